//! Rebuilding a replica of a mirrored namespace: copying to it what it lacks while
//! hosts write (see [`crate::backend::mirror`]).
//!
//! The mirror first takes the replica as a leg that catches up (`+remote:...`), so
//! every write from then on reaches it. A thread then copies, from this engine's own
//! replica, each cluster the replica lacks (those recorded as written at the
//! generation it left at or later, or every cluster), one at a time with the mirror's
//! copy window on it: writes to that cluster wait while it is read here and written
//! there, so no copy lands over a newer write. A cluster not allocated here is
//! deallocated there. Once every cluster is copied and flushed, the replica has every
//! write: the cluster may count it in sync again, and the namespace be served by a
//! mirror where it is a full leg. Like a migration, the copy runs off the reactors,
//! with blocking reads and the blocking initiator (`copy`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpool_api::RebuildInfo;

use crate::backend::Backend;
use crate::bufpool::Buf;
use crate::copy::{self, CopyJob, TargetQueue};
use crate::error::{Error, Result};
use crate::granules::granule_runs;
use crate::sync::lock;

/// The engine's rebuilds, by namespace (subsystem NQN and NSID).
#[derive(Default)]
pub struct Rebuilds {
    jobs: Mutex<HashMap<(String, u32), Arc<Job>>>,
}

type Job = CopyJob<RebuildInfo>;

/// What a rebuild works with: the mirror (as the namespace serves it) and a queue to
/// the replica.
pub(crate) struct Copy {
    /// The namespace's backend, a mirror whose first leg is this engine's volume.
    pub mirror: Arc<dyn Backend>,
    /// The mirror it replaced, which lacks the replica: its writes still under way
    /// reach the other legs only, so the copy starts once they are done.
    /// Let go of once drained.
    pub previous: Option<Arc<dyn Backend>>,
    /// The replica, as the mirror names the leg.
    pub leg: String,
    pub target: TargetQueue,
    /// The generation the replica left at (partial), or none (every cluster).
    pub since: Option<u64>,
    /// Bytes per second.
    pub rate: Option<u64>,
}

impl Rebuilds {
    /// A namespace's rebuild, or `none`.
    pub fn info(&self, nqn: &str, nsid: u32) -> RebuildInfo {
        match lock(&self.jobs).get(&(nqn.to_string(), nsid)) {
            Some(job) => lock(&job.info).clone(),
            None => RebuildInfo {
                leg: String::new(),
                state: "none".into(),
                error: String::new(),
                total_bytes: 0,
                copied_bytes: 0,
            },
        }
    }

    /// A namespace with a rebuild under way, if any (`NQN/NSID`).
    pub fn running(&self) -> Option<String> {
        lock(&self.jobs).iter().find(|(_, job)| job.alive()).map(|((nqn, nsid), _)| format!("{nqn}/{nsid}"))
    }

    /// Whether namespace `nsid` of `nqn` is being rebuilt.
    pub fn rebuilding(&self, nqn: &str, nsid: u32) -> bool {
        lock(&self.jobs).get(&(nqn.to_string(), nsid)).is_some_and(|j| j.alive())
    }

    /// Starts copying `copy` on a thread of its own.
    pub(crate) fn start(&self, nqn: &str, nsid: u32, copy: Copy) -> Result<RebuildInfo> {
        let info = RebuildInfo {
            leg: copy.leg.clone(),
            state: "copying".into(),
            error: String::new(),
            total_bytes: 0,
            copied_bytes: 0,
        };
        let job = Arc::new(Job::new(info.clone()));
        let worker = job.clone();
        let thread = std::thread::Builder::new()
            .name(format!("nvpool-rebuild-{nsid}"))
            .spawn(move || {
                let outcome = run(&worker, copy);
                worker.update(|i| match outcome {
                    Ok(()) => i.state = "done".into(),
                    Err(e) => {
                        i.state = "failed".into();
                        i.error = e.to_string();
                    }
                });
                let i = lock(&worker.info).clone();
                tracing::info!(leg = i.leg, state = i.state, error = i.error, copied = i.copied_bytes, "rebuild over");
            })
            .map_err(|e| Error::io("cannot start the rebuild thread", e))?;
        *lock(&job.thread) = Some(thread);
        lock(&self.jobs).insert((nqn.to_string(), nsid), job);
        Ok(info)
    }

    /// Stops every rebuild (the engine stops).
    pub fn stop_all(&self) {
        let jobs: Vec<Arc<Job>> = lock(&self.jobs).values().cloned().collect();
        copy::stop_all(jobs.iter().map(|j| &**j));
    }
}

/// Copies what the replica lacks, cluster by cluster, under the copy window.
fn run(job: &Job, mut copy: Copy) -> Result<()> {
    let mirror =
        copy.mirror.as_mirror().ok_or_else(|| Error::internal("a rebuild of a namespace that is no mirror"))?;
    let source = mirror.source().ok_or_else(|| Error::precondition("the mirror's first leg is not a volume"))?;
    let volume = &source.volume;
    let shift = volume.pool.cluster_shift();
    let (cluster, size) = (1u64 << shift, copy.mirror.size());
    // A new command takes the namespace's backend anew, so only those started before
    // the swap are on the mirror without the replica: the copy starts once they are
    // done, and the record is read only then (a write that waited for its cluster to
    // be allocated is recorded when it is written, and a record read before would
    // lack it, as a cluster copied before it landed would).
    if let Some(mirror) = copy.previous.take().as_deref().and_then(|p| p.as_mirror()) {
        mirror.drain();
    }
    // The record begins where this engine began serving the volume: a replica that
    // left before that (the engine restarted since) is copied in full.
    // Each cluster with the byte ranges in it to copy: the granules written since
    // (a partial rebuild), or all of it.
    let whole = |vc: u64| vec![(0, cluster.min(size - (vc << shift)))];
    let clusters: Vec<(u64, Vec<(u64, u64)>)> = match copy.since.filter(|&g| volume.map.records_since(g)) {
        Some(generation) => volume
            .map
            .written_since(generation)
            .into_iter()
            .map(|(vc, granules)| {
                let end = cluster.min(size - (vc << shift));
                let runs = granule_runs(&granules, shift);
                (vc, runs.into_iter().filter(|r| r.0 < end).map(|(at, n)| (at, n.min(end - at))).collect())
            })
            .collect(),
        None => (0..size.div_ceil(cluster)).map(|vc| (vc, whole(vc))).collect(),
    };
    // What the record gave, for a rebuild that comes out wrong to be traced.
    let partial = copy.since.filter(|&g| volume.map.records_since(g));
    tracing::info!(leg = copy.leg, ?partial, clusters = clusters.len(), "rebuild copies");
    job.update(|i| i.total_bytes = clusters.iter().flat_map(|(_, runs)| runs).map(|r| r.1).sum());
    let mut buf = Buf::new((cluster as usize).div_ceil(4096));
    let started = Instant::now();
    let mut sent = 0u64;
    for (vc, runs) in clusters {
        if job.cancelled() {
            return Err(Error::unavailable("cancelled: the engine stops"));
        }
        if mirror.catching_up(&copy.leg) != Some(true) {
            return Err(Error::unavailable(format!(
                "{} failed a write while it caught up, or the namespace no longer has it",
                copy.leg
            )));
        }
        mirror.hold_cluster(Some(vc));
        let copied = runs
            .iter()
            .try_for_each(|&(at, n)| copy::piece(volume, &mut buf, &mut copy.target, (vc << shift) + at, n))
            .and_then(|()| copy.target.settle());
        mirror.hold_cluster(None);
        copied?;
        sent += runs.iter().map(|r| r.1).sum::<u64>();
        job.update(|i| i.copied_bytes = sent);
        if let Some(rate) = copy.rate {
            let due = Duration::from_secs_f64(sent as f64 / rate as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    copy.target.flush()?;
    // From here a write that fails on the replica waits (as on any in-sync leg) until
    // the cluster serves the volume without it, so that none completes without it
    // between now and the mirror where it is a full leg.
    if !mirror.caught_up(&copy.leg) {
        return Err(Error::unavailable(format!("{} failed a write while it caught up", copy.leg)));
    }
    Ok(())
}

//! Moving a volume to another engine while hosts use it.
//!
//! The target is a volume of the same size and identity on the other engine, exported
//! to this engine's host NQN. A thread per migration copies over NVMe/TCP, engine to
//! engine, with no agent or controller in the data path:
//!
//! 1. The volume's [`Gate`] starts marking what commands change. The first round copies
//!    every allocated cluster (a thin volume's holes stay holes on the target).
//! 2. Each later round takes the marks (clearing them) and copies those ranges: what
//!    is allocated here is read and written there, what is not is deallocated there.
//!    The copy may be rate-limited, so hosts keep their speed.
//! 3. Once the switch is asked for and a round leaves little to copy, the gate holds
//!    new commands, the ones already on the volume finish, the rest is copied and the
//!    target flushed. A switch that would hold I/O longer than asked gives up before
//!    anything is decided: the gate opens and the rounds go on. Hosts that write
//!    faster than the copy would keep the rounds from shrinking: then the gate parks
//!    writes and this thread lets them through at a quarter of the copy rate, halved
//!    again each round that still leaves too much, which makes the rounds converge.
//! 4. The volume is deleted here: that is the point of no return, durable in this
//!    pool, so whoever asks after a crash can tell whether the switch happened. Then
//!    the held commands and all later ones go to the target, through the remote
//!    backend that now serves the namespace: hosts saw a pause, not an error.
//!
//! The copy runs on a thread of its own rather than on the reactors: it reads the
//! volume with blocking reads and writes the target through the blocking initiator,
//! and its pace (the rate limit) is its own, so the reactors' loop stays as it is.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpool_api::{MigrationInfo, MigrationState};

use crate::backend::gate::Gate;
use crate::backend::{Backend, OpenEnv, remote};
use crate::bufpool::Buf;
use crate::copy::{self, CopyJob, TargetQueue};
use crate::error::{Error, Result};
use crate::nvme::{Namespace, Subsystem};
use crate::pool::{Pool, VolumeIo};
use crate::pools::Pools;
use crate::sync::lock;

/// Pause a switch may take when none is given.
const DEFAULT_PAUSE: Duration = Duration::from_millis(100);
/// Rounds after the switch was asked for before one is tried whatever is left.
const ROUNDS_BEFORE_TRYING: u32 = 8;
/// How often an idle copy (nothing written since its last round) looks again.
const IDLE_WAIT: Duration = Duration::from_millis(20);
/// Shortest time from one round's start to the next's while no switch waits, so
/// that each round gathers the writes of a while rather than of a few microseconds.
const ROUND_SPACING: Duration = Duration::from_millis(100);
/// The least a throttle lets hosts write, in bytes per second.
const MIN_THROTTLE: u64 = 1 << 20;

/// The engine's migrations, by (pool, volume).
#[derive(Default)]
pub struct Migrations {
    jobs: Mutex<BTreeMap<(String, String), Arc<Job>>>,
}

/// One migration: what it reports and what it is asked.
struct Job {
    copy: CopyJob<MigrationInfo>,
    /// The longest pause allowed, once the switch was asked for.
    switch: Mutex<Option<Duration>>,
}

impl std::ops::Deref for Job {
    type Target = CopyJob<MigrationInfo>;

    fn deref(&self) -> &CopyJob<MigrationInfo> {
        &self.copy
    }
}

impl Job {
    fn running(&self) -> bool {
        matches!(lock(&self.info).state, MigrationState::Copying | MigrationState::Switching)
    }
}

/// Why a switch did not happen.
enum NoSwitch {
    /// The pause would have run over; nothing was decided.
    GaveUp,
    /// Cancelled while holding.
    Cancelled,
    /// The copy failed.
    Failed(Error),
}

/// What the copy thread works with.
struct Mover {
    pool: Arc<Pool>,
    volume: VolumeIo,
    name: String,
    size: u64,
    /// The namespace serving the volume, if it is exported, and its subsystem.
    export: Option<(Arc<Subsystem>, Arc<Namespace>)>,
    /// The target as a backend, which serves the namespace after the switch.
    forward: Arc<dyn Backend>,
    target: TargetQueue,
    rate: Option<u64>,
    buf: Buf,
    job: Arc<Job>,
    /// What the current round copies, as marked (before ranges are joined), and
    /// whether the round was found not to converge.
    marked: u64,
    judged: bool,
    /// Bytes per second hosts may write (0: not throttled), the bytes they may write
    /// now, and when that was last counted.
    throttle: u64,
    allowance: f64,
    paced_at: Instant,
}

fn none_info(volume_here: bool) -> MigrationInfo {
    MigrationInfo {
        id: String::new(),
        state: MigrationState::None,
        volume_here,
        target: String::new(),
        round: 0,
        copied_bytes: 0,
        dirty_bytes: 0,
        allocated_bytes: 0,
        rate: 0,
        round_bytes: Vec::new(),
        switch_requested: false,
        pause_us: None,
        pauses_given_up: 0,
        throttle: 0,
        error: None,
    }
}

impl Migrations {
    fn job(&self, pool: &str, name: &str) -> Option<Arc<Job>> {
        lock(&self.jobs).get(&(pool.to_string(), name.to_string())).cloned()
    }

    fn volume_here(pools: &Pools, pool: &str, name: &str) -> bool {
        pools.get(pool).is_ok_and(|p| p.open_volume(name).is_ok())
    }

    /// Starts moving volume `pool/name` of `pools` to `target` (`HOST:PORT/NQN/NSID`),
    /// which opens as a remote backend through `env`; `id` is the caller's name for
    /// this migration. An ended migration's record gives way.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        &self,
        pools: &Pools,
        env: &OpenEnv,
        pool: &str,
        name: &str,
        id: &str,
        target: &str,
        rate: Option<u64>,
    ) -> Result<MigrationInfo> {
        if let Some(job) = self.job(pool, name).filter(|j| j.running()) {
            return Err(Error::exists(format!(
                "volume {pool}/{name} is already moving to {}: `migration_status` shows how far it is",
                lock(&job.info).target
            )));
        }
        let p = pools.get(pool)?;
        let (volume, meta) = p.open_volume(name)?;
        if volume.map.parent().is_some() || volume.read_only {
            return Err(Error::precondition(format!(
                "volume {pool}/{name} is a snapshot or lies over one, and a move does not carry snapshots yet: it \
                 stays where it is"
            )));
        }
        let exports = pools.exports(&p, Some(volume.id));
        if exports.len() > 1 {
            return Err(Error::precondition(format!(
                "volume {pool}/{name} is exported {} times: remove all namespaces but one before moving it",
                exports.len()
            )));
        }
        if let Some((s, ns)) = exports.first().filter(|(_, ns)| ns.backend.as_mirror().is_some()) {
            return Err(Error::precondition(format!(
                "volume {pool}/{name} is one replica of namespace {} of {}, which mirrors it: moving a replica is \
                 not supported yet",
                ns.nsid, s.nqn
            )));
        }
        if let Some((s, ns)) = exports.first().filter(|(_, ns)| ns.reservations.in_use()) {
            return Err(Error::precondition(format!(
                "hosts are registered for reservations on namespace {} of {}: a move does not carry reservations \
                 yet, so it would drop them; unregister them first",
                ns.nsid, s.nqn
            )));
        }
        let (addr, nqn, nsid) = remote::parse(target).map_err(|e| Error::invalid(format!("target {target:?}: {e}")))?;
        let opened = crate::backend::open(&format!("remote:{target}"), env)?;
        if opened.identity != Some((meta.uuid, meta.nguid)) {
            return Err(Error::precondition(format!(
                "the target {target} is another namespace (its UUID or NGUID differ): create it with the volume's \
                 identity"
            )));
        }
        // Unexported, the volume has no block size of its own yet: it takes the target's
        // when it is exported there.
        let block = exports.first().map(|(_, ns)| ns.block_size());
        let required = opened.backend.required_block_size();
        if opened.backend.size() != meta.size {
            return Err(Error::precondition(format!(
                "the target {target} has {} bytes; the volume has {}: create it with the volume's size",
                opened.backend.size(),
                meta.size
            )));
        }
        if let (Some(block), Some(required)) = (block, required)
            && block != required
        {
            return Err(Error::precondition(format!(
                "the target {target} has {required}-byte blocks; the volume is exported with {block}-byte blocks"
            )));
        }
        let target_queue = TargetQueue::connect(remote::resolve(&addr)?, &nqn, nsid, env.host_nqn)
            .map_err(|e| Error::unavailable(format!("cannot reach the target {target}: {e}")))?;
        let mut info = none_info(true);
        info.id = id.to_string();
        info.state = MigrationState::Copying;
        info.target = target.to_string();
        info.allocated_bytes = volume.map.allocated() * p.cluster_size();
        let job = Arc::new(Job { copy: CopyJob::new(info.clone()), switch: Mutex::new(None) });
        let mover = Mover {
            buf: Buf::new((p.cluster_size() as usize).div_ceil(4096)),
            pool: p,
            volume,
            name: name.to_string(),
            size: meta.size,
            export: exports.into_iter().next(),
            forward: opened.backend,
            target: target_queue,
            rate,
            job: job.clone(),
            marked: 0,
            judged: false,
            throttle: 0,
            allowance: 0.0,
            paced_at: Instant::now(),
        };
        if let Some(gate) = mover.gate() {
            gate.track();
        }
        let thread = std::thread::Builder::new()
            .name(format!("nvpool-migrate-{name}"))
            .spawn(move || mover.run())
            .map_err(|e| Error::io("cannot start the migration thread", e))?;
        *lock(&job.thread) = Some(thread);
        lock(&self.jobs).insert((pool.to_string(), name.to_string()), job);
        tracing::info!(pool, volume = name, target, "migration started");
        Ok(info)
    }

    /// A migration's progress; `none` (and whether the volume is in `pools`) without
    /// one.
    pub fn info(&self, pools: &Pools, pool: &str, name: &str) -> MigrationInfo {
        let mut info = match self.job(pool, name) {
            Some(job) => lock(&job.info).clone(),
            None => none_info(false),
        };
        info.volume_here = Self::volume_here(pools, pool, name);
        info
    }

    /// Lets a migration switch once a round leaves little to copy.
    pub fn switch(&self, pools: &Pools, pool: &str, name: &str, pause: Option<Duration>) -> Result<MigrationInfo> {
        let job = self.running_job(pool, name)?;
        *lock(&job.switch) = Some(pause.unwrap_or(DEFAULT_PAUSE));
        job.update(|i| i.switch_requested = true);
        Ok(self.info(pools, pool, name))
    }

    /// Stops a migration that has not switched; waits for its thread.
    pub fn cancel(&self, pools: &Pools, pool: &str, name: &str) -> Result<MigrationInfo> {
        let job = match self.job(pool, name) {
            Some(job) if lock(&job.info).state == MigrationState::Switched => {
                return Err(Error::precondition(format!(
                    "volume {pool}/{name} has moved already: the switch cannot be undone"
                )));
            }
            Some(job) => job,
            None => return Ok(self.info(pools, pool, name)),
        };
        job.stop();
        Ok(self.info(pools, pool, name))
    }

    fn running_job(&self, pool: &str, name: &str) -> Result<Arc<Job>> {
        self.job(pool, name).filter(|j| j.running()).ok_or_else(|| {
            Error::not_found(format!("volume {pool}/{name} is not moving: start a migration with `migration_start`"))
        })
    }

    /// Whether volume `pool/name` is moving (copying or switching).
    pub fn moving(&self, pool: &str, name: &str) -> bool {
        self.job(pool, name).is_some_and(|j| j.running())
    }

    /// A volume whose migration is under way, as `POOL/NAME`, if any.
    pub fn running(&self) -> Option<String> {
        lock(&self.jobs).iter().find(|(_, job)| job.alive()).map(|((pool, name), _)| format!("{pool}/{name}"))
    }

    /// Cancels every running migration (the engine stops).
    pub fn stop_all(&self) {
        let jobs: Vec<Arc<Job>> = lock(&self.jobs).values().cloned().collect();
        copy::stop_all(jobs.iter().map(|j| &j.copy));
    }
}

impl Mover {
    fn gate(&self) -> Option<&Gate> {
        self.export.as_ref().and_then(|(_, ns)| ns.backend.as_volume()).map(|v| &v.gate)
    }

    fn cancelled(&self) -> bool {
        self.job.cancelled()
    }

    fn run(mut self) {
        let outcome = self.rounds();
        if let Some(gate) = self.gate() {
            gate.untrack();
            gate.throttle(false);
        }
        let (state, error) = match outcome {
            Ok(state) => (state, None),
            Err(e) => {
                tracing::warn!(volume = %self.name, "migration failed: {e}");
                (MigrationState::Failed, Some(e.to_string()))
            }
        };
        self.job.update(|i| {
            i.state = state;
            i.error = error;
        });
        if state == MigrationState::Switched {
            tracing::info!(volume = %self.name, pause_us = ?lock(&self.job.info).pause_us, "migration switched");
        }
    }

    /// Copies round after round until the switch, a cancel or an error.
    fn rounds(&mut self) -> Result<MigrationState> {
        let mut runs = self.allocated_runs();
        self.marked = runs.iter().map(|r| r.1).sum();
        let mut rounds_since_asked = 0;
        loop {
            if self.cancelled() {
                return Ok(MigrationState::Cancelled);
            }
            self.job.update(|i| i.round += 1);
            let started = Instant::now();
            let bytes: u64 = runs.iter().map(|r| r.1).sum();
            self.copy(&runs, true)?;
            self.target.settle()?;
            let secs = started.elapsed().as_secs_f64().max(1e-6);
            self.job.update(|i| {
                i.round_bytes.push(bytes);
                if bytes > 0 {
                    i.rate = (bytes as f64 / secs) as u64;
                }
            });
            // Wait for something to copy, or for the switch.
            loop {
                if self.cancelled() {
                    return Ok(MigrationState::Cancelled);
                }
                self.pace_writes();
                let dirty = self.gate().map_or(0, |g| g.dirty_bytes());
                self.job.update(|i| i.dirty_bytes = dirty);
                let pause = *lock(&self.job.switch);
                if let Some(pause) = pause {
                    let rate = lock(&self.job.info).rate.max(1);
                    let estimate = Duration::from_secs_f64(dirty as f64 / rate as f64);
                    if estimate <= pause / 2 || rounds_since_asked >= ROUNDS_BEFORE_TRYING {
                        match self.switch(pause) {
                            Ok(()) => return Ok(MigrationState::Switched),
                            Err(NoSwitch::Cancelled) => return Ok(MigrationState::Cancelled),
                            Err(NoSwitch::Failed(e)) => return Err(e),
                            Err(NoSwitch::GaveUp) => {
                                self.job.update(|i| i.pauses_given_up += 1);
                                rounds_since_asked = 0;
                            }
                        }
                    }
                }
                if dirty > 0 && (pause.is_some() || started.elapsed() >= ROUND_SPACING) {
                    if pause.is_some() {
                        rounds_since_asked += 1;
                    }
                    break;
                }
                // Held-back writes are let through every millisecond, not every 20.
                std::thread::sleep(if self.throttle > 0 { Duration::from_millis(1) } else { IDLE_WAIT });
            }
            self.marked = self.gate().map_or(0, |g| g.dirty_bytes());
            self.judged = false;
            runs = self.gate().map(|g| g.take_dirty()).unwrap_or_default();
        }
    }

    /// Holds hosts' writes back harder: a quarter of the copy rate at first, half the
    /// last throttle after.
    fn tighten(&mut self, copy_rate: u64) {
        if self.gate().is_none() {
            return;
        }
        self.throttle = if self.throttle == 0 { copy_rate / 4 } else { self.throttle / 2 }.max(MIN_THROTTLE);
        if let Some(gate) = self.gate() {
            gate.throttle(true);
        }
        self.paced_at = Instant::now();
        let throttle = self.throttle;
        self.job.update(|i| i.throttle = throttle);
        tracing::info!(volume = %self.name, "hosts' writes held back to {throttle} bytes/s so the rounds shrink");
    }

    /// Holds hosts' writes back when the round cannot converge, once the switch
    /// waits: it has left more than half of what it had to copy (hosts write about as
    /// fast as the copy goes). Judged once a round, as soon as that shows. Then lets
    /// parked writes through at the throttle's rate.
    fn pace_writes(&mut self) {
        if !self.judged && lock(&self.job.switch).is_some() {
            let left = self.gate().map_or(0, |g| g.dirty_bytes());
            if left * 2 > self.marked {
                self.judged = true;
                let rate = lock(&self.job.info).rate.max(1);
                self.tighten(rate);
            }
        }
        if self.throttle == 0 {
            return;
        }
        let now = Instant::now();
        let earned = self.throttle as f64 * (now - self.paced_at).as_secs_f64();
        self.paced_at = now;
        // At most a tenth of a second's worth waits unused: a burst stays a burst.
        self.allowance = (self.allowance + earned).min(self.throttle as f64 / 10.0);
        if let Some(gate) = self.gate() {
            let passed = gate.let_writes_through(self.allowance as u64);
            self.allowance -= passed as f64;
        }
    }

    /// The allocated clusters, as joined (offset, length) ranges.
    fn allocated_runs(&self) -> Vec<(u64, u64)> {
        let cs = self.pool.cluster_size();
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for vc in 0..self.volume.map.clusters() {
            if self.volume.map.get(vc) == 0 {
                continue;
            }
            let offset = vc * cs;
            let len = cs.min(self.size - offset);
            match runs.last_mut() {
                Some((start, l)) if *start + *l == offset => *l += len,
                _ => runs.push((offset, len)),
            }
        }
        runs
    }

    /// Copies `runs` to the target: what is allocated here is written there, what is
    /// not is deallocated there. `paced` applies the rate limit.
    fn copy(&mut self, runs: &[(u64, u64)], paced: bool) -> Result<()> {
        let cs = self.pool.cluster_size();
        let started = Instant::now();
        let mut sent = 0u64;
        for &(offset, len) in runs {
            let end = (offset + len).min(self.size);
            let mut at = offset;
            while at < end {
                if self.cancelled() {
                    return Ok(());
                }
                self.pace_writes();
                let within = at & (cs - 1);
                let n = (cs - within).min(end - at);
                copy::piece(&self.volume, &mut self.buf, &mut self.target, at, n)?;
                at += n;
                sent += n;
                self.job.update(|i| i.copied_bytes += n);
                if let Some(rate) = self.rate.filter(|_| paced) {
                    let due = Duration::from_secs_f64(sent as f64 / rate as f64);
                    if let Some(wait) = due.checked_sub(started.elapsed()) {
                        std::thread::sleep(wait);
                    }
                }
            }
        }
        Ok(())
    }

    /// Holds hosts' I/O, copies the rest, and moves the volume, within `pause`.
    fn switch(&mut self, pause: Duration) -> std::result::Result<(), NoSwitch> {
        self.job.update(|i| i.state = MigrationState::Switching);
        let held = Instant::now();
        let back = |me: &mut Mover, why: NoSwitch| {
            if let Some(gate) = me.gate() {
                gate.open();
            }
            me.job.update(|i| i.state = MigrationState::Copying);
            Err(why)
        };
        if let Some(gate) = self.gate() {
            gate.hold();
            while !gate.drained() {
                if held.elapsed() > pause {
                    return back(self, NoSwitch::GaveUp);
                }
                std::thread::sleep(Duration::from_micros(20));
            }
        }
        let runs = self.gate().map(|g| g.take_dirty()).unwrap_or_default();
        if let Err(e) = self.copy(&runs, false).and_then(|()| self.target.flush()) {
            return back(self, NoSwitch::Failed(e));
        }
        if self.cancelled() {
            return back(self, NoSwitch::Cancelled);
        }
        if held.elapsed() > pause {
            return back(self, NoSwitch::GaveUp);
        }
        // The point of no return: the volume is gone from this pool, durably.
        if let Err(e) = self.pool.delete_volume(&self.name) {
            return back(self, NoSwitch::Failed(e));
        }
        if let Some((subsystem, ns)) = &self.export {
            if let Some(gate) = ns.backend.as_volume().map(|v| &v.gate) {
                gate.forward(self.forward.clone());
            }
            // Later commands skip the gate. The namespace was found by this volume, so
            // it is there unless removed meanwhile, and then there is nothing to serve.
            let _ = subsystem.swap_backend(ns.nsid, self.forward.clone());
        }
        let pause_us = held.elapsed().as_micros() as u64;
        self.job.update(|i| {
            i.pause_us = Some(pause_us);
            i.dirty_bytes = 0;
            i.round += 1;
            i.round_bytes.push(runs.iter().map(|r| r.1).sum());
        });
        Ok(())
    }
}

//! `mirror:LEG LEG ...`: a replicated volume as its serving engine sees it. Each leg
//! is a replica: the engine's own (`volume:POOL/NAME`) and the others' (`remote:`, an
//! engine-to-engine queue on the same reactor). Every command that changes data
//! (Write, Write Zeroes, Deallocate) and every Flush goes to every leg and completes
//! when all have it; a read goes to the first leg alone (the local replica comes
//! first), or to the first leg that has not failed. A leg marked `+` catches up (a
//! rebuild copies to it what it lacks): it gets every write, but serves no read, and a
//! write that fails there still completes, since the cluster does not count it yet.
//! While the rebuild copies a cluster, writes to that cluster wait ([`window`]).
//!
//! With `generation=G` before its legs, the mirror serves at generation G of the
//! volume: it opens the other engines' replicas under reservation key G and holds
//! each one's Write Exclusive reservation (see [`super::remote`]), so that an engine
//! serving an older generation can no longer write to them.
//!
//! A leg that fails a command leaves the mirror for good (it is *faulted*): later
//! commands skip it. A write that did not reach every leg is held, completed on the
//! others but not answered, until the namespace is served by another backend: the
//! new one (a mirror of the legs left, after the controller recorded the smaller
//! in-sync set) lets the held writes complete; any other ends them with a path error,
//! so the host writes them again. So a write never completes to a host while a
//! replica the cluster still counts as in sync lacks it.
//!
//! The fan-out runs on the reactor: a ring client per reactor and mirror
//! ([`fanout`]) issues the legs' commands as any issuer does, so a remote leg's
//! command is on its way while the local leg's write is on the disk.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use nvpool_wire::Status;

use super::{Backend, BackendType, BlockIo, DiskQueue, Handover, OpenEnv, Opened};
use crate::error::{Error, Result};
use crate::plan::IoPlan;
use crate::sync::lock;

mod fanout;
mod window;

use window::CopyWindow;

/// The kind.
pub const TYPE: BackendType = BackendType { name: "mirror", usage: "mirror:LEG LEG ...", check, open };

/// Most legs a mirror has: a volume has at most three replicas.
pub const MAX_LEGS: usize = 3;

/// The route of a command the mirror handed to its fan-out (`BlockIo::route`); a read
/// served by the first leg directly carries that leg's route.
const ROUTE_FANNED_OUT: u8 = u8::MAX;

/// A `mirror:` argument: the generation it serves at, if given (`generation=G` before
/// the legs), and the legs.
fn parse(arg: &str) -> std::result::Result<(Option<u64>, Vec<&str>), String> {
    let mut words = arg.split(' ').filter(|w| !w.is_empty()).peekable();
    let generation = match words.peek().and_then(|w| w.strip_prefix("generation=")) {
        Some(g) => {
            let g = match g.parse::<u64>() {
                Ok(g) if g > 0 => g,
                _ => return Err(format!("generation {g:?} is not a number above 0")),
            };
            words.next();
            Some(g)
        }
        None => None,
    };
    let legs: Vec<&str> = words.collect();
    if legs.is_empty() || legs.len() > MAX_LEGS {
        return Err(format!("a mirror has 1 to {MAX_LEGS} legs, separated by spaces; this one has {}", legs.len()));
    }
    Ok((generation, legs))
}

fn check(arg: &str) -> std::result::Result<(), String> {
    let legs = parse(arg)?.1;
    if legs[0].starts_with(CATCHING_UP) {
        return Err("the first leg serves reads: it cannot be one that catches up".into());
    }
    for leg in legs {
        let leg = leg.trim_start_matches(CATCHING_UP);
        match leg.split_once(':').map(|(kind, _)| kind) {
            Some("mirror") => return Err("a mirror's leg cannot be a mirror".into()),
            Some("memory" | "null") => {
                return Err(format!("leg {leg:?} keeps nothing: a replica is a volume, a file or a remote namespace"));
            }
            _ => super::check(leg)?,
        }
    }
    Ok(())
}

fn open(arg: &str, env: &OpenEnv<'_>) -> Result<Opened> {
    let (generation, legs) = parse(arg).map_err(Error::invalid)?;
    // The other engines' replicas are opened under the generation's reservation key.
    let env = OpenEnv { own_listeners: env.own_listeners.clone(), fence: generation, ..*env };
    let mut opened = Vec::new();
    for &leg in &legs {
        opened.push(super::open(leg.trim_start_matches(CATCHING_UP), &env)?);
    }
    let identity = opened.iter().find_map(|o| o.identity);
    if let Some(o) = opened.iter().find(|o| o.identity.is_some_and(|id| Some(id) != identity)) {
        return Err(Error::invalid(format!(
            "leg {} is another namespace than the first (its UUID or NGUID differ): replicas share one identity",
            o.backend.description()
        )));
    }
    let size = opened[0].backend.size();
    if let Some(o) = opened.iter().find(|o| o.backend.size() < size) {
        return Err(Error::invalid(format!(
            "leg {} has {} bytes, fewer than the first leg's {size}",
            o.backend.description(),
            o.backend.size()
        )));
    }
    let block_sizes: Vec<u32> = opened.iter().filter_map(|o| o.backend.required_block_size()).collect();
    if block_sizes.windows(2).any(|w| w[0] != w[1]) {
        return Err(Error::invalid(format!("the legs' block sizes differ ({block_sizes:?}): replicas share one")));
    }
    let legs: Vec<Leg> = opened
        .into_iter()
        .zip(&legs)
        .map(|(o, spec)| Leg {
            backend: o.backend,
            catching_up: spec.starts_with(CATCHING_UP),
            caught_up: AtomicBool::new(false),
            faulted: AtomicBool::new(false),
        })
        .collect();
    let window = CopyWindow::new(copy_cluster_shift(&legs));
    let mirror = Arc::new(Mirror {
        key: crate::ring::new_client_key(),
        window,
        generation,
        legs,
        size,
        next_legs: OnceLock::new(),
        closed: AtomicBool::new(false),
        faults: Mutex::new(Vec::new()),
        fenced: AtomicBool::new(false),
    });
    Ok(Opened { backend: Arc::new(MirrorBackend(mirror)), identity })
}

/// One replica of the mirror.
struct Leg {
    backend: Arc<dyn Backend>,
    /// A replica that is not in sync yet: it gets every write, so that it misses
    /// none while a rebuild copies what it lacks, but no read, and a write that fails
    /// on it still completes (the cluster does not count it).
    catching_up: bool,
    /// Set when its rebuild is done: from then on it counts as in sync (a write that
    /// fails on it waits, as on any in-sync leg), although its spec keeps the `+`
    /// until the cluster records it in sync and serves a mirror where it is a full leg.
    caught_up: AtomicBool,
    /// Set once, when a command failed on it: no command goes to it any more.
    faulted: AtomicBool,
}

impl Leg {
    /// Its spec as the mirror's spec names it (`+` before one that catches up).
    fn spec(&self) -> String {
        let spec = self.backend.description();
        if self.catching_up { format!("{CATCHING_UP}{spec}") } else { spec }
    }
}

/// The clusters a rebuild copies, one at a time: the first leg's volume's (1 MiB when
/// the first leg is not a volume, which no rebuild copies from).
fn copy_cluster_shift(legs: &[Leg]) -> u32 {
    legs[0].backend.as_volume().map_or(20, |v| v.volume.pool.cluster_shift())
}

/// What the backend and its fan-outs (one per reactor) share.
pub(super) struct Mirror {
    /// The fan-outs' key as ring clients.
    key: u64,
    /// The cluster a rebuild copies now, which writes wait for.
    window: CopyWindow,
    /// The generation it serves at: the key of its reservations on the other
    /// engines' replicas.
    generation: Option<u64>,
    legs: Vec<Leg>,
    size: u64,
    /// Once the namespace is served by another backend: that backend's legs (a
    /// mirror's, or the one it is), or `None` if nothing serves it any more.
    next_legs: OnceLock<Option<Vec<String>>>,
    /// Set when the backend is gone: the fan-outs leave their rings once idle.
    closed: AtomicBool,
    /// The faulted legs and why, in the order they failed.
    faults: Mutex<Vec<(String, Status)>>,
    /// Set when a leg answered Reservation Conflict: another engine serves the volume
    /// at a later generation, so no write of this mirror may complete any more.
    fenced: AtomicBool,
}

impl Mirror {
    /// Whether leg `i` still takes commands.
    fn healthy(&self, i: usize) -> bool {
        !self.legs[i].faulted.load(Ordering::Acquire)
    }

    /// Whether leg `i` counts: in sync, so that a write missing it must wait.
    /// (Sequentially consistent with `caught_up`: see `MirrorBackend::caught_up`.)
    fn in_sync(&self, i: usize) -> bool {
        !self.legs[i].catching_up || self.legs[i].caught_up.load(Ordering::SeqCst)
    }

    /// Whether another backend serves the namespace now.
    fn is_retired(&self) -> bool {
        self.next_legs.get().is_some()
    }

    /// Whether another engine took the volume over (see `fenced`).
    fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::Acquire)
    }

    /// Takes leg `i` out for good after it answered `status`.
    fn fault(&self, i: usize, status: Status) {
        if status.base() == Status::RESERVATION_CONFLICT && !self.fenced.swap(true, Ordering::AcqRel) {
            tracing::warn!("a replica refused this engine's write: another engine serves the volume now");
        }
        // Sequentially consistent, before the fan-out asks whether the leg counts
        // (`in_sync`): see `MirrorBackend::caught_up`.
        if !self.legs[i].faulted.swap(true, Ordering::SeqCst) {
            let leg = self.legs[i].backend.description();
            tracing::warn!(
                leg,
                ?status,
                "a replica failed a command and leaves the mirror; writes wait until the volume is served without it"
            );
            lock(&self.faults).push((leg, status));
        }
    }

    /// The outcome of a held write that missed the legs in `missed` (a bit per leg),
    /// once the mirror is retired; `None` while it serves. It completes if the next
    /// backend serves the same data from here (a mirror, or the volume alone) and has
    /// none of those legs (the cluster no longer counts them), and ends with a path
    /// error otherwise, so that the host writes it again. A fenced mirror completes
    /// none: the engine that took over may count the legs it missed.
    fn held_outcome(&self, missed: u8) -> Option<Status> {
        if self.is_fenced() {
            return Some(Status::ANA_INACCESSIBLE);
        }
        let next = self.next_legs.get()?;
        let counted = |i: usize| next.as_ref().is_none_or(|n| n.contains(&self.legs[i].backend.description()));
        let complete = next.is_some() && !(0..self.legs.len()).any(|i| missed & 1 << i != 0 && counted(i));
        Some(if complete { Status::SUCCESS } else { Status::ANA_INACCESSIBLE })
    }
}

/// A replicated namespace's backend.
pub struct MirrorBackend(Arc<Mirror>);

/// Marks a leg that catches up (`+remote:...`).
const CATCHING_UP: char = '+';

impl std::fmt::Debug for MirrorBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MirrorBackend").field("legs", &self.description()).finish_non_exhaustive()
    }
}

impl Drop for MirrorBackend {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
    }
}

impl MirrorBackend {
    fn first(&self) -> &Arc<dyn Backend> {
        &self.0.legs[0].backend
    }

    /// The faulted legs (their specs) and the status each failed with.
    pub fn faults(&self) -> Vec<(String, Status)> {
        lock(&self.0.faults).clone()
    }

    /// The generation it serves at, if given.
    pub fn generation(&self) -> Option<u64> {
        self.0.generation
    }

    /// Whether a leg catches up (a rebuild copies to it).
    pub fn has_catching_up(&self) -> bool {
        self.0.legs.iter().any(|l| l.catching_up)
    }

    /// How many legs are in sync, catching up, and faulted.
    pub fn leg_counts(&self) -> [u64; 3] {
        let legs = &self.0.legs;
        let faulted = (0..legs.len()).filter(|&i| !self.0.healthy(i)).count();
        let catching_up = (0..legs.len()).filter(|&i| self.0.healthy(i) && legs[i].catching_up).count();
        [legs.len() - faulted - catching_up, catching_up, faulted].map(|n| n as u64)
    }

    /// The first leg's volume: the serving engine's own replica, which a rebuild
    /// copies from.
    pub fn source(&self) -> Option<&super::volume::VolumeBackend> {
        self.first().as_volume()
    }

    /// Whether the leg `spec` names is one that catches up and has not failed.
    pub fn catching_up(&self, spec: &str) -> Option<bool> {
        let leg = self.0.legs.iter().find(|l| l.catching_up && l.backend.description() == spec)?;
        Some(!leg.faulted.load(Ordering::Acquire))
    }

    /// Makes the leg `spec` names, which a rebuild caught up, count as in sync; false
    /// if it failed a write meanwhile (that write completed without it). One of the
    /// two sides sees the other: the fan-out marks a leg faulted before it asks
    /// whether the leg counts, and this marks it counted before it asks whether it
    /// faulted.
    pub fn caught_up(&self, spec: &str) -> bool {
        let Some(leg) = self.0.legs.iter().find(|l| l.catching_up && l.backend.description() == spec) else {
            return false;
        };
        leg.caught_up.store(true, Ordering::SeqCst);
        !leg.faulted.load(Ordering::SeqCst)
    }

    /// Waits for the writes under way to finish (a mirror that serves no more: its
    /// commands already started go on on it).
    pub fn drain(&self) {
        self.0.window.drain();
    }

    /// Makes writes to cluster `vc` wait, and waits for those under way, so that a
    /// rebuild copies the cluster while nobody changes it; `None` ends that.
    pub fn hold_cluster(&self, vc: Option<u64>) {
        self.0.window.hold(vc);
    }

    /// Makes every write wait and waits (at most `limit`) for those under way
    /// (`true`), so that each replica can take a snapshot at the same point in the
    /// write order; `false` lets them go on. Refused while a leg catches up (the window is the rebuild's
    /// then) or has failed (the in-sync set is about to change).
    pub fn hold_writes(&self, on: bool, limit: Duration) -> Result<()> {
        if on && self.0.legs.iter().enumerate().any(|(i, l)| l.catching_up || !self.0.healthy(i)) {
            return Err(Error::unavailable(
                "a replica of the volume catches up or has failed: a snapshot is taken once every replica is in \
                 sync; retry then",
            ));
        }
        if !self.0.window.hold_all(on, limit) {
            return Err(Error::unavailable(format!(
                "the volume's writes under way did not finish within {limit:?}: no snapshot was taken; retry"
            )));
        }
        Ok(())
    }

    /// Whether every write waits (`hold_writes`).
    pub fn writes_held(&self) -> bool {
        self.0.window.all_held()
    }
}

/// Whether a command changes data or asks for durability: it goes to every leg.
fn fans_out(plan: &IoPlan) -> bool {
    !matches!(plan, IoPlan::Read { .. } | IoPlan::DatasetManagement { deallocate: false, .. })
}

impl Backend for MirrorBackend {
    fn kind(&self) -> &'static str {
        "mirror"
    }

    fn size(&self) -> u64 {
        self.0.size
    }

    fn description(&self) -> String {
        let legs: Vec<String> = self.0.legs.iter().map(Leg::spec).collect();
        match self.0.generation {
            Some(g) => format!("mirror:generation={g} {}", legs.join(" ")),
            None => format!("mirror:{}", legs.join(" ")),
        }
    }

    /// Every leg opens again from its spec (no leg keeps its data in memory).
    fn handover(&self) -> Handover<'_> {
        Handover::Spec(self.description())
    }

    fn direct_io(&self) -> bool {
        self.first().direct_io()
    }

    fn power_fail_atomic_bytes(&self) -> u32 {
        self.0.legs.iter().map(|l| l.backend.power_fail_atomic_bytes()).min().unwrap_or(512)
    }

    fn required_block_size(&self) -> Option<u32> {
        self.0.legs.iter().find_map(|l| l.backend.required_block_size())
    }

    fn deallocated_reads_zeroes(&self) -> bool {
        self.0.legs.iter().all(|l| l.backend.deallocated_reads_zeroes())
    }

    fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        if !fans_out(&io.plan) && self.0.healthy(0) {
            return self.first().start(io, queue);
        }
        io.route = ROUTE_FANNED_OUT;
        let mirror = &self.0;
        queue.hand_to(io, mirror.key, 0, || Box::new(fanout::Fanout::new(mirror.clone())));
    }

    fn resume(&self, io: &mut BlockIo, status: Status, queue: &mut DiskQueue<'_>) {
        if io.route == ROUTE_FANNED_OUT {
            io.status = status;
        } else {
            self.first().resume(io, status, queue);
        }
    }

    fn settle(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        if io.route != ROUTE_FANNED_OUT {
            self.first().settle(io, queue);
        }
    }

    fn finished(&self, io: &mut BlockIo, reactor: usize) {
        if io.route != ROUTE_FANNED_OUT {
            self.first().finished(io, reactor);
        }
    }

    /// The volume of the engine's own replica (the first leg), so that the pool
    /// knows it is exported.
    fn as_volume(&self) -> Option<&super::volume::VolumeBackend> {
        self.first().as_volume()
    }

    fn as_mirror(&self) -> Option<&MirrorBackend> {
        Some(self)
    }

    fn retired(&self, next: Option<&dyn Backend>) {
        // A backend that does not serve the data from here (one that forwards to
        // another engine) counts as nothing: the held writes end with a path error.
        let next_legs = next.and_then(|b| {
            let spec = b.description();
            match spec.strip_prefix("mirror:").map(parse) {
                Some(Ok((_, legs))) => {
                    Some(legs.into_iter().map(|l| l.trim_start_matches(CATCHING_UP).to_string()).collect())
                }
                _ if b.as_volume().is_some() => Some(vec![spec]),
                _ => None,
            }
        });
        let _ = self.0.next_legs.set(next_legs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_names_one_to_three_replicas_that_keep_data() {
        assert!(check("volume:fast/db").is_ok());
        assert!(check("volume:fast/db remote:10.0.0.2:4420/nqn.2024-01.io.nvpool:r/1").is_ok());
        assert!(check("").unwrap_err().contains("1 to 3 legs"));
        assert!(check("volume:a/b volume:a/c volume:a/d volume:a/e").unwrap_err().contains("1 to 3 legs"));
        assert!(check("volume:a/b mirror:volume:a/c").unwrap_err().contains("cannot be a mirror"));
        assert!(check("memory:1GiB").unwrap_err().contains("keeps nothing"));
        assert!(check("volume:a").unwrap_err().contains("POOL/NAME"));
        assert_eq!(parse("generation=7 volume:a/b").unwrap(), (Some(7), vec!["volume:a/b"]));
        assert!(check("generation=0 volume:a/b").unwrap_err().contains("above 0"));
        assert!(check("generation=7").unwrap_err().contains("1 to 3 legs"));
        assert!(check("volume:a/b +volume:a/c").is_ok());
        assert!(check("+volume:a/b volume:a/c").unwrap_err().contains("first leg"));
    }

    #[test]
    fn only_data_changes_and_flushes_go_to_every_leg() {
        assert!(!fans_out(&IoPlan::Read { offset: 0, len: 4096 }));
        assert!(fans_out(&IoPlan::Write { offset: 0, len: 4096, fua: false }));
        assert!(fans_out(&IoPlan::Flush));
        assert!(fans_out(&IoPlan::WriteZeroes { offset: 0, len: 4096 }));
        assert!(fans_out(&IoPlan::DatasetManagement { ranges: 1, deallocate: true, block_shift: 9 }));
        assert!(!fans_out(&IoPlan::DatasetManagement { ranges: 1, deallocate: false, block_shift: 9 }));
    }
}

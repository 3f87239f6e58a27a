//! The gate every command to a volume passes, which a migration (see
//! [`crate::migration`]) uses to move the volume to another engine under running hosts.
//!
//! Open, the gate counts the commands it lets through (one counter per reactor, so no
//! cache line is shared between cores) and, while a migration copies, marks the
//! granules each write, zeroing or deallocation touched once it has completed: a
//! granule marked after a round read it is copied again by the next round, and one
//! completed before the round read it was copied with it. Throttled, it parks the
//! writes and the migration lets them through at a rate below its copy rate, so the
//! rounds shrink however hard hosts write. Holding, the gate parks every new command
//! (deferred, buffers kept) while those already through finish, so the last round
//! copies a volume nobody changes. Then it either opens again (the switch gave up) or
//! forwards every parked and later command to the volume's new place.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use nvpool_wire::Status;

use super::{Backend, BlockIo, DiskQueue, deallocated_ranges};
use crate::plan::IoPlan;
use crate::pool::Done;
use crate::sync::lock;

/// Counters per reactor; reactors past this many share them (atomically, so soundly).
const COUNTERS: usize = 64;
/// The smallest granule the dirty map tracks: the Linux host's usual write unit.
const MIN_GRANULE_SHIFT: u32 = 12;
/// Most granules a dirty map has (16 MiB of bits); larger volumes get larger granules.
const MAX_GRANULES: u64 = 1 << 27;
/// Dirty ranges closer than this are copied as one.
const JOIN_GAP: u64 = 32 << 10;

/// How commands pass.
const OPEN: u8 = 0;
const HOLDING: u8 = 1;
const FORWARDING: u8 = 2;

/// Where the gate sent a command (`BlockIo::route`); 0 is a command it has not seen.
pub(super) const ROUTE_HERE: u8 = 1;
const ROUTE_PARKED: u8 = 2;
const ROUTE_FORWARDED: u8 = 3;
/// Parked, then let go: it passes the gate once more, but no throttle parks it again.
const ROUTE_RELEASED: u8 = 4;

/// What became of a command at the gate.
pub(super) enum Admitted {
    /// Served here: the backend goes on with it.
    Here,
    /// Parked or forwarded: the gate has it.
    Elsewhere,
}

/// A counter alone on its cache line.
#[derive(Default)]
#[repr(align(64))]
struct Counter(AtomicU64);

/// The gate of one volume namespace.
pub struct Gate {
    mode: AtomicU8,
    passed: Box<[Counter]>,
    /// Parked commands, oldest first, with the bytes each writes (0 for others).
    parked: Mutex<VecDeque<(u64, Done)>>,
    /// Whether writes park until the migration lets them through.
    throttled: AtomicBool,
    /// Where commands go once the gate forwards.
    target: Mutex<Option<Arc<dyn Backend>>>,
    tracking: AtomicBool,
    dirty: OnceLock<DirtyMap>,
    size: u64,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate").field("mode", &self.mode).finish_non_exhaustive()
    }
}

impl Gate {
    /// An open gate for a volume of `size` bytes.
    pub fn new(size: u64) -> Gate {
        Gate {
            mode: AtomicU8::new(OPEN),
            passed: (0..COUNTERS).map(|_| Counter::default()).collect(),
            parked: Mutex::new(VecDeque::new()),
            throttled: AtomicBool::new(false),
            target: Mutex::new(None),
            tracking: AtomicBool::new(false),
            dirty: OnceLock::new(),
            size,
        }
    }

    fn counter(&self, reactor: usize) -> &AtomicU64 {
        &self.passed[reactor % COUNTERS].0
    }

    /// Lets a new command through, parks it, or forwards it.
    pub(super) fn admit(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) -> Admitted {
        let reactor = queue.reactor_id();
        let written = written_bytes(io);
        loop {
            match self.mode.load(Ordering::SeqCst) {
                OPEN if written > 0 && io.route != ROUTE_RELEASED && self.throttled.load(Ordering::Relaxed) => {
                    let mut parked = lock(&self.parked);
                    if self.mode.load(Ordering::SeqCst) == OPEN && self.throttled.load(Ordering::SeqCst) {
                        io.route = ROUTE_PARKED;
                        parked.push_back((written, queue.defer(io)));
                        return Admitted::Elsewhere;
                    }
                }
                OPEN => {
                    // Counted before the mode is checked again, so a switch that set
                    // HOLDING either sees this count or this command sees HOLDING.
                    self.counter(reactor).fetch_add(1, Ordering::SeqCst);
                    if self.mode.load(Ordering::SeqCst) == OPEN {
                        io.route = ROUTE_HERE;
                        return Admitted::Here;
                    }
                    self.counter(reactor).fetch_sub(1, Ordering::SeqCst);
                }
                HOLDING => {
                    let mut parked = lock(&self.parked);
                    // The mode leaves HOLDING only under this lock, so nothing parks
                    // after the parked commands were released.
                    if self.mode.load(Ordering::SeqCst) == HOLDING {
                        io.route = ROUTE_PARKED;
                        parked.push_back((written, queue.defer(io)));
                        return Admitted::Elsewhere;
                    }
                }
                _ => {
                    let target = lock(&self.target).clone();
                    if let Some(t) = target {
                        io.route = ROUTE_FORWARDED;
                        t.start(io, queue);
                        return Admitted::Elsewhere;
                    }
                    // Forwarding without a target cannot happen (see `forward`); serve
                    // the command here rather than lose it.
                    io.route = ROUTE_HERE;
                    self.counter(reactor).fetch_add(1, Ordering::SeqCst);
                    return Admitted::Here;
                }
            }
        }
    }

    /// Continues a command the gate parked or forwarded; false for one served here
    /// and one released (which is to pass the gate again).
    pub(super) fn resume(&self, io: &mut BlockIo, status: Status, queue: &mut DiskQueue<'_>) -> bool {
        match io.route {
            ROUTE_PARKED if status.is_success() => {
                io.route = ROUTE_RELEASED;
                false
            }
            ROUTE_PARKED => {
                io.status = status;
                true
            }
            ROUTE_FORWARDED => {
                if let Some(t) = lock(&self.target).clone() {
                    t.resume(io, status, queue);
                }
                true
            }
            _ => false,
        }
    }

    /// A command is done: one served here is uncounted, and marks what it changed.
    pub(super) fn finished(&self, io: &mut BlockIo, reactor: usize) {
        match io.route {
            ROUTE_HERE => {
                if self.tracking.load(Ordering::SeqCst)
                    && let Some(dirty) = self.dirty.get()
                {
                    dirty.mark_command(io);
                }
                self.counter(reactor).fetch_sub(1, Ordering::SeqCst);
            }
            ROUTE_FORWARDED => {
                if let Some(t) = lock(&self.target).clone() {
                    t.finished(io, reactor);
                }
            }
            _ => {}
        }
    }

    // ----- the migration's side --------------------------------------------------------

    /// Starts marking what commands change, from an empty map.
    pub fn track(&self) {
        self.dirty.get_or_init(|| DirtyMap::new(self.size)).take();
        self.tracking.store(true, Ordering::SeqCst);
    }

    /// Bytes marked since the last take.
    pub fn dirty_bytes(&self) -> u64 {
        self.dirty.get().map_or(0, DirtyMap::bytes)
    }

    /// The marked ranges, cleared (see [`DirtyMap::take`]).
    pub fn take_dirty(&self) -> Vec<(u64, u64)> {
        self.dirty.get().map(DirtyMap::take).unwrap_or_default()
    }

    /// Stops marking.
    pub fn untrack(&self) {
        self.tracking.store(false, Ordering::SeqCst);
    }

    /// Whether a migration uses the gate (marking, holding or forwarding).
    pub fn busy(&self) -> bool {
        self.tracking.load(Ordering::SeqCst) || self.mode.load(Ordering::SeqCst) != OPEN
    }

    /// Parks writes from now on, or stops doing so (and lets the parked ones go).
    pub fn throttle(&self, on: bool) {
        self.throttled.store(on, Ordering::SeqCst);
        if !on && self.mode.load(Ordering::SeqCst) == OPEN {
            self.release(OPEN);
        }
    }

    /// Lets parked writes through, oldest first, up to `budget` bytes (at least one
    /// if any waits and the budget is not empty); returns the bytes let through.
    pub fn let_writes_through(&self, budget: u64) -> u64 {
        let mut released = Vec::new();
        let mut bytes = 0;
        {
            let mut parked = lock(&self.parked);
            if self.mode.load(Ordering::SeqCst) != OPEN {
                return 0;
            }
            while let Some(&(n, _)) = parked.front() {
                if budget == 0 || (bytes > 0 && bytes + n > budget) {
                    break;
                }
                bytes += n;
                released.extend(parked.pop_front().map(|(_, resume)| resume));
            }
        }
        for resume in released {
            resume(Status::SUCCESS);
        }
        bytes
    }

    /// Parks every new command.
    pub fn hold(&self) {
        self.mode.store(HOLDING, Ordering::SeqCst);
    }

    /// Whether no command is on the volume (all through the gate have finished).
    pub fn drained(&self) -> bool {
        self.passed.iter().all(|c| c.0.load(Ordering::SeqCst) == 0)
    }

    /// Opens the gate again: parked commands are served here.
    pub fn open(&self) {
        self.release(OPEN);
    }

    /// From now on every command goes to `target`, the parked ones first.
    pub fn forward(&self, target: Arc<dyn Backend>) {
        *lock(&self.target) = Some(target);
        self.release(FORWARDING);
    }

    fn release(&self, mode: u8) {
        let parked = {
            let mut parked = lock(&self.parked);
            self.mode.store(mode, Ordering::SeqCst);
            std::mem::take(&mut *parked)
        };
        for (_, resume) in parked {
            resume(Status::SUCCESS);
        }
    }
}

/// The bytes a command writes (0 for reads and flushes): what a throttle counts.
fn written_bytes(io: &BlockIo) -> u64 {
    match io.plan {
        IoPlan::Write { len, .. } => u64::from(len),
        IoPlan::WriteZeroes { len, .. } => len,
        IoPlan::DatasetManagement { deallocate: true, .. } => 1,
        _ => 0,
    }
}

/// Which granules of a volume changed, one bit each.
pub struct DirtyMap {
    shift: u32,
    granules: u64,
    words: Box<[AtomicU64]>,
}

impl DirtyMap {
    fn new(size: u64) -> DirtyMap {
        let mut shift = MIN_GRANULE_SHIFT;
        while size.div_ceil(1 << shift) > MAX_GRANULES {
            shift += 1;
        }
        let granules = size.div_ceil(1 << shift);
        DirtyMap { shift, granules, words: (0..granules.div_ceil(64)).map(|_| AtomicU64::new(0)).collect() }
    }

    /// Bytes per granule.
    pub fn granule(&self) -> u64 {
        1 << self.shift
    }

    /// Marks every granule `len` bytes at `offset` touch.
    pub fn mark(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        let first = offset >> self.shift;
        let last = ((offset + len - 1) >> self.shift).min(self.granules.saturating_sub(1));
        let mut g = first;
        while g <= last {
            let word = g / 64;
            let upto = last.min(word * 64 + 63);
            let bits = (g % 64..=upto % 64).fold(0u64, |b, i| b | 1 << i);
            self.words[word as usize].fetch_or(bits, Ordering::SeqCst);
            g = upto + 1;
        }
    }

    fn mark_command(&self, io: &BlockIo) {
        match io.plan {
            IoPlan::Write { offset, len, .. } => self.mark(offset, u64::from(len)),
            IoPlan::WriteZeroes { offset, len } => self.mark(offset, len),
            IoPlan::DatasetManagement { deallocate: true, .. } => {
                let (ranges, n) = deallocated_ranges(io);
                for &(offset, len) in &ranges[..n] {
                    self.mark(offset, len);
                }
            }
            _ => {}
        }
    }

    /// Bytes marked now.
    pub fn bytes(&self) -> u64 {
        let set: u64 = self.words.iter().map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum();
        set << self.shift
    }

    /// The marked ranges as (offset, length), and clears them: a command that
    /// completes meanwhile is in these or in the next. Ranges less than
    /// [`JOIN_GAP`] apart are joined: one larger read and write cost less than two.
    pub fn take(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let g = self.granule();
        for (i, w) in self.words.iter().enumerate() {
            let mut bits = w.swap(0, Ordering::SeqCst);
            while bits != 0 {
                let b = u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                let offset = (i as u64 * 64 + b) * g;
                match runs.last_mut() {
                    Some((start, len)) if offset - (*start + *len) < JOIN_GAP => *len = offset + g - *start,
                    _ => runs.push((offset, g)),
                }
            }
        }
        runs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_join_into_runs_and_are_cleared_when_taken() {
        let m = DirtyMap::new(1 << 30);
        assert_eq!(m.granule(), 4096);
        m.mark(0, 512);
        m.mark(4096, 4096);
        m.mark(64 * 4096 - 1, 2);
        m.mark(1 << 20, 128 << 10);
        m.mark(70 * 4096, 1);
        m.mark(100 * 4096, 1);
        assert_eq!(m.bytes(), (2 + 2 + 1 + 1 + 32) * 4096);
        // Ranges less than 32 KiB apart are joined (a 20 KiB gap), others not (116 KiB).
        let runs = vec![(0, 8192), (63 * 4096, 8 * 4096), (100 * 4096, 4096), (1 << 20, 128 << 10)];
        assert_eq!(m.take(), runs);
        assert_eq!(m.bytes(), 0);
        assert!(m.take().is_empty());
    }

    #[test]
    fn huge_volumes_get_larger_granules_and_the_end_is_clipped() {
        let m = DirtyMap::new(1 << 40);
        assert_eq!(m.granule(), 8192);
        let m = DirtyMap::new(3 * 4096 + 1);
        m.mark(0, 1 << 30);
        assert_eq!(m.take(), vec![(0, 4 * 4096)]);
    }
}

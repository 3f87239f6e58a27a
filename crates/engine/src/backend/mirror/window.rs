//! The copy window: the one cluster a rebuild copies at a time, which writes wait for.
//!
//! A rebuild reads a cluster from the serving engine's replica and writes it to the
//! replica that catches up, which also gets every host write. A host write to that
//! cluster between the read and the copy's write would be overwritten by older data,
//! so writes to it wait while it is copied, and the copy starts only once the writes
//! already under way are done. Those are counted per reactor under an epoch: the copy
//! moves the epoch on and waits for the count of the old one to reach zero, and a
//! write counts itself before it looks at the window, so either the copy waits for it
//! or it sees the window (the same order as the migration gate's).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::plan::IoPlan;

/// Counters per reactor; reactors past this many share them (atomically, so soundly).
const COUNTERS: usize = 64;

/// A pair of counters alone on its cache line: writes under way, by epoch parity.
#[derive(Default)]
#[repr(align(64))]
struct InFlight([AtomicU64; 2]);

/// Which cluster is being copied, and the writes under way.
pub(super) struct CopyWindow {
    /// The cluster copied now, plus one; 0 when none is.
    copying: AtomicU64,
    /// Every write waits (a snapshot of every replica at one point in the write
    /// order), not only those to the cluster copied.
    all: AtomicBool,
    cluster_shift: u32,
    epoch: AtomicU64,
    in_flight: Box<[InFlight]>,
}

impl CopyWindow {
    pub(super) fn new(cluster_shift: u32) -> CopyWindow {
        CopyWindow {
            copying: AtomicU64::new(0),
            all: AtomicBool::new(false),
            cluster_shift,
            epoch: AtomicU64::new(0),
            in_flight: (0..COUNTERS).map(|_| InFlight::default()).collect(),
        }
    }

    fn slot(&self, reactor: usize, parity: usize) -> &AtomicU64 {
        &self.in_flight[reactor % COUNTERS].0[parity]
    }

    /// Counts a write starting on `reactor`; returns its epoch's parity, or `None`
    /// (not counted) if it must wait because it touches the cluster being copied.
    pub(super) fn enter(&self, reactor: usize, plan: &IoPlan) -> Option<usize> {
        let parity = loop {
            let epoch = self.epoch.load(Ordering::SeqCst);
            let parity = (epoch & 1) as usize;
            self.slot(reactor, parity).fetch_add(1, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == epoch {
                break parity;
            }
            self.slot(reactor, parity).fetch_sub(1, Ordering::SeqCst);
        };
        if self.blocks(plan) {
            self.slot(reactor, parity).fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(parity)
    }

    /// A write counted under `parity` on `reactor` is done.
    pub(super) fn leave(&self, reactor: usize, parity: usize) {
        self.slot(reactor, parity).fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether `plan` must wait for the cluster being copied. A deallocation's ranges
    /// are in its data, which this does not read: it waits for any copy.
    pub(super) fn blocks(&self, plan: &IoPlan) -> bool {
        if self.all.load(Ordering::SeqCst) {
            return !matches!(plan, IoPlan::Read { .. } | IoPlan::Flush);
        }
        let copying = self.copying.load(Ordering::SeqCst);
        if copying == 0 {
            return false;
        }
        let cluster = copying - 1;
        let touches = |offset: u64, len: u64| {
            len > 0 && offset >> self.cluster_shift <= cluster && (offset + len - 1) >> self.cluster_shift >= cluster
        };
        match *plan {
            IoPlan::Write { offset, len, .. } => touches(offset, u64::from(len)),
            IoPlan::WriteZeroes { offset, len } => touches(offset, len),
            IoPlan::DatasetManagement { deallocate, .. } => deallocate,
            IoPlan::Read { .. } | IoPlan::Flush => false,
        }
    }

    /// Opens the window on cluster `vc` and waits for the writes under way to finish
    /// (`Some`), or closes it (`None`).
    pub(super) fn hold(&self, vc: Option<u64>) {
        let Some(vc) = vc else {
            self.copying.store(0, Ordering::SeqCst);
            return;
        };
        self.copying.store(vc + 1, Ordering::SeqCst);
        self.drain();
    }

    /// Makes every write wait and waits for those under way (`true`; false if they
    /// did not finish within `limit`, and the hold is off again), or lets them go on
    /// (`false`).
    pub(super) fn hold_all(&self, on: bool, limit: Duration) -> bool {
        self.all.store(on, Ordering::SeqCst);
        if on && !self.drain_within(limit) {
            self.all.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Whether every write waits.
    pub(super) fn all_held(&self) -> bool {
        self.all.load(Ordering::SeqCst)
    }

    /// Waits for the writes under way now to finish (not for those that start later).
    pub(super) fn drain(&self) {
        self.drain_within(Duration::MAX);
    }

    /// `drain`, for at most `limit`: whether they finished.
    fn drain_within(&self, limit: Duration) -> bool {
        let started = std::time::Instant::now();
        let parity = (self.epoch.fetch_add(1, Ordering::SeqCst) & 1) as usize;
        while self.in_flight.iter().any(|c| c.0[parity].load(Ordering::SeqCst) != 0) {
            if started.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_to_the_cluster_being_copied_wait_and_others_pass() {
        let w = CopyWindow::new(20);
        let write = |offset: u64, len: u32| IoPlan::Write { offset, len, fua: false };
        let before = w.enter(0, &write(5 << 20, 4096)).unwrap();
        // The copy waits for the write under way (in another thread here).
        std::thread::scope(|s| {
            let copy = s.spawn(|| w.hold(Some(5)));
            std::thread::sleep(Duration::from_millis(20));
            assert!(!copy.is_finished(), "the copy started under a write");
            w.leave(0, before);
            copy.join().unwrap();
        });
        assert_eq!(w.enter(1, &write((5 << 20) + 4096, 4096)), None, "the cluster being copied");
        assert_eq!(w.enter(1, &write((4 << 20) + (1 << 20) - 512, 1024)), None, "a write that ends in it");
        let other = w.enter(1, &write(6 << 20, 4096)).expect("another cluster");
        assert!(!w.blocks(&IoPlan::Read { offset: 5 << 20, len: 4096 }), "reads pass");
        w.leave(1, other);
        w.hold(None);
        assert!(w.enter(1, &write(5 << 20, 4096)).is_some());
    }

    #[test]
    fn holding_every_write_waits_for_those_under_way_and_lets_reads_pass() {
        let w = CopyWindow::new(20);
        let write = |offset: u64| IoPlan::Write { offset, len: 4096, fua: false };
        let before = w.enter(0, &write(1 << 20)).unwrap();
        std::thread::scope(|s| {
            let hold = s.spawn(|| w.hold_all(true, Duration::from_secs(30)));
            std::thread::sleep(Duration::from_millis(20));
            assert!(!hold.is_finished(), "the hold took effect under a write");
            w.leave(0, before);
            assert!(hold.join().unwrap());
        });
        assert_eq!(w.enter(1, &write(9 << 20)), None, "any cluster's write waits");
        assert!(!w.blocks(&IoPlan::Read { offset: 0, len: 4096 }) && !w.blocks(&IoPlan::Flush));
        w.hold_all(false, Duration::ZERO);
        let stuck = w.enter(1, &write(9 << 20)).expect("writes go on");
        // A write that does not finish in time: the hold gives up and lets writes go.
        assert!(!w.hold_all(true, Duration::from_millis(5)));
        assert!(!w.all_held() && w.enter(0, &write(0)).is_some());
        w.leave(1, stuck);
    }
}

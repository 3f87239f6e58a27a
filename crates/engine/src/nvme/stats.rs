//! Per-namespace I/O statistics: counts, bytes, commands in flight, latency histograms
//! and errors by status, kept by the reactors and read by the management API and the
//! metrics endpoint.
//!
//! Each reactor writes only its own shard, with a plain load and store (no locked
//! instruction on the I/O path); readers sum the shards with relaxed loads, as these
//! are statistics. Reactors past `OWNED_SHARDS` share one more shard and add
//! atomically.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use nvpool_wire::Status;

use crate::plan::IoPlan;
pub use nvpool_api::StatsSnapshot;

/// Reactors with their own counter shard at most; any further reactors share one more.
const OWNED_SHARDS: usize = 64;

/// Reactors this process runs, set once at start: namespaces made afterwards get one
/// shard each and no more (each shard carries three histograms).
static REACTORS: AtomicUsize = AtomicUsize::new(OWNED_SHARDS);

/// Shards a per-reactor count of a namespace made now has: one per reactor up to
/// `OWNED_SHARDS`, and one that the reactors past them share.
pub fn reactor_shards() -> usize {
    REACTORS.load(Ordering::Relaxed) + 1
}

/// Sizes the shards of namespaces made from now on for `reactors` reactors.
pub fn set_reactor_count(reactors: usize) {
    REACTORS.store(reactors.clamp(1, OWNED_SHARDS), Ordering::Relaxed);
}

/// Upper bounds of the latency buckets, in nanoseconds: 10 us to 2.5 s in 1-2.5-5
/// steps, the range of a RAM namespace to a stalled disk. The last bucket is +Inf.
pub const LATENCY_BOUNDS_NS: [u64; 16] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    1_000_000_000,
    2_500_000_000,
];
const BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

/// What a completed command counts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    /// A read of this many bytes.
    Read(u64),
    /// A write of this many bytes.
    Write(u64),
    /// Flush, write zeroes or dataset management.
    Other,
    /// A command that failed, with its status.
    Error(Status),
}

impl Counted {
    /// What a command with this plan that ended with `status` counts as.
    pub fn of(plan: &IoPlan, status: Status) -> Counted {
        match *plan {
            _ if !status.is_success() => Counted::Error(status),
            IoPlan::Read { len, .. } => Counted::Read(u64::from(len)),
            IoPlan::Write { len, .. } => Counted::Write(u64::from(len)),
            _ => Counted::Other,
        }
    }
}

/// The kind of command a latency is recorded for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Reads.
    Read = 0,
    /// Writes.
    Write = 1,
    /// Flush, write zeroes, dataset management.
    Other = 2,
}

impl Op {
    /// Every kind, in index order.
    pub const ALL: [Op; 3] = [Op::Read, Op::Write, Op::Other];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::Other => "other",
        }
    }

    fn of(plan: &IoPlan) -> Op {
        match plan {
            IoPlan::Read { .. } => Op::Read,
            IoPlan::Write { .. } => Op::Write,
            _ => Op::Other,
        }
    }
}

/// Error statuses counted apart, by the name they get as a label; any other failure
/// counts as "other".
pub const ERROR_CLASSES: [&str; 9] = [
    "invalid_field",
    "invalid_namespace",
    "lba_out_of_range",
    "capacity_exceeded",
    "data_transfer_error",
    "internal_error",
    "transient_transport_error",
    "path_error",
    "other",
];

fn error_class(status: Status) -> usize {
    let named = [
        Status::INVALID_FIELD,
        Status::INVALID_NAMESPACE,
        Status::LBA_OUT_OF_RANGE,
        Status::CAPACITY_EXCEEDED,
        Status::DATA_TRANSFER_ERROR,
        Status::INTERNAL_ERROR,
        Status::TRANSIENT_TRANSPORT_ERROR,
    ];
    let code = status.base();
    if let Some(i) = named.iter().position(|&s| s == code) {
        return i;
    }
    // Path Related Status (status code type 3): ANA inaccessible, in transition,
    // persistent loss.
    if code.code_type() == 3 {
        return ERROR_CLASSES.len() - 2;
    }
    ERROR_CLASSES.len() - 1
}

/// A latency histogram of one shard.
#[derive(Debug, Default)]
struct HistogramShard {
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

/// One reactor's counters, on cache lines of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct StatShard {
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    others: AtomicU64,
    errors: AtomicU64,
    started: AtomicU64,
    completed: AtomicU64,
    throttled: AtomicU64,
    errors_by_class: [AtomicU64; ERROR_CLASSES.len()],
    latency: [HistogramShard; 3],
}

/// A latency histogram summed over the reactors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Commands per bucket (not cumulative); the last one is above every bound.
    pub buckets: [u64; BUCKETS],
    /// Sum of the latencies, in nanoseconds.
    pub sum_ns: u64,
}

impl HistogramSnapshot {
    /// Commands recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

/// Everything a namespace counted, summed over the reactors.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DetailedStats {
    /// The counts the management API reports.
    pub totals: StatsSnapshot,
    /// Commands started and not yet completed.
    pub in_flight: u64,
    /// Latency from the reactor pass that received a command to the pass that answered
    /// it, per [`Op`].
    pub latency: [HistogramSnapshot; 3],
    /// Failed commands per [`ERROR_CLASSES`] entry.
    pub errors_by_class: [u64; ERROR_CLASSES.len()],
    /// Commands that waited for the namespace's I/O limits.
    pub throttled: u64,
}

/// Per-namespace statistics, one shard per reactor.
#[derive(Debug)]
pub struct NamespaceStats {
    shards: Box<[StatShard]>,
}

impl Default for NamespaceStats {
    fn default() -> Self {
        let owned = REACTORS.load(Ordering::Relaxed);
        NamespaceStats { shards: (0..=owned).map(|_| StatShard::default()).collect() }
    }
}

impl NamespaceStats {
    /// The shard of reactor `reactor`, and whether that reactor is its only writer.
    fn shard(&self, reactor: usize) -> (&StatShard, bool) {
        let owned = self.shards.len() - 1;
        if reactor < owned { (&self.shards[reactor], true) } else { (&self.shards[owned], false) }
    }

    /// A command reactor `reactor` took up (only that reactor's thread may pass its ID).
    pub fn started(&self, reactor: usize) {
        let (shard, exclusive) = self.shard(reactor);
        add(&shard.started, 1, exclusive);
    }

    /// A command that waits for the namespace's I/O limits.
    pub fn throttled(&self, reactor: usize) {
        let (shard, exclusive) = self.shard(reactor);
        add(&shard.throttled, 1, exclusive);
    }

    /// A command that failed before it started (a malformed or refused command).
    pub fn rejected(&self, reactor: usize, status: Status) {
        let (shard, exclusive) = self.shard(reactor);
        add(&shard.errors, 1, exclusive);
        add(&shard.errors_by_class[error_class(status)], 1, exclusive);
    }

    /// A started command answered with `status` after `latency_ns`.
    pub fn completed(&self, reactor: usize, plan: &IoPlan, status: Status, latency_ns: u64) {
        let (shard, exclusive) = self.shard(reactor);
        add(&shard.completed, 1, exclusive);
        match Counted::of(plan, status) {
            Counted::Read(bytes) => {
                add(&shard.reads, 1, exclusive);
                add(&shard.read_bytes, bytes, exclusive);
            }
            Counted::Write(bytes) => {
                add(&shard.writes, 1, exclusive);
                add(&shard.write_bytes, bytes, exclusive);
            }
            Counted::Other => add(&shard.others, 1, exclusive),
            Counted::Error(status) => {
                add(&shard.errors, 1, exclusive);
                add(&shard.errors_by_class[error_class(status)], 1, exclusive);
            }
        }
        let histogram = &shard.latency[Op::of(plan) as usize];
        let bucket = LATENCY_BOUNDS_NS.iter().position(|&bound| latency_ns <= bound).unwrap_or(BUCKETS - 1);
        add(&histogram.buckets[bucket], 1, exclusive);
        add(&histogram.sum_ns, latency_ns, exclusive);
    }

    /// The counts the management API reports, summed over all reactors.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut t = StatsSnapshot::default();
        for s in self.shards.iter() {
            t.reads += get(&s.reads);
            t.writes += get(&s.writes);
            t.read_bytes += get(&s.read_bytes);
            t.write_bytes += get(&s.write_bytes);
            t.others += get(&s.others);
            t.errors += get(&s.errors);
            t.completed += get(&s.completed);
            t.latency_ns += s.latency.iter().map(|h| get(&h.sum_ns)).sum::<u64>();
        }
        t
    }

    /// Everything, summed over all reactors.
    pub fn detailed(&self) -> DetailedStats {
        let mut d = DetailedStats { totals: self.snapshot(), ..DetailedStats::default() };
        let (mut started, mut completed) = (0, 0);
        for s in self.shards.iter() {
            started += get(&s.started);
            completed += get(&s.completed);
            d.throttled += get(&s.throttled);
            for (total, c) in d.errors_by_class.iter_mut().zip(&s.errors_by_class) {
                *total += get(c);
            }
            for (total, h) in d.latency.iter_mut().zip(&s.latency) {
                for (b, c) in total.buckets.iter_mut().zip(&h.buckets) {
                    *b += get(c);
                }
                total.sum_ns += get(&h.sum_ns);
            }
        }
        // Shards are read one after another while reactors count, so a completion can
        // be seen before its start.
        d.in_flight = started.saturating_sub(completed);
        d
    }
}

fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// Adds `n`: a plain load and store for a shard's only writer, an atomic add otherwise.
fn add(counter: &AtomicU64, n: u64, exclusive: bool) {
    if exclusive {
        counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
    } else {
        counter.fetch_add(n, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const READ: IoPlan = IoPlan::Read { offset: 0, len: 4096 };
    const WRITE: IoPlan = IoPlan::Write { offset: 0, len: 512, fua: false };

    #[test]
    fn stats_sum_every_reactor_shard() {
        let stats = NamespaceStats::default();
        let owned = stats.shards.len() - 1;
        // Reactors with their own shard, and two past the owned ones that share one.
        let reactors = [0, 1, owned - 1, owned, owned + 7];
        std::thread::scope(|scope| {
            for &reactor in &reactors {
                let stats = &stats;
                scope.spawn(move || {
                    for _ in 0..1000 {
                        stats.started(reactor);
                        stats.completed(reactor, &READ, Status::SUCCESS, 5_000);
                        stats.started(reactor);
                        stats.completed(reactor, &WRITE, Status::SUCCESS, 30_000);
                    }
                    stats.started(reactor);
                    stats.completed(reactor, &IoPlan::Flush, Status::SUCCESS, 3_000_000_000);
                    stats.rejected(reactor, Status::LBA_OUT_OF_RANGE.with_dnr());
                    stats.started(reactor);
                });
            }
        });
        let n = reactors.len() as u64;
        let expected = StatsSnapshot {
            reads: 1000 * n,
            writes: 1000 * n,
            read_bytes: 4096 * 1000 * n,
            write_bytes: 512 * 1000 * n,
            others: n,
            errors: n,
            completed: 2001 * n,
            latency_ns: (5_000 * 1000 + 30_000 * 1000 + 3_000_000_000) * n,
        };
        assert_eq!(stats.snapshot(), expected);
        let d = stats.detailed();
        assert_eq!(d.totals, expected);
        assert_eq!(d.in_flight, n, "one command each left started");
        let read = &d.latency[Op::Read as usize];
        assert_eq!((read.buckets[0], read.count(), read.sum_ns), (1000 * n, 1000 * n, 5_000 * 1000 * n));
        assert_eq!(d.latency[Op::Write as usize].buckets[2], 1000 * n, "30 us is in the 50 us bucket");
        assert_eq!(d.latency[Op::Other as usize].buckets[BUCKETS - 1], n, "3 s is above every bound");
        assert_eq!(d.errors_by_class[2], n, "LBA out of range, whatever DNR says");
        assert_eq!(d.errors_by_class.iter().sum::<u64>(), n);
    }

    #[test]
    fn errors_are_classed_by_status() {
        let stats = NamespaceStats::default();
        stats.started(0);
        stats.completed(0, &READ, Status::ANA_INACCESSIBLE, 1_000);
        stats.rejected(0, Status::INVALID_OPCODE);
        let d = stats.detailed();
        assert_eq!(d.totals.errors, 2);
        assert_eq!(d.errors_by_class[ERROR_CLASSES.iter().position(|&c| c == "path_error").unwrap()], 1);
        assert_eq!(d.errors_by_class[ERROR_CLASSES.len() - 1], 1);
        // A failed command's latency still counts under its kind.
        assert_eq!(d.latency[Op::Read as usize].count(), 1);
    }
}

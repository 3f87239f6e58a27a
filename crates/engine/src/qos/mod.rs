//! A namespace's I/O limits: one shared token bucket per limit, which the reactors
//! draw on in batches.
//!
//! Each limit (operations or bytes, in total or per direction) is a bucket that fills
//! at the limit's rate and holds at most [`BURST_MS`] of it. A reactor does not go to
//! the shared bucket for every command: it takes a millisecond's worth (or what pays
//! its debt) into its own [`LocalBudget`] with one atomic operation and spends that
//! locally, so a namespace served by several reactors shares one budget without a
//! cross-core atomic per command. A command is let through while every budget it
//! draws on is positive, and its whole cost is then taken, which may leave a budget in
//! debt: a command larger than a millisecond's budget waits for the ones after it,
//! and the rate over time is the limit exactly. Commands that are not let through
//! wait on their reactor (see `reactor::throttle`), oldest first; they never fail.
//!
//! Budgets are counted in millionths of an operation or a byte, so that a limit of a
//! few hundred operations a second still fills its bucket on every pass.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};

use nvpool_api::QosLimits;

mod throttle;

pub use throttle::Throttle;

use crate::plan::IoPlan;
use crate::sync::lock;

/// How much of a limit's rate a bucket holds at most: the burst an idle namespace may
/// send at once before it is held to the rate.
pub const BURST_MS: u64 = 10;
/// Units of a budget per operation or byte.
const SCALE: i64 = 1_000_000;
/// A bucket is filled again at most this often, so reactors do not contend for it.
const REFILL_NS: u64 = 20_000;

/// The limits, in the order of a command's costs (see [`costs`]).
const LIMITS: usize = 6;
const IOPS: usize = 0;
const BPS: usize = 1;
const READ_IOPS: usize = 2;
const READ_BPS: usize = 3;
const WRITE_IOPS: usize = 4;
const WRITE_BPS: usize = 5;

fn rates(l: &QosLimits) -> [u64; LIMITS] {
    [l.iops, l.bps, l.read_iops, l.read_bps, l.write_iops, l.write_bps]
}

/// What a command costs each limit, in budget units (0: it does not draw on it).
pub fn costs(plan: &IoPlan) -> [i64; LIMITS] {
    let mut c = [0; LIMITS];
    c[IOPS] = SCALE;
    match *plan {
        IoPlan::Read { len, .. } => {
            c[READ_IOPS] = SCALE;
            c[BPS] = i64::from(len) * SCALE;
            c[READ_BPS] = c[BPS];
        }
        IoPlan::Write { len, .. } => {
            c[WRITE_IOPS] = SCALE;
            c[BPS] = i64::from(len) * SCALE;
            c[WRITE_BPS] = c[BPS];
        }
        IoPlan::WriteZeroes { .. } | IoPlan::DatasetManagement { .. } => c[WRITE_IOPS] = SCALE,
        IoPlan::Flush => {}
    }
    c
}

/// One limit's shared bucket, alone on its cache line.
#[derive(Default)]
#[repr(align(64))]
struct Bucket {
    /// Units per second; 0 is no limit.
    rate: AtomicU64,
    /// Units available; negative never (reactors take only what is there).
    balance: AtomicI64,
    /// When it was last filled, on the reactors' pass clock; 0: from the next take on.
    filled_ns: AtomicU64,
}

impl Bucket {
    fn rate(&self) -> i64 {
        self.rate.load(Ordering::Relaxed).min(i64::MAX as u64 / SCALE as u64) as i64 * SCALE
    }

    /// Fills the bucket for the time since it was last filled, up to its burst.
    fn fill(&self, rate: i64, now_ns: u64) {
        let last = self.filled_ns.load(Ordering::Acquire);
        if last != 0 && now_ns < last.saturating_add(REFILL_NS) {
            return;
        }
        // One reactor fills for a given span of time; the others see the new mark.
        if self.filled_ns.compare_exchange(last, now_ns.max(1), Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return;
        }
        if last == 0 {
            return;
        }
        let added = (rate as u128 * u128::from(now_ns - last) / 1_000_000_000).min(i64::MAX as u128) as i64;
        let cap = burst(rate);
        let _ =
            self.balance.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |b| Some(b.saturating_add(added).min(cap)));
    }

    /// Takes up to `want` units; what it got.
    fn take(&self, want: i64, now_ns: u64) -> i64 {
        self.fill(self.rate(), now_ns);
        let mut got = 0;
        let _ = self.balance.fetch_update(Ordering::AcqRel, Ordering::Relaxed, |b| {
            got = b.min(want);
            (got > 0).then_some(b - got)
        });
        got.max(0)
    }
}

/// The most a bucket of `rate` units a second holds.
fn burst(rate: i64) -> i64 {
    (rate / 1000 * BURST_MS as i64).max(SCALE)
}

/// A reactor's batch: a millisecond of the rate, at least one unit.
fn batch(rate: i64) -> i64 {
    (rate / 1000).max(1)
}

/// A namespace's limits and their buckets, shared by the reactors serving it and kept
/// when its backend is swapped.
#[derive(Default)]
pub struct Qos {
    /// Whether any limit is set: the one load a command of an unlimited namespace pays.
    limited: AtomicBool,
    /// Counts changes of the limits, so reactors drop budgets taken under old ones.
    generation: AtomicU64,
    buckets: [Bucket; LIMITS],
    limits: Mutex<QosLimits>,
}

impl std::fmt::Debug for Qos {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qos").field("limits", &self.limits()).finish()
    }
}

impl Qos {
    /// Limits of `limits`.
    pub fn new(limits: QosLimits) -> Qos {
        let q = Qos::default();
        q.set(limits);
        q
    }

    /// Sets the limits, from the next command on. Buckets start empty, and what
    /// reactors took under the old limits is dropped.
    pub fn set(&self, limits: QosLimits) {
        let mut current = lock(&self.limits);
        for (bucket, rate) in self.buckets.iter().zip(rates(&limits)) {
            bucket.rate.store(rate, Ordering::Relaxed);
            bucket.balance.store(0, Ordering::Relaxed);
            bucket.filled_ns.store(0, Ordering::Relaxed);
        }
        *current = limits;
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.limited.store(!limits.is_unlimited(), Ordering::Release);
    }

    /// The limits set.
    pub fn limits(&self) -> QosLimits {
        *lock(&self.limits)
    }

    /// Whether commands must pass the budget.
    pub fn limited(&self) -> bool {
        self.limited.load(Ordering::Acquire)
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

/// What one reactor holds of one namespace's budget. Only that reactor touches it.
pub struct LocalBudget {
    generation: u64,
    units: [i64; LIMITS],
}

impl LocalBudget {
    /// Nothing held yet.
    pub fn new() -> LocalBudget {
        LocalBudget { generation: u64::MAX, units: [0; LIMITS] }
    }

    /// Lets a command costing `costs` through if every budget it draws on is
    /// positive, drawing on the shared buckets for what this reactor lacks, and takes
    /// its cost. `now_ns` is the reactors' pass clock.
    pub fn admit(&mut self, qos: &Qos, costs: &[i64; LIMITS], now_ns: u64) -> bool {
        let generation = qos.generation();
        if generation != self.generation {
            self.generation = generation;
            self.units = [0; LIMITS];
        }
        for (i, bucket) in qos.buckets.iter().enumerate() {
            let rate = bucket.rate();
            if costs[i] == 0 || rate == 0 || self.units[i] > 0 {
                continue;
            }
            // Pays the debt and takes a batch on top, so the next commands draw locally.
            self.units[i] += bucket.take(batch(rate) - self.units[i], now_ns);
            if self.units[i] <= 0 {
                return false;
            }
        }
        for (i, bucket) in qos.buckets.iter().enumerate() {
            if costs[i] != 0 && bucket.rate() != 0 {
                self.units[i] -= costs[i];
            }
        }
        true
    }
}

impl Default for LocalBudget {
    fn default() -> Self {
        LocalBudget::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn read(len: u32) -> [i64; LIMITS] {
        costs(&IoPlan::Read { offset: 0, len })
    }

    /// Commands let through by `reactors` reactors offering one each, round robin, every
    /// `step_ns` for `span_ns`.
    fn run(qos: &Qos, reactors: usize, cost: [i64; LIMITS], step_ns: u64, span_ns: u64) -> u64 {
        let mut budgets: Vec<LocalBudget> = (0..reactors).map(|_| LocalBudget::new()).collect();
        let mut passed = 0;
        let mut now = 1;
        while now < span_ns {
            for b in &mut budgets {
                passed += u64::from(b.admit(qos, &cost, now));
            }
            now += step_ns;
        }
        passed
    }

    #[test]
    fn an_operation_limit_holds_over_time_across_reactors() {
        let qos = Qos::new(QosLimits { iops: 5000, ..Default::default() });
        // Offered far above the limit for one second, by two reactors.
        let passed = run(&qos, 2, read(4096), 10_000, 1000 * MS);
        assert!((4950..=5000 + 50).contains(&passed), "{passed} commands in a second at 5000 IOPS");
    }

    #[test]
    fn a_byte_limit_counts_bytes_and_lets_large_commands_run_into_debt() {
        let qos = Qos::new(QosLimits { bps: 100 << 20, ..Default::default() });
        // 1 MiB commands: larger than a millisecond's budget (100 KiB).
        let passed = run(&qos, 1, read(1 << 20), 50_000, 1000 * MS);
        assert!((99..=101).contains(&passed), "{passed} MiB in a second at 100 MiB/s");
    }

    #[test]
    fn direction_limits_apply_to_their_direction_only() {
        let qos = Qos::new(QosLimits { write_iops: 1000, ..Default::default() });
        let reads = run(&qos, 1, read(4096), 100_000, 100 * MS);
        assert_eq!(reads, 1000, "reads are not limited: one per step");
        let write = costs(&IoPlan::Write { offset: 0, len: 4096, fua: false });
        let writes = run(&qos, 1, write, 10_000, 1000 * MS);
        assert!((990..=1010).contains(&writes), "{writes} writes at 1000 IOPS");
    }

    #[test]
    fn a_limit_changes_from_the_next_command_and_lifts() {
        let qos = Qos::new(QosLimits { iops: 1000, ..Default::default() });
        let mut b = LocalBudget::new();
        let cost = read(4096);
        let count = |from: u64, to: u64, b: &mut LocalBudget| {
            (from..to).step_by(10_000).filter(|&t| b.admit(&qos, &cost, t)).count()
        };
        let slow = count(1, 100 * MS, &mut b);
        assert!((95..=105).contains(&slow), "{slow} in 100 ms at 1000 IOPS");
        qos.set(QosLimits { iops: 10_000, ..Default::default() });
        let fast = count(100 * MS, 200 * MS, &mut b);
        assert!((990..=1010).contains(&fast), "{fast} in 100 ms at 10000 IOPS");
        qos.set(QosLimits::default());
        assert!(!qos.limited());
    }

    #[test]
    fn an_idle_namespace_bursts_at_most_its_burst() {
        let qos = Qos::new(QosLimits { iops: 10_000, ..Default::default() });
        let mut b = LocalBudget::new();
        let cost = read(512);
        assert!(!b.admit(&qos, &cost, 1), "buckets start empty");
        // A second idle, then everything at once.
        let burst = (0..1000).filter(|_| b.admit(&qos, &cost, 1000 * MS)).count();
        assert_eq!(burst as u64, 10_000 * BURST_MS / 1000, "a burst of {BURST_MS} ms of the rate");
    }
}

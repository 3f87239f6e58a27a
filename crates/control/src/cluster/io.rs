//! Live I/O figures: the counters each engine reports with its agent's heartbeats,
//! turned into rates over the span between two heartbeats. Kept in memory only: a new
//! leader has figures after two heartbeats.

use crate::proto;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What one volume's namespace did between two heartbeats.
#[derive(Clone, Copy, Debug, Default)]
struct Change {
    reads: u64,
    writes: u64,
    read_bytes: u64,
    write_bytes: u64,
    completed: u64,
    latency_ns: u64,
}

impl Change {
    fn between(old: Option<&proto::VolumeCounters>, new: &proto::VolumeCounters) -> Change {
        // A namespace made anew (an engine restarted) counts from zero again.
        let old = old.filter(|o| o.completed <= new.completed).cloned().unwrap_or_default();
        Change {
            reads: new.reads.saturating_sub(old.reads),
            writes: new.writes.saturating_sub(old.writes),
            read_bytes: new.read_bytes.saturating_sub(old.read_bytes),
            write_bytes: new.write_bytes.saturating_sub(old.write_bytes),
            completed: new.completed.saturating_sub(old.completed),
            latency_ns: new.latency_ns.saturating_sub(old.latency_ns),
        }
    }

    fn add(self, o: Change) -> Change {
        Change {
            reads: self.reads + o.reads,
            writes: self.writes + o.writes,
            read_bytes: self.read_bytes + o.read_bytes,
            write_bytes: self.write_bytes + o.write_bytes,
            completed: self.completed + o.completed,
            latency_ns: self.latency_ns + o.latency_ns,
        }
    }

    fn rates(self, seconds: f64) -> proto::IoRates {
        proto::IoRates {
            read_iops: self.reads as f64 / seconds,
            write_iops: self.writes as f64 / seconds,
            read_bytes_per_second: self.read_bytes as f64 / seconds,
            write_bytes_per_second: self.write_bytes as f64 / seconds,
            mean_latency_us: if self.completed == 0 {
                0.0
            } else {
                self.latency_ns as f64 / self.completed as f64 / 1e3
            },
        }
    }
}

/// One node's I/O: its last counters and what changed before them.
#[derive(Debug, Default)]
pub(super) struct NodeIo {
    last: Option<(Instant, HashMap<String, proto::VolumeCounters>)>,
    /// By subsystem NQN, over `seconds`.
    changes: HashMap<String, Change>,
    seconds: f64,
}

/// Heartbeats closer than this are too close for a rate; the later one is skipped.
const SHORTEST_SPAN: Duration = Duration::from_millis(100);

impl NodeIo {
    /// Takes the counters of a heartbeat that arrived at `now`: every namespace's, or
    /// (`changes_only`) those that changed since the heartbeat before, with the NQNs of
    /// those that went away in `gone`.
    pub(super) fn update(
        &mut self,
        now: Instant,
        counters: Vec<proto::VolumeCounters>,
        changes_only: bool,
        gone: &[String],
    ) {
        let reported: HashMap<String, proto::VolumeCounters> =
            counters.into_iter().map(|c| (c.subsystem_nqn.clone(), c)).collect();
        let Some((at, old)) = &mut self.last else {
            self.last = Some((now, reported));
            return;
        };
        // Heartbeats too close for a rate skip it: the last rates stand.
        let span = now.duration_since(*at);
        let timed = span >= SHORTEST_SPAN;
        if timed {
            self.seconds = span.as_secs_f64();
            self.changes = reported.iter().map(|(nqn, c)| (nqn.clone(), Change::between(old.get(nqn), c))).collect();
        }
        if changes_only {
            // Changes are not sent again, so they are kept even when too close for a
            // rate; what was not reported did nothing and keeps its counters.
            old.extend(reported);
            for nqn in gone {
                old.remove(nqn);
            }
            if timed {
                *at = now;
            }
        } else if timed {
            self.last = Some((now, reported));
        }
    }

    /// The rates of one volume's namespace here, by its export's NQN (zeros for one
    /// whose counters did not change).
    pub(super) fn volume(&self, nqn: &str) -> Option<proto::IoRates> {
        let counted = self.last.as_ref().is_some_and(|(_, last)| last.contains_key(nqn));
        match self.changes.get(nqn) {
            Some(c) => Some(c.rates(self.seconds)),
            None if counted && self.seconds > 0.0 => Some(Change::default().rates(self.seconds)),
            None => None,
        }
    }

    /// The rates of every volume namespace here together.
    pub(super) fn total(&self) -> Option<proto::IoRates> {
        (self.seconds > 0.0)
            .then(|| self.changes.values().fold(Change::default(), |a, &c| a.add(c)).rates(self.seconds))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(nqn: &str, reads: u64, latency_ns: u64) -> proto::VolumeCounters {
        proto::VolumeCounters {
            subsystem_nqn: nqn.into(),
            reads,
            read_bytes: reads * 4096,
            completed: reads,
            latency_ns,
            ..Default::default()
        }
    }

    #[test]
    fn rates_are_changes_over_the_span_and_a_restart_counts_from_zero() {
        let t0 = Instant::now();
        let mut io = NodeIo::default();
        io.update(t0, vec![counters("a", 1000, 0), counters("b", 0, 0)], false, &[]);
        assert!(io.total().is_none(), "one heartbeat is no rate");
        io.update(
            t0 + Duration::from_millis(500),
            vec![counters("a", 2000, 50_000_000), counters("b", 500, 0)],
            false,
            &[],
        );
        let a = io.volume("a").unwrap();
        assert_eq!((a.read_iops, a.read_bytes_per_second, a.mean_latency_us), (2000.0, 2000.0 * 4096.0, 50.0));
        assert_eq!(io.total().unwrap().read_iops, 3000.0);
        // Too soon: skipped, the last rates stand.
        io.update(t0 + Duration::from_millis(550), vec![counters("a", 9000, 0)], false, &[]);
        assert_eq!(io.volume("a").unwrap().read_iops, 2000.0);
        // The engine restarted: its counters begin again.
        io.update(t0 + Duration::from_millis(1000), vec![counters("a", 100, 0)], false, &[]);
        assert_eq!(io.volume("a").unwrap().read_iops, 200.0);
        assert!(io.volume("b").is_none(), "b is no longer served here");
    }

    #[test]
    fn changes_add_to_the_counters_kept_and_what_is_not_reported_did_nothing() {
        let t0 = Instant::now();
        let mut io = NodeIo::default();
        io.update(t0, vec![counters("a", 1000, 0), counters("b", 10, 0), counters("c", 0, 0)], false, &[]);
        // Only a changed, and c went away.
        io.update(t0 + Duration::from_secs(1), vec![counters("a", 1500, 0)], true, &["c".to_string()]);
        assert_eq!(io.volume("a").unwrap().read_iops, 500.0);
        assert_eq!(io.volume("b").unwrap().read_iops, 0.0, "b is still served, idle");
        assert!(io.volume("c").is_none());
        // Nothing changed at all: every rate is zero, and b's counters are kept.
        io.update(t0 + Duration::from_secs(2), Vec::new(), true, &[]);
        assert_eq!(io.total().unwrap().read_iops, 0.0);
        io.update(t0 + Duration::from_secs(3), vec![counters("b", 30, 0)], true, &[]);
        assert_eq!(io.volume("b").unwrap().read_iops, 20.0);
        assert_eq!(io.total().unwrap().read_iops, 20.0);
    }
}

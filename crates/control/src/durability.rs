//! `nvpool sim --replication`: how a pool of replicated volumes fares under random
//! node failures, against the rebuild rate: how long it takes to get back to full
//! redundancy after a failure, how long volumes spend with a single current copy,
//! and how often one loses data.
//!
//! The model follows what the controller does (`cluster/replicas.rs`). Volumes of a
//! log-normal size each have `replicas` copies on distinct nodes, placed at random
//! (every node has room). Nodes fail one at a time as a Poisson process and come back
//! after an exponential repair time; a share of failures take the node's disks with
//! them. A replica whose node fails leaves the in-sync set, unless it was the last
//! in-sync one (then the volume stops taking writes until it returns: invariant 4).
//! Back within the replica timeout with its disks, it is rebuilt from what was
//! written meanwhile (the volume's write rate over the time away); later, or without
//! its disks, it is made anew on another node and rebuilt in full. Each node takes at
//! most `rebuild_cap` rebuilds at once, each at `rate`; the others queue. A volume
//! loses data when every copy that had all its writes is on lost disks.

use crate::sim::Rng;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

const GIB: f64 = (1u64 << 30) as f64;
const HOUR: f64 = 3600.0;
const YEAR: f64 = 365.0 * 24.0 * HOUR;

#[derive(Clone, Debug)]
pub struct DurabilityConfig {
    pub nodes: usize,
    pub volumes_per_node: usize,
    pub replicas: usize,
    /// Median volume size, bytes (log-normal, sigma 1, 1 GiB to 4 TiB).
    pub median_size: u64,
    /// Each volume's mean write rate, bytes per second.
    pub write_rate: f64,
    /// Failures per node and year.
    pub failures_per_node_year: f64,
    /// Mean time a failed node stays away, seconds.
    pub repair_seconds: f64,
    /// Share of failures that lose the node's disks.
    pub disk_loss_share: f64,
    /// How long a replica's node may stay away before the replica is made anew.
    pub replica_timeout_seconds: f64,
    /// Rebuilds a node takes at once.
    pub rebuild_cap: usize,
    pub years: f64,
    pub seed: u64,
}

impl Default for DurabilityConfig {
    fn default() -> DurabilityConfig {
        DurabilityConfig {
            nodes: 1000,
            volumes_per_node: 20,
            replicas: 3,
            median_size: 100 << 30,
            write_rate: 1e6,
            failures_per_node_year: 2.0,
            repair_seconds: 1800.0,
            disk_loss_share: 0.05,
            replica_timeout_seconds: 300.0,
            rebuild_cap: 2,
            years: 5.0,
            seed: 1,
        }
    }
}

/// What one run at one rebuild rate found.
#[derive(Clone, Debug, Serialize)]
pub struct DurabilityReport {
    /// Bytes per second each rebuild takes.
    pub rate: f64,
    pub failures: usize,
    /// From a node's failure until every volume it held has all its replicas in sync
    /// again: mean, 99th percentile and longest, hours.
    pub back_mean_hours: f64,
    pub back_p99_hours: f64,
    pub back_max_hours: f64,
    /// Volume-hours spent with a single in-sync copy, per volume and year.
    pub single_copy_hours_per_volume_year: f64,
    /// Volume-hours without any copy taking writes (the last in-sync one away).
    pub unavailable_hours_per_volume_year: f64,
    /// Volumes that lost data, and that per million volume-years.
    pub lost_volumes: usize,
    pub lost_per_million_volume_years: f64,
    /// Bytes the rebuilds copied.
    pub rebuilt_bytes: f64,
}

#[derive(Clone, Copy, PartialEq)]
enum Copy {
    /// Has every write.
    InSync,
    /// Lacks the writes since `since` (seconds), on a live node; waits for or runs its
    /// rebuild.
    Behind { since: f64 },
    /// On a failed node: `current` if it was the last in-sync copy (the volume waits
    /// for it), `since` when it left.
    Away { current: bool, since: f64 },
}

struct Replica {
    node: usize,
    state: Copy,
    /// Bumped when the replica's rebuild or timeout no longer holds.
    epoch: u32,
}

struct Volume {
    size: f64,
    replicas: Vec<Replica>,
    /// When the volume last changed its count of in-sync copies (for the exposure sums).
    since: f64,
}

#[derive(Clone, Copy)]
enum Event {
    Fail(usize),
    Return { node: usize, disks_lost: bool },
    Timeout { volume: usize, replica: usize, epoch: u32 },
    Rebuilt { volume: usize, replica: usize, epoch: u32 },
}

struct Sim<'a> {
    cfg: &'a DurabilityConfig,
    rate: f64,
    /// Placements of new replicas.
    rng: Rng,
    /// The failures (which node, when, for how long, whether its disks go): a stream
    /// of its own, so that every rebuild rate meets the same failures.
    failures: Rng,
    now: f64,
    queue: BinaryHeap<Reverse<(u64, usize)>>,
    events: Vec<Event>,
    volumes: Vec<Volume>,
    /// The (volume, replica) pairs on each node.
    on_node: Vec<Vec<(usize, usize)>>,
    up: Vec<bool>,
    /// Rebuilds each node runs, and those waiting for a slot.
    running: Vec<usize>,
    waiting: Vec<VecDeque<(usize, usize)>>,
    /// Per failure: when it happened and the volumes it left short of replicas.
    open_failures: Vec<(f64, Vec<usize>)>,
    back_hours: Vec<f64>,
    single_copy_seconds: f64,
    unavailable_seconds: f64,
    lost: usize,
    rebuilt_bytes: f64,
}

impl Sim<'_> {
    fn at(&mut self, when: f64, e: Event) {
        self.events.push(e);
        self.queue.push(Reverse(((when * 1000.0) as u64, self.events.len() - 1)));
    }

    fn in_sync(&self, v: usize) -> usize {
        self.volumes[v].replicas.iter().filter(|r| r.state == Copy::InSync).count()
    }

    fn full(&self, v: usize) -> bool {
        self.in_sync(v) == self.cfg.replicas
    }

    /// Adds the time since the volume's last change to the exposure sums; call before
    /// a change of its copies.
    fn account(&mut self, v: usize) {
        let in_sync = self.in_sync(v);
        let waiting = self.volumes[v].replicas.iter().any(|r| matches!(r.state, Copy::Away { current: true, .. }));
        let span = self.now - self.volumes[v].since;
        if waiting {
            self.unavailable_seconds += span;
        } else if in_sync == 1 {
            self.single_copy_seconds += span;
        }
        self.volumes[v].since = self.now;
    }

    fn fail(&mut self, node: usize) {
        if !self.up[node] {
            return;
        }
        self.up[node] = false;
        let disks_lost = self.failures.unit() < self.cfg.disk_loss_share;
        let mut touched = Vec::new();
        for (v, i) in self.on_node[node].clone() {
            self.account(v);
            let last = self.in_sync(v) == 1 && self.volumes[v].replicas[i].state == Copy::InSync;
            let r = &mut self.volumes[v].replicas[i];
            r.epoch += 1;
            let since = match r.state {
                Copy::Behind { since } | Copy::Away { since, .. } => since,
                Copy::InSync => self.now,
            };
            r.state = Copy::Away { current: last, since };
            let epoch = r.epoch;
            self.at(self.now + self.cfg.replica_timeout_seconds, Event::Timeout { volume: v, replica: i, epoch });
            touched.push(v);
        }
        // A running rebuild on this node stops; queued ones too.
        self.running[node] = 0;
        self.waiting[node].clear();
        if disks_lost {
            for &(v, i) in &self.on_node[node].clone() {
                let r = &mut self.volumes[v].replicas[i];
                let was_current = matches!(r.state, Copy::Away { current: true, .. });
                r.state = Copy::Away { current: false, since: self.now };
                // Nothing else has the writes the waiting volume took last.
                if was_current {
                    self.lose(v);
                }
            }
        }
        self.open_failures.push((self.now, touched));
        let back = self.now + self.failures.exponential(self.cfg.repair_seconds);
        self.at(back, Event::Return { node, disks_lost });
        // Rebuilds whose source was here wait for another in-sync copy.
        self.start_rebuilds_of_node_volumes(node);
    }

    fn lose(&mut self, v: usize) {
        self.lost += 1;
        // Start the volume over from its surviving copies, so the run goes on.
        let vol = &mut self.volumes[v];
        for r in vol.replicas.iter_mut().filter(|r| !matches!(r.state, Copy::Away { .. })) {
            r.state = Copy::InSync;
        }
    }

    fn ret(&mut self, node: usize, disks_lost: bool) {
        self.up[node] = true;
        for (v, i) in self.on_node[node].clone() {
            self.account(v);
            let r = &mut self.volumes[v].replicas[i];
            let Copy::Away { current, since } = r.state else { continue };
            r.epoch += 1;
            if current {
                r.state = Copy::InSync;
            } else {
                // Its disks gone, the copy starts empty.
                r.state = Copy::Behind { since: if disks_lost { f64::NEG_INFINITY } else { since } };
                self.waiting[node].push_back((v, i));
            }
        }
        self.start_rebuilds(node);
        self.start_rebuilds_of_node_volumes(node);
        self.close_failures();
    }

    fn timeout(&mut self, v: usize, i: usize) {
        let old = self.volumes[v].replicas[i].node;
        if self.up[old] || matches!(self.volumes[v].replicas[i].state, Copy::Away { current: true, .. }) {
            return;
        }
        // A new replica on a live node without one of this volume.
        let taken: Vec<usize> = self.volumes[v].replicas.iter().map(|r| r.node).collect();
        let node = loop {
            let n = self.rng.below(self.cfg.nodes as u64) as usize;
            if self.up[n] && !taken.contains(&n) {
                break n;
            }
        };
        self.account(v);
        self.on_node[old].retain(|&(x, j)| (x, j) != (v, i));
        let r = &mut self.volumes[v].replicas[i];
        r.node = node;
        r.epoch += 1;
        r.state = Copy::Behind { since: f64::NEG_INFINITY };
        self.on_node[node].push((v, i));
        self.waiting[node].push_back((v, i));
        self.start_rebuilds(node);
    }

    fn rebuilt(&mut self, v: usize, i: usize) {
        let node = self.volumes[v].replicas[i].node;
        self.running[node] -= 1;
        self.account(v);
        self.volumes[v].replicas[i].state = Copy::InSync;
        self.start_rebuilds(node);
        self.close_failures();
    }

    /// Starts the queued rebuilds of `node` while it has slots and their volume an
    /// in-sync copy on a live node to copy from.
    fn start_rebuilds(&mut self, node: usize) {
        let mut held = VecDeque::new();
        while self.up[node] && self.running[node] < self.cfg.rebuild_cap {
            let Some((v, i)) = self.waiting[node].pop_front() else { break };
            let Copy::Behind { since } = self.volumes[v].replicas[i].state else { continue };
            let source = self.volumes[v].replicas.iter().any(|r| r.state == Copy::InSync && self.up[r.node]);
            if !source {
                held.push_back((v, i));
                continue;
            }
            let size = self.volumes[v].size;
            let bytes = if since.is_finite() { (self.cfg.write_rate * (self.now - since)).min(size) } else { size };
            self.rebuilt_bytes += bytes;
            self.running[node] += 1;
            let epoch = self.volumes[v].replicas[i].epoch;
            self.at(self.now + bytes / self.rate, Event::Rebuilt { volume: v, replica: i, epoch });
        }
        self.waiting[node].extend(held);
    }

    /// Nodes that queue rebuilds of the volumes on `node` may go on now.
    fn start_rebuilds_of_node_volumes(&mut self, node: usize) {
        let mut targets: Vec<usize> = self.on_node[node]
            .iter()
            .flat_map(|&(v, _)| self.volumes[v].replicas.iter().map(|r| r.node))
            .filter(|&n| n != node && !self.waiting[n].is_empty())
            .collect();
        targets.sort_unstable();
        targets.dedup();
        for n in targets {
            self.start_rebuilds(n);
        }
    }

    fn close_failures(&mut self) {
        let now = self.now;
        let mut open = std::mem::take(&mut self.open_failures);
        open.retain(|(at, vols)| {
            let done = vols.iter().all(|&v| self.full(v));
            if done {
                self.back_hours.push((now - at) / HOUR);
            }
            !done
        });
        self.open_failures = open;
    }
}

/// Runs the model once per rebuild rate (bytes per second), each from the same seed.
pub fn run(cfg: &DurabilityConfig, rates: &[f64]) -> Vec<DurabilityReport> {
    rates.iter().map(|&rate| run_at(cfg, rate)).collect()
}

fn run_at(cfg: &DurabilityConfig, rate: f64) -> DurabilityReport {
    let mut rng = Rng::new(cfg.seed);
    let count = cfg.nodes * cfg.volumes_per_node;
    let mut on_node = vec![Vec::new(); cfg.nodes];
    let volumes: Vec<Volume> = (0..count)
        .map(|v| {
            let size = (cfg.median_size as f64 * rng.normal().exp()).clamp(GIB, 4096.0 * GIB);
            let mut nodes: Vec<usize> = Vec::new();
            while nodes.len() < cfg.replicas {
                let n = rng.below(cfg.nodes as u64) as usize;
                if !nodes.contains(&n) {
                    nodes.push(n);
                }
            }
            for (i, &n) in nodes.iter().enumerate() {
                on_node[n].push((v, i));
            }
            let replicas = nodes.into_iter().map(|node| Replica { node, state: Copy::InSync, epoch: 0 }).collect();
            Volume { size, replicas, since: 0.0 }
        })
        .collect();
    let mut sim = Sim {
        cfg,
        rate,
        rng,
        failures: Rng::new(cfg.seed ^ 0x5EED_FA11),
        now: 0.0,
        queue: BinaryHeap::new(),
        events: Vec::new(),
        volumes,
        on_node,
        up: vec![true; cfg.nodes],
        running: vec![0; cfg.nodes],
        waiting: vec![VecDeque::new(); cfg.nodes],
        open_failures: Vec::new(),
        back_hours: Vec::new(),
        single_copy_seconds: 0.0,
        unavailable_seconds: 0.0,
        lost: 0,
        rebuilt_bytes: 0.0,
    };
    let end = cfg.years * YEAR;
    let failure_gap = YEAR / (cfg.failures_per_node_year * cfg.nodes as f64);
    let first = sim.failures.exponential(failure_gap);
    let node = sim.failures.below(cfg.nodes as u64) as usize;
    sim.at(first, Event::Fail(node));
    let mut failures = 0;
    while let Some(Reverse((ms, e))) = sim.queue.pop() {
        sim.now = ms as f64 / 1000.0;
        if sim.now > end {
            break;
        }
        match sim.events[e] {
            Event::Fail(node) => {
                failures += 1;
                sim.fail(node);
                let next = sim.now + sim.failures.exponential(failure_gap);
                let node = sim.failures.below(cfg.nodes as u64) as usize;
                sim.at(next, Event::Fail(node));
            }
            Event::Return { node, disks_lost } => sim.ret(node, disks_lost),
            Event::Timeout { volume, replica, epoch } if sim.volumes[volume].replicas[replica].epoch == epoch => {
                sim.timeout(volume, replica)
            }
            Event::Rebuilt { volume, replica, epoch } if sim.volumes[volume].replicas[replica].epoch == epoch => {
                sim.rebuilt(volume, replica)
            }
            Event::Timeout { .. } | Event::Rebuilt { .. } => {}
        }
    }
    sim.now = end;
    for v in 0..sim.volumes.len() {
        sim.account(v);
    }
    let mut back = sim.back_hours.clone();
    back.sort_by(f64::total_cmp);
    let pick = |q: f64| back.get(((back.len() as f64 * q) as usize).min(back.len().saturating_sub(1))).copied();
    let volume_years = count as f64 * cfg.years;
    DurabilityReport {
        rate,
        failures,
        back_mean_hours: if back.is_empty() { 0.0 } else { back.iter().sum::<f64>() / back.len() as f64 },
        back_p99_hours: pick(0.99).unwrap_or(0.0),
        back_max_hours: back.last().copied().unwrap_or(0.0),
        single_copy_hours_per_volume_year: sim.single_copy_seconds / HOUR / volume_years,
        unavailable_hours_per_volume_year: sim.unavailable_seconds / HOUR / volume_years,
        lost_volumes: sim.lost,
        lost_per_million_volume_years: sim.lost as f64 / volume_years * 1e6,
        rebuilt_bytes: sim.rebuilt_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> DurabilityConfig {
        DurabilityConfig {
            nodes: 50,
            volumes_per_node: 10,
            years: 1.0,
            failures_per_node_year: 12.0,
            ..Default::default()
        }
    }

    #[test]
    fn faster_rebuilds_restore_redundancy_sooner() {
        let r = run(&small(), &[20e6, 400e6]);
        assert!(r[0].failures > 100, "{r:?}");
        assert_eq!(r[0].failures, r[1].failures, "the same failures at every rate");
        assert!(r[1].back_mean_hours < r[0].back_mean_hours, "{r:?}");
        assert!(r[1].single_copy_hours_per_volume_year <= r[0].single_copy_hours_per_volume_year, "{r:?}");
    }

    #[test]
    fn two_copies_lose_data_where_three_do_not() {
        let harsh = DurabilityConfig { disk_loss_share: 0.5, failures_per_node_year: 50.0, ..small() };
        let two = run(&DurabilityConfig { replicas: 2, ..harsh.clone() }, &[20e6]);
        let three = run(&harsh, &[20e6]);
        assert!(two[0].lost_volumes >= three[0].lost_volumes, "{two:?} {three:?}");
        assert!(two[0].single_copy_hours_per_volume_year > three[0].single_copy_hours_per_volume_year);
    }
}

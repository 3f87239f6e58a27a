//! `nvpool sim`: a synthetic cluster replayed through the real scheduler.
//!
//! The cluster mixes storage-heavy nodes, ordinary nodes and nodes without disks.
//! Every node hosts consumers, with a demand that does not follow its own disks
//! (LightPool's observation: one node's disks sit half empty while its neighbour's
//! fill up). A stream of creations (log-normal sizes, mostly asking for local
//! placement) and deletions runs until the first creation fails; the report gives
//! how full the cluster was then and how fragmented its free space was. The run then
//! goes on, skipping failed creations, until 1% of them failed, and reports the use
//! again. Each policy replays the same stream.

use crate::scheduler::{self, Locality, NodeView, Policy, PoolView, Request, Weights};
use std::time::Instant;

const GIB: u64 = 1 << 30;

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub nodes: usize,
    /// Share of nodes with many disks.
    pub heavy_fraction: f64,
    /// Share of nodes without disks.
    pub diskless_fraction: f64,
    pub heavy_disks: u64,
    pub light_disks: u64,
    pub disk_bytes: u64,
    /// Median volume size.
    pub median_size: u64,
    /// Chance that a step deletes a random volume instead of creating one.
    pub delete_probability: f64,
    /// Shares of requests asking for local and for remote placement (the rest: any).
    pub local_share: f64,
    pub remote_share: f64,
    pub seed: u64,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            nodes: 1000,
            heavy_fraction: 0.2,
            diskless_fraction: 0.3,
            heavy_disks: 8,
            light_disks: 2,
            disk_bytes: 3840 * 1000 * 1000 * 1000, // 3.84 TB
            median_size: 200 * GIB,
            delete_probability: 0.3,
            local_share: 0.7,
            remote_share: 0.1,
            seed: 42,
        }
    }
}

/// How volumes are placed in one run.
#[derive(Clone, Copy, Debug)]
pub enum Strategy {
    /// nvpool's scheduler with the given policy, locality as requested.
    Scheduler(Policy),
    /// A volume whose host node has disks must sit there; hosts without disks are
    /// served from the emptiest node.
    LocalOnly,
}

/// The policies compared by default.
pub fn strategies() -> Vec<(&'static str, Strategy)> {
    let with =
        |locality, space| Strategy::Scheduler(Policy { weights: Weights { locality, space }, ..Policy::default() });
    vec![
        ("nvpool (locality, then fullest)", Strategy::Scheduler(Policy::default())),
        ("locality, then emptiest", with(10.0, -1.0)),
        ("most-free-first", with(0.0, -1.0)),
        ("local-only", Strategy::LocalOnly),
    ]
}

#[derive(Clone, Debug)]
pub struct SimReport {
    pub name: String,
    pub created: u64,
    pub deleted: u64,
    /// Used bytes over capacity when the first creation failed.
    pub utilisation: f64,
    /// 1 - (largest node's free space / all free space) at the first failure: 0 when
    /// the free space is one hole, near 1 when it is spread thin.
    pub fragmentation: f64,
    /// Largest free space on one node at the first failure.
    pub largest_hole: u64,
    /// Used bytes over capacity once 1% of the creations have failed (the run goes on
    /// past the first failure, skipping the ones that fail).
    pub utilisation_at_1pct: f64,
    /// Share of local-preferring requests from nodes with disks placed on that node.
    pub local_met: f64,
    pub failed_size: u64,
    pub decisions_per_second: f64,
}

/// A small deterministic generator (xorshift64*), so that runs repeat.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-12), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The synthetic cluster: node views with one pool each (empty for diskless nodes)
/// and each node's share of the demand.
pub fn build_cluster(cfg: &SimConfig) -> (Vec<NodeView>, Vec<f64>) {
    let mut rng = Rng::new(cfg.seed);
    let mut nodes = Vec::with_capacity(cfg.nodes);
    let mut demand = Vec::with_capacity(cfg.nodes);
    for i in 0..cfg.nodes {
        let r = rng.unit();
        let disks = if r < cfg.diskless_fraction {
            0
        } else if r < cfg.diskless_fraction + cfg.heavy_fraction {
            cfg.heavy_disks
        } else {
            cfg.light_disks
        };
        let pools = if disks == 0 {
            vec![]
        } else {
            vec![PoolView {
                name: "p".into(),
                capacity: disks * cfg.disk_bytes,
                committed: 0,
                provisioned: 0,
                cluster_size: GIB,
                failed: None,
            }]
        };
        nodes.push(NodeView { name: format!("node-{i:05}"), healthy: true, pools });
        // Demand is log-normal across nodes and independent of their disks.
        demand.push(rng.normal().exp());
    }
    let total: f64 = demand.iter().sum();
    let mut acc = 0.0;
    let cumulative = demand.iter().map(|d| {
        acc += d / total;
        acc
    });
    (nodes, cumulative.collect())
}

fn pick_host(rng: &mut Rng, cumulative: &[f64]) -> usize {
    let u = rng.unit();
    cumulative.partition_point(|&c| c < u).min(cumulative.len() - 1)
}

/// Replays the stream under one strategy until the first creation fails.
pub fn run(cfg: &SimConfig, name: &str, strategy: Strategy) -> SimReport {
    let (mut nodes, cumulative) = build_cluster(cfg);
    let mut rng = Rng::new(cfg.seed ^ 0x5151);
    // (node, size) of each live volume
    let mut volumes: Vec<(usize, u64)> = Vec::new();
    let (mut created, mut deleted, mut local_asked, mut local_met) = (0u64, 0u64, 0u64, 0u64);
    let mut decisions = 0u64;
    let mut failures = 0u64;
    let mut first_failure: Option<SimReport> = None;
    let started = Instant::now();
    let sigma = 1.0;
    loop {
        if !volumes.is_empty() && rng.unit() < cfg.delete_probability {
            let (node, size) = volumes.swap_remove(rng.below(volumes.len()));
            let pool = &mut nodes[node].pools[0];
            pool.committed -= scheduler::thick_bytes(size, pool.cluster_size);
            pool.provisioned -= size;
            deleted += 1;
            continue;
        }
        let host = pick_host(&mut rng, &cumulative);
        let size = ((cfg.median_size as f64) * (sigma * rng.normal()).exp())
            .clamp(16.0 * GIB as f64, 4096.0 * GIB as f64) as u64;
        let r = rng.unit();
        let locality = if r < cfg.local_share {
            Locality::Local
        } else if r < cfg.local_share + cfg.remote_share {
            Locality::Remote
        } else {
            Locality::Any
        };
        let host_has_disks = !nodes[host].pools.is_empty();
        let mut req =
            Request { size, thin: false, locality, host_node: nodes[host].name.clone(), ..Request::default() };
        let policy = match strategy {
            Strategy::Scheduler(p) => p,
            Strategy::LocalOnly => {
                if host_has_disks {
                    req.include = vec![nodes[host].name.clone()];
                } else {
                    req.locality = Locality::Any;
                }
                Policy { weights: Weights { locality: 0.0, space: -1.0 }, ..Policy::default() }
            }
        };
        decisions += 1;
        let Some((node, pool)) = scheduler::choose(&nodes, &req, &policy) else {
            failures += 1;
            let first = first_failure.get_or_insert_with(|| {
                report(name, &nodes, created, deleted, size, local_asked, local_met, decisions, started)
            });
            if failures * 100 >= created + failures {
                first.utilisation_at_1pct = used_share(&nodes);
                first.decisions_per_second = decisions as f64 / started.elapsed().as_secs_f64();
                return first.clone();
            }
            continue;
        };
        if locality == Locality::Local && host_has_disks {
            local_asked += 1;
            local_met += u64::from(node == host);
        }
        let p = &mut nodes[node].pools[pool];
        p.committed += scheduler::thick_bytes(size, p.cluster_size);
        p.provisioned += size;
        volumes.push((node, size));
        created += 1;
    }
}

fn used_share(nodes: &[NodeView]) -> f64 {
    let (capacity, used) =
        nodes.iter().flat_map(|n| &n.pools).fold((0u64, 0u64), |(c, u), p| (c + p.capacity, u + p.committed));
    used as f64 / capacity as f64
}

#[allow(clippy::too_many_arguments)]
fn report(
    name: &str,
    nodes: &[NodeView],
    created: u64,
    deleted: u64,
    failed_size: u64,
    local_asked: u64,
    local_met: u64,
    decisions: u64,
    started: Instant,
) -> SimReport {
    let holes = nodes.iter().flat_map(|n| &n.pools).map(|p| p.capacity - p.committed);
    let free: u64 = holes.clone().sum();
    let largest_hole = holes.max().unwrap_or(0);
    SimReport {
        name: name.into(),
        created,
        deleted,
        utilisation: used_share(nodes),
        fragmentation: if free == 0 { 0.0 } else { 1.0 - largest_hole as f64 / free as f64 },
        largest_hole,
        utilisation_at_1pct: 0.0,
        local_met: if local_asked == 0 { 0.0 } else { local_met as f64 / local_asked as f64 },
        failed_size,
        decisions_per_second: decisions as f64 / started.elapsed().as_secs_f64(),
    }
}

/// Scheduler speed on a cluster filled to about half: `choose` is the decision alone,
/// `place` also explains the best 32 nodes, as the controller's CreateVolume does.
pub struct BenchReport {
    pub nodes: usize,
    pub utilisation: f64,
    pub rows: Vec<(String, u64, f64, f64, f64)>, // name, decisions, per second, p50 µs, p99 µs
}

pub fn bench(cfg: &SimConfig, decisions: usize) -> BenchReport {
    let (mut nodes, cumulative) = build_cluster(cfg);
    let policy = Policy::default();
    let mut rng = Rng::new(cfg.seed ^ 0xBE4C);
    let capacity: u64 = nodes.iter().flat_map(|n| &n.pools).map(|p| p.capacity).sum();
    let mut used = 0u64;
    let request = |rng: &mut Rng, nodes: &[NodeView]| {
        let host = pick_host(rng, &cumulative);
        let size = ((cfg.median_size as f64) * rng.normal().exp()).clamp(16.0 * GIB as f64, 4096.0 * GIB as f64) as u64;
        Request {
            size,
            thin: false,
            locality: Locality::Local,
            host_node: nodes[host].name.clone(),
            ..Request::default()
        }
    };
    while used < capacity / 2 {
        let req = request(&mut rng, &nodes);
        let Some((n, p)) = scheduler::choose(&nodes, &req, &policy) else { break };
        let pool = &mut nodes[n].pools[p];
        pool.committed += scheduler::thick_bytes(req.size, pool.cluster_size);
        used += scheduler::thick_bytes(req.size, pool.cluster_size);
    }
    let mut rows = Vec::new();
    for (name, count) in [
        ("choose (decision only)", decisions),
        ("place (as CreateVolume: scores all, explains the best 32)", decisions / 4),
    ] {
        let requests: Vec<Request> = (0..count).map(|_| request(&mut rng, &nodes)).collect();
        let mut lat = Vec::with_capacity(count);
        let started = Instant::now();
        for req in &requests {
            let t = Instant::now();
            if name.starts_with("choose") {
                std::hint::black_box(scheduler::choose(&nodes, req, &policy));
            } else {
                std::hint::black_box(scheduler::place(&nodes, req, &policy, 32));
            }
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let total = started.elapsed().as_secs_f64();
        lat.sort_by(f64::total_cmp);
        let pct = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
        rows.push((name.to_string(), count as u64, count as f64 / total, pct(0.5), pct(0.99)));
    }
    BenchReport { nodes: nodes.len(), utilisation: used as f64 / capacity as f64, rows }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_run_repeats_and_pooling_beats_local_only() {
        let cfg = SimConfig { nodes: 60, ..SimConfig::default() };
        let a = run(&cfg, "nvpool", Strategy::Scheduler(Policy::default()));
        let b = run(&cfg, "nvpool", Strategy::Scheduler(Policy::default()));
        assert_eq!((a.created, a.deleted), (b.created, b.deleted), "the same seed replays the same run");
        let local = run(&cfg, "local-only", Strategy::LocalOnly);
        assert!(a.utilisation > local.utilisation, "{} vs {}", a.utilisation, local.utilisation);
        assert!(a.utilisation <= 1.0 && a.utilisation_at_1pct <= 1.0);
        assert!(a.fragmentation <= 1.0 && a.local_met <= 1.0);
    }
}

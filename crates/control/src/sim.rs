//! `nvpool sim`: a synthetic cluster replayed through the real scheduler.
//!
//! The cluster mixes storage-heavy nodes, ordinary nodes and nodes without disks.
//! Pods arrive one at a time, each on a node, and ask for one to three volumes that
//! live as long as the pod. Database pods ask for volumes on their own node; they run
//! where the disks are, more on storage-heavy nodes (as in LightPool's OceanBase
//! clusters), with a log-normal spread on top that disks do not explain. Other pods
//! run anywhere and take their volumes from anywhere. Pods live an exponential time:
//! most long enough that the pool fills, some only briefly.
//!
//! The stream runs until the first volume fails to find room; the report gives how
//! full the pool was then and how many local requests got their own node. The run
//! then goes on, skipping failed volumes, until 1% of them failed, and reports the use
//! again. Every policy replays the same stream (the same pods, sizes and lifetimes).
//!
//! With migration on, a local request whose node is full first moves a few volumes
//! that did not ask for that node off it (as hot migration would), and the bytes moved
//! are reported.

use crate::room;
use crate::scheduler::{self, Locality, NodeView, Policy, PoolView, Request, Weights};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

const GIB: u64 = 1 << 30;

/// Where pods, and so the local requests, come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Demand {
    /// Database pods go to nodes in proportion to their disks (plus half a disk, so
    /// that a few land on nodes without disks) times each node's spread; other pods go
    /// to any node in proportion to its spread.
    FollowsDisks,
    /// Every pod goes to a node by one log-normal weight that ignores its disks: the
    /// model of the first simulator, kept to show how policies fare when local demand
    /// does not follow the disks at all.
    Independent,
}

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
    /// Median volume size (log-normal, sigma 1, from 16 GiB to 4 TiB).
    pub median_size: u64,
    /// Each pod asks for 1 to this many volumes.
    pub volumes_per_pod: u64,
    /// Shares of pods asking for local and for remote placement (the rest: any).
    pub local_share: f64,
    pub remote_share: f64,
    pub demand: Demand,
    /// Sigma of each node's log-normal demand factor.
    pub demand_spread: f64,
    /// Mean lifetime of long-lived pods, in pod arrivals that would fill the pool once.
    pub lifetime: f64,
    /// Share of pods that live a twentieth of that (tests, batch jobs).
    pub short_lived_share: f64,
    /// Share of volumes whose owners allow hot migration.
    pub movable_share: f64,
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
            volumes_per_pod: 3,
            local_share: 0.7,
            remote_share: 0.1,
            demand: Demand::FollowsDisks,
            demand_spread: 0.5,
            lifetime: 2.0,
            short_lived_share: 0.3,
            movable_share: 0.5,
            seed: 42,
        }
    }
}

/// How volumes are placed in one run.
#[derive(Clone, Copy, Debug)]
pub enum Strategy {
    /// nvpool's scheduler with the given policy, locality as requested; with
    /// `migrate`, a local request whose node is full moves volumes off it first.
    Scheduler { policy: Policy, migrate: bool },
    /// A volume whose host node has disks must sit there; hosts without disks are
    /// served from the emptiest node.
    LocalOnly,
}

/// The policies `nvpool sim` knows: name, description, strategy. The first is the
/// controller's default.
pub fn policies() -> Vec<(&'static str, &'static str, Strategy)> {
    let weights =
        |locality, reserve, space| Policy { weights: Weights { locality, reserve, space }, ..Policy::default() };
    let emptiest = weights(10.0, 0.0, -1.0);
    vec![
        (
            "reserve",
            "nvpool: locality, then local reserves, then most unreserved room",
            Strategy::Scheduler { policy: Policy::default(), migrate: false },
        ),
        (
            "reserve+migrate",
            "the same, and migration makes room when a volume does not fit",
            Strategy::Scheduler { policy: Policy::default(), migrate: true },
        ),
        ("emptiest+migrate", "no reserves, with migration", Strategy::Scheduler { policy: emptiest, migrate: true }),
        (
            "fullest",
            "before reserves: locality, then fullest",
            Strategy::Scheduler { policy: weights(10.0, 0.0, 1.0), migrate: false },
        ),
        ("emptiest", "locality, then emptiest", Strategy::Scheduler { policy: emptiest, migrate: false }),
        ("most-free", "most-free-first", Strategy::Scheduler { policy: weights(0.0, 0.0, -1.0), migrate: false }),
        ("local-only", "local-only", Strategy::LocalOnly),
    ]
}

/// A policy by name, or `weights:LOCALITY/RESERVE/SPACE` (with `+migrate` to migrate).
pub fn policy_named(name: &str) -> Result<Strategy, String> {
    if let Some((_, _, s)) = policies().into_iter().find(|(n, _, _)| *n == name) {
        return Ok(s);
    }
    let known = || policies().iter().map(|(n, _, _)| *n).collect::<Vec<_>>().join(", ");
    let spec = name
        .strip_prefix("weights:")
        .ok_or_else(|| format!("unknown policy {name:?}: use one of {}, or weights:L/R/S", known()))?;
    let (spec, migrate) = match spec.strip_suffix("+migrate") {
        Some(s) => (s, true),
        None => (spec, false),
    };
    let w: Vec<f64> = spec
        .split('/')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|_| format!("{name:?}: weights are three numbers, LOCALITY/RESERVE/SPACE, e.g. weights:10/2/1"))?;
    let [locality, reserve, space] = w[..] else {
        return Err(format!("{name:?}: weights are three numbers, LOCALITY/RESERVE/SPACE, e.g. weights:10/2/1"));
    };
    Ok(Strategy::Scheduler {
        policy: Policy { weights: Weights { locality, reserve, space }, ..Policy::default() },
        migrate,
    })
}

#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    pub policy: String,
    /// Volumes created and deleted until the first failure.
    pub created: u64,
    pub deleted: u64,
    /// Used bytes over capacity when the first creation failed.
    pub utilisation: f64,
    /// Size of the volume that failed first.
    pub failed_size: u64,
    /// Largest free space on one node at the first failure.
    pub largest_hole: u64,
    /// 1 - (largest node's free space / all free space) at the first failure: 0 when
    /// the free space is one hole, near 1 when it is spread thin.
    pub fragmentation: f64,
    /// Share of the volumes asking for local placement from nodes with disks that got
    /// their node, until the first failure.
    pub local_met: f64,
    /// The same, for the requests made while the pool was at least 90% used: how the
    /// policy holds up when space is short. None when the first failure came before.
    pub local_met_when_full: Option<f64>,
    /// Used bytes over capacity once 1% of the creations have failed.
    pub utilisation_at_1pct: f64,
    /// Volumes and bytes moved by migration until the first failure.
    pub migrations: u64,
    pub migrated_bytes: u64,
    /// Migrated bytes per volume created, until the first failure.
    pub migrated_per_placement: u64,
    /// Placement requests decided per second of the whole run (scheduler, migration
    /// and the simulator's own bookkeeping).
    pub decisions_per_second: f64,
}

/// A small deterministic generator (xorshift64*), so that runs repeat (the
/// replication model, `durability.rs`, draws from it too).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
    /// Standard normal (Box-Muller).
    pub(crate) fn normal(&mut self) -> f64 {
        let (u, v) = (self.unit().max(1e-12), self.unit());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
    pub(crate) fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// Cumulative shares of a set of weights, to draw from.
struct Picker(Vec<f64>);

impl Picker {
    fn new(weights: impl Iterator<Item = f64>) -> Picker {
        let weights: Vec<f64> = weights.collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        Picker(
            weights
                .iter()
                .map(|w| {
                    acc += w / total;
                    acc
                })
                .collect(),
        )
    }
    fn pick(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1)
    }
}

/// The synthetic cluster: nodes with one pool each (none for nodes without disks) and
/// where database pods and other pods land.
struct Layout {
    nodes: Vec<NodeView>,
    local_pods: Picker,
    other_pods: Picker,
}

fn layout(cfg: &SimConfig) -> Layout {
    let mut rng = Rng::new(cfg.seed);
    let mut nodes = Vec::with_capacity(cfg.nodes);
    let (mut local_weights, mut other_weights) = (Vec::new(), Vec::new());
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
        nodes.push(NodeView { name: format!("node-{i:05}"), healthy: true, pools, ..NodeView::default() });
        let spread = (cfg.demand_spread * rng.normal()).exp();
        match cfg.demand {
            Demand::FollowsDisks => {
                local_weights.push((disks as f64 + 0.5) * spread);
                other_weights.push((cfg.demand_spread * rng.normal()).exp());
            }
            Demand::Independent => {
                local_weights.push(spread);
                other_weights.push(spread);
            }
        }
    }
    Layout {
        nodes,
        local_pods: Picker::new(local_weights.into_iter()),
        other_pods: Picker::new(other_weights.into_iter()),
    }
}

/// Volume sizes: log-normal around the median, from 16 GiB to 4 TiB.
fn volume_size(rng: &mut Rng, median: u64) -> u64 {
    ((median as f64) * rng.normal().exp()).clamp(16.0 * GIB as f64, 4096.0 * GIB as f64) as u64
}

/// One pod of the stream: where it runs, what it asks for and how long it lives.
struct Pod {
    host: usize,
    locality: Locality,
    sizes: Vec<u64>,
    movable: Vec<bool>,
    lifetime: f64,
}

/// The stream of pods, the same for every policy.
struct Stream {
    rng: Rng,
    long_life: f64,
}

impl Stream {
    fn new(cfg: &SimConfig, capacity: u64) -> Stream {
        // Mean bytes per pod: (1 + max) / 2 volumes of e^(1/2) times the median.
        let pod_bytes = (1 + cfg.volumes_per_pod) as f64 / 2.0 * cfg.median_size as f64 * 0.5f64.exp();
        Stream { rng: Rng::new(cfg.seed ^ 0x5151), long_life: cfg.lifetime * capacity as f64 / pod_bytes }
    }

    fn next(&mut self, cfg: &SimConfig, layout: &Layout) -> Pod {
        let rng = &mut self.rng;
        let r = rng.unit();
        let locality = if r < cfg.local_share {
            Locality::Local
        } else if r < cfg.local_share + cfg.remote_share {
            Locality::Remote
        } else {
            Locality::Any
        };
        let host = if locality == Locality::Local { layout.local_pods.pick(rng) } else { layout.other_pods.pick(rng) };
        let count = 1 + rng.below(cfg.volumes_per_pod.max(1)) as usize;
        let sizes = (0..count).map(|_| volume_size(rng, cfg.median_size)).collect();
        let movable = (0..count).map(|_| rng.unit() < cfg.movable_share).collect();
        let short = rng.unit() < cfg.short_lived_share;
        let lifetime = rng.exponential(if short { self.long_life / 20.0 } else { self.long_life });
        Pod { host, locality, sizes, movable, lifetime }
    }
}

/// What a rebalancing moved.
struct Moved {
    volumes: u64,
    bytes: u64,
}

struct Volume {
    node: usize,
    size: u64,
    host: usize,
    locality: Locality,
    movable: bool,
    /// Its index in `Cluster::on_node[node]`.
    slot: usize,
}

/// Whether a volume on `node` may be migrated away: its owner allows it, and it is not
/// one that the node's own pods asked to have there.
fn may_leave(v: &Volume, node: usize) -> bool {
    v.movable && !(v.locality == Locality::Local && v.host == node)
}

/// The cluster's state during a run: the scheduler's view plus each volume's place.
struct Cluster {
    nodes: Vec<NodeView>,
    volumes: Vec<Option<Volume>>,
    on_node: Vec<Vec<usize>>,
    /// Bytes of each node's volumes that may move away (see `movable`).
    movable_bytes: Vec<u64>,
    capacity: u64,
    used: u64,
}

impl Cluster {
    fn new(nodes: Vec<NodeView>) -> Cluster {
        let capacity = nodes.iter().flat_map(|n| &n.pools).map(|p| p.capacity).sum();
        Cluster {
            on_node: vec![Vec::new(); nodes.len()],
            movable_bytes: vec![0; nodes.len()],
            nodes,
            volumes: Vec::new(),
            capacity,
            used: 0,
        }
    }

    fn used_share(&self) -> f64 {
        self.used as f64 / self.capacity as f64
    }

    fn free(&self, node: usize) -> u64 {
        self.nodes[node].pools.first().map_or(0, |p| p.capacity - p.committed)
    }

    fn request(&self, size: u64, locality: Locality, host: usize) -> Request {
        Request { size, locality, host_node: self.nodes[host].name.clone(), ..Request::default() }
    }

    /// Puts a volume on `node` (its only pool) and counts it in the views.
    fn attach(&mut self, id: usize, node: usize) {
        let v = self.volumes[id].as_mut().expect("a live volume");
        v.node = node;
        v.slot = self.on_node[node].len();
        self.on_node[node].push(id);
        let (size, host, locality) = (v.size, v.host, v.locality);
        if may_leave(v, node) {
            self.movable_bytes[node] += size;
        }
        let pool = &mut self.nodes[node].pools[0];
        let bytes = scheduler::thick_bytes(size, pool.cluster_size);
        pool.committed += bytes;
        pool.provisioned += size;
        self.used += bytes;
        if locality == Locality::Local && host == node {
            self.nodes[node].local_held += size;
        }
    }

    /// Takes a volume off its node.
    fn detach(&mut self, id: usize) {
        let v = self.volumes[id].as_ref().expect("a live volume");
        let (node, slot, size, host, locality) = (v.node, v.slot, v.size, v.host, v.locality);
        if may_leave(v, node) {
            self.movable_bytes[node] -= size;
        }
        self.on_node[node].swap_remove(slot);
        if let Some(&moved) = self.on_node[node].get(slot) {
            self.volumes[moved].as_mut().expect("a live volume").slot = slot;
        }
        let pool = &mut self.nodes[node].pools[0];
        let bytes = scheduler::thick_bytes(size, pool.cluster_size);
        pool.committed -= bytes;
        pool.provisioned -= size;
        self.used -= bytes;
        if locality == Locality::Local && host == node {
            self.nodes[node].local_held -= size;
        }
    }

    fn create(&mut self, node: usize, size: u64, host: usize, locality: Locality, movable: bool) -> usize {
        if locality == Locality::Local {
            self.nodes[host].local_demand += size;
        }
        self.volumes.push(Some(Volume { node, size, host, locality, movable, slot: 0 }));
        let id = self.volumes.len() - 1;
        self.attach(id, node);
        id
    }

    fn delete(&mut self, id: usize) {
        self.detach(id);
        let v = self.volumes[id].take().expect("a live volume");
        if v.locality == Locality::Local {
            self.nodes[v.host].local_demand -= v.size;
        }
    }

    /// Frees room for a volume that fits nowhere, on the node that needs the fewest
    /// bytes moved (of those whose movable volumes could make the room), as
    /// `make_room` does. Returns the node and what moved.
    fn make_hole(&mut self, size: u64, policy: &Policy) -> Option<(usize, Moved)> {
        let nodes = (0..self.nodes.len()).filter(|&n| !self.nodes[n].pools.is_empty()).map(|n| {
            let deficit = scheduler::thick_bytes(size, GIB).saturating_sub(self.free(n));
            (deficit, self.movable_bytes[n], n)
        });
        room::hole_candidates(nodes).into_iter().find_map(|n| self.make_room(n, size, policy).map(|moved| (n, moved)))
    }

    /// The volumes on `node` that may move away, as (size, id).
    fn movable(&self, node: usize) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.on_node[node]
            .iter()
            .map(|&id| (id, self.volumes[id].as_ref().expect("a live volume")))
            .filter(move |(_, v)| may_leave(v, node))
            .map(|(id, v)| (v.size, id))
    }

    /// Frees room on `host` for `size` bytes by migrating the volumes that
    /// `room::evictions` picks among those that did not ask for this node, to nodes
    /// the scheduler picks. Returns what moved, or `None` (and moves nothing)
    /// when it cannot.
    fn make_room(&mut self, host: usize, size: u64, policy: &Policy) -> Option<Moved> {
        let need = scheduler::thick_bytes(size, self.nodes[host].pools.first()?.cluster_size);
        let deficit = need.checked_sub(self.free(host)).filter(|&d| d > 0)?;
        let chosen = room::evictions(self.movable(host).collect(), deficit, size)?;
        let bytes: u64 = chosen.iter().map(|(s, _)| s).sum();
        let mut moved = Vec::new();
        for &(size, id) in &chosen {
            let v = self.volumes[id].as_ref().expect("a live volume");
            let mut req = self.request(size, v.locality, v.host);
            req.exclude = vec![self.nodes[host].name.clone()];
            match scheduler::choose(&self.nodes, &req, policy) {
                Some((to, _)) => {
                    self.detach(id);
                    self.attach(id, to);
                    moved.push(id);
                }
                None => {
                    for id in moved {
                        self.detach(id);
                        self.attach(id, host);
                    }
                    return None;
                }
            }
        }
        Some(Moved { volumes: chosen.len() as u64, bytes })
    }
}

/// Replays the stream under one strategy until 1% of the creations failed.
pub fn run(cfg: &SimConfig, name: &str, strategy: Strategy) -> SimReport {
    let layout = layout(cfg);
    let mut cluster = Cluster::new(layout.nodes.clone());
    let mut stream = Stream::new(cfg, cluster.capacity);
    // (time of death, pod) in arrival order; each pod's volumes
    let mut deaths: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut pods: Vec<Vec<usize>> = Vec::new();
    let (mut created, mut deleted, mut failures, mut decisions) = (0u64, 0u64, 0u64, 0u64);
    let (mut local_asked, mut local_met, mut full_asked, mut full_met) = (0u64, 0u64, 0u64, 0u64);
    let (mut migrations, mut migrated_bytes) = (0u64, 0u64);
    let mut first_failure: Option<SimReport> = None;
    let started = Instant::now();
    for now in 0u64.. {
        while let Some(&Reverse((at, pod))) = deaths.peek()
            && at <= now
        {
            deaths.pop();
            for id in std::mem::take(&mut pods[pod]) {
                cluster.delete(id);
                deleted += 1;
            }
        }
        let pod = stream.next(cfg, &layout);
        let host_has_disks = !cluster.nodes[pod.host].pools.is_empty();
        let mut ids = Vec::new();
        for (&size, &movable) in pod.sizes.iter().zip(&pod.movable) {
            decisions += 1;
            let mut req = cluster.request(size, pod.locality, pod.host);
            let (policy, migrate) = match strategy {
                Strategy::Scheduler { policy, migrate } => (policy, migrate),
                Strategy::LocalOnly => {
                    if host_has_disks {
                        req.include = vec![req.host_node.clone()];
                    } else {
                        req.locality = Locality::Any;
                    }
                    (
                        Policy { weights: Weights { locality: 0.0, reserve: 0.0, space: -1.0 }, ..Policy::default() },
                        false,
                    )
                }
            };
            let mut chosen = scheduler::choose(&cluster.nodes, &req, &policy).map(|(n, _)| n);
            let wants_home = pod.locality == Locality::Local && host_has_disks;
            if migrate
                && wants_home
                && chosen != Some(pod.host)
                && let Some(moved) = cluster.make_room(pod.host, size, &policy)
            {
                // The controller places a volume that fits elsewhere there at once and
                // brings it home once the room is made: its own bytes move too. (One
                // that fits nowhere is refused, and lands at home when retried.)
                let home_move = chosen.is_some();
                chosen = Some(pod.host);
                if first_failure.is_none() {
                    migrations += moved.volumes + u64::from(home_move);
                    migrated_bytes += moved.bytes + if home_move { size } else { 0 };
                }
            }
            if migrate
                && chosen.is_none()
                && let Some((node, moved)) = cluster.make_hole(size, &policy)
            {
                chosen = Some(node);
                if first_failure.is_none() {
                    migrations += moved.volumes;
                    migrated_bytes += moved.bytes;
                }
            }
            let Some(node) = chosen else {
                failures += 1;
                let first = first_failure.get_or_insert_with(|| SimReport {
                    policy: name.into(),
                    created,
                    deleted,
                    utilisation: cluster.used_share(),
                    failed_size: size,
                    local_met: share(local_met, local_asked),
                    local_met_when_full: (full_asked > 0).then(|| share(full_met, full_asked)),
                    migrations,
                    migrated_bytes,
                    migrated_per_placement: migrated_bytes / created.max(1),
                    ..free_space(&cluster)
                });
                if failures * 100 >= created + failures {
                    first.utilisation_at_1pct = cluster.used_share();
                    first.decisions_per_second = decisions as f64 / started.elapsed().as_secs_f64();
                    return first.clone();
                }
                continue;
            };
            if wants_home && first_failure.is_none() {
                local_asked += 1;
                local_met += u64::from(node == pod.host);
                if cluster.used_share() >= 0.9 {
                    full_asked += 1;
                    full_met += u64::from(node == pod.host);
                }
            }
            ids.push(cluster.create(node, size, pod.host, pod.locality, movable));
            if first_failure.is_none() {
                created += 1;
            }
        }
        deaths.push(Reverse((now + pod.lifetime.ceil() as u64, pods.len())));
        pods.push(ids);
    }
    unreachable!("the stream is endless")
}

/// One step of the stream as the simulator took it: a volume made on the node the
/// scheduler chose, or deleted when its pod ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Create { volume: usize, size: u64, locality: Locality, host: String, node: String },
    Delete { volume: usize },
}

/// The simulator's run under the controller's default policy, without migration, as
/// steps to replay through a controller (`nvpool fleet --replay`).
pub struct Placements {
    /// The nodes, each with its one pool (none for a node without disks), empty.
    pub nodes: Vec<NodeView>,
    pub steps: Vec<Step>,
    /// Whether the steps end where a creation found no room (else at `creations`).
    pub ended_full: bool,
}

/// The stream's first `creations` creations (or those before the first that finds
/// no room), with the deletions between them, as `run` takes them under the
/// "reserve" policy.
pub fn placements(cfg: &SimConfig, creations: usize) -> Placements {
    let layout = layout(cfg);
    let policy = Policy::default();
    let mut cluster = Cluster::new(layout.nodes.clone());
    let mut stream = Stream::new(cfg, cluster.capacity);
    let mut deaths: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let mut pods: Vec<Vec<usize>> = Vec::new();
    let (mut steps, mut made) = (Vec::new(), 0);
    let done = |steps: Vec<Step>, ended_full| Placements { nodes: layout.nodes.clone(), steps, ended_full };
    for now in 0u64.. {
        while let Some(&Reverse((at, pod))) = deaths.peek()
            && at <= now
        {
            deaths.pop();
            for volume in std::mem::take(&mut pods[pod]) {
                cluster.delete(volume);
                steps.push(Step::Delete { volume });
            }
        }
        let pod = stream.next(cfg, &layout);
        let mut ids = Vec::new();
        for &size in &pod.sizes {
            let req = cluster.request(size, pod.locality, pod.host);
            let Some((node, _)) = scheduler::choose(&cluster.nodes, &req, &policy) else {
                return done(steps, true);
            };
            let volume = cluster.create(node, size, pod.host, pod.locality, false);
            let node = cluster.nodes[node].name.clone();
            steps.push(Step::Create { volume, size, locality: pod.locality, host: req.host_node, node });
            ids.push(volume);
            made += 1;
            if made == creations {
                return done(steps, false);
            }
        }
        deaths.push(Reverse((now + pod.lifetime.ceil() as u64, pods.len())));
        pods.push(ids);
    }
    unreachable!("the stream is endless")
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 { 0.0 } else { part as f64 / whole as f64 }
}

/// A report with only the free space's shape filled in.
fn free_space(cluster: &Cluster) -> SimReport {
    let holes = cluster.nodes.iter().flat_map(|n| &n.pools).map(|p| p.capacity - p.committed);
    let free: u64 = holes.clone().sum();
    let largest_hole = holes.max().unwrap_or(0);
    SimReport {
        policy: String::new(),
        created: 0,
        deleted: 0,
        utilisation: 0.0,
        failed_size: 0,
        largest_hole,
        fragmentation: if free == 0 { 0.0 } else { 1.0 - largest_hole as f64 / free as f64 },
        local_met: 0.0,
        local_met_when_full: None,
        utilisation_at_1pct: 0.0,
        migrations: 0,
        migrated_bytes: 0,
        migrated_per_placement: 0,
        decisions_per_second: 0.0,
    }
}

/// Scheduler speed on a cluster filled to about half by the stream, for the default
/// policy and the one before reserves side by side: `choose` is the decision alone,
/// `place` also explains the best 32 nodes, as the controller's CreateVolume does.
pub struct BenchReport {
    pub nodes: usize,
    pub utilisation: f64,
    pub rows: Vec<(String, u64, f64, f64, f64)>, // name, decisions, per second, p50 µs, p99 µs
}

pub fn bench(cfg: &SimConfig, decisions: usize) -> BenchReport {
    let layout = layout(cfg);
    let mut rows = Vec::new();
    let mut utilisation = 0.0;
    for name in ["reserve", "fullest"] {
        let Ok(Strategy::Scheduler { policy, .. }) = policy_named(name) else { unreachable!("a scheduler policy") };
        let mut cluster = Cluster::new(layout.nodes.clone());
        let mut stream = Stream::new(cfg, cluster.capacity);
        let mut requests = Vec::new();
        while requests.len() < decisions {
            let pod = stream.next(cfg, &layout);
            for &size in &pod.sizes {
                let req = cluster.request(size, pod.locality, pod.host);
                if cluster.used_share() < 0.5 {
                    if let Some((n, _)) = scheduler::choose(&cluster.nodes, &req, &policy) {
                        cluster.create(n, size, pod.host, pod.locality, false);
                    }
                } else {
                    requests.push(req);
                }
            }
        }
        utilisation = cluster.used_share();
        for (path, count) in
            [("choose (decision only)", decisions), ("place (scores all, explains the best 32)", decisions / 4)]
        {
            let mut lat = Vec::with_capacity(count);
            let started = Instant::now();
            for req in &requests[..count] {
                let t = Instant::now();
                if path.starts_with("choose") {
                    std::hint::black_box(scheduler::choose(&cluster.nodes, req, &policy));
                } else {
                    std::hint::black_box(scheduler::place(&cluster.nodes, req, &policy, 32));
                }
                lat.push(t.elapsed().as_secs_f64() * 1e6);
            }
            let total = started.elapsed().as_secs_f64();
            lat.sort_by(f64::total_cmp);
            let pct = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
            rows.push((format!("{name}: {path}"), count as u64, count as f64 / total, pct(0.5), pct(0.99)));
        }
    }
    BenchReport { nodes: layout.nodes.len(), utilisation, rows }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SimConfig {
        SimConfig { nodes: 60, ..SimConfig::default() }
    }

    /// Every figure but the speed.
    fn figures(r: &SimReport) -> serde_json::Value {
        let mut v = serde_json::to_value(r).unwrap();
        v.as_object_mut().unwrap().remove("decisions_per_second");
        v
    }

    #[test]
    fn a_seed_replays_the_same_run_under_every_policy() {
        for (name, _, strategy) in policies() {
            let (a, b) = (run(&small(), name, strategy), run(&small(), name, strategy));
            assert_eq!(figures(&a), figures(&b), "{name}");
            assert!(a.utilisation <= 1.0 && a.utilisation_at_1pct <= 1.0 && a.local_met <= 1.0, "{name}: {a:?}");
        }
        let other = run(&SimConfig { seed: 7, ..small() }, "reserve", policies()[0].2);
        assert_ne!(figures(&other), figures(&run(&small(), "reserve", policies()[0].2)), "another seed, another run");
    }

    #[test]
    fn pooling_beats_local_only_and_only_migration_moves_bytes() {
        let get = |name| run(&small(), name, policy_named(name).unwrap());
        let (reserve, local) = (get("reserve"), get("local-only"));
        assert!(reserve.utilisation > local.utilisation, "{reserve:?} vs {local:?}");
        assert_eq!(reserve.migrated_bytes, 0);
        let migrate = get("reserve+migrate");
        assert!(migrate.migrations > 0 && migrate.migrated_bytes > 0, "{migrate:?}");
    }

    #[test]
    fn the_cluster_books_every_byte_through_creations_migrations_and_deletions() {
        let layout = layout(&small());
        let mut c = Cluster::new(layout.nodes.clone());
        let disks: Vec<usize> = (0..c.nodes.len()).filter(|&n| !c.nodes[n].pools.is_empty()).collect();
        let (a, b) = (disks[0], disks[1]);
        let local = c.create(a, 100 * GIB, a, Locality::Local, false);
        let other = c.create(a, 50 * GIB, b, Locality::Any, true);
        assert_eq!((c.nodes[a].local_demand, c.nodes[a].local_held), (100 * GIB, 100 * GIB));
        // Fill node a so that a new local request needs the movable volume gone.
        let filler = c.free(a) - 20 * GIB;
        let pinned = c.create(a, filler, b, Locality::Any, false);
        assert!(c.make_room(a, 60 * GIB, &Policy::default()).is_some());
        assert_ne!(c.volumes[other].as_ref().unwrap().node, a, "the movable volume left");
        assert_eq!(c.volumes[local].as_ref().unwrap().node, a, "the node's own volume stayed");
        for id in [local, other, pinned] {
            c.delete(id);
        }
        assert_eq!(c.used, 0);
        assert!(c.nodes.iter().all(|n| n.local_demand == 0 && n.local_held == 0));
        assert!(c.nodes.iter().flat_map(|n| &n.pools).all(|p| p.committed == 0 && p.provisioned == 0));
        assert!(c.on_node.iter().all(Vec::is_empty));
    }

    /// The steps to replay are the run's: as many creations and deletions as `run`
    /// makes under "reserve" before its first failure.
    #[test]
    fn placements_are_the_runs_until_its_first_failure() {
        let cfg = small();
        let Ok(strategy) = policy_named("reserve") else { unreachable!("a known policy") };
        let report = run(&cfg, "reserve", strategy);
        let p = placements(&cfg, usize::MAX);
        let count = |create: bool| p.steps.iter().filter(|s| matches!(s, Step::Create { .. }) == create).count() as u64;
        assert!(p.ended_full);
        assert_eq!((count(true), count(false)), (report.created, report.deleted));
        let first = placements(&cfg, 10);
        assert!(!first.ended_full);
        assert_eq!(first.steps[..], p.steps[..first.steps.len()], "a shorter replay is the start of the longer");
    }

    #[test]
    fn policy_names_and_weights_parse() {
        assert!(matches!(policy_named("weights:10/2/1+migrate"), Ok(Strategy::Scheduler { migrate: true, .. })));
        assert!(policy_named("weights:10/2").unwrap_err().contains("three numbers"));
        assert!(policy_named("best").unwrap_err().contains("reserve+migrate"));
    }
}

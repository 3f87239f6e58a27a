//! The controller's logic: the cluster's state in memory, written through to the store,
//! and the orders it sends to the node agents.
//!
//! Only the leading controller holds a `Cluster`, so its memory is the truth and the
//! store is the record of it. Every change is committed to the store before it is
//! acted on. A change to a volume then goes to its node's agent as the node's whole
//! desired state (`NodeState`), which the agent makes its engine match. A node whose
//! agent is behind gets its state again from the background loop.

use crate::cluster::convert::corrupt;
use crate::metrics::ControllerMetrics;
use crate::model::{
    CLUSTER_KEY, ClusterRecord, NODES, NodeRecord, PoolRecord, ROOT, SNAPSHOTS, SnapshotRecord, TOMBSTONES, Tombstone,
    VOLUMES, VolumeRecord, VolumeState, to_json,
};
use crate::scheduler::{Locality, Policy};
use crate::store::{Condition, Snapshot, Store, Txn};
use crate::{access, proto};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tonic::Status;
use tonic::transport::Channel;

mod apply;
mod convert;
mod io;
mod migrations;
mod nodes;
mod rebalance;
mod replica_moves;
mod replicas;
mod snapshots;
mod volumes;

pub use volumes::{VolumeBrief, VolumeTotals};

/// Heartbeats per second a controller takes by default. Each costs the leader about
/// 0.1 ms of CPU, mostly gRPC (`bench/results/control-scale.md`: 10,000 nodes at one a
/// second took 72% of a core): 2,000 a second is a fifth of a core or less, and a pool
/// of 10,000 nodes heartbeats every 5 s.
pub const DEFAULT_HEARTBEAT_BUDGET: u32 = 2000;

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub policy: Policy,
    /// A node whose last heartbeat is older than this is unhealthy (at the base
    /// heartbeat interval; it stretches with the interval, see `heartbeat_pace`).
    pub node_timeout: Duration,
    /// How often agents heartbeat while the pool is small enough for the budget.
    pub heartbeat_interval: Duration,
    /// Most heartbeats per second the controller takes: past that many nodes, each
    /// heartbeats less often.
    pub heartbeat_budget: u32,
    /// How long an agent may take to apply a node's state.
    pub apply_timeout: Duration,
    /// Mutual TLS to the agents (the controller's own certificate), when on.
    pub tls: Option<crate::tls::Tls>,
    /// What the controller counts as it works, kept across leadership terms.
    pub metrics: Arc<ControllerMetrics>,
    /// How often the rebalancer looks for volumes to move; `None`: it is off.
    pub rebalance_every: Option<Duration>,
    /// Most bytes per second each of the rebalancer's copies takes; 0: no limit.
    pub rebalance_rate: u64,
    /// Most bytes per second each replica's rebuild takes; 0: no limit.
    pub rebuild_rate: u64,
    /// How long a faulted replica's node may stay away before the replica is made
    /// anew on another node.
    pub replica_timeout: Duration,
    /// Rebuilds a node takes part in at once (as the serving engine that copies, or
    /// the replica copied to); the others wait their turn.
    pub rebuilds_per_node: usize,
}

/// A rebuild's rate by default: enough to copy 100 GiB in about 20 minutes, little
/// enough to leave a host most of a node's disk and network.
pub const DEFAULT_REBUILD_RATE: u64 = 100 << 20;

impl Default for ClusterConfig {
    fn default() -> ClusterConfig {
        ClusterConfig {
            policy: Policy::default(),
            node_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_budget: DEFAULT_HEARTBEAT_BUDGET,
            apply_timeout: Duration::from_secs(20),
            tls: None,
            metrics: Arc::default(),
            rebalance_every: Some(Duration::from_secs(10)),
            rebalance_rate: 0,
            rebuild_rate: DEFAULT_REBUILD_RATE,
            replica_timeout: Duration::from_secs(300),
            rebuilds_per_node: 2,
        }
    }
}

struct NodeEntry {
    record: NodeRecord,
    last_seen: Instant,
    /// The heartbeat interval the node was last told: it is judged by a timeout
    /// stretched in proportion.
    interval: Duration,
    /// Pools as the last heartbeat reported them.
    pools: Vec<PoolRecord>,
    /// Allocated bytes per engine volume, from the heartbeats.
    usage: HashMap<String, u64>,
    /// Whether `usage` and `io` rest on a heartbeat that listed everything, which the
    /// ones listing only changes add to; a new leader, or a re-registered agent, has
    /// none yet and asks for one.
    usage_complete: bool,
    desired_generation: u64,
    applied_generation: u64,
    /// Why the agent last could not reach its engine; the node takes nothing new then.
    engine_error: Option<String>,
    /// The version the node's engine runs, as last reported.
    engine_version: String,
    /// The hosts connected to each volume's export here (by volume ID), as of the last
    /// Apply.
    connected: HashMap<String, Vec<String>>,
    /// The state the node's agent holds, as this controller last gave it, with the
    /// agent's results: the next state goes as changes to it.
    held: Option<HeldState>,
    /// The I/O of the volumes served here, from the heartbeats.
    io: io::NodeIo,
    /// The mirrors of replicated volumes served here that have a faulted replica or
    /// one catching up, by subsystem NQN, as the last heartbeat listed them.
    mirrors: HashMap<String, proto::MirrorReport>,
    /// The replica exports here that no engine is connected to, by NQN.
    replicas_unconnected: HashSet<String>,
    /// The volumes (by ID) whose copy should be here and is not, as the agent's last
    /// results said (`VolumeResult.copy_lost`).
    lost_copies: HashSet<String>,
}

impl NodeEntry {
    /// A node as recorded, last seen at `last_seen` and told to heartbeat each
    /// `interval`, with nothing reported yet beyond its record's pools.
    fn new(record: NodeRecord, last_seen: Instant, interval: Duration) -> NodeEntry {
        NodeEntry {
            pools: record.pools.clone(),
            record,
            last_seen,
            interval,
            usage: HashMap::new(),
            usage_complete: false,
            desired_generation: 0,
            applied_generation: 0,
            engine_error: None,
            engine_version: String::new(),
            connected: HashMap::new(),
            held: None,
            io: io::NodeIo::default(),
            mirrors: HashMap::new(),
            replicas_unconnected: HashSet::new(),
            lost_copies: HashSet::new(),
        }
    }
}

struct State {
    cluster_id: String,
    nodes: BTreeMap<String, NodeEntry>,
    volumes: Volumes,
    /// Creations placed but not stored yet: they take their room from the scheduler's
    /// view, and no agent hears of them before the store has them (a creation whose
    /// store write fails must leave nothing on any node).
    reserved: BTreeMap<String, VolumeRecord>,
    tombstones: BTreeMap<String, Tombstone>,
    /// Snapshots by name.
    snapshots: BTreeMap<String, SnapshotRecord>,
    /// Nodes with an Apply in flight, so the background loop does not pile them up.
    applying: HashSet<String>,
    /// Volumes whose migration has a driver running.
    driving: HashSet<String>,
    /// What the drivers last heard of each migration.
    progress: HashMap<String, migrations::Progress>,
    /// Creations that found no room, for the rebalancer; kept in memory only (a new
    /// leader hears of them when the creations are retried).
    wanted_holes: Vec<rebalance::WantedHole>,
    next_generation: u64,
    /// Bytes per second each rebuild takes (`ClusterConfig::rebuild_rate`).
    rebuild_rate: u64,
}

/// The volumes by name, and by the nodes that serve them (the owner, access points, a
/// move's target), so that what concerns one node is found without a pass over every
/// volume of the cluster. Read as the map by name; changed only through `insert` and
/// `remove`, which keep the indexes and drop the node views the change makes stale.
#[derive(Default)]
struct Volumes {
    by_name: BTreeMap<String, VolumeRecord>,
    by_node: HashMap<String, BTreeSet<String>>,
    /// Local volumes by the node whose pods asked for them.
    by_host: HashMap<String, BTreeSet<String>>,
    /// Volumes with a migration under way, volumes still being created, and local
    /// volumes placed away from their consumers' node: the reconcile loop's and the
    /// rebalancer's work, found without a pass over every volume.
    migrating: BTreeSet<String>,
    creating: BTreeSet<String>,
    awaiting_home: BTreeSet<String>,
    /// Volumes with more than one replica, which the membership pass tends.
    replicated: BTreeSet<String>,
    /// The scheduler's view of each node, with what its volumes take of its pools,
    /// kept between requests (see `nodes::NodeViews`).
    views: nodes::NodeViews,
    /// What every attachment puts on each node as an access point: choosing an
    /// attachment's paths then costs the nodes, not every volume.
    path_loads: access::PathLoads,
    /// Per node, what changed since its last state was built: a state sent as changes
    /// builds the entries of these volumes alone (`apply::changes_for`).
    changed: HashMap<String, Changed>,
    /// The name of each volume ID: an agent's results come by ID.
    by_id: HashMap<String, String>,
}

/// What changed of one node's volumes: the names of those whose entries are to be
/// built again, and the IDs of those that left it (removed, moved away, or replaced
/// by a volume of the same name), whose entries go unless built again.
#[derive(Default)]
struct Changed {
    names: HashSet<String>,
    left: HashSet<String>,
}

/// The attachments of `v`, each with its paths as the access chooser counts them (the
/// owner alone for a host attached before paths were recorded).
fn attachments(v: &VolumeRecord) -> impl Iterator<Item = access::Attached<'_>> {
    v.hosts.iter().map(move |h| access::Attached {
        group: &v.group,
        host: h,
        paths: v.paths.get(h).map_or(std::slice::from_ref(&v.node), Vec::as_slice),
    })
}

impl std::ops::Deref for Volumes {
    type Target = BTreeMap<String, VolumeRecord>;
    fn deref(&self) -> &Self::Target {
        &self.by_name
    }
}

impl Volumes {
    fn insert(&mut self, name: String, v: VolumeRecord) -> Option<VolumeRecord> {
        let old = self.remove(&name);
        for node in v.exporting_nodes() {
            self.views.forget(&node);
            self.changed.entry(node.clone()).or_default().names.insert(name.clone());
            self.by_node.entry(node).or_default().insert(name.clone());
        }
        self.by_id.insert(v.id.clone(), name.clone());
        if let Some(host) = local_host(&v) {
            self.views.forget(host);
            self.by_host.entry(host.to_string()).or_default().insert(name.clone());
        }
        if v.migration.is_some() {
            self.migrating.insert(name.clone());
        }
        if v.state == VolumeState::Creating {
            self.creating.insert(name.clone());
        }
        if v.awaiting_home {
            self.awaiting_home.insert(name.clone());
        }
        if !v.replicas.is_empty() {
            self.replicated.insert(name.clone());
        }
        for a in attachments(&v) {
            self.path_loads.add(&a);
        }
        self.by_name.insert(name, v);
        old
    }

    fn remove(&mut self, name: &str) -> Option<VolumeRecord> {
        let old = self.by_name.remove(name)?;
        for node in old.exporting_nodes() {
            self.views.forget(&node);
            let changed = self.changed.entry(node.clone()).or_default();
            changed.names.insert(name.to_string());
            changed.left.insert(old.id.clone());
            unindex(&mut self.by_node, &node, name);
        }
        self.by_id.remove(&old.id);
        if let Some(host) = local_host(&old) {
            self.views.forget(host);
            unindex(&mut self.by_host, host, name);
        }
        self.migrating.remove(name);
        self.creating.remove(name);
        self.awaiting_home.remove(name);
        self.replicated.remove(name);
        for a in attachments(&old) {
            self.path_loads.remove(&a);
        }
        Some(old)
    }

    /// The volumes with a migration under way.
    fn migrating(&self) -> impl Iterator<Item = &VolumeRecord> {
        self.migrating.iter().filter_map(|name| self.by_name.get(name))
    }

    /// The volumes still being created.
    fn creating(&self) -> impl Iterator<Item = &VolumeRecord> {
        self.creating.iter().filter_map(|name| self.by_name.get(name))
    }

    /// The volumes with more than one replica.
    fn replicated(&self) -> impl Iterator<Item = &VolumeRecord> {
        self.replicated.iter().filter_map(|name| self.by_name.get(name))
    }

    /// The local volumes placed away from their consumers' node, by name.
    fn awaiting_home(&self) -> impl Iterator<Item = &VolumeRecord> {
        self.awaiting_home.iter().filter_map(|name| self.by_name.get(name))
    }

    /// The volumes `node` owns or serves, by name.
    fn of_node<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a VolumeRecord> {
        self.by_node.get(node).into_iter().flatten().filter_map(|name| self.by_name.get(name))
    }

    /// The local volumes the pods on `node` asked for, by name.
    fn hosted_by<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a VolumeRecord> {
        self.by_host.get(node).into_iter().flatten().filter_map(|name| self.by_name.get(name))
    }

    /// What changed on `node` since the last call, which then forgets it.
    fn take_changed(&mut self, node: &str) -> Changed {
        self.changed.remove(node).unwrap_or_default()
    }

    /// Marks a volume's entry on `node` to be built and sent again.
    fn mark_changed(&mut self, node: &str, name: &str) {
        self.changed.entry(node.to_string()).or_default().names.insert(name.to_string());
    }

    /// Whether `node` owns or serves the volume named `name`.
    fn serves_node(&self, node: &str, name: &str) -> bool {
        self.by_node.get(node).is_some_and(|names| names.contains(name))
    }

    /// The volume with ID `id`.
    fn by_id(&self, id: &str) -> Option<&VolumeRecord> {
        self.by_id.get(id).and_then(|name| self.by_name.get(name))
    }

    /// Marks every volume `node` serves as changed on every node that serves it: their
    /// entries name the node's addresses (an access point's, the owner's peer address;
    /// the owner's, the forwarding engines' host NQNs).
    fn node_record_changed(&mut self, node: &str) {
        let served: Vec<(String, BTreeSet<String>)> =
            self.of_node(node).map(|v| (v.name.clone(), v.exporting_nodes())).collect();
        for (name, nodes) in served {
            for n in nodes {
                self.mark_changed(&n, &name);
            }
        }
    }
}

/// The node whose pods asked for `v` locally, if they did.
fn local_host(v: &VolumeRecord) -> Option<&str> {
    (v.locality == Locality::Local).then_some(v.host_node.as_str())
}

fn unindex(index: &mut HashMap<String, BTreeSet<String>>, key: &str, name: &str) {
    if let Some(names) = index.get_mut(key) {
        names.remove(name);
        if names.is_empty() {
            index.remove(key);
        }
    }
}

impl State {
    /// Marks that a node's desired state changed.
    fn touch(&mut self, node: &str) {
        self.next_generation += 1;
        if let Some(n) = self.nodes.get_mut(node) {
            n.desired_generation = self.next_generation;
        }
    }
}

/// Serialises work per key (a volume name, a node name) across awaits. A key's lock
/// lives while someone holds or waits for it: names come and go (a deleted volume's
/// name is never locked again), so the table holds only the keys in use.
#[derive(Default)]
struct KeyedLocks(Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>);

/// A key's lock, held; dropping it lets the next waiter in, or forgets the key.
struct KeyGuard {
    key: String,
    table: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
    held: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl KeyedLocks {
    async fn lock(&self, key: &str) -> KeyGuard {
        let m = self.0.lock().unwrap().entry(key.to_string()).or_default().clone();
        KeyGuard { key: key.to_string(), table: self.0.clone(), held: Some(m.lock_owned().await) }
    }

    #[cfg(test)]
    fn keys(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

impl Drop for KeyGuard {
    fn drop(&mut self) {
        drop(self.held.take());
        // The table's reference is the last one when nobody else holds or waits for
        // this key (waiters clone it under the table's lock, which this holds).
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if table.get(&self.key).is_some_and(|m| Arc::strong_count(m) == 1) {
            table.remove(&self.key);
        }
    }
}

pub struct Cluster {
    store: Arc<dyn Store>,
    /// Conditions added to every write: under etcd, "this controller still leads".
    fence: Vec<Condition>,
    pub cfg: ClusterConfig,
    state: Mutex<State>,
    volume_locks: KeyedLocks,
    node_locks: KeyedLocks,
    /// One registration at a time, so that two new nodes never get one block of
    /// controller IDs.
    registrations: tokio::sync::Mutex<()>,
    channels: Mutex<HashMap<String, Channel>>,
    /// Permits for the background loop's applications (`BACKGROUND_APPLIES`).
    background_applies: tokio::sync::Semaphore,
    /// Nodes healthy at the last pass of the access points: when more are, the
    /// attachments short of paths get them (`repath_access_points`).
    healthy_nodes_seen: std::sync::atomic::AtomicUsize,
}

/// Most states the background loop sends at once. After a failover every node is
/// sent its whole state: sent to 10,000 nodes at once (100,000 volumes), they left a
/// creation's call to its node to fail ("operation was canceled").
const BACKGROUND_APPLIES: usize = 64;

/// How many nodes a CreateVolume answer explains (the best ones).
const EXPLAINED_NODES: usize = 32;

/// The outcome of each entry of a node's state, by ID, as last reported. Shared with
/// the callers of `apply_node` without a copy; changed in place while none holds it.
type Results = Arc<HashMap<String, proto::VolumeResult>>;

/// A node state an agent applied: its generation, its entries by volume ID, and the
/// agent's result for each (the last one it gave: an entry sent again only when it
/// changes keeps the result of its last application). Kept up to date by the changes
/// each application brings, so that it costs what changed, not the node's volumes.
#[derive(Default)]
struct HeldState {
    generation: u64,
    entries: HashMap<String, proto::DesiredVolume>,
    results: Results,
    /// The entries whose last result is an error.
    failing: HashSet<String>,
    /// The entries that remove a volume (tombstones), which go when their tombstone does.
    removals: HashSet<String>,
}

fn store_status(e: impl std::fmt::Display) -> Status {
    // Not "nothing was changed": a write the store took before it stopped answering
    // stands, and the retry finds it.
    Status::unavailable(format!(
        "the controller's store failed: {e}; retry when it is back (repeating the call is safe)"
    ))
}

/// How often each of `nodes` nodes is to heartbeat: the base interval, or longer, so
/// that all of them together stay within the controller's budget.
fn heartbeat_pace(cfg: &ClusterConfig, nodes: usize) -> Duration {
    let spread = Duration::from_secs_f64(nodes as f64 / f64::from(cfg.heartbeat_budget.max(1)));
    cfg.heartbeat_interval.max(spread)
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(1)
}

impl Cluster {
    /// Loads the cluster from the store, creating its identity on first use.
    pub async fn load(
        store: Arc<dyn Store>,
        fence: Vec<Condition>,
        cfg: ClusterConfig,
    ) -> Result<Arc<Cluster>, Status> {
        let records = Snapshot::read(store.as_ref(), ROOT).await.map_err(store_status)?;
        Cluster::load_from(records, store, fence, cfg).await
    }

    /// Loads the cluster from `records`, every key under [`ROOT`] as the store held
    /// them at one time (a standby's copy, or a fresh read), creating its identity on
    /// first use.
    pub async fn load_from(
        records: Snapshot,
        store: Arc<dyn Store>,
        fence: Vec<Condition>,
        cfg: ClusterConfig,
    ) -> Result<Arc<Cluster>, Status> {
        let started = Instant::now();
        let cluster_id = match records.get(CLUSTER_KEY) {
            Some(b) => serde_json::from_slice::<ClusterRecord>(b).map_err(corrupt)?.id,
            None => {
                let rec = ClusterRecord { id: uuid::Uuid::new_v4().to_string() };
                let mut txn =
                    Txn::default().when(Condition::Absent(CLUSTER_KEY.into())).put(CLUSTER_KEY, to_json(&rec));
                txn.conditions.extend(fence.iter().cloned());
                if !store.commit(txn).await.map_err(store_status)? {
                    return Err(Status::aborted("another controller initialised the cluster at the same time; retry"));
                }
                rec.id
            }
        };
        let now = Instant::now();
        let mut nodes = BTreeMap::new();
        // The pace the nodes were told by the last leader, if it had as many.
        let interval = heartbeat_pace(&cfg, records.under(NODES).count());
        for b in records.under(NODES) {
            let record: NodeRecord = serde_json::from_slice(b).map_err(corrupt)?;
            // A new leader gives every node a full timeout to report, so that creations
            // go on through a failover. (A node that died meanwhile fails its first
            // Apply; the volume is given up and the call can be retried.)
            let entry = NodeEntry::new(record, now, interval);
            nodes.insert(entry.record.name.clone(), entry);
        }
        let mut volumes = Volumes::default();
        for b in records.under(VOLUMES) {
            let v: VolumeRecord = serde_json::from_slice(b).map_err(corrupt)?;
            volumes.insert(v.name.clone(), v);
        }
        let mut tombstones = BTreeMap::new();
        for b in records.under(TOMBSTONES) {
            let t: Tombstone = serde_json::from_slice(b).map_err(corrupt)?;
            tombstones.insert(t.id.clone(), t);
        }
        let mut snapshots = BTreeMap::new();
        for b in records.under(SNAPSHOTS) {
            let s: SnapshotRecord = serde_json::from_slice(b).map_err(corrupt)?;
            snapshots.insert(s.name.clone(), s);
        }
        tracing::info!(
            "loaded {} nodes, {} volumes, {} snapshots and {} tombstones in {} ms",
            nodes.len(),
            volumes.len(),
            snapshots.len(),
            tombstones.len(),
            started.elapsed().as_millis()
        );
        // Generations start from the clock so that they never repeat one an agent
        // applied under an earlier controller.
        let mut state = State {
            cluster_id,
            nodes,
            volumes,
            reserved: BTreeMap::new(),
            tombstones,
            snapshots,
            applying: HashSet::new(),
            driving: HashSet::new(),
            progress: HashMap::new(),
            wanted_holes: Vec::new(),
            next_generation: now_ms(),
            rebuild_rate: cfg.rebuild_rate,
        };
        let names: Vec<String> = state.nodes.keys().cloned().collect();
        for n in names {
            state.touch(&n);
        }
        Ok(Arc::new(Cluster {
            store,
            fence,
            cfg,
            state: Mutex::new(state),
            volume_locks: KeyedLocks::default(),
            node_locks: KeyedLocks::default(),
            registrations: tokio::sync::Mutex::new(()),
            channels: Mutex::new(HashMap::new()),
            background_applies: tokio::sync::Semaphore::new(BACKGROUND_APPLIES),
            healthy_nodes_seen: std::sync::atomic::AtomicUsize::new(0),
        }))
    }

    pub fn cluster_id(&self) -> String {
        self.state.lock().unwrap().cluster_id.clone()
    }

    pub fn store_description(&self) -> String {
        self.store.describe()
    }

    async fn commit(&self, mut txn: Txn) -> Result<(), Status> {
        txn.conditions.extend(self.fence.iter().cloned());
        let started = Instant::now();
        let committed = self.store.commit(txn).await;
        let metrics = &self.cfg.metrics;
        metrics.store_commit_seconds.observe(started.elapsed().as_secs_f64());
        if !matches!(committed, Ok(true)) {
            metrics.store_commit_failures.inc();
        }
        if committed.map_err(store_status)? {
            Ok(())
        } else {
            Err(Status::unavailable(
                "this controller is no longer the leader; nothing was changed, retry against the new leader",
            ))
        }
    }
}

#[cfg(test)]
mod keyed_lock_tests {
    use super::KeyedLocks;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn a_key_is_forgotten_once_nobody_holds_or_waits_for_it() {
        let locks = Arc::new(KeyedLocks::default());
        for i in 0..100 {
            let _held = locks.lock(&format!("volume-{i}")).await;
        }
        assert_eq!(locks.keys(), 0, "names no longer in use stay in the table");

        // A waiter keeps the key alive until it had its turn.
        let first = locks.lock("v").await;
        let waiter = {
            let locks = locks.clone();
            tokio::spawn(async move {
                let _second = locks.lock("v").await;
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(first);
        assert!(locks.keys() <= 1);
        waiter.await.unwrap();
        assert_eq!(locks.keys(), 0);
    }
}

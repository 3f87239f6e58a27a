//! The controller's logic: the cluster's state in memory, written through to the store,
//! and the orders it sends to the node agents.
//!
//! Only the leading controller holds a `Cluster`, so its memory is the truth and the
//! store is the record of it. Every change is committed to the store before it is
//! acted on. A change to a volume then goes to its node's agent as the node's whole
//! desired state (`NodeState`), which the agent makes its engine match. A node whose
//! agent is behind gets its state again from the background loop.

use crate::model::*;
use crate::proto::{self, agent_client::AgentClient};
use crate::scheduler::{self, Locality, NodeView, Policy, PoolView, Request, Score};
use crate::store::{Condition, Store, Txn};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub policy: Policy,
    /// A node whose last heartbeat is older than this is unhealthy.
    pub node_timeout: Duration,
    pub heartbeat_interval: Duration,
    /// How long an agent may take to apply a node's state.
    pub apply_timeout: Duration,
}

impl Default for ClusterConfig {
    fn default() -> ClusterConfig {
        ClusterConfig {
            policy: Policy::default(),
            node_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_secs(1),
            apply_timeout: Duration::from_secs(20),
        }
    }
}

struct NodeEntry {
    record: NodeRecord,
    last_seen: Instant,
    /// Pools as the last heartbeat reported them.
    pools: Vec<PoolRecord>,
    /// Allocated bytes per engine volume, from the last heartbeat.
    usage: HashMap<String, u64>,
    desired_generation: u64,
    applied_generation: u64,
}

struct State {
    cluster_id: String,
    nodes: BTreeMap<String, NodeEntry>,
    volumes: BTreeMap<String, VolumeRecord>,
    tombstones: BTreeMap<String, Tombstone>,
    /// Nodes with an Apply in flight, so the background loop does not pile them up.
    applying: HashSet<String>,
    next_generation: u64,
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

/// Serialises work per key (a volume name, a node name) across awaits.
#[derive(Default)]
struct KeyedLocks(Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>);

impl KeyedLocks {
    async fn lock(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let m = self.0.lock().unwrap().entry(key.to_string()).or_default().clone();
        m.lock_owned().await
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
    channels: Mutex<HashMap<String, Channel>>,
}

/// How many nodes a CreateVolume answer explains (the best ones).
const EXPLAINED_NODES: usize = 32;

/// Outcome of one volume in an Apply.
type Results = HashMap<String, proto::VolumeResult>;

fn store_status(e: impl std::fmt::Display) -> Status {
    Status::unavailable(format!("the controller's store failed: {e}; nothing was changed, retry when it is back"))
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
        let cluster_id = match store.get(CLUSTER_KEY).await.map_err(store_status)? {
            Some(b) => serde_json::from_slice::<ClusterRecord>(&b).map_err(corrupt)?.id,
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
        for (_, b) in store.list(NODES).await.map_err(store_status)? {
            let record: NodeRecord = serde_json::from_slice(&b).map_err(corrupt)?;
            let entry = NodeEntry {
                pools: record.pools.clone(),
                record,
                // A new leader gives every node a full timeout to report, so that creations
                // go on through a failover. (A node that died meanwhile fails its first
                // Apply; the volume is given up and the call can be retried.)
                last_seen: now,
                usage: HashMap::new(),
                desired_generation: 0,
                applied_generation: 0,
            };
            nodes.insert(entry.record.name.clone(), entry);
        }
        let mut volumes = BTreeMap::new();
        for (_, b) in store.list(VOLUMES).await.map_err(store_status)? {
            let v: VolumeRecord = serde_json::from_slice(&b).map_err(corrupt)?;
            volumes.insert(v.name.clone(), v);
        }
        let mut tombstones = BTreeMap::new();
        for (_, b) in store.list(TOMBSTONES).await.map_err(store_status)? {
            let t: Tombstone = serde_json::from_slice(&b).map_err(corrupt)?;
            tombstones.insert(t.id.clone(), t);
        }
        // Generations start from the clock so that they never repeat one an agent
        // applied under an earlier controller.
        let mut state =
            State { cluster_id, nodes, volumes, tombstones, applying: HashSet::new(), next_generation: now_ms() };
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
            channels: Mutex::new(HashMap::new()),
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
        if self.store.commit(txn).await.map_err(store_status)? {
            Ok(())
        } else {
            Err(Status::unavailable(
                "this controller is no longer the leader; nothing was changed, retry against the new leader",
            ))
        }
    }

    // ---- volumes ----

    pub async fn create_volume(&self, req: &proto::CreateVolumeRequest) -> Result<proto::CreateVolumeResponse, Status> {
        check_name("volume", &req.name).map_err(Status::invalid_argument)?;
        if req.size_bytes == 0 {
            return Err(Status::invalid_argument("volume size must be more than 0 bytes"));
        }
        if req.size_bytes > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {} bytes is more than the largest volume nvpool makes (1 PiB)",
                req.size_bytes
            )));
        }
        let locality = locality_from(req.locality)?;
        if locality != Locality::Any && req.host_node.is_empty() {
            return Err(Status::invalid_argument("a local or remote preference needs the host node it is relative to"));
        }
        {
            let st = self.state.lock().unwrap();
            let named = std::iter::once(&req.host_node).filter(|n| !n.is_empty());
            for n in named.chain(&req.include_nodes).chain(&req.exclude_nodes) {
                if !st.nodes.contains_key(n) {
                    return Err(Status::not_found(format!("unknown node {n:?}: `nvpool node list` shows the nodes")));
                }
            }
        }
        let _guard = self.volume_locks.lock(&req.name).await;
        let existing = self.state.lock().unwrap().volumes.get(&req.name).cloned();
        if let Some(v) = existing {
            if !same_request(&v, req, locality) {
                return Err(Status::already_exists(format!(
                    "volume {} exists with size {} bytes, {}, locality {} to {:?}, include {:?}, exclude {:?}; \
                     delete it or use another name",
                    v.name,
                    v.size,
                    if v.thin { "thin" } else { "thick" },
                    v.locality,
                    v.host_node,
                    v.include,
                    v.exclude
                )));
            }
            if v.state == VolumeState::Creating {
                return self.finish_create(&v, Vec::new()).await;
            }
            return Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_proto(&v)),
                scores: vec![],
                existed: true,
            });
        }

        let request = Request {
            size: req.size_bytes,
            thin: req.thin,
            locality,
            host_node: req.host_node.clone(),
            include: req.include_nodes.clone(),
            exclude: req.exclude_nodes.clone(),
        };
        let id = uuid::Uuid::new_v4().to_string();
        let (record, scores) = {
            let mut st = self.state.lock().unwrap();
            let views = self.node_views(&st);
            let scores = scheduler::place(&views, &request, &self.cfg.policy, EXPLAINED_NODES);
            let Some(chosen) = scheduler::choice(&scores) else {
                return Err(Status::resource_exhausted(no_room_message(&request, &scores, views.len())));
            };
            let record = VolumeRecord {
                name: req.name.clone(),
                id: id.clone(),
                size: req.size_bytes,
                thin: req.thin,
                node: chosen.node.clone(),
                pool: chosen.pool.clone(),
                engine_name: format!("pv-{id}"),
                state: VolumeState::Creating,
                hosts: vec![],
                readonly_hosts: vec![],
                subsystem_nqn: format!("{VOLUME_NQN_PREFIX}{id}"),
                uuid: String::new(),
                nguid: String::new(),
                locality,
                host_node: req.host_node.clone(),
                include: req.include_nodes.clone(),
                exclude: req.exclude_nodes.clone(),
            };
            // Reserve the space now, so that concurrent creations see it taken.
            st.volumes.insert(record.name.clone(), record.clone());
            (record, scores)
        };
        let key = format!("{VOLUMES}{}", record.name);
        if let Err(e) =
            self.commit(Txn::default().when(Condition::Absent(key.clone())).put(key, to_json(&record))).await
        {
            self.state.lock().unwrap().volumes.remove(&record.name);
            return Err(e);
        }
        self.state.lock().unwrap().touch(&record.node);
        self.finish_create(&record, scores).await
    }

    /// Has the node's agent make a recorded volume, then reports the outcome.
    async fn finish_create(&self, v: &VolumeRecord, scores: Vec<Score>) -> Result<proto::CreateVolumeResponse, Status> {
        let outcome = self.apply_node(&v.node).await;
        let now = self.state.lock().unwrap().volumes.get(&v.name).cloned();
        match (now, outcome) {
            (Some(now), _) if now.id == v.id && now.state == VolumeState::Ready => Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_proto(&now)),
                scores: scores.iter().map(score_proto).collect(),
                existed: false,
            }),
            (_, Ok(results)) => {
                let why = results.get(&v.id).map(|r| r.error.clone()).unwrap_or_default();
                Err(Status::failed_precondition(format!(
                    "node {} could not create volume {}: {why}; nothing was left behind, retry to place it again",
                    v.node, v.name
                )))
            }
            (_, Err(e)) => {
                // The agent did not answer: give the volume up, so that a retry can place it elsewhere.
                self.bury(v).await?;
                Err(Status::unavailable(format!(
                    "node {} did not answer ({e}); volume {} was not created, retry to place it again",
                    v.node, v.name
                )))
            }
        }
    }

    /// Replaces a volume by a tombstone: the name is free at once, and the node
    /// removes the engine side when it can.
    async fn bury(&self, v: &VolumeRecord) -> Result<(), Status> {
        let tomb = Tombstone::from(v);
        self.commit(
            Txn::default()
                .delete(format!("{VOLUMES}{}", v.name))
                .put(format!("{TOMBSTONES}{}", tomb.id), to_json(&tomb)),
        )
        .await?;
        let mut st = self.state.lock().unwrap();
        st.volumes.remove(&v.name);
        st.tombstones.insert(tomb.id.clone(), tomb);
        st.touch(&v.node);
        Ok(())
    }

    pub async fn delete_volume(&self, name: &str) -> Result<bool, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let Some(v) = self.state.lock().unwrap().volumes.get(name).cloned() else {
            return Ok(false);
        };
        self.bury(&v).await?;
        // The tombstone is durable; the background loop retries if the node is away.
        let _ = self.apply_node(&v.node).await;
        Ok(true)
    }

    pub async fn resize_volume(&self, name: &str, size: u64) -> Result<proto::Volume, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if size <= v.size {
            return Ok(self.volume_proto(&v));
        }
        if size > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {size} bytes is more than the largest volume nvpool makes (1 PiB)"
            )));
        }
        {
            let st = self.state.lock().unwrap();
            let views = self.node_views(&st);
            let pool = views.iter().find(|n| n.name == v.node).and_then(|n| n.pools.iter().find(|p| p.name == v.pool));
            let Some(pool) = pool else {
                return Err(Status::failed_precondition(format!(
                    "node {} no longer reports pool {}; check the node with `nvpool node list`",
                    v.node, v.pool
                )));
            };
            let room = if v.thin {
                let limit = (pool.capacity as f64 * self.cfg.policy.thin_overcommit) as u64;
                pool.provisioned + (size - v.size) <= limit
            } else {
                let extra =
                    scheduler::thick_bytes(size, pool.cluster_size) - scheduler::thick_bytes(v.size, pool.cluster_size);
                pool.committed + extra <= pool.capacity
            };
            if !room {
                return Err(Status::resource_exhausted(format!(
                    "pool {} on node {} has no room to grow volume {} to {size} bytes; free space there or create a \
                     new volume",
                    v.pool, v.node, v.name
                )));
            }
        }
        let grown = VolumeRecord { size, ..v.clone() };
        self.put_volume(&grown).await?;
        match self.apply_node(&v.node).await {
            Ok(results) if results.get(&v.id).is_some_and(|r| r.error.is_empty()) => {
                Ok(self.volume_proto(&self.ready_volume(name)?))
            }
            outcome => {
                let why = match outcome {
                    Ok(r) => r.get(&v.id).map(|r| r.error.clone()).unwrap_or_default(),
                    Err(e) => format!("the node did not answer: {e}"),
                };
                self.put_volume(&v).await?;
                Err(Status::unavailable(format!(
                    "node {} could not grow volume {}: {why}; the volume keeps {} bytes, retry",
                    v.node, v.name, v.size
                )))
            }
        }
    }

    pub fn get_volume(&self, name: &str) -> Result<proto::Volume, Status> {
        let st = self.state.lock().unwrap();
        let v = st.volumes.get(name).ok_or_else(|| no_volume(name))?;
        Ok(self.volume_proto_locked(&st, v))
    }

    pub fn list_volumes(&self, node: &str) -> Vec<proto::Volume> {
        let st = self.state.lock().unwrap();
        st.volumes
            .values()
            .filter(|v| node.is_empty() || v.node == node)
            .map(|v| self.volume_proto_locked(&st, v))
            .collect()
    }

    pub async fn attach(&self, volume: &str, host: &str, readonly: bool) -> Result<proto::AttachResponse, Status> {
        check_host_nqn(host).map_err(Status::invalid_argument)?;
        let _guard = self.volume_locks.lock(volume).await;
        let v = self.ready_volume(volume)?;
        let attached_readonly = v.readonly_hosts.iter().any(|h| h == host);
        if v.hosts.iter().any(|h| h == host) && attached_readonly != readonly {
            return Err(Status::already_exists(format!(
                "volume {volume} is attached to {host} {}; detach it first to attach it {}",
                if attached_readonly { "read-only" } else { "read-write" },
                if readonly { "read-only" } else { "read-write" }
            )));
        }
        let node_applied = {
            let st = self.state.lock().unwrap();
            st.nodes.get(&v.node).is_some_and(|n| n.applied_generation == n.desired_generation)
        };
        if !v.hosts.iter().any(|h| h == host) || !node_applied {
            let mut with = v.clone();
            if !with.hosts.iter().any(|h| h == host) {
                with.hosts.push(host.to_string());
                if readonly {
                    with.readonly_hosts.push(host.to_string());
                }
            }
            self.put_volume(&with).await?;
            let ok =
                matches!(self.apply_node(&v.node).await, Ok(r) if r.get(&v.id).is_some_and(|r| r.error.is_empty()));
            if !ok {
                self.put_volume(&v).await?;
                return Err(Status::unavailable(format!(
                    "node {} did not export volume {volume} to {host}; nothing changed, retry when `nvpool node list` \
                     shows the node healthy",
                    v.node
                )));
            }
        }
        let v = self.ready_volume(volume)?;
        let st = self.state.lock().unwrap();
        let node = &st.nodes[&v.node].record;
        let (address, port) = split_address(&node.nvme_address);
        Ok(proto::AttachResponse {
            subsystem_nqn: v.subsystem_nqn.clone(),
            nsid: 1,
            uuid: v.uuid.clone(),
            nguid: v.nguid.clone(),
            paths: vec![proto::Path {
                node: v.node.clone(),
                transport: "tcp".into(),
                address,
                port,
                ana_state: "optimized".into(),
            }],
        })
    }

    pub async fn detach(&self, volume: &str, host: &str) -> Result<(), Status> {
        let _guard = self.volume_locks.lock(volume).await;
        let Some(v) = self.state.lock().unwrap().volumes.get(volume).cloned() else {
            return Ok(());
        };
        if v.hosts.iter().any(|h| h == host) {
            let without = VolumeRecord {
                hosts: v.hosts.iter().filter(|h| *h != host).cloned().collect(),
                readonly_hosts: v.readonly_hosts.iter().filter(|h| *h != host).cloned().collect(),
                ..v.clone()
            };
            self.put_volume(&without).await?;
        }
        match self.apply_node(&v.node).await {
            Ok(r) if r.get(&v.id).is_some_and(|r| r.error.is_empty()) => Ok(()),
            _ => Err(Status::unavailable(format!(
                "node {} has not yet removed {host} from volume {volume}'s allow-list; it will when it is back, \
                 retry to confirm",
                v.node
            ))),
        }
    }

    fn ready_volume(&self, name: &str) -> Result<VolumeRecord, Status> {
        let v = self.state.lock().unwrap().volumes.get(name).cloned().ok_or_else(|| no_volume(name))?;
        if v.state != VolumeState::Ready {
            return Err(Status::failed_precondition(format!("volume {name} is still being created; retry shortly")));
        }
        Ok(v)
    }

    /// Records a changed volume and marks its node for an update.
    async fn put_volume(&self, v: &VolumeRecord) -> Result<(), Status> {
        self.commit(Txn::default().put(format!("{VOLUMES}{}", v.name), to_json(v))).await?;
        let mut st = self.state.lock().unwrap();
        st.volumes.insert(v.name.clone(), v.clone());
        st.touch(&v.node);
        Ok(())
    }

    // ---- nodes ----

    pub async fn register_node(&self, node: proto::Node) -> Result<(), Status> {
        check_name("node", &node.name).map_err(Status::invalid_argument)?;
        if node.nvme_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(Status::invalid_argument(format!(
                "node {}: NVMe/TCP address {:?} is not IP:PORT",
                node.name, node.nvme_address
            )));
        }
        let record = NodeRecord {
            name: node.name.clone(),
            agent_address: node.agent_address.clone(),
            nvme_address: node.nvme_address.clone(),
            labels: node.labels.into_iter().collect(),
            pools: node.pools.iter().map(pool_record).collect(),
        };
        let _guard = self.node_locks.lock(&record.name).await;
        let changed = self.state.lock().unwrap().nodes.get(&record.name).is_none_or(|n| n.record != record);
        if changed {
            self.commit(Txn::default().put(format!("{NODES}{}", record.name), to_json(&record))).await?;
        }
        let mut st = self.state.lock().unwrap();
        let entry = st.nodes.entry(record.name.clone()).or_insert_with(|| NodeEntry {
            record: record.clone(),
            last_seen: Instant::now(),
            pools: vec![],
            usage: HashMap::new(),
            desired_generation: 0,
            applied_generation: 0,
        });
        entry.pools = record.pools.clone();
        entry.record = record.clone();
        entry.last_seen = Instant::now();
        // A (re)registered agent has applied nothing yet.
        entry.applied_generation = 0;
        st.touch(&record.name);
        Ok(())
    }

    pub fn heartbeat(&self, hb: proto::HeartbeatRequest) -> bool {
        let mut st = self.state.lock().unwrap();
        let Some(n) = st.nodes.get_mut(&hb.node) else {
            return false;
        };
        n.last_seen = Instant::now();
        n.pools = hb.pools.iter().map(pool_record).collect();
        n.usage = hb.volumes.into_iter().map(|u| (u.engine_name, u.allocated_bytes)).collect();
        n.applied_generation = hb.applied_generation;
        true
    }

    pub fn list_nodes(&self) -> Vec<proto::Node> {
        let st = self.state.lock().unwrap();
        st.nodes
            .values()
            .map(|n| proto::Node {
                name: n.record.name.clone(),
                agent_address: n.record.agent_address.clone(),
                nvme_address: n.record.nvme_address.clone(),
                labels: n.record.labels.clone().into_iter().collect(),
                pools: n.pools.iter().map(pool_report).collect(),
                healthy: self.healthy(n),
                last_heartbeat_ms_ago: n.last_seen.elapsed().as_millis() as u64,
                volumes: st.volumes.values().filter(|v| v.node == n.record.name).count() as u32,
            })
            .collect()
    }

    pub fn list_pools(&self) -> Vec<proto::PoolOnNode> {
        let st = self.state.lock().unwrap();
        let views = self.node_views(&st);
        let mut out = Vec::new();
        for n in st.nodes.values() {
            for p in &n.pools {
                let committed = views
                    .iter()
                    .find(|v| v.name == n.record.name)
                    .and_then(|v| v.pools.iter().find(|q| q.name == p.name))
                    .map_or(p.used_bytes, |q| q.committed);
                out.push(proto::PoolOnNode {
                    node: n.record.name.clone(),
                    pool: Some(pool_report(p)),
                    committed_bytes: committed,
                });
            }
        }
        out
    }

    fn healthy(&self, n: &NodeEntry) -> bool {
        n.last_seen.elapsed() < self.cfg.node_timeout
    }

    /// The scheduler's view: reported pools, with what this controller has promised
    /// on them counted in even before the node reports it.
    fn node_views(&self, st: &State) -> Vec<NodeView> {
        let cluster_size = |node: &str, pool: &str| {
            st.nodes.get(node).and_then(|n| n.pools.iter().find(|p| p.name == pool)).map_or(1, |p| p.cluster_size)
        };
        let live = st.volumes.values().map(|v| (&v.node, &v.pool, &v.engine_name, v.size, v.thin));
        let dying = st.tombstones.values().map(|t| (&t.node, &t.pool, &t.engine_name, t.size, t.thin));
        // (node, pool) -> (bytes taken, bytes promised)
        let mut promised: HashMap<(&str, &str), (u64, u64)> = HashMap::new();
        for (node, pool, engine_name, size, thin) in live.chain(dying) {
            let taken = if thin {
                st.nodes.get(node).and_then(|n| n.usage.get(engine_name)).copied().unwrap_or(0)
            } else {
                scheduler::thick_bytes(size, cluster_size(node, pool))
            };
            let e = promised.entry((node.as_str(), pool.as_str())).or_default();
            e.0 += taken;
            e.1 += size;
        }
        st.nodes
            .values()
            .map(|n| NodeView {
                name: n.record.name.clone(),
                healthy: self.healthy(n),
                pools: n
                    .pools
                    .iter()
                    .map(|p| {
                        let (taken, provisioned) =
                            promised.get(&(n.record.name.as_str(), p.name.as_str())).copied().unwrap_or_default();
                        PoolView {
                            name: p.name.clone(),
                            capacity: p.capacity_bytes,
                            committed: p.used_bytes.max(taken),
                            provisioned: p.provisioned_bytes.max(provisioned),
                            cluster_size: p.cluster_size,
                            failed: p.failed.clone(),
                        }
                    })
                    .collect(),
            })
            .collect()
    }

    // ---- applying desired state ----

    /// Sends a node its desired state and records what the agent reports: creations
    /// confirmed or rolled back, removals done.
    pub async fn apply_node(&self, node: &str) -> Result<Results, String> {
        let _guard = self.node_locks.lock(node).await;
        let (state, address) = {
            let st = self.state.lock().unwrap();
            let Some(n) = st.nodes.get(node) else {
                return Err(format!("unknown node {node}"));
            };
            let mut volumes: Vec<proto::DesiredVolume> = st
                .volumes
                .values()
                .filter(|v| v.node == node)
                .map(|v| proto::DesiredVolume {
                    id: v.id.clone(),
                    engine_name: v.engine_name.clone(),
                    pool: v.pool.clone(),
                    size_bytes: v.size,
                    thin: v.thin,
                    present: true,
                    subsystem_nqn: v.subsystem_nqn.clone(),
                    hosts: v.hosts.clone(),
                })
                .collect();
            volumes.extend(st.tombstones.values().filter(|t| t.node == node).map(|t| proto::DesiredVolume {
                id: t.id.clone(),
                engine_name: t.engine_name.clone(),
                pool: t.pool.clone(),
                size_bytes: t.size,
                thin: t.thin,
                present: false,
                subsystem_nqn: t.subsystem_nqn.clone(),
                hosts: vec![],
            }));
            let state = proto::NodeState { node: node.to_string(), generation: n.desired_generation, volumes };
            (state, n.record.agent_address.clone())
        };
        let generation = state.generation;
        let mut client = AgentClient::new(self.channel(&address)?);
        let reply = tokio::time::timeout(self.cfg.apply_timeout, client.apply(state))
            .await
            .map_err(|_| format!("agent at {address} took longer than {:?}", self.cfg.apply_timeout))?
            .map_err(|e| format!("agent at {address}: {}", e.message()))?
            .into_inner();
        let results: Results = reply.results.into_iter().map(|r| (r.id.clone(), r)).collect();
        self.absorb(node, generation, &results).await;
        Ok(results)
    }

    async fn absorb(&self, node: &str, generation: u64, results: &Results) {
        let (mut confirmed, mut failed, mut removed) = (vec![], vec![], vec![]);
        {
            let st = self.state.lock().unwrap();
            for v in st.volumes.values().filter(|v| v.node == node) {
                match results.get(&v.id) {
                    Some(r)
                        if r.error.is_empty()
                            && (v.state == VolumeState::Creating || v.uuid != r.uuid || v.nguid != r.nguid) =>
                    {
                        let mut now = v.clone();
                        now.state = VolumeState::Ready;
                        now.uuid = r.uuid.clone();
                        now.nguid = r.nguid.clone();
                        confirmed.push(now);
                    }
                    Some(r) if !r.error.is_empty() && v.state == VolumeState::Creating => failed.push(v.clone()),
                    _ => {}
                }
            }
            for t in st.tombstones.values().filter(|t| t.node == node) {
                if results.get(&t.id).is_some_and(|r| r.error.is_empty()) {
                    removed.push(t.id.clone());
                }
            }
        }
        let all_ok = results.values().all(|r| r.error.is_empty());
        for v in confirmed {
            if self.commit(Txn::default().put(format!("{VOLUMES}{}", v.name), to_json(&v))).await.is_ok() {
                self.state.lock().unwrap().volumes.insert(v.name.clone(), v);
            }
        }
        for v in failed {
            let _ = self.bury(&v).await;
        }
        for id in removed {
            if self.commit(Txn::default().delete(format!("{TOMBSTONES}{id}"))).await.is_ok() {
                self.state.lock().unwrap().tombstones.remove(&id);
            }
        }
        let mut st = self.state.lock().unwrap();
        if let Some(n) = st.nodes.get_mut(node)
            && all_ok
        {
            n.applied_generation = n.applied_generation.max(generation);
        }
    }

    fn channel(&self, address: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().unwrap();
        if let Some(c) = channels.get(address) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| format!("agent address {address:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2));
        let c = endpoint.connect_lazy();
        channels.insert(address.to_string(), c.clone());
        Ok(c)
    }

    /// Runs until the process ends: brings behind nodes up to date and finishes
    /// creations and removals that an earlier controller left open.
    pub async fn reconcile_forever(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.cfg.heartbeat_interval / 2).await;
            let due: Vec<String> = {
                let mut st = self.state.lock().unwrap();
                let open: HashSet<String> = st
                    .volumes
                    .values()
                    .filter(|v| v.state == VolumeState::Creating)
                    .map(|v| v.node.clone())
                    .chain(st.tombstones.values().map(|t| t.node.clone()))
                    .collect();
                let due: Vec<String> = st
                    .nodes
                    .values()
                    .filter(|n| self.healthy(n) && !st.applying.contains(&n.record.name))
                    .filter(|n| n.applied_generation != n.desired_generation || open.contains(&n.record.name))
                    .map(|n| n.record.name.clone())
                    .collect();
                st.applying.extend(due.iter().cloned());
                due
            };
            for node in due {
                let me = self.clone();
                tokio::spawn(async move {
                    let _ = me.apply_node(&node).await;
                    me.state.lock().unwrap().applying.remove(&node);
                });
            }
        }
    }

    // ---- conversions ----

    fn volume_proto(&self, v: &VolumeRecord) -> proto::Volume {
        let st = self.state.lock().unwrap();
        self.volume_proto_locked(&st, v)
    }

    fn volume_proto_locked(&self, st: &State, v: &VolumeRecord) -> proto::Volume {
        let allocated = if v.thin {
            st.nodes.get(&v.node).and_then(|n| n.usage.get(&v.engine_name)).copied().unwrap_or(0)
        } else {
            let cs = st
                .nodes
                .get(&v.node)
                .and_then(|n| n.pools.iter().find(|p| p.name == v.pool))
                .map_or(1, |p| p.cluster_size);
            scheduler::thick_bytes(v.size, cs)
        };
        proto::Volume {
            name: v.name.clone(),
            id: v.id.clone(),
            size_bytes: v.size,
            thin: v.thin,
            node: v.node.clone(),
            pool: v.pool.clone(),
            state: match v.state {
                VolumeState::Creating => "creating",
                VolumeState::Ready => "ready",
            }
            .into(),
            hosts: v.hosts.clone(),
            readonly_hosts: v.readonly_hosts.clone(),
            subsystem_nqn: v.subsystem_nqn.clone(),
            uuid: v.uuid.clone(),
            nguid: v.nguid.clone(),
            allocated_bytes: allocated,
            locality: locality_to(v.locality) as i32,
            host_node: v.host_node.clone(),
            include_nodes: v.include.clone(),
            exclude_nodes: v.exclude.clone(),
        }
    }
}

fn corrupt(e: serde_json::Error) -> Status {
    Status::data_loss(format!("a record in the controller's store is damaged ({e}); restore the store from a backup"))
}

fn no_volume(name: &str) -> Status {
    Status::not_found(format!("no volume {name}: `nvpool volume list` shows the volumes"))
}

fn same_request(v: &VolumeRecord, req: &proto::CreateVolumeRequest, locality: Locality) -> bool {
    v.size == req.size_bytes
        && v.thin == req.thin
        && v.locality == locality
        && v.host_node == req.host_node
        && v.include == req.include_nodes
        && v.exclude == req.exclude_nodes
}

fn no_room_message(req: &Request, scores: &[Score], nodes: usize) -> String {
    if scores.is_empty() {
        return "no node has registered yet: start `nvpool agent` on the nodes".into();
    }
    let reasons: Vec<String> =
        scores.iter().take(8).map(|s| format!("{}: {}", s.node, s.filtered_out.as_deref().unwrap_or(""))).collect();
    format!(
        "no node can take a {} volume of {} bytes ({}{}); free space, add disks, or ask for less",
        if req.thin { "thin" } else { "thick" },
        req.size,
        reasons.join("; "),
        if nodes > 8 { format!("; and {} more nodes", nodes - 8) } else { String::new() }
    )
}

pub fn locality_from(v: i32) -> Result<Locality, Status> {
    match proto::Locality::try_from(v) {
        Ok(proto::Locality::Any) => Ok(Locality::Any),
        Ok(proto::Locality::Local) => Ok(Locality::Local),
        Ok(proto::Locality::Remote) => Ok(Locality::Remote),
        Err(_) => Err(Status::invalid_argument(format!("locality {v} is not one of any (0), local (1) or remote (2)"))),
    }
}

pub fn locality_to(l: Locality) -> proto::Locality {
    match l {
        Locality::Any => proto::Locality::Any,
        Locality::Local => proto::Locality::Local,
        Locality::Remote => proto::Locality::Remote,
    }
}

fn score_proto(s: &Score) -> proto::NodeScore {
    proto::NodeScore {
        node: s.node.clone(),
        pool: s.pool.clone(),
        filtered_out: s.filtered_out.clone().unwrap_or_default(),
        locality_score: s.locality,
        space_score: s.space,
        total: s.total,
        used_ratio_after: s.used_ratio_after,
    }
}

fn pool_record(p: &proto::PoolReport) -> PoolRecord {
    PoolRecord {
        name: p.name.clone(),
        capacity_bytes: p.capacity_bytes,
        used_bytes: p.used_bytes,
        provisioned_bytes: p.provisioned_bytes,
        cluster_size: p.cluster_size,
        volumes: p.volumes,
        failed: (!p.failed.is_empty()).then(|| p.failed.clone()),
    }
}

fn pool_report(p: &PoolRecord) -> proto::PoolReport {
    proto::PoolReport {
        name: p.name.clone(),
        capacity_bytes: p.capacity_bytes,
        used_bytes: p.used_bytes,
        provisioned_bytes: p.provisioned_bytes,
        cluster_size: p.cluster_size,
        volumes: p.volumes,
        failed: p.failed.clone().unwrap_or_default(),
    }
}

fn split_address(a: &str) -> (String, u32) {
    match a.parse::<std::net::SocketAddr>() {
        Ok(s) => (s.ip().to_string(), u32::from(s.port())),
        Err(_) => (a.to_string(), 4420),
    }
}

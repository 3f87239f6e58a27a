//! Nodes: registration, heartbeats, health, and the views the scheduler sees.

use crate::cluster::convert::{pool_record, pool_report};
use crate::cluster::{Cluster, NodeEntry, State, Volumes, heartbeat_pace};
use crate::metrics::{ClusterFigures, PoolFigures};
use crate::model::{MigrationPhase, NODES, NodeRecord, ReplicaState, VolumeRecord, VolumeState, check_name, to_json};
use crate::proto::agent_client::AgentClient;
use crate::scheduler::{NodeView, PoolView};
use crate::store::Txn;
use crate::{access, proto, scheduler};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Status;

/// How long a node's agent may take to upgrade its engine: the engine itself gives up
/// on a new binary after about 20 s.
const UPGRADE_TIMEOUT: Duration = Duration::from_secs(60);

impl Cluster {
    /// Records a node; returns the controller IDs its engine is to hand out and how
    /// often it is to heartbeat.
    pub async fn register_node(&self, node: proto::Node) -> Result<((u16, u16), Duration), Status> {
        check_name("node", &node.name).map_err(Status::invalid_argument)?;
        match crate::model::host_address(&node.nvme_address) {
            None => {
                return Err(Status::invalid_argument(format!(
                    "node {}: host address {:?} is not IP:PORT or rdma:IP:PORT",
                    node.name, node.nvme_address
                )));
            }
            Some(("rdma", _)) if node.peer_address.is_empty() => {
                return Err(Status::invalid_argument(format!(
                    "node {}: hosts reach it over RDMA ({}), and other engines forward over NVMe/TCP: give the \
                     agent --peer-address IP:PORT (a TCP listener of its engine)",
                    node.name, node.nvme_address
                )));
            }
            Some(_) => {}
        }
        if !node.peer_address.is_empty() && node.peer_address.parse::<std::net::SocketAddr>().is_err() {
            return Err(Status::invalid_argument(format!(
                "node {}: peer address {:?} is not IP:PORT",
                node.name, node.peer_address
            )));
        }
        let _registering = self.registrations.lock().await;
        let _guard = self.node_locks.lock(&node.name).await;
        let cntlid_block = {
            let st = self.state.lock().unwrap();
            match st.nodes.get(&node.name).and_then(|n| n.record.cntlid_block) {
                Some(b) => b,
                // The block fewest nodes have, so that paths rarely need to avoid one.
                None => {
                    let mut holding = [0usize; access::CNTLID_BLOCKS as usize];
                    for b in st.nodes.values().filter_map(|n| n.record.cntlid_block) {
                        holding[usize::from(b % access::CNTLID_BLOCKS)] += 1;
                    }
                    (0..access::CNTLID_BLOCKS).min_by_key(|&b| holding[usize::from(b)]).unwrap_or(0)
                }
            }
        };
        let record = NodeRecord {
            name: node.name.clone(),
            agent_address: node.agent_address.clone(),
            nvme_address: node.nvme_address.clone(),
            labels: node.labels.into_iter().collect(),
            pools: node.pools.iter().map(pool_record).collect(),
            host_nqn: node.host_nqn.clone(),
            peer_address: node.peer_address.clone(),
            local_host_nqn: node.local_host_nqn.clone(),
            cntlid_block: Some(cntlid_block),
        };
        let changed = self.state.lock().unwrap().nodes.get(&record.name).is_none_or(|n| n.record != record);
        if changed {
            self.commit(Txn::default().put(format!("{NODES}{}", record.name), to_json(&record))).await?;
        }
        let mut st = self.state.lock().unwrap();
        let interval = heartbeat_pace(&self.cfg, st.nodes.len() + usize::from(!st.nodes.contains_key(&record.name)));
        let entry = st
            .nodes
            .entry(record.name.clone())
            .or_insert_with(|| NodeEntry::new(record.clone(), Instant::now(), interval));
        entry.interval = interval;
        entry.engine_version = node.engine_version.clone();
        entry.pools = record.pools.clone();
        entry.record = record.clone();
        entry.last_seen = Instant::now();
        // A (re)registered agent has applied nothing yet, and reached its engine; its
        // first heartbeat lists everything.
        entry.applied_generation = 0;
        entry.usage_complete = false;
        entry.engine_error = None;
        st.touch(&record.name);
        st.volumes.views.forget(&record.name);
        if changed {
            st.volumes.node_record_changed(&record.name);
        }
        Ok((access::cntlid_range(cntlid_block), interval))
    }

    /// Takes a node's heartbeat: what its engine reports, all of it or only what
    /// changed since the one before. Nothing is written to the store.
    pub fn heartbeat(&self, hb: proto::HeartbeatRequest) -> proto::HeartbeatResponse {
        let mut st = self.state.lock().unwrap();
        let interval = heartbeat_pace(&self.cfg, st.nodes.len());
        let heartbeat_interval_ms = interval.as_millis() as u64;
        let Some(n) = st.nodes.get_mut(&hb.node) else {
            return proto::HeartbeatResponse { known: false, send_everything: false, heartbeat_interval_ms };
        };
        n.last_seen = Instant::now();
        n.interval = interval;
        if !hb.engine_error.is_empty() {
            // The agent is alive but blind: keep the pools and usage last reported.
            if n.engine_error.is_none() {
                tracing::warn!(node = %hb.node, "the node's engine is down: {}", hb.engine_error);
            }
            n.engine_error = Some(hb.engine_error);
            return proto::HeartbeatResponse { known: true, send_everything: false, heartbeat_interval_ms };
        }
        if n.engine_error.take().is_some() {
            tracing::info!(node = %hb.node, "the node's engine is back");
        }
        n.engine_version = hb.engine_version;
        let pools: Vec<_> = hb.pools.iter().map(pool_record).collect();
        // A ledger rests on the pools' cluster sizes and the volumes' allocations.
        let ledger_stale = !hb.changes_only
            || !hb.volumes.is_empty()
            || !hb.volumes_gone.is_empty()
            || pools.len() != n.pools.len()
            || pools.iter().zip(&n.pools).any(|(a, b)| a.name != b.name || a.cluster_size != b.cluster_size);
        let report_changed = pools != n.pools;
        n.pools = pools;
        n.applied_generation = hb.applied_generation;
        let usage = hb.volumes.into_iter().map(|u| (u.engine_name, u.allocated_bytes));
        if hb.changes_only {
            // Changes on top of what this controller holds: without a complete report
            // under them they are still the newest figures, and the agent is asked for
            // everything next time.
            n.usage.extend(usage);
            for gone in &hb.volumes_gone {
                n.usage.remove(gone);
            }
        } else {
            n.usage = usage.collect();
            n.usage_complete = true;
        }
        n.io.update(n.last_seen, hb.counters, hb.changes_only, &hb.counters_gone);
        // Mirrors are listed whole each time: those that need the controller.
        n.mirrors = hb.mirrors.into_iter().map(|m| (m.subsystem_nqn.clone(), m)).collect();
        n.replicas_unconnected = hb.replicas_unconnected.into_iter().collect();
        let send_everything = !n.usage_complete;
        if ledger_stale {
            st.volumes.views.forget(&hb.node);
        } else if report_changed {
            st.volumes.views.report_changed(&hb.node);
        }
        proto::HeartbeatResponse { known: true, send_everything, heartbeat_interval_ms }
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
                volumes: st.volumes.of_node(&n.record.name).filter(|v| v.node == n.record.name).count() as u32,
                engine_error: n.engine_error.clone().unwrap_or_default(),
                host_nqn: n.record.host_nqn.clone(),
                peer_address: n.record.peer_address.clone(),
                cntlid_min: n.record.cntlid_block.map_or(0, |b| u32::from(access::cntlid_range(b).0)),
                cntlid_max: n.record.cntlid_block.map_or(0, |b| u32::from(access::cntlid_range(b).1)),
                engine_version: n.engine_version.clone(),
                local_host_nqn: n.record.local_host_nqn.clone(),
                io: n.io.total(),
            })
            .collect()
    }

    /// Hot-upgrades a node's engine through its agent: every connection stays, and a
    /// binary that cannot take over leaves the old engine serving (the error says why).
    pub async fn upgrade_node(&self, node: &str, binary: &str) -> Result<proto::UpgradeReply, Status> {
        let address = {
            let st = self.state.lock().unwrap();
            let n = st
                .nodes
                .get(node)
                .ok_or_else(|| Status::not_found(format!("node {node} is not registered (see `nvpool node list`)")))?;
            if !self.heartbeating(n) {
                return Err(Status::failed_precondition(format!(
                    "node {node} has not heartbeated for {:.1} s: its agent is down; upgrade it when it is back",
                    n.last_seen.elapsed().as_secs_f64()
                )));
            }
            n.record.agent_address.clone()
        };
        let mut client = AgentClient::new(self.channel(&address).map_err(Status::unavailable)?);
        let request = proto::UpgradeEngineRequest { binary: binary.to_string() };
        let reply = tokio::time::timeout(UPGRADE_TIMEOUT, client.upgrade_engine(request))
            .await
            .map_err(|_| {
                Status::deadline_exceeded(format!("node {node}'s agent did not answer within {UPGRADE_TIMEOUT:?}"))
            })?
            .map_err(|e| Status::new(e.code(), format!("node {node}: {}", e.message())))?;
        let mut reply = reply.into_inner();
        reply.node = node.to_string();
        tracing::info!(node, from = %reply.old_version, to = %reply.new_version, pause_us = reply.pause_us, "engine upgraded");
        Ok(reply)
    }

    /// The pool's state for a metrics scrape.
    pub fn figures(&self) -> ClusterFigures {
        let nodes = self.list_nodes();
        let pools = self.list_pools();
        let st = self.state.lock().unwrap();
        let count = |f: &dyn Fn(&VolumeRecord) -> bool| st.volumes.values().filter(|v| f(v)).count() as i64;
        ClusterFigures {
            nodes_healthy: nodes.iter().filter(|n| n.healthy).count() as i64,
            nodes_unhealthy: nodes.iter().filter(|n| !n.healthy).count() as i64,
            volumes_creating: count(&|v| v.state == VolumeState::Creating),
            volumes_ready: count(&|v| v.state == VolumeState::Ready),
            migrations: count(&|v| v.migration.is_some()),
            attachments: st.volumes.values().map(|v| v.hosts.len() as i64).sum(),
            replicas: [ReplicaState::InSync, ReplicaState::CatchingUp, ReplicaState::Faulted].map(|state| {
                st.volumes.replicated().flat_map(|v| &v.replicas).filter(|r| r.state == state).count() as i64
            }),
            volumes_degraded: st
                .volumes
                .replicated()
                .filter(|v| v.replicas.iter().any(|r| r.state != ReplicaState::InSync))
                .count() as i64,
            pools: pools
                .into_iter()
                .filter_map(|p| {
                    let r = p.pool?;
                    Some(PoolFigures {
                        node: p.node,
                        pool: r.name,
                        capacity_bytes: r.capacity_bytes as i64,
                        used_bytes: r.used_bytes as i64,
                        committed_bytes: p.committed_bytes as i64,
                        provisioned_bytes: r.provisioned_bytes as i64,
                        volumes: i64::from(r.volumes),
                        failed: !r.failed.is_empty(),
                    })
                })
                .collect(),
        }
    }

    pub fn list_pools(&self) -> Vec<proto::PoolOnNode> {
        let mut st = self.state.lock().unwrap();
        let views = self.node_views(&mut st);
        let mut out = Vec::new();
        // The views are in the nodes' order.
        for (n, view) in st.nodes.values().zip(views.iter()) {
            for p in &n.pools {
                let committed = view.pools.iter().find(|q| q.name == p.name).map_or(p.used_bytes, |q| q.committed);
                out.push(proto::PoolOnNode {
                    node: n.record.name.clone(),
                    pool: Some(pool_report(p)),
                    committed_bytes: committed,
                });
            }
        }
        out
    }

    /// Heartbeats arrive and the agent reaches its engine.
    pub(super) fn healthy(&self, n: &NodeEntry) -> bool {
        self.healthy_at(n, Instant::now())
    }

    /// As `healthy`, at `now`: a pass over every node reads the clock once.
    pub(super) fn healthy_at(&self, n: &NodeEntry, now: Instant) -> bool {
        self.heartbeating_at(n, now) && n.engine_error.is_none()
    }

    /// The node missed a heartbeat: a sign it may be lost, which others can confirm
    /// before it times out.
    pub(super) fn quiet(&self, n: &NodeEntry) -> bool {
        n.last_seen.elapsed() > n.interval * 3 / 2
    }

    /// Heartbeats arrive: the agent takes new states, even while its engine is down.
    pub(super) fn heartbeating(&self, n: &NodeEntry) -> bool {
        self.heartbeating_at(n, Instant::now())
    }

    fn heartbeating_at(&self, n: &NodeEntry, now: Instant) -> bool {
        // Told to heartbeat less often than the base interval, a node is given a
        // timeout stretched in proportion (in whole nanoseconds: this runs for every
        // node of a pass).
        let base = self.cfg.heartbeat_interval.as_nanos().max(1_000_000);
        let timeout = self.cfg.node_timeout.as_nanos() * n.interval.as_nanos().max(base) / base;
        now.saturating_duration_since(n.last_seen).as_nanos() < timeout
    }

    /// The scheduler's view of every node, in the order of `State::nodes`: reported
    /// pools, with what this controller has promised on them counted in even before
    /// the node reports it. Kept between calls: only the views something changed under
    /// are worked out again, and every node's health is read anew.
    pub(super) fn node_views(&self, st: &mut State) -> Arc<Vec<NodeView>> {
        let State { nodes, volumes, reserved, tombstones, .. } = st;
        // Creations under way and volumes whose removal is not confirmed yet are few;
        // what the stored volumes take is in each node's ledger.
        let mut pending: HashMap<(&str, &str), (u64, u64)> = HashMap::new();
        let creating = reserved.values().flat_map(|v| {
            let copies = std::iter::once((&v.node, &v.pool)).chain(v.replicas.iter().map(|r| (&r.node, &r.pool)));
            copies.map(move |(node, pool)| (node, pool, &v.engine_name, v.size, v.thin))
        });
        let dying = tombstones.values().map(|t| (&t.node, &t.pool, &t.engine_name, t.size, t.thin));
        for (node, pool, engine_name, size, thin) in creating.chain(dying) {
            if let Some(n) = nodes.get(node) {
                let e = pending.entry((node.as_str(), pool.as_str())).or_default();
                e.0 += taken_on(n, pool, engine_name, size, thin);
                e.1 += size;
            }
        }
        let now = Instant::now();
        let pending_nodes: BTreeSet<String> = pending.keys().map(|(node, _)| node.to_string()).collect();
        // Nodes only join: a list of another length misses some.
        if volumes.views.list.len() != nodes.len() {
            let list = nodes.values().map(|n| view_of(volumes.ledger(n), n, &pending, false)).collect();
            volumes.views.list = Arc::new(list);
            volumes.views.index = nodes.keys().enumerate().map(|(i, name)| (name.clone(), i)).collect();
            volumes.views.stale.clear();
        }
        // Views that counted pending work count it no more, or differently.
        let mut refresh = std::mem::take(&mut volumes.views.stale);
        refresh.extend(std::mem::replace(&mut volumes.views.pending, pending_nodes.clone()));
        refresh.extend(pending_nodes);
        let mut fresh = Vec::with_capacity(refresh.len());
        for name in &refresh {
            if let (Some(&i), Some(n)) = (volumes.views.index.get(name), nodes.get(name)) {
                fresh.push((i, view_of(volumes.ledger(n), n, &pending, false)));
            }
        }
        let list = Arc::make_mut(&mut volumes.views.list);
        for (i, view) in fresh {
            list[i] = view;
        }
        for (n, view) in nodes.values().zip(list.iter_mut()) {
            view.healthy = self.healthy_at(n, now);
        }
        debug_assert_eq!(
            *volumes.views.list,
            nodes
                .values()
                .map(|n| view_of(&NodeLedger::of(volumes, n), n, &pending, self.healthy_at(n, now)))
                .collect::<Vec<_>>(),
            "the kept node views differ from the nodes'"
        );
        volumes.views.list.clone()
    }
}

/// Node `n` as the scheduler sees it: its reported pools, with what its volumes take
/// (`ledger`) and what is `pending` on them counted in.
fn view_of(ledger: &NodeLedger, n: &NodeEntry, pending: &HashMap<(&str, &str), (u64, u64)>, healthy: bool) -> NodeView {
    let name = n.record.name.as_str();
    NodeView {
        name: n.record.name.clone(),
        healthy,
        local_demand: ledger.local_demand,
        local_held: ledger.local_held,
        pools: n
            .pools
            .iter()
            .map(|p| {
                let (held_taken, held_provisioned) = ledger.pools.get(&p.name).copied().unwrap_or_default();
                let (more_taken, more_provisioned) = pending.get(&(name, p.name.as_str())).copied().unwrap_or_default();
                PoolView {
                    name: p.name.clone(),
                    capacity: p.capacity_bytes,
                    committed: p.used_bytes.max(held_taken + more_taken),
                    provisioned: p.provisioned_bytes.max(held_provisioned + more_provisioned),
                    cluster_size: p.cluster_size,
                    failed: p.failed.clone(),
                }
            })
            .collect(),
    }
}

/// The scheduler's views of the nodes, kept between requests (a creation at 10,000
/// nodes would otherwise copy every node's pools and look up every node's ledger),
/// with the ledgers they rest on.
#[derive(Default)]
pub(super) struct NodeViews {
    /// Every node's view, in the order of `State::nodes`; shared with the callers,
    /// which drop it before the next call (so it is changed in place, not copied).
    list: Arc<Vec<NodeView>>,
    /// Each node's place in `list`.
    index: HashMap<String, usize>,
    /// Nodes whose view is out of date.
    stale: BTreeSet<String>,
    /// Nodes whose view counts creations or removals under way: worked out again at
    /// every call, since those end without a word to the views.
    pending: BTreeSet<String>,
    /// What each node's volumes take of its pools, as last worked out.
    ledgers: HashMap<String, NodeLedger>,
}

impl NodeViews {
    /// Forgets `node`'s view and ledger: its volumes, or its pools' sizes, changed.
    pub(super) fn forget(&mut self, node: &str) {
        self.ledgers.remove(node);
        self.report_changed(node);
    }

    /// Forgets `node`'s view, keeping its ledger: its report of its pools changed.
    pub(super) fn report_changed(&mut self, node: &str) {
        self.stale.insert(node.to_string());
    }
}

/// What one node's stored volumes take of its pools and promise them, and what its
/// pods asked to have locally. Worked out from the node's volumes (through the
/// indexes of `Volumes`) and its last report when a view needs it, and kept until
/// either changes.
#[derive(Debug, Default, PartialEq)]
pub(super) struct NodeLedger {
    /// By pool: (bytes taken, bytes promised). A migration's target takes the
    /// volume's room from the start.
    pools: HashMap<String, (u64, u64)>,
    /// Bytes of the live volumes that pods on this node asked to have here, and of
    /// those, the bytes that sit here.
    local_demand: u64,
    local_held: u64,
}

impl NodeLedger {
    fn of(volumes: &Volumes, n: &NodeEntry) -> NodeLedger {
        let name = n.record.name.as_str();
        let mut ledger = NodeLedger::default();
        let mut add = |pool: &str, engine_name: &str, size: u64, thin: bool| {
            let e = ledger.pools.entry(pool.to_string()).or_default();
            e.0 += taken_on(n, pool, engine_name, size, thin);
            e.1 += size;
        };
        for v in volumes.of_node(name) {
            if v.node == name {
                add(&v.pool, &v.engine_name, v.size, v.thin);
            }
            // Each replica takes the volume's room on its node's pool.
            if let Some(r) = v.replica_on(name) {
                add(&r.pool, &v.engine_name, v.size, v.thin);
            }
            if let Some(m) = v.migration.as_ref().filter(|m| m.phase != MigrationPhase::Retiring && m.to_node == name) {
                add(&m.to_pool, &v.engine_name, v.size, v.thin);
            }
        }
        for v in volumes.hosted_by(name) {
            ledger.local_demand += v.size;
            if v.node == name {
                ledger.local_held += v.size;
            }
        }
        ledger
    }
}

impl Volumes {
    /// Node `n`'s ledger, worked out again if something it rests on changed.
    fn ledger(&mut self, n: &NodeEntry) -> &NodeLedger {
        let name = &n.record.name;
        if !self.views.ledgers.contains_key(name) {
            let ledger = NodeLedger::of(self, n);
            self.views.ledgers.insert(name.clone(), ledger);
        }
        &self.views.ledgers[name]
    }
}

/// The bytes a volume takes of pool `pool` on node `n`: a thick volume its size in
/// whole clusters, a thin one what the node last reported allocated.
fn taken_on(n: &NodeEntry, pool: &str, engine_name: &str, size: u64, thin: bool) -> u64 {
    if thin {
        n.usage.get(engine_name).copied().unwrap_or(0)
    } else {
        let cluster_size = n.pools.iter().find(|p| p.name == pool).map_or(1, |p| p.cluster_size);
        scheduler::thick_bytes(size, cluster_size)
    }
}

#[cfg(test)]
mod pace_tests {
    use crate::cluster::{Cluster, ClusterConfig};
    use crate::proto;
    use crate::store::RedbStore;
    use std::sync::Arc;
    use std::time::Duration;

    fn node(name: &str, port: u16) -> proto::Node {
        proto::Node {
            name: name.into(),
            agent_address: "127.0.0.1:1".into(),
            nvme_address: format!("127.0.0.1:{port}"),
            ..Default::default()
        }
    }

    /// Past the budget, nodes are told to heartbeat less often, at registration and in
    /// every answer, and a node is judged by a timeout stretched in proportion.
    #[tokio::test]
    async fn past_the_budget_nodes_heartbeat_less_often_and_time_out_later() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(RedbStore::open(&dir.path().join("c.redb")).unwrap());
        let cfg = ClusterConfig {
            heartbeat_interval: Duration::from_millis(50),
            node_timeout: Duration::from_millis(100),
            heartbeat_budget: 10,
            rebalance_every: None,
            ..Default::default()
        };
        let cluster = Cluster::load(store, Vec::new(), cfg).await.unwrap();
        let (_, alone) = cluster.register_node(node("a", 4420)).await.unwrap();
        assert_eq!(alone, Duration::from_millis(100), "1 node at 10 a second: every 100 ms");
        let (_, paced) = cluster.register_node(node("b", 4421)).await.unwrap();
        assert_eq!(paced, Duration::from_millis(200), "2 nodes at 10 a second: every 200 ms each");
        let hb = cluster.heartbeat(proto::HeartbeatRequest { node: "a".into(), ..Default::default() });
        assert_eq!(hb.heartbeat_interval_ms, 200, "the first node hears the new pace with its next heartbeat");

        // Told 200 ms (4 times the base 50 ms), a node is healthy for 4 × 100 ms.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let heartbeating = |name: &str| cluster.heartbeating(&cluster.state.lock().unwrap().nodes[name]);
        assert!(heartbeating("a") && heartbeating("b"), "past the base timeout, within the stretched one");
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert!(!heartbeating("b"), "past the stretched timeout");
    }
}

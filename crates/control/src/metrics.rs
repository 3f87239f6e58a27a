//! Prometheus metrics of the controller and the agent (`--metrics-listen`): a small
//! HTTP server that answers `GET /metrics` in the Prometheus text format (0.0.4).
//!
//! Events (store commits, placements, leadership won) are counted as they happen in
//! [`ControllerMetrics`]; the pool's state (nodes by health, volumes by state, pool
//! capacity) is read from the leading cluster at scrape time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nvpool_api::scrape;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Labels of a placement: whether a node was found.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PlacementLabels {
    /// `volume` (a new volume) or `migration` (a new home for a moving one).
    pub purpose: &'static str,
    /// `placed` or `no_node`.
    pub result: &'static str,
}

/// Labels of the rebalancer's moves: why the volume moved.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RebalanceLabels {
    /// `home` (a local volume to its consumer's node), `room` (off that node, to make
    /// room for one) or `hole` (off a node, to make room for a volume that fit nowhere).
    pub reason: &'static str,
}

/// What the controller counts as it works; shared by every leadership term.
#[derive(Debug)]
pub struct ControllerMetrics {
    /// Time of the store's transactions.
    pub store_commit_seconds: Histogram,
    /// Transactions the store refused (another leader) or failed.
    pub store_commit_failures: Counter,
    /// Scheduler decisions.
    pub placements: Family<PlacementLabels, Counter>,
    /// Whether this controller leads.
    pub leader: Gauge,
    /// Terms this controller has won.
    pub leadership_terms: Counter,
    /// Migrations the rebalancer started, and their bytes (the volumes' sizes).
    pub rebalance_moves: Family<RebalanceLabels, Counter>,
    pub rebalance_bytes: Family<RebalanceLabels, Counter>,
    /// Time of the rebalancer's passes (its planning; the moves run after it).
    pub rebalance_pass_seconds: Histogram,
}

impl Default for ControllerMetrics {
    fn default() -> Self {
        ControllerMetrics {
            // 100 us to 10 s: redb on a local disk to etcd across a slow network.
            store_commit_seconds: Histogram::new([
                0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
            ]),
            store_commit_failures: Counter::default(),
            placements: Family::default(),
            leader: Gauge::default(),
            leadership_terms: Counter::default(),
            rebalance_moves: Family::default(),
            rebalance_bytes: Family::default(),
            rebalance_pass_seconds: Histogram::new([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]),
        }
    }
}

impl ControllerMetrics {
    /// Registers the event metrics under the controller's names.
    pub fn register(&self, r: &mut Registry) {
        r.register_with_unit(
            "nvpool_controller_store_commit",
            "Time of the controller's store transactions",
            Unit::Seconds,
            self.store_commit_seconds.clone(),
        );
        r.register(
            "nvpool_controller_store_commit_failures",
            "Store transactions that failed or were refused",
            self.store_commit_failures.clone(),
        );
        r.register(
            "nvpool_controller_placements",
            "Scheduler decisions, by purpose and result",
            self.placements.clone(),
        );
        r.register("nvpool_controller_leader", "1 while this controller leads the cluster", self.leader.clone());
        r.register(
            "nvpool_controller_leadership_terms",
            "Times this controller became the leader",
            self.leadership_terms.clone(),
        );
        r.register(
            "nvpool_controller_rebalance_moves",
            "Migrations the rebalancer started, by reason",
            self.rebalance_moves.clone(),
        );
        r.register_with_unit(
            "nvpool_controller_rebalance_moved",
            "Bytes of the volumes the rebalancer started moving, by reason",
            Unit::Bytes,
            self.rebalance_bytes.clone(),
        );
        r.register_with_unit(
            "nvpool_controller_rebalance_pass",
            "Time of the rebalancer's passes over the pool",
            Unit::Seconds,
            self.rebalance_pass_seconds.clone(),
        );
    }

    /// Records a move the rebalancer started.
    pub fn rebalanced(&self, reason: &'static str, bytes: u64) {
        let labels = RebalanceLabels { reason };
        self.rebalance_moves.get_or_create(&labels).inc();
        self.rebalance_bytes.get_or_create(&labels).inc_by(bytes);
    }

    /// Records a placement.
    pub fn placed(&self, purpose: &'static str, found: bool) {
        let result = if found { "placed" } else { "no_node" };
        self.placements.get_or_create(&PlacementLabels { purpose, result }).inc();
    }
}

/// Serves `GET /metrics` on `addr`; `render` builds the text of each scrape.
pub async fn serve(
    addr: SocketAddr,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen for metrics on {addr}: {e}; pass --metrics-listen another address"))?;
    Ok(tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let render = render.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(10), answer(stream, render)).await;
            });
        }
    }))
}

async fn answer(
    mut stream: tokio::net::TcpStream,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !scrape::head_complete(&head) {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    stream.write_all(scrape::reply(&head, || render()).as_bytes()).await?;
    stream.shutdown().await
}

/// The text of a registry.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String does not fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
    out
}

/// The pool's state as a scrape reports it, read from the leading cluster.
#[derive(Debug, Default)]
pub struct ClusterFigures {
    /// Nodes whose agent heartbeats and whose engine answers, and the others.
    pub nodes_healthy: i64,
    pub nodes_unhealthy: i64,
    /// Volumes by state: placed and not yet confirmed by their engine, or ready.
    pub volumes_creating: i64,
    pub volumes_ready: i64,
    /// Volumes moving to another node.
    pub migrations: i64,
    /// Host attachments over all volumes.
    pub attachments: i64,
    /// Replicas of replicated volumes besides the serving ones: in sync, catching up
    /// (rebuilding), faulted.
    pub replicas: [i64; 3],
    /// Replicated volumes with fewer replicas in sync than asked for.
    pub volumes_degraded: i64,
    pub pools: Vec<PoolFigures>,
}

/// One pool of one node.
#[derive(Debug, Default)]
pub struct PoolFigures {
    pub node: String,
    pub pool: String,
    pub capacity_bytes: i64,
    pub used_bytes: i64,
    /// What the volumes placed on it may take (thick sizes, thin allocations).
    pub committed_bytes: i64,
    pub provisioned_bytes: i64,
    pub volumes: i64,
    pub failed: bool,
}

type Labels = Vec<(&'static str, String)>;

/// Registers the cluster's state as gauges.
pub fn register_cluster(r: &mut Registry, f: &ClusterFigures) {
    let gauge = |r: &mut Registry, name: &str, help: &str, unit: Option<Unit>, values: Vec<(Labels, i64)>| {
        let family = Family::<Labels, Gauge>::default();
        for (labels, v) in values {
            family.get_or_create(&labels).set(v);
        }
        match unit {
            Some(u) => r.register_with_unit(name, help, u, family),
            None => r.register(name, help, family),
        }
    };
    gauge(
        r,
        "nvpool_cluster_nodes",
        "Nodes, by health (healthy: the agent heartbeats and the engine answers)",
        None,
        vec![
            (vec![("health", "healthy".into())], f.nodes_healthy),
            (vec![("health", "unhealthy".into())], f.nodes_unhealthy),
        ],
    );
    gauge(
        r,
        "nvpool_cluster_volumes",
        "Volumes, by state (creating: placed, not yet confirmed by the node's engine)",
        None,
        vec![
            (vec![("state", "creating".into())], f.volumes_creating),
            (vec![("state", "ready".into())], f.volumes_ready),
        ],
    );
    gauge(r, "nvpool_cluster_migrations", "Volumes moving to another node", None, vec![(vec![], f.migrations)]);
    gauge(r, "nvpool_cluster_attachments", "Hosts attached, over all volumes", None, vec![(vec![], f.attachments)]);
    gauge(
        r,
        "nvpool_cluster_replicas",
        "Replicas of replicated volumes besides the serving ones, by state",
        None,
        ["in-sync", "rebuilding", "faulted"]
            .iter()
            .zip(f.replicas)
            .map(|(s, n)| (vec![("state", s.to_string())], n))
            .collect(),
    );
    gauge(
        r,
        "nvpool_cluster_volumes_degraded",
        "Replicated volumes with fewer replicas in sync than asked for",
        None,
        vec![(vec![], f.volumes_degraded)],
    );
    let per_pool = |read: fn(&PoolFigures) -> i64| {
        f.pools.iter().map(|p| (vec![("node", p.node.clone()), ("pool", p.pool.clone())], read(p))).collect()
    };
    gauge(
        r,
        "nvpool_cluster_pool_capacity",
        "Data space of each node's pool",
        Some(Unit::Bytes),
        per_pool(|p| p.capacity_bytes),
    );
    gauge(r, "nvpool_cluster_pool_used", "Space allocated to volumes", Some(Unit::Bytes), per_pool(|p| p.used_bytes));
    gauge(
        r,
        "nvpool_cluster_pool_committed",
        "Space the volumes placed on the pool may take (the scheduler's view)",
        Some(Unit::Bytes),
        per_pool(|p| p.committed_bytes),
    );
    gauge(
        r,
        "nvpool_cluster_pool_provisioned",
        "Sum of the sizes of the pool's volumes",
        Some(Unit::Bytes),
        per_pool(|p| p.provisioned_bytes),
    );
    gauge(r, "nvpool_cluster_pool_volumes", "Volumes in each pool", None, per_pool(|p| p.volumes));
    gauge(
        r,
        "nvpool_cluster_pool_failed",
        "1 when the pool stopped accepting changes",
        None,
        per_pool(|p| i64::from(p.failed)),
    );
}

/// Labels of an agent's exchange with the controller or its engine.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// `ok`, `failed`, or for a heartbeat `unknown_node` (the controller asked it to
    /// register again).
    pub result: &'static str,
}

/// What an agent counts.
#[derive(Debug)]
pub struct AgentMetrics {
    /// 1 while the controller knows this node.
    pub registered: Gauge,
    /// 1 while the engine answers the agent.
    pub engine_up: Gauge,
    pub heartbeats: Family<ResultLabels, Counter>,
    /// Desired states applied to the engine, by whether every volume succeeded.
    pub applies: Family<ResultLabels, Counter>,
    /// Time to apply a desired state.
    pub apply_seconds: Histogram,
    /// Generation of the last state applied without errors.
    pub applied_generation: Gauge,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        AgentMetrics {
            registered: Gauge::default(),
            engine_up: Gauge::default(),
            heartbeats: Family::default(),
            applies: Family::default(),
            apply_seconds: Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 20.0]),
            applied_generation: Gauge::default(),
        }
    }
}

impl AgentMetrics {
    /// A registry of the agent's metrics.
    pub fn registry(&self) -> Registry {
        let mut r = Registry::default();
        r.register("nvpool_agent_registered", "1 while the controller knows this node", self.registered.clone());
        r.register("nvpool_agent_engine_up", "1 while the node's engine answers the agent", self.engine_up.clone());
        r.register("nvpool_agent_heartbeats", "Heartbeats sent to the controller, by result", self.heartbeats.clone());
        r.register("nvpool_agent_applies", "Desired states applied to the engine, by result", self.applies.clone());
        r.register_with_unit(
            "nvpool_agent_apply",
            "Time to apply a desired state to the engine",
            Unit::Seconds,
            self.apply_seconds.clone(),
        );
        r.register(
            "nvpool_agent_applied_generation",
            "Generation of the last desired state applied without errors",
            self.applied_generation.clone(),
        );
        r
    }
}

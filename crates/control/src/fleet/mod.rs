//! A fleet of simulated nodes in one process, to measure a real controller at a scale
//! no test machine has (`nvpool bench fleet`). Each node registers, heartbeats and
//! applies the node states the controller sends over the controller's real gRPC
//! protocol, as an agent does, with no engine behind it: what it is told to make
//! exists at once. One Agent server serves every node (a state names its node), so
//! that ten thousand nodes cost ten thousand small records, not ten thousand sockets.

use crate::client::Controllers;
use crate::proto::{self, agent_server::AgentServer};
use prost::Message;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tonic::{Request, Response, Status};

/// What each node of a uniform fleet has: one pool of this size.
pub const POOL_BYTES: u64 = 4 << 40;
const CLUSTER_BYTES: u64 = 1 << 20;

/// A simulated node's pool (its only one): its size and its cluster size, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct SimPool {
    pub capacity: u64,
    pub cluster_size: u64,
}

/// One simulated node: the state it holds, as an agent holds it.
#[derive(Default)]
struct SimNode {
    /// Its pool; a node without disks has none.
    pool: Option<SimPool>,
    /// The generation and entries (by volume ID) of the state it holds.
    held: Option<(u64, HashMap<String, proto::DesiredVolume>)>,
    /// Whether the controller holds a complete report of it.
    reported: bool,
    /// When it was last given a whole state.
    whole_at: Option<std::time::Instant>,
}

/// The fleet's nodes, by name, and what they were asked.
pub struct Fleet {
    nodes: HashMap<String, Mutex<SimNode>>,
    names: Vec<String>,
    /// Applications received, and entries applied (listed) in them.
    pub applies: AtomicU64,
    pub entries_applied: AtomicU64,
    pub whole_states: AtomicU64,
    /// Heartbeats the controller answered, and the bytes of those answers.
    pub heartbeats: AtomicU64,
    pub answer_bytes: AtomicU64,
    /// The migrations the nodes' engines would be carrying out, by the engine's name
    /// of the volume moving (unique in the pool): what a status call answers.
    migrations: Mutex<HashMap<String, proto::MigrationReply>>,
}

impl Fleet {
    /// `count` nodes named `{prefix}00000`, ..., each with a pool of `POOL_BYTES`.
    pub fn new(prefix: &str, count: usize) -> Arc<Fleet> {
        let pool = SimPool { capacity: POOL_BYTES, cluster_size: CLUSTER_BYTES };
        Fleet::of((0..count).map(|i| (format!("{prefix}{i:05}"), Some(pool))).collect())
    }

    /// These nodes, with these pools.
    pub fn of(nodes: Vec<(String, Option<SimPool>)>) -> Arc<Fleet> {
        let names: Vec<String> = nodes.iter().map(|(name, _)| name.clone()).collect();
        Arc::new(Fleet {
            nodes: nodes
                .into_iter()
                .map(|(name, pool)| (name, Mutex::new(SimNode { pool, ..SimNode::default() })))
                .collect(),
            names,
            applies: AtomicU64::new(0),
            entries_applied: AtomicU64::new(0),
            whole_states: AtomicU64::new(0),
            heartbeats: AtomicU64::new(0),
            answer_bytes: AtomicU64::new(0),
            migrations: Mutex::new(HashMap::new()),
        })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// How many nodes were given a whole state after `since`.
    fn given_whole_since(&self, since: std::time::Instant) -> usize {
        self.nodes.values().filter(|n| n.lock().unwrap().whole_at.is_some_and(|at| at > since)).count()
    }

    /// Serves the Agent API for every node on `listener`.
    pub fn serve(self: &Arc<Fleet>, listener: tokio::net::TcpListener) {
        let service = AgentServer::from_arc(Arc::new(FleetService(self.clone())))
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(crate::server::accepted(listener)),
        );
    }

    /// The node's registration, as an agent at `agent_address` makes it.
    fn registration(&self, index: usize, agent_address: &str) -> proto::RegisterNodeRequest {
        let name = &self.names[index];
        proto::RegisterNodeRequest {
            node: Some(proto::Node {
                name: name.clone(),
                agent_address: agent_address.to_string(),
                // Never dialled: no host connects in a fleet.
                nvme_address: format!("127.0.0.{}:{}", 1 + index / 60000, 1024 + index % 60000),
                pools: self.pool(name).into_iter().collect(),
                host_nqn: format!("nqn.2024-01.io.nvpool:fleet:{name}"),
                engine_version: "fleet".into(),
                ..Default::default()
            }),
        }
    }

    /// The node's pool, as its engine would report it: thick volumes take their
    /// size in whole clusters, thin ones nothing (nothing is written).
    fn pool(&self, name: &str) -> Option<proto::PoolReport> {
        let node = self.nodes[name].lock().unwrap();
        let pool = node.pool?;
        let present = node.held.as_ref().map(|(_, e)| e.values().filter(|d| d.present && d.owner_address.is_empty()));
        let (volumes, provisioned, used) = present.map_or((0, 0, 0), |p| {
            p.fold((0u32, 0u64, 0u64), |(n, b, u), d| {
                let taken = if d.thin { 0 } else { crate::scheduler::thick_bytes(d.size_bytes, pool.cluster_size) };
                (n + 1, b + d.size_bytes, u + taken)
            })
        });
        Some(proto::PoolReport {
            name: "p".into(),
            capacity_bytes: pool.capacity,
            used_bytes: used,
            provisioned_bytes: provisioned,
            cluster_size: pool.cluster_size,
            volumes,
            failed: String::new(),
            power_losses: 0,
            snapshot_bytes: 0,
        })
    }

    /// Registers every node with the controllers, `parallel` at a time.
    pub async fn register_all(
        self: &Arc<Fleet>,
        controllers: &Arc<Controllers>,
        agent_address: &str,
        parallel: usize,
    ) -> Result<Duration, String> {
        let mut interval = Duration::from_secs(1);
        let indexes: Vec<usize> = (0..self.names.len()).collect();
        for chunk in indexes.chunks(parallel.max(1)) {
            let mut calls = tokio::task::JoinSet::new();
            for &i in chunk {
                let req = self.registration(i, agent_address);
                let controllers = controllers.clone();
                calls.spawn(async move { controllers.call(async |mut c| c.register_node(req.clone()).await).await });
            }
            while let Some(r) = calls.join_next().await {
                let r = r.map_err(|e| e.to_string())?.map_err(|e| format!("registering: {}", e.message()))?;
                interval = Duration::from_millis(r.heartbeat_interval_ms.max(100));
            }
        }
        Ok(interval)
    }

    /// Heartbeats every node once per `interval`, spread over it, in `lanes` tasks, for
    /// ever; the interval follows what the controller's answers say, as an agent's
    /// does. A node at rest reports no changes, as an agent with a quiet engine does.
    pub fn heartbeat_forever(self: &Arc<Fleet>, controllers: Arc<Controllers>, interval: Duration, lanes: usize) {
        let interval_ms = Arc::new(AtomicU64::new(interval.as_millis() as u64));
        // No more lanes than nodes: a lane without one would loop without awaiting and
        // hold a runtime thread (a fleet of 5 nodes with 8 lanes never finished).
        let lanes = lanes.clamp(1, self.names.len().max(1));
        for lane in 0..lanes {
            let fleet = self.clone();
            let controllers = controllers.clone();
            let interval_ms = interval_ms.clone();
            tokio::spawn(async move {
                let mine: Vec<String> = fleet.names.iter().skip(lane).step_by(lanes).cloned().collect();
                loop {
                    // Each round spreads the lane's nodes over the interval last told.
                    let interval = Duration::from_millis(interval_ms.load(Ordering::Relaxed));
                    let gap = interval / (mine.len().max(1) as u32);
                    let mut tick = tokio::time::interval(gap.max(Duration::from_micros(50)));
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    for name in &mine {
                        tick.tick().await;
                        if let Some(ms) = fleet.send_heartbeat(&controllers, name).await {
                            interval_ms.store(ms.max(100), Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    }

    /// Sends node `name`'s heartbeat and takes the answer, as its agent does; returns
    /// the interval (ms) the controller asks for, if it says.
    async fn send_heartbeat(&self, controllers: &Controllers, name: &str) -> Option<u64> {
        let hb = self.heartbeat(name);
        let r = controllers.call(async |mut c| c.heartbeat(hb.clone()).await).await.ok()?;
        self.heartbeats.fetch_add(1, Ordering::Relaxed);
        self.answer_bytes.fetch_add(r.encoded_len() as u64, Ordering::Relaxed);
        self.nodes[name].lock().unwrap().reported = r.known && !r.send_everything;
        (r.heartbeat_interval_ms > 0).then_some(r.heartbeat_interval_ms)
    }

    /// Whether node `name` is one of the fleet's and holds volume `id` (present).
    fn holds(&self, name: &str, id: &str) -> bool {
        let Some(node) = self.nodes.get(name) else { return false };
        let node = node.lock().unwrap();
        node.held.as_ref().and_then(|(_, e)| e.get(id)).is_some_and(|d| d.present)
    }

    fn heartbeat(&self, name: &str) -> proto::HeartbeatRequest {
        let pool = self.pool(name);
        let node = self.nodes[name].lock().unwrap();
        let volumes = match node.reported {
            true => Vec::new(),
            false => node
                .held
                .iter()
                .flat_map(|(_, e)| e.values())
                .filter(|d| d.present && d.owner_address.is_empty())
                .map(|d| proto::VolumeUsage { engine_name: d.engine_name.clone(), allocated_bytes: 0 })
                .collect(),
        };
        proto::HeartbeatRequest {
            node: name.to_string(),
            pools: pool.into_iter().collect(),
            volumes,
            applied_generation: node.held.as_ref().map_or(0, |(g, _)| *g),
            engine_version: "fleet".into(),
            changes_only: node.reported,
            ..Default::default()
        }
    }
}

struct FleetService(Arc<Fleet>);

#[tonic::async_trait]
impl proto::agent_server::Agent for FleetService {
    /// Applies a state as an agent does (whole, or changes to the state held; changes
    /// to a state not held are refused with `whole_state_wanted`), and reports every
    /// entry applied as done.
    async fn apply(&self, r: Request<proto::NodeState>) -> Result<Response<proto::ApplyResponse>, Status> {
        let state = r.into_inner();
        let fleet = &self.0;
        let node = fleet.nodes.get(&state.node).ok_or_else(|| Status::not_found(format!("no node {}", state.node)))?;
        let mut node = node.lock().unwrap();
        fleet.applies.fetch_add(1, Ordering::Relaxed);
        let mut entries = match (state.changes_since, node.held.take()) {
            (0, _) => {
                fleet.whole_states.fetch_add(1, Ordering::Relaxed);
                node.whole_at = Some(std::time::Instant::now());
                HashMap::new()
            }
            (since, Some((generation, entries))) if generation == since => entries,
            (_, held) => {
                node.held = held;
                return Ok(Response::new(proto::ApplyResponse { results: Vec::new(), whole_state_wanted: true }));
            }
        };
        for id in &state.dropped {
            entries.remove(id);
        }
        fleet.entries_applied.fetch_add(state.volumes.len() as u64, Ordering::Relaxed);
        let results = state.volumes.iter().map(done).collect();
        entries.extend(state.volumes.into_iter().map(|d| (d.id.clone(), d)));
        node.held = Some((state.generation, entries));
        Ok(Response::new(proto::ApplyResponse { results, whole_state_wanted: false }))
    }

    /// Carries out a migration as an engine whose copy takes no time: started, its
    /// first round is done; asked to switch, it has switched and the volume is gone
    /// from here.
    async fn migration(&self, r: Request<proto::MigrationRequest>) -> Result<Response<proto::MigrationReply>, Status> {
        let req = r.into_inner();
        let mut migrations = self.0.migrations.lock().unwrap();
        let copying = || proto::MigrationReply {
            state: "copying".into(),
            volume_here: true,
            round: 1,
            round_bytes: vec![0],
            id: req.id.clone(),
            ..Default::default()
        };
        let reply = match req.action.as_str() {
            "start" => migrations.entry(req.engine_name.clone()).insert_entry(copying()).get().clone(),
            "switch" => {
                let switched = proto::MigrationReply {
                    state: "switched".into(),
                    volume_here: false,
                    switch_requested: true,
                    ..copying()
                };
                migrations.entry(req.engine_name.clone()).insert_entry(switched).get().clone()
            }
            "cancel" => {
                let cancelled = proto::MigrationReply { state: "cancelled".into(), ..copying() };
                migrations.entry(req.engine_name.clone()).insert_entry(cancelled).get().clone()
            }
            "status" => migrations.get(&req.engine_name).cloned().unwrap_or_else(|| proto::MigrationReply {
                state: "none".into(),
                volume_here: true,
                ..Default::default()
            }),
            other => return Err(Status::invalid_argument(format!("no migration action {other:?}"))),
        };
        Ok(Response::new(reply))
    }

    async fn upgrade_engine(
        &self,
        _: Request<proto::UpgradeEngineRequest>,
    ) -> Result<Response<proto::UpgradeReply>, Status> {
        Err(Status::unimplemented("a simulated node has no engine to upgrade"))
    }

    /// A snapshot takes no time and holds nothing on a simulated node.
    async fn take_snapshot(
        &self,
        _: Request<proto::TakeSnapshotRequest>,
    ) -> Result<Response<proto::TakeSnapshotReply>, Status> {
        Ok(Response::new(proto::TakeSnapshotReply::default()))
    }

    /// Nothing to hold on a simulated node.
    async fn hold_writes(
        &self,
        _: Request<proto::HoldWritesRequest>,
    ) -> Result<Response<proto::HoldWritesReply>, Status> {
        Ok(Response::new(proto::HoldWritesReply {}))
    }

    /// An inflation is done at once on a simulated node.
    async fn inflate_volume(&self, _: Request<proto::InflateRequest>) -> Result<Response<proto::InflateReply>, Status> {
        Ok(Response::new(proto::InflateReply { done: true, ..Default::default() }))
    }
}

/// A desired entry made (or removed) at once, with the identity an engine derives;
/// every host allowed is connected, as hosts that connect to each path they are
/// given are.
fn done(d: &proto::DesiredVolume) -> proto::VolumeResult {
    let uuid = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, d.id.as_bytes());
    proto::VolumeResult {
        id: d.id.clone(),
        uuid: uuid.to_string(),
        nguid: uuid.simple().to_string(),
        connected_hosts: if d.present { d.hosts.clone() } else { Vec::new() },
        ..Default::default()
    }
}

/// The host that volume `i` is attached to: one of a hundred.
pub(super) fn host_of(i: u64) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-{:012}", i % 100)
}

mod bench;
mod plane;
mod replay;
pub use bench::{BenchConfig, BenchReport, Changes, Figures, Pages, StoreKind, Stretch, bench};
pub use replay::{ReplayConfig, ReplayReport, replay};

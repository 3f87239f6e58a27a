//! A fleet of simulated nodes in one process, to measure a real controller at a scale
//! no test machine has (`nvpool bench fleet`). Each node registers, heartbeats and
//! applies the node states the controller sends over the controller's real gRPC
//! protocol, as an agent does, with no engine behind it: what it is told to make
//! exists at once. One Agent server serves every node (a state names its node), so
//! that ten thousand nodes cost ten thousand small records, not ten thousand sockets.

use crate::client::Controllers;
use crate::proto::{self, agent_server::AgentServer};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tonic::{Request, Response, Status};

/// What each simulated node has: one pool of this size.
pub const POOL_BYTES: u64 = 4 << 40;
const CLUSTER_BYTES: u64 = 1 << 20;

/// One simulated node: the state it holds, as an agent holds it.
#[derive(Default)]
struct SimNode {
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
    /// Heartbeats the controller answered.
    pub heartbeats: AtomicU64,
}

impl Fleet {
    /// `count` nodes named `{prefix}00000`, ...
    pub fn new(prefix: &str, count: usize) -> Arc<Fleet> {
        let names: Vec<String> = (0..count).map(|i| format!("{prefix}{i:05}")).collect();
        Arc::new(Fleet {
            nodes: names.iter().map(|n| (n.clone(), Mutex::new(SimNode::default()))).collect(),
            names,
            applies: AtomicU64::new(0),
            entries_applied: AtomicU64::new(0),
            whole_states: AtomicU64::new(0),
            heartbeats: AtomicU64::new(0),
        })
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Checks a listing against what was made, and the nodes against the listing:
    /// `count` volumes, each one created by the bench attached to its host through at
    /// least one path, and held (present) by its owner and by every node on its paths.
    fn check(&self, listed: &[proto::Volume], count: usize) -> Result<(), String> {
        if listed.len() != count {
            return Err(format!("the controller lists {} volumes of the {count} made", listed.len()));
        }
        for v in listed {
            let mut holders = vec![v.node.as_str()];
            if let Some(i) = v.name.strip_prefix('v').and_then(|i| i.parse::<u64>().ok()) {
                let host = host_of(i);
                let Some(attached) = v.attachments.iter().find(|a| a.host_nqn == host) else {
                    return Err(format!("volume {} lost its attachment to {host}", v.name));
                };
                if attached.paths.is_empty() {
                    return Err(format!("volume {} has no path to {host}", v.name));
                }
                holders.extend(attached.paths.iter().map(|p| p.node.as_str()));
            }
            for node in holders {
                let held = self.nodes.get(node).and_then(|n| {
                    let n = n.lock().unwrap();
                    n.held.as_ref().and_then(|(_, e)| e.get(&v.id)).map(|d| d.present)
                });
                if held != Some(true) {
                    return Err(format!("node {node} does not hold volume {} ({})", v.name, v.id));
                }
            }
        }
        Ok(())
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
                pools: vec![self.pool(name)],
                host_nqn: format!("nqn.2024-01.io.nvpool:fleet:{name}"),
                engine_version: "fleet".into(),
                ..Default::default()
            }),
        }
    }

    /// The node's one pool, as its engine would report it: thick volumes take their
    /// size in whole clusters, thin ones nothing (nothing is written).
    fn pool(&self, name: &str) -> proto::PoolReport {
        let node = self.nodes[name].lock().unwrap();
        let present = node.held.as_ref().map(|(_, e)| e.values().filter(|d| d.present && d.owner_address.is_empty()));
        let (volumes, provisioned, used) = present.map_or((0, 0, 0), |p| {
            p.fold((0u32, 0u64, 0u64), |(n, b, u), d| {
                let taken = if d.thin { 0 } else { crate::scheduler::thick_bytes(d.size_bytes, CLUSTER_BYTES) };
                (n + 1, b + d.size_bytes, u + taken)
            })
        });
        proto::PoolReport {
            name: "p".into(),
            capacity_bytes: POOL_BYTES,
            used_bytes: used,
            provisioned_bytes: provisioned,
            cluster_size: CLUSTER_BYTES,
            volumes,
            failed: String::new(),
        }
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
                        let hb = fleet.heartbeat(name);
                        if let Ok(r) = controllers.call(async |mut c| c.heartbeat(hb.clone()).await).await {
                            fleet.heartbeats.fetch_add(1, Ordering::Relaxed);
                            if r.heartbeat_interval_ms > 0 {
                                interval_ms.store(r.heartbeat_interval_ms.max(100), Ordering::Relaxed);
                            }
                            let mut node = fleet.nodes[name].lock().unwrap();
                            node.reported = r.known && !r.send_everything;
                        }
                    }
                }
            });
        }
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
            pools: vec![pool],
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

    async fn migration(&self, _: Request<proto::MigrationRequest>) -> Result<Response<proto::MigrationReply>, Status> {
        Err(Status::unimplemented("a simulated node has no engine to move data with"))
    }

    async fn upgrade_engine(
        &self,
        _: Request<proto::UpgradeEngineRequest>,
    ) -> Result<Response<proto::UpgradeReply>, Status> {
        Err(Status::unimplemented("a simulated node has no engine to upgrade"))
    }
}

/// A desired entry made (or removed) at once, with the identity an engine derives.
fn done(d: &proto::DesiredVolume) -> proto::VolumeResult {
    let uuid = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, d.id.as_bytes());
    proto::VolumeResult {
        id: d.id.clone(),
        uuid: uuid.to_string(),
        nguid: uuid.simple().to_string(),
        ..Default::default()
    }
}

/// What `nvpool bench fleet` runs: a controller of its own (the embedded store) and a
/// fleet of simulated nodes.
pub struct BenchConfig {
    /// The nvpool binary, which runs the controller.
    pub binary: std::path::PathBuf,
    /// Where the controller keeps its store and log.
    pub dir: std::path::PathBuf,
    pub nodes: usize,
    pub volumes: usize,
    /// Thin volumes (else thick).
    pub thin: bool,
    /// Creations per second, all clients together.
    pub rate: f64,
    pub clients: usize,
    /// How long to watch the controller at rest, before the failover.
    pub rest: Duration,
}

/// Latency figures of one stretch of creations and of their attachments, in
/// milliseconds.
pub struct Stretch {
    pub upto: usize,
    pub create: Figures,
    pub attach: Figures,
}

pub struct Figures {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Figures {
    fn of(mut ms: Vec<f64>) -> Figures {
        ms.sort_by(f64::total_cmp);
        Figures { p50: percentile(&ms, 0.5), p99: percentile(&ms, 0.99), max: ms.last().copied().unwrap_or(0.0) }
    }
}

/// The host that volume `i` is attached to: one of a hundred.
fn host_of(i: u64) -> String {
    format!("nqn.2014-08.org.nvmexpress:uuid:00000000-0000-4000-8000-{:012}", i % 100)
}

pub struct BenchReport {
    pub nodes: usize,
    pub volumes: usize,
    pub register_seconds: f64,
    pub creations: Vec<Stretch>,
    pub creations_per_second: f64,
    pub controller_cpu_creating: f64,
    pub controller_cpu_rest: f64,
    /// Heartbeats the controller answered per second at rest.
    pub heartbeats_per_second_rest: f64,
    pub controller_rss_mib: u64,
    pub store_mib: f64,
    pub list_volumes_ms: f64,
    /// How evenly the volumes spread: the fewest and the most on one node.
    pub fewest_on_a_node: usize,
    pub most_on_a_node: usize,
    pub applies: u64,
    pub entries_applied: u64,
    pub whole_states: u64,
    /// After a SIGKILL of the controller and a restart: until it lists every volume.
    pub failover_serving_seconds: f64,
    /// Until every node was given its whole state again (a new leader holds no node's
    /// state), and how many were by `rest` after the kill if not all.
    pub failover_reconciled_seconds: Option<f64>,
    pub failover_reconciled_nodes: usize,
    /// One creation right after the failover.
    pub failover_create_ms: f64,
}

/// CPU seconds a process used so far (user and system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime, the 14th and 15th fields, in USER_HZ (100 on Linux).
    (ticks(11) + ticks(12)) / 100.0
}

fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().split(' ').next()?.parse().ok());
    kib.unwrap_or(0u64) / 1024
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or(0.0)
}

struct ControllerProcess {
    child: std::process::Child,
    address: String,
}

/// A controller the bench started goes with it, however the bench ends (a failed run
/// left one running).
impl Drop for ControllerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_controller(cfg: &BenchConfig, port: u16) -> Result<ControllerProcess, String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(cfg.dir.join("controller.log"))
        .map_err(|e| format!("controller log in {}: {e}", cfg.dir.display()))?;
    let address = format!("127.0.0.1:{port}");
    let child = std::process::Command::new(&cfg.binary)
        .args(["controller", "--listen", &address, "--store"])
        .arg(format!("redb:{}", cfg.dir.join("controller.redb").display()))
        .stdout(log.try_clone().map_err(|e| e.to_string())?)
        .stderr(log)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", cfg.binary.display()))?;
    Ok(ControllerProcess { child, address })
}

/// Runs the fleet against a new controller: registration, `volumes` creations (each
/// attached at once) at `rate`, `rest` at rest, a listing, then a SIGKILL of the
/// controller and a restart, until every node was given its state again. Fails if a
/// volume, its attachment, or a node's copy of either is missing from what the
/// controller lists and the nodes hold, before or after the restart.
pub async fn bench(cfg: BenchConfig) -> Result<BenchReport, String> {
    // A port the restarted controller listens on again.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let mut controller = start_controller(&cfg, port)?;
    let controllers = Arc::new(Controllers::new(&controller.address)?);
    let fleet = Fleet::new("f", cfg.nodes);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let agent_address = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    fleet.serve(listener);

    let started = std::time::Instant::now();
    let interval = fleet.register_all(&controllers, &agent_address, 64).await?;
    let register_seconds = started.elapsed().as_secs_f64();
    fleet.heartbeat_forever(controllers.clone(), interval, 8);

    // Creations at the rate asked, from several clients at once.
    let pid = controller.child.id();
    let cpu_before = cpu_seconds(pid);
    let next = Arc::new(AtomicU64::new(0));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(cfg.volumes)));
    let started = std::time::Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..cfg.clients.max(1) {
        let (next, latencies, controllers) = (next.clone(), latencies.clone(), controllers.clone());
        let (volumes, rate, thin) = (cfg.volumes as u64, cfg.rate, cfg.thin);
        clients.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= volumes {
                    return Ok::<(), String>(());
                }
                // Volume i is due at i / rate seconds from the start.
                tokio::time::sleep_until((started + Duration::from_secs_f64(i as f64 / rate)).into()).await;
                let req = proto::CreateVolumeRequest {
                    name: format!("v{i:06}"),
                    size_bytes: 16 << 20,
                    thin,
                    qos: Some(proto::QosLimits { iops: 20_000, bps: 200 << 20, ..Default::default() }),
                    ..Default::default()
                };
                let t = std::time::Instant::now();
                controllers
                    .call(async |mut c| c.create_volume(req.clone()).await)
                    .await
                    .map_err(|e| format!("create {}: {}", req.name, e.message()))?;
                let created = t.elapsed().as_secs_f64() * 1000.0;
                // Attached at once, as a provisioner's volume is: the host gets its
                // paths, and two other nodes export the volume as access points.
                let attach =
                    proto::AttachRequest { volume: req.name.clone(), host_nqn: host_of(i), ..Default::default() };
                let t = std::time::Instant::now();
                controllers
                    .call(async |mut c| c.attach(attach.clone()).await)
                    .await
                    .map_err(|e| format!("attach {}: {}", req.name, e.message()))?;
                latencies.lock().unwrap().push((i, created, t.elapsed().as_secs_f64() * 1000.0));
            }
        });
    }
    while let Some(r) = clients.join_next().await {
        r.map_err(|e| e.to_string())??;
    }
    let creating = started.elapsed().as_secs_f64();
    let cpu_created = cpu_seconds(pid);
    let mut by_index = std::mem::take(&mut *latencies.lock().unwrap());
    by_index.sort_by_key(|&(i, _, _)| i);
    let tenth = (cfg.volumes / 10).max(1);
    let creations = by_index
        .chunks(tenth)
        .enumerate()
        .map(|(k, part)| Stretch {
            upto: (k * tenth + part.len()),
            create: Figures::of(part.iter().map(|&(_, ms, _)| ms).collect()),
            attach: Figures::of(part.iter().map(|&(_, _, ms)| ms).collect()),
        })
        .collect();

    let heartbeats_before = fleet.heartbeats.load(Ordering::Relaxed);
    tokio::time::sleep(cfg.rest).await;
    let cpu_rest = (cpu_seconds(pid) - cpu_created) / cfg.rest.as_secs_f64();
    let heartbeats_per_second_rest =
        (fleet.heartbeats.load(Ordering::Relaxed) - heartbeats_before) as f64 / cfg.rest.as_secs_f64();
    let controller_rss_mib = rss_mib(pid);
    let t = std::time::Instant::now();
    let listed = controllers.call(async |mut c| c.list_volumes(proto::ListVolumesRequest::default()).await).await;
    let list_volumes_ms = t.elapsed().as_secs_f64() * 1000.0;
    let listed = listed.map_err(|e| format!("list: {}", e.message()))?.volumes;
    fleet.check(&listed, cfg.volumes).map_err(|e| format!("before the failover: {e}"))?;
    let mut per_node: HashMap<&str, usize> = fleet.names().iter().map(|n| (n.as_str(), 0)).collect();
    for v in &listed {
        *per_node.entry(v.node.as_str()).or_default() += 1;
    }
    let fewest_on_a_node = per_node.values().copied().min().unwrap_or(0);
    let most_on_a_node = per_node.values().copied().max().unwrap_or(0);
    let store_mib = std::fs::metadata(cfg.dir.join("controller.redb")).map_or(0.0, |m| m.len() as f64 / 1048576.0);
    let (applies, entries_applied, whole_states) = (
        fleet.applies.load(Ordering::Relaxed),
        fleet.entries_applied.load(Ordering::Relaxed),
        fleet.whole_states.load(Ordering::Relaxed),
    );

    // The leader dies; a new process takes over from the store.
    controller.child.kill().map_err(|e| e.to_string())?;
    let _ = controller.child.wait();
    let killed = std::time::Instant::now();
    controller = start_controller(&cfg, port)?;
    loop {
        let listed = controllers.call(async |mut c| c.list_volumes(proto::ListVolumesRequest::default()).await).await;
        if listed.is_ok_and(|l| l.volumes.len() == cfg.volumes) {
            break;
        }
        if killed.elapsed() > Duration::from_secs(300) {
            return Err("the restarted controller did not list every volume within 300 s".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let failover_serving_seconds = killed.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let req = proto::CreateVolumeRequest {
        name: "after-failover".into(),
        size_bytes: 16 << 20,
        thin: true,
        ..Default::default()
    };
    controllers
        .call(async |mut c| c.create_volume(req.clone()).await)
        .await
        .map_err(|e| format!("create after the failover: {}", e.message()))?;
    let failover_create_ms = t.elapsed().as_secs_f64() * 1000.0;
    // Every node gets its state from the new leader (whole: it holds none of theirs).
    let give_up = killed + Duration::from_secs(120).max(cfg.rest);
    let failover_reconciled_seconds = loop {
        if fleet.given_whole_since(killed) == cfg.nodes {
            break Some(killed.elapsed().as_secs_f64());
        }
        if std::time::Instant::now() > give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let failover_reconciled_nodes = fleet.given_whole_since(killed);
    let listed = controllers.call(async |mut c| c.list_volumes(proto::ListVolumesRequest::default()).await).await;
    let listed = listed.map_err(|e| format!("list after the failover: {}", e.message()))?.volumes;
    // The volume made after the failover counts too.
    fleet.check(&listed, cfg.volumes + 1).map_err(|e| format!("after the failover: {e}"))?;
    drop(controller);
    Ok(BenchReport {
        nodes: cfg.nodes,
        volumes: cfg.volumes,
        register_seconds,
        creations,
        creations_per_second: cfg.volumes as f64 / creating,
        controller_cpu_creating: 100.0 * (cpu_created - cpu_before) / creating,
        controller_cpu_rest: 100.0 * cpu_rest,
        heartbeats_per_second_rest,
        controller_rss_mib,
        store_mib,
        list_volumes_ms,
        fewest_on_a_node,
        most_on_a_node,
        applies,
        entries_applied,
        whole_states,
        failover_serving_seconds,
        failover_reconciled_seconds,
        failover_reconciled_nodes,
        failover_create_ms,
    })
}

//! The bench's run: creations and their attachments at a set rate, then resizes,
//! deletions and migrations, figures at rest, a listing and the dashboard's pages,
//! and a failover, each checked against what the controller lists and the nodes hold.

use super::plane::{ControlPlane, cpu_seconds, http_get, metric, rss_mib, written_bytes};
use super::{Fleet, host_of};
use crate::client::Controllers;
use crate::proto;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Where the bench's controllers keep the pool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum StoreKind {
    /// One controller with redb in a file.
    Embedded,
    /// Two controllers (a leader and a standby) on a cluster of three etcd members.
    Etcd,
}

impl std::str::FromStr for StoreKind {
    type Err = String;
    fn from_str(s: &str) -> Result<StoreKind, String> {
        match s {
            "embedded" => Ok(StoreKind::Embedded),
            "etcd" => Ok(StoreKind::Etcd),
            _ => Err(format!("no store {s:?}: use embedded or etcd")),
        }
    }
}

/// What `nvpool fleet` runs: controllers of its own and a fleet of simulated nodes.
pub struct BenchConfig {
    /// The nvpool binary, which runs the controllers.
    pub binary: std::path::PathBuf,
    /// Where the controllers keep their store and logs.
    pub dir: std::path::PathBuf,
    pub store: StoreKind,
    pub nodes: usize,
    pub volumes: usize,
    /// Thin volumes (else thick).
    pub thin: bool,
    /// Creations (and then changes) per second, all clients together.
    pub rate: f64,
    pub clients: usize,
    /// How long to watch the controller at rest, before the failover.
    pub rest: Duration,
}

/// The size volumes are made with, and the size the resized ones grow to.
const CREATED_BYTES: u64 = 16 << 20;
const RESIZED_BYTES: u64 = 32 << 20;
/// Most volumes migrated (one in a hundred, up to this many).
const MOST_MIGRATIONS: u64 = 200;

/// What the bench changes of a volume once every volume is made.
#[derive(Clone, Copy, PartialEq)]
enum Change {
    Resize,
    Delete,
    Migrate,
}

/// Every tenth volume is resized, another tenth detached and deleted, and one in a
/// hundred migrated.
fn change_of(i: u64) -> Option<Change> {
    match i % 100 {
        3 if i / 100 < MOST_MIGRATIONS => Some(Change::Migrate),
        r if r % 10 == 1 => Some(Change::Resize),
        r if r % 10 == 2 => Some(Change::Delete),
        _ => None,
    }
}

/// What the bench made and changed, to check the controller and the nodes against.
#[derive(Default)]
struct Made {
    volumes: usize,
    /// IDs of the volumes to delete, by index, as their creations answered.
    to_delete: HashMap<u64, String>,
    /// IDs of the volumes deleted.
    deleted: HashSet<String>,
    /// Volumes migrated, and the node each left.
    moved_from: HashMap<String, String>,
}

/// Latency figures of one stretch of creations and of their attachments, in
/// milliseconds.
pub struct Stretch {
    pub upto: usize,
    pub create: Figures,
    pub attach: Figures,
}

pub struct Figures {
    pub count: usize,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Figures {
    fn of(mut ms: Vec<f64>) -> Figures {
        ms.sort_by(f64::total_cmp);
        Figures {
            count: ms.len(),
            p50: percentile(&ms, 0.5),
            p99: percentile(&ms, 0.99),
            max: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// Latencies of the changes made once every volume existed, in milliseconds (a
/// migration's move in seconds).
pub struct Changes {
    pub resize: Figures,
    pub detach: Figures,
    pub delete: Figures,
    pub migrate: Figures,
    pub moved_seconds: Figures,
}

/// Time to serve one page of each of the dashboard's tables, and its summary, in
/// milliseconds.
pub struct Pages {
    pub summary_ms: f64,
    pub nodes_ms: f64,
    pub volumes_ms: f64,
}

pub struct BenchReport {
    pub store: StoreKind,
    pub nodes: usize,
    pub volumes: usize,
    pub register_seconds: f64,
    pub creations: Vec<Stretch>,
    /// Every creation: its index, and its create and attach latencies (ms).
    pub samples: Vec<(u64, f64, f64)>,
    pub creations_per_second: f64,
    pub controller_cpu_creating: f64,
    /// The etcd members' CPU while creating, all together (etcd only).
    pub store_cpu_creating: f64,
    pub changes: Changes,
    /// From the last change until no node was given a state for 3 s.
    pub settled_seconds: f64,
    pub controller_cpu_rest: f64,
    /// Heartbeats the controller answered per second at rest, the bytes of an answer,
    /// and the states applied to nodes while at rest.
    pub heartbeats_per_second_rest: f64,
    pub answer_bytes_rest: f64,
    pub applies_rest: u64,
    /// Store transactions per second at rest, and bytes the store's processes wrote
    /// per second (the controller for redb, the members for etcd).
    pub commits_per_second_rest: f64,
    pub store_written_per_second_rest: f64,
    pub controller_rss_mib: u64,
    pub store_mib: f64,
    pub list_volumes_ms: f64,
    pub pages: Pages,
    /// The rebalancer's passes so far, and their mean and longest bucket (s).
    pub rebalance_passes: f64,
    pub rebalance_pass_mean_ms: f64,
    /// How evenly the creations spread (before any change): the fewest and the most
    /// volumes on one node.
    pub fewest_on_a_node: usize,
    pub most_on_a_node: usize,
    pub applies: u64,
    pub entries_applied: u64,
    pub whole_states: u64,
    /// After a SIGKILL of the leader: until a controller (a restarted one, or the
    /// standby under etcd) lists every volume.
    pub failover_serving_seconds: f64,
    /// Until every node was given its whole state again (a new leader holds no node's
    /// state), and how many were by `rest` after the kill if not all.
    pub failover_reconciled_seconds: Option<f64>,
    pub failover_reconciled_nodes: usize,
    /// One creation right after the failover.
    pub failover_create_ms: f64,
}

/// Every volume the controllers list.
async fn list_every_volume(controllers: &Controllers) -> Result<Vec<proto::Volume>, tonic::Status> {
    let listed = controllers.call(async |mut c| c.list_volumes(proto::ListVolumesRequest::default()).await).await;
    listed.map(|l| l.volumes)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 * p) as usize).min(sorted.len().saturating_sub(1))).copied().unwrap_or(0.0)
}

impl Fleet {
    /// Checks a listing against what the bench made and changed, and the nodes
    /// against the listing: each volume the bench made and did not delete is listed
    /// (and `extra` more), at its new size if resized, on another node if migrated,
    /// attached to its host through at least one path, and held (present) by its owner
    /// and by every node on its paths; no node holds a deleted one.
    fn check(&self, listed: &[proto::Volume], made: &Made, extra: usize) -> Result<(), String> {
        let count = made.volumes - made.deleted.len() + extra;
        if listed.len() != count {
            return Err(format!("the controller lists {} volumes; {count} should be there", listed.len()));
        }
        for v in listed {
            let mut holders = vec![v.node.as_str()];
            if let Some(i) = v.name.strip_prefix('v').and_then(|i| i.parse::<u64>().ok()) {
                match change_of(i) {
                    Some(Change::Delete) => return Err(format!("volume {} was deleted but is listed", v.name)),
                    Some(Change::Resize) if v.size_bytes != RESIZED_BYTES => {
                        return Err(format!(
                            "volume {} has {} bytes, not the {RESIZED_BYTES} it was resized to",
                            v.name, v.size_bytes
                        ));
                    }
                    Some(Change::Migrate) if v.migration.is_some() || made.moved_from.get(&v.name) == Some(&v.node) => {
                        return Err(format!("volume {} did not move off {}", v.name, v.node));
                    }
                    _ => {}
                }
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
                if !self.holds(node, &v.id) {
                    return Err(format!("node {node} does not hold volume {} ({})", v.name, v.id));
                }
            }
        }
        for (name, node) in &self.nodes {
            let node = node.lock().unwrap();
            let entries = node.held.iter().flat_map(|(_, e)| e.values());
            if let Some(d) = entries.filter(|d| d.present).find(|d| made.deleted.contains(&d.id)) {
                return Err(format!("node {name} still holds deleted volume {}", d.id));
            }
        }
        Ok(())
    }
}

/// Runs the fleet against controllers of its own: registration, `volumes` creations
/// (each attached at once) at `rate`, then changes at the same rate (resizes,
/// detachments and deletions, migrations), `rest` at rest, a listing and the
/// dashboard's pages, then a SIGKILL of the leader (a restart of it, or the standby
/// taking over under etcd), until every node was given its state again. Fails if a
/// volume, its attachment, a change, or a node's copy of any is missing from what the
/// controller lists and the nodes hold, before or after the failover.
pub async fn bench(cfg: BenchConfig) -> Result<BenchReport, String> {
    let mut plane = ControlPlane::start(&cfg.binary, &cfg.dir, cfg.store, &[]).await?;
    let controllers = Arc::new(Controllers::new(&plane.addresses())?);
    let fleet = Fleet::new("f", cfg.nodes);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let agent_address = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    fleet.serve(listener);

    let started = std::time::Instant::now();
    let interval = fleet.register_all(&controllers, &agent_address, 64).await?;
    let register_seconds = started.elapsed().as_secs_f64();
    // A lane heartbeats its nodes one after another, as no agent waits for another:
    // a hundred nodes a lane, so that a lane keeps its pace while the controller is
    // busy (8 lanes for 10,000 nodes fell behind by more than the node timeout, and
    // the controller rightly took their nodes for dead).
    fleet.heartbeat_forever(controllers.clone(), interval, cfg.nodes.div_ceil(100).max(8));

    // Creations at the rate asked, from several clients at once.
    let leader = plane.await_leader(Duration::from_secs(10)).await?;
    let pid = plane.pid(leader);
    let store_cpu = |plane: &ControlPlane| match plane.etcd.is_empty() {
        true => 0.0,
        false => plane.store_pids().into_iter().map(cpu_seconds).sum(),
    };
    let (cpu_before, store_cpu_before) = (cpu_seconds(pid), store_cpu(&plane));
    let made = Arc::new(Mutex::new(Made { volumes: cfg.volumes, ..Default::default() }));
    let started = std::time::Instant::now();
    let samples = run_at_rate(&cfg, (0..cfg.volumes as u64).collect(), {
        let (controllers, thin, made) = (controllers.clone(), cfg.thin, made.clone());
        move |i| {
            let (controllers, made) = (controllers.clone(), made.clone());
            async move {
                let req = proto::CreateVolumeRequest {
                    name: format!("v{i:06}"),
                    size_bytes: CREATED_BYTES,
                    thin,
                    qos: Some(proto::QosLimits { iops: 20_000, bps: 200 << 20, ..Default::default() }),
                    ..Default::default()
                };
                let t = std::time::Instant::now();
                let created = controllers
                    .call(async |mut c| c.create_volume(req.clone()).await)
                    .await
                    .map_err(|e| format!("create {}: {}", req.name, e.message()))?;
                let create_ms = t.elapsed().as_secs_f64() * 1000.0;
                if change_of(i) == Some(Change::Delete) {
                    made.lock().unwrap().to_delete.insert(i, created.volume.map(|v| v.id).unwrap_or_default());
                }
                // Attached at once, as a provisioner's volume is: the host gets its
                // paths, and two other nodes export the volume as access points.
                let attach =
                    proto::AttachRequest { volume: req.name.clone(), host_nqn: host_of(i), ..Default::default() };
                let t = std::time::Instant::now();
                controllers
                    .call(async |mut c| c.attach(attach.clone()).await)
                    .await
                    .map_err(|e| format!("attach {}: {}", req.name, e.message()))?;
                Ok((create_ms, t.elapsed().as_secs_f64() * 1000.0))
            }
        }
    })
    .await?;
    let creating = started.elapsed().as_secs_f64();
    let cpu_created = cpu_seconds(pid);
    let store_cpu_creating = 100.0 * (store_cpu(&plane) - store_cpu_before) / creating;
    let samples: Vec<(u64, f64, f64)> = samples.into_iter().map(|(i, (create, attach))| (i, create, attach)).collect();
    let tenth = (cfg.volumes / 10).max(1);
    let creations = samples
        .chunks(tenth)
        .enumerate()
        .map(|(k, part)| Stretch {
            upto: (k * tenth + part.len()),
            create: Figures::of(part.iter().map(|&(_, ms, _)| ms).collect()),
            attach: Figures::of(part.iter().map(|&(_, _, ms)| ms).collect()),
        })
        .collect();

    let created = list_every_volume(&controllers).await.map_err(|e| format!("list: {}", e.message()))?;
    let mut per_node: HashMap<&str, usize> = fleet.names().iter().map(|n| (n.as_str(), 0)).collect();
    for v in &created {
        *per_node.entry(v.node.as_str()).or_default() += 1;
    }
    let fewest_on_a_node = per_node.values().copied().min().unwrap_or(0);
    let most_on_a_node = per_node.values().copied().max().unwrap_or(0);
    drop(created);

    let changes = make_changes(&cfg, &controllers, &made).await?;

    // The last changes' removals reach their nodes (a migration's old copy, a deleted
    // volume's tombstone): settled once no state was applied for 3 s.
    let settling = std::time::Instant::now();
    let mut quiet_since = (std::time::Instant::now(), fleet.applies.load(Ordering::Relaxed));
    while quiet_since.0.elapsed() < Duration::from_secs(3) && settling.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let applies = fleet.applies.load(Ordering::Relaxed);
        if applies != quiet_since.1 {
            quiet_since = (std::time::Instant::now(), applies);
        }
    }
    let settled_seconds = settling.elapsed().as_secs_f64() - 3.0;

    // At rest: nothing changes, so nothing should be applied or written.
    let scrape = |plane: &ControlPlane, i: usize| {
        let address = plane.controllers[i].metrics.clone();
        async move { http_get(&address, "/metrics").await.map(|(s, _)| s) }
    };
    let (heartbeats_before, answer_bytes_before, applies_before) = (
        fleet.heartbeats.load(Ordering::Relaxed),
        fleet.answer_bytes.load(Ordering::Relaxed),
        fleet.applies.load(Ordering::Relaxed),
    );
    let commits_before = metric(&scrape(&plane, leader).await?, "nvpool_controller_store_commit_seconds_count");
    let written_before: f64 = plane.store_pids().into_iter().map(written_bytes).sum();
    let cpu_rest_before = cpu_seconds(pid);
    tokio::time::sleep(cfg.rest).await;
    let rest = cfg.rest.as_secs_f64();
    let cpu_rest = (cpu_seconds(pid) - cpu_rest_before) / rest;
    let after_rest = scrape(&plane, leader).await?;
    let commits_per_second_rest =
        (metric(&after_rest, "nvpool_controller_store_commit_seconds_count") - commits_before) / rest;
    let written: f64 = plane.store_pids().into_iter().map(written_bytes).sum();
    let store_written_per_second_rest = (written - written_before) / rest;
    let heartbeats_rest = fleet.heartbeats.load(Ordering::Relaxed) - heartbeats_before;
    let heartbeats_per_second_rest = heartbeats_rest as f64 / rest;
    let answer_bytes_rest =
        (fleet.answer_bytes.load(Ordering::Relaxed) - answer_bytes_before) as f64 / heartbeats_rest.max(1) as f64;
    let applies_rest = fleet.applies.load(Ordering::Relaxed) - applies_before;
    let rebalance_passes = metric(&after_rest, "nvpool_controller_rebalance_pass_seconds_count");
    let rebalance_pass_mean_ms =
        1000.0 * metric(&after_rest, "nvpool_controller_rebalance_pass_seconds_sum") / rebalance_passes.max(1.0);
    let controller_rss_mib = rss_mib(pid);

    let t = std::time::Instant::now();
    let listed = list_every_volume(&controllers).await;
    let list_volumes_ms = t.elapsed().as_secs_f64() * 1000.0;
    let listed = listed.map_err(|e| format!("list: {}", e.message()))?;
    fleet.check(&listed, &made.lock().unwrap(), 0).map_err(|e| format!("before the failover: {e}"))?;
    let http = plane.controllers[leader].http.clone();
    let pages = Pages {
        summary_ms: http_get(&http, "/api/v1/summary").await?.1,
        nodes_ms: http_get(&http, "/api/v1/nodes?sort=name&limit=50").await?.1,
        volumes_ms: http_get(&http, "/api/v1/volumes?sort=name&limit=50&offset=5000").await?.1,
    };
    let store_mib = plane.store_bytes() as f64 / 1048576.0;
    let (applies, entries_applied, whole_states) = (
        fleet.applies.load(Ordering::Relaxed),
        fleet.entries_applied.load(Ordering::Relaxed),
        fleet.whole_states.load(Ordering::Relaxed),
    );

    // The leader dies. Alone, it is started again and takes over from its file;
    // under etcd, the standby takes over once the lease lapses, and the dead one
    // comes back as the standby.
    let expected = listed.len();
    plane.controllers[leader].kill();
    let killed = std::time::Instant::now();
    if plane.controllers.len() == 1 {
        plane.launch(leader)?;
    }
    loop {
        if list_every_volume(&controllers).await.is_ok_and(|l| l.len() == expected) {
            break;
        }
        if killed.elapsed() > Duration::from_secs(300) {
            return Err("no controller listed every volume within 300 s of the leader's SIGKILL".into());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let failover_serving_seconds = killed.elapsed().as_secs_f64();
    if plane.controllers.len() > 1 {
        plane.launch(leader)?;
    }
    let t = std::time::Instant::now();
    let req = proto::CreateVolumeRequest {
        name: "after-failover".into(),
        size_bytes: CREATED_BYTES,
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
    let listed =
        list_every_volume(&controllers).await.map_err(|e| format!("list after the failover: {}", e.message()))?;
    // The volume made after the failover counts too.
    fleet.check(&listed, &made.lock().unwrap(), 1).map_err(|e| format!("after the failover: {e}"))?;
    drop(plane);
    Ok(BenchReport {
        store: cfg.store,
        nodes: cfg.nodes,
        volumes: cfg.volumes,
        register_seconds,
        creations,
        samples,
        creations_per_second: cfg.volumes as f64 / creating,
        controller_cpu_creating: 100.0 * (cpu_created - cpu_before) / creating,
        store_cpu_creating,
        changes,
        settled_seconds,
        controller_cpu_rest: 100.0 * cpu_rest,
        heartbeats_per_second_rest,
        answer_bytes_rest,
        applies_rest,
        commits_per_second_rest,
        store_written_per_second_rest,
        controller_rss_mib,
        store_mib,
        list_volumes_ms,
        pages,
        rebalance_passes,
        rebalance_pass_mean_ms,
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

/// Runs `op` on each of `indexes` at `cfg.rate` per second from `cfg.clients`
/// clients (the k-th is due k / rate seconds from the start); returns what each
/// gave, in the order of the indexes.
async fn run_at_rate<T, F, Fut>(cfg: &BenchConfig, indexes: Vec<u64>, op: F) -> Result<Vec<(u64, T)>, String>
where
    T: Send + 'static,
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<T, String>> + Send,
{
    let indexes = Arc::new(indexes);
    let next = Arc::new(AtomicU64::new(0));
    let figures = Arc::new(Mutex::new(Vec::with_capacity(indexes.len())));
    let started = std::time::Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..cfg.clients.max(1) {
        let (indexes, next, figures, op, rate) = (indexes.clone(), next.clone(), figures.clone(), op.clone(), cfg.rate);
        clients.spawn(async move {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(&i) = indexes.get(k) else { return Ok::<(), String>(()) };
                tokio::time::sleep_until((started + Duration::from_secs_f64(k as f64 / rate)).into()).await;
                let f = op(i).await?;
                figures.lock().unwrap().push((k, i, f));
            }
        });
    }
    while let Some(r) = clients.join_next().await {
        r.map_err(|e| e.to_string())??;
    }
    let mut figures = std::mem::take(&mut *figures.lock().unwrap());
    figures.sort_by_key(|&(k, _, _)| k);
    Ok(figures.into_iter().map(|(_, i, f)| (i, f)).collect())
}

/// What one change took: its calls (ms), and a migration's move until its volume
/// was on its new node (s).
enum Changed {
    Resized { ms: f64 },
    Deleted { detach_ms: f64, delete_ms: f64 },
    Migrating { ms: f64, moved: tokio::task::JoinHandle<Result<f64, String>> },
}

/// The changes, at the bench's rate: resizes, detachments and deletions, and
/// migrations (each followed, beside the others, until its volume is on its new node).
async fn make_changes(
    cfg: &BenchConfig,
    controllers: &Arc<Controllers>,
    made: &Arc<Mutex<Made>>,
) -> Result<Changes, String> {
    let changed: Vec<u64> = (0..cfg.volumes as u64).filter(|&i| change_of(i).is_some()).collect();
    let (controllers, made) = (controllers.clone(), made.clone());
    let done = run_at_rate(cfg, changed, move |i| {
        let (controllers, made) = (controllers.clone(), made.clone());
        async move {
            let name = format!("v{i:06}");
            let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1000.0;
            let t = std::time::Instant::now();
            match change_of(i) {
                Some(Change::Resize) => {
                    let req = proto::ResizeVolumeRequest { name: name.clone(), size_bytes: RESIZED_BYTES };
                    controllers
                        .call(async |mut c| c.resize_volume(req.clone()).await)
                        .await
                        .map_err(|e| format!("resize {name}: {}", e.message()))?;
                    Ok(Changed::Resized { ms: ms(t) })
                }
                Some(Change::Delete) => {
                    let req = proto::DetachRequest { volume: name.clone(), host_nqn: host_of(i) };
                    controllers
                        .call(async |mut c| c.detach(req.clone()).await)
                        .await
                        .map_err(|e| format!("detach {name}: {}", e.message()))?;
                    let detach_ms = ms(t);
                    let req = proto::VolumeName { name: name.clone() };
                    let t = std::time::Instant::now();
                    controllers
                        .call(async |mut c| c.delete_volume(req.clone()).await)
                        .await
                        .map_err(|e| format!("delete {name}: {}", e.message()))?;
                    let mut made = made.lock().unwrap();
                    let id = made.to_delete.remove(&i).unwrap_or_default();
                    made.deleted.insert(id);
                    Ok(Changed::Deleted { detach_ms, delete_ms: ms(t) })
                }
                Some(Change::Migrate) => {
                    let req = proto::MigrateVolumeRequest { name: name.clone(), auto: true, ..Default::default() };
                    let moving = controllers
                        .call(async |mut c| c.migrate_volume(req.clone()).await)
                        .await
                        .map_err(|e| format!("migrate {name}: {}", e.message()))?;
                    let migrate_ms = ms(t);
                    made.lock().unwrap().moved_from.insert(name.clone(), moving.node.clone());
                    let moved = tokio::spawn(moved_off(controllers.clone(), name, moving.node, t));
                    Ok(Changed::Migrating { ms: migrate_ms, moved })
                }
                None => unreachable!("only changed volumes are listed"),
            }
        }
    })
    .await?;
    let (mut resize, mut detach, mut delete, mut migrate, mut moved) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (_, changed) in done {
        match changed {
            Changed::Resized { ms } => resize.push(ms),
            Changed::Deleted { detach_ms, delete_ms } => {
                detach.push(detach_ms);
                delete.push(delete_ms);
            }
            Changed::Migrating { ms, moved: seconds } => {
                migrate.push(ms);
                moved.push(seconds.await.map_err(|e| e.to_string())??);
            }
        }
    }
    Ok(Changes {
        resize: Figures::of(resize),
        detach: Figures::of(detach),
        delete: Figures::of(delete),
        migrate: Figures::of(migrate),
        moved_seconds: Figures::of(moved),
    })
}

/// Seconds from `started` until volume `name` is off `from` with no migration left.
async fn moved_off(
    controllers: Arc<Controllers>,
    name: String,
    from: String,
    started: std::time::Instant,
) -> Result<f64, String> {
    let get = proto::VolumeName { name: name.clone() };
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let v = controllers
            .call(async |mut c| c.get_volume(get.clone()).await)
            .await
            .map_err(|e| format!("get {name}: {}", e.message()))?;
        if v.migration.is_none() {
            if v.node == from {
                return Err(format!("migrate {name}: it stayed on {from} ({})", v.last_migration));
            }
            return Ok(started.elapsed().as_secs_f64());
        }
        if started.elapsed() > Duration::from_secs(120) {
            return Err(format!("migrate {name}: still moving after 120 s"));
        }
    }
}

//! `nvpool agent`: one per node. It registers the node with the controller, reports
//! its pools and heartbeats, and makes its engine match the state the controller wants:
//! volumes, their exports and allow-lists. It keeps the last state it was given and
//! applies it again when a heartbeat finds another engine process, so an engine that
//! restarted gets its exports back without the controller's help; a restarted agent
//! registers again and is sent the state anew. On a volume's owner it also makes the
//! local devices the controller wants (ublk, for the node's own containers): an engine
//! that restarted takes such a device back by its number, with the I/O it held.

use crate::client::Controllers;
use crate::metrics::{AgentMetrics, ResultLabels};
use crate::model::{REPLICA_NQN_SUFFIX, VOLUME_NQN_PREFIX};
use crate::proto::{self, agent_server::AgentServer};
use nvpool_api::{
    AddHost, AddLocalDevice, AddNamespace, AddSubsystem, AnaState, CancelMigration, CloneVolume, CreateSnapshot,
    CreateVolume, DeleteVolume, DhchapKeys, EngineInfo, ErrorKind, GetEngineInfo, GetMigration, GetRebuild,
    GetSubsystems, GetUsage, GetVolume, GrowNamespace, HoldWrites, InflateVolume, ListAnaGroups, ListListeners,
    ListLocalDevices, ListPools, ListSubsystems, ListVolumes, LocalDeviceConfig, LocalDeviceInfo, Method,
    NamespaceConfig, NamespaceUsage, PathAddress, QosLimits, RemoveHost, RemoveLocalDevice, RemoveSubsystem,
    ResizeVolume, SetAnaState, SetControllerIdRange, SetDiscoveryAddress, SetHostPaths, SetNamespaceQos,
    StartMigration, StartRebuild, SubsystemConfig, SubsystemInfo, SwapNamespace, SwitchMigration, UpgradeEngine,
    UsageReport, VolumeIdentity, VolumeInfo,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

pub struct AgentArgs {
    pub name: String,
    pub controllers: String,
    pub listen: SocketAddr,
    /// Where the controller reaches this agent; defaults to `listen`.
    pub advertise: Option<String>,
    pub engine_socket: PathBuf,
    /// Where hosts reach the engine; defaults to the engine's first listener.
    pub nvme_address: Option<String>,
    /// Where other engines reach the engine; defaults to `nvme_address`.
    pub peer_address: Option<String>,
    /// The host NQN of this node's own NVMe host; empty: unknown.
    pub local_host_nqn: String,
    pub labels: BTreeMap<String, String>,
    /// Mutual TLS with this node's certificate (`node:NAME`), when on.
    pub tls: Option<crate::tls::Tls>,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
}

#[derive(Default)]
struct Applied {
    state: Option<proto::NodeState>,
    /// Generation of the last state applied without errors.
    generation: u64,
    /// Whether the last application of `state` went without errors.
    ok: bool,
    /// The engine process it was applied to (0: unknown).
    engine_pid: u32,
    /// When it was last applied.
    at: Option<std::time::Instant>,
}

/// How often the last state is applied again although nothing says the engine lost
/// any of it: a check that nobody changed the engine's exports by hand. Otherwise a
/// heartbeat applies it again only when the engine is another process (it restarted)
/// or the last application failed, so that a node at rest costs next to nothing
/// however many volumes it holds.
const RECHECK_EVERY: Duration = Duration::from_secs(30);

struct Service {
    engine: PathBuf,
    applied: tokio::sync::Mutex<Applied>,
    /// Under mutual TLS, only the controller may give orders.
    tls: bool,
    metrics: AgentMetrics,
    /// A hot upgrade of the engine is under way: a moment without an answer from it
    /// is the handover, not a lost engine (which would make the controller take its
    /// replicas out of their volumes, or fail their volumes over).
    upgrading: std::sync::atomic::AtomicBool,
}

impl Service {
    fn check_controller<T>(&self, r: &Request<T>) -> Result<(), Status> {
        if self.tls { crate::tls::require_identity(r, crate::tls::CONTROLLER) } else { Ok(()) }
    }
}

impl Service {
    /// Applies `state` to the engine and remembers it whole: a whole state, or changes
    /// to the one it holds (on the same engine process after an application without
    /// errors, only the changed entries are applied; otherwise the whole state they
    /// make). `None`: changes to a state it does not hold, so nothing was applied.
    async fn apply(&self, state: proto::NodeState) -> Option<Vec<proto::VolumeResult>> {
        let mut applied = self.applied.lock().await;
        let (whole, changes) = match state.changes_since {
            0 => (state, None),
            since => {
                let held = applied.state.as_ref().filter(|held| held.generation == since)?;
                let (whole, changes) = with_changes(held, state);
                (whole, Some(changes).filter(|_| applied.ok))
            }
        };
        let engine = self.engine.clone();
        let to_apply = whole.clone();
        let applied_pid = applied.engine_pid;
        let started = std::time::Instant::now();
        let (engine_pid, results) = tokio::task::spawn_blocking(move || {
            let pid = call(&engine, GetEngineInfo {}).map_or(0, |i| i.pid);
            // Another engine process holds none of what was applied: all of it again.
            let changes = changes.filter(|_| pid != 0 && pid == applied_pid);
            (pid, reconcile(&engine, &to_apply, changes.as_ref()))
        })
        .await
        .unwrap_or_else(|e| {
            (0, vec![proto::VolumeResult { error: format!("agent failed: {e}"), ..Default::default() }])
        });
        self.metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
        let ok = results.iter().all(|r| r.error.is_empty());
        self.metrics.applies.get_or_create(&ResultLabels { result: if ok { "ok" } else { "failed" } }).inc();
        if ok {
            applied.generation = whole.generation;
            self.metrics.applied_generation.set(whole.generation as i64);
        }
        applied.state = Some(whole);
        applied.ok = ok;
        applied.engine_pid = engine_pid;
        applied.at = Some(started);
        Some(results)
    }
}

/// The whole state that `changes` (a state given as changes) make of `held`, and what
/// they change in it.
fn with_changes(held: &proto::NodeState, changes: proto::NodeState) -> (proto::NodeState, Changes) {
    let replaced: HashSet<&str> =
        changes.volumes.iter().map(|d| d.id.as_str()).chain(changes.dropped.iter().map(String::as_str)).collect();
    let dropped_ids: HashSet<&str> = changes.dropped.iter().map(String::as_str).collect();
    let dropped: Vec<proto::DesiredVolume> =
        held.volumes.iter().filter(|d| dropped_ids.contains(d.id.as_str())).cloned().collect();
    let mut volumes: Vec<proto::DesiredVolume> =
        held.volumes.iter().filter(|d| !replaced.contains(d.id.as_str())).cloned().collect();
    volumes.extend(changes.volumes.iter().cloned());
    let whole = proto::NodeState { node: changes.node, generation: changes.generation, volumes, ..Default::default() };
    (whole, Changes { listed: changes.volumes, dropped })
}

#[tonic::async_trait]
impl proto::agent_server::Agent for Service {
    async fn apply(&self, r: Request<proto::NodeState>) -> Result<Response<proto::ApplyResponse>, Status> {
        self.check_controller(&r)?;
        Ok(Response::new(match Service::apply(self, r.into_inner()).await {
            Some(results) => proto::ApplyResponse { results, whole_state_wanted: false },
            None => proto::ApplyResponse { results: Vec::new(), whole_state_wanted: true },
        }))
    }

    async fn migration(&self, r: Request<proto::MigrationRequest>) -> Result<Response<proto::MigrationReply>, Status> {
        self.check_controller(&r)?;
        let engine = self.engine.clone();
        let reply = tokio::task::spawn_blocking(move || migration(&engine, r.into_inner()))
            .await
            .map_err(|e| Status::internal(format!("agent failed: {e}")))?
            .map_err(Status::unavailable)?;
        Ok(Response::new(reply))
    }

    async fn take_snapshot(
        &self,
        r: Request<proto::TakeSnapshotRequest>,
    ) -> Result<Response<proto::TakeSnapshotReply>, Status> {
        self.check_controller(&r)?;
        let engine = self.engine.clone();
        let reply = tokio::task::spawn_blocking(move || take_snapshot(&engine, r.into_inner()))
            .await
            .map_err(|e| Status::internal(format!("agent failed: {e}")))??;
        Ok(Response::new(reply))
    }

    async fn hold_writes(
        &self,
        r: Request<proto::HoldWritesRequest>,
    ) -> Result<Response<proto::HoldWritesReply>, Status> {
        self.check_controller(&r)?;
        let engine = self.engine.clone();
        let r = r.into_inner();
        let hold = HoldWrites { pool: r.pool, volume: r.volume, hold_ms: r.hold_ms };
        tokio::task::spawn_blocking(move || nvpool_api::call(&engine, &hold))
            .await
            .map_err(|e| Status::internal(format!("agent failed: {e}")))?
            .map_err(engine_status)?;
        Ok(Response::new(proto::HoldWritesReply {}))
    }

    async fn inflate_volume(&self, r: Request<proto::InflateRequest>) -> Result<Response<proto::InflateReply>, Status> {
        self.check_controller(&r)?;
        let engine = self.engine.clone();
        let reply = tokio::task::spawn_blocking(move || inflate(&engine, r.into_inner()))
            .await
            .map_err(|e| Status::internal(format!("agent failed: {e}")))??;
        Ok(Response::new(reply))
    }

    async fn upgrade_engine(
        &self,
        r: Request<proto::UpgradeEngineRequest>,
    ) -> Result<Response<proto::UpgradeReply>, Status> {
        self.check_controller(&r)?;
        let engine = self.engine.clone();
        let binary = Some(r.into_inner().binary).filter(|b| !b.is_empty()).map(PathBuf::from);
        self.upgrading.store(true, std::sync::atomic::Ordering::SeqCst);
        let report = tokio::task::spawn_blocking(move || nvpool_api::call(&engine, &UpgradeEngine { binary })).await;
        self.upgrading.store(false, std::sync::atomic::Ordering::SeqCst);
        let report = report.map_err(|e| Status::internal(format!("agent failed: {e}")))?.map_err(|e| match e.kind {
            ErrorKind::FailedPrecondition => Status::failed_precondition(e.message),
            ErrorKind::InvalidArgument => Status::invalid_argument(e.message),
            _ => Status::unavailable(e.message),
        })?;
        Ok(Response::new(proto::UpgradeReply {
            node: String::new(),
            old_pid: report.old_pid,
            old_version: report.old_version,
            new_pid: report.new_pid,
            new_version: report.new_version,
            connections: report.connections as u64,
            controllers: report.controllers as u64,
            pause_us: report.pause_us,
        }))
    }
}

/// Has the engine take a snapshot; one of that name there already was taken by an
/// earlier call whose answer was lost.
fn take_snapshot(engine: &Path, r: proto::TakeSnapshotRequest) -> Result<proto::TakeSnapshotReply, Status> {
    let identity = (!r.uuid.is_empty()).then(|| VolumeIdentity { uuid: r.uuid.clone(), nguid: r.nguid.clone() });
    let take = CreateSnapshot { pool: r.pool.clone(), volume: r.volume, name: r.snapshot.clone(), identity };
    match nvpool_api::call(engine, &take) {
        Ok(taken) => Ok(proto::TakeSnapshotReply {
            pause_us: taken.pause_us,
            allocated_bytes: taken.snapshot.allocated_bytes,
            existed: false,
        }),
        Err(e) if e.kind == ErrorKind::AlreadyExists => {
            match nvpool_api::call(engine, &GetVolume { pool: r.pool, name: r.snapshot.clone() }) {
                Ok(v) if v.snapshot => {
                    Ok(proto::TakeSnapshotReply { pause_us: 0, allocated_bytes: v.allocated_bytes, existed: true })
                }
                _ => Err(Status::already_exists(format!("the engine has a volume {} that is no snapshot", r.snapshot))),
            }
        }
        Err(e) => Err(engine_status(e)),
    }
}

/// The engine's refusal as the controller's status: what it names stays what it is,
/// anything else is worth a retry.
fn engine_status(e: nvpool_api::ApiError) -> Status {
    match e.kind {
        ErrorKind::NotFound => Status::not_found(e.message),
        ErrorKind::InvalidArgument => Status::invalid_argument(e.message),
        ErrorKind::FailedPrecondition => Status::failed_precondition(e.message),
        _ => Status::unavailable(e.message),
    }
}

/// Has the engine start inflating a volume (or go on), and says how far it is.
fn inflate(engine: &Path, r: proto::InflateRequest) -> Result<proto::InflateReply, Status> {
    let v = nvpool_api::call(engine, &InflateVolume { pool: r.pool, name: r.volume }).map_err(engine_status)?;
    let progress = v.inflating.unwrap_or_default();
    Ok(proto::InflateReply {
        copied_clusters: progress.copied,
        total_clusters: progress.total,
        done: v.parent.is_empty(),
        stopped: progress.stopped.unwrap_or_default(),
    })
}

/// Passes a migration request to the engine.
fn migration(engine: &Path, r: proto::MigrationRequest) -> Result<proto::MigrationReply, String> {
    let (pool, name) = (r.pool, r.engine_name);
    let info = match r.action.as_str() {
        "start" => {
            let rate = (r.rate > 0).then_some(r.rate);
            call(engine, StartMigration { pool, name, id: r.id, target: r.target, rate })?
        }
        "status" => call(engine, GetMigration { pool, name })?,
        "switch" => call(engine, SwitchMigration { pool, name, pause_ms: (r.pause_ms > 0).then_some(r.pause_ms) })?,
        "cancel" => call(engine, CancelMigration { pool, name })?,
        other => return Err(format!("migration action {other:?} is not one of start, status, switch or cancel")),
    };
    let state = serde_json::to_value(info.state).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default();
    Ok(proto::MigrationReply {
        state,
        volume_here: info.volume_here,
        round: info.round,
        copied_bytes: info.copied_bytes,
        dirty_bytes: info.dirty_bytes,
        allocated_bytes: info.allocated_bytes,
        rate: info.rate,
        round_bytes: info.round_bytes,
        pause_us: info.pause_us.unwrap_or(0),
        pauses_given_up: info.pauses_given_up,
        error: info.error.unwrap_or_default(),
        switch_requested: info.switch_requested,
        target: info.target,
        id: info.id,
    })
}

fn call<M: Method>(engine: &Path, request: M) -> Result<M::Reply, String> {
    nvpool_api::call(engine, &request).map_err(String::from)
}

/// The result of one desired volume: its identity, allocation and connected hosts,
/// or why it failed.
fn result(id: &str, outcome: Result<Option<VolumeInfo>, String>, connected: Vec<String>) -> proto::VolumeResult {
    match outcome {
        Ok(info) => proto::VolumeResult {
            id: id.to_string(),
            error: String::new(),
            uuid: info.as_ref().map(|i| i.uuid.clone()).unwrap_or_default(),
            nguid: info.as_ref().map(|i| i.nguid.clone()).unwrap_or_default(),
            allocated_bytes: info.as_ref().map_or(0, |i| i.allocated_bytes),
            connected_hosts: connected,
            ..Default::default()
        },
        Err(error) => proto::VolumeResult { id: id.to_string(), error, ..Default::default() },
    }
}

/// Makes the engine match `state`; one result per volume. The engine is asked for its
/// volumes, exports and local devices once; a volume whose export is as wanted costs
/// no further question, so applying an unchanged state to a node of many volumes is
/// three listings.
/// The entries of a whole state that changed since the state applied before, and the
/// entries of that one the new state no longer has: all that a state given as changes
/// asks of the engine.
struct Changes {
    listed: Vec<proto::DesiredVolume>,
    dropped: Vec<proto::DesiredVolume>,
}

/// Brings the engine to the whole `state`: every entry, or with `changes` only the
/// entries listed and dropped, asking the engine about those alone (a node's thousandth
/// volume costs what its first did). Returns a result per entry applied.
fn reconcile(engine: &Path, state: &proto::NodeState, changes: Option<&Changes>) -> Vec<proto::VolumeResult> {
    let entries = changes.map_or(&state.volumes, |c| &c.listed);
    let found = match changes {
        None => call(engine, ListVolumes { pool: None })
            .and_then(|volumes| Ok((volumes, call(engine, ListSubsystems {})?, call(engine, ListLocalDevices {})?))),
        Some(c) => {
            // With each entry, its replica's export: one may be there that is no
            // longer wanted (the node serves the volume now).
            let nqns =
                c.listed.iter().chain(&c.dropped).flat_map(|d| [d.subsystem_nqn.clone(), replica_nqn(d)]).collect();
            volumes_of(engine, &c.listed).and_then(|volumes| {
                Ok((volumes, call(engine, GetSubsystems { nqns })?, call(engine, ListLocalDevices {})?))
            })
        }
    };
    let (volumes, subsystems, devices) = match found {
        Ok(found) => found,
        Err(e) => return entries.iter().map(|d| result(&d.id, Err(e.clone()), vec![])).collect(),
    };
    let volumes: HashMap<(&str, &str), &VolumeInfo> =
        volumes.iter().map(|v| ((v.pool.as_str(), v.name.as_str()), v)).collect();
    let subsystems: HashMap<&str, &SubsystemInfo> = subsystems.iter().map(|s| (s.nqn.as_str(), s)).collect();
    // Local devices first go where unwanted: an export cannot be removed from under one.
    let wanted_devices: HashSet<(String, bool)> = state
        .volumes
        .iter()
        .filter(|d| d.present && d.owner_address.is_empty())
        .filter_map(|d| d.local.as_ref().map(|l| (local_target(d), l.read_only)))
        .collect();
    let mut gone_wrong = Vec::new();
    for dev in &devices {
        let wanted = wanted_devices.contains(&(dev.target.clone(), dev.read_only));
        // The controller makes ublk devices; a vhost-user-blk socket was made by hand.
        let ours = dev.target.starts_with(VOLUME_NQN_PREFIX) && dev.ublk_id.is_some();
        if ours
            && !wanted
            && let Err(e) = call(engine, RemoveLocalDevice { ublk_id: dev.ublk_id, socket: None })
        {
            gone_wrong.push((dev.target.clone(), format!("cannot remove {}: {e}", dev.device)));
        }
    }
    // A subsystem that a present entry serves stays when a removal names it too: a
    // move rolled back leaves its target an access point of the volume, whose copy
    // (the removal) goes once the export forwards to the owner again.
    let served: HashSet<&str> = state
        .volumes
        .iter()
        .filter(|d| d.present)
        .flat_map(|d| {
            std::iter::once(d.subsystem_nqn.as_str()).chain(d.replica.as_ref().map(|r| r.subsystem_nqn.as_str()))
        })
        .collect();
    let mut results: Vec<proto::VolumeResult> = entries
        .iter()
        .map(|d| {
            let subsystem = subsystems.get(d.subsystem_nqn.as_str()).copied();
            let volume = volumes.get(&(d.pool.as_str(), d.engine_name.as_str())).copied();
            let outcome = if let Some(wanted) = d.replica.as_ref().filter(|_| d.present) {
                let replica_export = subsystems.get(wanted.subsystem_nqn.as_str()).copied();
                replica(engine, d, wanted, volume, replica_export, subsystem).map(Some)
            } else if !d.owner_address.is_empty() {
                forward(engine, d, subsystem).map(|()| None)
            } else if d.present {
                ensure(engine, d, volume, subsystem).map(Some)
            } else {
                let export_goes = subsystem.is_some() && !served.contains(d.subsystem_nqn.as_str());
                remove(engine, d, volume.is_some(), export_goes).map(|()| None)
            };
            // The volume's data should be here and is not: reported, never made anew.
            let copy_lost = volume.is_none()
                && match d.replica.as_ref().filter(|_| d.present) {
                    Some(wanted) => !wanted.make,
                    None => d.present && d.owner_address.is_empty() && d.keep_only,
                };
            let connected = subsystem.map(|s| s.connected_hosts.clone()).unwrap_or_default();
            let exported = outcome.is_ok();
            let mut r = result(&d.id, outcome, connected);
            r.copy_lost = copy_lost;
            if exported && d.present && d.owner_address.is_empty() {
                match local_device(engine, d, &devices) {
                    Ok(Some(dev)) => (r.local_device, r.ublk_id) = (dev.device, dev.ublk_id.unwrap_or_default()),
                    Ok(None) => {}
                    Err(e) => r.local_error = e,
                }
            }
            if let Some((_, e)) = gone_wrong.iter().find(|(t, _)| *t == local_target(d)) {
                r.local_error = e.clone();
            }
            r
        })
        .collect();
    // A volume's export that the state no longer names is one this node stopped
    // being an access point for (or a volume deleted while the node was away). Given
    // changes, only the exports of dropped entries are candidates.
    let named: HashSet<&str> = state
        .volumes
        .iter()
        .flat_map(|d| {
            std::iter::once(d.subsystem_nqn.as_str()).chain(d.replica.as_ref().map(|r| r.subsystem_nqn.as_str()))
        })
        .collect();
    for nqn in subsystems.keys().filter(|n| n.starts_with(VOLUME_NQN_PREFIX) && !named.contains(*n)) {
        if let Err(e) = call(engine, RemoveSubsystem { nqn: nqn.to_string() }) {
            results.push(result(nqn, Err(format!("cannot remove the export {nqn}: {e}")), vec![]));
        }
    }
    results
}

/// The engine's volumes that these entries own (a volume not there is left out).
fn volumes_of(engine: &Path, entries: &[proto::DesiredVolume]) -> Result<Vec<VolumeInfo>, String> {
    let mut found = Vec::new();
    for d in entries.iter().filter(|d| d.owner_address.is_empty() || d.replica.is_some()) {
        match nvpool_api::call(engine, &GetVolume { pool: d.pool.clone(), name: d.engine_name.clone() }) {
            Ok(v) => found.push(v),
            Err(e) if e.kind == ErrorKind::NotFound => {}
            Err(e) => return Err(e.message),
        }
    }
    Ok(found)
}

/// What a volume's local device serves: its export's namespace.
fn local_target(d: &proto::DesiredVolume) -> String {
    format!("{}/1", d.subsystem_nqn)
}

/// Makes the local device the controller wants for a volume this node owns, or finds
/// the one there is; `None` when none is wanted.
fn local_device(
    engine: &Path,
    d: &proto::DesiredVolume,
    devices: &[LocalDeviceInfo],
) -> Result<Option<LocalDeviceInfo>, String> {
    let Some(wanted) = &d.local else { return Ok(None) };
    let target = local_target(d);
    if let Some(dev) =
        devices.iter().find(|dev| dev.target == target && dev.read_only == wanted.read_only && dev.ublk_id.is_some())
    {
        return Ok(Some(dev.clone()));
    }
    let device = LocalDeviceConfig {
        target,
        ublk_id: u32::try_from(wanted.ublk_id).ok(),
        read_only: wanted.read_only,
        queue_depth: None,
        vhost_user_blk: None,
    };
    call(engine, AddLocalDevice { device }).map(|added| Some(added.device))
}

/// Serves a volume whose data is on another node: a `remote:` namespace that
/// forwards to the owner under the same subsystem NQN and namespace identity.
fn forward(engine: &Path, d: &proto::DesiredVolume, subsystem: Option<&SubsystemInfo>) -> Result<(), String> {
    let namespace = NamespaceConfig {
        nsid: Some(1),
        backend: format!("remote:{}/{}/1", d.owner_address, d.subsystem_nqn),
        block_size: 0,
        uuid: None,
        allow_torn_writes: false,
        ana_group: None,
        qos: limits(d),
    };
    export(engine, d, namespace, subsystem)?;
    // The volume grew on its owner: this path serves the new size once it has.
    let served = subsystem.and_then(|s| s.namespaces.iter().find(|n| n.nsid == 1)).map(|n| n.size);
    if served.is_some_and(|s| s < d.size_bytes) {
        call(engine, GrowNamespace { nqn: d.subsystem_nqn.clone(), nsid: 1 })?;
    }
    Ok(())
}

/// The I/O limits the controller wants every engine serving the volume to enforce.
fn limits(d: &proto::DesiredVolume) -> QosLimits {
    d.qos.unwrap_or_default().into()
}

/// Makes the engine export `namespace` under the volume's subsystem to exactly the
/// desired hosts, each with the ANA state the controller chose for it. Each host's
/// state is set before the host is allowed, and around a change of backend so that
/// no host ever uses a backend it should not: a path that closes (inaccessible)
/// closes before the namespace changes backend, one that opens opens only once the
/// new backend serves. A migration's target is inaccessible to hosts until it holds
/// their data; when the move is rolled back it forwards to the owner again, and a
/// host that could write to it before that would lose the write with it.
fn export(
    engine: &Path,
    d: &proto::DesiredVolume,
    namespace: NamespaceConfig,
    subsystem: Option<&SubsystemInfo>,
) -> Result<(), String> {
    let nqn = d.subsystem_nqn.clone();
    let (allowed, backend, qos) = match subsystem {
        None => {
            let config = SubsystemConfig {
                nqn: nqn.clone(),
                serial: None,
                model: "nvpool".into(),
                allow_any_host: false,
                hosts: vec![],
                dhchap: vec![],
                tls_psk: vec![],
                namespaces: vec![namespace.clone()],
            };
            call(engine, AddSubsystem(config))?;
            (vec![], Some(namespace.backend.clone()), namespace.qos)
        }
        Some(s) => {
            let existing = s.namespaces.iter().find(|n| n.nsid == 1);
            if existing.is_none() {
                call(engine, AddNamespace { nqn: nqn.clone(), namespace: namespace.clone() })?;
            }
            let backend = existing.map(|n| n.backend.clone()).or(Some(namespace.backend.clone()));
            (s.hosts.clone(), backend, existing.map_or(namespace.qos, |n| n.qos))
        }
    };
    if qos != namespace.qos {
        call(engine, SetNamespaceQos { nqn: nqn.clone(), nsid: 1, limits: namespace.qos })?;
    }
    // The namespace is alone in ANA group 1 (its NSID). The listing's groups hold
    // unless the subsystem or its namespace was made just now.
    let asked;
    let groups = match subsystem.filter(|s| s.namespaces.iter().any(|n| n.nsid == 1)) {
        Some(s) => &s.ana_groups,
        None => {
            asked = call(engine, ListAnaGroups { nqn: nqn.clone() })?;
            &asked
        }
    };
    let group = groups.iter().find(|g| g.nsids.contains(&1));
    let mut changes = Vec::new();
    for a in &d.ana {
        let state: AnaState = a.state.parse()?;
        let now = group.map(|g| g.hosts.iter().find(|h| h.host == a.host_nqn).map_or(g.state, |h| h.state));
        if now != Some(state) {
            changes.push((a.host_nqn.clone(), state));
        }
    }
    let set_states = |changes: Vec<HostState>| {
        let group = group.map_or(1, |g| g.group);
        for (host, state) in changes {
            call(engine, SetAnaState { nqn: nqn.clone(), group, host: Some(host), state })?;
        }
        Ok::<(), String>(())
    };
    let (closing, opening) = around_swap(changes);
    set_states(closing)?;
    if backend.as_deref() != Some(namespace.backend.as_str()) {
        call(engine, SwapNamespace { nqn: nqn.clone(), nsid: 1, backend: namespace.backend.clone() })?;
    }
    set_states(opening)?;
    // Each host's access points, for its discovery log, before the host may see it.
    let paths_now = |h: &str| subsystem.and_then(|s| s.host_paths.iter().find(|p| p.host == h)).map(|p| &p.paths);
    for a in &d.access_points {
        let paths = a.addresses.iter().map(|p| p.parse()).collect::<Result<Vec<PathAddress>, String>>()?;
        if paths_now(&a.host_nqn).map_or(!paths.is_empty(), |now| *now != paths) {
            call(engine, SetHostPaths { nqn: nqn.clone(), host: a.host_nqn.clone(), paths })?;
        }
    }
    let given = |h: &str| d.access_points.iter().any(|a| a.host_nqn == h);
    for h in subsystem.iter().flat_map(|s| &s.host_paths).filter(|p| !given(&p.host)) {
        call(engine, SetHostPaths { nqn: nqn.clone(), host: h.host.clone(), paths: Vec::new() })?;
    }
    // Each host with the secrets the controller gave it, or none: a host is added again
    // when its secrets differ from those in place (by fingerprint).
    let installed = |h: &str| {
        subsystem.and_then(|s| s.authenticated_hosts.iter().find(|a| a.host == h)).map(|a| a.fingerprint.clone())
    };
    for h in &d.hosts {
        let wanted = d.dhchap.iter().find(|k| &k.host_nqn == h).and_then(|k| k.secrets.as_ref());
        let (keys, fingerprint) = match wanted {
            Some(s) => {
                let (keys, fingerprint) = dhchap_keys(s).map_err(|e| format!("the secrets of {h}: {e}"))?;
                (Some(keys), Some(fingerprint))
            }
            None => (None, None),
        };
        let have = installed(h);
        if allowed.contains(h) && have == fingerprint {
            continue;
        }
        if have.is_some() && fingerprint.is_none() {
            // Secrets are only ever replaced: dropping them takes the host off first.
            call(engine, RemoveHost { nqn: nqn.clone(), host: h.clone() })?;
        }
        call(engine, AddHost { nqn: nqn.clone(), host: h.clone(), dhchap: keys, tls_psk: None })?;
    }
    for h in allowed.iter().filter(|h| !d.hosts.contains(h)) {
        call(engine, RemoveHost { nqn: nqn.clone(), host: h.clone() })?;
    }
    Ok(())
}

/// A host and the ANA state it is to have.
type HostState = (String, AnaState);

/// A host's ANA changes split around a change of backend: those that close the path
/// (the host can no longer read or write through it) go first, those that open it
/// after the new backend serves.
fn around_swap(changes: Vec<HostState>) -> (Vec<HostState>, Vec<HostState>) {
    changes.into_iter().partition(|(_, s)| !matches!(s, AnaState::Optimized | AnaState::NonOptimized))
}

/// The engine's form of a host's secrets, with their fingerprint.
fn dhchap_keys(s: &proto::DhchapSecrets) -> Result<(DhchapKeys, String), String> {
    let host = nvpool_auth::Secret::parse(&s.secret).map_err(|e| e.to_string())?;
    let ctrl = match s.ctrl_secret.as_str() {
        "" => None,
        c => Some(nvpool_auth::Secret::parse(c).map_err(|e| e.to_string())?),
    };
    let fingerprint = nvpool_auth::secret::fingerprint(&host, ctrl.as_ref());
    let keys = DhchapKeys {
        secret: s.secret.clone(),
        ctrl_secret: (!s.ctrl_secret.is_empty()).then(|| s.ctrl_secret.clone()),
        hash: None,
        dh_group: None,
    };
    Ok((keys, fingerprint))
}

/// Creates, grows and exports one volume as needed; returns its engine info.
fn ensure(
    engine: &Path,
    d: &proto::DesiredVolume,
    volume: Option<&VolumeInfo>,
    subsystem: Option<&SubsystemInfo>,
) -> Result<VolumeInfo, String> {
    let (pool, name) = (d.pool.clone(), d.engine_name.clone());
    let mut info = match volume {
        None if d.keep_only => {
            return Err(format!(
                "volume {pool}/{name} is not on this engine and is not made anew, empty (its pool was made anew, \
                 or a migration moved it); the controller decides where it is"
            ));
        }
        None => {
            let identity =
                (!d.uuid.is_empty()).then(|| VolumeIdentity { uuid: d.uuid.clone(), nguid: d.nguid.clone() });
            if d.clone_from.is_empty() {
                let create =
                    CreateVolume { pool: pool.clone(), name: name.clone(), size: d.size_bytes, thin: d.thin, identity };
                call(engine, create)?
            } else {
                let clone =
                    CloneVolume { pool: pool.clone(), snapshot: d.clone_from.clone(), name: name.clone(), identity };
                call(engine, clone).map_err(|e| format!("cannot clone snapshot {}: {e}", d.clone_from))?
            }
        }
        Some(v) => v.clone(),
    };
    // A volume clone's own snapshot of its source goes (hidden under the clone) once
    // the clone stands on it.
    if d.hide_source {
        match nvpool_api::call(engine, &DeleteVolume { pool: pool.clone(), name: d.clone_from.clone() }) {
            Ok(_) => {}
            Err(e) if e.kind == ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot hide snapshot {} under its clone: {e}", d.clone_from)),
        }
    }
    // A mirror grows once its replicas have: asked again while it serves less.
    let served = subsystem.and_then(|s| s.namespaces.iter().find(|n| n.nsid == 1)).map(|n| n.size);
    if info.size < d.size_bytes || served.is_some_and(|s| s < d.size_bytes) {
        info = call(engine, ResizeVolume { pool: pool.clone(), name: name.clone(), size: d.size_bytes })?;
    }
    // A replicated volume is served as a mirror of this node's replica and the
    // others; while one catches up, the rebuild's mirror stands (it has that leg too).
    let current = subsystem.and_then(|s| s.namespaces.iter().find(|n| n.nsid == 1)).map(|n| n.backend.as_str());
    let (backend, rebuilding) = match &d.mirror {
        None => (format!("volume:{pool}/{name}"), None),
        Some(m) => {
            let mut spec = format!("mirror:generation={} volume:{pool}/{name}", m.generation);
            for leg in &m.legs {
                spec = format!("{spec} {leg}");
            }
            match m.rebuild_leg.as_str() {
                "" => (spec, None),
                leg => {
                    let with_leg = format!("{spec} +{leg}");
                    let running = current == Some(with_leg.as_str()) && rebuild_alive(engine, d, leg)?;
                    (if running { with_leg } else { spec }, Some((m, running)))
                }
            }
        }
    };
    // 4 KiB blocks where the pool's disks write them whole across a power loss.
    let namespace = NamespaceConfig {
        nsid: Some(1),
        backend,
        block_size: 0,
        uuid: None,
        allow_torn_writes: false,
        ana_group: None,
        qos: limits(d),
    };
    export(engine, d, namespace, subsystem)?;
    if let Some((m, false)) = rebuilding {
        call(
            engine,
            StartRebuild {
                nqn: d.subsystem_nqn.clone(),
                nsid: 1,
                leg: m.rebuild_leg.clone(),
                since: (m.rebuild_since > 0).then_some(m.rebuild_since),
                rate: (m.rebuild_rate > 0).then_some(m.rebuild_rate),
            },
        )
        .map_err(|e| format!("cannot start rebuilding the replica {}: {e}", m.rebuild_leg))?;
    }
    Ok(info)
}

/// Whether the engine's rebuild of `leg` is copying or done (not failed, not another
/// leg's, not gone with an engine restart).
fn rebuild_alive(engine: &Path, d: &proto::DesiredVolume, leg: &str) -> Result<bool, String> {
    let info = call(engine, GetRebuild { nqn: d.subsystem_nqn.clone(), nsid: 1 })?;
    Ok(info.leg == leg && matches!(info.state.as_str(), "copying" | "done"))
}

/// The name of a volume's replica export.
fn replica_nqn(d: &proto::DesiredVolume) -> String {
    format!("{}{REPLICA_NQN_SUFFIX}", d.subsystem_nqn)
}

/// Holds a replica of a volume another node serves: the volume (made with the
/// volume's identity if it is not here), exported as `replica:` to the serving engine
/// alone, whose reservation then fences any older one; and the access point's
/// export when the node is one, else none.
fn replica(
    engine: &Path,
    d: &proto::DesiredVolume,
    wanted: &proto::ReplicaWanted,
    volume: Option<&VolumeInfo>,
    replica_export: Option<&SubsystemInfo>,
    host_facing: Option<&SubsystemInfo>,
) -> Result<VolumeInfo, String> {
    let info = match volume {
        Some(v) if v.size < d.size_bytes => {
            call(engine, ResizeVolume { pool: d.pool.clone(), name: d.engine_name.clone(), size: d.size_bytes })?
        }
        Some(v) => v.clone(),
        None if !wanted.make => {
            return Err(format!(
                "replica volume {}/{} is not on this engine though it held the volume's data (its pool was made \
                 anew?); it is not made anew empty: the controller has it rebuilt in full",
                d.pool, d.engine_name
            ));
        }
        None => {
            let identity =
                (!d.uuid.is_empty()).then(|| VolumeIdentity { uuid: d.uuid.clone(), nguid: d.nguid.clone() });
            let create = CreateVolume {
                pool: d.pool.clone(),
                name: d.engine_name.clone(),
                size: d.size_bytes,
                thin: d.thin,
                identity,
            };
            call(engine, create)?
        }
    };
    let export_entry = proto::DesiredVolume {
        subsystem_nqn: wanted.subsystem_nqn.clone(),
        hosts: Some(wanted.serving_host_nqn.clone()).filter(|h| !h.is_empty()).into_iter().collect(),
        ana: Vec::new(),
        access_points: Vec::new(),
        dhchap: Vec::new(),
        ..d.clone()
    };
    let namespace = NamespaceConfig {
        nsid: Some(1),
        backend: format!("replica:{}/{}", d.pool, d.engine_name),
        block_size: 0,
        uuid: None,
        allow_torn_writes: false,
        ana_group: None,
        qos: QosLimits::default(),
    };
    export(engine, &export_entry, namespace, replica_export)?;
    if !d.owner_address.is_empty() {
        forward(engine, d, host_facing)?;
    } else if host_facing.is_some() {
        call(engine, RemoveSubsystem { nqn: d.subsystem_nqn.clone() })?;
    }
    Ok(info)
}

fn remove(engine: &Path, d: &proto::DesiredVolume, has_volume: bool, has_subsystem: bool) -> Result<(), String> {
    if has_subsystem {
        call(engine, RemoveSubsystem { nqn: d.subsystem_nqn.clone() })?;
    }
    if has_volume {
        // Gone already: a hidden snapshot goes with the last volume over it.
        match nvpool_api::call(engine, &DeleteVolume { pool: d.pool.clone(), name: d.engine_name.clone() }) {
            Ok(_) => {}
            Err(e) if e.kind == ErrorKind::NotFound => {}
            Err(e) => return Err(e.message),
        }
    }
    Ok(())
}

/// What the engine reports: its version, the node's pools, its volumes' allocations
/// and their namespaces' counters, all of them or (`changes_only`) what changed since
/// the engine's answer marked `since`; an error when the engine cannot be asked, so
/// that nothing reports an empty node.
struct Usage {
    version: String,
    pools: Vec<proto::PoolReport>,
    volumes: Vec<proto::VolumeUsage>,
    volumes_gone: Vec<String>,
    counters: Vec<proto::VolumeCounters>,
    counters_gone: Vec<String>,
    mirrors: Vec<proto::MirrorReport>,
    replicas_unconnected: Vec<String>,
    changes_only: bool,
    /// Passed as `since` next time.
    mark: u64,
}

fn usage(engine: &Path, version: String, since: Option<u64>) -> Result<Usage, String> {
    let report = match call(engine, GetUsage { since }) {
        Ok(report) => report,
        // An engine of an earlier version (a package upgraded under a running engine,
        // before its hot upgrade) has no `usage`: everything, from its lists.
        Err(e) if e.contains("unknown method") => listed_usage(engine)?,
        Err(e) => return Err(e),
    };
    let pools = report
        .pools
        .into_iter()
        .map(|p| proto::PoolReport {
            name: p.name,
            capacity_bytes: p.capacity_bytes,
            used_bytes: p.used_bytes,
            provisioned_bytes: p.provisioned_bytes,
            cluster_size: p.cluster_size,
            volumes: p.volumes as u32,
            failed: p.failed.unwrap_or_default(),
            power_losses: p.power_losses,
            snapshot_bytes: p.snapshot_bytes,
        })
        .collect();
    let volumes = report
        .volumes
        .into_iter()
        .map(|v| proto::VolumeUsage { engine_name: v.name, allocated_bytes: v.allocated_bytes })
        .collect();
    // A volume's counters are those of namespace 1 of its export.
    let of_volume = |n: &NamespaceUsage| n.nsid == 1 && n.nqn.starts_with(VOLUME_NQN_PREFIX);
    let counters = report
        .namespaces
        .into_iter()
        .filter(of_volume)
        .map(|n| proto::VolumeCounters {
            subsystem_nqn: n.nqn,
            reads: n.stats.reads,
            writes: n.stats.writes,
            read_bytes: n.stats.read_bytes,
            write_bytes: n.stats.write_bytes,
            completed: n.stats.completed,
            latency_ns: n.stats.latency_ns,
        })
        .collect();
    Ok(Usage {
        version,
        pools,
        volumes,
        volumes_gone: report.volumes_gone.into_iter().map(|v| v.name).collect(),
        counters,
        counters_gone: report.namespaces_gone.into_iter().filter(of_volume).map(|n| n.nqn).collect(),
        mirrors: report.mirrors.into_iter().filter(|m| m.nsid == 1).map(mirror_report).collect(),
        replicas_unconnected: report.replicas_unconnected,
        changes_only: !report.complete,
        mark: report.mark,
    })
}

/// A mirror as the engine reports it, for the controller.
fn mirror_report(m: nvpool_api::MirrorUsage) -> proto::MirrorReport {
    proto::MirrorReport {
        subsystem_nqn: m.nqn,
        generation: m.generation,
        faulted_legs: m.faulted_legs.into_iter().map(|f| proto::FaultedLeg { leg: f.leg, error: f.error }).collect(),
        rebuild: m.rebuild.map(|r| proto::RebuildReport {
            leg: r.leg,
            state: r.state,
            error: r.error,
            total_bytes: r.total_bytes,
            copied_bytes: r.copied_bytes,
        }),
    }
}

/// Everything an engine without `usage` reports, from its pool, volume and subsystem
/// lists, as one complete report.
fn listed_usage(engine: &Path) -> Result<UsageReport, String> {
    let volumes = call(engine, ListVolumes { pool: None })?
        .into_iter()
        .map(|v| nvpool_api::VolumeUsage { pool: v.pool, name: v.name, allocated_bytes: v.allocated_bytes })
        .collect();
    let namespaces = call(engine, ListSubsystems {})?
        .into_iter()
        .flat_map(|s| {
            let nqn = s.nqn;
            s.namespaces.into_iter().map(move |n| NamespaceUsage { nqn: nqn.clone(), nsid: n.nsid, stats: n.stats })
        })
        .collect();
    Ok(UsageReport {
        mark: 0,
        complete: true,
        pools: call(engine, ListPools {})?,
        volumes,
        volumes_gone: Vec::new(),
        namespaces,
        namespaces_gone: Vec::new(),
        mirrors: Vec::new(),
        replicas_unconnected: Vec::new(),
    })
}

/// The address hosts use: the engine's first listener (`rdma:IP:PORT` for an RDMA
/// one), unless one was given.
fn nvme_address(engine: &Path, given: &Option<String>) -> Result<String, String> {
    if let Some(a) = given {
        return Ok(a.clone());
    }
    let listeners = call(engine, ListListeners {})?;
    let first = listeners.first().ok_or("the engine has no listener: add one, or pass --nvme-address")?;
    if first.addr.is_unspecified() {
        return Err(format!(
            "the engine listens on {}: pass --nvme-address with the address hosts should use",
            first.addr
        ));
    }
    let scheme = if first.transport == nvpool_api::Transport::Rdma { "rdma:" } else { "" };
    Ok(format!("{scheme}{}", SocketAddr::new(first.addr, first.port)))
}

/// Where other engines reach this one: the given address, or for hosts on RDMA the
/// engine's first TCP listener (engines forward over NVMe/TCP); empty: the host
/// address.
fn peer_address(engine: &Path, given: &Option<String>, nvme: &str) -> Result<String, String> {
    if let Some(a) = given {
        return Ok(a.clone());
    }
    if !nvme.starts_with("rdma:") {
        return Ok(String::new());
    }
    let listeners = call(engine, ListListeners {})?;
    listeners
        .iter()
        .find(|l| l.transport == nvpool_api::Transport::Tcp && !l.addr.is_unspecified())
        .map(|l| SocketAddr::new(l.addr, l.port).to_string())
        .ok_or_else(|| {
            format!("hosts reach the engine over RDMA ({nvme}); other engines need NVMe/TCP: add a TCP listener, or pass --peer-address")
        })
}

/// Gives the engine the controller IDs the controller chose for this node, unless it
/// has them (an engine that restarted has its configured range again).
fn keep_cntlid_range(engine: &Path, info: &EngineInfo, (min, max): (u16, u16)) -> Result<(), String> {
    if (info.cntlid_min, info.cntlid_max) != (min, max) {
        call(engine, SetControllerIdRange { min, max })?;
    }
    Ok(())
}

/// Gives the engine the node's host-facing IP address for its discovery log, unless
/// it has it (a restarted engine has none).
fn keep_discovery_address(engine: &Path, info: &EngineInfo, address: IpAddr) -> Result<(), String> {
    if info.discovery_address != Some(address) {
        call(engine, SetDiscoveryAddress { address: Some(address) })?;
    }
    Ok(())
}

/// The IP address of a host-facing address (`IP:PORT` or `rdma:IP:PORT`).
fn host_facing_ip(nvme_address: &str) -> Option<IpAddr> {
    nvme_address.parse::<PathAddress>().ok().map(|p| p.address.ip())
}

/// Runs the agent until the process ends.
pub async fn run(args: AgentArgs) -> Result<(), String> {
    let controllers = Controllers::with_tls(&args.controllers, args.tls.as_ref())?;
    let service = Arc::new(Service {
        engine: args.engine_socket.clone(),
        applied: Default::default(),
        tls: args.tls.is_some(),
        metrics: AgentMetrics::default(),
        upgrading: Default::default(),
    });
    if let Some(addr) = args.metrics_listen {
        let service = service.clone();
        crate::metrics::serve(addr, Arc::new(move || crate::metrics::encode(&service.metrics.registry()))).await?;
        tracing::info!(agent = %args.name, "metrics at http://{addr}/metrics");
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e} (pick another --listen)", args.listen))?;
    let advertise =
        args.advertise.clone().unwrap_or_else(|| listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = &args.tls {
        builder = builder.tls_config(t.server()).map_err(|e| format!("TLS: {e}"))?;
    }
    tokio::spawn(
        builder
            .add_service(AgentServer::from_arc(service.clone()))
            .serve_with_incoming(crate::server::accepted(listener)),
    );
    let engine = args.engine_socket.clone();
    let mut interval = Duration::from_secs(1);
    let mut registered = false;
    // The controller IDs the controller gave this node's engine, and the address
    // hosts reach it at, which its discovery log gives.
    let mut cntlid_range: Option<(u16, u16)> = None;
    let mut discovery_address: Option<IpAddr> = None;
    // Why the engine did not answer the last heartbeat's questions, logged once.
    let mut engine_down: Option<String> = None;
    // Whether the controller merges heartbeats that list only changes, and the mark of
    // the engine's usage answer that the last heartbeat the controller took reported.
    let mut takes_changes = false;
    let mut usage_mark: Option<u64> = None;
    loop {
        if !registered {
            let engine2 = engine.clone();
            let given = args.nvme_address.clone();
            let given_peer = args.peer_address.clone();
            let found = tokio::task::spawn_blocking(move || {
                let nvme = nvme_address(&engine2, &given)?;
                let peer = peer_address(&engine2, &given_peer, &nvme)?;
                let info = call(&engine2, GetEngineInfo {})?;
                usage(&engine2, info.version, None).map(|u| (nvme, peer, info.host_nqn, u))
            })
            .await
            .map_err(|e| e.to_string())?;
            service.metrics.engine_up.set(i64::from(found.is_ok()));
            match found {
                Ok((nvme, peer_address, host_nqn, usage)) => {
                    discovery_address = host_facing_ip(&nvme);
                    let node = proto::Node {
                        name: args.name.clone(),
                        agent_address: advertise.clone(),
                        nvme_address: nvme,
                        labels: args.labels.clone().into_iter().collect(),
                        pools: usage.pools,
                        engine_version: usage.version,
                        host_nqn,
                        peer_address,
                        local_host_nqn: args.local_host_nqn.clone(),
                        ..Default::default()
                    };
                    let req = proto::RegisterNodeRequest { node: Some(node) };
                    match controllers.call(async |mut c| c.register_node(req.clone()).await).await {
                        Ok(r) => {
                            interval = Duration::from_millis(r.heartbeat_interval_ms.max(100));
                            registered = true;
                            takes_changes = r.takes_changes;
                            usage_mark = None;
                            cntlid_range = u16::try_from(r.cntlid_min).ok().zip(u16::try_from(r.cntlid_max).ok());
                            let engine2 = engine.clone();
                            let set = tokio::task::spawn_blocking(move || {
                                let info = call(&engine2, GetEngineInfo {})?;
                                if let Some(range) = cntlid_range {
                                    keep_cntlid_range(&engine2, &info, range)
                                        .map_err(|e| format!("cannot set the engine's controller IDs: {e}"))?;
                                }
                                if let Some(address) = discovery_address {
                                    keep_discovery_address(&engine2, &info, address)
                                        .map_err(|e| format!("cannot set the engine's discovery address: {e}"))?;
                                }
                                Ok::<_, String>(())
                            });
                            if let Ok(Err(e)) = set.await {
                                tracing::warn!(agent = %args.name, "{e}");
                            }
                            tracing::info!(agent = %args.name, "registered with the controller");
                        }
                        Err(e) => tracing::warn!(agent = %args.name, "registering failed: {}", e.message()),
                    }
                }
                // Not registered until the engine answers: a node is never announced
                // with the empty pools of an engine nobody could ask.
                Err(e) => tracing::warn!(agent = %args.name, "engine at {}: {e}", engine.display()),
            }
        } else {
            let engine2 = engine.clone();
            let info = tokio::task::spawn_blocking(move || {
                let info = call(&engine2, GetEngineInfo {})?;
                // Controller IDs first: hosts reconnect as soon as the exports are back.
                if let Some(range) = cntlid_range {
                    let _ = keep_cntlid_range(&engine2, &info, range);
                }
                if let Some(address) = discovery_address {
                    let _ = keep_discovery_address(&engine2, &info, address);
                }
                Ok::<_, String>(info)
            })
            .await
            .map_err(|e| e.to_string())?;
            // Apply the last state again where the engine may not hold it: another
            // process than the one it was applied to (a restart), a failed application,
            // or the periodic check.
            if let Ok(info) = &info {
                let again = {
                    let applied = service.applied.lock().await;
                    applied.state.clone().filter(|_| {
                        !applied.ok
                            || applied.engine_pid != info.pid
                            || applied.at.is_none_or(|at| at.elapsed() >= RECHECK_EVERY)
                    })
                };
                if let Some(state) = again {
                    service.apply(state).await;
                }
            }
            let engine2 = engine.clone();
            let since = usage_mark.filter(|_| takes_changes);
            let usage = tokio::task::spawn_blocking(move || usage(&engine2, info?.version, since))
                .await
                .map_err(|e| e.to_string())?;
            let mark = usage.as_ref().ok().map(|u| u.mark);
            let applied_generation = service.applied.lock().await.generation;
            service.metrics.engine_up.set(i64::from(usage.is_ok()));
            let hb = match usage {
                Ok(u) => {
                    if engine_down.take().is_some() {
                        tracing::info!(agent = %args.name, "engine at {} answers again", engine.display());
                    }
                    proto::HeartbeatRequest {
                        node: args.name.clone(),
                        pools: u.pools,
                        volumes: u.volumes,
                        applied_generation,
                        engine_version: u.version,
                        counters: u.counters,
                        changes_only: u.changes_only,
                        volumes_gone: u.volumes_gone,
                        counters_gone: u.counters_gone,
                        mirrors: u.mirrors,
                        replicas_unconnected: u.replicas_unconnected,
                        ..Default::default()
                    }
                }
                // The engine hands over to its new process: nothing to report but that the
                // node is here.
                Err(_) if service.upgrading.load(std::sync::atomic::Ordering::SeqCst) => proto::HeartbeatRequest {
                    node: args.name.clone(),
                    applied_generation,
                    changes_only: true,
                    ..Default::default()
                },
                Err(e) => {
                    if engine_down.is_none() {
                        tracing::warn!(agent = %args.name, "engine at {} does not answer: {e}", engine.display());
                    }
                    let engine_error = format!("engine at {} does not answer: {e}", engine.display());
                    engine_down = Some(engine_error.clone());
                    proto::HeartbeatRequest {
                        node: args.name.clone(),
                        applied_generation,
                        engine_error,
                        ..Default::default()
                    }
                }
            };
            let sent = controllers.call(async |mut c| c.heartbeat(hb.clone()).await).await;
            let result = match &sent {
                Ok(r) if !r.known => "unknown_node",
                Ok(_) => "ok",
                Err(_) => "failed",
            };
            service.metrics.heartbeats.get_or_create(&ResultLabels { result }).inc();
            // The next heartbeat lists only what changed after this one, once the
            // controller took this one and holds a complete report; otherwise all.
            usage_mark = None;
            let mut resend = false;
            match sent {
                Ok(r) if !r.known => registered = false,
                Ok(r) => {
                    usage_mark = mark.filter(|_| !r.send_everything);
                    // The controller paces its nodes by their number (0: an older one).
                    if r.heartbeat_interval_ms > 0 {
                        interval = Duration::from_millis(r.heartbeat_interval_ms.max(100));
                    }
                    // A controller without a complete report (a new leader) gets one
                    // at once rather than a heartbeat later.
                    resend = r.send_everything;
                }
                Err(e) => tracing::warn!(agent = %args.name, "heartbeat failed: {}", e.message()),
            }
            if resend {
                continue;
            }
        }
        service.metrics.registered.set(i64::from(registered));
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, size_bytes: u64) -> proto::DesiredVolume {
        proto::DesiredVolume {
            id: id.into(),
            subsystem_nqn: format!("{VOLUME_NQN_PREFIX}{id}"),
            size_bytes,
            present: true,
            ..Default::default()
        }
    }

    #[test]
    fn paths_close_before_a_backend_changes_and_open_after() {
        let changes = vec![
            ("h1".to_string(), AnaState::NonOptimized),
            ("h2".to_string(), AnaState::Inaccessible),
            ("h3".to_string(), AnaState::Optimized),
            ("h4".to_string(), AnaState::PersistentLoss),
        ];
        let (closing, opening) = around_swap(changes);
        let hosts = |v: &[HostState]| v.iter().map(|(h, _)| h.clone()).collect::<Vec<_>>();
        assert_eq!(hosts(&closing), ["h2", "h4"]);
        assert_eq!(hosts(&opening), ["h1", "h3"]);
    }

    #[test]
    fn changes_replace_add_and_drop_entries_of_the_state_held() {
        let held = proto::NodeState {
            node: "n1".into(),
            generation: 7,
            volumes: vec![entry("a", 1), entry("b", 1), entry("c", 1)],
            ..Default::default()
        };
        let changes = proto::NodeState {
            node: "n1".into(),
            generation: 8,
            volumes: vec![entry("b", 2), entry("d", 1)],
            changes_since: 7,
            dropped: vec!["c".into()],
        };
        let (whole, c) = with_changes(&held, changes);
        let mut ids: Vec<(String, u64)> = whole.volumes.iter().map(|d| (d.id.clone(), d.size_bytes)).collect();
        ids.sort();
        assert_eq!(ids, [("a".into(), 1), ("b".into(), 2), ("d".into(), 1)]);
        assert_eq!((whole.generation, whole.changes_since), (8, 0), "what is held is a whole state");
        assert!(whole.dropped.is_empty());
        assert_eq!(c.listed.iter().map(|d| d.id.as_str()).collect::<Vec<_>>(), ["b", "d"]);
        assert_eq!(c.dropped, [entry("c", 1)], "a dropped entry keeps what it was, for its export's removal");
    }
}

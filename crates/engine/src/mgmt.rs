//! The management API's server: newline-delimited JSON requests on a Unix socket,
//! each decoded as the [`nvpool_api`] type its method names and answered with that
//! method's reply type (the wire form and every method are documented there).

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nvpool_api::{
    AddHost, AddListener, AddLocalDevice, AddNamespace, AddSubsystem, AllowAnyHost, CancelMigration, CheckPool,
    CloneVolume, CreatePool, CreateSnapshot, CreateVolume, DeleteVolume, Empty, EngineInfo, ErrorReply, ExportPool,
    GetEngineInfo, GetMigration, GetRebuild, GetSubsystems, GetUsage, GetVolume, GrowNamespace, HoldWrites, ImportPool,
    InflateVolume, ListAnaGroups, ListListeners, ListLocalDevices, ListPools, ListSubsystems, ListVolumes,
    LocalDeviceAdded, METHODS, Method, NamespaceAdded, RemoveHost, RemoveListener, RemoveLocalDevice, RemoveNamespace,
    RemoveSubsystem, ResizeVolume, SetAnaState, SetControllerIdRange, SetDiscoveryAddress, SetHostPaths,
    SetNamespaceQos, StartMigration, StartRebuild, SwapNamespace, SwitchMigration, UpgradeEngine, VolumeDirty,
    VolumeWrittenSince,
};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::upgrade::process::wait_readable;

/// Binds the management socket and serves it on a background thread.
pub fn serve(engine: Arc<Engine>, path: &Path) -> std::result::Result<PathBuf, String> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    if UnixStream::connect(path).is_ok() {
        return Err(format!(
            "another engine already serves {}: stop it, or pass --mgmt-socket with another path",
            path.display()
        ));
    }
    let _ = std::fs::remove_file(path);
    let listener =
        UnixListener::bind(path).map_err(|e| format!("cannot bind the management socket {}: {e}", path.display()))?;
    serve_listener(engine, listener)?;
    Ok(path.to_path_buf())
}

/// Serves management on a bound socket (a hot upgrade's new process gets it bound).
pub fn serve_listener(engine: Arc<Engine>, listener: UnixListener) -> std::result::Result<(), String> {
    engine.set_management_listener(&listener);
    listener.set_nonblocking(true).map_err(|e| format!("management socket: {e}"))?;
    std::thread::Builder::new()
        .name("nvpool-mgmt".into())
        .spawn(move || {
            loop {
                // Accepting waits while a hot upgrade runs, and ends once it handed the
                // socket over: a client that connects then is served by the new engine.
                if !wait_readable(listener.as_raw_fd(), Duration::from_millis(200)) {
                    continue;
                }
                let _guard = engine.management_guard();
                if engine.handed_over() {
                    return;
                }
                let Ok((stream, _)) = listener.accept() else { continue };
                let _ = stream.set_nonblocking(false);
                let engine = engine.clone();
                let _ = std::thread::Builder::new()
                    .name("nvpool-mgmt-client".into())
                    .spawn(move || client(&engine, stream));
            }
        })
        .map_err(|e| format!("cannot start the management thread: {e}"))?;
    Ok(())
}

fn client(engine: &Engine, stream: UnixStream) {
    let Ok(mut out) = stream.try_clone() else {
        return;
    };
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        if line.trim().is_empty() {
            continue;
        }
        let reply = match reply_text(engine, &line) {
            Ok(result) => format!("{{\"result\":{result}}}\n"),
            Err(e) => format!("{}\n", json!(ErrorReply { error: &e.message, kind: e.kind })),
        };
        // One write for the whole reply: formatting straight into the socket sends
        // each token on its own, thousands of system calls for a long listing.
        let written = out.write_all(reply.as_bytes());
        if engine.handed_over() {
            // The new engine serves from here on; this process lets go of nothing it
            // handed over (its sockets close only as descriptors: no shutdown).
            let _ = out.flush();
            crate::upgrade::process::step_aside();
            std::process::exit(0);
        }
        if written.is_err() {
            return;
        }
    }
}

#[derive(Deserialize)]
struct ApiCall {
    method: String,
    #[serde(default)]
    params: Value,
}

/// Decodes `params` as method `M`'s request, runs it, and encodes the reply as JSON
/// text (straight from its type: a listing of a thousand volumes built as a JSON tree
/// first cost several times as much).
fn answer<M: Method>(params: Value, run: impl FnOnce(M) -> Result<M::Reply>) -> Result<String> {
    let params = if params.is_null() { json!({}) } else { params };
    let request: M =
        serde_json::from_value(params).map_err(|e| Error::invalid(format!("{}: bad params: {e}", M::NAME)))?;
    let reply = run(request)?;
    serde_json::to_string(&reply).map_err(|e| Error::internal(format!("{}: cannot encode the reply: {e}", M::NAME)))
}

fn ok(r: Result<()>) -> Result<Empty> {
    r.map(|()| Empty {})
}

/// Handles one request line; public so tests can drive the API without a socket.
pub fn handle(engine: &Engine, line: &str) -> Result<Value> {
    let text = reply_text(engine, line)?;
    serde_json::from_str(&text).map_err(|e| Error::internal(format!("the reply is not JSON: {e}")))
}

/// Handles one request line; the reply's JSON text.
fn reply_text(engine: &Engine, line: &str) -> Result<String> {
    let call: ApiCall = serde_json::from_str(line).map_err(|e| {
        Error::invalid(format!("request is not valid JSON of the form {{\"method\": ..., \"params\": ...}}: {e}"))
    })?;
    let p = call.params;
    if call.method == UpgradeEngine::NAME {
        // Holds the management lock alone, waiting for calls under way.
        return answer(p, |r: UpgradeEngine| engine.upgrade(r.binary.as_deref()));
    }
    let _guard = engine.management_guard();
    if engine.handed_over() {
        return Err(Error::unavailable("this engine handed over to a new process: connect again"));
    }
    match call.method.as_str() {
        GetEngineInfo::NAME => answer(p, |GetEngineInfo {}| {
            Ok(EngineInfo {
                version: crate::version::version().into(),
                pid: std::process::id(),
                controllers: engine.target().controller_count(),
                connections: engine.target().connection_count(),
                listeners: engine.listeners(),
                host_nqn: engine.host_nqn().to_string(),
                cntlid_min: engine.target().cntlid_range().0,
                cntlid_max: engine.target().cntlid_range().1,
                discovery_address: engine.target().discovery_address(),
            })
        }),
        SetControllerIdRange::NAME => {
            answer(p, |r: SetControllerIdRange| ok(engine.target().set_cntlid_range(r.min, r.max)))
        }
        ListSubsystems::NAME => answer(p, |ListSubsystems {}| Ok(engine.subsystems())),
        GetSubsystems::NAME => answer(p, |r: GetSubsystems| Ok(engine.subsystems_named(&r.nqns))),
        AddSubsystem::NAME => answer(p, |AddSubsystem(s)| ok(engine.add_subsystem(&s))),
        RemoveSubsystem::NAME => answer(p, |r: RemoveSubsystem| ok(engine.remove_subsystem(&r.nqn))),
        AddNamespace::NAME => {
            answer(p, |r: AddNamespace| engine.add_namespace(&r.nqn, &r.namespace).map(|nsid| NamespaceAdded { nsid }))
        }
        SetNamespaceQos::NAME => answer(p, |r: SetNamespaceQos| ok(engine.set_namespace_qos(&r.nqn, r.nsid, r.limits))),
        SwapNamespace::NAME => answer(p, |r: SwapNamespace| ok(engine.swap_namespace(&r.nqn, r.nsid, &r.backend))),
        GrowNamespace::NAME => answer(p, |r: GrowNamespace| ok(engine.grow_namespace(&r.nqn, r.nsid).map(drop))),
        RemoveNamespace::NAME => answer(p, |r: RemoveNamespace| ok(engine.remove_namespace(&r.nqn, r.nsid))),
        AddLocalDevice::NAME => {
            answer(p, |r: AddLocalDevice| engine.local.add(&r.device).map(|device| LocalDeviceAdded { device }))
        }
        RemoveLocalDevice::NAME => answer(p, |r: RemoveLocalDevice| match (r.ublk_id, r.socket) {
            (Some(id), None) => ok(engine.local.remove(id)),
            (None, Some(socket)) => ok(engine.local.remove_vhost(&socket)),
            _ => Err(Error::invalid("name one local device: its ublk_id or its vhost-user-blk socket")),
        }),
        ListLocalDevices::NAME => answer(p, |ListLocalDevices {}| Ok(engine.local.list())),
        AddHost::NAME => {
            answer(p, |r: AddHost| ok(engine.add_host(&r.nqn, &r.host, r.dhchap.as_ref(), r.tls_psk.as_ref())))
        }
        RemoveHost::NAME => answer(p, |r: RemoveHost| ok(engine.remove_host(&r.nqn, &r.host))),
        AllowAnyHost::NAME => answer(p, |r: AllowAnyHost| ok(engine.set_allow_any_host(&r.nqn, r.allow))),
        SetHostPaths::NAME => answer(p, |r: SetHostPaths| ok(engine.set_host_paths(&r.nqn, &r.host, r.paths))),
        SetDiscoveryAddress::NAME => answer(p, |r: SetDiscoveryAddress| {
            engine.target().set_discovery_address(r.address);
            Ok(Empty {})
        }),
        SetAnaState::NAME => {
            answer(p, |r: SetAnaState| ok(engine.set_ana_state(&r.nqn, r.group, r.host.as_deref(), r.state)))
        }
        ListAnaGroups::NAME => answer(p, |r: ListAnaGroups| engine.ana_groups(&r.nqn)),
        ListListeners::NAME => answer(p, |ListListeners {}| Ok(engine.listeners())),
        AddListener::NAME => answer(p, |r: AddListener| engine.add_listener(r.address, r.tls, r.transport)),
        RemoveListener::NAME => answer(p, |r: RemoveListener| ok(engine.remove_listener(r.address, r.transport))),
        CreatePool::NAME => answer(p, |r: CreatePool| engine.pools.create(&r.name, &r.disks, r.cluster_size, r.force)),
        ImportPool::NAME => answer(p, |r: ImportPool| engine.pools.import(&r.disks)),
        ExportPool::NAME => answer(p, |r: ExportPool| ok(engine.pools.export(&r.name))),
        CheckPool::NAME => answer(p, |r: CheckPool| ok(engine.pools.check(&r.name))),
        ListPools::NAME => answer(p, |ListPools {}| Ok(engine.pools.list())),
        GetUsage::NAME => answer(p, |r: GetUsage| Ok(engine.usage(r.since))),
        CreateVolume::NAME => answer(p, |r: CreateVolume| {
            engine.pools.create_volume(&r.pool, &r.name, r.size, r.thin, r.identity.as_ref())
        }),
        DeleteVolume::NAME => answer(p, |r: DeleteVolume| ok(engine.pools.delete_volume(&r.pool, &r.name))),
        CreateSnapshot::NAME => {
            answer(p, |r: CreateSnapshot| engine.pools.take_snapshot(&r.pool, &r.volume, &r.name, r.identity.as_ref()))
        }
        HoldWrites::NAME => answer(p, |r: HoldWrites| {
            if r.hold_ms == 0 {
                engine.pools.release_writes(&r.pool, &r.volume);
                return ok(Ok(()));
            }
            ok(engine.pools.hold_writes(&r.pool, &r.volume, Duration::from_millis(r.hold_ms)))
        }),
        CloneVolume::NAME => {
            answer(p, |r: CloneVolume| engine.pools.clone_volume(&r.pool, &r.snapshot, &r.name, r.identity.as_ref()))
        }
        GetVolume::NAME => answer(p, |r: GetVolume| engine.pools.volume(&r.pool, &r.name)),
        InflateVolume::NAME => answer(p, |r: InflateVolume| engine.pools.inflate_volume(&r.pool, &r.name)),
        ResizeVolume::NAME => answer(p, |r: ResizeVolume| engine.resize_volume(&r.pool, &r.name, r.size)),
        ListVolumes::NAME => answer(p, |r: ListVolumes| engine.pools.volumes(r.pool.as_deref())),
        VolumeDirty::NAME => answer(p, |r: VolumeDirty| engine.pools.volume_dirty(&r.pool, &r.name, r.action)),
        VolumeWrittenSince::NAME => {
            answer(p, |r: VolumeWrittenSince| engine.pools.written_since(&r.pool, &r.name, r.generation))
        }
        StartMigration::NAME => {
            answer(p, |r: StartMigration| engine.start_migration(&r.pool, &r.name, &r.id, &r.target, r.rate))
        }
        StartRebuild::NAME => {
            answer(p, |r: StartRebuild| engine.start_rebuild(&r.nqn, r.nsid, &r.leg, r.since, r.rate))
        }
        GetRebuild::NAME => answer(p, |r: GetRebuild| Ok(engine.rebuilds.info(&r.nqn, r.nsid))),
        GetMigration::NAME => answer(p, |r: GetMigration| Ok(engine.migrations.info(&engine.pools, &r.pool, &r.name))),
        SwitchMigration::NAME => answer(p, |r: SwitchMigration| {
            let pause = r.pause_ms.map(|ms| std::time::Duration::from_millis(u64::from(ms)));
            engine.migrations.switch(&engine.pools, &r.pool, &r.name, pause)
        }),
        CancelMigration::NAME => {
            answer(p, |r: CancelMigration| engine.migrations.cancel(&engine.pools, &r.pool, &r.name))
        }
        other => Err(Error::invalid(format!("unknown method {other:?}: use {}", METHODS.join(", ")))),
    }
}

//! The management API: newline-delimited JSON requests on a Unix socket.
//!
//! Each request is one line, `{"method": "...", "params": {...}}`; each reply is one
//! line, `{"result": ...}` or `{"error": "what was wrong and what to do"}`.
//!
//! | method | params |
//! |---|---|
//! | `engine_info` | |
//! | `subsystem_list` | |
//! | `subsystem_add` | a subsystem as in the TOML configuration |
//! | `subsystem_remove` | `nqn` |
//! | `namespace_add` | `nqn`, `namespace` (as in the TOML configuration) |
//! | `namespace_remove` | `nqn`, `nsid` |
//! | `host_add`, `host_remove` | `nqn`, `host` |
//! | `allow_any_host` | `nqn`, `allow` |
//! | `listener_list` | |
//! | `listener_add`, `listener_remove` | `address` |
//! | `pool_create` | `name`, `disks`, optional `cluster_size` (bytes), `force` |
//! | `pool_import` | `disks` |
//! | `pool_export`, `pool_check` | `name` |
//! | `pool_list` | |
//! | `volume_create` | `pool`, `name`, `size` (bytes), `thin` |
//! | `volume_delete`, `volume_get` | `pool`, `name` |
//! | `volume_resize` | `pool`, `name`, `size` (bytes; grow only) |
//! | `volume_list` | optional `pool` |
//! | `volume_dirty` | `pool`, `name`, `action`: `start`, `stop`, `report` or `reset` |

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::{NamespaceConfig, SubsystemConfig};
use crate::{DirtyAction, Engine};

/// Binds the management socket and serves it on a background thread.
pub fn serve(engine: Arc<Engine>, path: &Path) -> Result<PathBuf, String> {
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
    std::thread::Builder::new()
        .name("nvpool-mgmt".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let engine = engine.clone();
                let _ = std::thread::Builder::new()
                    .name("nvpool-mgmt-client".into())
                    .spawn(move || client(&engine, stream));
            }
        })
        .map_err(|e| format!("cannot start the management thread: {e}"))?;
    Ok(path.to_path_buf())
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
        let reply = match handle(engine, &line) {
            Ok(v) => json!({ "result": v }),
            Err(e) => json!({ "error": e }),
        };
        if writeln!(out, "{reply}").is_err() {
            return;
        }
    }
}

#[derive(Deserialize)]
struct Request {
    method: String,
    #[serde(default)]
    params: Value,
}

fn params<T: for<'de> Deserialize<'de>>(method: &str, v: Value) -> Result<T, String> {
    let v = if v.is_null() { json!({}) } else { v };
    serde_json::from_value(v).map_err(|e| format!("{method}: bad params: {e}"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Nqn {
    nqn: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NsAdd {
    nqn: String,
    namespace: NamespaceConfig,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NsRemove {
    nqn: String,
    nsid: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Host {
    nqn: String,
    host: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowAny {
    nqn: String,
    allow: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Address {
    address: std::net::SocketAddr,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolCreate {
    name: String,
    disks: Vec<PathBuf>,
    cluster_size: Option<u64>,
    #[serde(default)]
    force: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Disks {
    disks: Vec<PathBuf>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Name {
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeCreate {
    pool: String,
    name: String,
    size: u64,
    #[serde(default)]
    thin: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeRef {
    pool: String,
    name: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeResize {
    pool: String,
    name: String,
    size: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolFilter {
    pool: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct VolumeDirty {
    pool: String,
    name: String,
    action: DirtyAction,
}

/// Handles one request line; public so tests can drive the API without a socket.
pub fn handle(engine: &Engine, line: &str) -> Result<Value, String> {
    let req: Request = serde_json::from_str(line)
        .map_err(|e| format!("request is not valid JSON of the form {{\"method\": ..., \"params\": ...}}: {e}"))?;
    let m = req.method.as_str();
    let p = req.params;
    let ok = |r: Result<(), String>| r.map(|()| json!({}));
    match m {
        "engine_info" => Ok(json!({
            "version": env!("CARGO_PKG_VERSION"),
            "controllers": engine.target().controller_count(),
            "connections": engine.target().connection_count(),
            "listeners": engine.listeners(),
        })),
        "subsystem_list" => Ok(json!(engine.subsystems())),
        "subsystem_add" => ok(engine.add_subsystem(&params::<SubsystemConfig>(m, p)?)),
        "subsystem_remove" => ok(engine.remove_subsystem(&params::<Nqn>(m, p)?.nqn)),
        "namespace_add" => {
            let a: NsAdd = params(m, p)?;
            engine.add_namespace(&a.nqn, &a.namespace).map(|nsid| json!({ "nsid": nsid }))
        }
        "namespace_remove" => {
            let a: NsRemove = params(m, p)?;
            ok(engine.remove_namespace(&a.nqn, a.nsid))
        }
        "host_add" => {
            let h: Host = params(m, p)?;
            ok(engine.add_host(&h.nqn, &h.host))
        }
        "host_remove" => {
            let h: Host = params(m, p)?;
            ok(engine.remove_host(&h.nqn, &h.host))
        }
        "allow_any_host" => {
            let a: AllowAny = params(m, p)?;
            ok(engine.set_allow_any_host(&a.nqn, a.allow))
        }
        "listener_list" => Ok(json!(engine.listeners())),
        "listener_add" => engine.add_listener(params::<Address>(m, p)?.address).map(|l| json!(l)),
        "listener_remove" => ok(engine.remove_listener(params::<Address>(m, p)?.address)),
        "pool_create" => {
            let a: PoolCreate = params(m, p)?;
            engine.create_pool(&a.name, &a.disks, a.cluster_size, a.force).map(|i| json!(i))
        }
        "pool_import" => engine.import_pool(&params::<Disks>(m, p)?.disks).map(|i| json!(i)),
        "pool_export" => ok(engine.export_pool(&params::<Name>(m, p)?.name)),
        "pool_check" => ok(engine.check_pool(&params::<Name>(m, p)?.name)),
        "pool_list" => Ok(json!(engine.pools())),
        "volume_create" => {
            let a: VolumeCreate = params(m, p)?;
            engine.create_volume(&a.pool, &a.name, a.size, a.thin).map(|i| json!(i))
        }
        "volume_delete" => {
            let a: VolumeRef = params(m, p)?;
            ok(engine.delete_volume(&a.pool, &a.name))
        }
        "volume_get" => {
            let a: VolumeRef = params(m, p)?;
            engine.volume(&a.pool, &a.name).map(|i| json!(i))
        }
        "volume_resize" => {
            let a: VolumeResize = params(m, p)?;
            engine.resize_volume(&a.pool, &a.name, a.size).map(|i| json!(i))
        }
        "volume_list" => engine.volumes(params::<PoolFilter>(m, p)?.pool.as_deref()).map(|v| json!(v)),
        "volume_dirty" => {
            let a: VolumeDirty = params(m, p)?;
            engine.volume_dirty(&a.pool, &a.name, a.action).map(|r| json!(r))
        }
        _ => Err(format!(
            "unknown method {m:?}: use engine_info, subsystem_list, subsystem_add, subsystem_remove, namespace_add, \
             namespace_remove, host_add, host_remove, allow_any_host, listener_list, listener_add, listener_remove, \
             pool_create, pool_import, pool_export, pool_check, pool_list, volume_create, volume_delete, volume_get, \
             volume_resize, volume_list or volume_dirty"
        )),
    }
}

/// Sends one request to an engine's management socket and returns its result.
pub fn call(socket: &Path, method: &str, params: Value) -> Result<Value, String> {
    let mut s = UnixStream::connect(socket).map_err(|e| {
        format!(
            "cannot reach the engine at {}: {e} (is `nvpool engine` running? pass --socket if it uses another path)",
            socket.display()
        )
    })?;
    let req = json!({ "method": method, "params": params });
    writeln!(s, "{req}").map_err(|e| format!("sending to {}: {e}", socket.display()))?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).map_err(|e| format!("reading from {}: {e}", socket.display()))?;
    let reply: Value = serde_json::from_str(&line).map_err(|e| format!("the engine sent a malformed reply: {e}"))?;
    if let Some(e) = reply.get("error") {
        return Err(e.as_str().unwrap_or("unknown error").to_string());
    }
    Ok(reply.get("result").cloned().unwrap_or(Value::Null))
}

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

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::Engine;
use crate::config::{NamespaceConfig, SubsystemConfig};

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
        _ => Err(format!(
            "unknown method {m:?}: use engine_info, subsystem_list, subsystem_add, subsystem_remove, namespace_add, \
             namespace_remove, host_add, host_remove, allow_any_host, listener_list, listener_add or listener_remove"
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

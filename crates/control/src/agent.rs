//! `nvpool agent`: one per node. It registers the node with the controller, reports
//! its pools and heartbeats, and makes its engine match the state the controller wants:
//! volumes, their exports and allow-lists. It keeps the last state it was given and
//! re-applies it on every heartbeat, so an engine that restarted gets its exports back
//! without the controller's help; a restarted agent registers again and is sent the
//! state anew.

use crate::client::Controllers;
use crate::proto::{self, agent_server::AgentServer};
use nvpool_engine::mgmt;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
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
    pub labels: BTreeMap<String, String>,
}

#[derive(Default)]
struct Applied {
    state: Option<proto::NodeState>,
    /// Generation of the last state applied without errors.
    generation: u64,
}

struct Service {
    engine: PathBuf,
    applied: tokio::sync::Mutex<Applied>,
}

impl Service {
    /// Applies `state` to the engine and remembers it.
    async fn apply(&self, state: proto::NodeState) -> Vec<proto::VolumeResult> {
        let mut applied = self.applied.lock().await;
        let engine = self.engine.clone();
        let to_apply = state.clone();
        let results = tokio::task::spawn_blocking(move || reconcile(&engine, &to_apply)).await.unwrap_or_else(|e| {
            vec![proto::VolumeResult { error: format!("agent failed: {e}"), ..Default::default() }]
        });
        if results.iter().all(|r| r.error.is_empty()) {
            applied.generation = state.generation;
        }
        applied.state = Some(state);
        results
    }
}

#[tonic::async_trait]
impl proto::agent_server::Agent for Service {
    async fn apply(&self, r: Request<proto::NodeState>) -> Result<Response<proto::ApplyResponse>, Status> {
        Ok(Response::new(proto::ApplyResponse { results: Service::apply(self, r.into_inner()).await }))
    }
}

fn call(engine: &Path, method: &str, params: Value) -> Result<Value, String> {
    mgmt::call(engine, method, params)
}

/// Makes the engine match `state`; one result per volume.
fn reconcile(engine: &Path, state: &proto::NodeState) -> Vec<proto::VolumeResult> {
    let listed =
        call(engine, "volume_list", json!({})).and_then(|v| Ok((v, call(engine, "subsystem_list", json!({}))?)));
    let (volumes, subsystems) = match listed {
        Ok((Value::Array(v), Value::Array(s))) => (v, s),
        Ok(_) => (vec![], vec![]),
        Err(e) => {
            return state
                .volumes
                .iter()
                .map(|d| proto::VolumeResult { id: d.id.clone(), error: e.clone(), ..Default::default() })
                .collect();
        }
    };
    state
        .volumes
        .iter()
        .map(|d| {
            let volume = volumes.iter().find(|v| v["pool"] == d.pool.as_str() && v["name"] == d.engine_name.as_str());
            let subsystem = subsystems.iter().find(|s| s["nqn"] == d.subsystem_nqn.as_str());
            let outcome = if d.present {
                ensure(engine, d, volume, subsystem)
            } else {
                remove(engine, d, volume.is_some(), subsystem.is_some()).map(|()| Value::Null)
            };
            match outcome {
                Ok(info) => proto::VolumeResult {
                    id: d.id.clone(),
                    error: String::new(),
                    uuid: info["uuid"].as_str().unwrap_or_default().to_string(),
                    nguid: info["nguid"].as_str().unwrap_or_default().to_string(),
                    allocated_bytes: info["allocated_bytes"].as_u64().unwrap_or(0),
                },
                Err(error) => proto::VolumeResult { id: d.id.clone(), error, ..Default::default() },
            }
        })
        .collect()
}

/// Creates, grows and exports one volume as needed; returns its engine info.
fn ensure(
    engine: &Path,
    d: &proto::DesiredVolume,
    volume: Option<&Value>,
    subsystem: Option<&Value>,
) -> Result<Value, String> {
    let reference = json!({ "pool": d.pool, "name": d.engine_name });
    let mut info = match volume {
        None => call(
            engine,
            "volume_create",
            json!({ "pool": d.pool, "name": d.engine_name, "size": d.size_bytes, "thin": d.thin }),
        )?,
        Some(v) => v.clone(),
    };
    if info["size"].as_u64().unwrap_or(0) < d.size_bytes {
        info = call(engine, "volume_resize", json!({ "pool": d.pool, "name": d.engine_name, "size": d.size_bytes }))?;
    }
    let backend = format!("volume:{}/{}", d.pool, d.engine_name);
    match subsystem {
        None => {
            let config = json!({
                "nqn": d.subsystem_nqn,
                "allow_any_host": false,
                "hosts": d.hosts,
                "namespace": [{ "nsid": 1, "backend": backend, "block_size": 4096 }],
            });
            call(engine, "subsystem_add", config)?;
        }
        Some(s) => {
            let has_namespace = s["namespaces"].as_array().is_some_and(|n| n.iter().any(|n| n["nsid"] == 1));
            if !has_namespace {
                call(
                    engine,
                    "namespace_add",
                    json!({ "nqn": d.subsystem_nqn, "namespace": { "nsid": 1, "backend": backend, "block_size": 4096 } }),
                )?;
            }
            let allowed: Vec<&str> =
                s["hosts"].as_array().map(|h| h.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
            for h in d.hosts.iter().filter(|h| !allowed.contains(&h.as_str())) {
                call(engine, "host_add", json!({ "nqn": d.subsystem_nqn, "host": h }))?;
            }
            for h in allowed.iter().filter(|h| !d.hosts.iter().any(|d| d == *h)) {
                call(engine, "host_remove", json!({ "nqn": d.subsystem_nqn, "host": h }))?;
            }
        }
    }
    if volume.is_some() {
        info = call(engine, "volume_get", reference)?;
    }
    Ok(info)
}

fn remove(engine: &Path, d: &proto::DesiredVolume, has_volume: bool, has_subsystem: bool) -> Result<(), String> {
    if has_subsystem {
        call(engine, "subsystem_remove", json!({ "nqn": d.subsystem_nqn }))?;
    }
    if has_volume {
        call(engine, "volume_delete", json!({ "pool": d.pool, "name": d.engine_name }))?;
    }
    Ok(())
}

/// The node's pools and its volumes' allocations, as the engine reports them.
fn usage(engine: &Path) -> (Vec<proto::PoolReport>, Vec<proto::VolumeUsage>) {
    let pools = call(engine, "pool_list", json!({})).ok().and_then(|v| v.as_array().cloned()).unwrap_or_default();
    let volumes = call(engine, "volume_list", json!({})).ok().and_then(|v| v.as_array().cloned()).unwrap_or_default();
    let pools = pools
        .iter()
        .map(|p| proto::PoolReport {
            name: p["name"].as_str().unwrap_or_default().into(),
            capacity_bytes: p["capacity_bytes"].as_u64().unwrap_or(0),
            used_bytes: p["used_bytes"].as_u64().unwrap_or(0),
            provisioned_bytes: p["provisioned_bytes"].as_u64().unwrap_or(0),
            cluster_size: p["cluster_size"].as_u64().unwrap_or(0),
            volumes: p["volumes"].as_u64().unwrap_or(0) as u32,
            failed: p["failed"].as_str().unwrap_or_default().into(),
        })
        .collect();
    let volumes = volumes
        .iter()
        .map(|v| proto::VolumeUsage {
            engine_name: v["name"].as_str().unwrap_or_default().into(),
            allocated_bytes: v["allocated_bytes"].as_u64().unwrap_or(0),
        })
        .collect();
    (pools, volumes)
}

/// The address hosts use: the engine's first listener, unless one was given.
fn nvme_address(engine: &Path, given: &Option<String>) -> Result<String, String> {
    if let Some(a) = given {
        return Ok(a.clone());
    }
    let listeners = call(engine, "listener_list", json!({}))?;
    let first = listeners
        .as_array()
        .and_then(|l| l.first())
        .ok_or("the engine has no listener: add one, or pass --nvme-address")?;
    let ip: std::net::IpAddr =
        first["addr"].as_str().unwrap_or_default().parse().map_err(|e| format!("engine listener: {e}"))?;
    if ip.is_unspecified() {
        return Err(format!("the engine listens on {ip}: pass --nvme-address with the address hosts should use"));
    }
    Ok(SocketAddr::new(ip, first["port"].as_u64().unwrap_or(4420) as u16).to_string())
}

/// Runs the agent until the process ends.
pub async fn run(args: AgentArgs) -> Result<(), String> {
    let controllers = Controllers::new(&args.controllers)?;
    let service = Arc::new(Service { engine: args.engine_socket.clone(), applied: Default::default() });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e} (pick another --listen)", args.listen))?;
    let advertise =
        args.advertise.clone().unwrap_or_else(|| listener.local_addr().map(|a| a.to_string()).unwrap_or_default());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(AgentServer::from_arc(service.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let engine = args.engine_socket.clone();
    let mut interval = Duration::from_secs(1);
    let mut registered = false;
    loop {
        if !registered {
            let engine2 = engine.clone();
            let given = args.nvme_address.clone();
            let found = tokio::task::spawn_blocking(move || (nvme_address(&engine2, &given), usage(&engine2)))
                .await
                .map_err(|e| e.to_string())?;
            match found {
                (Ok(nvme), (pools, _)) => {
                    let node = proto::Node {
                        name: args.name.clone(),
                        agent_address: advertise.clone(),
                        nvme_address: nvme,
                        labels: args.labels.clone().into_iter().collect(),
                        pools,
                        ..Default::default()
                    };
                    let req = proto::RegisterNodeRequest { node: Some(node) };
                    match controllers.call(async |mut c| c.register_node(req.clone()).await).await {
                        Ok(r) => {
                            interval = Duration::from_millis(r.heartbeat_interval_ms.max(100));
                            registered = true;
                            eprintln!("agent {}: registered with the controller", args.name);
                        }
                        Err(e) => eprintln!("agent {}: registering failed: {}", args.name, e.message()),
                    }
                }
                (Err(e), _) => eprintln!("agent {}: engine at {}: {e}", args.name, engine.display()),
            }
        } else {
            // Re-apply the last state, which restores exports after an engine restart.
            let last = service.applied.lock().await.state.clone();
            if let Some(state) = last {
                service.apply(state).await;
            }
            let engine2 = engine.clone();
            let (pools, volumes) =
                tokio::task::spawn_blocking(move || usage(&engine2)).await.map_err(|e| e.to_string())?;
            let applied_generation = service.applied.lock().await.generation;
            let hb = proto::HeartbeatRequest { node: args.name.clone(), pools, volumes, applied_generation };
            match controllers.call(async |mut c| c.heartbeat(hb.clone()).await).await {
                Ok(r) if !r.known => registered = false,
                Ok(_) => {}
                Err(e) => eprintln!("agent {}: heartbeat failed: {}", args.name, e.message()),
            }
        }
        tokio::time::sleep(interval).await;
    }
}

//! The pool's dashboard: a read-only web page the controller serves (`--http-listen`).
//!
//! The page (`dashboard/index.html`, `app.js`, `style.css`: static files compiled into
//! the binary, no build step) asks this server for JSON every two seconds: a summary
//! of the pool (`/api/v1/summary`) and one page of nodes or volumes
//! (`/api/v1/nodes`, `/api/v1/volumes`), searched, sorted and cut here, so a pool of
//! 1,000 nodes and 10,000 volumes sends the browser one page at a time. The figures are
//! the leading controller's view: a standby answers 503 and names no data.
//!
//! Under the control plane's mutual TLS the page is served over HTTPS with the
//! controller's certificate, and a browser must present a certificate from the
//! cluster's CA (`nvpool certs init` makes `client:NAME` ones; import one into the
//! browser), as every other caller of the controller must.

use std::cmp::Ordering;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};

use crate::cluster::{Cluster, VolumeBrief};
use crate::proto;
use crate::tls::Tls;

const INDEX: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/app.js");
const STYLE: &str = include_str!("dashboard/style.css");
/// Most rows one page of a table holds.
const MAX_PAGE: usize = 500;

/// The leading cluster, if this controller leads.
pub type Leader = Arc<dyn Fn() -> Option<Arc<Cluster>> + Send + Sync>;

/// Serves the dashboard on `addr` in the background: over TLS with client
/// certificates required when `tls` is given.
pub async fn serve(addr: SocketAddr, leader: Leader, tls: Option<&Tls>) -> Result<(), String> {
    let app = Router::new()
        .route("/", get(|| async { page("text/html; charset=utf-8", INDEX) }))
        .route("/app.js", get(|| async { page("text/javascript; charset=utf-8", SCRIPT) }))
        .route("/style.css", get(|| async { page("text/css; charset=utf-8", STYLE) }))
        .route("/api/v1/summary", get(summary))
        .route("/api/v1/nodes", get(nodes))
        .route("/api/v1/volumes", get(volumes))
        .with_state(leader);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot serve the dashboard on {addr}: {e}; pass --http-listen another address"))?;
    let served = match tls {
        None => tokio::spawn(async move { axum::serve(listener, app).await }),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.rustls_server()?);
            tokio::spawn(async move { axum::serve(TlsListener { tcp: listener, acceptor }, app).await })
        }
    };
    tokio::spawn(async move {
        if let Ok(Err(e)) = served.await {
            tracing::warn!("the dashboard stopped: {e}");
        }
    });
    Ok(())
}

/// How long a browser has to finish its TLS handshake.
const HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(10);

/// Connections that completed a TLS handshake with a client certificate from the
/// cluster's CA; the others are dropped (and logged at debug level).
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let (tcp, peer) = match self.tcp.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, most likely: wait rather than spin.
                    tracing::debug!("dashboard: accept failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    continue;
                }
            };
            match tokio::time::timeout(HANDSHAKE, self.acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => return (tls, peer),
                Ok(Err(e)) => tracing::debug!("dashboard: TLS handshake with {peer} failed: {e}"),
                Err(_) => tracing::debug!("dashboard: {peer} did not finish its TLS handshake"),
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}

fn page(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

fn not_leading() -> Response {
    let why = "this controller does not lead: open the dashboard of the leading controller (`nvpool cluster-info`)";
    (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({ "error": why }))).into_response()
}

/// A table's request: `q` (a substring of any shown field), `sort` (a column),
/// `desc`, `offset` and `limit`.
#[derive(Debug, Default, Deserialize)]
pub struct TableQuery {
    #[serde(default)]
    q: String,
    #[serde(default)]
    sort: String,
    #[serde(default)]
    desc: bool,
    #[serde(default)]
    offset: usize,
    #[serde(default)]
    limit: Option<usize>,
}

/// One page of a table, and how many rows matched.
#[derive(Debug, Serialize)]
pub struct Table<T> {
    total: usize,
    offset: usize,
    items: Vec<T>,
}

/// I/O rates, as the page shows them.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Io {
    read_iops: f64,
    write_iops: f64,
    read_bytes_per_second: f64,
    write_bytes_per_second: f64,
    mean_latency_us: f64,
}

impl Io {
    fn of(r: Option<&proto::IoRates>) -> Io {
        r.map_or_else(Io::default, |r| Io {
            read_iops: r.read_iops,
            write_iops: r.write_iops,
            read_bytes_per_second: r.read_bytes_per_second,
            write_bytes_per_second: r.write_bytes_per_second,
            mean_latency_us: r.mean_latency_us,
        })
    }

    fn iops(&self) -> f64 {
        self.read_iops + self.write_iops
    }

    fn bytes_per_second(&self) -> f64 {
        self.read_bytes_per_second + self.write_bytes_per_second
    }
}

#[derive(Debug, Serialize)]
struct PoolRow {
    name: String,
    capacity_bytes: u64,
    used_bytes: u64,
    /// Of `used_bytes`, what snapshots hold (shared with the volumes over them).
    shared_bytes: u64,
    provisioned_bytes: u64,
    failed: String,
}

#[derive(Debug, Serialize)]
pub struct NodeRow {
    name: String,
    healthy: bool,
    engine_error: String,
    engine_version: String,
    nvme_address: String,
    volumes: u32,
    pools: Vec<PoolRow>,
    io: Io,
}

#[derive(Debug, Serialize)]
struct PathRow {
    node: String,
    ana_state: String,
    owner: bool,
    healthy: bool,
}

#[derive(Debug, Serialize)]
struct AttachmentRow {
    host: String,
    local: bool,
    paths: Vec<PathRow>,
}

#[derive(Debug, Serialize)]
struct MigrationRow {
    volume: String,
    from_node: String,
    to_node: String,
    phase: String,
    round: u32,
    copied_bytes: u64,
    dirty_bytes: u64,
    allocated_bytes: u64,
    rate: u64,
}

#[derive(Debug, Serialize)]
pub struct VolumeRow {
    name: String,
    node: String,
    pool: String,
    state: String,
    size_bytes: u64,
    allocated_bytes: u64,
    degraded: String,
    limits: String,
    attachments: Vec<AttachmentRow>,
    migration: Option<MigrationRow>,
    /// The other replicas of a replicated volume, each `node: state`.
    replicas: Vec<String>,
    io: Io,
}

fn node_row(n: proto::Node) -> NodeRow {
    NodeRow {
        pools: n
            .pools
            .iter()
            .map(|p| PoolRow {
                name: p.name.clone(),
                capacity_bytes: p.capacity_bytes,
                used_bytes: p.used_bytes,
                shared_bytes: p.snapshot_bytes,
                provisioned_bytes: p.provisioned_bytes,
                failed: p.failed.clone(),
            })
            .collect(),
        io: Io::of(n.io.as_ref()),
        name: n.name,
        healthy: n.healthy,
        engine_error: n.engine_error,
        engine_version: n.engine_version,
        nvme_address: n.nvme_address,
        volumes: n.volumes,
    }
}

fn migration_row(volume: &str, m: &proto::Migration) -> MigrationRow {
    MigrationRow {
        volume: volume.to_string(),
        from_node: m.from_node.clone(),
        to_node: m.to_node.clone(),
        phase: m.phase.clone(),
        round: m.round,
        copied_bytes: m.copied_bytes,
        dirty_bytes: m.dirty_bytes,
        allocated_bytes: m.allocated_bytes,
        rate: m.rate,
    }
}

fn volume_row(v: proto::Volume) -> VolumeRow {
    let limits = nvpool_api::QosLimits::from(v.qos.unwrap_or_default());
    VolumeRow {
        attachments: v
            .attachments
            .iter()
            .map(|a| AttachmentRow {
                host: a.host_nqn.clone(),
                local: a.local.is_some(),
                paths: a
                    .paths
                    .iter()
                    .map(|p| PathRow {
                        node: p.node.clone(),
                        ana_state: p.ana_state.clone(),
                        owner: p.owner,
                        healthy: p.healthy,
                    })
                    .collect(),
            })
            .collect(),
        migration: v.migration.as_ref().map(|m| migration_row(&v.name, m)),
        replicas: v
            .replicas
            .iter()
            .filter(|r| !r.serving)
            .map(|r| match r.state.as_str() {
                "rebuilding" if r.rebuild_total_bytes > 0 => {
                    format!("{}: rebuilding {}%", r.node, r.rebuild_copied_bytes * 100 / r.rebuild_total_bytes)
                }
                state => format!("{}: {state}", r.node),
            })
            .collect(),
        io: Io::of(v.io.as_ref()),
        limits: if limits.is_unlimited() { String::new() } else { limits.describe() },
        name: v.name,
        node: v.node,
        pool: v.pool,
        state: v.state,
        size_bytes: v.size_bytes,
        allocated_bytes: v.allocated_bytes,
        degraded: v.degraded,
    }
}

/// Filters, sorts and cuts `rows` as `q` asks. `text` is what a search matches;
/// `key` compares two rows by a column (None: the column does not exist).
fn table<T>(
    mut rows: Vec<T>,
    q: &TableQuery,
    text: impl Fn(&T) -> String,
    key: impl Fn(&str, &T, &T) -> Option<Ordering>,
    name: impl Fn(&T) -> &str,
) -> Table<T> {
    let needle = q.q.trim().to_lowercase();
    if !needle.is_empty() {
        rows.retain(|r| text(r).to_lowercase().contains(&needle));
    }
    rows.sort_by(|a, b| {
        let by = key(&q.sort, a, b).unwrap_or_else(|| name(a).cmp(name(b)));
        let by = if q.desc { by.reverse() } else { by };
        by.then_with(|| name(a).cmp(name(b)))
    });
    let total = rows.len();
    let limit = q.limit.unwrap_or(50).clamp(1, MAX_PAGE);
    let offset = q.offset.min(total);
    let items = rows.into_iter().skip(offset).take(limit).collect();
    Table { total, offset, items }
}

fn by_f64(a: f64, b: f64) -> Ordering {
    a.partial_cmp(&b).unwrap_or(Ordering::Equal)
}

fn pool_sum(n: &NodeRow, f: impl Fn(&PoolRow) -> u64) -> u64 {
    n.pools.iter().map(f).sum()
}

/// The nodes' table.
pub fn node_table(nodes: Vec<proto::Node>, q: &TableQuery) -> Table<NodeRow> {
    let rows = nodes.into_iter().map(node_row).collect();
    table(
        rows,
        q,
        |n| format!("{} {} {}", n.name, n.nvme_address, n.pools.iter().map(|p| p.name.as_str()).collect::<String>()),
        |col, a, b| {
            Some(match col {
                "iops" => by_f64(a.io.iops(), b.io.iops()),
                "throughput" => by_f64(a.io.bytes_per_second(), b.io.bytes_per_second()),
                "latency" => by_f64(a.io.mean_latency_us, b.io.mean_latency_us),
                "used" => pool_sum(a, |p| p.used_bytes).cmp(&pool_sum(b, |p| p.used_bytes)),
                "capacity" => pool_sum(a, |p| p.capacity_bytes).cmp(&pool_sum(b, |p| p.capacity_bytes)),
                "volumes" => a.volumes.cmp(&b.volumes),
                "health" => a.healthy.cmp(&b.healthy),
                _ => return None,
            })
        },
        |n| &n.name,
    )
}

/// The volumes' table: which volumes the page shows. `volumes` then builds their rows.
pub fn volume_table(volumes: Vec<VolumeBrief>, q: &TableQuery) -> Table<VolumeBrief> {
    table(
        volumes,
        q,
        |v| format!("{} {} {} {} {}", v.name, v.node, v.pool, v.state, v.hosts.join(" ")),
        |col, a, b| {
            let io = |v: &VolumeBrief| Io::of(v.io.as_ref());
            Some(match col {
                "node" => a.node.cmp(&b.node),
                "size" => a.size_bytes.cmp(&b.size_bytes),
                "iops" => by_f64(io(a).iops(), io(b).iops()),
                "throughput" => by_f64(io(a).bytes_per_second(), io(b).bytes_per_second()),
                "latency" => by_f64(io(a).mean_latency_us, io(b).mean_latency_us),
                "hosts" => a.hosts.len().cmp(&b.hosts.len()),
                "state" => a.state.cmp(b.state),
                _ => return None,
            })
        },
        |v| &v.name,
    )
}

#[derive(Debug, Default, Serialize)]
struct Summary {
    nodes: usize,
    healthy_nodes: usize,
    volumes: usize,
    volumes_by_state: HashMap<String, usize>,
    attachments: usize,
    capacity_bytes: u64,
    used_bytes: u64,
    provisioned_bytes: u64,
    io: Io,
    migrations: Vec<MigrationRow>,
}

async fn summary(State(leader): State<Leader>) -> Response {
    let Some(c) = leader() else { return not_leading() };
    let nodes = c.list_nodes();
    let totals = c.volume_totals();
    let mut s = Summary {
        nodes: nodes.len(),
        volumes: totals.volumes,
        volumes_by_state: totals.by_state,
        attachments: totals.attachments,
        io: Io {
            read_iops: totals.read_iops,
            write_iops: totals.write_iops,
            read_bytes_per_second: totals.read_bytes_per_second,
            write_bytes_per_second: totals.write_bytes_per_second,
            ..Io::default()
        },
        migrations: totals
            .migrating
            .iter()
            .filter_map(|v| Some(migration_row(&v.name, v.migration.as_ref()?)))
            .collect(),
        ..Summary::default()
    };
    for n in &nodes {
        s.healthy_nodes += usize::from(n.healthy);
        for p in &n.pools {
            s.capacity_bytes += p.capacity_bytes;
            s.used_bytes += p.used_bytes;
            s.provisioned_bytes += p.provisioned_bytes;
        }
    }
    Json(s).into_response()
}

async fn nodes(State(leader): State<Leader>, Query(q): Query<TableQuery>) -> Response {
    let Some(c) = leader() else { return not_leading() };
    Json(node_table(c.list_nodes(), &q)).into_response()
}

async fn volumes(State(leader): State<Leader>, Query(q): Query<TableQuery>) -> Response {
    let Some(c) = leader() else { return not_leading() };
    let page = volume_table(c.volume_briefs(), &q);
    let items = c.volumes_named(page.items.iter().map(|v| v.name.as_str())).into_iter().map(volume_row).collect();
    Json(Table { total: page.total, offset: page.offset, items }).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(i: usize) -> VolumeBrief {
        VolumeBrief {
            name: format!("vol-{i:05}"),
            node: format!("node-{}", i % 1000),
            size_bytes: (i as u64 + 1) << 20,
            state: "ready",
            io: Some(proto::IoRates { read_iops: (i % 97) as f64, ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn ten_thousand_volumes_are_searched_sorted_and_paged() {
        let all: Vec<VolumeBrief> = (0..10_000).map(volume).collect();
        let q = TableQuery { sort: "iops".into(), desc: true, limit: Some(25), ..Default::default() };
        let t = volume_table(all.clone(), &q);
        assert_eq!((t.total, t.items.len()), (10_000, 25));
        let iops = |v: &VolumeBrief| Io::of(v.io.as_ref()).iops();
        assert_eq!(iops(&t.items[0]), 96.0, "the busiest first");
        assert!(t.items.windows(2).all(|w| iops(&w[0]) >= iops(&w[1])));
        let q = TableQuery { q: "NODE-7".into(), offset: 5, limit: Some(3), ..Default::default() };
        let t = volume_table(all.clone(), &q);
        // node-7, node-70..79 and node-700..799: 111 nodes of 10 volumes each.
        assert_eq!(t.total, 1110);
        assert_eq!(t.items.len(), 3);
        assert!(t.items.iter().all(|v| v.node.starts_with("node-7")));
        let q = TableQuery { offset: 20_000, sort: "no-such-column".into(), ..Default::default() };
        let t = volume_table(all, &q);
        assert_eq!((t.total, t.items.len(), t.offset), (10_000, 0, 10_000), "past the end is an empty page");
    }

    #[test]
    fn nodes_sort_by_their_pools() {
        let node = |name: &str, used| proto::Node {
            name: name.into(),
            pools: vec![proto::PoolReport { name: "p".into(), used_bytes: used, ..Default::default() }],
            ..Default::default()
        };
        let q = TableQuery { sort: "used".into(), ..Default::default() };
        let t = node_table(vec![node("a", 30), node("b", 10), node("c", 20)], &q);
        let names: Vec<&str> = t.items.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["b", "c", "a"]);
    }
}

//! The Prometheus endpoint (`--metrics-listen`): `GET /metrics` answers with the
//! engine's figures in the Prometheus text format (0.0.4).
//!
//! Nothing is kept for it on the I/O path beyond the counters the reactors already
//! keep ([`crate::nvme::stats`]): a scrape gathers a snapshot of them on the
//! endpoint's own thread and encodes it with the `prometheus-client` crate. Names
//! follow Prometheus' conventions (base units, `_total` on counters) and mirror
//! node_exporter's disk figures where there is one to mirror.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use nvpool_api::PoolInfo;
use nvpool_api::scrape;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::engine::Engine;
use crate::nvme::stats::{DetailedStats, ERROR_CLASSES, LATENCY_BOUNDS_NS, Op};
use crate::reactor::ReactorTime;
use crate::upgrade::process::wait_readable;

/// Binds `addr` and serves scrapes on a thread of their own; returns the bound address.
pub fn serve(engine: Arc<Engine>, addr: SocketAddr) -> Result<SocketAddr, String> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| format!("cannot listen for metrics on {addr}: {e}; pass --metrics-listen another address"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("nvpool-metrics".into())
        .spawn(move || serve_on(&engine, listener))
        .map_err(|e| format!("cannot start the metrics thread: {e}"))?;
    Ok(bound)
}

/// After a hot upgrade: the old process lets go of `addr` as it exits, so a thread
/// tries for a while, then serves it.
pub fn serve_once_free(engine: Arc<Engine>, addr: SocketAddr) {
    let spawned = std::thread::Builder::new().name("nvpool-metrics".into()).spawn(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match TcpListener::bind(addr) {
                Ok(listener) => return serve_on(&engine, listener),
                Err(e) if std::time::Instant::now() >= deadline => {
                    return tracing::warn!("no metrics: cannot listen on {addr} after the upgrade: {e}");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!("no metrics: cannot start the metrics thread: {e}");
    }
}

/// Answers scrapes one at a time (as Prometheus scrapes; a stuck client times out)
/// until a hot upgrade hands the engine over: the listener then closes, so the new
/// process can take the address.
fn serve_on(engine: &Engine, listener: TcpListener) {
    loop {
        if !wait_readable(listener.as_raw_fd(), Duration::from_millis(200)) {
            if engine.handed_over() {
                return;
            }
            continue;
        }
        if engine.handed_over() {
            return;
        }
        if let Ok((stream, _)) = listener.accept() {
            let _ = answer(engine, stream);
        }
    }
}

/// Reads one HTTP/1.x request and answers it, then closes the connection.
fn answer(engine: &Engine, mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !scrape::head_complete(&head) {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    stream.write_all(scrape::reply(&head, || render(Snapshot::of(engine))).as_bytes())
}

/// One namespace's figures.
#[derive(Debug)]
struct NamespaceFigures {
    subsystem: String,
    nsid: u32,
    backend: String,
    size_bytes: u64,
    qos: nvpool_api::QosLimits,
    stats: DetailedStats,
    /// A mirror's legs: in sync, catching up, faulted.
    replicas: Option<[u64; 3]>,
    /// A rebuild's bytes copied and to copy, while one runs or after it ended.
    rebuild: Option<(u64, u64)>,
}

/// What a scrape reports, gathered from the engine at once.
#[derive(Debug)]
struct Snapshot {
    namespaces: Vec<NamespaceFigures>,
    /// Controllers per subsystem.
    controllers: Vec<(String, usize)>,
    connections: usize,
    reactors: Vec<ReactorTime>,
    pools: Vec<PoolInfo>,
}

impl Snapshot {
    fn of(engine: &Engine) -> Snapshot {
        let target = engine.target();
        let mut namespaces = Vec::new();
        let mut controllers = Vec::new();
        for s in target.subsystems().into_iter().filter(|s| !s.is_discovery()) {
            controllers.push((s.nqn.clone(), s.controllers().len()));
            for ns in s.namespaces().values() {
                namespaces.push(NamespaceFigures {
                    subsystem: s.nqn.clone(),
                    nsid: ns.nsid,
                    backend: ns.backend.description(),
                    size_bytes: ns.blocks << ns.block_shift,
                    qos: ns.qos.limits(),
                    stats: ns.stats.detailed(),
                    replicas: ns.backend.as_mirror().map(|m| m.leg_counts()),
                    rebuild: Some(engine.rebuilds.info(&s.nqn, ns.nsid))
                        .filter(|r| r.state != "none")
                        .map(|r| (r.copied_bytes, r.total_bytes)),
                });
            }
        }
        Snapshot {
            namespaces,
            controllers,
            connections: target.connection_count(),
            reactors: engine.reactor_times(),
            pools: engine.pools.list(),
        }
    }
}

/// The Prometheus text of a snapshot.
fn render(snapshot: Snapshot) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(SnapshotCollector(snapshot)));
    let mut out = String::new();
    // Writing into a String does not fail.
    let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &registry);
    out
}

#[derive(Debug)]
struct SnapshotCollector(Snapshot);

type Labels = Vec<(&'static str, String)>;

/// A family's name, help, unit and type.
type Descriptor<'a> = (&'a str, &'a str, Option<Unit>, MetricType);

/// A family read from each item of a list: name, help, unit, and the reading.
type Reading<T> = (&'static str, &'static str, Option<Unit>, fn(&T) -> u64);

/// A metric family: its name, help, unit and type, and one value per label set.
fn family<V: Copy>(
    encoder: &mut DescriptorEncoder,
    (name, help, unit, kind): Descriptor,
    values: impl IntoIterator<Item = (Labels, V)>,
    mut encode: impl FnMut(&mut MetricEncoder, V) -> Result<(), std::fmt::Error>,
) -> Result<(), std::fmt::Error> {
    let mut metric = encoder.encode_descriptor(name, help, unit.as_ref(), kind)?;
    for (labels, value) in values {
        let mut m = metric.encode_family(&labels)?;
        encode(&mut m, value)?;
    }
    Ok(())
}

fn counter(m: &mut MetricEncoder, v: u64) -> Result<(), std::fmt::Error> {
    m.encode_counter::<NoLabelSet, _, u64>(&v, None)
}

fn counter_seconds(m: &mut MetricEncoder, ns: u64) -> Result<(), std::fmt::Error> {
    m.encode_counter::<NoLabelSet, _, f64>(&(ns as f64 / 1e9), None)
}

fn gauge(m: &mut MetricEncoder, v: i64) -> Result<(), std::fmt::Error> {
    m.encode_gauge(&v)
}

impl prometheus_client::collector::Collector for SnapshotCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let e = &mut encoder;
        let ns_labels = |n: &NamespaceFigures| -> Labels {
            vec![("subsystem", n.subsystem.clone()), ("nsid", n.nsid.to_string()), ("backend", n.backend.clone())]
        };
        family(
            e,
            ("nvpool_engine_build", "The engine's version and process ID", None, MetricType::Info),
            [(Labels::new(), crate::version::version())],
            // The process, so that a scrape says which side of a hot upgrade answered.
            |m, version| m.encode_info(&[("version", version.to_string()), ("pid", std::process::id().to_string())]),
        )?;
        let per_ns = |f: fn(&DetailedStats) -> u64| s.namespaces.iter().map(move |n| (ns_labels(n), f(&n.stats)));
        let counters: [Reading<DetailedStats>; 5] = [
            ("nvpool_namespace_reads_completed", "Reads completed successfully", None, |d| d.totals.reads),
            ("nvpool_namespace_writes_completed", "Writes completed successfully", None, |d| d.totals.writes),
            (
                "nvpool_namespace_other_completed",
                "Flush, write zeroes and dataset management commands completed successfully",
                None,
                |d| d.totals.others,
            ),
            ("nvpool_namespace_read", "Bytes read", Some(Unit::Bytes), |d| d.totals.read_bytes),
            ("nvpool_namespace_written", "Bytes written", Some(Unit::Bytes), |d| d.totals.write_bytes),
        ];
        for (name, help, unit, f) in counters {
            family(e, (name, help, unit, MetricType::Counter), per_ns(f), counter)?;
        }
        family(
            e,
            (
                "nvpool_namespace_errors",
                "Commands that failed, by status (path_error: ANA inaccessible, in transition or lost)",
                None,
                MetricType::Counter,
            ),
            s.namespaces.iter().flat_map(|n| {
                ERROR_CLASSES.iter().zip(n.stats.errors_by_class).map(move |(class, count)| {
                    let mut l = ns_labels(n);
                    l.push(("status", class.to_string()));
                    (l, count)
                })
            }),
            counter,
        )?;
        family(
            e,
            (
                "nvpool_namespace_throttled",
                "Commands that waited for the namespace's I/O limits",
                None,
                MetricType::Counter,
            ),
            per_ns(|d| d.throttled),
            counter,
        )?;
        family(
            e,
            (
                "nvpool_namespace_qos_limit",
                "The namespace's I/O limits per second, by limit (iops, read_iops, write_iops, bps, read_bps, \
                 write_bps); a limit not set is not reported",
                None,
                MetricType::Gauge,
            ),
            s.namespaces.iter().flat_map(|n| {
                let q = n.qos;
                let limits = [
                    ("iops", q.iops),
                    ("read_iops", q.read_iops),
                    ("write_iops", q.write_iops),
                    ("bps", q.bps),
                    ("read_bps", q.read_bps),
                    ("write_bps", q.write_bps),
                ];
                limits.into_iter().filter(|(_, v)| *v != 0).map(move |(limit, v)| {
                    let mut l = ns_labels(n);
                    l.push(("limit", limit.to_string()));
                    (l, v.min(i64::MAX as u64) as i64)
                })
            }),
            gauge,
        )?;
        family(
            e,
            ("nvpool_namespace_io_now", "Commands in progress", None, MetricType::Gauge),
            per_ns(|d| d.in_flight).map(|(l, v)| (l, v as i64)),
            gauge,
        )?;
        family(
            e,
            (
                "nvpool_namespace_replicas",
                "A mirrored namespace's replicas by state (in_sync, catching_up, faulted)",
                None,
                MetricType::Gauge,
            ),
            s.namespaces.iter().flat_map(|n| {
                let states = ["in_sync", "catching_up", "faulted"];
                n.replicas.into_iter().flat_map(move |counts| {
                    states.into_iter().zip(counts).map(move |(state, count)| {
                        let mut l = ns_labels(n);
                        l.push(("state", state.to_string()));
                        (l, count as i64)
                    })
                })
            }),
            gauge,
        )?;
        family(
            e,
            (
                "nvpool_namespace_rebuild",
                "A replica's rebuild: bytes copied (part=copied) of those to copy (part=total)",
                Some(Unit::Bytes),
                MetricType::Gauge,
            ),
            s.namespaces.iter().flat_map(|n| {
                n.rebuild.into_iter().flat_map(move |(copied, total)| {
                    [("copied", copied), ("total", total)].map(|(part, v)| {
                        let mut l = ns_labels(n);
                        l.push(("part", part.to_string()));
                        (l, v as i64)
                    })
                })
            }),
            gauge,
        )?;
        family(
            e,
            ("nvpool_namespace_size", "Namespace size", Some(Unit::Bytes), MetricType::Gauge),
            s.namespaces.iter().map(|n| (ns_labels(n), n.size_bytes as i64)),
            gauge,
        )?;
        family(
            e,
            (
                "nvpool_namespace_latency",
                "Time from the reactor pass that received a command to the pass that answered it",
                Some(Unit::Seconds),
                MetricType::Histogram,
            ),
            s.namespaces.iter().flat_map(|n| {
                Op::ALL.into_iter().map(move |op| {
                    let mut l = ns_labels(n);
                    l.push(("op", op.name().to_string()));
                    (l, (n, op))
                })
            }),
            |m, (n, op)| {
                let h = &n.stats.latency[op as usize];
                let buckets: Vec<(f64, u64)> =
                    LATENCY_BOUNDS_NS.iter().map(|&b| b as f64 / 1e9).chain([f64::INFINITY]).zip(h.buckets).collect();
                m.encode_histogram::<NoLabelSet>(h.sum_ns as f64 / 1e9, h.count(), &buckets, None)
            },
        )?;
        family(
            e,
            ("nvpool_subsystem_controllers", "Controllers (host connections to a subsystem)", None, MetricType::Gauge),
            s.controllers.iter().map(|(nqn, n)| (vec![("subsystem", nqn.clone())], *n as i64)),
            gauge,
        )?;
        family(
            e,
            ("nvpool_connections", "NVMe/TCP connections open", None, MetricType::Gauge),
            [(Labels::new(), s.connections as i64)],
            gauge,
        )?;
        let per_reactor = |f: fn(&ReactorTime) -> u64| {
            s.reactors.iter().enumerate().map(move |(i, t)| (vec![("reactor", i.to_string())], f(t)))
        };
        family(
            e,
            (
                "nvpool_reactor_busy",
                "Time reactors spent on work: passes that completed something",
                Some(Unit::Seconds),
                MetricType::Counter,
            ),
            per_reactor(|t| t.busy_ns),
            counter_seconds,
        )?;
        family(
            e,
            (
                "nvpool_reactor_idle",
                "Time reactors spent asleep or polling with nothing to do",
                Some(Unit::Seconds),
                MetricType::Counter,
            ),
            per_reactor(|t| t.idle_ns),
            counter_seconds,
        )?;
        family(
            e,
            ("nvpool_reactor_connections", "NVMe/TCP connections a reactor serves", None, MetricType::Gauge),
            per_reactor(|t| t.connections).map(|(l, v)| (l, v as i64)),
            gauge,
        )?;
        family(
            e,
            (
                "nvpool_reactor_throttled_commands",
                "Commands waiting on a reactor for their namespace's I/O budget",
                None,
                MetricType::Gauge,
            ),
            per_reactor(|t| t.throttled).map(|(l, v)| (l, v as i64)),
            gauge,
        )?;
        let pool_gauges: [Reading<PoolInfo>; 8] = [
            ("nvpool_pool_capacity", "Data space of the pool", Some(Unit::Bytes), |p| p.capacity_bytes),
            ("nvpool_pool_used", "Space allocated to volumes", Some(Unit::Bytes), |p| p.used_bytes),
            ("nvpool_pool_free", "Space free", Some(Unit::Bytes), |p| p.free_bytes),
            (
                "nvpool_pool_provisioned",
                "Sum of the volumes' sizes (above the capacity when thin volumes overcommit)",
                Some(Unit::Bytes),
                |p| p.provisioned_bytes,
            ),
            ("nvpool_pool_volumes", "Volumes in the pool", None, |p| p.volumes as u64),
            ("nvpool_pool_journal_size", "Bytes the metadata journal holds", Some(Unit::Bytes), |p| {
                p.journal.size_bytes
            }),
            (
                "nvpool_pool_journal_used",
                "Bytes of the metadata journal in use since its last checkpoint",
                Some(Unit::Bytes),
                |p| p.journal.used_bytes,
            ),
            ("nvpool_pool_metadata_generation", "The metadata's checkpoint generation", None, |p| p.journal.generation),
        ];
        for (name, help, unit, f) in pool_gauges {
            family(
                e,
                (name, help, unit, MetricType::Gauge),
                s.pools.iter().map(|p| (vec![("pool", p.name.clone())], f(p) as i64)),
                gauge,
            )?;
        }
        let pool_counters: [Reading<PoolInfo>; 2] = [
            (
                "nvpool_pool_journal_entries",
                "Metadata journal entries written (one durable write each) since the engine opened the pool",
                None,
                |p| p.journal.entries,
            ),
            ("nvpool_pool_checkpoints", "Metadata checkpoints written since the engine opened the pool", None, |p| {
                p.journal.checkpoints
            }),
        ];
        for (name, help, unit, f) in pool_counters {
            family(
                e,
                (name, help, unit, MetricType::Counter),
                s.pools.iter().map(|p| (vec![("pool", p.name.clone())], f(p))),
                counter,
            )?;
        }
        family(
            e,
            ("nvpool_pool_failed", "1 when the pool stopped accepting changes", None, MetricType::Gauge),
            s.pools.iter().map(|p| (vec![("pool", p.name.clone())], i64::from(p.failed.is_some()))),
            gauge,
        )?;
        Ok(())
    }
}

//! The Prometheus endpoint: what it reports after known I/O, and how it answers HTTP.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use nvpool_engine::config::{EngineConfig, SubsystemConfig};
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:metrics";
const HOST: &str = "nqn.2024-01.io.nvpool:host-m";

fn get(addr: SocketAddr, request: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    let (head, body) = reply.split_once("\r\n\r\n").expect("an HTTP reply");
    (head.to_string(), body.to_string())
}

/// The value of the sample whose name and labels start as `prefix` says.
fn sample(body: &str, prefix: &str) -> f64 {
    let line = body.lines().find(|l| l.starts_with(prefix)).unwrap_or_else(|| panic!("no {prefix} in:\n{body}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn counts_agree_with_the_io_done() {
    let cfg = EngineConfig {
        reactors: Some(2),
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: true,
            hosts: vec![],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces: vec![namespace("memory:16MiB", 4096)],
        }],
        ..EngineConfig::default()
    };
    let t = TestEngine::start(&cfg);
    let metrics = nvpool_engine::metrics::serve(t.engine.clone(), "127.0.0.1:0".parse().unwrap()).unwrap();

    let o = ConnectOptions::admin(NQN, HOST);
    let mut admin = connect_admin(t.addr, &o).unwrap();
    admin.set_queue_count(1).unwrap();
    let mut q = Queue::connect(t.addr, &o.io(1, admin.cntlid, 31)).unwrap();
    for i in 0..10u64 {
        q.write(1, i * 2, &pattern(i, 8192), 4096, 8192).unwrap();
    }
    for i in 0..7u64 {
        assert_eq!(q.read(1, i * 2, 2, 4096).unwrap(), pattern(i, 8192));
    }
    q.flush(1).unwrap();
    // Past the namespace's end: refused before it starts, counted by status.
    assert!(q.read(1, (16 << 20) / 4096, 1, 4096).is_err());

    // Reactors publish their connection counts with their timers (every 100 ms).
    std::thread::sleep(std::time::Duration::from_millis(300));
    let (head, body) = get(metrics, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("Content-Type: text/plain; version=0.0.4"), "{head}");
    let ns = format!("{{subsystem=\"{NQN}\",nsid=\"1\",backend=\"memory:16777216\"");
    assert_eq!(sample(&body, &format!("nvpool_namespace_writes_completed_total{ns}")), 10.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_reads_completed_total{ns}")), 7.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_other_completed_total{ns}")), 1.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_written_bytes_total{ns}")), 81920.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_read_bytes_total{ns}")), 57344.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_errors_total{ns},status=\"lba_out_of_range\"")), 1.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_io_now{ns}")), 0.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_size_bytes{ns}")), (16u64 << 20) as f64);
    // Every read is in the histogram, and the +Inf bucket holds them all.
    assert_eq!(sample(&body, &format!("nvpool_namespace_latency_seconds_count{ns},op=\"read\"")), 7.0);
    assert_eq!(sample(&body, &format!("nvpool_namespace_latency_seconds_bucket{ns},op=\"write\",le=\"+Inf\"")), 10.0);
    assert_eq!(sample(&body, &format!("nvpool_subsystem_controllers{{subsystem=\"{NQN}\"}}")), 1.0);
    assert_eq!(sample(&body, "nvpool_connections "), 2.0);
    assert!(sample(&body, "nvpool_reactor_busy_seconds_total{reactor=\"0\"}") >= 0.0);
    let per_reactor = |r: u32| sample(&body, &format!("nvpool_reactor_connections{{reactor=\"{r}\"}}"));
    assert_eq!(per_reactor(0) + per_reactor(1), 2.0, "the admin and I/O queues, on their reactors");
    assert_eq!(sample(&body, "nvpool_reactor_throttled_commands{reactor=\"0\"}"), 0.0);
    assert!(sample(&body, "nvpool_reactor_idle_seconds_total{reactor=\"1\"}") > 0.0);
    assert!(body.contains("# TYPE nvpool_namespace_latency_seconds histogram"), "{body}");
    let build = format!(
        "nvpool_engine_build_info{{version=\"{}\",pid=\"{}\"}} 1",
        nvpool_engine::version(),
        std::process::id()
    );
    assert!(body.contains(&build), "{body}");

    let (head, _) = get(metrics, "GET / HTTP/1.1\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    let (head, _) = get(metrics, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");
}

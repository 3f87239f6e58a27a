//! `nvpool bench` and `nvpool responder`: the load generator and the protocol-minimal
//! target it is measured against.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use crate::output::{human, parse_size, render};

#[derive(Args)]
pub struct BenchArgs {
    /// Target address, IP:PORT.
    #[arg(long)]
    target: SocketAddr,
    /// Subsystem NQN (not used with --bare).
    #[arg(long, required_unless_present = "bare")]
    nqn: Option<String>,
    /// Drive a bare request/response loop (`nvpool responder --bare`) instead of
    /// NVMe/TCP: the same message sizes with no protocol, the machine's own limit.
    #[arg(long)]
    bare: bool,
    /// Host NQN to present.
    #[arg(long, default_value = "nqn.2024-01.io.nvpool:bench")]
    hostnqn: String,
    /// Namespace ID.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    /// randread, randwrite, read, write or randrw.
    #[arg(long, default_value = "randread")]
    workload: nvpool_bench::load::Workload,
    /// Percent reads for randrw.
    #[arg(long, default_value_t = 70)]
    rwmixread: u8,
    /// I/O size (512 B to 1 MiB; the target's MDTS applies), e.g. 4k or 128KiB.
    #[arg(long, default_value = "4k", value_parser = parse_io_size)]
    bs: u32,
    /// Commands in flight per connection.
    #[arg(long, default_value_t = 32)]
    qd: u32,
    /// I/O queues, one TCP connection each.
    #[arg(long, default_value_t = 1)]
    connections: u32,
    /// Measured seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds run before measuring.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// CPU to pin the generator to.
    #[arg(long)]
    core: Option<usize>,
    /// Stamp written blocks and check every block read back.
    #[arg(long)]
    verify: bool,
    /// Header and data digests.
    #[arg(long)]
    digests: bool,
    /// Use only the first SIZE bytes of the namespace.
    #[arg(long, value_parser = parse_size)]
    span: Option<u64>,
    /// Also report IOPS and the slowest I/O of every window of this many milliseconds.
    #[arg(long)]
    timeline_ms: Option<u64>,
    /// Keep SQ flow control on, as the Linux host does unless told `disable_sqflow`:
    /// each read is then answered with C2HData and a response capsule, two PDUs
    /// (the default asks for one, as SPDK's host does).
    #[arg(long)]
    sq_flow_control: bool,
    /// Sleep this many microseconds whenever nothing arrived, instead of polling:
    /// leaves the CPU to what shares it, at some latency (a throttled volume's load
    /// run beside the one measured).
    #[arg(long)]
    nap_us: Option<u64>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ResponderArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:4420")]
    listen: SocketAddr,
    /// CPU to pin the responder to.
    #[arg(long)]
    core: Option<usize>,
    /// Block size of the namespace it pretends to serve.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// Serve the bare request/response loop (for `nvpool bench --bare`) instead of
    /// NVMe/TCP.
    #[arg(long)]
    bare: bool,
}

fn parse_io_size(s: &str) -> Result<u32, String> {
    let v = parse_size(s)?;
    if !(512..=1 << 20).contains(&v) {
        return Err(format!("{s}: the I/O size must be 512 B to 1 MiB"));
    }
    Ok(v as u32)
}

fn pin(core: Option<usize>) -> Result<(), String> {
    match core {
        Some(c) => nvpool_engine::cpu::pin_current_thread(c).map_err(|e| format!("cannot pin to CPU {c}: {e}")),
        None => Ok(()),
    }
}

pub fn run_bench(a: BenchArgs) -> Result<(), String> {
    pin(a.core)?;
    let (warmup, duration) = (Duration::from_secs_f64(a.warmup), Duration::from_secs_f64(a.duration));
    let report = match a.nqn.clone() {
        _ if a.bare => {
            if a.workload != nvpool_bench::load::Workload::RandRead || a.connections != 1 || a.verify || a.digests {
                return Err("--bare measures one connection of read-sized answers: drop --workload, \
                            --connections, --verify and --digests"
                    .into());
            }
            nvpool_bench::bare::run(a.target, a.bs, a.qd, warmup, duration)?
        }
        Some(nqn) => bench_nvme(&a, nqn, warmup, duration)?,
        None => return Err("give --nqn NQN of the subsystem to drive (or --bare)".into()),
    };
    print_report(&report, a.json);
    if report.errors > 0 || report.verify_failures > 0 {
        return Err(format!("{} I/O errors and {} verify failures", report.errors, report.verify_failures));
    }
    Ok(())
}

fn bench_nvme(
    a: &BenchArgs,
    nqn: String,
    warmup: Duration,
    duration: Duration,
) -> Result<nvpool_bench::load::Report, String> {
    let o = nvpool_bench::load::Options {
        target: a.target,
        nqn,
        hostnqn: a.hostnqn.clone(),
        nsid: a.nsid,
        workload: a.workload,
        rwmixread: a.rwmixread,
        io_size: a.bs,
        queue_depth: a.qd,
        connections: a.connections,
        duration,
        warmup,
        verify: a.verify,
        digests: nvpool_wire::tcp::Digests { header: a.digests, data: a.digests },
        span: a.span,
        timeline: a.timeline_ms.map(Duration::from_millis),
        sq_flow_control: a.sq_flow_control,
        nap: a.nap_us.map(std::time::Duration::from_micros),
    };
    nvpool_bench::load::run(&o)
}

fn print_report(r: &nvpool_bench::load::Report, json: bool) {
    if json {
        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
    } else {
        let rows = vec![
            [
                "WORKLOAD",
                "BS",
                "QD",
                "CONNS",
                "IOPS",
                "MiB/s",
                "MEAN us",
                "P50 us",
                "P99 us",
                "P99.9 us",
                "MAX us",
                "ERRORS",
                "VERIFY FAIL",
            ]
            .map(String::from)
            .to_vec(),
            vec![
                format!("{:?}", r.workload).to_lowercase(),
                human(u64::from(r.io_size)),
                r.queue_depth.to_string(),
                r.connections.to_string(),
                format!("{:.0}", r.iops),
                format!("{:.1}", r.mib_per_s),
                format!("{:.1}", r.latency.mean_us),
                format!("{:.1}", r.latency.p50_us),
                format!("{:.1}", r.latency.p99_us),
                format!("{:.1}", r.latency.p999_us),
                format!("{:.1}", r.latency.max_us),
                r.errors.to_string(),
                r.verify_failures.to_string(),
            ],
        ];
        println!("{}", render(&rows));
        if !r.timeline.is_empty() {
            let mut rows = vec![["AT s", "IOPS", "MAX us"].map(String::from).to_vec()];
            for w in &r.timeline {
                rows.push(vec![format!("{:.1}", w.at_s), format!("{:.0}", w.iops), format!("{:.0}", w.max_us)]);
            }
            println!("\n{}", render(&rows));
        }
    }
}

pub fn run_responder(a: ResponderArgs) -> Result<(), String> {
    pin(a.core)?;
    let stop = std::sync::atomic::AtomicBool::new(false);
    if a.bare {
        let listener =
            std::net::TcpListener::bind(a.listen).map_err(|e| format!("cannot listen on {}: {e}", a.listen))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        println!("nvpool bare request/response loop on {}", a.listen);
        nvpool_bench::bare::serve(&listener, &stop);
        return Ok(());
    }
    let o = nvpool_bench::responder::ResponderOptions { block_size: a.block_size, size: 1 << 40 };
    let r = nvpool_bench::responder::Responder::bind(a.listen, &o)?;
    println!("nvpool responder on {} (namespace 1: 1 TiB of {}-byte blocks)", r.local_addr(), a.block_size);
    r.run(&stop);
    Ok(())
}

//! Connection storms against a real engine process: in bounded rounds, hundreds of
//! hosts connect at once, do a little I/O, and vanish in every way a host can (clean
//! disconnect, mid-command, with an R2T outstanding, after garbage, before ICReq). The
//! engine's resident memory must be flat after the first round, back where it was
//! before the storm, and every connection and controller released.

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nvpool_api::GetEngineInfo;
use nvpool_control::testkit::free_port;
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use nvpool_wire::command::{Command as Sqe, io_opcode};

const BIN: &str = env!("CARGO_BIN_EXE_nvpool");
const NQN: &str = "nqn.2024-01.io.nvpool:storm";
const HOST: &str = "nqn.2024-01.io.nvpool:storm-host";
/// Controllers per round; each has an admin queue and two I/O queues.
const CONTROLLERS_PER_ROUND: usize = 120;
/// Threads opening them, so that many are open at once.
const THREADS: usize = 6;
const ROUNDS: usize = 8;
/// What resident memory may grow by after the first round: allocator noise, not a
/// per-connection leak (a leak of even 4 KiB per connection would exceed it).
const SLACK_KIB: u64 = 4096;

struct Engine(Child);

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// What a host keeps open until the whole round is connected; dropping it is the
/// host vanishing.
#[derive(Default)]
struct Open {
    _queues: Vec<Queue>,
    _raw: Option<TcpStream>,
}

/// One host: connects, does I/O, and is left in a state that depends on `kind`; it
/// vanishes when the returned connections are dropped.
fn host(addr: SocketAddr, kind: usize) -> Open {
    match kind % 6 {
        // Garbage after the handshake.
        4 => {
            let mut q = Queue::handshake(addr, Default::default()).expect("handshake");
            let _ = q.stream().write_all(&pattern(kind as u64, 3000));
            Open { _queues: vec![q], ..Open::default() }
        }
        // Connected, no ICReq.
        5 => Open { _raw: TcpStream::connect(addr).ok(), ..Open::default() },
        _ => {
            let o = ConnectOptions::admin(NQN, HOST);
            let mut admin = connect_admin(addr, &o).expect("admin connect");
            admin.set_queue_count(2).unwrap();
            let mut io: Vec<Queue> =
                (1..=2).map(|qid| Queue::connect(addr, &o.io(qid, admin.cntlid, 63)).expect("I/O connect")).collect();
            let lba = (kind as u64 % 512) * 256;
            io[0].write(1, lba, &pattern(kind as u64, 65536), 512, 0).unwrap();
            assert_eq!(io[1].read(1, lba, 128, 512).unwrap(), pattern(kind as u64, 65536));
            match kind % 6 {
                // Leaves with a 128 KiB read in flight.
                1 => {
                    let cid = io[0].alloc_cid();
                    io[0].submit(Sqe::read_write(io_opcode::READ, cid, 1, 0, 256, 131072), &[], false).unwrap();
                }
                // Leaves with an R2T outstanding: the engine holds a buffer for it.
                2 => {
                    let cid = io[1].alloc_cid();
                    let w = Sqe::read_write(io_opcode::WRITE, cid, 1, lba, 256, 131072);
                    let mut hdr = [0u8; nvpool_wire::tcp::MAX_HEADER_SIZE];
                    let n = nvpool_wire::tcp::encode_capsule_cmd(
                        &Sqe { flags: nvpool_wire::command::PSDT_SGL, ..w },
                        0,
                        io[1].digests(),
                        &mut hdr,
                    );
                    io[1].stream().write_all(&hdr[..n]).unwrap();
                }
                // Many commands queued and never read back.
                3 => {
                    for _ in 0..32 {
                        let cid = io[0].alloc_cid();
                        let _ = io[0].submit(Sqe::read_write(io_opcode::READ, cid, 1, 0, 8, 4096), &[], false);
                    }
                }
                _ => {}
            }
            io.push(admin);
            Open { _queues: io, ..Open::default() }
        }
    }
}

fn wait_drained(socket: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = nvpool_api::call(socket, &GetEngineInfo {}).expect("engine info");
        if info.connections == 0 && info.controllers == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "left behind: {} connections, {} controllers",
            info.connections,
            info.controllers
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn connection_storms_leave_the_engines_memory_flat() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("engine.sock");
    let port = free_port();
    // No busy polling: the test measures memory, and shares the cores with others.
    let child = Command::new(BIN)
        .args(["engine", "--listen", &format!("127.0.0.1:{port}"), "--discovery-port", "0", "--reactors", "2"])
        .args(["--busy-poll-us", "0", "--subsystem", NQN, "--namespace", "memory:64MiB", "--mgmt-socket"])
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let engine = Engine(child);
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while nvpool_api::call(&socket, &GetEngineInfo {}).is_err() {
        assert!(Instant::now() < deadline, "the engine did not start");
        std::thread::sleep(Duration::from_millis(50));
    }

    let idle = rss_kib(engine.0.id());
    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        // Every host of the round is connected at once, then all vanish together.
        let all_open = std::sync::Barrier::new(THREADS);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let all_open = &all_open;
                s.spawn(move || {
                    let open: Vec<Open> = (t..CONTROLLERS_PER_ROUND)
                        .step_by(THREADS)
                        .map(|i| host(addr, round * CONTROLLERS_PER_ROUND + i))
                        .collect();
                    all_open.wait();
                    drop(open);
                });
            }
        });
        wait_drained(&socket);
        // Reactors give idle buffers back on their next tick (every 100 ms); on a busy
        // machine a tick can come late, so the round's figure is the lowest of 2 s.
        let mut settled = u64::MAX;
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(200));
            settled = settled.min(rss_kib(engine.0.id()));
            if settled <= idle + SLACK_KIB {
                break;
            }
        }
        rss.push(settled);
    }
    // Connections per round: 4 of 6 hosts open 3 queues, the others one connection.
    let per_round = CONTROLLERS_PER_ROUND / 6 * (4 * 3 + 2);
    println!(
        "storm: {ROUNDS} rounds of {per_round} connections; engine RSS idle {idle} KiB, after each round (KiB): {rss:?}"
    );
    let first = rss[0];
    let worst = *rss.iter().max().unwrap();
    assert!(
        worst <= first + SLACK_KIB,
        "resident memory grew from {first} KiB after the first round to {worst} KiB: {rss:?}"
    );
    // And what the hosts took was given back: an idle engine holds what it held before.
    assert!(worst <= idle + SLACK_KIB, "idle at {idle} KiB, but {worst} KiB after the hosts left: {rss:?}");
}

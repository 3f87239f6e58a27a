//! Crash test of pools and volumes: the engine process is killed with SIGKILL at random
//! moments while hosts write, trim and flush a thin volume, then restarted from its
//! disks. Every write that was acknowledged and then flushed must read back intact
//! (a block may also hold a later write that was in flight or not yet flushed), the
//! pool's metadata must check clean, and no cluster may leak.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nvpool_control::testkit::free_port;
use nvpool_initiator::{ConnectOptions, Queue, connect_admin};

const BIN: &str = env!("CARGO_BIN_EXE_nvpool");
const NQN: &str = "nqn.2024-01.io.nvpool:crash";
const BLOCK: usize = 4096;
const CLUSTER_BLOCKS: u64 = 32; // 128 KiB clusters
const VOLUME_BLOCKS: u64 = 16384; // 64 MiB
const WRITERS: u64 = 3;
const ITERATIONS: usize = 24;

/// Values a block may hold: seeds of writes (0 is "zeroes").
type Model = BTreeMap<u64, Vec<u64>>;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn block_data(block: u64, seed: u64) -> Vec<u8> {
    if seed == 0 {
        return vec![0; BLOCK];
    }
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ block | 1);
    let mut v: Vec<u8> = (0..BLOCK / 8).flat_map(|_| r.next().to_le_bytes()).collect();
    v[..8].copy_from_slice(&block.to_le_bytes());
    v[8..16].copy_from_slice(&seed.to_le_bytes());
    v
}

fn seed_of(block: u64, data: &[u8]) -> Option<u64> {
    if data.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let seed = u64::from_le_bytes(data[8..16].try_into().unwrap());
    (block_data(block, seed) == data).then_some(seed)
}

fn cli(socket: &Path, args: &[&str]) -> String {
    let out = Process::new(BIN).arg("engine").args(args).arg("--socket").arg(socket).output().unwrap();
    assert!(out.status.success(), "nvpool {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn start_engine(dir: &Path, port: u16, disks: &[PathBuf], export: bool) -> Child {
    let socket = dir.join("sock");
    // No busy polling: these tests check behaviour, not speed, and share the machine's
    // cores with other tests and builds.
    let mut cmd = Process::new(BIN);
    cmd.args(["engine", "--listen", &format!("127.0.0.1:{port}"), "--discovery-port", "0", "--reactors", "2"])
        .args(["--busy-poll-us", "0", "--mgmt-socket"])
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if export {
        let list: Vec<String> = disks.iter().map(|d| d.display().to_string()).collect();
        cmd.args(["--pool", &list.join(","), "--subsystem", NQN, "--namespace", "volume:crash/v"]);
        cmd.args(["--block-size", "4096"]);
    }
    // The management socket answers once the engine is up, listeners included.
    let _ = std::fs::remove_file(&socket);
    let child = cmd.spawn().unwrap();
    let start = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "the engine did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn connect(addr: SocketAddr) -> Result<(Queue, Queue), nvpool_initiator::Error> {
    let o = ConnectOptions::admin(NQN, "nqn.2024-01.io.nvpool:crash-host");
    let mut admin = connect_admin(addr, &o)?;
    admin.set_queue_count(1)?;
    let io = Queue::connect(addr, &o.io(1, admin.cntlid, 31))?;
    Ok((admin, io))
}

/// One host thread's work on the clusters it owns, until the engine goes away. The
/// model gains a block's new value before the command is sent (it may land even if no
/// answer comes) and drops older values once a flush after it succeeds.
fn writer(addr: SocketAddr, id: u64, seed: u64, mut model: Model, stop: Arc<AtomicBool>) -> Model {
    // The engine may already be gone: then there is nothing to do.
    let Ok((_admin, mut q)) = connect(addr) else { return model };
    let mut rng = Rng(seed | 1);
    let mut latest: BTreeMap<u64, u64> = BTreeMap::new();
    let clusters = VOLUME_BLOCKS / CLUSTER_BLOCKS;
    while !stop.load(Ordering::Relaxed) {
        let cluster = rng.below(clusters / WRITERS) * WRITERS + id;
        let first = cluster * CLUSTER_BLOCKS;
        let ok = match rng.below(10) {
            0..=6 => {
                let start = first + rng.below(CLUSTER_BLOCKS);
                let n = rng.below(8).min(first + CLUSTER_BLOCKS - start - 1) + 1;
                let value = rng.next() | 1;
                let mut data = Vec::new();
                for b in start..start + n {
                    model.entry(b).or_insert_with(|| vec![0]).push(value);
                    data.extend(block_data(b, value));
                }
                let done = q.write(1, start, &data, BLOCK as u32, 8192).is_ok();
                if done {
                    latest.extend((start..start + n).map(|b| (b, value)));
                }
                done
            }
            7 => {
                let done = q.flush(1).is_ok();
                if done {
                    for (b, v) in std::mem::take(&mut latest) {
                        model.insert(b, vec![v]);
                    }
                }
                done
            }
            8 => {
                for b in first..first + CLUSTER_BLOCKS {
                    model.entry(b).or_insert_with(|| vec![0]).push(0);
                }
                let done = q.deallocate(1, first, CLUSTER_BLOCKS as u32).is_ok_and(|s| s.is_success());
                if done {
                    latest.extend((first..first + CLUSTER_BLOCKS).map(|b| (b, 0)));
                }
                done
            }
            _ => {
                let b = first + rng.below(CLUSTER_BLOCKS);
                match q.read(1, b, 1, BLOCK as u32) {
                    Ok(data) => {
                        let got = seed_of(b, &data);
                        let allowed = model.get(&b).cloned().unwrap_or_else(|| vec![0]);
                        assert!(
                            got.is_some_and(|s| allowed.contains(&s)),
                            "live read of block {b}: {got:?} not in {allowed:?}"
                        );
                        true
                    }
                    Err(_) => false,
                }
            }
        };
        if !ok {
            break;
        }
    }
    model
}

fn verify(addr: SocketAddr, model: &Model) -> usize {
    let (_admin, mut q) = connect(addr).expect("connect after restart");
    let mut checked = 0;
    for (&b, allowed) in model {
        let data = q.read(1, b, 1, BLOCK as u32).unwrap();
        let got = seed_of(b, &data);
        assert!(got.is_some_and(|s| allowed.contains(&s)), "block {b} after restart: {got:?} not in {allowed:?}");
        checked += 1;
    }
    checked
}

#[test]
fn acknowledged_flushed_writes_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let disks: Vec<PathBuf> = (0..2)
        .map(|i| {
            let p = dir.path().join(format!("disk{i}"));
            std::fs::File::create(&p).unwrap().set_len(48 << 20).unwrap();
            p
        })
        .collect();
    let socket = dir.path().join("sock");
    let port = free_port();
    let mut engine = start_engine(dir.path(), port, &disks, false);
    let list: Vec<&str> = disks.iter().map(|d| d.to_str().unwrap()).collect();
    cli(&socket, &[&["pool", "create", "crash"][..], &list, &["--cluster-size", "128KiB"]].concat());
    cli(&socket, &["volume", "create", "crash", "v", "64MiB", "--thin"]);
    engine.kill().unwrap();
    engine.wait().unwrap();

    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut models: Vec<Model> = vec![Model::new(); WRITERS as usize];
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let mut kills_mid_write = 0;
    for iteration in 0..ITERATIONS {
        let mut engine = start_engine(dir.path(), port, &disks, true);
        let checked = verify(addr, &models.iter().flatten().map(|(b, v)| (*b, v.clone())).collect());
        cli(&socket, &["pool", "check", "crash"]);
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = models
            .drain(..)
            .enumerate()
            .map(|(i, m)| {
                let (stop, seed) = (stop.clone(), rng.next());
                std::thread::spawn(move || writer(addr, i as u64, seed, m, stop))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(50 + rng.below(400)));
        engine.kill().unwrap();
        engine.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        models = threads.into_iter().map(|t| t.join().expect("a writer thread failed")).collect();
        kills_mid_write += 1;
        eprintln!("iteration {iteration}: {checked} blocks verified before the run");
    }
    let engine = start_engine(dir.path(), port, &disks, true);
    let checked = verify(addr, &models.iter().flatten().map(|(b, v)| (*b, v.clone())).collect());
    cli(&socket, &["pool", "check", "crash"]);
    let volumes = cli(&socket, &["volume", "list", "crash", "--json"]);
    let pools = cli(&socket, &["pool", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&volumes).unwrap();
    let p: serde_json::Value = serde_json::from_str(&pools).unwrap();
    // One volume: every used byte of the pool is a cluster of that volume.
    assert_eq!(v[0]["allocated_bytes"], p[0]["used_bytes"], "no cluster leaked");
    let touched: BTreeSet<u64> = models.iter().flat_map(|m| m.keys().copied()).collect();
    eprintln!("{kills_mid_write} kills; {checked} blocks verified at the end; {} blocks ever written", touched.len());
    assert!(checked > 1000, "the writers did too little to test anything");
    let mut engine = engine;
    engine.kill().unwrap();
    engine.wait().unwrap();
}

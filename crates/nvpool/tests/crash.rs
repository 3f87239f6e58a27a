//! Crash test of pools and volumes: the engine process is killed with SIGKILL at random
//! moments while hosts write, trim and flush a thin volume, then restarted from its
//! disks. Every write that was acknowledged and then flushed must read back intact
//! (a block may also hold a later write that was in flight or not yet flushed), the
//! pool's metadata must check clean, and no cluster may leak.
//!
//! Snapshots are taken and deleted meanwhile, some of them as the engine is killed:
//! a snapshot the engine confirmed (or one it made before it died) holds, for every
//! block, a value the volume could hold while the snapshot was taken, after any
//! number of later writes, kills and deletions, and a deletion either happened or not.
//! The volume is also inflated (made to hold whole every cluster it reads from its
//! snapshots, then to lie over none) in the background, which the kill may cut short:
//! it reads the same throughout, and so do its snapshots.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
/// Snapshots alive at once at most (a chain holds 16, hidden ones included).
const SNAPSHOTS: usize = 12;

/// Values a block may hold: seeds of writes (0 is "zeroes").
type Model = BTreeMap<u64, Vec<u64>>;

/// Every (block, value) the writers ever sent, in order: a snapshot may hold a value
/// written and overwritten (and flushed) while it was being taken, which the models,
/// keeping only what a block may hold now, have dropped by the time it answers.
type Sent = Arc<Mutex<Vec<(u64, u64)>>>;

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
    try_cli(socket, args).unwrap_or_else(|e| panic!("nvpool {args:?}: {e}"))
}

/// A management call that may meet an engine being killed.
fn try_cli(socket: &Path, args: &[&str]) -> Result<String, String> {
    let out = Process::new(BIN).arg("engine").args(args).arg("--socket").arg(socket).output().unwrap();
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
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
/// The model is shared, so that a snapshot can take what the volume may hold as it
/// is taken.
fn writer(addr: SocketAddr, id: u64, seed: u64, model: Arc<Mutex<Model>>, sent: Sent, stop: Arc<AtomicBool>) {
    // The engine may already be gone: then there is nothing to do.
    let Ok((_admin, mut q)) = connect(addr) else { return };
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
                let mut m = model.lock().unwrap();
                for b in start..start + n {
                    m.entry(b).or_insert_with(|| vec![0]).push(value);
                    sent.lock().unwrap().push((b, value));
                    data.extend(block_data(b, value));
                }
                drop(m);
                let done = q.write(1, start, &data, BLOCK as u32, 8192).is_ok();
                if done {
                    latest.extend((start..start + n).map(|b| (b, value)));
                }
                done
            }
            7 => {
                let done = q.flush(1).is_ok();
                if done {
                    let mut m = model.lock().unwrap();
                    for (b, v) in std::mem::take(&mut latest) {
                        m.insert(b, vec![v]);
                    }
                }
                done
            }
            8 => {
                let mut m = model.lock().unwrap();
                for b in first..first + CLUSTER_BLOCKS {
                    m.entry(b).or_insert_with(|| vec![0]).push(0);
                    sent.lock().unwrap().push((b, 0));
                }
                drop(m);
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
                        let allowed = model.lock().unwrap().get(&b).cloned().unwrap_or_else(|| vec![0]);
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
}

/// Reads back every block of `model` through namespace `nsid` (what: the volume or
/// a snapshot).
fn verify(addr: SocketAddr, nsid: u32, model: &Model, what: &str) -> usize {
    let (_admin, mut q) = connect(addr).expect("connect after restart");
    // Runs of consecutive blocks, a cluster at most, each in one read.
    let blocks: Vec<(&u64, &Vec<u64>)> = model.iter().collect();
    let runs = blocks.chunk_by(|a, b| *b.0 == *a.0 + 1 && *b.0 / CLUSTER_BLOCKS == *a.0 / CLUSTER_BLOCKS);
    let mut checked = 0;
    for run in runs {
        let data = q.read(nsid, *run[0].0, run.len() as u32, BLOCK as u32).unwrap();
        for (&(&b, allowed), data) in run.iter().zip(data.chunks(BLOCK)) {
            let got = seed_of(b, data);
            assert!(got.is_some_and(|s| allowed.contains(&s)), "block {b} of {what}: {got:?} not in {allowed:?}");
            checked += 1;
        }
    }
    checked
}

/// Every writer's model as one.
fn merged(models: &[Arc<Mutex<Model>>]) -> Model {
    models.iter().flat_map(|m| m.lock().unwrap().clone()).collect()
}

/// What a snapshot may hold of each block: what the volume could hold at some moment
/// between the call (`before`) and its answer (`after`); the caller adds what was
/// sent in between (`Sent`).
fn either(before: Model, after: Model) -> Model {
    let mut m = before;
    for (b, values) in after {
        m.entry(b).or_insert_with(|| vec![0]).extend(values);
    }
    m
}

/// What a run does besides writing.
#[derive(Clone, Copy)]
enum Action {
    /// Takes a snapshot.
    Take,
    /// Deletes one.
    Delete,
    /// Starts inflating the volume.
    Inflate,
}

/// A snapshot the test took, and what it may hold.
struct Snapshot {
    name: String,
    model: Model,
    /// Read back since it was taken (a snapshot whose call the kill cut short is
    /// known to exist only once the engine is back).
    verified: bool,
}

/// Names of the snapshots the engine has (a deleted one it keeps hidden is not one).
fn snapshots_on(socket: &Path) -> BTreeSet<String> {
    let list: serde_json::Value = serde_json::from_str(&cli(socket, &["volume", "list", "crash", "--json"])).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .filter(|v| v["snapshot"] == true)
        .map(|v| v["name"].as_str().unwrap().into())
        .collect()
}

/// Exports snapshot `name` as namespace 2 and reads back what its model says.
fn verify_snapshot(socket: &Path, addr: SocketAddr, s: &Snapshot) -> usize {
    let backend = format!("volume:crash/{}", s.name);
    cli(socket, &["namespace", "add", NQN, &backend, "--nsid", "2", "--block-size", "4096"]);
    let checked = verify(addr, 2, &s.model, &format!("snapshot {}", s.name));
    cli(socket, &["namespace", "remove", NQN, "2"]);
    checked
}

#[test]
fn acknowledged_flushed_writes_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let disks: Vec<PathBuf> = (0..2)
        .map(|i| {
            let p = dir.path().join(format!("disk{i}"));
            std::fs::File::create(&p).unwrap().set_len(256 << 20).unwrap();
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
    let models: Vec<Arc<Mutex<Model>>> = (0..WRITERS).map(|_| Arc::default()).collect();
    let sent: Sent = Arc::default();
    let mut snapshots: Vec<Snapshot> = Vec::new();
    let mut rng = Rng(0x5EED_1234_ABCD_0001);
    let (mut kills_mid_write, mut taken, mut deleted, mut cut_short, mut snapshot_blocks) = (0, 0, 0, 0, 0);
    let (mut inflations, mut inflated) = (0, 0);
    for iteration in 0..ITERATIONS {
        let mut engine = start_engine(dir.path(), port, &disks, true);
        let checked = verify(addr, 1, &merged(&models), "the volume");
        cli(&socket, &["pool", "check", "crash"]);
        // What the last run's snapshot calls did, whatever the engine answered.
        let on_engine = snapshots_on(&socket);
        snapshots.retain(|s| on_engine.contains(&s.name));
        for s in snapshots.iter_mut().filter(|s| !s.verified) {
            snapshot_blocks += verify_snapshot(&socket, addr, s);
            s.verified = true;
        }
        // Over none of its snapshots: an inflation that the kill did not cut short.
        let volume: serde_json::Value =
            serde_json::from_str(&cli(&socket, &["volume", "stats", "crash", "v", "--json"])).unwrap();
        inflated += usize::from(volume["parent"] == "" && !snapshots.is_empty());
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = models
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let (stop, seed, m, sent) = (stop.clone(), rng.next(), m.clone(), sent.clone());
                std::thread::spawn(move || writer(addr, i as u64, seed, m, sent, stop))
            })
            .collect();
        // Most runs take a snapshot, delete one or start inflating the volume while the
        // hosts write, at a moment that may be the kill's.
        let run_for = Duration::from_millis(50 + rng.below(400));
        let at = Duration::from_millis(rng.below(run_for.as_millis() as u64 + 50));
        // Inflation is the rarest call, and a kill before its answer does not count:
        // the last runs start one until two were answered, so every run covers them.
        let inflation_due = inflations < 2 && iteration + 6 >= ITERATIONS;
        let action = match rng.below(5) {
            _ if inflation_due && !snapshots.is_empty() => Some((Action::Inflate, "v".to_string())),
            0 | 1 if snapshots.len() < SNAPSHOTS => Some((Action::Take, format!("s{iteration}"))),
            4 if !snapshots.is_empty() => Some((Action::Inflate, "v".to_string())),
            _ => (!snapshots.is_empty())
                .then(|| (Action::Delete, snapshots[rng.below(snapshots.len() as u64) as usize].name.clone())),
        };
        let caller = action.clone().map(|(action, name)| {
            let (socket, models, sent) = (socket.clone(), models.clone(), sent.clone());
            std::thread::spawn(move || {
                std::thread::sleep(at);
                let first_sent = sent.lock().unwrap().len();
                let before = merged(&models);
                let verb: &[&str] = match action {
                    Action::Take => &["volume", "snapshot", "crash", "v"],
                    Action::Delete => &["volume", "delete", "crash"],
                    Action::Inflate => &["volume", "inflate", "crash"],
                };
                let answered = try_cli(&socket, &[verb, &[name.as_str()]].concat()).is_ok();
                let mut may_hold = either(before, merged(&models));
                for &(b, value) in &sent.lock().unwrap()[first_sent..] {
                    may_hold.entry(b).or_insert_with(|| vec![0]).push(value);
                }
                (answered, may_hold)
            })
        });
        std::thread::sleep(run_for);
        engine.kill().unwrap();
        engine.wait().unwrap();
        stop.store(true, Ordering::Relaxed);
        for t in threads {
            t.join().expect("a writer thread failed");
        }
        if let (Some((action, name)), Some(caller)) = (action, caller) {
            let (answered, model) = caller.join().unwrap();
            cut_short += usize::from(!answered);
            match action {
                Action::Take => {
                    taken += usize::from(answered);
                    snapshots.push(Snapshot { name, model, verified: false });
                }
                // A deletion the engine confirmed happened: the snapshot is gone.
                Action::Delete if answered => {
                    deleted += 1;
                    snapshots.retain(|s| s.name != name);
                }
                Action::Delete => {}
                Action::Inflate => inflations += usize::from(answered),
            }
        }

        kills_mid_write += 1;
        eprintln!("iteration {iteration}: {checked} blocks verified before the run; {} snapshots", snapshots.len());
    }
    let engine = start_engine(dir.path(), port, &disks, true);
    let checked = verify(addr, 1, &merged(&models), "the volume");
    cli(&socket, &["pool", "check", "crash"]);
    // Every snapshot still holds what it held when it was taken.
    let on_engine = snapshots_on(&socket);
    snapshots.retain(|s| on_engine.contains(&s.name));
    assert_eq!(on_engine.len(), snapshots.len(), "snapshots the test did not take: {on_engine:?}");
    for s in &snapshots {
        snapshot_blocks += verify_snapshot(&socket, addr, s);
    }
    // Inflated to the end: the volume lies over none of them, and they and it read
    // as before.
    let began = Instant::now();
    let volume: serde_json::Value =
        serde_json::from_str(&cli(&socket, &["volume", "inflate", "crash", "v", "--wait", "--json"])).unwrap();
    assert_eq!(volume["parent"], "", "inflated: {volume}");
    eprintln!("the volume inflated in {:.2} s", began.elapsed().as_secs_f64());
    assert_eq!(verify(addr, 1, &merged(&models), "the inflated volume"), checked);
    for s in &snapshots {
        verify_snapshot(&socket, addr, s);
    }
    cli(&socket, &["pool", "check", "crash"]);
    let volumes = cli(&socket, &["volume", "list", "crash", "--json"]);
    let pools = cli(&socket, &["pool", "list", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&volumes).unwrap();
    let p: serde_json::Value = serde_json::from_str(&pools).unwrap();
    // Every used byte of the pool is a cluster of the volume or one a snapshot holds
    // (those deleted too, while the volume lies over them).
    let live = v.as_array().unwrap().iter().find(|v| v["name"] == "v").unwrap();
    let owned = live["allocated_bytes"].as_u64().unwrap() + p[0]["snapshot_bytes"].as_u64().unwrap();
    assert_eq!(owned, p[0]["used_bytes"].as_u64().unwrap(), "no cluster leaked");
    let touched: BTreeSet<u64> = merged(&models).keys().copied().collect();
    eprintln!(
        "{kills_mid_write} kills; {checked} blocks verified at the end; {} blocks ever written; {taken} snapshots \
         taken, {deleted} deleted, {inflations} inflations started ({inflated} runs began with the volume \
         inflated), {cut_short} calls cut short by the kill, {} kept, {snapshot_blocks} of their blocks verified",
        touched.len(),
        snapshots.len()
    );
    assert!(checked > 1000, "the writers did too little to test anything");
    assert!(taken >= 4 && deleted >= 1, "too few snapshots were taken or deleted to test anything");
    assert!(inflations >= 2, "too few inflations to test anything");
    let mut engine = engine;
    engine.kill().unwrap();
    engine.wait().unwrap();
}

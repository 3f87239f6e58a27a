//! Processes of a small nvpool cluster on 127.0.0.1 for tests: engines with a
//! file-backed pool, node agents and controllers, each a real `nvpool` process.

#![allow(dead_code)] // each test binary uses a different part

use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_initiator::{ConnectOptions, HostAuth, Queue, connect_admin, pattern};
use nvpool_wire::identify::lba_format_block_size;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_nvpool");

pub use nvpool_control::testkit::free_port;

fn log(dir: &Path, name: &str) -> std::fs::File {
    std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{name}.log"))).unwrap()
}

/// Polls `f` until it returns `Some`, or fails the test after `limit`.
pub async fn wait_for<T>(what: &str, limit: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Prints the end of every process log under a test's directory if the test fails,
/// so that a failure on a CI machine says what the processes were doing. Declare it
/// after the directory, so that it is dropped first.
pub struct LogsOnFailure<'a>(pub &'a Path);

impl Drop for LogsOnFailure<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut logs: Vec<PathBuf> =
            walk(self.0).into_iter().filter(|p| p.extension().is_some_and(|e| e == "log")).collect();
        logs.sort();
        for path in logs {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(40)..];
            eprintln!("----- the last {} lines of {} -----\n{}", tail.len(), path.display(), tail.join("\n"));
        }
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() { out.extend(walk(&path)) } else { out.push(path) }
    }
    out
}

/// A child process killed (SIGKILL) when dropped.
pub struct Proc(Option<Child>);

impl Proc {
    pub fn kill(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
    pub fn pid(&self) -> u32 {
        self.0.as_ref().map_or(0, Child::id)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One node: an engine with one pool on a sparse file, and (when started) its agent.
pub struct Node {
    pub name: String,
    pub dir: PathBuf,
    pub nvme_port: u16,
    pub agent_port: u16,
    pub disk: PathBuf,
    /// A file holding the boot ID the engine sees instead of the machine's (bound over
    /// it in a mount namespace of its own): a new one is a reboot of the node.
    pub boot_id: Option<PathBuf>,
    pub engine: Proc,
    pub agent: Proc,
}

impl Node {
    /// Starts the engine and makes its pool of `size` bytes.
    pub fn new(root: &Path, name: &str, size: u64) -> Node {
        let disk = root.join(name).join("disk0");
        std::fs::create_dir_all(root.join(name)).unwrap();
        std::fs::File::create(&disk).unwrap().set_len(size).unwrap();
        Node::on_disk(root, name, disk, None)
    }

    /// Starts the engine (seeing boot ID `boot_id`'s, if given) and makes its pool on
    /// `disk`, which exists.
    pub fn on_disk(root: &Path, name: &str, disk: PathBuf, boot_id: Option<PathBuf>) -> Node {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let mut n = Node {
            name: name.into(),
            dir,
            nvme_port: free_port(),
            agent_port: free_port(),
            disk,
            boot_id,
            engine: Proc(None),
            agent: Proc(None),
        };
        n.start_engine(false);
        let out = Command::new(BIN)
            .args(["engine", "pool", "create", &format!("{name}-pool")])
            .arg(&n.disk)
            .arg("--socket")
            .arg(n.socket())
            .output()
            .unwrap();
        assert!(out.status.success(), "pool create: {}", String::from_utf8_lossy(&out.stderr));
        n
    }

    /// What the node's engine presents when it forwards to an owner: one per node,
    /// as on separate machines.
    pub fn host_nqn(&self) -> String {
        format!("nqn.2024-01.io.nvpool:test-engine:{}", self.name)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("engine.sock")
    }

    /// Starts the engine; `import` opens the pool made earlier.
    pub fn start_engine(&mut self, import: bool) {
        let socket = self.socket();
        let _ = std::fs::remove_file(&socket);
        // No busy polling: these tests check behaviour, not speed, and share the machine's
        // cores with other tests and builds.
        let mut cmd = match &self.boot_id {
            None => Command::new(BIN),
            Some(boot_id) => {
                let mut c = Command::new("unshare");
                c.args(["--mount", "sh", "-c", r#"mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@""#])
                    .arg(boot_id)
                    .arg(BIN);
                c
            }
        };
        cmd.args(["engine", "--listen", &format!("127.0.0.1:{}", self.nvme_port), "--discovery-port", "0"])
            .args(["--reactors", "1", "--busy-poll-us", "0", "--host-nqn", &self.host_nqn(), "--mgmt-socket"])
            .arg(&socket)
            .stdout(log(&self.dir, "engine"))
            .stderr(log(&self.dir, "engine"));
        if import {
            cmd.arg("--pool").arg(&self.disk);
        }
        self.engine = Proc(Some(cmd.spawn().unwrap()));
        let start = Instant::now();
        while std::os::unix::net::UnixStream::connect(&socket).is_err() {
            assert!(start.elapsed() < Duration::from_secs(20), "engine of {} did not start", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn start_agent(&mut self, controllers: &str) {
        self.start_agent_with(controllers, &[]);
    }

    /// Starts the agent with more arguments (e.g. `--tls-dir DIR`).
    pub fn start_agent_with(&mut self, controllers: &str, extra: &[&str]) {
        let child = Command::new(BIN)
            .args(["agent", "--name", &self.name, "--controller", controllers])
            .args(["--listen", &format!("127.0.0.1:{}", self.agent_port), "--engine-socket"])
            .arg(self.socket())
            .args(extra)
            .stdout(log(&self.dir, "agent"))
            .stderr(log(&self.dir, "agent"))
            .spawn()
            .unwrap();
        self.agent = Proc(Some(child));
    }

    /// Calls the engine's management API.
    pub fn engine_call<M: nvpool_api::Method>(&self, request: M) -> M::Reply {
        nvpool_api::call(&self.socket(), &request).unwrap()
    }
}

pub struct ControllerProc {
    pub address: String,
    pub proc: Proc,
}

/// Starts `nvpool controller` with the given store and fast health settings.
pub fn start_controller(dir: &Path, store: &str, port: u16, tag: &str) -> ControllerProc {
    start_controller_with(dir, store, port, tag, &[])
}

/// Starts `nvpool controller` with more arguments (e.g. `--tls-dir DIR`).
pub fn start_controller_with(dir: &Path, store: &str, port: u16, tag: &str, extra: &[&str]) -> ControllerProc {
    let address = format!("127.0.0.1:{port}");
    let child = Command::new(BIN)
        .args(["controller", "--listen", &address, "--store", store])
        .args(["--node-timeout", "3s", "--heartbeat-interval", "500ms", "--lease-ttl", "2s"])
        .args(extra)
        .stdout(log(dir, &format!("controller-{tag}")))
        .stderr(log(dir, &format!("controller-{tag}")))
        .spawn()
        .unwrap();
    ControllerProc { address, proc: Proc(Some(child)) }
}

pub async fn nodes(c: &Controllers) -> Vec<proto::Node> {
    c.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await.unwrap().nodes
}

pub async fn volumes(c: &Controllers) -> Vec<proto::Volume> {
    c.call(async |mut c| c.list_volumes(proto::ListVolumesRequest::default()).await).await.unwrap().volumes
}

/// Waits until the controller reports these nodes, and only these, as healthy.
pub async fn wait_healthy(c: &Controllers, names: &[&str]) {
    wait_for(&format!("healthy nodes {names:?}"), Duration::from_secs(30), async || {
        let healthy: Vec<String> = nodes(c).await.into_iter().filter(|n| n.healthy).map(|n| n.name).collect();
        (healthy == names).then_some(())
    })
    .await
}

pub fn create_request(name: &str, size: u64) -> proto::CreateVolumeRequest {
    proto::CreateVolumeRequest { name: name.into(), size_bytes: size, ..Default::default() }
}

// ----- a host with several paths, as the kernel's native multipath uses them ---------

/// The host NQN the test hosts present.
pub const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-1111-2222-3333-444455556666";
/// Block size of the volumes the controller exports (4 KiB).
pub const BLOCK: usize = 4096;
/// Status code type 3: path-related (ANA states), which a multipath host retries on
/// another path.
const PATH_RELATED: u8 = 3;

pub fn addr(n: &Node) -> SocketAddr {
    format!("127.0.0.1:{}", n.nvme_port).parse().unwrap()
}

/// One path of the host: an admin queue (which makes the host "connected") and an
/// I/O queue.
pub struct HostPath {
    admin: Queue,
    pub io: Queue,
}

pub fn connect(at: SocketAddr, nqn: &str) -> Option<HostPath> {
    let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(nqn, HOST) };
    let mut admin = connect_admin(at, &o).ok()?;
    admin.set_queue_count(1).ok()?;
    let io = Queue::connect(at, &o.io(1, admin.cntlid, 31)).ok()?;
    Some(HostPath { admin, io })
}

impl HostPath {
    /// Whether the path still answers (a Keep Alive on its admin queue).
    pub fn keep_alive(&mut self) -> bool {
        let keep_alive = nvpool_wire::command::Command {
            opcode: nvpool_wire::command::admin_opcode::KEEP_ALIVE,
            ..Default::default()
        };
        self.admin.execute(keep_alive, 0).is_ok()
    }
}

/// What each block holds: the seed of its last write.
pub type Model = Arc<Mutex<HashMap<u64, u64>>>;

/// Writes random blocks among the first `blocks` through the first path that works,
/// moving to the next when a path fails or answers with a path error (as the kernel's
/// multipath does), until stopped. Returns (writes, errors that reached the
/// "application").
pub fn host_writer(
    paths: Vec<SocketAddr>,
    nqn: String,
    model: Model,
    stop: Arc<AtomicBool>,
    blocks: u64,
) -> std::thread::JoinHandle<(u64, u64)> {
    host_writer_in(paths, nqn, model, stop, 0..blocks)
}

/// The same, writing the blocks of `range` only.
pub fn host_writer_in(
    paths: Vec<SocketAddr>,
    nqn: String,
    model: Model,
    stop: Arc<AtomicBool>,
    range: std::ops::Range<u64>,
) -> std::thread::JoinHandle<(u64, u64)> {
    std::thread::spawn(move || {
        let mut current = 0;
        let mut path = connect(paths[current], &nqn);
        let (mut n, mut errors) = (0u64, 0u64);
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        while !stop.load(Ordering::SeqCst) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let lba = range.start + x % (range.end - range.start);
            let seed = x | 1;
            let data = pattern(seed, BLOCK);
            let started = Instant::now();
            loop {
                let outcome = path.as_mut().map(|p| p.io.write(1, lba, &data, BLOCK as u32, 8192));
                match outcome {
                    Some(Ok(())) => {
                        model.lock().unwrap().insert(lba, seed);
                        break;
                    }
                    Some(Err(nvpool_initiator::Error::Command(s))) if s.code_type() != PATH_RELATED => {
                        errors += 1;
                        break;
                    }
                    // The path is gone or answered a path error: the next one.
                    _ => {
                        assert!(started.elapsed() < Duration::from_secs(60), "no path took the write for 60 s");
                        std::thread::sleep(Duration::from_millis(20));
                        current = (current + 1) % paths.len();
                        path = connect(paths[current], &nqn);
                    }
                }
            }
            n += 1;
        }
        (n, errors)
    })
}

/// Reads every block the model knows through `at` and fails naming each block that
/// does not hold its last write (and whether it reads as zeroes, never written).
pub fn verify(at: SocketAddr, nqn: &str, model: &Model, through: &str) {
    let mut p = connect(at, nqn).unwrap_or_else(|| panic!("connect through {through}"));
    let mut wrong = Vec::new();
    for (&lba, &seed) in model.lock().unwrap().iter() {
        let got = p.io.read(1, lba, 1, BLOCK as u32).unwrap_or_else(|e| panic!("read {lba} through {through}: {e}"));
        if got != pattern(seed, BLOCK) {
            let zeroes = got.iter().all(|&b| b == 0);
            wrong.push(format!("{lba}{}", if zeroes { " (zeroes)" } else { "" }));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} blocks through {through} are not what was last written: {}",
        wrong.len(),
        wrong.iter().take(20).cloned().collect::<Vec<_>>().join(", ")
    );
}

/// Keeps an admin connection to the volume's subsystem on every node that exports
/// it, as a host connects every path it is given: the controller switches a move only
/// once the host is connected to the target.
pub fn hold_paths(addrs: Vec<SocketAddr>, nqn: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut held: Vec<Option<HostPath>> = addrs.iter().map(|_| None).collect();
        while !stop.load(Ordering::SeqCst) {
            for (slot, &at) in held.iter_mut().zip(&addrs) {
                let alive = slot.as_mut().is_some_and(|p| p.keep_alive());
                if !alive {
                    *slot = connect(at, &nqn);
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    })
}

// ----- crash cycles: a run's directory and its random moments ----------------------

/// The directory of a crash-cycle run (kept with NVPOOL_KEEP_TEST_DIR) and its seed:
/// NVPOOL_CRASH_SEED replays a run's random moments, else one from the clock.
pub fn crash_run() -> (tempfile::TempDir, u64) {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    let seed = std::env::var("NVPOOL_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    });
    println!("logs in {}; NVPOOL_CRASH_SEED={seed}", root.path().display());
    (root, seed)
}

/// The next number of a crash run's random sequence (xorshift).
pub fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Writes through one path as `host`, with its DH-HMAC-CHAP secrets, and reads back
/// through another.
pub fn write_then_read(host: &str, write_at: SocketAddr, read_at: SocketAddr, nqn: &str, auth: &HostAuth) {
    let o = ConnectOptions { auth: Some(auth.clone()), ..ConnectOptions::admin(nqn, host) };
    let data = pattern(11, 64 << 10);
    for (at, write) in [(write_at, true), (read_at, false)] {
        let mut admin = connect_admin(at, &o).unwrap_or_else(|e| panic!("authenticated connect to {at}: {e}"));
        assert!(admin.auth_required);
        admin.set_queue_count(1).unwrap();
        let bs = lba_format_block_size(admin.identify_namespace(1).unwrap().lbaf0);
        let mut q = Queue::connect(at, &o.io(1, admin.cntlid, 31)).unwrap();
        if write {
            q.write(1, 0, &data, bs, 0).unwrap();
            q.flush(1).unwrap();
        } else {
            assert!(q.read(1, 0, (data.len() / bs as usize) as u32, bs).unwrap() == data, "data differs at {at}");
        }
    }
}

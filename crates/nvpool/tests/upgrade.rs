//! Hot upgrade of a running engine under load, through the CLI: hosts (our initiator)
//! write and read back on a memory namespace, a file and a thin volume (allocating as
//! it is written, and snapshotted twice under the writes), over queues with and without digests, while the engine is replaced
//! by a new process again and again. No command may fail, no connection may drop (each
//! queue keeps its socket and its controller ID), and all data must read back. Upgrades
//! that fail (a binary that exits at once, one that crashes in the middle of the
//! handover) must leave the old engine serving. A thousand connections are handed over
//! at once, an upgrade while a volume migrates is refused with the reason, a
//! mirrored volume is served across upgrades of both its engines, and an engine under
//! `nvpool supervise` (a container's main process) upgrades with its supervisor staying.
#![allow(unsafe_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command as Process, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpool_control::testkit::free_port;
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::reservation::{
    Acquire, AcquireAction, AcquireData, Register, RegisterAction, RegisterData, ReservationType,
};
use nvpool_wire::tcp::Digests;

const BIN: &str = env!("CARGO_BIN_EXE_nvpool");
const NQN: &str = "nqn.2024-01.io.nvpool:upgrade";
const BLOCK: u32 = 4096;
const UPGRADES: usize = 10;
/// Blocks each writer owns, per namespace.
const SPAN: u64 = 2048;
/// The namespaces: RAM, a file, a thin volume.
const NAMESPACES: u32 = 3;

fn cli(socket: &Path, args: &[&str]) -> Result<String, String> {
    let out = Process::new(BIN).arg("engine").args(args).arg("--socket").arg(socket).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn engine_pid(socket: &Path) -> u32 {
    let info: serde_json::Value = serde_json::from_str(&cli(socket, &["info", "--json"]).unwrap()).unwrap();
    info["pid"].as_u64().unwrap() as u32
}

/// Waits (up to 10 s) until the engine behind `socket` answers; `what` names it in the failure.
fn wait_for_engine(socket: &Path, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while cli(socket, &["info"]).is_err() {
        assert!(Instant::now() < deadline, "{what} did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An engine serving `namespaces` of NQN (RAM when none), its management socket in `dir`.
fn start_engine(dir: &Path, port: u16, namespaces: &[String]) -> Child {
    let mut engine = Process::new(BIN);
    engine
        .args(["engine", "--listen", &format!("127.0.0.1:{port}"), "--discovery-port", "0", "--reactors", "2"])
        .args(["--subsystem", NQN, "--block-size", "4096"]);
    for ns in namespaces {
        engine.args(["--namespace", ns]);
    }
    if namespaces.is_empty() {
        engine.args(["--namespace", "memory:64MiB"]);
    }
    let engine = engine
        .arg("--mgmt-socket")
        .arg(dir.join("sock"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("engine.log")).unwrap())
        .spawn()
        .unwrap();
    wait_for_engine(&dir.join("sock"), "the engine");
    engine
}

/// What the writers saw.
#[derive(Default)]
struct Tally {
    commands: AtomicU64,
    errors: AtomicU64,
    slowest_us: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Tally {
    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::SeqCst);
        self.first_error.lock().unwrap().get_or_insert(what);
    }
}

/// A host's I/O queue writing and reading back its own blocks of both namespaces:
/// 4 KiB writes go in the capsule, 64 KiB writes through R2T and H2CData.
fn writer(addr: SocketAddr, io: ConnectOptions, id: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) -> Vec<Vec<u64>> {
    let mut q = Queue::connect(addr, &io).expect("I/O queue");
    let mut seeds = vec![vec![0u64; SPAN as usize]; NAMESPACES as usize];
    let mut n = 0u64;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let nsid = (n % u64::from(NAMESPACES)) as u32 + 1;
        let blocks: u64 = if n.is_multiple_of(3) { 16 } else { 1 };
        let first = (n * 7919) % (SPAN - blocks);
        let seed = id << 40 | n;
        let data: Vec<u8> = (0..blocks).flat_map(|b| pattern(seed ^ (first + b), BLOCK as usize)).collect();
        let start = Instant::now();
        let lba = id * SPAN + first;
        if let Err(e) = q.write(nsid, lba, &data, BLOCK, 8192) {
            tally.error(format!("writer {id}: write of {blocks} blocks at {lba} on namespace {nsid}: {e:?}"));
            return seeds;
        }
        match q.read(nsid, lba, blocks as u32, BLOCK) {
            Ok(back) if back == data => {}
            Ok(_) => tally.error(format!("writer {id}: blocks at {lba} on namespace {nsid} read back other data")),
            Err(e) => {
                tally.error(format!("writer {id}: read at {lba} on namespace {nsid}: {e:?}"));
                return seeds;
            }
        }
        tally.slowest_us.fetch_max(start.elapsed().as_micros() as u64, Ordering::SeqCst);
        tally.commands.fetch_add(2, Ordering::SeqCst);
        for b in 0..blocks {
            seeds[nsid as usize - 1][(first + b) as usize] = seed;
        }
    }
    seeds
}

/// Asserts that the writers complete commands again, without an error. How long they
/// paused is measured (the upgrade's pause, the slowest write and read-back), not
/// asserted: a busy machine (the test binaries beside this one) stretches it.
fn io_goes_on(tally: &Tally, dir: &Path, when: &str) {
    let before = tally.commands.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(10);
    while tally.commands.load(Ordering::SeqCst) <= before
        && tally.errors.load(Ordering::SeqCst) == 0
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let first_error = tally.first_error.lock().unwrap().clone();
    assert!(
        tally.commands.load(Ordering::SeqCst) > before && first_error.is_none(),
        "I/O goes on {when} (first error: {first_error:?}; engine log: {})",
        std::fs::read_to_string(dir.join("engine.log")).unwrap_or_default()
    );
}

struct Host {
    admin: Queue,
    cntlid: u16,
    io: ConnectOptions,
}

fn host(addr: SocketAddr, name: &str, digests: Digests) -> Host {
    let mut o = ConnectOptions::admin(NQN, &format!("nqn.2024-01.io.nvpool:upgrade-{name}"));
    o.digests = digests;
    // These hosts send no Keep Alive: the timeout outlasts the test's longest wait (a
    // new binary that never answers is given 10 s), while the engine keeps time.
    o.kato = 30_000;
    let mut admin = connect_admin(addr, &o).expect("admin queue");
    admin.set_queue_count(2).expect("Set Features Number of Queues");
    let cntlid = admin.cntlid;
    Host { admin, cntlid, io: o.io(1, cntlid, 63) }
}

#[test]
fn the_engine_is_replaced_under_load_and_no_host_notices() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let port = free_port();
    let file = format!("file:{}:64MiB", dir.path().join("ns2.img").display());
    let mut first = start_engine(dir.path(), port, &["memory:64MiB".into(), file]);
    let serving = StopOnDrop(socket.clone());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    std::fs::File::create(dir.path().join("disk")).unwrap().set_len(256 << 20).unwrap();
    cli(&socket, &["pool", "create", "p", dir.path().join("disk").to_str().unwrap()]).unwrap();
    cli(&socket, &["volume", "create", "p", "v", "128MiB", "--thin"]).unwrap();
    cli(
        &socket,
        &["namespace", "add", NQN, "volume:p/v", "--nsid", "3", "--block-size", "4096", "--allow-torn-writes"],
    )
    .unwrap();
    let mut hosts =
        [host(addr, "plain", Digests::default()), host(addr, "digests", Digests { header: true, data: true })];
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    let mut writers = Vec::new();
    for (i, h) in hosts.iter().enumerate() {
        for qid in 1..=2u16 {
            let mut io = h.io.clone();
            io.qid = qid;
            let id = (i * 2 + usize::from(qid) - 1) as u64;
            let (stop, tally) = (stop.clone(), tally.clone());
            writers.push((id, std::thread::spawn(move || writer(addr, io, id, stop, tally))));
        }
    }
    std::thread::sleep(Duration::from_millis(300));

    // Upgrades that fail leave the old engine serving.
    let pid = engine_pid(&socket);
    let e = cli(&socket, &["upgrade", "--binary", "/bin/false"]).unwrap_err();
    assert!(e.contains("called off") && e.contains("goes on serving"), "{e}");
    let faulty = |fault: &str| {
        let binary = dir.path().join(format!("{fault}-nvpool"));
        std::fs::write(&binary, format!("#!/bin/sh\nNVPOOL_FAULT_TAKEOVER={fault} exec {BIN} \"$@\"\n")).unwrap();
        std::fs::set_permissions(&binary, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        cli(&socket, &["upgrade", "--binary", binary.to_str().unwrap()]).unwrap_err()
    };
    let e = faulty("abort-after-state");
    assert!(e.contains("called off") && e.contains("did not confirm the takeover"), "{e}");
    let e = faulty("reads-no-format");
    assert!(e.contains("reads state formats []") && e.contains("upgrade through a version that reads both"), "{e}");
    let hanging = dir.path().join("hanging-nvpool");
    std::fs::write(&hanging, "#!/bin/sh\nexec sleep 600\n").unwrap();
    std::fs::set_permissions(&hanging, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let e = cli(&socket, &["upgrade", "--binary", hanging.to_str().unwrap()]).unwrap_err();
    assert!(e.contains("it did not say hello (no answer within 10s)") && e.contains("goes on serving"), "{e}");
    assert_eq!(engine_pid(&socket), pid, "a failed upgrade keeps the old engine");
    io_goes_on(&tally, dir.path(), "after failed upgrades");
    println!(
        "failed upgrades: /bin/false, a crash mid-handover, a binary that cannot read the state and one that never \
         answers were called off; pid {pid} serves on"
    );

    let mut pauses = Vec::new();
    let mut pids = vec![pid];
    for i in 0..UPGRADES {
        // Snapshots of the thin volume under its writes, before the first upgrade and
        // half-way: from then on the upgrades hand over a volume that lies over
        // snapshots, its first writes over them included.
        if i == 0 || i == UPGRADES / 2 {
            cli(&socket, &["volume", "snapshot", "p", "v", &format!("before-{i}")]).unwrap();
        }
        let report: serde_json::Value = serde_json::from_str(&cli(&socket, &["upgrade", "--json"]).unwrap()).unwrap();
        pauses.push(report["pause_us"].as_u64().unwrap());
        println!("{report}");
        assert_eq!(report["connections"].as_u64(), Some(6), "two admin and four I/O queues: {report}");
        assert_eq!(report["controllers"].as_u64(), Some(2), "{report}");
        let new_pid = report["new_pid"].as_u64().unwrap() as u32;
        assert!(!pids.contains(&new_pid));
        assert_eq!(engine_pid(&socket), new_pid, "upgrade {i}: the new process answers management");
        pids.push(new_pid);
        // The admin queues go on under their controllers, with their IDs.
        for h in &mut hosts {
            let id = h.admin.identify_controller().expect("Identify on the admin queue after an upgrade");
            assert_eq!(id.cntlid, h.cntlid, "the controller ID is kept");
        }
        io_goes_on(&tally, dir.path(), &format!("after upgrade {i}"));
    }
    // The first engine exited at the first upgrade.
    let _ = first.wait();
    stop.store(true, Ordering::SeqCst);
    let mut models = Vec::new();
    for (id, w) in writers {
        models.push((id, w.join().unwrap()));
    }
    let errors = tally.errors.load(Ordering::SeqCst);
    assert_eq!(errors, 0, "first error: {:?}", tally.first_error.lock().unwrap());
    // The snapshots are kept, and the volume still lies over the newer one.
    let list: serde_json::Value =
        serde_json::from_str(&cli(&socket, &["volume", "list", "p", "--json"]).unwrap()).unwrap();
    let entry = |name: &str| list.as_array().unwrap().iter().find(|v| v["name"] == name).cloned();
    let half = format!("before-{}", UPGRADES / 2);
    assert_eq!(entry("v").unwrap()["parent"], half.as_str(), "{list}");
    for name in ["before-0", half.as_str()] {
        assert_eq!(entry(name).unwrap_or_else(|| panic!("snapshot {name} lost: {list}"))["snapshot"], true);
    }
    cli(&socket, &["pool", "check", "p"]).unwrap();

    // Everything written reads back through a new connection.
    let h = host(addr, "checker", Digests::default());
    let mut q = Queue::connect(addr, &h.io).unwrap();
    let mut checked = 0;
    for (id, seeds) in &models {
        for (ns, blocks) in seeds.iter().enumerate() {
            for (b, &seed) in blocks.iter().enumerate().filter(|(_, s)| **s != 0) {
                let lba = id * SPAN + b as u64;
                let got = q.read(ns as u32 + 1, lba, 1, BLOCK).unwrap();
                assert_eq!(got, pattern(seed ^ b as u64, BLOCK as usize), "namespace {} block {lba}", ns + 1);
                checked += 1;
            }
        }
    }
    pauses.sort_unstable();
    println!(
        "{UPGRADES} upgrades under load: {} commands, 0 errors, {checked} blocks verified; pause p50 {:.2} ms, max \
         {:.2} ms; slowest write+read-back {:.2} ms; pids {pids:?}",
        tally.commands.load(Ordering::SeqCst),
        pauses[pauses.len() / 2] as f64 / 1000.0,
        pauses[pauses.len() - 1] as f64 / 1000.0,
        tally.slowest_us.load(Ordering::SeqCst) as f64 / 1000.0,
    );
    drop(serving);
}

/// Stops whichever engine process serves the socket when the test ends, passed or not.
struct StopOnDrop(std::path::PathBuf);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Ok(out) = cli(&self.0, &["info", "--json"]) {
            let info: serde_json::Value = serde_json::from_str(&out).unwrap_or_default();
            if let Some(pid) = info["pid"].as_u64() {
                let _ = Process::new("kill").arg(pid.to_string()).status();
            }
        }
    }
}

/// Lets this process open `n` files (the test holds a socket per connection).
fn allow_open_files(n: u64) {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_cur.max(n.min(limit.rlim_max));
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
}

#[test]
fn a_thousand_connections_are_handed_over() {
    const CONTROLLERS: u16 = 20;
    const IO_QUEUES: u16 = 49;
    allow_open_files(4096);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let port = free_port();
    let mut first = start_engine(dir.path(), port, &[]);
    let serving = StopOnDrop(socket.clone());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut admins = Vec::new();
    let mut queues = Vec::new();
    for c in 0..CONTROLLERS {
        let mut o = ConnectOptions::admin(NQN, &format!("nqn.2024-01.io.nvpool:upgrade-many-{c}"));
        o.kato = 30_000;
        let mut admin = connect_admin(addr, &o).expect("admin queue");
        admin.set_queue_count(IO_QUEUES).expect("Set Features Number of Queues");
        let cntlid = admin.cntlid;
        for qid in 1..=IO_QUEUES {
            queues.push(Queue::connect(addr, &o.io(qid, cntlid, 7)).expect("I/O queue"));
        }
        admins.push((admin, cntlid));
    }
    let connections = admins.len() + queues.len();
    assert_eq!(connections, 1000);
    // Each queue writes its own block before the upgrade, and reads it back after.
    for (i, q) in queues.iter_mut().enumerate() {
        q.write(1, i as u64, &pattern(i as u64, BLOCK as usize), BLOCK, 8192).expect("write before the upgrade");
    }
    let report: serde_json::Value = serde_json::from_str(&cli(&socket, &["upgrade", "--json"]).unwrap()).unwrap();
    assert_eq!(report["connections"].as_u64(), Some(connections as u64), "{report}");
    assert_eq!(report["controllers"].as_u64(), Some(u64::from(CONTROLLERS)), "{report}");
    // The first engine exited once it had handed over.
    let _ = first.wait();
    for (admin, cntlid) in &mut admins {
        assert_eq!(admin.identify_controller().expect("Identify after the upgrade").cntlid, *cntlid);
    }
    for (i, q) in queues.iter_mut().enumerate() {
        let back = q.read(1, i as u64, 1, BLOCK).expect("read after the upgrade");
        assert_eq!(back, pattern(i as u64, BLOCK as usize), "block {i}");
    }
    println!(
        "{connections} connections ({CONTROLLERS} controllers) handed over; pause {:.2} ms (finishing commands \
         {:.2}, handing over {:.2}, rebuilding {:.2}); every queue read its block back",
        report["pause_us"].as_f64().unwrap() / 1000.0,
        report["park_us"].as_f64().unwrap() / 1000.0,
        report["transfer_us"].as_f64().unwrap() / 1000.0,
        report["rebuild_us"].as_f64().unwrap() / 1000.0,
    );
    drop(serving);
}

/// Two engines, each with pool `p` on a 256 MiB file and volume `v` of 64 MiB, one
/// volume under one identity (made on the first, then on the second with its UUID and
/// NGUID): a migration's source and target, or two replicas. Stopped when dropped.
struct EnginePair {
    dirs: [tempfile::TempDir; 2],
    ports: [u16; 2],
    engines: Vec<Child>,
    guards: Vec<StopOnDrop>,
}

impl EnginePair {
    fn start() -> EnginePair {
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let ports = [free_port(), free_port()];
        let mut engines = Vec::new();
        let mut guards = Vec::new();
        for (dir, &port) in dirs.iter().zip(&ports) {
            engines.push(start_engine(dir.path(), port, &[]));
            let socket = dir.path().join("sock");
            guards.push(StopOnDrop(socket.clone()));
            std::fs::File::create(dir.path().join("disk")).unwrap().set_len(256 << 20).unwrap();
            cli(&socket, &["pool", "create", "p", dir.path().join("disk").to_str().unwrap()]).unwrap();
        }
        let pair = EnginePair { dirs, ports, engines, guards };
        let (a, b) = (pair.socket(0), pair.socket(1));
        let v: serde_json::Value =
            serde_json::from_str(&cli(&a, &["volume", "create", "p", "v", "64MiB", "--json"]).unwrap()).unwrap();
        let (uuid, nguid) = (v["uuid"].as_str().unwrap(), v["nguid"].as_str().unwrap());
        cli(&b, &["volume", "create", "p", "v", "64MiB", "--uuid", uuid, "--nguid", nguid]).unwrap();
        pair
    }

    /// Engine `i`'s management socket.
    fn socket(&self, i: usize) -> std::path::PathBuf {
        self.dirs[i].path().join("sock")
    }
}

impl Drop for EnginePair {
    fn drop(&mut self) {
        self.guards.clear();
        for e in &mut self.engines {
            let _ = e.wait();
        }
    }
}

#[test]
fn an_upgrade_is_refused_while_a_volume_migrates() {
    let pair = EnginePair::start();
    let (a, b, ports) = (pair.socket(0), pair.socket(1), pair.ports);
    for socket in [&a, &b] {
        cli(socket, &["namespace", "add", NQN, "volume:p/v", "--nsid", "2"]).unwrap();
    }
    let target = format!("127.0.0.1:{}/{NQN}/2", ports[1]);
    cli(&a, &["volume", "migrate", "p", "v", "--to", &target, "--rate", "1MiB"]).unwrap();
    let e = cli(&a, &["upgrade"]).unwrap_err();
    assert!(e.contains("p/v is moving to another engine") && e.contains("failed_precondition"), "{e}");
    cli(&a, &["volume", "cancel", "p", "v"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while cli(&a, &["upgrade"]).is_err() {
        assert!(Instant::now() < deadline, "the upgrade stays refused after the migration was cancelled");
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("an upgrade during a migration was refused: {}", e.trim());
}

/// Whether process `pid` exists (a zombie, ended but not reaped, counts).
fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// In a container (the Helm chart's engine pod) `nvpool supervise` is the main process:
/// it stays across hot upgrades, adopting each new engine as the old one exits (and
/// reaping the old one), while a host's queue goes on; SIGTERM reaches the engine
/// serving then, which stops cleanly, and the supervisor exits with it.
#[test]
fn a_supervised_engine_hot_upgrades_and_its_supervisor_stays() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let port = free_port();
    let mut supervisor = Process::new(BIN)
        .args(["supervise", "--", BIN, "engine", "--listen", &format!("127.0.0.1:{port}"), "--discovery-port", "0"])
        .args(["--subsystem", NQN, "--namespace", "memory:16MiB", "--block-size", "4096", "--mgmt-socket"])
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("supervise.log")).unwrap())
        .spawn()
        .unwrap();
    let serving = StopOnDrop(socket.clone());
    wait_for_engine(&socket, "the supervised engine");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let h = host(addr, "supervised", Digests::default());
    let mut q = Queue::connect(addr, &h.io).expect("I/O queue");
    let mut pids = vec![engine_pid(&socket)];
    for round in 0..3u64 {
        let data = pattern(round, BLOCK as usize);
        q.write(1, round, &data, BLOCK, 8192).expect("a write before the upgrade");
        cli(&socket, &["upgrade"]).expect("hot upgrade");
        let old = *pids.last().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while process_exists(old) {
            assert!(Instant::now() < deadline, "engine {old} was not reaped after its upgrade");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(supervisor.try_wait().unwrap().is_none(), "the supervisor exited with upgrade {round}");
        let new = engine_pid(&socket);
        assert_ne!(new, old);
        pids.push(new);
        assert_eq!(q.read(1, round, 1, BLOCK).expect("a read after the upgrade"), data);
    }
    drop(q);
    Process::new("kill").arg(supervisor.id().to_string()).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = supervisor.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the supervisor did not stop within 30 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "the supervisor exited with {status}");
    let last = *pids.last().unwrap();
    assert!(!process_exists(last), "engine {last} outlived its supervisor");
    println!("supervised engines {pids:?}: each upgrade adopted and reaped, SIGTERM stopped the last cleanly");
    drop(serving);
}

/// The service manager's side, as systemd sees it: the engine says it is ready and
/// which process it is; after each upgrade the new process names itself the main
/// process before the old one exits; a stopping engine says so.
#[test]
fn the_service_manager_follows_the_engine_across_upgrades() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let notify = std::os::unix::net::UnixDatagram::bind(dir.path().join("notify")).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let next = || {
        let mut buf = [0u8; 512];
        let n = notify.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let port = free_port();
    let mut first = Process::new(BIN)
        .args(["engine", "--listen", &format!("127.0.0.1:{port}"), "--discovery-port", "0"])
        .args(["--subsystem", NQN, "--namespace", "memory:16MiB", "--mgmt-socket"])
        .arg(&socket)
        .env("NOTIFY_SOCKET", dir.path().join("notify"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let serving = StopOnDrop(socket.clone());
    assert_eq!(next(), format!("READY=1\nMAINPID={}", first.id()));
    let mut pids = vec![first.id()];
    for _ in 0..3 {
        let report: serde_json::Value = serde_json::from_str(&cli(&socket, &["upgrade", "--json"]).unwrap()).unwrap();
        let new_pid = report["new_pid"].as_u64().unwrap();
        assert_eq!(next(), format!("MAINPID={new_pid}\nREADY=1"), "after the upgrade to pid {new_pid}");
        pids.push(new_pid as u32);
    }
    let _ = first.wait();
    Process::new("kill").arg(pids.last().unwrap().to_string()).status().unwrap();
    assert_eq!(next(), "STOPPING=1");
    println!("the service manager was told: ready as pid {}, then main pid {:?}, then stopping", pids[0], &pids[1..]);
    drop(serving);
}

#[test]
fn authenticated_queues_and_secrets_survive_an_upgrade() {
    use nvpool_auth::{Hash, Secret};
    use nvpool_initiator::{Error, HostAuth};

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let port = free_port();
    let mut first = start_engine(dir.path(), port, &[]);
    let _serving = StopOnDrop(socket.clone());
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let hostnqn = "nqn.2024-01.io.nvpool:upgrade-auth";
    let secret = Secret::generate(Some(Hash::Sha384));
    let ctrl = Secret::generate(Some(Hash::Sha384));
    let added = Process::new(BIN)
        .args(["engine", "host", "add", NQN, hostnqn, "--socket"])
        .arg(&socket)
        .env("NVPOOL_DHCHAP_SECRET", secret.to_dhhc())
        .env("NVPOOL_DHCHAP_CTRL_SECRET", ctrl.to_dhhc())
        .output()
        .unwrap();
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));

    let o = ConnectOptions {
        auth: Some(HostAuth::new(secret.clone(), Some(ctrl.clone()))),
        kato: 30_000,
        ..ConnectOptions::admin(NQN, hostnqn)
    };
    let mut admin = connect_admin(addr, &o).expect("authenticated admin queue");
    admin.set_queue_count(1).unwrap();
    let mut io = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).expect("authenticated I/O queue");
    let data = pattern(3, 8192);
    io.write(1, 0, &data, BLOCK, 0).unwrap();

    let old = engine_pid(&socket);
    cli(&socket, &["upgrade"]).expect("upgrade");
    assert_ne!(engine_pid(&socket), old);
    let _ = first.wait();

    // The queues stay authenticated: no command is refused after the handover.
    assert_eq!(io.read(1, 0, 2, BLOCK).unwrap(), data);
    admin.identify_controller().unwrap();
    // The new process has the secrets: a new host connection authenticates, a wrong
    // secret is refused, and the host may re-authenticate its old queue.
    let mut again = connect_admin(addr, &o).expect("a new connection authenticates");
    again.identify_controller().unwrap();
    let wrong = ConnectOptions { auth: Some(HostAuth::new(Secret::generate(Some(Hash::Sha384)), None)), ..o.clone() };
    assert!(matches!(Queue::connect(addr, &wrong), Err(Error::AuthRefused(_))));
    admin.authenticate(o.auth.as_ref().unwrap(), hostnqn, NQN).expect("re-authentication after the upgrade");
    let log = std::fs::read_to_string(dir.path().join("engine.log")).unwrap();
    assert!(!log.contains("DHHC"), "a secret reached the log");
}

#[test]
fn tls_listeners_and_psks_survive_an_upgrade() {
    use nvpool_auth::{ConfiguredPsk, Hash, Kdf};

    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let mut first = start_engine(dir.path(), free_port(), &[]);
    let _serving = StopOnDrop(socket.clone());
    let tls_port = free_port();
    let tls_addr: SocketAddr = format!("127.0.0.1:{tls_port}").parse().unwrap();
    cli(&socket, &["listener", "add", &tls_addr.to_string(), "--tls", "required"]).expect("a TLS listener");
    let hostnqn = "nqn.2024-01.io.nvpool:upgrade-tls";
    let psk = ConfiguredPsk::generate(Hash::Sha256);
    let added = Process::new(BIN)
        .args(["engine", "host", "add", NQN, hostnqn, "--socket"])
        .arg(&socket)
        .env("NVPOOL_TLS_PSK", psk.to_interchange())
        .output()
        .unwrap();
    assert!(added.status.success(), "{}", String::from_utf8_lossy(&added.stderr));
    let identity = psk.identity(Kdf::Compat, 0, hostnqn, NQN);
    let key = psk.tls_psk(Kdf::Compat, &identity).unwrap();
    let handshake = |key: &[u8]| {
        let stream = std::net::TcpStream::connect(tls_addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        nvpool_initiator::tls::psk_handshake(stream, &identity.to_string(), key)
    };
    handshake(&key).expect("a handshake before the upgrade");

    let old = engine_pid(&socket);
    cli(&socket, &["upgrade"]).expect("upgrade");
    assert_ne!(engine_pid(&socket), old);
    let _ = first.wait();

    // The new process has the listener's mode and the host's key.
    let listeners: serde_json::Value =
        serde_json::from_str(&cli(&socket, &["listener", "list", "--json"]).unwrap()).unwrap();
    let tls_listener = listeners.as_array().unwrap().iter().find(|l| l["port"] == tls_port).expect("the TLS listener");
    assert_eq!(tls_listener["tls"], "required");
    let subsystems = cli(&socket, &["subsystem", "list", "--json"]).unwrap();
    assert!(subsystems.contains(hostnqn) && !subsystems.contains("NVMeTLSkey"), "{subsystems}");
    assert_eq!(handshake(&key).expect("a handshake after the upgrade"), "TLS_AES_128_GCM_SHA256");
    let mut wrong = key.clone();
    wrong[0] ^= 1;
    assert!(handshake(&wrong).is_err(), "a wrong key after the upgrade");
    assert!(connect_admin(tls_addr, &ConnectOptions::admin(NQN, hostnqn)).is_err(), "plain NVMe/TCP after the upgrade");
    let log = std::fs::read_to_string(dir.path().join("engine.log")).unwrap();
    assert!(!log.contains("NVMeTLSkey"), "a key reached the log");
}

/// `GET /metrics` on `port`, retried while nothing answers (an upgrade's new process
/// binds the address once the old one lets go of it).
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut reply = String::new();
        let answered = std::net::TcpStream::connect(("127.0.0.1", port)).and_then(|mut s| {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n")?;
            s.read_to_string(&mut reply)
        });
        if answered.is_ok() && !reply.is_empty() {
            return reply;
        }
        assert!(Instant::now() < deadline, "nothing serves metrics on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn metrics_limits_and_reservations_are_served_across_upgrades() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sock");
    let (port, metrics) = (free_port(), free_port());
    let mut first = Process::new(BIN)
        .args(["engine", "--listen", &format!("127.0.0.1:{port}"), "--discovery-port", "0"])
        .args(["--subsystem", NQN, "--namespace", "memory:16MiB", "--metrics-listen", &format!("127.0.0.1:{metrics}")])
        .arg("--mgmt-socket")
        .arg(&socket)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let serving = StopOnDrop(socket.clone());
    wait_for_engine(&socket, "the engine");
    let mut pids = vec![first.id()];
    assert!(scrape(metrics).contains("nvpool_namespace_reads_completed_total{"), "before the upgrade");
    // I/O limits go across too.
    cli(&socket, &["namespace", "qos", NQN, "1", "--iops", "12345"]).unwrap();
    // And reservations: host A holds Write Exclusive; host B may read, not write.
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let io_of = |hostnqn: &str, id: u8| {
        let o = ConnectOptions { kato: 0, hostid: [id; 16], ..ConnectOptions::admin(NQN, hostnqn) };
        let mut admin = connect_admin(addr, &o).unwrap();
        admin.set_queue_count(1).unwrap();
        // The admin queue is kept: the controller ends with it.
        let io = Queue::connect(addr, &o.io(1, admin.cntlid, 15)).unwrap();
        (admin, io)
    };
    let (_a_admin, mut a) = io_of("nqn.2024-01.io.nvpool:upgrade-host-a", 0xA);
    let register = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 0 };
    let status = a.reservation_register(1, register, RegisterData { current_key: 0, new_key: 0xA1 }, true).unwrap();
    assert!(status.is_success(), "{status}");
    let acquire =
        Acquire { action: AcquireAction::Acquire, ignore_key: false, kind: Some(ReservationType::WriteExclusive) };
    let status = a.reservation_acquire(1, acquire, AcquireData { current_key: 0xA1, preempt_key: 0 }).unwrap();
    assert!(status.is_success(), "{status}");
    for _ in 0..2 {
        let report: serde_json::Value = serde_json::from_str(&cli(&socket, &["upgrade", "--json"]).unwrap()).unwrap();
        let new_pid = report["new_pid"].as_u64().unwrap();
        pids.push(new_pid as u32);
        // The old process lets go of the address as it hands over; until the new one
        // has it, scrapes find nothing or the old one's last answers.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let reply = scrape(metrics);
            if reply.contains(&format!(",pid=\"{new_pid}\"}} 1")) {
                assert!(reply.starts_with("HTTP/1.1 200 OK"), "{reply}");
                assert!(reply.contains(&format!("nvpool_namespace_size_bytes{{subsystem=\"{NQN}\"")), "{reply}");
                assert!(reply.contains("limit=\"iops\"} 12345"), "the namespace lost its limits:\n{reply}");
                let (_b_admin, mut b) = io_of("nqn.2024-01.io.nvpool:upgrade-host-b", 0xB);
                let written = b.write(1, 0, &pattern(1, 512), 512, 8192);
                assert!(
                    matches!(written, Err(nvpool_initiator::Error::Command(s)) if s.base() == Status::RESERVATION_CONFLICT),
                    "pid {new_pid} let host B write past A's reservation: {written:?}"
                );
                b.read(1, 0, 1, 512).unwrap();
                let report = b.reservation_report(1, 4096).unwrap();
                assert_eq!(report.kind, Some(ReservationType::WriteExclusive));
                assert_eq!(
                    report.registrants.iter().map(|r| (r.host_id, r.key)).collect::<Vec<_>>(),
                    [([0xA; 16], 0xA1)]
                );
                break;
            }
            assert!(Instant::now() < deadline, "pid {new_pid} does not serve the metrics:\n{reply}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let _ = first.wait();
    println!("metrics on port {metrics} from pids {pids:?}");
    drop(serving);
}

/// A mirrored volume across upgrades of its serving engine and of the engine holding
/// its other replica: the mirror opens again at its generation, the replica's export
/// keeps the serving engine's reservation, the host's queue stays, and every write
/// reaches both replicas.
#[test]
fn a_mirrored_volume_is_served_across_upgrades() {
    let pair = EnginePair::start();
    let (a, b, ports) = (pair.socket(0), pair.socket(1), pair.ports);
    cli(&b, &["namespace", "add", NQN, "replica:p/v", "--nsid", "2"]).unwrap();
    let mirror = format!("mirror:generation=1 volume:p/v remote:127.0.0.1:{}/{NQN}/2", ports[1]);
    cli(&a, &["namespace", "add", NQN, &mirror, "--nsid", "2"]).unwrap();

    let addr: SocketAddr = format!("127.0.0.1:{}", ports[0]).parse().unwrap();
    let h = host(addr, "mirror", Digests::default());
    let mut q = Queue::connect(addr, &h.io).expect("I/O queue");
    // The volume's namespaces take the pool's 512-byte sectors.
    const SECTOR: u32 = 512;
    let mut written = 0u64;
    let write_some = |q: &mut Queue, written: &mut u64| {
        for _ in 0..16 {
            q.write(2, *written * 8, &pattern(*written, 4096), SECTOR, 8192).unwrap();
            *written += 1;
        }
    };
    write_some(&mut q, &mut written);
    // What the serving engine recorded as written (a replica that left would copy
    // it) goes across its upgrades too.
    let record = |socket: &Path| {
        let r: serde_json::Value =
            serde_json::from_str(&cli(socket, &["volume", "written-since", "p", "v", "1", "--json"]).unwrap()).unwrap();
        (r["generation"].as_u64(), r["clusters"].as_array().map(Vec::len))
    };
    let recorded = record(&a);
    assert!(recorded.0 == Some(1) && recorded.1 > Some(0), "{recorded:?}");
    for (who, socket) in [("serving", &a), ("replica", &b), ("serving", &a)] {
        let before = engine_pid(socket);
        cli(socket, &["upgrade"]).unwrap();
        assert_ne!(engine_pid(socket), before, "the {who} engine was not replaced");
        assert_eq!(record(&a), recorded, "the record of what was written, after the {who} engine's upgrade");
        write_some(&mut q, &mut written);
    }
    let listed = cli(&a, &["subsystem", "list", "--json"]).unwrap();
    assert!(listed.contains("mirror:generation=1 volume:p/v remote:"), "{listed}");
    assert!(!listed.contains("faulted_legs"), "a replica left the mirror across the upgrades: {listed}");
    let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, "nqn.2024-01.io.nvpool:upgrade-check") };
    let b_addr: SocketAddr = format!("127.0.0.1:{}", ports[1]).parse().unwrap();
    let mut admin = connect_admin(b_addr, &o).unwrap();
    admin.set_queue_count(1).unwrap();
    let mut replica = Queue::connect(b_addr, &o.io(1, admin.cntlid, 15)).unwrap();
    for i in 0..written {
        let want = pattern(i, 4096);
        assert_eq!(q.read(2, i * 8, 8, SECTOR).unwrap(), want, "4 KiB {i} through the serving engine");
        assert_eq!(replica.read(2, i * 8, 8, SECTOR).unwrap(), want, "4 KiB {i} of the other replica");
    }
    println!("{written} writes of 4 KiB across three upgrades reached both replicas");
}

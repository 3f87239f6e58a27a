//! Moving a volume between two engines while a host writes to it: the rounds, the
//! switch (hosts' I/O held, then forwarded to the target), cancelling, a target that
//! dies, and bad requests.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpool_engine::config::{EngineConfig, ListenerConfig};
use nvpool_engine::error::{Error as ApiError, ErrorKind};
use nvpool_engine::{Engine, mgmt};
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use nvpool_wire::reservation::{Register, RegisterAction, RegisterData};
use serde_json::{Value, json};

const NQN: &str = "nqn.2024-01.io.nvpool:moving";
const HOST: &str = "nqn.2024-01.io.nvpool:moving-host";
const MIB: u64 = 1 << 20;
const BLOCK: usize = 4096;
const VOLUME_BYTES: u64 = 64 * MIB;
const BLOCKS: u64 = VOLUME_BYTES / BLOCK as u64;

struct Node {
    engine: Arc<Engine>,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

fn disks(dir: &Path, size: u64) -> Vec<PathBuf> {
    (0..2)
        .map(|i| {
            let p = dir.join(format!("disk{i}"));
            std::fs::File::create(&p).unwrap().set_len(size).unwrap();
            p
        })
        .collect()
}

impl Node {
    /// An engine with pool `p` (two 256 MiB disks) and an empty subsystem that any host
    /// may use.
    fn start(host_nqn: &str) -> Node {
        Node::with_disks(host_nqn, 256 * MIB)
    }

    fn with_disks(host_nqn: &str, disk_size: u64) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let cfg = EngineConfig {
            reactors: Some(2),
            listeners: vec![ListenerConfig {
                address: "127.0.0.1:0".parse().unwrap(),
                tls: Default::default(),
                transport: Default::default(),
            }],
            host_nqn: Some(host_nqn.into()),
            ..EngineConfig::default()
        };
        let engine = Engine::start(&cfg).expect("engine starts");
        let l = &engine.listeners()[0];
        let node = Node { engine, addr: SocketAddr::new(l.addr, l.port), _dir: dir };
        let d = disks(node._dir.path(), disk_size);
        node.ok("pool_create", json!({ "name": "p", "disks": d }));
        node.ok("subsystem_add", json!({ "nqn": NQN, "allow_any_host": true }));
        node
    }

    fn call(&self, method: &str, params: Value) -> Result<Value, ApiError> {
        mgmt::handle(&self.engine, &json!({ "method": method, "params": params }).to_string())
    }

    fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params).unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    /// Creates volume `v` (with `identity` if given) and exports it as namespace 1.
    fn volume(&self, identity: Option<&Value>) -> Value {
        let mut create = json!({ "pool": "p", "name": "v", "size": VOLUME_BYTES, "thin": true });
        if let Some(id) = identity {
            create["identity"] = json!({ "uuid": id["uuid"], "nguid": id["nguid"] });
        }
        let v = self.ok("volume_create", create);
        self.ok(
            "namespace_add",
            json!({ "nqn": NQN, "namespace": { "nsid": 1, "backend": "volume:p/v", "block_size": 4096 } }),
        );
        v
    }

    fn migration(&self) -> Value {
        self.ok("migration_status", json!({ "pool": "p", "name": "v" }))
    }

    fn wait_for(&self, what: &str, limit: Duration, mut done: impl FnMut(&Value) -> bool) -> Value {
        let start = Instant::now();
        loop {
            let m = self.migration();
            if done(&m) {
                return m;
            }
            assert!(start.elapsed() < limit, "{what}: still {m}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn queue(&self) -> (Queue, Queue) {
        let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, HOST) };
        let mut admin = connect_admin(self.addr, &o).unwrap();
        admin.set_queue_count(1).unwrap();
        let io = Queue::connect(self.addr, &o.io(1, admin.cntlid, 127)).unwrap();
        (admin, io)
    }
}

/// What each block should hold: the seed of its last write, or 0 for zeroes.
type Model = Arc<Mutex<HashMap<u64, u64>>>;

fn expected(seed: u64) -> Vec<u8> {
    if seed == 0 { vec![0; BLOCK] } else { pattern(seed, BLOCK) }
}

/// Writes random blocks (and now and then deallocates a whole cluster) until told to
/// stop; returns how many commands failed and how long the slowest took.
fn writer(node_addr: SocketAddr, model: Model, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, u64, Duration)> {
    std::thread::spawn(move || {
        let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, HOST) };
        let mut admin = connect_admin(node_addr, &o).unwrap();
        admin.set_queue_count(1).unwrap();
        let mut io = Queue::connect(node_addr, &o.io(1, admin.cntlid, 127)).unwrap();
        let (mut n, mut errors, mut slowest) = (0u64, 0u64, Duration::ZERO);
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        while !stop.load(Ordering::SeqCst) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let started = Instant::now();
            if x.is_multiple_of(97) {
                // A whole cluster (256 blocks) back to zeroes.
                let first = (x / 97 % (BLOCKS / 256)) * 256;
                match io.deallocate(1, first, 256) {
                    Ok(s) if s.is_success() => {
                        let mut m = model.lock().unwrap();
                        for b in first..first + 256 {
                            m.insert(b, 0);
                        }
                    }
                    _ => errors += 1,
                }
            } else {
                // Writes land in the first half mostly and never in the last quarter,
                // whose clusters stay holes.
                let lba = x % (BLOCKS / 2) + if x.is_multiple_of(5) { BLOCKS / 4 } else { 0 };
                let seed = x | 1;
                match io.write(1, lba, &pattern(seed, BLOCK), BLOCK as u32, 8192) {
                    Ok(()) => {
                        model.lock().unwrap().insert(lba, seed);
                    }
                    Err(_) => errors += 1,
                }
            }
            slowest = slowest.max(started.elapsed());
            n += 1;
        }
        (n, errors, slowest)
    })
}

fn verify(q: &mut Queue, model: &Model, through: &str) {
    let m = model.lock().unwrap();
    for (&lba, &seed) in m.iter() {
        let got =
            q.read(1, lba, 1, BLOCK as u32).unwrap_or_else(|e| panic!("read of block {lba} through {through}: {e}"));
        assert!(got == expected(seed), "block {lba} through {through} is not what was last written");
    }
}

#[test]
fn a_volume_moves_to_another_engine_while_a_host_writes() {
    let source = Node::start("nqn.2024-01.io.nvpool:engine-s");
    let target = Node::start("nqn.2024-01.io.nvpool:engine-t");
    let v = source.volume(None);
    let model: Model = Arc::default();
    // Data before the migration starts: the first round's.
    {
        let (_admin, mut io) = source.queue();
        for lba in (0..BLOCKS / 2).step_by(97) {
            io.write(1, lba, &pattern(lba + 7, BLOCK), BLOCK as u32, 8192).unwrap();
            model.lock().unwrap().insert(lba, lba + 7);
        }
    }
    target.volume(Some(&v));
    let stop = Arc::new(AtomicBool::new(false));
    let host = writer(source.addr, model.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(100));

    let to = format!("{}/{NQN}/1", target.addr);
    let started = source.ok("migration_start", json!({ "pool": "p", "name": "v", "target": to }));
    assert_eq!(started["state"], "copying");
    let m = source.wait_for("a second round", Duration::from_secs(30), |m| m["round"].as_u64() >= Some(2));
    assert_eq!(m["error"], Value::Null);
    source.ok("migration_switch", json!({ "pool": "p", "name": "v", "pause_ms": 500 }));
    let m = source.wait_for("the switch", Duration::from_secs(30), |m| m["state"] == "switched");
    let at_switch = Instant::now();
    while at_switch.elapsed() < Duration::from_millis(300) {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    let (commands, errors, slowest) = host.join().unwrap();
    println!(
        "moved under {commands} host commands: rounds {}, bytes per round {}, pause {} us (slowest host command \
         {slowest:?}), {} pauses given up",
        m["round"], m["round_bytes"], m["pause_us"], m["pauses_given_up"]
    );
    assert_eq!(errors, 0, "the host saw errors");
    assert_eq!(m["volume_here"], false, "the source's volume is deleted at the switch");
    assert!(source.call("volume_get", json!({ "pool": "p", "name": "v" })).is_err());

    // Every block reads back as last written, through the source (which forwards now)
    // and straight from the target.
    let (_a, mut through_source) = source.queue();
    verify(&mut through_source, &model, "the source");
    let (_b, mut direct) = target.queue();
    verify(&mut direct, &model, "the target");
    // Thin stays thin: the last quarter, never written, is all holes.
    let allocated = target.ok("volume_get", json!({ "pool": "p", "name": "v" }))["allocated_bytes"].as_u64().unwrap();
    assert!(allocated <= VOLUME_BYTES * 3 / 4, "the target allocated {allocated} bytes of {VOLUME_BYTES}");
    target.ok("pool_check", json!({ "name": "p" }));
    source.ok("pool_check", json!({ "name": "p" }));
}

#[test]
fn a_cancelled_or_failed_migration_leaves_the_volume_where_it_was() {
    let source = Node::start("nqn.2024-01.io.nvpool:engine-s2");
    let v = source.volume(None);
    let (_admin, mut io) = source.queue();
    // 32 MiB of data, copied at 8 MiB/s: the first round takes seconds.
    for lba in (0..BLOCKS / 2).step_by(8) {
        io.write(1, lba, &pattern(lba, BLOCK), BLOCK as u32, 8192).unwrap();
    }
    let target = Node::start("nqn.2024-01.io.nvpool:engine-t2");
    target.volume(Some(&v));
    let to = format!("{}/{NQN}/1", target.addr);
    let start = json!({ "pool": "p", "name": "v", "target": to, "rate": 8 * MIB });
    source.ok("migration_start", start.clone());
    let again = source.call("migration_start", start.clone()).unwrap_err();
    assert_eq!(again.kind, ErrorKind::AlreadyExists, "{again}");
    // A second export would take writes the migration does not track.
    let second = json!({ "nqn": NQN, "namespace": { "nsid": 2, "backend": "volume:p/v", "block_size": 4096 } });
    let e = source.call("namespace_add", second.clone()).unwrap_err();
    assert!(e.kind == ErrorKind::FailedPrecondition && e.message.contains("is moving"), "{e}");
    let m = source.ok("migration_cancel", json!({ "pool": "p", "name": "v" }));
    assert_eq!((m["state"].as_str(), m["volume_here"].as_bool()), (Some("cancelled"), Some(true)));
    io.write(1, 3, &pattern(99, BLOCK), BLOCK as u32, 8192).unwrap();
    assert_eq!(io.read(1, 3, 1, BLOCK as u32).unwrap(), pattern(99, BLOCK));

    // The target goes away during the copy: the migration fails, the volume stays.
    source.ok("migration_start", start);
    drop(target);
    let m = source.wait_for("the failure", Duration::from_secs(30), |m| m["state"] == "failed");
    println!("a target that died: {}", m["error"]);
    assert!(m["error"].as_str().unwrap().contains("target"), "{m}");
    assert_eq!(m["volume_here"], true);
    for lba in (0..BLOCKS / 2).step_by(8 * 37) {
        let want = if lba == 3 { pattern(99, BLOCK) } else { pattern(lba, BLOCK) };
        assert_eq!(io.read(1, lba, 1, BLOCK as u32).unwrap(), want);
    }
    let e = source.call("migration_switch", json!({ "pool": "p", "name": "v" })).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");

    // A target whose pool is smaller than the volume's data: the copy fails when the
    // target's pool is full, and the volume stays.
    let small = Node::with_disks("nqn.2024-01.io.nvpool:engine-t2-small", 12 * MIB);
    small.volume(Some(&v));
    let to = format!("{}/{NQN}/1", small.addr);
    source.ok("migration_start", json!({ "pool": "p", "name": "v", "target": to }));
    let m = source.wait_for("the failure", Duration::from_secs(30), |m| m["state"] == "failed");
    println!("a target that ran out of space: {}", m["error"]);
    assert!(m["error"].as_str().unwrap().contains("pool is full"), "{m}");
    assert_eq!(m["volume_here"], true);
    assert_eq!(io.read(1, 3, 1, BLOCK as u32).unwrap(), pattern(99, BLOCK));
}

#[test]
fn bad_migration_requests_say_what_was_wrong() {
    let source = Node::start("nqn.2024-01.io.nvpool:engine-s3");
    source.volume(None);
    let target = Node::start("nqn.2024-01.io.nvpool:engine-t3");
    target.volume(None);
    let start = |to: String| source.call("migration_start", json!({ "pool": "p", "name": "v", "target": to }));
    let e = start(format!("{}/{NQN}/1", target.addr)).unwrap_err();
    assert!(e.message.contains("another namespace"), "{e}");
    let e = start(format!("{}/{NQN}/1", source.addr)).unwrap_err();
    assert!(e.message.contains("itself"), "{e}");
    let e = start("nowhere".into()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    let e = source.call("migration_start", json!({ "pool": "p", "name": "w", "target": "x" })).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    // A move would drop the hosts' registrations: refused while there are any.
    let (_admin, mut io) = source.queue();
    let register = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 0 };
    assert!(
        io.reservation_register(1, register, RegisterData { current_key: 0, new_key: 7 }, true).unwrap().is_success()
    );
    let e = start(format!("{}/{NQN}/1", target.addr)).unwrap_err();
    assert!(e.kind == ErrorKind::FailedPrecondition && e.message.contains("reservations"), "{e}");
    assert_eq!(source.migration()["state"], "none");
}

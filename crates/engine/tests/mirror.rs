//! The mirror backend: a replicated volume served by one engine, whose writes reach
//! its own replica and the other engines' replicas before they complete, and whose
//! failed replica holds writes until the namespace is served without it.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use nvpool_engine::config::{EngineConfig, NamespaceConfig, SubsystemConfig};
use nvpool_engine::mgmt;
use nvpool_initiator::{ConnectOptions, Error, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, io_opcode};
use serde_json::{Value, json};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:mirror";
const REPLICA_NQN: &str = "nqn.2024-01.io.nvpool:mirror-replica";
const HOST: &str = "nqn.2024-01.io.nvpool:mirror-host";
const BLOCK: u32 = 512;
const SIZE: u64 = 16 << 20;
const IN_CAPSULE: usize = 8192;

fn engine(nqn: &str, backend: &str, reactors: usize) -> TestEngine {
    engine_as("nqn.2024-01.io.nvpool:engine:mirror-test", nqn, backend, reactors)
}

/// An engine that presents `host_nqn` to the engines whose replicas it writes.
fn engine_as(host_nqn: &str, nqn: &str, backend: &str, reactors: usize) -> TestEngine {
    let cfg = EngineConfig {
        host_nqn: Some(host_nqn.into()),
        reactors: Some(reactors),
        subsystems: vec![SubsystemConfig {
            nqn: nqn.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: true,
            hosts: vec![],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces: vec![NamespaceConfig { nsid: Some(1), ..namespace(backend, BLOCK) }],
        }],
        ..EngineConfig::default()
    };
    TestEngine::start(&cfg)
}

/// An engine holding one replica in RAM, under the replicas' subsystem.
fn replica() -> TestEngine {
    engine(REPLICA_NQN, &format!("memory:{SIZE}"), 1)
}

fn remote_leg(r: &TestEngine) -> String {
    format!("remote:{}/{REPLICA_NQN}/1", r.addr)
}

fn file_leg(path: &Path) -> String {
    format!("file:{}:{SIZE}", path.display())
}

fn io_queue(addr: SocketAddr, nqn: &str) -> (Queue, Queue) {
    let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(nqn, HOST) };
    let mut admin = connect_admin(addr, &o).unwrap();
    admin.set_queue_count(1).unwrap();
    let io = Queue::connect(addr, &o.io(1, admin.cntlid, 63)).unwrap();
    (admin, io)
}

fn write_zeroes(q: &mut Queue, slba: u64, nlb: u32) {
    let cdw = [slba as u32, (slba >> 32) as u32, nlb - 1, 0, 0, 0];
    q.execute(Command { opcode: io_opcode::WRITE_ZEROES, nsid: 1, cdw, ..Command::default() }, 0).unwrap();
}

/// A replica's whole content, read from its own engine.
fn content_of(r: &TestEngine) -> Vec<u8> {
    let (_admin, mut io) = io_queue(r.addr, REPLICA_NQN);
    let chunk = 256u32;
    (0..SIZE / u64::from(BLOCK))
        .step_by(chunk as usize)
        .flat_map(|lba| io.read(1, lba, chunk, BLOCK).unwrap())
        .collect()
}

fn faulted_legs(e: &TestEngine) -> Vec<nvpool_api::FaultedLeg> {
    let subsystems = e.engine.subsystems();
    let s = subsystems.iter().find(|s| s.nqn == NQN).unwrap();
    s.namespaces[0].faulted_legs.clone()
}

fn status_of(e: Error) -> Status {
    match e {
        Error::Command(s) => s,
        other => panic!("expected a command status, got {other}"),
    }
}

#[test]
fn writes_reach_every_replica_and_reads_come_from_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    let (r1, r2) = (replica(), replica());
    let spec = format!("mirror:{} {} {}", file_leg(&local), remote_leg(&r1), remote_leg(&r2));
    let serving = engine(NQN, &spec, 2);
    let (mut admin, mut io) = io_queue(serving.addr, NQN);
    let ns = admin.identify_namespace(1).unwrap();
    assert_eq!(ns.nsze << 9, SIZE);

    // In-capsule and R2T writes, a FUA write, zeroes, a deallocation and a flush.
    for (lba, len, seed) in [(0u64, 4096usize, 1u64), (64, 128 * 1024, 2), (4000, 512, 3), (9000, 64 * 1024, 4)] {
        io.write(1, lba, &pattern(seed, len), BLOCK, IN_CAPSULE).unwrap();
    }
    let cid = 77;
    let mut fua = Command::read_write(io_opcode::WRITE, cid, 1, 20000, 8, 4096);
    fua.cdw[2] |= 1 << 30;
    let r = io.execute_raw(fua, &pattern(5, 4096), true).unwrap();
    assert!(r.cqe.status.is_success());
    write_zeroes(&mut io, 72, 16);
    assert_eq!(io.deallocate(1, 9000, 32).unwrap(), Status::SUCCESS);
    io.flush(1).unwrap();
    assert_eq!(io.read(1, 64, 256, BLOCK).unwrap()[..4096], pattern(2, 128 * 1024)[..4096]);

    // Every replica holds the same bytes.
    let first = std::fs::read(&local).unwrap();
    assert_eq!(first.len() as u64, SIZE);
    assert_eq!(&first[..4096], &pattern(1, 4096)[..]);
    assert_eq!(&first[72 * 512..88 * 512], &[0u8; 16 * 512][..], "zeroed on the first replica");
    for (name, r) in [("second", &r1), ("third", &r2)] {
        assert!(content_of(r) == first, "the {name} replica differs from the first");
    }
}

/// Writes through `io` in a thread; returns its outcome once it completes.
fn write_in_background(
    mut io: Queue,
    lba: u64,
    seed: u64,
) -> std::sync::mpsc::Receiver<(Queue, std::result::Result<(), Error>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = io.write(1, lba, &pattern(seed, 4096), BLOCK, IN_CAPSULE);
        let _ = tx.send((io, r));
    });
    rx
}

#[test]
fn a_failed_replica_holds_writes_until_the_volume_is_served_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    let r1 = replica();
    let remote_leg_spec = remote_leg(&r1);
    let serving = engine(NQN, &format!("mirror:{} {remote_leg_spec}", file_leg(&local)), 1);
    let (_admin, mut io) = io_queue(serving.addr, NQN);
    io.write(1, 8, &pattern(1, 4096), BLOCK, IN_CAPSULE).unwrap();
    assert_eq!(content_of(&r1)[8 * 512..16 * 512], pattern(1, 4096));

    // The second replica's engine goes: a write reaches the first replica only, so it
    // is held, whatever the wait (the remote queue gives up on a lost replica in 5 s).
    drop(r1);
    let outcome = write_in_background(io, 16, 2);
    assert!(outcome.recv_timeout(Duration::from_secs(7)).is_err(), "a write that missed a replica completed");
    let faulted = faulted_legs(&serving);
    assert_eq!(faulted.iter().map(|f| f.leg.as_str()).collect::<Vec<_>>(), [remote_leg_spec.as_str()]);
    println!("the engine reports {faulted:?}");
    // The cluster recorded the mirror without it: the namespace is served by the
    // first replica alone, and the held write completes.
    serving.engine.swap_namespace(NQN, 1, &format!("mirror:{}", file_leg(&local))).unwrap();
    let started = Instant::now();
    let (mut io, r) = outcome.recv_timeout(Duration::from_secs(5)).expect("the held write completes");
    r.unwrap();
    println!("held write released {:?} after the swap", started.elapsed());
    assert_eq!(std::fs::read(&local).unwrap()[16 * 512..24 * 512], pattern(2, 4096));
    io.write(1, 24, &pattern(3, 4096), BLOCK, IN_CAPSULE).unwrap();
    assert_eq!(io.read(1, 8, 24, BLOCK).unwrap(), [pattern(1, 4096), pattern(2, 4096), pattern(3, 4096)].concat());
}

#[test]
fn a_held_write_fails_over_when_nothing_serves_the_volume_without_the_failed_replica() {
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    let r1 = replica();
    let serving = engine(NQN, &format!("mirror:{} {}", file_leg(&local), remote_leg(&r1)), 1);
    let (_admin, io) = io_queue(serving.addr, NQN);
    drop(r1);
    let outcome = write_in_background(io, 16, 2);
    assert!(outcome.recv_timeout(Duration::from_secs(7)).is_err(), "a write that missed a replica completed");
    // The namespace goes (say the engine lost the serving role): the held write was
    // never on every replica, so the host gets a path error and writes it elsewhere.
    serving.engine.remove_namespace(NQN, 1).unwrap();
    let (_io, r) = outcome.recv_timeout(Duration::from_secs(5)).expect("the held write ends");
    assert_eq!(status_of(r.unwrap_err()), Status::ANA_INACCESSIBLE);
}

#[test]
fn a_mirror_refuses_replicas_that_are_not_one_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let serving = engine(NQN, &file_leg(&dir.path().join("plain")), 1);
    let e = serving.engine.add_namespace(NQN, &namespace("mirror:memory:16MiB", BLOCK)).unwrap_err();
    assert!(e.to_string().contains("keeps nothing"), "{e}");
    // Another subsystem's namespace has another identity.
    const OTHER: &str = "nqn.2024-01.io.nvpool:mirror-other";
    let (r1, other) = (replica(), engine(OTHER, &format!("memory:{SIZE}"), 1));
    let spec = format!("mirror:{} remote:{}/{OTHER}/1", remote_leg(&r1), other.addr);
    let e = serving.engine.add_namespace(NQN, &namespace(&spec, BLOCK)).unwrap_err();
    assert!(e.to_string().contains("another namespace"), "{e}");
}

/// Where the serving role went to another engine: the new one serves at a later
/// generation and takes every replica's reservation, and the old one can no longer
/// write to them (its writes end in path errors: the host writes them again through
/// the new one), while an engine with an older generation cannot take the
/// reservation back.
#[test]
fn an_engine_that_lost_the_serving_role_cannot_write_to_the_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let r = replica();
    let mirror_at = |generation: u32, file: &str| {
        format!("mirror:generation={generation} {} {}", file_leg(&dir.path().join(file)), remote_leg(&r))
    };
    let old = engine_as("nqn.2024-01.io.nvpool:engine:old", NQN, &mirror_at(1, "old"), 1);
    let (_a, mut old_io) = io_queue(old.addr, NQN);
    old_io.write(1, 8, &pattern(1, 4096), BLOCK, IN_CAPSULE).unwrap();

    let new = engine_as("nqn.2024-01.io.nvpool:engine:new", NQN, &mirror_at(2, "new"), 1);
    let (_b, mut new_io) = io_queue(new.addr, NQN);
    new_io.write(1, 8, &pattern(2, 4096), BLOCK, IN_CAPSULE).unwrap();
    assert_eq!(content_of(&r)[8 * 512..16 * 512], pattern(2, 4096));

    // The old engine's next write is refused by the replica: a path error at once,
    // never completed, and so are its later ones, whatever serves it next.
    let outcome = write_in_background(old_io, 8, 3);
    let (old_io, result) = outcome.recv_timeout(Duration::from_secs(5)).expect("the fenced write ends");
    assert_eq!(status_of(result.unwrap_err()), Status::ANA_INACCESSIBLE);
    let faulted = faulted_legs(&old);
    assert_eq!(faulted.len(), 1, "{faulted:?}");
    assert!(faulted[0].error.to_lowercase().contains("reservation conflict"), "{faulted:?}");
    assert_eq!(content_of(&r)[8 * 512..16 * 512], pattern(2, 4096), "the fenced write reached the replica");
    let (_io, result) = write_in_background(old_io, 8, 3).recv_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(status_of(result.unwrap_err()), Status::ANA_INACCESSIBLE);
    assert_eq!(content_of(&r)[8 * 512..16 * 512], pattern(2, 4096), "the fenced write reached the replica");

    // An engine that still serves generation 1 cannot take the reservation back.
    let stale = engine_as("nqn.2024-01.io.nvpool:engine:stale", NQN, &mirror_at(1, "stale"), 1);
    let (_c, stale_io) = io_queue(stale.addr, NQN);
    let outcome = write_in_background(stale_io, 8, 4);
    assert!(outcome.recv_timeout(Duration::from_secs(7)).is_err(), "a stale engine completed a write");
    assert_eq!(faulted_legs(&stale).len(), 1);
    new_io.write(1, 16, &pattern(5, 4096), BLOCK, IN_CAPSULE).unwrap();
    let replica = content_of(&r);
    assert_eq!(replica[8 * 512..24 * 512], [pattern(2, 4096), pattern(5, 4096)].concat());
}

/// An engine with pool `p` holding one replica `v` of a volume (the identity given, or
/// a new one), exported to the serving engine as `replica:p/v` under the replicas'
/// subsystem; the hosts' subsystem is there, empty.
struct ReplicaNode {
    node: TestEngine,
    host_nqn: String,
    disks: tempfile::TempDir,
}

impl ReplicaNode {
    fn start(host_nqn: &str, identity: Option<&Value>) -> ReplicaNode {
        let disks = tempfile::tempdir().unwrap();
        let disk = disks.path().join("disk");
        std::fs::File::create(&disk).unwrap().set_len(64 << 20).unwrap();
        let cfg = EngineConfig { host_nqn: Some(host_nqn.into()), reactors: Some(1), ..EngineConfig::default() };
        let n = ReplicaNode { node: TestEngine::start(&cfg), host_nqn: host_nqn.into(), disks };
        n.ok("pool_create", json!({ "name": "p", "disks": [disk] }));
        let mut create = json!({ "pool": "p", "name": "v", "size": SIZE, "thin": true });
        if let Some(id) = identity {
            create["identity"] = json!({ "uuid": id["uuid"], "nguid": id["nguid"] });
        }
        n.ok("volume_create", create);
        for nqn in [NQN, REPLICA_NQN] {
            n.ok("subsystem_add", json!({ "nqn": nqn, "allow_any_host": true }));
        }
        n.add(REPLICA_NQN, "replica:p/v").unwrap();
        n
    }

    /// Stops the engine and starts a new one on the same disks, exporting the replica
    /// again (as its agent would): nothing but the pool carries over.
    fn restart(&mut self) {
        let cfg = EngineConfig { host_nqn: Some(self.host_nqn.clone()), reactors: Some(1), ..EngineConfig::default() };
        self.node.engine.stop();
        self.node = TestEngine::start(&cfg);
        self.ok("pool_import", json!({ "disks": [self.disks.path().join("disk")] }));
        for nqn in [NQN, REPLICA_NQN] {
            self.ok("subsystem_add", json!({ "nqn": nqn, "allow_any_host": true }));
        }
        self.add(REPLICA_NQN, "replica:p/v").unwrap();
    }

    fn call(&self, method: &str, params: Value) -> Result<Value, nvpool_engine::error::Error> {
        mgmt::handle(&self.node.engine, &json!({ "method": method, "params": params }).to_string())
    }

    fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params).unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    fn add(&self, nqn: &str, backend: &str) -> Result<Value, nvpool_engine::error::Error> {
        let namespace = json!({ "nsid": 1, "backend": backend, "block_size": BLOCK });
        self.call("namespace_add", json!({ "nqn": nqn, "namespace": namespace }))
    }

    /// Serves the volume to hosts at `generation`, with `other`'s replica as the
    /// second leg.
    fn serve(&self, generation: u64, other: &ReplicaNode) {
        let spec = format!("mirror:generation={generation} volume:p/v remote:{}/{REPLICA_NQN}/1", other.node.addr);
        self.add(NQN, &spec).unwrap();
    }

    /// 4 KiB at `lba` of this node's replica, read through its replica export.
    fn replica_block(&self, lba: u64) -> Vec<u8> {
        io_queue(self.node.addr, REPLICA_NQN).1.read(1, lba, 8, BLOCK).unwrap()
    }
}

/// The serving role moves from one engine to another, each serving its own replica
/// and writing the other's: from then on the engine that served before writes to
/// neither, whether it writes its own replica directly or the other's over the fabric.
#[test]
fn when_the_serving_role_moves_the_old_engine_writes_no_replica() {
    let a = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:a", None);
    let identity = a.ok("volume_list", json!({ "pool": "p" }))[0].clone();
    let b = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:b", Some(&identity));
    a.serve(1, &b);
    let (_a_admin, mut via_a) = io_queue(a.node.addr, NQN);
    via_a.write(1, 8, &pattern(1, 4096), BLOCK, IN_CAPSULE).unwrap();
    assert_eq!((a.replica_block(8), b.replica_block(8)), (pattern(1, 4096), pattern(1, 4096)));

    // b serves at generation 2: its first write takes a's replica.
    b.serve(2, &a);
    let (_b_admin, mut via_b) = io_queue(b.node.addr, NQN);
    via_b.write(1, 8, &pattern(2, 4096), BLOCK, IN_CAPSULE).unwrap();
    // a's record of what its generation wrote ends there: b's writes are not in it, so
    // a replica that left while a served cannot be rebuilt from it if a serves again.
    let r = a.ok("volume_written_since", json!({ "pool": "p", "name": "v", "generation": 1 }));
    assert_eq!(r["complete"], false, "{r}");
    // a's write reaches neither replica: both refuse it, and the host is told to
    // write it through another path.
    let e = via_a.write(1, 8, &pattern(3, 4096), BLOCK, IN_CAPSULE).unwrap_err();
    assert_eq!(status_of(e), Status::ANA_INACCESSIBLE);
    assert_eq!((a.replica_block(8), b.replica_block(8)), (pattern(2, 4096), pattern(2, 4096)));
    let faulted: Vec<String> = faulted_legs(&a.node).into_iter().map(|f| f.error.to_lowercase()).collect();
    assert!(faulted.len() == 2 && faulted.iter().all(|e| e.contains("reservation conflict")), "{faulted:?}");
    // Nor can a serves the volume at its old generation again.
    a.call("namespace_remove", json!({ "nqn": NQN, "nsid": 1 })).unwrap();
    let e = a.add(NQN, &format!("mirror:generation=1 volume:p/v remote:{}/{REPLICA_NQN}/1", b.node.addr)).unwrap_err();
    assert!(e.to_string().contains("generation 2"), "{e}");
    via_b.write(1, 16, &pattern(4, 4096), BLOCK, IN_CAPSULE).unwrap();
    assert_eq!((a.replica_block(16), b.replica_block(16)), (pattern(4, 4096), pattern(4, 4096)));
}

/// A replica remembers across a restart of its engine which generation took it: an
/// engine of an older generation can no longer write to it, nor serve it.
#[test]
fn a_replica_stays_fenced_across_a_restart_of_its_engine() {
    let mut a = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:a", None);
    let identity = a.ok("volume_list", json!({ "pool": "p" }))[0].clone();
    let b = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:b", Some(&identity));
    let old = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:old", Some(&identity));
    // b serves at generation 2: its first write takes a's replica.
    b.serve(2, &a);
    let (_b_admin, mut via_b) = io_queue(b.node.addr, NQN);
    via_b.write(1, 8, &pattern(1, 4096), BLOCK, IN_CAPSULE).unwrap();
    drop((_b_admin, via_b));
    b.call("namespace_remove", json!({ "nqn": NQN, "nsid": 1 })).unwrap();

    a.restart();
    // An engine still at generation 1 finds the replica refusing its writes...
    old.serve(1, &a);
    let (_old_admin, mut via_old) = io_queue(old.node.addr, NQN);
    let e = via_old.write(1, 8, &pattern(2, 4096), BLOCK, IN_CAPSULE).unwrap_err();
    assert_eq!(status_of(e), Status::ANA_INACCESSIBLE);
    assert_eq!(a.replica_block(8), pattern(1, 4096), "the old generation's write landed on the restarted replica");
    // ...and the restarted engine itself does not serve the volume at generation 1.
    let e = a.add(NQN, &format!("mirror:generation=1 volume:p/v remote:{}/{REPLICA_NQN}/1", b.node.addr)).unwrap_err();
    assert!(e.to_string().contains("generation 2"), "{e}");
    // The current generation's engine takes it again.
    b.serve(2, &a);
    let (_b_admin, mut via_b) = io_queue(b.node.addr, NQN);
    via_b.write(1, 16, &pattern(3, 4096), BLOCK, IN_CAPSULE).unwrap();
    assert_eq!(a.replica_block(16), pattern(3, 4096));
}

/// While a replica is away, its serving engine records what changes: the clusters
/// written by the writes that missed it and by every later generation, so that it
/// can come back by copying those alone.
#[test]
fn the_serving_engine_records_what_a_replica_that_left_lacks() {
    let mut a = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:a", None);
    let identity = a.ok("volume_list", json!({ "pool": "p" }))[0].clone();
    let b = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:b", Some(&identity));
    a.serve(1, &b);
    let (_admin, mut io) = io_queue(a.node.addr, NQN);
    let cluster = |c: u64| c * (1 << 20) / u64::from(BLOCK);
    for c in [0, 2] {
        io.write(1, cluster(c), &pattern(c, 4096), BLOCK, IN_CAPSULE).unwrap();
    }
    drop(b);
    let outcome = write_in_background(io, cluster(5), 5);
    assert!(outcome.recv_timeout(Duration::from_secs(7)).is_err(), "a write that missed a replica completed");
    a.ok("namespace_swap", json!({ "nqn": NQN, "nsid": 1, "backend": "mirror:generation=2 volume:p/v" }));
    let (mut io, r) = outcome.recv_timeout(Duration::from_secs(5)).expect("the held write completes");
    r.unwrap();
    io.write(1, cluster(9), &pattern(9, 4096), BLOCK, IN_CAPSULE).unwrap();
    let since = |generation: u64| {
        let r = a.ok("volume_written_since", json!({ "pool": "p", "name": "v", "generation": generation }));
        assert_eq!(r["generation"], 2);
        serde_json::from_value::<Vec<u64>>(r["clusters"].clone()).unwrap()
    };
    assert_eq!(since(2), [5, 9], "what the replica that left at generation 1 lacks");
    assert_eq!(since(1), [0, 2, 5, 9]);
    drop((_admin, io));

    // The engine restarts (a clean stop): its pool kept the record, and it serves the
    // volume again at generation 3, recording on.
    a.restart();
    a.ok("namespace_remove", json!({ "nqn": REPLICA_NQN, "nsid": 1 }));
    a.add(NQN, "mirror:generation=3 volume:p/v").unwrap();
    let (_admin, mut io) = io_queue(a.node.addr, NQN);
    io.write(1, cluster(11), &pattern(11, 4096), BLOCK, IN_CAPSULE).unwrap();
    let since = |generation: u64| {
        let r = a.ok("volume_written_since", json!({ "pool": "p", "name": "v", "generation": generation }));
        assert_eq!(r["complete"], true, "the record since generation {generation} is whole: {r}");
        serde_json::from_value::<Vec<u64>>(r["clusters"].clone()).unwrap()
    };
    assert_eq!(since(2), [5, 9, 11], "what the replica that left at generation 1 lacks, across the restart");
    assert_eq!(since(3), [11]);
}

/// Writes as a multipath host does: a path error (a write that reached a mirror
/// just replaced, which starts it on no leg) is sent again; any other error fails.
fn write_as_a_host_does(io: &mut Queue, lba: u64, data: &[u8]) {
    for _ in 0..100 {
        match io.write(1, lba, data, BLOCK, IN_CAPSULE) {
            Ok(()) => return,
            Err(Error::Command(s)) if s.code_type() == 3 => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("write at {lba}: {e}"),
        }
    }
    panic!("write at {lba}: a path error 100 times");
}

/// Writers on their own queues to `addr`, each writing 4 KiB blocks at random within
/// `clusters` (writer `w` of `n` the blocks equal to `w` modulo `n`, so that each
/// block has one writer), one at a time, until `stop`.
struct Writers {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<(std::collections::BTreeMap<u64, u64>, u64)>>,
}

impl Writers {
    fn start(addr: SocketAddr, clusters: &[u64], n: u64) -> Writers {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..n)
            .map(|w| {
                let (stop, clusters) = (stop.clone(), clusters.to_vec());
                std::thread::spawn(move || {
                    let (_admin, mut io) = io_queue(addr, NQN);
                    let mut last = std::collections::BTreeMap::new();
                    let mut x = 0x9E37_79B9_7F4A_7C15u64 + w;
                    let mut writes = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let within = ((x >> 32) % 256) / n * n + w;
                        let block = clusters[(x % clusters.len() as u64) as usize] * 256 + within.min(255);
                        if block % n != w {
                            continue;
                        }
                        write_as_a_host_does(&mut io, block * 8, &pattern(x, 4096));
                        last.insert(block, x);
                        writes += 1;
                    }
                    (last, writes)
                })
            })
            .collect();
        Writers { stop, threads }
    }

    /// Stops them; what each block written holds last, and the writes.
    fn stop(self) -> (std::collections::BTreeMap<u64, u64>, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut all = std::collections::BTreeMap::new();
        let mut writes = 0;
        for t in self.threads {
            let (last, n) = t.join().unwrap();
            all.extend(last);
            writes += n;
        }
        (all, writes)
    }
}

/// Waits for namespace 1's rebuild on `n` to end; returns its last report.
fn rebuilt(n: &ReplicaNode) -> Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = n.ok("replica_rebuild_status", json!({ "nqn": NQN, "nsid": 1 }));
        if info["state"] != "copying" {
            return info;
        }
        assert!(Instant::now() < deadline, "the rebuild did not end: {info}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A replica that comes back gets, while the host writes, what it lacks: the
/// clusters written since it left (partial), or every cluster for one that has
/// nothing (full); then both replicas are the same, byte for byte.
#[test]
fn a_replica_that_comes_back_copies_what_it_lacks_under_live_writes() {
    let a = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:a", None);
    let identity = a.ok("volume_list", json!({ "pool": "p" }))[0].clone();
    let b = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:b", Some(&identity));
    let b_leg = format!("remote:{}/{REPLICA_NQN}/1", b.node.addr);
    a.serve(1, &b);
    let (_admin, mut io) = io_queue(a.node.addr, NQN);
    let block_of_cluster = |c: u64| c * 256 * 8;
    for c in [0, 2] {
        io.write(1, block_of_cluster(c), &pattern(c, 4096), BLOCK, IN_CAPSULE).unwrap();
    }
    // b's replica goes away (its export with it): the next write misses it and is
    // held until a serves the volume alone, at generation 2.
    b.call("namespace_remove", json!({ "nqn": REPLICA_NQN, "nsid": 1 })).unwrap();
    let outcome = write_in_background(io, block_of_cluster(5), 5);
    std::thread::sleep(Duration::from_millis(300));
    a.ok("namespace_swap", json!({ "nqn": NQN, "nsid": 1, "backend": "mirror:generation=2 volume:p/v" }));
    let (mut io, r) = outcome.recv_timeout(Duration::from_secs(10)).expect("the held write completes");
    r.unwrap();
    io.write(1, block_of_cluster(9), &pattern(9, 4096), BLOCK, IN_CAPSULE).unwrap();
    drop(io);

    // b is back: a partial rebuild copies clusters 5 and 9 while hosts write into
    // them.
    b.add(REPLICA_NQN, "replica:p/v").unwrap();
    let writers = Writers::start(a.node.addr, &[5, 9], 4);
    std::thread::sleep(Duration::from_millis(100));
    let started = a.ok("replica_rebuild", json!({ "nqn": NQN, "nsid": 1, "leg": b_leg, "since": 2 }));
    assert_eq!(started["state"], "copying");
    let info = rebuilt(&a);
    std::thread::sleep(Duration::from_millis(100));
    let (_, writes) = writers.stop();
    assert_eq!(info["state"], "done", "{info}");
    // What the writers wrote while b was away, in 4 KiB granules of the two clusters
    // they write: at most those clusters.
    let total = info["total_bytes"].as_u64().unwrap();
    assert!(total > 0 && total <= 2 << 20 && info["copied_bytes"].as_u64() == Some(total), "{info}");
    assert!(content_of(&a.node) == content_of(&b.node), "the replicas differ after the partial rebuild");
    println!("partial rebuild: {info}; {writes} writes meanwhile");

    // A new, empty replica c gets every cluster (full rebuild), under writes
    // everywhere.
    let c = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:c", Some(&identity));
    let c_leg = format!("remote:{}/{REPLICA_NQN}/1", c.node.addr);
    // b joins the in-sync set at generation 3 while hosts write: the writes the
    // generation-2 mirror still has on its way finish (no leg faults, no write fails).
    let writers = Writers::start(a.node.addr, &(0..16).collect::<Vec<_>>(), 4);
    std::thread::sleep(Duration::from_millis(100));
    let both = format!("mirror:generation=3 volume:p/v {b_leg}");
    a.ok("namespace_swap", json!({ "nqn": NQN, "nsid": 1, "backend": both }));
    std::thread::sleep(Duration::from_millis(100));
    assert!(faulted_legs(&a.node).is_empty(), "{:?}", faulted_legs(&a.node));
    a.ok("replica_rebuild", json!({ "nqn": NQN, "nsid": 1, "leg": c_leg, "rate": 32 << 20 }));
    let info = rebuilt(&a);
    let (last, writes) = writers.stop();
    assert_eq!(info["state"], "done", "{info}");
    assert_eq!(info["copied_bytes"].as_u64(), Some(SIZE));
    let all = content_of(&a.node);
    assert!(all == content_of(&b.node) && all == content_of(&c.node), "the replicas differ after the full rebuild");
    let (_admin, mut io) = io_queue(a.node.addr, NQN);
    for (&block, &seed) in &last {
        assert_eq!(io.read(1, block * 8, 8, BLOCK).unwrap(), pattern(seed, 4096), "block {block}");
    }
    println!("full rebuild: {info}; {writes} writes meanwhile");

    // The metrics say the same: two replicas in sync, one caught up (the controller
    // makes it a full leg), and what its rebuild copied.
    let metrics = nvpool_engine::metrics::serve(a.node.engine.clone(), "127.0.0.1:0".parse().unwrap()).unwrap();
    let mut scrape = std::net::TcpStream::connect(metrics).unwrap();
    std::io::Write::write_all(&mut scrape, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut body = String::new();
    std::io::Read::read_to_string(&mut scrape, &mut body).unwrap();
    let value = |name: &str, label: &str| {
        let line = body
            .lines()
            .find(|l| l.starts_with(name) && l.contains(&format!("subsystem=\"{NQN}\"")) && l.contains(label));
        line.and_then(|l| l.rsplit(' ').next()).unwrap_or_else(|| panic!("no {name} {label} in:\n{body}")).to_string()
    };
    assert_eq!(value("nvpool_namespace_replicas", "state=\"in_sync\""), "2");
    assert_eq!(value("nvpool_namespace_replicas", "state=\"catching_up\""), "1");
    assert_eq!(value("nvpool_namespace_replicas", "state=\"faulted\""), "0");
    assert_eq!(value("nvpool_namespace_rebuild_bytes", "part=\"copied\""), SIZE.to_string());
}

const SNAPSHOT_NQN: &str = "nqn.2024-01.io.nvpool:mirror-snapshot";

/// A volume's (or snapshot's) whole content on `n`, through an export of its own.
fn pool_volume_content(n: &ReplicaNode, name: &str) -> Vec<u8> {
    let _ = n.call("subsystem_add", json!({ "nqn": SNAPSHOT_NQN, "allow_any_host": true }));
    let namespace = json!({ "nsid": 1, "backend": format!("volume:p/{name}"), "block_size": BLOCK });
    n.ok("namespace_add", json!({ "nqn": SNAPSHOT_NQN, "namespace": namespace }));
    let (_admin, mut io) = io_queue(n.node.addr, SNAPSHOT_NQN);
    let content =
        (0..SIZE / u64::from(BLOCK)).step_by(256).flat_map(|lba| io.read(1, lba, 256, BLOCK).unwrap()).collect();
    drop((_admin, io));
    n.ok("namespace_remove", json!({ "nqn": SNAPSHOT_NQN, "nsid": 1 }));
    content
}

/// A snapshot of a replicated volume, taken under live writes: the serving engine
/// holds the mirror's writes, the other replica takes it, then the serving engine
/// takes its own and lets the writes go on. Both copies are the same bytes (one point
/// in the write order) with one identity. A hold runs out by itself. After a later
/// snapshot, a replica that left before it still comes back by copying only what it
/// lacks: the record of what was written goes on with the volume, and the copy reads
/// through to the snapshots.
#[test]
fn a_snapshot_of_a_replicated_volume_is_one_point_on_every_replica() {
    let a = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:a", None);
    let identity = a.ok("volume_list", json!({ "pool": "p" }))[0].clone();
    let b = ReplicaNode::start("nqn.2024-01.io.nvpool:engine:b", Some(&identity));
    a.serve(1, &b);
    let snapshot_identity =
        json!({ "uuid": "6f1c2a34-5b6d-4e7f-8091-a2b3c4d5e6f7", "nguid": "00112233445566778899aabbccddeeff" });
    let take = |n: &ReplicaNode, name: &str| {
        n.call("snapshot_create", json!({ "pool": "p", "volume": "v", "name": name, "identity": snapshot_identity }))
    };
    let hold = |ms: u64| a.ok("volume_hold_writes", json!({ "pool": "p", "volume": "v", "hold_ms": ms }));
    // The serving engine takes none without the hold: the other replica would not
    // have the same point.
    let e = take(&a, "s0").unwrap_err().to_string();
    assert!(e.contains("replicated") && e.contains("nvpool snapshot create"), "{e}");
    assert!(b.call("volume_hold_writes", json!({ "pool": "p", "volume": "v", "hold_ms": 100 })).is_err());

    let writers = Writers::start(a.node.addr, &(0..8).collect::<Vec<_>>(), 4);
    std::thread::sleep(Duration::from_millis(200));
    hold(5000);
    take(&b, "s1").unwrap();
    let taken = take(&a, "s1").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let (last, writes) = writers.stop();
    println!("snapshot under {writes} writes: pause {} us", taken["pause_us"]);
    let (on_a, on_b) = (pool_volume_content(&a, "s1"), pool_volume_content(&b, "s1"));
    assert!(on_a == on_b, "the replicas' copies of the snapshot differ");
    let volume = content_of(&a.node);
    assert!(volume == content_of(&b.node), "the replicas differ");
    assert!(on_a != volume, "no write after the snapshot");
    for n in [&a, &b] {
        let s = n.ok("volume_get", json!({ "pool": "p", "name": "s1" }));
        assert_eq!(
            (s["uuid"].as_str(), s["snapshot"].as_bool()),
            (Some("6f1c2a34-5b6d-4e7f-8091-a2b3c4d5e6f7"), Some(true)),
            "{s}"
        );
    }
    let (_admin, mut io) = io_queue(a.node.addr, NQN);
    for (&block, &seed) in &last {
        assert_eq!(io.read(1, block * 8, 8, BLOCK).unwrap(), pattern(seed, 4096), "block {block}");
    }

    // A hold that nothing ends lets the writes go at its deadline.
    hold(300);
    let outcome = write_in_background(io, 3 * 256 * 8, 77);
    assert!(outcome.recv_timeout(Duration::from_millis(150)).is_err(), "a write went through the hold");
    let (io, r) = outcome.recv_timeout(Duration::from_secs(5)).expect("the hold ran out");
    r.unwrap();

    // b leaves; a serves alone at generation 2, writes, takes a snapshot, writes again.
    b.call("namespace_remove", json!({ "nqn": REPLICA_NQN, "nsid": 1 })).unwrap();
    let outcome = write_in_background(io, 12 * 256 * 8, 4);
    std::thread::sleep(Duration::from_millis(300));
    a.ok("namespace_swap", json!({ "nqn": NQN, "nsid": 1, "backend": "mirror:generation=2 volume:p/v" }));
    let (mut io, r) = outcome.recv_timeout(Duration::from_secs(10)).expect("the held write completes");
    r.unwrap();
    io.write(1, 9 * 256 * 8, &pattern(9, 4096), BLOCK, IN_CAPSULE).unwrap();
    hold(5000);
    take(&a, "s2").unwrap();
    io.write(1, 10 * 256 * 8 + 8, &pattern(10, 4096), BLOCK, IN_CAPSULE).unwrap();
    io.write(1, 9 * 256 * 8 + 16, &pattern(11, 4096), BLOCK, IN_CAPSULE).unwrap();
    drop(io);
    let since = a.ok("volume_written_since", json!({ "pool": "p", "name": "v", "generation": 2 }));
    assert_eq!((since["clusters"].clone(), since["complete"].clone()), (json!([9, 10, 12]), json!(true)), "{since}");

    // b is back: the partial rebuild copies those three clusters' granules alone,
    // reading what is under the snapshot from it.
    b.add(REPLICA_NQN, "replica:p/v").unwrap();
    let b_leg = format!("remote:{}/{REPLICA_NQN}/1", b.node.addr);
    a.ok("replica_rebuild", json!({ "nqn": NQN, "nsid": 1, "leg": b_leg, "since": 2 }));
    let info = rebuilt(&a);
    assert_eq!(info["state"], "done", "{info}");
    assert_eq!(info["total_bytes"].as_u64(), Some(4 * 4096), "{info}");
    assert!(content_of(&a.node) == content_of(&b.node), "the replicas differ after the partial rebuild");
}

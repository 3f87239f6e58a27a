//! Pools and volumes through the engine: the management API, and volumes exported as
//! namespaces driven over NVMe/TCP by the in-repo initiator.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nvpool_engine::config::{EngineConfig, ListenerConfig, PoolConfig};
use nvpool_engine::error::{Error as ApiError, ErrorKind};
use nvpool_engine::{Engine, mgmt};
use nvpool_initiator::{ConnectOptions, Error, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, io_opcode};
use serde_json::{Value, json};

const NQN: &str = "nqn.2024-01.io.nvpool:volumes";
const HOST: &str = "nqn.2024-01.io.nvpool:host-a";
const IN_CAPSULE: usize = 8192;
const MIB: u64 = 1 << 20;
/// Blocks of 4 KiB per 1 MiB cluster.
const BLOCKS_PER_CLUSTER: u64 = 256;

struct Node {
    engine: Arc<Engine>,
    addr: SocketAddr,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.engine.stop();
    }
}

impl Node {
    fn start(pools: Vec<PoolConfig>) -> Node {
        let cfg = EngineConfig {
            reactors: Some(2),
            listeners: vec![ListenerConfig {
                address: "127.0.0.1:0".parse().unwrap(),
                tls: Default::default(),
                transport: Default::default(),
            }],
            pools,
            ..EngineConfig::default()
        };
        let engine = Engine::start(&cfg).expect("engine starts");
        let l = &engine.listeners()[0];
        let addr = SocketAddr::new(l.addr, l.port);
        Node { engine, addr }
    }

    fn call(&self, method: &str, params: Value) -> Result<Value, ApiError> {
        mgmt::handle(&self.engine, &json!({ "method": method, "params": params }).to_string())
    }

    fn ok(&self, method: &str, params: Value) -> Value {
        self.call(method, params).unwrap_or_else(|e| panic!("{method}: {e}"))
    }

    fn export(&self, pool: &str, volume: &str) -> u32 {
        if self.call("subsystem_add", json!({ "nqn": NQN, "allow_any_host": true })).is_err() {
            // Already there.
        }
        let r = self.ok(
            "namespace_add",
            json!({ "nqn": NQN, "namespace": { "backend": format!("volume:{pool}/{volume}"), "block_size": 4096 } }),
        );
        r["nsid"].as_u64().unwrap() as u32
    }

    fn queue(&self) -> (Queue, Queue) {
        queue_at(self.addr)
    }
}

/// An admin queue and one I/O queue to the engine at `addr`.
fn queue_at(addr: SocketAddr) -> (Queue, Queue) {
    let o = ConnectOptions::admin(NQN, HOST);
    let mut admin = connect_admin(addr, &o).unwrap();
    admin.set_queue_count(1).unwrap();
    let io = Queue::connect(addr, &o.io(1, admin.cntlid, 127)).unwrap();
    (admin, io)
}

fn disks(dir: &Path, n: usize, size: u64) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let p = dir.join(format!("disk{i}"));
            std::fs::File::create(&p).unwrap().set_len(size).unwrap();
            p
        })
        .collect()
}

fn allocated(node: &Node, pool: &str, name: &str) -> u64 {
    node.ok("volume_get", json!({ "pool": pool, "name": name }))["allocated_bytes"].as_u64().unwrap()
}

fn write(q: &mut Queue, nsid: u32, slba: u64, data: &[u8]) -> Result<(), Error> {
    q.write(nsid, slba, data, 4096, IN_CAPSULE)
}

fn deallocate(q: &mut Queue, nsid: u32, slba: u64, nlb: u32) -> Status {
    q.deallocate(nsid, slba, nlb).unwrap().base()
}

#[test]
fn thin_volume_allocates_on_write_and_frees_on_trim() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 2, 64 * MIB);
    let node = Node::start(vec![]);
    let p = node.ok("pool_create", json!({ "name": "p", "disks": d }));
    let capacity = p["capacity_bytes"].as_u64().unwrap();
    assert!(capacity >= 100 * MIB, "two 64 MiB disks give most of their space: {capacity}");
    node.ok("volume_create", json!({ "pool": "p", "name": "thin", "size": 1 << 30, "thin": true }));
    let nsid = node.export("p", "thin");
    let (_admin, mut q) = node.queue();
    // Unwritten space reads as zeroes and allocates nothing.
    assert!(q.read(nsid, 0, 32, 4096).unwrap().iter().all(|&b| b == 0));
    assert_eq!(allocated(&node, "p", "thin"), 0);
    // A write allocates exactly the clusters it touches: one spanning a boundary, two.
    let data = pattern(1, 8192);
    write(&mut q, nsid, BLOCKS_PER_CLUSTER - 1, &data).unwrap();
    assert_eq!(allocated(&node, "p", "thin"), 2 * MIB);
    assert_eq!(q.read(nsid, BLOCKS_PER_CLUSTER - 1, 2, 4096).unwrap(), data);
    // The rest of a new cluster reads as zeroes.
    assert!(q.read(nsid, 0, 8, 4096).unwrap().iter().all(|&b| b == 0));
    // Largest transfers, across the pool's two disks.
    for i in 0..40u64 {
        write(&mut q, nsid, i * BLOCKS_PER_CLUSTER * 3, &pattern(i + 10, 131072)).unwrap();
    }
    for i in 0..40u64 {
        assert_eq!(q.read(nsid, i * BLOCKS_PER_CLUSTER * 3, 32, 4096).unwrap(), pattern(i + 10, 131072), "cluster {i}");
    }
    let before = allocated(&node, "p", "thin");
    // Deallocating a whole cluster frees it; a partial range zeroes in place.
    assert_eq!(deallocate(&mut q, nsid, 3 * BLOCKS_PER_CLUSTER, BLOCKS_PER_CLUSTER as u32), Status::SUCCESS);
    assert_eq!(allocated(&node, "p", "thin"), before - MIB);
    assert!(q.read(nsid, 3 * BLOCKS_PER_CLUSTER, 32, 4096).unwrap().iter().all(|&b| b == 0));
    assert_eq!(deallocate(&mut q, nsid, 6 * BLOCKS_PER_CLUSTER, 8), Status::SUCCESS);
    assert_eq!(allocated(&node, "p", "thin"), before - MIB);
    let back = q.read(nsid, 6 * BLOCKS_PER_CLUSTER, 32, 4096).unwrap();
    assert!(back[..8 * 4096].iter().all(|&b| b == 0));
    assert_eq!(back[8 * 4096..], pattern(12, 131072)[8 * 4096..]);
    // Write Zeroes over a whole cluster frees it too.
    let wz = Command {
        opcode: io_opcode::WRITE_ZEROES,
        nsid,
        cdw: [(9 * BLOCKS_PER_CLUSTER) as u32, 0, BLOCKS_PER_CLUSTER as u32 - 1, 0, 0, 0],
        ..Command::default()
    };
    q.execute(wz, 0).unwrap();
    assert_eq!(allocated(&node, "p", "thin"), before - 2 * MIB);
    assert!(q.read(nsid, 9 * BLOCKS_PER_CLUSTER, 32, 4096).unwrap().iter().all(|&b| b == 0));
    // A reused cluster never shows the old data.
    write(&mut q, nsid, 500 * BLOCKS_PER_CLUSTER, &pattern(99, 4096)).unwrap();
    let reused = q.read(nsid, 500 * BLOCKS_PER_CLUSTER, 32, 4096).unwrap();
    assert_eq!(reused[..4096], pattern(99, 4096));
    assert!(reused[4096..].iter().all(|&b| b == 0));
    node.ok("pool_check", json!({ "name": "p" }));
}

#[test]
fn a_full_pool_answers_capacity_exceeded_and_spares_other_volumes() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 1, 48 * MIB);
    let node = Node::start(vec![]);
    node.ok("pool_create", json!({ "name": "small", "disks": d }));
    let free = node.ok("pool_list", json!({}))[0]["free_bytes"].as_u64().unwrap();
    node.ok("volume_create", json!({ "pool": "small", "name": "thick", "size": 8 * MIB }));
    node.ok("volume_create", json!({ "pool": "small", "name": "big", "size": 1 << 30, "thin": true }));
    let err = node.call("volume_create", json!({ "pool": "small", "name": "huge", "size": 1 << 30 })).unwrap_err();
    assert!(err.message.contains("free") && err.message.contains("thin"), "{err}");
    assert_eq!(err.kind, ErrorKind::FailedPrecondition);
    let thick = node.export("small", "thick");
    let big = node.export("small", "big");
    let (_admin, mut q) = node.queue();
    let keep = pattern(7, 131072);
    write(&mut q, thick, 0, &keep).unwrap();
    let clusters = (free - 8 * MIB) / MIB;
    for c in 0..clusters {
        write(&mut q, big, c * BLOCKS_PER_CLUSTER, &pattern(c, 4096)).unwrap();
    }
    match write(&mut q, big, clusters * BLOCKS_PER_CLUSTER, &pattern(0, 4096)) {
        Err(Error::Command(s)) => assert_eq!(s.base(), Status::CAPACITY_EXCEEDED),
        other => panic!("expected capacity exceeded, got {other:?}"),
    }
    // Overwriting allocated space still works, and the other volume is intact.
    write(&mut q, big, 0, &pattern(1, 4096)).unwrap();
    assert_eq!(q.read(thick, 0, 32, 4096).unwrap(), keep);
    assert_eq!(node.ok("pool_list", json!({}))[0]["free_bytes"].as_u64().unwrap(), 0);
    // Freeing a cluster makes room again.
    assert_eq!(deallocate(&mut q, big, 0, BLOCKS_PER_CLUSTER as u32), Status::SUCCESS);
    write(&mut q, big, clusters * BLOCKS_PER_CLUSTER, &pattern(3, 4096)).unwrap();
    node.ok("pool_check", json!({ "name": "small" }));
}

#[test]
fn volumes_keep_data_and_identity_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 2, 64 * MIB);
    let data = pattern(5, 131072);
    let (uuid, nguid, pool_info) = {
        let node = Node::start(vec![]);
        node.ok("pool_create", json!({ "name": "keep", "disks": d, "cluster_size": 256 << 10 }));
        node.ok("volume_create", json!({ "pool": "keep", "name": "a", "size": 64 * MIB, "thin": true }));
        node.ok("volume_create", json!({ "pool": "keep", "name": "b", "size": 16 * MIB }));
        node.ok("volume_create", json!({ "pool": "keep", "name": "gone", "size": 16 * MIB }));
        node.ok("volume_delete", json!({ "pool": "keep", "name": "gone" }));
        let nsid = node.export("keep", "a");
        let (_admin, mut q) = node.queue();
        write(&mut q, nsid, 1000, &data).unwrap();
        q.flush(nsid).unwrap();
        let v = node.ok("volume_get", json!({ "pool": "keep", "name": "a" }));
        (v["uuid"].clone(), v["nguid"].clone(), node.ok("pool_list", json!({}))[0].clone())
    };
    // Imported from its disks in another order, through the configuration.
    let node = Node::start(vec![PoolConfig { disks: vec![d[1].clone(), d[0].clone()], create: None }]);
    let again = node.ok("pool_list", json!({}))[0].clone();
    for field in ["uuid", "capacity_bytes", "used_bytes", "free_bytes", "volumes"] {
        assert_eq!(again[field], pool_info[field], "{field}");
    }
    let v = node.ok("volume_get", json!({ "pool": "keep", "name": "a" }));
    assert_eq!((v["uuid"].clone(), v["nguid"].clone()), (uuid, nguid));
    let nsid = node.export("keep", "a");
    let (mut admin, mut q) = node.queue();
    assert_eq!(q.read(nsid, 1000, 32, 4096).unwrap(), data);
    let id = admin.identify_namespace(nsid).unwrap();
    assert_eq!(id.nsze, 64 * MIB / 4096);
    assert_eq!(hex(&id.nguid), v["nguid"].as_str().unwrap());
    node.ok("pool_check", json!({ "name": "keep" }));
    // Growing the volume grows the namespace.
    node.ok("volume_resize", json!({ "pool": "keep", "name": "a", "size": 96 * MIB }));
    assert_eq!(admin.identify_namespace(nsid).unwrap().nsze, 96 * MIB / 4096);
    let shrink = node.call("volume_resize", json!({ "pool": "keep", "name": "a", "size": MIB })).unwrap_err();
    assert!(shrink.message.contains("shrinking is not supported"), "{shrink}");
    assert_eq!(shrink.kind, ErrorKind::InvalidArgument);
    // Exported volumes cannot be deleted, nor their pool exported.
    let e = node.call("volume_delete", json!({ "pool": "keep", "name": "a" })).unwrap_err();
    assert!(e.message.contains("remove the namespace first"), "{e}");
    assert_eq!(e.kind, ErrorKind::FailedPrecondition);
    assert!(node.call("pool_export", json!({ "name": "keep" })).is_err());
    node.ok("namespace_remove", json!({ "nqn": NQN, "nsid": nsid }));
    node.ok("pool_export", json!({ "name": "keep" }));
    assert!(node.ok("pool_list", json!({})).as_array().unwrap().is_empty());
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn dirty_tracking_reports_written_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 1, 64 * MIB);
    let node = Node::start(vec![]);
    node.ok("pool_create", json!({ "name": "m", "disks": d }));
    node.ok("volume_create", json!({ "pool": "m", "name": "v", "size": 32 * MIB }));
    let nsid = node.export("m", "v");
    let (_admin, mut q) = node.queue();
    let dirty = |action: &str| node.ok("volume_dirty", json!({ "pool": "m", "name": "v", "action": action }));
    write(&mut q, nsid, 0, &pattern(1, 4096)).unwrap();
    assert_eq!(dirty("start")["tracking"], json!(true));
    write(&mut q, nsid, 5 * BLOCKS_PER_CLUSTER + 3, &pattern(2, 4096)).unwrap();
    write(&mut q, nsid, 2 * BLOCKS_PER_CLUSTER - 1, &pattern(3, 8192)).unwrap();
    q.read(nsid, 20 * BLOCKS_PER_CLUSTER, 1, 4096).unwrap();
    assert_eq!(dirty("report")["clusters"], json!([1, 2, 5]));
    assert_eq!(dirty("reset")["clusters"], json!([1, 2, 5]));
    assert_eq!(dirty("report")["clusters"], json!([]));
    write(&mut q, nsid, 7 * BLOCKS_PER_CLUSTER, &pattern(4, 4096)).unwrap();
    assert_eq!(dirty("report")["clusters"], json!([7]));
    dirty("stop");
    write(&mut q, nsid, 9 * BLOCKS_PER_CLUSTER, &pattern(4, 4096)).unwrap();
    assert_eq!(dirty("report")["tracking"], json!(false));
}

#[test]
fn a_configured_pool_is_claimed_at_the_first_start_and_imported_after() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 3, 32 * MIB);
    let configured = |disks: &[PathBuf]| vec![PoolConfig { disks: disks.to_vec(), create: Some("made".into()) }];
    let data = pattern(9, 4096);
    let uuid = {
        let node = Node::start(configured(&d[..2]));
        let pool = node.ok("pool_list", json!({}))[0].clone();
        assert_eq!(pool["name"], "made");
        node.ok("volume_create", json!({ "pool": "made", "name": "v", "size": 8 * MIB }));
        let nsid = node.export("made", "v");
        let (_admin, mut q) = node.queue();
        write(&mut q, nsid, 7, &data).unwrap();
        q.flush(nsid).unwrap();
        pool["uuid"].clone()
    };
    // The same configuration again: the pool and its data, not a new pool.
    let node = Node::start(configured(&d[..2]));
    assert_eq!(node.ok("pool_list", json!({}))[0]["uuid"], uuid);
    let nsid = node.export("made", "v");
    let (_admin, mut q) = node.queue();
    assert_eq!(q.read(nsid, 7, 1, 4096).unwrap(), data);
    drop(q);
    drop(node);
    // Disks that hold something else are not claimed: the engine does not start.
    let f = std::fs::OpenOptions::new().write(true).open(&d[2]).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x53, 0xEF], 1080).unwrap();
    let cfg = EngineConfig { pools: configured(&d[2..]), ..EngineConfig::default() };
    let e = Engine::start(&cfg).err().expect("a disk with a filesystem is refused");
    assert!(e.to_string().contains("ext2/3/4"), "{e}");
}

#[test]
fn disks_in_use_or_with_filesystems_are_refused_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 3, 32 * MIB);
    let node = Node::start(vec![]);
    node.ok("pool_create", json!({ "name": "one", "disks": [d[0]] }));
    let e = node.call("pool_create", json!({ "name": "two", "disks": [d[0]] })).unwrap_err();
    assert!(e.message.contains("already a disk of pool one"), "{e}");
    node.ok("pool_export", json!({ "name": "one" }));
    let e = node.call("pool_create", json!({ "name": "two", "disks": [d[0]] })).unwrap_err();
    assert!(e.message.contains("belongs to pool \"one\"") && e.message.contains("force"), "{e}");
    // An ext4 superblock magic at byte 1080.
    let f = std::fs::OpenOptions::new().write(true).open(&d[1]).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0x53, 0xEF], 1080).unwrap();
    let e = node.call("pool_create", json!({ "name": "two", "disks": [d[1]] })).unwrap_err();
    assert!(e.message.contains("ext2/3/4") && e.message.contains("force"), "{e}");
    node.ok("pool_create", json!({ "name": "two", "disks": [d[0], d[1]], "force": true }));
    // The old pool's disk now belongs to the new one only.
    node.ok("pool_export", json!({ "name": "two" }));
    let e = node.call("pool_import", json!({ "disks": [d[0]] })).unwrap_err();
    assert!(e.message.contains("has 2 disks"), "{e}");
    node.ok("pool_import", json!({ "disks": [d[0], d[1]] }));
    for bad in
        [json!({ "name": "x y", "disks": [d[2]] }), json!({ "name": "c", "disks": [d[2]], "cluster_size": 4096 })]
    {
        assert!(node.call("pool_create", bad).is_err());
    }
    let e = node.call("volume_create", json!({ "pool": "nope", "name": "v", "size": 4096 })).unwrap_err();
    assert!(e.message.contains("no pool nope"), "{e}");
    assert_eq!(e.kind, ErrorKind::NotFound);
    node.ok("volume_create", json!({ "pool": "two", "name": "v", "size": 4096 }));
    let e = node.call("volume_create", json!({ "pool": "two", "name": "v", "size": 4096 })).unwrap_err();
    assert_eq!(e.kind, ErrorKind::AlreadyExists, "{e}");
}

#[test]
fn usage_lists_everything_then_only_what_changed_since_the_mark_given() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 1, 64 * MIB);
    let node = Node::start(vec![]);
    node.ok("pool_create", json!({ "name": "p", "disks": d }));
    for name in ["a", "b", "c"] {
        node.ok("volume_create", json!({ "pool": "p", "name": name, "size": 16 * MIB, "thin": true }));
    }
    let nsid = node.export("p", "a");
    let usage = |since: Option<u64>| node.ok("usage", json!({ "since": since }));
    let names = |v: &Value, list: &str| -> Vec<String> {
        let mut n: Vec<String> = v[list]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.get("name").or(e.get("nqn")).unwrap().as_str().unwrap().to_string())
            .collect();
        n.sort();
        n
    };
    let first = usage(None);
    assert_eq!(first["complete"], true);
    assert_eq!(names(&first, "volumes"), ["a", "b", "c"]);
    assert_eq!(names(&first, "namespaces"), [NQN]);
    assert_eq!(first["pools"][0]["volumes"], 3);
    // At rest: the pools, and nothing else.
    let rest = usage(first["mark"].as_u64());
    assert_eq!(rest["complete"], false);
    for list in ["volumes", "volumes_gone", "namespaces", "namespaces_gone"] {
        assert!(rest[list].as_array().unwrap().is_empty(), "{list} at rest: {rest}");
    }
    assert_eq!(rest["pools"].as_array().unwrap().len(), 1);
    // A write: a's allocation and its namespace's counters changed, nothing else.
    let (_admin, mut q) = node.queue();
    write(&mut q, nsid, 0, &pattern(1, 4096)).unwrap();
    node.ok("volume_delete", json!({ "pool": "p", "name": "c" }));
    let changed = usage(rest["mark"].as_u64());
    assert_eq!(changed["complete"], false);
    assert_eq!(names(&changed, "volumes"), ["a"]);
    assert_eq!(changed["volumes"][0]["allocated_bytes"], MIB);
    assert_eq!(names(&changed, "volumes_gone"), ["c"]);
    assert_eq!(names(&changed, "namespaces"), [NQN]);
    assert_eq!(changed["namespaces"][0]["stats"]["writes"], 1);
    // An old mark (another caller asked since): everything again.
    let again = usage(rest["mark"].as_u64());
    assert_eq!(again["complete"], true);
    assert_eq!(names(&again, "volumes"), ["a", "b"]);
    assert!(again["volumes_gone"].as_array().unwrap().is_empty());
}

/// Reads `blocks` 4 KiB blocks at `slba` and compares them with what each should hold.
fn expect(q: &mut Queue, nsid: u32, slba: u64, want: &[u8], what: &str) {
    let got = q.read(nsid, slba, (want.len() / 4096) as u32, 4096).unwrap();
    assert!(got == want, "{what}: block {slba} reads otherwise");
}

#[test]
fn snapshots_keep_the_data_as_it_was_and_clones_write_apart() {
    let dir = tempfile::tempdir().unwrap();
    let d = disks(dir.path(), 2, 64 * MIB);
    let zero4k = vec![0u8; 4096];
    let (a0, a_cross, a_big) = (pattern(1, 4096), pattern(2, 8192), pattern(3, 131072));
    let (b1, b_big) = (pattern(11, 4096), pattern(13, 4096));
    let c0 = pattern(21, 8192);
    {
        let node = Node::start(vec![]);
        node.ok("pool_create", json!({ "name": "p", "disks": d }));
        node.ok("volume_create", json!({ "pool": "p", "name": "db", "size": 32 * MIB, "thin": true }));
        let db = node.export("p", "db");
        let (_admin, mut q) = node.queue();
        write(&mut q, db, 0, &a0).unwrap();
        write(&mut q, db, BLOCKS_PER_CLUSTER - 1, &a_cross).unwrap();
        write(&mut q, db, 5 * BLOCKS_PER_CLUSTER, &a_big).unwrap();
        // Taken while the volume is exported and a host is connected.
        let taken = node.ok("snapshot_create", json!({ "pool": "p", "volume": "db", "name": "db-1" }));
        assert_eq!(taken["snapshot"]["snapshot"], json!(true));
        assert_eq!(taken["snapshot"]["allocated_bytes"].as_u64().unwrap(), 3 * MIB, "the snapshot took the clusters");
        println!("snapshot pause: {} us", taken["pause_us"]);
        assert_eq!(allocated(&node, "p", "db"), 0);
        assert_eq!(node.ok("volume_get", json!({ "pool": "p", "name": "db" }))["parent"], json!("db-1"));
        // Written after: the volume holds the new data, reads the rest through.
        write(&mut q, db, 1, &b1).unwrap();
        write(&mut q, db, 5 * BLOCKS_PER_CLUSTER + 7, &b_big).unwrap();
        expect(&mut q, db, 0, &[a0.clone(), b1.clone()].concat(), "the volume after the snapshot");
        expect(&mut q, db, BLOCKS_PER_CLUSTER - 1, &a_cross, "a write across clusters before the snapshot");
        let mut big = a_big.clone();
        big[7 * 4096..8 * 4096].copy_from_slice(&b_big);
        expect(&mut q, db, 5 * BLOCKS_PER_CLUSTER, &big, "a cluster written in part after the snapshot");
        expect(&mut q, db, 9 * BLOCKS_PER_CLUSTER, &zero4k, "never written");
        assert_eq!(allocated(&node, "p", "db"), 2 * MIB, "one cluster per cluster written after the snapshot");
        // Zeroing over the snapshot's data reads zeroes, and leaves the snapshot's.
        assert_eq!(deallocate(&mut q, db, BLOCKS_PER_CLUSTER, BLOCKS_PER_CLUSTER as u32), Status::SUCCESS);
        expect(&mut q, db, BLOCKS_PER_CLUSTER, &zero4k, "deallocated over the snapshot");
        expect(&mut q, db, BLOCKS_PER_CLUSTER - 1, &a_cross[..4096], "the block before the deallocated cluster");
        // A clone reads as the snapshot, and writes apart from the volume.
        node.ok("volume_clone", json!({ "pool": "p", "snapshot": "db-1", "name": "copy" }));
        let copy = node.export("p", "copy");
        expect(&mut q, copy, 0, &[a0.clone(), zero4k.clone()].concat(), "the clone");
        expect(&mut q, copy, BLOCKS_PER_CLUSTER - 1, &a_cross, "the clone, across clusters");
        expect(&mut q, copy, 5 * BLOCKS_PER_CLUSTER, &a_big, "the clone's partly written cluster");
        write(&mut q, copy, 0, &c0).unwrap();
        expect(&mut q, copy, 0, &c0, "the clone after its write");
        expect(&mut q, db, 0, &[a0.clone(), b1.clone()].concat(), "the volume after the clone's write");
        // The snapshot itself: read-only.
        let snap = node.export("p", "db-1");
        expect(&mut q, snap, 0, &[a0.clone(), zero4k.clone()].concat(), "the snapshot");
        expect(&mut q, snap, 5 * BLOCKS_PER_CLUSTER, &a_big, "the snapshot's cluster");
        match write(&mut q, snap, 0, &b1) {
            Err(Error::Command(s)) => assert_eq!(s.base(), Status::NAMESPACE_WRITE_PROTECTED),
            other => panic!("a write to a snapshot: {other:?}"),
        }
        node.ok("namespace_remove", json!({ "nqn": NQN, "nsid": snap }));
        // Deleted while the volume and the clone lie over it: hidden, not gone.
        node.ok("volume_delete", json!({ "pool": "p", "name": "db-1" }));
        let names: Vec<Value> = node
            .ok("volume_list", json!({ "pool": "p" }))
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].clone())
            .collect();
        assert_eq!(names, [json!("db"), json!("copy")]);
        expect(&mut q, copy, 5 * BLOCKS_PER_CLUSTER, &a_big, "the clone over a hidden snapshot");
        q.flush(db).unwrap();
        node.ok("pool_check", json!({ "name": "p" }));
        let e = node.call("snapshot_create", json!({ "pool": "p", "volume": "db", "name": "copy" })).unwrap_err();
        assert_eq!(e.kind, ErrorKind::AlreadyExists, "{e}");
    }
    // Across a restart: the layers and what each holds.
    let node = Node::start(vec![PoolConfig { disks: d.clone(), create: None }]);
    let (db, copy) = (node.export("p", "db"), node.export("p", "copy"));
    let (_admin, mut q) = node.queue();
    let mut big = a_big.clone();
    big[7 * 4096..8 * 4096].copy_from_slice(&b_big);
    expect(&mut q, db, 0, &[a0.clone(), b1.clone()].concat(), "the volume after a restart");
    expect(&mut q, db, 5 * BLOCKS_PER_CLUSTER, &big, "its partly written cluster after a restart");
    expect(&mut q, db, BLOCKS_PER_CLUSTER, &zero4k, "its deallocated cluster after a restart");
    expect(&mut q, copy, 0, &c0, "the clone after a restart");
    expect(&mut q, copy, 5 * BLOCKS_PER_CLUSTER, &a_big, "the clone's read-through after a restart");
    node.ok("pool_check", json!({ "name": "p" }));
    // The last layer gone, the hidden snapshot goes with it: nothing is left.
    for (nsid, name) in [(db, "db"), (copy, "copy")] {
        node.ok("namespace_remove", json!({ "nqn": NQN, "nsid": nsid }));
        node.ok("volume_delete", json!({ "pool": "p", "name": name }));
    }
    let pool = node.ok("pool_list", json!({}))[0].clone();
    assert_eq!(pool["used_bytes"], json!(0), "{pool}");
    assert_eq!(pool["volumes"], json!(0), "{pool}");
    node.ok("pool_check", json!({ "name": "p" }));
}

/// An engine with a 16 MiB thin volume `p/v` (pool on one disk in `dir`) exported with
/// 512-byte blocks, smaller than a granule; and its namespace ID.
fn small_block_volume(dir: &Path) -> (Node, u32) {
    let d = disks(dir, 1, 64 * MIB);
    let node = Node::start(vec![]);
    node.ok("pool_create", json!({ "name": "p", "disks": d }));
    node.ok("volume_create", json!({ "pool": "p", "name": "v", "size": 16 * MIB, "thin": true }));
    node.call("subsystem_add", json!({ "nqn": NQN, "allow_any_host": true })).unwrap();
    let added = node.ok(
        "namespace_add",
        json!({ "nqn": NQN, "namespace": { "backend": "volume:p/v", "block_size": 512, "allow_torn_writes": true } }),
    );
    let nsid = added["nsid"].as_u64().unwrap() as u32;
    (node, nsid)
}

/// A write over a snapshot that is smaller than a granule (512-byte blocks) changes
/// its own blocks alone: its buffer is whole pages, and the rest of the granule keeps
/// what the snapshot holds.
#[test]
fn small_writes_over_a_snapshot_keep_their_neighbours() {
    let dir = tempfile::tempdir().unwrap();
    let (node, nsid) = small_block_volume(dir.path());
    let (_admin, mut q) = node.queue();
    let before = pattern(1, 8192);
    q.write(nsid, 0, &before, 512, IN_CAPSULE).unwrap();
    node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": "v-1" }));
    // One block, then three, each the first write to its granule or not.
    let one = pattern(2, 512);
    q.write(nsid, 3, &one, 512, IN_CAPSULE).unwrap();
    let three = pattern(3, 1536);
    q.write(nsid, 9, &three, 512, IN_CAPSULE).unwrap();
    let mut want = before.clone();
    want[3 * 512..4 * 512].copy_from_slice(&one);
    want[9 * 512..12 * 512].copy_from_slice(&three);
    assert!(q.read(nsid, 0, 16, 512).unwrap() == want, "the blocks around the small writes changed");
    node.ok("pool_check", json!({ "name": "p" }));
}

/// Whole-granule writes over a snapshot go straight to the volume's cluster while a
/// smaller write in the same granule, in flight with it, goes by the metadata thread,
/// which copies the rest of the granule from the snapshot: the copy never lands over
/// the whole write's blocks. The block both writes touch may hold either's data (commands in
/// flight together have no order), every other block reads what wrote it last.
#[test]
fn whole_and_partial_granule_writes_in_flight_together_keep_each_others_blocks() {
    const GRANULES: u64 = 96; // a multiple of 32
    let dir = tempfile::tempdir().unwrap();
    let (node, nsid) = small_block_volume(dir.path());
    let (_admin, mut q) = node.queue();
    let before = pattern(1, (GRANULES * 4096) as usize);
    for (i, piece) in before.chunks(8192).enumerate() {
        q.write(nsid, i as u64 * 16, piece, 512, IN_CAPSULE).unwrap();
    }
    node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": "v-1" }));
    let mut want = before.clone();
    let mut either = Vec::new();
    for g in 0..GRANULES {
        let whole = pattern(100 + g, 4096);
        let small = pattern(1000 + g, 512);
        let block = g * 8 + g % 8;
        let mut send = |slba: u64, data: &[u8]| {
            let cid = q.alloc_cid();
            let cmd =
                Command::read_write(io_opcode::WRITE, cid, nsid, slba, (data.len() / 512) as u32, data.len() as u32);
            q.submit(cmd, data, true).unwrap();
        };
        // Either goes first on the wire; both are in flight together.
        if g % 2 == 0 {
            send(g * 8, &whole);
            send(block, &small);
        } else {
            send(block, &small);
            send(g * 8, &whole);
        }
        let at = (g * 4096) as usize;
        want[at..at + 4096].copy_from_slice(&whole);
        either.push((block, whole[(g % 8) as usize * 512..][..512].to_vec(), small));
        // Sixteen granules' writes in flight at a time, well inside the queue's depth.
        if g % 16 == 15 {
            for _ in 0..32 {
                let r = q.next_reply().unwrap();
                assert!(r.cqe.status.is_success(), "a write over the snapshot: {:?}", r.cqe.status);
            }
        }
    }
    let got: Vec<u8> = (0..GRANULES * 8 / 256).flat_map(|i| q.read(nsid, i * 256, 256, 512).unwrap()).collect();
    for (block, from_whole, from_small) in &either {
        let at = (*block * 512) as usize;
        let here = &got[at..at + 512];
        assert!(here == &from_whole[..] || here == &from_small[..], "block {block} holds neither write");
        want[at..at + 512].copy_from_slice(here);
    }
    for g in 0..GRANULES as usize {
        assert!(got[g * 4096..][..4096] == want[g * 4096..][..4096], "granule {g}: a block lost its whole write");
    }
    let snap = node.export("p", "v-1");
    for (i, piece) in before.chunks(32 * 4096).enumerate() {
        expect(&mut q, snap, i as u64 * 32, piece, "the snapshot under the writes");
    }
    node.ok("pool_check", json!({ "name": "p" }));
}

/// Writes `data` at `slba`, 128 KiB a command.
fn write_big(q: &mut Queue, nsid: u32, slba: u64, data: &[u8]) {
    for (i, piece) in data.chunks(32 * 4096).enumerate() {
        write(q, nsid, slba + i as u64 * 32, piece).unwrap();
    }
}

/// Fails naming the 4 KiB blocks in which `got` and `want` differ (not their bytes).
fn same_blocks(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let wrong: Vec<usize> =
        (0..got.len() / 4096).filter(|&b| got[b * 4096..][..4096] != want[b * 4096..][..4096]).collect();
    assert!(wrong.is_empty(), "{what}: {} blocks differ, the first {:?}", wrong.len(), &wrong[..wrong.len().min(16)]);
}

/// The first `clusters` clusters of namespace `nsid`, 128 KiB a read.
fn image(q: &mut Queue, nsid: u32, clusters: u64) -> Vec<u8> {
    (0..clusters * BLOCKS_PER_CLUSTER / 32).flat_map(|i| q.read(nsid, i * 32, 32, 4096).unwrap()).collect()
}

/// A node with pool `p` on two new disks of `disk_size` bytes in `dir`, and on it a
/// 32 MiB thin volume `v` exported (its namespace ID last).
fn thin_volume_node(dir: &Path, disk_size: u64) -> (Node, Vec<PathBuf>, u32) {
    let d = disks(dir, 2, disk_size);
    let node = Node::start(vec![]);
    node.ok("pool_create", json!({ "name": "p", "disks": d }));
    node.ok("volume_create", json!({ "pool": "p", "name": "v", "size": 32 * MIB, "thin": true }));
    let v = node.export("p", "v");
    (node, d, v)
}

/// A deleted snapshot that one layer alone lies over folds into it: its clusters move
/// to the layer where the layer has none, the granules the layer lacks are copied
/// where it has one, and what the layer rewrote is freed. Reads stay as they were,
/// the chain gets shorter (so snapshots taken and deleted in turn never reach the
/// chain's limit), and nothing is left but the volume's own clusters.
#[test]
fn a_deleted_snapshot_folds_into_the_layer_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let (node, d, v) = thin_volume_node(dir.path(), 64 * MIB);
    let (_admin, mut q) = node.queue();
    let cluster = |c: u64| c * BLOCKS_PER_CLUSTER;
    // Before the first snapshot: clusters 0 to 3, whole or a block of them.
    write_big(&mut q, v, cluster(0), &pattern(1, 64 * 4096));
    write(&mut q, v, cluster(1) + 9, &pattern(2, 4096)).unwrap();
    write_big(&mut q, v, cluster(2), &pattern(3, 256 * 4096));
    write(&mut q, v, cluster(3) + 200, &pattern(4, 8192)).unwrap();
    node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": "s1" }));
    // Over it: cluster 0 in part (the rest must come from s1), cluster 2 whole (s1's
    // goes), cluster 4 new; clusters 1 and 3 untouched (s1's move).
    write(&mut q, v, cluster(0) + 3, &pattern(5, 4096)).unwrap();
    write(&mut q, v, cluster(0) + 100, &pattern(6, 4096)).unwrap();
    write_big(&mut q, v, cluster(2), &pattern(7, 256 * 4096));
    write(&mut q, v, cluster(4) + 1, &pattern(8, 4096)).unwrap();
    node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": "s2" }));
    write(&mut q, v, cluster(1) + 10, &pattern(9, 4096)).unwrap();
    let s2 = node.export("p", "s2");
    let (want_v, want_s2) = (image(&mut q, v, 6), image(&mut q, s2, 6));

    // s1 lies under s2 alone: it folds into s2, which reads as before.
    node.ok("volume_delete", json!({ "pool": "p", "name": "s1" }));
    assert_eq!(image(&mut q, s2, 6), want_s2, "s2 after s1 folded into it");
    assert_eq!(image(&mut q, v, 6), want_v, "the volume after s1 folded into s2");
    let names = |node: &Node| -> Vec<String> {
        let list = node.ok("volume_list", json!({ "pool": "p" }));
        list.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap().to_string()).collect()
    };
    assert_eq!(names(&node), ["v", "s2"]);
    assert_eq!(node.ok("volume_get", json!({ "pool": "p", "name": "s2" }))["parent"], json!(""));
    node.ok("pool_check", json!({ "name": "p" }));
    // s2, deleted while exported to nobody, folds into the volume under its writes:
    // first writes to granules of cluster 1, which the volume holds in part (the
    // fold copies the others into it from s2), and writes to a cluster s2 lacks.
    node.ok("namespace_remove", json!({ "nqn": NQN, "nsid": s2 }));
    let in_part: Vec<u64> = (0..BLOCKS_PER_CLUSTER).map(|i| cluster(1) + (i * 7 + 3) % BLOCKS_PER_CLUSTER).collect();
    let writer = {
        let (addr, in_part) = (node.addr, in_part.clone());
        std::thread::spawn(move || {
            let (_admin, mut io) = queue_at(addr);
            for (i, &b) in in_part.iter().enumerate() {
                write(&mut io, 1, b, &pattern(700 + i as u64, 4096)).unwrap();
            }
            for i in 0..200u64 {
                write(&mut io, 1, cluster(8) + i, &pattern(100 + i, 4096)).unwrap();
            }
        })
    };
    node.ok("volume_delete", json!({ "pool": "p", "name": "s2" }));
    writer.join().unwrap();
    let mut want_v = want_v;
    for (i, &b) in in_part.iter().enumerate() {
        let at = (b * 4096) as usize;
        want_v[at..at + 4096].copy_from_slice(&pattern(700 + i as u64, 4096));
    }
    same_blocks(&image(&mut q, v, 6), &want_v, "the volume after s2 folded into it");
    expect(&mut q, v, cluster(8) + 199, &pattern(299, 4096), "a write beside the fold");
    assert_eq!(names(&node), ["v"]);
    assert_eq!(node.ok("volume_get", json!({ "pool": "p", "name": "v" }))["parent"], json!(""));
    let pool = node.ok("pool_list", json!({}))[0].clone();
    assert_eq!(pool["used_bytes"], json!(allocated(&node, "p", "v")), "only the volume's own clusters: {pool}");
    assert_eq!(pool["snapshot_bytes"], json!(0), "{pool}");
    node.ok("pool_check", json!({ "name": "p" }));

    // Snapshots taken and deleted in turn, past the 16 a chain holds.
    for i in 0..20u64 {
        let name = format!("t{i}");
        node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": name }));
        write(&mut q, v, cluster(i % 6) + i, &pattern(200 + i, 4096)).unwrap();
        node.ok("volume_delete", json!({ "pool": "p", "name": name }));
    }
    let want_v = image(&mut q, v, 6);
    q.flush(v).unwrap();
    drop((_admin, q));
    drop(node);
    let node = Node::start(vec![PoolConfig { disks: d.clone(), create: None }]);
    let v = node.export("p", "v");
    let (_admin, mut q) = node.queue();
    assert_eq!(image(&mut q, v, 6), want_v, "the volume after a restart");
    assert_eq!(names(&node), ["v"]);
    node.ok("pool_check", json!({ "name": "p" }));
}

/// A clone inflated under writes stands alone: every cluster it read from the
/// snapshots under it (whole there, or held in part by it) is its own and whole, it
/// lies over nothing, and the snapshots and their origin go with all their space,
/// while the clone reads as before and keeps the writes made during the inflation,
/// across a restart too.
#[test]
fn an_inflated_clone_stands_alone_and_its_snapshots_can_go() {
    let dir = tempfile::tempdir().unwrap();
    let (node, d, v) = thin_volume_node(dir.path(), 96 * MIB);
    let (_admin, mut q) = node.queue();
    let cluster = |c: u64| c * BLOCKS_PER_CLUSTER;
    // The origin: 24 clusters, whole or a few blocks of each; then a second snapshot
    // over writes to some of them, so the clone reads through two.
    for c in 0..24 {
        match c % 3 {
            0 => write_big(&mut q, v, cluster(c), &pattern(c, 256 * 4096)),
            _ => write(&mut q, v, cluster(c) + c * 7, &pattern(c, 8192)).unwrap(),
        }
    }
    node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": "s1" }));
    for c in (0..24).step_by(4) {
        write(&mut q, v, cluster(c) + 100, &pattern(50 + c, 4096)).unwrap();
    }
    node.ok("snapshot_create", json!({ "pool": "p", "volume": "v", "name": "s2" }));
    node.ok("volume_clone", json!({ "pool": "p", "snapshot": "s2", "name": "c" }));
    let c = node.export("p", "c");
    // The clone's own writes before the inflation: in part over the snapshots, and
    // a cluster they do not have.
    write(&mut q, c, cluster(1) + 200, &pattern(90, 4096)).unwrap();
    write(&mut q, c, cluster(26) + 5, &pattern(91, 4096)).unwrap();
    let mut want = image(&mut q, c, 28);

    // Writes during the inflation: 4 KiB blocks over every kind of cluster.
    let blocks: Vec<u64> = (0..600u64).map(|i| (i * 7919) % cluster(28)).collect();
    let written = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writer = {
        let (addr, blocks, written) = (node.addr, blocks.clone(), written.clone());
        std::thread::spawn(move || {
            let (_admin, mut io) = queue_at(addr);
            for (i, &b) in blocks.iter().enumerate() {
                write(&mut io, c, b, &pattern(1000 + i as u64, 4096)).unwrap();
                written.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        })
    };
    while written.load(std::sync::atomic::Ordering::SeqCst) < 10 {
        std::thread::yield_now();
    }
    let started = node.ok("volume_inflate", json!({ "pool": "p", "name": "c" }));
    assert_eq!(started["parent"], json!("s2"), "{started}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let inflated = loop {
        let got = node.ok("volume_get", json!({ "pool": "p", "name": "c" }));
        assert!(got["inflating"]["stopped"].is_null(), "{got}");
        if got.get("inflating").is_none() {
            break got;
        }
        assert!(std::time::Instant::now() < deadline, "still inflating after 60 s: {got}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert_eq!(inflated["parent"], json!(""), "the clone lies over nothing once inflated: {inflated}");
    let during = written.load(std::sync::atomic::Ordering::SeqCst);
    eprintln!("the clone took writes 10 to {during} of {} while it inflated", blocks.len());
    writer.join().unwrap();
    for (i, &b) in blocks.iter().enumerate() {
        let at = (b * 4096) as usize;
        want[at..at + 4096].copy_from_slice(&pattern(1000 + i as u64, 4096));
    }
    same_blocks(&image(&mut q, c, 28), &want, "the clone after its inflation");
    node.ok("pool_check", json!({ "name": "p" }));

    let refused = node.call("volume_inflate", json!({ "pool": "p", "name": "s1" })).unwrap_err();
    assert!(refused.to_string().contains("is a snapshot"), "{refused}");

    // Its origin and snapshots go, and all their space with them.
    node.ok("namespace_remove", json!({ "nqn": NQN, "nsid": v }));
    for name in ["v", "s2", "s1"] {
        node.ok("volume_delete", json!({ "pool": "p", "name": name }));
    }
    let list = node.ok("volume_list", json!({ "pool": "p" }));
    let names: Vec<&str> = list.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["c"]);
    let pool = node.ok("pool_list", json!({}))[0].clone();
    assert_eq!(pool["used_bytes"], json!(allocated(&node, "p", "c")), "only the clone's clusters: {pool}");
    same_blocks(&image(&mut q, c, 28), &want, "the clone once its snapshots are gone");
    node.ok("pool_check", json!({ "name": "p" }));
    // Inflating a volume that lies over nothing does nothing.
    assert!(node.ok("volume_inflate", json!({ "pool": "p", "name": "c" })).get("inflating").is_none());

    q.flush(c).unwrap();
    drop((_admin, q));
    drop(node);
    let node = Node::start(vec![PoolConfig { disks: d.clone(), create: None }]);
    let c = node.export("p", "c");
    let (_admin, mut q) = node.queue();
    same_blocks(&image(&mut q, c, 28), &want, "the clone after a restart");
    node.ok("pool_check", json!({ "name": "p" }));
}

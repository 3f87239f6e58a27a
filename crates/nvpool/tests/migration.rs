//! Hot migration with real processes: three engines with their agents and one
//! controller. A host writes to a volume (going over to another path when one goes
//! away, as a multipath host does) while the controller moves the volume to another
//! node; then a cancelled move, a move whose target dies, and `--auto`.

mod cluster;

use cluster::*;
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::Code;

const MIB: u64 = 1 << 20;
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-1111-2222-3333-444455556666";
const BLOCK: usize = 4096;
const BLOCKS: u64 = 64 * MIB / BLOCK as u64;
/// Status code type 3: path-related (ANA states), which a multipath host retries on
/// another path.
const PATH_RELATED: u8 = 3;

fn addr(n: &Node) -> SocketAddr {
    format!("127.0.0.1:{}", n.nvme_port).parse().unwrap()
}

/// One path of the host: an admin queue (which makes the host "connected") and an
/// I/O queue.
struct HostPath {
    _admin: Queue,
    io: Queue,
}

fn connect(at: SocketAddr, nqn: &str) -> Option<HostPath> {
    let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(nqn, HOST) };
    let mut admin = connect_admin(at, &o).ok()?;
    admin.set_queue_count(1).ok()?;
    let io = Queue::connect(at, &o.io(1, admin.cntlid, 31)).ok()?;
    Some(HostPath { _admin: admin, io })
}

/// What each block holds: the seed of its last write.
type Model = Arc<Mutex<HashMap<u64, u64>>>;

/// Writes random blocks through the first path that works, moving to the next when a
/// path fails or answers with a path error (as the kernel's multipath does), until
/// stopped. Returns (writes, errors that reached the "application").
fn host_writer(
    paths: Vec<SocketAddr>,
    nqn: String,
    model: Model,
    stop: Arc<AtomicBool>,
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
            let lba = x % (BLOCKS / 2);
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
                        assert!(started.elapsed() < Duration::from_secs(30), "no path took the write for 30 s");
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

fn verify(at: SocketAddr, nqn: &str, model: &Model, through: &str) {
    let mut p = connect(at, nqn).unwrap_or_else(|| panic!("connect through {through}"));
    for (&lba, &seed) in model.lock().unwrap().iter() {
        let got = p.io.read(1, lba, 1, BLOCK as u32).unwrap_or_else(|e| panic!("read {lba} through {through}: {e}"));
        assert!(got == pattern(seed, BLOCK), "block {lba} through {through} is not what was last written");
    }
}

async fn get(c: &Controllers, name: &str) -> proto::Volume {
    let req = proto::VolumeName { name: name.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

async fn migrate(c: &Controllers, name: &str, to: &str, rate: u64) -> Result<proto::Volume, tonic::Status> {
    let req =
        proto::MigrateVolumeRequest { name: name.into(), to_node: to.into(), auto: to.is_empty(), rate, pause_ms: 500 };
    c.call(async |mut c| c.migrate_volume(req.clone()).await).await
}

/// Waits for the volume's migration to end; returns the volume.
async fn settled(c: &Controllers, name: &str, limit: Duration) -> proto::Volume {
    wait_for("the migration to end", limit, async || {
        let v = get(c, name).await;
        v.migration.is_none().then_some(v)
    })
    .await
}

fn engine_has_volume(n: &Node, engine_name: &str) -> bool {
    n.engine_call(nvpool_api::ListVolumes { pool: None }).iter().any(|v| v.name == engine_name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_moves_under_a_writing_host_and_failed_moves_leave_it_in_place() {
    // NVPOOL_KEEP_TEST_DIR=1 keeps the processes' logs for a look after a failure.
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let mut nodes_: Vec<Node> = ["n1", "n2", "n3"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3"]).await;

    let req =
        proto::CreateVolumeRequest { thin: true, include_nodes: vec!["n1".into()], ..create_request("mv", 64 * MIB) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: "mv".into(), host_nqn: HOST.into(), ..Default::default() };
    let paths = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap().paths;
    let path_nodes: Vec<&str> = paths.iter().map(|p| p.node.as_str()).collect();
    assert_eq!(path_nodes, ["n1", "n2", "n3"]);

    // The host writes through its optimized path, n1, and keeps a connection to n2
    // (one of its paths, and the target), as a multipath host does.
    let nqn = v.subsystem_nqn.clone();
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = host_writer(vec![addr(&nodes_[0]), addr(&nodes_[1])], nqn.clone(), model.clone(), stop.clone());
    let _n2_path = connect(addr(&nodes_[1]), &nqn).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Bad requests first.
    let e = migrate(&c, "mv", "n1", 0).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
    let e = migrate(&c, "mv", "n9", 0).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());
    let e = migrate(&c, "nothing", "n2", 0).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());

    let started = Instant::now();
    let moving = migrate(&c, "mv", "n2", 0).await.unwrap();
    let m = moving.migration.clone().unwrap();
    assert_eq!((m.from_node.as_str(), m.to_node.as_str(), m.phase.as_str()), ("n1", "n2", "preparing"));
    let e = migrate(&c, "mv", "n3", 0).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{}", e.message());
    let moved = settled(&c, "mv", Duration::from_secs(60)).await;
    println!("{} (controller's view, {:?} from the request)", moved.last_migration, started.elapsed());
    assert!(moved.last_migration.starts_with("moved from n1 to n2"), "{}", moved.last_migration);
    assert_eq!((moved.node.as_str(), moved.pool.as_str()), ("n2", "n2-pool"));
    let after: Vec<(String, String)> =
        moved.attachments[0].paths.iter().map(|p| (p.node.clone(), p.ana_state.clone())).collect();
    assert_eq!(after, [("n2".to_string(), "optimized".to_string()), ("n3".to_string(), "non-optimized".to_string())]);

    // The host goes on writing through n1 (which forwards, then goes away) and n2.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    println!("the host wrote {writes} blocks, {errors} errors");
    assert_eq!(errors, 0);
    wait_for("n1 to drop the volume's export", Duration::from_secs(15), async || {
        let subsystems = nodes_[0].engine_call(nvpool_api::ListSubsystems {});
        (!subsystems.iter().any(|s| s.nqn == nqn)).then_some(())
    })
    .await;
    assert!(!engine_has_volume(&nodes_[0], &format!("pv-{}", v.id)), "n1 keeps no copy");
    verify(addr(&nodes_[1]), &nqn, &model, "n2, the new owner");
    verify(addr(&nodes_[2]), &nqn, &model, "n3, which forwards to n2 now");

    // A cancelled move: the copy is slow (1 MiB/s), the target's volume goes again.
    migrate(&c, "mv", "n3", MIB).await.unwrap();
    wait_for("the copy to start", Duration::from_secs(30), async || {
        get(&c, "mv").await.migration.filter(|m| m.phase == "copying").map(|_| ())
    })
    .await;
    let req = proto::VolumeName { name: "mv".into() };
    let cancelled = c.call(async |mut c| c.cancel_migration(req.clone()).await).await.unwrap();
    assert!(cancelled.migration.is_none());
    assert!(cancelled.last_migration.contains("cancelled"), "{}", cancelled.last_migration);
    assert_eq!(cancelled.node, "n2");
    wait_for("n3 to remove the target's volume", Duration::from_secs(15), async || {
        (!engine_has_volume(&nodes_[2], &format!("pv-{}", v.id))).then_some(())
    })
    .await;

    // A move whose target dies: rolled back after the node timeout, the data stays.
    migrate(&c, "mv", "n3", MIB).await.unwrap();
    wait_for("the copy to start", Duration::from_secs(30), async || {
        get(&c, "mv").await.migration.filter(|m| m.phase == "copying").map(|_| ())
    })
    .await;
    nodes_[2].agent.kill();
    nodes_[2].engine.kill();
    let failed = settled(&c, "mv", Duration::from_secs(30)).await;
    println!("{}", failed.last_migration);
    assert!(
        failed.last_migration.contains("failed") && failed.last_migration.contains("n3"),
        "{}",
        failed.last_migration
    );
    assert_eq!(failed.node, "n2");
    verify(addr(&nodes_[1]), &nqn, &model, "n2 after the failed move");

    // --auto: the scheduler picks a healthy node other than n2: n1. The host connects
    // the new path once it is there.
    let auto = migrate(&c, "mv", "", 0).await.unwrap();
    assert_eq!(auto.migration.unwrap().to_node, "n1");
    let _n1_path =
        wait_for("the host to connect to n1", Duration::from_secs(30), async || connect(addr(&nodes_[0]), &nqn)).await;
    let back = settled(&c, "mv", Duration::from_secs(60)).await;
    assert!(back.last_migration.starts_with("moved from n2 to n1"), "{}", back.last_migration);
    verify(addr(&nodes_[0]), &nqn, &model, "n1 after the move back");
}

//! Hot migration with real processes: three engines with their agents and one
//! controller. A host writes to a volume (going over to another path when one goes
//! away, as a multipath host does) while the controller moves the volume to another
//! node; then a cancelled move, a move rolled back while the owner's engine is away,
//! a move whose target dies, and `--auto`.

mod cluster;

use cluster::{
    BIN, BLOCK, HOST, LogsOnFailure, Model, Node, addr, connect, create_request, free_port, hold_paths, host_writer,
    start_controller, verify, volumes, wait_for, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tonic::Code;

const MIB: u64 = 1 << 20;
const BLOCKS: u64 = 64 * MIB / BLOCK as u64;

async fn get(c: &Controllers, name: &str) -> proto::Volume {
    let req = proto::VolumeName { name: name.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

/// Starts a move; retried while the controller says to retry (an earlier move's copy
/// on the target is still being removed).
async fn migrate(c: &Controllers, name: &str, to: &str, rate: u64) -> Result<proto::Volume, tonic::Status> {
    let req = proto::MigrateVolumeRequest {
        name: name.into(),
        to_node: to.into(),
        auto: to.is_empty(),
        rate,
        pause_ms: 500,
        from_node: String::new(),
    };
    let start = Instant::now();
    loop {
        match c.call(async |mut c| c.migrate_volume(req.clone()).await).await {
            Err(e) if e.code() == Code::Unavailable && start.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            r => return r,
        }
    }
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
    let _logs = LogsOnFailure(root.path());
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
    let writer =
        host_writer(vec![addr(&nodes_[0]), addr(&nodes_[1])], nqn.clone(), model.clone(), stop.clone(), BLOCKS / 2);
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

    // A move rolled back while the owner's engine is away. The target's volume goes
    // (and the node may become an access point again, once the owner is back): until
    // then no write through it may be taken, which would go with the volume.
    migrate(&c, "mv", "n3", MIB).await.unwrap();
    wait_for("the copy to start", Duration::from_secs(30), async || {
        get(&c, "mv").await.migration.filter(|m| m.phase == "copying").map(|_| ())
    })
    .await;
    nodes_[1].engine.kill();
    let req = proto::VolumeName { name: "mv".into() };
    let _ = c.call(async |mut c| c.cancel_migration(req.clone()).await).await;
    let back = settled(&c, "mv", Duration::from_secs(30)).await;
    assert_eq!(back.node, "n2", "{}", back.last_migration);
    let block = nvpool_initiator::pattern(11, BLOCK);
    let closed_until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < closed_until {
        if let Some(mut p) = connect(addr(&nodes_[2]), &nqn) {
            let wrote = p.io.write(1, BLOCKS - 1, &block, BLOCK as u32, 0);
            assert!(wrote.is_err(), "n3 took a write while the owner was away");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    nodes_[1].start_engine(true);
    wait_for("a write through n3 to reach n2", Duration::from_secs(30), async || {
        let mut p = connect(addr(&nodes_[2]), &nqn)?;
        p.io.write(1, BLOCKS - 1, &block, BLOCK as u32, 0).ok()
    })
    .await;
    let mut p = connect(addr(&nodes_[1]), &nqn).unwrap();
    assert!(p.io.read(1, BLOCKS - 1, 1, BLOCK as u32).unwrap() == block, "the write through n3, read through n2");
    verify(addr(&nodes_[1]), &nqn, &model, "n2 after the move rolled back while its engine was away");

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

    // `nvpool node drain n1` (the CLI) moves n1's volumes to the only other healthy
    // node, by their placement rules: two that prefer n1 (one attached and written,
    // one no host uses); the host connects the new paths as they appear, as a CSI node
    // does. A volume that may only be on n1 (--include n1) cannot move: it goes first.
    let req = proto::VolumeName { name: "mv".into() };
    c.call(async |mut c| c.delete_volume(req.clone()).await).await.unwrap();
    let local = |name: &str| proto::CreateVolumeRequest {
        locality: proto::Locality::Local as i32,
        host_node: "n1".into(),
        ..create_request(name, 8 * MIB)
    };
    let mut drained_nqn = String::new();
    for name in ["busy", "idle"] {
        let req = local(name);
        let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
        assert_eq!(v.node, "n1");
        if name == "busy" {
            drained_nqn = v.subsystem_nqn.clone();
            let attach = proto::AttachRequest { volume: name.into(), host_nqn: HOST.into(), ..Default::default() };
            c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
        }
    }
    let data = nvpool_initiator::pattern(7, 16 * BLOCK);
    let mut p = connect(addr(&nodes_[0]), &drained_nqn).unwrap();
    p.io.write(1, 0, &data, BLOCK as u32, 0).unwrap();
    let stop_holding = Arc::new(AtomicBool::new(false));
    let holder = hold_paths(vec![addr(&nodes_[0]), addr(&nodes_[1])], drained_nqn.clone(), stop_holding.clone());
    let address = controller.address.clone();
    let drain = tokio::task::spawn_blocking(move || {
        std::process::Command::new(BIN).args(["node", "drain", "n1", "--controller", &address]).output().unwrap()
    })
    .await
    .unwrap();
    stop_holding.store(true, Ordering::SeqCst);
    holder.join().unwrap();
    let said = String::from_utf8_lossy(&drain.stdout);
    println!("nvpool node drain n1:\n{said}{}", String::from_utf8_lossy(&drain.stderr));
    assert!(drain.status.success() && said.contains("node n1 drained: 2 volumes moved"), "{said}");
    let left: Vec<String> = volumes(&c).await.into_iter().filter(|v| v.node == "n1").map(|v| v.name).collect();
    assert!(left.is_empty(), "still on n1: {left:?}");
    let mut p = connect(addr(&nodes_[1]), &drained_nqn).unwrap();
    assert!(p.io.read(1, 0, 16, BLOCK as u32).unwrap() == data, "the drained volume's data, read through n2");
}

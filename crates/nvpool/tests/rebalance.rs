//! The rebalancer with real processes: three engines with their agents and one
//! controller that looks for moves every 500 ms.
//!
//! - **Room, then home.** A local volume whose node is full goes elsewhere at once.
//!   The rebalancer moves a volume that did not ask for that node off it (not the
//!   pinned one), then brings the local volume home, while a host writes to it.
//! - **Hole.** A volume that fits nowhere is refused with word that room is being
//!   made. The rebalancer moves a volume off the node that needs the fewest bytes
//!   moved, and the retried creation lands there.
//!
//! Every moved volume's data is read back, and the host sees no I/O error.

mod cluster;

use cluster::{
    BLOCK, HOST, LogsOnFailure, Model, Node, addr, connect, create_request, free_port, hold_paths, host_writer,
    start_controller_with, verify, wait_for, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tonic::Code;

const MIB: u64 = 1 << 20;

async fn get(c: &Controllers, name: &str) -> proto::Volume {
    let req = proto::VolumeName { name: name.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

async fn create(c: &Controllers, req: proto::CreateVolumeRequest) -> Result<proto::Volume, tonic::Status> {
    c.call(async |mut c| c.create_volume(req.clone()).await).await.map(|r| r.volume.unwrap())
}

/// A volume that prefers `node` among `include` (it is remote to the other one).
fn on(name: &str, size: u64, node: &str, include: [&str; 2]) -> proto::CreateVolumeRequest {
    let other = include.iter().find(|n| **n != node).unwrap();
    proto::CreateVolumeRequest {
        locality: proto::Locality::Remote as i32,
        host_node: other.to_string(),
        include_nodes: include.map(String::from).to_vec(),
        ..create_request(name, size)
    }
}

/// Attaches the test host and writes `blocks` blocks of a pattern through `node`.
async fn attach_and_fill(c: &Controllers, v: &proto::Volume, node: &Node, seed: u64) -> Model {
    let attach = proto::AttachRequest { volume: v.name.clone(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let model: Model = Arc::default();
    let mut p = connect(addr(node), &v.subsystem_nqn).unwrap();
    for lba in (0..64).map(|i| i * 97) {
        let data = nvpool_initiator::pattern(seed + lba, BLOCK);
        p.io.write(1, lba, &data, BLOCK as u32, 0).unwrap();
        model.lock().unwrap().insert(lba, seed + lba);
    }
    model
}

/// Waits until the volume sits on `node` with no migration under way.
async fn settled_on(c: &Controllers, name: &str, node: &str) -> proto::Volume {
    wait_for(&format!("{name} to settle on {node}"), Duration::from_secs(90), async || {
        let v = get(c, name).await;
        (v.node == node && v.migration.is_none()).then_some(v)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rebalancer_brings_local_volumes_home_and_makes_holes() {
    // NVPOOL_KEEP_TEST_DIR=1 keeps the processes' logs for a look after a failure.
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller_with(root.path(), &store, free_port(), "1", &["--rebalance-every", "500ms"]);
    let mut nodes_: Vec<Node> = ["n1", "n2", "n3"].iter().map(|n| Node::new(root.path(), n, 512 * MIB)).collect();
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3"]).await;
    let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
    let capacity = pools.iter().map(|p| p.pool.as_ref().unwrap().capacity_bytes).min().unwrap();
    // A share of a pool, in whole 4 MiB.
    let part = |share: f64| (capacity as f64 * share) as u64 / (4 * MIB) * (4 * MIB);
    println!("pools of {} MiB", capacity / MIB);

    // Room, then home. n1 holds a pinned volume and one that may be on n1 or n2.
    let pinned = create(&c, proto::CreateVolumeRequest { pinned: true, ..on("pinned", part(0.3), "n1", ["n1", "n3"]) })
        .await
        .unwrap();
    let filler = create(&c, on("filler", part(0.5), "n1", ["n1", "n2"])).await.unwrap();
    assert_eq!((pinned.node.as_str(), filler.node.as_str()), ("n1", "n1"));
    let filler_data = attach_and_fill(&c, &filler, &nodes_[0], 1000).await;
    let local = proto::CreateVolumeRequest {
        locality: proto::Locality::Local as i32,
        host_node: "n1".into(),
        ..create_request("db", part(0.3))
    };
    let db = create(&c, local).await.unwrap();
    println!("db, local to n1, placed on {} (awaiting home: {})", db.node, db.awaiting_home);
    assert_ne!(db.node, "n1", "n1 has no room for db");
    assert!(db.awaiting_home);

    // A host writes to db through every path it is given, as a multipath host does,
    // and keeps a connection to every node exporting db or the filler.
    let attach = proto::AttachRequest { volume: "db".into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let all: Vec<_> = nodes_.iter().map(addr).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let holders = [
        hold_paths(all.clone(), db.subsystem_nqn.clone(), stop.clone()),
        hold_paths(all.clone(), filler.subsystem_nqn.clone(), stop.clone()),
    ];
    let db_paths = vec![addr(&nodes_[if db.node == "n2" { 1 } else { 2 }]), addr(&nodes_[0])];
    let db_data: Model = Arc::default();
    let writer = host_writer(db_paths, db.subsystem_nqn.clone(), db_data.clone(), stop.clone(), 2048);

    let home = settled_on(&c, "db", "n1").await;
    println!("db: {}", home.last_migration);
    assert!(!home.awaiting_home);
    let filler = get(&c, "filler").await;
    println!("filler: {}", filler.last_migration);
    assert_eq!(filler.node, "n2", "the filler made room on n1");
    assert_eq!(get(&c, "pinned").await.node, "n1", "the pinned volume stayed");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    for h in holders {
        h.join().unwrap();
    }
    println!("the host wrote {writes} blocks to db while it and the filler moved: {errors} errors");
    assert_eq!(errors, 0);
    verify(addr(&nodes_[0]), &home.subsystem_nqn, &db_data, "n1, db's home");
    verify(addr(&nodes_[1]), &filler.subsystem_nqn, &filler_data, "n2, the filler's new node");

    // Hole. Start again: pinned volumes leave n1 0.6, n2 0.35 and n3 0.3 of their
    // pools; a movable volume on n1 (it may go to n2) leaves it 0.3.
    for name in ["db", "filler", "pinned"] {
        let req = proto::VolumeName { name: name.into() };
        c.call(async |mut c| c.delete_volume(req.clone()).await).await.unwrap();
    }
    wait_for("the pools to be empty", Duration::from_secs(30), async || {
        let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
        pools.iter().all(|p| p.committed_bytes == 0 && p.pool.as_ref().unwrap().volumes == 0).then_some(())
    })
    .await;
    for (node, share) in [("n1", 0.4), ("n2", 0.65), ("n3", 0.7)] {
        let req = proto::CreateVolumeRequest {
            pinned: true,
            include_nodes: vec![node.into()],
            ..create_request(&format!("pinned-{node}"), part(share))
        };
        create(&c, req).await.unwrap();
    }
    let movable = create(&c, on("movable", part(0.3), "n1", ["n1", "n2"])).await.unwrap();
    assert_eq!(movable.node, "n1");
    let movable_data = attach_and_fill(&c, &movable, &nodes_[0], 2000).await;
    let stop = Arc::new(AtomicBool::new(false));
    let holder = hold_paths(all.clone(), movable.subsystem_nqn.clone(), stop.clone());

    let big = create_request("big", part(0.5));
    let refused = create(&c, big.clone()).await.unwrap_err();
    println!("{}", refused.message());
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert!(refused.message().contains("the rebalancer is making room on n1"), "{}", refused.message());
    // A provisioner retries.
    let placed =
        wait_for("big to be created", Duration::from_secs(90), async || create(&c, big.clone()).await.ok()).await;
    assert_eq!(placed.node, "n1");
    let movable = settled_on(&c, "movable", "n2").await;
    println!("movable: {}", movable.last_migration);
    stop.store(true, Ordering::SeqCst);
    holder.join().unwrap();
    verify(addr(&nodes_[1]), &movable.subsystem_nqn, &movable_data, "n2, the moved volume's new node");
    for name in ["pinned-n1", "pinned-n2", "pinned-n3"] {
        assert_eq!(get(&c, name).await.last_migration, "", "{name} never moved");
    }
}

//! Snapshots and clones through the controller, with real processes: two engines
//! with their agents and one controller, a host writing through an access point.
//!
//! - A snapshot keeps the volume's data as it was; the volume goes on changing.
//! - A volume made from the snapshot (larger than it) reads the snapshot's data and
//!   zeroes past it; a clone of a volume reads the volume as it was when cloned;
//!   writes to either touch nothing else.
//! - Retried calls return what the first made; wrong ones get clear errors; a
//!   volume with snapshots refuses to move, saying why.
//! - Snapshots survive a new controller; the pool reports the bytes they hold.
//! - A snapshot outlives its volume, and the clones outlive both; once all are
//!   deleted the pool is empty: nothing leaked.
//! - Limits apply to a clone as to any volume.
//! - A clone inflated holds all its data: it reads as before, depends on nothing
//!   and moves to another node.

mod cluster;

use cluster::{
    BLOCK, HOST, LogsOnFailure, Node, addr, connect, create_request, free_port, start_controller, wait_for,
    wait_healthy,
};
use nvpool_api::{CheckPool, ListPools, ListSubsystems, ListVolumes, QosLimits};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_initiator::pattern;
use std::time::Duration;
use tonic::Code;

const MIB: u64 = 1 << 20;
/// Blocks each test write covers: 64 KiB, at the start of a mebibyte.
const SPAN: u32 = 16;

async fn volume(c: &Controllers, name: &str) -> proto::Volume {
    let req = proto::VolumeName { name: name.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

async fn create(
    c: &Controllers,
    req: proto::CreateVolumeRequest,
) -> Result<proto::CreateVolumeResponse, tonic::Status> {
    c.call(async |mut c| c.create_volume(req.clone()).await).await
}

async fn snapshot(c: &Controllers, volume: &str, name: &str) -> Result<proto::Snapshot, tonic::Status> {
    let req = proto::CreateSnapshotRequest { volume: volume.into(), name: name.into() };
    c.call(async |mut c| c.create_snapshot(req.clone()).await).await
}

/// Attaches the test host and connects it through `at`.
async fn open(c: &Controllers, name: &str, at: &Node) -> cluster::HostPath {
    let attach = proto::AttachRequest { volume: name.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let nqn = volume(c, name).await.subsystem_nqn;
    wait_for(&format!("a path to {name}"), Duration::from_secs(20), async || connect(addr(at), &nqn)).await
}

fn write(p: &mut cluster::HostPath, lba: u64, seed: u64) {
    p.io.write(1, lba, &pattern(seed, SPAN as usize * BLOCK), BLOCK as u32, 0).unwrap();
    p.io.flush(1).unwrap();
}

fn holds(p: &mut cluster::HostPath, lba: u64, seed: u64) -> bool {
    p.io.read(1, lba, SPAN, BLOCK as u32).unwrap() == pattern(seed, SPAN as usize * BLOCK)
}

fn zeroes(p: &mut cluster::HostPath, lba: u64) -> bool {
    p.io.read(1, lba, SPAN, BLOCK as u32).unwrap().iter().all(|&b| b == 0)
}

/// Block address of mebibyte `m`.
fn mib(m: u64) -> u64 {
    m * MIB / BLOCK as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_clones_through_the_controller_outlive_their_sources() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let port = free_port();
    let mut controller = start_controller(root.path(), &store, port, "1");
    let mut nodes: Vec<Node> = ["n1", "n2"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2"]).await;
    let (n1, n2) = (&nodes[0], &nodes[1]);

    // The origin, on n1, written through n2 (an access point forwarding to n1).
    let req = proto::CreateVolumeRequest { include_nodes: vec!["n1".into()], ..create_request("origin", 16 * MIB) };
    create(&c, req).await.unwrap();
    let mut origin = open(&c, "origin", n2).await;
    for m in 0..4 {
        write(&mut origin, mib(m), 100 + m);
    }

    let s1 = snapshot(&c, "origin", "s1").await.unwrap();
    assert_eq!((s1.state.as_str(), s1.volume.as_str(), s1.node.as_str()), ("ready", "origin", "n1"));
    assert_eq!(s1.size_bytes, 16 * MIB);
    println!("snapshot s1 held origin's I/O for {} us", s1.pause_us);
    // The host's connection went on through the snapshot; the volume changes on.
    write(&mut origin, mib(0), 200);
    write(&mut origin, mib(2), 202);

    // Retries return what the first call made; wrong calls say what is wrong.
    assert_eq!(snapshot(&c, "origin", "s1").await.unwrap().id, s1.id, "a retried snapshot is the same one");
    let other = create(&c, create_request("other", 4 * MIB)).await.unwrap().volume.unwrap();
    let e = snapshot(&c, &other.name, "s1").await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{}", e.message());
    let e = snapshot(&c, "nowhere", "s9").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());
    let e = snapshot(&c, "origin", "bad name").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
    let from = |name: &str, snap: &str, size: u64| proto::CreateVolumeRequest {
        from_snapshot: snap.into(),
        ..create_request(name, size)
    };
    let e = create(&c, from("r", "missing", 0)).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());
    let e = create(&c, from("r", "s1", 8 * MIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "a clone smaller than its snapshot: {}", e.message());
    let e = create(&c, proto::CreateVolumeRequest { replicas: 2, ..from("r", "s1", 0) }).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{}", e.message());
    let migrate = proto::MigrateVolumeRequest { name: "origin".into(), to_node: "n2".into(), ..Default::default() };
    let e = c.call(async |mut c| c.migrate_volume(migrate.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("snapshots") && e.message().contains("stays on n1"), "{}", e.message());

    // A volume from the snapshot, larger than it: the snapshot's data, zeroes after.
    let restored = create(&c, from("restored", "s1", 32 * MIB)).await.unwrap().volume.unwrap();
    assert_eq!((restored.node.as_str(), restored.from_snapshot.as_str()), ("n1", "s1"));
    assert_eq!(restored.size_bytes, 32 * MIB);
    let again = create(&c, from("restored", "s1", 32 * MIB)).await.unwrap();
    assert!(again.existed, "a retried creation from a snapshot returns the volume made");
    let mut r = open(&c, "restored", n2).await;
    for m in 0..4 {
        assert!(holds(&mut r, mib(m), 100 + m), "restored MiB {m} is not the snapshot's");
    }
    assert!(zeroes(&mut r, mib(20)), "restored reads zeroes past the snapshot's size");
    write(&mut r, mib(1), 301);
    write(&mut r, mib(20), 320);
    // Limits apply to a clone as to any volume, on every path to it.
    let limits = QosLimits { iops: 4000, bps: 32 * MIB, ..Default::default() };
    let qos = proto::SetVolumeQosRequest { name: "restored".into(), qos: Some(limits.into()) };
    c.call(async |mut c| c.set_volume_qos(qos.clone()).await).await.unwrap();
    for n in [n1, n2] {
        wait_for("the clone's limits on every path", Duration::from_secs(20), async || {
            let subsystems = n.engine_call(ListSubsystems {});
            let s = subsystems.into_iter().find(|s| s.nqn == restored.subsystem_nqn)?;
            s.namespaces.iter().any(|ns| ns.qos == limits).then_some(())
        })
        .await;
    }

    // A clone of the volume as it is now.
    let req = proto::CreateVolumeRequest { clone_of: "origin".into(), ..create_request("copy", 0) };
    let copy = create(&c, req).await.unwrap().volume.unwrap();
    assert_eq!((copy.clone_of.as_str(), copy.size_bytes), ("origin", 16 * MIB));
    let mut k = open(&c, "copy", n1).await;
    for (m, seed) in [(0, 200), (1, 101), (2, 202), (3, 103)] {
        assert!(holds(&mut k, mib(m), seed), "copy MiB {m} is not origin's");
    }
    write(&mut k, mib(3), 403);

    // Nobody's writes reached another.
    for (m, seed) in [(0, 200), (1, 101), (2, 202), (3, 103)] {
        assert!(holds(&mut origin, mib(m), seed), "origin MiB {m} changed");
    }
    for (m, seed) in [(0, 100), (1, 301), (2, 102), (3, 103)] {
        assert!(holds(&mut r, mib(m), seed), "restored MiB {m} changed");
    }

    // What is listed and shown.
    let origin_now = volume(&c, "origin").await;
    assert_eq!(origin_now.snapshots, vec!["s1".to_string()]);
    let listed = c.call(async |mut c| c.list_snapshots(proto::ListSnapshotsRequest::default()).await).await.unwrap();
    assert_eq!(
        listed.snapshots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
        ["s1"],
        "the hidden one is not listed"
    );
    assert_eq!(listed.snapshots[0].clones, vec!["restored".to_string()]);
    let shared = wait_for("the pool to report the bytes snapshots hold", Duration::from_secs(20), async || {
        let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
        let p = pools.into_iter().find(|p| p.node == "n1")?.pool?;
        (p.snapshot_bytes > 0).then_some(p.snapshot_bytes)
    })
    .await;
    println!("n1's pool: {shared} bytes held by snapshots");

    // A new controller knows the snapshots and the clones' sources.
    controller.proc.kill();
    controller = start_controller(root.path(), &store, port, "2");
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2"]).await;
    let get = proto::SnapshotName { name: "s1".into() };
    let s = c.call(async |mut c| c.get_snapshot(get.clone()).await).await.unwrap();
    assert_eq!((s.id.as_str(), s.clones.len()), (s1.id.as_str(), 1));
    assert_eq!(volume(&c, "copy").await.clone_of, "origin");

    // The snapshot outlives its volume; the clones outlive both.
    let del = proto::VolumeName { name: "origin".into() };
    c.call(async |mut c| c.delete_volume(del.clone()).await).await.unwrap();
    let s = c.call(async |mut c| c.get_snapshot(get.clone()).await).await.unwrap();
    assert!(!s.volume_exists && s.state == "ready");
    let gone = c.call(async |mut c| c.delete_snapshot(get.clone()).await).await.unwrap();
    assert!(gone.deleted);
    assert_eq!(gone.kept_by, vec!["restored".to_string()], "the clone that reads it is named");
    let e = c.call(async |mut c| c.get_snapshot(get.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    for (m, seed) in [(0, 100), (1, 301), (2, 102), (3, 103)] {
        assert!(holds(&mut r, mib(m), seed), "restored MiB {m} changed with its snapshot gone");
    }
    assert!(holds(&mut r, mib(20), 320));
    for (m, seed) in [(0, 200), (1, 101), (2, 202), (3, 403)] {
        assert!(holds(&mut k, mib(m), seed), "copy MiB {m} changed with its origin gone");
    }

    // The clone of the volume, inflated: it reads as before, lies over nothing (its
    // hidden source is gone) and moves to another node.
    let inflate = proto::VolumeName { name: "copy".into() };
    let inflated = wait_for("copy to be inflated", Duration::from_secs(30), async || {
        let r = c.call(async |mut c| c.inflate_volume(inflate.clone()).await).await.unwrap();
        assert!(r.stopped.is_empty(), "the inflation stopped: {}", r.stopped);
        r.done.then_some(r)
    })
    .await;
    assert_eq!(inflated.volume.unwrap().clone_of, "", "an inflated clone has no source");
    for (m, seed) in [(0, 200), (1, 101), (2, 202), (3, 403)] {
        assert!(holds(&mut k, mib(m), seed), "copy MiB {m} changed with its inflation");
    }
    let hidden_left =
        |n: &Node| n.engine_call(ListVolumes { pool: None }).iter().any(|v| v.name.starts_with("source-of-"));
    assert!(!hidden_left(n1), "the clone's hidden source went with its inflation");
    // No host attached: the move need not wait for one to connect to the new path.
    drop(k);
    let detach = proto::DetachRequest { volume: "copy".into(), host_nqn: HOST.into() };
    c.call(async |mut c| c.detach(detach.clone()).await).await.unwrap();
    let migrate =
        proto::MigrateVolumeRequest { name: "copy".into(), to_node: "n2".into(), pause_ms: 500, ..Default::default() };
    c.call(async |mut c| c.migrate_volume(migrate.clone()).await).await.unwrap();
    let moved = wait_for("copy to move to n2", Duration::from_secs(60), async || {
        let v = volume(&c, "copy").await;
        (v.migration.is_none() && v.node == "n2").then_some(v)
    })
    .await;
    assert_eq!(moved.node, "n2");
    let mut k = open(&c, "copy", n1).await;
    for (m, seed) in [(0, 200), (1, 101), (2, 202), (3, 403)] {
        assert!(holds(&mut k, mib(m), seed), "copy MiB {m} changed with its move");
    }

    // All gone: the pool holds nothing.
    drop((r, k, origin));
    for name in ["restored", "copy", &other.name] {
        let del = proto::VolumeName { name: name.into() };
        c.call(async |mut c| c.delete_volume(del.clone()).await).await.unwrap();
    }
    for (n, pool) in [(n1, "n1-pool"), (n2, "n2-pool")] {
        wait_for("the pools to be empty", Duration::from_secs(30), async || {
            let left = n.engine_call(ListVolumes { pool: None });
            let pool = n.engine_call(ListPools {}).remove(0);
            (left.is_empty() && pool.volumes == 0 && pool.used_bytes == 0).then_some(())
        })
        .await;
        n.engine_call(CheckPool { name: pool.into() });
    }
}

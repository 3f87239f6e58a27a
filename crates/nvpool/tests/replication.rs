//! Replicated volumes through the controller: a volume of three replicas on three
//! nodes (one zone each) written by a host the whole time, while every engine is
//! hot-upgraded (nothing leaves the in-sync set), while a replica's engine
//! is killed and comes back (the controller takes it out of the in-sync set, then
//! has it rebuilt from what was written while it was away), and while the serving
//! node is lost (another replica serves, the host's path turns optimized there). The
//! host never sees an error that is not a path error, every acknowledged write reads
//! back, and every replica holds every write.

mod cluster;

use cluster::{
    BLOCK, HOST, Model, Node, addr, connect, create_request, free_port, host_writer, host_writer_in, start_controller,
    verify, wait_for,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const VOLUME: &str = "rv";
const SIZE: u64 = 64 * MIB;
/// The host writes the first 8 MiB alone: a partial rebuild copies those clusters at
/// most, a full one all of the volume's.
const WRITTEN: u64 = 8 * MIB;

async fn volume(c: &Controllers) -> proto::Volume {
    let req = proto::VolumeName { name: VOLUME.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

/// SIGKILLs an engine that a hot upgrade started (not a child of the test).
fn kill(pid: u32) {
    let status = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
    assert!(status.success(), "kill {pid}");
    // Gone before the test goes on: its sockets closed.
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Each replica's node and state (`in-sync`, `rebuilding`, `faulted`).
fn states(v: &proto::Volume) -> HashMap<String, String> {
    v.replicas.iter().map(|r| (r.node.clone(), r.state.clone())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_volume_keeps_every_write_through_a_replica_loss_and_a_serving_node_loss() {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for (n, zone) in nodes.iter_mut().zip(["a", "b", "c"]) {
        n.start_agent_with(&controller.address, &["--zone", zone]);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let zones: Vec<String> =
        cluster::nodes(&c).await.iter().map(|n| n.labels.get("zone").cloned().unwrap_or_default()).collect();
    assert_eq!(zones, ["a", "b", "c"], "each node carries its zone");

    let req = proto::CreateVolumeRequest { thin: true, replicas: 3, ..create_request(VOLUME, SIZE) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    assert_eq!((v.replica_count, v.generation), (3, 1));
    let mut on: Vec<&str> = v.replicas.iter().map(|r| r.node.as_str()).collect();
    on.sort();
    assert_eq!(on, names, "one replica on each node");
    assert!(v.replicas.iter().all(|r| r.state == "in-sync"), "{:?}", v.replicas);
    // Each node's engine holds the volume with one identity.
    for n in &nodes {
        let info =
            n.engine_call(nvpool_api::GetVolume { pool: format!("{}-pool", n.name), name: format!("pv-{}", v.id) });
        assert_eq!((info.uuid.as_str(), info.nguid.as_str()), (v.uuid.as_str(), v.nguid.as_str()), "{}", n.name);
    }
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    let attached = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    println!("attached: {attached:?}");
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let nqn = v.subsystem_nqn.clone();
    // The host's paths, the optimized (serving) one first, as its multipath tries them.
    let paths = volume(&c).await.attachments[0].paths.iter().map(|p| p.node.clone()).collect::<Vec<_>>();
    assert_eq!(paths.len(), 3, "a path through each replica's node: {paths:?}");
    let addrs = paths.iter().map(|p| addr(&nodes[index(p)])).collect::<Vec<_>>();
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = host_writer(addrs, nqn.clone(), model.clone(), stop.clone(), WRITTEN / BLOCK as u64);
    tokio::time::sleep(Duration::from_secs(1)).await;

    // Hot upgrades of every node's engine, one after the other, under the writes:
    // nothing leaves the in-sync set, no rebuild follows.
    // The engines are new processes from here on, not the test's children.
    let mut upgraded: HashMap<String, u32> = HashMap::new();
    for name in names {
        let req = proto::UpgradeNodeRequest { node: name.into(), binary: String::new() };
        let r = c.call(async |mut c| c.upgrade_node(req.clone()).await).await.unwrap();
        println!("{name} upgraded: pid {} -> {}", r.old_pid, r.new_pid);
        upgraded.insert(name.to_string(), r.new_pid);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = volume(&c).await;
        assert_eq!(now.generation, 1, "an upgrade of {name} changed the replicas: {:?}", now.replicas);
        assert!(now.replicas.iter().all(|r| r.state == "in-sync"), "{:?}", now.replicas);
    }

    // A replica's engine is lost: the controller takes it out of the in-sync set.
    let serving = v.node.clone();
    let lost = v.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    println!("killing the engine of {lost} (a replica; {serving} serves)");
    kill(upgraded[&lost]);
    let v2 = wait_for("the lost replica faulted", Duration::from_secs(30), async || {
        let v = volume(&c).await;
        (states(&v)[&lost] == "faulted").then_some(v)
    })
    .await;
    assert_eq!(v2.generation, 2, "{:?}", v2.replicas);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Back with its disks: rebuilt from the serving engine's record, then in sync.
    nodes[index(&lost)].start_engine(true);
    let v3 = wait_for("the replica back in sync", Duration::from_secs(60), async || {
        let v = volume(&c).await;
        v.replicas.iter().all(|r| r.state == "in-sync").then_some(v)
    })
    .await;
    assert!(v3.generation >= 3, "{:?}", v3);
    let rebuild = nodes[index(&serving)].engine_call(nvpool_api::GetRebuild { nqn: nqn.clone(), nsid: 1 });
    println!("rebuild of {lost}: {rebuild:?}");
    assert_eq!(rebuild.state, "done");
    assert!(rebuild.total_bytes <= WRITTEN, "a partial rebuild copies what was written while away: {rebuild:?}");

    // The serving node is lost (engine and agent): another replica serves.
    println!("killing {serving} (engine and agent)");
    nodes[index(&serving)].agent.kill();
    kill(upgraded[&serving]);
    let v4 = wait_for("another node serving", Duration::from_secs(30), async || {
        let v = volume(&c).await;
        (v.node != serving).then_some(v)
    })
    .await;
    println!("now served by {} at generation {}: {:?}", v4.node, v4.generation, v4.replicas);
    assert_eq!(states(&v4)[&serving], "faulted");
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The lost node comes back: its replica is rebuilt in full (the serving engine
    // changed while it was away).
    nodes[index(&serving)].start_engine(true);
    nodes[index(&serving)].start_agent_with(&controller.address, &["--zone", "x"]);
    wait_for("every replica in sync again", Duration::from_secs(60), async || {
        let v = volume(&c).await;
        v.replicas.iter().all(|r| r.state == "in-sync").then_some(())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    println!("{writes} writes, {errors} errors");
    assert_eq!(errors, 0, "the host saw errors");
    assert!(writes > 100, "the host wrote too little to prove anything: {writes}");

    // Every replica holds every acknowledged write: read each one directly, with the
    // agents stopped so that nobody changes the exports meanwhile.
    let v5 = volume(&c).await;
    for n in &mut nodes {
        n.agent.kill();
    }
    verify(addr(&nodes[index(&v5.node)]), &nqn, &model, "the serving node");
    let replica_nqn = format!("{nqn}-replica");
    for r in v5.replicas.iter().filter(|r| !r.serving) {
        let n = &nodes[index(&r.node)];
        n.engine_call(nvpool_api::AddHost { nqn: replica_nqn.clone(), host: HOST.into(), dhchap: None, tls_psk: None });
        verify(addr(n), &replica_nqn, &model, &format!("the replica on {}", r.node));
    }
}

/// A volume made with one copy gets a second online (`volume set --replicas 2`,
/// rebuilt in full before it counts); when that replica's node stays away past the
/// replica timeout, a new replica is made on another node; the old copy goes when its
/// node is back; and `--replicas 1` drops the second copy again. The host writes the
/// whole time and loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_are_added_replaced_and_dropped_online() {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller =
        cluster::start_controller_with(root.path(), &store, free_port(), "1", &["--replica-timeout", "2s"]);
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let req = proto::CreateVolumeRequest { thin: true, ..create_request(VOLUME, SIZE) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    assert!(v.replicas.is_empty() && v.replica_count == 1, "{v:?}");
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let addrs = nodes.iter().map(addr).collect::<Vec<_>>();
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = host_writer(addrs, v.subsystem_nqn.clone(), model.clone(), stop.clone(), WRITTEN / BLOCK as u64);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let set = async |n: u32| {
        let req = proto::SetVolumeReplicasRequest { name: VOLUME.into(), replicas: n };
        c.call(async |mut c| c.set_volume_replicas(req.clone()).await).await.unwrap()
    };
    let in_sync = async |count: usize| {
        wait_for(&format!("{count} replicas in sync"), Duration::from_secs(60), async || {
            let v = volume(&c).await;
            (v.replicas.len() == count && v.replicas.iter().all(|r| r.state == "in-sync")).then_some(v)
        })
        .await
    };

    // A second copy, online.
    set(2).await;
    let two = in_sync(2).await;
    let second = two.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    println!("second replica on {second}, generation {}", two.generation);
    let engine_name = format!("pv-{}", v.id);
    let has_volume = |n: &Node| {
        nvpool_api::call(
            &n.socket(),
            &nvpool_api::GetVolume { pool: format!("{}-pool", n.name), name: engine_name.clone() },
        )
        .is_ok()
    };
    assert!(has_volume(&nodes[index(&second)]));

    // Its node is lost for longer than the replica timeout: a new replica elsewhere.
    let lost = index(&second);
    nodes[lost].agent.kill();
    nodes[lost].engine.kill();
    let replaced = wait_for("a new replica elsewhere, in sync", Duration::from_secs(60), async || {
        let v = volume(&c).await;
        let other = v.replicas.iter().find(|r| !r.serving)?;
        (other.node != second && other.state == "in-sync").then_some(v)
    })
    .await;
    let third = replaced.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    println!("replaced by {third}: {:?}", replaced.replicas);
    assert_ne!(third, replaced.node);
    // Back, the lost node gives up its old copy.
    nodes[lost].start_engine(true);
    nodes[lost].start_agent(&controller.address);
    wait_for("the old copy removed", Duration::from_secs(30), async || (!has_volume(&nodes[lost])).then_some(())).await;

    // One copy again: the other replica goes.
    set(1).await;
    wait_for("one copy left", Duration::from_secs(30), async || {
        let v = volume(&c).await;
        (v.replicas.is_empty() && !has_volume(&nodes[index(&third)])).then_some(())
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    println!("{writes} writes, {errors} errors");
    assert_eq!(errors, 0, "the host saw errors");
    let v = volume(&c).await;
    verify(addr(&nodes[index(&v.node)]), &v.subsystem_nqn, &model, "the serving node");

    // Two copies again, then the volume deleted: no node keeps any of it.
    set(2).await;
    in_sync(2).await;
    c.call(async |mut c| c.detach(proto::DetachRequest { volume: VOLUME.into(), host_nqn: HOST.into() }).await)
        .await
        .unwrap();
    c.call(async |mut c| c.delete_volume(proto::VolumeName { name: VOLUME.into() }).await).await.unwrap();
    wait_for("every copy removed", Duration::from_secs(30), async || {
        nodes.iter().all(|n| !has_volume(n)).then_some(())
    })
    .await;
}

/// A replicated volume grows online under writes: every replica grows, then the
/// serving engine's mirror, and the host writes past the old end on both replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicated_volume_grows_online() {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let names = ["n1", "n2"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let req = proto::CreateVolumeRequest { thin: true, replicas: 2, ..create_request(VOLUME, 16 * MIB) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let serving = addr(&nodes[index(&v.node)]);
    let blocks = |bytes: u64| bytes / BLOCK as u64;
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let before = cluster::host_writer_in(
        vec![serving],
        v.subsystem_nqn.clone(),
        model.clone(),
        stop.clone(),
        0..blocks(16 * MIB),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    let grow = proto::ResizeVolumeRequest { name: VOLUME.into(), size_bytes: 32 * MIB };
    let grown = c.call(async |mut c| c.resize_volume(grow.clone()).await).await.unwrap();
    assert_eq!(grown.size_bytes, 32 * MIB);
    assert_eq!(grown.generation, v.generation, "growing changes no replica's membership: {grown:?}");
    assert!(grown.replicas.iter().all(|r| r.state == "in-sync"), "{:?}", grown.replicas);
    for n in &nodes {
        let info =
            n.engine_call(nvpool_api::GetVolume { pool: format!("{}-pool", n.name), name: format!("pv-{}", v.id) });
        assert_eq!(info.size, 32 * MIB, "the replica on {}", n.name);
    }
    // The host's other path, through the other node (an access point), serves the new
    // size too.
    let other_node = &nodes[1 - index(&v.node)];
    let ap_size = || {
        let subsystems = other_node.engine_call(nvpool_api::ListSubsystems {});
        let s = subsystems.iter().find(|s| s.nqn == v.subsystem_nqn).expect("the access point's export");
        s.namespaces[0].size
    };
    wait_for("the access point at the new size", Duration::from_secs(20), async || {
        (ap_size() == 32 * MIB).then_some(())
    })
    .await;
    // Past the old end, beside the writes that went on through the growth, through
    // both paths.
    let past = Arc::new(AtomicBool::new(false));
    let through_access_point = cluster::host_writer_in(
        vec![addr(other_node)],
        v.subsystem_nqn.clone(),
        model.clone(),
        past.clone(),
        blocks(24 * MIB)..blocks(32 * MIB),
    );
    let after = cluster::host_writer_in(
        vec![serving],
        v.subsystem_nqn.clone(),
        model.clone(),
        past.clone(),
        blocks(16 * MIB)..blocks(24 * MIB),
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    past.store(true, Ordering::SeqCst);
    let ((w1, e1), (w2, e2)) = (before.join().unwrap(), after.join().unwrap());
    let (w3, e3) = through_access_point.join().unwrap();
    println!("{w1} writes before and across the growth, {w2} past the old end, {w3} there through the access point");
    assert_eq!((e1, e2, e3), (0, 0, 0), "the host saw errors");
    assert!(w2 > 10 && w3 > 10, "too few writes past the old end: {w2}, {w3}");
    for n in &mut nodes {
        n.agent.kill();
    }
    verify(serving, &v.subsystem_nqn, &model, "the serving node");
    let replica_nqn = format!("{}-replica", v.subsystem_nqn);
    let other = &nodes[1 - index(&v.node)];
    other.engine_call(nvpool_api::AddHost { nqn: replica_nqn.clone(), host: HOST.into(), dhchap: None, tls_psk: None });
    verify(addr(other), &replica_nqn, &model, "the other replica");
}

/// One replica of a replicated volume moves under writes: by hand (a replica that
/// does not serve, then the serving one), by a node's drain, and by the rebalancer
/// making a hole for a volume that fits nowhere. Each move rebuilds a new replica in
/// full, then drops the old one; the serving one's hands the serving role over at
/// the next generation. The host never sees an error that is not a path error, and
/// every replica holds every write at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_moves_by_hand_by_drain_and_by_the_rebalancer() {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let _logs = cluster::LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller =
        cluster::start_controller_with(root.path(), &store, free_port(), "1", &["--rebalance-every", "500ms"]);
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
    let capacity = pools.iter().map(|p| p.pool.as_ref().unwrap().capacity_bytes).min().unwrap();
    // A share of a pool, in whole 4 MiB.
    let part = |share: f64| (capacity as f64 * share) as u64 / (4 * MIB) * (4 * MIB);
    // Thick: every move copies the whole volume, and it counts whole on each pool.
    let req = proto::CreateVolumeRequest { replicas: 2, ..create_request(VOLUME, part(0.3)) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let addrs = nodes.iter().map(addr).collect::<Vec<_>>();
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = host_writer(addrs, v.subsystem_nqn.clone(), model.clone(), stop.clone(), WRITTEN / BLOCK as u64);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let engine_name = format!("pv-{}", v.id);
    let has_copy = |n: &Node| {
        nvpool_api::call(
            &n.socket(),
            &nvpool_api::GetVolume { pool: format!("{}-pool", n.name), name: engine_name.clone() },
        )
        .is_ok()
    };
    let holders = |v: &proto::Volume| {
        let mut h: Vec<String> = v.replicas.iter().map(|r| r.node.clone()).collect();
        h.sort();
        h
    };
    // The move is over: the copies on `expected` nodes, all in sync, and no other
    // node keeps a copy.
    let moved = async |expected: &[&str]| {
        let v = wait_for(&format!("the replicas on {expected:?}, in sync"), Duration::from_secs(60), async || {
            let v = volume(&c).await;
            let settled = v.migration.is_none()
                && holders(&v) == expected
                && v.replicas.iter().all(|r| r.state == "in-sync")
                && names.iter().all(|n| has_copy(&nodes[index(n)]) == expected.contains(n));
            settled.then_some(v)
        })
        .await;
        println!("{}: serving on {}, generation {}", v.last_migration, v.node, v.generation);
        assert!(v.last_migration.starts_with("moved"), "{}", v.last_migration);
        v
    };
    let free_node = |v: &proto::Volume| *names.iter().find(|n| !holders(v).iter().any(|h| h == *n)).unwrap();
    let others = |but: &str| {
        let mut h: Vec<&str> = names.iter().copied().filter(|n| *n != but).collect();
        h.sort();
        h
    };

    // By hand, a replica that does not serve: to the only node without one.
    let serving = v.node.clone();
    let quiet = v.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    let req =
        proto::MigrateVolumeRequest { name: VOLUME.into(), auto: true, from_node: quiet.clone(), ..Default::default() };
    let started = c.call(async |mut c| c.migrate_volume(req.clone()).await).await.unwrap();
    let m = started.migration.expect("the move shows as a migration");
    assert_eq!((m.from_node.as_str(), m.to_node.as_str()), (quiet.as_str(), free_node(&v)));
    let refused = c
        .call(async |mut c| {
            c.set_volume_replicas(proto::SetVolumeReplicasRequest { name: VOLUME.into(), replicas: 3 }).await
        })
        .await
        .unwrap_err();
    assert!(refused.message().contains("is moving"), "{}", refused.message());
    let after = moved(&others(&quiet)).await;
    assert_eq!(after.node, serving, "a replica that does not serve moved: the serving one stays");
    assert!(after.generation > v.generation);

    // By hand, through the CLI, the serving one: the node it moves to serves.
    let to = free_node(&after).to_string();
    let out = std::process::Command::new(cluster::BIN)
        .args(["volume", "migrate", VOLUME, "--to", &to, "--controller", &controller.address])
        .output()
        .unwrap();
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let after = moved(&others(&serving)).await;
    assert_eq!(after.node, to, "the serving replica moved: its new node serves");
    assert!(after.attachments[0].paths[0].node == to, "the host's optimized path is the new serving node's");

    // A drain of the node that holds the replica that does not serve.
    let drained = after.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    let out = std::process::Command::new(cluster::BIN)
        .args(["node", "drain", &drained, "--controller", &controller.address])
        .output()
        .unwrap();
    println!("{}", String::from_utf8_lossy(&out.stdout));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let after = moved(&others(&drained)).await;

    // The rebalancer: a volume that fits nowhere until a replica of this one moves
    // to the node without one. The others hold 0.3 (a replica) and 0.4 pinned, the
    // free one 0.65 pinned; 0.5 fits once a replica leaves.
    let empty = free_node(&after).to_string();
    for (node, share) in names.iter().map(|n| (*n, if *n == empty { 0.65 } else { 0.4 })) {
        let req = proto::CreateVolumeRequest {
            pinned: true,
            include_nodes: vec![node.into()],
            ..create_request(&format!("pinned-{node}"), part(share))
        };
        c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap();
    }
    let big = create_request("big", part(0.5));
    let refused = c.call(async |mut c| c.create_volume(big.clone()).await).await.unwrap_err();
    println!("{}", refused.message());
    assert!(refused.message().contains("the rebalancer is making room"), "{}", refused.message());
    let placed = wait_for("big to be created", Duration::from_secs(90), async || {
        c.call(async |mut c| c.create_volume(big.clone()).await).await.ok()
    })
    .await
    .volume
    .unwrap();
    let after = volume(&c).await;
    println!("big on {}; {VOLUME}: {}", placed.node, after.last_migration);
    assert!(holders(&after).contains(&empty), "a replica moved to {empty}: {:?}", after.replicas);
    assert!(!holders(&after).contains(&placed.node), "big took the room the replica left");

    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    println!("{writes} writes across four moves, {errors} errors");
    assert_eq!(errors, 0, "the host saw errors");
    for n in &mut nodes {
        n.agent.kill();
    }
    verify(addr(&nodes[index(&after.node)]), &after.subsystem_nqn, &model, "the serving replica");
    let replica_nqn = format!("{}-replica", after.subsystem_nqn);
    let other = &nodes[index(&after.replicas.iter().find(|r| !r.serving).unwrap().node)];
    other.engine_call(nvpool_api::AddHost { nqn: replica_nqn.clone(), host: HOST.into(), dhchap: None, tls_psk: None });
    verify(addr(other), &replica_nqn, &model, "the other replica");
}

/// A replica's node comes back without its disks, under writes: first with no pool
/// at all (the replica is made anew on another node at once, not after the replica
/// timeout), then, on the node that took it, with a new, empty pool of the same name
/// (the replica is rebuilt there in full: a partial rebuild into a volume made anew
/// would leave it without everything written before it left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_disks_are_lost_is_rebuilt_in_full() {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    println!("logs in {}", root.path().display());
    let _logs = cluster::LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let req = proto::CreateVolumeRequest { thin: true, replicas: 2, ..create_request(VOLUME, 32 * MIB) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let serving = index(&v.node);
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = host_writer(
        vec![addr(&nodes[serving])],
        v.subsystem_nqn.clone(),
        model.clone(),
        stop.clone(),
        WRITTEN / BLOCK as u64,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let other = |v: &proto::Volume| v.replicas.iter().find(|r| !r.serving).unwrap().clone();
    let disks_lost = |n: &mut Node| {
        n.agent.kill();
        n.engine.kill();
        std::fs::remove_file(&n.disk).unwrap();
        std::fs::File::create(&n.disk).unwrap().set_len(256 * MIB).unwrap();
        n.start_engine(false);
    };

    // Back with no pool: its replica is made anew elsewhere at once.
    let first = index(&other(&v).node);
    disks_lost(&mut nodes[first]);
    nodes[first].start_agent(&controller.address);
    let started = std::time::Instant::now();
    let replaced = wait_for("the replica made anew on another node, in sync", Duration::from_secs(60), async || {
        let v = volume(&c).await;
        let r = other(&v);
        (r.node != names[first] && r.state == "in-sync").then_some(v)
    })
    .await;
    println!(
        "{} back without its pool: replica on {} in sync after {:.1?}",
        names[first],
        other(&replaced).node,
        started.elapsed()
    );

    // Back with a new, empty pool of the same name: rebuilt there in full. The host
    // writes another region from now on: a rebuild of what was written since the
    // replica left would leave the first region's blocks missing there.
    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let blocks = WRITTEN / BLOCK as u64;
    let writer = host_writer_in(
        vec![addr(&nodes[serving])],
        v.subsystem_nqn.clone(),
        model.clone(),
        stop.clone(),
        blocks..2 * blocks,
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = index(&other(&replaced).node);
    disks_lost(&mut nodes[second]);
    let out = std::process::Command::new(cluster::BIN)
        .args(["engine", "pool", "create", &format!("{}-pool", names[second])])
        .arg(&nodes[second].disk)
        .arg("--socket")
        .arg(nodes[second].socket())
        .output()
        .unwrap();
    assert!(out.status.success(), "pool create: {}", String::from_utf8_lossy(&out.stderr));
    nodes[second].start_agent(&controller.address);
    let faulted = wait_for("the replica faulted", Duration::from_secs(30), async || {
        let v = volume(&c).await;
        (other(&v).state != "in-sync").then_some(v)
    })
    .await;
    println!("{} lost its disks: {:?}", names[second], faulted.replicas);
    let rebuilt = wait_for("the replica rebuilt in place, in sync", Duration::from_secs(60), async || {
        let v = volume(&c).await;
        let r = other(&v);
        (r.node == names[second] && r.state == "in-sync").then_some(v)
    })
    .await;
    println!("{} back with a new pool: {:?}", names[second], rebuilt.replicas);

    stop.store(true, Ordering::SeqCst);
    let (later, later_errors) = writer.join().unwrap();
    println!("{writes} writes, then {later} to another region, {} errors", errors + later_errors);
    assert_eq!(errors + later_errors, 0, "the host saw errors");
    for n in &mut nodes {
        n.agent.kill();
    }
    verify(addr(&nodes[serving]), &v.subsystem_nqn, &model, "the serving replica");
    let replica_nqn = format!("{}-replica", v.subsystem_nqn);
    let holder = &nodes[second];
    holder.engine_call(nvpool_api::AddHost {
        nqn: replica_nqn.clone(),
        host: HOST.into(),
        dhchap: None,
        tls_psk: None,
    });
    verify(addr(holder), &replica_nqn, &model, "the replica rebuilt on a new pool");
}

/// A replicated volume's I/O limits and its host's DH-HMAC-CHAP secrets hold on every
/// path, the serving one's mirror included, and still do on the node that serves
/// after a failover; the replicas' own exports let no host in, with secrets or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_and_secrets_hold_on_every_replica_across_a_failover() {
    use nvpool_api::{ListSubsystems, QosLimits};
    use nvpool_auth::Secret;
    use nvpool_initiator::{ConnectOptions, Error, HostAuth, Queue};

    let root = tempfile::tempdir().unwrap();
    let _logs = cluster::LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let names = ["n1", "n2", "n3"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let limits = QosLimits { iops: 5000, bps: 64 * MIB, ..Default::default() };
    let req = proto::CreateVolumeRequest {
        thin: true,
        replicas: 2,
        qos: Some(limits.into()),
        ..create_request(VOLUME, 16 * MIB)
    };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach =
        proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), dhchap: true, ..Default::default() };
    let r = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let secrets = r.dhchap.clone().expect("secrets for a host attached with dhchap");
    let auth =
        HostAuth::new(Secret::parse(&secrets.secret).unwrap(), Some(Secret::parse(&secrets.ctrl_secret).unwrap()));
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let limits_on = |n: &Node, nqn: &str| {
        let subsystems = n.engine_call(ListSubsystems {});
        subsystems.into_iter().find(|s| s.nqn == nqn)?.namespaces.into_iter().find(|n| n.nsid == 1).map(|n| n.qos)
    };
    // Every path limits the host's I/O and demands its secrets.
    let check_paths = |nodes: &[Node], paths: &[proto::Path]| {
        for p in paths {
            let n = &nodes[index(&p.node)];
            assert_eq!(limits_on(n, &v.subsystem_nqn), Some(limits), "the limits on {}", p.node);
            let mut q = Queue::connect(addr(n), &ConnectOptions::admin(&v.subsystem_nqn, HOST)).unwrap();
            match q.identify_controller() {
                Err(Error::Command(s)) => assert_eq!(s.base(), nvpool_wire::Status::AUTH_REQUIRED, "{}", p.node),
                other => panic!("a host without its secret on {}: {:?}", p.node, other.map(|_| ())),
            }
        }
        let serving = addr(&nodes[index(&paths[0].node)]);
        for p in &paths[1..] {
            cluster::write_then_read(HOST, serving, addr(&nodes[index(&p.node)]), &v.subsystem_nqn, &auth);
        }
    };
    assert_eq!(r.paths[0].node, v.node);
    check_paths(&nodes, &r.paths);
    // A replica's export takes its serving engine alone: a host gets no controller.
    let replica_nqn = format!("{}-replica", v.subsystem_nqn);
    let other = v.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    let o = ConnectOptions { auth: Some(auth.clone()), ..ConnectOptions::admin(&replica_nqn, HOST) };
    match Queue::connect(addr(&nodes[index(&other)]), &o) {
        Err(Error::Command(s)) if s.base() == nvpool_wire::Status::CONNECT_INVALID_HOST => {}
        other => panic!("a host on a replica's export: {:?}", other.map(|_| ())),
    }

    // The serving node lost: the other replica serves, with the same limits and
    // secrets.
    let lost = index(&v.node);
    nodes[lost].agent.kill();
    nodes[lost].engine.kill();
    let after = wait_for("another replica serving", Duration::from_secs(30), async || {
        let v = volume(&c).await;
        (v.node == other).then_some(v)
    })
    .await;
    println!("{} serves at generation {}", after.node, after.generation);
    let paths: Vec<proto::Path> =
        after.attachments[0].paths.iter().filter(|p| p.node != names[lost]).cloned().collect();
    assert_eq!(paths[0].node, other, "the new serving node is the host's optimized path");
    check_paths(&nodes, &paths);
}

/// A snapshot of a replicated volume, taken while a host writes: every in-sync
/// replica holds a copy at the same point in the writes, so that when the serving
/// node is lost, a volume made from the snapshot on the replica left reads what one
/// made on the lost node read. The host loses nothing, and deleting the snapshot
/// names the volumes that still read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_a_replicated_volume_is_one_point_on_every_replica_and_outlives_the_serving_node() {
    let keep = std::env::var_os("NVPOOL_KEEP_TEST_DIR").is_some();
    let root = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    let _logs = cluster::LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let names = ["n1", "n2"];
    let mut nodes: Vec<Node> = names.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let req = proto::CreateVolumeRequest { thin: true, replicas: 2, ..create_request(VOLUME, 16 * MIB) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach =
        |volume: &str| proto::AttachRequest { volume: volume.into(), host_nqn: HOST.into(), ..Default::default() };
    let a = attach(VOLUME);
    c.call(async |mut c| c.attach(a.clone()).await).await.unwrap();
    let paths = volume(&c).await.attachments[0].paths.iter().map(|p| addr(&nodes[index(&p.node)])).collect();
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writer = host_writer(paths, v.subsystem_nqn.clone(), model.clone(), stop.clone(), WRITTEN / BLOCK as u64);
    tokio::time::sleep(Duration::from_secs(1)).await;

    let take = proto::CreateSnapshotRequest { volume: VOLUME.into(), name: "rs".into() };
    let s = c.call(async |mut c| c.create_snapshot(take.clone()).await).await.unwrap();
    let other = v.replicas.iter().find(|r| !r.serving).unwrap().node.clone();
    assert_eq!((s.state.as_str(), s.node.as_str()), ("ready", v.node.as_str()));
    assert_eq!(s.copy_nodes, std::slice::from_ref(&other), "the other replica holds a copy");
    println!("snapshot of a replicated volume under writes: writes held {} us", s.pause_us);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // A volume made from the snapshot reads it; so does one made after the serving
    // node is gone, from the copy on the replica left.
    let node_addrs: Vec<std::net::SocketAddr> = nodes.iter().map(addr).collect();
    let made_from = async |name: &str| {
        let req = proto::CreateVolumeRequest { from_snapshot: "rs".into(), ..create_request(name, 0) };
        let made = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
        let a = attach(name);
        c.call(async |mut c| c.attach(a.clone()).await).await.unwrap();
        let at = node_addrs[index(&made.node)];
        let mut p =
            wait_for("a path to the clone", Duration::from_secs(20), async || connect(at, &made.subsystem_nqn)).await;
        let blocks = (WRITTEN / BLOCK as u64) as u32;
        let content: Vec<u8> =
            (0..blocks).step_by(16).flat_map(|b| p.io.read(1, u64::from(b), 16, BLOCK as u32).unwrap()).collect();
        (made.node, content)
    };
    let (first_at, first) = made_from("from-rs-1").await;
    assert_eq!(first_at, v.node);
    assert!(first.iter().any(|&b| b != 0), "the snapshot holds the writes before it");

    let serving = index(&v.node);
    println!("killing {} (engine and agent)", v.node);
    nodes[serving].agent.kill();
    nodes[serving].engine.kill();
    wait_for("the replica left to serve", Duration::from_secs(30), async || {
        (volume(&c).await.node == other).then_some(())
    })
    .await;
    cluster::wait_healthy(&c, &[other.as_str()]).await;
    let (second_at, second) = made_from("from-rs-2").await;
    assert_eq!(second_at, other, "made on the node that is up, from its copy");
    assert!(first == second, "the replicas' copies of the snapshot differ");

    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    println!("{writes} writes, {errors} errors");
    assert_eq!(errors, 0, "the host saw errors");
    verify(addr(&nodes[index(&other)]), &v.subsystem_nqn, &model, "the replica left");

    let del = proto::SnapshotName { name: "rs".into() };
    let gone = c.call(async |mut c| c.delete_snapshot(del.clone()).await).await.unwrap();
    let mut kept_by = gone.kept_by.clone();
    kept_by.sort();
    assert_eq!(kept_by, ["from-rs-1", "from-rs-2", VOLUME], "{gone:?}");
}

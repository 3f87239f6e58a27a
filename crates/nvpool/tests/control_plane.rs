//! The control plane on one machine: three engines with their agents and one
//! controller (embedded store), all real processes.
//!
//! - 100 volumes of mixed sizes, types and locality preferences; each lands where an
//!   independent model of the policy says (preferred place first, then the room each
//!   node keeps for its own pods' local volumes, then the most room nobody reserved).
//! - A controller restart loses nothing.
//! - A killed agent's node turns unhealthy and gets nothing new; a volume deleted
//!   meanwhile, and the exports of an engine that restarted meanwhile, are put right
//!   when the agent comes back.
//! - A node whose engine is down (its agent alive) takes nothing new and keeps the
//!   capacity it last reported.
//! - Bad input gets a clear error and leaves nothing behind.

mod cluster;

use cluster::{
    LogsOnFailure, Node, create_request, free_port, nodes, start_controller, volumes, wait_for, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto::{self, Locality};
use std::collections::BTreeMap;
use std::time::Duration;
use tonic::Code;

const MIB: u64 = 1 << 20;
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0c0c0c0c-1111-2222-3333-444455556666";

/// What the test believes each node's one pool holds.
#[derive(Clone, Debug, Default)]
struct Pool {
    capacity: u64,
    /// Bytes taken (thick volumes, in whole clusters).
    committed: u64,
    cluster: u64,
    /// Sum of its volumes' sizes.
    provisioned: u64,
    /// Bytes of the volumes this node's pods asked to have locally, wherever they
    /// went, and those of them that sit here.
    local_demand: u64,
    local_held: u64,
}

type Ledger = BTreeMap<String, Pool>;

/// The nodes the policy may pick (more than one only on a tie, to within rounding):
/// healthy, allowed and fitting; then the highest `10 * locality + 2 * reserve -
/// space`, where reserve is 1 if the node keeps the room its own pods are expected to
/// need for local volumes (else 1 less the share of the node the volume takes from
/// that room), and space is the share of the pool taken or reserved afterwards.
fn expected_nodes(ledger: &Ledger, req: &proto::CreateVolumeRequest, healthy: &[&str]) -> Vec<String> {
    // The whole pool: capacity, placed bytes, and local demand.
    let capacity: u64 = ledger.values().map(|p| p.capacity).sum();
    let placed: u64 = ledger.values().map(|p| p.provisioned).sum();
    let local: u64 = ledger.values().map(|p| p.local_demand).sum();
    // A node's pods' share of the placed bytes, blended with a prior (local demand
    // spread by capacity) weighing a tenth of the pool, projected onto the full pool.
    let projected_need = |p: &Pool| {
        if placed == 0 {
            return 0.0;
        }
        let prior_weight = capacity as f64 / 10.0;
        let prior_share = local as f64 / placed as f64 * p.capacity as f64 / capacity as f64;
        (p.local_demand as f64 + prior_weight * prior_share) / (placed as f64 + prior_weight) * capacity as f64
    };
    let mut scored: Vec<(f64, String)> = Vec::new();
    for (node, p) in ledger {
        if !healthy.contains(&node.as_str()) || req.exclude_nodes.contains(node) {
            continue;
        }
        let need = if req.thin { 0 } else { req.size_bytes.div_ceil(p.cluster) * p.cluster };
        if p.committed + need > p.capacity || (req.thin && p.capacity - p.committed < p.cluster) {
            continue;
        }
        let here = *node == req.host_node;
        let locality = match Locality::try_from(req.locality).unwrap() {
            Locality::Any => 0.0,
            Locality::Local => f64::from(u8::from(here)),
            Locality::Remote => f64::from(u8::from(!here)),
        };
        let own = here && req.locality == Locality::Local as i32;
        let reserved = if own { 0.0 } else { (projected_need(p) - p.local_held as f64).max(0.0) };
        let free_after = (p.capacity - p.committed - need) as f64;
        let reserve = if free_after >= reserved {
            1.0
        } else {
            1.0 - (reserved - free_after).min(need as f64) / p.capacity as f64
        };
        let space = ((p.committed + need) as f64 + reserved).min(p.capacity as f64) / p.capacity as f64;
        scored.push((10.0 * locality + 2.0 * reserve - space, node.clone()));
    }
    let best = scored.iter().map(|s| s.0).fold(f64::NEG_INFINITY, f64::max);
    scored.into_iter().filter(|s| s.0 > best - 1e-6).map(|s| s.1).collect()
}

async fn create(
    c: &Controllers,
    req: &proto::CreateVolumeRequest,
) -> Result<proto::CreateVolumeResponse, tonic::Status> {
    c.call(async |mut c| c.create_volume(req.clone()).await).await
}

async fn ledger(c: &Controllers) -> Ledger {
    nodes(c)
        .await
        .into_iter()
        .map(|n| {
            let p = &n.pools[0];
            (n.name, Pool { capacity: p.capacity_bytes, cluster: p.cluster_size, ..Pool::default() })
        })
        .collect()
}

/// The volumes an engine exports: subsystem NQN -> allowed hosts.
fn exports(node: &Node) -> BTreeMap<String, Vec<String>> {
    let subsystems = node.engine_call(nvpool_api::ListSubsystems {});
    subsystems
        .into_iter()
        .filter(|s| s.nqn.starts_with("nqn.2024-01.io.nvpool:volume:"))
        .map(|s| (s.nqn, s.hosts))
        .collect()
}

fn engine_volume_count(node: &Node) -> usize {
    node.engine_call(nvpool_api::ListVolumes { pool: None }).len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_place_survive_restarts_and_reconcile() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let port = free_port();
    let mut controller = start_controller(root.path(), &store, port, "1");
    let mut nodes_ = vec![
        Node::new(root.path(), "n1", 768 * MIB),
        Node::new(root.path(), "n2", 1024 * MIB),
        Node::new(root.path(), "n3", 1280 * MIB),
    ];
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3"]).await;

    // 100 volumes; each must land where the model says.
    let mut book = ledger(&c).await;
    // Thick volumes take real disk (their clusters are allocated at creation), so the
    // sizes are small: what counts is their share of each pool.
    let sizes = [2 * MIB, 6 * MIB, 16 * MIB, 25 * MIB, 50 * MIB, MIB + 123];
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    let mut local_hits = 0;
    for i in 0..100u64 {
        let host = format!("n{}", 1 + i % 3);
        let (locality, host_node) = match i % 4 {
            0 => (Locality::Local, host.clone()),
            1 => (Locality::Remote, host.clone()),
            _ => (Locality::Any, String::new()),
        };
        let req = proto::CreateVolumeRequest {
            name: format!("vol-{i:03}"),
            size_bytes: sizes[(i as usize * 7) % sizes.len()],
            thin: i % 5 == 0,
            locality: locality as i32,
            host_node,
            include_nodes: vec![],
            exclude_nodes: if i % 10 == 3 { vec!["n3".into()] } else { vec![] },
            ..Default::default()
        };
        let want = expected_nodes(&book, &req, &["n1", "n2", "n3"]);
        assert!(!want.is_empty(), "the volumes fit");
        let got = create(&c, &req).await.unwrap_or_else(|e| panic!("create {}: {}", req.name, e.message()));
        let v = got.volume.unwrap();
        assert!(
            want.contains(&v.node),
            "{} went to {}, not {want:?} ({:?} to {:?}, {} bytes): scores {:?}",
            req.name,
            v.node,
            locality,
            req.host_node,
            req.size_bytes,
            got.scores
        );
        assert_eq!(v.state, "ready");
        assert!(!v.uuid.is_empty() && !v.nguid.is_empty());
        assert_eq!(got.scores.len(), 3, "--explain shows every node");
        if locality == Locality::Local && v.node == req.host_node {
            local_hits += 1;
        }
        let entry = book.get_mut(&v.node).unwrap();
        if !req.thin {
            entry.committed += req.size_bytes.div_ceil(entry.cluster) * entry.cluster;
        }
        entry.provisioned += req.size_bytes;
        if locality == Locality::Local {
            if v.node == req.host_node {
                entry.local_held += req.size_bytes;
            }
            book.get_mut(&req.host_node).unwrap().local_demand += req.size_bytes;
        }
        *per_node.entry(v.node.clone()).or_default() += 1;
    }
    println!("placement: {per_node:?}; local preference met {local_hits} of 25 times; ledger {book:?}");

    // Retrying a create returns the same volume; no second one appears.
    let again = create(
        &c,
        &proto::CreateVolumeRequest { name: "vol-002".into(), size_bytes: sizes[14 % 6], ..Default::default() },
    )
    .await
    .unwrap();
    assert!(again.existed);
    let before = volumes(&c).await;
    assert_eq!(before.len(), 100);
    let on_engines: usize = nodes_.iter().map(engine_volume_count).sum();
    assert_eq!(on_engines, 100, "every volume exists once, on one engine");

    // The engines' pools agree with the model (allowing for heartbeat lag).
    wait_for("pool reports", Duration::from_secs(10), async || {
        let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
        pools.iter().all(|p| p.pool.as_ref().unwrap().used_bytes == book[&p.node].committed).then_some(())
    })
    .await;

    // Attach one volume: the owner is the optimized path and the two other nodes
    // forward to it. The owner allows the host and the forwarding engines.
    let target = before.iter().find(|v| v.node == "n2").unwrap().clone();
    let attach = proto::AttachRequest { volume: target.name.clone(), host_nqn: HOST.into(), ..Default::default() };
    let a = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let paths: Vec<(&str, &str)> = a.paths.iter().map(|p| (p.node.as_str(), p.ana_state.as_str())).collect();
    assert_eq!(paths, [("n2", "optimized"), ("n1", "non-optimized"), ("n3", "non-optimized")]);
    assert_eq!((a.paths[0].address.as_str(), a.paths[0].port), ("127.0.0.1", u32::from(nodes_[1].nvme_port)));
    let owner_allows = |nodes_: &[Node]| {
        let mut hosts = vec![HOST.to_string(), nodes_[0].host_nqn(), nodes_[2].host_nqn()];
        hosts.sort();
        hosts
    };
    assert_eq!(sorted(exports(&nodes_[1])[&a.subsystem_nqn].clone()), owner_allows(&nodes_));
    assert_eq!(exports(&nodes_[0])[&a.subsystem_nqn], vec![HOST.to_string()]);
    assert_eq!(exports(&nodes_[2])[&a.subsystem_nqn], vec![HOST.to_string()]);
    let before = volumes(&c).await;

    // Restart the controller: every volume is still there, the same.
    controller.proc.kill();
    controller = start_controller(root.path(), &store, port, "2");
    wait_healthy(&c, &["n1", "n2", "n3"]).await;
    let after = volumes(&c).await;
    // The live I/O figures are measurements the new leader makes afresh, not state.
    let state = |vs: &[proto::Volume]| vs.iter().map(|v| proto::Volume { io: None, ..v.clone() }).collect::<Vec<_>>();
    assert_eq!(state(&after), state(&before), "the restarted controller sees every volume as it was");

    // Kill n2's agent: the node turns unhealthy and takes nothing new.
    nodes_[1].agent.kill();
    wait_healthy(&c, &["n1", "n3"]).await;
    for i in 0..10 {
        let req = proto::CreateVolumeRequest {
            name: format!("late-{i}"),
            size_bytes: 4 * MIB,
            locality: Locality::Local as i32,
            host_node: "n2".into(),
            ..Default::default()
        };
        let v = create(&c, &req).await.unwrap().volume.unwrap();
        assert_ne!(v.node, "n2", "an unhealthy node must get no new volume");
    }
    let only_n2 = proto::CreateVolumeRequest { include_nodes: vec!["n2".into()], ..create_request("only-n2", MIB) };
    let e = create(&c, &only_n2).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("n2: unhealthy"), "{}", e.message());
    // Attaching to a volume on the dead node fails cleanly.
    let e = c
        .call(async |mut c| {
            c.attach(proto::AttachRequest {
                volume: target.name.clone(),
                host_nqn: format!("{HOST}-2"),
                ..Default::default()
            })
            .await
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    // Delete a volume of n2 while its agent is away, and restart n2's engine too,
    // so that it comes back with its pool but no exports.
    let doomed = after.iter().find(|v| v.node == "n2" && v.name != target.name).unwrap().name.clone();
    let deleted =
        c.call(async |mut c| c.delete_volume(proto::VolumeName { name: doomed.clone() }).await).await.unwrap();
    assert!(deleted.deleted);
    let n2_count = after.iter().filter(|v| v.node == "n2").count();
    assert_eq!(engine_volume_count(&nodes_[1]), n2_count, "the engine keeps it until its agent is back");
    nodes_[1].engine.kill();
    nodes_[1].start_engine(true);
    assert!(exports(&nodes_[1]).is_empty());

    // The agent comes back and reconciles.
    nodes_[1].start_agent(&controller.address);
    wait_healthy(&c, &["n1", "n2", "n3"]).await;
    assert!(volumes(&c).await.iter().all(|v| v.name != doomed), "the deleted volume is gone from the controller");
    let sorted_exports = |n: &Node| exports(n).into_iter().map(|(q, h)| (q, sorted(h))).collect::<BTreeMap<_, _>>();
    // What n2 must export is read again on every look: once n2 is healthy the
    // rebalancer brings the volumes made while it was away (asked local to n2) home,
    // one at a time, so the set grows while this waits.
    let exported = wait_for("n2 to reconcile", Duration::from_secs(30), async || {
        let mut want: BTreeMap<String, Vec<String>> =
            volumes(&c).await.into_iter().filter(|v| v.node == "n2").map(|v| (v.subsystem_nqn, v.hosts)).collect();
        want.insert(a.subsystem_nqn.clone(), owner_allows(&nodes_));
        (sorted_exports(&nodes_[1]) == want && engine_volume_count(&nodes_[1]) == want.len()).then_some(want.len())
    })
    .await;
    println!("n2 reconciled: {exported} exports, the deleted volume removed");

    // Kill n3's engine while its agent runs: the node is reported with its engine down
    // and takes nothing new, but keeps the capacity it last reported.
    let capacity_of_n3 = |nodes: &[proto::Node]| {
        nodes.iter().find(|n| n.name == "n3").map(|n| n.pools.iter().map(|p| p.capacity_bytes).sum::<u64>())
    };
    let before = capacity_of_n3(&nodes(&c).await).unwrap();
    assert!(before > 0);
    nodes_[2].engine.kill();
    wait_healthy(&c, &["n1", "n2"]).await;
    let listed = nodes(&c).await;
    let n3 = listed.iter().find(|n| n.name == "n3").unwrap();
    assert!(n3.engine_error.contains("does not answer"), "{:?}", n3.engine_error);
    assert_eq!(capacity_of_n3(&listed), Some(before), "an engine that is down empties no pool");
    let only_n3 =
        proto::CreateVolumeRequest { include_nodes: vec!["n3".into()], ..create_request("while-n3-is-blind", MIB) };
    let e = create(&c, &only_n3).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("n3: unhealthy"), "{}", e.message());
    // n3 was an access point of the attached volume: the attachment drops it (no
    // other node can take its place) while n3 is down, and takes it back once n3
    // answers again (paths heal): n3 exports the subsystem to the host again and the
    // owner allows n3 to forward once more.
    let paths_now = async || {
        let v = c.call(async |mut c| c.get_volume(proto::VolumeName { name: target.name.clone() }).await).await;
        v.unwrap().attachments[0].paths.iter().map(|p| p.node.clone()).collect::<Vec<_>>()
    };
    wait_for("the lost access point to be dropped", Duration::from_secs(10), async || {
        (paths_now().await == ["n2", "n1"]).then_some(())
    })
    .await;
    nodes_[2].start_engine(true);
    wait_healthy(&c, &["n1", "n2", "n3"]).await;
    assert!(nodes(&c).await.iter().all(|n| n.engine_error.is_empty()));
    wait_for("n3 to be an access point again", Duration::from_secs(15), async || {
        let n3_serves = exports(&nodes_[2]).get(&a.subsystem_nqn) == Some(&vec![HOST.to_string()]);
        let owner_allows_n3 =
            exports(&nodes_[1]).get(&a.subsystem_nqn).cloned().map(sorted) == Some(owner_allows(&nodes_));
        (paths_now().await == ["n2", "n1", "n3"] && n3_serves && owner_allows_n3).then_some(())
    })
    .await;
    println!(
        "n3's engine down: reported, capacity kept, nothing placed, its path dropped; its path back once it answers"
    );
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_clear_errors_and_leaves_nothing_behind() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let etcd = nvpool_control::testkit::Etcd::start(root.path().to_path_buf());
    let mut etcd = etcd;
    let controller = start_controller(root.path(), &format!("etcd:{}", etcd.client_url), free_port(), "1");
    let mut n1 = Node::new(root.path(), "n1", 1 << 30);
    n1.start_agent(&controller.address);
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1"]).await;

    let expect = async |req: proto::CreateVolumeRequest, code: Code, words: &str| {
        let e = create(&c, &req).await.unwrap_err();
        assert_eq!(e.code(), code, "{}: {}", req.name, e.message());
        assert!(e.message().contains(words), "{:?} lacks {words:?}", e.message());
        println!("{code:?}: {}", e.message());
    };
    expect(create_request("zero", 0), Code::InvalidArgument, "more than 0").await;
    expect(create_request("absurd", u64::MAX), Code::InvalidArgument, "largest volume").await;
    expect(create_request("too-big", 100 << 30), Code::ResourceExhausted, "no node can take").await;
    expect(create_request("bad name", MIB), Code::InvalidArgument, "not valid").await;
    expect(
        proto::CreateVolumeRequest { host_node: "nowhere".into(), ..create_request("x", MIB) },
        Code::NotFound,
        "unknown node \"nowhere\"",
    )
    .await;
    expect(
        proto::CreateVolumeRequest { exclude_nodes: vec!["ghost".into()], ..create_request("x", MIB) },
        Code::NotFound,
        "ghost",
    )
    .await;
    expect(
        proto::CreateVolumeRequest { locality: Locality::Local as i32, ..create_request("x", MIB) },
        Code::InvalidArgument,
        "host node",
    )
    .await;
    expect(proto::CreateVolumeRequest { locality: 9, ..create_request("x", MIB) }, Code::InvalidArgument, "locality 9")
        .await;

    // Same name, other parameters.
    create(&c, &create_request("dup", 8 * MIB)).await.unwrap();
    expect(create_request("dup", 16 * MIB), Code::AlreadyExists, "exists with size 8388608").await;
    expect(proto::CreateVolumeRequest { thin: true, ..create_request("dup", 8 * MIB) }, Code::AlreadyExists, "thick")
        .await;

    // Other calls.
    let e = c.call(async |mut c| c.get_volume(proto::VolumeName { name: "nope".into() }).await).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    let e = c
        .call(async |mut c| {
            c.attach(proto::AttachRequest { volume: "dup".into(), host_nqn: "not-an-nqn".into(), ..Default::default() })
                .await
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
    let e = c
        .call(async |mut c| {
            c.resize_volume(proto::ResizeVolumeRequest { name: "dup".into(), size_bytes: 100 << 30 }).await
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{}", e.message());
    let gone =
        c.call(async |mut c| c.delete_volume(proto::VolumeName { name: "never-made".into() }).await).await.unwrap();
    assert!(!gone.deleted, "deleting what does not exist succeeds and says so");

    // Nothing half-made: only "dup" exists, on the engine too.
    assert_eq!(volumes(&c).await.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(), ["dup"]);
    assert_eq!(engine_volume_count(&n1), 1);

    // The store goes away: a clear error, and nothing is created anywhere.
    etcd.stop();
    let e = create(&c, &create_request("while-down", MIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    assert!(e.message().contains("store"), "{}", e.message());
    println!("store down: {}", e.message());
    assert_eq!(engine_volume_count(&n1), 1, "no engine volume without a stored record");
    etcd.resume();
    wait_for("the store to be back", Duration::from_secs(30), async || {
        create(&c, &create_request("after", MIB)).await.ok()
    })
    .await;
    let names: Vec<String> = volumes(&c).await.into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["after", "dup"], "the failed call left no volume");
    assert_eq!(engine_volume_count(&n1), 2);

    // The store hangs in the middle of a creation, long enough for the controller to
    // lose its lease: whether or not the write landed, no node hears of a volume the
    // store does not hold, and retrying ends with exactly one volume.
    etcd.freeze();
    let e = create(&c, &create_request("while-frozen", MIB)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{}", e.message());
    println!("store frozen: {}", e.message());
    assert_eq!(engine_volume_count(&n1), 2, "no engine volume without a stored record");
    etcd.thaw();
    wait_for("the store to answer again", Duration::from_secs(30), async || {
        create(&c, &create_request("while-frozen", MIB)).await.ok()
    })
    .await;
    let names: Vec<String> = volumes(&c).await.into_iter().map(|v| v.name).collect();
    assert_eq!(names, ["after", "dup", "while-frozen"]);
    assert_eq!(engine_volume_count(&n1), 3, "one engine volume for the retried creation");
}

/// Heartbeats at rest list only what changed (the engine's usage since the mark the
/// agent gives): the controller adds changes to what it holds, so a volume's
/// allocation and I/O stay right, and a new leader, which holds nothing, gets
/// everything at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_reaches_the_controller_as_changes_and_whole_after_a_restart() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let port = free_port();
    let mut controller = start_controller(root.path(), &store, port, "1");
    let mut node = Node::new(root.path(), "n1", 1 << 30);
    node.start_agent(&controller.address);
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1"]).await;
    for name in ["idle", "busy"] {
        let req = proto::CreateVolumeRequest { thin: true, ..create_request(name, 64 * MIB) };
        create(&c, &req).await.unwrap();
    }
    let attach = proto::AttachRequest { volume: "busy".into(), host_nqn: cluster::HOST.into(), ..Default::default() };
    let a = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let allocated =
        async |name: &str| volumes(&c).await.into_iter().find(|v| v.name == name).map(|v| (v.allocated_bytes, v.io));
    let mut path = cluster::connect(cluster::addr(&node), &a.subsystem_nqn).expect("the host connects");
    // The first heartbeat of the volume's counters is where its rates start from.
    wait_for("the volume's first counters", Duration::from_secs(10), async || allocated("busy").await?.1).await;
    let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
    assert_eq!(pools.len(), 1, "{pools:?}");
    // Three clusters written: the controller hears of the change, and sees the writes.
    for cluster in 0..3u64 {
        let lba = cluster * MIB / cluster::BLOCK as u64;
        path.io
            .write(1, lba, &nvpool_initiator::pattern(cluster, cluster::BLOCK), cluster::BLOCK as u32, 8192)
            .unwrap();
    }
    wait_for("the allocation and the writes at the controller", Duration::from_secs(10), async || {
        let (bytes, io) = allocated("busy").await?;
        (bytes == 3 * MIB && io.is_some_and(|r| r.write_iops > 0.0)).then_some(())
    })
    .await;
    // The pool's committed bytes count the allocation. (Debug builds also check here
    // that the controller's ledger of the node, kept since the listing before the
    // writes, matches one worked out afresh: the heartbeat that carried the
    // allocation must have made it stale.)
    let pools = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.unwrap().pools;
    assert!(pools.iter().all(|p| p.node == "n1" && p.committed_bytes >= 3 * MIB), "{pools:?}");
    // At rest: the figures stand (the heartbeats carry nothing), the writes rate falls
    // to zero, and the idle volume has allocated nothing.
    wait_for("no writes at rest", Duration::from_secs(10), async || {
        let (bytes, io) = allocated("busy").await?;
        (bytes == 3 * MIB && io.is_some_and(|r| r.write_iops == 0.0)).then_some(())
    })
    .await;
    assert_eq!(allocated("idle").await.unwrap().0, 0);
    // A new controller process holds no usage, and the heartbeats at rest carry
    // none: the agent, told so, sends everything.
    controller.proc.kill();
    controller = start_controller(root.path(), &store, port, "2");
    wait_for("the allocation at the new controller", Duration::from_secs(10), async || {
        (allocated("busy").await?.0 == 3 * MIB).then_some(())
    })
    .await;
    // And changes again from there.
    let lba = 3 * MIB / cluster::BLOCK as u64;
    path.io.write(1, lba, &nvpool_initiator::pattern(3, cluster::BLOCK), cluster::BLOCK as u32, 8192).unwrap();
    wait_for("one more cluster at the new controller", Duration::from_secs(10), async || {
        (allocated("busy").await?.0 == 4 * MIB).then_some(())
    })
    .await;
    drop(controller);
}

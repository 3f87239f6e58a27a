//! Access points with real processes: four engines with their agents and one
//! controller (node timeout 3 s, heartbeats every 500 ms).
//!
//! - Every attachment gets one optimized and two non-optimized access points, and
//!   the engines report to the host exactly the ANA state the controller chose.
//! - balance gives the volumes of a group different optimized access points;
//!   inherit gives a host one optimized access point for a whole group.
//! - Data written through an access point that forwards is read back through the
//!   owner, and the other way round.
//! - A node that stops heartbeating has its attachments re-pathed: the optimized path
//!   moves to a surviving access point, the lost one is replaced, and the dead node
//!   drops its exports when it comes back.
//! - Every engine serving an attachment gives the host its access points (for its
//!   discovery log); with no spare node, an attachment that lost paths gets them
//!   back when a node returns.
//! - A policy that does not exist is refused with a clear error.

mod cluster;

use cluster::{LogsOnFailure, Node, create_request, free_port, nodes, start_controller, wait_for, wait_healthy};
use nvpool_api::{AnaState, ListAnaGroups};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use nvpool_wire::identify::lba_format_block_size;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tonic::Code;

const MIB: u64 = 1 << 20;
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0a0a0a0a-1111-2222-3333-444455556666";

async fn create(c: &Controllers, name: &str, owner: &str, policy: proto::AccessPolicy, group: &str) -> proto::Volume {
    let req = proto::CreateVolumeRequest {
        include_nodes: vec![owner.into()],
        access_policy: policy as i32,
        group: group.into(),
        ..create_request(name, 16 * MIB)
    };
    let r = c.call(async |mut c| c.create_volume(req.clone()).await).await;
    r.unwrap_or_else(|e| panic!("create {name}: {}", e.message())).volume.unwrap()
}

async fn attach(c: &Controllers, volume: &str) -> proto::AttachResponse {
    let req =
        proto::AttachRequest { volume: volume.into(), host_nqn: HOST.into(), explain: true, ..Default::default() };
    let r = c.call(async |mut c| c.attach(req.clone()).await).await;
    let r = r.unwrap_or_else(|e| panic!("attach {volume}: {}", e.message()));
    println!("{volume}: {}", r.explain.join("; "));
    r
}

fn path_nodes(paths: &[proto::Path]) -> Vec<String> {
    paths.iter().map(|p| p.node.clone()).collect()
}

async fn paths_of(c: &Controllers, volume: &str) -> Vec<proto::Path> {
    let req = proto::VolumeName { name: volume.into() };
    let v = c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap();
    v.attachments.into_iter().find(|a| a.host_nqn == HOST).map(|a| a.paths).unwrap_or_default()
}

/// The ANA state HOST sees for the volume through this node's engine.
fn ana_seen(node: &Node, nqn: &str) -> Option<AnaState> {
    let groups = nvpool_api::call(&node.socket(), &ListAnaGroups { nqn: nqn.into() }).ok()?;
    let g = groups.iter().find(|g| g.nsids.contains(&1))?;
    Some(g.hosts.iter().find(|h| h.host == HOST).map_or(g.state, |h| h.state))
}

fn node<'a>(nodes: &'a [Node], name: &str) -> &'a Node {
    nodes.iter().find(|n| n.name == name).unwrap()
}

/// Checks that each path's engine reports the path's ANA state to HOST.
fn check_engines_agree(nodes: &[Node], nqn: &str, paths: &[proto::Path]) -> bool {
    paths.iter().all(|p| {
        let want = if p.ana_state == "optimized" { AnaState::Optimized } else { AnaState::NonOptimized };
        ana_seen(node(nodes, &p.node), nqn) == Some(want)
    })
}

/// Writes `blocks` of pattern `seed` at LBA 0 through one engine as HOST, or reads
/// them back and compares.
fn io(node: &Node, nqn: &str, seed: u64, write: bool) {
    let addr: SocketAddr = format!("127.0.0.1:{}", node.nvme_port).parse().unwrap();
    let o = ConnectOptions::admin(nqn, HOST);
    let mut admin = connect_admin(addr, &o).unwrap_or_else(|e| panic!("connect to {}: {e}", node.name));
    admin.set_queue_count(1).unwrap();
    let block_size = lba_format_block_size(admin.identify_namespace(1).unwrap().lbaf0);
    let mut q = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).unwrap();
    let data = pattern(seed, 64 << 10);
    let nlb = (data.len() / block_size as usize) as u32;
    if write {
        q.write(1, 0, &data, block_size, 0).unwrap_or_else(|e| panic!("write through {}: {e}", node.name));
        q.flush(1).unwrap();
    } else {
        let back = q.read(1, 0, nlb, block_size).unwrap_or_else(|e| panic!("read through {}: {e}", node.name));
        assert!(back == data, "data read through {} differs from what was written", node.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_points_follow_the_policies_and_move_off_a_dead_node() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let mut nodes_: Vec<Node> = ["n1", "n2", "n3", "n4"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3", "n4"]).await;
    let listed = nodes(&c).await;
    let mut ranges: Vec<(u32, u32)> = listed.iter().map(|n| (n.cntlid_min, n.cntlid_max)).collect();
    ranges.sort();
    assert!(ranges.windows(2).all(|w| w[0].1 < w[1].0), "controller ID ranges overlap: {ranges:?}");
    for n in &nodes_ {
        let given = listed.iter().find(|l| l.name == n.name).unwrap();
        assert_eq!(given.host_nqn, n.host_nqn());
        wait_for("the engine to take its controller IDs", Duration::from_secs(5), async || {
            let info = n.engine_call(nvpool_api::GetEngineInfo {});
            ((u32::from(info.cntlid_min), u32::from(info.cntlid_max)) == (given.cntlid_min, given.cntlid_max))
                .then_some(())
        })
        .await;
    }

    // balance: two volumes of one group, both on n1, get different optimized nodes.
    let a = create(&c, "bal-a", "n1", proto::AccessPolicy::Balance, "g").await;
    let b = create(&c, "bal-b", "n1", proto::AccessPolicy::Balance, "g").await;
    let pa = attach(&c, &a.name).await.paths;
    let pb = attach(&c, &b.name).await.paths;
    assert_eq!((pa.len(), pb.len()), (3, 3));
    assert_eq!(pa[0].node, "n1", "balance starts at the owner");
    assert_ne!(pb[0].node, pa[0].node, "balance spreads a group's optimized paths");
    assert!(pb.iter().any(|p| p.node == "n1" && p.owner && p.ana_state == "non-optimized"));
    // inherit: the host keeps the first volume's optimized node for the group.
    let x = create(&c, "inh-x", "n2", proto::AccessPolicy::Inherit, "h").await;
    let y = create(&c, "inh-y", "n3", proto::AccessPolicy::Inherit, "h").await;
    let px = attach(&c, &x.name).await.paths;
    let py = attach(&c, &y.name).await.paths;
    assert_eq!(px[0].node, "n2");
    assert_eq!(py[0].node, "n2", "inherit: the group's optimized access point, not y's owner");
    assert!(py.iter().any(|p| p.node == "n3" && p.owner));
    for (v, paths) in [(&a, &pa), (&b, &pb), (&x, &px), (&y, &py)] {
        let mut distinct = path_nodes(paths);
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 3, "{}: paths on distinct nodes", v.name);
        let engines_agree = async || check_engines_agree(&nodes_, &v.subsystem_nqn, paths).then_some(());
        wait_for("the engines to report the chosen ANA states", Duration::from_secs(10), engines_agree).await;
    }

    // The operator moves a's optimized path; the other paths stay.
    let req = proto::AttachRequest {
        volume: a.name.clone(),
        host_nqn: HOST.into(),
        optimized_node: "n3".into(),
        ..Default::default()
    };
    let pa = c.call(async |mut c| c.attach(req.clone()).await).await.unwrap().paths;
    assert_eq!(path_nodes(&pa), ["n3", "n1", "n2"]);
    wait_for("the engines to report the moved path", Duration::from_secs(10), async || {
        check_engines_agree(&nodes_, &a.subsystem_nqn, &pa).then_some(())
    })
    .await;
    let unknown = proto::AttachRequest { optimized_node: "n9".into(), ..req.clone() };
    let e = c.call(async |mut c| c.attach(unknown.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{}", e.message());

    // Data goes in through b's optimized access point (it forwards to n1) and comes
    // back through the owner, then the other way round through a non-optimized one.
    io(node(&nodes_, &pb[0].node), &b.subsystem_nqn, 1, true);
    io(node(&nodes_, "n1"), &b.subsystem_nqn, 1, false);
    let other = pb.iter().find(|p| !p.owner && p.node != pb[0].node).unwrap().node.clone();
    io(node(&nodes_, "n1"), &b.subsystem_nqn, 2, true);
    io(node(&nodes_, &other), &b.subsystem_nqn, 2, false);
    println!("bal-b: written through {} and read through n1, written through n1 and read through {other}", pb[0].node);

    // b's optimized access point stops: its agent and engine die together.
    let lost = pb[0].node.clone();
    let dead = nodes_.iter().position(|n| n.name == lost).unwrap();
    let fault = Instant::now();
    nodes_[dead].agent.kill();
    nodes_[dead].engine.kill();
    let moved = wait_for("b's optimized path to move", Duration::from_secs(15), async || {
        let now = paths_of(&c, &b.name).await;
        (now.first().is_some_and(|p| p.node != lost && p.healthy)).then_some(now)
    })
    .await;
    let repathed = fault.elapsed();
    wait_for("the surviving engines to agree", Duration::from_secs(10), async || {
        check_engines_agree(&nodes_, &b.subsystem_nqn, &moved).then_some(())
    })
    .await;
    let agreed = fault.elapsed();
    println!(
        "{lost} lost: bal-b re-pathed {:?} -> {:?} after {repathed:?} (node timeout 3 s); engines report it after \
         {agreed:?}",
        path_nodes(&pb),
        path_nodes(&moved)
    );
    assert!(pb.iter().any(|p| p.node == moved[0].node), "the optimized path moves to a surviving access point");
    assert_eq!(moved.len(), 3, "the fourth node takes the lost access point's place");
    assert!(!path_nodes(&moved).contains(&lost));
    io(node(&nodes_, &moved[0].node), &b.subsystem_nqn, 2, false);
    let to_dead = proto::AttachRequest {
        volume: b.name.clone(),
        host_nqn: HOST.into(),
        optimized_node: lost.clone(),
        ..Default::default()
    };
    let e = c.call(async |mut c| c.attach(to_dead.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition);
    assert!(e.message().contains("it is unhealthy"), "{}", e.message());
    // Every other attachment that used the lost node moved off it too.
    for v in [&a, &x, &y].into_iter().filter(|v| v.node != lost) {
        let now = paths_of(&c, &v.name).await;
        assert!(!path_nodes(&now).contains(&lost), "{}: {:?}", v.name, path_nodes(&now));
    }

    // The node comes back: it serves no attachment any more and drops the exports.
    nodes_[dead].start_engine(true);
    nodes_[dead].start_agent(&controller.address);
    wait_healthy(&c, &["n1", "n2", "n3", "n4"]).await;
    wait_for("the returned node to drop its exports", Duration::from_secs(15), async || {
        let subsystems = nodes_[dead].engine_call(nvpool_api::ListSubsystems {});
        (!subsystems.iter().any(|s| s.nqn == b.subsystem_nqn)).then_some(())
    })
    .await;

    // Every engine serving b gives the host its access points for its discovery log,
    // at the addresses the host connects to.
    let now = paths_of(&c, &b.name).await;
    let wanted: Vec<String> = now.iter().map(|p| format!("{}:{}", p.address, p.port)).collect();
    wait_for("the engines to give the host its access points", Duration::from_secs(10), async || {
        let given = |p: &proto::Path| {
            let subsystems = node(&nodes_, &p.node).engine_call(nvpool_api::ListSubsystems {});
            let mine = subsystems.into_iter().find(|s| s.nqn == b.subsystem_nqn)?.host_paths;
            let paths = mine.into_iter().find(|h| h.host == HOST)?.paths;
            Some(paths.iter().map(|a| a.to_string()).collect::<Vec<_>>())
        };
        now.iter().all(|p| given(p).as_ref() == Some(&wanted)).then_some(())
    })
    .await;

    // With no spare node, losing both access points that forward leaves the owner and
    // one other; when one of the two comes back, the attachment has three paths again.
    let forwarding: Vec<usize> = now
        .iter()
        .filter(|p| p.node != b.node)
        .map(|p| nodes_.iter().position(|n| n.name == p.node).unwrap())
        .collect();
    for &i in &forwarding {
        nodes_[i].agent.kill();
        nodes_[i].engine.kill();
    }
    let short = wait_for("b's paths to shrink to the two healthy nodes", Duration::from_secs(15), async || {
        let paths = paths_of(&c, &b.name).await;
        (paths.len() == 2 && paths.iter().all(|p| p.healthy)).then_some(paths)
    })
    .await;
    let back = forwarding[0];
    let came_back = Instant::now();
    nodes_[back].start_engine(true);
    nodes_[back].start_agent(&controller.address);
    let full = wait_for("b to have three paths again", Duration::from_secs(15), async || {
        let paths = paths_of(&c, &b.name).await;
        (paths.len() == 3).then_some(paths)
    })
    .await;
    println!(
        "no spare: bal-b kept {:?}; {} came back and it has {:?} after {:?}",
        path_nodes(&short),
        nodes_[back].name,
        path_nodes(&full),
        came_back.elapsed()
    );
    assert!(path_nodes(&full).contains(&nodes_[back].name));
    assert_eq!(full[0].node, short[0].node, "the optimized path stays where it is");
    let other = forwarding[1];
    nodes_[other].start_engine(true);
    nodes_[other].start_agent(&controller.address);
    wait_healthy(&c, &["n1", "n2", "n3", "n4"]).await;
    let moved = full;

    // Detach: every access point forgets the host.
    let req = proto::DetachRequest { volume: b.name.clone(), host_nqn: HOST.into() };
    c.call(async |mut c| c.detach(req.clone()).await).await.unwrap();
    for p in &moved {
        let subsystems = node(&nodes_, &p.node).engine_call(nvpool_api::ListSubsystems {});
        let allowed =
            subsystems.iter().find(|s| s.nqn == b.subsystem_nqn).is_some_and(|s| s.hosts.iter().any(|h| h == HOST));
        assert!(!allowed, "{} still allows the detached host", p.node);
    }

    // A policy that does not exist.
    let bad = proto::CreateVolumeRequest { access_policy: 7, ..create_request("bad-policy", MIB) };
    let e = c.call(async |mut c| c.create_volume(bad.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("access policy 7 does not exist"), "{}", e.message());
}

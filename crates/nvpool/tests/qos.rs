//! A volume's I/O limits through the controller, with real processes: three engines
//! with their agents and one controller.
//!
//! - Limits given at creation reach the owner's namespace, and those of the access
//!   points an attachment adds.
//! - SetVolumeQos changes them on every engine that serves the volume, with the host
//!   connected; the volume reports them.
//! - Through an access point, reads wait for the limit (and never fail): a run of
//!   reads takes at least as long as the limit allows.
//! - The same name with other limits is another volume: AlreadyExists.

mod cluster;

use cluster::{
    BLOCK, HOST, LogsOnFailure, Node, addr, connect, create_request, free_port, start_controller, wait_healthy,
};
use nvpool_api::{ListSubsystems, QosLimits};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::time::{Duration, Instant};
use tonic::Code;

const MIB: u64 = 1 << 20;

/// The limits on namespace 1 of `nqn` on this node's engine, if it serves it.
fn limits_on(node: &Node, nqn: &str) -> Option<QosLimits> {
    let subsystems = node.engine_call(ListSubsystems {});
    subsystems.into_iter().find(|s| s.nqn == nqn)?.namespaces.into_iter().find(|n| n.nsid == 1).map(|n| n.qos)
}

async fn volume(c: &Controllers, name: &str) -> proto::Volume {
    let req = proto::VolumeName { name: name.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_reach_every_engine_serving_the_volume_and_change_live() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let mut nodes: Vec<Node> = ["n1", "n2", "n3"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3"]).await;

    let created = QosLimits { iops: 5000, bps: 64 * MIB, ..Default::default() };
    let req = proto::CreateVolumeRequest {
        include_nodes: vec!["n1".into()],
        qos: Some(created.into()),
        ..create_request("limited", 16 * MIB)
    };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    assert_eq!(QosLimits::from(v.qos.unwrap_or_default()), created, "the volume reports its limits");
    assert_eq!(limits_on(&nodes[0], &v.subsystem_nqn), Some(created), "the owner enforces them");

    // The same name with other limits is another volume.
    let other = proto::CreateVolumeRequest { qos: None, ..req.clone() };
    let e = c.call(async |mut c| c.create_volume(other.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{}", e.message());

    // An attachment adds two access points, which take the limits too.
    let attach = proto::AttachRequest { volume: "limited".into(), host_nqn: HOST.into(), ..Default::default() };
    let paths = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap().paths;
    assert_eq!(paths.len(), 3);
    for n in &nodes {
        assert_eq!(limits_on(n, &v.subsystem_nqn), Some(created), "{} serves the volume with its limits", n.name);
    }

    // A host reads through an access point that forwards; then the limit drops to
    // 200 IOPS with the host connected, and its reads wait for it.
    let forwarder = nodes.iter().find(|n| n.name != "n1").unwrap();
    let mut host = connect(addr(forwarder), &v.subsystem_nqn).expect("connect through an access point");
    host.io.read(1, 0, 1, BLOCK as u32).expect("a read within the limit");
    let slow = QosLimits { iops: 200, ..Default::default() };
    let set = proto::SetVolumeQosRequest { name: "limited".into(), qos: Some(slow.into()) };
    let v = c.call(async |mut c| c.set_volume_qos(set.clone()).await).await.unwrap();
    assert_eq!(QosLimits::from(v.qos.unwrap_or_default()), slow);
    for n in &nodes {
        assert_eq!(limits_on(n, &v.subsystem_nqn), Some(slow), "{} took the new limits", n.name);
    }
    let reads = 100;
    let started = Instant::now();
    for i in 0..reads {
        host.io.read(1, i, 1, BLOCK as u32).unwrap_or_else(|e| panic!("read {i} must wait, not fail: {e}"));
    }
    let took = started.elapsed();
    // A burst of 10 ms of the rate (2 reads) may pass at once; the rest wait.
    let least = Duration::from_secs_f64((reads - 2) as f64 / 200.0);
    assert!(took >= least, "{reads} reads at 200 IOPS took {took:?}, less than {least:?}");
    println!("{reads} reads through {} at 200 IOPS took {took:?}", forwarder.name);
    assert!(host.keep_alive(), "the host stayed connected through the change");

    // Lifting them.
    let set = proto::SetVolumeQosRequest { name: "limited".into(), qos: None };
    c.call(async |mut c| c.set_volume_qos(set.clone()).await).await.unwrap();
    assert_eq!(QosLimits::from(volume(&c, "limited").await.qos.unwrap_or_default()), QosLimits::default());
    for n in &nodes {
        assert_eq!(limits_on(n, &v.subsystem_nqn), Some(QosLimits::default()), "{} lifted them", n.name);
    }
}

//! Attaching a host through a local device, with real processes: a controller and two
//! nodes. This machine's kernel has no ublk driver, so what shows here is the
//! fallback: the host asked for a local device and gets NVMe/TCP paths, with the
//! reason, and nothing of the attempt is left. The local device itself, through the
//! same controller and agent, is shown in the test guest (`tests/kernel/local-e2e`).

mod cluster;

use cluster::{LogsOnFailure, Node, create_request, free_port, start_controller, wait_healthy};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use tonic::Code;

const MIB: u64 = 1 << 20;
const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0b0b0b0b-1111-2222-3333-444455556666";

async fn attach(c: &Controllers, host: &str, local_node: &str) -> Result<proto::AttachResponse, tonic::Status> {
    let req = proto::AttachRequest {
        volume: "lv".into(),
        host_nqn: host.into(),
        local_node: local_node.into(),
        ..Default::default()
    };
    c.call(async |mut c| c.attach(req.clone()).await).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_cannot_have_a_local_device_gets_nvme_tcp_paths_and_the_reason() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let mut nodes_: Vec<Node> = ["n1", "n2"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2"]).await;
    let req = proto::CreateVolumeRequest { include_nodes: vec!["n1".into()], ..create_request("lv", 16 * MIB) };
    c.call(async |mut c| c.create_volume(req.clone()).await).await.expect("volume created");

    let e = attach(&c, HOST, "n9").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("n9") && e.message().contains("node list"), "{}", e.message());

    // On another node than the owner: NVMe/TCP, because the data is elsewhere.
    let r = attach(&c, HOST, "n2").await.expect("attached over NVMe/TCP");
    assert!(r.local.is_none() && !r.paths.is_empty());
    assert!(r.local_fallback.contains("on node n1, not n2"), "{}", r.local_fallback);

    // On the owner, whose kernel has no ublk driver: NVMe/TCP, and the engine's reason.
    let second = format!("{HOST}-local");
    let r = attach(&c, &second, "n1").await.expect("attached");
    if std::path::Path::new("/dev/ublk-control").exists() {
        eprintln!("this kernel has the ublk driver: the guest test covers the device (tests/kernel/local-e2e)");
        return;
    }
    assert!(r.local.is_none() && !r.paths.is_empty(), "{r:?}");
    assert!(
        r.local_fallback.contains("node n1 cannot serve a local device")
            && r.local_fallback.contains("modprobe ublk_drv"),
        "{}",
        r.local_fallback
    );
    let v = c.call(async |mut c| c.get_volume(proto::VolumeName { name: "lv".into() }).await).await.expect("volume");
    assert!(v.attachments.iter().all(|a| a.local.is_none()), "no local attachment is left: {:?}", v.attachments);
    assert_eq!(v.attachments.len(), 2, "both hosts are attached over NVMe/TCP");
    let devices = nodes_[0].engine_call(nvpool_api::ListLocalDevices {});
    assert!(devices.is_empty());
}

//! Mutual TLS in the control plane, with real processes (a controller and two agents
//! with their engines, all with `--tls-dir` from `nvpool certs init`): the cluster
//! works over TLS end to end; a CLI call without a client certificate, or with one
//! from another CA, is refused, and with one it works; an agent's certificate cannot
//! report as another node; nobody but the controller can give an agent orders; keys
//! are written 0600.

mod cluster;

use cluster::{
    BIN, HOST, LogsOnFailure, Node, addr, create_request, free_port, nodes, start_controller_with, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto::{self, agent_client::AgentClient};
use nvpool_control::tls::Tls;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use tonic::Code;

fn certs_init(dir: &Path, nodes: &[&str]) {
    let mut cmd = Command::new(BIN);
    cmd.args(["certs", "init", "--dir"]).arg(dir);
    for n in nodes {
        cmd.args(["--node", n]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "certs init: {}", String::from_utf8_lossy(&out.stderr));
}

fn cli(controller: &str, args: &[&str], tls_dir: Option<&Path>) -> std::process::Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args).args(["--controller", controller]).env_remove("NVPOOL_TLS_DIR");
    if let Some(d) = tls_dir {
        cmd.arg("--tls-dir").arg(d);
    }
    cmd.output().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_plane_runs_over_mutual_tls_and_refuses_who_has_no_certificate() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let certs = root.path().join("certs");
    certs_init(&certs, &["n1", "n2"]);
    for key in ["controller.key", "node-n1.key", "client-admin.key", "client-csi.key"] {
        let mode = std::fs::metadata(certs.join(key)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{key}");
    }
    let tls_dir = certs.to_str().unwrap();
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller_with(root.path(), &store, free_port(), "1", &["--tls-dir", tls_dir]);
    let mut nodes_: Vec<Node> = ["n1", "n2"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes_ {
        n.start_agent_with(&controller.address, &["--tls-dir", tls_dir]);
    }
    let admin = Tls::load(&certs, "client:admin").unwrap();
    let c = Controllers::with_tls(&controller.address, Some(&admin)).unwrap();
    wait_healthy(&c, &["n1", "n2"]).await;

    // Over TLS end to end: a volume made and attached (the controller gives its agents
    // their orders over TLS).
    let req = proto::CreateVolumeRequest { include_nodes: vec!["n1".into()], ..create_request("t", 16 << 20) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: v.name.clone(), host_nqn: HOST.into(), ..Default::default() };
    let r = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    assert_eq!(r.paths.len(), 2);
    verify_io(addr(&nodes_[0]), &r.subsystem_nqn);

    // The CLI: refused without a certificate, working with one.
    let plain = cli(&controller.address, &["node", "list"], None);
    assert!(!plain.status.success(), "a CLI call without a certificate went through");
    println!("without a certificate: {}", String::from_utf8_lossy(&plain.stderr).trim());
    let with = cli(&controller.address, &["node", "list"], Some(&certs));
    assert!(with.status.success(), "{}", String::from_utf8_lossy(&with.stderr));
    assert!(String::from_utf8_lossy(&with.stdout).contains("n2"));

    // TLS that trusts the cluster's CA but presents no client certificate is refused.
    let ca = tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.pem")).unwrap());
    let anonymous = tonic::transport::Endpoint::from_shared(format!("https://{}", controller.address))
        .unwrap()
        .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(ca))
        .unwrap()
        .connect_lazy();
    let e = proto::controller_client::ControllerClient::new(anonymous)
        .list_nodes(proto::ListNodesRequest {})
        .await
        .unwrap_err();
    println!("TLS without a client certificate: {}", e.message());

    // A certificate from another CA is refused.
    let other = root.path().join("other-ca");
    certs_init(&other, &["n1"]);
    let stranger = Controllers::with_tls(&controller.address, Some(&Tls::load(&other, "client:admin").unwrap()))
        .map(|mut s| {
            s.patience = std::time::Duration::from_millis(300);
            s
        })
        .unwrap();
    let e = stranger.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await.unwrap_err();
    println!("a certificate from another CA: {}", e.message());

    // n2's certificate cannot register or heartbeat as n1.
    let n2 = Controllers::with_tls(&controller.address, Some(&Tls::load(&certs, "node:n2").unwrap())).unwrap();
    let listed = nodes(&c).await;
    let n1_record = listed.iter().find(|n| n.name == "n1").unwrap().clone();
    let register = proto::RegisterNodeRequest { node: Some(n1_record) };
    let e = n2.call(async |mut c| c.register_node(register.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
    let beat = proto::HeartbeatRequest { node: "n1".into(), ..Default::default() };
    let e = n2.call(async |mut c| c.heartbeat(beat.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
    // An admin client cannot speak for a node either.
    let e = c.call(async |mut c| c.heartbeat(beat.clone()).await).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    // Only the controller gives an agent orders.
    let agent = tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{}", nodes_[0].agent_port))
        .unwrap()
        .tls_config(admin.client())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let e = AgentClient::new(agent).apply(proto::NodeState::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{}", e.message());
    // The nodes stayed healthy throughout.
    wait_healthy(&c, &["n1", "n2"]).await;
}

fn verify_io(at: std::net::SocketAddr, nqn: &str) {
    let o = nvpool_initiator::ConnectOptions::admin(nqn, HOST);
    let mut admin = nvpool_initiator::connect_admin(at, &o).expect("the owner exports the volume");
    admin.identify_namespace(1).unwrap();
}

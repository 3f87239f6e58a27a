//! DH-HMAC-CHAP through the controller, with real processes (a controller, three
//! engines with their agents): `attach --dhchap` makes a host's secrets, every access
//! point (the owner and the engines that forward to it) demands them, a host without
//! them gets nothing but Authentication Required, listings never show them, and detach
//! revokes them everywhere.

mod cluster;

use cluster::{LogsOnFailure, Node, addr, create_request, free_port, start_controller, wait_healthy, write_then_read};
use nvpool_api::ListSubsystems;
use nvpool_auth::Secret;
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_initiator::{ConnectOptions, Error, HostAuth, Queue};
use nvpool_wire::Status;
use std::net::SocketAddr;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:0d0d0d0d-1111-2222-3333-444455556666";

fn addr_of(nodes: &[Node], name: &str) -> SocketAddr {
    addr(nodes.iter().find(|n| n.name == name).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_with_dhchap_secures_every_access_point_and_detach_revokes_it() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let mut nodes_: Vec<Node> = ["n1", "n2", "n3"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3"]).await;
    let req = proto::CreateVolumeRequest { include_nodes: vec!["n1".into()], ..create_request("sec", 16 << 20) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();

    let attach =
        proto::AttachRequest { volume: v.name.clone(), host_nqn: HOST.into(), dhchap: true, ..Default::default() };
    let r = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let secrets = r.dhchap.clone().expect("secrets for a host attached with dhchap");
    assert_eq!(r.paths.len(), 3, "an owner and two access points");
    let auth = HostAuth::new(
        Secret::parse(&secrets.secret).expect("a DHHC-1 host secret"),
        Some(Secret::parse(&secrets.ctrl_secret).expect("a DHHC-1 controller secret")),
    );
    // Attaching again gives the same secrets.
    let again = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    assert_eq!(again.dhchap, r.dhchap);

    // Every path demands them, and serves the host that has them.
    let paths: Vec<SocketAddr> = r.paths.iter().map(|p| addr_of(&nodes_, &p.node)).collect();
    write_then_read(HOST, paths[1], paths[2], &r.subsystem_nqn, &auth);
    write_then_read(HOST, paths[0], paths[1], &r.subsystem_nqn, &auth);
    for at in &paths {
        let mut q = Queue::connect(*at, &ConnectOptions::admin(&r.subsystem_nqn, HOST)).unwrap();
        assert!(q.auth_required, "{at} lets the host in without authenticating");
        match q.identify_controller() {
            Err(Error::Command(s)) => assert_eq!(s.base(), Status::AUTH_REQUIRED),
            other => panic!("a host without its secret at {at}: {:?}", other.map(|_| ())),
        }
        let wrong = HostAuth::new(Secret::generate(None), None);
        let o = ConnectOptions { auth: Some(wrong), ..ConnectOptions::admin(&r.subsystem_nqn, HOST) };
        assert!(matches!(Queue::connect(*at, &o), Err(Error::AuthRefused(_))), "a wrong secret at {at}");
    }

    // Listings name the host, never a secret.
    let listed = format!(
        "{:?}",
        c.call(async |mut c| c.get_volume(proto::VolumeName { name: v.name.clone() }).await).await.unwrap()
    );
    assert!(!listed.contains("DHHC") && listed.contains(HOST), "{listed}");
    for n in &nodes_ {
        let subsystems = n.engine_call(ListSubsystems {});
        let s = subsystems.iter().find(|s| s.nqn == r.subsystem_nqn).expect("the volume's subsystem");
        let a = s.authenticated_hosts.iter().find(|a| a.host == HOST).expect("the host authenticates");
        assert!(a.bidirectional && !a.fingerprint.is_empty());
        assert!(!serde_json::to_string(&subsystems).unwrap().contains("DHHC"));
    }

    // Detach revokes: no engine lets the host in any more (the owner refuses the host,
    // the access points no longer export the volume at all).
    let detach = proto::DetachRequest { volume: v.name.clone(), host_nqn: HOST.into() };
    c.call(async |mut c| c.detach(detach.clone()).await).await.unwrap();
    for at in &paths {
        let o = ConnectOptions { auth: Some(auth.clone()), ..ConnectOptions::admin(&r.subsystem_nqn, HOST) };
        match Queue::connect(*at, &o) {
            Err(Error::Command(s))
                if [Status::CONNECT_INVALID_HOST, Status::CONNECT_INVALID_PARAMETERS].contains(&s.base()) => {}
            other => panic!("a detached host at {at}: {:?}", other.map(|_| ())),
        }
    }
    // Attached again with dhchap: new secrets.
    let fresh = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    assert_ne!(fresh.dhchap.unwrap().secret, secrets.secret);
}

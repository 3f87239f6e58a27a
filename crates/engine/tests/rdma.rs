//! An RDMA listener on a machine that cannot serve it: the engine starts, serves its
//! TCP listeners, and says why the RDMA one is missing. (NVMe over RDMA itself is
//! tested against the Linux host in the test guest: tests/kernel/rdma-e2e.)

use nvpool_api::Transport;
use nvpool_engine::config::{EngineConfig, ListenerConfig, SubsystemConfig};
use nvpool_engine::error::ErrorKind;
use nvpool_initiator::{ConnectOptions, connect_admin};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:rdma-less";
const HOST: &str = "nqn.2024-01.io.nvpool:host-a";

#[test]
fn an_rdma_listener_that_cannot_start_fails_alone_and_tcp_serves() {
    let listener =
        |transport| ListenerConfig { address: "127.0.0.1:0".parse().unwrap(), tls: Default::default(), transport };
    let cfg = EngineConfig {
        reactors: Some(1),
        listeners: vec![listener(Transport::Tcp), listener(Transport::Rdma)],
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: true,
            hosts: vec![],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces: vec![namespace("memory:1MiB", 512)],
        }],
        ..EngineConfig::default()
    };
    let t = TestEngine::start(&cfg);
    let rdma_listening = t.engine.listeners().iter().any(|l| l.transport == Transport::Rdma);
    let added = t.engine.add_listener("127.0.0.1:0".parse().unwrap(), Default::default(), Transport::Rdma);
    match added {
        // A machine with an RDMA device serves RDMA on the loopback address too.
        Ok(l) => {
            assert!(rdma_listening, "the configured RDMA listener failed where a second one starts");
            assert_eq!(l.transport, Transport::Rdma);
        }
        Err(e) => {
            assert!(!rdma_listening);
            assert_eq!(e.kind, ErrorKind::Unavailable, "{e:?}");
            assert!(e.message.contains("rdma:127.0.0.1:0") && e.message.contains("RDMA"), "{}", e.message);
            assert!(
                e.message.contains("rdma_ucm") || e.message.contains("install") || e.message.contains("rdma link add"),
                "the error says what to do: {}",
                e.message
            );
        }
    }
    // TLS belongs to TCP: asked of an RDMA listener, it is a configuration error.
    let tls = t.engine.add_listener("127.0.0.1:0".parse().unwrap(), nvpool_api::TlsMode::Required, Transport::Rdma);
    assert_eq!(tls.map(|_| ()).unwrap_err().kind, ErrorKind::InvalidArgument);
    // The TCP listener serves.
    let mut admin = connect_admin(t.addr, &ConnectOptions::admin(NQN, HOST)).expect("the TCP listener serves");
    assert_eq!(admin.identify_controller().unwrap().sgls & (1 << 2), 0, "no keyed SGLs over TCP");
}

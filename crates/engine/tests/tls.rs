//! NVMe/TCP listeners with TLS, driven over real sockets: the engine tells plain
//! NVMe/TCP from a TLS handshake, refuses plain connections where TLS is required,
//! and finishes the handshake only with a host that holds the PSK configured for the
//! identity it offers. (The records after the handshake are the kernel's work, kTLS,
//! which this machine's kernel may lack: the kernel host in the test guest covers
//! I/O over TLS, `tests/kernel/tls-e2e`.)

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use nvpool_api::{HostTlsPsk, TlsMode, TlsPsk};
use nvpool_auth::{ConfiguredPsk, Hash, Kdf};
use nvpool_engine::config::{EngineConfig, ListenerConfig, SubsystemConfig};
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:tls";
const HOST: &str = "nqn.2024-01.io.nvpool:host-tls";

struct Listeners {
    t: TestEngine,
    required: SocketAddr,
    allowed: SocketAddr,
}

/// An engine with a TLS-only and a TLS-or-plain listener; HOST has `psk`.
fn start(psk: &ConfiguredPsk) -> Listeners {
    let cfg = EngineConfig {
        reactors: Some(2),
        listeners: vec![ListenerConfig {
            address: "127.0.0.1:0".parse().unwrap(),
            tls: TlsMode::Required,
            transport: Default::default(),
        }],
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: false,
            hosts: vec![],
            dhchap: vec![],
            tls_psk: vec![HostTlsPsk { host: HOST.into(), psk: TlsPsk { key: psk.to_interchange(), kdf: None } }],
            namespaces: vec![namespace("memory:16MiB", 512)],
        }],
        ..EngineConfig::default()
    };
    let t = TestEngine::start(&cfg);
    let allowed = t.engine.add_listener("127.0.0.1:0".parse().unwrap(), TlsMode::Allowed, Default::default()).unwrap();
    let allowed = SocketAddr::new(allowed.addr, allowed.port);
    Listeners { required: t.addr, allowed, t }
}

/// A TLS 1.3 client handshake offering `identity` with the TLS PSK `key`.
fn handshake(addr: SocketAddr, identity: String, key: Vec<u8>) -> Result<String, String> {
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    nvpool_initiator::tls::psk_handshake(stream, &identity, &key)
}

/// Whether the engine closes the connection (after an alert, perhaps) within 20 s.
fn the_engine_closes(mut s: TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 256];
    for _ in 0..16 {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => return e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut,
        }
    }
    false
}

#[test]
fn plain_nvme_tcp_is_closed_where_tls_is_required_and_served_where_allowed() {
    let psk = ConfiguredPsk::generate(Hash::Sha256);
    let l = start(&psk);
    let o = ConnectOptions::admin(NQN, HOST);
    assert!(connect_admin(l.required, &o).is_err(), "a plain ICReq to a TLS-only listener must not be answered");
    let mut admin = connect_admin(l.allowed, &o).expect("plain NVMe/TCP on a TLS-or-plain listener");
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let mut io = Queue::connect(l.allowed, &o.io(1, admin.cntlid, 31)).unwrap();
    let data = pattern(9, 4096);
    io.write(1, 0, &data, 512, 0).unwrap();
    assert_eq!(io.read(1, 0, 8, 512).unwrap(), data);
    let listed = l.t.engine.listeners();
    assert!(listed.iter().any(|i| i.tls == TlsMode::Required) && listed.iter().any(|i| i.tls == TlsMode::Allowed));
    let subsystems = l.t.engine.subsystems();
    assert_eq!(subsystems[0].tls_psk_hosts, vec![HOST.to_string()]);
    assert!(!serde_json::to_string(&subsystems).unwrap().contains("NVMeTLSkey"), "listings never show a PSK");
}

#[test]
fn the_handshake_succeeds_only_with_the_configured_psk() {
    let psk = ConfiguredPsk::generate(Hash::Sha256);
    let l = start(&psk);
    for version in [0, 1] {
        let identity = psk.identity(Kdf::Compat, version, HOST, NQN);
        let key = psk.tls_psk(Kdf::Compat, &identity).unwrap();
        for addr in [l.required, l.allowed] {
            let suite = handshake(addr, identity.to_string(), key.clone())
                .unwrap_or_else(|e| panic!("identity v{version} to {addr}: {e}"));
            assert_eq!(suite, "TLS_AES_128_GCM_SHA256");
        }
    }
    // A version 1 identity tells the engine which derivation the host used.
    let rfc = psk.identity(Kdf::Rfc8446, 1, HOST, NQN);
    handshake(l.required, rfc.to_string(), psk.tls_psk(Kdf::Rfc8446, &rfc).unwrap()).expect("RFC 8446 derivation");

    let v0 = psk.identity(Kdf::Compat, 0, HOST, NQN);
    // A key derived another way, another host's key, an unknown host, another
    // subsystem, something that is no NVMe identity: no handshake.
    let wrong_kdf = psk.tls_psk(Kdf::Rfc8446, &v0).unwrap();
    assert!(handshake(l.required, v0.to_string(), wrong_kdf).is_err());
    let other = ConfiguredPsk::generate(Hash::Sha256);
    assert!(handshake(l.required, v0.to_string(), other.tls_psk(Kdf::Compat, &v0).unwrap()).is_err());
    let stranger = psk.identity(Kdf::Compat, 0, "nqn.2024-01.io.nvpool:stranger", NQN);
    assert!(handshake(l.required, stranger.to_string(), psk.tls_psk(Kdf::Compat, &stranger).unwrap()).is_err());
    let elsewhere = psk.identity(Kdf::Compat, 0, HOST, "nqn.2024-01.io.nvpool:other");
    assert!(handshake(l.required, elsewhere.to_string(), psk.tls_psk(Kdf::Compat, &elsewhere).unwrap()).is_err());
    assert!(handshake(l.required, "client".into(), vec![7; 32]).is_err());
    // The engine serves on, plain where plain is allowed.
    connect_admin(l.allowed, &ConnectOptions::admin(NQN, HOST)).expect("still serving");
}

#[test]
fn a_sha384_psk_runs_tls_aes_256_gcm_sha384() {
    let psk = ConfiguredPsk::generate(Hash::Sha384);
    let l = start(&psk);
    let identity = psk.identity(Kdf::Compat, 0, HOST, NQN);
    assert!(identity.to_string().starts_with("NVMe0R02 "));
    let key = psk.tls_psk(Kdf::Compat, &identity).unwrap();
    assert_eq!(key.len(), 48);
    let suite = handshake(l.required, identity.to_string(), key.clone()).expect("SHA-384 handshake");
    assert_eq!(suite, "TLS_AES_256_GCM_SHA384");
    let mut wrong = key;
    wrong[0] ^= 1;
    assert!(handshake(l.required, identity.to_string(), wrong).is_err());
}

#[test]
fn a_silent_or_garbage_peer_is_closed_without_harm() {
    let psk = ConfiguredPsk::generate(Hash::Sha256);
    let l = start(&psk);
    // A TLS record header, then nothing that makes a ClientHello.
    let mut s = TcpStream::connect(l.required).unwrap();
    std::io::Write::write_all(&mut s, &[22, 3, 1, 0, 4, 0xff, 0xff, 0xff, 0xff]).unwrap();
    assert!(the_engine_closes(s));
    // A host that closes before it says anything.
    drop(TcpStream::connect(l.required).unwrap());
    connect_admin(l.allowed, &ConnectOptions::admin(NQN, HOST)).expect("still serving");
}

//! DH-HMAC-CHAP in the engine, driven by the in-repo initiator over real sockets: the
//! transaction on the admin and I/O queues, unidirectional and bidirectional, every
//! hash and Diffie-Hellman group, re-authentication, and the refusals (wrong secret,
//! wrong controller secret, a replayed reply, a host that skips authentication).

use std::net::SocketAddr;

use nvpool_auth::chap::{self, Proof};
use nvpool_auth::{DhGroup, Hash, KeyPair, Secret};
use nvpool_engine::config::{EngineConfig, SubsystemConfig};
use nvpool_engine::{DhchapKeys, SubsystemInfo};
use nvpool_initiator::{ConnectOptions, Error, HostAuth, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::auth::{Message, Negotiate, Reply, failure};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:auth";
const HOST: &str = "nqn.2024-01.io.nvpool:host-auth";
const OTHER_HOST: &str = "nqn.2024-01.io.nvpool:host-plain";

fn keys(secret: &Secret, ctrl: Option<&Secret>, hash: Option<Hash>, group: DhGroup) -> DhchapKeys {
    DhchapKeys {
        secret: secret.to_dhhc(),
        ctrl_secret: ctrl.map(Secret::to_dhhc),
        hash: hash.map(|h| h.name().into()),
        dh_group: Some(group.name().into()),
    }
}

/// An engine whose subsystem lets any host in, and makes HOST authenticate.
fn start(k: DhchapKeys) -> TestEngine {
    let cfg = EngineConfig {
        reactors: Some(2),
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: true,
            hosts: vec![],
            dhchap: vec![nvpool_api::HostDhchap { host: HOST.into(), keys: k }],
            tls_psk: vec![],
            namespaces: vec![namespace("memory:16MiB", 512)],
        }],
        ..EngineConfig::default()
    };
    TestEngine::start(&cfg)
}

fn opts(auth: Option<HostAuth>) -> ConnectOptions {
    ConnectOptions { auth, ..ConnectOptions::admin(NQN, HOST) }
}

/// An authenticated admin queue and one authenticated I/O queue; writes and reads
/// back through the I/O queue.
fn round_trip(addr: SocketAddr, o: &ConnectOptions) {
    let mut admin = connect_admin(addr, o).expect("admin queue authenticates");
    assert!(admin.auth_required);
    assert_eq!(admin.set_queue_count(1).unwrap(), 1);
    let mut io = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).expect("I/O queue authenticates");
    assert!(io.auth_required, "every queue authenticates");
    let data = pattern(5, 8192);
    io.write(1, 8, &data, 512, 0).unwrap();
    assert_eq!(io.read(1, 8, 16, 512).unwrap(), data);
}

fn status_of(e: Error) -> Status {
    match e {
        Error::Command(s) => s.base(),
        other => panic!("expected a command status, got {other}"),
    }
}

#[test]
fn unidirectional_and_bidirectional_authentication_serve_io() {
    let host = Secret::generate(Some(Hash::Sha256));
    let ctrl = Secret::generate(Some(Hash::Sha256));
    let t = start(keys(&host, Some(&ctrl), None, DhGroup::Ffdhe2048));
    round_trip(t.addr, &opts(Some(HostAuth::new(host.clone(), None))));
    round_trip(t.addr, &opts(Some(HostAuth::new(host, Some(ctrl)))));
}

#[test]
fn every_hash_and_group_the_linux_host_offers() {
    let host = Secret::generate(None);
    for (hash, group) in [
        (Hash::Sha256, DhGroup::Null),
        (Hash::Sha384, DhGroup::Ffdhe3072),
        (Hash::Sha512, DhGroup::Ffdhe4096),
        (Hash::Sha256, DhGroup::Ffdhe6144),
        (Hash::Sha512, DhGroup::Ffdhe8192),
    ] {
        let ctrl = Secret::generate(Some(hash));
        let t = start(keys(&host, Some(&ctrl), Some(hash), group));
        let mut q = connect_admin(t.addr, &opts(Some(HostAuth::new(host.clone(), Some(ctrl)))))
            .unwrap_or_else(|e| panic!("{hash} {group}: {e}"));
        q.identify_controller().unwrap();
    }
}

#[test]
fn a_wrong_secret_is_refused_and_the_queue_takes_nothing_else() {
    let host = Secret::generate(Some(Hash::Sha384));
    let t = start(keys(&host, None, None, DhGroup::Ffdhe2048));
    let wrong = Secret::generate(Some(Hash::Sha384));
    match Queue::connect(t.addr, &opts(Some(HostAuth::new(wrong.clone(), None)))) {
        Err(Error::AuthRefused(e)) => assert_eq!(e, failure::FAILED),
        other => panic!("a wrong secret got {:?}", other.map(|_| ())),
    }
    // The same through the steps: the connection stays, and refuses other commands.
    let mut q = Queue::connect(t.addr, &opts(None)).unwrap();
    assert!(matches!(q.authenticate(&HostAuth::new(wrong, None), HOST, NQN), Err(Error::AuthRefused(_))));
    assert_eq!(status_of(q.identify_controller().unwrap_err()), Status::AUTH_REQUIRED);
    // A transaction with the right secret on that connection succeeds.
    q.authenticate(&HostAuth::new(host, None), HOST, NQN).unwrap();
    q.enable().unwrap();
    q.identify_controller().unwrap();
}

#[test]
fn a_host_that_skips_authentication_gets_authentication_required() {
    let host = Secret::generate(None);
    let t = start(keys(&host, None, None, DhGroup::Ffdhe2048));
    let mut q = Queue::connect(t.addr, &opts(None)).unwrap();
    assert!(q.auth_required);
    assert_eq!(status_of(q.property_get(0, true).unwrap_err()), Status::AUTH_REQUIRED);
    assert_eq!(status_of(q.identify_controller().unwrap_err()), Status::AUTH_REQUIRED);
    // An I/O queue of the unauthenticated controller is refused too.
    let mut io = Queue::connect(t.addr, &opts(None).io(1, q.cntlid, 31)).err();
    assert!(io.take().is_some(), "an I/O queue of a controller that never became ready");
    // A host without secrets on the subsystem connects as before.
    let mut plain = connect_admin(t.addr, &ConnectOptions::admin(NQN, OTHER_HOST)).unwrap();
    assert!(!plain.auth_required);
    plain.identify_controller().unwrap();
}

#[test]
fn a_wrong_controller_secret_makes_the_host_refuse_the_controller() {
    let host = Secret::generate(Some(Hash::Sha512));
    let ctrl = Secret::generate(Some(Hash::Sha512));
    let t = start(keys(&host, Some(&ctrl), None, DhGroup::Ffdhe2048));
    let mut q = Queue::connect(t.addr, &opts(None)).unwrap();
    let not_ctrl = Secret::generate(Some(Hash::Sha512));
    match q.authenticate(&HostAuth::new(host.clone(), Some(not_ctrl)), HOST, NQN) {
        Err(Error::Auth(why)) => assert!(why.contains("controller"), "{why}"),
        other => panic!("{other:?}"),
    }
    // The host sent FAILURE2: the queue is not authenticated.
    assert_eq!(status_of(q.identify_controller().unwrap_err()), Status::AUTH_REQUIRED);
    // Asking a controller without a controller secret to authenticate fails too.
    let t2 = start(keys(&host, None, None, DhGroup::Null));
    match Queue::connect(t2.addr, &opts(Some(HostAuth::new(host, Some(ctrl))))) {
        Err(Error::AuthRefused(e)) => assert_eq!(e, failure::FAILED),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// Runs a transaction by hand up to the reply; returns the reply's bytes.
fn reply_to_challenge(q: &mut Queue, host: &Secret, transaction: u16) -> Vec<u8> {
    let n = Negotiate { transaction, secure_channel: 0, dhchap: true, hashes: vec![1], dh_groups: vec![1] };
    assert!(q.auth_send(&Message::Negotiate(n).encode()).unwrap().is_success());
    let Message::Challenge(c) = q.auth_receive().unwrap() else { panic!("no challenge") };
    let k = KeyPair::generate(DhGroup::Ffdhe2048);
    let shared = k.shared_secret(&c.dh_public).unwrap();
    let key = host.transformed(HOST);
    let challenge = chap::effective_challenge(Hash::Sha256, &c.challenge, Some(&shared));
    let proof = Proof { hash: Hash::Sha256, key: &key, challenge: &challenge, seqnum: c.seqnum, transaction };
    let reply = Reply {
        transaction,
        response: chap::host_response(&proof, 0, HOST, NQN),
        challenge: None,
        seqnum: 0,
        dh_public: k.public().to_vec(),
    };
    Message::Reply(reply).encode()
}

#[test]
fn a_replayed_reply_is_refused() {
    let host = Secret::generate(Some(Hash::Sha256));
    let t = start(keys(&host, None, Some(Hash::Sha256), DhGroup::Ffdhe2048));
    let mut first = Queue::connect(t.addr, &opts(None)).unwrap();
    let reply = reply_to_challenge(&mut first, &host, 1);
    assert!(first.auth_send(&reply).unwrap().is_success());
    assert!(matches!(first.auth_receive().unwrap(), Message::Success1(_)));
    // Someone who saw that reply sends it to a new challenge, same transaction ID.
    let mut second = Queue::connect(t.addr, &opts(None)).unwrap();
    let _fresh = reply_to_challenge(&mut second, &host, 1);
    assert!(second.auth_send(&reply).unwrap().is_success());
    match second.auth_receive().unwrap() {
        Message::Failure { from_controller: true, explanation, .. } => assert_eq!(explanation, failure::FAILED),
        other => panic!("a replayed reply got {other:?}"),
    }
    assert_eq!(status_of(second.identify_controller().unwrap_err()), Status::AUTH_REQUIRED);
}

#[test]
fn messages_out_of_turn_or_malformed_fail_the_transaction() {
    let host = Secret::generate(None);
    let t = start(keys(&host, None, None, DhGroup::Null));
    let mut q = Queue::connect(t.addr, &opts(None)).unwrap();
    // A reply before any challenge.
    let r = Reply { transaction: 1, response: vec![0; 32], challenge: None, seqnum: 0, dh_public: vec![] };
    assert!(q.auth_send(&Message::Reply(r).encode()).unwrap().is_success());
    match q.auth_receive().unwrap() {
        Message::Failure { explanation, .. } => assert_eq!(explanation, failure::INCORRECT_PROTOCOL),
        other => panic!("{other:?}"),
    }
    // Garbage, then a Receive with nothing to receive.
    assert!(q.auth_send(&[0xAB; 5]).unwrap().is_success());
    assert!(matches!(q.auth_receive().unwrap(), Message::Failure { explanation: failure::INCORRECT_PAYLOAD, .. }));
    assert!(matches!(q.auth_receive().unwrap(), Message::Failure { explanation: failure::INCORRECT_PROTOCOL, .. }));
    // A hash the configuration does not allow.
    let t2 = start(keys(&host, None, Some(Hash::Sha512), DhGroup::Null));
    let mut q2 = Queue::connect(t2.addr, &opts(None)).unwrap();
    let mut only_sha256 = HostAuth::new(host.clone(), None);
    only_sha256.hashes = vec![Hash::Sha256.id()];
    assert!(matches!(q2.authenticate(&only_sha256, HOST, NQN), Err(Error::AuthRefused(failure::HASH_UNUSABLE))));
    // After all that, a proper transaction still works.
    q.authenticate(&HostAuth::new(host, None), HOST, NQN).unwrap();
    q.enable().unwrap();
}

#[test]
fn reauthentication_uses_the_current_secret_and_listings_show_no_secret() {
    let old = Secret::generate(Some(Hash::Sha256));
    let t = start(keys(&old, None, None, DhGroup::Ffdhe2048));
    let mut q = connect_admin(t.addr, &opts(Some(HostAuth::new(old.clone(), None)))).unwrap();
    q.authenticate(&HostAuth::new(old.clone(), None), HOST, NQN).expect("re-authentication");
    let new = Secret::generate(Some(Hash::Sha256));
    t.engine.add_host(NQN, HOST, Some(&keys(&new, None, None, DhGroup::Ffdhe2048)), None).unwrap();
    assert!(matches!(q.authenticate(&HostAuth::new(old, None), HOST, NQN), Err(Error::AuthRefused(_))));
    assert_eq!(status_of(q.identify_controller().unwrap_err()), Status::AUTH_REQUIRED);
    q.authenticate(&HostAuth::new(new.clone(), None), HOST, NQN).unwrap();
    q.identify_controller().unwrap();

    let listed: Vec<SubsystemInfo> = t.engine.subsystems();
    let json = serde_json::to_string(&listed).unwrap();
    assert!(!json.contains("DHHC") && !json.contains(&new.to_dhhc()[10..30]), "{json}");
    let a = &listed[0].authenticated_hosts[0];
    assert_eq!((a.host.as_str(), a.bidirectional, a.dh_group.as_str()), (HOST, false, "ffdhe2048"));
}

#[test]
fn bad_secrets_are_refused_with_the_reason() {
    let t = start(keys(&Secret::generate(None), None, None, DhGroup::Null));
    let bad = DhchapKeys { secret: "DHHC-1:01:nope:".into(), ..DhchapKeys::default() };
    let e = t.engine.add_host(NQN, HOST, Some(&bad), None).unwrap_err();
    assert!(e.message.contains("base64") || e.message.contains("secret"), "{}", e.message);
    let s = Secret::generate(None);
    let same = DhchapKeys { secret: s.to_dhhc(), ctrl_secret: Some(s.to_dhhc()), ..DhchapKeys::default() };
    assert!(t.engine.add_host(NQN, HOST, Some(&same), None).unwrap_err().message.contains("ctrl_secret"));
    let group = DhchapKeys { secret: s.to_dhhc(), dh_group: Some("ffdhe1024".into()), ..DhchapKeys::default() };
    assert!(t.engine.add_host(NQN, HOST, Some(&group), None).unwrap_err().message.contains("ffdhe1024"));
}

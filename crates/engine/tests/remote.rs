//! The remote backend: one engine (the proxy) serving another's namespace (the
//! owner's), forwarding each command from its reactors.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nvpool_engine::config::RemoteQueues;
use nvpool_engine::config::{EngineConfig, ListenerConfig, NamespaceConfig, SubsystemConfig};
use nvpool_engine::error::ErrorKind;
use nvpool_initiator::{ConnectOptions, Error, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, io_opcode};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:remote";
const HOST: &str = "nqn.2024-01.io.nvpool:remote-host";
const IN_CAPSULE: usize = 8192;

fn one_namespace(backend: &str, block_size: u32) -> NamespaceConfig {
    NamespaceConfig { nsid: Some(1), ..namespace(backend, block_size) }
}

fn engine(address: &str, namespaces: Vec<NamespaceConfig>, reactors: usize) -> TestEngine {
    engine_with(address, namespaces, reactors, RemoteQueues::PerNamespace)
}

fn engine_with(address: &str, namespaces: Vec<NamespaceConfig>, reactors: usize, queues: RemoteQueues) -> TestEngine {
    let cfg = EngineConfig {
        remote_queues: queues,
        reactors: Some(reactors),
        listeners: vec![ListenerConfig {
            address: address.parse().unwrap(),
            tls: Default::default(),
            transport: Default::default(),
        }],
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: true,
            hosts: vec![],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces,
        }],
        ..EngineConfig::default()
    };
    TestEngine::start(&cfg)
}

fn io_queue(addr: SocketAddr) -> (Queue, Queue) {
    let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, HOST) };
    let mut admin = connect_admin(addr, &o).unwrap();
    admin.set_queue_count(1).unwrap();
    let io = Queue::connect(addr, &o.io(1, admin.cntlid, 63)).unwrap();
    (admin, io)
}

fn status_of(e: Error) -> Status {
    match e {
        Error::Command(s) => s,
        other => panic!("expected a command status, got {other}"),
    }
}

#[test]
fn a_proxy_serves_the_owners_namespace_with_its_identity_and_data() {
    let owner = engine("127.0.0.1:0", vec![one_namespace("memory:16MiB", 512)], 1);
    let spec = format!("remote:{}/{NQN}/1", owner.addr);
    let proxy = engine("127.0.0.1:0", vec![one_namespace(&spec, 0)], 2);
    let (mut owner_admin, mut owner_io) = io_queue(owner.addr);
    let (mut proxy_admin, mut proxy_io) = io_queue(proxy.addr);
    let (a, b) = (owner_admin.identify_namespace(1).unwrap(), proxy_admin.identify_namespace(1).unwrap());
    assert_eq!((a.nguid, a.nsze, a.lbaf0), (b.nguid, b.nsze, b.lbaf0), "one namespace, whichever path");

    // Small writes go in the capsule, large ones by R2T; reads come back in pieces.
    for (lba, len, seed) in [(0u64, 4096usize, 1u64), (64, 128 * 1024, 2), (4000, 512, 3)] {
        let data = pattern(seed, len);
        proxy_io.write(1, lba, &data, 512, IN_CAPSULE).unwrap();
        let blocks = (len / 512) as u32;
        assert_eq!(owner_io.read(1, lba, blocks, 512).unwrap(), data, "written through the proxy");
        assert_eq!(proxy_io.read(1, lba, blocks, 512).unwrap(), data, "read through the proxy");
    }
    let direct = pattern(9, 8192);
    owner_io.write(1, 100, &direct, 512, IN_CAPSULE).unwrap();
    assert_eq!(proxy_io.read(1, 100, 16, 512).unwrap(), direct, "the owner's writes seen through the proxy");
    proxy_io.flush(1).unwrap();
    assert_eq!(proxy_io.deallocate(1, 0, 8).unwrap(), Status::SUCCESS);
    assert_eq!(owner_io.read(1, 0, 8, 512).unwrap(), vec![0; 4096], "deallocated through the proxy");
    // The owner's errors come back as they are.
    assert_eq!(status_of(proxy_io.read(1, 1 << 40, 1, 512).unwrap_err()).base(), Status::LBA_OUT_OF_RANGE);

    // Once the namespace is gone from the proxy, so are its connections to the owner:
    // only this test's own two remain.
    proxy.engine.remove_namespace(NQN, 1).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while owner.engine.target().connection_count() > 2 {
        assert!(Instant::now() < deadline, "the proxy kept its connections to the owner");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until the owner counts this many connections (its own admin ones take a
/// moment to go after a namespace is opened).
fn wait_connections(owner: &TestEngine, want: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while owner.engine.target().connection_count() != want {
        assert!(
            Instant::now() < deadline,
            "{what}: the owner has {} connections, not {want}",
            owner.engine.target().connection_count()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn namespaces_of_one_owner_share_its_queues_when_asked() {
    for (queues, queues_per_reactor) in [(RemoteQueues::PerOwner, 1), (RemoteQueues::PerNamespace, 3)] {
        let namespaces = (1..=3).map(|n| NamespaceConfig { nsid: Some(n), ..namespace("memory:8MiB", 512) }).collect();
        let owner = engine("127.0.0.1:0", namespaces, 1);
        let remote = (1..=3)
            .map(|n| NamespaceConfig { nsid: Some(n), ..namespace(&format!("remote:{}/{NQN}/{n}", owner.addr), 0) });
        let proxy = engine_with("127.0.0.1:0", remote.collect(), 1, queues);
        let (_admin, mut io) = io_queue(proxy.addr);
        // Each namespace gets its own data through the one queue or the three.
        for n in 1..=3u32 {
            io.write(n, 8, &pattern(u64::from(n), 4096), 512, IN_CAPSULE).unwrap();
        }
        for n in 1..=3u32 {
            assert_eq!(io.read(n, 8, 8, 512).unwrap(), pattern(u64::from(n), 4096), "{queues:?}: namespace {n}");
        }
        // The owner sees an admin queue and an I/O queue per link, plus none of ours.
        wait_connections(&owner, 2 * queues_per_reactor, &format!("{queues:?}"));
        // A shared link stays while any namespace uses it, and goes with the last.
        proxy.engine.remove_namespace(NQN, 1).unwrap();
        assert_eq!(io.read(2, 8, 8, 512).unwrap(), pattern(2, 4096));
        proxy.engine.remove_namespace(NQN, 2).unwrap();
        proxy.engine.remove_namespace(NQN, 3).unwrap();
        wait_connections(&owner, 0, &format!("{queues:?}, every namespace removed"));
    }
}

#[test]
fn a_lost_owner_is_a_path_error_and_a_returning_owner_is_used_again() {
    let owner = engine("127.0.0.1:0", vec![one_namespace("memory:16MiB", 512)], 1);
    let owner_addr = owner.addr;
    let spec = format!("remote:{owner_addr}/{NQN}/1");
    let proxy = engine("127.0.0.1:0", vec![one_namespace(&spec, 0)], 1);
    let (_admin, mut io) = io_queue(proxy.addr);
    io.write(1, 0, &pattern(1, 4096), 512, IN_CAPSULE).unwrap();
    drop(owner);
    // Without its owner the proxy answers with a path error the host retries
    // elsewhere: never Do Not Retry.
    let started = Instant::now();
    let s = status_of(io.read(1, 0, 8, 512).unwrap_err());
    assert_eq!(s, Status::ANA_INACCESSIBLE);
    assert!(!s.dnr());
    assert!(started.elapsed() < Duration::from_secs(10), "a command waits a bounded time");
    // The owner comes back on its address: the proxy reconnects by itself.
    let _owner = engine(&owner_addr.to_string(), vec![one_namespace("memory:16MiB", 512)], 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match io.write(1, 0, &pattern(2, 4096), 512, IN_CAPSULE) {
            Ok(()) => break,
            Err(e) => {
                assert_eq!(status_of(e), Status::ANA_INACCESSIBLE);
                assert!(Instant::now() < deadline, "the proxy never reached the owner again");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    assert_eq!(io.read(1, 0, 8, 512).unwrap(), pattern(2, 4096));
}

/// A write the proxy could not send yet (its owner refuses it for a while) is dropped
/// when its host's connection closes: the host takes its outcome as unknown, writes it
/// again through another path and may write the block anew after that, so the proxy
/// sending it once the owner takes it again would land an old write over a newer one.
#[test]
fn a_write_not_yet_forwarded_is_dropped_when_its_host_goes() {
    let owner = engine("127.0.0.1:0", vec![one_namespace("memory:16MiB", 512)], 1);
    let spec = format!("remote:{}/{NQN}/1", owner.addr);
    let proxy = engine("127.0.0.1:0", vec![one_namespace(&spec, 0)], 1);
    let proxy_host = proxy.engine.host_nqn().to_string();
    owner.engine.add_host(NQN, HOST, None, None).unwrap();
    owner.engine.add_host(NQN, &proxy_host, None, None).unwrap();
    owner.engine.set_allow_any_host(NQN, false).unwrap();
    // The owner drops the proxy: its queues end, and it cannot connect new ones.
    owner.engine.remove_host(NQN, &proxy_host).unwrap();
    {
        let (_admin, mut io) = io_queue(proxy.addr);
        let cid = io.alloc_cid();
        let write = Command::read_write(io_opcode::WRITE, cid, 1, 8, 8, 4096);
        io.submit(write, &pattern(1, 4096), true).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        // The host goes with its write unanswered.
    }
    std::thread::sleep(Duration::from_millis(200));
    owner.engine.add_host(NQN, &proxy_host, None, None).unwrap();
    // The proxy's link connects again within its backoff (2 s at most).
    std::thread::sleep(Duration::from_millis(3000));
    let (_admin, mut direct) = io_queue(owner.addr);
    let block = direct.read(1, 8, 8, 512).unwrap();
    assert!(block.iter().all(|&b| b == 0), "a write its host gave up landed later");
    // The proxy still forwards the writes of a host that stays.
    let (_admin, mut io) = io_queue(proxy.addr);
    io.write(1, 16, &pattern(2, 4096), 512, IN_CAPSULE).unwrap();
    assert_eq!(direct.read(1, 16, 8, 512).unwrap(), pattern(2, 4096));
}

#[test]
fn bad_remote_namespaces_say_what_was_wrong() {
    let owner = engine("127.0.0.1:0", vec![one_namespace("memory:16MiB", 512)], 1);
    let proxy = engine("127.0.0.1:0", vec![], 1);
    let add = |spec: String, block_size: u32| {
        let mut n = one_namespace(&spec, block_size);
        n.nsid = Some(7);
        proxy.engine.add_namespace(NQN, &n).unwrap_err()
    };
    let e = add(format!("remote:{}/{NQN}/1", proxy.addr), 0);
    assert!(e.message.contains("itself"), "{e}");
    let e = add(format!("remote:{}/{NQN}/1", owner.addr), 4096);
    assert!(e.message.contains("512-byte blocks"), "{e}");
    let e = add(format!("remote:{}/{NQN}/9", owner.addr), 0);
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    let e = add(format!("remote:127.0.0.1:1/{NQN}/1"), 0);
    assert!(e.message.contains("cannot reach"), "{e}");
    let e = add("remote:127.0.0.1:1/nqn".into(), 0);
    assert!(e.message.contains("NSID"), "{e}");
}

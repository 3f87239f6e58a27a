//! Asymmetric Namespace Access over real sockets: what Identify says, the ANA log at
//! its largest, per-host states, change events and the statuses I/O gets on paths the
//! host must not use.

use std::net::SocketAddr;

use nvpool_api::AnaState;
use nvpool_engine::config::{EngineConfig, Limits, NamespaceConfig, SubsystemConfig};
use nvpool_engine::error::ErrorKind;
use nvpool_engine::nvme::ana::{MAX_ANA_GROUP, MAX_LOG_PAGE};
use nvpool_initiator::{ConnectOptions, Error, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, admin_opcode};
use nvpool_wire::identify;
use nvpool_wire::log::{GetLogPage, async_event, decode_ana_log, lid};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:ana";
const HOST_A: &str = "nqn.2024-01.io.nvpool:host-a";
const HOST_B: &str = "nqn.2024-01.io.nvpool:host-b";
const NAMESPACES: u32 = 1000;

/// 1,000 namespaces: NSID n is in group n % 7 + 1, but the last ten have a group each.
fn group_of(nsid: u32) -> u32 {
    if nsid > NAMESPACES - 10 { nsid } else { nsid % 7 + 1 }
}

fn start(limits: Limits) -> TestEngine {
    let namespaces = (1..=NAMESPACES)
        .map(|nsid| NamespaceConfig {
            nsid: Some(nsid),
            ana_group: Some(group_of(nsid)),
            qos: Default::default(),
            ..namespace(if nsid == 1 { "memory:4MiB" } else { "null:1MiB" }, 512)
        })
        .collect();
    let cfg = EngineConfig {
        reactors: Some(1),
        limits,
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

fn admin(addr: SocketAddr, host: &str) -> Queue {
    connect_admin(addr, &ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, host) }).unwrap()
}

fn io_queue(addr: SocketAddr, admin: &mut Queue, host: &str) -> Queue {
    admin.set_queue_count(1).unwrap();
    let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, host) };
    Queue::connect(addr, &o.io(1, admin.cntlid, 31)).unwrap()
}

/// Reads the whole ANA log in one command, as the Linux host does.
fn ana_log(a: &mut Queue, groups_only: bool) -> (u64, Vec<nvpool_wire::log::AnaGroup>) {
    let mut glp = Command { opcode: admin_opcode::GET_LOG_PAGE, nsid: 0xFFFF_FFFF, ..Command::default() };
    let len = MAX_LOG_PAGE;
    GetLogPage { lid: lid::ANA, lsp: u8::from(groups_only), rae: false, len, offset: 0 }.apply(&mut glp);
    let page = a.execute(glp, len as u32).unwrap().data;
    decode_ana_log(&page).expect("a well-formed ANA log")
}

fn status_of(e: Error) -> Status {
    match e {
        Error::Command(s) => s,
        other => panic!("expected a command status, got {other}"),
    }
}

#[test]
fn identify_and_the_log_describe_every_group_at_the_largest_size() {
    let t = start(Limits::default());
    let mut a = admin(t.addr, HOST_A);
    let id = a.identify_controller().unwrap();
    let wanted = identify::CMIC_MULTI_PORT | identify::CMIC_MULTI_CONTROLLER | identify::CMIC_ANA;
    assert_eq!(id.cmic & wanted, wanted);
    assert_ne!(id.oaes & identify::OAES_ANA_CHANGE, 0);
    assert_eq!(id.anacap & identify::ANACAP_ALL_STATES, identify::ANACAP_ALL_STATES);
    assert!(id.anatt > 0);
    assert_eq!((id.anagrpmax, id.nanagrpid), (MAX_ANA_GROUP, MAX_ANA_GROUP));
    assert!(id.mnan >= 1 && id.mnan <= id.nn);
    // The host's log buffer, from the maxima, must fit MDTS or it turns ANA off.
    assert!(MAX_LOG_PAGE <= 4096 << id.mdts);
    assert_eq!(a.identify_namespace(5).unwrap().anagrpid, group_of(5));
    assert_ne!(a.identify_namespace(5).unwrap().nmic & identify::NMIC_SHARED, 0);

    let (_, groups) = ana_log(&mut a, false);
    assert_eq!(groups.len(), 7 + 10);
    assert!(groups.windows(2).all(|w| w[0].grpid < w[1].grpid), "groups ascending");
    let mut all: Vec<u32> = Vec::new();
    for g in &groups {
        assert!(g.nsids.windows(2).all(|w| w[0] < w[1]), "NSIDs ascending in group {}", g.grpid);
        assert!(g.nsids.iter().all(|&n| group_of(n) == g.grpid));
        assert_eq!(g.state, 1, "optimized until told otherwise");
        all.extend(&g.nsids);
    }
    all.sort_unstable();
    assert_eq!(all, (1..=NAMESPACES).collect::<Vec<_>>());
    let (_, only) = ana_log(&mut a, true);
    assert_eq!(only.len(), groups.len());
    assert!(only.iter().all(|g| g.nsids.is_empty()), "RGO: groups only");
}

#[test]
fn a_state_per_host_with_events_and_path_statuses() {
    let t = start(Limits::default());
    let mut a = admin(t.addr, HOST_A);
    let mut b = admin(t.addr, HOST_B);
    let mut io_a = io_queue(t.addr, &mut a, HOST_A);
    let mut io_b = io_queue(t.addr, &mut b, HOST_B);
    let group = group_of(1);
    // ANA change notices on, and an event request parked on each admin queue.
    let aer = |q: &mut Queue| {
        q.execute(
            Command { opcode: admin_opcode::SET_FEATURES, cdw: [0x0B, 1 << 11, 0, 0, 0, 0], ..Command::default() },
            0,
        )
        .unwrap();
        let cid = q.alloc_cid();
        q.submit(Command { opcode: admin_opcode::ASYNC_EVENT_REQUEST, cid, ..Command::default() }, &[], false).unwrap();
        cid
    };
    let aer_a = aer(&mut a);
    let aer_b = aer(&mut b);

    t.engine.set_ana_state(NQN, group, Some(HOST_A), AnaState::Inaccessible).unwrap();
    let r = a.next_reply().unwrap();
    assert_eq!(r.cqe.cid, aer_a);
    assert_eq!(r.cqe.result, async_event::result(async_event::TYPE_NOTICE, async_event::NOTICE_ANA_CHANGE, lid::ANA));
    // Host A's path is inaccessible: I/O is refused with a path status the host
    // retries elsewhere (no DNR). Host B's is untouched and serves its I/O.
    let s = status_of(io_a.read(1, 0, 1, 512).unwrap_err());
    assert_eq!(s, Status::ANA_INACCESSIBLE);
    assert!(!s.dnr(), "never Do Not Retry on a path error");
    io_b.write(1, 0, &pattern(3, 512), 512, 8192).unwrap();
    assert_eq!(io_b.read(1, 0, 1, 512).unwrap(), pattern(3, 512));
    // Namespaces of other groups are still served on host A's path.
    assert_eq!(io_a.read(2, 0, 1, 512).unwrap().len(), 512);
    let state_in = |q: &mut Queue| ana_log(q, false).1.into_iter().find(|g| g.grpid == group).unwrap().state;
    assert_eq!(state_in(&mut a), 3, "host A: inaccessible");
    assert_eq!(state_in(&mut b), 1, "host B: optimized");

    // A state for every host reaches B (its request was kept until its view
    // changed); A keeps its own.
    t.engine.set_ana_state(NQN, group, None, AnaState::Change).unwrap();
    assert_eq!(b.next_reply().unwrap().cqe.cid, aer_b);
    assert_eq!(status_of(io_b.read(1, 0, 1, 512).unwrap_err()), Status::ANA_TRANSITION);
    assert_eq!(state_in(&mut a), 3);
    t.engine.set_ana_state(NQN, group, Some(HOST_A), AnaState::NonOptimized).unwrap();
    t.engine.set_ana_state(NQN, group, None, AnaState::PersistentLoss).unwrap();
    assert_eq!(io_a.read(1, 0, 1, 512).unwrap(), pattern(3, 512), "non-optimized paths serve I/O");
    assert_eq!(status_of(io_b.read(1, 0, 1, 512).unwrap_err()), Status::ANA_PERSISTENT_LOSS);

    let listed = t.engine.ana_groups(NQN).unwrap();
    let g = listed.iter().find(|g| g.group == group).unwrap();
    assert_eq!(g.state, AnaState::PersistentLoss);
    assert_eq!(g.hosts.len(), 1);
    assert_eq!((g.hosts[0].host.as_str(), g.hosts[0].state), (HOST_A, AnaState::NonOptimized));
}

#[test]
fn bad_ana_requests_say_what_was_wrong() {
    let t = start(Limits::default());
    let e = t.engine.set_ana_state(NQN, 500, None, AnaState::Inaccessible).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert!(e.message.contains("ANA group 500") && e.message.contains("ana_group"), "{e}");
    let e = t.engine.set_ana_state(NQN, 0, None, AnaState::Inaccessible).unwrap_err();
    assert!(e.message.contains("out of range"), "{e}");
    let e = t.engine.set_ana_state("nqn.2024-01.io.nvpool:nope", 1, None, AnaState::Optimized).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    let e = t.engine.set_ana_state(NQN, 1, Some("not an nqn"), AnaState::Optimized).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    assert!("sideways".parse::<AnaState>().unwrap_err().contains("non-optimized"));
}

#[test]
fn controller_ids_come_from_the_engines_range() {
    let t = start(Limits { cntlid_min: 2041, cntlid_max: 2042, ..Limits::default() });
    let a = admin(t.addr, HOST_A);
    let b = admin(t.addr, HOST_B);
    let mut ids = [a.cntlid, b.cntlid];
    ids.sort_unstable();
    assert_eq!(ids, [2041, 2042]);
    drop(a);
    // A freed ID is handed out again once the range is used up.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let c = loop {
        if let Ok(q) = connect_admin(t.addr, &ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, HOST_A) }) {
            break q;
        }
        assert!(std::time::Instant::now() < deadline, "the freed controller ID never came back");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!((2041..=2042).contains(&c.cntlid));
    let bad = EngineConfig {
        limits: Limits { cntlid_min: 10, cntlid_max: 5, ..Limits::default() },
        ..EngineConfig::default()
    };
    assert!(bad.validate().unwrap_err().contains("cntlid_min"));
}

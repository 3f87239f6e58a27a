//! The engine driven over real sockets by the in-repo initiator.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpool_engine::config::{EngineConfig, NamespaceConfig, SubsystemConfig};
use nvpool_initiator::{ConnectOptions, Error, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, admin_opcode, io_opcode};
use nvpool_wire::fabrics::DISCOVERY_NQN;
use nvpool_wire::log::{DiscoveryLogHeader, GetLogPage, lid};
use nvpool_wire::tcp::{self, Digests, fes};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:test";
const HOST: &str = "nqn.2024-01.io.nvpool:host-a";
/// In-capsule data the engine accepts on I/O queues.
const IN_CAPSULE: usize = 8192;

fn start_with(namespaces: Vec<NamespaceConfig>, allow_any_host: bool, reactors: usize) -> TestEngine {
    let cfg = EngineConfig {
        reactors: Some(reactors),
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host,
            hosts: vec![HOST.into()],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces,
        }],
        ..EngineConfig::default()
    };
    TestEngine::start(&cfg)
}

fn start(backend: &str) -> TestEngine {
    start_with(vec![namespace(backend, 512)], false, 2)
}

fn admin_opts() -> ConnectOptions {
    ConnectOptions::admin(NQN, HOST)
}

/// An admin queue plus `n` I/O queues.
fn controller(addr: SocketAddr, o: &ConnectOptions, n: u16) -> (Queue, Vec<Queue>) {
    let mut admin = connect_admin(addr, o).expect("admin connect");
    assert_eq!(admin.set_queue_count(n).unwrap(), n);
    let io = (1..=n).map(|qid| Queue::connect(addr, &o.io(qid, admin.cntlid, 127)).expect("I/O connect")).collect();
    (admin, io)
}

fn status_of(e: Error) -> Status {
    match e {
        Error::Command(s) => s.base(),
        other => panic!("expected a command status, got {other}"),
    }
}

#[test]
fn identify_matches_connect() {
    let t = start("memory:64MiB");
    let mut a = connect_admin(t.addr, &admin_opts()).unwrap();
    let id = a.identify_controller().unwrap();
    assert_eq!(id.cntlid, a.cntlid);
    assert_ne!(id.kas, 0, "fabrics controllers must support keep alive");
    assert!(id.ioccsz >= 4 && id.iorcsz >= 1);
    assert_eq!(nvpool_wire::bytes::get_nul_padded(&id.subnqn, 0, 256), NQN);
    let ns = a.identify_namespace(1).unwrap();
    assert_eq!(ns.nsze, (64 << 20) / 512);
}

fn read_write_round_trip(digests: Digests, block_size: u32) {
    let t = start_with(vec![namespace("memory:64MiB", block_size)], false, 2);
    let o = ConnectOptions { digests, ..admin_opts() };
    let (_admin, mut io) = controller(t.addr, &o, 1);
    let q = &mut io[0];
    // In-capsule sizes, the R2T path, and the largest transfer.
    for (i, len) in [block_size as usize, 4096, IN_CAPSULE, 12288, 65536, 131072].into_iter().enumerate() {
        let data = pattern(i as u64, len);
        let slba = (i as u64) * 1024;
        q.write(1, slba, &data, block_size, IN_CAPSULE).unwrap();
        let back = q.read(1, slba, (len / block_size as usize) as u32, block_size).unwrap();
        assert!(back == data, "data mismatch at length {len}");
    }
}

#[test]
fn read_write_without_digests() {
    read_write_round_trip(Digests::default(), 512);
}

#[test]
fn read_write_with_digests() {
    read_write_round_trip(Digests { header: true, data: true }, 4096);
}

#[test]
fn success_flag_is_used_only_without_sq_flow_control() {
    let t = start("memory:16MiB");
    for disable in [false, true] {
        let o = ConnectOptions { disable_sq_flow_control: disable, ..admin_opts() };
        let (_admin, mut io) = controller(t.addr, &o, 1);
        let q = &mut io[0];
        q.write(1, 0, &pattern(1, 4096), 512, IN_CAPSULE).unwrap();
        let cid = q.alloc_cid();
        q.submit(Command::read_write(io_opcode::READ, cid, 1, 0, 8, 4096), &[], false).unwrap();
        let mut saw_resp = false;
        loop {
            match q.recv_pdu().unwrap() {
                nvpool_initiator::TargetPdu::Data { success, .. } => {
                    assert_eq!(success, disable);
                    if success {
                        break;
                    }
                }
                nvpool_initiator::TargetPdu::Resp(c) => {
                    assert!(c.status.is_success());
                    saw_resp = true;
                    break;
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(saw_resp, !disable);
    }
}

#[test]
fn many_queues_in_parallel_with_deep_queues() {
    let t = start_with(vec![namespace("memory:128MiB", 512)], false, 2);
    let (_admin, io) = controller(t.addr, &admin_opts(), 4);
    let workers: Vec<_> = io
        .into_iter()
        .enumerate()
        .map(|(qi, mut q)| {
            std::thread::spawn(move || {
                // 32 writes in flight at once, mixing in-capsule and R2T, then 32 reads.
                let base = qi as u64 * 20_000;
                let sizes = [4096usize, 16384, 512, 65536];
                let mut expected = Vec::new();
                for i in 0..32u64 {
                    let len = sizes[i as usize % sizes.len()];
                    let data = pattern(base + i, len);
                    let slba = base + i * 128;
                    let cid = q.alloc_cid();
                    let c = Command::read_write(io_opcode::WRITE, cid, 1, slba, (len / 512) as u32, len as u32);
                    q.submit(c, &data, len <= IN_CAPSULE).unwrap();
                    expected.push((slba, data));
                }
                for _ in 0..32 {
                    let r = q.next_reply().unwrap();
                    assert!(r.cqe.status.is_success(), "write failed: {:?}", r.cqe);
                }
                let mut by_cid = std::collections::HashMap::new();
                for (slba, data) in &expected {
                    let cid = q.alloc_cid();
                    let c = Command::read_write(
                        io_opcode::READ,
                        cid,
                        1,
                        *slba,
                        (data.len() / 512) as u32,
                        data.len() as u32,
                    );
                    q.submit(c, &[], false).unwrap();
                    by_cid.insert(cid, data.clone());
                }
                for _ in 0..32 {
                    let r = q.next_reply().unwrap();
                    assert!(r.cqe.status.is_success());
                    assert!(r.data == by_cid[&r.cqe.cid], "queue {qi}: data mismatch");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker");
    }
}

#[test]
fn errors_get_the_right_status() {
    let t = start("memory:1MiB");
    let (mut admin, mut io) = controller(t.addr, &admin_opts(), 1);
    let q = &mut io[0];
    let blocks = (1 << 20) / 512;
    assert_eq!(status_of(q.read(2, 0, 1, 512).unwrap_err()), Status::INVALID_NAMESPACE);
    assert_eq!(status_of(q.read(1, blocks - 1, 2, 512).unwrap_err()), Status::LBA_OUT_OF_RANGE);
    assert_eq!(status_of(q.read(1, 0, 512, 512).unwrap_err()), Status::INVALID_FIELD, "256 KiB exceeds MDTS");
    let cid = q.alloc_cid();
    let r = q.execute_raw(Command { opcode: 0x7C, cid, nsid: 1, ..Command::default() }, &[], false).unwrap();
    assert_eq!(r.cqe.status.base(), Status::INVALID_OPCODE);
    assert!(r.cqe.status.dnr());
    let r = admin.execute(Command { opcode: 0x55, ..Command::default() }, 0).unwrap_err();
    assert_eq!(status_of(r), Status::INVALID_OPCODE);
    // The queue still works after errors.
    q.write(1, 0, &pattern(9, 512), 512, IN_CAPSULE).unwrap();
}

#[test]
fn hosts_not_on_the_allow_list_are_refused() {
    let t = start("null:1GiB");
    let o = ConnectOptions::admin(NQN, "nqn.2024-01.io.nvpool:intruder");
    match Queue::connect(t.addr, &o) {
        Err(Error::Command(s)) => {
            assert_eq!(s.base(), Status::CONNECT_INVALID_HOST);
            // The allow-list may still change: the host is invited to retry.
            assert!(!s.dnr());
        }
        other => panic!("intruder was not refused: {:?}", other.map(|q| q.cntlid)),
    }
    let unknown = ConnectOptions::admin("nqn.2024-01.io.nvpool:nope", HOST);
    assert_eq!(status_of(Queue::connect(t.addr, &unknown).err().unwrap()), Status::CONNECT_INVALID_PARAMETERS);
    // The allowed host still gets in, and an I/O queue for a controller it does not own
    // is refused.
    let (admin, _io) = controller(t.addr, &admin_opts(), 1);
    let stranger = ConnectOptions::admin(NQN, "nqn.2024-01.io.nvpool:other").io(1, admin.cntlid, 31);
    assert!(Queue::connect(t.addr, &stranger).is_err());
    let dup = admin_opts().io(1, admin.cntlid, 31);
    assert_eq!(
        status_of(Queue::connect(t.addr, &dup).err().unwrap()),
        Status::COMMAND_SEQUENCE_ERROR,
        "queue 1 is taken"
    );
    // The same host NQN with another Host Identifier is not the association's host.
    let mut other_id = admin_opts().io(2, admin.cntlid, 31);
    other_id.hostid = [8; 16];
    assert_eq!(status_of(Queue::connect(t.addr, &other_id).err().unwrap()), Status::CONNECT_INVALID_PARAMETERS);
}

/// Sends raw bytes after a handshake and returns what the target answered.
fn send_malformed(addr: SocketAddr, digests: Digests, bytes: &[u8]) -> Result<nvpool_initiator::TargetPdu, Error> {
    let mut q = Queue::handshake(addr, digests).unwrap();
    q.stream().write_all(bytes).unwrap();
    q.recv_pdu()
}

fn expect_term(r: Result<nvpool_initiator::TargetPdu, Error>, want_fes: u16) {
    match r {
        Ok(nvpool_initiator::TargetPdu::Term { fes, .. }) => assert_eq!(fes, want_fes),
        other => panic!("expected a C2HTermReq with FES {want_fes}, got {other:?}"),
    }
}

/// Writes 16 KiB through an R2T, but answers the R2T with `bad` applied to the
/// H2CData header; returns what the target says.
fn h2c_data_answer(addr: SocketAddr, bad: impl Fn(&mut tcp::DataHeader)) -> nvpool_initiator::TargetPdu {
    let (_admin, mut io) = controller(addr, &admin_opts(), 1);
    let mut q = io.remove(0);
    let cmd = Command::read_write(io_opcode::WRITE, 7, 1, 0, 32, 16384);
    q.submit(cmd, &pattern(4, 16384), false).unwrap();
    let nvpool_initiator::TargetPdu::R2T(mut h) = q.recv_pdu().unwrap() else { panic!("no R2T") };
    bad(&mut h);
    let mut wire = [0u8; 32];
    let n = tcp::encode_h2c_data(&h, true, Digests::default(), &mut wire);
    let mut bytes = wire[..n].to_vec();
    bytes.extend_from_slice(&vec![0u8; h.length as usize]);
    q.stream().write_all(&bytes).unwrap();
    match q.recv_pdu() {
        Ok(p) => p,
        Err(e) => panic!("after {h:?}: {e}"),
    }
}

#[test]
fn a_wrong_h2c_data_field_is_named_by_its_offset() {
    let t = start("memory:16MiB");
    let term = |p| match p {
        nvpool_initiator::TargetPdu::Term { fes, fei } => (fes, fei),
        other => panic!("expected a C2HTermReq, got {other:?}"),
    };
    assert_eq!(term(h2c_data_answer(t.addr, |h| h.ttag += 1)), (fes::INVALID_HEADER_FIELD, 10), "unknown TTAG");
    assert_eq!(term(h2c_data_answer(t.addr, |h| h.cccid += 1)), (fes::INVALID_HEADER_FIELD, 8), "wrong CCCID");
    assert_eq!(term(h2c_data_answer(t.addr, |h| h.offset = 4096)), (fes::DATA_OUT_OF_RANGE, 0), "wrong offset");
    assert_eq!(term(h2c_data_answer(t.addr, |h| h.length += 512)), (fes::DATA_OUT_OF_RANGE, 0), "past the R2T");
    // The healthy exchange still works.
    let (_admin, mut io) = controller(t.addr, &admin_opts(), 1);
    io[0].write(1, 0, &pattern(5, 16384), 512, 0).unwrap();
    assert_eq!(io[0].read(1, 0, 32, 512).unwrap(), pattern(5, 16384));
}

#[test]
fn malformed_pdus_end_only_their_connection() {
    let t = start("memory:16MiB");
    let (_admin, mut io) = controller(t.addr, &admin_opts(), 1);
    io[0].write(1, 0, &pattern(3, 4096), 512, IN_CAPSULE).unwrap();

    // Unknown PDU type.
    expect_term(send_malformed(t.addr, Digests::default(), &[0x42, 0, 8, 0, 8, 0, 0, 0]), fes::INVALID_HEADER_FIELD);
    // Wrong header length for a capsule.
    expect_term(send_malformed(t.addr, Digests::default(), &[4, 0, 9, 0, 9, 0, 0, 0, 0]), fes::INVALID_HEADER_FIELD);
    // A PDU type only a controller sends.
    let mut resp = [0u8; 24];
    tcp::encode_capsule_resp(&Default::default(), Digests::default(), &mut resp);
    expect_term(send_malformed(t.addr, Digests::default(), &resp), fes::INVALID_HEADER_FIELD);
    // Header digest error.
    let d = Digests { header: true, data: false };
    let mut cap = [0u8; tcp::MAX_HEADER_SIZE];
    let n = tcp::encode_capsule_cmd(&Command::default(), 0, d, &mut cap);
    cap[n - 1] ^= 0xFF;
    expect_term(send_malformed(t.addr, d, &cap[..n]), fes::HEADER_DIGEST_ERROR);
    // In-capsule data larger than the capsule allows.
    let n = tcp::encode_capsule_cmd(&Command::default(), 64 * 1024, Digests::default(), &mut cap);
    expect_term(send_malformed(t.addr, Digests::default(), &cap[..n]), fes::DATA_LIMIT_EXCEEDED);
    // H2CData with no R2T outstanding.
    let mut h2c = [0u8; 32];
    let hd = tcp::DataHeader { cccid: 1, ttag: 0, offset: 0, length: 4 };
    let hl = tcp::encode_h2c_data(&hd, true, Digests::default(), &mut h2c);
    let mut bytes = h2c[..hl].to_vec();
    bytes.extend_from_slice(&[1, 2, 3, 4]);
    expect_term(send_malformed(t.addr, Digests::default(), &bytes), fes::INVALID_HEADER_FIELD);
    // A capsule before ICReq.
    let mut raw = std::net::TcpStream::connect(t.addr).unwrap();
    let n = tcp::encode_capsule_cmd(&Command::default(), 0, Digests::default(), &mut cap);
    raw.write_all(&cap[..n]).unwrap();
    let mut b = [0u8; 24];
    raw.read_exact(&mut b).unwrap();
    assert_eq!(b[0], tcp::pdu_type::C2H_TERM_REQ);
    // Truncated PDUs and garbage from hosts that then vanish.
    for junk in [&[4u8, 0, 72][..], &[0u8; 7][..], &pattern(5, 100_000)[..]] {
        let mut s = std::net::TcpStream::connect(t.addr).unwrap();
        let _ = s.write_all(junk);
    }
    // The healthy connection is untouched.
    let back = io[0].read(1, 0, 8, 512).unwrap();
    assert_eq!(back, pattern(3, 4096));
    // Every hostile connection was closed and released: only the admin and I/O queue
    // remain.
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.engine.target().connection_count() != 2 {
        assert!(Instant::now() < deadline, "{} connections still open", t.engine.target().connection_count());
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn many_short_lived_hosts_leave_nothing_behind() {
    let t = start("memory:16MiB");
    for round in 0..50 {
        let (_admin, mut io) = controller(t.addr, &admin_opts(), 2);
        io[round % 2].write(1, round as u64 * 8, &pattern(round as u64, 4096), 512, IN_CAPSULE).unwrap();
        if round % 3 == 0 {
            // Leave with a command in flight.
            let cid = io[0].alloc_cid();
            io[0].submit(Command::read_write(io_opcode::READ, cid, 1, 0, 256, 131072), &[], false).unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.engine.target().connection_count() > 0 || t.engine.target().controller_count() > 0 {
        assert!(Instant::now() < deadline, "connections or controllers left behind");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn keep_alive_expiry_tears_down_a_vanished_host() {
    let t = start("memory:16MiB");
    let o = ConnectOptions { kato: 600, ..admin_opts() };
    let (mut admin, mut io) = controller(t.addr, &o, 1);
    // Keep Alive keeps the controller for longer than KATO.
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(300));
        admin.execute(Command { opcode: admin_opcode::KEEP_ALIVE, ..Command::default() }, 0).unwrap();
    }
    io[0].write(1, 0, &pattern(1, 512), 512, IN_CAPSULE).unwrap();
    // Then the host goes silent without closing anything.
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.engine.target().controller_count() > 0 {
        assert!(Instant::now() < deadline, "controller outlived its keep-alive timeout");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its queues were closed by the target.
    assert!(io[0].read(1, 0, 1, 512).is_err());
    assert!(admin.identify_controller().is_err());
}

#[test]
fn closing_the_admin_queue_ends_the_controller() {
    let t = start("memory:16MiB");
    let (admin, mut io) = controller(t.addr, &admin_opts(), 1);
    assert_eq!(t.engine.target().controller_count(), 1);
    drop(admin);
    let deadline = Instant::now() + Duration::from_secs(5);
    while t.engine.target().controller_count() > 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(io[0].read(1, 0, 1, 512).is_err());
}

#[test]
fn namespace_added_at_runtime_raises_an_event() {
    let t = start("memory:16MiB");
    let mut a = connect_admin(t.addr, &admin_opts()).unwrap();
    // Enable namespace attribute notices, then park an AER.
    a.execute(Command { opcode: admin_opcode::SET_FEATURES, cdw: [0x0B, 1 << 8, 0, 0, 0, 0], ..Command::default() }, 0)
        .unwrap();
    let cid = a.alloc_cid();
    a.submit(Command { opcode: admin_opcode::ASYNC_EVENT_REQUEST, cid, ..Command::default() }, &[], false).unwrap();
    let nsid = t.engine.add_namespace(NQN, &namespace("memory:8MiB", 4096)).unwrap();
    assert_eq!(nsid, 2);
    let r = a.next_reply().unwrap();
    assert_eq!(r.cqe.cid, cid);
    assert_eq!(r.cqe.result, 0x0004_0002, "notice: namespace attribute changed, log page 04h");
    let mut glp = Command { opcode: admin_opcode::GET_LOG_PAGE, nsid: 0xFFFF_FFFF, ..Command::default() };
    GetLogPage { lid: lid::CHANGED_NS, lsp: 0, rae: false, len: 4096, offset: 0 }.apply(&mut glp);
    let log = a.execute(glp, 4096).unwrap().data;
    assert_eq!(&log[0..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
    assert_eq!(a.identify_namespace(2).unwrap().nsze, (8 << 20) / 4096);
}

#[test]
fn removed_namespace_is_released_by_connected_queues() {
    let t = start("memory:16MiB");
    let (_admin, mut io) = controller(t.addr, &admin_opts(), 1);
    let subsystem = t.engine.target().subsystem(NQN).unwrap();
    let held = Arc::downgrade(&subsystem.namespaces()[&1]);
    // I/O makes the queue keep the namespace for its next commands.
    io[0].write(1, 0, &pattern(1, 4096), 512, IN_CAPSULE).unwrap();
    assert_eq!(io[0].read(1, 0, 8, 512).unwrap(), pattern(1, 4096));
    t.engine.remove_namespace(NQN, 1).unwrap();
    // The queue stays connected and idle, yet lets go of the namespace.
    let deadline = Instant::now() + Duration::from_secs(5);
    while held.strong_count() > 0 {
        assert!(Instant::now() < deadline, "an idle queue still holds the removed namespace");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status_of(io[0].read(1, 0, 1, 512).unwrap_err()), Status::INVALID_NAMESPACE);
}

#[test]
fn discovery_lists_subsystems_and_listeners() {
    let t = start("null:1GiB");
    let mut d =
        connect_admin(t.addr, &ConnectOptions { kato: 0, ..ConnectOptions::admin(DISCOVERY_NQN, HOST) }).unwrap();
    let id = d.identify_controller().unwrap();
    assert_eq!(id.cntrltype, 2);
    let mut glp = Command { opcode: admin_opcode::GET_LOG_PAGE, ..Command::default() };
    GetLogPage { lid: lid::DISCOVERY, lsp: 0, rae: false, len: 3072, offset: 0 }.apply(&mut glp);
    let page = d.execute(glp, 3072).unwrap().data;
    let h = DiscoveryLogHeader::decode(&page).unwrap();
    assert_eq!(h.numrec, 2, "the discovery subsystem and {NQN} on one listener");
    assert_eq!(nvpool_wire::bytes::get_nul_padded(&page, 2048 + 256, 256), NQN);
    // A host not on the allow-list does not see the subsystem.
    let mut other =
        connect_admin(t.addr, &ConnectOptions { kato: 0, ..ConnectOptions::admin(DISCOVERY_NQN, "nqn.x:other") })
            .unwrap();
    let mut glp = Command { opcode: admin_opcode::GET_LOG_PAGE, ..Command::default() };
    GetLogPage { lid: lid::DISCOVERY, lsp: 0, rae: false, len: 1024, offset: 0 }.apply(&mut glp);
    let page = other.execute(glp, 1024).unwrap().data;
    assert_eq!(DiscoveryLogHeader::decode(&page).unwrap().numrec, 1);
}

#[test]
fn file_backend_flush_zeroes_deallocate_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let backend = format!("file:{}:32MiB", path.display());
    let data = pattern(77, 65536);
    {
        let t = start(&backend);
        let (_admin, mut io) = controller(t.addr, &admin_opts(), 1);
        let q = &mut io[0];
        q.write(1, 100, &data, 512, IN_CAPSULE).unwrap();
        q.write(1, 1000, &pattern(1, 8192), 512, IN_CAPSULE).unwrap();
        q.write(1, 3000, &pattern(2, 8192), 512, IN_CAPSULE).unwrap();
        q.flush(1).unwrap();
        // Write Zeroes on 1000..1016.
        let wz =
            Command { opcode: io_opcode::WRITE_ZEROES, nsid: 1, cdw: [1000, 0, 15, 0, 0, 0], ..Command::default() };
        q.execute(wz, 0).unwrap();
        assert!(q.read(1, 1000, 16, 512).unwrap().iter().all(|&b| b == 0));
        // Dataset Management deallocate of 3000..3016.
        assert!(q.deallocate(1, 3000, 16).unwrap().is_success());
        assert!(q.read(1, 3000, 16, 512).unwrap().iter().all(|&b| b == 0));
        // FUA write.
        let cid = q.alloc_cid();
        let mut fua = Command::read_write(io_opcode::WRITE, cid, 1, 5000, 8, 4096);
        fua.cdw[2] |= 1 << 30;
        assert!(q.execute_raw(fua, &pattern(5, 4096), true).unwrap().cqe.status.is_success());
    }
    // A new engine on the same file serves the same data and identity.
    let t = start(&backend);
    let (mut admin, mut io) = controller(t.addr, &admin_opts(), 1);
    assert_eq!(io[0].read(1, 100, 128, 512).unwrap(), data);
    assert_eq!(io[0].read(1, 5000, 8, 512).unwrap(), pattern(5, 4096));
    let ns = admin.identify_namespace(1).unwrap();
    assert_eq!(ns.nguid, nvpool_engine::config::derived_nguid(&nvpool_engine::config::derived_uuid(NQN, 1)));
}

#[test]
fn null_backend_reads_zeroes_and_accepts_writes() {
    let t = start_with(vec![namespace("null:1GiB", 4096)], true, 1);
    let (_admin, mut io) =
        controller(t.addr, &ConnectOptions { digests: Digests { header: true, data: true }, ..admin_opts() }, 1);
    io[0].write(1, 7, &pattern(1, 131072), 4096, IN_CAPSULE).unwrap();
    assert!(io[0].read(1, 7, 32, 4096).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn management_api_reports_and_refuses_clearly() {
    let t = start("memory:16MiB");
    let e = &t.engine;
    let list = nvpool_engine::mgmt::handle(e, r#"{"method":"subsystem_list"}"#).unwrap();
    assert_eq!(list[0]["nqn"], NQN);
    let err = nvpool_engine::mgmt::handle(
        e,
        r#"{"method":"namespace_add","params":{"nqn":"nqn.x:none","namespace":{"backend":"memory:1MiB"}}}"#,
    )
    .unwrap_err();
    assert!(err.message.contains("no subsystem"), "{err}");
    assert_eq!(err.kind, nvpool_engine::error::ErrorKind::NotFound);
    let err = nvpool_engine::mgmt::handle(e, r#"{"method":"namespace_add","params":{"nqn":"nqn.2024-01.io.nvpool:test","namespace":{"backend":"ram:1MiB"}}}"#).unwrap_err();
    assert!(err.message.contains("unknown"), "{err}");
    assert_eq!(err.kind, nvpool_engine::error::ErrorKind::InvalidArgument);
    let err = nvpool_engine::mgmt::handle(e, r#"{"method":"frobnicate"}"#).unwrap_err();
    assert!(err.message.contains("unknown method"), "{err}");
    let err = nvpool_engine::mgmt::handle(e, "not json").unwrap_err();
    assert!(err.message.contains("JSON"), "{err}");
    // I/O counters move.
    let (_admin, mut io) = controller(t.addr, &admin_opts(), 1);
    io[0].write(1, 0, &pattern(1, 4096), 512, IN_CAPSULE).unwrap();
    io[0].read(1, 0, 8, 512).unwrap();
    let list = nvpool_engine::mgmt::handle(e, r#"{"method":"subsystem_list"}"#).unwrap();
    let st = &list[0]["namespaces"][0]["stats"];
    assert_eq!(st["writes"], 1);
    assert_eq!(st["read_bytes"], 4096);
}

/// A host that sends commands far beyond its queue size without reading the answers:
/// the engine stops receiving while its output backs up (its memory stays bounded),
/// answers every command once the host reads again, and other queues carry on.
#[test]
fn a_host_that_does_not_read_is_throttled_and_every_command_is_answered() {
    const COMMANDS: usize = 20_000;
    let t = start("memory:16MiB");
    let (_admin, mut io) = controller(t.addr, &admin_opts(), 2);
    let mut flooder = io.remove(0);
    let mut wire = Vec::new();
    for i in 0..COMMANDS {
        let cmd = Command::read_write(io_opcode::READ, (i % 60_000) as u16 + 1, 1, (i % 2048) as u64 * 8, 8, 4096);
        let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
        let n = tcp::encode_capsule_cmd(&cmd, 0, Digests::default(), &mut hdr);
        wire.extend_from_slice(&hdr[..n]);
    }
    let mut writer = flooder.stream().try_clone().unwrap();
    let sender = std::thread::spawn(move || writer.write_all(&wire).unwrap());
    // While the flood waits unread, another queue of the same host reads and writes.
    std::thread::sleep(Duration::from_millis(300));
    io[0].write(1, 8, &pattern(9, 8192), 512, IN_CAPSULE).unwrap();
    assert_eq!(io[0].read(1, 8, 16, 512).unwrap(), pattern(9, 8192));
    let (mut answered, mut refused) = (0, 0);
    while answered + refused < COMMANDS {
        match flooder.recv_pdu().unwrap() {
            nvpool_initiator::TargetPdu::Resp(c) if c.status.is_success() => answered += 1,
            nvpool_initiator::TargetPdu::Resp(c) => {
                assert_eq!(c.status.base(), Status::COMMAND_ID_CONFLICT, "{c:?}");
                refused += 1;
            }
            nvpool_initiator::TargetPdu::Data { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    sender.join().unwrap();
    assert!(answered >= 128, "{answered} reads served, {refused} refused for a full queue");
    assert_eq!(io[0].read(1, 8, 16, 512).unwrap(), pattern(9, 8192));
}

#[test]
fn answers_sent_in_pieces_carry_their_own_command_ids_and_data() {
    // 100 reads of 128 KiB at a time (12.5 MiB, far more than the socket buffers
    // hold) left unread for a while: the engine's sends end part-way through a batch
    // and go on from there. Every answer must carry its own command's ID and data.
    const REGION: usize = 128 * 1024;
    const READS: u16 = 100;
    let t = start("memory:16MiB");
    let (_admin, mut io) = controller(t.addr, &admin_opts(), 1);
    let mut q = io.remove(0);
    for r in 0..8u64 {
        q.write(1, r * 256, &pattern(r + 1, REGION), 512, IN_CAPSULE).unwrap();
    }
    for round in 0..20u64 {
        let mut wanted = std::collections::HashMap::new();
        for i in 0..READS {
            let region = (u64::from(i) + round) % 8;
            let cid = q.alloc_cid();
            q.submit(Command::read_write(io_opcode::READ, cid, 1, region * 256, 256, REGION as u32), &[], false)
                .unwrap();
            wanted.insert(cid, region);
        }
        std::thread::sleep(Duration::from_millis(20));
        for _ in 0..READS {
            let reply = q.next_reply().unwrap();
            let region = wanted.remove(&reply.cqe.cid).unwrap_or_else(|| {
                panic!("round {round}: an answer for command {} that is not outstanding", reply.cqe.cid)
            });
            assert!(reply.cqe.status.is_success(), "{:?}", reply.cqe);
            assert!(reply.data == pattern(region + 1, REGION), "round {round}: command {}'s data", reply.cqe.cid);
        }
    }
}

#[test]
fn a_removed_listener_takes_its_connections_down_and_others_stay() {
    let t = start("memory:16MiB");
    let second = t.engine.add_listener("127.0.0.1:0".parse().unwrap(), Default::default(), Default::default()).unwrap();
    let second = SocketAddr::new(second.addr, second.port);
    // Two reactors: the connections land on both.
    let (_a1, mut io1) = controller(t.addr, &admin_opts(), 2);
    let (_a2, mut io2) = controller(second, &admin_opts(), 2);
    t.engine.remove_listener(t.addr, Default::default()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    for q in &mut io1 {
        while q.read(1, 0, 1, 512).is_ok() {
            assert!(Instant::now() < deadline, "a connection of the removed listener stayed up");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for q in &mut io2 {
        assert_eq!(q.read(1, 0, 1, 512).unwrap().len(), 512, "the other listener's paths stay up");
    }
    assert!(std::net::TcpStream::connect(t.addr).is_err(), "nothing listens there any more");
}

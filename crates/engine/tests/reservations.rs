//! Reservations from the hosts' side: registrations and reservations by Host
//! Identifier across controllers, the commands each type lets through, preemption,
//! reports, keys fetched by R2T, and what a namespace that forwards answers.

use std::net::SocketAddr;

use nvpool_engine::config::{EngineConfig, NamespaceConfig, SubsystemConfig};
use nvpool_initiator::{ConnectOptions, Error, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, io_opcode};
use nvpool_wire::identify::{self, ONCS_RESERVATIONS};
use nvpool_wire::reservation::{
    Acquire, AcquireAction, AcquireData, Register, RegisterAction, RegisterData, Release, ReleaseAction, ReleaseData,
    ReservationType, opcode,
};

mod common;
use common::{TestEngine, namespace};

const NQN: &str = "nqn.2024-01.io.nvpool:reservations";
const BLOCK: u32 = 512;

fn engine(backend: &str, block_size: u32) -> TestEngine {
    let cfg = EngineConfig {
        reactors: Some(2),
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: true,
            hosts: vec![],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces: vec![NamespaceConfig { nsid: Some(1), ..namespace(backend, block_size) }],
        }],
        ..EngineConfig::default()
    };
    TestEngine::start(&cfg)
}

/// A host (by its Host Identifier) with an admin and an I/O queue.
struct Host {
    admin: Queue,
    io: Queue,
}

fn host(addr: SocketAddr, name: &str, id: u8) -> Host {
    let o = ConnectOptions { kato: 0, hostid: [id; 16], ..ConnectOptions::admin(NQN, name) };
    let mut admin = connect_admin(addr, &o).unwrap();
    admin.set_queue_count(1).unwrap();
    let io = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).unwrap();
    Host { admin, io }
}

impl Host {
    fn register(&mut self, action: RegisterAction, current_key: u64, new_key: u64) -> Status {
        let fields = Register { action, ignore_key: false, change_ptpl: 0 };
        self.io.reservation_register(1, fields, RegisterData { current_key, new_key }, true).unwrap()
    }

    fn acquire(&mut self, action: AcquireAction, key: u64, preempt_key: u64, kind: ReservationType) -> Status {
        let fields = Acquire { action, ignore_key: false, kind: Some(kind) };
        self.io.reservation_acquire(1, fields, AcquireData { current_key: key, preempt_key }).unwrap()
    }

    fn release(&mut self, action: ReleaseAction, key: u64, kind: ReservationType) -> Status {
        let fields = Release { action, ignore_key: false, kind_code: kind.code() };
        self.io.reservation_release(1, fields, ReleaseData { current_key: key }).unwrap()
    }

    /// The status of a one-block write and of a one-block read.
    fn write_read(&mut self, lba: u64) -> (Status, Status) {
        let status = |r: Result<(), Error>| match r {
            Ok(()) => Status::SUCCESS,
            Err(Error::Command(s)) => s,
            Err(e) => panic!("{e}"),
        };
        let w = status(self.io.write(1, lba, &pattern(lba, BLOCK as usize), BLOCK, 8192));
        let r = status(self.io.read(1, lba, 1, BLOCK).map(drop));
        (w, r)
    }
}

const CONFLICT: Status = Status::RESERVATION_CONFLICT;
const OK: Status = Status::SUCCESS;

#[test]
fn reservations_keep_out_whom_they_should_and_follow_the_host_not_the_controller() {
    let e = engine("memory:4MiB", BLOCK);
    let mut a = host(e.addr, "nqn.2024-01.io.nvpool:host-a", 0xA);
    let mut b = host(e.addr, "nqn.2024-01.io.nvpool:host-b", 0xB);
    let ctrl = a.admin.identify_controller().unwrap();
    assert_ne!(ctrl.oncs & ONCS_RESERVATIONS, 0, "Identify Controller offers the reservation commands");
    assert_ne!(ctrl.ctratt & identify::CTRATT_HOST_ID_128, 0, "and says host IDs are 128 bits (extended reports)");
    let ns = a.admin.identify_namespace(1).unwrap();
    assert_eq!(ns.rescap, identify::RESCAP_ALL_TYPES);

    // Nothing held: everyone reads and writes; registering changes nothing of that.
    assert_eq!(b.write_read(1), (OK, OK));
    assert_eq!(a.register(RegisterAction::Register, 0, 0xA1), OK);
    assert_eq!(a.register(RegisterAction::Register, 0, 0xA2), CONFLICT.with_dnr(), "registered with another key");
    assert_eq!(b.write_read(2), (OK, OK));

    // Write Exclusive held by A: B reads, but may not write (nor flush).
    assert_eq!(a.acquire(AcquireAction::Acquire, 0xA1, 0, ReservationType::WriteExclusive), OK);
    assert_eq!(b.write_read(3), (CONFLICT.with_dnr(), OK));
    let flush = Command {
        opcode: nvpool_wire::command::io_opcode::FLUSH,
        nsid: 1,
        cid: b.io.alloc_cid(),
        ..Command::default()
    };
    let flush = b.io.execute_raw(flush, &[], false).unwrap();
    assert_eq!(flush.cqe.status, CONFLICT.with_dnr(), "Flush is kept out with writes");
    assert_eq!(a.write_read(3), (OK, OK));
    // A's second controller (same Host Identifier) holds the reservation too.
    let mut a2 = host(e.addr, "nqn.2024-01.io.nvpool:host-a", 0xA);
    assert_eq!(a2.write_read(4), (OK, OK));
    // B cannot take it without A's key, nor release what it does not hold.
    assert_eq!(b.acquire(AcquireAction::Acquire, 0xB1, 0, ReservationType::WriteExclusive), CONFLICT.with_dnr());

    // B registers and preempts A's key: A's registration goes, and with it its writes,
    // even one that A sent before and whose data (by R2T) comes only after.
    let cid = a.io.alloc_cid();
    let late = Command::read_write(io_opcode::WRITE, cid, 1, 9, 1, BLOCK);
    a.io.submit(late, &pattern(99, BLOCK as usize), false).unwrap();
    assert_eq!(b.register(RegisterAction::Register, 0, 0xB1), OK);
    assert_eq!(b.acquire(AcquireAction::Preempt, 0xB1, 0xA1, ReservationType::ExclusiveAccess), OK);
    assert_eq!(a.io.next_reply().unwrap().cqe.status, CONFLICT.with_dnr(), "the write whose data came late");
    assert_ne!(b.io.read(1, 9, 1, BLOCK).unwrap(), pattern(99, BLOCK as usize), "and it did not land");
    assert_eq!(a.write_read(5), (CONFLICT.with_dnr(), CONFLICT.with_dnr()), "Exclusive Access keeps reads out");
    assert_eq!(b.write_read(5), (OK, OK));
    let report = a.io.reservation_report(1, 4096).unwrap();
    assert_eq!(report.kind, Some(ReservationType::ExclusiveAccess));
    let registrants: Vec<([u8; 16], u64, bool)> =
        report.registrants.iter().map(|r| (r.host_id, r.key, r.holds)).collect();
    assert_eq!(registrants, [([0xB; 16], 0xB1, true)]);

    // A report without the extended structure cannot carry a fabric's host IDs.
    let mut plain = Command { nsid: 1, ..Command::default() };
    nvpool_wire::reservation::Report { len: 64, extended: false }.apply(&mut plain);
    let e_ = a.io.execute(plain, 64).unwrap_err();
    assert!(matches!(e_, Error::Command(s) if s == Status::HOST_ID_INCONSISTENT.with_dnr()), "{e_}");

    // Keys fetched by R2T (outside the capsule) work as in the capsule.
    let fields = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 0 };
    let by_r2t = a.io.reservation_register(1, fields, RegisterData { current_key: 0, new_key: 0xA3 }, false);
    assert_eq!(by_r2t.unwrap(), OK);

    // B releases: everyone writes again; a Clear drops every registration.
    assert_eq!(b.release(ReleaseAction::Release, 0xB1, ReservationType::ExclusiveAccess), OK);
    assert_eq!(a.write_read(6), (OK, OK));
    assert_eq!(b.acquire(AcquireAction::Acquire, 0xB1, 0, ReservationType::WriteExclusiveRegistrantsOnly), OK);
    assert_eq!(a.write_read(7), (OK, OK), "a registrant writes under Registrants Only");
    let mut c = host(e.addr, "nqn.2024-01.io.nvpool:host-c", 0xC);
    assert_eq!(c.write_read(7), (CONFLICT.with_dnr(), OK));
    assert_eq!(b.release(ReleaseAction::Clear, 0xB1, ReservationType::WriteExclusiveRegistrantsOnly), OK);
    assert_eq!(c.write_read(8), (OK, OK));
    assert!(a.io.reservation_report(1, 4096).unwrap().registrants.is_empty());

    // Bad fields get a clear status and change nothing.
    let bad = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 3 };
    let s = a.io.reservation_register(1, bad, RegisterData { current_key: 0, new_key: 1 }, true).unwrap();
    assert_eq!(s, Status::INVALID_FIELD.with_dnr(), "persisting through power loss is not offered");
    let mut short = Command { opcode: opcode::REGISTER, nsid: 1, ..Command::default() };
    short.cid = a.io.alloc_cid();
    let s = a.io.execute_raw(short, &[0; 8], true).unwrap().cqe.status;
    assert!(!s.is_success(), "8 bytes of keys where Register needs 16: {s}");
    assert!(a.io.reservation_report(1, 4096).unwrap().registrants.is_empty());
}

#[test]
fn a_namespace_that_forwards_leaves_reservations_to_its_owner() {
    let owner = engine("memory:4MiB", BLOCK);
    let proxy = engine(&format!("remote:{}/{NQN}/1", owner.addr), 0);
    let mut h = host(proxy.addr, "nqn.2024-01.io.nvpool:host-a", 0xA);
    assert_eq!(h.admin.identify_namespace(1).unwrap().rescap, 0);
    assert_eq!(h.register(RegisterAction::Register, 0, 1), Status::INVALID_OPCODE.with_dnr());
    assert_eq!(h.write_read(1), (OK, OK));
}

/// Writes of this namespace the engine completed.
fn writes_completed(e: &TestEngine) -> u64 {
    let s = e.engine.subsystems().into_iter().find(|s| s.nqn == NQN).unwrap();
    s.namespaces[0].stats.writes
}

#[test]
fn preempt_and_abort_completes_after_the_preempted_hosts_writes_in_flight() {
    let e = engine("memory:4MiB", BLOCK);
    // Four writes a second: A's writes wait in the namespace's limits, with the
    // backend, while B preempts A.
    let limits = nvpool_api::QosLimits { write_iops: 4, ..Default::default() };
    e.engine.set_namespace_qos(NQN, 1, limits).unwrap();
    let mut a = host(e.addr, "nqn.2024-01.io.nvpool:host-a", 0xA);
    let mut b = host(e.addr, "nqn.2024-01.io.nvpool:host-b", 0xB);
    assert_eq!(a.register(RegisterAction::Register, 0, 0xA1), OK);
    assert_eq!(a.acquire(AcquireAction::Acquire, 0xA1, 0, ReservationType::WriteExclusive), OK);
    assert_eq!(b.register(RegisterAction::Register, 0, 0xB1), OK);
    let base = writes_completed(&e);
    const WRITES: u64 = 8;
    for lba in 0..WRITES {
        let cid = a.io.alloc_cid();
        let w = Command::read_write(io_opcode::WRITE, cid, 1, lba, 1, BLOCK);
        a.io.submit(w, &pattern(lba, BLOCK as usize), true).unwrap();
    }
    // Let them reach the namespace (all but the first wait for their budget).
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(b.acquire(AcquireAction::PreemptAndAbort, 0xB1, 0xA1, ReservationType::WriteExclusive), OK);
    let done_at_preempt = writes_completed(&e) - base;
    let mut landed = 0;
    for _ in 0..WRITES {
        match a.io.next_reply().unwrap().cqe.status {
            s if s.is_success() => landed += 1,
            s => assert_eq!(s, CONFLICT.with_dnr()),
        }
    }
    println!("{landed} of A's {WRITES} writes landed; {done_at_preempt} had when B's Preempt and Abort completed");
    assert!(landed > 1, "writes were with the backend when B preempted A");
    assert_eq!(done_at_preempt, landed, "a write of A landed after the Preempt and Abort completed");
    assert_eq!(a.write_read(20), (CONFLICT.with_dnr(), OK));
}

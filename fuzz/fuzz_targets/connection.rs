//! Fuzzes the engine's connection state machine: each input is a script of host PDUs
//! (handshake, Connect, Property, admin and NVM commands with any data pointer, H2CData,
//! DH-HMAC-CHAP messages of a host that must authenticate, raw bytes, corruptions) sent
//! over one connection to an engine reactor that this
//! thread runs itself, pass by pass (`reactor::Stepped`), over a socket pair: no other
//! thread and no timing, so a script runs in tens of microseconds.
//!
//! What must hold: the engine never panics, everything it sends parses as a
//! controller's PDU, nothing follows a C2HTermReq, it closes the connection once the
//! host has and then frees it, and a witness controller on the same reactor keeps
//! reading back what it wrote.
#![no_main]

use std::cell::RefCell;
use std::io::{ErrorKind, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use nvpool_engine::Engine;
use nvpool_engine::config::{EngineConfig, NamespaceConfig, SubsystemConfig};
use nvpool_engine::reactor::Stepped;
use nvpool_initiator::pattern;
use nvpool_wire::Status;
use nvpool_wire::auth::{AuthTransfer, Message, Negotiate, Reply};
use nvpool_wire::command::{Command, Completion, PSDT_SGL, SglDescriptor, admin_opcode, io_opcode, sgl};
use nvpool_wire::fabrics::{
    CNTLID_DYNAMIC, CONNECT_DATA_SIZE, ConnectCommand, ConnectData, PropertyAccess, cc, property,
};
use nvpool_wire::tcp::{self, DataHeader, Digests, IcReq, Pdu};

const NQN: &str = "nqn.2024-01.io.nvpool:fuzz";
const HOST: &str = "nqn.2024-01.io.nvpool:fuzz-host";
/// A host that must authenticate; its group is `null`, so no Diffie-Hellman work
/// leaves this thread and the runs stay deterministic.
const AUTH_HOST: &str = "nqn.2024-01.io.nvpool:fuzz-auth";
const AUTH_SECRET: &str = "DHHC-1:00:BwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwcHBwfLJNij:";
const BLOCK: u32 = 512;
/// Passes after which an engine that neither answered nor closed is hung.
const MAX_PASSES: u32 = 1_000_000;

/// One end of a socket pair that the reactor serves at its other end.
struct Host {
    socket: UnixStream,
    received: Vec<u8>,
    digests: Digests,
}

impl Host {
    fn connect(reactor: &mut Stepped) -> Host {
        let (socket, engine_end) = UnixStream::pair().expect("a socket pair");
        socket.set_nonblocking(true).unwrap();
        reactor.serve(engine_end);
        Host { socket, received: Vec::new(), digests: Digests::default() }
    }

    /// Takes what the engine sent; returns false once it closed.
    fn receive(&mut self) -> bool {
        let mut chunk = [0u8; 65536];
        loop {
            match (&self.socket).read(&mut chunk) {
                Ok(0) => return false,
                Ok(n) => self.received.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return false,
                Err(e) => panic!("reading what the engine sent: {e}"),
            }
        }
    }

    /// Sends all of `bytes`, running the reactor (and taking its output) whenever the
    /// socket is full. Returns false if the engine closed before taking them all.
    fn send(&mut self, reactor: &mut Stepped, mut bytes: &[u8]) -> bool {
        let mut passes = 0;
        while !bytes.is_empty() {
            match (&self.socket).write(bytes) {
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    reactor.pass();
                    passes += 1;
                    assert!(passes < MAX_PASSES, "the engine stopped reading a connection it keeps open");
                    if !self.receive() {
                        return false;
                    }
                }
                Err(_) => return false,
            }
        }
        true
    }

    /// Runs the reactor until a whole PDU arrived, and hands it to `f`.
    fn next_pdu<T>(&mut self, reactor: &mut Stepped, f: impl FnOnce(Pdu<'_>) -> T) -> T {
        for _ in 0..MAX_PASSES {
            if let Some(p) = tcp::parse(&self.received, self.digests, tcp::DataLimits::uniform(1 << 20))
                .expect("the engine sent a malformed PDU to the witness")
            {
                let len = p.len;
                let out = f(p.pdu);
                self.received.drain(..len);
                return out;
            }
            reactor.pass();
            assert!(self.receive(), "the engine closed the witness's connection");
        }
        panic!("the witness got no answer");
    }

    fn handshake(&mut self, reactor: &mut Stepped) {
        let mut b = [0u8; tcp::IC_SIZE];
        tcp::encode_ic_req(&IcReq { pfv: 0, hpda: 0, digests: self.digests, maxr2t: 0 }, &mut b);
        assert!(self.send(reactor, &b));
        self.next_pdu(reactor, |p| assert!(matches!(p, Pdu::IcResp(_)), "the witness's ICReq got {p:?}"));
    }

    /// Sends a command capsule and returns its completion and any data it returned.
    fn command(&mut self, reactor: &mut Stepped, cmd: &Command, data: &[u8]) -> (Completion, Vec<u8>) {
        let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
        let n = tcp::encode_capsule_cmd(cmd, data.len(), self.digests, &mut hdr);
        assert!(self.send(reactor, &hdr[..n]) && self.send(reactor, data));
        let mut returned = Vec::new();
        loop {
            let done = self.next_pdu(reactor, |p| match p {
                Pdu::CapsuleResp(c) => Some(c),
                Pdu::C2HData { header, success, data, .. } => {
                    assert_eq!(header.offset as usize, returned.len(), "the witness's data arrived out of order");
                    returned.extend_from_slice(data);
                    success.then(|| Completion { cid: cmd.cid, ..Completion::default() })
                }
                other => panic!("the witness's command got {other:?}"),
            });
            if let Some(c) = done {
                assert_eq!(c.cid, cmd.cid);
                return (c, returned);
            }
        }
    }

    /// Fabrics Connect for queue `qid` of controller `cntlid`; returns the controller.
    fn connect_queue(&mut self, reactor: &mut Stepped, qid: u16, cntlid: u16) -> u16 {
        let mut data = [0u8; CONNECT_DATA_SIZE];
        ConnectData { hostid: [9; 16], cntlid, subnqn: NQN.into(), hostnqn: HOST.into() }.encode(&mut data);
        let mut cmd = ConnectCommand { recfmt: 0, qid, sqsize: 31, cattr: 0, kato: 0 }.to_command(1);
        cmd.flags = PSDT_SGL;
        cmd.dptr = SglDescriptor { address: 0, length: CONNECT_DATA_SIZE as u32, id: sgl::IN_CAPSULE };
        let (c, _) = self.command(reactor, &cmd, &data);
        assert_eq!(c.status, Status::SUCCESS, "the witness's Connect failed");
        c.result as u16
    }
}

/// The engine (its subsystem and namespace), the reactor this thread runs, and the
/// witness: an admin queue that I/O-queue Connects of the inputs may name, and an I/O
/// queue that writes and reads back between inputs.
struct World {
    _engine: Arc<Engine>,
    reactor: Stepped,
    cntlid: u16,
    _admin: Host,
    witness: Host,
    runs: u64,
}

fn world() -> World {
    let cfg = EngineConfig {
        reactors: Some(1),
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: false,
            hosts: vec![HOST.into()],
            dhchap: vec![nvpool_engine::HostDhchap {
                host: AUTH_HOST.into(),
                keys: nvpool_engine::DhchapKeys {
                    secret: AUTH_SECRET.into(),
                    dh_group: Some("null".into()),
                    ..Default::default()
                },
            }],
            tls_psk: vec![],
            namespaces: vec![NamespaceConfig {
                nsid: Some(1),
                backend: "memory:4MiB".into(),
                block_size: BLOCK,
                uuid: None,
                allow_torn_writes: false,
                ana_group: None,
                qos: Default::default(),
            }],
        }],
        ..EngineConfig::default()
    };
    // The engine's own reactor serves nothing (no listener): every connection is this
    // thread's.
    let engine = Engine::start(&cfg).expect("engine starts");
    let mut reactor = Stepped::new(engine.target().clone()).expect("a stepped reactor");
    let mut admin = Host::connect(&mut reactor);
    admin.handshake(&mut reactor);
    let cntlid = admin.connect_queue(&mut reactor, 0, CNTLID_DYNAMIC);
    let mut enable =
        PropertyAccess { eight_bytes: false, offset: property::CC, value: u64::from(cc::EN | 6 << 16 | 4 << 20) }
            .to_command(3, true);
    enable.flags = PSDT_SGL;
    let (c, _) = admin.command(&mut reactor, &enable, &[]);
    assert_eq!(c.status, Status::SUCCESS, "enabling the controller failed");
    let queues = Command {
        opcode: admin_opcode::SET_FEATURES,
        flags: PSDT_SGL,
        cid: 2,
        dptr: SglDescriptor { address: 0, length: 0, id: sgl::TRANSPORT },
        cdw: [0x07, 7 | 7 << 16, 0, 0, 0, 0],
        ..Command::default()
    };
    let (c, _) = admin.command(&mut reactor, &queues, &[]);
    assert_eq!(c.status, Status::SUCCESS, "Number of Queues failed");
    // The witness owns I/O queue 8; inputs may fight over 1 to 7.
    let mut witness = Host::connect(&mut reactor);
    witness.handshake(&mut reactor);
    witness.connect_queue(&mut reactor, 8, cntlid);
    World { _engine: engine, reactor, cntlid, _admin: admin, witness, runs: 0 }
}

#[derive(Arbitrary, Debug)]
enum Sgl {
    Transport,
    InCapsule { offset: u8 },
    Other { id: u8 },
}

#[derive(Arbitrary, Debug)]
enum Step {
    IcReq {
        pfv: u8,
        hpda: u8,
        digests: u8,
        maxr2t: u8,
    },
    Connect {
        io_queue: bool,
        qid: u8,
        sqsize: u8,
        known_controller: bool,
        known_host: bool,
        recfmt: u8,
        short_data: bool,
    },
    Property {
        set: bool,
        offset: u8,
        eight_bytes: bool,
        value: u32,
    },
    Admin {
        opcode: u8,
        cid: u8,
        nsid: u8,
        cdw10: u32,
        cdw11: u32,
        cdw12: u32,
        sgl: Sgl,
        length: u16,
        data: u16,
    },
    Io {
        opcode: u8,
        cid: u8,
        flags: u8,
        nsid: u8,
        slba: u16,
        nlb: u8,
        cdw12_high: u8,
        sgl: Sgl,
        length: u32,
        data: u16,
    },
    H2CData {
        cccid: u8,
        ttag: u8,
        offset: u16,
        length: u16,
        last: bool,
        pad: u8,
    },
    TermReq {
        fes: u8,
    },
    /// An admin queue Connect of the host that must authenticate.
    AuthConnect {
        sqsize: u8,
    },
    /// Authentication Send (with a message) or Receive.
    Auth {
        send: bool,
        protocol_ok: bool,
        message: AuthMessage,
        sgl: Sgl,
        length_delta: i8,
    },
    Raw(Vec<u8>),
    /// Flips bits in what the script has written so far.
    Corrupt {
        at: u16,
        xor: u8,
    },
}

#[derive(Arbitrary, Debug)]
enum AuthMessage {
    Negotiate { transaction: u8, secure_channel: u8, hashes: Vec<u8>, dh_groups: Vec<u8> },
    Reply { transaction: u8, hash_len: u8, challenge: bool, seqnum: u32, dh_len: u8 },
    Success2 { transaction: u8 },
    Failure2 { transaction: u8, explanation: u8 },
    Bytes(Vec<u8>),
}

impl AuthMessage {
    fn encode(self) -> Vec<u8> {
        match self {
            AuthMessage::Negotiate { transaction, secure_channel, hashes, dh_groups } => {
                let secure_channel = if secure_channel < 240 { 0 } else { secure_channel };
                let transaction = u16::from(transaction);
                Message::Negotiate(Negotiate { transaction, secure_channel, dhchap: true, hashes, dh_groups }).encode()
            }
            AuthMessage::Reply { transaction, hash_len, challenge, seqnum, dh_len } => {
                let hl = [32, 48, 64, usize::from(hash_len)][usize::from(hash_len % 4)];
                let reply = Reply {
                    transaction: u16::from(transaction),
                    response: filler(1)[..hl].to_vec(),
                    challenge: challenge.then(|| filler(2)[..hl].to_vec()),
                    seqnum,
                    dh_public: filler(3)[..usize::from(dh_len)].to_vec(),
                };
                Message::Reply(reply).encode()
            }
            AuthMessage::Success2 { transaction } => Message::Success2 { transaction: u16::from(transaction) }.encode(),
            AuthMessage::Failure2 { transaction, explanation } => {
                let transaction = u16::from(transaction);
                Message::Failure { transaction, from_controller: false, reason: 1, explanation }.encode()
            }
            AuthMessage::Bytes(b) => b,
        }
    }
}

/// Data for scripts to send (20,000 bytes, more than any step takes), made once: a
/// pattern per kind of step, so data that lands in the wrong place shows.
fn filler(kind: usize) -> &'static [u8] {
    static FILLERS: OnceLock<[Vec<u8>; 3]> = OnceLock::new();
    &FILLERS.get_or_init(|| [1, 2, 3].map(|seed| pattern(seed, 20_000)))[kind - 1]
}

/// The bytes a script sends, built as a host would, with the digests its first ICReq
/// asked for (the engine takes those; a later ICReq is an error).
struct Script {
    out: Vec<u8>,
    digests: Digests,
    negotiated: bool,
}

impl Script {
    fn capsule(&mut self, cmd: &Command, data: &[u8]) {
        let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
        let n = tcp::encode_capsule_cmd(cmd, data.len(), self.digests, &mut hdr);
        self.out.extend_from_slice(&hdr[..n]);
        self.out.extend_from_slice(data);
        if self.digests.data && !data.is_empty() {
            self.out.extend_from_slice(&tcp::crc32c(data).to_le_bytes());
        }
    }

    fn step(&mut self, s: Step, cntlid: u16) {
        let dptr = |sgl: Sgl, length: u32| match sgl {
            Sgl::Transport => SglDescriptor { address: 0, length, id: sgl::TRANSPORT },
            Sgl::InCapsule { offset } => SglDescriptor { address: u64::from(offset) * 16, length, id: sgl::IN_CAPSULE },
            Sgl::Other { id } => SglDescriptor { address: 0, length, id },
        };
        match s {
            Step::IcReq { pfv, hpda, digests, maxr2t } => {
                let d = Digests::from_bits(digests);
                let mut b = [0u8; tcp::IC_SIZE];
                let pfv = if pfv < 250 { 0 } else { u16::from(pfv) };
                tcp::encode_ic_req(&IcReq { pfv, hpda: hpda % 34, digests: d, maxr2t: u32::from(maxr2t) }, &mut b);
                self.out.extend_from_slice(&b);
                if !std::mem::replace(&mut self.negotiated, true) {
                    self.digests = d;
                }
            }
            Step::Connect { io_queue, qid, sqsize, known_controller, known_host, recfmt, short_data } => {
                let qid = if io_queue { u16::from(qid % 9) } else { 0 };
                let cntlid = match (io_queue, known_controller) {
                    (false, _) => CNTLID_DYNAMIC,
                    (true, true) => cntlid,
                    (true, false) => u16::from(qid) + 0x100,
                };
                let c = ConnectCommand {
                    recfmt: if recfmt < 250 { 0 } else { u16::from(recfmt) },
                    qid,
                    sqsize: u16::from(sqsize),
                    cattr: 0,
                    kato: 0,
                };
                let hostnqn = if known_host { HOST } else { "nqn.2024-01.io.nvpool:other" };
                let mut data = [0u8; CONNECT_DATA_SIZE];
                ConnectData { hostid: [7; 16], cntlid, subnqn: NQN.into(), hostnqn: hostnqn.into() }.encode(&mut data);
                let mut cmd = c.to_command(1);
                cmd.flags = PSDT_SGL;
                let n = if short_data { 512 } else { CONNECT_DATA_SIZE };
                cmd.dptr = SglDescriptor { address: 0, length: n as u32, id: sgl::IN_CAPSULE };
                self.capsule(&cmd, &data[..n]);
            }
            Step::Property { set, offset, eight_bytes, value } => {
                let mut cmd = PropertyAccess { eight_bytes, offset: u32::from(offset), value: u64::from(value) }
                    .to_command(2, set);
                cmd.flags = PSDT_SGL;
                self.capsule(&cmd, &[]);
            }
            Step::Admin { opcode, cid, nsid, cdw10, cdw11, cdw12, sgl, length, data } => {
                let cmd = Command {
                    opcode,
                    flags: PSDT_SGL,
                    cid: u16::from(cid),
                    nsid: u32::from(nsid).wrapping_sub(1),
                    dptr: dptr(sgl, u32::from(length) * 4),
                    cdw: [cdw10, cdw11, cdw12, 0, 0, 0],
                    ..Command::default()
                };
                self.capsule(&cmd, &filler(1)[..usize::from(data % 9000)]);
            }
            Step::Io { opcode, cid, flags, nsid, slba, nlb, cdw12_high, sgl, length, data } => {
                let cmd = Command {
                    opcode: opcode % 16,
                    flags: if flags < 240 { PSDT_SGL } else { flags },
                    cid: u16::from(cid),
                    nsid: u32::from(nsid % 3),
                    dptr: dptr(sgl, if length < 1 << 31 { (u32::from(nlb) + 1) * BLOCK } else { length }),
                    cdw: [u32::from(slba), 0, u32::from(nlb) | u32::from(cdw12_high) << 24, 0, 0, 0],
                    ..Command::default()
                };
                self.capsule(&cmd, &filler(2)[..usize::from(data % 9000)]);
            }
            Step::H2CData { cccid, ttag, offset, length, last, pad } => {
                let h = DataHeader {
                    cccid: u16::from(cccid),
                    ttag: u16::from(ttag % 8),
                    offset: u32::from(offset),
                    length: u32::from(length % 20000),
                };
                let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
                let n = tcp::encode_h2c_data(&h, last, self.digests, &mut hdr);
                if pad % 16 == 1 {
                    // Data placed after padding: PDO and PLEN moved together.
                    hdr[3] = hdr[3].wrapping_add(4);
                    let plen = u32::from_le_bytes(hdr[4..8].try_into().unwrap()) + 4;
                    hdr[4..8].copy_from_slice(&plen.to_le_bytes());
                    self.out.extend_from_slice(&hdr[..n]);
                    self.out.extend_from_slice(&[0; 4]);
                } else {
                    self.out.extend_from_slice(&hdr[..n]);
                }
                let data = &filler(3)[..h.length as usize];
                self.out.extend_from_slice(data);
                if self.digests.data && !data.is_empty() {
                    self.out.extend_from_slice(&tcp::crc32c(data).to_le_bytes());
                }
            }
            Step::TermReq { fes } => {
                let mut b = [0u8; tcp::TERM_REQ_MAX];
                let n = tcp::encode_term_req(false, u16::from(fes % 8), 0, &[], &mut b);
                self.out.extend_from_slice(&b[..n]);
            }
            Step::AuthConnect { sqsize } => {
                let c = ConnectCommand { recfmt: 0, qid: 0, sqsize: u16::from(sqsize), cattr: 0, kato: 0 };
                let mut data = [0u8; CONNECT_DATA_SIZE];
                ConnectData { hostid: [5; 16], cntlid: CNTLID_DYNAMIC, subnqn: NQN.into(), hostnqn: AUTH_HOST.into() }
                    .encode(&mut data);
                let mut cmd = c.to_command(1);
                cmd.flags = PSDT_SGL;
                self.capsule(&cmd, &data);
            }
            Step::Auth { send, protocol_ok, message, sgl, length_delta } => {
                let bytes = if send { message.encode() } else { Vec::new() };
                let length = if send { bytes.len() as u32 } else { 4096 };
                let mut t = AuthTransfer::dhchap(send, length.wrapping_add_signed(i32::from(length_delta)));
                if !protocol_ok {
                    t.secp ^= 0x10;
                }
                let mut cmd = t.to_command(3);
                cmd.flags = PSDT_SGL;
                if !matches!(sgl, Sgl::InCapsule { offset: 0 }) {
                    cmd.dptr = dptr(sgl, t.length);
                }
                self.capsule(&cmd, &bytes);
            }
            Step::Raw(bytes) => self.out.extend_from_slice(&bytes),
            Step::Corrupt { at, xor } => {
                if !self.out.is_empty() {
                    let i = usize::from(at) % self.out.len();
                    self.out[i] ^= xor;
                }
            }
        }
    }
}

/// Checks everything the engine sent on a fuzzed connection.
fn check_output(received: &[u8]) {
    // Until the ICResp, no digests; after it, the ones the ICResp names (the engine
    // echoes what the ICReq asked for, which corruption steps of the script may have
    // changed). A script that broke its own ICReq gets an early C2HTermReq.
    let mut rest = received;
    let mut d = Digests::default();
    let mut terminated = false;
    while !rest.is_empty() {
        assert!(!terminated, "the engine sent more after a C2HTermReq");
        let p = match tcp::parse(rest, d, tcp::DataLimits::uniform(1 << 20)) {
            Ok(Some(p)) => p,
            Ok(None) => panic!("the engine closed in the middle of a PDU"),
            Err(e) => panic!("the engine sent a malformed PDU: {e}"),
        };
        match p.pdu {
            Pdu::IcResp(r) => d = r.digests,
            Pdu::TermReq { from_controller: true, .. } => terminated = true,
            Pdu::CapsuleResp(_) | Pdu::C2HData { .. } | Pdu::R2T(_) => {}
            other => panic!("a controller sent {other:?}"),
        }
        rest = &rest[p.len..];
    }
}

/// The witness writes a block range and reads it back through the same reactor.
fn witness_check(w: &mut World) {
    let round = w.runs;
    let data = pattern(round, 4096);
    let lba = 4096 + (round % 64) * 8;
    let write = Command {
        opcode: io_opcode::WRITE,
        flags: PSDT_SGL,
        cid: 1,
        nsid: 1,
        dptr: SglDescriptor { address: 0, length: 4096, id: sgl::IN_CAPSULE },
        cdw: [lba as u32, (lba >> 32) as u32, 7, 0, 0, 0],
        ..Command::default()
    };
    let (c, _) = w.witness.command(&mut w.reactor, &write, &data);
    assert_eq!(c.status, Status::SUCCESS, "the witness's write failed");
    let read =
        Command { opcode: io_opcode::READ, cid: 2, dptr: SglDescriptor { id: sgl::TRANSPORT, ..write.dptr }, ..write };
    let (c, back) = w.witness.command(&mut w.reactor, &read, &[]);
    assert_eq!(c.status, Status::SUCCESS, "the witness's read failed");
    assert_eq!(back, data, "the witness's data changed");
}

thread_local! {
    static WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
}

fuzz_target!(|steps: Vec<Step>| {
    WORLD.with_borrow_mut(|slot| {
        let w = slot.get_or_insert_with(world);
        let open_before = w.reactor.connections();
        let mut script = Script { out: Vec::new(), digests: Digests::default(), negotiated: false };
        for s in steps.into_iter().take(64) {
            script.step(s, w.cntlid);
        }
        let mut host = Host::connect(&mut w.reactor);
        let mut open = host.send(&mut w.reactor, &script.out);
        let _ = host.socket.shutdown(Shutdown::Write);
        let mut passes = 0;
        while open {
            w.reactor.pass();
            open = host.receive();
            passes += 1;
            assert!(passes < MAX_PASSES, "the engine neither answered nor closed");
        }
        check_output(&host.received);
        drop(host);
        // Closed by both sides: once its last operations complete, it is freed.
        let mut passes = 0;
        while w.reactor.connections() > open_before {
            w.reactor.pass();
            passes += 1;
            assert!(passes < MAX_PASSES, "a closed connection was never freed");
        }
        w.runs += 1;
        if w.runs % 64 == 0 {
            witness_check(w);
        }
    });
});

//! Fuzzes the engine's connection state machine: each input is a script of host PDUs
//! (handshake, Connect, Property, admin and NVM commands with any data pointer, H2CData,
//! raw bytes, corruptions) sent over one TCP connection to an engine running in this
//! process, which then half-closes.
//!
//! What must hold: the engine never panics (libFuzzer aborts on a panic in any thread),
//! everything it sends parses as a controller's PDU, nothing follows a C2HTermReq, it
//! closes the connection once the host has, and a witness controller connected at
//! start keeps reading back what it wrote.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use nvpool_engine::Engine;
use nvpool_engine::config::{EngineConfig, ListenerConfig, NamespaceConfig, SubsystemConfig};
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use nvpool_wire::command::{Command, PSDT_SGL, SglDescriptor, sgl};
use nvpool_wire::fabrics::{CNTLID_DYNAMIC, CONNECT_DATA_SIZE, ConnectCommand, ConnectData, PropertyAccess};
use nvpool_wire::tcp::{self, DataHeader, Digests, IcReq, Pdu};

const NQN: &str = "nqn.2024-01.io.nvpool:fuzz";
const HOST: &str = "nqn.2024-01.io.nvpool:fuzz-host";
const BLOCK: u32 = 512;

struct World {
    _engine: Arc<Engine>,
    addr: SocketAddr,
    /// A controller that I/O queue Connects of the inputs may name.
    cntlid: u16,
    witness: Mutex<(Queue, Queue, u64)>,
}

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let cfg = EngineConfig {
            reactors: Some(1),
            listeners: vec![ListenerConfig { address: "127.0.0.1:0".parse().unwrap() }],
            subsystems: vec![SubsystemConfig {
                nqn: NQN.into(),
                serial: None,
                model: "nvpool".into(),
                allow_any_host: false,
                hosts: vec![HOST.into()],
                namespaces: vec![NamespaceConfig {
                    nsid: Some(1),
                    backend: "memory:4MiB".into(),
                    block_size: BLOCK,
                    uuid: None,
                    allow_torn_writes: false,
                }],
            }],
            ..EngineConfig::default()
        };
        let engine = Engine::start(&cfg).expect("engine starts");
        let l = &engine.listeners()[0];
        let addr = SocketAddr::new(l.addr, l.port);
        let o = ConnectOptions { kato: 0, ..ConnectOptions::admin(NQN, HOST) };
        let mut admin = connect_admin(addr, &o).expect("witness admin");
        admin.set_queue_count(8).expect("queues");
        // The witness owns I/O queue 8; inputs may fight over 1 to 7.
        let io = Queue::connect(addr, &o.io(8, admin.cntlid, 31)).expect("witness I/O queue");
        let cntlid = admin.cntlid;
        World { _engine: engine, addr, cntlid, witness: Mutex::new((admin, io, 0)) }
    })
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
    Raw(Vec<u8>),
    /// Flips bits in what the script has written so far.
    Corrupt {
        at: u16,
        xor: u8,
    },
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

    fn step(&mut self, s: Step, w: &World) {
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
                    (true, true) => w.cntlid,
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
                self.capsule(&cmd, &pattern(1, usize::from(data % 9000)));
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
                self.capsule(&cmd, &pattern(2, usize::from(data % 9000)));
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
                let data = pattern(3, h.length as usize);
                self.out.extend_from_slice(&data);
                if self.digests.data && !data.is_empty() {
                    self.out.extend_from_slice(&tcp::crc32c(&data).to_le_bytes());
                }
            }
            Step::TermReq { fes } => {
                let mut b = [0u8; tcp::TERM_REQ_MAX];
                let n = tcp::encode_term_req(false, u16::from(fes % 8), 0, &[], &mut b);
                self.out.extend_from_slice(&b[..n]);
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

/// Reads everything the engine says until it closes, checking each PDU.
fn drain(stream: &mut TcpStream, digests: Digests) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the engine neither answered nor closed: {e}"),
        }
    }
    // Until the ICResp, no digests; after it, the ones the host asked for (the engine
    // echoes them). A script that broke its own ICReq gets an early C2HTermReq.
    let mut rest = &buf[..];
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
            Pdu::IcResp(_) => d = digests,
            Pdu::TermReq { from_controller: true, .. } => terminated = true,
            Pdu::CapsuleResp(_) | Pdu::C2HData { .. } | Pdu::R2T(_) => {}
            other => panic!("a controller sent {other:?}"),
        }
        rest = &rest[p.len..];
    }
}

fn witness_check(w: &World) {
    let mut guard = w.witness.lock().unwrap();
    let (_, io, round) = &mut *guard;
    *round += 1;
    let data = pattern(*round, 4096);
    let lba = 4096 + (*round % 64) * 8;
    io.write(1, lba, &data, BLOCK, 8192).expect("the witness writes");
    assert_eq!(io.read(1, lba, 8, BLOCK).expect("the witness reads"), data, "the witness's data changed");
}

fuzz_target!(|steps: Vec<Step>| {
    let w = world();
    let mut script = Script { out: Vec::new(), digests: Digests::default(), negotiated: false };
    for s in steps.into_iter().take(64) {
        script.step(s, w);
    }
    let mut stream = TcpStream::connect(w.addr).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = stream.write_all(&script.out);
    let _ = stream.shutdown(Shutdown::Write);
    drain(&mut stream, script.digests);
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    if RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 256 == 0 {
        witness_check(w);
    }
});

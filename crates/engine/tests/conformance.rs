//! Adversarial conformance suite: one case per validation rule of the NVMe/TCP 1.0
//! transport, NVMe over Fabrics 1.1 and NVMe Base 2.0 specifications that applies to
//! what the engine serves, each sent over a raw socket as a hostile host would.
//!
//! Every case asserts the exact answer: a completion status (with Do Not Retry for
//! every error a retry cannot cure), or a C2HTermReq's FES and FEI followed by the
//! connection's close. All of them run against one engine while a witness host writes
//! and verifies its own data beside them; the witness must see no error, and every
//! hostile connection must be released at the end.
//!
//! The rules are written from the specifications, not from a list of failures: add one
//! here for each new command, field or PDU the engine learns.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nvpool_engine::Engine;
use nvpool_engine::config::{EngineConfig, ListenerConfig, NamespaceConfig, SubsystemConfig};
use nvpool_initiator::{ConnectOptions, Queue, connect_admin, pattern};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, DSM_RANGE_SIZE, DsmRange, PSDT_SGL, SglDescriptor, admin_opcode, io_opcode, sgl};
use nvpool_wire::fabrics::{
    CNTLID_DYNAMIC, CONNECT_CNTLID_OFFSET, CONNECT_DATA_SIZE, CONNECT_HOSTID_OFFSET, CONNECT_HOSTNQN_OFFSET,
    CONNECT_QID_OFFSET, CONNECT_SQSIZE_OFFSET, CONNECT_SUBNQN_OFFSET, ConnectCommand, ConnectData, DISCOVERY_NQN,
    PropertyAccess, cc, connect_invalid_param, fctype, property,
};
use nvpool_wire::log::{GetLogPage, feature, lid};
use nvpool_wire::tcp::{self, DataHeader, Digests, IcReq, Pdu, data_field, fes};

const NQN: &str = "nqn.2024-01.io.nvpool:conformance";
const HOST: &str = "nqn.2024-01.io.nvpool:host-conformance";
const BLOCK: u32 = 512;
/// Blocks in the namespace (16 MiB); the witness owns the upper half.
const BLOCKS: u64 = 32768;
const WITNESS_FIRST_LBA: u64 = BLOCKS / 2;

/// What the engine answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Answer {
    /// A completion with this status (the base status; DNR is checked apart).
    Status(Status),
    /// A completion whose DW0 says which Connect parameter was wrong.
    Refused(Status, u32),
    /// A C2HTermReq, after which the connection was closed.
    Term(u16, u32),
    /// An R2T: the command was accepted and waits for its data.
    R2T,
    /// The connection was closed without a word (after an H2CTermReq).
    Closed,
}

struct Case {
    area: &'static str,
    rule: &'static str,
    expect: Answer,
    run: Box<dyn Fn(SocketAddr) -> Answer>,
}

fn case(area: &'static str, rule: &'static str, expect: Answer, run: impl Fn(SocketAddr) -> Answer + 'static) -> Case {
    Case { area, rule, expect, run: Box::new(run) }
}

// ----- the host side -----------------------------------------------------------------

/// One host connection driven byte by byte.
struct Host {
    stream: TcpStream,
    digests: Digests,
    buf: Vec<u8>,
    /// Kept open while the case runs (the admin queue of an I/O queue's controller).
    admin: Option<Queue>,
}

impl Host {
    fn raw(addr: SocketAddr) -> Host {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Host { stream, digests: Digests::default(), buf: Vec::new(), admin: None }
    }

    fn from_queue(q: Queue, admin: Option<Queue>) -> Host {
        let (stream, digests) = q.into_stream();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Host { stream, digests, buf: Vec::new(), admin }
    }

    /// After ICReq/ICResp.
    fn handshaken(addr: SocketAddr, digests: Digests) -> Host {
        Host::from_queue(Queue::handshake(addr, digests).unwrap(), None)
    }

    /// A connected admin queue; enabled unless `enable` is false.
    fn admin_to(addr: SocketAddr, nqn: &str, enable: bool) -> Host {
        let o = ConnectOptions::admin(nqn, HOST);
        let q = if enable { connect_admin(addr, &o) } else { Queue::connect(addr, &o) };
        Host::from_queue(q.unwrap(), None)
    }

    fn admin(addr: SocketAddr) -> Host {
        Host::admin_to(addr, NQN, true)
    }

    /// I/O queue 1 of a fresh controller, its admin queue held open.
    fn io(addr: SocketAddr) -> Host {
        let o = ConnectOptions::admin(NQN, HOST);
        let mut admin = connect_admin(addr, &o).unwrap();
        admin.set_queue_count(2).unwrap();
        let io = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).unwrap();
        Host::from_queue(io, Some(admin))
    }

    fn send(&mut self, bytes: &[u8]) -> &mut Host {
        // The engine may already have closed a connection it refused.
        let _ = self.stream.write_all(bytes);
        self
    }

    /// Sends a command capsule with `data` in it.
    fn command(&mut self, cmd: &Command, data: &[u8]) -> &mut Host {
        let bytes = capsule(cmd, data, self.digests);
        self.send(&bytes)
    }

    /// The next thing the engine says about the command: C2HData are passed over.
    fn answer(&mut self) -> Answer {
        loop {
            match self.next_pdu() {
                None => return Answer::Closed,
                Some(Got::Resp(status, dw0)) => {
                    return if dw0 != 0 && !status.is_success() {
                        Answer::Refused(status, dw0)
                    } else {
                        Answer::Status(status)
                    };
                }
                Some(Got::Data) => continue,
                Some(Got::R2T(_)) => return Answer::R2T,
                Some(Got::Term(fes, fei)) => {
                    // Nothing may follow a C2HTermReq: the controller closes.
                    assert!(self.next_pdu().is_none(), "the engine went on after a C2HTermReq");
                    return Answer::Term(fes, fei);
                }
            }
        }
    }

    /// Sends a Write of `len` bytes at LBA 0 through an R2T and returns the R2T.
    fn r2t(&mut self, len: u32) -> DataHeader {
        let cmd = Command::read_write(io_opcode::WRITE, 9, 1, 0, len / BLOCK, len);
        self.command(&cmd, &[]);
        match self.next_pdu() {
            Some(Got::R2T(h)) => h,
            _ => panic!("no R2T for a Write"),
        }
    }

    /// Sends one H2CData PDU for `h` with `len` bytes of data.
    fn h2c(&mut self, h: DataHeader, last: bool) -> &mut Host {
        let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
        let n = tcp::encode_h2c_data(&h, last, self.digests, &mut hdr);
        let mut bytes = hdr[..n].to_vec();
        bytes.extend(std::iter::repeat_n(0xA5, h.length as usize));
        if self.digests.data && h.length > 0 {
            bytes.extend_from_slice(&tcp::crc32c(&bytes[n..]).to_le_bytes());
        }
        self.send(&bytes)
    }

    fn next_pdu(&mut self) -> Option<Got> {
        loop {
            match tcp::parse(&self.buf, self.digests, tcp::DataLimits::uniform(1 << 20)) {
                Ok(Some(p)) => {
                    let got = match p.pdu {
                        Pdu::CapsuleResp(c) => Got::Resp(c.status, c.result),
                        Pdu::C2HData { success: true, .. } => Got::Resp(Status::SUCCESS, 0),
                        Pdu::C2HData { .. } => Got::Data,
                        Pdu::R2T(h) => Got::R2T(h),
                        Pdu::TermReq { fes, fei, .. } => Got::Term(fes, fei),
                        other => panic!("a controller sent {other:?}"),
                    };
                    let len = p.len;
                    self.buf.drain(..len);
                    return Some(got);
                }
                Ok(None) => {}
                Err(e) => panic!("the engine sent a malformed PDU: {e}"),
            }
            let mut b = [0u8; 65536];
            match self.stream.read(&mut b) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(&b[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return None,
                Err(e) => panic!("no answer from the engine: {e}"),
            }
        }
    }
}

enum Got {
    Resp(Status, u32),
    Data,
    R2T(DataHeader),
    Term(u16, u32),
}

// ----- PDUs and commands -------------------------------------------------------------

fn capsule(cmd: &Command, data: &[u8], digests: Digests) -> Vec<u8> {
    let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
    let n = tcp::encode_capsule_cmd(cmd, data.len(), digests, &mut hdr);
    let mut bytes = hdr[..n].to_vec();
    bytes.extend_from_slice(data);
    if digests.data && !data.is_empty() {
        bytes.extend_from_slice(&tcp::crc32c(data).to_le_bytes());
    }
    bytes
}

fn ic_req() -> Vec<u8> {
    let mut b = [0u8; tcp::IC_SIZE];
    tcp::encode_ic_req(&IcReq::default(), &mut b);
    b.to_vec()
}

/// A command as a conforming host fills it: SGLs, CID 1, no data.
fn command(opcode: u8, nsid: u32, cdw10: u32, cdw11: u32) -> Command {
    Command {
        opcode,
        flags: PSDT_SGL,
        cid: 1,
        nsid,
        dptr: SglDescriptor { address: 0, length: 0, id: sgl::TRANSPORT },
        cdw: [cdw10, cdw11, 0, 0, 0, 0],
        ..Command::default()
    }
}

/// `cmd` with a transport buffer of `len` bytes for data to the host.
fn buffer(mut cmd: Command, len: u32) -> Command {
    cmd.dptr = SglDescriptor { address: 0, length: len, id: sgl::TRANSPORT };
    cmd
}

fn identify(cns: u32, nsid: u32) -> Command {
    buffer(command(admin_opcode::IDENTIFY, nsid, cns, 0), 4096)
}

fn get_log_page(lid: u8, len: usize, offset: u64) -> Command {
    let mut c = command(admin_opcode::GET_LOG_PAGE, 0xFFFF_FFFF, 0, 0);
    GetLogPage { lid, lsp: 0, rae: false, len, offset }.apply(&mut c);
    buffer(c, len as u32)
}

fn with_sgl(mut cmd: Command, id: u8, address: u64, length: u32) -> Command {
    cmd.dptr = SglDescriptor { address, length, id };
    cmd
}

fn read(slba: u64, nlb: u32) -> Command {
    Command { flags: PSDT_SGL, ..Command::read_write(io_opcode::READ, 1, 1, slba, nlb, nlb * BLOCK) }
}

fn write(slba: u64, nlb: u32) -> Command {
    Command { flags: PSDT_SGL, ..Command::read_write(io_opcode::WRITE, 1, 1, slba, nlb, nlb * BLOCK) }
}

fn in_capsule(cmd: Command) -> Command {
    with_sgl(cmd, sgl::IN_CAPSULE, 0, cmd.dptr.length)
}

fn dsm(ranges: &[(u64, u32)]) -> (Command, Vec<u8>) {
    let mut data = vec![0u8; ranges.len() * DSM_RANGE_SIZE];
    for (i, &(slba, nlb)) in ranges.iter().enumerate() {
        DsmRange { attributes: 0, nlb, slba }.encode(&mut data[i * DSM_RANGE_SIZE..(i + 1) * DSM_RANGE_SIZE]);
    }
    let nr = ranges.len() as u32 - 1;
    let cmd = with_sgl(command(io_opcode::DATASET_MANAGEMENT, 1, nr, 1 << 2), sgl::IN_CAPSULE, 0, data.len() as u32);
    (cmd, data)
}

fn write_zeroes(slba: u64, nlb: u32) -> Command {
    let mut c = command(io_opcode::WRITE_ZEROES, 1, slba as u32, (slba >> 32) as u32);
    c.cdw[2] = nlb - 1;
    c
}

/// A Connect command and its data, as a conforming host sends it.
struct Connect {
    cmd: ConnectCommand,
    data: ConnectData,
}

impl Connect {
    fn admin() -> Connect {
        Connect {
            cmd: ConnectCommand { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato: 30_000 },
            data: ConnectData { hostid: [7; 16], cntlid: CNTLID_DYNAMIC, subnqn: NQN.into(), hostnqn: HOST.into() },
        }
    }

    fn bytes(&self) -> (Command, Vec<u8>) {
        let mut d = [0u8; CONNECT_DATA_SIZE];
        self.data.encode(&mut d);
        let mut c = self.cmd.to_command(1);
        c.flags = PSDT_SGL;
        c.dptr = SglDescriptor { address: 0, length: CONNECT_DATA_SIZE as u32, id: sgl::IN_CAPSULE };
        (c, d.to_vec())
    }

    /// Sends it on a fresh handshaken connection.
    fn answer(&self, addr: SocketAddr) -> Answer {
        let (c, d) = self.bytes();
        Host::handshaken(addr, Digests::default()).command(&c, &d).answer()
    }
}

/// An I/O queue Connect for a fresh, enabled controller that was granted 2 I/O queues;
/// `tweak` changes it before it is sent.
fn io_connect(addr: SocketAddr, tweak: impl Fn(&mut Connect)) -> Answer {
    let mut admin = connect_admin(addr, &ConnectOptions::admin(NQN, HOST)).unwrap();
    admin.set_queue_count(2).unwrap();
    let mut c = Connect::admin();
    c.cmd.qid = 1;
    c.cmd.kato = 0;
    c.data.cntlid = admin.cntlid;
    tweak(&mut c);
    let answer = c.answer(addr);
    drop(admin);
    answer
}

fn property_get(offset: u32, eight_bytes: bool) -> Command {
    let mut c = PropertyAccess { eight_bytes, offset, value: 0 }.to_command(1, false);
    c.flags = PSDT_SGL;
    c
}

fn property_set(offset: u32, eight_bytes: bool, value: u64) -> Command {
    let mut c = PropertyAccess { eight_bytes, offset, value }.to_command(1, true);
    c.flags = PSDT_SGL;
    c
}

fn fabrics(fctype: u8) -> Command {
    let mut c = command(admin_opcode::FABRICS, 0, 0, 0);
    c.nsid = u32::from(fctype);
    c
}

/// Raw header bytes of a capsule with `data_len` bytes of data, to be broken by hand.
fn raw_capsule(data_len: usize, digests: Digests) -> Vec<u8> {
    capsule(&command(admin_opcode::KEEP_ALIVE, 0, 0, 0), &vec![0; data_len], digests)
}

fn set_plen(b: &mut [u8], plen: u32) {
    b[4..8].copy_from_slice(&plen.to_le_bytes());
}

// ----- the rules ---------------------------------------------------------------------

use Answer::{Closed, R2T, Refused, Term};

fn status(s: Status) -> Answer {
    Answer::Status(s)
}

fn pdu_rules() -> Vec<Case> {
    let a = "NVMe/TCP PDU";
    let no_digests = Digests::default();
    let header_digest = Digests { header: true, data: false };
    let data_digest = Digests { header: false, data: true };
    let field = |fei| Term(fes::INVALID_HEADER_FIELD, fei);
    let sequence = Term(fes::PDU_SEQUENCE_ERROR, 0);
    vec![
        case(a, "an unknown PDU type is an invalid header field at byte 0", field(0), |addr| {
            Host::handshaken(addr, Digests::default()).send(&[0x42, 0, 8, 0, 8, 0, 0, 0]).answer()
        }),
        case(a, "ICReq HLEN other than 128 is an invalid field at HLEN", field(2), |addr| {
            let mut b = ic_req();
            b[2] = 127;
            Host::raw(addr).send(&b).answer()
        }),
        case(a, "ICReq PLEN other than 128 is refused at once, at PLEN", field(4), |addr| {
            let mut b = ic_req();
            set_plen(&mut b, 256);
            Host::raw(addr).send(&b[..8]).answer()
        }),
        case(
            a,
            "ICReq PFV other than 0 is an unsupported parameter at PFV",
            Term(fes::UNSUPPORTED_PARAMETER, 8),
            |addr| {
                let mut b = ic_req();
                b[8] = 1;
                Host::raw(addr).send(&b).answer()
            },
        ),
        case(a, "ICReq HPDA above 31 is an invalid field at HPDA", field(10), |addr| {
            let mut b = ic_req();
            b[10] = 32;
            Host::raw(addr).send(&b).answer()
        }),
        case(a, "a capsule before ICReq is a PDU sequence error", sequence, |addr| {
            Host::raw(addr).send(&raw_capsule(0, Digests::default())).answer()
        }),
        case(a, "H2CData before ICReq is a PDU sequence error", sequence, |addr| {
            Host::raw(addr).h2c(DataHeader { cccid: 1, ttag: 0, offset: 0, length: 4 }, true).answer()
        }),
        case(a, "a second ICReq is a PDU sequence error", sequence, |addr| {
            Host::handshaken(addr, Digests::default()).send(&ic_req()).answer()
        }),
        case(a, "ICResp from a host is not a host PDU", field(0), |addr| {
            let mut b = [0u8; tcp::IC_SIZE];
            tcp::encode_ic_resp(&Default::default(), &mut b);
            Host::handshaken(addr, Digests::default()).send(&b).answer()
        }),
        case(a, "CapsuleResp from a host is not a host PDU", field(0), |addr| {
            let mut b = [0u8; 24];
            tcp::encode_capsule_resp(&Default::default(), Digests::default(), &mut b);
            Host::handshaken(addr, Digests::default()).send(&b).answer()
        }),
        case(a, "C2HData from a host is not a host PDU", field(0), |addr| {
            let mut b = [0u8; 24];
            let h = DataHeader { cccid: 1, ttag: 0, offset: 0, length: 0 };
            let n = tcp::encode_c2h_data(&h, true, false, Digests::default(), &mut b);
            Host::handshaken(addr, Digests::default()).send(&b[..n]).answer()
        }),
        case(a, "R2T from a host is not a host PDU", field(0), |addr| {
            let mut b = [0u8; 24];
            let n = tcp::encode_r2t(&DataHeader::default(), Digests::default(), &mut b);
            Host::handshaken(addr, Digests::default()).send(&b[..n]).answer()
        }),
        case(a, "C2HTermReq from a host is not a host PDU", field(0), |addr| {
            let mut b = [0u8; 24];
            let n = tcp::encode_term_req(true, fes::PDU_SEQUENCE_ERROR, 0, &[], &mut b);
            Host::handshaken(addr, Digests::default()).send(&b[..n]).answer()
        }),
        case(a, "H2CTermReq ends the connection without an answer", Closed, |addr| {
            let mut b = [0u8; 24];
            let n = tcp::encode_term_req(false, fes::PDU_SEQUENCE_ERROR, 0, &[], &mut b);
            Host::admin(addr).send(&b[..n]).answer()
        }),
        case(a, "a capsule HLEN other than 72 is an invalid field at HLEN", field(2), |addr| {
            let mut b = raw_capsule(0, Digests::default());
            b[2] = 64;
            Host::admin(addr).send(&b).answer()
        }),
        case(a, "an H2CData HLEN other than 24 is an invalid field at HLEN", field(2), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            let mut b = [0u8; 32];
            let n = tcp::encode_h2c_data(&r2t, true, Digests::default(), &mut b);
            b[2] = 28;
            let mut bytes = b[..n].to_vec();
            bytes.extend_from_slice(&[0; 4096]);
            h.send(&bytes).answer()
        }),
        case(a, "HDGST set without a negotiated header digest is an invalid field at FLAGS", field(1), move |addr| {
            Host::admin(addr).send(&raw_capsule(0, header_digest)).answer()
        }),
        case(a, "HDGST clear with a negotiated header digest is an invalid field at FLAGS", field(1), move |addr| {
            let mut h = Host::from_queue(
                Queue::connect(addr, &ConnectOptions { digests: header_digest, ..ConnectOptions::admin(NQN, HOST) })
                    .unwrap(),
                None,
            );
            h.send(&raw_capsule(0, no_digests)).answer()
        }),
        case(
            a,
            "DDGST set on data without a negotiated data digest is an invalid field at FLAGS",
            field(1),
            move |addr| Host::admin(addr).send(&raw_capsule(8, data_digest)).answer(),
        ),
        case(a, "a wrong header digest is a header digest error", Term(fes::HEADER_DIGEST_ERROR, 0), move |addr| {
            let mut h = Host::from_queue(
                Queue::connect(addr, &ConnectOptions { digests: header_digest, ..ConnectOptions::admin(NQN, HOST) })
                    .unwrap(),
                None,
            );
            let mut b = raw_capsule(0, header_digest);
            let last = b.len() - 1;
            b[last] ^= 1;
            h.send(&b).answer()
        }),
        case(
            a,
            "a wrong data digest fails the command, retryable",
            status(Status::TRANSIENT_TRANSPORT_ERROR),
            move |addr| {
                let o = ConnectOptions { digests: data_digest, ..ConnectOptions::admin(NQN, HOST) };
                let mut admin = connect_admin(addr, &o).unwrap();
                admin.set_queue_count(1).unwrap();
                let io = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).unwrap();
                let mut h = Host::from_queue(io, Some(admin));
                let mut b = capsule(&in_capsule(write(0, 1)), &[7; 512], data_digest);
                let last = b.len() - 1;
                b[last] ^= 1;
                h.send(&b).answer()
            },
        ),
        case(a, "PLEN shorter than the header is an invalid field at PLEN", field(4), |addr| {
            let mut b = raw_capsule(0, Digests::default());
            set_plen(&mut b, 64);
            Host::admin(addr).send(&b).answer()
        }),
        case(a, "PDO inside the header is an invalid field at PDO", field(3), |addr| {
            let mut b = raw_capsule(8, Digests::default());
            b[3] = 64;
            Host::admin(addr).send(&b).answer()
        }),
        case(a, "PDO not a multiple of the CPDA alignment is an invalid field at PDO", field(3), |addr| {
            let mut b = raw_capsule(8, Digests::default());
            b[3] = 73;
            set_plen(&mut b, 73 + 8);
            b.insert(72, 0);
            Host::admin(addr).send(&b).answer()
        }),
        case(a, "PDO on a PDU without data is an invalid field at PDO", field(3), |addr| {
            let mut b = raw_capsule(0, Digests::default());
            b[3] = 72;
            Host::admin(addr).send(&b).answer()
        }),
        case(a, "PDO past PLEN is an invalid field at PDO", field(3), |addr| {
            let mut b = raw_capsule(8, Digests::default());
            b[3] = 200;
            Host::admin(addr).send(&b).answer()
        }),
        case(
            a,
            "in-capsule data beyond the capsule size exceeds the data limit",
            Term(fes::DATA_LIMIT_EXCEEDED, 0),
            |addr| {
                let c = raw_capsule(0, Digests::default());
                let mut hdr = c[..72].to_vec();
                set_plen(&mut hdr, 72 + 16384);
                hdr[3] = 72;
                Host::admin(addr).send(&hdr).answer()
            },
        ),
        case(a, "H2CData longer than MAXH2CDATA exceeds the data limit", Term(fes::DATA_LIMIT_EXCEEDED, 0), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            let mut b = [0u8; 32];
            let n = tcp::encode_h2c_data(&DataHeader { length: 1 << 20, ..r2t }, true, Digests::default(), &mut b);
            h.send(&b[..n]).answer()
        }),
        case(a, "H2CData DATAL not matching PLEN is an invalid field at DATAL", field(data_field::DATAL), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            let mut b = [0u8; 32];
            let n = tcp::encode_h2c_data(&r2t, true, Digests::default(), &mut b);
            b[16..20].copy_from_slice(&2048u32.to_le_bytes());
            let mut bytes = b[..n].to_vec();
            bytes.extend_from_slice(&[0; 4096]);
            h.send(&bytes).answer()
        }),
        case(a, "H2CData with no R2T outstanding is an invalid field at TTAG", field(data_field::TTAG), |addr| {
            Host::io(addr).h2c(DataHeader { cccid: 1, ttag: 3, offset: 0, length: 512 }, true).answer()
        }),
        case(a, "H2CData with an unknown TTAG is an invalid field at TTAG", field(data_field::TTAG), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            h.h2c(DataHeader { ttag: r2t.ttag.wrapping_add(1), ..r2t }, true).answer()
        }),
        case(
            a,
            "H2CData with another command's CCCID is an invalid field at CCCID",
            field(data_field::CCCID),
            |addr| {
                let mut h = Host::io(addr);
                let r2t = h.r2t(4096);
                h.h2c(DataHeader { cccid: r2t.cccid + 1, ..r2t }, true).answer()
            },
        ),
        case(
            a,
            "H2CData at an offset other than where the data stands is out of range",
            Term(fes::DATA_OUT_OF_RANGE, 0),
            |addr| {
                let mut h = Host::io(addr);
                let r2t = h.r2t(4096);
                h.h2c(DataHeader { offset: 512, length: 512, ..r2t }, false).answer()
            },
        ),
        case(a, "H2CData past the R2T's length is out of range", Term(fes::DATA_OUT_OF_RANGE, 0), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            h.h2c(DataHeader { length: 4608, ..r2t }, true).answer()
        }),
        case(a, "LAST on H2CData before the whole transfer is out of range", Term(fes::DATA_OUT_OF_RANGE, 0), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            h.h2c(DataHeader { length: 512, ..r2t }, true).answer()
        }),
        case(a, "H2CData in pieces, in order, completes the Write", status(Status::SUCCESS), |addr| {
            let mut h = Host::io(addr);
            let r2t = h.r2t(4096);
            h.h2c(DataHeader { length: 1024, ..r2t }, false);
            h.h2c(DataHeader { offset: 1024, length: 3072, ..r2t }, true).answer()
        }),
    ]
}

/// Connect refusals that the engine's configuration decides, which may change.
fn configuration_can_cure(status: Status, dw0: u32) -> bool {
    status == Status::CONNECT_INVALID_HOST
        || (status == Status::CONNECT_INVALID_PARAMETERS && dw0 == connect_invalid_param(true, CONNECT_SUBNQN_OFFSET))
}

fn fabrics_rules() -> Vec<Case> {
    let a = "Fabrics";
    let invalid = |in_data, offset| Refused(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(in_data, offset));
    vec![
        case(
            a,
            "a command before Connect is a command sequence error",
            status(Status::COMMAND_SEQUENCE_ERROR),
            |addr| Host::handshaken(addr, Digests::default()).command(&identify(1, 0), &[]).answer(),
        ),
        case(
            a,
            "Connect with RECFMT other than 0 is an incompatible format",
            status(Status::CONNECT_INCOMPATIBLE_FORMAT),
            |addr| {
                let mut c = Connect::admin();
                c.cmd.recfmt = 1;
                c.answer(addr)
            },
        ),
        case(a, "Connect to an unknown SUBNQN names SUBNQN", invalid(true, CONNECT_SUBNQN_OFFSET), |addr| {
            let mut c = Connect::admin();
            c.data.subnqn = "nqn.2024-01.io.nvpool:nobody".into();
            c.answer(addr)
        }),
        case(
            a,
            "Connect from a host not allowed names HOSTNQN",
            Refused(Status::CONNECT_INVALID_HOST, connect_invalid_param(true, CONNECT_HOSTNQN_OFFSET)),
            |addr| {
                let mut c = Connect::admin();
                c.data.hostnqn = "nqn.2024-01.io.nvpool:stranger".into();
                c.answer(addr)
            },
        ),
        case(a, "Connect with SQSIZE 0 names SQSIZE", invalid(false, CONNECT_SQSIZE_OFFSET), |addr| {
            let mut c = Connect::admin();
            c.cmd.sqsize = 0;
            c.answer(addr)
        }),
        case(
            a,
            "an admin Connect deeper than the admin queue allows names SQSIZE",
            invalid(false, CONNECT_SQSIZE_OFFSET),
            |addr| {
                let mut c = Connect::admin();
                c.cmd.sqsize = 4095;
                c.answer(addr)
            },
        ),
        case(a, "an admin Connect with a static CNTLID names CNTLID", invalid(true, CONNECT_CNTLID_OFFSET), |addr| {
            let mut c = Connect::admin();
            c.data.cntlid = 1;
            c.answer(addr)
        }),
        case(
            a,
            "Connect data shorter than 1024 bytes is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| {
                let (mut cmd, d) = Connect::admin().bytes();
                cmd.dptr.length = 512;
                Host::handshaken(addr, Digests::default()).command(&cmd, &d[..512]).answer()
            },
        ),
        case(
            a,
            "Connect data described past the capsule is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| {
                let (cmd, d) = Connect::admin().bytes();
                Host::handshaken(addr, Digests::default()).command(&cmd, &d[..512]).answer()
            },
        ),
        case(
            a,
            "Connect data at an offset past the capsule is an SGL offset error",
            status(Status::SGL_OFFSET_INVALID),
            |addr| {
                let (mut cmd, d) = Connect::admin().bytes();
                cmd.dptr.address = 4096;
                Host::handshaken(addr, Digests::default()).command(&cmd, &d).answer()
            },
        ),
        case(a, "Connect data not in the capsule is an SGL type error", status(Status::SGL_TYPE_INVALID), |addr| {
            let (mut cmd, _) = Connect::admin().bytes();
            cmd.dptr.id = sgl::TRANSPORT;
            Host::handshaken(addr, Digests::default()).command(&cmd, &[]).answer()
        }),
        case(a, "Connect with a PRP data pointer is an invalid field", status(Status::INVALID_FIELD), |addr| {
            let (mut cmd, d) = Connect::admin().bytes();
            cmd.flags = 0;
            Host::handshaken(addr, Digests::default()).command(&cmd, &d).answer()
        }),
        case(
            a,
            "a second Connect on a connected queue is a command sequence error",
            status(Status::COMMAND_SEQUENCE_ERROR),
            |addr| {
                let (cmd, d) = Connect::admin().bytes();
                Host::admin(addr).command(&cmd, &d).answer()
            },
        ),
        case(
            a,
            "an I/O queue Connect for an unknown controller names CNTLID",
            invalid(true, CONNECT_CNTLID_OFFSET),
            |addr| io_connect(addr, |c| c.data.cntlid = 0xFFEE),
        ),
        case(
            a,
            "an I/O queue Connect from another Host Identifier names HOSTID",
            invalid(true, CONNECT_HOSTID_OFFSET),
            |addr| io_connect(addr, |c| c.data.hostid = [9; 16]),
        ),
        case(
            a,
            "an I/O queue Connect beyond the queues granted names QID",
            invalid(false, CONNECT_QID_OFFSET),
            |addr| io_connect(addr, |c| c.cmd.qid = 3),
        ),
        case(
            a,
            "an I/O queue Connect deeper than MQES allows names SQSIZE",
            invalid(false, CONNECT_SQSIZE_OFFSET),
            |addr| io_connect(addr, |c| c.cmd.sqsize = u16::MAX),
        ),
        case(
            a,
            "an I/O queue Connect before CC.EN is a command sequence error",
            status(Status::COMMAND_SEQUENCE_ERROR),
            |addr| {
                let admin = Queue::connect(addr, &ConnectOptions::admin(NQN, HOST)).unwrap();
                let mut c = Connect::admin();
                c.cmd.qid = 1;
                c.data.cntlid = admin.cntlid;
                c.answer(addr)
            },
        ),
        case(
            a,
            "a second Connect for a connected I/O queue is a command sequence error",
            status(Status::COMMAND_SEQUENCE_ERROR),
            |addr| {
                let o = ConnectOptions::admin(NQN, HOST);
                let mut admin = connect_admin(addr, &o).unwrap();
                admin.set_queue_count(1).unwrap();
                let _first = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).unwrap();
                let mut c = Connect::admin();
                c.cmd.qid = 1;
                c.data.cntlid = admin.cntlid;
                c.answer(addr)
            },
        ),
        case(a, "Property Get of an unknown property is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin_to(addr, NQN, false).command(&property_get(0x40, false), &[]).answer()
        }),
        case(
            a,
            "Property Get of an 8-byte property as 4 bytes is an invalid field",
            status(Status::INVALID_FIELD),
            |addr| Host::admin_to(addr, NQN, false).command(&property_get(property::CAP, false), &[]).answer(),
        ),
        case(a, "Property Set of a read-only property is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin_to(addr, NQN, false).command(&property_set(property::CSTS, false, 1), &[]).answer()
        }),
        case(a, "Property Set of reserved CC bits is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin_to(addr, NQN, false).command(&property_set(property::CC, false, 1 << 31), &[]).answer()
        }),
        case(a, "Property Set of CC as 8 bytes is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin_to(addr, NQN, false).command(&property_set(property::CC, true, u64::from(cc::EN)), &[]).answer()
        }),
        case(
            a,
            "an unknown fabrics command type on the admin queue is an invalid opcode",
            status(Status::INVALID_OPCODE),
            |addr| Host::admin(addr).command(&fabrics(0x7F), &[]).answer(),
        ),
        case(a, "Property Get on an I/O queue is an invalid opcode", status(Status::INVALID_OPCODE), |addr| {
            Host::io(addr).command(&property_get(property::CSTS, false), &[]).answer()
        }),
        case(a, "Disconnect of an I/O queue succeeds", status(Status::SUCCESS), |addr| {
            Host::io(addr).command(&fabrics(fctype::DISCONNECT), &[]).answer()
        }),
    ]
}

fn admin_rules() -> Vec<Case> {
    let a = "Admin";
    vec![
        case(
            a,
            "an admin command before CC.EN is a command sequence error",
            status(Status::COMMAND_SEQUENCE_ERROR),
            |addr| Host::admin_to(addr, NQN, false).command(&identify(1, 0), &[]).answer(),
        ),
        case(
            a,
            "host data with an admin command that takes none is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| {
                let c = with_sgl(command(admin_opcode::SET_FEATURES, 0, 0x0B, 0), sgl::IN_CAPSULE, 0, 8);
                Host::admin(addr).command(&c, &[0; 8]).answer()
            },
        ),
        case(
            a,
            "an admin command's host data outside the capsule is asked for with an R2T, as a write's, and the \
             command runs once it is in",
            status(Status::SGL_LENGTH_INVALID),
            |addr| {
                let c = with_sgl(command(admin_opcode::SET_FEATURES, 0, 0x0B, 0), sgl::TRANSPORT, 0, 8);
                let mut h = Host::admin(addr);
                h.command(&c, &[]);
                match h.next_pdu() {
                    Some(Got::R2T(r2t)) if r2t.length == 8 && r2t.offset == 0 => h.h2c(r2t, true).answer(),
                    Some(Got::R2T(_)) => Answer::Closed,
                    _ => Answer::Status(Status::SUCCESS),
                }
            },
        ),
        case(a, "an unknown admin opcode is an invalid opcode", status(Status::INVALID_OPCODE), |addr| {
            Host::admin(addr).command(&command(0xC1, 0, 0, 0), &[]).answer()
        }),
        case(a, "a fused admin command is an invalid field", status(Status::INVALID_FIELD), |addr| {
            let mut c = command(admin_opcode::KEEP_ALIVE, 0, 0, 0);
            c.flags |= 1;
            Host::admin(addr).command(&c, &[]).answer()
        }),
        case(a, "a PRP data pointer is an invalid field", status(Status::INVALID_FIELD), |addr| {
            let mut c = identify(1, 0);
            c.flags = 0;
            Host::admin(addr).command(&c, &[]).answer()
        }),
        case(
            a,
            "Identify with a buffer shorter than 4 KiB is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| Host::admin(addr).command(&buffer(identify(1, 0), 512), &[]).answer(),
        ),
        case(
            a,
            "Identify with a buffer longer than 4 KiB is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| Host::admin(addr).command(&buffer(identify(1, 0), 8192), &[]).answer(),
        ),
        case(
            a,
            "Identify into a Last Segment descriptor is an SGL type error",
            status(Status::SGL_TYPE_INVALID),
            |addr| Host::admin(addr).command(&with_sgl(identify(1, 0), 0x30, 0, 4096), &[]).answer(),
        ),
        case(
            a,
            "Identify into a reserved Data Block subtype is an SGL type error",
            status(Status::SGL_TYPE_INVALID),
            |addr| Host::admin(addr).command(&with_sgl(identify(1, 0), 0x0F, 0, 4096), &[]).answer(),
        ),
        case(a, "Identify into in-capsule data is an SGL type error", status(Status::SGL_TYPE_INVALID), |addr| {
            Host::admin(addr).command(&with_sgl(identify(1, 0), sgl::IN_CAPSULE, 0, 4096), &[]).answer()
        }),
        case(a, "Identify with an unknown CNS is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin(addr).command(&identify(0x42, 0), &[]).answer()
        }),
        case(a, "Identify Namespace of NSID 0 is an invalid namespace", status(Status::INVALID_NAMESPACE), |addr| {
            Host::admin(addr).command(&identify(0, 0), &[]).answer()
        }),
        case(
            a,
            "Identify Namespace of NSID above NN is an invalid namespace",
            status(Status::INVALID_NAMESPACE),
            |addr| Host::admin(addr).command(&identify(0, 0x10_0000), &[]).answer(),
        ),
        case(a, "Identify Namespace of an inactive NSID returns zeroes", status(Status::SUCCESS), |addr| {
            Host::admin(addr).command(&identify(0, 9), &[]).answer()
        }),
        case(
            a,
            "the active namespace list from NSID 0xFFFFFFFE is an invalid namespace",
            status(Status::INVALID_NAMESPACE),
            |addr| Host::admin(addr).command(&identify(2, 0xFFFF_FFFE), &[]).answer(),
        ),
        case(
            a,
            "namespace descriptors of an inactive NSID are an invalid namespace",
            status(Status::INVALID_NAMESPACE),
            |addr| Host::admin(addr).command(&identify(3, 9), &[]).answer(),
        ),
        case(a, "Identify for an unknown command set is an invalid field", status(Status::INVALID_FIELD), |addr| {
            let mut c = identify(6, 0);
            c.cdw[1] = 0x55 << 24;
            Host::admin(addr).command(&c, &[]).answer()
        }),
        case(a, "Get Log Page of an unknown log is an invalid log page", status(Status::INVALID_LOG_PAGE), |addr| {
            Host::admin(addr).command(&get_log_page(0x7E, 512, 0), &[]).answer()
        }),
        case(
            a,
            "Get Log Page over MDTS is an invalid field (4 GiB with a 4 GiB SGL)",
            status(Status::INVALID_FIELD),
            |addr| {
                let c = get_log_page(lid::SMART, 1 << 32, 0);
                Host::admin(addr).command(&buffer(c, u32::MAX), &[]).answer()
            },
        ),
        case(
            a,
            "Get Log Page over MDTS is an invalid field (16 GiB with a 4 KiB SGL)",
            status(Status::INVALID_FIELD),
            |addr| {
                let c = get_log_page(lid::SMART, 16 << 30, 0);
                Host::admin(addr).command(&buffer(c, 4096), &[]).answer()
            },
        ),
        case(
            a,
            "Get Log Page with a buffer shorter than NUMD is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| Host::admin(addr).command(&buffer(get_log_page(lid::SMART, 8192, 0), 4096), &[]).answer(),
        ),
        case(a, "Get Log Page into in-capsule data is an SGL type error", status(Status::SGL_TYPE_INVALID), |addr| {
            let c = get_log_page(lid::SMART, 512, 0);
            Host::admin(addr).command(&with_sgl(c, sgl::IN_CAPSULE, 0, 512), &[]).answer()
        }),
        case(
            a,
            "Get Log Page at an offset not dword aligned is an invalid field",
            status(Status::INVALID_FIELD),
            |addr| Host::admin(addr).command(&get_log_page(lid::SMART, 64, 2), &[]).answer(),
        ),
        case(a, "Get Log Page at an offset past the log is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin(addr).command(&get_log_page(lid::SMART, 64, 1 << 20), &[]).answer()
        }),
        case(a, "Get Log Page past the end of a log returns the log and zeroes", status(Status::SUCCESS), |addr| {
            Host::admin(addr).command(&get_log_page(lid::FW_SLOT, 4096, 0), &[]).answer()
        }),
        case(a, "Set Features of an unknown feature is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin(addr).command(&command(admin_opcode::SET_FEATURES, 0, 0x7E, 0), &[]).answer()
        }),
        case(a, "Set Features with Save is a feature not saveable", status(Status::FEATURE_NOT_SAVEABLE), |addr| {
            let c = command(admin_opcode::SET_FEATURES, 0, 1 << 31 | u32::from(feature::KEEP_ALIVE_TIMER), 10_000);
            Host::admin(addr).command(&c, &[]).answer()
        }),
        case(
            a,
            "Number of Queues asking for 65536 queues is an invalid field",
            status(Status::INVALID_FIELD),
            |addr| {
                let c = command(admin_opcode::SET_FEATURES, 0, u32::from(feature::NUMBER_OF_QUEUES), 0xFFFF_FFFF);
                Host::admin(addr).command(&c, &[]).answer()
            },
        ),
        case(
            a,
            "Number of Queues after an I/O queue exists is a command sequence error",
            status(Status::COMMAND_SEQUENCE_ERROR),
            |addr| {
                let mut h = Host::io(addr);
                let admin = h.admin.take().unwrap();
                let mut admin = Host::from_queue(admin, None);
                let c = command(admin_opcode::SET_FEATURES, 0, u32::from(feature::NUMBER_OF_QUEUES), 0x0003_0003);
                let answer = admin.command(&c, &[]).answer();
                drop(h);
                answer
            },
        ),
        case(a, "Get Features of an unknown feature is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::admin(addr).command(&command(admin_opcode::GET_FEATURES, 0, 0x7E, 0), &[]).answer()
        }),
        case(a, "Asynchronous Event Requests beyond AERL are refused", status(Status::AER_LIMIT_EXCEEDED), |addr| {
            let mut h = Host::admin(addr);
            for cid in 1..=4 {
                let mut c = command(admin_opcode::ASYNC_EVENT_REQUEST, 0, 0, 0);
                c.cid = cid;
                h.command(&c, &[]);
            }
            let mut c = command(admin_opcode::ASYNC_EVENT_REQUEST, 0, 0, 0);
            c.cid = 5;
            h.command(&c, &[]).answer()
        }),
        case(a, "the discovery controller has no I/O namespaces to identify", status(Status::INVALID_FIELD), |addr| {
            Host::admin_to(addr, DISCOVERY_NQN, true).command(&identify(0, 1), &[]).answer()
        }),
        case(a, "the discovery controller serves only the discovery log", status(Status::INVALID_LOG_PAGE), |addr| {
            Host::admin_to(addr, DISCOVERY_NQN, true).command(&get_log_page(lid::SMART, 512, 0), &[]).answer()
        }),
        case(a, "the discovery controller has no I/O queues to count", status(Status::INVALID_FIELD), |addr| {
            let c = command(admin_opcode::SET_FEATURES, 0, u32::from(feature::NUMBER_OF_QUEUES), 0);
            Host::admin_to(addr, DISCOVERY_NQN, true).command(&c, &[]).answer()
        }),
        case(a, "the discovery controller does not abort", status(Status::INVALID_OPCODE), |addr| {
            Host::admin_to(addr, DISCOVERY_NQN, true).command(&command(admin_opcode::ABORT, 0, 0, 0), &[]).answer()
        }),
    ]
}

fn nvm_rules() -> Vec<Case> {
    let a = "NVM";
    vec![
        case(a, "an unknown I/O opcode is an invalid opcode", status(Status::INVALID_OPCODE), |addr| {
            Host::io(addr).command(&command(0x7D, 1, 0, 0), &[]).answer()
        }),
        case(a, "an admin opcode on an I/O queue is an invalid opcode", status(Status::INVALID_OPCODE), |addr| {
            // NSID 1 exists: the namespace is checked before the opcode, as Linux and SPDK do.
            Host::io(addr).command(&identify(1, 1), &[]).answer()
        }),
        case(a, "a fused I/O command is an invalid field", status(Status::INVALID_FIELD), |addr| {
            let mut c = read(0, 1);
            c.flags |= 2;
            Host::io(addr).command(&c, &[]).answer()
        }),
        case(a, "an I/O command with a PRP data pointer is an invalid field", status(Status::INVALID_FIELD), |addr| {
            let mut c = read(0, 1);
            c.flags = 0;
            Host::io(addr).command(&c, &[]).answer()
        }),
        case(a, "an inactive NSID is an invalid namespace", status(Status::INVALID_NAMESPACE), |addr| {
            Host::io(addr).command(&Command { nsid: 9, ..read(0, 1) }, &[]).answer()
        }),
        case(a, "NSID 0 is an invalid namespace", status(Status::INVALID_NAMESPACE), |addr| {
            Host::io(addr).command(&Command { nsid: 0, ..read(0, 1) }, &[]).answer()
        }),
        case(
            a,
            "a broadcast Flush without broadcast support is an invalid namespace",
            status(Status::INVALID_NAMESPACE),
            |addr| Host::io(addr).command(&command(io_opcode::FLUSH, 0xFFFF_FFFF, 0, 0), &[]).answer(),
        ),
        case(a, "a Read past the namespace is an LBA out of range", status(Status::LBA_OUT_OF_RANGE), |addr| {
            Host::io(addr).command(&read(BLOCKS - 1, 2), &[]).answer()
        }),
        case(a, "a Read whose LBA range wraps is an LBA out of range", status(Status::LBA_OUT_OF_RANGE), |addr| {
            Host::io(addr).command(&read(u64::MAX, 2), &[]).answer()
        }),
        case(a, "a Write past the namespace is an LBA out of range", status(Status::LBA_OUT_OF_RANGE), |addr| {
            Host::io(addr).command(&write(BLOCKS, 1), &[]).answer()
        }),
        case(a, "a Read over MDTS is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::io(addr).command(&read(0, 512), &[]).answer()
        }),
        case(a, "a Write over MDTS is an invalid field", status(Status::INVALID_FIELD), |addr| {
            Host::io(addr).command(&write(0, 512), &[]).answer()
        }),
        case(
            a,
            "a Read whose SGL is shorter than the transfer is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| Host::io(addr).command(&with_sgl(read(0, 8), sgl::TRANSPORT, 0, 512), &[]).answer(),
        ),
        case(
            a,
            "a Write whose SGL is longer than the transfer is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| Host::io(addr).command(&with_sgl(write(0, 1), sgl::TRANSPORT, 0, 4096), &[]).answer(),
        ),
        case(a, "a Read into in-capsule data is an SGL type error", status(Status::SGL_TYPE_INVALID), |addr| {
            Host::io(addr).command(&in_capsule(read(0, 1)), &[]).answer()
        }),
        case(
            a,
            "a Write from a Last Segment descriptor is an SGL type error",
            status(Status::SGL_TYPE_INVALID),
            |addr| Host::io(addr).command(&with_sgl(write(0, 1), 0x30, 0, 512), &[]).answer(),
        ),
        case(a, "a Write from a Segment descriptor is an SGL type error", status(Status::SGL_TYPE_INVALID), |addr| {
            Host::io(addr).command(&with_sgl(write(0, 1), 0x20, 0, 512), &[]).answer()
        }),
        case(a, "a Write from a keyed descriptor is an SGL type error", status(Status::SGL_TYPE_INVALID), |addr| {
            Host::io(addr).command(&with_sgl(write(0, 1), 0x40, 0, 512), &[]).answer()
        }),
        case(
            a,
            "a Write from a reserved Data Block subtype is an SGL type error",
            status(Status::SGL_TYPE_INVALID),
            |addr| Host::io(addr).command(&with_sgl(write(0, 1), 0x02, 0, 512), &[]).answer(),
        ),
        case(
            a,
            "a Write from a reserved transport subtype is an SGL type error",
            status(Status::SGL_TYPE_INVALID),
            |addr| Host::io(addr).command(&with_sgl(write(0, 1), 0x5B, 0, 512), &[]).answer(),
        ),
        case(
            a,
            "a Write described past its in-capsule data is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| Host::io(addr).command(&in_capsule(write(0, 2)), &[0; 512]).answer(),
        ),
        case(
            a,
            "a Write at an in-capsule offset past the data is an SGL offset error",
            status(Status::SGL_OFFSET_INVALID),
            |addr| Host::io(addr).command(&with_sgl(write(0, 1), sgl::IN_CAPSULE, 1024, 512), &[0; 512]).answer(),
        ),
        case(
            a,
            "a Write at an in-capsule offset inside the data takes the data from there",
            status(Status::SUCCESS),
            |addr| Host::io(addr).command(&with_sgl(write(0, 1), sgl::IN_CAPSULE, 512, 512), &[0; 1024]).answer(),
        ),
        case(a, "a Write through the transport gets an R2T for the whole transfer", R2T, |addr| {
            Host::io(addr).command(&write(0, 8), &[]).answer()
        }),
        case(
            a,
            "in-capsule data beyond the I/O queue's capsule is a data limit error",
            Term(fes::DATA_LIMIT_EXCEEDED, 0),
            |addr| Host::io(addr).command(&in_capsule(write(0, 32)), &[0; 16384]).answer(),
        ),
        case(a, "Write Zeroes past the namespace is an LBA out of range", status(Status::LBA_OUT_OF_RANGE), |addr| {
            Host::io(addr).command(&write_zeroes(BLOCKS - 1, 2), &[]).answer()
        }),
        case(
            a,
            "a Dataset Management range past the namespace is an LBA out of range",
            status(Status::LBA_OUT_OF_RANGE),
            |addr| {
                let (c, d) = dsm(&[(0, 8), (BLOCKS - 4, 8)]);
                Host::io(addr).command(&c, &d).answer()
            },
        ),
        case(
            a,
            "Dataset Management with fewer ranges than NR is an SGL length error",
            status(Status::SGL_LENGTH_INVALID),
            |addr| {
                let (mut c, d) = dsm(&[(0, 8)]);
                c.cdw[0] = 1;
                Host::io(addr).command(&c, &d).answer()
            },
        ),
        case(a, "Dataset Management with a buffer larger than NR ranges is served", status(Status::SUCCESS), |addr| {
            let (mut c, mut d) = dsm(&[(0, 8)]);
            d.resize(4096, 0);
            c.dptr.length = 4096;
            Host::io(addr).command(&c, &d).answer()
        }),
        case(a, "a Read of a valid range succeeds", status(Status::SUCCESS), |addr| {
            Host::io(addr).command(&read(0, 8), &[]).answer()
        }),
    ]
}

fn all_rules() -> Vec<Case> {
    [pdu_rules(), fabrics_rules(), admin_rules(), nvm_rules()].into_iter().flatten().collect()
}

/// A host that writes and verifies its own blocks until told to stop.
fn witness(addr: SocketAddr, stop: Arc<AtomicBool>, verified: Arc<AtomicU64>) -> Result<(), String> {
    let o = ConnectOptions::admin(NQN, HOST);
    let mut admin = connect_admin(addr, &o).map_err(|e| e.to_string())?;
    admin.set_queue_count(1).map_err(|e| e.to_string())?;
    let mut io = Queue::connect(addr, &o.io(1, admin.cntlid, 31)).map_err(|e| e.to_string())?;
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let slot = round % 64;
        let lba = WITNESS_FIRST_LBA + slot * 32;
        let data = pattern(round, 16384);
        io.write(1, lba, &data, BLOCK, if round.is_multiple_of(2) { 8192 } else { 0 })
            .map_err(|e| format!("witness write {round}: {e}"))?;
        let back = io.read(1, lba, 32, BLOCK).map_err(|e| format!("witness read {round}: {e}"))?;
        if back != data {
            return Err(format!("witness read back other data at LBA {lba} in round {round}"));
        }
        verified.fetch_add(1, Ordering::Relaxed);
        round += 1;
    }
    Ok(())
}

#[test]
fn every_rule_is_answered_as_the_specifications_say_while_a_witness_verifies_its_data() {
    let cfg = EngineConfig {
        reactors: Some(2),
        listeners: vec![ListenerConfig {
            address: "127.0.0.1:0".parse().unwrap(),
            tls: Default::default(),
            transport: Default::default(),
        }],
        subsystems: vec![SubsystemConfig {
            nqn: NQN.into(),
            serial: None,
            model: "nvpool".into(),
            allow_any_host: false,
            hosts: vec![HOST.into()],
            dhchap: vec![],
            tls_psk: vec![],
            namespaces: vec![NamespaceConfig {
                nsid: Some(1),
                backend: format!("memory:{}", BLOCKS * u64::from(BLOCK)),
                block_size: BLOCK,
                uuid: None,
                allow_torn_writes: false,
                ana_group: None,
                qos: Default::default(),
            }],
        }],
        ..EngineConfig::default()
    };
    let engine = Engine::start(&cfg).expect("engine starts");
    let l = &engine.listeners()[0];
    let addr = SocketAddr::new(l.addr, l.port);

    let stop = Arc::new(AtomicBool::new(false));
    let verified = Arc::new(AtomicU64::new(0));
    let w = {
        let (stop, verified) = (stop.clone(), verified.clone());
        std::thread::spawn(move || witness(addr, stop, verified))
    };

    let rules = all_rules();
    let mut failures = Vec::new();
    let mut per_area: Vec<(&str, usize)> = Vec::new();
    for c in &rules {
        let got = (c.run)(addr);
        let dnr_ok = match got {
            // A Connect to a subsystem, or from a host, the engine does not know yet may
            // work once the agent has configured it: those refusals invite a retry.
            Answer::Refused(s, dw0) if configuration_can_cure(s.base(), dw0) => !s.dnr(),
            // Every other error but a transport hiccup is final: a retry cannot cure it.
            Answer::Status(s) | Answer::Refused(s, _)
                if !s.is_success() && s.base() != Status::TRANSIENT_TRANSPORT_ERROR =>
            {
                s.dnr()
            }
            _ => true,
        };
        let base = match got {
            Answer::Status(s) => Answer::Status(s.base()),
            Answer::Refused(s, dw0) => Answer::Refused(s.base(), dw0),
            other => other,
        };
        if base != c.expect || !dnr_ok {
            failures.push(format!(
                "[{}] {}: expected {:?}, got {:?}{}",
                c.area,
                c.rule,
                c.expect,
                got,
                if dnr_ok { "" } else { " with the wrong DNR" }
            ));
        }
        match per_area.iter_mut().find(|(a, _)| *a == c.area) {
            Some((_, n)) => *n += 1,
            None => per_area.push((c.area, 1)),
        }
    }

    stop.store(true, Ordering::Relaxed);
    let witness_result = w.join().expect("witness thread");
    let summary: Vec<String> = per_area.iter().map(|(a, n)| format!("{a}: {n}")).collect();
    println!(
        "conformance: {} rules ({}), {} failed; witness verified {} I/Os",
        rules.len(),
        summary.join(", "),
        failures.len(),
        verified.load(Ordering::Relaxed)
    );
    assert!(failures.is_empty(), "rules not kept:\n{}", failures.join("\n"));
    witness_result.expect("the witness saw only its own data, and no error");
    assert!(verified.load(Ordering::Relaxed) > 0, "the witness ran");

    // Every hostile connection was closed and released.
    let deadline = Instant::now() + Duration::from_secs(10);
    while engine.target().connection_count() != 0 {
        assert!(Instant::now() < deadline, "{} connections still open", engine.target().connection_count());
        std::thread::sleep(Duration::from_millis(20));
    }
    engine.stop();
}

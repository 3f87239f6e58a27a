//! The protocol-minimal NVMe/TCP responder: the fastest thing that speaks NVMe/TCP on
//! a machine, against which the engine is measured.
//!
//! It answers the connect sequence (ICReq, Connect, Property Get/Set, Identify, Set
//! Features) and then answers each read with one C2HData carrying the SUCCESS flag and
//! each write with a response capsule (after an R2T when the data is not in the
//! capsule). It stores nothing, checks nothing it does not have to, and sends read
//! data from one shared zero buffer. One thread busy-polls non-blocking sockets.

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};

use nvpool_wire::Status;
use nvpool_wire::bytes::{compact, nul};
use nvpool_wire::command::{Command, Completion, admin_opcode, io_opcode, sgl};
use nvpool_wire::fabrics::{Capabilities, PropertyAccess, VERSION_2_0, cc, csts, fctype, property};
use nvpool_wire::identify::{self, IdentifyController, IdentifyNamespace};
use nvpool_wire::tcp::{self, DataHeader, DataLimits, Digests, IcResp, Pdu};

use crate::idle::IdleBackoff;

/// Largest transfer the responder advertises (the same as the engine's).
const MAX_TRANSFER: usize = 128 * 1024;
/// In-capsule data accepted (the same as the engine's I/O queues).
const IN_CAPSULE: usize = 8192;
/// Most iovecs per write.
const MAX_IOV: usize = 256;

/// What the responder pretends to serve.
#[derive(Clone, Debug)]
pub struct ResponderOptions {
    /// Block size of namespace 1.
    pub block_size: u32,
    /// Size of namespace 1 in bytes.
    pub size: u64,
}

/// A bound responder.
pub struct Responder {
    listener: TcpListener,
    id_ctrl: Vec<u8>,
    id_ns: Vec<u8>,
}

enum Seg {
    Out { start: usize, len: usize },
    Zeroes(usize),
}

struct RConn {
    stream: TcpStream,
    digests: Digests,
    handshaken: bool,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    out: Vec<u8>,
    segs: Vec<Seg>,
    sent_in_first: usize,
    /// Writes waiting for H2CData: (command ID, bytes still to come).
    pending_writes: Vec<(u16, u32)>,
    qid: u16,
    /// The controller configuration the host last set: CSTS follows it, as hosts that
    /// disable the controller before enabling it (SPDK's) wait for that.
    cc: u32,
    dead: bool,
}

/// CSTS for a controller configured with `cc`: ready while enabled, and a shutdown
/// completes at once.
fn controller_status(cc_value: u32) -> u32 {
    let ready = if cc_value & cc::EN != 0 { csts::RDY } else { 0 };
    let shutdown = if cc_value & cc::SHN_MASK != 0 { csts::SHST_COMPLETE } else { 0 };
    ready | shutdown
}

impl Responder {
    /// Binds the listener.
    pub fn bind(addr: SocketAddr, o: &ResponderOptions) -> Result<Responder, String> {
        let listener = TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let id_ctrl = IdentifyController {
            sn: nvpool_wire::bytes::ascii("RESPONDER"),
            mn: nvpool_wire::bytes::ascii("nvpool minimal responder"),
            fr: nvpool_wire::bytes::ascii("1"),
            mdts: (MAX_TRANSFER / 4096).trailing_zeros() as u8,
            cntlid: 1,
            ver: VERSION_2_0,
            cntrltype: identify::CNTRLTYPE_IO,
            kas: 10,
            sqes: 0x66,
            cqes: 0x44,
            maxcmd: 1024,
            nn: 1,
            sgls: identify::SGLS_SUPPORTED | identify::SGLS_OFFSET,
            subnqn: nul("nqn.2024-01.io.nvpool:responder"),
            ioccsz: ((64 + IN_CAPSULE) / 16) as u32,
            iorcsz: 1,
            msdbd: 1,
            ..IdentifyController::default()
        }
        .to_vec();
        let blocks = o.size / u64::from(o.block_size);
        let id_ns = IdentifyNamespace {
            nsze: blocks,
            ncap: blocks,
            nuse: blocks,
            lbaf0: identify::lba_format(o.block_size),
            ..IdentifyNamespace::default()
        }
        .to_vec();
        Ok(Responder { listener, id_ctrl, id_ns })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound listener")
    }

    /// Serves until `stop` is set.
    pub fn run(&self, stop: &AtomicBool) {
        let zeroes = vec![0u8; MAX_TRANSFER];
        let mut conns: Vec<RConn> = Vec::new();
        let mut pass: u32 = 0;
        let mut idle = IdleBackoff::default();
        while !stop.load(Ordering::Relaxed) {
            pass = pass.wrapping_add(1);
            let napping = idle.pass();
            if napping || pass.is_multiple_of(256) {
                while let Ok((s, _)) = self.listener.accept() {
                    let _ = s.set_nodelay(true);
                    if s.set_nonblocking(true).is_ok() {
                        conns.push(RConn::new(s));
                    }
                }
                conns.retain(|c| !c.dead);
            }
            for c in conns.iter_mut().filter(|c| !c.dead) {
                match c.stream.read(&mut c.rbuf[c.rend..]) {
                    Ok(0) => c.dead = true,
                    Ok(n) => {
                        idle.busy();
                        c.rend += n;
                        c.process(self, &zeroes);
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(_) => c.dead = true,
                }
                c.flush(&zeroes);
            }
        }
    }
}

impl RConn {
    fn new(stream: TcpStream) -> RConn {
        RConn {
            stream,
            digests: Digests::default(),
            handshaken: false,
            rbuf: vec![0; 4 << 20],
            rstart: 0,
            rend: 0,
            out: Vec::with_capacity(1 << 16),
            segs: Vec::with_capacity(1024),
            sent_in_first: 0,
            pending_writes: Vec::new(),
            qid: 0,
            cc: 0,
            dead: false,
        }
    }

    fn push_out(&mut self, bytes: &[u8]) {
        let start = self.out.len();
        self.out.extend_from_slice(bytes);
        self.segs.push(Seg::Out { start, len: bytes.len() });
    }

    fn respond(&mut self, cid: u16, result: u64, status: Status) {
        let c = Completion {
            result: result as u32,
            result_hi: (result >> 32) as u32,
            cid,
            status,
            sqid: self.qid,
            sqhd: 0,
        };
        let mut b = [0u8; 32];
        let n = tcp::encode_capsule_resp(&c, self.digests, &mut b);
        self.push_out(&b[..n]);
    }

    fn c2h(&mut self, cid: u16, data: Option<&[u8]>, len: usize, success: bool, zeroes: &[u8]) {
        let h = DataHeader { cccid: cid, ttag: 0, offset: 0, length: len as u32 };
        let mut b = [0u8; 32];
        let n = tcp::encode_c2h_data(&h, true, success, self.digests, &mut b);
        self.push_out(&b[..n]);
        match data {
            Some(d) => self.push_out(&d[..len]),
            None => self.segs.push(Seg::Zeroes(len)),
        }
        if self.digests.data {
            let crc = tcp::crc32c(data.unwrap_or(&zeroes[..len]));
            self.push_out(&crc.to_le_bytes());
        }
    }

    fn process(&mut self, r: &Responder, zeroes: &[u8]) {
        let limits = DataLimits {
            capsule: IN_CAPSULE as u32,
            data_pdu: MAX_TRANSFER as u32,
            alignment: tcp::pdu_data_alignment(0),
        };
        let buf = std::mem::take(&mut self.rbuf);
        loop {
            let p = match tcp::parse(&buf[self.rstart..self.rend], self.digests, limits) {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(_) => {
                    self.dead = true;
                    break;
                }
            };
            self.rstart += p.len;
            match p.pdu {
                Pdu::IcReq(req) if !self.handshaken => {
                    let mut b = [0u8; tcp::IC_SIZE];
                    let resp = IcResp { pfv: 0, cpda: 0, digests: req.digests, maxdata: MAX_TRANSFER as u32 };
                    tcp::encode_ic_resp(&resp, &mut b);
                    self.push_out(&b);
                    self.digests = req.digests;
                    self.handshaken = true;
                }
                Pdu::CapsuleCmd { command, data } => self.command(r, &command, data.len(), zeroes),
                Pdu::H2CData { header, .. } => {
                    if let Some(i) = self.pending_writes.iter().position(|(cid, _)| *cid == header.cccid) {
                        let left = self.pending_writes[i].1.saturating_sub(header.length);
                        if left == 0 {
                            self.pending_writes.swap_remove(i);
                            self.respond(header.cccid, 0, Status::SUCCESS);
                        } else {
                            self.pending_writes[i].1 = left;
                        }
                    }
                }
                _ => self.dead = true,
            }
        }
        self.rbuf = buf;
        if self.rstart > 0 {
            compact(&mut self.rbuf, &mut self.rstart, &mut self.rend);
        }
    }

    fn command(&mut self, r: &Responder, c: &Command, in_capsule: usize, zeroes: &[u8]) {
        let len = c.dptr.length as usize;
        match c.opcode {
            admin_opcode::FABRICS => match c.fctype() {
                fctype::CONNECT => {
                    self.qid = nvpool_wire::fabrics::ConnectCommand::from_command(c).qid;
                    self.respond(c.cid, 1, Status::SUCCESS);
                }
                fctype::PROPERTY_GET => {
                    let v = match PropertyAccess::from_command(c).offset {
                        property::CAP => Capabilities { mqes: 1023, timeout: 15, css: 1 }.to_u64(),
                        property::VS => u64::from(VERSION_2_0),
                        property::CC => u64::from(self.cc),
                        property::CSTS => u64::from(controller_status(self.cc)),
                        _ => 0,
                    };
                    self.respond(c.cid, v, Status::SUCCESS);
                }
                fctype::PROPERTY_SET => {
                    let p = PropertyAccess::from_command(c);
                    if p.offset == property::CC {
                        self.cc = p.value as u32 & cc::WRITABLE;
                    }
                    self.respond(c.cid, 0, Status::SUCCESS);
                }
                _ => self.respond(c.cid, 0, Status::SUCCESS),
            },
            io_opcode::READ if self.qid != 0 => self.c2h(c.cid, None, len.min(MAX_TRANSFER), true, zeroes),
            io_opcode::WRITE if self.qid != 0 && c.dptr.id == sgl::TRANSPORT && in_capsule == 0 => {
                let h = DataHeader { cccid: c.cid, ttag: c.cid, offset: 0, length: len as u32 };
                let mut b = [0u8; 32];
                let n = tcp::encode_r2t(&h, self.digests, &mut b);
                self.push_out(&b[..n]);
                self.pending_writes.push((c.cid, len as u32));
            }
            admin_opcode::IDENTIFY if self.qid == 0 => {
                let page = match c.cdw10() & 0xFF {
                    1 => r.id_ctrl.clone(),
                    0 if c.nsid == 1 => r.id_ns.clone(),
                    2 => {
                        let mut v = vec![0u8; 4096];
                        v[0] = 1;
                        v
                    }
                    _ => vec![0u8; 4096],
                };
                self.c2h(c.cid, Some(&page), len.min(page.len()), false, zeroes);
                self.respond(c.cid, 0, Status::SUCCESS);
            }
            admin_opcode::SET_FEATURES if self.qid == 0 => {
                // Grant the queues asked for (Number of Queues echoes its request).
                self.respond(c.cid, u64::from(c.cdw11()), Status::SUCCESS);
            }
            admin_opcode::ASYNC_EVENT_REQUEST if self.qid == 0 => {}
            _ => self.respond(c.cid, 0, Status::SUCCESS),
        }
    }

    fn flush(&mut self, zeroes: &[u8]) {
        while !self.segs.is_empty() && !self.dead {
            let mut iov: [IoSlice<'_>; MAX_IOV] = std::array::from_fn(|_| IoSlice::new(&[]));
            let mut n = 0;
            for (i, s) in self.segs.iter().take(MAX_IOV).enumerate() {
                let bytes = match *s {
                    Seg::Out { start, len } => &self.out[start..start + len],
                    Seg::Zeroes(len) => &zeroes[..len],
                };
                iov[i] = IoSlice::new(if i == 0 { &bytes[self.sent_in_first..] } else { bytes });
                n = i + 1;
            }
            let mut written = match self.stream.write_vectored(&iov[..n]) {
                Ok(w) => w,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(_) => {
                    self.dead = true;
                    return;
                }
            };
            let mut done = 0;
            for s in &self.segs {
                let len = match *s {
                    Seg::Out { len, .. } | Seg::Zeroes(len) => len,
                } - if done == 0 { self.sent_in_first } else { 0 };
                if written < len {
                    break;
                }
                written -= len;
                done += 1;
                self.sent_in_first = 0;
            }
            self.segs.drain(..done);
            self.sent_in_first += written;
        }
        if self.segs.is_empty() {
            self.out.clear();
            self.sent_in_first = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_follows_the_configuration() {
        // SPDK's host disables a ready controller and waits for RDY to clear before it
        // enables it again; the Linux host and nvpool's enable and wait for RDY.
        assert_eq!(controller_status(0), 0);
        assert_eq!(controller_status(cc::EN | 6 << 16 | 4 << 20), csts::RDY);
        assert_eq!(controller_status(cc::EN | 1 << 14), csts::RDY | csts::SHST_COMPLETE);
    }
}

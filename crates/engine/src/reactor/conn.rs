//! One NVMe/TCP connection (one queue): PDU framing, command dispatch, R2T data
//! collection, command slots and the output queue. What a command does to storage is
//! its namespace's backend's business (see [`crate::backend`]).
//!
//! Output is queued as items (a PDU header, optional data, optional data digest) and
//! sent in batches with one `sendmsg` per batch, so many responses that became ready
//! in one reactor pass leave in one system call.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use io_uring::{opcode, types};
use nvpool_wire::Status;
use nvpool_wire::bytes::compact;
use nvpool_wire::command::{Command, Completion, SQE_SIZE, SglDescriptor, admin_opcode, sgl};
use nvpool_wire::fabrics::fctype;
use nvpool_wire::rdma::KeyedSgl;
use nvpool_wire::tcp::{self, DataHeader, Digests, FatalError, IcResp, Pdu, data_field, fes};

use super::Reactor;
use super::rdma::{Done, Prefetched, RdmaWire, Work};
use crate::bufpool::{Buf, PAGE_SIZE};
use crate::io::{BlockIo, DiskQueue, Queued};
use crate::nvme::admin::{self, AdminOutcome};
use crate::nvme::ana;
use crate::nvme::auth::{self, Handled, Outcome, Transaction};
use crate::nvme::data_pointer::Source;
use crate::nvme::nvm;
use crate::nvme::subsystem::NamespaceMap;
use crate::nvme::{ADMIN_IN_CAPSULE_DATA, Controller, IO_IN_CAPSULE_DATA, MAX_H2C_DATA, Namespace, Transport, fabrics};
use crate::plan::IoPlan;
use crate::ring::Op;
use crate::tls::TlsPeer;
use serde::{Deserialize, Serialize};

/// Controller PDU data alignment asked of hosts: 0, dword-aligned data, which every
/// host's plain layout (data right after the header and its digest) already has.
const CPDA: u8 = 0;
/// Receive buffer: one whole PDU of the largest kind (an H2CData of MAXH2CDATA) with
/// headers and digests, plus room to read ahead.
const RECV_BUF: usize = MAX_H2C_DATA as usize + 16 * 1024;
/// What one PDU from a host may carry: a capsule with the largest in-capsule data, or
/// one H2CData of MAXH2CDATA.
const RECV_LIMITS: tcp::DataLimits = tcp::DataLimits {
    capsule: if ADMIN_IN_CAPSULE_DATA > IO_IN_CAPSULE_DATA {
        ADMIN_IN_CAPSULE_DATA as u32
    } else {
        IO_IN_CAPSULE_DATA as u32
    },
    data_pdu: MAX_H2C_DATA,
    alignment: tcp::pdu_data_alignment(CPDA),
};
/// Most output items sent in one `sendmsg`.
const MAX_SEND_ITEMS: usize = 256;
/// Output items queued past which the connection stops receiving until sends drain:
/// a host that sends commands but does not read its answers cannot grow the queue
/// without bound. A full queue of commands needs at most three items each.
const MAX_OUT_BACKLOG: usize = 1024;
/// Header room inline in an output item: a data, R2T or response PDU header with its
/// header digest (28 bytes). Every I/O builds and queues an item, so items stay small;
/// the rare larger PDUs (ICResp, C2HTermReq) are sent as owned payloads instead.
const MAX_OUT_HEADER: usize = 32;
/// A connection must finish ICReq within this long, or it is closed.
const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Connect CATTR bit 2: the host disabled SQ flow control.
const CATTR_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Waiting for ICReq.
    Handshake,
    /// Serving commands.
    Ready,
    /// Sending what is queued (a termination request, a Disconnect response), then
    /// closing. Input is ignored.
    Draining,
    /// Shut down; waiting for in-flight operations before the connection is freed.
    Closed,
}

/// Data an output item sends after its header.
enum Payload {
    None,
    Pool(Buf, usize),
    Owned(Vec<u8>),
    Zeroes(usize),
    /// Read data sent straight from a memory namespace's RAM, with no copy into a
    /// buffer first. The namespace is held so the mapping outlives the send. Only made
    /// without data digests, which would need the bytes in Rust.
    Mapped {
        at: *const u8,
        len: usize,
        _namespace: Arc<Namespace>,
    },
}

struct OutItem {
    header: [u8; MAX_OUT_HEADER],
    header_len: usize,
    payload: Payload,
    digest: [u8; 4],
    digest_len: usize,
}

impl Payload {
    fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Pool(_, n) | Payload::Zeroes(n) | Payload::Mapped { len: n, .. } => *n,
            Payload::Owned(v) => v.len(),
        }
    }
}

impl OutItem {
    fn len(&self) -> usize {
        self.header_len + self.payload.len() + self.digest_len
    }
}

/// The queue this connection serves, once Connect succeeded.
struct Queue {
    controller: Arc<Controller>,
    qid: u16,
    sqsize: u16,
    sqhd: u16,
    flow_control_disabled: bool,
    namespaces: Arc<NamespaceMap>,
    generation: u64,
    /// Whether the queue takes commands other than authentication: set at Connect
    /// when the host has no secrets, or once it authenticated (DH-HMAC-CHAP).
    authenticated: bool,
    /// The authentication transaction, from the host's first message.
    auth: Option<Box<Transaction>>,
}

impl Queue {
    /// Takes the subsystem's current namespace map if it changed; returns whether it
    /// did. One atomic load: the map is re-read only after a change.
    fn refresh(&mut self) -> bool {
        let subsystem = &self.controller.subsystem;
        let g = subsystem.generation();
        if g == self.generation {
            return false;
        }
        self.namespaces = subsystem.namespaces();
        self.generation = g;
        true
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Waiting for H2CData after an R2T.
    AwaitingData,
    /// With the backend: disk operations in flight, or deferred to another thread.
    Backend,
}

/// A command that outlives the PDU that carried it (R2T or backend work).
struct Slot {
    state: SlotState,
    cid: u16,
    ns: Option<Arc<Namespace>>,
    io: BlockIo,
    received: u32,
}

impl Slot {
    fn free() -> Slot {
        Slot { state: SlotState::Free, cid: 0, ns: None, io: BlockIo::idle(), received: 0 }
    }
}

/// The bytes of a posted send that live in an output item itself (its PDU header and
/// data digest), copied out when the send is posted: the output queue may grow, and
/// so move its items, while the kernel still reads them.
struct SendArea {
    headers: [[u8; MAX_OUT_HEADER]; MAX_SEND_ITEMS],
    digests: [[u8; 4]; MAX_SEND_ITEMS],
}

/// How a connection's bytes move. The TCP state is inline: every TCP connection is
/// boxed already, and its hot path reads it on every PDU.
#[allow(clippy::large_enum_variant)]
enum Wire {
    /// An NVMe/TCP stream: PDUs in a byte stream, sent in batches.
    Tcp(Stream),
    /// An RDMA queue pair: capsules by SEND and RECV, data by READ and WRITE.
    Rdma(Box<RdmaWire>),
}

/// The NVMe/TCP side of a connection.
struct Stream {
    socket: TcpStream,
    /// Who the connection's TLS session proved the host to be: its Connect must name
    /// that host and subsystem.
    tls: Option<Box<TlsPeer>>,
    /// The socket's slot in the ring's registered-file table, if it has one: operations
    /// on a registered file skip the kernel's descriptor lookup and reference counting.
    registered_file: Option<u32>,
    digests: Digests,
    /// Its own mapping, so a closed connection gives the memory back at once. Out of
    /// its place only while `on_recv` parses it.
    recv_buf: Option<Buf>,
    recv_start: usize,
    recv_end: usize,
    recv_posted: bool,
    /// Output in order; the first `sending` items belong to the posted send.
    out: VecDeque<OutItem>,
    sending: usize,
    /// Bytes of those items the kernel has taken so far.
    sent: usize,
    iov: Vec<libc::iovec>,
    /// Where the posted send's headers and digests are; boxed, so it never moves.
    send_area: Box<SendArea>,
    msg: libc::msghdr,
    send_posted: bool,
    /// Whole capsules that arrived while parking, not acted on.
    held: Vec<u8>,
    /// Whether parking asked the kernel to take the posted receive back.
    recv_cancelled: bool,
    /// Parking was called off while a receive was posted: resume once it is back.
    resume_after_recv: bool,
}

/// One queue of a host: the commands it runs, on its wire.
pub(super) struct Conn {
    wire: Wire,
    /// The host's address, for the log.
    peer: String,
    /// The listener that accepted it; `None` for a socket pair.
    pub(super) port_id: Option<u16>,
    phase: Phase,
    accepted_ms: u64,
    ops_in_flight: u32,
    queue: Option<Queue>,
    slots: Vec<Slot>,
    free_slots: Vec<u16>,
    aers: Vec<u16>,
    /// Set while a hot upgrade parks the connection: it finishes what it took and
    /// takes nothing new (see `park_step`).
    parking: bool,
}

impl Conn {
    pub(super) fn new(socket: TcpStream, now_ms: u64, port_id: Option<u16>, tls: Option<Box<TlsPeer>>) -> Conn {
        let peer = socket.peer_addr().map_or_else(|_| "a socket pair".to_string(), |a| a.to_string());
        let stream = Stream {
            socket,
            tls,
            registered_file: None,
            digests: Digests::default(),
            recv_buf: Some(Buf::new(RECV_BUF.div_ceil(PAGE_SIZE))),
            recv_start: 0,
            recv_end: 0,
            recv_posted: false,
            out: VecDeque::with_capacity(256),
            sending: 0,
            sent: 0,
            iov: Vec::with_capacity(MAX_SEND_ITEMS * 3),
            send_area: Box::new(SendArea {
                headers: [[0; MAX_OUT_HEADER]; MAX_SEND_ITEMS],
                digests: [[0; 4]; MAX_SEND_ITEMS],
            }),
            // SAFETY: msghdr is plain data; all-zero is a valid empty header.
            msg: unsafe { std::mem::zeroed() },
            send_posted: false,
            held: Vec::new(),
            recv_cancelled: false,
            resume_after_recv: false,
        };
        Conn::on_wire(Wire::Tcp(stream), peer, now_ms, port_id, Phase::Handshake)
    }

    /// A connection on an RDMA queue pair, accepted with `posted` receives.
    pub(super) fn rdma(wire: Box<RdmaWire>, posted: u32, now_ms: u64, port_id: u16) -> Conn {
        let peer = wire.peer.clone();
        let mut c = Conn::on_wire(Wire::Rdma(wire), peer, now_ms, Some(port_id), Phase::Ready);
        c.ops_in_flight = posted;
        c
    }

    fn on_wire(wire: Wire, peer: String, now_ms: u64, port_id: Option<u16>, phase: Phase) -> Conn {
        Conn {
            wire,
            peer,
            port_id,
            phase,
            accepted_ms: now_ms,
            ops_in_flight: 0,
            queue: None,
            slots: Vec::new(),
            free_slots: Vec::new(),
            aers: Vec::new(),
            parking: false,
        }
    }

    /// A connection as another engine process left it, on `socket`: its handshake,
    /// digests, queue (claimed again in its controller), outstanding Asynchronous Event
    /// Requests. Its unread input is fed in by `resume`.
    pub(super) fn restore(
        socket: TcpStream,
        i: &ConnImage,
        controller: Option<Arc<Controller>>,
        now_ms: u64,
    ) -> Result<Conn, String> {
        let mut c = Conn::new(socket, now_ms, i.port_id, i.tls.clone().map(Box::new));
        if let Wire::Tcp(s) = &mut c.wire {
            s.digests = Digests { header: i.header_digest, data: i.data_digest };
            s.held = i.input.clone();
        }
        if i.ready {
            c.phase = Phase::Ready;
        }
        if let Some(q) = &i.queue {
            let controller = controller.ok_or_else(|| format!("controller {} of a connection is missing", q.cntlid))?;
            if !controller.claim_queue(q.qid) {
                return Err(format!("queue {} of controller {} is taken twice", q.qid, q.cntlid));
            }
            let depth = usize::from(q.sqsize) + 1;
            c.slots = (0..depth).map(|_| Slot::free()).collect();
            c.free_slots = (0..depth as u16).rev().collect();
            let namespaces = controller.subsystem.namespaces();
            let generation = controller.subsystem.generation();
            c.queue = Some(Queue {
                controller,
                qid: q.qid,
                sqsize: q.sqsize,
                sqhd: q.sqhd,
                flow_control_disabled: q.flow_control_disabled,
                namespaces,
                generation,
                authenticated: q.authenticated,
                auth: None,
            });
        }
        c.aers = i.aers.clone();
        // Parked as the other process left it, until `resume`.
        c.parking = true;
        Ok(c)
    }

    // ----- hot upgrade --------------------------------------------------------------

    /// Starts parking: commands already taken finish, new ones are held.
    pub(super) fn park(&mut self) {
        self.parking = true;
    }

    /// Whether nothing is in flight but, perhaps, the posted receive.
    fn quiet(&self) -> bool {
        let Wire::Tcp(s) = &self.wire else { return false };
        matches!(self.phase, Phase::Handshake | Phase::Ready)
            && s.out.is_empty()
            && !s.send_posted
            && self.ops_in_flight == u32::from(s.recv_posted)
            && self.slots.iter().all(|s| s.state == SlotState::Free)
    }

    /// Moves parking on: once quiet, the posted receive is taken back. Returns whether
    /// the connection is parked (quiet, nothing posted).
    pub(super) fn park_step(&mut self, r: &mut Reactor, idx: u32) -> bool {
        if !self.parking || !self.quiet() {
            return false;
        }
        let Wire::Tcp(s) = &mut self.wire else { return false };
        if s.recv_posted {
            if !s.recv_cancelled {
                s.recv_cancelled = true;
                let sqe = opcode::AsyncCancel::new(Op::Recv(idx).encode()).build().user_data(0);
                // SAFETY: a cancellation points at no memory.
                unsafe { r.ring.push(sqe) };
            }
            return false;
        }
        true
    }

    /// The bytes read and not acted on, in order: the capsules held while parking,
    /// then whatever the receive buffer has not parsed (the start of the next PDU).
    fn unread_input(s: &Stream) -> Vec<u8> {
        let mut input = s.held.clone();
        if let Some(buf) = &s.recv_buf {
            input.extend_from_slice(&buf.as_slice()[s.recv_start..s.recv_end]);
        }
        input
    }

    /// What a new engine process needs to serve this parked connection, its socket
    /// being descriptor `fd`; `None` for an RDMA connection, which cannot be handed on.
    pub(super) fn image(&self, reactor: usize, fd: usize) -> Option<ConnImage> {
        let Wire::Tcp(s) = &self.wire else { return None };
        Some(ConnImage {
            reactor,
            fd,
            port_id: self.port_id,
            tls: s.tls.as_deref().cloned(),
            ready: self.phase == Phase::Ready,
            header_digest: s.digests.header,
            data_digest: s.digests.data,
            input: Conn::unread_input(s),
            queue: self.queue.as_ref().map(|q| QueueImage {
                cntlid: q.controller.cntlid,
                qid: q.qid,
                sqsize: q.sqsize,
                sqhd: q.sqhd,
                flow_control_disabled: q.flow_control_disabled,
                authenticated: q.authenticated,
            }),
            aers: self.aers.clone(),
        })
    }

    /// Goes on serving after parking (or after a handover): the held commands and the
    /// partial PDU behind them are acted on, in order, then receiving starts again.
    pub(super) fn resume(&mut self, r: &mut Reactor, idx: u32) {
        if !self.parking {
            return;
        }
        let Wire::Tcp(s) = &mut self.wire else {
            self.parking = false;
            return;
        };
        if s.recv_posted {
            // The kernel may still write into the buffer: resume once the receive
            // is back (with data or cancelled).
            s.resume_after_recv = true;
            if !std::mem::replace(&mut s.recv_cancelled, true) {
                let sqe = opcode::AsyncCancel::new(Op::Recv(idx).encode()).build().user_data(0);
                // SAFETY: a cancellation points at no memory.
                unsafe { r.ring.push(sqe) };
            }
            return;
        }
        self.parking = false;
        s.recv_cancelled = false;
        let input = Conn::unread_input(s);
        s.held.clear();
        s.recv_start = 0;
        s.recv_end = 0;
        let mut rest = &input[..];
        while !rest.is_empty() && matches!(self.phase, Phase::Handshake | Phase::Ready) {
            let Wire::Tcp(s) = &mut self.wire else { break };
            let Some(buf) = s.recv_buf.as_mut() else { break };
            compact(buf.as_mut_slice(), &mut s.recv_start, &mut s.recv_end);
            let n = rest.len().min(buf.capacity() - s.recv_end);
            if n == 0 {
                // Cannot happen: the buffer holds the largest PDU, and whole PDUs are
                // consumed before more is copied in.
                break;
            }
            buf.as_mut_slice()[s.recv_end..s.recv_end + n].copy_from_slice(&rest[..n]);
            s.recv_end += n;
            rest = &rest[n..];
            self.parse_input(r, idx);
        }
        r.mark_dirty(idx);
    }

    /// The socket's descriptor; `None` on RDMA.
    pub(super) fn raw_fd(&self) -> Option<RawFd> {
        match &self.wire {
            Wire::Tcp(s) => Some(s.socket.as_raw_fd()),
            Wire::Rdma(_) => None,
        }
    }

    /// Records the socket's slot in the ring's registered-file table.
    pub(super) fn set_registered_file(&mut self, slot: u32) {
        if let Wire::Tcp(s) = &mut self.wire {
            s.registered_file = Some(slot);
        }
    }

    /// Takes the socket's slot in the ring's registered-file table, to free it.
    pub(super) fn take_registered_file(&mut self) -> Option<u32> {
        match &mut self.wire {
            Wire::Tcp(s) => s.registered_file.take(),
            Wire::Rdma(_) => None,
        }
    }

    /// A second descriptor of the socket, for another engine process.
    pub(super) fn dup_socket(&self) -> std::io::Result<TcpStream> {
        match &self.wire {
            Wire::Tcp(s) => s.socket.try_clone(),
            Wire::Rdma(_) => Err(std::io::Error::other("an RDMA connection has no socket")),
        }
    }

    /// The serial number of the RDMA connection, if it is one.
    pub(super) fn rdma_serial(&self) -> Option<u64> {
        match &self.wire {
            Wire::Rdma(w) => Some(w.serial),
            Wire::Tcp(_) => None,
        }
    }

    /// Whether the connection is closed and nothing references its memory any more.
    pub(super) fn can_free(&self) -> bool {
        self.phase == Phase::Closed && self.ops_in_flight == 0
    }

    /// Shuts the socket down (or disconnects the queue pair); outstanding operations
    /// complete with errors, after which the connection is freed.
    pub(super) fn begin_close(&mut self) {
        if self.phase != Phase::Closed {
            self.phase = Phase::Closed;
            match &mut self.wire {
                Wire::Tcp(s) => {
                    let _ = s.socket.shutdown(Shutdown::Both);
                }
                Wire::Rdma(w) => w.disconnect(),
            }
        }
    }

    /// Gives every buffer back and ends the queue's part in its controller.
    pub(super) fn release(&mut self, r: &mut Reactor) {
        let target = r.target.clone();
        for s in &mut self.slots {
            if let Some(b) = s.io.take_buf() {
                r.ring.pool.put(b);
            }
        }
        match &mut self.wire {
            Wire::Tcp(s) => {
                for item in s.out.drain(..) {
                    if let Payload::Pool(b, _) = item.payload {
                        r.ring.pool.put(b);
                    }
                }
            }
            Wire::Rdma(w) => w.release(r),
        }
        if let Some(q) = self.queue.take() {
            if !q.authenticated {
                tracing::warn!(
                    subsystem = q.controller.subsystem.nqn,
                    host = q.controller.hostnqn,
                    address = self.peer,
                    qid = q.qid,
                    "a queue closed without authenticating (DH-HMAC-CHAP): the host has no secret, or the wrong one"
                );
            }
            q.controller.release_queue(q.qid);
            if q.qid == 0 {
                // The admin queue is the association: without it the controller ends.
                q.controller.fail("admin queue closed");
                target.unregister_controller(q.controller.cntlid);
            }
        }
    }

    // ----- receive path -------------------------------------------------------------

    pub(super) fn post_recv(&mut self, r: &mut Reactor, idx: u32) {
        let Wire::Tcp(s) = &mut self.wire else { return };
        if s.recv_posted
            || !matches!(self.phase, Phase::Handshake | Phase::Ready)
            || s.out.len() >= MAX_OUT_BACKLOG
            // Parking reads only the data of commands already taken.
            || (self.parking && !self.slots.iter().any(|s| s.state == SlotState::AwaitingData))
        {
            return;
        }
        let Some(buf) = s.recv_buf.as_mut() else { return };
        if s.recv_start > 0 {
            // Keep the partial PDU at the front so the whole PDU always fits.
            compact(buf.as_mut_slice(), &mut s.recv_start, &mut s.recv_end);
        }
        let room = buf.capacity() - s.recv_end;
        let ptr = buf.as_mut_slice()[s.recv_end..].as_mut_ptr();
        let len = room as u32;
        let sqe = match s.registered_file {
            Some(i) => opcode::Recv::new(types::Fixed(i), ptr, len).build(),
            None => opcode::Recv::new(types::Fd(s.socket.as_raw_fd()), ptr, len).build(),
        };
        let sqe = sqe.user_data(Op::Recv(idx).encode());
        // SAFETY: the receive writes into `recv_buf` past `recv_end`, inside its length.
        // The mapping never moves or shrinks, and is taken out (not freed) while PDUs are parsed;
        // the connection is freed only once this operation has completed (see
        // `can_free`), and a receive is posted only when none is.
        unsafe { r.ring.push(sqe) };
        s.recv_posted = true;
        self.ops_in_flight += 1;
    }

    pub(super) fn on_recv(&mut self, r: &mut Reactor, idx: u32, res: i32) {
        let Wire::Tcp(s) = &mut self.wire else { return };
        self.ops_in_flight -= 1;
        s.recv_posted = false;
        if res == -libc::ECANCELED && self.parking {
            // Parking took the receive back before anything arrived.
        } else if res <= 0 {
            // 0: the host closed; negative: the socket failed or was shut down.
            self.begin_close();
            return;
        } else {
            s.recv_end += res as usize;
            self.parse_input(r, idx);
        }
        if let Wire::Tcp(s) = &mut self.wire
            && std::mem::take(&mut s.resume_after_recv)
        {
            self.resume(r, idx);
        }
    }

    /// Acts on every whole PDU in the receive buffer; a partial one stays at the front.
    fn parse_input(&mut self, r: &mut Reactor, idx: u32) {
        // The buffer is taken out so PDUs can borrow it while the connection changes.
        let Wire::Tcp(s) = &mut self.wire else { return };
        let Some(buf) = s.recv_buf.take() else { return };
        while matches!(self.phase, Phase::Handshake | Phase::Ready) {
            let Wire::Tcp(s) = &mut self.wire else { break };
            match tcp::parse(&buf.as_slice()[s.recv_start..s.recv_end], s.digests, RECV_LIMITS) {
                Ok(None) => break,
                Ok(Some(p)) if self.parking && matches!(p.pdu, Pdu::CapsuleCmd { .. } | Pdu::IcReq(_)) => {
                    // A parking connection takes no new command: the bytes wait for
                    // whichever process serves the connection next.
                    s.held.extend_from_slice(&buf.as_slice()[s.recv_start..s.recv_start + p.len]);
                    s.recv_start += p.len;
                }
                Ok(Some(p)) => {
                    s.recv_start += p.len;
                    self.on_pdu(r, idx, p.pdu, p.data_digest_ok);
                }
                Err(e) => {
                    let (start, end) = (s.recv_start, s.recv_end);
                    let bytes = buf.as_slice();
                    let hdr_end = (start + usize::from(bytes.get(start + 2).copied().unwrap_or(8))).min(end);
                    self.fatal(r, idx, e, &bytes[start..hdr_end.max(start)]);
                }
            }
        }
        if let Wire::Tcp(s) = &mut self.wire {
            s.recv_buf = Some(buf);
        }
        // The receive is posted again when the output is flushed, after the send, so
        // responses leave before the kernel arms the socket for the next request.
        r.mark_dirty(idx);
    }

    /// Sends a C2HTermReq and closes once it is out (on RDMA, which has no such
    /// message, closes).
    fn fatal(&mut self, r: &mut Reactor, idx: u32, e: FatalError, offending: &[u8]) {
        if let Wire::Rdma(_) = self.wire {
            tracing::warn!(address = self.peer, "closing the connection: {}", e.reason);
            return self.begin_close();
        }
        let mut pdu = [0u8; tcp::TERM_REQ_MAX];
        let len = tcp::encode_term_req(true, e.fes, e.fei, offending, &mut pdu);
        self.queue_whole_pdu(&pdu[..len]);
        self.phase = Phase::Draining;
        r.mark_dirty(idx);
    }

    fn sequence_error(&mut self, r: &mut Reactor, idx: u32, reason: &'static str) {
        self.fatal(r, idx, FatalError { fes: fes::PDU_SEQUENCE_ERROR, fei: 0, reason }, &[]);
    }

    fn on_pdu(&mut self, r: &mut Reactor, idx: u32, pdu: Pdu<'_>, digest_ok: bool) {
        match (self.phase, pdu) {
            (Phase::Handshake, Pdu::IcReq(req)) => {
                if req.pfv != 0 {
                    let e = FatalError {
                        fes: fes::UNSUPPORTED_PARAMETER,
                        fei: 8,
                        reason: "unsupported PDU format version",
                    };
                    return self.fatal(r, idx, e, &[]);
                }
                if req.hpda > 31 {
                    let e = FatalError { fes: fes::INVALID_HEADER_FIELD, fei: 10, reason: "HPDA out of range" };
                    return self.fatal(r, idx, e, &[]);
                }
                // Echo the host's digest choice: the Linux host refuses anything else.
                let resp = IcResp { pfv: 0, cpda: CPDA, digests: req.digests, maxdata: MAX_H2C_DATA };
                let mut pdu = [0u8; tcp::IC_SIZE];
                tcp::encode_ic_resp(&resp, &mut pdu);
                self.queue_whole_pdu(&pdu);
                if let Wire::Tcp(s) = &mut self.wire {
                    s.digests = req.digests;
                }
                self.phase = Phase::Ready;
            }
            (Phase::Handshake, _) => self.sequence_error(r, idx, "PDU before ICReq"),
            (_, Pdu::IcReq(_)) => self.sequence_error(r, idx, "second ICReq"),
            (_, Pdu::CapsuleCmd { command, data }) => self.on_command(r, idx, &command, data, digest_ok),
            (_, Pdu::H2CData { header, last, data }) => self.on_h2c_data(r, idx, header, last, data, digest_ok),
            (_, Pdu::TermReq { from_controller: false, .. }) => self.begin_close(),
            (_, _) => {
                let e = FatalError { fes: fes::INVALID_HEADER_FIELD, fei: 0, reason: "PDU type not valid from a host" };
                self.fatal(r, idx, e, &[]);
            }
        }
    }

    // ----- RDMA receive path --------------------------------------------------------

    /// A work request of the connection's queue pair completed.
    pub(super) fn on_rdma(&mut self, r: &mut Reactor, idx: u32, done: Done) {
        self.ops_in_flight -= 1;
        let Wire::Rdma(w) = &mut self.wire else { return };
        if let Work::Recv(i) = done.work {
            // A failed or flushed receive brought nothing.
            if done.ok && self.phase == Phase::Ready {
                self.on_capsule(r, idx, i, done.bytes as usize);
            }
        } else {
            // Every other kind held an entry of the send queue, free again.
            if let Some(b) = w.sent(done.work) {
                r.ring.pool.put(b);
            }
            if w.waiting() {
                // Work held back for a full send queue goes out now there is room.
                r.mark_dirty(idx);
            }
            match done.work {
                Work::Read(tag) if done.ok => self.on_data_read(r, idx, tag),
                Work::Prefetch(i) => {
                    let held = w.take_prefetched(i);
                    if let Some(p) = held {
                        if done.ok && self.phase == Phase::Ready {
                            self.on_prefetched(r, idx, &p);
                        }
                        r.ring.pool.put(p.buf);
                    }
                }
                Work::Send(_) | Work::Write(_) if done.ok && self.phase == Phase::Draining && w.idle() => {
                    self.begin_close()
                }
                _ => {}
            }
        }
        // A failed work request leaves the queue pair in error: nothing more goes through.
        if !done.ok {
            self.begin_close();
        }
    }

    /// A command capsule arrived in receive buffer `i`.
    fn on_capsule(&mut self, r: &mut Reactor, idx: u32, i: u32, len: usize) {
        let Wire::Rdma(w) = &mut self.wire else { return };
        let Some(capsules) = w.take_capsules() else { return };
        let bytes = RdmaWire::capsule(&capsules, i, len);
        let Some(sqe) = bytes.first_chunk::<SQE_SIZE>().copied() else {
            w.done_with(capsules, i);
            let e = FatalError { fes: 0, fei: 0, reason: "a capsule shorter than a command" };
            return self.fatal(r, idx, e, &[]);
        };
        let data = &bytes[SQE_SIZE..];
        let mut cmd = Command::decode(&sqe);
        let keyed = sqe[24..40].first_chunk::<16>().and_then(KeyedSgl::decode);
        if let Some(key) = keyed {
            w.remember_key(cmd.cid, key);
            // A keyed descriptor does on RDMA what a Transport Data Block does on TCP:
            // the data moves outside the capsule. The command runs with one, so the
            // checks see its length, and its data moves by READ or WRITE.
            cmd.dptr = SglDescriptor { address: 0, length: key.length, id: sgl::TRANSPORT };
            if data_before_running(&cmd) && key.length > 0 {
                let len = key.length as usize;
                if len > ADMIN_IN_CAPSULE_DATA {
                    w.done_with(capsules, i);
                    return self.refuse(r, idx, cmd.cid, Status::INVALID_FIELD.with_dnr());
                }
                let buf = r.ring.io_buf(len);
                let fetched = w.prefetch(cmd.cid, Prefetched { sqe, buf, len });
                w.done_with(capsules, i);
                if let Err(buf) = fetched {
                    r.ring.pool.put(buf);
                    return self.refuse(r, idx, cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR);
                }
                return r.mark_dirty(idx);
            }
        } else if cmd.dptr.id == sgl::TRANSPORT {
            // TCP's descriptor means nothing on RDMA.
            w.done_with(capsules, i);
            return self.refuse(r, idx, cmd.cid, Status::SGL_TYPE_INVALID.with_dnr());
        }
        self.on_command(r, idx, &cmd, data, true);
        if let Wire::Rdma(w) = &mut self.wire {
            w.done_with(capsules, i);
        }
        r.mark_dirty(idx);
    }

    /// Answers a command the transport refuses before it runs; it still left the
    /// submission queue.
    fn refuse(&mut self, r: &mut Reactor, idx: u32, cid: u16, status: Status) {
        self.took_command();
        self.respond(r, idx, cid, status, 0);
    }

    /// A command left the submission queue: its head moves on (the response says where).
    fn took_command(&mut self) {
        if let Some(q) = &mut self.queue {
            q.sqhd = if q.sqhd >= q.sqsize { 0 } else { q.sqhd + 1 };
        }
    }

    /// The data of a command that needs it to run arrived: the command runs as if
    /// the data had come in its capsule.
    fn on_prefetched(&mut self, r: &mut Reactor, idx: u32, p: &Prefetched) {
        let mut cmd = Command::decode(&p.sqe);
        cmd.dptr = SglDescriptor { address: 0, length: p.len as u32, id: sgl::IN_CAPSULE };
        self.on_command(r, idx, &cmd, &p.buf.as_slice()[..p.len], true);
        r.mark_dirty(idx);
    }

    // ----- commands -----------------------------------------------------------------

    fn on_command(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8], digest_ok: bool) {
        let fabrics = cmd.opcode == admin_opcode::FABRICS;
        let on_admin = self.queue.as_ref().is_none_or(|q| q.qid == 0);
        let limit = if fabrics || on_admin { ADMIN_IN_CAPSULE_DATA } else { IO_IN_CAPSULE_DATA };
        if data.len() > limit {
            let e = FatalError {
                fes: fes::DATA_LIMIT_EXCEEDED,
                fei: 0,
                reason: "in-capsule data exceeds the capsule size",
            };
            return self.fatal(r, idx, e, &[]);
        }
        self.took_command();
        if !digest_ok {
            return self.respond(r, idx, cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0);
        }
        if !cmd.has_fabrics_flags() {
            // A PRP data pointer has no meaning on a fabric; fused pairs are not served.
            return self.respond(r, idx, cmd.cid, Status::INVALID_FIELD.with_dnr(), 0);
        }
        if self.queue.is_none() {
            if fabrics && cmd.fctype() == fctype::CONNECT {
                return self.on_connect(r, idx, cmd, data);
            }
            return self.respond(r, idx, cmd.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0);
        }
        let (qid, dead, authenticated) =
            self.queue.as_ref().map_or((0, false, false), |q| (q.qid, q.controller.is_dead(), q.authenticated));
        if dead {
            // The association ended (keep-alive, admin queue gone, removal): this queue
            // must not serve another command.
            return self.begin_close();
        }
        if fabrics && matches!(cmd.fctype(), fctype::AUTH_SEND | fctype::AUTH_RECEIVE) {
            return self.on_auth(r, idx, cmd, data);
        }
        if !authenticated {
            // Logged when the queue closes, with the host's address.
            return self.respond(r, idx, cmd.cid, Status::AUTH_REQUIRED.with_dnr(), 0);
        }
        if qid == 0 {
            self.on_admin(r, idx, cmd);
        } else if fabrics {
            match cmd.fctype() {
                fctype::DISCONNECT => {
                    self.respond(r, idx, cmd.cid, Status::SUCCESS, 0);
                    self.phase = Phase::Draining;
                }
                fctype::CONNECT => self.respond(r, idx, cmd.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0),
                // Property Get/Set belong on the admin queue, as Linux nvmet and SPDK
                // answer too.
                _ => self.respond(r, idx, cmd.cid, Status::INVALID_OPCODE.with_dnr(), 0),
            }
        } else {
            self.on_io(r, idx, cmd, data);
        }
    }

    fn on_connect(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        let (tls, transport) = match &self.wire {
            Wire::Tcp(s) => (s.tls.as_deref(), Transport::Tcp),
            Wire::Rdma(_) => (None, Transport::Rdma),
        };
        match fabrics::connect(&r.target, cmd, data, tls, transport) {
            Ok(c) => {
                // Bit 17 of DW0 tells the host to authenticate before anything else.
                let result = u64::from(c.controller.cntlid)
                    | if c.auth_required { u64::from(nvpool_wire::auth::CONNECT_AUTH_REQUIRED) } else { 0 };
                let cattr = nvpool_wire::fabrics::ConnectCommand::from_command(cmd).cattr;
                let namespaces = c.controller.subsystem.namespaces();
                let generation = c.controller.subsystem.generation();
                // One slot per queue entry: commands that wait for data or the disk.
                let depth = usize::from(c.sqsize) + 1;
                self.slots = (0..depth).map(|_| Slot::free()).collect();
                self.free_slots = (0..depth as u16).rev().collect();
                self.queue = Some(Queue {
                    controller: c.controller,
                    qid: c.qid,
                    sqsize: c.sqsize,
                    sqhd: 1,
                    flow_control_disabled: cattr & CATTR_DISABLE_SQ_FLOW_CONTROL != 0,
                    namespaces,
                    generation,
                    authenticated: !c.auth_required,
                    auth: None,
                });
                self.respond(r, idx, cmd.cid, Status::SUCCESS, result);
            }
            Err(refused) => self.respond(r, idx, cmd.cid, refused.status, u64::from(refused.result)),
        }
    }

    /// Authentication Send or Receive, on any queue at any time: a host authenticates
    /// each queue after Connect, and again whenever it wants. Diffie-Hellman work runs
    /// on another thread, and the command completes when it is back (`on_auth_checked`).
    fn on_auth(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        let Some(q) = &mut self.queue else { return };
        let controller = q.controller.clone();
        if q.qid == 0 {
            // The host sends no Keep Alive before its admin queue authenticated: the
            // transaction's own messages keep the association alive meanwhile.
            controller.keep_alive(r.target.now_ms());
        }
        match auth::handle(&mut q.auth, &controller, cmd, data) {
            Handled::Now(answer) => self.auth_answer(r, idx, cmd.cid, answer),
            Handled::Later(job) => {
                // Held like a deferred disk command: the connection outlives the job.
                self.ops_in_flight += 1;
                let (links, reactor, cid) = (r.links.clone(), r.ring.id, cmd.cid);
                auth::run_off_reactor(move || {
                    let checked = job.run();
                    links[reactor].run(move |r| r.with_conn(idx, |r, c| c.on_auth_checked(r, idx, cid, checked)));
                });
            }
        }
    }

    /// The result of an authentication job: the Send that started it completes.
    pub(super) fn on_auth_checked(&mut self, r: &mut Reactor, idx: u32, cid: u16, checked: auth::Checked) {
        self.ops_in_flight -= 1;
        if self.phase == Phase::Closed {
            return;
        }
        let Some(q) = &mut self.queue else { return };
        let answer = auth::checked(&mut q.auth, checked);
        self.auth_answer(r, idx, cid, answer);
    }

    fn auth_answer(&mut self, r: &mut Reactor, idx: u32, cid: u16, answer: auth::Answer) {
        let Some(q) = &mut self.queue else { return };
        let controller = &q.controller;
        match answer.outcome {
            Outcome::Continues => {}
            Outcome::Authenticated => {
                q.authenticated = true;
                if q.qid == 0 {
                    tracing::info!(
                        subsystem = controller.subsystem.nqn,
                        host = controller.hostnqn,
                        cntlid = controller.cntlid,
                        "host authenticated (DH-HMAC-CHAP)"
                    );
                }
            }
            Outcome::Failed(why) => {
                q.authenticated = false;
                tracing::warn!(
                    subsystem = controller.subsystem.nqn,
                    host = controller.hostnqn,
                    address = self.peer,
                    qid = q.qid,
                    "DH-HMAC-CHAP authentication failed: {why}"
                );
            }
        }
        if let Some(d) = answer.data {
            self.send_data(r, cid, Payload::Owned(d), false);
        }
        self.respond(r, idx, cid, answer.status, 0);
    }

    fn on_admin(&mut self, r: &mut Reactor, idx: u32, cmd: &Command) {
        let Some(q) = &self.queue else { return };
        let controller = q.controller.clone();
        match admin::handle(&r.target, &controller, cmd, self.aers.len()) {
            AdminOutcome::ParkAsyncEvent => {
                self.aers.push(cmd.cid);
                self.deliver_events(r, idx);
            }
            AdminOutcome::Complete { status, result, data } => {
                // The handler checked the host's buffer: the data fills it exactly and
                // is within MDTS.
                if let Some(d) = data.filter(|d| !d.is_empty()) {
                    self.send_data(r, cmd.cid, Payload::Owned(d), false);
                }
                self.respond(r, idx, cmd.cid, status, result);
            }
        }
    }

    /// Completes outstanding Asynchronous Event Requests with pending events.
    fn deliver_events(&mut self, r: &mut Reactor, idx: u32) {
        let Some(q) = &self.queue else { return };
        let controller = q.controller.clone();
        while !self.aers.is_empty() {
            let Some(event) = controller.take_event() else {
                break;
            };
            let cid = self.aers.remove(0);
            self.respond(r, idx, cid, Status::SUCCESS, u64::from(event));
        }
    }

    /// Follows a change of the subsystem's namespaces. Free slots let go of the
    /// namespaces they kept, so a removed namespace is not held open by an idle queue.
    fn refresh_namespaces(&mut self) {
        if self.queue.as_mut().is_some_and(Queue::refresh) {
            for slot in self.slots.iter_mut().filter(|s| s.state == SlotState::Free) {
                slot.ns = None;
            }
        }
    }

    fn on_io(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        self.refresh_namespaces();
        let Some(q) = &self.queue else { return };
        let Some(ns) = q.namespaces.get(&cmd.nsid) else {
            return self.respond(r, idx, cmd.cid, Status::INVALID_NAMESPACE.with_dnr(), 0);
        };
        // A path the host should not use answers so that the host retries elsewhere.
        if let Some(status) = ana::io_status(q.controller.ana_state(ns.ana_group)) {
            return self.respond(r, idx, cmd.cid, status, 0);
        }
        let (plan, source) = match nvm::plan(ns, cmd, data.len()) {
            Ok(p) => p,
            Err(s) => {
                ns.stats.rejected(r.ring.id, s);
                return self.respond(r, idx, cmd.cid, s, 0);
            }
        };
        // Data a backend drops (null) is received and never copied.
        let keep_data = !matches!(plan, IoPlan::Write { .. }) || ns.backend.keeps_write_data();
        let host_len = plan.host_data_len() as usize;
        let Some(tag) = self.free_slots.pop() else {
            // More commands than the queue size the host connected with.
            return self.respond(r, idx, cmd.cid, Status::COMMAND_ID_CONFLICT.with_dnr(), 0);
        };
        let slot = &mut self.slots[usize::from(tag)];
        // A slot keeps its namespace after it is freed, so a queue doing I/O to one
        // namespace takes no reference (no atomic) per command.
        if !slot.ns.as_ref().is_some_and(|held| Arc::ptr_eq(held, ns)) {
            slot.ns = Some(ns.clone());
        }
        slot.cid = cmd.cid;
        slot.io.reset(plan, r.ring.pass_ns);
        ns.stats.started(r.ring.id);
        slot.received = 0;
        if host_len == 0 {
            return self.start_io(r, idx, tag);
        }
        let in_capsule = match source {
            Some(Source::InCapsule { offset }) => Some(&data[offset..offset + host_len]),
            _ => None,
        };
        if keep_data {
            let mut buf = r.ring.io_buf(host_len);
            if let Some(d) = in_capsule {
                buf.as_mut_slice()[..host_len].copy_from_slice(d);
            }
            slot.io.set_buf(buf);
        }
        if in_capsule.is_some() {
            slot.received = host_len as u32;
            return self.start_io(r, idx, tag);
        }
        slot.state = SlotState::AwaitingData;
        match &mut self.wire {
            Wire::Tcp(s) => {
                let h = DataHeader { cccid: cmd.cid, ttag: tag, offset: 0, length: host_len as u32 };
                let item = push_item(&mut s.out);
                item.header_len = tcp::encode_r2t(&h, s.digests, &mut item.header);
            }
            Wire::Rdma(w) => {
                // Data a backend drops is not fetched at all.
                let Some(buf) = slot.io.buf_mut() else {
                    slot.received = host_len as u32;
                    return self.start_io(r, idx, tag);
                };
                if !w.fetch(cmd.cid, Work::Read(tag), buf, host_len) {
                    slot.io.status = Status::SGL_TYPE_INVALID.with_dnr();
                    return self.finish(r, idx, tag);
                }
                r.mark_dirty(idx);
            }
        }
    }

    /// An RDMA READ of slot `tag`'s data completed.
    fn on_data_read(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let Some(slot) = self.slots.get_mut(usize::from(tag)).filter(|s| s.state == SlotState::AwaitingData) else {
            return;
        };
        slot.received = slot.io.plan.host_data_len();
        self.start_io(r, idx, tag);
    }

    fn on_h2c_data(&mut self, r: &mut Reactor, idx: u32, h: DataHeader, last: bool, data: &[u8], digest_ok: bool) {
        // A wrong field is named by its offset in the header, as SPDK does; Linux nvmet
        // drops the connection without a C2HTermReq.
        let header_error = |fei, reason| FatalError { fes: fes::INVALID_HEADER_FIELD, fei, reason };
        let Some(slot) = self.slots.get_mut(usize::from(h.ttag)).filter(|s| s.state == SlotState::AwaitingData) else {
            return self.fatal(r, idx, header_error(data_field::TTAG, "H2CData for no outstanding R2T"), &[]);
        };
        if slot.cid != h.cccid {
            return self.fatal(r, idx, header_error(data_field::CCCID, "H2CData CCCID is not the R2T's command"), &[]);
        }
        let total = slot.io.plan.host_data_len();
        // FEI names a field only for header field and parameter errors; for the others
        // it is reserved, so zero.
        let out_of_range = |reason| FatalError { fes: fes::DATA_OUT_OF_RANGE, fei: 0, reason };
        if h.offset != slot.received {
            return self.fatal(r, idx, out_of_range("H2CData offset is not where the data stands"), &[]);
        }
        if h.offset.checked_add(h.length).is_none_or(|end| end > total) {
            return self.fatal(r, idx, out_of_range("H2CData goes past the R2T"), &[]);
        }
        if let Some(b) = slot.io.data_mut() {
            b[h.offset as usize..(h.offset + h.length) as usize].copy_from_slice(data);
        }
        slot.received += h.length;
        if !digest_ok {
            slot.io.status = Status::TRANSIENT_TRANSPORT_ERROR;
        }
        if slot.received == total {
            if slot.io.status.is_success() {
                self.start_io(r, idx, h.ttag);
            } else {
                self.finish(r, idx, h.ttag);
            }
        } else if last {
            self.fatal(r, idx, out_of_range("last H2CData before the whole transfer"), &[]);
        }
    }

    /// Hands slot `tag`'s command, its data received, to the namespace's backend.
    fn start_io(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        let Some(ns) = slot.ns.as_ref() else { return };
        if let IoPlan::DatasetManagement { ranges, .. } = slot.io.plan
            && let Err(status) = nvm::check_dsm_ranges(ns, slot.io.data().unwrap_or_default(), ranges)
        {
            slot.io.status = status;
            return self.finish(r, idx, tag);
        }
        slot.state = SlotState::Backend;
        let mut queue = DiskQueue::new(&mut r.ring, idx, tag, self.wire.data_digest());
        ns.start(&mut slot.io, &mut queue);
        let queued = queue.queued();
        self.queued(r, idx, tag, queued);
    }

    /// Accounts for what a backend call queued (see `Reactor::disk_ops_queued`); with
    /// nothing in flight the command is done now.
    fn queued(&mut self, r: &mut Reactor, idx: u32, tag: u16, queued: Queued) {
        self.ops_in_flight += queued.ops + u32::from(queued.deferred);
        r.ring.disk_ops_queued(queued.ops, queued.on_device);
        if self.slots[usize::from(tag)].io.is_idle() {
            self.backend_done(r, idx, tag);
        }
    }

    /// The answer to slot `tag`'s command from wherever its backend handed it: the
    /// thread it deferred it to, or the owner of a remote namespace (which gives the
    /// command's buffer back with it).
    pub(super) fn on_resumed(&mut self, r: &mut Reactor, idx: u32, tag: u16, status: Status, buf: Option<Buf>) {
        self.ops_in_flight -= 1;
        let Some(slot) = self.slots.get_mut(usize::from(tag)) else { return };
        if let Some(b) = buf {
            slot.io.set_buf(b);
        }
        slot.io.deferred_done();
        let Some(ns) = slot.ns.as_ref() else { return };
        if self.phase == Phase::Closed {
            // Nobody waits for the answer, but the backend lets go of the command.
            if slot.io.is_idle() {
                ns.backend.finished(&mut slot.io, r.ring.id);
            }
            return;
        }
        let mut queue = DiskQueue::new(&mut r.ring, idx, tag, self.wire.data_digest());
        ns.resume(&mut slot.io, status, &mut queue);
        let queued = queue.queued();
        self.queued(r, idx, tag, queued);
    }

    pub(super) fn on_disk(&mut self, r: &mut Reactor, idx: u32, tag: u16, res: i32) {
        self.ops_in_flight -= 1;
        r.ring.disk_in_flight -= 1;
        let Some(slot) = self.slots.get_mut(usize::from(tag)) else {
            return;
        };
        if slot.io.op_done(res) && slot.io.is_idle() {
            self.backend_done(r, idx, tag);
        }
    }

    /// Slot `tag`'s command has nothing in flight any more: the backend lets go of what
    /// it held, and the command is answered.
    fn backend_done(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        if let Some(ns) = slot.ns.as_ref() {
            ns.backend.finished(&mut slot.io, r.ring.id);
        }
        if self.phase != Phase::Closed {
            self.finish(r, idx, tag);
        }
    }

    /// Completes slot `tag`: counts it, sends the data or the response, frees the slot.
    fn finish(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        let (cid, status, plan) = (slot.cid, slot.io.status, slot.io.plan);
        let buf = slot.io.take_buf();
        // The slot keeps its namespace for the next command (see `on_io`); a read
        // sent straight from the backend's memory holds its own reference until the
        // send is done.
        let mut mapped = None;
        if let Some(ns) = &slot.ns {
            ns.stats.completed(r.ring.id, &plan, status, r.ring.pass_ns.saturating_sub(slot.io.started_ns));
            if let (IoPlan::Read { offset, len }, true, None) = (plan, status.is_success(), &buf)
                && let Some(at) = ns.backend.mapped(offset, len as usize)
            {
                mapped = Some((at, ns.clone()));
            }
        }
        slot.state = SlotState::Free;
        self.free_slots.push(tag);
        match (plan, status.is_success()) {
            (IoPlan::Read { len, .. }, true) => {
                let len = len as usize;
                let payload = match (buf, mapped) {
                    (Some(b), _) => Payload::Pool(b, len),
                    // Only made without data digests, which would need the bytes here.
                    (None, Some((at, ns))) if !self.wire.data_digest() => Payload::Mapped { at, len, _namespace: ns },
                    _ => Payload::Zeroes(len),
                };
                let success = self.queue.as_ref().is_some_and(|q| q.flow_control_disabled);
                if !self.send_data(r, cid, payload, success) {
                    self.respond(r, idx, cid, Status::SUCCESS, 0);
                }
            }
            _ => {
                if let Some(b) = buf {
                    r.ring.pool.put(b);
                }
                self.respond(r, idx, cid, status, 0);
            }
        }
        r.mark_dirty(idx);
    }

    // ----- send path ----------------------------------------------------------------

    fn respond(&mut self, r: &mut Reactor, idx: u32, cid: u16, status: Status, result: u64) {
        let (sqhd, sqid) = self.queue.as_ref().map_or((0, 0), |q| (q.sqhd, q.qid));
        let c = Completion { result: result as u32, result_hi: (result >> 32) as u32, sqhd, sqid, cid, status };
        match &mut self.wire {
            Wire::Tcp(s) => {
                let item = push_item(&mut s.out);
                item.header_len = tcp::encode_capsule_resp(&c, s.digests, &mut item.header);
            }
            Wire::Rdma(w) => w.respond(&c),
        }
        r.mark_dirty(idx);
    }

    /// Queues a PDU larger than an item's inline header (ICResp, C2HTermReq) as an
    /// owned payload; these are rare, so the allocation does not matter.
    fn queue_whole_pdu(&mut self, pdu: &[u8]) {
        if let Wire::Tcp(s) = &mut self.wire {
            let mut item = new_item();
            item.payload = Payload::Owned(pdu.to_vec());
            s.out.push_back(item);
        }
    }

    /// Queues command `cid`'s data for the host: a C2HData PDU (whose SUCCESS flag,
    /// with `success`, stands for the response), or an RDMA WRITE. Returns whether the
    /// response went with the data. Inlined so the payload is written straight into
    /// the queued item (see `push_item`).
    #[inline(always)]
    fn send_data(&mut self, r: &mut Reactor, cid: u16, payload: Payload, success: bool) -> bool {
        match &mut self.wire {
            Wire::Tcp(s) => {
                let item = push_item(&mut s.out);
                item.payload = payload;
                let h = DataHeader { cccid: cid, ttag: 0, offset: 0, length: item.payload.len() as u32 };
                item.header_len = tcp::encode_c2h_data(&h, true, success, s.digests, &mut item.header);
                if s.digests.data {
                    item.digest = tcp::crc32c(payload_bytes(&item.payload, &r.ring.zeroes)).to_le_bytes();
                    item.digest_len = 4;
                }
                success
            }
            Wire::Rdma(w) => {
                // A WRITE needs registered memory: data that is not in a pool buffer is
                // copied into one.
                let len = payload.len();
                let buf = match payload {
                    Payload::Pool(b, _) => b,
                    other => {
                        let mut b = r.ring.io_buf(len.max(1));
                        let bytes = &mut b.as_mut_slice()[..len];
                        match &other {
                            Payload::Mapped { at, .. } => {
                                // SAFETY: the namespace (held by the payload) maps `len`
                                // bytes at `at` for as long as it lives.
                                bytes.copy_from_slice(unsafe { std::slice::from_raw_parts(*at, len) })
                            }
                            Payload::Zeroes(_) => bytes.fill(0),
                            p => bytes.copy_from_slice(payload_bytes(p, &r.ring.zeroes)),
                        }
                        b
                    }
                };
                if let Err(b) = w.send_data(cid, buf, len) {
                    // No key to write with, or memory the device cannot register: the
                    // connection cannot go on.
                    r.ring.pool.put(b);
                    self.begin_close();
                }
                false
            }
        }
    }

    pub(super) fn post_send(&mut self, r: &mut Reactor, idx: u32) {
        if self.phase == Phase::Closed {
            return;
        }
        let s = match &mut self.wire {
            Wire::Tcp(s) => s,
            Wire::Rdma(w) => {
                let (posted, result) = w.flush(idx);
                self.ops_in_flight += posted;
                if let Err(e) = result {
                    tracing::warn!(address = self.peer, "{e}");
                    self.begin_close();
                }
                return;
            }
        };
        if s.send_posted {
            return;
        }
        if s.sending == 0 {
            if s.out.is_empty() {
                if self.phase == Phase::Draining {
                    self.begin_close();
                }
                return;
            }
            s.sending = s.out.len().min(MAX_SEND_ITEMS);
            s.sent = 0;
            let area = &mut *s.send_area;
            for (i, item) in s.out.iter().take(s.sending).enumerate() {
                area.headers[i][..item.header_len].copy_from_slice(&item.header[..item.header_len]);
                area.digests[i] = item.digest;
            }
        }
        s.iov.clear();
        let mut skip = s.sent;
        for (i, item) in s.out.iter().take(s.sending).enumerate() {
            let payload = match &item.payload {
                Payload::Mapped { at, len, .. } => (*at, *len),
                p => {
                    let bytes = payload_bytes(p, &r.ring.zeroes);
                    (bytes.as_ptr(), bytes.len())
                }
            };
            let header = (s.send_area.headers[i].as_ptr(), item.header_len);
            let digest = (s.send_area.digests[i].as_ptr(), item.digest_len);
            for (at, len) in [header, payload, digest] {
                if skip >= len {
                    skip -= len;
                    continue;
                }
                // Pointer arithmetic only: the kernel reads the bytes, Rust never does.
                let rest = at.wrapping_add(skip);
                s.iov.push(libc::iovec { iov_base: rest as *mut libc::c_void, iov_len: len - skip });
                skip = 0;
            }
        }
        s.msg.msg_iov = s.iov.as_mut_ptr();
        s.msg.msg_iovlen = s.iov.len();
        let flags = libc::MSG_NOSIGNAL as u32;
        let sqe = match s.registered_file {
            Some(i) => opcode::SendMsg::new(types::Fixed(i), &s.msg).flags(flags).build(),
            None => opcode::SendMsg::new(types::Fd(s.socket.as_raw_fd()), &s.msg).flags(flags).build(),
        };
        let sqe = sqe.user_data(Op::Send(idx).encode());
        // SAFETY: the send reads `msg`, `iov` (never grown past its capacity), the
        // headers and digests in the boxed `send_area`, and the payloads of the first
        // `sending` items: pool buffers, owned vectors, the reactor's zeroes or a mapped
        // backend held by the item, all heap memory that stays put when the output
        // queue moves its items. None of them is changed or freed before this send
        // completes (`on_send` drains only sent items, and copies into `send_area` only
        // when no send is posted), and the connection outlives it (see `can_free`).
        unsafe { r.ring.push(sqe) };
        s.send_posted = true;
        self.ops_in_flight += 1;
    }

    pub(super) fn on_send(&mut self, r: &mut Reactor, idx: u32, res: i32) {
        let Wire::Tcp(s) = &mut self.wire else { return };
        self.ops_in_flight -= 1;
        s.send_posted = false;
        if res < 0 {
            self.begin_close();
            return;
        }
        s.sent += res as usize;
        let mut done = 0;
        for item in s.out.iter().take(s.sending) {
            if s.sent < item.len() {
                break;
            }
            s.sent -= item.len();
            done += 1;
        }
        s.sending -= done;
        if done > 0 && s.sending > 0 {
            // The batch goes on from its first unsent item, which is now the queue's
            // front: the copies of the headers and digests move to the front with it
            // (no send is posted now). Left in place, the rest of the batch would go
            // out under the headers of items already sent: other commands' IDs.
            let area = &mut *s.send_area;
            area.headers.copy_within(done..done + s.sending, 0);
            area.digests.copy_within(done..done + s.sending, 0);
        }
        for item in s.out.drain(..done) {
            if let Payload::Pool(b, _) = item.payload {
                r.ring.pool.put(b);
            }
        }
        self.post_send(r, idx);
        // Receiving may have stopped for a full output queue (see `MAX_OUT_BACKLOG`).
        self.post_recv(r, idx);
    }

    /// Periodic and on-demand checks: keep-alive, ended associations, handshakes that
    /// never finish, and events waiting for an Asynchronous Event Request.
    pub(super) fn check(&mut self, r: &mut Reactor, idx: u32, timers: bool) {
        if self.phase == Phase::Closed {
            return;
        }
        self.refresh_namespaces();
        let now = r.target.now_ms();
        match &self.queue {
            None if timers && now.saturating_sub(self.accepted_ms) > HANDSHAKE_TIMEOUT_MS => self.begin_close(),
            None => {}
            Some(q) => {
                if q.qid == 0 && timers && q.controller.keep_alive_expired(now) {
                    q.controller.fail("keep alive timeout");
                }
                if q.controller.is_dead() {
                    self.begin_close();
                } else if q.qid == 0 {
                    self.deliver_events(r, idx);
                }
            }
        }
    }
}

impl Wire {
    /// Whether data PDUs carry digests (never on RDMA).
    fn data_digest(&self) -> bool {
        matches!(self, Wire::Tcp(s) if s.digests.data)
    }
}

/// Whether a command takes its data before it runs: Connect and Authentication Send
/// are handled whole, so on RDMA their data is read first.
fn data_before_running(cmd: &Command) -> bool {
    cmd.opcode == admin_opcode::FABRICS && matches!(cmd.fctype(), fctype::CONNECT | fctype::AUTH_SEND)
}

/// Queues an empty item and returns it, to be filled in place. An item built on the
/// stack and moved in is written in small pieces and read back in wide ones, which
/// stalls store forwarding on every I/O.
fn push_item(out: &mut VecDeque<OutItem>) -> &mut OutItem {
    out.push_back(new_item());
    out.back_mut().expect("an item was just queued")
}

fn new_item() -> OutItem {
    OutItem { header: [0; MAX_OUT_HEADER], header_len: 0, payload: Payload::None, digest: [0; 4], digest_len: 0 }
}

/// The bytes of a payload Rust may read (for digests and sends); a mapped payload has
/// none: it is made only when no digest needs them, and sent by address.
fn payload_bytes<'a>(p: &'a Payload, zeroes: &'a [u8]) -> &'a [u8] {
    match p {
        Payload::None | Payload::Mapped { .. } => &[],
        Payload::Pool(b, n) => &b.as_slice()[..*n],
        Payload::Owned(v) => v,
        Payload::Zeroes(n) => &zeroes[..*n],
    }
}

/// A connection (one queue).
#[derive(Debug, Serialize, Deserialize)]
pub struct ConnImage {
    /// The reactor that served it.
    pub reactor: usize,
    /// Index of its socket.
    pub fd: usize,
    /// The listener that accepted it.
    pub port_id: Option<u16>,
    /// Who its TLS session proved the host to be (the kernel keeps the session itself
    /// with the socket).
    #[serde(default)]
    pub tls: Option<crate::tls::TlsPeer>,
    /// Whether ICReq was answered.
    pub ready: bool,
    /// Header digests.
    pub header_digest: bool,
    /// Data digests.
    pub data_digest: bool,
    /// Bytes read from the socket and not yet acted on: whole commands that arrived
    /// while the old engine stopped taking new ones, then the start of the next PDU.
    pub input: Vec<u8>,
    /// The queue, once Connect succeeded.
    pub queue: Option<QueueImage>,
    /// Command IDs of outstanding Asynchronous Event Requests (admin queue).
    pub aers: Vec<u16>,
}

/// A connection's queue.
#[derive(Debug, Serialize, Deserialize)]
pub struct QueueImage {
    /// Controller ID.
    pub cntlid: u16,
    /// Queue ID.
    pub qid: u16,
    /// Size (0's based).
    pub sqsize: u16,
    /// Submission queue head reported in completions.
    pub sqhd: u16,
    /// Whether the host disabled SQ flow control.
    pub flow_control_disabled: bool,
    /// Whether the queue may take commands other than authentication (an image from
    /// a build without authentication has every queue so).
    #[serde(default = "yes")]
    pub authenticated: bool,
}

fn yes() -> bool {
    true
}

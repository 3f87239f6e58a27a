//! NVMe/TCP (NVMe/TCP Transport Specification 1.0): a connection's PDUs on its
//! socket. Input is received into one buffer and parsed whole PDU by whole PDU; output
//! is queued as items (a PDU header, optional data, optional data digest) and sent in
//! batches with one `sendmsg` per batch, so many responses that became ready in one
//! reactor pass leave in one system call. Commands go to the lifecycle in `conn.rs`.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use io_uring::{opcode, types};
use nvpool_wire::Status;
use nvpool_wire::bytes::compact;
use nvpool_wire::command::Completion;
use nvpool_wire::tcp::{self, DataHeader, Digests, FatalError, IcResp, Pdu, data_field, fes};

use super::Reactor;
use super::conn::{Conn, ConnImage, Payload, Phase, Queue, QueueImage, Slot, SlotState, Wire, payload_bytes};
use crate::bufpool::{Buf, PAGE_SIZE};
use crate::nvme::{ADMIN_IN_CAPSULE_DATA, Controller, IO_IN_CAPSULE_DATA, MAX_H2C_DATA};
use crate::ring::{Op, Ring};
use crate::tls::TlsPeer;

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
/// Bytes of data read from a device past which a `sendmsg` takes no more items. The
/// kernel copies a send inline, holding the reactor inside `io_uring_enter` for as long
/// as the copy takes: a batch of twelve 128 KiB disk reads (1.5 MiB) kept it there for
/// up to 2.5 ms in a slow spell of this machine's loopback, while the commands the host
/// had sent back sat unparsed and the disk ran dry. Half a MiB hands the reactor back
/// within a few hundred microseconds even then (a quarter MiB did no better). Data from
/// RAM (a RAM namespace, a file in the page cache or on tmpfs) and zeroes have no device
/// waiting behind them, and there one large send costs less than several small ones:
/// capped at a quarter MiB, 128 KiB reads at depth 32 lost a third on the RAM namespace,
/// and at depth 128 a fifth on a volume on tmpfs.
const SEND_BATCH_BYTES: usize = 512 * 1024;
/// Output items queued past which the connection stops receiving until sends drain:
/// a host that sends commands but does not read its answers cannot grow the queue
/// without bound. A full queue of commands needs at most three items each.
const MAX_OUT_BACKLOG: usize = 1024;
/// Header room inline in an output item: a data, R2T or response PDU header with its
/// header digest (28 bytes). Every I/O builds and queues an item, so items stay small;
/// the rare larger PDUs (ICResp, C2HTermReq) are sent as owned payloads instead.
const MAX_OUT_HEADER: usize = 32;
pub(super) struct OutItem {
    pub(super) header: [u8; MAX_OUT_HEADER],
    pub(super) header_len: usize,
    pub(super) payload: Payload,
    pub(super) digest: [u8; 4],
    pub(super) digest_len: usize,
    /// Whether the payload is data a device read (see `SEND_BATCH_BYTES`).
    pub(super) from_device: bool,
}

impl OutItem {
    fn len(&self) -> usize {
        self.header_len + self.payload.len() + self.digest_len
    }
}

/// The bytes of a posted send that live in an output item itself (its PDU header and
/// data digest), copied out when the send is posted: the output queue may grow, and
/// so move its items, while the kernel still reads them.
struct SendArea {
    headers: [[u8; MAX_OUT_HEADER]; MAX_SEND_ITEMS],
    digests: [[u8; 4]; MAX_SEND_ITEMS],
}

/// The NVMe/TCP side of a connection.
pub(super) struct Stream {
    pub(super) socket: TcpStream,
    /// Who the connection's TLS session proved the host to be: its Connect must name
    /// that host and subsystem.
    pub(super) tls: Option<Box<TlsPeer>>,
    /// The socket's slot in the ring's registered-file table, if it has one: operations
    /// on a registered file skip the kernel's descriptor lookup and reference counting.
    pub(super) registered_file: Option<u32>,
    pub(super) digests: Digests,
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

/// What `Stream::post_send` did.
pub(super) enum Sending {
    /// A send is on its way (the connection counts it in flight).
    Posted,
    /// One was already on its way.
    Busy,
    /// Nothing was queued.
    Nothing,
}

impl Stream {
    pub(super) fn new(socket: TcpStream, tls: Option<Box<TlsPeer>>) -> Stream {
        Stream {
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
        }
    }

    /// Queues a CapsuleResp.
    pub(super) fn respond(&mut self, c: &Completion) {
        let item = push_item(&mut self.out);
        item.header_len = tcp::encode_capsule_resp(c, self.digests, &mut item.header);
    }

    /// Asks the host for command `cid`'s `len` bytes of data, for slot `tag` (R2T).
    pub(super) fn request_data(&mut self, cid: u16, tag: u16, len: u32) {
        let h = DataHeader { cccid: cid, ttag: tag, offset: 0, length: len };
        let item = push_item(&mut self.out);
        item.header_len = tcp::encode_r2t(&h, self.digests, &mut item.header);
    }

    /// Queues a C2HData PDU with `payload`; with `success` its SUCCESS flag stands for
    /// the response. Returns `success`. Inlined so the payload is written straight
    /// into the queued item (see `push_item`).
    #[inline(always)]
    pub(super) fn send_data(
        &mut self,
        cid: u16,
        payload: Payload,
        success: bool,
        from_device: bool,
        zeroes: &[u8],
    ) -> bool {
        let item = push_item(&mut self.out);
        item.payload = payload;
        item.from_device = from_device;
        let h = DataHeader { cccid: cid, ttag: 0, offset: 0, length: item.payload.len() as u32 };
        item.header_len = tcp::encode_c2h_data(&h, true, success, self.digests, &mut item.header);
        if self.digests.data {
            item.digest = tcp::crc32c(payload_bytes(&item.payload, zeroes)).to_le_bytes();
            item.digest_len = 4;
        }
        success
    }

    /// Queues a PDU larger than an item's inline header (ICResp, C2HTermReq) as an
    /// owned payload; these are rare, so the allocation does not matter.
    fn queue_whole_pdu(&mut self, pdu: &[u8]) {
        let mut item = new_item();
        item.payload = Payload::Owned(pdu.to_vec());
        self.out.push_back(item);
    }

    /// Queues the C2HTermReq that ends the connection for `e`.
    pub(super) fn queue_term_req(&mut self, e: &FatalError, offending: &[u8]) {
        let mut pdu = [0u8; tcp::TERM_REQ_MAX];
        let len = tcp::encode_term_req(true, e.fes, e.fei, offending, &mut pdu);
        self.queue_whole_pdu(&pdu[..len]);
    }

    /// Gives the buffers of queued output back.
    pub(super) fn release(&mut self, ring: &mut Ring) {
        for item in self.out.drain(..) {
            if let Payload::Pool(b, _) = item.payload {
                ring.pool.put(b);
            }
        }
    }

    /// Posts one `sendmsg` with the queued output (up to `MAX_SEND_ITEMS` items), or
    /// goes on with a partly sent batch.
    pub(super) fn post_send(&mut self, ring: &mut Ring, idx: u32) -> Sending {
        let s = self;
        if s.send_posted {
            return Sending::Busy;
        }
        if s.sending == 0 {
            if s.out.is_empty() {
                return Sending::Nothing;
            }
            s.sending = batch_len(&s.out);
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
                    let bytes = payload_bytes(p, &ring.zeroes);
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
        unsafe { ring.push(sqe) };
        s.send_posted = true;
        Sending::Posted
    }
}

impl Conn {
    pub(super) fn new(socket: TcpStream, now_ms: u64, port_id: Option<u16>, tls: Option<Box<TlsPeer>>) -> Conn {
        let peer = socket.peer_addr().map_or_else(|_| "a socket pair".to_string(), |a| a.to_string());
        let stream = Stream::new(socket, tls);
        Conn::on_wire(Wire::Tcp(stream), peer, now_ms, port_id, Phase::Handshake)
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

    /// Whether nothing is in flight but, perhaps, the posted receive.
    fn quiet(&self) -> bool {
        let Wire::Tcp(s) = &self.wire else { return false };
        matches!(self.phase, Phase::Handshake | Phase::Ready)
            && s.out.is_empty()
            && !s.send_posted
            && self.ops_in_flight == u32::from(s.recv_posted)
            && self.slots.iter().all(|s| s.state == SlotState::Free)
            && self.aborts.is_empty()
            && self.durable_waits.is_empty()
    }

    /// Moves parking on: once quiet, the posted receive is taken back. Returns whether
    /// the connection is parked (quiet, nothing posted).
    pub(super) fn park_step(&mut self, r: &mut Reactor, idx: u32) -> bool {
        // A Preempt and Abort taken before the pause completes before it.
        if !self.aborts.is_empty() {
            self.complete_aborts(r, idx);
        }
        if !self.durable_waits.is_empty() {
            self.complete_durable(r, idx);
        }
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
                if let Wire::Tcp(s) = &mut self.wire {
                    s.queue_whole_pdu(&pdu);
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
        let total = slot.expected;
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
            self.data_in(r, idx, h.ttag);
        } else if last {
            self.fatal(r, idx, out_of_range("last H2CData before the whole transfer"), &[]);
        }
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
}

/// How many items from the front of `out` one `sendmsg` takes: up to `MAX_SEND_ITEMS`,
/// and none past the one whose device data reaches `SEND_BATCH_BYTES`.
fn batch_len(out: &VecDeque<OutItem>) -> usize {
    let mut from_device = 0;
    let mut items = 0;
    for item in out.iter().take(MAX_SEND_ITEMS) {
        items += 1;
        if item.from_device {
            from_device += item.payload.len();
            if from_device >= SEND_BATCH_BYTES {
                break;
            }
        }
    }
    items
}

/// Queues an empty item and returns it, to be filled in place. An item built on the
/// stack and moved in is written in small pieces and read back in wide ones, which
/// stalls store forwarding on every I/O.
fn push_item(out: &mut VecDeque<OutItem>) -> &mut OutItem {
    out.push_back(new_item());
    out.back_mut().expect("an item was just queued")
}

fn new_item() -> OutItem {
    OutItem {
        header: [0; MAX_OUT_HEADER],
        header_len: 0,
        payload: Payload::None,
        digest: [0; 4],
        digest_len: 0,
        from_device: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(len: usize, from_device: bool) -> OutItem {
        let mut i = new_item();
        i.payload = Payload::Zeroes(len);
        i.from_device = from_device;
        i
    }

    #[test]
    fn a_send_stops_at_the_item_whose_device_data_reaches_the_cap() {
        let quarter = SEND_BATCH_BYTES / 4;
        let out: VecDeque<OutItem> = (0..8).map(|_| item(quarter, true)).collect();
        assert_eq!(batch_len(&out), 4);
        // Responses and data from RAM do not count toward the cap.
        let mut mixed: VecDeque<OutItem> = (0..8).map(|_| item(quarter, false)).collect();
        mixed.extend((0..8).map(|_| item(quarter, true)));
        assert_eq!(batch_len(&mixed), 12);
        let from_ram: VecDeque<OutItem> = (0..MAX_SEND_ITEMS + 5).map(|_| item(quarter, false)).collect();
        assert_eq!(batch_len(&from_ram), MAX_SEND_ITEMS);
        // One item larger than the cap still goes out.
        let large: VecDeque<OutItem> = [item(SEND_BATCH_BYTES * 2, true)].into_iter().collect();
        assert_eq!(batch_len(&large), 1);
    }
}

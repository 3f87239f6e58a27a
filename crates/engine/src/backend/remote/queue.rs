//! A reactor's I/O queue to the owner of a remote namespace: the host side of
//! NVMe/TCP, a client of the reactor's ring (`crate::ring::RingClient`). Commands are
//! handed to it with their buffer (write data out, read data in) and answered with
//! the owner's status and the buffer.
//!
//! The queue is connected by the link's connection thread and arrives by mail as a
//! socket ready for I/O. When it fails, the commands on it fail with ANA Inaccessible
//! (no Do Not Retry), a new queue is asked for, and commands wait for it up to
//! [`HOLD_MS`].
#![allow(unsafe_code)]

use std::any::Any;
use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;

use io_uring::{opcode, types};
use nvpool_wire::Status;
use nvpool_wire::bytes::compact;
use nvpool_wire::command::Completion;
use nvpool_wire::tcp::{self, DataHeader, Digests, Pdu};

use super::{HOLD_MS, QUEUE_DEPTH, RemoteLink, RemoteNamespace, RemoteSocket};
use crate::plan::MAX_TRANSFER;
use crate::ring::{Handed, Op, Ring, RingClient};

/// Receive buffer: a whole C2HData of the largest transfer with its headers, and room
/// to read ahead.
const RECV_BUF: usize = MAX_TRANSFER + 64 * 1024;
/// What the queue's operations are to it (`Op::Client`'s tag).
const RECV: u32 = 0;
const SEND: u32 = 1;

/// One reactor's I/O queue to one owner controller.
pub(super) struct HostQueue {
    link: Arc<RemoteLink>,
    socket: Option<TcpStream>,
    /// A failed queue's socket, shut down, kept open until its operations complete.
    closing: Option<TcpStream>,
    /// A queue that arrived while the old socket's operations were still in flight.
    next: Option<RemoteSocket>,
    /// Whether a queue was asked for and has not arrived.
    requested: bool,
    digests: Digests,
    max_h2c_data: u32,
    recv_buf: Vec<u8>,
    recv_start: usize,
    recv_end: usize,
    recv_posted: bool,
    /// Bytes to send next, and the bytes of the posted send (never touched while the
    /// kernel reads them).
    out: Vec<u8>,
    sending: Vec<u8>,
    sent: usize,
    send_posted: bool,
    ops_in_flight: u32,
    /// Sent commands by command ID.
    inflight: Vec<Option<Handed>>,
    free_cids: Vec<u16>,
    /// Commands waiting for a queue, or for a free command ID.
    waiting: VecDeque<Handed>,
}

impl HostQueue {
    pub(super) fn new(link: Arc<RemoteLink>) -> HostQueue {
        HostQueue {
            link,
            socket: None,
            closing: None,
            next: None,
            requested: false,
            digests: Digests::default(),
            max_h2c_data: 0,
            recv_buf: vec![0; RECV_BUF],
            recv_start: 0,
            recv_end: 0,
            recv_posted: false,
            out: Vec::with_capacity(256 * 1024),
            sending: Vec::with_capacity(256 * 1024),
            sent: 0,
            send_posted: false,
            ops_in_flight: 0,
            inflight: (0..QUEUE_DEPTH).map(|_| None).collect(),
            // A queue of N entries holds at most N - 1 commands.
            free_cids: (0..QUEUE_DEPTH - 1).rev().collect(),
            waiting: VecDeque::new(),
        }
    }

    /// Whether a queue is up.
    fn connected(&self) -> bool {
        self.socket.is_some()
    }

    fn ask_for_queue(&mut self, ring: &Ring) {
        if !self.requested && !self.link.is_closed() {
            self.requested = true;
            self.link.request_queue(ring.id, ring.mailer());
        }
    }

    /// A new queue from the connection thread.
    fn on_socket(&mut self, ring: &mut Ring, me: u32, s: RemoteSocket) {
        self.requested = false;
        if self.ops_in_flight > 0 {
            // The old socket's operations still point at the buffers: wait for them.
            self.next = Some(s);
            return;
        }
        self.install(ring, me, s);
    }

    fn install(&mut self, ring: &mut Ring, me: u32, s: RemoteSocket) {
        let _ = s.stream.set_nodelay(true);
        self.socket = Some(s.stream);
        self.digests = s.digests;
        self.max_h2c_data = s.max_h2c_data.max(4096);
        self.recv_start = 0;
        self.recv_end = 0;
        // Nothing of the old connection goes out on the new one: no send is posted.
        self.out.clear();
        self.sending.clear();
        self.sent = 0;
        self.post_recv(ring, me);
        self.send_waiting(ring, me);
    }

    /// Sends waiting commands while command IDs are free.
    fn send_waiting(&mut self, ring: &mut Ring, me: u32) {
        if !self.connected() {
            return;
        }
        while !self.waiting.is_empty() {
            let Some(cid) = self.free_cids.pop() else { break };
            let Some(f) = self.waiting.pop_front() else { break };
            let cmd = RemoteNamespace::from_route(f.route).command(&f.plan, cid, self.link.in_capsule);
            let data_len = cmd.dptr.length as usize;
            let in_capsule = data_len > 0 && cmd.dptr.id == nvpool_wire::command::sgl::IN_CAPSULE;
            let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
            let n = tcp::encode_capsule_cmd(&cmd, if in_capsule { data_len } else { 0 }, self.digests, &mut hdr);
            self.out.extend_from_slice(&hdr[..n]);
            if in_capsule {
                let data = f.buf.as_ref().map_or(&[][..], |b| &b.as_slice()[..data_len]);
                push_data(&mut self.out, self.digests, data);
            }
            self.inflight[usize::from(cid)] = Some(f);
        }
        self.post_send(ring, me);
    }

    fn post_recv(&mut self, ring: &mut Ring, me: u32) {
        let Some(socket) = &self.socket else { return };
        if self.recv_posted {
            return;
        }
        if self.recv_start > 0 {
            compact(&mut self.recv_buf, &mut self.recv_start, &mut self.recv_end);
        }
        let room = &mut self.recv_buf[self.recv_end..];
        let sqe = opcode::Recv::new(types::Fd(socket.as_raw_fd()), room.as_mut_ptr(), room.len() as u32)
            .build()
            .user_data(Op::Client(me, RECV).encode());
        // SAFETY: the receive writes into `recv_buf` past `recv_end`, inside its length;
        // the vector is never resized, and the queue (boxed in the ring's client table,
        // never ended while the reactor runs) keeps it until the completion is reaped: a
        // new socket is installed only once `ops_in_flight` is zero.
        unsafe { ring.push(sqe) };
        self.recv_posted = true;
        self.ops_in_flight += 1;
    }

    fn post_send(&mut self, ring: &mut Ring, me: u32) {
        let Some(socket) = &self.socket else { return };
        if self.send_posted {
            return;
        }
        if self.sent == self.sending.len() {
            if self.out.is_empty() {
                return;
            }
            std::mem::swap(&mut self.out, &mut self.sending);
            self.out.clear();
            self.sent = 0;
        }
        let rest = &self.sending[self.sent..];
        let sqe = opcode::Send::new(types::Fd(socket.as_raw_fd()), rest.as_ptr(), rest.len() as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(Op::Client(me, SEND).encode());
        // SAFETY: the send reads `sending` past `sent`; `sending` is neither written nor
        // resized while a send is posted (new bytes go to `out`), and it lives as long
        // as the queue, which outlives its operations (see `post_recv`).
        unsafe { ring.push(sqe) };
        self.send_posted = true;
        self.ops_in_flight += 1;
    }

    fn on_send(&mut self, ring: &mut Ring, me: u32, res: i32) {
        self.ops_in_flight -= 1;
        self.send_posted = false;
        if res < 0 || self.socket.is_none() {
            self.fail(ring, me);
            return;
        }
        self.sent += res as usize;
        self.post_send(ring, me);
    }

    fn on_recv(&mut self, ring: &mut Ring, me: u32, res: i32) {
        self.ops_in_flight -= 1;
        self.recv_posted = false;
        if res <= 0 || self.socket.is_none() {
            self.fail(ring, me);
            return;
        }
        self.recv_end += res as usize;
        let limits = tcp::DataLimits::uniform(MAX_TRANSFER as u32);
        loop {
            let parsed = match tcp::parse(&self.recv_buf[self.recv_start..self.recv_end], self.digests, limits) {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(link = self.link.id, "the owner sent a malformed PDU: {}", e.reason);
                    self.fail(ring, me);
                    return;
                }
            };
            let len = parsed.len;
            let ok = parsed.data_digest_ok;
            // The PDU borrows the receive buffer; what it says is copied out first.
            let event = match parsed.pdu {
                Pdu::CapsuleResp(c) => Event::Done(c),
                Pdu::C2HData { header, success, data, .. } => {
                    let cid = usize::from(header.cccid);
                    let landed = ok
                        && self.inflight.get_mut(cid).and_then(Option::as_mut).is_some_and(|f| {
                            let at = header.offset as usize;
                            f.buf
                                .as_mut()
                                .and_then(|b| b.as_mut_slice().get_mut(at..at + data.len()))
                                .map(|d| d.copy_from_slice(data))
                                .is_some()
                        });
                    if !landed {
                        Event::Broken("C2HData for no read, or out of its range")
                    } else if success {
                        Event::Done(Completion { cid: header.cccid, ..Completion::default() })
                    } else {
                        Event::Nothing
                    }
                }
                Pdu::R2T(h) => Event::Transfer(h),
                Pdu::TermReq { .. } => Event::Broken("the owner ended the connection (C2HTermReq)"),
                _ => Event::Broken("the owner sent a PDU a controller does not send"),
            };
            self.recv_start += len;
            match event {
                Event::Nothing => {}
                Event::Done(c) => self.complete(ring, me, c),
                Event::Transfer(h) => {
                    if !self.send_requested(h) {
                        self.fail(ring, me);
                        return;
                    }
                }
                Event::Broken(why) => {
                    tracing::warn!(link = self.link.id, "{why}");
                    self.fail(ring, me);
                    return;
                }
            }
        }
        self.post_send(ring, me);
        self.post_recv(ring, me);
    }

    /// Queues the H2CData PDUs an R2T asks for; false if it names no write.
    fn send_requested(&mut self, h: DataHeader) -> bool {
        let HostQueue { inflight, out, digests, max_h2c_data, .. } = self;
        let Some(Some(f)) = inflight.get(usize::from(h.cccid)) else { return false };
        let (start, end) = (h.offset as usize, h.offset as usize + h.length as usize);
        let Some(data) = f.buf.as_ref().and_then(|b| b.as_slice().get(start..end)) else { return false };
        for (i, piece) in data.chunks(*max_h2c_data as usize).enumerate() {
            let offset = start + i * *max_h2c_data as usize;
            let header = DataHeader { cccid: h.cccid, ttag: h.ttag, offset: offset as u32, length: piece.len() as u32 };
            let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
            let len = tcp::encode_h2c_data(&header, offset + piece.len() == end, *digests, &mut hdr);
            out.extend_from_slice(&hdr[..len]);
            push_data(out, *digests, piece);
        }
        true
    }

    fn complete(&mut self, ring: &mut Ring, me: u32, c: Completion) {
        let cid = c.cid;
        let Some(f) = self.inflight.get_mut(usize::from(cid)).and_then(Option::take) else {
            return;
        };
        self.free_cids.push(cid);
        ring.answer(f.owner, f.tag, c.status, f.buf);
        self.send_waiting(ring, me);
    }

    /// The queue failed: its commands fail with a path error, and a new queue is asked
    /// for once the old socket's operations are done.
    fn fail(&mut self, ring: &mut Ring, me: u32) {
        if let Some(s) = self.socket.take() {
            let _ = s.shutdown(Shutdown::Both);
            // The descriptor closes when the operations using it are done.
            self.closing = Some(s);
        }
        for cid in 0..self.inflight.len() {
            if let Some(f) = self.inflight[cid].take() {
                self.free_cids.push(cid as u16);
                ring.answer(f.owner, f.tag, Status::ANA_INACCESSIBLE, f.buf);
            }
        }
        if self.ops_in_flight == 0 {
            self.closing = None;
            if let Some(s) = self.next.take() {
                self.install(ring, me, s);
                return;
            }
        }
        if self.next.is_none() {
            self.ask_for_queue(ring);
        }
    }
}

impl RingClient for HostQueue {
    fn on_complete(&mut self, ring: &mut Ring, me: u32, tag: u32, res: i32, _flags: u32) {
        match tag {
            RECV => self.on_recv(ring, me, res),
            _ => self.on_send(ring, me, res),
        }
    }

    fn on_mail(&mut self, ring: &mut Ring, me: u32, message: Box<dyn Any + Send>) {
        if let Ok(socket) = message.downcast::<RemoteSocket>() {
            self.on_socket(ring, me, *socket);
        }
    }

    /// Takes a command; sends it now if the queue is up.
    fn take(&mut self, ring: &mut Ring, me: u32, cmd: Handed) {
        if !self.connected() && self.link.is_retired() {
            ring.answer(cmd.owner, cmd.tag, Status::ANA_INACCESSIBLE, cmd.buf);
            return;
        }
        self.waiting.push_back(cmd);
        if !self.connected() {
            self.ask_for_queue(ring);
        }
        self.send_waiting(ring, me);
    }

    /// Answers the commands `owner` handed that wait for a queue or a command ID
    /// (not sent): its host gave them up, and may write their blocks anew elsewhere.
    fn withdraw(&mut self, ring: &mut Ring, _me: u32, owner: u32) {
        let (gone, kept) = std::mem::take(&mut self.waiting).into_iter().partition(|c| c.owner == owner);
        self.waiting = kept;
        for c in gone {
            ring.answer(c.owner, c.tag, Status::ABORT_REQUESTED, c.buf);
        }
    }

    /// Fails commands that waited for a queue longer than the hold limit, and closes
    /// an idle queue whose namespace is gone.
    fn tick(&mut self, ring: &mut Ring, _me: u32) {
        let now_ms = ring.now_ms();
        if self.link.is_closed()
            && self.waiting.is_empty()
            && self.inflight.iter().all(Option::is_none)
            && let Some(s) = &self.socket
        {
            // Its operations complete with errors and `fail` lets go of it.
            let _ = s.shutdown(Shutdown::Both);
        }
        // Those of a retired link that has no queue wait for nothing.
        let retired = !self.connected() && self.link.is_retired();
        while self.waiting.front().is_some_and(|f| retired || now_ms.saturating_sub(f.since_ms) > HOLD_MS) {
            if let Some(f) = self.waiting.pop_front() {
                ring.answer(f.owner, f.tag, Status::ANA_INACCESSIBLE, f.buf);
            }
        }
    }
}

/// Appends a PDU's data and, if negotiated, its digest.
fn push_data(out: &mut Vec<u8>, digests: Digests, data: &[u8]) {
    out.extend_from_slice(data);
    if digests.data && !data.is_empty() {
        out.extend_from_slice(&tcp::crc32c(data).to_le_bytes());
    }
}

enum Event {
    Nothing,
    Done(Completion),
    Transfer(DataHeader),
    Broken(&'static str),
}

//! The RDMA wire of a connection (NVMe-oF 1.1 §7.3): command capsules arrive by
//! RECV, host data is fetched with RDMA READ, data for the host goes by RDMA WRITE and
//! responses by SEND, on the connection's queue pair. `conn.rs` runs the commands
//! exactly as it does for TCP; this module moves their bytes.
//!
//! Every queue pair of a reactor completes on the reactor's completion queue for its
//! device. The reactor polls those queues on each pass, and while it sleeps the queue's
//! completion channel wakes its ring (a poll on the channel's descriptor), so a
//! completion never crosses to another thread.
//!
//! Work requests are gathered during a pass and posted as one chain at its end, like
//! the TCP wire's one `sendmsg`: with soft-RoCE each post is a system call.
#![allow(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use nvpool_wire::command::{CQE_SIZE, Completion, SQE_SIZE};
use nvpool_wire::rdma::{ConnectRequest, KeyedSgl, encode_accept};
use rdma_mummy_sys::{
    ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wc, ibv_wc_status, ibv_wr_opcode,
    imm_data_invalidated_rkey_union_t, rdma_t,
};

use nvpool_wire::Status;
use nvpool_wire::command::{Command, SglDescriptor, admin_opcode, sgl};
use nvpool_wire::fabrics::fctype;
use nvpool_wire::tcp::FatalError;

use super::Reactor;
use super::conn::{Conn, Payload, Phase, SlotState, Wire, payload_bytes};
use crate::bufpool::{Buf, PAGE_SIZE};
use crate::nvme::{ADMIN_IN_CAPSULE_DATA, IO_IN_CAPSULE_DATA};
use crate::ring::Ring;
use crate::verbs::{CmId, CompletionQueue, Device};

/// A command capsule: the command and the largest in-capsule data (IOCCSZ).
const CAPSULE_SIZE: usize = SQE_SIZE + IO_IN_CAPSULE_DATA;
/// Completions a reactor's completion queue holds; queue pairs reserve their share.
const CQ_ENTRIES: u32 = 16384;
/// Completions taken per poll.
const POLL_BATCH: usize = 64;

/// What a work request was for, in its ID: kind in bits 63:56, connection slot in
/// bits 55:32, an index in bits 31:0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Work {
    /// A receive into capsule buffer `i`.
    Recv(u32),
    /// An RDMA READ of command slot `tag`'s data.
    Read(u16),
    /// An RDMA READ of the data of a command that needs it before it can run (Connect).
    Prefetch(u32),
    /// A SEND of the response in send slot `i`.
    Send(u32),
    /// An RDMA WRITE of the data held in send slot `i`.
    Write(u32),
}

impl Work {
    fn encode(self, conn: u32) -> u64 {
        let (kind, index) = match self {
            Work::Recv(i) => (1u64, i),
            Work::Read(tag) => (2, u32::from(tag)),
            Work::Prefetch(i) => (3, i),
            Work::Send(i) => (4, i),
            Work::Write(i) => (5, i),
        };
        kind << 56 | u64::from(conn & 0xFF_FFFF) << 32 | u64::from(index)
    }

    fn decode(v: u64) -> Option<(u32, Work)> {
        let conn = ((v >> 32) & 0xFF_FFFF) as u32;
        let index = v as u32;
        let work = match v >> 56 {
            1 => Work::Recv(index),
            2 => Work::Read(index as u16),
            3 => Work::Prefetch(index),
            4 => Work::Send(index),
            5 => Work::Write(index),
            _ => return None,
        };
        Some((conn, work))
    }
}

/// A completed work request, for the connection it belongs to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Done {
    pub work: Work,
    pub ok: bool,
    pub bytes: u32,
}

/// A reactor's completion queue for one device.
pub(super) struct ReactorCq {
    device: Arc<Device>,
    cq: CompletionQueue,
    /// Entries not yet reserved by a queue pair.
    room: u32,
}

/// The completion queues of a reactor, one per device, and what polling them found.
#[derive(Default)]
pub(super) struct ReactorRdma {
    cqs: Vec<ReactorCq>,
    wc: Vec<ibv_wc>,
}

impl ReactorRdma {
    /// Whether the reactor has any RDMA queue to poll.
    pub(super) fn active(&self) -> bool {
        !self.cqs.is_empty()
    }

    /// The completion queue for `device` with room for `entries` more, made (and its
    /// channel watched by the ring) on first use. Returns its index.
    fn reserve(r: &mut Reactor, device: &Arc<Device>, entries: u32) -> Result<usize, String> {
        if let Some(i) = r.rdma.cqs.iter().position(|c| Arc::ptr_eq(&c.device, device)) {
            let c = &mut r.rdma.cqs[i];
            if c.room < entries {
                return Err(format!("the reactor's completion queue is full ({CQ_ENTRIES} entries)"));
            }
            c.room -= entries;
            return Ok(i);
        }
        let mut cq = device.completion_queue(CQ_ENTRIES).map_err(|e| e.to_string())?;
        cq.rearm();
        r.rdma.cqs.push(ReactorCq { device: device.clone(), cq, room: CQ_ENTRIES - entries });
        let i = r.rdma.cqs.len() - 1;
        r.watch_rdma_cq(i);
        Ok(i)
    }

    /// The descriptor of completion queue `i`'s channel.
    pub(super) fn channel_fd(&self, i: usize) -> Option<i32> {
        self.cqs.get(i).map(|c| c.cq.fd())
    }

    /// Takes the channel's events and arms completion queue `i` again.
    pub(super) fn rearm(&mut self, i: usize) {
        if let Some(c) = self.cqs.get_mut(i) {
            c.cq.rearm();
        }
    }

    /// Polls every completion queue; returns the completions found, by connection.
    pub(super) fn poll(&mut self, found: &mut Vec<(u32, Done)>) {
        if self.wc.is_empty() {
            // SAFETY: ibv_wc is plain data; zeroed entries are overwritten by the poll.
            self.wc = vec![unsafe { std::mem::zeroed() }; POLL_BATCH];
        }
        for c in &mut self.cqs {
            loop {
                let n = c.cq.poll(&mut self.wc);
                for wc in &self.wc[..n] {
                    if let Some((conn, work)) = Work::decode(wc.wr_id) {
                        let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
                        found.push((conn, Done { work, ok, bytes: wc.byte_len }));
                    }
                }
                if n < self.wc.len() {
                    break;
                }
            }
        }
    }
}

/// `n` all-zero values.
///
/// # Safety
/// All-zero bytes must be a valid `T` (plain C data).
unsafe fn zeroed_vec<T>(n: u32) -> Vec<T> {
    // SAFETY: the caller answers for `T`.
    (0..n).map(|_| unsafe { std::mem::zeroed() }).collect()
}

/// Something to post at the end of the pass.
enum Outgoing {
    /// A response capsule, with the key to invalidate if the host asked.
    Response { cqe: [u8; CQE_SIZE], invalidate: Option<u32> },
    /// Data for the host.
    Write { buf: Buf, len: u32, remote: KeyedSgl },
    /// A read of the host's data into local memory.
    Read { work: Work, at: u64, key: u32, len: u32, remote: KeyedSgl },
}

/// A command whose data is fetched before it runs.
pub(super) struct Prefetched {
    pub sqe: [u8; SQE_SIZE],
    pub buf: Buf,
    pub len: usize,
}

/// A connect request handed to a reactor.
pub struct Incoming {
    /// The connection's identifier.
    pub id: CmId,
    /// Its device.
    pub device: Arc<Device>,
    /// The listener it came to.
    pub port_id: u16,
    /// What the host asked for.
    pub request: ConnectRequest,
    /// RDMA READs the host lets us have outstanding on the connection.
    pub initiator_depth: u8,
    /// RDMA READs the host wants to have outstanding on us (NVMe hosts make none).
    pub responder_resources: u8,
    /// The number its connection manager events carry: the reactor's index in the
    /// high 16 bits.
    pub serial: u64,
}

/// The RDMA side of a connection.
pub(super) struct RdmaWire {
    /// The queue pair and its identifier. First, so it is dropped first: once the queue
    /// pair is gone the device touches none of the buffers below.
    id: CmId,
    /// Its completion queue's index in the reactor.
    cq: usize,
    /// Entries of that queue this connection reserved.
    cq_entries: u32,
    device: Arc<Device>,
    /// The number connection manager events about it carry.
    pub(super) serial: u64,
    /// The host's address, for the log.
    pub(super) peer: String,
    /// The receive buffers, one capsule each; out of its place while a capsule is
    /// handled.
    capsules: Option<Buf>,
    capsule_key: u32,
    /// Receive buffers to post again at the end of the pass.
    repost: Vec<u32>,
    /// One response capsule per send slot.
    responses: Buf,
    response_key: u32,
    /// Per send slot: the data a WRITE in flight sends from.
    held: Vec<Option<Buf>>,
    free_slots: Vec<u32>,
    /// Send queue entries free.
    send_room: u32,
    queued: VecDeque<Outgoing>,
    /// The keyed descriptor of each command under way, by command ID.
    keys: HashMap<u16, KeyedSgl>,
    /// Commands waiting for the data a READ fetches before they run.
    prefetches: Vec<Option<Prefetched>>,
    /// Scratch for building a chain of work requests.
    wrs: Vec<ibv_send_wr>,
    sges: Vec<ibv_sge>,
    recv_wrs: Vec<ibv_recv_wr>,
    recv_sges: Vec<ibv_sge>,
}

impl RdmaWire {
    /// Makes the queue pair of a connect request on the reactor's completion queue,
    /// posts its receives and accepts. Refused before anything was posted, the request
    /// is rejected (`Err`). Otherwise returns the wire, the receives it posted (each
    /// completes once, flushed if the connection ends) and whether the accept went
    /// through: a wire whose accept failed is closed and freed like any other, once
    /// its receives came back.
    pub(super) fn accept(
        r: &mut Reactor,
        conn: u32,
        incoming: Incoming,
    ) -> Result<(RdmaWire, u32, Result<(), String>), String> {
        let Incoming { mut id, device, request, initiator_depth, responder_resources, serial, .. } = incoming;
        let entries = request.entries();
        // Each command may need a READ, a WRITE and a SEND at once.
        let send_wrs = (entries * 3 + 4).min(device.max_qp_wr);
        let recv_wrs = entries.min(device.max_qp_wr);
        let reject = |id: &CmId, e: String| {
            id.reject(&nvpool_wire::rdma::RejectReason::NoResources.encode());
            e
        };
        let cq = match ReactorRdma::reserve(r, &device, send_wrs + recv_wrs) {
            Ok(cq) => cq,
            Err(e) => return Err(reject(&id, e)),
        };
        let mut capsules = Buf::new((recv_wrs as usize * CAPSULE_SIZE).div_ceil(PAGE_SIZE));
        let mut responses = Buf::new((send_wrs as usize * CQE_SIZE).div_ceil(PAGE_SIZE));
        let made = capsules
            .rdma_key(&device)
            .and_then(|c| Ok((c, responses.rdma_key(&device)?)))
            .and_then(|keys| id.create_qp(&device, &r.rdma.cqs[cq].cq, send_wrs, recv_wrs).map(|()| keys));
        let (capsule_key, response_key) = match made {
            Ok(keys) => keys,
            Err(e) => {
                r.rdma.cqs[cq].room += send_wrs + recv_wrs;
                return Err(reject(&id, e.to_string()));
            }
        };
        let peer = id.peer().map_or_else(|| format!("RDMA connection {serial:#x}"), |a| format!("rdma:{a}"));
        let mut wire = RdmaWire {
            id,
            cq,
            cq_entries: send_wrs + recv_wrs,
            device: device.clone(),
            serial,
            peer,
            capsules: Some(capsules),
            capsule_key,
            repost: (0..recv_wrs).collect(),
            responses,
            response_key,
            held: (0..send_wrs).map(|_| None).collect(),
            free_slots: (0..send_wrs).rev().collect(),
            send_room: send_wrs,
            queued: VecDeque::with_capacity(send_wrs as usize),
            keys: HashMap::with_capacity(entries as usize),
            prefetches: Vec::new(),
            // SAFETY: work requests and scatter entries are plain C data; zeroed entries
            // are filled in before each use. The same holds for the three below.
            wrs: unsafe { zeroed_vec(send_wrs) },
            // SAFETY: as above.
            sges: unsafe { zeroed_vec(send_wrs) },
            // SAFETY: as above.
            recv_wrs: unsafe { zeroed_vec(recv_wrs) },
            // SAFETY: as above.
            recv_sges: unsafe { zeroed_vec(recv_wrs) },
        };
        // The receives are posted before the accept: the host sends Connect as soon as
        // the connection is up.
        let (posted, accepted) = match wire.post_receives(conn) {
            Ok(n) => {
                let accept = encode_accept(recv_wrs as u16);
                let depth = initiator_depth.min(device.max_qp_rd_atom);
                (n, wire.id.accept(&accept, responder_resources, depth).map_err(|e| e.to_string()))
            }
            Err((n, e)) => (n, Err(format!("cannot post receives: {e}"))),
        };
        Ok((wire, posted, accepted.map_err(|e| format!("cannot accept an RDMA connection: {e}"))))
    }

    /// Gives back the completion queue entries it reserved.
    pub(super) fn release(&mut self, r: &mut Reactor) {
        if let Some(c) = r.rdma.cqs.get_mut(self.cq) {
            c.room += self.cq_entries;
        }
        for b in self.held.iter_mut().filter_map(Option::take) {
            r.ring.pool.put(b);
        }
    }

    /// Starts tearing the connection down: everything posted completes, flushed.
    pub(super) fn disconnect(&mut self) {
        self.id.disconnect();
    }

    /// The receive buffers, taken out while a capsule in them is handled (the command
    /// may queue work on the wire meanwhile); put back with `done_with`.
    pub(super) fn take_capsules(&mut self) -> Option<Buf> {
        self.capsules.take()
    }

    /// Puts the capsule buffers back, buffer `i` to be posted again.
    pub(super) fn done_with(&mut self, capsules: Buf, i: u32) {
        self.capsules = Some(capsules);
        self.repost.push(i);
    }

    /// Capsule `i`'s bytes within the receive buffers.
    pub(super) fn capsule(capsules: &Buf, i: u32, len: usize) -> &[u8] {
        let at = i as usize * CAPSULE_SIZE;
        &capsules.as_slice()[at..at + len.min(CAPSULE_SIZE)]
    }

    /// Remembers a command's keyed descriptor until it is answered.
    pub(super) fn remember_key(&mut self, cid: u16, key: KeyedSgl) {
        self.keys.insert(cid, key);
    }

    /// Queues the response to command `cid`, invalidating its key if the host asked.
    pub(super) fn respond(&mut self, c: &Completion) {
        let mut cqe = [0u8; CQE_SIZE];
        c.encode(&mut cqe);
        let invalidate = self.keys.remove(&c.cid).filter(|k| k.invalidate).map(|k| k.key);
        self.queued.push_back(Outgoing::Response { cqe, invalidate });
    }

    /// Queues `len` bytes of `buf` for command `cid`'s buffer on the host; false if
    /// the command gave no keyed descriptor to write to.
    pub(super) fn send_data(&mut self, cid: u16, mut buf: Buf, len: usize) -> Result<(), Buf> {
        let Some(&remote) = self.keys.get(&cid) else { return Err(buf) };
        if buf.rdma_key(&self.device).is_err() {
            return Err(buf);
        }
        let len = (len as u32).min(remote.length);
        self.queued.push_back(Outgoing::Write { buf, len, remote });
        Ok(())
    }

    /// Queues a READ of command `cid`'s data into `buf`, for `work`.
    pub(super) fn fetch(&mut self, cid: u16, work: Work, buf: &mut Buf, len: usize) -> bool {
        let Some(&remote) = self.keys.get(&cid) else { return false };
        let Ok(key) = buf.rdma_key(&self.device) else { return false };
        let at = buf.as_mut_ptr() as u64;
        self.queued.push_back(Outgoing::Read { work, at, key, len: len as u32, remote });
        true
    }

    /// Holds a command until the READ of its data, queued here, completes; gives the
    /// buffer back if the READ cannot be made.
    pub(super) fn prefetch(&mut self, cid: u16, mut p: Prefetched) -> Result<(), Buf> {
        let i = self.prefetches.iter().position(Option::is_none).unwrap_or(self.prefetches.len());
        let len = p.len;
        if !self.fetch(cid, Work::Prefetch(i as u32), &mut p.buf, len) {
            return Err(p.buf);
        }
        if i == self.prefetches.len() {
            self.prefetches.push(None);
        }
        self.prefetches[i] = Some(p);
        Ok(())
    }

    /// The command held for READ `i`, now that it completed.
    pub(super) fn take_prefetched(&mut self, i: u32) -> Option<Prefetched> {
        self.prefetches.get_mut(i as usize).and_then(Option::take)
    }

    /// Whether work waits to be posted.
    pub(super) fn waiting(&self) -> bool {
        !self.queued.is_empty()
    }

    /// Whether nothing waits to be posted or completes on the send queue.
    pub(super) fn idle(&self) -> bool {
        self.queued.is_empty() && self.free_slots.len() == self.held.len()
    }

    /// A send-side work request (a SEND, WRITE or READ) completed: its send queue
    /// entry and slot are free again, and the data a WRITE sent from is returned.
    pub(super) fn sent(&mut self, work: Work) -> Option<Buf> {
        self.send_room += 1;
        match work {
            Work::Send(i) | Work::Write(i) => {
                self.free_slots.push(i);
                self.held.get_mut(i as usize).and_then(Option::take)
            }
            _ => None,
        }
    }

    /// Posts what the pass queued: the receives to repost, then as many sends, reads
    /// and writes as the send queue has room for. Returns how many were posted (each
    /// completes once), and whether the queue pair refused one.
    pub(super) fn flush(&mut self, conn: u32) -> (u32, Result<(), String>) {
        let mut posted = 0;
        match self.post_receives(conn) {
            Ok(n) => posted += n,
            Err((n, e)) => return (n, Err(format!("cannot post receives: {e}"))),
        }
        let mut n = 0;
        while n < self.wrs.len() && self.send_room > 0 {
            let Some(out) = self.queued.pop_front() else { break };
            let Some(slot) = self.free_slots.pop() else {
                self.queued.push_front(out);
                break;
            };
            let wr = &mut self.wrs[n];
            let sge = &mut self.sges[n];
            wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
            wr.num_sge = 1;
            wr.imm_data_invalidated_rkey_union = imm_data_invalidated_rkey_union_t { invalidated_rkey: 0 };
            match out {
                Outgoing::Response { cqe, invalidate } => {
                    let at = slot as usize * CQE_SIZE;
                    self.responses.as_mut_slice()[at..at + CQE_SIZE].copy_from_slice(&cqe);
                    *sge = ibv_sge {
                        addr: self.responses.as_mut_ptr() as u64 + at as u64,
                        length: CQE_SIZE as u32,
                        lkey: self.response_key,
                    };
                    wr.wr_id = Work::Send(slot).encode(conn);
                    wr.opcode = match invalidate {
                        Some(key) => {
                            wr.imm_data_invalidated_rkey_union =
                                imm_data_invalidated_rkey_union_t { invalidated_rkey: key };
                            ibv_wr_opcode::IBV_WR_SEND_WITH_INV
                        }
                        None => ibv_wr_opcode::IBV_WR_SEND,
                    };
                }
                Outgoing::Write { mut buf, len, remote } => {
                    let key = buf.rdma_key(&self.device).unwrap_or_default();
                    *sge = ibv_sge { addr: buf.as_mut_ptr() as u64, length: len, lkey: key };
                    wr.wr_id = Work::Write(slot).encode(conn);
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    wr.wr.rdma = rdma_t { remote_addr: remote.address, rkey: remote.key };
                    self.held[slot as usize] = Some(buf);
                }
                Outgoing::Read { work, at, key, len, remote } => {
                    // A read needs no send slot: its completion names its command.
                    self.free_slots.push(slot);
                    *sge = ibv_sge { addr: at, length: len, lkey: key };
                    wr.wr_id = work.encode(conn);
                    wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                    wr.wr.rdma = rdma_t { remote_addr: remote.address, rkey: remote.key };
                }
            }
            wr.sg_list = sge;
            n += 1;
            self.send_room -= 1;
        }
        if n > 0 {
            for i in 0..n - 1 {
                let next: *mut ibv_send_wr = &mut self.wrs[i + 1];
                self.wrs[i].next = next;
            }
            self.wrs[n - 1].next = std::ptr::null_mut();
            // SAFETY: the chain's scatter entries point at registered memory that lives
            // until the requests complete: the response slots (this connection's own
            // buffer), buffers held in `held` until their WRITE completes, and command
            // buffers held by their slots (or prefetches) until their READ completes.
            // The connection is freed only once everything posted completed.
            if let Err((sent, e)) = unsafe { self.id.post_send(&mut self.wrs[..n]) } {
                return (posted + sent as u32, Err(format!("cannot post to the queue pair: {e}")));
            }
            posted += n as u32;
        }
        (posted, Ok(()))
    }

    /// Posts the receives in `repost`; returns how many, or how many before the one
    /// refused and why.
    fn post_receives(&mut self, conn: u32) -> Result<u32, (u32, std::io::Error)> {
        let Some(capsules) = self.capsules.as_mut() else { return Ok(0) };
        let base = capsules.as_mut_ptr() as u64;
        let n = self.repost.len();
        for (k, &i) in self.repost.iter().enumerate() {
            self.recv_sges[k] = ibv_sge {
                addr: base + i as u64 * CAPSULE_SIZE as u64,
                length: CAPSULE_SIZE as u32,
                lkey: self.capsule_key,
            };
            let wr = &mut self.recv_wrs[k];
            wr.wr_id = Work::Recv(i).encode(conn);
            wr.sg_list = &mut self.recv_sges[k];
            wr.num_sge = 1;
        }
        for k in 0..n.saturating_sub(1) {
            let next: *mut ibv_recv_wr = &mut self.recv_wrs[k + 1];
            self.recv_wrs[k].next = next;
        }
        if n == 0 {
            return Ok(0);
        }
        self.recv_wrs[n - 1].next = std::ptr::null_mut();
        // SAFETY: each receive writes one capsule into the registered capsule buffer,
        // which lives (and stays registered) until the connection is freed, after every
        // posted receive completed.
        let posted = unsafe { self.id.post_recv(&mut self.recv_wrs[..n]) };
        self.repost.clear();
        posted.map(|()| n as u32).map_err(|(k, e)| (k as u32, e))
    }
}

// ----- a connection on RDMA: commands in, data fetched ------------------------------

impl Conn {
    /// A connection on an RDMA queue pair, accepted with `posted` receives.
    pub(super) fn rdma(wire: Box<RdmaWire>, posted: u32, now_ms: u64, port_id: u16) -> Conn {
        let peer = wire.peer.clone();
        let mut c = Conn::on_wire(Wire::Rdma(wire), peer, now_ms, Some(port_id), Phase::Ready);
        c.ops_in_flight = posted;
        c
    }

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
            if connects(&cmd) && self.queue.is_none() && key.length > 0 {
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

    /// The data of a command that needs it to run arrived: the command runs as if
    /// the data had come in its capsule.
    fn on_prefetched(&mut self, r: &mut Reactor, idx: u32, p: &Prefetched) {
        let mut cmd = Command::decode(&p.sqe);
        cmd.dptr = SglDescriptor { address: 0, length: p.len as u32, id: sgl::IN_CAPSULE };
        self.on_command(r, idx, &cmd, &p.buf.as_slice()[..p.len], true);
        r.mark_dirty(idx);
    }

    /// An RDMA READ of slot `tag`'s data completed.
    fn on_data_read(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let Some(slot) = self.slots.get_mut(usize::from(tag)).filter(|s| s.state == SlotState::AwaitingData) else {
            return;
        };
        slot.received = slot.expected;
        self.data_in(r, idx, tag);
    }

    /// Fetches slot `tag`'s `len` bytes of host data for command `cid` with an RDMA
    /// READ; data a backend drops is not fetched at all.
    pub(super) fn fetch_by_rdma_read(&mut self, r: &mut Reactor, idx: u32, tag: u16, cid: u16, len: usize) {
        let Wire::Rdma(w) = &mut self.wire else { return };
        let slot = &mut self.slots[usize::from(tag)];
        let Some(buf) = slot.io.buf_mut() else {
            slot.received = len as u32;
            return self.start_io(r, idx, tag);
        };
        if !w.fetch(cid, Work::Read(tag), buf, len) {
            slot.io.status = Status::SGL_TYPE_INVALID.with_dnr();
            return self.finish(r, idx, tag);
        }
        r.mark_dirty(idx);
    }
}

/// Whether a command is a Connect. Before Connect a queue has no slots to hold a
/// command while its data is read, so on RDMA a Connect's data is read first (every
/// later command with host data waits for it in a slot, as on TCP).
fn connects(cmd: &Command) -> bool {
    cmd.opcode == admin_opcode::FABRICS && cmd.fctype() == fctype::CONNECT
}

impl RdmaWire {
    /// Queues an RDMA WRITE of command `cid`'s data. A WRITE needs registered memory:
    /// data that is not in a pool buffer is copied into one. Returns false when it
    /// cannot be sent (no key to write with, or memory the device cannot register).
    pub(super) fn send_payload(&mut self, ring: &mut Ring, cid: u16, payload: Payload) -> bool {
        let len = payload.len();
        let buf = match payload {
            Payload::Pool(b, _) => b,
            other => {
                let mut b = ring.io_buf(len.max(1));
                let bytes = &mut b.as_mut_slice()[..len];
                match &other {
                    Payload::Mapped { at, .. } => {
                        // SAFETY: the namespace (held by the payload) maps `len` bytes
                        // at `at` for as long as it lives.
                        bytes.copy_from_slice(unsafe { std::slice::from_raw_parts(*at, len) })
                    }
                    Payload::Zeroes(_) => bytes.fill(0),
                    p => bytes.copy_from_slice(payload_bytes(p, &ring.zeroes)),
                }
                b
            }
        };
        match self.send_data(cid, buf, len) {
            Ok(()) => true,
            Err(b) => {
                ring.pool.put(b);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_request_ids_round_trip() {
        for (conn, work) in [
            (0, Work::Recv(0)),
            (0xFF_FFFF, Work::Recv(u32::MAX)),
            (7, Work::Read(0xFFFF)),
            (1, Work::Prefetch(3)),
            (2, Work::Send(4095)),
            (3, Work::Write(12)),
        ] {
            assert_eq!(Work::decode(work.encode(conn)), Some((conn, work)));
        }
        assert_eq!(Work::decode(0), None);
    }
}

//! A vhost-user-blk virtqueue on a reactor, a client of its ring
//! (`crate::ring::RingClient`). It reads the guest's kicks on the reactor's ring, takes each request the guest made available, serves it from the
//! namespace's backend (the same `BlockIo` and `DiskQueue` an NVMe command uses) and
//! puts it in the used ring, then signals the guest.
//!
//! Data is copied between guest memory and an engine buffer: a write's data before
//! the backend starts, a read's data once it is done. Every access to guest memory
//! goes through `vm-memory`, which checks it against the regions QEMU shared.
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;

use io_uring::{opcode, types};
use nvpool_wire::Status;
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory};

use super::vhost::Ring as VirtQueue;
use super::virtio_blk::{self, HEADER_SIZE, Header, ID_BYTES, SEGMENT_SIZE, Segment, request_type, status};
use crate::bufpool::Buf;
use crate::io::{BlockIo, DiskQueue};
use crate::nvme::Namespace;
use crate::plan::IoPlan;
use crate::ring::{CLIENT_OWNER, Op, Ring, RingClient};

/// The kick read's tag (`Op::Client`); disk operations use the request's head.
const KICK: u32 = u32::MAX;

/// One request the guest made available, from the descriptor chain at its head.
struct Request {
    io: BlockIo,
    active: bool,
    /// The request's data: (guest address, length) of each descriptor between the
    /// header and the status byte.
    data: Vec<(GuestAddress, u32)>,
    status: GuestAddress,
}

/// What a descriptor chain asks, once walked.
enum Parsed {
    /// A request to serve.
    Request { header: Header, data_len: u32 },
    /// A chain with a status byte that asks nothing the device serves.
    Unsupported,
    /// A chain with nowhere to put a status: completed with nothing written.
    Broken,
}

/// One virtqueue's run on this reactor.
pub struct VhostQueue {
    vq: Box<VirtQueue>,
    queue: Queue,
    /// The requests the last process left inflight, served first.
    pending: Vec<u16>,
    requests: Box<[Request]>,
    /// Where the kick eventfd's counter is read to.
    kick_buf: Box<[u8; 8]>,
    kick_armed: bool,
    /// Requests with the backend.
    serving: u32,
    /// Set when the session stops the queue: where to report the next available index.
    stopping: Option<Sender<u16>>,
    /// The namespace as last looked up, and the subsystem generation it is from.
    ns: Option<Arc<Namespace>>,
    generation: u64,
}

impl VhostQueue {
    /// Sets up the virtqueue `ring` describes; the requests the inflight region shows
    /// as taken and not completed come first, in the order they were taken.
    pub fn new(ring: Box<VirtQueue>) -> Result<VhostQueue, String> {
        let mut queue = Queue::new(ring.size).map_err(|e| format!("bad queue size {}: {e:?}", ring.size))?;
        queue.try_set_desc_table_address(GuestAddress(ring.desc)).map_err(|e| format!("descriptor table: {e:?}"))?;
        queue.try_set_avail_ring_address(GuestAddress(ring.avail)).map_err(|e| format!("available ring: {e:?}"))?;
        queue.try_set_used_ring_address(GuestAddress(ring.used)).map_err(|e| format!("used ring: {e:?}"))?;
        queue.set_ready(true);
        if !queue.is_valid(&*ring.memory) {
            return Err("the rings do not lie in guest memory".into());
        }
        let used = queue.used_idx(&*ring.memory, Ordering::Acquire).map_err(|e| format!("used ring: {e:?}"))?.0;
        let mut ring = ring;
        let pending = ring.inflight.as_mut().map(|i| i.recover(used)).unwrap_or_default();
        queue.set_next_used(used);
        // Every request taken is either in the used ring or still inflight.
        let next = if pending.is_empty() { ring.base } else { used.wrapping_add(pending.len() as u16) };
        queue.set_next_avail(next);
        let requests = (0..ring.size)
            .map(|_| Request {
                io: BlockIo::idle(),
                active: false,
                data: Vec::with_capacity(ring.geometry.max_segments() as usize),
                status: GuestAddress(0),
            })
            .collect();
        Ok(VhostQueue {
            vq: ring,
            queue,
            pending,
            requests,
            kick_buf: Box::new([0; 8]),
            kick_armed: false,
            serving: 0,
            stopping: None,
            ns: None,
            generation: u64::MAX,
        })
    }

    /// Serves the requests left inflight by the last process, then what the guest
    /// made available, and waits for kicks.
    fn serve(&mut self, ring: &mut Ring, me: u32) {
        let pending = std::mem::take(&mut self.pending);
        if !pending.is_empty() {
            tracing::info!(device = ?self.vq.device, queue = self.vq.index, requests = pending.len(),
                "serving again the requests the last engine process left inflight");
        }
        for head in pending {
            self.start(ring, me, head);
        }
        self.arm_kick(ring, me);
        self.drain(ring, me);
    }

    /// Stops taking requests; the queue ends once those under way are complete.
    fn stop_taking(&mut self, ring: &mut Ring, me: u32, done: Sender<u16>) {
        self.stopping = Some(done);
        if self.kick_armed {
            let sqe = opcode::AsyncCancel::new(Op::Client(me, KICK).encode()).build().user_data(0);
            // SAFETY: a cancellation points at no memory.
            unsafe { ring.push(sqe) };
        }
    }

    /// Reports where the queue stopped and gives its buffers back.
    fn release(&mut self, ring: &mut Ring) {
        for req in self.requests.iter_mut() {
            if let Some(b) = req.io.take_buf() {
                ring.pool.put(b);
            }
        }
        if let Some(done) = self.stopping.take() {
            let _ = done.send(self.queue.next_avail());
        }
    }

    fn arm_kick(&mut self, ring: &mut Ring, me: u32) {
        let sqe = opcode::Read::new(types::Fd(self.vq.kick.as_raw_fd()), self.kick_buf.as_mut_ptr(), 8)
            .build()
            .user_data(Op::Client(me, KICK).encode());
        // SAFETY: the read lands in `kick_buf`, a box this queue owns; the queue is
        // dropped only once the read completed (`ended` waits for it), and the ring is
        // dropped before the queues.
        unsafe { ring.push(sqe) };
        self.kick_armed = true;
    }

    /// The guest kicked (or the read was cancelled).
    fn on_kick(&mut self, ring: &mut Ring, me: u32, res: i32) {
        self.kick_armed = false;
        if self.stopping.is_some() {
            return;
        }
        if res < 0 && res != -libc::EINTR {
            let e = std::io::Error::from_raw_os_error(-res);
            tracing::warn!(device = ?self.vq.device, queue = self.vq.index, "cannot read a kick: {e}");
            return;
        }
        self.arm_kick(ring, me);
        self.drain(ring, me);
    }

    /// Takes every request the guest made available, unless a hot upgrade holds the
    /// reactor (the requests stay in the ring for the next process).
    fn drain(&mut self, ring: &mut Ring, me: u32) {
        if ring.held || self.stopping.is_some() {
            return;
        }
        let memory = self.vq.memory.clone();
        while let Some(chain) = self.queue.pop_descriptor_chain(&*memory) {
            let head = chain.head_index();
            if let Some(inflight) = self.vq.inflight.as_mut() {
                inflight.taken(head);
            }
            self.start(ring, me, head);
        }
    }

    /// Walks the chain at `head` into `req` and says what it asks.
    fn parse(&mut self, head: u16) -> Parsed {
        let memory = &*self.vq.memory;
        let size = self.vq.size;
        let req = &mut self.requests[usize::from(head)];
        req.data.clear();
        let mut header = None;
        let mut last: Option<Descriptor> = None;
        let mut index = head;
        for n in 0..size {
            let at = GuestAddress(self.vq.desc).checked_add(16 * u64::from(index));
            let Some(d) = at.and_then(|a| memory.read_obj::<Descriptor>(a).ok()) else { return Parsed::Broken };
            if d.refers_to_indirect_table() {
                // Not offered, so a guest that sends one is broken.
                return Parsed::Broken;
            }
            if n == 0 {
                let mut h = [0u8; HEADER_SIZE];
                if d.is_write_only() || d.len() < HEADER_SIZE as u32 || memory.read_slice(&mut h, d.addr()).is_err() {
                    return Parsed::Broken;
                }
                header = Some(Header::decode(&h));
            } else if let Some(prev) = last.replace(d) {
                // Every descriptor but the first and the last carries data.
                if req.data.len() == req.data.capacity() {
                    return Parsed::Unsupported;
                }
                req.data.push((prev.addr(), prev.len()));
            }
            if !d.has_next() {
                break;
            }
            index = d.next();
            if index >= size {
                return Parsed::Broken;
            }
        }
        let (Some(header), Some(status_desc)) = (header, last) else { return Parsed::Broken };
        if !status_desc.is_write_only() || status_desc.len() < 1 {
            return Parsed::Broken;
        }
        req.status = status_desc.addr();
        let data_len: u64 = req.data.iter().map(|&(_, len)| u64::from(len)).sum();
        match u32::try_from(data_len) {
            Ok(data_len) => Parsed::Request { header, data_len },
            Err(_) => Parsed::Unsupported,
        }
    }

    /// The namespace now, looked up again only when the subsystem changed.
    fn namespace(&mut self) -> Option<Arc<Namespace>> {
        let device = &self.vq.device;
        let g = device.subsystem.generation();
        if g != self.generation {
            self.generation = g;
            self.ns = device.subsystem.namespaces().get(&device.nsid).cloned();
        }
        self.ns.clone()
    }

    /// Serves the request at `head`.
    fn start(&mut self, ring: &mut Ring, me: u32, head: u16) {
        let Some(req) = self.requests.get(usize::from(head)) else { return };
        if req.active {
            tracing::warn!(device = ?self.vq.device, head, "the guest made a request available twice");
            return;
        }
        self.serving += 1;
        self.requests[usize::from(head)].active = true;
        let (header, data_len) = match self.parse(head) {
            Parsed::Request { header, data_len } => (header, data_len),
            Parsed::Unsupported => return self.complete(head, status::UNSUPP, 0),
            Parsed::Broken => return self.complete_broken(head),
        };
        let memory = self.vq.memory.clone();
        let geometry = self.vq.geometry;
        let ns = self.namespace();
        let req = &mut self.requests[usize::from(head)];
        if header.kind == request_type::GET_ID {
            let id = virtio_blk::serial(&self.vq.device.target());
            let ok = req
                .data
                .first()
                .is_some_and(|&(a, len)| len as usize >= ID_BYTES && memory.write_slice(&id, a).is_ok());
            return if ok {
                self.complete(head, status::OK, ID_BYTES as u32)
            } else {
                self.complete(head, status::UNSUPP, 0)
            };
        }
        let Some(ns) = ns else { return self.complete(head, status::IOERR, 0) };
        let segment = match header.kind {
            request_type::DISCARD | request_type::WRITE_ZEROES => req.data.first().and_then(|&(a, len)| {
                let mut b = [0u8; SEGMENT_SIZE];
                (len as usize >= SEGMENT_SIZE && memory.read_slice(&mut b, a).is_ok()).then(|| Segment::decode(&b))
            }),
            _ => None,
        };
        let Some(plan) = virtio_blk::plan(&geometry, header.kind, header.sector, data_len, segment) else {
            ns.stats.rejected(ring.id, Status::INVALID_FIELD);
            return self.complete(head, status::UNSUPP, 0);
        };
        req.io.reset(plan, ring.pass_ns);
        ns.stats.started(ring.id);
        match plan {
            IoPlan::Write { len, .. } => {
                let mut buf = ring.io_buf(len as usize);
                if gather(&*memory, &req.data, &mut buf).is_err() {
                    ring.pool.put(buf);
                    return self.complete(head, status::IOERR, 0);
                }
                req.io.set_buf(buf);
            }
            IoPlan::DatasetManagement { .. } => {
                let mut buf = ring.io_buf(SEGMENT_SIZE);
                if let Some(s) = segment {
                    virtio_blk::discard_range(&s, geometry.block_shift, buf.as_mut_slice());
                }
                req.io.set_buf(buf);
            }
            _ => {}
        }
        // Reads land in the request's buffer, where they are copied to the guest from.
        let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, head, true);
        ns.start(&mut req.io, &mut queue);
        queue.finish();
        if req.io.is_idle() {
            self.backend_done(ring, me, head);
        }
    }

    /// A disk operation of the request at `head` completed.
    fn disk_done(&mut self, ring: &mut Ring, me: u32, head: u16, res: i32) {
        let Some(req) = self.requests.get_mut(usize::from(head)) else { return };
        if req.io.op_done(res) && req.io.is_idle() {
            self.backend_done(ring, me, head);
        }
    }

    /// The thread or owner the request at `head` was handed to answered.
    fn answered(&mut self, ring: &mut Ring, me: u32, head: u16, status: Status, buf: Option<Buf>) {
        let Some(req) = self.requests.get_mut(usize::from(head)) else { return };
        if let Some(b) = buf {
            req.io.set_buf(b);
        }
        req.io.deferred_done();
        let Some(ns) = self.ns.as_deref() else { return };
        let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, head, true);
        ns.resume(&mut req.io, status, &mut queue);
        queue.finish();
        if req.io.is_idle() {
            self.backend_done(ring, me, head);
        }
    }

    /// The request at `head` has nothing in flight: the backend lets go, a read's data
    /// goes to the guest, and the request completes.
    fn backend_done(&mut self, ring: &mut Ring, me: u32, head: u16) {
        let memory = self.vq.memory.clone();
        let req = &mut self.requests[usize::from(head)];
        if let Some(ns) = &self.ns {
            let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, head, true);
            ns.backend.settle(&mut req.io, &mut queue);
            queue.finish();
            if !req.io.is_idle() {
                return;
            }
        }
        let (plan, ok) = (req.io.plan, req.io.status.is_success());
        if let Some(ns) = &self.ns {
            ns.backend.finished(&mut req.io, ring.id);
            ns.stats.completed(ring.id, &plan, req.io.status, ring.pass_ns.saturating_sub(req.io.started_ns));
        }
        let buf = req.io.take_buf();
        let mut written = 0;
        let mut outcome = if ok { status::OK } else { status::IOERR };
        if let (IoPlan::Read { len, .. }, true) = (plan, ok) {
            match buf.as_ref().map(|b| scatter(&*memory, &req.data, &b.as_slice()[..len as usize])) {
                Some(Ok(())) => written = len,
                _ => outcome = status::IOERR,
            }
        }
        if let Some(b) = buf {
            ring.pool.put(b);
        }
        self.complete(head, outcome, written);
    }

    /// Writes the status byte and puts `head` in the used ring with `written` data
    /// bytes (plus the status byte), then signals the guest.
    fn complete(&mut self, head: u16, outcome: u8, written: u32) {
        let status_at = self.requests[usize::from(head)].status;
        // A status the guest's memory cannot take is the guest's own loss.
        let _ = self.vq.memory.write_obj(outcome, status_at);
        self.publish(head, written + 1);
    }

    /// Completes a chain that has nowhere to put a status.
    fn complete_broken(&mut self, head: u16) {
        tracing::warn!(device = ?self.vq.device, head, "a malformed request: completed without a status");
        self.publish(head, 0);
    }

    fn publish(&mut self, head: u16, used_len: u32) {
        let memory = self.vq.memory.clone();
        self.requests[usize::from(head)].active = false;
        self.serving -= 1;
        if let Some(i) = self.vq.inflight.as_ref() {
            i.completing(head);
        }
        if self.queue.add_used(&*memory, head, used_len).is_err() {
            tracing::warn!(device = ?self.vq.device, head, "cannot write the used ring");
            return;
        }
        if let Some(i) = self.vq.inflight.as_ref() {
            i.completed(head, self.queue.next_used());
        }
        let fd = self.vq.call.fd();
        if fd >= 0 {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local u64 to the call eventfd; the session
            // keeps every call file of a running queue open (see `Call`).
            unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
        }
    }
}

/// What the session asks of a running virtqueue (mail to its ring client): stop taking
/// requests, finish those under way, then report the next available index.
pub struct Stop(pub Sender<u16>);

impl RingClient for VhostQueue {
    fn begin(&mut self, ring: &mut Ring, me: u32) {
        self.serve(ring, me);
    }

    fn on_complete(&mut self, ring: &mut Ring, me: u32, _tag: u32, res: i32, _flags: u32) {
        self.on_kick(ring, me, res);
    }

    fn on_disk(&mut self, ring: &mut Ring, me: u32, tag: u16, res: i32) {
        self.disk_done(ring, me, tag, res);
    }

    fn on_answer(&mut self, ring: &mut Ring, me: u32, tag: u16, status: Status, buf: Option<Buf>) {
        self.answered(ring, me, tag, status, buf);
    }

    fn on_mail(&mut self, ring: &mut Ring, me: u32, message: Box<dyn std::any::Any + Send>) {
        if let Ok(stop) = message.downcast::<Stop>() {
            self.stop_taking(ring, me, stop.0);
        }
    }

    /// While held, `drain` takes no request: those with the backend finish.
    fn parked(&self) -> bool {
        self.serving == 0
    }

    fn resume(&mut self, ring: &mut Ring, me: u32) {
        self.drain(ring, me);
    }

    /// Stopped, and nothing of it left on the ring.
    fn ended(&self) -> bool {
        self.stopping.is_some() && !self.kick_armed && self.serving == 0
    }

    fn finish(mut self: Box<Self>, ring: &mut Ring) {
        self.release(ring);
    }
}

/// Copies a write's data from guest memory into `buf`.
fn gather<M: GuestMemory>(memory: &M, data: &[(GuestAddress, u32)], buf: &mut Buf) -> Result<(), ()> {
    let mut at = 0usize;
    let bytes = buf.as_mut_slice();
    for &(a, len) in data {
        let end = at + len as usize;
        memory.read_slice(bytes.get_mut(at..end).ok_or(())?, a).map_err(|_| ())?;
        at = end;
    }
    Ok(())
}

/// Copies a read's data into the guest's buffers.
fn scatter<M: GuestMemory>(memory: &M, data: &[(GuestAddress, u32)], bytes: &[u8]) -> Result<(), ()> {
    let mut at = 0usize;
    for &(a, len) in data {
        let end = at + len as usize;
        memory.write_slice(bytes.get(at..end).ok_or(())?, a).map_err(|_| ())?;
        at = end;
    }
    Ok(())
}

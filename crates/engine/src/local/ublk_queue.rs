//! A ublk device's queue on a reactor, a client of its ring
//! (`crate::ring::RingClient`): it fetches every tag of its ublk queue with
//! `URING_CMD`s on the reactor's ring, serves each request the driver delivers
//! from the namespace's backend (the same `BlockIo` and `DiskQueue` an NVMe command
//! uses), and commits the result with the command that fetches the tag again.
//!
//! Each tag owns a buffer for good: the driver copies a write's data into it before
//! it delivers the request, and a read's data out of it when the result is committed.
//! While a tag's command is with the driver, its buffer belongs to the kernel; Rust
//! touches it only between delivery and commit.
//!
//! With zero copy (a file namespace on a driver with `AUTO_BUF_REG`), each tag also
//! owns a slot of the ring's buffer table: the driver puts the request's own pages
//! there before delivery and takes them out at commit, and the backend's reads and
//! writes use the slot directly. The tag's buffer then only carries discard ranges.
#![allow(unsafe_code)]

use std::os::fd::AsRawFd;
use std::sync::Arc;

use io_uring::{opcode, types};
use nvpool_wire::Status;

use super::LocalDevice;
use super::request;
use super::uapi::{self, IO_DESC_SIZE, IoCmd, IoDesc, op};
use crate::bufpool::{Buf, PAGE_SIZE};
use crate::io::{BlockIo, DiskQueue};
use crate::nvme::Namespace;
use crate::plan::IoPlan;
use crate::ring::{CLIENT_OWNER, Op, Ring, RingClient};

/// Where a tag stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TagState {
    /// Its fetch (or commit and fetch) is with the driver.
    Fetching,
    /// A request arrived while a hot upgrade holds the reactor: not started. If this
    /// process exits with it, the driver issues it again to the next one.
    Held,
    /// Its request is with the backend.
    Serving,
    /// The driver ended it: the device is stopping.
    Ended,
}

struct Tag {
    io: BlockIo,
    /// The tag's buffer while the tag is not serving (then `io` has it).
    buf: Option<Buf>,
    state: TagState,
}

/// One device's queue on this reactor.
pub struct UblkQueue {
    device: Arc<LocalDevice>,
    queue: u16,
    /// The driver's descriptors of this queue's requests, mapped read-only.
    descriptors: *const u8,
    descriptors_len: usize,
    tags: Box<[Tag]>,
    /// The namespace as last looked up, and the subsystem generation it is from.
    ns: Option<Arc<Namespace>>,
    generation: u64,
    /// Tags whose command is with the driver.
    with_driver: u32,
    /// Tags whose request is with the backend.
    serving: u32,
    /// With zero copy: the buffer-table slot of tag 0 (tag `t` has `first + t`).
    zero_copy_slots: Option<u16>,
}

impl UblkQueue {
    /// Maps queue `queue`'s descriptors of `device` and gives each tag a buffer.
    pub fn new(ring: &mut Ring, device: Arc<LocalDevice>, queue: u16) -> Result<UblkQueue, String> {
        let len = uapi::descriptors_len(device.depth, PAGE_SIZE);
        let offset = uapi::descriptors_offset(queue, PAGE_SIZE);
        // SAFETY: maps `len` bytes of the char device read-only and shared at the offset
        // the driver gives this queue; the result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                device.char_dev.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(format!("cannot map the descriptors of queue {queue} of /dev/ublkc{}: {e}", device.dev_id));
        }
        let zero_copy_slots = if device.zero_copy {
            let Some(first) = ring.reserve_zero_copy_slots(u32::from(device.depth)) else {
                // SAFETY: unmaps the mapping made above, which nothing else uses.
                unsafe { libc::munmap(ptr, len) };
                return Err(format!("no room in the reactor's buffer table for {} zero-copy tags", device.depth));
            };
            Some(first)
        } else {
            None
        };
        // Under zero copy the data stays in the request's pages: a tag's buffer only
        // carries a discard's range.
        let buf_len = if device.zero_copy { PAGE_SIZE } else { device.max_io_bytes as usize };
        let tags = (0..device.depth)
            .map(|_| Tag { io: BlockIo::idle(), buf: Some(ring.io_buf(buf_len)), state: TagState::Ended })
            .collect();
        Ok(UblkQueue {
            device,
            queue,
            descriptors: ptr.cast(),
            descriptors_len: len,
            tags,
            ns: None,
            generation: u64::MAX,
            with_driver: 0,
            serving: 0,
            zero_copy_slots,
        })
    }

    /// Sends tag `tag`'s command with its buffer: a fetch, or a commit of `result`.
    fn send(&mut self, ring: &mut Ring, me: u32, tag: u16, cmd_op: u32, result: i32) {
        let zero_copy_slot = self.zero_copy_slots.map(|first| first + tag);
        let t = &mut self.tags[usize::from(tag)];
        let Some(buf) = t.buf.as_mut() else { return };
        // Under zero copy the driver copies nothing: the command names the slot where
        // it puts the request's pages instead of a buffer.
        let buf_addr = if zero_copy_slot.is_some() { 0 } else { buf.as_mut_ptr() as u64 };
        let cmd = IoCmd { queue: self.queue, tag, result, buf_addr };
        let mut command =
            opcode::UringCmd16::new(types::Fd(self.device.char_dev.as_raw_fd()), cmd_op).cmd(cmd.encode());
        if let Some(s) = zero_copy_slot {
            command = command.addr(Some(uapi::auto_buf_reg(s)));
        }
        let sqe = command.build().user_data(Op::Client(me, u32::from(tag)).encode());
        // SAFETY: the command points at the tag's buffer (or, under zero copy, at no
        // memory of ours), which stays in `t.buf` (Rust leaves it alone) until the
        // command's completion is reaped, and which is never freed while a command
        // may be with the driver (see `Drop`). The ring is dropped before the queues.
        unsafe { ring.push(sqe) };
        t.state = TagState::Fetching;
        self.with_driver += 1;
    }

    /// Tag `tag`'s command completed: a request arrived, or the device is stopping.
    fn command_done(&mut self, ring: &mut Ring, me: u32, tag: u16, res: i32) {
        let Some(t) = self.tags.get_mut(usize::from(tag)) else { return };
        self.with_driver = self.with_driver.saturating_sub(1);
        if res != 0 {
            if res != uapi::IO_RES_ABORT {
                let e = std::io::Error::from_raw_os_error(-res);
                tracing::warn!(device = ?self.device, tag, "a ublk command failed: {e}");
            }
            t.state = TagState::Ended;
            return;
        }
        if ring.held {
            t.state = TagState::Held;
        } else {
            self.start(ring, me, tag);
        }
    }

    /// Starts the requests held during a hot upgrade that was called off.
    fn start_held(&mut self, ring: &mut Ring, me: u32) {
        for tag in 0..self.device.depth {
            if self.tags[usize::from(tag)].state == TagState::Held {
                self.start(ring, me, tag);
            }
        }
    }

    fn descriptor(&self, tag: u16) -> IoDesc {
        let at = usize::from(tag) * IO_DESC_SIZE;
        debug_assert!(at + IO_DESC_SIZE <= self.descriptors_len);
        // SAFETY: tag < depth, so the descriptor lies inside the mapping; the driver
        // wrote it before it completed the tag's command, which was reaped.
        let bytes = unsafe { std::ptr::read_volatile(self.descriptors.add(at).cast::<[u8; IO_DESC_SIZE]>()) };
        IoDesc::decode(&bytes)
    }

    /// The namespace now, looked up again only when the subsystem changed.
    fn namespace(&mut self) -> Option<Arc<Namespace>> {
        let g = self.device.subsystem.generation();
        if g != self.generation {
            self.generation = g;
            self.ns = self.device.subsystem.namespaces().get(&self.device.nsid).cloned();
        }
        self.ns.clone()
    }

    /// Hands tag `tag`'s request to the namespace's backend.
    fn start(&mut self, ring: &mut Ring, me: u32, tag: u16) {
        let desc = self.descriptor(tag);
        let ns = self.namespace();
        let t = &mut self.tags[usize::from(tag)];
        t.state = TagState::Serving;
        self.serving += 1;
        let Some(ns) = ns else {
            return self.commit(ring, me, tag, -libc::EIO);
        };
        let plan = match request::plan(&desc, ns.block_shift, ns.blocks << ns.block_shift, self.device.read_only) {
            Ok(p) => p,
            Err(errno) => {
                ns.stats.rejected(ring.id, Status::INVALID_FIELD);
                return self.commit(ring, me, tag, -errno);
            }
        };
        t.io.reset(plan, ring.pass_ns);
        ns.stats.started(ring.id);
        match (self.zero_copy_slots, plan) {
            (Some(first), IoPlan::Read { len, .. } | IoPlan::Write { len, .. }) => {
                t.io.set_kernel_buf(first + tag, len)
            }
            _ => {
                if let Some(mut buf) = t.buf.take() {
                    if desc.op == op::DISCARD {
                        request::discard_range(&desc, ns.block_shift, buf.as_mut_slice());
                    }
                    t.io.set_buf(buf);
                }
            }
        }
        // Reads land in the tag's buffer, where the driver takes them from.
        let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, tag, true);
        ns.start(&mut t.io, &mut queue);
        queue.finish();
        if t.io.is_idle() {
            self.backend_done(ring, me, tag);
        }
    }

    /// A disk operation of tag `tag`'s request completed.
    fn disk_done(&mut self, ring: &mut Ring, me: u32, tag: u16, res: i32) {
        let Some(t) = self.tags.get_mut(usize::from(tag)) else { return };
        if t.io.op_done(res) && t.io.is_idle() {
            self.backend_done(ring, me, tag);
        }
    }

    /// The thread or owner tag `tag`'s request was handed to answered.
    fn answered(&mut self, ring: &mut Ring, me: u32, tag: u16, status: Status, buf: Option<Buf>) {
        let Some(t) = self.tags.get_mut(usize::from(tag)) else { return };
        if let Some(b) = buf {
            t.io.set_buf(b);
        }
        t.io.deferred_done();
        let Some(ns) = self.ns.as_deref() else { return };
        let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, tag, true);
        ns.resume(&mut t.io, status, &mut queue);
        queue.finish();
        if t.io.is_idle() {
            self.backend_done(ring, me, tag);
        }
    }

    /// Tag `tag`'s request has nothing in flight: the backend lets go, and the result
    /// goes to the driver.
    fn backend_done(&mut self, ring: &mut Ring, me: u32, tag: u16) {
        let t = &mut self.tags[usize::from(tag)];
        if let Some(ns) = &self.ns {
            let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, tag, true);
            ns.backend.settle(&mut t.io, &mut queue);
            queue.finish();
            if !t.io.is_idle() {
                return;
            }
        }
        let (plan, status) = (t.io.plan, t.io.status);
        if let Some(ns) = &self.ns {
            ns.backend.finished(&mut t.io, ring.id);
            ns.stats.completed(ring.id, &plan, status, ring.pass_ns.saturating_sub(t.io.started_ns));
        }
        self.commit(ring, me, tag, request::result(&plan, status.is_success()));
    }

    /// Commits `result` for tag `tag` and fetches it again.
    fn commit(&mut self, ring: &mut Ring, me: u32, tag: u16, result: i32) {
        let t = &mut self.tags[usize::from(tag)];
        if let Some(b) = t.io.take_buf() {
            t.buf = Some(b);
        }
        self.serving -= 1;
        self.send(ring, me, tag, uapi::io::COMMIT_AND_FETCH_REQ, result);
    }

    /// Gives the tags' buffers back to the reactor's pool once the driver has none.
    fn release(&mut self, ring: &mut Ring) {
        if let Some(first) = self.zero_copy_slots.take() {
            ring.release_zero_copy_slots(first);
        }
        for t in self.tags.iter_mut() {
            if let Some(b) = t.buf.take().or_else(|| t.io.take_buf()) {
                ring.pool.put(b);
            }
        }
    }
}

impl RingClient for UblkQueue {
    /// Gives every tag to the driver.
    fn begin(&mut self, ring: &mut Ring, me: u32) {
        for tag in 0..self.device.depth {
            self.send(ring, me, tag, uapi::io::FETCH_REQ, 0);
        }
    }

    fn on_complete(&mut self, ring: &mut Ring, me: u32, tag: u32, res: i32, _flags: u32) {
        self.command_done(ring, me, tag as u16, res);
    }

    fn on_disk(&mut self, ring: &mut Ring, me: u32, tag: u16, res: i32) {
        self.disk_done(ring, me, tag, res);
    }

    fn on_answer(&mut self, ring: &mut Ring, me: u32, tag: u16, status: Status, buf: Option<Buf>) {
        self.answered(ring, me, tag, status, buf);
    }

    /// Requests that arrive while the reactor is held stay unstarted (`command_done`);
    /// those with the backend finish.
    fn parked(&self) -> bool {
        self.serving == 0
    }

    fn resume(&mut self, ring: &mut Ring, me: u32) {
        self.start_held(ring, me);
    }

    /// The driver ended every tag (the device stopped).
    fn ended(&self) -> bool {
        self.with_driver == 0 && self.serving == 0 && self.tags.iter().all(|t| t.state == TagState::Ended)
    }

    fn finish(mut self: Box<Self>, ring: &mut Ring) {
        let device = self.device.clone();
        self.release(ring);
        device.queue_ended();
    }
}

impl Drop for UblkQueue {
    fn drop(&mut self) {
        if self.with_driver > 0 {
            // The driver may still copy into these buffers: never give them back.
            for t in self.tags.iter_mut() {
                if let Some(b) = t.buf.take() {
                    std::mem::forget(b);
                }
            }
        }
        // SAFETY: unmaps exactly the mapping `new` made; nothing reads it after this.
        unsafe { libc::munmap(self.descriptors.cast_mut().cast(), self.descriptors_len) };
    }
}

//! The seam between whoever issues a block command (a connection, a local device's
//! queue) and the backends: one command's I/O state ([`BlockIo`]) and the queue its disk
//! operations go on ([`DiskQueue`]), on the reactor's ring.
//!
//! This is the only place disk submission entries are built. Each one points into the
//! command's own buffer, so the rule that makes them sound lives here too: a
//! [`BlockIo`] counts the operations it has in flight, hands out its buffer only while
//! that count is zero, and never frees a buffer the kernel may still be writing or
//! reading (dropped early, it leaks it instead). Backends build operations from byte
//! offsets into that buffer, never from slices of it, because slicing a buffer
//! mutably while the kernel writes other parts of it would alias.
#![allow(unsafe_code)]

use io_uring::{opcode, types};
use nvpool_wire::Status;

use std::sync::Arc;

use crate::bufpool::Buf;
use crate::disk::DiskFd;
use crate::granules::Granules;
use crate::plan::IoPlan;
use crate::qos::Qos;
use crate::ring::{Handed, Mail, Op, Ring, RingClient};

/// One command's I/O as a backend sees it: what to do, its data buffer, how it ends.
pub struct BlockIo {
    /// What the command asks for.
    pub plan: IoPlan,
    /// How it ends so far.
    pub status: Status,
    /// What a backend holds while the command's disk work runs and lets go of in
    /// [`crate::backend::Backend::finished`] (the volume backend's pool epoch).
    pub hold: Option<u8>,
    /// Where a backend that hands commands on (a migrating volume's gate) sent this
    /// one; 0 for a new command.
    pub route: u8,
    /// Set by a backend whose write another thread carries out whole (a first write
    /// over a snapshot, by the pool's metadata thread): its answer ends the command.
    pub written_elsewhere: bool,
    /// A write straight into a volume's clusters over its snapshot: (virtual cluster,
    /// physical cluster, granules) to record held once written (`Backend::settle`).
    pub to_record_held: Vec<(u64, u32, Granules)>,
    buf: Option<Buf>,
    /// Instead of `buf`: the slot of the ring's buffer table where the kernel put the
    /// request's own pages, and their length (ublk zero copy). Only fixed-buffer
    /// operations reach them, at offsets from 0; Rust never sees their bytes.
    kernel_buf: Option<(u16, u32)>,
    /// Disk operations queued and not yet completed.
    pending: u32,
    /// Whether another thread has the command and will answer through the mailbox.
    deferred: bool,
    /// Whether the command waits for its namespace's I/O budget and has not reached
    /// the backend yet.
    throttled: bool,
    /// Bytes of queued reads and writes not yet reported done: a transfer split over
    /// several operations completes in pieces, and one that ends short is an error.
    transfer_left: u64,
    /// The reactor pass clock when the command started (see `Ring::pass_ns`).
    pub started_ns: u64,
    /// Whether an operation of the command went to a device (`DiskFd::on_device`):
    /// its read data then comes from storage that idles until the next command starts.
    pub from_device: bool,
}

impl BlockIo {
    /// A command slot's I/O state, idle.
    pub fn idle() -> BlockIo {
        BlockIo {
            plan: IoPlan::Flush,
            status: Status::SUCCESS,
            hold: None,
            route: 0,
            written_elsewhere: false,
            to_record_held: Vec::new(),
            buf: None,
            kernel_buf: None,
            pending: 0,
            deferred: false,
            throttled: false,
            transfer_left: 0,
            started_ns: 0,
            from_device: false,
        }
    }

    /// Starts a new command at `now_ns` on the reactor's pass clock.
    pub fn reset(&mut self, plan: IoPlan, now_ns: u64) {
        debug_assert!(self.is_idle() && self.buf.is_none());
        self.plan = plan;
        self.started_ns = now_ns;
        self.status = Status::SUCCESS;
        self.hold = None;
        self.route = 0;
        self.written_elsewhere = false;
        self.to_record_held.clear();
        self.transfer_left = 0;
        self.kernel_buf = None;
        self.throttled = false;
        self.from_device = false;
    }

    /// Whether nothing is in flight for this command.
    pub fn is_idle(&self) -> bool {
        self.pending == 0 && !self.deferred
    }

    /// Gives the command the request pages the kernel registered in buffer-table slot
    /// `slot`, `len` bytes: reads and writes go there directly.
    pub fn set_kernel_buf(&mut self, slot: u16, len: u32) {
        debug_assert!(self.buf.is_none());
        self.kernel_buf = Some((slot, len));
    }

    /// Gives the command a data buffer.
    pub fn set_buf(&mut self, buf: Buf) {
        debug_assert!(self.buf.is_none());
        self.buf = Some(buf);
    }

    /// The data buffer's bytes, to fill or read while no operation is in flight.
    pub fn data_mut(&mut self) -> Option<&mut [u8]> {
        if self.pending != 0 {
            return None;
        }
        self.buf.as_mut().map(Buf::as_mut_slice)
    }

    /// The data buffer, for a transport to fill (an RDMA READ) while no disk
    /// operation is in flight.
    pub fn buf_mut(&mut self) -> Option<&mut Buf> {
        if self.pending != 0 {
            return None;
        }
        self.buf.as_mut()
    }

    /// The data buffer's bytes, while no operation is in flight.
    pub fn data(&self) -> Option<&[u8]> {
        if self.pending != 0 {
            return None;
        }
        self.buf.as_ref().map(Buf::as_slice)
    }

    /// Takes the buffer once nothing is in flight (to send it, or give it back).
    pub fn take_buf(&mut self) -> Option<Buf> {
        if self.pending != 0 {
            return None;
        }
        self.buf.take()
    }

    /// Zeroes `len` bytes of the buffer at `at`, which no queued operation covers.
    pub fn zero(&mut self, at: usize, len: usize) {
        if let Some(b) = self.buf.as_mut() {
            b.zero_range(at, len);
        }
    }

    /// Records one completed disk operation; returns whether the command's disk work
    /// is all done.
    pub fn op_done(&mut self, res: i32) -> bool {
        self.pending = self.pending.saturating_sub(1);
        let transfer = matches!(self.plan, IoPlan::Read { .. } | IoPlan::Write { .. });
        // Deallocation is advisory: storage that cannot punch holes may decline it.
        let advisory = matches!(self.plan, IoPlan::DatasetManagement { .. }) && res == -libc::EOPNOTSUPP;
        if res < 0 && !advisory {
            self.status = Status::INTERNAL_ERROR;
        } else if transfer {
            self.transfer_left = self.transfer_left.saturating_sub(res as u64);
        }
        if self.pending != 0 {
            return false;
        }
        if std::mem::take(&mut self.transfer_left) != 0 {
            // A short read or write: the disk ended before the range did.
            self.status = Status::INTERNAL_ERROR;
        }
        true
    }

    /// Records the answer of the thread the command was deferred to.
    pub fn deferred_done(&mut self) {
        self.deferred = false;
    }

    /// Whether the command waited for its I/O budget and has not reached the backend
    /// yet; the answer that lets it through clears it.
    pub fn take_throttled(&mut self) -> bool {
        std::mem::take(&mut self.throttled)
    }
}

impl Drop for BlockIo {
    fn drop(&mut self) {
        if self.pending != 0
            && let Some(b) = self.buf.take()
        {
            // The kernel may still use this memory: never give it back.
            std::mem::forget(b);
        }
    }
}

/// Where one command's disk operations go: the reactor's ring, with the completion
/// routed back to the command. Handed to a backend for the length of one call.
pub struct DiskQueue<'a> {
    ring: &'a mut Ring,
    owner: u32,
    tag: u16,
    /// Whether reads must land in a buffer because the transport needs their bytes
    /// (data digests), rather than being sent straight from where they are.
    pub needs_bytes: bool,
    /// Operations queued in this call.
    queued: u32,
    /// Whether the command was handed to another thread in this call.
    deferred: bool,
    /// Whether a queued operation goes to a device.
    on_device: bool,
}

/// What a [`DiskQueue`] saw during one backend call.
pub struct Queued {
    /// Disk operations queued.
    pub ops: u32,
    /// Whether the command left for another thread, a client or its I/O budget.
    pub deferred: bool,
}

impl<'a> DiskQueue<'a> {
    /// The queue of command `tag` of `owner` (a connection slot, or a ring client's
    /// slot with `CLIENT_OWNER`).
    pub fn new(ring: &'a mut Ring, owner: u32, tag: u16, needs_bytes: bool) -> DiskQueue<'a> {
        DiskQueue { ring, owner, tag, needs_bytes, queued: 0, deferred: false, on_device: false }
    }

    /// Ends the backend call: the ring learns of the disk operations it queued
    /// (`Ring::disk_ops_queued`), and the issuer of what is now in flight.
    pub fn finish(self) -> Queued {
        self.ring.disk_ops_queued(self.queued, self.on_device);
        Queued { ops: self.queued, deferred: self.deferred }
    }

    /// The reactor this runs on.
    pub fn reactor_id(&self) -> usize {
        self.ring.id
    }

    /// Whether `io`'s command may start now under its namespace's I/O limits. If not,
    /// it waits on this reactor as a deferred command until its budget lets it through
    /// (an answer with success), and then starts.
    pub fn admit(&mut self, qos: &Arc<Qos>, io: &mut BlockIo) -> bool {
        if self.ring.throttle.admit(qos, &io.plan, self.ring.pass_ns) {
            return true;
        }
        io.deferred = true;
        io.throttled = true;
        self.deferred = true;
        self.ring.throttle.wait(qos, self.owner, self.tag, io.plan);
        false
    }

    /// Gives `io` a data buffer of `len` bytes if it has none.
    pub fn give_buf(&mut self, io: &mut BlockIo, len: usize) {
        if io.buf.is_none() && io.kernel_buf.is_none() {
            io.buf = Some(self.ring.io_buf(len));
        }
    }

    fn push(&mut self, io: &mut BlockIo, disk: DiskFd, sqe: io_uring::squeue::Entry) {
        let sqe = sqe.user_data(Op::Disk(self.owner, self.tag).encode());
        // SAFETY: the entry points either at nothing, into `io`'s buffer at a range
        // checked against its capacity by the caller, or at a range of a buffer-table
        // slot the kernel filled with a ublk request's pages (checked against their
        // length; the driver keeps them registered until the request is committed,
        // which waits for this operation). Counting the operation in
        // `io.pending` keeps that buffer allocated and out of Rust's hands until the
        // completion is reaped (see `BlockIo`), and the ring is dropped before any
        // buffer (see `Reactor`).
        unsafe { self.ring.push(sqe) };
        io.pending += 1;
        self.queued += 1;
        self.on_device |= disk.on_device();
        io.from_device |= disk.on_device();
    }

    /// The address of `len` bytes at `at` in `io`'s buffer, checked against its size.
    fn buf_range(io: &mut BlockIo, at: usize, len: u32) -> Option<(*mut u8, Option<u16>)> {
        let end = at.checked_add(len as usize)?;
        if let Some((slot, size)) = io.kernel_buf {
            // A kernel-registered buffer is addressed by its offset.
            return (end <= size as usize).then_some((std::ptr::null_mut::<u8>().wrapping_add(at), Some(slot)));
        }
        let b = io.buf.as_mut()?;
        if end > b.capacity() {
            return None;
        }
        Some((b.as_mut_ptr().wrapping_add(at), b.registered_index()))
    }

    /// Reads `len` bytes at `pos` of `disk` into `io`'s buffer at `at`. False if the
    /// range is not inside the buffer.
    pub fn read(&mut self, io: &mut BlockIo, disk: DiskFd, at: usize, len: u32, pos: u64) -> bool {
        let Some((ptr, registered)) = Self::buf_range(io, at, len) else { return false };
        let fd = types::Fd(disk.fd());
        let sqe = match registered {
            Some(i) => opcode::ReadFixed::new(fd, ptr, len, i).offset(pos).build(),
            None => opcode::Read::new(fd, ptr, len).offset(pos).build(),
        };
        self.push(io, disk, sqe);
        io.transfer_left += u64::from(len);
        true
    }

    /// Writes `len` bytes of `io`'s buffer at `at` to `pos` of `disk`, durably before
    /// it completes if `fua`. False if the range is not inside the buffer.
    pub fn write(&mut self, io: &mut BlockIo, disk: DiskFd, at: usize, len: u32, pos: u64, fua: bool) -> bool {
        let Some((ptr, registered)) = Self::buf_range(io, at, len) else { return false };
        let fd = types::Fd(disk.fd());
        let flags = if fua { libc::RWF_DSYNC } else { 0 };
        let sqe = match registered {
            Some(i) => opcode::WriteFixed::new(fd, ptr, len, i).offset(pos).rw_flags(flags).build(),
            None => opcode::Write::new(fd, ptr, len).offset(pos).rw_flags(flags).build(),
        };
        self.push(io, disk, sqe);
        io.transfer_left += u64::from(len);
        true
    }

    /// Makes every completed write to `disk` durable (`fdatasync`).
    pub fn sync(&mut self, io: &mut BlockIo, disk: DiskFd) {
        let sqe = opcode::Fsync::new(types::Fd(disk.fd())).flags(types::FsyncFlags::DATASYNC).build();
        self.push(io, disk, sqe);
    }

    /// `fallocate(mode)` on `len` bytes at `pos` of `disk` (zeroing, deallocation).
    pub fn fallocate(&mut self, io: &mut BlockIo, disk: DiskFd, mode: i32, pos: u64, len: u64) {
        let sqe = opcode::Fallocate::new(types::Fd(disk.fd()), len).offset(pos).mode(mode).build();
        self.push(io, disk, sqe);
    }

    /// Hands the command, with its buffer, to the ring client registered under `key`
    /// (made by `make` on first use): a queue to the engine that owns the data. The
    /// client answers it with `Ring::answer`, and the backend's `resume` continues it.
    /// `route` says where it goes, in the client's terms.
    pub fn hand_to(&mut self, io: &mut BlockIo, key: u64, route: u64, make: impl FnOnce() -> Box<dyn RingClient>) {
        io.deferred = true;
        self.deferred = true;
        let slot = match self.ring.client_slot(key) {
            Some(slot) => slot,
            None => self.ring.add_client(key, make()),
        };
        let cmd = Handed {
            owner: self.owner,
            tag: self.tag,
            plan: io.plan,
            buf: io.buf.take(),
            since_ms: self.ring.now_ms(),
            route,
        };
        self.ring.handed_out += 1;
        self.ring.with_client(slot, |ring, client| client.take(ring, slot, cmd));
    }

    /// Hands the command to another thread: the returned callback, called once with
    /// the outcome, routes it back to this command on this reactor, where the
    /// backend's `resume` continues it.
    pub fn defer(&mut self, io: &mut BlockIo) -> Box<dyn FnOnce(Status) + Send> {
        io.deferred = true;
        self.deferred = true;
        let (mailer, owner, tag) = (self.ring.mailer(), self.owner, self.tag);
        Box::new(move |status| mailer.send(Mail::Answer { owner, tag, status }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bufpool::BufPool;

    fn io_with(plan: IoPlan, pending: u32) -> BlockIo {
        let mut io = BlockIo::idle();
        io.reset(plan, 0);
        io.set_buf(BufPool::new(8192).get(8192));
        io.pending = pending;
        io
    }

    #[test]
    fn the_buffer_is_out_of_reach_while_operations_are_in_flight() {
        let mut io = io_with(IoPlan::Read { offset: 0, len: 8192 }, 2);
        io.transfer_left = 8192;
        assert!(io.data().is_none() && io.data_mut().is_none() && io.take_buf().is_none());
        assert!(!io.op_done(4096), "one of two pieces done");
        assert!(io.op_done(4096));
        assert!(io.status.is_success());
        assert!(io.is_idle() && io.take_buf().is_some());
    }

    #[test]
    fn a_short_transfer_or_a_failed_operation_fails_the_command() {
        let mut io = io_with(IoPlan::Write { offset: 0, len: 8192, fua: false }, 1);
        io.transfer_left = 8192;
        assert!(io.op_done(4096));
        assert_eq!(io.status, Status::INTERNAL_ERROR, "a short write");
        let mut io = io_with(IoPlan::Flush, 1);
        assert!(io.op_done(-libc::EIO));
        assert_eq!(io.status, Status::INTERNAL_ERROR);
    }

    #[test]
    fn storage_that_cannot_deallocate_may_decline() {
        let plan = IoPlan::DatasetManagement { ranges: 1, deallocate: true, block_shift: 9 };
        let mut io = io_with(plan, 1);
        assert!(io.op_done(-libc::EOPNOTSUPP));
        assert!(io.status.is_success());
    }

    #[test]
    fn a_buffer_still_in_use_is_never_freed() {
        let io = io_with(IoPlan::Read { offset: 0, len: 4096 }, 1);
        // Dropped with an operation in flight, the buffer is leaked, not freed: the
        // kernel may still write it. (Miri or a sanitizer would see a free here.)
        drop(io);
    }
}

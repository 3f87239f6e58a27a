//! The local device queues a reactor serves, of either transport: a ublk queue
//! (`ublk.rs`) or a vhost-user-blk virtqueue (`vhost.rs`). Both hand their requests to
//! the backends through the same `BlockIo` and `DiskQueue`, with the queue's slot
//! marked `LOCAL_OWNER`, so disk completions and answers from other threads or engines
//! find their way back here.

use nvpool_wire::Status;

use super::Reactor;
use super::ublk::UblkQueue;
use super::vhost::VhostQueue;
use crate::bufpool::Buf;

/// A local device queue on this reactor.
pub(super) enum LocalQueue {
    Ublk(UblkQueue),
    Vhost(VhostQueue),
}

impl LocalQueue {
    /// Whether a request of this queue is with the backend.
    pub(super) fn serving(&self) -> bool {
        match self {
            LocalQueue::Ublk(q) => q.serving(),
            LocalQueue::Vhost(q) => q.serving(),
        }
    }

    /// Whether the queue is over: nothing of it is left with the kernel or the backend.
    pub(super) fn ended(&self) -> bool {
        match self {
            LocalQueue::Ublk(q) => q.ended(),
            LocalQueue::Vhost(q) => q.ended(),
        }
    }

    /// A disk operation of request `tag` completed.
    pub(super) fn on_disk(&mut self, r: &mut Reactor, slot: u32, tag: u16, res: i32) {
        match self {
            LocalQueue::Ublk(q) => q.on_disk(r, slot, tag, res),
            LocalQueue::Vhost(q) => q.on_disk(r, tag, res),
        }
    }

    /// The thread or owner request `tag` was handed to answered.
    pub(super) fn on_resumed(&mut self, r: &mut Reactor, slot: u32, tag: u16, status: Status, buf: Option<Buf>) {
        match self {
            LocalQueue::Ublk(q) => q.on_resumed(r, slot, tag, status, buf),
            LocalQueue::Vhost(q) => q.on_resumed(r, slot, tag, status, buf),
        }
    }

    /// A hot upgrade was called off: serve what was held.
    pub(super) fn start_held(&mut self, r: &mut Reactor, slot: u32) {
        match self {
            LocalQueue::Ublk(q) => q.start_held(r, slot),
            LocalQueue::Vhost(q) => q.drain(r, slot),
        }
    }

    /// The queue ended: give back its buffers and tell whoever waits for it.
    pub(super) fn finish(self, r: &mut Reactor) {
        match self {
            LocalQueue::Ublk(q) => {
                let device = q.device().clone();
                q.release(r);
                device.queue_ended();
            }
            LocalQueue::Vhost(q) => q.finish(r),
        }
    }
}

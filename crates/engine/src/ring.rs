//! A reactor's ring: its io_uring and what every operation on it shares (the buffer
//! pool and its registrations, the registered-file table, the zero buffer, the clock
//! of the pass, the commands waiting for their I/O budget), and the clients it hosts.
//!
//! Every submission goes through [`Ring::push`], an `unsafe fn` whose callers each say
//! why the memory their entry points at outlives the operation. A completion names
//! what it belongs to in its user data ([`Op`]): a connection's receive or send, a
//! command's disk operation, the mailbox's wakeup, or an operation of a *ring client*.
//!
//! A ring client ([`RingClient`]) is anything else that runs on the reactor's ring: a
//! queue to another engine, a local device's queue, a listener. It registers itself
//! under a key, posts its operations with [`Op::Client`] and its slot, and is called
//! back with their completions, with messages other threads send it, with the answers
//! to the commands it issued, and at each tick. The reactor knows none of them: a new
//! kind of queue is a new client, and the reactor's files do not change.
#![allow(unsafe_code)]

use std::any::Any;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use io_uring::{IoUring, squeue};
use nvpool_wire::Status;

use crate::bufpool::{Buf, BufPool};
use crate::plan::IoPlan;
use crate::qos::Throttle;

/// Submission queue entries; completions get four times as many.
pub const RING_ENTRIES: u32 = 1024;
/// Slots in the ring's registered-buffer table. Pool buffers are registered as the
/// pool grows, so disk I/O uses fixed buffers (no page pinning per operation). A
/// registered buffer stays in the pool for good, so this also bounds what the pool
/// keeps after a burst: 512 buffers cover 4 queues of 128 commands in flight.
const REGISTERED_BUFFERS: u32 = 512;
/// Slots after those, for the ublk driver to put requests' pages in (zero copy): one
/// per tag of each zero-copy ublk queue on this reactor.
const ZERO_COPY_SLOTS: u32 = 4096;
/// Slots in the ring's registered-file table: connection `i` uses slot `i`. Further
/// connections, or all of them if registration fails, use plain descriptors.
pub const REGISTERED_FILES: u32 = 1024;
/// Disk operations and answers name who issued the command: a connection's slot, or
/// a ring client's slot with this bit set.
pub const CLIENT_OWNER: u32 = 1 << 23;

/// What a completion belongs to, packed into the 64-bit user data:
/// kind in bits 63:56, a slot in bits 55:32, extra in bits 31:0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A connection's receive: (connection slot).
    Recv(u32),
    /// A connection's send: (connection slot).
    Send(u32),
    /// A disk operation of a command: (owner, command tag).
    Disk(u32, u16),
    /// The read of the mailbox's eventfd.
    Wake,
    /// An operation of a ring client: (client slot, what it is to the client).
    Client(u32, u32),
    /// A poll of a descriptor one of the reactor's transports watches: (its index).
    Watch(u32),
}

impl Op {
    /// The user data of an operation.
    pub fn encode(self) -> u64 {
        let (kind, slot, extra) = match self {
            Op::Recv(c) => (2u64, c, 0),
            Op::Send(c) => (3, c, 0),
            Op::Disk(owner, tag) => (4, owner, u32::from(tag)),
            Op::Wake => (5, 0, 0),
            Op::Client(slot, tag) => (6, slot, tag),
            Op::Watch(i) => (7, i, 0),
        };
        kind << 56 | u64::from(slot & 0xFF_FFFF) << 32 | u64::from(extra)
    }

    /// What user data names; `None` for an operation no one waits for (cancellations).
    pub fn decode(v: u64) -> Option<Op> {
        let slot = ((v >> 32) & 0xFF_FFFF) as u32;
        let extra = v as u32;
        Some(match v >> 56 {
            2 => Op::Recv(slot),
            3 => Op::Send(slot),
            4 => Op::Disk(slot, extra as u16),
            5 => Op::Wake,
            6 => Op::Client(slot, extra),
            7 => Op::Watch(slot),
            _ => return None,
        })
    }
}

/// A command handed to a ring client (a queue to the engine that owns the data): the
/// client answers it with [`Ring::answer`], giving the buffer back.
pub struct Handed {
    /// Who issued it: a connection slot, or a client slot with [`CLIENT_OWNER`].
    pub owner: u32,
    /// Its tag with the issuer.
    pub tag: u16,
    /// What it asks.
    pub plan: IoPlan,
    /// Its data: what a write sends, where a read lands.
    pub buf: Option<Buf>,
    /// When it was handed over, on the reactor's clock.
    pub since_ms: u64,
    /// Where it goes, in the client's terms (a remote namespace: its NSID and block
    /// size).
    pub route: u64,
}

/// The answer to a command that left its issuer: a deferred one, one handed to a ring
/// client, or one that waited for its I/O budget.
pub struct Answer {
    /// Who issued it.
    pub owner: u32,
    /// Its tag with the issuer.
    pub tag: u16,
    /// How it ended.
    pub status: Status,
    /// Its buffer, if it went with the command.
    pub buf: Option<Buf>,
}

/// Mail from another thread to a reactor's ring.
pub enum Mail {
    /// The thread a command was deferred to answers it.
    Answer {
        /// Who issued it.
        owner: u32,
        /// Its tag with the issuer.
        tag: u16,
        /// How it ended.
        status: Status,
    },
    /// A message for the ring client registered under `key` (dropped if there is none).
    Client {
        /// The client's key.
        key: u64,
        /// What it is told.
        message: Box<dyn Any + Send>,
    },
}

/// Sends mail to one reactor's ring from any thread.
#[derive(Clone)]
pub struct Mailer(Arc<dyn Fn(Mail) + Send + Sync>);

impl Mailer {
    /// A mailer that hands each piece of mail to `deliver`.
    pub fn new(deliver: impl Fn(Mail) + Send + Sync + 'static) -> Mailer {
        Mailer(Arc::new(deliver))
    }

    /// Sends `mail`, and wakes the reactor.
    pub fn send(&self, mail: Mail) {
        (self.0)(mail)
    }
}

/// A key no other ring client of the process has.
pub fn new_client_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1 << 48);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Anything that runs on a reactor's ring besides the NVMe/TCP and NVMe/RDMA
/// connections: it posts its own operations and is told of what concerns it. `me` is
/// the client's slot, for the operations it posts ([`Op::Client`]) and the commands it
/// issues (owner `me | CLIENT_OWNER`).
pub trait RingClient {
    /// The client joined the ring: it posts its first operations.
    fn begin(&mut self, _ring: &mut Ring, _me: u32) {}

    /// An operation the client posted with `Op::Client(me, tag)` completed.
    fn on_complete(&mut self, ring: &mut Ring, me: u32, tag: u32, res: i32, flags: u32);

    /// A disk operation of command `tag`, which the client issued, completed.
    fn on_disk(&mut self, _ring: &mut Ring, _me: u32, _tag: u16, _res: i32) {}

    /// The thread or client command `tag` went to answered it.
    fn on_answer(&mut self, _ring: &mut Ring, _me: u32, _tag: u16, _status: Status, _buf: Option<Buf>) {}

    /// Another thread sent the client a message (`Mail::Client`).
    fn on_mail(&mut self, _ring: &mut Ring, _me: u32, _message: Box<dyn Any + Send>) {}

    /// A command is handed to the client; it answers with `Ring::answer`.
    fn take(&mut self, ring: &mut Ring, _me: u32, cmd: Handed) {
        ring.answer(cmd.owner, cmd.tag, Status::INTERNAL_ERROR, cmd.buf);
    }

    /// The reactor's tick (every 100 ms, also while a hot upgrade holds it).
    fn tick(&mut self, _ring: &mut Ring, _me: u32) {}

    /// The issuer `owner` (a closed connection) gives up the commands it handed: those
    /// that have not left the engine are answered now (aborted), never sent later.
    fn withdraw(&mut self, _ring: &mut Ring, _me: u32, _owner: u32) {}

    /// A hot upgrade parks the reactor: finish what was taken, take nothing new.
    fn park(&mut self, _ring: &mut Ring, _me: u32) {}

    /// Whether nothing the client took is under way, so the reactor may report parked.
    fn parked(&self) -> bool {
        true
    }

    /// Serve again: the upgrade was called off, or the new process goes on.
    fn resume(&mut self, _ring: &mut Ring, _me: u32) {}

    /// The reactor stops: end what can be ended.
    fn stop(&mut self, _ring: &mut Ring, _me: u32) {}

    /// Whether the client is over, and leaves the ring.
    fn ended(&self) -> bool {
        false
    }

    /// The client's last call, once it ended: it gives back what it holds.
    fn finish(self: Box<Self>, _ring: &mut Ring) {}
}

/// The warnings a reactor may log from its loop.
#[derive(Clone, Copy, Debug)]
pub enum Warning {
    /// A submission failed.
    Submit,
    /// Entering the kernel failed.
    Enter,
    /// An accept failed.
    Accept,
    // The last kind: `WARNING_KINDS` counts from it.
    /// A closed socket could not leave the registered-file table.
    Unregister,
}

/// How many kinds of `Warning` there are: the last one's index plus one.
const WARNING_KINDS: usize = Warning::Unregister as usize + 1;

/// Logs each kind of warning at most once a second: a failure that repeats on every
/// pass of the loop must flood neither the log nor the loop.
#[derive(Default)]
pub struct WarningLimit {
    last: [Option<Instant>; WARNING_KINDS],
    suppressed: [u32; WARNING_KINDS],
}

impl WarningLimit {
    /// Whether to log a warning of this kind now; if so, how many were held back
    /// since the last one logged.
    pub fn allow(&mut self, w: Warning) -> Option<u32> {
        let i = w as usize;
        let now = Instant::now();
        if self.last[i].is_some_and(|t| now.duration_since(t) < Duration::from_secs(1)) {
            self.suppressed[i] = self.suppressed[i].saturating_add(1);
            return None;
        }
        self.last[i] = Some(now);
        Some(std::mem::take(&mut self.suppressed[i]))
    }
}

/// A reactor's ring and what its operations share.
///
/// Drop order matters: `uring` is declared first, so it is torn down (and the kernel
/// lets go of every registered buffer and pending operation) before the buffer pool,
/// the zeroes and the clients whose memory those operations point at.
pub struct Ring {
    uring: IoUring,
    /// The reactor's index.
    pub id: usize,
    /// I/O buffers.
    pub pool: BufPool,
    /// Zeroes sent for reads of null namespaces: no copy, and no stale data leaks.
    pub zeroes: Box<[u8]>,
    /// Whether the ring has its (sparse) buffer table.
    buffer_table: bool,
    /// The zero-copy slots ublk queues hold: (first slot, count).
    zero_copy_slots: Vec<(u32, u32)>,
    /// Next free slot of the registered-buffer table; `REGISTERED_BUFFERS` once the
    /// table is full or registration is unavailable.
    next_registered: u32,
    /// Slots of the registered-buffer table freed by `release_idle_buffers`.
    free_registered: Vec<u32>,
    /// Whether the ring has a registered-file table for sockets.
    pub files_registered: bool,
    /// Whether the kernel flags pending completion work in the ring (see `new_ring`).
    pub taskrun_flag: bool,
    /// Disk operations that copy from memory were queued in this pass and are not yet
    /// submitted.
    pub disk_queued: bool,
    /// Disk operations submitted and not yet completed, over all issuers.
    pub disk_in_flight: u32,
    /// Commands handed to clients (another engine) and not yet answered.
    pub handed_out: u32,
    /// Commands waiting for their namespace's I/O budget.
    pub throttle: Throttle,
    /// When this pass began, in nanoseconds since the target started: the clock
    /// commands are timed with, read once per pass.
    pub pass_ns: u64,
    /// Whether a hot upgrade holds the reactor still: nothing new is taken.
    pub held: bool,
    /// Answers to route to their issuers, gathered while the reactor works.
    answers: Vec<Answer>,
    /// Completions taken from the ring while a submission waited for room; handled
    /// with the next ones.
    reaped: Vec<(u64, i32, u32)>,
    /// Mail to this ring.
    mailer: Mailer,
    clients: Vec<Option<Box<dyn RingClient>>>,
    /// Each client's key, by slot.
    client_keys: Vec<u64>,
    pub warnings: WarningLimit,
}

impl Ring {
    /// Reactor `id`'s ring, on the calling thread (a single-issuer ring belongs to the
    /// thread that creates it), its tables registered where the kernel allows;
    /// `buffer_len`: the largest I/O buffer.
    pub fn new(id: usize, buffer_len: usize, mailer: Mailer) -> std::io::Result<Ring> {
        let (uring, taskrun_flag) = new_uring()?;
        let mut r = Ring {
            uring,
            id,
            pool: BufPool::new(buffer_len),
            zeroes: vec![0u8; buffer_len].into_boxed_slice(),
            buffer_table: false,
            zero_copy_slots: Vec::new(),
            next_registered: 0,
            free_registered: Vec::new(),
            files_registered: false,
            taskrun_flag,
            disk_queued: false,
            disk_in_flight: 0,
            handed_out: 0,
            throttle: Throttle::default(),
            pass_ns: 0,
            held: false,
            answers: Vec::with_capacity(256),
            reaped: Vec::new(),
            mailer,
            clients: Vec::new(),
            client_keys: Vec::new(),
            warnings: WarningLimit::default(),
        };
        if r.uring.submitter().register_buffers_sparse(REGISTERED_BUFFERS + ZERO_COPY_SLOTS).is_err() {
            r.next_registered = REGISTERED_BUFFERS;
        } else {
            r.buffer_table = true;
        }
        r.files_registered = r.uring.submitter().register_files_sparse(REGISTERED_FILES).is_ok();
        Ok(r)
    }

    /// The io_uring itself, for the event loop.
    pub fn uring(&mut self) -> &mut IoUring {
        &mut self.uring
    }

    /// The reactor's clock in milliseconds since the target started.
    pub fn now_ms(&self) -> u64 {
        self.pass_ns / 1_000_000
    }

    /// Mail to this ring, for another thread.
    pub fn mailer(&self) -> Mailer {
        self.mailer.clone()
    }

    /// Queues an SQE, submitting first if the submission queue is full.
    ///
    /// # Safety
    /// Every buffer, descriptor array and header the entry points at must stay
    /// allocated, and must not be written by Rust (or read, where the kernel writes
    /// it), until the operation's completion has been reaped.
    pub unsafe fn push(&mut self, sqe: squeue::Entry) {
        loop {
            // SAFETY: the caller answers for the memory the entry points at.
            if unsafe { self.uring.submission().push(&sqe) }.is_ok() {
                return;
            }
            if let Err(e) = self.uring.submit() {
                // A completion queue with no room makes the kernel refuse submissions
                // (EBUSY): the completions are taken out, to be handled with the next
                // ones, so that it takes the submissions again.
                let before = self.reaped.len();
                self.reaped.extend(self.uring.completion().map(|c| (c.user_data(), c.result(), c.flags())));
                if self.reaped.len() == before {
                    if let Some(suppressed) = self.warnings.allow(Warning::Submit) {
                        tracing::warn!(reactor = self.id, suppressed, "io_uring submit failed: {e}");
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Moves the completions the ring holds (those a full submission queue made it
    /// take early first) into `into`.
    pub fn reap(&mut self, into: &mut Vec<(u64, i32, u32)>) {
        into.append(&mut self.reaped);
        into.extend(self.uring.completion().map(|c| (c.user_data(), c.result(), c.flags())));
    }

    /// An I/O buffer from the pool, registered with the ring when it is new.
    pub fn io_buf(&mut self, len: usize) -> Buf {
        let mut buf = self.pool.get(len);
        let slot = || {
            self.free_registered
                .last()
                .copied()
                .or((self.next_registered < REGISTERED_BUFFERS).then_some(self.next_registered))
        };
        if buf.registered_index().is_none()
            && let Some(slot) = slot()
        {
            let iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.capacity() };
            // SAFETY: the buffer is a mapping that, once registered, always returns to
            // the pool (`BufPool::put` keeps registered buffers) until
            // `release_idle_buffers` takes it out of the table, and the ring is dropped
            // before the pool, so the registered memory outlives its registration.
            let rc = unsafe { self.uring.submitter().register_buffers_update(slot, &[iov], None) };
            match rc {
                Ok(_) => {
                    buf.set_registered_index(slot as u16);
                    if self.free_registered.pop().is_none() {
                        self.next_registered += 1;
                    }
                }
                // Without registration (e.g. a low RLIMIT_MEMLOCK) plain reads and writes
                // work the same, a little slower.
                Err(_) => {
                    self.next_registered = REGISTERED_BUFFERS;
                    self.free_registered.clear();
                }
            }
        }
        buf
    }

    /// Gives the pool's buffers back to the system (the reactor serves nobody): a
    /// registered buffer leaves the ring's table first, and its slot is reused.
    pub fn release_idle_buffers(&mut self) {
        let unregister = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        for buf in self.pool.take_all() {
            if let Some(slot) = buf.registered_index().map(u32::from) {
                // SAFETY: an empty entry clears the slot; the buffer is free (no
                // operation uses it) and lives until after the update returns.
                if unsafe { self.uring.submitter().register_buffers_update(slot, &[unregister], None) }.is_err() {
                    // Still in the table: it must stay alive.
                    self.pool.put(buf);
                    continue;
                }
                self.free_registered.push(slot);
            }
        }
    }

    /// Reserves `count` consecutive zero-copy slots of the buffer table for a ublk
    /// queue; returns the first.
    pub fn reserve_zero_copy_slots(&mut self, count: u32) -> Option<u16> {
        if !self.buffer_table {
            return None;
        }
        self.zero_copy_slots.sort_unstable();
        let mut first = REGISTERED_BUFFERS;
        for &(start, len) in &self.zero_copy_slots {
            if start >= first + count {
                break;
            }
            first = first.max(start + len);
        }
        if first + count > REGISTERED_BUFFERS + ZERO_COPY_SLOTS {
            return None;
        }
        self.zero_copy_slots.push((first, count));
        u16::try_from(first).ok()
    }

    /// Gives back the zero-copy slots starting at `first`.
    pub fn release_zero_copy_slots(&mut self, first: u16) {
        self.zero_copy_slots.retain(|&(start, _)| start != u32::from(first));
    }

    /// Puts socket `fd` in slot `slot` of the registered-file table; false if it
    /// could not.
    pub fn register_file(&mut self, slot: u32, fd: i32) -> bool {
        self.files_registered
            && slot < REGISTERED_FILES
            && self.uring.submitter().register_files_update(slot, &[fd]).is_ok()
    }

    /// Empties slot `slot` of the registered-file table.
    pub fn unregister_file(&mut self, slot: u32) {
        if let Err(e) = self.uring.submitter().register_files_update(slot, &[-1])
            && let Some(suppressed) = self.warnings.allow(Warning::Unregister)
        {
            tracing::warn!(reactor = self.id, suppressed, "cannot unregister a closed socket: {e}");
        }
    }

    /// Accounts for the disk operations a backend call queued: I/O to a device is
    /// handed to the kernel at once; I/O that copies from memory (page cache, tmpfs)
    /// completes within the submitting call and waits for the end of the pass, when
    /// one call submits it all (see `submit_disk_ops`).
    pub fn disk_ops_queued(&mut self, ops: u32, on_device: bool) {
        self.disk_in_flight += ops;
        if ops > 0 {
            if on_device {
                self.submit_disk_ops();
            } else {
                self.disk_queued = true;
            }
        }
    }

    /// Hands queued disk operations to the kernel.
    ///
    /// I/O to a device is submitted as soon as its command is parsed: the device starts
    /// on the first request of a burst while the reactor parses the rest. Batching a
    /// pass's reads cost about a tenth of a virtual disk's IOPS at depth 32, because an
    /// `io_uring_enter` with more than two entries holds its block requests back (a
    /// block plug) until all are issued, and the device is notified once, late. A
    /// system call per command is cheap next to a device's latency.
    ///
    /// I/O that copies from memory (page cache, tmpfs) completes inside the submitting
    /// call, so a call per command would only add system calls (a third fewer IOPS on
    /// tmpfs); it is submitted once at the end of the pass, before any send is queued
    /// (a large send copies its data first and would hold the reads back).
    pub fn submit_disk_ops(&mut self) {
        self.disk_queued = false;
        if let Err(e) = self.uring.submit()
            && let Some(suppressed) = self.warnings.allow(Warning::Submit)
        {
            tracing::warn!(reactor = self.id, suppressed, "io_uring submit failed: {e}");
        }
    }

    /// A client answers command `tag` of `owner`, which was handed to it; the reactor
    /// gives the answer to the issuer.
    pub fn answer(&mut self, owner: u32, tag: u16, status: Status, buf: Option<Buf>) {
        self.handed_out = self.handed_out.saturating_sub(1);
        self.answers.push(Answer { owner, tag, status, buf });
    }

    /// Records the answer to a command that was deferred to another thread or waited
    /// for its I/O budget; the reactor gives it to the issuer.
    pub fn route(&mut self, answer: Answer) {
        self.answers.push(answer);
    }

    /// Takes the answers gathered so far.
    pub fn take_answers(&mut self, into: &mut Vec<Answer>) {
        into.append(&mut self.answers);
    }

    /// Whether answers wait to be routed.
    pub fn has_answers(&self) -> bool {
        !self.answers.is_empty()
    }

    // ----- clients ------------------------------------------------------------------

    /// The slot of the client registered under `key`.
    pub fn client_slot(&self, key: u64) -> Option<u32> {
        self.client_keys.iter().position(|&k| k == key).map(|i| i as u32)
    }

    /// Registers a client under `key` and lets it begin; returns its slot.
    pub fn add_client(&mut self, key: u64, client: Box<dyn RingClient>) -> u32 {
        // A free slot has no key (one taken out by `with_client` keeps its key).
        let slot = match self.client_keys.iter().position(|&k| k == 0) {
            Some(free) => free,
            None => {
                self.clients.push(None);
                self.client_keys.push(0);
                self.clients.len() - 1
            }
        };
        self.clients[slot] = Some(client);
        self.client_keys[slot] = key;
        let slot = slot as u32;
        self.with_client(slot, |ring, c| c.begin(ring, slot));
        slot
    }

    /// Runs `f` on client `slot` taken out of the table, so that it can use the rest
    /// of the ring. A client that ended leaves the table and gets its last call.
    pub fn with_client(&mut self, slot: u32, f: impl FnOnce(&mut Ring, &mut dyn RingClient)) {
        let Some(mut client) = self.clients.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        f(self, client.as_mut());
        if client.ended() {
            self.client_keys[slot as usize] = 0;
            client.finish(self);
        } else {
            self.clients[slot as usize] = Some(client);
        }
    }

    /// Withdraws, from every client, the commands `owner` handed that have not left
    /// the engine (see `RingClient::withdraw`).
    pub fn withdraw(&mut self, owner: u32) {
        self.each_client(|ring, slot, c| c.withdraw(ring, slot, owner));
    }

    /// Runs `f` on every client.
    pub fn each_client(&mut self, mut f: impl FnMut(&mut Ring, u32, &mut dyn RingClient)) {
        for slot in 0..self.clients.len() as u32 {
            self.with_client(slot, |ring, c| f(ring, slot, c));
        }
    }

    /// Whether every client reports parked.
    pub fn clients_parked(&self) -> bool {
        self.clients.iter().flatten().all(|c| c.parked())
    }

    /// Whether any client is registered.
    pub fn has_clients(&self) -> bool {
        self.clients.iter().any(Option::is_some)
    }

    /// Delivers mail for the client registered under `key`.
    pub fn deliver(&mut self, key: u64, message: Box<dyn Any + Send>) {
        if let Some(slot) = self.client_slot(key) {
            self.with_client(slot, |ring, c| c.on_mail(ring, slot, message));
        }
    }
}

/// A ring whose completion work runs only when the reactor asks for it (deferred task
/// running, one issuer): no interrupts of the polling loop, and the cheapest wakeups.
/// The kernel flags pending completion work in the shared ring, so the polling loop
/// can tell without a system call whether entering the kernel would find anything.
/// Older kernels get cooperative task running, or a plain ring.
/// Returns the ring and whether it has that flag.
fn new_uring() -> std::io::Result<(IoUring, bool)> {
    let cq = RING_ENTRIES * 4;
    IoUring::builder()
        .setup_cqsize(cq)
        .setup_single_issuer()
        .setup_defer_taskrun()
        .setup_taskrun_flag()
        .build(RING_ENTRIES)
        .or_else(|_| IoUring::builder().setup_cqsize(cq).setup_coop_taskrun().setup_taskrun_flag().build(RING_ENTRIES))
        .map(|ring| (ring, true))
        .or_else(|_| IoUring::builder().setup_cqsize(cq).build(RING_ENTRIES).map(|ring| (ring, false)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        for op in [
            Op::Recv(0xABCDE),
            Op::Send(1),
            Op::Disk(0xFF_FFFF, 0xFFFF),
            Op::Wake,
            Op::Client(3, 7),
            Op::Client(0xFF_FFFF, u32::MAX),
            Op::Watch(2),
        ] {
            assert_eq!(Op::decode(op.encode()), Some(op));
        }
        assert_eq!(Op::decode(0), None);
    }
}

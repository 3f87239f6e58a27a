//! Reactors: one thread per configured core, each owning one io_uring used for both
//! socket and disk I/O.
//!
//! A reactor runs to completion. Each pass of its loop enters the kernel once if there
//! is anything to submit or any completion work pending (the ring flags it), reaps
//! every completion, parses what arrived, queues the disk and socket work, and then
//! flushes each connection's output as one `sendmsg`. I/O to a disk device is handed to
//! the kernel as soon as its command is parsed, I/O served from memory (page cache) once
//! per pass before the sends (see `Reactor::submit_disk_ops`).
//! Idle, the reactor sleeps in the kernel until a completion arrives. Nothing on the
//! I/O path takes a lock or allocates once buffers are warm. Other threads talk to a
//! reactor through its mailbox (a channel plus an eventfd that wakes the ring).
//!
//! Every submission goes through `Reactor::push`, an `unsafe fn` whose callers each
//! say why the memory their entry points at outlives the operation. Disk operations
//! are built in one place, `block_io.rs`, where the command's buffer owns that rule.
#![allow(unsafe_code)]

mod block_io;
mod conn;
mod local;
mod rdma;
mod remote;
mod throttle;
mod ublk;
mod vhost;

pub use block_io::{BlockIo, DiskFd, DiskQueue};

use std::collections::{BTreeMap, BTreeSet};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use crate::bufpool::BufPool;
use crate::nvme::{Controller, MAX_TRANSFER, Target};
use crate::tls::TlsPeer;
use crate::upgrade::image::ConnImage;
use conn::Conn;
use local::LocalQueue;
use rdma::{RdmaWire, ReactorRdma};
use remote::{Answer, Forwarded, HostQueue};
use throttle::Throttle;
use ublk::UblkQueue;
use vhost::VhostQueue;

use crate::backend::remote::RemoteLink;

/// How often timers (keep-alive, dead controllers, idle handshakes) are checked.
const TICK: Duration = Duration::from_millis(100);
/// How long a reactor with commands waiting for I/O budget sleeps at most: well under
/// the burst a budget holds (`qos::BURST_MS`), so a waiting command loses none of it.
const THROTTLE_WAKE: Duration = Duration::from_micros(200);
/// Submission queue entries; completions get four times as many.
const RING_ENTRIES: u32 = 1024;
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
const REGISTERED_FILES: u32 = 1024;
/// io_uring_enter flag: process completions (run deferred work) before returning.
const IORING_ENTER_GETEVENTS: u32 = 1;
/// Disk operations and handed-on commands name who issued them: a connection's slot,
/// or a local device queue's slot with this bit set.
const LOCAL_OWNER: u32 = 1 << 23;

/// A message to a reactor.
pub enum Msg {
    /// Serve a connection accepted elsewhere.
    Adopt {
        /// The connection.
        stream: TcpStream,
        /// The listener that accepted it.
        port_id: u16,
        /// Who its TLS session proved the host to be, if it has one.
        tls: Option<Box<TlsPeer>>,
    },
    /// Start accepting on a listener.
    Listen {
        /// Port ID (the discovery log's).
        port_id: u16,
        /// The bound, listening socket.
        listener: TcpListener,
    },
    /// Stop accepting on a listener and end the connections it accepted (sent to
    /// every reactor).
    Unlisten(u16),
    /// Something changed (namespaces, hosts, events): check connections now.
    Kick,
    /// Another thread finished a command a backend deferred to it.
    Deferred {
        /// Connection slot.
        conn: u32,
        /// Command slot.
        tag: u16,
        /// How it ended.
        status: nvpool_wire::Status,
    },
    /// An authentication job of a connection's queue ran on another thread.
    AuthChecked {
        /// Connection slot.
        conn: u32,
        /// The Authentication Send it answers.
        cid: u16,
        /// The job's result.
        checked: crate::nvme::auth::Checked,
    },
    /// A queue to the owner of a remote namespace, connected for this reactor.
    RemoteSocket(crate::backend::remote::RemoteSocket),
    /// Serve queue `queue` of a local device: fetch its tags, then report.
    LocalQueue {
        /// The device.
        device: Arc<crate::local::LocalDevice>,
        /// Which of its queues.
        queue: u16,
        /// Where to report.
        done: Sender<Result<(), String>>,
    },
    /// Serve a vhost-user-blk virtqueue, then report.
    VhostRing {
        /// The virtqueue as the frontend set it up.
        ring: Box<crate::local::vhost::Ring>,
        /// Where to report.
        done: Sender<Result<(), String>>,
    },
    /// Stop taking requests from virtqueue run `id`; once those under way are
    /// complete, report where it stopped in the available ring.
    VhostStop {
        /// The run (`Ring::id`).
        id: u64,
        /// Where to report.
        done: Sender<u16>,
    },
    /// Hot upgrade: stop accepting and taking new commands, finish the ones taken,
    /// then report the parked connections (and listeners) here.
    Park(Sender<Result<Parked, String>>),
    /// Hot upgrade called off: serve again, the held commands first.
    Resume,
    /// Hot upgrade, new process: take the connections and listeners another engine
    /// process parked, and hold them parked until `Resume`. Reports how many
    /// connections it took, or why one could not be taken.
    Restore {
        /// Each connection's socket, state and controller (already restored).
        conns: Vec<(TcpStream, ConnImage, Option<Arc<Controller>>)>,
        /// Listening sockets, by port ID.
        listeners: Vec<(u16, TcpListener)>,
        /// Where to report.
        done: Sender<Result<usize, String>>,
    },
    /// Serve an RDMA connection request: make its queue pair here and accept.
    RdmaQueue(Box<crate::rdma::Incoming>),
    /// The connection manager reports an RDMA connection (by its serial) gone.
    RdmaDisconnected(u64),
    /// Close everything and exit.
    Stop,
}

/// Where a reactor stands in a hot upgrade.
enum Upgrade {
    /// Serving.
    Serving,
    /// Finishing the commands it took; reports here once nothing is in flight.
    Parking(Sender<Result<Parked, String>>),
    /// Held still: reported (the old process) or restored (the new one), until
    /// `Resume` or the process exits.
    Parked,
}

/// A reactor's report that it is parked: nothing in flight, nothing accepted or read
/// until it resumes or the process exits.
pub struct Parked {
    /// Which reactor.
    pub reactor: usize,
    /// Each connection's state (its `fd` not yet filled in) and a copy of its socket.
    pub conns: Vec<(ConnImage, TcpStream)>,
    /// Copies of the listening sockets this reactor accepts on, by port ID.
    pub listeners: Vec<(u16, TcpListener)>,
}

/// A handle to send messages to a reactor and wake it.
pub struct ReactorLink {
    tx: Sender<Msg>,
    wake: OwnedFd,
    /// Where the reactor's time went, and its load; only the reactor writes it.
    time: ReactorClock,
}

/// Where a reactor's time went, and its load now, as the metrics report it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReactorTime {
    /// Passes that completed something, and the submissions that followed them.
    pub busy_ns: u64,
    /// Asleep on the ring, or polling with nothing to do.
    pub idle_ns: u64,
    /// Connections it serves.
    pub connections: u64,
    /// Commands waiting for their namespace's I/O budget on it.
    pub throttled: u64,
}

/// A reactor's time and load counters, on a cache line of their own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct ReactorClock {
    busy_ns: AtomicU64,
    idle_ns: AtomicU64,
    connections: AtomicU64,
    throttled: AtomicU64,
}

impl ReactorClock {
    /// Adds a pass; a plain load and store, as the reactor is the only writer.
    fn add(&self, ns: u64, busy: bool) {
        let counter = if busy { &self.busy_ns } else { &self.idle_ns };
        counter.store(counter.load(Ordering::Relaxed) + ns, Ordering::Relaxed);
    }

    /// Its connections and waiting commands now.
    fn set_load(&self, connections: usize, throttled: usize) {
        self.connections.store(connections as u64, Ordering::Relaxed);
        self.throttled.store(throttled as u64, Ordering::Relaxed);
    }
}

impl ReactorLink {
    /// Where the reactor's time went so far.
    pub fn time(&self) -> ReactorTime {
        ReactorTime {
            busy_ns: self.time.busy_ns.load(Ordering::Relaxed),
            idle_ns: self.time.idle_ns.load(Ordering::Relaxed),
            connections: self.time.connections.load(Ordering::Relaxed),
            throttled: self.time.throttled.load(Ordering::Relaxed),
        }
    }

    /// Sends a message and wakes the reactor.
    pub fn send(&self, m: Msg) {
        if self.tx.send(m).is_ok() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local u64 to an eventfd this link owns.
            unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

/// Creates the mailbox of a reactor: the link other threads use, and the receiving
/// end the reactor keeps.
pub fn mailbox() -> std::io::Result<(ReactorLink, Receiver<Msg>, OwnedFd)> {
    // SAFETY: eventfd returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is new and owned by nobody else.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let reactor_side = owned.try_clone()?;
    let (tx, rx) = mpsc::channel();
    Ok((ReactorLink { tx, wake: owned, time: ReactorClock::default() }, rx, reactor_side))
}

/// The CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; zeroed is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity fills `set`, whose size we pass.
    let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return vec![0];
    }
    // SAFETY: CPU_ISSET reads the set filled above.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Pins the calling thread to one CPU.
pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        let e = format!("CPU {cpu} is out of range: CPUs are numbered below {}", libc::CPU_SETSIZE);
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, e));
    }
    // SAFETY: as above, a zeroed cpu_set_t is empty.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t and cpu < CPU_SETSIZE was checked above, so
    // CPU_SET writes inside it.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: sched_setaffinity reads `set`, whose size we pass.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 { Err(std::io::Error::last_os_error()) } else { Ok(()) }
}

/// Starts a reactor thread, pinned to `core` if given, polling `busy_poll` after its
/// last completion.
pub fn spawn(
    id: usize,
    core: Option<usize>,
    busy_poll: Duration,
    target: Arc<Target>,
    links: Arc<Vec<ReactorLink>>,
    rx: Receiver<Msg>,
    wake: OwnedFd,
) -> std::io::Result<JoinHandle<()>> {
    // The ring is created on the reactor thread: a single-issuer ring belongs to the
    // thread that creates it. Creation errors are reported back before `spawn` returns.
    let (ready_tx, ready_rx) = mpsc::sync_channel::<std::io::Result<()>>(1);
    let handle = std::thread::Builder::new().name(format!("nvpool-reactor-{id}")).spawn(move || {
        if let Some(c) = core
            && let Err(e) = pin_current_thread(c)
        {
            tracing::warn!(reactor = id, "cannot pin to CPU {c}: {e}");
        }
        match Reactor::create(id, target, links, rx, wake) {
            Ok(mut r) => {
                r.busy_poll = busy_poll;
                let _ = ready_tx.send(Ok(()));
                r.run();
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        }
    })?;
    ready_rx.recv().map_err(|_| std::io::Error::other("reactor thread exited during start"))??;
    Ok(handle)
}

/// A ring whose completion work runs only when the reactor asks for it (deferred task
/// running, one issuer): no interrupts of the polling loop, and the cheapest wakeups.
/// The kernel flags pending completion work in the shared ring, so the polling loop
/// can tell without a system call whether entering the kernel would find anything.
/// Older kernels get cooperative task running, or a plain ring.
/// Returns the ring and whether it has that flag.
fn new_ring() -> std::io::Result<(IoUring, bool)> {
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

/// The warnings a reactor may log from its loop.
#[derive(Clone, Copy, Debug)]
enum Warning {
    Submit,
    Enter,
    Accept,
    // The last kind: `WARNING_KINDS` counts from it.
    Unregister,
}

/// Logs each kind of warning at most once a second: a failure that repeats on every
/// pass of the loop must flood neither the log nor the loop.
#[derive(Default)]
struct WarningLimit {
    last: [Option<Instant>; WARNING_KINDS],
    suppressed: [u32; WARNING_KINDS],
}

/// How many kinds of `Warning` there are: the last one's index plus one.
const WARNING_KINDS: usize = Warning::Unregister as usize + 1;

impl WarningLimit {
    /// Whether to log a warning of this kind now; if so, how many were held back
    /// since the last one logged.
    fn allow(&mut self, w: Warning) -> Option<u32> {
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

/// What a completion belongs to, packed into the 64-bit user data:
/// kind in bits 63:56, connection slot in bits 55:32, extra in bits 31:0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Accept(u16),
    Recv(u32),
    Send(u32),
    Disk(u32, u16),
    Wake,
    RemoteRecv(u32),
    RemoteSend(u32),
    /// A local device queue's command for a tag: (queue slot, tag).
    Local(u32, u16),
    /// A read of a virtqueue's kick eventfd: (queue slot).
    Kick(u32),
    /// A poll of the channel of the reactor's RDMA completion queue `i`.
    RdmaCq(u32),
}

impl Op {
    fn encode(self) -> u64 {
        let (kind, conn, extra) = match self {
            Op::Accept(port) => (1u64, 0u32, u32::from(port)),
            Op::Recv(c) => (2, c, 0),
            Op::Send(c) => (3, c, 0),
            Op::Disk(c, tag) => (4, c, u32::from(tag)),
            Op::Wake => (5, 0, 0),
            Op::RemoteRecv(q) => (6, q, 0),
            Op::RemoteSend(q) => (7, q, 0),
            Op::Local(q, tag) => (8, q, u32::from(tag)),
            Op::Kick(q) => (9, q, 0),
            Op::RdmaCq(i) => (10, i, 0),
        };
        kind << 56 | u64::from(conn & 0xFF_FFFF) << 32 | u64::from(extra)
    }

    fn decode(v: u64) -> Option<Op> {
        let conn = ((v >> 32) & 0xFF_FFFF) as u32;
        let extra = v as u32;
        Some(match v >> 56 {
            1 => Op::Accept(extra as u16),
            2 => Op::Recv(conn),
            3 => Op::Send(conn),
            4 => Op::Disk(conn, extra as u16),
            5 => Op::Wake,
            6 => Op::RemoteRecv(conn),
            7 => Op::RemoteSend(conn),
            8 => Op::Local(conn, extra as u16),
            9 => Op::Kick(conn),
            10 => Op::RdmaCq(conn),
            _ => return None,
        })
    }
}

/// One reactor's state.
///
/// Drop order matters: `ring` is declared first, so it is torn down (and the kernel
/// lets go of every registered buffer and pending operation) before the buffer pool,
/// the zeroes and the connections whose memory those operations point at.
struct Reactor {
    ring: IoUring,
    id: usize,
    target: Arc<Target>,
    links: Arc<Vec<ReactorLink>>,
    rx: Receiver<Msg>,
    wake_fd: OwnedFd,
    /// The eventfd read lands here. Leaked on purpose: the kernel may still write it
    /// while the ring is torn down after the thread exits.
    wake_buf: &'static mut u64,
    /// Whether the ring has its (sparse) buffer table.
    buffer_table: bool,
    /// The zero-copy slots ublk queues hold: (first slot, count).
    zero_copy_slots: Vec<(u32, u32)>,
    /// Next free slot of the registered-buffer table; `REGISTERED_BUFFERS` once the
    /// table is full or registration is unavailable.
    next_registered: u32,
    /// Slots of the registered-buffer table freed by `release_idle_buffers`.
    free_registered: Vec<u32>,
    /// Whether the memory of the last connections was given back since the reactor
    /// became idle.
    released_while_idle: bool,
    pool: BufPool,
    /// Zeroes sent for reads of null namespaces: no copy, and no stale data leaks.
    zeroes: Box<[u8]>,
    conns: Vec<Option<Box<Conn>>>,
    free_conns: Vec<u32>,
    /// Completion queues of the RDMA connections; after `conns`, so the queue pairs
    /// are destroyed before the queues they complete on.
    rdma: ReactorRdma,
    /// Completions taken from those queues in this pass.
    rdma_done: Vec<(u32, rdma::Done)>,
    /// Queues to owners of remote namespaces, by slot; boxed, so their buffers stay
    /// put while the table grows. Kept for the reactor's life.
    remotes: Vec<Option<Box<HostQueue>>>,
    /// The slot of each remote link this reactor has used.
    remote_slots: BTreeMap<u64, u32>,
    /// Its queues of local devices, by slot; boxed, so their buffers stay put.
    locals: Vec<Option<Box<LocalQueue>>>,
    /// Answers of forwarded commands, gathered during a call into a remote queue.
    answers: Vec<Answer>,
    listeners: BTreeMap<u16, TcpListener>,
    /// Listeners removed (port IDs are never reused).
    closed_ports: BTreeSet<u16>,
    next_owner: usize,
    /// How long to keep polling after the last completion (`busy_poll_us`); zero
    /// never polls.
    busy_poll: Duration,
    /// Whether the ring has a registered-file table for sockets.
    files_registered: bool,
    /// Whether the kernel flags pending completion work in the ring (see `new_ring`).
    taskrun_flag: bool,
    /// Disk operations that copy from memory were queued in this pass and are not yet
    /// submitted.
    disk_queued: bool,
    /// Disk operations submitted and not yet completed, over all connections.
    disk_in_flight: u32,
    /// Commands forwarded to owners of remote namespaces and not yet answered.
    remote_in_flight: u32,
    /// Commands waiting for their namespace's I/O budget.
    throttle: Throttle,
    /// The waiting commands let through in this pass.
    throttle_due: Vec<(u32, u16)>,
    /// Connections with output to flush at the end of this pass, each once.
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    stopping: bool,
    /// Where it stands in a hot upgrade.
    upgrade: Upgrade,
    /// Multishot accepts posted and not yet ended.
    armed_accepts: usize,
    last_tick: Instant,
    /// When this pass began, in nanoseconds since the target started: the clock
    /// commands are timed with, read once per pass.
    pass_ns: u64,
    warnings: WarningLimit,
}

impl Reactor {
    fn new(
        id: usize,
        ring: IoUring,
        target: Arc<Target>,
        links: Arc<Vec<ReactorLink>>,
        rx: Receiver<Msg>,
        wake_fd: OwnedFd,
    ) -> Reactor {
        Reactor {
            ring,
            id,
            target,
            links,
            rx,
            wake_fd,
            wake_buf: Box::leak(Box::new(0u64)),
            buffer_table: false,
            zero_copy_slots: Vec::new(),
            next_registered: 0,
            free_registered: Vec::new(),
            released_while_idle: true,
            pool: BufPool::new(MAX_TRANSFER),
            zeroes: vec![0u8; MAX_TRANSFER].into_boxed_slice(),
            conns: Vec::new(),
            free_conns: Vec::new(),
            rdma: ReactorRdma::default(),
            rdma_done: Vec::new(),
            remotes: Vec::new(),
            remote_slots: BTreeMap::new(),
            locals: Vec::new(),
            answers: Vec::new(),
            listeners: BTreeMap::new(),
            closed_ports: BTreeSet::new(),
            next_owner: 0,
            files_registered: false,
            busy_poll: Duration::from_micros(50),
            taskrun_flag: false,
            disk_queued: false,
            disk_in_flight: 0,
            remote_in_flight: 0,
            throttle: Throttle::default(),
            throttle_due: Vec::with_capacity(256),
            dirty: Vec::with_capacity(256),
            is_dirty: Vec::new(),
            stopping: false,
            upgrade: Upgrade::Serving,
            armed_accepts: 0,
            last_tick: Instant::now(),
            pass_ns: 0,
            warnings: WarningLimit::default(),
        }
    }

    /// A reactor with its ring, on the calling thread (a single-issuer ring belongs to
    /// the thread that creates it), its tables registered where the kernel allows.
    fn create(
        id: usize,
        target: Arc<Target>,
        links: Arc<Vec<ReactorLink>>,
        rx: Receiver<Msg>,
        wake: OwnedFd,
    ) -> std::io::Result<Reactor> {
        let (ring, taskrun_flag) = new_ring()?;
        let mut r = Reactor::new(id, ring, target, links, rx, wake);
        r.taskrun_flag = taskrun_flag;
        if r.ring.submitter().register_buffers_sparse(REGISTERED_BUFFERS + ZERO_COPY_SLOTS).is_err() {
            r.next_registered = REGISTERED_BUFFERS;
        } else {
            r.buffer_table = true;
        }
        r.files_registered = r.ring.submitter().register_files_sparse(REGISTERED_FILES).is_ok();
        Ok(r)
    }

    /// An I/O buffer from the pool, registered with the ring when it is new.
    /// Reserves `count` consecutive zero-copy slots of the buffer table for a ublk
    /// queue; returns the first.
    fn reserve_zero_copy_slots(&mut self, count: u32) -> Option<u16> {
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
    fn release_zero_copy_slots(&mut self, first: u16) {
        self.zero_copy_slots.retain(|&(start, _)| start != u32::from(first));
    }

    fn io_buf(&mut self, len: usize) -> crate::bufpool::Buf {
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
            let rc = unsafe { self.ring.submitter().register_buffers_update(slot, &[iov], None) };
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

    /// Queues an SQE, submitting first if the submission queue is full.
    ///
    /// # Safety
    /// Every buffer, descriptor array and header the entry points at must stay
    /// allocated, and must not be written by Rust (or read, where the kernel writes
    /// it), until the operation's completion has been reaped.
    unsafe fn push(&mut self, sqe: squeue::Entry) {
        loop {
            // SAFETY: the caller answers for the memory the entry points at.
            if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
                return;
            }
            if let Err(e) = self.ring.submit()
                && let Some(suppressed) = self.warnings.allow(Warning::Submit)
            {
                tracing::warn!(reactor = self.id, suppressed, "io_uring submit failed: {e}");
            }
        }
    }

    fn post_wake(&mut self) {
        let ptr: *mut u64 = self.wake_buf;
        let sqe =
            opcode::Read::new(types::Fd(self.wake_fd.as_raw_fd()), ptr.cast(), 8).build().user_data(Op::Wake.encode());
        // SAFETY: the read lands in `wake_buf`, which is leaked and so lives for ever.
        unsafe { self.push(sqe) };
    }

    fn post_accept(&mut self, port_id: u16) {
        if let Some(l) = self.listeners.get(&port_id) {
            let sqe =
                opcode::AcceptMulti::new(types::Fd(l.as_raw_fd())).build().user_data(Op::Accept(port_id).encode());
            // SAFETY: an accept points at no memory (no peer address is asked for).
            unsafe { self.push(sqe) };
            self.armed_accepts += 1;
        }
    }

    fn run(&mut self) {
        self.post_wake();
        let ts = types::Timespec::new().nsec(TICK.as_nanos() as u32);
        let throttled_ts = types::Timespec::new().nsec(THROTTLE_WAKE.as_nanos() as u32);
        let mut completions: Vec<(u64, i32, u32)> = Vec::with_capacity(RING_ENTRIES as usize * 4);
        let mut last_activity = Instant::now();
        // The clock is read once per pass, right after the enter: it serves the busy
        // check, the activity mark, the timers and the commands' latency.
        let mut now = last_activity;
        // Whether the last pass completed anything: its time, and the enter after it
        // unless that slept, counts as busy.
        let mut worked = false;
        loop {
            // Spin while busy: a request that follows a response within `busy_poll` is
            // picked up without a sleep and a wakeup. Idle, the thread sleeps on the ring.
            // Disk operations and forwarded commands in flight keep the reactor polling:
            // a disk or an owner answers in tens of microseconds, sooner than a sleeping
            // thread wakes up.
            let busy = !self.busy_poll.is_zero()
                && (self.disk_in_flight > 0
                    || self.remote_in_flight > 0
                    || now.duration_since(last_activity) < self.busy_poll);
            let entered = if busy {
                let (pending, kernel_work) = {
                    let sq = self.ring.submission();
                    (sq.len() as u32, sq.taskrun() || sq.cq_overflow())
                };
                if pending == 0 && self.taskrun_flag && !kernel_work {
                    // Nothing to submit and no completion work: polling stays in user
                    // space. A system call per pass would cost CPU that, in a virtual
                    // machine, the host also needs to run the guest's disks.
                    std::hint::spin_loop();
                    Ok(0)
                } else {
                    // Submits, runs completion work, and returns without waiting.
                    // SAFETY: no argument is passed; the flags are plain io_uring_enter flags.
                    unsafe { self.ring.submitter().enter::<libc::sigset_t>(pending, 0, IORING_ENTER_GETEVENTS, None) }
                }
            } else {
                // Commands waiting for budget are looked at again soon: their budget
                // fills with time, not with a completion.
                let wait = if self.throttle.waiting() > 0 { &throttled_ts } else { &ts };
                let args = types::SubmitArgs::new().timespec(wait);
                self.ring.submitter().submit_with_args(1, &args)
            };
            match entered {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => {}
                Err(e) => {
                    if let Some(suppressed) = self.warnings.allow(Warning::Enter) {
                        tracing::warn!(reactor = self.id, suppressed, "io_uring_enter failed: {e}");
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let pass_start = now;
            now = Instant::now();
            if let Some(link) = self.links.get(self.id) {
                link.time.add(now.duration_since(pass_start).as_nanos() as u64, worked && busy);
            }
            self.pass_ns = now.duration_since(self.target.started).as_nanos() as u64;
            worked = self.after_enter(&mut completions, now);
            if worked {
                last_activity = now;
            }
            if matches!(self.upgrade, Upgrade::Parking(_)) {
                self.park_progress();
            }
            if self.stopping
                && self.conns.iter().all(Option::is_none)
                && !self.locals.iter().flatten().any(|q| q.serving())
            {
                return;
            }
        }
    }

    /// The rest of a pass once the kernel was entered: reaps and handles every
    /// completion, runs the timers when due, submits queued disk work and flushes
    /// output. Returns whether anything completed.
    fn after_enter(&mut self, completions: &mut Vec<(u64, i32, u32)>, now: Instant) -> bool {
        completions.clear();
        completions.extend(self.ring.completion().map(|c| (c.user_data(), c.result(), c.flags())));
        for &(ud, res, flags) in completions.iter() {
            match Op::decode(ud) {
                Some(Op::Wake) => self.on_wake(),
                Some(Op::Accept(port)) => self.on_accept(port, res, flags),
                Some(Op::Recv(c)) => self.with_conn(c, |r, conn| conn.on_recv(r, c, res)),
                Some(Op::Send(c)) => self.with_conn(c, |r, conn| conn.on_send(r, c, res)),
                Some(Op::Disk(c, tag)) if c & LOCAL_OWNER != 0 => {
                    let q = c & !LOCAL_OWNER;
                    self.with_local(q, |r, queue| queue.on_disk(r, q, tag, res))
                }
                Some(Op::Disk(c, tag)) => self.with_conn(c, |r, conn| conn.on_disk(r, c, tag, res)),
                Some(Op::Local(q, tag)) => self.with_local(q, |r, queue| {
                    if let LocalQueue::Ublk(u) = queue {
                        u.on_command(r, q, tag, res)
                    }
                }),
                Some(Op::Kick(q)) => self.with_local(q, |r, queue| {
                    if let LocalQueue::Vhost(v) = queue {
                        v.on_kick(r, q, res)
                    }
                }),
                Some(Op::RdmaCq(i)) => self.on_rdma_event(i as usize),
                Some(Op::RemoteRecv(q)) => self.with_remote(q, |r, queue, answers| queue.on_recv(r, q, res, answers)),
                Some(Op::RemoteSend(q)) => self.with_remote(q, |r, queue, answers| queue.on_send(r, q, res, answers)),
                None => {}
            }
        }
        let rdma_work = self.rdma.active() && self.poll_rdma();
        if now.duration_since(self.last_tick) >= TICK {
            self.last_tick = now;
            self.tick();
        }
        if self.throttle.waiting() > 0 {
            self.start_throttled();
        }
        if self.disk_queued {
            self.submit_disk_ops();
        }
        self.flush_dirty();
        !completions.is_empty() || rdma_work
    }

    /// Handles what the RDMA completion queues completed; returns whether anything did.
    fn poll_rdma(&mut self) -> bool {
        let mut done = std::mem::take(&mut self.rdma_done);
        self.rdma.poll(&mut done);
        let any = !done.is_empty();
        for &(c, d) in &done {
            self.with_conn(c, |r, conn| conn.on_rdma(r, c, d));
        }
        done.clear();
        self.rdma_done = done;
        any
    }

    /// Watches RDMA completion queue `i`'s channel with the ring.
    fn watch_rdma_cq(&mut self, i: usize) {
        let Some(fd) = self.rdma.channel_fd(i) else { return };
        let sqe =
            opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build().user_data(Op::RdmaCq(i as u32).encode());
        // SAFETY: a poll points at no memory; the channel lives as long as the reactor.
        unsafe { self.push(sqe) };
    }

    /// Completion queue `i` signalled: its events are taken and it is armed again (the
    /// pass then polls it), and its channel watched again.
    fn on_rdma_event(&mut self, i: usize) {
        self.rdma.rearm(i);
        self.watch_rdma_cq(i);
    }

    /// Accepts an RDMA connection on this reactor.
    fn add_rdma_conn(&mut self, incoming: crate::rdma::Incoming) {
        let port_id = incoming.port_id;
        if self.stopping || self.held() || self.closed_ports.contains(&port_id) {
            incoming.id.reject(&nvpool_wire::rdma::RejectReason::NoResources.encode());
            return;
        }
        let idx = self.free_conns.pop().unwrap_or_else(|| {
            self.conns.push(None);
            (self.conns.len() - 1) as u32
        });
        match RdmaWire::accept(self, idx, incoming) {
            Ok((wire, posted, accepted)) => {
                let mut conn = Conn::rdma(Box::new(wire), posted, self.target.now_ms(), port_id);
                if let Err(e) = accepted {
                    // Freed once its receives come back flushed (or at the next tick).
                    tracing::warn!(reactor = self.id, port_id, "{e}");
                    conn.begin_close();
                }
                self.target.connection_opened();
                self.conns[idx as usize] = Some(Box::new(conn));
            }
            Err(e) => {
                tracing::warn!(reactor = self.id, port_id, "refused an RDMA connection: {e}");
                self.free_conns.push(idx);
            }
        }
    }

    /// Ends the RDMA connection with `serial`, which its host or the network ended.
    fn rdma_disconnected(&mut self, serial: u64) {
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |_, conn| {
                if conn.rdma_serial() == Some(serial) {
                    conn.begin_close();
                }
            });
        }
    }

    /// Starts the commands that waited for their namespace's I/O budget and now have
    /// it. While a hot upgrade parks the reactor, every one starts: parking waits for
    /// the commands under way, and the new process gets no waiting ones.
    fn start_throttled(&mut self) {
        let mut due = std::mem::take(&mut self.throttle_due);
        let everything = matches!(self.upgrade, Upgrade::Parking(_)) || self.stopping;
        self.throttle.due(self.pass_ns, everything, &mut due);
        for &(owner, tag) in &due {
            self.resumed(owner, tag, nvpool_wire::Status::SUCCESS, None);
        }
        due.clear();
        self.throttle_due = due;
    }

    /// Runs `f` on connection `c` with the connection taken out of the table, so `f`
    /// can use the rest of the reactor. The box keeps the connection's memory in place.
    fn with_conn(&mut self, c: u32, f: impl FnOnce(&mut Reactor, &mut Conn)) {
        let Some(mut conn) = self.conns.get_mut(c as usize).and_then(Option::take) else {
            return;
        };
        f(self, &mut conn);
        if conn.can_free() {
            self.free_conn(c, conn);
        } else {
            self.conns[c as usize] = Some(conn);
        }
    }

    /// Runs `f` on remote queue `q` taken out of the table, then delivers the answers
    /// it gathered to their connections.
    fn with_remote(&mut self, q: u32, f: impl FnOnce(&mut Reactor, &mut HostQueue, &mut Vec<Answer>)) {
        let Some(mut queue) = self.remotes.get_mut(q as usize).and_then(Option::take) else {
            return;
        };
        let mut answers = std::mem::take(&mut self.answers);
        f(self, &mut queue, &mut answers);
        self.remotes[q as usize] = Some(queue);
        for a in answers.drain(..) {
            self.remote_in_flight -= 1;
            self.resumed(a.conn, a.tag, a.status, a.buf);
        }
        self.answers = answers;
    }

    /// Routes the answer to a command handed to another thread or engine back to
    /// whoever issued it: a connection, or a local device queue.
    fn resumed(&mut self, owner: u32, tag: u16, status: nvpool_wire::Status, buf: Option<crate::bufpool::Buf>) {
        if owner & LOCAL_OWNER != 0 {
            let q = owner & !LOCAL_OWNER;
            self.with_local(q, |r, queue| queue.on_resumed(r, q, tag, status, buf));
        } else {
            self.with_conn(owner, |r, c| c.on_resumed(r, owner, tag, status, buf));
        }
    }

    /// Runs `f` on local device queue `q` taken out of the table. A queue that ended
    /// is dropped, and whoever waits for it told.
    fn with_local(&mut self, q: u32, f: impl FnOnce(&mut Reactor, &mut LocalQueue)) {
        let Some(mut queue) = self.locals.get_mut(q as usize).and_then(Option::take) else {
            return;
        };
        f(self, &mut queue);
        if queue.ended() {
            queue.finish(self);
        } else {
            self.locals[q as usize] = Some(queue);
        }
    }

    /// Puts a local device queue in a free slot of the table; returns the slot.
    fn insert_local(&mut self, queue: LocalQueue) -> u32 {
        let q = match self.locals.iter().position(Option::is_none) {
            Some(q) => q as u32,
            None => {
                self.locals.push(None);
                (self.locals.len() - 1) as u32
            }
        };
        self.locals[q as usize] = Some(Box::new(queue));
        q
    }

    /// Starts serving queue `queue` of a ublk device: every tag goes to the driver.
    fn add_ublk_queue(&mut self, device: Arc<crate::local::LocalDevice>, queue: u16) -> Result<(), String> {
        let local = UblkQueue::new(self, device, queue)?;
        let q = self.insert_local(LocalQueue::Ublk(local));
        self.with_local(q, |r, queue| {
            if let LocalQueue::Ublk(u) = queue {
                u.fetch_all(r, q)
            }
        });
        Ok(())
    }

    /// Starts serving a vhost-user-blk virtqueue.
    fn add_vhost_ring(&mut self, ring: Box<crate::local::vhost::Ring>) -> Result<(), String> {
        let (queue, pending) = VhostQueue::new(ring)?;
        let q = self.insert_local(LocalQueue::Vhost(queue));
        self.with_local(q, |r, queue| {
            if let LocalQueue::Vhost(v) = queue {
                v.begin(r, q, pending)
            }
        });
        Ok(())
    }

    /// Stops virtqueue run `id`, if it runs here.
    fn stop_vhost_ring(&mut self, id: u64, done: Sender<u16>) {
        let found = self.locals.iter().position(|l| matches!(l.as_deref(), Some(LocalQueue::Vhost(v)) if v.is(id)));
        match found {
            Some(q) => self.with_local(q as u32, |r, queue| {
                if let LocalQueue::Vhost(v) = queue {
                    v.stop(r, q as u32, done)
                }
            }),
            None => drop(done),
        }
    }

    /// Forwards a command to the owner of a remote namespace on this reactor's queue
    /// to it, made on first use.
    pub(super) fn forward(&mut self, link: &Arc<RemoteLink>, f: Forwarded) {
        let q = match self.remote_slots.get(&link.id) {
            Some(&q) => q,
            None => {
                let q = self.remotes.len() as u32;
                self.remotes.push(Some(Box::new(HostQueue::new(link.clone()))));
                self.remote_slots.insert(link.id, q);
                q
            }
        };
        self.remote_in_flight += 1;
        self.with_remote(q, |r, queue, _| queue.forward(r, q, f));
    }

    fn on_wake(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            match m {
                Msg::Adopt { stream, port_id, tls } => self.add_conn(stream, Some(port_id), tls),
                Msg::Listen { port_id, listener } => {
                    self.listeners.insert(port_id, listener);
                    self.post_accept(port_id);
                }
                Msg::Unlisten(port_id) => self.unlisten(port_id),
                Msg::Kick => self.kick(),
                Msg::Deferred { conn, tag, status } => self.resumed(conn, tag, status, None),
                Msg::AuthChecked { conn, cid, checked } => {
                    self.with_conn(conn, |r, c| c.on_auth_checked(r, conn, cid, checked));
                }
                Msg::RemoteSocket(socket) => {
                    if let Some(&q) = self.remote_slots.get(&socket.link) {
                        self.with_remote(q, |r, queue, _| queue.on_socket(r, q, socket));
                    }
                }
                Msg::LocalQueue { device, queue, done } => {
                    let _ = done.send(self.add_ublk_queue(device, queue));
                }
                Msg::VhostRing { ring, done } => {
                    let _ = done.send(self.add_vhost_ring(ring));
                }
                Msg::VhostStop { id, done } => self.stop_vhost_ring(id, done),
                Msg::Park(report) => self.park(report),
                Msg::Resume => self.resume(),
                Msg::Restore { conns, listeners, done } => self.restore(conns, listeners, done),
                Msg::RdmaQueue(incoming) => self.add_rdma_conn(*incoming),
                Msg::RdmaDisconnected(serial) => self.rdma_disconnected(serial),
                Msg::Stop => {
                    self.stopping = true;
                    let ports: Vec<u16> = self.listeners.keys().copied().collect();
                    for p in ports {
                        self.unlisten(p);
                    }
                    for c in 0..self.conns.len() as u32 {
                        self.with_conn(c, |_, conn| conn.begin_close());
                    }
                }
            }
        }
        if !self.stopping {
            self.post_wake();
        }
    }

    /// Stops listener `port_id`, if this reactor has it, and ends the connections it
    /// accepted: like nvmet and SPDK, a removed port takes its paths down, and their
    /// hosts go over to the paths they have left.
    fn unlisten(&mut self, port_id: u16) {
        self.closed_ports.insert(port_id);
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |_, conn| {
                if conn.port_id == Some(port_id) {
                    conn.begin_close();
                }
            });
        }
        if self.listeners.remove(&port_id).is_some() {
            // The ring holds its own reference to the socket: cancel the armed accept
            // so the socket really closes.
            let sqe = opcode::AsyncCancel::new(Op::Accept(port_id).encode()).build().user_data(0);
            // SAFETY: a cancellation points at no memory.
            unsafe { self.push(sqe) };
        }
    }

    fn on_accept(&mut self, port_id: u16, res: i32, flags: u32) {
        if res >= 0 {
            // SAFETY: a successful accept returns a new descriptor we now own.
            let stream = unsafe { TcpStream::from_raw_fd(res as RawFd) };
            let tls = self.target.listener_tls(port_id);
            if tls != crate::tls::TlsMode::Off {
                // The handshake runs on a thread of its own, which hands the socket on.
                crate::tls::admit(stream, port_id, tls, self.target.clone(), self.links.clone());
            } else {
                let owner = self.next_owner % self.links.len();
                self.next_owner += 1;
                if owner == self.id {
                    self.add_conn(stream, Some(port_id), None);
                } else {
                    self.links[owner].send(Msg::Adopt { stream, port_id, tls: None });
                }
            }
        } else if res != -libc::ECANCELED
            && let Some(suppressed) = self.warnings.allow(Warning::Accept)
        {
            let e = std::io::Error::from_raw_os_error(-res);
            tracing::warn!(reactor = self.id, suppressed, "accept on port {port_id} failed: {e}");
        }
        if !cqueue::more(flags) {
            self.armed_accepts -= 1;
            if !self.stopping && !self.held() {
                self.post_accept(port_id);
            }
        }
    }

    /// Serves a connection that listener `port_id` accepted (`None`: a socket pair),
    /// with the peer its TLS session proved if it has one.
    fn add_conn(&mut self, stream: TcpStream, port_id: Option<u16>, tls: Option<Box<TlsPeer>>) {
        // A connection handed over after its listener was removed is dropped, as the
        // listener's other connections were.
        if self.stopping || port_id.is_some_and(|p| self.closed_ports.contains(&p)) {
            return;
        }
        // Small PDUs must leave at once; the reactor batches writes itself.
        let _ = stream.set_nodelay(true);
        let mut conn = Box::new(Conn::new(stream, self.target.now_ms(), port_id, tls));
        if self.held() {
            conn.park();
        }
        let idx = self.insert_conn(conn);
        self.with_conn(idx, |r, conn| conn.post_recv(r, idx));
    }

    /// Puts a connection in a free slot of the table, its socket in the ring's file
    /// table where there is room; returns the slot.
    fn insert_conn(&mut self, mut conn: Box<Conn>) -> u32 {
        let idx = self.free_conns.pop().unwrap_or_else(|| {
            self.conns.push(None);
            (self.conns.len() - 1) as u32
        });
        if self.files_registered
            && idx < REGISTERED_FILES
            && let Some(fd) = conn.raw_fd()
            && self.ring.submitter().register_files_update(idx, &[fd]).is_ok()
        {
            conn.set_registered_file(idx);
        }
        self.target.connection_opened();
        self.conns[idx as usize] = Some(conn);
        idx
    }

    // ----- hot upgrade --------------------------------------------------------------

    /// Whether a hot upgrade holds this reactor still: nothing is accepted, no new
    /// command is taken and no timer ends a connection.
    fn held(&self) -> bool {
        !matches!(self.upgrade, Upgrade::Serving)
    }

    /// Starts parking: accepts are taken back and every connection parks.
    fn park(&mut self, report: Sender<Result<Parked, String>>) {
        self.upgrade = Upgrade::Parking(report);
        let ports: Vec<u16> = self.listeners.keys().copied().collect();
        for port_id in ports {
            let sqe = opcode::AsyncCancel::new(Op::Accept(port_id).encode()).build().user_data(0);
            // SAFETY: a cancellation points at no memory.
            unsafe { self.push(sqe) };
        }
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |_, conn| conn.park());
        }
        self.park_progress();
    }

    /// Reports the parked state once every connection is parked (or gone) and no
    /// accept is armed.
    fn park_progress(&mut self) {
        let mut all = true;
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |r, conn| all &= conn.park_step(r, c));
        }
        let local_serving = self.locals.iter().flatten().any(|q| q.serving());
        if !all || local_serving || self.armed_accepts > 0 {
            return;
        }
        let Upgrade::Parking(report) = std::mem::replace(&mut self.upgrade, Upgrade::Parked) else { return };
        let copies = || -> std::io::Result<Parked> {
            let mut conns = Vec::new();
            // RDMA connections are not handed on (an upgrade with RDMA listeners is
            // refused before it parks anything).
            for conn in self.conns.iter().flatten() {
                if let Some(image) = conn.image(self.id, 0) {
                    conns.push((image, conn.dup_socket()?));
                }
            }
            let mut listeners = Vec::new();
            for (&port_id, l) in &self.listeners {
                listeners.push((port_id, l.try_clone()?));
            }
            Ok(Parked { reactor: self.id, conns, listeners })
        };
        let _ = report.send(copies().map_err(|e| format!("reactor {} cannot copy a socket: {e}", self.id)));
    }

    /// Serves again: after parking (the upgrade was called off), or once a new
    /// process was told to go on with what it restored.
    fn resume(&mut self) {
        self.upgrade = Upgrade::Serving;
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |r, conn| conn.resume(r, c));
        }
        let ports: Vec<u16> = self.listeners.keys().copied().collect();
        for p in ports {
            self.post_accept(p);
        }
        for q in 0..self.locals.len() as u32 {
            self.with_local(q, |r, queue| queue.start_held(r, q));
        }
    }

    /// Takes the connections and listeners another engine process parked, and holds
    /// them parked until `resume`.
    fn restore(
        &mut self,
        conns: Vec<(TcpStream, ConnImage, Option<Arc<Controller>>)>,
        listeners: Vec<(u16, TcpListener)>,
        done: Sender<Result<usize, String>>,
    ) {
        self.upgrade = Upgrade::Parked;
        self.listeners.extend(listeners);
        let count = conns.len();
        let taken = || -> Result<usize, String> {
            for (stream, image, controller) in conns {
                let conn = Conn::restore(stream, &image, controller, self.target.now_ms())?;
                self.insert_conn(Box::new(conn));
            }
            Ok(count)
        };
        let _ = done.send(taken());
    }

    fn free_conn(&mut self, idx: u32, mut conn: Box<Conn>) {
        // The table holds its own reference to the socket: drop it, or the socket
        // would stay open after the connection is freed.
        if let Some(slot) = conn.take_registered_file()
            && let Err(e) = self.ring.submitter().register_files_update(slot, &[-1])
            && let Some(suppressed) = self.warnings.allow(Warning::Unregister)
        {
            tracing::warn!(reactor = self.id, suppressed, "cannot unregister a closed socket: {e}");
        }
        conn.release(self);
        drop(conn);
        self.target.connection_closed();
        self.free_conns.push(idx);
    }

    fn kick(&mut self) {
        // Parked connections are handed over as they are: nothing new goes out.
        if self.held() {
            return;
        }
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |r, conn| conn.check(r, c, false));
        }
    }

    fn tick(&mut self) {
        // Parked, no timer may end a connection: a hot upgrade's new process may be
        // serving it already.
        if !self.held() {
            for c in 0..self.conns.len() as u32 {
                self.with_conn(c, |r, conn| conn.check(r, c, true));
            }
        }
        self.throttle.forget_removed();
        if let Some(link) = self.links.get(self.id) {
            let open = self.conns.len() - self.free_conns.len();
            link.time.set_load(open, self.throttle.waiting());
        }
        let now = self.target.now_ms();
        for q in 0..self.remotes.len() as u32 {
            self.with_remote(q, |_, queue, answers| queue.tick(now, answers));
        }
        let idle = self.conns.iter().all(Option::is_none);
        if idle && !self.released_while_idle {
            self.release_idle_buffers();
            // The connections' own allocations (slots, output queues) went back to the
            // allocator, which keeps them in its arenas; hand the free pages back.
            // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
            unsafe { libc::malloc_trim(0) };
        }
        self.released_while_idle = idle;
    }

    /// Gives the pool's buffers back to the system once the reactor serves no
    /// connection, so a storm of hosts that came and went leaves nothing behind. A
    /// registered buffer leaves the ring's table first, and its slot is reused.
    fn release_idle_buffers(&mut self) {
        let unregister = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
        for buf in self.pool.take_all() {
            if let Some(slot) = buf.registered_index().map(u32::from) {
                // SAFETY: an empty entry clears the slot; the buffer is free (no
                // operation uses it) and lives until after the update returns.
                if unsafe { self.ring.submitter().register_buffers_update(slot, &[unregister], None) }.is_err() {
                    // Still in the table: it must stay alive.
                    self.pool.put(buf);
                    continue;
                }
                self.free_registered.push(slot);
            }
        }
    }

    /// Accounts for the disk operations a backend call queued: I/O to a device is
    /// handed to the kernel at once; I/O that copies from memory (page cache, tmpfs)
    /// completes within the submitting call and waits for the end of the pass, when
    /// one call submits it all (see `submit_disk_ops`).
    pub(super) fn disk_ops_queued(&mut self, queued: &block_io::Queued) {
        self.disk_in_flight += queued.ops;
        if queued.ops > 0 {
            if queued.on_device {
                self.submit_disk_ops();
            } else {
                self.disk_queued = true;
            }
        }
    }

    /// Hands queued disk operations to the kernel.
    ///
    /// I/O to a device is submitted as soon as its command is parsed (see `Conn::queued`):
    /// the device starts on the first request of a burst while the reactor parses the
    /// rest. Batching a pass's reads cost about a tenth of a virtual disk's IOPS at
    /// depth 32, because an `io_uring_enter` with more than two entries holds its block
    /// requests back (a block plug) until all are issued, and the device is notified
    /// once, late. A system call per command is cheap next to a device's latency.
    ///
    /// I/O that copies from memory (page cache, tmpfs) completes inside the submitting
    /// call, so a call per command would only add system calls (a third fewer IOPS on tmpfs);
    /// it is submitted once at the end of the pass, before any send is queued (a large
    /// send copies its data first and would hold the reads back).
    pub(super) fn submit_disk_ops(&mut self) {
        self.disk_queued = false;
        if let Err(e) = self.ring.submit()
            && let Some(suppressed) = self.warnings.allow(Warning::Submit)
        {
            tracing::warn!(reactor = self.id, suppressed, "io_uring submit failed: {e}");
        }
    }

    fn mark_dirty(&mut self, c: u32) {
        let i = c as usize;
        if self.is_dirty.len() <= i {
            self.is_dirty.resize(i + 1, false);
        }
        if !self.is_dirty[i] {
            self.is_dirty[i] = true;
            self.dirty.push(c);
        }
    }

    fn flush_dirty(&mut self) {
        while let Some(c) = self.dirty.pop() {
            self.is_dirty[c as usize] = false;
            self.with_conn(c, |r, conn| {
                conn.post_send(r, c);
                conn.post_recv(r, c);
            });
        }
    }
}

/// A reactor run by its caller, one pass per call, on the caller's thread and never
/// waiting: the whole connection state machine (framing, dispatch, backends, sends)
/// with no other thread and no timing in the way. The connection fuzzer drives it over
/// socket pairs, millions of scripts an hour.
pub struct Stepped {
    reactor: Reactor,
    completions: Vec<(u64, i32, u32)>,
}

impl Stepped {
    /// A reactor serving `target`'s subsystems.
    pub fn new(target: Arc<Target>) -> std::io::Result<Stepped> {
        let (link, rx, wake) = mailbox()?;
        let mut reactor = Reactor::create(0, target, Arc::new(vec![link]), rx, wake)?;
        reactor.post_wake();
        Ok(Stepped { reactor, completions: Vec::with_capacity(RING_ENTRIES as usize * 4) })
    }

    /// Serves one end of a stream socket pair as an NVMe/TCP connection. A connection
    /// only receives, sends and shuts down, which every stream socket does alike.
    pub fn serve(&mut self, socket: UnixStream) {
        self.reactor.add_conn(TcpStream::from(OwnedFd::from(socket)), None, None);
    }

    /// One pass: submits what is queued, handles whatever completed, flushes output.
    /// Returns whether anything completed.
    pub fn pass(&mut self) -> bool {
        let pending = self.reactor.ring.submission().len() as u32;
        // SAFETY: no argument is passed; the flags are plain io_uring_enter flags.
        let entered =
            unsafe { self.reactor.ring.submitter().enter::<libc::sigset_t>(pending, 0, IORING_ENTER_GETEVENTS, None) };
        if let Err(e) = entered
            && !matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY))
        {
            tracing::warn!("io_uring_enter failed: {e}");
        }
        self.reactor.after_enter(&mut self.completions, Instant::now())
    }

    /// Connections open, closing ones included.
    pub fn connections(&self) -> usize {
        self.reactor.conns.iter().filter(|c| c.is_some()).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        for op in [
            Op::Accept(7),
            Op::Recv(0xABCDE),
            Op::Send(1),
            Op::Disk(0xFF_FFFF, 0xFFFF),
            Op::Wake,
            Op::RemoteRecv(3),
            Op::RemoteSend(0xFF_FFFF),
            Op::Local(2, 4095),
            Op::Kick(0xFF_FFFF),
            Op::RdmaCq(2),
        ] {
            assert_eq!(Op::decode(op.encode()), Some(op));
        }
        assert_eq!(Op::decode(0), None);
    }

    #[test]
    fn a_stepped_reactor_answers_and_frees_a_connection_on_the_callers_thread() {
        use nvpool_wire::tcp::{self, Digests, IcReq, Pdu};
        use std::io::{Read, Write};

        let mut reactor = Stepped::new(Target::new(crate::config::Limits::default())).expect("a ring");
        let (host, engine_end) = UnixStream::pair().unwrap();
        host.set_nonblocking(true).unwrap();
        reactor.serve(engine_end);
        let mut ic = [0u8; tcp::IC_SIZE];
        tcp::encode_ic_req(&IcReq { pfv: 0, hpda: 0, digests: Digests::default(), maxr2t: 0 }, &mut ic);
        (&host).write_all(&ic).unwrap();
        let mut got = Vec::new();
        let mut chunk = [0u8; 512];
        for _ in 0..1000 {
            reactor.pass();
            if let Ok(n) = (&host).read(&mut chunk) {
                got.extend_from_slice(&chunk[..n]);
            }
            if got.len() >= tcp::IC_SIZE {
                break;
            }
        }
        let parsed = tcp::parse(&got, Digests::default(), tcp::DataLimits::uniform(4096)).unwrap().unwrap();
        assert!(matches!(parsed.pdu, Pdu::IcResp(_)), "{:?}", parsed.pdu);
        assert_eq!(reactor.connections(), 1);
        drop(host);
        for _ in 0..1000 {
            reactor.pass();
            if reactor.connections() == 0 {
                break;
            }
        }
        assert_eq!(reactor.connections(), 0, "the host closed; the engine frees its side");
    }
}

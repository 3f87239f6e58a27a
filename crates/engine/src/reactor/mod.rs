//! Reactors: one thread per configured core, each running the loop of one io_uring
//! (`crate::ring`) that carries both socket and disk I/O.
//!
//! A reactor runs to completion. Each pass of its loop enters the kernel once if there
//! is anything to submit or any completion work pending (the ring flags it), reaps
//! every completion, parses what arrived, queues the disk and socket work, and then
//! flushes each connection's output as one `sendmsg`. I/O to a disk device is handed to
//! the kernel as soon as its command is parsed, I/O served from memory (page cache) once
//! per pass before the sends (see `Ring::submit_disk_ops`).
//! Idle, the reactor sleeps in the kernel until a completion arrives. Nothing on the
//! I/O path takes a lock or allocates once buffers are warm.
//!
//! The loop knows its hot path: connections (`conn.rs`: a queue of a host, over TCP in
//! `tcp.rs` or RDMA in `rdma.rs`), their receives, sends and disk operations. Everything
//! else runs on the ring as a client (`crate::ring::RingClient`) that registers itself:
//! listeners, queues to other engines, local devices' queues. Other threads talk to a
//! reactor through its mailbox (a channel plus an eventfd that wakes the ring): mail
//! for the ring (answers to deferred commands, messages for clients), and closures run
//! on the reactor for the rare control work. Hot-upgrade parking is in `park.rs`.
#![allow(unsafe_code)]

mod conn;
mod park;
mod rdma;
mod tcp;

pub use conn::{ConnImage, QueueImage};
pub use park::Parked;
pub use rdma::Incoming;

use std::collections::BTreeSet;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use io_uring::{opcode, types};

use crate::nvme::{MAX_TRANSFER, Target};
use crate::ring::{Answer, CLIENT_OWNER, Mail, Mailer, Op, RING_ENTRIES, Ring, Warning};
use crate::tls::TlsPeer;
use conn::Conn;
use park::Upgrade;
use rdma::{RdmaWire, ReactorRdma};

/// How often timers (keep-alive, dead controllers, idle handshakes) are checked.
const TICK: Duration = Duration::from_millis(100);
/// How long a reactor with commands waiting for I/O budget sleeps at most: well under
/// the burst a budget holds (`qos::BURST_MS`), so a waiting command loses none of it.
const THROTTLE_WAKE: Duration = Duration::from_micros(200);
/// io_uring_enter flag: process completions (run deferred work) before returning.
const IORING_ENTER_GETEVENTS: u32 = 1;

/// Work for a reactor, from another thread.
pub enum Msg {
    /// Mail for the ring: an answer to a deferred command, a message for a client.
    Mail(Mail),
    /// Run on the reactor's thread, with the reactor.
    Run(Box<dyn FnOnce(&mut Reactor) + Send>),
}

/// A handle to send work to a reactor and wake it.
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

    fn send(&self, m: Msg) {
        if self.tx.send(m).is_ok() {
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local u64 to an eventfd this link owns.
            unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Runs `f` on the reactor's thread, with the reactor, and wakes it.
    pub fn run(&self, f: impl FnOnce(&mut Reactor) + Send + 'static) {
        self.send(Msg::Run(Box::new(f)));
    }

    /// Sends mail to the reactor's ring, and wakes it.
    pub fn mail(&self, m: Mail) {
        self.send(Msg::Mail(m));
    }
}

/// The links of every reactor of an engine.
pub type Links = Arc<Vec<ReactorLink>>;

/// Creates the mailbox of a reactor: the link other threads use, and the receiving
/// end the reactor keeps.
pub fn mailbox() -> std::io::Result<(ReactorLink, Receiver<Msg>, OwnedFd)> {
    // SAFETY: eventfd returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is new and owned by nobody else.
    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let reactor_side = owned.try_clone()?;
    let (tx, rx) = mpsc::channel();
    Ok((ReactorLink { tx, wake: owned, time: ReactorClock::default() }, rx, reactor_side))
}

/// Starts a reactor thread, pinned to `core` if given, polling `busy_poll` after its
/// last completion.
pub fn spawn(
    id: usize,
    core: Option<usize>,
    busy_poll: Duration,
    target: Arc<Target>,
    links: Links,
    rx: Receiver<Msg>,
    wake: OwnedFd,
) -> std::io::Result<JoinHandle<()>> {
    // The ring is created on the reactor thread: a single-issuer ring belongs to the
    // thread that creates it. Creation errors are reported back before `spawn` returns.
    let (ready_tx, ready_rx) = mpsc::sync_channel::<std::io::Result<()>>(1);
    let handle = std::thread::Builder::new().name(format!("nvpool-reactor-{id}")).spawn(move || {
        if let Some(c) = core
            && let Err(e) = crate::cpu::pin_current_thread(c)
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

/// One reactor's state.
///
/// Drop order matters: `ring` is declared first, so it is torn down (and the kernel
/// lets go of every pending operation) before the connections whose memory those
/// operations point at.
pub struct Reactor {
    /// The ring and what its operations share, clients included.
    pub ring: Ring,
    target: Arc<Target>,
    links: Links,
    rx: Receiver<Msg>,
    wake_fd: OwnedFd,
    /// The eventfd read lands here. Leaked on purpose: the kernel may still write it
    /// while the ring is torn down after the thread exits.
    wake_buf: &'static mut u64,
    /// Whether the memory of the last connections was given back since the reactor
    /// became idle.
    released_while_idle: bool,
    conns: Vec<Option<Box<Conn>>>,
    free_conns: Vec<u32>,
    /// Completion queues of the RDMA connections; after `conns`, so the queue pairs
    /// are destroyed before the queues they complete on.
    rdma: ReactorRdma,
    /// Completions taken from those queues in this pass.
    rdma_done: Vec<(u32, rdma::Done)>,
    /// Answers being given to their issuers.
    answers: Vec<Answer>,
    /// Listeners removed (port IDs are never reused): a connection they accepted that
    /// arrives later is dropped.
    closed_ports: BTreeSet<u16>,
    /// How long to keep polling after the last completion (`busy_poll_us`); zero
    /// never polls.
    busy_poll: Duration,
    /// Connections with output to flush at the end of this pass, each once.
    dirty: Vec<u32>,
    is_dirty: Vec<bool>,
    stopping: bool,
    /// Where it stands in a hot upgrade.
    upgrade: Upgrade,
    last_tick: Instant,
}

impl Reactor {
    /// A reactor with its ring, on the calling thread.
    fn create(
        id: usize,
        target: Arc<Target>,
        links: Links,
        rx: Receiver<Msg>,
        wake_fd: OwnedFd,
    ) -> std::io::Result<Reactor> {
        let to_self = links.clone();
        let mailer = Mailer::new(move |m| to_self[id].mail(m));
        Ok(Reactor {
            ring: Ring::new(id, MAX_TRANSFER, mailer)?,
            target,
            links,
            rx,
            wake_fd,
            wake_buf: Box::leak(Box::new(0u64)),
            released_while_idle: true,
            conns: Vec::new(),
            free_conns: Vec::new(),
            rdma: ReactorRdma::default(),
            rdma_done: Vec::new(),
            answers: Vec::with_capacity(256),
            closed_ports: BTreeSet::new(),
            busy_poll: Duration::from_micros(50),
            dirty: Vec::with_capacity(256),
            is_dirty: Vec::new(),
            stopping: false,
            upgrade: Upgrade::Serving,
            last_tick: Instant::now(),
        })
    }

    /// This reactor's index.
    pub fn id(&self) -> usize {
        self.ring.id
    }

    /// The target it serves.
    pub fn target(&self) -> &Arc<Target> {
        &self.target
    }

    /// The links of every reactor of the engine.
    pub fn links(&self) -> &Links {
        &self.links
    }

    fn post_wake(&mut self) {
        let ptr: *mut u64 = self.wake_buf;
        let sqe =
            opcode::Read::new(types::Fd(self.wake_fd.as_raw_fd()), ptr.cast(), 8).build().user_data(Op::Wake.encode());
        // SAFETY: the read lands in `wake_buf`, which is leaked and so lives for ever.
        unsafe { self.ring.push(sqe) };
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
            // Disk operations and commands handed to other engines in flight keep the
            // reactor polling: a disk or an owner answers in tens of microseconds,
            // sooner than a sleeping thread wakes up.
            let busy = !self.busy_poll.is_zero()
                && (self.ring.disk_in_flight > 0
                    || self.ring.handed_out > 0
                    || now.duration_since(last_activity) < self.busy_poll);
            let taskrun_flag = self.ring.taskrun_flag;
            let waiting = self.ring.throttle.waiting();
            let uring = self.ring.uring();
            let entered = if busy {
                let (pending, kernel_work) = {
                    let sq = uring.submission();
                    (sq.len() as u32, sq.taskrun() || sq.cq_overflow())
                };
                if pending == 0 && taskrun_flag && !kernel_work {
                    // Nothing to submit and no completion work: polling stays in user
                    // space. A system call per pass would cost CPU that, in a virtual
                    // machine, the host also needs to run the guest's disks.
                    std::hint::spin_loop();
                    Ok(0)
                } else {
                    // Submits, runs completion work, and returns without waiting.
                    // SAFETY: no argument is passed; the flags are plain io_uring_enter flags.
                    unsafe { uring.submitter().enter::<libc::sigset_t>(pending, 0, IORING_ENTER_GETEVENTS, None) }
                }
            } else {
                // Commands waiting for budget are looked at again soon: their budget
                // fills with time, not with a completion.
                let wait = if waiting > 0 { &throttled_ts } else { &ts };
                let args = types::SubmitArgs::new().timespec(wait);
                uring.submitter().submit_with_args(1, &args)
            };
            match entered {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)) => {}
                Err(e) => {
                    if let Some(suppressed) = self.ring.warnings.allow(Warning::Enter) {
                        tracing::warn!(reactor = self.id(), suppressed, "io_uring_enter failed: {e}");
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            let pass_start = now;
            now = Instant::now();
            if let Some(link) = self.links.get(self.id()) {
                link.time.add(now.duration_since(pass_start).as_nanos() as u64, worked && busy);
            }
            self.ring.pass_ns = now.duration_since(self.target.started).as_nanos() as u64;
            worked = self.after_enter(&mut completions, now);
            if worked {
                last_activity = now;
            }
            if matches!(self.upgrade, Upgrade::Parking(_)) {
                self.park_progress();
            }
            if self.stopping && self.conns.iter().all(Option::is_none) && self.ring.clients_parked() {
                return;
            }
        }
    }

    /// The rest of a pass once the kernel was entered: reaps and handles every
    /// completion, runs the timers when due, submits queued disk work and flushes
    /// output. Returns whether anything completed.
    fn after_enter(&mut self, completions: &mut Vec<(u64, i32, u32)>, now: Instant) -> bool {
        completions.clear();
        self.ring.reap(completions);
        for &(ud, res, flags) in completions.iter() {
            match Op::decode(ud) {
                Some(Op::Recv(c)) => self.with_conn(c, |r, conn| conn.on_recv(r, c, res)),
                Some(Op::Send(c)) => self.with_conn(c, |r, conn| conn.on_send(r, c, res)),
                Some(Op::Disk(owner, tag)) if owner & CLIENT_OWNER != 0 => {
                    let slot = owner & !CLIENT_OWNER;
                    self.ring.disk_in_flight -= 1;
                    self.ring.with_client(slot, |ring, client| client.on_disk(ring, slot, tag, res));
                }
                Some(Op::Disk(c, tag)) => self.with_conn(c, |r, conn| conn.on_disk(r, c, tag, res)),
                Some(Op::Wake) => self.on_wake(),
                Some(Op::Client(slot, tag)) => {
                    self.ring.with_client(slot, |ring, client| client.on_complete(ring, slot, tag, res, flags))
                }
                Some(Op::Watch(i)) => self.on_rdma_event(i as usize),
                None => {}
            }
            self.give_answers();
        }
        let rdma_work = self.rdma.active() && self.poll_rdma();
        if now.duration_since(self.last_tick) >= TICK {
            self.last_tick = now;
            self.tick();
        }
        if self.ring.throttle.waiting() > 0 {
            self.start_throttled();
        }
        self.give_answers();
        if self.ring.disk_queued {
            self.ring.submit_disk_ops();
        }
        self.flush_dirty();
        !completions.is_empty() || rdma_work
    }

    /// Gives the answers gathered on the ring (deferred commands, commands handed to
    /// clients, commands whose I/O budget came) to whoever issued them: a connection,
    /// or a client.
    fn give_answers(&mut self) {
        while self.ring.has_answers() {
            let mut answers = std::mem::take(&mut self.answers);
            self.ring.take_answers(&mut answers);
            for a in answers.drain(..) {
                if a.owner & CLIENT_OWNER != 0 {
                    let slot = a.owner & !CLIENT_OWNER;
                    self.ring.with_client(slot, |ring, c| c.on_answer(ring, slot, a.tag, a.status, a.buf));
                } else {
                    self.with_conn(a.owner, |r, c| c.on_resumed(r, a.owner, a.tag, a.status, a.buf));
                }
            }
            self.answers = answers;
        }
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
        self.give_answers();
        any
    }

    /// Watches RDMA completion queue `i`'s channel with the ring.
    fn watch_rdma_cq(&mut self, i: usize) {
        let Some(fd) = self.rdma.channel_fd(i) else { return };
        let sqe =
            opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build().user_data(Op::Watch(i as u32).encode());
        // SAFETY: a poll points at no memory; the channel lives as long as the reactor.
        unsafe { self.ring.push(sqe) };
    }

    /// Completion queue `i` signalled: its events are taken and it is armed again (the
    /// pass then polls it), and its channel watched again.
    fn on_rdma_event(&mut self, i: usize) {
        self.rdma.rearm(i);
        self.watch_rdma_cq(i);
    }

    /// Accepts an RDMA connection on this reactor.
    pub fn add_rdma_conn(&mut self, incoming: Incoming) {
        let port_id = incoming.port_id;
        if self.stopping || self.ring.held || self.closed_ports.contains(&port_id) {
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
                    tracing::warn!(reactor = self.id(), port_id, "{e}");
                    conn.begin_close();
                }
                self.target.connection_opened();
                self.conns[idx as usize] = Some(Box::new(conn));
            }
            Err(e) => {
                tracing::warn!(reactor = self.id(), port_id, "refused an RDMA connection: {e}");
                self.free_conns.push(idx);
            }
        }
    }

    /// Ends the RDMA connection with `serial`, which its host or the network ended.
    pub fn rdma_disconnected(&mut self, serial: u64) {
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
        let mut due = Vec::new();
        let everything = matches!(self.upgrade, Upgrade::Parking(_)) || self.stopping;
        self.ring.throttle.due(self.ring.pass_ns, everything, &mut due);
        for (owner, tag) in due {
            self.ring.route(Answer { owner, tag, status: nvpool_wire::Status::SUCCESS, buf: None });
        }
    }

    /// Runs `f` on connection `c` with the connection taken out of the table, so `f`
    /// can use the rest of the reactor. The box keeps the connection's memory in place.
    fn with_conn(&mut self, c: u32, f: impl FnOnce(&mut Reactor, &mut Conn)) {
        let Some(mut conn) = self.conns.get_mut(c as usize).and_then(Option::take) else {
            return;
        };
        f(self, &mut conn);
        if conn.withdraw_handed() {
            self.ring.withdraw(c);
        }
        if conn.can_free() {
            self.free_conn(c, conn);
        } else {
            self.conns[c as usize] = Some(conn);
        }
    }

    fn on_wake(&mut self) {
        while let Ok(m) = self.rx.try_recv() {
            match m {
                Msg::Mail(Mail::Answer { owner, tag, status }) => {
                    self.ring.route(Answer { owner, tag, status, buf: None })
                }
                Msg::Mail(Mail::Client { key, message }) => self.ring.deliver(key, message),
                Msg::Run(f) => f(self),
            }
            self.give_answers();
        }
        if !self.stopping {
            self.post_wake();
        }
    }

    /// Serves a connection that listener `port_id` accepted (`None`: a socket pair),
    /// with the peer its TLS session proved if it has one.
    pub fn adopt(&mut self, stream: TcpStream, port_id: Option<u16>, tls: Option<Box<TlsPeer>>) {
        // A connection handed over after its listener was removed is dropped, as the
        // listener's other connections were.
        if self.stopping || port_id.is_some_and(|p| self.closed_ports.contains(&p)) {
            return;
        }
        // Small PDUs must leave at once; the reactor batches writes itself.
        let _ = stream.set_nodelay(true);
        let mut conn = Box::new(Conn::new(stream, self.target.now_ms(), port_id, tls));
        if self.ring.held {
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
        if let Some(fd) = conn.raw_fd()
            && self.ring.register_file(idx, fd)
        {
            conn.set_registered_file(idx);
        }
        self.target.connection_opened();
        self.conns[idx as usize] = Some(conn);
        idx
    }

    /// Ends the connections listener `port_id` accepted: like nvmet and SPDK, a
    /// removed port takes its paths down, and their hosts go over to the paths they
    /// have left.
    pub fn close_port(&mut self, port_id: u16) {
        self.closed_ports.insert(port_id);
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |_, conn| {
                if conn.port_id == Some(port_id) {
                    conn.begin_close();
                }
            });
        }
    }

    /// Something changed (namespaces, hosts, events): every connection checks now.
    pub fn kick(&mut self) {
        // Parked connections are handed over as they are: nothing new goes out.
        if self.ring.held {
            return;
        }
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |r, conn| conn.check(r, c, false));
        }
    }

    /// Closes everything and exits once nothing is in flight.
    pub fn stop(&mut self) {
        self.stopping = true;
        self.ring.each_client(|ring, slot, c| c.stop(ring, slot));
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |_, conn| conn.begin_close());
        }
    }

    fn free_conn(&mut self, idx: u32, mut conn: Box<Conn>) {
        // The table holds its own reference to the socket: drop it, or the socket
        // would stay open after the connection is freed.
        if let Some(slot) = conn.take_registered_file() {
            self.ring.unregister_file(slot);
        }
        conn.release(self);
        drop(conn);
        self.target.connection_closed();
        self.free_conns.push(idx);
    }

    fn tick(&mut self) {
        // Parked, no timer may end a connection: a hot upgrade's new process may be
        // serving it already.
        if !self.ring.held {
            for c in 0..self.conns.len() as u32 {
                self.with_conn(c, |r, conn| conn.check(r, c, true));
            }
        }
        self.ring.throttle.forget_removed();
        if let Some(link) = self.links.get(self.id()) {
            let open = self.conns.len() - self.free_conns.len();
            link.time.set_load(open, self.ring.throttle.waiting());
        }
        self.ring.each_client(|ring, slot, c| c.tick(ring, slot));
        self.give_answers();
        let idle = self.conns.iter().all(Option::is_none);
        if idle && !self.released_while_idle {
            self.ring.release_idle_buffers();
            // The connections' own allocations (slots, output queues) went back to the
            // allocator, which keeps them in its arenas; hand the free pages back.
            // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
            unsafe { libc::malloc_trim(0) };
        }
        self.released_while_idle = idle;
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
        self.reactor.adopt(TcpStream::from(OwnedFd::from(socket)), None, None);
    }

    /// One pass: submits what is queued, handles whatever completed, flushes output.
    /// Returns whether anything completed.
    pub fn pass(&mut self) -> bool {
        let uring = self.reactor.ring.uring();
        let pending = uring.submission().len() as u32;
        // SAFETY: no argument is passed; the flags are plain io_uring_enter flags.
        let entered = unsafe { uring.submitter().enter::<libc::sigset_t>(pending, 0, IORING_ENTER_GETEVENTS, None) };
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

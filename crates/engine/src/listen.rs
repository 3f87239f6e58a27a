//! The engine's listeners: NVMe/TCP sockets accepted on reactor 0's ring (an
//! [`Acceptor`], a ring client) and NVMe/RDMA listeners of the connection manager
//! (`crate::rdma`). An accepted TCP connection goes to the reactors round robin, or
//! first through the TLS admission thread when its listener's mode is not `off`: it
//! looks at the first byte the host sends (a TLS handshake record starts with 22, an
//! NVMe/TCP ICReq with 0), runs the TLS handshake (`crate::tls::handshake`) and puts the
//! session's keys into the kernel (`crate::tls::ktls`), so that the reactor's I/O path
//! is the same with TLS or without.
#![allow(unsafe_code)]

use std::any::Any;
use std::collections::BTreeMap;
use std::io::ErrorKind as IoErrorKind;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use io_uring::{cqueue, opcode, types};
use nvpool_api::Transport;

use crate::error::{Error, ErrorKind, Result};
use crate::nvme::{ListenerInfo, Target};
use crate::reactor::Links;
use crate::ring::{Mail, Op, Ring, RingClient, Warning, new_client_key};
use crate::sync::lock;
use crate::tls::{TlsMode, TlsPeer, handshake, ktls};

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 22;
/// How long a host may take to start and finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes that may run at once; connections beyond are closed, so a flood of
/// half-open connections costs threads only up to this bound.
const MAX_HANDSHAKES: usize = 64;

/// One listener.
struct Listener {
    address: SocketAddr,
    transport: Transport,
    /// A copy of a TCP listener's socket, for a hot upgrade to hand on.
    socket: Option<TcpListener>,
    /// Its acceptor's key on reactor 0's ring (TCP).
    key: u64,
}

/// The listeners of an engine.
pub struct Listeners {
    target: Arc<Target>,
    links: Links,
    next_port_id: AtomicU16,
    listeners: Mutex<BTreeMap<u16, Listener>>,
    /// The RDMA connection manager, started with the first RDMA listener.
    rdma: Mutex<Option<Arc<crate::rdma::Rdma>>>,
    /// Where accepted connections go.
    handoff: Arc<Handoff>,
}

impl Listeners {
    /// No listener yet.
    pub fn new(target: Arc<Target>, links: Links) -> Listeners {
        let handoff = Arc::new(Handoff { target: target.clone(), links: links.clone(), next: AtomicUsize::new(0) });
        Listeners {
            target,
            links,
            next_port_id: AtomicU16::new(1),
            listeners: Mutex::new(BTreeMap::new()),
            rdma: Mutex::new(None),
            handoff,
        }
    }

    /// Binds and serves a listener; returns it with the port the system chose for 0.
    pub fn add(&self, addr: SocketAddr, tls: TlsMode, transport: Transport) -> Result<ListenerInfo> {
        if transport == Transport::Rdma {
            return self.add_rdma(addr, tls);
        }
        let listener = TcpListener::bind(addr).map_err(|e| {
            let message = format!(
                "cannot listen on {addr}: {e} (is another engine or nvmet using the port? pick another with --listen)"
            );
            if e.kind() == IoErrorKind::AddrInUse { Error::exists(message) } else { Error::invalid(message) }
        })?;
        let port_id = self.next_port_id.fetch_add(1, Ordering::Relaxed);
        self.serve(port_id, listener, tls)
    }

    /// Serves a bound listener as port `port_id` (a new one, or one a hot upgrade
    /// handed on: then the reactors are held, and it accepts once they resume).
    fn serve(&self, port_id: u16, listener: TcpListener, tls: TlsMode) -> Result<ListenerInfo> {
        let local = listener.local_addr().map_err(|e| Error::io("a listener's address", e))?;
        let copy = listener.try_clone().map_err(|e| Error::io("cannot copy a listener's socket", e))?;
        let key = new_client_key();
        lock(&self.listeners)
            .insert(port_id, Listener { address: local, transport: Transport::Tcp, socket: Some(copy), key });
        let info = ListenerInfo { port_id, addr: local.ip(), port: local.port(), tls, transport: Transport::Tcp };
        self.target.add_listener_info(info.clone());
        // Reactor 0 accepts; the connections go to every reactor.
        let handoff = self.handoff.clone();
        self.links[0].run(move |r| {
            let acceptor = Acceptor { listener, port_id, tls, handoff, armed: false, stopping: false };
            r.ring.add_client(key, Box::new(acceptor));
        });
        Ok(info)
    }

    /// Listens for NVMe over RDMA, starting the connection manager on first use. A
    /// machine without the RDMA libraries or a device at `addr` fails here, for this
    /// listener only.
    fn add_rdma(&self, addr: SocketAddr, tls: TlsMode) -> Result<ListenerInfo> {
        if tls != TlsMode::Off {
            return Err(Error::invalid(format!(
                "rdma:{addr}: TLS is defined for NVMe/TCP only: drop the tls setting of this listener"
            )));
        }
        let rdma = {
            let mut slot = lock(&self.rdma);
            match slot.as_ref() {
                Some(r) => r.clone(),
                None => {
                    let r = Arc::new(
                        crate::rdma::Rdma::start(self.target.clone(), self.links.clone())
                            .map_err(|e| Error::unavailable(format!("cannot listen on rdma:{addr}: {e}")))?,
                    );
                    *slot = Some(r.clone());
                    r
                }
            }
        };
        if lock(&self.listeners).values().any(|l| l.transport == Transport::Rdma && l.address == addr) {
            return Err(Error::exists(format!("the engine already listens on rdma:{addr}")));
        }
        let port_id = self.next_port_id.fetch_add(1, Ordering::Relaxed);
        let local = rdma.listen(addr, port_id).map_err(|e| {
            let message = format!("cannot listen on rdma:{addr}: {e}");
            if e.kind() == IoErrorKind::AddrInUse { Error::exists(message) } else { Error::unavailable(message) }
        })?;
        lock(&self.listeners)
            .insert(port_id, Listener { address: local, transport: Transport::Rdma, socket: None, key: 0 });
        let info = ListenerInfo { port_id, addr: local.ip(), port: local.port(), tls, transport: Transport::Rdma };
        self.target.add_listener_info(info.clone());
        Ok(info)
    }

    /// Stops a listener and ends the connections it accepted; their hosts go over to
    /// their other paths.
    pub fn remove(&self, addr: SocketAddr, transport: Transport) -> Result<()> {
        let (port_id, listener) = {
            let mut map = lock(&self.listeners);
            let id = map.iter().find(|(_, l)| l.address == addr && l.transport == transport).map(|(id, _)| *id);
            let id = id.ok_or_else(|| {
                let shown = if transport == Transport::Rdma { format!("rdma:{addr}") } else { addr.to_string() };
                Error::not_found(format!("no listener on {shown}: `nvpool engine listener list` shows them"))
            })?;
            (id, map.remove(&id).expect("the listener was just found"))
        };
        self.target.remove_listener_info(port_id);
        if transport == Transport::Rdma
            && let Some(r) = lock(&self.rdma).as_ref()
        {
            r.unlisten(port_id);
        }
        if listener.key != 0 {
            self.links[0].mail(Mail::Client { key: listener.key, message: Box::new(StopAccepting) });
        }
        for l in self.links.iter() {
            l.run(move |r| r.close_port(port_id));
        }
        Ok(())
    }

    /// An address the engine listens on for NVMe over RDMA, if it does.
    pub fn rdma_listener(&self) -> Option<SocketAddr> {
        lock(&self.listeners).values().find(|l| l.transport == Transport::Rdma).map(|l| l.address)
    }

    /// The TCP listeners for a hot upgrade's image: port ID, address and a copy of the
    /// socket each.
    pub fn tcp_sockets(&self) -> std::io::Result<Vec<(u16, SocketAddr, TcpListener)>> {
        let map = lock(&self.listeners);
        let mut out = Vec::new();
        for (&port_id, l) in map.iter() {
            if let Some(s) = &l.socket {
                out.push((port_id, l.address, s.try_clone()?));
            }
        }
        Ok(out)
    }

    /// How many listeners there are.
    pub fn count(&self) -> usize {
        lock(&self.listeners).len()
    }

    /// The next port ID a listener gets (for a hot upgrade's image).
    pub fn next_port_id(&self) -> u16 {
        self.next_port_id.load(Ordering::Relaxed)
    }

    /// Serves the listeners a hot upgrade handed on, as their old process numbered
    /// them; they accept once the reactors resume.
    pub fn restore(&self, next_port_id: u16, listeners: Vec<(u16, TcpListener, TlsMode)>) -> Result<()> {
        self.next_port_id.store(next_port_id, Ordering::Relaxed);
        for (port_id, listener, tls) in listeners {
            self.serve(port_id, listener, tls)?;
        }
        Ok(())
    }

    /// Stops the connection manager's thread (it hands connections to reactors); its
    /// event channel goes last, once the reactors destroyed the connections made on
    /// it. Returns it, for the caller to drop after the reactors stopped.
    pub fn stop_rdma(&self) -> Option<Arc<crate::rdma::Rdma>> {
        let rdma = lock(&self.rdma).take();
        if let Some(r) = &rdma {
            r.stop();
        }
        rdma
    }
}

/// Where a listener's accepted connections go.
struct Handoff {
    target: Arc<Target>,
    links: Links,
    next: AtomicUsize,
}

impl Handoff {
    /// Gives a connection to the next reactor, round robin.
    fn adopt(&self, stream: TcpStream, port_id: u16, tls: Option<TlsPeer>) {
        let owner = self.next.fetch_add(1, Ordering::Relaxed) % self.links.len();
        self.links[owner].run(move |r| r.adopt(stream, Some(port_id), tls.map(Box::new)));
    }

    /// Takes a connection a listener accepted.
    fn accepted(self: &Arc<Self>, stream: TcpStream, port_id: u16, tls: TlsMode) {
        if tls == TlsMode::Off {
            self.adopt(stream, port_id, None);
        } else {
            admit(self.clone(), stream, port_id, tls);
        }
    }
}

/// Asks an acceptor to stop (mail to its ring client).
struct StopAccepting;

/// A TCP listener accepting on reactor 0's ring (multishot accept).
struct Acceptor {
    listener: TcpListener,
    port_id: u16,
    tls: TlsMode,
    handoff: Arc<Handoff>,
    /// Whether an accept is armed.
    armed: bool,
    /// Whether it was removed (or the reactor stops): it ends once the accept is back.
    stopping: bool,
}

impl Acceptor {
    fn arm(&mut self, ring: &mut Ring, me: u32) {
        if self.armed || self.stopping || ring.held {
            return;
        }
        let sqe = opcode::AcceptMulti::new(types::Fd(self.listener.as_raw_fd()))
            .build()
            .user_data(Op::Client(me, 0).encode());
        // SAFETY: an accept points at no memory (no peer address is asked for).
        unsafe { ring.push(sqe) };
        self.armed = true;
    }

    fn cancel(&mut self, ring: &mut Ring, me: u32) {
        if self.armed {
            let sqe = opcode::AsyncCancel::new(Op::Client(me, 0).encode()).build().user_data(0);
            // SAFETY: a cancellation points at no memory.
            unsafe { ring.push(sqe) };
        }
    }
}

impl RingClient for Acceptor {
    fn begin(&mut self, ring: &mut Ring, me: u32) {
        self.arm(ring, me);
    }

    fn on_complete(&mut self, ring: &mut Ring, me: u32, _tag: u32, res: i32, flags: u32) {
        if res >= 0 {
            // SAFETY: a successful accept returns a new descriptor we now own.
            let stream = unsafe { TcpStream::from_raw_fd(res as RawFd) };
            self.handoff.accepted(stream, self.port_id, self.tls);
        } else if res != -libc::ECANCELED
            && let Some(suppressed) = ring.warnings.allow(Warning::Accept)
        {
            let e = std::io::Error::from_raw_os_error(-res);
            tracing::warn!(reactor = ring.id, suppressed, "accept on port {} failed: {e}", self.port_id);
        }
        if !cqueue::more(flags) {
            self.armed = false;
            self.arm(ring, me);
        }
    }

    fn on_mail(&mut self, ring: &mut Ring, me: u32, message: Box<dyn Any + Send>) {
        if message.is::<StopAccepting>() {
            self.stopping = true;
            self.cancel(ring, me);
        }
    }

    fn park(&mut self, ring: &mut Ring, me: u32) {
        self.cancel(ring, me);
    }

    fn parked(&self) -> bool {
        !self.armed
    }

    fn resume(&mut self, ring: &mut Ring, me: u32) {
        self.arm(ring, me);
    }

    fn stop(&mut self, ring: &mut Ring, me: u32) {
        self.stopping = true;
        self.cancel(ring, me);
    }

    fn ended(&self) -> bool {
        self.stopping && !self.armed
    }
}

static HANDSHAKES: AtomicUsize = AtomicUsize::new(0);

/// Takes a socket a `tls = allowed | required` listener accepted: on a thread of its
/// own, it tells TLS from plain NVMe/TCP, runs the handshake, and hands the socket to
/// a reactor; or closes it, with a log line that says why.
fn admit(handoff: Arc<Handoff>, stream: TcpStream, port_id: u16, mode: TlsMode) {
    let peer = stream.peer_addr().map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    if HANDSHAKES.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
        HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
        tracing::warn!("{MAX_HANDSHAKES} TLS handshakes are under way: the connection from {peer} is closed");
        return;
    }
    let from = peer.clone();
    let spawned = std::thread::Builder::new().name("nvpool-tls".into()).spawn(move || {
        match sort(&stream, mode, handoff.target.clone()) {
            Ok(tls) => handoff.adopt(stream, port_id, tls),
            Err(why) => tracing::warn!("connection from {from} to listener {port_id} closed: {why}"),
        }
        HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
    });
    if let Err(e) = spawned {
        HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
        tracing::warn!("cannot start a TLS handshake thread ({e}): the connection from {peer} is closed");
    }
}

/// Tells TLS from plain NVMe/TCP and, for TLS, runs the handshake and turns on kTLS.
/// `Ok(None)`: a plain connection the listener takes.
fn sort(stream: &TcpStream, mode: TlsMode, target: Arc<Target>) -> std::result::Result<Option<TlsPeer>, String> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| format!("socket: {e}"))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| format!("socket: {e}"))?;
    let mut first = [0u8; 1];
    let n = loop {
        match stream.peek(&mut first) {
            Err(e) if e.kind() == IoErrorKind::Interrupted => continue,
            r => break r.map_err(|e| format!("nothing arrived: {e}"))?,
        }
    };
    if n == 0 {
        return Err("the host closed the connection before it sent anything".into());
    }
    let peer = if first[0] == TLS_HANDSHAKE_RECORD {
        let done =
            handshake::accept(stream, Arc::new(move |identity: &nvpool_auth::Identity| target.tls_psk(identity)))?;
        ktls::enable(stream, &done.keys).map_err(|e| {
            format!("the TLS handshake succeeded, but the kernel cannot take its keys ({e}); is the `tls` module loaded (modprobe tls)?")
        })?;
        let addr = stream.peer_addr().map_or_else(|_| "?".to_string(), |a: SocketAddr| a.to_string());
        tracing::info!("TLS 1.3 session with {addr} ({}, identity {})", done.keys.suite.name(), done.identity);
        Some(TlsPeer { host_nqn: done.identity.host_nqn, subsystem_nqn: done.identity.subsystem_nqn })
    } else if mode == TlsMode::Required {
        return Err("the host speaks plain NVMe/TCP to a listener that requires TLS (connect with --tls)".into());
    } else {
        None
    };
    stream.set_read_timeout(None).map_err(|e| format!("socket: {e}"))?;
    stream.set_write_timeout(None).map_err(|e| format!("socket: {e}"))?;
    Ok(peer)
}

/// Whether an error is a listener's address being in use (a restart waits for it).
pub fn in_use(e: &Error) -> bool {
    e.kind == ErrorKind::AlreadyExists
}

//! Owned handles to rdma-core objects (librdmacm and libibverbs through
//! `rdma-mummy-sys`, which loads the libraries at first use): each frees its object
//! when dropped, and every call that can fail returns an `io::Error` from errno.
//!
//! Verbs objects may be used from any thread (the libraries lock what they share), so
//! the handles are `Send`; a device's protection domain is shared by every reactor.
#![allow(unsafe_code)]

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::ptr::null_mut;

use rdma_mummy_sys::{
    ibv_access_flags, ibv_ack_cq_events, ibv_alloc_pd, ibv_comp_channel, ibv_context, ibv_cq, ibv_create_comp_channel,
    ibv_create_cq, ibv_dealloc_pd, ibv_dereg_mr, ibv_destroy_comp_channel, ibv_destroy_cq, ibv_device_attr,
    ibv_get_cq_event, ibv_mr, ibv_pd, ibv_poll_cq, ibv_post_recv, ibv_post_send, ibv_qp_init_attr, ibv_qp_type,
    ibv_query_device, ibv_recv_wr, ibv_reg_mr, ibv_req_notify_cq, ibv_send_wr, ibv_wc, rdma_accept, rdma_ack_cm_event,
    rdma_bind_addr, rdma_cm_event, rdma_cm_event_type, rdma_cm_id, rdma_conn_param, rdma_create_event_channel,
    rdma_create_id, rdma_create_qp, rdma_destroy_event_channel, rdma_destroy_id, rdma_destroy_qp, rdma_disconnect,
    rdma_event_channel, rdma_get_cm_event, rdma_listen, rdma_port_space, rdma_reject,
};

/// errno as an `io::Error`, with `EOPNOTSUPP` (what the loader returns when it found
/// no library) explained.
fn last_error(what: &str) -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
        return io::Error::new(
            io::ErrorKind::Unsupported,
            format!(
                "{what}: the RDMA libraries (librdmacm.so.1, libibverbs.so.1) are not installed: install \
                 librdmacm1 and ibverbs-providers"
            ),
        );
    }
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// An RDMA CM event channel: where the events of every identifier made on it arrive.
pub struct EventChannel(*mut rdma_event_channel);

// SAFETY: librdmacm serializes use of a channel internally; the pointer is owned here.
unsafe impl Send for EventChannel {}
// SAFETY: as above: identifiers are created on the channel from several threads.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    /// A new channel.
    pub fn new() -> io::Result<EventChannel> {
        // SAFETY: no arguments; the result is checked.
        let ch = unsafe { rdma_create_event_channel() };
        if ch.is_null() {
            let errno = io::Error::last_os_error().raw_os_error();
            let e = last_error("cannot open the RDMA connection manager");
            if matches!(errno, Some(libc::ENODEV) | Some(libc::ENOENT)) {
                return Err(io::Error::new(
                    e.kind(),
                    format!(
                        "{e}: this machine has no /dev/infiniband/rdma_cm (load rdma_ucm, and configure an RDMA \
                         device, e.g. `rdma link add rxe0 type rxe netdev eth0`)"
                    ),
                ));
            }
            return Err(e);
        }
        Ok(EventChannel(ch))
    }

    /// Its descriptor, readable when an event waits.
    pub fn fd(&self) -> i32 {
        // SAFETY: the channel is alive while `self` is.
        unsafe { (*self.0).fd }
    }

    /// The next event, if one waits (the descriptor is polled first).
    pub fn next_event(&self) -> io::Result<Event> {
        let mut ev = null_mut();
        // SAFETY: the channel is alive; `ev` receives an event the caller acknowledges
        // (in `Event::drop`).
        if unsafe { rdma_get_cm_event(self.0, &mut ev) } != 0 {
            return Err(last_error("rdma_get_cm_event"));
        }
        Ok(Event(ev))
    }

    /// A listening identifier bound to `addr`.
    pub fn listen(&self, addr: SocketAddr, context: usize) -> io::Result<CmId> {
        let mut id = null_mut();
        // SAFETY: the channel is alive; `id` receives a new identifier owned by `CmId`.
        if unsafe { rdma_create_id(self.0, &mut id, context as *mut libc::c_void, rdma_port_space::RDMA_PS_TCP) } != 0 {
            return Err(last_error("rdma_create_id"));
        }
        let id = CmId { id, qp: false };
        let mut storage = socket_address(addr);
        // SAFETY: `storage` holds a sockaddr_in or sockaddr_in6 of the family it says.
        if unsafe { rdma_bind_addr(id.id, (&mut storage as *mut libc::sockaddr_storage).cast()) } != 0 {
            let e = io::Error::last_os_error();
            let hint = match e.raw_os_error() {
                Some(libc::EADDRNOTAVAIL) | Some(libc::ENODEV) => {
                    " (no RDMA device has this address: add one, e.g. `rdma link add rxe0 type rxe netdev eth0`)"
                }
                Some(libc::EADDRINUSE) => " (another RDMA target uses the port)",
                _ => "",
            };
            return Err(io::Error::new(e.kind(), format!("cannot bind RDMA on {addr}: {e}{hint}")));
        }
        if id.verbs().is_null() && !addr.ip().is_unspecified() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "no RDMA device has address {}: add one, e.g. `rdma link add rxe0 type rxe netdev eth0`",
                    addr.ip()
                ),
            ));
        }
        // SAFETY: the identifier is bound.
        if unsafe { rdma_listen(id.id, 128) } != 0 {
            return Err(last_error(&format!("cannot listen on RDMA {addr}")));
        }
        Ok(id)
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every identifier on the channel was destroyed first (they are owned by
        // whoever holds the channel's `Arc`).
        unsafe { rdma_destroy_event_channel(self.0) };
    }
}

fn socket_address(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain data; zeroed is a valid empty address.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match addr.ip() {
        IpAddr::V4(ip) => {
            let sin = (&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe {
                (*sin).sin_family = libc::AF_INET as u16;
                (*sin).sin_port = addr.port().to_be();
                (*sin).sin_addr.s_addr = u32::from_ne_bytes(ip.octets());
            }
        }
        IpAddr::V6(ip) => {
            let sin6 = (&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe {
                (*sin6).sin6_family = libc::AF_INET6 as u16;
                (*sin6).sin6_port = addr.port().to_be();
                (*sin6).sin6_addr.s6_addr = ip.octets();
            }
        }
    }
    storage
}

/// A connection manager event; acknowledged when dropped.
pub struct Event(*mut rdma_cm_event);

impl Event {
    fn raw(&self) -> &rdma_cm_event {
        // SAFETY: the event is valid until acknowledged in `drop`.
        unsafe { &*self.0 }
    }

    /// What happened.
    pub fn kind(&self) -> rdma_cm_event_type::Type {
        self.raw().event
    }

    /// The identifier it is about (for a connect request: the new one).
    pub fn id(&self) -> *mut rdma_cm_id {
        self.raw().id
    }

    /// The listening identifier's context (for a connect request).
    pub fn listen_context(&self) -> usize {
        let l = self.raw().listen_id;
        // SAFETY: a non-null listening identifier outlives its events.
        if l.is_null() { 0 } else { unsafe { (*l).context as usize } }
    }

    /// A connect request's private data, and the RDMA READ depths it offers (the
    /// resources the peer grants us to read with, and those it wants for its own
    /// reads: already from our side's view).
    pub fn connect_param(&self) -> (Vec<u8>, u8, u8) {
        // SAFETY: a connect request carries connection parameters.
        let conn = unsafe { self.raw().param.conn };
        let data = if conn.private_data.is_null() {
            Vec::new()
        } else {
            // SAFETY: the library gives `private_data_len` bytes, valid until the ack.
            unsafe { std::slice::from_raw_parts(conn.private_data.cast::<u8>(), usize::from(conn.private_data_len)) }
                .to_vec()
        };
        (data, conn.initiator_depth, conn.responder_resources)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: each event is acknowledged once.
        unsafe { rdma_ack_cm_event(self.0) };
    }
}

/// An RDMA CM identifier: a listener, or one connection with its queue pair.
pub struct CmId {
    id: *mut rdma_cm_id,
    qp: bool,
}

// SAFETY: librdmacm and libibverbs may be called on an identifier from any thread; it
// is owned here and destroyed once.
unsafe impl Send for CmId {}

impl CmId {
    /// Takes ownership of the identifier of a connect request.
    ///
    /// # Safety
    /// `id` must be a connect request's identifier that nothing else owns.
    pub unsafe fn from_request(id: *mut rdma_cm_id) -> CmId {
        CmId { id, qp: false }
    }

    /// The device context it is bound to.
    pub fn verbs(&self) -> *mut ibv_context {
        // SAFETY: the identifier is alive.
        unsafe { (*self.id).verbs }
    }

    /// Sets the value its events carry.
    pub fn set_context(&mut self, v: usize) {
        // SAFETY: the identifier is alive and owned here.
        unsafe { (*self.id).context = v as *mut libc::c_void };
    }

    /// The port it is bound to.
    pub fn local_port(&self) -> u16 {
        // SAFETY: the identifier is alive; the port sits at the same offset in
        // sockaddr_in and sockaddr_in6, whichever the bound address is.
        u16::from_be(unsafe { (*self.id).route.addr.src_addr_union.src_sin.sin_port })
    }

    /// The peer's address, for the log.
    pub fn peer(&self) -> Option<SocketAddr> {
        // SAFETY: the identifier is alive; the family says which member is valid.
        unsafe {
            let dst = &(*self.id).route.addr.dst_addr_union;
            match i32::from(dst.dst_sin.sin_family) {
                libc::AF_INET => {
                    let ip = std::net::Ipv4Addr::from(u32::from_be(dst.dst_sin.sin_addr.s_addr));
                    Some(SocketAddr::new(ip.into(), u16::from_be(dst.dst_sin.sin_port)))
                }
                libc::AF_INET6 => {
                    let ip = std::net::Ipv6Addr::from(dst.dst_sin6.sin6_addr.s6_addr);
                    Some(SocketAddr::new(ip.into(), u16::from_be(dst.dst_sin6.sin6_port)))
                }
                _ => None,
            }
        }
    }

    /// Creates its reliable-connected queue pair, both queues completing on `cq`.
    pub fn create_qp(&mut self, device: &Device, cq: &CompletionQueue, send: u32, recv: u32) -> io::Result<()> {
        // SAFETY: plain data; zeroed is a valid empty request.
        let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.cq;
        attr.recv_cq = cq.cq;
        attr.cap.max_send_wr = send;
        attr.cap.max_recv_wr = recv;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        // SAFETY: the identifier, device and CQ are alive; the QP is destroyed in drop.
        if unsafe { rdma_create_qp(self.id, device.pd, &mut attr) } != 0 {
            return Err(last_error("cannot create an RDMA queue pair"));
        }
        self.qp = true;
        Ok(())
    }

    /// Accepts the connection with `private_data`, granting `responder_resources`
    /// reads to the peer and reading with `initiator_depth`.
    pub fn accept(&self, private_data: &[u8], responder_resources: u8, initiator_depth: u8) -> io::Result<()> {
        // SAFETY: plain data; zeroed is valid.
        let mut p: rdma_conn_param = unsafe { std::mem::zeroed() };
        p.private_data = private_data.as_ptr().cast();
        p.private_data_len = private_data.len() as u8;
        p.responder_resources = responder_resources;
        p.initiator_depth = initiator_depth;
        p.rnr_retry_count = 7;
        // SAFETY: the identifier is a connect request's; the library copies the data.
        if unsafe { rdma_accept(self.id, &mut p) } != 0 {
            return Err(last_error("rdma_accept"));
        }
        Ok(())
    }

    /// Refuses a connect request with `private_data`.
    pub fn reject(&self, private_data: &[u8]) {
        // SAFETY: the identifier is a connect request's; the library copies the data.
        unsafe { rdma_reject(self.id, private_data.as_ptr().cast(), private_data.len() as u8) };
    }

    /// Starts tearing the connection down: the queue pair moves to the error state, so
    /// every posted work request completes (flushed).
    pub fn disconnect(&self) {
        // SAFETY: the identifier is alive; disconnecting twice only fails.
        unsafe { rdma_disconnect(self.id) };
    }

    /// Posts `chain`, whose requests are linked in order. On failure, says how many
    /// of them were posted (and will complete) before the one that failed.
    ///
    /// # Safety
    /// Each request's memory must be registered and stay valid until it completes.
    pub unsafe fn post_recv(&self, chain: &mut [ibv_recv_wr]) -> Result<(), (usize, io::Error)> {
        let mut bad = null_mut();
        // SAFETY: the queue pair exists; the caller answers for the memory.
        let rc = unsafe { ibv_post_recv((*self.id).qp, chain.as_mut_ptr(), &mut bad) };
        if rc == 0 { Ok(()) } else { Err((posted_before(chain, bad), io::Error::from_raw_os_error(rc))) }
    }

    /// Posts a chain of sends, reads and writes, as `post_recv` does receives.
    ///
    /// # Safety
    /// As for `post_recv`.
    pub unsafe fn post_send(&self, chain: &mut [ibv_send_wr]) -> Result<(), (usize, io::Error)> {
        let mut bad = null_mut();
        // SAFETY: the queue pair exists; the caller answers for the memory.
        let rc = unsafe { ibv_post_send((*self.id).qp, chain.as_mut_ptr(), &mut bad) };
        if rc == 0 { Ok(()) } else { Err((posted_before(chain, bad), io::Error::from_raw_os_error(rc))) }
    }
}

/// How many requests of `chain` precede `bad`, the one the library refused (none if it
/// names no request of the chain).
fn posted_before<T>(chain: &[T], bad: *mut T) -> usize {
    chain.iter().position(|wr| std::ptr::eq(wr, bad)).unwrap_or(0)
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: the identifier (and its QP, if made) is destroyed once; its owner
        // made sure no work request is outstanding. Destroying waits for the events of
        // the identifier to be acknowledged, which the event thread does at once.
        unsafe {
            if self.qp {
                rdma_destroy_qp(self.id);
            }
            rdma_destroy_id(self.id);
        }
    }
}

/// An RDMA device as the engine uses it: its context (owned by librdmacm) and one
/// protection domain, which every reactor's memory is registered with.
pub struct Device {
    context: *mut ibv_context,
    pd: *mut ibv_pd,
    /// Most work requests a queue pair may hold on one queue.
    pub max_qp_wr: u32,
    /// Most RDMA READs the device may have outstanding as initiator on a queue pair.
    pub max_qp_rd_atom: u8,
}

// SAFETY: verbs objects may be used from any thread; the PD is owned here.
unsafe impl Send for Device {}
// SAFETY: as above; registering memory with a shared PD is thread safe.
unsafe impl Sync for Device {}

impl Device {
    /// Opens a protection domain on `context`.
    ///
    /// # Safety
    /// `context` must be an open device context that stays open for the life of the
    /// process (librdmacm's, from an identifier bound to the device).
    pub unsafe fn open(context: *mut ibv_context) -> io::Result<Device> {
        // SAFETY: plain data, filled by the query.
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is librdmacm's, open for the life of the process.
        if unsafe { ibv_query_device(context, &mut attr) } != 0 {
            return Err(last_error("ibv_query_device"));
        }
        // SAFETY: as above.
        let pd = unsafe { ibv_alloc_pd(context) };
        if pd.is_null() {
            return Err(last_error("ibv_alloc_pd"));
        }
        Ok(Device {
            context,
            pd,
            max_qp_wr: attr.max_qp_wr.max(1) as u32,
            max_qp_rd_atom: attr.max_qp_rd_atom.clamp(1, 255) as u8,
        })
    }

    /// Whether this is the device of `context`.
    pub fn is(&self, context: *mut ibv_context) -> bool {
        self.context == context
    }

    /// Registers `len` bytes at `at` for local access and remote reads and writes by
    /// nobody else (the host's data moves only by our READs and WRITEs).
    ///
    /// # Safety
    /// The memory must stay mapped for as long as the region is alive.
    pub unsafe fn register(&self, at: *mut u8, len: usize) -> io::Result<Region> {
        let access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        // SAFETY: the caller answers for the memory; the PD is alive.
        let mr = unsafe { ibv_reg_mr(self.pd, at.cast(), len, access) };
        if mr.is_null() {
            return Err(last_error("cannot register memory with the RDMA device (is RLIMIT_MEMLOCK too low?)"));
        }
        Ok(Region { mr, pd: self.pd as usize })
    }

    /// A completion queue of `entries` with its own completion channel.
    pub fn completion_queue(&self, entries: u32) -> io::Result<CompletionQueue> {
        // SAFETY: the context is open.
        let channel = unsafe { ibv_create_comp_channel(self.context) };
        if channel.is_null() {
            return Err(last_error("ibv_create_comp_channel"));
        }
        // SAFETY: the channel is new; its descriptor is made non-blocking so taking an
        // event never blocks a reactor.
        unsafe {
            let fd = (*channel).fd;
            libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK);
        }
        // SAFETY: the context and channel are alive.
        let cq = unsafe { ibv_create_cq(self.context, entries as i32, null_mut(), channel, 0) };
        if cq.is_null() {
            let e = last_error("ibv_create_cq");
            // SAFETY: the channel has no CQ.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        Ok(CompletionQueue { cq, channel, unacked: 0 })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every region and queue pair of the PD went first (they hold the
        // device's `Arc`).
        unsafe { ibv_dealloc_pd(self.pd) };
    }
}

/// Registered memory.
pub struct Region {
    mr: *mut ibv_mr,
    pd: usize,
}

// SAFETY: a memory region is a handle usable from any thread; it is owned here.
unsafe impl Send for Region {}

impl Region {
    /// The key local work requests name it by.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the region is alive.
        unsafe { (*self.mr).lkey }
    }

    /// Whether it is registered with `device`.
    pub fn of(&self, device: &Device) -> bool {
        self.pd == device.pd as usize
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: deregistered once; no work request uses it any more (its memory's
        // owner makes sure).
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// A completion queue and the channel that signals it.
pub struct CompletionQueue {
    cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    /// Events taken and not yet acknowledged (acknowledged in batches).
    unacked: u32,
}

// SAFETY: owned here and used by one reactor at a time.
unsafe impl Send for CompletionQueue {}

impl CompletionQueue {
    /// The channel's descriptor: readable once the armed queue got a completion.
    pub fn fd(&self) -> i32 {
        // SAFETY: the channel is alive.
        unsafe { (*self.channel).fd }
    }

    /// Takes the channel's pending events (the descriptor is non-blocking) and arms the
    /// queue for the next completion.
    pub fn rearm(&mut self) {
        loop {
            let (mut cq, mut ctx) = (null_mut(), null_mut());
            // SAFETY: the channel is alive; non-blocking, so this returns at once.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } != 0 {
                break;
            }
            self.unacked += 1;
        }
        if self.unacked >= 64 {
            // SAFETY: acknowledges events taken above.
            unsafe { ibv_ack_cq_events(self.cq, self.unacked) };
            self.unacked = 0;
        }
        // SAFETY: the CQ is alive.
        unsafe { ibv_req_notify_cq(self.cq, 0) };
    }

    /// Fills `wc` with completions; returns how many.
    pub fn poll(&mut self, wc: &mut [ibv_wc]) -> usize {
        // SAFETY: the CQ is alive and `wc` has room for the count passed.
        let n = unsafe { ibv_poll_cq(self.cq, wc.len() as i32, wc.as_mut_ptr()) };
        n.max(0) as usize
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: no queue pair uses the CQ any more (they are destroyed first); the
        // events taken are acknowledged before the CQ goes, then the channel.
        unsafe {
            if self.unacked > 0 {
                ibv_ack_cq_events(self.cq, self.unacked);
            }
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.channel);
        }
    }
}

//! NVMe over RDMA (NVMe-oF 1.1 §7.3, the RDMA transport binding): listeners and
//! connection setup through the RDMA connection manager.
//!
//! One thread takes every connection manager event of the engine from one event
//! channel. A connect request's private data (queue ID and sizes) is checked here and
//! refused with its reason, or the request is handed to a reactor, round robin, which
//! makes the queue pair on its own completion queue, posts its receives and accepts
//! (see `reactor/rdma.rs`, the RDMA wire). Disconnects are passed on to the reactor
//! that serves the connection. Nothing on the I/O path runs on this thread.
//!
//! The libraries are loaded at first use (see `crate::verbs`): an engine on a machine without
//! rdma-core or without an RDMA device runs, and only its RDMA listeners fail, each
//! with the reason.
#![allow(unsafe_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nvpool_wire::rdma::{ConnectRequest, RejectReason};
use rdma_mummy_sys::rdma_cm_event_type as event;

use crate::nvme::Target;
use crate::reactor::{Incoming, ReactorLink};
use crate::sync::lock;
use crate::verbs::{self, CmId, Device, EventChannel};

/// The engine's RDMA side: the event channel, its thread and the listeners.
pub struct Rdma {
    channel: Arc<EventChannel>,
    listeners: Mutex<BTreeMap<u16, CmId>>,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What the event thread needs.
struct Events {
    channel: Arc<EventChannel>,
    target: Arc<Target>,
    links: Arc<Vec<ReactorLink>>,
    devices: Vec<Arc<Device>>,
    next_reactor: usize,
    next_serial: u64,
}

impl Rdma {
    /// Opens the connection manager and starts its event thread.
    pub fn start(target: Arc<Target>, links: Arc<Vec<ReactorLink>>) -> std::io::Result<Rdma> {
        let channel = Arc::new(EventChannel::new()?);
        let stop = Arc::new(AtomicBool::new(false));
        let mut events =
            Events { channel: channel.clone(), target, links, devices: Vec::new(), next_reactor: 0, next_serial: 1 };
        let stopping = stop.clone();
        let thread = std::thread::Builder::new().name("nvpool-rdma-cm".into()).spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                if crate::upgrade::process::wait_readable(events.channel.fd(), std::time::Duration::from_millis(200)) {
                    events.take_one();
                }
            }
        })?;
        Ok(Rdma { channel, listeners: Mutex::new(BTreeMap::new()), stop, thread: Mutex::new(Some(thread)) })
    }

    /// Listens on `addr` as listener `port_id`; returns the address with the port the
    /// system chose for 0.
    pub fn listen(&self, addr: SocketAddr, port_id: u16) -> std::io::Result<SocketAddr> {
        let id = self.channel.listen(addr, usize::from(port_id))?;
        let bound = SocketAddr::new(addr.ip(), id.local_port());
        lock(&self.listeners).insert(port_id, id);
        Ok(bound)
    }

    /// Stops listener `port_id` (its connections are ended by the reactors).
    pub fn unlisten(&self, port_id: u16) {
        lock(&self.listeners).remove(&port_id);
    }

    /// Stops listening and ends the event thread.
    pub fn stop(&self) {
        lock(&self.listeners).clear();
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl Events {
    /// Takes one event and acts on it.
    fn take_one(&mut self) {
        let ev = match self.channel.next_event() {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!("RDMA connection manager: {e}");
                return;
            }
        };
        match ev.kind() {
            event::RDMA_CM_EVENT_CONNECT_REQUEST => self.on_connect_request(&ev),
            event::RDMA_CM_EVENT_DISCONNECTED
            | event::RDMA_CM_EVENT_TIMEWAIT_EXIT
            | event::RDMA_CM_EVENT_CONNECT_ERROR
            | event::RDMA_CM_EVENT_UNREACHABLE
            | event::RDMA_CM_EVENT_REJECTED
            | event::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                // SAFETY: an event's identifier is alive until the event is acknowledged
                // (it is destroyed only after that, by its reactor).
                let serial = unsafe { (*ev.id()).context as u64 };
                let reactor = (serial >> 48) as usize;
                if serial != 0
                    && let Some(link) = self.links.get(reactor)
                {
                    link.run(move |r| r.rdma_disconnected(serial));
                }
            }
            _ => {}
        }
    }

    fn on_connect_request(&mut self, ev: &verbs::Event) {
        let (private_data, initiator_depth, responder_resources) = ev.connect_param();
        // SAFETY: the request's identifier is new, and nobody else owns it.
        let mut id = unsafe { CmId::from_request(ev.id()) };
        let port_id = ev.listen_context() as u16;
        let limits = &self.target.limits;
        let max_qid = u16::try_from(limits.max_io_queues).unwrap_or(u16::MAX);
        let max_entries = limits.max_queue_depth.max(u32::from(crate::nvme::ADMIN_QUEUE_DEPTH));
        let checked = ConnectRequest::decode(&private_data).and_then(|r| r.check(max_qid, max_entries).map(|()| r));
        let request = match checked {
            Ok(r) => r,
            Err(reason) => {
                tracing::warn!(port_id, "refused an RDMA connection: {reason}");
                id.reject(&reason.encode());
                return;
            }
        };
        let device = match self.device(id.verbs()) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(port_id, "refused an RDMA connection: {e}");
                id.reject(&RejectReason::NoResources.encode());
                return;
            }
        };
        let reactor = self.next_reactor % self.links.len();
        self.next_reactor += 1;
        let serial = (reactor as u64) << 48 | (self.next_serial & 0xFFFF_FFFF_FFFF);
        self.next_serial += 1;
        id.set_context(serial as usize);
        let incoming = Incoming { id, device, port_id, request, initiator_depth, responder_resources, serial };
        self.links[reactor].run(move |r| r.add_rdma_conn(incoming));
    }

    /// The device of a context, opened on first use.
    fn device(&mut self, context: *mut rdma_mummy_sys::ibv_context) -> std::io::Result<Arc<Device>> {
        if let Some(d) = self.devices.iter().find(|d| d.is(context)) {
            return Ok(d.clone());
        }
        // SAFETY: the context is librdmacm's, from a connect request's identifier; the
        // library keeps its devices open for the life of the process.
        let d = Arc::new(unsafe { Device::open(context)? });
        self.devices.push(d.clone());
        Ok(d)
    }
}

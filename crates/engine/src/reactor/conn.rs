//! One queue of a host, whatever its fabric: the command lifecycle (Connect,
//! authentication, admin and I/O commands, the slots of commands that wait for data or
//! storage, completion) and what a hot upgrade parks and hands on. How bytes move is
//! the fabric's: `tcp.rs` (PDUs on a byte stream) and `rdma.rs` (capsules by SEND and
//! RECV, data by READ and WRITE), behind the small interface `Wire` dispatches to:
//! fetch a command's data, send data, respond, fail. What a command does to storage is
//! its namespace's backend's business (see [`crate::backend`]).
#![allow(unsafe_code)]

use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use nvpool_wire::Status;
use nvpool_wire::command::{Command, Completion, SglDescriptor, admin_opcode, sgl};
use nvpool_wire::fabrics::fctype;
use nvpool_wire::tcp::{FatalError, fes};

use super::Reactor;
use super::rdma::RdmaWire;
use super::tcp::{Sending, Stream};
use crate::backend::Durable;
use crate::bufpool::Buf;
use crate::io::{BlockIo, DiskQueue, Queued};
use crate::nvme::admin::{self, AdminOutcome};
use crate::nvme::ana;
use crate::nvme::auth::{self, Handled, Outcome, Transaction};
use crate::nvme::data_pointer::Source;
use crate::nvme::nvm;
use crate::nvme::reservation::{self, Abort, Access, Executed, NamespaceReservations};
use crate::nvme::subsystem::NamespaceMap;
use crate::nvme::{ADMIN_IN_CAPSULE_DATA, Controller, IO_IN_CAPSULE_DATA, Namespace, Transport, fabrics};
use crate::plan::{IoPlan, MAX_TRANSFER};
use serde::{Deserialize, Serialize};

/// A connection must be connected (ICReq on TCP, then Connect) within this long, or it
/// is closed.
const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;

/// Connect CATTR bit 2: the host disabled SQ flow control.
const CATTR_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Waiting for ICReq.
    Handshake,
    /// Serving commands.
    Ready,
    /// Sending what is queued (a termination request, a Disconnect response), then
    /// closing. Input is ignored.
    Draining,
    /// Shut down; waiting for in-flight operations before the connection is freed.
    Closed,
}

/// Data for the host: what a TCP output item sends after its header, or what an RDMA
/// WRITE carries.
pub(super) enum Payload {
    None,
    Pool(Buf, usize),
    Owned(Vec<u8>),
    Zeroes(usize),
    /// Read data sent straight from a memory namespace's RAM, with no copy into a
    /// buffer first. The namespace is held so the mapping outlives the send. Only made
    /// without data digests, which would need the bytes in Rust.
    Mapped {
        at: *const u8,
        len: usize,
        _namespace: Arc<Namespace>,
    },
}

impl Payload {
    pub(super) fn len(&self) -> usize {
        match self {
            Payload::None => 0,
            Payload::Pool(_, n) | Payload::Zeroes(n) | Payload::Mapped { len: n, .. } => *n,
            Payload::Owned(v) => v.len(),
        }
    }
}

/// The bytes of a payload Rust may read (for digests and sends); a mapped payload has
/// none: it is made only when no digest needs them, and sent by address.
pub(super) fn payload_bytes<'a>(p: &'a Payload, zeroes: &'a [u8]) -> &'a [u8] {
    match p {
        Payload::None | Payload::Mapped { .. } => &[],
        Payload::Pool(b, n) => &b.as_slice()[..*n],
        Payload::Owned(v) => v,
        Payload::Zeroes(n) => &zeroes[..*n],
    }
}

/// The queue this connection serves, once Connect succeeded.
pub(super) struct Queue {
    pub(super) controller: Arc<Controller>,
    pub(super) qid: u16,
    pub(super) sqsize: u16,
    pub(super) sqhd: u16,
    pub(super) flow_control_disabled: bool,
    pub(super) namespaces: Arc<NamespaceMap>,
    pub(super) generation: u64,
    /// Whether the queue takes commands other than authentication: set at Connect
    /// when the host has no secrets, or once it authenticated (DH-HMAC-CHAP).
    pub(super) authenticated: bool,
    /// The authentication transaction, from the host's first message.
    pub(super) auth: Option<Box<Transaction>>,
}

impl Queue {
    /// Takes the subsystem's current namespace map if it changed; returns whether it
    /// did. One atomic load: the map is re-read only after a change.
    pub(super) fn refresh(&mut self) -> bool {
        let subsystem = &self.controller.subsystem;
        let g = subsystem.generation();
        if g == self.generation {
            return false;
        }
        self.namespaces = subsystem.namespaces();
        self.generation = g;
        true
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    /// Waiting for H2CData after an R2T.
    AwaitingData,
    /// With the backend: disk operations in flight, or deferred to another thread.
    Backend,
}

/// A command that outlives the PDU that carried it (R2T or backend work).
pub(super) struct Slot {
    pub(super) state: SlotState,
    pub(super) cid: u16,
    pub(super) ns: Option<Arc<Namespace>>,
    pub(super) io: BlockIo,
    /// Host data bytes the command takes, and how many arrived.
    pub(super) expected: u32,
    pub(super) received: u32,
    /// An admin or fabrics command waiting for its host data: it runs once the data
    /// is in, as an I/O command goes to its backend then. Boxed: rare, and every I/O
    /// slot would carry it.
    pub(super) command: Option<Box<Command>>,
    /// Counted among the namespace's commands with the backend, for a Preempt and
    /// Abort to wait for (the epoch's parity), while hosts are registered.
    pub(super) fence: Option<u8>,
}

impl Slot {
    pub(super) fn free() -> Slot {
        Slot {
            state: SlotState::Free,
            cid: 0,
            ns: None,
            io: BlockIo::idle(),
            expected: 0,
            received: 0,
            command: None,
            fence: None,
        }
    }
}

/// How a connection's bytes move. The TCP state is inline: every TCP connection is
/// boxed already, and its hot path reads it on every PDU.
#[allow(clippy::large_enum_variant)]
pub(super) enum Wire {
    /// An NVMe/TCP stream: PDUs in a byte stream, sent in batches.
    Tcp(Stream),
    /// An RDMA queue pair: capsules by SEND and RECV, data by READ and WRITE.
    Rdma(Box<RdmaWire>),
}

/// One queue of a host: the commands it runs, on its wire.
pub(super) struct Conn {
    pub(super) wire: Wire,
    /// The host's address, for the log.
    pub(super) peer: String,
    /// The listener that accepted it; `None` for a socket pair.
    pub(super) port_id: Option<u16>,
    pub(super) phase: Phase,
    pub(super) accepted_ms: u64,
    pub(super) ops_in_flight: u32,
    pub(super) queue: Option<Queue>,
    pub(super) slots: Vec<Slot>,
    pub(super) free_slots: Vec<u16>,
    pub(super) aers: Vec<u16>,
    /// Set while a hot upgrade parks the connection: it finishes what it took and
    /// takes nothing new (see `park_step`).
    pub(super) parking: bool,
    /// Preempt and Abort commands waiting for the commands before them to be done.
    pub(super) aborts: Vec<(u16, Arc<NamespaceReservations>, Abort)>,
    /// Acquires that completed, waiting for what they changed to be durable.
    pub(super) durable_waits: Vec<(u16, Durable)>,
    /// Set once, after it closed, the commands it handed to ring clients (queues to
    /// other engines) that had not left yet were withdrawn (see `withdraw_handed`).
    pub(super) withdrawn: bool,
}

impl Conn {
    pub(super) fn on_wire(wire: Wire, peer: String, now_ms: u64, port_id: Option<u16>, phase: Phase) -> Conn {
        Conn {
            wire,
            peer,
            port_id,
            phase,
            accepted_ms: now_ms,
            ops_in_flight: 0,
            queue: None,
            slots: Vec::new(),
            free_slots: Vec::new(),
            aers: Vec::new(),
            parking: false,
            aborts: Vec::new(),
            durable_waits: Vec::new(),
            withdrawn: false,
        }
    }

    // ----- hot upgrade --------------------------------------------------------------

    /// Starts parking: commands already taken finish, new ones are held.
    pub(super) fn park(&mut self) {
        self.parking = true;
    }

    /// The socket's descriptor; `None` on RDMA.
    pub(super) fn raw_fd(&self) -> Option<RawFd> {
        match &self.wire {
            Wire::Tcp(s) => Some(s.socket.as_raw_fd()),
            Wire::Rdma(_) => None,
        }
    }

    /// Records the socket's slot in the ring's registered-file table.
    pub(super) fn set_registered_file(&mut self, slot: u32) {
        if let Wire::Tcp(s) = &mut self.wire {
            s.registered_file = Some(slot);
        }
    }

    /// Takes the socket's slot in the ring's registered-file table, to free it.
    pub(super) fn take_registered_file(&mut self) -> Option<u32> {
        match &mut self.wire {
            Wire::Tcp(s) => s.registered_file.take(),
            Wire::Rdma(_) => None,
        }
    }

    /// A second descriptor of the socket, for another engine process.
    pub(super) fn dup_socket(&self) -> std::io::Result<TcpStream> {
        match &self.wire {
            Wire::Tcp(s) => s.socket.try_clone(),
            Wire::Rdma(_) => Err(std::io::Error::other("an RDMA connection has no socket")),
        }
    }

    /// The serial number of the RDMA connection, if it is one.
    pub(super) fn rdma_serial(&self) -> Option<u64> {
        match &self.wire {
            Wire::Rdma(w) => Some(w.serial),
            Wire::Tcp(_) => None,
        }
    }

    /// Whether the commands this connection handed to ring clients are to be
    /// withdrawn now: it closed with some under way. Its host takes their outcome as
    /// unknown and writes them again through another path, and may write the same
    /// blocks anew after that: a write forwarded later would land over those.
    /// True once.
    pub(super) fn withdraw_handed(&mut self) -> bool {
        let now = self.phase == Phase::Closed && self.ops_in_flight > 0 && !self.withdrawn;
        self.withdrawn |= now;
        now
    }

    /// Whether the connection is closed and nothing references its memory any more.
    pub(super) fn can_free(&self) -> bool {
        self.phase == Phase::Closed && self.ops_in_flight == 0
    }

    /// Shuts the socket down (or disconnects the queue pair); outstanding operations
    /// complete with errors, after which the connection is freed.
    pub(super) fn begin_close(&mut self) {
        if self.phase != Phase::Closed {
            self.phase = Phase::Closed;
            match &mut self.wire {
                Wire::Tcp(s) => {
                    let _ = s.socket.shutdown(Shutdown::Both);
                }
                Wire::Rdma(w) => w.disconnect(),
            }
        }
    }

    /// Gives every buffer back and ends the queue's part in its controller.
    pub(super) fn release(&mut self, r: &mut Reactor) {
        let target = r.target.clone();
        for s in &mut self.slots {
            if let Some(b) = s.io.take_buf() {
                r.ring.pool.put(b);
            }
        }
        match &mut self.wire {
            Wire::Tcp(s) => s.release(&mut r.ring),
            Wire::Rdma(w) => w.release(r),
        }
        if let Some(q) = self.queue.take() {
            if !q.authenticated {
                tracing::warn!(
                    subsystem = q.controller.subsystem.nqn,
                    host = q.controller.hostnqn,
                    address = self.peer,
                    qid = q.qid,
                    "a queue closed without authenticating (DH-HMAC-CHAP): the host has no secret, or the wrong one"
                );
            }
            q.controller.release_queue(q.qid);
            if q.qid == 0 {
                // The admin queue is the association: without it the controller ends.
                q.controller.fail("admin queue closed");
                target.unregister_controller(q.controller.cntlid);
            }
        }
    }
    /// Ends the connection for a transport error: a C2HTermReq goes out first on TCP
    /// (RDMA has no such message and closes at once).
    pub(super) fn fatal(&mut self, r: &mut Reactor, idx: u32, e: FatalError, offending: &[u8]) {
        match &mut self.wire {
            Wire::Tcp(s) => s.queue_term_req(&e, offending),
            Wire::Rdma(_) => {
                tracing::warn!(address = self.peer, "closing the connection: {}", e.reason);
                return self.begin_close();
            }
        }
        self.phase = Phase::Draining;
        r.mark_dirty(idx);
    }

    pub(super) fn sequence_error(&mut self, r: &mut Reactor, idx: u32, reason: &'static str) {
        self.fatal(r, idx, FatalError { fes: fes::PDU_SEQUENCE_ERROR, fei: 0, reason }, &[]);
    }

    /// Answers a command the transport refuses before it runs; it still left the
    /// submission queue.
    pub(super) fn refuse(&mut self, r: &mut Reactor, idx: u32, cid: u16, status: Status) {
        self.took_command();
        self.respond(r, idx, cid, status, 0);
    }

    /// A command left the submission queue: its head moves on (the response says where).
    fn took_command(&mut self) {
        if let Some(q) = &mut self.queue {
            q.sqhd = if q.sqhd >= q.sqsize { 0 } else { q.sqhd + 1 };
        }
    }

    // ----- commands -----------------------------------------------------------------

    pub(super) fn on_command(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8], digest_ok: bool) {
        let fabrics = cmd.opcode == admin_opcode::FABRICS;
        let on_admin = self.queue.as_ref().is_none_or(|q| q.qid == 0);
        let limit = if fabrics || on_admin { ADMIN_IN_CAPSULE_DATA } else { IO_IN_CAPSULE_DATA };
        if data.len() > limit {
            let e = FatalError {
                fes: fes::DATA_LIMIT_EXCEEDED,
                fei: 0,
                reason: "in-capsule data exceeds the capsule size",
            };
            return self.fatal(r, idx, e, &[]);
        }
        self.took_command();
        if !digest_ok {
            return self.respond(r, idx, cmd.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0);
        }
        if !cmd.has_fabrics_flags() {
            // A PRP data pointer has no meaning on a fabric; fused pairs are not served.
            return self.respond(r, idx, cmd.cid, Status::INVALID_FIELD.with_dnr(), 0);
        }
        if self.queue.is_none() {
            if fabrics && cmd.fctype() == fctype::CONNECT {
                return self.on_connect(r, idx, cmd, data);
            }
            return self.respond(r, idx, cmd.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0);
        }
        let (qid, dead, authenticated) =
            self.queue.as_ref().map_or((0, false, false), |q| (q.qid, q.controller.is_dead(), q.authenticated));
        if dead {
            // The association ended (keep-alive, admin queue gone, removal): this queue
            // must not serve another command.
            return self.begin_close();
        }
        let authenticating = fabrics && matches!(cmd.fctype(), fctype::AUTH_SEND | fctype::AUTH_RECEIVE);
        if !authenticating && !authenticated {
            // Logged when the queue closes, with the host's address.
            return self.respond(r, idx, cmd.cid, Status::AUTH_REQUIRED.with_dnr(), 0);
        }
        // Reservation commands carry a few bytes of keys, fetched as an admin command's.
        if (fabrics || qid == 0 || reservation::is_reservation_command(cmd.opcode))
            && let Some(len) = host_data_outside_capsule(cmd)
        {
            return self.fetch_then_run(r, idx, cmd, len);
        }
        self.run_command(r, idx, cmd, data);
    }

    /// Runs a command that has its host data (in `data`), past the checks every
    /// command passes when it arrives.
    fn run_command(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        let fabrics = cmd.opcode == admin_opcode::FABRICS;
        let qid = self.queue.as_ref().map_or(0, |q| q.qid);
        if fabrics && matches!(cmd.fctype(), fctype::AUTH_SEND | fctype::AUTH_RECEIVE) {
            self.on_auth(r, idx, cmd, data);
        } else if qid == 0 {
            self.on_admin(r, idx, cmd, data);
        } else if fabrics {
            match cmd.fctype() {
                fctype::DISCONNECT => {
                    self.respond(r, idx, cmd.cid, Status::SUCCESS, 0);
                    self.phase = Phase::Draining;
                }
                fctype::CONNECT => self.respond(r, idx, cmd.cid, Status::COMMAND_SEQUENCE_ERROR.with_dnr(), 0),
                // Property Get/Set belong on the admin queue, as Linux nvmet and SPDK
                // answer too.
                _ => self.respond(r, idx, cmd.cid, Status::INVALID_OPCODE.with_dnr(), 0),
            }
        } else {
            self.on_io(r, idx, cmd, data);
        }
    }

    /// Holds an admin or fabrics command in a slot while the fabric fetches its `len`
    /// bytes of host data (an R2T on TCP, an RDMA READ), as it does a write's.
    fn fetch_then_run(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, len: u32) {
        if len as usize > MAX_TRANSFER {
            return self.respond(r, idx, cmd.cid, Status::INVALID_FIELD.with_dnr(), 0);
        }
        let Some(tag) = self.free_slots.pop() else {
            return self.respond(r, idx, cmd.cid, Status::COMMAND_ID_CONFLICT.with_dnr(), 0);
        };
        let slot = &mut self.slots[usize::from(tag)];
        slot.cid = cmd.cid;
        slot.command = Some(Box::new(*cmd));
        // The slot's block I/O holds only the data buffer and the transfer's status.
        slot.io.reset(IoPlan::Flush, r.ring.pass_ns);
        slot.io.set_buf(r.ring.io_buf(len as usize));
        slot.expected = len;
        slot.received = 0;
        slot.state = SlotState::AwaitingData;
        match &mut self.wire {
            Wire::Tcp(s) => s.request_data(cmd.cid, tag, len),
            Wire::Rdma(_) => self.fetch_by_rdma_read(r, idx, tag, cmd.cid, len as usize),
        }
        r.mark_dirty(idx);
    }

    /// Slot `tag`'s host data is all in (or its transfer failed): a held admin or
    /// fabrics command runs, an I/O command goes to its backend.
    pub(super) fn data_in(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        let Some(mut cmd) = slot.command.take() else {
            return if slot.io.status.is_success() { self.start_io(r, idx, tag) } else { self.finish(r, idx, tag) };
        };
        let (status, len, buf) = (slot.io.status, slot.expected as usize, slot.io.take_buf());
        slot.state = SlotState::Free;
        self.free_slots.push(tag);
        match &buf {
            Some(b) if status.is_success() => {
                // It runs as if the data had come in its capsule.
                cmd.dptr = SglDescriptor { address: 0, length: len as u32, id: sgl::IN_CAPSULE };
                self.run_command(r, idx, &cmd, &b.as_slice()[..len]);
            }
            _ => self.respond(r, idx, cmd.cid, status, 0),
        }
        if let Some(b) = buf {
            r.ring.pool.put(b);
        }
        r.mark_dirty(idx);
    }

    fn on_connect(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        let (tls, transport) = match &self.wire {
            Wire::Tcp(s) => (s.tls.as_deref(), Transport::Tcp),
            Wire::Rdma(_) => (None, Transport::Rdma),
        };
        match fabrics::connect(&r.target, cmd, data, tls, transport) {
            Ok(c) => {
                // Bit 17 of DW0 tells the host to authenticate before anything else.
                let result = u64::from(c.controller.cntlid)
                    | if c.auth_required { u64::from(nvpool_wire::auth::CONNECT_AUTH_REQUIRED) } else { 0 };
                let cattr = nvpool_wire::fabrics::ConnectCommand::from_command(cmd).cattr;
                let namespaces = c.controller.subsystem.namespaces();
                let generation = c.controller.subsystem.generation();
                // One slot per queue entry: commands that wait for data or the disk.
                let depth = usize::from(c.sqsize) + 1;
                self.slots = (0..depth).map(|_| Slot::free()).collect();
                self.free_slots = (0..depth as u16).rev().collect();
                self.queue = Some(Queue {
                    controller: c.controller,
                    qid: c.qid,
                    sqsize: c.sqsize,
                    sqhd: 1,
                    flow_control_disabled: cattr & CATTR_DISABLE_SQ_FLOW_CONTROL != 0,
                    namespaces,
                    generation,
                    authenticated: !c.auth_required,
                    auth: None,
                });
                self.respond(r, idx, cmd.cid, Status::SUCCESS, result);
            }
            Err(refused) => self.respond(r, idx, cmd.cid, refused.status, u64::from(refused.result)),
        }
    }

    /// Authentication Send or Receive, on any queue at any time: a host authenticates
    /// each queue after Connect, and again whenever it wants. Diffie-Hellman work runs
    /// on another thread, and the command completes when it is back (`on_auth_checked`).
    fn on_auth(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        let Some(q) = &mut self.queue else { return };
        let controller = q.controller.clone();
        if q.qid == 0 {
            // The host sends no Keep Alive before its admin queue authenticated: the
            // transaction's own messages keep the association alive meanwhile.
            controller.keep_alive(r.target.now_ms());
        }
        match auth::handle(&mut q.auth, &controller, cmd, data) {
            Handled::Now(answer) => self.auth_answer(r, idx, cmd.cid, answer),
            Handled::Later(job) => {
                // Held like a deferred disk command: the connection outlives the job.
                self.ops_in_flight += 1;
                let (links, reactor, cid) = (r.links.clone(), r.ring.id, cmd.cid);
                auth::run_off_reactor(move || {
                    let checked = job.run();
                    links[reactor].run(move |r| r.with_conn(idx, |r, c| c.on_auth_checked(r, idx, cid, checked)));
                });
            }
        }
    }

    /// The result of an authentication job: the Send that started it completes.
    pub(super) fn on_auth_checked(&mut self, r: &mut Reactor, idx: u32, cid: u16, checked: auth::Checked) {
        self.ops_in_flight -= 1;
        if self.phase == Phase::Closed {
            return;
        }
        let Some(q) = &mut self.queue else { return };
        let answer = auth::checked(&mut q.auth, checked);
        self.auth_answer(r, idx, cid, answer);
    }

    fn auth_answer(&mut self, r: &mut Reactor, idx: u32, cid: u16, answer: auth::Answer) {
        let Some(q) = &mut self.queue else { return };
        let controller = &q.controller;
        match answer.outcome {
            Outcome::Continues => {}
            Outcome::Authenticated => {
                q.authenticated = true;
                if q.qid == 0 {
                    tracing::info!(
                        subsystem = controller.subsystem.nqn,
                        host = controller.hostnqn,
                        cntlid = controller.cntlid,
                        "host authenticated (DH-HMAC-CHAP)"
                    );
                }
            }
            Outcome::Failed(why) => {
                q.authenticated = false;
                tracing::warn!(
                    subsystem = controller.subsystem.nqn,
                    host = controller.hostnqn,
                    address = self.peer,
                    qid = q.qid,
                    "DH-HMAC-CHAP authentication failed: {why}"
                );
            }
        }
        if let Some(d) = answer.data {
            self.send_owned(r, cid, d);
        }
        self.respond(r, idx, cid, answer.status, 0);
    }

    fn on_admin(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        let Some(q) = &self.queue else { return };
        let controller = q.controller.clone();
        match admin::handle(&r.target, &controller, cmd, data, self.aers.len()) {
            AdminOutcome::ParkAsyncEvent => {
                self.aers.push(cmd.cid);
                self.deliver_events(r, idx);
            }
            AdminOutcome::Complete { status, result, data } => {
                // The handler checked the host's buffer: the data fills it exactly and
                // is within MDTS.
                if let Some(d) = data.filter(|d| !d.is_empty()) {
                    self.send_owned(r, cmd.cid, d);
                }
                self.respond(r, idx, cmd.cid, status, result);
            }
        }
    }

    /// Completes outstanding Asynchronous Event Requests with pending events.
    fn deliver_events(&mut self, r: &mut Reactor, idx: u32) {
        let Some(q) = &self.queue else { return };
        let controller = q.controller.clone();
        while !self.aers.is_empty() {
            let Some(event) = controller.take_event() else {
                break;
            };
            let cid = self.aers.remove(0);
            self.respond(r, idx, cid, Status::SUCCESS, u64::from(event));
        }
    }

    /// Follows a change of the subsystem's namespaces. Free slots let go of the
    /// namespaces they kept, so a removed namespace is not held open by an idle queue.
    fn refresh_namespaces(&mut self) {
        if self.queue.as_mut().is_some_and(Queue::refresh) {
            for slot in self.slots.iter_mut().filter(|s| s.state == SlotState::Free) {
                slot.ns = None;
            }
        }
    }

    fn on_io(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8]) {
        self.refresh_namespaces();
        let Some(q) = &self.queue else { return };
        let Some(ns) = q.namespaces.get(&cmd.nsid) else {
            return self.respond(r, idx, cmd.cid, Status::INVALID_NAMESPACE.with_dnr(), 0);
        };
        // A path the host should not use answers so that the host retries elsewhere.
        if let Some(status) = ana::io_status(q.controller.ana_state(ns.ana_group)) {
            return self.respond(r, idx, cmd.cid, status, 0);
        }
        if reservation::is_reservation_command(cmd.opcode) {
            let ns = ns.clone();
            return self.on_reservation(r, idx, cmd, data, &ns);
        }
        let (plan, source) = match nvm::plan(ns, cmd, data.len()) {
            Ok(p) => p,
            Err(s) => {
                ns.stats.rejected(r.ring.id, s);
                return self.respond(r, idx, cmd.cid, s, 0);
            }
        };
        // Data a backend drops (null) is received and never copied.
        let keep_data = !matches!(plan, IoPlan::Write { .. }) || ns.backend.keeps_write_data();
        let host_len = plan.host_data_len() as usize;
        let Some(tag) = self.free_slots.pop() else {
            // More commands than the queue size the host connected with.
            return self.respond(r, idx, cmd.cid, Status::COMMAND_ID_CONFLICT.with_dnr(), 0);
        };
        let slot = &mut self.slots[usize::from(tag)];
        // A slot keeps its namespace after it is freed, so a queue doing I/O to one
        // namespace takes no reference (no atomic) per command.
        if !slot.ns.as_ref().is_some_and(|held| Arc::ptr_eq(held, ns)) {
            slot.ns = Some(ns.clone());
        }
        slot.cid = cmd.cid;
        slot.io.reset(plan, r.ring.pass_ns);
        ns.stats.started(r.ring.id);
        slot.expected = host_len as u32;
        slot.received = 0;
        if host_len == 0 {
            return self.start_io(r, idx, tag);
        }
        let in_capsule = match source {
            Some(Source::InCapsule { offset }) => Some(&data[offset..offset + host_len]),
            _ => None,
        };
        if keep_data {
            let mut buf = r.ring.io_buf(host_len);
            if let Some(d) = in_capsule {
                buf.as_mut_slice()[..host_len].copy_from_slice(d);
            }
            slot.io.set_buf(buf);
        }
        if in_capsule.is_some() {
            slot.received = host_len as u32;
            return self.start_io(r, idx, tag);
        }
        slot.state = SlotState::AwaitingData;
        match &mut self.wire {
            Wire::Tcp(s) => s.request_data(cmd.cid, tag, host_len as u32),
            Wire::Rdma(_) => self.fetch_by_rdma_read(r, idx, tag, cmd.cid, host_len),
        }
    }

    /// Runs a reservation command on the namespace, at once: it touches only the
    /// namespace's reservation state, never its data.
    fn on_reservation(&mut self, r: &mut Reactor, idx: u32, cmd: &Command, data: &[u8], ns: &Namespace) {
        let Some(q) = &self.queue else { return };
        if !ns.serves_reservations() {
            return self.respond(r, idx, cmd.cid, Status::INVALID_OPCODE.with_dnr(), 0);
        }
        let outcome = ns.reservations.execute(&q.controller.hostid, cmd, data);
        let mut durable = None;
        if outcome.is_ok()
            && cmd.opcode == nvpool_wire::reservation::opcode::ACQUIRE
            && let Some(key) = ns.reservations.holder_key()
        {
            durable = ns.backend.reservation_taken(key);
        }
        match outcome {
            Ok(Executed::Done(report)) => {
                if let Some(d) = report.filter(|d| !d.is_empty()) {
                    self.send_owned(r, cmd.cid, d);
                }
                match durable {
                    Some(durable) => {
                        self.durable_waits.push((cmd.cid, durable));
                        self.complete_durable(r, idx);
                    }
                    None => self.respond(r, idx, cmd.cid, Status::SUCCESS, 0),
                }
            }
            Ok(Executed::Aborting(abort)) => {
                self.aborts.push((cmd.cid, ns.reservations.clone(), abort));
                self.complete_aborts(r, idx);
            }
            Err(status) => self.respond(r, idx, cmd.cid, status, 0),
        }
    }

    /// Completes the Preempt and Abort commands whose wait is over (see
    /// `NamespaceReservations`): checked at once and then at every check of the
    /// connection, the timer's at the latest.
    pub(super) fn complete_aborts(&mut self, r: &mut Reactor, idx: u32) {
        let mut i = 0;
        while i < self.aborts.len() {
            let (cid, reservations, abort) = &mut self.aborts[i];
            if reservations.advance(abort) {
                let cid = *cid;
                self.aborts.remove(i);
                self.respond(r, idx, cid, Status::SUCCESS, 0);
            } else {
                i += 1;
            }
        }
    }

    /// Completes the Acquires whose change is durable now: checked at once and then
    /// at every check of the connection, the timer's at the latest.
    pub(super) fn complete_durable(&mut self, r: &mut Reactor, idx: u32) {
        let mut i = 0;
        while i < self.durable_waits.len() {
            match self.durable_waits[i].1.get().copied() {
                Some(status) => {
                    let (cid, _) = self.durable_waits.remove(i);
                    let status = if status.is_success() { Status::SUCCESS } else { Status::INTERNAL_ERROR };
                    self.respond(r, idx, cid, status, 0);
                }
                None => i += 1,
            }
        }
    }

    /// Hands slot `tag`'s command, its data received, to the namespace's backend.
    pub(super) fn start_io(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        let Some(ns) = slot.ns.as_ref() else { return };
        // Checked here, as the command reaches the data, not when it arrived: a write
        // whose data came by R2T after its host was preempted must not land.
        // Counted first, so that a Preempt and Abort either refuses it or waits for it.
        slot.fence = ns.reservations.enter(r.ring.id);
        let host = self.queue.as_ref().map(|q| &q.controller.hostid);
        let access = if matches!(slot.io.plan, IoPlan::Read { .. }) { Access::Read } else { Access::Write };
        if host.is_some_and(|h| !ns.reservations.allows(h, access)) {
            if let Some(mark) = slot.fence.take() {
                ns.reservations.done(r.ring.id, mark);
            }
            slot.io.status = Status::RESERVATION_CONFLICT.with_dnr();
            return self.finish(r, idx, tag);
        }
        if let IoPlan::DatasetManagement { ranges, .. } = slot.io.plan
            && let Err(status) = nvm::check_dsm_ranges(ns, slot.io.data().unwrap_or_default(), ranges)
        {
            slot.io.status = status;
            return self.finish(r, idx, tag);
        }
        slot.state = SlotState::Backend;
        let mut queue = DiskQueue::new(&mut r.ring, idx, tag, self.wire.data_digest());
        ns.start(&mut slot.io, &mut queue);
        let queued = queue.finish();
        self.queued(r, idx, tag, queued);
    }

    /// Counts what a backend call left in flight; with nothing in flight the command
    /// is done now.
    fn queued(&mut self, r: &mut Reactor, idx: u32, tag: u16, queued: Queued) {
        self.ops_in_flight += queued.ops + u32::from(queued.deferred);
        if self.slots[usize::from(tag)].io.is_idle() {
            self.backend_done(r, idx, tag);
        }
    }

    /// The answer to slot `tag`'s command from wherever its backend handed it: the
    /// thread it deferred it to, or the owner of a remote namespace (which gives the
    /// command's buffer back with it).
    pub(super) fn on_resumed(&mut self, r: &mut Reactor, idx: u32, tag: u16, status: Status, buf: Option<Buf>) {
        self.ops_in_flight -= 1;
        let Some(slot) = self.slots.get_mut(usize::from(tag)) else { return };
        if let Some(b) = buf {
            slot.io.set_buf(b);
        }
        slot.io.deferred_done();
        let Some(ns) = slot.ns.as_ref() else { return };
        if self.phase == Phase::Closed {
            // Nobody waits for the answer, but the backend lets go of the command.
            if slot.io.is_idle() {
                ns.backend.finished(&mut slot.io, r.ring.id);
                if let Some(mark) = slot.fence.take() {
                    ns.reservations.done(r.ring.id, mark);
                }
            }
            return;
        }
        let mut queue = DiskQueue::new(&mut r.ring, idx, tag, self.wire.data_digest());
        ns.resume(&mut slot.io, status, &mut queue);
        let queued = queue.finish();
        self.queued(r, idx, tag, queued);
    }

    pub(super) fn on_disk(&mut self, r: &mut Reactor, idx: u32, tag: u16, res: i32) {
        self.ops_in_flight -= 1;
        r.ring.disk_in_flight -= 1;
        let Some(slot) = self.slots.get_mut(usize::from(tag)) else {
            return;
        };
        if slot.io.op_done(res) && slot.io.is_idle() {
            self.backend_done(r, idx, tag);
        }
    }

    /// Slot `tag`'s command has nothing in flight any more: the backend lets go of what
    /// it held, and the command is answered.
    fn backend_done(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let needs_bytes = self.wire.data_digest();
        let slot = &mut self.slots[usize::from(tag)];
        if let Some(ns) = slot.ns.as_ref() {
            let mut queue = DiskQueue::new(&mut r.ring, idx, tag, needs_bytes);
            ns.backend.settle(&mut slot.io, &mut queue);
            let queued = queue.finish();
            if !slot.io.is_idle() {
                // Its answer comes back through `on_resumed`.
                self.ops_in_flight += queued.ops + u32::from(queued.deferred);
                return;
            }
            ns.backend.finished(&mut slot.io, r.ring.id);
        }
        let fenced = slot.fence.take().map(|mark| (mark, slot.ns.clone()));
        if self.phase != Phase::Closed {
            self.finish(r, idx, tag);
        }
        // Last: a Preempt and Abort waiting for this command sees it counted done.
        if let Some((mark, Some(ns))) = fenced {
            ns.reservations.done(r.ring.id, mark);
        }
    }

    /// Completes slot `tag`: counts it, sends the data or the response, frees the slot.
    pub(super) fn finish(&mut self, r: &mut Reactor, idx: u32, tag: u16) {
        let slot = &mut self.slots[usize::from(tag)];
        let (cid, status, plan, from_device) = (slot.cid, slot.io.status, slot.io.plan, slot.io.from_device);
        let buf = slot.io.take_buf();
        // The slot keeps its namespace for the next command (see `on_io`); a read
        // sent straight from the backend's memory holds its own reference until the
        // send is done.
        let mut mapped = None;
        if let Some(ns) = &slot.ns {
            ns.stats.completed(r.ring.id, &plan, status, r.ring.pass_ns.saturating_sub(slot.io.started_ns));
            if let (IoPlan::Read { offset, len }, true, None) = (plan, status.is_success(), &buf)
                && let Some(at) = ns.backend.mapped(offset, len as usize)
            {
                mapped = Some((at, ns.clone()));
            }
        }
        slot.state = SlotState::Free;
        self.free_slots.push(tag);
        match (plan, status.is_success()) {
            (IoPlan::Read { len, .. }, true) => {
                let len = len as usize;
                let payload = match (buf, mapped) {
                    (Some(b), _) => Payload::Pool(b, len),
                    // Only made without data digests, which would need the bytes here.
                    (None, Some((at, ns))) if !self.wire.data_digest() => Payload::Mapped { at, len, _namespace: ns },
                    _ => Payload::Zeroes(len),
                };
                let success = self.queue.as_ref().is_some_and(|q| q.flow_control_disabled);
                if !self.send_data(r, cid, payload, success, from_device) {
                    self.respond(r, idx, cid, Status::SUCCESS, 0);
                }
            }
            _ => {
                if let Some(b) = buf {
                    r.ring.pool.put(b);
                }
                self.respond(r, idx, cid, status, 0);
            }
        }
        r.mark_dirty(idx);
    }
    // ----- to the host: the fabric's part -----------------------------------------------

    fn respond(&mut self, r: &mut Reactor, idx: u32, cid: u16, status: Status, result: u64) {
        let (sqhd, sqid) = self.queue.as_ref().map_or((0, 0), |q| (q.sqhd, q.qid));
        let c = Completion { result: result as u32, result_hi: (result >> 32) as u32, sqhd, sqid, cid, status };
        match &mut self.wire {
            Wire::Tcp(s) => s.respond(&c),
            Wire::Rdma(w) => w.respond(&c),
        }
        r.mark_dirty(idx);
    }
    /// Queues data the engine made itself for command `cid` (an admin, fabrics or
    /// reservation answer), ahead of its response.
    fn send_owned(&mut self, r: &mut Reactor, cid: u16, data: Vec<u8>) {
        self.send_data(r, cid, Payload::Owned(data), false, false);
    }

    /// Queues command `cid`'s data for the host: a C2HData PDU (whose SUCCESS flag,
    /// with `success`, stands for the response), or an RDMA WRITE. `from_device`: a
    /// device read the data (see `BlockIo::from_device`). Returns whether the response
    /// went with the data.
    #[inline(always)]
    fn send_data(&mut self, r: &mut Reactor, cid: u16, payload: Payload, success: bool, from_device: bool) -> bool {
        match &mut self.wire {
            Wire::Tcp(s) => s.send_data(cid, payload, success, from_device, &r.ring.zeroes),
            Wire::Rdma(w) => {
                if !w.send_payload(&mut r.ring, cid, payload) {
                    // No key to write with, or memory the device cannot register: the
                    // connection cannot go on.
                    self.begin_close();
                }
                false
            }
        }
    }
    /// Sends what the pass queued: one `sendmsg` on TCP, one chain of work requests
    /// on RDMA.
    pub(super) fn post_send(&mut self, r: &mut Reactor, idx: u32) {
        if self.phase == Phase::Closed {
            return;
        }
        match &mut self.wire {
            Wire::Tcp(s) => match s.post_send(&mut r.ring, idx) {
                Sending::Posted => self.ops_in_flight += 1,
                Sending::Nothing if self.phase == Phase::Draining => self.begin_close(),
                Sending::Nothing | Sending::Busy => {}
            },
            Wire::Rdma(w) => {
                let (posted, result) = w.flush(idx);
                self.ops_in_flight += posted;
                if let Err(e) = result {
                    tracing::warn!(address = self.peer, "{e}");
                    self.begin_close();
                }
            }
        }
    }

    /// Periodic and on-demand checks: keep-alive, ended associations, handshakes that
    /// never finish, and events waiting for an Asynchronous Event Request.
    pub(super) fn check(&mut self, r: &mut Reactor, idx: u32, timers: bool) {
        if self.phase == Phase::Closed {
            return;
        }
        self.refresh_namespaces();
        let now = r.target.now_ms();
        match &self.queue {
            None if timers && now.saturating_sub(self.accepted_ms) > HANDSHAKE_TIMEOUT_MS => self.begin_close(),
            None => {}
            Some(q) => {
                if q.qid == 0 && timers && q.controller.keep_alive_expired(now) {
                    q.controller.fail("keep alive timeout");
                }
                if q.controller.is_dead() {
                    self.begin_close();
                } else if q.qid == 0 {
                    self.deliver_events(r, idx);
                }
            }
        }
        if !self.aborts.is_empty() {
            self.complete_aborts(r, idx);
        }
        if !self.durable_waits.is_empty() {
            self.complete_durable(r, idx);
        }
    }
}

/// The bytes of host data an admin or fabrics command carries outside its capsule (a
/// Transport SGL Data Block: fetched by R2T on TCP, or by RDMA READ for a keyed
/// descriptor), if it carries any. The direction is the opcode's (a fabrics command's
/// function type's) low two bits: 01b is host to controller.
fn host_data_outside_capsule(cmd: &Command) -> Option<u32> {
    let direction = if cmd.opcode == admin_opcode::FABRICS { cmd.fctype() & 0b11 } else { cmd.opcode & 0b11 };
    (direction == 0b01 && cmd.dptr.id == sgl::TRANSPORT && cmd.dptr.length > 0).then_some(cmd.dptr.length)
}

impl Wire {
    /// Whether data PDUs carry digests (never on RDMA).
    pub(super) fn data_digest(&self) -> bool {
        matches!(self, Wire::Tcp(s) if s.digests.data)
    }
}

/// A connection (one queue).
#[derive(Debug, Serialize, Deserialize)]
pub struct ConnImage {
    /// The reactor that served it.
    pub reactor: usize,
    /// Index of its socket.
    pub fd: usize,
    /// The listener that accepted it.
    pub port_id: Option<u16>,
    /// Who its TLS session proved the host to be (the kernel keeps the session itself
    /// with the socket).
    #[serde(default)]
    pub tls: Option<crate::tls::TlsPeer>,
    /// Whether ICReq was answered.
    pub ready: bool,
    /// Header digests.
    pub header_digest: bool,
    /// Data digests.
    pub data_digest: bool,
    /// Bytes read from the socket and not yet acted on: whole commands that arrived
    /// while the old engine stopped taking new ones, then the start of the next PDU.
    pub input: Vec<u8>,
    /// The queue, once Connect succeeded.
    pub queue: Option<QueueImage>,
    /// Command IDs of outstanding Asynchronous Event Requests (admin queue).
    pub aers: Vec<u16>,
}

/// A connection's queue.
#[derive(Debug, Serialize, Deserialize)]
pub struct QueueImage {
    /// Controller ID.
    pub cntlid: u16,
    /// Queue ID.
    pub qid: u16,
    /// Size (0's based).
    pub sqsize: u16,
    /// Submission queue head reported in completions.
    pub sqhd: u16,
    /// Whether the host disabled SQ flow control.
    pub flow_control_disabled: bool,
    /// Whether the queue may take commands other than authentication (an image from
    /// a build without authentication has every queue so).
    #[serde(default = "yes")]
    pub authenticated: bool,
}

fn yes() -> bool {
    true
}

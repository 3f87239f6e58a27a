//! `remote:HOST:PORT/NQN/NSID`: a namespace whose data another engine (its owner)
//! serves. This engine becomes one more access point to it: each command is handed to
//! the reactor's own queue to the owner (`queue.rs`, a ring client: io_uring, the same
//! thread), forwarded over NVMe/TCP, and the owner's answer, path errors included, goes
//! back to the host as it came.
//!
//! Connections are set up off the I/O path: a thread per link holds the admin queue
//! (Connect, enable, Number of Queues) and connects one I/O queue per reactor when
//! that reactor asks, again after a failure, with backoff. While a reactor has no
//! queue, its commands wait up to [`HOLD_MS`]; then they fail with ANA Inaccessible
//! (no Do Not Retry), so a multipath host retries them on another path.
//!
//! A mirror's link to another engine's replica is *fenced*: before a queue serves, it
//! takes the replica's Write Exclusive reservation under the mirror's generation
//! (preempting an older generation's holder), so an engine that lost the serving
//! role gets Reservation Conflict for its writes (see `Fence`).
//!
//! A link is a controller on the owner. By default each remote namespace has its own
//! (`remote_queues = "per-namespace"`); with `"per-owner"` the namespaces of one
//! owner subsystem share one, so a reactor keeps one queue to that subsystem however
//! many of its namespaces it serves. (An NVMe queue belongs to one controller of one
//! subsystem, so namespaces of different subsystems never share a queue.)

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use nvpool_initiator::{ConnectOptions, Queue, connect_admin};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, admin_opcode};
use nvpool_wire::identify::{self, cns, nidt};
use nvpool_wire::tcp::Digests;

mod queue;

use super::{Backend, BackendType, BlockIo, DiskQueue, Handover, OpenEnv, Opened};
use crate::config::RemoteQueues;
use crate::error::{Error, Result};
use crate::plan::IoPlan;
use crate::ring::{Mail, Mailer};
use queue::HostQueue;

/// The kind.
pub const TYPE: BackendType =
    BackendType { name: "remote", usage: "remote:HOST:PORT/NQN/NSID", check: |a| parse(a).map(drop), open };

/// How long a command waits for a queue to the owner before it fails with a path error.
pub const HOLD_MS: u64 = 5_000;
/// Entries of each I/O queue to the owner (0's based size 127).
pub const QUEUE_DEPTH: u16 = 128;
/// I/O queues asked of the owner: one per reactor, up to this many reactors.
const IO_QUEUES: u16 = 64;
/// Longest wait between two attempts to reach the owner.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The owner's address, subsystem NQN and NSID of a `remote:` argument.
pub fn parse(arg: &str) -> std::result::Result<(String, String, u32), String> {
    let (addr, rest) = arg.split_once('/').ok_or("no /NQN/NSID after the owner's address")?;
    let (nqn, nsid) = rest.rsplit_once('/').ok_or("no /NSID after the NQN")?;
    let nsid: u32 = nsid.parse().map_err(|_| format!("NSID {nsid:?} is not a number"))?;
    if nsid == 0 {
        return Err("NSID 0 is not a namespace".into());
    }
    nvpool_wire::fabrics::validate_nqn(nqn)?;
    if !addr.contains(':') {
        return Err(format!("owner address {addr:?} has no port"));
    }
    Ok((addr.to_string(), nqn.to_string(), nsid))
}

/// The engine's links in `per-owner` mode, by owner address and subsystem NQN.
#[derive(Default)]
pub struct RemoteLinks {
    mode: RemoteQueues,
    shared: Mutex<HashMap<(SocketAddr, String), Weak<LinkHandle>>>,
}

impl RemoteLinks {
    pub fn new(mode: RemoteQueues) -> RemoteLinks {
        RemoteLinks { mode, shared: Mutex::default() }
    }
}

/// What a reactor needs to reach one owner controller: shared by every reactor that
/// forwards to it, and by the thread that connects their queues.
pub struct RemoteLink {
    /// Its queues' key as ring clients (unique in the process).
    pub id: u64,
    /// Largest write data sent inside the command capsule, as the owner allows.
    pub in_capsule: u32,
    requests: Mutex<Sender<Request>>,
    /// Set when the last namespace using the link is gone: reactors close their
    /// queues to the owner.
    closed: AtomicBool,
    /// Set when a namespace using the link is served by another backend now (an
    /// access point whose owner was lost, a replica that failed over): commands that
    /// wait for a queue to the owner end at once with a path error, and the host
    /// sends them again, to whatever serves the namespace now.
    retired: AtomicBool,
}

/// The namespaces' hold on a link: when the last one lets go, the link closes.
pub struct LinkHandle(Arc<RemoteLink>);

impl Drop for LinkHandle {
    fn drop(&mut self) {
        self.0.closed.store(true, Ordering::Release);
        let tx = self.0.requests.lock().unwrap_or_else(|e| e.into_inner());
        let _ = tx.send(Request::Stop);
    }
}

/// Which owner namespace a forwarded command is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteNamespace {
    /// The owner's namespace ID.
    pub nsid: u32,
    /// Bytes per block, the owner's.
    pub block_shift: u32,
}

impl RemoteNamespace {
    /// As a handed command's route (see `DiskQueue::hand_to`).
    fn route(self) -> u64 {
        u64::from(self.nsid) << 32 | u64::from(self.block_shift)
    }

    /// From a handed command's route.
    fn from_route(route: u64) -> RemoteNamespace {
        RemoteNamespace { nsid: (route >> 32) as u32, block_shift: route as u32 }
    }
}

/// What the connection thread is asked.
enum Request {
    /// A queue to the owner for reactor `reactor`, whose ring gets it by mail.
    Queue { reactor: usize, mailer: Mailer },
    /// The namespace is gone: let go of the owner.
    Stop,
}

/// A connected I/O queue, handed to the reactor that asked for it.
pub struct RemoteSocket {
    /// The queue's socket, after ICReq and Connect.
    pub stream: TcpStream,
    /// Digests negotiated.
    pub digests: Digests,
    /// The owner's MAXH2CDATA.
    pub max_h2c_data: u32,
}

impl RemoteLink {
    /// Asks for a (new) queue to the owner for reactor `reactor`; it arrives as mail
    /// for the reactor's queue to the owner (the ring client keyed by the link's ID).
    pub fn request_queue(&self, reactor: usize, mailer: Mailer) {
        let tx = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let _ = tx.send(Request::Queue { reactor, mailer });
    }

    /// Whether the namespace is gone.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Whether a namespace that used the link is served by another backend now.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }
}

impl RemoteNamespace {
    /// The NVMe command that does `plan` on the owner, with `cid`; write data up to
    /// `in_capsule` bytes goes inside the capsule.
    pub fn command(&self, plan: &IoPlan, cid: u16, in_capsule: u32) -> Command {
        use nvpool_wire::command::{PSDT_SGL, SglDescriptor, io_opcode, sgl};
        let blocks =
            |offset: u64, len: u64| (offset >> self.block_shift, ((len >> self.block_shift) as u32).wrapping_sub(1));
        let (opcode, cdw, data_len) = match *plan {
            IoPlan::Read { offset, len } => {
                let (slba, nlb) = blocks(offset, u64::from(len));
                (io_opcode::READ, [slba as u32, (slba >> 32) as u32, nlb, 0, 0, 0], len)
            }
            IoPlan::Write { offset, len, fua } => {
                let (slba, nlb) = blocks(offset, u64::from(len));
                let fua_bit = if fua { 1 << 30 } else { 0 };
                (io_opcode::WRITE, [slba as u32, (slba >> 32) as u32, nlb | fua_bit, 0, 0, 0], len)
            }
            IoPlan::Flush => (io_opcode::FLUSH, [0; 6], 0),
            IoPlan::WriteZeroes { offset, len } => {
                let (slba, nlb) = blocks(offset, len);
                (io_opcode::WRITE_ZEROES, [slba as u32, (slba >> 32) as u32, nlb, 0, 0, 0], 0)
            }
            IoPlan::DatasetManagement { ranges, deallocate, .. } => {
                let attributes = if deallocate { nvpool_wire::command::DSM_ATTR_DEALLOCATE } else { 0 };
                (io_opcode::DATASET_MANAGEMENT, [ranges - 1, attributes, 0, 0, 0, 0], plan.host_data_len())
            }
        };
        let in_capsule =
            matches!(plan, IoPlan::Write { .. } | IoPlan::DatasetManagement { .. }) && data_len <= in_capsule;
        let dptr = if data_len == 0 {
            SglDescriptor::default()
        } else if in_capsule {
            SglDescriptor { address: 0, length: data_len, id: sgl::IN_CAPSULE }
        } else {
            SglDescriptor { address: 0, length: data_len, id: sgl::TRANSPORT }
        };
        Command { opcode, flags: PSDT_SGL, cid, nsid: self.nsid, dptr, cdw, ..Command::default() }
    }
}

/// A namespace of another engine, served through this one.
pub struct RemoteBackend {
    owner: String,
    subnqn: String,
    size: u64,
    reads_zeroes: bool,
    link: Arc<LinkHandle>,
    namespace: RemoteNamespace,
}

impl std::fmt::Debug for RemoteBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteBackend").field("owner", &self.owner).field("nqn", &self.subnqn).finish_non_exhaustive()
    }
}

/// The host NQN an engine presents to owners unless configured: one per machine.
pub fn default_host_nqn() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("nqn.2024-01.io.nvpool:engine:{}", host.trim())
}

/// The socket address of an owner named as `HOST:PORT`.
pub fn resolve(owner: &str) -> Result<SocketAddr> {
    owner
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("cannot resolve the owner {owner}: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("the owner {owner} resolves to no address")))
}

fn open(arg: &str, env: &OpenEnv<'_>) -> Result<Opened> {
    let (owner, subnqn, nsid) = parse(arg).map_err(Error::invalid)?;
    let addr = resolve(&owner)?;
    if env.own_listeners.contains(&addr) {
        return Err(Error::invalid(format!(
            "remote:{arg} points at this engine itself: name the owner's address, or use the volume directly"
        )));
    }
    let hostnqn = env.host_nqn;
    let hostid = crate::config::derived_host_id(hostnqn);
    let options = ConnectOptions { kato: 0, hostid, ..ConnectOptions::admin(&subnqn, hostnqn) };
    let unreachable = |e: nvpool_initiator::Error| {
        let hint = match &e {
            nvpool_initiator::Error::Command(s) if s.base() == Status::CONNECT_INVALID_HOST => {
                format!(" (allow this engine's host NQN {hostnqn} on the owner)")
            }
            _ => String::new(),
        };
        Error::unavailable(format!("cannot reach {subnqn} at {owner} to serve namespace {nsid}: {e}{hint}"))
    };
    let mut admin = connect_admin(addr, &options).map_err(unreachable)?;
    let controller = admin.identify_controller().map_err(unreachable)?;
    let ns = admin.identify_namespace(nsid).map_err(unreachable)?;
    if ns.nsze == 0 {
        return Err(Error::not_found(format!("{subnqn} at {owner} has no namespace {nsid}")));
    }
    let block_size = identify::lba_format_block_size(ns.lbaf0);
    let mut descriptors = Command { opcode: admin_opcode::IDENTIFY, nsid, ..Command::default() };
    descriptors.cdw[0] = u32::from(cns::NS_DESCRIPTORS);
    let data = admin.execute(descriptors, identify::IDENTIFY_SIZE as u32).map_err(unreachable)?.data;
    let mut uuid = None;
    let mut nguid = ns.nguid;
    for d in identify::decode_ns_descriptors(&data) {
        match d.nidt {
            nidt::UUID if d.nid.len() == 16 => uuid = d.nid.try_into().ok(),
            nidt::NGUID if d.nid.len() == 16 => nguid = d.nid.try_into().unwrap_or(nguid),
            _ => {}
        }
    }
    let uuid = uuid.ok_or_else(|| Error::invalid(format!("namespace {nsid} of {subnqn} has no UUID to share")))?;
    let namespace = RemoteNamespace { nsid, block_shift: block_size.trailing_zeros() };
    // IOCCSZ counts 16-byte units of the whole capsule, the 64-byte command included.
    let in_capsule = (controller.ioccsz * 16).saturating_sub(64);
    let fence = env.fence.map(|key| Fence { nsid, key });
    let link = match env.remote_links.mode {
        // A fenced namespace (a replica) has a link of its own, which holds its
        // reservation.
        _ if fence.is_some() => start_link(addr, options, admin, in_capsule, fence)?,
        RemoteQueues::PerNamespace => start_link(addr, options, admin, in_capsule, None)?,
        RemoteQueues::PerOwner => {
            let mut shared = env.remote_links.shared.lock().unwrap_or_else(|e| e.into_inner());
            shared.retain(|_, l| l.strong_count() > 0);
            let key = (addr, subnqn.clone());
            // A retired link's waiting commands fail at once: a new namespace gets a new one.
            match shared.get(&key).and_then(Weak::upgrade).filter(|l| !l.0.is_retired()) {
                // The identify connection goes; the shared controller serves I/O.
                Some(link) => link,
                None => {
                    let link = start_link(addr, options, admin, in_capsule, None)?;
                    shared.insert(key, Arc::downgrade(&link));
                    link
                }
            }
        }
    };
    let backend = RemoteBackend {
        owner,
        subnqn,
        size: ns.nsze << namespace.block_shift,
        reads_zeroes: ns.dlfeat & identify::DLFEAT_READS_ZEROES != 0,
        link,
        namespace,
    };
    Ok(Opened { backend: Arc::new(backend), identity: Some((uuid, nguid)) })
}

/// A new link to an owner controller, whose thread takes over the admin queue.
fn start_link(
    addr: SocketAddr,
    options: ConnectOptions,
    admin: Queue,
    in_capsule: u32,
    fence: Option<Fence>,
) -> Result<Arc<LinkHandle>> {
    let (requests, inbox) = mpsc::channel();
    let link = Arc::new(RemoteLink {
        id: crate::ring::new_client_key(),
        in_capsule,
        requests: Mutex::new(requests),
        closed: AtomicBool::new(false),
        retired: AtomicBool::new(false),
    });
    let connector = Connector { addr, options, admin: Some(admin), link: link.id, fence };
    std::thread::Builder::new()
        .name(format!("nvpool-remote-{}", link.id))
        .spawn(move || connector.run(inbox))
        .map_err(|e| Error::io("cannot start the remote namespace's connection thread", e))?;
    Ok(Arc::new(LinkHandle(link)))
}

/// Connects I/O queues to the owner when reactors ask, off the I/O path.
struct Connector {
    addr: SocketAddr,
    options: ConnectOptions,
    admin: Option<Queue>,
    link: u64,
    fence: Option<Fence>,
}

/// Takes namespace `nsid`'s reservation on queue `q` for this engine (host identifier
/// `host_id`) at generation `key`, as each link of a mirror does: what a rebuild's
/// copy writes under.
pub(crate) fn take_fence(
    q: &mut Queue,
    nsid: u32,
    key: u64,
    host_id: [u8; 16],
) -> std::result::Result<(), nvpool_initiator::Error> {
    Fence { nsid, key }.take(q, host_id)
}

/// The reservation a link holds on its namespace: Write Exclusive under `key`.
#[derive(Clone, Copy, Debug)]
struct Fence {
    nsid: u32,
    key: u64,
}

impl Fence {
    /// Takes the namespace's reservation for this engine (its host identifier
    /// `host_id`) on queue `q`: registered with the key (replacing an older key of
    /// this engine's), then holding Write Exclusive, preempting a holder whose key is
    /// older. A holder with a newer key serves the volume at a later generation: this
    /// engine must not write, and the queue is refused.
    fn take(&self, q: &mut Queue, host_id: [u8; 16]) -> std::result::Result<(), nvpool_initiator::Error> {
        use nvpool_initiator::Error;
        use nvpool_wire::reservation::{
            Acquire, AcquireAction, AcquireData, Register, RegisterAction, RegisterData, ReservationType,
        };
        let succeeded = |s: Status| if s.is_success() { Ok(()) } else { Err(Error::Command(s)) };
        let register = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 0 };
        let keys = || RegisterData { current_key: 0, new_key: self.key };
        let status = q.reservation_register(self.nsid, register, keys(), true)?;
        if status.base() == Status::RESERVATION_CONFLICT {
            // Registered already, under an older generation's key.
            let replace = Register { action: RegisterAction::Replace, ignore_key: true, change_ptpl: 0 };
            succeeded(q.reservation_register(self.nsid, replace, keys(), true)?)?;
        } else {
            succeeded(status)?;
        }
        let report = q.reservation_report(self.nsid, 4096)?;
        let (action, preempt_key) = match report.registrants.iter().find(|r| r.holds) {
            None => (AcquireAction::Acquire, 0),
            Some(h) if h.host_id == host_id => return Ok(()),
            Some(h) if h.key < self.key => (AcquireAction::Preempt, h.key),
            Some(h) => {
                return Err(Error::Protocol(format!(
                    "generation {} holds the replica's reservation, later than this engine's {}: another engine \
                     serves the volume now",
                    h.key, self.key
                )));
            }
        };
        let acquire = Acquire { action, ignore_key: false, kind: Some(ReservationType::WriteExclusive) };
        succeeded(q.reservation_acquire(self.nsid, acquire, AcquireData { current_key: self.key, preempt_key })?)
    }
}

impl Connector {
    /// Serves requests until the backend is dropped (the channel closes).
    fn run(mut self, inbox: Receiver<Request>) {
        let mut pending: VecDeque<(usize, Mailer)> = VecDeque::new();
        let mut backoff = Duration::from_millis(50);
        loop {
            // Wait for work when there is none; take whatever else came meanwhile.
            let next = if pending.is_empty() { inbox.recv().ok() } else { inbox.try_recv().ok() };
            match next {
                Some(Request::Stop) => return,
                Some(Request::Queue { reactor, mailer }) => {
                    pending.push_back((reactor, mailer));
                    continue;
                }
                None if pending.is_empty() => return,
                None => {}
            }
            let Some((reactor, mailer)) = pending.front().cloned() else { continue };
            match self.connect_io(reactor) {
                Ok(socket) => {
                    mailer.send(Mail::Client { key: self.link, message: Box::new(socket) });
                    pending.pop_front();
                    backoff = Duration::from_millis(50);
                }
                Err(e) => {
                    tracing::warn!(owner = %self.addr, nqn = %self.options.subnqn, "cannot connect to the owner: {e}; retrying in {backoff:?}");
                    self.admin = None;
                    // A Stop while the owner is away ends the retries.
                    match inbox.recv_timeout(backoff) {
                        Ok(Request::Stop) | Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        Ok(Request::Queue { reactor, mailer }) => pending.push_back((reactor, mailer)),
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    /// An I/O queue for reactor `reactor` (queue ID `reactor + 1`), with the admin
    /// queue reconnected first if the owner lost it.
    fn connect_io(&mut self, reactor: usize) -> std::result::Result<RemoteSocket, nvpool_initiator::Error> {
        let alive = self
            .admin
            .as_mut()
            .is_some_and(|a| a.execute(Command { opcode: admin_opcode::KEEP_ALIVE, ..Command::default() }, 0).is_ok());
        if !alive {
            let mut admin = connect_admin(self.addr, &self.options)?;
            admin.set_queue_count(IO_QUEUES)?;
            self.admin = Some(admin);
        }
        let cntlid = self.admin.as_ref().map_or(0, |a| a.cntlid);
        let qid = reactor as u16 + 1;
        let mut q = Queue::connect(self.addr, &self.options.io(qid, cntlid, QUEUE_DEPTH - 1))?;
        if let Some(fence) = self.fence {
            fence.take(&mut q, self.options.hostid)?;
        }
        let max_h2c_data = q.icresp.maxdata;
        let (stream, digests) = q.into_stream();
        Ok(RemoteSocket { stream, digests, max_h2c_data })
    }
}

impl Backend for RemoteBackend {
    fn kind(&self) -> &'static str {
        "remote"
    }

    /// Commands that wait for a queue to the owner (it is away) are not sent later:
    /// whatever serves the namespace now takes them when the host sends them again.
    fn retired(&self, next: Option<&dyn Backend>) {
        if next.is_none_or(|n| n.description() != self.description()) {
            self.link.0.retired.store(true, Ordering::Release);
        }
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn description(&self) -> String {
        format!("remote:{}/{}/{}", self.owner, self.subnqn, self.namespace.nsid)
    }

    fn handover(&self) -> Handover<'_> {
        Handover::Spec(self.description())
    }

    /// The owner promises its own blocks whole; this engine forwards them as they are.
    fn power_fail_atomic_bytes(&self) -> u32 {
        1 << self.namespace.block_shift
    }

    fn required_block_size(&self) -> Option<u32> {
        Some(1 << self.namespace.block_shift)
    }

    fn deallocated_reads_zeroes(&self) -> bool {
        self.reads_zeroes
    }

    fn forwards(&self) -> bool {
        true
    }

    fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        if let IoPlan::Read { len, .. } = io.plan {
            queue.give_buf(io, len as usize);
        }
        let link = &self.link.0;
        queue.hand_to(io, link.id, self.namespace.route(), || Box::new(HostQueue::new(link.clone())));
    }

    fn resume(&self, io: &mut BlockIo, status: Status, _queue: &mut DiskQueue<'_>) {
        io.status = status;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_the_owner_the_subsystem_and_the_namespace() {
        let (addr, nqn, nsid) = parse("127.0.0.1:4420/nqn.2024-01.io.nvpool:vol/3").unwrap();
        assert_eq!((addr.as_str(), nqn.as_str(), nsid), ("127.0.0.1:4420", "nqn.2024-01.io.nvpool:vol", 3));
        assert!(parse("127.0.0.1:4420/nqn.2024-01.io.nvpool:vol").unwrap_err().contains("NSID"));
        assert!(parse("127.0.0.1/nqn.2024-01.io.nvpool:vol/1").unwrap_err().contains("port"));
        assert!(parse("127.0.0.1:1/nqn.2024-01.io.nvpool:vol/0").is_err());
        assert!(parse("127.0.0.1:1/notannqn/1").is_err());
    }
}

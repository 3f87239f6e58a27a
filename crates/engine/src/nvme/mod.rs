//! Target logic: subsystems, namespaces, controllers and the command handlers.
//!
//! Nothing here does I/O. The transport hands decoded commands in and gets back
//! completions, data and, for NVM commands, a plan of the disk work to do.

pub mod admin;
pub mod ana;
pub mod auth;
pub mod controller;
pub mod data_pointer;
pub mod discovery;
pub mod fabrics;
pub mod nvm;
pub mod reservation;
pub mod stats;
pub mod subsystem;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

pub use controller::Controller;
pub use nvpool_api::{ListenerInfo, Transport};
pub use stats::{NamespaceStats, StatsSnapshot};
pub use subsystem::{Namespace, Subsystem};

use crate::config::Limits;
use crate::error::{Error, Result};
use crate::sync::{lock, read, write};

pub use crate::plan::MAX_TRANSFER;
/// MDTS as Identify reports it: log2 of the transfer in 4 KiB pages.
pub const MDTS: u8 = (MAX_TRANSFER / 4096).trailing_zeros() as u8;
/// In-capsule data accepted on I/O queues. Writes up to this size need no R2T round
/// trip. The Connect data (1 KiB) and admin capsules (8 KiB) are always accepted.
pub const IO_IN_CAPSULE_DATA: usize = 8192;
/// In-capsule data the Linux host may send on the admin queue and with fabrics
/// commands on any queue.
pub const ADMIN_IN_CAPSULE_DATA: usize = 8192;
/// Largest H2CData PDU the host may send (MAXH2CDATA): one whole transfer.
pub const MAX_H2C_DATA: u32 = MAX_TRANSFER as u32;
/// Asynchronous Event Requests a host may leave outstanding.
pub const AER_LIMIT: usize = 4;
/// Keep Alive granularity advertised in KAS, in 100 ms units.
pub const KEEP_ALIVE_GRANULARITY: u16 = 10;
/// Highest namespace ID (NN): namespaces may be numbered 1..=MAX_NSID.
pub const MAX_NSID: u32 = 1024;
/// Admin queue depth the target accepts (the Linux host asks for 32).
pub const ADMIN_QUEUE_DEPTH: u16 = 128;

/// The whole target: every subsystem, controller and listener of this engine.
pub struct Target {
    subsystems: RwLock<BTreeMap<String, Arc<Subsystem>>>,
    controllers: Mutex<BTreeMap<u16, Arc<Controller>>>,
    next_cntlid: AtomicU16,
    /// Controller IDs this engine hands out, `min << 16 | max`: the configured range
    /// until the agent sets the one the controller gave this node.
    cntlid_range: AtomicU32,
    listeners: RwLock<Vec<ListenerInfo>>,
    /// The IP address hosts reach this engine at, which the discovery log gives for
    /// the listeners in place of their own, if set.
    discovery_address: RwLock<Option<IpAddr>>,
    discovery_generation: AtomicU64,
    connections: AtomicUsize,
    /// The epoch of the reactors' pass clock.
    pub(crate) started: Instant,
    /// Limits from the configuration.
    pub limits: Limits,
}

impl Target {
    /// An empty target with the given limits, and the discovery subsystem.
    pub fn new(limits: Limits) -> Arc<Target> {
        let t = Arc::new(Target {
            subsystems: RwLock::new(BTreeMap::new()),
            controllers: Mutex::new(BTreeMap::new()),
            next_cntlid: AtomicU16::new(0),
            cntlid_range: AtomicU32::new(u32::from(limits.cntlid_min) << 16 | u32::from(limits.cntlid_max)),
            listeners: RwLock::new(Vec::new()),
            discovery_address: RwLock::new(None),
            discovery_generation: AtomicU64::new(1),
            connections: AtomicUsize::new(0),
            started: Instant::now(),
            limits,
        });
        let d = Subsystem::discovery();
        t.subsystems.write().unwrap_or_else(|e| e.into_inner()).insert(d.nqn.clone(), d);
        t
    }

    /// Milliseconds since the target started: the clock keep-alive deadlines use.
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The subsystem with this NQN.
    pub fn subsystem(&self, nqn: &str) -> Option<Arc<Subsystem>> {
        read(&self.subsystems).get(nqn).cloned()
    }

    /// The NVM subsystem with this NQN, or an error that says how to find the NQNs.
    pub fn nvm_subsystem(&self, nqn: &str) -> crate::error::Result<Arc<Subsystem>> {
        self.subsystem(nqn).filter(|s| !s.is_discovery()).ok_or_else(|| {
            crate::error::Error::not_found(format!("no subsystem {nqn}: `nvpool engine subsystem list` shows the NQNs"))
        })
    }

    /// Namespace `nsid` of NVM subsystem `nqn`.
    pub fn namespace(&self, nqn: &str, nsid: u32) -> crate::error::Result<(Arc<Subsystem>, Arc<Namespace>)> {
        let s = self.nvm_subsystem(nqn)?;
        let ns = s.namespaces().get(&nsid).cloned().ok_or_else(|| {
            crate::error::Error::not_found(format!(
                "no namespace {nsid} in {nqn}: `nvpool engine subsystem list` shows them"
            ))
        })?;
        Ok((s, ns))
    }

    /// Every subsystem, the discovery subsystem included.
    pub fn subsystems(&self) -> Vec<Arc<Subsystem>> {
        read(&self.subsystems).values().cloned().collect()
    }

    /// Adds a subsystem; fails if the NQN is taken.
    pub fn add_subsystem(&self, s: Arc<Subsystem>) -> Result<()> {
        let mut map = write(&self.subsystems);
        if map.contains_key(&s.nqn) {
            return Err(Error::exists(format!(
                "subsystem {} already exists: remove it first or pick another NQN",
                s.nqn
            )));
        }
        map.insert(s.nqn.clone(), s);
        drop(map);
        self.discovery_changed();
        Ok(())
    }

    /// Removes a subsystem and ends every controller connected to it.
    pub fn remove_subsystem(&self, nqn: &str) -> Result<()> {
        let removed = {
            let mut map = write(&self.subsystems);
            match map.get(nqn) {
                Some(s) if s.is_discovery() => {
                    return Err(Error::invalid("the discovery subsystem cannot be removed"));
                }
                Some(_) => map.remove(nqn),
                None => None,
            }
        };
        let s = removed.ok_or_else(|| {
            Error::not_found(format!("no subsystem {nqn}: `nvpool engine subsystem list` shows the NQNs"))
        })?;
        for c in s.controllers() {
            c.fail("subsystem removed");
        }
        s.retire_namespaces();
        self.discovery_changed();
        Ok(())
    }

    /// Registers a new controller for a Connect on an admin queue.
    pub fn register_controller(&self, make: impl FnOnce(u16) -> Arc<Controller>) -> Option<Arc<Controller>> {
        let mut map = lock(&self.controllers);
        // IDs come from this engine's range; skip IDs still in use after wrapping.
        let (min, max) = self.cntlid_range();
        let span = u32::from(max - min) + 1;
        for _ in 0..span {
            let n = self.next_cntlid.fetch_add(1, Ordering::Relaxed);
            let id = min + (u32::from(n) % span) as u16;
            if let std::collections::btree_map::Entry::Vacant(v) = map.entry(id) {
                let c = make(id);
                v.insert(c.clone());
                return Some(c);
            }
        }
        None
    }

    /// Registers a controller another engine process handed over, under its own ID.
    pub fn adopt_controller(&self, c: Arc<Controller>) {
        lock(&self.controllers).insert(c.cntlid, c);
    }

    /// Where handing out controller IDs goes on.
    pub fn cntlid_cursor(&self) -> u16 {
        self.next_cntlid.load(Ordering::Relaxed)
    }

    /// Goes on handing out controller IDs where another engine process stopped, with
    /// its discovery log generation.
    pub fn continue_from(&self, cntlid_cursor: u16, discovery_generation: u64) {
        self.next_cntlid.store(cntlid_cursor, Ordering::Relaxed);
        self.discovery_generation.store(discovery_generation, Ordering::Release);
    }

    /// The controller IDs new controllers get.
    pub fn cntlid_range(&self) -> (u16, u16) {
        let range = self.cntlid_range.load(Ordering::Relaxed);
        ((range >> 16) as u16, range as u16)
    }

    /// Changes the controller IDs new controllers get; live controllers keep theirs.
    pub fn set_cntlid_range(&self, min: u16, max: u16) -> Result<()> {
        crate::config::check_cntlid_range(min, max).map_err(Error::invalid)?;
        // Under the controllers' lock, so no registration mixes the two ranges.
        let _controllers = lock(&self.controllers);
        self.cntlid_range.store(u32::from(min) << 16 | u32::from(max), Ordering::Relaxed);
        Ok(())
    }

    /// The live controller with this ID.
    pub fn controller(&self, cntlid: u16) -> Option<Arc<Controller>> {
        lock(&self.controllers).get(&cntlid).cloned()
    }

    /// Forgets a controller whose association ended.
    pub fn unregister_controller(&self, cntlid: u16) {
        lock(&self.controllers).remove(&cntlid);
    }

    /// Every registered controller.
    pub fn controllers(&self) -> Vec<Arc<Controller>> {
        lock(&self.controllers).values().cloned().collect()
    }

    /// Number of live controllers.
    pub fn controller_count(&self) -> usize {
        lock(&self.controllers).len()
    }

    /// Counts a TCP connection the reactors took on.
    pub fn connection_opened(&self) {
        self.connections.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a connection whose resources were all released.
    pub fn connection_closed(&self) {
        self.connections.fetch_sub(1, Ordering::Relaxed);
    }

    /// Connections open now, in any state.
    pub fn connection_count(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Records a listener for the discovery log.
    pub fn add_listener_info(&self, l: ListenerInfo) {
        write(&self.listeners).push(l);
        self.discovery_changed();
    }

    /// Forgets a listener.
    pub fn remove_listener_info(&self, port_id: u16) {
        write(&self.listeners).retain(|l| l.port_id != port_id);
        self.discovery_changed();
    }

    /// The listeners.
    pub fn listeners(&self) -> Vec<ListenerInfo> {
        read(&self.listeners).clone()
    }

    /// Whether listener `port_id` takes TLS (off for one that is gone).
    pub fn listener_tls(&self, port_id: u16) -> crate::tls::TlsMode {
        read(&self.listeners).iter().find(|l| l.port_id == port_id).map(|l| l.tls).unwrap_or_default()
    }

    /// The TLS PSK for a PSK identity a host offers: the one configured for that host
    /// on that subsystem, derived for the identity.
    pub fn tls_psk(&self, identity: &nvpool_auth::Identity) -> Option<Vec<u8>> {
        let subsystem = self.subsystem(&identity.subsystem_nqn)?;
        subsystem.host_psk(&identity.host_nqn)?.tls_psk(identity)
    }

    /// The IP address the discovery log gives for the listeners, if set.
    pub fn discovery_address(&self) -> Option<IpAddr> {
        *read(&self.discovery_address)
    }

    /// Sets the IP address hosts reach this engine at (none: the listeners' own).
    pub fn set_discovery_address(&self, address: Option<IpAddr>) {
        let before = std::mem::replace(&mut *write(&self.discovery_address), address);
        if before != address {
            self.discovery_changed();
        }
    }

    /// The discovery log generation counter.
    pub fn discovery_generation(&self) -> u64 {
        self.discovery_generation.load(Ordering::Acquire)
    }

    /// Bumps the discovery generation and tells discovery controllers.
    pub fn discovery_changed(&self) {
        self.discovery_generation.fetch_add(1, Ordering::AcqRel);
        if let Some(d) = self.subsystem(nvpool_wire::fabrics::DISCOVERY_NQN) {
            for c in d.controllers() {
                c.post_discovery_change();
            }
        }
    }
}

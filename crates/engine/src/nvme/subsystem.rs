//! NVM subsystems and their namespaces.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};

use nvpool_wire::Status;
use nvpool_wire::fabrics::{DISCOVERY_NQN, validate_nqn};

use nvpool_api::{AnaGroupInfo, AnaState, PathAddress};

use super::ana::{self, AnaImage, AnaTable};
use super::auth::HostKeys;
use super::stats::NamespaceStats;
use super::{Controller, MAX_NSID};
use crate::backend::{Backend, Handover};
use crate::error::{Error, Result};
use crate::io::{BlockIo, DiskQueue};
use crate::nvme::reservation::{NamespaceReservations, ReservationsImage};
use crate::qos::Qos;
use crate::sync::{lock, read, write};
use crate::tls::HostPsk;
use serde::{Deserialize, Serialize};

/// A namespace: a backend exported under an NSID with stable identifiers.
#[derive(Debug)]
pub struct Namespace {
    /// Namespace ID.
    pub nsid: u32,
    /// The storage.
    pub backend: Arc<dyn Backend>,
    /// log2 of the block size (9 or 12).
    pub block_shift: u32,
    /// Size in blocks.
    pub blocks: u64,
    /// Namespace globally unique identifier.
    pub nguid: [u8; 16],
    /// Namespace UUID.
    pub uuid: [u8; 16],
    /// ANA group (1 to `ana::MAX_ANA_GROUP`); the NSID unless configured.
    pub ana_group: u32,
    /// I/O counters, kept when the backend is swapped.
    pub stats: Arc<NamespaceStats>,
    /// I/O limits, kept when the backend is swapped.
    pub qos: Arc<Qos>,
    /// Registrations and the reservation, kept when the backend is swapped.
    pub reservations: Arc<NamespaceReservations>,
}

impl Namespace {
    /// Starts a command of this namespace: its backend takes it, unless the
    /// namespace's I/O limits hold it back; then it waits on the reactor (deferred)
    /// until its budget lets it through, and [`Namespace::resume`] starts it.
    pub fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        if self.qos.limited() && !queue.admit(&self.qos, io) {
            self.stats.throttled(queue.reactor_id());
            return;
        }
        self.backend.start(io, queue);
    }

    /// Continues a deferred command with the answer `status`: a command that waited for
    /// its budget starts now; one the backend handed away goes back to it.
    pub fn resume(&self, io: &mut BlockIo, status: Status, queue: &mut DiskQueue<'_>) {
        if io.take_throttled() {
            self.backend.start(io, queue);
        } else {
            self.backend.resume(io, status, queue);
        }
    }

    /// A namespace over `backend` with `block_size`-byte blocks (512 or 4096).
    pub fn new(
        nsid: u32,
        backend: Arc<dyn Backend>,
        block_size: u32,
        uuid: [u8; 16],
        nguid: [u8; 16],
    ) -> Result<Namespace> {
        if nsid == 0 || nsid > MAX_NSID {
            return Err(Error::invalid(format!("namespace ID {nsid} is out of range: use 1 to {MAX_NSID}")));
        }
        if block_size != 512 && block_size != 4096 {
            return Err(Error::invalid(format!("block size {block_size} is not supported: use 512 or 4096")));
        }
        let blocks = backend.size() / u64::from(block_size);
        if blocks == 0 {
            return Err(Error::invalid(format!(
                "the backend ({} bytes) is smaller than one {block_size}-byte block",
                backend.size()
            )));
        }
        Ok(Namespace {
            nsid,
            backend,
            block_shift: block_size.trailing_zeros(),
            blocks,
            nguid,
            uuid,
            ana_group: nsid,
            stats: Arc::default(),
            qos: Arc::default(),
            reservations: Arc::default(),
        })
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u32 {
        1 << self.block_shift
    }

    /// Whether the namespace keeps reservations: where it forwards to the owner of
    /// the data, reservations are the owner's, and this engine cannot tell its
    /// hosts apart there, so it offers none.
    pub fn serves_reservations(&self) -> bool {
        !self.backend.forwards()
    }
}

/// The namespaces of a subsystem, by NSID. Replaced as a whole when it changes, so I/O
/// queues can hold a snapshot without locking.
pub type NamespaceMap = BTreeMap<u32, Arc<Namespace>>;

/// Which hosts may connect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostPolicy {
    /// Any host may connect.
    pub allow_any: bool,
    /// Host NQNs allowed when `allow_any` is false.
    pub hosts: BTreeSet<String>,
    /// Hosts that must authenticate (DH-HMAC-CHAP), whether or not any host may connect.
    pub keys: BTreeMap<String, Arc<HostKeys>>,
    /// Hosts' pre-shared keys for NVMe/TCP over TLS.
    pub psks: BTreeMap<String, Arc<HostPsk>>,
    /// The access points hosts are to use, which their discovery log lists in place
    /// of this engine's listeners.
    pub paths: BTreeMap<String, Vec<PathAddress>>,
}

/// An NVM subsystem (or the discovery subsystem).
pub struct Subsystem {
    /// Subsystem NQN.
    pub nqn: String,
    /// Serial number reported in Identify Controller.
    pub serial: String,
    /// Model number reported in Identify Controller.
    pub model: String,
    hosts: RwLock<HostPolicy>,
    namespaces: RwLock<Arc<NamespaceMap>>,
    generation: AtomicU64,
    /// Taken before `controllers` where both are: a controller joins with the view
    /// of the moment, and every later change reaches it.
    ana: Mutex<AnaTable>,
    controllers: Mutex<Vec<Weak<Controller>>>,
}

impl std::fmt::Debug for Subsystem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subsystem").field("nqn", &self.nqn).finish_non_exhaustive()
    }
}

impl Subsystem {
    /// A new NVM subsystem with no namespaces.
    pub fn new(nqn: &str, serial: &str, model: &str, hosts: HostPolicy) -> Result<Arc<Subsystem>> {
        validate_nqn(nqn).map_err(Error::invalid)?;
        if nqn == DISCOVERY_NQN {
            return Err(Error::invalid("the discovery NQN is reserved: pick another subsystem NQN"));
        }
        if serial.is_empty() || serial.len() > 20 || !serial.is_ascii() {
            return Err(Error::invalid(format!("serial {serial:?} must be 1 to 20 ASCII characters")));
        }
        if model.len() > 40 || !model.is_ascii() {
            return Err(Error::invalid(format!("model {model:?} must be at most 40 ASCII characters")));
        }
        Ok(Arc::new(Subsystem::build(nqn, serial, model, hosts)))
    }

    fn build(nqn: &str, serial: &str, model: &str, hosts: HostPolicy) -> Subsystem {
        Subsystem {
            nqn: nqn.into(),
            serial: serial.into(),
            model: model.into(),
            hosts: RwLock::new(hosts),
            namespaces: RwLock::new(Arc::new(BTreeMap::new())),
            generation: AtomicU64::new(0),
            ana: Mutex::new(AnaTable::default()),
            controllers: Mutex::new(Vec::new()),
        }
    }

    /// The discovery subsystem: any host may use it.
    pub fn discovery() -> Arc<Subsystem> {
        Arc::new(Subsystem::build(
            DISCOVERY_NQN,
            "nvpool-discovery",
            "nvpool discovery",
            HostPolicy { allow_any: true, ..HostPolicy::default() },
        ))
    }

    /// Whether this is the discovery subsystem.
    pub fn is_discovery(&self) -> bool {
        self.nqn == DISCOVERY_NQN
    }

    /// Whether `hostnqn` may connect.
    pub fn host_allowed(&self, hostnqn: &str) -> bool {
        let p = read(&self.hosts);
        p.allow_any || p.hosts.contains(hostnqn)
    }

    /// The host policy.
    pub fn host_policy(&self) -> HostPolicy {
        read(&self.hosts).clone()
    }

    /// The DH-HMAC-CHAP secrets `hostnqn` must authenticate with, if any.
    pub fn host_keys(&self, hostnqn: &str) -> Option<Arc<HostKeys>> {
        read(&self.hosts).keys.get(hostnqn).cloned()
    }

    /// The TLS pre-shared key of `hostnqn`, if it has one.
    pub fn host_psk(&self, hostnqn: &str) -> Option<Arc<HostPsk>> {
        read(&self.hosts).psks.get(hostnqn).cloned()
    }

    /// Gives an allowed host a TLS pre-shared key (replacing any it had: its next
    /// handshake uses it).
    pub fn set_host_psk(&self, hostnqn: &str, psk: HostPsk) -> Result<()> {
        validate_nqn(hostnqn).map_err(Error::invalid)?;
        let mut p = write(&self.hosts);
        p.hosts.insert(hostnqn.into());
        p.psks.insert(hostnqn.into(), Arc::new(psk));
        Ok(())
    }

    /// Allows a host, with the secrets it must authenticate with if `keys` (replacing
    /// any it had: its queues use them from their next authentication). Existing
    /// connections are unaffected.
    pub fn add_host(&self, hostnqn: &str, keys: Option<HostKeys>) -> Result<()> {
        validate_nqn(hostnqn).map_err(Error::invalid)?;
        let mut p = write(&self.hosts);
        p.hosts.insert(hostnqn.into());
        if let Some(k) = keys {
            p.keys.insert(hostnqn.into(), Arc::new(k));
        }
        Ok(())
    }

    /// The access points `hostnqn` is to use, if it was given its own.
    pub fn host_paths(&self, hostnqn: &str) -> Option<Vec<PathAddress>> {
        read(&self.hosts).paths.get(hostnqn).cloned()
    }

    /// Gives a host its access points (none: this engine's listeners); returns whether
    /// they changed.
    pub fn set_host_paths(&self, hostnqn: &str, paths: Vec<PathAddress>) -> Result<bool> {
        validate_nqn(hostnqn).map_err(Error::invalid)?;
        let mut p = write(&self.hosts);
        let before = match paths.is_empty() {
            true => p.paths.remove(hostnqn),
            false => p.paths.insert(hostnqn.into(), paths.clone()),
        };
        Ok(before.unwrap_or_default() != paths)
    }

    /// Disallows a host and forgets its secrets and paths; its controllers end.
    pub fn remove_host(&self, hostnqn: &str) -> Result<()> {
        let removed = {
            let mut p = write(&self.hosts);
            let had_keys = p.keys.remove(hostnqn).is_some();
            let had_psk = p.psks.remove(hostnqn).is_some();
            let had_paths = p.paths.remove(hostnqn).is_some();
            p.hosts.remove(hostnqn) || had_keys || had_psk || had_paths
        };
        if !removed {
            return Err(Error::not_found(format!("host {hostnqn} is not on the allow-list of {}", self.nqn)));
        }
        if !self.host_allowed(hostnqn) {
            for c in self.controllers() {
                if c.hostnqn == hostnqn {
                    c.fail("host removed from the allow-list");
                }
            }
        }
        Ok(())
    }

    /// Sets whether any host may connect.
    pub fn set_allow_any(&self, allow: bool) {
        write(&self.hosts).allow_any = allow;
    }

    /// A snapshot of the namespaces.
    pub fn namespaces(&self) -> Arc<NamespaceMap> {
        read(&self.namespaces).clone()
    }

    /// A counter that changes whenever the namespaces change; I/O queues compare it to
    /// decide whether their snapshot is stale.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Changes namespace `nsid` in a copy of the map; when `change` succeeds, the copy
    /// replaces the map (queues see the new generation) and connected controllers are
    /// told (namespace attribute changed).
    fn change_namespace<R>(&self, nsid: u32, change: impl FnOnce(&mut NamespaceMap) -> Result<R>) -> Result<R> {
        let (r, before, after) = {
            let mut guard = write(&self.namespaces);
            let mut map = (**guard).clone();
            let r = change(&mut map)?;
            let after = map.get(&nsid).cloned();
            let before = std::mem::replace(&mut *guard, Arc::new(map)).get(&nsid).cloned();
            self.generation.fetch_add(1, Ordering::AcqRel);
            (r, before, after)
        };
        if let Some(old) = before {
            retire(&old, after.as_deref());
        }
        self.namespace_changed(nsid);
        Ok(r)
    }

    /// Adds a namespace and notifies connected controllers.
    pub fn add_namespace(&self, ns: Namespace) -> Result<()> {
        self.change_namespace(ns.nsid, |map| {
            if map.contains_key(&ns.nsid) {
                return Err(Error::exists(format!(
                    "namespace {} already exists in {}: remove it first",
                    ns.nsid, self.nqn
                )));
            }
            if let Some(other) = map.values().find(|n| n.uuid == ns.uuid || n.nguid == ns.nguid) {
                return Err(Error::exists(format!("namespace {} already uses that UUID or NGUID", other.nsid)));
            }
            map.insert(ns.nsid, Arc::new(ns));
            Ok(())
        })
    }

    /// Replaces namespace `ns.nsid` (a resized volume) and notifies connected
    /// controllers, which re-read its size.
    pub fn replace_namespace(&self, ns: Namespace) -> Result<()> {
        self.change_namespace(ns.nsid, |map| match map.get_mut(&ns.nsid) {
            Some(slot) => {
                *slot = Arc::new(ns);
                Ok(())
            }
            None => Err(Error::not_found(format!("no namespace {} in {}", ns.nsid, self.nqn))),
        })
    }

    /// Serves namespace `nsid` from `backend` from the next command on, keeping
    /// everything a host sees (identity, size, blocks, counters): no event is raised.
    /// Commands already started finish on the old backend.
    pub fn swap_backend(&self, nsid: u32, backend: Arc<dyn Backend>) -> Result<()> {
        let mut guard = write(&self.namespaces);
        let old = guard.get(&nsid).ok_or_else(|| Error::not_found(format!("no namespace {nsid} in {}", self.nqn)))?;
        if backend.size() >> old.block_shift < old.blocks {
            return Err(Error::invalid(format!(
                "{} is smaller than namespace {nsid} of {}",
                backend.description(),
                self.nqn
            )));
        }
        let swapped = Namespace {
            backend,
            stats: old.stats.clone(),
            qos: old.qos.clone(),
            reservations: old.reservations.clone(),
            ..**old
        };
        let mut map = (**guard).clone();
        let swapped = Arc::new(swapped);
        if let Some(old) = map.insert(nsid, swapped.clone()) {
            retire(&old, Some(&swapped));
        }
        *guard = Arc::new(map);
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Tells every namespace's backend that nothing serves it any more (the
    /// subsystem is removed).
    pub fn retire_namespaces(&self) {
        for ns in read(&self.namespaces).values() {
            retire(ns, None);
        }
    }

    /// Removes a namespace and notifies connected controllers.
    pub fn remove_namespace(&self, nsid: u32) -> Result<Arc<Namespace>> {
        self.change_namespace(nsid, |map| {
            map.remove(&nsid).ok_or_else(|| Error::not_found(format!("no namespace {nsid} in {}", self.nqn)))
        })
    }

    fn namespace_changed(&self, nsid: u32) {
        for c in self.controllers() {
            c.post_namespace_change(nsid);
        }
    }

    /// Tracks a new controller of this subsystem, and gives it its host's ANA view.
    pub fn attach_controller(&self, c: &Arc<Controller>) {
        let ana = lock(&self.ana);
        for (group, state) in ana.view(&c.hostnqn) {
            c.set_ana_state(group, state);
        }
        let mut list = lock(&self.controllers);
        list.retain(|w| w.strong_count() > 0);
        list.push(Arc::downgrade(c));
    }

    /// Sets the ANA state of `group` for `host`, or for every host without its own;
    /// each controller whose view changed gets an ANA change event.
    pub fn set_ana_state(&self, host: Option<&str>, group: u32, state: AnaState) -> Result<()> {
        ana::check_group(group).map_err(Error::invalid)?;
        let namespaces = self.namespaces();
        if !namespaces.values().any(|ns| ns.ana_group == group) {
            let mut groups: Vec<u32> = namespaces.values().map(|ns| ns.ana_group).collect();
            groups.sort_unstable();
            groups.dedup();
            let known = if groups.is_empty() {
                "it has no namespaces yet".to_string()
            } else {
                format!("its groups are {groups:?}")
            };
            return Err(Error::not_found(format!(
                "no namespace of {} is in ANA group {group} ({known}); add one with that ana_group first",
                self.nqn
            )));
        }
        if let Some(h) = host {
            validate_nqn(h).map_err(Error::invalid)?;
        }
        let mut ana = lock(&self.ana);
        ana.set(host, group, state);
        for c in self.controllers() {
            if host.is_none_or(|h| h == c.hostnqn) && c.set_ana_state(group, ana.state(&c.hostnqn, group)) {
                c.post_ana_change();
            }
        }
        Ok(())
    }

    /// What a hot upgrade's new process rebuilds this subsystem from: its identity,
    /// hosts and their secrets, namespaces (by backend spec, or the memfd that comes
    /// with the image) and ANA table.
    pub fn image(&self) -> SubsystemImage {
        let policy = self.host_policy();
        let namespaces = self
            .namespaces()
            .values()
            .map(|ns| NamespaceImage {
                nsid: ns.nsid,
                backend: match ns.backend.handover() {
                    Handover::Spec(spec) => BackendImage::Spec(spec),
                    Handover::Memfd { .. } => BackendImage::Memory,
                },
                block_size: ns.block_size(),
                uuid: ns.uuid,
                nguid: ns.nguid,
                ana_group: ns.ana_group,
                qos: ns.qos.limits(),
                reservations: ns.reservations.image(),
            })
            .collect();
        SubsystemImage {
            nqn: self.nqn.clone(),
            serial: self.serial.clone(),
            model: self.model.clone(),
            allow_any_host: policy.allow_any,
            hosts: policy.hosts.into_iter().collect(),
            dhchap: policy
                .keys
                .iter()
                .map(|(host, k)| nvpool_api::HostDhchap { host: host.clone(), keys: k.to_config() })
                .collect(),
            tls_psk: policy
                .psks
                .iter()
                .map(|(host, p)| nvpool_api::HostTlsPsk { host: host.clone(), psk: p.to_config() })
                .collect(),
            namespaces,
            ana: self.ana_image(),
            host_paths: policy
                .paths
                .iter()
                .map(|(host, paths)| nvpool_api::HostPaths { host: host.clone(), paths: paths.clone() })
                .collect(),
        }
    }

    /// The ANA table, for a new engine process.
    pub fn ana_image(&self) -> AnaImage {
        lock(&self.ana).image()
    }

    /// Takes the ANA table another engine process left (before any controller joins).
    pub fn restore_ana(&self, i: &AnaImage) {
        *lock(&self.ana) = AnaTable::restore(i);
    }

    /// Tracks a controller handed over by another engine process; it keeps the ANA view
    /// it had.
    pub fn adopt_controller(&self, c: &Arc<Controller>) {
        let mut list = lock(&self.controllers);
        list.push(Arc::downgrade(c));
    }

    /// The ANA groups and their states, for management.
    pub fn ana_groups(&self) -> Vec<AnaGroupInfo> {
        lock(&self.ana).describe(&self.namespaces())
    }

    /// The ANA log page for `ctrl`.
    pub fn ana_log_page(&self, ctrl: &Controller, groups_only: bool) -> Vec<u8> {
        let change_count = lock(&self.ana).change_count();
        ana::log_page(&self.namespaces(), |g| ctrl.ana_state(g), change_count, groups_only)
    }

    /// The live controllers.
    pub fn controllers(&self) -> Vec<Arc<Controller>> {
        lock(&self.controllers).iter().filter_map(Weak::upgrade).filter(|c| !c.is_dead()).collect()
    }
}

/// A subsystem with its namespaces, hosts and ANA states.
#[derive(Debug, Serialize, Deserialize)]
pub struct SubsystemImage {
    /// NQN.
    pub nqn: String,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Whether any host may connect.
    pub allow_any_host: bool,
    /// Allowed hosts.
    pub hosts: Vec<String>,
    /// Hosts that must authenticate, with their secrets (the image travels over a
    /// socket pair between the two processes only).
    #[serde(default)]
    pub dhchap: Vec<nvpool_api::HostDhchap>,
    /// Hosts' TLS pre-shared keys.
    #[serde(default)]
    pub tls_psk: Vec<nvpool_api::HostTlsPsk>,
    /// Namespaces.
    pub namespaces: Vec<NamespaceImage>,
    /// ANA states.
    pub ana: AnaImage,
    /// Hosts' access points, for their discovery log.
    #[serde(default)]
    pub host_paths: Vec<nvpool_api::HostPaths>,
}

/// A namespace.
#[derive(Debug, Serialize, Deserialize)]
pub struct NamespaceImage {
    /// NSID.
    pub nsid: u32,
    /// How its backend opens again.
    pub backend: BackendImage,
    /// Block size.
    pub block_size: u32,
    /// UUID.
    pub uuid: [u8; 16],
    /// NGUID.
    pub nguid: [u8; 16],
    /// ANA group.
    pub ana_group: u32,
    /// I/O limits (none from an engine that had none).
    #[serde(default)]
    pub qos: nvpool_api::QosLimits,
    /// Registrations and the reservation (none from an engine that had none).
    #[serde(default)]
    pub reservations: ReservationsImage,
}

/// How a backend opens in the new process.
#[derive(Debug, Serialize, Deserialize)]
pub enum BackendImage {
    /// From its spec, as management adds one (files, volumes, remote namespaces).
    Spec(String),
    /// RAM: the memfd sent and mapped before the pause, so the data stays.
    Memory,
}

/// Tells `old`'s backend that `next` serves its namespace from now on (unless it is
/// the same backend, as when a namespace only grew).
fn retire(old: &Namespace, next: Option<&Namespace>) {
    match next {
        Some(n) if Arc::ptr_eq(&n.backend, &old.backend) => {}
        Some(n) => old.backend.retired(Some(&*n.backend)),
        None => old.backend.retired(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(nsid: u32, id: u8) -> Namespace {
        Namespace::new(nsid, Arc::new(crate::backend::null::Null::new(1 << 20)), 512, [id; 16], [id; 16]).unwrap()
    }

    #[test]
    fn namespaces_are_snapshotted_and_versioned() {
        let s = Subsystem::new("nqn.2024-01.io.nvpool:t", "SN1", "m", HostPolicy::default()).unwrap();
        let before = s.namespaces();
        let g = s.generation();
        s.add_namespace(ns(1, 1)).unwrap();
        assert!(before.is_empty());
        assert_eq!(s.namespaces().len(), 1);
        assert_ne!(s.generation(), g);
        assert!(s.add_namespace(ns(1, 2)).is_err());
        assert!(s.add_namespace(ns(2, 1)).is_err(), "duplicate UUID must be refused");
        s.remove_namespace(1).unwrap();
        assert!(s.remove_namespace(1).is_err());
    }

    #[test]
    fn host_policy_is_enforced() {
        let s = Subsystem::new("nqn.2024-01.io.nvpool:t", "SN1", "m", HostPolicy::default()).unwrap();
        assert!(!s.host_allowed("nqn.h1"));
        s.add_host("nqn.h1", None).unwrap();
        assert!(s.host_allowed("nqn.h1"));
        assert!(!s.host_allowed("nqn.h2"));
        s.set_allow_any(true);
        assert!(s.host_allowed("nqn.h2"));
    }

    #[test]
    fn bad_names_are_refused_with_a_reason() {
        assert!(Subsystem::new("bad nqn", "S", "m", HostPolicy::default()).unwrap_err().message.contains("nqn."));
        assert!(Subsystem::new(DISCOVERY_NQN, "S", "m", HostPolicy::default()).is_err());
        assert!(Namespace::new(0, Arc::new(crate::backend::null::Null::new(4096)), 512, [0; 16], [0; 16]).is_err());
        assert!(Namespace::new(1, Arc::new(crate::backend::null::Null::new(4096)), 1024, [0; 16], [0; 16]).is_err());
    }
}

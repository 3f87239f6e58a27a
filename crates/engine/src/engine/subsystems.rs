//! The subsystems, their namespaces and hosts: what the target exports.

use std::sync::Arc;

use nvpool_api::{DhchapKeys, FaultedLeg, NamespaceInfo, SubsystemInfo};

use super::Engine;
use crate::config::{self, NamespaceConfig, SubsystemConfig};
use crate::error::{Error, Result};
use crate::nvme::auth::HostKeys;
use crate::nvme::subsystem::HostPolicy;
use crate::nvme::{self, Namespace, Subsystem};
use crate::tls;

impl Engine {
    /// Creates a subsystem with its hosts and namespaces.
    pub fn add_subsystem(&self, c: &SubsystemConfig) -> Result<()> {
        let _exporting = self.exporting();
        let serial = c.serial.clone().unwrap_or_else(|| config::derived_serial(&c.nqn));
        let policy = HostPolicy { allow_any: c.allow_any_host, ..HostPolicy::default() };
        let s = Subsystem::new(&c.nqn, &serial, &c.model, policy)?;
        for h in &c.hosts {
            s.add_host(h, None)?;
        }
        for d in &c.dhchap {
            let keys = HostKeys::from_config(&d.keys)
                .map_err(|e| Error::invalid(format!("subsystem {} host {}: {}", c.nqn, d.host, e.message)))?;
            s.add_host(&d.host, Some(keys))?;
        }
        for p in &c.tls_psk {
            let psk = tls::HostPsk::from_config(&p.psk)
                .map_err(|e| Error::invalid(format!("subsystem {} host {}: {e}", c.nqn, p.host)))?;
            s.set_host_psk(&p.host, psk)?;
        }
        for n in &c.namespaces {
            add_namespace_to(self, &s, n)?;
        }
        self.target.add_subsystem(s)?;
        self.kick();
        Ok(())
    }

    /// Removes a subsystem; its controllers end.
    pub fn remove_subsystem(&self, nqn: &str) -> Result<()> {
        if let Some(device) = self.local.device_of(nqn, None) {
            return Err(Error::precondition(format!("a namespace of {nqn} backs {device}")));
        }
        self.target.remove_subsystem(nqn)?;
        self.kick();
        Ok(())
    }

    fn subsystem(&self, nqn: &str) -> Result<Arc<Subsystem>> {
        self.target.nvm_subsystem(nqn)
    }

    /// Adds a namespace to a subsystem at runtime; connected hosts get an event.
    /// Returns the NSID.
    pub fn add_namespace(&self, nqn: &str, n: &NamespaceConfig) -> Result<u32> {
        let _exporting = self.exporting();
        let s = self.subsystem(nqn)?;
        let nsid = add_namespace_to(self, &s, n)?;
        self.kick();
        Ok(nsid)
    }

    /// Serves namespace `nsid` of `nqn` from another backend, invisibly to hosts: the
    /// backend must have the namespace's identity (if it has one) and block size, and
    /// at least its size. Refused while the namespace's volume is moving.
    pub fn swap_namespace(&self, nqn: &str, nsid: u32, spec: &str) -> Result<()> {
        let _exporting = self.exporting();
        let (s, ns) = self.target.namespace(nqn, nsid)?;
        if ns.backend.as_volume().is_some_and(|v| v.gate.busy()) {
            return Err(Error::precondition(format!(
                "namespace {nsid} of {nqn} serves a volume that is moving: cancel its migration first"
            )));
        }
        let opened = self.open_backend(spec)?;
        if opened.identity.is_some_and(|id| id != (ns.uuid, ns.nguid)) {
            return Err(Error::precondition(format!(
                "{spec} is another namespace (its UUID or NGUID differ from namespace {nsid}'s): hosts would see \
                 other data under the same identity"
            )));
        }
        if opened.backend.required_block_size().is_some_and(|b| b != ns.block_size()) {
            return Err(Error::invalid(format!(
                "{spec} has {}-byte blocks; namespace {nsid} has {}-byte blocks",
                opened.backend.required_block_size().unwrap_or(0),
                ns.block_size()
            )));
        }
        s.swap_backend(nsid, opened.backend)
    }

    /// Grows volume `pool/name` and every namespace that serves it. A namespace that
    /// mirrors it (a replicated volume's serving engine) opens its mirror again, over
    /// legs whose engines grew their replicas first, and takes the size they have in
    /// common; its hosts are told the namespace changed.
    pub fn resize_volume(&self, pool: &str, name: &str, size: u64) -> Result<nvpool_api::VolumeInfo> {
        let info = self.pools.resize_volume(pool, name, size)?;
        let p = self.pools.get(pool)?;
        let (volume, _) = p.open_volume(name)?;
        for (s, ns) in self.pools.exports(&p, Some(volume.id)) {
            if ns.backend.as_mirror().is_none() {
                continue;
            }
            let served = self.grow_namespace(&s.nqn, ns.nsid)?;
            if served < info.size {
                return Err(Error::precondition(format!(
                    "the replicas of {pool}/{name} hold {served} bytes in common, less than its {} bytes: grow every \
                     replica first",
                    info.size
                )));
            }
        }
        Ok(info)
    }

    /// Serves namespace `nsid` of `nqn` (a `remote:` or `mirror:` one) at the size its
    /// backend has now, if larger: the backend opens again from its spec (another
    /// engine's volume grew), and hosts are told the namespace changed. Returns the
    /// bytes it serves.
    pub fn grow_namespace(&self, nqn: &str, nsid: u32) -> Result<u64> {
        let _exporting = self.exporting();
        let (s, ns) = self.target.namespace(nqn, nsid)?;
        let spec = ns.backend.description();
        if !(spec.starts_with("remote:") || spec.starts_with("mirror:")) {
            return Err(Error::invalid(format!(
                "namespace {nsid} of {nqn} is served by {spec}: only remote: and mirror: namespaces grow this way (a \
                 volume grows with `volume resize`)"
            )));
        }
        if spec.contains(" +") {
            return Err(Error::precondition(format!(
                "namespace {nsid} of {nqn} has a replica catching up: grow it once its rebuild is done"
            )));
        }
        let opened = self.open_backend(&spec)?;
        if opened.identity.is_some_and(|id| id != (ns.uuid, ns.nguid)) {
            return Err(Error::precondition(format!("{spec} is another namespace now: its UUID or NGUID changed")));
        }
        let blocks = opened.backend.size() >> ns.block_shift;
        if blocks <= ns.blocks {
            return Ok(ns.blocks << ns.block_shift);
        }
        s.replace_namespace(Namespace {
            backend: opened.backend,
            blocks,
            stats: ns.stats.clone(),
            qos: ns.qos.clone(),
            reservations: ns.reservations.clone(),
            ..*ns
        })?;
        Ok(blocks << ns.block_shift)
    }

    /// Sets the I/O limits of namespace `nsid` of `nqn`, from its next command on.
    pub fn set_namespace_qos(&self, nqn: &str, nsid: u32, limits: nvpool_api::QosLimits) -> Result<()> {
        let (_, ns) = self.target.namespace(nqn, nsid)?;
        ns.qos.set(limits);
        tracing::info!(nqn, nsid, "I/O limits: {}", limits.describe());
        Ok(())
    }

    /// Removes a namespace; connected hosts get an event. Refused while a local
    /// device serves it.
    pub fn remove_namespace(&self, nqn: &str, nsid: u32) -> Result<()> {
        if let Some(device) = self.local.device_of(nqn, Some(nsid)) {
            return Err(Error::precondition(format!("namespace {nsid} of {nqn} backs {device}")));
        }
        self.subsystem(nqn)?.remove_namespace(nsid)?;
        self.kick();
        Ok(())
    }

    /// Sets the ANA state of a group of a subsystem's namespaces on this engine, for one
    /// host or for every host without its own; controllers whose view changed are told.
    pub fn set_ana_state(&self, nqn: &str, group: u32, host: Option<&str>, state: nvpool_api::AnaState) -> Result<()> {
        self.subsystem(nqn)?.set_ana_state(host, group, state)?;
        // Reactors deliver the events to outstanding Asynchronous Event Requests.
        self.kick();
        Ok(())
    }

    /// A subsystem's ANA groups and their states on this engine.
    pub fn ana_groups(&self, nqn: &str) -> Result<Vec<nvpool_api::AnaGroupInfo>> {
        Ok(self.subsystem(nqn)?.ana_groups())
    }

    /// Allows a host on a subsystem, with the DH-HMAC-CHAP secrets it must
    /// authenticate with if `dhchap`, and its TLS pre-shared key if `tls_psk`.
    pub fn add_host(
        &self,
        nqn: &str,
        host: &str,
        dhchap: Option<&DhchapKeys>,
        tls_psk: Option<&nvpool_api::TlsPsk>,
    ) -> Result<()> {
        let keys = dhchap.map(HostKeys::from_config).transpose()?;
        let psk = tls_psk
            .map(tls::HostPsk::from_config)
            .transpose()
            .map_err(|e| Error::invalid(format!("host {host}: {e}")))?;
        let subsystem = self.subsystem(nqn)?;
        subsystem.add_host(host, keys)?;
        if let Some(psk) = psk {
            subsystem.set_host_psk(host, psk)?;
        }
        self.target.discovery_changed();
        self.kick();
        Ok(())
    }

    /// Disallows a host; its controllers on that subsystem end.
    pub fn remove_host(&self, nqn: &str, host: &str) -> Result<()> {
        self.subsystem(nqn)?.remove_host(host)?;
        self.target.discovery_changed();
        self.kick();
        Ok(())
    }

    /// Gives a host its access points to a subsystem, for its discovery log.
    pub fn set_host_paths(&self, nqn: &str, host: &str, paths: Vec<nvpool_api::PathAddress>) -> Result<()> {
        if self.subsystem(nqn)?.set_host_paths(host, paths)? {
            self.target.discovery_changed();
        }
        Ok(())
    }

    /// Sets whether any host may connect to a subsystem.
    pub fn set_allow_any_host(&self, nqn: &str, allow: bool) -> Result<()> {
        self.subsystem(nqn)?.set_allow_any(allow);
        self.target.discovery_changed();
        self.kick();
        Ok(())
    }

    /// Every NVM subsystem with its namespaces and counters.
    pub fn subsystems(&self) -> Vec<SubsystemInfo> {
        self.target.subsystems().into_iter().filter(|s| !s.is_discovery()).map(|s| subsystem_info(&s)).collect()
    }

    /// The subsystems of these NQNs that exist: what `subsystems` lists of them, without
    /// describing every other one.
    pub fn subsystems_named(&self, nqns: &[String]) -> Vec<SubsystemInfo> {
        let mut nqns: Vec<&String> = nqns.iter().collect();
        nqns.sort();
        nqns.dedup();
        nqns.into_iter()
            .filter_map(|nqn| self.target.subsystem(nqn))
            .filter(|s| !s.is_discovery())
            .map(|s| subsystem_info(&s))
            .collect()
    }
}

fn subsystem_info(s: &Subsystem) -> SubsystemInfo {
    let policy = s.host_policy();
    SubsystemInfo {
        nqn: s.nqn.clone(),
        serial: s.serial.clone(),
        model: s.model.clone(),
        allow_any_host: policy.allow_any,
        hosts: policy.hosts.into_iter().collect(),
        authenticated_hosts: policy.keys.iter().map(|(host, k)| k.info(host)).collect(),
        tls_psk_hosts: policy.psks.keys().cloned().collect(),
        controllers: s.controllers().len(),
        connected_hosts: {
            let mut hosts: Vec<String> = s.controllers().iter().map(|c| c.hostnqn.clone()).collect();
            hosts.sort();
            hosts.dedup();
            hosts
        },
        namespaces: s.namespaces().values().map(|ns| namespace_info(ns)).collect(),
        ana_groups: s.ana_groups(),
        host_paths: policy.paths.into_iter().map(|(host, paths)| nvpool_api::HostPaths { host, paths }).collect(),
    }
}

fn add_namespace_to(engine: &Engine, s: &Subsystem, n: &NamespaceConfig) -> Result<u32> {
    let nsid = match n.nsid {
        Some(id) => id,
        None => (1..=nvme::MAX_NSID)
            .find(|id| !s.namespaces().contains_key(id))
            .ok_or_else(|| Error::precondition("every namespace ID is in use: remove a namespace first"))?,
    };
    let opened = engine.open_backend(&n.backend)?;
    let (uuid, nguid) = match (opened.identity, n.uuid) {
        (Some(_), Some(_)) => {
            return Err(Error::invalid(format!("{} has its own UUID: leave uuid out of the namespace", n.backend)));
        }
        (Some(identity), None) => identity,
        (None, given) => {
            let uuid = given.unwrap_or_else(|| config::derived_uuid(&s.nqn, nsid));
            (*uuid.as_bytes(), config::derived_nguid(&uuid))
        }
    };
    let atomic = opened.backend.power_fail_atomic_bytes();
    let block_size = match opened.backend.required_block_size() {
        Some(required) if n.block_size == 0 || n.block_size == required => required,
        Some(required) => {
            return Err(Error::invalid(format!(
                "{} has {required}-byte blocks, so its namespace must too: use block_size {required} or 0",
                n.backend
            )));
        }
        None => block_size_for(n, atomic)?,
    };
    let mut ns = Namespace::new(nsid, opened.backend, block_size, uuid, nguid)?;
    if let Some(group) = n.ana_group {
        nvme::ana::check_group(group).map_err(Error::invalid)?;
        ns.ana_group = group;
    }
    ns.qos.set(n.qos);
    s.add_namespace(ns)?;
    Ok(nsid)
}

/// The block size a namespace gets: the one asked for, or for 0 the largest the
/// storage writes whole across a power loss. A block larger than that is refused
/// unless allowed: Identify promises a one-block write is never torn (AWUPF 0).
fn block_size_for(n: &NamespaceConfig, atomic: u32) -> Result<u32> {
    match n.block_size {
        0 if atomic >= 4096 => Ok(4096),
        0 => Ok(512),
        bs if bs > atomic && !n.allow_torn_writes => Err(Error::invalid(format!(
            "{} writes only {atomic} bytes whole across a power loss, so a {bs}-byte block could come back \
             part old, part new: use block_size 512 (or 0 to choose), or set allow_torn_writes if the host \
             can live with that",
            n.backend
        ))),
        bs => Ok(bs),
    }
}

fn namespace_info(ns: &Namespace) -> NamespaceInfo {
    NamespaceInfo {
        nsid: ns.nsid,
        kind: ns.backend.kind().into(),
        backend: ns.backend.description(),
        size: ns.blocks << ns.block_shift,
        block_size: ns.block_size(),
        uuid: uuid::Uuid::from_bytes(ns.uuid).to_string(),
        nguid: ns.nguid.iter().map(|b| format!("{b:02x}")).collect(),
        direct_io: ns.backend.direct_io(),
        ana_group: ns.ana_group,
        qos: ns.qos.limits(),
        stats: ns.stats.snapshot(),
        faulted_legs: ns
            .backend
            .as_mirror()
            .map(|m| {
                m.faults().into_iter().map(|(leg, status)| FaultedLeg { leg, error: status.to_string() }).collect()
            })
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn ns(block_size: u32, allow_torn_writes: bool) -> NamespaceConfig {
        NamespaceConfig {
            nsid: None,
            backend: "file:/d".into(),
            block_size,
            uuid: None,
            allow_torn_writes,
            ana_group: None,
            qos: Default::default(),
        }
    }

    #[test]
    fn blocks_are_never_larger_than_the_storage_writes_whole_unless_allowed() {
        // Disks with 4 KiB physical blocks (or RAM) take either size.
        assert_eq!(block_size_for(&ns(4096, false), 4096).unwrap(), 4096);
        assert_eq!(block_size_for(&ns(0, false), 4096).unwrap(), 4096);
        assert_eq!(block_size_for(&ns(0, false), u32::MAX).unwrap(), 4096);
        // 512-byte physical sectors: 512-byte blocks, 4 KiB only when told.
        assert_eq!(block_size_for(&ns(0, false), 512).unwrap(), 512);
        assert_eq!(block_size_for(&ns(512, false), 512).unwrap(), 512);
        let e = block_size_for(&ns(4096, false), 512).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("512 bytes whole") && e.message.contains("allow_torn_writes"), "{e}");
        assert_eq!(block_size_for(&ns(4096, true), 512).unwrap(), 4096);
    }
}

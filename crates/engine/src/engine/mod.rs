//! The engine: the target, its reactors, and the services that own the rest of its
//! state (listeners, pools, local devices, migrations, what a hot upgrade keeps). The
//! management socket ([`crate::mgmt`]) calls these services directly; the methods
//! here are what spans several of them: starting and stopping, the subsystems and
//! their namespaces (whose backends may be pool volumes or other engines), and the
//! hot upgrade (`upgrade.rs`), which composes every owner's saved state.

mod handover;
mod subsystems;
mod usage;

pub use handover::TakenOver;

use std::net::SocketAddr;
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use nvpool_api::{MigrationInfo, RebuildInfo, Transport};

use crate::backend;
use crate::config::EngineConfig;
use crate::copy::TargetQueue;
use crate::cpu;
use crate::error::{Error, ErrorKind, Result};
use crate::listen::Listeners;
use crate::local::LocalDevices;
use crate::migration::Migrations;
use crate::nvme::{self, ListenerInfo, Target};
use crate::pools::Pools;
use crate::reactor::{self, Links};
use crate::rebuild::{self, Rebuilds};
use crate::sync::lock;
use crate::tls;
use crate::upgrade::UpgradeState;

/// A running engine.
pub struct Engine {
    target: Arc<Target>,
    links: Links,
    threads: Mutex<Vec<JoinHandle<()>>>,
    listeners: Listeners,
    /// Its pools and volumes.
    pub pools: Pools,
    /// Block devices of this node served from namespaces (ublk, vhost-user-blk).
    pub local: Arc<LocalDevices>,
    /// Volumes moving to other engines.
    pub migrations: Migrations,
    /// Replicas of mirrored namespaces catching up.
    pub rebuilds: Rebuilds,
    /// Held while a namespace takes a backend and while a migration starts: a volume
    /// exported after its migration took stock of its exports would take writes that
    /// the migration does not track, and lose them at the switch.
    exporting: Mutex<()>,
    /// What a hot upgrade keeps: the binary, the management socket, whether it ran.
    upgrades: UpgradeState,
    /// The host NQN `remote:` namespaces present to their owners.
    host_nqn: String,
    /// Links to owners that `remote:` namespaces share.
    remote_links: backend::remote::RemoteLinks,
    /// The configuration it started with (a hot upgrade hands it on).
    config: Mutex<EngineConfig>,
    /// The last usage answer, which the next one may list only changes against.
    last_usage: Mutex<usage::LastUsage>,
}

impl Engine {
    /// Starts reactors, listeners and everything the configuration describes.
    pub fn start(cfg: &EngineConfig) -> Result<Arc<Engine>> {
        cfg.validate().map_err(Error::invalid)?;
        // What only this machine can check: its CPUs, and the backends' kinds.
        let cores = cpu::reactor_cpus(cfg).map_err(Error::invalid)?;
        for s in &cfg.subsystems {
            for n in &s.namespaces {
                backend::check(&n.backend)
                    .map_err(|e| Error::invalid(format!("subsystem {} namespace.backend: {e}", s.nqn)))?;
            }
        }
        let target = Target::new(cfg.limits.clone());
        nvme::stats::set_reactor_count(cores.len());
        let mut links = Vec::new();
        let mut ends = Vec::new();
        for _ in &cores {
            let (link, rx, wake) = reactor::mailbox().map_err(|e| Error::io("cannot create a reactor mailbox", e))?;
            links.push(link);
            ends.push((rx, wake));
        }
        let links = Arc::new(links);
        let mut threads = Vec::new();
        for (id, (core, (rx, wake))) in cores.iter().zip(ends).enumerate() {
            let busy_poll = std::time::Duration::from_micros(u64::from(cfg.busy_poll_us));
            let t = reactor::spawn(id, *core, busy_poll, target.clone(), links.clone(), rx, wake)
                .map_err(|e| Error::unavailable(format!("cannot start reactor {id} (io_uring setup failed: {e}); is io_uring disabled by the kernel or a seccomp policy?")))?;
            threads.push(t);
        }
        let engine = Arc::new(Engine {
            listeners: Listeners::new(target.clone(), links.clone()),
            pools: Pools::new(target.clone(), links.clone()),
            local: Arc::new(LocalDevices::new(target.clone(), links.clone())),
            migrations: Migrations::default(),
            rebuilds: Rebuilds::default(),
            exporting: Mutex::new(()),
            upgrades: UpgradeState::new(),
            target,
            links,
            threads: Mutex::new(threads),
            host_nqn: cfg.host_nqn.clone().unwrap_or_else(backend::remote::default_host_nqn),
            remote_links: backend::remote::RemoteLinks::new(cfg.remote_queues),
            config: Mutex::new(cfg.clone()),
            last_usage: Mutex::new(usage::LastUsage::new()),
        });
        let setup = || -> Result<()> {
            for p in &cfg.pools {
                engine.pools.import_or_create(&p.disks, p.create.as_deref())?;
            }
            for s in &cfg.subsystems {
                engine.add_subsystem(s)?;
            }
            for l in &cfg.listeners {
                // After a crash the old engine's sockets close only once the kernel has
                // torn down its rings, a moment after the process is gone: a restart
                // waits for the address instead of failing.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                let mut told = false;
                loop {
                    match engine.add_listener(l.address, l.tls, l.transport) {
                        Err(e) if e.kind == ErrorKind::AlreadyExists && std::time::Instant::now() < deadline => {
                            if !std::mem::replace(&mut told, true) {
                                tracing::warn!(
                                    "{} is in use; waiting up to 10 s for it (an engine that just stopped \
                                     releases its port a moment after it exits; another running engine \
                                     keeps it, and this one then gives up)",
                                    l.address
                                );
                            }
                            std::thread::sleep(std::time::Duration::from_millis(50))
                        }
                        // An RDMA listener without the libraries or a device fails alone:
                        // the engine serves its other listeners.
                        Err(e) if l.transport == Transport::Rdma && e.kind == ErrorKind::Unavailable => {
                            tracing::error!("{}; the engine goes on without this listener", e.message);
                            break;
                        }
                        r => break r.map(|_| ())?,
                    }
                }
            }
            for d in &cfg.local {
                engine.local.add(d)?;
            }
            Ok(())
        };
        if let Err(e) = setup() {
            engine.stop();
            return Err(e);
        }
        Ok(engine)
    }

    /// Keeps a copy of the management socket's listener, which a hot upgrade hands on.
    pub fn set_management_listener(&self, l: &UnixListener) {
        self.upgrades.set_management(l);
    }

    /// Held shared by every management call, so none runs during a hot upgrade.
    pub fn management_guard(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.upgrades.shared()
    }

    /// Whether this engine handed over to a new process (and must exit).
    pub fn handed_over(&self) -> bool {
        self.upgrades.handed_over()
    }

    /// The host NQN this engine presents to the owners of its `remote:` namespaces.
    pub fn host_nqn(&self) -> &str {
        &self.host_nqn
    }

    /// Runs `f` with what backends open with here: the pools, the links to other
    /// engines, and this engine's own addresses (which a remote backend may not name).
    fn with_open_env<R>(&self, f: impl FnOnce(&backend::OpenEnv) -> R) -> R {
        let own_listeners = self.listeners().iter().map(|l| SocketAddr::new(l.addr, l.port)).collect();
        let env = backend::OpenEnv {
            pool: &|name| self.pools.get(name),
            own_listeners,
            host_nqn: self.host_nqn(),
            remote_links: &self.remote_links,
            fence: None,
        };
        f(&env)
    }

    /// Opens the backend a namespace spec names (`file:...`, `volume:POOL/NAME`, ...).
    /// A volume that is moving to another engine is not opened: it is served only
    /// through the namespace its migration watches.
    fn open_backend(&self, spec: &str) -> Result<backend::Opened> {
        // A mirror's legs are specs of their own.
        let volumes = spec.trim_start_matches("mirror:").split(' ').filter_map(|leg| {
            leg.strip_prefix("volume:").or(leg.strip_prefix("replica:")).and_then(|v| v.split_once('/'))
        });
        if let Some((pool, name)) = volumes.into_iter().find(|(pool, name)| self.migrations.moving(pool, name)) {
            return Err(Error::precondition(format!(
                "volume {pool}/{name} is moving to another engine: export it once its migration ends, or cancel \
                 the migration"
            )));
        }
        self.with_open_env(|env| backend::open(spec, env))
    }

    /// Serializes exporting volumes with starting migrations (see `exporting`).
    fn exporting(&self) -> std::sync::MutexGuard<'_, ()> {
        lock(&self.exporting)
    }

    /// Starts moving volume `pool/name` to `target` (`HOST:PORT/NQN/NSID`), another
    /// engine's namespace this one opens as a remote backend.
    pub fn start_migration(
        &self,
        pool: &str,
        name: &str,
        id: &str,
        target: &str,
        rate: Option<u64>,
    ) -> Result<MigrationInfo> {
        let _exporting = self.exporting();
        self.with_open_env(|env| self.migrations.start(&self.pools, env, pool, name, id, target, rate))
    }

    /// Brings replica `leg` (`remote:HOST:PORT/NQN/NSID`) into the mirror that serves
    /// namespace `nsid` of `nqn`: the mirror takes it as a leg that catches up, and a
    /// thread copies to it the clusters written at generation `since` or later (every
    /// cluster when none), at `rate` bytes per second at most.
    pub fn start_rebuild(
        &self,
        nqn: &str,
        nsid: u32,
        leg: &str,
        since: Option<u64>,
        rate: Option<u64>,
    ) -> Result<RebuildInfo> {
        if self.rebuilds.rebuilding(nqn, nsid) {
            return Err(Error::exists(format!(
                "namespace {nsid} of {nqn} is being rebuilt already: `replica_rebuild_status` shows how far"
            )));
        }
        let (_, ns) = self.target.namespace(nqn, nsid)?;
        if ns.backend.as_mirror().is_none() {
            return Err(Error::precondition(format!(
                "namespace {nsid} of {nqn} is served by {}, not a mirror: serve it as mirror:... first",
                ns.backend.description()
            )));
        }
        let (addr, replica_nqn, replica_nsid) = leg
            .strip_prefix("remote:")
            .ok_or_else(|| format!("{leg:?} is not a remote:HOST:PORT/NQN/NSID leg"))
            .and_then(backend::remote::parse)
            .map_err(|e| Error::invalid(format!("replica {leg:?}: {e}")))?;
        let current = ns.backend.description();
        if current.split(' ').any(|l| l.trim_start_matches('+') == leg) {
            return Err(Error::precondition(format!("{leg} is a leg of namespace {nsid} of {nqn} already")));
        }
        let previous = Some(ns.backend.clone());
        self.swap_namespace(nqn, nsid, &format!("{current} +{leg}"))?;
        let (_, ns) = self.target.namespace(nqn, nsid)?;
        let mut target =
            TargetQueue::connect(backend::remote::resolve(&addr)?, &replica_nqn, replica_nsid, &self.host_nqn)
                .map_err(|e| Error::unavailable(format!("cannot reach the replica {leg}: {e}")))?;
        // The copy writes under the mirror's generation itself, whether or not the
        // mirror's own link to the replica has taken it yet (a replica whose engine
        // restarted remembers its generation and refuses writers without one).
        if let Some(generation) = ns.backend.as_mirror().and_then(|m| m.generation()) {
            target.take_fence(generation, &self.host_nqn).map_err(|e| {
                Error::unavailable(format!("cannot take the replica {leg} at generation {generation}: {e}"))
            })?;
        }
        let copy = rebuild::Copy { mirror: ns.backend.clone(), previous, leg: leg.to_string(), target, since, rate };
        let info = self.rebuilds.start(nqn, nsid, copy)?;
        tracing::info!(nqn, nsid, leg, ?since, "rebuild started");
        Ok(info)
    }

    /// The target state.
    pub fn target(&self) -> &Arc<Target> {
        &self.target
    }

    fn kick(&self) {
        for l in self.links.iter() {
            l.run(|r| r.kick());
        }
    }

    /// Binds and serves a listener; returns it with the port the system chose for 0.
    pub fn add_listener(&self, addr: SocketAddr, tls: tls::TlsMode, transport: Transport) -> Result<ListenerInfo> {
        let info = self.listeners.add(addr, tls, transport)?;
        self.kick();
        Ok(info)
    }

    /// Stops a listener and ends the connections it accepted; their hosts go over to
    /// their other paths.
    pub fn remove_listener(&self, addr: SocketAddr, transport: Transport) -> Result<()> {
        self.listeners.remove(addr, transport)?;
        self.kick();
        Ok(())
    }

    /// The listeners.
    pub fn listeners(&self) -> Vec<ListenerInfo> {
        self.target.listeners()
    }

    /// Where each reactor's time went so far, by reactor.
    pub fn reactor_times(&self) -> Vec<reactor::ReactorTime> {
        self.links.iter().map(|l| l.time()).collect()
    }

    /// Stops every reactor and waits for them; connections are closed.
    pub fn stop(&self) {
        self.migrations.stop_all();
        self.rebuilds.stop_all();
        // A new process that took over keeps the local devices; otherwise they go, so
        // none is left waiting for an engine that will not come.
        if !self.handed_over() {
            self.local.remove_all();
        }
        // The connection manager's thread stops first (it hands connections to
        // reactors); its event channel goes last, after the reactors destroyed the
        // connections made on it.
        let rdma = self.listeners.stop_rdma();
        for l in self.links.iter() {
            l.run(|r| r.stop());
        }
        for t in lock(&self.threads).drain(..) {
            let _ = t.join();
        }
        drop(rdma);
        self.pools.close_all(!self.handed_over());
    }
}

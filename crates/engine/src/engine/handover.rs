//! The hot upgrade's steps, run with the engine's services (the steps and the
//! formats are described in [`crate::upgrade`]).

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::Instant;

use nvpool_api::UpgradeReport;

use super::Engine;
use crate::backend::Handover;
use crate::backend::memory::Memory;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::nvme::auth::HostKeys;
use crate::nvme::subsystem::{BackendImage, HostPolicy, SubsystemImage};
use crate::nvme::{Controller, Namespace, Subsystem};
use crate::reactor::Parked;
use crate::sync::lock;
use crate::upgrade::channel::Channel;
use crate::upgrade::image::{Answer, EngineImage, FORMAT, Hello, ListenerImage, MemoryImage, Order, READS};
use crate::upgrade::{
    FAULT_ENV, FdList, PARK_TIMEOUT, READY_TIMEOUT, SERVING_TIMEOUT, abandon, process, start_new_engine, unexpected,
};

/// What a new engine process took over: the engine and its management socket.
pub struct TakenOver {
    /// The engine, serving.
    pub engine: Arc<Engine>,
    /// Its configuration (the lists of listeners, pools and subsystems empty: they
    /// were the old engine's start, and are its state now).
    pub config: EngineConfig,
    /// The management socket, listening.
    pub management: UnixListener,
}

impl Engine {
    /// Hands this engine over to a new process running `binary` (the engine's own
    /// executable if `None`). On success the caller answers its client and exits the
    /// process; on failure this engine goes on serving, and the error says why.
    pub fn upgrade(&self, binary: Option<&Path>) -> Result<UpgradeReport> {
        let _exclusive = self.upgrades.exclusive();
        if self.upgrades.handed_over() {
            return Err(Error::precondition("this engine already handed over to a new process"));
        }
        if let Some(volume) = self.migrations.running() {
            return Err(Error::precondition(format!(
                "volume {volume} is moving to another engine: upgrade once its migration ends, or cancel it"
            )));
        }
        if let Some(namespace) = self.rebuilds.running() {
            return Err(Error::precondition(format!(
                "a replica of namespace {namespace} is being rebuilt: upgrade once the rebuild ends"
            )));
        }
        if let Some(address) = self.listeners.rdma_listener() {
            return Err(Error::precondition(format!(
                "the engine listens for NVMe over RDMA on {address}, and RDMA queue pairs cannot be handed to another \
                 process: remove the RDMA listeners (their hosts go over to their other paths), upgrade, then add \
                 them again"
            )));
        }
        let binary = binary.map(Path::to_path_buf).unwrap_or_else(|| self.upgrades.executable());
        let called = Instant::now();
        let (channel, mut child) = start_new_engine(&binary)?;
        let hello = match channel.recv::<Hello>() {
            Ok((h, _)) => h,
            Err(e) => return Err(abandon(&channel, &mut child, &binary, &format!("it did not say hello ({e})"))),
        };
        if !hello.reads.contains(&FORMAT) {
            let why = format!(
                "it (version {}) reads state formats {:?} and this engine writes format {FORMAT}: upgrade through a \
                 version that reads both",
                hello.version, hello.reads
            );
            return Err(abandon(&channel, &mut child, &binary, &why));
        }
        let prepared = self.prepare(&channel).and_then(|()| match channel.recv::<Answer>() {
            Ok((Answer::Prepared, _)) => Ok(()),
            Ok((Answer::Failed(why), _)) => Err(format!("it could not start its reactors: {why}")),
            Ok((other, _)) => Err(format!("it answered {other:?} to the configuration")),
            Err(e) => Err(format!("it did not start its reactors ({e})")),
        });
        if let Err(why) = prepared {
            return Err(abandon(&channel, &mut child, &binary, &why));
        }

        // From here until Go, no command is read.
        let paused = Instant::now();
        let start = paused - called;
        let parked = match self.park_all() {
            Ok(p) => p,
            Err(e) => {
                self.resume_all();
                return Err(abandon(&channel, &mut child, &binary, &e));
            }
        };
        let park = paused.elapsed();
        let handed = self.hand_over(&channel, parked);
        let transfer = paused.elapsed() - park;
        let ready = handed.and_then(|counts| {
            channel.set_timeout(Some(READY_TIMEOUT)).map_err(|e| e.to_string())?;
            match channel.recv::<Answer>() {
                Ok((Answer::Ready, _)) => Ok(counts),
                Ok((Answer::Failed(why), _)) => Err(format!("it could not take over: {why}")),
                Ok((other, _)) => Err(format!("it answered {other:?} to the state")),
                Err(e) => Err(format!("it did not confirm the takeover ({e})")),
            }
        });
        let (connections, controllers) = match ready.and_then(|c| {
            channel.send(&Order::Go, &[]).map_err(|e| format!("it went away before it was told to go on ({e})"))?;
            Ok(c)
        }) {
            Ok(c) => c,
            Err(why) => {
                let e = abandon(&channel, &mut child, &binary, &why);
                self.pools.take_back_all();
                self.resume_all();
                return Err(e);
            }
        };
        let pause = paused.elapsed();
        self.upgrades.set_handed_over();
        // The new process serves now. It names itself the service's main process
        // before it says so; this one exits only then, so a service manager never
        // sees the main process gone. Past Go nothing is taken back: a new process
        // that does not answer is waited for a moment only.
        let _ = channel.set_timeout(Some(SERVING_TIMEOUT));
        if !matches!(channel.recv::<Answer>(), Ok((Answer::Serving, _))) {
            tracing::warn!(new_pid = hello.pid, "the new engine did not confirm that it serves");
        }
        tracing::info!(
            new_pid = hello.pid,
            version = %hello.version,
            connections,
            pause_us = pause.as_micros() as u64,
            "handed over to the new engine; exiting"
        );
        Ok(UpgradeReport {
            old_pid: std::process::id(),
            old_version: crate::version::version().to_string(),
            new_pid: hello.pid,
            new_version: hello.version,
            connections,
            controllers,
            start_us: start.as_micros() as u64,
            pause_us: pause.as_micros() as u64,
            park_us: park.as_micros() as u64,
            transfer_us: transfer.as_micros() as u64,
            rebuild_us: (pause - park - transfer).as_micros() as u64,
        })
    }

    /// Parks reactor 0 first (it accepts, and hands accepted connections to the
    /// others), then the rest.
    fn park_all(&self) -> std::result::Result<Vec<Parked>, String> {
        let deadline = Instant::now() + PARK_TIMEOUT;
        let (tx, rx) = mpsc::channel();
        let wait = |rx: &mpsc::Receiver<std::result::Result<Parked, String>>| {
            rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).map_err(|_| {
                format!(
                    "the connections did not finish their commands within {PARK_TIMEOUT:?} (a host that does not \
                     send the data it was asked for, or a backend that does not answer)"
                )
            })?
        };
        let park = |link: &crate::reactor::ReactorLink| {
            let tx = tx.clone();
            link.run(move |r| r.park(tx));
        };
        park(&self.links[0]);
        let mut parked = vec![wait(&rx)?];
        for l in &self.links[1..] {
            park(l);
        }
        for _ in 1..self.links.len() {
            parked.push(wait(&rx)?);
        }
        Ok(parked)
    }

    fn resume_all(&self) {
        for l in self.links.iter() {
            l.run(|r| r.resume());
        }
    }

    /// Checkpoints the pools and sends the image and its descriptors. Returns the
    /// connections and controllers handed over.
    fn hand_over(&self, channel: &Channel, parked: Vec<Parked>) -> std::result::Result<(usize, usize), String> {
        self.pools.checkpoint_all().map_err(|e| format!("the pools could not be checkpointed: {e}"))?;
        let mut fds = FdList::default();
        let image = self.image(parked, &mut fds)?;
        let counts = (image.connections.len(), image.controllers.len());
        let raw = fds.raw();
        let sent = channel
            .send(&Order::Image { descriptors: raw.len() }, &[])
            .and_then(|()| channel.send(&image, &[]))
            .and_then(|()| channel.send_fds(&raw));
        sent.map_err(|e| format!("the state could not be sent ({e})"))?;
        Ok(counts)
    }

    fn image(&self, parked: Vec<Parked>, fds: &mut FdList) -> std::result::Result<EngineImage, String> {
        let copy = |what: &str, e: std::io::Error| format!("cannot copy the {what} descriptor: {e}");
        let management = self.upgrades.management()?;
        let management_fd = fds.push(management);
        let pools = self.pools.disk_paths();
        let generation_records = self.pools.generation_records();
        let mut listeners = Vec::new();
        for (port_id, address, socket) in self.listeners.tcp_sockets().map_err(|e| copy("listener", e))? {
            let tls = self.target.listener_tls(port_id);
            listeners.push(ListenerImage { port_id, address, tls, fd: fds.push(socket) });
        }
        let mut connections = Vec::new();
        for p in parked {
            for (mut c, socket) in p.conns {
                c.fd = fds.push(socket);
                connections.push(c);
            }
        }
        let subsystems = self.target.subsystems().iter().filter(|s| !s.is_discovery()).map(|s| s.image()).collect();
        let controllers = self.target.controllers().iter().filter(|c| !c.is_dead()).map(|c| c.image()).collect();
        let (cntlid_min, cntlid_max) = self.target.cntlid_range();
        Ok(EngineImage {
            format: FORMAT,
            version: crate::version::version().to_string(),
            executable: self.upgrades.executable(),
            management_fd,
            pools,
            listeners,
            next_port_id: self.listeners.next_port_id(),
            cntlid_min,
            cntlid_max,
            cntlid_cursor: self.target.cntlid_cursor(),
            discovery_generation: self.target.discovery_generation(),
            discovery_address: self.target.discovery_address(),
            generation_records,
            subsystems,
            controllers,
            connections,
            local: self.local.configs(),
        })
    }

    /// Sends what a new process can set up while this one still serves: the
    /// configuration to start its reactors with (without the listeners, pools and
    /// subsystems this one started with: the image carries what there is now), and
    /// the memory namespaces with their memfds. Nothing changes them until the image
    /// is sent: management calls wait.
    fn prepare(&self, channel: &Channel) -> std::result::Result<(), String> {
        let mut config = lock(&self.config).clone();
        config.listeners.clear();
        config.pools.clear();
        config.subsystems.clear();
        config.local.clear();
        let mut memory = Vec::new();
        let mut fds = FdList::default();
        for s in self.target.subsystems() {
            for ns in s.namespaces().values() {
                if let Handover::Memfd { fd, size } = ns.backend.handover() {
                    let fd = fd.try_clone_to_owned().map_err(|e| format!("cannot copy a memfd: {e}"))?;
                    fds.push(fd);
                    memory.push(MemoryImage { nqn: s.nqn.clone(), nsid: ns.nsid, size });
                }
            }
        }
        // A copy of every connection's socket, a listener's, the management socket's.
        let descriptors = self.target.connection_count() + self.listeners.count() + 1;
        process::reserve_descriptors(descriptors);
        channel
            .send(&Order::Prepare { config: Box::new(config), memory, descriptors }, &[])
            .and_then(|()| channel.send_fds(&fds.raw()))
            .map_err(|e| format!("it went away before it got the configuration ({e})"))
    }

    /// The new process's side: says hello on the inherited channel `fd`, starts its
    /// reactors, rebuilds the engine from the image it gets with every connection
    /// parked, says it is ready, and on Go lets the connections run. Errors are told
    /// to the old process too, which goes on serving.
    pub fn take_over(fd: RawFd) -> std::result::Result<TakenOver, String> {
        let socket = process::adopt_inherited(fd).map_err(|e| format!("no handover socket at descriptor {fd}: {e}"))?;
        let channel = Channel::new(socket);
        let fault = std::env::var(FAULT_ENV).unwrap_or_default();
        let reads = if fault == "reads-no-format" { Vec::new() } else { READS.to_vec() };
        let hello = Hello { version: crate::version::version().to_string(), pid: std::process::id(), reads };
        channel.send(&hello, &[]).map_err(|e| format!("cannot greet the running engine: {e}"))?;
        let lost = |e: std::io::Error| format!("the running engine went away during the handover: {e}");
        let failed = |why: String| {
            let _ = channel.send(&Answer::Failed(why.clone()), &[]);
            why
        };
        let (config, memory) = match channel.recv::<Order>().map_err(lost)?.0 {
            Order::Prepare { config, memory, descriptors } => {
                process::reserve_descriptors(descriptors);
                (*config, memory)
            }
            other => return Err(unexpected(other, "its configuration")),
        };
        let memfds = channel.recv_fds(memory.len()).map_err(lost)?;
        let mut mapped = BTreeMap::new();
        for (m, fd) in memory.into_iter().zip(memfds) {
            let ram = Memory::from_memfd(fd, m.size).map_err(|e| failed(e.to_string()))?;
            mapped.insert((m.nqn, m.nsid), Arc::new(ram));
        }
        let engine = Engine::start(&config).map_err(|e| failed(e.to_string()))?;
        channel.send(&Answer::Prepared, &[]).map_err(lost)?;

        let descriptors = match channel.recv::<Order>().map_err(lost)?.0 {
            Order::Image { descriptors } => descriptors,
            other => return Err(unexpected(other, "its state")),
        };
        let (mut image, _) = channel.recv::<EngineImage>().map_err(lost)?;
        let local = std::mem::take(&mut image.local);
        let fds = channel.recv_fds(descriptors).map_err(lost)?.into_iter().map(Some).collect();
        if fault == "abort-after-state" {
            // Tests: a binary that crashes in the middle of a handover.
            std::process::abort();
        }
        if !READS.contains(&image.format) {
            return Err(failed(format!("state format {} is not one this build reads ({READS:?})", image.format)));
        }
        let management = rebuild(&engine, image, fds, mapped).map_err(failed)?;
        channel.send(&Answer::Ready, &[]).map_err(lost)?;
        match channel.recv::<Order>() {
            Ok((Order::Go, _)) => {}
            Ok((other, _)) => return Err(unexpected(other, "go")),
            // The old process is gone: nobody else serves these connections now.
            Err(e) => tracing::warn!("the running engine went away before it said go ({e}); serving on"),
        }
        for l in engine.links.iter() {
            l.run(|r| r.resume());
        }
        process::notify_service_manager(&format!("MAINPID={}\nREADY=1", std::process::id()));
        let _ = channel.send(&Answer::Serving, &[]);
        // The old process exits now; the driver lets its local devices go once its
        // rings are torn down, and they are taken back with the I/O they held.
        engine.local.recover(local);
        engine.upgrades.set_management(&management);
        Ok(TakenOver { engine, config, management })
    }
}

/// Memory namespaces mapped before the pause, by subsystem and NSID.
type Mapped = BTreeMap<(String, u32), Arc<Memory>>;

/// Rebuilds the image's state in `engine` (whose reactors run) and puts every
/// listener and connection parked on its reactor. Returns the management socket.
fn rebuild(
    engine: &Arc<Engine>,
    image: EngineImage,
    mut fds: Vec<Option<OwnedFd>>,
    mut mapped: Mapped,
) -> std::result::Result<UnixListener, String> {
    let mut take = |i: usize| fds.get_mut(i).and_then(Option::take).ok_or(format!("descriptor {i} is missing"));
    let management = UnixListener::from(take(image.management_fd)?);
    let reactors = engine.links.len();
    let mut conns: Vec<Vec<_>> = (0..reactors).map(|_| Vec::new()).collect();
    let mut listeners = Vec::new();
    for l in &image.listeners {
        listeners.push((l.port_id, TcpListener::from(take(l.fd)?), l.tls));
    }
    let mut sockets = Vec::new();
    for c in &image.connections {
        sockets.push(TcpStream::from(take(c.fd)?));
    }
    let controllers = (|| -> Result<_> {
        engine.upgrades.set_executable(image.executable.clone());
        engine.target.set_cntlid_range(image.cntlid_min, image.cntlid_max)?;
        engine.target.continue_from(image.cntlid_cursor, image.discovery_generation);
        engine.target.set_discovery_address(image.discovery_address);
        for disks in &image.pools {
            engine.pools.import(disks)?;
        }
        for (pool, volume, record) in &image.generation_records {
            engine.pools.restore_generation_record(pool, volume, record)?;
        }
        for s in &image.subsystems {
            engine.restore_subsystem(s, &mut mapped)?;
        }
        let now = engine.target.now_ms();
        let mut controllers = BTreeMap::new();
        for c in &image.controllers {
            let subsystem = engine.target.subsystem(&c.subsystem).ok_or_else(|| {
                Error::internal(format!("controller {} belongs to the unknown subsystem {}", c.cntlid, c.subsystem))
            })?;
            let controller = Arc::new(Controller::restore(c, subsystem.clone(), now));
            engine.target.adopt_controller(controller.clone());
            subsystem.adopt_controller(&controller);
            controllers.insert(c.cntlid, controller);
        }
        Ok(controllers)
    })()
    .map_err(|e| e.to_string())?;
    for (stream, c) in sockets.into_iter().zip(image.connections) {
        let controller = c.queue.as_ref().and_then(|q| controllers.get(&q.cntlid).cloned());
        conns[c.reactor % reactors].push((stream, c, controller));
    }
    let (done, restored) = mpsc::channel();
    for (link, conns) in engine.links.iter().zip(conns) {
        let done = done.clone();
        link.run(move |r| r.restore(conns, done));
    }
    // After the reactors are held: the listeners accept once they resume.
    engine.listeners.restore(image.next_port_id, listeners).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + READY_TIMEOUT;
    for _ in 0..reactors {
        restored
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| "a reactor did not take its connections in time".to_string())??;
    }
    Ok(management)
}

impl Engine {
    fn restore_subsystem(&self, i: &SubsystemImage, mapped: &mut Mapped) -> Result<()> {
        let mut keys = BTreeMap::new();
        for d in &i.dhchap {
            keys.insert(d.host.clone(), Arc::new(HostKeys::from_config(&d.keys)?));
        }
        let mut psks = BTreeMap::new();
        for p in &i.tls_psk {
            let psk = crate::tls::HostPsk::from_config(&p.psk)
                .map_err(|e| Error::internal(format!("host {} of {}: {e}", p.host, i.nqn)))?;
            psks.insert(p.host.clone(), Arc::new(psk));
        }
        let paths = i.host_paths.iter().map(|h| (h.host.clone(), h.paths.clone())).collect();
        let policy =
            HostPolicy { allow_any: i.allow_any_host, hosts: i.hosts.iter().cloned().collect(), keys, psks, paths };
        let s = Subsystem::new(&i.nqn, &i.serial, &i.model, policy)?;
        for n in &i.namespaces {
            let backend = match &n.backend {
                BackendImage::Spec(spec) => self.open_backend(spec)?.backend,
                BackendImage::Memory => mapped.remove(&(i.nqn.clone(), n.nsid)).ok_or_else(|| {
                    Error::internal(format!("memory namespace {} of {} was not sent before the pause", n.nsid, i.nqn))
                })?,
            };
            let mut ns = Namespace::new(n.nsid, backend, n.block_size, n.uuid, n.nguid)?;
            ns.ana_group = n.ana_group;
            ns.qos.set(n.qos);
            ns.reservations.restore(&n.reservations);
            if let Some(key) = ns.reservations.holder_key() {
                ns.backend.reservation_taken(key);
            }
            s.add_namespace(ns)?;
        }
        s.restore_ana(&i.ana);
        self.target.add_subsystem(s)
    }
}

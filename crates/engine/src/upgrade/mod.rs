//! Hot upgrade: a new engine binary takes over the running engine's sockets and state,
//! and no host notices more than a pause.
//!
//! The old engine starts the new binary (`nvpool engine --take-over`) with one end of a
//! Unix socket pair and waits for its hello, which says which state formats it reads;
//! nothing has stopped yet, so a binary that does not start costs nothing. Then:
//!
//! 1. **Park.** Reactor 0 stops accepting, then every reactor parks its connections:
//!    commands already taken finish (their data, disk work, forwarding and answers),
//!    commands that arrive are held unread, and the posted receive is taken back.
//! 2. **Image.** Pools are checkpointed (the new process replays no journal). The state
//!    image (subsystems, namespaces, ANA tables, controllers, each connection's queue,
//!    held bytes and outstanding Asynchronous Event Requests) goes over the channel with
//!    copies of the sockets, memfds and the management socket (SCM_RIGHTS).
//! 3. **Ready.** The new process rebuilds everything and says so, still not reading.
//! 4. **Go.** The old engine tells it to go on, answers the caller and exits without
//!    touching a socket; the new one restores the connections on its reactors, which
//!    act on the held bytes first and then read on.
//!
//! Until Go, the old engine can take everything back: a new process that exits,
//! crashes, says it failed or does not answer in time is killed, and the reactors
//! resume (the held commands are acted on first). Management calls wait while an
//! upgrade runs; one is refused while a volume migrates.

pub mod channel;
pub mod image;

use std::collections::BTreeMap;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::Ordering;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use channel::{Channel, MAX_FDS_PER_FRAME};
use image::*;
use nvpool_api::UpgradeReport;

use crate::Engine;
use crate::backend::Handover;
use crate::backend::memory::Memory;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::nvme::subsystem::HostPolicy;
use crate::nvme::{Controller, Namespace, Subsystem, lock};
use crate::reactor::{Msg, Parked};

/// The environment variable naming the handover socket's descriptor in the new process.
pub const TAKEOVER_FD_ENV: &str = "NVPOOL_TAKEOVER_FD";
/// Set to `abort-after-state` in a new process's environment, it crashes once it has
/// the state image: how the tests show that a crash mid-handover loses nothing.
pub const FAULT_ENV: &str = "NVPOOL_FAULT_TAKEOVER";
/// How long the new binary may take to start and say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the connections may take to finish the commands they took.
const PARK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the new process may take to rebuild the engine from the image.
const READY_TIMEOUT: Duration = Duration::from_secs(5);

/// What a new engine process took over: the engine and its management socket.
pub struct TakenOver {
    /// The engine, serving.
    pub engine: Arc<Engine>,
    /// Its configuration (lists of listeners, pools and subsystems empty).
    pub config: EngineConfig,
    /// The management socket, listening.
    pub management: UnixListener,
}

/// The descriptors that go with an image, in index order, kept open until sent.
#[derive(Default)]
struct FdList {
    owned: Vec<OwnedFd>,
}

impl FdList {
    fn push(&mut self, fd: impl Into<OwnedFd>) -> usize {
        self.owned.push(fd.into());
        self.owned.len() - 1
    }

    fn raw(&self) -> Vec<RawFd> {
        self.owned.iter().map(|f| f.as_raw_fd()).collect()
    }
}

impl Engine {
    /// Hands this engine over to a new process running `binary` (the engine's own
    /// executable if `None`). On success the caller answers its client and exits the
    /// process; on failure this engine goes on serving, and the error says why.
    pub fn upgrade(&self, binary: Option<&Path>) -> Result<UpgradeReport> {
        let _exclusive = self.upgrade_lock.write().unwrap_or_else(|e| e.into_inner());
        if self.handed_over.load(Ordering::SeqCst) {
            return Err(Error::precondition("this engine already handed over to a new process"));
        }
        if let Some(volume) = self.migration_running() {
            return Err(Error::precondition(format!(
                "volume {volume} is moving to another engine: upgrade once its migration ends, or cancel it"
            )));
        }
        let binary = binary.map(Path::to_path_buf).unwrap_or_else(|| lock(&self.executable).clone());
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

        // From here until Go, no command is read.
        let paused = Instant::now();
        let parked = match self.park_all() {
            Ok(p) => p,
            Err(e) => {
                self.resume_all();
                return Err(abandon(&channel, &mut child, &binary, &e));
            }
        };
        let handed = self.hand_over(&channel, parked);
        let ready = handed.and_then(|counts| {
            channel.set_timeout(Some(READY_TIMEOUT)).map_err(|e| e.to_string())?;
            match channel.recv::<Answer>() {
                Ok((Answer::Ready, _)) => Ok(counts),
                Ok((Answer::Failed(why), _)) => Err(format!("it could not take over: {why}")),
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
                self.resume_all();
                return Err(e);
            }
        };
        let pause = paused.elapsed();
        self.handed_over.store(true, Ordering::SeqCst);
        tracing::info!(
            new_pid = hello.pid,
            version = %hello.version,
            connections,
            pause_us = pause.as_micros() as u64,
            "handed over to the new engine; exiting"
        );
        Ok(UpgradeReport {
            old_pid: std::process::id(),
            old_version: crate::VERSION.to_string(),
            new_pid: hello.pid,
            new_version: hello.version,
            connections,
            controllers,
            pause_us: pause.as_micros() as u64,
        })
    }

    /// Whether this engine handed over to a new process (and must exit).
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::SeqCst)
    }

    /// Parks reactor 0 first (it accepts, and hands accepted connections to the
    /// others), then the rest.
    fn park_all(&self) -> std::result::Result<Vec<Parked>, String> {
        let deadline = Instant::now() + PARK_TIMEOUT;
        let (tx, rx) = mpsc::channel();
        let wait = |rx: &mpsc::Receiver<Parked>| {
            rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).map_err(|_| {
                format!(
                    "the connections did not finish their commands within {PARK_TIMEOUT:?} (a host that does not \
                     send the data it was asked for, or a backend that does not answer)"
                )
            })
        };
        self.links[0].send(Msg::Park(tx.clone()));
        let mut parked = vec![wait(&rx)?];
        for l in &self.links[1..] {
            l.send(Msg::Park(tx.clone()));
        }
        for _ in 1..self.links.len() {
            parked.push(wait(&rx)?);
        }
        Ok(parked)
    }

    fn resume_all(&self) {
        for l in self.links.iter() {
            l.send(Msg::Resume);
        }
    }

    /// Checkpoints the pools and sends the image and its descriptors. Returns the
    /// connections and controllers handed over.
    fn hand_over(&self, channel: &Channel, parked: Vec<Parked>) -> std::result::Result<(usize, usize), String> {
        for p in lock(&self.pools).values() {
            p.checkpoint().map_err(|e| format!("the pools could not be checkpointed: {e}"))?;
        }
        let mut fds = FdList::default();
        let image = self.image(parked, &mut fds)?;
        let counts = (image.connections.len(), image.controllers.len());
        let raw = fds.raw();
        let frames: Vec<&[RawFd]> = raw.chunks(MAX_FDS_PER_FRAME).collect();
        let sent = channel
            .send(&Order::Image { fd_frames: frames.len() }, &[])
            .and_then(|()| channel.send(&image, &[]))
            .and_then(|()| frames.iter().try_for_each(|f| channel.send(&FdFrame { count: f.len() }, f)));
        sent.map_err(|e| format!("the state could not be sent ({e})"))?;
        Ok(counts)
    }

    fn image(&self, parked: Vec<Parked>, fds: &mut FdList) -> std::result::Result<EngineImage, String> {
        let copy = |what: &str, e: std::io::Error| format!("cannot copy the {what} descriptor: {e}");
        let management = lock(&self.management)
            .as_ref()
            .ok_or("the engine has no management socket")?
            .try_clone()
            .map_err(|e| copy("management socket", e))?;
        let management_fd = fds.push(management);
        let pools = lock(&self.pools).values().map(|p| p.disk_paths()).collect();
        let addresses = lock(&self.listeners).clone();
        let mut listeners = Vec::new();
        let mut connections = Vec::new();
        for p in parked {
            for (port_id, l) in p.listeners {
                if let Some(&address) = addresses.get(&port_id) {
                    listeners.push(ListenerImage { port_id, address, fd: fds.push(l) });
                }
            }
            for (mut c, socket) in p.conns {
                c.fd = fds.push(socket);
                connections.push(c);
            }
        }
        let mut subsystems = Vec::new();
        for s in self.target.subsystems().into_iter().filter(|s| !s.is_discovery()) {
            let policy = s.host_policy();
            let mut namespaces = Vec::new();
            for ns in s.namespaces().values() {
                let backend = match ns.backend.handover() {
                    Handover::Spec(spec) => BackendImage::Spec(spec),
                    Handover::Memfd { fd, size } => {
                        let fd = fd.try_clone_to_owned().map_err(|e| copy("memory namespace", e))?;
                        BackendImage::Memory { size, fd: fds.push(fd) }
                    }
                };
                namespaces.push(NamespaceImage {
                    nsid: ns.nsid,
                    backend,
                    block_size: ns.block_size(),
                    uuid: ns.uuid,
                    nguid: ns.nguid,
                    ana_group: ns.ana_group,
                });
            }
            subsystems.push(SubsystemImage {
                nqn: s.nqn.clone(),
                serial: s.serial.clone(),
                model: s.model.clone(),
                allow_any_host: policy.allow_any,
                hosts: policy.hosts.into_iter().collect(),
                namespaces,
                ana: s.ana_image(),
            });
        }
        let controllers = self.target.controllers().iter().filter(|c| !c.is_dead()).map(|c| c.image()).collect();
        let (cntlid_min, cntlid_max) = self.target.cntlid_range();
        let mut config = lock(&self.config).clone();
        config.listeners.clear();
        config.pools.clear();
        config.subsystems.clear();
        Ok(EngineImage {
            format: FORMAT,
            version: crate::VERSION.to_string(),
            config,
            executable: lock(&self.executable).clone(),
            management_fd,
            pools,
            listeners,
            next_port_id: self.next_port_id.load(Ordering::Relaxed),
            cntlid_min,
            cntlid_max,
            cntlid_cursor: self.target.cntlid_cursor(),
            discovery_generation: self.target.discovery_generation(),
            subsystems,
            controllers,
            connections,
        })
    }

    /// The new process's side: says hello on the inherited channel `fd`, rebuilds the
    /// engine from the image it gets, says it is ready, and on Go serves every
    /// connection. Errors are reported to the old process too, which goes on serving.
    pub fn take_over(fd: RawFd) -> std::result::Result<TakenOver, String> {
        let socket = channel::adopt_inherited(fd).map_err(|e| format!("no handover socket at descriptor {fd}: {e}"))?;
        let channel = Channel::new(socket);
        let hello = Hello { version: crate::VERSION.to_string(), pid: std::process::id(), reads: READS.to_vec() };
        channel.send(&hello, &[]).map_err(|e| format!("cannot greet the running engine: {e}"))?;
        let lost = |e: std::io::Error| format!("the running engine went away during the handover: {e}");
        let fd_frames = match channel.recv::<Order>().map_err(lost)?.0 {
            Order::Image { fd_frames } => fd_frames,
            Order::Abort(why) => return Err(format!("the running engine called the upgrade off: {why}")),
            Order::Go => return Err("the running engine said go before sending its state".into()),
        };
        let (image, _) = channel.recv::<EngineImage>().map_err(lost)?;
        let mut fds = Vec::new();
        for _ in 0..fd_frames {
            let (frame, got) = channel.recv::<FdFrame>().map_err(lost)?;
            if frame.count != got.len() {
                return Err(format!("a frame promised {} descriptors and carried {}", frame.count, got.len()));
            }
            fds.extend(got.into_iter().map(Some));
        }
        if std::env::var(FAULT_ENV).as_deref() == Ok("abort-after-state") {
            // Tests: a binary that crashes in the middle of a handover.
            std::process::abort();
        }
        let rebuilt = if READS.contains(&image.format) {
            Rebuilt::from_image(image, fds)
        } else {
            Err(format!("state format {} is not one this build reads ({READS:?})", image.format))
        };
        let rebuilt = match rebuilt {
            Ok(r) => r,
            Err(e) => {
                let _ = channel.send(&Answer::Failed(e.clone()), &[]);
                return Err(e);
            }
        };
        channel.send(&Answer::Ready, &[]).map_err(lost)?;
        match channel.recv::<Order>() {
            Ok((Order::Go, _)) => {}
            Ok((Order::Abort(why), _)) => {
                rebuilt.engine.stop();
                return Err(format!("the running engine called the upgrade off: {why}"));
            }
            Ok((Order::Image { .. }, _)) => {
                rebuilt.engine.stop();
                return Err("the running engine sent its state twice".into());
            }
            // The old process is gone: nobody else serves these connections now.
            Err(e) => tracing::warn!("the running engine went away before it said go ({e}); serving on"),
        }
        Ok(rebuilt.serve())
    }
}

/// The engine rebuilt in the new process, its connections and listeners waiting for Go.
struct Rebuilt {
    engine: Arc<Engine>,
    config: EngineConfig,
    management: UnixListener,
    listeners: Vec<(u16, TcpListener)>,
    conns: Vec<(TcpStream, ConnImage, Option<Arc<Controller>>)>,
}

impl Rebuilt {
    fn from_image(image: EngineImage, mut fds: Vec<Option<OwnedFd>>) -> std::result::Result<Rebuilt, String> {
        let mut take = |i: usize| fds.get_mut(i).and_then(Option::take).ok_or(format!("descriptor {i} is missing"));
        let management = UnixListener::from(take(image.management_fd)?);
        let mut listeners = Vec::new();
        for l in &image.listeners {
            listeners.push((l.port_id, l.address, TcpListener::from(take(l.fd)?)));
        }
        let mut sockets = Vec::new();
        for c in &image.connections {
            sockets.push(TcpStream::from(take(c.fd)?));
        }
        let mut memfds = BTreeMap::new();
        for s in &image.subsystems {
            for ns in &s.namespaces {
                if let BackendImage::Memory { fd, .. } = ns.backend {
                    memfds.insert(fd, take(fd)?);
                }
            }
        }
        let engine = Engine::start(&image.config).map_err(|e| e.to_string())?;
        let built = (|| -> Result<_> {
            *lock(&engine.executable) = image.executable.clone();
            *lock(&engine.config) = image.config.clone();
            engine.next_port_id.store(image.next_port_id, Ordering::Relaxed);
            engine.target.set_cntlid_range(image.cntlid_min, image.cntlid_max)?;
            engine.target.continue_from(image.cntlid_cursor, image.discovery_generation);
            for disks in &image.pools {
                engine.import_pool(disks)?;
            }
            for s in &image.subsystems {
                engine.restore_subsystem(s, &mut memfds)?;
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
        })();
        let controllers = match built {
            Ok(c) => c,
            Err(e) => {
                engine.stop();
                return Err(e.to_string());
            }
        };
        let mut listener_list = Vec::new();
        for (port_id, address, l) in listeners {
            lock(&engine.listeners).insert(port_id, address);
            let info = nvpool_api::ListenerInfo { port_id, addr: address.ip(), port: address.port() };
            engine.target.add_listener_info(info);
            listener_list.push((port_id, l));
        }
        let conns = sockets
            .into_iter()
            .zip(image.connections)
            .map(|(s, c)| {
                let controller = c.queue.as_ref().and_then(|q| controllers.get(&q.cntlid).cloned());
                (s, c, controller)
            })
            .collect();
        Ok(Rebuilt { engine, config: image.config, management, listeners: listener_list, conns })
    }

    /// Go: the reactors take the listeners and connections.
    fn serve(self) -> TakenOver {
        let links = &self.engine.links;
        for (port_id, listener) in self.listeners {
            links[0].send(Msg::Listen { port_id, listener });
        }
        for (stream, image, controller) in self.conns {
            links[image.reactor % links.len()].send(Msg::Restore { stream, image, controller });
        }
        *lock(&self.engine.management) = self.management.try_clone().ok();
        TakenOver { engine: self.engine, config: self.config, management: self.management }
    }
}

impl Engine {
    fn restore_subsystem(&self, i: &SubsystemImage, memfds: &mut BTreeMap<usize, OwnedFd>) -> Result<()> {
        let policy = HostPolicy { allow_any: i.allow_any_host, hosts: i.hosts.iter().cloned().collect() };
        let s = Subsystem::new(&i.nqn, &i.serial, &i.model, policy)?;
        for n in &i.namespaces {
            let backend = match &n.backend {
                BackendImage::Spec(spec) => self.open_backend(spec)?.backend,
                BackendImage::Memory { size, fd } => {
                    let fd =
                        memfds.remove(fd).ok_or_else(|| Error::internal("a memory namespace's memfd is missing"))?;
                    Arc::new(Memory::from_memfd(fd, *size)?)
                }
            };
            let mut ns = Namespace::new(n.nsid, backend, n.block_size, n.uuid, n.nguid)?;
            ns.ana_group = n.ana_group;
            s.add_namespace(ns)?;
        }
        s.restore_ana(&i.ana);
        self.target.add_subsystem(s)
    }
}

/// Starts `binary` as a new engine that takes over through the returned channel.
fn start_new_engine(binary: &Path) -> Result<(Channel, Child)> {
    let (channel, child_end) = Channel::pair().map_err(|e| Error::io("cannot create the handover socket pair", e))?;
    channel::inherit(child_end.as_raw_fd()).map_err(|e| Error::io("cannot pass the handover socket on", e))?;
    let child = Command::new(binary)
        .args(["engine", "--take-over"])
        .env(TAKEOVER_FD_ENV, child_end.as_raw_fd().to_string())
        .spawn()
        .map_err(|e| {
            Error::invalid(format!("cannot start {}: {e} (pass --binary with the new nvpool binary)", binary.display()))
        })?;
    // The child has its copy; ours would keep the channel open if the child died.
    drop(child_end);
    channel.set_timeout(Some(HELLO_TIMEOUT)).map_err(|e| Error::io("handover socket", e))?;
    Ok((channel, child))
}

/// Calls the upgrade off: tells the new process, kills it and reaps it. Returns the
/// error the caller reports, with how the new process ended.
fn abandon(channel: &Channel, child: &mut Child, binary: &Path, why: &str) -> Error {
    let _ = channel.send(&Order::Abort(why.to_string()), &[]);
    let ended = match child.try_wait() {
        Ok(Some(status)) => format!("; it exited with {status}"),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            String::new()
        }
    };
    tracing::warn!("hot upgrade to {} called off: {why}{ended}; this engine goes on serving", binary.display());
    Error::unavailable(format!(
        "the upgrade to {} was called off: {why}{ended}. This engine goes on serving; nothing was lost",
        binary.display()
    ))
}

/// The default binary of the next upgrade: the running executable's path, where a
/// package upgrade puts the new version.
pub fn own_executable() -> PathBuf {
    std::env::current_exe()
        .map(|p| {
            // A replaced binary reads as "PATH (deleted)": the path is where the new one is.
            let s = p.to_string_lossy();
            s.strip_suffix(" (deleted)").map(PathBuf::from).unwrap_or(p)
        })
        .unwrap_or_else(|_| PathBuf::from("nvpool"))
}

//! Hot upgrade: a new engine binary takes over the running engine's sockets and state,
//! and no host notices more than a pause.
//!
//! The old engine starts the new binary (`nvpool engine --take-over`) with one end of a
//! Unix socket pair and waits for its hello, which says which state formats it reads.
//! It sends its configuration, and the new process starts its reactors (threads,
//! rings, registered buffers) while the old one still serves: a binary that does not
//! start costs nothing, and the slow part of starting is out of the pause. Then:
//!
//! 1. **Park.** Reactor 0 stops accepting, then every reactor parks its connections:
//!    commands already taken finish (their data, disk work, forwarding and answers),
//!    commands that arrive are held unread, and the posted receive is taken back.
//! 2. **Image.** Pools are checkpointed (the new process replays no journal). The state
//!    image (subsystems, namespaces, ANA tables, controllers, each connection's queue,
//!    held bytes and outstanding Asynchronous Event Requests) goes over the channel with
//!    copies of the sockets, memfds and the management socket (SCM_RIGHTS).
//! 3. **Ready.** The new process rebuilds everything, puts each connection parked on
//!    its reactor, and says so. Everything that can fail is done by now.
//! 4. **Go.** The old engine tells it to go on. The new reactors act on the held bytes
//!    first, then read on; the new process names itself the service's main process
//!    to systemd, if systemd started the engine, and says it serves. The old engine
//!    then answers the caller and exits without touching a socket.
//!
//! Until Go, the old engine can take everything back: a new process that exits,
//! crashes, says it failed or does not answer in time is killed, and the reactors
//! resume (the held commands are acted on first). The new process never stops what it
//! was given when it gives up, since stopping would shut down sockets the old engine
//! serves: it exits, which only closes its copies. Management calls wait while an
//! upgrade runs; one is refused while a volume migrates.
//!
//! This module holds the formats, the channel, the process handling and the state
//! kept between upgrades; `engine/handover.rs` runs the steps above with the engine's
//! services, each of which images its own state.

pub mod channel;
pub mod image;
pub mod process;

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use channel::Channel;
use image::Order;

use crate::error::{Error, Result};
use crate::sync::lock;

/// The environment variable naming the handover socket's descriptor in the new process.
pub const TAKEOVER_FD_ENV: &str = "NVPOOL_TAKEOVER_FD";
/// In a new process's environment, for the tests: `abort-after-state` crashes it once
/// it has the state image (a crash mid-handover loses nothing); `reads-no-format`
/// makes it say it reads no state format (the old engine refuses to hand over).
pub const FAULT_ENV: &str = "NVPOOL_FAULT_TAKEOVER";
/// How long the new binary may take to start, say hello and start its reactors.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the connections may take to finish the commands they took.
pub(crate) const PARK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the new process may take to rebuild the engine from the image.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the old process waits, after Go, for the new one to say it serves.
pub(crate) const SERVING_TIMEOUT: Duration = Duration::from_secs(2);

/// What the engine keeps for hot upgrades while it runs.
pub struct UpgradeState {
    /// The binary a hot upgrade starts unless told another.
    executable: Mutex<PathBuf>,
    /// The management socket's listener, for a hot upgrade to hand on.
    management: Mutex<Option<UnixListener>>,
    /// Management calls hold it shared; a hot upgrade holds it alone.
    lock: RwLock<()>,
    /// Set once a hot upgrade handed everything to a new process.
    handed_over: AtomicBool,
}

impl UpgradeState {
    /// Nothing handed over; the next upgrade starts this process's own executable.
    pub fn new() -> UpgradeState {
        UpgradeState {
            executable: Mutex::new(own_executable()),
            management: Mutex::new(None),
            lock: RwLock::new(()),
            handed_over: AtomicBool::new(false),
        }
    }

    /// Held shared by every management call, so none runs during a hot upgrade.
    pub fn shared(&self) -> RwLockReadGuard<'_, ()> {
        self.lock.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Held by a hot upgrade from start to end.
    pub fn exclusive(&self) -> RwLockWriteGuard<'_, ()> {
        self.lock.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a hot upgrade handed everything to a new process (which serves now).
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::SeqCst)
    }

    /// Records that the new process took over.
    pub fn set_handed_over(&self) {
        self.handed_over.store(true, Ordering::SeqCst);
    }

    /// The binary the next upgrade starts unless told another.
    pub fn executable(&self) -> PathBuf {
        lock(&self.executable).clone()
    }

    /// Sets the binary the next upgrade starts (the one the process before ran).
    pub fn set_executable(&self, path: PathBuf) {
        *lock(&self.executable) = path;
    }

    /// Keeps a copy of the management socket's listener.
    pub fn set_management(&self, listener: &UnixListener) {
        *lock(&self.management) = listener.try_clone().ok();
    }

    /// A copy of the management socket's listener, to hand on.
    pub fn management(&self) -> std::result::Result<UnixListener, String> {
        lock(&self.management)
            .as_ref()
            .ok_or("the engine has no management socket")?
            .try_clone()
            .map_err(|e| format!("cannot copy the management socket descriptor: {e}"))
    }
}

impl Default for UpgradeState {
    fn default() -> Self {
        UpgradeState::new()
    }
}

/// The descriptors that go with an image, in index order, kept open until sent.
#[derive(Default)]
pub(crate) struct FdList {
    owned: Vec<OwnedFd>,
}

impl FdList {
    pub(crate) fn push(&mut self, fd: impl Into<OwnedFd>) -> usize {
        self.owned.push(fd.into());
        self.owned.len() - 1
    }

    pub(crate) fn raw(&self) -> Vec<RawFd> {
        self.owned.iter().map(|f| f.as_raw_fd()).collect()
    }
}

/// The new process's error for an order out of turn.
pub(crate) fn unexpected(order: Order, waited_for: &str) -> String {
    match order {
        Order::Abort(why) => format!("the running engine called the upgrade off: {why}"),
        other => format!("the running engine sent {other:?} where it was to send {waited_for}"),
    }
}

/// Starts `binary` as a new engine that takes over through the returned channel.
pub(crate) fn start_new_engine(binary: &Path) -> Result<(Channel, Child)> {
    let (channel, child_end) = Channel::pair().map_err(|e| Error::io("cannot create the handover socket pair", e))?;
    process::inherit(child_end.as_raw_fd()).map_err(|e| Error::io("cannot pass the handover socket on", e))?;
    let child = Command::new(binary)
        .args(["engine", "--take-over"])
        .env(TAKEOVER_FD_ENV, child_end.as_raw_fd().to_string())
        .spawn()
        .map_err(|e| {
            Error::invalid(format!("cannot start {}: {e} (pass --binary with the new nvpool binary)", binary.display()))
        })?;
    // The child has its copy; ours would keep the channel open if the child died.
    drop(child_end);
    channel.set_timeout(Some(START_TIMEOUT)).map_err(|e| Error::io("handover socket", e))?;
    Ok((channel, child))
}

/// Calls the upgrade off: tells the new process, kills it and reaps it. Returns the
/// error the caller reports, with how the new process ended.
pub(crate) fn abandon(channel: &Channel, child: &mut Child, binary: &Path, why: &str) -> Error {
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

//! Local devices: a namespace served as a block device of this node, so containers
//! and virtual machines on the volume's own node skip NVMe/TCP.
//!
//! For containers, Linux's ublk driver hands each block request to the engine through
//! `URING_CMD`s on the reactors' own rings (one ublk queue per reactor,
//! `reactor/ublk.rs`); the engine answers it from the namespace's backend, as it would
//! an NVMe command. The device outlives the engine process: it is created with the
//! driver's user recovery (I/O waits while no engine serves it, and requests the
//! engine held are issued again), so an engine that crashed, or the new process of a
//! hot upgrade, takes it back by number and the block device's users see no error.
//!
//! For virtual machines, a vhost-user-blk socket (`vhost.rs`): QEMU shares the guest's
//! memory and the reactors serve the virtqueues in it (`reactor/vhost.rs`).

pub mod control;
pub mod request;
pub mod uapi;
mod ublk_queue;
pub mod vhost;
mod vhost_queue;
pub mod virtio_blk;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use nvpool_api::{LocalDeviceConfig, LocalDeviceInfo};

use crate::error::{Error, ErrorKind, Result};
use crate::nvme::{MAX_TRANSFER, Namespace, Subsystem, Target};
use crate::reactor::Links;
use crate::ring::new_client_key;
use crate::sync::lock;
use control::Control;
use uapi::{DevInfo, Params, attr, feature, state};
use ublk_queue::UblkQueue;

/// Requests in flight per queue unless configured.
const DEFAULT_DEPTH: u16 = 128;
/// How long a device left by an engine that exited may take to be released by the
/// kernel (its rings are torn down after the process is gone).
const RECOVERY_PATIENCE: Duration = Duration::from_secs(10);
/// The largest discard or write zeroes request, in sectors: a Dataset Management range
/// counts blocks in 32 bits.
const MAX_DISCARD_SECTORS: u32 = 1 << 30;

/// A ublk device this engine serves, shared by its queues on the reactors.
pub struct LocalDevice {
    /// The N of `/dev/ublkbN`.
    pub dev_id: u32,
    /// The subsystem of the namespace it serves.
    pub subsystem: Arc<Subsystem>,
    /// The namespace it serves.
    pub nsid: u32,
    /// Whether writes are refused.
    pub read_only: bool,
    /// Queues: reactor `q` serves queue `q`.
    pub queues: u16,
    /// Tags per queue.
    pub depth: u16,
    /// Largest request in bytes (each tag has a buffer of this size).
    pub max_io_bytes: u32,
    /// `/dev/ublkcN`, where the queues' commands go.
    pub char_dev: OwnedFd,
    /// Whether requests' pages go straight to the backend (driver zero copy with
    /// automatic buffer registration) rather than through each tag's buffer.
    pub zero_copy: bool,
    config: LocalDeviceConfig,
    recovered: bool,
    data_path: String,
    /// Queues whose commands have all ended (the device is stopping).
    ended: Mutex<u16>,
    ended_cv: Condvar,
}

impl LocalDevice {
    /// Called by a reactor once its queue of this device has ended.
    pub fn queue_ended(&self) {
        *lock(&self.ended) += 1;
        self.ended_cv.notify_all();
    }

    fn wait_queues_ended(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut ended = lock(&self.ended);
        while *ended < self.queues {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            ended = self.ended_cv.wait_timeout(ended, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        true
    }

    fn info(&self) -> LocalDeviceInfo {
        let ns = self.subsystem.namespaces().get(&self.nsid).cloned();
        LocalDeviceInfo {
            kind: "ublk".into(),
            device: format!("/dev/ublkb{}", self.dev_id),
            ublk_id: Some(self.dev_id),
            target: format!("{}/{}", self.subsystem.nqn, self.nsid),
            size: ns.as_ref().map_or(0, |n| n.blocks << n.block_shift),
            block_size: ns.as_ref().map_or(0, |n| n.block_size()),
            read_only: self.read_only,
            queues: self.queues,
            queue_depth: self.depth,
            data_path: self.data_path.clone(),
            recovered: self.recovered,
        }
    }
}

impl std::fmt::Debug for LocalDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "/dev/ublkb{} ({}/{})", self.dev_id, self.subsystem.nqn, self.nsid)
    }
}

/// The engine's local devices: ublk block devices and vhost-user-blk sockets, each
/// serving a namespace of the target through queues on the reactors.
pub struct LocalDevices {
    target: Arc<Target>,
    links: Links,
    control: Mutex<Option<Arc<Control>>>,
    devices: Mutex<BTreeMap<u32, Arc<LocalDevice>>>,
    vhost: vhost::VhostDevices,
}

/// How data moves for a device made with `flags` on a driver offering `features`.
fn data_path(flags: u64, features: u64, backend: &str) -> String {
    if flags & feature::ZERO_COPY == feature::ZERO_COPY {
        "zero copy: the driver registers each request's pages in the reactor's ring and the backend reads and \
         writes them directly"
            .into()
    } else if features & feature::AUTO_BUF_REG != 0 {
        format!(
            "copy: the driver copies between each request and the engine's buffer (zero copy is for file \
             namespaces; this one is {backend})"
        )
    } else {
        "copy: the driver copies between each request and the engine's buffer (zero copy needs Linux 6.16 or \
         later)"
            .into()
    }
}

/// Whether a device of a namespace with this backend is made with zero copy: only a
/// file's data path is nothing but fixed-buffer reads and writes the driver's pages can
/// take (other backends copy, zero or forward the data with the CPU).
fn zero_copy_for(features: u64, backend: &str) -> bool {
    features & feature::AUTO_BUF_REG != 0 && backend == "file"
}

impl LocalDevices {
    /// No device yet.
    pub fn new(target: Arc<Target>, links: Links) -> LocalDevices {
        LocalDevices {
            vhost: vhost::VhostDevices::new(links.clone()),
            target,
            links,
            control: Mutex::new(None),
            devices: Mutex::new(BTreeMap::new()),
        }
    }

    fn ublk_control(&self) -> Result<Arc<Control>> {
        let mut c = lock(&self.control);
        if let Some(c) = c.as_ref() {
            return Ok(c.clone());
        }
        let opened = Arc::new(Control::open().map_err(Error::unavailable)?);
        *c = Some(opened.clone());
        Ok(opened)
    }

    /// The subsystem and namespace a local device's target names.
    fn local_target(&self, target: &str) -> Result<(Arc<Subsystem>, Arc<Namespace>)> {
        if let Some(volume) = target.strip_prefix("volume:") {
            let spec = format!("volume:{volume}");
            for s in self.target.subsystems() {
                if let Some(ns) = s.namespaces().values().find(|n| n.backend.description() == spec) {
                    return Ok((s.clone(), ns.clone()));
                }
            }
            return Err(Error::not_found(format!(
                "no namespace serves {spec} on this engine: export the volume first (`nvpool engine namespace add`), \
                 or name the namespace as NQN/NSID"
            )));
        }
        let (nqn, nsid) =
            target.rsplit_once('/').and_then(|(nqn, nsid)| Some((nqn, nsid.parse::<u32>().ok()?))).ok_or_else(
                || Error::invalid(format!("{target:?} names no namespace: use NQN/NSID or volume:POOL/NAME")),
            )?;
        self.target.namespace(nqn, nsid)
    }

    /// Serves a namespace as `/dev/ublkbN`, or takes back the device of that number an
    /// engine that exited left (with the I/O it held).
    pub fn add(&self, cfg: &LocalDeviceConfig) -> Result<LocalDeviceInfo> {
        let (subsystem, ns) = self.local_target(&cfg.target)?;
        if ns.backend.kind() == "remote" {
            return Err(Error::invalid(format!(
                "{} is served by another engine: a local device needs the volume on this node; attach it over NVMe/TCP",
                cfg.target
            )));
        }
        if let Some(socket) = &cfg.vhost_user_blk {
            return self.vhost.add(cfg, socket, subsystem, ns.nsid);
        }
        if let Some(id) = cfg.ublk_id
            && lock(&self.devices).contains_key(&id)
        {
            return Err(Error::exists(format!("this engine already serves /dev/ublkb{id}")));
        }
        let control = self.ublk_control()?;
        let features = control.features().map_err(|e| Error::io("cannot read the ublk driver's features", e))?;
        let reactors = u16::try_from(self.links.len()).unwrap_or(u16::MAX);
        let existing = cfg.ublk_id.and_then(|id| control.info(id).ok());
        let recovering = existing.is_some_and(|i| i.state != state::DEAD);
        let granted = match existing {
            Some(info) if recovering => {
                if info.flags & feature::USER_RECOVERY == 0 {
                    return Err(Error::exists(format!(
                        "/dev/ublkb{} exists and cannot be taken over (it was made without user recovery): \
                         remove it or choose another ublk_id",
                        info.dev_id
                    )));
                }
                if info.flags & feature::ZERO_COPY != 0 && ns.backend.kind() != "file" {
                    return Err(Error::precondition(format!(
                        "/dev/ublkb{} was made with zero copy, which needs a file namespace, and {} is {}: remove \
                         the device and add it again",
                        info.dev_id,
                        cfg.target,
                        ns.backend.kind()
                    )));
                }
                if info.queues > reactors {
                    return Err(Error::precondition(format!(
                        "/dev/ublkb{} has {} queues and this engine has {reactors} reactors: start the engine with \
                         at least {} reactors to take it back",
                        info.dev_id, info.queues, info.queues
                    )));
                }
                control.start_recovery(info.dev_id, RECOVERY_PATIENCE).map_err(|e| match e.raw_os_error() {
                    Some(libc::EBUSY) => Error::precondition(format!(
                        "/dev/ublkb{} is still served by process {}: stop that engine first",
                        info.dev_id, info.server_pid
                    )),
                    _ => Error::io(format!("cannot take /dev/ublkb{} back", info.dev_id), e),
                })?;
                info
            }
            existing => {
                if let Some(dead) = existing {
                    // Added and never started (an engine that died while adding it).
                    control.delete(dead.dev_id).map_err(|e| Error::io("cannot delete a device never started", e))?;
                }
                self.create_ublk(&control, cfg, &ns, features, reactors)?
            }
        };
        let char_dev = control::open_char_device(granted.dev_id)
            .map_err(|e| Error::io(format!("cannot open /dev/ublkc{}", granted.dev_id), e))?;
        let mut config = cfg.clone();
        config.ublk_id = Some(granted.dev_id);
        let device = Arc::new(LocalDevice {
            dev_id: granted.dev_id,
            subsystem,
            nsid: ns.nsid,
            read_only: cfg.read_only,
            queues: granted.queues,
            depth: granted.depth,
            max_io_bytes: granted.max_io_bytes,
            char_dev,
            zero_copy: granted.flags & feature::ZERO_COPY == feature::ZERO_COPY,
            config,
            recovered: recovering,
            data_path: data_path(granted.flags, features, ns.backend.kind()),
            ended: Mutex::new(0),
            ended_cv: Condvar::new(),
        });
        let started = self.start_queues(&device).and_then(|()| {
            if recovering { control.end_recovery(device.dev_id) } else { control.start(device.dev_id) }
                .map_err(|e| Error::io(format!("cannot start /dev/ublkb{}", device.dev_id), e))
        });
        if let Err(e) = started {
            let _ = self.end_device(&control, device, !recovering);
            return Err(e);
        }
        tracing::info!(device = ?device, recovered = recovering, "local device serving");
        let info = device.info();
        lock(&self.devices).insert(device.dev_id, device);
        Ok(info)
    }

    fn create_ublk(
        &self,
        control: &Control,
        cfg: &LocalDeviceConfig,
        ns: &Namespace,
        features: u64,
        reactors: u16,
    ) -> Result<DevInfo> {
        let depth = cfg.queue_depth.unwrap_or(DEFAULT_DEPTH);
        if depth == 0 || depth > uapi::MAX_QUEUE_DEPTH {
            return Err(Error::invalid(format!("queue_depth {depth} is out of range: use 1 to 4096")));
        }
        let mut wanted = feature::USER_RECOVERY | feature::USER_RECOVERY_REISSUE | feature::CMD_IOCTL_ENCODE;
        if zero_copy_for(features, ns.backend.kind()) {
            wanted |= feature::ZERO_COPY;
        }
        let asked = DevInfo {
            queues: reactors,
            depth,
            max_io_bytes: MAX_TRANSFER as u32,
            dev_id: cfg.ublk_id.unwrap_or(u32::MAX),
            flags: wanted & features,
            ..DevInfo::default()
        };
        let granted = control.add(&asked).map_err(|e| match e.raw_os_error() {
            Some(libc::EEXIST) => {
                Error::exists(format!("/dev/ublkb{} belongs to another program: choose another ublk_id", asked.dev_id))
            }
            _ => Error::io("cannot add a ublk device", e),
        })?;
        let mut attrs = attr::VOLATILE_CACHE | attr::FUA;
        if cfg.read_only {
            attrs |= attr::READ_ONLY;
        }
        let params = Params {
            attrs,
            block_shift: ns.block_shift as u8,
            sectors: (ns.blocks << ns.block_shift) >> 9,
            max_sectors: granted.max_io_bytes >> 9,
            max_discard_sectors: MAX_DISCARD_SECTORS,
        };
        if let Err(e) = control.set_params(granted.dev_id, &params) {
            let _ = control.delete(granted.dev_id);
            return Err(Error::io("cannot set the ublk device's parameters", e));
        }
        Ok(granted)
    }

    /// Gives each reactor its queue of `device`, which fetches every tag.
    fn start_queues(&self, device: &Arc<LocalDevice>) -> Result<()> {
        let (tx, rx) = mpsc::channel();
        for q in 0..device.queues {
            let (device, done) = (device.clone(), tx.clone());
            self.links[usize::from(q)].run(move |r| {
                let made = UblkQueue::new(&mut r.ring, device, q);
                let _ = done.send(made.map(|queue| {
                    r.ring.add_client(new_client_key(), Box::new(queue));
                }));
            });
        }
        for _ in 0..device.queues {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(Error::unavailable(e)),
                Err(_) => return Err(Error::unavailable("a reactor did not take its ublk queue within 10 s")),
            }
        }
        Ok(())
    }

    /// Stops a device (deleting it if `delete`): its queues end, and the char device
    /// closes once the reactors let go of it.
    /// A driver that does not answer (a kernel bug) is an error; the device is left as
    /// it is, for the kernel log to explain.
    fn end_device(&self, control: &Control, device: Arc<LocalDevice>, delete: bool) -> Result<()> {
        let id = device.dev_id;
        match control.stop(id) {
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                tracing::error!("cannot stop /dev/ublkb{id}: {e}");
                return Err(Error::unavailable(format!("cannot stop /dev/ublkb{id}: {e}")));
            }
            Err(e) => tracing::warn!("cannot stop /dev/ublkb{id}: {e}"),
            Ok(()) => {}
        }
        if !device.wait_queues_ended(Duration::from_secs(10)) {
            tracing::warn!("the queues of /dev/ublkb{id} did not end within 10 s");
        }
        // The reactors drop their references right after they say their queue ended.
        let deadline = Instant::now() + Duration::from_secs(1);
        while Arc::strong_count(&device) > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(device);
        if delete && let Err(e) = control.delete(id) {
            tracing::warn!("cannot delete /dev/ublkb{id}: {e}");
            if e.kind() == std::io::ErrorKind::TimedOut {
                return Err(Error::unavailable(format!("cannot delete /dev/ublkb{id}: {e}")));
            }
        }
        Ok(())
    }

    /// Removes a local device. A device an engine that exited left, and nobody took
    /// back, is removed too.
    pub fn remove(&self, ublk_id: u32) -> Result<()> {
        let control = self.ublk_control()?;
        let Some(device) = lock(&self.devices).remove(&ublk_id) else {
            return match control.info(ublk_id) {
                Ok(info) if info.state == state::QUIESCED || info.state == state::DEAD => {
                    let _ = control.stop(ublk_id);
                    control.delete(ublk_id).map_err(|e| Error::io(format!("cannot delete /dev/ublkb{ublk_id}"), e))
                }
                _ => Err(Error::not_found(format!(
                    "this engine serves no /dev/ublkb{ublk_id}: `nvpool engine local list` shows its devices"
                ))),
            };
        };
        self.end_device(&control, device, true)
    }

    /// Removes the vhost-user-blk device at `socket`.
    pub fn remove_vhost(&self, socket: &str) -> Result<()> {
        self.vhost.remove(socket)
    }

    /// Every local device.
    pub fn list(&self) -> Vec<LocalDeviceInfo> {
        let mut all: Vec<_> = lock(&self.devices).values().map(|d| d.info()).collect();
        all.extend(self.vhost.infos());
        all
    }

    /// The local devices as configuration, for a hot upgrade's new process to take
    /// them back.
    pub fn configs(&self) -> Vec<LocalDeviceConfig> {
        let mut all: Vec<_> = lock(&self.devices).values().map(|d| d.config.clone()).collect();
        all.extend(self.vhost.configs());
        all
    }

    /// The local device that serves a namespace of `nqn` (namespace `nsid` only, if
    /// given), and how to remove it.
    pub fn device_of(&self, nqn: &str, nsid: Option<u32>) -> Option<String> {
        let ublk = lock(&self.devices)
            .values()
            .find(|d| d.subsystem.nqn == nqn && nsid.is_none_or(|n| n == d.nsid))
            .map(|d| d.dev_id);
        match ublk {
            Some(id) => Some(format!("/dev/ublkb{id}: remove that first (`nvpool engine local remove {id}`)")),
            None => self.vhost.device_of(nqn, nsid).map(|socket| {
                format!("the vhost-user-blk device {socket}: remove that first (`nvpool engine local remove {socket}`)")
            }),
        }
    }

    /// Removes every local device (the engine is stopping for good).
    pub fn remove_all(&self) {
        self.vhost.remove_all();
        let devices: Vec<_> = std::mem::take(&mut *lock(&self.devices)).into_values().collect();
        if devices.is_empty() {
            return;
        }
        if let Ok(control) = self.ublk_control() {
            for d in devices {
                let _ = self.end_device(&control, d, true);
            }
        }
    }

    /// Takes back, on a thread of its own, the local devices of the process this one
    /// took over from, once that process has let go of them.
    pub fn recover(self: &Arc<LocalDevices>, devices: Vec<LocalDeviceConfig>) {
        if devices.is_empty() {
            return;
        }
        let local = self.clone();
        let _ = std::thread::Builder::new().name("nvpool-local-recovery".into()).spawn(move || {
            for d in devices {
                let mut tries = 0;
                loop {
                    match local.add(&d) {
                        Ok(info) => {
                            tracing::info!(device = info.device, "took the local device back");
                            break;
                        }
                        // The old process may still be on its way out.
                        Err(e) if e.kind == ErrorKind::FailedPrecondition && tries < 3 => tries += 1,
                        Err(e) => {
                            tracing::error!(target = d.target, "cannot take a local device back: {e}");
                            break;
                        }
                    }
                }
            }
        });
    }
}

//! vhost-user-blk: a namespace served to a virtual machine as a virtio block device.
//! QEMU (or cloud-hypervisor) connects to the device's Unix socket and speaks the
//! vhost-user protocol (`docs/interop/vhost-user.rst`); this module answers it on a
//! thread of the device's own, with the `vhost` crate's message handling. Each
//! virtqueue, once QEMU has set it up, is served on a reactor (`reactor/vhost.rs`):
//! the reactor reads the guest's kicks on its ring, takes requests from the guest's
//! memory, serves them from the namespace's backend and signals completions.
//!
//! An engine restart must not fail the guest's I/O. QEMU keeps the inflight region
//! ([`InflightQueue`]) the engine gave it and hands it to the next engine process it
//! reconnects to; the requests recorded there as taken and not completed are served
//! again, in the order they were taken.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::ErrorKind as IoErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nvpool_api::{LocalDeviceConfig, LocalDeviceInfo};
use vhost::VhostUserMemoryRegionBase;
use vhost::vhost_user::message::{
    VhostTransferStateDirection, VhostTransferStatePhase, VhostUserConfigFlags, VhostUserInflight, VhostUserLog,
    VhostUserMemoryRegion, VhostUserProtocolFeatures, VhostUserShMemConfig, VhostUserSharedMsg,
    VhostUserSingleMemoryRegion, VhostUserVringAddrFlags, VhostUserVringState,
};
use vhost::vhost_user::{BackendReqHandler, GpuBackend, VhostUserBackendReqHandlerMut};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use super::vhost_queue::{Stop, VhostQueue};
use super::virtio_blk::{Geometry, feature};
use crate::error::{Error, Result};
use crate::nvme::{MAX_TRANSFER, Subsystem};
use crate::reactor::{Links, ReactorLink};
use crate::ring::{Mail, new_client_key};
use crate::sync::lock;

type VhostResult<T> = vhost::vhost_user::Result<T>;

/// Most virtqueues a device offers (QEMU's `num-queues` may ask for fewer).
const MAX_QUEUES: u16 = 16;
/// How often a session waiting on a reactor (to start a virtqueue, or to drain one)
/// says it is still waiting.
const RING_PATIENCE: Duration = Duration::from_secs(10);

/// A vhost-user-blk device this engine serves.
pub struct VhostDevice {
    /// The Unix socket QEMU connects to.
    pub socket: PathBuf,
    /// The subsystem of the namespace it serves.
    pub subsystem: Arc<Subsystem>,
    /// The namespace it serves.
    pub nsid: u32,
    /// Whether writes are refused.
    pub read_only: bool,
    /// Virtqueues offered.
    pub queues: u16,
    config: LocalDeviceConfig,
    /// Set when the device is removed: its thread stops accepting.
    removing: AtomicBool,
    /// The connected frontend's socket, to end the session when the device goes.
    session: Mutex<Option<UnixStream>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl VhostDevice {
    /// What the guest sees, from the namespace as it is now.
    pub fn geometry(&self) -> Option<Geometry> {
        let ns = self.subsystem.namespaces().get(&self.nsid).cloned()?;
        Some(Geometry {
            size: ns.blocks << ns.block_shift,
            block_shift: ns.block_shift,
            max_request: MAX_TRANSFER as u32,
            queues: self.queues,
            read_only: self.read_only,
        })
    }

    /// The serial a GET_ID request answers.
    pub fn target(&self) -> String {
        format!("{}/{}", self.subsystem.nqn, self.nsid)
    }

    fn info(&self) -> LocalDeviceInfo {
        let g = self.geometry();
        let connected = lock(&self.session).is_some();
        LocalDeviceInfo {
            kind: "vhost-user-blk".into(),
            device: self.socket.display().to_string(),
            ublk_id: None,
            target: self.target(),
            size: g.map_or(0, |g| g.size),
            block_size: g.map_or(0, |g| 1 << g.block_shift),
            read_only: self.read_only,
            queues: self.queues,
            queue_depth: 0,
            data_path: format!(
                "copy: each request's data moves between guest memory and an engine buffer ({})",
                if connected { "a frontend is connected" } else { "no frontend connected" }
            ),
            recovered: false,
        }
    }
}

impl std::fmt::Debug for VhostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vhost-user-blk {} ({}/{})", self.socket.display(), self.subsystem.nqn, self.nsid)
    }
}

/// The engine's vhost-user-blk devices, by socket path.
pub struct VhostDevices {
    links: Links,
    devices: Mutex<BTreeMap<PathBuf, Arc<VhostDevice>>>,
}

/// The call eventfd of a running virtqueue. QEMU may replace it while the queue runs
/// (when the guest masks the interrupt); the reactor reads the descriptor for each
/// signal, and the session keeps every file it was given open until the queue stops,
/// so the number the reactor read is never closed under it.
pub struct Call {
    fd: AtomicI32,
}

impl Call {
    /// The descriptor to signal, or -1 for none.
    pub fn fd(&self) -> i32 {
        self.fd.load(Ordering::Acquire)
    }
}

/// What a reactor needs to serve one virtqueue.
pub struct Ring {
    /// Names this run of the queue, for stopping it.
    pub id: u64,
    /// The device.
    pub device: Arc<VhostDevice>,
    /// Which virtqueue.
    pub index: u16,
    /// Entries.
    pub size: u16,
    /// Guest addresses of the descriptor table, available ring and used ring.
    pub desc: u64,
    /// See `desc`.
    pub avail: u64,
    /// See `desc`.
    pub used: u64,
    /// Where to take the next request from in the available ring.
    pub base: u16,
    /// The guest's memory.
    pub memory: Arc<GuestMemoryMmap>,
    /// Written by the guest (through QEMU or KVM) when it adds requests.
    pub kick: File,
    /// Signalled when requests complete.
    pub call: Arc<Call>,
    /// Where taken and completed requests are recorded for the next process.
    pub inflight: Option<InflightQueue>,
    /// What the guest sees.
    pub geometry: Geometry,
}

// ----- the inflight region ------------------------------------------------------------

/// Bytes of a queue's inflight header: features u64, version u16, desc_num u16,
/// last_batch_head u16, used_idx u16.
const INFLIGHT_HEADER: u64 = 16;
/// Bytes per descriptor: inflight u8, padding, next u16 (at 6), counter u64 (at 8).
const INFLIGHT_DESC: u64 = 16;
const INFLIGHT_VERSION: u16 = 1;

/// Bytes of one queue's part of the inflight region, aligned as QEMU's own backends do.
fn inflight_queue_bytes(queue_size: u16) -> u64 {
    (INFLIGHT_HEADER + INFLIGHT_DESC * u64::from(queue_size)).next_multiple_of(64)
}

/// One virtqueue's part of the inflight region (the split-ring layout of the
/// vhost-user spec): which descriptor heads were taken and not yet completed, with a
/// counter giving the order they were taken in.
pub struct InflightQueue {
    region: Arc<GuestMemoryMmap>,
    base: u64,
    size: u16,
    counter: u64,
}

impl InflightQueue {
    fn at(&self, field: u64) -> GuestAddress {
        GuestAddress(self.base + field)
    }

    fn desc(&self, head: u16, field: u64) -> GuestAddress {
        self.at(INFLIGHT_HEADER + INFLIGHT_DESC * u64::from(head) + field)
    }

    fn read<T: vm_memory::ByteValued + Default>(&self, a: GuestAddress) -> T {
        self.region.read_obj(a).unwrap_or_default()
    }

    fn write<T: vm_memory::ByteValued>(&self, v: T, a: GuestAddress) {
        // The region was sized for this queue when it was mapped: writes stay inside.
        let _ = self.region.write_obj(v, a);
    }

    /// Makes the record agree with the guest's used index and returns the heads taken
    /// and not completed, in the order they were taken. A fresh region (or one for
    /// another ring size) starts empty.
    pub fn recover(&mut self, guest_used: u16) -> Vec<u16> {
        let valid = self.read::<u16>(self.at(8)) == INFLIGHT_VERSION && self.read::<u16>(self.at(10)) == self.size;
        if !valid {
            for head in 0..self.size {
                self.write(0u8, self.desc(head, 0));
                self.write(0u64, self.desc(head, 8));
            }
            self.write(INFLIGHT_VERSION, self.at(8));
            self.write(self.size, self.at(10));
            self.write(guest_used, self.at(14));
            self.counter = 0;
            return Vec::new();
        }
        if self.read::<u16>(self.at(14)) != guest_used {
            // The process stopped between publishing a completion and recording it:
            // the last completed head is done.
            let last = self.read::<u16>(self.at(12));
            if last < self.size {
                self.write(0u8, self.desc(last, 0));
            }
            self.write(guest_used, self.at(14));
        }
        let mut pending: Vec<(u64, u16)> = (0..self.size)
            .filter(|&h| self.read::<u8>(self.desc(h, 0)) == 1)
            .map(|h| (self.read::<u64>(self.desc(h, 8)), h))
            .collect();
        pending.sort_unstable();
        self.counter = pending.last().map_or(0, |&(c, _)| c);
        pending.into_iter().map(|(_, h)| h).collect()
    }

    /// Records that `head` was taken.
    pub fn taken(&mut self, head: u16) {
        self.counter += 1;
        self.write(self.counter, self.desc(head, 8));
        self.write(1u8, self.desc(head, 0));
    }

    /// Records, before the used ring shows it, that `head` is completing.
    pub fn completing(&self, head: u16) {
        self.write(head, self.at(12));
    }

    /// Records that the used ring now shows `head` complete, at used index `used`.
    pub fn completed(&self, head: u16, used: u16) {
        self.write(0u8, self.desc(head, 0));
        self.write(used, self.at(14));
    }
}

/// A file in shared memory of `len` bytes, for QEMU to map too.
fn shared_memory_file(len: u64) -> std::io::Result<File> {
    let open = |dir: &Path| {
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_TMPFILE).mode(0o600).open(dir)
    };
    let file = open(Path::new("/dev/shm")).or_else(|_| open(&std::env::temp_dir()))?;
    file.set_len(len)?;
    Ok(file)
}

// ----- the session with a frontend --------------------------------------------------

/// What the frontend has said about one virtqueue.
#[derive(Default)]
struct VringSetup {
    size: u16,
    /// Frontend (QEMU process) addresses of the descriptor table, used and available
    /// rings.
    desc: u64,
    used: u64,
    avail: u64,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    enabled: bool,
    /// Where it runs, while it runs.
    running: Option<Running>,
}

struct Running {
    id: u64,
    reactor: usize,
    call: Arc<Call>,
    /// Call files given while it runs, kept open until it stops (see [`Call`]).
    old_calls: Vec<File>,
}

/// One frontend connection's state.
struct Session {
    device: Arc<VhostDevice>,
    links: Arc<Vec<ReactorLink>>,
    acked_features: u64,
    memory: Option<Arc<GuestMemoryMmap>>,
    /// (frontend address, guest address, size) of each memory region: ring addresses
    /// come as frontend addresses.
    regions: Vec<(u64, u64, u64)>,
    vrings: Vec<VringSetup>,
    inflight: Option<InflightRegion>,
}

/// The inflight region QEMU keeps for the device: one part per virtqueue.
struct InflightRegion {
    memory: Arc<GuestMemoryMmap>,
    queue_size: u16,
    len: u64,
}

fn refused(what: &'static str) -> vhost::vhost_user::Error {
    vhost::vhost_user::Error::InvalidOperation(what)
}

impl Session {
    fn new(device: Arc<VhostDevice>, links: Arc<Vec<ReactorLink>>) -> Session {
        let vrings = (0..device.queues).map(|_| VringSetup::default()).collect();
        Session { device, links, acked_features: 0, memory: None, regions: Vec::new(), vrings, inflight: None }
    }

    fn vring(&mut self, index: u32) -> VhostResult<&mut VringSetup> {
        self.vrings.get_mut(index as usize).ok_or(vhost::vhost_user::Error::InvalidParam)
    }

    fn guest_address(&self, frontend: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|&&(ua, _, size)| frontend >= ua && frontend - ua < size)
            .map(|&(ua, gpa, _)| gpa + (frontend - ua))
    }

    /// Starts virtqueue `index` on its reactor once everything it needs is known.
    fn try_start(&mut self, index: usize) -> VhostResult<()> {
        let (Some(memory), Some(geometry)) = (self.memory.clone(), self.device.geometry()) else { return Ok(()) };
        let v = &self.vrings[index];
        if v.running.is_some() || !v.enabled || v.size == 0 || v.kick.is_none() {
            return Ok(());
        }
        let (Some(desc), Some(avail), Some(used)) =
            (self.guest_address(v.desc), self.guest_address(v.avail), self.guest_address(v.used))
        else {
            return Err(refused("a ring address lies outside guest memory"));
        };
        let inflight = self.inflight.as_ref().and_then(|r| {
            let bytes = inflight_queue_bytes(r.queue_size);
            let base = bytes * index as u64;
            (base + bytes <= r.len && r.queue_size == v.size).then(|| InflightQueue {
                region: r.memory.clone(),
                base,
                size: v.size,
                counter: 0,
            })
        });
        let v = &mut self.vrings[index];
        let kick = v.kick.as_ref().and_then(|k| k.try_clone().ok()).ok_or(refused("cannot duplicate the kick file"))?;
        let call = Arc::new(Call { fd: AtomicI32::new(v.call.as_ref().map_or(-1, |c| c.as_raw_fd())) });
        // Its run's key as a client of the reactor's ring.
        let id = new_client_key();
        let reactor = index % self.links.len();
        let ring = Ring {
            id,
            device: self.device.clone(),
            index: index as u16,
            size: v.size,
            desc,
            avail,
            used,
            base: v.base,
            memory,
            kick,
            call: call.clone(),
            inflight,
            geometry,
        };
        let (tx, rx) = mpsc::channel();
        self.links[reactor].run(move |r| {
            let made = VhostQueue::new(Box::new(ring));
            let _ = tx.send(made.map(|queue| {
                r.ring.add_client(id, Box::new(queue));
            }));
        });
        // Waited for however long it takes: a run the session stopped waiting for would
        // still start later, beside the next one on the same ring.
        match wait_for_reactor(&rx, &self.device, index, "to take the virtqueue") {
            Some(Ok(())) => {
                v.running = Some(Running { id, reactor, call, old_calls: Vec::new() });
                tracing::debug!(device = ?self.device, queue = index, reactor, "virtqueue serving");
                Ok(())
            }
            Some(Err(e)) => {
                tracing::warn!(device = ?self.device, queue = index, "cannot serve a virtqueue: {e}");
                Err(refused("the virtqueue is not valid"))
            }
            None => Err(refused("a reactor ended before it took its virtqueue")),
        }
    }

    /// Stops virtqueue `index` once the requests it took are complete; returns where
    /// it stopped in the available ring.
    fn stop(&mut self, index: usize) -> u16 {
        let v = &mut self.vrings[index];
        let Some(running) = v.running.take() else { return v.base };
        let (tx, rx) = mpsc::channel();
        // A virtqueue that ended already is not there: the sender goes, and so does the wait.
        self.links[running.reactor].mail(Mail::Client { key: running.id, message: Box::new(Stop(tx)) });
        // Until the run has ended, it may still take requests, write guest memory and
        // signal the call files `running` keeps open: only then may the ring be
        // handed on, or the files closed.
        if let Some(next) = wait_for_reactor(&rx, &self.device, index, "to drain the virtqueue") {
            v.base = next;
        }
        drop(running);
        v.base
    }

    fn stop_all(&mut self) -> Vec<usize> {
        let running: Vec<usize> = (0..self.vrings.len()).filter(|&i| self.vrings[i].running.is_some()).collect();
        for &i in &running {
            self.stop(i);
        }
        running
    }
}

/// Waits for a reactor's answer about virtqueue `index`, saying every [`RING_PATIENCE`]
/// that it still waits; `None` if the reactor dropped the question unanswered.
fn wait_for_reactor<T>(rx: &mpsc::Receiver<T>, device: &VhostDevice, index: usize, what: &str) -> Option<T> {
    let mut waited = Duration::ZERO;
    loop {
        match rx.recv_timeout(RING_PATIENCE) {
            Ok(answer) => return Some(answer),
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                waited += RING_PATIENCE;
                tracing::warn!(device = ?device, queue = index, "still waiting for a reactor {what} ({} s)", waited.as_secs());
            }
        }
    }
}

impl VhostUserBackendReqHandlerMut for Session {
    fn set_owner(&mut self) -> VhostResult<()> {
        Ok(())
    }

    fn reset_owner(&mut self) -> VhostResult<()> {
        self.reset_device()
    }

    fn reset_device(&mut self) -> VhostResult<()> {
        self.stop_all();
        let (device, links) = (self.device.clone(), self.links.clone());
        *self = Session::new(device, links);
        Ok(())
    }

    fn get_features(&mut self) -> VhostResult<u64> {
        self.device.geometry().map(|g| g.features()).ok_or(refused("the namespace is gone"))
    }

    fn set_features(&mut self, features: u64) -> VhostResult<()> {
        self.acked_features = features;
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        regions: &[VhostUserMemoryRegion],
        files: Vec<File>,
        _postcopy: Option<bool>,
    ) -> VhostResult<Option<Vec<VhostUserMemoryRegionBase>>> {
        let mut mapped = Vec::with_capacity(regions.len());
        let mut table = Vec::with_capacity(regions.len());
        for (r, file) in regions.iter().zip(files) {
            let map = MmapRegion::from_file(FileOffset::new(file, r.mmap_offset), r.memory_size as usize)
                .map_err(|_| refused("cannot map a guest memory region"))?;
            mapped.push(
                GuestRegionMmap::new(map, GuestAddress(r.guest_phys_addr))
                    .ok_or(refused("a guest memory region overflows"))?,
            );
            table.push((r.user_addr, r.guest_phys_addr, r.memory_size));
        }
        let memory = GuestMemoryMmap::from_regions(mapped).map_err(|_| refused("guest memory regions overlap"))?;
        // Running queues move to the new memory where they stopped.
        let running = self.stop_all();
        self.memory = Some(Arc::new(memory));
        self.regions = table;
        for i in running {
            self.try_start(i)?;
        }
        Ok(None)
    }

    fn set_vring_num(&mut self, index: u32, num: u32) -> VhostResult<()> {
        if num == 0 || num > 32768 || !num.is_power_of_two() {
            return Err(vhost::vhost_user::Error::InvalidParam);
        }
        self.vring(index)?.size = num as u16;
        Ok(())
    }

    fn set_vring_addr(
        &mut self,
        index: u32,
        _flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        _log: u64,
    ) -> VhostResult<()> {
        let v = self.vring(index)?;
        (v.desc, v.used, v.avail) = (descriptor, used, available);
        Ok(())
    }

    fn set_vring_base(&mut self, index: u32, base: u32) -> VhostResult<()> {
        self.vring(index)?.base = base as u16;
        Ok(())
    }

    fn get_vring_base(&mut self, index: u32) -> VhostResult<VhostUserVringState> {
        self.vring(index)?;
        let next = self.stop(index as usize);
        // A stopped ring waits for a new kick file before it runs again.
        let v = self.vring(index)?;
        v.kick = None;
        v.enabled = false;
        Ok(VhostUserVringState::new(index, u32::from(next)))
    }

    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let protocol = self.acked_features & feature::PROTOCOL_FEATURES != 0;
        let v = self.vring(u32::from(index))?;
        v.kick = fd;
        // Without the protocol features a ring runs once it has its kick.
        if !protocol {
            v.enabled = true;
        }
        self.try_start(usize::from(index))
    }

    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> VhostResult<()> {
        let v = self.vring(u32::from(index))?;
        if let Some(running) = v.running.as_mut() {
            running.call.fd.store(fd.as_ref().map_or(-1, |f| f.as_raw_fd()), Ordering::Release);
            if let Some(old) = v.call.take() {
                running.old_calls.push(old);
            }
        }
        v.call = fd;
        Ok(())
    }

    fn set_vring_err(&mut self, _index: u8, _fd: Option<File>) -> VhostResult<()> {
        Ok(())
    }

    fn get_protocol_features(&mut self) -> VhostResult<VhostUserProtocolFeatures> {
        Ok(VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::INFLIGHT_SHMFD)
    }

    fn set_protocol_features(&mut self, _features: u64) -> VhostResult<()> {
        Ok(())
    }

    fn get_queue_num(&mut self) -> VhostResult<u64> {
        Ok(u64::from(self.device.queues))
    }

    fn set_vring_enable(&mut self, index: u32, enable: bool) -> VhostResult<()> {
        self.vring(index)?.enabled = enable;
        if enable {
            self.try_start(index as usize)
        } else {
            self.stop(index as usize);
            Ok(())
        }
    }

    fn get_config(&mut self, offset: u32, size: u32, _flags: VhostUserConfigFlags) -> VhostResult<Vec<u8>> {
        let config = self.device.geometry().ok_or(refused("the namespace is gone"))?.config();
        let mut out = vec![0u8; size as usize];
        let from = (offset as usize).min(config.len());
        let n = (config.len() - from).min(out.len());
        out[..n].copy_from_slice(&config[from..from + n]);
        Ok(out)
    }

    fn set_config(&mut self, _offset: u32, _buf: &[u8], _flags: VhostUserConfigFlags) -> VhostResult<()> {
        Err(refused("the configuration space is read-only"))
    }

    fn set_gpu_socket(&mut self, _gpu: GpuBackend) -> VhostResult<()> {
        Err(refused("not a GPU"))
    }

    fn get_shared_object(&mut self, _uuid: VhostUserSharedMsg) -> VhostResult<File> {
        Err(refused("no shared objects"))
    }

    fn get_inflight_fd(&mut self, asked: &VhostUserInflight) -> VhostResult<(VhostUserInflight, File)> {
        let len = inflight_queue_bytes(asked.queue_size) * u64::from(asked.num_queues);
        let file = shared_memory_file(len).map_err(|_| refused("cannot make the inflight region"))?;
        let ours = file.try_clone().map_err(|_| refused("cannot duplicate the inflight file"))?;
        self.map_inflight(ours, 0, len, asked.queue_size)?;
        Ok((VhostUserInflight::new(len, 0, asked.num_queues, asked.queue_size), file))
    }

    fn set_inflight_fd(&mut self, given: &VhostUserInflight, file: File) -> VhostResult<()> {
        self.map_inflight(file, given.mmap_offset, given.mmap_size, given.queue_size)?;
        tracing::info!(device = ?self.device, queues = given.num_queues, "inflight region set by the frontend");
        Ok(())
    }

    fn get_max_mem_slots(&mut self) -> VhostResult<u64> {
        Err(refused("memory slots are not offered"))
    }

    fn add_mem_region(
        &mut self,
        _region: &VhostUserSingleMemoryRegion,
        _fd: File,
        _postcopy: Option<bool>,
    ) -> VhostResult<Option<VhostUserMemoryRegionBase>> {
        Err(refused("memory slots are not offered"))
    }

    fn remove_mem_region(&mut self, _region: &VhostUserSingleMemoryRegion) -> VhostResult<()> {
        Err(refused("memory slots are not offered"))
    }

    fn set_device_state_fd(
        &mut self,
        _direction: VhostTransferStateDirection,
        _phase: VhostTransferStatePhase,
        _fd: File,
    ) -> VhostResult<Option<File>> {
        Err(refused("device state transfer is not offered"))
    }

    fn check_device_state(&mut self) -> VhostResult<()> {
        Err(refused("device state transfer is not offered"))
    }

    fn get_shmem_config(&mut self) -> VhostResult<VhostUserShMemConfig> {
        Err(refused("no shared memory regions"))
    }

    fn set_log_base(&mut self, _log: &VhostUserLog, _file: File) -> VhostResult<()> {
        Err(refused("dirty logging is not offered"))
    }
}

impl Session {
    fn map_inflight(&mut self, file: File, offset: u64, len: u64, queue_size: u16) -> VhostResult<()> {
        if queue_size == 0 || len < inflight_queue_bytes(queue_size) {
            return Err(vhost::vhost_user::Error::InvalidParam);
        }
        let map = MmapRegion::from_file(FileOffset::new(file, offset), len as usize)
            .map_err(|_| refused("cannot map the inflight region"))?;
        let region = GuestRegionMmap::new(map, GuestAddress(0)).ok_or(refused("the inflight region overflows"))?;
        let memory =
            GuestMemoryMmap::from_regions(vec![region]).map_err(|_| refused("cannot use the inflight region"))?;
        self.inflight = Some(InflightRegion { memory: Arc::new(memory), queue_size, len });
        Ok(())
    }
}

/// Accepts frontends on the device's socket, one at a time, until the device is
/// removed.
fn serve(device: Arc<VhostDevice>, links: Arc<Vec<ReactorLink>>, listener: UnixListener) {
    while !device.removing.load(Ordering::Acquire) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == IoErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                tracing::warn!(device = ?device, "cannot accept a vhost-user frontend: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        if stream.set_nonblocking(false).is_err() {
            continue;
        }
        *lock(&device.session) = stream.try_clone().ok();
        // A removal between accept and here would miss this session: look again.
        if device.removing.load(Ordering::Acquire) {
            break;
        }
        tracing::info!(device = ?device, "vhost-user frontend connected");
        let session = Arc::new(Mutex::new(Session::new(device.clone(), links.clone())));
        let mut handler = BackendReqHandler::from_stream(stream, session.clone());
        let ended = loop {
            if let Err(e) = handler.handle_request() {
                break e;
            }
        };
        lock(&session).stop_all();
        *lock(&device.session) = None;
        match ended {
            vhost::vhost_user::Error::Disconnected | vhost::vhost_user::Error::PartialMessage => {
                tracing::info!(device = ?device, "vhost-user frontend disconnected")
            }
            e => tracing::warn!(device = ?device, "vhost-user session ended: {e}"),
        }
    }
    let _ = std::fs::remove_file(&device.socket);
}

impl VhostDevices {
    /// No device yet; the devices' queues go to the reactors of `links`.
    pub fn new(links: Links) -> VhostDevices {
        VhostDevices { links, devices: Mutex::new(BTreeMap::new()) }
    }

    /// Serves a namespace to virtual machines at a vhost-user-blk socket.
    pub(super) fn add(
        &self,
        cfg: &LocalDeviceConfig,
        socket: &str,
        subsystem: Arc<Subsystem>,
        nsid: u32,
    ) -> Result<LocalDeviceInfo> {
        if cfg.ublk_id.is_some() || cfg.queue_depth.is_some() {
            return Err(Error::invalid(
                "ublk_id and queue_depth are for ublk devices: a vhost-user-blk device's queues are the ones QEMU sets up",
            ));
        }
        let path = PathBuf::from(socket);
        if lock(&self.devices).contains_key(&path) {
            return Err(Error::exists(format!("this engine already serves {socket}")));
        }
        // A socket left by an engine that exited (or by the process a hot upgrade
        // replaces) is taken over: QEMU reconnects to the path.
        match std::fs::symlink_metadata(&path) {
            Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                let _ = std::fs::remove_file(&path);
            }
            Ok(_) => {
                return Err(Error::exists(format!("{socket} exists and is not a socket: choose another path")));
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(&path).map_err(|e| Error::io(format!("cannot listen on {socket}"), e))?;
        listener.set_nonblocking(true).map_err(|e| Error::io(format!("cannot listen on {socket}"), e))?;
        let queues = u16::try_from(self.links.len()).unwrap_or(MAX_QUEUES).clamp(1, MAX_QUEUES);
        let device = Arc::new(VhostDevice {
            socket: path.clone(),
            subsystem,
            nsid,
            read_only: cfg.read_only,
            queues,
            config: cfg.clone(),
            removing: AtomicBool::new(false),
            session: Mutex::new(None),
            thread: Mutex::new(None),
        });
        let (d, links) = (device.clone(), self.links.clone());
        let thread = std::thread::Builder::new()
            .name("nvpool-vhost".into())
            .spawn(move || serve(d, links, listener))
            .map_err(|e| Error::io("cannot start the vhost-user thread", e))?;
        *lock(&device.thread) = Some(thread);
        tracing::info!(device = ?device, "local device serving");
        let info = device.info();
        lock(&self.devices).insert(path, device);
        Ok(info)
    }

    /// Removes a vhost-user-blk device: the frontend's session ends once the requests
    /// it has under way are complete, and the socket goes away.
    pub fn remove(&self, socket: &str) -> Result<()> {
        let device = lock(&self.devices).remove(Path::new(socket)).ok_or_else(|| {
            Error::not_found(format!("this engine serves no {socket}: `nvpool engine local list` shows its devices"))
        })?;
        end_vhost(&device);
        Ok(())
    }

    pub(super) fn infos(&self) -> Vec<LocalDeviceInfo> {
        lock(&self.devices).values().map(|d| d.info()).collect()
    }

    pub(super) fn configs(&self) -> Vec<LocalDeviceConfig> {
        lock(&self.devices).values().map(|d| d.config.clone()).collect()
    }

    /// The socket of a vhost-user-blk device serving a namespace of `nqn` (namespace
    /// `nsid` only, if given).
    pub(super) fn device_of(&self, nqn: &str, nsid: Option<u32>) -> Option<String> {
        lock(&self.devices)
            .values()
            .find(|d| d.subsystem.nqn == nqn && nsid.is_none_or(|n| n == d.nsid))
            .map(|d| d.socket.display().to_string())
    }

    pub(super) fn remove_all(&self) {
        let devices: Vec<_> = std::mem::take(&mut *lock(&self.devices)).into_values().collect();
        for d in devices {
            end_vhost(&d);
        }
    }
}

fn end_vhost(device: &VhostDevice) {
    device.removing.store(true, Ordering::Release);
    if let Some(s) = lock(&device.session).as_ref() {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    if let Some(t) = lock(&device.thread).take() {
        let _ = t.join();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(size: u16) -> InflightQueue {
        let len = inflight_queue_bytes(size) as usize;
        let region = GuestRegionMmap::new(MmapRegion::new(len).unwrap(), GuestAddress(0)).unwrap();
        InflightQueue {
            region: Arc::new(GuestMemoryMmap::from_regions(vec![region]).unwrap()),
            base: 0,
            size,
            counter: 0,
        }
    }

    #[test]
    fn taken_requests_come_back_in_the_order_they_were_taken() {
        let mut q = queue(8);
        assert!(q.recover(0).is_empty(), "a fresh region is initialised");
        for head in [5, 2, 7] {
            q.taken(head);
        }
        q.completing(2);
        q.completed(2, 1);
        // A new process maps the same region.
        let mut next = InflightQueue { region: q.region.clone(), base: 0, size: 8, counter: 0 };
        assert_eq!(next.recover(1), vec![5, 7]);
        next.taken(1);
        assert_eq!(next.read::<u64>(next.desc(1, 8)), 4, "the counter goes on");
    }

    #[test]
    fn a_completion_published_but_not_recorded_counts_as_done() {
        let mut q = queue(4);
        q.recover(0);
        q.taken(0);
        q.taken(3);
        // The used ring shows head 3 at index 1, and the process stopped before
        // recording it.
        q.completing(3);
        let mut next = InflightQueue { region: q.region.clone(), base: 0, size: 4, counter: 0 };
        assert_eq!(next.recover(1), vec![0]);
        assert_eq!(inflight_queue_bytes(128), 2048 + 64);
    }
}

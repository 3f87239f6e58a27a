//! Disk pools and the logical volumes carved out of them.
//!
//! A pool claims one or more disks (block devices, or files standing in for them),
//! splits their space into clusters, and hands clusters to volumes: all at creation for
//! thick volumes, on first write for thin ones. The metadata (volume table and cluster
//! maps) lives on the first disk ([`journal`]); the reactors read cluster maps lock-free
//! ([`cluster_map`], through [`PoolShared`]) and ask the pool's metadata thread
//! (`meta_thread.rs`) for anything that changes them. This file holds the pool's
//! administration: creation, import, volumes, checks.
//!
//! Two rules keep volumes from ever seeing each other's data:
//! - a cluster is zeroed, and the zeroes made durable, before the record that maps it;
//! - a released cluster is reused only after every I/O that might still address it has
//!   completed. Reactors count their volume I/O in flight under one of two epochs; a
//!   release clears the map, switches the epoch and waits for the old one to drain.

pub mod alloc;
pub mod cluster_map;
pub mod format;
mod inflate;
pub mod journal;
pub mod layer_claims;
mod meta_thread;
mod shared;

use shared::InFlight;
pub use shared::{Done, MAX_REACTORS, MetaRequest, PoolDisk, PoolShared, VolumeIo};

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, mpsc};

pub use nvpool_api::{PoolInfo, VolumeInfo};

use crate::disk::Disk;
use crate::error::{Error, Result};
use crate::granules::{Granules, granule_runs, whole_granules};
use crate::sync::lock;
use alloc::FreeClusters;
use cluster_map::{GenerationRecord, VolumeMap};
use format::{BLOCK, Generations, Member, MetaLayout, PoolState, Record, Superblock, VolumeMeta};

/// Clusters of a hidden snapshot folded into its layer in one journal entry.
const FOLD_BATCH: usize = 64;
use journal::{MetaIo, MetaStore};

/// Default cluster size: the unit of thin allocation.
pub const DEFAULT_CLUSTER_SIZE: u64 = 1 << 20;
/// Smallest cluster size: an I/O (at most 128 KiB) then spans at most two clusters.
pub const MIN_CLUSTER_SIZE: u64 = 128 << 10;
/// Journal size on the first disk.
const JOURNAL_SIZE: u64 = 8 << 20;
/// Where Linux names the current boot.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// This machine's boot ID (zeroes where it has none: power losses then go unseen).
fn current_boot() -> [u8; 16] {
    let text = std::fs::read_to_string(BOOT_ID).unwrap_or_default();
    uuid::Uuid::parse_str(text.trim()).map(|u| *u.as_bytes()).unwrap_or_default()
}

/// Builds the map of volume `id` as the metadata has it, and first those of the
/// snapshots it lies over (a layer's map reads through its parent's).
fn build_map(
    state: &PoolState,
    id: u32,
    cs: u64,
    saved: &BTreeMap<u32, format::SavedRecord>,
    maps: &mut BTreeMap<u32, Arc<VolumeMap>>,
) -> Arc<VolumeMap> {
    if let Some(m) = maps.get(&id) {
        return m.clone();
    }
    let v = &state.volumes[&id];
    let parent = v.layer.parent.map(|p| build_map(state, p, cs, saved, maps));
    let m = VolumeMap::over(v.meta.size.div_ceil(cs), parent);
    for (&vc, &pc) in &v.map {
        match v.partial.get(&vc) {
            Some(held) => m.set_partial(u64::from(vc), pc, *held),
            None => m.set(u64::from(vc), pc),
        }
    }
    m.restore_generations(v.generations);
    if let Some(saved) = saved.get(&id) {
        m.restore_generation_record(&GenerationRecord {
            recorded_from: saved.recorded_from,
            written: saved.written.iter().map(|&(vc, g, _)| (u64::from(vc), g)).collect(),
            granules: saved.written.iter().map(|&(_, _, granules)| granules).collect(),
            ..GenerationRecord::default()
        });
    }
    let m = Arc::new(m);
    maps.insert(id, m.clone());
    m
}

/// The buffered descriptor the metadata goes through.
struct MetaFile(File);

impl MetaIo for MetaFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0.read_exact_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.0.write_all_at(buf, offset)
    }
    fn sync(&self) -> std::io::Result<()> {
        self.0.sync_data()
    }
}

struct Inner {
    store: MetaStore<MetaFile>,
    state: PoolState,
    free: FreeClusters,
    maps: BTreeMap<u32, Arc<VolumeMap>>,
    /// Set when metadata could not be written: the pool refuses every change after.
    failed: Option<String>,
    /// Inflations under way.
    inflating: Vec<inflate::Inflation>,
    /// Set once the pool closes or a hot upgrade's new process is to take it: the
    /// inflations stop (their next step would change what the other process reads).
    stop_inflating: bool,
}

/// An open pool.
pub struct Pool {
    /// Name.
    pub name: String,
    /// UUID.
    pub uuid: [u8; 16],
    /// Its format version (`format::VERSION`): from 2 it holds snapshots.
    version: u32,
    cluster_size: u64,
    shared: Arc<PoolShared>,
    inner: Arc<Mutex<Inner>>,
}

/// Filesystem and partition signatures (offset, bytes) a disk is checked for before it
/// is claimed.
const SIGNATURES: &[(usize, &[u8], &str)] = &[
    (1080, &[0x53, 0xEF], "an ext2/3/4 filesystem"),
    (0, b"XFSB", "an XFS filesystem"),
    (65600, b"_BHRfS_M", "a btrfs filesystem"),
    (4086, b"SWAPSPACE2", "swap space"),
    (512, b"EFI PART", "a GPT partition table"),
    (536, b"LVM2 001", "an LVM physical volume"),
    (510, &[0x55, 0xAA], "an MBR partition table"),
];

/// Options of pool creation.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// Bytes per cluster (a power of two, at least 128 KiB).
    pub cluster_size: u64,
    /// Claim disks that hold another pool or a filesystem.
    pub force: bool,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions { cluster_size: DEFAULT_CLUSTER_SIZE, force: false }
    }
}

fn read_head(path: &Path) -> Result<Vec<u8>> {
    let f = File::open(path).map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
    let mut head = vec![0u8; 128 << 10];
    let mut got = 0;
    while got < head.len() {
        match f.read_at(&mut head[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(Error::io(format!("cannot read {}", path.display()), e)),
        }
    }
    head.truncate(got);
    Ok(head)
}

fn open_meta(path: &Path) -> Result<MetaFile> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map(MetaFile)
        .map_err(|e| Error::io(format!("cannot open {} for metadata", path.display()), e))
}

fn io_err(what: &str) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(what, e)
}

impl Pool {
    /// Whether any of `paths` carries a pool's superblock (that pool's, another's or a
    /// damaged one's): such disks are imported, never claimed anew.
    pub fn any_disk_has_pool(paths: &[PathBuf]) -> Result<bool> {
        for p in paths {
            if Superblock::has_magic(&read_head(p)?) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Claims `paths` as a new pool named `name`.
    pub fn create(name: &str, paths: &[PathBuf], o: &CreateOptions) -> Result<Arc<Pool>> {
        format::check_name("pool", name).map_err(Error::invalid)?;
        if paths.is_empty() || paths.len() > format::MAX_DISKS {
            return Err(Error::invalid(format!("a pool needs 1 to {} disks", format::MAX_DISKS)));
        }
        if !o.cluster_size.is_power_of_two() || o.cluster_size < MIN_CLUSTER_SIZE || o.cluster_size > 1 << 30 {
            return Err(Error::invalid(format!(
                "cluster size {} is not valid: use a power of two from 128KiB to 1GiB",
                o.cluster_size
            )));
        }
        let mut disks_opened = Vec::new();
        for p in paths {
            let head = read_head(p)?;
            if Superblock::has_magic(&head) && !o.force {
                let owner = Superblock::decode(&head).map(|s| format!("pool {:?}", s.pool_name));
                return Err(Error::precondition(format!(
                    "{} already belongs to {}: import that pool, or pass force to claim the disk (its data is lost)",
                    p.display(),
                    owner.unwrap_or_else(|_| "a damaged nvpool pool".into())
                )));
            }
            if !o.force
                && let Some((_, _, what)) =
                    SIGNATURES.iter().find(|(off, sig, _)| head.get(*off..*off + sig.len()) == Some(*sig))
            {
                return Err(Error::precondition(format!(
                    "{} holds {what}: pass force to claim it anyway (its data is lost)",
                    p.display()
                )));
            }
            let b = Disk::open(p, None)?;
            disks_opened.push(b);
        }
        let cs = o.cluster_size;
        let raw_clusters: u64 = disks_opened.iter().map(|b| b.size() / cs).sum();
        let journal_size = JOURNAL_SIZE.min(disks_opened[0].size() / 64).max(64 * BLOCK);
        let layout = MetaLayout::for_pool(raw_clusters, journal_size, format::VERSION);
        let mut members = Vec::new();
        let mut total: u64 = 0;
        for (i, b) in disks_opened.iter().enumerate() {
            let data_offset = if i == 0 { layout.end().div_ceil(cs) * cs } else { cs };
            let clusters = b.size().saturating_sub(data_offset) / cs;
            if clusters == 0 {
                return Err(Error::invalid(format!(
                    "{} is too small: it needs at least {} bytes with {cs}-byte clusters",
                    paths[i].display(),
                    data_offset + cs
                )));
            }
            total += clusters;
            members.push(Member { uuid: *uuid::Uuid::new_v4().as_bytes(), clusters: clusters as u32, data_offset });
        }
        if total >= u64::from(u32::MAX) {
            return Err(Error::invalid("the pool would have more than 2^32 clusters: use a larger cluster size"));
        }
        let pool_uuid = *uuid::Uuid::new_v4().as_bytes();
        let meta = open_meta(&paths[0])?;
        MetaStore::format(meta, pool_uuid, layout, &PoolState::default())
            .map_err(io_err("writing the pool metadata"))?;
        // Superblocks last, the first disk's very last: a pool half created is not found.
        for i in (0..disks_opened.len()).rev() {
            let sb = Superblock {
                version: format::VERSION,
                pool_uuid,
                pool_name: name.to_string(),
                disk_index: i as u32,
                cluster_size: cs,
                meta: layout,
                members: members.clone(),
            };
            let f = open_meta(&paths[i])?;
            f.write_at(&sb.encode(), 0).and_then(|()| f.sync()).map_err(io_err("writing a superblock"))?;
        }
        Pool::import(paths)
    }

    /// Opens the pool on `paths` (all of its disks, in any order).
    pub fn import(paths: &[PathBuf]) -> Result<Arc<Pool>> {
        Pool::import_on(paths, current_boot())
    }

    /// Opens the pool as on boot `boot` of its machine.
    fn import_on(paths: &[PathBuf], boot: [u8; 16]) -> Result<Arc<Pool>> {
        if paths.is_empty() {
            return Err(Error::invalid("importing a pool needs its disks"));
        }
        let mut found: Vec<(Superblock, PathBuf)> = Vec::new();
        for p in paths {
            let head = read_head(p)?;
            let sb = Superblock::decode(&head).map_err(|e| Error::invalid(format!("{}: {e}", p.display())))?;
            found.push((sb, p.clone()));
        }
        let first = found[0].0.clone();
        if let Some((_, p)) = found.iter().find(|(s, _)| s.pool_uuid != first.pool_uuid) {
            return Err(Error::invalid(format!(
                "{} belongs to another pool than {}",
                p.display(),
                found[0].1.display()
            )));
        }
        found.sort_by_key(|(s, _)| s.disk_index);
        let expected = first.members.len();
        let have: Vec<u32> = found.iter().map(|(s, _)| s.disk_index).collect();
        if have != (0..expected as u32).collect::<Vec<_>>() {
            return Err(Error::invalid(format!(
                "pool {:?} has {expected} disks; found disk numbers {have:?}: pass every disk of the pool once",
                first.pool_name
            )));
        }
        let mut disks = Vec::new();
        let mut next = 1u32;
        for (sb, p) in &found {
            let m = &first.members[sb.disk_index as usize];
            if sb.disk_uuid() != m.uuid || sb.members != first.members {
                return Err(Error::invalid(format!(
                    "{}: its superblock disagrees with the other disks of the pool",
                    p.display()
                )));
            }
            let file = Disk::open(p, None)?;
            disks.push(PoolDisk {
                file: Arc::new(file),
                path: p.clone(),
                first: next,
                clusters: m.clusters,
                data_offset: m.data_offset,
            });
            next += m.clusters;
        }
        let total = next - 1;
        let meta = open_meta(&found[0].1)?;
        let (store, mut state) = MetaStore::open(meta, first.pool_uuid, first.meta, first.cluster_size)
            .map_err(io_err(&format!("reading the metadata of pool {:?}", first.pool_name)))?;
        // Records saved at a close count only if that close finished: nothing was
        // written after them.
        let saved = std::mem::take(&mut state.saved_records);
        let saved = if state.open_boot == [0; 16] { saved } else { BTreeMap::new() };
        let used = state.used_clusters().map_err(Error::internal)?;
        if used.last().is_some_and(|&c| c > total) {
            return Err(Error::internal(format!(
                "pool {:?}: the metadata maps clusters the disks do not have",
                first.pool_name
            )));
        }
        let cs = first.cluster_size;
        state.check_layers().map_err(|e| Error::internal(format!("pool {:?}: {e}", first.pool_name)))?;
        let mut maps = BTreeMap::new();
        for &id in state.volumes.keys() {
            build_map(&state, id, cs, &saved, &mut maps);
        }
        // Left open by another boot: the machine stopped with the pool open, and its
        // disks may have lost what they cached (writes acknowledged, not yet flushed).
        let mut power_losses = state.power_losses;
        if state.open_boot != [0; 16] && state.open_boot != boot {
            power_losses += 1;
            tracing::warn!(
                pool = %first.pool_name,
                "the pool was open when its machine stopped: writes its disks had not made durable may be lost \
                 (power loss {power_losses}); replicas on it are rebuilt in full"
            );
        }
        let opened = Record::Opened { boot, power_losses };
        let (tx, rx) = mpsc::channel();
        let mut inner = Inner {
            store,
            state,
            free: FreeClusters::new(total, &used),
            maps,
            failed: None,
            inflating: Vec::new(),
            stop_inflating: false,
        };
        inner.state.apply(&opened, cs).map_err(Error::internal)?;
        let Inner { store, state, .. } = &mut inner;
        store.commit(&[opened], state).map_err(io_err(&format!("opening pool {:?}", first.pool_name)))?;
        let inner = Arc::new(Mutex::new(inner));
        let shared = Arc::new(PoolShared {
            disks,
            cluster_shift: cs.trailing_zeros(),
            epoch: AtomicU64::new(0),
            in_flight: (0..MAX_REACTORS).map(|_| InFlight::default()).collect(),
            requests: Mutex::new(tx),
            metadata: inner.clone(),
        });
        let pool = Arc::new(Pool {
            name: first.pool_name.clone(),
            uuid: first.pool_uuid,
            version: first.version,
            cluster_size: cs,
            shared,
            inner,
        });
        pool.delete_orphans(&mut lock(&pool.inner))?;
        // A fold a stop cut short goes on.
        pool.fold_hidden();
        let worker = pool.clone();
        std::thread::Builder::new()
            .name(format!("nvpool-pool-{}", pool.name))
            .spawn(move || worker.serve(rx))
            .map_err(|e| Error::internal(format!("cannot start the metadata thread: {e}")))?;
        Ok(pool)
    }

    /// Stops the metadata thread; the pool is closed once the last reference goes.
    pub fn close(&self) {
        // Replacing the sender drops the thread's only way in; it exits.
        *lock(&self.shared.requests) = mpsc::channel().0;
        lock(&self.inner).stop_inflating = true;
    }

    /// Makes every write durable and records that the pool was closed cleanly (not
    /// when a hot upgrade's new process holds it: that one writes its metadata now),
    /// with what the volumes' serving engines recorded of their generations' writes,
    /// so that a replica away across the restart still rebuilds only what it lacks.
    pub fn close_cleanly(&self) {
        self.close();
        let mut inner = lock(&self.inner);
        let mut records: Vec<Record> = inner
            .maps
            .iter()
            .filter(|(id, _)| inner.state.volumes.get(id).is_some_and(|v| v.layer.kind == format::VolumeKind::Volume))
            .filter_map(|(&id, map)| {
                let r = map.generation_record().filter(|r| r.recorded_from != 0 && !r.written.is_empty())?;
                let written = r.written.iter().zip(&r.granules).map(|(&(vc, g), &granules)| (vc as u32, g, granules));
                Some(Record::SaveRecord {
                    id,
                    record: format::SavedRecord { recorded_from: r.recorded_from, written: written.collect() },
                })
            })
            .collect();
        records.push(Record::Closed);
        let synced = self.shared.disks.iter().try_for_each(|d| d.file.sync_now()).map_err(io_err("syncing its disks"));
        // An empty journal first, so the records fit in it if they can (in a
        // checkpoint they would not be kept: the replicas away then rebuild in full).
        let closed =
            synced.and_then(|()| self.checkpoint_locked(&mut inner)).and_then(|()| self.commit(&mut inner, &records));
        if let Err(e) = closed {
            tracing::warn!(pool = %self.name, "cannot record a clean close ({e}): it opens next as after a power loss");
        }
    }

    /// Writes the whole metadata as a checkpoint, so the next open replays no journal:
    /// a hot upgrade's new process opens the pool right after, while this one holds
    /// it quiet.
    pub fn checkpoint(&self) -> Result<()> {
        let mut inner = lock(&self.inner);
        inner.stop_inflating = true;
        self.checkpoint_locked(&mut inner)
    }

    /// Takes the pool back after a hot upgrade that did not happen: inflations may
    /// start again (those the checkpoint stopped say so, and go on when started).
    pub fn take_back(&self) {
        lock(&self.inner).stop_inflating = false;
    }

    fn checkpoint_locked(&self, inner: &mut Inner) -> Result<()> {
        if let Some(why) = &inner.failed {
            return Err(Error::unavailable(format!("pool {:?} stopped taking changes: {why}", self.name)));
        }
        let Inner { store, state, .. } = inner;
        store.checkpoint(state).map_err(io_err(&format!("checkpointing pool {:?}", self.name)))
    }

    /// The paths of its disks, in pool order.
    pub fn disk_paths(&self) -> Vec<PathBuf> {
        self.shared.disks.iter().map(|d| d.path.clone()).collect()
    }

    /// Bytes per cluster.
    pub fn cluster_size(&self) -> u64 {
        self.cluster_size
    }

    /// What the reactors need of this pool.
    pub fn shared(&self) -> &Arc<PoolShared> {
        &self.shared
    }

    // ----- management ----------------------------------------------------------------

    /// Creates a volume of `size` bytes (rounded up to 4 KiB), with the namespace UUID
    /// and NGUID given, or new ones.
    pub fn create_volume(
        &self,
        name: &str,
        size: u64,
        thin: bool,
        identity: Option<([u8; 16], [u8; 16])>,
    ) -> Result<VolumeInfo> {
        format::check_name("volume", name).map_err(Error::invalid)?;
        if size == 0 {
            return Err(Error::invalid("a volume needs a size above zero"));
        }
        let size = size.div_ceil(4096) * 4096;
        let mut inner = lock(&self.inner);
        if inner.state.volume_by_name(name).is_some() {
            return Err(Error::exists(format!("pool {} already has a volume {name}: pick another name", self.name)));
        }
        if inner.state.volumes.len() as u32 >= format::MAX_VOLUMES {
            return Err(Error::precondition(format!(
                "pool {} has {} volumes, the most it can hold: delete one first",
                self.name,
                format::MAX_VOLUMES
            )));
        }
        let clusters = size.div_ceil(self.cluster_size);
        if clusters > u64::from(u32::MAX) {
            return Err(Error::invalid("the volume is too large for this cluster size"));
        }
        let id = inner.state.next_id;
        let (uuid, nguid) =
            identity.unwrap_or_else(|| (*uuid::Uuid::new_v4().as_bytes(), *uuid::Uuid::new_v4().as_bytes()));
        let meta = VolumeMeta { id, name: name.to_string(), size, thin, uuid, nguid };
        let map = Arc::new(VolumeMap::new(clusters));
        inner.maps.insert(id, map);
        let result = if thin {
            self.commit(&mut inner, &[Record::CreateVolume(meta)])
        } else {
            self.allocate_all(&mut inner, id, 0, clusters, vec![Record::CreateVolume(meta)])
        };
        if let Err(e) = result {
            inner.maps.remove(&id);
            return Err(e);
        }
        Ok(self.volume_info(&inner, id))
    }

    /// Allocates virtual clusters `from..to` of volume `id` with `before` in the same
    /// commit; fails without change when the pool has too little space.
    fn allocate_all(&self, inner: &mut Inner, id: u32, from: u64, to: u64, before: Vec<Record>) -> Result<()> {
        let need = to - from;
        if need > u64::from(inner.free.free()) {
            return Err(Error::precondition(format!(
                "pool {} has {} bytes free; this needs {}: free space, or make the volume thin",
                self.name,
                u64::from(inner.free.free()) * self.cluster_size,
                need * self.cluster_size
            )));
        }
        let new: Vec<(u32, u64, u32)> = (from..to).filter_map(|vc| inner.free.take().map(|pc| (id, vc, pc))).collect();
        self.map_durably(inner, &new, before).inspect_err(|_| {
            for &(_, _, pc) in &new {
                inner.free.put(pc);
            }
        })
    }

    fn volume_id(&self, inner: &Inner, name: &str) -> Result<u32> {
        inner.state.volume_by_name(name).map(|v| v.meta.id).ok_or_else(|| {
            Error::not_found(format!("pool {} has no volume {name}: `nvpool engine volume list` shows them", self.name))
        })
    }

    /// Deletes a volume or snapshot and frees its clusters; returns the layers that
    /// keep a snapshot hidden instead (it goes with the last of them). A hidden
    /// snapshot that nothing lies over any more goes too. The caller makes sure it is
    /// not exported.
    pub fn delete_volume(&self, name: &str) -> Result<Vec<String>> {
        let mut inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        let over: Vec<String> = inner.state.layers_over(id).map(|v| v.meta.name.clone()).collect();
        if !over.is_empty() {
            if inner.state.volumes[&id].layer.kind == format::VolumeKind::Snapshot {
                self.commit(&mut inner, &[Record::Hide { id }])?;
            }
        } else {
            self.delete_now(&mut inner, id)?;
            self.delete_orphans(&mut inner)?;
        }
        drop(inner);
        // A hidden snapshot one layer alone lies over now folds into it.
        self.fold_hidden();
        Ok(over)
    }

    fn delete_now(&self, inner: &mut Inner, id: u32) -> Result<()> {
        let vcs: Vec<u64> = inner.state.volumes[&id].map.keys().map(|&c| u64::from(c)).collect();
        self.release(inner, id, &vcs, Some(Record::DeleteVolume { id }))?;
        inner.maps.remove(&id);
        Ok(())
    }

    /// Deletes the hidden snapshots nothing lies over any more: one whose last layer
    /// just went, and those a crash left while such deletions went down a chain.
    fn delete_orphans(&self, inner: &mut Inner) -> Result<()> {
        loop {
            let orphan = inner.state.volumes.values().find(|v| {
                v.layer.kind == format::VolumeKind::Hidden && inner.state.layers_over(v.meta.id).next().is_none()
            });
            let Some(id) = orphan.map(|v| v.meta.id) else { return Ok(()) };
            self.delete_now(inner, id)?;
        }
    }

    /// Folds every hidden snapshot that one layer alone lies over into that layer:
    /// its clusters move to the layer where the layer has none, the granules the
    /// layer lacks are copied where it has one (and the snapshot's cluster is freed),
    /// and once the snapshot is empty the layer lies over its parent. Up to
    /// `FOLD_BATCH` clusters a step, each step one journal entry after which reads
    /// see what they saw before; the lock is let go between steps, so that I/O and
    /// other changes go on. The layer's map keeps the emptied snapshot's map as a
    /// parent it reads through until the pool opens again. A failure is logged: the
    /// snapshot stays hidden, and the next open tries again.
    pub fn fold_hidden(&self) {
        loop {
            let (id, layer, vcs) = {
                let inner = lock(&self.inner);
                let foldable =
                    inner.state.volumes.keys().find_map(|&h| inner.state.fold_target(h).map(|(child, _)| (h, child)));
                let Some((id, child)) = foldable else { return };
                let vcs: Vec<u64> = inner.state.volumes[&id].map.keys().take(FOLD_BATCH).map(|&vc| vc.into()).collect();
                (id, inner.maps[&child].clone(), vcs)
            };
            // Granules the layer lacks are copied into its clusters: no direct write
            // may fill them meanwhile.
            let _held_off = inflate::DirectWritesHeldOff::new(layer.clone(), vcs.clone());
            let mut inner = lock(&self.inner);
            let same_layer = inner
                .state
                .fold_target(id)
                .is_some_and(|(child, _)| inner.maps.get(&child).is_some_and(|m| Arc::ptr_eq(m, &layer)));
            if !same_layer {
                continue;
            }
            if let Err(e) = self.fold_step(&mut inner, id, &vcs) {
                let name = inner.state.volumes.get(&id).map(|v| v.meta.name.clone()).unwrap_or_default();
                tracing::error!(pool = %self.name, "folding the deleted snapshot {name} into its layer failed: {e}");
                return;
            }
        }
    }

    /// One step of `fold_hidden` for hidden snapshot `id`: those of clusters `vcs` it
    /// still has.
    fn fold_step(&self, inner: &mut Inner, id: u32, vcs: &[u64]) -> Result<()> {
        let (child, _) = inner.state.fold_target(id).ok_or_else(|| Error::internal("nothing to fold"))?;
        let snapshot_map = &inner.state.volumes[&id].map;
        if snapshot_map.is_empty() {
            self.commit(inner, &[Record::Fold { id }])?;
            inner.maps.remove(&id);
            return Ok(());
        }
        let vcs: Vec<u32> = vcs.iter().map(|&vc| vc as u32).filter(|vc| snapshot_map.contains_key(vc)).collect();
        if vcs.is_empty() {
            return Ok(());
        }
        let (snapshot, layer) = (inner.maps[&id].clone(), inner.maps[&child].clone());
        let shift = self.cluster_size.trailing_zeros();
        let mut records = Vec::new();
        let mut copier = inflate::GranuleCopier::new(self);
        // (vc, the snapshot's cluster, granules copied into the layer's; None: moved).
        let mut steps: Vec<(u32, u32, Option<Granules>)> = Vec::new();
        for vc in vcs {
            let (recs, need) = inner.state.fold_cluster(id, vc, self.cluster_size).expect("a fold target");
            let pc = inner.state.volumes[&id].map[&vc];
            let layer_pc = inner.state.volumes[&child].map.get(&vc).copied();
            if let Some(to) = layer_pc {
                for (at, len) in granule_runs(&need, shift) {
                    copier.copy(self, pc, to, at, len, "folding a deleted snapshot")?;
                }
            }
            records.extend(recs);
            steps.push((vc, pc, layer_pc.map(|_| need)));
        }
        copier.sync(self, "syncing a fold")?;
        self.commit(inner, &records)?;
        // The layer first, then the snapshot: a reader finds the data either way.
        let whole = whole_granules(self.cluster_size);
        let mut freed = Vec::new();
        for &(vc, pc, copied) in &steps {
            let vc64 = u64::from(vc);
            match copied {
                None => match inner.state.volumes[&child].partial.get(&vc) {
                    Some(held) => layer.set_partial(vc64, pc, *held),
                    None => layer.set(vc64, pc),
                },
                Some(need) => {
                    layer.hold(vc64, need, whole);
                    freed.push(pc);
                }
            }
            snapshot.clear(vc64);
        }
        if !freed.is_empty() {
            // Reads that found the snapshot's clusters before finish before they go.
            self.shared.drain();
            for pc in freed {
                inner.free.put(pc);
            }
        }
        Ok(())
    }

    /// Grows a volume; returns its new cluster map for re-exporting.
    pub fn resize_volume(&self, name: &str, size: u64) -> Result<VolumeInfo> {
        let size = size.div_ceil(4096) * 4096;
        let mut inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        let v = inner.state.volumes[&id].meta.clone();
        if size < v.size {
            return Err(Error::invalid(format!(
                "volume {name} is {} bytes; shrinking is not supported: create a smaller volume and copy the data",
                v.size
            )));
        }
        if size == v.size {
            return Ok(self.volume_info(&inner, id));
        }
        let (old, new) = (v.size.div_ceil(self.cluster_size), size.div_ceil(self.cluster_size));
        let old_map = inner.maps[&id].clone();
        inner.maps.insert(id, Arc::new(old_map.resized(new)));
        let resize = vec![Record::ResizeVolume { id, size }];
        let r =
            if v.thin { self.commit(&mut inner, &resize) } else { self.allocate_all(&mut inner, id, old, new, resize) };
        if let Err(e) = r {
            inner.maps.insert(id, old_map);
            return Err(e);
        }
        Ok(self.volume_info(&inner, id))
    }

    /// Takes snapshot `snapshot` of volume `name`, in one journal record: the snapshot
    /// keeps the volume's clusters as they are, and the volume goes on as an empty
    /// layer over it. The caller holds the volume's I/O meanwhile (nothing in flight)
    /// and serves it afterwards with the map `open_volume` gives; a backend that still
    /// holds the old map finds the new one (`current_map`).
    ///
    /// A replica's record of what its serving generations wrote goes on with the
    /// volume (a partial rebuild from it must still see the writes made before the
    /// snapshot).
    pub fn take_snapshot(
        &self,
        name: &str,
        snapshot: &str,
        identity: Option<([u8; 16], [u8; 16])>,
    ) -> Result<VolumeInfo> {
        format::check_name("snapshot", snapshot).map_err(Error::invalid)?;
        let mut inner = lock(&self.inner);
        self.check_layers_allowed(&inner, snapshot)?;
        let id = self.volume_id(&inner, name)?;
        let v = &inner.state.volumes[&id];
        if v.layer.kind != format::VolumeKind::Volume {
            return Err(Error::invalid(format!(
                "{name} is a snapshot: take snapshots of volumes (or clone {name} and take one of the clone)"
            )));
        }
        let map = inner.maps[&id].clone();
        if map.tracking() {
            return Err(Error::precondition(format!("volume {name} is moving: take its snapshot once it has moved")));
        }
        if inner.state.chain(id).len() >= format::MAX_CHAIN {
            return Err(Error::precondition(format!(
                "volume {name} lies over {} snapshots, the most a chain holds: delete one of its snapshots first",
                format::MAX_CHAIN
            )));
        }
        let snap_id = inner.state.next_id;
        let (uuid, nguid) =
            identity.unwrap_or_else(|| (*uuid::Uuid::new_v4().as_bytes(), *uuid::Uuid::new_v4().as_bytes()));
        let meta =
            VolumeMeta { id: snap_id, name: snapshot.to_string(), size: v.meta.size, thin: v.meta.thin, uuid, nguid };
        self.commit(&mut inner, &[Record::TakeSnapshot { id, snapshot: meta }])?;
        let head = Arc::new(map.layer_over());
        if let Some(record) = map.generation_record() {
            head.restore_generation_record(&record);
        }
        map.hand_on(&head);
        inner.maps.insert(snap_id, map);
        inner.maps.insert(id, head);
        Ok(self.volume_info(&inner, snap_id))
    }

    /// Makes volume `name`, a writable layer over snapshot `snapshot` (a clone: it
    /// reads as the snapshot until written), with the identity given or a new one.
    pub fn create_clone(
        &self,
        name: &str,
        snapshot: &str,
        identity: Option<([u8; 16], [u8; 16])>,
    ) -> Result<VolumeInfo> {
        format::check_name("volume", name).map_err(Error::invalid)?;
        let mut inner = lock(&self.inner);
        self.check_layers_allowed(&inner, name)?;
        let parent = self.volume_id(&inner, snapshot)?;
        let p = &inner.state.volumes[&parent];
        if p.layer.kind != format::VolumeKind::Snapshot {
            return Err(Error::invalid(format!(
                "{snapshot} is not a snapshot: take one of it first (`nvpool engine snapshot create`)"
            )));
        }
        if inner.state.chain(parent).len() + 1 >= format::MAX_CHAIN {
            return Err(Error::precondition(format!(
                "snapshot {snapshot} lies over too many others to be cloned (a chain holds {}): delete some of them",
                format::MAX_CHAIN
            )));
        }
        let id = inner.state.next_id;
        let (uuid, nguid) =
            identity.unwrap_or_else(|| (*uuid::Uuid::new_v4().as_bytes(), *uuid::Uuid::new_v4().as_bytes()));
        let meta = VolumeMeta { id, name: name.to_string(), size: p.meta.size, thin: true, uuid, nguid };
        let clusters = p.meta.size.div_ceil(self.cluster_size);
        let map = Arc::new(VolumeMap::over(clusters, Some(inner.maps[&parent].clone())));
        self.commit(&mut inner, &[Record::CreateLayer { meta, parent }])?;
        inner.maps.insert(id, map);
        Ok(self.volume_info(&inner, id))
    }

    /// Refuses a new snapshot or clone where the pool cannot hold one, or has `name`.
    fn check_layers_allowed(&self, inner: &Inner, name: &str) -> Result<()> {
        if self.version < format::LAYERS_VERSION {
            return Err(Error::precondition(format!(
                "pool {} was made before snapshots (format {}): its metadata has no room for them; make a new pool \
                 and move the volume there",
                self.name, self.version
            )));
        }
        if inner.state.volume_by_name(name).is_some() {
            return Err(Error::exists(format!("pool {} already has a volume or snapshot {name}", self.name)));
        }
        if inner.state.volumes.len() as u32 >= format::MAX_VOLUMES {
            return Err(Error::precondition(format!(
                "pool {} holds {} volumes and snapshots, the most it can: delete one first",
                self.name,
                format::MAX_VOLUMES
            )));
        }
        Ok(())
    }

    /// The map volume `id` is served with now: a backend whose map became a
    /// snapshot's (it was opened before the snapshot) goes on with this one.
    pub fn current_map(&self, id: u32) -> Option<Arc<VolumeMap>> {
        lock(&self.inner).maps.get(&id).cloned()
    }

    /// What a namespace serving the volume needs: the data-path view and the metadata.
    pub fn open_volume(&self, name: &str) -> Result<(VolumeIo, VolumeMeta)> {
        let inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        let read_only = inner.state.volumes[&id].layer.kind != format::VolumeKind::Volume;
        let io = VolumeIo { pool: self.shared.clone(), map: inner.maps[&id].clone(), id, read_only };
        Ok((io, inner.state.volumes[&id].meta.clone()))
    }

    /// Starts or stops tracking written clusters.
    pub fn set_dirty_tracking(&self, name: &str, on: bool) -> Result<()> {
        let inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        inner.maps[&id].set_tracking(on);
        Ok(())
    }

    /// The clusters written since tracking started (or the last reset), as indexes.
    pub fn dirty_clusters(&self, name: &str, reset: bool) -> Result<Vec<u64>> {
        let inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        Ok(inner.maps[&id].dirty_clusters(reset))
    }

    fn volume_info(&self, inner: &Inner, id: u32) -> VolumeInfo {
        let v = &inner.state.volumes[&id];
        VolumeInfo {
            pool: self.name.clone(),
            name: v.meta.name.clone(),
            size: v.meta.size,
            thin: v.meta.thin,
            allocated_bytes: v.map.len() as u64 * self.cluster_size,
            uuid: uuid::Uuid::from_bytes(v.meta.uuid).to_string(),
            nguid: v.meta.nguid.iter().map(|b| format!("{b:02x}")).collect(),
            dirty_tracking: inner.maps.get(&id).is_some_and(|m| m.tracking()),
            snapshot: v.layer.kind != format::VolumeKind::Volume,
            parent: v
                .layer
                .parent
                .and_then(|p| inner.state.volumes.get(&p))
                .map(|p| p.meta.name.clone())
                .unwrap_or_default(),
            inflating: inner.inflation_of(id),
        }
    }

    /// The generation records of the volumes a generation took, by volume name.
    pub fn generation_records(&self) -> Vec<(String, GenerationRecord)> {
        let inner = lock(&self.inner);
        // A snapshot's map shares its volume's generations but writes nothing.
        let name = |id: &u32| {
            let v = inner.state.volumes.get(id).filter(|v| v.layer.kind == format::VolumeKind::Volume)?;
            Some(v.meta.name.clone())
        };
        inner.maps.iter().filter_map(|(id, map)| Some((name(id)?, map.generation_record()?))).collect()
    }

    /// Makes volume `id`'s generations as its map has them now durable, if they rose:
    /// a replica remembers across a restart which generation took it, so an engine
    /// that lost the role cannot take it again.
    pub fn persist_generations(&self, id: u32) -> Result<()> {
        let mut inner = lock(&self.inner);
        let Some(map) = inner.maps.get(&id) else { return Ok(()) };
        let now = Generations { taken: map.generation(), fenced_at: map.fenced_at() };
        // The map starts from what is stored and only rises: a difference is a rise.
        if inner.state.volumes.get(&id).is_none_or(|v| v.generations == now) {
            return Ok(());
        }
        self.commit(&mut inner, &[Record::SetGenerations { id, generations: now }])
    }

    /// How many times the pool was opened after its machine stopped with it open.
    pub fn power_losses(&self) -> u32 {
        lock(&self.inner).state.power_losses
    }

    /// Gives volume `name` back the generation record a hot upgrade handed on.
    pub fn restore_generation_record(&self, name: &str, record: &GenerationRecord) -> Result<()> {
        let inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        inner.maps[&id].restore_generation_record(record);
        Ok(())
    }

    /// Every volume.
    pub fn volumes(&self) -> Vec<VolumeInfo> {
        let inner = lock(&self.inner);
        let listed = inner.state.volumes.values().filter(|v| v.layer.kind != format::VolumeKind::Hidden);
        listed.map(|v| self.volume_info(&inner, v.meta.id)).collect()
    }

    /// Every volume's allocated bytes, as (pool, volume, bytes): what `volumes` says
    /// without the strings it formats.
    pub fn allocations(&self) -> Vec<(String, String, u64)> {
        let inner = lock(&self.inner);
        inner
            .state
            .volumes
            .values()
            .map(|v| (self.name.clone(), v.meta.name.clone(), v.map.len() as u64 * self.cluster_size))
            .collect()
    }

    /// One volume.
    pub fn volume(&self, name: &str) -> Result<VolumeInfo> {
        let inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        Ok(self.volume_info(&inner, id))
    }

    /// The pool's figures.
    pub fn info(&self) -> PoolInfo {
        let inner = lock(&self.inner);
        let cs = self.cluster_size;
        let total = u64::from(inner.free.total());
        let free = u64::from(inner.free.free());
        PoolInfo {
            name: self.name.clone(),
            uuid: uuid::Uuid::from_bytes(self.uuid).to_string(),
            disks: self.shared.disks.iter().map(|d| d.path.display().to_string()).collect(),
            cluster_size: cs,
            capacity_bytes: total * cs,
            used_bytes: (total - free) * cs,
            free_bytes: free * cs,
            provisioned_bytes: inner.state.volumes.values().map(|v| v.meta.size).sum(),
            volumes: inner.state.volumes.len(),
            failed: inner.failed.clone(),
            journal: inner.store.figures(),
            power_losses: inner.state.power_losses,
            snapshot_bytes: inner
                .state
                .volumes
                .values()
                .filter(|v| v.layer.kind != format::VolumeKind::Volume)
                .map(|v| v.map.len() as u64 * cs)
                .sum(),
        }
    }

    /// Checks the metadata against the runtime maps and the free set: every mapped
    /// cluster is used once, and used plus free is the whole pool (no leaks).
    pub fn check(&self) -> Result<()> {
        let inner = lock(&self.inner);
        let used = inner.state.used_clusters().map_err(Error::internal)?;
        inner.state.check_layers().map_err(Error::internal)?;
        if used.len() as u64 + u64::from(inner.free.free()) != u64::from(inner.free.total()) {
            return Err(Error::internal(format!(
                "{} clusters used and {} free do not add up to {}",
                used.len(),
                inner.free.free(),
                inner.free.total()
            )));
        }
        for v in inner.state.volumes.values() {
            let m = &inner.maps[&v.meta.id];
            if m.allocated() != v.map.len() as u64 {
                return Err(Error::internal(format!(
                    "volume {}: the map has clusters the metadata does not",
                    v.meta.name
                )));
            }
            for (&vc, &pc) in &v.map {
                if m.get(u64::from(vc)) != pc {
                    return Err(Error::internal(format!(
                        "volume {} cluster {vc}: the map and the metadata disagree",
                        v.meta.name
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvpool_wire::Status;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    const CLUSTER: u64 = 128 << 10;

    #[derive(Clone, Debug)]
    enum Op {
        Create(bool, u64),
        Delete(usize),
        Grow(usize, u64),
        Write(usize, u64),
        Trim(usize, u64, u64),
        Reopen,
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<bool>(), 1u64..40).prop_map(|(thin, n)| Op::Create(thin, n)),
            (0usize..6).prop_map(Op::Delete),
            (0usize..6, 1u64..10).prop_map(|(v, n)| Op::Grow(v, n)),
            (0usize..6, 0u64..60).prop_map(|(v, c)| Op::Write(v, c)),
            (0usize..6, 0u64..60, 1u64..5).prop_map(|(v, c, n)| Op::Trim(v, c, n)),
            Just(Op::Reopen),
        ]
    }

    /// What the model expects of one volume.
    #[derive(Clone, Debug)]
    struct Expect {
        clusters: u64,
        thin: bool,
        allocated: BTreeSet<u64>,
    }

    fn ask(pool: &Pool, req: impl FnOnce(Done) -> MetaRequest) -> Status {
        let (tx, rx) = mpsc::channel();
        pool.shared().request(req(Box::new(move |s| tx.send(s).unwrap())));
        rx.recv().unwrap()
    }

    fn two_disks(dir: &Path) -> Vec<PathBuf> {
        (0..2)
            .map(|i| {
                let p = dir.join(format!("d{i}"));
                File::create(&p).unwrap().set_len(12 << 20).unwrap();
                p
            })
            .collect()
    }

    /// A pool on two new disks in `dir` with a thick volume `v` of `clusters` clusters
    /// (every one under the snapshot, for the clone to take), its snapshot `s` and a
    /// clone `c` of that.
    fn clone_of_thick_volume(dir: &Path, clusters: u64) -> Arc<Pool> {
        let pool = Pool::create("i", &two_disks(dir), &CreateOptions { cluster_size: CLUSTER, force: false }).unwrap();
        pool.create_volume("v", clusters * CLUSTER, false, None).unwrap();
        pool.take_snapshot("v", "s", None).unwrap();
        pool.create_clone("c", "s", None).unwrap();
        pool
    }

    #[test]
    fn a_hot_upgrades_checkpoint_stops_inflations_until_the_pool_is_taken_back() {
        let dir = tempfile::tempdir().unwrap();
        let pool = clone_of_thick_volume(dir.path(), 2);
        pool.checkpoint().unwrap();
        let refused = pool.inflate_volume("c").unwrap_err().to_string();
        assert!(refused.contains("hot upgrade"), "{refused}");
        pool.take_back();
        pool.inflate_volume("c").unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !pool.volume("c").unwrap().parent.is_empty() {
            assert!(std::time::Instant::now() < deadline, "{:?}", pool.volume("c"));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(pool.volume("c").unwrap().allocated_bytes, 2 * CLUSTER);
        pool.check().unwrap();
    }

    /// A snapshot taken of a volume while it inflates takes the map the inflation
    /// fills, so the inflation goes on with the snapshot: either way, what the volume
    /// came from lies under nothing once it is done, and its deletion frees it whole.
    #[test]
    fn a_snapshot_taken_while_a_clone_inflates_is_inflated_in_its_place() {
        let dir = tempfile::tempdir().unwrap();
        let pool = clone_of_thick_volume(dir.path(), 64);
        pool.inflate_volume("c").unwrap();
        pool.take_snapshot("c", "cs", None).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let under_way = |name: &str| pool.volume(name).unwrap().inflating.is_some_and(|p| p.stopped.is_none());
        while under_way("c") || under_way("cs") {
            assert!(std::time::Instant::now() < deadline, "{:?} {:?}", pool.volume("c"), pool.volume("cs"));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        for name in ["c", "cs"] {
            let got = pool.volume(name).unwrap();
            assert!(got.inflating.is_none(), "{name} stopped: {got:?}");
        }
        assert_eq!(pool.volume("cs").unwrap().parent, "", "the snapshot of the clone lies over nothing");
        assert_eq!(pool.volume("c").unwrap().parent, "cs");
        pool.delete_volume("v").unwrap();
        assert!(pool.delete_volume("s").unwrap().is_empty(), "nothing lies over s any more");
        assert!(pool.volume("s").is_err(), "s is gone, not hidden");
        pool.check().unwrap();
    }

    #[test]
    fn a_replicas_generations_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let disks = two_disks(dir.path());
        let pool = Pool::create("g", &disks, &CreateOptions { cluster_size: CLUSTER, force: false }).unwrap();
        pool.create_volume("r", 4 * CLUSTER, true, None).unwrap();
        let (io, _) = pool.open_volume("r").unwrap();
        io.map.fence(7);
        pool.persist_generations(io.id).unwrap();
        // Raised in memory only: not what a restart finds.
        io.map.take_generation(9);
        pool.close();
        drop((pool, io));
        let pool = Pool::import(&disks).unwrap();
        let (io, _) = pool.open_volume("r").unwrap();
        assert_eq!((io.map.generation(), io.map.fenced_at()), (7, 7));
        // An older generation cannot take it again.
        assert_eq!(io.map.take_generation(6), 7);
        pool.check().unwrap();
    }

    #[test]
    fn the_record_of_what_generations_wrote_is_kept_by_a_clean_close_only() {
        let dir = tempfile::tempdir().unwrap();
        let disks = two_disks(dir.path());
        let pool = Pool::create("w", &disks, &CreateOptions { cluster_size: CLUSTER, force: false }).unwrap();
        pool.create_volume("r", 2048 * CLUSTER, true, None).unwrap();
        let (io, _) = pool.open_volume("r").unwrap();
        io.map.take_generation(3);
        io.map.start_record(3);
        // Cluster 1 written at generation 3; cluster 1500 written at 4 and released:
        // its page has no mapping when the pool opens again, and the record must
        // still name it (the replica that lacks it deallocates it too).
        for (vc, generation, granules) in [(1, 3, [1, 0, 0, 0]), (1500, 4, [0, 2, 0, 0])] {
            let st = ask(&pool, |done| MetaRequest::Allocate { volume: io.id, first: vc, count: 1, done });
            assert_eq!(st, Status::SUCCESS);
            io.map.mark_generation(vc, generation, granules);
        }
        let ranges = vec![(1500 * CLUSTER, CLUSTER)];
        assert_eq!(ask(&pool, |done| MetaRequest::Zero { volume: io.id, ranges, done }), Status::SUCCESS);
        let written = |pool: &Pool| {
            let (io, _) = pool.open_volume("r").unwrap();
            (io.map.records_since(4), io.map.written_since(4))
        };
        pool.close_cleanly();
        drop((pool, io));
        let pool = Pool::import(&disks).unwrap();
        assert_eq!(written(&pool), (true, vec![(1500, [0, 2, 0, 0])]));
        // Opened again and stopped without a clean close: what it saved then is gone
        // (it was written to after).
        pool.close();
        drop(pool);
        let pool = Pool::import(&disks).unwrap();
        assert_eq!(written(&pool), (false, vec![]));
        pool.check().unwrap();
    }

    #[test]
    fn a_pool_left_open_by_another_boot_counts_a_power_loss() {
        let dir = tempfile::tempdir().unwrap();
        let disks = two_disks(dir.path());
        let o = CreateOptions { cluster_size: CLUSTER, force: false };
        let (boot_a, boot_b) = ([1; 16], [2; 16]);
        Pool::create("p", &disks, &o).unwrap().close_cleanly();
        // Closed cleanly, then opened on a later boot: nothing lost.
        let pool = Pool::import_on(&disks, boot_a).unwrap();
        assert_eq!(pool.power_losses(), 0);
        // The same boot again (the engine restarted, the disks kept their caches).
        pool.close();
        drop(pool);
        let pool = Pool::import_on(&disks, boot_a).unwrap();
        assert_eq!(pool.power_losses(), 0);
        // Another boot while it was open: the machine stopped with it open.
        pool.close();
        drop(pool);
        let pool = Pool::import_on(&disks, boot_b).unwrap();
        assert_eq!(pool.info().power_losses, 1);
        pool.close_cleanly();
        drop(pool);
        let pool = Pool::import_on(&disks, boot_a).unwrap();
        assert_eq!(pool.power_losses(), 1);
        pool.check().unwrap();
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Random volume operations through the real pool against a model of what each
        /// volume holds; reopening from the disks changes nothing, and space adds up.
        #[test]
        fn pool_matches_its_model(ops in proptest::collection::vec(arb_op(), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let disks: Vec<PathBuf> = (0..2).map(|i| {
                let p = dir.path().join(format!("d{i}"));
                File::create(&p).unwrap().set_len(12 << 20).unwrap();
                p
            }).collect();
            let o = CreateOptions { cluster_size: CLUSTER, force: false };
            let mut pool = Pool::create("model", &disks, &o).unwrap();
            let total = pool.info().capacity_bytes / CLUSTER;
            let mut model: BTreeMap<String, Expect> = BTreeMap::new();
            let mut next = 0;
            for op in ops {
                let names: Vec<String> = model.keys().cloned().collect();
                let pick = |i: usize| names.get(i % names.len().max(1)).cloned();
                let used: u64 = model.values().map(|e| e.allocated.len() as u64).sum();
                match op {
                    Op::Create(thin, n) => {
                        let name = format!("v{next}");
                        next += 1;
                        let r = pool.create_volume(&name, n * CLUSTER, thin, None);
                        prop_assert_eq!(r.is_ok(), thin || used + n <= total);
                        if r.is_ok() {
                            let allocated = if thin { BTreeSet::new() } else { (0..n).collect() };
                            model.insert(name, Expect { clusters: n, thin, allocated });
                        }
                    }
                    Op::Delete(i) => if let Some(name) = pick(i) {
                        pool.delete_volume(&name).unwrap();
                        model.remove(&name);
                    },
                    Op::Grow(i, n) => if let Some(name) = pick(i) {
                        let e = model.get_mut(&name).unwrap();
                        let r = pool.resize_volume(&name, (e.clusters + n) * CLUSTER);
                        prop_assert_eq!(r.is_ok(), e.thin || used + n <= total);
                        if r.is_ok() {
                            if !e.thin {
                                e.allocated.extend(e.clusters..e.clusters + n);
                            }
                            e.clusters += n;
                        }
                    },
                    Op::Write(i, c) => if let Some(name) = pick(i) {
                        let e = model.get_mut(&name).unwrap();
                        let vc = c % e.clusters;
                        let id = pool.open_volume(&name).unwrap().0.id;
                        let st = ask(&pool, |done| MetaRequest::Allocate { volume: id, first: vc, count: 1, done });
                        let fits = e.allocated.contains(&vc) || used < total;
                        prop_assert_eq!(st, if fits { Status::SUCCESS } else { Status::CAPACITY_EXCEEDED });
                        if fits {
                            e.allocated.insert(vc);
                        }
                    },
                    Op::Trim(i, c, n) => if let Some(name) = pick(i) {
                        let e = model.get_mut(&name).unwrap();
                        let id = pool.open_volume(&name).unwrap().0.id;
                        let ranges = vec![(c * CLUSTER, n * CLUSTER)];
                        prop_assert_eq!(ask(&pool, |done| MetaRequest::Zero { volume: id, ranges, done }), Status::SUCCESS);
                        if e.thin {
                            e.allocated.retain(|vc| *vc < c || *vc >= c + n);
                        }
                    },
                    Op::Reopen => {
                        let before = serde_json::to_string(&pool.volumes()).unwrap();
                        pool.close();
                        drop(pool);
                        pool = Pool::import(&[disks[1].clone(), disks[0].clone()]).unwrap();
                        prop_assert_eq!(serde_json::to_string(&pool.volumes()).unwrap(), before);
                    }
                }
                pool.check().unwrap();
                let info = pool.info();
                let used: u64 = model.values().map(|e| e.allocated.len() as u64).sum();
                prop_assert_eq!(info.used_bytes, used * CLUSTER);
                for v in pool.volumes() {
                    let e = &model[&v.name];
                    prop_assert_eq!(v.allocated_bytes, e.allocated.len() as u64 * CLUSTER, "volume {}", v.name);
                    prop_assert_eq!(v.size, e.clusters * CLUSTER);
                }
                prop_assert_eq!(pool.volumes().len(), model.len());
            }
        }
    }
}

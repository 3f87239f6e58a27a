//! The on-disk format of a pool, as pure encoding and decoding (no I/O).
//!
//! Every member disk starts with a [`Superblock`] that names the pool, the disk and all
//! members. Disk 0 also holds the metadata: two checkpoint slots and a journal.
//!
//! ```text
//! disk 0: | superblock | checkpoint A | checkpoint B | journal | clusters ... |
//! disk n: | superblock | clusters ...                                         |
//! ```
//!
//! A checkpoint is the whole [`PoolState`] with a generation number; the valid slot with
//! the highest generation wins. Journal entries after it carry the same generation and
//! consecutive sequence numbers, each one checksummed, so replay stops at the first
//! entry that is torn, stale or missing. Every structure is little-endian and carries a
//! CRC32C.

use std::collections::BTreeMap;

use nvpool_wire::tcp::crc32c;

use crate::granules::{ALL_GRANULES, Granules, whole_granules};

/// Unit of metadata I/O and alignment of every metadata structure (direct I/O needs it).
pub const BLOCK: u64 = 4096;
/// Format version of the pools this code makes. Version 2 gives each checkpoint slot
/// room for snapshots' layers; a pool of version 1 (made before them) is read and
/// written as it was, and takes no snapshot.
pub const VERSION: u32 = 2;
/// The first version whose pools hold layers (snapshots, clones).
pub const LAYERS_VERSION: u32 = 2;
/// Most layers under a volume: a read goes down at most this many parents.
pub const MAX_CHAIN: usize = 16;
/// Most disks in one pool.
pub const MAX_DISKS: usize = 32;
/// Most volumes in one pool.
pub const MAX_VOLUMES: u32 = 4096;
/// Longest pool or volume name, in bytes.
pub const MAX_NAME: usize = 63;

const SUPERBLOCK_MAGIC: &[u8; 8] = b"NVPOOLSB";
const CHECKPOINT_MAGIC: &[u8; 8] = b"NVPOOLCK";
const JOURNAL_MAGIC: &[u8; 8] = b"NVPOOLJE";
/// Bytes of a checkpoint or journal header before the payload.
pub const HEADER_LEN: usize = 64;
/// Bytes of one volume entry in a checkpoint, before its extents.
const VOLUME_ENTRY: usize = 128;
/// Bytes of one extent in a checkpoint.
const EXTENT_ENTRY: usize = 12;
/// Bytes of a checkpoint's pool-wide fields, after the volumes.
const POOL_TRAILER: usize = 24;
/// Bytes of a volume's layer entry in a checkpoint's layer section, before its
/// partly held clusters.
const LAYER_ENTRY: usize = 16;
/// Bytes of a partly held cluster in a layer entry: its virtual cluster and granules.
const PARTIAL_ENTRY: usize = 4 + 32;
/// A layer entry's parent when it has none (volume IDs start at 0).
const NO_PARENT: u32 = u32::MAX;

/// Rounds `v` up to a multiple of [`BLOCK`].
pub fn block_align(v: u64) -> u64 {
    v.div_ceil(BLOCK) * BLOCK
}

/// Checks a pool or volume name: 1 to 63 bytes of letters, digits, `-`, `_` and `.`.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!("{what} name {name:?} is not valid: use 1 to {MAX_NAME} letters, digits, '-', '_' or '.'"))
    }
}

// ----- little-endian cursors ---------------------------------------------------------

struct Writer<'a> {
    b: &'a mut Vec<u8>,
}

impl Writer<'_> {
    fn u8(&mut self, v: u8) {
        self.b.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.b.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.b.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, v: &[u8]) {
        self.b.extend_from_slice(v);
    }
    /// A name as a NUL-padded field of `MAX_NAME + 1` bytes.
    fn name(&mut self, s: &str) {
        let mut f = [0u8; MAX_NAME + 1];
        let n = s.len().min(MAX_NAME);
        f[..n].copy_from_slice(&s.as_bytes()[..n]);
        self.bytes(&f);
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or("metadata ends early")?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        let mut v = [0u8; N];
        v.copy_from_slice(self.take(N)?);
        Ok(v)
    }
    fn name(&mut self) -> Result<String, String> {
        let f = self.take(MAX_NAME + 1)?;
        let end = f.iter().position(|&c| c == 0).unwrap_or(f.len());
        String::from_utf8(f[..end].to_vec()).map_err(|_| "a name in the metadata is not UTF-8".to_string())
    }
    fn skip_to(&mut self, at: usize) -> Result<(), String> {
        if at < self.at || at > self.b.len() {
            return Err("metadata ends early".into());
        }
        self.at = at;
        Ok(())
    }
}

// ----- superblock --------------------------------------------------------------------

/// One member disk as every superblock lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The disk's UUID.
    pub uuid: [u8; 16],
    /// Data clusters on the disk.
    pub clusters: u32,
    /// Byte offset of the disk's first data cluster.
    pub data_offset: u64,
}

/// Where disk 0 keeps the metadata.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaLayout {
    /// Byte offset of checkpoint slot A; slot B follows it.
    pub checkpoint_offset: u64,
    /// Bytes of each checkpoint slot.
    pub checkpoint_size: u64,
    /// Byte offset of the journal.
    pub journal_offset: u64,
    /// Bytes of the journal.
    pub journal_size: u64,
}

impl MetaLayout {
    /// The layout for a pool of `clusters` clusters with a journal of `journal_size`
    /// bytes: each checkpoint slot holds the largest state such a pool can have (of
    /// format `version`: from version 2, every volume a layer and every cluster held
    /// in part).
    pub fn for_pool(clusters: u64, journal_size: u64, version: u32) -> MetaLayout {
        let layers = if version >= LAYERS_VERSION {
            4 + u64::from(MAX_VOLUMES) * LAYER_ENTRY as u64 + clusters * PARTIAL_ENTRY as u64
        } else {
            0
        };
        let checkpoint_size = block_align(
            (HEADER_LEN + 8 + POOL_TRAILER) as u64
                + u64::from(MAX_VOLUMES) * VOLUME_ENTRY as u64
                + clusters * EXTENT_ENTRY as u64
                + layers,
        );
        MetaLayout {
            checkpoint_offset: BLOCK,
            checkpoint_size,
            journal_offset: BLOCK + 2 * checkpoint_size,
            journal_size: block_align(journal_size),
        }
    }

    /// Where the metadata ends on disk 0.
    pub fn end(&self) -> u64 {
        self.journal_offset + self.journal_size
    }

    /// Byte offset of checkpoint slot `slot` (0 or 1).
    pub fn slot_offset(&self, slot: u64) -> u64 {
        self.checkpoint_offset + (slot % 2) * self.checkpoint_size
    }
}

/// The first block of every member disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// The pool's format version (see [`VERSION`]).
    pub version: u32,
    /// The pool's UUID.
    pub pool_uuid: [u8; 16],
    /// The pool's name.
    pub pool_name: String,
    /// This disk's index in `members`.
    pub disk_index: u32,
    /// Bytes per cluster (a power of two).
    pub cluster_size: u64,
    /// Where disk 0 keeps the metadata.
    pub meta: MetaLayout,
    /// Every member disk, in index order.
    pub members: Vec<Member>,
}

impl Superblock {
    /// This disk's UUID.
    pub fn disk_uuid(&self) -> [u8; 16] {
        self.members[self.disk_index as usize].uuid
    }

    /// Encodes into one [`BLOCK`].
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(BLOCK as usize);
        let mut w = Writer { b: &mut b };
        w.bytes(SUPERBLOCK_MAGIC);
        w.u32(self.version);
        w.u32(0); // CRC, filled in below
        w.bytes(&self.pool_uuid);
        w.name(&self.pool_name);
        w.u32(self.disk_index);
        w.u32(self.members.len() as u32);
        w.u64(self.cluster_size);
        w.u64(self.meta.checkpoint_offset);
        w.u64(self.meta.checkpoint_size);
        w.u64(self.meta.journal_offset);
        w.u64(self.meta.journal_size);
        for m in &self.members {
            w.bytes(&m.uuid);
            w.u32(m.clusters);
            w.u64(m.data_offset);
        }
        b.resize(BLOCK as usize, 0);
        let crc = crc32c(&b);
        b[12..16].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Whether `b` starts with a superblock's magic (valid or not).
    pub fn has_magic(b: &[u8]) -> bool {
        b.starts_with(SUPERBLOCK_MAGIC)
    }

    /// Decodes and checks a superblock.
    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        if b.len() < BLOCK as usize || !Self::has_magic(b) {
            return Err("no nvpool superblock".into());
        }
        let mut copy = b[..BLOCK as usize].to_vec();
        let stored = u32::from_le_bytes([copy[12], copy[13], copy[14], copy[15]]);
        copy[12..16].fill(0);
        if crc32c(&copy) != stored {
            return Err("the superblock checksum does not match (the disk is damaged)".into());
        }
        let mut r = Reader { b: &copy, at: 8 };
        let version = r.u32()?;
        if !(1..=VERSION).contains(&version) {
            return Err(format!(
                "superblock version {version} is not supported (this engine reads 1 to {VERSION}): a newer engine \
                 made the pool"
            ));
        }
        r.u32()?;
        let pool_uuid = r.array()?;
        let pool_name = r.name()?;
        let disk_index = r.u32()?;
        let count = r.u32()? as usize;
        let cluster_size = r.u64()?;
        let meta = MetaLayout {
            checkpoint_offset: r.u64()?,
            checkpoint_size: r.u64()?,
            journal_offset: r.u64()?,
            journal_size: r.u64()?,
        };
        if count == 0 || count > MAX_DISKS || disk_index as usize >= count || !cluster_size.is_power_of_two() {
            return Err("the superblock has impossible values".into());
        }
        let mut members = Vec::with_capacity(count);
        for _ in 0..count {
            members.push(Member { uuid: r.array()?, clusters: r.u32()?, data_offset: r.u64()? });
        }
        Ok(Superblock { version, pool_uuid, pool_name, disk_index, cluster_size, meta, members })
    }
}

// ----- pool state ----------------------------------------------------------------------

/// What the metadata says about one volume (its map aside).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeMeta {
    /// Pool-unique, never reused.
    pub id: u32,
    /// Pool-unique name.
    pub name: String,
    /// Size in bytes (a multiple of 4 KiB).
    pub size: u64,
    /// Thin volumes allocate clusters on first write.
    pub thin: bool,
    /// Namespace UUID it is exported with.
    pub uuid: [u8; 16],
    /// Namespace NGUID it is exported with.
    pub nguid: [u8; 16],
}

/// One volume: its description and which physical cluster backs each virtual one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeState {
    /// The description.
    pub meta: VolumeMeta,
    /// Virtual cluster → physical cluster, for allocated clusters only.
    pub map: BTreeMap<u32, u32>,
    /// The replica generations it has seen (zero for a volume with one copy).
    pub generations: Generations,
    /// What it is among snapshots and their layers.
    pub layer: Layer,
    /// The clusters of `map` that hold only some of their granules (the others are
    /// read from the parent), by virtual cluster; every other mapped cluster is whole.
    pub partial: BTreeMap<u32, Granules>,
}

impl VolumeState {
    /// A volume with no clusters, no generation and no parent.
    pub fn new(meta: VolumeMeta) -> VolumeState {
        VolumeState {
            meta,
            map: BTreeMap::new(),
            generations: Generations::default(),
            layer: Layer::default(),
            partial: BTreeMap::new(),
        }
    }
}

/// Where a pool volume stands among snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Layer {
    /// The snapshot it lies over: what it does not hold reads from there.
    pub parent: Option<u32>,
    /// What it is.
    pub kind: VolumeKind,
}

/// A pool volume's kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VolumeKind {
    /// Writable: a volume, or a clone.
    #[default]
    Volume,
    /// A read-only snapshot.
    Snapshot,
    /// A snapshot deleted while layers still lie over it: listed nowhere, gone with
    /// its last layer.
    Hidden,
}

impl VolumeKind {
    fn code(self) -> u8 {
        match self {
            VolumeKind::Volume => 0,
            VolumeKind::Snapshot => 1,
            VolumeKind::Hidden => 2,
        }
    }

    fn from_code(c: u8) -> Result<VolumeKind, String> {
        match c {
            0 => Ok(VolumeKind::Volume),
            1 => Ok(VolumeKind::Snapshot),
            2 => Ok(VolumeKind::Hidden),
            c => Err(format!("unknown volume kind {c}")),
        }
    }
}

/// What a replica of a replicated volume must remember across a restart to stay
/// fenced: the latest generation that took it, and the latest one another engine
/// took it at (see `VolumeMap::take_generation` and `VolumeMap::fence`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Generations {
    /// The latest generation of the volume that took it (0: none).
    pub taken: u64,
    /// The latest generation another engine took it at (0: none).
    pub fenced_at: u64,
}

/// The whole metadata of a pool: what checkpoints store and journal entries change.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolState {
    /// The ID the next volume gets.
    pub next_id: u32,
    /// Volumes by ID.
    pub volumes: BTreeMap<u32, VolumeState>,
    /// The boot (`/proc/sys/kernel/random/boot_id`) of the machine that has the pool
    /// open, all zeroes once it was closed cleanly: found set to another boot, the
    /// machine stopped with the pool open (a power loss), and the disks may have lost
    /// the writes they still cached.
    pub open_boot: [u8; 16],
    /// How many times the pool was opened after such a loss: a replica whose pool's
    /// count grew while it was away may lack writes it had acknowledged.
    pub power_losses: u32,
    /// What serving engines recorded of their volumes' writes, saved at a clean close
    /// and taken when the pool opens (journal entries only, never in a checkpoint: the
    /// checkpoint every open writes drops them, so a record is never used twice).
    pub saved_records: BTreeMap<u32, SavedRecord>,
}

/// A serving engine's record of which generation last wrote each cluster of a
/// replicated volume, and which granules (see `VolumeMap::generation_record`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedRecord {
    /// The first generation the record holds the writes of.
    pub recorded_from: u64,
    /// (virtual cluster, generation, granules written) of each cluster written.
    pub written: Vec<(u32, u32, [u64; 4])>,
}

/// One change to a [`PoolState`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// A new volume with no clusters.
    CreateVolume(VolumeMeta),
    /// A volume and its clusters are gone.
    DeleteVolume {
        /// Volume ID.
        id: u32,
    },
    /// A volume's new size; clusters past the end are released.
    ResizeVolume {
        /// Volume ID.
        id: u32,
        /// New size in bytes.
        size: u64,
    },
    /// `count` virtual clusters from `vstart` are backed by physical clusters from
    /// `pstart`.
    Map {
        /// Volume ID.
        id: u32,
        /// First virtual cluster.
        vstart: u32,
        /// First physical cluster.
        pstart: u32,
        /// Number of clusters.
        count: u32,
    },
    /// `count` virtual clusters from `vstart` are released.
    Unmap {
        /// Volume ID.
        id: u32,
        /// First virtual cluster.
        vstart: u32,
        /// Number of clusters.
        count: u32,
    },
    /// A replica's generations rose.
    SetGenerations {
        /// Volume ID.
        id: u32,
        /// The generations now.
        generations: Generations,
    },
    /// The pool is open on boot `boot`, after `power_losses` losses.
    Opened {
        /// The boot ID.
        boot: [u8; 16],
        /// Power losses so far.
        power_losses: u32,
    },
    /// The pool was closed cleanly: its disks have every write.
    Closed,
    /// A volume's record of what its generations wrote, at a clean close.
    SaveRecord {
        /// Volume ID.
        id: u32,
        /// The record.
        record: SavedRecord,
    },
    /// Snapshot `snapshot` of volume `id` takes the volume's map as it stands (and its
    /// parent); the volume goes on as an empty layer over the snapshot.
    TakeSnapshot {
        /// The volume.
        id: u32,
        /// The new snapshot (its own ID and name; the volume's size).
        snapshot: VolumeMeta,
    },
    /// A new writable volume with no clusters, lying over snapshot `parent` (a clone).
    CreateLayer {
        /// The new volume.
        meta: VolumeMeta,
        /// The snapshot it lies over.
        parent: u32,
    },
    /// As `Map`, for clusters over the parent's data: they hold no granule yet.
    MapLayer {
        /// Volume ID.
        id: u32,
        /// First virtual cluster.
        vstart: u32,
        /// First physical cluster.
        pstart: u32,
        /// Number of clusters.
        count: u32,
    },
    /// The cluster at `vc` of volume `id` holds these granules too (written there);
    /// once it holds all, it is whole.
    Hold {
        /// Volume ID.
        id: u32,
        /// Virtual cluster.
        vc: u32,
        /// The granules it holds now besides those it held.
        granules: Granules,
    },
    /// A snapshot was deleted while layers lie over it: it is hidden until they go.
    Hide {
        /// Snapshot ID.
        id: u32,
    },
    /// Hidden snapshot `id`, whose clusters all went to the one layer over it (or
    /// were dropped where that layer held them already), is gone: the layer lies over
    /// its parent now.
    Fold {
        /// The hidden snapshot's ID.
        id: u32,
    },
    /// Volume or snapshot `id`, which holds whole every cluster the snapshots under it
    /// have (an inflated clone), lies over nothing now.
    Detach {
        /// Volume ID.
        id: u32,
    },
}

impl PoolState {
    /// Applies a change, checking that it is consistent with the state: physical
    /// clusters must be free (`in_use` is every mapped physical cluster).
    pub fn apply(&mut self, rec: &Record, cluster_size: u64) -> Result<(), String> {
        match rec {
            Record::CreateVolume(m) => {
                if self.volumes.contains_key(&m.id) || self.volumes.values().any(|v| v.meta.name == m.name) {
                    return Err(format!("volume {} exists twice", m.name));
                }
                self.next_id = self.next_id.max(m.id + 1);
                self.volumes.insert(m.id, VolumeState::new(m.clone()));
            }
            Record::DeleteVolume { id } => {
                if let Some(over) = self.layers_over(*id).next() {
                    return Err(format!("deleting volume {id}, which {} lies over", over.meta.name));
                }
                self.volumes.remove(id).ok_or_else(|| format!("deleting unknown volume {id}"))?;
            }
            Record::ResizeVolume { id, size } => {
                let v = self.volumes.get_mut(id).ok_or_else(|| format!("resizing unknown volume {id}"))?;
                v.meta.size = *size;
                let clusters = size.div_ceil(cluster_size);
                v.map.retain(|&vc, _| u64::from(vc) < clusters);
                v.partial.retain(|&vc, _| u64::from(vc) < clusters);
            }
            Record::Map { id, vstart, pstart, count } => {
                let v = self.volumes.get_mut(id).ok_or_else(|| format!("mapping into unknown volume {id}"))?;
                let clusters = v.meta.size.div_ceil(cluster_size);
                for i in 0..*count {
                    let vc = vstart.checked_add(i).filter(|&c| u64::from(c) < clusters);
                    let vc = vc.ok_or_else(|| format!("mapping past the end of volume {id}"))?;
                    if *pstart == 0 {
                        return Err("physical cluster 0 does not exist".into());
                    }
                    v.map.insert(vc, pstart + i);
                    v.partial.remove(&vc);
                }
            }
            Record::Unmap { id, vstart, count } => {
                let v = self.volumes.get_mut(id).ok_or_else(|| format!("unmapping in unknown volume {id}"))?;
                let end = u64::from(*vstart) + u64::from(*count);
                let gone: Vec<u32> =
                    v.map.range(*vstart..).take_while(|(vc, _)| u64::from(**vc) < end).map(|(vc, _)| *vc).collect();
                for vc in gone {
                    v.map.remove(&vc);
                    v.partial.remove(&vc);
                }
            }
            Record::SetGenerations { id, generations } => {
                let v = self.volumes.get_mut(id).ok_or_else(|| format!("fencing unknown volume {id}"))?;
                v.generations = *generations;
            }
            Record::Opened { boot, power_losses } => {
                self.open_boot = *boot;
                self.power_losses = *power_losses;
            }
            Record::Closed => self.open_boot = [0; 16],
            Record::SaveRecord { id, record } => {
                if self.volumes.contains_key(id) {
                    self.saved_records.insert(*id, record.clone());
                }
            }
            Record::TakeSnapshot { id, snapshot } => {
                if self.volumes.contains_key(&snapshot.id) || self.volume_by_name(&snapshot.name).is_some() {
                    return Err(format!("snapshot {} exists twice", snapshot.name));
                }
                let v = self.volumes.get(id).ok_or_else(|| format!("snapshot of unknown volume {id}"))?;
                if v.layer.kind != VolumeKind::Volume {
                    return Err(format!("a snapshot of snapshot {}", v.meta.name));
                }
                if self.chain(*id).len() >= MAX_CHAIN {
                    return Err(format!("volume {} lies over {MAX_CHAIN} snapshots already", v.meta.name));
                }
                let v = self.volumes.get_mut(id).expect("checked above");
                let mut taken =
                    VolumeState::new(VolumeMeta { size: v.meta.size, thin: v.meta.thin, ..snapshot.clone() });
                taken.map = std::mem::take(&mut v.map);
                taken.partial = std::mem::take(&mut v.partial);
                taken.layer = Layer { parent: v.layer.parent, kind: VolumeKind::Snapshot };
                v.layer.parent = Some(snapshot.id);
                self.next_id = self.next_id.max(snapshot.id + 1);
                self.volumes.insert(snapshot.id, taken);
            }
            Record::CreateLayer { meta, parent } => {
                let p = self.volumes.get(parent).ok_or_else(|| format!("a clone of unknown snapshot {parent}"))?;
                if p.layer.kind != VolumeKind::Snapshot {
                    return Err(format!("a clone of {}, which is no snapshot", p.meta.name));
                }
                if self.chain(*parent).len() + 1 >= MAX_CHAIN {
                    return Err(format!("snapshot {} lies over too many others to be cloned", p.meta.name));
                }
                self.apply(&Record::CreateVolume(meta.clone()), cluster_size)?;
                self.volumes.get_mut(&meta.id).expect("just made").layer.parent = Some(*parent);
            }
            Record::MapLayer { id, vstart, pstart, count } => {
                self.apply(&Record::Map { id: *id, vstart: *vstart, pstart: *pstart, count: *count }, cluster_size)?;
                let v = self.volumes.get_mut(id).expect("mapped above");
                for vc in *vstart..vstart + count {
                    v.partial.insert(vc, [0; 4]);
                }
            }
            Record::Hold { id, vc, granules } => {
                let v = self.volumes.get_mut(id).ok_or_else(|| format!("holding in unknown volume {id}"))?;
                if !v.map.contains_key(vc) {
                    return Err(format!("holding granules of unmapped cluster {vc} of volume {id}"));
                }
                if let Some(held) = v.partial.get_mut(vc) {
                    let whole = whole_granules(cluster_size);
                    for (h, g) in held.iter_mut().zip(granules) {
                        *h |= g;
                    }
                    if held.iter().zip(whole).all(|(h, w)| h & w == w) {
                        v.partial.remove(vc);
                    }
                }
            }
            Record::Hide { id } => {
                let v = self.volumes.get_mut(id).ok_or_else(|| format!("hiding unknown snapshot {id}"))?;
                if v.layer.kind != VolumeKind::Snapshot {
                    return Err(format!("hiding {}, which is no snapshot", v.meta.name));
                }
                v.layer.kind = VolumeKind::Hidden;
            }
            Record::Fold { id } => {
                let (child, parent) =
                    self.fold_target(*id).ok_or_else(|| format!("folding {id}, which cannot fold"))?;
                if !self.volumes[id].map.is_empty() {
                    return Err(format!("folding {id}, which still holds clusters"));
                }
                self.volumes.get_mut(&child).expect("found above").layer.parent = parent;
                self.volumes.remove(id);
            }
            Record::Detach { id } => {
                // A snapshot too: one taken of a volume while it inflated goes on with it.
                let v = self.volumes.get(id).ok_or_else(|| format!("detaching unknown volume {id}"))?;
                if let Some(vc) = self.inflate_pending(*id).first() {
                    return Err(format!("detaching {}, which still reads cluster {vc} from a snapshot", v.meta.name));
                }
                self.volumes.get_mut(id).expect("found above").layer.parent = None;
            }
        }
        Ok(())
    }

    /// The virtual clusters volume `id` still reads, wholly or in part, from the
    /// snapshots under it: those one of them has, and the volume does not hold whole.
    pub fn inflate_pending(&self, id: u32) -> Vec<u32> {
        let Some(v) = self.volumes.get(&id) else { return Vec::new() };
        let mut under: Vec<u32> = self.chain(id).iter().flat_map(|p| self.volumes[p].map.keys().copied()).collect();
        under.sort_unstable();
        under.dedup();
        under.retain(|vc| !v.map.contains_key(vc) || v.partial.contains_key(vc));
        under
    }

    /// For a hidden snapshot that one layer alone lies over: that layer, and the
    /// snapshot's own parent (what the layer will lie over once folded).
    pub fn fold_target(&self, id: u32) -> Option<(u32, Option<u32>)> {
        let v = self.volumes.get(&id).filter(|v| v.layer.kind == VolumeKind::Hidden)?;
        let mut over = self.layers_over(id);
        let child = over.next()?.meta.id;
        over.next().is_none().then_some((child, v.layer.parent))
    }

    /// The records that fold cluster `vc` of hidden snapshot `id` into the layer over
    /// it, with the granules of it that must be copied into that layer's own cluster
    /// first (none: the cluster moves to the layer, or the layer holds them already).
    /// The state is the same to a reader before and after them.
    pub fn fold_cluster(&self, id: u32, vc: u32, cluster_size: u64) -> Option<(Vec<Record>, Granules)> {
        let (child, _) = self.fold_target(id)?;
        let (h, c) = (&self.volumes[&id], &self.volumes[&child]);
        let pc = *h.map.get(&vc)?;
        let held = h.partial.get(&vc).copied().unwrap_or(ALL_GRANULES);
        let unmap = Record::Unmap { id, vstart: vc, count: 1 };
        if !c.map.contains_key(&vc) {
            let give = match held == ALL_GRANULES {
                true => vec![Record::Map { id: child, vstart: vc, pstart: pc, count: 1 }],
                false => vec![
                    Record::MapLayer { id: child, vstart: vc, pstart: pc, count: 1 },
                    Record::Hold { id: child, vc, granules: held },
                ],
            };
            return Some(([vec![unmap], give].concat(), [0; 4]));
        }
        let has = c.partial.get(&vc).copied().unwrap_or(ALL_GRANULES);
        let whole = whole_granules(cluster_size);
        let need: Granules = std::array::from_fn(|i| held[i] & !has[i] & whole[i]);
        let mut records = Vec::new();
        if need != [0; 4] {
            records.push(Record::Hold { id: child, vc, granules: need });
        }
        records.push(unmap);
        Some((records, need))
    }

    /// The snapshots under volume `id`, nearest first (empty for one without a parent).
    pub fn chain(&self, id: u32) -> Vec<u32> {
        let mut chain = Vec::new();
        let mut at = self.volumes.get(&id).and_then(|v| v.layer.parent);
        while let Some(p) = at.filter(|_| chain.len() <= MAX_CHAIN) {
            chain.push(p);
            at = self.volumes.get(&p).and_then(|v| v.layer.parent);
        }
        chain
    }

    /// Checks what snapshots and layers must keep true: every parent exists and is a
    /// snapshot (hidden or not), chains end within `MAX_CHAIN`, and a cluster held in
    /// part is mapped and not whole. (A hidden snapshot nothing lies over is deleted
    /// when the pool opens: a crash can leave one between two deletions.)
    pub fn check_layers(&self) -> Result<(), String> {
        for v in self.volumes.values() {
            let name = &v.meta.name;
            if let Some(parent) = v.layer.parent {
                let p = self.volumes.get(&parent).ok_or_else(|| format!("{name} lies over a missing volume"))?;
                if p.layer.kind == VolumeKind::Volume {
                    return Err(format!("{name} lies over {}, which is no snapshot", p.meta.name));
                }
            }
            if self.chain(v.meta.id).len() > MAX_CHAIN {
                return Err(format!("{name} lies over more than {MAX_CHAIN} snapshots (or a circle of them)"));
            }
            if let Some((vc, g)) = v.partial.iter().find(|(vc, g)| !v.map.contains_key(vc) || **g == ALL_GRANULES) {
                return Err(format!("{name} holds cluster {vc} in part ({g:x?}), which is unmapped or whole"));
            }
        }
        Ok(())
    }

    /// The volumes that lie directly over `id`.
    pub fn layers_over(&self, id: u32) -> impl Iterator<Item = &VolumeState> {
        self.volumes.values().filter(move |v| v.layer.parent == Some(id))
    }

    /// Physical clusters in use by any volume, checking that none is used twice.
    pub fn used_clusters(&self) -> Result<Vec<u32>, String> {
        let mut all: Vec<u32> = self.volumes.values().flat_map(|v| v.map.values().copied()).collect();
        all.sort_unstable();
        if let Some(w) = all.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!("physical cluster {} is mapped twice", w[0]));
        }
        Ok(all)
    }

    /// A volume by name.
    pub fn volume_by_name(&self, name: &str) -> Option<&VolumeState> {
        self.volumes.values().find(|v| v.meta.name == name)
    }
}

/// Runs of consecutive virtual clusters backed by consecutive physical clusters:
/// (vstart, pstart, count).
pub fn extents(map: &BTreeMap<u32, u32>) -> Vec<(u32, u32, u32)> {
    let mut out: Vec<(u32, u32, u32)> = Vec::new();
    for (&vc, &pc) in map {
        match out.last_mut() {
            Some((v, p, n)) if *v + *n == vc && *p + *n == pc => *n += 1,
            _ => out.push((vc, pc, 1)),
        }
    }
    out
}

// ----- checkpoints ---------------------------------------------------------------------

fn encode_header(magic: &[u8; 8], pool_uuid: &[u8; 16], generation: u64, seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(HEADER_LEN + payload.len());
    let mut w = Writer { b: &mut b };
    w.bytes(magic);
    w.bytes(pool_uuid);
    w.u64(generation);
    w.u64(seq);
    w.u64(payload.len() as u64);
    w.u32(crc32c(payload));
    w.u32(0); // header CRC, filled in below
    b.resize(HEADER_LEN, 0);
    let crc = crc32c(&b);
    b[52..56].copy_from_slice(&crc.to_le_bytes());
    b.extend_from_slice(payload);
    let padded = block_align(b.len() as u64) as usize;
    b.resize(padded, 0);
    b
}

/// A decoded checkpoint or journal header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Checkpoint generation (a journal entry's is that of the checkpoint it follows).
    pub generation: u64,
    /// Journal sequence number (0 for checkpoints).
    pub seq: u64,
    /// Payload bytes after the header.
    pub payload_len: u64,
    payload_crc: u32,
}

impl Header {
    /// Bytes the structure occupies on disk, header and padding included.
    pub fn total_len(&self) -> u64 {
        block_align(HEADER_LEN as u64 + self.payload_len)
    }
}

fn decode_header(magic: &[u8; 8], pool_uuid: &[u8; 16], b: &[u8]) -> Option<Header> {
    if b.len() < HEADER_LEN || &b[..8] != magic || &b[8..24] != pool_uuid {
        return None;
    }
    let mut h = b[..HEADER_LEN].to_vec();
    let stored = u32::from_le_bytes([h[52], h[53], h[54], h[55]]);
    h[52..56].fill(0);
    if crc32c(&h) != stored {
        return None;
    }
    let mut r = Reader { b: &h, at: 24 };
    Some(Header {
        generation: r.u64().ok()?,
        seq: r.u64().ok()?,
        payload_len: r.u64().ok()?,
        payload_crc: r.u32().ok()?,
    })
}

fn payload_ok(h: &Header, b: &[u8]) -> bool {
    let end = HEADER_LEN as u64 + h.payload_len;
    end <= b.len() as u64 && crc32c(&b[HEADER_LEN..end as usize]) == h.payload_crc
}

/// Encodes a checkpoint of `state`, padded to whole blocks.
pub fn encode_checkpoint(pool_uuid: &[u8; 16], generation: u64, state: &PoolState) -> Vec<u8> {
    let mut p = Vec::new();
    let mut w = Writer { b: &mut p };
    w.u32(state.next_id);
    w.u32(state.volumes.len() as u32);
    for v in state.volumes.values() {
        let ext = extents(&v.map);
        let start = w.b.len();
        w.u32(v.meta.id);
        w.u32(u32::from(v.meta.thin));
        w.u64(v.meta.size);
        w.bytes(&v.meta.uuid);
        w.bytes(&v.meta.nguid);
        w.name(&v.meta.name);
        w.u32(ext.len() as u32);
        // The entry's last 12 bytes: zero in pools written before replicas had
        // generations, which read as none.
        w.u64(v.generations.taken);
        w.u32(v.generations.fenced_at.min(u64::from(u32::MAX)) as u32);
        w.b.resize(start + VOLUME_ENTRY, 0);
        for (vs, ps, n) in ext {
            w.u32(vs);
            w.u32(ps);
            w.u32(n);
        }
    }
    // After the volumes (absent in older pools: a pool closed cleanly, no loss).
    w.bytes(&state.open_boot);
    w.u32(state.power_losses);
    w.b.resize(w.b.len() + POOL_TRAILER - 20, 0);
    // Then the layers: the volumes with a parent, a kind other than volume, or
    // clusters held in part (absent in older pools: none).
    let layered: Vec<&VolumeState> =
        state.volumes.values().filter(|v| v.layer != Layer::default() || !v.partial.is_empty()).collect();
    if !layered.is_empty() {
        w.u32(layered.len() as u32);
        for v in layered {
            w.u32(v.meta.id);
            w.u32(v.layer.parent.unwrap_or(NO_PARENT));
            w.u8(v.layer.kind.code());
            w.bytes(&[0; 3]);
            w.u32(v.partial.len() as u32);
            for (vc, granules) in &v.partial {
                w.u32(*vc);
                w.granules(granules);
            }
        }
    }
    encode_header(CHECKPOINT_MAGIC, pool_uuid, generation, 0, &p)
}

/// The header of a checkpoint, if `b` (at least its first block) holds a valid one.
pub fn checkpoint_header(pool_uuid: &[u8; 16], b: &[u8]) -> Option<Header> {
    decode_header(CHECKPOINT_MAGIC, pool_uuid, b)
}

/// Decodes a whole checkpoint read into `b`; `None` if it is torn or not ours.
pub fn decode_checkpoint(pool_uuid: &[u8; 16], b: &[u8]) -> Option<(u64, PoolState)> {
    let h = checkpoint_header(pool_uuid, b)?;
    if !payload_ok(&h, b) {
        return None;
    }
    let mut r = Reader { b: &b[..HEADER_LEN + h.payload_len as usize], at: HEADER_LEN };
    let parse = |r: &mut Reader<'_>| -> Result<PoolState, String> {
        let mut s = PoolState { next_id: r.u32()?, ..PoolState::default() };
        let count = r.u32()?;
        for _ in 0..count {
            let start = r.at;
            let id = r.u32()?;
            let thin = r.u32()? != 0;
            let size = r.u64()?;
            let uuid = r.array()?;
            let nguid = r.array()?;
            let name = r.name()?;
            let n = r.u32()?;
            let generations = Generations { taken: r.u64()?, fenced_at: u64::from(r.u32()?) };
            r.skip_to(start + VOLUME_ENTRY)?;
            let mut map = BTreeMap::new();
            for _ in 0..n {
                let (vs, ps, c) = (r.u32()?, r.u32()?, r.u32()?);
                for i in 0..c {
                    map.insert(vs + i, ps + i);
                }
            }
            let meta = VolumeMeta { id, name, size, thin, uuid, nguid };
            s.volumes.insert(id, VolumeState { map, generations, ..VolumeState::new(meta) });
        }
        if r.at < r.b.len() {
            s.open_boot = r.array()?;
            s.power_losses = r.u32()?;
            r.take(POOL_TRAILER - 20)?;
        }
        if r.at < r.b.len() {
            for _ in 0..r.u32()? {
                let id = r.u32()?;
                let parent = Some(r.u32()?).filter(|&p| p != NO_PARENT);
                let kind = VolumeKind::from_code(r.u8()?)?;
                r.take(3)?;
                let v = s.volumes.get_mut(&id).ok_or("a layer of an unknown volume")?;
                v.layer = Layer { parent, kind };
                for _ in 0..r.u32()? {
                    let vc = r.u32()?;
                    v.partial.insert(vc, r.granules()?);
                }
            }
        }
        Ok(s)
    };
    parse(&mut r).ok().map(|s| (h.generation, s))
}

// ----- journal -------------------------------------------------------------------------

const TAG_CREATE: u8 = 1;
const TAG_DELETE: u8 = 2;
const TAG_RESIZE: u8 = 3;
const TAG_MAP: u8 = 4;
const TAG_UNMAP: u8 = 5;
const TAG_GENERATIONS: u8 = 6;
const TAG_OPENED: u8 = 7;
const TAG_CLOSED: u8 = 8;
const TAG_SAVE_RECORD: u8 = 9;
const TAG_TAKE_SNAPSHOT: u8 = 10;
const TAG_CREATE_LAYER: u8 = 11;
const TAG_MAP_LAYER: u8 = 12;
const TAG_HOLD: u8 = 13;
const TAG_HIDE: u8 = 14;
const TAG_FOLD: u8 = 15;
const TAG_DETACH: u8 = 16;

impl Writer<'_> {
    fn meta(&mut self, m: &VolumeMeta) {
        self.u32(m.id);
        self.u8(u8::from(m.thin));
        self.u64(m.size);
        self.bytes(&m.uuid);
        self.bytes(&m.nguid);
        self.name(&m.name);
    }

    fn granules(&mut self, g: &Granules) {
        for word in g {
            self.u64(*word);
        }
    }
}

impl Reader<'_> {
    fn meta(&mut self) -> Result<VolumeMeta, String> {
        let id = self.u32()?;
        let thin = self.u8()? != 0;
        let size = self.u64()?;
        let uuid = self.array()?;
        let nguid = self.array()?;
        let name = self.name()?;
        Ok(VolumeMeta { id, name, size, thin, uuid, nguid })
    }

    fn granules(&mut self) -> Result<Granules, String> {
        Ok([self.u64()?, self.u64()?, self.u64()?, self.u64()?])
    }
}

/// Encodes a journal entry holding `records`, padded to whole blocks.
pub fn encode_entry(pool_uuid: &[u8; 16], generation: u64, seq: u64, records: &[Record]) -> Vec<u8> {
    let mut p = Vec::new();
    let mut w = Writer { b: &mut p };
    w.u32(records.len() as u32);
    for rec in records {
        match rec {
            Record::CreateVolume(m) => {
                w.u8(TAG_CREATE);
                w.meta(m);
            }
            Record::DeleteVolume { id } => {
                w.u8(TAG_DELETE);
                w.u32(*id);
            }
            Record::ResizeVolume { id, size } => {
                w.u8(TAG_RESIZE);
                w.u32(*id);
                w.u64(*size);
            }
            Record::Map { id, vstart, pstart, count } => {
                w.u8(TAG_MAP);
                w.u32(*id);
                w.u32(*vstart);
                w.u32(*pstart);
                w.u32(*count);
            }
            Record::Unmap { id, vstart, count } => {
                w.u8(TAG_UNMAP);
                w.u32(*id);
                w.u32(*vstart);
                w.u32(*count);
            }
            Record::SetGenerations { id, generations } => {
                w.u8(TAG_GENERATIONS);
                w.u32(*id);
                w.u64(generations.taken);
                w.u64(generations.fenced_at);
            }
            Record::Opened { boot, power_losses } => {
                w.u8(TAG_OPENED);
                w.bytes(boot);
                w.u32(*power_losses);
            }
            Record::Closed => w.u8(TAG_CLOSED),
            Record::SaveRecord { id, record } => {
                w.u8(TAG_SAVE_RECORD);
                w.u32(*id);
                w.u64(record.recorded_from);
                w.u32(record.written.len() as u32);
                for (vc, generation, granules) in &record.written {
                    w.u32(*vc);
                    w.u32(*generation);
                    w.granules(granules);
                }
            }
            Record::TakeSnapshot { id, snapshot } => {
                w.u8(TAG_TAKE_SNAPSHOT);
                w.u32(*id);
                w.meta(snapshot);
            }
            Record::CreateLayer { meta, parent } => {
                w.u8(TAG_CREATE_LAYER);
                w.meta(meta);
                w.u32(*parent);
            }
            Record::MapLayer { id, vstart, pstart, count } => {
                w.u8(TAG_MAP_LAYER);
                w.u32(*id);
                w.u32(*vstart);
                w.u32(*pstart);
                w.u32(*count);
            }
            Record::Hold { id, vc, granules } => {
                w.u8(TAG_HOLD);
                w.u32(*id);
                w.u32(*vc);
                w.granules(granules);
            }
            Record::Hide { id } => {
                w.u8(TAG_HIDE);
                w.u32(*id);
            }
            Record::Fold { id } => {
                w.u8(TAG_FOLD);
                w.u32(*id);
            }
            Record::Detach { id } => {
                w.u8(TAG_DETACH);
                w.u32(*id);
            }
        }
    }
    encode_header(JOURNAL_MAGIC, pool_uuid, generation, seq, &p)
}

/// The header of a journal entry, if `b` starts with a valid one.
pub fn entry_header(pool_uuid: &[u8; 16], b: &[u8]) -> Option<Header> {
    decode_header(JOURNAL_MAGIC, pool_uuid, b)
}

/// Decodes a whole journal entry; `None` if it is torn or not ours.
pub fn decode_entry(pool_uuid: &[u8; 16], b: &[u8]) -> Option<(Header, Vec<Record>)> {
    let h = entry_header(pool_uuid, b)?;
    if !payload_ok(&h, b) {
        return None;
    }
    let mut r = Reader { b: &b[..HEADER_LEN + h.payload_len as usize], at: HEADER_LEN };
    let parse = |r: &mut Reader<'_>| -> Result<Vec<Record>, String> {
        let n = r.u32()?;
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(match r.u8()? {
                TAG_CREATE => Record::CreateVolume(r.meta()?),
                TAG_DELETE => Record::DeleteVolume { id: r.u32()? },
                TAG_RESIZE => Record::ResizeVolume { id: r.u32()?, size: r.u64()? },
                TAG_MAP => Record::Map { id: r.u32()?, vstart: r.u32()?, pstart: r.u32()?, count: r.u32()? },
                TAG_UNMAP => Record::Unmap { id: r.u32()?, vstart: r.u32()?, count: r.u32()? },
                TAG_GENERATIONS => Record::SetGenerations {
                    id: r.u32()?,
                    generations: Generations { taken: r.u64()?, fenced_at: r.u64()? },
                },
                TAG_OPENED => Record::Opened { boot: r.array()?, power_losses: r.u32()? },
                TAG_CLOSED => Record::Closed,
                TAG_SAVE_RECORD => {
                    let id = r.u32()?;
                    let recorded_from = r.u64()?;
                    let n = r.u32()?;
                    let mut written = Vec::new();
                    for _ in 0..n {
                        let (vc, generation) = (r.u32()?, r.u32()?);
                        written.push((vc, generation, r.granules()?));
                    }
                    Record::SaveRecord { id, record: SavedRecord { recorded_from, written } }
                }
                TAG_TAKE_SNAPSHOT => Record::TakeSnapshot { id: r.u32()?, snapshot: r.meta()? },
                TAG_CREATE_LAYER => Record::CreateLayer { meta: r.meta()?, parent: r.u32()? },
                TAG_MAP_LAYER => Record::MapLayer { id: r.u32()?, vstart: r.u32()?, pstart: r.u32()?, count: r.u32()? },
                TAG_HOLD => Record::Hold { id: r.u32()?, vc: r.u32()?, granules: r.granules()? },
                TAG_HIDE => Record::Hide { id: r.u32()? },
                TAG_FOLD => Record::Fold { id: r.u32()? },
                TAG_DETACH => Record::Detach { id: r.u32()? },
                t => return Err(format!("unknown journal record type {t}")),
            });
        }
        Ok(out)
    };
    parse(&mut r).ok().map(|recs| (h, recs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(i: u8) -> Member {
        Member { uuid: [i; 16], clusters: 100 + u32::from(i), data_offset: 1 << 20 }
    }

    #[test]
    fn superblock_round_trips_and_detects_damage() {
        let sb = Superblock {
            version: VERSION,
            pool_uuid: [7; 16],
            pool_name: "fast".into(),
            disk_index: 1,
            cluster_size: 1 << 20,
            meta: MetaLayout::for_pool(1000, 1 << 20, VERSION),
            members: vec![member(1), member(2)],
        };
        let b = sb.encode();
        assert_eq!(b.len(), BLOCK as usize);
        assert_eq!(Superblock::decode(&b).unwrap(), sb);
        // A pool made before layers keeps its version; one of a newer engine is refused.
        let old = Superblock { version: 1, ..sb.clone() };
        assert_eq!(Superblock::decode(&old.encode()).unwrap().version, 1);
        let newer = Superblock { version: VERSION + 1, ..sb.clone() };
        assert!(Superblock::decode(&newer.encode()).unwrap_err().contains("newer engine"));
        assert_eq!(sb.disk_uuid(), [2; 16]);
        let mut bad = b.clone();
        bad[100] ^= 1;
        assert!(Superblock::decode(&bad).unwrap_err().contains("checksum"));
        assert!(Superblock::decode(&[0u8; 4096]).is_err());
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("volume", "db-01.data_x").is_ok());
        for bad in ["", "a/b", "a b", &"x".repeat(64)] {
            assert!(check_name("volume", bad).is_err(), "{bad:?}");
        }
    }

    fn arb_record() -> impl Strategy<Value = Record> {
        prop_oneof![
            (any::<u32>(), "[a-z]{1,63}", any::<u64>(), any::<bool>(), any::<[u8; 16]>()).prop_map(
                |(id, name, size, thin, uuid)| Record::CreateVolume(VolumeMeta {
                    id,
                    name,
                    size,
                    thin,
                    uuid,
                    nguid: uuid
                })
            ),
            any::<u32>().prop_map(|id| Record::DeleteVolume { id }),
            (any::<u32>(), any::<u64>()).prop_map(|(id, size)| Record::ResizeVolume { id, size }),
            (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>())
                .prop_map(|(id, vstart, pstart, count)| Record::Map { id, vstart, pstart, count }),
            (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(id, vstart, count)| Record::Unmap {
                id,
                vstart,
                count
            }),
            (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(id, taken, fenced_at)| Record::SetGenerations {
                id,
                generations: Generations { taken, fenced_at }
            }),
            (any::<[u8; 16]>(), any::<u32>()).prop_map(|(boot, power_losses)| Record::Opened { boot, power_losses }),
            Just(Record::Closed),
            (any::<u32>(), any::<u64>(), proptest::collection::vec(any::<(u32, u32, [u64; 4])>(), 0..20)).prop_map(
                |(id, recorded_from, written)| Record::SaveRecord {
                    id,
                    record: SavedRecord { recorded_from, written }
                }
            ),
            (any::<u32>(), arb_meta()).prop_map(|(id, snapshot)| Record::TakeSnapshot { id, snapshot }),
            (arb_meta(), any::<u32>()).prop_map(|(meta, parent)| Record::CreateLayer { meta, parent }),
            (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>())
                .prop_map(|(id, vstart, pstart, count)| Record::MapLayer { id, vstart, pstart, count }),
            (any::<u32>(), any::<u32>(), any::<[u64; 4]>()).prop_map(|(id, vc, granules)| Record::Hold {
                id,
                vc,
                granules
            }),
            any::<u32>().prop_map(|id| Record::Hide { id }),
            any::<u32>().prop_map(|id| Record::Fold { id }),
            any::<u32>().prop_map(|id| Record::Detach { id }),
        ]
    }

    fn arb_meta() -> impl Strategy<Value = VolumeMeta> {
        (any::<u32>(), "[a-z]{1,63}", any::<u64>(), any::<bool>(), any::<[u8; 16]>())
            .prop_map(|(id, name, size, thin, uuid)| VolumeMeta { id, name, size, thin, uuid, nguid: uuid })
    }

    proptest! {
        #[test]
        fn journal_entries_round_trip(recs in proptest::collection::vec(arb_record(), 0..40), generation: u64, seq: u64) {
            let b = encode_entry(&[3; 16], generation, seq, &recs);
            prop_assert_eq!(b.len() as u64 % BLOCK, 0);
            let (h, back) = decode_entry(&[3; 16], &b).unwrap();
            prop_assert_eq!((h.generation, h.seq), (generation, seq));
            prop_assert_eq!(back, recs);
            // Another pool's entry, or any flipped bit, is not accepted.
            prop_assert!(decode_entry(&[4; 16], &b).is_none());
            let mut torn = b.clone();
            let at = (seq as usize) % (HEADER_LEN + 4);
            torn[at] ^= 0x10;
            prop_assert!(decode_entry(&[3; 16], &torn).is_none());
        }

        #[test]
        fn checkpoints_round_trip(
            maps in proptest::collection::vec(proptest::collection::btree_map(0u32..500, 1u32..5000, 0..50), 0..6),
            layered in any::<bool>(),
            held in any::<[u64; 4]>(),
        ) {
            let mut s = PoolState { next_id: 99, open_boot: [9; 16], power_losses: 3, ..PoolState::default() };
            for (i, map) in maps.into_iter().enumerate() {
                let id = i as u32 * 3;
                let meta = VolumeMeta { id, name: format!("v{i}"), size: 1 << 30, thin: i % 2 == 0, uuid: [i as u8; 16], nguid: [1; 16] };
                let generations = Generations { taken: i as u64 * 7, fenced_at: i as u64 };
                let mut v = VolumeState { map, generations, ..VolumeState::new(meta) };
                // Some volumes lie over the one before, hold part of their first cluster,
                // and are snapshots or hidden.
                if layered && i > 0 {
                    v.layer = Layer { parent: Some(id - 3), kind: [VolumeKind::Volume, VolumeKind::Snapshot, VolumeKind::Hidden][i % 3] };
                    if let Some(&vc) = v.map.keys().next() {
                        v.partial.insert(vc, held);
                    }
                }
                s.volumes.insert(id, v);
            }
            let b = encode_checkpoint(&[5; 16], 42, &s);
            let (g, back) = decode_checkpoint(&[5; 16], &b).unwrap();
            prop_assert_eq!(g, 42);
            prop_assert_eq!(back, s);
        }
    }

    #[test]
    fn extents_merge_runs() {
        let map: BTreeMap<u32, u32> = [(0, 10), (1, 11), (2, 12), (3, 20), (5, 21), (6, 22)].into_iter().collect();
        assert_eq!(extents(&map), vec![(0, 10, 3), (3, 20, 1), (5, 21, 2)]);
    }

    #[test]
    fn layout_fits_the_largest_state() {
        let clusters = 3000u64;
        let l = MetaLayout::for_pool(clusters, 1 << 20, VERSION);
        let mut s = PoolState::default();
        // Worst case: every cluster its own extent and held in part, in as many
        // volumes as allowed, each a layer.
        for id in 0..MAX_VOLUMES {
            let map = (0..clusters as u32)
                .filter(|c| c % u64::from(MAX_VOLUMES) as u32 == id)
                .map(|c| (c * 2, c + 1))
                .collect();
            let meta = VolumeMeta {
                id,
                name: format!("volume-{id:0>50}"),
                size: 1 << 40,
                thin: true,
                uuid: [0; 16],
                nguid: [0; 16],
            };
            s.volumes.insert(id, VolumeState { map, ..VolumeState::new(meta) });
        }
        // Version 1 has no layers.
        let v1 = MetaLayout::for_pool(clusters, 1 << 20, 1);
        assert!(encode_checkpoint(&[0; 16], 1, &s).len() as u64 <= v1.checkpoint_size);
        for v in s.volumes.values_mut() {
            v.layer = Layer { parent: Some(v.meta.id + 1), kind: VolumeKind::Hidden };
            v.partial = v.map.keys().map(|&vc| (vc, [1; 4])).collect();
        }
        assert!(encode_checkpoint(&[0; 16], 1, &s).len() as u64 <= l.checkpoint_size);
        assert_eq!(l.journal_offset, BLOCK + 2 * l.checkpoint_size);
    }

    fn meta(id: u32, name: &str) -> VolumeMeta {
        VolumeMeta { id, name: name.into(), size: 4 << 20, thin: true, uuid: [id as u8; 16], nguid: [0; 16] }
    }

    #[test]
    fn a_snapshot_takes_the_map_and_the_volume_lies_over_it() {
        const CS: u64 = 1 << 20;
        let mut s = PoolState::default();
        s.apply(&Record::CreateVolume(meta(1, "db")), CS).unwrap();
        s.apply(&Record::Map { id: 1, vstart: 0, pstart: 10, count: 2 }, CS).unwrap();
        s.apply(&Record::TakeSnapshot { id: 1, snapshot: meta(2, "db@1") }, CS).unwrap();
        let (db, snap) = (&s.volumes[&1], &s.volumes[&2]);
        assert!(db.map.is_empty() && db.layer == Layer { parent: Some(2), kind: VolumeKind::Volume });
        assert_eq!(snap.map.len(), 2);
        assert_eq!(snap.layer, Layer { parent: None, kind: VolumeKind::Snapshot });
        assert_eq!(s.next_id, 3);
        // The first write over the snapshot maps a cluster that holds no granule, then
        // holds what it wrote; all of them make it whole.
        s.apply(&Record::MapLayer { id: 1, vstart: 1, pstart: 20, count: 1 }, CS).unwrap();
        assert_eq!(s.volumes[&1].partial[&1], [0; 4]);
        s.apply(&Record::Hold { id: 1, vc: 1, granules: [1, 0, 0, 0] }, CS).unwrap();
        assert_eq!(s.volumes[&1].partial[&1], [1, 0, 0, 0]);
        s.apply(&Record::Hold { id: 1, vc: 1, granules: ALL_GRANULES }, CS).unwrap();
        assert!(s.volumes[&1].partial.is_empty() && s.volumes[&1].map[&1] == 20);
        // A second snapshot lies over the first; a clone over the second.
        s.apply(&Record::TakeSnapshot { id: 1, snapshot: meta(3, "db@2") }, CS).unwrap();
        s.apply(&Record::CreateLayer { meta: meta(4, "copy"), parent: 3 }, CS).unwrap();
        assert_eq!(s.chain(1), vec![3, 2]);
        assert_eq!(s.chain(4), vec![3, 2]);
        assert_eq!(s.layers_over(3).count(), 2);
        // What lies over a snapshot keeps it: it can only be hidden.
        assert!(s.apply(&Record::DeleteVolume { id: 3 }, CS).unwrap_err().contains("lies over"));
        s.apply(&Record::Hide { id: 3 }, CS).unwrap();
        assert!(s.apply(&Record::CreateLayer { meta: meta(5, "late"), parent: 3 }, CS).is_err());
        assert!(s.apply(&Record::TakeSnapshot { id: 2, snapshot: meta(6, "x") }, CS).is_err());
        s.apply(&Record::DeleteVolume { id: 4 }, CS).unwrap();
        s.apply(&Record::DeleteVolume { id: 1 }, CS).unwrap();
        s.apply(&Record::DeleteVolume { id: 3 }, CS).unwrap();
        s.apply(&Record::DeleteVolume { id: 2 }, CS).unwrap();
        assert!(s.volumes.is_empty());
        // Every cluster was named by one map at a time.
        assert!(s.used_clusters().unwrap().is_empty());
    }

    #[test]
    fn a_chain_is_bounded() {
        const CS: u64 = 1 << 20;
        let mut s = PoolState::default();
        s.apply(&Record::CreateVolume(meta(1, "db")), CS).unwrap();
        for i in 0..MAX_CHAIN as u32 {
            s.apply(&Record::TakeSnapshot { id: 1, snapshot: meta(2 + i, &format!("s{i}")) }, CS).unwrap();
        }
        let err = s.apply(&Record::TakeSnapshot { id: 1, snapshot: meta(100, "one-more") }, CS).unwrap_err();
        assert!(err.contains("lies over"), "{err}");
    }
}

//! What the reactors use of a pool, without a lock: where clusters live, the epochs
//! that keep a released cluster from being reused under in-flight I/O, and the queue
//! to the metadata thread.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvpool_wire::Status;

use super::cluster_map::VolumeMap;
use crate::disk::Disk;
use crate::granules::Granules;
use crate::sync::lock;

/// Most reactors whose in-flight I/O a pool tracks.
pub const MAX_REACTORS: usize = 256;

/// How a pool request ends: called once, on the metadata thread.
pub type Done = Box<dyn FnOnce(Status) + Send>;

/// Work a reactor hands to the pool's metadata thread.
pub enum MetaRequest {
    /// Allocate every unallocated cluster in `first..first + count` of a volume.
    Allocate {
        /// Volume ID.
        volume: u32,
        /// First virtual cluster.
        first: u64,
        /// Number of clusters.
        count: u64,
        /// Completion.
        done: Done,
    },
    /// Zero byte ranges of a volume, releasing whole clusters of thin volumes.
    Zero {
        /// Volume ID.
        volume: u32,
        /// (offset, length) in bytes.
        ranges: Vec<(u64, u64)>,
        /// Completion.
        done: Done,
    },
    /// Write `data` at byte `offset` of a volume that lies over a snapshot, where its
    /// clusters do not hold every granule written: written, synced and recorded held
    /// before `done` (`Pool::write_layers`).
    WriteLayer {
        /// Volume ID.
        volume: u32,
        /// Byte offset.
        offset: u64,
        /// The data.
        data: Vec<u8>,
        /// Completion.
        done: Done,
    },
    /// Record held the granules a reactor wrote straight into a volume's clusters over
    /// its snapshot (`Pool::record_held`), and let go of their claims.
    RecordHeld {
        /// Volume ID.
        volume: u32,
        /// (virtual cluster, the physical cluster written, the granules filled).
        pieces: Vec<(u64, u32, Granules)>,
        /// False if the write failed: nothing is recorded, the claims go.
        written: bool,
        /// A FUA write's: the record is durable before `done`. Another's is written,
        /// and durable with the next Flush (which syncs the disk it is on).
        durable: bool,
        /// Completion.
        done: Done,
    },
    /// Make a volume's generations durable, if they rose (`Pool::persist_generations`).
    PersistGenerations {
        /// Volume ID.
        volume: u32,
        /// Completion.
        done: Done,
    },
}

/// One member disk, open.
pub struct PoolDisk {
    /// The disk as the reactors address it (direct I/O where possible).
    pub file: Arc<Disk>,
    /// Path it was opened by.
    pub path: PathBuf,
    /// First global cluster number on this disk.
    pub(super) first: u32,
    pub(super) clusters: u32,
    pub(super) data_offset: u64,
}

#[repr(align(64))]
#[derive(Default)]
pub(super) struct InFlight([AtomicU32; 2]);

/// What the reactors need of a pool: where clusters live, the epochs, and the way to
/// the metadata thread.
pub struct PoolShared {
    pub(super) disks: Vec<PoolDisk>,
    pub(super) cluster_shift: u32,
    pub(super) epoch: AtomicU64,
    pub(super) in_flight: Box<[InFlight]>,
    pub(super) requests: Mutex<Sender<MetaRequest>>,
    /// The pool's metadata, which the metadata thread writes; a reactor only ever
    /// tries it (`PoolShared::record_held_here`).
    pub(super) metadata: Arc<Mutex<super::Inner>>,
}

impl PoolShared {
    /// log2 of the cluster size.
    pub fn cluster_shift(&self) -> u32 {
        self.cluster_shift
    }

    /// The member disks.
    pub fn disks(&self) -> &[PoolDisk] {
        &self.disks
    }

    /// Counts an I/O that is about to read cluster maps; returns the epoch to leave.
    pub fn enter(&self, reactor: usize) -> u8 {
        let e = (self.epoch.load(Ordering::SeqCst) & 1) as u8;
        self.in_flight[reactor % MAX_REACTORS].0[usize::from(e)].fetch_add(1, Ordering::SeqCst);
        e
    }

    /// Uncounts an I/O counted by [`PoolShared::enter`].
    pub fn leave(&self, reactor: usize, epoch: u8) {
        self.in_flight[reactor % MAX_REACTORS].0[usize::from(epoch)].fetch_sub(1, Ordering::Release);
    }

    /// The disk and byte offset of `within` bytes into physical cluster `pc`.
    pub fn locate(&self, pc: u32, within: u64) -> Option<(&Disk, u64)> {
        let d = self.disks.iter().find(|d| pc >= d.first && pc < d.first + d.clusters)?;
        Some((&d.file, d.data_offset + (u64::from(pc - d.first) << self.cluster_shift) + within))
    }

    /// Hands work to the metadata thread.
    pub fn request(&self, r: MetaRequest) {
        if let Err(mpsc::SendError(r)) = lock(&self.requests).send(r) {
            // The pool was exported: nothing can be allocated any more.
            match r {
                MetaRequest::Allocate { done, .. }
                | MetaRequest::Zero { done, .. }
                | MetaRequest::WriteLayer { done, .. }
                | MetaRequest::RecordHeld { done, .. }
                | MetaRequest::PersistGenerations { done, .. } => done(Status::NAMESPACE_NOT_READY),
            }
        }
    }

    /// Waits until no I/O that might have read a map before now is in flight.
    pub(super) fn drain(&self) {
        let old = (self.epoch.fetch_add(1, Ordering::SeqCst) & 1) as usize;
        let start = Instant::now();
        let mut next_warning = start + Duration::from_secs(30);
        while self.in_flight.iter().any(|c| c.0[old].load(Ordering::SeqCst) != 0) {
            if Instant::now() >= next_warning {
                let waited = start.elapsed().as_secs();
                tracing::warn!("pool I/O has been in flight for {waited} s while releasing clusters; still waiting");
                next_warning += Duration::from_secs(30);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// A volume as the data path sees it.
#[derive(Clone)]
pub struct VolumeIo {
    /// The pool.
    pub pool: Arc<PoolShared>,
    /// The cluster map at the size the namespace was created with.
    pub map: Arc<VolumeMap>,
    /// Volume ID.
    pub id: u32,
    /// A snapshot's: it takes no write.
    pub read_only: bool,
}

impl std::fmt::Debug for VolumeIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "volume {}", self.id)
    }
}

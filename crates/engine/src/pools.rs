//! The engine's pools and volumes: management on top of [`crate::pool`], and volumes
//! exported as namespaces.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use nvpool_api::{DirtyAction, DirtyReport, SnapshotInfo, VolumeIdentity, WrittenClusters};

use crate::backend::gate::Gate;
use crate::backend::volume;
use crate::error::{Error, Result};
use crate::nvme::{Namespace, Subsystem, Target};
use crate::pool::cluster_map::GenerationRecord;
use crate::pool::{CreateOptions, DEFAULT_CLUSTER_SIZE, Pool, PoolInfo, VolumeInfo};
use crate::reactor::Links;
use crate::sync::lock;

/// The longest a snapshot holds its volume's new commands, waiting for those under
/// way: past it, no snapshot is taken.
const SNAPSHOT_PAUSE: Duration = Duration::from_secs(1);

/// The gate of a namespace that serves a pool volume.
fn gate(ns: &Arc<Namespace>) -> Option<&Gate> {
    ns.backend.as_volume().map(|v| &v.gate)
}

/// A volume identity's UUID and NGUID as bytes.
fn parse_identity(id: &VolumeIdentity) -> Result<([u8; 16], [u8; 16])> {
    let uuid = uuid::Uuid::parse_str(&id.uuid).map_err(|e| {
        Error::invalid(format!("UUID {:?} is not valid ({e}): give it as 8-4-4-4-12 hex digits", id.uuid))
    })?;
    let nguid = (id.nguid.len() == 32)
        .then(|| (0..16).map(|i| u8::from_str_radix(&id.nguid[2 * i..2 * i + 2], 16).ok()).collect::<Option<Vec<u8>>>())
        .flatten()
        .and_then(|b| <[u8; 16]>::try_from(b).ok())
        .ok_or_else(|| Error::invalid(format!("NGUID {:?} is not valid: give it as 32 hex digits", id.nguid)))?;
    Ok((*uuid.as_bytes(), nguid))
}

fn canonical(p: &Path) -> PathBuf {
    p.canonicalize().unwrap_or_else(|_| p.to_path_buf())
}

/// The engine's open pools.
pub struct Pools {
    pools: Mutex<BTreeMap<String, Arc<Pool>>>,
    target: Arc<Target>,
    links: Links,
    /// The replicated volumes whose writes this engine holds, by pool and volume.
    holds: Arc<Mutex<BTreeMap<(String, String), WriteHold>>>,
}

/// A replicated volume's writes held by its serving engine while every replica takes
/// the same snapshot: until the serving engine takes its own, or the deadline.
struct WriteHold {
    /// The mirrors held (the volume's exports that fan out).
    mirrors: Vec<Arc<Namespace>>,
    since: Instant,
    /// Tells this hold from a later one of the same volume (for the deadline's thread).
    serial: u64,
}

/// The longest a replicated volume's writes are held for its snapshot: what the
/// controller has to take it on every replica.
pub const MAX_WRITE_HOLD: Duration = Duration::from_secs(10);

static NEXT_HOLD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn release(hold: WriteHold) {
    for ns in &hold.mirrors {
        if let Some(m) = ns.backend.as_mirror() {
            let _ = m.hold_writes(false, Duration::ZERO);
        }
    }
}

impl Pools {
    /// No pool open yet.
    pub fn new(target: Arc<Target>, links: Links) -> Pools {
        Pools { pools: Mutex::new(BTreeMap::new()), target, links, holds: Arc::default() }
    }

    /// The open pool named `name`.
    pub fn get(&self, name: &str) -> Result<Arc<Pool>> {
        lock(&self.pools).get(name).cloned().ok_or_else(|| {
            Error::not_found(format!(
                "no pool {name}: `nvpool engine pool list` shows the pools, `nvpool engine pool import` opens one"
            ))
        })
    }

    fn check_disks_free(&self, disks: &[PathBuf]) -> Result<()> {
        for p in lock(&self.pools).values() {
            for d in p.shared().disks() {
                if let Some(dup) = disks.iter().find(|x| canonical(x) == canonical(&d.path)) {
                    return Err(Error::precondition(format!("{} is already a disk of pool {}", dup.display(), p.name)));
                }
            }
        }
        Ok(())
    }

    fn add_pool(&self, pool: Arc<Pool>) -> Result<PoolInfo> {
        let mut pools = lock(&self.pools);
        if pools.contains_key(&pool.name) {
            pool.close();
            return Err(Error::exists(format!("a pool named {} is already open: export it first", pool.name)));
        }
        let info = pool.info();
        pools.insert(pool.name.clone(), pool);
        Ok(info)
    }

    /// Claims disks as a new pool.
    pub fn create(&self, name: &str, disks: &[PathBuf], cluster_size: Option<u64>, force: bool) -> Result<PoolInfo> {
        if lock(&self.pools).contains_key(name) {
            return Err(Error::exists(format!("a pool named {name} already exists: pick another name")));
        }
        self.check_disks_free(disks)?;
        let o = CreateOptions { cluster_size: cluster_size.unwrap_or(DEFAULT_CLUSTER_SIZE), force };
        self.add_pool(Pool::create(name, disks, &o)?)
    }

    /// Opens the pool on `disks`, or where none of them holds a pool yet and `create`
    /// names one, claims them as that pool (refusing disks that hold data, as `create`
    /// without force does): a configuration that names a node's disks once serves from
    /// its first start on, and never formats a pool's disks again.
    pub fn import_or_create(&self, disks: &[PathBuf], create: Option<&str>) -> Result<PoolInfo> {
        match create {
            Some(name) if !Pool::any_disk_has_pool(disks)? => self.create(name, disks, None, false),
            _ => self.import(disks),
        }
    }

    /// Opens an existing pool from its disks.
    pub fn import(&self, disks: &[PathBuf]) -> Result<PoolInfo> {
        self.check_disks_free(disks)?;
        self.add_pool(Pool::import(disks)?)
    }

    /// Closes a pool; its disks keep everything. Refused while a volume is exported.
    pub fn export(&self, name: &str) -> Result<()> {
        let pool = self.get(name)?;
        if let Some((s, ns)) = self.exports(&pool, None).first() {
            return Err(Error::precondition(format!(
                "pool {name} has a volume exported as namespace {} of {}: remove the namespace first",
                ns.nsid, s.nqn
            )));
        }
        pool.close();
        lock(&self.pools).remove(name);
        Ok(())
    }

    /// Every open pool.
    pub fn list(&self) -> Vec<PoolInfo> {
        lock(&self.pools).values().map(|p| p.info()).collect()
    }

    /// Every volume's allocated bytes, as (pool, volume, bytes).
    pub fn allocations(&self) -> Vec<(String, String, u64)> {
        lock(&self.pools).values().flat_map(|p| p.allocations()).collect()
    }

    /// Namespaces serving volumes of `pool` (all, or volume `id`'s).
    pub fn exports(&self, pool: &Arc<Pool>, id: Option<u32>) -> Vec<(Arc<Subsystem>, Arc<Namespace>)> {
        let mut out = Vec::new();
        for s in self.target.subsystems() {
            for ns in s.namespaces().values() {
                if let Some(v) = ns.backend.as_volume()
                    && Arc::ptr_eq(&v.volume.pool, pool.shared())
                    && id.is_none_or(|i| i == v.volume.id)
                {
                    out.push((s.clone(), ns.clone()));
                }
            }
        }
        out
    }

    /// Creates a volume, with the namespace identity given or a new one.
    pub fn create_volume(
        &self,
        pool: &str,
        name: &str,
        size: u64,
        thin: bool,
        identity: Option<&VolumeIdentity>,
    ) -> Result<VolumeInfo> {
        let identity = identity.map(parse_identity).transpose()?;
        self.get(pool)?.create_volume(name, size, thin, identity)
    }

    /// Deletes a volume or a snapshot. Refused while it is exported; a snapshot that
    /// clones or later snapshots lie over is hidden until they go.
    pub fn delete_volume(&self, pool: &str, name: &str) -> Result<()> {
        let p = self.get(pool)?;
        let (io, _) = p.open_volume(name)?;
        if let Some((s, ns)) = self.exports(&p, Some(io.id)).first() {
            return Err(Error::precondition(format!(
                "volume {pool}/{name} is exported as namespace {} of {}: remove the namespace first",
                ns.nsid, s.nqn
            )));
        }
        let kept_by = p.delete_volume(name)?;
        if !kept_by.is_empty() {
            tracing::info!(pool, name, "the snapshot is hidden, and goes once {} go", kept_by.join(", "));
        }
        Ok(())
    }

    /// Holds every write of replicated volume `pool/volume` (its exports here that
    /// fan out to the replicas) and waits for those under way, so that each replica
    /// can take a snapshot at one point in the write order: until `take_snapshot` of
    /// the volume here, `release_writes`, or `limit` (at most [`MAX_WRITE_HOLD`]),
    /// whichever comes first.
    pub fn hold_writes(&self, pool: &str, volume: &str, limit: Duration) -> Result<()> {
        let p = self.get(pool)?;
        let (io, _) = p.open_volume(volume)?;
        let mirrors: Vec<Arc<Namespace>> = self
            .exports(&p, Some(io.id))
            .into_iter()
            .map(|(_, ns)| ns)
            .filter(|ns| ns.backend.as_mirror().is_some())
            .collect();
        if mirrors.is_empty() {
            return Err(Error::precondition(format!(
                "volume {pool}/{volume} is not served to its replicas here: only a replicated volume's serving \
                 engine holds its writes"
            )));
        }
        self.release_writes(pool, volume);
        let since = Instant::now();
        for (i, ns) in mirrors.iter().enumerate() {
            let held = ns.backend.as_mirror().map_or(Ok(()), |m| m.hold_writes(true, SNAPSHOT_PAUSE));
            if let Err(e) = held {
                release(WriteHold { mirrors: mirrors[..i].to_vec(), since, serial: 0 });
                return Err(e);
            }
        }
        let key = (pool.to_string(), volume.to_string());
        let serial = NEXT_HOLD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        lock(&self.holds).insert(key.clone(), WriteHold { mirrors, since, serial });
        let holds = self.holds.clone();
        let limit = limit.min(MAX_WRITE_HOLD);
        let deadline = std::thread::Builder::new().name("write-hold".into()).spawn(move || {
            std::thread::sleep(limit);
            let mut held = lock(&holds);
            if held.get(&key).is_some_and(|h| h.serial == serial) {
                let hold = held.remove(&key);
                drop(held);
                tracing::warn!(
                    pool = key.0,
                    volume = key.1,
                    "a snapshot's hold of the volume's writes ran past {limit:?}: writes go on, and no snapshot was \
                     taken here"
                );
                hold.into_iter().for_each(release);
            }
        });
        if let Err(e) = deadline {
            self.release_writes(pool, volume);
            return Err(Error::io("cannot start the write hold's deadline", e));
        }
        Ok(())
    }

    /// Lets a volume's writes held by `hold_writes` go on (nothing if none are).
    pub fn release_writes(&self, pool: &str, volume: &str) {
        let hold = lock(&self.holds).remove(&(pool.to_string(), volume.to_string()));
        hold.into_iter().for_each(release);
    }

    /// Takes snapshot `name` of volume `volume`, crash-consistent: every export of the
    /// volume holds new commands while those under way finish (for at most
    /// `SNAPSHOT_PAUSE`), the snapshot is recorded, and they go on. A replicated
    /// volume's serving engine takes it only under `hold_writes` (the other replicas
    /// took theirs meanwhile), and lets the writes go on after it; the snapshot takes
    /// the identity given (every replica's copy has the same).
    pub fn take_snapshot(
        &self,
        pool: &str,
        volume: &str,
        name: &str,
        identity: Option<&VolumeIdentity>,
    ) -> Result<SnapshotInfo> {
        let taken = self.take_snapshot_held(pool, volume, name, identity);
        let hold = lock(&self.holds).remove(&(pool.to_string(), volume.to_string()));
        let since = hold.as_ref().map(|h| h.since);
        hold.into_iter().for_each(release);
        let (snapshot, held) = taken?;
        Ok(SnapshotInfo { snapshot, pause_us: since.unwrap_or(held).elapsed().as_micros() as u64 })
    }

    fn take_snapshot_held(
        &self,
        pool: &str,
        volume: &str,
        name: &str,
        identity: Option<&VolumeIdentity>,
    ) -> Result<(VolumeInfo, Instant)> {
        let identity = identity.map(parse_identity).transpose()?;
        let p = self.get(pool)?;
        let (io, _) = p.open_volume(volume)?;
        let gates: Vec<Arc<Namespace>> = self.exports(&p, Some(io.id)).into_iter().map(|(_, ns)| ns).collect();
        if gates.iter().any(|ns| gate(ns).is_some_and(|g| g.busy())) {
            return Err(Error::precondition(format!(
                "volume {pool}/{volume} is moving: take its snapshot once it has moved"
            )));
        }
        let unheld = |ns: &Arc<Namespace>| ns.backend.as_mirror().is_some_and(|m| !m.writes_held());
        if gates.iter().any(unheld) {
            return Err(Error::precondition(format!(
                "volume {pool}/{volume} is replicated: its snapshot is taken on every replica at once \
                 (`nvpool snapshot create`), which holds its writes here first"
            )));
        }
        let held = Instant::now();
        gates.iter().filter_map(gate).for_each(Gate::hold);
        while !gates.iter().filter_map(gate).all(Gate::drained) {
            if held.elapsed() > SNAPSHOT_PAUSE {
                gates.iter().filter_map(gate).for_each(Gate::open);
                return Err(Error::unavailable(format!(
                    "volume {pool}/{volume}'s commands under way did not finish within {SNAPSHOT_PAUSE:?}: no \
                     snapshot was taken; retry"
                )));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        // A mirror that replaced the held one (the replicas changed meanwhile) is not
        // held: the copies the others took may not be this one's point.
        let taken = if self.exports(&p, Some(io.id)).iter().any(|(_, ns)| unheld(ns)) {
            Err(Error::unavailable(format!(
                "volume {pool}/{volume}'s replicas changed while its snapshot was taken: no snapshot was taken; retry"
            )))
        } else {
            p.take_snapshot(volume, name, identity)
        };
        gates.iter().filter_map(gate).for_each(Gate::open);
        Ok((taken?, held))
    }

    /// Makes volume `name`, a clone of snapshot `snapshot`.
    pub fn clone_volume(
        &self,
        pool: &str,
        snapshot: &str,
        name: &str,
        identity: Option<&VolumeIdentity>,
    ) -> Result<VolumeInfo> {
        let identity = identity.map(parse_identity).transpose()?;
        self.get(pool)?.create_clone(name, snapshot, identity)
    }

    /// Starts inflating volume `name` in the background (see `Pool::inflate_volume`).
    pub fn inflate_volume(&self, pool: &str, name: &str) -> Result<VolumeInfo> {
        self.get(pool)?.inflate_volume(name)
    }

    /// Grows a volume and the namespaces that serve it as a volume or as a replica
    /// export; those that mirror it (its serving engine's) are the caller's to grow,
    /// once the other replicas have grown.
    pub fn resize_volume(&self, pool: &str, name: &str, size: u64) -> Result<VolumeInfo> {
        let p = self.get(pool)?;
        let (io, _) = p.open_volume(name)?;
        let info = p.resize_volume(name, size)?;
        for (s, ns) in self.exports(&p, Some(io.id)) {
            if ns.backend.as_mirror().is_some() {
                continue;
            }
            let replica = ns.backend.as_volume().is_some_and(|v| v.is_replica());
            let opened = if replica { volume::open_replica(&p, name)? } else { volume::open(&p, name)? };
            let (uuid, nguid) =
                opened.identity.ok_or_else(|| Error::internal("a volume backend without its identity"))?;
            let mut grown = Namespace::new(ns.nsid, opened.backend, ns.block_size(), uuid, nguid)?;
            grown.ana_group = ns.ana_group;
            // Hosts see the same namespace, grown: its counters, limits and reservations go on.
            grown.stats = ns.stats.clone();
            grown.qos = ns.qos.clone();
            grown.reservations = ns.reservations.clone();
            // A replica's writer keeps writing under the reservation it holds.
            if let Some(key) = grown.reservations.holder_key() {
                grown.backend.reservation_taken(key);
            }
            s.replace_namespace(grown)?;
        }
        self.kick_all();
        Ok(info)
    }

    /// Volumes of one pool, or of all.
    pub fn volumes(&self, pool: Option<&str>) -> Result<Vec<VolumeInfo>> {
        match pool {
            Some(p) => Ok(self.get(p)?.volumes()),
            None => Ok(lock(&self.pools).values().flat_map(|p| p.volumes()).collect()),
        }
    }

    /// One volume.
    pub fn volume(&self, pool: &str, name: &str) -> Result<VolumeInfo> {
        self.get(pool)?.volume(name)
    }

    /// Starts, stops, reports or resets a volume's dirty-cluster tracking.
    pub fn volume_dirty(&self, pool: &str, name: &str, action: DirtyAction) -> Result<DirtyReport> {
        let p = self.get(pool)?;
        match action {
            DirtyAction::Start => p.set_dirty_tracking(name, true)?,
            DirtyAction::Stop => p.set_dirty_tracking(name, false)?,
            DirtyAction::Report | DirtyAction::Reset => {}
        }
        let clusters = match action {
            DirtyAction::Report => p.dirty_clusters(name, false)?,
            DirtyAction::Reset => p.dirty_clusters(name, true)?,
            _ => Vec::new(),
        };
        let info = p.volume(name)?;
        Ok(DirtyReport { tracking: info.dirty_tracking, cluster_size: p.cluster_size(), clusters })
    }

    /// The clusters of volume `pool/name` written at `generation` or later.
    pub fn written_since(&self, pool: &str, name: &str, generation: u64) -> Result<WrittenClusters> {
        let p = self.get(pool)?;
        let (io, _) = p.open_volume(name)?;
        Ok(WrittenClusters {
            generation: io.map.generation(),
            cluster_size: p.cluster_size(),
            clusters: io.map.written_since(generation).into_iter().map(|(vc, _)| vc).collect(),
            complete: io.map.records_since(generation),
        })
    }

    /// Checks a pool's metadata and space accounting.
    pub fn check(&self, pool: &str) -> Result<()> {
        self.get(pool)?.check()
    }

    /// The disks of every pool, by pool (a hot upgrade's image).
    pub fn disk_paths(&self) -> Vec<Vec<PathBuf>> {
        lock(&self.pools).values().map(|p| p.disk_paths()).collect()
    }

    /// The generation records of replicated volumes, as (pool, volume, record): what a
    /// hot upgrade hands on so that a replica that is away can still come back with a
    /// partial rebuild.
    pub fn generation_records(&self) -> Vec<(String, String, GenerationRecord)> {
        let pools = lock(&self.pools);
        pools
            .iter()
            .flat_map(|(name, p)| p.generation_records().into_iter().map(|(v, r)| (name.clone(), v, r)))
            .collect()
    }

    /// Gives a volume back its generation record (the new process of a hot upgrade).
    pub fn restore_generation_record(&self, pool: &str, volume: &str, record: &GenerationRecord) -> Result<()> {
        self.get(pool)?.restore_generation_record(volume, record)
    }

    /// Checkpoints every pool (a hot upgrade's new process replays no journal).
    pub fn checkpoint_all(&self) -> Result<()> {
        for p in lock(&self.pools).values() {
            p.checkpoint()?;
        }
        Ok(())
    }

    /// Takes every pool back after a hot upgrade that did not happen.
    pub fn take_back_all(&self) {
        for p in lock(&self.pools).values() {
            p.take_back();
        }
    }

    /// Closes every pool (the engine stops): cleanly, recording that the disks have
    /// every write, unless a hot upgrade's new process holds them now.
    pub fn close_all(&self, cleanly: bool) {
        for p in lock(&self.pools).values() {
            if cleanly { p.close_cleanly() } else { p.close() }
        }
    }

    fn kick_all(&self) {
        for l in self.links.iter() {
            l.run(|r| r.kick());
        }
    }
}

//! Inflating a volume that lies over snapshots (a clone): in the background, every
//! cluster it reads from below becomes its own and whole, and then it lies over
//! nothing, so the snapshots it came from can go.
//!
//! Each step copies up to `INFLATE_BATCH` clusters under the pool's metadata lock,
//! like the metadata thread's writes over a snapshot, so those never interleave with
//! it. A cluster the volume holds in part gets the granules it lacks (the snapshots'
//! bytes, or zeroes where none has any) and one `Hold` makes it whole; a cluster it
//! has none of gets a new one, filled the same way and mapped. Data is synced before
//! the step's journal entry, so a crash leaves each cluster as it was or whole, and
//! reads see the same bytes throughout. Direct writes from the reactors (whole
//! granules the layer lacks, `layer_claims.rs`) are kept out of the step's clusters
//! while it copies ([`DirectWritesHeldOff`]): they go to the metadata thread instead.
//!
//! The inflation follows the volume's map, not its name: a snapshot taken of the
//! volume meanwhile takes that map, and it is the snapshot that is inflated (the
//! volume, now an empty layer over it, reads through it and depends on nothing else).

use std::sync::Arc;
use std::time::Duration;

use nvpool_api::InflateProgress;

use super::cluster_map::VolumeMap;
use super::format::{self, Record};
use super::{Inner, Pool, VolumeInfo, io_err};
use crate::bufpool::Buf;
use crate::error::{Error, Result};
use crate::granules::{ALL_GRANULES, Granules, whole_granules};
use crate::sync::lock;

/// Clusters copied in one step: the pool's metadata lock is held while they copy.
const INFLATE_BATCH: usize = 8;

/// Keeps the reactors' direct writes out of some clusters of a layer while the pool
/// copies granules into them (a fold or an inflation). A new write there goes to the
/// metadata thread, which waits for the pool's lock; the direct writes already under
/// way are waited for when it is made, so it must be made without that lock.
pub(super) struct DirectWritesHeldOff {
    map: Arc<VolumeMap>,
    vcs: Vec<u64>,
}

impl DirectWritesHeldOff {
    pub(super) fn new(map: Arc<VolumeMap>, vcs: Vec<u64>) -> DirectWritesHeldOff {
        for &vc in &vcs {
            map.claims().queue(vc, vc);
        }
        // A direct write's claim goes once its granules are recorded held.
        while vcs.iter().any(|&vc| map.claims().direct_under(vc, &ALL_GRANULES)) {
            std::thread::sleep(Duration::from_micros(100));
        }
        DirectWritesHeldOff { map, vcs }
    }
}

impl Drop for DirectWritesHeldOff {
    fn drop(&mut self) {
        for &vc in &self.vcs {
            self.map.claims().dequeue(vc, vc);
        }
    }
}

/// Copies runs of granules from one physical cluster of the pool to the same place
/// in another (a fold's, an inflation's), through one cluster-sized buffer, and
/// syncs the disks it wrote before their records are committed.
pub(super) struct GranuleCopier {
    buf: Buf,
    touched: Vec<bool>,
}

impl GranuleCopier {
    pub(super) fn new(pool: &Pool) -> GranuleCopier {
        let pages = (pool.cluster_size as usize).div_ceil(4096);
        GranuleCopier { buf: Buf::new(pages), touched: vec![false; pool.shared.disks.len()] }
    }

    /// Bytes `at..at + len` of cluster `from` (zeroes for 0) into cluster `to`.
    pub(super) fn copy(&mut self, pool: &Pool, from: u32, to: u32, at: u64, len: u64, what: &str) -> Result<()> {
        let outside = || Error::internal("cluster outside the pool");
        let (disk, pos) = pool.shared.locate(to, at).ok_or_else(outside)?;
        if from == 0 {
            disk.zero_now(pos, len).map_err(io_err(what))?;
        } else {
            let (src, src_pos) = pool.shared.locate(from, at).ok_or_else(outside)?;
            let data = &mut self.buf.as_mut_slice()[..len as usize];
            src.read_now(data, src_pos).map_err(io_err(what))?;
            disk.write_now(data, pos).map_err(io_err(what))?;
        }
        if let Some(i) = pool.shared.disks.iter().position(|d| std::ptr::eq(&*d.file, disk)) {
            self.touched[i] = true;
        }
        Ok(())
    }

    /// Makes what was copied durable.
    pub(super) fn sync(&self, pool: &Pool, what: &str) -> Result<()> {
        for (d, _) in pool.shared.disks.iter().zip(&self.touched).filter(|(_, t)| **t) {
            d.file.sync_now().map_err(io_err(what))?;
        }
        Ok(())
    }
}

/// An inflation under way: the map it fills, and how far it is.
pub(super) struct Inflation {
    map: Arc<VolumeMap>,
    pub(super) progress: InflateProgress,
}

impl Inner {
    /// How far the inflation of volume `id` is, if one is under way.
    pub(super) fn inflation_of(&self, id: u32) -> Option<InflateProgress> {
        let map = self.maps.get(&id)?;
        self.inflating.iter().find(|i| Arc::ptr_eq(&i.map, map)).map(|i| i.progress.clone())
    }

    /// Refuses a further step once the pool closes or is handed to a new process.
    fn check_inflating(&self) -> Result<()> {
        match self.stop_inflating {
            true => Err(Error::unavailable(
                "the pool closed or went to a hot upgrade's new process: `volume inflate` again goes on from there",
            )),
            false => Ok(()),
        }
    }

    /// The volume whose map `map` is now (none: deleted).
    fn volume_of(&self, map: &Arc<VolumeMap>) -> Option<u32> {
        self.maps.iter().find(|(_, m)| Arc::ptr_eq(m, map)).map(|(&id, _)| id)
    }
}

impl Pool {
    /// Starts inflating volume `name` in the background (nothing to do for one that
    /// lies over no snapshot, and an inflation under way goes on; one that stopped
    /// starts again from where it was). `volume_get` reports the progress, or why it
    /// stopped; once done, the volume has no parent.
    pub fn inflate_volume(self: &Arc<Self>, name: &str) -> Result<VolumeInfo> {
        let mut inner = lock(&self.inner);
        let id = self.volume_id(&inner, name)?;
        let v = &inner.state.volumes[&id];
        if v.layer.kind != format::VolumeKind::Volume {
            return Err(Error::invalid(format!(
                "{name} is a snapshot: inflate the volumes that lie over it (a snapshot's clone reads what it lacks \
                 from it)"
            )));
        }
        inner.check_inflating()?;
        let under_way = inner.inflation_of(id).is_some_and(|p| p.stopped.is_none());
        if v.layer.parent.is_none() || under_way {
            return Ok(self.volume_info(&inner, id));
        }
        let map = inner.maps[&id].clone();
        let pending = inner.state.inflate_pending(id);
        let new_clusters = pending.iter().filter(|vc| !v.map.contains_key(vc)).count() as u64;
        let free = u64::from(inner.free.free());
        if new_clusters > free {
            let mib = |clusters: u64| (clusters * self.cluster_size) >> 20;
            return Err(Error::precondition(format!(
                "inflating {name} takes {} MiB more of pool {}, which has {} MiB free: free some space (delete \
                 volumes or snapshots) or add a disk first",
                mib(new_clusters),
                self.name,
                mib(free)
            )));
        }
        let progress = InflateProgress { copied: 0, total: pending.len() as u64, stopped: None };
        // This volume's stopped one, and any of a volume deleted since, go.
        let gone: Vec<bool> = inner.inflating.iter().map(|i| inner.volume_of(&i.map).is_none()).collect();
        let mut gone = gone.into_iter();
        inner.inflating.retain(|i| !gone.next().unwrap_or(false) && !Arc::ptr_eq(&i.map, &map));
        inner.inflating.push(Inflation { map: map.clone(), progress });
        let info = self.volume_info(&inner, id);
        drop(inner);
        let (pool, inflated, volume) = (self.clone(), map.clone(), name.to_string());
        let spawned = std::thread::Builder::new()
            .name(format!("inflate-{name}"))
            .spawn(move || pool.inflate_in_background(inflated, &volume));
        if let Err(e) = spawned {
            lock(&self.inner).inflating.retain(|i| !Arc::ptr_eq(&i.map, &map));
            return Err(Error::internal(format!("starting the inflation of {name}: {e}")));
        }
        Ok(info)
    }

    /// Runs an inflation to its end (`name`: the volume's, for the log).
    fn inflate_in_background(&self, map: Arc<VolumeMap>, name: &str) {
        let result = loop {
            match self.inflate_step(&map) {
                Ok(true) => continue,
                Ok(false) => break Ok(()),
                Err(e) => break Err(e),
            }
        };
        let mut inner = lock(&self.inner);
        match result {
            Ok(()) => {
                inner.inflating.retain(|i| !Arc::ptr_eq(&i.map, &map));
                tracing::info!(pool = %self.name, "volume {name} inflated: it lies over no snapshot now");
            }
            // The clusters copied so far stay the volume's; inflating it again goes on.
            Err(e) => {
                tracing::error!(pool = %self.name, "inflating volume {name} stopped: {e}");
                if let Some(i) = inner.inflating.iter_mut().find(|i| Arc::ptr_eq(&i.map, &map)) {
                    i.progress.stopped = Some(e.to_string());
                }
            }
        }
    }

    /// One step of an inflation; false once it is done (or its volume is gone).
    fn inflate_step(&self, map: &Arc<VolumeMap>) -> Result<bool> {
        let vcs: Vec<u64> = {
            let mut inner = lock(&self.inner);
            inner.check_inflating()?;
            let Some(id) = inner.volume_of(map) else { return Ok(false) };
            let pending = inner.state.inflate_pending(id);
            if pending.is_empty() {
                if inner.state.volumes[&id].layer.parent.is_some() {
                    self.commit(&mut inner, &[Record::Detach { id }])?;
                    // A volume goes on with its map over nothing (so that it may move,
                    // for one); a snapshot's map stays: the layer over it holds it.
                    if inner.state.volumes[&id].layer.kind == format::VolumeKind::Volume {
                        let detached = Arc::new(map.detached());
                        map.hand_on(&detached);
                        inner.maps.insert(id, detached);
                    }
                    self.delete_orphans(&mut inner)?;
                }
                drop(inner);
                // A hidden snapshot now under one layer alone folds into it.
                self.fold_hidden();
                return Ok(false);
            }
            pending.into_iter().take(INFLATE_BATCH).map(u64::from).collect()
        };
        let _held_off = DirectWritesHeldOff::new(map.clone(), vcs.clone());
        let mut inner = lock(&self.inner);
        inner.check_inflating()?;
        let Some(id) = inner.volume_of(map) else { return Ok(false) };
        self.inflate_clusters(&mut inner, id, map, &vcs)?;
        Ok(true)
    }

    /// Copies into volume `id` what it reads from below at clusters `vcs`, then
    /// records and publishes them whole.
    fn inflate_clusters(&self, inner: &mut Inner, id: u32, map: &Arc<VolumeMap>, vcs: &[u64]) -> Result<()> {
        let cs = self.cluster_size;
        let shift = cs.trailing_zeros();
        let whole = whole_granules(cs);
        let mut records = Vec::new();
        // (virtual cluster, its cluster, a new one?, the granules filled).
        let mut filled: Vec<(u64, u32, bool, Granules)> = Vec::new();
        let mut copier = GranuleCopier::new(self);
        let result = (|| -> Result<()> {
            for &vc in vcs {
                let v = &inner.state.volumes[&id];
                let (pc, missing, new) = match v.map.get(&(vc as u32)) {
                    Some(&pc) => match v.partial.get(&(vc as u32)) {
                        Some(held) => (pc, std::array::from_fn(|i| !held[i] & whole[i]), false),
                        None => continue,
                    },
                    // Filled from below, zeroes where nothing is: every cluster of the
                    // step ends whole, so each step makes progress.
                    None => (inner.free.take().ok_or_else(|| Error::precondition("the pool is full"))?, whole, true),
                };
                filled.push((vc, pc, new, missing));
                // What the cluster reads from below, run by run (its own granules
                // skipped): copied, or zeroed where nothing below has it.
                let own = map.get(vc);
                let mut runs = Vec::new();
                map.sources(vc, 0, cs, shift, |at, len, from| {
                    if from == 0 || from != own {
                        runs.push((at, len, from));
                    }
                });
                for (at, len, from) in runs {
                    copier.copy(self, from, pc, at, len, "inflating a volume")?;
                }
                records.push(match new {
                    true => Record::Map { id, vstart: vc as u32, pstart: pc, count: 1 },
                    false => Record::Hold { id, vc: vc as u32, granules: missing },
                });
            }
            copier.sync(self, "syncing an inflation")?;
            self.commit(inner, &records)
        })();
        if let Err(e) = result {
            for &(_, pc, new, _) in &filled {
                if new {
                    inner.free.put(pc);
                }
            }
            return Err(e);
        }
        for &(vc, pc, new, missing) in &filled {
            match new {
                true => map.set(vc, pc),
                false => map.hold(vc, missing, whole),
            }
        }
        if let Some(i) = inner.inflating.iter_mut().find(|i| Arc::ptr_eq(&i.map, map)) {
            i.progress.copied = (i.progress.copied + vcs.len() as u64).min(i.progress.total);
        }
        Ok(())
    }
}

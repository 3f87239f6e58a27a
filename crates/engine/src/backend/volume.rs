//! `volume:POOL/NAME`: a logical volume of a disk pool (see [`crate::pool`]).
//!
//! Each piece of a transfer goes to the disk and offset its cluster maps to, so a
//! transfer that crosses a cluster boundary becomes several operations. Reads of
//! unallocated clusters are zeroes. A write to an unallocated cluster, and zeroing or
//! deallocation (which may release clusters), go to the pool's metadata thread first.
//! Every I/O that reads a cluster map is counted under the pool's epoch until its
//! operations complete, so a released cluster is never reused under it. Every command
//! passes the volume's [`Gate`] first, which a migration uses to move the volume.
//!
//! A volume that lies over a snapshot reads what its own clusters do not hold from
//! the snapshot's (down the chain, `VolumeMap::sources`). A write of whole granules it
//! does not hold yet, in clusters it has, goes straight to them with FUA, and the
//! metadata thread records them held before the write completes
//! (`MetaRequest::RecordHeld`, in `settle`); any other write to granules not held
//! goes to the metadata thread, which merges a granule written in part with the
//! snapshot's bytes (`MetaRequest::WriteLayer`). `LayerClaims` keeps the two from
//! crossing in a granule. Later writes there go straight to the cluster. A backend opened before a snapshot of its volume goes on
//! with the volume's new map (its own became the snapshot's).
//!
//! A replicated volume has a replica on each of several engines: the serving engine
//! writes its own as `volume:` under its mirror's generation, and exports each of
//! the others as `replica:`, whose reservation (held by the serving engine, keyed by
//! its generation) the volume records, so that an engine whose generation is over
//! writes neither to another engine's replica nor to its own.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use nvpool_wire::Status;

use super::gate::{Admitted, Gate, ROUTE_HERE};
use super::{Backend, BackendType, BlockIo, DiskQueue, Durable, Handover, OpenEnv, Opened, deallocated_ranges};
use crate::error::{Error, Result};
use crate::granules::{Granules, granule_shift, granules_of};
use crate::plan::IoPlan;
use crate::pool::cluster_map::VolumeMap;
use crate::pool::{MetaRequest, Pool, VolumeIo};

/// The registration of `volume:POOL/NAME`. Opened by a mirror serving at a
/// generation (its local replica), the volume takes that generation, and refuses
/// writes once a later one took it.
pub const TYPE: BackendType = BackendType {
    name: "volume",
    usage: "volume:POOL/NAME",
    check: |arg| parse(arg).map(drop),
    open: |arg, env: &OpenEnv<'_>| {
        let (pool, name) = parse(arg).map_err(Error::invalid)?;
        let pool = (env.pool)(pool)?;
        match env.fence {
            Some(generation) => open_as(&pool, name, Role::Serving(generation)),
            None => open_as(&pool, name, Role::Plain),
        }
    },
};

/// The registration of `replica:POOL/NAME`: a volume exported to the engine that
/// serves it, whose reservation keys are the volume's generations.
pub const REPLICA: BackendType = BackendType {
    name: "replica",
    usage: "replica:POOL/NAME",
    check: |arg| parse(arg).map(drop),
    open: |arg, env: &OpenEnv<'_>| {
        let (pool, name) = parse(arg).map_err(Error::invalid)?;
        let pool = (env.pool)(pool)?;
        open_as(&pool, name, Role::Replica)
    },
};

/// What a volume backend is to a replicated volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    /// Nothing: a volume with one copy, or one a migration moves.
    Plain,
    /// One replica, exported to the engine that serves the volume: the key of the
    /// reservation that engine takes is its generation, which the volume records.
    Replica,
    /// The serving engine's own replica, written by its mirror at this generation.
    Serving(u64),
}

/// Opens volume `name` of `pool` as a backend, with the identity stored with it.
pub fn open(pool: &Pool, name: &str) -> Result<Opened> {
    open_as(pool, name, Role::Plain)
}

/// Opens volume `name` of `pool` as a replica export (`replica:POOL/NAME`).
pub fn open_replica(pool: &Pool, name: &str) -> Result<Opened> {
    open_as(pool, name, Role::Replica)
}

fn open_as(pool: &Pool, name: &str, role: Role) -> Result<Opened> {
    let (volume, meta) = pool.open_volume(name)?;
    if let Role::Serving(generation) = role {
        // This generation took the volume before: an engine that served it then (this
        // one before a crash) wrote what no record here names, so the record can only
        // answer for the generations after it. (A record a clean stop or an upgrade
        // handed on is already under way, and goes on.)
        let resumed = volume.map.generation() >= generation;
        let latest = volume.map.take_generation(generation);
        if latest > generation {
            return Err(Error::precondition(format!(
                "generation {latest} of volume {}/{name} serves it now, later than {generation}: this engine no \
                 longer serves it",
                pool.name
            )));
        }
        volume.map.start_record(if resumed { generation + 1 } else { generation });
        pool.persist_generations(volume.id)?;
    }
    let kind = if role == Role::Replica { "replica" } else { "volume" };
    let backend = VolumeBackend {
        volume,
        size: meta.size,
        description: format!("{kind}:{}/{name}", pool.name),
        gate: Gate::new(meta.size),
        role,
        reserved_at: AtomicU64::new(0),
    };
    Ok(Opened { backend: Arc::new(backend), identity: Some((meta.uuid, meta.nguid)) })
}

/// Notes in `map` that `generation` wrote the granules `ranges` (bytes) touch.
fn mark_generation_in(map: &VolumeMap, shift: u32, ranges: &[(u64, u64)], generation: u64) {
    for &(offset, len) in ranges.iter().filter(|r| r.1 > 0) {
        let end = offset + len;
        for vc in offset >> shift..=(end - 1) >> shift {
            let start = (vc << shift).max(offset);
            let stop = ((vc + 1) << shift).min(end);
            map.mark_generation(vc, generation, granules_of(start - (vc << shift), stop - start, shift));
        }
    }
}

fn parse(arg: &str) -> std::result::Result<(&str, &str), String> {
    match arg.split_once('/') {
        Some((pool, name)) if !pool.is_empty() && !name.is_empty() => Ok((pool, name)),
        _ => Err("does not name a volume".into()),
    }
}

/// A volume served as a namespace.
#[derive(Debug)]
pub struct VolumeBackend {
    /// The pool and cluster map the I/O goes through.
    pub volume: VolumeIo,
    size: u64,
    description: String,
    /// What a migration holds, marks and forwards.
    pub gate: Gate,
    role: Role,
    /// A replica's: the key (generation) of the reservation its writer holds.
    reserved_at: AtomicU64,
}

impl VolumeBackend {
    /// Whether it is a replica export, whose writer's reservation fences it.
    pub fn is_replica(&self) -> bool {
        self.role == Role::Replica
    }

    /// Notes that `generation` wrote the clusters `ranges` (bytes) touch, in the map
    /// the volume writes through now (a snapshot since the backend opened took the
    /// one it opened with).
    pub fn mark_generation(&self, ranges: &[(u64, u64)], generation: u64) {
        let moved_on = self.moved_on();
        let map = match &moved_on {
            None => &self.volume.map,
            Some(Some(m)) => m,
            Some(None) => return,
        };
        mark_generation_in(map, self.volume.pool.cluster_shift(), ranges, generation);
    }

    /// Whether a later generation than its writer's took the volume: its writes are
    /// refused (the writer no longer serves the volume). The serving engine's own leg
    /// is fenced by another engine's generation only; a replica export by any later one.
    fn fenced(&self) -> bool {
        match self.role {
            Role::Plain => false,
            // Not `generation()`: this engine's own mirror of the next generation takes
            // the same replica while the old one's writes finish, and they may.
            Role::Serving(generation) => self.volume.map.fenced_at() > generation,
            Role::Replica => self.volume.map.generation() > self.reserved_at.load(Ordering::Acquire),
        }
    }

    /// The volume's map since a snapshot took the one this backend opened with:
    /// `None` while it has its own (the common case costs one load), `Some(None)` if
    /// the volume is gone. A snapshot's own backend reads the snapshot, whatever the
    /// volume did since.
    fn moved_on(&self) -> Option<Option<Arc<VolumeMap>>> {
        if self.volume.read_only {
            return None;
        }
        let mut next = self.volume.map.successor()?;
        while let Some(later) = next.as_ref().and_then(|m| m.successor()) {
            next = later;
        }
        Some(next)
    }

    /// Queues a read or write piece by piece (a write `durable`: FUA whatever the
    /// command asked); returns whether anything was queued. A write's clusters hold
    /// what it writes, or it fills whole granules of them (`direct_layer_pieces`).
    fn transfer(
        &self,
        io: &mut BlockIo,
        queue: &mut DiskQueue<'_>,
        map: &VolumeMap,
        (offset, len): (u64, u32),
        write: bool,
        durable: bool,
    ) -> bool {
        let pool = &self.volume.pool;
        let asked_fua = matches!(io.plan, IoPlan::Write { fua: true, .. });
        let shift = pool.cluster_shift();
        let end = offset + u64::from(len);
        let mut queued = false;
        let mut at = offset;
        while at < end {
            let (vc, within) = (at >> shift, at & ((1 << shift) - 1));
            let n = ((1u64 << shift) - within).min(end - at) as u32;
            let in_buf = (at - offset) as usize;
            if write {
                // `durable` orders the data before a record of it, which a disk that
                // forgets everything at a power loss does not need.
                let queued_here = pool.locate(map.get(vc), within).is_some_and(|(disk, pos)| {
                    let fua = asked_fua || (durable && !disk.forgets_at_power_loss());
                    queue.write(io, disk.disk_fd(), in_buf, n, pos, fua)
                });
                if queued_here {
                    queued = true;
                } else {
                    io.status = Status::INTERNAL_ERROR;
                }
                map.mark_written(vc);
                if let Role::Serving(generation) = self.role {
                    map.mark_generation(vc, generation, granules_of(within, u64::from(n), shift));
                }
            } else {
                // A layer's cluster may take pieces from the snapshots under it.
                map.sources(vc, within, u64::from(n), shift, |from, bytes, pc| {
                    let at_buf = in_buf + (from - within) as usize;
                    match pool.locate(pc, from) {
                        None if pc == 0 => io.zero(at_buf, bytes as usize),
                        Some((disk, pos)) if queue.read(io, disk.disk_fd(), at_buf, bytes as u32, pos) => queued = true,
                        _ => io.status = Status::INTERNAL_ERROR,
                    }
                });
            }
            at += u64::from(n);
        }
        queued
    }

    /// Whether a write of `offset..offset + len` reaches granules its clusters do not
    /// hold while a snapshot under the volume has data there: the metadata thread
    /// then writes it (`MetaRequest::WriteLayer`).
    fn needs_layer_write(map: &VolumeMap, offset: u64, len: u32, shift: u32) -> bool {
        if map.parent().is_none() {
            return false;
        }
        let end = offset + u64::from(len);
        let mut at = offset;
        while at < end {
            let (vc, within) = (at >> shift, at & ((1 << shift) - 1));
            let n = ((1u64 << shift) - within).min(end - at);
            if !map.holds(vc, &granules_of(within, n, shift)) && (map.get(vc) != 0 || map.under(vc)) {
                return true;
            }
            at += n;
        }
        false
    }

    /// For a write over a snapshot that can go straight to the volume's clusters (each
    /// piece of it lands in a cluster the volume has, on granules it holds or on whole
    /// ones): the pieces that fill granules not held yet, to record held once the
    /// write is done. `None` for one the metadata thread writes.
    fn direct_layer_pieces(map: &VolumeMap, offset: u64, len: u32, shift: u32) -> Option<Vec<(u64, u32, Granules)>> {
        let granule = 1u64 << granule_shift(shift);
        let end = offset + u64::from(len);
        let mut pieces = Vec::new();
        let mut at = offset;
        while at < end {
            let (vc, within) = (at >> shift, at & ((1 << shift) - 1));
            let n = ((1u64 << shift) - within).min(end - at);
            let pc = map.get(vc);
            let granules = granules_of(within, n, shift);
            if pc == 0 {
                return None;
            }
            if !map.holds(vc, &granules) {
                if !within.is_multiple_of(granule) || !(within + n).is_multiple_of(granule) {
                    return None;
                }
                pieces.push((vc, pc, granules));
            }
            at += n;
        }
        Some(pieces)
    }

    /// Hands zeroing of `ranges` to the metadata thread (it may release clusters).
    fn zero(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>, ranges: Vec<(u64, u64)>) {
        if let Role::Serving(generation) = self.role {
            self.mark_generation(&ranges, generation);
        }
        let done = queue.defer(io);
        self.volume.pool.request(MetaRequest::Zero { volume: self.volume.id, ranges, done });
    }
}

impl Backend for VolumeBackend {
    fn kind(&self) -> &'static str {
        if self.role == Role::Replica { "replica" } else { "volume" }
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn description(&self) -> String {
        self.description.clone()
    }

    fn handover(&self) -> Handover<'_> {
        Handover::Spec(self.description())
    }

    fn direct_io(&self) -> bool {
        true
    }

    /// A block may land on any member disk: the pool keeps what its weakest disk keeps.
    fn power_fail_atomic_bytes(&self) -> u32 {
        self.volume.pool.disks().iter().map(|d| d.file.power_fail_atomic_bytes()).min().unwrap_or(512)
    }

    fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        if !matches!(io.plan, IoPlan::Read { .. } | IoPlan::Flush) && self.volume.read_only {
            io.status = Status::NAMESPACE_WRITE_PROTECTED;
            return;
        }
        if !matches!(io.plan, IoPlan::Read { .. }) && self.fenced() {
            io.status = Status::RESERVATION_CONFLICT;
            return;
        }
        // A command already through the gate (a write back from allocation) is not
        // counted or parked twice.
        if io.route != ROUTE_HERE
            && let Admitted::Elsewhere = self.gate.admit(io, queue)
        {
            return;
        }
        let pool = &self.volume.pool;
        match io.plan {
            IoPlan::Read { offset, len } | IoPlan::Write { offset, len, .. } => {
                let write = matches!(io.plan, IoPlan::Write { .. });
                let shift = pool.cluster_shift();
                let (first, last) = (offset >> shift, (offset + u64::from(len) - 1) >> shift);
                let moved_on;
                let map: &VolumeMap = match self.moved_on() {
                    None => &self.volume.map,
                    Some(Some(m)) => {
                        moved_on = m;
                        &moved_on
                    }
                    Some(None) => {
                        io.status = Status::NAMESPACE_NOT_READY;
                        return;
                    }
                };
                let epoch = pool.enter(queue.reactor_id());
                if write && Self::needs_layer_write(map, offset, len, shift) {
                    if let Some(pieces) = Self::direct_layer_pieces(map, offset, len, shift)
                        && map.claims().claim_direct(&pieces.iter().map(|&(vc, _, g)| (vc, g)).collect::<Vec<_>>())
                    {
                        // Whole granules: written here, durably (a granule the record
                        // names must hold what was written, whatever the power does),
                        // and recorded held before the answer (`settle`).
                        io.to_record_held = pieces;
                        if self.transfer(io, queue, map, (offset, len), true, true) {
                            io.hold = Some(epoch);
                        } else {
                            pool.leave(queue.reactor_id(), epoch);
                        }
                        return;
                    }
                    // Written by the metadata thread, which records the granules held.
                    pool.leave(queue.reactor_id(), epoch);
                    // The command's bytes: its buffer may be larger (whole pages).
                    let Some(data) = io.data().and_then(|d| d.get(..len as usize)).map(<[u8]>::to_vec) else {
                        // The kernel's own pages (ublk zero copy, which serves file
                        // namespaces only): never a volume's.
                        io.status = Status::INTERNAL_ERROR;
                        return;
                    };
                    for vc in first..=last {
                        map.mark_written(vc);
                    }
                    if let Role::Serving(generation) = self.role {
                        mark_generation_in(map, shift, &[(offset, u64::from(len))], generation);
                    }
                    map.claims().queue(first, last);
                    io.written_elsewhere = true;
                    let done = queue.defer(io);
                    pool.request(MetaRequest::WriteLayer { volume: self.volume.id, offset, data, done });
                    return;
                }
                if write && (first..=last).any(|vc| map.get(vc) == 0) {
                    // The clusters are allocated first; `resume` maps the write anew.
                    pool.leave(queue.reactor_id(), epoch);
                    let done = queue.defer(io);
                    let count = last - first + 1;
                    pool.request(MetaRequest::Allocate { volume: self.volume.id, first, count, done });
                    return;
                }
                if !write {
                    queue.give_buf(io, len as usize);
                }
                if self.transfer(io, queue, map, (offset, len), write, false) {
                    io.hold = Some(epoch);
                } else {
                    pool.leave(queue.reactor_id(), epoch);
                }
            }
            IoPlan::Flush => {
                for disk in pool.disks() {
                    queue.sync(io, disk.file.disk_fd());
                }
            }
            IoPlan::WriteZeroes { offset, len } => self.zero(io, queue, vec![(offset, len)]),
            IoPlan::DatasetManagement { deallocate: true, .. } => {
                let (ranges, n) = deallocated_ranges(io);
                if n > 0 {
                    self.zero(io, queue, ranges[..n].to_vec());
                }
            }
            IoPlan::DatasetManagement { .. } => {}
        }
    }

    fn resume(&self, io: &mut BlockIo, status: Status, queue: &mut DiskQueue<'_>) {
        if self.gate.resume(io, status, queue) {
            return;
        }
        // A command the gate released starts now. A write whose clusters exist now
        // (unless released again meanwhile) is mapped anew; one the metadata thread
        // wrote is done.
        let written = std::mem::take(&mut io.written_elsewhere);
        if io.route != ROUTE_HERE || status.is_success() && matches!(io.plan, IoPlan::Write { .. }) && !written {
            return self.start(io, queue);
        }
        if !status.is_success() {
            io.status = status;
        }
    }

    /// A write straight into the volume's clusters over its snapshot: the granules it
    /// filled are recorded held, here if the pool's metadata is free, else by the
    /// metadata thread, whose answer ends the command (one that failed only lets go of
    /// their claims). The pool epoch goes before that hand-over: the metadata thread
    /// may wait for it to release clusters.
    fn settle(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        if io.to_record_held.is_empty() {
            return;
        }
        let pieces = std::mem::take(&mut io.to_record_held);
        let written = io.status.is_success();
        let durable = matches!(io.plan, IoPlan::Write { fua: true, .. });
        if written && !durable && self.volume.pool.record_held_here(self.volume.id, &pieces) {
            return;
        }
        if let Some(epoch) = io.hold.take() {
            self.volume.pool.leave(queue.reactor_id(), epoch);
        }
        io.written_elsewhere = true;
        let done = queue.defer(io);
        self.volume.pool.request(MetaRequest::RecordHeld { volume: self.volume.id, pieces, written, durable, done });
    }

    fn finished(&self, io: &mut BlockIo, reactor: usize) {
        if let Some(epoch) = io.hold.take() {
            self.volume.pool.leave(reactor, epoch);
        }
        self.gate.finished(io, reactor);
    }

    fn as_volume(&self) -> Option<&VolumeBackend> {
        Some(self)
    }

    fn reservation_taken(&self, key: u64) -> Option<Durable> {
        if self.role != Role::Replica {
            return None;
        }
        self.reserved_at.store(key, Ordering::Release);
        let risen = key > self.volume.map.generation();
        self.volume.map.fence(key);
        if !risen {
            return None;
        }
        // Durable before the Acquire completes, so that a restart of this engine
        // cannot let an engine of an older generation take the replica again. The
        // metadata thread writes it; the reactor never waits for that thread (its
        // release of clusters waits for the reactors' I/O).
        let durable = Durable::default();
        let set = durable.clone();
        let description = self.description.clone();
        let done = Box::new(move |status: Status| {
            if !status.is_success() {
                tracing::error!("{description}: its generation {key} could not be made durable ({status:?})");
            }
            let _ = set.set(status);
        });
        self.volume.pool.request(MetaRequest::PersistGenerations { volume: self.volume.id, done });
        Some(durable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::CreateOptions;
    use std::path::PathBuf;

    /// What the serving engine's record answers for once the engine is back at the
    /// same generation after a crash: only later ones (it wrote before the crash what
    /// the new record lacks). A clean stop's saved record: tests/mirror.rs.
    #[test]
    fn a_record_restarted_at_a_generation_already_served_answers_only_for_later_ones() {
        let dir = tempfile::tempdir().unwrap();
        let disks: Vec<PathBuf> = (0..2)
            .map(|i| {
                let p = dir.path().join(format!("d{i}"));
                std::fs::File::create(&p).unwrap().set_len(12 << 20).unwrap();
                p
            })
            .collect();
        let pool = Pool::create("g", &disks, &CreateOptions { cluster_size: 128 << 10, force: false }).unwrap();
        pool.create_volume("v", 4 << 20, true, None).unwrap();
        let serve = |pool: &Pool| {
            let (io, _) = pool.open_volume("v").unwrap();
            drop(open_as(pool, "v", Role::Serving(5)).unwrap());
            (io.map.records_since(5), io.map.records_since(6))
        };
        assert_eq!(serve(&pool), (true, true), "a generation served from its start is recorded whole");
        pool.close();
        drop(pool);
        let pool = Pool::import(&disks).unwrap();
        assert_eq!(serve(&pool), (false, true), "after a crash, generation 5 had writes the record lacks");
    }
}

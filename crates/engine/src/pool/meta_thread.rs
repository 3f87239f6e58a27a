//! The pool's metadata thread: the writer of cluster maps and the journal. The
//! reactors hand it allocations (first writes to thin clusters), first writes over
//! snapshots, and zeroing (Write Zeroes, Deallocate); it batches them, makes them
//! durable, and answers each through its callback. The one thing a reactor writes
//! itself, when the metadata's lock is free, is the record of granules a direct write
//! over a snapshot filled (`PoolShared::record_held_here`): a small buffered write,
//! where a round trip to this thread would cost the write as much again.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use nvpool_wire::Status;

use super::cluster_map::VolumeMap;
use super::format::Record;
use super::shared::{Done, MetaRequest, PoolShared};
use super::{Inner, Pool, io_err};
use crate::bufpool::Buf;
use crate::error::{Error, Result};
use crate::granules::{Granules, granule_shift, granules_of, whole_granules};
use crate::sync::{lock, try_lock};

/// What a batch of writes over snapshots did to one cluster, published once durable.
struct LayerCluster {
    map: Arc<VolumeMap>,
    pc: u32,
    /// Mapped by this batch: whole (zeroed) or holding no granule before it.
    new: Option<NewCluster>,
    /// The granules it holds after the batch.
    held: Granules,
    /// The granules the batch made it hold.
    added: Granules,
}

/// How often writes over a snapshot held back for direct writes look again.
const HELD_BACK_RETRY: Duration = Duration::from_micros(200);

/// A write over a snapshot the metadata thread carries out (`MetaRequest::WriteLayer`).
struct LayerWrite {
    volume: u32,
    offset: u64,
    data: Vec<u8>,
    done: Done,
}

impl LayerWrite {
    /// The first and last virtual clusters it touches.
    fn clusters(&self, cluster_size: u64) -> (u64, u64) {
        (self.offset / cluster_size, (self.offset + self.data.len().max(1) as u64 - 1) / cluster_size)
    }
}

/// Granules a reactor wrote over a snapshot, to record held (`MetaRequest::RecordHeld`).
struct HeldRecord {
    volume: u32,
    pieces: Vec<(u64, u32, Granules)>,
    written: bool,
    durable: bool,
    done: Done,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum NewCluster {
    Whole,
    Partial,
}

impl Pool {
    pub(super) fn serve(self: Arc<Self>, rx: Receiver<MetaRequest>) {
        // Writes over snapshots held back until direct writes under their granules
        // are recorded (see `LayerClaims`): such a record comes in a later batch.
        let mut held_back: Vec<LayerWrite> = Vec::new();
        loop {
            // A reactor that records its direct writes itself tells nobody: writes
            // held back for them look again now and then.
            let first = if held_back.is_empty() {
                rx.recv().map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                rx.recv_timeout(HELD_BACK_RETRY)
            };
            let mut batch = match first {
                Ok(r) => vec![r],
                Err(RecvTimeoutError::Timeout) => Vec::new(),
                Err(RecvTimeoutError::Disconnected) => break,
            };
            batch.extend(rx.try_iter());
            let mut allocs = Vec::new();
            let mut layer_writes = std::mem::take(&mut held_back);
            let mut records_held = Vec::new();
            for r in batch {
                match r {
                    MetaRequest::Allocate { volume, first, count, done } => allocs.push((volume, first, count, done)),
                    MetaRequest::WriteLayer { volume, offset, data, done } => {
                        layer_writes.push(LayerWrite { volume, offset, data, done })
                    }
                    MetaRequest::RecordHeld { volume, pieces, written, durable, done } => {
                        records_held.push(HeldRecord { volume, pieces, written, durable, done })
                    }
                    MetaRequest::Zero { volume, ranges, done } => {
                        let st = self.zero(volume, &ranges);
                        done(st);
                    }
                    MetaRequest::PersistGenerations { volume, done } => {
                        done(self.persist_generations(volume).map_or(Status::INTERNAL_ERROR, |()| Status::SUCCESS))
                    }
                }
            }
            if !allocs.is_empty() {
                self.allocate(allocs);
            }
            if !records_held.is_empty() {
                self.record_held(records_held);
            }
            let (ready, waiting) = self.waiting_for_direct_writes(layer_writes);
            held_back = waiting;
            if !ready.is_empty() {
                let writes: Vec<(u32, u64, &[u8])> =
                    ready.iter().map(|w| (w.volume, w.offset, w.data.as_slice())).collect();
                let status = {
                    let mut inner = lock(&self.inner);
                    let status = self
                        .write_layers(&mut inner, &writes)
                        .inspect_err(|e| tracing::error!(pool = %self.name, "a write over a snapshot failed: {e}"))
                        .map_or(Status::INTERNAL_ERROR, |()| Status::SUCCESS);
                    for w in &ready {
                        if let Some(map) = inner.maps.get(&w.volume) {
                            let (first, last) = w.clusters(self.cluster_size);
                            map.claims().dequeue(first, last);
                        }
                    }
                    status
                };
                for w in ready {
                    (w.done)(status);
                }
            }
        }
        // The pool was exported.
        for w in held_back {
            (w.done)(Status::NAMESPACE_NOT_READY);
        }
    }

    /// Splits writes over snapshots into those that may go now and those that wait: a
    /// direct write is filling one of their granules, or an earlier write waiting
    /// touches one of their clusters (so that writes to a cluster keep their order).
    fn waiting_for_direct_writes(&self, writes: Vec<LayerWrite>) -> (Vec<LayerWrite>, Vec<LayerWrite>) {
        let (mut ready, mut waiting) = (Vec::new(), Vec::<LayerWrite>::new());
        let inner = lock(&self.inner);
        let shift = self.cluster_size.trailing_zeros();
        for w in writes {
            let (first, last) = w.clusters(self.cluster_size);
            let behind = waiting.iter().any(|o| {
                let (f, l) = o.clusters(self.cluster_size);
                o.volume == w.volume && f <= last && first <= l
            });
            let under_direct = inner.maps.get(&w.volume).is_some_and(|map| {
                (first..=last).any(|vc| {
                    let start = (vc * self.cluster_size).max(w.offset);
                    let end = ((vc + 1) * self.cluster_size).min(w.offset + w.data.len() as u64);
                    let granules = granules_of(start - vc * self.cluster_size, end - start, shift);
                    map.claims().direct_under(vc, &granules)
                })
            });
            if behind || under_direct { waiting.push(w) } else { ready.push(w) }
        }
        (ready, waiting)
    }

    /// Records held the granules reactors wrote straight into volumes' clusters over
    /// their snapshots, in one journal entry (synced only if a FUA write asks), then
    /// publishes them and lets go of their claims. A cluster released or replaced
    /// since the write (a Deallocate under way with it) records nothing.
    fn record_held(&self, reqs: Vec<HeldRecord>) {
        let mut inner = lock(&self.inner);
        let whole = whole_granules(self.cluster_size);
        let mut records = Vec::new();
        let mut publish = Vec::new();
        for r in reqs.iter().filter(|r| r.written) {
            let Some(map) = inner.maps.get(&r.volume).cloned() else { continue };
            let (held, granules) = held_records(&map, r.volume, &r.pieces);
            records.extend(held);
            publish.extend(granules.into_iter().map(|(vc, g)| (map.clone(), vc, g)));
        }
        let durable = reqs.iter().any(|r| r.written && r.durable);
        let status = match inner.commit_records(&records, durable, self.cluster_size, &self.name) {
            Ok(()) => {
                for (map, vc, granules) in publish {
                    map.hold(vc, granules, whole);
                }
                Status::SUCCESS
            }
            Err(e) => {
                tracing::error!(pool = %self.name, "recording writes over a snapshot failed: {e}");
                Status::INTERNAL_ERROR
            }
        };
        for r in &reqs {
            if let Some(map) = inner.maps.get(&r.volume) {
                let pieces: Vec<(u64, Granules)> = r.pieces.iter().map(|&(vc, _, g)| (vc, g)).collect();
                map.claims().release_direct(&pieces);
            }
        }
        drop(inner);
        for r in reqs {
            (r.done)(if r.written { status } else { Status::SUCCESS });
        }
    }

    /// Writes over snapshots, as one batch: each piece is written into its volume's
    /// cluster (one is mapped where the volume has none: whole and zeroed if a piece
    /// covers it, else holding no granule yet, its other granules still read from the
    /// snapshot), a granule written in part taking the rest of its bytes from the
    /// snapshot first; the disks are synced; one journal entry records the new
    /// clusters and the granules held; only then are they published. A crash before
    /// that entry leaves the granules read from the snapshot: what was there before.
    fn write_layers(&self, inner: &mut Inner, writes: &[(u32, u64, &[u8])]) -> Result<()> {
        let cs = self.cluster_size;
        let shift = cs.trailing_zeros();
        let g_size = 1u64 << granule_shift(shift);
        let whole = whole_granules(cs);
        let mut clusters: BTreeMap<(u32, u64), LayerCluster> = BTreeMap::new();
        let mut touched = vec![false; self.shared.disks.len()];
        let result = (|| -> Result<()> {
            for &(volume, offset, data) in writes {
                let map =
                    inner.maps.get(&volume).cloned().ok_or_else(|| Error::internal("a write to a volume gone"))?;
                let end = offset + data.len() as u64;
                let mut at = offset;
                while at < end {
                    let (vc, within) = (at / cs, at % cs);
                    let n = (cs - within).min(end - at);
                    let piece = &data[(at - offset) as usize..(at - offset + n) as usize];
                    let c = match clusters.entry((volume, vc)) {
                        std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                        std::collections::btree_map::Entry::Vacant(e) => {
                            let pc = map.get(vc);
                            let (pc, new, held) = if pc != 0 {
                                (pc, None, map.held(vc))
                            } else {
                                let pc = inner.free.take().ok_or_else(|| Error::precondition("the pool is full"))?;
                                if n == cs || !map.under(vc) {
                                    let (disk, off) = self
                                        .shared
                                        .locate(pc, 0)
                                        .ok_or_else(|| Error::internal("cluster outside the pool"))?;
                                    disk.zero_now(off, cs).map_err(io_err("zeroing a new cluster"))?;
                                    (pc, Some(NewCluster::Whole), whole)
                                } else {
                                    (pc, Some(NewCluster::Partial), [0; 4])
                                }
                            };
                            e.insert(LayerCluster { map: map.clone(), pc, new, held, added: [0; 4] })
                        }
                    };
                    // Granule by granule. One the cluster holds takes the bytes written
                    // alone (a reactor may be writing its other blocks). One it does
                    // not is written whole: the bytes written, and the rest of it from
                    // the snapshot, which nothing writes.
                    let mut g_at = within - within % g_size;
                    while g_at < within + n {
                        let bit = granules_of(g_at, g_size, shift);
                        let (from, to) = (g_at.max(within), (g_at + g_size).min(within + n));
                        let holds = c.held.iter().zip(bit).all(|(h, b)| h & b == b);
                        let mut buf = Buf::new((g_size as usize).div_ceil(4096));
                        let (write_at, image) = if holds || to - from == g_size {
                            let image = &mut buf.as_mut_slice()[..(to - from) as usize];
                            image.copy_from_slice(&piece[(from - within) as usize..(to - within) as usize]);
                            (from, &*image)
                        } else {
                            let image = &mut buf.as_mut_slice()[..g_size as usize];
                            let source = c.map.parent_source(vc, &bit);
                            match self.shared.locate(source, g_at) {
                                Some((disk, pos)) if source != 0 => {
                                    disk.read_now(image, pos).map_err(io_err("reading a snapshot"))?
                                }
                                _ => image.fill(0),
                            }
                            image[(from - g_at) as usize..(to - g_at) as usize]
                                .copy_from_slice(&piece[(from - within) as usize..(to - within) as usize]);
                            (g_at, &*image)
                        };
                        let (disk, pos) = self
                            .shared
                            .locate(c.pc, write_at)
                            .ok_or_else(|| Error::internal("cluster outside the pool"))?;
                        disk.write_now(image, pos).map_err(io_err("writing over a snapshot"))?;
                        if let Some(i) = self.shared.disks.iter().position(|d| std::ptr::eq(&*d.file, disk)) {
                            touched[i] = true;
                        }
                        for ((h, a), b) in c.held.iter_mut().zip(c.added.iter_mut()).zip(bit) {
                            *a |= b & !*h;
                            *h |= b;
                        }
                        g_at += g_size;
                    }
                    at += n;
                }
            }
            Ok(())
        })();
        let records = result.and_then(|()| {
            for (d, t) in self.shared.disks.iter().zip(&touched) {
                if *t {
                    d.file.sync_now().map_err(io_err("syncing writes over a snapshot"))?;
                }
            }
            let mut records = Vec::new();
            for (&(id, vc), c) in &clusters {
                let (vstart, pstart) = (vc as u32, c.pc);
                match c.new {
                    Some(NewCluster::Whole) => records.push(Record::Map { id, vstart, pstart, count: 1 }),
                    Some(NewCluster::Partial) => records.push(Record::MapLayer { id, vstart, pstart, count: 1 }),
                    None => {}
                }
                if c.new != Some(NewCluster::Whole) && c.added != [0; 4] {
                    records.push(Record::Hold { id, vc: vstart, granules: c.added });
                }
            }
            self.commit(inner, &records)
        });
        if let Err(e) = records {
            for c in clusters.values().filter(|c| c.new.is_some()) {
                inner.free.put(c.pc);
            }
            return Err(e);
        }
        for (&(_, vc), c) in &clusters {
            match c.new {
                Some(NewCluster::Whole) => c.map.set(vc, c.pc),
                Some(NewCluster::Partial) => c.map.set_partial(vc, c.pc, c.held),
                None => c.map.hold(vc, c.added, whole),
            }
        }
        Ok(())
    }

    /// Allocates clusters for a batch of requests with one metadata commit.
    fn allocate(&self, reqs: Vec<(u32, u64, u64, Done)>) {
        let mut inner = lock(&self.inner);
        let mut new: Vec<(u32, u64, u32)> = Vec::new();
        let mut replies = Vec::new();
        for (volume, first, count, done) in reqs {
            if inner.failed.is_some() {
                replies.push((done, Status::INTERNAL_ERROR));
                continue;
            }
            let Some(map) = inner.maps.get(&volume).cloned() else {
                replies.push((done, Status::NAMESPACE_NOT_READY));
                continue;
            };
            let mut status = Status::SUCCESS;
            for vc in first..(first + count).min(map.clusters()) {
                if map.get(vc) != 0 || new.iter().any(|&(v, c, _)| v == volume && c == vc) {
                    continue;
                }
                match inner.free.take() {
                    Some(pc) => new.push((volume, vc, pc)),
                    None => {
                        status = Status::CAPACITY_EXCEEDED;
                        break;
                    }
                }
            }
            replies.push((done, status));
        }
        if !new.is_empty()
            && let Err(e) = self.map_durably(&mut inner, &new, Vec::new())
        {
            for &(_, _, pc) in &new {
                inner.free.put(pc);
            }
            tracing::error!(pool = %self.name, "allocation failed: {e}");
            for r in &mut replies {
                r.1 = Status::INTERNAL_ERROR;
            }
        }
        drop(inner);
        for (done, st) in replies {
            done(st);
        }
    }

    /// Zeroes the new clusters, then commits `before` plus their Map records, then
    /// publishes the mappings. On an error the pool is marked failed.
    pub(super) fn map_durably(&self, inner: &mut Inner, new: &[(u32, u64, u32)], before: Vec<Record>) -> Result<()> {
        let mut touched = vec![false; self.shared.disks.len()];
        for &(_, _, pc) in new {
            let (disk, off) = self.shared.locate(pc, 0).ok_or_else(|| Error::internal("cluster outside the pool"))?;
            disk.zero_now(off, self.cluster_size).map_err(io_err("zeroing a new cluster"))?;
            if let Some(i) = self.shared.disks.iter().position(|d| std::ptr::eq(&*d.file, disk)) {
                touched[i] = true;
            }
        }
        for (d, t) in self.shared.disks.iter().zip(touched) {
            if t {
                d.file.sync_now().map_err(io_err("syncing zeroed clusters"))?;
            }
        }
        let mut records = before;
        let mut sorted = new.to_vec();
        sorted.sort_unstable();
        for &(id, vc, pc) in &sorted {
            match records.last_mut() {
                Some(Record::Map { id: i, vstart, pstart, count })
                    if *i == id && u64::from(*vstart + *count) == vc && *pstart + *count == pc =>
                {
                    *count += 1
                }
                _ => records.push(Record::Map { id, vstart: vc as u32, pstart: pc, count: 1 }),
            }
        }
        self.commit(inner, &records)?;
        for &(id, vc, pc) in new {
            if let Some(m) = inner.maps.get(&id) {
                m.set(vc, pc);
            }
        }
        Ok(())
    }

    /// Applies and commits records; a failed commit marks the pool failed.
    pub(super) fn commit(&self, inner: &mut Inner, records: &[Record]) -> Result<()> {
        inner.commit_records(records, true, self.cluster_size, &self.name)
    }

    /// Releases virtual clusters of a volume: clears them, waits out I/O that might use
    /// them, commits their Unmap records followed by `then`, and frees them.
    pub(super) fn release(&self, inner: &mut Inner, id: u32, vcs: &[u64], then: Option<Record>) -> Result<()> {
        let map = inner.maps.get(&id).cloned();
        let mut freed = Vec::new();
        if let Some(m) = &map {
            freed.extend(vcs.iter().map(|&vc| m.clear(vc)).filter(|&pc| pc != 0));
        }
        self.shared.drain();
        let mut records: Vec<Record> = Vec::new();
        for &vc in vcs {
            match records.last_mut() {
                Some(Record::Unmap { vstart, count, .. }) if u64::from(*vstart + *count) == vc => *count += 1,
                _ => records.push(Record::Unmap { id, vstart: vc as u32, count: 1 }),
            }
        }
        records.extend(then);
        self.commit(inner, &records)?;
        for pc in freed {
            inner.free.put(pc);
        }
        Ok(())
    }

    /// Write Zeroes and Deallocate: whole clusters of thin volumes are released, the
    /// rest is zeroed in place.
    fn zero(&self, id: u32, ranges: &[(u64, u64)]) -> Status {
        let mut inner = lock(&self.inner);
        let Some(map) = inner.maps.get(&id).cloned() else { return Status::NAMESPACE_NOT_READY };
        let thin = inner.state.volumes.get(&id).is_some_and(|v| v.meta.thin);
        let cs = self.cluster_size;
        let mut whole = Vec::new();
        // Over a snapshot's data, zeroes are written where the volume's cluster does
        // not hold the range: releasing it, or leaving it unmapped, would show the
        // snapshot's data instead.
        let mut over = Vec::new();
        for &(offset, len) in ranges {
            let mut at = offset;
            let end = offset + len;
            while at < end {
                let vc = at / cs;
                let within = at % cs;
                let n = (cs - within).min(end - at);
                let under = map.under(vc);
                if under && map.held(vc) != [u64::MAX; 4] {
                    over.push((at, n));
                } else if thin && n == cs && !under {
                    whole.push(vc);
                } else {
                    let pc = map.get(vc);
                    if pc != 0 {
                        let Some((disk, off)) = self.shared.locate(pc, within) else { return Status::INTERNAL_ERROR };
                        if disk.zero_now(off, n).is_err() {
                            return Status::INTERNAL_ERROR;
                        }
                    }
                }
                at += n;
            }
        }
        whole.retain(|&vc| map.get(vc) != 0);
        whole.sort_unstable();
        whole.dedup();
        if !whole.is_empty()
            && let Err(e) = self.release(&mut inner, id, &whole, None)
        {
            tracing::error!(pool = %self.name, "releasing clusters failed: {e}");
            return Status::INTERNAL_ERROR;
        }
        let zeroes: Vec<Vec<u8>> = over.iter().map(|&(_, n)| vec![0; n as usize]).collect();
        let writes: Vec<(u32, u64, &[u8])> =
            over.iter().zip(&zeroes).map(|(&(at, _), z)| (id, at, z.as_slice())).collect();
        if !writes.is_empty()
            && let Err(e) = self.write_layers(&mut inner, &writes)
        {
            tracing::error!(pool = %self.name, "zeroing over a snapshot failed: {e}");
            return Status::INTERNAL_ERROR;
        }
        Status::SUCCESS
    }
}

impl Inner {
    /// Applies and commits records, durable before it returns or only once the disk is
    /// next synced (`MetaStore::commit_unsynced`); a failed commit marks the pool failed.
    fn commit_records(&mut self, records: &[Record], durable: bool, cluster_size: u64, pool: &str) -> Result<()> {
        if let Some(f) = &self.failed {
            return Err(Error::precondition(format!("pool {pool} refuses changes: {f}")));
        }
        for r in records {
            self.state.apply(r, cluster_size).map_err(Error::internal)?;
        }
        let Inner { store, state, .. } = self;
        let written = if durable { store.commit(records, state) } else { store.commit_unsynced(records, state) };
        if let Err(e) = written {
            let why = format!("writing metadata failed ({e}); export and import the pool to recover");
            self.failed = Some(why.clone());
            return Err(Error::io(format!("pool {pool}"), std::io::Error::other(why)));
        }
        Ok(())
    }
}

/// The Hold records of the granules a direct write filled, and the (virtual cluster,
/// granules) to publish once they are committed: none for a cluster released or
/// replaced since the write (a Deallocate under way with it).
fn held_records(map: &VolumeMap, volume: u32, pieces: &[(u64, u32, Granules)]) -> (Vec<Record>, Vec<(u64, Granules)>) {
    pieces
        .iter()
        .filter(|&&(vc, pc, _)| pc != 0 && map.get(vc) == pc)
        .map(|&(vc, _, granules)| (Record::Hold { id: volume, vc: vc as u32, granules }, (vc, granules)))
        .unzip()
}

impl PoolShared {
    /// Records held the granules a direct write filled, as the metadata thread would,
    /// here on the reactor: when nobody holds the pool's metadata and the entry fits
    /// the journal without a checkpoint, it is one buffered write of a small entry
    /// (no sync: this is for writes without FUA), with no thread between the write and
    /// its answer. False if it could not, with nothing done: the metadata thread then
    /// does it (`MetaRequest::RecordHeld`).
    pub fn record_held_here(&self, volume: u32, pieces: &[(u64, u32, Granules)]) -> bool {
        let Some(mut inner) = try_lock(&self.metadata) else { return false };
        let Some(map) = inner.maps.get(&volume).cloned() else { return false };
        let (records, publish) = held_records(&map, volume, pieces);
        if inner.failed.is_some() || !inner.store.fits(&records) {
            return false;
        }
        let cluster_size = 1u64 << self.cluster_shift;
        if inner.commit_records(&records, false, cluster_size, "(a reactor's record)").is_err() {
            return false;
        }
        let whole = whole_granules(cluster_size);
        for (vc, granules) in publish {
            map.hold(vc, granules, whole);
        }
        map.claims().release_direct(&pieces.iter().map(|&(vc, _, g)| (vc, g)).collect::<Vec<_>>());
        true
    }
}

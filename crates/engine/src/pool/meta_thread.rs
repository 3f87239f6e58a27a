//! The pool's metadata thread: the one writer of cluster maps and the journal. The
//! reactors hand it allocations (first writes to thin clusters) and zeroing (Write
//! Zeroes, Deallocate); it batches them, makes them durable, and answers each through
//! its callback.

use std::sync::Arc;
use std::sync::mpsc::Receiver;

use nvpool_wire::Status;

use super::format::Record;
use super::shared::{Done, MetaRequest};
use super::{Inner, Pool, io_err};
use crate::error::{Error, Result};
use crate::sync::lock;

impl Pool {
    pub(super) fn serve(self: Arc<Self>, rx: Receiver<MetaRequest>) {
        while let Ok(first) = rx.recv() {
            let mut batch = vec![first];
            batch.extend(rx.try_iter());
            let mut allocs = Vec::new();
            for r in batch {
                match r {
                    MetaRequest::Allocate { volume, first, count, done } => allocs.push((volume, first, count, done)),
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
        }
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
        if let Some(f) = &inner.failed {
            return Err(Error::precondition(format!("pool {} refuses changes: {f}", self.name)));
        }
        for r in records {
            inner.state.apply(r, self.cluster_size).map_err(Error::internal)?;
        }
        let Inner { store, state, .. } = inner;
        if let Err(e) = store.commit(records, state) {
            let why = format!("writing metadata failed ({e}); export and import the pool to recover");
            inner.failed = Some(why.clone());
            return Err(Error::io(format!("pool {}", self.name), std::io::Error::other(why)));
        }
        Ok(())
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
        for &(offset, len) in ranges {
            let mut at = offset;
            let end = offset + len;
            while at < end {
                let vc = at / cs;
                let within = at % cs;
                let n = (cs - within).min(end - at);
                if thin && n == cs {
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
        Status::SUCCESS
    }
}

//! The metadata store: checkpoints and a journal on disk 0, written so that a crash at
//! any instant leaves the old state or the new one.
//!
//! A change is durable once [`MetaStore::commit`] returns: its journal entry has been
//! written and synced. When the journal is full, the whole state is written as a new
//! checkpoint instead, into the slot the current one does not occupy, and the journal
//! starts over under the new generation (entries of older generations are ignored).
//! Opening replays the newest valid checkpoint and then the journal, and writes a fresh
//! checkpoint so that a torn tail is never appended to.

use std::io;

use super::format::{self, BLOCK, MetaLayout, PoolState, Record};

/// Positioned I/O on the metadata disk. Writes are not durable until `sync`.
pub trait MetaIo {
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes all of `buf` at `offset`.
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()>;
    /// Makes every completed write durable.
    fn sync(&self) -> io::Result<()>;
}

/// The writer of a pool's metadata.
pub struct MetaStore<D: MetaIo> {
    dev: D,
    pool_uuid: [u8; 16],
    layout: MetaLayout,
    generation: u64,
    /// Bytes of the journal used under the current generation.
    journal_used: u64,
    next_seq: u64,
    /// Entries and checkpoints written since the store was opened.
    entries: u64,
    checkpoints: u64,
}

impl<D: MetaIo> MetaStore<D> {
    /// Writes the first checkpoint of a new pool (generation 1; slot 0 is cleared so no
    /// older pool's checkpoint on the disk can be mistaken for ours).
    pub fn format(dev: D, pool_uuid: [u8; 16], layout: MetaLayout, state: &PoolState) -> io::Result<MetaStore<D>> {
        dev.write_at(&vec![0u8; BLOCK as usize], layout.slot_offset(0))?;
        dev.write_at(&vec![0u8; BLOCK as usize], layout.journal_offset)?;
        let mut s = MetaStore {
            dev,
            pool_uuid,
            layout,
            generation: 0,
            journal_used: 0,
            next_seq: 0,
            entries: 0,
            checkpoints: 0,
        };
        s.checkpoint(state)?;
        Ok(s)
    }

    /// Loads the state: the newest valid checkpoint, then every valid journal entry of
    /// its generation in sequence. Then writes a new checkpoint of the result.
    pub fn open(
        dev: D,
        pool_uuid: [u8; 16],
        layout: MetaLayout,
        cluster_size: u64,
    ) -> io::Result<(MetaStore<D>, PoolState)> {
        let mut best: Option<(u64, PoolState)> = None;
        for slot in 0..2 {
            let off = layout.slot_offset(slot);
            let mut first = vec![0u8; BLOCK as usize];
            dev.read_at(&mut first, off)?;
            let Some(h) = format::checkpoint_header(&pool_uuid, &first) else { continue };
            if h.total_len() > layout.checkpoint_size || best.as_ref().is_some_and(|(g, _)| *g >= h.generation) {
                continue;
            }
            let mut all = vec![0u8; h.total_len() as usize];
            dev.read_at(&mut all, off)?;
            if let Some(found) = format::decode_checkpoint(&pool_uuid, &all) {
                best = Some(found);
            }
        }
        let (generation, mut state) = best.ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "no valid checkpoint: the pool metadata is lost")
        })?;
        let mut at = 0u64;
        let mut seq = 0u64;
        while at + BLOCK <= layout.journal_size {
            let mut first = vec![0u8; BLOCK as usize];
            dev.read_at(&mut first, layout.journal_offset + at)?;
            let Some(h) = format::entry_header(&pool_uuid, &first) else { break };
            if h.generation != generation || h.seq != seq || at + h.total_len() > layout.journal_size {
                break;
            }
            let mut all = first;
            if h.total_len() > BLOCK {
                all = vec![0u8; h.total_len() as usize];
                dev.read_at(&mut all, layout.journal_offset + at)?;
            }
            let Some((_, records)) = format::decode_entry(&pool_uuid, &all) else { break };
            for r in &records {
                state.apply(r, cluster_size).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            }
            at += h.total_len();
            seq += 1;
        }
        let mut s = MetaStore {
            dev,
            pool_uuid,
            layout,
            generation,
            journal_used: at,
            next_seq: seq,
            entries: 0,
            checkpoints: 0,
        };
        s.checkpoint(&state)?;
        Ok((s, state))
    }

    /// Makes `records` durable. `after` is the state with them applied: it is written as
    /// a checkpoint when the journal has no room for the entry.
    pub fn commit(&mut self, records: &[Record], after: &PoolState) -> io::Result<()> {
        self.append(records, after, true)
    }

    /// Writes `records` without waiting for the disk to keep them: a process that dies
    /// after still leaves them to the next import, and the next sync of the disk (a
    /// Flush, or any durable commit) makes them durable. Entries reach the disk in any
    /// order before that, and the import reads the journal up to the first one
    /// missing: only what no sync covered can be lost, as with a disk's write cache.
    pub fn commit_unsynced(&mut self, records: &[Record], after: &PoolState) -> io::Result<()> {
        self.append(records, after, false)
    }

    /// Whether `records` fit in the journal as one entry, without a checkpoint.
    pub fn fits(&self, records: &[Record]) -> bool {
        let entry = format::encode_entry(&self.pool_uuid, self.generation, self.next_seq, records);
        self.journal_used + entry.len() as u64 <= self.layout.journal_size
    }

    fn append(&mut self, records: &[Record], after: &PoolState, sync: bool) -> io::Result<()> {
        if records.is_empty() {
            return Ok(());
        }
        let entry = format::encode_entry(&self.pool_uuid, self.generation, self.next_seq, records);
        if self.journal_used + entry.len() as u64 > self.layout.journal_size {
            return self.checkpoint(after);
        }
        self.dev.write_at(&entry, self.layout.journal_offset + self.journal_used)?;
        if sync {
            self.dev.sync()?;
        }
        self.journal_used += entry.len() as u64;
        self.next_seq += 1;
        self.entries += 1;
        Ok(())
    }

    /// Writes `state` as the next generation's checkpoint and empties the journal.
    pub fn checkpoint(&mut self, state: &PoolState) -> io::Result<()> {
        let generation = self.generation + 1;
        let b = format::encode_checkpoint(&self.pool_uuid, generation, state);
        if b.len() as u64 > self.layout.checkpoint_size {
            return Err(io::Error::other("the pool metadata outgrew its checkpoint slot"));
        }
        self.dev.write_at(&b, self.layout.slot_offset(generation))?;
        self.dev.sync()?;
        self.generation = generation;
        self.journal_used = 0;
        self.next_seq = 0;
        self.checkpoints += 1;
        Ok(())
    }

    /// The journal's figures, for the management API and the metrics.
    pub fn figures(&self) -> nvpool_api::JournalInfo {
        nvpool_api::JournalInfo {
            size_bytes: self.layout.journal_size,
            used_bytes: self.journal_used,
            entries: self.entries,
            checkpoints: self.checkpoints,
            generation: self.generation,
        }
    }

    /// Bytes of journal in use (for tests and stats).
    pub fn journal_used(&self) -> u64 {
        self.journal_used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::format::{MAX_CHAIN, VERSION, VolumeKind, VolumeMeta};
    use proptest::prelude::*;
    use std::cell::{Cell, RefCell};

    const SECTOR: usize = 512;

    /// A disk that loses writes like a power cut: writes since the last sync are kept
    /// only in part (a random subset of their sectors) when it crashes. The power goes
    /// out at a chosen sync: that sync and every later one fail.
    struct CrashDisk {
        durable: RefCell<Vec<u8>>,
        pending: RefCell<Vec<(u64, Vec<u8>)>>,
        syncs_left: Cell<usize>,
    }

    impl CrashDisk {
        fn new(size: usize) -> CrashDisk {
            CrashDisk::with_image(vec![0xA5; size])
        }

        fn with_image(img: Vec<u8>) -> CrashDisk {
            CrashDisk {
                durable: RefCell::new(img),
                pending: RefCell::new(Vec::new()),
                syncs_left: Cell::new(usize::MAX),
            }
        }

        /// What the disk holds after a power cut, given a source of randomness.
        fn crash(&self, mut keep: impl FnMut() -> bool) -> CrashDisk {
            let mut img = self.durable.borrow().clone();
            for (off, data) in self.pending.borrow().iter() {
                for (i, sector) in data.chunks(SECTOR).enumerate() {
                    if keep() {
                        let at = *off as usize + i * SECTOR;
                        img[at..at + sector.len()].copy_from_slice(sector);
                    }
                }
            }
            CrashDisk::with_image(img)
        }
    }

    impl MetaIo for &CrashDisk {
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            let mut img = self.durable.borrow().clone();
            for (off, data) in self.pending.borrow().iter() {
                img[*off as usize..*off as usize + data.len()].copy_from_slice(data);
            }
            buf.copy_from_slice(&img[offset as usize..offset as usize + buf.len()]);
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
            self.pending.borrow_mut().push((offset, buf.to_vec()));
            Ok(())
        }
        fn sync(&self) -> io::Result<()> {
            if self.syncs_left.get() == 0 {
                return Err(io::Error::other("power cut"));
            }
            self.syncs_left.set(self.syncs_left.get() - 1);
            let mut img = self.durable.borrow_mut();
            for (off, data) in self.pending.borrow_mut().drain(..) {
                img[off as usize..off as usize + data.len()].copy_from_slice(&data);
            }
            Ok(())
        }
    }

    const CLUSTER: u64 = 1 << 20;
    const CLUSTERS: u32 = 64;

    /// Operations of the model test, in terms a pool would turn into records.
    #[derive(Clone, Debug)]
    enum Op {
        Create {
            thin: bool,
            clusters: u32,
        },
        Delete(usize),
        Grow(usize, u32),
        Write(usize, u32),
        Trim(usize, u32, u32),
        Snapshot(usize),
        Clone(usize),
        /// One step of folding a hidden snapshot into the one layer over it.
        Fold,
        /// One step of inflating a volume that lies over a snapshot.
        Inflate(usize),
        Checkpoint,
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (any::<bool>(), 1u32..12).prop_map(|(thin, clusters)| Op::Create { thin, clusters }),
            (0usize..8).prop_map(Op::Delete),
            (0usize..8, 1u32..8).prop_map(|(v, n)| Op::Grow(v, n)),
            (0usize..8, 0u32..40).prop_map(|(v, c)| Op::Write(v, c)),
            (0usize..8, 0u32..40, 1u32..6).prop_map(|(v, c, n)| Op::Trim(v, c, n)),
            (0usize..8).prop_map(Op::Snapshot),
            (0usize..8).prop_map(Op::Clone),
            Just(Op::Fold),
            (0usize..8).prop_map(Op::Inflate),
            Just(Op::Checkpoint),
        ]
    }

    fn free_clusters(s: &PoolState) -> Vec<u32> {
        let used = s.used_clusters().unwrap();
        (1..=CLUSTERS).filter(|c| used.binary_search(c).is_err()).collect()
    }

    fn meta(id: u32, size: u64, thin: bool) -> VolumeMeta {
        VolumeMeta { id, name: format!("v{id}"), size, thin, uuid: [id as u8; 16], nguid: [0; 16] }
    }

    /// Turns an operation into records against the current state (what the pool does).
    fn records_for(op: &Op, s: &PoolState) -> Vec<Record> {
        let of_kind = |kind: VolumeKind| -> Vec<u32> {
            s.volumes.values().filter(|v| v.layer.kind == kind).map(|v| v.meta.id).collect()
        };
        let ids: Vec<u32> = s.volumes.keys().copied().collect();
        let pick = |i: usize| ids.get(i % ids.len().max(1)).copied();
        let writable = of_kind(VolumeKind::Volume);
        let pick_writable = |i: usize| writable.get(i % writable.len().max(1)).copied();
        let mut free = free_clusters(s).into_iter();
        match *op {
            Op::Create { thin, clusters } => {
                let id = s.next_id;
                let meta = meta(id, u64::from(clusters) * CLUSTER, thin);
                let mut recs = vec![Record::CreateVolume(meta)];
                if !thin {
                    if free.len() < clusters as usize {
                        return vec![];
                    }
                    for vc in 0..clusters {
                        recs.push(Record::Map { id, vstart: vc, pstart: free.next().unwrap(), count: 1 });
                    }
                }
                recs
            }
            // What layers lie over stays, hidden if it is a snapshot.
            Op::Delete(i) => match pick(i) {
                Some(id) if s.layers_over(id).next().is_none() => vec![Record::DeleteVolume { id }],
                Some(id) if s.volumes[&id].layer.kind == VolumeKind::Snapshot => vec![Record::Hide { id }],
                _ => vec![],
            },
            Op::Grow(i, n) => pick_writable(i)
                .map(|id| vec![Record::ResizeVolume { id, size: s.volumes[&id].meta.size + u64::from(n) * CLUSTER }])
                .unwrap_or_default(),
            // A write over a parent's data maps a cluster that holds only the granule
            // written; a write to a cluster held in part holds one more.
            Op::Write(i, c) => {
                let Some(id) = pick_writable(i) else { return vec![] };
                let v = &s.volumes[&id];
                let vc = c % (v.meta.size / CLUSTER) as u32;
                let mut granules = [0u64; 4];
                granules[(c / 64 % 4) as usize] = 1 << (c % 64);
                let under = s.chain(id).iter().any(|p| s.volumes[p].map.contains_key(&vc));
                match (v.map.contains_key(&vc), free.next()) {
                    (false, Some(pc)) if under => vec![
                        Record::MapLayer { id, vstart: vc, pstart: pc, count: 1 },
                        Record::Hold { id, vc, granules },
                    ],
                    (false, Some(pc)) => vec![Record::Map { id, vstart: vc, pstart: pc, count: 1 }],
                    (true, _) if v.partial.contains_key(&vc) => vec![Record::Hold { id, vc, granules }],
                    _ => vec![],
                }
            }
            Op::Trim(i, c, n) => {
                pick_writable(i).map(|id| vec![Record::Unmap { id, vstart: c, count: n }]).unwrap_or_default()
            }
            Op::Snapshot(i) => match pick_writable(i) {
                Some(id) if s.chain(id).len() < MAX_CHAIN => {
                    let v = &s.volumes[&id];
                    vec![Record::TakeSnapshot { id, snapshot: meta(s.next_id, v.meta.size, v.meta.thin) }]
                }
                _ => vec![],
            },
            Op::Clone(i) => {
                let snapshots = of_kind(VolumeKind::Snapshot);
                match snapshots.get(i % snapshots.len().max(1)) {
                    Some(&parent) if s.chain(parent).len() + 1 < MAX_CHAIN => {
                        let size = s.volumes[&parent].meta.size;
                        vec![Record::CreateLayer { meta: meta(s.next_id, size, true), parent }]
                    }
                    _ => vec![],
                }
            }
            Op::Fold => {
                let hidden = of_kind(VolumeKind::Hidden);
                let Some(&id) = hidden.iter().find(|&&h| s.fold_target(h).is_some()) else { return vec![] };
                match s.volumes[&id].map.keys().next() {
                    Some(&vc) => s.fold_cluster(id, vc, CLUSTER).unwrap().0,
                    None => vec![Record::Fold { id }],
                }
            }
            // A cluster the volume reads from below becomes its own and whole (its
            // missing granules copied in), and once none is left it lies over nothing.
            Op::Inflate(i) => {
                let layered: Vec<u32> = writable.iter().copied().filter(|&id| !s.chain(id).is_empty()).collect();
                let Some(&id) = layered.get(i % layered.len().max(1)) else { return vec![] };
                let v = &s.volumes[&id];
                match s.inflate_pending(id).first() {
                    None => vec![Record::Detach { id }],
                    Some(&vc) => match v.partial.get(&vc) {
                        Some(held) => vec![Record::Hold { id, vc, granules: std::array::from_fn(|i| !held[i]) }],
                        None => match free.next() {
                            Some(pc) => vec![Record::Map { id, vstart: vc, pstart: pc, count: 1 }],
                            None => vec![],
                        },
                    },
                }
            }
            Op::Checkpoint => vec![],
        }
    }

    fn layout() -> MetaLayout {
        // A small journal, so checkpoints happen often.
        MetaLayout::for_pool(u64::from(CLUSTERS), 6 * BLOCK, VERSION)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Random changes against a model, reopening as we go; then a power cut at a
        /// random write of a random change: the state read back is exactly the one
        /// before that change or the one after it, and no cluster is mapped twice.
        #[test]
        fn survives_power_cuts(ops in proptest::collection::vec(arb_op(), 1..60), cut in 0usize..60, syncs in 0usize..2, seed: u64) {
            let l = layout();
            let disk = CrashDisk::new((l.end() + BLOCK) as usize);
            let mut model = PoolState::default();
            let mut store = MetaStore::format(&disk, [9; 16], l, &model).unwrap();
            let cut = cut % ops.len();
            let mut rng = seed;
            let mut coin = move || { rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407); rng >> 63 == 1 };
            for (i, op) in ops.iter().enumerate() {
                let recs = records_for(op, &model);
                let mut after = model.clone();
                for r in &recs {
                    after.apply(r, CLUSTER).unwrap();
                }
                if i == cut {
                    // The power goes at one of the change's syncs: the change never returns.
                    disk.syncs_left.set(syncs);
                    let done = if matches!(op, Op::Checkpoint) { store.checkpoint(&after) } else { store.commit(&recs, &after) };
                    let crashed = disk.crash(&mut coin);
                    let (_, got) = MetaStore::open(&crashed, [9; 16], l, CLUSTER).unwrap();
                    if done.is_ok() {
                        prop_assert_eq!(&got, &after);
                    }
                    prop_assert!(got == model || got == after, "state after the cut is neither the old nor the new one");
                    got.used_clusters().unwrap();
                    got.check_layers().unwrap();
                    return Ok(());
                }
                if matches!(op, Op::Checkpoint) { store.checkpoint(&after).unwrap() } else { store.commit(&recs, &after).unwrap() }
                model = after;
                if i % 7 == 3 {
                    let (s, got) = MetaStore::open(&disk, [9; 16], l, CLUSTER).unwrap();
                    prop_assert_eq!(&got, &model);
                    store = s;
                }
            }
        }
    }

    /// The disk keeps only what was synced; `commit`'s sync is what a cut can interrupt,
    /// so the test above must see the pending writes of the in-flight change. This checks
    /// that the crash disk does what the test assumes.
    #[test]
    fn crash_disk_drops_unsynced_writes() {
        let d = CrashDisk::new(4096);
        (&d).write_at(&[1; 512], 0).unwrap();
        (&d).sync().unwrap();
        (&d).write_at(&[2; 1024], 0).unwrap();
        let lost = d.crash(|| false);
        let mut b = [0u8; 1024];
        (&lost).read_at(&mut b, 0).unwrap();
        assert_eq!(&b[..512], &[1; 512]);
        assert_eq!(&b[512..], &[0xA5; 512]);
    }

    #[test]
    fn a_full_journal_becomes_a_checkpoint() {
        let l = layout();
        let disk = CrashDisk::new((l.end() + BLOCK) as usize);
        let mut state = PoolState::default();
        let mut store = MetaStore::format(&disk, [1; 16], l, &state).unwrap();
        let meta =
            VolumeMeta { id: 0, name: "a".into(), size: 64 * CLUSTER, thin: true, uuid: [0; 16], nguid: [0; 16] };
        let mut recs = vec![Record::CreateVolume(meta)];
        for vc in 0..20u32 {
            for r in &recs {
                state.apply(r, CLUSTER).unwrap();
            }
            store.commit(&recs, &state).unwrap();
            assert!(store.journal_used() <= l.journal_size);
            recs = vec![Record::Map { id: 0, vstart: vc, pstart: vc + 1, count: 1 }];
        }
        let (_, got) = MetaStore::open(&disk, [1; 16], l, CLUSTER).unwrap();
        assert_eq!(got, state);
        assert_eq!(got.volumes[&0].map.len(), 19);
    }
}

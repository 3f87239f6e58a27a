//! A volume's cluster map as the reactors read it: lock-free lookups, written only by
//! the pool's metadata thread, plus the dirty-cluster set for migration.
//!
//! The map is two levels: a top table of pages, each page covering `PAGE` virtual
//! clusters and created on first use. A page holds the physical cluster of each virtual
//! one (0 when unallocated) and one dirty bit per cluster. Growing a volume builds a
//! new top table that shares the existing pages, so readers holding the old table see
//! every later change to the clusters they can address.
//!
//! A volume that lies over a snapshot (a *layer*) has the snapshot's map as its
//! parent. A cluster of a layer is whole, or holds only some of its granules (a bit
//! each): a read takes what it does not hold from the parent, down the chain
//! ([`VolumeMap::sources`]). A map that became a snapshot's names its *successor*,
//! the volume's new map over it, where a backend still holding the old one goes on.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use super::layer_claims::LayerClaims;
use crate::granules::{ALL_GRANULES, GRANULES, Granules, granule_shift};

/// A replicated volume's generations and which generation last wrote each cluster
/// (`VolumeMap::generation_record`), as a hot upgrade hands it on.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GenerationRecord {
    pub generation: u64,
    pub fenced_at: u64,
    /// The first generation whose writes the record holds (0: none).
    #[serde(default)]
    pub recorded_from: u64,
    /// (virtual cluster, generation) of every cluster a generation wrote.
    pub written: Vec<(u64, u32)>,
    /// The granules written in each of those clusters, in the same order (an image
    /// without them: every granule).
    #[serde(default)]
    pub granules: Vec<Granules>,
}

/// Virtual clusters per map page.
pub const PAGE: usize = 1024;

/// One page of the map.
pub struct MapPage {
    physical: [AtomicU32; PAGE],
    dirty: [AtomicU64; PAGE / 64],
    /// The latest generation of a replicated volume that wrote each cluster here (0:
    /// none since the engine started).
    written_at: [AtomicU32; PAGE],
    /// The granules of each cluster that any generation wrote since the engine
    /// started (bits are only ever set: a record that names more than was written
    /// since a replica left only copies more).
    granules: [[AtomicU64; (GRANULES / 64) as usize]; PAGE],
    /// Which clusters here hold only some of their granules, a bit each (the others
    /// are read from the parent).
    partial: [AtomicU64; PAGE / 64],
    /// The granules each cluster held in part holds; made with the page's first such.
    held: OnceLock<Box<HeldGranules>>,
}

type HeldGranules = [[AtomicU64; (GRANULES / 64) as usize]; PAGE];

impl MapPage {
    fn new() -> Box<MapPage> {
        Box::new(MapPage {
            physical: std::array::from_fn(|_| AtomicU32::new(0)),
            dirty: std::array::from_fn(|_| AtomicU64::new(0)),
            written_at: std::array::from_fn(|_| AtomicU32::new(0)),
            granules: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
            partial: std::array::from_fn(|_| AtomicU64::new(0)),
            held: OnceLock::new(),
        })
    }

    fn is_partial(&self, i: usize) -> bool {
        self.partial[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0
    }

    /// Whether cluster `i` (mapped) holds every granule of `granules`.
    fn holds(&self, i: usize, granules: &Granules) -> bool {
        if !self.is_partial(i) {
            return true;
        }
        let Some(held) = self.held.get() else { return false };
        held[i].iter().zip(granules).all(|(h, g)| h.load(Ordering::Acquire) & g == *g)
    }
}

type PageSlot = Arc<OnceLock<Box<MapPage>>>;

/// The cluster map of a volume at one size.
pub struct VolumeMap {
    pages: Box<[PageSlot]>,
    clusters: u64,
    /// Whether writes mark their clusters dirty. Shared by every size of the map.
    tracking: Arc<AtomicBool>,
    /// The latest generation of the volume that took it as a replica (0: none): a
    /// writer of an older one may no longer write through its replica export. Shared
    /// by every size.
    generation: Arc<AtomicU64>,
    /// The latest generation another engine took it at, through its replica export's
    /// reservation: this engine's own mirror of an older one may no longer write to it.
    fenced_at: Arc<AtomicU64>,
    /// The first generation this engine served the volume at since it started (0:
    /// none): the record of what each generation wrote begins there, so a replica
    /// that left before it can only be rebuilt in full.
    recorded_from: Arc<AtomicU64>,
    /// The map of the snapshot this volume lies over: what it does not hold is read
    /// from there (and down that one's parent).
    parent: Option<Arc<VolumeMap>>,
    /// Set once the map became a snapshot's: the volume's map now. Weak: the new map
    /// holds this one as its parent. Shared by every size.
    successor: Arc<OnceLock<Weak<VolumeMap>>>,
    /// The writes over the snapshot under way. Shared by every size.
    claims: Arc<LayerClaims>,
}

impl VolumeMap {
    /// An empty map of `clusters` clusters.
    pub fn new(clusters: u64) -> VolumeMap {
        VolumeMap::over(clusters, None)
    }

    /// An empty map of `clusters` clusters lying over `parent` (a snapshot's map).
    pub fn over(clusters: u64, parent: Option<Arc<VolumeMap>>) -> VolumeMap {
        let pages = (0..clusters.div_ceil(PAGE as u64)).map(|_| PageSlot::default()).collect();
        VolumeMap {
            pages,
            clusters,
            tracking: Arc::default(),
            generation: Arc::default(),
            fenced_at: Arc::default(),
            recorded_from: Arc::default(),
            parent,
            successor: Arc::default(),
            claims: Arc::default(),
        }
    }

    /// A new, empty map for the volume this one served, lying over this one (which
    /// becomes a snapshot's): the volume keeps its size, its dirty tracking and its
    /// replica generations.
    pub fn layer_over(self: &Arc<Self>) -> VolumeMap {
        VolumeMap {
            tracking: self.tracking.clone(),
            generation: self.generation.clone(),
            fenced_at: self.fenced_at.clone(),
            recorded_from: self.recorded_from.clone(),
            ..VolumeMap::over(self.clusters, Some(self.clone()))
        }
    }

    /// The writes over the snapshot under way (see [`LayerClaims`]).
    pub fn claims(&self) -> &LayerClaims {
        &self.claims
    }

    /// The snapshot's map this one lies over, if any.
    pub fn parent(&self) -> Option<&Arc<VolumeMap>> {
        self.parent.as_ref()
    }

    /// Marks the map a snapshot's, or one replaced by its detached copy: the volume it
    /// served goes on with `next`.
    pub fn hand_on(&self, next: &Arc<VolumeMap>) {
        let _ = self.successor.set(Arc::downgrade(next));
    }

    /// Whether the map became a snapshot's, with the volume's map since (`Some(None)`:
    /// the volume is gone).
    pub fn successor(&self) -> Option<Option<Arc<VolumeMap>>> {
        self.successor.get().map(Weak::upgrade)
    }

    /// The same map grown (or shrunk) to `clusters`, sharing every page it keeps.
    pub fn resized(&self, clusters: u64) -> VolumeMap {
        let n = clusters.div_ceil(PAGE as u64) as usize;
        let pages =
            (0..n).map(|i| self.pages.get(i).cloned().unwrap_or_default()).collect::<Vec<_>>().into_boxed_slice();
        VolumeMap {
            pages,
            clusters,
            tracking: self.tracking.clone(),
            generation: self.generation.clone(),
            fenced_at: self.fenced_at.clone(),
            recorded_from: self.recorded_from.clone(),
            parent: self.parent.clone(),
            successor: self.successor.clone(),
            claims: self.claims.clone(),
        }
    }

    /// The same map lying over nothing (an inflated volume's), sharing every page:
    /// the volume goes on with it, and a backend holding this one finds it
    /// ([`VolumeMap::hand_on`]).
    pub fn detached(&self) -> VolumeMap {
        VolumeMap { parent: None, successor: Arc::default(), ..self.resized(self.clusters) }
    }

    /// Number of virtual clusters.
    pub fn clusters(&self) -> u64 {
        self.clusters
    }

    fn page(&self, vc: u64) -> Option<&MapPage> {
        self.pages.get((vc / PAGE as u64) as usize)?.get().map(|b| &**b)
    }

    /// The physical cluster behind virtual cluster `vc`; 0 when unallocated.
    pub fn get(&self, vc: u64) -> u32 {
        // SeqCst pairs with `clear`: a reader either sees the cleared entry, or its
        // in-flight count is seen by the thread waiting to reuse the cluster.
        self.page(vc).map_or(0, |p| p.physical[vc as usize % PAGE].load(Ordering::SeqCst))
    }

    /// Publishes a mapping of a whole cluster (metadata thread only, after the
    /// mapping is durable).
    pub fn set(&self, vc: u64, pc: u32) {
        let Some(slot) = self.pages.get((vc / PAGE as u64) as usize) else { return };
        let (page, i) = (slot.get_or_init(MapPage::new), vc as usize % PAGE);
        page.partial[i / 64].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        page.physical[i].store(pc, Ordering::SeqCst);
    }

    /// Publishes a mapping of a cluster that holds `held` of its granules, the others
    /// read from the parent (metadata thread only, once durable). The granules are
    /// set before the cluster is published, so a reader that sees it sees them.
    pub fn set_partial(&self, vc: u64, pc: u32, held: Granules) {
        let Some(slot) = self.pages.get((vc / PAGE as u64) as usize) else { return };
        let (page, i) = (slot.get_or_init(MapPage::new), vc as usize % PAGE);
        let bits =
            page.held.get_or_init(|| Box::new(std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0)))));
        for (word, g) in bits[i].iter().zip(held) {
            word.store(g, Ordering::SeqCst);
        }
        page.partial[i / 64].fetch_or(1 << (i % 64), Ordering::SeqCst);
        page.physical[i].store(pc, Ordering::SeqCst);
    }

    /// Publishes that the cluster at `vc` holds `granules` too (metadata thread only,
    /// once durable); one that holds every granule of `whole` becomes whole.
    pub fn hold(&self, vc: u64, granules: Granules, whole: Granules) {
        let Some(page) = self.page(vc) else { return };
        let i = vc as usize % PAGE;
        let Some(bits) = page.held.get() else { return };
        let mut all = true;
        for ((word, g), w) in bits[i].iter().zip(granules).zip(whole) {
            all &= (word.fetch_or(g, Ordering::SeqCst) | g) & w == w;
        }
        if all {
            page.partial[i / 64].fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        }
    }

    /// Whether the cluster at `vc` is mapped and holds every granule of `granules`
    /// (a write there goes straight to it).
    pub fn holds(&self, vc: u64, granules: &Granules) -> bool {
        self.page(vc).is_some_and(|p| {
            let i = vc as usize % PAGE;
            p.physical[i].load(Ordering::SeqCst) != 0 && p.holds(i, granules)
        })
    }

    /// Whether a parent down the chain has anything at `vc`: a write there must keep
    /// the rest of the cluster readable from it.
    pub fn under(&self, vc: u64) -> bool {
        let mut at = self.parent.as_deref();
        while let Some(m) = at {
            if vc < m.clusters && m.get(vc) != 0 {
                return true;
            }
            at = m.parent.as_deref();
        }
        false
    }

    /// Where each piece of bytes `within..within + len` of virtual cluster `vc` is
    /// read from, in order: `f(offset in the cluster, length, physical cluster)`, the
    /// physical cluster 0 for zeroes. A whole cluster of this map is one piece; a
    /// cluster held in part, or none, splits at granules (of `1 << granule_shift`
    /// bytes) that the parents hold, nearest first.
    pub fn sources(&self, vc: u64, within: u64, len: u64, shift: u32, mut f: impl FnMut(u64, u64, u32)) {
        if let Some(p) = self.page(vc) {
            let i = vc as usize % PAGE;
            let pc = p.physical[i].load(Ordering::SeqCst);
            if pc != 0 && !p.is_partial(i) {
                return f(within, len, pc);
            }
        }
        if self.parent.is_none() && self.get(vc) == 0 {
            return f(within, len, 0);
        }
        let g_shift = granule_shift(shift);
        let end = within + len;
        let mut run: Option<(u64, u64, u32)> = None;
        let mut at = within;
        while at < end {
            let g = at >> g_shift;
            let stop = ((g + 1) << g_shift).min(end);
            let mut bit = [0u64; (GRANULES / 64) as usize];
            bit[(g / 64) as usize % bit.len()] = 1 << (g % 64);
            let pc = self.source_of(vc, &bit);
            match &mut run {
                Some((_, n, p)) if *p == pc => *n += stop - at,
                _ => {
                    if let Some((o, n, p)) = run.take() {
                        f(o, n, p);
                    }
                    run = Some((at, stop - at, pc));
                }
            }
            at = stop;
        }
        if let Some((o, n, p)) = run {
            f(o, n, p);
        }
    }

    /// The granules the cluster at `vc` holds: all for a whole one, none unmapped.
    pub fn held(&self, vc: u64) -> Granules {
        let Some(p) = self.page(vc) else { return [0; 4] };
        let i = vc as usize % PAGE;
        if p.physical[i].load(Ordering::SeqCst) == 0 {
            return [0; 4];
        }
        if !p.is_partial(i) {
            return [u64::MAX; 4];
        }
        p.held.get().map_or([0; 4], |h| h[i].each_ref().map(|w| w.load(Ordering::SeqCst)))
    }

    /// The physical cluster under this map that holds granule `bit` of `vc`: the
    /// nearest parent's that does (0: none, zeroes).
    pub fn parent_source(&self, vc: u64, bit: &Granules) -> u32 {
        self.parent.as_deref().map_or(0, |p| p.source_of(vc, bit))
    }

    /// The physical cluster that holds granule `bit` of `vc`, down the chain (0: none).
    fn source_of(&self, vc: u64, bit: &Granules) -> u32 {
        let mut at = Some(self);
        while let Some(m) = at {
            if vc >= m.clusters {
                return 0;
            }
            if let Some(p) = m.page(vc) {
                let i = vc as usize % PAGE;
                let pc = p.physical[i].load(Ordering::SeqCst);
                if pc != 0 && p.holds(i, bit) {
                    return pc;
                }
            }
            at = m.parent.as_deref();
        }
        0
    }

    /// Which of the mapped clusters hold only some granules, and which (for a
    /// snapshot taking this map's entries).
    pub fn partial_clusters(&self) -> Vec<(u64, Granules)> {
        let mut out = Vec::new();
        for (pi, slot) in self.pages.iter().enumerate() {
            let Some(p) = slot.get() else { continue };
            let Some(held) = p.held.get() else { continue };
            for i in (0..PAGE).filter(|&i| p.is_partial(i)) {
                out.push(((pi * PAGE + i) as u64, held[i].each_ref().map(|w| w.load(Ordering::SeqCst))));
            }
        }
        out
    }

    /// Removes a mapping (metadata thread only); returns the physical cluster it had.
    pub fn clear(&self, vc: u64) -> u32 {
        self.page(vc).map_or(0, |p| p.physical[vc as usize % PAGE].swap(0, Ordering::SeqCst))
    }

    /// Notes that virtual cluster `vc` was written, if tracking is on.
    pub fn mark_written(&self, vc: u64) {
        if self.tracking.load(Ordering::Relaxed)
            && let Some(p) = self.page(vc)
        {
            let bit = vc as usize % PAGE;
            p.dirty[bit / 64].fetch_or(1 << (bit % 64), Ordering::Relaxed);
        }
    }

    /// Starts or stops dirty tracking. Starting clears the set.
    pub fn set_tracking(&self, on: bool) {
        if on {
            self.dirty_clusters(true);
        }
        self.tracking.store(on, Ordering::SeqCst);
    }

    /// Whether dirty tracking is on.
    pub fn tracking(&self) -> bool {
        self.tracking.load(Ordering::SeqCst)
    }

    /// Records that generation `g` of the volume took it as a replica; returns the
    /// latest generation that did, `g` or a later one.
    pub fn take_generation(&self, g: u64) -> u64 {
        self.generation.fetch_max(g, Ordering::SeqCst).max(g)
    }

    /// The latest generation that took the volume as a replica (0: none).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Records that another engine took the volume at generation `g` (its replica
    /// export's reservation): this engine's mirrors of older generations are fenced.
    /// The record of what this engine's generations wrote ends there: the other
    /// engine's writes are not in it, so a replica that left before cannot be rebuilt
    /// from it (it starts again when this engine serves the volume again).
    pub fn fence(&self, g: u64) {
        if self.fenced_at.fetch_max(g, Ordering::SeqCst) < g {
            self.recorded_from.store(0, Ordering::SeqCst);
        }
        self.take_generation(g);
    }

    /// Notes that this engine serves the volume at generation `g`: the record of what
    /// each generation wrote starts with the first one.
    pub fn start_record(&self, g: u64) {
        let _ = self.recorded_from.compare_exchange(0, g, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Whether the record names every cluster written at generation `g` or later.
    pub fn records_since(&self, g: u64) -> bool {
        let from = self.recorded_from.load(Ordering::SeqCst);
        from != 0 && g >= from
    }

    /// Takes back the generations the pool's metadata kept (when the pool opens).
    pub fn restore_generations(&self, g: super::format::Generations) {
        self.take_generation(g.taken);
        self.fenced_at.fetch_max(g.fenced_at, Ordering::SeqCst);
    }

    /// The latest generation another engine took the volume at (0: none).
    pub fn fenced_at(&self) -> u64 {
        self.fenced_at.load(Ordering::SeqCst)
    }

    /// What a hot upgrade hands on for a volume a generation took: the generation,
    /// the one another engine took it at, and the clusters written with the
    /// generation that wrote each last. `None` for a volume no generation took.
    pub fn generation_record(&self) -> Option<GenerationRecord> {
        let generation = self.generation();
        if generation == 0 {
            return None;
        }
        let (mut written, mut granules) = (Vec::new(), Vec::new());
        for (pi, slot) in self.pages.iter().enumerate() {
            let Some(p) = slot.get() else { continue };
            for (i, at) in p.written_at.iter().enumerate() {
                let at = at.load(Ordering::Relaxed);
                if at != 0 {
                    written.push(((pi * PAGE + i) as u64, at));
                    granules.push(p.granules[i].each_ref().map(|g| g.load(Ordering::Relaxed)));
                }
            }
        }
        let recorded_from = self.recorded_from.load(Ordering::SeqCst);
        Some(GenerationRecord { generation, fenced_at: self.fenced_at(), recorded_from, written, granules })
    }

    /// Takes back what `generation_record` gave (in the new process of a hot upgrade).
    pub fn restore_generation_record(&self, record: &GenerationRecord) {
        self.take_generation(record.generation);
        self.fenced_at.fetch_max(record.fenced_at, Ordering::SeqCst);
        if record.recorded_from != 0 {
            self.start_record(record.recorded_from);
        }
        for (i, &(vc, at)) in record.written.iter().enumerate() {
            // A cluster written and released since has no page yet here: the record
            // must still name it (the replica that lacks it deallocates it too).
            if let Some(slot) = self.pages.get((vc / PAGE as u64) as usize) {
                slot.get_or_init(MapPage::new);
            }
            self.mark_generation(vc, u64::from(at), record.granules.get(i).copied().unwrap_or(ALL_GRANULES));
        }
    }

    /// Notes that generation `g` of the volume wrote (or zeroed) the granules
    /// `granules` of virtual cluster `vc`: the record of what a replica that left the
    /// volume lacks. The granules are set before the generation is raised, so a
    /// reader that sees the generation sees them.
    pub fn mark_generation(&self, vc: u64, g: u64, granules: Granules) {
        let g = g.min(u64::from(u32::MAX)) as u32;
        let Some(p) = self.page(vc) else { return };
        let i = vc as usize % PAGE;
        // Read first: granules written again (the common case) cost no write to a
        // line the other reactors read.
        for (word, bits) in p.granules[i].iter().zip(granules) {
            if word.load(Ordering::Relaxed) & bits != bits {
                word.fetch_or(bits, Ordering::Release);
            }
        }
        let at = &p.written_at[i];
        if at.load(Ordering::Relaxed) < g {
            at.fetch_max(g, Ordering::Release);
        }
    }

    /// The clusters generation `g` or a later one wrote, in ascending order, each
    /// with the granules written in it.
    pub fn written_since(&self, g: u64) -> Vec<(u64, Granules)> {
        let mut out = Vec::new();
        for (pi, slot) in self.pages.iter().enumerate() {
            let Some(p) = slot.get() else { continue };
            for (i, at) in p.written_at.iter().enumerate() {
                let vc = (pi * PAGE + i) as u64;
                if u64::from(at.load(Ordering::Acquire)) >= g && vc < self.clusters {
                    out.push((vc, p.granules[i].each_ref().map(|w| w.load(Ordering::Acquire))));
                }
            }
        }
        out
    }

    /// The dirty clusters in ascending order; cleared as they are read if `reset`, so a
    /// write that races with the report is either in it or in the next one.
    pub fn dirty_clusters(&self, reset: bool) -> Vec<u64> {
        let mut out = Vec::new();
        for (pi, slot) in self.pages.iter().enumerate() {
            let Some(p) = slot.get() else { continue };
            for (wi, w) in p.dirty.iter().enumerate() {
                let mut bits = if reset { w.swap(0, Ordering::Relaxed) } else { w.load(Ordering::Relaxed) };
                while bits != 0 {
                    let b = bits.trailing_zeros() as u64;
                    bits &= bits - 1;
                    let vc = (pi * PAGE + wi * 64) as u64 + b;
                    if vc < self.clusters {
                        out.push(vc);
                    }
                }
            }
        }
        out
    }

    /// Allocated clusters (for stats).
    pub fn allocated(&self) -> u64 {
        let mut n = 0;
        for slot in self.pages.iter() {
            if let Some(p) = slot.get() {
                n += p.physical.iter().filter(|e| e.load(Ordering::Relaxed) != 0).count() as u64;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::granules::{granule_runs, granules_of};

    #[test]
    fn grown_maps_share_pages() {
        let m = VolumeMap::new(10);
        m.set(3, 77);
        let big = m.resized(5000);
        assert_eq!(big.get(3), 77);
        big.set(4, 78);
        assert_eq!(m.get(4), 78, "the old map sees changes made through the new one");
        big.set(4000, 9);
        assert_eq!(big.get(4000), 9);
        assert_eq!(m.get(4000), 0);
        assert_eq!(big.allocated(), 3);
        assert_eq!(big.clear(3), 77);
        assert_eq!(m.get(3), 0);
    }

    #[test]
    fn the_record_names_the_granules_each_generation_wrote() {
        let m = VolumeMap::new(8);
        for vc in 0..8 {
            m.set(vc, vc as u32 + 1);
        }
        let shift = 20; // 1 MiB clusters: 4 KiB granules
        m.mark_generation(1, 1, granules_of(0, 4096, shift));
        m.mark_generation(2, 2, granules_of(8192, 16384, shift));
        m.mark_generation(2, 2, granules_of((1 << 20) - 4096, 4096, shift));
        m.mark_generation(3, 3, granules_of(4096, 1, shift));
        let since: Vec<(u64, Vec<(u64, u64)>)> =
            m.written_since(2).into_iter().map(|(vc, g)| (vc, granule_runs(&g, shift))).collect();
        assert_eq!(since, [(2, vec![(8192, 16384), ((1 << 20) - 4096, 4096)]), (3, vec![(4096, 4096)])]);
        // A later generation writing the cluster again keeps what the earlier wrote.
        m.mark_generation(2, 4, granules_of(0, 4096, shift));
        assert_eq!(granule_runs(&m.written_since(4)[0].1, shift), [(0, 4096), (8192, 16384), ((1 << 20) - 4096, 4096)]);
    }

    #[test]
    fn dirty_tracking_reports_and_resets() {
        let m = VolumeMap::new(3000);
        m.set(1, 5);
        m.mark_written(1);
        assert!(m.dirty_clusters(false).is_empty(), "not tracking yet");
        m.set_tracking(true);
        let grown = m.resized(5000);
        grown.set(4000, 6);
        m.mark_written(1);
        grown.mark_written(4000);
        assert!(grown.tracking());
        assert_eq!(m.dirty_clusters(false), vec![1], "the old map stops at its size");
        assert_eq!(grown.dirty_clusters(true), vec![1, 4000]);
        assert!(grown.dirty_clusters(false).is_empty());
        grown.set_tracking(false);
        grown.mark_written(1);
        assert!(grown.dirty_clusters(false).is_empty());
    }
}

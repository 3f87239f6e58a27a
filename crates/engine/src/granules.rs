//! Granules: a cluster's 256 equal parts, the unit a layer over a snapshot holds and a
//! replica's write record names. A set of them is a bitmap ([`Granules`]); these are
//! the few pure functions between byte ranges and those bitmaps, shared by the pool,
//! its backends and the commands that carry a write's granules from one to the other.

/// Granules per cluster (fewer in clusters below 1 MiB: a granule is never less than
/// a 4 KiB block).
pub const GRANULES: u32 = 256;

/// Which granules of a cluster, a bit each.
pub type Granules = [u64; (GRANULES / 64) as usize];

/// Every granule there can be (a cluster has fewer below 1 MiB: [`whole_granules`]).
pub const ALL_GRANULES: Granules = [u64::MAX; (GRANULES / 64) as usize];

/// A granule's size (as a shift) in a cluster of `1 << shift` bytes: a 256th of it,
/// and never less than a 4 KiB block, so that each granule is whole blocks.
pub fn granule_shift(shift: u32) -> u32 {
    shift.saturating_sub(8).max(12)
}

/// Every granule of a cluster of `cluster_size` bytes.
pub fn whole_granules(cluster_size: u64) -> Granules {
    let shift = cluster_size.trailing_zeros();
    let count = (1u32 << shift.saturating_sub(granule_shift(shift))).min(GRANULES);
    let mut g = [0u64; (GRANULES / 64) as usize];
    for i in 0..count {
        g[(i / 64) as usize] |= 1 << (i % 64);
    }
    g
}

/// The granules that bytes `within..within + len` of a cluster of `1 << shift` bytes
/// touch.
pub fn granules_of(within: u64, len: u64, shift: u32) -> Granules {
    let mut bits = [0u64; (GRANULES / 64) as usize];
    if len == 0 {
        return bits;
    }
    let granule_shift = granule_shift(shift);
    let (first, last) = (within >> granule_shift, (within + len - 1) >> granule_shift);
    for g in first..=last.min(u64::from(GRANULES) - 1) {
        bits[(g / 64) as usize] |= 1 << (g % 64);
    }
    bits
}

/// The byte ranges (offset within the cluster, length) of the granules set in
/// `granules`, runs of adjacent ones merged, for a cluster of `1 << shift` bytes.
pub fn granule_runs(granules: &Granules, shift: u32) -> Vec<(u64, u64)> {
    let granule_shift = granule_shift(shift);
    let set = |g: u32| granules[(g / 64) as usize] & (1 << (g % 64)) != 0;
    let mut runs: Vec<(u64, u64)> = Vec::new();
    let count = (1u32 << shift.saturating_sub(granule_shift)).min(GRANULES);
    for g in (0..count).filter(|&g| set(g)) {
        let at = u64::from(g) << granule_shift;
        match runs.last_mut() {
            Some((start, len)) if *start + *len == at => *len += 1 << granule_shift,
            _ => runs.push((at, 1 << granule_shift)),
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_ranges_and_granules_agree() {
        // 128 KiB clusters: granules of one 4 KiB block, 32 of them.
        assert_eq!(granule_runs(&granules_of(0, 128 << 10, 17), 17), [(0, 128 << 10)]);
        assert_eq!(granule_runs(&granules_of(4096, 512, 17), 17), [(4096, 4096)]);
        assert_eq!(whole_granules(128 << 10), [u32::MAX as u64, 0, 0, 0]);
        assert_eq!(whole_granules(1 << 20), ALL_GRANULES);
        assert_eq!(whole_granules(4 << 20), ALL_GRANULES);
    }
}

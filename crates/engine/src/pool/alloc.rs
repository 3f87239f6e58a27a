//! The set of free physical clusters.

/// Free physical clusters, numbered from 1 (0 means "unallocated" in maps).
pub struct FreeClusters {
    /// Bit `c - 1` is set when cluster `c` is free.
    bits: Vec<u64>,
    total: u32,
    free: u32,
    /// Where the next search starts, so allocations run forward and stay contiguous.
    cursor: u32,
}

impl FreeClusters {
    /// Every cluster of `total` free except those in `used`.
    pub fn new(total: u32, used: &[u32]) -> FreeClusters {
        let mut bits = vec![u64::MAX; (total as usize).div_ceil(64)];
        if !total.is_multiple_of(64) {
            let last = bits.len() - 1;
            bits[last] = (1u64 << (total % 64)) - 1;
        }
        let mut f = FreeClusters { bits, total, free: total, cursor: 0 };
        for &c in used {
            f.remove(c);
        }
        f
    }

    fn remove(&mut self, c: u32) {
        let i = (c - 1) as usize;
        if self.bits[i / 64] & (1 << (i % 64)) != 0 {
            self.bits[i / 64] &= !(1 << (i % 64));
            self.free -= 1;
        }
    }

    /// Takes one free cluster, the next one after the previous allocation if it can.
    pub fn take(&mut self) -> Option<u32> {
        if self.free == 0 {
            return None;
        }
        let words = self.bits.len();
        let start = (self.cursor / 64) as usize;
        for k in 0..=words {
            let wi = (start + k) % words;
            let mut w = self.bits[wi];
            if k == 0 {
                // Skip bits before the cursor in its own word on the first visit.
                w &= u64::MAX << (self.cursor % 64);
            }
            if w != 0 {
                let c = (wi * 64) as u32 + w.trailing_zeros() + 1;
                self.remove(c);
                self.cursor = c % self.total;
                return Some(c);
            }
        }
        None
    }

    /// Returns a cluster to the free set.
    pub fn put(&mut self, c: u32) {
        let i = (c - 1) as usize;
        if self.bits[i / 64] & (1 << (i % 64)) == 0 {
            self.bits[i / 64] |= 1 << (i % 64);
            self.free += 1;
        }
    }

    /// Number of free clusters.
    pub fn free(&self) -> u32 {
        self.free
    }

    /// Number of clusters in the pool.
    pub fn total(&self) -> u32 {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn allocation_is_contiguous_and_exhausts() {
        let mut f = FreeClusters::new(130, &[2, 3]);
        assert_eq!(f.free(), 128);
        assert_eq!(f.take(), Some(1));
        assert_eq!(f.take(), Some(4));
        assert_eq!(f.take(), Some(5));
        let mut n = 3;
        while f.take().is_some() {
            n += 1;
        }
        assert_eq!(n, 128);
        f.put(77);
        assert_eq!(f.take(), Some(77));
        assert_eq!(f.take(), None);
    }

    proptest! {
        #[test]
        fn matches_a_set_model(total in 1u32..300, ops in proptest::collection::vec(any::<Option<u16>>(), 0..400)) {
            let mut f = FreeClusters::new(total, &[]);
            let mut used = BTreeSet::new();
            for op in ops {
                match op {
                    None => match f.take() {
                        Some(c) => { prop_assert!(c >= 1 && c <= total); prop_assert!(used.insert(c)); }
                        None => prop_assert_eq!(used.len() as u32, total),
                    },
                    Some(x) => {
                        let c = u32::from(x) % total + 1;
                        f.put(c);
                        used.remove(&c);
                    }
                }
                prop_assert_eq!(f.free(), total - used.len() as u32);
            }
        }
    }
}

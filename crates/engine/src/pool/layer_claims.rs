//! Which granules of a layer's clusters writes over a snapshot have under way.
//!
//! A write to granules a layer does not hold yet goes one of two ways. Whole granules
//! of a cluster the layer has go *direct*: the reactor writes them (durably) and the
//! metadata thread then records them held. Anything else is *queued* to the metadata
//! thread, which merges a granule written in part with the snapshot's bytes and writes
//! it whole. Two such writes to one granule must not interleave: a queued write would
//! fill the rest of a granule with the snapshot's bytes over a direct write's. So a
//! direct write goes only where nothing is queued or direct already, and the metadata
//! thread holds back a queued write until the direct ones under its granules are
//! recorded. Writes to granules already held need neither (they go to the cluster).

use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::granules::Granules;
use crate::sync::lock;

/// One cluster's writes under way.
#[derive(Default)]
struct Claim {
    /// Granules direct writes are filling.
    direct: Granules,
    /// Queued writes touching the cluster, not yet carried out.
    queued: u32,
}

/// A volume's writes over its snapshot under way, by virtual cluster.
#[derive(Default)]
pub struct LayerClaims(Mutex<BTreeMap<u64, Claim>>);

impl LayerClaims {
    /// Claims `granules` of each cluster for a direct write; false (nothing claimed)
    /// if a queued write touches one of the clusters or a direct one those granules.
    pub fn claim_direct(&self, pieces: &[(u64, Granules)]) -> bool {
        let mut claims = lock(&self.0);
        let free = pieces.iter().all(|(vc, g)| {
            claims.get(vc).is_none_or(|c| c.queued == 0 && c.direct.iter().zip(g).all(|(d, g)| d & g == 0))
        });
        if free {
            for (vc, g) in pieces {
                let c = claims.entry(*vc).or_default();
                c.direct.iter_mut().zip(g).for_each(|(d, g)| *d |= g);
            }
        }
        free
    }

    /// Lets go of direct claims once their granules are recorded held (or the write
    /// failed).
    pub fn release_direct(&self, pieces: &[(u64, Granules)]) {
        let mut claims = lock(&self.0);
        for (vc, g) in pieces {
            if let Some(c) = claims.get_mut(vc) {
                c.direct.iter_mut().zip(g).for_each(|(d, g)| *d &= !g);
                if c.queued == 0 && c.direct == [0; 4] {
                    claims.remove(vc);
                }
            }
        }
    }

    /// Counts a queued write touching clusters `first..=last`.
    pub fn queue(&self, first: u64, last: u64) {
        let mut claims = lock(&self.0);
        for vc in first..=last {
            claims.entry(vc).or_default().queued += 1;
        }
    }

    /// A queued write to clusters `first..=last` was carried out (or failed).
    pub fn dequeue(&self, first: u64, last: u64) {
        let mut claims = lock(&self.0);
        for vc in first..=last {
            if let Some(c) = claims.get_mut(&vc) {
                c.queued = c.queued.saturating_sub(1);
                if c.queued == 0 && c.direct == [0; 4] {
                    claims.remove(&vc);
                }
            }
        }
    }

    /// Whether a direct write is filling any of `granules` of cluster `vc`.
    pub fn direct_under(&self, vc: u64, granules: &Granules) -> bool {
        lock(&self.0).get(&vc).is_some_and(|c| c.direct.iter().zip(granules).any(|(d, g)| d & g != 0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G0: Granules = [1, 0, 0, 0];
    const G1: Granules = [2, 0, 0, 0];

    #[test]
    fn a_direct_write_goes_only_where_no_other_write_is_under_way() {
        let claims = LayerClaims::default();
        assert!(claims.claim_direct(&[(3, G0)]));
        assert!(!claims.claim_direct(&[(3, G0)]), "the same granule is being written");
        assert!(claims.claim_direct(&[(3, G1)]), "another granule of the cluster is free");
        assert!(claims.direct_under(3, &G0) && !claims.direct_under(4, &G0));
        claims.queue(5, 6);
        assert!(!claims.claim_direct(&[(6, G0)]), "a queued write touches the cluster");
        claims.dequeue(5, 6);
        assert!(claims.claim_direct(&[(6, G0)]));
        claims.release_direct(&[(3, G0), (3, G1), (6, G0)]);
        assert!(!claims.direct_under(3, &[u64::MAX; 4]));
        assert!(lock(&claims.0).is_empty(), "nothing is left behind");
    }
}

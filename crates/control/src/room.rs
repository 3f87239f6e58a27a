//! Making room: which volumes leave a node so that another volume fits there.
//!
//! The controller's rebalancer and the simulator both ask these questions, so that
//! the figures the simulator reports are those of the rebalancer that runs. Pure
//! code: the callers say which volumes may move and carry the moves out.

/// Most volumes moved to make room for one.
pub const MOST_MOVED: usize = 4;
/// Most bytes moved to make room for a volume, as a multiple of its size: beyond
/// that, placing it remotely is the cheaper answer.
pub const MOST_BYTES_PER_BYTE: u64 = 2;
/// How many nodes a hole is tried on, fewest bytes to move first.
pub const HOLE_TRIES: usize = 8;

/// The volumes to move off a node to free `deficit` bytes there for a volume of
/// `size` bytes, from `movable` (size, key): the smallest one that is enough, else the
/// largest ones, at most [`MOST_MOVED`] volumes and [`MOST_BYTES_PER_BYTE`] times
/// `size` bytes. `None` when those cannot free the deficit. Ties go to the smaller
/// key, so the answer depends only on its input.
pub fn evictions<K: Ord>(mut movable: Vec<(u64, K)>, deficit: u64, size: u64) -> Option<Vec<(u64, K)>> {
    movable.sort_unstable();
    let chosen = match movable.iter().position(|(s, _)| *s >= deficit) {
        Some(i) => vec![movable.swap_remove(i)],
        None => {
            let mut picked = Vec::new();
            let mut freed = 0;
            while freed < deficit && picked.len() < MOST_MOVED {
                let (s, key) = movable.pop()?;
                freed += s;
                picked.push((s, key));
            }
            if freed < deficit {
                return None;
            }
            picked
        }
    };
    let bytes: u64 = chosen.iter().map(|(s, _)| s).sum();
    (bytes <= MOST_BYTES_PER_BYTE.saturating_mul(size)).then_some(chosen)
}

/// The nodes to try for a hole, from (deficit, movable bytes, node): those whose
/// movable volumes could cover their deficit, at most [`HOLE_TRIES`], the smallest
/// deficit first (ties: the smaller node).
pub fn hole_candidates<N: Ord>(nodes: impl Iterator<Item = (u64, u64, N)>) -> Vec<N> {
    let mut candidates: Vec<(u64, N)> =
        nodes.filter(|(deficit, movable, _)| movable >= deficit).map(|(deficit, _, n)| (deficit, n)).collect();
    if candidates.len() > HOLE_TRIES {
        candidates.select_nth_unstable(HOLE_TRIES - 1);
        candidates.truncate(HOLE_TRIES);
    }
    candidates.sort_unstable();
    candidates.into_iter().map(|(_, n)| n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_volume_that_is_enough_goes_alone() {
        let movable = vec![(50, "a"), (300, "b"), (120, "c"), (120, "d")];
        assert_eq!(evictions(movable, 100, 100), Some(vec![(120, "c")]));
    }

    #[test]
    fn else_the_largest_go_up_to_four_volumes_and_twice_the_size() {
        let movable = vec![(10, "a"), (40, "b"), (30, "c"), (20, "d"), (5, "e")];
        assert_eq!(evictions(movable.clone(), 65, 100), Some(vec![(40, "b"), (30, "c")]));
        assert_eq!(evictions(movable.clone(), 100, 100), Some(vec![(40, "b"), (30, "c"), (20, "d"), (10, "a")]));
        // Five volumes would be needed.
        assert_eq!(evictions(movable.clone(), 101, 100), None);
        // Enough, but more than twice the volume's size.
        assert_eq!(evictions(movable, 40, 15), None);
        assert_eq!(evictions(Vec::<(u64, u8)>::new(), 1, 10), None);
    }

    #[test]
    fn holes_are_tried_where_the_fewest_bytes_move() {
        let nodes = (0..20u64).map(|n| (1000 - n * 10, if n == 3 { 0 } else { 5000 }, n));
        let order = hole_candidates(nodes);
        assert_eq!(order, vec![19, 18, 17, 16, 15, 14, 13, 12]);
        let few = [(30, 10, "x"), (20, 40, "y"), (20, 25, "w")];
        assert_eq!(hole_candidates(few.into_iter()), vec!["w", "y"]);
    }
}

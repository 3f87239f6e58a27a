//! Volume placement, in LightPool's two phases. *Filter* drops the nodes that cannot or
//! must not take the volume. *Score* ranks the rest by three terms:
//! - locality: the consumer's preference (its own node, or any other);
//! - reserve: whether the volume leaves a node the room its own pods' local requests
//!   are expected to need (learned from them: see `Outlook::reserve`);
//! - space: how much of the pool would be spoken for afterwards (taken, or reserved).
//!
//! The default weights put locality first, then reserves, then the pool with the most
//! room nobody expects to need: volumes that may go anywhere spread over that room and
//! stay off the room local requests will want (docs/ARCHITECTURE.md, "Placement", has
//! the measurements behind this). Pure code: the controller and the simulator both
//! call it.

use serde::{Deserialize, Serialize};

/// Where the volume's consumer would like it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Locality {
    #[default]
    Any,
    /// On the host node itself.
    Local,
    /// Anywhere but the host node.
    Remote,
}

impl std::fmt::Display for Locality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Locality::Any => "any",
            Locality::Local => "local",
            Locality::Remote => "remote",
        })
    }
}

/// How much each score counts. All three scores lie in [0, 1].
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Weights {
    pub locality: f64,
    /// 0 turns local reserves off: the scheduler then places as if no local request
    /// were to come.
    #[serde(default)]
    pub reserve: f64,
    pub space: f64,
}

impl Default for Weights {
    /// Locality outweighs the rest: a volume goes to its preferred place whenever that
    /// place fits it. Among equally preferred places, one that keeps the nodes'
    /// reserves whole beats one that eats into them, and the emptiest pool (counting
    /// reserves as taken) wins last. A positive space weight packs instead: the
    /// fullest pool wins.
    fn default() -> Weights {
        Weights { locality: 10.0, reserve: 2.0, space: -1.0 }
    }
}

/// How the pools' space may be promised.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Policy {
    pub weights: Weights,
    /// Thin volumes may promise up to this multiple of a pool's capacity.
    pub thin_overcommit: f64,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy { weights: Weights::default(), thin_overcommit: 2.0 }
    }
}

/// One pool, as the scheduler sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolView {
    pub name: String,
    pub capacity: u64,
    /// Bytes taken: thick volumes' sizes and thin volumes' allocations.
    pub committed: u64,
    /// Sum of the sizes of all its volumes.
    pub provisioned: u64,
    pub cluster_size: u64,
    /// Why the pool takes no changes, if it does not.
    pub failed: Option<String>,
}

/// One node, as the scheduler sees it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub healthy: bool,
    pub pools: Vec<PoolView>,
    /// Bytes of the live volumes that pods on this node asked to have on this node,
    /// wherever they were placed. With `local_held`, this is the node's history of
    /// local requests from which its reserve is learned.
    pub local_demand: u64,
    /// Of `local_demand`, the bytes that sit on this node.
    pub local_held: u64,
}

/// What is to be placed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Request {
    pub size: u64,
    pub thin: bool,
    pub locality: Locality,
    pub host_node: String,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
}

/// The scheduler's verdict on one node.
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    pub node: String,
    /// The pool the volume would go to.
    pub pool: String,
    /// Why the node was filtered out; `None` when it passed.
    pub filtered_out: Option<String>,
    pub locality: f64,
    pub reserve: f64,
    pub space: f64,
    pub total: f64,
    pub used_ratio_after: f64,
    /// Bytes the node keeps for its own pods' local requests (0 for the request's own
    /// host when it asks for local placement: the reserve is there for it).
    pub reserved: u64,
}

/// Bytes a volume of `size` takes from a pool when thick: whole clusters.
pub fn thick_bytes(size: u64, cluster_size: u64) -> u64 {
    let cluster_size = cluster_size.max(1);
    // Cluster sizes are powers of two in practice; this runs for every pool in every
    // decision, and a division costs more than the rest of the pool's check.
    if cluster_size.is_power_of_two() {
        size.checked_add(cluster_size - 1).map_or(u64::MAX, |s| s & !(cluster_size - 1))
    } else {
        size.div_ceil(cluster_size) * cluster_size
    }
}

/// Filters and scores every node and explains the best `limit` of them, best first
/// (eligible nodes by score, then filtered ones). Equal scores go to the pool that has
/// promised least for its size (see [`Eligible::promised`]), then in the order given,
/// which for the controller is by name. The first is the choice when it passed the
/// filter.
/// This is what the controller shows; [`choose`] makes the same choice without
/// explaining.
pub fn place(nodes: &[NodeView], req: &Request, policy: &Policy, limit: usize) -> Vec<Score> {
    let outlook = Outlook::of(nodes, policy);
    let host = host_of(nodes, req);
    let mut evaluated: Vec<(usize, Result<Eligible, Filtered>)> =
        nodes.iter().enumerate().map(|(i, n)| (i, evaluate(n, host == Some(i), req, policy, &outlook))).collect();
    let order = |a: &(usize, Result<Eligible, Filtered>), b: &(usize, Result<Eligible, Filtered>)| {
        let in_order = || a.0.cmp(&b.0);
        match (&a.1, &b.1) {
            // As `choose` compares: -0 and 0 are equal.
            (Ok(x), Ok(y)) => y
                .total
                .partial_cmp(&x.total)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| x.promised.partial_cmp(&y.promised).unwrap_or(std::cmp::Ordering::Equal))
                .then_with(in_order),
            (Ok(_), Err(_)) => std::cmp::Ordering::Less,
            (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
            (Err(_), Err(_)) => in_order(),
        }
    };
    // Only the explained nodes are sorted and put into words.
    if limit > 0 && evaluated.len() > limit {
        evaluated.select_nth_unstable_by(limit - 1, order);
        evaluated.truncate(limit);
    }
    evaluated.sort_by(order);
    evaluated
        .into_iter()
        .map(|(i, verdict)| {
            let n = &nodes[i];
            match verdict {
                Ok(e) => Score {
                    node: n.name.clone(),
                    pool: n.pools[e.pool].name.clone(),
                    filtered_out: None,
                    locality: e.locality,
                    reserve: e.reserve,
                    space: e.space,
                    total: e.total,
                    used_ratio_after: ratio(e.committed_after, &n.pools[e.pool]),
                    reserved: e.reserved,
                },
                Err(why) => Score {
                    node: n.name.clone(),
                    pool: String::new(),
                    filtered_out: Some(why.describe(n, req, policy)),
                    locality: 0.0,
                    reserve: 0.0,
                    space: 0.0,
                    total: 0.0,
                    used_ratio_after: 0.0,
                    reserved: 0,
                },
            }
        })
        .collect()
}

/// The chosen node and pool (indexes into `nodes`), without allocating: what the
/// simulator and the benchmark run. Same choice as `place`.
pub fn choose(nodes: &[NodeView], req: &Request, policy: &Policy) -> Option<(usize, usize)> {
    // A local request whose own node passes and fits: when locality outweighs the other
    // terms together, that node wins without scoring the rest. (Its own reserve is
    // there for it, so the outlook does not matter.)
    let w = &policy.weights;
    let host = host_of(nodes, req);
    if req.locality == Locality::Local
        && w.locality > w.reserve.abs() + w.space.abs()
        && let Some(host) = host
        && let Ok(e) = evaluate(&nodes[host], true, req, policy, &Outlook::NONE)
    {
        return Some((host, e.pool));
    }
    let outlook = Outlook::of(nodes, policy);
    let mut best: Option<(usize, Eligible)> = None;
    for (i, n) in nodes.iter().enumerate() {
        if let Ok(e) = evaluate(n, host == Some(i), req, policy, &outlook) {
            let better = match &best {
                None => true,
                Some((_, b)) => e.total > b.total || (e.total == b.total && e.promised < b.promised),
            };
            if better {
                best = Some((i, e));
            }
        }
    }
    best.map(|(i, e)| (i, e.pool))
}

/// The request's host node, if it names one; found once, so that each node's
/// evaluation compares indexes rather than names.
fn host_of(nodes: &[NodeView], req: &Request) -> Option<usize> {
    match req.locality {
        Locality::Any => None,
        Locality::Local | Locality::Remote => find_node(nodes, &req.host_node),
    }
}

/// The node of that name: by binary search when the nodes are sorted by name (as the
/// controller and the simulator list them), else by looking at each.
fn find_node(nodes: &[NodeView], name: &str) -> Option<usize> {
    match nodes.binary_search_by(|n| n.name.as_str().cmp(name)) {
        Ok(i) => Some(i),
        Err(_) => nodes.iter().position(|n| n.name == name),
    }
}

/// The chosen node and pool, if any node passed.
pub fn choice(scores: &[Score]) -> Option<&Score> {
    scores.first().filter(|s| s.filtered_out.is_none())
}

struct Eligible {
    pool: usize,
    locality: f64,
    reserve: f64,
    space: f64,
    total: f64,
    committed_after: u64,
    reserved: u64,
    /// The pool's promised bytes afterwards (every volume's size, the new one's too)
    /// per byte of its capacity: what breaks a tie. Thin volumes take no room when
    /// made, so on nodes alike every one of them ties; by name alone they all went to
    /// the first node (16 creations a second on a fleet of 1,000 nodes, every volume
    /// on one of them).
    promised: f64,
}

/// What reserves are projected from, worked out once per decision.
struct Outlook {
    /// Projected local need per byte of a node's local demand, and per byte of its
    /// capacity (the prior); both 0 when reserves are off or nothing is placed yet.
    per_demand_byte: f64,
    per_capacity_byte: f64,
}

impl Outlook {
    const NONE: Outlook = Outlook { per_demand_byte: 0.0, per_capacity_byte: 0.0 };

    /// A node's pods' share of the bytes placed so far is the best guess of their
    /// share of the pool once it is full. While little is placed that share says
    /// little, so it starts from a prior, weighing as much as a tenth of the pool's
    /// worth of placements: the local demand seen so far, spread over the nodes by
    /// capacity. In all, a node's projected local need is
    /// `C * (demand + W * (L / T) * capacity / C) / (T + W)` for a pool of capacity
    /// `C` holding `T` bytes, `L` of them asked for locally, and a prior weight `W`.
    fn of(nodes: &[NodeView], policy: &Policy) -> Outlook {
        if policy.weights.reserve == 0.0 {
            return Outlook::NONE;
        }
        let (mut capacity, mut placed, mut local_demand) = (0u64, 0u64, 0u64);
        for n in nodes.iter().filter(|n| !n.pools.is_empty()) {
            local_demand = local_demand.saturating_add(n.local_demand);
            for p in &n.pools {
                capacity = capacity.saturating_add(p.capacity);
                placed = placed.saturating_add(p.provisioned);
            }
        }
        if placed == 0 {
            return Outlook::NONE;
        }
        let (capacity, placed, local_demand) = (capacity as f64, placed as f64, local_demand as f64);
        let prior_weight = capacity / 10.0;
        Outlook {
            per_demand_byte: capacity / (placed + prior_weight),
            per_capacity_byte: prior_weight * (local_demand / placed) / (placed + prior_weight),
        }
    }

    /// The room a node keeps for its own pods' local requests: their projected need
    /// less what they hold already.
    fn reserve(&self, node: &NodeView, node_capacity: u64) -> u64 {
        let projected = node.local_demand as f64 * self.per_demand_byte + node_capacity as f64 * self.per_capacity_byte;
        (projected as u64).saturating_sub(node.local_held)
    }
}

/// Why a node was filtered out; turned into words only when explaining.
enum Filtered {
    Unhealthy,
    Excluded,
    NotIncluded,
    NoPool,
    NoRoom,
}

impl Filtered {
    fn describe(&self, node: &NodeView, req: &Request, policy: &Policy) -> String {
        match self {
            Filtered::Unhealthy => "unhealthy: it missed its heartbeats, or its engine is down".into(),
            Filtered::Excluded => "excluded by the request".into(),
            Filtered::NotIncluded => "not among the included nodes".into(),
            Filtered::NoPool => "has no pool".into(),
            Filtered::NoRoom => node
                .pools
                .iter()
                .map(|p| match fit(p, req, policy) {
                    Ok(_) => format!("pool {}: fits", p.name),
                    Err(why) => format!("pool {}: {why}", p.name),
                })
                .collect::<Vec<_>>()
                .join("; "),
        }
    }
}

fn evaluate(
    node: &NodeView,
    is_host: bool,
    req: &Request,
    policy: &Policy,
    outlook: &Outlook,
) -> Result<Eligible, Filtered> {
    if !node.healthy {
        return Err(Filtered::Unhealthy);
    }
    if req.exclude.contains(&node.name) {
        return Err(Filtered::Excluded);
    }
    if !req.include.is_empty() && !req.include.contains(&node.name) {
        return Err(Filtered::NotIncluded);
    }
    if node.pools.is_empty() {
        return Err(Filtered::NoPool);
    }
    // The fullest pool that fits, for the same reason as across nodes.
    let mut best: Option<(usize, u64)> = None;
    let (mut node_free, mut node_capacity) = (0u64, 0u64);
    for (i, p) in node.pools.iter().enumerate() {
        node_free = node_free.saturating_add(p.capacity.saturating_sub(p.committed));
        node_capacity = node_capacity.saturating_add(p.capacity);
        if let Ok(after) = fit(p, req, policy)
            && best.is_none_or(|(j, a)| ratio(after, &node.pools[i]) > ratio(a, &node.pools[j]))
        {
            best = Some((i, after));
        }
    }
    let (pool, committed_after) = best.ok_or(Filtered::NoRoom)?;
    let (locality, own_reserve) = match req.locality {
        Locality::Any => (0.0, false),
        Locality::Local => (f64::from(u8::from(is_host)), is_host),
        Locality::Remote => (f64::from(u8::from(!is_host)), false),
    };
    let reserved = if own_reserve { 0 } else { outlook.reserve(node, node_capacity) };
    let p = &node.pools[pool];
    // One division per node (they dominate a decision on a large cluster): a node with
    // one pool, the usual case, has the pool's capacity.
    let per_node_byte = 1.0 / node_capacity as f64;
    let per_pool_byte = if node.pools.len() == 1 { per_node_byte } else { 1.0 / p.capacity as f64 };
    let free_after = node_free.saturating_sub(committed_after - p.committed);
    // 1 while the node keeps its whole reserve; else less by the share of the node's
    // capacity the volume takes out of it, so that the node that loses least wins.
    let reserve = if free_after >= reserved {
        1.0
    } else {
        let taken = (reserved - free_after).min(node_free - free_after);
        (1.0 - taken as f64 * per_node_byte).max(0.0)
    };
    // How much of the pool is spoken for: taken, or kept for the node's own pods.
    let space = (committed_after.saturating_add(reserved) as f64 * per_pool_byte).min(1.0);
    let w = &policy.weights;
    Ok(Eligible {
        pool,
        locality,
        reserve,
        space,
        total: w.locality * locality + w.reserve * reserve + w.space * space,
        committed_after,
        reserved,
        promised: p.provisioned.saturating_add(req.size) as f64 * per_pool_byte,
    })
}

fn ratio(bytes: u64, p: &PoolView) -> f64 {
    bytes as f64 / p.capacity as f64
}

/// Why a pool cannot take a volume.
enum PoolReject {
    Failed(String),
    NoCapacity,
    Overcommitted { promised: u64, limit: u64, ratio: f64 },
    Full,
    TooSmall { free: u64, need: u64 },
}

impl std::fmt::Display for PoolReject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolReject::Failed(why) => write!(f, "failed ({why})"),
            PoolReject::NoCapacity => f.write_str("no capacity"),
            PoolReject::Overcommitted { promised, limit, ratio } => {
                write!(f, "thin volumes would promise {promised} of {limit} bytes allowed ({ratio}x capacity)")
            }
            PoolReject::Full => f.write_str("full"),
            PoolReject::TooSmall { free, need } => write!(f, "{free} bytes free, {need} needed"),
        }
    }
}

/// Whether the pool can take the volume; if so, the bytes it has committed afterwards.
fn fit(p: &PoolView, req: &Request, policy: &Policy) -> Result<u64, PoolReject> {
    if let Some(why) = &p.failed {
        return Err(PoolReject::Failed(why.clone()));
    }
    if p.capacity == 0 {
        return Err(PoolReject::NoCapacity);
    }
    let free = p.capacity.saturating_sub(p.committed);
    let after = if req.thin {
        let limit = (p.capacity as f64 * policy.thin_overcommit) as u64;
        let promised = p.provisioned.saturating_add(req.size);
        if promised > limit {
            return Err(PoolReject::Overcommitted { promised, limit, ratio: policy.thin_overcommit });
        }
        if free < p.cluster_size {
            return Err(PoolReject::Full);
        }
        p.committed
    } else {
        let need = thick_bytes(req.size, p.cluster_size);
        if need > free {
            return Err(PoolReject::TooSmall { free, need });
        }
        p.committed + need
    };
    Ok(after)
}

/// How many bytes of volumes would have to leave the pool for the volume to fit: 0
/// when it fits; `None` when no amount would do (the pool failed or has no capacity).
/// For a thin volume it counts provisioned bytes beyond the overcommit limit.
pub fn shortfall(p: &PoolView, req: &Request, policy: &Policy) -> Option<u64> {
    match fit(p, req, policy) {
        Ok(_) => Some(0),
        Err(PoolReject::Failed(_) | PoolReject::NoCapacity) => None,
        Err(PoolReject::TooSmall { free, need }) => Some(need - free),
        Err(PoolReject::Overcommitted { .. } | PoolReject::Full) => {
            let limit = (p.capacity as f64 * policy.thin_overcommit) as u64;
            let over = p.provisioned.saturating_add(req.size).saturating_sub(limit);
            let full = p.cluster_size.saturating_sub(p.capacity.saturating_sub(p.committed));
            Some(over.max(full))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const GIB: u64 = 1 << 30;

    fn node(name: &str, capacity: u64, committed: u64) -> NodeView {
        NodeView {
            name: name.into(),
            healthy: true,
            pools: vec![PoolView {
                name: "p".into(),
                capacity,
                committed,
                provisioned: committed,
                cluster_size: 1 << 20,
                failed: None,
            }],
            ..NodeView::default()
        }
    }

    fn req(size: u64, locality: Locality, host: &str) -> Request {
        Request { size, locality, host_node: host.into(), ..Request::default() }
    }

    /// The policy before reserves: locality, then the fullest pool.
    fn fullest() -> Policy {
        Policy { weights: Weights { locality: 10.0, reserve: 0.0, space: 1.0 }, ..Policy::default() }
    }

    #[test]
    fn without_reserves_the_fuller_node_wins_when_locality_is_equal() {
        let nodes = [node("a", 100 * GIB, 10 * GIB), node("b", 100 * GIB, 60 * GIB), node("c", 100 * GIB, 95 * GIB)];
        let scores = place(&nodes, &req(10 * GIB, Locality::Any, ""), &fullest(), 0);
        assert_eq!(choice(&scores).unwrap().node, "b", "c is too full, b is the fullest that fits");
        assert!(scores[2].filtered_out.as_deref().unwrap().contains("needed"));
    }

    #[test]
    fn locality_wins_and_falls_back_when_full() {
        let nodes = [node("a", 100 * GIB, 10 * GIB), node("b", 100 * GIB, 60 * GIB)];
        for p in [Policy::default(), fullest()] {
            assert_eq!(choice(&place(&nodes, &req(GIB, Locality::Local, "b"), &p, 0)).unwrap().node, "b");
            assert_eq!(choice(&place(&nodes, &req(GIB, Locality::Remote, "b"), &p, 0)).unwrap().node, "a");
            // The host node cannot fit it: the volume goes elsewhere rather than failing.
            assert_eq!(choice(&place(&nodes, &req(85 * GIB, Locality::Local, "b"), &p, 0)).unwrap().node, "a");
        }
    }

    #[test]
    fn other_volumes_keep_off_the_room_a_node_reserves_for_its_own_pods() {
        // Half of what is placed was asked for locally by a's pods. Blended with the
        // prior (by capacity, a quarter), a expects its pods to need 43% of the pool
        // (129.5 GiB) and keeps 89.5 GiB free beyond the 40 they hold.
        let mut a = node("a", 150 * GIB, 40 * GIB);
        (a.local_demand, a.local_held) = (40 * GIB, 40 * GIB);
        let b = node("b", 150 * GIB, 40 * GIB);
        let nodes = [a, b];
        let scores = place(&nodes, &req(10 * GIB, Locality::Any, "x"), &Policy::default(), 0);
        let by_name = |n: &str| scores.iter().find(|s| s.node == n).unwrap().clone();
        assert_eq!(choice(&scores).unwrap().node, "b");
        assert_eq!(by_name("a").reserved / (GIB / 2), 179, "{:?}", by_name("a"));
        assert_eq!(by_name("a").reserve, 1.0, "a still keeps its reserve with 10 GiB more");
        // The reserve is there for a's own pods.
        let mine = place(&nodes, &req(10 * GIB, Locality::Local, "a"), &Policy::default(), 0);
        assert_eq!((choice(&mine).unwrap().node.as_str(), choice(&mine).unwrap().reserved), ("a", 0));
        // Without reserves, the two nodes are alike and the name decides.
        assert_eq!(choice(&place(&nodes, &req(10 * GIB, Locality::Any, "x"), &fullest(), 0)).unwrap().node, "a");
    }

    #[test]
    fn when_every_node_must_give_up_reserve_the_one_that_loses_least_takes_it() {
        // Each node's pods asked for 50 GiB and expect to need about 83 GiB in all: a's
        // hold 10 and b's 50, so a keeps 73 GiB and b 33. Both have 40 GiB free.
        let mut a = node("a", 100 * GIB, 60 * GIB);
        (a.local_demand, a.local_held) = (50 * GIB, 10 * GIB);
        let mut b = node("b", 100 * GIB, 60 * GIB);
        (b.local_demand, b.local_held) = (50 * GIB, 50 * GIB);
        let scores = place(&[a, b], &req(30 * GIB, Locality::Any, "x"), &Policy::default(), 0);
        assert!(scores.iter().all(|s| s.reserve < 1.0), "{scores:?}");
        // In a the volume takes 30 GiB of the reserve, in b only the 23 beyond 10 free.
        assert_eq!(choice(&scores).unwrap().node, "b", "{scores:?}");
    }

    #[test]
    fn thin_volumes_respect_the_overcommit_limit() {
        let nodes = [node("a", 10 * GIB, 0)];
        let p = Policy { thin_overcommit: 2.0, ..Policy::default() };
        let mut r = req(20 * GIB, Locality::Any, "");
        r.thin = true;
        assert!(choice(&place(&nodes, &r, &p, 0)).is_some());
        r.size += 1;
        assert!(choice(&place(&nodes, &r, &p, 0)).is_none());
    }

    #[test]
    fn thin_volumes_spread_over_nodes_alike_by_what_each_has_promised() {
        let mut nodes = [node("a", 100 * GIB, 0), node("b", 100 * GIB, 0), node("c", 100 * GIB, 0)];
        let mut r = req(10 * GIB, Locality::Any, "");
        r.thin = true;
        let mut placed = BTreeMap::new();
        for _ in 0..9 {
            let (n, p) = choose(&nodes, &r, &Policy::default()).unwrap();
            let explained = place(&nodes, &r, &Policy::default(), 0);
            assert_eq!(choice(&explained).unwrap().node, nodes[n].name, "both paths agree");
            nodes[n].pools[p].provisioned += r.size;
            *placed.entry(nodes[n].name.clone()).or_insert(0) += 1;
        }
        assert_eq!(placed, BTreeMap::from([("a".into(), 3), ("b".into(), 3), ("c".into(), 3)]));
    }

    #[test]
    fn picks_the_fullest_fitting_pool_within_a_node() {
        let mut n = node("a", 100 * GIB, 50 * GIB);
        n.pools.push(PoolView { name: "q".into(), committed: 80 * GIB, ..n.pools[0].clone() });
        n.pools.push(PoolView { name: "r".into(), committed: 99 * GIB, ..n.pools[0].clone() });
        let s = place(&[n], &req(10 * GIB, Locality::Any, ""), &Policy::default(), 0);
        assert_eq!(s[0].pool, "q");
        assert!((s[0].used_ratio_after - 0.9).abs() < 1e-9);
    }

    /// A small random cluster: some nodes unhealthy, some pools failed or full, local
    /// demand all over, and a request that may include and exclude nodes.
    fn cluster_and_request() -> impl Strategy<Value = (Vec<NodeView>, Request, Policy)> {
        let pool = (1u64..100, 0u64..110, 0u64..3, proptest::bool::weighted(0.1));
        let node = (proptest::collection::vec(pool, 0..4), proptest::bool::weighted(0.8), 0u64..120, 0u64..100);
        (
            proptest::collection::vec(node, 1..14),
            (1u64..60, proptest::bool::ANY, 0u8..3, 0usize..14),
            (proptest::collection::vec(0usize..14, 0..4), proptest::collection::vec(0usize..14, 0..3)),
            (0.0f64..20.0, -3.0f64..3.0, -2.0f64..2.0),
        )
            .prop_map(|(nodes, (size, thin, locality, host), (include, exclude), (lw, rw, sw))| {
                let nodes: Vec<NodeView> = nodes
                    .into_iter()
                    .enumerate()
                    .map(|(i, (pools, healthy, demand, held))| NodeView {
                        name: format!("n{i}"),
                        healthy,
                        pools: pools
                            .into_iter()
                            .enumerate()
                            .map(|(k, (cap, used, thin_share, failed))| PoolView {
                                name: format!("p{k}"),
                                capacity: cap * GIB,
                                committed: used.min(cap) * GIB,
                                provisioned: used * GIB * (1 + thin_share),
                                cluster_size: 1 << 20,
                                failed: failed.then(|| "disk gone".into()),
                            })
                            .collect(),
                        local_demand: demand * GIB,
                        local_held: held.min(demand) * GIB,
                    })
                    .collect();
                let name = |i: &usize| format!("n{i}");
                let req = Request {
                    size: size * GIB,
                    thin,
                    locality: [Locality::Any, Locality::Local, Locality::Remote][locality as usize],
                    host_node: format!("n{host}"),
                    include: include.iter().map(name).collect(),
                    exclude: exclude.iter().map(name).collect(),
                };
                (nodes, req, Policy { weights: Weights { locality: lw, reserve: rw, space: sw }, thin_overcommit: 2.0 })
            })
    }

    /// Whether a pool can take the request, from first principles.
    fn has_room(p: &PoolView, r: &Request, policy: &Policy) -> bool {
        let free = p.capacity.saturating_sub(p.committed);
        p.failed.is_none()
            && p.capacity > 0
            && if r.thin {
                p.provisioned + r.size <= (p.capacity as f64 * policy.thin_overcommit) as u64 && free >= p.cluster_size
            } else {
                thick_bytes(r.size, p.cluster_size) <= free
            }
    }

    proptest! {
        /// Under any weights: the choice is healthy, allowed by the request and has
        /// room; there is a choice whenever some node qualifies; the same input gives
        /// the same choice; and the explained path agrees with the fast one.
        #[test]
        fn the_choice_is_always_allowed_and_has_room((nodes, req, policy) in cluster_and_request(), limit in 0usize..16) {
            let allowed = |n: &NodeView| n.healthy
                && !req.exclude.contains(&n.name)
                && (req.include.is_empty() || req.include.contains(&n.name));
            let qualifies = nodes.iter().any(|n| allowed(n) && n.pools.iter().any(|p| has_room(p, &req, &policy)));
            let fast = choose(&nodes, &req, &policy);
            prop_assert_eq!(fast.is_some(), qualifies);
            if let Some((n, p)) = fast {
                prop_assert!(allowed(&nodes[n]), "{:?} is not allowed", nodes[n].name);
                prop_assert!(has_room(&nodes[n].pools[p], &req, &policy));
            }
            prop_assert_eq!(fast, choose(&nodes, &req, &policy), "deterministic");
            let explained = place(&nodes, &req, &policy, limit);
            let names = fast.map(|(n, p)| (nodes[n].name.clone(), nodes[n].pools[p].name.clone()));
            prop_assert_eq!(choice(&explained).map(|s| (s.node.clone(), s.pool.clone())), names);
            for s in &explained {
                prop_assert!((0.0..=1.0).contains(&s.reserve) && (0.0..=1.0).contains(&s.space), "{:?}", s);
            }
        }
    }
}

//! Volume placement, in LightPool's two phases. *Filter* drops the nodes that cannot or
//! must not take the volume. *Score* ranks the rest by locality preference and by how
//! full the pool would be afterwards: the fuller pool wins, so that large holes stay
//! free for large volumes. Pure code: the controller and the simulator both call it.

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

/// How much each score counts. Both scores lie in [0, 1].
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Weights {
    pub locality: f64,
    pub space: f64,
}

impl Default for Weights {
    /// Locality outweighs fullness: a volume goes to its preferred place whenever that
    /// place fits it, and fullness decides among equally preferred places.
    fn default() -> Weights {
        Weights { locality: 10.0, space: 1.0 }
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
#[derive(Clone, Debug)]
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
#[derive(Clone, Debug)]
pub struct NodeView {
    pub name: String,
    pub healthy: bool,
    pub pools: Vec<PoolView>,
}

/// What is to be placed.
#[derive(Clone, Debug, Default)]
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
    pub space: f64,
    pub total: f64,
    pub used_ratio_after: f64,
}

/// Bytes a volume of `size` takes from a pool when thick: whole clusters.
pub fn thick_bytes(size: u64, cluster_size: u64) -> u64 {
    size.div_ceil(cluster_size.max(1)) * cluster_size.max(1)
}

/// Filters and scores every node and explains the best `limit` of them, best first
/// (eligible nodes by score, then filtered ones by name). The first is the choice when
/// it passed the filter. This is what the controller shows; [`choose`] makes the same
/// choice without explaining.
pub fn place(nodes: &[NodeView], req: &Request, policy: &Policy, limit: usize) -> Vec<Score> {
    let mut evaluated: Vec<(usize, Result<Eligible, Filtered>)> =
        nodes.iter().enumerate().map(|(i, n)| (i, evaluate(n, req, policy))).collect();
    let order = |a: &(usize, Result<Eligible, Filtered>), b: &(usize, Result<Eligible, Filtered>)| {
        let by_name = || nodes[a.0].name.cmp(&nodes[b.0].name);
        match (&a.1, &b.1) {
            (Ok(x), Ok(y)) => y.total.total_cmp(&x.total).then_with(by_name),
            (Ok(_), Err(_)) => std::cmp::Ordering::Less,
            (Err(_), Ok(_)) => std::cmp::Ordering::Greater,
            (Err(_), Err(_)) => by_name(),
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
                    space: e.space,
                    total: e.total,
                    used_ratio_after: e.space,
                },
                Err(why) => Score {
                    node: n.name.clone(),
                    pool: String::new(),
                    filtered_out: Some(why.describe(n, req, policy)),
                    locality: 0.0,
                    space: 0.0,
                    total: 0.0,
                    used_ratio_after: 0.0,
                },
            }
        })
        .collect()
}

/// The chosen node and pool (indexes into `nodes`), without allocating: what the
/// simulator and the benchmark run. Same choice as `place`.
pub fn choose(nodes: &[NodeView], req: &Request, policy: &Policy) -> Option<(usize, usize)> {
    let mut best: Option<(usize, Eligible)> = None;
    for (i, n) in nodes.iter().enumerate() {
        if let Ok(e) = evaluate(n, req, policy) {
            let better = match &best {
                None => true,
                Some((j, b)) => e.total > b.total || (e.total == b.total && n.name < nodes[*j].name),
            };
            if better {
                best = Some((i, e));
            }
        }
    }
    best.map(|(i, e)| (i, e.pool))
}

/// The chosen node and pool, if any node passed.
pub fn choice(scores: &[Score]) -> Option<&Score> {
    scores.first().filter(|s| s.filtered_out.is_none())
}

struct Eligible {
    pool: usize,
    locality: f64,
    space: f64,
    total: f64,
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

fn evaluate(node: &NodeView, req: &Request, policy: &Policy) -> Result<Eligible, Filtered> {
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
    let mut best: Option<(usize, f64)> = None;
    for (i, p) in node.pools.iter().enumerate() {
        if let Ok(ratio) = fit(p, req, policy)
            && best.is_none_or(|(_, r)| ratio > r)
        {
            best = Some((i, ratio));
        }
    }
    let (pool, used_ratio_after) = best.ok_or(Filtered::NoRoom)?;
    let locality = match req.locality {
        Locality::Any => 0.0,
        Locality::Local => f64::from(u8::from(node.name == req.host_node)),
        Locality::Remote => f64::from(u8::from(node.name != req.host_node)),
    };
    let space = used_ratio_after;
    Ok(Eligible { pool, locality, space, total: policy.weights.locality * locality + policy.weights.space * space })
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

/// Whether the pool can take the volume; if so, the share of it used afterwards.
fn fit(p: &PoolView, req: &Request, policy: &Policy) -> Result<f64, PoolReject> {
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
    Ok(after as f64 / p.capacity as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }
    }

    fn req(size: u64, locality: Locality, host: &str) -> Request {
        Request { size, locality, host_node: host.into(), ..Request::default() }
    }

    #[test]
    fn prefers_the_fuller_node_when_locality_is_equal() {
        let nodes = [node("a", 100 * GIB, 10 * GIB), node("b", 100 * GIB, 60 * GIB), node("c", 100 * GIB, 95 * GIB)];
        let scores = place(&nodes, &req(10 * GIB, Locality::Any, ""), &Policy::default(), 0);
        assert_eq!(choice(&scores).unwrap().node, "b", "c is too full, b is the fullest that fits");
        assert!(scores[2].filtered_out.as_deref().unwrap().contains("needed"));
    }

    #[test]
    fn locality_wins_over_fullness_and_falls_back_when_full() {
        let nodes = [node("a", 100 * GIB, 10 * GIB), node("b", 100 * GIB, 60 * GIB)];
        let p = Policy::default();
        assert_eq!(choice(&place(&nodes, &req(GIB, Locality::Local, "a"), &p, 0)).unwrap().node, "a");
        assert_eq!(choice(&place(&nodes, &req(GIB, Locality::Remote, "b"), &p, 0)).unwrap().node, "a");
        // The host node cannot fit it: the volume goes elsewhere rather than failing.
        assert_eq!(choice(&place(&nodes, &req(85 * GIB, Locality::Local, "b"), &p, 0)).unwrap().node, "a");
    }

    #[test]
    fn filters_unhealthy_excluded_and_not_included_nodes() {
        let mut nodes = vec![node("a", 100 * GIB, 0), node("b", 100 * GIB, 0), node("c", 100 * GIB, 0)];
        nodes[0].healthy = false;
        let mut r = req(GIB, Locality::Any, "");
        r.exclude = vec!["b".into()];
        let scores = place(&nodes, &r, &Policy::default(), 0);
        assert_eq!(choice(&scores).unwrap().node, "c");
        r.include = vec!["a".into(), "b".into()];
        assert!(choice(&place(&nodes, &r, &Policy::default(), 0)).is_none());
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
    fn picks_the_fullest_fitting_pool_within_a_node() {
        let mut n = node("a", 100 * GIB, 50 * GIB);
        n.pools.push(PoolView { name: "q".into(), committed: 80 * GIB, ..n.pools[0].clone() });
        n.pools.push(PoolView { name: "r".into(), committed: 99 * GIB, ..n.pools[0].clone() });
        let s = place(&[n], &req(10 * GIB, Locality::Any, ""), &Policy::default(), 0);
        assert_eq!(s[0].pool, "q");
        assert!((s[0].used_ratio_after - 0.9).abs() < 1e-9);
    }

    proptest::proptest! {
        /// The fast path and the explained path always make the same choice.
        #[test]
        fn choose_agrees_with_place(
            pools in proptest::collection::vec((0u64..4, 1u64..100, 0u64..100, proptest::bool::ANY), 1..12),
            size in 1u64..60,
            thin in proptest::bool::ANY,
            locality in 0u8..3,
            host in 0usize..12,
            space_weight in -2.0f64..2.0,
            limit in 0usize..14,
        ) {
            let nodes: Vec<NodeView> = pools
                .iter()
                .enumerate()
                .map(|(i, &(n, cap, used, healthy))| NodeView {
                    name: format!("n{i}"),
                    healthy,
                    pools: (0..n)
                        .map(|k| PoolView {
                            name: format!("p{k}"),
                            capacity: cap * GIB,
                            committed: (used.min(cap) * GIB) / (k + 1),
                            provisioned: used * GIB,
                            cluster_size: 1 << 20,
                            failed: None,
                        })
                        .collect(),
                })
                .collect();
            let locality = [Locality::Any, Locality::Local, Locality::Remote][locality as usize];
            let req = Request { size: size * GIB, thin, locality, host_node: format!("n{host}"), ..Request::default() };
            let policy = Policy { weights: Weights { locality: 10.0, space: space_weight }, thin_overcommit: 2.0 };
            let explained = place(&nodes, &req, &policy, limit);
            let fast = choose(&nodes, &req, &policy).map(|(n, p)| (nodes[n].name.clone(), nodes[n].pools[p].name.clone()));
            proptest::prop_assert_eq!(choice(&explained).map(|s| (s.node.clone(), s.pool.clone())), fast);
        }
    }
}

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

/// Filters and scores every node. Returns the scores best first; the first one is the
/// choice when it passed the filter.
pub fn place(nodes: &[NodeView], req: &Request, policy: &Policy) -> Vec<Score> {
    let mut scores: Vec<Score> = nodes.iter().map(|n| score_node(n, req, policy)).collect();
    scores.sort_by(|a, b| {
        let passed = |s: &Score| s.filtered_out.is_none();
        passed(b).cmp(&passed(a)).then(b.total.total_cmp(&a.total)).then_with(|| a.node.cmp(&b.node))
    });
    scores
}

/// The chosen node and pool, if any node passed.
pub fn choice(scores: &[Score]) -> Option<&Score> {
    scores.first().filter(|s| s.filtered_out.is_none())
}

fn score_node(node: &NodeView, req: &Request, policy: &Policy) -> Score {
    let out = |why: String| Score {
        node: node.name.clone(),
        pool: String::new(),
        filtered_out: Some(why),
        locality: 0.0,
        space: 0.0,
        total: 0.0,
        used_ratio_after: 0.0,
    };
    if !node.healthy {
        return out("unhealthy: it missed its heartbeats".into());
    }
    if req.exclude.contains(&node.name) {
        return out("excluded by the request".into());
    }
    if !req.include.is_empty() && !req.include.contains(&node.name) {
        return out("not among the included nodes".into());
    }
    if node.pools.is_empty() {
        return out("has no pool".into());
    }
    // The fullest pool that fits, for the same reason as across nodes.
    let mut best: Option<(&PoolView, f64)> = None;
    let mut reasons = Vec::new();
    for p in &node.pools {
        match fit(p, req, policy) {
            Ok(ratio) => {
                if best.is_none_or(|(_, r)| ratio > r) {
                    best = Some((p, ratio));
                }
            }
            Err(why) => reasons.push(format!("pool {}: {why}", p.name)),
        }
    }
    let Some((pool, used_ratio_after)) = best else {
        return out(reasons.join("; "));
    };
    let locality = match req.locality {
        Locality::Any => 0.0,
        Locality::Local => f64::from(u8::from(node.name == req.host_node)),
        Locality::Remote => f64::from(u8::from(node.name != req.host_node)),
    };
    let space = used_ratio_after;
    Score {
        node: node.name.clone(),
        pool: pool.name.clone(),
        filtered_out: None,
        locality,
        space,
        total: policy.weights.locality * locality + policy.weights.space * space,
        used_ratio_after,
    }
}

/// Whether the pool can take the volume; if so, the share of it used afterwards.
fn fit(p: &PoolView, req: &Request, policy: &Policy) -> Result<f64, String> {
    if let Some(why) = &p.failed {
        return Err(format!("failed ({why})"));
    }
    if p.capacity == 0 {
        return Err("no capacity".into());
    }
    let free = p.capacity.saturating_sub(p.committed);
    let after = if req.thin {
        let limit = (p.capacity as f64 * policy.thin_overcommit) as u64;
        if p.provisioned.saturating_add(req.size) > limit {
            return Err(format!(
                "thin volumes would promise {} of {} allowed ({}x capacity)",
                p.provisioned.saturating_add(req.size),
                limit,
                policy.thin_overcommit
            ));
        }
        if free < p.cluster_size {
            return Err("full".into());
        }
        p.committed
    } else {
        let need = thick_bytes(req.size, p.cluster_size);
        if need > free {
            return Err(format!("{free} bytes free, {need} needed"));
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
        let scores = place(&nodes, &req(10 * GIB, Locality::Any, ""), &Policy::default());
        assert_eq!(choice(&scores).unwrap().node, "b", "c is too full, b is the fullest that fits");
        assert!(scores[2].filtered_out.as_deref().unwrap().contains("needed"));
    }

    #[test]
    fn locality_wins_over_fullness_and_falls_back_when_full() {
        let nodes = [node("a", 100 * GIB, 10 * GIB), node("b", 100 * GIB, 60 * GIB)];
        let p = Policy::default();
        assert_eq!(choice(&place(&nodes, &req(GIB, Locality::Local, "a"), &p)).unwrap().node, "a");
        assert_eq!(choice(&place(&nodes, &req(GIB, Locality::Remote, "b"), &p)).unwrap().node, "a");
        // The host node cannot fit it: the volume goes elsewhere rather than failing.
        assert_eq!(choice(&place(&nodes, &req(85 * GIB, Locality::Local, "b"), &p)).unwrap().node, "a");
    }

    #[test]
    fn filters_unhealthy_excluded_and_not_included_nodes() {
        let mut nodes = vec![node("a", 100 * GIB, 0), node("b", 100 * GIB, 0), node("c", 100 * GIB, 0)];
        nodes[0].healthy = false;
        let mut r = req(GIB, Locality::Any, "");
        r.exclude = vec!["b".into()];
        let scores = place(&nodes, &r, &Policy::default());
        assert_eq!(choice(&scores).unwrap().node, "c");
        r.include = vec!["a".into(), "b".into()];
        assert!(choice(&place(&nodes, &r, &Policy::default())).is_none());
    }

    #[test]
    fn thin_volumes_respect_the_overcommit_limit() {
        let nodes = [node("a", 10 * GIB, 0)];
        let p = Policy { thin_overcommit: 2.0, ..Policy::default() };
        let mut r = req(20 * GIB, Locality::Any, "");
        r.thin = true;
        assert!(choice(&place(&nodes, &r, &p)).is_some());
        r.size += 1;
        assert!(choice(&place(&nodes, &r, &p)).is_none());
    }

    #[test]
    fn picks_the_fullest_fitting_pool_within_a_node() {
        let mut n = node("a", 100 * GIB, 50 * GIB);
        n.pools.push(PoolView { name: "q".into(), committed: 80 * GIB, ..n.pools[0].clone() });
        n.pools.push(PoolView { name: "r".into(), committed: 99 * GIB, ..n.pools[0].clone() });
        let s = place(&[n], &req(10 * GIB, Locality::Any, ""), &Policy::default());
        assert_eq!(s[0].pool, "q");
        assert!((s[0].used_ratio_after - 0.9).abs() < 1e-9);
    }
}

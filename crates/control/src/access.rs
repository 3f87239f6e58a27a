//! Access points: the engines a host reaches a volume through. Each attachment (host,
//! volume) gets one optimized access point and up to two non-optimized ones; the
//! owner serves the data itself and the others forward to it (`remote:` namespaces).
//! The host's native multipath uses the optimized path and fails over to the others
//! when ANA says so.
//!
//! This module is pure: the controller hands it the nodes and the attachments it
//! knows, and gets back the paths and why each node was or was not chosen.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// How a host's optimized access point is picked.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum AccessPolicy {
    /// One optimized access point per host and volume group: the owner of the
    /// first volume the host attached. Without a group, the volume's owner.
    #[default]
    Inherit,
    /// The volumes of a group get different optimized access points where the
    /// nodes allow it, and the optimized load stays even across nodes.
    Balance,
}

impl AccessPolicy {
    pub fn name(self) -> &'static str {
        match self {
            AccessPolicy::Inherit => "inherit",
            AccessPolicy::Balance => "balance",
        }
    }

    pub fn parse(s: &str) -> Result<AccessPolicy, String> {
        match s {
            "inherit" => Ok(AccessPolicy::Inherit),
            "balance" => Ok(AccessPolicy::Balance),
            _ => Err(format!("access policy {s:?} does not exist: use inherit or balance")),
        }
    }
}

impl std::fmt::Display for AccessPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One optimized and two non-optimized access points at most.
pub const MAX_PATHS: usize = 3;

/// Controller IDs are split in this many blocks; a node gets one. The kernel host
/// refuses a second path whose controller ID it already sees in the subsystem, so
/// the paths of one attachment are always on nodes with different blocks.
pub const CNTLID_BLOCKS: u16 = 16;
/// The least loaded nodes looked at first for the paths after the optimized one:
/// enough that the paths nearly always come from them (a node is passed over only
/// for sharing a chosen node's controller IDs).
const FIRST_LOOKED_AT: usize = 64;
const CNTLID_BLOCK_SIZE: u16 = 4094;

/// The controller IDs of a block: 16 blocks of 4,094 IDs within 1..=65504.
pub fn cntlid_range(block: u16) -> (u16, u16) {
    let block = block % CNTLID_BLOCKS;
    (1 + block * CNTLID_BLOCK_SIZE, (block + 1) * CNTLID_BLOCK_SIZE)
}

/// A node as the chooser sees it.
#[derive(Clone, Debug)]
pub struct Candidate<'a> {
    pub name: &'a str,
    /// Heartbeats arrive and the agent reaches its engine.
    pub healthy: bool,
    /// The volume's placement excludes the node.
    pub excluded: bool,
    pub cntlid_block: u16,
}

/// An attachment: the group of its volume, its host, and its paths.
#[derive(Clone, Debug)]
pub struct Attached<'a> {
    pub group: &'a str,
    pub host: &'a str,
    /// Its access points, the optimized one first.
    pub paths: &'a [String],
}

/// The attachment to choose paths for.
#[derive(Clone, Debug)]
pub struct AccessRequest<'a> {
    pub volume: &'a str,
    pub owner: &'a str,
    /// The nodes holding the volume's other replicas: after the owner, they come
    /// first, so that when the owner is lost the host already has a path to the node
    /// that takes over (an ANA change, not a new connection).
    pub replicas: &'a [String],
    pub host: &'a str,
    pub policy: AccessPolicy,
    pub group: &'a str,
    /// The attachment's paths now (empty for a new one). Those on usable nodes are
    /// kept, and a usable optimized one stays optimized, so that a re-choice moves
    /// only what it must.
    pub current: &'a [String],
    /// The operator's choice of optimized access point, which the caller checked
    /// is usable; it overrides the policy.
    pub optimized: Option<&'a str>,
    /// This attachment's own paths as the loads count them (empty when it is new):
    /// they are left out of the load the choice weighs.
    pub counted: &'a [String],
    /// Say why each node was or was not chosen: a line per node, which in a pool of
    /// 10,000 nodes costs more than the choice.
    pub explain: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The access points, the optimized one first.
    pub paths: Vec<String>,
    /// One line per node: why it was or was not chosen (when the request asks).
    pub explain: Vec<String>,
}

/// What the attachments put on each node, kept up to date as they come and go
/// (`add`, `remove`), so that a choice costs the nodes, not every attachment of the
/// cluster.
#[derive(Default, Clone, Debug, PartialEq)]
pub struct PathLoads {
    /// Paths of any state, and optimized paths, per node.
    nodes: HashMap<String, (usize, usize)>,
    /// Optimized paths per host and named group, per node.
    groups: HashMap<(String, String), HashMap<String, usize>>,
}

impl PathLoads {
    pub fn add(&mut self, a: &Attached<'_>) {
        for (i, node) in a.paths.iter().enumerate() {
            let (paths, optimized) = self.nodes.entry(node.clone()).or_default();
            *paths += 1;
            if i == 0 {
                *optimized += 1;
                if !a.group.is_empty() {
                    let group = self.groups.entry((a.host.to_string(), a.group.to_string())).or_default();
                    *group.entry(node.clone()).or_default() += 1;
                }
            }
        }
    }

    pub fn remove(&mut self, a: &Attached<'_>) {
        for (i, node) in a.paths.iter().enumerate() {
            if let Some((paths, optimized)) = self.nodes.get_mut(node.as_str()) {
                *paths -= 1;
                *optimized -= usize::from(i == 0);
                if *paths == 0 {
                    self.nodes.remove(node.as_str());
                }
            }
            if i == 0 && !a.group.is_empty() {
                let key = (a.host.to_string(), a.group.to_string());
                if let Some(group) = self.groups.get_mut(&key) {
                    if let Some(count) = group.get_mut(node.as_str()) {
                        *count -= 1;
                        if *count == 0 {
                            group.remove(node.as_str());
                        }
                    }
                    if group.is_empty() {
                        self.groups.remove(&key);
                    }
                }
            }
        }
    }

    /// The optimized paths per node of the host and group `req` chooses for, if its
    /// group is named.
    fn group_of(&self, req: &AccessRequest<'_>) -> Option<&HashMap<String, usize>> {
        if req.group.is_empty() {
            return None;
        }
        self.groups.get(&(req.host.to_string(), req.group.to_string()))
    }

    /// What the attachments other than the one `req` chooses for put on `node`;
    /// `group` is `group_of(req)`, looked up once per choice.
    fn of(&self, node: &str, group: Option<&HashMap<String, usize>>, req: &AccessRequest<'_>) -> Load {
        let (paths, optimized) = self.nodes.get(node).copied().unwrap_or_default();
        let group_optimized = group.and_then(|g| g.get(node)).copied().unwrap_or(0);
        let own = req.counted.iter().position(|p| p == node);
        let own_optimized = usize::from(own == Some(0));
        Load {
            paths: paths - usize::from(own.is_some()),
            optimized: optimized - own_optimized,
            group_optimized: group_optimized - if req.group.is_empty() { 0 } else { own_optimized },
        }
    }
}

/// What the other attachments put on a node.
#[derive(Default, Clone, Copy)]
struct Load {
    /// Paths of any state.
    paths: usize,
    /// Optimized paths.
    optimized: usize,
    /// Optimized paths of this host to other volumes of this group.
    group_optimized: usize,
}

/// Chooses the access points of one attachment. Fails only when no node can serve.
pub fn choose(nodes: &[Candidate<'_>], loads: &PathLoads, req: &AccessRequest<'_>) -> Result<Choice, String> {
    let group = loads.group_of(req);
    // Each node's load, and which node owns the volume, found once: the choice looks
    // at every node more than once, and a pool may have 10,000. Nodes go by their
    // place in `nodes` from here on.
    let load: Vec<Load> = nodes.iter().map(|n| loads.of(n.name, group, req)).collect();
    let owner = nodes.iter().position(|n| n.name == req.owner);
    let is_owner = |i: usize| Some(i) == owner;
    let usable = |i: usize| nodes[i].healthy && !nodes[i].excluded;
    let index = |name: &str| nodes.iter().position(|n| n.name == name);
    let kept: Vec<usize> = req.current.iter().filter_map(|p| index(p)).filter(|&i| usable(i)).collect();

    let keep_optimized = req.optimized.or(req.current.first().map(String::as_str));
    let optimized = match keep_optimized.and_then(index).filter(|&i| usable(i)) {
        Some(i) => i,
        None => {
            // A lost optimized path moves to a surviving access point, which the host
            // is connected to already; a new attachment may use any usable node.
            let pool: Vec<usize> =
                if kept.is_empty() { (0..nodes.len()).filter(|&i| usable(i)).collect() } else { kept.clone() };
            let best = match req.policy {
                AccessPolicy::Inherit => pool
                    .iter()
                    .copied()
                    .filter(|&i| load[i].group_optimized > 0)
                    .max_by_key(|&i| (load[i].group_optimized, std::cmp::Reverse(nodes[i].name)))
                    .or_else(|| pool.iter().copied().find(|&i| is_owner(i)))
                    .or_else(|| {
                        pool.iter().copied().min_by_key(|&i| (load[i].optimized, load[i].paths, nodes[i].name))
                    }),
                AccessPolicy::Balance => pool.iter().copied().min_by_key(|&i| {
                    let l = load[i];
                    (l.group_optimized, l.optimized, !is_owner(i), l.paths, nodes[i].name)
                }),
            };
            match best {
                Some(i) => i,
                None => {
                    return Err(format!(
                        "no node can be an access point of volume {} for {}: every node is down or excluded",
                        req.volume, req.host
                    ));
                }
            }
        }
    };

    let mut chosen: Vec<usize> = vec![optimized];
    let block = |i: usize| nodes[i].cntlid_block % CNTLID_BLOCKS;
    let fits = |chosen: &[usize], i: usize| usable(i) && chosen.iter().all(|&c| c != i && block(c) != block(i));
    // Surviving paths first, then the owner (no forwarding hop), then the replicas'
    // nodes, then the least loaded.
    // Only the first few in that order are ever taken: they are found without sorting
    // every node (each key once), and the rest is sorted only if none of them fit.
    let is_replica = |i: usize| req.replicas.iter().any(|r| r == nodes[i].name);
    // (not the owner, not a replica's node, paths it has, name): lower goes first.
    type Order<'n> = (bool, bool, usize, &'n str);
    let mut others: Vec<(Order, usize)> = (0..nodes.len())
        .filter(|&i| usable(i))
        .map(|i| ((!is_owner(i), !is_replica(i), load[i].paths, nodes[i].name), i))
        .collect();
    let first = others.len().min(FIRST_LOOKED_AT);
    if first < others.len() {
        others.select_nth_unstable_by_key(first, |o| o.0);
    }
    let (ahead, rest) = others.split_at_mut(first);
    ahead.sort_unstable_by_key(|o| o.0);
    for i in kept.iter().copied().chain(ahead.iter().map(|&(_, i)| i)) {
        if chosen.len() < MAX_PATHS && fits(&chosen, i) {
            chosen.push(i);
        }
    }
    if chosen.len() < MAX_PATHS {
        rest.sort_unstable_by_key(|o| o.0);
        for &(_, i) in rest.iter() {
            if chosen.len() < MAX_PATHS && fits(&chosen, i) {
                chosen.push(i);
            }
        }
    }

    let paths = chosen.iter().map(|&i| nodes[i].name.to_string()).collect();
    if !req.explain {
        return Ok(Choice { paths, explain: Vec::new() });
    }
    let explain = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let l = load[i];
            let role = if is_owner(i) { "owner" } else { "forwards to the owner" };
            let why = match chosen.iter().position(|&c| c == i) {
                Some(0) => format!("optimized ({role}; {})", why_optimized(req, n, l, kept.contains(&i))),
                Some(_) => format!("non-optimized ({role}; {} other paths here)", l.paths),
                None if !n.healthy => "not chosen: unhealthy".to_string(),
                None if n.excluded => "not chosen: excluded by the volume's placement".to_string(),
                None if chosen.len() == MAX_PATHS => {
                    format!("not chosen: {MAX_PATHS} paths are enough ({} other paths here)", l.paths)
                }
                None => "not chosen: its controller IDs are those of a chosen node".to_string(),
            };
            format!("{}: {why}", n.name)
        })
        .collect();
    Ok(Choice { paths, explain })
}

fn why_optimized(req: &AccessRequest<'_>, n: &Candidate<'_>, l: Load, kept: bool) -> String {
    if req.optimized == Some(n.name) {
        return "chosen by the operator".into();
    }
    if req.current.first().is_some_and(|p| *p == n.name) {
        return "it was optimized already".into();
    }
    let moved = if req.current.is_empty() { "" } else { "the optimized path was lost; " };
    let surviving = if kept { "a surviving path, " } else { "" };
    match req.policy {
        AccessPolicy::Inherit if l.group_optimized > 0 => {
            format!("{moved}{surviving}inherit: the host's optimized access point for group {}", req.group)
        }
        AccessPolicy::Inherit => format!("{moved}{surviving}inherit: the owner, or the least loaded node"),
        AccessPolicy::Balance => format!(
            "{moved}{surviving}balance: {} of the group's and {} optimized paths of all hosts here",
            l.group_optimized, l.optimized
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashSet};

    /// Node `i`'s name, for the life of the test process (a candidate borrows it).
    fn name(i: usize) -> &'static str {
        Box::leak(format!("n{i}").into_boxed_str())
    }

    fn nodes(n: usize) -> Vec<Candidate<'static>> {
        (0..n).map(|i| Candidate { name: name(i), healthy: true, excluded: false, cntlid_block: i as u16 }).collect()
    }

    /// A request for host h on volume v, owned by n0, without a group.
    fn request<'a>(policy: AccessPolicy, current: &'a [String], optimized: Option<&'a str>) -> AccessRequest<'a> {
        AccessRequest {
            volume: "v",
            owner: "n0",
            replicas: &[],
            host: "h",
            policy,
            group: "",
            current,
            optimized,
            counted: &[],
            explain: true,
        }
    }

    /// Attachments as (volume, group, host) → paths.
    type Book = BTreeMap<(String, String, String), Vec<String>>;

    fn loads(book: &Book) -> PathLoads {
        let mut loads = PathLoads::default();
        for ((_, group, host), paths) in book {
            loads.add(&Attached { group, host, paths });
        }
        loads
    }

    fn attach(
        nodes: &[Candidate<'_>],
        book: &mut Book,
        volume: &str,
        owner: &str,
        group: &str,
        host: &str,
        policy: AccessPolicy,
    ) -> Vec<String> {
        let req = AccessRequest {
            volume,
            owner,
            replicas: &[],
            host,
            policy,
            group,
            current: &[],
            optimized: None,
            counted: &[],
            explain: true,
        };
        let choice = choose(nodes, &loads(book), &req).unwrap();
        assert_eq!(choice.explain.len(), nodes.len());
        book.insert((volume.into(), group.into(), host.into()), choice.paths.clone());
        choice.paths
    }

    #[test]
    fn the_owner_is_optimized_by_default_and_two_others_follow() {
        let n = nodes(4);
        let mut book = Book::new();
        let p = attach(&n, &mut book, "v", "n2", "", "h", AccessPolicy::Inherit);
        assert_eq!(p[0], "n2");
        assert_eq!(p.len(), 3);
        let q = attach(&n, &mut book, "w", "n2", "", "h", AccessPolicy::Inherit);
        assert_eq!(q[0], "n2");
        // The second volume's non-optimized paths avoid the nodes the first one loaded.
        assert!(!q[1..].iter().all(|x| p[1..].contains(x)));
    }

    #[test]
    fn balance_keeps_the_optimized_load_even_across_hosts() {
        let n = nodes(4);
        let mut book = Book::new();
        for i in 0..10 {
            // Every volume on n0, each attached by its own host: only the load decides.
            attach(&n, &mut book, &format!("v{i}"), "n0", "", &format!("h{i}"), AccessPolicy::Balance);
        }
        let mut optimized = BTreeMap::<String, usize>::new();
        for p in book.values() {
            *optimized.entry(p[0].clone()).or_default() += 1;
        }
        let (least, most) = (optimized.values().min().unwrap(), optimized.values().max().unwrap());
        assert!(optimized.len() == 4 && most - least <= 1, "{optimized:?}");
    }

    #[test]
    fn paths_come_from_past_the_least_loaded_when_those_share_the_optimized_nodes_ids() {
        // n0 owns the volume; the 99 others are idle, but all except the last two
        // share n0's controller IDs, so the paths must come from past the first looked at.
        let mut n = nodes(100);
        for c in n.iter_mut() {
            c.cntlid_block = 0;
        }
        n[98].cntlid_block = 1;
        n[99].cntlid_block = 2;
        let c = choose(&n, &PathLoads::default(), &request(AccessPolicy::Inherit, &[], None)).unwrap();
        assert_eq!(c.paths, vec!["n0", "n98", "n99"]);
    }

    #[test]
    fn a_lost_optimized_path_moves_to_a_survivor_and_is_replaced() {
        let mut n = nodes(5);
        let current = vec!["n1".to_string(), "n0".to_string(), "n2".to_string()];
        n[1].healthy = false;
        let c = choose(&n, &PathLoads::default(), &request(AccessPolicy::Inherit, &current, None)).unwrap();
        assert_eq!(c.paths[0], "n0", "the surviving owner takes over");
        assert_eq!(c.paths.len(), 3);
        assert!(c.paths.contains(&"n2".to_string()), "a surviving path is kept");
        assert!(!c.paths.contains(&"n1".to_string()));
        assert!(c.explain.iter().any(|l| l == "n1: not chosen: unhealthy"), "{:?}", c.explain);
    }

    #[test]
    fn the_operator_moves_the_optimized_path_and_the_others_stay() {
        let n = nodes(4);
        let current = vec!["n0".to_string(), "n1".to_string(), "n2".to_string()];
        let c = choose(&n, &PathLoads::default(), &request(AccessPolicy::Inherit, &current, Some("n2"))).unwrap();
        assert_eq!(c.paths, ["n2", "n0", "n1"]);
        assert!(c.explain.iter().any(|l| l == "n2: optimized (forwards to the owner; chosen by the operator)"));
    }

    /// A re-choice weighs the other attachments only: its own paths, counted in the
    /// loads, are left out, as if they were not there. Removing what was added
    /// leaves nothing.
    #[test]
    fn loads_leave_out_the_attachment_being_chosen_and_removals_undo_additions() {
        let n = nodes(5);
        let mut book = Book::new();
        for i in 0..6 {
            attach(&n, &mut book, &format!("v{i}"), "n1", "g", &format!("h{}", i % 2), AccessPolicy::Balance);
        }
        let own = book.remove(&("v3".into(), "g".into(), "h1".into())).unwrap();
        let without = loads(&book);
        let mut with = without.clone();
        with.add(&Attached { group: "g", host: "h1", paths: &own });
        let current = own.clone();
        let req = |counted| AccessRequest {
            volume: "v3",
            owner: "n1",
            replicas: &[],
            host: "h1",
            policy: AccessPolicy::Balance,
            group: "g",
            current: &current,
            optimized: None,
            counted,
            explain: true,
        };
        assert_eq!(choose(&n, &with, &req(&own)), choose(&n, &without, &req(&[])));
        with.remove(&Attached { group: "g", host: "h1", paths: &own });
        assert_eq!(with, without);
        for ((_, group, host), paths) in &book {
            with.remove(&Attached { group, host, paths });
        }
        assert_eq!(with, PathLoads::default());
    }

    #[test]
    fn nodes_sharing_controller_ids_never_serve_one_attachment() {
        let mut n = nodes(3);
        n[1].cntlid_block = n[0].cntlid_block + CNTLID_BLOCKS;
        let mut book = Book::new();
        let p = attach(&n, &mut book, "v", "n0", "", "h", AccessPolicy::Inherit);
        assert_eq!(p, vec!["n0".to_string(), "n2".to_string()]);
    }

    #[test]
    fn no_usable_node_is_a_clear_error() {
        let mut n = nodes(2);
        n[0].healthy = false;
        n[1].excluded = true;
        let e = choose(&n, &PathLoads::default(), &request(AccessPolicy::Balance, &[], None)).unwrap_err();
        assert!(e.contains("every node is down or excluded"), "{e}");
    }

    #[test]
    fn policy_names_parse_and_unknown_ones_are_refused() {
        assert_eq!(AccessPolicy::parse("balance"), Ok(AccessPolicy::Balance));
        assert_eq!(AccessPolicy::parse("inherit"), Ok(AccessPolicy::Inherit));
        assert!(AccessPolicy::parse("spread").unwrap_err().contains("use inherit or balance"));
    }

    #[test]
    fn controller_id_blocks_do_not_overlap() {
        let ranges: Vec<(u16, u16)> = (0..CNTLID_BLOCKS).map(cntlid_range).collect();
        assert_eq!(ranges[0].0, 1);
        assert!(ranges.windows(2).all(|w| w[0].1 < w[1].0));
        assert!(ranges.last().unwrap().1 <= 0xFFEF);
    }

    proptest::proptest! {
        /// Any cluster, any sequence of attachments: paths are distinct usable nodes
        /// with distinct controller-ID blocks, at most three, and as many as the
        /// usable nodes allow. Group g0 inherits: one optimized node per host. Group
        /// g1 balances: a host's volumes get distinct optimized nodes while there
        /// are nodes enough.
        #[test]
        fn policies_on_generated_clusters(
            health in proptest::collection::vec((proptest::bool::weighted(0.8), proptest::bool::weighted(0.1), 0u16..20), 1..9),
            attachments in proptest::collection::vec((0usize..8, 0usize..3), 1..40),
        ) {
            let n: Vec<Candidate> = health
                .iter()
                .enumerate()
                .map(|(i, &(healthy, excluded, block))| Candidate { name: name(i), healthy, excluded, cntlid_block: block })
                .collect();
            let usable = n.iter().filter(|c| c.healthy && !c.excluded).count();
            let blocks: HashSet<u16> =
                n.iter().filter(|c| c.healthy && !c.excluded).map(|c| c.cntlid_block % CNTLID_BLOCKS).collect();
            let mut book = Book::new();
            for (volume, host) in attachments {
                let (group, policy) =
                    if volume % 2 == 0 { ("g0", AccessPolicy::Inherit) } else { ("g1", AccessPolicy::Balance) };
                let owner = format!("n{}", volume % n.len());
                let (volume, host) = (format!("v{volume}"), format!("h{host}"));
                let key = (volume.clone(), group.to_string(), host.clone());
                if book.contains_key(&key) {
                    continue;
                }
                let same_group: Vec<String> =
                    book.iter().filter(|((_, g, h), _)| g == group && *h == host).map(|(_, p)| p[0].clone()).collect();
                let req = AccessRequest {
                    volume: &volume, owner: &owner, replicas: &[], host: &host, policy, group, current: &[], optimized: None, counted: &[],
                    explain: false,
                };
                let result = choose(&n, &loads(&book), &req);
                // Asking why changes nothing of the choice.
                let explained = choose(&n, &loads(&book), &AccessRequest { explain: true, ..req.clone() });
                proptest::prop_assert_eq!(result.clone().map(|c| c.paths), explained.map(|c| c.paths));
                if usable == 0 {
                    proptest::prop_assert!(result.is_err());
                    continue;
                }
                let paths = result.unwrap().paths;
                let mut seen_nodes = HashSet::new();
                let mut seen_blocks = HashSet::new();
                for p in &paths {
                    let c = n.iter().find(|c| c.name == p).unwrap();
                    proptest::prop_assert!(c.healthy && !c.excluded);
                    proptest::prop_assert!(seen_nodes.insert(p.clone()), "two paths on {}", p);
                    proptest::prop_assert!(seen_blocks.insert(c.cntlid_block % CNTLID_BLOCKS));
                }
                proptest::prop_assert_eq!(paths.len(), MAX_PATHS.min(blocks.len()));
                if policy == AccessPolicy::Inherit {
                    proptest::prop_assert!(same_group.iter().all(|o| *o == paths[0]), "inherit: {:?} then {}", same_group, paths[0]);
                } else if same_group.len() < usable {
                    proptest::prop_assert!(!same_group.contains(&paths[0]), "balance: {:?} then {}", same_group, paths[0]);
                }
                book.insert(key, paths);
            }
        }
    }
}

//! The rebalancer: hot migrations that bring local volumes to their consumers' nodes
//! and make room for volumes that fit nowhere (docs/ARCHITECTURE.md, "Placement").
//!
//! - **Home.** A local volume whose consumer's node had no room went elsewhere at
//!   once, so its consumer has it now (`awaiting_home`). The rebalancer moves it home
//!   when the node has room.
//! - **Room.** If the node has no room, the rebalancer first moves a few volumes that
//!   did not ask for that node off it. `room::evictions` picks them, as in the
//!   simulator.
//! - **Hole.** A creation that found no node with room leaves a wanted hole. The
//!   rebalancer moves volumes off the node that needs the fewest bytes moved, and the
//!   creation, retried, lands there. A local request tries its own node first.
//!
//! It never moves a pinned volume, one a node's own pods asked to have there, one
//! served through a local device, or one that its include list keeps on its node. A
//! replicated volume moves one replica at a time (the one on the node that needs
//! room), and only while all its replicas are in sync.
//! Nodes that a migration is leaving or entering wait until it ends, so a pass never
//! plans on room that is still changing. A pass starts nothing while
//! [`MOST_IN_FLIGHT`] migrations are under way.

use crate::cluster::{Cluster, State};
use crate::model::{ReplicaState, VolumeRecord, VolumeState};
use crate::scheduler::{Locality, NodeView, Request};
use crate::{proto, room, scheduler};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Migrations under way (anyone's) at which the rebalancer starts no more.
const MOST_IN_FLIGHT: usize = 4;
/// How long a failed creation's hole is wanted: a provisioner retries within it.
const HOLE_WANTED_FOR: Duration = Duration::from_secs(600);
/// Most holes wanted at once; a newer one pushes out the oldest.
const MOST_WANTED_HOLES: usize = 16;
/// Most volumes awaiting home looked at in one pass.
const LOOK_AT: usize = 64;

/// A creation that found no room, kept until a hole fits it or it expires.
pub(super) struct WantedHole {
    request: Request,
    until: Instant,
    /// The node the last moves for it leave; while they run, it waits for them.
    making_on: Option<String>,
}

/// A migration the rebalancer starts: of the volume's copy on `from`, to `to` or
/// where the scheduler picks.
struct Move {
    volume: String,
    from: String,
    to: Option<String>,
    reason: &'static str,
    bytes: u64,
}

/// Whether the rebalancer may move the volume at all now: not pinned, ready, not
/// moving, not served through a local device, and every replica in sync.
fn movable_now(v: &VolumeRecord) -> bool {
    !v.pinned
        && !v.layered
        && v.state == VolumeState::Ready
        && v.migration.is_none()
        && v.local_hosts.is_empty()
        && v.replicas.iter().all(|r| r.state == ReplicaState::InSync && r.replaces.is_empty())
}

/// Whether the rebalancer may move the volume's copy off `node` to make room there.
fn may_leave(v: &VolumeRecord, node: &str) -> bool {
    movable_now(v)
        && !(v.locality == Locality::Local && v.host_node == node && v.node == node)
        && (v.include.is_empty() || v.include.iter().any(|n| *n != node))
}

/// Each copy of the volume's data: its node and pool (the serving one first).
fn copies(v: &VolumeRecord) -> impl Iterator<Item = (&str, &str)> {
    std::iter::once((v.node.as_str(), v.pool.as_str()))
        .chain(v.replicas.iter().map(|r| (r.node.as_str(), r.pool.as_str())))
}

/// Whether the volume's own rules allow it on `node`.
fn allowed_on(include: &[String], exclude: &[String], node: &str) -> bool {
    (include.is_empty() || include.iter().any(|n| n == node)) && !exclude.iter().any(|n| n == node)
}

impl Cluster {
    /// Remembers a creation that found no room, if the rebalancer could make a hole
    /// for it now; returns the node it would make the hole on.
    pub(super) fn want_hole(&self, st: &mut State, views: &[NodeView], request: &Request) -> Option<String> {
        self.cfg.rebalance_every?;
        let busy = busy_nodes(st);
        let (node, _) = self.plan_hole(st, views, &busy, request)?;
        st.wanted_holes.retain(|h| h.request != *request);
        if st.wanted_holes.len() >= MOST_WANTED_HOLES {
            st.wanted_holes.remove(0);
        }
        let until = Instant::now() + HOLE_WANTED_FOR;
        st.wanted_holes.push(WantedHole { request: request.clone(), until, making_on: None });
        Some(node)
    }

    /// One pass: plans under the state lock, then records the migrations, which
    /// their drivers carry out.
    pub(super) async fn rebalance(self: &Arc<Self>) {
        let moves = {
            let mut st = self.state.lock().unwrap();
            self.plan_moves(&mut st)
        };
        for m in moves {
            let req = proto::MigrateVolumeRequest {
                name: m.volume.clone(),
                to_node: m.to.clone().unwrap_or_default(),
                auto: m.to.is_none(),
                rate: self.cfg.rebalance_rate,
                pause_ms: 0,
                from_node: m.from.clone(),
            };
            match self.migrate_volume(&req).await {
                Ok(v) => {
                    self.cfg.metrics.rebalanced(m.reason, m.bytes);
                    let to = v.migration.map(|m| m.to_node).unwrap_or_default();
                    tracing::info!(volume = m.volume, reason = m.reason, from = %m.from, to = %to, "rebalancer: moving");
                }
                Err(e) => {
                    // The rest of the plan counted on this move; the next pass plans again.
                    tracing::info!(volume = m.volume, reason = m.reason, "rebalancer: cannot move: {}", e.message());
                    break;
                }
            }
        }
    }

    fn plan_moves(&self, st: &mut State) -> Vec<Move> {
        if st.volumes.migrating().count() + replica_moves(st).count() >= MOST_IN_FLIGHT {
            return Vec::new();
        }
        let busy = busy_nodes(st);
        let views = self.node_views(st);
        let now = Instant::now();
        let policy = &self.cfg.policy;
        st.wanted_holes.retain(|h| h.until > now && scheduler::choose(&views, &h.request, policy).is_none());
        let making = |h: &WantedHole| h.making_on.as_ref().is_some_and(|n| busy.contains(n));
        let hole = st
            .wanted_holes
            .iter()
            .enumerate()
            .filter(|(_, h)| !making(h))
            .find_map(|(i, h)| self.plan_hole(st, &views, &busy, &h.request).map(|(node, moves)| (i, node, moves)));
        if let Some((i, node, moves)) = hole {
            st.wanted_holes[i].making_on = Some(node);
            return moves;
        }
        // A replicated volume with a replica on its consumer's node already is not
        // moved there: that would take a second copy on one node.
        let awaiting = st.volumes.awaiting_home().filter(|v| {
            movable_now(v)
                && !copies(v).any(|(node, _)| node == v.host_node)
                && !busy.contains(&v.host_node)
                && !busy.contains(&v.node)
                && allowed_on(&v.include, &v.exclude, &v.host_node)
        });
        for v in awaiting.take(LOOK_AT) {
            let home = Request {
                size: v.size,
                thin: v.thin,
                locality: v.locality,
                host_node: v.host_node.clone(),
                include: vec![v.host_node.clone()],
                exclude: Vec::new(),
            };
            if scheduler::choose(&views, &home, policy).is_some() {
                let to = Some(v.host_node.clone());
                return vec![Move { volume: v.name.clone(), from: v.node.clone(), to, reason: "home", bytes: v.size }];
            }
            if let Some(moves) = self.plan_room(st, &views, &v.host_node, &home, "room") {
                return moves;
            }
        }
        Vec::new()
    }

    /// Where a hole for `request` could be made, and the moves that make it: on the
    /// consumer's node for a local request, else on the nodes `room::hole_candidates`
    /// orders.
    fn plan_hole(
        &self,
        st: &State,
        views: &[NodeView],
        busy: &HashSet<String>,
        request: &Request,
    ) -> Option<(String, Vec<Move>)> {
        let usable = |n: &NodeView| {
            n.healthy && !busy.contains(&n.name) && allowed_on(&request.include, &request.exclude, &n.name)
        };
        if request.locality == Locality::Local
            && let Some(home) = views.iter().find(|n| n.name == request.host_node).filter(|n| usable(n))
            && let Some(moves) = self.plan_room(st, views, &home.name, request, "hole")
        {
            return Some((home.name.clone(), moves));
        }
        let mut movable: HashMap<&str, u64> = HashMap::new();
        for v in st.volumes.values() {
            for (node, _) in copies(v).filter(|(node, _)| may_leave(v, node)) {
                *movable.entry(node).or_default() += v.size;
            }
        }
        let candidates = views.iter().filter(|n| usable(n)).filter_map(|n| {
            let deficit = n.pools.iter().filter_map(|p| scheduler::shortfall(p, request, &self.cfg.policy)).min()?;
            Some((deficit, movable.get(n.name.as_str()).copied().unwrap_or(0), n.name.as_str()))
        });
        room::hole_candidates(candidates)
            .into_iter()
            .find_map(|node| self.plan_room(st, views, node, request, "hole").map(|moves| (node.to_string(), moves)))
    }

    /// The moves that free room on `node` for `request`, in the pool that needs the
    /// fewest bytes moved; `None` when none can (too much to move, or nowhere for it
    /// to go), or when the volume fits already.
    fn plan_room(
        &self,
        st: &State,
        views: &[NodeView],
        node: &str,
        request: &Request,
        reason: &'static str,
    ) -> Option<Vec<Move>> {
        let view = views.iter().find(|n| n.name == node).filter(|n| n.healthy)?;
        let mut pools: Vec<(u64, &str)> = view
            .pools
            .iter()
            .filter_map(|p| scheduler::shortfall(p, request, &self.cfg.policy).map(|d| (d, p.name.as_str())))
            .collect();
        pools.sort_unstable();
        pools.into_iter().take_while(|(deficit, _)| *deficit > 0).find_map(|(deficit, pool)| {
            let movable: Vec<(u64, &str)> = st
                .volumes
                .of_node(node)
                .filter(|v| copies(v).any(|copy| copy == (node, pool)) && may_leave(v, node))
                .map(|v| (v.size, v.name.as_str()))
                .collect();
            let chosen = room::evictions(movable, deficit, request.size)?;
            let leaving: Vec<&VolumeRecord> = chosen.iter().map(|(_, name)| &st.volumes[*name]).collect();
            self.all_find_room(views, &leaving).then(|| {
                let moving = |v: &&VolumeRecord| Move {
                    volume: v.name.clone(),
                    from: node.to_string(),
                    to: None,
                    reason,
                    bytes: v.size,
                };
                leaving.iter().map(moving).collect()
            })
        })
    }

    /// Whether the scheduler finds each of these volumes a node that holds no copy of
    /// it, placing them one after the other.
    fn all_find_room(&self, views: &[NodeView], leaving: &[&VolumeRecord]) -> bool {
        let mut views = views.to_vec();
        leaving.iter().all(|v| {
            let request = Request {
                size: v.size,
                thin: v.thin,
                locality: v.locality,
                host_node: v.host_node.clone(),
                include: v.include.clone(),
                exclude: v.exclude.iter().cloned().chain(copies(v).map(|(n, _)| n.to_string())).collect(),
            };
            let Some((n, p)) = scheduler::choose(&views, &request, &self.cfg.policy) else { return false };
            let pool = &mut views[n].pools[p];
            if !v.thin {
                pool.committed += scheduler::thick_bytes(v.size, pool.cluster_size);
            }
            pool.provisioned += v.size;
            true
        })
    }
}

/// Nodes that a migration or a replica's move under way leaves or enters.
fn busy_nodes(st: &State) -> HashSet<String> {
    let migrations = st.volumes.migrating().filter_map(|v| v.migration.as_ref()).map(|m| (&m.from_node, &m.to_node));
    let moves = replica_moves(st).map(|r| (&r.replaces, &r.node));
    migrations.chain(moves).flat_map(|(from, to)| [from.clone(), to.clone()]).collect()
}

/// The new replicas of the replicas' moves under way.
fn replica_moves(st: &State) -> impl Iterator<Item = &crate::model::ReplicaRecord> {
    st.volumes.replicated().filter_map(VolumeRecord::replica_move)
}

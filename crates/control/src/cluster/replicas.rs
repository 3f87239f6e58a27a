//! Replicated volumes: where their replicas go, what each node serves of them, and
//! the membership pass that keeps the stored in-sync set true to what the serving
//! engine reports (docs/ARCHITECTURE.md, "Replicas and snapshots").
//!
//! Every change of the in-sync set or of the serving node is committed to the store
//! with the next generation *before* any node is told of it: the serving engine
//! answers the writes that skipped a failed replica only once its agent swaps in the
//! mirror without it, which the agent does on the controller's word alone.

use crate::cluster::{Cluster, State, now_ms, replica_moves};
use crate::model::{ReplicaRecord, ReplicaState, Tombstone, VolumeRecord, VolumeState};
use crate::scheduler::{self, Locality, NodeView, Request};
use crate::{access, proto};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use tonic::Status;

impl State {
    /// The leg by which the serving engine reaches the replica on `node`.
    pub(super) fn replica_leg(&self, v: &VolumeRecord, node: &str) -> Option<String> {
        let n = self.nodes.get(node)?;
        Some(format!("remote:{}/{}/1", n.record.peer(), v.replica_nqn()))
    }
}

/// The serving node's mirror: its generation, the other in-sync replicas, and the
/// one catching up, if any (one at a time: an engine rebuilds one leg of a mirror).
pub(super) fn mirror_wanted(st: &State, v: &VolumeRecord, rebuild_rate: u64) -> Option<proto::MirrorWanted> {
    if v.replicas.is_empty() {
        return None;
    }
    let legs = v
        .replicas
        .iter()
        .filter(|r| r.state == ReplicaState::InSync)
        .filter_map(|r| st.replica_leg(v, &r.node))
        .collect();
    let catching_up = v.replicas.iter().find(|r| r.state == ReplicaState::CatchingUp);
    Some(proto::MirrorWanted {
        generation: v.generation,
        legs,
        rebuild_leg: catching_up.and_then(|r| st.replica_leg(v, &r.node)).unwrap_or_default(),
        rebuild_since: catching_up.map_or(0, |r| r.since),
        rebuild_rate,
    })
}

/// On a replica's node: its export, which only the serving engine may connect to.
pub(super) fn replica_wanted(st: &State, v: &VolumeRecord, r: &ReplicaRecord) -> proto::ReplicaWanted {
    proto::ReplicaWanted {
        subsystem_nqn: v.replica_nqn(),
        serving_host_nqn: st.nodes.get(&v.node).map(|n| n.record.host_nqn.clone()).unwrap_or_default(),
        make: copies_in_full(v, r),
    }
}

/// Whether the replica's volume may be made, empty, where it is missing: the volume
/// is being created, or the replica's next (or current) rebuild copies every
/// cluster. A replica that holds the volume's data, or that a partial rebuild is to
/// bring up to date, is never made anew: its volume missing is a lost copy
/// (`lost_copies`).
fn copies_in_full(v: &VolumeRecord, r: &ReplicaRecord) -> bool {
    if v.state == VolumeState::Creating {
        return true;
    }
    match r.state {
        ReplicaState::InSync => false,
        ReplicaState::CatchingUp => r.since == 0,
        ReplicaState::Faulted => !(r.left_serving == v.node && r.left_at > 0),
    }
}

/// A new replicated volume's identity, which every replica takes (hosts see one
/// namespace whichever replica serves it).
pub(super) fn new_identity() -> (String, String) {
    let uuid = uuid::Uuid::new_v4();
    let nguid = uuid::Uuid::new_v4().simple().to_string();
    (uuid.to_string(), nguid)
}

impl Cluster {
    /// The nodes and pools of `more` replicas of a volume whose replicas are on the
    /// nodes `holding` (the serving one first): each on a node of its own and, while
    /// enough nodes carry zones, in a zone of its own, chosen by the same scheduler.
    pub(super) fn place_replicas(
        &self,
        st: &State,
        views: &[NodeView],
        req: &Request,
        holding: &[String],
        more: usize,
    ) -> Result<Vec<(String, String)>, String> {
        let zone_of = |node: &str| st.nodes.get(node).and_then(|n| n.record.labels.get("zone")).cloned();
        let count = holding.len() + more;
        let mut chosen: Vec<(String, String)> = holding.iter().map(|n| (n.clone(), String::new())).collect();
        while chosen.len() < count {
            let taken: Vec<String> = chosen.iter().map(|(n, _)| n.clone()).collect();
            let zones: BTreeSet<String> = taken.iter().filter_map(|n| zone_of(n)).collect();
            let apart = Request {
                locality: Locality::Any,
                host_node: String::new(),
                exclude: req.exclude.iter().cloned().chain(taken).collect(),
                ..req.clone()
            };
            let same_zone = st.nodes.keys().filter(|n| zone_of(n).is_some_and(|z| zones.contains(&z))).cloned();
            let zone_apart =
                Request { exclude: apart.exclude.iter().cloned().chain(same_zone).collect(), ..apart.clone() };
            let pick = scheduler::choose(views, &zone_apart, &self.cfg.policy)
                .or_else(|| scheduler::choose(views, &apart, &self.cfg.policy));
            let Some((node, pool)) = pick else {
                return Err(format!(
                    "{count} replicas need {count} healthy nodes with room, but only {} could be placed ({}): \
                     add nodes or space, or ask for fewer replicas",
                    chosen.len(),
                    chosen.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
                ));
            };
            chosen.push((views[node].name.clone(), views[node].pools[pool].name.clone()));
        }
        Ok(chosen.split_off(holding.len()))
    }

    /// Makes a volume hold `count` replicas (1 to 3), online: new ones are placed
    /// apart from the others and rebuilt in full, one at a time, before they count;
    /// fewer drops the faulted ones first, then those catching up, then in-sync ones
    /// (never the serving one).
    pub async fn set_volume_replicas(self: &Arc<Self>, name: &str, count: u32) -> Result<proto::Volume, Status> {
        if !(1..=3).contains(&count) {
            return Err(Status::invalid_argument(format!(
                "{count} replicas asked for: a volume has 1 to 3 (each on its own node)"
            )));
        }
        let count = count as usize;
        let _guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if v.migration.is_some() || v.replica_move().is_some() {
            return Err(Status::failed_precondition(format!(
                "volume {name} is moving: change its replicas once the move is over"
            )));
        }
        if count == v.replica_count() {
            return Ok(self.volume_proto(&v));
        }
        let mut next = v.clone();
        let mut gone = Vec::new();
        if count > v.replica_count() {
            let placed = {
                let mut st = self.state.lock().unwrap();
                let views = self.node_views(&mut st);
                self.place_replicas(&st, &views, &request_of(&v), &holding_nodes(&st, &v), count - v.replica_count())
            };
            let placed = placed.map_err(|e| Status::resource_exhausted(format!("volume {name}: {e}")))?;
            next.replicas.extend(placed.iter().map(|(node, pool)| new_replica(node, pool)));
            // Generations only grow: one that served the volume before (it had replicas
            // once) is later than any engine took it at.
            next.generation += 1;
            if v.replicas.is_empty() {
                next.serving_power_losses = {
                    let st = self.state.lock().unwrap();
                    power_losses(&st, &v.node, &v.pool)
                };
            }
        } else {
            let rank = |r: &ReplicaRecord| match r.state {
                ReplicaState::Faulted => 0,
                ReplicaState::CatchingUp => 1,
                ReplicaState::InSync => 2,
            };
            next.replicas.sort_by_key(rank);
            gone = next.replicas.drain(..v.replica_count() - count).collect();
            next.generation += 1;
        }
        let tombs: Vec<Tombstone> = gone.iter().map(|r| Tombstone::of_replica(&v, &r.node, &r.pool)).collect();
        self.put_volume_and_tombs(&next, tombs).await?;
        tracing::info!(volume = name, generation = next.generation, "replicas: {} asked for", count);
        let me = self.clone();
        let nodes: Vec<String> = next.exporting_nodes().into_iter().chain(gone.into_iter().map(|r| r.node)).collect();
        tokio::spawn(async move {
            for node in nodes {
                let _ = me.apply_node(&node).await;
            }
        });
        Ok(self.volume_proto(&next))
    }

    /// Replaces each replica whose node stayed away longer than `replica_timeout`, or
    /// came back without the replica's pool, by a new one on another node (rebuilt in
    /// full); the old one is removed when its node comes back (if its pool is gone,
    /// there is nothing to remove).
    async fn replace_lost_replicas(self: &Arc<Self>) {
        let timeout_ms = self.cfg.replica_timeout.as_millis() as u64;
        // Away too long, or back without its pool (its disks lost): made anew at once.
        // A replica that a move replaces is not: the move's replica is its
        // replacement already.
        let lost = |st: &State, v: &VolumeRecord, r: &ReplicaRecord| {
            let away = r.left_ms > 0
                && now_ms().saturating_sub(r.left_ms) >= timeout_ms
                && !st.nodes.get(&r.node).is_some_and(|n| self.healthy(n));
            r.state == ReplicaState::Faulted
                && (away || pool_gone(st, &r.node, &r.pool))
                && !v.replicas.iter().any(|m| m.replaces == r.node)
        };
        let due: Vec<String> = {
            let st = self.state.lock().unwrap();
            st.volumes
                .replicated()
                .filter(|v| v.state == VolumeState::Ready && v.migration.is_none())
                .filter(|v| v.replicas.iter().any(|r| lost(&st, v, r)))
                .map(|v| v.name.clone())
                .collect()
        };
        for name in due {
            let _guard = self.volume_locks.lock(&name).await;
            let replaced = {
                let mut st = self.state.lock().unwrap();
                let Some(v) = st.volumes.get(&name).cloned() else { continue };
                let Some(old) = v.replicas.iter().find(|r| lost(&st, &v, r)).cloned() else { continue };
                let tomb = Tombstone::of_replica(&v, &old.node, &old.pool);
                if !old.replaces.is_empty() {
                    // A move's new replica lost: the move stops, the replica it was to
                    // replace stays.
                    let mut next = v.clone();
                    next.replicas.retain(|r| r.node != old.node);
                    next.generation += 1;
                    next.last_migration = format!(
                        "the move of the replica on {} to {} stopped: {} stayed away longer than the replica \
                         timeout; the replica stays on {}",
                        old.replaces, old.node, old.node, old.replaces
                    );
                    Some((next, tomb, old.node))
                } else {
                    let views = self.node_views(&mut st);
                    match self.place_replicas(&st, &views, &request_of(&v), &holding_nodes(&st, &v), 1) {
                        Ok(placed) => {
                            let mut next = v.clone();
                            next.replicas.retain(|r| r.node != old.node);
                            next.replicas.extend(placed.iter().map(|(node, pool)| new_replica(node, pool)));
                            Some((next, tomb, old.node))
                        }
                        Err(e) => {
                            tracing::warn!(volume = name, node = old.node, "cannot replace a lost replica yet: {e}");
                            None
                        }
                    }
                }
            };
            let Some((next, tomb, old_node)) = replaced else { continue };
            if self.put_volume_and_tombs(&next, vec![tomb]).await.is_ok() {
                tracing::info!(
                    volume = name,
                    node = old_node,
                    "replicas: a replica away too long is made anew elsewhere"
                );
            }
        }
    }

    /// Runs on every pass of the background loop: commits each change the replicated
    /// volumes need (a replica failed, went away, came back, finished its rebuild;
    /// the serving node was lost) and has the nodes concerned apply it.
    pub(super) async fn tend_replicas(self: &Arc<Self>) {
        self.replace_lost_replicas().await;
        let due: Vec<String> = {
            let st = self.state.lock().unwrap();
            let rebuilds = rebuilds_by_node(&st);
            st.volumes
                .replicated()
                .filter(|v| self.membership_change(&st, v, &rebuilds).is_some())
                .map(|v| v.name.clone())
                .collect()
        };
        for name in due {
            let _guard = self.volume_locks.lock(&name).await;
            let change = {
                let st = self.state.lock().unwrap();
                let rebuilds = rebuilds_by_node(&st);
                st.volumes.get(&name).and_then(|v| self.membership_change(&st, v, &rebuilds).map(|c| (v.clone(), c)))
            };
            let Some((old, (next, what, tombs))) = change else { continue };
            if let Err(e) = self.put_volume_and_tombs(&next, tombs).await {
                tracing::warn!(volume = name, "cannot record a change of its replicas ({what}): {e}");
                continue;
            }
            tracing::info!(volume = name, generation = next.generation, "replicas: {what}");
            // The serving node first: a failover's new one takes its replicas' reservations.
            let mut nodes = vec![next.node.clone()];
            nodes.extend(old.exporting_nodes().into_iter().chain(next.exporting_nodes()).filter(|n| *n != next.node));
            nodes.dedup();
            let me = self.clone();
            tokio::spawn(async move {
                for node in nodes {
                    let _ = me.apply_node(&node).await;
                }
            });
        }
    }

    /// The next change a replicated volume needs, with what it is, if any.
    fn membership_change(
        &self,
        st: &State,
        v: &VolumeRecord,
        rebuilds: &HashMap<&str, usize>,
    ) -> Option<(VolumeRecord, String, Vec<Tombstone>)> {
        if v.state != VolumeState::Ready || v.migration.is_some() {
            return None;
        }
        let up = |node: &str| st.nodes.get(node).is_some_and(|n| self.healthy(n));
        // Up and on time: a node that missed a heartbeat may be the one being lost,
        // so it takes no new role (serving, a rebuild) until it heartbeats again.
        let alive = |node: &str| st.nodes.get(node).is_some_and(|n| self.healthy(n) && !self.quiet(n));
        // Only what the mirror of this generation reports counts: an older one's
        // report was taken before the change that followed it.
        let report = st
            .nodes
            .get(&v.node)
            .and_then(|n| n.mirrors.get(&v.subsystem_nqn))
            .filter(|m| m.generation == v.generation);
        let failed = |leg: &str| report.and_then(|m| m.faulted_legs.iter().find(|f| f.leg == leg));
        let own_leg = format!("volume:{}/{}", v.pool, v.engine_name);
        let mut next = v.clone();
        // The serving node missed a heartbeat and an in-sync replica lost its
        // engine's connection: lost, without waiting for the node's timeout.
        let replica_nqn = v.replica_nqn();
        let orphaned = st.nodes.get(&v.node).is_some_and(|n| self.quiet(n))
            && v.replicas.iter().any(|r| {
                r.state == ReplicaState::InSync
                    && st
                        .nodes
                        .get(&r.node)
                        .is_some_and(|n| self.healthy(n) && n.replicas_unconnected.contains(&replica_nqn))
            });
        let serving_copy_gone = serving_copy_gone(st, v);
        if !up(&v.node) || orphaned || failed(&own_leg).is_some() || serving_copy_gone.is_some() {
            // The serving replica is gone: an in-sync one on a live node takes over,
            // if there is one; else I/O waits for the serving node (invariant 4).
            let heir = v.replicas.iter().position(|r| r.state == ReplicaState::InSync && alive(&r.node))?;
            let heir = next.replicas.remove(heir);
            let why = match (failed(&own_leg), serving_copy_gone) {
                (Some(f), _) => format!("it failed a write: {}", f.error),
                (None, Some(gone)) => gone,
                (None, None) => format!("node {} was lost while serving", v.node),
            };
            next.replicas.push(ReplicaRecord {
                state: ReplicaState::Faulted,
                why,
                left_at: v.generation,
                left_serving: v.node.clone(),
                left_ms: now_ms(),
                ..ReplicaRecord::new(&v.node, &v.pool)
            });
            for r in next.replicas.iter_mut().filter(|r| r.state != ReplicaState::Faulted && !up(&r.node)) {
                leave(r, v, format!("node {} went away", r.node));
            }
            next.node = heir.node.clone();
            next.pool = heir.pool;
            next.serving_power_losses = heir.power_losses;
            // The new serving node becomes every host's optimized path.
            for paths in next.paths.values_mut() {
                paths.retain(|n| *n != heir.node);
                paths.insert(0, heir.node.clone());
                paths.truncate(access::MAX_PATHS);
            }
            next.local_device = None;
            next.generation += 1;
            let what = format!("{} serves at generation {} ({} lost)", heir.node, next.generation, v.node);
            return Some((next, what, Vec::new()));
        }
        let mut changes = Vec::new();
        for r in next.replicas.iter_mut() {
            let leg = st.replica_leg(v, &r.node).unwrap_or_default();
            let failure = failed(&leg).map(|f| format!("it failed a write: {}", f.error));
            let rebuild = report.and_then(|m| m.rebuild.as_ref()).filter(|b| b.leg == leg);
            let gone = (!up(&r.node)).then(|| format!("node {} went away", r.node));
            // Its machine stopped with the pool open since it joined (or began to catch
            // up): the disks may have lost writes they had acknowledged, whatever the
            // serving engine's record says it has.
            let lost_power = (power_losses(st, &r.node, &r.pool) > r.power_losses)
                .then(|| format!("node {} lost power: its disks may lack writes they had acknowledged", r.node));
            // Its copy is gone (its pool lost or made anew): whatever it held, it is
            // rebuilt in full, here or (its pool lost) elsewhere.
            let copy_gone = copy_gone(st, v, &r.node, &r.pool);
            let in_full = copy_gone.is_some() && !r.left_serving.is_empty();
            let gone = gone.or(lost_power).or(copy_gone);
            match r.state {
                ReplicaState::InSync => {
                    if let Some(why) = failure.or(gone) {
                        changes.push(format!("{} faulted: {why}", r.node));
                        leave(r, v, why);
                    }
                }
                ReplicaState::CatchingUp => {
                    let rebuild_failed =
                        rebuild.filter(|b| b.state == "failed").map(|b| format!("its rebuild failed: {}", b.error));
                    if let Some(why) = failure.or(gone).or(rebuild_failed) {
                        changes.push(format!("{} faulted while catching up: {why}", r.node));
                        r.state = ReplicaState::Faulted;
                        r.why = why;
                        r.since = 0;
                    } else if rebuild.is_some_and(|b| b.state == "done") {
                        changes.push(format!("{} rebuilt and in sync", r.node));
                        // A move's replica stays marked: the next pass ends the move.
                        let moving = !r.replaces.is_empty();
                        *r = ReplicaRecord {
                            power_losses: r.power_losses,
                            replaces: std::mem::take(&mut r.replaces),
                            left_ms: if moving { r.left_ms } else { 0 },
                            ..ReplicaRecord::new(&r.node, &r.pool)
                        };
                    }
                }
                ReplicaState::Faulted => {}
            }
            if in_full {
                // No record of what it lacks counts for it any more.
                changes.push(format!("{} rebuilds in full", r.node));
                r.left_serving.clear();
            }
        }
        if !changes.is_empty() {
            next.generation += 1;
            return Some((next, changes.join("; "), Vec::new()));
        }
        // A move's replica is in sync: the replica it replaces goes.
        if let Some(i) = next.replicas.iter().position(|r| !r.replaces.is_empty() && r.state == ReplicaState::InSync) {
            return Some(replica_moves::finish_move(v, next, i));
        }
        // A faulted replica whose node is back catches up, one at a time: only the
        // clusters written since it left when the serving engine then is the one
        // serving now (it keeps that record), else every cluster.
        if next.replicas.iter().any(|r| r.state == ReplicaState::CatchingUp) {
            return None;
        }
        // Each node copies from or to at most `rebuilds_per_node` replicas at once.
        let room = |node: &str| rebuilds.get(node).copied().unwrap_or(0) < self.cfg.rebuilds_per_node;
        if !room(&v.node) {
            return None;
        }
        let r = next.replicas.iter_mut().find(|r| {
            r.state == ReplicaState::Faulted && alive(&r.node) && room(&r.node) && !pool_gone(st, &r.node, &r.pool)
        })?;
        r.state = ReplicaState::CatchingUp;
        // The record names what it lacks only if the serving engine kept it, and only
        // if its own disks kept everything it had acknowledged.
        let power_lost = power_losses(st, &r.node, &r.pool) > r.power_losses;
        r.power_losses = power_losses(st, &r.node, &r.pool);
        r.since = if r.left_serving == v.node && r.left_at > 0 && !power_lost { r.left_at + 1 } else { 0 };
        let what = match r.since {
            0 => format!("{} back: a full rebuild", r.node),
            since => format!("{} back: rebuilding what generations {since} and later wrote", r.node),
        };
        Some((next, what, Vec::new()))
    }
}

/// Why the serving copy of `v` may no longer hold every write: gone, or its node
/// lost power since it began serving (its disks may lack writes they had
/// acknowledged, which the other replicas have).
fn serving_copy_gone(st: &State, v: &VolumeRecord) -> Option<String> {
    copy_gone(st, v, &v.node, &v.pool).or_else(|| {
        (power_losses(st, &v.node, &v.pool) > v.serving_power_losses).then(|| {
            format!("node {} lost power while serving: its disks may lack writes they had acknowledged", v.node)
        })
    })
}

/// Why the copy of `v` in pool `pool` of node `node` is gone, if it is: the node
/// reports without that pool (its disks lost), or its agent found the volume missing
/// where it held the data (its pool made anew).
fn copy_gone(st: &State, v: &VolumeRecord, node: &str, pool: &str) -> Option<String> {
    if pool_gone(st, node, pool) {
        return Some(format!("its pool {pool} is gone from node {node}"));
    }
    let lost = st.nodes.get(node).is_some_and(|n| n.lost_copies.contains(&v.id));
    lost.then(|| format!("its copy on node {node} is gone (its pool was made anew?)"))
}

/// Whether node `node` reports without pool `pool`, or with it failed: a node that
/// heartbeats with its engine up lists every pool it has.
fn pool_gone(st: &State, node: &str, pool: &str) -> bool {
    st.nodes.get(node).is_some_and(|n| {
        n.engine_error.is_none() && n.usage_complete && !n.pools.iter().any(|p| p.name == pool && p.failed.is_none())
    })
}

/// The power losses pool `pool` of node `node` counted, as its last heartbeat said.
pub(super) fn power_losses(st: &State, node: &str, pool: &str) -> u32 {
    st.nodes.get(node).and_then(|n| n.pools.iter().find(|p| p.name == pool)).map_or(0, |p| p.power_losses)
}

/// The rebuilds under way per node, as the source (the serving node) or the target.
fn rebuilds_by_node(st: &State) -> HashMap<&str, usize> {
    let mut count = HashMap::new();
    for v in st.volumes.replicated() {
        for r in v.replicas.iter().filter(|r| r.state == ReplicaState::CatchingUp) {
            *count.entry(v.node.as_str()).or_default() += 1;
            *count.entry(r.node.as_str()).or_default() += 1;
        }
    }
    count
}

/// A replica made anew: it has nothing yet, so it waits for a full rebuild (the
/// membership pass starts one once no other replica of the volume catches up).
pub(super) fn new_replica(node: &str, pool: &str) -> ReplicaRecord {
    ReplicaRecord {
        state: ReplicaState::Faulted,
        why: "new: waits for its rebuild".into(),
        left_ms: now_ms(),
        ..ReplicaRecord::new(node, pool)
    }
}

/// The nodes a new replica of `v` may not go to: those holding one, and those whose
/// dropped replica is still to be removed (the removal would take the new one).
pub(super) fn holding_nodes(st: &State, v: &VolumeRecord) -> Vec<String> {
    let prefix = format!("{}@", v.id);
    let dropped = st.tombstones.values().filter(|t| t.id.starts_with(&prefix)).map(|t| t.node.clone());
    let mut nodes: Vec<String> =
        std::iter::once(v.node.clone()).chain(v.replicas.iter().map(|r| r.node.clone())).chain(dropped).collect();
    nodes.dedup();
    nodes
}

/// What the scheduler places another replica of `v` by: its size and node rules,
/// anywhere.
pub(super) fn request_of(v: &VolumeRecord) -> Request {
    Request {
        size: v.size,
        thin: v.thin,
        locality: Locality::Any,
        host_node: String::new(),
        include: v.include.clone(),
        exclude: v.exclude.clone(),
    }
}

/// Takes an in-sync replica out of the in-sync set of `v` (at its generation).
fn leave(r: &mut ReplicaRecord, v: &VolumeRecord, why: String) {
    r.state = ReplicaState::Faulted;
    r.why = why;
    r.left_at = v.generation;
    r.left_serving = v.node.clone();
    r.left_ms = now_ms();
    r.since = 0;
}

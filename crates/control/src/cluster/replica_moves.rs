//! Moving one replica of a replicated volume to another node: `volume migrate`, a
//! node's drain and the rebalancer all come here for a volume of several replicas.
//!
//! A move is one more replica, on the target, marked with the node whose replica it
//! replaces (`ReplicaRecord::replaces`). The membership pass rebuilds it in full under
//! live writes, as any new replica, and commits it in sync; its next pass finishes
//! the move in one commit at the next generation: the replaced replica is dropped (a
//! tombstone removes its copy), and if it was the serving one, the new replica serves
//! instead. Its engine then takes the other replicas' reservations at that
//! generation, so the old serving engine can no longer write anywhere, and its writes
//! in flight end with a path error that hosts send again on another path. Each
//! host's paths keep their places, the target's in the old node's place, the serving
//! node's first. Until the new replica is in sync the move can be cancelled, and the
//! volume keeps its replicas as they were.

use crate::access;
use crate::cluster::replicas::{holding_nodes, new_replica, request_of};
use crate::cluster::{Cluster, State, now_ms};
use crate::model::{ReplicaRecord, ReplicaState, Tombstone, VolumeRecord};
use crate::proto;
use std::sync::Arc;
use tonic::Status;

impl Cluster {
    /// Records the move of one replica of `v` (the serving one unless the request
    /// names another) to the node asked for or one the scheduler picks.
    pub(super) async fn move_replica(
        self: &Arc<Self>,
        v: VolumeRecord,
        req: &proto::MigrateVolumeRequest,
    ) -> Result<proto::Volume, Status> {
        let name = v.name.as_str();
        let from = if req.from_node.is_empty() { v.node.clone() } else { req.from_node.clone() };
        let holders: Vec<&str> =
            std::iter::once(v.node.as_str()).chain(v.replicas.iter().map(|r| r.node.as_str())).collect();
        if !holders.contains(&from.as_str()) {
            return Err(Status::invalid_argument(format!(
                "volume {name} has no replica on {from}: its replicas are on {}",
                holders.join(", ")
            )));
        }
        if let Some(r) = v.replica_move() {
            return Err(Status::already_exists(format!(
                "volume {name} is already moving its replica on {} to {}: `nvpool volume get {name}` shows the \
                 rebuild, `nvpool volume migrate {name} --cancel` stops it",
                r.replaces, r.node
            )));
        }
        if let Some(r) = v.replicas.iter().find(|r| r.node != from && r.state != ReplicaState::InSync) {
            return Err(Status::failed_precondition(format!(
                "volume {name}'s replica on {} is not in sync ({}): a replica moves only while the others are; \
                 retry once `nvpool volume get {name}` shows them in sync",
                r.node,
                if r.why.is_empty() { "rebuilding" } else { r.why.as_str() }
            )));
        }
        if from == v.node && !v.local_hosts.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {name} serves {} through a local device on {}: detach those hosts (they can attach over \
                 NVMe/TCP) before its serving replica moves",
                v.local_hosts.join(", "),
                v.node
            )));
        }
        let placed = {
            let mut st = self.state.lock().unwrap();
            let mut request = request_of(&v);
            if !req.to_node.is_empty() {
                if !st.nodes.contains_key(&req.to_node) {
                    return Err(Status::not_found(format!(
                        "unknown node {:?}: `nvpool node list` shows the nodes",
                        req.to_node
                    )));
                }
                if holders.contains(&req.to_node.as_str()) {
                    return Err(Status::invalid_argument(format!(
                        "volume {name} has a replica on {} already: name a node that holds none",
                        req.to_node
                    )));
                }
                request.include = vec![req.to_node.clone()];
            }
            let views = self.node_views(&mut st);
            self.place_replicas(&st, &views, &request, &holding_nodes(&st, &v), 1)
        };
        let mut placed = placed.map_err(|e| {
            Status::resource_exhausted(format!("volume {name}'s replica on {from} has nowhere to move: {e}"))
        })?;
        let (to, pool) = placed.remove(0);
        let mut next = v.clone();
        next.replicas.push(ReplicaRecord {
            replaces: from.clone(),
            why: format!("new: replaces the replica on {from} once rebuilt"),
            ..new_replica(&to, &pool)
        });
        next.last_migration.clear();
        self.put_volume(&next).await?;
        tracing::info!(volume = name, from = %from, to = %to, "replicas: a replica moves");
        let me = self.clone();
        let nodes = next.exporting_nodes();
        tokio::spawn(async move {
            for node in nodes {
                let _ = me.apply_node(&node).await;
            }
        });
        Ok(self.volume_proto(&next))
    }

    /// Stops a replica's move before its new replica is in sync: that replica goes,
    /// the others stay as they were.
    pub(super) async fn cancel_replica_move(self: &Arc<Self>, v: VolumeRecord) -> Result<proto::Volume, Status> {
        let Some(moving) = v.replica_move().cloned() else { return Ok(self.volume_proto(&v)) };
        if moving.state == ReplicaState::InSync {
            return Err(Status::failed_precondition(format!(
                "volume {}'s new replica on {} is in sync and takes the place of {}'s now: that cannot be stopped; \
                 it ends in a moment",
                v.name, moving.node, moving.replaces
            )));
        }
        let mut next = v.clone();
        next.replicas.retain(|r| r.node != moving.node);
        next.generation += 1;
        next.last_migration = format!(
            "the move of the replica on {} to {} was cancelled; it stays on {}",
            moving.replaces, moving.node, moving.replaces
        );
        let tomb = Tombstone::of_replica(&v, &moving.node, &moving.pool);
        self.put_volume_and_tombs(&next, vec![tomb]).await?;
        tracing::info!(volume = %v.name, "{}", next.last_migration);
        let me = self.clone();
        let nodes: Vec<String> = next.exporting_nodes().into_iter().chain([moving.node]).collect();
        tokio::spawn(async move {
            for node in nodes {
                let _ = me.apply_node(&node).await;
            }
        });
        Ok(self.volume_proto(&next))
    }
}

/// The commit that ends a move whose new replica (`next.replicas[i]`) is in sync:
/// the replica it replaces goes, and the new one serves if that one did.
pub(super) fn finish_move(
    v: &VolumeRecord,
    mut next: VolumeRecord,
    i: usize,
) -> (VolumeRecord, String, Vec<Tombstone>) {
    let from = std::mem::take(&mut next.replicas[i].replaces);
    let to = next.replicas[i].node.clone();
    let started_ms = next.replicas[i].left_ms;
    next.replicas[i].left_ms = 0;
    let mut tombs = Vec::new();
    if from == v.node {
        let heir = next.replicas.remove(i);
        tombs.push(Tombstone::of_replica(v, &v.node, &v.pool));
        next.node = heir.node;
        next.pool = heir.pool;
        next.serving_power_losses = heir.power_losses;
        next.local_device = None;
    } else if let Some(old) = next.replicas.iter().position(|r| r.node == from) {
        let old = next.replicas.remove(old);
        tombs.push(Tombstone::of_replica(v, &old.node, &old.pool));
    }
    for paths in next.paths.values_mut() {
        *paths = moved_paths(paths, &from, &to, &next.node);
    }
    next.generation += 1;
    let secs = now_ms().saturating_sub(started_ms) as f64 / 1000.0;
    next.last_migration = if from == v.node {
        format!(
            "moved the serving replica from {from} to {to} in {secs:.1} s (rebuilt there in full); {to} serves at \
             generation {}",
            next.generation
        )
    } else {
        format!("moved the replica on {from} to {to} in {secs:.1} s (rebuilt there in full)")
    };
    let what = next.last_migration.clone();
    (next, what, tombs)
}

/// A host's paths once the replica on `from` moved to `to`: the target in the old
/// node's place (a host keeps its paths on the replicas' nodes, so a later failover
/// is an ANA change), the serving node first.
fn moved_paths(paths: &[String], from: &str, to: &str, serving: &str) -> Vec<String> {
    let mut moved: Vec<String> = Vec::new();
    for node in paths.iter().map(|n| if n == from { to } else { n.as_str() }) {
        if node != serving && !moved.iter().any(|m| m == node) {
            moved.push(node.to_string());
        }
    }
    moved.insert(0, serving.to_string());
    moved.truncate(access::MAX_PATHS);
    moved
}

/// What `volume get` shows of a replica's move, in a migration's terms (the CLI
/// follows both alike): waiting for its rebuild, rebuilding with its progress, or
/// switching once in sync.
pub(super) fn move_proto(st: &State, v: &VolumeRecord, moving: &ReplicaRecord) -> proto::Migration {
    let report = st.nodes.get(&v.node).and_then(|n| n.mirrors.get(&v.subsystem_nqn));
    let rebuild = report.and_then(|m| m.rebuild.as_ref()).filter(|b| {
        moving.state == ReplicaState::CatchingUp && st.replica_leg(v, &moving.node).as_deref() == Some(&b.leg)
    });
    let started_ms_ago = now_ms().saturating_sub(moving.left_ms);
    let copied = rebuild.map_or(0, |b| b.copied_bytes);
    proto::Migration {
        from_node: moving.replaces.clone(),
        to_node: moving.node.clone(),
        to_pool: moving.pool.clone(),
        phase: match moving.state {
            ReplicaState::Faulted => "preparing",
            ReplicaState::CatchingUp => "copying",
            ReplicaState::InSync => "switching",
        }
        .into(),
        round: 1,
        copied_bytes: copied,
        allocated_bytes: rebuild.map_or(0, |b| b.total_bytes),
        rate: (copied * 1000).checked_div(started_ms_ago).unwrap_or(0),
        started_ms_ago,
        waiting: match moving.state {
            ReplicaState::Faulted => "a rebuild to start (one per volume, and a few per node, at a time)".into(),
            _ => String::new(),
        },
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::moved_paths;

    fn nodes(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn the_target_takes_the_old_nodes_place_and_the_serving_node_comes_first() {
        // A replica that does not serve: its path's place goes to the target.
        assert_eq!(moved_paths(&nodes(&["a", "b", "c"]), "b", "d", "a"), nodes(&["a", "d", "c"]));
        // The serving one: the target serves, first.
        assert_eq!(moved_paths(&nodes(&["a", "b", "c"]), "a", "d", "d"), nodes(&["d", "b", "c"]));
        // A target that was an access point already is not listed twice.
        assert_eq!(moved_paths(&nodes(&["a", "b", "d"]), "a", "d", "d"), nodes(&["d", "b"]));
        // A host without a path to the old node keeps its paths.
        assert_eq!(moved_paths(&nodes(&["a", "c"]), "b", "d", "a"), nodes(&["a", "c"]));
    }
}

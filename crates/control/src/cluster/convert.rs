//! Between the store's records and the gRPC API's messages.

use crate::access::AccessPolicy;
use crate::cluster::{Cluster, State, now_ms, replica_moves};
use crate::model::{DhchapRecord, MigrationPhase, PoolRecord, ReplicaState, VolumeRecord, VolumeState};
use crate::scheduler::{Locality, Request, Score};
use crate::{proto, scheduler};
use tonic::Status;

impl Cluster {
    pub(super) fn volume_proto(&self, v: &VolumeRecord) -> proto::Volume {
        let st = self.state.lock().unwrap();
        self.volume_proto_locked(&st, v)
    }

    pub(super) fn volume_proto_locked(&self, st: &State, v: &VolumeRecord) -> proto::Volume {
        let allocated = if v.thin {
            st.nodes.get(&v.node).and_then(|n| n.usage.get(&v.engine_name)).copied().unwrap_or(0)
        } else {
            let cs = st
                .nodes
                .get(&v.node)
                .and_then(|n| n.pools.iter().find(|p| p.name == v.pool))
                .map_or(1, |p| p.cluster_size);
            scheduler::thick_bytes(v.size, cs)
        };
        proto::Volume {
            name: v.name.clone(),
            id: v.id.clone(),
            size_bytes: v.size,
            thin: v.thin,
            node: v.node.clone(),
            pool: v.pool.clone(),
            state: match v.state {
                VolumeState::Creating => "creating",
                VolumeState::Ready => "ready",
            }
            .into(),
            hosts: v.hosts.clone(),
            readonly_hosts: v.readonly_hosts.clone(),
            subsystem_nqn: v.subsystem_nqn.clone(),
            uuid: v.uuid.clone(),
            nguid: v.nguid.clone(),
            allocated_bytes: allocated,
            locality: locality_to(v.locality) as i32,
            host_node: v.host_node.clone(),
            include_nodes: v.include.clone(),
            exclude_nodes: v.exclude.clone(),
            access_policy: policy_to(v.access_policy) as i32,
            group: v.group.clone(),
            qos: Some(v.qos.into()),
            io: st.nodes.get(&v.node).and_then(|n| n.io.volume(&v.subsystem_nqn)),
            attachments: v
                .hosts
                .iter()
                .map(|h| proto::Attachment { host_nqn: h.clone(), paths: self.paths_proto(st, v, h), local: None })
                .chain(v.local_hosts.iter().map(|h| proto::Attachment {
                    host_nqn: h.clone(),
                    paths: vec![],
                    local: Some(local_proto(v)),
                }))
                .collect(),
            degraded: match st.nodes.get(&v.node) {
                Some(n) if n.lost_copies.contains(&v.id) && v.migration.is_none() && v.replicas.is_empty() => {
                    format!(
                        "its only copy is gone from {} (the pool was made anew or lost it): restore that pool, or \
                         delete the volume",
                        v.node
                    )
                }
                Some(n) if self.healthy(n) => String::new(),
                _ if !v.replicas.is_empty() => format!("its serving node {} is down", v.node),
                _ => format!("its owner {} is down and holds the only copy of its data", v.node),
            },
            migration: v
                .migration
                .as_ref()
                .map(|m| {
                    let p = st.progress.get(&v.name).cloned().unwrap_or_default();
                    proto::Migration {
                        from_node: m.from_node.clone(),
                        to_node: m.to_node.clone(),
                        to_pool: m.to_pool.clone(),
                        phase: match m.phase {
                            MigrationPhase::Preparing => "preparing",
                            MigrationPhase::Copying => "copying",
                            MigrationPhase::Switching => "switching",
                            MigrationPhase::Retiring => "retiring",
                        }
                        .into(),
                        round: p.engine.round,
                        copied_bytes: p.engine.copied_bytes,
                        dirty_bytes: p.engine.dirty_bytes,
                        allocated_bytes: p.engine.allocated_bytes,
                        rate: p.engine.rate,
                        round_bytes: p.engine.round_bytes,
                        pause_us: p.engine.pause_us,
                        started_ms_ago: now_ms().saturating_sub(m.started_ms),
                        waiting: p.waiting,
                    }
                })
                .or_else(|| v.replica_move().map(|r| replica_moves::move_proto(st, v, r))),
            last_migration: v.last_migration.clone(),
            pinned: v.pinned,
            awaiting_home: v.awaiting_home,
            replica_count: v.replica_count() as u32,
            generation: v.generation,
            replicas: replicas_proto(st, v),
            from_snapshot: v.source.as_ref().map(|s| s.snapshot.clone()).unwrap_or_default(),
            clone_of: v.source.as_ref().map(|s| s.volume.clone()).unwrap_or_default(),
            snapshots: super::snapshots::snapshots_of(st, v),
        }
    }

    /// A host's paths to a volume, the optimized one first; a migration's target last
    /// (inaccessible until the switch), so hosts connect it beforehand.
    pub(super) fn paths_proto(&self, st: &State, v: &VolumeRecord, host: &str) -> Vec<proto::Path> {
        let target = v.migration_path().map(String::from);
        v.paths_of(host)
            .iter()
            .chain(target.as_ref())
            .enumerate()
            .map(|(i, node)| {
                let entry = st.nodes.get(node);
                let (transport, address, port) =
                    entry.map(|n| split_address(&n.record.nvme_address)).unwrap_or(("tcp", String::new(), 0));
                proto::Path {
                    node: node.clone(),
                    transport: transport.into(),
                    address,
                    port,
                    ana_state: match v.migration.as_ref() {
                        Some(m) if Some(node) == target.as_ref() && m.phase == MigrationPhase::Retiring => {
                            "non-optimized"
                        }
                        Some(_) if Some(node) == target.as_ref() => "inaccessible",
                        _ => ana_state(i),
                    }
                    .into(),
                    owner: *node == v.node,
                    healthy: entry.is_some_and(|n| self.healthy(n)),
                }
            })
            .collect()
    }
}

/// The ANA state of the path at this place in an attachment's list.
pub(super) fn ana_state(place: usize) -> &'static str {
    if place == 0 { "optimized" } else { "non-optimized" }
}

pub(super) fn policy_from(v: i32) -> Result<AccessPolicy, Status> {
    match proto::AccessPolicy::try_from(v) {
        Ok(proto::AccessPolicy::Inherit) => Ok(AccessPolicy::Inherit),
        Ok(proto::AccessPolicy::Balance) => Ok(AccessPolicy::Balance),
        Err(_) => {
            Err(Status::invalid_argument(format!("access policy {v} does not exist: use inherit (0) or balance (1)")))
        }
    }
}

pub(super) fn policy_to(p: AccessPolicy) -> proto::AccessPolicy {
    match p {
        AccessPolicy::Inherit => proto::AccessPolicy::Inherit,
        AccessPolicy::Balance => proto::AccessPolicy::Balance,
    }
}

pub(super) fn corrupt(e: serde_json::Error) -> Status {
    Status::data_loss(format!("a record in the controller's store is damaged ({e}); restore the store from a backup"))
}

pub(super) fn no_volume(name: &str) -> Status {
    Status::not_found(format!("no volume {name}: `nvpool volume list` shows the volumes"))
}

/// Every replica of a replicated volume, the serving one first, with a rebuild's
/// progress as the serving engine last reported it; none for a volume of one.
fn replicas_proto(st: &State, v: &VolumeRecord) -> Vec<proto::Replica> {
    if v.replicas.is_empty() {
        return Vec::new();
    }
    let report = st.nodes.get(&v.node).and_then(|n| n.mirrors.get(&v.subsystem_nqn));
    let serving = proto::Replica {
        node: v.node.clone(),
        pool: v.pool.clone(),
        state: "in-sync".into(),
        serving: true,
        ..Default::default()
    };
    let others = v.replicas.iter().map(|r| {
        let rebuild = report
            .and_then(|m| m.rebuild.as_ref())
            .filter(|b| r.state == ReplicaState::CatchingUp && st.replica_leg(v, &r.node).as_deref() == Some(&b.leg));
        proto::Replica {
            node: r.node.clone(),
            pool: r.pool.clone(),
            state: match r.state {
                ReplicaState::InSync => "in-sync",
                ReplicaState::CatchingUp => "rebuilding",
                ReplicaState::Faulted => "faulted",
            }
            .into(),
            why: r.why.clone(),
            left_at: r.left_at,
            serving: false,
            rebuild_total_bytes: rebuild.map_or(0, |b| b.total_bytes),
            rebuild_copied_bytes: rebuild.map_or(0, |b| b.copied_bytes),
        }
    });
    std::iter::once(serving).chain(others).collect()
}

pub(super) fn same_request(v: &VolumeRecord, req: &proto::CreateVolumeRequest, locality: Locality) -> bool {
    v.size == req.size_bytes
        && v.thin == req.thin
        && v.locality == locality
        && v.host_node == req.host_node
        && v.include == req.include_nodes
        && v.exclude == req.exclude_nodes
        && policy_to(v.access_policy) as i32 == req.access_policy
        && v.group == req.group
        && v.qos == req.qos.unwrap_or_default().into()
        && v.replica_count() == req.replicas.max(1) as usize
}

pub(super) fn no_room_message(req: &Request, scores: &[Score], nodes: usize) -> String {
    if scores.is_empty() {
        return "no node has registered yet: start `nvpool agent` on the nodes".into();
    }
    let reasons: Vec<String> =
        scores.iter().take(8).map(|s| format!("{}: {}", s.node, s.filtered_out.as_deref().unwrap_or(""))).collect();
    format!(
        "no node can take a {} volume of {} bytes ({}{}); free space, add disks, or ask for less",
        if req.thin { "thin" } else { "thick" },
        req.size,
        reasons.join("; "),
        if nodes > 8 { format!("; and {} more nodes", nodes - 8) } else { String::new() }
    )
}

pub(super) fn locality_from(v: i32) -> Result<Locality, Status> {
    match proto::Locality::try_from(v) {
        Ok(proto::Locality::Any) => Ok(Locality::Any),
        Ok(proto::Locality::Local) => Ok(Locality::Local),
        Ok(proto::Locality::Remote) => Ok(Locality::Remote),
        Err(_) => Err(Status::invalid_argument(format!("locality {v} is not one of any (0), local (1) or remote (2)"))),
    }
}

pub(super) fn locality_to(l: Locality) -> proto::Locality {
    match l {
        Locality::Any => proto::Locality::Any,
        Locality::Local => proto::Locality::Local,
        Locality::Remote => proto::Locality::Remote,
    }
}

pub(super) fn score_proto(s: &Score) -> proto::NodeScore {
    proto::NodeScore {
        node: s.node.clone(),
        pool: s.pool.clone(),
        filtered_out: s.filtered_out.clone().unwrap_or_default(),
        locality_score: s.locality,
        space_score: s.space,
        total: s.total,
        used_ratio_after: s.used_ratio_after,
        reserve_score: s.reserve,
        reserved_bytes: s.reserved,
    }
}

pub(super) fn pool_record(p: &proto::PoolReport) -> PoolRecord {
    PoolRecord {
        name: p.name.clone(),
        capacity_bytes: p.capacity_bytes,
        used_bytes: p.used_bytes,
        provisioned_bytes: p.provisioned_bytes,
        cluster_size: p.cluster_size,
        volumes: p.volumes,
        failed: (!p.failed.is_empty()).then(|| p.failed.clone()),
        power_losses: p.power_losses,
        snapshot_bytes: p.snapshot_bytes,
    }
}

pub(super) fn pool_report(p: &PoolRecord) -> proto::PoolReport {
    proto::PoolReport {
        name: p.name.clone(),
        capacity_bytes: p.capacity_bytes,
        used_bytes: p.used_bytes,
        provisioned_bytes: p.provisioned_bytes,
        cluster_size: p.cluster_size,
        volumes: p.volumes,
        failed: p.failed.clone().unwrap_or_default(),
        power_losses: p.power_losses,
        snapshot_bytes: p.snapshot_bytes,
    }
}

/// A node's host address as a path names it: transport, IP and port.
pub(super) fn split_address(a: &str) -> (&'static str, String, u32) {
    match crate::model::host_address(a) {
        Some((transport, s)) => (transport, s.ip().to_string(), u32::from(s.port())),
        None => ("tcp", a.to_string(), 4420),
    }
}

/// The local device of a volume with local hosts, as reported: its device path is empty
/// until the owner's engine made it.
pub(super) fn local_proto(v: &VolumeRecord) -> proto::LocalDevice {
    proto::LocalDevice {
        node: v.node.clone(),
        kind: "ublk".into(),
        device: v.local_device.as_ref().map(|d| d.device.clone()).unwrap_or_default(),
    }
}

pub(super) fn dhchap_proto(d: &DhchapRecord) -> proto::DhchapSecrets {
    proto::DhchapSecrets { secret: d.secret.clone(), ctrl_secret: d.ctrl_secret.clone() }
}

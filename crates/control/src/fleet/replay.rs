//! The simulator's placements replayed through a real controller (`nvpool fleet
//! --replay SEED`): the simulator's nodes, with their disks, become simulated nodes;
//! its stream's creations and deletions are made one at a time; and every volume
//! must land where the simulator put it, with every node's room counted as the
//! simulator counts it. The scheduler is the same code in both: what this shows is
//! that the controller feeds it the same cluster (its views, ledgers, reports from
//! the nodes, and creations and removals under way) as the simulator's model.

use super::bench::StoreKind;
use super::plane::ControlPlane;
use super::{Fleet, SimPool};
use crate::client::Controllers;
use crate::proto;
use crate::scheduler::{self, Locality};
use crate::sim::{self, SimConfig, Step};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct ReplayConfig {
    /// The nvpool binary, which runs the controller.
    pub binary: std::path::PathBuf,
    /// Where the controller keeps its store and log.
    pub dir: std::path::PathBuf,
    pub nodes: usize,
    /// Most creations to replay (fewer if the pool fills first).
    pub volumes: usize,
    pub seed: u64,
}

pub struct ReplayReport {
    pub nodes: usize,
    pub nodes_with_disks: usize,
    pub creations: usize,
    pub deletions: usize,
    /// Whether the simulator's stream ended where a creation found no room.
    pub ended_full: bool,
    /// Share of the pool's bytes taken at the end.
    pub used_share: f64,
    pub local_creations: usize,
    pub seconds: f64,
}

/// How long the controller may take to count a deletion's room as free: the node
/// removes the volume, and reports its pool without it in a heartbeat.
const DELETION_PATIENCE: Duration = Duration::from_secs(10);

/// Replays the simulator's run of `cfg.seed` on `cfg.nodes` nodes through a
/// controller of its own (embedded store, rebalancer off: the simulator's run moves
/// nothing). Fails at the first volume the controller puts elsewhere than the
/// simulator, or the first node whose room it counts otherwise.
pub async fn replay(cfg: ReplayConfig) -> Result<ReplayReport, String> {
    let sim_cfg = SimConfig { nodes: cfg.nodes, seed: cfg.seed, ..SimConfig::default() };
    let placements = sim::placements(&sim_cfg, cfg.volumes);
    let plane = ControlPlane::start(&cfg.binary, &cfg.dir, StoreKind::Embedded, &["--rebalance-every", "0"]).await?;
    let controllers = Arc::new(Controllers::new(&plane.addresses())?);
    let cluster_size = |name: &str| placements.nodes.iter().find(|n| n.name == name).and_then(|n| n.pools.first());
    let fleet = Fleet::of(
        placements
            .nodes
            .iter()
            .map(|n| {
                let pool = n.pools.first().map(|p| SimPool { capacity: p.capacity, cluster_size: p.cluster_size });
                (n.name.clone(), pool)
            })
            .collect(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| e.to_string())?;
    let agent_address = listener.local_addr().map_err(|e| e.to_string())?.to_string();
    fleet.serve(listener);
    let interval = fleet.register_all(&controllers, &agent_address, 64).await?;
    fleet.heartbeat_forever(controllers.clone(), interval, cfg.nodes.div_ceil(100).max(1));

    let started = Instant::now();
    // What the simulator's model says each node's pool has taken, and each live
    // volume's ID and node.
    let mut committed: HashMap<String, u64> = HashMap::new();
    let mut live: HashMap<usize, (String, String, u64)> = HashMap::new();
    // Deleted volumes not yet confirmed gone from their nodes: (node, volume ID).
    let mut leaving: Vec<(String, String)> = Vec::new();
    let (mut creations, mut deletions, mut local_creations) = (0, 0, 0);
    for step in &placements.steps {
        match step {
            Step::Create { volume, size, locality, host, node } => {
                // The simulator counts a deletion's room free at once; the controller
                // once the node confirms it: the next placement waits for that.
                settle(&fleet, &controllers, &mut leaving, &committed).await?;
                let req = proto::CreateVolumeRequest {
                    name: format!("s{volume:06}"),
                    size_bytes: *size,
                    locality: locality_proto(*locality) as i32,
                    host_node: host.clone(),
                    ..Default::default()
                };
                let created = controllers
                    .call(async |mut c| c.create_volume(req.clone()).await)
                    .await
                    .map_err(|e| format!("creation {} of the replay ({}): {}", creations + 1, req.name, e.message()))?;
                let placed = created.volume.unwrap_or_default();
                if placed.node != *node {
                    return Err(format!(
                        "creation {} of the replay ({}, {size} bytes, {locality:?} to {host}): the controller put it \
                         on {}, the simulator on {node}",
                        creations + 1,
                        req.name,
                        placed.node
                    ));
                }
                let pool = cluster_size(node).map_or(1, |p| p.cluster_size);
                *committed.entry(node.clone()).or_default() += scheduler::thick_bytes(*size, pool);
                live.insert(*volume, (placed.id, node.clone(), *size));
                creations += 1;
                local_creations += usize::from(*locality == Locality::Local);
            }
            Step::Delete { volume } => {
                let (id, node, size) =
                    live.remove(volume).ok_or_else(|| format!("the replay deletes volume {volume} twice"))?;
                let name = proto::VolumeName { name: format!("s{volume:06}") };
                controllers
                    .call(async |mut c| c.delete_volume(name.clone()).await)
                    .await
                    .map_err(|e| format!("deleting {}: {}", name.name, e.message()))?;
                let pool = cluster_size(&node).map_or(1, |p| p.cluster_size);
                *committed.entry(node.clone()).or_default() -= scheduler::thick_bytes(size, pool);
                leaving.push((node, id));
                deletions += 1;
            }
        }
    }
    settle(&fleet, &controllers, &mut leaving, &committed).await?;
    // Every node's room as the simulator's model counts it.
    let every: BTreeSet<String> =
        placements.nodes.iter().filter(|n| !n.pools.is_empty()).map(|n| n.name.clone()).collect();
    let (taken, capacity) = counted(&controllers, &every, &committed).await?;
    Ok(ReplayReport {
        nodes: cfg.nodes,
        nodes_with_disks: every.len(),
        creations,
        deletions,
        ended_full: placements.ended_full,
        used_share: taken as f64 / capacity.max(1) as f64,
        local_creations,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn locality_proto(l: Locality) -> proto::Locality {
    match l {
        Locality::Any => proto::Locality::Any,
        Locality::Local => proto::Locality::Local,
        Locality::Remote => proto::Locality::Remote,
    }
}

/// Waits until the nodes of `leaving` removed those volumes and the controller
/// counts their room as the simulator does: each such node reports its pool at once
/// (as its next heartbeat would, a little later). Fails if one does not within
/// `DELETION_PATIENCE`.
async fn settle(
    fleet: &Arc<Fleet>,
    controllers: &Controllers,
    leaving: &mut Vec<(String, String)>,
    committed: &HashMap<String, u64>,
) -> Result<(), String> {
    let freed: BTreeSet<String> = leaving.iter().map(|(node, _)| node.clone()).collect();
    let deadline = Instant::now() + DELETION_PATIENCE;
    while !freed.is_empty() {
        let mut reported = BTreeSet::new();
        for (node, _) in leaving.extract_if(.., |(node, id)| !fleet.holds(node, id)) {
            if reported.insert(node.clone()) {
                fleet.send_heartbeat(controllers, &node).await;
            }
        }
        let check = counted(controllers, &freed, committed).await;
        if leaving.is_empty() && check.is_ok() {
            break;
        }
        if Instant::now() > deadline {
            return Err(match leaving.first() {
                Some((node, id)) => format!("node {node} still holds deleted volume {id} after {DELETION_PATIENCE:?}"),
                None => check.err().unwrap_or_default(),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Checks that the controller counts the room taken on each of `nodes` as the
/// simulator does; returns the bytes taken and the capacity of those nodes.
async fn counted(
    controllers: &Controllers,
    nodes: &BTreeSet<String>,
    committed: &HashMap<String, u64>,
) -> Result<(u64, u64), String> {
    let listed = controllers
        .call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await)
        .await
        .map_err(|e| format!("listing pools: {}", e.message()))?;
    let (mut taken, mut capacity) = (0, 0);
    for p in listed.pools.iter().filter(|p| nodes.contains(&p.node)) {
        let expected = committed.get(&p.node).copied().unwrap_or(0);
        if p.committed_bytes != expected {
            return Err(format!(
                "node {}: the controller counts {} bytes taken, the simulator {expected}",
                p.node, p.committed_bytes
            ));
        }
        taken += expected;
        capacity += p.pool.as_ref().map_or(0, |r| r.capacity_bytes);
    }
    Ok((taken, capacity))
}

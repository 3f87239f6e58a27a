//! Migrations: moving a volume's data to another node under running hosts.
//!
//! Each step is recorded in the store before it is taken, and a driver task per
//! volume takes the next step from what is recorded, so a controller that takes over
//! (or restarts) goes on where the last one stopped:
//!
//! - **preparing**: the target node makes a volume of the same size and identity and
//!   exports it under the volume's subsystem, inaccessible to the attached hosts (who
//!   connect it as one more path) and optimized for the owner's engine;
//! - **copying**: the owner's engine copies rounds to it (`migration_start`);
//! - **switching**, recorded once the first round is done and every attached host is
//!   connected to the new path: the owner's engine is allowed to switch. It holds the
//!   hosts' I/O, copies the rest, deletes its volume (the point of no return, durable
//!   on that node) and forwards everything to the target;
//! - **retiring**, recorded once the old owner says it switched (or has no volume any
//!   more): the record names the target as the owner, in one write. The target becomes
//!   each host's optimized path (an ANA change), access points forward to it, and the
//!   old node forwards too, as a non-optimized path; a few seconds later, once the
//!   hosts' I/O has left it, its export goes.
//!
//! Before the switch any failure (a node down, the target full, a cancel) rolls back:
//! the engine's copy is cancelled, the target's volume is removed (a tombstone), and
//! the volume stays where it was. Once the switch was allowed, only the old owner can
//! tell whether it happened (is its volume still there?), so the driver waits for it.

use crate::cluster::convert::{no_room_message, no_volume};
use crate::cluster::{Cluster, EXPLAINED_NODES, now_ms};
use crate::model::{MigrationPhase, MigrationRecord, TOMBSTONES, Tombstone, VOLUMES, VolumeRecord, to_json};
use crate::proto::agent_client::AgentClient;
use crate::scheduler::Request;
use crate::store::Txn;
use crate::{proto, scheduler};
use std::sync::Arc;
use std::time::Duration;
use tonic::Status;

/// How often a driver looks at its migration.
const STEP: Duration = Duration::from_millis(250);
/// How long the target may take to make and export the volume.
const PREPARE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the old owner stays after the switch, forwarding and inaccessible: time
/// for hosts to read the ANA change and finish what they sent it.
const RETIRE_AFTER: Duration = Duration::from_secs(3);

/// What a driver last heard of a migration, for `GetVolume`.
#[derive(Clone, Default)]
pub(super) struct Progress {
    pub engine: proto::MigrationReply,
    pub waiting: String,
}

/// What the driver does after a step.
enum Next {
    Again,
    Done,
}

impl Cluster {
    /// Records a migration and starts its driver.
    pub async fn migrate_volume(self: &Arc<Self>, req: &proto::MigrateVolumeRequest) -> Result<proto::Volume, Status> {
        let name = req.name.as_str();
        if req.auto != req.to_node.is_empty() {
            return Err(Status::invalid_argument(
                "name the node to move to (--to NODE), or let the scheduler pick (--auto)",
            ));
        }
        let guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if v.layered {
            return Err(Status::failed_precondition(layered_stays(&v)));
        }
        if !v.replicas.is_empty() {
            return self.move_replica(v, req).await;
        }
        if !req.from_node.is_empty() && req.from_node != v.node {
            return Err(Status::invalid_argument(format!(
                "volume {name} has one copy, on {}: `--from` names a replica of a replicated volume",
                v.node
            )));
        }
        if !v.local_hosts.is_empty() {
            return Err(Status::failed_precondition(format!(
                "volume {name} serves {} through a local device on {}: detach those hosts (they can attach over \
                 NVMe/TCP) before it moves",
                v.local_hosts.join(", "),
                v.node
            )));
        }
        if let Some(m) = &v.migration {
            return Err(Status::already_exists(format!(
                "volume {name} is already moving to {}: `nvpool volume get {name}` shows how far it is, \
                 `nvpool volume migrate {name} --cancel` stops it",
                m.to_node
            )));
        }
        let (to_node, to_pool) = {
            let mut st = self.state.lock().unwrap();
            if !req.to_node.is_empty() {
                if !st.nodes.contains_key(&req.to_node) {
                    return Err(Status::not_found(format!(
                        "unknown node {:?}: `nvpool node list` shows the nodes",
                        req.to_node
                    )));
                }
                if req.to_node == v.node {
                    return Err(Status::invalid_argument(format!("volume {name} is on {} already", v.node)));
                }
            }
            let mut exclude = v.exclude.clone();
            exclude.push(v.node.clone());
            let include = if req.to_node.is_empty() { v.include.clone() } else { vec![req.to_node.clone()] };
            let request = Request {
                size: v.size,
                thin: v.thin,
                locality: v.locality,
                host_node: v.host_node.clone(),
                include,
                exclude,
            };
            let views = self.node_views(&mut st);
            let scores = scheduler::place(&views, &request, &self.cfg.policy, EXPLAINED_NODES);
            self.cfg.metrics.placed("migration", scheduler::choice(&scores).is_some());
            let Some(chosen) = scheduler::choice(&scores) else {
                return Err(Status::resource_exhausted(format!(
                    "volume {name} cannot move: {}",
                    no_room_message(&request, &scores, views.len())
                )));
            };
            (chosen.node.clone(), chosen.pool.clone())
        };
        if self.state.lock().unwrap().tombstones.contains_key(&leftover_id(&v, &to_node)) {
            return Err(Status::unavailable(format!(
                "the copy an earlier move of {name} left on {to_node} is still being removed; retry in a moment"
            )));
        }
        let mut moving = v.clone();
        // The target is no access point while it fills: hosts that used it as one go
        // through the others meanwhile.
        for paths in moving.paths.values_mut() {
            paths.retain(|n| *n != to_node);
        }
        moving.migration = Some(MigrationRecord {
            from_node: v.node.clone(),
            to_node: to_node.clone(),
            to_pool,
            phase: MigrationPhase::Preparing,
            rate: req.rate,
            pause_ms: if req.pause_ms == 0 { 100 } else { req.pause_ms },
            started_ms: now_ms(),
            switched_ms: 0,
        });
        self.put_volume(&moving).await?;
        drop(guard);
        tracing::info!(volume = name, from = %v.node, to = %to_node, "migration recorded");
        self.start_driver(name);
        Ok(self.volume_proto(&moving))
    }

    /// Stops a migration before its switch; the volume stays where it was.
    pub async fn cancel_migration(self: &Arc<Self>, name: &str) -> Result<proto::Volume, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let v = self.state.lock().unwrap().volumes.get(name).cloned().ok_or_else(|| no_volume(name))?;
        let Some(m) = v.migration.clone() else {
            return self.cancel_replica_move(v).await;
        };
        if matches!(m.phase, MigrationPhase::Switching | MigrationPhase::Retiring) {
            return Err(Status::failed_precondition(format!(
                "volume {name} is switching to {}: that cannot be stopped; it ends in a moment",
                m.to_node
            )));
        }
        self.roll_back(&v, &m, "cancelled").await?;
        let back = self.state.lock().unwrap().volumes[name].clone();
        Ok(self.volume_proto(&back))
    }

    /// Starts the driver of a volume's migration unless one runs.
    pub(super) fn start_driver(self: &Arc<Self>, name: &str) {
        if !self.state.lock().unwrap().driving.insert(name.to_string()) {
            return;
        }
        let me = self.clone();
        let name = name.to_string();
        tokio::spawn(async move {
            loop {
                let next = {
                    let _guard = me.volume_locks.lock(&name).await;
                    me.step(&name).await
                };
                match next {
                    Next::Again => tokio::time::sleep(STEP).await,
                    Next::Done => break,
                }
            }
            let mut st = me.state.lock().unwrap();
            st.driving.remove(&name);
            st.progress.remove(&name);
        });
    }

    /// Takes the next step of a volume's migration, as recorded.
    async fn step(&self, name: &str) -> Next {
        let Some(v) = self.state.lock().unwrap().volumes.get(name).cloned() else { return Next::Done };
        let Some(m) = v.migration.clone() else { return Next::Done };
        let outcome = match m.phase {
            MigrationPhase::Preparing => self.prepare(&v, &m).await,
            MigrationPhase::Copying => self.copying(&v, &m).await,
            MigrationPhase::Switching => self.switching(&v, &m).await,
            MigrationPhase::Retiring => self.retire(&v, &m).await,
        };
        match outcome {
            Ok(next) => next,
            Err(why) => {
                tracing::warn!(volume = name, "migration failed: {why}");
                match self.roll_back(&v, &m, &why).await {
                    Ok(()) => Next::Done,
                    // The store is away: try again on the next step.
                    Err(_) => Next::Again,
                }
            }
        }
    }

    fn set_progress(&self, name: &str, engine: Option<proto::MigrationReply>, waiting: impl Into<String>) {
        let mut st = self.state.lock().unwrap();
        let p = st.progress.entry(name.to_string()).or_default();
        if let Some(e) = engine {
            p.engine = e;
        }
        p.waiting = waiting.into();
    }

    async fn record_phase(&self, v: &VolumeRecord, m: &MigrationRecord, phase: MigrationPhase) -> Result<Next, String> {
        let mut next = v.clone();
        next.migration = Some(MigrationRecord { phase, ..m.clone() });
        self.put_volume(&next).await.map_err(|e| e.message().to_string())?;
        tracing::info!(volume = %v.name, ?phase, "migration phase recorded");
        Ok(Next::Again)
    }

    /// The target makes and exports the volume.
    async fn prepare(&self, v: &VolumeRecord, m: &MigrationRecord) -> Result<Next, String> {
        self.check_nodes(v, m)?;
        match self.apply_node(&m.to_node).await {
            Ok(results) => match results.get(&v.id) {
                Some(r) if r.error.is_empty() => return self.record_phase(v, m, MigrationPhase::Copying).await,
                Some(r) => return Err(format!("node {} could not make the target volume: {}", m.to_node, r.error)),
                None => {}
            },
            Err(e) => self.set_progress(&v.name, None, format!("node {} does not answer: {e}", m.to_node)),
        }
        if Duration::from_millis(now_ms().saturating_sub(m.started_ms)) > PREPARE_TIMEOUT {
            return Err(format!("node {} did not make the target volume within {PREPARE_TIMEOUT:?}", m.to_node));
        }
        Ok(Next::Again)
    }

    /// The owner's engine copies; the switch is allowed once the first round is done
    /// and every attached host is connected to the new path.
    async fn copying(&self, v: &VolumeRecord, m: &MigrationRecord) -> Result<Next, String> {
        self.check_nodes(v, m)?;
        let status = match self.engine_migration(v, "status", m).await {
            Ok(s) => s,
            Err(e) => {
                self.set_progress(&v.name, None, format!("node {} does not answer: {e}", v.node));
                return Ok(Next::Again);
            }
        };
        // What the engine reports of an earlier migration is no answer about this one.
        let state = if status.id == migration_id(m) { status.state.as_str() } else { "none" };
        match state {
            "none" | "cancelled" | "failed" if !status.volume_here => {
                return Err(format!("node {} no longer has the volume", v.node));
            }
            "none" | "cancelled" => {
                if let Err(why) = self.owner_serves(v).await {
                    self.set_progress(&v.name, None, why);
                    return Ok(Next::Again);
                }
                let started = self
                    .engine_migration(v, "start", m)
                    .await
                    .map_err(|e| format!("the copy to {} could not start: {e}", m.to_node))?;
                self.set_progress(&v.name, Some(started), "");
            }
            "failed" => return Err(format!("the copy failed: {}", status.error)),
            _ => {
                let first_round_done = !status.round_bytes.is_empty();
                // Refresh which hosts are connected to the target.
                let _ = self.apply_node(&m.to_node).await;
                let missing: Vec<String> = {
                    let st = self.state.lock().unwrap();
                    let connected = st.nodes.get(&m.to_node).and_then(|n| n.connected.get(&v.id));
                    v.hosts.iter().filter(|h| !connected.is_some_and(|c| c.contains(h))).cloned().collect()
                };
                let waiting = match (first_round_done, missing.is_empty()) {
                    (false, _) => String::new(),
                    (true, false) => format!(
                        "host {} has not connected to the new path through {} (its NVMe/TCP address in \
                         `nvpool volume get {}`)",
                        missing.join(", "),
                        m.to_node,
                        v.name
                    ),
                    (true, true) => {
                        self.set_progress(&v.name, Some(status), "");
                        return self.record_phase(v, m, MigrationPhase::Switching).await;
                    }
                };
                self.set_progress(&v.name, Some(status), waiting);
            }
        }
        Ok(Next::Again)
    }

    /// The switch is allowed: wait for it, and only the old owner can say it happened.
    async fn switching(&self, v: &VolumeRecord, m: &MigrationRecord) -> Result<Next, String> {
        let status = match self.engine_migration(v, "status", m).await {
            Ok(s) => s,
            Err(e) => {
                let why = format!(
                    "node {} does not answer ({e}); only it can tell whether the switch happened: waiting for it",
                    v.node
                );
                self.set_progress(&v.name, None, why);
                return Ok(Next::Again);
            }
        };
        let state = if status.id == migration_id(m) { status.state.as_str() } else { "none" };
        match state {
            "switched" => return self.record_switch(v, m, &status).await,
            // The old owner's engine restarted after the point of no return.
            _ if !status.volume_here => return self.record_switch(v, m, &status).await,
            "none" | "cancelled" => {
                // The engine restarted before the switch: copy again, then switch.
                if let Err(why) = self.owner_serves(v).await {
                    self.set_progress(&v.name, None, why);
                    return Ok(Next::Again);
                }
                let started = self.engine_migration(v, "start", m).await?;
                self.set_progress(&v.name, Some(started), "");
            }
            "failed" => return Err(format!("the copy failed: {}", status.error)),
            _ if !status.switch_requested => {
                let asked = self.engine_migration(v, "switch", m).await?;
                self.set_progress(&v.name, Some(asked), "");
            }
            _ => self.set_progress(&v.name, Some(status), ""),
        }
        Ok(Next::Again)
    }

    /// Whether the owner's engine exports the volume (its agent applied the volume's
    /// entry without error): a copy starts only from the export, whose writes it
    /// tracks. After an engine restart the agent exports it again first.
    async fn owner_serves(&self, v: &VolumeRecord) -> Result<(), String> {
        let waiting = |why: String| format!("waiting for node {} to serve the volume again: {why}", v.node);
        match self.apply_node(&v.node).await.map_err(waiting)?.get(&v.id) {
            Some(r) if r.error.is_empty() => Ok(()),
            Some(r) => Err(waiting(r.error.clone())),
            None => Err(waiting("its agent did not report it".into())),
        }
    }

    /// Fails a migration before its switch when a node it needs is down.
    fn check_nodes(&self, v: &VolumeRecord, m: &MigrationRecord) -> Result<(), String> {
        let st = self.state.lock().unwrap();
        for (node, role) in [(&v.node, "the volume's node"), (&m.to_node, "the target node")] {
            if !st.nodes.get(node).is_some_and(|n| self.heartbeating(n)) {
                return Err(format!("{role} {node} is down"));
            }
        }
        Ok(())
    }

    /// The namespace the owner's engine copies to: the volume's on the target node,
    /// where other engines reach that node.
    fn target_of(&self, v: &VolumeRecord, m: &MigrationRecord) -> Result<String, String> {
        let st = self.state.lock().unwrap();
        let to = st.nodes.get(&m.to_node).ok_or_else(|| format!("unknown node {}", m.to_node))?;
        Ok(format!("{}/{}/1", to.record.peer(), v.subsystem_nqn))
    }

    /// Asks the owner's agent to start, read, switch or cancel the engine's migration.
    async fn engine_migration(
        &self,
        v: &VolumeRecord,
        action: &str,
        m: &MigrationRecord,
    ) -> Result<proto::MigrationReply, String> {
        let target = self.target_of(v, m)?;
        let address = {
            let st = self.state.lock().unwrap();
            st.nodes.get(&v.node).ok_or_else(|| format!("unknown node {}", v.node))?.record.agent_address.clone()
        };
        let request = proto::MigrationRequest {
            id: migration_id(m),
            action: action.into(),
            pool: v.pool.clone(),
            engine_name: v.engine_name.clone(),
            target,
            rate: m.rate,
            pause_ms: m.pause_ms,
        };
        let mut client = AgentClient::new(self.channel(&address)?);
        tokio::time::timeout(self.cfg.apply_timeout, client.migration(request))
            .await
            .map_err(|_| format!("agent at {address} took longer than {:?}", self.cfg.apply_timeout))?
            .map(|r| r.into_inner())
            .map_err(|e| format!("agent at {address}: {}", e.message()))
    }

    /// The switch happened: the target owns the volume, in one write; then the nodes
    /// follow, the new owner first (hosts' optimized path), then the access points
    /// (forwarding to it), then the old owner, which retires as a non-optimized path.
    async fn record_switch(
        &self,
        v: &VolumeRecord,
        m: &MigrationRecord,
        engine: &proto::MigrationReply,
    ) -> Result<Next, String> {
        let from = v.node.clone();
        let mut moved = v.clone();
        moved.node = m.to_node.clone();
        moved.pool = m.to_pool.clone();
        // Wherever it went, it was moved there on purpose: the rebalancer leaves it.
        moved.awaiting_home = false;
        moved.migration = Some(MigrationRecord { phase: MigrationPhase::Retiring, switched_ms: now_ms(), ..m.clone() });
        for paths in moved.paths.values_mut() {
            let rest: Vec<String> = paths.iter().filter(|n| **n != from && **n != m.to_node).cloned().collect();
            *paths = std::iter::once(m.to_node.clone()).chain(rest).collect();
        }
        let secs = now_ms().saturating_sub(m.started_ms) as f64 / 1000.0;
        let mib = |b: u64| format!("{:.1}", b as f64 / (1u64 << 20) as f64);
        let mut rounds: Vec<String> = engine.round_bytes.iter().take(12).map(|&b| mib(b)).collect();
        if engine.round_bytes.len() > 12 {
            rounds.push(format!("... {}", mib(*engine.round_bytes.last().unwrap_or(&0))));
        }
        moved.last_migration = if engine.round == 0 {
            // The old owner's engine restarted after the switch: its figures went with it.
            format!(
                "moved from {from} to {} in {secs:.1} s (the copy's figures went with {from}'s engine, which restarted after the switch)",
                m.to_node
            )
        } else {
            format!(
                "moved from {from} to {} in {secs:.1} s: {} rounds ({} MiB), {} MiB copied, I/O paused {:.1} ms",
                m.to_node,
                engine.round,
                rounds.join(", "),
                mib(engine.copied_bytes),
                engine.pause_us as f64 / 1000.0
            )
        };
        self.put_volume(&moved).await.map_err(|e| e.message().to_string())?;
        tracing::info!(volume = %v.name, "{}", moved.last_migration);
        let mut order = vec![m.to_node.clone()];
        order.extend(moved.exporting_nodes().into_iter().filter(|n| *n != m.to_node && *n != from));
        order.push(from);
        for node in order {
            let _ = self.apply_node(&node).await;
        }
        Ok(Next::Again)
    }

    /// The old owner retires once hosts have had the time to take the ANA change and
    /// finish the I/O they sent it: then its export goes.
    async fn retire(&self, v: &VolumeRecord, m: &MigrationRecord) -> Result<Next, String> {
        if Duration::from_millis(now_ms().saturating_sub(m.switched_ms)) < RETIRE_AFTER {
            self.set_progress(&v.name, None, format!("the old owner {} retires", m.from_node));
            return Ok(Next::Again);
        }
        let mut done = v.clone();
        done.migration = None;
        // Another node takes the old owner's place among each host's paths, where one
        // can: chosen while the old owner still retires, so that it is not the one.
        {
            let st = self.state.lock().unwrap();
            for (host, paths) in &mut done.paths {
                if let Ok(choice) = self.choose_paths(&st, v, host, paths, None, false) {
                    *paths = choice.paths;
                }
            }
        }
        self.put_volume(&done).await.map_err(|e| e.message().to_string())?;
        for node in done.exporting_nodes().into_iter().chain([m.from_node.clone()]) {
            let _ = self.apply_node(&node).await;
        }
        Ok(Next::Done)
    }

    /// Ends a migration before its switch: the engine stops copying, the target's
    /// volume goes (a tombstone), the volume stays where it was.
    pub(super) async fn roll_back(&self, v: &VolumeRecord, m: &MigrationRecord, why: &str) -> Result<(), Status> {
        if let Err(e) = self.engine_migration(v, "cancel", m).await {
            // The copy fails by itself once the target's volume is gone.
            tracing::warn!(volume = %v.name, "could not cancel the copy on {}: {e}", v.node);
        }
        let mut back = v.clone();
        back.migration = None;
        back.last_migration = if why == "cancelled" {
            format!("the move to {} was cancelled; the volume stays on {}", m.to_node, v.node)
        } else {
            format!("the move to {} failed: {why}; the volume stays on {}", m.to_node, v.node)
        };
        let tomb = Tombstone {
            id: leftover_id(v, &m.to_node),
            node: m.to_node.clone(),
            pool: m.to_pool.clone(),
            engine_name: v.engine_name.clone(),
            subsystem_nqn: v.subsystem_nqn.clone(),
            size: v.size,
            thin: v.thin,
        };
        self.commit(
            Txn::default()
                .put(format!("{VOLUMES}{}", back.name), to_json(&back))
                .put(format!("{TOMBSTONES}{}", tomb.id), to_json(&tomb)),
        )
        .await?;
        {
            let mut st = self.state.lock().unwrap();
            st.volumes.insert(back.name.clone(), back.clone());
            st.tombstones.insert(tomb.id.clone(), tomb);
            for node in back.exporting_nodes().into_iter().chain([m.to_node.clone()]) {
                st.touch(&node);
            }
        }
        tracing::info!(volume = %v.name, "{}", back.last_migration);
        let _ = self.apply_node(&m.to_node).await;
        Ok(())
    }
}

/// The name the engine knows a migration by: one per recorded migration.
fn migration_id(m: &MigrationRecord) -> String {
    format!("{}@{}", m.to_node, m.started_ms)
}

/// The tombstone of the copy a migration that did not switch left on `node`.
fn leftover_id(v: &VolumeRecord, node: &str) -> String {
    format!("{}@{node}", v.id)
}

/// Why a volume that lies over a snapshot does not move, and what to do.
pub(super) fn layered_stays(v: &VolumeRecord) -> String {
    let over = match &v.source {
        Some(s) if s.hidden() => format!("is a clone of volume {}", s.volume),
        Some(s) => format!("is a clone of snapshot {}", s.snapshot),
        None => "has snapshots (or had: one deleted stays, hidden, while the volume reads from it)".to_string(),
    };
    format!(
        "volume {} {over}: its data is in more than its own pool volume, and moving a volume with its \
         snapshots is not built yet, so it stays on {}; `nvpool volume inflate {}` makes it hold all its data \
         itself, and then it moves (its snapshots stay on {})",
        v.name, v.node, v.name, v.node
    )
}

//! Volumes: creation (placement, then the node's confirmation), resizing, deletion,
//! attachment.

use crate::cluster::convert::{
    corrupt, dhchap_proto, local_proto, locality_from, no_room_message, no_volume, policy_from, same_request,
    score_proto,
};
use crate::cluster::{Cluster, EXPLAINED_NODES, Results, State};
use crate::model::{
    DhchapRecord, MAX_VOLUME_SIZE, MigrationPhase, ReplicaRecord, ReplicaState, TOMBSTONES, Tombstone,
    VOLUME_NQN_PREFIX, VOLUMES, VolumeRecord, VolumeState, check_host_nqn, check_name, to_json,
};
use crate::scheduler::{Locality, Request, Score};
use crate::store::{Condition, Txn};
use crate::{access, proto, scheduler};
use nvpool_api::QosLimits;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use tonic::Status;

impl Cluster {
    pub async fn create_volume(&self, req: &proto::CreateVolumeRequest) -> Result<proto::CreateVolumeResponse, Status> {
        check_name("volume", &req.name).map_err(Status::invalid_argument)?;
        if !req.from_snapshot.is_empty() || !req.clone_of.is_empty() {
            return self.create_clone(req).await;
        }
        if req.size_bytes == 0 {
            return Err(Status::invalid_argument("volume size must be more than 0 bytes"));
        }
        if req.size_bytes > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {} bytes is more than the largest volume nvpool makes (1 PiB)",
                req.size_bytes
            )));
        }
        if req.replicas > 3 {
            return Err(Status::invalid_argument(format!(
                "{} replicas asked for: a volume has 1 to 3 (each on its own node)",
                req.replicas
            )));
        }
        let replica_count = req.replicas.max(1) as usize;
        let locality = locality_from(req.locality)?;
        let access_policy = policy_from(req.access_policy)?;
        if !req.group.is_empty() {
            check_name("volume group", &req.group).map_err(Status::invalid_argument)?;
        }
        if locality != Locality::Any && req.host_node.is_empty() {
            return Err(Status::invalid_argument("a local or remote preference needs the host node it is relative to"));
        }
        {
            let st = self.state.lock().unwrap();
            let named = std::iter::once(&req.host_node).filter(|n| !n.is_empty());
            for n in named.chain(&req.include_nodes).chain(&req.exclude_nodes) {
                if !st.nodes.contains_key(n) {
                    return Err(Status::not_found(format!("unknown node {n:?}: `nvpool node list` shows the nodes")));
                }
            }
        }
        let _guard = self.volume_locks.lock(&req.name).await;
        let existing = self.state.lock().unwrap().volumes.get(&req.name).cloned();
        if let Some(v) = existing {
            return self.create_again(&v, req, locality).await;
        }

        let request = Request {
            size: req.size_bytes,
            thin: req.thin,
            locality,
            host_node: req.host_node.clone(),
            include: req.include_nodes.clone(),
            exclude: req.exclude_nodes.clone(),
        };
        let id = uuid::Uuid::new_v4().to_string();
        let (record, scores) = {
            let mut st = self.state.lock().unwrap();
            let views = self.node_views(&mut st);
            let scores = scheduler::place(&views, &request, &self.cfg.policy, EXPLAINED_NODES);
            self.cfg.metrics.placed("volume", scheduler::choice(&scores).is_some());
            let Some(chosen) = scheduler::choice(&scores) else {
                let message = no_room_message(&request, &scores, views.len());
                return Err(Status::resource_exhausted(match self.want_hole(&mut st, &views, &request) {
                    Some(node) => format!(
                        "{message}; the rebalancer is making room on {node} by moving other volumes: \
                         retry in a minute"
                    ),
                    None => message,
                }));
            };
            let replicas =
                match self.place_replicas(&st, &views, &request, std::slice::from_ref(&chosen.node), replica_count - 1)
                {
                    Ok(placed) => placed,
                    Err(e) => return Err(Status::resource_exhausted(format!("volume {}: {e}", req.name))),
                };
            // Replicas take the volume's identity from the controller, all the same one.
            let (uuid, nguid) = if replicas.is_empty() { Default::default() } else { super::replicas::new_identity() };
            let record = VolumeRecord {
                uuid,
                nguid,
                locality,
                awaiting_home: locality == Locality::Local
                    && chosen.node != req.host_node
                    && views.iter().any(|n| n.name == req.host_node && !n.pools.is_empty()),
                generation: if replicas.is_empty() { 0 } else { 1 },
                serving_power_losses: crate::cluster::replicas::power_losses(&st, &chosen.node, &chosen.pool),
                replicas: replicas
                    .iter()
                    .map(|(node, pool)| ReplicaRecord {
                        power_losses: crate::cluster::replicas::power_losses(&st, node, pool),
                        ..ReplicaRecord::new(node, pool)
                    })
                    .collect(),
                ..new_record(req, &id, &chosen.node, &chosen.pool, access_policy)
            };
            // Reserve the space now, so that concurrent creations see it taken.
            st.reserved.insert(record.name.clone(), record.clone());
            (record, scores)
        };
        let _reservation = Reservation { state: &self.state, name: &record.name };
        let key = format!("{VOLUMES}{}", record.name);
        let txn = Txn::default().when(Condition::Absent(key.clone())).put(key.clone(), to_json(&record));
        // An earlier call whose answer was lost (the store went away, or the caller
        // gave up) may have stored this name: that record stands.
        let earlier = match self.commit(txn).await {
            Ok(()) => None,
            Err(e) => {
                let Ok(Some(stored)) = self.store.get(&key).await else { return Err(e) };
                Some(serde_json::from_slice::<VolumeRecord>(&stored).map_err(corrupt)?)
            }
        };
        let stored = earlier.as_ref().unwrap_or(&record);
        {
            let mut st = self.state.lock().unwrap();
            st.reserved.remove(&record.name);
            st.volumes.insert(stored.name.clone(), stored.clone());
            st.touch(&stored.node);
        }
        match &earlier {
            Some(v) => self.create_again(v, req, locality).await,
            None => self.finish_create(&record, scores).await,
        }
    }

    /// A creation of a name that exists: the same request gets the volume (finished
    /// if an earlier call left it half made), another one a clear refusal.
    async fn create_again(
        &self,
        v: &VolumeRecord,
        req: &proto::CreateVolumeRequest,
        locality: Locality,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        if v.source.is_some() || !same_request(v, req, locality) {
            return Err(Status::already_exists(format!(
                "volume {} exists with size {} bytes, {}, locality {} to {:?}, include {:?}, exclude {:?}; \
                 delete it or use another name",
                v.name,
                v.size,
                if v.thin { "thin" } else { "thick" },
                v.locality,
                v.host_node,
                v.include,
                v.exclude
            )));
        }
        if v.state == VolumeState::Creating {
            return self.finish_create(v, Vec::new()).await;
        }
        Ok(proto::CreateVolumeResponse { volume: Some(self.volume_proto(v)), scores: vec![], existed: true })
    }

    /// Has the node's agent make a recorded volume, then reports the outcome.
    pub(super) async fn finish_create(
        &self,
        v: &VolumeRecord,
        scores: Vec<Score>,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        // A replicated volume: the replicas first, since the serving engine's mirror
        // connects to them; until they are exported (the background loop may apply
        // the serving node first) its creation fails for a while, and is tried again.
        let attempts = if v.replicas.is_empty() { 1 } else { 10 };
        let mut outcome = Err(String::new());
        for attempt in 0..attempts {
            if attempt > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            }
            for r in &v.replicas {
                if let Err(e) = self.apply_node(&r.node).await {
                    tracing::warn!(volume = v.name, node = r.node, "cannot make a replica yet: {e}");
                }
            }
            outcome = self.apply_node(&v.node).await;
            let ready =
                self.state.lock().unwrap().volumes.get(&v.name).is_some_and(|now| now.state == VolumeState::Ready);
            if ready || !matches!(&outcome, Ok(results) if results.get(&v.id).is_some_and(|r| !r.error.is_empty())) {
                break;
            }
        }
        if !v.replicas.is_empty()
            && let Ok(results) = &outcome
            && let Some(r) = results.get(&v.id).filter(|r| !r.error.is_empty())
        {
            // Never made: nothing of it stays on any node.
            let why = r.error.clone();
            self.bury(v).await?;
            return Err(Status::failed_precondition(format!(
                "node {} could not serve volume {} over its replicas: {why}; nothing was left behind, retry to \
                 place it again",
                v.node, v.name
            )));
        }
        let now = self.state.lock().unwrap().volumes.get(&v.name).cloned();
        match (now, outcome) {
            (Some(now), _) if now.id == v.id && now.state == VolumeState::Ready => Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_proto(&now)),
                scores: scores.iter().map(score_proto).collect(),
                existed: false,
            }),
            (_, Ok(results)) => {
                let why = results.get(&v.id).map(|r| r.error.clone()).unwrap_or_default();
                Err(Status::failed_precondition(format!(
                    "node {} could not create volume {}: {why}; nothing was left behind, retry to place it again",
                    v.node, v.name
                )))
            }
            (_, Err(e)) => {
                // The agent did not answer: give the volume up, so that a retry can place it elsewhere.
                self.bury(v).await?;
                Err(Status::unavailable(format!(
                    "node {} did not answer ({e}); volume {} was not created, retry to place it again",
                    v.node, v.name
                )))
            }
        }
    }

    /// Replaces a volume by a tombstone: the name is free at once, and the node
    /// removes the engine side when it can.
    pub(super) async fn bury(&self, v: &VolumeRecord) -> Result<(), Status> {
        let tombs = Tombstone::all_of(v);
        let mut txn = Txn::default().delete(format!("{VOLUMES}{}", v.name));
        for tomb in &tombs {
            txn = txn.put(format!("{TOMBSTONES}{}", tomb.id), to_json(tomb));
        }
        self.commit(txn).await?;
        let mut st = self.state.lock().unwrap();
        st.volumes.remove(&v.name);
        for tomb in tombs {
            st.tombstones.insert(tomb.id.clone(), tomb);
        }
        // The access points drop their exports with the volume.
        for node in v.exporting_nodes() {
            st.touch(&node);
        }
        Ok(())
    }

    pub async fn delete_volume(&self, name: &str) -> Result<bool, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let Some(mut v) = self.state.lock().unwrap().volumes.get(name).cloned() else {
            return Ok(false);
        };
        if let Some(m) = v.migration.clone() {
            if matches!(m.phase, MigrationPhase::Switching | MigrationPhase::Retiring) {
                return Err(Status::unavailable(format!(
                    "volume {name} is switching to {}; retry in a moment",
                    m.to_node
                )));
            }
            // Its move ends first: the target's copy goes with a tombstone of its own.
            self.roll_back(&v, &m, "cancelled").await?;
            v = self.state.lock().unwrap().volumes[name].clone();
        }
        self.bury(&v).await?;
        // The tombstone is durable; the background loop retries if the node is away.
        let _ = self.apply_node(&v.node).await;
        Ok(true)
    }

    pub async fn resize_volume(&self, name: &str, size: u64) -> Result<proto::Volume, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if let Some(m) = &v.migration {
            return Err(Status::failed_precondition(format!(
                "volume {name} is moving to {}: resize it once it is there, or cancel the move",
                m.to_node
            )));
        }
        if size <= v.size {
            return Ok(self.volume_proto(&v));
        }
        // Every replica grows with it: all must hold the writes so far (a rebuild copies
        // the size it started with).
        if let Some(r) = v.replicas.iter().find(|r| r.state != ReplicaState::InSync) {
            return Err(Status::failed_precondition(format!(
                "volume {name}'s replica on {} is not in sync ({:?}{}): grow it once every replica is",
                r.node,
                r.state,
                if r.why.is_empty() { String::new() } else { format!(": {}", r.why) }
            )));
        }
        if size > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {size} bytes is more than the largest volume nvpool makes (1 PiB)"
            )));
        }
        let holders: Vec<(String, String)> = std::iter::once((v.node.clone(), v.pool.clone()))
            .chain(v.replicas.iter().map(|r| (r.node.clone(), r.pool.clone())))
            .collect();
        for (node, pool_name) in &holders {
            let mut st = self.state.lock().unwrap();
            let views = self.node_views(&mut st);
            let pool =
                views.iter().find(|n| n.name == *node).and_then(|n| n.pools.iter().find(|p| p.name == *pool_name));
            let Some(pool) = pool else {
                return Err(Status::failed_precondition(format!(
                    "node {node} no longer reports pool {pool_name}; check the node with `nvpool node list`"
                )));
            };
            let room = if v.thin {
                let limit = (pool.capacity as f64 * self.cfg.policy.thin_overcommit) as u64;
                pool.provisioned + (size - v.size) <= limit
            } else {
                let extra =
                    scheduler::thick_bytes(size, pool.cluster_size) - scheduler::thick_bytes(v.size, pool.cluster_size);
                pool.committed + extra <= pool.capacity
            };
            if !room {
                return Err(Status::resource_exhausted(format!(
                    "pool {pool_name} on node {node} has no room to grow volume {} to {size} bytes; free space there \
                     or create a new volume",
                    v.name
                )));
            }
        }
        let grown = VolumeRecord { size, ..v.clone() };
        self.put_volume(&grown).await?;
        // The replicas first: the serving engine's mirror grows to what its legs hold.
        let mut replicas_grown = Ok(());
        for r in &v.replicas {
            let outcome = self.apply_node(&r.node).await;
            if !outcome.as_ref().is_ok_and(|results| results.get(&v.id).is_some_and(|r| r.error.is_empty())) {
                let why = match outcome {
                    Ok(results) => results.get(&v.id).map(|r| r.error.clone()).unwrap_or_default(),
                    Err(e) => format!("the node did not answer: {e}"),
                };
                replicas_grown = Err(format!("its replica on {} did not grow: {why}", r.node));
                break;
            }
        }
        if let Err(why) = replicas_grown {
            self.put_volume(&v).await?;
            return Err(Status::unavailable(format!(
                "volume {} could not grow: {why}; it keeps {} bytes, retry",
                v.name, v.size
            )));
        }
        match self.apply_node(&v.node).await {
            Ok(results) if results.get(&v.id).is_some_and(|r| r.error.is_empty()) => {
                // The hosts' other paths serve the new size once the serving node does:
                // their entries go again (unchanged since the replicas grew), and their
                // agents grow the namespaces that forward to it.
                for node in grown.exporting_nodes().into_iter().filter(|n| *n != v.node) {
                    {
                        let mut st = self.state.lock().unwrap();
                        if let Some(held) = st.nodes.get_mut(&node).and_then(|n| n.held.as_mut()) {
                            held.entries.remove(&v.id);
                        }
                        st.volumes.mark_changed(&node, &v.name);
                    }
                    if let Err(e) = self.apply_node(&node).await {
                        tracing::warn!(volume = name, node, "its path there serves the new size later: {e}");
                    }
                }
                Ok(self.volume_proto(&self.ready_volume(name)?))
            }
            outcome => {
                let why = match outcome {
                    Ok(r) => r.get(&v.id).map(|r| r.error.clone()).unwrap_or_default(),
                    Err(e) => format!("the node did not answer: {e}"),
                };
                self.put_volume(&v).await?;
                Err(Status::unavailable(format!(
                    "node {} could not grow volume {}: {why}; the volume keeps {} bytes, retry",
                    v.node, v.name, v.size
                )))
            }
        }
    }

    /// Sets a volume's I/O limits and has every node that serves it enforce them.
    pub async fn set_volume_qos(&self, name: &str, qos: QosLimits) -> Result<proto::Volume, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if v.qos == qos {
            return Ok(self.volume_proto(&v));
        }
        self.put_volume(&VolumeRecord { qos, ..v.clone() }).await?;
        let mut failed = Vec::new();
        for node in v.exporting_nodes() {
            let applied = match self.apply_node(&node).await {
                Ok(results) => results.get(&v.id).map_or(Ok(()), |r| match r.error.as_str() {
                    "" => Ok(()),
                    e => Err(e.to_string()),
                }),
                Err(e) => Err(format!("the node did not answer: {e}")),
            };
            if let Err(e) = applied {
                failed.push(format!("{node}: {e}"));
            }
        }
        if !failed.is_empty() {
            // The limits are recorded: each node takes them when it next applies its state.
            return Err(Status::unavailable(format!(
                "volume {name} has limits {} now, but not every node serving it took them yet ({}); they will as \
                 they come back, or retry",
                qos.describe(),
                failed.join("; ")
            )));
        }
        Ok(self.volume_proto(&self.ready_volume(name)?))
    }

    pub fn get_volume(&self, name: &str) -> Result<proto::Volume, Status> {
        let st = self.state.lock().unwrap();
        let v = st.volumes.get(name).ok_or_else(|| no_volume(name))?;
        Ok(self.volume_proto_locked(&st, v))
    }

    /// What the dashboard's summary counts of the volumes, from their records under
    /// one short hold of the state: only the moving volumes are put in their API
    /// form (every volume's took most of a second at 100,000, with the state held).
    pub fn volume_totals(&self) -> VolumeTotals {
        let st = self.state.lock().unwrap();
        let mut t = VolumeTotals { volumes: st.volumes.len(), ..VolumeTotals::default() };
        for v in st.volumes.values() {
            let state = match v.state {
                VolumeState::Creating => "creating",
                VolumeState::Ready => "ready",
            };
            *t.by_state.entry(state.to_string()).or_default() += 1;
            t.attachments += v.hosts.len() + v.local_hosts.len();
            if let Some(io) = st.nodes.get(&v.node).and_then(|n| n.io.volume(&v.subsystem_nqn)) {
                t.read_iops += io.read_iops;
                t.write_iops += io.write_iops;
                t.read_bytes_per_second += io.read_bytes_per_second;
                t.write_bytes_per_second += io.write_bytes_per_second;
            }
        }
        t.migrating = st.volumes.migrating().map(|v| self.volume_proto_locked(&st, v)).collect();
        t
    }

    /// Every volume, as lists search and sort them: enough to choose a page without
    /// building every volume's whole message (at 100,000 volumes that took a second).
    pub fn volume_briefs(&self) -> Vec<VolumeBrief> {
        let st = self.state.lock().unwrap();
        st.volumes
            .values()
            .map(|v| VolumeBrief {
                name: v.name.clone(),
                node: v.node.clone(),
                pool: v.pool.clone(),
                state: match v.state {
                    VolumeState::Creating => "creating",
                    VolumeState::Ready => "ready",
                },
                hosts: v.hosts.iter().chain(&v.local_hosts).cloned().collect(),
                size_bytes: v.size,
                io: st.nodes.get(&v.node).and_then(|n| n.io.volume(&v.subsystem_nqn)),
            })
            .collect()
    }

    /// The volumes of these names that exist, in the order given.
    pub fn volumes_named<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> Vec<proto::Volume> {
        let st = self.state.lock().unwrap();
        names.into_iter().filter_map(|name| st.volumes.get(name)).map(|v| self.volume_proto_locked(&st, v)).collect()
    }

    pub fn list_volumes(&self, node: &str) -> Vec<proto::Volume> {
        let st = self.state.lock().unwrap();
        st.volumes
            .values()
            .filter(|v| node.is_empty() || v.node == node || v.replica_on(node).is_some())
            .map(|v| self.volume_proto_locked(&st, v))
            .collect()
    }

    /// Allows a host on a volume through its access points (the owner and up to two
    /// engines that forward to it) and returns every path, the optimized one first.
    pub async fn attach(&self, req: &proto::AttachRequest) -> Result<proto::AttachResponse, Status> {
        let (volume, host, readonly) = (req.volume.as_str(), req.host_nqn.as_str(), req.readonly);
        check_host_nqn(host).map_err(Status::invalid_argument)?;
        let _guard = self.volume_locks.lock(volume).await;
        let v = self.ready_volume(volume)?;
        let attached_readonly = v.readonly_hosts.iter().any(|h| h == host);
        let attached = v.hosts.iter().chain(&v.local_hosts).any(|h| h == host);
        if attached && attached_readonly != readonly {
            return Err(Status::already_exists(format!(
                "volume {volume} is attached to {host} {}; detach it first to attach it {}",
                if attached_readonly { "read-only" } else { "read-write" },
                if readonly { "read-only" } else { "read-write" }
            )));
        }
        let mut local_fallback = String::new();
        if !req.local_node.is_empty() {
            match self.attach_local(&v, host, readonly, &req.local_node).await? {
                Ok(response) => return Ok(response),
                Err(why) => local_fallback = why,
            }
        }
        let v = self.ready_volume(volume)?;
        let current = v.paths.get(host).cloned().unwrap_or_default();
        let optimized = (!req.optimized_node.is_empty()).then_some(req.optimized_node.as_str());
        let choice = {
            let st = self.state.lock().unwrap();
            if let Some(node) = optimized {
                let why = match st.nodes.get(node) {
                    None => {
                        return Err(Status::not_found(format!(
                            "unknown node {node:?}: `nvpool node list` shows the nodes"
                        )));
                    }
                    Some(n) if !self.healthy(n) => "it is unhealthy",
                    Some(_) if v.exclude.iter().any(|e| e == node) => "the volume's placement excludes it",
                    Some(_) => "",
                };
                if !why.is_empty() {
                    return Err(Status::failed_precondition(format!(
                        "node {node} cannot be the optimized access point of volume {volume}: {why}; pick another \
                         node or leave the choice to the policy"
                    )));
                }
            }
            self.choose_paths(&st, &v, host, &current, optimized, req.explain).map_err(Status::unavailable)?
        };
        let mut with = v.clone();
        if !with.hosts.iter().any(|h| h == host) {
            with.hosts.push(host.to_string());
            if readonly {
                with.readonly_hosts.push(host.to_string());
            }
        }
        if req.dhchap && !with.dhchap.contains_key(host) {
            with.dhchap.insert(host.to_string(), DhchapRecord::generate());
        }
        with.paths.insert(host.to_string(), choice.paths.clone());
        let all_applied = {
            let st = self.state.lock().unwrap();
            choice.paths.iter().all(|n| st.nodes.get(n).is_some_and(|n| n.applied_generation == n.desired_generation))
        };
        if with != v || !all_applied {
            self.put_volume(&with).await?;
            // The owner first: it must allow the forwarding engines before they connect.
            let exported = |outcome: &Result<Results, String>| matches!(outcome, Ok(r) if r.get(&v.id).is_some_and(|r| r.error.is_empty()));
            if !exported(&self.apply_node(&v.node).await) {
                self.put_volume(&v).await?;
                return Err(Status::unavailable(format!(
                    "node {} did not export volume {volume} to {host}; nothing changed, retry when `nvpool node list` \
                     shows the node healthy",
                    v.node
                )));
            }
            let proxies: Vec<&String> = choice.paths.iter().filter(|n| **n != v.node).collect();
            let mut outcomes = Vec::with_capacity(proxies.len());
            for n in &proxies {
                outcomes.push(self.apply_node(n).await);
            }
            let failed: Vec<&String> =
                proxies.iter().zip(&outcomes).filter(|(_, o)| !exported(o)).map(|(n, _)| *n).collect();
            if !failed.is_empty() {
                // A path the host cannot use is worse than none: leave it out.
                tracing::warn!(volume, host, ?failed, "access points could not export the volume; left out");
                let mut fewer = self.ready_volume(volume)?;
                fewer
                    .paths
                    .insert(host.to_string(), choice.paths.iter().filter(|n| !failed.contains(n)).cloned().collect());
                self.put_volume(&fewer).await?;
            }
        }
        let v = self.ready_volume(volume)?;
        let st = self.state.lock().unwrap();
        Ok(proto::AttachResponse {
            subsystem_nqn: v.subsystem_nqn.clone(),
            nsid: 1,
            uuid: v.uuid.clone(),
            nguid: v.nguid.clone(),
            paths: self.paths_proto(&st, &v, host),
            explain: if req.explain { choice.explain } else { vec![] },
            local: None,
            local_fallback,
            dhchap: v.dhchap.get(host).map(dhchap_proto),
        })
    }

    /// Attaches a host on node `local_node` through a local device, where that node
    /// owns the volume and its engine can make one. `Ok(Err(why))`: it cannot, and the
    /// host is to get NVMe/TCP paths instead; nothing was changed.
    async fn attach_local(
        &self,
        v: &VolumeRecord,
        host: &str,
        readonly: bool,
        local_node: &str,
    ) -> Result<Result<proto::AttachResponse, String>, Status> {
        if !self.state.lock().unwrap().nodes.contains_key(local_node) {
            return Err(Status::not_found(format!("unknown node {local_node:?}: `nvpool node list` shows the nodes")));
        }
        let volume = v.name.as_str();
        if v.node != local_node {
            return Ok(Err(format!(
                "the data of volume {volume} is on node {}, not {local_node}: a local device serves only the \
                 owner's own containers",
                v.node
            )));
        }
        if v.hosts.iter().any(|h| h == host) {
            return Ok(Err(format!("{host} is attached over NVMe/TCP; detach it first to attach it locally")));
        }
        if let Some(m) = &v.migration {
            return Ok(Err(format!("volume {volume} is moving to {}", m.to_node)));
        }
        let mut with = v.clone();
        if !with.local_hosts.iter().any(|h| h == host) {
            with.local_hosts.push(host.to_string());
            if readonly {
                with.readonly_hosts.push(host.to_string());
            }
        }
        self.put_volume(&with).await?;
        let outcome = self.apply_node(&v.node).await;
        let made = match &outcome {
            Ok(r) => match r.get(&v.id) {
                Some(r) if r.error.is_empty() && r.local_error.is_empty() && !r.local_device.is_empty() => Ok(()),
                Some(r) if !r.error.is_empty() => Err(r.error.clone()),
                Some(r) if !r.local_error.is_empty() => Err(r.local_error.clone()),
                _ => Err("its engine did not report a device".to_string()),
            },
            Err(e) => Err(e.clone()),
        };
        if let Err(e) = made {
            // Back as it was (its engine drops a device it may have made).
            self.put_volume(v).await?;
            let _ = self.apply_node(&v.node).await;
            return Ok(Err(format!("node {} cannot serve a local device: {e}", v.node)));
        }
        let v = self.ready_volume(volume)?;
        Ok(Ok(proto::AttachResponse {
            subsystem_nqn: v.subsystem_nqn.clone(),
            nsid: 1,
            uuid: v.uuid.clone(),
            nguid: v.nguid.clone(),
            paths: vec![],
            explain: vec![],
            local: Some(local_proto(&v)),
            local_fallback: String::new(),
            dhchap: None,
        }))
    }

    /// Picks a host's access points to a volume, keeping the usable ones of `current`
    /// (and says why of every node if `explain`).
    pub(super) fn choose_paths(
        &self,
        st: &State,
        v: &VolumeRecord,
        host: &str,
        current: &[String],
        optimized: Option<&str>,
        explain: bool,
    ) -> Result<access::Choice, String> {
        let now = std::time::Instant::now();
        let candidates: Vec<access::Candidate> = st
            .nodes
            .values()
            .map(|n| access::Candidate {
                name: &n.record.name,
                // A lost owner stays a path: nothing else has the data, and the host
                // gets it back through that path when the node returns.
                healthy: self.healthy_at(n, now) || n.record.name == v.node,
                // The node a migration adds serves hosts only as the migration says.
                excluded: v.exclude.contains(&n.record.name) || v.migration_path() == Some(n.record.name.as_str()),
                cntlid_block: n.record.cntlid_block.unwrap_or(0),
            })
            .collect();
        debug_assert_eq!(
            st.volumes.path_loads,
            {
                let mut fresh = access::PathLoads::default();
                st.volumes.values().flat_map(super::attachments).for_each(|a| fresh.add(&a));
                fresh
            },
            "the kept path loads differ from the volumes'"
        );
        // The loads count the volume as it is held (`v` may be a copy with changes).
        let held = st.volumes.get(&v.name);
        let counted = held.and_then(|h| super::attachments(h).find(|a| a.host == host)).map_or(&[][..], |a| a.paths);
        let replicas: Vec<String> = v.replicas.iter().map(|r| r.node.clone()).collect();
        let request = access::AccessRequest {
            volume: &v.name,
            owner: &v.node,
            replicas: &replicas,
            host,
            policy: v.access_policy,
            group: &v.group,
            current,
            optimized,
            counted,
            explain,
        };
        access::choose(&candidates, &st.volumes.path_loads, &request)
    }

    /// Moves the paths of attachments that lost an access point: the optimized path
    /// goes to a surviving one (the host sees an ANA change) and another node takes
    /// the lost one's place where one can. When more nodes are healthy than at the
    /// last pass (a lost node came back, a node joined), attachments with fewer than
    /// three paths get more. Called by the background loop.
    pub(super) async fn repath_access_points(&self) {
        let due: Vec<(String, String)> = {
            let st = self.state.lock().unwrap();
            let now = std::time::Instant::now();
            let lost = |n: &String| st.nodes.get(n).is_none_or(|e| !self.healthy_at(e, now));
            // Only volumes that a lost node serves can have a lost path: found through
            // the index by node, so that a healthy cluster costs a pass over its nodes.
            let mut suspects = BTreeSet::new();
            for node in st.volumes.by_node.keys().filter(|n| lost(n)) {
                suspects.extend(st.volumes.of_node(node).map(|v| v.name.as_str()));
            }
            let healthy = st.nodes.values().filter(|n| self.healthy_at(n, now)).count();
            let more_nodes = healthy > self.healthy_nodes_seen.swap(healthy, std::sync::atomic::Ordering::Relaxed);
            let short = |paths: &Vec<String>| more_nodes && paths.len() < access::MAX_PATHS;
            if more_nodes {
                let short_of_paths = st.volumes.values().filter(|v| v.paths.values().any(short));
                suspects.extend(short_of_paths.map(|v| v.name.as_str()));
            }
            suspects
                .into_iter()
                .filter_map(|name| st.volumes.get(name))
                .filter(|v| v.state == VolumeState::Ready)
                .flat_map(|v| {
                    v.paths
                        .iter()
                        .filter(|(_, paths)| short(paths) || paths.iter().any(|n| *n != v.node && lost(n)))
                        .map(|(h, _)| (v.name.clone(), h.clone()))
                })
                .collect()
        };
        for (volume, host) in due {
            let _guard = self.volume_locks.lock(&volume).await;
            let Ok(v) = self.ready_volume(&volume) else { continue };
            let Some(current) = v.paths.get(&host).cloned() else { continue };
            let choice = {
                let st = self.state.lock().unwrap();
                self.choose_paths(&st, &v, &host, &current, None, false)
            };
            let Ok(choice) = choice else { continue };
            if choice.paths == current {
                continue;
            }
            let mut moved = v.clone();
            moved.paths.insert(host.clone(), choice.paths.clone());
            if self.put_volume(&moved).await.is_ok() {
                tracing::info!(volume, host, from = ?current, to = ?choice.paths, "re-pathed");
            }
        }
    }

    pub async fn detach(&self, volume: &str, host: &str) -> Result<(), Status> {
        let _guard = self.volume_locks.lock(volume).await;
        let Some(v) = self.state.lock().unwrap().volumes.get(volume).cloned() else {
            return Ok(());
        };
        if v.local_hosts.iter().any(|h| h == host) {
            let local_hosts: Vec<String> = v.local_hosts.iter().filter(|h| *h != host).cloned().collect();
            let without = VolumeRecord {
                readonly_hosts: v.readonly_hosts.iter().filter(|h| *h != host).cloned().collect(),
                local_device: if local_hosts.is_empty() { None } else { v.local_device.clone() },
                local_hosts,
                ..v.clone()
            };
            self.put_volume(&without).await?;
            return match self.apply_node(&v.node).await {
                Ok(r) if r.get(&v.id).is_none_or(|r| r.error.is_empty() && r.local_error.is_empty()) => Ok(()),
                _ => Err(Status::unavailable(format!(
                    "node {} has not yet removed the local device of volume {volume}; it will when it is back, \
                     retry to confirm",
                    v.node
                ))),
            };
        }
        if v.hosts.iter().any(|h| h == host) {
            let mut without = VolumeRecord {
                hosts: v.hosts.iter().filter(|h| *h != host).cloned().collect(),
                readonly_hosts: v.readonly_hosts.iter().filter(|h| *h != host).cloned().collect(),
                ..v.clone()
            };
            without.paths.remove(host);
            // Its secrets go: every access point forgets them with the host.
            without.dhchap.remove(host);
            self.put_volume(&without).await?;
        }
        let nodes = v.paths_of(host);
        let mut outcomes = Vec::with_capacity(nodes.len());
        for n in &nodes {
            outcomes.push(self.apply_node(n).await);
        }
        let behind: Vec<&String> = nodes
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| !matches!(o, Ok(r) if r.get(&v.id).is_none_or(|r| r.error.is_empty())))
            .map(|(n, _)| n)
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(Status::unavailable(format!(
                "node {} has not yet removed {host} from volume {volume}'s allow-list; it will when it is back, \
                 retry to confirm",
                behind.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(", ")
            )))
        }
    }

    pub(super) fn ready_volume(&self, name: &str) -> Result<VolumeRecord, Status> {
        let v = self.state.lock().unwrap().volumes.get(name).cloned().ok_or_else(|| no_volume(name))?;
        if v.state != VolumeState::Ready {
            return Err(Status::failed_precondition(format!("volume {name} is still being created; retry shortly")));
        }
        Ok(v)
    }

    /// Records a changed volume with the tombstones of what it no longer holds (a
    /// replica dropped or replaced), and marks the nodes concerned for an update.
    pub(super) async fn put_volume_and_tombs(&self, v: &VolumeRecord, tombs: Vec<Tombstone>) -> Result<(), Status> {
        let mut txn = Txn::default().put(format!("{VOLUMES}{}", v.name), to_json(v));
        for tomb in &tombs {
            txn = txn.put(format!("{TOMBSTONES}{}", tomb.id), to_json(tomb));
        }
        self.commit(txn).await?;
        let mut st = self.state.lock().unwrap();
        let mut nodes = v.exporting_nodes();
        if let Some(old) = st.volumes.insert(v.name.clone(), v.clone()) {
            nodes.extend(old.exporting_nodes());
        }
        for tomb in tombs {
            nodes.insert(tomb.node.clone());
            st.tombstones.insert(tomb.id.clone(), tomb);
        }
        for node in nodes {
            st.touch(&node);
        }
        Ok(())
    }

    /// Records a changed volume and marks the nodes that export it, before or after,
    /// for an update.
    pub(super) async fn put_volume(&self, v: &VolumeRecord) -> Result<(), Status> {
        self.commit(Txn::default().put(format!("{VOLUMES}{}", v.name), to_json(v))).await?;
        let mut st = self.state.lock().unwrap();
        let mut nodes = v.exporting_nodes();
        if let Some(old) = st.volumes.insert(v.name.clone(), v.clone()) {
            nodes.extend(old.exporting_nodes());
        }
        for node in nodes {
            st.touch(&node);
        }
        Ok(())
    }
}

/// The record of a volume `req` asks for, placed on `node` and `pool`, as it is
/// stored before the node makes it: one replica, nothing attached, no identity yet.
pub(super) fn new_record(
    req: &proto::CreateVolumeRequest,
    id: &str,
    node: &str,
    pool: &str,
    access_policy: access::AccessPolicy,
) -> VolumeRecord {
    VolumeRecord {
        name: req.name.clone(),
        id: id.to_string(),
        size: req.size_bytes,
        thin: req.thin,
        node: node.to_string(),
        pool: pool.to_string(),
        engine_name: format!("pv-{id}"),
        state: VolumeState::Creating,
        hosts: vec![],
        readonly_hosts: vec![],
        subsystem_nqn: format!("{VOLUME_NQN_PREFIX}{id}"),
        uuid: String::new(),
        nguid: String::new(),
        locality: Locality::Any,
        host_node: req.host_node.clone(),
        include: req.include_nodes.clone(),
        exclude: req.exclude_nodes.clone(),
        access_policy,
        group: req.group.clone(),
        paths: BTreeMap::new(),
        migration: None,
        last_migration: String::new(),
        local_hosts: vec![],
        local_device: None,
        dhchap: BTreeMap::new(),
        qos: req.qos.unwrap_or_default().into(),
        pinned: req.pinned,
        awaiting_home: false,
        generation: 0,
        replicas: vec![],
        serving_power_losses: 0,
        source: None,
        layered: false,
    }
}

/// A creation's place while its record is being stored; it is given back however the
/// call ends (stored, refused, or dropped by a caller that went away).
struct Reservation<'a> {
    state: &'a Mutex<State>,
    name: &'a str,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.state.lock().unwrap().reserved.remove(self.name);
    }
}

/// The volumes' figures for the dashboard's summary (`Cluster::volume_totals`).
#[derive(Debug, Default)]
pub struct VolumeTotals {
    pub volumes: usize,
    /// By state: creating, ready.
    pub by_state: std::collections::HashMap<String, usize>,
    /// Hosts attached over NVMe-oF and locally, over every volume.
    pub attachments: usize,
    pub read_iops: f64,
    pub write_iops: f64,
    pub read_bytes_per_second: f64,
    pub write_bytes_per_second: f64,
    /// The volumes with a migration under way.
    pub migrating: Vec<proto::Volume>,
}

/// A volume as lists search and sort it (`Cluster::volume_briefs`).
#[derive(Debug, Clone, Default)]
pub struct VolumeBrief {
    pub name: String,
    pub node: String,
    pub pool: String,
    /// creating or ready.
    pub state: &'static str,
    /// Hosts attached over NVMe-oF and locally.
    pub hosts: Vec<String>,
    pub size_bytes: u64,
    pub io: Option<proto::IoRates>,
}

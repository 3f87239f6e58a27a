//! Volumes: creation (placement, then the node's confirmation), resizing, deletion,
//! attachment.

use super::*;

impl Cluster {
    pub async fn create_volume(&self, req: &proto::CreateVolumeRequest) -> Result<proto::CreateVolumeResponse, Status> {
        check_name("volume", &req.name).map_err(Status::invalid_argument)?;
        if req.size_bytes == 0 {
            return Err(Status::invalid_argument("volume size must be more than 0 bytes"));
        }
        if req.size_bytes > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {} bytes is more than the largest volume nvpool makes (1 PiB)",
                req.size_bytes
            )));
        }
        let locality = locality_from(req.locality)?;
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
            if !same_request(&v, req, locality) {
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
                return self.finish_create(&v, Vec::new()).await;
            }
            return Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_proto(&v)),
                scores: vec![],
                existed: true,
            });
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
            let views = self.node_views(&st);
            let scores = scheduler::place(&views, &request, &self.cfg.policy, EXPLAINED_NODES);
            let Some(chosen) = scheduler::choice(&scores) else {
                return Err(Status::resource_exhausted(no_room_message(&request, &scores, views.len())));
            };
            let record = VolumeRecord {
                name: req.name.clone(),
                id: id.clone(),
                size: req.size_bytes,
                thin: req.thin,
                node: chosen.node.clone(),
                pool: chosen.pool.clone(),
                engine_name: format!("pv-{id}"),
                state: VolumeState::Creating,
                hosts: vec![],
                readonly_hosts: vec![],
                subsystem_nqn: format!("{VOLUME_NQN_PREFIX}{id}"),
                uuid: String::new(),
                nguid: String::new(),
                locality,
                host_node: req.host_node.clone(),
                include: req.include_nodes.clone(),
                exclude: req.exclude_nodes.clone(),
            };
            // Reserve the space now, so that concurrent creations see it taken.
            st.volumes.insert(record.name.clone(), record.clone());
            (record, scores)
        };
        let key = format!("{VOLUMES}{}", record.name);
        if let Err(e) =
            self.commit(Txn::default().when(Condition::Absent(key.clone())).put(key, to_json(&record))).await
        {
            self.state.lock().unwrap().volumes.remove(&record.name);
            return Err(e);
        }
        self.state.lock().unwrap().touch(&record.node);
        self.finish_create(&record, scores).await
    }

    /// Has the node's agent make a recorded volume, then reports the outcome.
    pub(super) async fn finish_create(
        &self,
        v: &VolumeRecord,
        scores: Vec<Score>,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        let outcome = self.apply_node(&v.node).await;
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
        let tomb = Tombstone::from(v);
        self.commit(
            Txn::default()
                .delete(format!("{VOLUMES}{}", v.name))
                .put(format!("{TOMBSTONES}{}", tomb.id), to_json(&tomb)),
        )
        .await?;
        let mut st = self.state.lock().unwrap();
        st.volumes.remove(&v.name);
        st.tombstones.insert(tomb.id.clone(), tomb);
        st.touch(&v.node);
        Ok(())
    }

    pub async fn delete_volume(&self, name: &str) -> Result<bool, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let Some(v) = self.state.lock().unwrap().volumes.get(name).cloned() else {
            return Ok(false);
        };
        self.bury(&v).await?;
        // The tombstone is durable; the background loop retries if the node is away.
        let _ = self.apply_node(&v.node).await;
        Ok(true)
    }

    pub async fn resize_volume(&self, name: &str, size: u64) -> Result<proto::Volume, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if size <= v.size {
            return Ok(self.volume_proto(&v));
        }
        if size > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {size} bytes is more than the largest volume nvpool makes (1 PiB)"
            )));
        }
        {
            let st = self.state.lock().unwrap();
            let views = self.node_views(&st);
            let pool = views.iter().find(|n| n.name == v.node).and_then(|n| n.pools.iter().find(|p| p.name == v.pool));
            let Some(pool) = pool else {
                return Err(Status::failed_precondition(format!(
                    "node {} no longer reports pool {}; check the node with `nvpool node list`",
                    v.node, v.pool
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
                    "pool {} on node {} has no room to grow volume {} to {size} bytes; free space there or create a \
                     new volume",
                    v.pool, v.node, v.name
                )));
            }
        }
        let grown = VolumeRecord { size, ..v.clone() };
        self.put_volume(&grown).await?;
        match self.apply_node(&v.node).await {
            Ok(results) if results.get(&v.id).is_some_and(|r| r.error.is_empty()) => {
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

    pub fn get_volume(&self, name: &str) -> Result<proto::Volume, Status> {
        let st = self.state.lock().unwrap();
        let v = st.volumes.get(name).ok_or_else(|| no_volume(name))?;
        Ok(self.volume_proto_locked(&st, v))
    }

    pub fn list_volumes(&self, node: &str) -> Vec<proto::Volume> {
        let st = self.state.lock().unwrap();
        st.volumes
            .values()
            .filter(|v| node.is_empty() || v.node == node)
            .map(|v| self.volume_proto_locked(&st, v))
            .collect()
    }

    pub async fn attach(&self, volume: &str, host: &str, readonly: bool) -> Result<proto::AttachResponse, Status> {
        check_host_nqn(host).map_err(Status::invalid_argument)?;
        let _guard = self.volume_locks.lock(volume).await;
        let v = self.ready_volume(volume)?;
        let attached_readonly = v.readonly_hosts.iter().any(|h| h == host);
        if v.hosts.iter().any(|h| h == host) && attached_readonly != readonly {
            return Err(Status::already_exists(format!(
                "volume {volume} is attached to {host} {}; detach it first to attach it {}",
                if attached_readonly { "read-only" } else { "read-write" },
                if readonly { "read-only" } else { "read-write" }
            )));
        }
        let node_applied = {
            let st = self.state.lock().unwrap();
            st.nodes.get(&v.node).is_some_and(|n| n.applied_generation == n.desired_generation)
        };
        if !v.hosts.iter().any(|h| h == host) || !node_applied {
            let mut with = v.clone();
            if !with.hosts.iter().any(|h| h == host) {
                with.hosts.push(host.to_string());
                if readonly {
                    with.readonly_hosts.push(host.to_string());
                }
            }
            self.put_volume(&with).await?;
            let ok =
                matches!(self.apply_node(&v.node).await, Ok(r) if r.get(&v.id).is_some_and(|r| r.error.is_empty()));
            if !ok {
                self.put_volume(&v).await?;
                return Err(Status::unavailable(format!(
                    "node {} did not export volume {volume} to {host}; nothing changed, retry when `nvpool node list` \
                     shows the node healthy",
                    v.node
                )));
            }
        }
        let v = self.ready_volume(volume)?;
        let st = self.state.lock().unwrap();
        let node = &st.nodes[&v.node].record;
        let (address, port) = split_address(&node.nvme_address);
        Ok(proto::AttachResponse {
            subsystem_nqn: v.subsystem_nqn.clone(),
            nsid: 1,
            uuid: v.uuid.clone(),
            nguid: v.nguid.clone(),
            paths: vec![proto::Path {
                node: v.node.clone(),
                transport: "tcp".into(),
                address,
                port,
                ana_state: "optimized".into(),
            }],
        })
    }

    pub async fn detach(&self, volume: &str, host: &str) -> Result<(), Status> {
        let _guard = self.volume_locks.lock(volume).await;
        let Some(v) = self.state.lock().unwrap().volumes.get(volume).cloned() else {
            return Ok(());
        };
        if v.hosts.iter().any(|h| h == host) {
            let without = VolumeRecord {
                hosts: v.hosts.iter().filter(|h| *h != host).cloned().collect(),
                readonly_hosts: v.readonly_hosts.iter().filter(|h| *h != host).cloned().collect(),
                ..v.clone()
            };
            self.put_volume(&without).await?;
        }
        match self.apply_node(&v.node).await {
            Ok(r) if r.get(&v.id).is_some_and(|r| r.error.is_empty()) => Ok(()),
            _ => Err(Status::unavailable(format!(
                "node {} has not yet removed {host} from volume {volume}'s allow-list; it will when it is back, \
                 retry to confirm",
                v.node
            ))),
        }
    }

    pub(super) fn ready_volume(&self, name: &str) -> Result<VolumeRecord, Status> {
        let v = self.state.lock().unwrap().volumes.get(name).cloned().ok_or_else(|| no_volume(name))?;
        if v.state != VolumeState::Ready {
            return Err(Status::failed_precondition(format!("volume {name} is still being created; retry shortly")));
        }
        Ok(v)
    }

    /// Records a changed volume and marks its node for an update.
    pub(super) async fn put_volume(&self, v: &VolumeRecord) -> Result<(), Status> {
        self.commit(Txn::default().put(format!("{VOLUMES}{}", v.name), to_json(v))).await?;
        let mut st = self.state.lock().unwrap();
        st.volumes.insert(v.name.clone(), v.clone());
        st.touch(&v.node);
        Ok(())
    }
}

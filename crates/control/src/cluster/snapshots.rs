//! Snapshots and clones. A snapshot is taken by the volume's serving engine, which
//! holds the volume's I/O from every path for the moment it takes (so it is one point
//! in the volume's write order), and is kept, read-only, in the pool that held the
//! volume; it outlives the volume. A clone is a volume made over a snapshot in that
//! pool: it reads what it has not written from there. A clone of a volume is a clone
//! of a snapshot taken for it alone, which the engine keeps hidden under the clone.

use crate::cluster::convert::policy_from;
use crate::cluster::volumes::new_record;
use crate::cluster::{Cluster, State, now_ms};
use crate::model::{
    CloneSource, MAX_VOLUME_SIZE, ReplicaState, SNAPSHOTS, SnapshotCopy, SnapshotRecord, SnapshotState, TOMBSTONES,
    VOLUMES, VolumeRecord, VolumeState, check_name, to_json,
};
use crate::proto::{self, agent_client::AgentClient};
use crate::store::{Condition, Txn};
use tonic::{Code, Status};

/// A snapshot name's key in the keyed locks, apart from volume names (which never
/// hold ':').
fn lock_key(name: &str) -> String {
    format!("snapshot:{name}")
}

/// Whether a snapshot of `v` can be taken (or `v` cloned) now.
fn snapshot_allowed(v: &VolumeRecord) -> Result<(), Status> {
    if let Some(m) = &v.migration {
        return Err(Status::unavailable(format!(
            "volume {} is moving to {}: take the snapshot once it has moved (`nvpool volume get {}`)",
            v.name, m.to_node, v.name
        )));
    }
    if let Some(r) = v.replica_move() {
        return Err(Status::unavailable(format!(
            "volume {}'s replica on {} moves to {}: take the snapshot once it has moved (`nvpool volume get {}`)",
            v.name, r.replaces, r.node, v.name
        )));
    }
    if let Some(r) = v.replicas.iter().find(|r| r.state == ReplicaState::CatchingUp) {
        return Err(Status::unavailable(format!(
            "volume {}'s replica on {} catches up: every replica takes the snapshot at once, so take it once \
             that one is in sync (`nvpool volume get {}`)",
            v.name, r.node, v.name
        )));
    }
    Ok(())
}

/// How long at most the serving engine holds a replicated volume's writes while
/// the other replicas take the snapshot: past it, the writes go on without it.
const REPLICATED_HOLD_MS: u64 = 5_000;

impl Cluster {
    /// Takes snapshot `name` of `volume`, or returns it if it was taken of that volume
    /// before; one left half taken by an earlier call is taken now. A replicated
    /// volume's is one snapshot with one identity on every in-sync replica: the
    /// serving engine holds the volume's writes, each other replica takes it, then
    /// the serving engine takes its own and lets the writes go on.
    pub async fn create_snapshot(&self, volume: &str, name: &str) -> Result<proto::Snapshot, Status> {
        check_name("snapshot", name).map_err(Status::invalid_argument)?;
        let _name_guard = self.volume_locks.lock(&lock_key(name)).await;
        let _volume_guard = self.volume_locks.lock(volume).await;
        let (existing, v) = {
            let st = self.state.lock().unwrap();
            (st.snapshots.get(name).cloned(), st.volumes.get(volume).cloned())
        };
        let record = match existing {
            Some(s) if v.as_ref().is_none_or(|v| v.id != s.volume_id) => {
                return Err(Status::already_exists(format!(
                    "snapshot {name} exists, of volume {}: delete it or use another name",
                    s.volume
                )));
            }
            Some(s) if s.state == SnapshotState::Ready => return Ok(self.snapshot_proto(&s)),
            // Copies an earlier call may have left are of another point: they go, and
            // the snapshot is taken anew everywhere.
            Some(s) if !s.copies.is_empty() => {
                self.undo_snapshot(&s).await?;
                self.record_snapshot(volume, name).await?
            }
            Some(s) => s,
            None => self.record_snapshot(volume, name).await?,
        };
        let v = self.ready_volume(volume)?;
        let taken = if v.replicas.is_empty() {
            self.take_on_node(&record.node, &record.pool, &v.engine_name, &record.engine_name, None).await
        } else {
            self.take_replicated(&v, &record).await
        };
        match taken {
            Ok(taken) => {
                let ready = SnapshotRecord { state: SnapshotState::Ready, pause_us: taken.pause_us, ..record };
                self.commit(Txn::default().put(format!("{SNAPSHOTS}{name}"), to_json(&ready))).await?;
                self.state.lock().unwrap().snapshots.insert(name.to_string(), ready.clone());
                Ok(self.snapshot_proto(&ready))
            }
            // The node may have taken it: the record stays, for a retry to finish (or
            // a deletion to remove).
            Err(e)
                if record.copies.is_empty()
                    && matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown) =>
            {
                Err(Status::unavailable(format!(
                    "node {} did not say whether it took snapshot {name} ({}): retry to finish it, or delete it",
                    record.node,
                    e.message()
                )))
            }
            // A replicated volume's snapshot is on every copy or on none.
            Err(e) => {
                self.undo_snapshot(&record).await?;
                let retry = if matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown) {
                    "; retry"
                } else {
                    ""
                };
                Err(Status::new(
                    e.code(),
                    format!("snapshot {name} of volume {volume} was not taken: {}{retry}", e.message()),
                ))
            }
        }
    }

    /// Takes `record`'s snapshot of replicated volume `v` on every copy: the serving
    /// node holds the writes, the others take theirs, the serving node takes its own
    /// (which ends the hold). Its pause is the serving node's hold.
    async fn take_replicated(
        &self,
        v: &VolumeRecord,
        record: &SnapshotRecord,
    ) -> Result<proto::TakeSnapshotReply, Status> {
        let identity = Some((uuid::Uuid::new_v4(), uuid::Uuid::new_v4()));
        self.hold_on_node(&v.node, &v.pool, &v.engine_name, REPLICATED_HOLD_MS).await?;
        for c in &record.copies {
            if let Err(e) = self.take_on_node(&c.node, &c.pool, &v.engine_name, &record.engine_name, identity).await {
                let _ = self.hold_on_node(&v.node, &v.pool, &v.engine_name, 0).await;
                return Err(Status::new(e.code(), format!("node {} did not take its copy: {}", c.node, e.message())));
            }
        }
        self.take_on_node(&record.node, &record.pool, &v.engine_name, &record.engine_name, identity).await
    }

    /// Forgets a snapshot not taken everywhere: the copies it has go.
    async fn undo_snapshot(&self, s: &SnapshotRecord) -> Result<(), Status> {
        let tombs = s.tombstones();
        let mut txn = Txn::default().delete(format!("{SNAPSHOTS}{}", s.name));
        for t in &tombs {
            txn = txn.put(format!("{TOMBSTONES}{}", t.id), to_json(t));
        }
        self.commit(txn).await?;
        {
            let mut st = self.state.lock().unwrap();
            st.snapshots.remove(&s.name);
            for t in tombs {
                st.touch(&t.node);
                st.tombstones.insert(t.id.clone(), t);
            }
        }
        for (node, _) in s.places() {
            let _ = self.apply_node(node).await;
        }
        Ok(())
    }

    /// Records a snapshot to be taken, and its volume as lying over it from now on
    /// (so that it never moves without it).
    async fn record_snapshot(&self, volume: &str, name: &str) -> Result<SnapshotRecord, Status> {
        let v = self.ready_volume(volume)?;
        snapshot_allowed(&v)?;
        let id = uuid::Uuid::new_v4().to_string();
        let record = SnapshotRecord {
            name: name.to_string(),
            id: id.clone(),
            volume: v.name.clone(),
            volume_id: v.id.clone(),
            node: v.node.clone(),
            pool: v.pool.clone(),
            engine_name: format!("snap-{id}"),
            size: v.size,
            created_ms: now_ms(),
            state: SnapshotState::Taking,
            pause_us: 0,
            copies: v
                .replicas
                .iter()
                .filter(|r| r.state == ReplicaState::InSync)
                .map(|r| SnapshotCopy { node: r.node.clone(), pool: r.pool.clone() })
                .collect(),
        };
        let key = format!("{SNAPSHOTS}{name}");
        let layered = VolumeRecord { layered: true, ..v };
        let txn = Txn::default()
            .when(Condition::Absent(key.clone()))
            .put(key, to_json(&record))
            .put(format!("{VOLUMES}{}", layered.name), to_json(&layered));
        self.commit(txn).await?;
        let mut st = self.state.lock().unwrap();
        st.snapshots.insert(name.to_string(), record.clone());
        st.volumes.insert(layered.name.clone(), layered);
        Ok(record)
    }

    /// The agent of `node` if it is up.
    fn agent_of(&self, node: &str, what: &str) -> Result<AgentClient<tonic::transport::Channel>, Status> {
        let address = {
            let st = self.state.lock().unwrap();
            let n = st.nodes.get(node).ok_or_else(|| Status::unavailable(format!("node {node} is not known")))?;
            if !self.healthy(n) {
                return Err(Status::unavailable(format!("node {node} is down: {what} once it is back")));
            }
            n.record.agent_address.clone()
        };
        Ok(AgentClient::new(self.channel(&address).map_err(Status::unavailable)?))
    }

    /// Has `node`'s agent take snapshot `snapshot` of engine volume `volume`, with
    /// the identity given (new if none).
    async fn take_on_node(
        &self,
        node: &str,
        pool: &str,
        volume: &str,
        snapshot: &str,
        identity: Option<(uuid::Uuid, uuid::Uuid)>,
    ) -> Result<proto::TakeSnapshotReply, Status> {
        let mut agent = self.agent_of(node, "take the snapshot")?;
        let (uuid, nguid) = identity.map_or_else(Default::default, |(u, g)| (u.to_string(), g.simple().to_string()));
        let request = proto::TakeSnapshotRequest {
            pool: pool.to_string(),
            volume: volume.to_string(),
            snapshot: snapshot.to_string(),
            uuid,
            nguid,
        };
        tokio::time::timeout(self.cfg.apply_timeout, agent.take_snapshot(request))
            .await
            .map_err(|_| Status::deadline_exceeded(format!("node {node}'s agent took too long")))?
            .map(|r| r.into_inner())
    }

    /// Has `node`'s engine hold replicated volume `volume`'s writes for at most
    /// `hold_ms` (0: lets them go on).
    async fn hold_on_node(&self, node: &str, pool: &str, volume: &str, hold_ms: u64) -> Result<(), Status> {
        let mut agent = self.agent_of(node, "take the snapshot")?;
        let request = proto::HoldWritesRequest { pool: pool.to_string(), volume: volume.to_string(), hold_ms };
        tokio::time::timeout(self.cfg.apply_timeout, agent.hold_writes(request))
            .await
            .map_err(|_| Status::deadline_exceeded(format!("node {node}'s agent took too long")))?
            .map(|_| ())
            .map_err(|e| Status::new(e.code(), format!("node {node} cannot hold the volume's writes: {}", e.message())))
    }

    /// Deletes snapshot `name`: its pool volume goes (or, while volumes read from it,
    /// stays hidden until the last of them goes). Returns whether it existed and those
    /// volumes.
    pub async fn delete_snapshot(&self, name: &str) -> Result<(bool, Vec<String>), Status> {
        let _guard = self.volume_locks.lock(&lock_key(name)).await;
        let Some(s) = self.state.lock().unwrap().snapshots.get(name).cloned() else {
            return Ok((false, Vec::new()));
        };
        let kept_by = readers_of(&self.state.lock().unwrap(), &s);
        // The tombstones are durable; the background loop retries a node away.
        self.undo_snapshot(&s).await?;
        Ok((true, kept_by))
    }

    pub fn get_snapshot(&self, name: &str) -> Result<proto::Snapshot, Status> {
        let s = self.state.lock().unwrap().snapshots.get(name).cloned().ok_or_else(|| no_snapshot(name))?;
        Ok(self.snapshot_proto(&s))
    }

    /// Every snapshot, or those taken of volume `volume` (as it was named then).
    pub fn list_snapshots(&self, volume: &str) -> Vec<proto::Snapshot> {
        let st = self.state.lock().unwrap();
        let mut listed: Vec<&SnapshotRecord> =
            st.snapshots.values().filter(|s| volume.is_empty() || s.volume == volume).collect();
        listed.sort_by(|a, b| (a.created_ms, &a.name).cmp(&(b.created_ms, &b.name)));
        listed.into_iter().map(|s| snapshot_proto_locked(&st, s)).collect()
    }

    fn snapshot_proto(&self, s: &SnapshotRecord) -> proto::Snapshot {
        snapshot_proto_locked(&self.state.lock().unwrap(), s)
    }

    /// Inflates volume `name` (a clone, or a volume with snapshots) on its node:
    /// starts it there, or says how far it is. Once the engine says it is done, the
    /// record forgets the volume's source and that it lay over snapshots, so the
    /// volume may move and take replicas again; its source, if a snapshot, no longer
    /// counts it among its clones (and a volume clone's hidden source is gone).
    pub async fn inflate_volume(&self, name: &str) -> Result<proto::InflateVolumeResponse, Status> {
        let _guard = self.volume_locks.lock(name).await;
        let v = self.ready_volume(name)?;
        if !v.layered {
            return Ok(proto::InflateVolumeResponse {
                volume: Some(self.volume_proto(&v)),
                done: true,
                ..Default::default()
            });
        }
        let address = {
            let st = self.state.lock().unwrap();
            let n =
                st.nodes.get(&v.node).ok_or_else(|| Status::unavailable(format!("node {} is not known", v.node)))?;
            if !self.healthy(n) {
                return Err(Status::unavailable(format!("node {} is down: inflate {name} once it is back", v.node)));
            }
            n.record.agent_address.clone()
        };
        let channel = self.channel(&address).map_err(Status::unavailable)?;
        let request = proto::InflateRequest { pool: v.pool.clone(), volume: v.engine_name.clone() };
        let reply = tokio::time::timeout(self.cfg.apply_timeout, AgentClient::new(channel).inflate_volume(request))
            .await
            .map_err(|_| Status::deadline_exceeded(format!("node {}'s agent took too long", v.node)))?
            .map_err(|e| Status::new(e.code(), format!("node {} cannot inflate {name}: {}", v.node, e.message())))?
            .into_inner();
        let v = if reply.done {
            let independent = VolumeRecord { source: None, layered: false, ..v };
            self.commit(Txn::default().put(format!("{VOLUMES}{name}"), to_json(&independent))).await?;
            self.state.lock().unwrap().volumes.insert(name.to_string(), independent.clone());
            independent
        } else {
            v
        };
        Ok(proto::InflateVolumeResponse {
            volume: Some(self.volume_proto(&v)),
            copied_clusters: reply.copied_clusters,
            total_clusters: reply.total_clusters,
            done: reply.done,
            stopped: reply.stopped,
        })
    }

    /// Makes volume `req.name` a clone of a snapshot or of a volume, on the pool that
    /// holds its source; a clone of that source made before is returned (finished if
    /// an earlier call left it half made).
    pub(super) async fn create_clone(
        &self,
        req: &proto::CreateVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        if !req.from_snapshot.is_empty() && !req.clone_of.is_empty() {
            return Err(Status::invalid_argument("a volume is made from a snapshot or from a volume, not both"));
        }
        if req.replicas > 1 {
            return Err(Status::failed_precondition(
                "a clone has one replica for now: make it with one, and add replicas once inflating clones is built",
            ));
        }
        let _guard = self.volume_locks.lock(&req.name).await;
        let existing = self.state.lock().unwrap().volumes.get(&req.name).cloned();
        if let Some(v) = existing {
            return self.clone_again(&v, req).await;
        }
        let id = uuid::Uuid::new_v4().to_string();
        let _source_guard = match req.clone_of.as_str() {
            "" => None,
            volume => Some(self.volume_locks.lock(volume).await),
        };
        let (node, pool, least, source, origin) = if req.clone_of.is_empty() {
            let s = self
                .state
                .lock()
                .unwrap()
                .snapshots
                .get(&req.from_snapshot)
                .cloned()
                .ok_or_else(|| no_snapshot(&req.from_snapshot))?;
            if s.state != SnapshotState::Ready {
                return Err(Status::unavailable(format!(
                    "snapshot {} is still being taken: retry once `nvpool snapshot get {}` says ready",
                    s.name, s.name
                )));
            }
            let source =
                CloneSource { snapshot: s.name.clone(), engine_name: s.engine_name.clone(), volume: String::new() };
            // On the copy of a node that is up, the serving replica's first.
            let (node, pool) = {
                let st = self.state.lock().unwrap();
                let up = |node: &str| st.nodes.get(node).is_some_and(|n| self.healthy(n));
                let (node, pool) = s.places().find(|(node, _)| up(node)).unwrap_or((&s.node, &s.pool));
                (node.to_string(), pool.to_string())
            };
            (node, pool, s.size, source, None)
        } else {
            let v = self.ready_volume(&req.clone_of)?;
            snapshot_allowed(&v)?;
            let source =
                CloneSource { snapshot: String::new(), engine_name: format!("source-of-{id}"), volume: v.name.clone() };
            (v.node.clone(), v.pool.clone(), v.size, source, Some(v))
        };
        let size = if req.size_bytes == 0 { least } else { req.size_bytes };
        if size < least {
            return Err(Status::invalid_argument(format!(
                "{size} bytes is less than the {least} bytes of the {}: a volume made from it is at least as large",
                describe(&source)
            )));
        }
        if size > MAX_VOLUME_SIZE {
            return Err(Status::invalid_argument(format!(
                "volume size {size} bytes is more than the largest volume nvpool makes (1 PiB)"
            )));
        }
        let record = clone_record(req, &id, size, &node, &pool, source.clone())?;
        let key = format!("{VOLUMES}{}", record.name);
        let mut txn = Txn::default().when(Condition::Absent(key.clone())).put(key, to_json(&record));
        let origin = origin.map(|v| VolumeRecord { layered: true, ..v });
        if let Some(o) = &origin {
            txn = txn.put(format!("{VOLUMES}{}", o.name), to_json(o));
        }
        self.commit(txn).await?;
        {
            let mut st = self.state.lock().unwrap();
            st.volumes.insert(record.name.clone(), record.clone());
            if let Some(o) = origin.clone() {
                st.volumes.insert(o.name.clone(), o);
            }
            st.touch(&node);
        }
        self.finish_clone(&record, origin.as_ref()).await
    }

    /// A creation of a name that exists, with a source given: the same clone is
    /// returned or finished, anything else refused.
    async fn clone_again(
        &self,
        v: &VolumeRecord,
        req: &proto::CreateVolumeRequest,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        let same = v.source.as_ref().is_some_and(|s| s.snapshot == req.from_snapshot && s.volume == req.clone_of)
            && (req.size_bytes == 0 || req.size_bytes == v.size);
        if !same {
            return Err(Status::already_exists(format!(
                "volume {} exists ({}, {} bytes): delete it or use another name",
                v.name,
                v.source.as_ref().map_or("made empty".to_string(), describe),
                v.size
            )));
        }
        if v.state == VolumeState::Ready {
            return Ok(proto::CreateVolumeResponse {
                volume: Some(self.volume_proto(v)),
                scores: vec![],
                existed: true,
            });
        }
        let origin = match v.source.as_ref().filter(|s| s.hidden()) {
            Some(s) => Some(self.ready_volume(&s.volume)?),
            None => None,
        };
        self.finish_clone(v, origin.as_ref()).await
    }

    /// Takes the hidden snapshot `snapshot` a clone of volume `o` lies over, on its
    /// serving node alone (the clone is made there): a replicated volume's writes are
    /// held for it as for any of its snapshots.
    async fn take_source_of(&self, o: &VolumeRecord, snapshot: &str) -> Result<proto::TakeSnapshotReply, Status> {
        if !o.replicas.is_empty() {
            self.hold_on_node(&o.node, &o.pool, &o.engine_name, REPLICATED_HOLD_MS).await?;
        }
        self.take_on_node(&o.node, &o.pool, &o.engine_name, snapshot, None).await
    }

    /// Takes a volume clone's snapshot of its source (if it clones a volume), then has
    /// the node make the clone over it. A clone that cannot be made is given up.
    async fn finish_clone(
        &self,
        v: &VolumeRecord,
        origin: Option<&VolumeRecord>,
    ) -> Result<proto::CreateVolumeResponse, Status> {
        if let (Some(o), Some(s)) = (origin, v.source.as_ref())
            && let Err(e) = self.take_source_of(o, &s.engine_name).await
        {
            if !matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded | Code::Unknown) {
                self.bury(v).await?;
            }
            return Err(Status::new(
                e.code(),
                format!("cannot snapshot volume {} to clone it: {}; retry to try again", o.name, e.message()),
            ));
        }
        self.finish_create(v, Vec::new()).await
    }
}

/// A clone's record: on its source's node and pool (the request's placement rules
/// do not apply), thin, with the request's access rules and limits.
fn clone_record(
    req: &proto::CreateVolumeRequest,
    id: &str,
    size: u64,
    node: &str,
    pool: &str,
    source: CloneSource,
) -> Result<VolumeRecord, Status> {
    Ok(VolumeRecord {
        size,
        thin: true,
        include: vec![],
        exclude: vec![],
        source: Some(source),
        layered: true,
        ..new_record(req, id, node, pool, policy_from(req.access_policy)?)
    })
}

/// What a clone was made from, in words.
fn describe(s: &CloneSource) -> String {
    if s.hidden() { format!("volume {} (cloned)", s.volume) } else { format!("snapshot {}", s.snapshot) }
}

fn no_snapshot(name: &str) -> Status {
    Status::not_found(format!("no snapshot {name}: `nvpool snapshot list` shows the snapshots"))
}

/// The clones made from snapshot `s`.
fn clones_of<'a>(st: &'a State, s: &'a SnapshotRecord) -> impl Iterator<Item = &'a VolumeRecord> {
    st.volumes.values().filter(|v| v.source.as_ref().is_some_and(|c| c.engine_name == s.engine_name))
}

/// The volumes that read from snapshot `s`: the volume it was taken of (which lies
/// over every snapshot taken of it), and its clones.
fn readers_of(st: &State, s: &SnapshotRecord) -> Vec<String> {
    let origin = st.volumes.by_id(&s.volume_id);
    origin.into_iter().chain(clones_of(st, s)).map(|v| v.name.clone()).collect()
}

fn snapshot_proto_locked(st: &State, s: &SnapshotRecord) -> proto::Snapshot {
    let clones = clones_of(st, s);
    proto::Snapshot {
        name: s.name.clone(),
        id: s.id.clone(),
        volume: s.volume.clone(),
        volume_id: s.volume_id.clone(),
        volume_exists: st.volumes.by_id(&s.volume_id).is_some(),
        node: s.node.clone(),
        pool: s.pool.clone(),
        size_bytes: s.size,
        created_ms: s.created_ms,
        state: match s.state {
            SnapshotState::Taking => "taking",
            SnapshotState::Ready => "ready",
        }
        .into(),
        pause_us: s.pause_us,
        allocated_bytes: st.nodes.get(&s.node).and_then(|n| n.usage.get(&s.engine_name)).copied().unwrap_or(0),
        clones: clones.map(|v| v.name.clone()).collect(),
        copy_nodes: s.copies.iter().map(|c| c.node.clone()).collect(),
    }
}

/// The names of `v`'s snapshots, oldest first.
pub(super) fn snapshots_of(st: &State, v: &VolumeRecord) -> Vec<String> {
    let mut of: Vec<&SnapshotRecord> = st.snapshots.values().filter(|s| s.volume_id == v.id).collect();
    of.sort_by_key(|s| s.created_ms);
    of.into_iter().map(|s| s.name.clone()).collect()
}

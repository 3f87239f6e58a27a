//! Carrying the desired state to the node agents: each node's whole `NodeState`, sent
//! after every change and again by the background loop until the agent is current.

use crate::cluster::convert::{ana_state, dhchap_proto};
use crate::cluster::{Changed, Cluster, HeldState, Results, State, replicas};
use crate::model::{
    LocalDeviceRecord, MigrationPhase, MigrationRecord, TOMBSTONES, VOLUMES, VolumeRecord, VolumeState, to_json,
};
use crate::proto;
use crate::proto::agent_client::AgentClient;
use crate::store::Txn;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};

/// What one node serves of a volume: the data and its export on the owner; an
/// export that forwards to the owner on an access point; the copy a migration fills,
/// on its target.
fn desired_volume(st: &State, v: &VolumeRecord, node: &str) -> proto::DesiredVolume {
    if let Some(m) = v.migration.as_ref().filter(|_| v.migration_path() == Some(node)) {
        return if m.phase == MigrationPhase::Retiring { retiring(st, v) } else { migration_target(st, v, m) };
    }
    let mut hosts = Vec::new();
    let mut ana = Vec::new();
    for host in &v.hosts {
        if let Some(place) = v.paths_of(host).iter().position(|n| n == node) {
            hosts.push(host.clone());
            ana.push(proto::HostAna { host_nqn: host.clone(), state: ana_state(place).into() });
        }
    }
    let owner_address = if v.node == node {
        // The owner allows the engines that forward to it.
        let forwarders = v.exporting_nodes().into_iter().filter(|n| n != node);
        hosts.extend(
            forwarders.filter_map(|n| st.nodes.get(&n)).map(|n| n.record.host_nqn.clone()).filter(|q| !q.is_empty()),
        );
        hosts.sort();
        hosts.dedup();
        String::new()
    } else {
        owner_peer(st, v)
    };
    let local = (v.node == node && !v.local_hosts.is_empty()).then(|| proto::LocalWanted {
        read_only: v.local_hosts.iter().all(|h| v.readonly_hosts.contains(h)),
        ublk_id: v.local_device.as_ref().map_or(-1, |d| i64::from(d.ublk_id)),
    });
    let access_points = hosts.iter().filter(|h| v.hosts.contains(h)).map(|h| access_points(st, v, h)).collect();
    let d = proto::DesiredVolume {
        hosts,
        owner_address,
        ana,
        local,
        access_points,
        // A volume that exists is never made anew, empty, in place of its data (a
        // pool made anew); once a switch may have happened, the owner's engine may
        // have deleted it.
        keep_only: v.node == node
            && (v.state == VolumeState::Ready
                || v.migration.as_ref().is_some_and(|m| m.phase == MigrationPhase::Switching)),
        ..present(v, &v.pool)
    };
    // A clone being made: over its snapshot, in the pool that holds it.
    let (clone_from, hide_source) = match &v.source {
        Some(s) if v.node == node && v.state == VolumeState::Creating => (s.engine_name.clone(), s.hidden()),
        _ => (String::new(), false),
    };
    let d = proto::DesiredVolume { clone_from, hide_source, ..d };
    with_replicas(st, v, node, d)
}

/// A replicated volume's part of a node's entry: on the serving node the mirror it
/// serves, on a replica's node the replica's export (and the access point's, if the
/// node is one); every replica takes the volume's identity.
fn with_replicas(st: &State, v: &VolumeRecord, node: &str, mut d: proto::DesiredVolume) -> proto::DesiredVolume {
    if v.replicas.is_empty() {
        return d;
    }
    d.uuid = v.uuid.clone();
    d.nguid = v.nguid.clone();
    if v.node == node {
        d.mirror = replicas::mirror_wanted(st, v, st.rebuild_rate);
    } else if let Some(r) = v.replica_on(node) {
        d.pool = r.pool.clone();
        d.replica = Some(replicas::replica_wanted(st, v, r));
        if d.ana.is_empty() {
            // Not an access point: the replica's export alone.
            d.owner_address.clear();
            d.hosts.clear();
            d.access_points.clear();
        }
    }
    d
}

/// The volume, present in `pool`: what every node that serves it is told.
fn present(v: &VolumeRecord, pool: &str) -> proto::DesiredVolume {
    proto::DesiredVolume {
        id: v.id.clone(),
        engine_name: v.engine_name.clone(),
        pool: pool.to_string(),
        size_bytes: v.size,
        thin: v.thin,
        present: true,
        subsystem_nqn: v.subsystem_nqn.clone(),
        dhchap: v
            .dhchap
            .iter()
            .map(|(host, d)| proto::HostDhchap { host_nqn: host.clone(), secrets: Some(dhchap_proto(d)) })
            .collect(),
        qos: Some(v.qos.into()),
        ..Default::default()
    }
}

/// The access points `host` is to connect to for `v`, at their host-facing
/// addresses, which every engine serving it lists in the host's discovery log: its
/// paths, and the node a migration adds (connected before the switch).
fn access_points(st: &State, v: &VolumeRecord, host: &str) -> proto::HostAccessPoints {
    let mut nodes = v.paths_of(host);
    if let Some(added) = v.migration_path().filter(|m| !nodes.iter().any(|n| n == m)) {
        nodes.push(added.to_string());
    }
    proto::HostAccessPoints {
        host_nqn: host.to_string(),
        addresses: nodes.iter().filter_map(|n| st.nodes.get(n)).map(|n| n.record.nvme_address.clone()).collect(),
    }
}

/// Where engines that forward reach the volume's owner.
fn owner_peer(st: &State, v: &VolumeRecord) -> String {
    st.nodes.get(&v.node).map(|o| o.record.peer().to_string()).unwrap_or_default()
}

/// The old owner after a migration's switch: it forwards to the new owner (as its
/// engine already does since the switch) as a non-optimized path. A host takes the
/// ANA changes of its controllers one at a time: while it still sees the new owner
/// inaccessible, this path stays usable, so no I/O waits for a path; once the new
/// owner is optimized, the host leaves this one, and then its export goes.
fn retiring(st: &State, v: &VolumeRecord) -> proto::DesiredVolume {
    proto::DesiredVolume {
        hosts: v.hosts.clone(),
        owner_address: owner_peer(st, v),
        ana: v.hosts.iter().map(|h| proto::HostAna { host_nqn: h.clone(), state: "non-optimized".into() }).collect(),
        access_points: v.hosts.iter().map(|h| access_points(st, v, h)).collect(),
        ..present(v, &v.pool)
    }
}

/// The target of a migration: a volume of the same size and identity, exported to the
/// attached hosts as inaccessible (they connect, and use it once it is theirs) and to
/// the owner's engine, which copies into it and forwards to it after the switch.
fn migration_target(st: &State, v: &VolumeRecord, m: &MigrationRecord) -> proto::DesiredVolume {
    let owner_engine = st.nodes.get(&v.node).map(|n| n.record.host_nqn.clone()).unwrap_or_default();
    let mut ana: Vec<proto::HostAna> =
        v.hosts.iter().map(|h| proto::HostAna { host_nqn: h.clone(), state: "inaccessible".into() }).collect();
    ana.push(proto::HostAna { host_nqn: owner_engine.clone(), state: "optimized".into() });
    let mut hosts: Vec<String> = v.hosts.iter().cloned().chain([owner_engine]).filter(|h| !h.is_empty()).collect();
    hosts.sort();
    hosts.dedup();
    proto::DesiredVolume {
        hosts,
        ana,
        access_points: v.hosts.iter().map(|h| access_points(st, v, h)).collect(),
        uuid: v.uuid.clone(),
        nguid: v.nguid.clone(),
        ..present(v, &m.to_pool)
    }
}

/// The local device the owner's engine reports for a volume with local hosts (kept
/// while the engine cannot say, so a restarted engine takes the same device back).
fn reported_local(v: &VolumeRecord, r: &proto::VolumeResult) -> Option<LocalDeviceRecord> {
    if v.local_hosts.is_empty() {
        return None;
    }
    if r.local_device.is_empty() {
        return v.local_device.clone();
    }
    Some(LocalDeviceRecord { node: v.node.clone(), ublk_id: r.ublk_id, device: r.local_device.clone() })
}

/// Whether `node` serves `v` now: its owner and its replicas' nodes always; an access
/// point or a move's target once the volume is ready.
fn serves(v: &VolumeRecord, node: &str) -> bool {
    v.node == node || v.replica_on(node).is_some() || v.state == VolumeState::Ready
}

/// An entry whose result is awaited each time it is sent: a creation, a move.
fn is_open(v: &VolumeRecord) -> bool {
    v.state == VolumeState::Creating || v.migration.is_some()
}

/// The entries of the volumes removed from the cluster whose removal `node` has not
/// confirmed yet; always open.
fn tombstones_on<'a>(st: &'a State, node: &'a str) -> impl Iterator<Item = proto::DesiredVolume> + 'a {
    st.tombstones.values().filter(move |t| t.node == node).map(|t| proto::DesiredVolume {
        id: t.id.clone(),
        engine_name: t.engine_name.clone(),
        pool: t.pool.clone(),
        size_bytes: t.size,
        thin: t.thin,
        present: false,
        subsystem_nqn: t.subsystem_nqn.clone(),
        ..Default::default()
    })
}

/// The node's whole desired state.
fn whole_state(st: &State, node: &str, generation: u64) -> proto::NodeState {
    let mut volumes: Vec<proto::DesiredVolume> =
        st.volumes.of_node(node).filter(|v| serves(v, node)).map(|v| desired_volume(st, v, node)).collect();
    volumes.extend(tombstones_on(st, node));
    proto::NodeState { node: node.to_string(), generation, volumes, ..Default::default() }
}

/// The node's desired state as changes to the state its agent holds: the entries that
/// differ from those held or are open, and the IDs of those gone. Only the volumes
/// that changed since the last state was built (`changed`) and those with work open
/// get their entries built and compared: a node's thousandth volume costs what its
/// first did.
fn changes_for(st: &State, node: &str, generation: u64, held: &HeldState, changed: &Changed) -> proto::NodeState {
    let open = st.volumes.creating().chain(st.volumes.migrating()).filter(|v| st.volumes.serves_node(node, &v.name));
    let names: BTreeSet<&str> = changed.names.iter().map(String::as_str).chain(open.map(|v| v.name.as_str())).collect();
    let mut volumes = Vec::new();
    let mut here: HashSet<&str> = HashSet::new();
    for v in names.into_iter().filter_map(|name| st.volumes.get(name)) {
        if !st.volumes.serves_node(node, &v.name) || !serves(v, node) {
            continue;
        }
        here.insert(&v.id);
        let d = desired_volume(st, v, node);
        if is_open(v) || held.entries.get(&v.id) != Some(&d) {
            volumes.push(d);
        }
    }
    here.extend(st.tombstones.values().filter(|t| t.node == node).map(|t| t.id.as_str()));
    volumes.extend(tombstones_on(st, node));
    // Gone: the volumes that left the node and the removals whose tombstone went,
    // unless an entry of the same ID is here again.
    let dropped: Vec<String> = changed
        .left
        .iter()
        .chain(&held.removals)
        .filter(|id| held.entries.contains_key(*id) && !here.contains(id.as_str()))
        .cloned()
        .collect::<BTreeSet<String>>()
        .into_iter()
        .collect();
    // Debug builds check that the changes make the whole state of the node.
    #[cfg(debug_assertions)]
    {
        let whole = whole_state(st, node, generation).volumes;
        for d in &whole {
            debug_assert!(
                held.entries.get(&d.id) == Some(d) || volumes.iter().any(|s| s.id == d.id),
                "node {node}: entry {} changed but was not marked changed",
                d.id
            );
        }
        let ids: HashSet<&str> = whole.iter().map(|d| d.id.as_str()).collect();
        for id in held.entries.keys().filter(|id| !ids.contains(id.as_str())) {
            debug_assert!(dropped.contains(id), "node {node}: entry {id} went but was not dropped");
        }
    }
    proto::NodeState { node: node.to_string(), generation, volumes, changes_since: held.generation, dropped }
}

/// What one application brought: the results the agent gave (by ID), and whether
/// every entry the agent holds now stands without error.
struct Applied {
    fresh: Vec<proto::VolumeResult>,
    all_ok: bool,
}

impl HeldState {
    /// Takes in a state the agent applied (changes to this one, or whole) and the
    /// results it gave; keeps the node's connected hosts per entry alongside.
    fn take_in(
        &mut self,
        sent: proto::NodeState,
        as_changes: bool,
        results: Vec<proto::VolumeResult>,
        connected: &mut HashMap<String, Vec<String>>,
    ) -> Applied {
        if !as_changes {
            *self = HeldState::default();
            connected.clear();
        }
        self.generation = sent.generation;
        let held_results = Arc::make_mut(&mut self.results);
        for id in &sent.dropped {
            self.entries.remove(id);
            held_results.remove(id);
            self.failing.remove(id);
            self.removals.remove(id);
            connected.remove(id);
        }
        for d in sent.volumes {
            if d.present {
                self.removals.remove(&d.id);
            } else {
                self.removals.insert(d.id.clone());
            }
            self.entries.insert(d.id.clone(), d);
        }
        // A result of no entry (an export the agent could not remove) counts once.
        let mut stray_error = false;
        for r in &results {
            if !self.entries.contains_key(&r.id) {
                stray_error |= !r.error.is_empty();
                continue;
            }
            if r.error.is_empty() {
                self.failing.remove(&r.id);
            } else {
                self.failing.insert(r.id.clone());
            }
            connected.insert(r.id.clone(), r.connected_hosts.clone());
            held_results.insert(r.id.clone(), r.clone());
        }
        Applied { all_ok: self.failing.is_empty() && !stray_error, fresh: results }
    }
}

impl Cluster {
    /// Sends a node its desired state and records what the agent reports: creations
    /// confirmed or rolled back, removals done. The state goes as changes to the one
    /// the agent holds, when this controller knows it: the entries that changed or
    /// have work open (a creation, a removal, a move, whose results are awaited), and
    /// the IDs of those gone; the results are then those of the last application of
    /// each entry. So a node's thousandth volume costs what its first did.
    pub async fn apply_node(&self, node: &str) -> Result<Results, String> {
        let _guard = self.node_locks.lock(node).await;
        let (state, address) = {
            let mut st = self.state.lock().unwrap();
            let Some(n) = st.nodes.get(node) else {
                return Err(format!("unknown node {node}"));
            };
            let address = n.record.agent_address.clone();
            // Taken whether the state goes whole or as changes: either covers them.
            let changed = st.volumes.take_changed(node);
            let n = &st.nodes[node];
            let state = match &n.held {
                Some(held) => changes_for(&st, node, n.desired_generation, held, &changed),
                None => whole_state(&st, node, n.desired_generation),
            };
            (state, address)
        };
        let mut client = AgentClient::new(self.channel(&address)?);
        let mut send = async |state: proto::NodeState| {
            tokio::time::timeout(self.cfg.apply_timeout, client.apply(state))
                .await
                .map_err(|_| format!("agent at {address} took longer than {:?}", self.cfg.apply_timeout))?
                .map_err(|e| format!("agent at {address}: {}", e.message()))
                .map(tonic::Response::into_inner)
        };
        let mut sent = state.clone();
        let mut as_changes = state.changes_since != 0;
        let mut reply = send(state).await;
        if matches!(&reply, Ok(r) if r.whole_state_wanted) {
            as_changes = false;
            sent = {
                let st = self.state.lock().unwrap();
                let n = st.nodes.get(node).ok_or_else(|| format!("unknown node {node}"))?;
                whole_state(&st, node, n.desired_generation)
            };
            reply = send(sent.clone()).await;
        }
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) => {
                // What the agent holds now is not known: the next state goes whole.
                if let Some(n) = self.state.lock().unwrap().nodes.get_mut(node) {
                    n.held = None;
                }
                return Err(e);
            }
        };
        let generation = sent.generation;
        let (applied, results) = {
            let mut st = self.state.lock().unwrap();
            let Some(n) = st.nodes.get_mut(node) else {
                return Err(format!("unknown node {node}"));
            };
            match (as_changes, n.held.take()) {
                // Changes to a state forgotten meanwhile (the node registered again):
                // what the agent holds is not known, and the next state goes whole.
                (true, None) => {
                    let results = reply.results.iter().map(|r| (r.id.clone(), r.clone())).collect();
                    (Applied { fresh: reply.results, all_ok: false }, Arc::new(results))
                }
                (_, held) => {
                    let mut held = held.unwrap_or_default();
                    let applied = held.take_in(sent, as_changes, reply.results, &mut n.connected);
                    let results = held.results.clone();
                    n.held = Some(held);
                    (applied, results)
                }
            }
        };
        self.absorb(node, generation, &applied).await;
        Ok(results)
    }

    /// Records what the agent's results settle: creations confirmed or failed, the
    /// identity or local device an engine reports, removals done. Only the results
    /// just given count; one whose record cannot be written has its entry sent again,
    /// so that its result comes back.
    async fn absorb(&self, node: &str, generation: u64, applied: &Applied) {
        let (mut confirmed, mut failed, mut removed) = (vec![], vec![], vec![]);
        {
            let st = self.state.lock().unwrap();
            for r in &applied.fresh {
                if let Some(v) = st.volumes.by_id(&r.id).filter(|v| v.node == node) {
                    match r {
                        r if r.error.is_empty()
                            && (v.state == VolumeState::Creating || v.uuid != r.uuid || v.nguid != r.nguid) =>
                        {
                            let mut now = v.clone();
                            now.state = VolumeState::Ready;
                            now.uuid = r.uuid.clone();
                            now.nguid = r.nguid.clone();
                            now.local_device = reported_local(v, r);
                            confirmed.push(now);
                        }
                        // A replicated volume's creation fails until its replicas are
                        // exported: `finish_create` tries again, and gives it up.
                        r if !r.error.is_empty() && v.state == VolumeState::Creating && v.replicas.is_empty() => {
                            failed.push(v.clone())
                        }
                        r if r.error.is_empty() && v.local_device != reported_local(v, r) => {
                            confirmed.push(VolumeRecord { local_device: reported_local(v, r), ..v.clone() });
                        }
                        _ => {}
                    }
                }
                if r.error.is_empty() && st.tombstones.get(&r.id).is_some_and(|t| t.node == node) {
                    removed.push(r.id.clone());
                }
            }
        }
        for v in confirmed {
            if self.commit(Txn::default().put(format!("{VOLUMES}{}", v.name), to_json(&v))).await.is_ok() {
                self.state.lock().unwrap().volumes.insert(v.name.clone(), v);
            } else {
                self.state.lock().unwrap().volumes.mark_changed(node, &v.name);
            }
        }
        for v in failed {
            let _ = self.bury(&v).await;
        }
        for id in removed {
            if self.commit(Txn::default().delete(format!("{TOMBSTONES}{id}"))).await.is_ok() {
                self.state.lock().unwrap().tombstones.remove(&id);
            }
        }
        let mut st = self.state.lock().unwrap();
        let Some(n) = st.nodes.get_mut(node) else { return };
        if applied.all_ok {
            n.applied_generation = n.applied_generation.max(generation);
        }
        // The membership pass acts on copies found gone (`replicas.rs`).
        for r in &applied.fresh {
            if r.copy_lost {
                n.lost_copies.insert(r.id.clone());
            } else {
                n.lost_copies.remove(&r.id);
            }
        }
    }

    pub(super) fn channel(&self, address: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().unwrap();
        if let Some(c) = channels.get(address) {
            return Ok(c.clone());
        }
        let scheme = if self.cfg.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| format!("agent address {address:?}: {e}"))?
            .connect_timeout(Duration::from_secs(2));
        if let Some(t) = &self.cfg.tls {
            endpoint = endpoint.tls_config(t.client()).map_err(|e| format!("TLS to agent {address}: {e}"))?;
        }
        let c = endpoint.connect_lazy();
        channels.insert(address.to_string(), c.clone());
        Ok(c)
    }

    /// Runs until the process ends: brings behind nodes up to date and finishes
    /// creations and removals that an earlier controller left open; now and then, the
    /// rebalancer's pass.
    pub async fn reconcile_forever(self: Arc<Self>) {
        let mut rebalanced = Instant::now();
        loop {
            tokio::time::sleep(self.cfg.heartbeat_interval / 2).await;
            self.tend_replicas().await;
            self.repath_access_points().await;
            if let Some(every) = self.cfg.rebalance_every
                && rebalanced.elapsed() >= every
            {
                rebalanced = Instant::now();
                self.rebalance().await;
                self.cfg.metrics.rebalance_pass_seconds.observe(rebalanced.elapsed().as_secs_f64());
            }
            // Migrations an earlier controller recorded go on from their last step.
            let moving: Vec<String> = self.state.lock().unwrap().volumes.migrating().map(|v| v.name.clone()).collect();
            for name in moving {
                self.start_driver(&name);
            }
            let due: Vec<String> = {
                let mut st = self.state.lock().unwrap();
                let open: HashSet<String> = st
                    .volumes
                    .creating()
                    .flat_map(|v| std::iter::once(v.node.clone()).chain(v.replicas.iter().map(|r| r.node.clone())))
                    .chain(st.tombstones.values().map(|t| t.node.clone()))
                    .collect();
                let due: Vec<String> = st
                    .nodes
                    .values()
                    // An agent whose engine is down keeps the newest state, and applies
                    // it, not an older one, when the engine is back.
                    .filter(|n| self.heartbeating(n) && !st.applying.contains(&n.record.name))
                    .filter(|n| n.applied_generation != n.desired_generation || open.contains(&n.record.name))
                    .map(|n| n.record.name.clone())
                    .collect();
                st.applying.extend(due.iter().cloned());
                due
            };
            for node in due {
                let me = self.clone();
                tokio::spawn(async move {
                    // A few at a time: a new leader has every node to bring up to date,
                    // and calls made for a client go on meanwhile.
                    if let Ok(_permit) = me.background_applies.acquire().await {
                        let _ = me.apply_node(&node).await;
                    }
                    me.state.lock().unwrap().applying.remove(&node);
                });
            }
        }
    }
}

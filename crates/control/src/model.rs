//! The records the controller keeps in its store, as JSON under these keys:
//! `/nvpool/cluster`, `/nvpool/nodes/NAME`, `/nvpool/volumes/NAME`,
//! `/nvpool/snapshots/NAME`, `/nvpool/tombstones/ID` and (etcd only) `/nvpool/leader`.

use crate::access::AccessPolicy;
use crate::scheduler::Locality;
use nvpool_api::QosLimits;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Every key the controller keeps starts with this.
pub const ROOT: &str = "/nvpool/";
pub const CLUSTER_KEY: &str = "/nvpool/cluster";
pub const NODES: &str = "/nvpool/nodes/";
pub const VOLUMES: &str = "/nvpool/volumes/";
pub const TOMBSTONES: &str = "/nvpool/tombstones/";
pub const SNAPSHOTS: &str = "/nvpool/snapshots/";
pub const LEADER_KEY: &str = "/nvpool/leader";

/// Volumes are exported as one subsystem each: this prefix and the volume's ID.
pub const VOLUME_NQN_PREFIX: &str = "nqn.2024-01.io.nvpool:volume:";

/// A replica's export is the volume's NQN with this after it.
pub const REPLICA_NQN_SUFFIX: &str = "-replica";

/// Largest volume the controller accepts: 1 PiB.
pub const MAX_VOLUME_SIZE: u64 = 1 << 50;

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClusterRecord {
    pub id: String,
}

/// Who leads, as stored in the leader key.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LeaderRecord {
    pub id: String,
    pub address: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PoolRecord {
    pub name: String,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub provisioned_bytes: u64,
    pub cluster_size: u64,
    pub volumes: u32,
    pub failed: Option<String>,
    /// Times the pool was opened after a power loss (see `PoolInfo::power_losses`).
    #[serde(default)]
    pub power_losses: u32,
    /// Bytes of `used_bytes` that snapshots hold.
    #[serde(default)]
    pub snapshot_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct NodeRecord {
    pub name: String,
    pub agent_address: String,
    pub nvme_address: String,
    pub labels: BTreeMap<String, String>,
    /// The pools as last registered; heartbeats refresh the figures in memory only.
    pub pools: Vec<PoolRecord>,
    /// The host NQN the node's engine presents to owners when it forwards.
    #[serde(default)]
    pub host_nqn: String,
    /// Where other engines reach this node's engine; empty: `nvme_address`.
    #[serde(default)]
    pub peer_address: String,
    /// The host NQN the node's own NVMe host (and its CSI node plugin) presents.
    #[serde(default)]
    pub local_host_nqn: String,
    /// The block of controller IDs the node's engine hands out (see
    /// `access::cntlid_range`); given at the first registration.
    #[serde(default)]
    pub cntlid_block: Option<u16>,
}

impl NodeRecord {
    /// Where other engines reach this node's engine (always NVMe/TCP: registration
    /// makes a node whose hosts use RDMA give a peer address).
    pub fn peer(&self) -> &str {
        if self.peer_address.is_empty() {
            self.nvme_address.strip_prefix("tcp:").unwrap_or(&self.nvme_address)
        } else {
            &self.peer_address
        }
    }
}

/// Where hosts reach an engine, as a node registers it: `IP:PORT` (NVMe/TCP),
/// `tcp:IP:PORT` or `rdma:IP:PORT`. Returns the transport as `nvme connect -t` names
/// it, and the address.
pub fn host_address(a: &str) -> Option<(&'static str, std::net::SocketAddr)> {
    let (transport, rest) = match a.split_once(':') {
        Some(("rdma", rest)) => ("rdma", rest),
        Some(("tcp", rest)) => ("tcp", rest),
        _ => ("tcp", a),
    };
    rest.parse().ok().map(|addr| (transport, addr))
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum VolumeState {
    /// Placed and recorded; the node's engine has not confirmed it yet.
    Creating,
    Ready,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VolumeRecord {
    pub name: String,
    pub id: String,
    pub size: u64,
    pub thin: bool,
    pub node: String,
    pub pool: String,
    pub engine_name: String,
    pub state: VolumeState,
    pub hosts: Vec<String>,
    /// Those of `hosts` that attached read-only.
    #[serde(default)]
    pub readonly_hosts: Vec<String>,
    pub subsystem_nqn: String,
    pub uuid: String,
    pub nguid: String,
    pub locality: Locality,
    pub host_node: String,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    #[serde(default)]
    pub access_policy: AccessPolicy,
    /// The volume group the access policy works on; empty for none.
    #[serde(default)]
    pub group: String,
    /// Each attached host's access points, the optimized one first.
    #[serde(default)]
    pub paths: BTreeMap<String, Vec<String>>,
    /// The migration under way, if any.
    #[serde(default)]
    pub migration: Option<MigrationRecord>,
    /// How the last migration ended.
    #[serde(default)]
    pub last_migration: String,
    /// Hosts on the owner node attached through a local device (not in `hosts`: they
    /// have no NVMe/TCP paths).
    #[serde(default)]
    pub local_hosts: Vec<String>,
    /// The local device the owner's engine made for them.
    #[serde(default)]
    pub local_device: Option<LocalDeviceRecord>,
    /// DH-HMAC-CHAP secrets of the hosts attached with them, by host NQN.
    #[serde(default)]
    pub dhchap: BTreeMap<String, DhchapRecord>,
    /// I/O limits every engine serving the volume enforces.
    #[serde(default, skip_serializing_if = "QosLimits::is_unlimited")]
    pub qos: QosLimits,
    /// The rebalancer never moves it.
    #[serde(default)]
    pub pinned: bool,
    /// A local volume that its consumer's node had no room for when it was made, so
    /// it went elsewhere: the rebalancer brings it home when it can. Any move clears it.
    #[serde(default)]
    pub awaiting_home: bool,
    /// A replicated volume's generation: it grows with every change of its in-sync
    /// set or its serving node, and is the key of the serving engine's reservations
    /// on the replicas (0: one replica, none).
    #[serde(default)]
    pub generation: u64,
    /// The replicas besides the serving one (which is `node`, `pool`): empty for a
    /// volume of one copy.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replicas: Vec<ReplicaRecord>,
    /// The serving pool's power losses when it began serving (as a replica's): a later
    /// one means its disks may lack writes the other replicas have, so another
    /// replica serves if one is in sync.
    #[serde(default)]
    pub serving_power_losses: u32,
    /// The snapshot a clone lies over (it reads what it has not written from there);
    /// `None` for a volume made empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<CloneSource>,
    /// The volume lies over a snapshot in its pool (one of its own, kept hidden while
    /// it reads from it even once deleted, or its clone source): its data is in more
    /// than its own pool volume, so it stays where it is for now.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub layered: bool,
}

/// What a clone was made from: a snapshot, or a volume (through a snapshot taken of
/// it for the clone alone, hidden under the clone once it is made).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct CloneSource {
    /// The snapshot's name; empty for the hidden snapshot of a volume clone.
    #[serde(default)]
    pub snapshot: String,
    /// The snapshot's name in the engine's pool (the clone's node and pool).
    pub engine_name: String,
    /// The volume cloned (`--clone-of`); empty for a clone of a named snapshot.
    #[serde(default)]
    pub volume: String,
}

impl CloneSource {
    /// The hidden snapshot a volume clone made of its source (none for a named one).
    pub fn hidden(&self) -> bool {
        self.snapshot.is_empty()
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotState {
    /// Recorded; the volume's engine has not reported it taken yet.
    Taking,
    Ready,
}

/// A snapshot: the volume's data at one point in its write order, kept read-only in
/// the pool that held the volume. It outlives the volume.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub name: String,
    pub id: String,
    /// The volume it was taken of, by name and ID (a volume of that name made later
    /// is another one).
    pub volume: String,
    pub volume_id: String,
    pub node: String,
    pub pool: String,
    pub engine_name: String,
    pub size: u64,
    pub created_ms: u64,
    pub state: SnapshotState,
    /// How long the volume's I/O was held while it was taken.
    #[serde(default)]
    pub pause_us: u64,
    /// A replicated volume's: the copies its other in-sync replicas took at the same
    /// point in its writes (same engine name and identity), each in the replica's
    /// node and pool. `node` and `pool` hold the serving replica's.
    #[serde(default)]
    pub copies: Vec<SnapshotCopy>,
}

/// Where a copy of a snapshot is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct SnapshotCopy {
    pub node: String,
    pub pool: String,
}

impl SnapshotRecord {
    /// Every copy's node and pool, the serving replica's first.
    pub fn places(&self) -> impl Iterator<Item = (&str, &str)> {
        std::iter::once((self.node.as_str(), self.pool.as_str()))
            .chain(self.copies.iter().map(|c| (c.node.as_str(), c.pool.as_str())))
    }

    /// What a deleted snapshot leaves for its nodes to remove: each copy's pool
    /// volume (which the engine keeps, hidden, while volumes lie over it).
    pub fn tombstones(&self) -> Vec<Tombstone> {
        self.places()
            .enumerate()
            .map(|(i, (node, pool))| Tombstone {
                id: if i == 0 { self.id.clone() } else { format!("{}@{node}", self.id) },
                node: node.to_string(),
                pool: pool.to_string(),
                engine_name: self.engine_name.clone(),
                // Never exported: no export of this name exists.
                subsystem_nqn: format!("{VOLUME_NQN_PREFIX}{}", self.id),
                size: self.size,
                thin: true,
            })
            .collect()
    }
}

/// Where a replica stands.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum ReplicaState {
    /// It has every write: the serving engine writes to it and waits for it.
    InSync,
    /// It gets every write and a rebuild copies what it lacks; it joins the in-sync
    /// set when the copy is done.
    CatchingUp,
    /// It left the in-sync set (its node went, or it failed a command).
    Faulted,
}

/// A copy of a replicated volume's data other than the serving one.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReplicaRecord {
    pub node: String,
    pub pool: String,
    pub state: ReplicaState,
    /// Why it left the in-sync set.
    #[serde(default)]
    pub why: String,
    /// The generation it left the in-sync set at (0: never).
    #[serde(default)]
    pub left_at: u64,
    /// The serving node when it left: only that node's engine recorded what it lacks.
    #[serde(default)]
    pub left_serving: String,
    /// When it left (milliseconds since the epoch).
    #[serde(default)]
    pub left_ms: u64,
    /// While catching up: the generation from which the rebuild copies what was
    /// written (0: every cluster).
    #[serde(default)]
    pub since: u64,
    /// Its pool's power losses when it joined the in-sync set: a later one means its
    /// disks may have lost writes it had acknowledged, so it leaves the set and
    /// rebuilds in full.
    #[serde(default)]
    pub power_losses: u32,
    /// A move's new replica: the node whose replica it replaces, dropped (or, if it
    /// serves, handing the serving role to this one) once this one is in sync.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub replaces: String,
}

impl ReplicaRecord {
    /// A new replica, in sync with an empty volume.
    pub fn new(node: &str, pool: &str) -> ReplicaRecord {
        ReplicaRecord {
            node: node.to_string(),
            pool: pool.to_string(),
            state: ReplicaState::InSync,
            why: String::new(),
            left_at: 0,
            left_serving: String::new(),
            left_ms: 0,
            since: 0,
            power_losses: 0,
            replaces: String::new(),
        }
    }
}

/// A host's DH-HMAC-CHAP secrets (`DHHC-1` form). `Debug` hides them.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DhchapRecord {
    /// What the host proves it knows.
    pub secret: String,
    /// What the controller proves it knows.
    pub ctrl_secret: String,
}

impl DhchapRecord {
    /// New random secrets, transformed with SHA-256 as `nvme gen-dhchap-key --hmac=1`.
    pub fn generate() -> DhchapRecord {
        let make = || nvpool_auth::Secret::generate(Some(nvpool_auth::Hash::Sha256)).to_dhhc();
        DhchapRecord { secret: make(), ctrl_secret: make() }
    }
}

impl std::fmt::Debug for DhchapRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DhchapRecord(redacted)")
    }
}

/// A local device serving a volume on its owner node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct LocalDeviceRecord {
    pub node: String,
    /// The device number, which an engine that restarted takes back.
    pub ublk_id: u32,
    /// e.g. /dev/ublkb0.
    pub device: String,
}

/// Where a migration stands, as recorded before each step is taken.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MigrationPhase {
    /// The target node makes the volume (same size and identity) and exports it to
    /// the hosts (inaccessible) and to the owner's engine.
    Preparing,
    /// The owner's engine copies rounds to the target.
    Copying,
    /// The switch was asked for: once it happens, the target holds the only copy.
    Switching,
    /// Switched: the target owns the volume; the old node still forwards to it, a
    /// non-optimized path, until hosts' I/O has left it.
    Retiring,
}

/// A volume's move to another node.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MigrationRecord {
    #[serde(default)]
    pub from_node: String,
    pub to_node: String,
    pub to_pool: String,
    pub phase: MigrationPhase,
    /// Most bytes per second the copy takes; 0: no limit.
    pub rate: u64,
    /// Longest pause of hosts' I/O at the switch.
    pub pause_ms: u32,
    pub started_ms: u64,
    /// When the switch was seen (retiring).
    #[serde(default)]
    pub switched_ms: u64,
}

impl VolumeRecord {
    /// A host's access points; a host attached before access points existed
    /// reaches the owner only.
    pub fn paths_of(&self, host: &str) -> Vec<String> {
        self.paths.get(host).cloned().unwrap_or_else(|| vec![self.node.clone()])
    }

    /// The node a migration adds to every host's paths: its target (inaccessible)
    /// until the switch, then the old owner (non-optimized) while it retires.
    pub fn migration_path(&self) -> Option<&str> {
        self.migration
            .as_ref()
            .map(|m| if m.phase == MigrationPhase::Retiring { &m.from_node } else { &m.to_node })
            .map(|n| n.as_str())
    }

    /// Every node that exports the volume: its owner, its access points, the node
    /// its migration adds, and its replicas' nodes.
    pub fn exporting_nodes(&self) -> BTreeSet<String> {
        let mut nodes: BTreeSet<String> = self.hosts.iter().flat_map(|h| self.paths_of(h)).collect();
        nodes.insert(self.node.clone());
        nodes.extend(self.migration_path().map(String::from));
        nodes.extend(self.replicas.iter().map(|r| r.node.clone()));
        nodes
    }

    /// Copies of the data asked for: the serving one and the others.
    pub fn replica_count(&self) -> usize {
        1 + self.replicas.len()
    }

    /// The replica on `node`, if one is there (the serving one is not in the list).
    pub fn replica_on(&self, node: &str) -> Option<&ReplicaRecord> {
        self.replicas.iter().find(|r| r.node == node)
    }

    /// The new replica of a move under way (one replica moving to another node).
    pub fn replica_move(&self) -> Option<&ReplicaRecord> {
        self.replicas.iter().find(|r| !r.replaces.is_empty())
    }

    /// The export of the replicas (each replica node has its own, of this name).
    pub fn replica_nqn(&self) -> String {
        format!("{}{REPLICA_NQN_SUFFIX}", self.subsystem_nqn)
    }
}

/// A volume that is gone from the cluster's view but whose engine side is still to
/// be removed. Its space counts as used until the node confirms the removal.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Tombstone {
    pub id: String,
    pub node: String,
    pub pool: String,
    pub engine_name: String,
    pub subsystem_nqn: String,
    pub size: u64,
    pub thin: bool,
}

impl Tombstone {
    /// What a removed volume leaves to remove: its serving copy and each replica. A
    /// replica's tombstone is named `ID@NODE` (the agent's entries go by that name)
    /// and removes the replica's export.
    pub fn all_of(v: &VolumeRecord) -> Vec<Tombstone> {
        let replicas = v.replicas.iter().map(|r| Tombstone::of_replica(v, &r.node, &r.pool));
        // A volume clone's hidden snapshot, in case the clone was never made over it
        // (once it was, the engine deletes it with the clone).
        let hidden_source = v.source.as_ref().filter(|s| s.hidden()).map(|s| Tombstone {
            id: format!("{}-source", v.id),
            engine_name: s.engine_name.clone(),
            subsystem_nqn: format!("{}-source", v.subsystem_nqn),
            ..Tombstone::from(v)
        });
        std::iter::once(Tombstone::from(v)).chain(replicas).chain(hidden_source).collect()
    }

    /// The tombstone of the replica of `v` on `node`.
    pub fn of_replica(v: &VolumeRecord, node: &str, pool: &str) -> Tombstone {
        Tombstone {
            id: format!("{}@{node}", v.id),
            node: node.to_string(),
            pool: pool.to_string(),
            subsystem_nqn: v.replica_nqn(),
            ..Tombstone::from(v)
        }
    }
}

impl From<&VolumeRecord> for Tombstone {
    fn from(v: &VolumeRecord) -> Tombstone {
        Tombstone {
            id: v.id.clone(),
            node: v.node.clone(),
            pool: v.pool.clone(),
            engine_name: v.engine_name.clone(),
            subsystem_nqn: v.subsystem_nqn.clone(),
            size: v.size,
            thin: v.thin,
        }
    }
}

/// Volume and node names: what Kubernetes object names allow, and a little more.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(format!("{what} name {name:?} is not valid: use 1 to 253 letters, digits, '-', '_' or '.'"))
    }
}

/// Host NQNs as the NVMe base specification shapes them.
pub fn check_host_nqn(nqn: &str) -> Result<(), String> {
    if nqn.starts_with("nqn.") && nqn.len() <= 223 && nqn.is_ascii() && !nqn.contains(char::is_whitespace) {
        Ok(())
    } else {
        Err(format!(
            "host NQN {nqn:?} is not valid: it starts with \"nqn.\" and has at most 223 ASCII characters \
             (`cat /etc/nvme/hostnqn` shows a host's NQN)"
        ))
    }
}

pub fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).expect("records serialize")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_addresses_name_their_transport_and_peers_stay_on_tcp() {
        let ip = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        assert_eq!(host_address("10.0.0.1:4420"), Some(("tcp", ip("10.0.0.1:4420"))));
        assert_eq!(host_address("tcp:10.0.0.1:4420"), Some(("tcp", ip("10.0.0.1:4420"))));
        assert_eq!(host_address("rdma:192.168.7.1:4420"), Some(("rdma", ip("192.168.7.1:4420"))));
        assert_eq!(host_address("rdma:[fd00::1]:4420"), Some(("rdma", ip("[fd00::1]:4420"))));
        assert_eq!(host_address("rdma:host:4420"), None);
        assert_eq!(host_address("roce:10.0.0.1:4420"), None);
        let node = |nvme: &str, peer: &str| NodeRecord {
            name: "n".into(),
            agent_address: String::new(),
            nvme_address: nvme.into(),
            labels: BTreeMap::new(),
            pools: vec![],
            host_nqn: String::new(),
            peer_address: peer.into(),
            local_host_nqn: String::new(),
            cntlid_block: None,
        };
        assert_eq!(node("tcp:10.0.0.1:4420", "").peer(), "10.0.0.1:4420");
        assert_eq!(node("10.0.0.1:4420", "").peer(), "10.0.0.1:4420");
        assert_eq!(node("rdma:192.168.7.1:4420", "10.0.0.1:4420").peer(), "10.0.0.1:4420");
    }
}

//! The engine's management API, defined once for the engine, the agent and the CLI.
//!
//! The wire form is newline-delimited JSON on a Unix socket. Each request is one line,
//! `{"method": NAME, "params": {...}}`; each reply is one line, `{"result": ...}` or
//! `{"error": "what was wrong and what to do", "kind": "not_found"}` (see [`ErrorKind`]). Every request is a type implementing
//! [`Method`], which names its method and its reply type; [`call`] sends one and
//! decodes the reply as that type, so a renamed or missing field is an error, never a
//! silent zero.

mod client;
pub mod scrape;
mod types;

pub use client::{ApiError, ErrorKind, ErrorReply, call};
pub use types::*;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A management request: its method name and the type of its reply.
pub trait Method: Serialize + DeserializeOwned {
    /// The method name on the wire.
    const NAME: &'static str;
    /// What a successful call returns.
    type Reply: Serialize + DeserializeOwned;
}

macro_rules! methods {
    ($( $(#[$doc:meta])* $name:literal => $req:ident -> $reply:ty { $($(#[$fdoc:meta])* $field:ident : $ty:ty),* $(,)? } )*) => {
        $(
            $(#[$doc])*
            #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
            #[serde(deny_unknown_fields)]
            pub struct $req {
                $( $(#[$fdoc])* pub $field: $ty, )*
            }
            impl Method for $req {
                const NAME: &'static str = $name;
                type Reply = $reply;
            }
        )*
        /// Every method name, for error messages.
        pub const METHODS: &[&str] = &[$($name),*];
    };
}

methods! {
    /// The engine's version, connections and listeners.
    "engine_info" => GetEngineInfo -> EngineInfo {}
    /// Sets the controller IDs new controllers get, so that the engines serving one
    /// subsystem never hand a host the same ID; live controllers keep theirs.
    "cntlid_range_set" => SetControllerIdRange -> Empty {
        /// First ID, at least 1.
        min: u16,
        /// Last ID, at most 65519.
        max: u16,
    }
    /// Every subsystem, the discovery subsystem included, with namespaces and counters.
    "subsystem_list" => ListSubsystems -> Vec<SubsystemInfo> {}
    /// The subsystems of these NQNs that exist, as `subsystem_list` gives them.
    "subsystem_get" => GetSubsystems -> Vec<SubsystemInfo> {
        /// Subsystem NQNs.
        nqns: Vec<String>,
    }
    /// Removes a subsystem and ends its controllers.
    "subsystem_remove" => RemoveSubsystem -> Empty {
        /// Subsystem NQN.
        nqn: String,
    }
    /// Adds a namespace to a subsystem.
    "namespace_add" => AddNamespace -> NamespaceAdded {
        /// Subsystem NQN.
        nqn: String,
        /// The namespace, as in the TOML configuration.
        namespace: NamespaceConfig,
    }
    /// Serves a namespace from another backend from the next command on, keeping
    /// what hosts see (identity, size, blocks): no event is raised. The backend must
    /// carry the namespace's identity, if it carries one.
    "namespace_swap" => SwapNamespace -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
        /// The new backend, as in the configuration (`volume:POOL/NAME`, `remote:...`).
        backend: String,
    }
    /// Serves a `remote:` or `mirror:` namespace at the size its backend has now, if
    /// larger (the volume grew on its owner, or on every replica): its backend opens
    /// again from its spec, and hosts are told the namespace changed.
    "namespace_grow" => GrowNamespace -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
    }
    /// Sets a namespace's I/O limits, from its next command on: connected hosts keep
    /// their connections, and commands waiting for the old budget wait for the new one.
    "namespace_qos_set" => SetNamespaceQos -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
        /// The limits; all zero lifts them.
        limits: QosLimits,
    }
    /// Removes a namespace.
    "namespace_remove" => RemoveNamespace -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
    }
    /// Serves a namespace as a block device of this node (ublk), or takes back one an
    /// engine that exited left.
    "local_add" => AddLocalDevice -> LocalDeviceAdded {
        /// The device, as in the configuration's `[[local]]`.
        device: LocalDeviceConfig,
    }
    /// Removes a local device once the I/O under way is done: `/dev/ublkbN`, or a
    /// vhost-user-blk socket (its frontend is disconnected). Name exactly one.
    "local_remove" => RemoveLocalDevice -> Empty {
        /// The ublk device number.
        #[serde(default)]
        ublk_id: Option<u32>,
        /// The vhost-user-blk socket.
        #[serde(default)]
        socket: Option<String>,
    }
    /// Every local device this engine serves.
    "local_list" => ListLocalDevices -> Vec<LocalDeviceInfo> {}
    /// Allows a host on a subsystem.
    "host_add" => AddHost -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Host NQN.
        host: String,
        /// DH-HMAC-CHAP secrets the host must authenticate with; adding a host again
        /// with other secrets changes them for its next authentication.
        #[serde(default)]
        dhchap: Option<DhchapKeys>,
        /// The host's pre-shared key for NVMe/TCP over TLS; adding a host again with
        /// another key changes it for its next handshake.
        #[serde(default)]
        tls_psk: Option<TlsPsk>,
    }
    /// Disallows a host; its controllers are ended.
    "host_remove" => RemoveHost -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Host NQN.
        host: String,
    }
    /// Lets any host connect, or only the allowed ones.
    "allow_any_host" => AllowAnyHost -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Whether any host may connect.
        allow: bool,
    }
    /// Sets the ANA state of a group of a subsystem's namespaces on this engine, for
    /// one host or for every host without a state of its own. Controllers whose view
    /// changed get an ANA change event.
    "ana_set" => SetAnaState -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// ANA group ID.
        group: u32,
        /// Host NQN; every host without its own state when absent.
        host: Option<String>,
        /// The new state.
        state: AnaState,
    }
    /// Sets the access points a host is to use for a subsystem: this engine's
    /// discovery log lists them to that host (its own address among them, as given)
    /// in place of this engine's listeners. No paths puts the listeners back.
    /// Discovery controllers get a Discovery Log Page Change event.
    "host_paths_set" => SetHostPaths -> Empty {
        /// Subsystem NQN.
        nqn: String,
        /// Host NQN, allowed on the subsystem.
        host: String,
        /// Its access points, the optimized one first.
        paths: Vec<PathAddress>,
    }
    /// Sets the IP address hosts reach this engine at: the discovery log gives it for
    /// this engine's listeners in place of the address each is bound to (a node behind
    /// address translation, or listening on 0.0.0.0). None puts the bound ones back.
    "discovery_address_set" => SetDiscoveryAddress -> Empty {
        /// The host-facing IP address.
        address: Option<std::net::IpAddr>,
    }
    /// The ANA groups of a subsystem on this engine and their states.
    "ana_list" => ListAnaGroups -> Vec<AnaGroupInfo> {
        /// Subsystem NQN.
        nqn: String,
    }
    /// The listeners.
    "listener_list" => ListListeners -> Vec<ListenerInfo> {}
    /// Listens on an address.
    "listener_add" => AddListener -> ListenerInfo {
        /// IP and port.
        address: std::net::SocketAddr,
        /// Whether hosts connect with TLS.
        #[serde(default)]
        tls: TlsMode,
        /// NVMe/TCP (the default) or NVMe over RDMA.
        #[serde(default)]
        transport: Transport,
    }
    /// Stops listening on an address and ends the connections it accepted.
    "listener_remove" => RemoveListener -> Empty {
        /// IP and port.
        address: std::net::SocketAddr,
        /// The listener's transport.
        #[serde(default)]
        transport: Transport,
    }
    /// Creates a pool on disks.
    "pool_create" => CreatePool -> PoolInfo {
        /// Pool name.
        name: String,
        /// Member disks.
        disks: Vec<std::path::PathBuf>,
        /// Bytes per cluster; the default when absent.
        cluster_size: Option<u64>,
        /// Claim disks that hold something else.
        #[serde(default)]
        force: bool,
    }
    /// Opens a pool from its disks.
    "pool_import" => ImportPool -> PoolInfo {
        /// Member disks.
        disks: Vec<std::path::PathBuf>,
    }
    /// Closes a pool none of whose volumes is exported.
    "pool_export" => ExportPool -> Empty {
        /// Pool name.
        name: String,
    }
    /// Checks a pool's metadata and space accounting.
    "pool_check" => CheckPool -> Empty {
        /// Pool name.
        name: String,
    }
    /// Every open pool.
    "pool_list" => ListPools -> Vec<PoolInfo> {}
    /// What a node's agent reports with each heartbeat: the pools, each volume's
    /// allocated bytes and each namespace's counters; given the mark of this engine's
    /// previous answer, only what changed since it (at rest, next to nothing).
    "usage" => GetUsage -> UsageReport {
        /// The `mark` of the previous answer; everything when absent.
        since: Option<u64>,
    }
    /// Creates a volume.
    "volume_create" => CreateVolume -> VolumeInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// Size in bytes.
        size: u64,
        /// Allocate on first write.
        #[serde(default)]
        thin: bool,
        /// The namespace UUID and NGUID the volume keeps for life; new ones when
        /// absent. A migration's target takes its source's, so hosts see one namespace.
        #[serde(default)]
        identity: Option<VolumeIdentity>,
    }
    /// Takes a snapshot of a volume, crash-consistent: the volume's exports hold new
    /// commands while those under way finish, the snapshot is recorded, and they go
    /// on. The snapshot keeps the volume's data as it was; the volume goes on over it.
    "snapshot_create" => CreateSnapshot -> SnapshotInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        volume: String,
        /// The snapshot's name (unique in the pool, like a volume's).
        name: String,
        /// The namespace UUID and NGUID the snapshot keeps; new ones when absent.
        /// Every replica's copy of one snapshot has the same.
        #[serde(default)]
        identity: Option<VolumeIdentity>,
    }
    /// Holds every write of a replicated volume this engine serves (and waits for
    /// those under way), so that each replica takes a snapshot at the same point in
    /// the write order: until `snapshot_create` of the volume here, a call with
    /// `hold_ms` 0, or `hold_ms` milliseconds (at most 10 s), whichever comes first.
    "volume_hold_writes" => HoldWrites -> Empty {
        /// Pool name.
        pool: String,
        /// Volume name.
        volume: String,
        /// How long at most; 0 lets the writes go on now.
        hold_ms: u64,
    }
    /// Makes a writable volume that reads as a snapshot until written (a clone).
    "volume_clone" => CloneVolume -> VolumeInfo {
        /// Pool name.
        pool: String,
        /// The snapshot.
        snapshot: String,
        /// The new volume's name.
        name: String,
        /// The namespace UUID and NGUID the clone keeps for life; new ones when absent.
        #[serde(default)]
        identity: Option<VolumeIdentity>,
    }
    /// Starts making a volume that lies over a snapshot (a clone) independent of it,
    /// in the background: what it reads from below is copied into it, and then it
    /// lies over nothing. `volume_get` shows the progress (`inflating`).
    "volume_inflate" => InflateVolume -> VolumeInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    }
    /// Deletes a volume that is not exported, or a snapshot (which clones or later
    /// snapshots still lying over it keep, hidden, until they go).
    "volume_delete" => DeleteVolume -> Empty {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    }
    /// One volume.
    "volume_get" => GetVolume -> VolumeInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    }
    /// Grows a volume; namespaces serving it take the new size.
    "volume_resize" => ResizeVolume -> VolumeInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// New size in bytes (grow only).
        size: u64,
    }
    /// The volumes of one pool, or of all.
    "volume_list" => ListVolumes -> Vec<VolumeInfo> {
        /// Pool name; all pools when absent.
        pool: Option<String>,
    }
    /// Tracks a volume's written clusters (for migration).
    "volume_dirty" => VolumeDirty -> DirtyReport {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// What to do.
        action: DirtyAction,
    }
    /// The clusters of a replicated volume written at a generation or later (on the
    /// engine that served them): what a replica that left at that generation lacks.
    "volume_written_since" => VolumeWrittenSince -> WrittenClusters {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// The generation.
        generation: u64,
    }
    /// Brings a replica into a mirrored namespace: the mirror takes it as a leg that
    /// catches up (it gets every write from now on), and what it lacks is copied to it
    /// from this engine's replica, cluster by cluster, under live writes: the clusters
    /// written at generation `since` or later, or every cluster when `since` is none.
    /// Once done, the leg has every write and may join the in-sync set.
    "replica_rebuild" => StartRebuild -> RebuildInfo {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID of the mirror.
        nsid: u32,
        /// The replica, as a leg (`remote:HOST:PORT/NQN/NSID`).
        leg: String,
        /// The generation it left the in-sync set at (a partial rebuild), or none (full).
        #[serde(default)]
        since: Option<u64>,
        /// Bytes per second the copy may take (none: as fast as it goes).
        #[serde(default)]
        rate: Option<u64>,
    }
    /// A rebuild's progress.
    "replica_rebuild_status" => GetRebuild -> RebuildInfo {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID of the mirror.
        nsid: u32,
    }
    /// Starts moving a volume to another engine: its data is copied there in rounds
    /// (all allocated clusters, then what was written since), engine to engine over
    /// NVMe/TCP, while hosts keep using it here.
    "migration_start" => StartMigration -> MigrationInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// What the caller calls this migration; `migration_status` repeats it, so an
        /// earlier migration's outcome is never taken for this one's.
        #[serde(default)]
        id: String,
        /// The target namespace, `HOST:PORT/NQN/NSID`: a volume of the same size on the
        /// other engine, exported to this engine's host NQN with an ANA state it may use.
        target: String,
        /// Most bytes per second the copy may take; unlimited when absent.
        #[serde(default)]
        rate: Option<u64>,
    }
    /// A migration's progress, or `none` and whether the volume is still here.
    "migration_status" => GetMigration -> MigrationInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    }
    /// Lets a migration switch once a round leaves little to copy: hosts' I/O to the
    /// volume is held, the rest copied, the volume deleted here (the point of no
    /// return) and every command forwarded to the target from then on.
    "migration_switch" => SwitchMigration -> MigrationInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// Longest pause of hosts' I/O the switch may cause; it waits for a round that
        /// fits, and gives up on a pause that runs over (I/O goes on here).
        pause_ms: Option<u32>,
    }
    /// Stops a migration that has not switched: the volume stays here, as it was.
    "migration_cancel" => CancelMigration -> MigrationInfo {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    }
    /// Replaces the running engine with a new binary without closing a connection:
    /// the new process takes over every socket and all the state, then this one exits.
    /// If the new binary fails, this engine goes on serving and the call says why.
    "engine_upgrade" => UpgradeEngine -> UpgradeReport {
        /// The new binary; the engine's own executable path when absent (where a
        /// package upgrade puts the new version).
        binary: Option<std::path::PathBuf>,
    }
}

/// Adds a subsystem, as in the TOML configuration.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct AddSubsystem(pub SubsystemConfig);

impl Method for AddSubsystem {
    const NAME: &'static str = "subsystem_add";
    type Reply = Empty;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_keep_their_wire_names_and_fields() {
        let r = ResizeVolume { pool: "p".into(), name: "v".into(), size: 4096 };
        assert_eq!(serde_json::to_value(&r).unwrap(), serde_json::json!({"pool": "p", "name": "v", "size": 4096}));
        assert_eq!(ResizeVolume::NAME, "volume_resize");
        let empty: ListPools = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(empty, ListPools {});
        assert!(
            serde_json::from_value::<GetVolume>(serde_json::json!({"pool": "p"})).is_err(),
            "a missing field fails"
        );
        assert!(serde_json::from_value::<GetVolume>(serde_json::json!({"pool": "p", "name": "v", "x": 1})).is_err());
        assert!(METHODS.contains(&"volume_dirty"));
    }

    #[test]
    fn error_kinds_print_as_they_travel() {
        for kind in [ErrorKind::NotFound, ErrorKind::FailedPrecondition, ErrorKind::Io] {
            assert_eq!(serde_json::to_value(kind).unwrap(), serde_json::Value::String(kind.to_string()));
        }
    }

    #[test]
    fn replies_fail_on_a_renamed_field() {
        let good = serde_json::json!({"nsid": 3});
        assert_eq!(serde_json::from_value::<NamespaceAdded>(good).unwrap().nsid, 3);
        assert!(serde_json::from_value::<NamespaceAdded>(serde_json::json!({"ns_id": 3})).is_err());
    }
}

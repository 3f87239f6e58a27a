//! What the requests carry and the replies hold.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

/// The reply of a call that returns nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// The engine as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineInfo {
    /// The engine's version.
    pub version: String,
    /// Live controllers.
    pub controllers: usize,
    /// Open TCP connections.
    pub connections: usize,
    /// Listeners.
    pub listeners: Vec<ListenerInfo>,
    /// The host NQN this engine presents to the owners of its `remote:` namespaces.
    pub host_nqn: String,
    /// The first controller ID new controllers may get.
    pub cntlid_min: u16,
    /// The last controller ID new controllers may get.
    pub cntlid_max: u16,
    /// The engine's process ID (it changes with a hot upgrade).
    #[serde(default)]
    pub pid: u32,
    /// The IP address its discovery log gives for its listeners, if set
    /// (`discovery_address_set`).
    #[serde(default)]
    pub discovery_address: Option<IpAddr>,
}

/// What a hot upgrade did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpgradeReport {
    /// The process that served before, and its version.
    pub old_pid: u32,
    /// The old engine's version.
    pub old_version: String,
    /// The process that serves now.
    pub new_pid: u32,
    /// The new engine's version.
    pub new_version: String,
    /// Connections handed over, each with its controller and queue state.
    pub connections: usize,
    /// Controllers handed over.
    pub controllers: usize,
    /// How long the new binary took to start, greet and start its reactors, in
    /// microseconds: the old engine served all along.
    pub start_us: u64,
    /// How long no command was read, in microseconds: from the moment the old
    /// engine stopped reading to the moment the new one was told to go on.
    pub pause_us: u64,
    /// Of the pause: finishing the commands under way.
    pub park_us: u64,
    /// Of the pause: checkpointing the pools and sending the state and sockets.
    pub transfer_us: u64,
    /// Of the pause: the new process rebuilding the engine, until it said ready.
    pub rebuild_us: u64,
}

/// A listener, as the discovery log reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListenerInfo {
    /// Port ID reported in the discovery log.
    pub port_id: u16,
    /// IP address.
    pub addr: IpAddr,
    /// TCP port.
    pub port: u16,
    /// Whether hosts connect with TLS.
    #[serde(default)]
    pub tls: TlsMode,
    /// The transport: NVMe/TCP or NVMe over RDMA.
    #[serde(default)]
    pub transport: Transport,
}

/// An engine's address with its transport: where a listener listens, or where a
/// host reaches an engine (as a discovery log entry gives it). Written `IP:PORT`
/// (NVMe/TCP), `tcp:IP:PORT` or `rdma:IP:PORT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PathAddress {
    #[serde(default)]
    pub transport: Transport,
    pub address: SocketAddr,
}

impl std::str::FromStr for PathAddress {
    type Err = String;
    fn from_str(s: &str) -> Result<PathAddress, String> {
        let (transport, rest) = match s.split_once(':') {
            Some((t @ ("tcp" | "rdma"), rest)) => (t.parse()?, rest),
            _ => (Transport::Tcp, s),
        };
        let address = rest
            .parse()
            .map_err(|e| format!("{s:?} is not an address ({e}): write IP:PORT, or rdma:IP:PORT for NVMe over RDMA"))?;
        Ok(PathAddress { transport, address })
    }
}

impl std::fmt::Display for PathAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.transport {
            Transport::Tcp => write!(f, "{}", self.address),
            Transport::Rdma => write!(f, "rdma:{}", self.address),
        }
    }
}

/// The access points one host is to use for a subsystem: every engine serving it
/// lists them in that host's discovery log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPaths {
    pub host: String,
    pub paths: Vec<PathAddress>,
}

/// The NVMe over Fabrics transport a listener speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// NVMe/TCP.
    #[default]
    Tcp,
    /// NVMe over RDMA (RoCE v2, InfiniBand, iWARP), through the RDMA connection manager.
    Rdma,
}

impl Transport {
    /// The name users write (and `nvme-cli`'s `-t`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Tcp => "tcp",
            Transport::Rdma => "rdma",
        }
    }
}

impl std::str::FromStr for Transport {
    type Err = String;

    fn from_str(s: &str) -> Result<Transport, String> {
        match s {
            "tcp" => Ok(Transport::Tcp),
            "rdma" => Ok(Transport::Rdma),
            other => Err(format!("unknown transport {other:?}: use tcp or rdma")),
        }
    }
}

/// Whether a listener takes NVMe/TCP over TLS 1.3 (with a pre-shared key).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TlsMode {
    /// Plain NVMe/TCP only.
    #[default]
    Off,
    /// TLS, or plain NVMe/TCP from hosts that do not start a handshake.
    Allowed,
    /// TLS only: a plain connection is closed.
    Required,
}

impl TlsMode {
    /// The name users write.
    pub fn name(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::Allowed => "allowed",
            TlsMode::Required => "required",
        }
    }
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<TlsMode, String> {
        [TlsMode::Off, TlsMode::Allowed, TlsMode::Required]
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("TLS mode `{s}` is not one of off, allowed, required"))
    }
}

/// A host's pre-shared key for NVMe/TCP over TLS. `Debug` hides the key.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsPsk {
    /// The configured PSK in the interchange format `nvme gen-tls-key` prints
    /// (`NVMeTLSkey-1:01:<base64>:`).
    pub key: String,
    /// How the host's tools derive the TLS key from it: `compat` (libnvme before
    /// mid-2025, e.g. Debian 13's nvme-cli 2.13; the default) or `rfc8446` (SPDK, newer
    /// libnvme). A host that offers a version 1 identity is recognised either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kdf: Option<String>,
}

impl std::fmt::Debug for TlsPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsPsk").field("key", &"(redacted)").field("kdf", &self.kdf).finish()
    }
}

/// A host's TLS pre-shared key in the configuration file (`[[subsystem.tls_psk]]`):
/// the host is allowed too.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostTlsPsk {
    /// Host NQN.
    pub host: String,
    /// The key.
    #[serde(flatten)]
    pub psk: TlsPsk,
}

/// A subsystem.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubsystemInfo {
    /// NQN.
    pub nqn: String,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Whether any host may connect.
    pub allow_any_host: bool,
    /// Allowed hosts.
    pub hosts: Vec<String>,
    /// Live controllers.
    pub controllers: usize,
    /// The hosts those controllers belong to, each once.
    #[serde(default)]
    pub connected_hosts: Vec<String>,
    /// Hosts that must authenticate with DH-HMAC-CHAP (their secrets are never shown).
    #[serde(default)]
    pub authenticated_hosts: Vec<HostAuthInfo>,
    /// Hosts with a TLS pre-shared key (the keys are never shown).
    #[serde(default)]
    pub tls_psk_hosts: Vec<String>,
    /// Namespaces.
    pub namespaces: Vec<NamespaceInfo>,
    /// Its ANA groups and their states, as `ana_list` gives them: one listing tells an
    /// agent every export's states, without a question per subsystem.
    #[serde(default)]
    pub ana_groups: Vec<AnaGroupInfo>,
    /// The hosts given paths of their own (`host_paths_set`), with those paths.
    #[serde(default)]
    pub host_paths: Vec<HostPaths>,
}

/// How a host authenticates, without its secrets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostAuthInfo {
    /// Host NQN.
    pub host: String,
    /// Whether the controller has a secret too, for hosts that authenticate it.
    pub bidirectional: bool,
    /// The hash the controller chooses (`any`: the host's first).
    pub hash: String,
    /// The Diffie-Hellman group the controller chooses.
    pub dh_group: String,
    /// A one-way fingerprint of the secrets (`nvpool_auth::secret::fingerprint`), to
    /// tell whether they are the ones an agent installed.
    #[serde(default)]
    pub fingerprint: String,
}

/// DH-HMAC-CHAP secrets and choices for one host of a subsystem. `Debug` hides the
/// secrets.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DhchapKeys {
    /// The secret the host proves it knows, `DHHC-1:hh:<base64>:` (as `nvme
    /// gen-dhchap-key` prints it).
    pub secret: String,
    /// The controller's own secret, which a host that asks (`nvme connect
    /// --dhchap-ctrl-secret`) checks: bidirectional authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctrl_secret: Option<String>,
    /// The hash the controller chooses among the host's offers: `sha256`, `sha384` or
    /// `sha512`; the host's first choice when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hash: Option<String>,
    /// The Diffie-Hellman group the controller chooses: `null` (none), `ffdhe2048`
    /// (when absent), `ffdhe3072`, `ffdhe4096`, `ffdhe6144` or `ffdhe8192`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dh_group: Option<String>,
}

impl std::fmt::Debug for DhchapKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DhchapKeys")
            .field("secret", &"(redacted)")
            .field("ctrl_secret", &self.ctrl_secret.as_ref().map(|_| "(redacted)"))
            .field("hash", &self.hash)
            .field("dh_group", &self.dh_group)
            .finish()
    }
}

/// A host's DH-HMAC-CHAP secrets in the configuration file
/// (`[[subsystem.dhchap]]`): the host is allowed too. (Unknown fields are refused by
/// `DhchapKeys`, which takes every field but `host`.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostDhchap {
    /// Host NQN.
    pub host: String,
    /// Secrets and choices.
    #[serde(flatten)]
    pub keys: DhchapKeys,
}

/// A namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceInfo {
    /// Namespace ID.
    pub nsid: u32,
    /// Backend kind (`null`, `memory`, `file`, `volume`, ...).
    pub kind: String,
    /// Backend description (path, or kind and size).
    pub backend: String,
    /// Size in bytes.
    pub size: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// UUID.
    pub uuid: String,
    /// NGUID, as 32 hex digits.
    pub nguid: String,
    /// Whether I/O bypasses the page cache.
    pub direct_io: bool,
    /// ANA group.
    pub ana_group: u32,
    /// I/O limits.
    #[serde(default, skip_serializing_if = "QosLimits::is_unlimited")]
    pub qos: QosLimits,
    /// I/O counters.
    pub stats: StatsSnapshot,
    /// The replicas (legs) of a mirrored namespace that failed a command and get no
    /// more: writes that missed them wait until the namespace is served without them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faulted_legs: Vec<FaultedLeg>,
}

/// A replica a mirrored namespace no longer writes to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FaultedLeg {
    /// The leg's backend spec.
    pub leg: String,
    /// The status of the command it failed.
    pub error: String,
}

/// An ANA state (NVMe Base 2.0 §8.1.3) of a group as a host sees it through one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AnaState {
    /// The preferred path.
    Optimized,
    /// Usable; the host prefers an optimized path.
    NonOptimized,
    /// Not usable now: I/O is answered with ANA Inaccessible and the host goes
    /// elsewhere.
    Inaccessible,
    /// Not usable ever again on this path.
    PersistentLoss,
    /// Changing: I/O is answered with ANA Transition until the new state is set.
    Change,
}

impl AnaState {
    /// Every state, in the order of their codes.
    pub const ALL: [AnaState; 5] = [
        AnaState::Optimized,
        AnaState::NonOptimized,
        AnaState::Inaccessible,
        AnaState::PersistentLoss,
        AnaState::Change,
    ];

    /// The state's name, as the API and the CLI spell it.
    pub fn name(self) -> &'static str {
        match self {
            AnaState::Optimized => "optimized",
            AnaState::NonOptimized => "non-optimized",
            AnaState::Inaccessible => "inaccessible",
            AnaState::PersistentLoss => "persistent-loss",
            AnaState::Change => "change",
        }
    }
}

impl std::fmt::Display for AnaState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for AnaState {
    type Err = String;

    fn from_str(s: &str) -> Result<AnaState, String> {
        AnaState::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| {
            let names: Vec<&str> = AnaState::ALL.iter().map(|a| a.name()).collect();
            format!("{s:?} is not an ANA state: use one of {}", names.join(", "))
        })
    }
}

/// One ANA group of a subsystem on this engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnaGroupInfo {
    /// ANA group ID.
    pub group: u32,
    /// Its namespaces.
    pub nsids: Vec<u32>,
    /// Its state for hosts without one of their own.
    pub state: AnaState,
    /// Hosts that see another state, with that state.
    pub hosts: Vec<AnaHostState>,
}

/// A host's own state for an ANA group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnaHostState {
    /// Host NQN.
    pub host: String,
    /// The state it sees.
    pub state: AnaState,
}

/// The engine's usage (`usage`): everything, or what changed since an earlier answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageReport {
    /// Passed as `since` next time, it asks for what changed after this answer.
    pub mark: u64,
    /// True: everything is listed (no `since`, or one that is not this engine's last
    /// mark: another caller asked since, or another process answers), and the caller
    /// forgets what it kept. False: only what changed since `since`.
    pub complete: bool,
    /// Every pool (always all of them: a node has few).
    pub pools: Vec<PoolInfo>,
    /// Volumes whose allocated bytes changed (all of them when complete).
    pub volumes: Vec<VolumeUsage>,
    /// Volumes deleted since `since`.
    pub volumes_gone: Vec<VolumeUsage>,
    /// Namespaces whose counters changed (all of them when complete).
    pub namespaces: Vec<NamespaceUsage>,
    /// Namespaces removed since `since`.
    pub namespaces_gone: Vec<NamespaceUsage>,
    /// Every mirrored namespace that needs its controller: one with a faulted leg or
    /// a leg catching up (always all of them: they are few, and each waits for an
    /// answer).
    #[serde(default)]
    pub mirrors: Vec<MirrorUsage>,
    /// The subsystems exporting a replica (`replica:`) that no engine is connected to:
    /// the engine that writes them is gone (or not there yet). Always all of them.
    #[serde(default)]
    pub replicas_unconnected: Vec<String>,
}

/// A mirrored namespace in a [`UsageReport`]: its faulted legs and its rebuild.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MirrorUsage {
    /// Subsystem NQN.
    pub nqn: String,
    /// Namespace ID.
    pub nsid: u32,
    /// The generation the mirror serves at (0: none given).
    pub generation: u64,
    /// The legs that failed a command.
    pub faulted_legs: Vec<FaultedLeg>,
    /// The rebuild of a leg catching up, if one is.
    pub rebuild: Option<RebuildInfo>,
}

/// One volume's space in a [`UsageReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeUsage {
    /// Pool name.
    pub pool: String,
    /// Volume name.
    pub name: String,
    /// Bytes of clusters allocated to the volume (0 in `volumes_gone`).
    pub allocated_bytes: u64,
}

/// One namespace's counters in a [`UsageReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceUsage {
    /// Subsystem NQN.
    pub nqn: String,
    /// Namespace ID.
    pub nsid: u32,
    /// Its counters (zeros in `namespaces_gone`).
    pub stats: StatsSnapshot,
}

/// Per-namespace I/O counters, summed over all reactors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Read commands completed.
    pub reads: u64,
    /// Write commands completed.
    pub writes: u64,
    /// Bytes read.
    pub read_bytes: u64,
    /// Bytes written.
    pub write_bytes: u64,
    /// Other commands (flush, write zeroes, dataset management).
    pub others: u64,
    /// Commands that failed.
    pub errors: u64,
    /// Commands answered, failed ones included.
    #[serde(default)]
    pub completed: u64,
    /// The latencies of the commands answered, summed, in nanoseconds: the mean
    /// latency over a span is its change over `completed`'s.
    #[serde(default)]
    pub latency_ns: u64,
}

/// What `namespace_add` made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamespaceAdded {
    /// The namespace ID it got.
    pub nsid: u32,
}

/// A pool.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolInfo {
    /// Name.
    pub name: String,
    /// UUID.
    pub uuid: String,
    /// Member disks, in order.
    pub disks: Vec<String>,
    /// Bytes per cluster.
    pub cluster_size: u64,
    /// Bytes of data space.
    pub capacity_bytes: u64,
    /// Bytes allocated to volumes.
    pub used_bytes: u64,
    /// Bytes free.
    pub free_bytes: u64,
    /// Sum of the volumes' sizes (more than the capacity when thin volumes overcommit).
    pub provisioned_bytes: u64,
    /// Number of volumes.
    pub volumes: usize,
    /// Why the pool stopped accepting changes, if it did.
    pub failed: Option<String>,
    /// Its metadata journal.
    #[serde(default)]
    pub journal: JournalInfo,
    /// How many times it was opened after its machine stopped with it open (a power
    /// loss: its disks may have lost writes they cached).
    #[serde(default)]
    pub power_losses: u32,
    /// Bytes of `used_bytes` that snapshots hold (hidden ones too): shared with the
    /// volumes and clones over them, which read what they have not rewritten from
    /// there. The rest is each volume's own.
    #[serde(default)]
    pub snapshot_bytes: u64,
}

/// A pool's metadata journal: where allocation changes are made durable before they
/// are used, until a checkpoint of the whole metadata empties it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalInfo {
    /// Bytes the journal holds.
    pub size_bytes: u64,
    /// Bytes of it in use since the last checkpoint.
    pub used_bytes: u64,
    /// Entries written since the pool was opened (each one a durable write).
    pub entries: u64,
    /// Checkpoints written since the pool was opened.
    pub checkpoints: u64,
    /// The checkpoint generation the metadata is at.
    pub generation: u64,
}

/// A volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// Pool name.
    pub pool: String,
    /// Volume name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Thin (allocated on write) or thick.
    pub thin: bool,
    /// Bytes of clusters allocated to the volume.
    pub allocated_bytes: u64,
    /// Namespace UUID.
    pub uuid: String,
    /// Namespace NGUID (32 hex digits).
    pub nguid: String,
    /// Whether written clusters are being tracked.
    pub dirty_tracking: bool,
    /// A read-only snapshot (of the volume it was taken of).
    #[serde(default)]
    pub snapshot: bool,
    /// The snapshot it lies over (reads what it does not hold from there); empty for
    /// none.
    #[serde(default)]
    pub parent: String,
    /// How far its inflation is, while one is under way (`volume_inflate`), or why
    /// the last one stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inflating: Option<InflateProgress>,
}

/// An inflation under way, or one that stopped: clusters the volume read from below
/// that are its own now, of those it read when the inflation began.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InflateProgress {
    /// Clusters done.
    pub copied: u64,
    /// Clusters to do.
    pub total: u64,
    /// Why it stopped before it was done (inflating the volume again goes on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
}

/// A snapshot taken: its volume entry, and how long the volume's I/O was held.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// The snapshot.
    pub snapshot: VolumeInfo,
    /// Microseconds the volume's exports held new commands.
    pub pause_us: u64,
}

/// What `volume_dirty` does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DirtyAction {
    /// Start tracking (clears the set).
    Start,
    /// Stop tracking.
    Stop,
    /// Report the set.
    Report,
    /// Report the set and clear it.
    Reset,
}

/// The dirty clusters of a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyReport {
    /// Whether tracking is on.
    pub tracking: bool,
    /// Bytes per cluster.
    pub cluster_size: u64,
    /// Indexes of the clusters written since tracking started or the last reset.
    pub clusters: Vec<u64>,
}

/// The clusters of a replicated volume written since a generation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenClusters {
    /// The latest generation that took the volume (0: none).
    pub generation: u64,
    /// Bytes per cluster.
    pub cluster_size: u64,
    /// Indexes of the clusters written at the generation asked or later.
    pub clusters: Vec<u64>,
    /// Whether this engine recorded every write since that generation (it served the
    /// volume all along): only then does a rebuild copy those clusters alone.
    #[serde(default)]
    pub complete: bool,
}

/// The identity a volume's namespace keeps for life.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeIdentity {
    /// Namespace UUID.
    pub uuid: String,
    /// Namespace NGUID (32 hex digits).
    pub nguid: String,
}

/// Where a migration stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationState {
    /// No migration of this volume runs on this engine.
    None,
    /// Copying rounds; hosts use the volume here.
    Copying,
    /// Holding hosts' I/O and copying the last of it.
    Switching,
    /// Done: the volume is on the target, and this engine forwards to it.
    Switched,
    /// Stopped by an error; the volume is here, as it was.
    Failed,
    /// Stopped on request; the volume is here, as it was.
    Cancelled,
}

/// A rebuild's progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RebuildInfo {
    /// The replica, as a leg of the mirror.
    pub leg: String,
    /// `copying`, `done`, `failed` or `none` (no rebuild of this namespace).
    pub state: String,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub error: String,
    /// Bytes to copy (the clusters the rebuild names).
    pub total_bytes: u64,
    /// Bytes copied so far.
    pub copied_bytes: u64,
}

/// A migration's progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationInfo {
    /// The ID the migration was started with.
    #[serde(default)]
    pub id: String,
    /// Where it stands.
    pub state: MigrationState,
    /// Whether the volume is still in this engine's pool (it is deleted at the switch).
    pub volume_here: bool,
    /// The target, as given.
    pub target: String,
    /// Rounds begun (the first copies every allocated cluster).
    pub round: u32,
    /// Bytes copied over all rounds.
    pub copied_bytes: u64,
    /// Bytes written since the current round began, to copy next.
    pub dirty_bytes: u64,
    /// Bytes the first round copies (the volume's allocated clusters).
    pub allocated_bytes: u64,
    /// Bytes per second over the last round.
    pub rate: u64,
    /// Bytes each finished round copied.
    pub round_bytes: Vec<u64>,
    /// Whether the switch was asked for.
    pub switch_requested: bool,
    /// How long hosts' I/O was held at the switch, in microseconds.
    pub pause_us: Option<u64>,
    /// Switches begun and given up because the pause would have run over.
    pub pauses_given_up: u32,
    /// Bytes per second hosts may write while the rounds do not shrink enough to
    /// switch (writes wait in the engine meanwhile); 0 when hosts are not held back.
    #[serde(default)]
    pub throttle: u64,
    /// Why it failed.
    pub error: Option<String>,
}

/// A namespace, in the configuration file and in `namespace_add`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct NamespaceConfig {
    /// Namespace ID; the next free one when absent.
    pub nsid: Option<u32>,
    /// `null:SIZE`, `memory:SIZE`, `file:PATH`, `file:PATH:SIZE` or `volume:POOL/NAME`.
    pub backend: String,
    /// Block size: 512 or 4096, or 0 for 4096 where the storage writes 4 KiB whole
    /// across a power loss and 512 elsewhere.
    #[serde(default = "default_block_size")]
    pub block_size: u32,
    /// UUID; derived from the subsystem NQN and NSID when absent, so it is stable.
    /// Volumes always use the UUID and NGUID stored with them.
    pub uuid: Option<uuid::Uuid>,
    /// Serve blocks larger than the storage writes whole across a power loss. The
    /// host is told one block is always written whole (AWUPF 0); with this set, a
    /// block written without a Flush may come back part old, part new after a power
    /// cut. Off by default: such a namespace is refused.
    #[serde(default)]
    pub allow_torn_writes: bool,
    /// ANA group (1 to 1024); the namespace ID when absent. Every path to the
    /// namespace must put it in the same group.
    #[serde(default)]
    pub ana_group: Option<u32>,
    /// I/O limits; none when absent.
    #[serde(default, skip_serializing_if = "QosLimits::is_unlimited")]
    pub qos: QosLimits,
}

/// Limits on a namespace's I/O, enforced by the engine serving it: over-limit commands
/// wait, they never fail. 0 is no limit. Operations count every command; bytes count
/// the data reads and writes move. A command is let through while its budget is
/// positive and its whole cost is then taken, so one larger than a millisecond's
/// budget waits for the next ones.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QosLimits {
    /// Commands per second, reads, writes and others together.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub iops: u64,
    /// Reads per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_iops: u64,
    /// Writes per second (Write, Write Zeroes and Dataset Management).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_iops: u64,
    /// Bytes read and written per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bps: u64,
    /// Bytes read per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub read_bps: u64,
    /// Bytes written per second.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub write_bps: u64,
}

impl QosLimits {
    /// Whether no limit is set.
    pub fn is_unlimited(&self) -> bool {
        *self == QosLimits::default()
    }

    /// The limits as `name=value` pairs, for people: `iops=5000 bps=200MiB/s`, or
    /// `none`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for (name, v) in [("iops", self.iops), ("read_iops", self.read_iops), ("write_iops", self.write_iops)] {
            if v != 0 {
                parts.push(format!("{name}={v}"));
            }
        }
        for (name, v) in [("bps", self.bps), ("read_bps", self.read_bps), ("write_bps", self.write_bps)] {
            if v != 0 {
                parts.push(format!("{name}={}", bytes_per_second(v)));
            }
        }
        if parts.is_empty() { "none".into() } else { parts.join(" ") }
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A rate in the largest binary unit that divides it: `200MiB/s`, `1500B/s`.
fn bytes_per_second(v: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if v >= 1 << shift && v.is_multiple_of(1 << shift) {
            return format!("{}{unit}/s", v >> shift);
        }
    }
    format!("{v}B/s")
}

fn default_block_size() -> u32 {
    512
}

/// A subsystem, in the configuration file and in `subsystem_add`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    /// NQN.
    pub nqn: String,
    /// Serial number; derived from the NQN when absent.
    pub serial: Option<String>,
    /// Model number.
    #[serde(default = "default_model")]
    pub model: String,
    /// Whether any host may connect.
    #[serde(default)]
    pub allow_any_host: bool,
    /// Hosts allowed to connect.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// Hosts that must authenticate with DH-HMAC-CHAP (allowed as well).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dhchap: Vec<HostDhchap>,
    /// Hosts' pre-shared keys for NVMe/TCP over TLS (allowed as well).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tls_psk: Vec<HostTlsPsk>,
    /// Namespaces.
    #[serde(default, rename = "namespace")]
    pub namespaces: Vec<NamespaceConfig>,
}

fn default_model() -> String {
    "nvpool".into()
}

/// A local device: a namespace served to this node's own containers and VMs without
/// NVMe/TCP, in the configuration file (`[[local]]`) and in `local_add`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LocalDeviceConfig {
    /// What it serves: `NQN/NSID`, or `volume:POOL/NAME` for the namespace that serves
    /// that volume.
    pub target: String,
    /// The ublk device number (the N of `/dev/ublkbN`); the first free one when absent.
    /// A device of that number left by an engine that exited is taken back, with the
    /// I/O it held.
    #[serde(default)]
    pub ublk_id: Option<u32>,
    /// Refuse writes.
    #[serde(default)]
    pub read_only: bool,
    /// Requests in flight per queue (one queue per reactor); 128 when absent.
    #[serde(default)]
    pub queue_depth: Option<u16>,
    /// Serve it as a vhost-user-blk device at this Unix socket (for QEMU's
    /// `vhost-user-blk-pci`) instead of a ublk block device.
    #[serde(default)]
    pub vhost_user_blk: Option<String>,
}

/// A local device, as `local_list` reports it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct LocalDeviceInfo {
    /// `ublk` or `vhost-user-blk`.
    pub kind: String,
    /// The block device, e.g. `/dev/ublkb0`, or the vhost-user socket.
    pub device: String,
    /// The ublk device number (none for vhost-user-blk).
    #[serde(default)]
    pub ublk_id: Option<u32>,
    /// What it serves, `NQN/NSID`.
    pub target: String,
    /// Size in bytes.
    pub size: u64,
    /// Block size.
    pub block_size: u32,
    /// Whether writes are refused.
    pub read_only: bool,
    /// Queues (one per reactor; the most offered for vhost-user-blk).
    pub queues: u16,
    /// Requests in flight per queue (0 for vhost-user-blk: the frontend sizes its
    /// virtqueues).
    pub queue_depth: u16,
    /// How data moves between the device and the engine, and why.
    pub data_path: String,
    /// Whether it was taken back from an engine that exited, rather than created.
    pub recovered: bool,
}

/// What `local_add` made.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct LocalDeviceAdded {
    /// The device.
    pub device: LocalDeviceInfo,
}

/// Parses a size such as `4096`, `256MiB`, `1G` or `2TiB` (binary units).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let n: u64 = num.parse().map_err(|_| format!("size {s:?} must start with a number, e.g. 256MiB"))?;
    let shift = match unit {
        "" | "B" => 0,
        "k" | "K" | "KiB" | "KB" => 10,
        "M" | "MiB" | "MB" => 20,
        "G" | "GiB" | "GB" => 30,
        "T" | "TiB" | "TB" => 40,
        _ => {
            return Err(format!("size unit {unit:?} is unknown: use B, KiB, MiB, GiB or TiB"));
        }
    };
    let v = n.checked_mul(1u64 << shift).ok_or_else(|| format!("size {s:?} is too large"))?;
    if v == 0 {
        return Err(format!("size {s:?} must be greater than zero"));
    }
    Ok(v)
}

/// Parses a rate in bytes per second: a size with or without `/s` (`200MiB/s`), or 0
/// for none.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let size = s.trim().strip_suffix("/s").unwrap_or(s.trim());
    if size == "0" {
        return Ok(0);
    }
    parse_size(size).map_err(|e| format!("{e}; a rate reads like 200MiB/s, or 0 for no limit"))
}

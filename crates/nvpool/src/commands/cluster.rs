//! Command-line verbs of the control plane: running the controller and the agent, and
//! managing nodes, pools, volumes and attachments through the controller.

use crate::output::{QosArgs, human, parse_size, print_or, render};
use clap::{Args, Subcommand};
use nvpool_control::access::AccessPolicy;
use nvpool_control::client::Controllers;
use nvpool_control::cluster::ClusterConfig;
use nvpool_control::durability::{self, DurabilityConfig};
use nvpool_control::proto;
use nvpool_control::scheduler::{Policy, Weights};
use nvpool_control::sim::{self, SimConfig};
use nvpool_control::tls::{CONTROLLER, NODE_PREFIX, Tls};
use nvpool_control::{agent, server};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Subcommand)]
pub enum Command {
    /// Run the controller: cluster state, scheduler and the Controller API.
    Controller(ControllerArgs),
    /// Run a node agent: registers the node and drives its engine.
    Agent(AgentArgs),
    /// Show the cluster's nodes.
    Node {
        #[command(subcommand)]
        verb: NodeVerb,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Show the cluster's pools (to manage one node's pools: `nvpool engine pool`).
    Pool {
        #[command(subcommand)]
        verb: ClusterPoolVerb,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Create, resize, delete and list the cluster's volumes.
    Volume {
        #[command(subcommand)]
        verb: Box<ClusterVolumeVerb>,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Take, list and delete snapshots of the cluster's volumes.
    Snapshot {
        #[command(subcommand)]
        verb: SnapshotVerb,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Allow a host on a volume and print how it connects.
    Attach {
        /// Volume name.
        volume: String,
        /// The host's NQN (`cat /etc/nvme/hostnqn` on the host).
        host_nqn: String,
        /// Record the attachment as read-only.
        #[arg(long)]
        readonly: bool,
        /// Show why each node is or is not an access point.
        #[arg(long)]
        explain: bool,
        /// Make this node the host's optimized access point (also moves the
        /// optimized path of an attached host).
        #[arg(long, default_value = "")]
        optimized: String,
        /// The node the host runs on: where it owns the volume, the host gets a local
        /// block device (ublk) instead of NVMe/TCP paths; elsewhere NVMe/TCP, and why.
        #[arg(long, value_name = "NODE", default_value = "")]
        local: String,
        /// The host must authenticate (DH-HMAC-CHAP): the controller makes its secrets
        /// and prints them (keep them secret; detach revokes them).
        #[arg(long)]
        dhchap: bool,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Remove a host from a volume's allow-list.
    Detach {
        /// Volume name.
        volume: String,
        /// The host's NQN.
        host_nqn: String,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Replay a synthetic cluster through the scheduler and compare placement policies.
    Sim(SimArgs),
    /// Measure a controller of its own (embedded store) against simulated nodes: each
    /// registers, heartbeats and applies its states over the real protocol, with no
    /// engine; volumes are created at a set rate, then the controller is killed and
    /// started again. Prints a table.
    Fleet(FleetArgs),
    /// Serve the CSI driver (controller and/or node plugin) on a Unix socket.
    Csi(CsiArgs),
    /// Show the busiest volumes and nodes, refreshed: IOPS, throughput and latency
    /// from the engines' counters.
    Top {
        /// How often to refresh, e.g. 2s.
        #[arg(long, default_value = "2s", value_parser = parse_duration)]
        every: Duration,
        /// How many volumes and nodes to show.
        #[arg(long, default_value_t = 20)]
        rows: usize,
        /// Print one screen and exit.
        #[arg(long)]
        once: bool,
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Show which controller leads and which store it uses.
    ClusterInfo {
        #[command(flatten)]
        api: ControllerApi,
    },
    /// Make certificates for mutual TLS in the control plane.
    Certs {
        #[command(subcommand)]
        verb: CertsVerb,
    },
}

#[derive(Subcommand)]
pub enum CertsVerb {
    /// Make a CA and certificates for a test cluster: the controller, an agent per
    /// node (node:NAME), and clients (client:admin for the CLI, client:csi, more with
    /// --client). Keys are written 0600.
    Init {
        /// Where to write them (ca.pem, NAME.pem, NAME.key).
        #[arg(long)]
        dir: PathBuf,
        /// A node name (repeatable).
        #[arg(long)]
        node: Vec<String>,
        /// Another client name (repeatable).
        #[arg(long)]
        client: Vec<String>,
        /// A host name or IP address servers are reached by, besides localhost
        /// (repeatable).
        #[arg(long)]
        name: Vec<String>,
    },
}

#[derive(Args)]
pub struct ControllerApi {
    /// Controller addresses, HOST:PORT[,HOST:PORT...]; the leader is found among them.
    #[arg(long, global = true, env = "NVPOOL_CONTROLLER", default_value = "127.0.0.1:9400")]
    controller: String,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Mutual TLS: the directory of `nvpool certs init` (ca.pem and this client's
    /// certificate and key).
    #[arg(long, global = true, env = "NVPOOL_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Which certificate of --tls-dir to present.
    #[arg(long, global = true, env = "NVPOOL_TLS_IDENTITY", default_value = "client:admin")]
    tls_identity: String,
}

impl ControllerApi {
    /// The controllers, over mutual TLS when --tls-dir is given.
    fn controllers(&self) -> Result<Controllers, String> {
        let tls = self.tls_dir.as_deref().map(|d| Tls::load(d, &self.tls_identity)).transpose()?;
        Controllers::with_tls(&self.controller, tls.as_ref())
    }
}

#[derive(Args)]
pub struct ControllerArgs {
    /// Address to serve the Controller API on.
    #[arg(long, default_value = "127.0.0.1:9400")]
    listen: SocketAddr,
    /// Address clients are told to use for this controller (default: --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// Store: redb:PATH (embedded, the default) or etcd:http://HOST:PORT[,...] (HA).
    #[arg(long, default_value = "redb:/var/lib/nvpool/controller.redb")]
    store: String,
    /// A node whose heartbeats stop for this long is unhealthy (stretched in
    /// proportion when the heartbeat budget stretches the interval).
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    node_timeout: Duration,
    /// How often agents heartbeat.
    #[arg(long, value_parser = parse_duration, default_value = "1s")]
    heartbeat_interval: Duration,
    /// Most heartbeats per second the controller takes: with more nodes than this
    /// times the interval, each heartbeats less often (10,000 nodes: every 5 s).
    #[arg(long, default_value_t = nvpool_control::cluster::DEFAULT_HEARTBEAT_BUDGET)]
    heartbeat_budget: u32,
    /// How long a dead leader keeps leadership (etcd only).
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    lease_ttl: Duration,
    /// Scheduler weight of the locality preference.
    #[arg(long, allow_negative_numbers = true, default_value_t = Weights::default().locality)]
    weight_locality: f64,
    /// Scheduler weight of keeping the room a node's own pods are expected to need for
    /// local volumes (0: no reserves).
    #[arg(long, allow_negative_numbers = true, default_value_t = Weights::default().reserve)]
    weight_reserve: f64,
    /// Scheduler weight of fullness (fuller pools score higher).
    #[arg(long, allow_negative_numbers = true, default_value_t = Weights::default().space)]
    weight_space: f64,
    /// Thin volumes may promise up to this multiple of a pool's capacity.
    #[arg(long, default_value_t = Policy::default().thin_overcommit)]
    thin_overcommit: f64,
    /// How often the rebalancer looks for volumes to move: local volumes placed away
    /// for want of room go home, and room is made for volumes that fit nowhere
    /// (0: the rebalancer is off).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    rebalance_every: Duration,
    /// Most bytes per second each of the rebalancer's copies takes, e.g. 200MiB
    /// (default: no limit).
    #[arg(long, value_parser = parse_size)]
    rebalance_rate: Option<u64>,
    /// Most bytes per second each replica's rebuild takes, e.g. 200MiB (0: no
    /// limit), so that the volume's host keeps its speed.
    #[arg(long, value_parser = parse_size, default_value_t = nvpool_control::cluster::DEFAULT_REBUILD_RATE)]
    rebuild_rate: u64,
    /// How long a replica's node may stay away before the replica is made anew on
    /// another node (rebuilt in full).
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    replica_timeout: Duration,
    /// Rebuilds a node takes part in at once (copying from it or to it).
    #[arg(long, default_value_t = 2)]
    rebuilds_per_node: usize,
    /// Mutual TLS: the directory of `nvpool certs init`; callers then need a
    /// certificate from its CA, and agents their node's.
    #[arg(long, env = "NVPOOL_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9482.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Serve the pool's dashboard (a read-only web page) at http://ADDR/, e.g.
    /// 127.0.0.1:9483; with --tls-dir, HTTPS that wants a client certificate from the CA.
    #[arg(long)]
    http_listen: Option<SocketAddr>,
}

#[derive(Args)]
pub struct AgentArgs {
    /// Node name (default: the host name).
    #[arg(long)]
    name: Option<String>,
    /// Controller addresses, HOST:PORT[,HOST:PORT...].
    #[arg(long, env = "NVPOOL_CONTROLLER", default_value = "127.0.0.1:9400")]
    controller: String,
    /// Address to serve the Agent API on.
    #[arg(long, default_value = "127.0.0.1:9401")]
    listen: SocketAddr,
    /// Address the controller uses to reach this agent (default: --listen).
    #[arg(long)]
    advertise: Option<String>,
    /// The engine's management socket.
    #[arg(long, default_value_os_t = nvpool_engine::config::default_socket())]
    engine_socket: PathBuf,
    /// Where hosts reach the engine: IP:PORT over NVMe/TCP, rdma:IP:PORT over RDMA
    /// (default: its first listener).
    #[arg(long)]
    nvme_address: Option<String>,
    /// Where other engines reach this one over NVMe/TCP when they forward to it
    /// (default: the hosts' address, or the engine's first TCP listener when hosts use
    /// RDMA), e.g. on a storage network apart from the hosts'.
    #[arg(long)]
    peer_address: Option<String>,
    /// The host NQN of this node's own NVMe host, which its CSI node plugin presents:
    /// such a host on the volume's owner gets a local device (default:
    /// /etc/nvme/hostnqn, if there is one).
    #[arg(long)]
    local_host_nqn: Option<String>,
    /// Topology label KEY=VALUE (repeatable), e.g. rack=r7.
    #[arg(long, value_parser = parse_label)]
    label: Vec<(String, String)>,
    /// The node's failure domain (the label zone=Z): the replicas of one volume go to
    /// distinct zones where there are enough.
    #[arg(long)]
    zone: Option<String>,
    /// Mutual TLS: the directory of `nvpool certs init`; the agent presents its node's
    /// certificate (node:NAME) and takes orders only from the controller's.
    #[arg(long, env = "NVPOOL_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9481.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

#[derive(Args)]
pub struct CsiArgs {
    /// The CSI socket: unix:///path or a path.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    endpoint: String,
    /// Which services to serve: controller, node or all.
    #[arg(long, default_value = "all", value_parser = ["controller", "node", "all"])]
    mode: String,
    /// nvpool controller addresses, HOST:PORT[,HOST:PORT...] (controller plugin).
    #[arg(long, env = "NVPOOL_CONTROLLER", default_value = "127.0.0.1:9400")]
    controller: String,
    /// This node's name, its topology (default: the host name).
    #[arg(long)]
    node_name: Option<String>,
    /// This host's NQN, the CSI node ID (default: /etc/nvme/hostnqn).
    #[arg(long)]
    host_nqn: Option<String>,
    /// Where the node plugin records staged volumes.
    #[arg(long, default_value = "/var/lib/nvpool/csi")]
    state_dir: PathBuf,
    /// Mutual TLS to the controller: the directory of `nvpool certs init`.
    #[arg(long, env = "NVPOOL_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// Which certificate of --tls-dir to present.
    #[arg(long, default_value = "client:csi")]
    tls_identity: String,
    /// The Kubernetes API server, https://HOST:PORT, for hosts' DH-HMAC-CHAP secrets
    /// (StorageClass parameter dhchap: "true"); in a pod, the pod's own is used.
    #[arg(long, requires_all = ["kube_token_file", "kube_ca_file"])]
    kube_api: Option<String>,
    /// A file with the bearer token for --kube-api.
    #[arg(long)]
    kube_token_file: Option<PathBuf>,
    /// The CA certificates (PEM) that --kube-api's certificate chains to.
    #[arg(long)]
    kube_ca_file: Option<PathBuf>,
    /// The namespace of the Secrets with hosts' DH-HMAC-CHAP secrets (default: the
    /// pod's own, else nvpool).
    #[arg(long)]
    secret_namespace: Option<String>,
}

#[derive(Args)]
pub struct FleetArgs {
    /// Where the controllers keep the pool: embedded (one controller, redb) or etcd
    /// (three etcd members on 127.0.0.1, a leader and a standby controller).
    #[arg(long, default_value = "embedded")]
    store: nvpool_control::fleet::StoreKind,
    /// Simulated nodes.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Volumes to create (16 MiB, thick unless --thin).
    #[arg(long, default_value_t = 10000)]
    volumes: usize,
    /// Create thin volumes: they take no room, and spread by what each pool promised.
    #[arg(long)]
    thin: bool,
    /// Creations per second, all clients together.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Clients creating at once.
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// Seconds to watch the controller at rest, before the failover.
    #[arg(long, default_value_t = 10.0)]
    rest: f64,
    /// Keep the controller's store and log here (default: a temporary directory).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Write each creation's latencies here (CSV: volume, create ms, attach ms), for
    /// bench/plot-fleet.
    #[arg(long)]
    samples: Option<std::path::PathBuf>,
    /// Instead of the bench: replay `nvpool sim`'s run of this seed (its nodes and
    /// their disks, its creations and deletions, up to --volumes creations or a full
    /// pool) through a controller, one creation at a time, and fail unless every
    /// volume lands where the simulator put it.
    #[arg(long)]
    replay: Option<u64>,
}

#[derive(Args)]
pub struct SimArgs {
    /// Policies to compare, in this order: reserve, reserve+migrate, emptiest+migrate,
    /// fullest, emptiest, most-free, local-only, or weights:LOCALITY/RESERVE/SPACE[+migrate].
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "reserve,reserve+migrate,emptiest+migrate,fullest,emptiest,most-free,local-only"
    )]
    policies: Vec<String>,
    /// Nodes in the cluster.
    #[arg(long, default_value_t = SimConfig::default().nodes)]
    nodes: usize,
    /// Share of nodes with 8 disks.
    #[arg(long, default_value_t = SimConfig::default().heavy_fraction)]
    heavy_fraction: f64,
    /// Share of nodes without disks.
    #[arg(long, default_value_t = SimConfig::default().diskless_fraction)]
    diskless_fraction: f64,
    /// Median volume size.
    #[arg(long, value_parser = parse_size, default_value = "200GiB")]
    median_size: u64,
    /// Share of pods (databases) whose volumes ask for their own node.
    #[arg(long, default_value_t = SimConfig::default().local_share)]
    local_share: f64,
    /// Where pods run: "disks" (database pods follow the disks) or "independent" (one
    /// weight per node for every pod, whatever its disks).
    #[arg(long, default_value = "disks", value_parser = ["disks", "independent"])]
    demand: String,
    /// Sigma of each node's log-normal demand factor.
    #[arg(long, default_value_t = SimConfig::default().demand_spread)]
    demand_spread: f64,
    /// Mean lifetime of long-lived pods, in pod arrivals that would fill the pool once.
    #[arg(long, default_value_t = SimConfig::default().lifetime)]
    lifetime: f64,
    /// Share of volumes that may be hot-migrated.
    #[arg(long, default_value_t = SimConfig::default().movable_share)]
    movable_share: f64,
    /// Random seed; the same seed replays the same cluster and stream.
    #[arg(long, default_value_t = SimConfig::default().seed)]
    seed: u64,
    /// Print the reports as JSON.
    #[arg(long)]
    json: bool,
    /// Measure scheduler speed (decisions per second, p50 and p99) instead.
    #[arg(long)]
    bench: bool,
    /// Decisions to time with --bench.
    #[arg(long, default_value_t = 20000)]
    decisions: usize,
    /// Simulate replicated volumes under node failures instead: time back to full
    /// redundancy and lost volumes, for each --rebuild-rates.
    #[arg(long)]
    replication: bool,
    #[command(flatten)]
    durability: DurabilityArgs,
}

/// The replication model's parameters (`nvpool sim --replication`).
#[derive(Args)]
pub struct DurabilityArgs {
    /// Copies of each volume.
    #[arg(long, default_value_t = DurabilityConfig::default().replicas)]
    replicas: usize,
    /// Volumes per node.
    #[arg(long, default_value_t = DurabilityConfig::default().volumes_per_node)]
    volumes_per_node: usize,
    /// Each volume's mean write rate (what a replica away misses), e.g. 1MB.
    #[arg(long, value_parser = parse_size, default_value = "1MiB")]
    write_rate: u64,
    /// Failures per node and year.
    #[arg(long, default_value_t = DurabilityConfig::default().failures_per_node_year)]
    failures_per_node_year: f64,
    /// Mean time a failed node stays away.
    #[arg(long, value_parser = parse_duration, default_value = "30m")]
    repair: Duration,
    /// Share of failures that lose the node's disks.
    #[arg(long, default_value_t = DurabilityConfig::default().disk_loss_share)]
    disk_loss_share: f64,
    /// How long a replica's node may stay away before the replica is made anew.
    #[arg(long, value_parser = parse_duration, default_value = "5m")]
    replica_timeout: Duration,
    /// Rebuilds a node takes at once.
    #[arg(long, default_value_t = DurabilityConfig::default().rebuild_cap)]
    rebuild_cap: usize,
    /// Years to simulate.
    #[arg(long, default_value_t = DurabilityConfig::default().years)]
    years: f64,
    /// The rebuild rates to compare (bytes per second each).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "25MiB,50MiB,100MiB,200MiB,400MiB")]
    rebuild_rates: Vec<u64>,
}

#[derive(Subcommand)]
pub enum NodeVerb {
    /// List nodes with health, address and capacity.
    List,
    /// Move every volume off a node (to nodes the scheduler picks), one at a time.
    Drain {
        /// Node name.
        name: String,
        #[command(flatten)]
        how: MoveArgs,
    },
    /// Hot-upgrade a node's engine (every connection stays), or every node's, one by
    /// one: each must be healthy again, running the new version, before the next.
    Upgrade {
        /// Node name.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        name: Option<String>,
        /// Every node, in name order; stops at the first that fails.
        #[arg(long)]
        all: bool,
        /// The new nvpool binary, a path on the nodes (default: each engine's own
        /// executable path, where a package upgrade puts the new version).
        #[arg(long)]
        binary: Option<String>,
        /// How long a node may take to be healthy again with the new version.
        #[arg(long, default_value_t = 30)]
        health_timeout_s: u64,
    },
}

/// How a volume moves.
#[derive(Args, Clone)]
pub struct MoveArgs {
    /// Most bytes per second the copy takes, e.g. 200MiB (default: no limit).
    #[arg(long, value_parser = parse_size)]
    rate: Option<u64>,
    /// Longest pause of hosts' I/O at the switch, in milliseconds.
    #[arg(long, default_value_t = 100)]
    pause_ms: u32,
    /// Start and return; `nvpool volume get` shows the progress.
    #[arg(long)]
    no_wait: bool,
}

#[derive(Subcommand)]
pub enum ClusterPoolVerb {
    /// List every node's pools.
    List,
}

#[derive(Subcommand)]
pub enum SnapshotVerb {
    /// Take a crash-consistent snapshot of a volume: its engine holds new commands
    /// from every path while those under way finish, records the snapshot, and goes
    /// on (the pause is printed). The snapshot outlives the volume.
    Create {
        /// The volume.
        volume: String,
        /// The snapshot's name, unique in the cluster.
        name: String,
    },
    /// List snapshots, of every volume or of one.
    List {
        /// Only the snapshots of this volume.
        volume: Option<String>,
    },
    /// Show one snapshot.
    Get {
        /// Snapshot name.
        name: String,
    },
    /// Delete a snapshot. Volumes made from it keep reading it, hidden, until the
    /// last of them goes (or, one alone left, it folds into that one); they are named.
    Delete {
        /// Snapshot name.
        name: String,
    },
}

#[derive(Subcommand)]
pub enum ClusterVolumeVerb {
    /// Create a volume; the scheduler picks the node and pool. A clone (of a snapshot
    /// or of a volume) is made where its source is, thin, reading its source until
    /// written.
    Create {
        /// Volume name.
        name: String,
        /// Size, e.g. 10GiB (a clone: its source's size by default, or more).
        #[arg(value_parser = parse_size, required_unless_present_any = ["from_snapshot", "clone_of"])]
        size: Option<u64>,
        /// Make the volume a clone of this snapshot.
        #[arg(long, value_name = "SNAPSHOT", conflicts_with = "clone_of")]
        from_snapshot: Option<String>,
        /// Make the volume a clone of this volume as it is now.
        #[arg(long, value_name = "VOLUME")]
        clone_of: Option<String>,
        /// Allocate space on first write instead of now.
        #[arg(long)]
        thin: bool,
        /// Where the volume should be relative to --host-node: local, remote or any.
        #[arg(long, default_value = "any", value_parser = ["any", "local", "remote"])]
        locality: String,
        /// The node the volume's consumer runs on.
        #[arg(long, default_value = "")]
        host_node: String,
        /// Only these nodes may hold the volume (comma separated).
        #[arg(long, value_delimiter = ',')]
        include: Vec<String>,
        /// These nodes may not hold the volume (comma separated).
        #[arg(long, value_delimiter = ',')]
        exclude: Vec<String>,
        /// How hosts get their optimized access point: inherit (one per host and
        /// group; the owner by default) or balance (spread over the nodes).
        #[arg(long, default_value = "inherit", value_parser = parse_access_policy)]
        access_policy: AccessPolicy,
        /// The volume group the access policy works on.
        #[arg(long, default_value = "")]
        group: String,
        /// The rebalancer never moves this volume (it still moves by hand or by drain).
        #[arg(long)]
        pinned: bool,
        /// Copies of the data, each on its own node (and zone, where nodes have
        /// zones): 1 to 3. Writes reach every copy before they complete.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=3))]
        replicas: u32,
        /// Show every node's score.
        #[arg(long)]
        explain: bool,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Change a volume online: its number of replicas (new ones are placed on other
    /// nodes and rebuilt in full before they count; fewer drops the faulted first).
    Set {
        /// Volume name.
        name: String,
        /// Copies of the data: 1 to 3.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=3))]
        replicas: u32,
    },
    /// Set a volume's I/O limits on every engine that serves it, from their next
    /// command on; hosts stay connected. Limits not given stay as they are.
    Qos {
        /// Volume name.
        name: String,
        #[command(flatten)]
        qos: QosArgs,
        /// Lift every limit (before applying those given).
        #[arg(long)]
        clear: bool,
    },
    /// Delete a volume.
    Delete {
        /// Volume name.
        name: String,
    },
    /// Make a volume that lies over snapshots (a clone, or a volume with snapshots)
    /// hold all its data itself, in the background on its node, and wait for it
    /// (printing the progress): then its source can go without keeping its space,
    /// and the volume may move and take replicas again. Interrupted, the inflation
    /// goes on; run this again to see it end.
    Inflate {
        /// Volume name.
        name: String,
        /// Start it and return at once.
        #[arg(long)]
        no_wait: bool,
    },
    /// Grow a volume; attached hosts see the new size.
    Resize {
        /// Volume name.
        name: String,
        /// New size, e.g. 20GiB.
        #[arg(value_parser = parse_size)]
        size: u64,
    },
    /// Show one volume.
    Get {
        /// Volume name.
        name: String,
    },
    /// List volumes.
    List {
        /// Only volumes with a copy on this node (serving or a replica).
        #[arg(long, default_value = "")]
        node: String,
    },
    /// Move a volume's data to another node while hosts use it; shows the progress.
    Migrate {
        /// Volume name.
        name: String,
        /// The node to move to.
        #[arg(long, conflicts_with_all = ["auto", "cancel"], required_unless_present_any = ["auto", "cancel"])]
        to: Option<String>,
        /// Let the scheduler pick the node, by the volume's placement rules.
        #[arg(long, conflicts_with = "cancel")]
        auto: bool,
        /// A replicated volume: the node whose replica moves (default: the serving one).
        #[arg(long, conflicts_with = "cancel")]
        from: Option<String>,
        /// Stop a migration that has not switched; the volume stays where it was.
        #[arg(long)]
        cancel: bool,
        #[command(flatten)]
        how: MoveArgs,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(s.len()));
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a duration like 500ms, 5s or 1m"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        _ => return Err(format!("{s:?} is not a duration like 500ms, 5s or 1m")),
    };
    Ok(Duration::from_secs_f64(secs))
}

fn parse_access_policy(s: &str) -> Result<AccessPolicy, String> {
    AccessPolicy::parse(s)
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or(format!("label {s:?} is not KEY=VALUE"))
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
}

fn status(e: tonic::Status) -> String {
    e.message().to_string()
}

pub fn run(cmd: Command) -> Result<(), String> {
    let rt = runtime()?;
    match cmd {
        Command::Controller(a) => {
            let args = server::ControllerArgs {
                listen: a.listen,
                advertise: a.advertise.unwrap_or_else(|| a.listen.to_string()),
                store: a.store,
                cluster: ClusterConfig {
                    policy: Policy {
                        weights: Weights { locality: a.weight_locality, reserve: a.weight_reserve, space: a.weight_space },
                        thin_overcommit: a.thin_overcommit,
                    },
                    node_timeout: a.node_timeout,
                    heartbeat_interval: a.heartbeat_interval,
                    heartbeat_budget: a.heartbeat_budget,
                    rebalance_every: (!a.rebalance_every.is_zero()).then_some(a.rebalance_every),
                    rebalance_rate: a.rebalance_rate.unwrap_or(0),
                    rebuild_rate: a.rebuild_rate,
                    replica_timeout: a.replica_timeout,
                    rebuilds_per_node: a.rebuilds_per_node.max(1),
                    tls: a.tls_dir.as_deref().map(|d| Tls::load(d, CONTROLLER)).transpose()?,
                    ..ClusterConfig::default()
                },
                lease_ttl: a.lease_ttl,
                metrics_listen: a.metrics_listen,
                http_listen: a.http_listen,
            };
            rt.block_on(server::run(args))
        }
        Command::Agent(a) => {
            let name = match a.name {
                Some(n) => n,
                None => std::fs::read_to_string("/etc/hostname")
                    .map(|h| h.trim().to_string())
                    .map_err(|e| format!("cannot read the host name ({e}); pass --name"))?,
            };
            let args = agent::AgentArgs {
                controllers: a.controller,
                listen: a.listen,
                advertise: a.advertise,
                engine_socket: a.engine_socket,
                nvme_address: a.nvme_address,
                peer_address: a.peer_address,
                local_host_nqn: a.local_host_nqn.unwrap_or_else(|| {
                    std::fs::read_to_string("/etc/nvme/hostnqn").map(|s| s.trim().to_string()).unwrap_or_default()
                }),
                labels: a.label.into_iter().chain(a.zone.map(|z| ("zone".to_string(), z))).collect::<BTreeMap<_, _>>(),
                tls: a.tls_dir.as_deref().map(|d| Tls::load(d, &format!("{NODE_PREFIX}{name}"))).transpose()?,
                metrics_listen: a.metrics_listen,
                name,
            };
            rt.block_on(agent::run(args))
        }
        Command::Node { verb: NodeVerb::List, api } => rt.block_on(async {
            let c = api.controllers()?;
            let r = c.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await.map_err(status)?;
            print_or(api.json, &nodes_json(&r.nodes), || render(&node_table(&r.nodes)));
            Ok(())
        }),
        Command::Node { verb: NodeVerb::Drain { name, how }, api } => rt.block_on(drain(&name, how, &api)),
        Command::Node { verb: NodeVerb::Upgrade { name, all: _, binary, health_timeout_s }, api } => {
            let health_timeout = Duration::from_secs(health_timeout_s);
            rt.block_on(upgrade_nodes(name, binary.unwrap_or_default(), health_timeout, &api))
        }
        Command::Pool { verb: ClusterPoolVerb::List, api } => rt.block_on(async {
            let c = api.controllers()?;
            let r = c.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await.map_err(status)?;
            print_or(api.json, &pools_json(&r.pools), || render(&pool_table(&r.pools)));
            Ok(())
        }),
        Command::Volume { verb, api } => rt.block_on(volume(*verb, api)),
        Command::Snapshot { verb, api } => rt.block_on(snapshot(verb, api)),
        Command::Attach { volume, host_nqn, readonly, explain, optimized, local, dhchap, api } => rt.block_on(async {
            let c = api.controllers()?;
            let req = proto::AttachRequest {
                volume: volume.clone(),
                host_nqn: host_nqn.clone(),
                readonly,
                explain,
                optimized_node: optimized,
                local_node: local,
                dhchap,
            };
            let r = c.call(async |mut c| c.attach(req.clone()).await).await.map_err(status)?;
            let mut j = serde_json::json!({ "subsystem_nqn": r.subsystem_nqn, "nsid": r.nsid, "uuid": r.uuid, "nguid": r.nguid, "paths": paths_json(&r.paths) });
            if explain {
                j["explain"] = r.explain.clone().into();
            }
            if let Some(l) = &r.local {
                j["local"] = local_json(l);
            }
            if !r.local_fallback.is_empty() {
                j["local_fallback"] = r.local_fallback.clone().into();
            }
            if let Some(d) = &r.dhchap {
                j["dhchap"] = serde_json::json!({ "secret": d.secret, "ctrl_secret": d.ctrl_secret });
            }
            let secrets = r.dhchap.as_ref().map_or(String::new(), |d| {
                format!(" --dhchap-secret {} --dhchap-ctrl-secret {}", d.secret, d.ctrl_secret)
            });
            print_or(api.json, &j, || {
                if let Some(l) = &r.local {
                    return format!("volume {volume} is attached to {host_nqn} on node {} as {} ({})", l.node, l.device, l.kind);
                }
                let mut out = format!("volume {volume} is attached to {host_nqn}: namespace {} of {}, uuid {}\n", r.nsid, r.subsystem_nqn, r.uuid);
                if !r.local_fallback.is_empty() {
                    out += &format!("no local device: {}\n", r.local_fallback);
                }
                out += "connect from the host with:\n";
                for p in &r.paths {
                    out += &format!(
                        "  nvme connect -t {} -a {} -s {} -n {} --hostnqn {host_nqn}{secrets}    # {} path via {}\n",
                        p.transport, p.address, p.port, r.subsystem_nqn, p.ana_state, p.node
                    );
                }
                if explain {
                    out += "access points:\n";
                    for line in &r.explain {
                        out += &format!("  {line}\n");
                    }
                }
                out.trim_end().to_string()
            });
            Ok(())
        }),
        Command::Detach { volume, host_nqn, api } => rt.block_on(async {
            let c = api.controllers()?;
            let req = proto::DetachRequest { volume: volume.clone(), host_nqn: host_nqn.clone() };
            c.call(async |mut c| c.detach(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &serde_json::json!({}), || format!("{host_nqn} detached from volume {volume}"));
            Ok(())
        }),
        Command::Certs { verb: CertsVerb::Init { dir, node, client, name } } => {
            let mut identities = vec![CONTROLLER.to_string()];
            identities.extend(node.iter().map(|n| format!("{NODE_PREFIX}{n}")));
            identities.extend(["client:admin".to_string(), "client:csi".to_string()]);
            identities.extend(client.iter().map(|c| format!("client:{c}")));
            nvpool_control::tls::init(&dir, &identities, &name)?;
            println!("certificates for {} in {} (keys 0600)", identities.join(", "), dir.display());
            Ok(())
        }
        Command::Csi(a) => {
            let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string()).unwrap_or_default();
            let args = nvpool_csi::CsiArgs {
                endpoint: a.endpoint,
                mode: match a.mode.as_str() {
                    "controller" => nvpool_csi::Mode::Controller,
                    "node" => nvpool_csi::Mode::Node,
                    _ => nvpool_csi::Mode::All,
                },
                controllers: a.controller,
                node_name: a.node_name.unwrap_or_else(|| read("/etc/hostname")),
                host_nqn: a.host_nqn.unwrap_or_else(|| read("/etc/nvme/hostnqn")),
                state_dir: a.state_dir,
                tls: a.tls_dir.as_deref().map(|d| Tls::load(d, &a.tls_identity)).transpose()?,
                kube: match (&a.kube_api, &a.kube_token_file, &a.kube_ca_file) {
                    (Some(url), Some(token), Some(ca)) => Some(nvpool_csi::kube::KubeApi::new(url, token, ca)?),
                    _ => nvpool_csi::kube::KubeApi::in_cluster()?,
                },
                secret_namespace: a.secret_namespace.unwrap_or_else(|| {
                    Some(read("/var/run/secrets/kubernetes.io/serviceaccount/namespace"))
                        .filter(|n| !n.is_empty())
                        .unwrap_or_else(|| "nvpool".to_string())
                }),
            };
            rt.block_on(nvpool_csi::run(args))
        }
        Command::Sim(a) => {
            run_sim(a)
        }
        Command::Fleet(a) => rt.block_on(run_fleet(a)),
        Command::Top { every, rows, once, api } => rt.block_on(async {
            let options = super::top::TopOptions { every, rows, once };
            super::top::run(&api.controllers()?, &options).await
        }),
        Command::ClusterInfo { api } => rt.block_on(async {
            let c = api.controllers()?;
            let r = c.call(async |mut c| c.cluster_info(proto::ClusterInfoRequest {}).await).await.map_err(status)?;
            let j = serde_json::json!({ "cluster_id": r.cluster_id, "controller_id": r.controller_id, "leader": r.leader, "leader_address": r.leader_address, "store": r.store });
            print_or(api.json, &j, || {
                format!(
                    "cluster {}\ncontroller {} ({})\nleader at {}\nstore {}",
                    r.cluster_id,
                    r.controller_id,
                    if r.leader { "leader" } else { "standby" },
                    r.leader_address,
                    r.store
                )
            });
            Ok(())
        }),
    }
}

async fn volume(verb: ClusterVolumeVerb, api: ControllerApi) -> Result<(), String> {
    let c = api.controllers()?;
    match verb {
        ClusterVolumeVerb::Create {
            name,
            size,
            thin,
            locality,
            host_node,
            include,
            exclude,
            access_policy,
            group,
            pinned,
            replicas,
            explain,
            qos,
            from_snapshot,
            clone_of,
        } => {
            let locality = match locality.as_str() {
                "local" => proto::Locality::Local,
                "remote" => proto::Locality::Remote,
                _ => proto::Locality::Any,
            };
            let req = proto::CreateVolumeRequest {
                name,
                size_bytes: size.unwrap_or(0),
                thin,
                locality: locality as i32,
                host_node,
                include_nodes: include,
                exclude_nodes: exclude,
                access_policy: match access_policy {
                    AccessPolicy::Inherit => proto::AccessPolicy::Inherit,
                    AccessPolicy::Balance => proto::AccessPolicy::Balance,
                } as i32,
                group,
                qos: qos.given().then(|| qos.applied_to(Default::default()).into()),
                pinned,
                replicas,
                from_snapshot: from_snapshot.unwrap_or_default(),
                clone_of: clone_of.unwrap_or_default(),
            };
            let r = c.call(async |mut c| c.create_volume(req.clone()).await).await.map_err(status)?;
            let v = r.volume.unwrap_or_default();
            let mut j = volume_json(&v);
            if explain {
                j["scores"] = scores_json(&r.scores);
            }
            print_or(api.json, &j, || {
                let mut out = render(&volume_table(std::slice::from_ref(&v)));
                if r.existed {
                    out += "\n(the volume already existed with these parameters)";
                }
                if explain && !r.scores.is_empty() {
                    out += "\n\n";
                    out += &render(&score_table(&r.scores));
                }
                out
            });
        }
        ClusterVolumeVerb::Delete { name } => {
            let req = proto::VolumeName { name: name.clone() };
            let r = c.call(async |mut c| c.delete_volume(req.clone()).await).await.map_err(status)?;
            let msg = if r.deleted {
                format!("volume {name} deleted")
            } else {
                format!("no volume {name}; nothing to delete")
            };
            print_or(api.json, &serde_json::json!({ "deleted": r.deleted }), || msg);
        }
        ClusterVolumeVerb::Inflate { name, no_wait } => {
            let req = proto::VolumeName { name: name.clone() };
            let mut progress_shown = false;
            let r = loop {
                let r = c.call(async |mut c| c.inflate_volume(req.clone()).await).await.map_err(status)?;
                if !r.stopped.is_empty() {
                    return Err(format!(
                        "the inflation of {name} stopped before it was done ({}): run `nvpool volume inflate {name}` \
                         again to go on",
                        r.stopped
                    ));
                }
                if r.done || no_wait {
                    if progress_shown {
                        eprintln!();
                    }
                    break r;
                }
                if !api.json {
                    eprint!("\rinflating {name}: {} of {} clusters", r.copied_clusters, r.total_clusters);
                    progress_shown = true;
                }
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            };
            let v = r.volume.unwrap_or_default();
            let mut json = volume_json(&v);
            json["inflated"] = serde_json::json!(r.done);
            print_or(api.json, &json, || {
                let state = match r.done {
                    true => format!("\nvolume {name} holds all its data: it lies over no snapshot"),
                    false => {
                        format!("\nvolume {name} is inflating: {} of {} clusters", r.copied_clusters, r.total_clusters)
                    }
                };
                format!("{}{state}", render(&volume_table(std::slice::from_ref(&v))))
            });
        }
        ClusterVolumeVerb::Resize { name, size } => {
            let req = proto::ResizeVolumeRequest { name, size_bytes: size };
            let v = c.call(async |mut c| c.resize_volume(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &volume_json(&v), || render(&volume_table(std::slice::from_ref(&v))));
        }
        ClusterVolumeVerb::Set { name, replicas } => {
            let req = proto::SetVolumeReplicasRequest { name, replicas };
            let v = c.call(async |mut c| c.set_volume_replicas(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &volume_json(&v), || {
                format!("{}\n\n{}", render(&volume_table(std::slice::from_ref(&v))), render(&replica_table(&v)))
            });
        }
        ClusterVolumeVerb::Qos { name, qos, clear } => {
            let current = if clear {
                nvpool_api::QosLimits::default()
            } else {
                let req = proto::VolumeName { name: name.clone() };
                let v = c.call(async |mut c| c.get_volume(req.clone()).await).await.map_err(status)?;
                v.qos.unwrap_or_default().into()
            };
            if !clear && !qos.given() {
                return Err(format!(
                    "volume {name} has limits {}: give --iops, --bw or another limit to change them, or --clear",
                    current.describe()
                ));
            }
            let req = proto::SetVolumeQosRequest { name: name.clone(), qos: Some(qos.applied_to(current).into()) };
            let v = c.call(async |mut c| c.set_volume_qos(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &volume_json(&v), || {
                format!("volume {name}: limits {}", nvpool_api::QosLimits::from(v.qos.unwrap_or_default()).describe())
            });
        }
        ClusterVolumeVerb::Get { name } => {
            let req = proto::VolumeName { name };
            let v = c.call(async |mut c| c.get_volume(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &volume_json(&v), || {
                let mut out = render(&volume_table(std::slice::from_ref(&v)));
                if !v.degraded.is_empty() {
                    out += &format!("\ndegraded: {}", v.degraded);
                }
                if let Some(m) = &v.migration {
                    out += &format!("\nmoving from {} to {}: {}", m.from_node, m.to_node, progress_line(m));
                }
                if !v.last_migration.is_empty() {
                    out += &format!("\nlast migration: {}", v.last_migration);
                }
                if !v.from_snapshot.is_empty() {
                    out +=
                        &format!("\nmade from snapshot {} (reads what it has not written from there)", v.from_snapshot);
                }
                if !v.clone_of.is_empty() {
                    out += &format!("\ncloned from volume {} (reads what it has not written from there)", v.clone_of);
                }
                if !v.snapshots.is_empty() {
                    out += &format!("\nsnapshots: {}", v.snapshots.join(", "));
                }
                let qos = nvpool_api::QosLimits::from(v.qos.unwrap_or_default());
                if !qos.is_unlimited() {
                    out += &format!("\nlimits: {}", qos.describe());
                }
                out += &format!(
                    "\naccess policy {}{}",
                    policy_name(v.access_policy),
                    if v.group.is_empty() { String::new() } else { format!(", group {}", v.group) }
                );
                if !v.replicas.is_empty() {
                    out += &format!("\n\n{} replicas at generation {}:\n", v.replica_count, v.generation);
                    out += &render(&replica_table(&v));
                }
                if !v.attachments.is_empty() {
                    out += "\n\n";
                    out += &render(&path_table(&v.attachments));
                }
                out
            });
        }
        ClusterVolumeVerb::List { node } => {
            let req = proto::ListVolumesRequest { node };
            let r = c.call(async |mut c| c.list_volumes(req.clone()).await).await.map_err(status)?;
            let j = serde_json::Value::Array(r.volumes.iter().map(volume_json).collect());
            print_or(api.json, &j, || render(&volume_table(&r.volumes)));
        }
        ClusterVolumeVerb::Migrate { name, cancel: true, .. } => {
            let req = proto::VolumeName { name: name.clone() };
            let v = c.call(async |mut c| c.cancel_migration(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &volume_json(&v), || {
                if v.last_migration.is_empty() {
                    format!("volume {name} is not moving")
                } else {
                    v.last_migration.clone()
                }
            });
        }
        ClusterVolumeVerb::Migrate { name, to, auto, from, how, .. } => {
            let whence = Whence { from: from.unwrap_or_default(), to: to.unwrap_or_default(), auto };
            migrate(&c, &name, whence, &how, api.json).await?;
        }
    }
    Ok(())
}

async fn snapshot(verb: SnapshotVerb, api: ControllerApi) -> Result<(), String> {
    let c = api.controllers()?;
    match verb {
        SnapshotVerb::Create { volume, name } => {
            let req = proto::CreateSnapshotRequest { volume, name };
            let s = c.call(async |mut c| c.create_snapshot(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &snapshot_json(&s), || {
                format!(
                    "{}\n(the volume's I/O was held for {:.2} ms)",
                    render(&snapshot_table(std::slice::from_ref(&s))),
                    s.pause_us as f64 / 1000.0
                )
            });
        }
        SnapshotVerb::List { volume } => {
            let req = proto::ListSnapshotsRequest { volume: volume.unwrap_or_default() };
            let r = c.call(async |mut c| c.list_snapshots(req.clone()).await).await.map_err(status)?;
            let j = serde_json::Value::Array(r.snapshots.iter().map(snapshot_json).collect());
            print_or(api.json, &j, || render(&snapshot_table(&r.snapshots)));
        }
        SnapshotVerb::Get { name } => {
            let req = proto::SnapshotName { name };
            let s = c.call(async |mut c| c.get_snapshot(req.clone()).await).await.map_err(status)?;
            print_or(api.json, &snapshot_json(&s), || {
                let mut out = render(&snapshot_table(std::slice::from_ref(&s)));
                if !s.volume_exists {
                    out += &format!("\nvolume {} is gone; the snapshot stays", s.volume);
                }
                if !s.copy_nodes.is_empty() {
                    out += &format!("\ncopies on the replicas' nodes too: {}", s.copy_nodes.join(", "));
                }
                if !s.clones.is_empty() {
                    out += &format!("\nvolumes made from it: {}", s.clones.join(", "));
                }
                out
            });
        }
        SnapshotVerb::Delete { name } => {
            let req = proto::SnapshotName { name: name.clone() };
            let r = c.call(async |mut c| c.delete_snapshot(req.clone()).await).await.map_err(status)?;
            let msg = match (r.deleted, r.kept_by.is_empty()) {
                (false, _) => format!("no snapshot {name}; nothing to delete"),
                (true, true) => format!("snapshot {name} deleted"),
                (true, false) => format!(
                    "snapshot {name} deleted; {} still read it, so its data stays for them (hidden, or folded into the \
                     last one)",
                    r.kept_by.join(", ")
                ),
            };
            print_or(api.json, &serde_json::json!({ "deleted": r.deleted, "kept_by": r.kept_by }), || msg);
        }
    }
    Ok(())
}

fn snapshot_json(s: &proto::Snapshot) -> serde_json::Value {
    serde_json::json!({
        "name": s.name, "id": s.id, "volume": s.volume, "volume_id": s.volume_id,
        "volume_exists": s.volume_exists, "node": s.node, "pool": s.pool, "size_bytes": s.size_bytes,
        "created_ms": s.created_ms, "state": s.state, "pause_us": s.pause_us,
        "allocated_bytes": s.allocated_bytes, "clones": s.clones, "copy_nodes": s.copy_nodes,
    })
}

fn snapshot_table(snapshots: &[proto::Snapshot]) -> Vec<Vec<String>> {
    let mut rows =
        vec![["SNAPSHOT", "VOLUME", "NODE", "POOL", "SIZE", "HOLDS", "STATE", "CLONES"].map(String::from).to_vec()];
    for s in snapshots {
        rows.push(vec![
            s.name.clone(),
            if s.volume_exists { s.volume.clone() } else { format!("{} (gone)", s.volume) },
            if s.copy_nodes.is_empty() { s.node.clone() } else { format!("{}+{}", s.node, s.copy_nodes.join("+")) },
            s.pool.clone(),
            human(s.size_bytes),
            human(s.allocated_bytes),
            s.state.clone(),
            if s.clones.is_empty() { "-".into() } else { s.clones.join(",") },
        ]);
    }
    rows
}

/// Which copy of a volume moves, and where to.
struct Whence {
    /// A replicated volume's replica on this node; empty: the serving one (or the
    /// only copy).
    from: String,
    /// The node to move to; empty with `auto`.
    to: String,
    auto: bool,
}

/// Starts a volume's migration (a replicated volume's: one replica's move) and,
/// unless told not to wait, follows it to its end: a progress bar on a terminal, a
/// line per round otherwise, JSON events with --json.
async fn migrate(c: &Controllers, name: &str, whence: Whence, how: &MoveArgs, json: bool) -> Result<(), String> {
    let req = proto::MigrateVolumeRequest {
        name: name.to_string(),
        to_node: whence.to,
        auto: whence.auto,
        rate: how.rate.unwrap_or(0),
        pause_ms: how.pause_ms,
        from_node: whence.from,
    };
    let v = c.call(async |mut c| c.migrate_volume(req.clone()).await).await.map_err(status)?;
    let m = v.migration.clone().unwrap_or_default();
    if json {
        println!("{}", serde_json::json!({ "event": "started", "volume": name, "from": m.from_node, "to": m.to_node }));
    } else {
        println!("moving volume {name} from {} to {} (pool {})", m.from_node, m.to_node, m.to_pool);
    }
    if how.no_wait {
        return Ok(());
    }
    use std::io::{IsTerminal, Write};
    let bar = !json && std::io::stdout().is_terminal();
    let mut last_line = String::new();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let req = proto::VolumeName { name: name.to_string() };
        let v = c.call(async |mut c| c.get_volume(req.clone()).await).await.map_err(status)?;
        let Some(m) = v.migration.clone() else {
            if bar {
                println!();
            }
            let moved = v.last_migration.starts_with("moved");
            if json {
                let event = if moved { "moved" } else { "stopped" };
                println!(
                    "{}",
                    serde_json::json!({ "event": event, "volume": name, "node": v.node, "summary": v.last_migration })
                );
            } else {
                println!("{}", v.last_migration);
            }
            return if moved { Ok(()) } else { Err(format!("volume {name} did not move: {}", v.last_migration)) };
        };
        let line = progress_line(&m);
        if json {
            let j = serde_json::json!({
                "event": "progress", "volume": name, "phase": m.phase, "round": m.round,
                "copied_bytes": m.copied_bytes, "dirty_bytes": m.dirty_bytes, "allocated_bytes": m.allocated_bytes,
                "rate": m.rate, "eta_seconds": eta(&m), "waiting": m.waiting,
            });
            if line != last_line {
                println!("{j}");
            }
        } else if bar {
            print!("\r\x1b[2K{line}");
            let _ = std::io::stdout().flush();
        } else if line != last_line {
            println!("{line}");
        }
        last_line = line;
    }
}

/// Seconds left at the last round's rate: the first round's rest, or what is dirty.
fn eta(m: &proto::Migration) -> Option<f64> {
    let left = if m.round <= 1 { m.allocated_bytes.saturating_sub(m.copied_bytes) } else { m.dirty_bytes };
    (m.rate > 0).then(|| left as f64 / m.rate as f64)
}

fn progress_line(m: &proto::Migration) -> String {
    let mut line = format!("{:<9} round {:>2}", m.phase, m.round);
    if m.round <= 1 && m.allocated_bytes > 0 {
        let done = (m.copied_bytes as f64 / m.allocated_bytes as f64).min(1.0);
        let filled = (done * 20.0) as usize;
        line += &format!(" [{}{}] {:>3.0}%", "#".repeat(filled), "-".repeat(20 - filled), done * 100.0);
    }
    line += &format!("  copied {}  dirty {}  {}/s", human(m.copied_bytes), human(m.dirty_bytes), human(m.rate));
    if let Some(s) = eta(m) {
        line += &format!("  ETA {s:.0}s");
    }
    if !m.waiting.is_empty() {
        line += &format!("  (waiting: {})", m.waiting);
    }
    line
}

/// Moves every volume off a node, one after the other (of a replicated volume, the
/// replica there).
async fn drain(node: &str, how: MoveArgs, api: &ControllerApi) -> Result<(), String> {
    let c = api.controllers()?;
    let req = proto::ListVolumesRequest { node: node.to_string() };
    let volumes = c.call(async |mut c| c.list_volumes(req.clone()).await).await.map_err(status)?.volumes;
    if volumes.is_empty() {
        println!("node {node} holds no volume");
        return Ok(());
    }
    let how = MoveArgs { no_wait: false, ..how };
    let mut failed = Vec::new();
    for v in &volumes {
        let whence = Whence { from: node.to_string(), to: String::new(), auto: true };
        if let Err(e) = migrate(&c, &v.name, whence, &how, api.json).await {
            eprintln!("{e}");
            failed.push(v.name.clone());
        }
    }
    if failed.is_empty() {
        println!("node {node} drained: {} volumes moved", volumes.len());
        Ok(())
    } else {
        Err(format!(
            "{} of {} volumes did not move off {node}: {}; run the drain again",
            failed.len(),
            volumes.len(),
            failed.join(", ")
        ))
    }
}

/// Hot-upgrades `node`'s engine, or every node's (`None`) one after the other, each
/// healthy again with its new version before the next one starts.
async fn upgrade_nodes(
    node: Option<String>,
    binary: String,
    health_timeout: Duration,
    api: &ControllerApi,
) -> Result<(), String> {
    let c = api.controllers()?;
    let nodes = match node {
        Some(n) => vec![n],
        None => {
            let listed = c.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await.map_err(status)?;
            let mut names: Vec<String> = listed.nodes.into_iter().map(|n| n.name).collect();
            names.sort();
            names
        }
    };
    let mut reports = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let left = |done: usize| -> String {
            if nodes.len() > 1 && done < nodes.len() {
                format!("; not upgraded: {}", nodes[done..].join(", "))
            } else {
                String::new()
            }
        };
        let req = proto::UpgradeNodeRequest { node: node.clone(), binary: binary.clone() };
        let r = c
            .call(async |mut c| c.upgrade_node(req.clone()).await)
            .await
            .map_err(|e| format!("{}{}", e.message(), left(i)))?;
        if !api.json {
            println!(
                "{node}: {} (pid {}) -> {} (pid {}); {} connections kept; I/O paused {:.2} ms",
                r.old_version,
                r.old_pid,
                r.new_version,
                r.new_pid,
                r.connections,
                r.pause_us as f64 / 1000.0
            );
        }
        healthy_with(&c, node, &r.new_version, health_timeout).await.map_err(|e| format!("{e}{}", left(i + 1)))?;
        reports.push(serde_json::json!({
            "node": r.node, "old_version": r.old_version, "new_version": r.new_version, "old_pid": r.old_pid,
            "new_pid": r.new_pid, "connections": r.connections, "controllers": r.controllers, "pause_us": r.pause_us,
        }));
    }
    if api.json {
        println!("{}", serde_json::Value::Array(reports));
    }
    Ok(())
}

/// Waits until the controller sees `node` healthy, its engine at `version`.
async fn healthy_with(c: &Controllers, node: &str, version: &str, timeout: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let listed = c.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await.map_err(status)?;
        let n = listed.nodes.into_iter().find(|n| n.name == node);
        if n.as_ref().is_some_and(|n| n.healthy && n.engine_version == version) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            let seen = n.map_or("gone from the cluster".to_string(), |n| {
                format!("{}, engine version {:?}", if n.healthy { "healthy" } else { "unhealthy" }, n.engine_version)
            });
            return Err(format!(
                "node {node} was upgraded to {version} but is not healthy with it after {timeout:?} ({seen}); look at \
                 its agent and engine before going on"
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn locality_name(l: i32) -> &'static str {
    match proto::Locality::try_from(l) {
        Ok(proto::Locality::Local) => "local",
        Ok(proto::Locality::Remote) => "remote",
        _ => "any",
    }
}

fn policy_name(p: i32) -> &'static str {
    match proto::AccessPolicy::try_from(p) {
        Ok(proto::AccessPolicy::Balance) => "balance",
        _ => "inherit",
    }
}

fn volume_json(v: &proto::Volume) -> serde_json::Value {
    let attachments: Vec<serde_json::Value> = v
        .attachments
        .iter()
        .map(|a| {
            let mut j = serde_json::json!({ "host_nqn": a.host_nqn, "paths": paths_json(&a.paths) });
            if let Some(l) = &a.local {
                j["local"] = local_json(l);
            }
            j
        })
        .collect();
    serde_json::json!({
        "name": v.name, "id": v.id, "size_bytes": v.size_bytes, "thin": v.thin, "node": v.node, "pool": v.pool,
        "state": v.state, "hosts": v.hosts, "subsystem_nqn": v.subsystem_nqn, "uuid": v.uuid, "nguid": v.nguid,
        "allocated_bytes": v.allocated_bytes, "locality": locality_name(v.locality), "host_node": v.host_node,
        "include_nodes": v.include_nodes, "exclude_nodes": v.exclude_nodes,
        "access_policy": policy_name(v.access_policy), "group": v.group, "attachments": attachments,
        "degraded": if v.degraded.is_empty() { serde_json::Value::Null } else { v.degraded.clone().into() },
        "migration": v.migration.as_ref().map(|m| serde_json::json!({
            "from_node": m.from_node, "to_node": m.to_node, "to_pool": m.to_pool, "phase": m.phase,
            "round": m.round, "copied_bytes": m.copied_bytes, "dirty_bytes": m.dirty_bytes,
            "allocated_bytes": m.allocated_bytes, "rate": m.rate, "round_bytes": m.round_bytes,
            "pause_us": m.pause_us, "started_ms_ago": m.started_ms_ago, "waiting": m.waiting,
        })),
        "last_migration": v.last_migration,
        "pinned": v.pinned, "awaiting_home": v.awaiting_home,
        "replica_count": v.replica_count.max(1), "generation": v.generation,
        "replicas": v.replicas.iter().map(|r| serde_json::json!({
            "node": r.node, "pool": r.pool, "state": replica_state(r), "why": r.why, "left_at": r.left_at,
            "serving": r.serving, "rebuild_total_bytes": r.rebuild_total_bytes,
            "rebuild_copied_bytes": r.rebuild_copied_bytes,
        })).collect::<Vec<_>>(),
        "qos": nvpool_api::QosLimits::from(v.qos.unwrap_or_default()),
        "io": io_json(v.io.as_ref()),
        "from_snapshot": (!v.from_snapshot.is_empty()).then_some(&v.from_snapshot),
        "clone_of": (!v.clone_of.is_empty()).then_some(&v.clone_of),
        "snapshots": v.snapshots,
    })
}

fn paths_json(paths: &[proto::Path]) -> serde_json::Value {
    paths
        .iter()
        .map(|p| {
            serde_json::json!({
                "node": p.node, "transport": p.transport, "address": p.address, "port": p.port,
                "ana_state": p.ana_state, "owner": p.owner, "healthy": p.healthy,
            })
        })
        .collect()
}

/// Each attached host's paths, a row each.
fn local_json(l: &proto::LocalDevice) -> serde_json::Value {
    serde_json::json!({ "node": l.node, "kind": l.kind, "device": l.device })
}

fn path_table(attachments: &[proto::Attachment]) -> Vec<Vec<String>> {
    let mut rows = vec![["HOST", "NODE", "ADDRESS", "ANA STATE", "ROLE", "NODE STATE"].map(String::from).to_vec()];
    for a in attachments {
        if let Some(l) = &a.local {
            let device = if l.device.is_empty() { "(being made)".to_string() } else { l.device.clone() };
            rows.push(vec![
                a.host_nqn.clone(),
                l.node.clone(),
                device,
                "-".into(),
                format!("local {}", l.kind),
                "-".into(),
            ]);
        }
        for p in &a.paths {
            rows.push(vec![
                a.host_nqn.clone(),
                p.node.clone(),
                format!("{}:{}", p.address, p.port),
                p.ana_state.clone(),
                if p.owner { "owner" } else { "forwards" }.into(),
                if p.healthy { "healthy" } else { "down" }.into(),
            ]);
        }
    }
    rows
}

fn volume_table(vs: &[proto::Volume]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["NAME", "SIZE", "TYPE", "NODE", "POOL", "STATE", "REPLICAS", "ALLOCATED", "HOSTS"].map(String::from).to_vec(),
    ];
    for v in vs {
        rows.push(vec![
            v.name.clone(),
            human(v.size_bytes),
            if v.thin { "thin" } else { "thick" }.into(),
            v.node.clone(),
            v.pool.clone(),
            // A local volume the rebalancer is to bring home.
            if v.awaiting_home { format!("{}, away from {}", v.state, v.host_node) } else { v.state.clone() },
            replicas_brief(v),
            human(v.allocated_bytes),
            if v.hosts.is_empty() { "-".into() } else { v.hosts.join(",") },
        ]);
    }
    rows
}

/// A replica's state as people read it: `in-sync`, `rebuilding 37%`, `faulted: why`.
fn replica_state(r: &proto::Replica) -> String {
    match r.state.as_str() {
        "rebuilding" if r.rebuild_total_bytes > 0 => {
            format!("rebuilding {}%", r.rebuild_copied_bytes * 100 / r.rebuild_total_bytes)
        }
        "faulted" if !r.why.is_empty() => format!("faulted: {}", r.why),
        s => s.to_string(),
    }
}

/// A volume's replicas in one cell: `1`, or `2/3` (in sync of asked for).
fn replicas_brief(v: &proto::Volume) -> String {
    let asked = v.replica_count.max(1);
    let in_sync = v.replicas.iter().filter(|r| r.state == "in-sync").count();
    if v.replicas.is_empty() { asked.to_string() } else { format!("{in_sync}/{asked}") }
}

/// Each replica of a replicated volume, a row each.
fn replica_table(v: &proto::Volume) -> Vec<Vec<String>> {
    let mut rows = vec![["NODE", "POOL", "ROLE", "STATE", "LEFT AT"].map(String::from).to_vec()];
    for r in &v.replicas {
        rows.push(vec![
            r.node.clone(),
            r.pool.clone(),
            if r.serving { "serving" } else { "replica" }.into(),
            replica_state(r),
            if r.left_at == 0 { "-".into() } else { format!("generation {}", r.left_at) },
        ]);
    }
    rows
}

fn scores_json(scores: &[proto::NodeScore]) -> serde_json::Value {
    scores
        .iter()
        .map(|s| {
            serde_json::json!({
                "node": s.node, "pool": s.pool, "filtered_out": s.filtered_out, "locality": s.locality_score,
                "reserve": s.reserve_score, "reserved_bytes": s.reserved_bytes, "space": s.space_score,
                "total": s.total, "used_ratio_after": s.used_ratio_after,
            })
        })
        .collect()
}

fn score_table(scores: &[proto::NodeScore]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["NODE", "POOL", "LOCALITY", "RESERVE", "RESERVED", "SPACE", "TOTAL", "USED AFTER", "VERDICT"]
            .map(String::from)
            .to_vec(),
    ];
    for (i, s) in scores.iter().enumerate() {
        let passed = s.filtered_out.is_empty();
        rows.push(vec![
            s.node.clone(),
            if passed { s.pool.clone() } else { "-".into() },
            if passed { format!("{:.2}", s.locality_score) } else { "-".into() },
            if passed { format!("{:.3}", s.reserve_score) } else { "-".into() },
            if passed { human(s.reserved_bytes) } else { "-".into() },
            if passed { format!("{:.3}", s.space_score) } else { "-".into() },
            if passed { format!("{:.3}", s.total) } else { "-".into() },
            if passed { format!("{:.1}%", s.used_ratio_after * 100.0) } else { "-".into() },
            if !passed {
                format!("filtered out: {}", s.filtered_out)
            } else if i == 0 {
                "chosen".into()
            } else {
                "eligible".into()
            },
        ]);
    }
    rows
}

fn nodes_json(nodes: &[proto::Node]) -> serde_json::Value {
    nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "name": n.name, "agent_address": n.agent_address, "nvme_address": n.nvme_address, "labels": n.labels,
                "healthy": n.healthy, "last_heartbeat_ms_ago": n.last_heartbeat_ms_ago, "volumes": n.volumes,
                "pools": n.pools.iter().map(pool_json).collect::<Vec<_>>(),
                "engine_error": if n.engine_error.is_empty() { serde_json::Value::Null } else { n.engine_error.clone().into() },
                "engine_version": n.engine_version,
                "io": io_json(n.io.as_ref()),
            })
        })
        .collect()
}

/// Live I/O rates, or null before the controller has two heartbeats of them.
fn io_json(io: Option<&proto::IoRates>) -> serde_json::Value {
    io.map_or(serde_json::Value::Null, |r| {
        serde_json::json!({
            "read_iops": r.read_iops, "write_iops": r.write_iops, "read_bytes_per_second": r.read_bytes_per_second,
            "write_bytes_per_second": r.write_bytes_per_second, "mean_latency_us": r.mean_latency_us,
        })
    })
}

fn pool_json(p: &proto::PoolReport) -> serde_json::Value {
    serde_json::json!({
        "name": p.name, "capacity_bytes": p.capacity_bytes, "used_bytes": p.used_bytes,
        "provisioned_bytes": p.provisioned_bytes, "cluster_size": p.cluster_size, "volumes": p.volumes,
        "exclusive_bytes": p.used_bytes.saturating_sub(p.snapshot_bytes), "shared_bytes": p.snapshot_bytes,
        "failed": if p.failed.is_empty() { serde_json::Value::Null } else { p.failed.clone().into() },
    })
}

fn node_table(nodes: &[proto::Node]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["NODE", "HEALTH", "ZONE", "VERSION", "NVME ADDRESS", "POOLS", "CAPACITY", "USED", "VOLUMES", "LAST SEEN"]
            .map(String::from)
            .to_vec(),
    ];
    for n in nodes {
        rows.push(vec![
            n.name.clone(),
            match (n.healthy, n.engine_error.is_empty()) {
                (true, _) => "healthy",
                (false, false) => "engine down",
                (false, true) => "unhealthy",
            }
            .into(),
            n.labels.get("zone").cloned().unwrap_or_else(|| "-".into()),
            n.engine_version.clone(),
            n.nvme_address.clone(),
            n.pools.len().to_string(),
            human(n.pools.iter().map(|p| p.capacity_bytes).sum()),
            human(n.pools.iter().map(|p| p.used_bytes).sum()),
            n.volumes.to_string(),
            format!("{:.1}s ago", n.last_heartbeat_ms_ago as f64 / 1000.0),
        ]);
    }
    rows
}

fn pools_json(pools: &[proto::PoolOnNode]) -> serde_json::Value {
    pools
        .iter()
        .map(|p| {
            let mut j = pool_json(&p.pool.clone().unwrap_or_default());
            j["node"] = p.node.clone().into();
            j["committed_bytes"] = p.committed_bytes.into();
            j
        })
        .collect()
}

fn pool_table(pools: &[proto::PoolOnNode]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["NODE", "POOL", "CAPACITY", "USED", "EXCLUSIVE", "SHARED", "COMMITTED", "PROVISIONED", "VOLUMES"]
            .map(String::from)
            .to_vec(),
    ];
    for p in pools {
        let r = p.pool.clone().unwrap_or_default();
        rows.push(vec![
            p.node.clone(),
            r.name,
            human(r.capacity_bytes),
            human(r.used_bytes),
            human(r.used_bytes.saturating_sub(r.snapshot_bytes)),
            human(r.snapshot_bytes),
            human(p.committed_bytes),
            human(r.provisioned_bytes),
            r.volumes.to_string(),
        ]);
    }
    rows
}

fn run_sim(a: SimArgs) -> Result<(), String> {
    if a.replication {
        return run_durability(&a);
    }
    let cfg = SimConfig {
        nodes: a.nodes,
        heavy_fraction: a.heavy_fraction,
        diskless_fraction: a.diskless_fraction,
        median_size: a.median_size,
        local_share: a.local_share,
        demand: if a.demand == "independent" { sim::Demand::Independent } else { sim::Demand::FollowsDisks },
        demand_spread: a.demand_spread,
        lifetime: a.lifetime,
        movable_share: a.movable_share,
        seed: a.seed,
        ..SimConfig::default()
    };
    let disks = format!(
        "{:.0}% of nodes with {} disks, {:.0}% without disks, the rest with {} disks of {:.2} TB",
        cfg.heavy_fraction * 100.0,
        cfg.heavy_disks,
        cfg.diskless_fraction * 100.0,
        cfg.light_disks,
        cfg.disk_bytes as f64 / 1e12
    );
    if a.bench {
        let r = sim::bench(&cfg, a.decisions);
        println!("Scheduler speed: {} nodes ({disks}), filled to {:.1}%, one thread\n", r.nodes, r.utilisation * 100.0);
        println!("| path | decisions | decisions/s | p50 µs | p99 µs |\n|---|---:|---:|---:|---:|");
        for (name, n, rate, p50, p99) in r.rows {
            println!("| {name} | {n} | {rate:.0} | {p50:.1} | {p99:.1} |");
        }
        return Ok(());
    }
    let strategies: Vec<(String, sim::Strategy)> = a
        .policies
        .iter()
        .map(|name| sim::policy_named(name).map(|s| (name.clone(), s)))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("--policies: {e}"))?;
    if a.json {
        let reports: Vec<sim::SimReport> = strategies.iter().map(|(name, s)| sim::run(&cfg, name, *s)).collect();
        println!("{}", serde_json::to_string_pretty(&reports).map_err(|e| e.to_string())?);
        return Ok(());
    }
    let demand = match cfg.demand {
        sim::Demand::FollowsDisks => "database pods run where the disks are",
        sim::Demand::Independent => "pods land by a weight independent of the disks",
    };
    println!(
        "Simulated cluster: {} nodes ({disks}). Pods ask for 1 to {} volumes, log-normal around {}; {:.0}% of pods \
         ask local, {:.0}% remote; {demand}, with a log-normal spread of sigma {}; long-lived pods live {} pool \
         fills on average, {:.0}% live a twentieth of that; {:.0}% of volumes may migrate; seed {}.\n",
        cfg.nodes,
        cfg.volumes_per_pod,
        human(cfg.median_size),
        cfg.local_share * 100.0,
        cfg.remote_share * 100.0,
        cfg.demand_spread,
        cfg.lifetime,
        cfg.short_lived_share * 100.0,
        cfg.movable_share * 100.0,
        cfg.seed
    );
    println!(
        "| policy | created | deleted | used at first failure | failed request | largest hole | fragmentation | \
         local requests met | met at ≥90% used | used when 1% failed | migrated per placement | decisions/s |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let descriptions = sim::policies();
    for (name, strategy) in &strategies {
        let r = sim::run(&cfg, name, *strategy);
        let label =
            descriptions.iter().find(|(n, _, _)| n == name).map_or(name.clone(), |(n, d, _)| format!("{n} ({d})"));
        let goal = r.utilisation >= 0.95 && r.local_met >= 0.9;
        let b = |s: String| if goal { format!("**{s}**") } else { s };
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.3} | {} | {} | {:.1}% | {} | {:.0} |",
            b(label),
            r.created,
            r.deleted,
            b(format!("{:.1}%", r.utilisation * 100.0)),
            human(r.failed_size),
            human(r.largest_hole),
            r.fragmentation,
            b(format!("{:.1}%", r.local_met * 100.0)),
            r.local_met_when_full.map_or("-".into(), |m| format!("{:.1}%", m * 100.0)),
            r.utilisation_at_1pct * 100.0,
            human(r.migrated_per_placement),
            r.decisions_per_second
        );
    }
    println!("| LightPool's report: local-only | | | | | | | | | about 40% | | |");
    println!("| LightPool's report: pooled | | | | | | | | | about 65% | | |");
    println!(
        "\nBold: the goal, at least 95% used at the first failure with at least 90% of local requests met.\n\
         fragmentation: 1 - (largest free space on one node / all free space) at the first failure.\n\
         local requests met: volumes asking for their pod's node, from nodes with disks, that got it (until the \
         first failure); met at ≥90% used: the same, for requests made while the pool was at least 90% used \
         (-: it failed first).\n\
         migrated per placement: bytes moved by hot migration per volume created, until the first failure."
    );
    Ok(())
}

async fn run_fleet(a: FleetArgs) -> Result<(), String> {
    use nvpool_control::fleet::{Figures, StoreKind};
    let temporary = std::env::temp_dir().join(format!("nvpool-fleet-{}", std::process::id()));
    let dir = a.dir.clone().unwrap_or_else(|| temporary.clone());
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let binary = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    if let Some(seed) = a.replay {
        let cfg = nvpool_control::fleet::ReplayConfig { binary, dir, nodes: a.nodes, volumes: a.volumes, seed };
        let r = nvpool_control::fleet::replay(cfg).await;
        if a.dir.is_none() {
            let _ = std::fs::remove_dir_all(&temporary);
        }
        let r = r?;
        println!("## The simulator's run of seed {seed} replayed through a controller");
        println!();
        println!("| figure | value |");
        println!("|---|---:|");
        println!("| nodes (with disks) | {} ({}) |", r.nodes, r.nodes_with_disks);
        println!("| creations (local) / deletions | {} ({}) / {} |", r.creations, r.local_creations, r.deletions);
        println!("| ended at the first creation that found no room | {} |", if r.ended_full { "yes" } else { "no" });
        println!("| pool used at the end | {:.1}% |", 100.0 * r.used_share);
        println!("| placements as the simulator's | {} of {} |", r.creations, r.creations);
        println!("| seconds | {:.1} |", r.seconds);
        return Ok(());
    }
    let cfg = nvpool_control::fleet::BenchConfig {
        binary,
        dir,
        store: a.store,
        nodes: a.nodes,
        volumes: a.volumes,
        thin: a.thin,
        rate: a.rate,
        clients: a.clients,
        rest: Duration::from_secs_f64(a.rest),
    };
    let r = nvpool_control::fleet::bench(cfg).await;
    if a.dir.is_none() {
        let _ = std::fs::remove_dir_all(&temporary);
    }
    let r = r?;
    if let Some(path) = &a.samples {
        let rows: Vec<String> = r.samples.iter().map(|(i, c, at)| format!("{i},{c:.3},{at:.3}")).collect();
        std::fs::write(path, format!("volume,create_ms,attach_ms\n{}\n", rows.join("\n")))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let kind = if a.thin { "thin" } else { "thick" };
    let store = match r.store {
        StoreKind::Embedded => "embedded store",
        StoreKind::Etcd => "etcd, 3 members, leader and standby",
    };
    println!("## {} nodes, {} {kind} volumes ({store})", r.nodes, r.volumes);
    println!();
    println!("{} nodes registered in {:.1} s.", r.nodes, r.register_seconds);
    println!();
    println!("| volumes created | create p50 (ms) | p99 (ms) | max (ms) | attach p50 (ms) | p99 (ms) | max (ms) |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut from = 1;
    for s in &r.creations {
        let (c, a) = (&s.create, &s.attach);
        println!(
            "| {from}–{} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
            s.upto, c.p50, c.p99, c.max, a.p50, a.p99, a.max
        );
        from = s.upto + 1;
    }
    println!();
    println!("Then, at the same rate, with every volume made:");
    println!();
    println!("| change | count | p50 | p99 | max |");
    println!("|---|---:|---:|---:|---:|");
    let row = |what: &str, f: &Figures, unit: &str| {
        println!("| {what} ({unit}) | {} | {:.1} | {:.1} | {:.1} |", f.count, f.p50, f.p99, f.max);
    };
    let c = &r.changes;
    row("resize", &c.resize, "ms");
    row("detach", &c.detach, "ms");
    row("delete", &c.delete, "ms");
    row("migrate: the call", &c.migrate, "ms");
    row("migrate: until done, the old copy removed", &c.moved_seconds, "s");
    println!();
    println!("The last change's removals reached their nodes {:.1} s after it.", r.settled_seconds.max(0.0));
    println!();
    println!("| figure | value |");
    println!("|---|---:|");
    println!("| creations per second (asked {}) | {:.1} |", a.rate, r.creations_per_second);
    println!("| leader's CPU while creating (% of a core) | {:.1} |", r.controller_cpu_creating);
    if r.store == StoreKind::Etcd {
        println!("| etcd members' CPU while creating, together (% of a core) | {:.1} |", r.store_cpu_creating);
    }
    println!("| leader's CPU at rest, {} nodes heartbeating (% of a core) | {:.1} |", r.nodes, r.controller_cpu_rest);
    println!("| heartbeats answered per second at rest | {:.0} |", r.heartbeats_per_second_rest);
    println!("| bytes of a heartbeat's answer at rest | {:.1} |", r.answer_bytes_rest);
    println!("| states applied to nodes at rest | {} |", r.applies_rest);
    println!("| store transactions per second at rest | {:.2} |", r.commits_per_second_rest);
    println!("| bytes the store wrote per second at rest | {:.0} |", r.store_written_per_second_rest);
    println!("| leader's RSS (MiB) | {} |", r.controller_rss_mib);
    println!("| store on disk (MiB) | {:.1} |", r.store_mib);
    println!("| list every volume (ms) | {:.0} |", r.list_volumes_ms);
    println!(
        "| dashboard: summary / a page of nodes / a page of volumes (ms) | {:.0} / {:.0} / {:.0} |",
        r.pages.summary_ms, r.pages.nodes_ms, r.pages.volumes_ms
    );
    println!(
        "| rebalancer passes, mean time of a pass (ms) | {:.0}, {:.1} |",
        r.rebalance_passes, r.rebalance_pass_mean_ms
    );
    println!("| volumes per node once all were made, fewest / most | {} / {} |", r.fewest_on_a_node, r.most_on_a_node);
    println!(
        "| states applied / entries in them / whole states | {} / {} / {} |",
        r.applies, r.entries_applied, r.whole_states
    );
    println!("| after the leader's SIGKILL: a controller lists every volume (s) | {:.2} |", r.failover_serving_seconds);
    println!("| after the leader's SIGKILL: one creation (ms) | {:.1} |", r.failover_create_ms);
    match r.failover_reconciled_seconds {
        Some(s) => println!("| after the leader's SIGKILL: every node given its state again (s) | {s:.2} |"),
        None => println!(
            "| after the leader's SIGKILL: nodes given their state again in 120 s | {} of {} |",
            r.failover_reconciled_nodes, r.nodes
        ),
    }
    Ok(())
}

/// `nvpool sim --replication`: the replication model at each rebuild rate.
fn run_durability(a: &SimArgs) -> Result<(), String> {
    let d = &a.durability;
    if d.replicas == 0 || d.replicas >= a.nodes {
        return Err(format!("--replicas {} needs 1 or more, and fewer than --nodes {}", d.replicas, a.nodes));
    }
    let cfg = DurabilityConfig {
        nodes: a.nodes,
        volumes_per_node: d.volumes_per_node,
        replicas: d.replicas,
        median_size: a.median_size,
        write_rate: d.write_rate as f64,
        failures_per_node_year: d.failures_per_node_year,
        repair_seconds: d.repair.as_secs_f64(),
        disk_loss_share: d.disk_loss_share,
        replica_timeout_seconds: d.replica_timeout.as_secs_f64(),
        rebuild_cap: d.rebuild_cap.max(1),
        years: d.years,
        seed: a.seed,
    };
    let rates: Vec<f64> = d.rebuild_rates.iter().map(|&r| r as f64).collect();
    let reports = durability::run(&cfg, &rates);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&reports).map_err(|e| e.to_string())?);
        return Ok(());
    }
    println!(
        "Simulated pool: {} nodes, {} volumes of {} copies (log-normal around {}, each writing {}/s), placed at \
         random on distinct nodes; each node fails {} times a year, stays away {:?} on average, {:.0}% of failures \
         lose the disks; a replica away {:?} is made anew elsewhere; {} rebuilds at once per node; {} years; seed {}.\n",
        cfg.nodes,
        cfg.nodes * cfg.volumes_per_node,
        cfg.replicas,
        human(cfg.median_size),
        human(d.write_rate),
        cfg.failures_per_node_year,
        d.repair,
        cfg.disk_loss_share * 100.0,
        d.replica_timeout,
        cfg.rebuild_cap,
        cfg.years,
        cfg.seed
    );
    println!(
        "| rebuild rate | failures | back to full redundancy: mean / p99 / max (h) | hours with one copy per volume-year \
         | hours unavailable per volume-year | volumes lost | lost per million volume-years | rebuilt |"
    );
    println!("|---:|---:|---|---:|---:|---:|---:|---:|");
    for r in &reports {
        println!(
            "| {}/s | {} | {:.2} / {:.2} / {:.2} | {:.4} | {:.5} | {} | {:.1} | {} |",
            human(r.rate as u64),
            r.failures,
            r.back_mean_hours,
            r.back_p99_hours,
            r.back_max_hours,
            r.single_copy_hours_per_volume_year,
            r.unavailable_hours_per_volume_year,
            r.lost_volumes,
            r.lost_per_million_volume_years,
            human(r.rebuilt_bytes as u64)
        );
    }
    Ok(())
}

//! The state image one engine process hands the next: everything a host would notice
//! if it were lost. Plain data, encoded as JSON; descriptors travel beside it and are
//! named here by their index in the order they were sent.

use std::net::SocketAddr;
use std::path::PathBuf;

use nvpool_api::AnaState;
use serde::{Deserialize, Serialize};

use crate::config::EngineConfig;

/// The format this build writes. A new engine lists the formats it reads in its
/// hello; the old one refuses to hand over to a binary that cannot read its own.
pub const FORMAT: u32 = 3;
/// The formats this build reads: 2 is 3 without local devices.
pub const READS: &[u32] = &[2, FORMAT];

/// The new process's first message: what it is and what it can read.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    /// Its version.
    pub version: String,
    /// Its process ID.
    pub pid: u32,
    /// Image formats it reads.
    pub reads: Vec<u32>,
}

/// What the old process says after the hello.
#[derive(Debug, Serialize, Deserialize)]
pub enum Order {
    /// Start the reactors of this configuration (its listener, subsystem and pool
    /// lists empty) and map these memory namespaces (their memfds follow, in this
    /// order) while the old engine still serves, and answer `Prepared`.
    Prepare {
        /// The configuration.
        config: Box<EngineConfig>,
        /// The memory namespaces.
        memory: Vec<MemoryImage>,
        /// About how many descriptors the image will bring: the descriptor table is
        /// grown for them now, not while no command is read.
        descriptors: usize,
    },
    /// The image follows, then its descriptors.
    Image {
        /// How many descriptors follow the image.
        descriptors: usize,
    },
    /// Start serving: the old process has let go of everything.
    Go,
    /// Give up and exit: the old process goes on serving.
    Abort(String),
}

/// What the new process answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    /// The reactors run; waiting for the image.
    Prepared,
    /// Everything is rebuilt and every connection sits parked on its reactor;
    /// waiting for `Go`.
    Ready,
    /// After `Go`: serving, and named the service's main process.
    Serving,
    /// The image could not be taken over; the new process exits.
    Failed(String),
}

/// A memory namespace, sent before the pause: mapping its RAM takes time.
#[derive(Debug, Serialize, Deserialize)]
pub struct MemoryImage {
    /// Its subsystem.
    pub nqn: String,
    /// NSID.
    pub nsid: u32,
    /// Size in bytes.
    pub size: u64,
}

/// The whole engine.
#[derive(Debug, Serialize, Deserialize)]
pub struct EngineImage {
    /// `FORMAT` of the writer.
    pub format: u32,
    /// The version that wrote it.
    pub version: String,
    /// The executable the engine runs (the default binary of the next upgrade).
    pub executable: PathBuf,
    /// The management socket's listening descriptor.
    pub management_fd: usize,
    /// Pools, by the paths of their disks (opened again; their metadata was
    /// checkpointed, so nothing is replayed).
    pub pools: Vec<Vec<PathBuf>>,
    /// Listeners with their listening descriptors (pending connections stay queued).
    pub listeners: Vec<ListenerImage>,
    /// The next port ID a listener gets.
    pub next_port_id: u16,
    /// The controller ID range and where handing out IDs goes on.
    pub cntlid_min: u16,
    /// Last ID of the range.
    pub cntlid_max: u16,
    /// The cursor of controller ID allocation.
    pub cntlid_cursor: u16,
    /// The discovery log's generation counter.
    pub discovery_generation: u64,
    /// NVM subsystems.
    pub subsystems: Vec<SubsystemImage>,
    /// Live controllers, discovery controllers included.
    pub controllers: Vec<ControllerImage>,
    /// Open connections.
    pub connections: Vec<ConnImage>,
    /// Local devices, which the new process takes back once this one has exited.
    #[serde(default)]
    pub local: Vec<nvpool_api::LocalDeviceConfig>,
}

/// A listener.
#[derive(Debug, Serialize, Deserialize)]
pub struct ListenerImage {
    /// Port ID (the discovery log's).
    pub port_id: u16,
    /// Bound address.
    pub address: SocketAddr,
    /// Whether hosts connect with TLS.
    #[serde(default)]
    pub tls: nvpool_api::TlsMode,
    /// Index of its descriptor.
    pub fd: usize,
}

/// A subsystem with its namespaces, hosts and ANA states.
#[derive(Debug, Serialize, Deserialize)]
pub struct SubsystemImage {
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
    /// Hosts that must authenticate, with their secrets (the image travels over a
    /// socket pair between the two processes only).
    #[serde(default)]
    pub dhchap: Vec<nvpool_api::HostDhchap>,
    /// Hosts' TLS pre-shared keys.
    #[serde(default)]
    pub tls_psk: Vec<nvpool_api::HostTlsPsk>,
    /// Namespaces.
    pub namespaces: Vec<NamespaceImage>,
    /// ANA states.
    pub ana: AnaImage,
}

/// A namespace.
#[derive(Debug, Serialize, Deserialize)]
pub struct NamespaceImage {
    /// NSID.
    pub nsid: u32,
    /// How its backend opens again.
    pub backend: BackendImage,
    /// Block size.
    pub block_size: u32,
    /// UUID.
    pub uuid: [u8; 16],
    /// NGUID.
    pub nguid: [u8; 16],
    /// ANA group.
    pub ana_group: u32,
    /// I/O limits (none from an engine that had none).
    #[serde(default)]
    pub qos: nvpool_api::QosLimits,
}

/// How a backend opens in the new process.
#[derive(Debug, Serialize, Deserialize)]
pub enum BackendImage {
    /// From its spec, as management adds one (files, volumes, remote namespaces).
    Spec(String),
    /// RAM: the memfd sent and mapped before the pause, so the data stays.
    Memory,
}

/// A subsystem's ANA table.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct AnaImage {
    /// Group states for hosts without their own.
    pub groups: Vec<(u32, AnaState)>,
    /// Per-host states.
    pub hosts: Vec<(String, u32, AnaState)>,
    /// The change count the ANA log reports.
    pub change_count: u64,
}

/// A controller.
#[derive(Debug, Serialize, Deserialize)]
pub struct ControllerImage {
    /// Controller ID.
    pub cntlid: u16,
    /// Its subsystem's NQN.
    pub subsystem: String,
    /// Host NQN.
    pub hostnqn: String,
    /// Host ID.
    pub hostid: [u8; 16],
    /// Keep Alive Timeout (ms); the timer starts again in the new process.
    pub kato_ms: u32,
    /// Controller Configuration.
    pub cc: u32,
    /// Controller Status.
    pub csts: u32,
    /// I/O queues granted.
    pub io_queues_granted: u32,
    /// Queue slots (the most I/O queues it may have, plus the admin queue).
    pub queue_slots: u32,
    /// Async Event Configuration.
    pub async_event_config: u32,
    /// Events waiting for an Asynchronous Event Request.
    pub pending_events: Vec<u32>,
    /// Event types reported and not yet cleared.
    pub masked_events: u32,
    /// The Changed Namespace List.
    pub changed_namespaces: Vec<u32>,
    /// The ANA state of each group as its host sees it (state codes by group ID).
    pub ana: Vec<u8>,
}

/// A connection (one queue).
#[derive(Debug, Serialize, Deserialize)]
pub struct ConnImage {
    /// The reactor that served it.
    pub reactor: usize,
    /// Index of its socket.
    pub fd: usize,
    /// The listener that accepted it.
    pub port_id: Option<u16>,
    /// Who its TLS session proved the host to be (the kernel keeps the session itself
    /// with the socket).
    #[serde(default)]
    pub tls: Option<crate::tls::TlsPeer>,
    /// Whether ICReq was answered.
    pub ready: bool,
    /// Header digests.
    pub header_digest: bool,
    /// Data digests.
    pub data_digest: bool,
    /// Bytes read from the socket and not yet acted on: whole commands that arrived
    /// while the old engine stopped taking new ones, then the start of the next PDU.
    pub input: Vec<u8>,
    /// The queue, once Connect succeeded.
    pub queue: Option<QueueImage>,
    /// Command IDs of outstanding Asynchronous Event Requests (admin queue).
    pub aers: Vec<u16>,
}

/// A connection's queue.
#[derive(Debug, Serialize, Deserialize)]
pub struct QueueImage {
    /// Controller ID.
    pub cntlid: u16,
    /// Queue ID.
    pub qid: u16,
    /// Size (0's based).
    pub sqsize: u16,
    /// Submission queue head reported in completions.
    pub sqhd: u16,
    /// Whether the host disabled SQ flow control.
    pub flow_control_disabled: bool,
    /// Whether the queue may take commands other than authentication (an image from
    /// a build without authentication has every queue so).
    #[serde(default = "yes")]
    pub authenticated: bool,
}

fn yes() -> bool {
    true
}

//! The state image one engine process hands the next: everything a host would notice
//! if it were lost. Plain data, encoded as JSON; descriptors travel beside it and are
//! named here by their index in the order they were sent. Each part is defined beside
//! the state it saves (a subsystem's in `nvme::subsystem`, a controller's in
//! `nvme::controller`, a connection's in `reactor`); this file composes them, with the
//! messages of the handover.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::EngineConfig;
use crate::nvme::controller::ControllerImage;
use crate::nvme::subsystem::SubsystemImage;
use crate::reactor::ConnImage;

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
    /// The address the discovery log gives for the listeners, if set.
    #[serde(default)]
    pub discovery_address: Option<std::net::IpAddr>,
    /// NVM subsystems.
    pub subsystems: Vec<SubsystemImage>,
    /// Live controllers, discovery controllers included.
    pub controllers: Vec<ControllerImage>,
    /// Open connections.
    pub connections: Vec<ConnImage>,
    /// Local devices, which the new process takes back once this one has exited.
    #[serde(default)]
    pub local: Vec<nvpool_api::LocalDeviceConfig>,
    /// Replicated volumes' generations and records of what changed, as (pool, volume,
    /// record). An older image has none: replicas away then rebuild in full.
    #[serde(default)]
    pub generation_records: Vec<(String, String, crate::pool::cluster_map::GenerationRecord)>,
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

//! Engine configuration: a TOML file, or the quick flags form.
//!
//! ```toml
//! reactors = 2                     # or: cores = [0, 1]
//! busy_poll_us = 50                # polling after the last completion (0: never poll)
//! host_nqn = "nqn...:engine:node1" # what remote: namespaces present to their owners
//! remote_queues = "per-namespace"  # or "per-owner": remote namespaces of one owner
//!                                  # subsystem share its controller and queues
//! management_socket = "/run/nvpool/engine.sock"
//!
//! [limits]
//! max_queue_depth = 128            # entries per I/O queue (MQES + 1)
//! max_io_queues = 64               # I/O queues per controller
//! cntlid_min = 1                   # controller IDs this engine hands out: engines that
//! cntlid_max = 65519               # serve one subsystem need ranges that do not overlap
//!
//! [[listener]]
//! address = "127.0.0.1:4420"
//! [[listener]]
//! address = "127.0.0.1:8009"       # discovery; every listener serves every NQN
//! [[listener]]
//! address = "127.0.0.1:4430"
//! tls = "required"                 # NVMe/TCP over TLS 1.3 with a PSK; or "allowed"
//! [[listener]]
//! address = "192.168.1.10:4420"
//! transport = "rdma"               # NVMe over RDMA (RoCE v2, InfiniBand, iWARP)
//!
//! [[subsystem]]
//! nqn = "nqn.2024-01.io.nvpool:vol1"
//! serial = "NVPOOL0001"            # optional: derived from the NQN
//! model = "nvpool"                 # optional
//! allow_any_host = false
//! hosts = ["nqn.2014-08.org.nvmexpress:uuid:..."]
//!
//! [[subsystem.dhchap]]             # a host that must authenticate (DH-HMAC-CHAP);
//! host = "nqn.2014-08.org.nvmexpress:uuid:..."      # allowed too
//! secret = "DHHC-1:01:...:"        # from `nvme gen-dhchap-key`; keep the file 0600
//! ctrl_secret = "DHHC-1:02:...:"   # optional: for hosts that authenticate the controller
//! hash = "sha256"                  # optional: sha384, sha512 (default: the host's first)
//! dh_group = "ffdhe2048"           # optional: null, ffdhe3072 ... ffdhe8192
//!
//! [[subsystem.tls_psk]]            # a host's TLS pre-shared key; the host is allowed too
//! host = "nqn.2014-08.org.nvmexpress:uuid:..."
//! key = "NVMeTLSkey-1:01:...:"     # from `nvme gen-tls-key`; keep the file 0600
//! kdf = "compat"                   # optional: "rfc8446" for hosts with newer libnvme
//!
//! [[subsystem.namespace]]
//! nsid = 1                         # optional: the next free ID
//! backend = "file:/var/lib/nvpool/vol1.img:10GiB"   # or memory:256MiB, null:1GiB
//! block_size = 512                 # optional: 512 (default), 4096, or 0 (4096 where
//!                                   # the storage writes 4 KiB whole, else 512)
//! allow_torn_writes = false         # optional: allow blocks the storage may tear
//! ana_group = 1                     # optional: the ANA group (default: the NSID)
//! uuid = "..."                     # optional: derived from the NQN and NSID
//! qos = { iops = 5000, bps = 209715200 }   # optional: I/O limits per second (also
//!                                   # read_iops, write_iops, read_bps, write_bps)
//!
//! [[pool]]                         # a pool to open at start: all of its disks
//! disks = ["/dev/disk/by-id/nvme-A", "/dev/disk/by-id/nvme-B"]
//! create = "p0"                    # optional: claim the disks as pool p0 if none of
//!                                  # them holds a pool yet (refused if they hold data)
//!
//! [[local]]                        # a block device of this node (ublk)
//! target = "nqn.2024-01.io.nvpool:vol1/1"   # NQN/NSID, or volume:POOL/NAME
//! ublk_id = 0                      # optional: /dev/ublkb0; taken back if an engine
//!                                  # that exited left it
//! read_only = false                # optional
//! queue_depth = 128                # optional: requests in flight per reactor
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;

use nvpool_wire::fabrics::validate_nqn;
use serde::{Deserialize, Serialize};

pub use nvpool_api::{LocalDeviceConfig, NamespaceConfig, SubsystemConfig};

/// Limits the target enforces.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Entries per I/O queue the host may ask for (CAP.MQES + 1).
    pub max_queue_depth: u32,
    /// I/O queues per controller.
    pub max_io_queues: u32,
    /// Lowest controller ID this engine hands out.
    pub cntlid_min: u16,
    /// Highest controller ID this engine hands out. A host groups the paths to a
    /// subsystem by controller ID, so the engines serving one need disjoint ranges.
    pub cntlid_max: u16,
}

/// Highest valid controller ID (NVMe Base 2.0: FFF0h and up are reserved).
pub const MAX_CNTLID: u16 = 0xFFEF;

impl Default for Limits {
    fn default() -> Self {
        Limits { max_queue_depth: 128, max_io_queues: 64, cntlid_min: 1, cntlid_max: MAX_CNTLID }
    }
}

impl Limits {
    fn validate(&self) -> Result<(), String> {
        if !(2..=4096).contains(&self.max_queue_depth) {
            return Err(format!("limits.max_queue_depth = {} must be 2 to 4096", self.max_queue_depth));
        }
        if !(1..=1024).contains(&self.max_io_queues) {
            return Err(format!("limits.max_io_queues = {} must be 1 to 1024", self.max_io_queues));
        }
        check_cntlid_range(self.cntlid_min, self.cntlid_max).map_err(|e| format!("limits.cntlid_min/cntlid_max: {e}"))
    }
}

/// A range of controller IDs an engine may hand out.
pub fn check_cntlid_range(min: u16, max: u16) -> Result<(), String> {
    if min == 0 || min > max || max > MAX_CNTLID {
        return Err(format!(
            "controller IDs {min}..={max} are not a valid range: use min <= max within 1 to {MAX_CNTLID}"
        ));
    }
    Ok(())
}

/// A listener.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// IP address and port.
    pub address: SocketAddr,
    /// Whether hosts connect with TLS: `off` (the default), `allowed` or `required`.
    #[serde(default)]
    pub tls: nvpool_api::TlsMode,
    /// `tcp` (the default) or `rdma`.
    #[serde(default)]
    pub transport: nvpool_api::Transport,
}

/// The whole engine configuration.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Number of reactor threads, pinned to the first CPUs the process may use.
    pub reactors: Option<usize>,
    /// Explicit CPUs to pin reactors to (one reactor each); overrides `reactors`.
    pub cores: Option<Vec<usize>>,
    /// Unix socket of the management API.
    #[serde(default = "default_socket")]
    pub management_socket: PathBuf,
    /// How long, in microseconds, a reactor keeps polling after its last completion
    /// before it sleeps; 0 never polls (for reactors that share CPUs with other busy
    /// threads, where polling only takes the CPU from whoever it waits for).
    #[serde(default = "default_busy_poll_us")]
    pub busy_poll_us: u32,
    /// The host NQN this engine presents to the engines whose namespaces it serves as
    /// `remote:`; derived from the host name when absent. Owners must allow it.
    #[serde(default)]
    pub host_nqn: Option<String>,
    /// Whether `remote:` namespaces of one owner subsystem share one controller (and
    /// one queue per reactor) or each have their own.
    #[serde(default)]
    pub remote_queues: RemoteQueues,
    /// Limits.
    #[serde(default)]
    pub limits: Limits,
    /// Where to serve Prometheus metrics (`GET /metrics`), if anywhere.
    #[serde(default)]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Listeners.
    #[serde(default, rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
    /// Pools to import at start, before the subsystems (whose namespaces may be volumes).
    #[serde(default, rename = "pool")]
    pub pools: Vec<PoolConfig>,
    /// Subsystems.
    #[serde(default, rename = "subsystem")]
    pub subsystems: Vec<SubsystemConfig>,
    /// Local devices (ublk), made or taken back at start, after the subsystems.
    #[serde(default, rename = "local")]
    pub local: Vec<LocalDeviceConfig>,
}

/// How remote namespaces reach their owners.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum RemoteQueues {
    /// A controller (admin queue and a queue per reactor) per remote namespace.
    #[default]
    PerNamespace,
    /// One controller per owner subsystem, shared by its namespaces.
    PerOwner,
}

/// A pool to import: all of its disks.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Paths of every member disk (any order).
    pub disks: Vec<PathBuf>,
    /// A name to claim the disks as a new pool under, at the first start, when none of
    /// them holds a pool yet (disks that hold data are refused); imported afterwards.
    #[serde(default)]
    pub create: Option<String>,
}

/// Where the management socket lives unless configured.
pub fn default_socket() -> PathBuf {
    PathBuf::from("/run/nvpool/engine.sock")
}

/// Longer than a request/response round trip on a fast network, short enough that an
/// idle engine uses no CPU.
fn default_busy_poll_us() -> u32 {
    50
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            reactors: None,
            cores: None,
            management_socket: default_socket(),
            busy_poll_us: default_busy_poll_us(),
            host_nqn: None,
            remote_queues: Default::default(),
            limits: Limits::default(),
            metrics_listen: None,
            listeners: Vec::new(),
            pools: Vec::new(),
            subsystems: Vec::new(),
            local: Vec::new(),
        }
    }
}

impl EngineConfig {
    /// Parses a TOML configuration; errors name the field.
    pub fn from_toml(text: &str) -> Result<EngineConfig, String> {
        let c: EngineConfig = toml::from_str(text).map_err(|e| format!("invalid engine configuration: {e}"))?;
        c.validate()?;
        Ok(c)
    }

    /// Checks what parsing cannot.
    /// Checks what can be checked from the configuration alone; what needs the
    /// machine (its CPUs) or the backends' kinds is checked when the engine starts.
    pub fn validate(&self) -> Result<(), String> {
        self.limits.validate()?;
        if self.reactors == Some(0) {
            return Err("reactors = 0: at least one reactor is needed".into());
        }
        if let Some(q) = &self.host_nqn {
            validate_nqn(q).map_err(|e| format!("host_nqn: {e}"))?;
        }
        if self.cores.as_ref().is_some_and(Vec::is_empty) {
            return Err("cores = []: list at least one CPU".into());
        }
        for s in &self.subsystems {
            validate_nqn(&s.nqn).map_err(|e| format!("subsystem.nqn: {e}"))?;
            for h in &s.hosts {
                validate_nqn(h).map_err(|e| format!("subsystem {} hosts: {e}", s.nqn))?;
            }
        }
        Ok(())
    }
}

pub use nvpool_api::parse_size;

/// The stable UUID of namespace `nsid` of subsystem `nqn`, for namespaces configured
/// without one: the same configuration gives the same identity after a restart.
pub fn derived_uuid(nqn: &str, nsid: u32) -> uuid::Uuid {
    uuid::Uuid::new_v5(&NVPOOL_UUID_NAMESPACE, format!("{nqn}/ns/{nsid}").as_bytes())
}

/// The host identifier an engine presents with its host NQN to other engines: one per
/// host NQN, so that another engine's reservations tell engines apart.
pub fn derived_host_id(host_nqn: &str) -> [u8; 16] {
    *uuid::Uuid::new_v5(&NVPOOL_UUID_NAMESPACE, format!("hostid/{host_nqn}").as_bytes()).as_bytes()
}

/// The NGUID of a namespace with this UUID: derived, so it is stable too.
pub fn derived_nguid(uuid: &uuid::Uuid) -> [u8; 16] {
    *uuid::Uuid::new_v5(&NVPOOL_UUID_NAMESPACE, format!("nguid/{uuid}").as_bytes()).as_bytes()
}

/// A serial number derived from the NQN: 20 hex characters of its hash.
pub fn derived_serial(nqn: &str) -> String {
    uuid::Uuid::new_v5(&NVPOOL_UUID_NAMESPACE, nqn.as_bytes()).simple().to_string()[..20].to_string()
}

/// The UUID namespace of nvpool's derived identifiers.
const NVPOOL_UUID_NAMESPACE: uuid::Uuid = uuid::Uuid::from_u128(0x6e76_706f_6f6c_4e53_8000_0000_0000_0001);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12XB").unwrap_err().contains("unit"));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn toml_config_parses_and_errors_name_the_field() {
        let c = EngineConfig::from_toml(
            r#"
            reactors = 2
            [[listener]]
            address = "127.0.0.1:4420"
            [[subsystem]]
            nqn = "nqn.2024-01.io.nvpool:a"
            allow_any_host = true
            [[subsystem.namespace]]
            backend = "memory:64MiB"
            qos = { write_iops = 100, read_bps = 1048576 }
            "#,
        )
        .unwrap();
        assert_eq!(c.subsystems[0].namespaces[0].block_size, 512);
        let qos = c.subsystems[0].namespaces[0].qos;
        assert_eq!((qos.write_iops, qos.read_bps, qos.iops), (100, 1 << 20, 0));
        let e = EngineConfig::from_toml(
            "[[subsystem]]\nnqn = \"x\"\n[[subsystem.namespace]]\nbackend = \"null:1M\"\nqos = { iopz = 1 }",
        );
        assert!(e.unwrap_err().contains("iopz"));
        assert_eq!(c.listeners[0].address.port(), 4420);
        let e = EngineConfig::from_toml("reactorz = 1").unwrap_err();
        assert!(e.contains("reactorz"), "{e}");
        let e = EngineConfig::from_toml("[limits]\nmax_queue_depth = 1").unwrap_err();
        assert!(e.contains("max_queue_depth"), "{e}");
        let e = EngineConfig::from_toml("[[subsystem]]\nnqn = \"x\"").unwrap_err();
        assert!(e.contains("subsystem.nqn"), "{e}");
    }

    #[test]
    fn derived_identities_are_stable() {
        assert_eq!(derived_uuid("nqn.a", 1), derived_uuid("nqn.a", 1));
        assert_ne!(derived_uuid("nqn.a", 1), derived_uuid("nqn.a", 2));
        assert_eq!(derived_serial("nqn.a").len(), 20);
    }
}

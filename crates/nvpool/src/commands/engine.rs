//! `nvpool engine`: run the engine, or manage a running one through its management
//! socket (subsystems, namespaces, hosts, listeners, pools, volumes, stats).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use nvpool_api::{
    AddHost, AddListener, AddLocalDevice, AddNamespace, AddSubsystem, AllowAnyHost, AnaGroupInfo, AnaState,
    CancelMigration, CheckPool, CloneVolume, CreatePool, CreateSnapshot, CreateVolume, DeleteVolume, DhchapKeys,
    DirtyAction, ExportPool, GetEngineInfo, GetMigration, GetRebuild, GetVolume, GrowNamespace, ImportPool,
    InflateVolume, ListAnaGroups, ListListeners, ListLocalDevices, ListPools, ListSubsystems, ListVolumes,
    ListenerInfo, LocalDeviceConfig, LocalDeviceInfo, Method, MigrationInfo, PathAddress, PoolInfo, RebuildInfo,
    RemoveHost, RemoveListener, RemoveLocalDevice, RemoveNamespace, RemoveSubsystem, ResizeVolume, SetAnaState,
    SetNamespaceQos, StartMigration, StartRebuild, SubsystemInfo, SwapNamespace, SwitchMigration, TlsMode, TlsPsk,
    Transport, UpgradeEngine, VolumeDirty, VolumeIdentity, VolumeInfo, VolumeWrittenSince,
};
use nvpool_engine::Engine;
use nvpool_engine::config::{
    EngineConfig, ListenerConfig, NamespaceConfig, PoolConfig, SubsystemConfig, default_socket,
};
use nvpool_engine::mgmt;
use nvpool_engine::upgrade::process::notify_service_manager;

use crate::output::{QosArgs, human, parse_size, print_or, render};

#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct EngineCommand {
    #[command(subcommand)]
    verb: Option<EngineVerb>,
    #[command(flatten)]
    run: EngineArgs,
}

/// Verbs that talk to one engine through its management socket.
#[derive(Subcommand)]
enum EngineVerb {
    /// Manage subsystems of the engine.
    Subsystem {
        #[command(subcommand)]
        verb: SubsystemVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Manage namespaces of the engine.
    Namespace {
        #[command(subcommand)]
        verb: NamespaceVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Serve namespaces as block devices of this node: ublk for its own containers,
    /// vhost-user-blk for its virtual machines.
    Local {
        #[command(subcommand)]
        verb: LocalVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Manage the hosts allowed on a subsystem.
    Host {
        #[command(subcommand)]
        verb: HostVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Manage the listeners of the engine.
    Listener {
        #[command(subcommand)]
        verb: ListenerVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Manage disk pools of the engine.
    Pool {
        #[command(subcommand)]
        verb: EnginePoolVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Manage volumes in the pools of the engine.
    Volume {
        #[command(subcommand)]
        verb: EngineVolumeVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// ANA states of a subsystem's namespace groups on this engine (multipath).
    Ana {
        #[command(subcommand)]
        verb: AnaVerb,
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Show per-namespace I/O statistics.
    Stats {
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Show the engine's version, process, connections and listeners.
    Info {
        #[command(flatten)]
        api: EngineSocket,
    },
    /// Replace the running engine with a new binary, keeping every connection (hot
    /// upgrade). If the new binary fails, the running engine goes on serving.
    Upgrade {
        /// The new nvpool binary (default: the running engine's executable path).
        #[arg(long)]
        binary: Option<PathBuf>,
        #[command(flatten)]
        api: EngineSocket,
    },
}

#[derive(Args)]
struct EngineSocket {
    /// The engine's management socket.
    #[arg(long, global = true, default_value_os_t = default_socket())]
    socket: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Args)]
struct EngineArgs {
    /// Take over a running engine that started this process for a hot upgrade (set
    /// by `nvpool engine upgrade`, never by hand).
    #[arg(long, hide = true)]
    take_over: bool,
    /// A TOML configuration file (see the README); the quick flags below are then
    /// not allowed.
    #[arg(long, conflicts_with_all = ["listen", "subsystem", "namespace", "host", "pool"])]
    config: Option<PathBuf>,
    /// Import a pool at start: its disks, comma-separated (repeatable, one per pool).
    #[arg(long)]
    pool: Vec<String>,
    /// Address to serve on (repeatable): IP:PORT for NVMe/TCP, rdma:IP:PORT for NVMe
    /// over RDMA.
    #[arg(long)]
    listen: Vec<PathAddress>,
    /// NQN of the subsystem to serve.
    #[arg(long, requires = "namespace")]
    subsystem: Option<String>,
    /// A namespace: memory:SIZE, null:SIZE, file:PATH, file:PATH:SIZE, volume:POOL/NAME,
    /// remote:HOST:PORT/NQN/NSID or "mirror:LEG LEG ..." (replicas: each write goes to
    /// every leg) (repeatable).
    #[arg(long)]
    namespace: Vec<String>,
    /// Block size of the namespaces: 512, 4096, or 0 for 4096 where the storage writes
    /// 4 KiB whole across a power loss.
    #[arg(long, default_value_t = 512)]
    block_size: u32,
    /// Allow only these hosts (repeatable); without it any host may connect.
    #[arg(long)]
    host: Vec<String>,
    /// Number of reactor threads.
    #[arg(long)]
    reactors: Option<usize>,
    /// CPUs to pin reactors to, e.g. 0,1 (overrides --reactors).
    #[arg(long, value_delimiter = ',')]
    cores: Option<Vec<usize>>,
    /// Microseconds a reactor polls after its last completion before it sleeps (0:
    /// never; for reactors that share CPUs with other busy threads).
    #[arg(long)]
    busy_poll_us: Option<u32>,
    /// The host NQN this engine presents to the owners of its `remote:` namespaces
    /// (default: one per machine, from its host name).
    #[arg(long)]
    host_nqn: Option<String>,
    /// Remote namespaces of one owner subsystem share one controller and queue per
    /// reactor (per-owner), or each have their own (per-namespace, the default).
    #[arg(long, value_parser = ["per-namespace", "per-owner"])]
    remote_queues: Option<String>,
    /// Also listen for discovery on this port at the first --listen address (0: no).
    #[arg(long, default_value_t = 8009)]
    discovery_port: u16,
    /// Path of the management socket.
    #[arg(long)]
    mgmt_socket: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9480.
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
}

#[derive(Subcommand)]
enum SubsystemVerb {
    /// List subsystems and their namespaces.
    List,
    /// Create a subsystem.
    Add {
        /// NQN.
        nqn: String,
        /// Serial number (derived from the NQN by default).
        #[arg(long)]
        serial: Option<String>,
        /// Model number.
        #[arg(long, default_value = "nvpool")]
        model: String,
        /// Let any host connect.
        #[arg(long)]
        allow_any_host: bool,
    },
    /// Remove a subsystem (its controllers are disconnected).
    Remove {
        /// NQN.
        nqn: String,
    },
}

#[derive(Subcommand)]
enum NamespaceVerb {
    /// Add a namespace; connected hosts see it appear.
    Add {
        /// Subsystem NQN.
        nqn: String,
        /// Backend: memory:SIZE, null:SIZE, file:PATH, file:PATH:SIZE, volume:POOL/NAME,
        /// remote:HOST:PORT/NQN/NSID (another engine's namespace, forwarded) or
        /// "mirror:LEG LEG ..." (a replicated volume: each write goes to every leg).
        backend: String,
        /// Namespace ID (the next free one by default).
        #[arg(long)]
        nsid: Option<u32>,
        /// Block size: 512, 4096, or 0 for 4096 where the storage writes 4 KiB whole.
        #[arg(long, default_value_t = 512)]
        block_size: u32,
        /// UUID (derived from the NQN and NSID by default).
        #[arg(long)]
        uuid: Option<uuid::Uuid>,
        /// Serve blocks larger than the storage writes whole across a power loss.
        #[arg(long)]
        allow_torn_writes: bool,
        /// ANA group, 1 to 1024 (the NSID by default); the same on every path.
        #[arg(long)]
        ana_group: Option<u32>,
        #[command(flatten)]
        qos: QosArgs,
    },
    /// Set a namespace's I/O limits, from its next command on; hosts stay connected.
    /// Limits not given stay as they are.
    Qos {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
        #[command(flatten)]
        qos: QosArgs,
        /// Lift every limit (before applying those given).
        #[arg(long)]
        clear: bool,
    },
    /// Remove a namespace.
    Remove {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
    },
    /// Bring a replica into the mirror serving a namespace: it gets every write from
    /// now on, and what it lacks is copied to it under live writes.
    Rebuild {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID of the mirror.
        nsid: u32,
        /// The replica: remote:HOST:PORT/NQN/NSID.
        leg: String,
        /// The generation it left at: copy only the clusters written since (default:
        /// every cluster).
        #[arg(long)]
        since: Option<u64>,
        /// Most bytes per second the copy takes, e.g. 200MiB.
        #[arg(long, value_parser = parse_size)]
        rate: Option<u64>,
    },
    /// Show a namespace's rebuild.
    Rebuilding {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
    },
    /// Serve a namespace from another backend from its next command on, invisibly to
    /// hosts (same identity and blocks): a mirror of the replicas left after one
    /// failed, a volume's new place.
    Swap {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
        /// The new backend, as for `add`.
        backend: String,
    },
    /// Serve the size a `remote:` or `mirror:` namespace's backend has now (its
    /// owner's volume, or every leg, grew): the backend opens again from its spec and
    /// hosts are told the namespace changed.
    Grow {
        /// Subsystem NQN.
        nqn: String,
        /// Namespace ID.
        nsid: u32,
    },
}

#[derive(Subcommand)]
enum LocalVerb {
    /// Serve a namespace as /dev/ublkbN (or take back the device of that number an
    /// engine that exited left, with the I/O it held), or to virtual machines at a
    /// vhost-user-blk socket.
    Add {
        /// NQN/NSID, or volume:POOL/NAME for the namespace that serves that volume.
        target: String,
        /// As a ublk block device (Linux 6.0 or later, module ublk_drv).
        #[arg(long, required_unless_present = "vhost_user_blk", conflicts_with = "vhost_user_blk")]
        ublk: bool,
        /// As a vhost-user-blk device at this Unix socket, for QEMU's
        /// `-device vhost-user-blk-pci` (give QEMU shared guest memory).
        #[arg(long, value_name = "SOCKET")]
        vhost_user_blk: Option<String>,
        /// The device number N of /dev/ublkbN (the first free one by default).
        #[arg(long)]
        id: Option<u32>,
        /// Refuse writes.
        #[arg(long)]
        read_only: bool,
        /// Requests in flight per reactor (128 by default).
        #[arg(long)]
        queue_depth: Option<u16>,
    },
    /// Remove a local device once the I/O under way is done.
    Remove {
        /// The device number N of /dev/ublkbN, or the vhost-user-blk socket.
        device: String,
    },
    /// List the local devices.
    List,
}

#[derive(Subcommand)]
enum AnaVerb {
    /// List the ANA groups with their namespaces and states.
    List {
        /// Subsystem NQN.
        nqn: String,
    },
    /// Set a group's state for every host without its own, or for one host.
    Set {
        /// Subsystem NQN.
        nqn: String,
        /// ANA group ID.
        group: u32,
        /// optimized, non-optimized, inaccessible, persistent-loss or change.
        state: AnaState,
        /// Only for this host NQN.
        #[arg(long)]
        host: Option<String>,
    },
}

#[derive(Subcommand)]
enum EnginePoolVerb {
    /// List pools with capacity and use.
    List,
    /// Claim disks (block devices or files) as a new pool.
    Create {
        /// Pool name.
        name: String,
        /// Disks, in order; the first holds the metadata.
        #[arg(required = true)]
        disks: Vec<PathBuf>,
        /// Cluster size, the unit of thin allocation (128KiB to 1GiB).
        #[arg(long, value_parser = parse_size)]
        cluster_size: Option<u64>,
        /// Claim disks that hold a filesystem or another pool (their data is lost).
        #[arg(long)]
        force: bool,
    },
    /// Open an existing pool from all of its disks.
    Import {
        /// Every disk of the pool, in any order.
        #[arg(required = true)]
        disks: Vec<PathBuf>,
    },
    /// Close a pool; its disks keep everything.
    Export {
        /// Pool name.
        name: String,
    },
    /// Check a pool's metadata and space accounting.
    Check {
        /// Pool name.
        name: String,
    },
}

#[derive(Subcommand)]
enum EngineVolumeVerb {
    /// List volumes (of one pool, or all).
    List {
        /// Pool name.
        pool: Option<String>,
    },
    /// Create a volume (thick unless --thin).
    Create {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// Size, e.g. 10GiB.
        #[arg(value_parser = parse_size)]
        size: u64,
        /// Allocate clusters on first write instead of now.
        #[arg(long)]
        thin: bool,
        /// Namespace UUID the volume keeps (another engine's volume it is to replace).
        #[arg(long, requires = "nguid")]
        uuid: Option<String>,
        /// Namespace NGUID (32 hex digits), with --uuid.
        #[arg(long, requires = "uuid")]
        nguid: Option<String>,
    },
    /// Delete a volume and free its space.
    Delete {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    },
    /// Grow a volume; hosts see the new size.
    Resize {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// New size, e.g. 20GiB.
        #[arg(value_parser = parse_size)]
        size: u64,
    },
    /// Take a crash-consistent snapshot of a volume (its exports hold new commands
    /// while those under way finish); prints how long I/O was held.
    Snapshot {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// The snapshot's name.
        snapshot: String,
    },
    /// Make a writable volume that reads as a snapshot until written.
    Clone {
        /// Pool name.
        pool: String,
        /// The snapshot.
        snapshot: String,
        /// The new volume's name.
        name: String,
    },
    /// Make a volume that lies over a snapshot (a clone) independent of it, in the
    /// background: what it reads from the snapshot is copied into it, after which the
    /// snapshot can go without keeping its space. `volume stats` shows the progress.
    Inflate {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// Wait until it is done, printing the progress.
        #[arg(long)]
        wait: bool,
    },
    /// Show one volume: size, allocation, identity.
    Stats {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    },
    /// Track the clusters written to a volume (for migration).
    Dirty {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// start, stop, report, or reset (report and clear).
        #[arg(value_parser = parse_dirty_action)]
        action: DirtyAction,
    },
    /// The clusters of a replicated volume written at a generation or later: what a
    /// replica that left at the generation before lacks.
    WrittenSince {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// The generation.
        generation: u64,
    },
    /// Move a volume to another engine under running hosts: copy it in rounds to the
    /// target namespace (a volume of the same size and identity there, exported to
    /// this engine's host NQN), until `switch` and `cancel`.
    Migrate {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// The target namespace: HOST:PORT/NQN/NSID.
        #[arg(long)]
        to: String,
        /// Most bytes per second the copy takes, e.g. 200MiB.
        #[arg(long, value_parser = parse_size)]
        rate: Option<u64>,
    },
    /// Show a migration's progress.
    Migration {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    },
    /// Let a migration switch hosts over to the target at the next short round.
    Switch {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
        /// Longest pause of hosts' I/O, in milliseconds.
        #[arg(long)]
        pause_ms: Option<u32>,
    },
    /// Stop a migration that has not switched; the volume stays here.
    Cancel {
        /// Pool name.
        pool: String,
        /// Volume name.
        name: String,
    },
}

#[derive(Subcommand)]
enum HostVerb {
    /// Allow a host; with a DH-HMAC-CHAP secret, it must authenticate every queue.
    Add {
        /// Subsystem NQN.
        nqn: String,
        /// Host NQN.
        host: String,
        /// The secret the host must prove it knows (`DHHC-1:...`, from `nvme
        /// gen-dhchap-key`); taken from the environment to keep it out of `ps`.
        #[arg(long, env = "NVPOOL_DHCHAP_SECRET", hide_env_values = true)]
        dhchap_secret: Option<String>,
        /// The controller's secret, for a host that authenticates the controller too.
        #[arg(long, env = "NVPOOL_DHCHAP_CTRL_SECRET", hide_env_values = true, requires = "dhchap_secret")]
        dhchap_ctrl_secret: Option<String>,
        /// The hash to choose: sha256, sha384 or sha512 (default: the host's first).
        #[arg(long, requires = "dhchap_secret")]
        dhchap_hash: Option<String>,
        /// The Diffie-Hellman group to choose: null, ffdhe2048 (default) to ffdhe8192.
        #[arg(long, requires = "dhchap_secret")]
        dhchap_dhgroup: Option<String>,
        /// The host's pre-shared key for NVMe/TCP over TLS (`NVMeTLSkey-1:...`, from
        /// `nvme gen-tls-key`); taken from the environment to keep it out of `ps`.
        #[arg(long, env = "NVPOOL_TLS_PSK", hide_env_values = true)]
        tls_psk: Option<String>,
        /// How the host's tools derive TLS keys from the PSK: compat (libnvme before
        /// mid-2025, e.g. Debian 13; the default) or rfc8446 (SPDK, newer libnvme).
        #[arg(long, requires = "tls_psk", value_parser = ["compat", "rfc8446"])]
        tls_psk_kdf: Option<String>,
    },
    /// Disallow a host (its controllers are disconnected).
    Remove {
        /// Subsystem NQN.
        nqn: String,
        /// Host NQN.
        host: String,
    },
    /// Let any host connect (on) or only allowed ones (off).
    AllowAny {
        /// Subsystem NQN.
        nqn: String,
        /// on or off.
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
}

#[derive(Subcommand)]
enum ListenerVerb {
    /// List listeners.
    List,
    /// Listen on an address.
    Add {
        /// IP:PORT for NVMe/TCP, or rdma:IP:PORT for NVMe over RDMA.
        address: PathAddress,
        /// NVMe/TCP over TLS 1.3: off, allowed (TLS or plain) or required.
        #[arg(long, default_value = "off")]
        tls: TlsMode,
    },
    /// Stop listening on an address.
    Remove {
        /// IP:PORT, or rdma:IP:PORT.
        address: PathAddress,
    },
}

/// Runs the engine, or one verb against a running engine.
pub fn run(c: EngineCommand) -> Result<(), String> {
    match c.verb {
        None => run_engine(c.run),
        Some(verb) => run_engine_verb(verb),
    }
}

fn run_engine_verb(verb: EngineVerb) -> Result<(), String> {
    match verb {
        EngineVerb::Subsystem { verb, api } => match verb {
            SubsystemVerb::List => show(&api, ListSubsystems {}, |r| subsystem_table(r)),
            SubsystemVerb::Add { nqn, serial, model, allow_any_host } => {
                let message = format!("subsystem {nqn} added");
                let config = SubsystemConfig {
                    nqn,
                    serial,
                    model,
                    allow_any_host,
                    hosts: vec![],
                    dhchap: vec![],
                    tls_psk: vec![],
                    namespaces: vec![],
                };
                done(&api, AddSubsystem(config), &message)
            }
            SubsystemVerb::Remove { nqn } => {
                let message = format!("subsystem {nqn} removed");
                done(&api, RemoveSubsystem { nqn }, &message)
            }
        },
        EngineVerb::Namespace { verb, api } => match verb {
            NamespaceVerb::Add { nqn, backend, nsid, block_size, uuid, allow_torn_writes, ana_group, qos } => {
                let qos = qos.applied_to(Default::default());
                let namespace = NamespaceConfig { nsid, backend, block_size, uuid, allow_torn_writes, ana_group, qos };
                let r = api.call(AddNamespace { nqn: nqn.clone(), namespace })?;
                print_or(api.json, &r, || format!("namespace {} added to {nqn}", r.nsid));
                Ok(())
            }
            NamespaceVerb::Qos { nqn, nsid, qos, clear } => {
                let subsystems = api.call(ListSubsystems {})?;
                let current = subsystems
                    .iter()
                    .filter(|s| s.nqn == nqn)
                    .flat_map(|s| &s.namespaces)
                    .find(|n| n.nsid == nsid)
                    .map(|n| n.qos)
                    .ok_or_else(|| {
                        format!("no namespace {nsid} in {nqn}: `nvpool engine subsystem list` shows them")
                    })?;
                if !clear && !qos.given() {
                    return Err(format!(
                        "namespace {nsid} of {nqn} has limits {}: give --iops, --bw or another limit to change \
                         them, or --clear",
                        current.describe()
                    ));
                }
                let limits = qos.applied_to(if clear { Default::default() } else { current });
                let message = format!("namespace {nsid} of {nqn}: limits {}", limits.describe());
                done(&api, SetNamespaceQos { nqn, nsid, limits }, &message)
            }
            NamespaceVerb::Remove { nqn, nsid } => {
                let message = format!("namespace {nsid} removed from {nqn}");
                done(&api, RemoveNamespace { nqn, nsid }, &message)
            }
            NamespaceVerb::Rebuild { nqn, nsid, leg, since, rate } => {
                show(&api, StartRebuild { nqn, nsid, leg, since, rate }, rebuild_table)
            }
            NamespaceVerb::Rebuilding { nqn, nsid } => show(&api, GetRebuild { nqn, nsid }, rebuild_table),
            NamespaceVerb::Swap { nqn, nsid, backend } => {
                let message = format!("namespace {nsid} of {nqn} served by {backend}");
                done(&api, SwapNamespace { nqn, nsid, backend }, &message)
            }
            NamespaceVerb::Grow { nqn, nsid } => {
                let message = format!("namespace {nsid} of {nqn} serves its backend's size now");
                done(&api, GrowNamespace { nqn, nsid }, &message)
            }
        },
        EngineVerb::Local { verb, api } => match verb {
            LocalVerb::Add { target, ublk: _, vhost_user_blk, id, read_only, queue_depth } => {
                let device = LocalDeviceConfig { target, ublk_id: id, read_only, queue_depth, vhost_user_blk };
                let r = api.call(AddLocalDevice { device })?;
                let d = &r.device;
                let how = if d.recovered { "taken back" } else { "serving" };
                print_or(api.json, &r, || {
                    format!("{} {how} {} ({}; {})", d.device, d.target, human(d.size), d.data_path)
                });
                Ok(())
            }
            LocalVerb::Remove { device } => {
                let message = format!("{device} removed");
                let request = match device.strip_prefix("/dev/ublkb").unwrap_or(&device).parse::<u32>() {
                    Ok(id) => RemoveLocalDevice { ublk_id: Some(id), socket: None },
                    Err(_) => RemoveLocalDevice { ublk_id: None, socket: Some(device) },
                };
                done(&api, request, &message)
            }
            LocalVerb::List => show(&api, ListLocalDevices {}, |r| local_table(r)),
        },
        EngineVerb::Ana { verb, api } => match verb {
            AnaVerb::List { nqn } => show(&api, ListAnaGroups { nqn }, |r| ana_table(r)),
            AnaVerb::Set { nqn, group, state, host } => {
                let whom = host.as_ref().map_or("hosts without their own".to_string(), |h| format!("host {h}"));
                let message = format!("ANA group {group} of {nqn}: {state} for {whom}");
                done(&api, SetAnaState { nqn, group, host, state }, &message)
            }
        },
        EngineVerb::Host { verb, api } => match verb {
            HostVerb::Add {
                nqn,
                host,
                dhchap_secret,
                dhchap_ctrl_secret,
                dhchap_hash,
                dhchap_dhgroup,
                tls_psk,
                tls_psk_kdf,
            } => {
                let dhchap = dhchap_secret.map(|secret| DhchapKeys {
                    secret,
                    ctrl_secret: dhchap_ctrl_secret,
                    hash: dhchap_hash,
                    dh_group: dhchap_dhgroup,
                });
                let how = match &dhchap {
                    Some(k) if k.ctrl_secret.is_some() => " (DH-HMAC-CHAP, bidirectional)",
                    Some(_) => " (DH-HMAC-CHAP)",
                    None => "",
                };
                let tls_psk = tls_psk.map(|key| TlsPsk { key, kdf: tls_psk_kdf });
                let psk = if tls_psk.is_some() { " with a TLS PSK" } else { "" };
                let message = format!("host {host} allowed on {nqn}{how}{psk}");
                done(&api, AddHost { nqn, host, dhchap, tls_psk }, &message)
            }
            HostVerb::Remove { nqn, host } => {
                let message = format!("host {host} removed from {nqn}");
                done(&api, RemoveHost { nqn, host }, &message)
            }
            HostVerb::AllowAny { nqn, state } => {
                let message = format!("allow any host on {nqn}: {state}");
                done(&api, AllowAnyHost { nqn, allow: state == "on" }, &message)
            }
        },
        EngineVerb::Listener { verb, api } => match verb {
            ListenerVerb::List => show(&api, ListListeners {}, |r| listener_table(r)),
            ListenerVerb::Add { address: a, tls } => {
                let how = if tls == TlsMode::Off { String::new() } else { format!(" (TLS {})", tls.name()) };
                let add = AddListener { address: a.address, tls, transport: a.transport };
                done(&api, add, &format!("listening on {a}{how}"))
            }
            ListenerVerb::Remove { address: a } => {
                let remove = RemoveListener { address: a.address, transport: a.transport };
                done(&api, remove, &format!("stopped listening on {a}"))
            }
        },
        EngineVerb::Pool { verb, api } => match verb {
            EnginePoolVerb::List => show(&api, ListPools {}, |r| pool_table(r)),
            EnginePoolVerb::Create { name, disks, cluster_size, force } => {
                show(&api, CreatePool { name, disks, cluster_size, force }, |r| pool_table(std::slice::from_ref(r)))
            }
            EnginePoolVerb::Import { disks } => {
                show(&api, ImportPool { disks }, |r| pool_table(std::slice::from_ref(r)))
            }
            EnginePoolVerb::Export { name } => {
                let message = format!("pool {name} exported");
                done(&api, ExportPool { name }, &message)
            }
            EnginePoolVerb::Check { name } => {
                let message = format!("pool {name}: metadata and space accounting are consistent");
                done(&api, CheckPool { name }, &message)
            }
        },
        EngineVerb::Volume { verb, api } => match verb {
            EngineVolumeVerb::List { pool } => show(&api, ListVolumes { pool }, |r| volume_table(r)),
            EngineVolumeVerb::Create { pool, name, size, thin, uuid, nguid } => {
                let identity = uuid.zip(nguid).map(|(uuid, nguid)| VolumeIdentity { uuid, nguid });
                show(&api, CreateVolume { pool, name, size, thin, identity }, |r| volume_table(std::slice::from_ref(r)))
            }
            EngineVolumeVerb::Migrate { pool, name, to, rate } => {
                show(&api, StartMigration { pool, name, id: String::new(), target: to, rate }, migration_table)
            }
            EngineVolumeVerb::Migration { pool, name } => show(&api, GetMigration { pool, name }, migration_table),
            EngineVolumeVerb::Switch { pool, name, pause_ms } => {
                show(&api, SwitchMigration { pool, name, pause_ms }, migration_table)
            }
            EngineVolumeVerb::Cancel { pool, name } => show(&api, CancelMigration { pool, name }, migration_table),
            EngineVolumeVerb::Delete { pool, name } => {
                let message = format!("volume {pool}/{name} deleted");
                done(&api, DeleteVolume { pool, name }, &message)
            }
            EngineVolumeVerb::Resize { pool, name, size } => {
                show(&api, ResizeVolume { pool, name, size }, |r| volume_table(std::slice::from_ref(r)))
            }
            EngineVolumeVerb::Snapshot { pool, name, snapshot } => {
                let r = api.call(CreateSnapshot { pool, volume: name, name: snapshot, identity: None })?;
                print_or(api.json, &r, || {
                    format!(
                        "{}\nI/O held {:.2} ms",
                        render(&volume_table(std::slice::from_ref(&r.snapshot))),
                        r.pause_us as f64 / 1000.0
                    )
                });
                Ok(())
            }
            EngineVolumeVerb::Clone { pool, snapshot, name } => {
                let clone = CloneVolume { pool, snapshot, name, identity: None };
                show(&api, clone, |r| volume_table(std::slice::from_ref(r)))
            }
            EngineVolumeVerb::Inflate { pool, name, wait } => {
                let mut r = api.call(InflateVolume { pool: pool.clone(), name: name.clone() })?;
                while wait && r.inflating.as_ref().is_some_and(|p| p.stopped.is_none()) {
                    if let (false, Some(p)) = (api.json, &r.inflating) {
                        eprint!("\rinflating {pool}/{name}: {} of {} clusters", p.copied, p.total);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    r = api.call(GetVolume { pool: pool.clone(), name: name.clone() })?;
                }
                if wait && !r.parent.is_empty() {
                    let why = r.inflating.and_then(|p| p.stopped).unwrap_or_else(|| "see the engine's log".into());
                    return Err(format!(
                        "the inflation of {pool}/{name} stopped before it was done ({why}): run `nvpool engine volume \
                         inflate` again to go on"
                    ));
                }
                if wait && !api.json {
                    eprintln!();
                }
                print_or(api.json, &r, || render(&volume_table(std::slice::from_ref(&r))));
                Ok(())
            }
            EngineVolumeVerb::Stats { pool, name } => {
                show(&api, GetVolume { pool, name }, |r| volume_table(std::slice::from_ref(r)))
            }
            EngineVolumeVerb::WrittenSince { pool, name, generation } => {
                let r = api.call(VolumeWrittenSince { pool, name, generation })?;
                print_or(api.json, &r, || {
                    let whole = if r.complete {
                        ""
                    } else {
                        "; this engine did not record every write since then: a rebuild from it copies everything"
                    };
                    format!(
                        "generation {}; {} clusters of {} written at generation {generation} or later ({}){whole}",
                        r.generation,
                        r.clusters.len(),
                        human(r.cluster_size),
                        human(r.clusters.len() as u64 * r.cluster_size)
                    )
                });
                Ok(())
            }
            EngineVolumeVerb::Dirty { pool, name, action } => {
                let r = api.call(VolumeDirty { pool, name, action })?;
                print_or(api.json, &r, || {
                    let clusters: Vec<String> = r.clusters.iter().map(u64::to_string).collect();
                    format!(
                        "tracking: {}; cluster size {}; {} dirty clusters{}{}",
                        if r.tracking { "on" } else { "off" },
                        human(r.cluster_size),
                        clusters.len(),
                        if clusters.is_empty() { "" } else { ": " },
                        clusters.join(" ")
                    )
                });
                Ok(())
            }
        },
        EngineVerb::Stats { api } => show(&api, ListSubsystems {}, |r| stats_table(r)),
        EngineVerb::Info { api } => show(&api, GetEngineInfo {}, |i| {
            let listeners: Vec<String> = i.listeners.iter().map(|l| format!("{}:{}", l.addr, l.port)).collect();
            vec![
                ["VERSION", "PID", "CONTROLLERS", "CONNECTIONS", "LISTENERS", "HOST NQN"].map(String::from).to_vec(),
                vec![
                    i.version.clone(),
                    i.pid.to_string(),
                    i.controllers.to_string(),
                    i.connections.to_string(),
                    listeners.join(","),
                    i.host_nqn.clone(),
                ],
            ]
        }),
        EngineVerb::Upgrade { binary, api } => {
            let r = api.call(UpgradeEngine { binary })?;
            print_or(api.json, &r, || {
                format!(
                    "upgraded: pid {} ({}) -> pid {} ({}); {} connections and {} controllers kept; the new binary \
                     started in {:.1} ms; I/O paused {:.2} ms (finishing commands {:.2}, handing over {:.2}, \
                     rebuilding {:.2})",
                    r.old_pid,
                    r.old_version,
                    r.new_pid,
                    r.new_version,
                    r.connections,
                    r.controllers,
                    r.start_us as f64 / 1000.0,
                    r.pause_us as f64 / 1000.0,
                    r.park_us as f64 / 1000.0,
                    r.transfer_us as f64 / 1000.0,
                    r.rebuild_us as f64 / 1000.0,
                )
            });
            Ok(())
        }
    }
}

fn parse_dirty_action(s: &str) -> Result<DirtyAction, String> {
    serde_json::from_value(serde_json::Value::String(s.into()))
        .map_err(|_| format!("{s:?} is not an action: use start, stop, report or reset"))
}

fn engine_config(a: &EngineArgs) -> Result<EngineConfig, String> {
    let mut cfg = match &a.config {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            EngineConfig::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))?
        }
        None => {
            if a.listen.is_empty() {
                return Err("give --listen ADDR (e.g. --listen 127.0.0.1:4420) or --config FILE".into());
            }
            let mut cfg = EngineConfig {
                listeners: a
                    .listen
                    .iter()
                    .map(|l| ListenerConfig { address: l.address, tls: Default::default(), transport: l.transport })
                    .collect(),
                pools: a
                    .pool
                    .iter()
                    .map(|disks| PoolConfig { disks: disks.split(',').map(PathBuf::from).collect(), create: None })
                    .collect(),
                ..EngineConfig::default()
            };
            if a.discovery_port != 0 && !a.listen.iter().any(|l| l.address.port() == a.discovery_port) {
                let first = a.listen[0];
                let address = SocketAddr::new(first.address.ip(), a.discovery_port);
                cfg.listeners.push(ListenerConfig { address, tls: Default::default(), transport: first.transport });
            }
            if let Some(nqn) = &a.subsystem {
                cfg.subsystems.push(SubsystemConfig {
                    nqn: nqn.clone(),
                    serial: None,
                    model: "nvpool".into(),
                    allow_any_host: a.host.is_empty(),
                    hosts: a.host.clone(),
                    dhchap: vec![],
                    tls_psk: vec![],
                    namespaces: a
                        .namespace
                        .iter()
                        .map(|b| NamespaceConfig {
                            nsid: None,
                            backend: b.clone(),
                            block_size: a.block_size,
                            uuid: None,
                            allow_torn_writes: false,
                            ana_group: None,
                            qos: Default::default(),
                        })
                        .collect(),
                });
            } else if !a.namespace.is_empty() {
                return Err("--namespace needs --subsystem NQN".into());
            }
            cfg
        }
    };
    if let Some(r) = a.reactors {
        cfg.reactors = Some(r);
    }
    if let Some(c) = &a.cores {
        cfg.cores = Some(c.clone());
    }
    if let Some(addr) = a.metrics_listen {
        cfg.metrics_listen = Some(addr);
    }
    if let Some(us) = a.busy_poll_us {
        cfg.busy_poll_us = us;
    }
    if let Some(q) = &a.host_nqn {
        cfg.host_nqn = Some(q.clone());
    }
    match a.remote_queues.as_deref() {
        Some("per-owner") => cfg.remote_queues = nvpool_engine::config::RemoteQueues::PerOwner,
        Some(_) => cfg.remote_queues = nvpool_engine::config::RemoteQueues::PerNamespace,
        None => {}
    }
    if let Some(s) = &a.mgmt_socket {
        cfg.management_socket = s.clone();
    }
    cfg.validate()?;
    Ok(cfg)
}

fn run_engine(a: EngineArgs) -> Result<(), String> {
    crate::process::catch_stop_signals();
    crate::process::raise_open_file_limit();
    if a.take_over {
        return run_taken_over();
    }
    let cfg = engine_config(&a)?;
    let engine = Engine::start(&cfg)?;
    if let Err(e) = mgmt::serve(engine.clone(), &cfg.management_socket) {
        engine.stop();
        return Err(e);
    }
    if let Some(addr) = cfg.metrics_listen {
        match nvpool_engine::metrics::serve(engine.clone(), addr) {
            Ok(bound) => println!("  metrics at http://{bound}/metrics"),
            Err(e) => {
                engine.stop();
                return Err(e);
            }
        }
    }
    println!(
        "nvpool engine {} running; management socket {}",
        nvpool_engine::version(),
        cfg.management_socket.display()
    );
    for l in engine.listeners() {
        let scheme = if l.transport == Transport::Rdma { "rdma:" } else { "" };
        println!("  listening on {scheme}{}:{}", l.addr, l.port);
    }
    for s in engine.subsystems() {
        for l in engine.listeners().iter().filter(|l| cfg.listeners.first().is_some_and(|f| f.address.port() == l.port))
        {
            let t = l.transport.name();
            println!("connect a host with:\n  nvme connect -t {t} -a {} -s {} -n {}", l.addr, l.port, s.nqn);
        }
    }
    notify_service_manager(&format!("READY=1\nMAINPID={}", std::process::id()));
    serve_until_stopped(&engine, &cfg.management_socket);
    Ok(())
}

/// Serves until SIGINT or SIGTERM, then stops the engine and removes its socket.
fn serve_until_stopped(engine: &Engine, management_socket: &Path) {
    crate::process::wait_for_stop();
    println!("nvpool engine stopping");
    notify_service_manager("STOPPING=1");
    engine.stop();
    let _ = std::fs::remove_file(management_socket);
}

/// The new process of a hot upgrade: takes the running engine over, then serves
/// until stopped, like any engine.
fn run_taken_over() -> Result<(), String> {
    crate::process::catch_stop_signals();
    let env = nvpool_engine::upgrade::TAKEOVER_FD_ENV;
    let fd = std::env::var(env)
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("--take-over is for `nvpool engine upgrade`: {env} names no handover socket"))?;
    let taken = Engine::take_over(fd)?;
    let engine = taken.engine;
    if let Err(e) = mgmt::serve_listener(engine.clone(), taken.management) {
        engine.stop();
        return Err(e);
    }
    if let Some(addr) = taken.config.metrics_listen {
        // The old process still holds the address for a moment while it exits.
        nvpool_engine::metrics::serve_once_free(engine.clone(), addr);
    }
    println!(
        "nvpool engine {} took over (pid {}); management socket {}",
        nvpool_engine::version(),
        std::process::id(),
        taken.config.management_socket.display()
    );
    serve_until_stopped(&engine, &taken.config.management_socket);
    Ok(())
}

impl EngineSocket {
    fn call<M: Method>(&self, request: M) -> Result<M::Reply, String> {
        nvpool_api::call(&self.socket, &request).map_err(|e| format!("{} [{}]", e.message, e.kind))
    }
}

fn done<M: Method>(api: &EngineSocket, request: M, message: &str) -> Result<(), String> {
    let r = api.call(request)?;
    print_or(api.json, &r, || message.to_string());
    Ok(())
}

fn show<M: Method>(
    api: &EngineSocket,
    request: M,
    table: impl FnOnce(&M::Reply) -> Vec<Vec<String>>,
) -> Result<(), String> {
    let r = api.call(request)?;
    print_or(api.json, &r, || render(&table(&r)));
    Ok(())
}

fn subsystem_table(subsystems: &[SubsystemInfo]) -> Vec<Vec<String>> {
    let mut rows = vec![["NQN", "NSID", "BACKEND", "SIZE", "BLOCK", "UUID", "HOSTS"].map(String::from).to_vec()];
    for sub in subsystems {
        // A host that must authenticate is marked: (chap), or (chap2) when bidirectional;
        // one with a TLS PSK: (psk).
        let marked = |h: &String| {
            let psk = if sub.tls_psk_hosts.contains(h) { " (psk)" } else { "" };
            let chap = match sub.authenticated_hosts.iter().find(|a| &a.host == h) {
                Some(a) if a.bidirectional => " (chap2)",
                Some(_) => " (chap)",
                None => "",
            };
            format!("{h}{chap}{psk}")
        };
        let listed: Vec<String> = sub.hosts.iter().map(marked).collect();
        let hosts = if sub.allow_any_host {
            ["any".to_string()].into_iter().chain(listed).collect::<Vec<_>>().join(",")
        } else {
            listed.join(",")
        };
        if sub.namespaces.is_empty() {
            rows.push(vec![sub.nqn.clone(), "-".into(), "-".into(), "-".into(), "-".into(), "-".into(), hosts.clone()]);
        }
        for ns in &sub.namespaces {
            rows.push(vec![
                sub.nqn.clone(),
                ns.nsid.to_string(),
                match ns.faulted_legs.as_slice() {
                    [] => ns.backend.clone(),
                    faulted => {
                        let legs: Vec<&str> = faulted.iter().map(|f| f.leg.as_str()).collect();
                        format!("{} (faulted: {})", ns.backend, legs.join(", "))
                    }
                },
                human(ns.size),
                ns.block_size.to_string(),
                ns.uuid.clone(),
                hosts.clone(),
            ]);
        }
    }
    rows
}

fn local_table(devices: &[LocalDeviceInfo]) -> Vec<Vec<String>> {
    let mut rows = vec![["DEVICE", "TARGET", "SIZE", "MODE", "QUEUES", "DATA PATH"].map(String::from).to_vec()];
    for d in devices {
        let mode = if d.read_only { "ro" } else { "rw" };
        let queues =
            if d.queue_depth == 0 { format!("up to {}", d.queues) } else { format!("{}x{}", d.queues, d.queue_depth) };
        let path = d.data_path.split(':').next().unwrap_or_default().to_string();
        rows.push(vec![d.device.clone(), d.target.clone(), human(d.size), mode.into(), queues, path]);
    }
    rows
}

fn ana_table(groups: &[AnaGroupInfo]) -> Vec<Vec<String>> {
    let mut rows = vec![["GROUP", "NSIDS", "STATE", "HOSTS WITH THEIR OWN STATE"].map(String::from).to_vec()];
    for g in groups {
        let nsids: Vec<String> = g.nsids.iter().map(u32::to_string).collect();
        let hosts: Vec<String> = g.hosts.iter().map(|h| format!("{}={}", h.host, h.state)).collect();
        let hosts = if hosts.is_empty() { "-".to_string() } else { hosts.join(" ") };
        rows.push(vec![g.group.to_string(), nsids.join(","), g.state.to_string(), hosts]);
    }
    rows
}

fn stats_table(subsystems: &[SubsystemInfo]) -> Vec<Vec<String>> {
    let mut rows =
        vec![["NQN", "NSID", "READS", "WRITES", "READ", "WRITTEN", "OTHER", "ERRORS"].map(String::from).to_vec()];
    for sub in subsystems {
        for ns in &sub.namespaces {
            let st = &ns.stats;
            rows.push(vec![
                sub.nqn.clone(),
                ns.nsid.to_string(),
                st.reads.to_string(),
                st.writes.to_string(),
                human(st.read_bytes),
                human(st.write_bytes),
                st.others.to_string(),
                st.errors.to_string(),
            ]);
        }
    }
    rows
}

fn pool_table(pools: &[PoolInfo]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["NAME", "DISKS", "CLUSTER", "CAPACITY", "USED", "FREE", "PROVISIONED", "VOLUMES", "STATE"]
            .map(String::from)
            .to_vec(),
    ];
    for p in pools {
        rows.push(vec![
            p.name.clone(),
            p.disks.join(","),
            human(p.cluster_size),
            human(p.capacity_bytes),
            human(p.used_bytes),
            human(p.free_bytes),
            human(p.provisioned_bytes),
            p.volumes.to_string(),
            match (&p.failed, p.power_losses) {
                (Some(f), _) => format!("failed: {f}"),
                (None, 0) => "online".to_string(),
                // Said, so that nobody wonders why its replicas were rebuilt in full.
                (None, n) => format!("online ({n} power losses)"),
            },
        ]);
    }
    rows
}

fn rebuild_table(r: &RebuildInfo) -> Vec<Vec<String>> {
    let state = if r.error.is_empty() { r.state.clone() } else { format!("{}: {}", r.state, r.error) };
    vec![
        ["STATE", "REPLICA", "COPIED", "OF"].map(String::from).to_vec(),
        vec![state, r.leg.clone(), human(r.copied_bytes), human(r.total_bytes)],
    ]
}

fn migration_table(m: &MigrationInfo) -> Vec<Vec<String>> {
    let state = serde_json::to_value(m.state).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default();
    let rounds: Vec<String> = m.round_bytes.iter().map(|b| human(*b)).collect();
    vec![
        vec![
            "STATE".into(),
            "TARGET".into(),
            "ROUND".into(),
            "COPIED".into(),
            "DIRTY".into(),
            "RATE".into(),
            "ROUNDS".into(),
            "PAUSE".into(),
            "NOTE".into(),
        ],
        vec![
            state,
            m.target.clone(),
            m.round.to_string(),
            human(m.copied_bytes),
            human(m.dirty_bytes),
            format!("{}/s", human(m.rate)),
            rounds.join(" "),
            m.pause_us.map_or("-".into(), |us| format!("{:.1} ms", us as f64 / 1000.0)),
            m.error.clone().unwrap_or_else(|| if m.volume_here { String::new() } else { "volume not here".into() }),
        ],
    ]
}

fn volume_table(volumes: &[VolumeInfo]) -> Vec<Vec<String>> {
    let mut rows = vec![
        ["POOL", "NAME", "SIZE", "TYPE", "ALLOCATED", "PARENT", "UUID", "DIRTY TRACKING"].map(String::from).to_vec(),
    ];
    for x in volumes {
        let kind = match (x.snapshot, x.thin) {
            (true, _) => "snapshot",
            (false, true) => "thin",
            (false, false) => "thick",
        };
        rows.push(vec![
            x.pool.clone(),
            x.name.clone(),
            human(x.size),
            kind.to_string(),
            human(x.allocated_bytes),
            match (&x.inflating, x.parent.is_empty()) {
                (Some(p), _) if p.stopped.is_some() => format!("{} (inflation stopped)", x.parent),
                (Some(p), _) => format!("{} (inflating: {}%)", x.parent, p.copied * 100 / p.total.max(1)),
                (None, true) => "-".into(),
                (None, false) => x.parent.clone(),
            },
            x.uuid.clone(),
            if x.dirty_tracking { "on" } else { "off" }.to_string(),
        ]);
    }
    rows
}

fn listener_table(listeners: &[ListenerInfo]) -> Vec<Vec<String>> {
    let mut rows = vec![["PORT ID", "TRANSPORT", "ADDRESS", "PORT", "TLS"].map(String::from).to_vec()];
    for l in listeners {
        rows.push(vec![
            l.port_id.to_string(),
            l.transport.name().to_string(),
            l.addr.to_string(),
            l.port.to_string(),
            l.tls.name().to_string(),
        ]);
    }
    rows
}

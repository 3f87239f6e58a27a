//! `nvpool csi`: nvpool's CSI driver (CSI v1.12.0). The Controller service calls the
//! nvpool controller; the Node service attaches volumes with the kernel's NVMe/TCP
//! host. One process can serve either or both on one Unix socket.

mod controller;
mod fsinfo;
pub mod kube;
mod node;

use nvpool_control::client::Controllers;
use std::path::PathBuf;
use std::sync::Arc;

/// The generated CSI types and services (`proto/csi.proto`).
#[allow(clippy::all, missing_docs)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// The driver's name, as StorageClasses and CSIDriver objects give it.
pub const PLUGIN_NAME: &str = "csi.nvpool.io";
/// The topology key: the nvpool node a CSI node is.
pub const TOPOLOGY_NODE_KEY: &str = "topology.nvpool.io/node";
/// The StorageClass parameter (and volume context key) choosing how a pod on the
/// volume's own node reaches it: `ublk` (a local device where the kernel has ublk, the
/// default) or `nvme-tcp`.
pub const LOCAL_PATH: &str = "localPath";
/// The publish context key naming the local device a host on the owner node got.
pub const LOCAL_DEVICE: &str = "localDevice";
/// The StorageClass parameter (and volume context key) asking that hosts authenticate
/// with DH-HMAC-CHAP: `true` or `false` (the default).
pub const DHCHAP: &str = "dhchap";
/// The publish context key naming the Secret (`NAMESPACE/NAME`) with a host's
/// DH-HMAC-CHAP secrets.
pub const DHCHAP_SECRET: &str = "dhchapSecret";

/// Why a capability is not supported, if it is not.
fn capability_error(c: &csi::VolumeCapability) -> Option<String> {
    use csi::volume_capability::{AccessType, access_mode::Mode};
    let mode = c.access_mode.as_ref().map(|m| m.mode).and_then(|m| Mode::try_from(m).ok());
    let block = matches!(c.access_type, Some(AccessType::Block(_)));
    match (&c.access_type, mode) {
        (None, _) => Some("a volume capability needs an access type (block or mount)".into()),
        (_, None | Some(Mode::Unknown)) => Some("a volume capability needs an access mode".into()),
        (Some(AccessType::Mount(m)), _) if !["", "ext4", "xfs"].contains(&m.fs_type.as_str()) => {
            Some(format!("filesystem {:?} is not supported: use ext4 or xfs", m.fs_type))
        }
        // A filesystem mounted on several nodes at once would be corrupted; raw block
        // devices shared between nodes are the application's business.
        (_, Some(Mode::MultiNodeSingleWriter | Mode::MultiNodeMultiWriter)) if !block => {
            Some("a filesystem volume can be written from one node only; use block access to share it".into())
        }
        _ => None,
    }
}

/// A field CSI requires: INVALID_ARGUMENT when empty.
fn required<'a>(value: &'a str, what: &str) -> Result<&'a str, tonic::Status> {
    if value.is_empty() { Err(tonic::Status::invalid_argument(format!("{what} is required"))) } else { Ok(value) }
}

/// Keeps NotFound from the controller (with the volume named); other errors as they are.
fn not_found_or(e: tonic::Status, volume: &str) -> tonic::Status {
    if e.code() == tonic::Code::NotFound {
        tonic::Status::not_found(format!("volume {volume} does not exist"))
    } else {
        e
    }
}

/// Which services to serve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Controller,
    Node,
    All,
}

pub struct CsiArgs {
    /// `unix:///path`, `unix:/path` or a path.
    pub endpoint: String,
    pub mode: Mode,
    /// nvpool controller addresses: the Controller service calls them, and the Node
    /// service asks them for the paths of its staged volumes.
    pub controllers: String,
    pub node_name: String,
    pub host_nqn: String,
    pub state_dir: PathBuf,
    /// Mutual TLS to the controllers, when on.
    pub tls: Option<nvpool_control::tls::Tls>,
    /// The Kubernetes API, for hosts' DH-HMAC-CHAP secrets (`None`: volumes whose class
    /// asks for them are refused).
    pub kube: Option<kube::KubeApi>,
    /// The namespace of those Secrets (the driver's own).
    pub secret_namespace: String,
}

/// Serves until the process ends.
pub async fn run(args: CsiArgs) -> Result<(), String> {
    let path = args.endpoint.trim_start_matches("unix://").trim_start_matches("unix:").to_string();
    if path.is_empty() {
        return Err("--endpoint needs a Unix socket path, e.g. unix:///csi/csi.sock".into());
    }
    let _ = std::fs::remove_file(&path);
    if let Some(dir) = std::path::Path::new(&path).parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(&path).map_err(|e| format!("cannot listen on {path}: {e}"))?;
    let serves_controller = args.mode != Mode::Node;
    let client = Arc::new(Controllers::with_tls(&args.controllers, args.tls.as_ref())?);
    let controllers = serves_controller.then(|| client.clone());
    let mut router = tonic::transport::Server::builder().add_service(csi::identity_server::IdentityServer::new(
        controller::IdentityService { controllers: controllers.clone() },
    ));
    if let Some(c) = controllers {
        let secrets = args
            .kube
            .clone()
            .map(|api| Arc::new(controller::SecretStore { api, namespace: args.secret_namespace.clone() }));
        router = router.add_service(csi::controller_server::ControllerServer::new(controller::ControllerService {
            controllers: c,
            secrets,
        }));
    }
    if args.mode != Mode::Controller {
        if !args.host_nqn.starts_with("nqn.") {
            return Err(format!(
                "host NQN {:?} is not an NQN: pass --host-nqn, or create /etc/nvme/hostnqn (nvme gen-hostnqn)",
                args.host_nqn
            ));
        }
        let node = Arc::new(node::NodeService {
            node_name: args.node_name,
            host_nqn: args.host_nqn,
            state_dir: args.state_dir,
            path_changes: tokio::sync::Mutex::new(()),
            kube: args.kube.clone(),
        });
        tokio::spawn(node.clone().follow_paths(client));
        router = router.add_service(csi::node_server::NodeServer::from_arc(node));
    }
    tracing::info!("nvpool csi ({:?}) serving {PLUGIN_NAME} on {path}", args.mode);
    router
        .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
        .await
        .map_err(|e| format!("CSI server failed: {e}"))
}

//! csi-call: calls a CSI driver on its Unix socket the way Kubernetes does when a pod
//! starts and ends on a node, for tests that need a volume staged by the node plugin
//! without a kubelet, and for trying a node plugin by hand.
//!
//! ```text
//! csi-call SOCKET publish VOLUME TARGET     ControllerPublish to this node, NodeStage, NodePublish
//! csi-call SOCKET unpublish VOLUME TARGET   NodeUnpublish, NodeUnstage, ControllerUnpublish
//! ```
//!
//! The volume is used as a raw block device (single-node writer): TARGET becomes the
//! device, staged at `TARGET.staging`. The driver must serve the Controller and Node
//! services on the one socket (`nvpool csi`, which serves both by default).

use nvpool_csi::csi;
use nvpool_csi::csi::controller_client::ControllerClient;
use nvpool_csi::csi::node_client::NodeClient;
use tonic::transport::{Channel, Endpoint, Uri};

fn block_capability() -> csi::VolumeCapability {
    use csi::volume_capability::{AccessMode, AccessType, BlockVolume, access_mode::Mode};
    csi::VolumeCapability {
        access_type: Some(AccessType::Block(BlockVolume {})),
        access_mode: Some(AccessMode { mode: Mode::SingleNodeWriter as i32 }),
    }
}

async fn connect(socket: String) -> Result<Channel, String> {
    // The URI is never dialled: every connection goes to the socket.
    Endpoint::from_static("http://csi.invalid")
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { tokio::net::UnixStream::connect(socket).await.map(hyper_util::rt::TokioIo::new) }
        }))
        .await
        .map_err(|e| format!("cannot reach the CSI driver: {e}"))
}

async fn publish(channel: Channel, volume: &str, target: &str) -> Result<(), tonic::Status> {
    let mut node = NodeClient::new(channel.clone());
    let mut controller = ControllerClient::new(channel);
    let node_id = node.node_get_info(csi::NodeGetInfoRequest {}).await?.into_inner().node_id;
    let publish_context = controller
        .controller_publish_volume(csi::ControllerPublishVolumeRequest {
            volume_id: volume.into(),
            node_id,
            volume_capability: Some(block_capability()),
            ..Default::default()
        })
        .await?
        .into_inner()
        .publish_context;
    let staging = format!("{target}.staging");
    node.node_stage_volume(csi::NodeStageVolumeRequest {
        volume_id: volume.into(),
        publish_context: publish_context.clone(),
        staging_target_path: staging.clone(),
        volume_capability: Some(block_capability()),
        ..Default::default()
    })
    .await?;
    node.node_publish_volume(csi::NodePublishVolumeRequest {
        volume_id: volume.into(),
        publish_context,
        staging_target_path: staging,
        target_path: target.into(),
        volume_capability: Some(block_capability()),
        ..Default::default()
    })
    .await?;
    Ok(())
}

async fn unpublish(channel: Channel, volume: &str, target: &str) -> Result<(), tonic::Status> {
    let mut node = NodeClient::new(channel.clone());
    let mut controller = ControllerClient::new(channel);
    let node_id = node.node_get_info(csi::NodeGetInfoRequest {}).await?.into_inner().node_id;
    node.node_unpublish_volume(csi::NodeUnpublishVolumeRequest {
        volume_id: volume.into(),
        target_path: target.into(),
    })
    .await?;
    node.node_unstage_volume(csi::NodeUnstageVolumeRequest {
        volume_id: volume.into(),
        staging_target_path: format!("{target}.staging"),
    })
    .await?;
    controller
        .controller_unpublish_volume(csi::ControllerUnpublishVolumeRequest {
            volume_id: volume.into(),
            node_id,
            ..Default::default()
        })
        .await?;
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, verb, volume, target] = args.as_slice() else {
        eprintln!("usage: csi-call SOCKET publish|unpublish VOLUME TARGET");
        std::process::exit(2);
    };
    let channel = match connect(socket.trim_start_matches("unix://").to_string()).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("csi-call: {e} at {socket}: is the driver running?");
            std::process::exit(1);
        }
    };
    let done = match verb.as_str() {
        "publish" => publish(channel, volume, target).await,
        "unpublish" => unpublish(channel, volume, target).await,
        _ => {
            eprintln!("csi-call: unknown verb {verb:?}: publish or unpublish");
            std::process::exit(2);
        }
    };
    if let Err(e) = done {
        eprintln!("csi-call: {verb} {volume}: {}: {}", e.code(), e.message());
        std::process::exit(1);
    }
}

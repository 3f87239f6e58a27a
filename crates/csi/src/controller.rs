//! The CSI Identity and Controller services. The Controller service turns CSI calls
//! into calls on the nvpool controller: a CSI volume is an nvpool volume of the same
//! name (the volume ID is that name), and a CSI node ID is the node's host NQN, so
//! that publishing a volume to a node is attaching it to that host.

use crate::csi::{self, controller_server::Controller, identity_server::Identity};
use crate::kube::KubeApi;
use crate::{
    DHCHAP, DHCHAP_SECRET, LOCAL_DEVICE, LOCAL_PATH, PLUGIN_NAME, TOPOLOGY_NODE_KEY, capability_error, not_found_or,
    required,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// Size of a volume created without a capacity range.
const DEFAULT_SIZE: i64 = 1 << 30;
/// Sizes are whole 4 KiB blocks.
const BLOCK: i64 = 4096;
/// ListVolumes and ListSnapshots tokens name the last entry of the previous page.
const TOKEN_PREFIX: &str = "after:";

pub struct IdentityService {
    /// With no controller to reach (a node-only plugin), Probe only says the plugin runs.
    pub controllers: Option<Arc<Controllers>>,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: PLUGIN_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: HashMap::new(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{Service, Type, VolumeExpansion, service, volume_expansion};
        let service =
            |t: service::Type| csi::PluginCapability { r#type: Some(Type::Service(Service { r#type: t as i32 })) };
        let mut capabilities = vec![service(service::Type::VolumeAccessibilityConstraints)];
        if self.controllers.is_some() {
            capabilities.push(service(service::Type::ControllerService));
        }
        capabilities.push(csi::PluginCapability {
            r#type: Some(Type::VolumeExpansion(VolumeExpansion { r#type: volume_expansion::Type::Online as i32 })),
        });
        Ok(Response::new(csi::GetPluginCapabilitiesResponse { capabilities }))
    }

    async fn probe(&self, _: Request<csi::ProbeRequest>) -> Result<Response<csi::ProbeResponse>, Status> {
        if let Some(c) = &self.controllers {
            c.call(async |mut c| c.cluster_info(proto::ClusterInfoRequest {}).await).await?;
        }
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

pub struct ControllerService {
    pub controllers: Arc<Controllers>,
    /// Where hosts' DH-HMAC-CHAP secrets go, for volumes whose class asks for them.
    pub secrets: Option<Arc<SecretStore>>,
}

/// The Kubernetes namespace whose Secrets carry hosts' DH-HMAC-CHAP secrets from the
/// Controller service to the Node service.
pub struct SecretStore {
    pub api: KubeApi,
    pub namespace: String,
}

impl SecretStore {
    /// The Secret of one attachment: a name from the volume and the host (hashed, as
    /// either may hold characters a Secret name may not).
    pub fn name(volume: &str, host: &str) -> String {
        let digest = nvpool_auth::Hash::Sha256.digest(&[volume.as_bytes(), b"\0", host.as_bytes()]);
        let hex: String = digest[..10].iter().map(|b| format!("{b:02x}")).collect();
        format!("nvpool-dhchap-{hex}")
    }
}

/// The size to create: the required bytes rounded up to whole blocks, within the limit.
fn size_from(range: Option<&csi::CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(Status::invalid_argument("capacity_range bytes must not be negative"));
    }
    if limit > 0 && required > limit {
        return Err(Status::invalid_argument(format!("required_bytes {required} is more than limit_bytes {limit}")));
    }
    let wanted = if required > 0 {
        required
    } else if limit > 0 {
        limit.min(DEFAULT_SIZE)
    } else {
        DEFAULT_SIZE
    };
    let size = (wanted as u64).div_ceil(BLOCK as u64) as i64 * BLOCK;
    if limit > 0 && size > limit {
        return Err(Status::out_of_range(format!(
            "volumes are whole 4096-byte blocks; none lies between {required} and {limit} bytes"
        )));
    }
    Ok(size as u64)
}

fn csi_volume(v: &proto::Volume) -> csi::Volume {
    csi::Volume {
        capacity_bytes: v.size_bytes as i64,
        volume_id: v.name.clone(),
        volume_context: HashMap::from([("uuid".to_string(), v.uuid.clone()), ("node".to_string(), v.node.clone())]),
        content_source: None,
        // Every node reaches every volume over NVMe/TCP, so no topology restricts use.
        accessible_topology: vec![],
    }
}

/// One page of a CSI list: `entries` sorted by name, those after the entry the token
/// names, at most `max_entries` of them (0: all); and the token of the next page
/// (empty after the last).
fn page<'a, T>(
    entries: &'a mut [T],
    name: impl Fn(&T) -> &str,
    max_entries: i32,
    starting_token: &str,
) -> Result<(&'a [T], String), Status> {
    if max_entries < 0 {
        return Err(Status::invalid_argument("max_entries must not be negative"));
    }
    entries.sort_by(|a, b| name(a).cmp(name(b)));
    let start = match starting_token {
        "" => 0,
        token => {
            let after = token
                .strip_prefix(TOKEN_PREFIX)
                .ok_or_else(|| Status::aborted(format!("starting_token {token:?} was not made by this plugin")))?;
            entries.partition_point(|e| name(e) <= after)
        }
    };
    let rest = &entries[start..];
    let take = if max_entries == 0 { rest.len() } else { (max_entries as usize).min(rest.len()) };
    let next_token = if take < rest.len() { format!("{TOKEN_PREFIX}{}", name(&rest[take - 1])) } else { String::new() };
    Ok((&rest[..take], next_token))
}

/// A CSI snapshot: its ID is the nvpool snapshot's name, its source the volume's.
fn csi_snapshot(s: &proto::Snapshot) -> csi::Snapshot {
    let ms = s.created_ms as i64;
    csi::Snapshot {
        size_bytes: s.size_bytes as i64,
        snapshot_id: s.name.clone(),
        source_volume_id: s.volume.clone(),
        creation_time: Some(prost_types::Timestamp { seconds: ms / 1000, nanos: (ms % 1000) as i32 * 1_000_000 }),
        ready_to_use: s.state == "ready",
        group_snapshot_id: String::new(),
    }
}

/// The snapshot or the volume a new volume is made from (empty: none).
fn content_source(source: Option<&csi::VolumeContentSource>) -> Result<(&str, &str), Status> {
    use csi::volume_content_source::Type;
    match source.and_then(|s| s.r#type.as_ref()) {
        None => Ok(("", "")),
        Some(Type::Snapshot(s)) => Ok((required(&s.snapshot_id, "volume_content_source.snapshot.snapshot_id")?, "")),
        Some(Type::Volume(v)) => Ok(("", required(&v.volume_id, "volume_content_source.volume.volume_id")?)),
    }
}

/// The single-node access modes; the others need several hosts on one volume.
fn single_node(c: &csi::VolumeCapability) -> bool {
    use csi::volume_capability::access_mode::Mode;
    let mode = c.access_mode.as_ref().map_or(0, |m| m.mode);
    matches!(
        Mode::try_from(mode),
        Ok(Mode::SingleNodeWriter
            | Mode::SingleNodeReaderOnly
            | Mode::SingleNodeSingleWriter
            | Mode::SingleNodeMultiWriter)
    )
}

/// Host NQNs are CSI node IDs; anything else names no node.
fn host_of(node_id: &str) -> Result<&str, Status> {
    let node_id = required(node_id, "node_id")?;
    if node_id.starts_with("nqn.") {
        Ok(node_id)
    } else {
        Err(Status::not_found(format!(
            "node {node_id:?} is not an nvpool CSI node: node IDs are host NQNs (NodeGetInfo reports them)"
        )))
    }
}

impl ControllerService {
    async fn volume(&self, name: &str) -> Result<proto::Volume, Status> {
        let req = proto::VolumeName { name: name.to_string() };
        self.controllers.call(async |mut c| c.get_volume(req.clone()).await).await
    }

    /// The nvpool node a host runs on, as its agent reports the node's own host NQN;
    /// empty when no node does (the host then gets NVMe/TCP paths).
    async fn node_of_host(&self, host: &str) -> Result<String, Status> {
        let nodes = self.controllers.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await?.nodes;
        Ok(nodes.into_iter().find(|n| n.local_host_nqn == host).map(|n| n.name).unwrap_or_default())
    }

    /// Maps CSI topology to the scheduler's request: the preferred node becomes a
    /// local preference, requisite nodes the include list. Topology naming nodes nvpool
    /// does not know (say, a node without disks or agent) is a preference it cannot use.
    async fn placement(
        &self,
        req: &csi::CreateVolumeRequest,
        out: &mut proto::CreateVolumeRequest,
    ) -> Result<(), Status> {
        let Some(t) = &req.accessibility_requirements else { return Ok(()) };
        let known: Vec<String> = self
            .controllers
            .call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await)
            .await?
            .nodes
            .into_iter()
            .map(|n| n.name)
            .collect();
        let node_of = |t: &csi::Topology| t.segments.get(TOPOLOGY_NODE_KEY).filter(|n| known.contains(n)).cloned();
        if let Some(preferred) = t.preferred.iter().find_map(node_of) {
            out.host_node = preferred;
            out.locality = proto::Locality::Local as i32;
        }
        let requisite: Vec<String> = t.requisite.iter().filter_map(node_of).collect();
        if !requisite.is_empty() {
            out.include_nodes = requisite;
        }
        Ok(())
    }
}

/// The StorageClass parameters that set I/O limits, and whether each is in bytes per
/// second (else commands per second).
const QOS_PARAMETERS: [(&str, bool); 6] = [
    ("iops", false),
    ("readIops", false),
    ("writeIops", false),
    ("bandwidth", true),
    ("readBandwidth", true),
    ("writeBandwidth", true),
];

/// The I/O limits a class's parameters set.
/// A true|false parameter of the storage class; false when absent.
fn bool_parameter(parameters: &HashMap<String, String>, name: &str) -> Result<bool, Status> {
    match parameters.get(name).map(String::as_str) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(Status::invalid_argument(format!("parameter {name}={other:?}: use true or false"))),
    }
}

fn qos_parameters(parameters: &HashMap<String, String>) -> Result<nvpool_api::QosLimits, Status> {
    let mut values = [0u64; 6];
    for ((name, bytes), value) in QOS_PARAMETERS.iter().zip(values.iter_mut()) {
        let Some(given) = parameters.get(*name) else { continue };
        let parsed = if *bytes {
            nvpool_api::parse_rate(given)
        } else {
            given.trim().parse::<u64>().map_err(|_| "use a whole number of commands per second, or 0".to_string())
        };
        *value = parsed.map_err(|e| Status::invalid_argument(format!("parameter {name}={given:?}: {e}")))?;
    }
    let [iops, read_iops, write_iops, bps, read_bps, write_bps] = values;
    Ok(nvpool_api::QosLimits { iops, read_iops, write_iops, bps, read_bps, write_bps })
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        r: Request<csi::CreateVolumeRequest>,
    ) -> Result<Response<csi::CreateVolumeResponse>, Status> {
        let req = r.into_inner();
        let name = required(&req.name, "name")?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        for c in &req.volume_capabilities {
            capability_error(c).map_or(Ok(()), |e| Err(Status::invalid_argument(e)))?;
        }
        let (from_snapshot, clone_of) = content_source(req.volume_content_source.as_ref())?;
        let thin = bool_parameter(&req.parameters, "thin")?;
        let pinned = bool_parameter(&req.parameters, "pinned")?;
        let access_policy = match req.parameters.get("accessPolicy").map(String::as_str) {
            None | Some("inherit") => proto::AccessPolicy::Inherit,
            Some("balance") => proto::AccessPolicy::Balance,
            Some(other) => {
                return Err(Status::invalid_argument(format!(
                    "parameter accessPolicy={other:?} does not exist: use inherit or balance"
                )));
            }
        };
        let local_path = match req.parameters.get("localPath").map(String::as_str) {
            None | Some("ublk") => "ublk",
            Some("nvme-tcp") => "nvme-tcp",
            Some(other) => {
                return Err(Status::invalid_argument(format!(
                    "parameter localPath={other:?} does not exist: use ublk (a pod on the volume's own node gets a \
                     local device where the kernel has ublk) or nvme-tcp (always NVMe/TCP)"
                )));
            }
        };
        let dhchap = bool_parameter(&req.parameters, DHCHAP)?;
        if dhchap && self.secrets.is_none() {
            return Err(Status::failed_precondition(format!(
                "the class asks for {DHCHAP}=true, and this driver reaches no Kubernetes API to hand hosts their \
                 secrets through: run it in a pod, or pass --kube-api"
            )));
        }
        let qos = qos_parameters(&req.parameters)?;
        let replicas = match req.parameters.get("replicas").map(String::as_str) {
            None => 1,
            Some(n) => match n.parse::<u32>() {
                Ok(n @ 1..=3) => n,
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "parameter replicas={n:?}: use 1, 2 or 3 (copies of the data, each on its own node)"
                    )));
                }
            },
        };
        let known = ["thin", "pinned", "accessPolicy", "volumeGroup", "localPath", "replicas", DHCHAP];
        let known: Vec<&str> = known.into_iter().chain(QOS_PARAMETERS.iter().map(|(name, _)| *name)).collect();
        if let Some(unknown) =
            req.parameters.keys().find(|k| !k.starts_with("csi.storage.k8s.io/") && !known.contains(&k.as_str()))
        {
            return Err(Status::invalid_argument(format!(
                "unknown parameter {unknown:?}: nvpool takes thin=true|false, pinned=true|false, replicas=1|2|3, \
                 accessPolicy=inherit|balance, volumeGroup=NAME, localPath=ublk|nvme-tcp, {DHCHAP}=true|false, \
                 and the I/O limits iops, readIops, writeIops (per second), bandwidth, readBandwidth and \
                 writeBandwidth (e.g. 200MiB/s)"
            )));
        }
        // A volume from a source is its source's size unless asked for more.
        let sourced = !from_snapshot.is_empty() || !clone_of.is_empty();
        let size = match &req.capacity_range {
            None if sourced => 0,
            range => size_from(range.as_ref())?,
        };
        let mut create = proto::CreateVolumeRequest {
            name: name.to_string(),
            size_bytes: size,
            from_snapshot: from_snapshot.to_string(),
            clone_of: clone_of.to_string(),
            thin,
            access_policy: access_policy as i32,
            group: req.parameters.get("volumeGroup").cloned().unwrap_or_default(),
            qos: (!qos.is_unlimited()).then(|| qos.into()),
            pinned,
            replicas,
            ..Default::default()
        };
        self.placement(&req, &mut create).await?;
        let created = self.controllers.call(async |mut c| c.create_volume(create.clone()).await).await;
        let v = match created {
            Ok(r) => r.volume.unwrap_or_default(),
            // The same name with another size is the CO's mistake; say so in CSI's terms.
            Err(e) if e.code() == tonic::Code::AlreadyExists => return Err(e),
            Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                return Err(Status::resource_exhausted(e.message()));
            }
            // Smaller than its source: a capacity the plugin cannot give.
            Err(e) if sourced && e.code() == tonic::Code::InvalidArgument => {
                return Err(Status::out_of_range(e.message()));
            }
            Err(e) => return Err(e),
        };
        let mut volume = csi_volume(&v);
        volume.content_source = req.volume_content_source.clone();
        volume.volume_context.insert(LOCAL_PATH.to_string(), local_path.to_string());
        if dhchap {
            volume.volume_context.insert(DHCHAP.to_string(), "true".to_string());
        }
        Ok(Response::new(csi::CreateVolumeResponse { volume: Some(volume) }))
    }

    async fn delete_volume(
        &self,
        r: Request<csi::DeleteVolumeRequest>,
    ) -> Result<Response<csi::DeleteVolumeResponse>, Status> {
        let req = proto::VolumeName { name: required(&r.get_ref().volume_id, "volume_id")?.to_string() };
        self.controllers.call(async |mut c| c.delete_volume(req.clone()).await).await?;
        Ok(Response::new(csi::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        r: Request<csi::ControllerPublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerPublishVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        required(&req.node_id, "node_id")?;
        let capability =
            req.volume_capability.as_ref().ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        capability_error(capability).map_or(Ok(()), |e| Err(Status::invalid_argument(e)))?;
        let v = self.volume(volume).await?;
        let host = host_of(&req.node_id)?;
        if single_node(capability) && v.hosts.iter().any(|h| h != host) {
            return Err(Status::failed_precondition(format!(
                "volume {volume} is published to {} and its access mode allows one node",
                v.hosts.join(", ")
            )));
        }
        // A host on the volume's own node may get a local device: the controller
        // decides, and falls back to NVMe/TCP where it cannot.
        let local_node = match req.volume_context.get(LOCAL_PATH).map(String::as_str) {
            Some("nvme-tcp") => String::new(),
            _ => self.node_of_host(host).await?,
        };
        // A class with dhchap=true: the controller makes secrets for this host, which
        // reach the node through a Secret (never through the publish context, which
        // Kubernetes keeps in plain sight on the VolumeAttachment).
        let dhchap = req.volume_context.get(DHCHAP).is_some_and(|v| v == "true");
        let store = match (dhchap, &self.secrets) {
            (false, _) => None,
            (true, Some(store)) => Some(store),
            (true, None) => {
                return Err(Status::failed_precondition(format!(
                    "volume {volume} asks for {DHCHAP}, and this driver reaches no Kubernetes API to hand the host \
                     its secrets through: run it in a pod, or pass --kube-api"
                )));
            }
        };
        let attach = proto::AttachRequest {
            volume: volume.to_string(),
            host_nqn: host.to_string(),
            readonly: req.readonly,
            local_node,
            dhchap,
            ..Default::default()
        };
        let a = self.controllers.call(async |mut c| c.attach(attach.clone()).await).await?;
        let mut secret_ref = None;
        if let (Some(store), Some(s)) = (store, &a.dhchap) {
            let name = SecretStore::name(volume, host);
            let labels = BTreeMap::from([
                ("app.kubernetes.io/managed-by".to_string(), PLUGIN_NAME.to_string()),
                ("nvpool.io/purpose".to_string(), "dhchap".to_string()),
            ]);
            let mut data = BTreeMap::from([("secret".to_string(), s.secret.clone())]);
            if !s.ctrl_secret.is_empty() {
                data.insert("ctrl_secret".to_string(), s.ctrl_secret.clone());
            }
            store.api.put_secret(&store.namespace, &name, &labels, &data).await.map_err(Status::unavailable)?;
            secret_ref = Some(format!("{}/{name}", store.namespace));
        }
        if !a.local_fallback.is_empty() {
            tracing::info!("{volume}: {host} gets NVMe/TCP paths: {}", a.local_fallback);
        }
        let paths: Vec<String> =
            a.paths.iter().map(|p| format!("{},{},{},{}", p.transport, p.address, p.port, p.ana_state)).collect();
        let mut publish_context = HashMap::from([
            ("nqn".to_string(), a.subsystem_nqn),
            ("nsid".to_string(), a.nsid.to_string()),
            ("uuid".to_string(), a.uuid),
            ("paths".to_string(), paths.join(";")),
        ]);
        if let Some(local) = a.local {
            publish_context.insert(LOCAL_DEVICE.to_string(), local.device);
        }
        if let Some(r) = secret_ref {
            publish_context.insert(DHCHAP_SECRET.to_string(), r);
        }
        Ok(Response::new(csi::ControllerPublishVolumeResponse { publish_context }))
    }

    async fn controller_unpublish_volume(
        &self,
        r: Request<csi::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<csi::ControllerUnpublishVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        // An empty node ID means every node; a node that is not a host NQN was never published.
        let hosts: Vec<String> = if req.node_id.is_empty() {
            match self.volume(volume).await {
                Ok(v) => v.hosts,
                Err(e) if e.code() == tonic::Code::NotFound => vec![],
                Err(e) => return Err(e),
            }
        } else if req.node_id.starts_with("nqn.") {
            vec![req.node_id.clone()]
        } else {
            vec![]
        };
        for host in hosts {
            let detach = proto::DetachRequest { volume: volume.to_string(), host_nqn: host.clone() };
            self.controllers.call(async |mut c| c.detach(detach.clone()).await).await?;
            // The controller revoked the host's secrets; their Secret goes too.
            if let Some(store) = &self.secrets {
                let name = SecretStore::name(volume, &host);
                store.api.delete_secret(&store.namespace, &name).await.map_err(Status::unavailable)?;
            }
        }
        Ok(Response::new(csi::ControllerUnpublishVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        r: Request<csi::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<csi::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        self.volume(volume).await?;
        let unsupported: Vec<String> = req.volume_capabilities.iter().filter_map(capability_error).collect();
        Ok(Response::new(if unsupported.is_empty() {
            csi::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(csi::validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: req.mutable_parameters,
                }),
                message: String::new(),
            }
        } else {
            csi::ValidateVolumeCapabilitiesResponse { confirmed: None, message: unsupported.join("; ") }
        }))
    }

    async fn list_volumes(
        &self,
        r: Request<csi::ListVolumesRequest>,
    ) -> Result<Response<csi::ListVolumesResponse>, Status> {
        let req = r.into_inner();
        let list = proto::ListVolumesRequest::default();
        let mut volumes = self.controllers.call(async |mut c| c.list_volumes(list.clone()).await).await?.volumes;
        let (listed, next_token) = page(&mut volumes, |v| &v.name, req.max_entries, &req.starting_token)?;
        let entries = listed
            .iter()
            .map(|v| csi::list_volumes_response::Entry {
                volume: Some(csi_volume(v)),
                status: Some(csi::list_volumes_response::VolumeStatus {
                    published_node_ids: v.hosts.clone(),
                    volume_condition: None,
                }),
            })
            .collect();
        Ok(Response::new(csi::ListVolumesResponse { entries, next_token }))
    }

    async fn get_capacity(
        &self,
        r: Request<csi::GetCapacityRequest>,
    ) -> Result<Response<csi::GetCapacityResponse>, Status> {
        let req = r.into_inner();
        let node = req.accessible_topology.as_ref().and_then(|t| t.segments.get(TOPOLOGY_NODE_KEY)).cloned();
        let nodes = self.controllers.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await?.nodes;
        let pools = self.controllers.call(async |mut c| c.list_pools(proto::ListPoolsRequest {}).await).await?.pools;
        let healthy = |name: &str| nodes.iter().any(|n| n.name == name && n.healthy);
        let free = pools
            .iter()
            .filter(|p| healthy(&p.node) && node.as_ref().is_none_or(|n| *n == p.node))
            .map(|p| p.pool.as_ref().map_or(0, |r| r.capacity_bytes.saturating_sub(p.committed_bytes)));
        let (total, largest) = free.fold((0u64, 0u64), |(t, l), f| (t + f, l.max(f)));
        Ok(Response::new(csi::GetCapacityResponse {
            available_capacity: total as i64,
            // A volume lives in one pool, so the largest free space bounds it.
            maximum_volume_size: Some(largest as i64),
            minimum_volume_size: Some(BLOCK),
        }))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<csi::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<csi::ControllerGetCapabilitiesResponse>, Status> {
        use csi::controller_service_capability::{Rpc, Type, rpc::Type as R};
        let capabilities = [
            R::CreateDeleteVolume,
            R::PublishUnpublishVolume,
            R::ListVolumes,
            R::ListVolumesPublishedNodes,
            R::GetCapacity,
            R::ExpandVolume,
            R::PublishReadonly,
            R::CreateDeleteSnapshot,
            R::ListSnapshots,
            R::GetSnapshot,
            R::CloneVolume,
        ]
        .into_iter()
        .map(|t| csi::ControllerServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
        .collect();
        Ok(Response::new(csi::ControllerGetCapabilitiesResponse { capabilities }))
    }

    async fn controller_expand_volume(
        &self,
        r: Request<csi::ControllerExpandVolumeRequest>,
    ) -> Result<Response<csi::ControllerExpandVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        let range =
            req.capacity_range.as_ref().ok_or_else(|| Status::invalid_argument("capacity_range is required"))?;
        let size = size_from(Some(range))?;
        let resize = proto::ResizeVolumeRequest { name: volume.to_string(), size_bytes: size };
        let v = self
            .controllers
            .call(async |mut c| c.resize_volume(resize.clone()).await)
            .await
            .map_err(|e| not_found_or(e, volume))?;
        let block = req
            .volume_capability
            .as_ref()
            .is_some_and(|c| matches!(c.access_type, Some(csi::volume_capability::AccessType::Block(_))));
        Ok(Response::new(csi::ControllerExpandVolumeResponse {
            capacity_bytes: v.size_bytes as i64,
            // A filesystem must grow on the node too; a raw block device needs nothing.
            node_expansion_required: !block,
        }))
    }

    async fn create_snapshot(
        &self,
        r: Request<csi::CreateSnapshotRequest>,
    ) -> Result<Response<csi::CreateSnapshotResponse>, Status> {
        let req = r.into_inner();
        let name = required(&req.name, "name")?;
        let volume = required(&req.source_volume_id, "source_volume_id")?;
        if let Some(unknown) = req.parameters.keys().find(|k| !k.starts_with("csi.storage.k8s.io/")) {
            return Err(Status::invalid_argument(format!(
                "unknown parameter {unknown:?}: nvpool's snapshot classes take no parameters"
            )));
        }
        let take = proto::CreateSnapshotRequest { volume: volume.to_string(), name: name.to_string() };
        let s = self
            .controllers
            .call(async |mut c| c.create_snapshot(take.clone()).await)
            .await
            .map_err(|e| not_found_or(e, volume))?;
        Ok(Response::new(csi::CreateSnapshotResponse { snapshot: Some(csi_snapshot(&s)) }))
    }

    async fn delete_snapshot(
        &self,
        r: Request<csi::DeleteSnapshotRequest>,
    ) -> Result<Response<csi::DeleteSnapshotResponse>, Status> {
        let req = proto::SnapshotName { name: required(&r.get_ref().snapshot_id, "snapshot_id")?.to_string() };
        self.controllers.call(async |mut c| c.delete_snapshot(req.clone()).await).await?;
        Ok(Response::new(csi::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        r: Request<csi::ListSnapshotsRequest>,
    ) -> Result<Response<csi::ListSnapshotsResponse>, Status> {
        let req = r.into_inner();
        let list = proto::ListSnapshotsRequest { volume: req.source_volume_id.clone() };
        let mut snapshots = self.controllers.call(async |mut c| c.list_snapshots(list.clone()).await).await?.snapshots;
        // Those of a volume gone since are another volume's, should one of that name
        // exist now: a source volume ID names the volume as it is.
        snapshots.retain(|s| {
            (req.snapshot_id.is_empty() || s.name == req.snapshot_id)
                && (req.source_volume_id.is_empty() || s.volume_exists)
        });
        let (listed, next_token) = page(&mut snapshots, |s| &s.name, req.max_entries, &req.starting_token)?;
        let entries =
            listed.iter().map(|s| csi::list_snapshots_response::Entry { snapshot: Some(csi_snapshot(s)) }).collect();
        Ok(Response::new(csi::ListSnapshotsResponse { entries, next_token }))
    }

    async fn get_snapshot(
        &self,
        r: Request<csi::GetSnapshotRequest>,
    ) -> Result<Response<csi::GetSnapshotResponse>, Status> {
        let id = r.into_inner().snapshot_id;
        if id.is_empty() {
            return Err(Status::invalid_argument("GetSnapshot needs a snapshot_id (the nvpool snapshot's name)"));
        }
        let get = proto::SnapshotName { name: id };
        let s = self.controllers.call(async |mut c| c.get_snapshot(get.clone()).await).await?;
        Ok(Response::new(csi::GetSnapshotResponse { snapshot: Some(csi_snapshot(&s)) }))
    }

    async fn controller_get_volume(
        &self,
        _: Request<csi::ControllerGetVolumeRequest>,
    ) -> Result<Response<csi::ControllerGetVolumeResponse>, Status> {
        Err(Status::unimplemented("ControllerGetVolume is not offered (no GET_VOLUME capability)"))
    }

    async fn controller_modify_volume(
        &self,
        _: Request<csi::ControllerModifyVolumeRequest>,
    ) -> Result<Response<csi::ControllerModifyVolumeResponse>, Status> {
        Err(Status::unimplemented("ControllerModifyVolume is not offered (no MODIFY_VOLUME capability)"))
    }
}

//! `nvpool controller`: serves the Controller API. With redb it leads at once. With
//! etcd it campaigns for the leader key; until it wins it answers every call with
//! "standby" and the leader's address, and the clients move on to the next controller.

use crate::cluster::{Cluster, ClusterConfig};
use crate::metadata::{FROM_CONTROLLER, TRY_ANOTHER};
use crate::model::{LEADER_KEY, LeaderRecord, ROOT, to_json};
use crate::proto::{self, controller_server::ControllerServer};
use crate::store::{self, Condition, EtcdStore, Snapshot, Store};
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tonic::{Request, Response, Status};

/// How long a new leader waits for its copy of the store to hold the last leader's
/// writes before it reads the store instead.
const MIRROR_PATIENCE: Duration = Duration::from_secs(2);

pub struct ControllerArgs {
    pub listen: SocketAddr,
    /// The address other controllers and clients are told to use for this one.
    pub advertise: String,
    /// `redb:PATH` or `etcd:URL[,URL...]`.
    pub store: String,
    pub cluster: ClusterConfig,
    /// How long a dead leader keeps the leader key (etcd only).
    pub lease_ttl: Duration,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// Where to serve the dashboard, if anywhere.
    pub http_listen: Option<SocketAddr>,
}

struct Service {
    id: String,
    leader: RwLock<Option<Arc<Cluster>>>,
    store: Arc<dyn Store>,
    /// Under mutual TLS, a node's calls must carry that node's certificate.
    tls: bool,
}

impl Service {
    /// Under TLS, refuses a node call whose certificate is not that node's.
    fn check_node<T>(&self, r: &Request<T>, node: &str) -> Result<(), Status> {
        if !self.tls {
            return Ok(());
        }
        crate::tls::require_identity(r, &format!("{}{node}", crate::tls::NODE_PREFIX))
    }
}

fn tag(mut s: Status, id: &str) -> Status {
    if let Ok(v) = id.parse() {
        s.metadata_mut().insert(FROM_CONTROLLER, v);
    }
    s
}

impl Service {
    async fn cluster(&self) -> Result<Arc<Cluster>, Status> {
        if let Some(c) = self.leader.read().unwrap().clone() {
            return Ok(c);
        }
        let leader = match self.store.get(LEADER_KEY).await {
            Ok(Some(b)) => serde_json::from_slice::<LeaderRecord>(&b).map(|l| l.address).unwrap_or_default(),
            _ => String::new(),
        };
        let mut s = Status::unavailable(if leader.is_empty() {
            format!(
                "this controller is a standby and no leader is elected yet (is the store {} reachable?); retry shortly",
                self.store.describe()
            )
        } else {
            format!("this controller is a standby; the leader is at {leader}")
        });
        s.metadata_mut().insert(TRY_ANOTHER, "1".parse().unwrap());
        Err(tag(s, &self.id))
    }

    /// Runs one call against the leading cluster, tagging its errors.
    async fn with<T>(&self, f: impl AsyncFnOnce(Arc<Cluster>) -> Result<T, Status>) -> Result<Response<T>, Status> {
        let c = self.cluster().await?;
        f(c).await.map(Response::new).map_err(|e| tag(e, &self.id))
    }
}

#[tonic::async_trait]
impl proto::controller_server::Controller for Service {
    async fn create_volume(
        &self,
        r: Request<proto::CreateVolumeRequest>,
    ) -> Result<Response<proto::CreateVolumeResponse>, Status> {
        self.with(async |c| c.create_volume(r.get_ref()).await).await
    }

    async fn delete_volume(
        &self,
        r: Request<proto::VolumeName>,
    ) -> Result<Response<proto::DeleteVolumeResponse>, Status> {
        self.with(async |c| {
            c.delete_volume(&r.get_ref().name).await.map(|deleted| proto::DeleteVolumeResponse { deleted })
        })
        .await
    }

    async fn resize_volume(&self, r: Request<proto::ResizeVolumeRequest>) -> Result<Response<proto::Volume>, Status> {
        self.with(async |c| c.resize_volume(&r.get_ref().name, r.get_ref().size_bytes).await).await
    }

    async fn get_volume(&self, r: Request<proto::VolumeName>) -> Result<Response<proto::Volume>, Status> {
        self.with(async |c| c.get_volume(&r.get_ref().name)).await
    }

    async fn migrate_volume(&self, r: Request<proto::MigrateVolumeRequest>) -> Result<Response<proto::Volume>, Status> {
        self.with(async |c| c.migrate_volume(r.get_ref()).await).await
    }

    async fn cancel_migration(&self, r: Request<proto::VolumeName>) -> Result<Response<proto::Volume>, Status> {
        self.with(async |c| c.cancel_migration(&r.get_ref().name).await).await
    }

    async fn set_volume_qos(&self, r: Request<proto::SetVolumeQosRequest>) -> Result<Response<proto::Volume>, Status> {
        let r = r.into_inner();
        self.with(async |c| c.set_volume_qos(&r.name, r.qos.unwrap_or_default().into()).await).await
    }

    async fn set_volume_replicas(
        &self,
        r: Request<proto::SetVolumeReplicasRequest>,
    ) -> Result<Response<proto::Volume>, Status> {
        let r = r.into_inner();
        self.with(async |c| c.set_volume_replicas(&r.name, r.replicas).await).await
    }

    async fn create_snapshot(
        &self,
        r: Request<proto::CreateSnapshotRequest>,
    ) -> Result<Response<proto::Snapshot>, Status> {
        self.with(async |c| c.create_snapshot(&r.get_ref().volume, &r.get_ref().name).await).await
    }

    async fn delete_snapshot(
        &self,
        r: Request<proto::SnapshotName>,
    ) -> Result<Response<proto::DeleteSnapshotResponse>, Status> {
        self.with(async |c| {
            let (deleted, kept_by) = c.delete_snapshot(&r.get_ref().name).await?;
            Ok(proto::DeleteSnapshotResponse { deleted, kept_by })
        })
        .await
    }

    async fn inflate_volume(
        &self,
        r: Request<proto::VolumeName>,
    ) -> Result<Response<proto::InflateVolumeResponse>, Status> {
        self.with(async |c| c.inflate_volume(&r.get_ref().name).await).await
    }

    async fn get_snapshot(&self, r: Request<proto::SnapshotName>) -> Result<Response<proto::Snapshot>, Status> {
        self.with(async |c| c.get_snapshot(&r.get_ref().name)).await
    }

    async fn list_snapshots(
        &self,
        r: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<proto::ListSnapshotsResponse>, Status> {
        self.with(async |c| Ok(proto::ListSnapshotsResponse { snapshots: c.list_snapshots(&r.get_ref().volume) })).await
    }

    async fn list_volumes(
        &self,
        r: Request<proto::ListVolumesRequest>,
    ) -> Result<Response<proto::ListVolumesResponse>, Status> {
        self.with(async |c| Ok(proto::ListVolumesResponse { volumes: c.list_volumes(&r.get_ref().node) })).await
    }

    async fn attach(&self, r: Request<proto::AttachRequest>) -> Result<Response<proto::AttachResponse>, Status> {
        self.with(async |c| c.attach(r.get_ref()).await).await
    }

    async fn detach(&self, r: Request<proto::DetachRequest>) -> Result<Response<proto::DetachResponse>, Status> {
        self.with(async |c| {
            c.detach(&r.get_ref().volume, &r.get_ref().host_nqn).await.map(|()| proto::DetachResponse {})
        })
        .await
    }

    async fn list_nodes(
        &self,
        _: Request<proto::ListNodesRequest>,
    ) -> Result<Response<proto::ListNodesResponse>, Status> {
        self.with(async |c| Ok(proto::ListNodesResponse { nodes: c.list_nodes() })).await
    }

    async fn list_pools(
        &self,
        _: Request<proto::ListPoolsRequest>,
    ) -> Result<Response<proto::ListPoolsResponse>, Status> {
        self.with(async |c| Ok(proto::ListPoolsResponse { pools: c.list_pools() })).await
    }

    async fn cluster_info(
        &self,
        _: Request<proto::ClusterInfoRequest>,
    ) -> Result<Response<proto::ClusterInfoResponse>, Status> {
        let leader = self.leader.read().unwrap().clone();
        let leader_address = match self.store.get(LEADER_KEY).await {
            Ok(Some(b)) => serde_json::from_slice::<LeaderRecord>(&b).map(|l| l.address).unwrap_or_default(),
            _ => String::new(),
        };
        Ok(Response::new(proto::ClusterInfoResponse {
            cluster_id: leader.as_ref().map(|c| c.cluster_id()).unwrap_or_default(),
            controller_id: self.id.clone(),
            leader: leader.is_some(),
            leader_address,
            store: self.store.describe(),
        }))
    }

    async fn register_node(
        &self,
        r: Request<proto::RegisterNodeRequest>,
    ) -> Result<Response<proto::RegisterNodeResponse>, Status> {
        let name = r.get_ref().node.as_ref().map(|n| n.name.clone()).unwrap_or_default();
        self.check_node(&r, &name)?;
        self.with(async |c| {
            let node = r.into_inner().node.ok_or_else(|| Status::invalid_argument("RegisterNode needs a node"))?;
            let ((cntlid_min, cntlid_max), interval) = c.register_node(node).await?;
            Ok(proto::RegisterNodeResponse {
                heartbeat_interval_ms: interval.as_millis() as u64,
                cntlid_min: u32::from(cntlid_min),
                cntlid_max: u32::from(cntlid_max),
                takes_changes: true,
            })
        })
        .await
    }

    async fn upgrade_node(
        &self,
        r: Request<proto::UpgradeNodeRequest>,
    ) -> Result<Response<proto::UpgradeReply>, Status> {
        self.with(async |c| c.upgrade_node(&r.get_ref().node, &r.get_ref().binary).await).await
    }

    async fn heartbeat(
        &self,
        r: Request<proto::HeartbeatRequest>,
    ) -> Result<Response<proto::HeartbeatResponse>, Status> {
        self.check_node(&r, &r.get_ref().node)?;
        self.with(async |c| Ok(c.heartbeat(r.into_inner()))).await
    }
}

/// Runs a controller until the process ends or its server fails.
pub async fn run(args: ControllerArgs) -> Result<(), String> {
    let id = uuid::Uuid::new_v4().to_string();
    let (store, etcd): (Arc<dyn Store>, Option<Arc<EtcdStore>>) = match args.store.strip_prefix("etcd:") {
        Some(urls) => {
            let endpoints: Vec<String> = urls.split(',').map(str::to_string).collect();
            let e = Arc::new(EtcdStore::connect(&endpoints).await.map_err(|e| e.to_string())?);
            (e.clone(), Some(e))
        }
        None => (store::open(&args.store).await.map_err(|e| e.to_string())?, None),
    };
    let tls = args.cluster.tls.clone();
    let service =
        Arc::new(Service { id: id.clone(), leader: RwLock::new(None), store: store.clone(), tls: tls.is_some() });
    let listener = tokio::net::TcpListener::bind(args.listen).await.map_err(|e| {
        format!("cannot listen on {}: {e} (is another controller there? pick another --listen)", args.listen)
    })?;
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = &tls {
        builder = builder.tls_config(t.server()).map_err(|e| format!("TLS: {e}"))?;
    }
    let server =
        builder.add_service(ControllerServer::from_arc(service.clone())).serve_with_incoming(accepted(listener));
    let serving = tokio::spawn(server);
    tracing::info!(controller = %id, "serving on {} with store {}", args.listen, store.describe());
    let metrics = args.cluster.metrics.clone();
    if let Some(addr) = args.metrics_listen {
        let (service, metrics) = (service.clone(), metrics.clone());
        let render = move || {
            let mut registry = prometheus_client::registry::Registry::default();
            metrics.register(&mut registry);
            // A standby reports its own figures only: the pool's are the leader's.
            if let Some(cluster) = service.leader.read().unwrap().clone() {
                crate::metrics::register_cluster(&mut registry, &cluster.figures());
            }
            crate::metrics::encode(&registry)
        };
        crate::metrics::serve(addr, std::sync::Arc::new(render)).await?;
        tracing::info!(controller = %id, "metrics at http://{addr}/metrics");
    }
    if let Some(addr) = args.http_listen {
        let service = service.clone();
        let leader = std::sync::Arc::new(move || service.leader.read().unwrap().clone());
        // Under mutual TLS, HTTPS with a client certificate from the cluster's CA.
        crate::dashboard::serve(addr, leader, tls.as_ref()).await?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        tracing::info!(controller = %id, "dashboard at {scheme}://{addr}/");
    }

    let Some(etcd) = etcd else {
        let cluster = Cluster::load(store, vec![], args.cluster).await.map_err(|e| e.message().to_string())?;
        tracing::info!(controller = %id, "leading cluster {}", cluster.cluster_id());
        *service.leader.write().unwrap() = Some(cluster.clone());
        metrics.leader.set(1);
        metrics.leadership_terms.inc();
        tokio::spawn(cluster.reconcile_forever());
        return serving.await.map_err(|e| e.to_string())?.map_err(|e| format!("controller server failed: {e}"));
    };
    // Under etcd: campaign, lead until the lease is lost, then stand by and campaign again.
    let me = to_json(&LeaderRecord { id: id.clone(), address: args.advertise.clone() });
    loop {
        tracing::info!(controller = %id, "standing by for leadership");
        // The standby keeps a copy of the store, so that taking over reads nothing.
        let mirror = etcd.mirror(ROOT);
        let leadership = loop {
            match etcd.campaign(LEADER_KEY, &me, args.lease_ttl).await {
                Ok(l) => break l,
                Err(e) => {
                    tracing::warn!(controller = %id, "cannot campaign: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        let records = match mirror.take_at(leadership.revision, MIRROR_PATIENCE).await {
            Some(records) => records,
            None => {
                tracing::warn!(controller = %id, "the standby's copy of the store is behind; reading the store");
                match Snapshot::read(store.as_ref(), ROOT).await {
                    Ok(records) => records,
                    Err(e) => {
                        tracing::error!(controller = %id, "cannot load the cluster: {e}");
                        continue; // dropping the leadership lets the lease lapse
                    }
                }
            }
        };
        let fence = vec![Condition::Equals(LEADER_KEY.into(), me.clone())];
        let cluster = match Cluster::load_from(records, store.clone(), fence, args.cluster.clone()).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(controller = %id, "cannot load the cluster: {}", e.message());
                continue; // dropping the leadership lets the lease lapse
            }
        };
        tracing::info!(controller = %id, "leading cluster {}", cluster.cluster_id());
        *service.leader.write().unwrap() = Some(cluster.clone());
        metrics.leader.set(1);
        metrics.leadership_terms.inc();
        let background = tokio::spawn(cluster.reconcile_forever());
        let mut lost = leadership.lost.clone();
        let _ = lost.wait_for(|l| *l).await;
        background.abort();
        *service.leader.write().unwrap() = None;
        metrics.leader.set(0);
        tracing::warn!(controller = %id, "lost the leader lease; standing by");
    }
}

/// The connections a gRPC server accepts, with Nagle's algorithm off. tonic sets
/// TCP_NODELAY only on sockets it accepts itself: on these, a reply's trailers waited
/// for the acknowledgement of its data, which the caller delays by 40 ms, in one call
/// of two (a creation took 50 ms instead of 10).
pub(crate) fn accepted(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}

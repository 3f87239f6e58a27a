//! The CSI Node service: connects to a volume with the kernel's NVMe/TCP host
//! (`nvme connect`), finds its block device by the namespace UUID, makes a filesystem
//! when the device has none, and mounts or bind-mounts it where the CO asks. What a
//! staged volume uses (its subsystem NQN and device) is kept in a small file per
//! volume, so that unstaging works after a plugin restart. The node also follows the
//! paths the controller gives its staged volumes: a path added later (a migration's
//! target, which waits for its hosts to connect; a lost node's replacement) is
//! connected within seconds, and one taken away is disconnected.

use crate::csi::{self, node_server::Node, volume_capability::AccessType};
use crate::kube::KubeApi;
use crate::{DHCHAP_SECRET, LOCAL_DEVICE, TOPOLOGY_NODE_KEY, capability_error, fsinfo, required};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::process::Command;
use tonic::{Request, Response, Status};

pub struct NodeService {
    pub node_name: String,
    /// This host's NQN; it is the CSI node ID.
    pub host_nqn: String,
    /// Where staged volumes are recorded.
    pub state_dir: PathBuf,
    /// Held while paths are connected or disconnected, so that following a volume's
    /// paths never reconnects one that unstaging is taking down.
    pub path_changes: tokio::sync::Mutex<()>,
    /// The Kubernetes API, to read hosts' DH-HMAC-CHAP secrets from their Secrets.
    pub kube: Option<KubeApi>,
}

/// What a staged volume uses.
struct Staged {
    nqn: String,
    device: String,
    /// The Secret (`NAMESPACE/NAME`) with the DH-HMAC-CHAP secrets its paths connect with.
    dhchap_secret: Option<String>,
}

/// Runs a command; its stderr becomes the error.
async fn run(program: &str, args: &[&str]) -> Result<String, Status> {
    let out = Command::new(program)
        .args(args)
        .output()
        .await
        .map_err(|e| Status::internal(format!("cannot run {program}: {e} (is it installed on the node?)")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Status::internal(format!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Mount points, from /proc/self/mountinfo (spaces and the like are octal escapes).
fn mount_points() -> Vec<(String, String)> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let unescape = |s: &str| {
        let mut out = String::new();
        let mut chars = s.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\\' {
                let code: String = chars.by_ref().take(3).collect();
                out.push(u8::from_str_radix(&code, 8).map_or('?', char::from));
            } else {
                out.push(c);
            }
        }
        out
    };
    info.lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let source = l.split(" - ").nth(1)?.split(' ').nth(1)?;
            Some((unescape(fields.get(4)?), unescape(source)))
        })
        .collect()
}

fn is_mounted(path: &str) -> bool {
    let path = path.trim_end_matches('/');
    mount_points().iter().any(|(m, _)| m == path)
}

/// The live controller the kernel has for a subsystem, e.g. `nvme3`.
fn controller_of(nqn: &str) -> Option<String> {
    std::fs::read_dir("/sys/class/nvme").ok()?.flatten().find_map(|c| {
        let read =
            |f: &str| std::fs::read_to_string(c.path().join(f)).map(|s| s.trim().to_string()).unwrap_or_default();
        (read("subsysnqn") == nqn && read("state") == "live").then(|| c.file_name().to_string_lossy().into_owned())
    })
}

/// The kernel's controllers (live or reconnecting) for a subsystem: each one's
/// device name (nvmeN), address and port.
fn controllers_of(nqn: &str) -> Vec<(String, String, u32)> {
    let Ok(dir) = std::fs::read_dir("/sys/class/nvme") else { return Vec::new() };
    dir.flatten()
        .filter_map(|c| {
            let read =
                |f: &str| std::fs::read_to_string(c.path().join(f)).map(|s| s.trim().to_string()).unwrap_or_default();
            if read("subsysnqn") != nqn || read("state") == "deleting" {
                return None;
            }
            let at = read("address");
            let field = |name: &str| at.split(',').find_map(|part| part.strip_prefix(name)).map(str::to_string);
            let port = field("trsvcid=")?.parse().ok()?;
            Some((c.file_name().to_string_lossy().into_owned(), field("traddr=")?, port))
        })
        .collect()
}

/// Whether the kernel has a controller (live or reconnecting) for a subsystem at an
/// address and port.
fn path_connected(nqn: &str, address: &str, port: u32) -> bool {
    controllers_of(nqn).iter().any(|(_, a, p)| a == address && *p == port)
}

/// How often the node looks for new paths of its staged volumes.
const FOLLOW_EVERY: Duration = Duration::from_secs(2);

/// The block device whose namespace has this UUID.
fn device_with_uuid(uuid: &str) -> Option<String> {
    std::fs::read_dir("/sys/block").ok()?.flatten().find_map(|b| {
        let name = b.file_name().to_string_lossy().into_owned();
        let id = std::fs::read_to_string(b.path().join("uuid")).unwrap_or_default();
        // nvmeXcYnZ are the hidden per-path devices of native multipath; nvmeXnZ is the volume.
        let head = name.strip_prefix("nvme").is_some_and(|rest| !rest.contains('c'));
        (head && id.trim().eq_ignore_ascii_case(uuid)).then(|| format!("/dev/{name}"))
    })
}

/// The paths under a native-multipath device `nvmeXnZ`: its hidden per-path devices
/// `nvmeXcYnZ`; 1 when the kernel runs without native multipath.
fn paths_under(device: &str) -> usize {
    let name = device.trim_start_matches("/dev/");
    let Some((subsystem, namespace)) = name.strip_prefix("nvme").and_then(|rest| rest.split_once('n')) else {
        return 1;
    };
    let prefix = format!("nvme{subsystem}c");
    let suffix = format!("n{namespace}");
    let paths = std::fs::read_dir("/sys/block").map_or(0, |d| {
        d.flatten()
            .filter(|b| {
                let b = b.file_name().to_string_lossy().into_owned();
                b.strip_prefix(&prefix)
                    .and_then(|rest| rest.strip_suffix(&suffix))
                    .is_some_and(|c| !c.is_empty() && c.bytes().all(|x| x.is_ascii_digit()))
            })
            .count()
    });
    paths.max(1)
}

/// The filesystem on a device, read from its superblock: what this driver makes
/// (ext4) or accepts (xfs), or `Some("unknown")` for any other non-zero start.
fn filesystem_on(device: &str) -> Result<Option<&'static str>, Status> {
    use std::io::Read;
    let mut head = vec![0u8; 2048];
    std::fs::File::open(device)
        .and_then(|mut f| f.read_exact(&mut head))
        .map_err(|e| Status::internal(format!("cannot read {device}: {e}")))?;
    // ext2/3/4: magic 0xEF53 at byte 56 of the superblock, which starts at 1024.
    if head[1080..1082] == [0x53, 0xEF] {
        return Ok(Some("ext4"));
    }
    if &head[..4] == b"XFSB" {
        return Ok(Some("xfs"));
    }
    Ok(head.iter().any(|&b| b != 0).then_some("unknown"))
}

/// The device's size in bytes, from sysfs.
fn device_size(device: &str) -> Option<u64> {
    let name = Path::new(device).file_name()?.to_string_lossy().into_owned();
    let sectors: u64 = std::fs::read_to_string(format!("/sys/class/block/{name}/size")).ok()?.trim().parse().ok()?;
    Some(sectors * 512)
}

/// Stages the local device the controller made for this host on the volume's own
/// node (its engine serves it there): no NVMe/TCP connection, the device is used as it is.
async fn local_device(nqn: String, device: &str) -> Result<Staged, Status> {
    let name = device.strip_prefix("/dev/").unwrap_or(device);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !Path::new(&format!("/sys/class/block/{name}")).exists() {
        if Instant::now() > deadline {
            return Err(Status::unavailable(format!(
                "the local device {device} of {nqn} did not appear: is this node's engine serving it? \
                 (`nvpool engine local list`)"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tracing::info!("{nqn}: staged the local device {device}");
    Ok(Staged { nqn, device: device.to_string(), dhchap_secret: None })
}

impl NodeService {
    /// Runs for ever: connects every path the controller lists for this host to a
    /// staged volume that the kernel has no controller for, and disconnects the
    /// kernel's controllers of that volume at addresses the controller no longer
    /// lists (a lost node's, which the kernel would retry until `ctrl_loss_tmo`; a
    /// migrated volume's old owner's).
    pub async fn follow_paths(self: Arc<Self>, controllers: Arc<Controllers>) {
        let mut unreachable_told = false;
        loop {
            tokio::time::sleep(FOLLOW_EVERY).await;
            let staged: Vec<(String, Staged)> = std::fs::read_dir(&self.state_dir)
                .map(|d| {
                    d.flatten()
                        .filter_map(|f| f.file_name().to_string_lossy().strip_suffix(".staged").map(String::from))
                        .filter_map(|v| self.staged(&v).map(|s| (v, s)))
                        .collect()
                })
                .unwrap_or_default();
            for (volume, _) in staged {
                let req = proto::VolumeName { name: volume.clone() };
                let v = match controllers.call(async |mut c| c.get_volume(req.clone()).await).await {
                    Ok(v) => v,
                    Err(e) => {
                        if !std::mem::replace(&mut unreachable_told, true) {
                            tracing::warn!("cannot ask the controller for the paths of {volume}: {}", e.message());
                        }
                        continue;
                    }
                };
                unreachable_told = false;
                let _changing = self.path_changes.lock().await;
                // Unstaged meanwhile: its paths are not to come back.
                let Some(staged) = self.staged(&volume) else { continue };
                let paths = v.attachments.into_iter().find(|a| a.host_nqn == self.host_nqn).map(|a| a.paths);
                let auth = match self.dhchap_args(staged.dhchap_secret.as_deref()).await {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!("{volume}: cannot connect new paths: {}", e.message());
                        continue;
                    }
                };
                let paths = paths.unwrap_or_default();
                for (device, address, port) in controllers_of(&staged.nqn) {
                    // Never the last one: a volume whose paths are all gone keeps what it has.
                    if paths.is_empty() || paths.iter().any(|p| p.address == address && p.port == port) {
                        continue;
                    }
                    match run("nvme", &["disconnect", "-d", &device]).await {
                        Ok(_) => tracing::info!("{volume}: disconnected {device} ({address}:{port}): no longer a path"),
                        Err(e) => tracing::warn!("{volume}: cannot disconnect {device}: {}", e.message()),
                    }
                }
                for p in paths {
                    if path_connected(&staged.nqn, &p.address, p.port) {
                        continue;
                    }
                    let port = p.port.to_string();
                    let mut args = vec![
                        "connect",
                        "-t",
                        &p.transport,
                        "-a",
                        &p.address,
                        "-s",
                        &port,
                        "-n",
                        &staged.nqn,
                        "--hostnqn",
                        &self.host_nqn,
                    ];
                    args.extend(auth.iter().map(String::as_str));
                    match run("nvme", &args).await {
                        Ok(_) => tracing::info!("{volume}: connected the path through {} ({})", p.node, p.ana_state),
                        Err(e) => tracing::warn!("{volume}: path through {}: {}", p.node, e.message()),
                    }
                }
            }
        }
    }

    /// The `nvme connect` options that authenticate with the secrets in Secret
    /// `reference` (`NAMESPACE/NAME`); none without one.
    async fn dhchap_args(&self, reference: Option<&str>) -> Result<Vec<String>, Status> {
        let Some(reference) = reference else { return Ok(vec![]) };
        let (namespace, name) = reference.split_once('/').ok_or_else(|| {
            Status::invalid_argument(format!("publish_context {DHCHAP_SECRET}={reference:?} is not NAMESPACE/NAME"))
        })?;
        let kube = self.kube.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!(
                "the volume's host authenticates with secrets in Secret {reference}, and this node plugin reaches no \
                 Kubernetes API: run it in a pod, or pass --kube-api"
            ))
        })?;
        let data = kube.get_secret(namespace, name).await.map_err(Status::unavailable)?;
        let secret = data
            .get("secret")
            .ok_or_else(|| Status::failed_precondition(format!("Secret {reference} has no `secret` field")))?;
        let mut args = vec![format!("--dhchap-secret={secret}")];
        if let Some(ctrl) = data.get("ctrl_secret") {
            args.push(format!("--dhchap-ctrl-secret={ctrl}"));
        }
        Ok(args)
    }

    fn state_file(&self, volume: &str) -> PathBuf {
        self.state_dir.join(format!("{volume}.staged"))
    }

    fn staged(&self, volume: &str) -> Option<Staged> {
        let text = std::fs::read_to_string(self.state_file(volume)).ok()?;
        let mut lines = text.lines();
        Some(Staged {
            nqn: lines.next()?.to_string(),
            device: lines.next()?.to_string(),
            dhchap_secret: lines.next().filter(|l| !l.is_empty()).map(String::from),
        })
    }

    /// Connects every path of the volume and waits for its device.
    async fn connect(&self, context: &HashMap<String, String>) -> Result<Staged, Status> {
        let field = |k: &str| {
            context.get(k).filter(|v| !v.is_empty()).cloned().ok_or_else(|| {
                Status::invalid_argument(format!(
                    "publish_context lacks {k:?}: was the volume published by this driver?"
                ))
            })
        };
        if let Some(device) = context.get(LOCAL_DEVICE).filter(|d| !d.is_empty()) {
            return local_device(field("nqn")?, device).await;
        }
        let (nqn, uuid, paths) = (field("nqn")?, field("uuid")?, field("paths")?);
        let dhchap_secret = context.get(DHCHAP_SECRET).filter(|s| !s.is_empty()).cloned();
        let auth = self.dhchap_args(dhchap_secret.as_deref()).await?;
        let mut errors = Vec::new();
        if controller_of(&nqn).is_none() {
            for path in paths.split(';') {
                let parts: Vec<&str> = path.split(',').collect();
                let [transport, address, port, ..] = parts[..] else {
                    return Err(Status::invalid_argument(format!("publish_context path {path:?} is not understood")));
                };
                let mut args = vec![
                    "connect",
                    "-t",
                    transport,
                    "-a",
                    address,
                    "-s",
                    port,
                    "-n",
                    &nqn,
                    "--hostnqn",
                    &self.host_nqn,
                ];
                args.extend(auth.iter().map(String::as_str));
                if let Err(e) = run("nvme", &args).await {
                    errors.push(e.message().to_string());
                }
            }
            if controller_of(&nqn).is_none() && errors.len() == paths.split(';').count() {
                return Err(Status::unavailable(format!("no path to {nqn} connected: {}", errors.join("; "))));
            }
        }
        let connected = paths.split(';').count() - errors.len();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(device) = device_with_uuid(&uuid) {
                // The kernel adds each path's namespace as it scans it: give the
                // paths just connected a moment to join the device.
                let settle = Instant::now() + Duration::from_secs(5);
                while paths_under(&device) < connected && Instant::now() < settle {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tracing::info!("{nqn}: staged {device} with {} of {connected} connected paths", paths_under(&device));
                return Ok(Staged { nqn, device, dhchap_secret });
            }
            if Instant::now() > deadline {
                return Err(Status::unavailable(format!(
                    "no block device with namespace UUID {uuid} appeared after connecting to {nqn} ({}); check that \
                     the node reaches the engine and that the nvme-tcp module is loaded",
                    if errors.is_empty() { "connected".to_string() } else { errors.join("; ") }
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tonic::async_trait]
impl Node for NodeService {
    async fn node_stage_volume(
        &self,
        r: Request<csi::NodeStageVolumeRequest>,
    ) -> Result<Response<csi::NodeStageVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        let staging = required(&req.staging_target_path, "staging_target_path")?;
        let capability =
            req.volume_capability.as_ref().ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        capability_error(capability).map_or(Ok(()), |e| Err(Status::invalid_argument(e)))?;
        let changing = self.path_changes.lock().await;
        let staged = self.connect(&req.publish_context).await?;
        std::fs::create_dir_all(&self.state_dir)
            .and_then(|()| {
                let secret = staged.dhchap_secret.as_deref().unwrap_or_default();
                std::fs::write(self.state_file(volume), format!("{}\n{}\n{secret}\n", staged.nqn, staged.device))
            })
            .map_err(|e| {
                Status::internal(format!("cannot record the staged volume in {}: {e}", self.state_dir.display()))
            })?;
        drop(changing);
        if let Some(AccessType::Mount(m)) = &capability.access_type {
            if is_mounted(staging) {
                return Ok(Response::new(csi::NodeStageVolumeResponse {}));
            }
            let fs = if m.fs_type.is_empty() { "ext4" } else { m.fs_type.as_str() };
            match filesystem_on(&staged.device)? {
                None => {
                    run(&format!("mkfs.{fs}"), &[&staged.device]).await?;
                }
                Some(found) if found != fs => {
                    return Err(Status::failed_precondition(format!(
                        "volume {volume} holds a {found} filesystem, not {fs}; it is left as it is"
                    )));
                }
                _ => {}
            }
            std::fs::create_dir_all(staging).map_err(|e| Status::internal(format!("cannot create {staging}: {e}")))?;
            let mut args = vec!["-t", fs];
            let flags = m.mount_flags.join(",");
            if !flags.is_empty() {
                args.extend(["-o", flags.as_str()]);
            }
            args.extend([staged.device.as_str(), staging]);
            run("mount", &args).await?;
        }
        Ok(Response::new(csi::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        r: Request<csi::NodeUnstageVolumeRequest>,
    ) -> Result<Response<csi::NodeUnstageVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        let staging = required(&req.staging_target_path, "staging_target_path")?;
        if is_mounted(staging) {
            run("umount", &[staging]).await?;
        }
        let _changing = self.path_changes.lock().await;
        if let Some(staged) = self.staged(volume) {
            // Each volume is its own subsystem; disconnect it unless something still uses
            // one of its devices (a bind mount left behind, say).
            let controller = controller_of(&staged.nqn);
            let in_use = mount_points().iter().any(|(_, source)| {
                *source == staged.device
                    || controller.as_ref().is_some_and(|c| source.starts_with(&format!("/dev/{c}n")))
            });
            if in_use {
                return Err(Status::failed_precondition(format!(
                    "a device of volume {volume} is still mounted; unpublish it first"
                )));
            }
            if controller.is_some() {
                run("nvme", &["disconnect", "-n", &staged.nqn]).await?;
            }
            let _ = std::fs::remove_file(self.state_file(volume));
        }
        Ok(Response::new(csi::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        r: Request<csi::NodePublishVolumeRequest>,
    ) -> Result<Response<csi::NodePublishVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        let target = required(&req.target_path, "target_path")?;
        let capability =
            req.volume_capability.as_ref().ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        let staging = required(&req.staging_target_path, "staging_target_path")?;
        capability_error(capability).map_or(Ok(()), |e| Err(Status::invalid_argument(e)))?;
        if is_mounted(target) {
            return Ok(Response::new(csi::NodePublishVolumeResponse {}));
        }
        let source = match &capability.access_type {
            Some(AccessType::Block(_)) => {
                let staged = self.staged(volume).ok_or_else(|| {
                    Status::failed_precondition(format!("volume {volume} is not staged on this node: stage it first"))
                })?;
                if let Some(parent) = Path::new(target).parent() {
                    std::fs::create_dir_all(parent)
                        .map_err(|e| Status::internal(format!("cannot create {target}'s directory: {e}")))?;
                }
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(target)
                    .map_err(|e| Status::internal(format!("cannot create {target}: {e}")))?;
                staged.device
            }
            _ => {
                if !is_mounted(staging) {
                    return Err(Status::failed_precondition(format!(
                        "volume {volume} is not staged at {staging}: stage it first"
                    )));
                }
                std::fs::create_dir_all(target)
                    .map_err(|e| Status::internal(format!("cannot create {target}: {e}")))?;
                staging.to_string()
            }
        };
        run("mount", &["-o", "bind", &source, target]).await?;
        if req.readonly {
            run("mount", &["-o", "remount,bind,ro", target]).await?;
        }
        Ok(Response::new(csi::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        r: Request<csi::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<csi::NodeUnpublishVolumeResponse>, Status> {
        let req = r.into_inner();
        required(&req.volume_id, "volume_id")?;
        let target = required(&req.target_path, "target_path")?;
        if is_mounted(target) {
            run("umount", &[target]).await?;
        }
        let path = Path::new(target);
        let removed = if path.is_dir() { std::fs::remove_dir(path) } else { std::fs::remove_file(path) };
        match removed {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Status::internal(format!("cannot remove {target}: {e}")))
            }
            _ => Ok(Response::new(csi::NodeUnpublishVolumeResponse {})),
        }
    }

    async fn node_get_volume_stats(
        &self,
        r: Request<csi::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<csi::NodeGetVolumeStatsResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        let path = required(&req.volume_path, "volume_path")?;
        let meta = std::fs::metadata(path)
            .map_err(|_| Status::not_found(format!("volume path {path} of volume {volume} does not exist")))?;
        use csi::volume_usage::Unit;
        let usage = if meta.is_dir() {
            let fs = fsinfo::statvfs(path).map_err(|e| Status::internal(format!("statvfs {path}: {e}")))?;
            vec![
                csi::VolumeUsage {
                    total: fs.bytes_total as i64,
                    available: fs.bytes_available as i64,
                    used: (fs.bytes_total - fs.bytes_free) as i64,
                    unit: Unit::Bytes as i32,
                },
                csi::VolumeUsage {
                    total: fs.inodes_total as i64,
                    available: fs.inodes_free as i64,
                    used: (fs.inodes_total - fs.inodes_free) as i64,
                    unit: Unit::Inodes as i32,
                },
            ]
        } else {
            let staged =
                self.staged(volume).ok_or_else(|| Status::not_found(format!("volume {volume} is not staged here")))?;
            let total = device_size(&staged.device).unwrap_or(0) as i64;
            vec![csi::VolumeUsage { total, available: 0, used: 0, unit: Unit::Bytes as i32 }]
        };
        Ok(Response::new(csi::NodeGetVolumeStatsResponse { usage, volume_condition: None }))
    }

    async fn node_expand_volume(
        &self,
        r: Request<csi::NodeExpandVolumeRequest>,
    ) -> Result<Response<csi::NodeExpandVolumeResponse>, Status> {
        let req = r.into_inner();
        let volume = required(&req.volume_id, "volume_id")?;
        let path = required(&req.volume_path, "volume_path")?;
        let staged =
            self.staged(volume).ok_or_else(|| Status::not_found(format!("volume {volume} is not staged here")))?;
        if let Some(c) = controller_of(&staged.nqn) {
            // The engine raised a Namespace Attribute Changed event; rescan in case it was missed.
            let _ = run("nvme", &["ns-rescan", &format!("/dev/{c}")]).await;
        }
        let block =
            matches!(req.volume_capability.as_ref().and_then(|c| c.access_type.as_ref()), Some(AccessType::Block(_)));
        if !block && std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            match filesystem_on(&staged.device)? {
                Some("xfs") => run("xfs_growfs", &[path]).await?,
                _ => run("resize2fs", &[&staged.device]).await?,
            };
        }
        Ok(Response::new(csi::NodeExpandVolumeResponse {
            capacity_bytes: device_size(&staged.device).unwrap_or(0) as i64,
        }))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<csi::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<csi::NodeGetCapabilitiesResponse>, Status> {
        use csi::node_service_capability::{Rpc, Type, rpc::Type as R};
        let capabilities = [R::StageUnstageVolume, R::GetVolumeStats, R::ExpandVolume]
            .into_iter()
            .map(|t| csi::NodeServiceCapability { r#type: Some(Type::Rpc(Rpc { r#type: t as i32 })) })
            .collect();
        Ok(Response::new(csi::NodeGetCapabilitiesResponse { capabilities }))
    }

    async fn node_get_info(
        &self,
        _: Request<csi::NodeGetInfoRequest>,
    ) -> Result<Response<csi::NodeGetInfoResponse>, Status> {
        Ok(Response::new(csi::NodeGetInfoResponse {
            node_id: self.host_nqn.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(csi::Topology {
                segments: HashMap::from([(TOPOLOGY_NODE_KEY.to_string(), self.node_name.clone())]),
            }),
        }))
    }
}

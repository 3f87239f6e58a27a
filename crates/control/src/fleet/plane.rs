//! The bench's own control plane: controllers as child processes (one on redb, or a
//! leader and a standby on three etcd members), and what the bench reads of them
//! (their metrics, pages, and the processes' CPU, memory and writes).

use super::bench::StoreKind;
use crate::etcd_server::Etcd;
use std::time::Duration;

/// CPU seconds a process used so far (user and system), from /proc.
pub(super) fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit_once(')').map_or("", |(_, rest)| rest).split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime, the 14th and 15th fields, in USER_HZ (100 on Linux).
    (ticks(11) + ticks(12)) / 100.0
}

/// Bytes a process caused to be written to storage so far, from /proc.
pub(super) fn written_bytes(pid: u32) -> f64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
    io.lines().find_map(|l| l.strip_prefix("write_bytes:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
}

pub(super) fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kib =
        status.lines().find_map(|l| l.strip_prefix("VmRSS:")).and_then(|v| v.trim().split(' ').next()?.parse().ok());
    kib.unwrap_or(0u64) / 1024
}

/// A port on 127.0.0.1 that nothing listens on now.
fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on 127.0.0.1: {e}"))
}

/// The body of `GET path` from an HTTP server at `address`, and how long it took (ms).
pub(super) async fn http_get(address: &str, path: &str) -> Result<(String, f64), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = std::time::Instant::now();
    let mut s = tokio::net::TcpStream::connect(address).await.map_err(|e| format!("{address}: {e}"))?;
    let ask = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    s.write_all(ask.as_bytes()).await.map_err(|e| format!("{address}: {e}"))?;
    let mut reply = Vec::new();
    s.read_to_end(&mut reply).await.map_err(|e| format!("{address}: {e}"))?;
    let reply = String::from_utf8_lossy(&reply);
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("GET http://{address}{path}: {}", head.lines().next().unwrap_or("no answer")));
    }
    Ok((body.to_string(), started.elapsed().as_secs_f64() * 1000.0))
}

/// The sum of a metric's samples (over its labels) in a Prometheus scrape.
pub(super) fn metric(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with([' ', '{'])))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A controller the bench started, on ports it keeps across restarts.
pub(super) struct ControllerProcess {
    child: Option<std::process::Child>,
    address: String,
    pub(super) metrics: String,
    pub(super) http: String,
}

/// A controller the bench started goes with it, however the bench ends (a failed run
/// left one running).
impl Drop for ControllerProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

impl ControllerProcess {
    pub(super) fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The bench's controllers and their store.
pub(super) struct ControlPlane {
    binary: std::path::PathBuf,
    dir: std::path::PathBuf,
    store: String,
    /// Flags every controller is started with, beyond its addresses and store.
    flags: Vec<String>,
    pub(super) controllers: Vec<ControllerProcess>,
    pub(super) etcd: Vec<Etcd>,
}

impl ControlPlane {
    /// One controller on redb, or three etcd members and two controllers on them
    /// (the first leads; the second stands by).
    pub(super) async fn start(
        binary: &std::path::Path,
        dir: &std::path::Path,
        kind: StoreKind,
        flags: &[&str],
    ) -> Result<ControlPlane, String> {
        let (store, etcd, count) = match kind {
            StoreKind::Embedded => (format!("redb:{}", dir.join("controller.redb").display()), Vec::new(), 1),
            StoreKind::Etcd => {
                // Each member takes a client and a peer port.
                let mut ports = (0..6).map(|_| free_port()).collect::<Result<Vec<u16>, String>>()?.into_iter();
                let members = Etcd::cluster(&dir.join("etcd"), 3, || ports.next().unwrap_or_default())?;
                (Etcd::store_address(&members), members, 2)
            }
        };
        let mut plane = ControlPlane {
            binary: binary.to_path_buf(),
            dir: dir.to_path_buf(),
            store,
            flags: flags.iter().map(|f| f.to_string()).collect(),
            controllers: Vec::new(),
            etcd,
        };
        for _ in 0..count {
            let address = format!("127.0.0.1:{}", free_port()?);
            let metrics = format!("127.0.0.1:{}", free_port()?);
            let http = format!("127.0.0.1:{}", free_port()?);
            plane.controllers.push(ControllerProcess { child: None, address, metrics, http });
            let started = plane.controllers.len() - 1;
            plane.launch(started)?;
            if started == 0 {
                plane.await_leader(Duration::from_secs(60)).await?;
            }
        }
        Ok(plane)
    }

    /// The controllers' addresses, as clients and agents are given them.
    pub(super) fn addresses(&self) -> String {
        let all: Vec<&str> = self.controllers.iter().map(|c| c.address.as_str()).collect();
        all.join(",")
    }

    pub(super) fn launch(&mut self, i: usize) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("controller-{i}.log")))
            .map_err(|e| format!("controller log in {}: {e}", self.dir.display()))?;
        let c = &mut self.controllers[i];
        let child = std::process::Command::new(&self.binary)
            .args(["controller", "--listen", &c.address, "--advertise", &c.address, "--store", &self.store])
            .args(["--metrics-listen", &c.metrics, "--http-listen", &c.http])
            .args(&self.flags)
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        c.child = Some(child);
        Ok(())
    }

    /// The controller that leads now, if one does (by its metrics).
    pub(super) async fn leader(&self) -> Option<usize> {
        for (i, c) in self.controllers.iter().enumerate() {
            if c.child.is_some()
                && let Ok((scrape, _)) = http_get(&c.metrics, "/metrics").await
                && metric(&scrape, "nvpool_controller_leader") == 1.0
            {
                return Some(i);
            }
        }
        None
    }

    pub(super) async fn await_leader(&self, patience: Duration) -> Result<usize, String> {
        let deadline = std::time::Instant::now() + patience;
        loop {
            if let Some(i) = self.leader().await {
                return Ok(i);
            }
            if std::time::Instant::now() > deadline {
                return Err(format!("no controller leads after {patience:?}; see {}", self.dir.display()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub(super) fn pid(&self, i: usize) -> u32 {
        self.controllers[i].child.as_ref().map_or(0, std::process::Child::id)
    }

    /// The processes that write the store: the controllers (redb), or etcd's members.
    pub(super) fn store_pids(&self) -> Vec<u32> {
        match self.etcd.is_empty() {
            true => (0..self.controllers.len()).map(|i| self.pid(i)).collect(),
            false => self.etcd.iter().filter_map(Etcd::pid).collect(),
        }
    }

    pub(super) fn store_bytes(&self) -> u64 {
        match self.etcd.is_empty() {
            true => std::fs::metadata(self.dir.join("controller.redb")).map_or(0, |m| m.len()),
            false => self.etcd.iter().map(Etcd::data_bytes).sum(),
        }
    }
}

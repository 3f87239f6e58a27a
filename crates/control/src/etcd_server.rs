//! etcd servers as child processes on 127.0.0.1, each with its own data directory: the
//! store of the tests (with the `testkit` feature) and the three members that
//! `nvpool fleet --store etcd` measures a controller against.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One etcd server: a member of a cluster of one or more on 127.0.0.1.
pub struct Etcd {
    pub client_url: String,
    peer_url: String,
    name: String,
    /// Every member's name and peer URL, as `--initial-cluster` takes them.
    initial_cluster: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl Etcd {
    /// Starts `count` members of one cluster, each in a directory of its own under
    /// `dir` (one alone keeps `dir`), on ports from `port`, and waits until each
    /// serves with a leader.
    pub fn cluster(dir: &Path, count: usize, mut port: impl FnMut() -> u16) -> Result<Vec<Etcd>, String> {
        let mut members: Vec<Etcd> = (0..count)
            .map(|i| Etcd {
                client_url: format!("http://127.0.0.1:{}", port()),
                peer_url: format!("http://127.0.0.1:{}", port()),
                name: if count == 1 { "t".into() } else { format!("m{i}") },
                initial_cluster: String::new(),
                dir: if count == 1 { dir.to_path_buf() } else { dir.join(format!("m{i}")) },
                child: None,
            })
            .collect();
        let initial_cluster: Vec<String> = members.iter().map(|m| format!("{}={}", m.name, m.peer_url)).collect();
        for m in &mut members {
            m.initial_cluster = initial_cluster.join(",");
            std::fs::create_dir_all(&m.dir).map_err(|e| format!("{}: {e}", m.dir.display()))?;
        }
        // All members run before any can elect a leader: a quorum must answer.
        for m in &mut members {
            m.launch()?;
        }
        for m in &members {
            m.await_healthy()?;
        }
        Ok(members)
    }

    /// The clients' URLs of `members`, as `--store etcd:` takes them.
    pub fn store_address(members: &[Etcd]) -> String {
        let urls: Vec<&str> = members.iter().map(|m| m.client_url.as_str()).collect();
        format!("etcd:{}", urls.join(","))
    }

    /// Starts the server process on its ports and data (a restart joins the cluster
    /// from its data; the initial cluster only counts the first time).
    pub(crate) fn launch(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .map_err(|e| format!("etcd log in {}: {e}", self.dir.display()))?;
        let child = Command::new("etcd")
            .args(["--name", &self.name, "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.client_url, "--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &self.peer_url, "--initial-advertise-peer-urls", &self.peer_url])
            .args(["--initial-cluster", &self.initial_cluster])
            // etcd keeps every revision until compacted, and refuses writes once its
            // file reaches the quota (2 GiB by default): 100,000 volumes written several
            // times each get there. Older revisions than a minute are never read.
            .args(["--auto-compaction-mode", "periodic", "--auto-compaction-retention", "1m"])
            .args(["--quota-backend-bytes", &(8u64 << 30).to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start etcd: {e} (scripts/setup installs Debian's etcd-server)"))?;
        self.child = Some(child);
        Ok(())
    }

    /// Waits until the server reports itself healthy (it has a leader). Waiting for
    /// that, not just for its port, matters: an etcd killed before it wrote its first
    /// raft entries leaves a data directory it restarts from as a member with no
    /// voters, which never elects a leader (seen in CI as a store that never worked
    /// again after a restart).
    pub(crate) fn await_healthy(&self) -> Result<(), String> {
        let address = self.client_url.trim_start_matches("http://");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !healthy(address) {
            if Instant::now() > deadline {
                return Err(format!("etcd did not become healthy; see {}", self.dir.join("etcd.log").display()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// The process's ID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The size of its data directory, in bytes.
    pub fn data_bytes(&self) -> u64 {
        fn size(p: &Path) -> u64 {
            let Ok(entries) = std::fs::read_dir(p) else { return 0 };
            entries
                .flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => size(&e.path()),
                    _ => e.metadata().map_or(0, |m| m.len()),
                })
                .sum()
        }
        size(&self.dir.join("data"))
    }

    /// Kills the server; its data stays.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Whether etcd at `address` answers its `/health` endpoint with health true.
fn healthy(address: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(address) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_err() {
        return false;
    }
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply.contains("\"health\":\"true\"")
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

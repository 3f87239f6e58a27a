//! Real peers for tests: an etcd server on 127.0.0.1 with its own data directory.
//! Tests of this crate and of the `nvpool` binary use it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    pub client_url: String,
    peer_url: String,
    dir: PathBuf,
    child: Option<Child>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Etcd {
    /// Starts etcd in `dir` (the data and log live there) and waits until it serves.
    pub fn start(dir: PathBuf) -> Etcd {
        let mut e = Etcd {
            client_url: format!("http://127.0.0.1:{}", free_port()),
            peer_url: format!("http://127.0.0.1:{}", free_port()),
            dir,
            child: None,
        };
        e.resume();
        e
    }

    /// Starts the stopped server again on the same ports and data, and waits until it
    /// reports itself healthy (it has a leader). Waiting for that, not just for its
    /// port, matters: an etcd killed before it wrote its first raft entries leaves a
    /// data directory it restarts from as a member with no voters, which never elects
    /// a leader (seen in CI as a store that never worked again after a restart).
    pub fn resume(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("etcd.log"))
            .expect("etcd log file");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.join("data"))
            .args(["--listen-client-urls", &self.client_url, "--advertise-client-urls", &self.client_url])
            .args(["--listen-peer-urls", &self.peer_url, "--initial-advertise-peer-urls", &self.peer_url])
            .args(["--initial-cluster", &format!("t={}", self.peer_url)])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd is not installed: scripts/setup installs Debian's etcd-server");
        self.child = Some(child);
        let address = self.client_url.trim_start_matches("http://").to_string();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !healthy(&address) {
            assert!(
                Instant::now() < deadline,
                "etcd did not become healthy; see {}",
                self.dir.join("etcd.log").display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Freezes the server (SIGSTOP): it holds its connections and answers nothing, as a
    /// store that hangs does, until `thaw`.
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    pub fn thaw(&self) {
        self.signal("CONT");
    }

    fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("etcd is running");
        let sent = Command::new("kill").arg(format!("-{name}")).arg(child.id().to_string()).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -{name} etcd failed");
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

//! Real peers for tests: an etcd server on 127.0.0.1 with its own data directory, and
//! ports to start servers on. Tests of this crate and of the `nvpool` binary use it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub struct Etcd {
    pub client_url: String,
    peer_url: String,
    dir: PathBuf,
    child: Option<Child>,
}

/// Where `free_port` looks: below Linux's default range of ephemeral ports (32768 and
/// up), which every outgoing connection on the machine draws from. A port the kernel
/// picked there could be taken, between the test's look and its server's bind, by any
/// connection: a download of a build running beside the tests once took an agent's.
const TEST_PORTS: std::ops::Range<u32> = 20_000..32_000;

/// A port on 127.0.0.1 that nothing listens on now, for a server a test starts in
/// another process. Each call in a process gives another port; processes start at
/// different places in the range (by process ID and time), so that test binaries
/// running side by side rarely meet.
pub fn free_port() -> u16 {
    static NEXT: LazyLock<AtomicU32> = LazyLock::new(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        AtomicU32::new(std::process::id().wrapping_mul(7919) ^ now.subsec_nanos())
    });
    let span = TEST_PORTS.end - TEST_PORTS.start;
    for _ in 0..span {
        let port = TEST_PORTS.start + NEXT.fetch_add(1, Ordering::Relaxed) % span;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return port as u16;
        }
    }
    panic!("no free port on 127.0.0.1 in {TEST_PORTS:?}: stop what holds them and run the test again")
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

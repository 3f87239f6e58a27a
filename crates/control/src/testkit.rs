//! Real peers for tests: an etcd server on 127.0.0.1 with its own data directory, and
//! ports to start servers on. Tests of this crate and of the `nvpool` binary use it.

pub use crate::etcd_server::Etcd;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU32, Ordering};

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
    /// Starts one etcd in `dir` (the data and log live there) and waits until it
    /// serves.
    pub fn start(dir: PathBuf) -> Etcd {
        let mut members = Etcd::cluster(&dir, 1, free_port).expect("etcd starts");
        members.pop().expect("one member")
    }

    /// Starts the stopped server again on the same ports and data, and waits until it
    /// reports itself healthy.
    pub fn resume(&mut self) {
        self.launch().expect("etcd starts again");
        self.await_healthy().expect("etcd is healthy again");
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
        let pid = self.pid().expect("etcd is running");
        let sent = Command::new("kill").arg(format!("-{name}")).arg(pid.to_string()).status();
        assert!(sent.is_ok_and(|s| s.success()), "kill -{name} etcd failed");
    }
}

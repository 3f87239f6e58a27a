//! `nvpool supervise -- COMMAND...`: the main process of a container whose engine
//! hot-upgrades itself.
//!
//! A container lives as long as the process its runtime started, and everything in it
//! is killed when that process exits. A hot upgrade's new engine is a child of the old
//! one, which exits once the new one has taken over, so the engine cannot be that
//! process; this is. It is a child subreaper (the new engine becomes its child when the
//! old one exits) and, as far as the engine knows, its service manager: it hands the
//! engine a `NOTIFY_SOCKET`, and learns from the `MAINPID=` an engine sends there which
//! process serves now, as systemd does for `deploy/systemd`. SIGTERM and SIGINT go on
//! to that process (the engine's graceful stop); when that process ends without having
//! handed over, this one exits with its status.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

use crate::process::{self, Ended};

/// How often the loop looks at the socket, the signals and the children.
const TICK: Duration = Duration::from_millis(50);

/// Runs `command` and stays until the process serving in its place ends.
pub fn run(command: &[String]) -> Result<(), String> {
    let (program, args) = command.split_first().ok_or("nothing to supervise: give the command after --")?;
    process::catch_stop_signals();
    process::become_child_subreaper().map_err(|e| format!("cannot become a child subreaper: {e}"))?;
    // An abstract socket: nothing on disk to clean up, and private to this process's
    // network namespace (the container's).
    let name = format!("nvpool-supervise-{}", std::process::id());
    let address = SocketAddr::from_abstract_name(name.as_bytes()).map_err(|e| e.to_string())?;
    let notify = UnixDatagram::bind_addr(&address).map_err(|e| format!("cannot open the notify socket: {e}"))?;
    notify.set_nonblocking(true).map_err(|e| e.to_string())?;
    let child = std::process::Command::new(program)
        .args(args)
        .env("NOTIFY_SOCKET", format!("@{name}"))
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    let mut serving = child.id();
    let mut stop_sent_to = None;
    loop {
        std::thread::sleep(TICK);
        receive_main_pid(&notify, &mut serving);
        if process::stop_asked() && stop_sent_to != Some(serving) {
            process::terminate(serving);
            stop_sent_to = Some(serving);
        }
        // No children at all cannot be: the serving process would have been seen ending.
        while let Some((pid, ended)) =
            process::reap_child().map_err(|e| format!("no process left to supervise: {e}"))?
        {
            // The new process says MAINPID before the old one exits; read what came in
            // before deciding that the serving process is gone.
            receive_main_pid(&notify, &mut serving);
            if pid == serving {
                tracing::info!("supervise: process {pid} ended ({ended:?})");
                return exit_like(ended);
            }
            tracing::info!("supervise: process {pid} ended ({ended:?}); process {serving} serves");
        }
    }
}

/// Reads every notification waiting, taking the last `MAINPID=` among them.
fn receive_main_pid(notify: &UnixDatagram, serving: &mut u32) {
    let mut buffer = [0u8; 4096];
    while let Ok(n) = notify.recv(&mut buffer) {
        let text = String::from_utf8_lossy(&buffer[..n]);
        for pid in text.lines().filter_map(|l| l.strip_prefix("MAINPID=")?.trim().parse::<u32>().ok()) {
            if pid != *serving {
                tracing::info!("supervise: process {pid} serves in place of {serving}");
                *serving = pid;
            }
        }
    }
}

fn exit_like(ended: Ended) -> Result<(), String> {
    match ended.status() {
        0 => Ok(()),
        status => std::process::exit(status),
    }
}

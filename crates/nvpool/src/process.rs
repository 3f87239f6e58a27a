//! The engine process's dealings with the system: the signals it stops on, and the
//! open-file limit it runs with.
#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM ask the process to stop (`wait_for_stop` returns)
/// instead of ending it. Called first thing: an engine that says it is ready (or took
/// over in an upgrade) before it catches them would die at once, without stopping
/// cleanly or telling the service manager, when stopped right then.
pub fn catch_stop_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: installs an async-signal-safe handler that only stores an atomic.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Blocks until SIGINT or SIGTERM arrives (once `catch_stop_signals` was called).
pub fn wait_for_stop() {
    while !stop_asked() {
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Raises this process's soft limit of open files to its hard limit. An engine holds
/// a descriptor per connection, and two during a hot upgrade (its own and the copy it
/// hands on), so the usual soft limit of 1,024 would cap it near 500 hosts' queues.
pub fn raise_open_file_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write the one struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// Makes this process the reaper of its descendants' orphans: a child's children
/// become its own when the child exits (as they would become init's).
pub fn become_child_subreaper() -> std::io::Result<()> {
    // SAFETY: PR_SET_CHILD_SUBREAPER takes an integer and touches no memory.
    let done = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1 as libc::c_ulong, 0, 0, 0) };
    if done == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// How a reaped child ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this status.
    Exited(i32),
    /// A signal ended it.
    Killed(i32),
}

impl Ended {
    /// The exit status a shell gives such a child (128 + the signal for a killed one).
    pub fn status(self) -> i32 {
        match self {
            Ended::Exited(code) => code,
            Ended::Killed(signal) => 128 + signal,
        }
    }
}

/// Reaps one child that has ended, without waiting: `Ok(None)` when none has (yet),
/// an error (ECHILD) when there are no children left.
pub fn reap_child() -> std::io::Result<Option<(u32, Ended)>> {
    let mut status: libc::c_int = 0;
    // SAFETY: waitpid writes the one integer passed.
    let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
    match pid {
        -1 => Err(std::io::Error::last_os_error()),
        0 => Ok(None),
        pid if libc::WIFSIGNALED(status) => Ok(Some((pid as u32, Ended::Killed(libc::WTERMSIG(status))))),
        pid => Ok(Some((pid as u32, Ended::Exited(libc::WEXITSTATUS(status))))),
    }
}

/// Sends SIGTERM to process `pid`.
pub fn terminate(pid: u32) {
    // SAFETY: kill sends a signal and touches no memory.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
}

/// Whether SIGINT or SIGTERM arrived since `catch_stop_signals`.
pub fn stop_asked() -> bool {
    STOP.load(Ordering::SeqCst)
}

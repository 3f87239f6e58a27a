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
    while !STOP.load(Ordering::SeqCst) {
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

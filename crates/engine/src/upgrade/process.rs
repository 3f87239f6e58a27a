//! What a hot upgrade asks of the operating system besides the channel: passing the
//! channel's descriptor to the new process, waiting on the management socket, room
//! for descriptors, an old process that steps aside as it exits, and telling the
//! service manager which process is the engine now.
#![allow(unsafe_code)]

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// Clears close-on-exec on `fd`, so a child started next inherits it.
pub fn inherit(fd: RawFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns; F_SETFD only sets its flags.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Takes ownership of a descriptor inherited from the parent, named by number.
pub fn adopt_inherited(fd: RawFd) -> std::io::Result<UnixStream> {
    // SAFETY: F_GETFD only reads the flags, and fails for a descriptor that is not open.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the parent passed this descriptor to this process alone, for this use,
    // and it is open (checked above); nothing else in the process owns it.
    let socket = unsafe { UnixStream::from_raw_fd(fd) };
    // SAFETY: F_SETFD with FD_CLOEXEC on the descriptor now owned; no child inherits it.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(socket)
}

/// Lowers every thread of this process to the lowest priority (nice 19), so that
/// tearing the process down as it exits yields the CPUs to the engine that took over.
pub fn step_aside() {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
    for tid in tasks.flatten().filter_map(|t| t.file_name().to_str()?.parse::<libc::id_t>().ok()) {
        // SAFETY: setpriority only changes the scheduling priority of one of this
        // process's threads.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, 19) };
    }
}

/// Waits up to `timeout` until `fd` is readable (a listener has a connection waiting).
pub fn wait_readable(fd: RawFd, timeout: Duration) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: poll reads and writes the one pollfd passed.
    let n = unsafe { libc::poll(&mut p, 1, timeout.as_millis() as libc::c_int) };
    n > 0 && p.revents & libc::POLLIN != 0
}

/// Grows this process's descriptor table so that `extra` more descriptors fit beside
/// those open now. The kernel grows a table that threads share only after an RCU grace
/// period, milliseconds each time it doubles; a hot upgrade copies or receives one
/// descriptor per connection while no command is read, so it grows the table before.
pub fn reserve_descriptors(extra: usize) {
    let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the one struct passed.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    let wanted = (open + extra + 64) as u64;
    let Ok(at) = libc::c_int::try_from(wanted.min(limit.rlim_cur.saturating_sub(1))) else { return };
    let Ok(probe) = std::fs::File::open("/dev/null") else { return };
    // SAFETY: F_DUPFD returns a new descriptor, the lowest free one at `at` or above,
    // and touches no other; it is closed at once, and the table keeps its size.
    unsafe {
        let copy = libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&probe), libc::F_DUPFD, at);
        if copy >= 0 {
            libc::close(copy);
        }
    }
}

/// Tells the service manager that started this process (systemd, through the datagram
/// socket named by `NOTIFY_SOCKET`) `state`, e.g. `READY=1` or `MAINPID=...`; nothing
/// when there is none. A hot upgrade's new process names itself the main process this
/// way before the old one exits, so systemd follows the engine rather than taking the
/// old process's exit for the service's end (the unit needs `NotifyAccess=all`).
pub fn notify_service_manager(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else { return };
    // A leading '@' names a socket in the abstract namespace.
    let address = match socket.as_bytes().strip_prefix(b"@") {
        Some(name) => SocketAddr::from_abstract_name(name),
        None => SocketAddr::from_pathname(&socket),
    };
    let sent = address.and_then(|a| UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &a));
    if let Err(e) = sent {
        tracing::warn!("cannot notify the service manager ({state:?}): {e}");
    }
}

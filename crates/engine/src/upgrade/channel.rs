//! The handover channel between the old and the new engine process: a Unix stream
//! socket carrying frames (a 4-byte little-endian length, then that many bytes of
//! JSON), each optionally with file descriptors attached (SCM_RIGHTS). The kernel
//! delivers a frame's descriptors with its first byte and never merges the bytes of
//! two sends that carry descriptors into one read, so reading the 4-byte length with
//! `recvmsg` returns exactly that frame's descriptors.
#![allow(unsafe_code)]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Descriptors sent with one frame: below the kernel's limit of 253 per message.
const MAX_FDS_PER_FRAME: usize = 200;
/// The largest frame accepted: a state image with a thousand connections and their
/// unread commands stays far below it.
const MAX_FRAME: usize = 256 << 20;

/// One end of the handover channel.
pub struct Channel {
    socket: UnixStream,
    /// How long a `recv` waits, for the error when nothing came.
    timeout: std::cell::Cell<Option<Duration>>,
}

impl Channel {
    /// Wraps a connected Unix stream socket.
    pub fn new(socket: UnixStream) -> Channel {
        Channel { socket, timeout: std::cell::Cell::new(None) }
    }

    /// A connected pair: one end for each process.
    pub fn pair() -> std::io::Result<(Channel, UnixStream)> {
        let (a, b) = UnixStream::pair()?;
        Ok((Channel::new(a), b))
    }

    /// Bounds how long a `recv` waits; `None` waits for ever.
    pub fn set_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.timeout.set(t);
        self.socket.set_read_timeout(t)
    }

    /// Sends `value` as one frame with `fds` attached (at most `MAX_FDS_PER_FRAME`).
    pub fn send<T: Serialize>(&self, value: &T, fds: &[RawFd]) -> std::io::Result<()> {
        assert!(fds.len() <= MAX_FDS_PER_FRAME, "at most {MAX_FDS_PER_FRAME} descriptors per frame");
        let body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
        let len = (body.len() as u32).to_le_bytes();
        send_with_fds(&self.socket, &len, fds)?;
        (&self.socket).write_all(&body)
    }

    /// Sends descriptors, in as many frames as they need; the receiver is told how
    /// many to expect in a frame before them.
    pub fn send_fds(&self, fds: &[RawFd]) -> std::io::Result<()> {
        fds.chunks(MAX_FDS_PER_FRAME).try_for_each(|chunk| self.send(&chunk.len(), chunk))
    }

    /// Receives `count` descriptors sent with `send_fds`.
    pub fn recv_fds(&self, count: usize) -> std::io::Result<Vec<OwnedFd>> {
        let mut all = Vec::with_capacity(count);
        while all.len() < count {
            let (promised, got): (usize, _) = self.recv()?;
            if promised != got.len() || got.is_empty() {
                let why = format!("a frame promised {promised} descriptors and carried {}", got.len());
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
            }
            all.extend(got);
        }
        Ok(all)
    }

    /// Receives one frame and the descriptors sent with it; an error of kind
    /// `TimedOut` when nothing came in time.
    pub fn recv<T: DeserializeOwned>(&self) -> std::io::Result<(T, Vec<OwnedFd>)> {
        self.recv_frame().map_err(|e| match (e.kind(), self.timeout.get()) {
            (std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut, Some(t)) => {
                std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no answer within {t:?}"))
            }
            _ => e,
        })
    }

    fn recv_frame<T: DeserializeOwned>(&self) -> std::io::Result<(T, Vec<OwnedFd>)> {
        let mut len = [0u8; 4];
        let (got, fds) = recv_with_fds(&self.socket, &mut len)?;
        if got == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the other process closed the channel"));
        }
        (&self.socket).read_exact(&mut len[got..])?;
        let n = u32::from_le_bytes(len) as usize;
        if n > MAX_FRAME {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("a {n}-byte frame is too large")));
        }
        let mut body = vec![0u8; n];
        (&self.socket).read_exact(&mut body)?;
        let value =
            serde_json::from_slice(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        Ok((value, fds))
    }
}

/// Room for the control message of `MAX_FDS_PER_FRAME` descriptors.
fn control_space() -> usize {
    // SAFETY: CMSG_SPACE only computes a size.
    unsafe { libc::CMSG_SPACE((MAX_FDS_PER_FRAME * size_of::<RawFd>()) as u32) as usize }
}

fn send_with_fds(socket: &UnixStream, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
    let mut control = vec![0u8; control_space()];
    let mut sent = 0;
    while sent < bytes.len() {
        let mut iov =
            libc::iovec { iov_base: bytes[sent..].as_ptr() as *mut libc::c_void, iov_len: bytes.len() - sent };
        // SAFETY: msghdr is plain data; all-zero is an empty header.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        // The descriptors go with the first bytes only.
        if sent == 0 && !fds.is_empty() {
            let data_len = std::mem::size_of_val(fds) as u32;
            // SAFETY: CMSG_SPACE only computes a size.
            msg.msg_controllen = unsafe { libc::CMSG_SPACE(data_len) } as usize;
            msg.msg_control = control.as_mut_ptr().cast();
            // SAFETY: `control` holds CMSG_SPACE(data_len) bytes (at most
            // `control_space`), so the first header and its data fit; the header is
            // written before the data is copied behind it.
            unsafe {
                let cmsg = libc::CMSG_FIRSTHDR(&msg);
                (*cmsg).cmsg_level = libc::SOL_SOCKET;
                (*cmsg).cmsg_type = libc::SCM_RIGHTS;
                (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as usize;
                std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), fds.len());
            }
        }
        // SAFETY: `msg` points at `iov` and `control`, both alive for the call.
        let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        sent += n as usize;
    }
    Ok(())
}

fn recv_with_fds(socket: &UnixStream, buf: &mut [u8]) -> std::io::Result<(usize, Vec<OwnedFd>)> {
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let mut control = vec![0u8; control_space()];
    // SAFETY: msghdr is plain data; all-zero is an empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    let n = loop {
        // SAFETY: `msg` points at `iov` (over `buf`) and `control`, both alive for the
        // call and of the lengths given.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` up to `msg_controllen`; CMSG_FIRSTHDR and
    // CMSG_NXTHDR walk only inside it, and each SCM_RIGHTS header's data holds
    // `(cmsg_len - CMSG_LEN(0)) / 4` descriptors, now ours.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "descriptors were cut off"));
    }
    Ok((n, fds))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn frames_carry_their_descriptors() {
        let (a, b) = Channel::pair().unwrap();
        let b = Channel::new(b);
        let big: Vec<u8> = (0..1_000_000).map(|i| i as u8).collect();
        // The big frame is larger than the socket's buffer: it is sent while read.
        let sender = std::thread::spawn({
            let big = big.clone();
            move || {
                let (x, _y) = UnixStream::pair().unwrap();
                a.send(&"first", &[x.as_fd().as_raw_fd(), x.as_fd().as_raw_fd()]).unwrap();
                a.send(&vec![1u32, 2, 3], &[]).unwrap();
                a.send(&big, &[x.as_raw_fd()]).unwrap();
                a.send_fds(&vec![x.as_raw_fd(); 450]).unwrap();
            }
        });
        let (first, fds): (String, _) = b.recv().unwrap();
        assert_eq!((first.as_str(), fds.len()), ("first", 2));
        let (second, fds): (Vec<u32>, _) = b.recv().unwrap();
        assert_eq!((second, fds.len()), (vec![1, 2, 3], 0));
        let (third, fds): (Vec<u8>, _) = b.recv().unwrap();
        assert_eq!((third == big, fds.len()), (true, 1));
        assert_eq!(b.recv_fds(450).unwrap().len(), 450);
        sender.join().unwrap();
        assert_eq!(b.recv::<String>().unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    }
}

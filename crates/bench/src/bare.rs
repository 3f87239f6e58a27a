//! The bare request/response loop: the same message sizes as NVMe/TCP I/O (a 72-byte
//! command capsule out, a C2HData header and the data back), with no protocol at all.
//! It is what one TCP connection on this machine can do, measured in the same run as
//! `nvpool bench` against the minimal responder, so the generator's own cost shows.
//!
//! The client stamps each request with the response length it wants; the server
//! answers requests in order with that many bytes from a zero buffer. Both sides
//! busy-poll non-blocking sockets on one thread and batch: everything that arrived is
//! answered with one vectored write.

use std::collections::VecDeque;
use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::histogram::Histogram;
use crate::idle::IdleBackoff;
use crate::load::{Latency, Report, Workload};

/// Bytes of one request: the size of an NVMe/TCP command capsule without data.
pub const REQUEST: usize = 72;
/// Bytes of the header in front of each response's data (a C2HData PDU header).
pub const RESPONSE_HEADER: usize = 24;
/// Largest response the server sends.
const MAX_RESPONSE: usize = RESPONSE_HEADER + (1 << 20);
/// Most iovecs per write.
const MAX_IOV: usize = 512;

/// Serves the bare loop on `listener` until `stop` is set.
pub fn serve(listener: &TcpListener, stop: &AtomicBool) {
    let zeroes = vec![0u8; MAX_RESPONSE];
    let mut conns: Vec<ServerConn> = Vec::new();
    let mut pass: u32 = 0;
    let mut idle = IdleBackoff::default();
    while !stop.load(Ordering::Relaxed) {
        pass = pass.wrapping_add(1);
        let napping = idle.pass();
        if napping || pass.is_multiple_of(256) {
            while let Ok((s, _)) = listener.accept() {
                let _ = s.set_nodelay(true);
                if s.set_nonblocking(true).is_ok() {
                    conns.push(ServerConn {
                        stream: s,
                        rbuf: vec![0; 1 << 20],
                        rend: 0,
                        owed: VecDeque::new(),
                        sent: 0,
                        dead: false,
                    });
                }
            }
            conns.retain(|c| !c.dead);
        }
        for c in conns.iter_mut().filter(|c| !c.dead) {
            if c.poll(&zeroes) {
                idle.busy();
            }
        }
    }
}

struct ServerConn {
    stream: TcpStream,
    rbuf: Vec<u8>,
    rend: usize,
    /// Response lengths owed, oldest first; `sent` bytes of the first are out.
    owed: VecDeque<usize>,
    sent: usize,
    dead: bool,
}

impl ServerConn {
    /// Reads what arrived, queues a response per whole request and writes as much as
    /// the socket takes. Returns whether anything arrived.
    fn poll(&mut self, zeroes: &[u8]) -> bool {
        let arrived = match self.stream.read(&mut self.rbuf[self.rend..]) {
            Ok(0) => {
                self.dead = true;
                return false;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => 0,
            Err(_) => {
                self.dead = true;
                return false;
            }
        };
        self.rend += arrived;
        let whole = self.rend / REQUEST * REQUEST;
        for req in self.rbuf[..whole].chunks_exact(REQUEST) {
            let want = u32::from_le_bytes([req[0], req[1], req[2], req[3]]) as usize;
            self.owed.push_back(want.clamp(RESPONSE_HEADER, MAX_RESPONSE));
        }
        self.rbuf.copy_within(whole..self.rend, 0);
        self.rend -= whole;
        while !self.owed.is_empty() {
            let mut iov: [IoSlice<'_>; MAX_IOV] = std::array::from_fn(|_| IoSlice::new(&[]));
            let mut n = 0;
            for (i, &len) in self.owed.iter().take(MAX_IOV).enumerate() {
                let skip = if i == 0 { self.sent } else { 0 };
                iov[i] = IoSlice::new(&zeroes[skip..len]);
                n = i + 1;
            }
            let mut written = match self.stream.write_vectored(&iov[..n]) {
                Ok(w) => w,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.dead = true;
                    break;
                }
            };
            while let Some(&len) = self.owed.front() {
                let left = len - self.sent;
                if written < left {
                    self.sent += written;
                    break;
                }
                written -= left;
                self.sent = 0;
                self.owed.pop_front();
            }
        }
        arrived > 0
    }
}

/// Drives the bare loop at `addr`: `queue_depth` requests in flight, each asking for
/// `RESPONSE_HEADER + io_size` bytes back. Measures like `nvpool bench`.
pub fn run(
    addr: SocketAddr,
    io_size: u32,
    queue_depth: u32,
    warmup: Duration,
    duration: Duration,
) -> Result<Report, String> {
    if queue_depth == 0 {
        return Err("--qd must be at least 1".into());
    }
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connecting to {addr}: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream.set_nonblocking(true).map_err(|e| e.to_string())?;
    let response = RESPONSE_HEADER + io_size as usize;
    let mut request = [0u8; REQUEST];
    request[..4].copy_from_slice(&(response as u32).to_le_bytes());
    let mut rbuf = vec![0u8; 4 << 20];
    let mut wbuf: Vec<u8> = Vec::with_capacity(REQUEST * queue_depth as usize);
    let mut wsent = 0;
    // Send times of the requests in flight, oldest first (answers come in order).
    let mut started: VecDeque<Instant> = VecDeque::with_capacity(queue_depth as usize);
    let mut partial = 0;
    let start = Instant::now();
    for _ in 0..queue_depth {
        wbuf.extend_from_slice(&request);
        started.push_back(start);
    }
    let (measure_at, end_at) = (start + warmup, start + warmup + duration);
    let (mut measuring, mut measure_start, mut cpu_start) = (false, start, 0);
    let mut started_unix_s = 0.0;
    let (mut ios, mut hist) = (0u64, Histogram::default());
    let mut pass: u32 = 0;
    loop {
        while wsent < wbuf.len() {
            match stream.write(&wbuf[wsent..]) {
                Ok(n) => wsent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(format!("socket: {e}")),
            }
        }
        if wsent == wbuf.len() {
            wbuf.clear();
            wsent = 0;
        }
        match stream.read(&mut rbuf) {
            Ok(0) => return Err("the server closed the connection".into()),
            Ok(n) => {
                let now = Instant::now();
                partial += n;
                while partial >= response {
                    partial -= response;
                    let sent = started.pop_front().unwrap_or(now);
                    if measuring {
                        hist.record((now - sent).as_nanos() as u64);
                        ios += 1;
                    }
                    wbuf.extend_from_slice(&request);
                    started.push_back(now);
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("socket: {e}")),
        }
        pass = pass.wrapping_add(1);
        if !pass.is_multiple_of(64) {
            continue;
        }
        let now = Instant::now();
        if !measuring && now >= measure_at {
            (measuring, measure_start, cpu_start) = (true, now, crate::load::thread_cpu_ns());
            started_unix_s = crate::load::unix_now();
        }
        if now >= end_at {
            let seconds = (now - measure_start).as_secs_f64();
            let cpu_seconds = (crate::load::thread_cpu_ns() - cpu_start) as f64 / 1e9;
            return Ok(Report {
                workload: Workload::RandRead,
                io_size,
                queue_depth,
                connections: 1,
                seconds,
                ios,
                commands: ios,
                iops: ios as f64 / seconds.max(1e-9),
                mib_per_s: (ios * u64::from(io_size)) as f64 / seconds.max(1e-9) / (1024.0 * 1024.0),
                latency: Latency::from_histogram(&hist),
                errors: 0,
                verify_failures: 0,
                cpu_seconds,
                timeline: Vec::new(),
                started_unix_s,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn bare_loop_answers_every_request() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let stop = stop.clone();
            std::thread::spawn(move || serve(&listener, &stop))
        };
        let r = run(addr, 4096, 8, Duration::from_millis(50), Duration::from_millis(200)).unwrap();
        stop.store(true, Ordering::Relaxed);
        server.join().unwrap();
        assert!(r.ios > 0, "no responses: {r:?}");
        assert!(r.latency.mean_us > 0.0);
    }
}

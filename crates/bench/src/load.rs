//! The load generator: NVMe/TCP I/O queues driven from one busy-polling thread.
//!
//! Each connection keeps `queue_depth` commands in flight. A loop pass reads what
//! arrived on each socket, completes commands (C2HData with SUCCESS, or a response
//! capsule), answers R2Ts, immediately queues a replacement for every completed
//! command, and writes the whole batch with one `write`. Sockets are non-blocking and
//! the thread never sleeps, like the bare request/response loop it is compared with.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvpool_initiator::{ConnectOptions, Queue, connect_admin};
use nvpool_wire::bytes::compact;
use nvpool_wire::command::{Command, PSDT_SGL, SglDescriptor, io_opcode, sgl};
use nvpool_wire::identify;
use nvpool_wire::tcp::{self, DataHeader, DataLimits, Digests, Pdu};
use serde::Serialize;

use crate::histogram::Histogram;

/// What the generator does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Workload {
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random mixed reads and writes (`rwmixread` percent reads).
    RandRw,
}

impl std::str::FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "randread" => Workload::RandRead,
            "randwrite" => Workload::RandWrite,
            "read" => Workload::Read,
            "write" => Workload::Write,
            "randrw" => Workload::RandRw,
            _ => return Err(format!("workload {s:?} is unknown: use randread, randwrite, read, write or randrw")),
        })
    }
}

/// Options of one run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Target address.
    pub target: SocketAddr,
    /// Subsystem NQN.
    pub nqn: String,
    /// Host NQN presented to the target.
    pub hostnqn: String,
    /// Namespace.
    pub nsid: u32,
    /// Workload.
    pub workload: Workload,
    /// Percent reads for `randrw`.
    pub rwmixread: u8,
    /// I/O size in bytes (a multiple of the namespace block size).
    pub io_size: u32,
    /// Commands in flight per connection.
    pub queue_depth: u32,
    /// I/O queues (one TCP connection each).
    pub connections: u32,
    /// Measured time.
    pub duration: Duration,
    /// Time run before measuring.
    pub warmup: Duration,
    /// Stamp written blocks and check what is read back.
    pub verify: bool,
    /// Header and data digests.
    pub digests: Digests,
    /// Use only the first `span` bytes of the namespace (all of it when `None`).
    pub span: Option<u64>,
    /// Report IOPS and the slowest I/O of every window this long, too.
    pub timeline: Option<Duration>,
    /// Keep SQ flow control on, as the Linux host does by default: a target then
    /// answers each read with its data and a response capsule, two PDUs. Off, a read's
    /// last C2HData PDU may carry SUCCESS and stand for the response.
    pub sq_flow_control: bool,
    /// Sleep this long after a pass that received nothing, instead of polling again:
    /// for a load that must leave the CPU to what shares it (a throttled volume's load
    /// beside the one measured). `None` polls.
    pub nap: Option<Duration>,
}

/// One window of a run's timeline.
#[derive(Clone, Debug, Serialize)]
pub struct Window {
    /// Seconds from the start of the measured time to the window's start.
    pub at_s: f64,
    /// I/Os per second in the window.
    pub iops: f64,
    /// The slowest I/O completed in the window, in microseconds.
    pub max_us: f64,
}

/// Latency figures in microseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
    /// Largest.
    pub max_us: f64,
}

impl Latency {
    /// The figures of a histogram of nanoseconds.
    pub(crate) fn from_histogram(h: &Histogram) -> Latency {
        let us = |ns: u64| ns as f64 / 1000.0;
        Latency {
            mean_us: h.mean() / 1000.0,
            p50_us: us(h.quantile(0.5)),
            p99_us: us(h.quantile(0.99)),
            p999_us: us(h.quantile(0.999)),
            max_us: us(h.max()),
        }
    }
}

/// The result of a run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Workload.
    pub workload: Workload,
    /// I/O size in bytes.
    pub io_size: u32,
    /// Queue depth per connection.
    pub queue_depth: u32,
    /// Connections.
    pub connections: u32,
    /// Measured seconds.
    pub seconds: f64,
    /// I/Os completed while measuring.
    pub ios: u64,
    /// Every I/O command completed, the warm-up's and the drain's included: what the
    /// target saw.
    pub commands: u64,
    /// I/Os per second.
    pub iops: f64,
    /// MiB per second.
    pub mib_per_s: f64,
    /// Latency.
    pub latency: Latency,
    /// Commands that failed.
    pub errors: u64,
    /// Blocks whose content was wrong (with `verify`).
    pub verify_failures: u64,
    /// CPU seconds the generator's thread used while measuring.
    pub cpu_seconds: f64,
    /// With `timeline`: the measured time, window by window.
    pub timeline: Vec<Window>,
    /// When the measured time began, in seconds since the Unix epoch: lines the
    /// timeline up with events outside the run (an upgrade, a path change).
    pub started_unix_s: f64,
}

/// Marks a block written with `verify`: the first 8 bytes; the next 8 are the LBA.
const VERIFY_MAGIC: u64 = 0x6e76_706f_6f6c_5631;

struct Slot {
    start: Instant,
    lba: u64,
    write: bool,
}

struct Conn {
    stream: TcpStream,
    digests: Digests,
    rbuf: Vec<u8>,
    rstart: usize,
    rend: usize,
    wbuf: Vec<u8>,
    wsent: usize,
    slots: Vec<Option<Slot>>,
    free: Vec<u16>,
    rng: u64,
    cursor: u64,
    region: (u64, u64),
    maxh2cdata: usize,
    /// Commands completed on this connection, whether measured or not.
    completed: u64,
}

/// Everything about the namespace and the run the hot loop needs.
struct Plan {
    nsid: u32,
    workload: Workload,
    rwmixread: u64,
    io_size: u32,
    block_size: u32,
    blocks_per_io: u64,
    in_capsule_max: usize,
    verify: bool,
    pattern: Vec<u8>,
}

impl Plan {
    fn nlb(&self) -> u32 {
        self.blocks_per_io as u32
    }

    /// The bytes of block `lba` as `verify` writes them: magic, LBA, then the pattern.
    fn stamp(&self, data: &mut [u8], first_lba: u64) {
        if !self.verify {
            return;
        }
        for (i, block) in data.chunks_mut(self.block_size as usize).enumerate() {
            block[..8].copy_from_slice(&VERIFY_MAGIC.to_le_bytes());
            block[8..16].copy_from_slice(&(first_lba + i as u64).to_le_bytes());
        }
    }

    /// Counts blocks of `data` (read from `first_lba + offset`) that are neither
    /// never-written zeroes nor what `stamp` wrote.
    fn check(&self, data: &[u8], first_lba: u64) -> u64 {
        let bs = self.block_size as usize;
        data.chunks(bs)
            .enumerate()
            .filter(|(i, block)| {
                let stamped = block.len() == bs
                    && block[..8] == VERIFY_MAGIC.to_le_bytes()
                    && block[8..16] == (first_lba + *i as u64).to_le_bytes()
                    && block[16..] == self.pattern[16..bs];
                !stamped && block.iter().any(|&b| b != 0)
            })
            .count() as u64
    }
}

fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs a benchmark and returns its report.
pub fn run(o: &Options) -> Result<Report, String> {
    if o.queue_depth == 0 || o.connections == 0 {
        return Err("--qd and --connections must be at least 1".into());
    }
    let admin_opts = ConnectOptions { kato: 0, digests: o.digests, ..ConnectOptions::admin(&o.nqn, &o.hostnqn) };
    let mut admin = connect_admin(o.target, &admin_opts).map_err(|e| format!("connecting to {}: {e}", o.target))?;
    let ctrl = admin.identify_controller().map_err(|e| format!("Identify Controller: {e}"))?;
    let ns = admin.identify_namespace(o.nsid).map_err(|e| format!("Identify Namespace {}: {e}", o.nsid))?;
    if ns.nsze == 0 {
        return Err(format!("namespace {} does not exist on {}", o.nsid, o.nqn));
    }
    let block_size = identify::lba_format_block_size(ns.lbaf0);
    if o.io_size == 0 || !o.io_size.is_multiple_of(block_size) {
        return Err(format!("--bs {} must be a multiple of the namespace block size {block_size}", o.io_size));
    }
    if ctrl.mdts != 0 && u64::from(o.io_size) > 4096u64 << ctrl.mdts {
        return Err(format!(
            "--bs {} exceeds the target's largest transfer ({} bytes)",
            o.io_size,
            4096u64 << ctrl.mdts
        ));
    }
    let granted = admin.set_queue_count(o.connections as u16).map_err(|e| format!("Set Features: {e}"))?;
    if u32::from(granted) < o.connections {
        return Err(format!("the target grants {granted} I/O queues, fewer than --connections {}", o.connections));
    }
    let blocks = o.span.map_or(ns.nsze, |s| (s / u64::from(block_size)).min(ns.nsze));
    let blocks_per_io = u64::from(o.io_size / block_size);
    let mut pattern = vec![0u8; o.io_size as usize];
    let mut seed = 0x1234_5678_9abc_def1u64;
    for b in pattern.iter_mut() {
        *b = xorshift(&mut seed) as u8;
    }
    let plan = Plan {
        nsid: o.nsid,
        workload: o.workload,
        rwmixread: u64::from(o.rwmixread.min(100)),
        io_size: o.io_size,
        block_size,
        blocks_per_io,
        in_capsule_max: (ctrl.ioccsz as usize * 16).saturating_sub(64),
        verify: o.verify,
        pattern: if o.verify { stamped_pattern(&pattern, block_size) } else { pattern },
    };
    let sqsize = (o.queue_depth.max(2) - 1) as u16;
    let per_conn = (blocks / u64::from(o.connections)) / blocks_per_io * blocks_per_io;
    if per_conn < blocks_per_io {
        return Err("the namespace (or --span) is too small for this I/O size and connection count".into());
    }
    let mut conns = Vec::new();
    for i in 0..o.connections {
        let q = Queue::connect(
            o.target,
            &ConnectOptions {
                disable_sq_flow_control: !o.sq_flow_control,
                ..admin_opts.io(i as u16 + 1, admin.cntlid, sqsize)
            },
        )
        .map_err(|e| format!("connecting I/O queue {}: {e}", i + 1))?;
        let maxh2cdata = q.icresp.maxdata.max(tcp::MIN_MAXH2CDATA) as usize;
        let (stream, digests) = q.into_stream();
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        conns.push(Conn {
            stream,
            digests,
            rbuf: vec![0; 4 << 20],
            rstart: 0,
            rend: 0,
            wbuf: Vec::with_capacity(1 << 20),
            wsent: 0,
            slots: (0..o.queue_depth).map(|_| None).collect(),
            free: (0..o.queue_depth as u16).rev().collect(),
            rng: 0x9E37_79B9_7F4A_7C15 ^ u64::from(i + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
            cursor: 0,
            region: (u64::from(i) * per_conn, per_conn),
            maxh2cdata,
            completed: 0,
        });
    }
    let result = drive(&plan, &mut conns, o);
    drop(admin);
    let r = result?;
    Ok(Report { workload: o.workload, io_size: o.io_size, queue_depth: o.queue_depth, connections: o.connections, ..r })
}

/// The pattern with every block's tail fixed, so any block's tail can be checked
/// against `pattern[16..block_size]`.
fn stamped_pattern(p: &[u8], block_size: u32) -> Vec<u8> {
    let bs = block_size as usize;
    let tail = p[16..bs].to_vec();
    let mut out = p.to_vec();
    for block in out.chunks_mut(bs) {
        block[16..].copy_from_slice(&tail);
    }
    out
}

/// When a batch of PDUs arrived, and what phase the run is in.
#[derive(Clone, Copy)]
struct Tick {
    now: Instant,
    running: bool,
    measuring: bool,
}

#[derive(Default)]
struct Counters {
    ios: u64,
    bytes: u64,
    errors: u64,
    verify_failures: u64,
    hist: Histogram,
    /// I/Os and the slowest one since the timeline's window began.
    window_ios: u64,
    window_max_ns: u64,
}

/// CPU time the calling thread has used, in nanoseconds.
pub(crate) fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(0)
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn drive(plan: &Plan, conns: &mut [Conn], o: &Options) -> Result<Report, String> {
    let start = Instant::now();
    let measure_at = start + o.warmup;
    let end_at = measure_at + o.duration;
    let mut counters = Counters::default();
    let mut measuring = false;
    let mut running = true;
    let mut measure_start = start;
    let mut started_unix_s = 0.0;
    let mut cpu_start = 0;
    let mut measured_secs = 0.0;
    let mut cpu_secs = 0.0;
    for c in conns.iter_mut() {
        while let Some(cid) = c.free.pop() {
            c.submit(plan, cid, start);
        }
    }
    let mut pass: u32 = 0;
    let mut drain_deadline = None;
    let mut windows = Vec::new();
    let mut window_start = start;
    loop {
        let mut received = false;
        for c in conns.iter_mut() {
            c.flush()?;
            match c.stream.read(&mut c.rbuf[c.rend..]) {
                Ok(0) => return Err("the target closed a connection".into()),
                Ok(n) => {
                    received = true;
                    c.rend += n;
                    let t = Tick { now: Instant::now(), running, measuring };
                    c.process(plan, t, &mut counters)?;
                    c.flush()?;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => return Err(format!("socket: {e}")),
            }
        }
        let napped = !received && o.nap.is_some();
        if let (true, Some(nap)) = (napped, o.nap) {
            std::thread::sleep(nap);
        }
        // Busy, the clock is read every 64 passes; a pass that napped is long already.
        pass = pass.wrapping_add(1);
        if !napped && !pass.is_multiple_of(64) {
            continue;
        }
        let now = Instant::now();
        if !measuring && running && now >= measure_at {
            measuring = true;
            measure_start = now;
            started_unix_s = unix_now();
            cpu_start = thread_cpu_ns();
            counters = Counters::default();
            window_start = now;
        }
        if o.timeline.is_some_and(|w| measuring && now - window_start >= w) {
            let secs = (now - window_start).as_secs_f64();
            windows.push(Window {
                at_s: (window_start - measure_start).as_secs_f64(),
                iops: counters.window_ios as f64 / secs,
                max_us: counters.window_max_ns as f64 / 1000.0,
            });
            (counters.window_ios, counters.window_max_ns) = (0, 0);
            // The next window starts when this one's counts were taken, so a late
            // check (a nap, a busy pass) makes a longer window, never a wrong rate.
            window_start = now;
        }
        if running && now >= end_at {
            running = false;
            measuring = false;
            measured_secs = (now - measure_start).as_secs_f64();
            cpu_secs = (thread_cpu_ns() - cpu_start) as f64 / 1e9;
            drain_deadline = Some(now + Duration::from_secs(10));
        }
        if !running {
            if conns.iter().all(|c| c.free.len() == c.slots.len()) {
                break;
            }
            if drain_deadline.is_some_and(|d| now > d) {
                return Err("commands did not complete within 10 s after the run".into());
            }
        }
    }
    let h = &counters.hist;
    Ok(Report {
        workload: plan.workload,
        io_size: plan.io_size,
        queue_depth: 0,
        connections: 0,
        seconds: measured_secs,
        ios: counters.ios,
        commands: conns.iter().map(|c| c.completed).sum(),
        iops: counters.ios as f64 / measured_secs.max(1e-9),
        mib_per_s: counters.bytes as f64 / measured_secs.max(1e-9) / (1024.0 * 1024.0),
        latency: Latency::from_histogram(h),
        errors: counters.errors,
        verify_failures: counters.verify_failures,
        cpu_seconds: cpu_secs,
        timeline: windows,
        started_unix_s,
    })
}

impl Conn {
    fn next_io(&mut self, plan: &Plan) -> (bool, u64) {
        let (base, len) = self.region;
        let ios = len / plan.blocks_per_io;
        let write = match plan.workload {
            Workload::RandRead | Workload::Read => false,
            Workload::RandWrite | Workload::Write => true,
            Workload::RandRw => xorshift(&mut self.rng) % 100 >= plan.rwmixread,
        };
        let index = match plan.workload {
            Workload::Read | Workload::Write => {
                let i = self.cursor % ios;
                self.cursor += 1;
                i
            }
            _ => xorshift(&mut self.rng) % ios,
        };
        (write, base + index * plan.blocks_per_io)
    }

    fn submit(&mut self, plan: &Plan, cid: u16, now: Instant) {
        let (write, lba) = self.next_io(plan);
        let len = plan.io_size;
        let in_capsule = write && len as usize <= plan.in_capsule_max;
        let mut cmd = Command::read_write(
            if write { io_opcode::WRITE } else { io_opcode::READ },
            cid,
            plan.nsid,
            lba,
            plan.nlb(),
            len,
        );
        cmd.flags |= PSDT_SGL;
        if in_capsule {
            cmd.dptr = SglDescriptor { address: 0, length: len, id: sgl::IN_CAPSULE };
        }
        let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
        let n = tcp::encode_capsule_cmd(&cmd, if in_capsule { len as usize } else { 0 }, self.digests, &mut hdr);
        self.wbuf.extend_from_slice(&hdr[..n]);
        if in_capsule {
            self.append_data(plan, lba, 0, len as usize);
        }
        self.slots[usize::from(cid)] = Some(Slot { start: now, lba, write });
    }

    /// Appends write data `[offset, offset + len)` of the command at `lba`, and its
    /// digest when enabled.
    fn append_data(&mut self, plan: &Plan, lba: u64, offset: usize, len: usize) {
        let at = self.wbuf.len();
        self.wbuf.extend_from_slice(&plan.pattern[offset..offset + len]);
        plan.stamp(&mut self.wbuf[at..], lba + (offset / plan.block_size as usize) as u64);
        if self.digests.data {
            let crc = tcp::crc32c(&self.wbuf[at..]);
            self.wbuf.extend_from_slice(&crc.to_le_bytes());
        }
    }

    fn flush(&mut self) -> Result<(), String> {
        while self.wsent < self.wbuf.len() {
            match self.stream.write(&self.wbuf[self.wsent..]) {
                Ok(n) => self.wsent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(format!("socket: {e}")),
            }
        }
        self.wbuf.clear();
        self.wsent = 0;
        Ok(())
    }

    fn complete(&mut self, plan: &Plan, cid: u16, ok: bool, t: Tick, k: &mut Counters) {
        let Some(slot) = self.slots.get_mut(usize::from(cid)).and_then(Option::take) else { return };
        self.completed += 1;
        if t.measuring {
            let ns = (t.now - slot.start).as_nanos() as u64;
            k.hist.record(ns);
            k.ios += 1;
            k.bytes += u64::from(plan.io_size);
            k.window_ios += 1;
            k.window_max_ns = k.window_max_ns.max(ns);
        }
        if !ok {
            k.errors += 1;
        }
        if t.running {
            self.submit(plan, cid, t.now);
        } else {
            self.free.push(cid);
        }
    }

    fn process(&mut self, plan: &Plan, t: Tick, k: &mut Counters) -> Result<(), String> {
        let limits = DataLimits::uniform(self.rbuf.len() as u32);
        loop {
            let parsed = tcp::parse(&self.rbuf[self.rstart..self.rend], self.digests, limits)
                .map_err(|e| format!("malformed PDU from the target: {e}"))?;
            let Some(p) = parsed else { break };
            let len = p.len;
            let mut done = None;
            let mut r2t = None;
            match p.pdu {
                Pdu::C2HData { header, success, data, .. } => {
                    if !p.data_digest_ok {
                        k.errors += 1;
                    }
                    if let (true, Some(Some(slot))) = (plan.verify, self.slots.get(usize::from(header.cccid))) {
                        let first = slot.lba + u64::from(header.offset / plan.block_size);
                        k.verify_failures += plan.check(data, first);
                    }
                    if success {
                        done = Some((header.cccid, true));
                    }
                }
                Pdu::CapsuleResp(c) => done = Some((c.cid, c.status.is_success())),
                Pdu::R2T(h) => r2t = Some(h),
                Pdu::TermReq { fes, fei, .. } => {
                    return Err(format!("the target terminated the connection (fes {fes:#x}, fei {fei:#x})"));
                }
                _ => return Err("unexpected PDU from the target".into()),
            }
            self.rstart += len;
            if let Some((cid, ok)) = done {
                self.complete(plan, cid, ok, t, k);
            }
            if let Some(h) = r2t {
                self.answer_r2t(plan, h)?;
            }
        }
        // Compacting only past half the buffer keeps copies rare under load.
        if self.rstart == self.rend || self.rstart > self.rbuf.len() / 2 {
            compact(&mut self.rbuf, &mut self.rstart, &mut self.rend);
        }
        Ok(())
    }

    fn answer_r2t(&mut self, plan: &Plan, h: DataHeader) -> Result<(), String> {
        let lba = match self.slots.get(usize::from(h.cccid)) {
            Some(Some(s)) if s.write => s.lba,
            _ => return Err(format!("R2T for command {} that is not a pending write", h.cccid)),
        };
        let (start, end) = (h.offset as usize, (h.offset + h.length) as usize);
        if end > plan.io_size as usize {
            return Err("R2T beyond the write's data".into());
        }
        let mut off = start;
        while off < end {
            let n = (end - off).min(self.maxh2cdata);
            let dh = DataHeader { cccid: h.cccid, ttag: h.ttag, offset: off as u32, length: n as u32 };
            let mut hdr = [0u8; 32];
            let hl = tcp::encode_h2c_data(&dh, off + n == end, self.digests, &mut hdr);
            self.wbuf.extend_from_slice(&hdr[..hl]);
            self.append_data(plan, lba, off, n);
            off += n;
        }
        Ok(())
    }
}

//! A small blocking NVMe/TCP initiator.
//!
//! It drives any NVMe/TCP target through a socket: ICReq, Fabrics Connect, Property
//! Get/Set, admin and I/O commands with in-capsule data, R2T/H2CData and C2HData. It
//! exists for nvpool's own tests and tools; interoperability is proven against the
//! Linux host, never by this crate alone.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use nvpool_wire::Status;
use nvpool_wire::command::{
    Command, Completion, DSM_ATTR_DEALLOCATE, DSM_RANGE_SIZE, DsmRange, PSDT_SGL, SglDescriptor, admin_opcode,
    io_opcode, sgl,
};
use nvpool_wire::fabrics::{
    CNTLID_DYNAMIC, CONNECT_DATA_SIZE, ConnectCommand, ConnectData, PropertyAccess, cc, csts, property,
};
use nvpool_wire::identify::{IdentifyController, IdentifyNamespace};
use nvpool_wire::reservation::{
    Acquire, AcquireData, Register, RegisterData, Release, ReleaseData, Report, ReservationStatus,
};
use nvpool_wire::tcp::{self, DataHeader, Digests, IcReq, IcResp, Pdu};
use thiserror::Error;

mod auth;
pub mod tls;
pub use auth::HostAuth;

/// Errors of the initiator.
#[derive(Debug, Error)]
pub enum Error {
    /// The socket failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The target broke the protocol.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The target sent a termination request.
    #[error("target terminated the connection: fes {fes:#x} fei {fei:#x}")]
    Terminated {
        /// Fatal Error Status.
        fes: u16,
        /// Fatal Error Information.
        fei: u32,
    },
    /// A command failed.
    #[error("command failed: {0}")]
    Command(Status),
    /// Authentication could not go on (a wrong value from the target).
    #[error("authentication: {0}")]
    Auth(String),
    /// The target refused the host's authentication (FAILURE1, with its explanation).
    #[error("the target refused authentication (explanation {0:#04x})")]
    AuthRefused(u8),
}

/// Options of one queue connection.
#[derive(Clone, Debug)]
pub struct ConnectOptions {
    /// Subsystem NQN.
    pub subnqn: String,
    /// Host NQN.
    pub hostnqn: String,
    /// Host ID.
    pub hostid: [u8; 16],
    /// Queue ID (0 = admin).
    pub qid: u16,
    /// Controller ID for I/O queues (from the admin Connect).
    pub cntlid: u16,
    /// Queue size, 0's based.
    pub sqsize: u16,
    /// Keep Alive Timeout in ms (admin queue).
    pub kato: u32,
    /// Digests to ask for.
    pub digests: Digests,
    /// Ask the target to skip SQ flow control (allows C2HData SUCCESS).
    pub disable_sq_flow_control: bool,
    /// Secrets to authenticate with when the target asks (DH-HMAC-CHAP).
    pub auth: Option<HostAuth>,
}

impl ConnectOptions {
    /// Admin queue options with common defaults.
    pub fn admin(subnqn: &str, hostnqn: &str) -> ConnectOptions {
        ConnectOptions {
            subnqn: subnqn.into(),
            hostnqn: hostnqn.into(),
            hostid: [7; 16],
            qid: 0,
            cntlid: CNTLID_DYNAMIC,
            sqsize: 31,
            kato: 30_000,
            digests: Digests::default(),
            disable_sq_flow_control: false,
            auth: None,
        }
    }

    /// Options for I/O queue `qid` of the controller `cntlid`, from admin options.
    pub fn io(&self, qid: u16, cntlid: u16, sqsize: u16) -> ConnectOptions {
        ConnectOptions { qid, cntlid, sqsize, kato: 0, ..self.clone() }
    }
}

/// What a completed command returned.
#[derive(Debug, Clone)]
pub struct Reply {
    /// The completion (synthesised when the target used the C2HData SUCCESS flag).
    pub cqe: Completion,
    /// Controller-to-host data.
    pub data: Vec<u8>,
}

/// A PDU from the target, owned.
#[derive(Debug)]
pub enum TargetPdu {
    /// ICResp.
    IcResp(IcResp),
    /// CapsuleResp.
    Resp(Completion),
    /// C2HData.
    Data {
        /// Header.
        header: DataHeader,
        /// SUCCESS flag.
        success: bool,
        /// Data.
        data: Vec<u8>,
    },
    /// R2T.
    R2T(DataHeader),
    /// C2HTermReq.
    Term {
        /// Fatal Error Status.
        fes: u16,
        /// Fatal Error Information.
        fei: u32,
    },
}

/// One queue connection to a target.
pub struct Queue {
    stream: TcpStream,
    digests: Digests,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    next_cid: u16,
    /// Controller ID the Connect returned.
    pub cntlid: u16,
    /// The target's ICResp.
    pub icresp: IcResp,
    pending_writes: HashMap<u16, Vec<u8>>,
    reads: HashMap<u16, Vec<u8>>,
    qid: u16,
    /// Whether the target asked this queue to authenticate (Connect DW0 bit 17).
    pub auth_required: bool,
    transaction: u16,
}

impl Queue {
    /// Opens a TCP connection and performs ICReq/ICResp only.
    pub fn handshake(addr: SocketAddr, digests: Digests) -> Result<Queue, Error> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut q = Queue {
            stream,
            digests: Digests::default(),
            buf: vec![0; 1 << 20],
            start: 0,
            end: 0,
            next_cid: 1,
            cntlid: 0,
            icresp: IcResp::default(),
            pending_writes: HashMap::new(),
            reads: HashMap::new(),
            qid: 0,
            auth_required: false,
            transaction: 0,
        };
        let mut b = [0u8; tcp::IC_SIZE];
        tcp::encode_ic_req(&IcReq { pfv: 0, hpda: 0, digests, maxr2t: 0 }, &mut b);
        q.stream.write_all(&b)?;
        match q.recv_pdu()? {
            TargetPdu::IcResp(r) => {
                if r.digests != digests {
                    return Err(Error::Protocol(format!("ICResp digests {:?} do not echo {:?}", r.digests, digests)));
                }
                q.icresp = r;
                q.digests = digests;
                Ok(q)
            }
            other => Err(Error::Protocol(format!("expected ICResp, got {other:?}"))),
        }
    }

    /// Handshake and Fabrics Connect.
    pub fn connect(addr: SocketAddr, o: &ConnectOptions) -> Result<Queue, Error> {
        let mut q = Queue::handshake(addr, o.digests)?;
        q.qid = o.qid;
        let cattr = if o.disable_sq_flow_control { 1 << 2 } else { 0 };
        let c = ConnectCommand { recfmt: 0, qid: o.qid, sqsize: o.sqsize, cattr, kato: o.kato };
        let mut data = [0u8; CONNECT_DATA_SIZE];
        ConnectData { hostid: o.hostid, cntlid: o.cntlid, subnqn: o.subnqn.clone(), hostnqn: o.hostnqn.clone() }
            .encode(&mut data);
        let cid = q.alloc_cid();
        let r = q.execute_raw(c.to_command(cid), &data, true)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        q.cntlid = r.cqe.result as u16;
        q.auth_required = r.cqe.result & nvpool_wire::auth::CONNECT_AUTH_REQUIRED != 0;
        if q.auth_required
            && let Some(a) = &o.auth
        {
            q.authenticate(a, &o.hostnqn, &o.subnqn)?;
        }
        Ok(q)
    }

    /// Gives up the queue's socket once connected, for a caller that drives I/O itself
    /// (nothing is left unread after Connect).
    pub fn into_stream(self) -> (TcpStream, Digests) {
        (self.stream, self.digests)
    }

    /// The socket, for tests that misbehave on purpose.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Negotiated digests.
    pub fn digests(&self) -> Digests {
        self.digests
    }

    /// A fresh command ID.
    pub fn alloc_cid(&mut self) -> u16 {
        let c = self.next_cid;
        self.next_cid = self.next_cid.wrapping_add(1).max(1);
        c
    }

    /// Sends a command capsule. Host-to-controller data goes in the capsule when
    /// `in_capsule`, else it is kept for the target's R2T.
    pub fn submit(&mut self, mut cmd: Command, data: &[u8], in_capsule: bool) -> Result<u16, Error> {
        cmd.flags |= PSDT_SGL;
        if !data.is_empty() {
            cmd.dptr = SglDescriptor {
                address: 0,
                length: data.len() as u32,
                id: if in_capsule { sgl::IN_CAPSULE } else { sgl::TRANSPORT },
            };
        }
        let inline = if in_capsule { data } else { &[][..] };
        let mut hdr = [0u8; tcp::MAX_HEADER_SIZE];
        let n = tcp::encode_capsule_cmd(&cmd, inline.len(), self.digests, &mut hdr);
        let mut wire = hdr[..n].to_vec();
        wire.extend_from_slice(inline);
        if self.digests.data && !inline.is_empty() {
            wire.extend_from_slice(&tcp::crc32c(inline).to_le_bytes());
        }
        self.stream.write_all(&wire)?;
        if !in_capsule && !data.is_empty() {
            self.pending_writes.insert(cmd.cid, data.to_vec());
        }
        Ok(cmd.cid)
    }

    /// Waits for the next command to complete, answering R2Ts on the way.
    pub fn next_reply(&mut self) -> Result<Reply, Error> {
        loop {
            match self.recv_pdu()? {
                TargetPdu::Resp(cqe) => {
                    self.pending_writes.remove(&cqe.cid);
                    let data = self.reads.remove(&cqe.cid).unwrap_or_default();
                    return Ok(Reply { cqe, data });
                }
                TargetPdu::Data { header, success, data } => {
                    let buf = self.reads.entry(header.cccid).or_default();
                    let end = header.offset as usize + data.len();
                    if buf.len() < end {
                        buf.resize(end, 0);
                    }
                    buf[header.offset as usize..end].copy_from_slice(&data);
                    if success {
                        let cqe = Completion { cid: header.cccid, sqid: self.qid, ..Completion::default() };
                        let data = self.reads.remove(&header.cccid).unwrap_or_default();
                        return Ok(Reply { cqe, data });
                    }
                }
                TargetPdu::R2T(h) => self.answer_r2t(h)?,
                TargetPdu::Term { fes, fei } => return Err(Error::Terminated { fes, fei }),
                TargetPdu::IcResp(_) => return Err(Error::Protocol("unexpected ICResp".into())),
            }
        }
    }

    fn answer_r2t(&mut self, h: DataHeader) -> Result<(), Error> {
        let data = self
            .pending_writes
            .get(&h.cccid)
            .ok_or_else(|| Error::Protocol(format!("R2T for unknown command {}", h.cccid)))?;
        let start = h.offset as usize;
        let end = start + h.length as usize;
        if end > data.len() {
            return Err(Error::Protocol("R2T beyond the command's data".into()));
        }
        let max = self.icresp.maxdata.max(tcp::MIN_MAXH2CDATA) as usize;
        let mut wire = Vec::with_capacity(h.length as usize + 64);
        let mut off = start;
        while off < end {
            let n = (end - off).min(max);
            let dh = DataHeader { cccid: h.cccid, ttag: h.ttag, offset: off as u32, length: n as u32 };
            let mut hdr = [0u8; 32];
            let hl = tcp::encode_h2c_data(&dh, off + n == end, self.digests, &mut hdr);
            wire.extend_from_slice(&hdr[..hl]);
            wire.extend_from_slice(&data[off..off + n]);
            if self.digests.data {
                wire.extend_from_slice(&tcp::crc32c(&data[off..off + n]).to_le_bytes());
            }
            off += n;
        }
        self.stream.write_all(&wire)?;
        Ok(())
    }

    /// Submits one command and waits for it.
    pub fn execute_raw(&mut self, cmd: Command, data: &[u8], in_capsule: bool) -> Result<Reply, Error> {
        let cid = self.submit(cmd, data, in_capsule)?;
        let r = self.next_reply()?;
        if r.cqe.cid != cid {
            return Err(Error::Protocol(format!("reply for command {} while waiting for {cid}", r.cqe.cid)));
        }
        Ok(r)
    }

    /// Executes a command that reads `len` bytes (or none); fails on an error status.
    pub fn execute(&mut self, mut cmd: Command, len: u32) -> Result<Reply, Error> {
        cmd.cid = self.alloc_cid();
        cmd.dptr = SglDescriptor { address: 0, length: len, id: sgl::TRANSPORT };
        let r = self.execute_raw(cmd, &[], false)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        Ok(r)
    }

    /// Reads the next PDU from the target.
    pub fn recv_pdu(&mut self) -> Result<TargetPdu, Error> {
        loop {
            let parsed = tcp::parse(&self.buf[self.start..self.end], self.digests, tcp::DataLimits::uniform(1 << 20))
                .map_err(|e| Error::Protocol(format!("malformed PDU from the target: {e}")))?;
            if let Some(p) = parsed {
                if !p.data_digest_ok {
                    return Err(Error::Protocol("data digest mismatch from the target".into()));
                }
                let pdu = match p.pdu {
                    Pdu::IcResp(r) => TargetPdu::IcResp(r),
                    Pdu::CapsuleResp(c) => TargetPdu::Resp(c),
                    Pdu::C2HData { header, success, data, .. } => {
                        TargetPdu::Data { header, success, data: data.to_vec() }
                    }
                    Pdu::R2T(h) => TargetPdu::R2T(h),
                    Pdu::TermReq { fes, fei, .. } => TargetPdu::Term { fes, fei },
                    other => {
                        return Err(Error::Protocol(format!("unexpected PDU from a target: {other:?}")));
                    }
                };
                self.start += p.len;
                return Ok(pdu);
            }
            if self.start > 0 {
                nvpool_wire::bytes::compact(&mut self.buf, &mut self.start, &mut self.end);
            }
            let n = self.stream.read(&mut self.buf[self.end..])?;
            if n == 0 {
                return Err(Error::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            self.end += n;
        }
    }

    /// Property Get.
    pub fn property_get(&mut self, offset: u32, eight_bytes: bool) -> Result<u64, Error> {
        let cid = self.alloc_cid();
        let r =
            self.execute_raw(PropertyAccess { eight_bytes, offset, value: 0 }.to_command(cid, false), &[], false)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        Ok(u64::from(r.cqe.result) | u64::from(r.cqe.result_hi) << 32)
    }

    /// Property Set.
    pub fn property_set(&mut self, offset: u32, value: u64) -> Result<(), Error> {
        let cid = self.alloc_cid();
        let r =
            self.execute_raw(PropertyAccess { eight_bytes: false, offset, value }.to_command(cid, true), &[], false)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        Ok(())
    }

    /// Enables the controller (CC.EN with standard entry sizes) and waits for RDY.
    pub fn enable(&mut self) -> Result<(), Error> {
        self.property_set(property::CC, u64::from(cc::EN | 6 << 16 | 4 << 20))?;
        for _ in 0..100 {
            if self.property_get(property::CSTS, false)? as u32 & csts::RDY != 0 {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(Error::Protocol("controller never became ready".into()))
    }

    /// Identify Controller.
    pub fn identify_controller(&mut self) -> Result<IdentifyController, Error> {
        let c = Command { opcode: admin_opcode::IDENTIFY, cdw: [1, 0, 0, 0, 0, 0], ..Command::default() };
        let r = self.execute(c, 4096)?;
        IdentifyController::decode(&r.data).ok_or_else(|| Error::Protocol("short Identify Controller".into()))
    }

    /// Identify Namespace.
    pub fn identify_namespace(&mut self, nsid: u32) -> Result<IdentifyNamespace, Error> {
        let c = Command { opcode: admin_opcode::IDENTIFY, nsid, ..Command::default() };
        let r = self.execute(c, 4096)?;
        IdentifyNamespace::decode(&r.data).ok_or_else(|| Error::Protocol("short Identify Namespace".into()))
    }

    /// Set Features Number of Queues; returns how many I/O queues were granted.
    pub fn set_queue_count(&mut self, n: u16) -> Result<u16, Error> {
        let v = u32::from(n - 1) | u32::from(n - 1) << 16;
        let c = Command { opcode: admin_opcode::SET_FEATURES, cdw: [0x07, v, 0, 0, 0, 0], ..Command::default() };
        let r = self.execute(c, 0)?;
        Ok((r.cqe.result & 0xFFFF) as u16 + 1)
    }

    /// Reads `nlb` blocks of `block_size` bytes.
    pub fn read(&mut self, nsid: u32, slba: u64, nlb: u32, block_size: u32) -> Result<Vec<u8>, Error> {
        let len = nlb * block_size;
        let cid = self.alloc_cid();
        let r = self.execute_raw(Command::read_write(io_opcode::READ, cid, nsid, slba, nlb, len), &[], false)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        Ok(r.data)
    }

    /// Writes `data` (whole blocks) at `slba`, in the capsule when it fits
    /// `in_capsule_max`, else through R2T.
    pub fn write(
        &mut self,
        nsid: u32,
        slba: u64,
        data: &[u8],
        block_size: u32,
        in_capsule_max: usize,
    ) -> Result<(), Error> {
        let nlb = (data.len() / block_size as usize) as u32;
        let cid = self.alloc_cid();
        let cmd = Command::read_write(io_opcode::WRITE, cid, nsid, slba, nlb, data.len() as u32);
        let r = self.execute_raw(cmd, data, data.len() <= in_capsule_max)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        Ok(())
    }
}

impl Queue {
    /// Flushes namespace `nsid` (every completed write made durable).
    pub fn flush(&mut self, nsid: u32) -> Result<(), Error> {
        self.execute(Command { opcode: io_opcode::FLUSH, nsid, ..Command::default() }, 0).map(|_| ())
    }

    /// Deallocates `nlb` blocks at `slba` with one Dataset Management range; returns
    /// the command's status.
    pub fn deallocate(&mut self, nsid: u32, slba: u64, nlb: u32) -> Result<Status, Error> {
        let mut range = [0u8; DSM_RANGE_SIZE];
        DsmRange { attributes: 0, nlb, slba }.encode(&mut range);
        let cid = self.alloc_cid();
        let cdw11 = DSM_ATTR_DEALLOCATE;
        let dsm = Command {
            opcode: io_opcode::DATASET_MANAGEMENT,
            cid,
            nsid,
            cdw: [0, cdw11, 0, 0, 0, 0],
            ..Command::default()
        };
        Ok(self.execute_raw(dsm, &range, true)?.cqe.status)
    }
}

impl Queue {
    /// Reservation Register with its keys; returns the command's status.
    pub fn reservation_register(
        &mut self,
        nsid: u32,
        fields: Register,
        data: RegisterData,
        in_capsule: bool,
    ) -> Result<Status, Error> {
        let mut cmd = Command { nsid, cid: self.alloc_cid(), ..Command::default() };
        fields.apply(&mut cmd);
        Ok(self.execute_raw(cmd, &data.to_vec(), in_capsule)?.cqe.status)
    }

    /// Reservation Acquire with its keys; returns the command's status.
    pub fn reservation_acquire(&mut self, nsid: u32, fields: Acquire, data: AcquireData) -> Result<Status, Error> {
        let mut cmd = Command { nsid, cid: self.alloc_cid(), ..Command::default() };
        fields.apply(&mut cmd);
        Ok(self.execute_raw(cmd, &data.to_vec(), true)?.cqe.status)
    }

    /// Reservation Release with its key; returns the command's status.
    pub fn reservation_release(&mut self, nsid: u32, fields: Release, data: ReleaseData) -> Result<Status, Error> {
        let mut cmd = Command { nsid, cid: self.alloc_cid(), ..Command::default() };
        fields.apply(&mut cmd);
        Ok(self.execute_raw(cmd, &data.to_vec(), true)?.cqe.status)
    }

    /// Reservation Report in its extended form (`len` bytes).
    pub fn reservation_report(&mut self, nsid: u32, len: usize) -> Result<ReservationStatus, Error> {
        let mut cmd = Command { nsid, ..Command::default() };
        Report { len, extended: true }.apply(&mut cmd);
        let r = self.execute(cmd, len as u32)?;
        ReservationStatus::decode_extended(&r.data)
            .ok_or_else(|| Error::Protocol(format!("a reservation report of {} bytes", r.data.len())))
    }
}

/// Deterministic pseudo-random test data: the same seed gives the same bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An admin queue connected and enabled, ready for commands.
pub fn connect_admin(addr: SocketAddr, o: &ConnectOptions) -> Result<Queue, Error> {
    let mut q = Queue::connect(addr, o)?;
    q.enable()?;
    Ok(q)
}

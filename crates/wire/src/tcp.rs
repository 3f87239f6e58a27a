//! NVMe/TCP PDUs (NVMe/TCP Transport Specification 1.0 §3.6) and their digests.
//!
//! Receivers call [`parse`] on the bytes they have; it returns `Ok(None)` until a
//! whole PDU is there, then the decoded PDU and its length. Anything malformed is a
//! [`FatalError`] carrying the Fatal Error Status and Information the spec asks a
//! receiver to report in a termination request before it closes the connection.

use crate::bytes::{get_u16, get_u32, put_u16, put_u32};
use crate::command::{CQE_SIZE, Command, Completion, SQE_SIZE};

/// PDU types (NVMe/TCP 1.0 Figure 16).
pub mod pdu_type {
    /// Initialize Connection Request.
    pub const IC_REQ: u8 = 0x00;
    /// Initialize Connection Response.
    pub const IC_RESP: u8 = 0x01;
    /// Host to controller termination request.
    pub const H2C_TERM_REQ: u8 = 0x02;
    /// Controller to host termination request.
    pub const C2H_TERM_REQ: u8 = 0x03;
    /// Command capsule.
    pub const CAPSULE_CMD: u8 = 0x04;
    /// Response capsule.
    pub const CAPSULE_RESP: u8 = 0x05;
    /// Host to controller data.
    pub const H2C_DATA: u8 = 0x06;
    /// Controller to host data.
    pub const C2H_DATA: u8 = 0x07;
    /// Ready to transfer.
    pub const R2T: u8 = 0x09;
}

/// Common header flags (NVMe/TCP 1.0 Figure 15).
pub mod flags {
    /// A header digest follows the header.
    pub const HDGST: u8 = 1 << 0;
    /// A data digest follows the data.
    pub const DDGST: u8 = 1 << 1;
    /// Last data PDU of the transfer (H2CData, C2HData).
    pub const DATA_LAST: u8 = 1 << 2;
    /// C2HData only: the command succeeded; no response capsule follows.
    pub const DATA_SUCCESS: u8 = 1 << 3;
}

/// Size of the common header.
pub const CH_SIZE: usize = 8;
/// Size of ICReq and ICResp.
pub const IC_SIZE: usize = 128;
/// Header length of a command capsule.
pub const CAPSULE_CMD_HLEN: usize = CH_SIZE + SQE_SIZE;
/// Header length of a response capsule.
pub const CAPSULE_RESP_HLEN: usize = CH_SIZE + CQE_SIZE;
/// Header length of H2CData, C2HData and R2T.
pub const DATA_HLEN: usize = 24;
/// Header length of the termination requests.
pub const TERM_REQ_HLEN: usize = 24;
/// Largest termination request: the header plus up to 128 bytes of the offending PDU
/// header (NVMe/TCP 1.0 §3.6.2.9).
pub const TERM_REQ_MAX: usize = 152;
/// Size of a digest.
pub const DIGEST_SIZE: usize = 4;
/// The smallest MAXH2CDATA a controller may advertise.
pub const MIN_MAXH2CDATA: u32 = 4096;

// PDU header sizes fixed by NVMe/TCP 1.0 §3.6.
const _: () = assert!(CAPSULE_CMD_HLEN == 72 && CAPSULE_RESP_HLEN == 24 && IC_SIZE == 128);

/// Fatal Error Status values of termination requests (NVMe/TCP 1.0 Figure 33).
pub mod fes {
    /// Invalid PDU header field.
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    /// PDU sequence error.
    pub const PDU_SEQUENCE_ERROR: u16 = 0x02;
    /// Header digest error.
    pub const HEADER_DIGEST_ERROR: u16 = 0x03;
    /// Data transfer out of range.
    pub const DATA_OUT_OF_RANGE: u16 = 0x04;
    /// Data transfer limit exceeded.
    pub const DATA_LIMIT_EXCEEDED: u16 = 0x05;
    /// Unsupported parameter.
    pub const UNSUPPORTED_PARAMETER: u16 = 0x06;
}

/// Byte offsets of the fields of an H2CData or C2HData header, which a C2HTermReq's
/// FEI names when one of them is wrong (NVMe/TCP transport 3.6.2.8).
pub mod data_field {
    /// Command Capsule CID.
    pub const CCCID: u32 = 8;
    /// Transfer Tag.
    pub const TTAG: u32 = 10;
    /// Data Length.
    pub const DATAL: u32 = 16;
}

/// CRC32C as NVMe/TCP header and data digests use it.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// Extends a CRC32C over more data (for data split across buffers).
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// Which digests a connection negotiated in ICReq/ICResp.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    /// Header digests on every PDU after IC.
    pub header: bool,
    /// Data digests on every PDU carrying data.
    pub data: bool,
}

impl Digests {
    /// From the ICReq/ICResp digest byte.
    pub fn from_bits(b: u8) -> Digests {
        Digests { header: b & 1 != 0, data: b & 2 != 0 }
    }

    /// To the ICReq/ICResp digest byte.
    pub fn bits(self) -> u8 {
        u8::from(self.header) | u8::from(self.data) << 1
    }

    fn header_len(self) -> usize {
        if self.header { DIGEST_SIZE } else { 0 }
    }
}

/// A fatal transport error: the receiver sends a termination request with these
/// values and closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FatalError {
    /// Fatal Error Status.
    pub fes: u16,
    /// Fatal Error Information: for header field errors, the byte offset of the field.
    pub fei: u32,
    /// What was wrong, for logs.
    pub reason: &'static str,
}

impl FatalError {
    fn field(offset: u32, reason: &'static str) -> FatalError {
        FatalError { fes: fes::INVALID_HEADER_FIELD, fei: offset, reason }
    }
}

impl std::fmt::Display for FatalError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (fes {:#x}, fei {:#x})", self.reason, self.fes, self.fei)
    }
}

impl std::error::Error for FatalError {}

/// ICReq fields (NVMe/TCP 1.0 Figure 26).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version: 0.
    pub pfv: u16,
    /// Host PDU data alignment, in dwords, 0's based.
    pub hpda: u8,
    /// Digests the host asks for.
    pub digests: Digests,
    /// Maximum outstanding R2Ts per command, 0's based.
    pub maxr2t: u32,
}

/// ICResp fields (NVMe/TCP 1.0 Figure 27).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IcResp {
    /// PDU format version: 0.
    pub pfv: u16,
    /// Controller PDU data alignment.
    pub cpda: u8,
    /// Digests enabled: the host's choice, echoed.
    pub digests: Digests,
    /// Maximum H2C data per PDU (MAXH2CDATA).
    pub maxdata: u32,
}

/// The header of H2CData, C2HData and R2T (same layout; `ttag` is reserved in C2HData).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataHeader {
    /// The command capsule's command ID.
    pub cccid: u16,
    /// Transfer tag (H2CData, R2T).
    pub ttag: u16,
    /// Offset of this data in the command's buffer.
    pub offset: u32,
    /// Length of this data.
    pub length: u32,
}

/// A decoded PDU; data fields borrow from the receive buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// Initialize Connection Request.
    IcReq(IcReq),
    /// Initialize Connection Response.
    IcResp(IcResp),
    /// Termination request from either side, with the offending header it carries.
    TermReq {
        /// Whether the controller sent it (C2HTermReq).
        from_controller: bool,
        /// Fatal Error Status.
        fes: u16,
        /// Fatal Error Information.
        fei: u32,
    },
    /// Command capsule with its in-capsule data (possibly empty).
    CapsuleCmd {
        /// The SQE.
        command: Command,
        /// In-capsule data.
        data: &'a [u8],
    },
    /// Response capsule.
    CapsuleResp(Completion),
    /// Host to controller data.
    H2CData {
        /// Header fields.
        header: DataHeader,
        /// Whether this is the last PDU of the transfer.
        last: bool,
        /// The data.
        data: &'a [u8],
    },
    /// Controller to host data.
    C2HData {
        /// Header fields.
        header: DataHeader,
        /// Whether this is the last PDU of the transfer.
        last: bool,
        /// Whether the command completed successfully (no response capsule follows).
        success: bool,
        /// The data.
        data: &'a [u8],
    },
    /// Ready to transfer.
    R2T(DataHeader),
}

/// A whole PDU found at the start of a buffer.
#[derive(Debug, PartialEq, Eq)]
pub struct Parsed<'a> {
    /// The PDU.
    pub pdu: Pdu<'a>,
    /// Bytes the PDU occupies; the next PDU starts there.
    pub len: usize,
    /// False if the data digest did not match. The PDU is still delimited; the
    /// receiver fails the command with a transient transport error.
    pub data_digest_ok: bool,
}

/// Fixed header length of each PDU type, or `None` for an unknown type.
fn expected_hlen(pdu_type: u8) -> Option<usize> {
    match pdu_type {
        pdu_type::IC_REQ | pdu_type::IC_RESP => Some(IC_SIZE),
        pdu_type::H2C_TERM_REQ | pdu_type::C2H_TERM_REQ => Some(TERM_REQ_HLEN),
        pdu_type::CAPSULE_CMD => Some(CAPSULE_CMD_HLEN),
        pdu_type::CAPSULE_RESP => Some(CAPSULE_RESP_HLEN),
        pdu_type::H2C_DATA | pdu_type::C2H_DATA | pdu_type::R2T => Some(DATA_HLEN),
        _ => None,
    }
}

/// The most data a receiver accepts in one PDU, checked as soon as the header is in,
/// so a hostile length cannot make the receiver buffer without limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataLimits {
    /// In-capsule data of a command capsule.
    pub capsule: u32,
    /// Data of one H2CData or C2HData PDU.
    pub data_pdu: u32,
    /// Alignment of the data in a PDU (PDO), in bytes: what the receiver asked for
    /// in the IC exchange, see [`pdu_data_alignment`].
    pub alignment: u32,
}

impl DataLimits {
    /// The same limit for every PDU type, with the alignment of a PDA of 0.
    pub const fn uniform(max: u32) -> DataLimits {
        DataLimits { capsule: max, data_pdu: max, alignment: pdu_data_alignment(0) }
    }
}

/// The PDU data alignment in bytes for an HPDA or CPDA: a 0's based count of dwords
/// (NVMe/TCP 1.0 §3.6.2.2), so even a PDA of 0 asks for dword-aligned data.
pub const fn pdu_data_alignment(pda: u8) -> u32 {
    (pda as u32 + 1) * 4
}

/// Parses the PDU at the start of `buf`.
///
/// `digests` are the connection's negotiated digests (none before ICReq/ICResp);
/// `limits` bound the data a PDU may carry.
pub fn parse(buf: &[u8], digests: Digests, limits: DataLimits) -> Result<Option<Parsed<'_>>, FatalError> {
    if buf.len() < CH_SIZE {
        return Ok(None);
    }
    let (ty, fl, hlen, pdo, plen) = (buf[0], buf[1], usize::from(buf[2]), usize::from(buf[3]), get_u32(buf, 4));
    let want_hlen = expected_hlen(ty).ok_or(FatalError::field(0, "unknown PDU type"))?;
    if hlen != want_hlen {
        return Err(FatalError::field(2, "header length does not match the PDU type"));
    }
    let is_ic = matches!(ty, pdu_type::IC_REQ | pdu_type::IC_RESP);
    let is_term = matches!(ty, pdu_type::H2C_TERM_REQ | pdu_type::C2H_TERM_REQ);
    // Termination requests never carry digests, so that a peer can always read them.
    let hd = if is_ic || is_term { 0 } else { digests.header_len() };
    if !is_ic && !is_term && (fl & flags::HDGST != 0) != digests.header {
        return Err(FatalError::field(1, "header digest flag does not match the negotiated digests"));
    }
    let plen = plen as usize;
    // Checked before waiting for the whole PDU: a wrong length must be answered at
    // once, not taken as a promise of more bytes.
    if is_ic && plen != IC_SIZE {
        return Err(FatalError::field(4, "IC PDU length must be 128"));
    }
    if is_term {
        if plen < hlen || plen > TERM_REQ_MAX {
            return Err(FatalError::field(4, "termination request length out of range"));
        }
    } else if plen < hlen + hd {
        return Err(FatalError::field(4, "PDU length shorter than its header"));
    }
    let carries_data =
        matches!(ty, pdu_type::CAPSULE_CMD | pdu_type::H2C_DATA | pdu_type::C2H_DATA) && plen > hlen + hd;
    let (data_start, data_len, dd) = if carries_data {
        let dd = if fl & flags::DDGST != 0 { DIGEST_SIZE } else { 0 };
        if (dd != 0) != digests.data {
            return Err(FatalError::field(1, "data digest flag does not match the negotiated digests"));
        }
        if pdo < hlen + hd || pdo + dd > plen {
            return Err(FatalError::field(3, "PDU data offset out of range"));
        }
        if !(pdo as u32).is_multiple_of(limits.alignment.max(1)) {
            return Err(FatalError::field(3, "PDU data offset not aligned as the IC exchange set"));
        }
        (pdo, plen - pdo - dd, dd)
    } else {
        // A termination request is read whatever its PDO says: the peer is closing anyway.
        if pdo != 0 && !is_ic && !is_term {
            return Err(FatalError::field(3, "PDU data offset set on a PDU without data"));
        }
        if !is_ic && !is_term && plen != hlen + hd {
            return Err(FatalError::field(4, "PDU length does not match a PDU without data"));
        }
        (plen, 0, 0)
    };
    let max_data = if ty == pdu_type::CAPSULE_CMD { limits.capsule } else { limits.data_pdu };
    if data_len > max_data as usize {
        return Err(FatalError {
            fes: fes::DATA_LIMIT_EXCEEDED,
            fei: 0,
            reason: "PDU data exceeds the negotiated limit",
        });
    }
    if buf.len() < plen {
        return Ok(None);
    }
    if hd != 0 {
        let want = get_u32(buf, hlen);
        if crc32c(&buf[..hlen]) != want {
            return Err(FatalError { fes: fes::HEADER_DIGEST_ERROR, fei: 0, reason: "header digest mismatch" });
        }
    }
    let data = &buf[data_start..data_start + data_len];
    let data_digest_ok = dd == 0 || crc32c(data) == get_u32(buf, data_start + data_len);
    let data_header = || DataHeader {
        cccid: get_u16(buf, 8),
        ttag: get_u16(buf, 10),
        offset: get_u32(buf, 12),
        length: get_u32(buf, 16),
    };
    let pdu = match ty {
        pdu_type::IC_REQ | pdu_type::IC_RESP => {
            if ty == pdu_type::IC_REQ {
                Pdu::IcReq(IcReq {
                    pfv: get_u16(buf, 8),
                    hpda: buf[10],
                    digests: Digests::from_bits(buf[11]),
                    maxr2t: get_u32(buf, 12),
                })
            } else {
                Pdu::IcResp(IcResp {
                    pfv: get_u16(buf, 8),
                    cpda: buf[10],
                    digests: Digests::from_bits(buf[11]),
                    maxdata: get_u32(buf, 12),
                })
            }
        }
        pdu_type::H2C_TERM_REQ | pdu_type::C2H_TERM_REQ => {
            Pdu::TermReq { from_controller: ty == pdu_type::C2H_TERM_REQ, fes: get_u16(buf, 8), fei: get_u32(buf, 10) }
        }
        pdu_type::CAPSULE_CMD => {
            let mut sqe = [0u8; SQE_SIZE];
            sqe.copy_from_slice(&buf[CH_SIZE..CH_SIZE + SQE_SIZE]);
            Pdu::CapsuleCmd { command: Command::decode(&sqe), data }
        }
        pdu_type::CAPSULE_RESP => {
            let mut cqe = [0u8; CQE_SIZE];
            cqe.copy_from_slice(&buf[CH_SIZE..CH_SIZE + CQE_SIZE]);
            Pdu::CapsuleResp(Completion::decode(&cqe))
        }
        pdu_type::H2C_DATA | pdu_type::C2H_DATA => {
            let header = data_header();
            if header.length as usize != data_len {
                return Err(FatalError::field(data_field::DATAL, "data length does not match the PDU length"));
            }
            if ty == pdu_type::H2C_DATA {
                Pdu::H2CData { header, last: fl & flags::DATA_LAST != 0, data }
            } else {
                Pdu::C2HData { header, last: fl & flags::DATA_LAST != 0, success: fl & flags::DATA_SUCCESS != 0, data }
            }
        }
        _ => Pdu::R2T(data_header()),
    };
    Ok(Some(Parsed { pdu, len: plen, data_digest_ok }))
}

#[inline]
fn put_common(b: &mut [u8], ty: u8, fl: u8, hlen: usize, pdo: usize, plen: usize) {
    b[0] = ty;
    b[1] = fl;
    b[2] = hlen as u8;
    b[3] = pdo as u8;
    put_u32(b, 4, plen as u32);
}

/// Appends the header digest to a header of `hlen` bytes at the start of `b`, if
/// enabled; returns the header length including the digest.
#[inline]
fn seal_header(b: &mut [u8], hlen: usize, digests: Digests) -> usize {
    if digests.header {
        let crc = crc32c(&b[..hlen]);
        put_u32(b, hlen, crc);
        hlen + DIGEST_SIZE
    } else {
        hlen
    }
}

/// Encodes an ICReq into `b` (128 bytes).
pub fn encode_ic_req(r: &IcReq, b: &mut [u8; IC_SIZE]) {
    b.fill(0);
    put_common(b, pdu_type::IC_REQ, 0, IC_SIZE, 0, IC_SIZE);
    put_u16(b, 8, r.pfv);
    b[10] = r.hpda;
    b[11] = r.digests.bits();
    put_u32(b, 12, r.maxr2t);
}

/// Encodes an ICResp into `b` (128 bytes).
pub fn encode_ic_resp(r: &IcResp, b: &mut [u8; IC_SIZE]) {
    b.fill(0);
    put_common(b, pdu_type::IC_RESP, 0, IC_SIZE, 0, IC_SIZE);
    put_u16(b, 8, r.pfv);
    b[10] = r.cpda;
    b[11] = r.digests.bits();
    put_u32(b, 12, r.maxdata);
}

/// Largest header any data-free or data-carrying PDU header encoder here writes,
/// including the header digest: a command capsule.
pub const MAX_HEADER_SIZE: usize = CAPSULE_CMD_HLEN + DIGEST_SIZE;

/// Encodes a response capsule; returns its length.
#[inline]
pub fn encode_capsule_resp(c: &Completion, digests: Digests, b: &mut [u8]) -> usize {
    let plen = CAPSULE_RESP_HLEN + digests.header_len();
    put_common(b, pdu_type::CAPSULE_RESP, if digests.header { flags::HDGST } else { 0 }, CAPSULE_RESP_HLEN, 0, plen);
    let mut cqe = [0u8; CQE_SIZE];
    c.encode(&mut cqe);
    b[CH_SIZE..CAPSULE_RESP_HLEN].copy_from_slice(&cqe);
    seal_header(b, CAPSULE_RESP_HLEN, digests)
}

/// Encodes the header (and header digest) of a PDU that carries `data_len` bytes of
/// data after it: H2CData, C2HData or a command capsule's header. The data and, when
/// enabled, its digest ([`crc32c`] of the data, little endian) follow on the wire.
/// Returns the header length.
#[inline]
fn encode_data_pdu_header(
    b: &mut [u8],
    ty: u8,
    extra_flags: u8,
    hlen: usize,
    data_len: usize,
    digests: Digests,
) -> usize {
    let hd = digests.header_len();
    let has_data = data_len > 0;
    let dd = if has_data && digests.data { DIGEST_SIZE } else { 0 };
    let pdo = if has_data { hlen + hd } else { 0 };
    let plen = hlen + hd + data_len + dd;
    let mut fl = extra_flags;
    if digests.header {
        fl |= flags::HDGST;
    }
    if dd != 0 {
        fl |= flags::DDGST;
    }
    put_common(b, ty, fl, hlen, pdo, plen);
    hlen + hd
}

/// Encodes a C2HData header; returns its length. `success` asks the host to complete
/// the command without a response capsule (only valid with `last`).
#[inline]
pub fn encode_c2h_data(h: &DataHeader, last: bool, success: bool, digests: Digests, b: &mut [u8]) -> usize {
    let mut fl = 0;
    if last {
        fl |= flags::DATA_LAST;
    }
    if success {
        fl |= flags::DATA_SUCCESS;
    }
    b[..DATA_HLEN].fill(0);
    let n = encode_data_pdu_header(b, pdu_type::C2H_DATA, fl, DATA_HLEN, h.length as usize, digests);
    put_data_header(b, h);
    seal_header(b, DATA_HLEN, digests);
    n
}

/// Encodes an H2CData header; returns its length.
pub fn encode_h2c_data(h: &DataHeader, last: bool, digests: Digests, b: &mut [u8]) -> usize {
    b[..DATA_HLEN].fill(0);
    let fl = if last { flags::DATA_LAST } else { 0 };
    let n = encode_data_pdu_header(b, pdu_type::H2C_DATA, fl, DATA_HLEN, h.length as usize, digests);
    put_data_header(b, h);
    seal_header(b, DATA_HLEN, digests);
    n
}

/// Encodes an R2T; returns its length.
#[inline]
pub fn encode_r2t(h: &DataHeader, digests: Digests, b: &mut [u8]) -> usize {
    b[..DATA_HLEN].fill(0);
    let plen = DATA_HLEN + digests.header_len();
    put_common(b, pdu_type::R2T, if digests.header { flags::HDGST } else { 0 }, DATA_HLEN, 0, plen);
    put_data_header(b, h);
    seal_header(b, DATA_HLEN, digests)
}

#[inline]
fn put_data_header(b: &mut [u8], h: &DataHeader) {
    put_u16(b, 8, h.cccid);
    put_u16(b, 10, h.ttag);
    put_u32(b, 12, h.offset);
    put_u32(b, 16, h.length);
}

/// Encodes a command capsule header for `data_len` bytes of in-capsule data; returns
/// the header length.
pub fn encode_capsule_cmd(c: &Command, data_len: usize, digests: Digests, b: &mut [u8]) -> usize {
    let n = encode_data_pdu_header(b, pdu_type::CAPSULE_CMD, 0, CAPSULE_CMD_HLEN, data_len, digests);
    let mut sqe = [0u8; SQE_SIZE];
    c.encode(&mut sqe);
    b[CH_SIZE..CAPSULE_CMD_HLEN].copy_from_slice(&sqe);
    seal_header(b, CAPSULE_CMD_HLEN, digests);
    n
}

/// Encodes a termination request carrying up to 128 bytes of the offending PDU
/// header; returns its length. Termination requests never carry digests.
pub fn encode_term_req(from_controller: bool, fes: u16, fei: u32, offending: &[u8], b: &mut [u8]) -> usize {
    let n = offending.len().min(TERM_REQ_MAX - TERM_REQ_HLEN);
    let plen = TERM_REQ_HLEN + n;
    b[..TERM_REQ_HLEN].fill(0);
    let ty = if from_controller { pdu_type::C2H_TERM_REQ } else { pdu_type::H2C_TERM_REQ };
    put_common(b, ty, 0, TERM_REQ_HLEN, 0, plen);
    put_u16(b, 8, fes);
    put_u32(b, 10, fei);
    b[TERM_REQ_HLEN..plen].copy_from_slice(&offending[..n]);
    plen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::Status;
    use proptest::prelude::*;

    fn any_digests() -> impl Strategy<Value = Digests> {
        (any::<bool>(), any::<bool>()).prop_map(|(header, data)| Digests { header, data })
    }

    /// Builds a data-carrying PDU the way a sender does: header, data, data digest.
    fn with_data(header: &[u8], data: &[u8], d: Digests) -> Vec<u8> {
        let mut v = header.to_vec();
        v.extend_from_slice(data);
        if d.data && !data.is_empty() {
            v.extend_from_slice(&crc32c(data).to_le_bytes());
        }
        v
    }

    proptest! {
        #[test]
        fn ic_req_round_trips(hpda in 0u8..32, maxr2t: u32, d in any_digests()) {
            let r = IcReq { pfv: 0, hpda, digests: d, maxr2t };
            let mut b = [0u8; IC_SIZE];
            encode_ic_req(&r, &mut b);
            let p = parse(&b, Digests::default(), DataLimits::uniform(0)).unwrap().unwrap();
            prop_assert_eq!(p.pdu, Pdu::IcReq(r));
            prop_assert_eq!(p.len, IC_SIZE);
        }

        #[test]
        fn ic_resp_round_trips(maxdata: u32, d in any_digests()) {
            let r = IcResp { pfv: 0, cpda: 0, digests: d, maxdata };
            let mut b = [0u8; IC_SIZE];
            encode_ic_resp(&r, &mut b);
            prop_assert_eq!(parse(&b, Digests::default(), DataLimits::uniform(0)).unwrap().unwrap().pdu, Pdu::IcResp(r));
        }

        #[test]
        fn capsule_cmd_round_trips(cid: u16, nsid: u32, cdw: [u32; 6],
                                   data in proptest::collection::vec(any::<u8>(), 0..9000),
                                   d in any_digests()) {
            let c = Command { opcode: 1, cid, nsid, cdw, ..Command::default() };
            let mut h = [0u8; MAX_HEADER_SIZE];
            let n = encode_capsule_cmd(&c, data.len(), d, &mut h);
            let wire = with_data(&h[..n], &data, d);
            let p = parse(&wire, d, DataLimits::uniform(16384)).unwrap().unwrap();
            prop_assert!(p.data_digest_ok);
            prop_assert_eq!(p.len, wire.len());
            prop_assert_eq!(p.pdu, Pdu::CapsuleCmd { command: c, data: &data });
            // Every strict prefix asks for more bytes rather than failing.
            for cut in [0, 1, 7, n - 1, wire.len() - 1] {
                prop_assert_eq!(parse(&wire[..cut], d, DataLimits::uniform(16384)).unwrap(), None);
            }
        }

        #[test]
        fn capsule_resp_round_trips(result: u32, sqhd: u16, cid: u16, st in 0u16..0x7FFF, d in any_digests()) {
            let c = Completion { result, sqhd, cid, status: Status(st), ..Completion::default() };
            let mut b = [0u8; 32];
            let n = encode_capsule_resp(&c, d, &mut b);
            let p = parse(&b[..n], d, DataLimits::uniform(0)).unwrap().unwrap();
            prop_assert_eq!(p.pdu, Pdu::CapsuleResp(c));
            prop_assert_eq!(p.len, n);
        }

        #[test]
        fn c2h_data_round_trips(cccid: u16, offset: u32, last: bool, success: bool,
                                data in proptest::collection::vec(any::<u8>(), 1..5000), d in any_digests()) {
            let h = DataHeader { cccid, ttag: 0, offset, length: data.len() as u32 };
            let mut b = [0u8; 32];
            let n = encode_c2h_data(&h, last, success, d, &mut b);
            let wire = with_data(&b[..n], &data, d);
            let p = parse(&wire, d, DataLimits::uniform(1 << 20)).unwrap().unwrap();
            prop_assert_eq!(p.pdu, Pdu::C2HData { header: h, last, success, data: &data });
        }

        #[test]
        fn h2c_data_round_trips(cccid: u16, ttag: u16, offset: u32, last: bool,
                                data in proptest::collection::vec(any::<u8>(), 1..5000), d in any_digests()) {
            let h = DataHeader { cccid, ttag, offset, length: data.len() as u32 };
            let mut b = [0u8; 32];
            let n = encode_h2c_data(&h, last, d, &mut b);
            let wire = with_data(&b[..n], &data, d);
            prop_assert_eq!(parse(&wire, d, DataLimits::uniform(1 << 20)).unwrap().unwrap().pdu, Pdu::H2CData { header: h, last, data: &data });
        }

        #[test]
        fn r2t_round_trips(cccid: u16, ttag: u16, offset: u32, length: u32, d in any_digests()) {
            let h = DataHeader { cccid, ttag, offset, length };
            let mut b = [0u8; 32];
            let n = encode_r2t(&h, d, &mut b);
            prop_assert_eq!(parse(&b[..n], d, DataLimits::uniform(0)).unwrap().unwrap().pdu, Pdu::R2T(h));
        }

        #[test]
        fn term_req_round_trips(fes in 1u16..7, fei: u32, offending in proptest::collection::vec(any::<u8>(), 0..200), from_controller: bool) {
            let mut b = [0u8; TERM_REQ_MAX];
            let n = encode_term_req(from_controller, fes, fei, &offending, &mut b);
            prop_assert!(n <= TERM_REQ_MAX);
            let p = parse(&b[..n], Digests { header: true, data: true }, DataLimits::uniform(0)).unwrap().unwrap();
            prop_assert_eq!(p.pdu, Pdu::TermReq { from_controller, fes, fei });
        }

        // Arbitrary bytes never panic the parser, whatever it decides.
        #[test]
        fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), d in any_digests()) {
            let _ = parse(&bytes, d, DataLimits::uniform(8192));
        }
    }

    #[test]
    fn header_digest_error_is_fatal() {
        let d = Digests { header: true, data: false };
        let mut b = [0u8; 32];
        let n = encode_capsule_resp(&Completion::default(), d, &mut b);
        b[10] ^= 1;
        let e = parse(&b[..n], d, DataLimits::uniform(0)).unwrap_err();
        assert_eq!(e.fes, fes::HEADER_DIGEST_ERROR);
    }

    #[test]
    fn data_digest_error_is_reported_not_fatal() {
        let d = Digests { header: false, data: true };
        let c = Command::default();
        let mut h = [0u8; MAX_HEADER_SIZE];
        let n = encode_capsule_cmd(&c, 4, d, &mut h);
        let mut wire = with_data(&h[..n], &[1, 2, 3, 4], d);
        let last = wire.len() - 1;
        wire[last] ^= 0xFF;
        assert!(!parse(&wire, d, DataLimits::uniform(4096)).unwrap().unwrap().data_digest_ok);
    }

    #[test]
    fn an_ic_request_of_the_wrong_length_is_refused_at_once() {
        let mut b = [0u8; IC_SIZE];
        encode_ic_req(&IcReq::default(), &mut b);
        for plen in [127u32, 129, 4096, u32::MAX] {
            b[4..8].copy_from_slice(&plen.to_le_bytes());
            // Only the common header has arrived: the length alone is enough to refuse.
            let e = parse(&b[..CH_SIZE], Digests::default(), DataLimits::uniform(0)).unwrap_err();
            assert_eq!((e.fes, e.fei), (fes::INVALID_HEADER_FIELD, 4), "PLEN {plen}");
        }
    }

    #[test]
    fn malformed_headers_name_the_field() {
        let mut b = [0u8; IC_SIZE];
        encode_ic_req(&IcReq::default(), &mut b);
        b[2] = 100;
        assert_eq!(parse(&b, Digests::default(), DataLimits::uniform(0)).unwrap_err().fei, 2);
        b[2] = 128;
        b[0] = 0x42;
        assert_eq!(parse(&b, Digests::default(), DataLimits::uniform(0)).unwrap_err().fei, 0);
        // A digest flag the connection did not negotiate.
        let mut r = [0u8; 32];
        let n = encode_capsule_resp(&Completion::default(), Digests { header: true, data: false }, &mut r);
        assert_eq!(parse(&r[..n], Digests::default(), DataLimits::uniform(0)).unwrap_err().fei, 1);
    }

    #[test]
    fn oversized_data_is_refused_before_it_arrives() {
        let c = Command::default();
        let mut h = [0u8; MAX_HEADER_SIZE];
        let n = encode_capsule_cmd(&c, 1 << 20, Digests::default(), &mut h);
        let e = parse(&h[..n], Digests::default(), DataLimits::uniform(8192)).unwrap_err();
        assert_eq!(e.fes, fes::DATA_LIMIT_EXCEEDED);
    }

    #[test]
    fn misaligned_data_is_refused_at_the_pdu_data_offset() {
        let d = Digests::default();
        let mut h = [0u8; MAX_HEADER_SIZE];
        let n = encode_capsule_cmd(&Command::default(), 8, d, &mut h);
        // Move the data one byte later: PDO 73 is past the header but not dword aligned.
        let mut wire = h[..n].to_vec();
        wire[3] += 1;
        wire[4] += 1;
        wire.extend_from_slice(&[0; 9]);
        let e = parse(&wire, d, DataLimits::uniform(8192)).unwrap_err();
        assert_eq!((e.fes, e.fei), (fes::INVALID_HEADER_FIELD, 3));
        // Padding to a multiple of the alignment is allowed.
        wire[3] += 3;
        wire[4] += 3;
        wire.extend_from_slice(&[0; 3]);
        let p = parse(&wire, d, DataLimits::uniform(8192)).unwrap().unwrap();
        assert!(matches!(p.pdu, Pdu::CapsuleCmd { data, .. } if data.len() == 8));
        let strict = DataLimits { alignment: pdu_data_alignment(31), ..DataLimits::uniform(8192) };
        assert_eq!(parse(&wire, d, strict).unwrap_err().fei, 3);
    }
}

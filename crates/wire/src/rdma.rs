//! What NVMe over RDMA adds on the wire (NVMe RDMA Transport Specification 1.0b):
//! the private data of the RDMA CM connection request, accept and reject, the Keyed SGL
//! Data Block descriptor that names host memory, and the discovery log entry's
//! transport-specific subtype.
//!
//! Capsules themselves are the plain 64-byte command and 16-byte response of
//! [`crate::command`]: RDMA frames them, so there is no PDU header.

use std::fmt;

use crate::bytes::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};

/// Bytes of private data in a connection request and an accept.
pub const PRIVATE_DATA_LEN: usize = 32;
/// Bytes of private data in a reject.
pub const REJECT_DATA_LEN: usize = 4;
/// The only record format defined.
const RECORD_FORMAT: u16 = 0;

/// Why a controller refuses a connection request: the reject's STS field, whose
/// value each variant carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum RejectReason {
    /// The private data is shorter than a request's.
    InvalidLength = 1,
    /// The record format is not 0.
    InvalidRecordFormat = 2,
    /// The queue ID is beyond the queues the controller offers.
    InvalidQid = 3,
    /// The submission queue size is 0 or larger than the controller takes.
    InvalidHsqsize = 4,
    /// The host has no receive queue entries for responses.
    InvalidHrqsize = 5,
    /// The controller cannot make the queue pair.
    NoResources = 6,
    /// The host's inbound RDMA READ depth is not usable.
    InvalidIrd = 7,
    /// The host's outbound RDMA READ depth is not usable.
    InvalidOrd = 8,
    /// The controller ID does not name a controller of this host.
    InvalidCntlid = 9,
}

impl RejectReason {
    /// Every reason, in the order of their values (1 to 9).
    const ALL: [RejectReason; 9] = [
        RejectReason::InvalidLength,
        RejectReason::InvalidRecordFormat,
        RejectReason::InvalidQid,
        RejectReason::InvalidHsqsize,
        RejectReason::InvalidHrqsize,
        RejectReason::NoResources,
        RejectReason::InvalidIrd,
        RejectReason::InvalidOrd,
        RejectReason::InvalidCntlid,
    ];

    /// The STS value.
    pub fn code(self) -> u16 {
        self as u16
    }

    /// The reason an STS value stands for, if it is a defined one.
    pub fn from_code(code: u16) -> Option<RejectReason> {
        Self::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// The reject's private data.
    pub fn encode(self) -> [u8; REJECT_DATA_LEN] {
        let mut b = [0u8; REJECT_DATA_LEN];
        put_u16(&mut b, 0, RECORD_FORMAT);
        put_u16(&mut b, 2, self.code());
        b
    }

    /// Reads a reject's private data; `None` if it is short or names no defined reason.
    pub fn decode(b: &[u8]) -> Option<RejectReason> {
        (b.len() >= REJECT_DATA_LEN).then(|| RejectReason::from_code(get_u16(b, 2))).flatten()
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::InvalidLength => "the connection request's private data is too short",
            RejectReason::InvalidRecordFormat => "the connection request's record format is not 0",
            RejectReason::InvalidQid => "the queue ID is beyond the queues this controller offers",
            RejectReason::InvalidHsqsize => "the submission queue size is 0 or too large",
            RejectReason::InvalidHrqsize => "the host's receive queue size is 0",
            RejectReason::NoResources => "the controller cannot make the queue pair",
            RejectReason::InvalidIrd => "the host's inbound RDMA READ depth is not usable",
            RejectReason::InvalidOrd => "the host's outbound RDMA READ depth is not usable",
            RejectReason::InvalidCntlid => "the controller ID names no controller of this host",
        })
    }
}

/// What a host asks for in its RDMA CM connection request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectRequest {
    /// The queue the connection carries: 0 for the admin queue.
    pub qid: u16,
    /// Receive queue entries the host posted for response capsules (HRQSIZE).
    pub host_receive_entries: u16,
    /// The submission queue size, 0's based, as in the Connect command (HSQSIZE).
    pub sqsize: u16,
    /// For an I/O queue, the controller it joins (0 from hosts that predate the field).
    pub cntlid: u16,
}

impl ConnectRequest {
    /// Reads the private data of a connection request.
    pub fn decode(b: &[u8]) -> Result<ConnectRequest, RejectReason> {
        if b.len() < PRIVATE_DATA_LEN {
            return Err(RejectReason::InvalidLength);
        }
        if get_u16(b, 0) != RECORD_FORMAT {
            return Err(RejectReason::InvalidRecordFormat);
        }
        Ok(ConnectRequest {
            qid: get_u16(b, 2),
            host_receive_entries: get_u16(b, 4),
            sqsize: get_u16(b, 6),
            cntlid: get_u16(b, 8),
        })
    }

    /// The private data of this request.
    pub fn encode(&self) -> [u8; PRIVATE_DATA_LEN] {
        let mut b = [0u8; PRIVATE_DATA_LEN];
        put_u16(&mut b, 0, RECORD_FORMAT);
        put_u16(&mut b, 2, self.qid);
        put_u16(&mut b, 4, self.host_receive_entries);
        put_u16(&mut b, 6, self.sqsize);
        put_u16(&mut b, 8, self.cntlid);
        b
    }

    /// Submission queue entries, 1's based.
    pub fn entries(&self) -> u32 {
        u32::from(self.sqsize) + 1
    }

    /// Checks the request against what the controller offers: I/O queue IDs up to
    /// `max_qid`, and at most `max_entries` entries in a queue.
    pub fn check(&self, max_qid: u16, max_entries: u32) -> Result<(), RejectReason> {
        if self.qid > max_qid {
            return Err(RejectReason::InvalidQid);
        }
        // An SQSIZE of 0 (one entry) leaves no room: a queue is full with one fewer
        // entry than its size.
        if self.sqsize == 0 || self.entries() > max_entries {
            return Err(RejectReason::InvalidHsqsize);
        }
        if self.host_receive_entries == 0 {
            return Err(RejectReason::InvalidHrqsize);
        }
        Ok(())
    }
}

/// The private data of an accept: the receive queue entries the controller posted for
/// command capsules (CRQSIZE).
pub fn encode_accept(controller_receive_entries: u16) -> [u8; PRIVATE_DATA_LEN] {
    let mut b = [0u8; PRIVATE_DATA_LEN];
    put_u16(&mut b, 0, RECORD_FORMAT);
    put_u16(&mut b, 2, controller_receive_entries);
    b
}

/// Reads an accept's CRQSIZE; `None` if the data is short or of another format.
pub fn decode_accept(b: &[u8]) -> Option<u16> {
    (b.len() >= 4 && get_u16(b, 0) == RECORD_FORMAT).then(|| get_u16(b, 2))
}

/// The SGL descriptor identifier byte of a Keyed SGL Data Block (type 4h), address
/// subtype.
pub const KEYED_DATA_BLOCK: u8 = 0x40;
/// The same, with the subtype asking the controller to invalidate the key when it
/// answers (Send with Invalidate).
pub const KEYED_DATA_BLOCK_INVALIDATE: u8 = 0x4F;
/// The largest length a keyed descriptor can carry (24 bits).
pub const MAX_KEYED_LENGTH: u32 = (1 << 24) - 1;

/// A Keyed SGL Data Block descriptor: host memory the controller reaches with RDMA
/// READ and WRITE, named by the remote key of the region holding it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyedSgl {
    /// The address in the host's region.
    pub address: u64,
    /// Bytes (at most 2^24 - 1).
    pub length: u32,
    /// The region's remote key.
    pub key: u32,
    /// Whether the host asks for the key to be invalidated with the response.
    pub invalidate: bool,
}

impl KeyedSgl {
    /// Reads a 16-byte descriptor (bytes 24..40 of a command); `None` unless it is a
    /// keyed data block with one of the two subtypes RDMA defines.
    pub fn decode(d: &[u8; 16]) -> Option<KeyedSgl> {
        let invalidate = match d[15] {
            KEYED_DATA_BLOCK => false,
            KEYED_DATA_BLOCK_INVALIDATE => true,
            _ => return None,
        };
        Some(KeyedSgl {
            address: get_u64(d, 0),
            length: u32::from(d[8]) | u32::from(d[9]) << 8 | u32::from(d[10]) << 16,
            key: get_u32(d, 11),
            invalidate,
        })
    }

    /// The descriptor's 16 bytes; the length is cut to 24 bits.
    pub fn encode(&self) -> [u8; 16] {
        let mut d = [0u8; 16];
        put_u64(&mut d, 0, self.address);
        d[8..11].copy_from_slice(&(self.length & MAX_KEYED_LENGTH).to_le_bytes()[..3]);
        put_u32(&mut d, 11, self.key);
        d[15] = if self.invalidate { KEYED_DATA_BLOCK_INVALIDATE } else { KEYED_DATA_BLOCK };
        d
    }
}

/// The transport-specific address subtype of a discovery log entry for an RDMA port:
/// reliable connected queue pairs, no provider type named (RoCE v1, v2, InfiniBand and
/// iWARP all reach it), connections through the RDMA IP CM.
pub fn discovery_tsas() -> [u8; 256] {
    let mut t = [0u8; 256];
    t[0] = 1; // RDMA_QPTYPE: reliable connected
    t[1] = 1; // RDMA_PRTYPE: no provider specified
    t[2] = 1; // RDMA_CMS: RDMA IP CM
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_request_reads_field_by_field() {
        let mut b = [0u8; PRIVATE_DATA_LEN];
        b[2] = 3; // QID
        b[4] = 128; // HRQSIZE
        b[6] = 127; // HSQSIZE, 0's based
        b[8] = 0x34;
        b[9] = 0x12; // CNTLID
        let r = ConnectRequest::decode(&b).unwrap();
        assert_eq!(r, ConnectRequest { qid: 3, host_receive_entries: 128, sqsize: 127, cntlid: 0x1234 });
        assert_eq!(r.entries(), 128);
        assert_eq!(r.encode(), b);
    }

    #[test]
    fn a_short_or_unknown_request_is_refused_with_its_reason() {
        let good = ConnectRequest { qid: 0, host_receive_entries: 32, sqsize: 31, cntlid: 0 }.encode();
        assert_eq!(ConnectRequest::decode(&good[..31]), Err(RejectReason::InvalidLength));
        let mut other_format = good;
        other_format[0] = 1;
        assert_eq!(ConnectRequest::decode(&other_format), Err(RejectReason::InvalidRecordFormat));
        // Longer private data (a CM pads it) is fine.
        let mut padded = [0u8; 56];
        padded[..32].copy_from_slice(&good);
        assert!(ConnectRequest::decode(&padded).is_ok());
    }

    #[test]
    fn requests_are_checked_against_the_queues_offered() {
        let r = |qid, hrq, sqsize| ConnectRequest { qid, host_receive_entries: hrq, sqsize, cntlid: 0 };
        assert_eq!(r(4, 128, 127).check(4, 128), Ok(()));
        assert_eq!(r(5, 128, 127).check(4, 128), Err(RejectReason::InvalidQid));
        assert_eq!(r(1, 128, 128).check(4, 128), Err(RejectReason::InvalidHsqsize));
        assert_eq!(r(1, 128, 0).check(4, 128), Err(RejectReason::InvalidHsqsize));
        assert_eq!(r(1, 0, 31).check(4, 128), Err(RejectReason::InvalidHrqsize));
    }

    #[test]
    fn accepts_and_rejects_round_trip() {
        let a = encode_accept(128);
        assert_eq!((a.len(), a[2], a[3]), (PRIVATE_DATA_LEN, 128, 0));
        assert_eq!(decode_accept(&a), Some(128));
        for code in 1..=9 {
            let reason = RejectReason::from_code(code).unwrap();
            assert_eq!(reason.code(), code);
            assert_eq!(RejectReason::decode(&reason.encode()), Some(reason));
            assert!(!reason.to_string().is_empty());
        }
        assert_eq!(RejectReason::from_code(0), None);
        assert_eq!(RejectReason::from_code(10), None);
        assert_eq!(RejectReason::decode(&[0, 0, 6]), None, "short");
    }

    #[test]
    fn keyed_descriptors_carry_a_24_bit_length_and_a_key() {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        d[8..11].copy_from_slice(&[0x00, 0x10, 0x02]); // 0x021000 bytes
        d[11..15].copy_from_slice(&0xAABB_CCDDu32.to_le_bytes());
        d[15] = KEYED_DATA_BLOCK_INVALIDATE;
        let k = KeyedSgl::decode(&d).unwrap();
        assert_eq!(
            k,
            KeyedSgl { address: 0x1122_3344_5566_7788, length: 0x02_1000, key: 0xAABB_CCDD, invalidate: true }
        );
        assert_eq!(k.encode(), d);
        d[15] = KEYED_DATA_BLOCK;
        assert!(!KeyedSgl::decode(&d).unwrap().invalidate);
    }

    #[test]
    fn other_descriptors_are_not_keyed() {
        // Data Block (offset), Transport Data Block, keyed with a reserved subtype.
        for id in [0x01, 0x5A, 0x41, 0x4A, 0x00] {
            let mut d = [0u8; 16];
            d[15] = id;
            assert_eq!(KeyedSgl::decode(&d), None, "id {id:#x}");
        }
    }

    #[test]
    fn the_discovery_entry_names_reliable_connected_rdma_cm() {
        let t = discovery_tsas();
        assert_eq!(&t[..3], &[1, 1, 1]);
        assert!(t[3..].iter().all(|&b| b == 0));
    }
}

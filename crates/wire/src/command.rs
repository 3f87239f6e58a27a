//! Submission and completion queue entries (NVMe Base 2.0 §4.2, §4.6) and the command
//! fields nvpool interprets.

use crate::bytes::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::status::Status;

/// Size of a submission queue entry.
pub const SQE_SIZE: usize = 64;
/// Size of a completion queue entry.
pub const CQE_SIZE: usize = 16;

/// Admin command opcodes (NVMe Base 2.0 Figure 28).
pub mod admin_opcode {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT_REQUEST: u8 = 0x0C;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Fabrics command; the Fabrics Command Type is in byte 4.
    pub const FABRICS: u8 = 0x7F;
}

/// NVM command set I/O opcodes (NVM Command Set 1.0 Figure 14).
pub mod io_opcode {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DATASET_MANAGEMENT: u8 = 0x09;
}

/// SGL descriptor identifiers used by NVMe/TCP (NVMe/TCP 1.0 §3.3.1, NVMe Base §4.3.2).
pub mod sgl {
    /// Data Block descriptor, Offset subtype: the data is in the capsule.
    pub const IN_CAPSULE: u8 = 0x01;
    /// Transport SGL Data Block descriptor, transport-specific subtype: the data moves
    /// in separate PDUs (R2T/H2CData or C2HData).
    pub const TRANSPORT: u8 = 0x5A;
}

/// The data pointer of a fabrics command: one SGL descriptor (bytes 24..40 of the SQE).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SglDescriptor {
    /// Address (for in-capsule data: the offset into the capsule data).
    pub address: u64,
    /// Length of the data in bytes.
    pub length: u32,
    /// Descriptor type (bits 7:4) and subtype (bits 3:0).
    pub id: u8,
}

/// A submission queue entry. Command-specific dwords are kept raw; accessors below
/// interpret them for the commands nvpool serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Command {
    /// Opcode (CDW0 bits 7:0).
    pub opcode: u8,
    /// Fused operation and PRP/SGL selection (CDW0 bits 15:8).
    pub flags: u8,
    /// Command identifier (CDW0 bits 31:16).
    pub cid: u16,
    /// Namespace identifier; for fabrics commands byte 4 is the command type.
    pub nsid: u32,
    /// Command dword 2.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// Data pointer (one SGL descriptor for fabrics).
    pub dptr: SglDescriptor,
    /// Command dwords 10 to 15.
    pub cdw: [u32; 6],
}

impl Command {
    /// Decodes an SQE.
    pub fn decode(b: &[u8; SQE_SIZE]) -> Command {
        Command {
            opcode: b[0],
            flags: b[1],
            cid: get_u16(b, 2),
            nsid: get_u32(b, 4),
            cdw2: get_u32(b, 8),
            cdw3: get_u32(b, 12),
            mptr: get_u64(b, 16),
            dptr: SglDescriptor { address: get_u64(b, 24), length: get_u32(b, 32), id: b[39] },
            cdw: std::array::from_fn(|i| get_u32(b, 40 + 4 * i)),
        }
    }

    /// Encodes the SQE.
    pub fn encode(&self, b: &mut [u8; SQE_SIZE]) {
        b.fill(0);
        b[0] = self.opcode;
        b[1] = self.flags;
        put_u16(b, 2, self.cid);
        put_u32(b, 4, self.nsid);
        put_u32(b, 8, self.cdw2);
        put_u32(b, 12, self.cdw3);
        put_u64(b, 16, self.mptr);
        put_u64(b, 24, self.dptr.address);
        put_u32(b, 32, self.dptr.length);
        b[39] = self.dptr.id;
        for (i, v) in self.cdw.iter().enumerate() {
            put_u32(b, 40 + 4 * i, *v);
        }
    }

    /// Command dword 10.
    pub fn cdw10(&self) -> u32 {
        self.cdw[0]
    }
    /// Command dword 11.
    pub fn cdw11(&self) -> u32 {
        self.cdw[1]
    }
    /// Command dword 12.
    pub fn cdw12(&self) -> u32 {
        self.cdw[2]
    }

    /// The Fabrics Command Type (byte 4) of a fabrics command.
    pub fn fctype(&self) -> u8 {
        (self.nsid & 0xFF) as u8
    }

    /// Starting LBA of Read, Write and Write Zeroes (CDW10-11).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw[0]) | u64::from(self.cdw[1]) << 32
    }

    /// Number of logical blocks of Read, Write and Write Zeroes (CDW12 bits 15:0 are
    /// 0's based; this returns the real count).
    pub fn nlb(&self) -> u32 {
        (self.cdw[2] & 0xFFFF) + 1
    }

    /// Force Unit Access (CDW12 bit 30) of Read, Write and Write Zeroes.
    pub fn fua(&self) -> bool {
        self.cdw[2] & (1 << 30) != 0
    }

    /// Deallocate (CDW12 bit 25) of Write Zeroes.
    pub fn write_zeroes_deallocate(&self) -> bool {
        self.cdw[2] & (1 << 25) != 0
    }

    /// Whether CDW0 asks for what a fabrics controller serves: SGLs (PSDT 01b, as
    /// NVMe-oF requires) and no fused operation.
    pub fn has_fabrics_flags(&self) -> bool {
        self.flags & (PSDT_MASK | FUSE_MASK) == PSDT_SGL
    }

    /// A Read or Write command for `nlb` blocks from `slba` (helper for initiators).
    pub fn read_write(opcode: u8, cid: u16, nsid: u32, slba: u64, nlb: u32, len: u32) -> Command {
        Command {
            opcode,
            flags: PSDT_SGL,
            cid,
            nsid,
            dptr: SglDescriptor { address: 0, length: len, id: sgl::TRANSPORT },
            cdw: [slba as u32, (slba >> 32) as u32, (nlb - 1) & 0xFFFF, 0, 0, 0],
            ..Command::default()
        }
    }
}

/// CDW0 flags value selecting SGLs for the data pointer (PSDT = 01b).
pub const PSDT_SGL: u8 = 0x40;
/// CDW0 flags bits of PSDT (PRP or SGL for the data pointer).
pub const PSDT_MASK: u8 = 0xC0;
/// CDW0 flags bits of FUSE (fused operations).
pub const FUSE_MASK: u8 = 0x03;

/// A completion queue entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// Command specific result (DW0).
    pub result: u32,
    /// DW1 (command specific; Property Get uses it for the upper half of 8-byte values).
    pub result_hi: u32,
    /// Submission queue head pointer.
    pub sqhd: u16,
    /// Submission queue identifier.
    pub sqid: u16,
    /// Command identifier.
    pub cid: u16,
    /// Completion status.
    pub status: Status,
}

impl Completion {
    /// Decodes a CQE; the phase tag (bit 0 of the status word) is not used on fabrics.
    pub fn decode(b: &[u8; CQE_SIZE]) -> Completion {
        Completion {
            result: get_u32(b, 0),
            result_hi: get_u32(b, 4),
            sqhd: get_u16(b, 8),
            sqid: get_u16(b, 10),
            cid: get_u16(b, 12),
            status: Status(get_u16(b, 14) >> 1),
        }
    }

    /// Encodes the CQE with a zero phase tag.
    pub fn encode(&self, b: &mut [u8; CQE_SIZE]) {
        put_u32(b, 0, self.result);
        put_u32(b, 4, self.result_hi);
        put_u16(b, 8, self.sqhd);
        put_u16(b, 10, self.sqid);
        put_u16(b, 12, self.cid);
        put_u16(b, 14, self.status.0 << 1);
    }
}

/// One range of a Dataset Management command (NVM Command Set 1.0 Figure 39).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DsmRange {
    /// Context attributes.
    pub attributes: u32,
    /// Length in logical blocks.
    pub nlb: u32,
    /// Starting LBA.
    pub slba: u64,
}

/// Size of one Dataset Management range.
pub const DSM_RANGE_SIZE: usize = 16;

impl DsmRange {
    /// Decodes a range.
    pub fn decode(b: &[u8]) -> DsmRange {
        DsmRange { attributes: get_u32(b, 0), nlb: get_u32(b, 4), slba: get_u64(b, 8) }
    }

    /// Encodes a range.
    pub fn encode(&self, b: &mut [u8]) {
        put_u32(b, 0, self.attributes);
        put_u32(b, 4, self.nlb);
        put_u64(b, 8, self.slba);
    }
}

/// Dataset Management CDW11 attribute: Deallocate.
pub const DSM_ATTR_DEALLOCATE: u32 = 1 << 2;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    prop_compose! {
        fn any_command()(opcode: u8, flags: u8, cid: u16, nsid: u32, cdw2: u32, cdw3: u32,
                         mptr: u64, address: u64, length: u32, id: u8, cdw: [u32; 6]) -> Command {
            Command { opcode, flags, cid, nsid, cdw2, cdw3, mptr,
                      dptr: SglDescriptor { address, length, id }, cdw }
        }
    }

    proptest! {
        #[test]
        fn sqe_round_trips(c in any_command()) {
            let mut b = [0u8; SQE_SIZE];
            c.encode(&mut b);
            prop_assert_eq!(Command::decode(&b), c);
        }

        #[test]
        fn cqe_round_trips(result: u32, result_hi: u32, sqhd: u16, sqid: u16, cid: u16, st in 0u16..0x7FFF) {
            let c = Completion { result, result_hi, sqhd, sqid, cid, status: Status(st) };
            let mut b = [0u8; CQE_SIZE];
            c.encode(&mut b);
            prop_assert_eq!(Completion::decode(&b), c);
        }

        #[test]
        fn dsm_range_round_trips(attributes: u32, nlb: u32, slba: u64) {
            let r = DsmRange { attributes, nlb, slba };
            let mut b = [0u8; DSM_RANGE_SIZE];
            r.encode(&mut b);
            prop_assert_eq!(DsmRange::decode(&b), r);
        }
    }

    #[test]
    fn read_write_fields() {
        let c = Command::read_write(io_opcode::READ, 7, 1, 0x1_0000_0002, 8, 4096);
        assert_eq!(c.slba(), 0x1_0000_0002);
        assert_eq!(c.nlb(), 8);
        assert!(!c.fua());
    }
}

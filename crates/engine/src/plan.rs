//! What a block command asks of storage, whoever sent it (an NVMe host, a local
//! device, a migration's copy): the plan a backend carries out, in bytes.

use nvpool_wire::command::{DSM_RANGE_SIZE, DsmRange};

/// Largest data transfer of one command (MDTS): 128 KiB, as SPDK's default I/O unit.
/// Larger host I/Os are split by the host.
pub const MAX_TRANSFER: usize = 128 * 1024;

/// The disk work one NVM command needs, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoPlan {
    /// Read `len` bytes at `offset` and send them.
    Read {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u32,
    },
    /// Receive `len` bytes and write them at `offset`, durably if `fua`.
    Write {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u32,
        /// Force Unit Access: durable before completion.
        fua: bool,
    },
    /// Make every completed write durable.
    Flush,
    /// Zero `len` bytes at `offset`.
    WriteZeroes {
        /// Byte offset.
        offset: u64,
        /// Byte length.
        len: u64,
    },
    /// Receive `ranges` Dataset Management ranges; deallocate them if `deallocate`.
    DatasetManagement {
        /// Number of ranges.
        ranges: u32,
        /// Whether the host asked to deallocate.
        deallocate: bool,
        /// log2 of the namespace's block size, to turn the ranges into bytes.
        block_shift: u32,
    },
}

impl IoPlan {
    /// Bytes the host sends with this command.
    pub fn host_data_len(&self) -> u32 {
        match *self {
            IoPlan::Write { len, .. } => len,
            IoPlan::DatasetManagement { ranges, .. } => ranges * DSM_RANGE_SIZE as u32,
            _ => 0,
        }
    }
}

/// The non-empty Dataset Management ranges in a command's data, as (offset, length)
/// in bytes; checked beforehand (`nvme::nvm::check_dsm_ranges`).
pub fn dsm_byte_ranges(data: &[u8], ranges: u32, block_shift: u32) -> impl Iterator<Item = (u64, u64)> + '_ {
    data.chunks_exact(DSM_RANGE_SIZE)
        .take(ranges as usize)
        .map(DsmRange::decode)
        .filter(|r| r.nlb > 0)
        .map(move |r| (r.slba << block_shift, u64::from(r.nlb) << block_shift))
}

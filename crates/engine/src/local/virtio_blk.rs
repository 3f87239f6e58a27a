//! The virtio block device as a vhost-user-blk backend offers it (virtio 1.2 §5.2):
//! feature bits, the configuration space, and what a request asks of the namespace, as
//! the same [`IoPlan`] an NVMe command becomes. Pure encodings: no I/O.

use nvpool_wire::command::{DSM_RANGE_SIZE, DsmRange};

use crate::plan::IoPlan;

/// Device feature bits (virtio 1.2 §5.2.3) and the transport bits the engine offers.
pub mod feature {
    /// `size_max` in the configuration is the largest segment.
    pub const SIZE_MAX: u64 = 1 << 1;
    /// `seg_max` in the configuration is the most segments in a request.
    pub const SEG_MAX: u64 = 1 << 2;
    /// The device is read-only.
    pub const RO: u64 = 1 << 5;
    /// `blk_size` in the configuration is the logical block size.
    pub const BLK_SIZE: u64 = 1 << 6;
    /// Flush requests are served (the device has a volatile cache).
    pub const FLUSH: u64 = 1 << 9;
    /// `num_queues` in the configuration is the number of request queues.
    pub const MQ: u64 = 1 << 12;
    /// Discard requests are served.
    pub const DISCARD: u64 = 1 << 13;
    /// Write zeroes requests are served.
    pub const WRITE_ZEROES: u64 = 1 << 14;
    /// Virtio 1.x (not the legacy interface).
    pub const VERSION_1: u64 = 1 << 32;
    /// vhost-user: the protocol feature negotiation exists (rings start disabled).
    pub const PROTOCOL_FEATURES: u64 = 1 << 30;
}

/// Request types (virtio 1.2 §5.2.6).
pub mod request_type {
    /// Read into the device-writable buffers.
    pub const IN: u32 = 0;
    /// Write from the device-readable buffers.
    pub const OUT: u32 = 1;
    /// Make completed writes durable.
    pub const FLUSH: u32 = 4;
    /// The device's serial, 20 bytes.
    pub const GET_ID: u32 = 8;
    /// Deallocate the segments given.
    pub const DISCARD: u32 = 11;
    /// Zero the segments given.
    pub const WRITE_ZEROES: u32 = 13;
}

/// The status byte a request ends with.
pub mod status {
    /// Done.
    pub const OK: u8 = 0;
    /// The device failed it.
    pub const IOERR: u8 = 1;
    /// The device does not serve this kind of request (or it was malformed).
    pub const UNSUPP: u8 = 2;
}

/// The header every request starts with: type, reserved, sector.
pub const HEADER_SIZE: usize = 16;
/// A discard or write zeroes segment: sector, sector count, flags.
pub const SEGMENT_SIZE: usize = 16;
/// Bytes of the serial a GET_ID answers with.
pub const ID_BYTES: usize = 20;
/// Bytes of the configuration space this device fills (up to the secure erase fields).
pub const CONFIG_SIZE: usize = 60;
/// Sectors are 512 bytes whatever the block size.
const SECTOR_SHIFT: u32 = 9;

/// A request's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// One of [`request_type`].
    pub kind: u32,
    /// Where it starts, in 512-byte sectors.
    pub sector: u64,
}

impl Header {
    /// Decodes the header from its 16 bytes.
    pub fn decode(b: &[u8; HEADER_SIZE]) -> Header {
        Header {
            kind: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            sector: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        }
    }
}

/// A discard or write zeroes segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First sector.
    pub sector: u64,
    /// Sectors.
    pub sectors: u32,
}

impl Segment {
    /// Decodes a segment from its 16 bytes (the flags are not needed: a write zeroes
    /// that may unmap is still a write zeroes).
    pub fn decode(b: &[u8; SEGMENT_SIZE]) -> Segment {
        Segment {
            sector: u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            sectors: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
        }
    }
}

/// What the device is, as its configuration space and features say it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Size in bytes.
    pub size: u64,
    /// log2 of the logical block size.
    pub block_shift: u32,
    /// Largest request in bytes.
    pub max_request: u32,
    /// Request queues.
    pub queues: u16,
    /// Whether writes are refused.
    pub read_only: bool,
}

/// Largest discard or write zeroes, in sectors (a Dataset Management range counts
/// blocks in 32 bits).
const MAX_ZEROING_SECTORS: u32 = 1 << 30;

impl Geometry {
    /// The feature bits offered for this device.
    pub fn features(&self) -> u64 {
        let mut f = feature::VERSION_1
            | feature::PROTOCOL_FEATURES
            | feature::SIZE_MAX
            | feature::SEG_MAX
            | feature::BLK_SIZE
            | feature::FLUSH
            | feature::MQ
            | feature::DISCARD
            | feature::WRITE_ZEROES;
        if self.read_only {
            f |= feature::RO;
        }
        f
    }

    /// The most segments a request may have: each is at most a page, and a request
    /// moves at most `max_request` bytes.
    pub fn max_segments(&self) -> u32 {
        self.max_request / 4096
    }

    /// The configuration space (`struct virtio_blk_config`, little-endian).
    pub fn config(&self) -> [u8; CONFIG_SIZE] {
        let mut c = [0u8; CONFIG_SIZE];
        c[0..8].copy_from_slice(&(self.size >> SECTOR_SHIFT).to_le_bytes());
        c[8..12].copy_from_slice(&4096u32.to_le_bytes()); // size_max
        c[12..16].copy_from_slice(&self.max_segments().to_le_bytes()); // seg_max
        c[20..24].copy_from_slice(&(1u32 << self.block_shift).to_le_bytes()); // blk_size
        c[32] = 1; // writeback: the cache is volatile, flushes matter
        c[34..36].copy_from_slice(&self.queues.to_le_bytes());
        c[36..40].copy_from_slice(&MAX_ZEROING_SECTORS.to_le_bytes()); // max_discard_sectors
        c[40..44].copy_from_slice(&1u32.to_le_bytes()); // max_discard_seg
        c[44..48].copy_from_slice(&((1u32 << self.block_shift) >> SECTOR_SHIFT).to_le_bytes());
        c[48..52].copy_from_slice(&MAX_ZEROING_SECTORS.to_le_bytes()); // max_write_zeroes_sectors
        c[52..56].copy_from_slice(&1u32.to_le_bytes()); // max_write_zeroes_seg
        c
    }
}

/// The plan for a request of type `kind` at `sector` moving `data_len` bytes (for
/// reads and writes), or naming `segment` (discard, write zeroes), on this device. A
/// discard becomes a Dataset Management deallocation whose one range
/// [`discard_range`] writes into the request's buffer. `None`: the device answers
/// UNSUPP (GET_ID is answered without the backend).
pub fn plan(g: &Geometry, kind: u32, sector: u64, data_len: u32, segment: Option<Segment>) -> Option<IoPlan> {
    let block = 1u64 << g.block_shift;
    let range = |sector: u64, len: u64| {
        let offset = sector.checked_mul(512)?;
        let inside = offset.checked_add(len).is_some_and(|end| end <= g.size);
        (inside && offset.is_multiple_of(block) && len.is_multiple_of(block)).then_some(offset)
    };
    let writes = matches!(kind, request_type::OUT | request_type::DISCARD | request_type::WRITE_ZEROES);
    if g.read_only && writes {
        return None;
    }
    match kind {
        request_type::IN if data_len > 0 && data_len <= g.max_request => {
            Some(IoPlan::Read { offset: range(sector, u64::from(data_len))?, len: data_len })
        }
        request_type::OUT if data_len > 0 && data_len <= g.max_request => {
            Some(IoPlan::Write { offset: range(sector, u64::from(data_len))?, len: data_len, fua: false })
        }
        request_type::FLUSH => Some(IoPlan::Flush),
        request_type::DISCARD | request_type::WRITE_ZEROES => {
            let s = segment?;
            if s.sectors == 0 || s.sectors > MAX_ZEROING_SECTORS {
                return None;
            }
            let len = u64::from(s.sectors) << SECTOR_SHIFT;
            let offset = range(s.sector, len)?;
            Some(if kind == request_type::DISCARD {
                IoPlan::DatasetManagement { ranges: 1, deallocate: true, block_shift: g.block_shift }
            } else {
                IoPlan::WriteZeroes { offset, len }
            })
        }
        _ => None,
    }
}

/// Writes a discard segment as the one Dataset Management range its plan reads.
pub fn discard_range(s: &Segment, block_shift: u32, buf: &mut [u8]) {
    let sectors_per_block = 1u64 << (block_shift - SECTOR_SHIFT);
    let range = DsmRange {
        attributes: 0,
        nlb: (u64::from(s.sectors) / sectors_per_block) as u32,
        slba: s.sector / sectors_per_block,
    };
    range.encode(&mut buf[..DSM_RANGE_SIZE]);
}

/// The device serial a GET_ID answers: the namespace's target, cut to 20 bytes (zero
/// padded when shorter, as the spec allows).
pub fn serial(target: &str) -> [u8; ID_BYTES] {
    let mut id = [0u8; ID_BYTES];
    let tail = &target.as_bytes()[target.len().saturating_sub(ID_BYTES)..];
    id[..tail.len()].copy_from_slice(tail);
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::dsm_byte_ranges;

    const G: Geometry =
        Geometry { size: 1 << 20, block_shift: 12, max_request: 128 * 1024, queues: 2, read_only: false };

    #[test]
    fn the_configuration_space_describes_the_namespace() {
        let c = G.config();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048, "capacity in sectors");
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 32, "seg_max");
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096, "blk_size");
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2, "num_queues");
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8, "discard alignment in sectors");
        assert_eq!(G.features() & feature::RO, 0);
        assert_ne!(Geometry { read_only: true, ..G }.features() & feature::RO, 0);
    }

    #[test]
    fn requests_become_the_plans_nvme_commands_would() {
        let h = Header::decode(&[1, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(h, Header { kind: request_type::OUT, sector: 8 });
        assert_eq!(plan(&G, h.kind, h.sector, 4096, None), Some(IoPlan::Write { offset: 4096, len: 4096, fua: false }));
        assert_eq!(plan(&G, request_type::IN, 0, 8192, None), Some(IoPlan::Read { offset: 0, len: 8192 }));
        assert_eq!(plan(&G, request_type::FLUSH, 0, 0, None), Some(IoPlan::Flush));
        let zero = Segment { sector: 16, sectors: 16 };
        assert_eq!(
            plan(&G, request_type::WRITE_ZEROES, 0, 0, Some(zero)),
            Some(IoPlan::WriteZeroes { offset: 8192, len: 8192 })
        );
        let mut buf = [0u8; 16];
        discard_range(&zero, 12, &mut buf);
        assert_eq!(dsm_byte_ranges(&buf, 1, 12).collect::<Vec<_>>(), vec![(8192, 8192)]);
    }

    #[test]
    fn bad_requests_are_unsupported_and_read_only_devices_take_no_writes() {
        assert_eq!(plan(&G, request_type::IN, 2048, 4096, None), None, "past the end");
        assert_eq!(plan(&G, request_type::IN, 1, 4096, None), None, "not block aligned");
        assert_eq!(plan(&G, request_type::IN, 0, 0, None), None, "no data");
        assert_eq!(plan(&G, request_type::DISCARD, 0, 0, None), None, "no segment");
        assert_eq!(plan(&G, 99, 0, 4096, None), None);
        let ro = Geometry { read_only: true, ..G };
        assert_eq!(plan(&ro, request_type::OUT, 0, 4096, None), None);
        assert!(plan(&ro, request_type::IN, 0, 4096, None).is_some());
        assert_eq!(&serial("nqn.x:volume:abc/1")[..4], b"nqn.");
        assert_eq!(&serial("0123456789012345678901234")[..], b"56789012345678901234");
    }
}

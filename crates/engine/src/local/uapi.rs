//! The ublk driver's user interface (Linux `include/uapi/linux/ublk_cmd.h`) as plain
//! byte encodings: control commands, device information, parameters, I/O commands and
//! I/O descriptors. Pure code: no I/O, no `unsafe`.

/// Control command numbers (`UBLK_U_CMD_*`, sent as ioctl encodings on
/// `/dev/ublk-control`).
pub mod ctrl {
    /// Creates `/dev/ublkcN` from a device description.
    pub const ADD_DEV: u32 = iowr(0x04);
    /// Deletes a stopped device.
    pub const DEL_DEV: u32 = iowr(0x05);
    /// Creates `/dev/ublkbN` once every queue has fetched its tags.
    pub const START_DEV: u32 = iowr(0x06);
    /// Removes `/dev/ublkbN` and ends the queues' commands.
    pub const STOP_DEV: u32 = iowr(0x07);
    /// Sets the block device's parameters.
    pub const SET_PARAMS: u32 = iowr(0x08);
    /// Reads a device's description.
    pub const GET_DEV_INFO: u32 = ior(0x02);
    /// Lets a new server take over a device whose server exited.
    pub const START_USER_RECOVERY: u32 = iowr(0x10);
    /// Ends the takeover once the new server fetched every tag.
    pub const END_USER_RECOVERY: u32 = iowr(0x11);
    /// The driver's feature flags.
    pub const GET_FEATURES: u32 = ior(0x13);

    const fn ioc(dir: u32, nr: u32) -> u32 {
        dir << 30 | (super::CTRL_CMD_SIZE as u32) << 16 | (b'u' as u32) << 8 | nr
    }
    const fn iowr(nr: u32) -> u32 {
        ioc(3, nr)
    }
    const fn ior(nr: u32) -> u32 {
        ioc(2, nr)
    }
}

/// I/O command numbers (`UBLK_U_IO_*`, sent on `/dev/ublkcN`).
pub mod io {
    /// Gives the driver a tag to deliver a request on.
    pub const FETCH_REQ: u32 = iowr(0x20);
    /// Completes a tag's request and gives the tag back.
    pub const COMMIT_AND_FETCH_REQ: u32 = iowr(0x21);

    const fn iowr(nr: u32) -> u32 {
        3 << 30 | (super::IO_CMD_SIZE as u32) << 16 | (b'u' as u32) << 8 | nr
    }
}

/// Feature flags (`UBLK_F_*`).
pub mod feature {
    /// Request pages go into the server's io_uring buffer table (Linux 6.15).
    pub const SUPPORT_ZERO_COPY: u64 = 1 << 0;
    /// The device survives its server's exit; new I/O waits for the next server.
    pub const USER_RECOVERY: u64 = 1 << 3;
    /// Requests the exited server held are issued again to the next one.
    pub const USER_RECOVERY_REISSUE: u64 = 1 << 4;
    /// Commands are ioctl encodings.
    pub const CMD_IOCTL_ENCODE: u64 = 1 << 6;
    /// The server copies with pread/pwrite on the char device.
    pub const USER_COPY: u64 = 1 << 7;
    /// Request buffers are registered automatically (Linux 6.16).
    pub const AUTO_BUF_REG: u64 = 1 << 11;
    /// Zero copy as the engine uses it: each request's pages are put in the fetching
    /// ring's buffer table by the driver before delivery and taken out at commit.
    pub const ZERO_COPY: u64 = SUPPORT_ZERO_COPY | AUTO_BUF_REG;
}

/// What a fetch or commit carries in the SQE's `addr` field under
/// [`feature::AUTO_BUF_REG`]: the buffer-table slot where the driver registers the
/// request's pages (bits 0-15; no flags, reserved bits zero).
pub fn auto_buf_reg(slot: u16) -> u64 {
    u64::from(slot)
}

/// Device states (`UBLK_S_DEV_*`).
pub mod state {
    /// Not started, or stopped.
    pub const DEAD: u16 = 0;
    /// Serving.
    pub const LIVE: u16 = 1;
    /// Its server exited; I/O waits for recovery.
    pub const QUIESCED: u16 = 2;
}

/// The result that ends a tag: the device is stopping (`UBLK_IO_RES_ABORT`).
pub const IO_RES_ABORT: i32 = -libc::ENODEV;
/// Deepest queue the driver allows.
pub const MAX_QUEUE_DEPTH: u16 = 4096;
/// Size of a control command (`struct ublksrv_ctrl_cmd`).
pub const CTRL_CMD_SIZE: usize = 32;
/// Size of an I/O command (`struct ublksrv_io_cmd`).
pub const IO_CMD_SIZE: usize = 16;
/// Size of a device description (`struct ublksrv_ctrl_dev_info`).
pub const DEV_INFO_SIZE: usize = 64;
/// Size of one I/O descriptor (`struct ublksrv_io_desc`).
pub const IO_DESC_SIZE: usize = 24;
/// The parameter types written: basic and discard (`struct ublk_params` up to
/// `discard`).
pub const PARAMS_SIZE: usize = 8 + 32 + 20;

/// Where queue `q`'s descriptors are mapped from on `/dev/ublkcN`: every queue has room
/// for the deepest queue, rounded to pages.
pub fn descriptors_offset(q: u16, page: usize) -> u64 {
    let per_queue = (usize::from(MAX_QUEUE_DEPTH) * IO_DESC_SIZE).div_ceil(page) * page;
    u64::from(q) * per_queue as u64
}

/// Bytes to map for a queue of `depth` descriptors.
pub fn descriptors_len(depth: u16, page: usize) -> usize {
    (usize::from(depth) * IO_DESC_SIZE).div_ceil(page) * page
}

/// A control command.
#[derive(Clone, Copy, Debug, Default)]
pub struct CtrlCmd {
    /// The device; `u32::MAX` lets ADD_DEV choose.
    pub dev_id: u32,
    /// The queue; `u16::MAX` for none.
    pub queue_id: u16,
    /// Length of the buffer at `addr`.
    pub len: u16,
    /// A buffer the command reads or fills.
    pub addr: u64,
    /// Inline argument (the server's PID for START_DEV and END_USER_RECOVERY).
    pub data: u64,
}

impl CtrlCmd {
    /// The command's bytes, as the SQE carries them.
    pub fn encode(&self) -> [u8; CTRL_CMD_SIZE] {
        let mut b = [0u8; CTRL_CMD_SIZE];
        b[0..4].copy_from_slice(&self.dev_id.to_ne_bytes());
        b[4..6].copy_from_slice(&self.queue_id.to_ne_bytes());
        b[6..8].copy_from_slice(&self.len.to_ne_bytes());
        b[8..16].copy_from_slice(&self.addr.to_ne_bytes());
        b[16..24].copy_from_slice(&self.data.to_ne_bytes());
        b
    }
}

/// A device description (what ADD_DEV takes and GET_DEV_INFO gives).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DevInfo {
    /// Queues (one per reactor).
    pub queues: u16,
    /// Tags per queue.
    pub depth: u16,
    /// `state::*`.
    pub state: u16,
    /// Largest request, in bytes.
    pub max_io_bytes: u32,
    /// The N of `/dev/ublkbN`; `u32::MAX` asks the driver to choose.
    pub dev_id: u32,
    /// The serving process.
    pub server_pid: i32,
    /// `feature::*` asked for, then granted.
    pub flags: u64,
}

impl DevInfo {
    /// The description's bytes.
    pub fn encode(&self) -> [u8; DEV_INFO_SIZE] {
        let mut b = [0u8; DEV_INFO_SIZE];
        b[0..2].copy_from_slice(&self.queues.to_ne_bytes());
        b[2..4].copy_from_slice(&self.depth.to_ne_bytes());
        b[4..6].copy_from_slice(&self.state.to_ne_bytes());
        b[8..12].copy_from_slice(&self.max_io_bytes.to_ne_bytes());
        b[12..16].copy_from_slice(&self.dev_id.to_ne_bytes());
        b[16..20].copy_from_slice(&self.server_pid.to_ne_bytes());
        b[24..32].copy_from_slice(&self.flags.to_ne_bytes());
        b
    }

    /// Reads a description the driver filled in.
    pub fn decode(b: &[u8; DEV_INFO_SIZE]) -> DevInfo {
        let u16_at = |i: usize| u16::from_ne_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        DevInfo {
            queues: u16_at(0),
            depth: u16_at(2),
            state: u16_at(4),
            max_io_bytes: u32_at(8),
            dev_id: u32_at(12),
            server_pid: u32_at(16) as i32,
            flags: u64::from_ne_bytes(b[24..32].try_into().expect("8 bytes")),
        }
    }
}

/// Block device attributes (`UBLK_ATTR_*`).
pub mod attr {
    /// Writes are refused.
    pub const READ_ONLY: u32 = 1 << 0;
    /// The device has a write cache: the kernel sends flushes.
    pub const VOLATILE_CACHE: u32 = 1 << 2;
    /// The device takes FUA writes.
    pub const FUA: u32 = 1 << 3;
}

/// The block device's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// `attr::*`.
    pub attrs: u32,
    /// log2 of the logical block size.
    pub block_shift: u8,
    /// Size in 512-byte sectors.
    pub sectors: u64,
    /// Largest request in sectors.
    pub max_sectors: u32,
    /// Largest discard (and write zeroes) in sectors; 0 for none.
    pub max_discard_sectors: u32,
}

impl Params {
    /// The parameters' bytes: header, basic and discard parameters.
    pub fn encode(&self) -> [u8; PARAMS_SIZE] {
        const BASIC: u32 = 1 << 0;
        const DISCARD: u32 = 1 << 1;
        let mut b = [0u8; PARAMS_SIZE];
        let types = if self.max_discard_sectors > 0 { BASIC | DISCARD } else { BASIC };
        b[0..4].copy_from_slice(&(PARAMS_SIZE as u32).to_ne_bytes());
        b[4..8].copy_from_slice(&types.to_ne_bytes());
        // basic: attrs, logical/physical/io_opt/io_min shifts, max_sectors,
        // chunk_sectors, dev_sectors, virt_boundary_mask
        let basic = &mut b[8..40];
        basic[0..4].copy_from_slice(&self.attrs.to_ne_bytes());
        basic[4..8].copy_from_slice(&[self.block_shift; 4]);
        basic[8..12].copy_from_slice(&self.max_sectors.to_ne_bytes());
        basic[16..24].copy_from_slice(&self.sectors.to_ne_bytes());
        // discard: alignment, granularity, max discard sectors, max write zeroes
        // sectors, max segments (the driver takes one)
        let discard = &mut b[40..60];
        if self.max_discard_sectors > 0 {
            discard[4..8].copy_from_slice(&(1u32 << self.block_shift).to_ne_bytes());
            discard[8..12].copy_from_slice(&self.max_discard_sectors.to_ne_bytes());
            discard[12..16].copy_from_slice(&self.max_discard_sectors.to_ne_bytes());
            discard[16..18].copy_from_slice(&1u16.to_ne_bytes());
        }
        b
    }
}

/// An I/O command: fetch a tag, or commit its result and fetch it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoCmd {
    /// Queue.
    pub queue: u16,
    /// Tag.
    pub tag: u16,
    /// The request's result: bytes done, or a negative errno (commits only).
    pub result: i32,
    /// The tag's buffer, where the driver copies a write's data and takes a read's.
    pub buf_addr: u64,
}

impl IoCmd {
    /// The command's bytes, as the SQE carries them.
    pub fn encode(&self) -> [u8; IO_CMD_SIZE] {
        let mut b = [0u8; IO_CMD_SIZE];
        b[0..2].copy_from_slice(&self.queue.to_ne_bytes());
        b[2..4].copy_from_slice(&self.tag.to_ne_bytes());
        b[4..8].copy_from_slice(&self.result.to_ne_bytes());
        b[8..16].copy_from_slice(&self.buf_addr.to_ne_bytes());
        b
    }
}

/// Request operations (`UBLK_IO_OP_*`).
pub mod op {
    /// Read.
    pub const READ: u8 = 0;
    /// Write.
    pub const WRITE: u8 = 1;
    /// Flush the write cache.
    pub const FLUSH: u8 = 2;
    /// Discard (deallocate).
    pub const DISCARD: u8 = 3;
    /// Write zeroes.
    pub const WRITE_ZEROES: u8 = 5;
}

/// A request flag: durable before completion (`UBLK_IO_F_FUA`).
pub const IO_F_FUA: u32 = 1 << 13;

/// A request the driver delivered on a tag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoDesc {
    /// `op::*`.
    pub op: u8,
    /// `IO_F_*` flags (bits 8 and up of the driver's word, in place).
    pub flags: u32,
    /// Length in 512-byte sectors.
    pub sectors: u32,
    /// First 512-byte sector.
    pub start_sector: u64,
}

impl IoDesc {
    /// Reads a descriptor.
    pub fn decode(b: &[u8; IO_DESC_SIZE]) -> IoDesc {
        let op_flags = u32::from_ne_bytes(b[0..4].try_into().expect("4 bytes"));
        IoDesc {
            op: op_flags as u8,
            flags: op_flags & !0xFF,
            sectors: u32::from_ne_bytes(b[4..8].try_into().expect("4 bytes")),
            start_sector: u64::from_ne_bytes(b[8..16].try_into().expect("8 bytes")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_auto_registration_slot_is_the_low_bits_of_addr() {
        assert_eq!(auto_buf_reg(0x1234), 0x1234);
        assert_eq!(feature::ZERO_COPY, 0x801);
    }

    #[test]
    fn command_numbers_are_the_drivers_ioctl_encodings() {
        // _IOWR('u', 0x04, 32 bytes) and _IOR('u', 0x13, 32 bytes); _IOWR('u', 0x21, 16).
        assert_eq!(ctrl::ADD_DEV, 0xC020_7504);
        assert_eq!(ctrl::GET_FEATURES, 0x8020_7513);
        assert_eq!(io::COMMIT_AND_FETCH_REQ, 0xC010_7521);
    }

    #[test]
    fn descriptions_round_trip_and_fields_sit_where_the_driver_reads_them() {
        let info = DevInfo {
            queues: 2,
            depth: 128,
            state: state::LIVE,
            max_io_bytes: 128 << 10,
            dev_id: 7,
            server_pid: 42,
            flags: feature::USER_RECOVERY,
        };
        let b = info.encode();
        assert_eq!(DevInfo::decode(&b), info);
        assert_eq!(&b[12..16], &7u32.to_ne_bytes(), "dev_id follows max_io_buf_bytes");
        let p =
            Params { attrs: attr::FUA, block_shift: 12, sectors: 1 << 21, max_sectors: 256, max_discard_sectors: 8 };
        let b = p.encode();
        assert_eq!(&b[0..8], &[60, 0, 0, 0, 3, 0, 0, 0]);
        assert_eq!(b[12], 12, "logical block shift");
        assert_eq!(&b[24..32], &(1u64 << 21).to_ne_bytes(), "dev_sectors");
        assert_eq!(&b[56..58], &1u16.to_ne_bytes(), "one discard segment");
    }

    #[test]
    fn descriptors_are_read_in_place_and_queues_are_a_deepest_queue_apart() {
        let mut b = [0u8; IO_DESC_SIZE];
        b[0..4].copy_from_slice(&(u32::from(op::WRITE) | IO_F_FUA).to_ne_bytes());
        b[4..8].copy_from_slice(&8u32.to_ne_bytes());
        b[8..16].copy_from_slice(&100u64.to_ne_bytes());
        let d = IoDesc::decode(&b);
        assert_eq!((d.op, d.flags, d.sectors, d.start_sector), (op::WRITE, IO_F_FUA, 8, 100));
        assert_eq!(descriptors_offset(1, 4096), 24 * 4096);
        assert_eq!(descriptors_len(128, 4096), 4096);
    }
}

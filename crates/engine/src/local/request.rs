//! What a block request delivered by a local device asks of the namespace: the same
//! [`IoPlan`] an NVMe command becomes, so backends serve both alike.

use nvpool_wire::command::{DSM_RANGE_SIZE, DsmRange};

use super::uapi::{IO_F_FUA, IoDesc, op};
use crate::plan::IoPlan;

/// Why a request is refused, as the errno the block layer gets.
pub type Refusal = i32;

/// The plan for request `d` on a namespace of `size` bytes with `1 << block_shift`
/// byte blocks. A discard becomes a Dataset Management deallocation whose one range
/// [`discard_range`] writes into the request's buffer.
pub fn plan(d: &IoDesc, block_shift: u32, size: u64, read_only: bool) -> Result<IoPlan, Refusal> {
    // A flush names no range (the block layer gives it sector -1).
    if d.op == op::FLUSH {
        return Ok(IoPlan::Flush);
    }
    let offset = d.start_sector.checked_mul(512).ok_or(libc::EINVAL)?;
    let len = u64::from(d.sectors) * 512;
    let block = 1u64 << block_shift;
    let inside = offset.checked_add(len).is_some_and(|end| end <= size);
    let aligned = offset % block == 0 && len % block == 0;
    let writes = matches!(d.op, op::WRITE | op::DISCARD | op::WRITE_ZEROES);
    if read_only && writes {
        return Err(libc::EROFS);
    }
    if !inside || !aligned {
        return Err(libc::EINVAL);
    }
    match d.op {
        op::READ => Ok(IoPlan::Read { offset, len: len as u32 }),
        op::WRITE => Ok(IoPlan::Write { offset, len: len as u32, fua: d.flags & IO_F_FUA != 0 }),
        op::WRITE_ZEROES => Ok(IoPlan::WriteZeroes { offset, len }),
        op::DISCARD if (len >> block_shift) <= u64::from(u32::MAX) => {
            Ok(IoPlan::DatasetManagement { ranges: 1, deallocate: true, block_shift })
        }
        _ => Err(libc::EOPNOTSUPP),
    }
}

/// Writes a discard's one range into `buf`, where the Dataset Management plan reads it.
pub fn discard_range(d: &IoDesc, block_shift: u32, buf: &mut [u8]) {
    let sectors_per_block = 1u64 << (block_shift - 9);
    let range = DsmRange {
        attributes: 0,
        nlb: (u64::from(d.sectors) / sectors_per_block) as u32,
        slba: d.start_sector / sectors_per_block,
    };
    range.encode(&mut buf[..DSM_RANGE_SIZE]);
}

/// What the driver is told when a request ends: the bytes moved for reads and writes,
/// 0 for the rest, or a negative errno.
pub fn result(plan: &IoPlan, ok: bool) -> i32 {
    match (ok, plan) {
        (false, _) => -libc::EIO,
        (true, IoPlan::Read { len, .. } | IoPlan::Write { len, .. }) => *len as i32,
        (true, _) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::dsm_byte_ranges;

    fn desc(op: u8, start_sector: u64, sectors: u32) -> IoDesc {
        IoDesc { op, flags: 0, sectors, start_sector }
    }

    #[test]
    fn requests_become_the_plans_nvme_commands_would() {
        assert_eq!(plan(&desc(op::READ, 8, 8), 12, 1 << 20, false), Ok(IoPlan::Read { offset: 4096, len: 4096 }));
        let fua = IoDesc { flags: IO_F_FUA, ..desc(op::WRITE, 0, 1) };
        assert_eq!(plan(&fua, 9, 1 << 20, false), Ok(IoPlan::Write { offset: 0, len: 512, fua: true }));
        assert_eq!(plan(&desc(op::FLUSH, u64::MAX, 0), 9, 1 << 20, false), Ok(IoPlan::Flush), "sector -1");
        assert_eq!(
            plan(&desc(op::WRITE_ZEROES, 2, 2), 9, 1 << 20, false),
            Ok(IoPlan::WriteZeroes { offset: 1024, len: 1024 })
        );
    }

    #[test]
    fn bad_requests_are_refused_and_read_only_devices_take_no_writes() {
        assert_eq!(plan(&desc(op::READ, 2048, 8), 9, 1 << 20, false), Err(libc::EINVAL), "past the end");
        assert_eq!(plan(&desc(op::READ, 1, 8), 12, 1 << 20, false), Err(libc::EINVAL), "not block aligned");
        assert_eq!(plan(&desc(op::WRITE, 0, 8), 9, 1 << 20, true), Err(libc::EROFS));
        assert_eq!(plan(&desc(op::DISCARD, 0, 8), 9, 1 << 20, true), Err(libc::EROFS));
        assert!(plan(&desc(op::READ, 0, 8), 9, 1 << 20, true).is_ok());
        assert_eq!(plan(&desc(4, 0, 8), 9, 1 << 20, false), Err(libc::EOPNOTSUPP), "write same");
    }

    #[test]
    fn a_discard_is_one_deallocated_range_in_blocks() {
        let d = desc(op::DISCARD, 16, 32);
        assert_eq!(
            plan(&d, 12, 1 << 20, false),
            Ok(IoPlan::DatasetManagement { ranges: 1, deallocate: true, block_shift: 12 })
        );
        let mut buf = [0u8; 16];
        discard_range(&d, 12, &mut buf);
        assert_eq!(dsm_byte_ranges(&buf, 1, 12).collect::<Vec<_>>(), vec![(8192, 16384)]);
        assert_eq!(result(&IoPlan::Read { offset: 0, len: 4096 }, true), 4096);
        assert_eq!(result(&IoPlan::Flush, true), 0);
        assert_eq!(result(&IoPlan::Flush, false), -libc::EIO);
    }
}

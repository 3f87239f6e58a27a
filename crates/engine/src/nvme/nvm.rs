//! NVM I/O commands (NVM Command Set 1.0 §3): validation and the disk work they need.

use nvpool_wire::Status;
use nvpool_wire::command::{Command, DSM_ATTR_DEALLOCATE, DSM_RANGE_SIZE, io_opcode};

use super::Namespace;
use super::data_pointer::{self, Direction, Length, Source};
use crate::plan::IoPlan;

fn range(ns: &Namespace, slba: u64, nlb: u64) -> Result<(u64, u64), Status> {
    match slba.checked_add(nlb) {
        Some(end) if end <= ns.blocks => Ok((slba << ns.block_shift, nlb << ns.block_shift)),
        _ => Err(Status::LBA_OUT_OF_RANGE.with_dnr()),
    }
}

/// Validates an NVM command, with `in_capsule` bytes of data in its capsule, against
/// its namespace. Says what disk work it needs and, for a command with data, where
/// the host's data is.
pub fn plan(ns: &Namespace, cmd: &Command, in_capsule: usize) -> Result<(IoPlan, Option<Source>), Status> {
    match cmd.opcode {
        io_opcode::READ | io_opcode::WRITE => {
            let (offset, len) = range(ns, cmd.slba(), u64::from(cmd.nlb()))?;
            let direction = if cmd.opcode == io_opcode::READ { Direction::ToHost } else { Direction::FromHost };
            let source = data_pointer::check(&cmd.dptr, direction, Length::Exactly(len), in_capsule)?;
            // Within MDTS, as the check above made sure.
            let len = len as u32;
            let plan = if cmd.opcode == io_opcode::READ {
                IoPlan::Read { offset, len }
            } else {
                IoPlan::Write { offset, len, fua: cmd.fua() }
            };
            Ok((plan, Some(source)))
        }
        io_opcode::FLUSH => Ok((IoPlan::Flush, None)),
        io_opcode::WRITE_ZEROES => {
            let (offset, len) = range(ns, cmd.slba(), u64::from(cmd.nlb()))?;
            Ok((IoPlan::WriteZeroes { offset, len }, None))
        }
        io_opcode::DATASET_MANAGEMENT => {
            let ranges = (cmd.cdw10() & 0xFF) + 1;
            // Linux describes its whole range buffer, which may hold more ranges than NR.
            let need = Length::AtLeast(u64::from(ranges) * DSM_RANGE_SIZE as u64);
            let source = data_pointer::check(&cmd.dptr, Direction::FromHost, need, in_capsule)?;
            let plan = IoPlan::DatasetManagement {
                ranges,
                deallocate: cmd.cdw11() & DSM_ATTR_DEALLOCATE != 0,
                block_shift: ns.block_shift,
            };
            Ok((plan, Some(source)))
        }
        _ => Err(Status::INVALID_OPCODE.with_dnr()),
    }
}

/// Checks the Dataset Management ranges in a command's data against the namespace.
pub fn check_dsm_ranges(ns: &Namespace, data: &[u8], ranges: u32) -> Result<(), Status> {
    data.chunks_exact(DSM_RANGE_SIZE)
        .take(ranges as usize)
        .map(nvpool_wire::command::DsmRange::decode)
        .filter(|r| r.nlb > 0)
        .try_for_each(|r| range(ns, r.slba, u64::from(r.nlb)).map(drop))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::null::Null;
    use crate::plan::dsm_byte_ranges;
    use nvpool_wire::command::{DsmRange, SglDescriptor, sgl};
    use std::sync::Arc;

    fn ns() -> Namespace {
        Namespace::new(1, Arc::new(Null::new(1 << 20)), 512, [1; 16], [1; 16]).unwrap()
    }

    fn status(r: Result<(IoPlan, Option<Source>), Status>) -> Status {
        r.unwrap_err().base()
    }

    #[test]
    fn reads_and_writes_are_checked() {
        let ns = ns();
        let c = Command::read_write(io_opcode::READ, 1, 1, 8, 8, 4096);
        assert_eq!(plan(&ns, &c, 0), Ok((IoPlan::Read { offset: 4096, len: 4096 }, Some(Source::Transport))));
        let past_end = Command::read_write(io_opcode::WRITE, 1, 1, 2047, 2, 1024);
        assert_eq!(status(plan(&ns, &past_end, 0)), Status::LBA_OUT_OF_RANGE);
        let overflow = Command::read_write(io_opcode::READ, 1, 1, u64::MAX, 2, 1024);
        assert_eq!(status(plan(&ns, &overflow, 0)), Status::LBA_OUT_OF_RANGE);
        let too_big = Command::read_write(io_opcode::READ, 1, 1, 0, 512, 512 * 512);
        assert_eq!(status(plan(&ns, &too_big, 0)), Status::INVALID_FIELD);
        let wrong_sgl = Command::read_write(io_opcode::READ, 1, 1, 0, 1, 4096);
        assert_eq!(status(plan(&ns, &wrong_sgl, 0)), Status::SGL_LENGTH_INVALID);
        let unknown = Command { opcode: 0x7E, ..c };
        assert_eq!(status(plan(&ns, &unknown, 0)), Status::INVALID_OPCODE);
    }

    #[test]
    fn writes_take_only_the_two_nvme_tcp_descriptors() {
        let ns = ns();
        let w = Command::read_write(io_opcode::WRITE, 1, 1, 0, 1, 512);
        assert_eq!(plan(&ns, &w, 0).unwrap().1, Some(Source::Transport));
        let in_capsule = Command { dptr: SglDescriptor { id: sgl::IN_CAPSULE, ..w.dptr }, ..w };
        assert_eq!(plan(&ns, &in_capsule, 512).unwrap().1, Some(Source::InCapsule { offset: 0 }));
        assert_eq!(status(plan(&ns, &in_capsule, 100)), Status::SGL_LENGTH_INVALID);
        for id in [0x00, 0x02, 0x30, 0x20, 0x5F] {
            let odd = Command { dptr: SglDescriptor { id, ..w.dptr }, ..w };
            assert_eq!(status(plan(&ns, &odd, 512)), Status::SGL_TYPE_INVALID, "id {id:#x}");
        }
    }

    #[test]
    fn dsm_ranges_are_checked() {
        let ns = ns();
        let c = Command {
            opcode: io_opcode::DATASET_MANAGEMENT,
            dptr: SglDescriptor { length: 4096, id: sgl::TRANSPORT, ..SglDescriptor::default() },
            cdw: [1, DSM_ATTR_DEALLOCATE, 0, 0, 0, 0],
            ..Command::default()
        };
        let dsm = IoPlan::DatasetManagement { ranges: 2, deallocate: true, block_shift: 9 };
        assert_eq!(plan(&ns, &c, 0), Ok((dsm, Some(Source::Transport))));
        let short = Command { dptr: SglDescriptor { length: 16, ..c.dptr }, ..c };
        assert_eq!(status(plan(&ns, &short, 0)), Status::SGL_LENGTH_INVALID);
        let mut d = [0u8; 32];
        DsmRange { attributes: 0, nlb: 8, slba: 0 }.encode(&mut d[..16]);
        DsmRange { attributes: 0, nlb: 8, slba: 2048 }.encode(&mut d[16..]);
        assert_eq!(check_dsm_ranges(&ns, &d, 2).unwrap_err().base(), Status::LBA_OUT_OF_RANGE);
        DsmRange { attributes: 0, nlb: 8, slba: 16 }.encode(&mut d[16..]);
        assert_eq!(check_dsm_ranges(&ns, &d, 2), Ok(()));
        assert_eq!(dsm_byte_ranges(&d, 2, 9).collect::<Vec<_>>(), vec![(0, 4096), (8192, 4096)]);
    }
}

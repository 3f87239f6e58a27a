//! `file:PATH[:SIZE]`: a regular file or a block device (a [`Disk`]), opened with
//! `O_DIRECT` where the filesystem supports it. Flush is `fdatasync`; FUA writes use
//! `RWF_DSYNC`; Write Zeroes zeroes in place and deallocation punches holes.

use std::path::PathBuf;

use nvpool_wire::Status;

use super::{Backend, BackendType, BlockIo, DiskQueue, Handover, OpenEnv, Opened, deallocated_ranges, size_arg};
use crate::disk::{Disk, PUNCH_HOLE, ZERO_RANGE};
use crate::error::Error;
use crate::plan::IoPlan;

/// The registration of `file:PATH[:SIZE]`.
pub const TYPE: BackendType = BackendType {
    name: "file",
    usage: "file:PATH, file:PATH:SIZE",
    check: |arg| parse(arg).map(drop),
    open: |arg, _: &OpenEnv<'_>| {
        let (path, size) = parse(arg).map_err(Error::invalid)?;
        Opened::plain(FileBackend(Disk::open(&path, size)?))
    },
};

/// `PATH` or `PATH:SIZE`: a trailing `:SIZE` is a size only if it parses as one.
fn parse(arg: &str) -> std::result::Result<(PathBuf, Option<u64>), String> {
    if arg.is_empty() {
        return Err("no path".into());
    }
    Ok(match arg.rsplit_once(':') {
        Some((path, size)) if size_arg(size).is_ok() => (PathBuf::from(path), Some(size_arg(size)?)),
        _ => (PathBuf::from(arg), None),
    })
}

/// A namespace on a file or block device.
#[derive(Debug)]
pub struct FileBackend(Disk);

impl Backend for FileBackend {
    fn kind(&self) -> &'static str {
        "file"
    }

    fn size(&self) -> u64 {
        self.0.size()
    }

    fn description(&self) -> String {
        self.0.path().display().to_string()
    }

    fn handover(&self) -> Handover<'_> {
        Handover::Spec(format!("file:{}", self.0.path().display()))
    }

    fn direct_io(&self) -> bool {
        self.0.direct_io()
    }

    fn power_fail_atomic_bytes(&self) -> u32 {
        self.0.power_fail_atomic_bytes()
    }

    /// Block devices may ignore a discard, so there deallocation is only advisory.
    fn deallocated_reads_zeroes(&self) -> bool {
        !self.0.is_block_device()
    }

    fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        let disk = self.0.disk_fd();
        match io.plan {
            IoPlan::Read { offset, len } => {
                queue.give_buf(io, len as usize);
                if !queue.read(io, disk, 0, len, offset) {
                    io.status = Status::INTERNAL_ERROR;
                }
            }
            IoPlan::Write { offset, len, fua } => {
                if !queue.write(io, disk, 0, len, offset, fua) {
                    io.status = Status::INTERNAL_ERROR;
                }
            }
            IoPlan::Flush => queue.sync(io, disk),
            IoPlan::WriteZeroes { offset, len } => queue.fallocate(io, disk, ZERO_RANGE, offset, len),
            IoPlan::DatasetManagement { deallocate: true, .. } => {
                let (ranges, n) = deallocated_ranges(io);
                for &(offset, len) in &ranges[..n] {
                    queue.fallocate(io, disk, PUNCH_HOLE, offset, len);
                }
            }
            IoPlan::DatasetManagement { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trailing_size_is_a_size_only_if_it_parses() {
        assert_eq!(parse("/a/b"), Ok(("/a/b".into(), None)));
        assert_eq!(parse("/a/b:1M"), Ok(("/a/b".into(), Some(1 << 20))));
        assert_eq!(parse("/a:b"), Ok(("/a:b".into(), None)));
        assert!(parse("").is_err());
    }
}

//! `memory:SIZE`: RAM. A memfd of the namespace's size, mapped once and shared by every
//! reactor. Reads and writes copy to and from the mapping directly; a read without data
//! digests is sent straight from it. Zeroing and deallocation punch holes in the memfd.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nvpool_wire::Status;

use super::{Backend, BackendType, BlockIo, DiskFd, DiskQueue, OpenEnv, Opened, deallocated_ranges, size_arg};
use crate::error::{Error, Result};
use crate::nvme::nvm::IoPlan;

/// The registration of `memory:SIZE`.
pub const TYPE: BackendType = BackendType {
    name: "memory",
    usage: "memory:SIZE",
    check: |arg| size_arg(arg).map(drop),
    open: |arg, _: &OpenEnv<'_>| Opened::plain(Memory::new(size_arg(arg)?)?),
};

/// Holes punched in shmem read back as zeroes (it cannot zero in place).
const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;

/// The RAM mapping. Concurrent I/O to overlapping ranges leaves unspecified bytes
/// there, as it would on a disk.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory that lives as long as `Mapping`; every
// access goes through bounds-checked copies, so sharing the pointer between threads is
// sound.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize) -> Result<Mapping> {
        // SAFETY: maps `len` bytes of a memfd we own, shared, with no fixed address; the
        // result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                // Populated up front, like SPDK's malloc bdev: the RAM is the namespace,
                // and page faults on first touch would otherwise dominate I/O latency.
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io("cannot map the memory backend", std::io::Error::last_os_error()));
        }
        Ok(Mapping { ptr: ptr.cast(), len })
    }

    fn range(&self, offset: u64, len: usize) -> Option<usize> {
        let start = usize::try_from(offset).ok()?;
        (start.checked_add(len)? <= self.len).then_some(start)
    }

    fn read(&self, offset: u64, dst: &mut [u8]) -> bool {
        let Some(start) = self.range(offset, dst.len()) else { return false };
        // SAFETY: `range` checked that [start, start + len) lies inside the mapping, and
        // `dst` is a distinct Rust buffer of that length.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(start), dst.as_mut_ptr(), dst.len()) };
        true
    }

    fn address(&self, offset: u64, len: usize) -> Option<*const u8> {
        let start = self.range(offset, len)?;
        Some(self.ptr.wrapping_add(start).cast_const())
    }

    fn write(&self, offset: u64, src: &[u8]) -> bool {
        let Some(start) = self.range(offset, src.len()) else { return false };
        // SAFETY: as in `read`, with the copy going the other way.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(start), src.len()) };
        true
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` created; nothing uses it after drop.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A namespace in RAM.
#[derive(Debug)]
pub struct Memory {
    // Declared before the memfd so the mapping goes first.
    ram: Mapping,
    fd: OwnedFd,
    size: u64,
}

impl Memory {
    /// A RAM backend of `size` bytes.
    pub fn new(size: u64) -> Result<Memory> {
        // SAFETY: memfd_create reads a NUL-terminated name and returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"nvpool-memory-bdev".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: fd was just returned by memfd_create and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(|e| Error::io(format!("cannot size the memory backend to {size} bytes"), e))?;
        let len = usize::try_from(size).map_err(|_| Error::invalid(format!("memory:{size} does not fit in memory")))?;
        let fd: OwnedFd = file.into();
        Ok(Memory { ram: Mapping::new(&fd, len)?, fd, size })
    }

    fn memfd(&self) -> DiskFd {
        DiskFd::new(self.fd.as_raw_fd(), false)
    }
}

impl Backend for Memory {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn description(&self) -> String {
        format!("memory:{}", self.size)
    }

    fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>) {
        match io.plan {
            // Sent from the RAM itself (see `mapped`); only the range is checked.
            IoPlan::Read { offset, len } if !queue.needs_bytes => {
                if self.ram.address(offset, len as usize).is_none() {
                    io.status = Status::INTERNAL_ERROR;
                }
            }
            IoPlan::Read { offset, len } => {
                queue.give_buf(io, len as usize);
                let copied = io.data_mut().is_some_and(|d| self.ram.read(offset, &mut d[..len as usize]));
                if !copied {
                    io.status = Status::INTERNAL_ERROR;
                }
            }
            IoPlan::Write { offset, len, .. } => {
                let copied = io.data().is_some_and(|d| self.ram.write(offset, &d[..len as usize]));
                if !copied {
                    io.status = Status::INTERNAL_ERROR;
                }
            }
            IoPlan::Flush => {}
            IoPlan::WriteZeroes { offset, len } => queue.fallocate(io, self.memfd(), PUNCH_HOLE, offset, len),
            IoPlan::DatasetManagement { deallocate: true, .. } => {
                let (ranges, n) = deallocated_ranges(io);
                for &(offset, len) in &ranges[..n] {
                    queue.fallocate(io, self.memfd(), PUNCH_HOLE, offset, len);
                }
            }
            IoPlan::DatasetManagement { .. } => {}
        }
    }

    fn mapped(&self, offset: u64, len: usize) -> Option<*const u8> {
        self.ram.address(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_backend_has_its_size_and_bounds() {
        let b = Memory::new(8 << 20).unwrap();
        assert_eq!(b.size(), 8 << 20);
        assert!(b.ram.write(4096, &[7u8; 512]));
        let mut back = [0u8; 1024];
        assert!(b.ram.read(4096 - 512, &mut back));
        assert_eq!(&back[..512], &[0u8; 512][..]);
        assert_eq!(&back[512..], &[7u8; 512][..]);
        assert!(!b.ram.read((8 << 20) - 100, &mut back), "reads past the end are refused");
        assert!(!b.ram.write(u64::MAX, &[0u8; 1]));
        assert!(b.mapped((8 << 20) - 4096, 4096).is_some());
        assert!(b.mapped((8 << 20) - 4095, 4096).is_none());
    }
}

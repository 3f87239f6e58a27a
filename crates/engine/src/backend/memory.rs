//! `memory:SIZE`: RAM. A memfd of the namespace's size, mapped once and shared by every
//! reactor. Reads and writes copy to and from the mapping directly; a read without data
//! digests is sent straight from it. Zeroing and deallocation punch holes in the memfd.
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use nvpool_wire::Status;

use super::{
    Backend, BackendType, BlockIo, DiskFd, DiskQueue, Handover, OpenEnv, Opened, deallocated_ranges, size_arg,
};
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

/// The RAM mapping. Reactors copy in and out of it at the same time, and two hosts may
/// write one range at once, so every access from Rust is a relaxed atomic copy: a race
/// is then defined, and leaves each word old or new, as a disk leaves each sector.
/// The kernel reads it directly for sends and punches holes in it.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

/// When a mapping's page tables are made.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PageTables {
    /// At once, like SPDK's malloc bdev: the RAM is the namespace, and zero-filling
    /// faults on first touch would otherwise be in the I/O latency.
    Now,
    /// On first touch, one minor fault per page: a hot upgrade maps RAM that is already
    /// there, beside a serving engine, and making the page tables of a large namespace
    /// at once would take the reactors' CPU for tens of milliseconds (0.75 us a page
    /// here). A thread making them in the background at idle priority was tried: it
    /// holds the address space's lock when preempted, and starves everything that maps
    /// memory behind it.
    OnFirstTouch,
}

// SAFETY: the mapping lives as long as `Mapping` and Rust touches it only through
// bounds-checked atomic copies (`copy_out`, `copy_in`), which any number of threads may
// run at once.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(fd: &OwnedFd, len: usize, tables: PageTables) -> Result<Mapping> {
        let populate = if tables == PageTables::Now { libc::MAP_POPULATE } else { 0 };
        // SAFETY: maps `len` bytes of a memfd we own, shared, with no fixed address; the
        // result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | populate,
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
        // SAFETY: `range` checked that [start, start + len) lies inside the mapping.
        unsafe { copy_out(self.ptr.add(start), dst) };
        true
    }

    fn address(&self, offset: u64, len: usize) -> Option<*const u8> {
        let start = self.range(offset, len)?;
        Some(self.ptr.wrapping_add(start).cast_const())
    }

    fn write(&self, offset: u64, src: &[u8]) -> bool {
        let Some(start) = self.range(offset, src.len()) else { return false };
        // SAFETY: as in `read`.
        unsafe { copy_in(src, self.ptr.add(start)) };
        true
    }
}

/// Splits `len` bytes from `addr` into a head of single bytes up to 8-byte alignment,
/// whole 8-byte words, and a tail of single bytes; returns (head, words).
fn word_split(addr: usize, len: usize) -> (usize, usize) {
    let head = addr.wrapping_neg() % 8;
    if head >= len {
        return (len, 0);
    }
    (head, (len - head) / 8)
}

/// Copies `dst.len()` bytes out of shared memory at `src` with relaxed atomic loads.
///
/// # Safety
/// `src..src + dst.len()` must be mapped, writable memory that Rust touches only
/// through atomic accesses while this runs.
unsafe fn copy_out(src: *const u8, dst: &mut [u8]) {
    let (head, words) = word_split(src as usize, dst.len());
    let src = src.cast_mut();
    for (i, d) in dst.iter_mut().enumerate().take(head) {
        // SAFETY: in bounds by the caller's promise; AtomicU8 has no alignment need.
        *d = unsafe { AtomicU8::from_ptr(src.add(i)) }.load(Ordering::Relaxed);
    }
    for w in 0..words {
        let at = head + w * 8;
        // SAFETY: in bounds, and `word_split` made `src + at` 8-byte aligned.
        let v = unsafe { AtomicU64::from_ptr(src.add(at).cast::<u64>()) }.load(Ordering::Relaxed);
        dst[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    }
    for (i, d) in dst.iter_mut().enumerate().skip(head + words * 8) {
        // SAFETY: as for the head.
        *d = unsafe { AtomicU8::from_ptr(src.add(i)) }.load(Ordering::Relaxed);
    }
}

/// Copies `src` into shared memory at `dst` with relaxed atomic stores.
///
/// # Safety
/// As for [`copy_out`], for `dst..dst + src.len()`.
unsafe fn copy_in(src: &[u8], dst: *mut u8) {
    let (head, words) = word_split(dst as usize, src.len());
    for (i, &b) in src.iter().enumerate().take(head) {
        // SAFETY: in bounds by the caller's promise; AtomicU8 has no alignment need.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(b, Ordering::Relaxed);
    }
    for w in 0..words {
        let at = head + w * 8;
        let v = u64::from_ne_bytes(src[at..at + 8].try_into().expect("an 8-byte word"));
        // SAFETY: in bounds, and `word_split` made `dst + at` 8-byte aligned.
        unsafe { AtomicU64::from_ptr(dst.add(at).cast::<u64>()) }.store(v, Ordering::Relaxed);
    }
    for (i, &b) in src.iter().enumerate().skip(head + words * 8) {
        // SAFETY: as for the head.
        unsafe { AtomicU8::from_ptr(dst.add(i)) }.store(b, Ordering::Relaxed);
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
        Ok(Memory { ram: Mapping::new(&fd, len, PageTables::Now)?, fd, size })
    }

    /// A RAM backend over the memfd of another engine process, data and all (a hot
    /// upgrade): its pages are mapped as they are first touched.
    pub fn from_memfd(fd: OwnedFd, size: u64) -> Result<Memory> {
        let len = usize::try_from(size).map_err(|_| Error::invalid(format!("memory:{size} does not fit in memory")))?;
        Ok(Memory { ram: Mapping::new(&fd, len, PageTables::OnFirstTouch)?, fd, size })
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

    fn handover(&self) -> Handover<'_> {
        Handover::Memfd { fd: self.fd.as_fd(), size: self.size }
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

    #[test]
    fn copies_of_any_alignment_and_length_round_trip() {
        let b = Memory::new(1 << 16).unwrap();
        for (offset, len) in [(0u64, 0usize), (0, 1), (3, 5), (5, 8), (7, 9), (1, 4096), (4096, 4096), (13, 1000)] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + offset as usize) as u8).collect();
            assert!(b.ram.write(offset, &data));
            let mut back = vec![0u8; len];
            assert!(b.ram.read(offset, &mut back));
            assert_eq!(back, data, "offset {offset} length {len}");
        }
    }

    #[test]
    fn two_threads_writing_one_range_leave_whole_words_of_either() {
        let b = std::sync::Arc::new(Memory::new(1 << 16).unwrap());
        let writers: Vec<_> = [0x11u8, 0x22]
            .into_iter()
            .map(|v| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        assert!(b.ram.write(0, &[v; 4096]));
                    }
                })
            })
            .collect();
        writers.into_iter().for_each(|w| w.join().unwrap());
        let mut back = [0u8; 4096];
        assert!(b.ram.read(0, &mut back));
        for word in back.chunks(8) {
            assert!(word.iter().all(|&x| x == word[0]) && (word[0] == 0x11 || word[0] == 0x22));
        }
    }
}

//! `memory:SIZE`: RAM. A memfd of the namespace's size, mapped once and shared by every
//! reactor. Reads and writes copy to and from the mapping directly; a read without data
//! digests is sent straight from it. Zeroing and deallocation punch holes in the memfd.
//!
//! The memfd is on huge pages when the system has enough of them reserved
//! (`vm.nr_hugepages`) and the size is a multiple of one, as SPDK's malloc bdev is on
//! DPDK's huge pages; otherwise on ordinary pages. Random I/O over a large namespace
//! on 4 KiB pages misses the TLB on nearly every command, and under a hypervisor each
//! miss is a two-level page walk (see "What changed" in `bench/results/results.md`).
#![allow(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
#[cfg(any(test, not(target_arch = "x86_64")))]
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use nvpool_wire::Status;

use super::{
    Backend, BackendType, BlockIo, DiskFd, DiskQueue, Handover, OpenEnv, Opened, deallocated_ranges, size_arg,
};
use crate::error::{Error, Result};
use crate::plan::IoPlan;

/// The registration of `memory:SIZE`.
pub const TYPE: BackendType = BackendType {
    name: "memory",
    usage: "memory:SIZE",
    check: |arg| size_arg(arg).map(drop),
    open: |arg, _: &OpenEnv<'_>| Opened::plain(Memory::new(size_arg(arg).map_err(Error::invalid)?)?),
};

/// Holes punched in shmem read back as zeroes (it cannot zero in place).
const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;

/// The RAM mapping. Reactors copy in and out of it at the same time, and two hosts may
/// write one range at once, so every copy is a byte-wise atomic one (each byte a
/// relaxed atomic access, in no particular order): a race is then defined, and leaves
/// each byte old or new. The kernel reads it directly for sends and punches holes in it.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

/// The pages a new memory namespace is made of.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Pages {
    /// The system's default huge pages (hugetlb), from the pool `vm.nr_hugepages` reserves.
    Huge,
    /// Ordinary shared memory.
    Ordinary,
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
// bounds-checked byte-wise atomic copies (`copy_out`, `copy_in`), which any number of
// threads may run at once.
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

/// Copies `len` bytes from `src` to `dst`, where either may be memory other threads
/// and the kernel copy in and out of at the same time.
///
/// On x86-64 this is `rep movsb`, which fast-string hardware runs with full-width
/// stores. Its effect is that of a byte-wise atomic copy: every byte is read and written
/// once, each access indivisible, in no set order (as Relaxed atomics of one byte
/// each), so a race with another copy is defined. A loop of 8-byte atomics, the
/// portable form below, stalls on the store buffer when the namespace's memory is not
/// in cache: random 4 KiB writes at depth spent 56% of the reactor in it, and 21%
/// with `rep movsb`.
///
/// # Safety
/// `src..src + len` and `dst..dst + len` must be mapped, `dst` writable, and any
/// other access to them while this runs must be atomic (or another of these copies).
#[cfg(target_arch = "x86_64")]
unsafe fn shared_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's promise; the ABI keeps the direction flag clear, so the copy
    // ascends, and the block touches no stack and no flags.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") len => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags)
        );
    }
}

/// The portable form of the copy above: 8-byte relaxed atomics where both ends allow
/// them, single bytes around.
///
/// # Safety
/// As above.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn shared_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's promise.
    unsafe { atomic_copy(src, dst, len) }
}

/// The copy in relaxed atomics (compiled for tests everywhere, to test it).
///
/// # Safety
/// As for [`shared_copy`].
#[cfg(any(test, not(target_arch = "x86_64")))]
unsafe fn atomic_copy(src: *const u8, dst: *mut u8, len: usize) {
    let mut at = 0;
    while at < len {
        let (s, d) = (src.wrapping_add(at), dst.wrapping_add(at));
        if len - at >= 8 && (s as usize).is_multiple_of(8) && (d as usize).is_multiple_of(8) {
            // SAFETY: in bounds by the caller's promise, and both ends 8-byte aligned.
            unsafe {
                let v = AtomicU64::from_ptr(s.cast_mut().cast::<u64>()).load(Ordering::Relaxed);
                AtomicU64::from_ptr(d.cast::<u64>()).store(v, Ordering::Relaxed);
            }
            at += 8;
        } else {
            // SAFETY: in bounds by the caller's promise; a byte has no alignment need.
            unsafe {
                let v = AtomicU8::from_ptr(s.cast_mut()).load(Ordering::Relaxed);
                AtomicU8::from_ptr(d).store(v, Ordering::Relaxed);
            }
            at += 1;
        }
    }
}

/// Copies `dst.len()` bytes out of shared memory at `src`.
///
/// # Safety
/// `src..src + dst.len()` must be mapped memory that Rust touches only through these
/// copies while this runs.
unsafe fn copy_out(src: *const u8, dst: &mut [u8]) {
    // SAFETY: the caller's promise for `src`; `dst` is an exclusive slice of that length.
    unsafe { shared_copy(src, dst.as_mut_ptr(), dst.len()) }
}

/// Copies `src` into shared memory at `dst`.
///
/// # Safety
/// As for [`copy_out`], for `dst..dst + src.len()`, which must be writable.
unsafe fn copy_in(src: &[u8], dst: *mut u8) {
    // SAFETY: the caller's promise for `dst`; `src` is a slice of that length.
    unsafe { streaming_copy(src.as_ptr(), dst, src.len()) }
}

/// As [`shared_copy`], but the whole 64-byte lines of `dst` are written with
/// non-temporal stores, which go to memory without first reading the line into the
/// cache. A write lands on lines of a namespace far larger than the caches, which are
/// not in them and will not be read soon: random 4 KiB writes over 512 MiB cost 0.24 us
/// a copy this way against 0.40-0.48 us with `rep movsb`, which must fetch every line
/// before overwriting it. The `sfence` makes the stores visible before anything the
/// reactor does next (the command's completion).
///
/// # Safety
/// As for [`shared_copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn streaming_copy(src: *const u8, dst: *mut u8, len: usize) {
    let head = dst.align_offset(64).min(len);
    let lines = (len - head) & !63;
    // SAFETY: the caller's promise; the three parts split [0, len) of both ranges.
    unsafe {
        shared_copy(src, dst, head);
        if lines > 0 {
            // SAFETY: `dst + head` is 64-byte aligned, as `movntdq` needs 16; `movdqu`
            // loads need no alignment; the loop runs `lines / 64` times, inside both
            // ranges, and touches no stack.
            std::arch::asm!(
                "2:",
                "movdqu {a}, [{s}]",
                "movdqu {b}, [{s} + 16]",
                "movdqu {c}, [{s} + 32]",
                "movdqu {d}, [{s} + 48]",
                "movntdq [{t}], {a}",
                "movntdq [{t} + 16], {b}",
                "movntdq [{t} + 32], {c}",
                "movntdq [{t} + 48], {d}",
                "add {s}, 64",
                "add {t}, 64",
                "sub {n}, 64",
                "jnz 2b",
                "sfence",
                s = inout(reg) src.add(head) => _,
                t = inout(reg) dst.add(head) => _,
                n = inout(reg) lines => _,
                a = out(xmm_reg) _,
                b = out(xmm_reg) _,
                c = out(xmm_reg) _,
                d = out(xmm_reg) _,
                options(nostack)
            );
        }
        shared_copy(src.add(head + lines), dst.add(head + lines), len - head - lines);
    }
}

/// Elsewhere, the copy of [`shared_copy`].
///
/// # Safety
/// As for [`shared_copy`].
#[cfg(not(target_arch = "x86_64"))]
unsafe fn streaming_copy(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's promise.
    unsafe { shared_copy(src, dst, len) }
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
    /// A RAM backend of `size` bytes, on huge pages if the system has enough free.
    pub fn new(size: u64) -> Result<Memory> {
        match Memory::with_pages(size, Pages::Huge) {
            Ok(m) => {
                tracing::info!("memory namespace of {size} bytes on huge pages");
                Ok(m)
            }
            Err(e) => {
                tracing::debug!("memory namespace of {size} bytes on ordinary pages: {e}");
                Memory::with_pages(size, Pages::Ordinary)
            }
        }
    }

    /// A RAM backend of `size` bytes on pages of this kind; huge pages fail when too
    /// few are free or `size` is not a multiple of one.
    fn with_pages(size: u64, pages: Pages) -> Result<Memory> {
        let flags = match pages {
            Pages::Huge => libc::MFD_CLOEXEC | libc::MFD_HUGETLB,
            Pages::Ordinary => libc::MFD_CLOEXEC,
        };
        // SAFETY: memfd_create reads a NUL-terminated name and returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"nvpool-memory-bdev".as_ptr(), flags) };
        if fd < 0 {
            return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: fd was just returned by memfd_create and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(|e| Error::io(format!("cannot size the memory backend to {size} bytes"), e))?;
        let len = usize::try_from(size).map_err(|_| Error::invalid(format!("memory:{size} does not fit in memory")))?;
        let fd: OwnedFd = file.into();
        // Mapping huge pages reserves them: it fails here, not on a later fault.
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
        for (offset, len) in [
            (0u64, 0usize),
            (0, 1),
            (3, 5),
            (5, 8),
            (7, 9),
            (1, 4096),
            (4096, 4096),
            (13, 1000),
            (64, 64),
            (60, 68),
            (63, 130),
            (100, 127),
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + offset as usize) as u8).collect();
            assert!(b.ram.write(offset, &data));
            let mut back = vec![0u8; len];
            assert!(b.ram.read(offset, &mut back));
            assert_eq!(back, data, "offset {offset} length {len}");
        }
    }

    /// Zeroing and deallocation punch holes; on huge pages the kernel zeroes the parts
    /// of a huge page a hole only covers in part, so any block range reads back zeroes.
    #[test]
    fn holes_read_back_as_zeroes_on_either_kind_of_page() {
        for pages in [Pages::Huge, Pages::Ordinary] {
            let size = 8 << 20;
            let b = match Memory::with_pages(size, pages) {
                Ok(b) => b,
                Err(e) => {
                    assert_eq!(pages, Pages::Huge, "ordinary pages always work: {e}");
                    eprintln!("no huge pages free ({e}): only ordinary pages tested; scripts/test reserves some");
                    continue;
                }
            };
            assert!(b.ram.write(0, &vec![0xa5; size as usize]));
            for (offset, len) in [(4096u64, 4096u64), ((2 << 20) - 512, 1024), (4 << 20, 2 << 20)] {
                // SAFETY: fallocate on the backend's own memfd, within its size.
                let r = unsafe { libc::fallocate(b.fd.as_raw_fd(), PUNCH_HOLE, offset as i64, len as i64) };
                assert_eq!(r, 0, "{pages:?}: punch {offset}+{len}: {}", std::io::Error::last_os_error());
            }
            let mut back = vec![0u8; size as usize];
            assert!(b.ram.read(0, &mut back));
            let zeroed = |at: usize| {
                [(4096, 8192), ((2 << 20) - 512, (2 << 20) + 512), (4 << 20, 6 << 20)]
                    .iter()
                    .any(|&(s, e)| (s..e).contains(&at))
            };
            for (at, &byte) in back.iter().enumerate() {
                assert_eq!(byte, if zeroed(at) { 0 } else { 0xa5 }, "{pages:?}: byte {at}");
            }
        }
    }

    #[test]
    fn the_portable_copy_handles_any_alignment() {
        let src: Vec<u8> = (0..200u8).collect();
        for (from, to, len) in [(0, 0, 200), (1, 0, 150), (0, 3, 100), (5, 13, 64), (7, 7, 9), (2, 2, 0)] {
            let mut dst = vec![0u8; 220];
            // SAFETY: both ranges lie inside their vectors; nothing else touches them.
            unsafe { atomic_copy(src.as_ptr().add(from), dst.as_mut_ptr().add(to), len) };
            assert_eq!(&dst[to..to + len], &src[from..from + len], "from {from} to {to} length {len}");
            assert!(dst[..to].iter().chain(&dst[to + len..]).all(|&b| b == 0), "nothing else written");
        }
    }

    #[test]
    fn two_threads_writing_one_range_leave_each_byte_of_either() {
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
        assert!(back.iter().all(|&x| x == 0x11 || x == 0x22), "each byte is one writer's");
    }
}

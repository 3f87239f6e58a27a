//! Block backends ("bdevs") a namespace can be served from.
//!
//! All three kinds are served on the reactor's io_uring, so the I/O path is the same:
//! - `null`: no storage; reads return zeroes, writes are dropped.
//! - `memory`: a memfd of the namespace's size. Buffered, in RAM, lost on exit.
//! - `file`: a regular file or block device, opened with `O_DIRECT` when the
//!   filesystem supports it. Flush is `fdatasync`; FUA writes use `RWF_DSYNC`.
//! - `volume`: a logical volume of a pool (see [`crate::pool`]), whose I/O goes to
//!   the pool's disks through the volume's cluster map.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::pool::VolumeIo;

/// Errors opening a backend.
#[derive(Debug, Error)]
pub enum BdevError {
    /// The file could not be opened.
    #[error("cannot open {path}: {source}")]
    Open {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The backend has a size the namespace cannot use.
    #[error("{0}")]
    Size(String),
    /// A system call failed.
    #[error("{what}: {source}")]
    Sys {
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

/// What kind of storage a bdev is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BdevKind {
    /// No storage.
    Null,
    /// RAM (a memfd).
    Memory,
    /// A file or block device.
    File,
    /// A logical volume of a pool.
    Volume,
}

/// The memory backend's RAM: its memfd mapped once, shared by every reactor. Reads and
/// writes copy to and from it directly; concurrent I/O to overlapping ranges leaves
/// unspecified bytes there, as it would on a disk.
#[derive(Debug)]
pub struct Memory {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory that lives as long as `Memory`; every
// access goes through bounds-checked copies, so sharing the pointer between threads is
// sound.
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    fn map(fd: &OwnedFd, len: usize) -> Result<Memory, BdevError> {
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
            return Err(BdevError::Sys { what: "mapping the memory backend", source: std::io::Error::last_os_error() });
        }
        Ok(Memory { ptr: ptr.cast(), len })
    }

    fn range(&self, offset: u64, len: usize) -> Option<usize> {
        let start = usize::try_from(offset).ok()?;
        (start.checked_add(len)? <= self.len).then_some(start)
    }

    /// Copies `dst.len()` bytes at `offset` out of the backend; false if out of range.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> bool {
        let Some(start) = self.range(offset, dst.len()) else { return false };
        // SAFETY: `range` checked that [start, start + len) lies inside the mapping, and
        // `dst` is a distinct Rust buffer of that length.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(start), dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// The address of `len` bytes at `offset`, for the kernel to copy from when a read
    /// is sent straight out of the backend; None if out of range. Rust code never reads
    /// through it: other reactors may be writing there at the same time.
    pub fn address(&self, offset: u64, len: usize) -> Option<*const u8> {
        let start = self.range(offset, len)?;
        Some(self.ptr.wrapping_add(start).cast_const())
    }

    /// Copies `src` into the backend at `offset`; false if out of range.
    pub fn write(&self, offset: u64, src: &[u8]) -> bool {
        let Some(start) = self.range(offset, src.len()) else { return false };
        // SAFETY: as in `read`, with the copy going the other way.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(start), src.len()) };
        true
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` created; nothing uses it after drop.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// An open block backend, shared by every reactor that serves its namespace.
#[derive(Debug)]
pub struct Bdev {
    kind: BdevKind,
    memory: Option<Memory>,
    volume: Option<VolumeIo>,
    fd: Option<OwnedFd>,
    size: u64,
    block_device: bool,
    direct: bool,
    on_device: bool,
    description: String,
}

impl Bdev {
    /// A null backend of `size` bytes.
    pub fn null(size: u64) -> Bdev {
        Bdev {
            kind: BdevKind::Null,
            memory: None,
            volume: None,
            fd: None,
            size,
            block_device: false,
            direct: false,
            on_device: false,
            description: format!("null:{size}"),
        }
    }

    /// A RAM backend of `size` bytes.
    pub fn memory(size: u64) -> Result<Bdev, BdevError> {
        // SAFETY: memfd_create reads a NUL-terminated name and returns a new fd or -1.
        let fd = unsafe { libc::memfd_create(c"nvpool-memory-bdev".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(BdevError::Sys { what: "memfd_create", source: std::io::Error::last_os_error() });
        }
        // SAFETY: fd was just returned by memfd_create and nothing else owns it.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(|e| BdevError::Sys { what: "sizing the memory backend", source: e })?;
        let len =
            usize::try_from(size).map_err(|_| BdevError::Size(format!("memory:{size} does not fit in memory")))?;
        let fd: OwnedFd = file.into();
        Ok(Bdev {
            kind: BdevKind::Memory,
            memory: Some(Memory::map(&fd, len)?),
            volume: None,
            fd: Some(fd),
            size,
            block_device: false,
            direct: false,
            on_device: false,
            description: format!("memory:{size}"),
        })
    }

    /// A file or block device. A regular file that does not exist (or is empty) is
    /// created with `create_size` bytes; an existing one keeps its size.
    pub fn file(path: &Path, create_size: Option<u64>) -> Result<Bdev, BdevError> {
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true);
            if create_size.is_some() {
                o.create(true);
            }
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        // Filesystems without O_DIRECT (tmpfs) refuse it with EINVAL: fall back to
        // buffered I/O, which still honours fdatasync and RWF_DSYNC.
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                (open(false).map_err(|source| BdevError::Open { path: path.into(), source })?, false)
            }
            Err(source) => {
                return Err(BdevError::Open { path: path.into(), source });
            }
        };
        let meta = file.metadata().map_err(|source| BdevError::Open { path: path.into(), source })?;
        let block_device = meta.file_type().is_block_device();
        // Filesystems without a device (tmpfs) have major number 0; their direct I/O
        // still copies from memory.
        let on_device = block_device || (direct && libc::major(meta.dev()) != 0);
        let mut size = if block_device { block_device_size(&file)? } else { meta.len() };
        if let (0, false, Some(want)) = (size, block_device, create_size) {
            file.set_len(want).map_err(|e| BdevError::Sys { what: "sizing the backing file", source: e })?;
            size = want;
        }
        if size == 0 {
            return Err(BdevError::Size(format!(
                "{} is empty: give a size (file:PATH:SIZE) to create it",
                path.display()
            )));
        }
        Ok(Bdev {
            kind: BdevKind::File,
            memory: None,
            volume: None,
            fd: Some(file.into()),
            size,
            block_device,
            direct,
            on_device,
            description: path.display().to_string(),
        })
    }

    /// A volume of a pool, `size` bytes.
    pub fn volume(io: VolumeIo, size: u64, description: String) -> Bdev {
        let on_device = io.pool.disks().iter().any(|d| d.bdev.on_device());
        Bdev {
            kind: BdevKind::Volume,
            memory: None,
            volume: Some(io),
            fd: None,
            size,
            block_device: false,
            direct: true,
            on_device,
            description,
        }
    }

    /// The volume behind a volume backend.
    pub fn as_volume(&self) -> Option<&VolumeIo> {
        self.volume.as_ref()
    }

    /// The kind of storage.
    pub fn kind(&self) -> BdevKind {
        self.kind
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The RAM of a memory backend, which I/O copies to and from directly.
    pub fn ram(&self) -> Option<&Memory> {
        self.memory.as_ref()
    }

    /// The file descriptor I/O goes to (none for null).
    pub fn raw_fd(&self) -> Option<RawFd> {
        self.fd.as_ref().map(|f| f.as_raw_fd())
    }

    /// Whether I/O bypasses the page cache.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Whether I/O goes to a device and completes later (a block device, or a file with
    /// direct I/O on a filesystem that has one), rather than copying from memory inside
    /// the submitting call. A volume's I/O goes to its pool's disks, known when the
    /// volume is opened (a pool's disks do not change).
    pub fn on_device(&self) -> bool {
        self.on_device
    }

    /// Whether deallocated blocks are guaranteed to read back as zeroes. Block devices
    /// may ignore a discard, so there deallocation is only advisory.
    pub fn deallocated_reads_zeroes(&self) -> bool {
        !self.block_device
    }

    /// Human-readable description (the path, or kind and size).
    pub fn description(&self) -> &str {
        &self.description
    }

    /// The fallocate mode that zeroes a range: shmem (memfd) can only punch holes,
    /// which read back as zeroes; files and block devices zero in place.
    pub fn zero_range_mode(&self) -> i32 {
        match self.kind {
            BdevKind::Memory => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            _ => libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE,
        }
    }

    /// The fallocate mode that deallocates a range.
    pub fn deallocate_mode(&self) -> i32 {
        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
    }
}

impl Bdev {
    /// Zeroes `len` bytes at `offset` now, blocking: in place for files and block
    /// devices (no data is written where the system can avoid it), by writing zeroes
    /// otherwise. Not durable until [`Bdev::sync_now`].
    pub fn zero_now(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let Some(fd) = self.raw_fd() else { return Ok(()) };
        if self.block_device {
            let range: [u64; 2] = [offset, len];
            // SAFETY: BLKZEROOUT reads two u64 (start, length) through the pointer, which
            // points at `range`.
            if unsafe { libc::ioctl(fd, BLKZEROOUT, range.as_ptr()) } == 0 {
                return Ok(());
            }
        } else {
            // SAFETY: fallocate takes plain integers; fd is open for writing.
            let rc = unsafe { libc::fallocate(fd, self.zero_range_mode(), offset as i64, len as i64) };
            if rc == 0 {
                return Ok(());
            }
        }
        // Writing zeroes works everywhere. The write goes through a buffered descriptor,
        // which the direct I/O of the reactors sees once it is synced.
        let file = std::fs::OpenOptions::new().write(true).open(format!("/proc/self/fd/{fd}"))?;
        let zeroes = vec![0u8; 1 << 20];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            std::os::unix::fs::FileExt::write_all_at(&file, &zeroes[..n], offset + done)?;
            done += n as u64;
        }
        file.sync_data()
    }

    /// Makes every completed write durable, blocking (`fdatasync`).
    pub fn sync_now(&self) -> std::io::Result<()> {
        let Some(fd) = self.raw_fd() else { return Ok(()) };
        // SAFETY: fdatasync takes a descriptor we own.
        if unsafe { libc::fdatasync(fd) } == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
    }
}

/// `BLKZEROOUT`: `_IO(0x12, 127)`; the libc crate does not export it.
const BLKZEROOUT: libc::c_ulong = 0x127F;

/// `BLKGETSIZE64`: `_IOR(0x12, 114, size_t)`; the libc crate does not export it.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

fn block_device_size(file: &File) -> Result<u64, BdevError> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(BdevError::Sys { what: "BLKGETSIZE64", source: std::io::Error::last_os_error() });
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_backend_creates_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk");
        let b = Bdev::file(&p, Some(1 << 20)).unwrap();
        assert_eq!(b.size(), 1 << 20);
        drop(b);
        assert_eq!(Bdev::file(&p, None).unwrap().size(), 1 << 20);
        assert!(Bdev::file(&dir.path().join("missing"), None).is_err());
    }

    #[test]
    fn only_storage_with_a_device_counts_as_on_device() {
        assert!(!Bdev::null(1 << 20).on_device());
        assert!(!Bdev::memory(1 << 20).unwrap().on_device());
        // tmpfs has no device (major number 0), even where it accepts O_DIRECT.
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            let dir = tempfile::tempdir_in(shm).unwrap();
            assert!(!Bdev::file(&dir.path().join("disk"), Some(1 << 20)).unwrap().on_device());
        }
        // A filesystem on a block device: I/O there completes later, from the device.
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let b = Bdev::file(&dir.path().join("disk"), Some(1 << 20)).unwrap();
        let dev = std::fs::metadata(dir.path()).unwrap().dev();
        assert_eq!(b.on_device(), b.direct() && libc::major(dev) != 0);
    }

    #[test]
    fn memory_backend_has_its_size() {
        let b = Bdev::memory(8 << 20).unwrap();
        assert_eq!(b.size(), 8 << 20);
        assert_eq!(b.kind(), BdevKind::Memory);
        let ram = b.ram().unwrap();
        assert!(ram.write(4096, &[7u8; 512]));
        let mut back = [0u8; 1024];
        assert!(ram.read(4096 - 512, &mut back));
        assert_eq!(&back[..512], &[0u8; 512][..]);
        assert_eq!(&back[512..], &[7u8; 512][..]);
        assert!(!ram.read((8 << 20) - 100, &mut back), "reads past the end are refused");
        assert!(!ram.write(u64::MAX, &[0u8; 1]));
    }
}

//! The engine's disks: a file or block device opened with `O_DIRECT` where the
//! filesystem allows it, its size and physical block, the few blocking operations the
//! pools' metadata thread and migrations need, and the descriptor reactors queue disk
//! operations on ([`DiskFd`]).
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// `fallocate` mode that zeroes a range in place (Write Zeroes).
pub const ZERO_RANGE: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
/// `fallocate` mode that deallocates a range (Dataset Management).
pub const PUNCH_HOLE: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;

/// A descriptor disk operations go to, and how its operations complete.
#[derive(Clone, Copy, Debug)]
pub struct DiskFd {
    fd: RawFd,
    on_device: bool,
}

impl DiskFd {
    /// `fd`; `on_device`: whether its I/O goes to a device and completes later (and so
    /// is handed to the kernel at once) rather than copying memory inside the
    /// submitting call (and so waits for the end of the reactor's pass).
    pub fn new(fd: RawFd, on_device: bool) -> DiskFd {
        DiskFd { fd, on_device }
    }

    /// The descriptor.
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    /// Whether its I/O goes to a device.
    pub fn on_device(&self) -> bool {
        self.on_device
    }
}

/// An open file or block device: where a `file:` namespace or a pool's member disk
/// keeps its data.
#[derive(Debug)]
pub struct Disk {
    fd: OwnedFd,
    path: PathBuf,
    size: u64,
    block_device: bool,
    direct: bool,
    on_device: bool,
    /// The largest aligned write a power loss leaves whole: the physical block.
    atomic_bytes: u32,
    /// Whether its filesystem lives in memory only (tmpfs, ramfs): a power loss keeps
    /// none of it, so no write needs to reach it before another.
    in_memory: bool,
}

impl Disk {
    /// Opens a file or block device. A regular file that does not exist (or is empty)
    /// is created with `create_size` bytes; an existing one keeps its size.
    pub fn open(path: &Path, create_size: Option<u64>) -> Result<Disk> {
        let cannot = |e: std::io::Error| Error::io(format!("cannot open {}", path.display()), e);
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
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(false).map_err(cannot)?, false),
            Err(e) => return Err(cannot(e)),
        };
        let meta = file.metadata().map_err(cannot)?;
        let block_device = meta.file_type().is_block_device();
        // Filesystems without a device (tmpfs) have major number 0; their direct I/O
        // still copies from memory.
        let on_device = block_device || (direct && libc::major(meta.dev()) != 0);
        let mut size = if block_device { block_device_size(&file).map_err(cannot)? } else { meta.len() };
        if let (0, false, Some(want)) = (size, block_device, create_size) {
            file.set_len(want).map_err(|e| Error::io(format!("cannot size {} to {want} bytes", path.display()), e))?;
            size = want;
        }
        if size == 0 {
            return Err(Error::invalid(format!(
                "{} is empty: give a size (file:PATH:SIZE) to create it",
                path.display()
            )));
        }
        let atomic_bytes = if block_device {
            physical_block_size(&file).map_err(cannot)?
        } else if libc::major(meta.dev()) == 0 {
            // A filesystem without a device (tmpfs) keeps nothing across a power loss.
            u32::MAX
        } else {
            device_physical_block(meta.dev())
        };
        let in_memory = !block_device && in_memory_filesystem(&file);
        Ok(Disk { fd: file.into(), path: path.into(), size, block_device, direct, on_device, atomic_bytes, in_memory })
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether it is a block device (a file otherwise).
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    /// Whether I/O bypasses the page cache.
    pub fn direct_io(&self) -> bool {
        self.direct
    }

    /// The largest aligned write, in bytes, that a power loss leaves whole.
    pub fn power_fail_atomic_bytes(&self) -> u32 {
        self.atomic_bytes
    }

    /// Whether a power loss keeps nothing of it (a file on tmpfs or ramfs), so that
    /// ordering its writes for a power loss (FUA) buys nothing. A file system without a
    /// device is not enough: FUSE has none and may keep what was synced.
    pub fn forgets_at_power_loss(&self) -> bool {
        self.in_memory
    }

    /// Where disk operations on it go.
    pub fn disk_fd(&self) -> DiskFd {
        DiskFd::new(self.fd.as_raw_fd(), self.on_device)
    }

    /// Whether I/O goes to a device and completes later (a block device, or a file with
    /// direct I/O on a filesystem that has one), rather than copying from memory inside
    /// the submitting call.
    pub fn on_device(&self) -> bool {
        self.on_device
    }

    /// Zeroes `len` bytes at `offset` now, blocking: in place for files and block
    /// devices (no data is written where the system can avoid it), by writing zeroes
    /// otherwise. Not durable until [`Disk::sync_now`].
    pub fn zero_now(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let fd = self.fd.as_raw_fd();
        if self.block_device {
            let range: [u64; 2] = [offset, len];
            // SAFETY: BLKZEROOUT reads two u64 (start, length) through the pointer, which
            // points at `range`.
            if unsafe { libc::ioctl(fd, BLKZEROOUT, range.as_ptr()) } == 0 {
                return Ok(());
            }
        } else {
            // SAFETY: fallocate takes plain integers; fd is open for writing.
            let rc = unsafe { libc::fallocate(fd, ZERO_RANGE, offset as i64, len as i64) };
            if rc == 0 {
                return Ok(());
            }
        }
        // Writing zeroes works everywhere. The write goes through a buffered descriptor,
        // which the direct I/O of the reactors sees once it is synced.
        let file = OpenOptions::new().write(true).open(format!("/proc/self/fd/{fd}"))?;
        let zeroes = vec![0u8; 1 << 20];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeroes.len() as u64) as usize;
            std::os::unix::fs::FileExt::write_all_at(&file, &zeroes[..n], offset + done)?;
            done += n as u64;
        }
        file.sync_data()
    }

    /// Reads `buf.len()` bytes at `offset` now, blocking. With direct I/O, `buf` and
    /// `offset` must be aligned to the device's logical block.
    pub fn read_now(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let fd = self.fd.as_raw_fd();
        whole(buf.len(), std::io::ErrorKind::UnexpectedEof, |done| {
            let rest = &mut buf[done..];
            // SAFETY: pread writes at most `rest.len()` bytes into `rest`, which is valid
            // for writes; fd is a descriptor we own.
            unsafe { libc::pread(fd, rest.as_mut_ptr().cast(), rest.len(), (offset + done as u64) as i64) }
        })
    }

    /// Writes `buf` at `offset` now, blocking; not durable until [`Disk::sync_now`].
    /// With direct I/O, `buf` and `offset` must be aligned to the device's logical
    /// block.
    pub fn write_now(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let fd = self.fd.as_raw_fd();
        whole(buf.len(), std::io::ErrorKind::WriteZero, |done| {
            let rest = &buf[done..];
            // SAFETY: pwrite reads at most `rest.len()` bytes from `rest`, which is valid
            // for reads; fd is a descriptor we own.
            unsafe { libc::pwrite(fd, rest.as_ptr().cast(), rest.len(), (offset + done as u64) as i64) }
        })
    }

    /// Makes every completed write durable, blocking (`fdatasync`).
    pub fn sync_now(&self) -> std::io::Result<()> {
        // SAFETY: fdatasync takes a descriptor we own.
        if unsafe { libc::fdatasync(self.fd.as_raw_fd()) } == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
    }
}

/// Repeats `step(done)` (a pread or pwrite of what is left after `done` bytes) until
/// `len` bytes moved; a step that moves nothing fails with `short`.
fn whole(len: usize, short: std::io::ErrorKind, mut step: impl FnMut(usize) -> isize) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        match step(done) {
            0 => return Err(short.into()),
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => done += n as usize,
        }
    }
    Ok(())
}

/// `BLKZEROOUT`: `_IO(0x12, 127)`; the libc crate does not export it.
const BLKZEROOUT: libc::c_ulong = 0x127F;

/// `BLKGETSIZE64`: `_IOR(0x12, 114, size_t)`; the libc crate does not export it.
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;

/// `BLKPBSZGET`: `_IO(0x12, 123)`; the libc crate does not export it.
const BLKPBSZGET: libc::c_ulong = 0x127B;

/// The physical block size of a block device: the unit it writes whole.
fn physical_block_size(file: &File) -> std::io::Result<u32> {
    let mut size: libc::c_uint = 0;
    // SAFETY: BLKPBSZGET writes one unsigned int through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKPBSZGET, &mut size as *mut libc::c_uint) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size.max(512))
}

/// Whether `file` is on a file system kept only in memory (tmpfs or ramfs).
fn in_memory_filesystem(file: &File) -> bool {
    const TMPFS_MAGIC: libc::c_long = 0x0102_1994;
    const RAMFS_MAGIC: libc::c_long = 0x8584_58f6;
    // SAFETY: statfs is plain data, for which all zeroes is a valid value.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs through the pointer, which points at `fs`.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
        return false;
    }
    matches!(fs.f_type, TMPFS_MAGIC | RAMFS_MAGIC)
}

/// The physical block size of the device a file's filesystem lives on, from sysfs (a
/// partition's is its disk's); 512, the smallest, when it cannot be told.
fn device_physical_block(dev: u64) -> u32 {
    let dir = PathBuf::from(format!("/sys/dev/block/{}:{}", libc::major(dev), libc::minor(dev)));
    ["queue/physical_block_size", "../queue/physical_block_size"]
        .iter()
        .find_map(|f| std::fs::read_to_string(dir.join(f)).ok()?.trim().parse::<u32>().ok())
        .unwrap_or(512)
        .max(512)
}

fn block_device_size(file: &File) -> std::io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points at `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disks_are_created_and_reopened() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk");
        let d = Disk::open(&p, Some(1 << 20)).unwrap();
        assert_eq!(d.size(), 1 << 20);
        drop(d);
        assert_eq!(Disk::open(&p, None).unwrap().size(), 1 << 20);
        assert!(Disk::open(&dir.path().join("missing"), None).is_err());
    }

    #[test]
    fn only_storage_with_a_device_counts_as_on_device() {
        // tmpfs has no device (major number 0), even where it accepts O_DIRECT.
        let shm = Path::new("/dev/shm");
        if shm.is_dir() {
            let dir = tempfile::tempdir_in(shm).unwrap();
            let d = Disk::open(&dir.path().join("disk"), Some(1 << 20)).unwrap();
            assert!(!d.on_device());
            assert!(d.forgets_at_power_loss(), "tmpfs keeps nothing across a power loss");
        }
        // A filesystem on a block device: I/O there completes later, from the device.
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let d = Disk::open(&dir.path().join("disk"), Some(1 << 20)).unwrap();
        let dev = std::fs::metadata(dir.path()).unwrap().dev();
        assert_eq!(d.on_device(), d.direct_io() && libc::major(dev) != 0);
    }
}

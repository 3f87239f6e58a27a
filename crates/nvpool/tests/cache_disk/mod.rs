//! Disks that keep writes in a volatile cache until a flush, the way a disk with a
//! write-back cache does, and lose part of them when their power is cut: files of a
//! FUSE file system that the test process serves, so that an engine on this machine
//! can have its pool on them.
//!
//! A write goes to the disk's cache, sector by sector (4 KiB, the unit a write lands
//! in whole across a power loss); `fsync` or `fdatasync` writes the cache to the
//! medium (a sparse file beside the mount) and syncs it. Reads see the cache over the
//! medium. [`CacheDisks::cut`] cuts one disk's power: each cached sector reaches the
//! medium or is lost, at random, half and half, and the cache empties. Cut only while
//! nothing has the disk open (its engine killed and gone): a write still on its way
//! could land after the cut otherwise.

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner, MountOption,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request,
    WriteFlags,
};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

/// The unit a write lands in whole.
const SECTOR: u64 = 4096;
const TTL: Duration = Duration::from_secs(3600);

struct Disk {
    name: String,
    size: u64,
    medium: File,
    /// Sector number → what was written there and not flushed yet.
    cache: HashMap<u64, Vec<u8>>,
}

impl Disk {
    fn sector(&self, n: u64) -> Vec<u8> {
        if let Some(s) = self.cache.get(&n) {
            return s.clone();
        }
        let mut s = vec![0u8; SECTOR as usize];
        self.medium.read_exact_at(&mut s, n * SECTOR).unwrap();
        s
    }

    fn read(&self, offset: u64, len: u64) -> Vec<u8> {
        let end = (offset + len).min(self.size);
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        let mut at = offset;
        while at < end {
            let n = at / SECTOR;
            let within = (at % SECTOR) as usize;
            let take = ((SECTOR as usize) - within).min((end - at) as usize);
            out.extend_from_slice(&self.sector(n)[within..within + take]);
            at += take as u64;
        }
        out
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let n = at / SECTOR;
            let within = (at % SECTOR) as usize;
            let take = ((SECTOR as usize) - within).min(data.len() - done);
            let mut s = self.sector(n);
            s[within..within + take].copy_from_slice(&data[done..done + take]);
            self.cache.insert(n, s);
            done += take;
        }
    }

    fn flush(&mut self) {
        for (n, s) in self.cache.drain() {
            self.medium.write_all_at(&s, n * SECTOR).unwrap();
        }
        self.medium.sync_data().unwrap();
    }

    fn attr(&self, ino: u64) -> FileAttr {
        let file = FileAttr { ino: INodeNo(ino), kind: FileType::RegularFile, perm: 0o600, nlink: 1, ..dir_attr() };
        FileAttr { size: self.size, blocks: self.size / 512, ..file }
    }
}

fn dir_attr() -> FileAttr {
    FileAttr {
        ino: INodeNo::ROOT,
        size: 0,
        blocks: 0,
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind: FileType::Directory,
        perm: 0o755,
        nlink: 2,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: SECTOR as u32,
        flags: 0,
    }
}

/// The disks, by inode (2, 3, ...: the root is 1).
type Disks = Arc<Mutex<Vec<Disk>>>;

struct CacheFs(Disks);

impl CacheFs {
    fn with<T>(&self, ino: INodeNo, f: impl FnOnce(&mut Disk) -> T) -> Option<T> {
        let mut disks = self.0.lock().unwrap();
        let i = usize::try_from(ino.0).ok()?.checked_sub(2)?;
        disks.get_mut(i).map(f)
    }
}

impl Filesystem for CacheFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let disks = self.0.lock().unwrap();
        match disks.iter().position(|d| parent == INodeNo::ROOT && OsStr::new(&d.name) == name) {
            Some(i) => reply.entry(&TTL, &disks[i].attr(i as u64 + 2), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino == INodeNo::ROOT {
            return reply.attr(&TTL, &dir_attr());
        }
        match self.with(ino, |d| d.attr(ino.0)) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // No page cache in front: every write reaches the disk's own cache.
        reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO);
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.with(ino, |d| d.read(offset, u64::from(size))) {
            Some(data) => reply.data(&data),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let fits = self.with(ino, |d| {
            let fits = offset + data.len() as u64 <= d.size;
            if fits {
                d.write(offset, data);
            }
            fits
        });
        match fits {
            Some(true) => reply.written(data.len() as u32),
            Some(false) => reply.error(Errno::ENOSPC),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        // close(2): a disk makes nothing durable for it.
        reply.ok();
    }

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        match self.with(ino, Disk::flush) {
            Some(()) => reply.ok(),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let disks = self.0.lock().unwrap();
        let mut entries = vec![(1, FileType::Directory, ".".to_string()), (1, FileType::Directory, "..".to_string())];
        entries.extend(disks.iter().enumerate().map(|(i, d)| (i as u64 + 2, FileType::RegularFile, d.name.clone())));
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The mounted disks; unmounted when dropped.
pub struct CacheDisks {
    pub mount: PathBuf,
    disks: Disks,
    _session: fuser::BackgroundSession,
}

impl CacheDisks {
    /// Mounts at `dir/disks` the disks `names` of `size` bytes each, their media in
    /// `dir/media` (kept across mounts).
    pub fn mount(dir: &Path, names: &[&str], size: u64) -> CacheDisks {
        let (mount, media) = (dir.join("disks"), dir.join("media"));
        std::fs::create_dir_all(&mount).unwrap();
        std::fs::create_dir_all(&media).unwrap();
        let disks: Vec<Disk> = names
            .iter()
            .map(|name| {
                let medium =
                    File::options().read(true).write(true).create(true).truncate(false).open(media.join(name)).unwrap();
                medium.set_len(size).unwrap();
                Disk { name: name.to_string(), size, medium, cache: HashMap::new() }
            })
            .collect();
        let disks = Arc::new(Mutex::new(disks));
        let mut config = Config::default();
        config.mount_options = vec![MountOption::FSName("nvpool-cache-disks".into()), MountOption::RW];
        config.acl = fuser::SessionACL::All;
        config.n_threads = Some(2);
        let session = fuser::spawn_mount(CacheFs(disks.clone()), &mount, &config)
            .unwrap_or_else(|e| panic!("cannot mount the cache disks at {} (FUSE, as root): {e}", mount.display()));
        CacheDisks { mount, disks, _session: session }
    }

    /// The path of disk `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.mount.join(name)
    }

    /// Cuts disk `name`'s power: each cached sector lands or is lost, at random.
    /// Returns (sectors lost, sectors that landed).
    pub fn cut(&self, name: &str, seed: &mut u64) -> (usize, usize) {
        let mut disks = self.disks.lock().unwrap();
        let d = disks.iter_mut().find(|d| d.name == name).unwrap();
        let (mut lost, mut landed) = (0, 0);
        let mut cached: Vec<(u64, Vec<u8>)> = d.cache.drain().collect();
        cached.sort_by_key(|(n, _)| *n);
        for (n, s) in cached {
            if crate::cluster::next(seed) & 1 == 0 {
                d.medium.write_all_at(&s, n * SECTOR).unwrap();
                landed += 1;
            } else {
                lost += 1;
            }
        }
        d.medium.sync_data().unwrap();
        (lost, landed)
    }
}

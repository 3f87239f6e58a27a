//! Copying a volume's clusters to another engine's namespace, off the reactors: what a
//! migration's rounds and a replica's rebuild both do. The copy reads the volume with
//! blocking reads (counted in the pool's epoch, so no cluster it reads is reused under
//! it) and writes the target through the blocking initiator, up to [`COPY_DEPTH`]
//! writes outstanding.

use std::net::SocketAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use nvpool_initiator::{ConnectOptions, Queue, connect_admin};
use nvpool_wire::Status;
use nvpool_wire::command::{Command, io_opcode};
use nvpool_wire::identify;

use crate::bufpool::Buf;
use crate::error::{Error, Result};
use crate::nvme::MAX_TRANSFER;
use crate::pool::{MAX_REACTORS, VolumeIo};
use crate::sync::lock;

/// A copy's thread and what it reports (`I`), shared by the thread and the engine's
/// calls: a migration's, a rebuild's.
pub(crate) struct CopyJob<I> {
    pub info: Mutex<I>,
    pub cancel: AtomicBool,
    pub thread: Mutex<Option<JoinHandle<()>>>,
}

impl<I> CopyJob<I> {
    pub(crate) fn new(info: I) -> CopyJob<I> {
        CopyJob { info: Mutex::new(info), cancel: AtomicBool::new(false), thread: Mutex::new(None) }
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut I)) {
        f(&mut lock(&self.info));
    }

    /// Whether the engine asked the copy to stop.
    pub(crate) fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::SeqCst)
    }

    /// Whether its thread still runs.
    pub(crate) fn alive(&self) -> bool {
        lock(&self.thread).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// Asks the copy to stop and waits for its thread.
    pub(crate) fn stop(&self) {
        self.cancel.store(true, Ordering::SeqCst);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// Stops every job of `jobs` (the engine stops): asks them all, then waits for each.
pub(crate) fn stop_all<'a, I: 'a>(jobs: impl IntoIterator<Item = &'a CopyJob<I>> + Clone) {
    for job in jobs.clone() {
        job.cancel.store(true, Ordering::SeqCst);
    }
    for job in jobs {
        job.stop();
    }
}

/// The pool in-flight slot a copy counts its reads under (shared, atomically, with
/// a reactor of that number, which is sound).
const COPY_SLOT: usize = MAX_REACTORS - 1;
/// Writes a copy keeps outstanding at the target.
const COPY_DEPTH: usize = 16;

/// The copy's own queue to the target namespace.
pub(crate) struct TargetQueue {
    /// Kept so the controller stays associated (no keep-alive: KATO 0).
    _admin: Queue,
    io: Queue,
    nsid: u32,
    block_shift: u32,
    outstanding: usize,
}

impl TargetQueue {
    /// A queue to namespace `nsid` of `nqn` at `addr`, as this engine (its host NQN and
    /// host identifier, so that a reservation it holds there lets the copy write).
    pub(crate) fn connect(
        addr: SocketAddr,
        nqn: &str,
        nsid: u32,
        host_nqn: &str,
    ) -> std::result::Result<TargetQueue, String> {
        let hostid = crate::config::derived_host_id(host_nqn);
        let options = ConnectOptions { kato: 0, hostid, ..ConnectOptions::admin(nqn, host_nqn) };
        let mut admin = connect_admin(addr, &options).map_err(|e| e.to_string())?;
        admin.set_queue_count(1).map_err(|e| e.to_string())?;
        let ns = admin.identify_namespace(nsid).map_err(|e| e.to_string())?;
        if ns.nsze == 0 {
            return Err(format!("it has no namespace {nsid}"));
        }
        let block_shift = identify::lba_format_block_size(ns.lbaf0).trailing_zeros();
        let io =
            Queue::connect(addr, &options.io(1, admin.cntlid, COPY_DEPTH as u16 * 2)).map_err(|e| e.to_string())?;
        Ok(TargetQueue { _admin: admin, io, nsid, block_shift, outstanding: 0 })
    }

    /// Takes the target's reservation at generation `key` for this engine (its host
    /// NQN), so that a replica fenced by that generation takes the copy's writes.
    pub(crate) fn take_fence(&mut self, key: u64, host_nqn: &str) -> std::result::Result<(), String> {
        let host_id = crate::config::derived_host_id(host_nqn);
        crate::backend::remote::take_fence(&mut self.io, self.nsid, key, host_id).map_err(|e| e.to_string())
    }

    /// Takes one answer; an error status fails the copy.
    fn reap(&mut self) -> Result<()> {
        let reply =
            self.io.next_reply().map_err(|e| Error::unavailable(format!("the target stopped answering: {e}")))?;
        self.outstanding -= 1;
        if !reply.cqe.status.is_success() {
            return Err(target_refused(reply.cqe.status));
        }
        Ok(())
    }

    /// Waits for every outstanding write.
    pub(crate) fn settle(&mut self) -> Result<()> {
        while self.outstanding > 0 {
            self.reap()?;
        }
        Ok(())
    }

    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        if self.outstanding == COPY_DEPTH {
            self.reap()?;
        }
        let cid = self.io.alloc_cid();
        let (slba, nlb) = (offset >> self.block_shift, (data.len() >> self.block_shift) as u32);
        let cmd = Command::read_write(io_opcode::WRITE, cid, self.nsid, slba, nlb, data.len() as u32);
        self.io.submit(cmd, data, false).map_err(|e| Error::unavailable(format!("cannot write to the target: {e}")))?;
        self.outstanding += 1;
        Ok(())
    }

    pub(crate) fn deallocate(&mut self, offset: u64, len: u64) -> Result<()> {
        self.settle()?;
        let (slba, nlb) = (offset >> self.block_shift, (len >> self.block_shift) as u32);
        let status = self
            .io
            .deallocate(self.nsid, slba, nlb)
            .map_err(|e| Error::unavailable(format!("cannot deallocate on the target: {e}")))?;
        if !status.is_success() {
            return Err(target_refused(status));
        }
        Ok(())
    }

    pub(crate) fn flush(&mut self) -> Result<()> {
        self.settle()?;
        self.io.flush(self.nsid).map_err(|e| Error::unavailable(format!("the target did not flush: {e}")))
    }
}

fn target_refused(status: Status) -> Error {
    let why = if status.base() == Status::CAPACITY_EXCEEDED {
        "the target's pool is full".to_string()
    } else {
        format!("the target answered {status}")
    };
    Error::unavailable(why)
}

/// Copies `n` bytes at `at` of `volume` (within one cluster) to `target` through
/// `buf`: written there if the volume or a snapshot under it holds any of it,
/// deallocated there if nothing does (a layered volume reads through to its
/// snapshots, and so does its copy).
pub(crate) fn piece(volume: &VolumeIo, buf: &mut Buf, target: &mut TargetQueue, at: u64, n: u64) -> Result<()> {
    let pool = &volume.pool;
    let shift = pool.cluster_shift();
    let (vc, within) = (at >> shift, at & ((1 << shift) - 1));
    let epoch = pool.enter(COPY_SLOT);
    let mut sources = Vec::new();
    volume.map.sources(vc, within, n, shift, |from, bytes, pc| sources.push((from, bytes, pc)));
    let held = sources.iter().any(|&(_, _, pc)| pc != 0);
    let read = sources.iter().filter(|_| held).try_for_each(|&(from, bytes, pc)| {
        let into = &mut buf.as_mut_slice()[(from - within) as usize..(from - within + bytes) as usize];
        match pool.locate(pc, from) {
            _ if pc == 0 => {
                into.fill(0);
                Ok(())
            }
            Some((disk, pos)) => disk.read_now(into, pos),
            None => Err(std::io::Error::other(format!("cluster {pc} is on no disk of the pool"))),
        }
    });
    pool.leave(COPY_SLOT, epoch);
    let read = read.map(|()| held);
    match read {
        Ok(true) => {
            for offset in (0..n).step_by(MAX_TRANSFER) {
                let m = (n - offset).min(MAX_TRANSFER as u64) as usize;
                target.write(at + offset, &buf.as_slice()[offset as usize..offset as usize + m])?;
            }
            Ok(())
        }
        Err(e) => Err(Error::io(format!("reading volume {} at {at}", volume.id), e)),
        Ok(false) => target.deallocate(at, n),
    }
}

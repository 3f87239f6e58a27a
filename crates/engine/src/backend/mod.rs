//! Backends: the storage a namespace is served from.
//!
//! A connection hands each validated NVM command to its namespace's backend, which
//! queues the command's disk work on the reactor's ring ([`Backend::start`]) with no
//! allocation, or answers it at once. The connection keeps the PDUs, the command
//! slots and the sends; everything about where the bytes live is here.
//!
//! | kind | spec | what |
//! |---|---|---|
//! | [`null`] | `null:SIZE` | no storage: reads return zeroes, writes are dropped |
//! | [`memory`] | `memory:SIZE` | RAM (a memfd), lost on exit |
//! | [`file`](mod@file) | `file:PATH[:SIZE]` | a file or block device, with `O_DIRECT` where possible |
//! | [`volume`] | `volume:POOL/NAME` | a logical volume of a disk pool, split at cluster boundaries |
//! | [`volume`] | `replica:POOL/NAME` | a volume exported as a replica to the engine that serves it |
//! | [`remote`] | `remote:HOST:PORT/NQN/NSID` | another engine's namespace, forwarded over NVMe/TCP |
//! | [`mirror`] | `mirror:LEG LEG ...` | a replicated volume: writes go to every leg (replica) |
//!
//! A new backend is one file here that implements [`Backend`] and exports a
//! [`BackendType`], plus its line in [`TYPES`].

pub mod file;
pub mod gate;
pub mod memory;
pub mod mirror;
pub mod null;
pub mod remote;
pub mod volume;

use std::fmt;
use std::sync::Arc;

use nvpool_wire::Status;

use crate::plan::{IoPlan, dsm_byte_ranges};

pub use crate::disk::DiskFd;
use crate::error::{Error, Result};
pub use crate::io::{BlockIo, DiskQueue};
use crate::pool::Pool;

/// Every kind of backend a namespace spec may name.
pub const TYPES: &[BackendType] =
    &[null::TYPE, memory::TYPE, file::TYPE, volume::TYPE, volume::REPLICA, remote::TYPE, mirror::TYPE];

/// The storage behind a namespace, shared by every reactor that serves it.
pub trait Backend: Send + Sync + fmt::Debug {
    /// The kind's name, as in the spec (`file`, `volume`, ...).
    fn kind(&self) -> &'static str;

    /// Size in bytes.
    fn size(&self) -> u64;

    /// What it is, for people (the path, or kind and size).
    fn description(&self) -> String;

    /// How a new engine process opens it again after a hot upgrade.
    fn handover(&self) -> Handover<'_>;

    /// Whether I/O bypasses the page cache.
    fn direct_io(&self) -> bool {
        false
    }

    /// The largest aligned write, in bytes, that a power loss leaves whole (all old
    /// or all new): the storage's physical block. A namespace never gets blocks larger
    /// than this unless told (Identify promises that one block is written whole,
    /// AWUPF 0). Storage that keeps nothing across a power loss has no limit.
    fn power_fail_atomic_bytes(&self) -> u32 {
        u32::MAX
    }

    /// The only block size the namespace may have, where the storage decides it (a
    /// remote namespace has its owner's).
    fn required_block_size(&self) -> Option<u32> {
        None
    }

    /// Whether deallocated blocks are guaranteed to read back as zeroes (Identify
    /// Namespace's DLFEAT).
    fn deallocated_reads_zeroes(&self) -> bool {
        true
    }

    /// Whether written data must be received into a buffer; a backend that drops
    /// writes lets the connection skip the copy.
    fn keeps_write_data(&self) -> bool {
        true
    }

    /// Starts the command in `io`: queues its disk operations on `queue`, defers it to
    /// another thread, or records its outcome in `io.status` and returns with nothing
    /// in flight (the command is then complete). A write's data is in `io`'s buffer.
    fn start(&self, io: &mut BlockIo, queue: &mut DiskQueue<'_>);

    /// Continues a command [`DiskQueue::defer`] handed away, with that thread's answer.
    fn resume(&self, io: &mut BlockIo, status: Status, _queue: &mut DiskQueue<'_>) {
        if !status.is_success() {
            io.status = status;
        }
    }

    /// Called once the command's disk operations have all completed, before
    /// `finished`: a backend with more to do before the answer (a volume recording
    /// the granules a write over its snapshot filled) hands the command on with
    /// [`DiskQueue::defer`], and `resume` ends it.
    fn settle(&self, _io: &mut BlockIo, _queue: &mut DiskQueue<'_>) {}

    /// Called once the command's disk operations have all completed, before it is
    /// answered: lets go of whatever `start` held in `io.hold`.
    fn finished(&self, _io: &mut BlockIo, _reactor: usize) {}

    /// For a read of `len` bytes at `offset` that left no data in a buffer: where the
    /// transport may send them from directly (memory the backend keeps mapped for as
    /// long as it lives). `None` sends zeroes.
    fn mapped(&self, _offset: u64, _len: usize) -> Option<*const u8> {
        None
    }

    /// The volume behind this backend, for the pool's management.
    fn as_volume(&self) -> Option<&volume::VolumeBackend> {
        None
    }

    /// The mirror this is, for the management of its replicas.
    fn as_mirror(&self) -> Option<&mirror::MirrorBackend> {
        None
    }

    /// Whether the data is another engine's, which this one forwards to.
    fn forwards(&self) -> bool {
        false
    }

    /// The namespace is served by `next` from now on, or by nothing: a backend that
    /// holds commands decides what becomes of them.
    fn retired(&self, _next: Option<&dyn Backend>) {}

    /// A host took the namespace's reservation with key `key`: for a replica of a
    /// volume, the generation that serves the volume from now on. What it returns
    /// is set once that is durable: the Acquire completes only then.
    fn reservation_taken(&self, _key: u64) -> Option<Durable> {
        None
    }
}

/// Set, with how it ended, once a change a command made is durable.
pub type Durable = Arc<std::sync::OnceLock<Status>>;

/// How a backend opens again in a new engine process.
pub enum Handover<'a> {
    /// From this spec: the data is on a disk or another engine.
    Spec(String),
    /// RAM: the memfd is handed over, so the data stays.
    Memfd {
        /// The memfd.
        fd: std::os::fd::BorrowedFd<'a>,
        /// Size in bytes.
        size: u64,
    },
}

/// An opened backend, and the identity it carries, if any (a volume keeps its UUID
/// and NGUID for life).
pub struct Opened {
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// (UUID, NGUID) stored with the backend.
    pub identity: Option<([u8; 16], [u8; 16])>,
}

impl Opened {
    fn plain(backend: impl Backend + 'static) -> Result<Opened> {
        Ok(Opened { backend: Arc::new(backend), identity: None })
    }
}

/// What opening a backend may need from the engine.
pub struct OpenEnv<'a> {
    /// The engine's open pool of this name.
    pub pool: &'a dyn Fn(&str) -> Result<Arc<Pool>>,
    /// Where this engine listens, so a remote namespace cannot point at itself.
    pub own_listeners: Vec<std::net::SocketAddr>,
    /// The host NQN remote namespaces present to their owners.
    pub host_nqn: &'a str,
    /// The links remote namespaces may share.
    pub remote_links: &'a remote::RemoteLinks,
    /// The reservation key remote namespaces are opened under: each takes its
    /// namespace's Write Exclusive reservation with it, so that no other engine writes
    /// there (a mirror's generation). `None` for plain forwarding.
    pub fence: Option<u64>,
}

/// A kind of backend: how its spec reads and how it opens.
pub struct BackendType {
    /// The spec's prefix (`file` in `file:/dev/nvme1n1`).
    pub name: &'static str,
    /// The spec's form, for error messages.
    pub usage: &'static str,
    /// Checks the argument (after `name:`) without opening anything.
    pub check: fn(&str) -> std::result::Result<(), String>,
    /// Opens the backend the argument names.
    pub open: fn(&str, &OpenEnv<'_>) -> Result<Opened>,
}

fn usage() -> String {
    let forms: Vec<&str> = TYPES.iter().map(|t| t.usage).collect();
    format!("use {} (e.g. memory:256MiB)", forms.join(", "))
}

fn find(spec: &str) -> std::result::Result<(&'static BackendType, &str), String> {
    let (kind, arg) = spec.split_once(':').ok_or_else(|| format!("backend {spec:?} has no kind: {}", usage()))?;
    let t = TYPES
        .iter()
        .find(|t| t.name == kind)
        .ok_or_else(|| format!("backend kind {kind:?} is unknown: {}", usage()))?;
    Ok((t, arg))
}

/// Checks a backend spec (`null:1GiB`, `file:/path:10GiB`, ...) without opening it.
pub fn check(spec: &str) -> std::result::Result<(), String> {
    let (t, arg) = find(spec)?;
    (t.check)(arg).map_err(|e| format!("backend {spec:?}: {e}; {}", t.usage))
}

/// Opens the backend a spec names.
pub fn open(spec: &str, env: &OpenEnv<'_>) -> Result<Opened> {
    check(spec).map_err(Error::invalid)?;
    let (t, arg) = find(spec).map_err(Error::invalid)?;
    (t.open)(arg, env)
}

/// Most ranges one Dataset Management command carries (NR is 8 bits, 0's based).
const MAX_DSM_RANGES: usize = 256;

/// The byte ranges a Dataset Management command names, copied out of its buffer so
/// operations can be queued on the command while they are read; the count used.
fn deallocated_ranges(io: &BlockIo) -> ([(u64, u64); MAX_DSM_RANGES], usize) {
    let mut out = [(0, 0); MAX_DSM_RANGES];
    let mut n = 0;
    if let (IoPlan::DatasetManagement { ranges, block_shift, .. }, Some(data)) = (io.plan, io.data()) {
        for (slot, range) in out.iter_mut().zip(dsm_byte_ranges(data, ranges, block_shift)) {
            *slot = range;
            n += 1;
        }
    }
    (out, n)
}

/// Parses `SIZE` as a backend argument.
fn size_arg(arg: &str) -> std::result::Result<u64, String> {
    crate::config::parse_size(arg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_checked_by_their_kind() {
        assert!(check("null:1GiB").is_ok());
        assert!(check("memory:256MiB").is_ok());
        assert!(check("file:/a/b").is_ok());
        assert!(check("file:/a/b:1M").is_ok());
        assert!(check("volume:fast/db").is_ok());
        assert!(check("volume:fast").unwrap_err().contains("POOL/NAME"));
        assert!(check("disk:/x").unwrap_err().contains("unknown"));
        assert!(check("file:").is_err());
        assert!(check("null:0").is_err());
        assert!(check("nothing").unwrap_err().contains("no kind"));
    }
}

//! `null:SIZE`: no storage. Reads return zeroes, writes are received and dropped;
//! the fastest a namespace can be, for measuring everything around the storage.

use super::{Backend, BackendType, BlockIo, DiskQueue, Handover, OpenEnv, Opened, size_arg};
use crate::error::Error;

/// The registration of `null:SIZE`.
pub const TYPE: BackendType = BackendType {
    name: "null",
    usage: "null:SIZE",
    check: |arg| size_arg(arg).map(drop),
    open: |arg, _: &OpenEnv<'_>| Opened::plain(Null { size: size_arg(arg).map_err(Error::invalid)? }),
};

/// A namespace with no storage.
#[derive(Debug)]
pub struct Null {
    size: u64,
}

impl Null {
    /// A null backend of `size` bytes.
    pub fn new(size: u64) -> Null {
        Null { size }
    }
}

impl Backend for Null {
    fn kind(&self) -> &'static str {
        "null"
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn description(&self) -> String {
        format!("null:{}", self.size)
    }

    fn handover(&self) -> Handover<'_> {
        Handover::Spec(self.description())
    }

    fn keeps_write_data(&self) -> bool {
        false
    }

    /// Nothing to do: a read with no buffer is sent as zeroes; a read that has one (a
    /// local device's) gets zeroes in it.
    fn start(&self, io: &mut BlockIo, _queue: &mut DiskQueue<'_>) {
        if let crate::plan::IoPlan::Read { len, .. } = io.plan {
            io.zero(0, len as usize);
        }
    }
}

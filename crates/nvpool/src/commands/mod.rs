//! The command families of the `nvpool` binary.

pub mod bench;
pub mod cluster;
pub mod engine;
pub mod supervise;
pub mod top;

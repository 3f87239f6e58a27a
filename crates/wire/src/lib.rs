//! NVMe and NVMe/TCP wire formats for nvpool.
//!
//! Pure encode and decode: no I/O and no `unsafe`. Every structure is laid out as the
//! specifications define it:
//! - NVM Express Base Specification 2.0 (commands, completions, Identify, log pages,
//!   features),
//! - NVM Command Set Specification 1.0 (Read, Write, Flush, Write Zeroes, Dataset
//!   Management, the reservation commands, the I/O Command Set specific Identify
//!   structures),
//! - NVMe over Fabrics 1.1 (Connect, Property Get/Set, Disconnect, discovery log),
//! - NVMe/TCP Transport Specification 1.0 (PDUs and digests),
//! - NVMe RDMA Transport Specification 1.0b (connection private data, keyed SGLs),
//! - NVMe Base 2.x in-band authentication (the DH-HMAC-CHAP messages).
//!
//! Decoders never panic on wire input: they return an error that names what was wrong.
#![forbid(unsafe_code)]

pub mod auth;
pub mod bytes;
pub mod command;
pub mod fabrics;
pub mod identify;
pub mod log;
pub mod rdma;
pub mod reservation;
pub mod status;
pub mod tcp;

pub use command::{Command, Completion};
pub use status::Status;

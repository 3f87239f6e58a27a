//! The nvpool engine: a userspace NVMe-oF target speaking NVMe/TCP and NVMe/RDMA.
//!
//! [`Engine::start`] builds the target from an [`config::EngineConfig`], starts one
//! reactor thread per configured core, and binds the listeners. Management changes go
//! through the `Engine` and its services, which the Unix-socket API in [`mgmt`]
//! exposes. The modules form layers, each importing only the ones below it; the list
//! is in docs/ARCHITECTURE.md and `scripts/check-layers` holds the code to it.

pub mod backend;
pub mod bufpool;
pub mod config;
mod copy;
pub mod cpu;
pub mod disk;
mod engine;
pub mod error;
pub mod granules;
pub mod io;
pub mod listen;
pub mod local;
pub mod metrics;
pub mod mgmt;
pub mod migration;
pub mod nvme;
pub mod plan;
pub mod pool;
pub mod pools;
pub mod qos;
pub mod rdma;
pub mod reactor;
pub mod rebuild;
pub mod ring;
pub mod sync;
pub mod tls;
pub mod upgrade;
pub mod verbs;
mod version;

pub use engine::{Engine, TakenOver};
pub use nvpool_api::{DhchapKeys, DirtyAction, DirtyReport, HostDhchap, NamespaceInfo, SubsystemInfo};
pub use version::{set_version, version};

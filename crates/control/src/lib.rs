//! nvpool's control plane: the controller (cluster state, scheduler, store) and the
//! node agent that carries the controller's orders to its engine. The data path never
//! passes through here; this crate only decides where volumes live and who may reach
//! them.

pub mod access;
pub mod agent;
pub mod client;
pub mod cluster;
pub mod dashboard;
pub mod durability;
pub mod etcd_server;
pub mod fleet;
pub mod metadata;
pub mod metrics;
pub mod model;
pub mod room;
pub mod scheduler;
pub mod server;
pub mod sim;
pub mod store;
/// Real peers for tests (an etcd server); only with the `testkit` feature, which the
/// tests of this crate and of the binary turn on.
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod tls;

/// The generated gRPC types and services (`proto/nvpool/v1/control.proto`).
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("nvpool.v1");

    impl From<nvpool_api::QosLimits> for QosLimits {
        fn from(l: nvpool_api::QosLimits) -> QosLimits {
            QosLimits {
                iops: l.iops,
                read_iops: l.read_iops,
                write_iops: l.write_iops,
                bps: l.bps,
                read_bps: l.read_bps,
                write_bps: l.write_bps,
            }
        }
    }

    impl From<QosLimits> for nvpool_api::QosLimits {
        fn from(l: QosLimits) -> nvpool_api::QosLimits {
            nvpool_api::QosLimits {
                iops: l.iops,
                read_iops: l.read_iops,
                write_iops: l.write_iops,
                bps: l.bps,
                read_bps: l.read_bps,
                write_bps: l.write_bps,
            }
        }
    }
}

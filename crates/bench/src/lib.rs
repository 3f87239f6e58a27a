//! nvpool's benchmark tools: `nvpool bench`, an NVMe/TCP load generator that can
//! drive any NVMe/TCP target, and `nvpool responder`, the protocol-minimal target that
//! measures what the machine itself allows.

pub mod bare;
pub mod histogram;
pub mod idle;
pub mod load;
pub mod responder;

//! The gRPC metadata keys the controller sets on its errors and its clients read:
//! shared here so that a client links none of the server.

/// Metadata on every error the controller itself returns, so that clients can tell
/// them from transport failures.
pub const FROM_CONTROLLER: &str = "nvpool-controller";
/// Metadata on errors meaning "ask another controller".
pub const TRY_ANOTHER: &str = "nvpool-try-another";

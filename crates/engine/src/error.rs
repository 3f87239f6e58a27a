//! The engine's errors: a kind a caller can act on (the management API sends it with
//! the message), and a message that says what was wrong and what to do.

pub use nvpool_api::ErrorKind;

/// An engine error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Error {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What was wrong and what to do.
    pub message: String,
}

/// A result with an engine error.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Error {
        Error { kind, message: message.into() }
    }

    /// What the request names does not exist.
    pub fn not_found(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::NotFound, message)
    }

    /// What the request would create exists already.
    pub fn exists(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::AlreadyExists, message)
    }

    /// The request is wrong.
    pub fn invalid(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    /// Something must change before the request can be done.
    pub fn precondition(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::FailedPrecondition, message)
    }

    /// The engine cannot do it now.
    pub fn unavailable(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Unavailable, message)
    }

    /// A disk or file operation failed: `what` was being done.
    pub fn io(what: impl std::fmt::Display, e: std::io::Error) -> Error {
        Error::new(ErrorKind::Io, format!("{what}: {e}"))
    }

    /// A failure that is nobody's input: a broken invariant, or the system refusing.
    pub fn internal(message: impl Into<String>) -> Error {
        Error::new(ErrorKind::Internal, message)
    }
}

impl From<Error> for String {
    fn from(e: Error) -> String {
        e.message
    }
}

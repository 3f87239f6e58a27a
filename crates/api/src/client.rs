//! Calling an engine.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::Method;

/// What went wrong, as a caller can act on it (the kinds follow gRPC's codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// What the request names does not exist.
    NotFound,
    /// What the request would create exists already.
    AlreadyExists,
    /// The request itself is wrong (a bad name, size or field).
    InvalidArgument,
    /// The request is sound but something must change first (a volume still exported,
    /// a pool that stopped accepting changes).
    FailedPrecondition,
    /// The engine could not be reached, or is stopping.
    Unavailable,
    /// A disk or file operation failed.
    Io,
    /// Anything else: a bug, or a reply this version cannot read.
    Internal,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ErrorKind::NotFound => "not_found",
            ErrorKind::AlreadyExists => "already_exists",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::FailedPrecondition => "failed_precondition",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Io => "io",
            ErrorKind::Internal => "internal",
        })
    }
}

/// A failed call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// What kind of failure.
    pub kind: ErrorKind,
    /// What was wrong and what to do.
    pub message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<ApiError> for String {
    fn from(e: ApiError) -> String {
        e.message
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Reply<R> {
    result: Option<R>,
    error: Option<String>,
    kind: Option<ErrorKind>,
}

/// An error reply as the engine sends it.
#[derive(Serialize)]
pub struct ErrorReply<'a> {
    /// What was wrong and what to do.
    pub error: &'a str,
    /// What kind of failure.
    pub kind: ErrorKind,
}

/// Sends one request to the engine's management socket and returns its reply.
pub fn call<M: Method>(socket: &Path, request: &M) -> Result<M::Reply, ApiError> {
    let fail = |kind, message: String| ApiError { kind, message };
    let unavailable = |e: std::io::Error| {
        fail(
            ErrorKind::Unavailable,
            format!(
                "cannot reach the engine at {}: {e} (is `nvpool engine` running? pass --socket if it uses another path)",
                socket.display()
            ),
        )
    };
    let mut s = UnixStream::connect(socket).map_err(unavailable)?;
    let line = serde_json::json!({ "method": M::NAME, "params": request });
    // One write: formatting straight into the socket would send each token on its own.
    s.write_all(format!("{line}\n").as_bytes()).map_err(unavailable)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(unavailable)?;
    if answer.is_empty() {
        return Err(fail(ErrorKind::Unavailable, format!("the engine at {} closed the connection", socket.display())));
    }
    let reply: Reply<M::Reply> = serde_json::from_str(&answer).map_err(|e| {
        fail(ErrorKind::Internal, format!("the engine's reply to {} is not what this version expects: {e}", M::NAME))
    })?;
    match reply {
        Reply { error: Some(e), kind, .. } => Err(fail(kind.unwrap_or(ErrorKind::Internal), e)),
        Reply { result: Some(r), .. } => Ok(r),
        Reply { result: None, error: None, .. } => {
            Err(fail(ErrorKind::Internal, format!("the engine's reply to {} has no result", M::NAME)))
        }
    }
}

//! Calling an engine.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde::Deserialize;

use crate::Method;

/// What went wrong with a call, as a caller can act on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The engine could not be reached (not running, or another socket path).
    Unavailable,
    /// The engine answered with an error: the request was refused.
    Refused,
    /// The engine's reply could not be read as the method's reply.
    Malformed,
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
    writeln!(s, "{line}").map_err(unavailable)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(unavailable)?;
    if answer.is_empty() {
        return Err(fail(ErrorKind::Unavailable, format!("the engine at {} closed the connection", socket.display())));
    }
    let reply: Reply<M::Reply> = serde_json::from_str(&answer).map_err(|e| {
        fail(ErrorKind::Malformed, format!("the engine's reply to {} is not what this version expects: {e}", M::NAME))
    })?;
    match reply {
        Reply { error: Some(e), .. } => Err(fail(ErrorKind::Refused, e)),
        Reply { result: Some(r), .. } => Ok(r),
        Reply { result: None, error: None } => {
            Err(fail(ErrorKind::Malformed, format!("the engine's reply to {} has no result", M::NAME)))
        }
    }
}

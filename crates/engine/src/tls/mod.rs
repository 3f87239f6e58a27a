//! NVMe/TCP over TLS 1.3 with pre-shared keys (the NVMe/TCP transport's secure
//! channel), as the Linux host speaks it through `tlshd`.
//!
//! A listener whose mode is not `off` hands each accepted socket to [`admit`], which
//! runs on a thread of its own, away from the reactors: it looks at the first byte the
//! host sends (a TLS handshake record starts with 22, an NVMe/TCP ICReq with 0), runs
//! the TLS handshake with OpenSSL ([`handshake`]), then puts the session's keys into the
//! kernel ([`ktls`]). The socket then goes to a reactor like any other: the kernel
//! encrypts and decrypts, and the reactor's I/O path is the same with TLS or without.

pub mod handshake;
pub mod ktls;

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

pub use nvpool_api::TlsMode;
use nvpool_api::TlsPsk;
use nvpool_auth::{ConfiguredPsk, Identity, Kdf};

use crate::nvme::Target;
use crate::reactor::{Msg, ReactorLink};

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE_RECORD: u8 = 22;
/// How long a host may take to start and finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes that may run at once; connections beyond are closed, so a flood of
/// half-open connections costs threads only up to this bound.
const MAX_HANDSHAKES: usize = 64;

static HANDSHAKES: AtomicUsize = AtomicUsize::new(0);
static NEXT_REACTOR: AtomicUsize = AtomicUsize::new(0);

/// Who a TLS connection proved to be: the NQNs of the PSK identity it used. Its
/// Connect must name the same host and subsystem.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsPeer {
    /// The host NQN of the identity.
    pub host_nqn: String,
    /// The subsystem NQN of the identity.
    pub subsystem_nqn: String,
}

/// Takes a socket a `tls = allowed | required` listener accepted: on a thread of its
/// own, it tells TLS from plain NVMe/TCP, runs the handshake, and hands the socket to
/// a reactor; or closes it, with a log line that says why.
pub(crate) fn admit(stream: TcpStream, port_id: u16, mode: TlsMode, target: Arc<Target>, links: Arc<Vec<ReactorLink>>) {
    let peer = stream.peer_addr().map_or_else(|_| "an unknown address".to_string(), |a| a.to_string());
    if HANDSHAKES.fetch_add(1, Ordering::AcqRel) >= MAX_HANDSHAKES {
        HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
        tracing::warn!("{MAX_HANDSHAKES} TLS handshakes are under way: the connection from {peer} is closed");
        return;
    }
    let from = peer.clone();
    let spawned = std::thread::Builder::new().name("nvpool-tls".into()).spawn(move || {
        match sort(&stream, mode, target) {
            Ok(tls) => {
                let owner = NEXT_REACTOR.fetch_add(1, Ordering::Relaxed) % links.len();
                links[owner].send(Msg::Adopt { stream, port_id, tls: tls.map(Box::new) });
            }
            Err(why) => tracing::warn!("connection from {from} to listener {port_id} closed: {why}"),
        }
        HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
    });
    if let Err(e) = spawned {
        HANDSHAKES.fetch_sub(1, Ordering::AcqRel);
        tracing::warn!("cannot start a TLS handshake thread ({e}): the connection from {peer} is closed");
    }
}

/// Tells TLS from plain NVMe/TCP and, for TLS, runs the handshake and turns on kTLS.
/// `Ok(None)`: a plain connection the listener takes.
fn sort(stream: &TcpStream, mode: TlsMode, target: Arc<Target>) -> Result<Option<TlsPeer>, String> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| format!("socket: {e}"))?;
    stream.set_write_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(|e| format!("socket: {e}"))?;
    let mut first = [0u8; 1];
    let n = loop {
        match stream.peek(&mut first) {
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            r => break r.map_err(|e| format!("nothing arrived: {e}"))?,
        }
    };
    if n == 0 {
        return Err("the host closed the connection before it sent anything".into());
    }
    let peer = if first[0] == TLS_HANDSHAKE_RECORD {
        let done = handshake::accept(stream, Arc::new(move |identity: &Identity| target.tls_psk(identity)))?;
        ktls::enable(stream, &done.keys).map_err(|e| {
            format!("the TLS handshake succeeded, but the kernel cannot take its keys ({e}); is the `tls` module loaded (modprobe tls)?")
        })?;
        let addr = stream.peer_addr().map_or_else(|_| "?".to_string(), |a: SocketAddr| a.to_string());
        tracing::info!("TLS 1.3 session with {addr} ({}, identity {})", done.keys.suite.name(), done.identity);
        Some(TlsPeer { host_nqn: done.identity.host_nqn, subsystem_nqn: done.identity.subsystem_nqn })
    } else if mode == TlsMode::Required {
        return Err("the host speaks plain NVMe/TCP to a listener that requires TLS (connect with --tls)".into());
    } else {
        None
    };
    stream.set_read_timeout(None).map_err(|e| format!("socket: {e}"))?;
    stream.set_write_timeout(None).map_err(|e| format!("socket: {e}"))?;
    Ok(peer)
}

/// A host's configured PSK for one subsystem, and how its tools derive TLS keys.
#[derive(Debug, PartialEq, Eq)]
pub struct HostPsk {
    psk: ConfiguredPsk,
    kdf: Kdf,
}

impl HostPsk {
    /// From the configuration or the management API, with an error that says what is
    /// wrong and how to make a good key.
    pub fn from_config(c: &TlsPsk) -> Result<HostPsk, String> {
        let psk = ConfiguredPsk::parse(&c.key).map_err(|e| e.to_string())?;
        let kdf = match &c.kdf {
            None => Kdf::default(),
            Some(name) => {
                Kdf::parse(name).ok_or_else(|| format!("PSK derivation `{name}` is not one of compat, rfc8446"))?
            }
        };
        Ok(HostPsk { psk, kdf })
    }

    /// Back to the configuration form (for a hot upgrade's image; never listed).
    pub fn to_config(&self) -> TlsPsk {
        TlsPsk { key: self.psk.to_interchange(), kdf: Some(self.kdf.name().into()) }
    }

    /// The key TLS runs with for `identity`, if it can belong to this PSK.
    pub fn tls_psk(&self, identity: &Identity) -> Option<Vec<u8>> {
        self.psk.tls_psk(self.kdf, identity)
    }
}

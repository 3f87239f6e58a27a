//! The server side of the TLS 1.3 handshake with an external PSK, with OpenSSL.
//!
//! OpenSSL finds a TLS 1.3 PSK through a callback that builds a session for the
//! identity the host offers. The `openssl` crate has no wrapper for that callback, so
//! this module declares the few C functions it needs. The handshake ends with the
//! traffic secrets (from OpenSSL's key log), which [`super::ktls`] gives the kernel.
#![allow(unsafe_code)]

use std::net::TcpStream;
use std::sync::{Arc, Mutex, OnceLock};

use foreign_types::ForeignTypeRef;
use nvpool_auth::Identity;
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::ssl::{HandshakeError, Ssl, SslContext, SslMethod, SslRef, SslVersion};
use openssl_sys as ffi;

use super::ktls::{SessionKeys, Suite};
use crate::sync::lock;

/// Finds the TLS PSK for an identity, or `None` when no host may use it.
pub type KeyLookup = dyn Fn(&Identity) -> Option<Vec<u8>> + Send + Sync;

/// A finished handshake.
pub struct Established {
    /// The identity the host proved it holds the key of.
    pub identity: Identity,
    /// The session's traffic secrets.
    pub keys: SessionKeys,
}

/// What one handshake's callbacks share with it, kept in the `SSL`'s extra data.
struct HandshakeState {
    lookup: Arc<KeyLookup>,
    /// The identity whose key was given to OpenSSL.
    chosen: Mutex<Option<Identity>>,
    /// An identity that was offered and refused, for the error.
    refused: Mutex<Option<String>>,
    /// Why a session could not be made, for the error.
    failed: Mutex<Option<String>>,
    /// The application traffic secrets from the key log.
    secrets: Mutex<TrafficSecrets>,
}

#[derive(Default)]
struct TrafficSecrets {
    server: Option<Vec<u8>>,
    client: Option<Vec<u8>>,
}

/// Runs the server side of a handshake on `stream` (blocking). On success the host
/// has proved it holds the key `lookup` gave for its identity.
pub fn accept(stream: &TcpStream, lookup: Arc<KeyLookup>) -> Result<Established, String> {
    let context = context()?;
    let mut ssl = Ssl::new(context).map_err(|e| format!("TLS setup: {e}"))?;
    let state = HandshakeState {
        lookup,
        chosen: Mutex::new(None),
        refused: Mutex::new(None),
        failed: Mutex::new(None),
        secrets: Mutex::new(TrafficSecrets::default()),
    };
    ssl.set_ex_data(state_index()?, state);
    let session = match ssl.accept(stream) {
        Ok(s) => s,
        Err(e) => {
            let state = match &e {
                HandshakeError::Failure(mid) | HandshakeError::WouldBlock(mid) => {
                    state_index().ok().and_then(|i| mid.ssl().ex_data(i))
                }
                HandshakeError::SetupFailure(_) => None,
            };
            if let Some(failed) = state.and_then(|st| lock(&st.failed).take()) {
                return Err(failed);
            }
            // A key was found for the identity, and the host's did not match it.
            if let Some(identity) = state.and_then(|st| lock(&st.chosen).take()) {
                return Err(format!(
                    "the host's key for identity {identity} is not the PSK configured for it (or the host derives \
                     TLS keys another way: --tls-psk-kdf compat for libnvme before mid-2025, rfc8446 for SPDK and \
                     newer libnvme); OpenSSL: {e}"
                ));
            }
            return Err(match state.and_then(|st| lock(&st.refused).take()) {
                Some(identity) => format!("no TLS PSK for the identity the host offered ({identity})"),
                None => format!("TLS handshake failed: {e}"),
            });
        }
    };
    let ssl = session.ssl();
    let state = ssl.ex_data(state_index()?).ok_or("TLS handshake lost its state")?;
    let identity = lock(&state.chosen).take().ok_or("the TLS session was not made with a PSK")?;
    let suite = ssl
        .current_cipher()
        .and_then(|c| Suite::from_name(c.standard_name().unwrap_or(c.name())))
        .ok_or("the TLS session has a cipher suite NVMe/TCP does not use")?;
    let secrets = std::mem::take(&mut *lock(&state.secrets));
    let (Some(to_host), Some(from_host)) = (secrets.server, secrets.client) else {
        return Err("OpenSSL did not report the session's traffic secrets".into());
    };
    // The session object goes without a close_notify: the connection goes on in the
    // kernel.
    Ok(Established { identity, keys: SessionKeys { suite, to_host, from_host } })
}

/// The OpenSSL context every handshake shares: TLS 1.3 only, NVMe/TCP's two suites,
/// no certificate, no session tickets (the Linux host takes nothing but application
/// data after the handshake, and the kernel's TLS layer could not read a ticket).
fn context() -> Result<&'static SslContext, String> {
    static CONTEXT: OnceLock<Result<SslContext, String>> = OnceLock::new();
    CONTEXT
        .get_or_init(|| {
            let build = || -> Result<SslContext, ErrorStack> {
                let mut b = SslContext::builder(SslMethod::tls_server())?;
                b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
                b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
                b.set_ciphersuites(&format!("{}:{}", Suite::Aes128GcmSha256.name(), Suite::Aes256GcmSha384.name()))?;
                b.set_num_tickets(0)?;
                b.set_keylog_callback(record_secret);
                // SAFETY: the context is being built and is ours; the callback has the
                // signature OpenSSL declares.
                unsafe { SSL_CTX_set_psk_find_session_callback(b.as_ptr(), Some(find_session)) };
                Ok(b.build())
            };
            build().map_err(|e| format!("cannot set up OpenSSL for TLS: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn state_index() -> Result<Index<Ssl, HandshakeState>, String> {
    static INDEX: OnceLock<Result<Index<Ssl, HandshakeState>, String>> = OnceLock::new();
    INDEX.get_or_init(|| Ssl::new_ex_index().map_err(|e| format!("OpenSSL: {e}"))).clone()
}

/// Keeps the application traffic secrets from OpenSSL's key log lines
/// (`LABEL client_random secret`, hex).
fn record_secret(ssl: &SslRef, line: &str) {
    let Some(state) = state_index().ok().and_then(|i| ssl.ex_data(i)) else { return };
    let mut words = line.split(' ');
    let (Some(label), Some(_), Some(hex)) = (words.next(), words.next(), words.next()) else { return };
    let Some(secret) = decode_hex(hex) else { return };
    let mut secrets = lock(&state.secrets);
    match label {
        "SERVER_TRAFFIC_SECRET_0" => secrets.server = Some(secret),
        "CLIENT_TRAFFIC_SECRET_0" => secrets.client = Some(secret),
        _ => {}
    }
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

type FindSession = unsafe extern "C" fn(
    ssl: *mut ffi::SSL,
    identity: *const u8,
    identity_len: usize,
    session: *mut *mut ffi::SSL_SESSION,
) -> libc::c_int;

unsafe extern "C" {
    fn SSL_CTX_set_psk_find_session_callback(ctx: *mut ffi::SSL_CTX, cb: Option<FindSession>);
    fn SSL_SESSION_new() -> *mut ffi::SSL_SESSION;
    fn SSL_SESSION_set1_master_key(s: *mut ffi::SSL_SESSION, key: *const u8, len: usize) -> libc::c_int;
    fn SSL_SESSION_set_cipher(s: *mut ffi::SSL_SESSION, cipher: *const ffi::SSL_CIPHER) -> libc::c_int;
    fn SSL_SESSION_set_protocol_version(s: *mut ffi::SSL_SESSION, version: libc::c_int) -> libc::c_int;
    fn SSL_CIPHER_find(ssl: *mut ffi::SSL, code: *const u8) -> *const ffi::SSL_CIPHER;
}

/// OpenSSL's question: which key goes with this identity? Answers with a session
/// holding the TLS PSK and its suite, or with no session (OpenSSL then refuses the
/// handshake: this engine has no certificate to fall back on). Returns 0 only when
/// OpenSSL itself failed.
unsafe extern "C" fn find_session(
    ssl: *mut ffi::SSL,
    identity: *const u8,
    identity_len: usize,
    session: *mut *mut ffi::SSL_SESSION,
) -> libc::c_int {
    // SAFETY: OpenSSL calls with the live SSL of the handshake, an identity of
    // `identity_len` readable bytes, and a place for the session.
    let (ssl_ref, offered) = unsafe {
        *session = std::ptr::null_mut();
        (SslRef::from_ptr(ssl), std::slice::from_raw_parts(identity, identity_len))
    };
    let Some(state) = state_index().ok().and_then(|i| ssl_ref.ex_data(i)) else { return 0 };
    let text = String::from_utf8_lossy(offered);
    let found = Identity::parse(&text).and_then(|id| Some((Suite::for_hash(id.hash)?, (state.lookup)(&id)?, id)));
    let Some((suite, mut key, id)) = found else {
        *lock(&state.refused) = Some(text.into_owned());
        return 1;
    };
    // SAFETY: the SSL is live; the code is two readable bytes; the new session is ours
    // until it is handed to OpenSSL through `session` (or freed on failure); the key is
    // readable for its length and copied.
    let made: Result<(), &str> = unsafe {
        let cipher = SSL_CIPHER_find(ssl, suite.code().as_ptr());
        let s = SSL_SESSION_new();
        let outcome = if cipher.is_null() {
            Err("SSL_CIPHER_find")
        } else if s.is_null() {
            Err("SSL_SESSION_new")
        } else if SSL_SESSION_set1_master_key(s, key.as_ptr(), key.len()) != 1 {
            Err("SSL_SESSION_set1_master_key")
        } else if SSL_SESSION_set_cipher(s, cipher) != 1 {
            Err("SSL_SESSION_set_cipher")
        } else if SSL_SESSION_set_protocol_version(s, ffi::TLS1_3_VERSION) != 1 {
            Err("SSL_SESSION_set_protocol_version")
        } else {
            *session = s;
            Ok(())
        };
        if outcome.is_err() && !s.is_null() {
            ffi::SSL_SESSION_free(s);
        }
        outcome
    };
    key.fill(0);
    if let Err(call) = made {
        *lock(&state.failed) = Some(format!("OpenSSL's {call} failed for the session of identity {id}"));
        return 0;
    }
    *lock(&state.chosen) = Some(id);
    1
}

//! The host side of NVMe/TCP's TLS 1.3 handshake with a pre-shared key, with OpenSSL,
//! for tests of TLS listeners. It stops at the handshake: the records after it are
//! kernel TLS's work on both ends, which the kernel host in the test guest exercises.
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::net::TcpStream;

use openssl::ssl::{Ssl, SslContext, SslMethod, SslVerifyMode, SslVersion};
use openssl_sys as ffi;

type UseSession = unsafe extern "C" fn(
    *mut ffi::SSL,
    *const ffi::EVP_MD,
    *mut *const u8,
    *mut usize,
    *mut *mut ffi::SSL_SESSION,
) -> libc::c_int;

unsafe extern "C" {
    fn SSL_CTX_set_psk_use_session_callback(ctx: *mut ffi::SSL_CTX, cb: Option<UseSession>);
    fn SSL_SESSION_new() -> *mut ffi::SSL_SESSION;
    fn SSL_SESSION_set1_master_key(s: *mut ffi::SSL_SESSION, key: *const u8, len: usize) -> libc::c_int;
    fn SSL_SESSION_set_cipher(s: *mut ffi::SSL_SESSION, cipher: *const ffi::SSL_CIPHER) -> libc::c_int;
    fn SSL_SESSION_set_protocol_version(s: *mut ffi::SSL_SESSION, version: libc::c_int) -> libc::c_int;
    fn SSL_CIPHER_find(ssl: *mut ffi::SSL, code: *const u8) -> *const ffi::SSL_CIPHER;
}

/// What the session callback offers: identity, key and suite code. OpenSSL's callback
/// has no context argument, and the handshake runs on the calling thread.
struct Offer {
    identity: String,
    key: Vec<u8>,
    suite: [u8; 2],
}

thread_local!(static OFFER: RefCell<Option<Offer>> = const { RefCell::new(None) });

/// Runs a TLS 1.3 handshake on `stream` offering `identity` with the TLS PSK `key` (32
/// bytes: TLS_AES_128_GCM_SHA256; 48: TLS_AES_256_GCM_SHA384). Returns the suite the
/// server chose, or why the handshake failed.
pub fn psk_handshake(stream: TcpStream, identity: &str, key: &[u8]) -> Result<String, String> {
    let (suite, name) = match key.len() {
        32 => ([0x13, 0x01], "TLS_AES_128_GCM_SHA256"),
        48 => ([0x13, 0x02], "TLS_AES_256_GCM_SHA384"),
        n => return Err(format!("a TLS PSK is 32 or 48 bytes, not {n}")),
    };
    OFFER.with(|o| *o.borrow_mut() = Some(Offer { identity: identity.into(), key: key.to_vec(), suite }));
    let context = || -> Result<SslContext, openssl::error::ErrorStack> {
        let mut b = SslContext::builder(SslMethod::tls_client())?;
        b.set_min_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_max_proto_version(Some(SslVersion::TLS1_3))?;
        b.set_ciphersuites(name)?;
        b.set_verify(SslVerifyMode::NONE);
        // SAFETY: the context is ours and being built; the callback has OpenSSL's signature.
        unsafe { SSL_CTX_set_psk_use_session_callback(b.as_ptr(), Some(use_session)) };
        Ok(b.build())
    };
    let context = context().map_err(|e| e.to_string())?;
    let ssl = Ssl::new(&context).map_err(|e| e.to_string())?;
    let result = ssl
        .connect(stream)
        .map(|s| s.ssl().current_cipher().map(|c| c.name().to_string()).unwrap_or_default())
        .map_err(|e| e.to_string());
    OFFER.with(|o| o.borrow_mut().take());
    result
}

/// OpenSSL asks which PSK to offer: a session with the key and suite of `OFFER`.
unsafe extern "C" fn use_session(
    ssl: *mut ffi::SSL,
    _md: *const ffi::EVP_MD,
    id: *mut *const u8,
    id_len: *mut usize,
    session: *mut *mut ffi::SSL_SESSION,
) -> libc::c_int {
    OFFER.with(|o| {
        let o = o.borrow();
        let Some(offer) = o.as_ref() else { return 0 };
        // SAFETY: OpenSSL passes a live SSL and places for the answers. The session is
        // new and handed over (or freed); the identity stays in the thread-local until
        // the handshake is over.
        unsafe {
            let cipher = SSL_CIPHER_find(ssl, offer.suite.as_ptr());
            let s = SSL_SESSION_new();
            if cipher.is_null()
                || s.is_null()
                || SSL_SESSION_set1_master_key(s, offer.key.as_ptr(), offer.key.len()) != 1
                || SSL_SESSION_set_cipher(s, cipher) != 1
                || SSL_SESSION_set_protocol_version(s, ffi::TLS1_3_VERSION) != 1
            {
                if !s.is_null() {
                    ffi::SSL_SESSION_free(s);
                }
                return 0;
            }
            *id = offer.identity.as_ptr();
            *id_len = offer.identity.len();
            *session = s;
        }
        1
    })
}

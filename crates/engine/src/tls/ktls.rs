//! Kernel TLS: once a handshake is done, the session's traffic keys go into the socket
//! (`TCP_ULP` "tls", then `TLS_TX` and `TLS_RX`), and from then on the kernel seals
//! and opens the records. Reads and writes on the socket carry plain NVMe/TCP PDUs.
#![allow(unsafe_code)]

use std::net::TcpStream;
use std::os::fd::AsRawFd;

use nvpool_auth::Hash;
use nvpool_auth::psk::expand_label;

/// `SOL_TLS` options and values of `linux/tls.h`.
const SOL_TLS: libc::c_int = 282;
const TLS_TX: libc::c_int = 1;
const TLS_RX: libc::c_int = 2;
const TLS_1_3_VERSION: u16 = 0x0304;
const TLS_CIPHER_AES_GCM_128: u16 = 51;
const TLS_CIPHER_AES_GCM_256: u16 = 52;
/// The AEAD nonce length of both suites.
const IV_LEN: usize = 12;
/// Of the nonce, the part the kernel calls the salt (the rest is its "iv").
const SALT_LEN: usize = 4;

/// The TLS 1.3 cipher suites NVMe/TCP uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Suite {
    /// TLS_AES_128_GCM_SHA256, for SHA-256 PSKs.
    Aes128GcmSha256,
    /// TLS_AES_256_GCM_SHA384, for SHA-384 PSKs.
    Aes256GcmSha384,
}

impl Suite {
    /// The suite's name, as OpenSSL and the TLS registry spell it.
    pub fn name(self) -> &'static str {
        match self {
            Suite::Aes128GcmSha256 => "TLS_AES_128_GCM_SHA256",
            Suite::Aes256GcmSha384 => "TLS_AES_256_GCM_SHA384",
        }
    }

    /// The suite with this name.
    pub fn from_name(name: &str) -> Option<Suite> {
        [Suite::Aes128GcmSha256, Suite::Aes256GcmSha384].into_iter().find(|s| s.name() == name)
    }

    /// The suite for a PSK of this hash.
    pub fn for_hash(hash: Hash) -> Option<Suite> {
        match hash {
            Hash::Sha256 => Some(Suite::Aes128GcmSha256),
            Hash::Sha384 => Some(Suite::Aes256GcmSha384),
            Hash::Sha512 => None,
        }
    }

    /// The two bytes that identify the suite on the wire.
    pub fn code(self) -> [u8; 2] {
        match self {
            Suite::Aes128GcmSha256 => [0x13, 0x01],
            Suite::Aes256GcmSha384 => [0x13, 0x02],
        }
    }

    fn hash(self) -> Hash {
        match self {
            Suite::Aes128GcmSha256 => Hash::Sha256,
            Suite::Aes256GcmSha384 => Hash::Sha384,
        }
    }

    fn key_len(self) -> usize {
        match self {
            Suite::Aes128GcmSha256 => 16,
            Suite::Aes256GcmSha384 => 32,
        }
    }

    fn kernel_cipher(self) -> u16 {
        match self {
            Suite::Aes128GcmSha256 => TLS_CIPHER_AES_GCM_128,
            Suite::Aes256GcmSha384 => TLS_CIPHER_AES_GCM_256,
        }
    }
}

/// The application traffic secrets of a finished handshake. Zeroed when dropped.
pub struct SessionKeys {
    /// The negotiated suite.
    pub suite: Suite,
    /// The server's secret: what the engine sends is sealed with it.
    pub to_host: Vec<u8>,
    /// The client's secret: what the host sends is sealed with it.
    pub from_host: Vec<u8>,
}

impl Drop for SessionKeys {
    fn drop(&mut self) {
        self.to_host.fill(0);
        self.from_host.fill(0);
    }
}

/// Hands the session to the kernel. Both directions start at record sequence 0: the
/// engine sends no session tickets, so no application record has passed yet.
pub fn enable(stream: &TcpStream, keys: &SessionKeys) -> std::io::Result<()> {
    set_option(stream, libc::IPPROTO_TCP, libc::TCP_ULP, b"tls")?;
    let mut tx = crypto_info(keys.suite, &keys.to_host);
    let sent = set_option(stream, SOL_TLS, TLS_TX, &tx);
    tx.fill(0);
    sent?;
    let mut rx = crypto_info(keys.suite, &keys.from_host);
    let received = set_option(stream, SOL_TLS, TLS_RX, &rx);
    rx.fill(0);
    received
}

/// The kernel's `tls12_crypto_info_aes_gcm_*` for one direction: version, cipher, the
/// nonce's last 8 bytes, the key, the nonce's first 4 bytes, and the record sequence.
fn crypto_info(suite: Suite, traffic_secret: &[u8]) -> Vec<u8> {
    let mut key = expand_label(suite.hash(), traffic_secret, b"key", b"", suite.key_len());
    let mut iv = expand_label(suite.hash(), traffic_secret, b"iv", b"", IV_LEN);
    let mut info = Vec::with_capacity(4 + IV_LEN + key.len() + 8);
    info.extend_from_slice(&TLS_1_3_VERSION.to_ne_bytes());
    info.extend_from_slice(&suite.kernel_cipher().to_ne_bytes());
    info.extend_from_slice(&iv[SALT_LEN..]);
    info.extend_from_slice(&key);
    info.extend_from_slice(&iv[..SALT_LEN]);
    info.extend_from_slice(&[0u8; 8]);
    key.fill(0);
    iv.fill(0);
    info
}

fn set_option(stream: &TcpStream, level: libc::c_int, name: libc::c_int, value: &[u8]) -> std::io::Result<()> {
    // SAFETY: the descriptor is the stream's, open for the call; the value is a
    // readable buffer of the length passed, which the kernel copies.
    let rc = unsafe {
        libc::setsockopt(stream.as_raw_fd(), level, name, value.as_ptr().cast(), value.len() as libc::socklen_t)
    };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crypto_info_has_the_kernel_layout() {
        let secret = [7u8; 32];
        let info = crypto_info(Suite::Aes128GcmSha256, &secret);
        // tls12_crypto_info_aes_gcm_128: 4 + iv 8 + key 16 + salt 4 + rec_seq 8.
        assert_eq!(info.len(), 40);
        assert_eq!(&info[..2], &0x0304u16.to_ne_bytes());
        assert_eq!(&info[2..4], &51u16.to_ne_bytes());
        let iv = expand_label(Hash::Sha256, &secret, b"iv", b"", 12);
        assert_eq!(&info[4..12], &iv[4..]);
        assert_eq!(&info[28..32], &iv[..4]);
        assert_eq!(&info[32..], &[0u8; 8]);
        // tls12_crypto_info_aes_gcm_256: the key is 32 bytes.
        assert_eq!(crypto_info(Suite::Aes256GcmSha384, &[7u8; 48]).len(), 56);
    }
}

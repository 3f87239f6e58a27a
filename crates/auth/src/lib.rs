//! DH-HMAC-CHAP, the in-band authentication of NVMe over Fabrics (NVMe Base 2.x,
//! "Authentication"), as the Linux host and target implement it: the `DHHC-1` secrets,
//! the hash functions, the RFC 7919 finite-field Diffie-Hellman groups, and the
//! responses each side computes; and the pre-shared keys of NVMe/TCP's TLS channel.
//! Pure code: no I/O, no `unsafe`. The messages that carry these values are in
//! `nvpool-wire`.

pub mod chap;
pub mod ffdhe;
mod framing;
pub mod hash;
pub mod psk;
pub mod secret;

pub use ffdhe::{DhGroup, KeyPair};
pub use hash::Hash;
pub use psk::{ConfiguredPsk, Identity, Kdf, PskError};
pub use secret::{Secret, SecretError};

/// Random bytes from the operating system.
pub fn random_bytes(buf: &mut [u8]) {
    // The kernel's generator fails only before it is seeded at boot, long before an
    // engine runs; there is no safe way on without it.
    getrandom::fill(buf).expect("the operating system has no random numbers");
}

/// A random sequence number: never 0, which the spec reserves.
pub fn random_seqnum() -> u32 {
    loop {
        let mut b = [0u8; 4];
        random_bytes(&mut b);
        let n = u32::from_le_bytes(b);
        if n != 0 {
            return n;
        }
    }
}

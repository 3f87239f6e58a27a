//! The hash functions DH-HMAC-CHAP names by identifier.

use hmac::{KeyInit, Mac};
use sha2::Digest;

/// A hash function, with its identifier on the wire (HMAC identifiers in `DHHC-1`
/// secrets use the same numbers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hash {
    /// SHA-256 (identifier 1).
    Sha256,
    /// SHA-384 (identifier 2).
    Sha384,
    /// SHA-512 (identifier 3).
    Sha512,
}

impl Hash {
    /// Every hash, in identifier order.
    pub const ALL: [Hash; 3] = [Hash::Sha256, Hash::Sha384, Hash::Sha512];

    /// The identifier on the wire.
    pub fn id(self) -> u8 {
        match self {
            Hash::Sha256 => 1,
            Hash::Sha384 => 2,
            Hash::Sha512 => 3,
        }
    }

    /// The hash with this identifier.
    pub fn from_id(id: u8) -> Option<Hash> {
        Hash::ALL.into_iter().find(|h| h.id() == id)
    }

    /// Digest length in bytes.
    pub fn output_len(self) -> usize {
        match self {
            Hash::Sha256 => 32,
            Hash::Sha384 => 48,
            Hash::Sha512 => 64,
        }
    }

    /// The name users write: `sha256`, `sha384`, `sha512`.
    pub fn name(self) -> &'static str {
        match self {
            Hash::Sha256 => "sha256",
            Hash::Sha384 => "sha384",
            Hash::Sha512 => "sha512",
        }
    }

    /// Parses a name: `sha256` or Linux nvmet's `hmac(sha256)`.
    pub fn parse(name: &str) -> Option<Hash> {
        let bare = name.strip_prefix("hmac(").and_then(|n| n.strip_suffix(')')).unwrap_or(name);
        Hash::ALL.into_iter().find(|h| h.name() == bare)
    }

    /// The digest of the concatenation of `parts`.
    pub fn digest(self, parts: &[&[u8]]) -> Vec<u8> {
        fn run<D: Digest>(parts: &[&[u8]]) -> Vec<u8> {
            let mut d = D::new();
            for p in parts {
                d.update(p);
            }
            d.finalize().to_vec()
        }
        match self {
            Hash::Sha256 => run::<sha2::Sha256>(parts),
            Hash::Sha384 => run::<sha2::Sha384>(parts),
            Hash::Sha512 => run::<sha2::Sha512>(parts),
        }
    }

    /// HMAC with this hash, keyed with `key`, of the concatenation of `parts`.
    pub fn hmac(self, key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
        fn run<M: Mac + KeyInit>(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
            // HMAC takes keys of any length.
            let mut m = <M as KeyInit>::new_from_slice(key).expect("HMAC takes any key length");
            for p in parts {
                m.update(p);
            }
            m.finalize().into_bytes().to_vec()
        }
        match self {
            Hash::Sha256 => run::<hmac::Hmac<sha2::Sha256>>(key, parts),
            Hash::Sha384 => run::<hmac::Hmac<sha2::Sha384>>(key, parts),
            Hash::Sha512 => run::<hmac::Hmac<sha2::Sha512>>(key, parts),
        }
    }
}

impl std::fmt::Display for Hash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc_4231_test_case_2() {
        // Key "Jefe", data "what do ya want for nothing?".
        let parts: [&[u8]; 2] = [b"what do ya want ", b"for nothing?"];
        assert_eq!(
            hex(&Hash::Sha256.hmac(b"Jefe", &parts)),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&Hash::Sha384.hmac(b"Jefe", &parts)),
            "af45d2e376484031617f78d2b58a6b1b9c7ef464f5a01b47e42ec3736322445e8e2240ca5e69e2c78b3239ecfab21649"
        );
        assert_eq!(
            hex(&Hash::Sha512.hmac(b"Jefe", &parts)),
            "164b7a7bfcf819e2e395fbe73b56e0a387bd64222e831fd610270cd7ea2505549758bf75c05a994a6d034f65f8f0e6fdcaeab1a34d4a6b4b636e070a38bce737"
        );
    }

    #[test]
    fn names_and_identifiers_round_trip() {
        for h in Hash::ALL {
            assert_eq!(Hash::from_id(h.id()), Some(h));
            assert_eq!(Hash::parse(h.name()), Some(h));
            assert_eq!(Hash::parse(&format!("hmac({h})")), Some(h));
            assert_eq!(h.digest(&[b"x"]).len(), h.output_len());
        }
        assert_eq!(Hash::from_id(0), None);
        assert_eq!(Hash::parse("md5"), None);
    }
}

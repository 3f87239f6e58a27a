//! DH-HMAC-CHAP secrets in the `DHHC-1:hh:<base64>:` representation that nvme-cli's
//! `gen-dhchap-key` prints and the Linux host and target read: `hh` names the hash the
//! secret is transformed with before use (00 none, 01-03 SHA-256/384/512), and the
//! base64 holds the key followed by its CRC-32, least significant byte first.

use crate::Hash;
use crate::framing::{self, FrameError};

/// What every secret starts with.
const PREFIX: &str = "DHHC-1:";

/// What is appended to an NQN when a secret is transformed.
const TRANSFORM_SUFFIX: &[u8] = b"NVMe-over-Fabrics";

/// A secret. Its bytes are never printed: `Debug` shows only its shape.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret {
    key: Vec<u8>,
    transform: Option<Hash>,
}

/// Why a secret was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    /// Not `DHHC-1:hh:<base64>:`.
    #[error("a DH-HMAC-CHAP secret looks like DHHC-1:01:<base64>: (make one with `nvme gen-dhchap-key`)")]
    Format,
    /// `hh` is not 00 to 03.
    #[error("the secret's transform `{0}` is not one of 00 (none), 01 (SHA-256), 02 (SHA-384), 03 (SHA-512)")]
    Transform(String),
    /// The base64 part does not decode.
    #[error("the secret's key is not valid base64")]
    Base64,
    /// The key is not 32, 48 or 64 bytes, or not the transform's length.
    #[error("the secret's key is {0} bytes: it must be 32, 48 or 64, and as long as its transform's hash")]
    Length(usize),
    /// The CRC-32 does not match: the secret was mistyped or cut.
    #[error("the secret's checksum does not match its key: it was mistyped or cut short")]
    Checksum,
}

impl Secret {
    /// Parses `DHHC-1:hh:<base64>:` (the trailing colon may be missing).
    pub fn parse(text: &str) -> Result<Secret, SecretError> {
        let framed = framing::decode(text, PREFIX).map_err(|e| match e {
            FrameError::Format => SecretError::Format,
            FrameError::Base64 => SecretError::Base64,
            FrameError::Short => SecretError::Length(0),
        })?;
        let hh = framed.hh;
        let transform = match hh {
            "00" => None,
            _ => Some(hh.parse::<u8>().ok().and_then(Hash::from_id).ok_or_else(|| SecretError::Transform(hh.into()))?),
        };
        let secret = Secret::new(framed.key, transform)?;
        if !framed.checksum_ok {
            return Err(SecretError::Checksum);
        }
        Ok(secret)
    }

    /// A secret of `key`, to be transformed with `transform` before use.
    pub fn new(key: Vec<u8>, transform: Option<Hash>) -> Result<Secret, SecretError> {
        let fits = match transform {
            Some(h) => key.len() == h.output_len(),
            None => matches!(key.len(), 32 | 48 | 64),
        };
        if !fits {
            return Err(SecretError::Length(key.len()));
        }
        Ok(Secret { key, transform })
    }

    /// A new random secret, as `nvme gen-dhchap-key --hmac` makes: as long as its
    /// transform's hash, or 32 bytes without a transform.
    pub fn generate(transform: Option<Hash>) -> Secret {
        let mut key = vec![0u8; transform.map_or(32, Hash::output_len)];
        crate::random_bytes(&mut key);
        Secret { key, transform }
    }

    /// The `DHHC-1:hh:<base64>:` form, to hand to a host. Keep it out of logs.
    pub fn to_dhhc(&self) -> String {
        framing::encode(PREFIX, self.transform.map_or(0, Hash::id), &self.key)
    }

    /// The hash the secret is transformed with, if any.
    pub fn transform(&self) -> Option<Hash> {
        self.transform
    }

    /// The key an HMAC is keyed with for `nqn` (the host's NQN for a host secret,
    /// the subsystem's for a controller secret): HMAC(key, NQN || "NVMe-over-Fabrics")
    /// with the transform's hash, or the key itself without a transform.
    pub fn transformed(&self, nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => h.hmac(&self.key, &[nqn.as_bytes(), TRANSFORM_SUFFIX]),
        }
    }
}

/// A short, one-way name for a host secret and its controller secret: equal secrets
/// give equal fingerprints, and the fingerprint tells nothing of them. Listings show it
/// so that whoever installed secrets can tell whether they are still the ones in place.
pub fn fingerprint(host: &Secret, controller: Option<&Secret>) -> String {
    let ctrl = controller.map(Secret::to_dhhc).unwrap_or_default();
    let digest =
        Hash::Sha256.digest(&[b"nvpool DH-HMAC-CHAP fingerprint\0", host.to_dhhc().as_bytes(), b"\0", ctrl.as_bytes()]);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.key.fill(0);
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret({} bytes, transform {:?}, redacted)", self.key.len(), self.transform)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;

    /// A 32-byte key of 0x00..0x1f with the SHA-256 transform.
    const NVME_CLI_SECRET: &str = "DHHC-1:01:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh+KfiaR:";
    /// What nvme-cli 2.13 prints for that key and an NQN (`nvme gen-dhchap-key
    /// --secret=000102...1f --hmac=1 --nqn=nqn.2024-01.io.nvpool:kat`, checked in the
    /// guest by tests/kernel/auth-e2e): libnvme stores the key already transformed for
    /// the NQN, which makes it a known answer of the transform.
    const NVME_CLI_TRANSFORMED: &str = "DHHC-1:01:GC19EF3ch6/G246Ie27kuqKhuc2QkG2d3DKS/UENsCpJAD0P:";

    #[test]
    fn transform_matches_nvme_cli() {
        let s = Secret::parse(NVME_CLI_SECRET).unwrap();
        let cli = Secret::parse(NVME_CLI_TRANSFORMED).unwrap();
        assert_eq!(s.transformed("nqn.2024-01.io.nvpool:kat"), cli.key);
    }

    #[test]
    fn parses_dhhc_secrets_and_writes_them_back() {
        let s = Secret::parse(NVME_CLI_SECRET).unwrap();
        assert_eq!(s.key, (0u8..32).collect::<Vec<_>>());
        assert_eq!(s.transform(), Some(Hash::Sha256));
        assert_eq!(s.to_dhhc(), NVME_CLI_SECRET);
    }

    #[test]
    fn generated_secrets_round_trip() {
        for t in [None, Some(Hash::Sha256), Some(Hash::Sha384), Some(Hash::Sha512)] {
            let s = Secret::generate(t);
            assert_eq!(Secret::parse(&s.to_dhhc()).unwrap(), s);
        }
    }

    #[test]
    fn refuses_malformed_secrets_with_the_reason() {
        let good = NVME_CLI_SECRET;
        assert_eq!(Secret::parse("DHHC-2:01:abc:"), Err(SecretError::Format));
        assert_eq!(Secret::parse(&good.replace(":01:", ":07:")), Err(SecretError::Transform("07".into())));
        assert_eq!(Secret::parse(&good.replace(":01:", ":03:")), Err(SecretError::Length(32)));
        assert_eq!(Secret::parse(&good.replace("AAEC", "AAED")), Err(SecretError::Checksum));
        assert_eq!(Secret::parse("DHHC-1:00:!!!!:"), Err(SecretError::Base64));
        let short = format!("DHHC-1:00:{}:", STANDARD.encode([1u8; 20]));
        assert_eq!(Secret::parse(&short), Err(SecretError::Length(16)));
    }

    #[test]
    fn fingerprints_tell_secrets_apart() {
        let (a, b) = (Secret::generate(None), Secret::generate(None));
        assert_eq!(fingerprint(&a, None), fingerprint(&a.clone(), None));
        assert_ne!(fingerprint(&a, None), fingerprint(&b, None));
        assert_ne!(fingerprint(&a, None), fingerprint(&a, Some(&b)));
        assert_eq!(fingerprint(&a, None).len(), 16);
    }

    #[test]
    fn debug_output_shows_no_key() {
        let s = Secret::parse(NVME_CLI_SECRET).unwrap();
        let shown = format!("{s:?}");
        assert!(!shown.contains("AAEC") && shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn transform_is_the_hmac_of_the_nqn_and_the_suffix() {
        let s = Secret::parse(NVME_CLI_SECRET).unwrap();
        let nqn = "nqn.2014-08.org.nvmexpress:uuid:host";
        let mut message = nqn.as_bytes().to_vec();
        message.extend_from_slice(b"NVMe-over-Fabrics");
        assert_eq!(s.transformed(nqn), Hash::Sha256.hmac(&s.key, &[&message]));
        let plain = Secret::new(s.key.clone(), None).unwrap();
        assert_eq!(plain.transformed(nqn), s.key);
    }
}

//! Pre-shared keys for NVMe/TCP over TLS 1.3 (the NVMe/TCP transport's secure channel):
//! the configured PSK in the interchange format `nvme gen-tls-key` prints, the PSK
//! identities the Linux host offers, and the derivation from a configured PSK to the
//! key TLS runs with.
//!
//! The chain, as the Linux host's tools compute it:
//! 1. retained PSK = HKDF-Expand-Label(HKDF-Extract(0, configured), "HostNQN", host NQN),
//!    or the configured PSK itself when its transform is `00`;
//! 2. for identity version 1, a digest = base64(HMAC(retained, "host subsys NVMe-over-Fabrics"));
//! 3. TLS PSK = HKDF-Expand-Label(HKDF-Extract(0, retained), "nvme-tls-psk", context),
//!    where the context is the identity (version 0) or "hh digest" (version 1).
//!
//! The hash of steps 2 and 3 is the cipher suite's, given by the key's length (32
//! bytes: SHA-256 and TLS_AES_128_GCM_SHA256; 48: SHA-384 and TLS_AES_256_GCM_SHA384);
//! the hash of step 1 is the configured key's transform.
//!
//! Hosts lay out the HKDF labels of steps 1 and 3 in one of two ways ([`Kdf`]): as RFC
//! 8446 says (SPDK, newer libnvme), or as libnvme did up to mid-2025 (what Debian 13's
//! nvme-cli 2.13 inserts into the kernel's keyring). The two give different keys.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

use crate::Hash;
use crate::framing::{self, FrameError};

/// What every configured PSK in the interchange format starts with.
const PREFIX: &str = "NVMeTLSkey-1:";

/// How the HKDF labels of the PSK derivation are laid out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Kdf {
    /// The layout libnvme used up to mid-2025 (nvme-cli 2.13 in Debian 13, and older):
    /// the length in little-endian order, the label and context without their length
    /// bytes.
    #[default]
    Compat,
    /// HKDF-Expand-Label exactly as RFC 8446 defines it (SPDK, libnvme since mid-2025).
    Rfc8446,
}

impl Kdf {
    /// Both layouts, in the order to try them.
    pub const ALL: [Kdf; 2] = [Kdf::Compat, Kdf::Rfc8446];

    /// The name users write: `compat` or `rfc8446`.
    pub fn name(self) -> &'static str {
        match self {
            Kdf::Compat => "compat",
            Kdf::Rfc8446 => "rfc8446",
        }
    }

    /// Parses a name.
    pub fn parse(name: &str) -> Option<Kdf> {
        Kdf::ALL.into_iter().find(|k| k.name() == name)
    }

    fn other(self) -> Kdf {
        match self {
            Kdf::Compat => Kdf::Rfc8446,
            Kdf::Rfc8446 => Kdf::Compat,
        }
    }

    fn expand_label(self, hash: Hash, prk: &[u8], label: &[u8], context: &[u8], length: usize) -> Vec<u8> {
        match self {
            Kdf::Rfc8446 => expand_label(hash, prk, label, context, length),
            Kdf::Compat => {
                let info = [&(length as u16).to_le_bytes()[..], b"tls13 ", label, context].concat();
                expand(hash, prk, &info, length)
            }
        }
    }
}

/// A configured PSK. Its bytes are never printed: `Debug` shows only its shape.
#[derive(Clone, PartialEq, Eq)]
pub struct ConfiguredPsk {
    key: Vec<u8>,
    transform: Option<Hash>,
}

/// Why a PSK was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PskError {
    /// Not `NVMeTLSkey-1:hh:<base64>:`.
    #[error("a TLS PSK looks like NVMeTLSkey-1:01:<base64>: (make one with `nvme gen-tls-key`)")]
    Format,
    /// `hh` is not 00 to 02.
    #[error("the PSK's transform `{0}` is not one of 00 (none), 01 (SHA-256), 02 (SHA-384)")]
    Transform(String),
    /// The base64 part does not decode.
    #[error("the PSK's key is not valid base64")]
    Base64,
    /// The key is not 32 or 48 bytes.
    #[error("the PSK's key is {0} bytes: it must be 32 (SHA-256) or 48 (SHA-384), and as long as its transform's hash")]
    Length(usize),
    /// The CRC-32 does not match.
    #[error("the PSK's checksum does not match its key: it was mistyped or cut short")]
    Checksum,
}

/// A PSK identity a host offers in its ClientHello: `NVMe<v>R<hh> <hostnqn> <subnqn>`,
/// with ` <digest>` after it in version 1. `G` (generated) identities come from
/// authentication's secure concatenation and are not taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// 0 (TP 8011) or 1 (TP 8018, with the digest).
    pub version: u8,
    /// The cipher suite's hash: SHA-256 or SHA-384.
    pub hash: Hash,
    /// The host's NQN.
    pub host_nqn: String,
    /// The subsystem's NQN.
    pub subsystem_nqn: String,
    /// Version 1's digest of the retained PSK and both NQNs, in base64.
    pub digest: Option<String>,
}

impl Identity {
    /// Parses an identity; `None` for anything else, including generated PSKs.
    pub fn parse(text: &str) -> Option<Identity> {
        let mut words = text.split(' ');
        let head = words.next()?;
        let rest = head.strip_prefix("NVMe")?.as_bytes();
        if rest.len() != 4 || rest[1] != b'R' {
            return None;
        }
        let version = match rest[0] {
            b'0' => 0,
            b'1' => 1,
            _ => return None,
        };
        let hash = match &rest[2..] {
            b"01" => Hash::Sha256,
            b"02" => Hash::Sha384,
            _ => return None,
        };
        let host_nqn = words.next().filter(|w| !w.is_empty())?.to_string();
        let subsystem_nqn = words.next().filter(|w| !w.is_empty())?.to_string();
        let digest = if version == 1 { Some(words.next().filter(|w| !w.is_empty())?.to_string()) } else { None };
        if words.next().is_some() {
            return None;
        }
        Some(Identity { version, hash, host_nqn, subsystem_nqn, digest })
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NVMe{}R{:02} {} {}", self.version, self.hash.id(), self.host_nqn, self.subsystem_nqn)?;
        if let Some(d) = &self.digest {
            write!(f, " {d}")?;
        }
        Ok(())
    }
}

impl ConfiguredPsk {
    /// Parses `NVMeTLSkey-1:hh:<base64>:` (the trailing colon may be missing).
    pub fn parse(text: &str) -> Result<ConfiguredPsk, PskError> {
        let framed = framing::decode(text, PREFIX).map_err(|e| match e {
            FrameError::Format => PskError::Format,
            FrameError::Base64 => PskError::Base64,
            FrameError::Short => PskError::Length(0),
        })?;
        let transform = match framed.hh {
            "00" => None,
            "01" => Some(Hash::Sha256),
            "02" => Some(Hash::Sha384),
            hh => return Err(PskError::Transform(hh.into())),
        };
        let psk = ConfiguredPsk::new(framed.key, transform)?;
        if !framed.checksum_ok {
            return Err(PskError::Checksum);
        }
        Ok(psk)
    }

    /// A PSK of `key` (32 or 48 bytes), transformed with `transform` into the
    /// retained PSK.
    pub fn new(key: Vec<u8>, transform: Option<Hash>) -> Result<ConfiguredPsk, PskError> {
        let fits = match transform {
            Some(h) => key.len() == h.output_len(),
            None => matches!(key.len(), 32 | 48),
        };
        if !fits {
            return Err(PskError::Length(key.len()));
        }
        Ok(ConfiguredPsk { key, transform })
    }

    /// A new random PSK for `hash`'s cipher suite, transformed with that hash, as
    /// `nvme gen-tls-key` makes by default.
    pub fn generate(hash: Hash) -> ConfiguredPsk {
        let mut key = vec![0u8; hash.output_len()];
        crate::random_bytes(&mut key);
        ConfiguredPsk { key, transform: Some(hash) }
    }

    /// The interchange form, to hand to a host. Keep it out of logs.
    pub fn to_interchange(&self) -> String {
        framing::encode(PREFIX, self.transform.map_or(0, Hash::id), &self.key)
    }

    /// The hash of the cipher suite this PSK is for, by its length.
    pub fn suite_hash(&self) -> Hash {
        if self.key.len() == 48 { Hash::Sha384 } else { Hash::Sha256 }
    }

    /// The retained PSK for `host_nqn`.
    pub fn retained(&self, kdf: Kdf, host_nqn: &str) -> Vec<u8> {
        match self.transform {
            None => self.key.clone(),
            Some(h) => kdf.expand_label(h, &extract(h, &self.key), b"HostNQN", host_nqn.as_bytes(), self.key.len()),
        }
    }

    /// The identity a host offers with this PSK, in `version` 0 or 1.
    pub fn identity(&self, kdf: Kdf, version: u8, host_nqn: &str, subsystem_nqn: &str) -> Identity {
        let hash = self.suite_hash();
        let digest = (version == 1).then(|| self.digest(kdf, host_nqn, subsystem_nqn));
        Identity { version, hash, host_nqn: host_nqn.into(), subsystem_nqn: subsystem_nqn.into(), digest }
    }

    /// Version 1's digest of the retained PSK and the two NQNs.
    fn digest(&self, kdf: Kdf, host_nqn: &str, subsystem_nqn: &str) -> String {
        let retained = self.retained(kdf, host_nqn);
        let mac = self
            .suite_hash()
            .hmac(&retained, &[host_nqn.as_bytes(), b" ", subsystem_nqn.as_bytes(), b" ", b"NVMe-over-Fabrics"]);
        STANDARD.encode(mac)
    }

    /// The key TLS runs with when a host offers `identity`, or `None` when the identity
    /// cannot belong to this PSK (another cipher suite, or a digest of another key).
    /// A version 1 identity's digest tells which layout the host used, and that one is
    /// taken; a version 0 identity tells nothing, and `kdf` is taken.
    pub fn tls_psk(&self, kdf: Kdf, identity: &Identity) -> Option<Vec<u8>> {
        let hash = self.suite_hash();
        if identity.hash != hash {
            return None;
        }
        let (kdf, context) = match &identity.digest {
            None => (kdf, identity.to_string()),
            Some(d) => {
                let matching = [kdf, kdf.other()]
                    .into_iter()
                    .find(|k| *d == self.digest(*k, &identity.host_nqn, &identity.subsystem_nqn))?;
                (matching, format!("{:02} {d}", hash.id()))
            }
        };
        let retained = self.retained(kdf, &identity.host_nqn);
        Some(kdf.expand_label(hash, &extract(hash, &retained), b"nvme-tls-psk", context.as_bytes(), self.key.len()))
    }
}

impl Drop for ConfiguredPsk {
    fn drop(&mut self) {
        self.key.fill(0);
    }
}

impl std::fmt::Debug for ConfiguredPsk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConfiguredPsk({} bytes, transform {:?}, redacted)", self.key.len(), self.transform)
    }
}

/// HKDF-Extract with a zero salt (RFC 5869).
fn extract(hash: Hash, ikm: &[u8]) -> Vec<u8> {
    hash.hmac(&vec![0u8; hash.output_len()], &[ikm])
}

/// HKDF-Expand-Label (RFC 8446, section 7.1): HKDF-Expand of the label structure
/// (length, "tls13 " label, context, each length-prefixed).
pub fn expand_label(hash: Hash, prk: &[u8], label: &[u8], context: &[u8], length: usize) -> Vec<u8> {
    let full_label = [b"tls13 ", label].concat();
    let mut info = Vec::with_capacity(4 + full_label.len() + context.len());
    info.extend_from_slice(&(length as u16).to_be_bytes());
    info.push(full_label.len() as u8);
    info.extend_from_slice(&full_label);
    info.push(context.len() as u8);
    info.extend_from_slice(context);
    expand(hash, prk, &info, length)
}

/// HKDF-Expand (RFC 5869).
fn expand(hash: Hash, prk: &[u8], info: &[u8], length: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(length);
    let mut block: Vec<u8> = Vec::new();
    let mut counter = 1u8;
    while out.len() < length {
        block = hash.hmac(prk, &[&block, info, &[counter]]);
        out.extend_from_slice(&block);
        counter += 1;
    }
    out.truncate(length);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configured key of libnvme's PSK tests.
    const KEY: [u8; 32] = [
        0x55, 0x12, 0xDB, 0xB6, 0x73, 0x7D, 0x01, 0x06, 0xF6, 0x59, 0x75, 0xB7, 0x73, 0xDF, 0xB0, 0x11, 0xFF, 0xC3,
        0x44, 0xBC, 0xF4, 0x42, 0xE2, 0xDD, 0x6D, 0x8B, 0xC4, 0x87, 0x0B, 0x5D, 0x5B, 0x03,
    ];
    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";
    const SUBSYS: &str = "nqn.2024-01.io.nvpool:kat";

    fn key48() -> Vec<u8> {
        [&KEY[..], &KEY[16..32]].concat()
    }

    #[test]
    fn interchange_format_matches_libnvme() {
        // libnvme's export/import known answers.
        let sha256 = ConfiguredPsk::new(KEY.to_vec(), Some(Hash::Sha256)).unwrap();
        assert_eq!(sha256.to_interchange(), "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:");
        let none = ConfiguredPsk::new(KEY.to_vec(), None).unwrap();
        assert_eq!(none.to_interchange(), "NVMeTLSkey-1:00:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:");
        let sha384 = ConfiguredPsk::new(key48(), Some(Hash::Sha384)).unwrap();
        let text = "NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi3W2LxIcLXVsDn8kXZQ==:";
        assert_eq!(sha384.to_interchange(), text);
        assert_eq!(ConfiguredPsk::parse(text).unwrap(), sha384);
        assert_eq!(sha384.suite_hash(), Hash::Sha384);
    }

    #[test]
    fn identities_match_nvme_cli() {
        // What `nvme check-tls-key --identity=N` (nvme-cli 2.13, libnvme 1.13) printed
        // for these keys and NQNs in the test guest.
        let sha256 = ConfiguredPsk::new(KEY.to_vec(), Some(Hash::Sha256)).unwrap();
        assert_eq!(sha256.identity(Kdf::Compat, 0, HOST, SUBSYS).to_string(), format!("NVMe0R01 {HOST} {SUBSYS}"));
        assert_eq!(
            sha256.identity(Kdf::Compat, 1, HOST, SUBSYS).to_string(),
            format!("NVMe1R01 {HOST} {SUBSYS} Fwa7DGWrip0psemaR1bbZkFooQ2DJEL08QOAn+vN/d0=")
        );
        let none = ConfiguredPsk::new(KEY.to_vec(), None).unwrap();
        assert_eq!(
            none.identity(Kdf::Compat, 1, HOST, SUBSYS).to_string(),
            format!("NVMe1R01 {HOST} {SUBSYS} 6iZHMbssXlg+9nU3AzSw+kQxa5el4ivwPVYQ457zzDE=")
        );
        let sha384 = ConfiguredPsk::new(key48(), Some(Hash::Sha384)).unwrap();
        assert_eq!(
            sha384.identity(Kdf::Compat, 1, HOST, SUBSYS).to_string(),
            format!("NVMe1R02 {HOST} {SUBSYS} WP1rGaop+ElLLibpzbNq9Q9rKCj+jcDGWEDiV93AKy1P/VtCfVBiCY+17BttvBDK")
        );
    }

    #[test]
    fn identities_parse_and_print_alike() {
        for text in [
            format!("NVMe0R01 {HOST} {SUBSYS}"),
            format!("NVMe0R02 {HOST} {SUBSYS}"),
            format!("NVMe1R01 {HOST} {SUBSYS} Fwa7DGWrip0psemaR1bbZkFooQ2DJEL08QOAn+vN/d0="),
        ] {
            assert_eq!(Identity::parse(&text).unwrap().to_string(), text);
        }
        for bad in [
            format!("NVMe0G01 {HOST} {SUBSYS}"),
            format!("NVMe0R03 {HOST} {SUBSYS}"),
            format!("NVMe2R01 {HOST} {SUBSYS}"),
            format!("NVMe1R01 {HOST} {SUBSYS}"),
            format!("NVMe0R01 {HOST}"),
            format!("NVMe0R01 {HOST} {SUBSYS} extra"),
            "psk".to_string(),
        ] {
            assert_eq!(Identity::parse(&bad), None, "{bad}");
        }
    }

    #[test]
    fn the_tls_psk_depends_on_the_identity_and_refuses_a_foreign_one() {
        let psk = ConfiguredPsk::new(KEY.to_vec(), Some(Hash::Sha256)).unwrap();
        let v0 = psk.identity(Kdf::Compat, 0, HOST, SUBSYS);
        let v1 = psk.identity(Kdf::Compat, 1, HOST, SUBSYS);
        let a = psk.tls_psk(Kdf::Compat, &v0).unwrap();
        let b = psk.tls_psk(Kdf::Compat, &v1).unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert_ne!(psk.tls_psk(Kdf::Rfc8446, &v0).unwrap(), a);
        // A version 1 digest says which layout the host used, whatever was configured.
        assert_eq!(psk.tls_psk(Kdf::Rfc8446, &v1).unwrap(), b);
        let v1_rfc = psk.identity(Kdf::Rfc8446, 1, HOST, SUBSYS);
        assert_ne!(v1_rfc, v1);
        assert_ne!(psk.tls_psk(Kdf::Compat, &v1_rfc).unwrap(), b);
        let other_host = psk.identity(Kdf::Compat, 0, "nqn.2014-08.org.nvmexpress:uuid:other", SUBSYS);
        assert_ne!(psk.tls_psk(Kdf::Compat, &other_host).unwrap(), a);
        // A SHA-384 identity cannot use a 32-byte key; a digest of another key is refused.
        let mut wrong_suite = v0.clone();
        wrong_suite.hash = Hash::Sha384;
        assert_eq!(psk.tls_psk(Kdf::Compat, &wrong_suite), None);
        let other = ConfiguredPsk::generate(Hash::Sha256);
        assert_eq!(psk.tls_psk(Kdf::Compat, &other.identity(Kdf::Compat, 1, HOST, SUBSYS)), None);
    }

    #[test]
    fn expand_label_matches_rfc_8448() {
        // RFC 8448 (simple 1-RTT): the server's handshake traffic key and IV from its
        // handshake traffic secret.
        let secret = hex("b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38");
        assert_eq!(expand_label(Hash::Sha256, &secret, b"key", b"", 16), hex("3fce516009c21727d0f2e4e86ee403bc"));
        assert_eq!(expand_label(Hash::Sha256, &secret, b"iv", b"", 12), hex("5d313eb2671276ee13000b30"));
    }

    #[test]
    fn malformed_keys_are_refused_with_the_reason() {
        assert_eq!(ConfiguredPsk::parse("DHHC-1:01:abc:"), Err(PskError::Format));
        assert_eq!(
            ConfiguredPsk::parse("NVMeTLSkey-1:03:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
            Err(PskError::Transform("03".into()))
        );
        assert_eq!(
            ConfiguredPsk::parse("NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrA:"),
            Err(PskError::Checksum)
        );
        assert_eq!(ConfiguredPsk::parse("NVMeTLSkey-1:01:!!!!:"), Err(PskError::Base64));
        assert!(matches!(
            ConfiguredPsk::parse("NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:"),
            Err(PskError::Length(32))
        ));
        let generated = ConfiguredPsk::generate(Hash::Sha384);
        assert_eq!(ConfiguredPsk::parse(&generated.to_interchange()).unwrap(), generated);
        assert!(!format!("{generated:?}").contains(&generated.to_interchange()[16..24]));
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }
}

//! NVMe/TCP over TLS 1.3 with pre-shared keys (the NVMe/TCP transport's secure
//! channel), as the Linux host speaks it through `tlshd`: the hosts' keys, who a
//! session proved the host to be, the handshake with OpenSSL ([`handshake`]) and the
//! session's keys in the kernel ([`ktls`]). Listeners admit connections with them
//! (`crate::listen`); then the kernel encrypts and decrypts, and the reactor's I/O path
//! is the same with TLS or without.

pub mod handshake;
pub mod ktls;

pub use nvpool_api::TlsMode;
use nvpool_api::TlsPsk;
use nvpool_auth::{ConfiguredPsk, Identity, Kdf};

/// Who a TLS connection proved to be: the NQNs of the PSK identity it used. Its
/// Connect must name the same host and subsystem.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TlsPeer {
    /// The host NQN of the identity.
    pub host_nqn: String,
    /// The subsystem NQN of the identity.
    pub subsystem_nqn: String,
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

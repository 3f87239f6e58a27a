//! The text framing DH-HMAC-CHAP secrets and TLS PSKs share: `PREFIX:hh:<base64>:`,
//! where `hh` names the key's transform and the base64 holds the key followed by its
//! CRC-32, least significant byte first.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;

/// Why a framed key did not read.
pub(crate) enum FrameError {
    /// Not `PREFIX:hh:<base64>:`.
    Format,
    /// The base64 part does not decode.
    Base64,
    /// Too short to hold a CRC-32.
    Short,
}

/// A framed key, read: its transform field and key, and whether its CRC-32 matched.
pub(crate) struct Framed<'a> {
    pub hh: &'a str,
    pub key: Vec<u8>,
    pub checksum_ok: bool,
}

/// Reads `PREFIX:hh:<base64>:` (the trailing colon may be missing).
pub(crate) fn decode<'a>(text: &'a str, prefix: &str) -> Result<Framed<'a>, FrameError> {
    let rest = text.trim().strip_prefix(prefix).ok_or(FrameError::Format)?;
    let (hh, body) = rest.split_once(':').ok_or(FrameError::Format)?;
    let body = body.strip_suffix(':').unwrap_or(body);
    if body.contains(':') || hh.len() != 2 {
        return Err(FrameError::Format);
    }
    let mut decoded = STANDARD.decode(body).map_err(|_| FrameError::Base64)?;
    if decoded.len() < 4 {
        return Err(FrameError::Short);
    }
    let crc_at = decoded.len() - 4;
    let crc = u32::from_le_bytes(decoded[crc_at..].try_into().expect("four bytes"));
    let key = decoded[..crc_at].to_vec();
    decoded.fill(0);
    let checksum_ok = crc32fast::hash(&key) == crc;
    Ok(Framed { hh, key, checksum_ok })
}

/// `PREFIX:hh:<base64(key ‖ crc32)>:`.
pub(crate) fn encode(prefix: &str, hh: u8, key: &[u8]) -> String {
    let mut body = key.to_vec();
    body.extend_from_slice(&crc32fast::hash(key).to_le_bytes());
    let text = format!("{prefix}{hh:02}:{}:", STANDARD.encode(&body));
    body.fill(0);
    text
}

//! The values the two sides of a DH-HMAC-CHAP transaction compute (NVMe Base 2.x,
//! "DH-HMAC-CHAP protocol"), in the byte order the Linux host and target use.

use crate::Hash;

/// The challenge an HMAC response is computed over: the challenge itself without a
/// Diffie-Hellman exchange, or with one, HMAC(H(shared secret), challenge) (the
/// "augmented challenge").
pub fn effective_challenge(hash: Hash, challenge: &[u8], shared_secret: Option<&[u8]>) -> Vec<u8> {
    match shared_secret {
        None => challenge.to_vec(),
        Some(s) => hash.hmac(&hash.digest(&[s]), &[challenge]),
    }
}

/// What one side proves it knows in a transaction.
pub struct Proof<'a> {
    /// The hash the transaction negotiated.
    pub hash: Hash,
    /// The transformed secret (`Secret::transformed`).
    pub key: &'a [u8],
    /// The effective challenge (`effective_challenge`).
    pub challenge: &'a [u8],
    /// The sequence number sent with the challenge.
    pub seqnum: u32,
    /// The transaction identifier.
    pub transaction: u16,
}

/// The host's response to the controller's challenge (R1):
/// HMAC(Kh, C1 || S1 || T_ID || SC_C || "HostHost" || hostnqn || 0 || subnqn).
pub fn host_response(p: &Proof<'_>, secure_channel: u8, hostnqn: &str, subnqn: &str) -> Vec<u8> {
    p.hash.hmac(
        p.key,
        &[
            p.challenge,
            &p.seqnum.to_le_bytes(),
            &p.transaction.to_le_bytes(),
            &[secure_channel],
            b"HostHost",
            hostnqn.as_bytes(),
            &[0],
            subnqn.as_bytes(),
        ],
    )
}

/// The controller's response to the host's challenge (R2), with the NQNs the other
/// way round: HMAC(Kc, C2 || S2 || T_ID || 0 || "Controller" || subnqn || 0 || hostnqn).
pub fn controller_response(p: &Proof<'_>, hostnqn: &str, subnqn: &str) -> Vec<u8> {
    p.hash.hmac(
        p.key,
        &[
            p.challenge,
            &p.seqnum.to_le_bytes(),
            &p.transaction.to_le_bytes(),
            &[0],
            b"Controller",
            subnqn.as_bytes(),
            &[0],
            hostnqn.as_bytes(),
        ],
    )
}

/// Compares two responses in time that does not depend on where they differ.
pub fn responses_match(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DhGroup, KeyPair, Secret};

    const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:host";
    const SUB: &str = "nqn.2024-01.io.nvpool:test";

    #[test]
    fn host_and_controller_agree_through_a_dh_exchange() {
        let secret = Secret::generate(Some(Hash::Sha384));
        let host_dh = KeyPair::generate(DhGroup::Ffdhe2048);
        let ctrl_dh = KeyPair::generate(DhGroup::Ffdhe2048);
        let challenge = [7u8; 48];
        let on_host = host_dh.shared_secret(ctrl_dh.public()).unwrap();
        let on_ctrl = ctrl_dh.shared_secret(host_dh.public()).unwrap();
        let ca_host = effective_challenge(Hash::Sha384, &challenge, Some(&on_host));
        let ca_ctrl = effective_challenge(Hash::Sha384, &challenge, Some(&on_ctrl));
        let key = secret.transformed(HOST);
        let proof = |c: &[u8]| {
            host_response(
                &Proof { hash: Hash::Sha384, key: &key, challenge: c, seqnum: 9, transaction: 3 },
                0,
                HOST,
                SUB,
            )
        };
        assert!(responses_match(&proof(&ca_host), &proof(&ca_ctrl)));
        assert_ne!(ca_host, challenge.to_vec());
    }

    #[test]
    fn every_field_changes_the_response() {
        let key = [1u8; 32];
        let base = Proof { hash: Hash::Sha256, key: &key, challenge: &[2u8; 32], seqnum: 1, transaction: 1 };
        let r = host_response(&base, 0, HOST, SUB);
        assert_eq!(r.len(), 32);
        assert_ne!(r, host_response(&Proof { seqnum: 2, ..base }, 0, HOST, SUB));
        assert_ne!(r, host_response(&Proof { transaction: 2, ..base }, 0, HOST, SUB));
        assert_ne!(r, host_response(&Proof { challenge: &[3u8; 32], ..base }, 0, HOST, SUB));
        assert_ne!(r, host_response(&base, 1, HOST, SUB));
        // The NQNs are bound in order: swapping them is another response, and the
        // controller's response differs from the host's over the same values.
        assert_ne!(r, host_response(&base, 0, SUB, HOST));
        assert_ne!(r, controller_response(&base, HOST, SUB));
    }

    #[test]
    fn responses_compare_by_value_and_length() {
        assert!(responses_match(&[1, 2, 3], &[1, 2, 3]));
        assert!(!responses_match(&[1, 2, 3], &[1, 2, 4]));
        assert!(!responses_match(&[1, 2, 3], &[1, 2]));
    }
}

//! The finite-field Diffie-Hellman groups of RFC 7919 (ffdhe2048 to ffdhe8192, as
//! DH-HMAC-CHAP names them 1 to 5; 0 is "no exchange"), and the exchange itself.
//!
//! Each prime is p = 2^b - 2^(b-64) + (floor(2^(b-130) e) + X) 2^64 - 1, generator 2.
//! They are computed from that definition (with RFC 7919's X per group) once, on first
//! use, instead of being carried as kilobytes of hex; the tests hold them to their
//! published form.

use std::sync::OnceLock;

use num_bigint::BigUint;

/// A Diffie-Hellman group identifier of DH-HMAC-CHAP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DhGroup {
    /// No exchange (identifier 0): the challenge is used as it is.
    Null,
    /// ffdhe2048 (1).
    Ffdhe2048,
    /// ffdhe3072 (2).
    Ffdhe3072,
    /// ffdhe4096 (3).
    Ffdhe4096,
    /// ffdhe6144 (4).
    Ffdhe6144,
    /// ffdhe8192 (5).
    Ffdhe8192,
}

/// Bits of private exponent: RFC 7919 §5.2 asks at least twice the group's security
/// strength, which for ffdhe8192 is about 400.
const PRIVATE_BITS: usize = 512;

impl DhGroup {
    /// Every group, in identifier order.
    pub const ALL: [DhGroup; 6] = [
        DhGroup::Null,
        DhGroup::Ffdhe2048,
        DhGroup::Ffdhe3072,
        DhGroup::Ffdhe4096,
        DhGroup::Ffdhe6144,
        DhGroup::Ffdhe8192,
    ];

    /// The identifier on the wire.
    pub fn id(self) -> u8 {
        DhGroup::ALL.iter().position(|g| *g == self).expect("listed") as u8
    }

    /// The group with this identifier.
    pub fn from_id(id: u8) -> Option<DhGroup> {
        DhGroup::ALL.get(usize::from(id)).copied()
    }

    /// The name users write: `null`, `ffdhe2048`, ...
    pub fn name(self) -> &'static str {
        match self {
            DhGroup::Null => "null",
            DhGroup::Ffdhe2048 => "ffdhe2048",
            DhGroup::Ffdhe3072 => "ffdhe3072",
            DhGroup::Ffdhe4096 => "ffdhe4096",
            DhGroup::Ffdhe6144 => "ffdhe6144",
            DhGroup::Ffdhe8192 => "ffdhe8192",
        }
    }

    /// Parses a name.
    pub fn parse(name: &str) -> Option<DhGroup> {
        DhGroup::ALL.into_iter().find(|g| g.name() == name)
    }

    /// The prime's size in bits (0 for `Null`).
    pub fn bits(self) -> usize {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 2048,
            DhGroup::Ffdhe3072 => 3072,
            DhGroup::Ffdhe4096 => 4096,
            DhGroup::Ffdhe6144 => 6144,
            DhGroup::Ffdhe8192 => 8192,
        }
    }

    /// Length of public values and shared secrets, in bytes (0 for `Null`).
    pub fn value_len(self) -> usize {
        self.bits() / 8
    }

    /// RFC 7919's X: the smallest addend that makes p a safe prime.
    fn addend(self) -> u64 {
        match self {
            DhGroup::Null => 0,
            DhGroup::Ffdhe2048 => 560_316,
            DhGroup::Ffdhe3072 => 2_625_351,
            DhGroup::Ffdhe4096 => 5_736_041,
            DhGroup::Ffdhe6144 => 15_705_020,
            DhGroup::Ffdhe8192 => 10_965_728,
        }
    }

    fn prime(self) -> &'static BigUint {
        static PRIMES: [OnceLock<BigUint>; 6] = [const { OnceLock::new() }; 6];
        PRIMES[usize::from(self.id())].get_or_init(|| {
            let b = self.bits();
            let one = BigUint::from(1u8);
            (&one << b) - (&one << (b - 64)) + ((e_scaled(b - 130) + BigUint::from(self.addend())) << 64) - one
        })
    }
}

impl std::fmt::Display for DhGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// floor(e * 2^bits), from the series e = sum 1/k!, with 64 guard bits.
fn e_scaled(bits: usize) -> BigUint {
    let mut term = BigUint::from(1u8) << (bits + 64);
    let mut sum = BigUint::ZERO;
    let mut k = 0u32;
    while term != BigUint::ZERO {
        sum += &term;
        k += 1;
        term /= k;
    }
    sum >> 64
}

/// One side's ephemeral key pair in a group other than `Null`.
pub struct KeyPair {
    group: DhGroup,
    private: BigUint,
    public: Vec<u8>,
}

/// The peer's public value is not one of the group (wrong length, or 0, 1 or p-1,
/// which would give a guessable secret).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the peer's Diffie-Hellman value is not a valid public value of {0}")]
pub struct BadPublicValue(pub DhGroup);

impl KeyPair {
    /// A new random key pair in `group` (not `Null`).
    pub fn generate(group: DhGroup) -> KeyPair {
        let mut bytes = [0u8; PRIVATE_BITS / 8];
        crate::random_bytes(&mut bytes);
        bytes[0] |= 0x80;
        let private = BigUint::from_bytes_be(&bytes);
        bytes.fill(0);
        KeyPair::from_private(group, private)
    }

    fn from_private(group: DhGroup, private: BigUint) -> KeyPair {
        assert!(group != DhGroup::Null, "the null group has no key pairs");
        let public = pad(&BigUint::from(2u8).modpow(&private, group.prime()), group.value_len());
        KeyPair { group, private, public }
    }

    /// The public value g^x mod p, as long as the prime.
    pub fn public(&self) -> &[u8] {
        &self.public
    }

    /// The shared secret (g^y)^x mod p from the peer's public value, as long as the
    /// prime (leading zeroes kept, as the Linux kernel's DH gives it).
    pub fn shared_secret(&self, peer_public: &[u8]) -> Result<Vec<u8>, BadPublicValue> {
        let p = self.group.prime();
        let y = BigUint::from_bytes_be(peer_public);
        let one = BigUint::from(1u8);
        if peer_public.len() != self.group.value_len() || y <= one || y >= p - &one {
            return Err(BadPublicValue(self.group));
        }
        Ok(pad(&y.modpow(&self.private, p), self.group.value_len()))
    }
}

fn pad(n: &BigUint, len: usize) -> Vec<u8> {
    let bytes = n.to_bytes_be();
    let mut out = vec![0u8; len - bytes.len()];
    out.extend_from_slice(&bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02X}")).collect()
    }

    #[test]
    fn primes_have_the_published_form() {
        // RFC 7919 Appendix A: every prime starts and ends with 64 one bits, and
        // ffdhe2048 goes on with the digits of e that the RFC prints.
        for g in &DhGroup::ALL[1..] {
            let p = hex(&g.prime().to_bytes_be());
            assert_eq!(p.len(), g.bits() / 4, "{g}");
            assert!(p.starts_with("FFFFFFFFFFFFFFFF") && p.ends_with("FFFFFFFFFFFFFFFF"), "{g}");
        }
        let p2048 = hex(&DhGroup::Ffdhe2048.prime().to_bytes_be());
        assert!(p2048.starts_with("FFFFFFFFFFFFFFFFADF85458A2BB4A9AAFDC5620273D3CF1"), "{p2048}");
        assert!(p2048.ends_with("886B423861285C97FFFFFFFFFFFFFFFF"), "{p2048}");
    }

    #[test]
    fn ffdhe2048_is_prime_to_fermat() {
        let p = DhGroup::Ffdhe2048.prime();
        let one = BigUint::from(1u8);
        assert_eq!(BigUint::from(3u8).modpow(&(p - &one), p), one);
    }

    #[test]
    fn both_sides_derive_the_same_secret() {
        for g in [DhGroup::Ffdhe2048, DhGroup::Ffdhe3072] {
            let a = KeyPair::generate(g);
            let b = KeyPair::generate(g);
            assert_eq!(a.public().len(), g.value_len());
            let s = a.shared_secret(b.public()).unwrap();
            assert_eq!(s, b.shared_secret(a.public()).unwrap());
            assert_eq!(s.len(), g.value_len());
        }
    }

    #[test]
    fn small_exponents_give_known_values() {
        // 2^10 = 1024 needs no reduction: the public value is 0x0400, left-padded.
        let k = KeyPair::from_private(DhGroup::Ffdhe2048, BigUint::from(10u8));
        assert_eq!(k.public().len(), 256);
        assert_eq!(&k.public()[254..], &[0x04, 0x00]);
        assert!(k.public()[..254].iter().all(|&b| b == 0));
    }

    #[test]
    fn degenerate_public_values_are_refused() {
        let g = DhGroup::Ffdhe2048;
        let k = KeyPair::generate(g);
        let p = g.prime();
        let one = BigUint::from(1u8);
        for bad in [BigUint::ZERO, one.clone(), p - &one, p.clone()] {
            assert_eq!(k.shared_secret(&pad(&bad, 256)), Err(BadPublicValue(g)));
        }
        assert_eq!(k.shared_secret(&[2u8; 255]), Err(BadPublicValue(g)));
    }

    #[test]
    fn identifiers_and_names() {
        for g in DhGroup::ALL {
            assert_eq!(DhGroup::from_id(g.id()), Some(g));
            assert_eq!(DhGroup::parse(g.name()), Some(g));
        }
        assert_eq!(DhGroup::from_id(6), None);
    }
}

//! In-band authentication on the wire (NVMe Base 2.x, "Authentication"): the fields of
//! the Authentication Send and Receive fabrics commands, and the DH-HMAC-CHAP messages
//! they carry. The values inside the messages are computed in `nvpool-auth`.

use crate::bytes::{get_u16, get_u32, put_u16, put_u32};
use crate::command::{Command, PSDT_SGL, SglDescriptor, admin_opcode, sgl};
use crate::fabrics::fctype;

/// Security protocol of NVMe in-band authentication (SECP).
pub const SECP_NVME_AUTH: u8 = 0xE9;
/// Both protocol-specific fields (SPSP0, SPSP1) are 1 for DH-HMAC-CHAP.
pub const SPSP_DHCHAP: u8 = 0x01;
/// Connect response DW0: Authentication Transaction Required (AUTHREQ.ATR).
pub const CONNECT_AUTH_REQUIRED: u32 = 1 << 17;
/// Connect response DW0: secure channel concatenation required (AUTHREQ.ASCR).
pub const CONNECT_SECURE_CHANNEL_REQUIRED: u32 = 1 << 18;

/// Message kinds (AUTH_TYPE).
pub mod auth_type {
    /// Messages common to every protocol: Negotiate, and the failures.
    pub const COMMON: u8 = 0x00;
    /// DH-HMAC-CHAP's own messages.
    pub const DHCHAP: u8 = 0x01;
}

/// Message identifiers (AUTH_ID).
pub mod auth_id {
    /// The host's opening offer.
    pub const NEGOTIATE: u8 = 0x00;
    /// The controller's challenge.
    pub const CHALLENGE: u8 = 0x01;
    /// The host's response (and its own challenge, bidirectionally).
    pub const REPLY: u8 = 0x02;
    /// The controller's verdict (with its response, bidirectionally).
    pub const SUCCESS1: u8 = 0x03;
    /// The host's acceptance of the controller's response.
    pub const SUCCESS2: u8 = 0x04;
    /// The host refuses the controller.
    pub const FAILURE2: u8 = 0xF0;
    /// The controller refuses the host.
    pub const FAILURE1: u8 = 0xF1;
}

/// Protocol identifier of DH-HMAC-CHAP in a Negotiate descriptor.
pub const PROTOCOL_DHCHAP: u8 = 0x01;

/// Reason code of a failure message: authentication failed.
pub const REASON_FAILED: u8 = 0x01;

/// Explanations of a failure (the reason code explanation).
pub mod failure {
    /// The response did not match.
    pub const FAILED: u8 = 0x01;
    /// No protocol the host offered can be used.
    pub const NOT_USABLE: u8 = 0x02;
    /// Secure channel concatenation was asked for and is not offered.
    pub const CONCAT_MISMATCH: u8 = 0x03;
    /// No hash the host offered can be used.
    pub const HASH_UNUSABLE: u8 = 0x04;
    /// No Diffie-Hellman group the host offered can be used.
    pub const DHGROUP_UNUSABLE: u8 = 0x05;
    /// A message was malformed.
    pub const INCORRECT_PAYLOAD: u8 = 0x06;
    /// A message came out of turn.
    pub const INCORRECT_PROTOCOL: u8 = 0x07;
}

/// Size of every message's common header.
const HEADER: usize = 16;
/// Size of a Negotiate descriptor, and where its DH group list starts.
const DESCRIPTOR: usize = 64;
const DH_IDS_AT: usize = 34;
/// Most identifiers a descriptor lists of each kind.
const MAX_IDS: usize = 30;

/// The SQE fields of Authentication Send and Receive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AuthTransfer {
    /// Send (host to controller) or Receive.
    pub send: bool,
    /// Security protocol.
    pub secp: u8,
    /// Protocol-specific field 0.
    pub spsp0: u8,
    /// Protocol-specific field 1.
    pub spsp1: u8,
    /// Transfer length (Send) or allocation length (Receive), in bytes.
    pub length: u32,
}

impl AuthTransfer {
    /// Reads the fields of an Authentication Send or Receive SQE.
    pub fn from_command(c: &Command) -> AuthTransfer {
        AuthTransfer {
            send: c.fctype() == fctype::AUTH_SEND,
            spsp0: (c.cdw[0] >> 8) as u8,
            spsp1: (c.cdw[0] >> 16) as u8,
            secp: (c.cdw[0] >> 24) as u8,
            length: c.cdw[1],
        }
    }

    /// A DH-HMAC-CHAP transfer of `length` bytes.
    pub fn dhchap(send: bool, length: u32) -> AuthTransfer {
        AuthTransfer { send, secp: SECP_NVME_AUTH, spsp0: SPSP_DHCHAP, spsp1: SPSP_DHCHAP, length }
    }

    /// Whether SECP, SPSP0 and SPSP1 name DH-HMAC-CHAP.
    pub fn is_dhchap(&self) -> bool {
        self.secp == SECP_NVME_AUTH && self.spsp0 == SPSP_DHCHAP && self.spsp1 == SPSP_DHCHAP
    }

    /// Builds the SQE; a Send's data travels in the capsule.
    pub fn to_command(&self, cid: u16) -> Command {
        let fc = if self.send { fctype::AUTH_SEND } else { fctype::AUTH_RECEIVE };
        let id = if self.send { sgl::IN_CAPSULE } else { sgl::TRANSPORT };
        Command {
            opcode: admin_opcode::FABRICS,
            flags: PSDT_SGL,
            cid,
            nsid: u32::from(fc),
            dptr: SglDescriptor { address: 0, length: self.length, id },
            cdw: [
                u32::from(self.spsp0) << 8 | u32::from(self.spsp1) << 16 | u32::from(self.secp) << 24,
                self.length,
                0,
                0,
                0,
                0,
            ],
            ..Command::default()
        }
    }
}

/// A DH-HMAC-CHAP message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// The host's offer.
    Negotiate(Negotiate),
    /// The controller's challenge.
    Challenge(Challenge),
    /// The host's response.
    Reply(Reply),
    /// The controller's verdict.
    Success1(Success1),
    /// The host accepts the controller.
    Success2 {
        /// Transaction identifier.
        transaction: u16,
    },
    /// One side refuses the other: `from_controller` for FAILURE1.
    Failure {
        /// Transaction identifier.
        transaction: u16,
        /// FAILURE1 (controller) or FAILURE2 (host).
        from_controller: bool,
        /// Reason code.
        reason: u8,
        /// Reason code explanation (`failure`).
        explanation: u8,
    },
}

/// Negotiate: what the host offers for one transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Negotiate {
    /// Transaction identifier.
    pub transaction: u16,
    /// Secure channel concatenation the host asks for (0: none).
    pub secure_channel: u8,
    /// Whether the host offered DH-HMAC-CHAP at all.
    pub dhchap: bool,
    /// Hash identifiers offered, in the host's order.
    pub hashes: Vec<u8>,
    /// Diffie-Hellman group identifiers offered.
    pub dh_groups: Vec<u8>,
}

/// Challenge: the controller's choice and its challenge to the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Challenge {
    /// Transaction identifier.
    pub transaction: u16,
    /// Chosen hash.
    pub hash: u8,
    /// Chosen Diffie-Hellman group.
    pub dh_group: u8,
    /// Sequence number S1.
    pub seqnum: u32,
    /// The challenge C1, as long as the hash.
    pub challenge: Vec<u8>,
    /// The controller's Diffie-Hellman public value (empty for the null group).
    pub dh_public: Vec<u8>,
}

/// Reply: the host's response, and bidirectionally its own challenge.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    /// Transaction identifier.
    pub transaction: u16,
    /// The response R1, as long as the hash.
    pub response: Vec<u8>,
    /// The host's challenge C2 when it wants the controller to authenticate too.
    pub challenge: Option<Vec<u8>>,
    /// Sequence number S2 (0 when there is no challenge).
    pub seqnum: u32,
    /// The host's Diffie-Hellman public value (empty for the null group).
    pub dh_public: Vec<u8>,
}

/// Success1: the host is authenticated; bidirectionally, the controller's response.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Success1 {
    /// Transaction identifier.
    pub transaction: u16,
    /// The hash length (the size of the response field).
    pub hash_len: u8,
    /// The controller's response R2, if the host sent a challenge.
    pub response: Option<Vec<u8>>,
}

/// Why a message could not be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MessageError {
    /// Shorter than its header or its fields say.
    #[error("the message is shorter than its fields say")]
    Truncated,
    /// An AUTH_TYPE and AUTH_ID pair that names no message.
    #[error("unknown message type {0:#04x}/{1:#04x}")]
    Unknown(u8, u8),
    /// A length field out of range.
    #[error("a length in the message is out of range")]
    BadLength,
}

impl Message {
    /// Reads a message from the data of an Authentication Send or Receive.
    pub fn decode(b: &[u8]) -> Result<Message, MessageError> {
        if b.len() < 8 {
            return Err(MessageError::Truncated);
        }
        let transaction = get_u16(b, 4);
        match (b[0], b[1]) {
            (auth_type::COMMON, auth_id::NEGOTIATE) => {
                let count = usize::from(b[7]);
                let end = 8 + count * DESCRIPTOR;
                if b.len() < end {
                    return Err(MessageError::Truncated);
                }
                let mut n = Negotiate { transaction, secure_channel: b[6], ..Negotiate::default() };
                for d in b[8..end].chunks_exact(DESCRIPTOR).filter(|d| d[0] == PROTOCOL_DHCHAP) {
                    let (hashes, groups) = (usize::from(d[2]), usize::from(d[3]));
                    if hashes > MAX_IDS || groups > MAX_IDS {
                        return Err(MessageError::BadLength);
                    }
                    n.dhchap = true;
                    n.hashes.extend_from_slice(&d[4..4 + hashes]);
                    n.dh_groups.extend_from_slice(&d[DH_IDS_AT..DH_IDS_AT + groups]);
                }
                Ok(Message::Negotiate(n))
            }
            (auth_type::COMMON | auth_type::DHCHAP, id @ (auth_id::FAILURE1 | auth_id::FAILURE2)) => {
                Ok(Message::Failure {
                    transaction,
                    from_controller: id == auth_id::FAILURE1,
                    reason: b[6],
                    explanation: b[7],
                })
            }
            (auth_type::DHCHAP, id) => {
                if b.len() < HEADER {
                    return Err(MessageError::Truncated);
                }
                let hl = usize::from(b[6]);
                let field =
                    |at: usize, len: usize| b.get(at..at + len).map(<[u8]>::to_vec).ok_or(MessageError::Truncated);
                match id {
                    auth_id::CHALLENGE => {
                        let dh_len = usize::from(get_u16(b, 10));
                        Ok(Message::Challenge(Challenge {
                            transaction,
                            hash: b[8],
                            dh_group: b[9],
                            seqnum: get_u32(b, 12),
                            challenge: field(HEADER, hl)?,
                            dh_public: field(HEADER + hl, dh_len)?,
                        }))
                    }
                    auth_id::REPLY => {
                        let dh_len = usize::from(get_u16(b, 10));
                        let has_challenge = b[8] != 0;
                        Ok(Message::Reply(Reply {
                            transaction,
                            response: field(HEADER, hl)?,
                            challenge: if has_challenge { Some(field(HEADER + hl, hl)?) } else { None },
                            seqnum: get_u32(b, 12),
                            dh_public: field(HEADER + 2 * hl, dh_len)?,
                        }))
                    }
                    auth_id::SUCCESS1 => Ok(Message::Success1(Success1 {
                        transaction,
                        hash_len: b[6],
                        response: if b[8] != 0 { Some(field(HEADER, hl)?) } else { None },
                    })),
                    auth_id::SUCCESS2 => Ok(Message::Success2 { transaction }),
                    _ => Err(MessageError::Unknown(b[0], id)),
                }
            }
            (t, id) => Err(MessageError::Unknown(t, id)),
        }
    }

    /// Writes the message as it goes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Negotiate(n) => {
                let mut b = header(auth_type::COMMON, auth_id::NEGOTIATE, n.transaction, 8 + DESCRIPTOR);
                b[6] = n.secure_channel;
                b[7] = 1;
                let d = &mut b[8..];
                d[0] = PROTOCOL_DHCHAP;
                let hashes = &n.hashes[..n.hashes.len().min(MAX_IDS)];
                let groups = &n.dh_groups[..n.dh_groups.len().min(MAX_IDS)];
                d[2] = hashes.len() as u8;
                d[3] = groups.len() as u8;
                d[4..4 + hashes.len()].copy_from_slice(hashes);
                d[DH_IDS_AT..DH_IDS_AT + groups.len()].copy_from_slice(groups);
                b
            }
            Message::Challenge(c) => {
                let mut b = header(auth_type::DHCHAP, auth_id::CHALLENGE, c.transaction, HEADER);
                b[6] = c.challenge.len() as u8;
                b[8] = c.hash;
                b[9] = c.dh_group;
                put_u16(&mut b, 10, c.dh_public.len() as u16);
                put_u32(&mut b, 12, c.seqnum);
                b.extend_from_slice(&c.challenge);
                b.extend_from_slice(&c.dh_public);
                b
            }
            Message::Reply(r) => {
                let hl = r.response.len();
                let mut b = header(auth_type::DHCHAP, auth_id::REPLY, r.transaction, HEADER);
                b[6] = hl as u8;
                b[8] = u8::from(r.challenge.is_some());
                put_u16(&mut b, 10, r.dh_public.len() as u16);
                put_u32(&mut b, 12, r.seqnum);
                b.extend_from_slice(&r.response);
                // The challenge field is there, zeroed, even without a challenge.
                match &r.challenge {
                    Some(c) => b.extend_from_slice(c),
                    None => b.resize(b.len() + hl, 0),
                }
                b.extend_from_slice(&r.dh_public);
                b
            }
            Message::Success1(s) => {
                let mut b = header(auth_type::DHCHAP, auth_id::SUCCESS1, s.transaction, HEADER);
                b[6] = s.hash_len;
                b[8] = u8::from(s.response.is_some());
                match &s.response {
                    Some(r) => b.extend_from_slice(r),
                    None => b.resize(HEADER + usize::from(s.hash_len), 0),
                }
                b
            }
            Message::Success2 { transaction } => header(auth_type::DHCHAP, auth_id::SUCCESS2, *transaction, HEADER),
            Message::Failure { transaction, from_controller, reason, explanation } => {
                let id = if *from_controller { auth_id::FAILURE1 } else { auth_id::FAILURE2 };
                let mut b = header(auth_type::COMMON, id, *transaction, 8);
                b[6] = *reason;
                b[7] = *explanation;
                b
            }
        }
    }
}

fn header(kind: u8, id: u8, transaction: u16, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    b[0] = kind;
    b[1] = id;
    put_u16(&mut b, 4, transaction);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn negotiate_as_the_linux_host_sends_it() {
        // Linux offers SHA-256/384/512 and the null group and ffdhe2048 to 8192 in one
        // descriptor: 8 + 64 bytes.
        let n = Negotiate {
            transaction: 5,
            secure_channel: 0,
            dhchap: true,
            hashes: vec![1, 2, 3],
            dh_groups: vec![0, 1, 2, 3, 4, 5],
        };
        let b = Message::Negotiate(n.clone()).encode();
        assert_eq!(b.len(), 72);
        assert_eq!(&b[..8], &[0, 0, 0, 0, 5, 0, 0, 1]);
        assert_eq!(&b[8..12], &[1, 0, 3, 6]);
        assert_eq!(&b[12..15], &[1, 2, 3]);
        assert_eq!(&b[42..48], &[0, 1, 2, 3, 4, 5]);
        assert_eq!(Message::decode(&b), Ok(Message::Negotiate(n)));
    }

    #[test]
    fn challenge_and_reply_layouts() {
        let c = Challenge {
            transaction: 1,
            hash: 1,
            dh_group: 1,
            seqnum: 0x0102_0304,
            challenge: vec![0xAA; 32],
            dh_public: vec![0xBB; 256],
        };
        let b = Message::Challenge(c.clone()).encode();
        assert_eq!(b.len(), 16 + 32 + 256);
        assert_eq!(&b[6..16], &[32, 0, 1, 1, 0, 1, 4, 3, 2, 1]);
        assert_eq!(Message::decode(&b), Ok(Message::Challenge(c)));

        let r = Reply { transaction: 1, response: vec![1; 48], challenge: None, seqnum: 0, dh_public: vec![] };
        let b = Message::Reply(r.clone()).encode();
        assert_eq!(b.len(), 16 + 2 * 48, "the challenge field is there even when unused");
        assert_eq!(Message::decode(&b), Ok(Message::Reply(r)));
        let bidi = Reply { challenge: Some(vec![2; 48]), seqnum: 77, dh_public: vec![3; 384], ..Reply::default() };
        let bidi = Reply { response: vec![1; 48], ..bidi };
        assert_eq!(Message::decode(&Message::Reply(bidi.clone()).encode()), Ok(Message::Reply(bidi)));
    }

    #[test]
    fn success_and_failure_layouts() {
        let s = Success1 { transaction: 9, hash_len: 64, response: Some(vec![4; 64]) };
        let b = Message::Success1(s.clone()).encode();
        assert_eq!((b.len(), b[1], b[8]), (80, auth_id::SUCCESS1, 1));
        assert_eq!(Message::decode(&b), Ok(Message::Success1(s)));
        let f = Message::Failure {
            transaction: 9,
            from_controller: true,
            reason: REASON_FAILED,
            explanation: failure::FAILED,
        };
        let b = f.encode();
        assert_eq!(b, [0, 0xF1, 0, 0, 9, 0, 1, 1]);
        assert_eq!(Message::decode(&b), Ok(f));
        assert_eq!(
            Message::decode(&Message::Success2 { transaction: 3 }.encode()),
            Ok(Message::Success2 { transaction: 3 })
        );
    }

    #[test]
    fn auth_commands_carry_the_protocol_fields() {
        let t = AuthTransfer::dhchap(true, 72);
        let c = t.to_command(4);
        assert_eq!(c.cdw[0], 0xE901_0100);
        assert_eq!(AuthTransfer::from_command(&c), t);
        assert!(t.is_dhchap());
        let r = AuthTransfer::from_command(&AuthTransfer::dhchap(false, 80).to_command(5));
        assert!(!r.send && r.length == 80);
    }

    proptest! {
        #[test]
        fn decoding_never_panics(b in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Message::decode(&b);
        }

        #[test]
        fn truncated_messages_are_errors(hl in 1usize..=64, dh in 0usize..300, cut in 1usize..64) {
            let c = Challenge { transaction: 1, hash: 1, dh_group: 1, seqnum: 1, challenge: vec![1; hl], dh_public: vec![2; dh] };
            let b = Message::Challenge(c).encode();
            let cut = cut.min(b.len() - 1);
            prop_assert!(Message::decode(&b[..b.len() - cut]).is_err());
        }
    }
}

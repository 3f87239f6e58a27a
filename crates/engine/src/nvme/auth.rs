//! DH-HMAC-CHAP on the controller side (NVMe Base 2.x, "Authentication"): a host with
//! secrets on a subsystem must authenticate every queue it connects, through
//! Authentication Send and Receive, before the queue takes any other command.
//!
//! A transaction, as the Linux host runs it:
//! 1. Send NEGOTIATE: the hashes and Diffie-Hellman groups the host offers.
//! 2. Receive CHALLENGE: the controller's choice, C1, S1 and its DH public value.
//! 3. Send REPLY: R1, the host's DH value, and (bidirectionally) C2 and S2.
//! 4. Receive SUCCESS1 (with R2 bidirectionally) or FAILURE1.
//! 5. Bidirectionally, send SUCCESS2 (or FAILURE2 if R2 was wrong).
//!
//! A message out of turn, or malformed, fails the transaction: the next Receive
//! answers FAILURE1 with the reason, as Linux nvmet does. A NEGOTIATE at any time
//! starts over (re-authentication) with the host's current secrets.

use std::sync::Arc;

use nvpool_api::{DhchapKeys, HostAuthInfo};
use nvpool_auth::chap::{self, Proof};
use nvpool_auth::{DhGroup, Hash, KeyPair, Secret};
use nvpool_wire::Status;
use nvpool_wire::auth::{AuthTransfer, Challenge, Message, REASON_FAILED, Success1, failure};
use nvpool_wire::command::Command;

use super::Controller;
use super::data_pointer::{self, Direction, Length, Source};
use crate::error::{Error, Result};

/// The DH-HMAC-CHAP secrets and choices for one host on one subsystem.
#[derive(Debug, PartialEq, Eq)]
pub struct HostKeys {
    host: Secret,
    controller: Option<Secret>,
    hash: Option<Hash>,
    dh_group: DhGroup,
}

/// The group chosen when the configuration names none and the host offers it.
const DEFAULT_DH_GROUP: DhGroup = DhGroup::Ffdhe2048;

impl HostKeys {
    /// Reads secrets and choices from the configuration or the management API.
    pub fn from_config(k: &DhchapKeys) -> Result<HostKeys> {
        let host = Secret::parse(&k.secret).map_err(|e| Error::invalid(format!("dhchap secret: {e}")))?;
        let controller = match &k.ctrl_secret {
            Some(c) => Some(Secret::parse(c).map_err(|e| Error::invalid(format!("dhchap ctrl_secret: {e}")))?),
            None => None,
        };
        if controller.as_ref().is_some_and(|c| *c == host) {
            return Err(Error::invalid(
                "the dhchap ctrl_secret equals the host secret: a controller secret must be a secret of its own \
                 (the Linux host refuses the pair too)",
            ));
        }
        let hash = match &k.hash {
            Some(h) => Some(
                Hash::parse(h)
                    .ok_or_else(|| Error::invalid(format!("dhchap hash {h:?} is not one of sha256, sha384, sha512")))?,
            ),
            None => None,
        };
        let dh_group = match &k.dh_group {
            Some(g) => DhGroup::parse(g).ok_or_else(|| {
                Error::invalid(format!(
                    "dhchap dh_group {g:?} is not one of null, ffdhe2048, ffdhe3072, ffdhe4096, ffdhe6144, ffdhe8192"
                ))
            })?,
            None => DEFAULT_DH_GROUP,
        };
        Ok(HostKeys { host, controller, hash, dh_group })
    }

    /// Back to configuration, for a hot upgrade's new process.
    pub fn to_config(&self) -> DhchapKeys {
        DhchapKeys {
            secret: self.host.to_dhhc(),
            ctrl_secret: self.controller.as_ref().map(Secret::to_dhhc),
            hash: self.hash.map(|h| h.name().to_string()),
            dh_group: Some(self.dh_group.name().to_string()),
        }
    }

    /// What listings show: no secret.
    pub fn info(&self, host: &str) -> HostAuthInfo {
        HostAuthInfo {
            host: host.to_string(),
            bidirectional: self.controller.is_some(),
            hash: self.hash.map_or("any", Hash::name).to_string(),
            dh_group: self.dh_group.name().to_string(),
        }
    }
}

/// What a message did to the queue's authentication.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The transaction goes on.
    Continues,
    /// The host proved it knows its secret (and, bidirectionally, accepted ours).
    Authenticated,
    /// The transaction failed; the reason is for the log.
    Failed(String),
}

/// One queue's authentication transaction.
pub struct Transaction {
    keys: Arc<HostKeys>,
    step: Step,
}

enum Step {
    /// Waiting for NEGOTIATE.
    Negotiate,
    /// The challenge goes out on the next Receive.
    Challenge(Box<Challenged>),
    /// Waiting for the host's REPLY to the challenge.
    Reply(Box<Challenged>),
    /// SUCCESS1 goes out on the next Receive.
    Success1 { message: Success1, bidirectional: bool },
    /// Waiting for SUCCESS2 (bidirectional).
    Success2 { transaction: u16 },
    /// FAILURE1 goes out on the next Receive.
    Failure1 { transaction: u16, explanation: u8 },
    /// Ended; only a NEGOTIATE starts another.
    Over,
}

struct Challenged {
    transaction: u16,
    hash: Hash,
    group: DhGroup,
    seqnum: u32,
    challenge: Vec<u8>,
    dh: Option<KeyPair>,
}

/// Names of the hosts' offers that can be used, for messages.
fn usable<T: Copy>(offered: &[u8], from_id: fn(u8) -> Option<T>) -> Vec<T> {
    offered.iter().filter_map(|&id| from_id(id)).collect()
}

impl Transaction {
    /// A transaction with `keys`, waiting for the host's NEGOTIATE.
    pub fn new(keys: Arc<HostKeys>) -> Transaction {
        Transaction { keys, step: Step::Negotiate }
    }

    /// Takes the data of an Authentication Send. `current_keys` gives the host's
    /// secrets as they are now, for a NEGOTIATE that starts over.
    pub fn send(
        &mut self,
        data: &[u8],
        hostnqn: &str,
        subnqn: &str,
        current_keys: impl FnOnce() -> Option<Arc<HostKeys>>,
    ) -> Outcome {
        let message = match Message::decode(data) {
            Ok(m) => m,
            Err(e) => return self.fail(0, failure::INCORRECT_PAYLOAD, format!("malformed message: {e}")),
        };
        match (std::mem::replace(&mut self.step, Step::Over), message) {
            (_, Message::Negotiate(n)) => {
                match current_keys() {
                    Some(k) => self.keys = k,
                    None => {
                        return self.fail(n.transaction, failure::FAILED, "the host's secrets were removed".into());
                    }
                }
                if !n.dhchap {
                    return self.fail(n.transaction, failure::NOT_USABLE, "the host offered no DH-HMAC-CHAP".into());
                }
                if n.secure_channel != 0 {
                    return self.fail(
                        n.transaction,
                        failure::CONCAT_MISMATCH,
                        "the host asked for secure channel concatenation, which is not offered".into(),
                    );
                }
                let hashes = usable(&n.hashes, Hash::from_id);
                let hash = match self.keys.hash {
                    Some(h) => hashes.contains(&h).then_some(h),
                    None => hashes.first().copied(),
                };
                let Some(hash) = hash else {
                    let why = format!("no hash the host offered ({:?}) is the configured one", n.hashes);
                    return self.fail(n.transaction, failure::HASH_UNUSABLE, why);
                };
                let groups = usable(&n.dh_groups, DhGroup::from_id);
                if !groups.contains(&self.keys.dh_group) {
                    let why = format!("the host did not offer {} (it offered {:?})", self.keys.dh_group, n.dh_groups);
                    return self.fail(n.transaction, failure::DHGROUP_UNUSABLE, why);
                }
                let group = self.keys.dh_group;
                let mut challenge = vec![0u8; hash.output_len()];
                nvpool_auth::random_bytes(&mut challenge);
                self.step = Step::Challenge(Box::new(Challenged {
                    transaction: n.transaction,
                    hash,
                    group,
                    seqnum: nvpool_auth::random_seqnum(),
                    challenge,
                    dh: (group != DhGroup::Null).then(|| KeyPair::generate(group)),
                }));
                Outcome::Continues
            }
            (Step::Reply(c), Message::Reply(r)) => self.check_reply(&c, &r, hostnqn, subnqn),
            (Step::Success2 { transaction }, Message::Success2 { transaction: t }) if t == transaction => {
                Outcome::Authenticated
            }
            (_, Message::Failure { from_controller: false, explanation, .. }) => Outcome::Failed(format!(
                "the host refused the controller (explanation {explanation:#04x}): wrong controller secret?"
            )),
            (_, other) => {
                let t = transaction_of(&other);
                self.fail(t, failure::INCORRECT_PROTOCOL, format!("message out of turn: {other:?}"))
            }
        }
    }

    /// The message for an Authentication Receive, and what handing it out did.
    pub fn receive(&mut self) -> (Vec<u8>, Outcome) {
        match std::mem::replace(&mut self.step, Step::Over) {
            Step::Challenge(c) => {
                let message = Message::Challenge(Challenge {
                    transaction: c.transaction,
                    hash: c.hash.id(),
                    dh_group: c.group.id(),
                    seqnum: c.seqnum,
                    challenge: c.challenge.clone(),
                    dh_public: c.dh.as_ref().map(|k| k.public().to_vec()).unwrap_or_default(),
                });
                self.step = Step::Reply(c);
                (message.encode(), Outcome::Continues)
            }
            Step::Success1 { message, bidirectional } => {
                let transaction = message.transaction;
                let bytes = Message::Success1(message).encode();
                if bidirectional {
                    self.step = Step::Success2 { transaction };
                    (bytes, Outcome::Continues)
                } else {
                    (bytes, Outcome::Authenticated)
                }
            }
            Step::Failure1 { transaction, explanation } => (failure1(transaction, explanation), Outcome::Continues),
            _ => (
                failure1(0, failure::INCORRECT_PROTOCOL),
                Outcome::Failed("Authentication Receive with nothing to receive".into()),
            ),
        }
    }

    fn check_reply(&mut self, c: &Challenged, r: &nvpool_wire::auth::Reply, hostnqn: &str, subnqn: &str) -> Outcome {
        let t = c.transaction;
        if r.transaction != t {
            return self.fail(t, failure::INCORRECT_PROTOCOL, format!("reply to transaction {}", r.transaction));
        }
        if r.response.len() != c.hash.output_len() {
            return self.fail(t, failure::INCORRECT_PAYLOAD, "the response has the wrong length".into());
        }
        let shared = match &c.dh {
            Some(k) => match k.shared_secret(&r.dh_public) {
                Ok(s) => Some(s),
                Err(e) => return self.fail(t, failure::INCORRECT_PAYLOAD, e.to_string()),
            },
            None if !r.dh_public.is_empty() => {
                return self.fail(t, failure::INCORRECT_PAYLOAD, "a DH value without an exchange".into());
            }
            None => None,
        };
        let key = self.keys.host.transformed(hostnqn);
        let challenge = chap::effective_challenge(c.hash, &c.challenge, shared.as_deref());
        let proof = Proof { hash: c.hash, key: &key, challenge: &challenge, seqnum: c.seqnum, transaction: t };
        if !chap::responses_match(&chap::host_response(&proof, 0, hostnqn, subnqn), &r.response) {
            return self.fail(t, failure::FAILED, "the host's response does not match its secret".into());
        }
        let response = match &r.challenge {
            None => None,
            Some(c2) => {
                let Some(ctrl) = &self.keys.controller else {
                    return self.fail(
                        t,
                        failure::FAILED,
                        "the host asked the controller to authenticate and it has no controller secret".into(),
                    );
                };
                if r.seqnum == 0 || c2.len() != c.hash.output_len() {
                    return self.fail(t, failure::INCORRECT_PAYLOAD, "a controller challenge without S2".into());
                }
                let key = ctrl.transformed(subnqn);
                let challenge = chap::effective_challenge(c.hash, c2, shared.as_deref());
                let proof = Proof { hash: c.hash, key: &key, challenge: &challenge, seqnum: r.seqnum, transaction: t };
                Some(chap::controller_response(&proof, hostnqn, subnqn))
            }
        };
        let bidirectional = response.is_some();
        self.step = Step::Success1 {
            message: Success1 { transaction: t, hash_len: c.hash.output_len() as u8, response },
            bidirectional,
        };
        Outcome::Continues
    }

    fn fail(&mut self, transaction: u16, explanation: u8, why: String) -> Outcome {
        self.step = Step::Failure1 { transaction, explanation };
        Outcome::Failed(why)
    }
}

fn failure1(transaction: u16, explanation: u8) -> Vec<u8> {
    Message::Failure { transaction, from_controller: true, reason: REASON_FAILED, explanation }.encode()
}

fn transaction_of(m: &Message) -> u16 {
    match m {
        Message::Negotiate(n) => n.transaction,
        Message::Challenge(c) => c.transaction,
        Message::Reply(r) => r.transaction,
        Message::Success1(s) => s.transaction,
        Message::Success2 { transaction } | Message::Failure { transaction, .. } => *transaction,
    }
}

/// The answer to an Authentication Send or Receive.
pub struct Answer {
    /// The command's status.
    pub status: Status,
    /// Data for the host (a Receive's message, padded to its allocation length).
    pub data: Option<Vec<u8>>,
    /// What the command did to the queue's authentication.
    pub outcome: Outcome,
}

impl Answer {
    fn status(status: Status) -> Answer {
        Answer { status, data: None, outcome: Outcome::Continues }
    }
}

/// The largest Authentication Receive taken: the longest message, a challenge with an
/// ffdhe8192 value, is 1104 bytes (the Linux host asks for 4096).
const MAX_RECEIVE: u32 = 16 * 1024;

/// Runs an Authentication Send or Receive on a queue of `controller`, whose
/// transaction is `tx` (started here on the first message).
pub fn handle(tx: &mut Option<Box<Transaction>>, controller: &Controller, cmd: &Command, data: &[u8]) -> Answer {
    let t = AuthTransfer::from_command(cmd);
    if !t.is_dhchap() || t.length == 0 {
        return Answer::status(Status::INVALID_FIELD.with_dnr());
    }
    let (hostnqn, subsystem) = (controller.hostnqn.as_str(), &controller.subsystem);
    if tx.is_none() {
        match subsystem.host_keys(hostnqn) {
            Some(k) => *tx = Some(Box::new(Transaction::new(k))),
            // Nothing to authenticate with: this queue needs no authentication.
            None => return Answer::status(Status::COMMAND_SEQUENCE_ERROR.with_dnr()),
        }
    }
    let tx = tx.as_mut().expect("set above");
    let length = u64::from(t.length);
    if t.send {
        let offset = match data_pointer::check(&cmd.dptr, Direction::FromHost, Length::Exactly(length), data.len()) {
            Ok(Source::InCapsule { offset }) => offset,
            // The messages are small: hosts send them in the capsule.
            Ok(Source::Transport) => return Answer::status(Status::SGL_TYPE_INVALID.with_dnr()),
            Err(status) => return Answer::status(status),
        };
        let message = &data[offset..offset + t.length as usize];
        let outcome = tx.send(message, hostnqn, &subsystem.nqn, || subsystem.host_keys(hostnqn));
        return Answer { status: Status::SUCCESS, data: None, outcome };
    }
    if t.length > MAX_RECEIVE {
        return Answer::status(Status::INVALID_FIELD.with_dnr());
    }
    if let Err(status) = data_pointer::check(&cmd.dptr, Direction::ToHost, Length::Exactly(length), 0) {
        return Answer::status(status);
    }
    let (mut message, outcome) = tx.receive();
    if message.len() > t.length as usize {
        tx.step = Step::Over;
        return Answer {
            status: Status::INVALID_FIELD.with_dnr(),
            data: None,
            outcome: Outcome::Failed(format!("a Receive of {} bytes for a {}-byte message", t.length, message.len())),
        };
    }
    message.resize(t.length as usize, 0);
    Answer { status: Status::SUCCESS, data: Some(message), outcome }
}

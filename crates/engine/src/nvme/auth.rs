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
            fingerprint: nvpool_auth::secret::fingerprint(&self.host, self.controller.as_ref()),
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

/// One queue's authentication transaction, waiting at first for the host's NEGOTIATE.
#[derive(Default)]
pub struct Transaction {
    step: Step,
}

#[derive(Default)]
enum Step {
    /// Waiting for NEGOTIATE.
    #[default]
    Negotiate,
    /// A Diffie-Hellman computation for the last message runs off the reactor.
    Busy,
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
    /// The host's secrets as they were at NEGOTIATE.
    keys: Arc<HostKeys>,
    transaction: u16,
    hash: Hash,
    group: DhGroup,
    seqnum: u32,
    challenge: Vec<u8>,
    dh: Option<KeyPair>,
}

/// What an Authentication Send did: its outcome now, or a Diffie-Hellman computation
/// to run off the reactor first (milliseconds for ffdhe2048, tens for ffdhe8192).
pub enum Sent {
    /// Done.
    Now(Outcome),
    /// Run the job on another thread, then hand its result to `Transaction::checked`.
    Later(Job),
}

/// A computation of a transaction, for another thread.
pub struct Job(Box<dyn FnOnce() -> Checked + Send>);

impl Job {
    /// Runs it.
    pub fn run(self) -> Checked {
        (self.0)()
    }
}

/// The result of a `Job`.
pub struct Checked {
    step: Step,
    outcome: Outcome,
}

fn failed(transaction: u16, explanation: u8, why: impl Into<String>) -> (Step, Outcome) {
    (Step::Failure1 { transaction, explanation }, Outcome::Failed(why.into()))
}

/// Those of the host's offers this build knows.
fn usable<T: Copy>(offered: &[u8], from_id: fn(u8) -> Option<T>) -> Vec<T> {
    offered.iter().filter_map(|&id| from_id(id)).collect()
}

impl Transaction {
    /// Takes the data of an Authentication Send. `current_keys` gives the host's
    /// secrets as they are now: a NEGOTIATE (re)starts with them.
    pub fn send(
        &mut self,
        data: &[u8],
        hostnqn: &str,
        subnqn: &str,
        current_keys: impl FnOnce() -> Option<Arc<HostKeys>>,
    ) -> Sent {
        let (step, outcome) = match Message::decode(data) {
            Ok(message) => match self.take(message, hostnqn, subnqn, current_keys) {
                Ok(now) => now,
                Err(job) => {
                    self.step = Step::Busy;
                    return Sent::Later(job);
                }
            },
            Err(e) => failed(0, failure::INCORRECT_PAYLOAD, format!("malformed message: {e}")),
        };
        self.step = step;
        Sent::Now(outcome)
    }

    /// The next step for `message`, or the job that computes it.
    fn take(
        &mut self,
        message: Message,
        hostnqn: &str,
        subnqn: &str,
        current_keys: impl FnOnce() -> Option<Arc<HostKeys>>,
    ) -> std::result::Result<(Step, Outcome), Job> {
        Ok(match (std::mem::replace(&mut self.step, Step::Over), message) {
            (_, Message::Negotiate(n)) => {
                let t = n.transaction;
                let Some(keys) = current_keys() else {
                    return Ok(failed(t, failure::FAILED, "the host's secrets were removed"));
                };
                if !n.dhchap {
                    return Ok(failed(t, failure::NOT_USABLE, "the host offered no DH-HMAC-CHAP"));
                }
                if n.secure_channel != 0 {
                    let why = "the host asked for secure channel concatenation, which is not offered";
                    return Ok(failed(t, failure::CONCAT_MISMATCH, why));
                }
                let hashes = usable(&n.hashes, Hash::from_id);
                let hash = match keys.hash {
                    Some(h) => hashes.contains(&h).then_some(h),
                    None => hashes.first().copied(),
                };
                let Some(hash) = hash else {
                    let why = format!("no hash the host offered ({:?}) is the configured one", n.hashes);
                    return Ok(failed(t, failure::HASH_UNUSABLE, why));
                };
                let group = keys.dh_group;
                if !usable(&n.dh_groups, DhGroup::from_id).contains(&group) {
                    let why = format!("the host did not offer {group} (it offered {:?})", n.dh_groups);
                    return Ok(failed(t, failure::DHGROUP_UNUSABLE, why));
                }
                let mut challenge = vec![0u8; hash.output_len()];
                nvpool_auth::random_bytes(&mut challenge);
                let c = Challenged {
                    keys,
                    transaction: t,
                    hash,
                    group,
                    seqnum: nvpool_auth::random_seqnum(),
                    challenge,
                    dh: None,
                };
                if group == DhGroup::Null {
                    return Ok((Step::Challenge(Box::new(c)), Outcome::Continues));
                }
                return Err(Job(Box::new(move || {
                    let c = Challenged { dh: Some(KeyPair::generate(group)), ..c };
                    Checked { step: Step::Challenge(Box::new(c)), outcome: Outcome::Continues }
                })));
            }
            (Step::Reply(c), Message::Reply(r)) => {
                if c.dh.is_none() {
                    return Ok(check_reply(&c, &r, hostnqn, subnqn));
                }
                let (hostnqn, subnqn) = (hostnqn.to_string(), subnqn.to_string());
                return Err(Job(Box::new(move || {
                    let (step, outcome) = check_reply(&c, &r, &hostnqn, &subnqn);
                    Checked { step, outcome }
                })));
            }
            (Step::Success2 { transaction }, Message::Success2 { transaction: t }) if t == transaction => {
                (Step::Over, Outcome::Authenticated)
            }
            (_, Message::Failure { from_controller: false, explanation, .. }) => (
                Step::Over,
                Outcome::Failed(format!(
                    "the host refused the controller (explanation {explanation:#04x}): wrong controller secret?"
                )),
            ),
            (_, other) => {
                failed(transaction_of(&other), failure::INCORRECT_PROTOCOL, format!("message out of turn: {other:?}"))
            }
        })
    }

    /// Takes the result of a job `send` handed out (nothing else moves the
    /// transaction meanwhile: `handle` refuses messages while it is busy).
    pub fn checked(&mut self, checked: Checked) -> Outcome {
        self.step = checked.step;
        checked.outcome
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
}

/// Checks the host's response to challenge `c` and computes the controller's, if
/// the host asked for it.
fn check_reply(c: &Challenged, r: &nvpool_wire::auth::Reply, hostnqn: &str, subnqn: &str) -> (Step, Outcome) {
    let t = c.transaction;
    if r.transaction != t {
        return failed(t, failure::INCORRECT_PROTOCOL, format!("reply to transaction {}", r.transaction));
    }
    if r.response.len() != c.hash.output_len() {
        return failed(t, failure::INCORRECT_PAYLOAD, "the response has the wrong length");
    }
    let shared = match &c.dh {
        Some(k) => match k.shared_secret(&r.dh_public) {
            Ok(s) => Some(s),
            Err(e) => return failed(t, failure::INCORRECT_PAYLOAD, e.to_string()),
        },
        None if !r.dh_public.is_empty() => {
            return failed(t, failure::INCORRECT_PAYLOAD, "a DH value without an exchange");
        }
        None => None,
    };
    let key = c.keys.host.transformed(hostnqn);
    let challenge = chap::effective_challenge(c.hash, &c.challenge, shared.as_deref());
    let proof = Proof { hash: c.hash, key: &key, challenge: &challenge, seqnum: c.seqnum, transaction: t };
    if !chap::responses_match(&chap::host_response(&proof, 0, hostnqn, subnqn), &r.response) {
        return failed(t, failure::FAILED, "the host's response does not match its secret");
    }
    let response = match &r.challenge {
        None => None,
        Some(c2) => {
            let Some(ctrl) = &c.keys.controller else {
                let why = "the host asked the controller to authenticate and it has no controller secret";
                return failed(t, failure::FAILED, why);
            };
            if r.seqnum == 0 || c2.len() != c.hash.output_len() {
                return failed(t, failure::INCORRECT_PAYLOAD, "a controller challenge without S2");
            }
            let key = ctrl.transformed(subnqn);
            let challenge = chap::effective_challenge(c.hash, c2, shared.as_deref());
            let proof = Proof { hash: c.hash, key: &key, challenge: &challenge, seqnum: r.seqnum, transaction: t };
            Some(chap::controller_response(&proof, hostnqn, subnqn))
        }
    };
    let bidirectional = response.is_some();
    let message = Success1 { transaction: t, hash_len: c.hash.output_len() as u8, response };
    (Step::Success1 { message, bidirectional }, Outcome::Continues)
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

/// Runs jobs on one thread of their own, in order: authentication is rare, and one
/// thread keeps a flood of it from taking more than one core.
pub fn run_off_reactor(work: impl FnOnce() + Send + 'static) {
    type Work = Box<dyn FnOnce() + Send>;
    static WORKER: std::sync::OnceLock<std::sync::mpsc::Sender<Work>> = std::sync::OnceLock::new();
    let worker = WORKER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Work>();
        std::thread::Builder::new()
            .name("nvpool-auth".into())
            .spawn(move || rx.into_iter().for_each(|w| w()))
            .expect("a thread for authentication");
        tx
    });
    let _ = worker.send(Box::new(work));
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

/// What an Authentication Send or Receive needs: an answer now, or a job to run off
/// the reactor, whose result `checked` turns into the answer.
pub enum Handled {
    /// Answer now.
    Now(Answer),
    /// Run the job elsewhere first.
    Later(Job),
}

impl From<Answer> for Handled {
    fn from(a: Answer) -> Handled {
        Handled::Now(a)
    }
}

/// The answer to an Authentication Send whose job ran.
pub fn checked(tx: &mut Option<Box<Transaction>>, result: Checked) -> Answer {
    let outcome = match tx {
        Some(t) => t.checked(result),
        None => Outcome::Failed("the transaction ended while its computation ran".into()),
    };
    Answer { status: Status::SUCCESS, data: None, outcome }
}

/// Runs an Authentication Send or Receive on a queue of `controller`, whose
/// transaction is `tx` (started here on the first message).
pub fn handle(tx: &mut Option<Box<Transaction>>, controller: &Controller, cmd: &Command, data: &[u8]) -> Handled {
    let t = AuthTransfer::from_command(cmd);
    if !t.is_dhchap() || t.length == 0 {
        return Answer::status(Status::INVALID_FIELD.with_dnr()).into();
    }
    let (hostnqn, subsystem) = (controller.hostnqn.as_str(), &controller.subsystem);
    if tx.is_none() && subsystem.host_keys(hostnqn).is_none() {
        // Nothing to authenticate with: this queue needs no authentication.
        return Answer::status(Status::COMMAND_SEQUENCE_ERROR.with_dnr()).into();
    }
    let tx = tx.get_or_insert_with(Box::default);
    if matches!(tx.step, Step::Busy) {
        // One message at a time: the host waits for each Send before the next.
        return Answer::status(Status::COMMAND_SEQUENCE_ERROR.with_dnr()).into();
    }
    let length = u64::from(t.length);
    if t.send {
        let offset = match data_pointer::check(&cmd.dptr, Direction::FromHost, Length::Exactly(length), data.len()) {
            Ok(Source::InCapsule { offset }) => offset,
            // The messages are small: hosts send them in the capsule.
            Ok(Source::Transport) => return Answer::status(Status::SGL_TYPE_INVALID.with_dnr()).into(),
            Err(status) => return Answer::status(status).into(),
        };
        let message = &data[offset..offset + t.length as usize];
        return match tx.send(message, hostnqn, &subsystem.nqn, || subsystem.host_keys(hostnqn)) {
            Sent::Now(outcome) => Answer { status: Status::SUCCESS, data: None, outcome }.into(),
            Sent::Later(job) => Handled::Later(job),
        };
    }
    if t.length > MAX_RECEIVE {
        return Answer::status(Status::INVALID_FIELD.with_dnr()).into();
    }
    if let Err(status) = data_pointer::check(&cmd.dptr, Direction::ToHost, Length::Exactly(length), 0) {
        return Answer::status(status).into();
    }
    let (mut message, outcome) = tx.receive();
    if message.len() > t.length as usize {
        tx.step = Step::Over;
        let why = format!("a Receive of {} bytes for a {}-byte message", t.length, message.len());
        return Answer { status: Status::INVALID_FIELD.with_dnr(), data: None, outcome: Outcome::Failed(why) }.into();
    }
    message.resize(t.length as usize, 0);
    Answer { status: Status::SUCCESS, data: Some(message), outcome }.into()
}

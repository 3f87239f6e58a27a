//! The host side of DH-HMAC-CHAP, for tests: it authenticates a queue the way the
//! Linux host does, and exposes the single messages so tests can misbehave.

use nvpool_auth::chap::{self, Proof};
use nvpool_auth::{DhGroup, Hash, KeyPair, Secret};
use nvpool_wire::auth::{AuthTransfer, Message, Negotiate, REASON_FAILED, Reply, failure};

use crate::{Error, Queue};

/// A host's DH-HMAC-CHAP secrets and offers.
#[derive(Clone, Debug)]
pub struct HostAuth {
    /// The host's secret.
    pub secret: Secret,
    /// The controller's secret, to authenticate the controller too.
    pub ctrl_secret: Option<Secret>,
    /// Hash identifiers offered (the Linux host offers SHA-256, -384, -512).
    pub hashes: Vec<u8>,
    /// Diffie-Hellman group identifiers offered (Linux: null and ffdhe2048 to 8192).
    pub dh_groups: Vec<u8>,
}

impl HostAuth {
    /// The secrets with the Linux host's offers.
    pub fn new(secret: Secret, ctrl_secret: Option<Secret>) -> HostAuth {
        HostAuth {
            secret,
            ctrl_secret,
            hashes: Hash::ALL.iter().map(|h| h.id()).collect(),
            dh_groups: DhGroup::ALL.iter().map(|g| g.id()).collect(),
        }
    }
}

/// The allocation length of every Authentication Receive, as the Linux host uses.
const RECEIVE_LEN: u32 = 4096;

impl Queue {
    /// Sends one authentication message (Authentication Send, data in the capsule);
    /// returns the command's status.
    pub fn auth_send(&mut self, message: &[u8]) -> Result<nvpool_wire::Status, Error> {
        let cid = self.alloc_cid();
        let cmd = AuthTransfer::dhchap(true, message.len() as u32).to_command(cid);
        Ok(self.execute_raw(cmd, message, true)?.cqe.status)
    }

    /// Receives one authentication message (Authentication Receive).
    pub fn auth_receive(&mut self) -> Result<Message, Error> {
        let cid = self.alloc_cid();
        let r = self.execute_raw(AuthTransfer::dhchap(false, RECEIVE_LEN).to_command(cid), &[], false)?;
        if !r.cqe.status.is_success() {
            return Err(Error::Command(r.cqe.status));
        }
        Message::decode(&r.data).map_err(|e| Error::Protocol(format!("authentication message: {e}")))
    }

    /// Runs one DH-HMAC-CHAP transaction on this queue as the Linux host does.
    pub fn authenticate(&mut self, auth: &HostAuth, hostnqn: &str, subnqn: &str) -> Result<(), Error> {
        self.transaction = self.transaction.wrapping_add(1);
        let t = self.transaction;
        let negotiate = Negotiate {
            transaction: t,
            secure_channel: 0,
            dhchap: true,
            hashes: auth.hashes.clone(),
            dh_groups: auth.dh_groups.clone(),
        };
        self.send_ok(&Message::Negotiate(negotiate).encode())?;
        let c = match self.auth_receive()? {
            Message::Challenge(c) if c.transaction == t => c,
            other => return Err(refused(other)),
        };
        let hash = Hash::from_id(c.hash).ok_or_else(|| Error::Auth(format!("unknown hash {}", c.hash)))?;
        let group = DhGroup::from_id(c.dh_group).ok_or_else(|| Error::Auth(format!("unknown group {}", c.dh_group)))?;
        let (dh_public, shared) = match group {
            DhGroup::Null => (Vec::new(), None),
            g => {
                let k = KeyPair::generate(g);
                let s = k.shared_secret(&c.dh_public).map_err(|e| Error::Auth(e.to_string()))?;
                (k.public().to_vec(), Some(s))
            }
        };
        let key = auth.secret.transformed(hostnqn);
        let challenge = chap::effective_challenge(hash, &c.challenge, shared.as_deref());
        let proof = Proof { hash, key: &key, challenge: &challenge, seqnum: c.seqnum, transaction: t };
        let response = chap::host_response(&proof, 0, hostnqn, subnqn);
        let mine = auth.ctrl_secret.as_ref().map(|_| {
            let mut c2 = vec![0u8; hash.output_len()];
            nvpool_auth::random_bytes(&mut c2);
            (c2, nvpool_auth::random_seqnum())
        });
        let reply = Reply {
            transaction: t,
            response,
            challenge: mine.as_ref().map(|(c2, _)| c2.clone()),
            seqnum: mine.as_ref().map_or(0, |(_, s2)| *s2),
            dh_public,
        };
        self.send_ok(&Message::Reply(reply).encode())?;
        let s = match self.auth_receive()? {
            Message::Success1(s) if s.transaction == t => s,
            other => return Err(refused(other)),
        };
        let (Some(ctrl), Some((c2, s2))) = (&auth.ctrl_secret, mine) else {
            return Ok(());
        };
        let key = ctrl.transformed(subnqn);
        let challenge = chap::effective_challenge(hash, &c2, shared.as_deref());
        let proof = Proof { hash, key: &key, challenge: &challenge, seqnum: s2, transaction: t };
        let expected = chap::controller_response(&proof, hostnqn, subnqn);
        if !s.response.as_deref().is_some_and(|r| chap::responses_match(r, &expected)) {
            let f = Message::Failure {
                transaction: t,
                from_controller: false,
                reason: REASON_FAILED,
                explanation: failure::FAILED,
            };
            self.send_ok(&f.encode())?;
            return Err(Error::Auth("the controller's response does not match its secret".into()));
        }
        self.send_ok(&Message::Success2 { transaction: t }.encode())
    }

    fn send_ok(&mut self, message: &[u8]) -> Result<(), Error> {
        match self.auth_send(message)? {
            s if s.is_success() => Ok(()),
            s => Err(Error::Command(s)),
        }
    }
}

fn refused(m: Message) -> Error {
    match m {
        Message::Failure { explanation, .. } => Error::AuthRefused(explanation),
        other => Error::Auth(format!("unexpected message {other:?}")),
    }
}

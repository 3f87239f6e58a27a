//! Controllers of the dynamic controller model: one per host association, created by
//! a Connect on an admin queue and ended when that queue goes away, when Keep Alive
//! expires, or when management removes what it serves.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nvpool_api::AnaState;
use nvpool_wire::fabrics::{cc, csts};
use nvpool_wire::log::{async_event, lid};

use super::Subsystem;
use super::ana::{self, MAX_ANA_GROUP};
use crate::sync::lock;
use serde::{Deserialize, Serialize};

/// Async Event Configuration bit 8: namespace attribute notices.
const AEC_NS_ATTRIBUTE: u32 = 1 << 8;
/// Async Event Configuration bit 11: ANA change notices.
const AEC_ANA_CHANGE: u32 = 1 << 11;
/// Async Event Configuration bit 31: discovery log change notices.
const AEC_DISCOVERY_CHANGE: u32 = 1 << 31;

/// What an admin queue Connect establishes.
pub struct Association {
    /// The subsystem.
    pub subsystem: Arc<Subsystem>,
    /// The host's NQN.
    pub hostnqn: String,
    /// The host's identifier.
    pub hostid: [u8; 16],
    /// Keep Alive Timeout in milliseconds (0: none).
    pub kato_ms: u32,
    /// Upper bound of what Set Features Number of Queues grants.
    pub max_io_queues: u32,
    /// The transport of its admin queue.
    pub transport: super::Transport,
}

/// A controller: the state of one host's association with one subsystem.
pub struct Controller {
    /// Controller ID.
    pub cntlid: u16,
    /// The subsystem.
    pub subsystem: Arc<Subsystem>,
    /// The host's NQN.
    pub hostnqn: String,
    /// The host's identifier.
    pub hostid: [u8; 16],
    /// The transport of its admin queue: Identify says what its data pointers may be.
    pub transport: super::Transport,
    kato_ms: AtomicU32,
    keep_alive_deadline_ms: AtomicU64,
    cc: AtomicU32,
    csts: AtomicU32,
    io_queues_granted: AtomicU32,
    async_event_config: AtomicU32,
    connected_queues: Mutex<Vec<bool>>,
    events: Mutex<Events>,
    /// The ANA state of each group (by group ID) as this controller's host sees it.
    ana: Box<[AtomicU8]>,
    dead: AtomicBool,
}

#[derive(Default)]
struct Events {
    /// Completions (DW0) waiting for an outstanding Asynchronous Event Request.
    pending: VecDeque<u32>,
    /// Event types reported but not yet cleared by reading their log page; further
    /// events of a masked type are not reported (NVMe Base 2.0 §5.2).
    masked: u32,
    changed_namespaces: Vec<u32>,
}

impl Controller {
    /// A new controller for an association established at `now_ms`.
    pub fn new(cntlid: u16, a: Association, now_ms: u64) -> Controller {
        let Association { subsystem, hostnqn, hostid, kato_ms, max_io_queues, transport } = a;
        Controller {
            cntlid,
            subsystem,
            hostnqn,
            hostid,
            transport,
            kato_ms: AtomicU32::new(kato_ms),
            keep_alive_deadline_ms: AtomicU64::new(now_ms + u64::from(kato_ms)),
            cc: AtomicU32::new(0),
            csts: AtomicU32::new(0),
            io_queues_granted: AtomicU32::new(max_io_queues),
            async_event_config: AtomicU32::new(0),
            connected_queues: Mutex::new(vec![false; max_io_queues as usize + 1]),
            events: Mutex::new(Events::default()),
            ana: (0..=MAX_ANA_GROUP).map(|_| AtomicU8::new(ana::code(AnaState::Optimized))).collect(),
            dead: AtomicBool::new(false),
        }
    }

    /// What a new engine process needs to go on with this controller.
    pub fn image(&self) -> ControllerImage {
        let e = lock(&self.events);
        ControllerImage {
            cntlid: self.cntlid,
            subsystem: self.subsystem.nqn.clone(),
            hostnqn: self.hostnqn.clone(),
            hostid: self.hostid,
            kato_ms: self.kato_ms(),
            cc: self.cc(),
            csts: self.csts(),
            io_queues_granted: self.io_queues_granted(),
            queue_slots: lock(&self.connected_queues).len() as u32,
            async_event_config: self.async_event_config(),
            pending_events: e.pending.iter().copied().collect(),
            masked_events: e.masked,
            changed_namespaces: e.changed_namespaces.clone(),
            ana: self.ana.iter().map(|s| s.load(Ordering::Relaxed)).collect(),
        }
    }

    /// A controller as another engine process left it, its Keep Alive timer started
    /// at `now_ms`; its queues are claimed as their connections are adopted.
    pub fn restore(i: &ControllerImage, subsystem: Arc<Subsystem>, now_ms: u64) -> Controller {
        let ana: Box<[AtomicU8]> = (0..=MAX_ANA_GROUP as usize)
            .map(|g| AtomicU8::new(i.ana.get(g).copied().unwrap_or(ana::code(AnaState::Optimized))))
            .collect();
        Controller {
            cntlid: i.cntlid,
            subsystem,
            hostnqn: i.hostnqn.clone(),
            hostid: i.hostid,
            // Only NVMe/TCP connections are handed to a new process.
            transport: super::Transport::Tcp,
            kato_ms: AtomicU32::new(i.kato_ms),
            keep_alive_deadline_ms: AtomicU64::new(now_ms + u64::from(i.kato_ms)),
            cc: AtomicU32::new(i.cc),
            csts: AtomicU32::new(i.csts),
            io_queues_granted: AtomicU32::new(i.io_queues_granted),
            async_event_config: AtomicU32::new(i.async_event_config),
            connected_queues: Mutex::new(vec![false; i.queue_slots.max(1) as usize]),
            events: Mutex::new(Events {
                pending: i.pending_events.iter().copied().collect(),
                masked: i.masked_events,
                changed_namespaces: i.changed_namespaces.clone(),
            }),
            ana,
            dead: AtomicBool::new(false),
        }
    }

    /// Whether the association has ended; its queues must close.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Ends the association; the first reason is logged.
    pub fn fail(&self, why: &str) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            tracing::info!(
                cntlid = self.cntlid,
                subsystem = %self.subsystem.nqn,
                host = %self.hostnqn,
                "controller ended: {why}"
            );
        }
    }

    /// Keep Alive Timeout in milliseconds; 0 disables the timer.
    pub fn kato_ms(&self) -> u32 {
        self.kato_ms.load(Ordering::Relaxed)
    }

    /// Sets the Keep Alive Timeout (Set Features).
    pub fn set_kato_ms(&self, kato: u32, now_ms: u64) {
        self.kato_ms.store(kato, Ordering::Relaxed);
        self.keep_alive(now_ms);
    }

    /// Restarts the Keep Alive timer.
    pub fn keep_alive(&self, now_ms: u64) {
        let kato = u64::from(self.kato_ms());
        self.keep_alive_deadline_ms.store(now_ms + kato, Ordering::Relaxed);
    }

    /// Whether the Keep Alive timer expired at `now_ms`.
    pub fn keep_alive_expired(&self, now_ms: u64) -> bool {
        self.kato_ms() != 0 && now_ms > self.keep_alive_deadline_ms.load(Ordering::Relaxed)
    }

    /// Controller Configuration.
    pub fn cc(&self) -> u32 {
        self.cc.load(Ordering::Acquire)
    }

    /// Controller Status.
    pub fn csts(&self) -> u32 {
        self.csts.load(Ordering::Acquire)
    }

    /// Whether the host enabled the controller (CC.EN and CSTS.RDY).
    pub fn ready(&self) -> bool {
        self.csts() & csts::RDY != 0
    }

    /// Property Set CC: applies enable, disable and shutdown. Returns false if the value
    /// is invalid.
    pub fn set_cc(&self, value: u32) -> bool {
        if value & !cc::WRITABLE != 0 {
            return false;
        }
        let old = self.cc.swap(value, Ordering::AcqRel);
        let mut status = self.csts();
        if value & cc::EN != 0 && old & cc::EN == 0 {
            // Queue entry sizes must be the standard 64 and 16 bytes on I/O controllers.
            let sqes = (value >> 16) & 0xF;
            let cqes = (value >> 20) & 0xF;
            if !self.subsystem.is_discovery() && (sqes != 6 || cqes != 4) {
                self.csts.store(status | csts::CFS, Ordering::Release);
                return true;
            }
            status |= csts::RDY;
        } else if value & cc::EN == 0 && old & cc::EN != 0 {
            status &= !(csts::RDY | csts::SHST_COMPLETE);
        }
        if value & cc::SHN_MASK != 0 {
            // Nothing is cached in the engine: shutdown completes at once.
            status |= csts::SHST_COMPLETE;
        }
        self.csts.store(status, Ordering::Release);
        true
    }

    /// The number of I/O queues granted by Set Features Number of Queues.
    pub fn io_queues_granted(&self) -> u32 {
        self.io_queues_granted.load(Ordering::Relaxed)
    }

    /// Grants up to `requested` I/O queues within the configured maximum; returns the
    /// grant.
    pub fn grant_io_queues(&self, requested: u32) -> u32 {
        let max = lock(&self.connected_queues).len() as u32 - 1;
        let g = requested.clamp(1, max);
        self.io_queues_granted.store(g, Ordering::Relaxed);
        g
    }

    /// Whether any I/O queue is connected.
    pub fn has_io_queues(&self) -> bool {
        lock(&self.connected_queues).iter().skip(1).any(|&connected| connected)
    }

    /// Claims queue `qid` for a new connection; false if it is out of range or taken.
    pub fn claim_queue(&self, qid: u16) -> bool {
        let mut q = lock(&self.connected_queues);
        let granted = self.io_queues_granted() as usize;
        match q.get_mut(usize::from(qid)) {
            Some(slot) if !*slot && (qid == 0 || usize::from(qid) <= granted) => {
                *slot = true;
                true
            }
            _ => false,
        }
    }

    /// Releases queue `qid` when its connection closes.
    pub fn release_queue(&self, qid: u16) {
        if let Some(slot) = lock(&self.connected_queues).get_mut(usize::from(qid)) {
            *slot = false;
        }
    }

    /// Async Event Configuration (Set Features 0Bh).
    pub fn set_async_event_config(&self, v: u32) {
        self.async_event_config.store(v, Ordering::Relaxed);
    }

    /// Async Event Configuration.
    pub fn async_event_config(&self) -> u32 {
        self.async_event_config.load(Ordering::Relaxed)
    }

    /// Records that a namespace changed and, if enabled and not masked, queues a
    /// Namespace Attribute Changed event.
    pub fn post_namespace_change(&self, nsid: u32) {
        let mut e = lock(&self.events);
        if !e.changed_namespaces.contains(&nsid) {
            e.changed_namespaces.push(nsid);
        }
        self.post(&mut e, AEC_NS_ATTRIBUTE, async_event::NOTICE_NS_CHANGED, lid::CHANGED_NS);
    }

    /// The ANA state of `group` as this controller's host sees it: one load, for
    /// every I/O command.
    pub fn ana_state(&self, group: u32) -> AnaState {
        let code = self.ana.get(group as usize).map_or(0, |s| s.load(Ordering::Relaxed));
        ana::from_code(code).unwrap_or(AnaState::Optimized)
    }

    /// Sets the state of `group` in this controller's view; returns whether it changed.
    pub fn set_ana_state(&self, group: u32, state: AnaState) -> bool {
        self.ana.get(group as usize).is_some_and(|s| s.swap(ana::code(state), Ordering::Relaxed) != ana::code(state))
    }

    /// Queues an ANA Change event if enabled and not masked.
    pub fn post_ana_change(&self) {
        let mut e = lock(&self.events);
        self.post(&mut e, AEC_ANA_CHANGE, async_event::NOTICE_ANA_CHANGE, lid::ANA);
    }

    /// Reading the ANA log unmasks ANA change events unless `retain`.
    pub fn ana_log_read(&self, retain: bool) {
        if !retain {
            lock(&self.events).masked &= !AEC_ANA_CHANGE;
        }
    }

    /// Queues a Discovery Log Page Change event if enabled and not masked.
    pub fn post_discovery_change(&self) {
        let mut e = lock(&self.events);
        self.post(&mut e, AEC_DISCOVERY_CHANGE, async_event::NOTICE_DISCOVERY_CHANGE, lid::DISCOVERY);
    }

    fn post(&self, e: &mut Events, enable_bit: u32, info: u8, log_page: u8) {
        if self.async_event_config() & enable_bit == 0 || e.masked & enable_bit != 0 {
            return;
        }
        e.masked |= enable_bit;
        e.pending.push_back(async_event::result(async_event::TYPE_NOTICE, info, log_page));
    }

    /// Takes the next event for an outstanding Asynchronous Event Request.
    pub fn take_event(&self) -> Option<u32> {
        lock(&self.events).pending.pop_front()
    }

    /// Reads the Changed Namespace List: returns it, and unless `retain` clears it and
    /// unmasks the event.
    pub fn read_changed_namespaces(&self, retain: bool) -> Vec<u32> {
        let mut e = lock(&self.events);
        let list = e.changed_namespaces.clone();
        if !retain {
            e.changed_namespaces.clear();
            e.masked &= !AEC_NS_ATTRIBUTE;
        }
        list
    }

    /// Reading the discovery log unmasks discovery change events.
    pub fn discovery_log_read(&self, retain: bool) {
        if !retain {
            lock(&self.events).masked &= !AEC_DISCOVERY_CHANGE;
        }
    }
}

/// A controller.
#[derive(Debug, Serialize, Deserialize)]
pub struct ControllerImage {
    /// Controller ID.
    pub cntlid: u16,
    /// Its subsystem's NQN.
    pub subsystem: String,
    /// Host NQN.
    pub hostnqn: String,
    /// Host ID.
    pub hostid: [u8; 16],
    /// Keep Alive Timeout (ms); the timer starts again in the new process.
    pub kato_ms: u32,
    /// Controller Configuration.
    pub cc: u32,
    /// Controller Status.
    pub csts: u32,
    /// I/O queues granted.
    pub io_queues_granted: u32,
    /// Queue slots (the most I/O queues it may have, plus the admin queue).
    pub queue_slots: u32,
    /// Async Event Configuration.
    pub async_event_config: u32,
    /// Events waiting for an Asynchronous Event Request.
    pub pending_events: Vec<u32>,
    /// Event types reported and not yet cleared.
    pub masked_events: u32,
    /// The Changed Namespace List.
    pub changed_namespaces: Vec<u32>,
    /// The ANA state of each group as its host sees it (state codes by group ID).
    pub ana: Vec<u8>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::subsystem::HostPolicy;

    fn ctrl() -> Controller {
        let s = Subsystem::new("nqn.2024-01.io.nvpool:t", "SN", "m", HostPolicy::default()).unwrap();
        let a = Association {
            subsystem: s,
            hostnqn: "nqn.h".into(),
            hostid: [0; 16],
            kato_ms: 5000,
            max_io_queues: 4,
            transport: super::super::Transport::Tcp,
        };
        Controller::new(1, a, 0)
    }

    #[test]
    fn enable_and_shutdown() {
        let c = ctrl();
        assert!(c.set_cc(cc::EN | 6 << 16 | 4 << 20));
        assert!(c.ready());
        assert!(c.set_cc(cc::EN | 6 << 16 | 4 << 20 | 1 << 14));
        assert_ne!(c.csts() & csts::SHST_COMPLETE, 0);
        assert!(!c.set_cc(1 << 31), "reserved bits are refused");
        let bad = ctrl();
        bad.set_cc(cc::EN);
        assert_ne!(bad.csts() & csts::CFS, 0, "wrong entry sizes are a fatal status");
    }

    #[test]
    fn events_are_masked_until_the_log_is_read() {
        let c = ctrl();
        c.post_namespace_change(1);
        assert!(c.take_event().is_none(), "not enabled yet");
        c.set_async_event_config(AEC_NS_ATTRIBUTE);
        c.post_namespace_change(2);
        c.post_namespace_change(3);
        assert!(c.take_event().is_some());
        assert!(c.take_event().is_none(), "a second event waits until the log is read");
        assert_eq!(c.read_changed_namespaces(false), vec![1, 2, 3]);
        c.post_namespace_change(4);
        assert!(c.take_event().is_some());
    }

    #[test]
    fn ana_changes_are_seen_at_once_and_announced_until_the_log_is_read() {
        let c = ctrl();
        assert_eq!(c.ana_state(7), AnaState::Optimized);
        assert!(c.set_ana_state(7, AnaState::Inaccessible));
        assert!(!c.set_ana_state(7, AnaState::Inaccessible), "no change, no event");
        assert_eq!(c.ana_state(7), AnaState::Inaccessible);
        c.set_async_event_config(AEC_ANA_CHANGE);
        c.post_ana_change();
        c.post_ana_change();
        assert_eq!(c.take_event(), Some(async_event::result(async_event::TYPE_NOTICE, 3, lid::ANA)));
        assert!(c.take_event().is_none(), "masked until the log is read");
        c.ana_log_read(true);
        c.post_ana_change();
        assert!(c.take_event().is_none(), "a read that retains the event keeps it masked");
        c.ana_log_read(false);
        c.post_ana_change();
        assert!(c.take_event().is_some());
    }

    #[test]
    fn queues_are_claimed_once_within_the_grant() {
        let c = ctrl();
        assert_eq!(c.grant_io_queues(2), 2);
        assert!(c.claim_queue(1));
        assert!(!c.claim_queue(1));
        assert!(c.claim_queue(2));
        assert!(!c.claim_queue(3));
        c.release_queue(1);
        assert!(c.claim_queue(1));
    }

    #[test]
    fn keep_alive_expires() {
        let c = ctrl();
        assert!(!c.keep_alive_expired(4000));
        assert!(c.keep_alive_expired(5001));
        c.keep_alive(5000);
        assert!(!c.keep_alive_expired(9000));
    }
}

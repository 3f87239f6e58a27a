//! A namespace's reservations: which hosts are registered with which key, who holds
//! the reservation and of which type, and whether a host's command may run. Hosts are
//! told apart by the Host Identifier they gave at Connect, so every controller of a
//! host shares its registration. Pure state: the namespace keeps one behind a lock,
//! and the I/O path asks `allows` only while a reservation is held.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use nvpool_wire::Status;
use nvpool_wire::command::Command;
use nvpool_wire::reservation::{
    Acquire, AcquireAction, AcquireData, Register, RegisterAction, RegisterData, RegisteredController, Release,
    ReleaseAction, ReleaseData, Report, ReservationStatus, ReservationType, opcode,
};
use serde::{Deserialize, Serialize};

use crate::nvme::data_pointer::{self, Direction, Length, Source};
use crate::sync::lock;

/// A host's identifier, as Connect carried it.
pub type HostId = [u8; 16];

/// What a command does to a namespace's data, as reservations see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read.
    Read,
    /// Write, Write Zeroes, Dataset Management, Flush.
    Write,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Registrant {
    host: HostId,
    key: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    /// The host that acquired it; with an all-registrants type every registrant holds.
    host: HostId,
    kind: ReservationType,
}

/// What a change did to other hosts: each gets a Reservation Notification log page
/// (and the event that announces it), and Preempt and Abort must see the preempted
/// hosts' commands in flight end before it completes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Notices {
    /// Hosts whose registration another host preempted.
    pub registration_preempted: Vec<HostId>,
    /// Registrants that lost a registrants-only or all-registrants reservation they
    /// had access through, because its holder released or unregistered.
    pub reservation_released: Vec<HostId>,
    /// Hosts whose registration a Clear removed.
    pub reservation_preempted: Vec<HostId>,
    /// Hosts whose commands in flight must end before the command completes.
    pub abort: Vec<HostId>,
}

/// The reservations of one namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reservations {
    /// In the order they registered.
    registrants: Vec<Registrant>,
    holder: Option<Holder>,
    /// Bumped by every successful Register, Preempt and Clear.
    generation: u32,
}

impl Reservations {
    /// Whether a reservation is held: when none is, every command may run and the I/O
    /// path needs no check.
    pub fn held(&self) -> bool {
        self.holder.is_some()
    }

    fn registrant(&self, host: &HostId) -> Option<&Registrant> {
        self.registrants.iter().find(|r| &r.host == host)
    }

    fn holds(&self, host: &HostId) -> bool {
        match self.holder {
            Some(h) if h.kind.all_registrants_hold() => self.registrant(host).is_some(),
            Some(h) => &h.host == host,
            None => false,
        }
    }

    /// Whether `host` may run a command of `access` now.
    pub fn allows(&self, host: &HostId, access: Access) -> bool {
        let Some(holder) = self.holder else { return true };
        if self.holds(host) || (access == Access::Read && !holder.kind.excludes_reads()) {
            return true;
        }
        holder.kind.admits_registrants() && self.registrant(host).is_some()
    }

    /// The registrant's key, checked against `current_key` unless `ignore_key`:
    /// Reservation Conflict if `host` is not registered or gave another key.
    fn checked(&self, host: &HostId, current_key: u64, ignore_key: bool) -> Result<usize, Status> {
        self.registrants
            .iter()
            .position(|r| &r.host == host && (ignore_key || r.key == current_key))
            .ok_or(Status::RESERVATION_CONFLICT)
    }

    /// Reservation Register.
    pub fn register(&mut self, host: &HostId, cmd: Register, data: RegisterData) -> Result<Notices, Status> {
        // Persisting through a power loss (CPTPL 3) is not offered: the engine's
        // restart is its power loss, and the controller restores what matters.
        if matches!(cmd.change_ptpl, 1 | 3) {
            return Err(Status::INVALID_FIELD);
        }
        let mut notices = Notices::default();
        match cmd.action {
            RegisterAction::Register => match self.registrant(host) {
                Some(r) if r.key == data.new_key => {}
                Some(_) => return Err(Status::RESERVATION_CONFLICT),
                None => self.registrants.push(Registrant { host: *host, key: data.new_key }),
            },
            RegisterAction::Unregister => {
                let at = self.checked(host, data.current_key, cmd.ignore_key)?;
                self.registrants.remove(at);
                self.after_leaving(host, &mut notices);
            }
            RegisterAction::Replace => {
                let at = self.checked(host, data.current_key, cmd.ignore_key)?;
                self.registrants[at].key = data.new_key;
            }
        }
        self.generation = self.generation.wrapping_add(1);
        Ok(notices)
    }

    /// `host` is no longer registered: a reservation it held goes to another
    /// registrant (all-registrants types) or is released.
    fn after_leaving(&mut self, host: &HostId, notices: &mut Notices) {
        let Some(holder) = self.holder else { return };
        if holder.kind.all_registrants_hold() {
            match self.registrants.first() {
                Some(next) => self.holder = Some(Holder { host: next.host, kind: holder.kind }),
                None => self.holder = None,
            }
        } else if &holder.host == host {
            self.holder = None;
            if holder.kind.admits_registrants() {
                notices.reservation_released.extend(self.registrants.iter().map(|r| r.host));
            }
        }
    }

    /// Reservation Acquire.
    pub fn acquire(&mut self, host: &HostId, cmd: Acquire, data: AcquireData) -> Result<Notices, Status> {
        let kind = match (cmd.kind, cmd.ignore_key) {
            (Some(kind), false) => kind,
            _ => return Err(Status::INVALID_FIELD),
        };
        self.checked(host, data.current_key, false)?;
        match cmd.action {
            AcquireAction::Acquire => match self.holder {
                None => {
                    self.holder = Some(Holder { host: *host, kind });
                    Ok(Notices::default())
                }
                Some(h) if self.holds(host) && h.kind == kind => Ok(Notices::default()),
                Some(_) => Err(Status::RESERVATION_CONFLICT),
            },
            AcquireAction::Preempt | AcquireAction::PreemptAndAbort => {
                let mut notices = self.preempt(host, kind, data.preempt_key)?;
                if cmd.action == AcquireAction::PreemptAndAbort {
                    notices.abort = notices.registration_preempted.clone();
                }
                self.generation = self.generation.wrapping_add(1);
                Ok(notices)
            }
        }
    }

    fn preempt(&mut self, host: &HostId, kind: ReservationType, preempt_key: u64) -> Result<Notices, Status> {
        let mut notices = Notices::default();
        let Some(holder) = self.holder else {
            // Nothing held: the registrations with that key go.
            return self.remove_keyed(host, preempt_key, &mut notices).map(|()| notices);
        };
        if holder.kind.all_registrants_hold() {
            if preempt_key == 0 {
                // Key 0 takes an all-registrants reservation: every other host goes.
                self.holder = Some(Holder { host: *host, kind });
                let others: Vec<HostId> = self.registrants.iter().map(|r| r.host).filter(|h| h != host).collect();
                self.registrants.retain(|r| &r.host == host);
                notices.registration_preempted = others;
                return Ok(notices);
            }
            self.remove_keyed(host, preempt_key, &mut notices)?;
            return Ok(notices);
        }
        if holder.host == *host {
            // The holder changes its own reservation's type.
            self.holder = Some(Holder { host: *host, kind });
            if holder.kind != kind && holder.kind.admits_registrants() {
                notices.reservation_released.extend(self.registrants.iter().map(|r| r.host).filter(|h| h != host));
            }
            return Ok(notices);
        }
        let holder_key = self.registrant(&holder.host).map(|r| r.key);
        if holder_key == Some(preempt_key) {
            // The holder's key: the reservation passes to `host`, and every other
            // registration with that key goes.
            self.holder = Some(Holder { host: *host, kind });
            let preempted: Vec<HostId> =
                self.registrants.iter().filter(|r| r.key == preempt_key && &r.host != host).map(|r| r.host).collect();
            self.registrants.retain(|r| !preempted.contains(&r.host));
            if holder.kind != kind && holder.kind.admits_registrants() {
                notices.reservation_released.extend(self.registrants.iter().map(|r| r.host).filter(|h| h != host));
            }
            notices.registration_preempted = preempted;
            return Ok(notices);
        }
        if preempt_key == 0 {
            return Err(Status::INVALID_FIELD);
        }
        self.remove_keyed(host, preempt_key, &mut notices).map(|()| notices)
    }

    /// Removes every registration with `key` (Reservation Conflict if none has it).
    fn remove_keyed(&mut self, by: &HostId, key: u64, notices: &mut Notices) -> Result<(), Status> {
        let removed: Vec<HostId> = self.registrants.iter().filter(|r| r.key == key).map(|r| r.host).collect();
        if removed.is_empty() {
            return Err(Status::RESERVATION_CONFLICT);
        }
        self.registrants.retain(|r| r.key != key);
        for host in &removed {
            self.after_leaving(host, notices);
        }
        notices.registration_preempted.extend(removed.into_iter().filter(|h| h != by));
        Ok(())
    }

    /// Reservation Release.
    pub fn release(&mut self, host: &HostId, cmd: Release, data: ReleaseData) -> Result<Notices, Status> {
        if cmd.ignore_key {
            return Err(Status::INVALID_FIELD);
        }
        self.checked(host, data.current_key, false)?;
        let mut notices = Notices::default();
        match cmd.action {
            ReleaseAction::Release => {
                // Releasing what one does not hold is no error, and changes nothing.
                let Some(holder) = self.holder.filter(|_| self.holds(host)) else { return Ok(notices) };
                if holder.kind.code() != cmd.kind_code {
                    return Err(Status::INVALID_FIELD);
                }
                self.holder = None;
                if holder.kind.admits_registrants() {
                    notices.reservation_released.extend(self.registrants.iter().map(|r| r.host).filter(|h| h != host));
                }
            }
            ReleaseAction::Clear => {
                self.holder = None;
                notices.reservation_preempted = self.registrants.iter().map(|r| r.host).filter(|h| h != host).collect();
                self.registrants.clear();
                self.generation = self.generation.wrapping_add(1);
            }
        }
        Ok(notices)
    }

    /// The Reservation Status a report returns. Controllers are listed as dynamic
    /// (0xFFFF): a host's registration is its, whichever controller it uses.
    pub fn status(&self) -> ReservationStatus {
        ReservationStatus {
            generation: self.generation,
            kind: self.holder.map(|h| h.kind),
            ptpl: false,
            registrants: self
                .registrants
                .iter()
                .map(|r| RegisteredController {
                    controller_id: 0xFFFF,
                    holds: self.holds(&r.host),
                    host_id: r.host,
                    key: r.key,
                })
                .collect(),
        }
    }
}

/// Whether `opcode` is one of the reservation commands.
pub fn is_reservation_command(opcode: u8) -> bool {
    matches!(opcode, opcode::REGISTER | opcode::REPORT | opcode::ACQUIRE | opcode::RELEASE)
}

/// A namespace's reservations as the I/O path uses them: shared by the namespace's
/// forms (a swapped backend, a grown volume keep them) and by every queue of every
/// controller. While nothing is held, a command's check is one atomic load.
///
/// While any host is registered, the commands with the backend are counted, per
/// reactor and per epoch (its parity), so that a Preempt and Abort completes only
/// once every command that went to the backend before it is done: then no write of a
/// preempted host lands after it. It flips the epoch and waits for the old one's
/// count to reach zero; one that comes while another waits takes its turn after it.
#[derive(Debug)]
pub struct NamespaceReservations {
    held: AtomicBool,
    /// Hosts are registered: commands are counted.
    tracking: AtomicBool,
    epoch: AtomicU64,
    /// The epoch (plus one) whose commands a Preempt and Abort waits for; 0 for none,
    /// `CLAIMED` while one is flipping the epoch.
    drain: AtomicU64,
    in_flight: Box<[EpochCounts]>,
    state: Mutex<Reservations>,
}

/// One reactor's commands with the backend, by the parity of the epoch they went in.
#[derive(Debug, Default)]
#[repr(align(64))]
struct EpochCounts([AtomicU64; 2]);

impl Default for NamespaceReservations {
    fn default() -> Self {
        NamespaceReservations {
            held: AtomicBool::new(false),
            tracking: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
            drain: AtomicU64::new(0),
            in_flight: (0..crate::nvme::stats::reactor_shards()).map(|_| EpochCounts::default()).collect(),
            state: Mutex::default(),
        }
    }
}

/// A Preempt and Abort waiting to complete (see `NamespaceReservations`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abort {
    /// Another one is waiting: this one flips the epoch after it.
    Queued,
    /// Waiting for the commands of this epoch (plus one, as `drain` holds it).
    Draining(u64),
}

/// `drain` while a Preempt and Abort flips the epoch.
const CLAIMED: u64 = u64::MAX;

/// What a reservation command gives back.
#[derive(Debug, PartialEq, Eq)]
pub enum Executed {
    /// Complete, with a report's data if it is one.
    Done(Option<Vec<u8>>),
    /// A Preempt and Abort: it completes once `NamespaceReservations::advance` says so.
    Aborting(Abort),
}

impl NamespaceReservations {
    /// Whether `host` may run a command of `access` on the namespace now.
    pub fn allows(&self, host: &HostId, access: Access) -> bool {
        !self.held.load(Ordering::Acquire) || lock(&self.state).allows(host, access)
    }

    fn counts(&self, reactor: usize) -> &EpochCounts {
        &self.in_flight[reactor.min(self.in_flight.len() - 1)]
    }

    /// Counts a command that goes to the backend on `reactor` while hosts are
    /// registered; the mark it returns goes back to `done` when the backend is done.
    /// Called before the command is checked against the reservation, so that a
    /// command is either refused by a preemption or counted before it.
    pub fn enter(&self, reactor: usize) -> Option<u8> {
        if !self.tracking.load(Ordering::Acquire) {
            return None;
        }
        loop {
            let epoch = self.epoch.load(Ordering::SeqCst);
            let parity = (epoch & 1) as u8;
            self.counts(reactor).0[usize::from(parity)].fetch_add(1, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == epoch {
                return Some(parity);
            }
            // The epoch flipped meanwhile: counted in the old one, nobody may wait
            // for it there.
            self.counts(reactor).0[usize::from(parity)].fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A command `enter` counted is done with the backend.
    pub fn done(&self, reactor: usize, mark: u8) {
        self.counts(reactor).0[usize::from(mark)].fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether every command of epoch `epoch` is done with the backend.
    fn drained(&self, epoch: u64) -> bool {
        let parity = (epoch & 1) as usize;
        self.in_flight.iter().all(|c| c.0[parity].load(Ordering::SeqCst) == 0)
    }

    /// Moves a waiting Preempt and Abort on; true once it may complete. The wait of
    /// an earlier one ends when its epoch's commands are done, whether or not its
    /// connection is still there to see it.
    pub fn advance(&self, abort: &mut Abort) -> bool {
        if *abort == Abort::Queued {
            match self.drain.load(Ordering::SeqCst) {
                CLAIMED => return false,
                0 => {}
                earlier if self.drained(earlier - 1) => {
                    let _ = self.drain.compare_exchange(earlier, 0, Ordering::SeqCst, Ordering::SeqCst);
                }
                _ => return false,
            }
            if self.drain.compare_exchange(0, CLAIMED, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                return false;
            }
            let before = self.epoch.fetch_add(1, Ordering::SeqCst);
            self.drain.store(before + 1, Ordering::SeqCst);
            *abort = Abort::Draining(before + 1);
        }
        let Abort::Draining(mine) = *abort else { return false };
        if !self.drained(mine - 1) {
            return false;
        }
        let _ = self.drain.compare_exchange(mine, 0, Ordering::SeqCst, Ordering::SeqCst);
        true
    }

    /// Runs a reservation command of `host` whose host data (Register, Acquire,
    /// Release) is `data`.
    pub fn execute(&self, host: &HostId, cmd: &Command, data: &[u8]) -> Result<Executed, Status> {
        let mut state = lock(&self.state);
        let mut aborting = false;
        let outcome = match cmd.opcode {
            opcode::REGISTER => {
                let fields = Register::from_command(cmd).ok_or(Status::INVALID_FIELD.with_dnr())?;
                state.register(host, fields, decoded(RegisterData::decode(host_data(cmd, data, RegisterData::SIZE)?))?)
            }
            opcode::ACQUIRE => {
                let fields = Acquire::from_command(cmd).ok_or(Status::INVALID_FIELD.with_dnr())?;
                aborting = fields.action == AcquireAction::PreemptAndAbort;
                state.acquire(host, fields, decoded(AcquireData::decode(host_data(cmd, data, AcquireData::SIZE)?))?)
            }
            opcode::RELEASE => {
                let fields = Release::from_command(cmd).ok_or(Status::INVALID_FIELD.with_dnr())?;
                state.release(host, fields, decoded(ReleaseData::decode(host_data(cmd, data, ReleaseData::SIZE)?))?)
            }
            opcode::REPORT => {
                let report = Report::from_command(cmd);
                // A fabric's host identifiers are 128 bits: only the extended structure
                // can carry them.
                if !report.extended {
                    return Err(Status::HOST_ID_INCONSISTENT.with_dnr());
                }
                data_pointer::check(&cmd.dptr, Direction::ToHost, Length::Exactly(report.len as u64), 0)?;
                return Ok(Executed::Done(Some(state.status().encode_extended(report.len))));
            }
            _ => return Err(Status::INVALID_OPCODE.with_dnr()),
        };
        // The notices (log pages and events for the hosts affected) are not sent yet.
        outcome.map_err(|s| s.with_dnr())?;
        self.held.store(state.held(), Ordering::Release);
        self.tracking.store(!state.registrants.is_empty(), Ordering::Release);
        Ok(if aborting { Executed::Aborting(Abort::Queued) } else { Executed::Done(None) })
    }

    /// The key of the host holding the reservation, if one does.
    pub fn holder_key(&self) -> Option<u64> {
        let state = lock(&self.state);
        let holder = state.holder?;
        state.registrant(&holder.host).map(|r| r.key)
    }

    /// Whether any host is registered.
    pub fn in_use(&self) -> bool {
        self.tracking.load(Ordering::Acquire)
    }

    /// What a hot upgrade hands on.
    pub fn image(&self) -> ReservationsImage {
        let state = lock(&self.state);
        ReservationsImage {
            registrants: state.registrants.iter().map(|r| (r.host, r.key)).collect(),
            holder: state.holder.map(|h| (h.host, h.kind.code())),
            generation: state.generation,
        }
    }

    /// The reservations a hot upgrade handed on.
    pub fn restore(&self, image: &ReservationsImage) {
        let mut state = lock(&self.state);
        state.registrants = image.registrants.iter().map(|&(host, key)| Registrant { host, key }).collect();
        state.holder =
            image.holder.and_then(|(host, code)| ReservationType::from_code(code).map(|kind| Holder { host, kind }));
        state.generation = image.generation;
        self.held.store(state.held(), Ordering::Release);
        self.tracking.store(!state.registrants.is_empty(), Ordering::Release);
    }
}

/// A command's host data of `len` bytes, which the SGL must describe exactly.
fn host_data<'a>(cmd: &Command, data: &'a [u8], len: usize) -> Result<&'a [u8], Status> {
    match data_pointer::check(&cmd.dptr, Direction::FromHost, Length::Exactly(len as u64), data.len())? {
        Source::InCapsule { offset } => data.get(offset..offset + len).ok_or(Status::SGL_LENGTH_INVALID.with_dnr()),
        // The connection fetched the data before it ran the command.
        Source::Transport => Err(Status::SGL_TYPE_INVALID.with_dnr()),
    }
}

/// Host data `host_data` gave the length of decodes.
fn decoded<T>(d: Option<T>) -> Result<T, Status> {
    d.ok_or(Status::SGL_LENGTH_INVALID.with_dnr())
}

/// A namespace's reservations, as a hot upgrade hands them on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationsImage {
    /// Host identifiers and keys, in the order they registered.
    pub registrants: Vec<(HostId, u64)>,
    /// The holder's host identifier and the type's code.
    pub holder: Option<(HostId, u8)>,
    pub generation: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use ReservationType::*;

    const A: HostId = [0xA; 16];
    const B: HostId = [0xB; 16];
    const C: HostId = [0xC; 16];

    fn register(r: &mut Reservations, host: &HostId, key: u64) -> Result<Notices, Status> {
        let cmd = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 0 };
        r.register(host, cmd, RegisterData { current_key: 0, new_key: key })
    }

    fn acquire(r: &mut Reservations, host: &HostId, key: u64, kind: ReservationType) -> Result<Notices, Status> {
        let cmd = Acquire { action: AcquireAction::Acquire, ignore_key: false, kind: Some(kind) };
        r.acquire(host, cmd, AcquireData { current_key: key, preempt_key: 0 })
    }

    fn preempt(
        r: &mut Reservations,
        host: &HostId,
        key: u64,
        preempt_key: u64,
        kind: ReservationType,
        abort: bool,
    ) -> Result<Notices, Status> {
        let action = if abort { AcquireAction::PreemptAndAbort } else { AcquireAction::Preempt };
        let cmd = Acquire { action, ignore_key: false, kind: Some(kind) };
        r.acquire(host, cmd, AcquireData { current_key: key, preempt_key })
    }

    fn release(r: &mut Reservations, host: &HostId, key: u64, kind: ReservationType) -> Result<Notices, Status> {
        let cmd = Release { action: ReleaseAction::Release, ignore_key: false, kind_code: kind.code() };
        r.release(host, cmd, ReleaseData { current_key: key })
    }

    #[test]
    fn preempt_and_abort_waits_for_the_commands_before_it_and_in_turn() {
        let r = NamespaceReservations::default();
        assert_eq!(r.enter(0), None, "nobody registered: nothing is counted");
        r.tracking.store(true, Ordering::SeqCst);
        let before = r.enter(0).unwrap();
        let mut first = Abort::Queued;
        assert!(!r.advance(&mut first), "a command went to the backend before it");
        let after = r.enter(1).unwrap();
        let mut second = Abort::Queued;
        assert!(!r.advance(&mut second), "the second waits for the first");
        r.done(0, before);
        assert!(r.advance(&mut first), "the command before the first is done");
        assert!(!r.advance(&mut second), "the second waits for the command before it");
        r.done(1, after);
        assert!(r.advance(&mut second));

        // A first one whose connection went away: the next one ends its wait itself.
        let before = r.enter(0).unwrap();
        let mut abandoned = Abort::Queued;
        assert!(!r.advance(&mut abandoned));
        let mut next = Abort::Queued;
        assert!(!r.advance(&mut next));
        r.done(0, before);
        assert!(r.advance(&mut next));
    }

    #[test]
    fn without_a_reservation_everyone_reads_and_writes() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        assert!(!r.held());
        assert!(r.allows(&B, Access::Write) && r.allows(&B, Access::Read));
    }

    #[test]
    fn each_type_keeps_out_whom_it_should() {
        // (type, may an unregistered host read, write; may a registered non-holder read, write)
        let table = [
            (WriteExclusive, true, false, true, false),
            (ExclusiveAccess, false, false, false, false),
            (WriteExclusiveRegistrantsOnly, true, false, true, true),
            (ExclusiveAccessRegistrantsOnly, false, false, true, true),
            (WriteExclusiveAllRegistrants, true, false, true, true),
            (ExclusiveAccessAllRegistrants, false, false, true, true),
        ];
        for (kind, out_read, out_write, in_read, in_write) in table {
            let mut r = Reservations::default();
            register(&mut r, &A, 1).unwrap();
            register(&mut r, &B, 2).unwrap();
            acquire(&mut r, &A, 1, kind).unwrap();
            assert!(r.allows(&A, Access::Read) && r.allows(&A, Access::Write), "{kind:?}: the holder");
            assert_eq!((r.allows(&C, Access::Read), r.allows(&C, Access::Write)), (out_read, out_write), "{kind:?}");
            assert_eq!((r.allows(&B, Access::Read), r.allows(&B, Access::Write)), (in_read, in_write), "{kind:?}");
        }
    }

    #[test]
    fn keys_are_checked() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        assert_eq!(register(&mut r, &A, 1), Ok(Notices::default()), "the same key again is no error");
        assert_eq!(register(&mut r, &A, 9), Err(Status::RESERVATION_CONFLICT), "another key is");
        assert_eq!(acquire(&mut r, &A, 9, WriteExclusive), Err(Status::RESERVATION_CONFLICT));
        assert_eq!(acquire(&mut r, &B, 0, WriteExclusive), Err(Status::RESERVATION_CONFLICT), "not registered");
        let replace = Register { action: RegisterAction::Replace, ignore_key: true, change_ptpl: 0 };
        r.register(&A, replace, RegisterData { current_key: 0, new_key: 5 }).unwrap();
        acquire(&mut r, &A, 5, WriteExclusive).unwrap();
        let persist = Register { action: RegisterAction::Register, ignore_key: false, change_ptpl: 3 };
        assert_eq!(r.register(&B, persist, RegisterData { current_key: 0, new_key: 2 }), Err(Status::INVALID_FIELD));
    }

    #[test]
    fn a_second_acquire_conflicts_unless_it_is_the_same() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        register(&mut r, &B, 2).unwrap();
        acquire(&mut r, &A, 1, WriteExclusive).unwrap();
        assert_eq!(acquire(&mut r, &A, 1, WriteExclusive), Ok(Notices::default()));
        assert_eq!(acquire(&mut r, &A, 1, ExclusiveAccess), Err(Status::RESERVATION_CONFLICT));
        assert_eq!(acquire(&mut r, &B, 2, WriteExclusive), Err(Status::RESERVATION_CONFLICT));
    }

    /// How nvpool fences an engine that lost the serving role: the new one preempts
    /// the old one's key, and the old one can no longer write.
    #[test]
    fn preempt_and_abort_moves_the_reservation_and_fences_the_old_holder() {
        let mut r = Reservations::default();
        register(&mut r, &A, 7).unwrap();
        acquire(&mut r, &A, 7, WriteExclusive).unwrap();
        register(&mut r, &B, 8).unwrap();
        let generation = r.status().generation;
        let notices = preempt(&mut r, &B, 8, 7, WriteExclusive, true).unwrap();
        assert_eq!(notices.registration_preempted, vec![A]);
        assert_eq!(notices.abort, vec![A], "A's commands in flight must end first");
        assert!(!r.allows(&A, Access::Write) && r.allows(&B, Access::Write));
        assert!(r.allows(&A, Access::Read), "write exclusive: others still read");
        let status = r.status();
        assert_eq!(status.generation, generation + 1);
        assert_eq!(status.registrants.len(), 1);
        assert!(status.registrants[0].holds && status.registrants[0].host_id == B);
        // A's old key no longer does anything.
        assert_eq!(release(&mut r, &A, 7, WriteExclusive), Err(Status::RESERVATION_CONFLICT));
    }

    #[test]
    fn preempting_a_key_nobody_has_conflicts_and_key_zero_is_invalid() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        register(&mut r, &B, 2).unwrap();
        assert_eq!(preempt(&mut r, &B, 2, 99, WriteExclusive, false), Err(Status::RESERVATION_CONFLICT));
        acquire(&mut r, &A, 1, WriteExclusive).unwrap();
        assert_eq!(preempt(&mut r, &B, 2, 0, WriteExclusive, false), Err(Status::INVALID_FIELD));
    }

    #[test]
    fn an_all_registrants_reservation_outlives_its_first_holder() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        register(&mut r, &B, 2).unwrap();
        acquire(&mut r, &A, 1, WriteExclusiveAllRegistrants).unwrap();
        assert!(r.status().registrants.iter().all(|c| c.holds), "every registrant holds it");
        let unregister = Register { action: RegisterAction::Unregister, ignore_key: false, change_ptpl: 0 };
        r.register(&A, unregister, RegisterData { current_key: 1, new_key: 0 }).unwrap();
        assert!(r.held() && r.allows(&B, Access::Write) && !r.allows(&A, Access::Write));
        // Key 0 takes it over and removes every other registrant.
        register(&mut r, &C, 3).unwrap();
        let notices = preempt(&mut r, &C, 3, 0, ExclusiveAccess, false).unwrap();
        assert_eq!(notices.registration_preempted, vec![B]);
        assert!(!r.allows(&B, Access::Read));
    }

    #[test]
    fn releasing_tells_the_registrants_that_had_access_through_it() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        register(&mut r, &B, 2).unwrap();
        acquire(&mut r, &A, 1, WriteExclusiveRegistrantsOnly).unwrap();
        assert_eq!(release(&mut r, &B, 2, WriteExclusiveRegistrantsOnly), Ok(Notices::default()), "not the holder");
        assert!(r.held());
        assert_eq!(release(&mut r, &A, 1, WriteExclusive), Err(Status::INVALID_FIELD), "another type");
        let notices = release(&mut r, &A, 1, WriteExclusiveRegistrantsOnly).unwrap();
        assert_eq!(notices.reservation_released, vec![B]);
        assert!(!r.held());
        assert_eq!(r.status().registrants.len(), 2, "a release keeps the registrations");
    }

    #[test]
    fn clear_removes_everything_and_tells_the_others() {
        let mut r = Reservations::default();
        register(&mut r, &A, 1).unwrap();
        register(&mut r, &B, 2).unwrap();
        acquire(&mut r, &B, 2, ExclusiveAccess).unwrap();
        let clear = Release { action: ReleaseAction::Clear, ignore_key: false, kind_code: 0 };
        let notices = r.release(&A, clear, ReleaseData { current_key: 1 }).unwrap();
        assert_eq!(notices.reservation_preempted, vec![B]);
        assert_eq!(r.status().registrants.len(), 0);
        assert!(!r.held() && r.allows(&C, Access::Write));
    }
}

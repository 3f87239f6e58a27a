//! Reservations (NVMe Base 2.0 and the NVM Command Set 1.0): the fields of Reservation
//! Register, Acquire, Release and Report, the data each carries, and the Reservation
//! Status data structure a report returns.

use crate::bytes::{get_u16, get_u32, get_u64, layout, put_u16, put_u32};
use crate::command::Command;

/// The I/O opcodes of the reservation commands.
pub mod opcode {
    /// Reservation Register.
    pub const REGISTER: u8 = 0x0D;
    /// Reservation Report.
    pub const REPORT: u8 = 0x0E;
    /// Reservation Acquire.
    pub const ACQUIRE: u8 = 0x11;
    /// Reservation Release.
    pub const RELEASE: u8 = 0x15;
}

/// What a reservation keeps others from. "Registrants only" and
/// "all registrants" let every registered host through; the plain kinds only the
/// holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReservationType {
    WriteExclusive = 1,
    ExclusiveAccess = 2,
    WriteExclusiveRegistrantsOnly = 3,
    ExclusiveAccessRegistrantsOnly = 4,
    WriteExclusiveAllRegistrants = 5,
    ExclusiveAccessAllRegistrants = 6,
}

impl ReservationType {
    /// The type a command field names, if it names one.
    pub fn from_code(code: u8) -> Option<ReservationType> {
        use ReservationType::*;
        Some(match code {
            1 => WriteExclusive,
            2 => ExclusiveAccess,
            3 => WriteExclusiveRegistrantsOnly,
            4 => ExclusiveAccessRegistrantsOnly,
            5 => WriteExclusiveAllRegistrants,
            6 => ExclusiveAccessAllRegistrants,
            _ => return None,
        })
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    /// Whether hosts other than registrants are kept from reads too.
    pub fn excludes_reads(self) -> bool {
        use ReservationType::*;
        matches!(self, ExclusiveAccess | ExclusiveAccessRegistrantsOnly | ExclusiveAccessAllRegistrants)
    }

    /// Whether every registrant may do what the reservation keeps from others (not
    /// only the holder).
    pub fn admits_registrants(self) -> bool {
        !matches!(self, ReservationType::WriteExclusive | ReservationType::ExclusiveAccess)
    }

    /// Whether every registrant holds the reservation (rather than one host).
    pub fn all_registrants_hold(self) -> bool {
        matches!(self, ReservationType::WriteExclusiveAllRegistrants | ReservationType::ExclusiveAccessAllRegistrants)
    }
}

/// Reservation Register's action (CDW10 bits 2:0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterAction {
    Register,
    Unregister,
    Replace,
}

/// The fields of a Reservation Register command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Register {
    pub action: RegisterAction,
    /// Ignore Existing Key: the current key field is not checked.
    pub ignore_key: bool,
    /// Change Persist Through Power Loss State (CDW10 bits 31:30): 0 leaves it.
    pub change_ptpl: u8,
}

impl Register {
    /// Reads the fields; `None` for a reserved action.
    pub fn from_command(c: &Command) -> Option<Register> {
        let action = match c.cdw[0] & 7 {
            0 => RegisterAction::Register,
            1 => RegisterAction::Unregister,
            2 => RegisterAction::Replace,
            _ => return None,
        };
        Some(Register { action, ignore_key: c.cdw[0] & 1 << 3 != 0, change_ptpl: (c.cdw[0] >> 30) as u8 })
    }

    pub fn apply(&self, c: &mut Command) {
        let action = match self.action {
            RegisterAction::Register => 0,
            RegisterAction::Unregister => 1,
            RegisterAction::Replace => 2,
        };
        c.opcode = opcode::REGISTER;
        c.cdw[0] = action | u32::from(self.ignore_key) << 3 | u32::from(self.change_ptpl & 3) << 30;
    }
}

/// Reservation Acquire's action (CDW10 bits 2:0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireAction {
    Acquire,
    Preempt,
    PreemptAndAbort,
}

/// The fields of a Reservation Acquire command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Acquire {
    pub action: AcquireAction,
    pub ignore_key: bool,
    /// The type asked for (CDW10 bits 15:8); `None` when the field names none.
    pub kind: Option<ReservationType>,
}

impl Acquire {
    /// Reads the fields; `None` for a reserved action.
    pub fn from_command(c: &Command) -> Option<Acquire> {
        let action = match c.cdw[0] & 7 {
            0 => AcquireAction::Acquire,
            1 => AcquireAction::Preempt,
            2 => AcquireAction::PreemptAndAbort,
            _ => return None,
        };
        Some(Acquire {
            action,
            ignore_key: c.cdw[0] & 1 << 3 != 0,
            kind: ReservationType::from_code((c.cdw[0] >> 8) as u8),
        })
    }

    pub fn apply(&self, c: &mut Command) {
        let action = match self.action {
            AcquireAction::Acquire => 0,
            AcquireAction::Preempt => 1,
            AcquireAction::PreemptAndAbort => 2,
        };
        c.opcode = opcode::ACQUIRE;
        c.cdw[0] = action | u32::from(self.ignore_key) << 3 | u32::from(self.kind.map_or(0, |k| k.code())) << 8;
    }
}

/// Reservation Release's action (CDW10 bits 2:0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseAction {
    Release,
    Clear,
}

/// The fields of a Reservation Release command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Release {
    pub action: ReleaseAction,
    pub ignore_key: bool,
    /// The type being released (CDW10 bits 15:8), as the host gives it.
    pub kind_code: u8,
}

impl Release {
    /// Reads the fields; `None` for a reserved action.
    pub fn from_command(c: &Command) -> Option<Release> {
        let action = match c.cdw[0] & 7 {
            0 => ReleaseAction::Release,
            1 => ReleaseAction::Clear,
            _ => return None,
        };
        Some(Release { action, ignore_key: c.cdw[0] & 1 << 3 != 0, kind_code: (c.cdw[0] >> 8) as u8 })
    }

    pub fn apply(&self, c: &mut Command) {
        let action = match self.action {
            ReleaseAction::Release => 0,
            ReleaseAction::Clear => 1,
        };
        c.opcode = opcode::RELEASE;
        c.cdw[0] = action | u32::from(self.ignore_key) << 3 | u32::from(self.kind_code) << 8;
    }
}

/// The fields of a Reservation Report command.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report {
    /// Bytes the host takes (CDW10, a 0's based count of dwords).
    pub len: usize,
    /// Extended Data Structure (CDW11 bit 0): 128-bit host identifiers.
    pub extended: bool,
}

impl Report {
    pub fn from_command(c: &Command) -> Report {
        Report { len: (c.cdw[0] as usize + 1) * 4, extended: c.cdw[1] & 1 != 0 }
    }

    pub fn apply(&self, c: &mut Command) {
        c.opcode = opcode::REPORT;
        c.cdw[0] = (self.len / 4).saturating_sub(1) as u32;
        c.cdw[1] = u32::from(self.extended);
    }
}

layout! {
    /// Reservation Register data.
    pub struct RegisterData[16] {
        /// Current reservation key.
        current_key: u64 = 0,
        /// New reservation key.
        new_key: u64 = 8,
    }
}

layout! {
    /// Reservation Acquire data.
    pub struct AcquireData[16] {
        /// Current reservation key.
        current_key: u64 = 0,
        /// Preempt reservation key.
        preempt_key: u64 = 8,
    }
}

layout! {
    /// Reservation Release data.
    pub struct ReleaseData[8] {
        /// Current reservation key.
        current_key: u64 = 0,
    }
}

/// One registrant as a report lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegisteredController {
    /// The controller's ID, or 0xFFFF where the host's controllers are dynamic.
    pub controller_id: u16,
    /// Whether this registrant holds the reservation.
    pub holds: bool,
    pub host_id: [u8; 16],
    pub key: u64,
}

/// The Reservation Status data structure (its extended form, with 128-bit host identifiers).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ReservationStatus {
    /// Counts the registrations and reservations changed by Register, Preempt and
    /// Clear.
    pub generation: u32,
    /// The type held, if any.
    pub kind: Option<ReservationType>,
    /// Persist Through Power Loss State.
    pub ptpl: bool,
    pub registrants: Vec<RegisteredController>,
}

/// Bytes before the first registrant of the extended structure (a 24-byte header and
/// 40 reserved bytes), and each registrant's.
const EXTENDED_HEADER: usize = 64;
const EXTENDED_ENTRY: usize = 64;

impl ReservationStatus {
    /// The extended structure (128-bit host identifiers), cut to `len` bytes: a host
    /// that asked for fewer gets the first ones, and the count of all in the header.
    pub fn encode_extended(&self, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; EXTENDED_HEADER + EXTENDED_ENTRY * self.registrants.len()];
        put_u32(&mut b, 0, self.generation);
        b[4] = self.kind.map_or(0, |k| k.code());
        put_u16(&mut b, 5, self.registrants.len().min(usize::from(u16::MAX)) as u16);
        b[9] = u8::from(self.ptpl);
        for (i, r) in self.registrants.iter().enumerate() {
            let at = EXTENDED_HEADER + i * EXTENDED_ENTRY;
            put_u16(&mut b, at, r.controller_id);
            b[at + 2] = u8::from(r.holds);
            b[at + 8..at + 16].copy_from_slice(&r.key.to_le_bytes());
            b[at + 16..at + 32].copy_from_slice(&r.host_id);
        }
        b.resize(len, 0);
        b
    }

    /// Reads the extended structure; registrants past the end of `b` are left out.
    /// `None` if `b` is shorter than its header.
    pub fn decode_extended(b: &[u8]) -> Option<ReservationStatus> {
        if b.len() < EXTENDED_HEADER {
            return None;
        }
        let count = usize::from(get_u16(b, 5));
        let registrants = (0..count)
            .map(|i| EXTENDED_HEADER + i * EXTENDED_ENTRY)
            .take_while(|at| at + EXTENDED_ENTRY <= b.len())
            .map(|at| RegisteredController {
                controller_id: get_u16(b, at),
                holds: b[at + 2] & 1 != 0,
                key: get_u64(b, at + 8),
                host_id: b[at + 16..at + 32].try_into().expect("16 bytes"),
            })
            .collect();
        Some(ReservationStatus {
            generation: get_u32(b, 0),
            kind: ReservationType::from_code(b[4]),
            ptpl: b[9] & 1 != 0,
            registrants,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_fields_round_trip() {
        let mut c = Command::default();
        let r = Register { action: RegisterAction::Replace, ignore_key: true, change_ptpl: 2 };
        r.apply(&mut c);
        assert_eq!((c.opcode, c.cdw[0]), (0x0D, 2 | 1 << 3 | 2 << 30));
        assert_eq!(Register::from_command(&c), Some(r));
        let a = Acquire {
            action: AcquireAction::PreemptAndAbort,
            ignore_key: false,
            kind: Some(ReservationType::WriteExclusive),
        };
        a.apply(&mut c);
        assert_eq!((c.opcode, c.cdw[0]), (0x11, 2 | 1 << 8));
        assert_eq!(Acquire::from_command(&c), Some(a));
        let l = Release { action: ReleaseAction::Clear, ignore_key: false, kind_code: 0 };
        l.apply(&mut c);
        assert_eq!((c.opcode, c.cdw[0]), (0x15, 1));
        assert_eq!(Release::from_command(&c), Some(l));
        let p = Report { len: 4096, extended: true };
        p.apply(&mut c);
        assert_eq!((c.opcode, c.cdw[0], c.cdw[1]), (0x0E, 1023, 1));
        assert_eq!(Report::from_command(&c), p);
    }

    #[test]
    fn reserved_actions_and_types_are_refused() {
        let c = |cdw10: u32| Command { cdw: [cdw10, 0, 0, 0, 0, 0], ..Command::default() };
        assert_eq!(Register::from_command(&c(3)), None);
        assert_eq!(Acquire::from_command(&c(3)), None);
        assert_eq!(Release::from_command(&c(2)), None);
        assert_eq!(Acquire::from_command(&c(7 << 8)).unwrap().kind, None, "type 7 is reserved");
    }

    #[test]
    fn data_structures_have_the_spec_layout() {
        let d = RegisterData { current_key: 0x1122, new_key: 0xAABB }.to_vec();
        assert_eq!(d.len(), 16);
        assert_eq!((d[0], d[1], d[8], d[9]), (0x22, 0x11, 0xBB, 0xAA));
        assert_eq!(AcquireData::decode(&d).map(|a| (a.current_key, a.preempt_key)), Some((0x1122, 0xAABB)));
        assert_eq!(ReleaseData::decode(&d[..8]).map(|r| r.current_key), Some(0x1122));
        assert_eq!(ReleaseData::decode(&d[..7]), None);
    }

    #[test]
    fn a_report_lists_every_registrant_and_counts_those_it_cuts() {
        let status = ReservationStatus {
            generation: 7,
            kind: Some(ReservationType::WriteExclusiveRegistrantsOnly),
            ptpl: false,
            registrants: (0..3u8)
                .map(|i| RegisteredController {
                    controller_id: 0xFFFF,
                    holds: i == 1,
                    host_id: [i; 16],
                    key: u64::from(i) * 10,
                })
                .collect(),
        };
        let whole = status.encode_extended(64 + 3 * 64);
        assert_eq!((whole[4], get_u16(&whole, 5)), (3, 3));
        assert_eq!(ReservationStatus::decode_extended(&whole), Some(status.clone()));
        // Room for one: the header still counts three.
        let cut = status.encode_extended(128);
        let read = ReservationStatus::decode_extended(&cut).unwrap();
        assert_eq!((read.registrants.len(), get_u16(&cut, 5)), (1, 3));
        assert_eq!(ReservationStatus::decode_extended(&cut[..63]), None);
    }
}

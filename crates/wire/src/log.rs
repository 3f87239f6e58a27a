//! Log pages (NVMe Base 2.0 §5.16), asynchronous event results (§5.2) and the
//! discovery log (NVMe-oF 1.1 §5.3).

use crate::bytes::{get_u16, get_u32, get_u64, layout, put_u16, put_u32, put_u64};
use crate::command::Command;

/// Log page identifiers nvpool serves.
pub mod lid {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FW_SLOT: u8 = 0x03;
    /// Changed Namespace List.
    pub const CHANGED_NS: u8 = 0x04;
    /// Commands Supported and Effects.
    pub const COMMAND_EFFECTS: u8 = 0x05;
    /// Asymmetric Namespace Access.
    pub const ANA: u8 = 0x0C;
    /// Reservation Notification.
    pub const RESERVATION_NOTIFICATION: u8 = 0x80;
    /// Discovery (discovery controllers only).
    pub const DISCOVERY: u8 = 0x70;
}

/// The fields of a Get Log Page command (NVMe Base 2.0 Figure 197-200).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetLogPage {
    /// Log page identifier.
    pub lid: u8,
    /// Log specific parameter.
    pub lsp: u8,
    /// Retain asynchronous event.
    pub rae: bool,
    /// Number of bytes to return.
    pub len: usize,
    /// Byte offset into the log page.
    pub offset: u64,
}

impl GetLogPage {
    /// Reads the Get Log Page fields from an admin SQE.
    pub fn from_command(c: &Command) -> GetLogPage {
        let numdl = c.cdw[0] >> 16;
        let numdu = c.cdw[1] & 0xFFFF;
        GetLogPage {
            lid: (c.cdw[0] & 0xFF) as u8,
            lsp: ((c.cdw[0] >> 8) & 0x7F) as u8,
            rae: c.cdw[0] & (1 << 15) != 0,
            len: ((numdu << 16 | numdl) as usize + 1) * 4,
            offset: u64::from(c.cdw[2]) | u64::from(c.cdw[3]) << 32,
        }
    }

    /// Writes the fields into an admin SQE's dwords (the rest of the SQE is the
    /// caller's).
    pub fn apply(&self, c: &mut Command) {
        let numd = (self.len / 4).saturating_sub(1) as u32;
        c.cdw[0] =
            u32::from(self.lid) | u32::from(self.lsp & 0x7F) << 8 | u32::from(self.rae) << 15 | (numd & 0xFFFF) << 16;
        c.cdw[1] = numd >> 16;
        c.cdw[2] = self.offset as u32;
        c.cdw[3] = (self.offset >> 32) as u32;
    }
}

layout! {
    /// One Error Information log entry (NVMe Base 2.0 Figure 205).
    pub struct ErrorLogEntry[64] {
        /// Error count; 0 means the entry is unused.
        error_count: u64 = 0,
        /// Submission queue ID.
        sqid: u16 = 8,
        /// Command ID.
        cid: u16 = 10,
        /// Status field (with phase tag bit).
        status: u16 = 12,
        /// Parameter error location.
        param_location: u16 = 14,
        /// LBA.
        lba: u64 = 16,
        /// Namespace.
        nsid: u32 = 24,
    }
}

layout! {
    /// SMART / Health Information log page (NVMe Base 2.0 Figure 207). Counters are
    /// 128-bit in the spec; nvpool fills the low 64 bits.
    pub struct SmartLog[512] {
        /// Critical warning bits.
        critical_warning: u8 = 0,
        /// Composite temperature in kelvins.
        temperature: u16 = 1,
        /// Available spare, percent.
        available_spare: u8 = 3,
        /// Available spare threshold, percent.
        available_spare_threshold: u8 = 4,
        /// Percentage used.
        percentage_used: u8 = 5,
        /// Data units read, in thousands of 512-byte units.
        data_units_read: u64 = 32,
        /// Data units written, in thousands of 512-byte units.
        data_units_written: u64 = 48,
        /// Host read commands.
        host_reads: u64 = 64,
        /// Host write commands.
        host_writes: u64 = 80,
        /// Power cycles.
        power_cycles: u64 = 112,
        /// Power-on hours.
        power_on_hours: u64 = 128,
        /// Unsafe shutdowns.
        unsafe_shutdowns: u64 = 144,
        /// Media and data integrity errors.
        media_errors: u64 = 160,
        /// Number of error information log entries.
        error_log_entries: u64 = 176,
    }
}

layout! {
    /// Firmware Slot Information log page (NVMe Base 2.0 Figure 208).
    pub struct FwSlotLog[512] {
        /// Active firmware info: slot 1 is active.
        afi: u8 = 0,
        /// Firmware revision in slot 1.
        frs1: [u8; 8] = 8,
    }
}

/// Size of the Commands Supported and Effects log page.
pub const COMMAND_EFFECTS_SIZE: usize = 4096;
/// Commands Supported and Effects entry bit 0: the command is supported.
pub const EFFECT_SUPPORTED: u32 = 1;
/// Entry bit 1: the command may change logical block content.
pub const EFFECT_LBCC: u32 = 1 << 1;
/// Entry bit 2: the command may change namespace capabilities.
pub const EFFECT_NCC: u32 = 1 << 2;

/// Encodes a Commands Supported and Effects log page from (opcode, effects) pairs for
/// admin and I/O commands.
pub fn encode_command_effects(admin: &[(u8, u32)], io: &[(u8, u32)], b: &mut [u8]) {
    b[..COMMAND_EFFECTS_SIZE].fill(0);
    for &(op, e) in admin {
        put_u32(b, usize::from(op) * 4, e);
    }
    for &(op, e) in io {
        put_u32(b, 1024 + usize::from(op) * 4, e);
    }
}

/// The supported commands of a Commands Supported and Effects log page, as (opcode,
/// effects) pairs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommandEffects {
    /// Admin commands.
    pub admin: Vec<(u8, u32)>,
    /// I/O commands.
    pub io: Vec<(u8, u32)>,
}

/// Decodes a Commands Supported and Effects log page.
pub fn decode_command_effects(b: &[u8]) -> CommandEffects {
    let table = |base: usize| -> Vec<(u8, u32)> {
        (0..=255u8).map(|op| (op, get_u32(b, base + usize::from(op) * 4))).filter(|&(_, e)| e != 0).collect()
    };
    CommandEffects { admin: table(0), io: table(1024) }
}

/// Size of the Changed Namespace List log page.
pub const CHANGED_NS_SIZE: usize = 4096;

/// Encodes a Changed Namespace List: up to 1024 NSIDs, or FFFFFFFFh first if more
/// changed than fit.
pub fn encode_changed_ns(nsids: &[u32], b: &mut [u8]) {
    b[..CHANGED_NS_SIZE].fill(0);
    if nsids.len() > CHANGED_NS_SIZE / 4 {
        put_u32(b, 0, u32::MAX);
        return;
    }
    for (i, id) in nsids.iter().enumerate() {
        put_u32(b, i * 4, *id);
    }
}

/// Decodes a Changed Namespace List (the NSIDs before the first zero).
pub fn decode_changed_ns(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).take_while(|&id| id != 0).collect()
}

/// ANA states (NVMe Base 2.0 §8.1.3).
pub mod ana_state {
    /// Optimized.
    pub const OPTIMIZED: u8 = 0x01;
    /// Non-optimized.
    pub const NON_OPTIMIZED: u8 = 0x02;
    /// Inaccessible.
    pub const INACCESSIBLE: u8 = 0x03;
    /// Persistent loss.
    pub const PERSISTENT_LOSS: u8 = 0x04;
    /// Change (in transition).
    pub const CHANGE: u8 = 0x0F;
}

/// One ANA group of the ANA log page.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnaGroup {
    /// ANA group ID.
    pub grpid: u32,
    /// Change count of this group.
    pub chgcnt: u64,
    /// ANA state.
    pub state: u8,
    /// Namespaces in the group (omitted when the host asks for groups only).
    pub nsids: Vec<u32>,
}

/// Encodes the ANA log page (NVMe Base 2.0 Figure 222): a 16-byte header, then per
/// group a 32-byte descriptor followed by its NSIDs.
pub fn encode_ana_log(chgcnt: u64, groups: &[AnaGroup], groups_only: bool) -> Vec<u8> {
    let mut b = vec![0u8; 16];
    put_u64(&mut b, 0, chgcnt);
    put_u16(&mut b, 8, groups.len() as u16);
    for g in groups {
        let n = if groups_only { 0 } else { g.nsids.len() };
        let start = b.len();
        b.resize(start + 32 + 4 * n, 0);
        put_u32(&mut b, start, g.grpid);
        put_u32(&mut b, start + 4, n as u32);
        put_u64(&mut b, start + 8, g.chgcnt);
        b[start + 16] = g.state;
        for (i, id) in g.nsids.iter().take(n).enumerate() {
            put_u32(&mut b, start + 32 + 4 * i, *id);
        }
    }
    b
}

/// Decodes an ANA log page into its change count and groups; `None` if the page is
/// shorter than its own header and descriptors say.
pub fn decode_ana_log(b: &[u8]) -> Option<(u64, Vec<AnaGroup>)> {
    if b.len() < 16 {
        return None;
    }
    let n = usize::from(get_u16(b, 8));
    let mut off = 16;
    let mut groups = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        if b.len() < off + 32 {
            return None;
        }
        let count = get_u32(b, off + 4) as usize;
        let end = off.checked_add(32)?.checked_add(count.checked_mul(4)?)?;
        if b.len() < end {
            return None;
        }
        groups.push(AnaGroup {
            grpid: get_u32(b, off),
            chgcnt: get_u64(b, off + 8),
            state: b[off + 16],
            nsids: (0..count).map(|i| get_u32(b, off + 32 + 4 * i)).collect(),
        });
        off = end;
    }
    Some((get_u64(b, 0), groups))
}

/// Asynchronous event types and information (NVMe Base 2.0 Figure 146-151).
pub mod async_event {
    /// Event type: notice.
    pub const TYPE_NOTICE: u8 = 0x2;
    /// Notice: namespace attribute changed (read the Changed Namespace List).
    pub const NOTICE_NS_CHANGED: u8 = 0x00;
    /// Notice: ANA change (read the ANA log page).
    pub const NOTICE_ANA_CHANGE: u8 = 0x03;
    /// Notice: discovery log page change.
    pub const NOTICE_DISCOVERY_CHANGE: u8 = 0xF0;

    /// The completion DW0 of an Asynchronous Event Request.
    pub fn result(event_type: u8, info: u8, log_page: u8) -> u32 {
        u32::from(event_type & 0x7) | u32::from(info) << 8 | u32::from(log_page) << 16
    }
}

/// Feature identifiers nvpool supports (NVMe Base 2.0 Figure 319).
pub mod feature {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Power Management.
    pub const POWER_MANAGEMENT: u8 = 0x02;
    /// Temperature Threshold.
    pub const TEMPERATURE_THRESHOLD: u8 = 0x04;
    /// Volatile Write Cache.
    pub const VOLATILE_WRITE_CACHE: u8 = 0x06;
    /// Number of Queues.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing.
    pub const INTERRUPT_COALESCING: u8 = 0x08;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0B;
    /// Keep Alive Timer.
    pub const KEEP_ALIVE_TIMER: u8 = 0x0F;
    /// Reservation Notification Mask (per namespace).
    pub const RESERVATION_NOTIFICATION_MASK: u8 = 0x81;
    /// Reservation Persistence (per namespace): Persist Through Power Loss.
    pub const RESERVATION_PERSISTENCE: u8 = 0x82;
}

/// Bytes of the Reservation Notification log page (one entry).
pub const RESERVATION_NOTIFICATION_SIZE: usize = 64;

layout! {
    /// The Discovery log page header (NVMe-oF 1.1 Figure 38).
    pub struct DiscoveryLogHeader[1024] {
        /// Generation counter: changes whenever the log changes.
        genctr: u64 = 0,
        /// Number of records.
        numrec: u64 = 8,
        /// Record format (0).
        recfmt: u16 = 16,
    }
}

layout! {
    /// One Discovery log page entry (NVMe-oF 1.1 Figure 39).
    pub struct DiscoveryLogEntry[1024] {
        /// Transport type: 3 for TCP.
        trtype: u8 = 0,
        /// Address family: 1 IPv4, 2 IPv6.
        adrfam: u8 = 1,
        /// Subsystem type: 2 NVM subsystem, 3 current discovery subsystem.
        subtype: u8 = 2,
        /// Transport requirements.
        treq: u8 = 3,
        /// Port ID.
        portid: u16 = 4,
        /// Controller ID: 0xFFFF for the dynamic model.
        cntlid: u16 = 6,
        /// Admin maximum submission queue size.
        asqsz: u16 = 8,
        /// Entry flags.
        eflags: u16 = 10,
        /// Transport service ID (the port, as ASCII).
        trsvcid: [u8; 32] = 32,
        /// Subsystem NQN.
        subnqn: [u8; 256] = 256,
        /// Transport address (ASCII).
        traddr: [u8; 256] = 512,
        /// Transport specific address subtype.
        tsas: [u8; 256] = 768,
    }
}

// Fixed log page layouts (NVMe Base 2.0 §5.16.1, NVMe-oF 1.1 §5.3).
const _: () = assert!(ErrorLogEntry::SIZE == 64);
const _: () = assert!(SmartLog::SIZE == 512);
const _: () = assert!(FwSlotLog::SIZE == 512);
const _: () = assert!(DiscoveryLogHeader::SIZE == 1024);
const _: () = assert!(DiscoveryLogEntry::SIZE == 1024);

/// Transport type: TCP.
pub const TRTYPE_TCP: u8 = 3;
/// Transport type: RDMA.
pub const TRTYPE_RDMA: u8 = 1;
/// Address family: IPv4.
pub const ADRFAM_IPV4: u8 = 1;
/// Address family: IPv6.
pub const ADRFAM_IPV6: u8 = 2;
/// Subsystem type: NVM subsystem.
pub const SUBTYPE_NVME: u8 = 2;
/// Subsystem type: the current discovery subsystem.
pub const SUBTYPE_CURRENT_DISCOVERY: u8 = 3;
/// TREQ bits 1:0 = 10b: secure channel not required. Bit 2: SQ flow control disable
/// allowed.
pub const TREQ_NOT_REQUIRED: u8 = 0b10;
/// TREQ bits 1:0 = 01b: a secure channel is required.
pub const TREQ_REQUIRED: u8 = 0b01;
/// NVMe/TCP's TSAS byte 0 (SECTYPE): TLS 1.3.
pub const TSAS_SECTYPE_TLS13: u8 = 2;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn get_log_page_round_trips(lid: u8, lsp in 0u8..0x80, rae: bool, numd in 1usize..(1 << 20), offset: u64) {
            let g = GetLogPage { lid, lsp, rae, len: numd * 4, offset };
            let mut c = Command::default();
            g.apply(&mut c);
            prop_assert_eq!(GetLogPage::from_command(&c), g);
        }

        #[test]
        fn discovery_entry_round_trips(raw in proptest::collection::vec(any::<u8>(), 1024)) {
            let e = DiscoveryLogEntry::decode(&raw).unwrap();
            prop_assert_eq!(DiscoveryLogEntry::decode(&e.to_vec()).unwrap(), e);
        }

        #[test]
        fn smart_round_trips(raw in proptest::collection::vec(any::<u8>(), 512)) {
            let e = SmartLog::decode(&raw).unwrap();
            prop_assert_eq!(SmartLog::decode(&e.to_vec()).unwrap(), e);
        }

        #[test]
        fn ana_log_round_trips(chgcnt: u64, groups in proptest::collection::vec(
            (1u32.., any::<u64>(), 1u8..16, proptest::collection::vec(1u32.., 0..20)), 0..8)) {
            let groups: Vec<AnaGroup> = groups.into_iter()
                .map(|(grpid, chgcnt, state, nsids)| AnaGroup { grpid, chgcnt, state, nsids }).collect();
            let page = encode_ana_log(chgcnt, &groups, false);
            prop_assert_eq!(decode_ana_log(&page), Some((chgcnt, groups)));
        }

        #[test]
        fn ana_log_decoder_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_ana_log(&raw);
        }

        #[test]
        fn changed_ns_round_trips(ids in proptest::collection::vec(1u32.., 0..1024)) {
            let mut b = [0u8; CHANGED_NS_SIZE];
            encode_changed_ns(&ids, &mut b);
            prop_assert_eq!(decode_changed_ns(&b), ids);
        }

        #[test]
        fn command_effects_round_trip(admin in proptest::collection::btree_map(any::<u8>(), 1u32.., 0..40),
                                      io in proptest::collection::btree_map(any::<u8>(), 1u32.., 0..40)) {
            let admin: Vec<(u8, u32)> = admin.into_iter().collect();
            let io: Vec<(u8, u32)> = io.into_iter().collect();
            let mut b = [0u8; COMMAND_EFFECTS_SIZE];
            encode_command_effects(&admin, &io, &mut b);
            prop_assert_eq!(decode_command_effects(&b), CommandEffects { admin, io });
        }

        #[test]
        fn error_entry_round_trips(raw in proptest::collection::vec(any::<u8>(), 64)) {
            let e = ErrorLogEntry::decode(&raw).unwrap();
            prop_assert_eq!(ErrorLogEntry::decode(&e.to_vec()).unwrap(), e);
        }
    }

    #[test]
    fn ana_log_layout() {
        let g = [
            AnaGroup { grpid: 1, chgcnt: 5, state: ana_state::OPTIMIZED, nsids: vec![1, 2] },
            AnaGroup { grpid: 2, chgcnt: 6, state: ana_state::INACCESSIBLE, nsids: vec![3] },
        ];
        let b = encode_ana_log(9, &g, false);
        assert_eq!(b.len(), 16 + 32 + 8 + 32 + 4);
        assert_eq!(b[8], 2);
        assert_eq!(b[16 + 16], ana_state::OPTIMIZED);
        assert_eq!(encode_ana_log(9, &g, true).len(), 16 + 64);
    }

    #[test]
    fn changed_ns_overflow_marks_all() {
        let mut b = [0u8; CHANGED_NS_SIZE];
        encode_changed_ns(&(1..2000).collect::<Vec<_>>(), &mut b);
        assert_eq!(&b[0..4], &[0xFF; 4]);
    }

    #[test]
    fn async_event_result_packs_fields() {
        let r = async_event::result(async_event::TYPE_NOTICE, async_event::NOTICE_NS_CHANGED, lid::CHANGED_NS);
        assert_eq!(r, 0x0004_0002);
    }
}

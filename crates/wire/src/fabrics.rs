//! Fabrics commands (NVMe-oF 1.1 §3.3, §6) and controller properties (NVMe Base 2.0
//! §3.1.4).

use crate::bytes::{get_array, get_nul_padded, get_u16, put_nul_padded, put_u16};
use crate::command::{Command, PSDT_SGL, SglDescriptor, admin_opcode, sgl};

/// Fabrics Command Type values (byte 4 of a fabrics SQE).
pub mod fctype {
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECEIVE: u8 = 0x06;
    /// Disconnect (an I/O queue).
    pub const DISCONNECT: u8 = 0x08;
}

/// Size of the Connect command's data.
pub const CONNECT_DATA_SIZE: usize = 1024;
/// The controller ID a host sends in Connect to ask for any controller (dynamic model).
pub const CNTLID_DYNAMIC: u16 = 0xFFFF;
/// The well-known NQN of discovery subsystems.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Maximum length of an NQN in bytes (NVMe Base 2.0 §4.5).
pub const NQN_MAX_LEN: usize = 223;

/// Checks an NQN's form: 1 to 223 bytes of printable ASCII with the `nqn.` prefix.
pub fn validate_nqn(nqn: &str) -> Result<(), String> {
    if nqn.is_empty() || nqn.len() > NQN_MAX_LEN {
        return Err(format!("NQN {nqn:?} must be 1 to 223 bytes long"));
    }
    if !nqn.starts_with("nqn.") || !nqn.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "NQN {nqn:?} is malformed: it must start with \"nqn.\" and contain no spaces, e.g. nqn.2024-01.io.nvpool:vol1"
        ));
    }
    Ok(())
}

/// The SQE fields of a Connect command (NVMe-oF 1.1 Figure 20).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectCommand {
    /// Record format; 0 is the only one defined.
    pub recfmt: u16,
    /// Queue ID: 0 for the admin queue.
    pub qid: u16,
    /// Submission queue size, 0's based.
    pub sqsize: u16,
    /// Connect attributes.
    pub cattr: u8,
    /// Keep Alive Timeout in milliseconds (admin queue only).
    pub kato: u32,
}

impl ConnectCommand {
    /// Reads the Connect fields of a fabrics SQE.
    pub fn from_command(c: &Command) -> ConnectCommand {
        ConnectCommand {
            recfmt: (c.cdw[0] & 0xFFFF) as u16,
            qid: (c.cdw[0] >> 16) as u16,
            sqsize: (c.cdw[1] & 0xFFFF) as u16,
            cattr: ((c.cdw[1] >> 16) & 0xFF) as u8,
            kato: c.cdw[2],
        }
    }

    /// Builds the Connect SQE; the 1 KiB data travels in the capsule.
    pub fn to_command(&self, cid: u16) -> Command {
        Command {
            opcode: admin_opcode::FABRICS,
            flags: PSDT_SGL,
            cid,
            nsid: u32::from(fctype::CONNECT),
            dptr: SglDescriptor { address: 0, length: CONNECT_DATA_SIZE as u32, id: sgl::IN_CAPSULE },
            cdw: [
                u32::from(self.recfmt) | u32::from(self.qid) << 16,
                u32::from(self.sqsize) | u32::from(self.cattr) << 16,
                self.kato,
                0,
                0,
                0,
            ],
            ..Command::default()
        }
    }
}

/// The 1 KiB data of a Connect command (NVMe-oF 1.1 Figure 21).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnectData {
    /// Host identifier (a UUID).
    pub hostid: [u8; 16],
    /// Controller ID: 0xFFFF on the admin queue; the allocated ID on I/O queues.
    pub cntlid: u16,
    /// The subsystem the host connects to.
    pub subnqn: String,
    /// The host's NQN.
    pub hostnqn: String,
}

/// Byte offset of QID in the Connect SQE, as Connect Invalid Parameters names it.
pub const CONNECT_QID_OFFSET: u16 = 42;
/// Byte offset of SQSIZE in the Connect SQE.
pub const CONNECT_SQSIZE_OFFSET: u16 = 44;
/// Byte offset of the host identifier in the Connect data.
pub const CONNECT_HOSTID_OFFSET: u16 = 0;
/// Byte offset of CNTLID in the Connect data.
pub const CONNECT_CNTLID_OFFSET: u16 = 16;
/// Byte offset of the subsystem NQN in the Connect data.
pub const CONNECT_SUBNQN_OFFSET: u16 = 256;
/// Byte offset of the host NQN in the Connect data.
pub const CONNECT_HOSTNQN_OFFSET: u16 = 512;

impl ConnectData {
    /// Decodes the Connect data; `b` must be at least 1024 bytes.
    pub fn decode(b: &[u8]) -> Option<ConnectData> {
        if b.len() < CONNECT_DATA_SIZE {
            return None;
        }
        Some(ConnectData {
            hostid: get_array(b, 0),
            cntlid: get_u16(b, 16),
            subnqn: get_nul_padded(b, 256, 256),
            hostnqn: get_nul_padded(b, 512, 256),
        })
    }

    /// Encodes the Connect data.
    pub fn encode(&self, b: &mut [u8; CONNECT_DATA_SIZE]) {
        b.fill(0);
        b[0..16].copy_from_slice(&self.hostid);
        put_u16(b, 16, self.cntlid);
        put_nul_padded(b, 256, 256, &self.subnqn);
        put_nul_padded(b, 512, 256, &self.hostnqn);
    }
}

/// CQE DW0 of a failed Connect with "invalid parameters": which field was wrong.
/// Bit 16 (IATTR) set means the offset points into the data, clear means into the SQE.
pub fn connect_invalid_param(in_data: bool, offset: u16) -> u32 {
    u32::from(offset) | if in_data { 1 << 16 } else { 0 }
}

/// Property offsets (NVMe Base 2.0 Figure 33).
pub mod property {
    /// Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// Version (4 bytes).
    pub const VS: u32 = 0x08;
    /// Controller Configuration (4 bytes).
    pub const CC: u32 = 0x14;
    /// Controller Status (4 bytes).
    pub const CSTS: u32 = 0x1C;
    /// NVM Subsystem Reset (4 bytes).
    pub const NSSR: u32 = 0x20;
}

/// The Property Get/Set fields of a fabrics SQE (NVMe-oF 1.1 Figures 26 and 30).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PropertyAccess {
    /// Whether the property is 8 bytes wide (ATTRIB bits 2:0 = 1) rather than 4.
    pub eight_bytes: bool,
    /// Property offset.
    pub offset: u32,
    /// Value to set (Property Set only).
    pub value: u64,
}

impl PropertyAccess {
    /// Reads the Property Get/Set fields.
    pub fn from_command(c: &Command) -> PropertyAccess {
        PropertyAccess {
            eight_bytes: c.cdw[0] & 0x7 == 1,
            offset: c.cdw[1],
            value: u64::from(c.cdw[2]) | u64::from(c.cdw[3]) << 32,
        }
    }

    /// Builds a Property Get (`set == false`) or Property Set SQE.
    pub fn to_command(&self, cid: u16, set: bool) -> Command {
        Command {
            opcode: admin_opcode::FABRICS,
            flags: PSDT_SGL,
            cid,
            nsid: u32::from(if set { fctype::PROPERTY_SET } else { fctype::PROPERTY_GET }),
            dptr: SglDescriptor { id: sgl::TRANSPORT, ..SglDescriptor::default() },
            cdw: [u32::from(self.eight_bytes), self.offset, self.value as u32, (self.value >> 32) as u32, 0, 0],
            ..Command::default()
        }
    }
}

/// Controller Capabilities (CAP) fields nvpool reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Maximum queue entries supported, 0's based.
    pub mqes: u16,
    /// Worst-case time to become ready, in 500 ms units.
    pub timeout: u8,
    /// Command sets supported (bit 0 NVM, bit 6 I/O command set specific, bit 7 none).
    pub css: u8,
}

impl Capabilities {
    /// The 64-bit CAP value: contiguous queues required (bit 16), MPSMIN = MPSMAX = 0
    /// (4 KiB pages).
    pub fn to_u64(self) -> u64 {
        u64::from(self.mqes) | 1 << 16 | u64::from(self.timeout) << 24 | u64::from(self.css) << 37
    }

    /// Decodes CAP.
    pub fn from_u64(v: u64) -> Capabilities {
        Capabilities { mqes: (v & 0xFFFF) as u16, timeout: ((v >> 24) & 0xFF) as u8, css: ((v >> 37) & 0xFF) as u8 }
    }
}

/// Controller Configuration (CC) fields.
pub mod cc {
    /// Enable.
    pub const EN: u32 = 1;
    /// Shutdown notification (bits 15:14).
    pub const SHN_MASK: u32 = 0x3 << 14;
    /// The CC fields nvpool stores; the rest must be zero.
    pub const WRITABLE: u32 = EN | 0x7 << 4 | 0xF << 7 | 0x7 << 11 | SHN_MASK | 0xF << 16 | 0xF << 20;
}

/// Controller Status (CSTS) fields.
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1;
    /// Controller fatal status.
    pub const CFS: u32 = 1 << 1;
    /// Shutdown processing complete (SHST = 10b).
    pub const SHST_COMPLETE: u32 = 0x2 << 2;
}

/// The version nvpool reports: NVMe 2.0.
pub const VERSION_2_0: u32 = 0x0002_0000;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn connect_command_round_trips(recfmt: u16, qid: u16, sqsize: u16, cattr: u8, kato: u32, cid: u16) {
            let c = ConnectCommand { recfmt, qid, sqsize, cattr, kato };
            let sqe = c.to_command(cid);
            prop_assert_eq!(sqe.fctype(), fctype::CONNECT);
            prop_assert_eq!(ConnectCommand::from_command(&sqe), c);
        }

        #[test]
        fn connect_data_round_trips(hostid: [u8; 16], cntlid: u16, sub in "[a-z0-9.:-]{1,223}", host in "[a-z0-9.:-]{1,223}") {
            let d = ConnectData { hostid, cntlid, subnqn: sub, hostnqn: host };
            let mut b = [0u8; CONNECT_DATA_SIZE];
            d.encode(&mut b);
            prop_assert_eq!(ConnectData::decode(&b), Some(d));
        }

        #[test]
        fn property_round_trips(eight_bytes: bool, offset: u32, value: u64, set: bool) {
            let p = PropertyAccess { eight_bytes, offset, value };
            prop_assert_eq!(PropertyAccess::from_command(&p.to_command(1, set)), p);
        }

        #[test]
        fn cap_round_trips(mqes: u16, timeout: u8, css: u8) {
            let c = Capabilities { mqes, timeout, css };
            prop_assert_eq!(Capabilities::from_u64(c.to_u64()), c);
        }
    }

    #[test]
    fn short_connect_data_is_rejected() {
        assert_eq!(ConnectData::decode(&[0u8; 100]), None);
    }
}

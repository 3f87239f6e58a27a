//! Completion status values (NVMe Base 2.0 §4.6.1, NVMe-oF 1.1 §3.5).
//!
//! A [`Status`] holds the completion queue entry's status field without the phase tag:
//! Status Code in bits 7:0, Status Code Type in bits 10:8, Command Retry Delay in bits
//! 12:11, More in bit 13 and Do Not Retry in bit 14.

use std::fmt;

/// A completion status: the CQE status field shifted right past the phase tag.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(pub u16);

const SCT_GENERIC: u16 = 0;
const SCT_COMMAND_SPECIFIC: u16 = 1;
const SCT_PATH: u16 = 3;
const DNR: u16 = 1 << 14;

const fn status(sct: u16, sc: u16) -> Status {
    Status(sct << 8 | sc)
}

impl Status {
    /// Successful completion.
    pub const SUCCESS: Status = status(SCT_GENERIC, 0x00);
    /// The opcode is not supported.
    pub const INVALID_OPCODE: Status = status(SCT_GENERIC, 0x01);
    /// A field of the command is invalid.
    pub const INVALID_FIELD: Status = status(SCT_GENERIC, 0x02);
    /// The command identifier is already in use.
    pub const COMMAND_ID_CONFLICT: Status = status(SCT_GENERIC, 0x03);
    /// Transferring the data or metadata failed.
    pub const DATA_TRANSFER_ERROR: Status = status(SCT_GENERIC, 0x04);
    /// The controller failed internally (for example a disk I/O error).
    pub const INTERNAL_ERROR: Status = status(SCT_GENERIC, 0x06);
    /// The command was aborted by an Abort command.
    pub const ABORT_REQUESTED: Status = status(SCT_GENERIC, 0x07);
    /// The command was aborted because its submission queue was deleted.
    pub const ABORT_SQ_DELETED: Status = status(SCT_GENERIC, 0x08);
    /// The namespace or format is invalid.
    pub const INVALID_NAMESPACE: Status = status(SCT_GENERIC, 0x0B);
    /// The command arrived out of the required sequence.
    pub const COMMAND_SEQUENCE_ERROR: Status = status(SCT_GENERIC, 0x0C);
    /// The data SGL length is invalid for the command.
    pub const SGL_LENGTH_INVALID: Status = status(SCT_GENERIC, 0x0F);
    /// The SGL descriptor type is not supported.
    pub const SGL_TYPE_INVALID: Status = status(SCT_GENERIC, 0x11);
    /// The SGL offset is invalid.
    pub const SGL_OFFSET_INVALID: Status = status(SCT_GENERIC, 0x16);
    /// Host identifier is inconsistent (Connect).
    pub const HOST_ID_INCONSISTENT: Status = status(SCT_GENERIC, 0x18);
    /// A transport error the host may retry (for example a data digest error).
    pub const TRANSIENT_TRANSPORT_ERROR: Status = status(SCT_GENERIC, 0x22);
    /// A write to a namespace that takes none (a snapshot).
    pub const NAMESPACE_WRITE_PROTECTED: Status = status(SCT_GENERIC, 0x20);
    /// The LBA range exceeds the namespace.
    pub const LBA_OUT_OF_RANGE: Status = status(SCT_GENERIC, 0x80);
    /// The namespace has no capacity left.
    pub const CAPACITY_EXCEEDED: Status = status(SCT_GENERIC, 0x81);
    /// The namespace is not ready.
    pub const NAMESPACE_NOT_READY: Status = status(SCT_GENERIC, 0x82);
    /// A reservation keeps this host from the command, or a reservation command's key
    /// or registration does not match.
    pub const RESERVATION_CONFLICT: Status = status(SCT_GENERIC, 0x83);

    /// The queue identifier is invalid (Connect for a queue that does not exist).
    pub const INVALID_QUEUE_IDENTIFIER: Status = status(SCT_COMMAND_SPECIFIC, 0x01);
    /// The queue size is invalid.
    pub const INVALID_QUEUE_SIZE: Status = status(SCT_COMMAND_SPECIFIC, 0x02);
    /// Too many Asynchronous Event Requests are outstanding.
    pub const AER_LIMIT_EXCEEDED: Status = status(SCT_COMMAND_SPECIFIC, 0x05);
    /// The log page identifier is not supported.
    pub const INVALID_LOG_PAGE: Status = status(SCT_COMMAND_SPECIFIC, 0x09);
    /// The feature identifier cannot be saved.
    pub const FEATURE_NOT_SAVEABLE: Status = status(SCT_COMMAND_SPECIFIC, 0x0D);
    /// Connect: the record format is not supported.
    pub const CONNECT_INCOMPATIBLE_FORMAT: Status = status(SCT_COMMAND_SPECIFIC, 0x80);
    /// Connect: the controller is busy.
    pub const CONNECT_CONTROLLER_BUSY: Status = status(SCT_COMMAND_SPECIFIC, 0x81);
    /// Connect: a parameter is invalid; CQE DW0 says which.
    pub const CONNECT_INVALID_PARAMETERS: Status = status(SCT_COMMAND_SPECIFIC, 0x82);
    /// Connect: the host is not allowed on this subsystem.
    pub const CONNECT_INVALID_HOST: Status = status(SCT_COMMAND_SPECIFIC, 0x84);
    /// Authentication Required: the queue must authenticate before this command.
    pub const AUTH_REQUIRED: Status = status(SCT_COMMAND_SPECIFIC, 0x91);

    /// The namespace's ANA group is lost for good on this path.
    pub const ANA_PERSISTENT_LOSS: Status = status(SCT_PATH, 0x01);
    /// The namespace's ANA group is inaccessible on this path.
    pub const ANA_INACCESSIBLE: Status = status(SCT_PATH, 0x02);
    /// The namespace's ANA group is changing state on this path.
    pub const ANA_TRANSITION: Status = status(SCT_PATH, 0x03);

    /// Status Code (bits 7:0).
    pub fn code(self) -> u8 {
        (self.0 & 0xFF) as u8
    }

    /// Status Code Type (bits 10:8).
    pub fn code_type(self) -> u8 {
        ((self.0 >> 8) & 0x7) as u8
    }

    /// Whether Do Not Retry is set.
    pub fn dnr(self) -> bool {
        self.0 & DNR != 0
    }

    /// This status with Do Not Retry set: the host must not retry the command.
    pub fn with_dnr(self) -> Status {
        Status(self.0 | DNR)
    }

    /// Whether this is a success.
    pub fn is_success(self) -> bool {
        self.0 & 0x7FF == 0
    }

    /// The status without retry and more bits, for comparing against the constants.
    pub fn base(self) -> Status {
        Status(self.0 & 0x7FF)
    }

    /// A short description for logs and error messages.
    pub fn describe(self) -> &'static str {
        match self.base() {
            Status::SUCCESS => "success",
            Status::INVALID_OPCODE => "invalid opcode",
            Status::INVALID_FIELD => "invalid field in command",
            Status::COMMAND_ID_CONFLICT => "command id conflict",
            Status::DATA_TRANSFER_ERROR => "data transfer error",
            Status::INTERNAL_ERROR => "internal error",
            Status::ABORT_REQUESTED => "aborted by request",
            Status::ABORT_SQ_DELETED => "aborted: queue deleted",
            Status::INVALID_NAMESPACE => "invalid namespace or format",
            Status::COMMAND_SEQUENCE_ERROR => "command sequence error",
            Status::SGL_LENGTH_INVALID => "data SGL length invalid",
            Status::SGL_TYPE_INVALID => "SGL descriptor type invalid",
            Status::SGL_OFFSET_INVALID => "SGL offset invalid",
            Status::HOST_ID_INCONSISTENT => "host identifier inconsistent",
            Status::TRANSIENT_TRANSPORT_ERROR => "transient transport error",
            Status::LBA_OUT_OF_RANGE => "LBA out of range",
            Status::CAPACITY_EXCEEDED => "capacity exceeded",
            Status::NAMESPACE_NOT_READY => "namespace not ready",
            Status::RESERVATION_CONFLICT => "reservation conflict",
            Status::INVALID_QUEUE_IDENTIFIER => "invalid queue identifier",
            Status::INVALID_QUEUE_SIZE => "invalid queue size",
            Status::AER_LIMIT_EXCEEDED => "asynchronous event request limit exceeded",
            Status::INVALID_LOG_PAGE => "invalid log page",
            Status::FEATURE_NOT_SAVEABLE => "feature not saveable",
            Status::CONNECT_INCOMPATIBLE_FORMAT => "connect: incompatible format",
            Status::CONNECT_CONTROLLER_BUSY => "connect: controller busy",
            Status::CONNECT_INVALID_PARAMETERS => "connect: invalid parameters",
            Status::CONNECT_INVALID_HOST => "connect: host not allowed",
            Status::ANA_PERSISTENT_LOSS => "ANA persistent loss",
            Status::ANA_INACCESSIBLE => "ANA inaccessible",
            Status::ANA_TRANSITION => "ANA transition",
            _ => "unknown status",
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Status(sct={:#x} sc={:#04x}{} {})",
            self.code_type(),
            self.code(),
            if self.dnr() { " dnr" } else { "" },
            self.describe()
        )
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (sct {:#x}, sc {:#04x})", self.describe(), self.code_type(), self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_decode() {
        let s = Status::CONNECT_INVALID_HOST.with_dnr();
        assert_eq!(s.code(), 0x84);
        assert_eq!(s.code_type(), 1);
        assert!(s.dnr());
        assert!(!s.is_success());
        assert_eq!(s.base(), Status::CONNECT_INVALID_HOST);
        assert!(Status::SUCCESS.is_success());
    }
}

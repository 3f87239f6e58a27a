//! The data pointer of a command (one SGL descriptor) checked against the data the
//! command moves (NVMe Base 2.0 §4.3.2, NVMe/TCP 1.0 §3.3.1).
//!
//! NVMe/TCP knows two descriptors: a Data Block with the Offset subtype for data in
//! the capsule, and a Transport Data Block for data moved by R2T/H2CData or C2HData.
//! Controller-to-host data never travels in a capsule. Identify Controller does not set
//! SGLS bit 16, so an SGL longer than the transfer is as wrong as a shorter one, except
//! where hosts are known to describe a larger buffer (Dataset Management).

use nvpool_wire::Status;
use nvpool_wire::command::{SglDescriptor, sgl};

use super::MAX_TRANSFER;

/// Which way a command's data moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the controller to the host (Read, Identify, Get Log Page).
    ToHost,
    /// From the host to the controller (Write, Dataset Management, Connect).
    FromHost,
}

/// How long the SGL must be for the command's transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Length {
    /// Exactly the transfer.
    Exactly(u64),
    /// At least the transfer (the command reads only what it needs).
    AtLeast(u64),
}

impl Length {
    fn transfer(self) -> u64 {
        match self {
            Length::Exactly(n) | Length::AtLeast(n) => n,
        }
    }
}

/// Where a command's host-to-controller data is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// In the capsule, from this offset of the in-capsule data.
    InCapsule {
        /// Offset into the capsule's data.
        offset: usize,
    },
    /// Sent later in H2CData PDUs (or, for controller-to-host data, in C2HData).
    Transport,
}

/// Checks `dptr` for a command that moves `length` bytes in `direction`, with
/// `in_capsule` bytes of data in its capsule; says where the data is.
///
/// The checks run in the order the causes are reported: a transfer over MDTS is an
/// invalid field whatever describes it, then the descriptor type, then its offset and
/// length.
pub fn check(dptr: &SglDescriptor, direction: Direction, length: Length, in_capsule: usize) -> Result<Source, Status> {
    let transfer = length.transfer();
    if transfer > MAX_TRANSFER as u64 {
        return Err(Status::INVALID_FIELD.with_dnr());
    }
    let source = match (dptr.id, direction) {
        (sgl::TRANSPORT, _) => Source::Transport,
        (sgl::IN_CAPSULE, Direction::FromHost) => {
            let offset = usize::try_from(dptr.address).unwrap_or(usize::MAX);
            if offset > in_capsule {
                return Err(Status::SGL_OFFSET_INVALID.with_dnr());
            }
            if ((in_capsule - offset) as u64) < transfer {
                return Err(Status::SGL_LENGTH_INVALID.with_dnr());
            }
            Source::InCapsule { offset }
        }
        _ => return Err(Status::SGL_TYPE_INVALID.with_dnr()),
    };
    let described = u64::from(dptr.length);
    let fits = match length {
        Length::Exactly(n) => described == n,
        Length::AtLeast(n) => described >= n,
    };
    if !fits {
        return Err(Status::SGL_LENGTH_INVALID.with_dnr());
    }
    Ok(source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dptr(id: u8, address: u64, length: u32) -> SglDescriptor {
        SglDescriptor { address, length, id }
    }

    fn base(r: Result<Source, Status>) -> Result<Source, Status> {
        r.map_err(|s| s.base())
    }

    #[test]
    fn transport_descriptors_must_describe_the_transfer() {
        let t = |len, want| check(&dptr(sgl::TRANSPORT, 0, len), Direction::ToHost, want, 0);
        assert_eq!(t(4096, Length::Exactly(4096)), Ok(Source::Transport));
        assert_eq!(base(t(512, Length::Exactly(4096))), Err(Status::SGL_LENGTH_INVALID));
        assert_eq!(base(t(8192, Length::Exactly(4096))), Err(Status::SGL_LENGTH_INVALID));
        assert_eq!(t(4096, Length::AtLeast(32)), Ok(Source::Transport));
        assert_eq!(base(t(16, Length::AtLeast(32))), Err(Status::SGL_LENGTH_INVALID));
    }

    #[test]
    fn transfers_over_mdts_are_invalid_whatever_describes_them() {
        let huge = 4 << 30;
        let r = check(&dptr(sgl::TRANSPORT, 0, u32::MAX), Direction::ToHost, Length::Exactly(huge), 0);
        assert_eq!(base(r), Err(Status::INVALID_FIELD));
        let r = check(&dptr(0x30, 0, 0), Direction::ToHost, Length::Exactly(MAX_TRANSFER as u64 + 4), 0);
        assert_eq!(base(r), Err(Status::INVALID_FIELD));
    }

    #[test]
    fn only_the_two_nvme_tcp_descriptors_are_accepted() {
        // Data Block with a reserved subtype, Bit Bucket, Segment, Last Segment, Keyed.
        for id in [0x00, 0x02, 0x0F, 0x10, 0x20, 0x30, 0x40, 0x4A, 0x50, 0x5B, 0xF0] {
            for direction in [Direction::ToHost, Direction::FromHost] {
                let r = check(&dptr(id, 0, 4096), direction, Length::Exactly(4096), 4096);
                assert_eq!(base(r), Err(Status::SGL_TYPE_INVALID), "id {id:#x} {direction:?}");
            }
        }
        // Data for the host cannot be in the capsule.
        let r = check(&dptr(sgl::IN_CAPSULE, 0, 4096), Direction::ToHost, Length::Exactly(4096), 0);
        assert_eq!(base(r), Err(Status::SGL_TYPE_INVALID));
    }

    #[test]
    fn in_capsule_data_must_be_in_the_capsule() {
        let c = |offset, len, have| {
            check(&dptr(sgl::IN_CAPSULE, offset, len), Direction::FromHost, Length::Exactly(512), have)
        };
        assert_eq!(c(0, 512, 512), Ok(Source::InCapsule { offset: 0 }));
        assert_eq!(c(16, 512, 528), Ok(Source::InCapsule { offset: 16 }));
        assert_eq!(base(c(0, 512, 256)), Err(Status::SGL_LENGTH_INVALID));
        assert_eq!(base(c(600, 512, 512)), Err(Status::SGL_OFFSET_INVALID));
        assert_eq!(base(c(u64::MAX, 512, 512)), Err(Status::SGL_OFFSET_INVALID));
        assert_eq!(base(c(0, 256, 512)), Err(Status::SGL_LENGTH_INVALID));
    }
}

//! Fuzzes the NVMe/TCP PDU parser.
//!
//! Input layout: byte 0 selects the negotiated digests (bit 0 header, bit 1 data);
//! bytes 1..3 (little endian) are the data limit in 4-byte units; the rest is the
//! received byte stream, parsed PDU after PDU as a receiver would.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvpool_wire::tcp::{self, DataLimits, Digests};

fuzz_target!(|input: &[u8]| {
    if input.len() < 3 {
        return;
    }
    let digests = Digests::from_bits(input[0]);
    let limit = u32::from(u16::from_le_bytes([input[1], input[2]])) * 4;
    let mut rest = &input[3..];
    while let Ok(Some(p)) = tcp::parse(rest, digests, DataLimits::uniform(limit)) {
        // A parsed PDU is never empty, never longer than what arrived, and never
        // carries more data than the limit allows.
        assert!(p.len > 0 && p.len <= rest.len());
        if let tcp::Pdu::CapsuleCmd { data, .. } | tcp::Pdu::H2CData { data, .. } | tcp::Pdu::C2HData { data, .. } = p.pdu {
            assert!(data.len() <= limit as usize);
        }
        rest = &rest[p.len..];
    }
});

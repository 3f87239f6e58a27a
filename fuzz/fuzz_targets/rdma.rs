//! Fuzzes what NVMe over RDMA reads from a host before any capsule: the private data
//! of a connection request (and of an accept or reject, as a host reads them), and a
//! command's Keyed SGL Data Block descriptor.
//!
//! What must hold: decoding never panics, and whatever decodes encodes back to the
//! same fields (a keyed descriptor to the same 16 bytes).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvpool_wire::rdma::{ConnectRequest, KeyedSgl, RejectReason, decode_accept, encode_accept};

fuzz_target!(|input: &[u8]| {
    if let Ok(request) = ConnectRequest::decode(input) {
        assert_eq!(ConnectRequest::decode(&request.encode()), Ok(request));
        let _ = request.check(u16::from(input.first().copied().unwrap_or(0)), 1024);
    }
    if let Some(reason) = RejectReason::decode(input) {
        assert_eq!(RejectReason::decode(&reason.encode()), Some(reason));
    }
    if let Some(entries) = decode_accept(input) {
        assert_eq!(decode_accept(&encode_accept(entries)), Some(entries));
    }
    if let Some(descriptor) = input.get(..16).and_then(|d| <&[u8; 16]>::try_from(d).ok()) {
        if let Some(keyed) = KeyedSgl::decode(descriptor) {
            assert_eq!(&keyed.encode(), descriptor);
        }
    }
});

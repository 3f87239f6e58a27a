//! Identify data structures (NVMe Base 2.0 §5.17.2, NVM Command Set 1.0 §4.1.5).

use crate::bytes::layout;

/// Size of every Identify data structure.
pub const IDENTIFY_SIZE: usize = 4096;

/// Controller or Namespace Structure values (CDW10 bits 7:0).
pub mod cns {
    /// Identify Namespace for the NSID.
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller.
    pub const CONTROLLER: u8 = 0x01;
    /// Active namespace ID list.
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
    /// Namespace Identification Descriptor list.
    pub const NS_DESCRIPTORS: u8 = 0x03;
    /// I/O Command Set specific Identify Namespace.
    pub const CSI_NAMESPACE: u8 = 0x05;
    /// I/O Command Set specific Identify Controller.
    pub const CSI_CONTROLLER: u8 = 0x06;
    /// I/O Command Set independent Identify Namespace.
    pub const CS_INDEPENDENT_NAMESPACE: u8 = 0x08;
}

/// Command Set Identifier of the NVM command set.
pub const CSI_NVM: u8 = 0;

layout! {
    /// Identify Controller data structure (NVMe Base 2.0 Figure 275, NVMe-oF 1.1
    /// Figure 28 for the fabrics fields at 1792).
    pub struct IdentifyController[4096] {
        /// PCI vendor ID.
        vid: u16 = 0,
        /// PCI subsystem vendor ID.
        ssvid: u16 = 2,
        /// Serial number (ASCII, space padded).
        sn: [u8; 20] = 4,
        /// Model number (ASCII, space padded).
        mn: [u8; 40] = 24,
        /// Firmware revision (ASCII, space padded).
        fr: [u8; 8] = 64,
        /// Recommended arbitration burst.
        rab: u8 = 72,
        /// IEEE OUI identifier.
        ieee: [u8; 3] = 73,
        /// Controller multi-path I/O and namespace sharing capabilities.
        cmic: u8 = 76,
        /// Maximum data transfer size, a power of two in units of 4 KiB pages.
        mdts: u8 = 77,
        /// Controller ID.
        cntlid: u16 = 78,
        /// Version.
        ver: u32 = 80,
        /// Optional asynchronous events supported.
        oaes: u32 = 92,
        /// Controller attributes.
        ctratt: u32 = 96,
        /// Controller type: 1 I/O, 2 discovery, 3 administrative.
        cntrltype: u8 = 111,
        /// Optional admin command support.
        oacs: u16 = 256,
        /// Abort command limit, 0's based.
        acl: u8 = 258,
        /// Asynchronous event request limit, 0's based.
        aerl: u8 = 259,
        /// Firmware updates.
        frmw: u8 = 260,
        /// Log page attributes.
        lpa: u8 = 261,
        /// Error log page entries, 0's based.
        elpe: u8 = 262,
        /// Keep Alive support: granularity in 100 ms units.
        kas: u16 = 320,
        /// ANA transition time in seconds.
        anatt: u8 = 342,
        /// ANA capabilities.
        anacap: u8 = 343,
        /// ANA group identifier maximum.
        anagrpmax: u32 = 344,
        /// Number of ANA group identifiers.
        nanagrpid: u32 = 348,
        /// Submission queue entry size (required and maximum, log2).
        sqes: u8 = 512,
        /// Completion queue entry size (required and maximum, log2).
        cqes: u8 = 513,
        /// Maximum outstanding commands.
        maxcmd: u16 = 514,
        /// Number of namespaces (highest valid NSID).
        nn: u32 = 516,
        /// Optional NVM command support.
        oncs: u16 = 520,
        /// Fused operation support.
        fuses: u16 = 522,
        /// Format NVM attributes.
        fna: u8 = 524,
        /// Volatile write cache.
        vwc: u8 = 525,
        /// Atomic write unit normal.
        awun: u16 = 526,
        /// Atomic write unit power fail.
        awupf: u16 = 528,
        /// SGL support.
        sgls: u32 = 536,
        /// Maximum number of allowed namespaces.
        mnan: u32 = 540,
        /// NVM subsystem NQN.
        subnqn: [u8; 256] = 768,
        /// I/O queue command capsule supported size, in 16-byte units.
        ioccsz: u32 = 1792,
        /// I/O queue response capsule supported size, in 16-byte units.
        iorcsz: u32 = 1796,
        /// In-capsule data offset, in 16-byte units.
        icdoff: u16 = 1800,
        /// Fabrics controller attributes.
        fcatt: u8 = 1802,
        /// Maximum SGL data block descriptors.
        msdbd: u8 = 1803,
        /// Optional fabric commands supported.
        ofcs: u16 = 1804,
    }
}

/// CMIC bit 0: the subsystem may have more than one port.
pub const CMIC_MULTI_PORT: u8 = 1;
/// CMIC bit 1: the subsystem may have more than one controller.
pub const CMIC_MULTI_CONTROLLER: u8 = 1 << 1;
/// CMIC bit 3: ANA reporting.
pub const CMIC_ANA: u8 = 1 << 3;
/// ANACAP bits 4:0: the ANA states a controller may report (optimized, non-optimized,
/// inaccessible, persistent loss, change).
pub const ANACAP_ALL_STATES: u8 = 0x1F;
/// ANACAP bit 6: a namespace's ANAGRPID does not change while it is attached.
pub const ANACAP_FIXED_GROUP_ID: u8 = 1 << 6;
/// OAES bit 8: Namespace Attribute Notices.
pub const OAES_NS_ATTRIBUTE: u32 = 1 << 8;
/// OAES bit 11: ANA change notices.
pub const OAES_ANA_CHANGE: u32 = 1 << 11;
/// OAES bit 31: Discovery Log Page change notices.
pub const OAES_DISCOVERY_CHANGE: u32 = 1 << 31;
/// ONCS bit 2: Dataset Management.
pub const ONCS_DSM: u16 = 1 << 2;
/// ONCS bit 3: Write Zeroes.
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;
/// CTRATT bit 0: 128-bit Host Identifiers.
pub const CTRATT_HOST_ID_128: u32 = 1;
/// ONCS bit 5: the reservation commands.
pub const ONCS_RESERVATIONS: u16 = 1 << 5;
/// VWC bit 0: a volatile write cache is present.
pub const VWC_PRESENT: u8 = 1;
/// VWC bits 2:1 = 10b: Flush with NSID FFFFFFFFh is not supported.
pub const VWC_NO_BROADCAST_FLUSH: u8 = 0b10 << 1;
/// LPA bit 1: the Commands Supported and Effects log page is supported.
pub const LPA_COMMAND_EFFECTS: u8 = 1 << 1;
/// LPA bit 2: extended data for Get Log Page (offsets, 32-bit NUMD).
pub const LPA_EXTENDED_DATA: u8 = 1 << 2;
/// SGLS bits 1:0 = 01b: SGLs supported, no alignment requirement.
pub const SGLS_SUPPORTED: u32 = 1;
/// SGLS bit 2: Keyed SGL Data Block descriptors supported (NVMe over RDMA; the Linux
/// host refuses an RDMA controller without it).
pub const SGLS_KEYED: u32 = 1 << 2;
/// SGLS bit 20: SGL offsets supported (needed for in-capsule data).
pub const SGLS_OFFSET: u32 = 1 << 20;
/// Controller type: I/O controller.
pub const CNTRLTYPE_IO: u8 = 1;
/// Controller type: discovery controller.
pub const CNTRLTYPE_DISCOVERY: u8 = 2;

layout! {
    /// One LBA format (NVMe Base 2.0 Figure 280 bytes 128+).
    pub struct LbaFormat[4] {
        /// Metadata size.
        ms: u16 = 0,
        /// LBA data size, log2.
        lbads: u8 = 2,
        /// Relative performance.
        rp: u8 = 3,
    }
}

layout! {
    /// Identify Namespace data structure for the NVM command set (NVM Command Set 1.0
    /// Figure 97). nvpool reports one LBA format.
    pub struct IdentifyNamespace[4096] {
        /// Namespace size in logical blocks.
        nsze: u64 = 0,
        /// Namespace capacity in logical blocks.
        ncap: u64 = 8,
        /// Namespace utilization in logical blocks.
        nuse: u64 = 16,
        /// Namespace features.
        nsfeat: u8 = 24,
        /// Number of LBA formats, 0's based.
        nlbaf: u8 = 25,
        /// Formatted LBA size: the index of the format in use.
        flbas: u8 = 26,
        /// Namespace multi-path I/O and sharing capabilities.
        nmic: u8 = 30,
        /// Reservation capabilities.
        rescap: u8 = 31,
        /// Deallocate logical block features.
        dlfeat: u8 = 33,
        /// Namespace optimal I/O boundary in logical blocks.
        noiob: u16 = 46,
        /// ANA group identifier.
        anagrpid: u32 = 92,
        /// Namespace attributes.
        nsattr: u8 = 99,
        /// Namespace globally unique identifier.
        nguid: [u8; 16] = 104,
        /// IEEE extended unique identifier.
        eui64: [u8; 8] = 120,
        /// LBA format 0 (ms, lbads, rp packed as one dword).
        lbaf0: u32 = 128,
    }
}

/// RESCAP: every reservation type (bits 1 to 6) and Ignore Existing Key as NVMe 1.3
/// and later define it (bit 7); not Persist Through Power Loss (bit 0).
pub const RESCAP_ALL_TYPES: u8 = 0b1111_1110;
/// NMIC bit 0: the namespace may be attached to more than one controller.
pub const NMIC_SHARED: u8 = 1;
/// NSFEAT bit 0: thin provisioning (NCAP and NUSE may be less than NSZE).
pub const NSFEAT_THIN: u8 = 1;
/// DLFEAT: deallocated blocks read as zeroes (bits 2:0 = 001b) and Write Zeroes may
/// deallocate (bit 3).
pub const DLFEAT_READS_ZEROES: u8 = 0b1001;

/// Packs an LBA format dword from the block size in bytes (a power of two).
pub fn lba_format(block_size: u32) -> u32 {
    u32::from(block_size.trailing_zeros() as u8) << 16
}

/// The block size described by an LBA format dword.
pub fn lba_format_block_size(lbaf: u32) -> u32 {
    1u32 << ((lbaf >> 16) & 0xFF).min(31)
}

layout! {
    /// I/O Command Set specific Identify Controller for the NVM command set (NVM
    /// Command Set 1.0 Figure 98): limits outside MDTS.
    pub struct IdentifyNvmController[4096] {
        /// Verify size limit.
        vsl: u8 = 0,
        /// Write Zeroes size limit.
        wzsl: u8 = 1,
        /// Write Uncorrectable size limit.
        wusl: u8 = 2,
        /// Dataset Management ranges limit.
        dmrl: u8 = 3,
        /// Dataset Management range size limit in logical blocks.
        dmrsl: u32 = 4,
        /// Dataset Management size limit in logical blocks.
        dmsl: u64 = 8,
    }
}

layout! {
    /// I/O Command Set specific Identify Namespace for the NVM command set (NVM Command
    /// Set 1.0 Figure 99): protection and extended LBA formats.
    pub struct IdentifyNvmNamespace[4096] {
        /// Logical block storage tag mask.
        lbstm: u64 = 0,
        /// Protection information capabilities.
        pic: u8 = 8,
        /// Extended LBA format 0.
        elbaf0: u32 = 12,
    }
}

// Every Identify data structure is exactly 4 KiB (NVMe Base 2.0 §5.17.2).
const _: () = assert!(IdentifyController::SIZE == IDENTIFY_SIZE);
const _: () = assert!(IdentifyNamespace::SIZE == IDENTIFY_SIZE);
const _: () = assert!(IdentifyNvmController::SIZE == IDENTIFY_SIZE);
const _: () = assert!(IdentifyNvmNamespace::SIZE == IDENTIFY_SIZE);

/// Namespace Identifier Types of the descriptor list (NVMe Base 2.0 Figure 278).
pub mod nidt {
    /// IEEE extended unique identifier, 8 bytes.
    pub const EUI64: u8 = 1;
    /// Namespace globally unique identifier, 16 bytes.
    pub const NGUID: u8 = 2;
    /// Namespace UUID, 16 bytes.
    pub const UUID: u8 = 3;
    /// Command set identifier, 1 byte.
    pub const CSI: u8 = 4;
}

/// One entry of the Namespace Identification Descriptor list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NsDescriptor {
    /// Identifier type (see [`nidt`]).
    pub nidt: u8,
    /// The identifier.
    pub nid: Vec<u8>,
}

/// Encodes a Namespace Identification Descriptor list into a 4 KiB buffer.
pub fn encode_ns_descriptors(descs: &[NsDescriptor], b: &mut [u8]) {
    b[..IDENTIFY_SIZE].fill(0);
    let mut off = 0;
    for d in descs {
        let end = off + 4 + d.nid.len();
        if end > IDENTIFY_SIZE {
            break;
        }
        b[off] = d.nidt;
        b[off + 1] = d.nid.len() as u8;
        b[off + 4..end].copy_from_slice(&d.nid);
        off = end;
    }
}

/// Decodes a Namespace Identification Descriptor list; stops at the first zero type or
/// at a descriptor that would run past the buffer.
pub fn decode_ns_descriptors(b: &[u8]) -> Vec<NsDescriptor> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 4 <= b.len() {
        let (nidt, len) = (b[off], usize::from(b[off + 1]));
        if nidt == 0 || off + 4 + len > b.len() {
            break;
        }
        out.push(NsDescriptor { nidt, nid: b[off + 4..off + 4 + len].to_vec() });
        off += 4 + len;
    }
    out
}

/// Encodes an active namespace ID list: up to 1024 NSIDs greater than `after`, in
/// increasing order, zero terminated.
pub fn encode_ns_list(nsids: impl IntoIterator<Item = u32>, after: u32, b: &mut [u8]) {
    b[..IDENTIFY_SIZE].fill(0);
    let mut ids: Vec<u32> = nsids.into_iter().filter(|&n| n > after).collect();
    ids.sort_unstable();
    for (i, id) in ids.into_iter().take(IDENTIFY_SIZE / 4).enumerate() {
        b[i * 4..i * 4 + 4].copy_from_slice(&id.to_le_bytes());
    }
}

/// Decodes an active namespace ID list.
pub fn decode_ns_list(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).take_while(|&id| id != 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // Any bytes decode; what decodes encodes back to the same structure.
        #[test]
        fn identify_controller_round_trips(raw in proptest::collection::vec(any::<u8>(), 4096)) {
            let id = IdentifyController::decode(&raw).unwrap();
            prop_assert_eq!(IdentifyController::decode(&id.to_vec()).unwrap(), id);
        }

        #[test]
        fn identify_namespace_round_trips(raw in proptest::collection::vec(any::<u8>(), 4096)) {
            let id = IdentifyNamespace::decode(&raw).unwrap();
            prop_assert_eq!(IdentifyNamespace::decode(&id.to_vec()).unwrap(), id);
        }

        #[test]
        fn nvm_controller_round_trips(raw in proptest::collection::vec(any::<u8>(), 4096)) {
            let id = IdentifyNvmController::decode(&raw).unwrap();
            prop_assert_eq!(IdentifyNvmController::decode(&id.to_vec()).unwrap(), id);
        }

        #[test]
        fn nvm_namespace_round_trips(raw in proptest::collection::vec(any::<u8>(), 4096)) {
            let id = IdentifyNvmNamespace::decode(&raw).unwrap();
            prop_assert_eq!(IdentifyNvmNamespace::decode(&id.to_vec()).unwrap(), id);
        }

        #[test]
        fn ns_descriptors_round_trip(nguid: [u8; 16], uuid: [u8; 16], eui: [u8; 8]) {
            let d = vec![
                NsDescriptor { nidt: nidt::EUI64, nid: eui.to_vec() },
                NsDescriptor { nidt: nidt::NGUID, nid: nguid.to_vec() },
                NsDescriptor { nidt: nidt::UUID, nid: uuid.to_vec() },
                NsDescriptor { nidt: nidt::CSI, nid: vec![CSI_NVM] },
            ];
            let mut b = [0u8; IDENTIFY_SIZE];
            encode_ns_descriptors(&d, &mut b);
            prop_assert_eq!(decode_ns_descriptors(&b), d);
        }

        #[test]
        fn ns_list_round_trips(mut ids in proptest::collection::btree_set(1u32.., 0..50)) {
            let mut b = [0u8; IDENTIFY_SIZE];
            encode_ns_list(ids.iter().copied(), 0, &mut b);
            let v: Vec<u32> = std::mem::take(&mut ids).into_iter().collect();
            prop_assert_eq!(decode_ns_list(&b), v);
        }
    }

    #[test]
    fn offsets_match_the_spec() {
        let id = IdentifyController { cntlid: 0x1234, ioccsz: 4, kas: 1, ..Default::default() };
        let b = id.to_vec();
        assert_eq!(&b[78..80], &[0x34, 0x12]);
        assert_eq!(b[1792], 4);
        assert_eq!(b[320], 1);
        assert_eq!(lba_format_block_size(lba_format(4096)), 4096);
        assert_eq!(lba_format(512) >> 16, 9);
    }

    #[test]
    fn ns_list_skips_ids_not_above_start() {
        let mut b = [0u8; IDENTIFY_SIZE];
        encode_ns_list([5, 1, 3], 1, &mut b);
        assert_eq!(decode_ns_list(&b), vec![3, 5]);
    }
}

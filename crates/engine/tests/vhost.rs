//! vhost-user-blk through the protocol, with a frontend written here on the `vhost`
//! crate's frontend side in place of QEMU: guest memory is a shared file, the rings
//! and requests are written into it by hand. What QEMU itself does with the device is
//! `tests/kernel/vhost-e2e`; this covers what a QEMU run cannot show on demand: the
//! requests a previous engine process left inflight are served again (once), bad
//! chains are answered without harm, and removal ends the session.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvpool_engine::config::{EngineConfig, NamespaceConfig, SubsystemConfig};
use nvpool_engine::error::Error;
use nvpool_engine::{Engine, mgmt};
use serde_json::{Value, json};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserInflight, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

const NQN: &str = "nqn.2024-01.io.nvpool:vhost";
const MEMORY: usize = 4 << 20;
/// Where the frontend says guest memory is in its own address space.
const FRONTEND_BASE: u64 = 0x7f00_0000_0000;
const QUEUE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;
/// Each request slot: header at the start, status byte after it, data at +4 KiB.
const SLOTS: u64 = 0x10_0000;
const SLOT_BYTES: u64 = 0x2_0000;

const IN: u32 = 0;
const OUT: u32 = 1;
const FLUSH: u32 = 4;
const GET_ID: u32 = 8;
const DISCARD: u32 = 11;
const WRITE_ZEROES: u32 = 13;
const NEXT: u16 = 1;
const WRITE: u16 = 2;

fn engine() -> Arc<Engine> {
    let namespace = NamespaceConfig {
        nsid: Some(1),
        backend: "memory:16MiB".into(),
        block_size: 512,
        uuid: None,
        allow_torn_writes: false,
        ana_group: None,
        qos: Default::default(),
    };
    let subsystem = SubsystemConfig {
        nqn: NQN.into(),
        serial: None,
        model: "nvpool".into(),
        allow_any_host: true,
        hosts: vec![],
        dhchap: vec![],
        tls_psk: vec![],
        namespaces: vec![namespace],
    };
    Engine::start(&EngineConfig { reactors: Some(2), subsystems: vec![subsystem], ..EngineConfig::default() })
        .expect("engine starts")
}

fn call(engine: &Arc<Engine>, method: &str, params: Value) -> Result<Value, Error> {
    mgmt::handle(engine, &json!({ "method": method, "params": params }).to_string())
}

/// The guest's memory, shared with the engine through a file.
struct Guest {
    file: File,
    memory: GuestMemoryMmap,
    next_avail: u16,
}

impl Guest {
    fn new() -> Guest {
        let file = tempfile::tempfile_in("/dev/shm").or_else(|_| tempfile::tempfile()).unwrap();
        file.set_len(MEMORY as u64).unwrap();
        let map = MmapRegion::from_file(FileOffset::new(file.try_clone().unwrap(), 0), MEMORY).unwrap();
        let memory = GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(map, GuestAddress(0)).unwrap()]).unwrap();
        Guest { file, memory, next_avail: 0 }
    }

    fn descriptor(&self, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = GuestAddress(DESC + 16 * u64::from(index));
        let mut d = [0u8; 16];
        d[0..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.memory.write_slice(&d, at).unwrap();
    }

    /// Writes request `kind` at `sector` into slot `slot` (descriptors 3 slot to
    /// 3 slot + 2): header, `data` bytes (written by the device if `device_writes`),
    /// status. Returns the chain's head.
    fn request(&self, slot: u16, kind: u32, sector: u64, data: u32, device_writes: bool) -> u16 {
        let base = SLOTS + SLOT_BYTES * u64::from(slot);
        let mut header = [0u8; 16];
        header[0..4].copy_from_slice(&kind.to_le_bytes());
        header[8..16].copy_from_slice(&sector.to_le_bytes());
        self.memory.write_slice(&header, GuestAddress(base)).unwrap();
        self.memory.write_obj(0xFFu8, GuestAddress(base + 16)).unwrap();
        let head = 3 * slot;
        self.descriptor(head, base, 16, NEXT, head + 1);
        let data_flags = NEXT | if device_writes { WRITE } else { 0 };
        self.descriptor(head + 1, base + 0x1000, data, data_flags, head + 2);
        self.descriptor(head + 2, base + 16, 1, WRITE, 0);
        head
    }

    fn data(&self, slot: u16, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.memory.read_slice(&mut v, GuestAddress(SLOTS + SLOT_BYTES * u64::from(slot) + 0x1000)).unwrap();
        v
    }

    fn fill(&self, slot: u16, bytes: &[u8]) {
        self.memory.write_slice(bytes, GuestAddress(SLOTS + SLOT_BYTES * u64::from(slot) + 0x1000)).unwrap();
    }

    fn status(&self, slot: u16) -> u8 {
        self.memory.read_obj(GuestAddress(SLOTS + SLOT_BYTES * u64::from(slot) + 16)).unwrap()
    }

    /// Makes `head` available.
    fn offer(&mut self, head: u16) {
        let at = AVAIL + 4 + 2 * u64::from(self.next_avail % QUEUE);
        self.memory.write_obj(head, GuestAddress(at)).unwrap();
        self.next_avail = self.next_avail.wrapping_add(1);
        self.memory.write_obj(self.next_avail, GuestAddress(AVAIL + 2)).unwrap();
    }

    fn used_idx(&self) -> u16 {
        self.memory.read_obj(GuestAddress(USED + 2)).unwrap()
    }

    /// The (head, length) of used entry `n`.
    fn used(&self, n: u16) -> (u32, u32) {
        let at = USED + 4 + 8 * u64::from(n % QUEUE);
        (self.memory.read_obj(GuestAddress(at)).unwrap(), self.memory.read_obj(GuestAddress(at + 4)).unwrap())
    }

    fn wait_used(&self, count: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.used_idx() != count {
            assert!(Instant::now() < deadline, "used index {} never reached {count}", self.used_idx());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A connected frontend with one virtqueue running.
struct Session {
    frontend: Frontend,
    kick: EventFd,
    call: EventFd,
}

/// Connects and sets the device up as QEMU does; `inflight` is the region from an
/// earlier session (QEMU keeps it across reconnections), or `None` to get a new one.
fn connect(
    socket: &Path,
    guest: &Guest,
    base: u16,
    inflight: Option<&(VhostUserInflight, File)>,
) -> (Session, (VhostUserInflight, File)) {
    let mut frontend = Frontend::connect(socket, 1).expect("connects");
    frontend.set_owner().unwrap();
    let features = frontend.get_features().unwrap();
    assert_ne!(features & (1 << 32), 0, "VERSION_1");
    frontend.set_features(features).unwrap();
    let protocol = frontend.get_protocol_features().unwrap();
    assert!(protocol.contains(VhostUserProtocolFeatures::INFLIGHT_SHMFD | VhostUserProtocolFeatures::CONFIG));
    frontend.set_protocol_features(protocol).unwrap();
    let region = match inflight {
        Some((info, file)) => (*info, file.try_clone().unwrap()),
        None => frontend.get_inflight_fd(&VhostUserInflight::new(0, 0, 1, QUEUE)).expect("inflight region"),
    };
    frontend.set_inflight_fd(&region.0, region.1.as_raw_fd()).unwrap();
    let info = VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MEMORY as u64,
        userspace_addr: FRONTEND_BASE,
        mmap_offset: 0,
        mmap_handle: guest.file.as_raw_fd(),
    };
    frontend.set_mem_table(&[info]).unwrap();
    frontend.set_vring_num(0, QUEUE).unwrap();
    frontend.set_vring_base(0, base).unwrap();
    let rings = VringConfigData {
        queue_max_size: QUEUE,
        queue_size: QUEUE,
        flags: 0,
        desc_table_addr: FRONTEND_BASE + DESC,
        used_ring_addr: FRONTEND_BASE + USED,
        avail_ring_addr: FRONTEND_BASE + AVAIL,
        log_addr: None,
    };
    frontend.set_vring_addr(0, &rings).unwrap();
    let kick = EventFd::new(EFD_NONBLOCK).unwrap();
    let call = EventFd::new(EFD_NONBLOCK).unwrap();
    frontend.set_vring_kick(0, &kick).unwrap();
    frontend.set_vring_call(0, &call).unwrap();
    frontend.set_vring_enable(0, true).unwrap();
    (Session { frontend, kick, call }, region)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn a_frontend_reads_and_writes_and_bad_requests_do_no_harm() {
    let engine = engine();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("blk.sock");
    let added = call(
        &engine,
        "local_add",
        json!({ "device": { "target": format!("{NQN}/1"),
        "vhost_user_blk": socket.to_str().unwrap() } }),
    )
    .expect("added");
    assert_eq!(added["device"]["kind"], "vhost-user-blk");
    let mut guest = Guest::new();
    let (mut s, _region) = connect(&socket, &guest, 0, None);

    let config = s.frontend.get_config(0, 60, VhostUserConfigFlags::WRITABLE, &[0u8; 60]).unwrap().1;
    assert_eq!(u64::from_le_bytes(config[0..8].try_into().unwrap()), 32768, "capacity: 16 MiB in sectors");

    // A write, then a read of the same blocks.
    let data = pattern(7, 8192);
    guest.fill(0, &data);
    let head = guest.request(0, OUT, 64, 8192, false);
    guest.offer(head);
    s.kick.write(1).unwrap();
    guest.wait_used(1);
    assert_eq!((guest.status(0), guest.used(0)), (0, (u32::from(head), 1)));
    assert!(s.call.read().is_ok(), "the guest was signalled");
    let head = guest.request(1, IN, 64, 8192, true);
    guest.offer(head);
    s.kick.write(1).unwrap();
    guest.wait_used(2);
    assert_eq!((guest.status(1), guest.used(1)), (0, (u32::from(head), 8193)));
    assert_eq!(guest.data(1, 8192), data);

    // Write zeroes and discard name their range in a segment the device reads; both
    // leave zeroes (a memory namespace deallocates by zeroing).
    for (kind, sector, done) in [(WRITE_ZEROES, 64u64, 3), (DISCARD, 72, 4)] {
        let mut segment = [0u8; 16];
        segment[0..8].copy_from_slice(&sector.to_le_bytes());
        segment[8..12].copy_from_slice(&8u32.to_le_bytes());
        guest.fill(2, &segment);
        let head = guest.request(2, kind, 0, 16, false);
        guest.offer(head);
        s.kick.write(1).unwrap();
        guest.wait_used(done);
        assert_eq!(guest.status(2), 0, "request type {kind}");
    }
    let head = guest.request(1, IN, 64, 8192, true);
    guest.offer(head);
    s.kick.write(1).unwrap();
    guest.wait_used(5);
    assert_eq!(guest.data(1, 8192), vec![0u8; 8192], "zeroed and discarded blocks read back as zeroes");
    let head = guest.request(1, FLUSH, 0, 0, false);
    guest.descriptor(head + 1, SLOTS + SLOT_BYTES + 16, 1, WRITE, 0); // header, status
    guest.descriptor(head, SLOTS + SLOT_BYTES, 16, NEXT, head + 1);
    guest.offer(head);
    s.kick.write(1).unwrap();
    guest.wait_used(6);
    assert_eq!(guest.status(1), 0, "flush");

    // The serial, a read past the end, an unknown type, and a chain with no status.
    let head = guest.request(2, GET_ID, 0, 20, true);
    guest.offer(head);
    let past_end = guest.request(3, IN, 32768, 512, true);
    guest.offer(past_end);
    let unknown = guest.request(4, 77, 0, 512, true);
    guest.offer(unknown);
    s.kick.write(1).unwrap();
    guest.wait_used(9);
    assert_eq!(guest.status(2), 0);
    assert!(String::from_utf8_lossy(&guest.data(2, 20)).ends_with("vhost/1"));
    assert_eq!((guest.status(3), guest.status(4)), (2, 2), "UNSUPP");
    guest.descriptor(15, SLOTS, 16, 0, 0); // a header alone
    guest.offer(15);
    s.kick.write(1).unwrap();
    guest.wait_used(10);
    assert_eq!(guest.used(9), (15, 0));

    // Stopping the ring reports where it stopped.
    assert_eq!(s.frontend.get_vring_base(0).unwrap(), 10);
    // A later request still works after the ring is set up again.
    s.frontend.set_vring_base(0, 10).unwrap();
    s.frontend.set_vring_kick(0, &s.kick).unwrap();
    s.frontend.set_vring_enable(0, true).unwrap();
    let head = guest.request(0, IN, 64, 512, true);
    guest.offer(head);
    s.kick.write(1).unwrap();
    guest.wait_used(11);
    assert_eq!((guest.status(0), guest.data(0, 512)), (0, vec![0u8; 512]));

    // Removal ends the session and removes the socket.
    call(&engine, "local_remove", json!({ "socket": socket.to_str().unwrap() })).expect("removed");
    assert!(!socket.exists());
    assert!(s.frontend.get_features().is_err(), "the session ended");
    engine.stop();
}

#[test]
fn requests_a_previous_process_left_inflight_are_served_again_once() {
    let engine = engine();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("blk.sock");
    let device = json!({ "device": { "target": format!("{NQN}/1"), "vhost_user_blk": socket.to_str().unwrap() } });
    call(&engine, "local_add", device.clone()).expect("added");
    let mut guest = Guest::new();
    let (s, region) = connect(&socket, &guest, 0, None);
    let head = guest.request(0, OUT, 0, 4096, false);
    guest.fill(0, &pattern(1, 4096));
    guest.offer(head);
    s.kick.write(1).unwrap();
    guest.wait_used(1);
    drop(s);

    // As if a process had taken slot 1's write and died before completing it: the
    // request is in the available ring (at the used index) and recorded inflight.
    let head = guest.request(1, OUT, 8, 4096, false);
    guest.fill(1, &pattern(2, 4096));
    guest.offer(head);
    let inflight = MmapRegion::<()>::from_file(FileOffset::new(region.1.try_clone().unwrap(), 0), 4096).unwrap();
    let inflight =
        GuestMemoryMmap::from_regions(vec![GuestRegionMmap::new(inflight, GuestAddress(0)).unwrap()]).unwrap();
    let desc = 16 + 16 * u64::from(head);
    inflight.write_obj(1u8, GuestAddress(desc)).unwrap();
    inflight.write_obj(100u64, GuestAddress(desc + 8)).unwrap();
    // The engine restarts with the device; QEMU reconnects with the region it kept and
    // the used index as the base (it could not ask the dead process).
    call(&engine, "local_remove", json!({ "socket": socket.to_str().unwrap() })).unwrap();
    call(&engine, "local_add", device).unwrap();
    let (s, _) = connect(&socket, &guest, guest.used_idx(), Some(&region));
    guest.wait_used(2);
    assert_eq!((guest.status(1), guest.used(1).0), (0, u32::from(head)));
    // Nothing is served twice: the next request is the next used entry.
    let read = guest.request(2, IN, 8, 4096, true);
    guest.offer(read);
    s.kick.write(1).unwrap();
    guest.wait_used(3);
    assert_eq!(guest.data(2, 4096), pattern(2, 4096), "the resubmitted write landed");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(guest.used_idx(), 3);
    assert_eq!(inflight.read_obj::<u8>(GuestAddress(desc)).unwrap(), 0, "no longer inflight");
    engine.stop();
    assert!(!socket.exists(), "a stopped engine removes its sockets");
}

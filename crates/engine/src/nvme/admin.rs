//! Admin commands (NVMe Base 2.0 §5): Identify, Get Log Page, Set/Get Features,
//! Asynchronous Event Request, Keep Alive, Abort, and the fabrics Property commands.

use nvpool_wire::Status;
use nvpool_wire::bytes::{ascii, nul};
use nvpool_wire::command::{Command, admin_opcode, io_opcode};
use nvpool_wire::fabrics::fctype;
use nvpool_wire::identify::{
    self, IDENTIFY_SIZE, IdentifyController, IdentifyNamespace, IdentifyNvmController, NsDescriptor, cns, nidt,
};
use nvpool_wire::log::{
    self, EFFECT_LBCC, EFFECT_NCC, EFFECT_SUPPORTED, ErrorLogEntry, FwSlotLog, GetLogPage, SmartLog, feature, lid,
};
use nvpool_wire::reservation;

use super::ana::{ANA_TRANSITION_TIME_S, MAX_ANA_GROUP};
use super::data_pointer::{self, Direction, Length};
use super::{
    AER_LIMIT, Controller, IO_IN_CAPSULE_DATA, KEEP_ALIVE_GRANULARITY, MAX_NSID, MDTS, Namespace, Target, Transport,
    discovery, fabrics,
};

/// Firmware revision reported in Identify and the firmware slot log (8 characters:
/// longer versions are cut).
/// Error log entries the controller keeps, 0's based (one entry, always empty).
const ERROR_LOG_ENTRIES: u8 = 0;

/// What an admin command produced.
#[derive(Debug, PartialEq, Eq)]
pub enum AdminOutcome {
    /// Complete now with this status and DW0/DW1, sending `data` to the host first.
    Complete {
        /// Status.
        status: Status,
        /// CQE DW0 and DW1.
        result: u64,
        /// Controller-to-host data.
        data: Option<Vec<u8>>,
    },
    /// An Asynchronous Event Request: the transport keeps it until an event comes.
    ParkAsyncEvent,
}

fn done(status: Status) -> AdminOutcome {
    AdminOutcome::Complete { status, result: 0, data: None }
}

fn done_result(result: u64) -> AdminOutcome {
    AdminOutcome::Complete { status: Status::SUCCESS, result, data: None }
}

fn done_data(data: Vec<u8>) -> AdminOutcome {
    AdminOutcome::Complete { status: Status::SUCCESS, result: 0, data: Some(data) }
}

/// Handles one admin command for `ctrl`, with the host data it carried: whatever the
/// fabric, that data is all in before the command runs (in its capsule, or fetched
/// the way a write's is). `outstanding_aers` is how many Asynchronous Event Requests
/// the queue already holds.
pub fn handle(target: &Target, ctrl: &Controller, cmd: &Command, data: &[u8], outstanding_aers: usize) -> AdminOutcome {
    if cmd.opcode == admin_opcode::FABRICS {
        return match cmd.fctype() {
            fctype::PROPERTY_GET => match fabrics::property_get(target, ctrl, cmd) {
                Ok(v) => done_result(v),
                Err(s) => done(s),
            },
            fctype::PROPERTY_SET => done(fabrics::property_set(ctrl, cmd).err().unwrap_or(Status::SUCCESS)),
            // A second Connect on a connected queue is out of sequence.
            fctype::CONNECT => done(Status::COMMAND_SEQUENCE_ERROR.with_dnr()),
            _ => done(Status::INVALID_OPCODE.with_dnr()),
        };
    }
    // Before CC.EN only fabrics commands are allowed (NVMe-oF 1.1 §3.5).
    if !ctrl.ready() {
        return done(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
    }
    // The host's buffer is checked before the command runs: a refused Get Log Page
    // must not clear an event (RAE), and no page is built for a buffer it cannot fill.
    if let Some(len) = data_to_host(cmd)
        && let Err(status) = data_pointer::check(&cmd.dptr, Direction::ToHost, Length::Exactly(len), 0)
    {
        return done(status);
    }
    // No admin command served here takes host data (a handler for one would read
    // `data`); data sent with one that takes none is refused, as Linux nvmet does.
    if !data.is_empty() {
        return done(Status::SGL_LENGTH_INVALID.with_dnr());
    }
    let discovery = ctrl.subsystem.is_discovery();
    match cmd.opcode {
        admin_opcode::IDENTIFY => identify(target, ctrl, cmd),
        admin_opcode::GET_LOG_PAGE => get_log_page(target, ctrl, cmd),
        admin_opcode::KEEP_ALIVE => {
            ctrl.keep_alive(target.now_ms());
            done(Status::SUCCESS)
        }
        admin_opcode::ASYNC_EVENT_REQUEST => {
            if outstanding_aers >= AER_LIMIT {
                done(Status::AER_LIMIT_EXCEEDED.with_dnr())
            } else {
                AdminOutcome::ParkAsyncEvent
            }
        }
        admin_opcode::SET_FEATURES => set_features(target, ctrl, cmd),
        admin_opcode::GET_FEATURES => get_features(ctrl, cmd),
        // Abort is best effort (NVMe Base 2.0 §5.1): like Linux nvmet, nvpool lets every
        // command run to completion and answers "not aborted" (DW0 bit 0 set).
        admin_opcode::ABORT if !discovery => done_result(1),
        _ => done(Status::INVALID_OPCODE.with_dnr()),
    }
}

/// How many bytes an admin command sends to the host, for the commands that send any.
/// The data an outcome carries is exactly this long.
fn data_to_host(cmd: &Command) -> Option<u64> {
    match cmd.opcode {
        admin_opcode::IDENTIFY => Some(IDENTIFY_SIZE as u64),
        admin_opcode::GET_LOG_PAGE => Some(GetLogPage::from_command(cmd).len as u64),
        _ => None,
    }
}

fn identify(target: &Target, ctrl: &Controller, cmd: &Command) -> AdminOutcome {
    let which = (cmd.cdw10() & 0xFF) as u8;
    let csi = (cmd.cdw11() >> 24) as u8;
    let discovery = ctrl.subsystem.is_discovery();
    let namespaces = ctrl.subsystem.namespaces();
    match which {
        cns::CONTROLLER => done_data(identify_controller(target, ctrl).to_vec()),
        _ if discovery => done(Status::INVALID_FIELD.with_dnr()),
        cns::NAMESPACE => {
            if cmd.nsid == 0 || cmd.nsid > MAX_NSID {
                return done(Status::INVALID_NAMESPACE.with_dnr());
            }
            // An inactive but valid NSID returns zeroes (NVMe Base 2.0 §5.17.2.1).
            let data = namespaces.get(&cmd.nsid).map(|ns| identify_namespace(ns).to_vec());
            done_data(data.unwrap_or_else(|| vec![0; IDENTIFY_SIZE]))
        }
        cns::ACTIVE_NAMESPACES => {
            if cmd.nsid >= 0xFFFF_FFFE {
                return done(Status::INVALID_NAMESPACE.with_dnr());
            }
            let mut b = vec![0; IDENTIFY_SIZE];
            identify::encode_ns_list(namespaces.keys().copied(), cmd.nsid, &mut b);
            done_data(b)
        }
        cns::NS_DESCRIPTORS => match namespaces.get(&cmd.nsid) {
            Some(ns) => {
                let mut b = vec![0; IDENTIFY_SIZE];
                identify::encode_ns_descriptors(
                    &[
                        NsDescriptor { nidt: nidt::NGUID, nid: ns.nguid.to_vec() },
                        NsDescriptor { nidt: nidt::UUID, nid: ns.uuid.to_vec() },
                        NsDescriptor { nidt: nidt::CSI, nid: vec![identify::CSI_NVM] },
                    ],
                    &mut b,
                );
                done_data(b)
            }
            None => done(Status::INVALID_NAMESPACE.with_dnr()),
        },
        cns::CSI_CONTROLLER if csi == identify::CSI_NVM => {
            // No limits beyond MDTS for Write Zeroes and Dataset Management.
            done_data(IdentifyNvmController::default().to_vec())
        }
        cns::CSI_NAMESPACE if csi == identify::CSI_NVM => match namespaces.get(&cmd.nsid) {
            // No protection information and no extended LBA formats.
            Some(_) => done_data(identify::IdentifyNvmNamespace::default().to_vec()),
            None => done(Status::INVALID_NAMESPACE.with_dnr()),
        },
        _ => done(Status::INVALID_FIELD.with_dnr()),
    }
}

/// The Identify Controller structure for `ctrl`.
pub fn identify_controller(target: &Target, ctrl: &Controller) -> IdentifyController {
    let s = &ctrl.subsystem;
    let common = IdentifyController {
        sn: ascii(&s.serial),
        mn: ascii(&s.model),
        fr: ascii(crate::version::version()),
        mdts: MDTS,
        cntlid: ctrl.cntlid,
        ver: nvpool_wire::fabrics::VERSION_2_0,
        kas: KEEP_ALIVE_GRANULARITY,
        lpa: identify::LPA_EXTENDED_DATA,
        elpe: ERROR_LOG_ENTRIES,
        aerl: (AER_LIMIT - 1) as u8,
        sgls: identify::SGLS_SUPPORTED
            | identify::SGLS_OFFSET
            | if ctrl.transport == Transport::Rdma { identify::SGLS_KEYED } else { 0 },
        maxcmd: (target.limits.max_queue_depth) as u16,
        subnqn: nul(&s.nqn),
        ioccsz: ((64 + IO_IN_CAPSULE_DATA) / 16) as u32,
        iorcsz: 1,
        msdbd: 1,
        ..IdentifyController::default()
    };
    if s.is_discovery() {
        return IdentifyController {
            cntrltype: identify::CNTRLTYPE_DISCOVERY,
            oaes: identify::OAES_DISCOVERY_CHANGE,
            ..common
        };
    }
    IdentifyController {
        cntrltype: identify::CNTRLTYPE_IO,
        cmic: identify::CMIC_MULTI_PORT | identify::CMIC_MULTI_CONTROLLER | identify::CMIC_ANA,
        oaes: identify::OAES_NS_ATTRIBUTE | identify::OAES_ANA_CHANGE,
        acl: 3,
        // One read-only firmware slot.
        frmw: 0b11,
        lpa: identify::LPA_EXTENDED_DATA | identify::LPA_COMMAND_EFFECTS,
        sqes: 0x66,
        cqes: 0x44,
        nn: MAX_NSID,
        mnan: MAX_NSID,
        oncs: identify::ONCS_DSM | identify::ONCS_WRITE_ZEROES | identify::ONCS_RESERVATIONS,
        // Host Identifiers are 128 bits on a fabric: hosts ask for the extended
        // reservation report, the only one that can carry them.
        ctratt: identify::CTRATT_HOST_ID_128,
        vwc: identify::VWC_PRESENT | identify::VWC_NO_BROADCAST_FLUSH,
        anatt: ANA_TRANSITION_TIME_S,
        anacap: identify::ANACAP_ALL_STATES | identify::ANACAP_FIXED_GROUP_ID,
        anagrpmax: MAX_ANA_GROUP,
        nanagrpid: MAX_ANA_GROUP,
        // Disconnect of I/O queues is supported.
        ofcs: 1,
        ..common
    }
}

/// The Identify Namespace structure for `ns`.
pub fn identify_namespace(ns: &Namespace) -> IdentifyNamespace {
    IdentifyNamespace {
        nsze: ns.blocks,
        ncap: ns.blocks,
        nuse: ns.blocks,
        nsfeat: 0,
        nlbaf: 0,
        flbas: 0,
        nmic: identify::NMIC_SHARED,
        rescap: if ns.serves_reservations() { identify::RESCAP_ALL_TYPES } else { 0 },
        dlfeat: if ns.backend.deallocated_reads_zeroes() { identify::DLFEAT_READS_ZEROES } else { 0 },
        anagrpid: ns.ana_group,
        nguid: ns.nguid,
        lbaf0: identify::lba_format(ns.block_size()),
        ..IdentifyNamespace::default()
    }
}

fn get_log_page(target: &Target, ctrl: &Controller, cmd: &Command) -> AdminOutcome {
    let g = GetLogPage::from_command(cmd);
    let discovery = ctrl.subsystem.is_discovery();
    let page: Vec<u8> = match g.lid {
        lid::DISCOVERY if discovery => {
            ctrl.discovery_log_read(g.rae);
            discovery::log_page(target, &ctrl.hostnqn)
        }
        _ if discovery => return done(Status::INVALID_LOG_PAGE.with_dnr()),
        lid::ERROR => vec![0; ErrorLogEntry::SIZE * (usize::from(ERROR_LOG_ENTRIES) + 1)],
        lid::SMART => smart_log(ctrl).to_vec(),
        lid::FW_SLOT => FwSlotLog { afi: 1, frs1: ascii(crate::version::version()) }.to_vec(),
        lid::CHANGED_NS => {
            let mut b = vec![0; log::CHANGED_NS_SIZE];
            log::encode_changed_ns(&ctrl.read_changed_namespaces(g.rae), &mut b);
            b
        }
        lid::COMMAND_EFFECTS => command_effects(),
        // No notices are queued yet: the page says so (a count of 0).
        lid::RESERVATION_NOTIFICATION => vec![0; log::RESERVATION_NOTIFICATION_SIZE],
        lid::ANA => {
            ctrl.ana_log_read(g.rae);
            // LSP bit 0: Return Groups Only.
            ctrl.subsystem.ana_log_page(ctrl, g.lsp & 1 != 0)
        }
        _ => return done(Status::INVALID_LOG_PAGE.with_dnr()),
    };
    // An offset must be dword aligned and inside the page (NVMe Base 2.0 §5.16).
    if !g.offset.is_multiple_of(4) || g.offset > page.len() as u64 {
        return done(Status::INVALID_FIELD.with_dnr());
    }
    let start = g.offset as usize;
    let mut out = vec![0; g.len];
    let n = (page.len() - start).min(g.len);
    out[..n].copy_from_slice(&page[start..start + n]);
    done_data(out)
}

fn smart_log(ctrl: &Controller) -> SmartLog {
    let mut s = SmartLog { available_spare: 100, available_spare_threshold: 10, ..SmartLog::default() };
    for ns in ctrl.subsystem.namespaces().values() {
        let st = ns.stats.snapshot();
        // Data units are thousands of 512-byte units, rounded up.
        s.data_units_read += st.read_bytes.div_ceil(512_000);
        s.data_units_written += st.write_bytes.div_ceil(512_000);
        s.host_reads += st.reads;
        s.host_writes += st.writes;
    }
    s
}

fn command_effects() -> Vec<u8> {
    let admin = [
        admin_opcode::GET_LOG_PAGE,
        admin_opcode::IDENTIFY,
        admin_opcode::ABORT,
        admin_opcode::SET_FEATURES,
        admin_opcode::GET_FEATURES,
        admin_opcode::ASYNC_EVENT_REQUEST,
        admin_opcode::KEEP_ALIVE,
    ]
    .map(|op| (op, EFFECT_SUPPORTED));
    let io = [
        (io_opcode::FLUSH, EFFECT_SUPPORTED | EFFECT_LBCC),
        (io_opcode::WRITE, EFFECT_SUPPORTED | EFFECT_LBCC),
        (io_opcode::READ, EFFECT_SUPPORTED),
        (io_opcode::WRITE_ZEROES, EFFECT_SUPPORTED | EFFECT_LBCC),
        (io_opcode::DATASET_MANAGEMENT, EFFECT_SUPPORTED | EFFECT_LBCC | EFFECT_NCC),
        (reservation::opcode::REGISTER, EFFECT_SUPPORTED),
        (reservation::opcode::REPORT, EFFECT_SUPPORTED),
        (reservation::opcode::ACQUIRE, EFFECT_SUPPORTED),
        (reservation::opcode::RELEASE, EFFECT_SUPPORTED),
    ];
    let mut b = vec![0; log::COMMAND_EFFECTS_SIZE];
    log::encode_command_effects(&admin, &io, &mut b);
    b
}

fn set_features(target: &Target, ctrl: &Controller, cmd: &Command) -> AdminOutcome {
    let fid = (cmd.cdw10() & 0xFF) as u8;
    if cmd.cdw10() & (1 << 31) != 0 {
        return done(Status::FEATURE_NOT_SAVEABLE.with_dnr());
    }
    let v = cmd.cdw11();
    match fid {
        feature::NUMBER_OF_QUEUES if !ctrl.subsystem.is_discovery() => {
            // NSQR and NCQR are 0's based; 0xFFFF is invalid (NVMe Base 2.0 §5.27.1.7).
            let (nsqr, ncqr) = (v & 0xFFFF, v >> 16);
            if nsqr == 0xFFFF || ncqr == 0xFFFF {
                return done(Status::INVALID_FIELD.with_dnr());
            }
            // The count is set before any I/O queue exists (NVMe Base 2.0 §5.27.1.7).
            if ctrl.has_io_queues() {
                return done(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
            }
            let granted = ctrl.grant_io_queues(nsqr.min(ncqr) + 1) - 1;
            done_result(u64::from(granted | granted << 16))
        }
        feature::ASYNC_EVENT_CONFIG => {
            ctrl.set_async_event_config(v);
            done(Status::SUCCESS)
        }
        feature::KEEP_ALIVE_TIMER => {
            ctrl.set_kato_ms(v, target.now_ms());
            done(Status::SUCCESS)
        }
        // Persisting reservations through a power loss is not offered (RESCAP bit 0).
        feature::RESERVATION_PERSISTENCE if v & 1 != 0 => done(Status::INVALID_FIELD.with_dnr()),
        // Accepted: no notice is sent yet, so there is nothing to mask.
        feature::RESERVATION_PERSISTENCE | feature::RESERVATION_NOTIFICATION_MASK => done(Status::SUCCESS),
        // Accepted and ignored: these have no effect on a fabrics target.
        feature::ARBITRATION
        | feature::POWER_MANAGEMENT
        | feature::TEMPERATURE_THRESHOLD
        | feature::INTERRUPT_COALESCING
        | feature::VOLATILE_WRITE_CACHE => done(Status::SUCCESS),
        _ => done(Status::INVALID_FIELD.with_dnr()),
    }
}

fn get_features(ctrl: &Controller, cmd: &Command) -> AdminOutcome {
    let fid = (cmd.cdw10() & 0xFF) as u8;
    let value = match fid {
        feature::NUMBER_OF_QUEUES if !ctrl.subsystem.is_discovery() => {
            let g = ctrl.io_queues_granted() - 1;
            g | g << 16
        }
        feature::ASYNC_EVENT_CONFIG => ctrl.async_event_config(),
        feature::KEEP_ALIVE_TIMER => ctrl.kato_ms(),
        // The write cache is always on: writes are durable after Flush or with FUA.
        feature::VOLATILE_WRITE_CACHE => 1,
        // Over-temperature threshold 0x0157 (343 K) as controllers report by default.
        feature::TEMPERATURE_THRESHOLD => 0x0157,
        feature::ARBITRATION | feature::POWER_MANAGEMENT | feature::INTERRUPT_COALESCING => 0,
        feature::RESERVATION_NOTIFICATION_MASK | feature::RESERVATION_PERSISTENCE => 0,
        _ => return done(Status::INVALID_FIELD.with_dnr()),
    };
    done_result(u64::from(value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::null::Null;
    use crate::config::Limits;
    use crate::nvme::subsystem::{HostPolicy, Subsystem};
    use nvpool_wire::command::{SglDescriptor, sgl};
    use nvpool_wire::fabrics::{PropertyAccess, cc, property};
    use std::sync::Arc;

    fn setup() -> (Arc<Target>, Arc<Controller>) {
        let t = Target::new(Limits::default());
        let s = Subsystem::new(
            "nqn.2024-01.io.nvpool:t",
            "SN1",
            "nvpool",
            HostPolicy { allow_any: true, ..Default::default() },
        )
        .unwrap();
        s.add_namespace(Namespace::new(1, Arc::new(Null::new(1 << 30)), 4096, [1; 16], [2; 16]).unwrap()).unwrap();
        t.add_subsystem(s.clone()).unwrap();
        let a = crate::nvme::controller::Association {
            subsystem: s.clone(),
            hostnqn: "nqn.h".into(),
            hostid: [0; 16],
            kato_ms: 0,
            max_io_queues: 4,
            transport: Transport::Tcp,
        };
        let c = Arc::new(Controller::new(1, a, 0));
        s.attach_controller(&c);
        (t, c)
    }

    fn admin(opcode: u8, nsid: u32, cdw10: u32, cdw11: u32) -> Command {
        Command { opcode, nsid, cdw: [cdw10, cdw11, 0, 0, 0, 0], ..Command::default() }
    }

    /// Runs `cmd` as a host with a buffer of the right size for its data would send it.
    fn call(t: &Target, c: &Controller, cmd: &Command, aers: usize) -> AdminOutcome {
        let mut cmd = *cmd;
        if let Some(len) = data_to_host(&cmd) {
            cmd.dptr = SglDescriptor { address: 0, length: len as u32, id: sgl::TRANSPORT };
        }
        handle(t, c, &cmd, &[], aers)
    }

    fn data(o: AdminOutcome) -> Vec<u8> {
        match o {
            AdminOutcome::Complete { status, data: Some(d), .. } if status.is_success() => d,
            other => panic!("expected data, got {other:?}"),
        }
    }

    fn status(o: AdminOutcome) -> Status {
        match o {
            AdminOutcome::Complete { status, .. } => status.base(),
            AdminOutcome::ParkAsyncEvent => panic!("parked"),
        }
    }

    fn enable(t: &Target, c: &Controller) {
        let set =
            PropertyAccess { eight_bytes: false, offset: property::CC, value: u64::from(cc::EN | 6 << 16 | 4 << 20) };
        assert_eq!(status(call(t, c, &set.to_command(1, true), 0)), Status::SUCCESS);
    }

    #[test]
    fn commands_before_enable_are_out_of_sequence() {
        let (t, c) = setup();
        assert_eq!(status(call(&t, &c, &admin(admin_opcode::IDENTIFY, 0, 1, 0), 0)), Status::COMMAND_SEQUENCE_ERROR);
        enable(&t, &c);
        let id = IdentifyController::decode(&data(call(&t, &c, &admin(admin_opcode::IDENTIFY, 0, 1, 0), 0))).unwrap();
        assert_eq!(id.cntlid, 1);
        assert_ne!(id.kas, 0);
        assert!(id.ioccsz >= 4);
    }

    #[test]
    fn identify_namespace_and_lists() {
        let (t, c) = setup();
        enable(&t, &c);
        let ns = IdentifyNamespace::decode(&data(call(&t, &c, &admin(admin_opcode::IDENTIFY, 1, 0, 0), 0))).unwrap();
        assert_eq!(ns.nsze, (1 << 30) / 4096);
        assert_eq!(identify::lba_format_block_size(ns.lbaf0), 4096);
        let inactive = data(call(&t, &c, &admin(admin_opcode::IDENTIFY, 7, 0, 0), 0));
        assert!(inactive.iter().all(|&b| b == 0));
        assert_eq!(status(call(&t, &c, &admin(admin_opcode::IDENTIFY, 0, 0, 0), 0)), Status::INVALID_NAMESPACE);
        let list = data(call(&t, &c, &admin(admin_opcode::IDENTIFY, 0, 2, 0), 0));
        assert_eq!(identify::decode_ns_list(&list), vec![1]);
        let d = identify::decode_ns_descriptors(&data(call(&t, &c, &admin(admin_opcode::IDENTIFY, 1, 3, 0), 0)));
        assert!(d.iter().any(|x| x.nidt == nidt::UUID && x.nid == vec![1; 16]));
        assert_eq!(status(call(&t, &c, &admin(admin_opcode::IDENTIFY, 0, 0x42, 0), 0)), Status::INVALID_FIELD);
    }

    #[test]
    fn features_and_logs() {
        let (t, c) = setup();
        enable(&t, &c);
        let o = call(&t, &c, &admin(admin_opcode::SET_FEATURES, 0, feature::NUMBER_OF_QUEUES.into(), 0x0007_0007), 0);
        assert_eq!(o, AdminOutcome::Complete { status: Status::SUCCESS, result: 3 | 3 << 16, data: None });
        let mut glp = admin(admin_opcode::GET_LOG_PAGE, 0xFFFF_FFFF, 0, 0);
        GetLogPage { lid: lid::SMART, lsp: 0, rae: false, len: 512, offset: 0 }.apply(&mut glp);
        assert_eq!(data(call(&t, &c, &glp, 0)).len(), 512);
        GetLogPage { lid: 0x42, lsp: 0, rae: false, len: 512, offset: 0 }.apply(&mut glp);
        assert_eq!(status(call(&t, &c, &glp, 0)), Status::INVALID_LOG_PAGE);
        assert_eq!(call(&t, &c, &admin(admin_opcode::ASYNC_EVENT_REQUEST, 0, 0, 0), 0), AdminOutcome::ParkAsyncEvent);
        assert_eq!(
            status(call(&t, &c, &admin(admin_opcode::ASYNC_EVENT_REQUEST, 0, 0, 0), AER_LIMIT)),
            Status::AER_LIMIT_EXCEEDED
        );
        assert_eq!(status(call(&t, &c, &admin(0x55, 0, 0, 0), 0)), Status::INVALID_OPCODE);
    }

    #[test]
    fn data_for_the_host_needs_a_transport_buffer_of_its_size_within_mdts() {
        let (t, c) = setup();
        enable(&t, &c);
        let with = |mut cmd: Command, id, length| {
            cmd.dptr = SglDescriptor { address: 0, length, id };
            status(handle(&t, &c, &cmd, &[], 0))
        };
        let identify = admin(admin_opcode::IDENTIFY, 0, 1, 0);
        assert_eq!(with(identify, sgl::TRANSPORT, 4096), Status::SUCCESS);
        assert_eq!(with(identify, sgl::TRANSPORT, 512), Status::SGL_LENGTH_INVALID);
        assert_eq!(with(identify, sgl::IN_CAPSULE, 4096), Status::SGL_TYPE_INVALID);
        assert_eq!(with(identify, 0x30, 4096), Status::SGL_TYPE_INVALID);
        assert_eq!(with(identify, 0x0F, 4096), Status::SGL_TYPE_INVALID);
        let mut glp = admin(admin_opcode::GET_LOG_PAGE, 0xFFFF_FFFF, 0, 0);
        // 4 GiB with a matching descriptor: over MDTS, refused before anything is built.
        GetLogPage { lid: lid::SMART, lsp: 0, rae: false, len: 1 << 32, offset: 0 }.apply(&mut glp);
        assert_eq!(with(glp, sgl::TRANSPORT, u32::MAX), Status::INVALID_FIELD);
        GetLogPage { lid: lid::SMART, lsp: 0, rae: false, len: 16 << 30, offset: 0 }.apply(&mut glp);
        assert_eq!(with(glp, sgl::TRANSPORT, 4096), Status::INVALID_FIELD);
        GetLogPage { lid: lid::SMART, lsp: 0, rae: false, len: 8192, offset: 0 }.apply(&mut glp);
        assert_eq!(with(glp, sgl::TRANSPORT, 4096), Status::SGL_LENGTH_INVALID);
        assert_eq!(with(glp, sgl::TRANSPORT, 8192), Status::SUCCESS);
    }
}

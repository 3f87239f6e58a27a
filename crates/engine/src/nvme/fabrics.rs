//! Fabrics commands: Connect, Property Get and Property Set (NVMe-oF 1.1 §3.3).

use std::sync::Arc;

use nvpool_wire::Status;
use nvpool_wire::command::Command;
use nvpool_wire::fabrics::{
    CNTLID_DYNAMIC, CONNECT_CNTLID_OFFSET, CONNECT_DATA_SIZE, CONNECT_HOSTID_OFFSET, CONNECT_HOSTNQN_OFFSET,
    CONNECT_QID_OFFSET, CONNECT_SQSIZE_OFFSET, CONNECT_SUBNQN_OFFSET, Capabilities, ConnectCommand, ConnectData,
    PropertyAccess, VERSION_2_0, connect_invalid_param, property,
};

use super::controller::Association;
use super::data_pointer::{self, Direction, Length, Source};
use super::{ADMIN_QUEUE_DEPTH, Controller, Target, Transport};
use crate::tls::TlsPeer;

/// A successful Connect: the queue now belongs to `controller`.
pub struct Connected {
    /// The controller.
    pub controller: Arc<Controller>,
    /// Queue ID: 0 for the admin queue.
    pub qid: u16,
    /// Queue size, 0's based.
    pub sqsize: u16,
    /// Whether the queue must authenticate before anything else: the host has
    /// DH-HMAC-CHAP secrets on the subsystem.
    pub auth_required: bool,
}

/// A refused Connect: the status and CQE DW0 to report.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    /// The status (with Do Not Retry when retrying cannot help).
    pub status: Status,
    /// CQE DW0: which parameter was wrong, for invalid parameters.
    pub result: u32,
}

fn refuse(status: Status, result: u32) -> Refused {
    Refused { status: status.with_dnr(), result }
}

/// A refusal that configuration can lift: Do Not Retry stays clear. An engine that
/// restarts comes up empty and its agent puts the subsystems and allow-lists back a
/// moment later; a host reconnecting in between must keep trying (the Linux host gives
/// a controller up on the first DNR status), not lose the path for good.
fn refuse_for_now(status: Status, result: u32) -> Refused {
    Refused { status, result }
}

/// Handles a Connect command with its in-capsule data, arrived over `transport`.
pub fn connect(
    target: &Target,
    cmd: &Command,
    data: &[u8],
    tls: Option<&TlsPeer>,
    transport: Transport,
) -> Result<Connected, Refused> {
    let c = ConnectCommand::from_command(cmd);
    if c.recfmt != 0 {
        return Err(refuse(Status::CONNECT_INCOMPATIBLE_FORMAT, 0));
    }
    let need = Length::Exactly(CONNECT_DATA_SIZE as u64);
    // The Connect data comes in the capsule: before the queue exists there is no R2T
    // to ask for it with.
    let offset = match data_pointer::check(&cmd.dptr, Direction::FromHost, need, data.len()) {
        Ok(Source::InCapsule { offset }) => offset,
        Ok(Source::Transport) => return Err(refuse(Status::SGL_TYPE_INVALID, 0)),
        Err(status) => return Err(refuse(status, 0)),
    };
    let d = ConnectData::decode(&data[offset..]).ok_or_else(|| refuse(Status::SGL_LENGTH_INVALID, 0))?;
    let subsystem = target.subsystem(&d.subnqn).ok_or_else(|| {
        refuse_for_now(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(true, CONNECT_SUBNQN_OFFSET))
    })?;
    if !subsystem.host_allowed(&d.hostnqn) {
        return Err(refuse_for_now(Status::CONNECT_INVALID_HOST, connect_invalid_param(true, CONNECT_HOSTNQN_OFFSET)));
    }
    // A TLS session's PSK was the key of one host for one subsystem: the queue serves
    // only that pair.
    if let Some(peer) = tls
        && (peer.host_nqn != d.hostnqn || peer.subsystem_nqn != d.subnqn)
    {
        return Err(refuse_for_now(Status::CONNECT_INVALID_HOST, connect_invalid_param(true, CONNECT_HOSTNQN_OFFSET)));
    }
    let auth_required = subsystem.host_keys(&d.hostnqn).is_some();
    if c.sqsize == 0 {
        return Err(refuse(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(false, CONNECT_SQSIZE_OFFSET)));
    }
    if c.qid == 0 {
        if d.cntlid != CNTLID_DYNAMIC {
            return Err(refuse(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(true, CONNECT_CNTLID_OFFSET)));
        }
        if c.sqsize >= ADMIN_QUEUE_DEPTH {
            return Err(refuse(
                Status::CONNECT_INVALID_PARAMETERS,
                connect_invalid_param(false, CONNECT_SQSIZE_OFFSET),
            ));
        }
        let now = target.now_ms();
        let max_io_queues = if subsystem.is_discovery() { 0 } else { target.limits.max_io_queues };
        let controller = target
            .register_controller(|id| {
                let a = Association {
                    subsystem: subsystem.clone(),
                    hostnqn: d.hostnqn.clone(),
                    hostid: d.hostid,
                    kato_ms: c.kato,
                    max_io_queues,
                    transport,
                };
                Arc::new(Controller::new(id, a, now))
            })
            .ok_or_else(|| refuse(Status::CONNECT_CONTROLLER_BUSY, 0))?;
        controller.claim_queue(0);
        subsystem.attach_controller(&controller);
        return Ok(Connected { controller, qid: 0, sqsize: c.sqsize, auth_required });
    }
    let controller = target
        .controller(d.cntlid)
        .filter(|ctl| !ctl.is_dead() && Arc::ptr_eq(&ctl.subsystem, &subsystem) && ctl.hostnqn == d.hostnqn)
        .ok_or_else(|| {
            refuse(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(true, CONNECT_CNTLID_OFFSET))
        })?;
    if controller.hostid != d.hostid {
        // An I/O queue must come from the host that made the association: the data's
        // HOSTID is the invalid parameter (as SPDK answers).
        return Err(refuse(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(true, CONNECT_HOSTID_OFFSET)));
    }
    if !controller.ready() {
        return Err(refuse(Status::COMMAND_SEQUENCE_ERROR, 0));
    }
    if u32::from(c.sqsize) >= target.limits.max_queue_depth {
        return Err(refuse(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(false, CONNECT_SQSIZE_OFFSET)));
    }
    if u32::from(c.qid) > controller.io_queues_granted() {
        return Err(refuse(Status::CONNECT_INVALID_PARAMETERS, connect_invalid_param(false, CONNECT_QID_OFFSET)));
    }
    if !controller.claim_queue(c.qid) {
        return Err(refuse(Status::COMMAND_SEQUENCE_ERROR, 0));
    }
    Ok(Connected { controller, qid: c.qid, sqsize: c.sqsize, auth_required })
}

/// Handles Property Get: returns the 8-byte value split into CQE DW0 and DW1.
pub fn property_get(target: &Target, ctrl: &Controller, cmd: &Command) -> Result<u64, Status> {
    let p = PropertyAccess::from_command(cmd);
    let value = match (p.offset, p.eight_bytes) {
        (property::CAP, true) => Capabilities {
            mqes: (target.limits.max_queue_depth - 1) as u16,
            // CAP.TO in 500 ms units: the controller is ready at once; 7.5 s is ample.
            timeout: 15,
            css: 1,
        }
        .to_u64(),
        (property::VS, false) => u64::from(VERSION_2_0),
        (property::CC, false) => u64::from(ctrl.cc()),
        (property::CSTS, false) => u64::from(ctrl.csts()),
        _ => return Err(Status::INVALID_FIELD.with_dnr()),
    };
    Ok(value)
}

/// Handles Property Set (only CC is writable).
pub fn property_set(ctrl: &Controller, cmd: &Command) -> Result<(), Status> {
    let p = PropertyAccess::from_command(cmd);
    if p.offset != property::CC || p.eight_bytes || !ctrl.set_cc(p.value as u32) {
        return Err(Status::INVALID_FIELD.with_dnr());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use nvpool_wire::command::{SglDescriptor, sgl};

    use super::*;
    use crate::config::Limits;
    use crate::nvme::subsystem::{HostPolicy, Subsystem};

    const NQN: &str = "nqn.2024-01.io.nvpool:tls-bound";
    const HOST: &str = "nqn.2024-01.io.nvpool:host-a";

    fn admin_connect(subnqn: &str, hostnqn: &str) -> (Command, Vec<u8>) {
        let mut cmd = ConnectCommand { recfmt: 0, qid: 0, sqsize: 31, cattr: 0, kato: 5000 }.to_command(1);
        cmd.dptr = SglDescriptor { address: 0, length: CONNECT_DATA_SIZE as u32, id: sgl::IN_CAPSULE };
        let mut data = [0u8; CONNECT_DATA_SIZE];
        ConnectData { hostid: [1; 16], cntlid: CNTLID_DYNAMIC, subnqn: subnqn.into(), hostnqn: hostnqn.into() }
            .encode(&mut data);
        (cmd, data.to_vec())
    }

    #[test]
    fn a_tls_connection_serves_only_the_host_and_subsystem_of_its_psk() {
        let target = Target::new(Limits::default());
        let policy = HostPolicy { allow_any: true, ..HostPolicy::default() };
        target.add_subsystem(Subsystem::new(NQN, "S1", "m", policy.clone()).unwrap()).unwrap();
        let other = "nqn.2024-01.io.nvpool:tls-other";
        target.add_subsystem(Subsystem::new(other, "S2", "m", policy).unwrap()).unwrap();
        let peer = TlsPeer { host_nqn: HOST.into(), subsystem_nqn: NQN.into() };

        let (cmd, data) = admin_connect(NQN, HOST);
        assert!(connect(&target, &cmd, &data, Some(&peer), Transport::Tcp).is_ok());
        // Another host's NQN, or another subsystem, over that session: Connect Invalid Host.
        for (subnqn, hostnqn) in [(NQN, "nqn.2024-01.io.nvpool:host-b"), (other, HOST)] {
            let (cmd, data) = admin_connect(subnqn, hostnqn);
            let refused = connect(&target, &cmd, &data, Some(&peer), Transport::Tcp).err().expect("refused");
            assert_eq!(refused.status.base(), Status::CONNECT_INVALID_HOST);
        }
        // Without TLS, nothing binds the NQNs.
        let (cmd, data) = admin_connect(other, HOST);
        assert!(connect(&target, &cmd, &data, None, Transport::Tcp).is_ok());
    }
}

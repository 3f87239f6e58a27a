//! Control commands to the ublk driver: `URING_CMD`s on `/dev/ublk-control`, each on a
//! small ring of its own (the driver needs 128-byte entries, and some commands block
//! until the reactors have fetched their tags, so they never run on a reactor).
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::{Duration, Instant};

use io_uring::{IoUring, cqueue, opcode, squeue, types};

use super::uapi::{CtrlCmd, DEV_INFO_SIZE, DevInfo, PARAMS_SIZE, Params, ctrl, state};

/// `/dev/ublk-control`, opened once.
pub struct Control {
    file: File,
}

impl Control {
    /// Opens the control device; the error says how to get one.
    pub fn open() -> Result<Control, String> {
        match OpenOptions::new().read(true).write(true).open("/dev/ublk-control") {
            Ok(file) => Ok(Control { file }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err("this kernel has no ublk driver loaded (/dev/ublk-control is missing): run `modprobe ublk_drv` \
                 (Linux 6.0 or later), or attach over NVMe/TCP"
                    .into())
            }
            Err(e) => Err(format!("cannot open /dev/ublk-control: {e} (ublk devices need CAP_SYS_ADMIN)")),
        }
    }

    /// Runs one command; `buf` is the buffer it reads or fills. It waits as long as the
    /// driver takes, since the driver may write into `buf` until it answers.
    fn run(&self, op: u32, mut cmd: CtrlCmd, buf: Option<&mut [u8]>) -> io::Result<i32> {
        let mut ring = self.ring()?;
        if let Some(b) = buf {
            cmd.addr = b.as_mut_ptr() as u64;
            cmd.len = b.len() as u16;
        }
        // SAFETY: the entry points at `buf` (if any), which the caller lends for this
        // call, and this call waits for the completion before it returns.
        unsafe { ring.submission().push(&self.entry(op, cmd)) }.map_err(|_| io::Error::other("control ring full"))?;
        loop {
            match ring.submit_and_wait(1) {
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                r => r?,
            };
            if let Some(c) = ring.completion().next() {
                return answer(c.result());
            }
        }
    }

    /// Runs one command that lends the driver no buffer, giving up after `limit`.
    /// A driver that hit a kernel bug can block a command for good (Linux 6.12 stops a
    /// device by waiting for work that may have oopsed); the caller then gets an error
    /// to report instead of hanging with it. The command stays with the driver.
    fn run_bounded(&self, op: u32, cmd: CtrlCmd, limit: Duration) -> io::Result<i32> {
        let mut ring = self.ring()?;
        // SAFETY: the entry holds the whole command inline and points at no memory.
        unsafe { ring.submission().push(&self.entry(op, cmd)) }.map_err(|_| io::Error::other("control ring full"))?;
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the ublk driver did not answer within {} s (the kernel log, dmesg, may say why)",
                        limit.as_secs()
                    ),
                ));
            }
            let wait = types::Timespec::from(left.min(Duration::from_millis(100)));
            let args = types::SubmitArgs::new().timespec(&wait);
            match ring.submitter().submit_with_args(1, &args) {
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::ETIME)) => {}
                r => drop(r?),
            };
            if let Some(c) = ring.completion().next() {
                return answer(c.result());
            }
        }
    }

    fn ring(&self) -> io::Result<IoUring<squeue::Entry128, cqueue::Entry>> {
        IoUring::builder().build(2)
    }

    fn entry(&self, op: u32, cmd: CtrlCmd) -> squeue::Entry128 {
        let mut bytes = [0u8; 80];
        bytes[..32].copy_from_slice(&cmd.encode());
        opcode::UringCmd80::new(types::Fd(self.file.as_raw_fd()), op).cmd(bytes).build()
    }

    /// The feature flags the driver offers.
    pub fn features(&self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.run(ctrl::GET_FEATURES, CtrlCmd { queue_id: u16::MAX, ..CtrlCmd::default() }, Some(&mut b))?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Creates a device (`/dev/ublkcN`); returns the description the driver granted.
    pub fn add(&self, info: &DevInfo) -> io::Result<DevInfo> {
        let mut b = info.encode();
        let cmd = CtrlCmd { dev_id: info.dev_id, queue_id: u16::MAX, ..CtrlCmd::default() };
        self.run(ctrl::ADD_DEV, cmd, Some(&mut b))?;
        Ok(DevInfo::decode(&b))
    }

    /// A device's description.
    pub fn info(&self, dev_id: u32) -> io::Result<DevInfo> {
        let mut b = [0u8; DEV_INFO_SIZE];
        self.run(ctrl::GET_DEV_INFO, device(dev_id), Some(&mut b))?;
        Ok(DevInfo::decode(&b))
    }

    /// Sets a device's block parameters.
    pub fn set_params(&self, dev_id: u32, params: &Params) -> io::Result<()> {
        let mut b: [u8; PARAMS_SIZE] = params.encode();
        self.run(ctrl::SET_PARAMS, device(dev_id), Some(&mut b)).map(drop)
    }

    /// Creates `/dev/ublkbN`: waits until every queue fetched its tags, then reads the
    /// partition table through them.
    pub fn start(&self, dev_id: u32) -> io::Result<()> {
        self.run(ctrl::START_DEV, CtrlCmd { data: u64::from(std::process::id()), ..device(dev_id) }, None).map(drop)
    }

    /// Removes `/dev/ublkbN` once the requests under way are answered; the queues'
    /// fetches then end.
    pub fn stop(&self, dev_id: u32) -> io::Result<()> {
        self.run_bounded(ctrl::STOP_DEV, device(dev_id), CONTROL_PATIENCE).map(drop)
    }

    /// Deletes a stopped device once nobody holds its char device.
    pub fn delete(&self, dev_id: u32) -> io::Result<()> {
        self.run_bounded(ctrl::DEL_DEV, device(dev_id), CONTROL_PATIENCE).map(drop)
    }

    /// Starts taking over a device whose server exited. The driver answers EBUSY until
    /// the old server's rings are gone; this retries until `patience` runs out.
    pub fn start_recovery(&self, dev_id: u32, patience: Duration) -> io::Result<()> {
        let deadline = Instant::now() + patience;
        // Linux 6.12's driver marks the device QUIESCED, drops its lock, and only then
        // cancels the old server's commands; a takeover that lands in that window can
        // make the cancelling kernel worker oops (a NULL command in io_uring_cmd_done,
        // seen in this project's CI and in SPDK's issue 3384), after which the device
        // can never be stopped. So wait for QUIESCED, then give the worker time to end.
        while self.info(dev_id)?.state != state::QUIESCED && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(CANCEL_GRACE);
        loop {
            match self.run(ctrl::START_USER_RECOVERY, device(dev_id), None) {
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                r => return r.map(drop),
            }
        }
    }

    /// Ends the takeover once every queue fetched its tags: held I/O goes on.
    pub fn end_recovery(&self, dev_id: u32) -> io::Result<()> {
        let cmd = CtrlCmd { data: u64::from(std::process::id()), ..device(dev_id) };
        self.run(ctrl::END_USER_RECOVERY, cmd, None).map(drop)
    }
}

/// How long a takeover waits after the device turned QUIESCED (see `start_recovery`).
const CANCEL_GRACE: Duration = Duration::from_millis(100);
/// How long stopping or deleting a device may take before the caller hears of it.
const CONTROL_PATIENCE: Duration = Duration::from_secs(30);

fn answer(result: i32) -> io::Result<i32> {
    if result < 0 { Err(io::Error::from_raw_os_error(-result)) } else { Ok(result) }
}

fn device(dev_id: u32) -> CtrlCmd {
    CtrlCmd { dev_id, queue_id: u16::MAX, ..CtrlCmd::default() }
}

/// Opens `/dev/ublkcN`, which the driver creates as the device is added (devtmpfs);
/// a node made by udev may take a moment.
pub fn open_char_device(dev_id: u32) -> io::Result<OwnedFd> {
    let path = format!("/dev/ublkc{dev_id}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match OpenOptions::new().read(true).write(true).open(&path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            r => return r.map(OwnedFd::from),
        }
    }
}

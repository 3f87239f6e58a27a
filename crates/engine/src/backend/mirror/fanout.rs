//! The mirror's fan-out on one reactor: a ring client that takes each command the
//! mirror hands it and issues it to the legs, one command per leg, as a connection
//! issues commands to a backend (`me | CLIENT_OWNER`, a tag per command and leg).
//!
//! The issuer's buffer goes to the first leg; every other leg gets a copy of the
//! write data (a leg may hand its buffer to another engine's queue, so two legs never
//! share one). When every leg has answered, the command is answered, or held if it
//! missed a leg (see the module above).

use nvpool_wire::Status;

use super::{MAX_LEGS, Mirror, fans_out};
use crate::backend::{BlockIo, DiskQueue};
use crate::bufpool::Buf;
use crate::plan::{IoPlan, dsm_byte_ranges};
use crate::ring::{CLIENT_OWNER, Handed, Ring, RingClient};
use std::collections::VecDeque;
use std::sync::Arc;

/// Tags per command: one per leg, rounded up to a power of two.
const LEG_TAGS: usize = 4;
/// Most commands a fan-out has under way at once (their tags fit in 16 bits).
const MAX_COMMANDS: usize = u16::MAX as usize / LEG_TAGS;

/// One command of the issuer's, spread over the legs.
struct Fanned {
    owner: u32,
    tag: u16,
    plan: IoPlan,
    /// Each leg's command.
    legs: [BlockIo; MAX_LEGS],
    /// Legs whose command is under way.
    waiting: usize,
    /// The leg that has the issuer's buffer.
    carrier: usize,
    /// The issuer's buffer, once its leg is done.
    buf: Option<Buf>,
    /// A bit per in-sync leg the command did not reach: faulted before, or failed it
    /// now.
    missed: u8,
    /// The copy window's epoch parity it was counted under, if it was (a write).
    counted: Option<usize>,
    /// How a read ended (a write's outcome is decided by `missed`).
    status: Status,
}

impl Fanned {
    fn idle() -> Fanned {
        Fanned {
            owner: 0,
            tag: 0,
            plan: IoPlan::Flush,
            legs: std::array::from_fn(|_| BlockIo::idle()),
            waiting: 0,
            carrier: 0,
            buf: None,
            missed: 0,
            counted: None,
            status: Status::SUCCESS,
        }
    }
}

/// A mirror's fan-out on one reactor.
pub(super) struct Fanout {
    mirror: Arc<Mirror>,
    commands: Vec<Fanned>,
    free: Vec<u16>,
    /// Commands taken and not answered yet, held ones included.
    busy: usize,
    /// Commands done on the legs they reached, waiting for the mirror to retire.
    held: Vec<u16>,
    /// Writes to the cluster a rebuild copies, waiting for it to be copied.
    waiting: VecDeque<Handed>,
}

fn leg_tag(command: u16, leg: usize) -> u16 {
    command * LEG_TAGS as u16 + leg as u16
}

fn split_tag(tag: u16) -> (u16, usize) {
    (tag / LEG_TAGS as u16, usize::from(tag) % LEG_TAGS)
}

impl Fanout {
    pub(super) fn new(mirror: Arc<Mirror>) -> Fanout {
        Fanout { mirror, commands: Vec::new(), free: Vec::new(), busy: 0, held: Vec::new(), waiting: VecDeque::new() }
    }

    /// A free command slot, if the fan-out has not reached its limit.
    fn slot(&mut self) -> Option<u16> {
        if let Some(c) = self.free.pop() {
            return Some(c);
        }
        if self.commands.len() >= MAX_COMMANDS {
            return None;
        }
        self.commands.push(Fanned::idle());
        Some(self.commands.len() as u16 - 1)
    }

    /// Answers command `c` to its issuer and frees its slot.
    fn answer(&mut self, ring: &mut Ring, c: u16, status: Status) {
        let f = &mut self.commands[usize::from(c)];
        ring.answer(f.owner, f.tag, status, f.buf.take());
        self.free.push(c);
        self.busy -= 1;
    }

    /// Leg `leg` of command `c` has nothing in flight any more.
    fn leg_done(&mut self, ring: &mut Ring, me: u32, c: u16, leg: usize) {
        let f = &mut self.commands[usize::from(c)];
        let io = &mut f.legs[leg];
        let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, leg_tag(c, leg), true);
        self.mirror.legs[leg].backend.settle(io, &mut queue);
        queue.finish();
        if !io.is_idle() {
            return;
        }
        self.mirror.legs[leg].backend.finished(io, ring.id);
        if !io.status.is_success() {
            if fans_out(&f.plan) {
                self.mirror.fault(leg, io.status);
                if self.mirror.in_sync(leg) {
                    f.missed |= 1 << leg;
                }
            } else {
                f.status = io.status;
            }
        }
        match io.take_buf() {
            Some(b) if leg == f.carrier => f.buf = Some(b),
            Some(b) => ring.pool.put(b),
            None => {}
        }
        f.waiting -= 1;
        if f.waiting == 0 {
            self.complete(ring, c);
        }
    }

    /// Every leg command `c` went to has answered.
    fn complete(&mut self, ring: &mut Ring, c: u16) {
        let f = &mut self.commands[usize::from(c)];
        if let Some(parity) = f.counted.take() {
            self.mirror.window.leave(ring.id, parity);
        }
        if !fans_out(&f.plan) {
            let status = f.status;
            return self.answer(ring, c, status);
        }
        let all = (0..self.mirror.legs.len()).filter(|&i| self.mirror.in_sync(i)).fold(0u8, |m, i| m | 1 << i);
        if f.missed & all == all || (f.missed != 0 && self.mirror.is_fenced()) {
            // No replica has it, or this engine no longer serves the volume: the host
            // writes it again (through the engine that does).
            self.answer(ring, c, Status::ANA_INACCESSIBLE);
        } else if f.missed != 0 {
            self.record_missed(c);
            self.held.push(c);
            self.release_held(ring);
        } else {
            self.answer(ring, c, Status::SUCCESS);
        }
    }

    /// Records what held command `c` changed as written by the next generation, on
    /// the serving engine's own replica: the mirror that serves without the legs it
    /// missed is that generation, and a leg that comes back copies what the record
    /// names from the generation it left at (`VolumeMap::written_since`).
    fn record_missed(&self, c: u16) {
        let f = &self.commands[usize::from(c)];
        let (Some(generation), Some(volume)) = (self.mirror.generation, self.mirror.legs[0].backend.as_volume()) else {
            return;
        };
        let ranges: Vec<(u64, u64)> = match f.plan {
            IoPlan::Write { offset, len, .. } => vec![(offset, u64::from(len))],
            IoPlan::WriteZeroes { offset, len } => vec![(offset, len)],
            IoPlan::DatasetManagement { ranges, block_shift, .. } => {
                f.buf.as_ref().map(|b| dsm_byte_ranges(b.as_slice(), ranges, block_shift).collect()).unwrap_or_default()
            }
            IoPlan::Read { .. } | IoPlan::Flush => Vec::new(),
        };
        volume.mark_generation(&ranges, generation + 1);
    }

    /// Starts a command on its legs, or keeps it waiting while the cluster it writes
    /// is being copied. It counts in `busy` from `take` to its answer.
    fn start(&mut self, ring: &mut Ring, me: u32, mut cmd: Handed) {
        let fan = fans_out(&cmd.plan);
        // The legs it goes to, a bit each: every healthy leg for a change, the first
        // healthy in-sync leg for a read.
        let targets = {
            let m = &self.mirror;
            let healthy = (0..m.legs.len()).filter(|&i| m.healthy(i)).fold(0u8, |t, i| t | 1 << i);
            if fan {
                healthy
            } else {
                (0..m.legs.len()).find(|&i| healthy & 1 << i != 0 && m.in_sync(i)).map_or(0, |i| 1 << i)
            }
        };
        let Some(c) = (targets != 0).then(|| self.slot()).flatten() else {
            // No replica left to serve it (or no room): the host retries it later.
            self.busy -= 1;
            ring.answer(cmd.owner, cmd.tag, Status::ANA_INACCESSIBLE, cmd.buf);
            return;
        };
        let Fanout { mirror, commands, free, waiting, .. } = self;
        let counted = if fan {
            match mirror.window.enter(ring.id, &cmd.plan) {
                Some(parity) => Some(parity),
                None => {
                    free.push(c);
                    waiting.push_back(cmd);
                    return;
                }
            }
        } else {
            None
        };
        // A change that reaches a mirror another one replaced (a write whose data came
        // by R2T after the swap: it took the namespace's backend when its capsule came)
        // must not start on this mirror's legs: the new one may have others (a replica
        // catching up that a rebuild's record, read once this mirror's writes were
        // done, would not name). Asked after entering the window, which a rebuild
        // drains after the swap, so one of the two sees the other. The host sends it
        // again, to the mirror that serves now.
        if let Some(parity) = counted.filter(|_| mirror.is_retired()) {
            mirror.window.leave(ring.id, parity);
            free.push(c);
            self.busy -= 1;
            ring.answer(cmd.owner, cmd.tag, Status::ANA_INACCESSIBLE, cmd.buf);
            return;
        }
        let aimed = |leg: &usize| targets & 1 << leg != 0;
        let carrier = targets.trailing_zeros() as usize;
        let f = &mut commands[usize::from(c)];
        f.counted = counted;
        f.owner = cmd.owner;
        f.tag = cmd.tag;
        f.plan = cmd.plan;
        f.waiting = targets.count_ones() as usize;
        f.carrier = carrier;
        f.status = Status::SUCCESS;
        // In-sync legs it skips (faulted): it must be held. One that catches up may miss it.
        let skipped = |i: &usize| mirror.in_sync(*i) && !aimed(i);
        f.missed = if fan { (0..mirror.legs.len()).filter(skipped).fold(0, |m, i| m | 1 << i) } else { 0 };
        let data_len = cmd.plan.host_data_len() as usize;
        for leg in (0..mirror.legs.len()).filter(aimed) {
            let io = &mut f.legs[leg];
            io.reset(cmd.plan, ring.pass_ns);
            if leg != carrier
                && data_len > 0
                && let Some(data) = cmd.buf.as_ref()
            {
                let mut copy = ring.io_buf(data_len);
                copy.as_mut_slice()[..data_len].copy_from_slice(&data.as_slice()[..data_len]);
                io.set_buf(copy);
            }
        }
        if let Some(b) = cmd.buf.take() {
            f.legs[carrier].set_buf(b);
        }
        // Every leg starts before any is counted done, so that a leg that ends at
        // once does not complete the command while others have not started.
        let mut done_now = [false; MAX_LEGS];
        for leg in (0..mirror.legs.len()).filter(aimed) {
            let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, leg_tag(c, leg), true);
            mirror.legs[leg].backend.start(&mut f.legs[leg], &mut queue);
            queue.finish();
            done_now[leg] = f.legs[leg].is_idle();
        }
        for leg in (0..MAX_LEGS).filter(|&l| done_now[l]) {
            self.leg_done(ring, me, c, leg);
        }
    }

    /// Starts the writes that waited for a copied cluster, once it is no longer
    /// being copied (each at most once per call: one that must wait again goes back).
    fn start_waiting(&mut self, ring: &mut Ring, me: u32) {
        for _ in 0..self.waiting.len() {
            match self.waiting.front() {
                Some(cmd) if !self.mirror.window.blocks(&cmd.plan) => {
                    if let Some(cmd) = self.waiting.pop_front() {
                        self.start(ring, me, cmd);
                    }
                }
                _ => return,
            }
        }
    }

    /// Answers the held commands once the mirror is retired.
    fn release_held(&mut self, ring: &mut Ring) {
        let mut i = 0;
        while i < self.held.len() {
            let c = self.held[i];
            match self.mirror.held_outcome(self.commands[usize::from(c)].missed) {
                Some(status) => {
                    self.held.swap_remove(i);
                    self.answer(ring, c, status);
                }
                None => i += 1,
            }
        }
    }
}

impl RingClient for Fanout {
    fn on_complete(&mut self, _ring: &mut Ring, _me: u32, _tag: u32, _res: i32, _flags: u32) {}

    fn take(&mut self, ring: &mut Ring, me: u32, cmd: Handed) {
        self.busy += 1;
        self.start(ring, me, cmd);
        self.start_waiting(ring, me);
    }

    fn on_disk(&mut self, ring: &mut Ring, me: u32, tag: u16, res: i32) {
        let (c, leg) = split_tag(tag);
        let Some(f) = self.commands.get_mut(usize::from(c)) else { return };
        if f.legs[leg].op_done(res) && f.legs[leg].is_idle() {
            self.leg_done(ring, me, c, leg);
        }
        self.start_waiting(ring, me);
    }

    fn on_answer(&mut self, ring: &mut Ring, me: u32, tag: u16, status: Status, buf: Option<Buf>) {
        let (c, leg) = split_tag(tag);
        let Some(f) = self.commands.get_mut(usize::from(c)) else { return };
        let io = &mut f.legs[leg];
        if let Some(b) = buf {
            io.set_buf(b);
        }
        io.deferred_done();
        let mut queue = DiskQueue::new(ring, me | CLIENT_OWNER, tag, true);
        self.mirror.legs[leg].backend.resume(io, status, &mut queue);
        queue.finish();
        if io.is_idle() {
            self.leg_done(ring, me, c, leg);
        }
        self.start_waiting(ring, me);
    }

    /// Answers the commands of `owner` that wait for the copy window (not started on
    /// any leg): its host gave them up.
    fn withdraw(&mut self, ring: &mut Ring, _me: u32, owner: u32) {
        let (gone, kept) = std::mem::take(&mut self.waiting).into_iter().partition(|c| c.owner == owner);
        self.waiting = kept;
        for cmd in gone {
            self.busy -= 1;
            ring.answer(cmd.owner, cmd.tag, Status::ABORT_REQUESTED, cmd.buf);
        }
    }

    fn tick(&mut self, ring: &mut Ring, me: u32) {
        self.release_held(ring);
        self.start_waiting(ring, me);
    }

    /// Held commands keep a hot upgrade waiting until the mirror is retired: they
    /// are acknowledged to nobody yet.
    fn parked(&self) -> bool {
        self.busy == 0
    }

    fn stop(&mut self, ring: &mut Ring, _me: u32) {
        for c in std::mem::take(&mut self.held) {
            self.answer(ring, c, Status::ANA_INACCESSIBLE);
        }
        for cmd in std::mem::take(&mut self.waiting) {
            self.busy -= 1;
            ring.answer(cmd.owner, cmd.tag, Status::ANA_INACCESSIBLE, cmd.buf);
        }
    }

    fn ended(&self) -> bool {
        self.busy == 0 && self.mirror.closed.load(std::sync::atomic::Ordering::Acquire)
    }
}

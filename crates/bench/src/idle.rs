//! Idle back-off for the busy-polling servers (the responder and the bare loop).
//!
//! They poll while there is traffic. After a quiet spell they nap, with naps that grow
//! from 0.2 ms to 20 ms. The benchmark suite keeps every target up and measures them
//! one after another on the same CPU, so an idle server must not disturb the one being
//! measured: at a fixed 0.2 ms nap it woke 5,000 times a second, which cost the measured
//! target CPU time and cache and shifted its figures by 10% and more.

use std::time::Duration;

/// Quiet polling passes (about a millisecond) before the first nap.
const IDLE_PASSES: u32 = 100_000;
/// The first nap; each further nap is this much longer, up to `LONGEST_NAP`.
const NAP_STEP: Duration = Duration::from_micros(200);
/// The longest nap: a long-idle server wakes 50 times a second.
const LONGEST_NAP: Duration = Duration::from_millis(20);

/// Tracks how long a polling loop has been idle, and naps when it has been.
#[derive(Debug, Default)]
pub struct IdleBackoff {
    idle_passes: u32,
    naps: u32,
}

impl IdleBackoff {
    /// Call once per polling pass. Naps if the loop has been idle, and returns whether
    /// it did: a napping loop should look for new connections on every pass, since its
    /// passes are now far apart.
    pub fn pass(&mut self) -> bool {
        self.idle_passes = self.idle_passes.saturating_add(1);
        if self.idle_passes <= IDLE_PASSES {
            return false;
        }
        self.naps = self.naps.saturating_add(1);
        std::thread::sleep(NAP_STEP.saturating_mul(self.naps).min(LONGEST_NAP));
        true
    }

    /// Records traffic: polling resumes at full speed.
    pub fn busy(&mut self) {
        self.idle_passes = 0;
        self.naps = 0;
    }
}

//! Hot-upgrade parking on a reactor: it stops taking new commands, finishes the ones
//! taken, and reports each connection's image and a copy of its socket; the new
//! process's reactors take such connections back (`restore`) and hold them until told
//! to serve. Ring clients park themselves (`RingClient::park`).

use std::net::TcpStream;
use std::sync::Arc;
use std::sync::mpsc::Sender;

use super::Reactor;
use super::conn::{Conn, ConnImage};
use crate::nvme::Controller;

/// Where a reactor stands in a hot upgrade.
pub(super) enum Upgrade {
    /// Serving.
    Serving,
    /// Finishing the commands it took; reports here once nothing is in flight.
    Parking(Sender<Result<Parked, String>>),
    /// Held still: reported (the old process) or restored (the new one), until
    /// `resume` or the process exits.
    Parked,
}

/// A reactor's report that it is parked: nothing in flight, nothing accepted or read
/// until it resumes or the process exits.
pub struct Parked {
    /// Which reactor.
    pub reactor: usize,
    /// Each connection's state (its `fd` not yet filled in) and a copy of its socket.
    pub conns: Vec<(ConnImage, TcpStream)>,
}

impl Reactor {
    /// Starts parking: nothing new is taken (accepts included: listeners are clients),
    /// every connection and client finishes what it took. Reports to `report`.
    pub fn park(&mut self, report: Sender<Result<Parked, String>>) {
        self.upgrade = Upgrade::Parking(report);
        self.ring.held = true;
        self.ring.each_client(|ring, slot, c| c.park(ring, slot));
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |_, conn| conn.park());
        }
        self.park_progress();
    }

    /// Reports the parked state once every connection is parked (or gone) and every
    /// client is.
    pub(super) fn park_progress(&mut self) {
        let mut all = true;
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |r, conn| all &= conn.park_step(r, c));
        }
        if !all || !self.ring.clients_parked() {
            return;
        }
        let Upgrade::Parking(report) = std::mem::replace(&mut self.upgrade, Upgrade::Parked) else { return };
        let copies = || -> std::io::Result<Parked> {
            let mut conns = Vec::new();
            // RDMA connections are not handed on (an upgrade with RDMA listeners is
            // refused before it parks anything).
            for conn in self.conns.iter().flatten() {
                if let Some(image) = conn.image(self.ring.id, 0) {
                    conns.push((image, conn.dup_socket()?));
                }
            }
            Ok(Parked { reactor: self.ring.id, conns })
        };
        let _ = report.send(copies().map_err(|e| format!("reactor {} cannot copy a socket: {e}", self.ring.id)));
    }

    /// Serves again: after parking (the upgrade was called off), or once a new
    /// process was told to go on with what it restored.
    pub fn resume(&mut self) {
        self.upgrade = Upgrade::Serving;
        self.ring.held = false;
        for c in 0..self.conns.len() as u32 {
            self.with_conn(c, |r, conn| conn.resume(r, c));
        }
        self.ring.each_client(|ring, slot, c| c.resume(ring, slot));
        self.give_answers();
    }

    /// Takes the connections another engine process parked, and holds them parked
    /// until `resume`. Reports how many it took, or why one could not be taken.
    pub fn restore(
        &mut self,
        conns: Vec<(TcpStream, ConnImage, Option<Arc<Controller>>)>,
        done: Sender<Result<usize, String>>,
    ) {
        self.upgrade = Upgrade::Parked;
        self.ring.held = true;
        let count = conns.len();
        let taken = || -> Result<usize, String> {
            for (stream, image, controller) in conns {
                let conn = Conn::restore(stream, &image, controller, self.target.now_ms())?;
                self.insert_conn(Box::new(conn));
            }
            Ok(count)
        };
        let _ = done.send(taken());
    }
}

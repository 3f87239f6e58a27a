//! Commands over their namespace's I/O limits, waiting on the reactor that took them.
//!
//! A reactor keeps, for each limited namespace it serves, what it holds of the
//! namespace's budget (see [`crate::qos`]) and the commands waiting for more, oldest
//! first. A waiting command is deferred like one handed to another thread: its
//! connection or local queue keeps it, and the reactor resumes it once its budget lets
//! it through, so every transport waits the same way and nothing fails. A new command
//! of a namespace with waiters queues behind them.

use std::collections::VecDeque;
use std::sync::Arc;

use super::{LocalBudget, Qos, costs};
use crate::plan::IoPlan;

/// Waiters a namespace's queue has room for before it grows.
const WAITERS: usize = 256;

/// A command waiting for budget: who issued it, and what it costs.
struct Waiter {
    owner: u32,
    tag: u16,
    plan: IoPlan,
}

/// One limited namespace, as this reactor sees it.
struct Limited {
    qos: Arc<Qos>,
    budget: LocalBudget,
    waiters: VecDeque<Waiter>,
}

/// The limited namespaces a reactor serves and their waiting commands.
#[derive(Default)]
pub struct Throttle {
    limited: Vec<Limited>,
    waiting: usize,
}

impl Throttle {
    fn limited(&mut self, qos: &Arc<Qos>) -> &mut Limited {
        let i = match self.limited.iter().position(|l| Arc::ptr_eq(&l.qos, qos)) {
            Some(i) => i,
            None => {
                let waiters = VecDeque::with_capacity(WAITERS);
                self.limited.push(Limited { qos: qos.clone(), budget: LocalBudget::new(), waiters });
                self.limited.len() - 1
            }
        };
        &mut self.limited[i]
    }

    /// Whether a new command of a limited namespace may start now (and then takes its
    /// cost): only if none of the namespace's commands waits before it.
    pub fn admit(&mut self, qos: &Arc<Qos>, plan: &IoPlan, now_ns: u64) -> bool {
        let l = self.limited(qos);
        l.waiters.is_empty() && l.budget.admit(qos, &costs(plan), now_ns)
    }

    /// Queues a command that was not let through.
    pub fn wait(&mut self, qos: &Arc<Qos>, owner: u32, tag: u16, plan: IoPlan) {
        self.limited(qos).waiters.push_back(Waiter { owner, tag, plan });
        self.waiting += 1;
    }

    /// Commands waiting, over every namespace.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Moves to `due` the commands their budgets now let through, oldest first per
    /// namespace: all of them if `everything` (a hot upgrade parks the reactor, and
    /// nothing may wait then).
    pub fn due(&mut self, now_ns: u64, everything: bool, due: &mut Vec<(u32, u16)>) {
        for l in &mut self.limited {
            while let Some(w) = l.waiters.front() {
                if !everything && !l.budget.admit(&l.qos, &costs(&w.plan), now_ns) {
                    break;
                }
                due.push((w.owner, w.tag));
                l.waiters.pop_front();
                self.waiting -= 1;
            }
        }
    }

    /// Forgets namespaces nothing else holds any more (they were removed).
    pub fn forget_removed(&mut self) {
        self.limited.retain(|l| !l.waiters.is_empty() || Arc::strong_count(&l.qos) > 1);
    }
}

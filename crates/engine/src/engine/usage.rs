//! What a node's agent reports with every heartbeat: pools, volumes' allocated bytes,
//! namespaces' counters. The engine remembers its last answer, so that an agent asking
//! with that answer's mark hears only what changed: a node of a thousand volumes at
//! rest answers with its pools alone, instead of encoding every volume and subsystem
//! each second.

use std::collections::HashMap;
use std::hash::Hash;

use nvpool_api::{FaultedLeg, MirrorUsage, NamespaceUsage, StatsSnapshot, UsageReport, VolumeUsage};

use super::Engine;
use crate::sync::lock;

/// The last answer's figures and its mark.
#[derive(Default)]
pub(super) struct LastUsage {
    mark: u64,
    volumes: HashMap<(String, String), u64>,
    namespaces: HashMap<(String, u32), StatsSnapshot>,
}

impl LastUsage {
    /// Marks start at a random number, so that a mark of another engine process
    /// (before a restart or a hot upgrade) is never taken for this one's.
    pub(super) fn new() -> LastUsage {
        LastUsage { mark: uuid::Uuid::new_v4().as_u64_pair().0, ..LastUsage::default() }
    }
}

impl Engine {
    /// The usage now: everything, or only what changed since the answer marked `since`.
    pub fn usage(&self, since: Option<u64>) -> UsageReport {
        let volumes: HashMap<(String, String), u64> =
            self.pools.allocations().into_iter().map(|(pool, name, bytes)| ((pool, name), bytes)).collect();
        // One pass over the subsystems: every namespace's counters, the mirrors that need
        // the controller, and the replica exports nobody writes.
        let mut namespaces: HashMap<(String, u32), StatsSnapshot> = HashMap::new();
        let (mut mirrors, mut replicas_unconnected) = (Vec::new(), Vec::new());
        for s in self.target().subsystems().into_iter().filter(|s| !s.is_discovery()) {
            let served = s.namespaces();
            if s.controllers().is_empty() && served.values().any(|ns| ns.backend.kind() == "replica") {
                replicas_unconnected.push(s.nqn.clone());
            }
            for ns in served.values() {
                namespaces.insert((s.nqn.clone(), ns.nsid), ns.stats.snapshot());
                if let Some(m) = ns.backend.as_mirror() {
                    mirrors.extend(self.mirror_usage(&s.nqn, ns.nsid, m));
                }
            }
        }
        let mut last = lock(&self.last_usage);
        let since_last = (since == Some(last.mark)).then_some(&*last);
        let (volumes_changed, volumes_gone) =
            changes(&volumes, since_last.map(|l| &l.volumes), |(pool, name), bytes| VolumeUsage {
                pool: pool.clone(),
                name: name.clone(),
                allocated_bytes: bytes,
            });
        let (namespaces_changed, namespaces_gone) =
            changes(&namespaces, since_last.map(|l| &l.namespaces), |(nqn, nsid), stats| NamespaceUsage {
                nqn: nqn.clone(),
                nsid: *nsid,
                stats,
            });
        let report = UsageReport {
            mirrors,
            replicas_unconnected,
            mark: last.mark.wrapping_add(1),
            complete: since_last.is_none(),
            pools: self.pools.list(),
            volumes: volumes_changed,
            volumes_gone,
            namespaces: namespaces_changed,
            namespaces_gone,
        };
        *last = LastUsage { mark: report.mark, volumes, namespaces };
        report
    }
}

impl Engine {
    /// A mirror's faulted legs and its rebuild, if it has either (else the controller
    /// has nothing to do for it).
    fn mirror_usage(&self, nqn: &str, nsid: u32, m: &crate::backend::mirror::MirrorBackend) -> Option<MirrorUsage> {
        let faults = m.faults();
        if faults.is_empty() && !m.has_catching_up() {
            return None;
        }
        Some(MirrorUsage {
            nqn: nqn.to_string(),
            nsid,
            generation: m.generation().unwrap_or(0),
            faulted_legs: faults
                .into_iter()
                .map(|(leg, status)| FaultedLeg { leg, error: status.to_string() })
                .collect(),
            rebuild: m.has_catching_up().then(|| self.rebuilds.info(nqn, nsid)),
        })
    }
}

/// The entries of `now` that differ from `last` (all of them when there is no `last`),
/// and those of `last` gone from `now` (with default figures), made by `make`.
fn changes<K: Eq + Hash, V: Copy + PartialEq + Default, T>(
    now: &HashMap<K, V>,
    last: Option<&HashMap<K, V>>,
    make: impl Fn(&K, V) -> T,
) -> (Vec<T>, Vec<T>) {
    let changed = now.iter().filter(|&(k, v)| last.is_none_or(|l| l.get(k) != Some(v))).map(|(k, &v)| make(k, v));
    let gone = last.into_iter().flat_map(|l| l.keys()).filter(|k| !now.contains_key(*k)).map(|k| make(k, V::default()));
    (changed.collect(), gone.collect())
}

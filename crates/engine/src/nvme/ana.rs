//! Asymmetric Namespace Access (NVMe Base 2.0 §8.1): which paths a host should use.
//!
//! Every namespace is in an ANA group. Each engine that serves a subsystem keeps a
//! state per group, and may give one host a state of its own: two hosts can then see
//! different engines as the optimized path to the same volume (SPDK and Linux nvmet
//! keep one state per listener, which cannot say that). A controller holds its host's
//! view in atomics, so the I/O path reads its group's state without a lock.

use std::collections::BTreeMap;

use nvpool_api::{AnaGroupInfo, AnaHostState, AnaState};
use nvpool_wire::Status;
use nvpool_wire::log::{self, AnaGroup, ana_state};

use super::MAX_NSID;
use super::subsystem::NamespaceMap;
use serde::{Deserialize, Serialize};

/// Highest ANA group ID (ANAGRPMAX, and NANAGRPID): a group per namespace at most.
pub const MAX_ANA_GROUP: u32 = MAX_NSID;
/// ANA Transition Time in seconds: the Linux host resets a controller whose group
/// stays in the change state for twice this long.
pub const ANA_TRANSITION_TIME_S: u8 = 10;

/// The state's code in the ANA log.
pub fn code(state: AnaState) -> u8 {
    match state {
        AnaState::Optimized => ana_state::OPTIMIZED,
        AnaState::NonOptimized => ana_state::NON_OPTIMIZED,
        AnaState::Inaccessible => ana_state::INACCESSIBLE,
        AnaState::PersistentLoss => ana_state::PERSISTENT_LOSS,
        AnaState::Change => ana_state::CHANGE,
    }
}

/// The state with this code in the ANA log.
pub fn from_code(c: u8) -> Option<AnaState> {
    AnaState::ALL.into_iter().find(|&s| code(s) == c)
}

/// What an I/O command on a path in this state is answered with, where it is not
/// served. Never with Do Not Retry: the host must retry it on another path, not fail
/// it to the application.
pub fn io_status(state: AnaState) -> Option<Status> {
    match state {
        AnaState::Optimized | AnaState::NonOptimized => None,
        AnaState::Inaccessible => Some(Status::ANA_INACCESSIBLE),
        AnaState::PersistentLoss => Some(Status::ANA_PERSISTENT_LOSS),
        AnaState::Change => Some(Status::ANA_TRANSITION),
    }
}

/// Checks a group ID given by management.
pub fn check_group(group: u32) -> Result<(), String> {
    if group == 0 || group > MAX_ANA_GROUP {
        return Err(format!("ANA group {group} is out of range: use 1 to {MAX_ANA_GROUP}"));
    }
    Ok(())
}

/// The ANA states of one subsystem's groups on this engine. A group with no state
/// set is optimized.
#[derive(Debug, Default)]
pub struct AnaTable {
    groups: BTreeMap<u32, AnaState>,
    hosts: BTreeMap<(String, u32), AnaState>,
    change_count: u64,
}

impl AnaTable {
    /// The table, for a new engine process.
    pub fn image(&self) -> AnaImage {
        AnaImage {
            groups: self.groups.iter().map(|(&g, &s)| (g, s)).collect(),
            hosts: self.hosts.iter().map(|((h, g), &s)| (h.clone(), *g, s)).collect(),
            change_count: self.change_count,
        }
    }

    /// The table another engine process left.
    pub fn restore(i: &AnaImage) -> AnaTable {
        AnaTable {
            groups: i.groups.iter().copied().collect(),
            hosts: i.hosts.iter().map(|(h, g, s)| ((h.clone(), *g), *s)).collect(),
            change_count: i.change_count,
        }
    }

    /// The state `host` sees for `group`.
    pub fn state(&self, host: &str, group: u32) -> AnaState {
        self.hosts.get(&(host.to_string(), group)).copied().unwrap_or_else(|| self.group_state(group))
    }

    /// The groups whose state `host` sees as other than optimized, with that state.
    pub fn view(&self, host: &str) -> Vec<(u32, AnaState)> {
        let mut v: BTreeMap<u32, AnaState> = self.groups.clone();
        v.extend(self.hosts.iter().filter(|((h, _), _)| h == host).map(|((_, g), &s)| (*g, s)));
        v.into_iter().filter(|&(_, s)| s != AnaState::Optimized).collect()
    }

    /// The state of `group` for hosts without their own.
    pub fn group_state(&self, group: u32) -> AnaState {
        self.groups.get(&group).copied().unwrap_or(AnaState::Optimized)
    }

    /// Sets the state of `group` for `host`, or for every host without its own.
    pub fn set(&mut self, host: Option<&str>, group: u32, state: AnaState) {
        match host {
            Some(h) => self.hosts.insert((h.to_string(), group), state),
            None => self.groups.insert(group, state),
        };
        self.change_count += 1;
    }

    /// How many changes were made: the ANA log's change count.
    pub fn change_count(&self) -> u64 {
        self.change_count
    }

    /// The groups of `namespaces` with their states, for management.
    pub fn describe(&self, namespaces: &NamespaceMap) -> Vec<AnaGroupInfo> {
        groups_of(namespaces)
            .into_iter()
            .map(|(group, nsids)| AnaGroupInfo {
                group,
                nsids,
                state: self.group_state(group),
                hosts: self
                    .hosts
                    .iter()
                    .filter(|((_, g), _)| *g == group)
                    .map(|((host, _), &state)| AnaHostState { host: host.clone(), state })
                    .collect(),
            })
            .collect()
    }
}

/// The groups that hold namespaces, ascending, each with its NSIDs ascending.
fn groups_of(namespaces: &NamespaceMap) -> Vec<(u32, Vec<u32>)> {
    let mut groups: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    // The map is ordered by NSID, so each list comes out ascending, as the Linux
    // host needs it (it walks its sorted namespaces and each list in step).
    for ns in namespaces.values() {
        groups.entry(ns.ana_group).or_default().push(ns.nsid);
    }
    groups.into_iter().collect()
}

/// The ANA log page (Log Identifier 0Ch) for a controller whose view of each group
/// `state` gives: a descriptor per group that holds a namespace, ascending, and with
/// `groups_only` (RGO) no NSID lists.
pub fn log_page(
    namespaces: &NamespaceMap,
    state: impl Fn(u32) -> AnaState,
    change_count: u64,
    groups_only: bool,
) -> Vec<u8> {
    let groups: Vec<AnaGroup> = groups_of(namespaces)
        .into_iter()
        .map(|(grpid, nsids)| AnaGroup { grpid, chgcnt: change_count, state: code(state(grpid)), nsids })
        .collect();
    log::encode_ana_log(change_count, &groups, groups_only)
}

/// The largest ANA log page: the buffer the Linux host reads it into, from the
/// advertised maxima (it disables ANA if this is over MDTS).
pub const MAX_LOG_PAGE: usize = 16 + MAX_ANA_GROUP as usize * 32 + MAX_NSID as usize * 4;
const _: () = assert!(MAX_LOG_PAGE <= super::MAX_TRANSFER, "the largest ANA log must fit one transfer (MDTS)");

/// A subsystem's ANA table.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct AnaImage {
    /// Group states for hosts without their own.
    pub groups: Vec<(u32, AnaState)>,
    /// Per-host states.
    pub hosts: Vec<(String, u32, AnaState)>,
    /// The change count the ANA log reports.
    pub change_count: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::null::Null;
    use crate::nvme::Namespace;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn namespaces(groups: &[(u32, u32)]) -> NamespaceMap {
        groups
            .iter()
            .map(|&(nsid, group)| {
                let mut id = [0u8; 16];
                id[..4].copy_from_slice(&nsid.to_le_bytes());
                let mut ns = Namespace::new(nsid, Arc::new(Null::new(1 << 20)), 512, id, id).unwrap();
                ns.ana_group = group;
                (nsid, Arc::new(ns))
            })
            .collect()
    }

    #[test]
    fn a_host_of_its_own_sees_its_state_and_others_the_groups() {
        let mut t = AnaTable::default();
        assert_eq!(t.state("h1", 1), AnaState::Optimized, "unset groups are optimized");
        t.set(None, 1, AnaState::NonOptimized);
        t.set(Some("h1"), 1, AnaState::Inaccessible);
        assert_eq!(t.state("h1", 1), AnaState::Inaccessible);
        assert_eq!(t.state("h2", 1), AnaState::NonOptimized);
        assert_eq!(t.state("h1", 2), AnaState::Optimized);
        assert_eq!(t.change_count(), 2);
        let d = t.describe(&namespaces(&[(1, 1), (2, 2)]));
        assert_eq!(d[0].hosts, vec![AnaHostState { host: "h1".into(), state: AnaState::Inaccessible }]);
        assert_eq!(d[1].state, AnaState::Optimized);
    }

    #[test]
    fn paths_in_service_are_served_and_the_others_are_retried_elsewhere() {
        for s in AnaState::ALL {
            assert_eq!(from_code(code(s)), Some(s));
            let status = io_status(s);
            assert_eq!(status.is_none(), matches!(s, AnaState::Optimized | AnaState::NonOptimized));
            if let Some(st) = status {
                assert_eq!(st.code_type(), 3, "a path-related status");
                assert!(!st.dnr(), "never Do Not Retry");
            }
        }
    }

    #[test]
    fn the_largest_log_fits_one_transfer() {
        let all: Vec<(u32, u32)> = (1..=MAX_NSID).map(|n| (n, n)).collect();
        let page = log_page(&namespaces(&all), |_| AnaState::Optimized, 1, false);
        assert_eq!(page.len(), MAX_LOG_PAGE);
    }

    proptest! {
        /// Any mix of namespaces, groups and states: the log lists each group that
        /// holds a namespace once, ascending, with its state and its NSIDs ascending,
        /// and every namespace in exactly one descriptor.
        #[test]
        fn the_log_lists_every_group_with_its_namespaces_in_order(
            placement in proptest::collection::btree_map(1u32..=MAX_NSID, 1u32..=MAX_ANA_GROUP, 0..64),
            states in proptest::collection::vec((1u32..=MAX_ANA_GROUP, 0usize..5, any::<bool>()), 0..16),
            groups_only in any::<bool>(),
        ) {
            let pairs: Vec<(u32, u32)> = placement.iter().map(|(&n, &g)| (n, g)).collect();
            let map = namespaces(&pairs);
            let mut table = AnaTable::default();
            for &(group, s, for_host) in &states {
                table.set(for_host.then_some("h"), group, AnaState::ALL[s]);
            }
            let page = log_page(&map, |g| table.state("h", g), table.change_count(), groups_only);
            let (chgcnt, groups) = log::decode_ana_log(&page).expect("a well-formed page");
            prop_assert_eq!(chgcnt, table.change_count());
            let mut seen = Vec::new();
            for w in groups.windows(2) {
                prop_assert!(w[0].grpid < w[1].grpid);
            }
            for g in &groups {
                prop_assert!(g.grpid >= 1 && g.grpid <= MAX_ANA_GROUP);
                prop_assert_eq!(from_code(g.state), Some(table.state("h", g.grpid)));
                if groups_only {
                    prop_assert!(g.nsids.is_empty());
                } else {
                    prop_assert!(!g.nsids.is_empty());
                    prop_assert!(g.nsids.windows(2).all(|w| w[0] < w[1]));
                    for n in &g.nsids {
                        prop_assert_eq!(placement[n], g.grpid);
                    }
                    seen.extend(g.nsids.iter().copied());
                }
            }
            if !groups_only {
                seen.sort_unstable();
                prop_assert_eq!(seen, placement.keys().copied().collect::<Vec<_>>());
            }
            let distinct: std::collections::BTreeSet<u32> = placement.values().copied().collect();
            prop_assert_eq!(groups.len(), distinct.len());
        }
    }
}

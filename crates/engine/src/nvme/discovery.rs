//! The discovery log page (NVMe-oF 1.1 §5.3): one entry per listener for the
//! discovery subsystem itself, and for every NVM subsystem the asking host may
//! connect to, one entry per access point the host was given for it (the cluster's
//! view, this engine's own address among them), or else one per listener of this
//! engine. Listeners show the engine's host-facing address when it was set.

use nvpool_api::PathAddress;
use nvpool_wire::bytes::nul;
use nvpool_wire::fabrics::DISCOVERY_NQN;
use nvpool_wire::log::{
    ADRFAM_IPV4, ADRFAM_IPV6, DiscoveryLogEntry, DiscoveryLogHeader, SUBTYPE_CURRENT_DISCOVERY, SUBTYPE_NVME,
    TREQ_NOT_REQUIRED, TREQ_REQUIRED, TRTYPE_RDMA, TRTYPE_TCP, TSAS_SECTYPE_TLS13,
};

use super::{ADMIN_QUEUE_DEPTH, ListenerInfo, Target, Transport};
use crate::tls::TlsMode;

/// Port IDs of the entries for a host's access points: the position in its list
/// after this base, apart from this engine's listeners (numbered from 1). Each
/// engine serving a subsystem is another port of it.
const ACCESS_POINT_PORT_IDS: u16 = 0x8000;

fn entry(l: &ListenerInfo, subtype: u8, subnqn: &str) -> DiscoveryLogEntry {
    // A TLS listener says so, as nvmet's tls1.3 ports do: SECTYPE TLS 1.3, and whether
    // the secure channel is required.
    // An RDMA port says how to reach it: reliable connected queue pairs through the
    // RDMA IP connection manager.
    let (trtype, tsas) = match l.transport {
        Transport::Tcp => {
            let mut tsas = [0u8; 256];
            if l.tls != TlsMode::Off {
                tsas[0] = TSAS_SECTYPE_TLS13;
            }
            (TRTYPE_TCP, tsas)
        }
        Transport::Rdma => (TRTYPE_RDMA, nvpool_wire::rdma::discovery_tsas()),
    };
    DiscoveryLogEntry {
        trtype,
        adrfam: if l.addr.is_ipv4() { ADRFAM_IPV4 } else { ADRFAM_IPV6 },
        subtype,
        treq: if l.tls == TlsMode::Required { TREQ_REQUIRED } else { TREQ_NOT_REQUIRED },
        tsas,
        portid: l.port_id,
        cntlid: nvpool_wire::fabrics::CNTLID_DYNAMIC,
        asqsz: ADMIN_QUEUE_DEPTH,
        trsvcid: nul(&l.port.to_string()),
        subnqn: nul(subnqn),
        traddr: nul(&l.addr.to_string()),
        ..DiscoveryLogEntry::default()
    }
}

/// Access point `i` of a host's list, as a listener: another engine's takes the TLS
/// setting of this engine's listeners of its transport (the engines of a cluster
/// are set up alike).
fn access_point(i: usize, p: &PathAddress, listeners: &[ListenerInfo]) -> ListenerInfo {
    let tls = listeners.iter().find(|l| l.transport == p.transport).map_or(TlsMode::Off, |l| l.tls);
    ListenerInfo {
        port_id: ACCESS_POINT_PORT_IDS.saturating_add(i as u16),
        addr: p.address.ip(),
        port: p.address.port(),
        tls,
        transport: p.transport,
    }
}

/// The whole discovery log page as `hostnqn` sees it.
pub fn log_page(target: &Target, hostnqn: &str) -> Vec<u8> {
    let mut listeners = target.listeners();
    if let Some(shown) = target.discovery_address() {
        for l in &mut listeners {
            l.addr = shown;
        }
    }
    let mut entries = Vec::new();
    for l in &listeners {
        entries.push(entry(l, SUBTYPE_CURRENT_DISCOVERY, DISCOVERY_NQN));
    }
    for s in target.subsystems() {
        if s.is_discovery() || !s.host_allowed(hostnqn) {
            continue;
        }
        match s.host_paths(hostnqn) {
            Some(paths) => {
                for (i, p) in paths.iter().enumerate() {
                    entries.push(entry(&access_point(i, p, &listeners), SUBTYPE_NVME, &s.nqn));
                }
            }
            None => {
                for l in &listeners {
                    entries.push(entry(l, SUBTYPE_NVME, &s.nqn));
                }
            }
        }
    }
    let header = DiscoveryLogHeader { genctr: target.discovery_generation(), numrec: entries.len() as u64, recfmt: 0 };
    let mut page = header.to_vec();
    for e in entries {
        page.extend_from_slice(&e.to_vec());
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Limits;
    use crate::nvme::subsystem::{HostPolicy, Subsystem};
    use nvpool_wire::bytes::get_nul_padded;

    /// A target with one plain NVMe/TCP listener, 127.0.0.1:4420.
    fn target_listening_on_4420() -> std::sync::Arc<Target> {
        let t = Target::new(Limits::default());
        t.add_listener_info(ListenerInfo {
            port_id: 1,
            addr: "127.0.0.1".parse().unwrap(),
            port: 4420,
            tls: TlsMode::Off,
            transport: Transport::Tcp,
        });
        t
    }

    #[test]
    fn lists_only_allowed_subsystems() {
        let t = target_listening_on_4420();
        let open = Subsystem::new(
            "nqn.2024-01.io.nvpool:open",
            "S1",
            "m",
            HostPolicy { allow_any: true, ..Default::default() },
        )
        .unwrap();
        let closed = Subsystem::new("nqn.2024-01.io.nvpool:closed", "S2", "m", HostPolicy::default()).unwrap();
        t.add_subsystem(open).unwrap();
        t.add_subsystem(closed).unwrap();
        let page = log_page(&t, "nqn.someone");
        let h = DiscoveryLogHeader::decode(&page).unwrap();
        assert_eq!(h.numrec, 2);
        assert_eq!(page.len(), 1024 * 3);
        let e = DiscoveryLogEntry::decode(&page[2048..]).unwrap();
        assert_eq!(get_nul_padded(&e.subnqn, 0, 256), "nqn.2024-01.io.nvpool:open");
        assert_eq!(get_nul_padded(&e.trsvcid, 0, 32), "4420");
        assert_eq!(e.subtype, SUBTYPE_NVME);
    }

    /// Every entry of a page, after its header.
    fn entries(page: &[u8]) -> Vec<DiscoveryLogEntry> {
        page[1024..].chunks(1024).map(|e| DiscoveryLogEntry::decode(e).unwrap()).collect()
    }

    fn address(e: &DiscoveryLogEntry) -> String {
        format!("{}:{}", get_nul_padded(&e.traddr, 0, 256), get_nul_padded(&e.trsvcid, 0, 32))
    }

    /// A host given its access points sees them, this engine's among them, in place
    /// of the listeners; other hosts still see the listeners, at the host-facing
    /// address once it is set; taking the host off forgets its paths. Each change
    /// moves the generation on.
    #[test]
    fn a_host_sees_its_access_points_and_the_host_facing_address() {
        let t = target_listening_on_4420();
        let nqn = "nqn.2024-01.io.nvpool:v";
        let s = Subsystem::new(nqn, "S1", "m", HostPolicy::default()).unwrap();
        for h in ["nqn.h1", "nqn.h2"] {
            s.add_host(h, None).unwrap();
        }
        t.add_subsystem(s.clone()).unwrap();
        let paths: Vec<PathAddress> =
            ["10.0.0.2:4420", "10.0.0.1:4420", "rdma:10.0.0.3:4420"].iter().map(|p| p.parse().unwrap()).collect();
        let before = t.discovery_generation();
        assert!(s.set_host_paths("nqn.h1", paths.clone()).unwrap());
        assert!(!s.set_host_paths("nqn.h1", paths).unwrap(), "the same paths change nothing");

        let page = log_page(&t, "nqn.h1");
        let h1 = entries(&page);
        assert_eq!(h1.len(), 4, "its discovery listener and three access points");
        assert_eq!(h1[0].subtype, SUBTYPE_CURRENT_DISCOVERY);
        let shown: Vec<String> = h1[1..].iter().map(address).collect();
        assert_eq!(shown, ["10.0.0.2:4420", "10.0.0.1:4420", "10.0.0.3:4420"]);
        assert_eq!(h1[3].trtype, TRTYPE_RDMA);
        assert!(h1[1..].iter().all(|e| e.subtype == SUBTYPE_NVME && get_nul_padded(&e.subnqn, 0, 256) == nqn));

        let h2 = entries(&log_page(&t, "nqn.h2"));
        assert_eq!(h2.iter().map(address).collect::<Vec<_>>(), ["127.0.0.1:4420", "127.0.0.1:4420"]);
        t.set_discovery_address(Some("192.0.2.7".parse().unwrap()));
        let h2 = entries(&log_page(&t, "nqn.h2"));
        assert_eq!(h2.iter().map(address).collect::<Vec<_>>(), ["192.0.2.7:4420", "192.0.2.7:4420"]);

        s.remove_host("nqn.h1").unwrap();
        assert_eq!(entries(&log_page(&t, "nqn.h1")).len(), 1, "a host taken off sees the discovery entry only");
        s.add_host("nqn.h1", None).unwrap();
        assert_eq!(entries(&log_page(&t, "nqn.h1")).len(), 2, "allowed again, it sees the listeners: no paths kept");
        assert!(DiscoveryLogHeader::decode(&log_page(&t, "nqn.h1")).unwrap().genctr > before);
    }

    #[test]
    fn tls_listeners_report_tls_1_3_and_whether_it_is_required() {
        let t = Target::new(Limits::default());
        for (port_id, tls) in [(1, TlsMode::Off), (2, TlsMode::Allowed), (3, TlsMode::Required)] {
            t.add_listener_info(ListenerInfo {
                port_id,
                addr: "127.0.0.1".parse().unwrap(),
                port: 4419 + port_id,
                tls,
                transport: Transport::Tcp,
            });
        }
        let page = log_page(&t, "nqn.someone");
        let entries: Vec<DiscoveryLogEntry> =
            (0..3).map(|i| DiscoveryLogEntry::decode(&page[1024 * (i + 1)..]).unwrap()).collect();
        assert_eq!((entries[0].treq, entries[0].tsas[0]), (TREQ_NOT_REQUIRED, 0));
        assert_eq!((entries[1].treq, entries[1].tsas[0]), (TREQ_NOT_REQUIRED, TSAS_SECTYPE_TLS13));
        assert_eq!((entries[2].treq, entries[2].tsas[0]), (TREQ_REQUIRED, TSAS_SECTYPE_TLS13));
    }

    #[test]
    fn rdma_listeners_report_their_transport_and_how_to_reach_them() {
        let t = Target::new(Limits::default());
        let addr = "192.168.77.1".parse().unwrap();
        t.add_listener_info(ListenerInfo {
            port_id: 7,
            addr,
            port: 4420,
            tls: TlsMode::Off,
            transport: Transport::Rdma,
        });
        let page = log_page(&t, "nqn.someone");
        let e = DiscoveryLogEntry::decode(&page[1024..]).unwrap();
        assert_eq!(e.trtype, TRTYPE_RDMA);
        assert_eq!(e.tsas[..3], [1, 1, 1], "reliable connected, no provider named, RDMA IP CM");
        assert_eq!(e.treq, TREQ_NOT_REQUIRED);
        assert_eq!(get_nul_padded(&e.traddr, 0, 256), "192.168.77.1");
    }
}

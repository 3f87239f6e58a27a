//! A power cut of one replica's node under replicated writes. Both nodes keep their
//! pools on disks with a volatile write cache (`cache_disk`); each engine sees a boot
//! ID of its own. A host writes a first region of the volume and stops (those writes
//! are acknowledged by both replicas, part of them still in the replica's disk cache),
//! then writes a second region without pause. The replica's node loses power under
//! those writes: its engine and agent are killed, its disk loses a random half of what
//! it cached, and it comes back on a new boot. Its pool counts the power loss; the
//! controller rebuilds that replica in full (the serving engine's record only names
//! what was written after it left, not what its disks lost of what they had
//! acknowledged). Afterwards every acknowledged write reads back through the serving
//! node and from the rebuilt replica directly. Without the power-loss count the
//! replica is rebuilt from the record alone and lacks about half of the first region.
//!
//! Runs as root: it mounts a FUSE file system and binds a boot ID over the machine's
//! in each engine's own mount namespace.

mod cache_disk;
mod cluster;

use cache_disk::CacheDisks;
use cluster::{
    BLOCK, HOST, LogsOnFailure, Model, Node, addr, connect, create_request, free_port, host_writer_in,
    start_controller, verify, wait_for,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_initiator::pattern;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const VOLUME: &str = "pc";
const SIZE: u64 = 32 * MIB;
/// The region written before the cut and never again, in blocks.
const FIRST: std::ops::Range<u64> = 0..1024;
/// The region written across the cut.
const SECOND: std::ops::Range<u64> = 1024..2048;

async fn volume(c: &Controllers) -> proto::Volume {
    let req = proto::VolumeName { name: VOLUME.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.unwrap()
}

fn new_boot(file: &Path, n: u32) {
    std::fs::write(file, format!("00000000-0000-4000-8000-{n:012}\n")).unwrap();
}

/// The blocks of `range` that volume `engine_name` of node `n`'s pool does not hold
/// as the model says, read through a subsystem made for the look (agent stopped).
fn blocks_lacking(n: &Node, engine_name: &str, model: &Model, range: std::ops::Range<u64>) -> Vec<u64> {
    let nqn = "nqn.2024-01.io.nvpool:power-cut-look".to_string();
    n.engine_call(nvpool_api::AddSubsystem(nvpool_api::SubsystemConfig {
        nqn: nqn.clone(),
        serial: None,
        model: "nvpool".into(),
        allow_any_host: true,
        hosts: vec![],
        dhchap: vec![],
        tls_psk: vec![],
        namespaces: vec![nvpool_api::NamespaceConfig {
            nsid: Some(1),
            backend: format!("volume:{}-pool/{engine_name}", n.name),
            block_size: BLOCK as u32,
            uuid: None,
            allow_torn_writes: false,
            ana_group: None,
            qos: Default::default(),
        }],
    }));
    let mut path = connect(addr(n), &nqn).expect("connect to the look");
    let mut lacking = Vec::new();
    for (&lba, &seed) in model.lock().unwrap().iter().filter(|(lba, _)| range.contains(lba)) {
        if path.io.read(1, lba, 1, BLOCK as u32).unwrap() != pattern(seed, BLOCK) {
            lacking.push(lba);
        }
    }
    drop(path);
    n.engine_call(nvpool_api::RemoveSubsystem { nqn });
    lacking
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_node_lost_power_is_rebuilt_in_full_and_nothing_acknowledged_is_lost() {
    let (root, mut seed) = cluster::crash_run();
    let _logs = LogsOnFailure(root.path());
    let names = ["a", "b"];
    let disks = CacheDisks::mount(root.path(), &names, 128 * MIB);
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let boot_file = |name: &str| root.path().join(format!("{name}.boot_id"));
    let mut nodes: Vec<Node> = names
        .iter()
        .map(|name| {
            new_boot(&boot_file(name), 1);
            Node::on_disk(root.path(), name, disks.path(name), Some(boot_file(name)))
        })
        .collect();
    for n in nodes.iter_mut() {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    cluster::wait_healthy(&c, &names).await;
    // Thick: no allocation syncs the disks while the host writes, so what the host
    // wrote stays in the replica's disk cache until the cut.
    let req = proto::CreateVolumeRequest { thin: false, replicas: 2, ..create_request(VOLUME, SIZE) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let index = |name: &str| names.iter().position(|n| *n == name).unwrap();
    let serving = index(&v.node);
    let replica = 1 - serving;
    let (nqn, engine_name) = (v.subsystem_nqn.clone(), format!("pv-{}", v.id));
    let paths = volume(&c).await.attachments[0].paths.iter().map(|p| addr(&nodes[index(&p.node)])).collect::<Vec<_>>();
    println!("{} serves, {} holds the other replica", names[serving], names[replica]);

    // The first region, written and then left alone: both replicas acknowledged it.
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let first = host_writer_in(paths.clone(), nqn.clone(), model.clone(), stop.clone(), FIRST);
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::SeqCst);
    let (first_writes, first_errors) = first.join().unwrap();
    println!("first region: {first_writes} writes, {} blocks", model.lock().unwrap().len());

    // The second region under writes the whole time; the replica's node loses power.
    let stop = Arc::new(AtomicBool::new(false));
    let second = host_writer_in(paths.clone(), nqn.clone(), model.clone(), stop.clone(), SECOND);
    tokio::time::sleep(Duration::from_secs(2)).await;
    nodes[replica].agent.kill();
    nodes[replica].engine.kill();
    let (lost, landed) = disks.cut(names[replica], &mut seed);
    println!("power cut on {}: {lost} cached sectors lost, {landed} landed", names[replica]);
    wait_for("the replica faulted", Duration::from_secs(30), async || {
        let v = volume(&c).await;
        v.replicas.iter().any(|r| r.node == names[replica] && r.state.starts_with("faulted")).then_some(())
    })
    .await;

    // Back on a new boot: its pool counts a power loss, and its copy of the first
    // region lacks writes it had acknowledged (the harness saw a power loss).
    new_boot(&boot_file(names[replica]), 2);
    nodes[replica].start_engine(true);
    let pools = nodes[replica].engine_call(nvpool_api::ListPools {});
    assert_eq!(pools[0].power_losses, 1, "the pool counts the power loss: {pools:?}");
    let lacking = blocks_lacking(&nodes[replica], &engine_name, &model, FIRST);
    println!("the replica lacks {} blocks of the first region after the cut", lacking.len());
    nodes[replica].start_agent(&controller.address);
    let v2 = wait_for("the replica rebuilt and in sync", Duration::from_secs(120), async || {
        let v = volume(&c).await;
        v.replicas.iter().all(|r| r.state == "in-sync").then_some(v)
    })
    .await;
    let rebuild = nodes[serving].engine_call(nvpool_api::GetRebuild { nqn: nqn.clone(), nsid: 1 });
    println!("rebuild: {rebuild:?}; now at generation {}", v2.generation);
    let allocated = nodes[serving]
        .engine_call(nvpool_api::GetVolume { pool: format!("{}-pool", names[serving]), name: engine_name.clone() })
        .allocated_bytes;
    assert_eq!(rebuild.total_bytes, allocated, "a full rebuild copies every allocated cluster: {rebuild:?}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::SeqCst);
    let (second_writes, second_errors) = second.join().unwrap();
    println!("second region: {second_writes} writes; errors {first_errors} + {second_errors}");
    assert_eq!(first_errors + second_errors, 0, "the host saw errors");
    assert!(!lacking.is_empty(), "the cut cost the replica no acknowledged write: this run proves nothing");

    // Every acknowledged write, through the serving node and on the rebuilt replica.
    for n in nodes.iter_mut() {
        n.agent.kill();
    }
    verify(addr(&nodes[serving]), &nqn, &model, "the serving node");
    let replica_nqn = format!("{nqn}-replica");
    nodes[replica].engine_call(nvpool_api::AddHost {
        nqn: replica_nqn.clone(),
        host: HOST.into(),
        dhchap: None,
        tls_psk: None,
    });
    verify(addr(&nodes[replica]), &replica_nqn, &model, "the rebuilt replica");
}

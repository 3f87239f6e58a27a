//! Hot migration across crashes: twenty moves of a volume between two nodes while a
//! host writes, each with one process killed (SIGKILL) at a random moment of the move
//! and started again: the source's engine, the target's engine, the controller, the
//! source's agent or the target's agent, in turn. Every move must end, done or rolled
//! back, with the volume on one node, served, every acknowledged write in it, and no
//! copy left on the other node. NVPOOL_CRASH_SEED replays a run's random moments.

mod cluster;

use cluster::{
    BLOCK, HOST, Model, Node, addr, create_request, free_port, hold_paths, host_writer, next, start_controller, verify,
    wait_for, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const RUNS: usize = 20;
const VOLUME: &str = "cv";

const VICTIMS: [&str; 5] = ["source engine", "target engine", "controller", "source agent", "target agent"];

/// The volume as the controller sees it, or None while the controller is away.
async fn volume(c: &Controllers) -> Option<proto::Volume> {
    let req = proto::VolumeName { name: VOLUME.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_end_done_or_rolled_back_whatever_process_is_killed() {
    let (root, seed) = cluster::crash_run();
    let mut rng = seed;
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let port = free_port();
    let mut controller = start_controller(root.path(), &store, port, "1");
    let mut nodes_: Vec<Node> = ["n1", "n2"].iter().map(|n| Node::new(root.path(), n, 512 * MIB)).collect();
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2"]).await;
    let req =
        proto::CreateVolumeRequest { thin: true, include_nodes: vec!["n1".into()], ..create_request(VOLUME, 32 * MIB) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let nqn = v.subsystem_nqn.clone();
    let addrs = vec![addr(&nodes_[0]), addr(&nodes_[1])];
    let holding = Arc::new(AtomicBool::new(false));
    let holder = hold_paths(addrs.clone(), nqn.clone(), holding.clone());
    let model: Model = Arc::default();
    let blocks = 32 * MIB / BLOCK as u64;

    let mut outcomes = Vec::new();
    for run in 0..RUNS {
        let from = volume(&c).await.unwrap().node;
        let (src, dst) = if from == "n1" { (0, 1) } else { (1, 0) };
        let to = nodes_[dst].name.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let writer = host_writer(addrs.clone(), nqn.clone(), model.clone(), stop.clone(), blocks);
        tokio::time::sleep(Duration::from_millis(200)).await;

        // Retried while an earlier move's copy on the target is still being removed.
        let req = proto::MigrateVolumeRequest {
            name: VOLUME.into(),
            to_node: to.clone(),
            pause_ms: 500,
            ..Default::default()
        };
        wait_for("the move to start", Duration::from_secs(60), async || {
            c.call(async |mut c| c.migrate_volume(req.clone()).await).await.ok()
        })
        .await;
        let started = Instant::now();
        let victim = run % VICTIMS.len();
        let at = Duration::from_millis(next(&mut rng) % 2500);
        tokio::time::sleep(at).await;
        let phase = volume(&c).await.and_then(|v| v.migration).map_or("ended".into(), |m| m.phase);
        let down = Duration::from_millis(300 + next(&mut rng) % 1200);
        match victim {
            0 | 1 => {
                let n = if victim == 0 { src } else { dst };
                nodes_[n].engine.kill();
                tokio::time::sleep(down).await;
                nodes_[n].start_engine(true);
            }
            2 => {
                controller.proc.kill();
                tokio::time::sleep(down).await;
                controller = start_controller(root.path(), &store, port, &format!("{}", run + 2));
            }
            _ => {
                let n = if victim == 3 { src } else { dst };
                nodes_[n].agent.kill();
                tokio::time::sleep(down).await;
                nodes_[n].start_agent(&controller.address);
            }
        }
        let ended = wait_for("the move to end", Duration::from_secs(120), async || {
            volume(&c).await.filter(|v| v.migration.is_none())
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        let (writes, errors) = writer.join().expect("the host writer");
        let outcome = if ended.last_migration.starts_with(&format!("moved from {from} to {to}")) {
            assert_eq!(ended.node, to);
            "moved"
        } else {
            assert!(
                ended.last_migration.contains("failed") || ended.last_migration.contains("cancelled"),
                "run {run}: {}",
                ended.last_migration
            );
            assert_eq!(ended.node, from, "a move that did not happen leaves the volume where it was");
            "rolled back"
        };
        println!(
            "run {run:2}: {} killed {:.1} s into the move ({phase}), down {:.1} s: {outcome} in {:.1} s; the host \
             wrote {writes} blocks, {errors} errors; {}",
            VICTIMS[victim],
            at.as_secs_f64(),
            down.as_secs_f64(),
            started.elapsed().as_secs_f64(),
            ended.last_migration
        );
        assert_eq!(errors, 0, "run {run}: the host saw errors");
        let owner = if ended.node == "n1" { 0 } else { 1 };
        verify(addr(&nodes_[owner]), &nqn, &model, &format!("{} after run {run}", ended.node));
        let other = &nodes_[1 - owner];
        let engine_name = format!("pv-{}", v.id);
        wait_for("the other node to keep no copy", Duration::from_secs(60), async || {
            let kept = nvpool_api::call(&other.socket(), &nvpool_api::ListVolumes { pool: None });
            kept.ok().filter(|vs| !vs.iter().any(|v| v.name == engine_name)).map(|_| ())
        })
        .await;
        outcomes.push((victim, outcome));
    }
    holding.store(true, Ordering::SeqCst);
    holder.join().unwrap();
    for (i, name) in VICTIMS.iter().enumerate() {
        let of = |what: &str| outcomes.iter().filter(|(v, o)| *v == i && *o == what).count();
        println!("{name} killed: {} moved, {} rolled back", of("moved"), of("rolled back"));
    }
}

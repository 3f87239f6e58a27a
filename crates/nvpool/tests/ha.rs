//! Controller HA on a real etcd: three controllers, one leads. A client streams
//! CreateVolume calls while the leader is killed (SIGKILL), twice. Every call must
//! succeed exactly once: the volumes listed, and those on the engine, are exactly the
//! ones requested. A new leader must take over within seconds.

mod cluster;

use cluster::{
    ControllerProc, LogsOnFailure, Node, create_request, free_port, start_controller, volumes, wait_for, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use nvpool_control::testkit::Etcd;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

const CALLS: usize = 60;
const KILL_AT: [usize; 2] = [15, 35];

/// Which of the controllers leads now, if one does.
async fn leader(addresses: &[String]) -> Option<usize> {
    for (i, a) in addresses.iter().enumerate() {
        let mut c = Controllers::new(a).unwrap();
        c.patience = Duration::ZERO;
        if let Ok(info) = c.call(async |mut c| c.cluster_info(proto::ClusterInfoRequest {}).await).await
            && info.leader
        {
            return Some(i);
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_dies_under_a_stream_of_creates() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let etcd = Etcd::start(root.path().to_path_buf());
    let store = format!("etcd:{}", etcd.client_url);
    let mut controllers: Vec<ControllerProc> =
        (0..3).map(|i| start_controller(root.path(), &store, free_port(), &i.to_string())).collect();
    let addresses: Vec<String> = controllers.iter().map(|c| c.address.clone()).collect();
    let all = addresses.join(",");
    let mut node = Node::new(root.path(), "n1", 2 << 30);
    node.start_agent(&all);
    let mut client = Controllers::new(&all).unwrap();
    client.patience = Duration::from_secs(60);
    let client = Arc::new(client);
    wait_healthy(&client, &["n1"]).await;

    let done = Arc::new(AtomicUsize::new(0));
    let creator = {
        let (client, done) = (client.clone(), done.clone());
        tokio::spawn(async move {
            let mut slowest = Duration::ZERO;
            for i in 0..CALLS {
                let req = proto::CreateVolumeRequest { thin: true, ..create_request(&format!("ha-{i:02}"), 4 << 20) };
                let started = Instant::now();
                let r = client.call(async |mut c| c.create_volume(req.clone()).await).await;
                let v = r.unwrap_or_else(|e| panic!("create ha-{i:02} failed: {}", e.message())).volume.unwrap();
                assert_eq!(v.state, "ready");
                slowest = slowest.max(started.elapsed());
                done.store(i + 1, Ordering::SeqCst);
            }
            slowest
        })
    };

    for at in KILL_AT {
        wait_for("the stream to progress", Duration::from_secs(120), async || {
            (done.load(Ordering::SeqCst) >= at).then_some(())
        })
        .await;
        let old = leader(&addresses).await.expect("a leader");
        controllers[old].proc.kill();
        let killed = Instant::now();
        let before = done.load(Ordering::SeqCst);
        let new = wait_for("a new leader", Duration::from_secs(30), async || leader(&addresses).await).await;
        assert_ne!(new, old);
        wait_for("a create served by the new leader", Duration::from_secs(30), async || {
            (done.load(Ordering::SeqCst) > before + 1).then_some(())
        })
        .await;
        println!(
            "killed leader {} after {before} creates; controller {new} leads; the stream moved on {:.2} s after the kill",
            addresses[old],
            killed.elapsed().as_secs_f64()
        );
    }
    let slowest = creator.await.unwrap();
    println!("{CALLS} creates, none failed; the slowest took {:.2} s (it spanned a failover)", slowest.as_secs_f64());

    // Exactly the requested volumes, each once, in the cluster and on the engine.
    let names: Vec<String> = volumes(&client).await.into_iter().map(|v| v.name).collect();
    let want: Vec<String> = (0..CALLS).map(|i| format!("ha-{i:02}")).collect();
    assert_eq!(names, want, "no call lost or duplicated");
    wait_for("the engine to hold exactly the listed volumes", Duration::from_secs(20), async || {
        let on_engine = node.engine_call(nvpool_api::ListVolumes { pool: None }).len();
        (on_engine == CALLS).then_some(())
    })
    .await;
    let subsystems = node.engine_call(nvpool_api::ListSubsystems {}).len();
    assert_eq!(subsystems, CALLS, "one export per volume");
}

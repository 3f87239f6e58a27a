//! Replication across crashes: thirty runs under a host that writes the whole time to
//! a volume of two replicas on three nodes, each run SIGKILLing a process at a
//! random moment (an engine, an agent or the controller; now and then a whole
//! node), starting it again a random while later, and sometimes killing another while
//! the first is still being recovered from (a rebuild, a failover). After each run
//! the volume comes back to two replicas in sync, and every acknowledged write reads
//! back through the node that serves it; at the end every replica holds every write.
//! NVPOOL_CRASH_SEED replays a run's random moments.

mod cluster;

use cluster::{
    BLOCK, HOST, Model, Node, addr, create_request, free_port, host_writer, next, start_controller, verify, wait_for,
    wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const RUNS: usize = 30;
const VOLUME: &str = "cr";
const SIZE: u64 = 32 * MIB;
const NAMES: [&str; 3] = ["n1", "n2", "n3"];

async fn volume(c: &Controllers) -> Option<proto::Volume> {
    let req = proto::VolumeName { name: VOLUME.into() };
    c.call(async |mut c| c.get_volume(req.clone()).await).await.ok()
}

/// What a run kills.
#[derive(Clone, Copy, Debug)]
enum Victim {
    ServingEngine,
    ReplicaEngine,
    ServingAgent,
    ReplicaAgent,
    ServingNode,
    Controller,
}

const VICTIMS: [Victim; 6] = [
    Victim::ServingEngine,
    Victim::ReplicaEngine,
    Victim::ServingAgent,
    Victim::ReplicaAgent,
    Victim::ServingNode,
    Victim::Controller,
];

struct Cluster {
    root: tempfile::TempDir,
    store: String,
    port: u16,
    controller: cluster::ControllerProc,
    nodes: Vec<Node>,
    restarts: usize,
}

impl Cluster {
    /// Kills the victim's processes; returns what to start again.
    fn kill(&mut self, victim: Victim, v: &proto::Volume) -> (Victim, usize) {
        let index = |name: &str| NAMES.iter().position(|n| *n == name).unwrap();
        let serving = index(&v.node);
        let replica = v.replicas.iter().find(|r| !r.serving).map_or((serving + 1) % 3, |r| index(&r.node));
        match victim {
            Victim::ServingEngine => self.nodes[serving].engine.kill(),
            Victim::ReplicaEngine => self.nodes[replica].engine.kill(),
            Victim::ServingAgent => self.nodes[serving].agent.kill(),
            Victim::ReplicaAgent => self.nodes[replica].agent.kill(),
            Victim::ServingNode => {
                self.nodes[serving].agent.kill();
                self.nodes[serving].engine.kill();
            }
            Victim::Controller => self.controller.proc.kill(),
        }
        let node = match victim {
            Victim::ReplicaEngine | Victim::ReplicaAgent => replica,
            _ => serving,
        };
        (victim, node)
    }

    /// Starts again what `kill` killed.
    fn restart(&mut self, (victim, node): (Victim, usize)) {
        let address = self.controller.address.clone();
        let n = &mut self.nodes[node];
        match victim {
            Victim::ServingEngine | Victim::ReplicaEngine => n.start_engine(true),
            Victim::ServingAgent | Victim::ReplicaAgent => n.start_agent(&address),
            Victim::ServingNode => {
                n.start_engine(true);
                n.start_agent(&address);
            }
            Victim::Controller => {
                self.restarts += 1;
                self.controller =
                    start_controller(self.root.path(), &self.store, self.port, &format!("{}", self.restarts + 1));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_keep_every_acknowledged_write_whatever_process_is_killed() {
    let (root, seed) = cluster::crash_run();
    let mut rng = seed;
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let port = free_port();
    let controller = start_controller(root.path(), &store, port, "1");
    let mut nodes: Vec<Node> = NAMES.iter().map(|n| Node::new(root.path(), n, 256 * MIB)).collect();
    for n in &mut nodes {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &NAMES).await;
    let req = proto::CreateVolumeRequest { thin: true, replicas: 2, ..create_request(VOLUME, SIZE) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: VOLUME.into(), host_nqn: HOST.into(), ..Default::default() };
    c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap();
    let nqn = v.subsystem_nqn.clone();
    let addrs: Vec<_> = nodes.iter().map(addr).collect();
    let model: Model = Arc::default();
    let mut cl = Cluster { root, store, port, controller, nodes, restarts: 0 };
    let (mut writes, mut errors) = (0, 0);

    for run in 0..RUNS {
        // A writer for the run: it stops before the volume is read back, so that no
        // write is on the disk and not yet in the model while the model is compared.
        let stop = Arc::new(AtomicBool::new(false));
        let writer = host_writer(addrs.clone(), nqn.clone(), model.clone(), stop.clone(), SIZE / BLOCK as u64);
        let v = volume(&c).await.expect("the controller answers");
        let first = VICTIMS[(next(&mut rng) % VICTIMS.len() as u64) as usize];
        tokio::time::sleep(Duration::from_millis(next(&mut rng) % 1000)).await;
        let killed = cl.kill(first, &v);
        let away = Duration::from_millis(300 + next(&mut rng) % 1500);
        // Half the runs kill a second process while the first is recovered from.
        let second =
            next(&mut rng).is_multiple_of(2).then(|| VICTIMS[(next(&mut rng) % VICTIMS.len() as u64) as usize]);
        println!(
            "run {run}: {first:?} on {} ({} serving), back after {away:?}; then {second:?}",
            NAMES[killed.1], v.node
        );
        tokio::time::sleep(away).await;
        cl.restart(killed);
        if let Some(second) = second {
            tokio::time::sleep(Duration::from_millis(next(&mut rng) % 2000)).await;
            let now = wait_for("the controller", Duration::from_secs(30), async || volume(&c).await).await;
            let killed = cl.kill(second, &now);
            tokio::time::sleep(Duration::from_millis(300 + next(&mut rng) % 1500)).await;
            cl.restart(killed);
        }
        let settled = wait_for("two replicas in sync again", Duration::from_secs(90), async || {
            let v = volume(&c).await?;
            let healthy = cluster::nodes(&c).await.iter().filter(|n| n.healthy).count() == 3;
            (healthy && v.replicas.len() == 2 && v.replicas.iter().all(|r| r.state == "in-sync")).then_some(v)
        })
        .await;
        stop.store(true, Ordering::SeqCst);
        let (n, e) = writer.join().unwrap();
        (writes, errors) = (writes + n, errors + e);
        println!("    {n} writes; {} serving at generation {}", settled.node, settled.generation);
        let at = NAMES.iter().position(|n| *n == settled.node).unwrap();
        // A node back a moment ago is healthy once its agent registers, and exports the
        // volume again once its agent has applied its state.
        wait_for("the serving node's export", Duration::from_secs(30), async || {
            cluster::connect(addrs[at], &nqn).map(drop)
        })
        .await;
        verify(addrs[at], &nqn, &model, &format!("{} after run {run}", settled.node));
    }
    println!("{writes} writes, {errors} errors");
    assert_eq!(errors, 0, "the host saw errors that were not path errors");

    // Every replica holds every acknowledged write (the agents stopped, so that
    // nobody changes the exports meanwhile).
    let v = volume(&c).await.unwrap();
    for n in &mut cl.nodes {
        n.agent.kill();
    }
    for r in v.replicas.iter().filter(|r| !r.serving) {
        let n = &cl.nodes[NAMES.iter().position(|x| *x == r.node).unwrap()];
        let replica_nqn = format!("{nqn}-replica");
        n.engine_call(nvpool_api::AddHost { nqn: replica_nqn.clone(), host: HOST.into(), dhchap: None, tls_psk: None });
        verify(addr(n), &replica_nqn, &model, &format!("the replica on {}", r.node));
    }
}

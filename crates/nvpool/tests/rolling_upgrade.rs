//! A rolling hot upgrade through the control plane, with real processes: three engines
//! with their agents and one controller. A host writes to a volume through its owner
//! the whole time while `nvpool node upgrade --all` replaces every engine in turn,
//! each healthy again with its new version before the next: no write fails and no
//! path changes. The node list reports each engine's version, and bad requests get
//! clear errors.

mod cluster;

use cluster::{
    BLOCK, HOST, LogsOnFailure, Model, Node, addr, create_request, free_port, host_writer, nodes, start_controller,
    verify, wait_healthy,
};
use nvpool_control::client::Controllers;
use nvpool_control::proto;
use std::process::Command as Process;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const MIB: u64 = 1 << 20;
const BIN: &str = env!("CARGO_BIN_EXE_nvpool");

/// Runs `nvpool ARGS --controller ADDRESS`; its standard output, or its error.
fn cli(controller: &str, args: &[&str]) -> Result<String, String> {
    let out = Process::new(BIN).args(args).args(["--controller", controller]).output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Stops the engines serving the nodes' sockets when the test ends: after an upgrade
/// they are not the processes the nodes started.
struct StopEngines(Vec<std::path::PathBuf>);

impl Drop for StopEngines {
    fn drop(&mut self) {
        for socket in &self.0 {
            if let Ok(info) = nvpool_api::call(socket, &nvpool_api::GetEngineInfo {}) {
                let _ = Process::new("kill").arg(info.pid.to_string()).status();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_engine_is_upgraded_in_turn_under_a_writing_host() {
    let root = tempfile::tempdir().unwrap();
    let _logs = LogsOnFailure(root.path());
    let store = format!("redb:{}", root.path().join("controller.redb").display());
    let controller = start_controller(root.path(), &store, free_port(), "1");
    let mut nodes_: Vec<Node> = ["n1", "n2", "n3"].iter().map(|n| Node::new(root.path(), n, 1 << 30)).collect();
    let _stop_engines = StopEngines(nodes_.iter().map(Node::socket).collect());
    for n in &mut nodes_ {
        n.start_agent(&controller.address);
    }
    let c = Controllers::new(&controller.address).unwrap();
    wait_healthy(&c, &["n1", "n2", "n3"]).await;
    // The nvpool binary the nodes run reports the package version.
    let version = env!("CARGO_PKG_VERSION");
    for n in nodes(&c).await {
        assert_eq!(n.engine_version, version, "node {} reports its engine's version", n.name);
    }
    let listed = cli(&controller.address, &["node", "list"]).unwrap();
    assert!(listed.contains("VERSION") && listed.contains(version), "{listed}");

    let req = proto::CreateVolumeRequest { include_nodes: vec!["n2".into()], ..create_request("up", 64 * MIB) };
    let v = c.call(async |mut c| c.create_volume(req.clone()).await).await.unwrap().volume.unwrap();
    let attach = proto::AttachRequest { volume: "up".into(), host_nqn: HOST.into(), ..Default::default() };
    let paths = c.call(async |mut c| c.attach(attach.clone()).await).await.unwrap().paths;
    assert_eq!(paths[0].node, "n2", "the owner is the optimized path");
    let model: Model = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let owner = addr(&nodes_[1]);
    let writer =
        host_writer(vec![owner], v.subsystem_nqn.clone(), model.clone(), stop.clone(), 64 * MIB / BLOCK as u64);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    let before: Vec<u32> = nodes_.iter().map(|n| n.engine_call(nvpool_api::GetEngineInfo {}).pid).collect();
    let out = cli(&controller.address, &["node", "upgrade", "--all", "--json"]).unwrap();
    let reports: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    let upgraded: Vec<&str> = reports.iter().map(|r| r["node"].as_str().unwrap()).collect();
    assert_eq!(upgraded, ["n1", "n2", "n3"], "every node, in name order");
    for (r, old) in reports.iter().zip(&before) {
        assert_eq!(r["old_pid"].as_u64(), Some(u64::from(*old)), "{r}");
        assert_ne!(r["new_pid"].as_u64(), Some(u64::from(*old)), "{r}");
        assert_eq!(r["new_version"].as_str(), Some(version), "{r}");
    }
    let owner_report = &reports[1];
    assert!(owner_report["connections"].as_u64().unwrap() >= 2, "the host's queues were handed over: {owner_report}");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let (writes, errors) = writer.join().unwrap();
    assert_eq!(errors, 0, "no write failed");
    assert!(writes > 0);
    verify(owner, &v.subsystem_nqn, &model, "n2");
    for n in nodes(&c).await {
        assert!(n.healthy && n.engine_version == version, "{}: healthy {}, {:?}", n.name, n.healthy, n.engine_version);
    }

    // One node, named; then what cannot be done.
    let one = cli(&controller.address, &["node", "upgrade", "n3"]).unwrap();
    assert!(one.starts_with("n3: ") && one.contains("connections kept"), "{one}");
    let e = cli(&controller.address, &["node", "upgrade", "n9"]).unwrap_err();
    assert!(e.contains("node n9 is not registered"), "{e}");
    let e = cli(&controller.address, &["node", "upgrade", "n1", "--binary", "/bin/false"]).unwrap_err();
    assert!(e.contains("node n1") && e.contains("called off") && e.contains("goes on serving"), "{e}");
    assert!(nodes(&c).await.iter().all(|n| n.healthy), "a failed upgrade leaves every node serving");
    println!(
        "rolling upgrade of n1, n2, n3 under a writing host: {writes} writes, 0 errors; pauses {:?} us; {}",
        reports.iter().map(|r| r["pause_us"].as_u64().unwrap()).collect::<Vec<_>>(),
        one.trim()
    );
}

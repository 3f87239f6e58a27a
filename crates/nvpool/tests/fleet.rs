//! `nvpool fleet` end to end, small: simulated nodes register, heartbeat and apply
//! through a real controller, every volume created is listed, the changes made after
//! (resizes, deletions, migrations) are listed and held by the nodes, and after the
//! controller is killed and started again every one is still there (the command
//! fails otherwise). The volumes are thin, and spread evenly over the nodes, which are
//! alike: on equal scores the scheduler picks the pool that promised least.

use std::process::Command;

#[test]
fn a_fleet_creates_volumes_and_loses_none_across_a_controller_kill() {
    let out = Command::new(env!("CARGO_BIN_EXE_nvpool"))
        .args([
            "fleet",
            "--nodes",
            "20",
            "--volumes",
            "200",
            "--thin",
            "--rate",
            "400",
            "--clients",
            "4",
            "--rest",
            "1",
        ])
        .output()
        .expect("nvpool runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nvpool fleet failed: {}{text}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("## 20 nodes, 200 thin volumes"), "{text}");
    assert!(
        text.contains("| volumes per node once all were made, fewest / most | 10 / 10 |"),
        "ten on every node: {text}"
    );
    assert!(text.contains("| 181–200 |"), "ten stretches of creations: {text}");
    for (change, count) in [("resize", 20), ("detach", 20), ("delete", 20), ("migrate: the call", 2)] {
        assert!(text.contains(&format!("| {change} (ms) | {count} |")), "{count} of {change}: {text}");
    }
    assert!(text.contains("| states applied to nodes at rest | 0 |"), "nothing applied at rest: {text}");
    assert!(text.contains("after the leader's SIGKILL: a controller lists every volume"), "{text}");
    assert!(
        text.contains("after the leader's SIGKILL: every node given its state again"),
        "every node converges: {text}"
    );
}

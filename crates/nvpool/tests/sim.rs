//! `nvpool sim` from the command line: any policy set and seed, as a table or JSON,
//! the same figures for the same seed, and a clear error for an unknown policy.

use std::process::Command;

fn sim(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_nvpool")).arg("sim").args(["--nodes", "60"]).args(args).output().unwrap()
}

fn reports(args: &[&str]) -> Vec<serde_json::Value> {
    let out = sim(&[args, &["--json"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut reports: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    for r in &mut reports {
        r.as_object_mut().unwrap().remove("decisions_per_second");
    }
    reports
}

#[test]
fn policies_and_seeds_as_json_and_tables() {
    let picked = reports(&["--policies", "reserve,weights:10/0/1+migrate,local-only", "--seed", "7"]);
    let names: Vec<&str> = picked.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["reserve", "weights:10/0/1+migrate", "local-only"]);
    for r in &picked {
        let used = r["utilisation"].as_f64().unwrap();
        assert!(used > 0.0 && used <= 1.0, "{r}");
        assert!(r["local_met"].as_f64().unwrap() <= 1.0, "{r}");
    }
    assert_eq!(picked[0]["migrated_bytes"], 0, "placement alone moves nothing");
    assert_eq!(picked, reports(&["--policies", "reserve,weights:10/0/1+migrate,local-only", "--seed", "7"]));
    assert_ne!(picked[0], reports(&["--policies", "reserve", "--seed", "8"])[0], "another seed, another run");

    let table = sim(&["--policies", "reserve,fullest"]);
    assert!(table.status.success());
    let text = String::from_utf8(table.stdout).unwrap();
    // A policy that meets the goal is in bold.
    let row = |name: &str| text.contains(&format!("| {name} (")) || text.contains(&format!("| **{name} ("));
    assert!(row("reserve") && row("fullest"), "{text}");
    assert!(text.contains("migrated per placement"), "{text}");
}

#[test]
fn an_unknown_policy_is_refused_with_the_known_ones() {
    let out = sim(&["--policies", "reserve,best"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("\"best\"") && err.contains("reserve+migrate") && err.contains("weights:"), "{err}");
}

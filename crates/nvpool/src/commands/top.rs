//! `nvpool top`: the busiest volumes and nodes of the pool, refreshed in the terminal,
//! from the live figures the controller keeps (the engines' counters, reported with
//! the agents' heartbeats).

use std::time::Duration;

use nvpool_control::client::Controllers;
use nvpool_control::proto;

use crate::output::{human, render};

/// What `nvpool top` shows and how often.
pub(crate) struct TopOptions {
    pub every: Duration,
    pub rows: usize,
    /// Print once, with no screen clearing (for scripts and tests).
    pub once: bool,
}

fn iops(io: Option<&proto::IoRates>) -> f64 {
    io.map_or(0.0, |r| r.read_iops + r.write_iops)
}

fn figures(io: Option<&proto::IoRates>) -> [String; 4] {
    let r = io.cloned().unwrap_or_default();
    let latency = if r.mean_latency_us > 0.0 { format!("{:.0}us", r.mean_latency_us) } else { "-".into() };
    [
        format!("{:.0}", r.read_iops),
        format!("{:.0}", r.write_iops),
        format!("{}/s", human((r.read_bytes_per_second + r.write_bytes_per_second) as u64)),
        latency,
    ]
}

/// One screen: a summary line, then the busiest nodes and volumes.
fn screen(nodes: &mut [proto::Node], volumes: &mut [proto::Volume], rows: usize) -> String {
    let healthy = nodes.iter().filter(|n| n.healthy).count();
    let total: f64 = volumes.iter().map(|v| iops(v.io.as_ref())).sum();
    let moving = volumes.iter().filter(|v| v.migration.is_some()).count();
    let mut out = format!(
        "nvpool: {healthy}/{} nodes healthy, {} volumes ({moving} moving), {total:.0} IOPS\n\n",
        nodes.len(),
        volumes.len()
    );
    nodes.sort_by(|a, b| iops(b.io.as_ref()).total_cmp(&iops(a.io.as_ref())).then_with(|| a.name.cmp(&b.name)));
    let mut t = vec![
        ["NODE", "HEALTH", "USED", "CAPACITY", "READ IOPS", "WRITE IOPS", "THROUGHPUT", "LATENCY"]
            .map(String::from)
            .to_vec(),
    ];
    for n in nodes.iter().take(rows) {
        let used: u64 = n.pools.iter().map(|p| p.used_bytes).sum();
        let capacity: u64 = n.pools.iter().map(|p| p.capacity_bytes).sum();
        let mut row =
            vec![n.name.clone(), if n.healthy { "healthy" } else { "down" }.into(), human(used), human(capacity)];
        row.extend(figures(n.io.as_ref()));
        t.push(row);
    }
    out += &render(&t);
    volumes.sort_by(|a, b| iops(b.io.as_ref()).total_cmp(&iops(a.io.as_ref())).then_with(|| a.name.cmp(&b.name)));
    let mut t = vec![
        ["VOLUME", "OWNER", "HOSTS", "READ IOPS", "WRITE IOPS", "THROUGHPUT", "LATENCY", "STATE"]
            .map(String::from)
            .to_vec(),
    ];
    for v in volumes.iter().take(rows) {
        let hosts = v.attachments.len().to_string();
        let mut row = vec![v.name.clone(), v.node.clone(), hosts];
        row.extend(figures(v.io.as_ref()));
        // A replicated volume with a replica out of sync says which and how.
        let out_of_sync: Vec<String> = v
            .replicas
            .iter()
            .filter(|r| r.state != "in-sync")
            .map(|r| match r.rebuild_total_bytes {
                0 => format!("{} {}", r.node, r.state),
                total => format!("{} rebuilding {}%", r.node, r.rebuild_copied_bytes * 100 / total),
            })
            .collect();
        row.push(match &v.migration {
            Some(m) => format!("moving to {} ({})", m.to_node, m.phase),
            None if !out_of_sync.is_empty() => format!("{}; {}", v.state, out_of_sync.join(", ")),
            None => v.state.clone(),
        });
        t.push(row);
    }
    out += "\n\n";
    out += &render(&t);
    out
}

/// Shows the busiest nodes and volumes until interrupted (or once).
pub(crate) async fn run(c: &Controllers, o: &TopOptions) -> Result<(), String> {
    loop {
        let nodes = c.call(async |mut c| c.list_nodes(proto::ListNodesRequest {}).await).await;
        let volumes = c.call(async |mut c| c.list_volumes(proto::ListVolumesRequest::default()).await).await;
        let (mut nodes, mut volumes) = match (nodes, volumes) {
            (Ok(n), Ok(v)) => (n.nodes, v.volumes),
            (Err(e), _) | (_, Err(e)) => return Err(format!("cannot read the pool: {}", e.message())),
        };
        let text = screen(&mut nodes, &mut volumes, o.rows);
        if o.once {
            println!("{text}");
            return Ok(());
        }
        // Home and clear, then the screen: one write, so the terminal does not flicker.
        print!("\x1b[H\x1b[2J{text}\n\n(every {:?}; Ctrl-C quits)\n", o.every);
        tokio::time::sleep(o.every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busiest_come_first() {
        let io = |r: f64| Some(proto::IoRates { read_iops: r, mean_latency_us: 80.0, ..Default::default() });
        let mut nodes = vec![
            proto::Node { name: "quiet".into(), healthy: true, ..Default::default() },
            proto::Node { name: "busy".into(), healthy: true, io: io(500.0), ..Default::default() },
        ];
        let mut volumes = vec![
            proto::Volume { name: "cold".into(), io: io(1.0), ..Default::default() },
            proto::Volume { name: "hot".into(), io: io(900.0), ..Default::default() },
            proto::Volume { name: "warm".into(), io: io(20.0), ..Default::default() },
        ];
        let s = screen(&mut nodes, &mut volumes, 2);
        assert!(s.starts_with("nvpool: 2/2 nodes healthy, 3 volumes (0 moving), 921 IOPS"), "{s}");
        let busy = s.find("busy").unwrap();
        assert!(busy < s.find("quiet").unwrap());
        assert!(s.find("hot").unwrap() < s.find("warm").unwrap());
        assert!(!s.contains("cold"), "two rows each:\n{s}");
        assert!(s.contains("80us"));
    }
}

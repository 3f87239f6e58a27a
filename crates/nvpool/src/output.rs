//! How the CLI reads sizes and prints results: tables for people, JSON with `--json`.

use serde::Serialize;

/// Prints `v` as JSON when asked, else the text (a table or a message).
pub(crate) fn print_or(json: bool, v: &impl Serialize, text: impl FnOnce() -> String) {
    if json {
        println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
    } else {
        println!("{}", text());
    }
}

pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{bytes}B") } else { format!("{v:.1}{}", UNITS[u]) }
}

pub(crate) fn render(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> =
        (0..cols).map(|c| rows.iter().map(|r| r.get(c).map_or(0, String::len)).max().unwrap_or(0)).collect();
    rows.iter()
        .map(|r| {
            r.iter()
                .enumerate()
                .map(|(i, cell)| format!("{cell:<w$}", w = widths[i]))
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Parses a size such as `1GiB` (binary units).
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    nvpool_engine::config::parse_size(s)
}

/// I/O limits given on the command line; a limit not given stays as it is, and 0
/// lifts one.
#[derive(clap::Args, Clone, Debug, Default)]
pub(crate) struct QosArgs {
    /// Most commands per second, reads and writes together (0: no limit).
    #[arg(long)]
    iops: Option<u64>,
    /// Most reads per second (0: no limit).
    #[arg(long)]
    read_iops: Option<u64>,
    /// Most writes per second (0: no limit).
    #[arg(long)]
    write_iops: Option<u64>,
    /// Most bytes per second, reads and writes together, e.g. 200MiB/s (0: no limit).
    #[arg(long, value_parser = nvpool_api::parse_rate)]
    bw: Option<u64>,
    /// Most bytes read per second (0: no limit).
    #[arg(long, value_parser = nvpool_api::parse_rate)]
    read_bw: Option<u64>,
    /// Most bytes written per second (0: no limit).
    #[arg(long, value_parser = nvpool_api::parse_rate)]
    write_bw: Option<u64>,
}

impl QosArgs {
    /// Whether any limit was given.
    pub(crate) fn given(&self) -> bool {
        [self.iops, self.read_iops, self.write_iops, self.bw, self.read_bw, self.write_bw].iter().any(Option::is_some)
    }

    /// `base` with the limits given here in place of its own.
    pub(crate) fn applied_to(&self, base: nvpool_api::QosLimits) -> nvpool_api::QosLimits {
        nvpool_api::QosLimits {
            iops: self.iops.unwrap_or(base.iops),
            read_iops: self.read_iops.unwrap_or(base.read_iops),
            write_iops: self.write_iops.unwrap_or(base.write_iops),
            bps: self.bw.unwrap_or(base.bps),
            read_bps: self.read_bw.unwrap_or(base.read_bps),
            write_bps: self.write_bw.unwrap_or(base.write_bps),
        }
    }
}

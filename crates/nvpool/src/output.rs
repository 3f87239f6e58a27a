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

//! `nvpool`: the engine, the control plane's services, and the command-line verbs that
//! manage them. Each family of commands has its file in `commands/`; `output.rs`
//! prints what they return. The binary (`main.rs`) holds only the version, so that a
//! build differing in nothing else (the upgrade tests' second one) compiles that file
//! again and links, rather than all of this.

mod commands;
mod output;
mod process;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// nvpool: pool every node's NVMe SSDs and serve volumes over NVMe/TCP.
#[derive(Parser)]
#[command(about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the engine (an NVMe/TCP target), or manage a running one with its verbs.
    Engine(Box<commands::engine::EngineCommand>),
    #[command(flatten)]
    Cluster(commands::cluster::Command),
    /// Drive an NVMe/TCP target with I/O and report IOPS, bandwidth and latency.
    Bench(commands::bench::BenchArgs),
    /// Run the protocol-minimal NVMe/TCP responder (the machine's limit for benchmarks).
    Responder(commands::bench::ResponderArgs),
    /// Run COMMAND (an engine) as a container's main process, through its hot upgrades:
    /// stays while the process serving in its place runs, and passes SIGTERM to it.
    Supervise {
        /// The command and its arguments, after `--`.
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
}

/// Runs a parsed command line.
fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Engine(c) => commands::engine::run(*c),
        Command::Cluster(c) => commands::cluster::run(c),
        Command::Bench(a) => commands::bench::run_bench(a),
        Command::Responder(a) => commands::bench::run_responder(a),
        Command::Supervise { command } => commands::supervise::run(&command),
    }
}

/// Logs go to standard error at the level `NVPOOL_LOG` names (error, warn, info,
/// debug or trace; info when unset).
fn init_logging() {
    let level =
        std::env::var("NVPOOL_LOG").ok().and_then(|l| l.parse::<tracing::Level>().ok()).unwrap_or(tracing::Level::INFO);
    // Colours only on a terminal: logs usually land in files.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(false)
        .with_ansi(colour)
        .init();
}

/// Runs the command line of a binary whose version is `version`.
pub fn main(version: &'static str) {
    nvpool_engine::set_version(version);
    init_logging();
    let matches = Cli::command().version(version).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = run(cli) {
        eprintln!("nvpool: {e}");
        std::process::exit(1);
    }
}

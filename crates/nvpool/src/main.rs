//! `nvpool`: the engine and the command-line verbs that manage it.

mod cli;
mod cluster;
mod signals;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    if let Err(e) = cli::run(args) {
        eprintln!("nvpool: {e}");
        std::process::exit(1);
    }
}

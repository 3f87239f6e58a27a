//! The `nvpool` binary. Everything it does is in the library; this file holds the
//! version alone, so that the upgrade tests' second build (another `NVPOOL_VERSION`)
//! compiles it again and links, and nothing else.

/// This build's version: the package version, or `NVPOOL_VERSION` when set at build
/// time (the upgrade tests build a second binary that way, to tell the two apart).
const VERSION: &str = match option_env!("NVPOOL_VERSION") {
    Some(v) => v,
    None => env!("CARGO_PKG_VERSION"),
};

fn main() {
    nvpool::main(VERSION);
}

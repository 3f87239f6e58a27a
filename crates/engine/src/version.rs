//! The version this engine reports.

static VERSION: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// The version this engine reports (management, hot upgrades, metrics and Identify's
/// firmware revision): its binary's, which the binary sets once with [`set_version`]
/// before it starts anything, else this library's package version. The binary owns it
/// so that a build that differs only in its version (the upgrade tests' second build)
/// recompiles the binary's crate alone.
pub fn version() -> &'static str {
    VERSION.get().copied().unwrap_or(env!("CARGO_PKG_VERSION"))
}

/// Sets what [`version`] reports; the first call wins.
pub fn set_version(version: &'static str) {
    let _ = VERSION.set(version);
}

// Generates the gRPC code for the control plane API. Needs `protoc` (Debian's
// protobuf-compiler, installed by scripts/setup).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_protos(&["proto/nvpool/v1/control.proto"], &["proto"])?;
    Ok(())
}

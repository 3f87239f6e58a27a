// Generates the CSI gRPC code from the vendored spec (proto/csi.proto, CSI v1.12.0,
// Apache-2.0: proto/LICENSE). Needs `protoc` and the well-known types (Debian's
// protobuf-compiler and libprotobuf-dev, installed by scripts/setup). The clients
// serve src/bin/csi-call.rs, with which tests call the driver as kubelet would.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    tonic_prost_build::configure().compile_protos(&["proto/csi.proto"], &["proto"])?;
    Ok(())
}

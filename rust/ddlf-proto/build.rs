//! Generates the Rust messages and the gRPC client/server from `proto/ddlf.proto`.
//!
//! `protoc` comes from the `protoc-bin-vendored` crate (a binary shipped inside a crates.io package), so a
//! fresh machine needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let proto = proto_dir.join("ddlf.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded at this point.
        unsafe { std::env::set_var("PROTOC", protoc) };
    }
    tonic_prost_build::configure()
        // `bytes` fields decode as `bytes::Bytes`: slices of the receive buffer, not fresh copies.
        .bytes(".")
        .compile_protos(&[proto], &[proto_dir])?;
    Ok(())
}

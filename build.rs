//! Compiles cachepick's own protos (`proto/`) at build time, with no system `protoc`: `protox` parses
//! them into a descriptor set, `tonic-prost-build` generates the messages, the gRPC server and the
//! client into `OUT_DIR`, and the encoded descriptor set is kept for gRPC server reflection.

use std::error::Error;
use std::path::PathBuf;

/// Where the protos live; imports resolve from here.
const PROTO_ROOT: &str = "proto";
const PROTOS: [&str; 1] = ["cachepick/v1/admin.proto"];
/// The encoded `FileDescriptorSet` that `src/extproc/admin.rs` serves over reflection.
const DESCRIPTOR_SET: &str = "cachepick_v1_descriptor.bin";

fn main() -> Result<(), Box<dyn Error>> {
    // Rerun only when a proto changes, not on every edit of the crate.
    println!("cargo:rerun-if-changed={PROTO_ROOT}/cachepick");
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("cargo sets OUT_DIR")?);

    let mut compiler = protox::Compiler::new([PROTO_ROOT])?;
    compiler.include_source_info(true).include_imports(true);
    for proto in PROTOS {
        compiler.open_file(proto)?;
    }
    std::fs::write(
        out_dir.join(DESCRIPTOR_SET),
        compiler.encode_file_descriptor_set(),
    )?;

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .emit_rerun_if_changed(false)
        .out_dir(&out_dir)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}

//! Compiles `proto/rebound/v1/*.proto` with `protox` (pure Rust, so a fresh machine needs no
//! `protoc`) and keeps the encoded descriptor set for server reflection.

use std::{env, error::Error, fs, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn Error>> {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    let protos = [root.join("rebound/v1/advisor.proto")];
    for p in &protos {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    let fds = protox::compile(&protos, [&root])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out.join("rebound_v1_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::pb::SmallCodec")
        .compile_fds(fds)?;
    Ok(())
}

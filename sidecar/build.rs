//! Compiles `proto/rebound/v1/*.proto` with `protox` (pure Rust, so a fresh machine needs no
//! `protoc`) and keeps the encoded descriptor set for server reflection.
//!
//! Two generations from the one proto: the message types and the client as written, and
//! the server over request messages whose `string` fields are read as `bytes` (the same
//! wire encoding). prost rejects invalid UTF-8 while decoding, which would fail a whole
//! call (a whole batch) with INTERNAL; reading bytes lets the sidecar check each field
//! itself and answer INVALID_ARGUMENT naming it, per batch item. Those fields are
//! `bytes::Bytes`: decoding slices them out of the received message instead of copying
//! each into its own allocation.

use std::{env, error::Error, fs, path::PathBuf};

use prost::Message;

/// The server's input messages; the server decodes its own copy of these.
const REQUESTS: [&str; 3] = ["DecideRequest", "DecideBatchRequest", "GetPolicyRequest"];
/// The server's output messages, shared with the client's types.
const RESPONSES: [&str; 3] = ["DecideResponse", "DecideBatchResponse", "GetPolicyResponse"];
/// `google.protobuf.FieldDescriptorProto.Type` values.
const TYPE_STRING: i32 = 9;
const TYPE_BYTES: i32 = 12;

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
        .build_server(false)
        .codec_path("crate::pb::SmallCodec")
        .compile_fds(fds.clone())?;

    let mut server_fds = fds;
    for file in &mut server_fds.file {
        file.enum_type.clear();
        file.message_type
            .retain(|m| REQUESTS.contains(&m.name.as_deref().unwrap_or_default()));
        for field in file
            .message_type
            .iter_mut()
            .flat_map(|m| m.field.iter_mut())
        {
            if field.r#type == Some(TYPE_STRING) {
                field.r#type = Some(TYPE_BYTES);
            }
        }
    }
    let server_out = out.join("server");
    fs::create_dir_all(&server_out)?;
    let mut server = tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .codec_path("crate::pb::ServerCodec")
        .bytes(".")
        .out_dir(&server_out);
    for name in RESPONSES {
        server = server.extern_path(
            format!(".rebound.v1.{name}"),
            format!("crate::pb::v1::{name}"),
        );
    }
    server.compile_fds(server_fds)?;
    Ok(())
}

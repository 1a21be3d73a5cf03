//! Compiles the gRPC API (`agent/api/proto/`) into Rust with protox, a protobuf compiler written in
//! Rust, so building needs no `protoc` on the machine. The generated code lands in `OUT_DIR` and is
//! included by `serve::grpc::proto`, beside the encoded descriptor set that server reflection
//! answers from (`DESCRIPTOR_SET_FILE`).

const PROTO_ROOT: &str = "api/proto";
const PROTOS: [&str; 1] = ["api/proto/peregrine/encoder/v1/encoder.proto"];
/// In `OUT_DIR`; read by `serve::grpc::proto::FILE_DESCRIPTOR_SET`.
const DESCRIPTOR_SET_FILE: &str = "encoder_descriptor.bin";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, [PROTO_ROOT])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out_dir.join(DESCRIPTOR_SET_FILE), prost::Message::encode_to_vec(&descriptors))?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(descriptors)?;
    Ok(())
}

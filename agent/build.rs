//! Compiles the gRPC API (`agent/api/proto/`) into Rust with protox, a protobuf compiler written in
//! Rust, so building needs no `protoc` on the machine. The generated code lands in `OUT_DIR` and is
//! included by `serve::grpc::proto`.

const PROTO_ROOT: &str = "api/proto";
const PROTOS: [&str; 1] = ["api/proto/peregrine/encoder/v1/encoder.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, [PROTO_ROOT])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(descriptors)?;
    Ok(())
}

//! gRPC beside HTTP for an encoder (`serve --grpc-port N`): `peregrine.encoder.v1.Encoder`
//! (`agent/api/proto/peregrine/encoder/v1/encoder.proto`) with Embed, Rerank, Score and Classify.
//! Each call is turned into the HTTP endpoint's typed request and goes through the same
//! validation, handler, admission, batching thread and metrics ([`service`]); errors map to gRPC
//! status codes ([`status`]). Packed floats make large embedding batches cheaper than JSON.
//! `grpc.health.v1` (following `/ready`) and server reflection sit beside it ([`health`]).

pub mod proto {
    //! The code tonic-prost-build generates from the .proto (see `agent/build.rs`).
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("peregrine.encoder.v1");
    /// The encoded descriptors of the .proto (and its imports), for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/encoder_descriptor.bin"));
}
pub mod connections;
pub mod health;
pub mod service;
pub mod status;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

use super::encoder_backend::EncoderOnly;
use super::state::AppState;
use proto::encoder_server::EncoderServer;
use service::EncoderService;

/// The largest response message: bounded, and roomy enough for the largest request's answer
/// (2048 inputs of 4096-wide embeddings take 32 MiB).
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024 * 1024;
/// Concurrent calls on one HTTP/2 connection; the server-wide bound is `--max-waiting-requests`.
const MAX_STREAMS_PER_CONNECTION: u32 = 256;
/// Pings idle connections so that dead peers are noticed and their connections closed.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the Encoder service on `listener` until `shutdown` completes, then lets calls in flight
/// finish (the caller bounds how long it waits). Request messages are limited like HTTP bodies
/// (`--max-body-bytes`): tonic refuses a larger one from its length prefix, before reading it, with
/// OUT_OF_RANGE (its code for this; the call never reaches the service, so it is not counted in
/// `peregrine_request_errors_total`). At most `--max-connections` gRPC connections are open at once.
pub async fn serve(
    listener: TcpListener,
    state: Arc<AppState<EncoderOnly>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let max_request = state.config.max_body_bytes;
    let incoming = connections::limited(listener, state.config.connections.max_connections);
    let (reporter, health_service) = tonic_health::server::health_reporter();
    // Aborted when the server returns: the status then no longer matters.
    let follower = tokio::spawn(health::follow_readiness(reporter, state.clone()));
    let encoder = EncoderServer::new(EncoderService::new(state))
        .max_decoding_message_size(max_request)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);
    // The descriptors are built into the binary, so an error here is a build defect: gRPC is then
    // served without reflection rather than not at all.
    let (reflection_v1, reflection_v1alpha) = match health::reflection_services() {
        Ok((v1, v1alpha)) => (Some(v1), Some(v1alpha)),
        Err(e) => {
            tracing::error!(error = %e, "gRPC reflection unavailable");
            (None, None)
        }
    };
    let served = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .add_service(encoder)
        .add_service(health_service)
        .add_optional_service(reflection_v1)
        .add_optional_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    follower.abort();
    served
}

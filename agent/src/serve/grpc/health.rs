//! `grpc.health.v1.Health` and server reflection on the gRPC port. Health answers SERVING for the
//! whole server (`""`) and for `peregrine.encoder.v1.Encoder` exactly when HTTP's `/ready` is 200
//! (warm-up done, not draining), NOT_SERVING otherwise, so that gRPC probes and load balancers see
//! what HTTP's probes see. Neither service asks for an API key (probes carry none) and neither
//! touches the model.

use std::sync::Arc;
use std::time::Duration;

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use super::proto::encoder_server::EncoderServer;
use super::service::EncoderService;
use crate::serve::encoder_backend::EncoderOnly;
use crate::serve::lifecycle::Lifecycle;
use crate::serve::state::AppState;

/// How often the health status is brought in line with the lifecycle: readiness turns once at
/// warm-up and once at SIGTERM, so a short poll is simpler than a notification path and as timely
/// for probes (which run every few seconds).
const FOLLOW_INTERVAL: Duration = Duration::from_millis(100);

/// The health service's name for the Encoder service (the .proto's full name).
pub fn encoder_service_name() -> &'static str {
    <EncoderServer<EncoderService> as tonic::server::NamedService>::NAME
}

fn status_of(lifecycle: &Lifecycle) -> ServingStatus {
    if lifecycle.is_ready() {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

/// Keeps `reporter` equal to the lifecycle's readiness until the task is dropped; starts at
/// NOT_SERVING (tonic-health starts the server-wide status at SERVING).
pub async fn follow_readiness(reporter: HealthReporter, state: Arc<AppState<EncoderOnly>>) {
    let mut reported = None;
    loop {
        let status = status_of(&state.lifecycle);
        if reported != Some(status) {
            for name in ["", encoder_service_name()] {
                reporter.set_service_status(name, status).await;
            }
            reported = Some(status);
        }
        tokio::time::sleep(FOLLOW_INTERVAL).await;
    }
}

/// Server reflection (v1 and the v1alpha that older clients still ask for) over the Encoder's
/// descriptors and the health service's, so `grpcurl list` and `describe` work without the .proto.
pub fn reflection_services() -> Result<
    (
        tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
        tonic_reflection::server::v1alpha::ServerReflectionServer<impl tonic_reflection::server::v1alpha::ServerReflection>,
    ),
    tonic_reflection::server::Error,
> {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(super::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    Ok((builder().build_v1()?, builder().build_v1alpha()?))
}

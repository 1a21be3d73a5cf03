//! Logs through `tracing`, and OpenTelemetry traces over OTLP/HTTP when an endpoint is configured
//! (one span per request, with events for scheduling, first token and finish). The setup itself is
//! shared with the operator in `peregrine-telemetry`.

pub use peregrine_telemetry::TelemetryGuard;
use peregrine_telemetry::TelemetryConfig;

pub fn init(otlp_endpoint: Option<&str>, json: bool) -> anyhow::Result<TelemetryGuard> {
    let config = TelemetryConfig { service_name: "peregrine-agent", default_filter: "info", otlp_endpoint, json };
    Ok(peregrine_telemetry::init(config)?)
}

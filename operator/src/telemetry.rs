//! Logging and tracing setup: log lines, and one OpenTelemetry span per reconcile exported over
//! OTLP/HTTP when an endpoint is configured (shared setup in `peregrine-telemetry`).

pub use peregrine_telemetry::{TelemetryError, TelemetryGuard};
use peregrine_telemetry::TelemetryConfig;

/// Installs the global subscriber: `RUST_LOG`-style filtering (default `info,kube=warn`), JSON or
/// text lines, and trace export to `otlp_endpoint` (an OTLP/HTTP base URL) when given. Keep the
/// guard until exit: dropping it flushes the last spans.
pub fn init(otlp_endpoint: Option<&str>, json: bool) -> Result<TelemetryGuard, TelemetryError> {
    peregrine_telemetry::init(TelemetryConfig {
        service_name: "peregrine-operator",
        default_filter: "info,kube=warn",
        otlp_endpoint,
        json,
    })
}

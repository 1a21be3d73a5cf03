//! Logs through `tracing`, and OpenTelemetry traces over OTLP/HTTP when an endpoint is configured.
//! Shared by `peregrine-agent` and `peregrine-operator` so both export the same way.

mod client;

use std::io::IsTerminal;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tokio::runtime::{Handle, RuntimeFlavor};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// How long one export request may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("trace export to an OTLP endpoint needs a tokio runtime: call init from inside one")]
    NoRuntime,
    #[error("building the OTLP trace exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("installing the tracing subscriber: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// What to set up.
#[derive(Debug, Clone, Copy)]
pub struct TelemetryConfig<'a> {
    /// `service.name` of exported traces and the tracer's name.
    pub service_name: &'static str,
    /// Filter when `RUST_LOG` is unset (e.g. `info`).
    pub default_filter: &'a str,
    /// OTLP/HTTP base URL (e.g. `http://otel-collector:4318`); `None` or empty exports nothing.
    pub otlp_endpoint: Option<&'a str>,
    /// JSON log lines instead of text.
    pub json: bool,
}

/// Flushes and stops the trace exporter when dropped (at exit).
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether traces are being exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        let Some(provider) = self.provider.take() else { return };
        // Shutdown blocks until the last batch is sent, and sending runs on the tokio runtime: on a
        // runtime worker, hand the worker's other tasks away first so that the send can progress.
        let shutdown = || provider.shutdown();
        let result = match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(shutdown),
            _ => shutdown(),
        };
        if let Err(e) = result {
            eprintln!("trace exporter shutdown: {e}");
        }
    }
}

/// Installs the global subscriber: logs on stderr, plus span export when an endpoint is given.
pub fn init(config: TelemetryConfig<'_>) -> Result<TelemetryGuard, TelemetryError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(config.default_filter));
    // Colours only for a person at a terminal: escape codes in a file or a log collector are noise.
    let fmt = log_layer(config.json, std::io::stderr().is_terminal(), std::io::stderr);
    let provider = match config.otlp_endpoint.filter(|e| !e.is_empty()) {
        Some(endpoint) => Some(tracer_provider(config.service_name, endpoint)?),
        None => None,
    };
    let otel = provider.as_ref().map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer(config.service_name)));
    tracing_subscriber::registry().with(filter).with(fmt).with(otel).try_init()?;
    Ok(TelemetryGuard { provider })
}

/// The log-line layer: JSON lines, or text with ANSI colours only when `ansi`.
fn log_layer<S, W>(json: bool, ansi: bool, writer: W) -> Box<dyn Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    if json {
        tracing_subscriber::fmt::layer().json().with_ansi(false).with_writer(writer).boxed()
    } else {
        tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(writer).boxed()
    }
}

fn tracer_provider(service_name: &'static str, endpoint: &str) -> Result<SdkTracerProvider, TelemetryError> {
    let runtime = Handle::try_current().map_err(|_| TelemetryError::NoRuntime)?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client::RuntimeHttpClient::new(runtime, EXPORT_TIMEOUT))
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .with_timeout(EXPORT_TIMEOUT)
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder().with_service_name(service_name).build();
    Ok(SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build())
}

#[cfg(test)]
mod tests {
    use super::*;

    // The global subscriber can be installed once per process: only the second test installs it.

    #[test]
    fn an_endpoint_outside_a_tokio_runtime_is_refused_before_anything_is_installed() {
        let config = TelemetryConfig { service_name: "test", default_filter: "info", otlp_endpoint: Some("http://127.0.0.1:4318"), json: false };
        assert!(matches!(init(config), Err(TelemetryError::NoRuntime)));
    }

    /// Collects what a layer writes.
    #[derive(Clone, Default)]
    struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn log_with(json: bool, ansi: bool) -> String {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::registry().with(log_layer(json, ansi, move || writer.clone()));
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("request", request_id = 7);
            let _entered = span.enter();
            tracing::warn!(model = "m", "grace period over");
        });
        let bytes = out.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn log_lines_have_no_escape_codes_off_a_terminal_and_json_is_json() {
        let text = log_with(false, false);
        assert!(text.contains("grace period over") && !text.contains('\x1b'), "{text:?}");
        assert!(log_with(false, true).contains('\x1b'), "colours at a terminal");
        let json = log_with(true, true);
        let line: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
        assert_eq!(line["fields"]["message"], "grace period over");
        assert_eq!(line["level"], "WARN");
        assert!(!json.contains('\x1b'));
    }

    #[test]
    fn no_endpoint_exports_nothing() {
        let config = TelemetryConfig { service_name: "test", default_filter: "info", otlp_endpoint: Some(""), json: true };
        let guard = init(config).unwrap();
        assert!(!guard.exporting());
    }
}

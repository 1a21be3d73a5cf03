//! The port answers while the model loads, so probes, Prometheus and the operator see the process
//! and how far the load has come instead of a refused connection: `/health` 200, `/ready` 503
//! `{"status":"loading"}`, `/metrics` the `peregrine_load_progress` gauge (0–1, bytes of weights
//! read) and the process's memory, every other path 503 `model_loading` with `Retry-After`.
//! Served with the same connection limits as the real server, on a duplicate of its listening
//! socket; stopped once the model is loaded, and the real server accepts from then on.

use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use peregrine_api::admin::ProbeStatus;
use peregrine_api::metric_names as names;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::connections::{serve_connections, ConnectionLimits, ConnectionMetrics};
use super::error::ApiError;

/// How long a stop waits for the loading server's open connections before dropping them.
const STOP_WAIT: Duration = Duration::from_secs(2);

pub struct LoadingServer {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// Starts answering on `listener` until [`LoadingServer::stop`].
pub fn start(listener: TcpListener, limits: ConnectionLimits) -> LoadingServer {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let stop_accepting = async move {
            let _ = stopped.await;
        };
        serve_connections(listener, router(), limits, ConnectionMetrics::default(), stop_accepting).await;
    });
    LoadingServer { stop, task }
}

impl LoadingServer {
    /// Stops accepting; connections still open after [`STOP_WAIT`] are dropped.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let mut task = self.task;
        if tokio::time::timeout(STOP_WAIT, &mut task).await.is_err() {
            task.abort();
        }
    }
}

fn router() -> Router {
    Router::new()
        .route("/health", get(|| async { Json(ProbeStatus { status: "ok".into() }) }))
        .route("/ready", get(|| async { (StatusCode::SERVICE_UNAVAILABLE, Json(ProbeStatus { status: "loading".into() })) }))
        .route("/metrics", get(|| async { metrics_response() }))
        .fallback(|| async { ApiError::Loading.into_response() })
}

fn metrics_response() -> Response {
    let fraction = peregrine_engine::progress::weights().snapshot().fraction();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], render(fraction, super::metrics::resident_memory_bytes()))
        .into_response()
}

/// The exposition text of the loading server's `/metrics`.
pub fn render(fraction: f64, resident_bytes: Option<u64>) -> String {
    let mut out = format!(
        "# HELP {0} {1}\n# TYPE {0} gauge\n{0} {fraction}\n",
        names::LOAD_PROGRESS,
        LOAD_PROGRESS_HELP
    );
    if let Some(rss) = resident_bytes {
        out.push_str(&format!(
            "# HELP {0} Resident memory of the process.\n# TYPE {0} gauge\n{0} {rss}\n",
            names::PROCESS_RESIDENT_MEMORY_BYTES
        ));
    }
    out
}

/// One help text for the gauge here and on the real server's `/metrics`.
pub const LOAD_PROGRESS_HELP: &str = "Fraction of the model's weight bytes read (0-1; 1 once loaded).";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_text_names_the_gauge() {
        let text = render(0.25, Some(4096));
        assert!(text.contains("# TYPE peregrine_load_progress gauge\nperegrine_load_progress 0.25\n"), "{text}");
        assert!(text.contains("process_resident_memory_bytes 4096\n"), "{text}");
    }

    /// While loading, every path answers; the API paths with 503 `model_loading` in OpenAI's shape.
    #[tokio::test]
    async fn answers_probes_and_refuses_the_api_while_loading() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = start(listener, ConnectionLimits::default());
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        assert!(get("/health").await.starts_with("HTTP/1.1 200"));
        let ready = get("/ready").await;
        assert!(ready.starts_with("HTTP/1.1 503") && ready.contains(r#"{"status":"loading"}"#), "{ready}");
        let metrics = get("/metrics").await;
        assert!(metrics.starts_with("HTTP/1.1 200") && metrics.contains("peregrine_load_progress "), "{metrics}");
        let api = get("/v1/models").await;
        assert!(api.starts_with("HTTP/1.1 503"), "{api}");
        assert!(api.to_lowercase().contains("retry-after: 5"), "{api}");
        assert!(api.contains(r#""code":"model_loading""#) && api.contains("service_unavailable_error"), "{api}");
        server.stop().await;
        assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "stopped: nothing accepts on the port");
    }
}

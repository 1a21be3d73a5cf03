//! The operator's HTTP endpoints: `/metrics`, `/healthz`, `/readyz`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use crate::metrics::Metrics;

#[derive(Clone)]
pub struct ServerState {
    pub metrics: Metrics,
    /// Set once the process has a working API client (standby replicas are ready too: readiness is
    /// about this pod, leadership is the Lease's business).
    pub ready: Arc<AtomicBool>,
}

pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

async fn metrics(State(state): State<ServerState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
}

async fn readyz(State(state): State<ServerState>) -> impl IntoResponse {
    if state.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

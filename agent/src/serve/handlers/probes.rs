//! `/health`, `/ready`, `/metrics`, `/version`, `/v1/models`: what probes, Prometheus and the
//! operator read.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use peregrine_api::admin::{ProbeStatus, VersionInfo};
use peregrine_api::{ModelCard, ModelList};

use super::{fail, SharedState};
use crate::serve::backend::InferenceBackend;
use crate::serve::error::ApiError;

/// The process is alive and serving HTTP.
pub async fn health() -> Json<ProbeStatus> {
    Json(ProbeStatus { status: "ok".into() })
}

/// The model is loaded and warm, and the process is not draining.
pub async fn ready<B: InferenceBackend>(State(state): State<SharedState<B>>) -> Response {
    let status = if state.lifecycle.is_ready() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, Json(ProbeStatus { status: state.lifecycle.status().into() })).into_response()
}

pub async fn metrics<B: InferenceBackend>(State(state): State<SharedState<B>>) -> Response {
    match state.metrics.render() {
        Ok(text) => ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response(),
        Err(e) => fail(&state, ApiError::Internal(format!("metrics encoding: {e}"))),
    }
}

pub async fn version<B: InferenceBackend>(State(state): State<SharedState<B>>) -> Json<VersionInfo> {
    Json(VersionInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        model: state.backend.model_name().to_string(),
        backend: state.backend.backend_name(),
    })
}

/// The base model, then every adapter new requests can name (`parent` = the base model).
pub async fn models<B: InferenceBackend>(State(state): State<SharedState<B>>) -> Response {
    let adapters = match state.backend.adapters().await {
        Ok(a) => a,
        Err(e) => return fail(&state, e),
    };
    let mut names: Vec<String> = adapters.into_iter().filter(|a| a.state != "unloading").map(|a| a.name).collect();
    names.dedup();
    let base = state.backend.model_name().to_string();
    let max_model_len = state.backend.max_model_len();
    let mut data = vec![ModelCard {
        id: base.clone(),
        object: "model".into(),
        created: state.started,
        owned_by: "peregrine".into(),
        root: base.clone(),
        parent: None,
        max_model_len,
    }];
    data.extend(names.into_iter().map(|name| ModelCard {
        id: name,
        object: "model".into(),
        created: state.started,
        owned_by: "peregrine".into(),
        root: base.clone(),
        parent: Some(base.clone()),
        max_model_len,
    }));
    Json(ModelList { object: "list".into(), data }).into_response()
}

pub async fn not_found(uri: axum::http::Uri) -> Response {
    ApiError::RouteNotFound(uri.path().to_string()).into_response()
}

pub async fn method_not_allowed() -> Response {
    ApiError::MethodNotAllowed.into_response()
}

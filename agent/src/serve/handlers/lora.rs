//! LoRA admin: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter` (vLLM's bodies and
//! plain-text success answers, so vLLM tooling works unchanged) and `GET /v1/adapters`.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use peregrine_api::{AdapterList, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, ADAPTER_DIGEST_HEADER};

use super::{fail, SharedState};
use crate::serve::backend::{InferenceBackend, LoadOutcome};
use crate::serve::error::ApiError;
use crate::serve::parse::{body_bytes, parse_request};

fn text(message: String) -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], message).into_response()
}

pub async fn load<B: InferenceBackend>(State(state): State<SharedState<B>>, body: Result<Bytes, BytesRejection>) -> Response {
    let request = match body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<LoadLoraAdapterRequest>(&b)) {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let name = request.lora_name;
    if name == state.backend.model_name() {
        // It would be listed but never reachable: `model` resolves to the base model first.
        return fail(&state, ApiError::invalid(Some("lora_name".to_string()), format!("`{name}` is the base model's name; choose another adapter name")));
    }
    let Some(path) = state.config.adapter_roots.resolve(&request.lora_path) else {
        tracing::info!(adapter = %name, path = %request.lora_path, "LoRA adapter path refused: outside --lora-root or unreadable");
        return fail(&state, ApiError::AdapterUnreadable(name));
    };
    match state.backend.load_adapter(name.clone(), path).await {
        Ok(loaded) => {
            let what = match loaded.outcome {
                LoadOutcome::Loaded => "added successfully",
                LoadOutcome::Replaced => "replaced successfully",
                LoadOutcome::AlreadyLoaded => "is already loaded from this path",
            };
            tracing::info!(adapter = %name, path = %request.lora_path, rank = loaded.adapter.rank, digest = loaded.adapter.digest.as_deref().unwrap_or_default(), outcome = what, "LoRA adapter load");
            let mut response = text(format!("Success: LoRA adapter '{name}' {what}."));
            // The operator records what each pod loaded by this digest.
            if let Some(value) = loaded.adapter.digest.as_deref().and_then(|d| header::HeaderValue::from_str(d).ok()) {
                response.headers_mut().insert(ADAPTER_DIGEST_HEADER, value);
            }
            response
        }
        Err(e) => fail(&state, e),
    }
}

pub async fn unload<B: InferenceBackend>(State(state): State<SharedState<B>>, body: Result<Bytes, BytesRejection>) -> Response {
    let request = match body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<UnloadLoraAdapterRequest>(&b)) {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let name = request.lora_name;
    match state.backend.unload_adapter(name.clone()).await {
        Ok(info) => {
            tracing::info!(adapter = %name, in_flight = info.in_flight, "LoRA adapter unloaded");
            // Requests still running on it keep their own handles; the series leave `/metrics`.
            state.metrics.forget_model(&name);
            text(format!("Success: LoRA adapter '{name}' removed successfully."))
        }
        Err(e) => fail(&state, e),
    }
}

pub async fn list<B: InferenceBackend>(State(state): State<SharedState<B>>) -> Response {
    match state.backend.adapters().await {
        Ok(data) => Json(AdapterList { object: "list".into(), data }).into_response(),
        Err(e) => fail(&state, e),
    }
}

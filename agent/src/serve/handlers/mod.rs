//! One module per endpoint group.

pub mod chat;
pub mod classify;
pub mod completions;
pub mod embeddings;
pub mod lora;
pub mod probes;
pub mod rerank;

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use peregrine_engine::request::SamplingParams;

use super::backend::InferenceBackend;
use super::error::ApiError;
use super::state::AppState;

/// Counts the error, logs it and renders it.
pub fn fail<B: InferenceBackend>(state: &AppState<B>, e: ApiError) -> Response {
    state.metrics.error(e.label());
    if e.status().is_server_error() {
        tracing::error!(code = e.label(), error = %e, "request failed");
    } else {
        tracing::debug!(code = e.label(), error = %e, "request refused");
    }
    e.into_response()
}

/// `cmpl-…` / `chatcmpl-…`: unique per process run and request.
pub fn response_id(prefix: &str, started: u64, request_id: u64) -> String {
    format!("{prefix}-{started:x}{request_id:08x}")
}

/// OpenAI sampling fields → engine parameters (vLLM defaults where a field is absent).
#[allow(clippy::too_many_arguments)]
pub fn sampling_params(
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i64>,
    min_p: Option<f32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    repetition_penalty: Option<f32>,
    seed: Option<u64>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: bool,
    logprobs: Option<usize>,
) -> SamplingParams {
    SamplingParams {
        temperature: temperature.unwrap_or(1.0),
        top_k: top_k.filter(|k| *k > 0).map(|k| k as usize).unwrap_or(0),
        top_p: top_p.unwrap_or(1.0),
        min_p: min_p.unwrap_or(0.0),
        repetition_penalty: repetition_penalty.unwrap_or(1.0),
        presence_penalty: presence_penalty.unwrap_or(0.0),
        frequency_penalty: frequency_penalty.unwrap_or(0.0),
        seed,
        max_tokens: 0, // resolved against the prompt length in `generation::start`
        stop_token_ids: stop_token_ids.unwrap_or_default(),
        ignore_eos,
        logprobs,
    }
}

/// Validated `max_tokens` (≥ 1 by validation) as a count.
pub fn max_tokens(m: Option<i64>) -> Option<usize> {
    m.map(|m| usize::try_from(m).unwrap_or(usize::MAX))
}

pub type SharedState<B> = Arc<AppState<B>>;

//! One module per endpoint group.

pub mod chat;
pub mod classify;
pub mod completions;
pub mod embeddings;
pub mod lora;
pub mod probes;
pub mod rerank;
pub mod structured;
pub mod tei;

use std::future::Future;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use peregrine_api::{SamplingFields, Validate};
use serde::de::DeserializeOwned;
use serde::Serialize;
use peregrine_engine::request::SamplingParams;
use peregrine_engine::structured::CompiledGrammar;

use super::backend::{InferenceBackend, PromptInput};
use super::error::ApiError;
use super::generation::Job;
use super::parse::{body_bytes, parse_request};
use super::state::AppState;

/// Counts the error, logs it and renders it.
pub fn fail<B: InferenceBackend>(state: &AppState<B>, e: ApiError) -> Response {
    record_failure(state, &e);
    e.into_response()
}

/// Counts and logs a failed request (HTTP through [`fail`], gRPC through its status mapping).
pub fn record_failure<B: InferenceBackend>(state: &AppState<B>, e: &ApiError) {
    state.metrics.error(e.label());
    if e.status().is_server_error() {
        tracing::error!(code = e.label(), error = %e, "request failed");
    } else {
        tracing::debug!(code = e.label(), error = %e, "request refused");
    }
}

/// A JSON endpoint whose answer is a function of the validated request (the encoder endpoints, whose
/// functions gRPC shares): reads and parses the body, runs `respond`, renders the answer or the error.
pub async fn answer_json<B, Q, R, F, Fut>(state: &AppState<B>, body: Result<Bytes, BytesRejection>, respond: F) -> Response
where
    B: InferenceBackend,
    Q: DeserializeOwned + Validate,
    R: Serialize,
    F: FnOnce(Q) -> Fut,
    Fut: Future<Output = Result<R, ApiError>>,
{
    let request = body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<Q>(&b));
    let answer = match request {
        Ok(r) => respond(r).await,
        Err(e) => Err(e),
    };
    match answer {
        Ok(r) => axum::Json(r).into_response(),
        Err(e) => fail(state, e),
    }
}

/// `cmpl-…` / `chatcmpl-…`: unique per process run and request.
pub fn response_id(prefix: &str, started: u64, request_id: u64) -> String {
    format!("{prefix}-{started:x}{request_id:08x}")
}

/// The request's sampling fields → engine parameters (vLLM defaults where a field is absent).
/// `logprobs` is the endpoint's own field (a flag plus a count on chat, a count on completions).
pub fn sampling_params(f: &SamplingFields, logprobs: Option<usize>) -> SamplingParams {
    SamplingParams {
        temperature: f.temperature.unwrap_or(1.0),
        top_k: f.top_k.filter(|k| *k > 0).map(|k| k as usize).unwrap_or(0),
        top_p: f.top_p.unwrap_or(1.0),
        min_p: f.min_p.unwrap_or(0.0),
        repetition_penalty: f.repetition_penalty.unwrap_or(1.0),
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        seed: f.seed,
        max_tokens: 0, // resolved against the prompt length in `generation::start`
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos,
        logprobs,
        // Checked in validation; the engine checks the ids against the vocabulary.
        logit_bias: f.logit_bias_entries().unwrap_or_default(),
        grammar: None,
    }
}

/// The generation job both endpoints start: prompt, limits, sampling and stop strings.
pub fn job(
    model: &str,
    prompt: PromptInput,
    max_tokens_field: Option<i64>,
    f: &SamplingFields,
    logprobs: Option<usize>,
    grammar: Option<CompiledGrammar>,
) -> Job {
    Job {
        model: model.to_string(),
        prompt,
        max_tokens: max_tokens(max_tokens_field),
        params: SamplingParams { grammar, ..sampling_params(f, logprobs) },
        stop: f.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default(),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        follows: None,
    }
}

/// Usage of all choices: the prompt once (it is computed once), every choice's completion tokens.
pub fn total_usage(usages: &[peregrine_engine::request::Usage]) -> peregrine_api::common::Usage {
    let first = usages.first().copied().unwrap_or_default();
    let completion: usize = usages.iter().map(|u| u.completion_tokens).sum();
    peregrine_api::common::Usage::new(first.prompt_tokens, completion, first.cached_prompt_tokens)
}

/// Validated `max_tokens` (≥ 1 by validation) as a count.
pub fn max_tokens(m: Option<i64>) -> Option<usize> {
    m.map(|m| usize::try_from(m).unwrap_or(usize::MAX))
}

pub type SharedState<B> = Arc<AppState<B>>;

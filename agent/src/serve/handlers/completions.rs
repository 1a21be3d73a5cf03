//! `POST /v1/completions`.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use peregrine_api::common::Usage as ApiUsage;
use peregrine_api::completions::{CompletionChoice, CompletionLogprobs, TopLogprobMap};
use peregrine_api::{CompletionChunk, CompletionRequest, CompletionResponse, Prompt};

use super::{fail, job, response_id, structured, SharedState};
use crate::serve::backend::{InferenceBackend, PromptInput, TokenOutput};
use crate::serve::generation::{self, Running, Step};
use crate::serve::parse::{body_bytes, parse_request};
use crate::serve::tenant::Tenant;
use crate::serve::sse;
use crate::serve::state::unix_now;

pub async fn handle<B: InferenceBackend>(
    State(state): State<SharedState<B>>,
    Extension(tenant): Extension<Tenant>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request = match body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<CompletionRequest>(&b)) {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let prompt = match request.prompt {
        Prompt::Text(t) => PromptInput::Text(t),
        Prompt::Texts(mut v) => PromptInput::Text(v.pop().unwrap_or_default()),
        Prompt::Tokens(t) => PromptInput::Tokens(t),
        Prompt::TokenBatches(mut v) => PromptInput::Tokens(v.pop().unwrap_or_default()),
    };
    let logprobs = request.logprobs.map(|l| l as usize);
    // OpenAI's default for completions is 16 tokens.
    let grammar = match structured::grammar(&*state.backend, &request.structured).await {
        Ok(g) => g,
        Err(e) => return fail(&state, e),
    };
    let job = job(&request.model, prompt, request.sampling.max_tokens.or(Some(16)), &request.sampling, logprobs, grammar);
    let running = match generation::start(&state, tenant.0, job).await {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let out = Output {
        id: response_id("cmpl", state.started, running.request_id),
        created: unix_now(),
        model: request.model,
        logprobs: logprobs.is_some(),
    };
    if request.sampling.stream {
        let include_usage = request.sampling.stream_options.is_some_and(|o| o.include_usage);
        stream(out, running, include_usage)
    } else {
        complete(&state, out, running).await
    }
}

struct Output {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
}

impl Output {
    fn choice(&self, text: String, logprobs: Option<CompletionLogprobs>, finish_reason: Option<&str>) -> CompletionChoice {
        CompletionChoice { index: 0, text, logprobs, finish_reason: finish_reason.map(str::to_string) }
    }

    fn chunk(&self, choices: Vec<CompletionChoice>, usage: Option<Option<ApiUsage>>) -> CompletionChunk {
        CompletionChunk {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

fn push_logprobs(lp: &mut CompletionLogprobs, t: &TokenOutput, offset: usize) {
    lp.tokens.push(t.token_text.clone());
    lp.token_logprobs.push(t.logprob);
    lp.top_logprobs.push(TopLogprobMap(t.top_logprobs.clone()));
    lp.text_offset.push(offset);
}

fn api_usage(u: peregrine_engine::request::Usage) -> ApiUsage {
    ApiUsage::new(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
}

async fn complete<B: InferenceBackend>(state: &SharedState<B>, out: Output, mut running: Running) -> Response {
    let mut text = String::new();
    let mut logprobs = out.logprobs.then(CompletionLogprobs::default);
    while let Some(step) = running.next().await {
        match step {
            Step::Token(t) => {
                if let Some(lp) = logprobs.as_mut() {
                    push_logprobs(lp, &t, text.len());
                }
                text.push_str(&t.text);
            }
            Step::Finished { trailing_text, reason, usage } => {
                text.push_str(&trailing_text);
                let response = CompletionResponse {
                    id: out.id.clone(),
                    object: "text_completion".into(),
                    created: out.created,
                    model: out.model.clone(),
                    choices: vec![out.choice(text, logprobs, Some(reason.as_str()))],
                    usage: api_usage(usage),
                };
                return Json(response).into_response();
            }
            // Counted and logged by the generation when it ended; `fail` would count it twice.
            Step::Error(e) => return e.into_response(),
        }
    }
    fail(state, crate::serve::error::ApiError::EngineStopped)
}

fn stream(out: Output, running: Running, include_usage: bool) -> Response {
    let usage_field = move |u: Option<ApiUsage>| include_usage.then_some(u);
    let state = (out, running, 0usize, false);
    let body = futures::stream::unfold(state, move |(out, mut running, mut offset, finished)| async move {
        if finished {
            return None;
        }
        loop {
            let Some(step) = running.next().await else {
                return Some((Ok::<_, Infallible>(Bytes::from_static(sse::DONE)), (out, running, offset, true)));
            };
            let bytes = match step {
                Step::Token(t) => {
                    if t.text.is_empty() && !out.logprobs {
                        continue;
                    }
                    let lp = out.logprobs.then(|| {
                        let mut lp = CompletionLogprobs::default();
                        push_logprobs(&mut lp, &t, offset);
                        lp
                    });
                    offset += t.text.len();
                    sse::event(&out.chunk(vec![out.choice(t.text, lp, None)], usage_field(None)))
                }
                Step::Finished { trailing_text, reason, usage } => {
                    let mut b = sse::event(&out.chunk(vec![out.choice(trailing_text, None, Some(reason.as_str()))], usage_field(None)));
                    if include_usage {
                        b.extend(sse::event(&out.chunk(vec![], Some(Some(api_usage(usage))))));
                    }
                    b.extend_from_slice(sse::DONE);
                    return Some((Ok(Bytes::from(b)), (out, running, offset, true)));
                }
                Step::Error(e) => {
                    let mut b = sse::event(&e.body());
                    b.extend_from_slice(sse::DONE);
                    return Some((Ok(Bytes::from(b)), (out, running, offset, true)));
                }
            };
            return Some((Ok(Bytes::from(bytes)), (out, running, offset, false)));
        }
    });
    sse::response(body)
}

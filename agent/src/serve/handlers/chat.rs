//! `POST /v1/chat/completions`.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use peregrine_api::chat::{
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatTokenLogprob, Role, TopLogprob,
};
use peregrine_api::common::Usage as ApiUsage;
use peregrine_api::{ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse};

use super::{fail, job, response_id, structured, SharedState};
use crate::serve::backend::{ChatTurn, InferenceBackend, PromptInput, TokenOutput};
use crate::serve::error::ApiError;
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
    let request =
        match body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<ChatCompletionRequest>(&b)) {
            Ok(r) => r,
            Err(e) => return fail(&state, e),
        };
    let turns = request
        .messages
        .iter()
        .map(|m| ChatTurn {
            role: m.role.as_str().to_string(),
            content: m.content.as_ref().map(|c| c.text()).unwrap_or_default(),
        })
        .collect();
    // OpenAI: `top_logprobs` alternatives only when `logprobs` is true.
    let logprobs = request.logprobs.then(|| request.top_logprobs.unwrap_or(0) as usize);
    let grammar = match structured::grammar(&*state.backend, &request.structured).await {
        Ok(g) => g,
        Err(e) => return fail(&state, e),
    };
    let job = job(&request.model, PromptInput::Chat(turns), request.max_tokens(), &request.sampling, logprobs, grammar);
    let running = match generation::start(&state, tenant.0, job).await {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let out = Output {
        id: response_id("chatcmpl", state.started, running.request_id),
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
    fn chunk(&self, choices: Vec<ChatChunkChoice>, usage: Option<Option<ApiUsage>>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }
}

fn token_logprob(t: &TokenOutput) -> ChatTokenLogprob {
    ChatTokenLogprob {
        token: t.token_text.clone(),
        logprob: t.logprob.unwrap_or(f32::NEG_INFINITY),
        bytes: Some(t.token_text.as_bytes().to_vec()),
        top_logprobs: t
            .top_logprobs
            .iter()
            .map(|(token, logprob)| TopLogprob { token: token.clone(), logprob: *logprob, bytes: Some(token.as_bytes().to_vec()) })
            .collect(),
    }
}

fn api_usage(u: peregrine_engine::request::Usage) -> ApiUsage {
    ApiUsage::new(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
}

async fn complete<B: InferenceBackend>(state: &SharedState<B>, out: Output, mut running: Running) -> Response {
    let mut text = String::new();
    let mut logprobs = out.logprobs.then(ChatLogprobs::default);
    while let Some(step) = running.next().await {
        match step {
            Step::Token(t) => {
                if let Some(lp) = logprobs.as_mut() {
                    lp.content.push(token_logprob(&t));
                }
                text.push_str(&t.text);
            }
            Step::Finished { trailing_text, reason, usage } => {
                text.push_str(&trailing_text);
                let response = ChatCompletionResponse {
                    id: out.id,
                    object: "chat.completion".into(),
                    created: out.created,
                    model: out.model,
                    choices: vec![ChatChoice {
                        index: 0,
                        message: AssistantMessage { role: Role::Assistant, content: Some(text) },
                        logprobs,
                        finish_reason: Some(reason.as_str().to_string()),
                    }],
                    usage: api_usage(usage),
                };
                return Json(response).into_response();
            }
            // Counted and logged by the generation when it ended; `fail` would count it twice.
            Step::Error(e) => return e.into_response(),
        }
    }
    fail(state, ApiError::EngineStopped)
}

enum Phase {
    /// The first event carries the assistant role, as OpenAI's does.
    Role,
    Tokens,
    Done,
}

fn stream(out: Output, running: Running, include_usage: bool) -> Response {
    let usage_field = move |u: Option<ApiUsage>| include_usage.then_some(u);
    let choice = |delta: ChatDelta, logprobs: Option<ChatLogprobs>, finish: Option<&str>| ChatChunkChoice {
        index: 0,
        delta,
        logprobs,
        finish_reason: finish.map(str::to_string),
    };
    let body = futures::stream::unfold((out, running, Phase::Role), move |(out, mut running, phase)| async move {
        match phase {
            Phase::Done => None,
            Phase::Role => {
                let delta = ChatDelta { role: Some(Role::Assistant), content: Some(String::new()) };
                let b = sse::event(&out.chunk(vec![choice(delta, None, None)], usage_field(None)));
                Some((Ok::<_, Infallible>(Bytes::from(b)), (out, running, Phase::Tokens)))
            }
            Phase::Tokens => loop {
                let Some(step) = running.next().await else {
                    return Some((Ok(Bytes::from_static(sse::DONE)), (out, running, Phase::Done)));
                };
                match step {
                    Step::Token(t) => {
                        if t.text.is_empty() && !out.logprobs {
                            continue;
                        }
                        let lp = out.logprobs.then(|| ChatLogprobs { content: vec![token_logprob(&t)] });
                        let delta = ChatDelta { role: None, content: Some(t.text) };
                        let b = sse::event(&out.chunk(vec![choice(delta, lp, None)], usage_field(None)));
                        return Some((Ok(Bytes::from(b)), (out, running, Phase::Tokens)));
                    }
                    Step::Finished { trailing_text, reason, usage } => {
                        let delta = ChatDelta { role: None, content: (!trailing_text.is_empty()).then_some(trailing_text) };
                        let mut b = sse::event(&out.chunk(vec![choice(delta, None, Some(reason.as_str()))], usage_field(None)));
                        if include_usage {
                            b.extend(sse::event(&out.chunk(vec![], Some(Some(api_usage(usage))))));
                        }
                        b.extend_from_slice(sse::DONE);
                        return Some((Ok(Bytes::from(b)), (out, running, Phase::Done)));
                    }
                    Step::Error(e) => {
                        let mut b = sse::event(&e.body());
                        b.extend_from_slice(sse::DONE);
                        return Some((Ok(Bytes::from(b)), (out, running, Phase::Done)));
                    }
                }
            },
        }
    });
    sse::response(body)
}

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
use peregrine_api::tools::{FunctionCallDelta, ToolCallDelta, ToolType};
use peregrine_api::{ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse};
use peregrine_engine::request::FinishReason;
use peregrine_engine::structured::GrammarSpec;

use futures::StreamExt;

use super::{fail, job, response_id, structured, total_usage, SharedState};
use crate::serve::backend::{ChatTurn, InferenceBackend, PromptInput, TokenOutput};
use crate::serve::error::ApiError;
use crate::serve::generation::{self, Running, Step};
use crate::serve::parse::{body_bytes, parse_request};
use crate::serve::tenant::Tenant;
use crate::serve::sse;
use crate::serve::state::unix_now;
use crate::serve::tools::stream::{ToolDelta, ToolStream};
use crate::serve::tools::{self, ToolPlan};

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
            tool_calls: m.tool_calls.as_deref().map(tools::template_tool_calls),
            tool_call_id: m.tool_call_id.clone(),
            name: m.name.clone(),
        })
        .collect();
    // OpenAI: `top_logprobs` alternatives only when `logprobs` is true.
    let logprobs = request.logprobs.then(|| request.top_logprobs.unwrap_or(0) as usize);
    let tool_use = match request.tool_use() {
        Ok(t) => t,
        Err(e) => return fail(&state, e.into()),
    };
    let Some(plan) = ToolPlan::new(&tool_use, state.config.tool_call_format) else {
        return fail(
            &state,
            ApiError::invalid(
                Some("tool_choice".to_string()),
                "tool_choice `auto` needs a tool-call format, and this model's chat template names none: start the server \
                 with --tool-call-parser, or use tool_choice `required` or a named function",
            ),
        );
    };
    let declared = request.tools.as_deref().unwrap_or(&[]);
    // A forced call's grammar replaces the (then absent, see validation) structured-output one.
    let grammar = match tools::forced_schema(declared, &tool_use) {
        Some(schema) => state.backend.compile_grammar(GrammarSpec::JsonSchema(schema), "tools").await.map(Some),
        None => structured::grammar(&*state.backend, &request.structured).await,
    };
    let grammar = match grammar {
        Ok(g) => g,
        Err(e) => return fail(&state, e),
    };
    let template_tools = (!declared.is_empty()).then(|| serde_json::to_value(declared).unwrap_or_default());
    let prompt = PromptInput::Chat { turns, tools: template_tools };
    let job = job(&request.model, prompt, request.max_tokens(), &request.sampling, logprobs, grammar);
    let n = request.sampling.n.unwrap_or(1) as usize;
    let runs = match generation::start_choices(&state, tenant.0, job, n).await {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let out = Output {
        id: response_id("chatcmpl", state.started, runs.first().map_or(0, |r| r.request_id)),
        created: unix_now(),
        model: request.model,
        logprobs: logprobs.is_some(),
        tools: plan,
    };
    if request.sampling.stream {
        let include_usage = request.sampling.stream_options.is_some_and(|o| o.include_usage);
        stream(out, runs, include_usage)
    } else {
        complete(&state, out, runs).await
    }
}

struct Output {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
    tools: ToolPlan,
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

/// Reads every choice to its end and answers with all of them, in index order.
async fn complete<B: InferenceBackend>(state: &SharedState<B>, out: Output, runs: Vec<Running>) -> Response {
    let total = runs.len();
    let mut texts = vec![String::new(); total];
    let mut logprobs: Vec<Option<ChatLogprobs>> = (0..total).map(|_| out.logprobs.then(ChatLogprobs::default)).collect();
    let mut finished: Vec<Option<(FinishReason, peregrine_engine::request::Usage)>> = vec![None; total];
    let mut steps = generation::merge_choices(runs);
    while let Some((i, step)) = steps.next().await {
        match step {
            Step::Token(t) => {
                if let Some(lp) = logprobs.get_mut(i).and_then(Option::as_mut) {
                    lp.content.push(token_logprob(&t));
                }
                if let Some(text) = texts.get_mut(i) {
                    text.push_str(&t.text);
                }
            }
            Step::Finished { trailing_text, reason, usage } => {
                if let (Some(text), Some(f)) = (texts.get_mut(i), finished.get_mut(i)) {
                    text.push_str(&trailing_text);
                    *f = Some((reason, usage));
                }
            }
            // Counted and logged by the generation when it ended; `fail` would count it twice.
            Step::Error(e) => return e.into_response(),
        }
    }
    let mut choices = Vec::with_capacity(total);
    let mut usages = Vec::with_capacity(total);
    for (index, ((text, logprobs), f)) in texts.into_iter().zip(logprobs).zip(finished).enumerate() {
        let Some((reason, usage)) = f else { return fail(state, ApiError::EngineStopped) };
        usages.push(usage);
        let parsed = tools::parse_output(&out.tools, &text);
        let called = !parsed.calls.is_empty();
        // Ids unique per choice: the response id's hex, the choice, the call.
        let tool_calls = called.then(|| tools::api_calls(&format!("{}{index:x}", out.id), parsed.calls));
        choices.push(ChatChoice {
            index: index as u32,
            message: AssistantMessage { role: Role::Assistant, content: parsed.content, tool_calls },
            logprobs,
            finish_reason: Some(finish_reason(reason, called).to_string()),
        });
    }
    let response = ChatCompletionResponse {
        choices,
        id: out.id,
        object: "chat.completion".into(),
        created: out.created,
        model: out.model,
        usage: total_usage(&usages),
    };
    Json(response).into_response()
}

/// `tool_calls` when the model ended on its own after calling tools (OpenAI's reason), else the
/// engine's.
fn finish_reason(reason: FinishReason, called: bool) -> &'static str {
    if called && reason == FinishReason::Stop {
        "tool_calls"
    } else {
        reason.as_str()
    }
}

/// One streamed piece of choice `choice` as a chunk's delta; a call's first delta carries its id
/// and type.
fn chat_delta(out: &Output, choice: usize, d: ToolDelta) -> ChatDelta {
    let call = |index: usize, id: Option<String>, function: FunctionCallDelta| ChatDelta {
        tool_calls: Some(vec![ToolCallDelta { index: index as u32, kind: id.as_ref().map(|_| ToolType::Function), id, function }]),
        ..ChatDelta::default()
    };
    match d {
        ToolDelta::Content(text) => ChatDelta { content: Some(text), ..ChatDelta::default() },
        ToolDelta::Call { index, name } => call(
            index,
            Some(tools::call_id(&format!("{}{choice:x}", out.id), index)),
            FunctionCallDelta { name: Some(name), arguments: Some(String::new()) },
        ),
        ToolDelta::Arguments { index, text } => call(index, None, FunctionCallDelta { name: None, arguments: Some(text) }),
    }
}

/// Streams every choice's chunks as they come, each with its `index` (the first chunk of each
/// carries the assistant role); `[DONE]` after the last choice finishes.
fn stream(out: Output, runs: Vec<Running>, include_usage: bool) -> Response {
    let usage_field = move |u: Option<ApiUsage>| include_usage.then_some(u);
    let choice = |index: usize, delta: ChatDelta, logprobs: Option<ChatLogprobs>, finish: Option<&str>| ChatChunkChoice {
        index: index as u32,
        delta,
        logprobs,
        finish_reason: finish.map(str::to_string),
    };
    let total = runs.len();
    let tool_streams: Vec<ToolStream> = (0..total).map(|_| ToolStream::new(&out.tools)).collect();
    let steps = generation::merge_choices(runs);
    let state = (out, steps, tool_streams, Vec::with_capacity(total), Phase::Role);
    let body = futures::stream::unfold(state, move |(out, mut steps, mut tools, mut usages, phase)| async move {
        match phase {
            Phase::Done => None,
            Phase::Role => {
                let mut b = Vec::new();
                for i in 0..total {
                    let delta = ChatDelta { role: Some(Role::Assistant), content: Some(String::new()), ..ChatDelta::default() };
                    b.extend(sse::event(&out.chunk(vec![choice(i, delta, None, None)], usage_field(None))));
                }
                Some((Ok::<_, Infallible>(Bytes::from(b)), (out, steps, tools, usages, Phase::Tokens)))
            }
            Phase::Tokens => loop {
                let Some((i, step)) = steps.next().await else {
                    return Some((Ok(Bytes::from_static(sse::DONE)), (out, steps, tools, usages, Phase::Done)));
                };
                let Some(tool_stream) = tools.get_mut(i) else { continue };
                match step {
                    Step::Token(t) => {
                        let deltas = tool_stream.push(&t.text);
                        let mut lp = out.logprobs.then(|| ChatLogprobs { content: vec![token_logprob(&t)] });
                        if deltas.is_empty() && lp.is_none() {
                            continue;
                        }
                        let mut b = Vec::new();
                        if deltas.is_empty() {
                            // Nothing to show yet, but the token's logprobs are sent with it.
                            let delta = ChatDelta { content: Some(String::new()), ..ChatDelta::default() };
                            b.extend(sse::event(&out.chunk(vec![choice(i, delta, lp.take(), None)], usage_field(None))));
                        }
                        for d in deltas {
                            let delta = chat_delta(&out, i, d);
                            b.extend(sse::event(&out.chunk(vec![choice(i, delta, lp.take(), None)], usage_field(None))));
                        }
                        return Some((Ok(Bytes::from(b)), (out, steps, tools, usages, Phase::Tokens)));
                    }
                    Step::Finished { trailing_text, reason, usage } => {
                        let mut deltas = tool_stream.push(&trailing_text);
                        deltas.extend(tool_stream.finish());
                        let called = tool_stream.called();
                        // The last piece rides on the chunk that carries the finish reason.
                        let last = deltas.pop().map(|d| chat_delta(&out, i, d)).unwrap_or_default();
                        let mut b = Vec::new();
                        for d in deltas {
                            b.extend(sse::event(&out.chunk(vec![choice(i, chat_delta(&out, i, d), None, None)], usage_field(None))));
                        }
                        let finish = finish_reason(reason, called);
                        b.extend(sse::event(&out.chunk(vec![choice(i, last, None, Some(finish))], usage_field(None))));
                        usages.push(usage);
                        if usages.len() < total {
                            return Some((Ok(Bytes::from(b)), (out, steps, tools, usages, Phase::Tokens)));
                        }
                        if include_usage {
                            b.extend(sse::event(&out.chunk(vec![], Some(Some(total_usage(&usages))))));
                        }
                        b.extend_from_slice(sse::DONE);
                        return Some((Ok(Bytes::from(b)), (out, steps, tools, usages, Phase::Done)));
                    }
                    Step::Error(e) => {
                        let mut b = sse::event(&e.body());
                        b.extend_from_slice(sse::DONE);
                        return Some((Ok(Bytes::from(b)), (out, steps, tools, usages, Phase::Done)));
                    }
                }
            },
        }
    });
    sse::response(body)
}

enum Phase {
    /// The first event carries the assistant role, as OpenAI's does.
    Role,
    Tokens,
    Done,
}

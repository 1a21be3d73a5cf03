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

use futures::StreamExt;

use super::{fail, job, response_id, structured, total_usage, SharedState};
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
    let (n, best_of) = (request.n(), request.best_of());
    let prompt = match request.prompt {
        Prompt::Text(t) => PromptInput::Text(t),
        Prompt::Texts(mut v) => PromptInput::Text(v.pop().unwrap_or_default()),
        Prompt::Tokens(t) => PromptInput::Tokens(t),
        Prompt::TokenBatches(mut v) => PromptInput::Tokens(v.pop().unwrap_or_default()),
    };
    let logprobs = request.logprobs.map(|l| l as usize);
    // Ranking `best_of` choices needs each token's logprob, asked or not.
    let engine_logprobs = if best_of > n { Some(logprobs.unwrap_or(0)) } else { logprobs };
    // OpenAI's default for completions is 16 tokens.
    let grammar = match structured::grammar(&*state.backend, &request.structured).await {
        Ok(g) => g,
        Err(e) => return fail(&state, e),
    };
    let job = job(&request.model, prompt, request.sampling.max_tokens.or(Some(16)), &request.sampling, engine_logprobs, grammar);
    let runs = match generation::start_choices(&state, tenant.0, job, best_of).await {
        Ok(r) => r,
        Err(e) => return fail(&state, e),
    };
    let out = Output {
        id: response_id("cmpl", state.started, runs.first().map_or(0, |r| r.request_id)),
        created: unix_now(),
        model: request.model,
        logprobs: logprobs.is_some(),
    };
    if request.sampling.stream {
        let include_usage = request.sampling.stream_options.is_some_and(|o| o.include_usage);
        stream(out, runs, include_usage)
    } else {
        complete(&state, out, runs, n).await
    }
}

struct Output {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
}

impl Output {
    fn choice(&self, index: usize, text: String, logprobs: Option<CompletionLogprobs>, finish_reason: Option<&str>) -> CompletionChoice {
        CompletionChoice { index: index as u32, text, logprobs, finish_reason: finish_reason.map(str::to_string) }
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

/// One choice being collected.
#[derive(Default)]
struct Collected {
    text: String,
    logprobs: CompletionLogprobs,
    /// Sum of the sampled tokens' logprobs (ranks `best_of` choices).
    cumulative: f64,
    finish: Option<(&'static str, peregrine_engine::request::Usage)>,
}

/// Reads every choice to its end; returns the `n` best (highest cumulative logprob, OpenAI's and
/// vLLM's `best_of` rule; with `best_of == n`, all of them in order), numbered from 0.
async fn complete<B: InferenceBackend>(state: &SharedState<B>, out: Output, runs: Vec<Running>, n: usize) -> Response {
    let total = runs.len();
    let mut choices: Vec<Collected> = (0..total).map(|_| Collected::default()).collect();
    let mut steps = generation::merge_choices(runs);
    while let Some((i, step)) = steps.next().await {
        let Some(c) = choices.get_mut(i) else { continue };
        match step {
            Step::Token(t) => {
                push_logprobs(&mut c.logprobs, &t, c.text.len());
                c.cumulative += f64::from(t.logprob.unwrap_or(0.0));
                c.text.push_str(&t.text);
            }
            Step::Finished { trailing_text, reason, usage } => {
                c.text.push_str(&trailing_text);
                c.finish = Some((reason.as_str(), usage));
            }
            // Counted and logged by the generation when it ended; `fail` would count it twice.
            Step::Error(e) => return e.into_response(),
        }
    }
    if choices.iter().any(|c| c.finish.is_none()) {
        return fail(state, crate::serve::error::ApiError::EngineStopped);
    }
    let usages: Vec<_> = choices.iter().filter_map(|c| c.finish.map(|(_, u)| u)).collect();
    let mut order: Vec<usize> = (0..total).collect();
    if total > n {
        // Stable: ties keep generation order.
        order.sort_by(|&a, &b| choices[b].cumulative.total_cmp(&choices[a].cumulative));
        order.truncate(n);
    }
    let picked = order
        .into_iter()
        .enumerate()
        .map(|(index, i)| {
            let c = std::mem::take(&mut choices[i]);
            let reason = c.finish.map(|(r, _)| r);
            out.choice(index, c.text, out.logprobs.then_some(c.logprobs), reason)
        })
        .collect();
    let response = CompletionResponse {
        id: out.id.clone(),
        object: "text_completion".into(),
        created: out.created,
        model: out.model.clone(),
        choices: picked,
        usage: total_usage(&usages),
    };
    Json(response).into_response()
}

/// Streams every choice's chunks as they come, each with its `index`; `[DONE]` after the last
/// choice finishes (and the usage chunk of all of them, when asked for).
fn stream(out: Output, runs: Vec<Running>, include_usage: bool) -> Response {
    let usage_field = move |u: Option<ApiUsage>| include_usage.then_some(u);
    let total = runs.len();
    let state = (out, generation::merge_choices(runs), vec![0usize; total], Vec::with_capacity(total), false);
    let body = futures::stream::unfold(state, move |(out, mut steps, mut offsets, mut usages, finished)| async move {
        if finished {
            return None;
        }
        loop {
            let Some((i, step)) = steps.next().await else {
                return Some((Ok::<_, Infallible>(Bytes::from_static(sse::DONE)), (out, steps, offsets, usages, true)));
            };
            let bytes = match step {
                Step::Token(t) => {
                    if t.text.is_empty() && !out.logprobs {
                        continue;
                    }
                    let offset = offsets.get(i).copied().unwrap_or(0);
                    let lp = out.logprobs.then(|| {
                        let mut lp = CompletionLogprobs::default();
                        push_logprobs(&mut lp, &t, offset);
                        lp
                    });
                    if let Some(o) = offsets.get_mut(i) {
                        *o += t.text.len();
                    }
                    sse::event(&out.chunk(vec![out.choice(i, t.text, lp, None)], usage_field(None)))
                }
                Step::Finished { trailing_text, reason, usage } => {
                    usages.push(usage);
                    let mut b = sse::event(&out.chunk(vec![out.choice(i, trailing_text, None, Some(reason.as_str()))], usage_field(None)));
                    if usages.len() < total {
                        return Some((Ok(Bytes::from(b)), (out, steps, offsets, usages, false)));
                    }
                    if include_usage {
                        b.extend(sse::event(&out.chunk(vec![], Some(Some(total_usage(&usages))))));
                    }
                    b.extend_from_slice(sse::DONE);
                    return Some((Ok(Bytes::from(b)), (out, steps, offsets, usages, true)));
                }
                Step::Error(e) => {
                    let mut b = sse::event(&e.body());
                    b.extend_from_slice(sse::DONE);
                    return Some((Ok(Bytes::from(b)), (out, steps, offsets, usages, true)));
                }
            };
            return Some((Ok(Bytes::from(bytes)), (out, steps, offsets, usages, false)));
        }
    });
    sse::response(body)
}

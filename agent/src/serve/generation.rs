//! One request's life between the HTTP handlers and the backend: model resolution, admission,
//! tokenizing, length checks, token reservations, then the event stream with metrics and trace
//! events recorded as it goes. Endpoint handlers only shape the JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use peregrine_engine::request::{FinishReason, SamplingParams, Usage};
use tracing::Span;

use super::admission::{RunningSlot, WaitingSlot};
use super::tenant::TenantId;
use super::backend::{EventStream, GenerateEvent, GenerateInput, InferenceBackend, PreparedPrompt, PromptInput, TokenOutput};
use super::error::ApiError;
use super::metrics::{served_label, Metrics, ModelSeries};
use super::state::AppState;
use super::vllm::activity::ActivityGuard;

/// What an endpoint asks for, after its own request type is validated.
#[derive(Debug, Clone)]
pub struct Job {
    /// The `model` field: the base model or an adapter.
    pub model: String,
    pub prompt: PromptInput,
    /// None: up to the context length.
    pub max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub stop: Vec<String>,
    pub skip_special_tokens: bool,
    /// Another choice of the same request (`n > 1`) whose prompt this one shares (see
    /// `EngineHandle::submit_following`); None: an ordinary request.
    pub follows: Option<u64>,
}

/// What a handler reads from a running request.
#[derive(Debug)]
pub enum Step {
    Token(TokenOutput),
    Finished { trailing_text: String, reason: FinishReason, usage: Usage },
    Error(ApiError),
}

pub struct Running {
    pub request_id: u64,
    pub prompt_tokens: usize,
    events: EventStream,
    /// The model's series, looked up once (not a labelled-family lookup per token).
    series: ModelSeries,
    metrics: Metrics,
    waiting: WaitingSlot,
    running: Option<RunningSlot>,
    /// Waiting → running → gone, for vLLM's queue gauges and `vllm:lora_requests_info`.
    activity: ActivityGuard,
    arrival: Instant,
    last_token: Option<Instant>,
    completion_tokens: usize,
    reservation: Option<TokenReservation>,
    /// Completes when the shutdown grace period is over.
    cut_off: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    span: Span,
    done: bool,
}

/// Gives unused reserved tokens back to a tenant's bucket (type-erased so `Running` is not generic).
pub trait Refund: Send + Sync {
    fn refund(&self, tenant: TenantId, tokens: u64);
}

/// Tokens reserved from a tenant's per-minute budget before a request runs. However the request
/// ends (finished, refused after reserving, failed, aborted by the client), dropping this settles
/// the budget to what was used: the prompt once it was processed, plus the tokens generated.
pub struct TokenReservation {
    refund: Arc<dyn Refund>,
    tenant: TenantId,
    reserved: u64,
    used: u64,
}

impl TokenReservation {
    pub fn new(refund: Arc<dyn Refund>, tenant: TenantId, reserved: u64) -> Self {
        TokenReservation { refund, tenant, reserved, used: 0 }
    }

    /// Sets what the request has used so far (never more than was reserved).
    pub fn set_used(&mut self, used: u64) {
        self.used = used.min(self.reserved);
    }
}

impl Drop for TokenReservation {
    fn drop(&mut self) {
        let unused = self.reserved - self.used;
        if unused > 0 {
            self.refund.refund(self.tenant, unused);
        }
    }
}

impl<B: InferenceBackend> Refund for AppState<B> {
    fn refund(&self, tenant: TenantId, tokens: u64) {
        self.limiter.refund_tokens(tenant, tokens);
    }
}

/// Admits and submits a request. Errors here become the HTTP status of the response.
pub async fn start<B: InferenceBackend>(
    state: &Arc<AppState<B>>,
    tenant: Option<TenantId>,
    job: Job,
) -> Result<Running, ApiError> {
    let arrival = Instant::now();
    let series = model_series(state, &job.model)?;
    // No refusal while draining: load balancers may still route here until they see `/ready` fail,
    // and every request that reaches us is served (the listener closes after the drain delay).
    let waiting = state.admission.try_admit(vec![series.waiting.clone(), series.totals.waiting.clone()])?;
    let (pending, input) = check(state, tenant, job, series, waiting, arrival, None).await?;
    let events = state.backend.generate(input)?;
    Ok(pending.launch(state, events))
}

/// Starts the `n` choices of one job: the first computes the prompt, the others follow it (they
/// fork its KV blocks once it is computed). A seeded request gives choice `i` the seed `seed + i`
/// so that its choices differ. Each choice is a request of its own to the queue and a sequence to
/// the engine, and the `n` are admitted as a whole, as vLLM admits a request's sequence group:
/// all `n` waiting slots are taken at once or the request is refused (429 while the queue is too
/// full, 400 when `n` exceeds the queue or `max_num_seqs`, which it never could fit); the engine
/// receives them in one message and starts them together (see `EngineHandle::submit_choices`).
/// Waiting as a whole rather than running some choices early: the response needs them all.
pub async fn start_choices<B: InferenceBackend>(
    state: &Arc<AppState<B>>,
    tenant: Option<TenantId>,
    job: Job,
    n: usize,
) -> Result<Vec<Running>, ApiError> {
    if n <= 1 {
        return Ok(vec![start(state, tenant, job).await?]);
    }
    let arrival = Instant::now();
    let series = model_series(state, &job.model)?;
    let slots = state.admission.try_admit_many(n, vec![series.waiting.clone(), series.totals.waiting.clone()])?;
    let mut pending = Vec::with_capacity(n);
    let mut inputs: Vec<GenerateInput> = Vec::with_capacity(n);
    for (i, slot) in slots.into_iter().enumerate() {
        let mut choice = job.clone();
        choice.params.seed = job.params.seed.map(|s| s.wrapping_add(i as u64));
        // The prompt is tokenized once.
        let prompt = inputs.first().map(|first| first.prompt.clone());
        let (p, mut input) = check(state, tenant, choice, series.clone(), slot, arrival, prompt).await?;
        input.follows = inputs.first().map(|first| first.request_id);
        pending.push(p);
        inputs.push(input);
    }
    // If this fails, dropping `pending` gives back every slot and token reservation.
    let streams = state.backend.generate_choices(inputs)?;
    Ok(pending.into_iter().zip(streams).map(|(p, events)| p.launch(state, events)).collect())
}

/// The series of the model a job names (the base model or one of its adapters).
fn model_series<B: InferenceBackend>(state: &Arc<AppState<B>>, model: &str) -> Result<ModelSeries, ApiError> {
    let Some(label) = served_label(state.backend.as_ref(), model) else {
        return Err(ApiError::ModelNotFound(model.to_string()));
    };
    Ok(state.metrics.series(&label))
}

/// A request admitted to the queue and checked, not yet submitted.
struct Pending {
    request_id: u64,
    prompt_tokens: usize,
    series: ModelSeries,
    activity: ActivityGuard,
    waiting: WaitingSlot,
    arrival: Instant,
    reservation: Option<TokenReservation>,
    span: Span,
}

impl Pending {
    fn launch<B: InferenceBackend>(self, state: &Arc<AppState<B>>, events: EventStream) -> Running {
        tracing::debug!(parent: &self.span, "queued");
        Running {
            request_id: self.request_id,
            prompt_tokens: self.prompt_tokens,
            events,
            series: self.series,
            activity: self.activity,
            metrics: state.metrics.clone(),
            waiting: self.waiting,
            running: None,
            arrival: self.arrival,
            last_token: None,
            completion_tokens: 0,
            reservation: self.reservation,
            cut_off: Box::pin(state.lifecycle.cut_off_signal()),
            span: self.span,
            done: false,
        }
    }
}

/// Tokenizes (unless `prompt` is given), checks the length and reserves the tenant's tokens for
/// a request holding a waiting slot.
async fn check<B: InferenceBackend>(
    state: &Arc<AppState<B>>,
    tenant: Option<TenantId>,
    job: Job,
    series: ModelSeries,
    waiting: WaitingSlot,
    arrival: Instant,
    prompt: Option<PreparedPrompt>,
) -> Result<(Pending, GenerateInput), ApiError> {
    let backend = &state.backend;
    let adapter = (job.model != backend.model_name()).then(|| job.model.clone());
    let activity = state.metrics.vllm.enter(adapter.clone());
    let request_id = state.next_request_id();
    let span = tracing::info_span!(
        "request",
        request_id,
        model = %job.model,
        prompt_tokens = tracing::field::Empty,
        max_tokens = tracing::field::Empty,
        completion_tokens = tracing::field::Empty,
        finish_reason = tracing::field::Empty,
    );

    let prompt = match prompt {
        Some(p) => p,
        None => backend.prepare(job.prompt).await?,
    };
    let prompt_len = prompt.tokens.len();
    if prompt_len == 0 {
        return Err(ApiError::invalid(Some("prompt".to_string()), "the prompt is empty"));
    }
    let max_len = backend.max_model_len();
    let max_tokens = match job.max_tokens {
        Some(m) if prompt_len.saturating_add(m) > max_len => {
            return Err(ApiError::ContextLengthExceeded(format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens \
                 ({prompt_len} in the prompt, {m} in the completion). Please reduce the prompt or max_tokens.",
                prompt_len.saturating_add(m)
            )))
        }
        Some(m) => m,
        None if prompt_len >= max_len => {
            return Err(ApiError::ContextLengthExceeded(format!(
                "This model's maximum context length is {max_len} tokens. However, the prompt has {prompt_len} tokens."
            )))
        }
        None => max_len - prompt_len,
    };
    span.record("prompt_tokens", prompt_len);
    span.record("max_tokens", max_tokens);

    let reservation = match tenant {
        Some(t) => {
            let reserve = (prompt_len + max_tokens) as u64;
            state
                .limiter
                .reserve_tokens(t, state.keys.limits(t), reserve, Instant::now())
                .map_err(|r| ApiError::RateLimited {
                    message: format!("rate limit reached for {} per minute; retry after {:.1}s", r.what, r.retry_after.as_secs_f64()),
                    retry_after: r.retry_after,
                })?;
            // From here every early return gives the whole reservation back.
            Some(TokenReservation::new(state.clone() as Arc<dyn Refund>, t, reserve))
        }
        None => None,
    };

    let mut params = job.params;
    params.max_tokens = max_tokens;
    let input = GenerateInput {
        request_id,
        prompt,
        params,
        stop: job.stop,
        skip_special_tokens: job.skip_special_tokens,
        adapter,
        follows: job.follows,
    };
    let pending = Pending { request_id, prompt_tokens: prompt_len, series, activity, waiting, arrival, reservation, span };
    Ok((pending, input))
}

/// One choice's steps, tagged with its index.
pub type ChoiceSteps = std::pin::Pin<Box<dyn futures::Stream<Item = (usize, Step)> + Send>>;

/// The choices' steps as they come, each with its choice index.
pub fn merge_choices(runs: Vec<Running>) -> futures::stream::SelectAll<ChoiceSteps> {
    futures::stream::select_all(runs.into_iter().enumerate().map(|(i, r)| {
        Box::pin(futures::stream::unfold(r, move |mut r| async move { r.next().await.map(|s| ((i, s), r)) })) as ChoiceSteps
    }))
}

impl Running {
    /// The next thing to tell the client; None once finished.
    pub async fn next(&mut self) -> Option<Step> {
        if self.done {
            return None;
        }
        loop {
            let next = tokio::select! {
                biased;
                () = &mut self.cut_off => None,
                event = self.events.next() => Some(event),
            };
            let Some(next) = next else {
                // Shutdown's grace period is over: a clean 503 / SSE error, and the stream is
                // dropped below, which aborts the request in the engine.
                self.done = true;
                self.activity.finish();
                self.metrics.error(ApiError::Draining.label());
                self.series.finished("abort").inc();
                self.series.totals.requests_finished.inc();
                tracing::warn!(parent: &self.span, "cut off at the end of the shutdown grace period");
                return Some(Step::Error(ApiError::Draining));
            };
            let Some(event) = next else {
                self.done = true;
                self.activity.finish();
                self.metrics.error("engine_stopped");
                return Some(Step::Error(ApiError::EngineStopped));
            };
            match event {
                GenerateEvent::Scheduled { queue_time } => self.on_scheduled(queue_time),
                GenerateEvent::Token(t) => {
                    self.on_token();
                    return Some(Step::Token(t));
                }
                GenerateEvent::Finished { trailing_text, reason, usage } => {
                    self.on_finished(reason, usage);
                    return Some(Step::Finished { trailing_text, reason, usage });
                }
                GenerateEvent::Error(e) => {
                    self.done = true;
                    self.activity.finish();
                    self.metrics.error(e.label());
                    tracing::warn!(parent: &self.span, error = %e, "failed");
                    return Some(Step::Error(e));
                }
            }
        }
    }

    fn on_scheduled(&mut self, queue_time: Duration) {
        if self.running.is_none() {
            self.waiting.release();
            self.running = Some(RunningSlot::new(vec![self.series.running.clone(), self.series.totals.running.clone()]));
            self.activity.scheduled();
            // Time in our own queue (tokenizing) plus the engine's.
            let queued = self.arrival.elapsed().max(queue_time);
            self.series.queue_time.observe(queued.as_secs_f64());
            self.metrics.vllm.request_queue_time.observe(queued.as_secs_f64());
            self.charge();
            tracing::info!(parent: &self.span, queue_time_s = queue_time.as_secs_f64(), "scheduled");
        }
    }

    fn on_token(&mut self) {
        let now = Instant::now();
        if self.running.is_none() {
            // A backend that does not report scheduling still leaves the queue at its first token.
            self.on_scheduled(Duration::ZERO);
        }
        match self.last_token {
            None => {
                self.series.time_to_first_token.observe((now - self.arrival).as_secs_f64());
                self.metrics.vllm.time_to_first_token.observe((now - self.arrival).as_secs_f64());
                // vLLM counts a prompt's tokens when its prefill completes.
                self.metrics.vllm.prompt_tokens.inc_by(self.prompt_tokens as u64);
                tracing::info!(parent: &self.span, ttft_s = (now - self.arrival).as_secs_f64(), "first_token");
            }
            Some(prev) => {
                self.series.time_per_output_token.observe((now - prev).as_secs_f64());
                self.metrics.vllm.time_per_output_token.observe((now - prev).as_secs_f64());
            }
        }
        self.last_token = Some(now);
        self.series.generation_tokens.inc();
        self.series.totals.generation_tokens.inc();
        self.metrics.vllm.generation_tokens.inc();
        self.completion_tokens += 1;
        self.charge();
    }

    /// Once scheduled, the prompt has been (or is being) processed: it is charged, and every token
    /// generated so far, so an abort or a failure settles to what the engine did.
    fn charge(&mut self) {
        if let Some(r) = self.reservation.as_mut() {
            r.set_used((self.prompt_tokens + self.completion_tokens) as u64);
        }
    }

    fn on_finished(&mut self, reason: FinishReason, usage: Usage) {
        self.done = true;
        self.series.e2e_latency.observe(self.arrival.elapsed().as_secs_f64());
        self.metrics.vllm.e2e_request_latency.observe(self.arrival.elapsed().as_secs_f64());
        self.metrics.vllm.prefix_cache_queries.inc_by(usage.prompt_tokens as u64);
        self.metrics.vllm.prefix_cache_hits.inc_by(usage.cached_prompt_tokens as u64);
        self.activity.finish();
        self.series.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        self.series.totals.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        self.series.prefix_cache_hit_tokens.inc_by(usage.cached_prompt_tokens as u64);
        self.series.finished(reason.as_str()).inc();
        self.series.totals.requests_finished.inc();
        if let Some(mut r) = self.reservation.take() {
            r.set_used((usage.prompt_tokens + usage.completion_tokens) as u64);
        }
        self.span.record("completion_tokens", usage.completion_tokens);
        self.span.record("finish_reason", reason.as_str());
        tracing::info!(parent: &self.span, e2e_s = self.arrival.elapsed().as_secs_f64(), "finished");
        self.running = None;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.done {
            // The client went away: dropping `events` aborts the request in the engine.
            self.series.finished("abort").inc();
            self.series.totals.requests_finished.inc();
            tracing::info!(parent: &self.span, "aborted");
        }
    }
}

//! One request's life between the HTTP handlers and the backend: model resolution, admission,
//! tokenizing, length checks, token reservations, then the event stream with metrics and trace
//! events recorded as it goes. Endpoint handlers only shape the JSON.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::Histogram;
use peregrine_engine::request::{FinishReason, SamplingParams, Usage};
use tracing::Span;

use super::admission::{RunningSlot, WaitingSlot};
use super::tenant::TenantId;
use super::backend::{EventStream, GenerateEvent, GenerateInput, InferenceBackend, PromptInput, TokenOutput};
use super::error::ApiError;
use super::metrics::{FinishLabels, Metrics, ModelLabel};
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
    metrics: Metrics,
    label: ModelLabel,
    waiting: WaitingSlot,
    running: Option<RunningSlot>,
    running_gauge: prometheus_client::metrics::gauge::Gauge,
    /// Waiting → running → gone, for vLLM's queue gauges and `vllm:lora_requests_info`.
    activity: ActivityGuard,
    /// Per-token series, looked up once (not a labelled-family lookup per token).
    per_token: PerTokenMetrics,
    arrival: Instant,
    last_token: Option<Instant>,
    reservation: Option<(Arc<dyn Refund>, TenantId, u64)>,
    span: Span,
    done: bool,
}

struct PerTokenMetrics {
    time_to_first_token: Histogram,
    time_per_output_token: Histogram,
    generation_tokens: Counter,
}

impl PerTokenMetrics {
    fn new(metrics: &Metrics, label: &ModelLabel) -> Self {
        PerTokenMetrics {
            time_to_first_token: metrics.time_to_first_token.get_or_create(label).clone(),
            time_per_output_token: metrics.time_per_output_token.get_or_create(label).clone(),
            generation_tokens: metrics.generation_tokens.get_or_create(label).clone(),
        }
    }
}

/// Gives unused reserved tokens back to a tenant's bucket (type-erased so `Running` is not generic).
pub trait Refund: Send + Sync {
    fn refund(&self, tenant: TenantId, tokens: u64);
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
    let backend = &state.backend;
    let adapter = if job.model == backend.model_name() {
        None
    } else if backend.has_adapter(&job.model) {
        Some(job.model.clone())
    } else {
        return Err(ApiError::ModelNotFound(job.model));
    };
    // No refusal while draining: load balancers may still route here until they see `/ready` fail,
    // and every request that reaches us is served (the listener closes after the drain delay).
    let label = Metrics::label(&job.model);
    let waiting = state.admission.try_admit(state.metrics.waiting.get_or_create(&label).clone())?;
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

    let prompt = backend.prepare(job.prompt).await?;
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
            Some((state.clone() as Arc<dyn Refund>, t, reserve))
        }
        None => None,
    };

    let mut params = job.params;
    params.max_tokens = max_tokens;
    let events = backend.generate(GenerateInput {
        request_id,
        prompt,
        params,
        stop: job.stop,
        skip_special_tokens: job.skip_special_tokens,
        adapter,
    })?;
    tracing::debug!(parent: &span, "queued");
    Ok(Running {
        request_id,
        prompt_tokens: prompt_len,
        events,
        running_gauge: state.metrics.running.get_or_create(&label).clone(),
        activity,
        per_token: PerTokenMetrics::new(&state.metrics, &label),
        metrics: state.metrics.clone(),
        label,
        waiting,
        running: None,
        arrival,
        last_token: None,
        reservation,
        span,
        done: false,
    })
}

impl Running {
    /// The next thing to tell the client; None once finished.
    pub async fn next(&mut self) -> Option<Step> {
        if self.done {
            return None;
        }
        loop {
            let Some(event) = self.events.next().await else {
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
            self.running = Some(RunningSlot::new(self.running_gauge.clone()));
            self.activity.scheduled();
            // Time in our own queue (tokenizing) plus the engine's.
            let queued = self.arrival.elapsed().max(queue_time);
            Metrics::observe(&self.metrics.queue_time, &self.label, queued);
            self.metrics.vllm.request_queue_time.observe(queued.as_secs_f64());
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
                self.per_token.time_to_first_token.observe((now - self.arrival).as_secs_f64());
                self.metrics.vllm.time_to_first_token.observe((now - self.arrival).as_secs_f64());
                // vLLM counts a prompt's tokens when its prefill completes.
                self.metrics.vllm.prompt_tokens.inc_by(self.prompt_tokens as u64);
                tracing::info!(parent: &self.span, ttft_s = (now - self.arrival).as_secs_f64(), "first_token");
            }
            Some(prev) => {
                self.per_token.time_per_output_token.observe((now - prev).as_secs_f64());
                self.metrics.vllm.time_per_output_token.observe((now - prev).as_secs_f64());
            }
        }
        self.last_token = Some(now);
        self.per_token.generation_tokens.inc();
        self.metrics.vllm.generation_tokens.inc();
    }

    fn on_finished(&mut self, reason: FinishReason, usage: Usage) {
        self.done = true;
        Metrics::observe(&self.metrics.e2e_latency, &self.label, self.arrival.elapsed());
        self.metrics.vllm.e2e_request_latency.observe(self.arrival.elapsed().as_secs_f64());
        self.metrics.vllm.prefix_cache_queries.inc_by(usage.prompt_tokens as u64);
        self.metrics.vllm.prefix_cache_hits.inc_by(usage.cached_prompt_tokens as u64);
        self.activity.finish();
        self.metrics.prompt_tokens.get_or_create(&self.label).inc_by(usage.prompt_tokens as u64);
        self.metrics.prefix_cache_hit_tokens.get_or_create(&self.label).inc_by(usage.cached_prompt_tokens as u64);
        self.metrics
            .requests_finished
            .get_or_create(&FinishLabels { model: self.label.model.clone(), finished_reason: reason.as_str().to_string() })
            .inc();
        if let Some((refund, tenant, reserved)) = self.reservation.take() {
            let used = (usage.prompt_tokens + usage.completion_tokens) as u64;
            refund.refund(tenant, reserved.saturating_sub(used));
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
            self.metrics
                .requests_finished
                .get_or_create(&FinishLabels { model: self.label.model.clone(), finished_reason: "abort".to_string() })
                .inc();
            tracing::info!(parent: &self.span, "aborted");
        }
    }
}

//! The real engine behind [`InferenceBackend`]: tokenizing and chat rendering on tokio's blocking
//! pool, incremental detokenizing and stop strings in the request's own task, never on the engine
//! thread. Dropping a request's stream drops its `RequestStream`, which aborts it in the engine.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use peregrine_api::AdapterStatus;
use peregrine_engine::lora::{self, AdapterInfo};

use peregrine_engine::engine::{EngineHandle, RequestStream};
use peregrine_engine::request::{FinishReason, GenerationRequest, RequestEvent, SampledToken, Usage};
use peregrine_engine::tokenizer::{ChatMessage, IncrementalDecoder, StopMatcher, Tokenizer};
use peregrine_engine::structured::{CompiledGrammar, GrammarCompiler, GrammarSpec};
use peregrine_engine::EngineError;

use super::backend::{
    AdapterCache, AdapterLoaded, BackendStats, EngineShape, EventStream, GenerateEvent, GenerateInput, InferenceBackend, LoadOutcome, PreparedPrompt,
    PromptInput, TokenOutput,
};
use super::error::ApiError;

pub struct EngineBackend {
    model_name: String,
    backend_name: String,
    max_model_len: usize,
    engine: EngineHandle,
    tokenizer: Tokenizer,
    shape: EngineShape,
    kv_cache_bytes: Option<u64>,
    /// Built on the first structured-output request (it indexes the whole vocabulary), then shared.
    grammars: Arc<OnceLock<Result<GrammarCompiler, String>>>,
}

impl EngineBackend {
    pub fn new(model_name: String, backend_name: String, max_model_len: usize, engine: EngineHandle, tokenizer: Tokenizer) -> Self {
        EngineBackend { model_name, backend_name, max_model_len, engine, tokenizer, shape: EngineShape::default(), kv_cache_bytes: None, grammars: Arc::new(OnceLock::new()) }
    }

    /// The KV-cache and LoRA sizes the engine was started with (reported to gateways).
    pub fn with_engine_shape(mut self, shape: EngineShape) -> Self {
        self.shape = shape;
        self
    }

    /// The KV pool's size, for `/metrics`.
    pub fn with_kv_cache_bytes(mut self, bytes: Option<u64>) -> Self {
        self.kv_cache_bytes = bytes;
        self
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }
}

/// The model id clients use by default: the file or folder name without extension.
pub fn default_model_name(path: &Path) -> String {
    let stem = if path.is_dir() { path.file_name() } else { path.file_stem() };
    stem.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".to_string())
}

fn engine_error(e: EngineError) -> ApiError {
    match e {
        EngineError::InvalidRequest(m) => ApiError::invalid(None, m),
        EngineError::ChatTemplate(m) => ApiError::invalid(Some("messages".to_string()), format!("chat template: {m}")),
        EngineError::Tokenizer(m) => ApiError::invalid(Some("prompt".to_string()), format!("tokenizer: {m}")),
        EngineError::EngineStopped => ApiError::EngineStopped,
        // Only `submit` reaches here with it: a completion naming a model we do not serve.
        EngineError::UnknownAdapter(name) => ApiError::ModelNotFound(name),
        EngineError::AdapterUnavailable(name) => ApiError::AdapterUnavailable(name),
        other => ApiError::Internal(other.to_string()),
    }
}

/// An error of an adapter admin call, kept whole until the caller knows the adapter's name.
#[derive(Debug)]
enum AdminError {
    Engine(EngineError),
    Task(ApiError),
}

impl AdminError {
    /// A load's error as the client sees it: the adapter's name, never a host path. A missing
    /// folder, a file instead of a folder and a folder without the adapter files all read alike
    /// (they would reveal which folders exist); a readable adapter that does not fit says why.
    fn without_host_paths(self, adapter: &str, dir: &Path) -> ApiError {
        match self {
            AdminError::Engine(EngineError::Io { .. }) => ApiError::AdapterUnreadable(adapter.to_string()),
            AdminError::Engine(EngineError::InvalidAdapter { path, .. }) if path == dir => {
                ApiError::AdapterUnreadable(adapter.to_string())
            }
            AdminError::Engine(EngineError::InvalidAdapter { message, .. }) => {
                ApiError::InvalidAdapter(format!("the LoRA adapter `{adapter}` cannot be served: {message}"))
            }
            other => other.into(),
        }
    }
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::Task(e) => e,
            // Paths stay in the server's log, not in the answer.
            AdminError::Engine(e @ (EngineError::InvalidAdapter { .. } | EngineError::Io { .. })) => {
                tracing::warn!(error = %e, "adapter files");
                ApiError::InvalidAdapter("the adapter's files cannot be used".to_string())
            }
            AdminError::Engine(EngineError::UnknownAdapter(name)) => ApiError::AdapterNotFound(name),
            AdminError::Engine(EngineError::Unsupported(_)) => ApiError::LoraDisabled,
            AdminError::Engine(EngineError::InvalidRequest(m)) => ApiError::invalid(Some("lora_name".to_string()), m),
            AdminError::Engine(other) => engine_error(other),
        }
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn adapter_status(info: AdapterInfo) -> AdapterStatus {
    let state = match info.state {
        lora::AdapterState::Active => "active",
        lora::AdapterState::Loaded => "loaded",
        lora::AdapterState::Evicted => "evicted",
        lora::AdapterState::Unloading => "unloading",
        lora::AdapterState::Failed => "failed",
    };
    AdapterStatus {
        name: info.name,
        id: info.id,
        source: info.source.display().to_string(),
        rank: info.rank,
        state: state.to_string(),
        slot: info.slot,
        loaded_at: unix_seconds(info.loaded_at),
        last_used: info.last_used.map(unix_seconds),
        requests_served: info.requests_served,
        in_flight: info.in_flight,
        size_bytes: info.size_bytes,
        digest: (!info.digest.is_empty()).then_some(info.digest),
    }
}

impl EngineBackend {
    /// Runs an engine admin call on tokio's blocking pool: loads read and validate files, and every
    /// call waits for the engine thread's answer.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(EngineHandle) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, AdminError> {
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || call(engine))
            .await
            .map_err(|e| AdminError::Task(ApiError::Internal(format!("adapter task: {e}"))))?
            .map_err(AdminError::Engine)
    }
}

impl InferenceBackend for EngineBackend {
    fn model_name(&self) -> &str {
        &self.model_name
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn backend_name(&self) -> String {
        self.backend_name.clone()
    }

    fn stats(&self) -> BackendStats {
        let m = self.engine.metrics();
        BackendStats {
            kv_cache_usage_ratio: m.kv_usage_ratio,
            num_preemptions: m.preemptions_total,
            prefix_cache_hit_tokens: m.prefix_cache_hit_tokens_total,
            engine_running: m.num_running,
            engine_waiting: m.num_waiting,
            kv_cache_bytes: self.kv_cache_bytes,
            adapter_cache: m.lora_cache.map(|c| AdapterCache {
                host_bytes: c.host_bytes,
                host_adapters: c.host_adapters,
                slots_used: c.slots_used,
                slots: c.slots,
                failed: self.engine.failed_adapters(),
            }),
        }
    }

    fn engine_shape(&self) -> EngineShape {
        self.shape
    }

    fn has_adapter(&self, name: &str) -> bool {
        // A fast check against the names the engine thread publishes; `submit` still refuses a
        // name unloaded in between (→ 404).
        self.engine.has_adapter(name)
    }

    async fn adapters(&self) -> Result<Vec<AdapterStatus>, ApiError> {
        if !self.engine.lora_supported() {
            return Ok(Vec::new());
        }
        let list = self.blocking(|engine| engine.list_adapters()).await?;
        Ok(list.into_iter().map(adapter_status).collect())
    }

    async fn load_adapter(&self, name: String, path: PathBuf) -> Result<AdapterLoaded, ApiError> {
        let (adapter, dir) = (name.clone(), path.clone());
        let (outcome, info) = self
            .blocking(move |engine| engine.load_adapter(&name, &path))
            .await
            .map_err(|e| e.without_host_paths(&adapter, &dir))?;
        let outcome = match outcome {
            lora::LoadOutcome::Loaded => LoadOutcome::Loaded,
            lora::LoadOutcome::AlreadyLoaded => LoadOutcome::AlreadyLoaded,
            lora::LoadOutcome::Replaced => LoadOutcome::Replaced,
        };
        Ok(AdapterLoaded { outcome, adapter: adapter_status(info) })
    }

    async fn unload_adapter(&self, name: String) -> Result<AdapterStatus, ApiError> {
        let info = self.blocking(move |engine| engine.unload_adapter(&name)).await?;
        Ok(adapter_status(info))
    }

    fn chat_template_source(&self) -> Option<String> {
        self.tokenizer.chat_template().map(|t| t.source().to_string())
    }

    async fn prepare(&self, prompt: PromptInput) -> Result<PreparedPrompt, ApiError> {
        let tokenizer = self.tokenizer.clone();
        // Long prompts take milliseconds to tokenize: keep that off the async workers and, above
        // all, off the engine thread.
        let tokens = tokio::task::spawn_blocking(move || -> Result<Vec<u32>, ApiError> {
            match prompt {
                PromptInput::Text(text) => tokenizer.encode(&text).map_err(engine_error),
                PromptInput::Tokens(ids) => {
                    let vocab = tokenizer.vocab_size();
                    match ids.iter().find(|&&id| id as usize >= vocab) {
                        Some(bad) => Err(ApiError::invalid(
                            Some("prompt".to_string()),
                            format!("token id {bad} is outside the vocabulary (size {vocab})"),
                        )),
                        None => Ok(ids),
                    }
                }
                PromptInput::Chat { turns, tools } => {
                    let template = tokenizer.chat_template().ok_or_else(|| {
                        ApiError::invalid(Some("messages".to_string()), "this model has no chat template; use /v1/completions")
                    })?;
                    let messages: Vec<ChatMessage> = turns
                        .into_iter()
                        .map(|t| ChatMessage { tool_calls: t.tool_calls, tool_call_id: t.tool_call_id, name: t.name, ..ChatMessage::new(t.role, t.content) })
                        .collect();
                    let text = template.render_with_tools(&messages, tools.as_ref(), true).map_err(engine_error)?;
                    tokenizer.encode(&text).map_err(engine_error)
                }
            }
        })
        .await
        .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))??;
        Ok(PreparedPrompt { tokens })
    }

    async fn compile_grammar(&self, spec: GrammarSpec, param: &'static str) -> Result<CompiledGrammar, ApiError> {
        let (grammars, tokenizer) = (self.grammars.clone(), self.tokenizer.clone());
        // Compiling a large schema takes milliseconds: on the blocking pool, never on the engine
        // thread or an async worker.
        tokio::task::spawn_blocking(move || {
            let compiler = grammars
                .get_or_init(|| GrammarCompiler::new(&tokenizer).map_err(|e| e.to_string()))
                .as_ref()
                .map_err(|e| ApiError::invalid(Some(param.to_string()), format!("structured outputs are unavailable for this model: {e}")))?;
            compiler
                .compile(&spec)
                .map_err(|e| ApiError::invalid(Some(param.to_string()), format!("invalid {} constraint: {e}", spec.kind())))
        })
        .await
        .map_err(|e| ApiError::Internal(format!("grammar task: {e}")))?
    }

    fn generate(&self, input: GenerateInput) -> Result<EventStream, ApiError> {
        let (request, detok) = self.split(input);
        let stream = match detok.follows {
            Some(leader) => self.engine.submit_following(request, leader),
            None => self.engine.submit(request),
        }
        .map_err(engine_error)?;
        Ok(detok.stream(stream))
    }

    /// One engine message for all the choices: the scheduler admits them as a whole.
    fn generate_choices(&self, inputs: Vec<GenerateInput>) -> Result<Vec<EventStream>, ApiError> {
        let (requests, detoks): (Vec<_>, Vec<_>) = inputs.into_iter().map(|input| self.split(input)).unzip();
        let streams = self.engine.submit_choices(requests).map_err(engine_error)?;
        Ok(detoks.into_iter().zip(streams).map(|(d, s)| d.stream(s)).collect())
    }
}

impl EngineBackend {
    /// The engine's part of a request, and what turns its events into text.
    fn split(&self, input: GenerateInput) -> (GenerationRequest, DetokSetup) {
        let setup = DetokSetup {
            adapter: input.adapter.clone().map(|name| (name, self.engine.clone())),
            decoder: IncrementalDecoder::new(self.tokenizer.clone(), input.skip_special_tokens),
            tokenizer: self.tokenizer.clone(),
            stop: StopMatcher::new(input.stop),
            logprobs: input.params.logprobs.is_some(),
            prompt_tokens: input.prompt.tokens.len(),
            follows: input.follows,
        };
        let request =
            GenerationRequest { id: input.request_id, prompt_tokens: input.prompt.tokens, params: input.params, adapter: input.adapter };
        (request, setup)
    }
}

/// A [`Detok`] waiting for its engine stream.
struct DetokSetup {
    adapter: Option<(String, EngineHandle)>,
    decoder: IncrementalDecoder,
    tokenizer: Tokenizer,
    stop: StopMatcher,
    logprobs: bool,
    prompt_tokens: usize,
    follows: Option<u64>,
}

impl DetokSetup {
    fn stream(self, stream: RequestStream) -> EventStream {
        let state = Detok {
            stream: Some(stream),
            adapter: self.adapter,
            decoder: self.decoder,
            tokenizer: self.tokenizer,
            stop: self.stop,
            logprobs: self.logprobs,
            pending: VecDeque::new(),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: 0,
        };
        Box::pin(futures::stream::unfold(state, |mut s| async move {
            let event = s.next().await?;
            Some((event, s))
        }))
    }
}

/// Turns engine events into text events for one request.
struct Detok {
    /// None once finished (dropping it aborts the request in the engine).
    stream: Option<RequestStream>,
    /// The request's adapter, to tell an adapter that failed (503 naming it) from other errors.
    adapter: Option<(String, EngineHandle)>,
    decoder: IncrementalDecoder,
    tokenizer: Tokenizer,
    stop: StopMatcher,
    /// Whether the client asked for logprobs: only then is each token's own text looked up.
    logprobs: bool,
    pending: VecDeque<GenerateEvent>,
    prompt_tokens: usize,
    completion_tokens: usize,
}

impl Detok {
    async fn next(&mut self) -> Option<GenerateEvent> {
        if let Some(e) = self.pending.pop_front() {
            return Some(e);
        }
        let event = self.stream.as_mut()?.next().await;
        let Some(event) = event else {
            self.stream = None;
            return Some(GenerateEvent::Error(ApiError::EngineStopped));
        };
        match event {
            RequestEvent::Scheduled { queue_time } => Some(GenerateEvent::Scheduled { queue_time }),
            RequestEvent::Token(t) => Some(self.on_token(t)),
            RequestEvent::Finished { reason, usage } => {
                self.stream = None;
                let tail = self.decoder.finish();
                let out = self.stop.push(&tail);
                let (trailing_text, reason) =
                    if out.stopped { (out.text, FinishReason::Stop) } else { (out.text + &self.stop.finish(), reason) };
                Some(GenerateEvent::Finished { trailing_text, reason, usage })
            }
            RequestEvent::Error(message) => {
                self.stream = None;
                // The engine marks an adapter failed before it fails the requests waiting for it.
                if let Some((name, engine)) = &self.adapter {
                    if engine.adapter_failed(name) {
                        return Some(GenerateEvent::Error(ApiError::AdapterUnavailable(name.clone())));
                    }
                }
                Some(GenerateEvent::Error(ApiError::Internal(message)))
            }
        }
    }

    fn on_token(&mut self, t: SampledToken) -> GenerateEvent {
        self.completion_tokens += 1;
        let text = match self.decoder.push(t.token_id) {
            Ok(text) => text,
            Err(e) => {
                self.stream = None;
                return GenerateEvent::Error(engine_error(e));
            }
        };
        let out = self.stop.push(&text);
        let token_text = |id: u32| self.tokenizer.token_str(id).unwrap_or_default();
        let token = TokenOutput {
            token_id: t.token_id,
            text: out.text,
            token_text: if self.logprobs { token_text(t.token_id) } else { String::new() },
            logprob: t.logprob,
            top_logprobs: t.top_logprobs.iter().map(|a| (token_text(a.token_id), a.logprob)).collect(),
        };
        if out.stopped {
            // A stop string: end here and drop the engine stream, which aborts the request.
            self.stream = None;
            let usage = Usage { prompt_tokens: self.prompt_tokens, completion_tokens: self.completion_tokens, cached_prompt_tokens: 0 };
            self.pending.push_back(GenerateEvent::Finished { trailing_text: String::new(), reason: FinishReason::Stop, usage });
        }
        GenerateEvent::Token(token)
    }
}


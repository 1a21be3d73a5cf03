//! What the HTTP layer needs from an inference engine, in the style of TGI's router `Backend`:
//! prepare a prompt (tokenize, off the engine thread), then stream a generation. The real engine
//! sits behind [`super::engine_backend::EngineBackend`]; tests use small fakes.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use peregrine_api::AdapterStatus;
use peregrine_engine::request::{FinishReason, SamplingParams, Usage};
use peregrine_engine::structured::{CompiledGrammar, GrammarSpec};

use super::error::ApiError;

/// A prompt as the client sent it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    /// Chat turns, rendered with the model's chat template (generation prompt added), with the
    /// request's `tools` (OpenAI's list) passed to the template as transformers passes them.
    Chat { turns: Vec<ChatTurn>, tools: Option<serde_json::Value> },
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatTurn {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, arguments as JSON objects (see `ChatMessage::tool_calls`).
    pub tool_calls: Option<serde_json::Value>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// A tokenized prompt, ready for the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedPrompt {
    pub tokens: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct GenerateInput {
    pub request_id: u64,
    pub prompt: PreparedPrompt,
    /// `max_tokens` already resolved against the context length.
    pub params: SamplingParams,
    /// Stop strings: the backend cuts the text before the first match and ends the request.
    pub stop: Vec<String>,
    pub skip_special_tokens: bool,
    /// LoRA adapter name (None: the base model).
    pub adapter: Option<String>,
    /// Another choice (request id) whose prompt this one shares (`n > 1`).
    pub follows: Option<u64>,
}

/// One generated token, detokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    pub token_id: u32,
    /// Text that became final with this token (may be empty while a character or a possible stop
    /// string is incomplete).
    pub text: String,
    /// The token's own text, for logprobs.
    pub token_text: String,
    pub logprob: Option<f32>,
    /// `(token text, logprob)`, most likely first.
    pub top_logprobs: Vec<(String, f32)>,
}

#[derive(Debug, Clone)]
pub enum GenerateEvent {
    /// Left the engine's waiting queue.
    Scheduled { queue_time: Duration },
    Token(TokenOutput),
    /// Text released at the end (held back by the detokenizer or stop matcher), then the end.
    Finished { trailing_text: String, reason: FinishReason, usage: Usage },
    Error(ApiError),
}

pub type EventStream = Pin<Box<dyn Stream<Item = GenerateEvent> + Send>>;

/// The LoRA adapter cache, for metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdapterCache {
    /// Bytes of adapter weights in host memory.
    pub host_bytes: u64,
    /// Adapter versions with weights in host memory.
    pub host_adapters: usize,
    /// Backend slots holding an adapter, of `slots`.
    pub slots_used: usize,
    pub slots: usize,
    /// Adapters whose evicted weights could not be re-read (refused until loaded again).
    pub failed: Vec<String>,
}

/// A snapshot of engine-wide state for metrics and `/ready`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendStats {
    pub kv_cache_usage_ratio: f64,
    pub num_preemptions: u64,
    pub prefix_cache_hit_tokens: u64,
    pub engine_running: usize,
    pub engine_waiting: usize,
    /// Bytes of the KV-cache pool, where the backend knows them (the CPU backend's host memory).
    pub kv_cache_bytes: Option<u64>,
    /// None when LoRA is off.
    pub adapter_cache: Option<AdapterCache>,
}

/// Fixed facts about the engine that gateways read (`vllm:cache_config_info`,
/// `vllm:lora_requests_info`). Zero / None where a backend has none.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineShape {
    /// Tokens per KV-cache block.
    pub kv_block_size: usize,
    /// KV-cache blocks in the pool.
    pub num_kv_blocks: usize,
    /// Adapters that can run in one batch; None when LoRA is off.
    pub max_loras: Option<usize>,
}

/// What a load did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    Loaded,
    /// Same name, same source: nothing changed.
    AlreadyLoaded,
    /// Same name, another source: new requests get the new version.
    Replaced,
}

#[derive(Debug, Clone)]
pub struct AdapterLoaded {
    pub outcome: LoadOutcome,
    pub adapter: AdapterStatus,
}

pub trait InferenceBackend: Send + Sync + 'static {
    /// The base model's id as clients name it.
    fn model_name(&self) -> &str;
    fn max_model_len(&self) -> usize;
    /// "cpu", "cuda:0".
    fn backend_name(&self) -> String;
    fn stats(&self) -> BackendStats;
    fn engine_shape(&self) -> EngineShape {
        EngineShape::default()
    }
    /// Whether `name` names a loaded adapter. An unload may still race with the request, so
    /// `generate` must also refuse an unknown name with [`ApiError::ModelNotFound`].
    fn has_adapter(&self, _name: &str) -> bool {
        false
    }
    /// Every adapter version, for `GET /v1/adapters` and `/v1/models`.
    fn adapters(&self) -> impl Future<Output = Result<Vec<AdapterStatus>, ApiError>> + Send {
        async { Ok(Vec::new()) }
    }
    /// Loads (or replaces) the PEFT adapter in `path` under `name`. File reading and validation
    /// happen on a worker pool, never on the async runtime or the engine thread.
    fn load_adapter(&self, _name: String, _path: PathBuf) -> impl Future<Output = Result<AdapterLoaded, ApiError>> + Send {
        async { Err(ApiError::LoraDisabled) }
    }
    /// Unloads `name`; requests already running on it finish first.
    fn unload_adapter(&self, _name: String) -> impl Future<Output = Result<AdapterStatus, ApiError>> + Send {
        async { Err(ApiError::LoraDisabled) }
    }
    /// Compiles a structured-output constraint against the model's tokenizer (cached by hash), on
    /// a worker pool. A bad schema or grammar is a 400 naming `param`.
    fn compile_grammar(
        &self,
        _spec: GrammarSpec,
        param: &'static str,
    ) -> impl Future<Output = Result<CompiledGrammar, ApiError>> + Send {
        async move { Err(ApiError::invalid(Some(param.to_string()), "structured outputs are not supported by this backend")) }
    }
    /// The chat template's source, for `--tool-call-parser auto` (None: no template).
    fn chat_template_source(&self) -> Option<String> {
        None
    }
    /// Tokenizes (and for chat, renders) a prompt on a worker pool, never on the engine thread.
    fn prepare(&self, prompt: PromptInput) -> impl Future<Output = Result<PreparedPrompt, ApiError>> + Send;
    /// Submits a request; dropping the returned stream aborts it and frees its KV blocks.
    fn generate(&self, input: GenerateInput) -> Result<EventStream, ApiError>;
    /// Submits the `n` choices of one request (the first computes the prompt, the others have
    /// `follows` set to it), together where the backend can queue them as a whole; one stream
    /// per input, in order. By default, one by one.
    fn generate_choices(&self, inputs: Vec<GenerateInput>) -> Result<Vec<EventStream>, ApiError> {
        inputs.into_iter().map(|input| self.generate(input)).collect()
    }
}

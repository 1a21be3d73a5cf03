//! What a caller hands the engine and what comes back, independent of HTTP.

use serde::{Deserialize, Serialize};

/// Engine-wide unique id of a request, chosen by the caller (the server uses a counter).
pub type RequestId = u64;

/// Per-request sampling settings, with OpenAI/vLLM semantics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    /// 1.0 disables top-p.
    pub top_p: f32,
    /// 0.0 disables min-p.
    pub min_p: f32,
    /// 1.0 disables; > 1 discourages tokens already in prompt or output (HF/vLLM semantics).
    pub repetition_penalty: f32,
    /// OpenAI semantics: subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// OpenAI semantics: subtracted per occurrence in the generated tokens.
    pub frequency_penalty: f32,
    /// Makes sampling reproducible for this request whatever else is in the batch.
    pub seed: Option<u64>,
    pub max_tokens: usize,
    /// Token ids that end generation (in addition to the model's EOS unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of top alternatives to report with each sampled token (`None`: no logprobs at all).
    pub logprobs: Option<usize>,
    /// OpenAI's `logit_bias`: `(token id, bias)` added to the token's logit after the grammar mask
    /// and before penalties (vLLM's order); at most [`crate::sampling::MAX_LOGIT_BIAS`] entries,
    /// biases in [-100, 100], ids checked against the vocabulary at submit. A biased row is always
    /// sampled on the host (see `RequestSampler::device_plan`).
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Structured outputs: only tokens this grammar allows are sampled, and the sequence stops when
    /// the grammar is complete. Compiled by the caller ([`crate::structured::GrammarCompiler`]),
    /// off the engine thread; not serialized (a compiled grammar belongs to this process).
    #[serde(skip)]
    pub grammar: Option<crate::structured::CompiledGrammar>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            logit_bias: Vec::new(),
            grammar: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams { temperature: 0.0, max_tokens, ..Default::default() }
    }
}

/// A request as the engine sees it: token ids in, token ids out.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub id: RequestId,
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
    /// Name of the LoRA adapter to apply (None: the base model).
    pub adapter: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop token id (or, decided by the caller, a stop string).
    Stop,
    /// `max_tokens` or the model's context length reached.
    Length,
    /// Cancelled by the caller.
    Abort,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Log-probability of one token id.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// One sampled token with its log-probability and the `top_logprobs` alternatives when asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SampledToken {
    pub token_id: u32,
    pub logprob: Option<f32>,
    pub top_logprobs: Vec<TokenLogprob>,
}

/// What flows back on a request's output channel, in order: one `Scheduled`, zero or more `Token`s, then exactly one
/// `Finished` (or one `Error`).
#[derive(Debug, Clone, PartialEq)]
pub enum RequestEvent {
    /// The request left the waiting queue and its first prefill chunk was scheduled.
    Scheduled { queue_time: std::time::Duration },
    Token(SampledToken),
    Finished { reason: FinishReason, usage: Usage },
    Error(String),
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

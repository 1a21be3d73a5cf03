//! `POST /v1/completions`.

use serde::{Deserialize, Serialize};

use crate::common::{SamplingFields, MAX_TOP_LOGPROBS};
use crate::{Prompt, StopSequences, StreamOptions, Usage, Validate, ValidationError};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Number of alternatives to return per token (0 returns only the sampled token's logprob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<StopSequences>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<serde_json::Map<String, serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    // vLLM extensions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skip_special_tokens: Option<bool>,
}

impl CompletionRequest {
    /// A minimal request, for clients and tests.
    pub fn new(model: impl Into<String>, prompt: Prompt) -> Self {
        CompletionRequest {
            model: model.into(),
            prompt,
            max_tokens: None,
            temperature: None,
            top_p: None,
            n: None,
            best_of: None,
            stream: false,
            stream_options: None,
            logprobs: None,
            echo: false,
            stop: None,
            presence_penalty: None,
            frequency_penalty: None,
            logit_bias: None,
            seed: None,
            suffix: None,
            user: None,
            top_k: None,
            min_p: None,
            repetition_penalty: None,
            ignore_eos: false,
            stop_token_ids: None,
            skip_special_tokens: None,
        }
    }
}

impl Validate for CompletionRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        SamplingFields {
            max_tokens: self.max_tokens,
            max_tokens_param: "max_tokens",
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            n: self.n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            stop: self.stop.as_ref(),
            logit_bias: self.logit_bias.as_ref(),
        }
        .validate()?;
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(ValidationError::new("best_of", "only best_of=1 is supported"));
        }
        if let Some(l) = self.logprobs {
            if l > MAX_TOP_LOGPROBS {
                return Err(ValidationError::new("logprobs", format!("logprobs must be at most {MAX_TOP_LOGPROBS}, got {l}")));
            }
        }
        if self.echo {
            return Err(ValidationError::new("echo", "echo is not supported"));
        }
        if self.suffix.is_some() {
            return Err(ValidationError::new("suffix", "suffix is not supported"));
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(ValidationError::new("stream_options", "stream_options is only allowed when stream is true"));
        }
        match &self.prompt {
            Prompt::Text(_) | Prompt::Tokens(_) => Ok(()),
            Prompt::Texts(v) if v.len() == 1 => Ok(()),
            Prompt::TokenBatches(v) if v.len() == 1 => Ok(()),
            _ => Err(ValidationError::new("prompt", "exactly one prompt per request is supported")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    /// Always `text_completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
}

/// OpenAI's legacy logprobs layout: parallel arrays, one entry per generated token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<TopLogprobMap>,
    pub text_offset: Vec<usize>,
}

/// `{token: logprob}` for one position, most likely first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TopLogprobMap(#[serde(with = "crate::common::ordered_map")] pub Vec<(String, f32)>);

/// One `data:` event of a streamed completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    /// Present (as null until the last event) only when `stream_options.include_usage` is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

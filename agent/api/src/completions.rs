//! `POST /v1/completions`.

use serde::{Deserialize, Serialize};

use crate::common::{NoUnknownFields, SamplingFields, MAX_N, MAX_TOP_LOGPROBS};
use crate::structured::StructuredFields;
use crate::{Prompt, Usage, Validate, ValidationError};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<u32>,
    /// Number of alternatives to return per token (0 returns only the sampled token's logprob).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// `response_format`, `structured_outputs`, `guided_*`.
    #[serde(flatten)]
    pub structured: StructuredFields,
    /// Must stay the last field: it takes what the fields above did not.
    #[serde(flatten)]
    pub unknown: NoUnknownFields,
}

impl CompletionRequest {
    /// A minimal request, for clients and tests.
    pub fn new(model: impl Into<String>, prompt: Prompt) -> Self {
        CompletionRequest { model: model.into(), prompt, ..Default::default() }
    }

    /// Choices returned (`n`, default 1).
    pub fn n(&self) -> usize {
        self.sampling.n.unwrap_or(1) as usize
    }

    /// Choices generated (`best_of`, default `n`): the `n` with the highest cumulative logprob
    /// are returned.
    pub fn best_of(&self) -> usize {
        self.best_of.map_or(self.n(), |b| b as usize)
    }
}

impl Validate for CompletionRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        self.sampling.validate(self.sampling.max_tokens, "max_tokens")?;
        self.structured.constraint()?;
        if let Some(b) = self.best_of {
            let n = self.sampling.n.unwrap_or(1);
            if b < n || b > MAX_N {
                return Err(ValidationError::new("best_of", format!("best_of must be between n ({n}) and {MAX_N}, got {b}")));
            }
            if b > n && self.sampling.stream {
                return Err(ValidationError::new("best_of", "best_of greater than n cannot be streamed"));
            }
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

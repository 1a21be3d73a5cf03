//! Pieces shared by completions and chat requests.

use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};

use crate::ValidationError;

/// A completion prompt: text or token ids, one or a batch (OpenAI accepts all four shapes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

impl Default for Prompt {
    /// The empty text, so that requests can be built with struct-update syntax.
    fn default() -> Self {
        Prompt::Text(String::new())
    }
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StopSequences {
    One(String),
    Many(Vec<String>),
}

impl StopSequences {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            StopSequences::One(s) => vec![s.clone()],
            StopSequences::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    /// Accepted for compatibility with newer clients; usage is reported per the include_usage flag.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continuous_usage_stats: Option<bool>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }
}

/// The most stop strings one request may carry (OpenAI allows 4; vLLM more; this bounds the work
/// the stop matcher does per token).
pub const MAX_STOP_SEQUENCES: usize = 16;
/// The most choices (`n`, `best_of`) one request may ask for: each is a sequence in the engine.
pub const MAX_N: u32 = 16;
/// The most `logit_bias` entries one request may carry (the engine's bound).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// `logit_bias` values lie in [-MAX_BIAS, MAX_BIAS] (OpenAI's range).
pub const MAX_BIAS: f64 = 100.0;
/// The most alternatives `logprobs`/`top_logprobs` may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The sampling and output fields both endpoints share, embedded in each request with
/// `#[serde(flatten)]` so that they are declared, validated and converted in one place.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SamplingFields {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
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

impl SamplingFields {
    /// `logit_bias` as `(token id, bias)` pairs sorted by id: keys are token ids written as
    /// strings (OpenAI's wire format), values numbers in [-100, 100], at most [`MAX_LOGIT_BIAS`].
    pub fn logit_bias_entries(&self) -> Result<Vec<(u32, f32)>, ValidationError> {
        let Some(map) = &self.logit_bias else { return Ok(Vec::new()) };
        if map.len() > MAX_LOGIT_BIAS {
            return Err(ValidationError::new("logit_bias", format!("logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {}", map.len())));
        }
        let mut entries = Vec::with_capacity(map.len());
        for (k, v) in map {
            let id: u32 = k
                .parse()
                .map_err(|_| ValidationError::new("logit_bias", format!("logit_bias keys must be token ids, got {k:?}")))?;
            let bias = v.as_f64().filter(|b| (-MAX_BIAS..=MAX_BIAS).contains(b)).ok_or_else(|| {
                ValidationError::new("logit_bias", format!("logit_bias values must be numbers in [-{MAX_BIAS}, {MAX_BIAS}], got {v} for token {k}"))
            })?;
            entries.push((id, bias as f32));
        }
        entries.sort_by_key(|&(id, _)| id);
        Ok(entries)
    }

    /// Range checks. `max_tokens` is passed in because chat's `max_completion_tokens` overrides it
    /// (`max_tokens_param` names whichever field the value came from).
    pub fn validate(&self, max_tokens: Option<i64>, max_tokens_param: &str) -> Result<(), ValidationError> {
        if let Some(m) = max_tokens {
            if m < 1 {
                return Err(ValidationError::new(max_tokens_param, format!("{max_tokens_param} must be at least 1, got {m}")));
            }
        }
        check_range("temperature", self.temperature, 0.0, 2.0)?;
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ValidationError::new("top_p", format!("top_p must be in (0, 1], got {p}")));
            }
        }
        if let Some(k) = self.top_k {
            if k < -1 {
                return Err(ValidationError::new("top_k", format!("top_k must be -1 (disable) or at least 0, got {k}")));
            }
        }
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if let Some(r) = self.repetition_penalty {
            if !(r > 0.0 && r.is_finite()) {
                return Err(ValidationError::new("repetition_penalty", format!("repetition_penalty must be > 0, got {r}")));
            }
        }
        if let Some(n) = self.n {
            if n == 0 || n > MAX_N {
                return Err(ValidationError::new("n", format!("n must be between 1 and {MAX_N}, got {n}")));
            }
        }
        if let Some(stop) = &self.stop {
            let stops = stop.to_vec();
            if stops.len() > MAX_STOP_SEQUENCES {
                return Err(ValidationError::new("stop", format!("at most {MAX_STOP_SEQUENCES} stop sequences are allowed")));
            }
            if stops.iter().any(|s| s.is_empty()) {
                return Err(ValidationError::new("stop", "stop sequences must not be empty"));
            }
        }
        self.logit_bias_entries()?;
        if self.stream_options.is_some() && !self.stream {
            return Err(ValidationError::new("stream_options", "stream_options is only allowed when stream is true"));
        }
        Ok(())
    }
}

/// Refuses every field no other part of the request claimed.
///
/// serde cannot combine `deny_unknown_fields` with `flatten`, so each request ends with
/// `#[serde(flatten)] _unknown: NoUnknownFields`: serde hands it whatever the request's own and
/// flattened fields did not take, and it fails with serde's own "unknown field `name`" message
/// (naming every stray field) so that callers see the same error as before the flattening.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoUnknownFields;

impl<'de> Deserialize<'de> for NoUnknownFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let rest = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        if rest.is_empty() {
            return Ok(NoUnknownFields);
        }
        let names: Vec<String> = rest.keys().map(|k| format!("`{k}`")).collect();
        Err(serde::de::Error::custom(format!("unknown field {}", names.join(", "))))
    }
}

impl Serialize for NoUnknownFields {
    /// Nothing: flattening an empty map adds no keys.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_map(Some(0))?.end()
    }
}

fn check_range(param: &str, value: Option<f32>, lo: f32, hi: f32) -> Result<(), ValidationError> {
    match value {
        // NaN fails both comparisons, so it is rejected too.
        Some(v) if !(v >= lo && v <= hi) => {
            Err(ValidationError::new(param, format!("{param} must be in [{lo}, {hi}], got {v}")))
        }
        _ => Ok(()),
    }
}

/// Serializes `(token, logprob)` pairs as a JSON object in the given order, the way OpenAI's
/// legacy completions `top_logprobs` entries look.
pub mod ordered_map {
    use serde::ser::SerializeMap;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(pairs: &[(String, f32)], s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(pairs.len()))?;
        for (k, v) in pairs {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, f32)>, D::Error> {
        let map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        Ok(map.into_iter().map(|(k, v)| (k, v.as_f64().unwrap_or(f64::NEG_INFINITY) as f32)).collect())
    }
}

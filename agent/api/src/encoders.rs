//! Encoder endpoints: `POST /v1/embeddings` (OpenAI), `POST /v1/rerank` (the Cohere/Jina shape
//! that vLLM and TEI also accept), `POST /v1/score` and `POST /classify` (vLLM's shapes).

use serde::{Deserialize, Serialize};

use crate::{Validate, ValidationError};

/// The most inputs one embeddings/classify request may carry (OpenAI's limit for embeddings).
pub const MAX_INPUTS: usize = 2048;
/// The most documents one rerank/score request may carry.
pub const MAX_DOCUMENTS: usize = 1000;

/// `input`: one text, several, one token-id list or several (OpenAI accepts all four).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

impl EmbeddingInput {
    pub fn len(&self) -> usize {
        match self {
            EmbeddingInput::Text(_) | EmbeddingInput::Tokens(_) => 1,
            EmbeddingInput::Texts(v) => v.len(),
            EmbeddingInput::TokenBatches(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn validate(&self, param: &str) -> Result<(), ValidationError> {
        let n = self.len();
        if n == 0 {
            return Err(ValidationError::new(param, "input must not be an empty list"));
        }
        if n > MAX_INPUTS {
            return Err(ValidationError::new(param, format!("at most {MAX_INPUTS} inputs per request, got {n}")));
        }
        let empty = match self {
            EmbeddingInput::Text(s) => s.is_empty(),
            EmbeddingInput::Texts(v) => v.iter().any(String::is_empty),
            EmbeddingInput::Tokens(t) => t.is_empty(),
            EmbeddingInput::TokenBatches(v) => v.iter().any(Vec::is_empty),
        };
        if empty {
            return Err(ValidationError::new(param, "inputs must not be empty strings or empty token lists"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncodingFormat {
    #[default]
    Float,
    /// Little-endian f32 bytes, base64: what the official Python client asks for by default.
    Base64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    pub model: String,
    pub input: EmbeddingInput,
    #[serde(default)]
    pub encoding_format: EncodingFormat,
    /// A shorter output (the first `dimensions` components, re-normalized when the model
    /// normalizes), for models trained for it; at most the model's width.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Cut inputs above the model's `max_seq_length` instead of refusing them (TEI's `truncate`).
    #[serde(default)]
    pub truncate: bool,
}

impl Validate for EmbeddingRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        self.input.validate("input")?;
        check_dimensions(self.dimensions)
    }
}

/// A requested embedding width is at least 1 (its upper bound is the model's, checked by the server).
pub(crate) fn check_dimensions(dimensions: Option<i64>) -> Result<(), ValidationError> {
    match dimensions {
        Some(d) if d < 1 => Err(ValidationError::new("dimensions", format!("dimensions must be at least 1, got {d}"))),
        _ => Ok(()),
    }
}

/// One embedding: floats, or base64 of little-endian f32 bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingData {
    pub object: String,
    pub index: usize,
    pub embedding: EmbeddingVector,
}

/// Token counts of an encoder request (no completion tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncoderUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

impl EncoderUsage {
    pub fn new(tokens: usize) -> Self {
        EncoderUsage { prompt_tokens: tokens, total_tokens: tokens }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingResponse {
    pub object: String,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: EncoderUsage,
}

/// A rerank document: a string or Cohere's `{"text": ...}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RerankDocument {
    Text(String),
    Object { text: String },
}

impl RerankDocument {
    pub fn text(&self) -> &str {
        match self {
            RerankDocument::Text(t) | RerankDocument::Object { text: t } => t,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RerankRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub query: String,
    pub documents: Vec<RerankDocument>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_n: Option<i64>,
    #[serde(default = "default_true")]
    pub return_documents: bool,
    #[serde(default)]
    pub truncate: bool,
}

fn default_true() -> bool {
    true
}

pub(crate) fn check_texts<'a>(param: &str, texts: impl Iterator<Item = &'a str>, max: usize) -> Result<(), ValidationError> {
    let mut n = 0;
    for t in texts {
        if t.is_empty() {
            return Err(ValidationError::new(param, "texts must not be empty"));
        }
        n += 1;
    }
    if n == 0 {
        return Err(ValidationError::new(param, "must not be an empty list"));
    }
    if n > max {
        return Err(ValidationError::new(param, format!("at most {max} per request, got {n}")));
    }
    Ok(())
}

impl Validate for RerankRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        if self.query.is_empty() {
            return Err(ValidationError::new("query", "query must not be empty"));
        }
        check_texts("documents", self.documents.iter().map(RerankDocument::text), MAX_DOCUMENTS)?;
        if let Some(n) = self.top_n {
            if n < 1 {
                return Err(ValidationError::new("top_n", format!("top_n must be at least 1, got {n}")));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankResult {
    pub index: usize,
    pub relevance_score: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankResultDocument>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankResultDocument {
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankResponse {
    pub id: String,
    pub model: String,
    pub usage: EncoderUsage,
    /// Most relevant first.
    pub results: Vec<RerankResult>,
}

/// `text_1`/`text_2` of `/v1/score`: one text or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ScoreTexts {
    One(String),
    Many(Vec<String>),
}

impl ScoreTexts {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            ScoreTexts::One(s) => vec![s.clone()],
            ScoreTexts::Many(v) => v.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub text_1: ScoreTexts,
    pub text_2: ScoreTexts,
    #[serde(default)]
    pub truncate: bool,
}

impl Validate for ScoreRequest {
    /// `text_1` is one text (scored against each of `text_2`) or as many as `text_2` (pairwise).
    fn validate(&self) -> Result<(), ValidationError> {
        let (a, b) = (self.text_1.to_vec(), self.text_2.to_vec());
        check_texts("text_1", a.iter().map(String::as_str), MAX_DOCUMENTS)?;
        check_texts("text_2", b.iter().map(String::as_str), MAX_DOCUMENTS)?;
        if a.len() != 1 && a.len() != b.len() {
            return Err(ValidationError::new("text_1", format!("text_1 has {} texts: give one, or as many as text_2 ({})", a.len(), b.len())));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreData {
    pub index: usize,
    pub object: String,
    pub score: f32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub data: Vec<ScoreData>,
    pub usage: EncoderUsage,
}

/// `/classify`: one text or a list.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifyRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub input: ScoreTexts,
    #[serde(default)]
    pub truncate: bool,
}

impl Validate for ClassifyRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        check_texts("input", self.input.to_vec().iter().map(String::as_str), MAX_INPUTS)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassifyData {
    pub index: usize,
    pub label: String,
    pub probs: Vec<f32>,
    pub num_classes: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassifyResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub data: Vec<ClassifyData>,
    pub usage: EncoderUsage,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deserializes and validates a body, as the server does (shared with `tei`'s tests).
    pub(crate) fn parse<T: serde::de::DeserializeOwned + Validate>(s: &str) -> Result<T, String> {
        let t: T = serde_json::from_str(s).map_err(|e| e.to_string())?;
        t.validate().map_err(|e| e.to_string())?;
        Ok(t)
    }

    #[test]
    fn embedding_inputs_of_every_shape() {
        for body in [r#""a""#, r#"["a","b"]"#, "[1,2]", "[[1],[2,3]]"] {
            let r: EmbeddingRequest = parse(&format!(r#"{{"model":"m","input":{body}}}"#)).unwrap();
            assert!(!r.input.is_empty());
        }
        for bad in [r#""""#, "[]", r#"["a",""]"#, "[[]]", r#"[1,"a"]"#, "{}", "null"] {
            assert!(parse::<EmbeddingRequest>(&format!(r#"{{"model":"m","input":{bad}}}"#)).is_err(), "{bad}");
        }
        let many = format!(r#"{{"model":"m","input":[{}]}}"#, vec![r#""x""#; MAX_INPUTS + 1].join(","));
        assert!(parse::<EmbeddingRequest>(&many).unwrap_err().contains("at most"));
        assert!(parse::<EmbeddingRequest>(r#"{"model":"m","input":"a","encoding_format":"int8"}"#).is_err());
        assert!(parse::<EmbeddingRequest>(r#"{"model":"m","input":"a","dimensions":0}"#).is_err());
        assert!(parse::<EmbeddingRequest>(r#"{"model":"m","input":"a","extra":1}"#).is_err());
    }

    #[test]
    fn rerank_and_score_shapes() {
        let r: RerankRequest = parse(r#"{"query":"q","documents":["a",{"text":"b"}],"top_n":1}"#).unwrap();
        assert_eq!(r.documents[1].text(), "b");
        assert!(r.return_documents);
        assert!(parse::<RerankRequest>(r#"{"query":"q","documents":[]}"#).is_err());
        assert!(parse::<RerankRequest>(r#"{"query":"","documents":["a"]}"#).is_err());
        assert!(parse::<RerankRequest>(r#"{"query":"q","documents":["a"],"top_n":0}"#).is_err());
        assert!(parse::<ScoreRequest>(r#"{"text_1":"q","text_2":["a","b"]}"#).is_ok());
        assert!(parse::<ScoreRequest>(r#"{"text_1":["q","r"],"text_2":["a","b"]}"#).is_ok());
        assert!(parse::<ScoreRequest>(r#"{"text_1":["q","r"],"text_2":["a","b","c"]}"#).is_err());
        assert!(parse::<ClassifyRequest>(r#"{"input":["a",""]}"#).is_err());
        assert!(parse::<ClassifyRequest>(r#"{"input":"a"}"#).is_ok());
    }
}

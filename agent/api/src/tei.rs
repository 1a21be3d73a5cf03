//! text-embeddings-inference's (TEI's) bodies for the `/embed` and `/rerank` aliases, so clients
//! written for TEI work unchanged against an encoder. Same limits as the OpenAI/Cohere shapes in
//! [`crate::encoders`]; errors keep Peregrine's OpenAI error shape.

use serde::{Deserialize, Serialize};

use crate::encoders::{check_dimensions, check_texts, ScoreTexts, MAX_DOCUMENTS, MAX_INPUTS};
use crate::{Validate, ValidationError};

/// TEI cuts over-long inputs only on the right; `left` is refused rather than silently ignored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TruncationDirection {
    #[default]
    #[serde(alias = "right", alias = "Right")]
    Right,
    #[serde(alias = "left", alias = "Left")]
    Left,
}

fn default_true() -> bool {
    true
}

fn right_only(direction: TruncationDirection) -> Result<(), ValidationError> {
    match direction {
        TruncationDirection::Right => Ok(()),
        TruncationDirection::Left => Err(ValidationError::new("truncation_direction", "only right truncation is supported")),
    }
}

/// `POST /embed`: `{"inputs": text | [texts]}` → `[[f32]]`, one vector per input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeiEmbedRequest {
    pub inputs: ScoreTexts,
    /// TEI normalizes by default, whatever the model's own chain does; `false` leaves out the
    /// chain's final Normalize.
    #[serde(default = "default_true")]
    pub normalize: bool,
    #[serde(default)]
    pub truncate: bool,
    #[serde(default)]
    pub truncation_direction: TruncationDirection,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimensions: Option<i64>,
}

impl Validate for TeiEmbedRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        check_texts("inputs", self.inputs.to_vec().iter().map(String::as_str), MAX_INPUTS)?;
        right_only(self.truncation_direction)?;
        check_dimensions(self.dimensions)
    }
}

/// `POST /rerank`: `{"query", "texts"}` → `[{index, score}]`, most relevant first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeiRerankRequest {
    pub query: String,
    pub texts: Vec<String>,
    /// The cross-encoder's logit instead of sigmoid(logit) (a cosine either way for an embedding model).
    #[serde(default)]
    pub raw_scores: bool,
    #[serde(default)]
    pub return_text: bool,
    #[serde(default)]
    pub truncate: bool,
    #[serde(default)]
    pub truncation_direction: TruncationDirection,
}

impl Validate for TeiRerankRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        if self.query.is_empty() {
            return Err(ValidationError::new("query", "query must not be empty"));
        }
        check_texts("texts", self.texts.iter().map(String::as_str), MAX_DOCUMENTS)?;
        right_only(self.truncation_direction)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeiRank {
    pub index: usize,
    pub score: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encoders::tests::parse;

    #[test]
    fn tei_embed_bodies() {
        let r: TeiEmbedRequest = parse(r#"{"inputs":"a"}"#).unwrap();
        assert!(r.normalize && !r.truncate);
        let r: TeiEmbedRequest = parse(r#"{"inputs":["a","b"],"normalize":false,"truncation_direction":"Right"}"#).unwrap();
        assert_eq!(r.inputs.to_vec().len(), 2);
        assert!(!r.normalize);
        for bad in [r#"{"inputs":""}"#, r#"{"inputs":[]}"#, r#"{"inputs":[1]}"#, r#"{"input":"a"}"#, r#"{"inputs":"a","truncation_direction":"left"}"#, r#"{"inputs":"a","dimensions":0}"#] {
            assert!(parse::<TeiEmbedRequest>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tei_rerank_bodies() {
        let r: TeiRerankRequest = parse(r#"{"query":"q","texts":["a","b"],"raw_scores":true}"#).unwrap();
        assert!(r.raw_scores && !r.return_text);
        for bad in [r#"{"query":"","texts":["a"]}"#, r#"{"query":"q","texts":[]}"#, r#"{"query":"q","texts":[""]}"#, r#"{"query":"q","documents":["a"]}"#] {
            assert!(parse::<TeiRerankRequest>(bad).is_err(), "{bad}");
        }
        let json = serde_json::to_value(TeiRank { index: 1, score: 0.5, text: None }).unwrap();
        assert_eq!(json, serde_json::json!({"index": 1, "score": 0.5}));
    }
}

//! OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    /// OpenAI's error class, e.g. `invalid_request_error`, `authentication_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// A stable machine-readable label, e.g. `context_length_exceeded`.
    pub code: Option<String>,
}

/// A request that parsed but asks for something out of range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ValidationError {
    pub message: String,
    pub param: Option<String>,
}

impl ValidationError {
    pub fn new(param: &str, message: impl Into<String>) -> Self {
        ValidationError { message: message.into(), param: Some(param.to_string()) }
    }
}

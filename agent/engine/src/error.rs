//! The engine's one error type. Every variant has a stable label (`kind()`) that the server maps to
//! HTTP status codes and metrics.

use std::path::PathBuf;

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, #[source] source: std::io::Error },
    /// A model, tokenizer or adapter file that is malformed, truncated or of an unsupported kind.
    #[error("invalid model file {path}: {message}")]
    InvalidModel { path: PathBuf, message: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The caller asked for something impossible (prompt too long, unknown token id, bad parameter).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("backend: {0}")]
    Backend(String),
    /// A LoRA adapter that cannot be served: missing or malformed files, shapes that do not fit the
    /// base model, rank above `max_lora_rank`, non-finite values, unsupported PEFT features.
    #[error("invalid LoRA adapter {path}: {message}")]
    InvalidAdapter { path: PathBuf, message: String },
    /// A request or admin call named an adapter that is not loaded (or is being unloaded).
    #[error("unknown adapter {0:?}")]
    UnknownAdapter(String),
    /// A loaded adapter whose evicted weights can no longer be re-read from its source (files
    /// deleted or damaged since the load); it stays refused until it is loaded again.
    #[error("adapter {0:?} is unavailable: its files can no longer be read; load it again")]
    AdapterUnavailable(String),
    /// Engine settings that cannot work with this model or backend (block size mismatch, a context
    /// length the KV cache cannot hold).
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    /// The engine thread has stopped; no more requests can be served.
    #[error("engine stopped")]
    EngineStopped,
}

impl EngineError {
    /// A short stable label, used as a metrics label and in logs.
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::Io { .. } => "io",
            EngineError::InvalidModel { .. } => "invalid_model",
            EngineError::Unsupported(_) => "unsupported",
            EngineError::Tokenizer(_) => "tokenizer",
            EngineError::ChatTemplate(_) => "chat_template",
            EngineError::InvalidRequest(_) => "invalid_request",
            EngineError::Backend(_) => "backend",
            EngineError::InvalidAdapter { .. } => "invalid_adapter",
            EngineError::UnknownAdapter(_) => "unknown_adapter",
            EngineError::AdapterUnavailable(_) => "adapter_unavailable",
            EngineError::InvalidConfig(_) => "invalid_config",
            EngineError::EngineStopped => "engine_stopped",
        }
    }

    pub fn invalid_model(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        EngineError::InvalidModel { path: path.into(), message: message.into() }
    }

    pub fn invalid_adapter(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        EngineError::InvalidAdapter { path: path.into(), message: message.into() }
    }
}

//! Request and response types of the Peregrine agent's HTTP API.
//!
//! The OpenAI-compatible part (`/v1/completions`, `/v1/chat/completions`, `/v1/models`) follows
//! OpenAI's wire format, plus the vLLM extensions clients commonly send (`top_k`, `min_p`,
//! `repetition_penalty`, `ignore_eos`, `stop_token_ids`). Requests reject unknown fields, as OpenAI
//! does, and [`Validate`] checks value ranges so that the server and the operator's client agree on
//! what a well-formed request is. The agent's own endpoints (`/version`) live in [`admin`], the LoRA
//! adapter endpoints in [`lora`], the names of the metrics others scrape in
//! [`metric_names`].

pub mod admin;
pub mod chat;
pub mod common;
pub mod completions;
pub mod encoders;
pub mod error;
pub mod gbnf;
pub mod lora;
pub mod metric_names;
pub mod models;
pub mod structured;
pub mod tools;
pub mod tei;

pub use chat::{ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessage};
pub use common::{NoUnknownFields, Prompt, SamplingFields, StopSequences, StreamOptions, Usage};
pub use completions::{CompletionChunk, CompletionRequest, CompletionResponse};
pub use error::{ErrorBody, ErrorDetail, ValidationError};
pub use lora::{AdapterList, AdapterStatus, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, ADAPTER_DIGEST_HEADER};
pub use models::{ModelCard, ModelList};
pub use structured::{OutputConstraint, ResponseFormat, StructuredFields, StructuredOutputs};

/// Range checks beyond what the types express. Returns the first problem found, naming the field.
pub trait Validate {
    fn validate(&self) -> Result<(), ValidationError>;
}

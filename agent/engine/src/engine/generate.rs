//! Run one request to completion from a plain thread (CLI, tests).

use super::handle::EngineHandle;
use crate::request::{FinishReason, GenerationRequest, RequestEvent, SampledToken, SamplingParams, Usage};
use crate::{EngineError, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct GenerationOutput {
    pub tokens: Vec<SampledToken>,
    pub finish_reason: FinishReason,
    pub usage: Usage,
}

impl GenerationOutput {
    pub fn token_ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|t| t.token_id).collect()
    }
}

/// Submits a request and blocks until it finishes. Must not be called from inside an async runtime.
pub fn generate_blocking(
    handle: &EngineHandle,
    prompt_tokens: Vec<u32>,
    params: SamplingParams,
) -> Result<GenerationOutput> {
    let request = GenerationRequest { id: handle.new_request_id(), prompt_tokens, params, adapter: None };
    let mut stream = handle.submit(request)?;
    let mut tokens = Vec::new();
    loop {
        match stream.blocking_next() {
            Some(RequestEvent::Scheduled { .. }) => {}
            Some(RequestEvent::Token(t)) => tokens.push(t),
            Some(RequestEvent::Finished { reason, usage }) => {
                return Ok(GenerationOutput { tokens, finish_reason: reason, usage })
            }
            Some(RequestEvent::Error(msg)) => return Err(EngineError::Backend(msg)),
            None => return Err(EngineError::EngineStopped),
        }
    }
}

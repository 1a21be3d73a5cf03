//! Serving an encoder (`serve --model <BERT-family folder>`): [`EncoderOnly`] stands in the
//! server's [`InferenceBackend`] slot, so auth, rate limits, admission, lifecycle, `/metrics`,
//! `/v1/models` and `/version` work unchanged, and refuses generation with a clear 400. The
//! encoder endpoints (`handlers::embeddings`, `handlers::rerank`, `handlers::classify`) reach the
//! batching thread through [`EncoderOnly::encoder`] and [`encode`]: tokenizing on tokio's blocking
//! pool, the forward on the encoder's thread, the request's slot held while it waits.

use std::sync::atomic::Ordering;
use std::time::Instant;

use peregrine_engine::encoder::{EncoderHandle, EncoderInput, EncoderJobKind};
use peregrine_engine::EngineError;

use super::backend::{BackendStats, EventStream, GenerateInput, InferenceBackend, PreparedPrompt, PromptInput};
use super::error::ApiError;
use super::admission::RunningSlot;
use super::metrics::Metrics;
use super::state::AppState;

pub struct EncoderOnly {
    model_name: String,
    encoder: EncoderHandle,
}

impl EncoderOnly {
    pub fn new(model_name: String, encoder: EncoderHandle) -> Self {
        EncoderOnly { model_name, encoder }
    }

    pub fn encoder(&self) -> &EncoderHandle {
        &self.encoder
    }

    fn not_a_generator(&self) -> ApiError {
        ApiError::invalid(
            Some("model".to_string()),
            format!(
                "the model `{}` is an encoder: it serves /v1/embeddings, /v1/rerank, /v1/score and /classify, not generation",
                self.model_name
            ),
        )
    }
}

impl InferenceBackend for EncoderOnly {
    fn model_name(&self) -> &str {
        &self.model_name
    }

    fn max_model_len(&self) -> usize {
        self.encoder.model().tokenizer.max_seq_length()
    }

    fn backend_name(&self) -> String {
        self.encoder.backend_name().to_string()
    }

    fn stats(&self) -> BackendStats {
        BackendStats {
            engine_waiting: self.encoder.metrics().queued_sequences.load(Ordering::Relaxed) as usize,
            ..BackendStats::default()
        }
    }

    async fn prepare(&self, _prompt: PromptInput) -> Result<PreparedPrompt, ApiError> {
        Err(self.not_a_generator())
    }

    fn generate(&self, _input: GenerateInput) -> Result<EventStream, ApiError> {
        Err(self.not_a_generator())
    }
}

/// One input of an encoder request, before tokenizing.
#[derive(Debug, Clone)]
pub enum EncodeInput {
    Text(String),
    Pair(String, String),
    Tokens(Vec<u32>),
}

pub fn encoder_error(e: EngineError) -> ApiError {
    match e {
        EngineError::InvalidRequest(m) => ApiError::invalid(Some("input".to_string()), m),
        EngineError::Tokenizer(m) => ApiError::invalid(Some("input".to_string()), format!("tokenizer: {m}")),
        EngineError::EngineStopped => ApiError::EngineStopped,
        other => ApiError::Internal(other.to_string()),
    }
}

/// What [`encode`] returns: one vector per input, in order, and the tokens they took.
pub struct Encoded {
    pub vectors: Vec<Vec<f32>>,
    pub tokens: usize,
}

/// Checks `model` (when the request names one), takes a waiting slot (429 when full), tokenizes on
/// the blocking pool, runs the inputs through the batching thread and records metrics.
pub async fn encode(
    state: &AppState<EncoderOnly>,
    model: Option<&str>,
    inputs: Vec<EncodeInput>,
    truncate: bool,
    kind: EncoderJobKind,
) -> Result<Encoded, ApiError> {
    let name = state.backend.model_name();
    if let Some(m) = model {
        if m != name {
            return Err(ApiError::ModelNotFound(m.to_string()));
        }
    }
    let arrival = Instant::now();
    let series = state.metrics.series(&Metrics::label(name));
    let mut waiting = state.admission.try_admit(vec![series.waiting.clone(), series.totals.waiting.clone()])?;
    let encoder = state.backend.encoder().clone();
    let tokenized = tokio::task::spawn_blocking(move || -> Result<(Vec<EncoderInput>, EncoderHandle), EngineError> {
        let tok = &encoder.model().tokenizer;
        let inputs = inputs
            .iter()
            .map(|input| match input {
                EncodeInput::Text(t) => tok.encode(t, truncate),
                EncodeInput::Pair(a, b) => tok.encode_pair(a, b, truncate),
                EncodeInput::Tokens(ids) => tok.check_ids(ids, truncate),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((inputs, encoder))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenizer task: {e}")))?;
    let (inputs, encoder) = tokenized.map_err(encoder_error)?;
    let tokens: usize = inputs.iter().map(EncoderInput::len).sum();
    waiting.release();
    let running = RunningSlot::new(vec![series.running.clone(), series.totals.running.clone()]);
    let result = encoder.run(inputs, kind).await;
    drop(running);
    let vectors = result.map_err(encoder_error)?;
    series.prompt_tokens.inc_by(tokens as u64);
    series.totals.prompt_tokens.inc_by(tokens as u64);
    series.e2e_latency.observe(arrival.elapsed().as_secs_f64());
    // An encoder request finishes as a generation's "stop" does: it ran to its end.
    series.finished("stop").inc();
    series.totals.requests_finished.inc();
    Ok(Encoded { vectors, tokens })
}

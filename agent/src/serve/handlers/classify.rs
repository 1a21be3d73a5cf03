//! `POST /classify` (vLLM's shape): the label and class probabilities (softmax of the logits) of
//! each input, for `*ForSequenceClassification` models.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use peregrine_api::encoders::{ClassifyData, ClassifyRequest, ClassifyResponse, EncoderUsage};
use peregrine_engine::encoder::{softmax, EncoderJobKind, EncoderTask};

use crate::serve::backend::InferenceBackend;
use super::{answer_json, response_id, SharedState};
use crate::serve::encoder_backend::{encode, EncodeInput, EncoderOnly};
use crate::serve::error::ApiError;
use crate::serve::state::unix_now;

pub async fn handle(State(state): State<SharedState<EncoderOnly>>, body: Result<Bytes, BytesRejection>) -> Response {
    answer_json(&state, body, |r: ClassifyRequest| respond(&state, r)).await
}

/// The answer to a validated request (HTTP's body or gRPC's `Classify`).
pub async fn respond(state: &SharedState<EncoderOnly>, request: ClassifyRequest) -> Result<ClassifyResponse, ApiError> {
    let model = state.backend.encoder().model();
    if model.task != EncoderTask::Classify {
        return Err(ApiError::invalid(Some("model".to_string()), "this model has no classification head (use /v1/embeddings)"));
    }
    let inputs = request.input.to_vec().into_iter().map(EncodeInput::Text).collect();
    let out = encode(state, request.model.as_deref(), inputs, request.truncate, EncoderJobKind::Classify).await?;
    let labels = &model.config.labels;
    let data = out
        .vectors
        .iter()
        .enumerate()
        .map(|(index, logits)| {
            let probs = softmax(logits);
            let best = probs.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i);
            ClassifyData { index, label: labels.get(best).cloned().unwrap_or_default(), num_classes: probs.len(), probs }
        })
        .collect();
    Ok(ClassifyResponse {
        id: response_id("classify", state.started, state.next_request_id()),
        object: "list".into(),
        created: unix_now(),
        model: state.backend.model_name().to_string(),
        data,
        usage: EncoderUsage::new(out.tokens),
    })
}

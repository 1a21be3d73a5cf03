//! `POST /v1/embeddings` (OpenAI): one vector per input, floats or base64 of little-endian f32.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use base64::Engine as _;
use peregrine_api::encoders::{
    EmbeddingData, EmbeddingInput, EmbeddingRequest, EmbeddingResponse, EmbeddingVector, EncoderUsage, EncodingFormat,
};
use peregrine_engine::encoder::EncoderJobKind;

use crate::serve::backend::InferenceBackend;
use super::{answer_json, SharedState};
use crate::serve::encoder_backend::{encode, EncodeInput, EncoderOnly};
use crate::serve::error::ApiError;

pub async fn handle(State(state): State<SharedState<EncoderOnly>>, body: Result<Bytes, BytesRejection>) -> Response {
    answer_json(&state, body, |r: EmbeddingRequest| respond(&state, r)).await
}

/// The answer to a validated request (HTTP's body or gRPC's `Embed`).
pub async fn respond(state: &SharedState<EncoderOnly>, request: EmbeddingRequest) -> Result<EmbeddingResponse, ApiError> {
    let dims = output_dims(state, request.dimensions)?;
    let inputs: Vec<EncodeInput> = match request.input {
        EmbeddingInput::Text(t) => vec![EncodeInput::Text(t)],
        EmbeddingInput::Texts(v) => v.into_iter().map(EncodeInput::Text).collect(),
        EmbeddingInput::Tokens(t) => vec![EncodeInput::Tokens(t)],
        EmbeddingInput::TokenBatches(v) => v.into_iter().map(EncodeInput::Tokens).collect(),
    };
    let encoded = encode(state, Some(&request.model), inputs, request.truncate, EncoderJobKind::Embed).await?;
    let renormalize = state.backend.encoder().model().pipeline.normalizes();
    let data = encoded
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, mut v)| {
            shorten(&mut v, dims, renormalize);
            let embedding = match request.encoding_format {
                EncodingFormat::Float => EmbeddingVector::Float(v),
                EncodingFormat::Base64 => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            EmbeddingData { object: "embedding".into(), index, embedding }
        })
        .collect();
    Ok(EmbeddingResponse {
        object: "list".into(),
        data,
        model: state.backend.model_name().to_string(),
        usage: EncoderUsage::new(encoded.tokens),
    })
}

/// The width a request asks for (`dimensions`), at most the model's.
pub(super) fn output_dims(state: &SharedState<EncoderOnly>, dimensions: Option<i64>) -> Result<usize, ApiError> {
    let width = state.backend.encoder().model().embedding_dim();
    match dimensions {
        None => Ok(width),
        Some(d) if d >= 1 && (d as u64) <= width as u64 => Ok(d as usize),
        Some(d) => Err(ApiError::invalid(Some("dimensions".to_string()), format!("dimensions {d} is outside 1..={width} for this model"))),
    }
}

/// Matryoshka-style shortening: the leading `dims` components, unit length again when `renormalize`
/// (the vector was unit length before).
pub(super) fn shorten(v: &mut Vec<f32>, dims: usize, renormalize: bool) {
    if dims < v.len() {
        v.truncate(dims);
        if renormalize {
            peregrine_engine::encoder::sentence::l2_normalize(v);
        }
    }
}

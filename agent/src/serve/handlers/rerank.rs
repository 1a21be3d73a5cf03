//! `POST /v1/rerank` (Cohere/Jina shape) and `POST /v1/score` (vLLM shape). A cross-encoder (a
//! one-label classification model) scores each (query, document) pair as sigmoid(logit), as
//! Sentence-Transformers' `CrossEncoder` does; an embedding model scores by the cosine of the two
//! embeddings.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::Response;
use peregrine_api::encoders::{
    EncoderUsage, RerankRequest, RerankResponse, RerankResult, RerankResultDocument, ScoreData, ScoreRequest, ScoreResponse,
};
use peregrine_engine::encoder::{sigmoid, EncoderJobKind, EncoderTask};

use crate::serve::backend::InferenceBackend;
use super::{answer_json, response_id, SharedState};
use crate::serve::encoder_backend::{encode, EncodeInput, EncoderOnly};
use crate::serve::error::ApiError;
use crate::serve::state::unix_now;

pub async fn rerank(State(state): State<SharedState<EncoderOnly>>, body: Result<Bytes, BytesRejection>) -> Response {
    answer_json(&state, body, |r: RerankRequest| rerank_response(&state, r)).await
}

/// The answer to a validated rerank request (HTTP's body or gRPC's `Rerank`).
pub async fn rerank_response(state: &SharedState<EncoderOnly>, request: RerankRequest) -> Result<RerankResponse, ApiError> {
    let docs: Vec<String> = request.documents.iter().map(|d| d.text().to_string()).collect();
    let (scores, tokens) = score_pairs(state, request.model.as_deref(), std::slice::from_ref(&request.query), &docs, request.truncate, false).await?;
    let mut results: Vec<RerankResult> = scores
        .into_iter()
        .enumerate()
        .map(|(index, relevance_score)| RerankResult {
            index,
            relevance_score,
            document: request.return_documents.then(|| RerankResultDocument { text: docs[index].clone() }),
        })
        .collect();
    results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score).then(a.index.cmp(&b.index)));
    if let Some(n) = request.top_n {
        results.truncate(usize::try_from(n).unwrap_or(usize::MAX));
    }
    Ok(RerankResponse {
        id: response_id("rerank", state.started, state.next_request_id()),
        model: state.backend.model_name().to_string(),
        usage: EncoderUsage::new(tokens),
        results,
    })
}

pub async fn score(State(state): State<SharedState<EncoderOnly>>, body: Result<Bytes, BytesRejection>) -> Response {
    answer_json(&state, body, |r: ScoreRequest| score_response(&state, r)).await
}

/// The answer to a validated score request (HTTP's body or gRPC's `Score`).
pub async fn score_response(state: &SharedState<EncoderOnly>, request: ScoreRequest) -> Result<ScoreResponse, ApiError> {
    let (a, b) = (request.text_1.to_vec(), request.text_2.to_vec());
    let (scores, tokens) = score_pairs(state, request.model.as_deref(), &a, &b, request.truncate, false).await?;
    Ok(ScoreResponse {
        id: response_id("score", state.started, state.next_request_id()),
        object: "list".into(),
        created: unix_now(),
        model: state.backend.model_name().to_string(),
        data: scores.into_iter().enumerate().map(|(index, score)| ScoreData { index, object: "score".into(), score }).collect(),
        usage: EncoderUsage::new(tokens),
    })
}

/// Scores of `firsts[i]` (or `firsts[0]` when there is one) against each of `seconds`; `raw` gives
/// a cross-encoder's logits rather than sigmoid(logit).
pub(super) async fn score_pairs(
    state: &SharedState<EncoderOnly>,
    model: Option<&str>,
    firsts: &[String],
    seconds: &[String],
    truncate: bool,
    raw: bool,
) -> Result<(Vec<f32>, usize), ApiError> {
    let first = |i: usize| firsts.get(i).or(firsts.first()).cloned().unwrap_or_default();
    let m = state.backend.encoder().model();
    match m.task {
        EncoderTask::Classify => {
            if m.config.labels.len() != 1 {
                return Err(ApiError::invalid(
                    Some("model".to_string()),
                    format!("this classifier has {} labels; scoring needs a one-label cross-encoder (use /classify)", m.config.labels.len()),
                ));
            }
            let pairs = seconds.iter().enumerate().map(|(i, s)| EncodeInput::Pair(first(i), s.clone())).collect();
            let out = encode(state, model, pairs, truncate, EncoderJobKind::Classify).await?;
            let logits = out.vectors.iter().map(|l| l.first().copied().unwrap_or(f32::NAN));
            Ok((if raw { logits.collect() } else { logits.map(sigmoid).collect() }, out.tokens))
        }
        EncoderTask::Embed => {
            // The distinct first texts once, then every second text: one request to the batcher.
            let n_first = if firsts.len() == 1 { 1 } else { seconds.len() };
            let mut inputs: Vec<EncodeInput> = (0..n_first).map(|i| EncodeInput::Text(first(i))).collect();
            inputs.extend(seconds.iter().cloned().map(EncodeInput::Text));
            let out = encode(state, model, inputs, truncate, EncoderJobKind::Embed).await?;
            let (a, b) = out.vectors.split_at(n_first);
            let scores = b.iter().enumerate().map(|(i, v)| cosine(&a[if n_first == 1 { 0 } else { i }], v)).collect();
            Ok((scores, out.tokens))
        }
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    (dot / (na * nb).max(1e-12)) as f32
}

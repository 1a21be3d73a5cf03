//! text-embeddings-inference's (TEI's) `POST /embed` and `POST /rerank`, for clients written for
//! TEI: the same encoder path as `/v1/embeddings` and `/v1/rerank`, TEI's bodies and bare-array
//! answers (`[[f32]]` and `[{index, score, text?}]`). Errors keep the OpenAI error shape.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use peregrine_api::tei::{TeiEmbedRequest, TeiRank, TeiRerankRequest};
use peregrine_engine::encoder::EncoderJobKind;

use super::embeddings::{output_dims, shorten};
use super::rerank::score_pairs;
use super::{fail, SharedState};
use crate::serve::encoder_backend::{encode, EncodeInput, EncoderOnly};
use crate::serve::error::ApiError;
use crate::serve::parse::{body_bytes, parse_request};

pub async fn embed(State(state): State<SharedState<EncoderOnly>>, body: Result<Bytes, BytesRejection>) -> Response {
    match run_embed(&state, body).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => fail(&state, e),
    }
}

async fn run_embed(state: &SharedState<EncoderOnly>, body: Result<Bytes, BytesRejection>) -> Result<Vec<Vec<f32>>, ApiError> {
    let request = body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<TeiEmbedRequest>(&b))?;
    let dims = output_dims(state, request.dimensions)?;
    let inputs = request.inputs.to_vec().into_iter().map(EncodeInput::Text).collect();
    // TEI normalizes when asked, whether or not the model's chain ends in Normalize; `false`
    // leaves that step out.
    let kind = if request.normalize { EncoderJobKind::Embed } else { EncoderJobKind::EmbedUnnormalized };
    let encoded = encode(state, None, inputs, request.truncate, kind).await?;
    let chain_normalizes = state.backend.encoder().model().pipeline.normalizes();
    Ok(encoded
        .vectors
        .into_iter()
        .map(|mut v| {
            if request.normalize && !chain_normalizes {
                peregrine_engine::encoder::sentence::l2_normalize(&mut v);
            }
            shorten(&mut v, dims, request.normalize);
            v
        })
        .collect())
}

pub async fn rerank(State(state): State<SharedState<EncoderOnly>>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let request = body_bytes(body, state.config.max_body_bytes).and_then(|b| parse_request::<TeiRerankRequest>(&b))?;
        let query = std::slice::from_ref(&request.query);
        let (scores, _) = score_pairs(&state, None, query, &request.texts, request.truncate, request.raw_scores).await?;
        let mut ranks: Vec<TeiRank> = scores
            .into_iter()
            .enumerate()
            .map(|(index, score)| TeiRank { index, score, text: request.return_text.then(|| request.texts[index].clone()) })
            .collect();
        ranks.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
        Ok::<_, ApiError>(ranks)
    };
    match run.await {
        Ok(r) => Json(r).into_response(),
        Err(e) => fail(&state, e),
    }
}

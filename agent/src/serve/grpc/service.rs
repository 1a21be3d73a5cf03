//! The Encoder service: each call is checked as HTTP's middleware checks a request (API key and
//! per-tenant request limit; UNAVAILABLE until the warm-up has run), turned into the HTTP
//! endpoint's typed request, validated by the same rules, answered by the same handler and turned
//! back into protobuf. Failures are counted in `/metrics` like HTTP's.

use std::future::Future;

use peregrine_api::encoders::{
    ClassifyRequest, EmbeddingInput, EmbeddingRequest, EmbeddingVector, EncoderUsage, EncodingFormat, RerankDocument,
    RerankRequest, ScoreRequest, ScoreTexts,
};
use peregrine_api::Validate;
use tonic::{Request, Response, Status};

use super::proto::encoder_server::Encoder;
use super::proto::{
    Classification, ClassifyResponse, EmbedResponse, Embedding, RerankResponse, RerankResult, ScoreResponse, Usage,
};
use super::{proto, status};
use crate::serve::backend::InferenceBackend;
use crate::serve::encoder_backend::EncoderOnly;
use crate::serve::error::ApiError;
use crate::serve::handlers::{classify, embeddings, record_failure, rerank, SharedState};
use crate::serve::routes::authorize;

pub struct EncoderService {
    state: SharedState<EncoderOnly>,
}

impl EncoderService {
    pub fn new(state: SharedState<EncoderOnly>) -> Self {
        EncoderService { state }
    }

    /// Admits the call, runs `handle` on its message and counts a failure.
    async fn answer<Q, R, F, Fut>(&self, request: Request<Q>, handle: F) -> Result<Response<R>, Status>
    where
        F: FnOnce(SharedState<EncoderOnly>, Q) -> Fut,
        Fut: Future<Output = Result<R, ApiError>>,
    {
        let admitted = self.admit(&request);
        let result = match admitted {
            Ok(()) => handle(self.state.clone(), request.into_inner()).await,
            Err(e) => Err(e),
        };
        result.map(Response::new).map_err(|e| {
            record_failure(&self.state, &e);
            status::to_status(&e)
        })
    }

    fn admit<Q>(&self, request: &Request<Q>) -> Result<(), ApiError> {
        // HTTP binds only once the model is loaded; its warm-up is the one remaining step. (While
        // draining, calls are still answered, as HTTP answers them until the drain delay ends.)
        let lifecycle = &self.state.lifecycle;
        if !lifecycle.is_ready() && !lifecycle.is_draining() {
            return Err(ApiError::Loading);
        }
        let authorization = request.metadata().get("authorization").map(|v| v.as_bytes());
        authorize(&self.state, authorization).map(|_tenant| ())
    }
}

#[tonic::async_trait]
impl Encoder for EncoderService {
    async fn embed(&self, request: Request<proto::EmbedRequest>) -> Result<Response<EmbedResponse>, Status> {
        self.answer(request, embed).await
    }

    async fn rerank(&self, request: Request<proto::RerankRequest>) -> Result<Response<RerankResponse>, Status> {
        self.answer(request, rerank).await
    }

    async fn score(&self, request: Request<proto::ScoreRequest>) -> Result<Response<ScoreResponse>, Status> {
        self.answer(request, score).await
    }

    async fn classify(&self, request: Request<proto::ClassifyRequest>) -> Result<Response<ClassifyResponse>, Status> {
        self.answer(request, classify).await
    }
}

/// proto3 has no absent string: an empty `model` means the served model.
fn model_field(model: String) -> Option<String> {
    (!model.is_empty()).then_some(model)
}

fn usage(u: EncoderUsage) -> Option<Usage> {
    let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    Some(Usage { prompt_tokens: count(u.prompt_tokens), total_tokens: count(u.total_tokens) })
}

async fn embed(state: SharedState<EncoderOnly>, r: proto::EmbedRequest) -> Result<EmbedResponse, ApiError> {
    let request = EmbeddingRequest {
        model: model_field(r.model).unwrap_or_else(|| state.backend.model_name().to_string()),
        input: EmbeddingInput::Texts(r.inputs),
        encoding_format: EncodingFormat::Float,
        dimensions: r.dimensions.map(i64::from),
        user: None,
        truncate: r.truncate,
    };
    request.validate()?;
    let answer = embeddings::respond(&state, request).await?;
    let embeddings = answer
        .data
        .into_iter()
        .map(|d| match d.embedding {
            EmbeddingVector::Float(values) => Ok(Embedding { values }),
            EmbeddingVector::Base64(_) => Err(ApiError::Internal("a base64 embedding for a float request".into())),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(EmbedResponse { model: answer.model, embeddings, usage: usage(answer.usage) })
}

async fn rerank(state: SharedState<EncoderOnly>, r: proto::RerankRequest) -> Result<RerankResponse, ApiError> {
    let request = RerankRequest {
        model: model_field(r.model),
        query: r.query,
        documents: r.documents.into_iter().map(RerankDocument::Text).collect(),
        top_n: r.top_n.map(i64::from),
        return_documents: r.return_documents,
        truncate: r.truncate,
    };
    request.validate()?;
    let answer = rerank::rerank_response(&state, request).await?;
    let results = answer
        .results
        .into_iter()
        .map(|x| RerankResult {
            index: u32::try_from(x.index).unwrap_or(u32::MAX),
            relevance_score: x.relevance_score,
            document: x.document.map(|d| d.text),
        })
        .collect();
    Ok(RerankResponse { id: answer.id, model: answer.model, results, usage: usage(answer.usage) })
}

async fn score(state: SharedState<EncoderOnly>, r: proto::ScoreRequest) -> Result<ScoreResponse, ApiError> {
    let request = ScoreRequest {
        model: model_field(r.model),
        text_1: ScoreTexts::Many(r.text_1),
        text_2: ScoreTexts::Many(r.text_2),
        truncate: r.truncate,
    };
    request.validate()?;
    let answer = rerank::score_response(&state, request).await?;
    let scores = answer.data.iter().map(|d| d.score).collect();
    Ok(ScoreResponse { id: answer.id, model: answer.model, scores, usage: usage(answer.usage) })
}

async fn classify(state: SharedState<EncoderOnly>, r: proto::ClassifyRequest) -> Result<ClassifyResponse, ApiError> {
    let request = ClassifyRequest { model: model_field(r.model), input: ScoreTexts::Many(r.inputs), truncate: r.truncate };
    request.validate()?;
    let answer = classify::respond(&state, request).await?;
    let results = answer.data.into_iter().map(|d| Classification { label: d.label, probs: d.probs }).collect();
    Ok(ClassifyResponse { id: answer.id, model: answer.model, results, usage: usage(answer.usage) })
}

//! Encoder cases (`spec.model.task` embed, rerank, classify) through the agent's encoder endpoints,
//! built from and read into the agent's own types (`peregrine_api::encoders`).
//!
//! An encoder answers in one step, so the whole request's latency stands in the `ttft` slot (the
//! time to the answer) and `tpot` stays empty: the runner's latency gate then compares request
//! latencies. The output is a vector (`values`: the embedding; the documents' relevance scores in
//! the case's order; the class probabilities) and a text the text expectations check (the top
//! label for classify; the document indices, most relevant first, comma-separated, for rerank).

use std::time::Instant;

use peregrine_api::encoders::{
    ClassifyRequest, ClassifyResponse, EmbeddingInput, EmbeddingRequest, EmbeddingResponse, EmbeddingVector, EncodingFormat,
    RerankDocument, RerankRequest, RerankResponse, ScoreTexts,
};
use peregrine_crds::{ModelTask, RegressionCase};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::client::{root, truncate, ClientError, Generation, OpenAiClient};

impl OpenAiClient {
    /// Sends `case` the way `task` needs: generation (streamed) or one encoder request.
    pub async fn run_case(&self, base: &str, model: &str, task: ModelTask, case: &RegressionCase) -> Result<Generation, ClientError> {
        if task.is_encoder() {
            self.encode(base, model, task, case).await
        } else {
            self.generate(base, model, case).await
        }
    }

    /// One encoder case: `/v1/embeddings`, `/v1/rerank` or `/classify`.
    pub async fn encode(&self, base: &str, model: &str, task: ModelTask, case: &RegressionCase) -> Result<Generation, ClientError> {
        let input = case.input.clone().ok_or_else(|| ClientError::BadCase("an encoder case needs input".into()))?;
        let started = Instant::now();
        let mut out = match task {
            ModelTask::Embed => {
                let request = EmbeddingRequest {
                    model: model.to_string(),
                    input: EmbeddingInput::Text(input),
                    encoding_format: EncodingFormat::Float,
                    dimensions: None,
                    user: None,
                    truncate: false,
                };
                let response: EmbeddingResponse = self.post(base, "/v1/embeddings", &request).await?;
                let data = response.data.into_iter().next().ok_or_else(|| ClientError::Protocol("no embedding in the answer".into()))?;
                let EmbeddingVector::Float(v) = data.embedding else {
                    return Err(ClientError::Protocol("asked for floats, got base64".into()));
                };
                Generation { text: String::new(), values: Some(v.into_iter().map(f64::from).collect()), ..Generation::default() }
            }
            ModelTask::Rerank => {
                let request = RerankRequest {
                    model: Some(model.to_string()),
                    query: input,
                    documents: case.documents.iter().cloned().map(RerankDocument::Text).collect(),
                    top_n: None,
                    return_documents: false,
                    truncate: false,
                };
                let response: RerankResponse = self.post(base, "/v1/rerank", &request).await?;
                let mut scores = vec![f64::NAN; case.documents.len()];
                for r in &response.results {
                    let slot = scores.get_mut(r.index).ok_or_else(|| ClientError::Protocol(format!("rerank index {} out of range", r.index)))?;
                    *slot = f64::from(r.relevance_score);
                }
                let order: Vec<String> = response.results.iter().map(|r| r.index.to_string()).collect();
                Generation { text: order.join(","), values: Some(scores), ..Generation::default() }
            }
            ModelTask::Classify => {
                let request = ClassifyRequest { model: Some(model.to_string()), input: ScoreTexts::One(input), truncate: false };
                let response: ClassifyResponse = self.post(base, "/classify", &request).await?;
                let data = response.data.into_iter().next().ok_or_else(|| ClientError::Protocol("no classification in the answer".into()))?;
                Generation { text: data.label, values: Some(data.probs.into_iter().map(f64::from).collect()), ..Generation::default() }
            }
            ModelTask::Generate => return Err(ClientError::BadCase("a generate model has no encoder endpoint".into())),
        };
        out.ttft = started.elapsed();
        Ok(out)
    }

    async fn post<B: Serialize, R: DeserializeOwned>(&self, base: &str, path: &str, body: &B) -> Result<R, ClientError> {
        let url = format!("{}{path}", root(base));
        let response = self.http().post(&url).json(body).send().await.map_err(|e| ClientError::Transport(e.to_string()))?;
        let status = response.status();
        let text = response.text().await.map_err(|e| ClientError::Transport(e.to_string()))?;
        if !status.is_success() {
            return Err(ClientError::Status { status: status.as_u16(), body: truncate(&text, 500) });
        }
        serde_json::from_str(&text).map_err(|e| ClientError::Protocol(format!("{path}: {e}")))
    }
}

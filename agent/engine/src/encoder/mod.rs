//! Encoder models (BERT family: BERT, MiniLM, BGE, RoBERTa, XLM-R) served for embeddings,
//! classification and reranking, apart from the decoder path.
//!
//! - [`config`]: `config.json` → [`EncoderConfig`]; [`weights`]: safetensors → [`EncoderWeights`].
//! - [`tokenize`]: text (or text pairs) → ids + token types, truncation only when asked.
//! - [`sentence`]: the Sentence-Transformers chain after the Transformer (pooling, Dense, Normalize).
//! - [`service`]: the batching thread: queued sequences merged by total tokens into one ragged
//!   forward (`plan::RaggedBatch`) on an [`crate::backend::EncoderBackend`].
//!
//! [`EncoderModel::load`] reads a whole folder; the forward itself is a backend's job
//! (`backend::cpu::encoder::CpuEncoder`).

pub mod config;
pub mod decoder;
pub mod sentence;
pub mod service;
pub mod tokenize;
pub mod weights;

use std::path::Path;

pub use config::EncoderConfig;
pub use sentence::SentencePipeline;
pub use service::{EncoderHandle, EncoderJobKind, EncoderMetrics, EncoderServiceConfig};
pub use tokenize::{EncoderInput, EncoderTokenizer};
pub use weights::{ClassifierHead, EncoderWeights};

use crate::{EngineError, Result};

/// What an encoder folder is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderTask {
    /// Sentence embeddings (pooling chain).
    Embed,
    /// `*ForSequenceClassification`: labels + probabilities; with one label, a cross-encoder score.
    Classify,
}

/// Everything a folder holds except the forward's weights, which go to the backend.
#[derive(Debug, Clone)]
pub struct EncoderModel {
    pub config: EncoderConfig,
    pub tokenizer: EncoderTokenizer,
    pub pipeline: SentencePipeline,
    pub classifier: Option<ClassifierHead>,
    pub task: EncoderTask,
}

/// Whether `dir` holds a BERT-family encoder (its `config.json` says so), rather than a decoder.
pub fn is_encoder_folder(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return false;
    };
    let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    matches!(
        json.get("model_type").and_then(|v| v.as_str()),
        Some("bert" | "roberta" | "xlm-roberta" | "camembert")
    )
}

impl EncoderModel {
    /// Loads config, tokenizer, Sentence-Transformers modules and weights. The task is
    /// classification when `config.json`'s architectures name a `*ForSequenceClassification`, else
    /// embeddings. Returns the weights apart, for the backend.
    pub fn load(dir: &Path) -> Result<(EncoderModel, EncoderWeights)> {
        let config = EncoderConfig::load(dir)?;
        let classify = std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|j| j.get("architectures").cloned())
            .and_then(|a| a.as_array().cloned())
            .is_some_and(|a| a.iter().any(|x| x.as_str().is_some_and(|s| s.ends_with("ForSequenceClassification"))));
        if classify && config.labels.is_empty() {
            return Err(EngineError::invalid_model(dir.join("config.json"), "a classification model without id2label"));
        }
        let num_labels = if classify { config.labels.len() } else { 0 };
        let mut weights = EncoderWeights::load(dir, &config, num_labels)?;
        let pipeline = SentencePipeline::load(dir, config.hidden_size)?;
        let limit = config.max_tokens_per_sequence();
        let max_seq_length = pipeline.max_seq_length.map_or(limit, |m| m.min(limit));
        let tokenizer = EncoderTokenizer::load(dir, max_seq_length)?;
        let classifier = weights.classifier.take();
        let task = if classify { EncoderTask::Classify } else { EncoderTask::Embed };
        Ok((EncoderModel { config, tokenizer, pipeline, classifier, task }, weights))
    }

    /// Overrides Sentence-Transformers' `max_seq_length` (`serve --max-model-len`), up to what the
    /// position table holds.
    pub fn set_max_seq_length(&mut self, n: usize) -> Result<()> {
        let limit = self.config.max_tokens_per_sequence();
        if n == 0 || n > limit {
            return Err(EngineError::InvalidConfig(format!("max sequence length {n} is outside 1..={limit} for this encoder")));
        }
        self.tokenizer.set_max_seq_length(n)
    }

    /// Width of one embedding.
    pub fn embedding_dim(&self) -> usize {
        self.pipeline.output_dim(self.config.hidden_size)
    }

    /// The classifier's logits for one sequence's hidden states (its first token), if it has a head.
    pub fn classify(&self, rows: &[f32]) -> Option<Vec<f32>> {
        self.classify_first(&rows[..self.config.hidden_size])
    }

    /// The classifier's logits from a sequence's first-token hidden state (`hidden` values), if it
    /// has a head.
    pub fn classify_first(&self, first: &[f32]) -> Option<Vec<f32>> {
        let head = self.classifier.as_ref()?;
        let mut pooled = sentence::linear_apply(&head.dense, first);
        pooled.iter_mut().for_each(|v| *v = v.tanh());
        Some(sentence::linear_apply(&head.out, &pooled))
    }
}

/// Softmax of a logits vector (f64 inside), for class probabilities.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| (e / sum) as f32).collect()
}

/// The logistic function, for a one-label cross-encoder's relevance score.
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

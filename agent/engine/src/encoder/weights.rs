//! The weights of a BERT-family encoder in HF layout, read from a safetensors folder: embeddings
//! (word, absolute position, token type, LayerNorm), per layer q/k/v/o with biases and the two
//! post-LayerNorms, the feed-forward pair, and the optional sequence-classification head.

use std::path::Path;

use super::config::EncoderConfig;
use crate::model::safetensors::SafetensorsFolder;
use crate::model::Matrix;
use crate::{EngineError, Result};

/// A linear layer `y = x·Wᵀ + b`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Matrix,
    pub bias: Vec<f32>,
}

/// `LayerNorm(x) = (x - mean) / sqrt(var + eps) · weight + bias`.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct EncoderLayer {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    pub attn_out: Linear,
    pub attn_norm: LayerNorm,
    pub intermediate: Linear,
    pub output: Linear,
    pub output_norm: LayerNorm,
}

impl EncoderLayer {
    /// `[q; k; v]` as one linear (rows stacked, biases concatenated): both backends run the three
    /// projections as one GEMM over the input.
    pub fn fused_qkv(&self) -> Linear {
        let parts = [&self.query, &self.key, &self.value];
        let cols = self.query.weight.cols;
        let rows = parts.iter().map(|p| p.weight.rows).sum();
        let mut w = Vec::with_capacity(rows * cols);
        let mut bias = Vec::with_capacity(rows);
        for p in parts {
            w.extend(p.weight.to_f32());
            bias.extend_from_slice(&p.bias);
        }
        Linear { weight: Matrix::from_f32(rows, cols, w), bias }
    }
}

/// `*ForSequenceClassification`'s head on the first token: `out(tanh(dense(h[0])))`. BERT calls the
/// dense layer `pooler.dense` and the output `classifier`; RoBERTa/XLM-R `classifier.dense` and
/// `classifier.out_proj`: the same arithmetic.
#[derive(Debug, Clone)]
pub struct ClassifierHead {
    pub dense: Linear,
    pub out: Linear,
}

#[derive(Debug, Clone)]
pub struct EncoderWeights {
    pub word_embeddings: Vec<f32>,
    pub position_embeddings: Vec<f32>,
    pub token_type_embeddings: Vec<f32>,
    pub embeddings_norm: LayerNorm,
    pub layers: Vec<EncoderLayer>,
    pub classifier: Option<ClassifierHead>,
}

/// Reads tensors under one name prefix and checks every shape against the config.
struct Reader<'a> {
    st: &'a SafetensorsFolder,
    file: &'a Path,
    prefix: String,
}

impl Reader<'_> {
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let full = format!("{}{name}", self.prefix);
        let (got, data) = self.st.tensor_f32(&full)?;
        if got != shape {
            return Err(EngineError::invalid_model(
                self.file,
                format!("tensor {full} has shape {got:?}, expected {shape:?}"),
            ));
        }
        if data.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::invalid_model(self.file, format!("tensor {full} has non-finite values")));
        }
        Ok(data)
    }

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        Ok(Linear {
            weight: Matrix::from_f32(rows, cols, self.tensor(&format!("{name}.weight"), &[rows, cols])?),
            bias: self.tensor(&format!("{name}.bias"), &[rows])?,
        })
    }

    fn norm(&self, name: &str, len: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self.tensor(&format!("{name}.weight"), &[len])?,
            bias: self.tensor(&format!("{name}.bias"), &[len])?,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.st.contains(&format!("{}{name}", self.prefix))
    }
}

impl EncoderWeights {
    /// Reads `model.safetensors` (or its shards) in `dir`. The body's names may carry the prefix a
    /// task class gives them (`bert.`, `roberta.`, ...); `num_labels > 0` requires the head.
    pub fn load(dir: &Path, config: &EncoderConfig, num_labels: usize) -> Result<EncoderWeights> {
        let st = SafetensorsFolder::open(dir)?;
        let file = dir.join("model.safetensors");
        let prefix = ["", "bert.", "roberta.", "xlm-roberta.", "model."]
            .into_iter()
            .find(|p| st.contains(&format!("{p}embeddings.word_embeddings.weight")))
            .ok_or_else(|| EngineError::invalid_model(&file, "no embeddings.word_embeddings.weight: not a BERT-family checkpoint"))?;
        let r = Reader { st: &st, file: &file, prefix: prefix.to_string() };
        let c = config;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("encoder.layer.{l}");
            layers.push(EncoderLayer {
                query: r.linear(&format!("{p}.attention.self.query"), h, h)?,
                key: r.linear(&format!("{p}.attention.self.key"), h, h)?,
                value: r.linear(&format!("{p}.attention.self.value"), h, h)?,
                attn_out: r.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: r.norm(&format!("{p}.attention.output.LayerNorm"), h)?,
                intermediate: r.linear(&format!("{p}.intermediate.dense"), i, h)?,
                output: r.linear(&format!("{p}.output.dense"), h, i)?,
                output_norm: r.norm(&format!("{p}.output.LayerNorm"), h)?,
            });
        }
        let classifier = if num_labels == 0 {
            None
        } else {
            // The head lives outside the body's prefix.
            let top = Reader { st: &st, file: &file, prefix: String::new() };
            let head = if top.has("classifier.out_proj.weight") {
                ClassifierHead {
                    dense: top.linear("classifier.dense", h, h)?,
                    out: top.linear("classifier.out_proj", num_labels, h)?,
                }
            } else {
                ClassifierHead {
                    dense: r.linear("pooler.dense", h, h)?,
                    out: top.linear("classifier", num_labels, h)?,
                }
            };
            Some(head)
        };
        Ok(EncoderWeights {
            word_embeddings: r.tensor("embeddings.word_embeddings.weight", &[c.vocab_size, h])?,
            position_embeddings: r.tensor("embeddings.position_embeddings.weight", &[c.max_position_embeddings, h])?,
            token_type_embeddings: r.tensor("embeddings.token_type_embeddings.weight", &[c.type_vocab_size, h])?,
            embeddings_norm: r.norm("embeddings.LayerNorm", h)?,
            layers,
            classifier,
        })
    }
}

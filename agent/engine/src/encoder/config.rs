//! `EncoderConfig`: the hyper-parameters of a BERT-family encoder (BERT, MiniLM, BGE, RoBERTa,
//! XLM-R) from its `config.json`, plus the classification labels of `*ForSequenceClassification`.

use std::path::Path;

use serde_json::Value;

use crate::{EngineError, Result};

/// The activation of the feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `0.5·x·(1 + erf(x/√2))`: transformers' `gelu`.
    GeluErf,
    /// The tanh approximation: `gelu_new`, `gelu_pytorch_tanh`.
    GeluTanh,
    Relu,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EncoderConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f32,
    pub activation: Activation,
    /// Position ids start here: 0 for BERT; `pad_token_id + 1` for RoBERTa/XLM-R, whose position
    /// table reserves the rows up to the padding index.
    pub position_offset: usize,
    /// Class labels in id order (`id2label`), when the model has a classification head.
    pub labels: Vec<String>,
}

impl EncoderConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The longest sequence the position table allows.
    pub fn max_tokens_per_sequence(&self) -> usize {
        self.max_position_embeddings.saturating_sub(self.position_offset)
    }

    /// Checks a batch against this model (ids inside the vocabulary and token types, lengths inside
    /// the position table) before any backend indexes its tables with it.
    pub fn check_batch(&self, batch: &crate::plan::RaggedBatch) -> Result<()> {
        batch
            .validate(self.vocab_size, self.type_vocab_size, self.max_tokens_per_sequence())
            .map_err(|m| EngineError::InvalidRequest(format!("encoder batch: {m}")))
    }

    pub fn load(dir: &Path) -> Result<EncoderConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|source| EngineError::Io { path: path.clone(), source })?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| EngineError::invalid_model(&path, format!("not valid JSON: {e}")))?;
        Self::parse(&json).map_err(|m| EngineError::invalid_model(&path, m))
    }

    /// Parses a `config.json` value; errors are plain messages (the caller adds the path).
    pub fn parse(json: &Value) -> std::result::Result<EncoderConfig, String> {
        let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("").to_string();
        let roberta_like = matches!(model_type.as_str(), "roberta" | "xlm-roberta" | "camembert");
        if !roberta_like && !matches!(model_type.as_str(), "bert" | "") {
            return Err(format!("model_type {model_type:?} is not a BERT-family encoder"));
        }
        let usize_field = |name: &str| -> std::result::Result<usize, String> {
            json.get(name)
                .and_then(Value::as_u64)
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{name} is missing or not a positive integer"))
        };
        let hidden_size = usize_field("hidden_size")?;
        let num_attention_heads = usize_field("num_attention_heads")?;
        if hidden_size % num_attention_heads != 0 {
            return Err(format!(
                "hidden_size {hidden_size} is not a multiple of num_attention_heads {num_attention_heads}"
            ));
        }
        let activation = match json.get("hidden_act").and_then(Value::as_str).unwrap_or("gelu") {
            "gelu" => Activation::GeluErf,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            other => return Err(format!("hidden_act {other:?} is not supported (gelu, gelu_new, relu)")),
        };
        let position_type =
            json.get("position_embedding_type").and_then(Value::as_str).unwrap_or("absolute");
        if position_type != "absolute" {
            return Err(format!(
                "position_embedding_type {position_type:?} is not supported (absolute only)"
            ));
        }
        let position_offset = if roberta_like {
            json.get("pad_token_id").and_then(Value::as_u64).map_or(1, |p| p as usize) + 1
        } else {
            0
        };
        let max_position_embeddings = usize_field("max_position_embeddings")?;
        if position_offset >= max_position_embeddings {
            return Err("pad_token_id leaves no position embeddings".into());
        }
        let type_vocab_size = json.get("type_vocab_size").and_then(Value::as_u64).unwrap_or(2) as usize;
        let layer_norm_eps =
            json.get("layer_norm_eps").and_then(Value::as_f64).unwrap_or(1e-12) as f32;
        Ok(EncoderConfig {
            model_type,
            vocab_size: usize_field("vocab_size")?,
            hidden_size,
            num_hidden_layers: usize_field("num_hidden_layers")?,
            num_attention_heads,
            intermediate_size: usize_field("intermediate_size")?,
            max_position_embeddings,
            type_vocab_size: type_vocab_size.max(1),
            layer_norm_eps,
            activation,
            position_offset,
            labels: labels(json)?,
        })
    }
}

/// `id2label` in id order; ids must be exactly `0..n`.
fn labels(json: &Value) -> std::result::Result<Vec<String>, String> {
    let Some(map) = json.get("id2label").and_then(Value::as_object) else {
        return Ok(Vec::new());
    };
    let mut labels = vec![None; map.len()];
    for (id, label) in map {
        let i: usize = id.parse().map_err(|_| format!("id2label key {id:?} is not an integer"))?;
        let slot = labels.get_mut(i).ok_or_else(|| format!("id2label ids are not 0..{}", map.len()))?;
        *slot = Some(label.as_str().ok_or("id2label values must be strings")?.to_string());
    }
    labels.into_iter().map(|l| l.ok_or_else(|| "id2label has a gap".to_string())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn minilm() -> Value {
        serde_json::json!({"model_type": "bert", "hidden_size": 384, "num_attention_heads": 12,
            "num_hidden_layers": 6, "intermediate_size": 1536, "max_position_embeddings": 512,
            "vocab_size": 30522, "type_vocab_size": 2, "hidden_act": "gelu", "layer_norm_eps": 1e-12})
    }

    #[test]
    fn bert_and_roberta_positions() {
        let c = EncoderConfig::parse(&minilm()).unwrap();
        assert_eq!((c.head_dim(), c.position_offset, c.max_tokens_per_sequence()), (32, 0, 512));
        let mut x = minilm();
        x["model_type"] = "xlm-roberta".into();
        x["pad_token_id"] = 1.into();
        let c = EncoderConfig::parse(&x).unwrap();
        assert_eq!((c.position_offset, c.max_tokens_per_sequence()), (2, 510));
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        for (field, value) in [
            ("model_type", serde_json::json!("llama")),
            ("hidden_act", serde_json::json!("swish")),
            ("position_embedding_type", serde_json::json!("relative_key")),
            ("num_attention_heads", serde_json::json!(5)),
            ("hidden_size", serde_json::json!(-1)),
        ] {
            let mut x = minilm();
            x[field] = value;
            assert!(EncoderConfig::parse(&x).is_err(), "{field}");
        }
    }

    #[test]
    fn labels_in_id_order() {
        let mut x = minilm();
        x["id2label"] = serde_json::json!({"1": "pos", "0": "neg"});
        assert_eq!(EncoderConfig::parse(&x).unwrap().labels, ["neg", "pos"]);
        x["id2label"] = serde_json::json!({"0": "a", "2": "c"});
        assert!(EncoderConfig::parse(&x).is_err());
    }
}

//! `ModelConfig` from a HF folder (`config.json` + optional `generation_config.json`) or from GGUF
//! metadata (`{arch}.*` keys).

use std::path::Path;

use serde_json::Value;

use super::gguf::GgufFile;
use crate::config::{Architecture, Llama3RopeScaling, ModelConfig};
use crate::{EngineError, Result};

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text)
        .map_err(|e| EngineError::invalid_model(path, format!("not valid JSON: {e}")))
}

/// Token id(s) stored as a number or a list of numbers.
fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .into_iter()
            .collect(),
        Some(Value::Array(items)) => items
            .iter()
            .filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect(),
        _ => Vec::new(),
    }
}

/// Reads `config.json` in `dir` and, when present, `generation_config.json` (its EOS ids are added).
pub fn load_hf_config(dir: &Path) -> Result<ModelConfig> {
    let config_path = dir.join("config.json");
    let json = read_json(&config_path)?;
    let mut config =
        parse_hf_config(&json).map_err(|m| EngineError::invalid_model(&config_path, m))?;
    // A quantized checkpoint this loader cannot read fails here, by name, not at a tensor's dtype;
    // one it reads but serves differently from its own description says how.
    let notes = super::quantized_checkpoint::check_quantization_config(&json)
        .map_err(|m| EngineError::invalid_model(&config_path, m))?;
    for note in notes {
        tracing::info!("quantized checkpoint: {note}");
    }
    let gen_path = dir.join("generation_config.json");
    if gen_path.is_file() {
        let gen = read_json(&gen_path)?;
        for id in token_ids(gen.get("eos_token_id")) {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
        if config.bos_token_id.is_none() {
            config.bos_token_id = token_ids(gen.get("bos_token_id")).first().copied();
        }
    }
    Ok(config)
}

/// Parses a `config.json` value. Errors are plain messages; the caller adds the path.
pub fn parse_hf_config(json: &Value) -> std::result::Result<ModelConfig, String> {
    let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
    let architecture = match model_type {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        other => {
            return Err(format!(
                "model_type {other:?} is not supported (llama, mistral, qwen2)"
            ))
        }
    };
    let usize_field = |key: &str| -> std::result::Result<Option<usize>, String> {
        match json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| format!("{key} must be a non-negative integer, found {v}")),
        }
    };
    let required = |key: &str| -> std::result::Result<usize, String> {
        usize_field(key)?
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("{key} is missing or zero"))
    };
    let hidden_size = required("hidden_size")?;
    let num_attention_heads = required("num_attention_heads")?;
    let num_key_value_heads = usize_field("num_key_value_heads")?.unwrap_or(num_attention_heads);
    let head_dim = usize_field("head_dim")?.unwrap_or(hidden_size / num_attention_heads);
    let f64_field = |key: &str| json.get(key).and_then(Value::as_f64);
    // transformers 5 moved rope settings into `rope_parameters`; older configs keep `rope_theta` and
    // `rope_scaling` at the top level.
    let rope = json.get("rope_parameters").filter(|v| v.is_object());
    let rope_theta = rope
        .and_then(|r| r.get("rope_theta"))
        .and_then(Value::as_f64)
        .or_else(|| f64_field("rope_theta"))
        .unwrap_or(10000.0) as f32;
    let scaling = rope.or_else(|| json.get("rope_scaling").filter(|v| v.is_object()));
    let rope_scaling = match scaling {
        None => None,
        Some(s) => parse_rope_scaling(s)?,
    };
    let tie_default = false;
    let eos_token_ids = token_ids(json.get("eos_token_id"));
    let config = ModelConfig {
        architecture,
        hidden_size,
        intermediate_size: required("intermediate_size")?,
        num_hidden_layers: required("num_hidden_layers")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        vocab_size: required("vocab_size")?,
        max_position_embeddings: usize_field("max_position_embeddings")?.unwrap_or(2048),
        rms_norm_eps: f64_field("rms_norm_eps").unwrap_or(1e-6) as f32,
        rope_theta,
        rope_scaling,
        tie_word_embeddings: json
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(tie_default),
        // Qwen2 always has q/k/v biases; Llama makes them optional.
        attention_bias: architecture == Architecture::Qwen2
            || json
                .get("attention_bias")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        bos_token_id: token_ids(json.get("bos_token_id")).first().copied(),
        eos_token_ids,
    };
    check_config(&config)?;
    Ok(config)
}

fn parse_rope_scaling(s: &Value) -> std::result::Result<Option<Llama3RopeScaling>, String> {
    let rope_type = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match rope_type {
        "default" => Ok(None),
        "llama3" => {
            let f = |key: &str| {
                s.get(key)
                    .and_then(Value::as_f64)
                    .ok_or_else(|| format!("rope_scaling.{key} is missing"))
            };
            Ok(Some(Llama3RopeScaling {
                factor: f("factor")? as f32,
                low_freq_factor: f("low_freq_factor")? as f32,
                high_freq_factor: f("high_freq_factor")? as f32,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            }))
        }
        other => Err(format!(
            "rope scaling type {other:?} is not supported (default, llama3)"
        )),
    }
}

/// Sanity checks shared by both sources, so the backend can trust the numbers.
fn check_config(c: &ModelConfig) -> std::result::Result<(), String> {
    if c.num_key_value_heads == 0 || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        return Err(format!(
            "num_attention_heads {} is not a multiple of num_key_value_heads {}",
            c.num_attention_heads, c.num_key_value_heads
        ));
    }
    if c.head_dim == 0 || !c.head_dim.is_multiple_of(2) {
        return Err(format!("head_dim {} must be even and non-zero", c.head_dim));
    }
    if !(c.rms_norm_eps.is_finite()
        && c.rms_norm_eps > 0.0
        && c.rope_theta.is_finite()
        && c.rope_theta > 0.0)
    {
        return Err("rms_norm_eps and rope_theta must be positive".into());
    }
    if let Some(s) = &c.rope_scaling {
        if !(s.factor > 0.0 && s.high_freq_factor > s.low_freq_factor && s.low_freq_factor > 0.0) {
            return Err(format!("invalid llama3 rope_scaling {s:?}"));
        }
    }
    Ok(())
}

/// Builds the config from GGUF metadata (llama.cpp's `{arch}.*` keys and `tokenizer.ggml.*` ids).
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig> {
    let err = |m: String| EngineError::invalid_model(file.path(), m);
    let arch_name = file
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| err("general.architecture is missing".into()))?;
    let architecture = match arch_name {
        // Mistral GGUFs are written as "llama".
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        other => {
            return Err(EngineError::Unsupported(format!(
                "GGUF architecture {other:?} (llama, qwen2)"
            )))
        }
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    let uint = |k: &str| {
        file.get(&key(k))
            .and_then(|v| v.as_u64())
            .map(|n| n as usize)
    };
    let req = |k: &str| {
        uint(k)
            .filter(|&n| n > 0)
            .ok_or_else(|| err(format!("{} is missing", key(k))))
    };
    let float = |k: &str| file.get(&key(k)).and_then(|v| v.as_f32());

    if let Some(t) = file.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        if t != "none" {
            return Err(EngineError::Unsupported(format!(
                "GGUF rope scaling type {t:?}"
            )));
        }
    }
    if file.tensor("rope_freqs.weight").is_some() {
        return Err(EngineError::Unsupported(
            "GGUF with precomputed rope_freqs (Llama-3.1 scaling): load the HF folder instead"
                .into(),
        ));
    }

    let hidden_size = req("embedding_length")?;
    let num_attention_heads = req("attention.head_count")?;
    let num_key_value_heads = uint("attention.head_count_kv").unwrap_or(num_attention_heads);
    let head_dim = uint("attention.key_length")
        .or_else(|| uint("rope.dimension_count"))
        .unwrap_or(hidden_size / num_attention_heads);
    let vocab_size = match uint("vocab_size") {
        Some(v) => v,
        None => file
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.len())
            .ok_or_else(|| err("no vocab_size and no tokenizer.ggml.tokens".into()))?,
    };
    let tok_id = |k: &str| {
        file.get(k)
            .and_then(|v| v.as_u64())
            .and_then(|n| u32::try_from(n).ok())
    };
    let config = ModelConfig {
        architecture,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        vocab_size,
        max_position_embeddings: uint("context_length").unwrap_or(2048),
        rms_norm_eps: float("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        rope_theta: float("rope.freq_base").unwrap_or(10000.0),
        rope_scaling: None,
        tie_word_embeddings: file.tensor("output.weight").is_none(),
        attention_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        bos_token_id: tok_id("tokenizer.ggml.bos_token_id"),
        eos_token_ids: tok_id("tokenizer.ggml.eos_token_id").into_iter().collect(),
    };
    check_config(&config).map_err(err)?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_config_with_rope_scaling_and_eos_list() {
        let json: Value = serde_json::from_str(
            r#"{"model_type":"llama","hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,
            "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":131072,
            "rms_norm_eps":1e-05,"rope_theta":500000.0,"tie_word_embeddings":true,"bos_token_id":128000,
            "eos_token_id":[128001,128008,128009],
            "rope_scaling":{"factor":32.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
            "original_max_position_embeddings":8192,"rope_type":"llama3"}}"#,
        )
        .unwrap();
        let c = parse_hf_config(&json).unwrap();
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.gqa_group(), 4);
        assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
        let s = c.rope_scaling.unwrap();
        assert_eq!(
            (s.factor, s.low_freq_factor, s.high_freq_factor),
            (32.0, 1.0, 4.0)
        );
        assert_eq!(s.original_max_position_embeddings, 8192);
    }

    #[test]
    fn qwen2_has_biases_and_unknown_types_fail() {
        let json: Value = serde_json::from_str(
            r#"{"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,
            "num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,"rope_theta":1000000.0,
            "rms_norm_eps":1e-06,"eos_token_id":151645}"#,
        )
        .unwrap();
        let c = parse_hf_config(&json).unwrap();
        assert!(c.attention_bias);
        assert_eq!(c.head_dim, 64);
        let bad: Value = serde_json::from_str(r#"{"model_type":"gpt2"}"#).unwrap();
        assert!(parse_hf_config(&bad).is_err());
        let bad: Value = serde_json::from_str(
            r#"{"model_type":"llama","hidden_size":64,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":3,"num_key_value_heads":2,"vocab_size":8}"#,
        )
        .unwrap();
        assert!(parse_hf_config(&bad).is_err());
    }
}

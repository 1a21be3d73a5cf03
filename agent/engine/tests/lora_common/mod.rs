//! Helpers shared by the `lora_*` integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use peregrine_engine::config::{Architecture, ModelConfig};

use super::common;

/// SmolLM2-135M's config as transformers reports it in the fixtures (no model loading needed).
pub fn smollm2_config() -> ModelConfig {
    let reference = common::reference();
    let c = &reference["model_config"];
    let get = |k: &str| c[k].as_u64().unwrap_or_else(|| panic!("model_config.{k}")) as usize;
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: get("hidden_size"),
        intermediate_size: get("intermediate_size"),
        num_hidden_layers: get("num_hidden_layers"),
        num_attention_heads: get("num_attention_heads"),
        num_key_value_heads: get("num_key_value_heads"),
        head_dim: get("head_dim"),
        vocab_size: get("vocab_size"),
        max_position_embeddings: get("max_position_embeddings"),
        rms_norm_eps: c["rms_norm_eps"].as_f64().unwrap() as f32,
        rope_theta: c["rope_theta"].as_f64().unwrap() as f32,
        rope_scaling: None,
        tie_word_embeddings: true,
        attention_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

pub fn adapter_dir(name: &str) -> PathBuf {
    let dir = common::fixtures_dir().join("smollm2/lora").join(name);
    assert!(dir.is_dir(), "adapter fixture {} missing: run `make model` / check ../shared/fixtures", dir.display());
    dir
}

pub fn lora_reference() -> serde_json::Value {
    let path = common::fixtures_dir().join("smollm2/lora_reference.json");
    let text = std::fs::read_to_string(&path).expect("read lora_reference.json");
    serde_json::from_str(&text).expect("parse lora_reference.json")
}

/// Copies a fixture adapter folder into a temp dir so a test can damage it.
pub fn copy_adapter(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(adapter_dir(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

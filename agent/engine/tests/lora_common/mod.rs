//! Helpers shared by the `lora_*` integration tests.
#![allow(dead_code)]

use std::path::PathBuf;

use peregrine_engine::config::{Architecture, ModelConfig};
use serde_json::Value;

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
    assert!(
        dir.is_dir(),
        "adapter fixture {} missing: check tests/fixtures or PEREGRINE_FIXTURES",
        dir.display()
    );
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

pub const ATOL: f32 = 1e-3;

pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

/// One generation case: a prompt under an adapter slot (None: base) and what the fixtures expect.
pub struct Case {
    pub label: String,
    pub prompt: Vec<u32>,
    pub slot: Option<u32>,
    /// The fixture adapter's folder name (None: base model).
    pub adapter: Option<String>,
    pub top10_ids: Vec<u32>,
    pub top10_logits: Vec<f32>,
    /// Greedy ids to match exactly (cut before the first low-margin step for the base model).
    pub greedy: Vec<u32>,
}

pub fn cases(slots: &[(&str, u32)]) -> Vec<Case> {
    let lora_ref = lora_reference();
    let base_ref = common::reference();
    let mut out = Vec::new();
    for &(name, slot) in slots {
        for (pi, p) in lora_ref["adapters"][name]["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            out.push(Case {
                label: format!("{name} prompt {pi}"),
                prompt: u32s(&p["input_ids"]),
                slot: Some(slot),
                adapter: Some(name.to_string()),
                top10_ids: u32s(&p["last_top10_ids"]),
                top10_logits: f32s(&p["last_top10_logits"]),
                greedy: u32s(&p["greedy"]["ids"]),
            });
        }
    }
    // The base model on the same prompts, from the base fixtures.
    for p in lora_ref["adapters"]["adapter-a"]["prompts"]
        .as_array()
        .unwrap()
    {
        let ids = u32s(&p["input_ids"]);
        let base = base_ref["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| u32s(&b["input_ids"]) == ids)
            .unwrap();
        let last = base["positions"].as_array().unwrap().last().unwrap();
        let steps = base["greedy"]["steps"].as_array().unwrap();
        let safe = steps
            .iter()
            .take(24)
            .take_while(|s| s["top2_margin"].as_f64().unwrap() > 2.0 * ATOL as f64)
            .count();
        out.push(Case {
            label: format!("base {:?}", base["prompt"].as_str().unwrap()),
            prompt: ids,
            slot: None,
            adapter: None,
            top10_ids: u32s(&last["top10_ids"]),
            top10_logits: f32s(&last["top10_logits"]),
            greedy: u32s(&base["greedy"]["ids"])[..safe].to_vec(),
        });
    }
    out
}

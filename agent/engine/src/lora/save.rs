//! Writes an adapter as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, each
//! tensor in the width the adapter holds it: f32, F16 or BF16), so synthetic adapters (benchmarks,
//! tests, e2e) go through the same loading path as real ones, and a loaded adapter saves as read.

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::adapter::{LoraAdapter, CONFIG_FILE, WEIGHTS_FILE};
use super::values::LoraValues;
use crate::{EngineError, Result};

/// Saves `adapter` into `dir` (created if needed) with `lora_alpha = scaling · r` (no rsLoRA).
pub fn save_peft(adapter: &LoraAdapter, dir: &Path) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EngineError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": adapter.rank,
        "lora_alpha": adapter.scaling * adapter.rank as f32,
        "target_modules": adapter.targets.iter().map(|m| m.peft_name()).collect::<Vec<_>>(),
        "bias": "none",
        "use_rslora": false,
        "fan_in_fan_out": false,
        "lora_dropout": 0.0,
    });
    let config_path = dir.join(CONFIG_FILE);
    std::fs::write(&config_path, config.to_string()).map_err(io(&config_path))?;

    let mut buffers: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    for (layer, pairs) in adapter.layers.iter().enumerate() {
        for pair_and_module in pairs.iter().enumerate() {
            let (index, Some(pair)) = pair_and_module else {
                continue;
            };
            let module = super::target::TargetModule::ALL[index];
            let prefix = format!(
                "base_model.model.model.layers.{layer}.{}.{}",
                module.parent(),
                module.peft_name()
            );
            let fan_in = pair.a.len() / adapter.rank.max(1);
            let fan_out = pair.b.len() / adapter.rank.max(1);
            let (a_dtype, a_bytes) = le_bytes(&pair.a);
            buffers.push((format!("{prefix}.lora_A.weight"), vec![adapter.rank, fan_in], a_dtype, a_bytes));
            let (b_dtype, b_bytes) = le_bytes(&pair.b);
            buffers.push((format!("{prefix}.lora_B.weight"), vec![fan_out, adapter.rank], b_dtype, b_bytes));
        }
    }
    let views = buffers
        .iter()
        .map(|(name, shape, dtype, data)| {
            TensorView::new(*dtype, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| EngineError::Backend(format!("cannot build tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| EngineError::Backend(format!("cannot serialize adapter: {e}")))?;
    let weights_path = dir.join(WEIGHTS_FILE);
    std::fs::write(&weights_path, bytes).map_err(io(&weights_path))
}

/// The values' safetensors dtype and little-endian bytes.
fn le_bytes(values: &LoraValues) -> (Dtype, Vec<u8>) {
    match values {
        LoraValues::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        LoraValues::F16(v) => (Dtype::F16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        LoraValues::Bf16(v) => (Dtype::BF16, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

//! Writes an adapter as a PEFT folder (`adapter_config.json` + f32 `adapter_model.safetensors`),
//! so synthetic adapters (benchmarks, tests, e2e) go through the same loading path as real ones.

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::adapter::{LoraAdapter, CONFIG_FILE, WEIGHTS_FILE};
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

    let mut buffers: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (layer, pairs) in adapter.layers.iter().enumerate() {
        for pair_and_module in pairs.iter().enumerate() {
            let (index, Some(pair)) = pair_and_module else { continue };
            let module = super::target::TargetModule::ALL[index];
            let prefix = format!("base_model.model.model.layers.{layer}.{}.{}", module.parent(), module.peft_name());
            let fan_in = pair.a.len() / adapter.rank.max(1);
            let fan_out = pair.b.len() / adapter.rank.max(1);
            buffers.push((format!("{prefix}.lora_A.weight"), vec![adapter.rank, fan_in], f32_bytes(&pair.a)));
            buffers.push((format!("{prefix}.lora_B.weight"), vec![fan_out, adapter.rank], f32_bytes(&pair.b)));
        }
    }
    let views = buffers
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| EngineError::Backend(format!("cannot build tensor {name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes = safetensors::serialize(views, None)
        .map_err(|e| EngineError::Backend(format!("cannot serialize adapter: {e}")))?;
    let weights_path = dir.join(WEIGHTS_FILE);
    std::fs::write(&weights_path, bytes).map_err(io(&weights_path))
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

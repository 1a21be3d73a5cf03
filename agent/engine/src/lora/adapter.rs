//! A PEFT LoRA adapter in host memory: `adapter_config.json` + `adapter_model.safetensors`, read,
//! checked against the base model and converted to f32.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};

use super::config::AdapterConfig;
use super::target::TargetModule;
use crate::config::ModelConfig;
use crate::{EngineError, Result};

pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
const PICKLE_FILE: &str = "adapter_model.bin";

/// The low-rank pair of one projection of one layer: `delta_W = scaling * B @ A`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPair {
    /// `[r, in]`, row-major.
    pub a: Vec<f32>,
    /// `[out, r]`, row-major.
    pub b: Vec<f32>,
}

/// An adapter's weights in f32, per layer and target module, with its rank and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraAdapter {
    pub rank: usize,
    /// `alpha / r` (or `alpha / sqrt(r)` with rsLoRA).
    pub scaling: f32,
    pub targets: Vec<TargetModule>,
    /// `layers[l][module.index()]`: `Some` exactly for the targeted modules.
    pub layers: Vec<[Option<LoraPair>; 7]>,
    /// What was read: [`content_digest`] of the folder's files at load; empty for adapters built
    /// in memory.
    pub digest: String,
}

/// `sha256:<hex>` of `adapter_config.json`'s bytes followed by `adapter_model.safetensors`'s, so
/// that `cat adapter_config.json adapter_model.safetensors | sha256sum` gives the same hex. It
/// names the content a pod serves: the operator records it per pod and compares pods by it.
pub fn content_digest(config_bytes: &[u8], weights_bytes: &[u8]) -> String {
    let mut hasher = Sha256::new();
    hasher.update(config_bytes);
    hasher.update(weights_bytes);
    let hex: String = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

impl LoraAdapter {
    /// Loads the PEFT adapter in the folder `dir` and validates it against `base` (shapes, rank ≤
    /// `max_rank`, dtypes, the exact set of tensors, finite values).
    pub fn load(dir: &Path, base: &ModelConfig, max_rank: usize) -> Result<LoraAdapter> {
        if !dir.is_dir() {
            return Err(EngineError::invalid_adapter(
                dir,
                "not a folder (expected a PEFT adapter folder)",
            ));
        }
        let config_path = dir.join(CONFIG_FILE);
        let weights_path = dir.join(WEIGHTS_FILE);
        if !weights_path.is_file() && dir.join(PICKLE_FILE).is_file() {
            return Err(EngineError::invalid_adapter(
                dir,
                "pickle .bin adapters are not supported; convert to safetensors",
            ));
        }
        if !config_path.is_file() {
            return Err(EngineError::invalid_adapter(
                dir,
                format!("missing {CONFIG_FILE}"),
            ));
        }
        if !weights_path.is_file() {
            return Err(EngineError::invalid_adapter(
                dir,
                format!("missing {WEIGHTS_FILE}"),
            ));
        }
        // Read once: the digest and the parsed adapter come from the same bytes.
        let config_text = std::fs::read_to_string(&config_path).map_err(|source| EngineError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config = AdapterConfig::from_json(&config_text)
            .map_err(|message| EngineError::invalid_adapter(&config_path, message))?;
        let bytes = std::fs::read(&weights_path).map_err(|source| EngineError::Io {
            path: weights_path.clone(),
            source,
        })?;
        let mut adapter = LoraAdapter::from_parts(&config, &bytes, base, max_rank)
            .map_err(|message| EngineError::invalid_adapter(&weights_path, message))?;
        adapter.digest = content_digest(config_text.as_bytes(), &bytes);
        Ok(adapter)
    }

    /// Builds the adapter from a parsed config and the bytes of a safetensors file.
    pub fn from_parts(
        config: &AdapterConfig,
        safetensors_bytes: &[u8],
        base: &ModelConfig,
        max_rank: usize,
    ) -> std::result::Result<LoraAdapter, String> {
        let r = config.r;
        if r > max_rank {
            return Err(format!("rank {r} exceeds max_lora_rank {max_rank}"));
        }
        let st = SafeTensors::deserialize(safetensors_bytes)
            .map_err(|e| format!("not a valid safetensors file: {e}"))?;

        // Sort every tensor into its (layer, module, A|B) place first, so that missing and extra
        // tensors are both reported by name.
        let mut found: BTreeMap<(usize, TargetModule, bool), safetensors::tensor::TensorView<'_>> =
            BTreeMap::new();
        for (name, view) in st.iter() {
            let (layer, module, is_a) = parse_tensor_name(name).ok_or_else(|| {
                format!("unexpected tensor {name:?} (only LoRA A/B of decoder projections)")
            })?;
            if layer >= base.num_hidden_layers {
                return Err(format!(
                    "tensor {name:?} is for layer {layer} but the base model has {} layers",
                    base.num_hidden_layers
                ));
            }
            if !config.target_modules.contains(&module) {
                return Err(format!(
                    "tensor {name:?} targets {module}, which target_modules does not list"
                ));
            }
            found.insert((layer, module, is_a), view);
        }

        let mut layers: Vec<[Option<LoraPair>; 7]> = Vec::with_capacity(base.num_hidden_layers);
        for layer in 0..base.num_hidden_layers {
            let mut per_module: [Option<LoraPair>; 7] = Default::default();
            for &module in &config.target_modules {
                let (fan_in, fan_out) = module.dims(base);
                let a = take_tensor(&found, layer, module, true, [r, fan_in])?;
                let b = take_tensor(&found, layer, module, false, [fan_out, r])?;
                per_module[module.index()] = Some(LoraPair { a, b });
            }
            layers.push(per_module);
        }
        Ok(LoraAdapter {
            rank: r,
            scaling: config.scaling(),
            targets: config.target_modules.iter().copied().collect(),
            layers,
            digest: String::new(),
        })
    }

    /// Bytes this adapter takes in host memory (f32 weights).
    pub fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.iter().flatten())
            .map(|p| (p.a.len() + p.b.len()) * std::mem::size_of::<f32>())
            .sum()
    }

    pub fn pair(&self, layer: usize, module: TargetModule) -> Option<&LoraPair> {
        self.layers
            .get(layer)
            .and_then(|l| l[module.index()].as_ref())
    }
}

/// `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight` → (i, module, is_a).
/// PEFT writes the adapter name into the key only in memory (`lora_A.default.weight`); we accept that
/// spelling too since some tools save it.
fn parse_tensor_name(name: &str) -> Option<(usize, TargetModule, bool)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (parent, rest) = rest.split_once('.')?;
    let (module_name, rest) = rest.split_once('.')?;
    let module = TargetModule::from_peft_name(module_name)?;
    if module.parent() != parent {
        return None;
    }
    let is_a = match rest {
        "lora_A.weight" | "lora_A.default.weight" => true,
        "lora_B.weight" | "lora_B.default.weight" => false,
        _ => return None,
    };
    Some((layer, module, is_a))
}

fn take_tensor(
    found: &BTreeMap<(usize, TargetModule, bool), safetensors::tensor::TensorView<'_>>,
    layer: usize,
    module: TargetModule,
    is_a: bool,
    shape: [usize; 2],
) -> std::result::Result<Vec<f32>, String> {
    let which = if is_a { "lora_A" } else { "lora_B" };
    let label = format!("layers.{layer}.{}.{module}.{which}", module.parent());
    let view = found
        .get(&(layer, module, is_a))
        .ok_or_else(|| format!("missing tensor {label}"))?;
    if view.shape() != shape {
        return Err(format!(
            "{label} has shape {:?}, expected {:?} for this base model (A is [r, in], B is [out, r])",
            view.shape(),
            shape
        ));
    }
    let values = to_f32(view.dtype(), view.data()).ok_or_else(|| {
        format!(
            "{label} has dtype {:?}; only F32, F16 and BF16 are supported",
            view.dtype()
        )
    })?;
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!(
            "{label} holds a non-finite value ({}) at index {i}",
            values[i]
        ));
    }
    Ok(values)
}

/// Little-endian F32/F16/BF16 bytes → f32; None for any other dtype. The safetensors crate has
/// already checked that the byte length matches shape × dtype size.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let values = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => return None,
    };
    Some(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_digest_is_sha256_of_the_files_one_after_the_other() {
        // FIPS 180-2's "abc" test vector, split across the two files.
        assert_eq!(
            content_digest(b"ab", b"c"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(content_digest(b"abc", b""), content_digest(b"a", b"bc"));
    }

    #[test]
    fn parses_peft_tensor_names() {
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.12.self_attn.q_proj.lora_A.weight"),
            Some((12, TargetModule::Q, true))
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"),
            Some((0, TargetModule::Down, false))
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.0.mlp.q_proj.lora_B.weight"),
            None
        );
        assert_eq!(
            parse_tensor_name("base_model.model.lm_head.lora_A.weight"),
            None
        );
        assert_eq!(
            parse_tensor_name("base_model.model.model.layers.x.mlp.up_proj.lora_A.weight"),
            None
        );
    }
}

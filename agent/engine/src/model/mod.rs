//! Model files → weights in memory: GGUF files and HF safetensors folders, dequantization, configs.

pub mod dummy;
pub mod quantized_checkpoint;
pub mod gptq;
pub mod ggml_type;
pub mod gguf;
pub mod gguf_weights;
pub mod hf_config;
pub mod quant;
pub mod quantize;
pub mod rotate;
pub mod rowquant;
pub mod safetensors;
pub mod weights;

use std::path::Path;

pub use ggml_type::GgmlType;
pub use gguf::{GgufFile, GgufTensorInfo, GgufValue};
pub use weights::{LayerWeights, Matrix, MatrixData, ModelWeights};

use crate::config::ModelConfig;
use crate::{EngineError, Result};

/// How to read the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LoadFormat {
    /// A `.gguf` file (or any file starting with the GGUF magic) → GGUF; a folder → safetensors.
    #[default]
    Auto,
    Gguf,
    Safetensors,
    /// Random weights from `config.json` (a folder holding it, or the file itself).
    Dummy,
}

/// Seed used for [`LoadFormat::Dummy`] weights.
pub const DUMMY_SEED: u64 = 0x5eed;

#[derive(Debug, Clone)]
pub struct LoadedModel {
    pub config: ModelConfig,
    pub weights: ModelWeights,
}

fn is_gguf_file(path: &Path) -> bool {
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return true;
    }
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// Loads a model from a `.gguf` file or a HF folder.
pub fn load(path: &Path, format: LoadFormat) -> Result<LoadedModel> {
    if !path.exists() {
        return Err(EngineError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder"),
        });
    }
    let format = match format {
        LoadFormat::Auto if path.is_dir() => LoadFormat::Safetensors,
        LoadFormat::Auto if is_gguf_file(path) => LoadFormat::Gguf,
        LoadFormat::Auto => {
            return Err(EngineError::invalid_model(
                path,
                "neither a GGUF file nor a folder with config.json",
            ))
        }
        f => f,
    };
    match format {
        // Resolved above; kept as a GGUF load so the match needs no impossible arm.
        LoadFormat::Gguf | LoadFormat::Auto => {
            let file = GgufFile::open(path)?;
            let config = hf_config::config_from_gguf(&file)?;
            let weights = gguf_weights::weights_from_gguf(&file, &config)?;
            Ok(LoadedModel { config, weights })
        }
        LoadFormat::Safetensors => {
            if !path.is_dir() {
                return Err(EngineError::invalid_model(
                    path,
                    "safetensors loading expects a HF folder",
                ));
            }
            let config = hf_config::load_hf_config(path)?;
            let weights = safetensors::weights_from_safetensors(path, &config)?;
            Ok(LoadedModel { config, weights })
        }
        LoadFormat::Dummy => {
            let config = dummy_config(path)?;
            let weights = dummy::dummy_weights(&config, DUMMY_SEED);
            Ok(LoadedModel { config, weights })
        }
    }
}

/// The model shape `--load-format dummy` builds random weights for: `config.json` in the folder
/// `path`, or the JSON file `path` itself. Backends that make their weights on their device read
/// only this, never a host copy of the weights.
pub fn dummy_config(path: &Path) -> Result<ModelConfig> {
    if path.is_dir() {
        return hf_config::load_hf_config(path);
    }
    let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io { path: path.to_path_buf(), source })?;
    let json = serde_json::from_str(&text).map_err(|e| EngineError::invalid_model(path, format!("not valid JSON: {e}")))?;
    hf_config::parse_hf_config(&json).map_err(|m| EngineError::invalid_model(path, m))
}

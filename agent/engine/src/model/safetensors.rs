//! HF folders of safetensors (one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`), memory-mapped; F32/F16/BF16 tensors become f32, and
//! pre-quantized checkpoints' `F8_E4M3` and `I8` linear weights stay 8-bit with their scales
//! (`quantized_checkpoint`).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use super::quantized_checkpoint;
use super::ggml_type::GgmlType;
use super::quant;
use super::weights::{LayerWeights, Matrix, ModelWeights};
use crate::config::ModelConfig;
use crate::{EngineError, Result};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// The mapped shards of one folder and which shard holds each tensor.
pub struct SafetensorsFolder {
    maps: Vec<(PathBuf, Mmap)>,
    /// tensor name → index into `maps`
    index: HashMap<String, usize>,
}

impl SafetensorsFolder {
    pub fn open(dir: &Path) -> Result<SafetensorsFolder> {
        let index_path = dir.join(INDEX_FILE);
        let files: Vec<PathBuf> = if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| EngineError::Io {
                path: index_path.clone(),
                source,
            })?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                EngineError::invalid_model(&index_path, format!("not valid JSON: {e}"))
            })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| EngineError::invalid_model(&index_path, "no weight_map object"))?;
            let mut shards = std::collections::BTreeSet::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| {
                    EngineError::invalid_model(
                        &index_path,
                        format!("weight_map entry {name} is not a file name"),
                    )
                })?;
                // Shards must sit in the folder itself: no absolute paths or `..`.
                if Path::new(file).components().count() != 1 {
                    return Err(EngineError::invalid_model(
                        &index_path,
                        format!("bad shard name {file:?}"),
                    ));
                }
                shards.insert(file.to_string());
            }
            shards.into_iter().map(|f| dir.join(f)).collect()
        } else {
            vec![dir.join(SINGLE_FILE)]
        };

        if files.is_empty() {
            return Err(EngineError::invalid_model(
                &index_path,
                "weight_map lists no shards",
            ));
        }
        let mut maps = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let file = File::open(&path).map_err(|source| EngineError::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: read-only private map; the file must not change while mapped (as for any
            // mmap-based loader).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|source| EngineError::Io {
                path: path.clone(),
                source,
            })?;
            let st = SafeTensors::deserialize(&mmap).map_err(|e| {
                EngineError::invalid_model(&path, format!("not a valid safetensors file: {e}"))
            })?;
            for name in st.names() {
                if index.insert(name.to_string(), i).is_some() {
                    return Err(EngineError::invalid_model(
                        &path,
                        format!("tensor {name} appears in two shards"),
                    ));
                }
            }
            maps.push((path, mmap));
        }
        Ok(SafetensorsFolder { maps, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Bytes of all mapped files (for load progress: the headers are a rounding error).
    pub fn total_bytes(&self) -> u64 {
        self.maps.iter().map(|(_, m)| m.len() as u64).sum()
    }

    /// Every tensor name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// A tensor's dtype, shape and bytes (borrowed from the map).
    fn tensor_raw(&self, name: &str) -> Result<(Dtype, Vec<usize>, &[u8])> {
        let &i = self.index.get(name).ok_or_else(|| {
            EngineError::invalid_model(&self.maps[0].0, format!("tensor {name} is missing"))
        })?;
        let (path, mmap) = &self.maps[i];
        let err = |m: String| EngineError::invalid_model(path, m);
        // Already validated in `open`; deserializing again only re-reads the header.
        let st = SafeTensors::deserialize(mmap).map_err(|e| err(e.to_string()))?;
        let view = st
            .tensor(name)
            .map_err(|e| err(format!("tensor {name}: {e}")))?;
        Ok((view.dtype(), view.shape().to_vec(), view.data()))
    }

    /// A tensor as f32 with its shape.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (dtype, shape, data) = self.tensor_raw(name)?;
        // Counted where a tensor's bytes are used (here, and FP8 codes in `linear`), once each.
        crate::progress::weights().tensor_done(data.len() as u64);
        let err = |m: String| EngineError::invalid_model(self.path(), m);
        let ty = match dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => {
                return Err(err(format!(
                    "tensor {name} has dtype {other:?} (F32, F16, BF16 supported; F8_E4M3 and I8 for linear weights)"
                )))
            }
        };
        // The reader checked shape × dtype against the bytes; overflow is still refused, not wrapped.
        let n = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| err(format!("tensor {name}: shape {shape:?} overflows")))?;
        let data = quant::dequantize(ty, data, n)
            .map_err(|e| err(format!("tensor {name}: {e}")))?;
        Ok((shape, data))
    }

    fn path(&self) -> &Path {
        &self.maps[0].0
    }

    /// A linear layer's weight: floats become f32; `F8_E4M3` or `I8` (a pre-quantized checkpoint)
    /// stays 8-bit with the scales of `{name}_scale`.
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let (dtype, shape, codes) = self.tensor_raw(name)?;
        let Some(format) = quantized_checkpoint::row_format_of(dtype) else {
            return self.matrix(name, rows, cols);
        };
        let scale = quantized_checkpoint::scale_name(name);
        if !self.contains(&scale) {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("tensor {name} is {dtype:?} but {scale} is missing"),
            ));
        }
        crate::progress::weights().tensor_done(codes.len() as u64);
        let (scale_shape, scales) = self.tensor_f32(&scale)?;
        quantized_checkpoint::row_quant_matrix(format, name, codes, &shape, &scale_shape, scales, rows, cols)
            .map_err(|m| EngineError::invalid_model(self.path(), m))
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let (shape, data) = self.tensor_f32(name)?;
        if shape != [rows, cols] {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("tensor {name} has shape {shape:?}, expected [{rows}, {cols}]"),
            ));
        }
        Ok(Matrix::from_f32(rows, cols, data))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let (shape, data) = self.tensor_f32(name)?;
        if shape != [len] {
            return Err(EngineError::invalid_model(
                self.path(),
                format!("tensor {name} has shape {shape:?}, expected [{len}]"),
            ));
        }
        Ok(data)
    }

    fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.contains(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Reads HF-named tensors (`model.layers.{i}.self_attn.q_proj.weight`, ...) into [`ModelWeights`].
pub fn weights_from_safetensors(dir: &Path, config: &ModelConfig) -> Result<ModelWeights> {
    let st = SafetensorsFolder::open(dir)?;
    let progress = crate::progress::weights();
    progress.begin(&dir.display().to_string(), st.total_bytes(), st.index.len() as u64);
    let weights = read_weights(&st, dir, config);
    progress.finish();
    weights
}

fn read_weights(st: &SafetensorsFolder, dir: &Path, config: &ModelConfig) -> Result<ModelWeights> {
    let c = config;
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        layers.push(LayerWeights {
            input_layernorm: st.vector(&n("input_layernorm.weight"), h)?,
            q_proj: st.linear(&n("self_attn.q_proj.weight"), q, h)?,
            k_proj: st.linear(&n("self_attn.k_proj.weight"), kv, h)?,
            v_proj: st.linear(&n("self_attn.v_proj.weight"), kv, h)?,
            o_proj: st.linear(&n("self_attn.o_proj.weight"), h, q)?,
            q_bias: st.optional_vector(&n("self_attn.q_proj.bias"), q)?,
            k_bias: st.optional_vector(&n("self_attn.k_proj.bias"), kv)?,
            v_bias: st.optional_vector(&n("self_attn.v_proj.bias"), kv)?,
            post_attention_layernorm: st.vector(&n("post_attention_layernorm.weight"), h)?,
            gate_proj: st.linear(&n("mlp.gate_proj.weight"), inter, h)?,
            up_proj: st.linear(&n("mlp.up_proj.weight"), inter, h)?,
            down_proj: st.linear(&n("mlp.down_proj.weight"), h, inter)?,
        });
    }
    let lm_head = if c.tie_word_embeddings {
        None
    } else {
        Some(st.linear("lm_head.weight", c.vocab_size, h)?)
    };
    let weights = ModelWeights {
        config: config.clone(),
        embed_tokens: st.matrix("model.embed_tokens.weight", c.vocab_size, h)?,
        layers,
        norm: st.vector("model.norm.weight", h)?,
        lm_head,
        down_input_hadamard: None,
    };
    weights
        .validate()
        .map_err(|m| EngineError::invalid_model(dir, m))?;
    Ok(weights)
}

/// The HF tensor names and f32 data of `weights` (for writing a folder, e.g. in tests or export).
pub fn hf_tensors(weights: &ModelWeights) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = BTreeMap::new();
    let mut mat = |name: String, m: &Matrix| {
        out.insert(name, (vec![m.rows, m.cols], m.to_f32()));
    };
    mat("model.embed_tokens.weight".into(), &weights.embed_tokens);
    if let Some(m) = &weights.lm_head {
        mat("lm_head.weight".into(), m);
    }
    for (i, l) in weights.layers.iter().enumerate() {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        mat(n("self_attn.q_proj.weight"), &l.q_proj);
        mat(n("self_attn.k_proj.weight"), &l.k_proj);
        mat(n("self_attn.v_proj.weight"), &l.v_proj);
        mat(n("self_attn.o_proj.weight"), &l.o_proj);
        mat(n("mlp.gate_proj.weight"), &l.gate_proj);
        mat(n("mlp.up_proj.weight"), &l.up_proj);
        mat(n("mlp.down_proj.weight"), &l.down_proj);
    }
    let mut vec = |name: String, v: &[f32]| {
        out.insert(name, (vec![v.len()], v.to_vec()));
    };
    vec("model.norm.weight".into(), &weights.norm);
    for (i, l) in weights.layers.iter().enumerate() {
        let n = |s: &str| format!("model.layers.{i}.{s}");
        vec(n("input_layernorm.weight"), &l.input_layernorm);
        vec(
            n("post_attention_layernorm.weight"),
            &l.post_attention_layernorm,
        );
        for (name, b) in [
            ("q_proj", &l.q_bias),
            ("k_proj", &l.k_bias),
            ("v_proj", &l.v_bias),
        ] {
            if let Some(b) = b {
                vec(n(&format!("self_attn.{name}.bias")), b);
            }
        }
    }
    out
}

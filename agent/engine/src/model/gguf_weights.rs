//! GGUF tensors → [`ModelWeights`] in HF layout.
//!
//! Q8_0/Q4_0/Q4_1 matrices stay quantized (repacked); F32/F16/BF16 become f32. For the `llama`
//! architecture llama.cpp's converter permuted the q/k rows for its interleaved RoPE; they are put
//! back in HF order here so the backend can use rotate-half RoPE like transformers.

use super::gguf::{GgufFile, GgufTensorInfo};
use super::quant::{self, QuantKind, QuantMatrix};
use super::weights::{unpermute_rope_rows, LayerWeights, Matrix, ModelWeights};
use crate::config::ModelConfig;
use crate::{EngineError, Result};

struct Ctx<'a> {
    file: &'a GgufFile,
}

impl Ctx<'_> {
    fn err(&self, m: String) -> EngineError {
        EngineError::invalid_model(self.file.path(), m)
    }

    fn info(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.file
            .tensor(name)
            .ok_or_else(|| self.err(format!("tensor {name} is missing")))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.info(name)?;
        if info.n_elements != len as u64 {
            return Err(self.err(format!(
                "tensor {name} has {} elements, expected {len}",
                info.n_elements
            )));
        }
        let bytes = self.file.tensor_data(info)?;
        crate::progress::weights().tensor_done(bytes.len() as u64);
        quant::dequantize(info.ggml_type, bytes, len)
            .map_err(|e| self.err(format!("tensor {name}: {e}")))
    }

    fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        match self.file.tensor(name) {
            None => Ok(None),
            Some(_) => self.vector(name, len).map(Some),
        }
    }

    /// A `[rows, cols]` matrix (ggml dims `[cols, rows]`).
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let info = self.info(name)?;
        if info.dims.len() != 2 || info.dims[0] != cols as u64 || info.dims[1] != rows as u64 {
            return Err(self.err(format!(
                "tensor {name} has ggml dims {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        let bytes = self.file.tensor_data(info)?;
        crate::progress::weights().tensor_done(bytes.len() as u64);
        let map = |e: quant::QuantError| self.err(format!("tensor {name}: {e}"));
        if QuantKind::from_ggml(info.ggml_type).is_some() {
            Ok(Matrix::from_quant(
                QuantMatrix::from_ggml(info.ggml_type, bytes, rows, cols).map_err(map)?,
            ))
        } else {
            Ok(Matrix::from_f32(
                rows,
                cols,
                quant::dequantize(info.ggml_type, bytes, rows * cols).map_err(map)?,
            ))
        }
    }
}

/// Reads every tensor the config needs.
pub fn weights_from_gguf(file: &GgufFile, config: &ModelConfig) -> Result<ModelWeights> {
    let progress = crate::progress::weights();
    let bytes: u64 = file.tensors().iter().filter_map(|t| t.n_bytes).fold(0, u64::saturating_add);
    progress.begin(&file.path().display().to_string(), bytes, file.tensors().len() as u64);
    let weights = read_weights(file, config);
    progress.finish();
    weights
}

fn read_weights(file: &GgufFile, config: &ModelConfig) -> Result<ModelWeights> {
    let cx = Ctx { file };
    let c = config;
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let permuted = file.get("general.architecture").and_then(|v| v.as_str()) == Some("llama");
    let q_perm = unpermute_rope_rows(c.num_attention_heads, c.head_dim);
    let k_perm = unpermute_rope_rows(c.num_key_value_heads, c.head_dim);
    let unpermute = |m: Matrix, perm: &[usize]| if permuted { m.permute_rows(perm) } else { m };
    let unpermute_vec = |v: Option<Vec<f32>>, perm: &[usize]| {
        v.map(|v| {
            if permuted {
                perm.iter().map(|&i| v[i]).collect()
            } else {
                v
            }
        })
    };

    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for i in 0..c.num_hidden_layers {
        let n = |s: &str| format!("blk.{i}.{s}");
        layers.push(LayerWeights {
            input_layernorm: cx.vector(&n("attn_norm.weight"), h)?,
            q_proj: unpermute(cx.matrix(&n("attn_q.weight"), q, h)?, &q_perm),
            k_proj: unpermute(cx.matrix(&n("attn_k.weight"), kv, h)?, &k_perm),
            v_proj: cx.matrix(&n("attn_v.weight"), kv, h)?,
            o_proj: cx.matrix(&n("attn_output.weight"), h, q)?,
            q_bias: unpermute_vec(cx.optional_vector(&n("attn_q.bias"), q)?, &q_perm),
            k_bias: unpermute_vec(cx.optional_vector(&n("attn_k.bias"), kv)?, &k_perm),
            v_bias: cx.optional_vector(&n("attn_v.bias"), kv)?,
            post_attention_layernorm: cx.vector(&n("ffn_norm.weight"), h)?,
            gate_proj: cx.matrix(&n("ffn_gate.weight"), inter, h)?,
            up_proj: cx.matrix(&n("ffn_up.weight"), inter, h)?,
            down_proj: cx.matrix(&n("ffn_down.weight"), h, inter)?,
        });
    }
    let lm_head = match file.tensor("output.weight") {
        Some(_) => Some(cx.matrix("output.weight", c.vocab_size, h)?),
        None => None,
    };
    let weights = ModelWeights {
        config: config.clone(),
        embed_tokens: cx.matrix("token_embd.weight", c.vocab_size, h)?,
        layers,
        norm: cx.vector("output_norm.weight", h)?,
        lm_head,
        down_input_hadamard: None,
    };
    weights.validate().map_err(|m| cx.err(m))?;
    Ok(weights)
}

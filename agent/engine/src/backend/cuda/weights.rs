//! Model weights on the GPU in bf16, in the layouts the forward pass wants: q/k/v fused into one
//! `[q_dim + 2 kv_dim, hidden]` matrix and gate/up into one `[2 I, hidden]` matrix, so each takes one
//! GEMM. Norm weights and biases stay f32 (tiny, read by the f32 parts of the kernels).

use half::bf16;
use peregrine_kernels::{Cuda, DevBuf};

use super::gpu_err;
use crate::config::ModelConfig;
use crate::model::{Matrix, ModelWeights};
use crate::{EngineError, Result};

pub struct LayerWeights {
    pub input_norm: DevBuf<f32>,
    pub qkv: DevBuf<u16>,
    pub qkv_bias: Option<DevBuf<f32>>,
    pub o: DevBuf<u16>,
    pub post_norm: DevBuf<f32>,
    pub gate_up: DevBuf<u16>,
    pub down: DevBuf<u16>,
}

pub struct GpuWeights {
    pub embed: DevBuf<u16>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DevBuf<f32>,
    /// None: tied to `embed`.
    pub lm_head: Option<DevBuf<u16>>,
}

impl GpuWeights {
    pub fn lm_head_ptr(&self) -> u64 {
        self.lm_head.as_ref().unwrap_or(&self.embed).ptr()
    }

    /// Bytes the weights take on the device.
    pub fn bytes(&self) -> usize {
        let mut b = self.embed.len() * 2 + self.final_norm.len() * 4 + self.lm_head.as_ref().map_or(0, |l| l.len() * 2);
        for l in &self.layers {
            b += (l.qkv.len() + l.o.len() + l.gate_up.len() + l.down.len()) * 2;
            b += (l.input_norm.len() + l.post_norm.len() + l.qkv_bias.as_ref().map_or(0, |x| x.len())) * 4;
        }
        b
    }

    /// Uploads host weights (dequantized to f32, then rounded to bf16 on the host, nearest even).
    pub fn upload(cuda: &Cuda, w: &ModelWeights) -> Result<Self> {
        w.validate().map_err(EngineError::Unsupported)?;
        let mats = |parts: &[&Matrix]| -> Result<DevBuf<u16>> {
            let total: usize = parts.iter().map(|m| m.rows * m.cols).sum();
            let mut bits = Vec::with_capacity(total);
            for m in parts {
                bits.extend(m.to_f32().into_iter().map(|v| bf16::from_f32(v).to_bits()));
            }
            cuda.gpu.upload(&bits).map_err(gpu_err)
        };
        let vec32 = |v: &[f32]| -> Result<DevBuf<f32>> { cuda.gpu.upload(v).map_err(gpu_err) };
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let qkv_bias = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(vec32(&[q.as_slice(), k, v].concat())?),
                (None, None, None) => None,
                _ => return Err(EngineError::Unsupported("q/k/v biases must be all present or all absent".into())),
            };
            layers.push(LayerWeights {
                input_norm: vec32(&l.input_layernorm)?,
                qkv: mats(&[&l.q_proj, &l.k_proj, &l.v_proj])?,
                qkv_bias,
                o: mats(&[&l.o_proj])?,
                post_norm: vec32(&l.post_attention_layernorm)?,
                gate_up: mats(&[&l.gate_proj, &l.up_proj])?,
                down: mats(&[&l.down_proj])?,
            });
        }
        Ok(GpuWeights {
            embed: mats(&[&w.embed_tokens])?,
            layers,
            final_norm: vec32(&w.norm)?,
            lm_head: w.lm_head.as_ref().map(|m| mats(&[m])).transpose()?,
        })
    }

    /// Random weights generated on the device (for `--load-format dummy` benchmarks of big models):
    /// matrices uniform with std 1/sqrt(fan_in), embeddings uniform in ±1, norms 1, biases 0.
    pub fn random(cuda: &Cuda, config: &ModelConfig, seed: u64) -> Result<Self> {
        let h = config.hidden_size;
        let mut next_seed = seed;
        let mut rand = |len: usize, fan_in: usize| -> Result<DevBuf<u16>> {
            let buf = cuda.gpu.alloc_zeros::<u16>(len).map_err(gpu_err)?;
            next_seed = next_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let scale = (3.0f32 / fan_in as f32).sqrt();
            // SAFETY: buf holds len bf16 values.
            unsafe { cuda.kernels.fill_uniform_bf16(&cuda.gpu.stream, buf.ptr(), len, next_seed, scale) }.map_err(gpu_err)?;
            Ok(buf)
        };
        let ones = |len: usize| -> Result<DevBuf<f32>> { cuda.gpu.upload(&vec![1.0f32; len]).map_err(gpu_err) };
        let (q, kv, inter) = (config.q_dim(), config.kv_dim(), config.intermediate_size);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for _ in 0..config.num_hidden_layers {
            layers.push(LayerWeights {
                input_norm: ones(h)?,
                qkv: rand((q + 2 * kv) * h, h)?,
                qkv_bias: if config.attention_bias { Some(cuda.gpu.alloc_zeros::<f32>(q + 2 * kv).map_err(gpu_err)?) } else { None },
                o: rand(h * q, q)?,
                post_norm: ones(h)?,
                gate_up: rand(2 * inter * h, h)?,
                down: rand(h * inter, inter)?,
            });
        }
        let embed = rand(config.vocab_size * h, 3)?; // scale sqrt(3/3) = 1: uniform in ±1
        let lm_head = if config.tie_word_embeddings { None } else { Some(rand(config.vocab_size * h, h)?) };
        let final_norm = ones(h)?;
        cuda.gpu.synchronize().map_err(gpu_err)?;
        Ok(GpuWeights { embed, layers, final_norm, lm_head })
    }
}

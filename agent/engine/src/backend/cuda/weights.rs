//! Model weights on the GPU in bf16, in the layouts the forward pass wants: q/k/v fused into one
//! `[q_dim + 2 kv_dim, hidden]` matrix and gate/up into one `[2 I, hidden]` matrix, so each takes one
//! GEMM. Norm weights and biases stay f32 (tiny, read by the f32 parts of the kernels).

use std::borrow::Cow;

use half::bf16;
use peregrine_kernels::{Cuda, DevBuf};

use super::gpu_err;
use crate::config::ModelConfig;
use crate::{EngineError, Result};

/// Where host weights come from: f32 tensors by their Hugging Face names
/// (`model.layers.0.self_attn.q_proj.weight`, ...), in HF layout (`[out, in]`, q/k un-permuted).
pub trait HostWeights {
    fn tensor(&self, name: &str) -> Option<Cow<'_, [f32]>>;
}

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

    /// Uploads (converting to bf16 on the host, round to nearest even).
    pub fn upload(cuda: &Cuda, config: &ModelConfig, host: &dyn HostWeights) -> Result<Self> {
        let h = config.hidden_size;
        let get = |name: &str, len: usize| -> Result<Cow<'_, [f32]>> {
            let t = host.tensor(name).ok_or_else(|| EngineError::Unsupported(format!("weight {name} missing")))?;
            if t.len() != len {
                return Err(EngineError::Unsupported(format!("weight {name}: {} values, expected {len}", t.len())));
            }
            Ok(t)
        };
        let mats = |parts: &[(&str, usize)]| -> Result<DevBuf<u16>> {
            let total: usize = parts.iter().map(|p| p.1).sum();
            let mut bits = Vec::with_capacity(total);
            for (name, len) in parts {
                bits.extend(get(name, *len)?.iter().map(|&v| bf16::from_f32(v).to_bits()));
            }
            cuda.gpu.upload(&bits).map_err(gpu_err)
        };
        let vec32 = |name: &str, len: usize| -> Result<DevBuf<f32>> { cuda.gpu.upload(&get(name, len)?).map_err(gpu_err) };
        let (q, kv, inter) = (config.q_dim(), config.kv_dim(), config.intermediate_size);
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let qkv_bias = if config.attention_bias {
                let mut b = get(&format!("{p}.self_attn.q_proj.bias"), q)?.into_owned();
                b.extend_from_slice(&get(&format!("{p}.self_attn.k_proj.bias"), kv)?);
                b.extend_from_slice(&get(&format!("{p}.self_attn.v_proj.bias"), kv)?);
                Some(cuda.gpu.upload(&b).map_err(gpu_err)?)
            } else {
                None
            };
            layers.push(LayerWeights {
                input_norm: vec32(&format!("{p}.input_layernorm.weight"), h)?,
                qkv: mats(&[
                    (&format!("{p}.self_attn.q_proj.weight"), q * h),
                    (&format!("{p}.self_attn.k_proj.weight"), kv * h),
                    (&format!("{p}.self_attn.v_proj.weight"), kv * h),
                ])?,
                qkv_bias,
                o: mats(&[(&format!("{p}.self_attn.o_proj.weight"), h * q)])?,
                post_norm: vec32(&format!("{p}.post_attention_layernorm.weight"), h)?,
                gate_up: mats(&[(&format!("{p}.mlp.gate_proj.weight"), inter * h), (&format!("{p}.mlp.up_proj.weight"), inter * h)])?,
                down: mats(&[(&format!("{p}.mlp.down_proj.weight"), h * inter)])?,
            });
        }
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(mats(&[("lm_head.weight", config.vocab_size * h)])?)
        };
        Ok(GpuWeights {
            embed: mats(&[("model.embed_tokens.weight", config.vocab_size * h)])?,
            layers,
            final_norm: vec32("model.norm.weight", h)?,
            lm_head,
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

//! Per-step activation buffers on the device, and the packed plan metadata's staging.

use peregrine_kernels::ops::SAMPLE_PARAMS;
use peregrine_kernels::{Cuda, DevBuf};

use super::{gpu_err, PlanLayout};
use crate::config::ModelConfig;
use crate::Result;

/// Per-step activations, sized for `max_num_batched_tokens` tokens and `max_num_seqs` logit rows.
pub(super) struct Scratch {
    pub(super) residual: DevBuf<f32>,
    pub(super) normed: DevBuf<u16>,
    pub(super) qkv: DevBuf<u16>,
    pub(super) q: DevBuf<u16>,
    pub(super) attn: DevBuf<u16>,
    pub(super) delta: DevBuf<u16>,
    pub(super) gate_up: DevBuf<u16>,
    pub(super) act: DevBuf<u16>,
    pub(super) final_normed: DevBuf<u16>,
    pub(super) logits: DevBuf<f32>,
    pub(super) argmax: DevBuf<u32>,
    /// [`peregrine_kernels::ops::SAMPLE_PARAMS`] floats per logits row.
    pub(super) sample_params: DevBuf<f32>,
    pub(super) sample_params_host: Vec<f32>,
    pub(super) meta: DevBuf<i32>,
    pub(super) meta_host: Vec<i32>,
    pub(super) attn_partials: DevBuf<f32>,
    /// W8A8 models only (else one element each): the 8-bit codes of the activations the next linear
    /// reads (`t × max(hidden, q_dim, intermediate)` bytes) and one scale per token.
    pub(super) xq: DevBuf<u8>,
    pub(super) xs: DevBuf<f32>,
}

impl Scratch {
    pub(super) fn new(cuda: &Cuda, c: &ModelConfig, t: usize, layout: &PlanLayout, w8: bool) -> Result<Self> {
        let h = c.hidden_size;
        let r = layout.max_seqs;
        let a = |n: usize| cuda.gpu.alloc_zeros::<u16>(n).map_err(gpu_err);
        Ok(Scratch {
            residual: cuda.gpu.alloc_zeros::<f32>(t * h).map_err(gpu_err)?,
            normed: a(t * h)?,
            qkv: a(t * (c.q_dim() + 2 * c.kv_dim()))?,
            q: a(t * c.q_dim())?,
            attn: a(t * c.q_dim())?,
            delta: a(t * h)?,
            gate_up: a(t * 2 * c.intermediate_size)?,
            act: a(t * c.intermediate_size)?,
            final_normed: a(r * h)?,
            logits: cuda.gpu.alloc_zeros::<f32>(r * c.vocab_size).map_err(gpu_err)?,
            argmax: cuda.gpu.alloc_zeros::<u32>(r).map_err(gpu_err)?,
            sample_params: cuda.gpu.alloc_zeros::<f32>(r * SAMPLE_PARAMS).map_err(gpu_err)?,
            sample_params_host: vec![0.0; r * SAMPLE_PARAMS],
            meta: cuda.gpu.alloc_zeros::<i32>(layout.len()).map_err(gpu_err)?,
            meta_host: vec![0; layout.len()],
            attn_partials: cuda.gpu.alloc_zeros::<f32>(cuda.kernels.attention_partials_len()).map_err(gpu_err)?,
            xq: cuda.gpu.alloc_zeros::<u8>(if w8 { Self::xq_len(c, t) } else { 1 }).map_err(gpu_err)?,
            xs: cuda.gpu.alloc_zeros::<f32>(if w8 { t } else { 1 }).map_err(gpu_err)?,
        })
    }

    fn xq_len(c: &ModelConfig, t: usize) -> usize {
        t * c.hidden_size.max(c.q_dim()).max(c.intermediate_size)
    }

    pub(super) fn bytes(c: &ModelConfig, t: usize, layout: &PlanLayout, w8: bool) -> usize {
        let h = c.hidden_size;
        let bf = t * (h * 3 + c.q_dim() * 2 + c.q_dim() + 2 * c.kv_dim() + 3 * c.intermediate_size) + layout.max_seqs * h;
        let w8_bytes = if w8 { Self::xq_len(c, t) + t * 4 } else { 0 };
        bf * 2 + t * h * 4 + layout.max_seqs * (c.vocab_size * 4 + 4 + SAMPLE_PARAMS * 4) + layout.len() * 4 + w8_bytes
    }
}

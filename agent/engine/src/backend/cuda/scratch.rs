//! Per-step activation buffers on the device, and the packed plan metadata's staging.

use peregrine_kernels::ops::{packed_capacity, SAMPLE_PARAMS};
use peregrine_kernels::{Cuda, DevBuf};

use super::{gpu_err, PlanLayout};
use crate::config::ModelConfig;
use crate::sampling::MAX_LOGIT_BIAS;
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
    /// One step's token masks and logit biases packed for token_mask.cu (one upload per step),
    /// sized at start for every row masked with the most biases ([`Scratch::constraint_words`]).
    pub(super) constraints: DevBuf<u32>,
    pub(super) constraints_host: Vec<u32>,
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
            constraints: cuda.gpu.alloc_zeros::<u32>(Self::constraint_words(c, r)).map_err(gpu_err)?,
            constraints_host: Vec::new(),
            meta: cuda.gpu.alloc_zeros::<i32>(layout.len()).map_err(gpu_err)?,
            meta_host: vec![0; layout.len()],
            attn_partials: cuda.gpu.alloc_zeros::<f32>(cuda.kernels.attention_partials_len()).map_err(gpu_err)?,
            xq: cuda.gpu.alloc_zeros::<u8>(if w8 { Self::xq_len(c, t) } else { 1 }).map_err(gpu_err)?,
            xs: cuda.gpu.alloc_zeros::<f32>(if w8 { t } else { 1 }).map_err(gpu_err)?,
        })
    }

    /// The most words a step's packed constraints take: `rows` rows, each with a mask and
    /// [`MAX_LOGIT_BIAS`] biases (at batch 256 and a 128k vocabulary about 6 MB).
    pub(super) fn constraint_words(c: &ModelConfig, rows: usize) -> usize {
        packed_capacity(rows, c.vocab_size, MAX_LOGIT_BIAS)
    }

    fn xq_len(c: &ModelConfig, t: usize) -> usize {
        t * c.hidden_size.max(c.q_dim()).max(c.intermediate_size)
    }

    pub(super) fn bytes(c: &ModelConfig, t: usize, layout: &PlanLayout, w8: bool) -> usize {
        let h = c.hidden_size;
        let bf = t * (h * 3 + c.q_dim() * 2 + c.q_dim() + 2 * c.kv_dim() + 3 * c.intermediate_size) + layout.max_seqs * h;
        let w8_bytes = if w8 { Self::xq_len(c, t) + t * 4 } else { 0 };
        bf * 2 + t * h * 4 + layout.max_seqs * (c.vocab_size * 4 + 4 + SAMPLE_PARAMS * 4) + layout.len() * 4 + w8_bytes + Self::constraint_words(c, layout.max_seqs) * 4
    }
}

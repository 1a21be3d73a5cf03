//! Figures for `bench` on the CUDA backend: decode and prefill throughput, against the bound that
//! memory bandwidth puts on batch-1 decode. Benchmarks print figures; they assert nothing.

use std::time::Instant;

use super::CudaBackend;
use crate::backend::{Backend, SeqChunk, StepBatch};
use crate::config::{Architecture, Llama3RopeScaling, ModelConfig};
use crate::Result;

/// Llama-3.1-8B's shape (for `--load-format dummy` benchmarks).
pub fn llama31_8b() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 4096,
        intermediate_size: 14336,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        vocab_size: 128256,
        max_position_embeddings: 131072,
        rms_norm_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: Some(Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        }),
        tie_word_embeddings: false,
        attention_bias: false,
        bos_token_id: Some(128000),
        eos_token_ids: vec![128001, 128008, 128009],
    }
}

/// Bytes one decode step must read at least: every weight except the embedding table (only `batch`
/// rows of it are read).
pub fn decode_weight_bytes(backend: &CudaBackend) -> usize {
    let c = backend.config();
    let embed = c.vocab_size * c.hidden_size * 2;
    if c.tie_word_embeddings {
        backend.weight_bytes()
    } else {
        backend.weight_bytes() - embed
    }
}

#[derive(Debug, Clone)]
pub struct Figure {
    pub name: String,
    pub tokens: usize,
    pub seconds: f64,
    /// Fraction of the wall time the GPU had no step in flight (decode only).
    pub gpu_idle: Option<f64>,
}

impl Figure {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.seconds
    }
}

/// Sequential block tables: sequence `s` owns blocks `s*per .. (s+1)*per`.
fn table(s: usize, per: usize) -> Vec<u32> {
    ((s * per) as u32..((s + 1) * per) as u32).collect()
}

fn prompt_token(i: usize, vocab: usize) -> u32 {
    ((i * 7919 + 13) % vocab.min(30000)) as u32
}

/// Prefills `seqs` prompts of `len` tokens, as many per step as `max_tokens` allows, timing it all.
pub fn prefill(backend: &mut CudaBackend, seqs: usize, len: usize, max_tokens: usize) -> Result<Figure> {
    let bs = backend.kv_shape().block_size;
    let per = (len + 1).div_ceil(bs) + 1;
    let vocab = backend.config().vocab_size;
    let start = Instant::now();
    let mut s = 0;
    while s < seqs {
        let mut batch = StepBatch::default();
        while s < seqs && batch.tokens.len() + len <= max_tokens.max(len) {
            let begin = batch.tokens.len();
            for i in 0..len {
                batch.tokens.push(prompt_token(s * len + i, vocab));
                batch.positions.push(i as u32);
            }
            batch.seqs.push(SeqChunk { start: begin, len, context_len: 0, block_table: table(s, per), wants_logits: true, lora_slot: None });
            s += 1;
        }
        backend.forward_greedy(&batch)?;
    }
    Ok(Figure { name: format!("prefill {seqs} x {len}"), tokens: seqs * len, seconds: start.elapsed().as_secs_f64(), gpu_idle: None })
}

/// Time to first token: one prompt of `len` tokens, logits on the host (as a server would sample).
pub fn ttft(backend: &mut CudaBackend, len: usize) -> Result<f64> {
    let vocab = backend.config().vocab_size;
    let bs = backend.kv_shape().block_size;
    let batch = StepBatch {
        tokens: (0..len).map(|i| prompt_token(i, vocab)).collect(),
        positions: (0..len as u32).collect(),
        seqs: vec![SeqChunk { start: 0, len, context_len: 0, block_table: table(0, len.div_ceil(bs)), wants_logits: true, lora_slot: None }],
    };
    let start = Instant::now();
    backend.forward(&batch)?;
    Ok(start.elapsed().as_secs_f64())
}

/// Decode throughput: `batch` sequences with `prompt` tokens already prefilled, then `steps` greedy
/// steps of one token each (ids fed back from the GPU argmax). Only the decode steps are timed.
pub fn decode(backend: &mut CudaBackend, batch: usize, prompt: usize, steps: usize, max_tokens: usize) -> Result<Figure> {
    let bs = backend.kv_shape().block_size;
    let per = (prompt + steps + 1).div_ceil(bs);
    let vocab = backend.config().vocab_size;
    // Prefill, several prompts per step.
    let mut last = vec![0u32; batch];
    let mut s = 0;
    while s < batch {
        let mut b = StepBatch::default();
        let first = s;
        while s < batch && b.tokens.len() + prompt <= max_tokens.max(prompt) {
            let begin = b.tokens.len();
            for i in 0..prompt {
                b.tokens.push(prompt_token(s * prompt + i, vocab));
                b.positions.push(i as u32);
            }
            b.seqs.push(SeqChunk { start: begin, len: prompt, context_len: 0, block_table: table(s, per), wants_logits: true, lora_slot: None });
            s += 1;
        }
        let ids = backend.forward_greedy(&b)?;
        last[first..first + ids.len()].copy_from_slice(&ids);
    }
    let mut plan = StepBatch::default();
    backend.set_step_timing(true)?;
    let start = Instant::now();
    for step in 0..steps {
        let ctx = prompt + step;
        plan.tokens.clear();
        plan.positions.clear();
        plan.seqs.clear();
        for (s, &tok) in last.iter().enumerate() {
            plan.tokens.push(tok);
            plan.positions.push(ctx as u32);
            plan.seqs.push(SeqChunk { start: s, len: 1, context_len: ctx, block_table: table(s, per), wants_logits: true, lora_slot: None });
        }
        last = backend.forward_greedy(&plan)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let busy = backend.gpu_busy_seconds().unwrap_or(seconds);
    backend.set_step_timing(false)?;
    Ok(Figure {
        name: format!("decode batch {batch} (context {prompt}..{})", prompt + steps),
        tokens: batch * steps,
        seconds,
        gpu_idle: Some((1.0 - busy / seconds).max(0.0)),
    })
}

/// HBM bandwidth measured on this GPU (device-to-device copy, read + write), bytes/s.
pub fn hbm_bandwidth(backend: &CudaBackend) -> Result<f64> {
    backend.cuda.gpu.copy_bandwidth(2 << 30, 20).map_err(super::gpu_err)
}

//! Fake tensor parallelism on the CPU: a correctness tool, not a speed feature. The model is split
//! as [`crate::tp::TpPlan`] says into `N` rank backends, each holding only its slice of the weights
//! and its KV heads' share of the cache, and the ranks take turns on one thread pool. Between them
//! runs what NCCL would do on GPUs, on the host: an all-reduce (a sum in rank order, so every run
//! adds the same way) after the embedding, after o_proj and after down_proj, and a gather of the
//! vocabulary-split logits. It shows that a sharding reproduces the unsharded model before any GPU
//! code depends on it.
//!
//! What differs from one backend: each all-reduced sum adds `N` partial dot products instead of
//! one long one, so hidden states differ from TP=1 by float rounding (f32 reassociation); every
//! other value (q/k/v, attention per head, SwiGLU, each logit's dot product) is computed exactly
//! as one backend computes it from the same input. W8A8 weights (`--quantization`) quantize each
//! rank's activation slice with its own per-token scale, as row-parallel layers on GPUs do, so
//! they differ from TP=1 by that quantization's noise.

use std::sync::Arc;

use super::{check_step, logit_rows, ops, thread_pool, token_ctx, CpuBackend, Scratch};
use crate::backend::{Backend, KvCacheShape, Logits, StepBatch};
use crate::config::ModelConfig;
use crate::lora::LoraAdapter;
use crate::model::ModelWeights;
use crate::tp::{shard_adapter, shard_weights, Tensor, TpError, TpPlan};
use crate::{EngineError, Result};

fn config_error(e: TpError) -> EngineError {
    EngineError::InvalidConfig(e.to_string())
}

/// `N` CPU rank backends run as one tensor-parallel model.
pub struct CpuTpBackend {
    /// The whole model's shape (each rank holds `plan.local_config(&config)`).
    config: ModelConfig,
    plan: TpPlan,
    ranks: Vec<CpuBackend>,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
}

impl std::fmt::Debug for CpuTpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuTpBackend").field("size", &self.plan.size).field("ranks", &self.ranks).finish()
    }
}

impl CpuTpBackend {
    /// Shards `weights` over `size` ranks; every rank gets a KV cache of `kv`'s blocks for its KV
    /// heads. Errors name what `size` does not divide, or the tensor whose quantization blocks a
    /// split would cut. `threads == 0` uses every available core.
    pub fn new(weights: ModelWeights, kv: KvCacheShape, threads: usize, size: usize) -> Result<CpuTpBackend> {
        weights
            .validate()
            .map_err(|m| EngineError::Backend(format!("weights do not match the config: {m}")))?;
        let plan = TpPlan::new(&weights.config, size).map_err(config_error)?;
        let (pool, threads) = thread_pool(threads, "peregrine-cpu")?;
        let mut ranks = Vec::with_capacity(size);
        for rank in 0..size {
            let shard = shard_weights(&weights, &plan, rank).map_err(config_error)?;
            ranks.push(CpuBackend::with_pool(shard, kv, Arc::clone(&pool), threads)?);
        }
        Ok(CpuTpBackend { config: weights.config, plan, ranks, pool, threads })
    }

    pub fn size(&self) -> usize {
        self.plan.size
    }

    fn forward_inner(&mut self, batch: &StepBatch) -> Logits {
        let (hidden, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        let n = batch.tokens.len();
        let ctx = token_ctx(batch);
        let mut partials: Vec<Scratch> = self.ranks.iter().map(|r| Scratch::new(&r.config, n, r.rope.half())).collect();

        // Vocabulary-split embedding: the rank holding a token's row writes it, the others zeros.
        let mut h = vec![0f32; n * hidden];
        for ((rank, s), r) in self.ranks.iter().zip(&mut partials).zip(0..) {
            let vocab = self.plan.range(Tensor::Embed, r);
            for (row, &t) in s.proj.chunks_exact_mut(hidden).zip(&batch.tokens) {
                match (t as usize).checked_sub(vocab.start).filter(|&i| i < vocab.len()) {
                    Some(i) => rank.embed.row_into(i, row),
                    None => row.fill(0.0),
                }
            }
        }
        all_reduce_add(&partials, &mut h);

        // Norm weights are replicated: rank 0's serve for the (replicated) hidden state.
        let mut xn = vec![0f32; n * hidden];
        for li in 0..self.config.num_hidden_layers {
            ops::rms_norm(&h, &self.ranks[0].layers[li].attn_norm, eps, &mut xn);
            for (rank, s) in self.ranks.iter_mut().zip(&mut partials) {
                rank.attention_block(li, &xn, &ctx, s);
            }
            all_reduce_add(&partials, &mut h);
            ops::rms_norm(&h, &self.ranks[0].layers[li].mlp_norm, eps, &mut xn);
            for (rank, s) in self.ranks.iter_mut().zip(&mut partials) {
                rank.mlp_block(li, &xn, s);
            }
            all_reduce_add(&partials, &mut h);
        }

        // Vocabulary-split LM head: each rank's logits, gathered side by side per row.
        let rows = logit_rows(batch);
        let normed = self.ranks[0].final_norm(&h, &rows);
        let vocab = self.config.vocab_size;
        let mut data = vec![0f32; rows.len() * vocab];
        for (rank, r) in self.ranks.iter().zip(0..) {
            let cols = self.plan.range(Tensor::LmHead, r);
            let mut part = vec![0f32; rows.len() * cols.len()];
            rank.lm_head_into(&normed, rows.len(), &mut part);
            for (dst, src) in data.chunks_exact_mut(vocab).zip(part.chunks_exact(cols.len().max(1))) {
                dst[cols.clone()].copy_from_slice(src);
            }
        }
        Logits { vocab, data }
    }
}

/// The host all-reduce: adds every rank's partial (`proj`) to `h`, summing the partials in rank
/// order first (`((p0 + p1) + p2) + …`), so the result does not depend on timing and equals what
/// one backend adds when there is one rank.
fn all_reduce_add(partials: &[Scratch], h: &mut [f32]) {
    let Some((first, rest)) = partials.split_first() else { return };
    for (i, x) in h.iter_mut().enumerate() {
        let mut sum = first.proj[i];
        for p in rest {
            sum += p.proj[i];
        }
        *x += sum;
    }
}

impl Backend for CpuTpBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_shape(&self) -> KvCacheShape {
        self.ranks[0].kv.shape
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        let lora_enabled = self.ranks[0].lora.is_some();
        check_step(batch, self.config.vocab_size, self.kv_shape(), lora_enabled)?;
        for rank in &mut self.ranks {
            if let Some(lora) = &mut rank.lora {
                lora.begin_step(batch)?;
            }
        }
        if batch.tokens.is_empty() {
            return Ok(Logits { vocab: self.config.vocab_size, data: Vec::new() });
        }
        let pool = Arc::clone(&self.pool);
        Ok(pool.install(|| self.forward_inner(batch)))
    }

    fn name(&self) -> String {
        format!("cpu-fake-tp{}({} threads, {})", self.plan.size, self.threads, self.ranks[0].isa.name())
    }

    fn enable_lora(&mut self, max_loras: usize, max_rank: usize) -> Result<()> {
        for rank in &mut self.ranks {
            rank.enable_lora(max_loras, max_rank)?;
        }
        Ok(())
    }

    fn set_lora_slot(&mut self, slot: u32, adapter: &LoraAdapter) -> Result<()> {
        for (rank, r) in self.ranks.iter_mut().zip(0..) {
            let shard = shard_adapter(adapter, &self.plan, r).map_err(config_error)?;
            rank.set_lora_slot(slot, &shard)?;
        }
        Ok(())
    }
}

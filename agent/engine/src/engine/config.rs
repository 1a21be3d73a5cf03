//! Engine settings and their check against the model and backend they will drive.

use crate::backend::{BatchCapacity, KvCacheShape};
use crate::config::ModelConfig;
use crate::{EngineError, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Most sequences running at once (each takes one decode token per step).
    pub max_num_seqs: usize,
    /// Most tokens in one step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output). None: the model's own limit, capped to what the KV cache
    /// holds.
    pub max_model_len: Option<usize>,
    /// Tokens per KV block; must match the backend's cache.
    pub block_size: usize,
    pub enable_prefix_caching: bool,
    /// Admit a request only when the running ones' projected KV growth leaves room for it (see
    /// `scheduler`); false: admit whatever fits now and preempt when the cache runs out.
    pub kv_lookahead: bool,
    /// Seeds the RNG of requests that bring no seed of their own (mixed with the request id).
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            max_model_len: None,
            block_size: 16,
            enable_prefix_caching: true,
            kv_lookahead: true,
            seed: 0,
        }
    }
}

/// The limits the engine enforces, once resolved against model and backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedLimits {
    pub max_model_len: usize,
    /// Most sequences running at once: the most choices one request may have.
    pub max_num_seqs: usize,
    pub vocab_size: usize,
}

impl EngineConfig {
    /// Checks `max_num_seqs` and `max_num_batched_tokens` against what the backend can carry in
    /// one step. A refusal rather than a clamp: the backend's capacity comes from its own options,
    /// so a mismatch is a set-up error, and clamping would quietly serve less than configured.
    pub fn check_batch_capacity(&self, capacity: Option<BatchCapacity>) -> Result<()> {
        let Some(cap) = capacity else { return Ok(()) };
        if self.max_num_seqs > cap.max_seqs {
            return Err(EngineError::InvalidConfig(format!(
                "max_num_seqs ({}) exceeds the backend's batch capacity of {} sequences",
                self.max_num_seqs, cap.max_seqs
            )));
        }
        if self.max_num_batched_tokens > cap.max_tokens {
            return Err(EngineError::InvalidConfig(format!(
                "max_num_batched_tokens ({}) exceeds the backend's step capacity of {} tokens",
                self.max_num_batched_tokens, cap.max_tokens
            )));
        }
        Ok(())
    }

    pub fn resolve(&self, model: &ModelConfig, kv: KvCacheShape) -> Result<ResolvedLimits> {
        let bad = |m: String| Err(EngineError::InvalidConfig(m));
        if self.max_num_seqs == 0 || self.max_num_batched_tokens == 0 {
            return bad("max_num_seqs and max_num_batched_tokens must be at least 1".into());
        }
        // Every running sequence must get its decode token each step.
        if self.max_num_batched_tokens < self.max_num_seqs {
            return bad(format!(
                "max_num_batched_tokens ({}) must be >= max_num_seqs ({})",
                self.max_num_batched_tokens, self.max_num_seqs
            ));
        }
        if self.block_size == 0 || self.block_size != kv.block_size {
            return bad(format!(
                "block_size {} does not match the backend's KV cache block size {}",
                self.block_size, kv.block_size
            ));
        }
        // A sequence alone must always fit, or it could wait (or be preempted) forever.
        let kv_tokens = kv.num_blocks * kv.block_size;
        let max_model_len = match self.max_model_len {
            Some(0) => return bad("max_model_len must be at least 1".into()),
            Some(m) if m > model.max_position_embeddings => {
                return bad(format!(
                    "max_model_len {m} exceeds the model's max_position_embeddings {}",
                    model.max_position_embeddings
                ))
            }
            Some(m) if m > kv_tokens => {
                return bad(format!("max_model_len {m} exceeds the KV cache capacity of {kv_tokens} tokens"))
            }
            Some(m) => m,
            None => {
                let m = model.max_position_embeddings.min(kv_tokens);
                if m < model.max_position_embeddings {
                    tracing::warn!(
                        max_model_len = m,
                        model_max = model.max_position_embeddings,
                        "KV cache limits the context length"
                    );
                }
                m
            }
        };
        if max_model_len == 0 {
            return bad("the KV cache has no blocks".into());
        }
        Ok(ResolvedLimits { max_model_len, max_num_seqs: self.max_num_seqs, vocab_size: model.vocab_size })
    }
}

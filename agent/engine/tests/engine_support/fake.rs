//! A backend that behaves like attention where it matters to the engine: the "K/V" written for the
//! token at position p is a hash chained from the K/V at p-1 (read back through the block table)
//! and the token, so it depends on the whole history; logits are a function of the last position's
//! K/V. A wrong block table, a token lost or duplicated, a shared block overwritten, or a preemption
//! bug changes the chain and so the output; a slot holding the wrong position fails the step.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use peregrine_engine::backend::{Backend, BatchCapacity, KvCacheShape, Logits, StepBatch};
use peregrine_engine::config::{Architecture, ModelConfig};
use peregrine_engine::{EngineError, Result};

pub const VOCAB: usize = 128;
pub const EOS: u32 = 0;
/// A batch containing this token fails (to test error isolation); never sampled.
pub const POISON: u32 = VOCAB as u32 - 1;

#[derive(Debug, Default, Clone)]
pub struct FakeStats {
    pub steps: usize,
    pub max_batch_tokens: usize,
    pub max_batch_seqs: usize,
    pub chunks_without_logits: usize,
}

pub struct FakeBackend {
    config: ModelConfig,
    shape: KvCacheShape,
    /// (chained K/V hash, position) per physical slot.
    slots: Vec<Option<(u64, u32)>>,
    step_delay: Duration,
    /// What [`Backend::batch_capacity`] reports (None: no limit).
    pub batch_capacity: Option<BatchCapacity>,
    pub stats: Arc<Mutex<FakeStats>>,
}

pub fn model_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: 8,
        intermediate_size: 16,
        num_hidden_layers: 1,
        num_attention_heads: 1,
        num_key_value_heads: 1,
        head_dim: 8,
        vocab_size: VOCAB,
        max_position_embeddings: 4096,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        attention_bias: false,
        bos_token_id: None,
        eos_token_ids: vec![EOS],
    }
}

impl FakeBackend {
    pub fn new(shape: KvCacheShape) -> Self {
        FakeBackend {
            config: model_config(),
            shape,
            slots: vec![None; shape.num_blocks * shape.block_size],
            step_delay: Duration::ZERO,
            batch_capacity: None,
            stats: Arc::default(),
        }
    }

    pub fn with_step_delay(mut self, d: Duration) -> Self {
        self.step_delay = d;
        self
    }

    fn slot(&self, table: &[u32], pos: usize) -> Result<usize> {
        let bs = self.shape.block_size;
        let block = *table
            .get(pos / bs)
            .ok_or_else(|| EngineError::Backend(format!("block table does not cover position {pos}")))?;
        if block as usize >= self.shape.num_blocks {
            return Err(EngineError::Backend(format!("block {block} out of range")));
        }
        Ok(block as usize * bs + pos % bs)
    }

    fn read(&self, table: &[u32], pos: usize) -> Result<u64> {
        match self.slots[self.slot(table, pos)?] {
            Some((h, p)) if p as usize == pos => Ok(h),
            other => Err(EngineError::Backend(format!("KV slot for position {pos} holds {other:?}"))),
        }
    }
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const ROOT: u64 = 0x1234_5678;

fn chain(prev: u64, token: u32) -> u64 {
    mix(prev ^ token as u64)
}

/// Logits for a whole history, computed directly (the reference the engine must reproduce).
pub fn logits_for(history: &[u32]) -> Vec<f32> {
    logits_from(history.iter().fold(ROOT, |h, &t| chain(h, t)))
}

fn logits_from(h: u64) -> Vec<f32> {
    (0..VOCAB)
        .map(|j| {
            if j as u32 == POISON {
                return -1e9;
            }
            (mix(h ^ (j as u64).wrapping_mul(0xA24B_AED4_963E_E407)) % 1000) as f32 / 100.0
        })
        .collect()
}

impl Backend for FakeBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_shape(&self) -> KvCacheShape {
        self.shape
    }

    fn batch_capacity(&self) -> Option<BatchCapacity> {
        self.batch_capacity
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        if !self.step_delay.is_zero() {
            std::thread::sleep(self.step_delay);
        }
        if batch.tokens.contains(&POISON) {
            return Err(EngineError::Backend("poisoned batch".into()));
        }
        if batch.tokens.len() != batch.positions.len() {
            return Err(EngineError::Backend("tokens and positions differ in length".into()));
        }
        {
            let mut s = self.stats.lock();
            s.steps += 1;
            s.max_batch_tokens = s.max_batch_tokens.max(batch.num_tokens());
            s.max_batch_seqs = s.max_batch_seqs.max(batch.seqs.len());
            s.chunks_without_logits += batch.seqs.iter().filter(|c| !c.wants_logits).count();
        }
        // Each sequence writes its new positions in order; a sequence only ever reads its own table.
        let mut expected_start = 0;
        let mut data = Vec::new();
        for c in &batch.seqs {
            if c.start != expected_start || c.len == 0 {
                return Err(EngineError::Backend("chunks are not back to back".into()));
            }
            expected_start += c.len;
            if c.block_table.len() != (c.context_len + c.len).div_ceil(self.shape.block_size) {
                return Err(EngineError::Backend("block table does not match the context".into()));
            }
            for i in 0..c.len {
                let pos = c.context_len + i;
                if batch.positions[c.start + i] as usize != pos {
                    return Err(EngineError::Backend(format!("wrong position for token {i}")));
                }
                let prev = if pos == 0 { ROOT } else { self.read(&c.block_table, pos - 1)? };
                let slot = self.slot(&c.block_table, pos)?;
                self.slots[slot] = Some((chain(prev, batch.tokens[c.start + i]), pos as u32));
            }
            if c.wants_logits {
                data.extend(logits_from(self.read(&c.block_table, c.context_len + c.len - 1)?));
            }
        }
        Ok(Logits { vocab: VOCAB, data })
    }

    fn name(&self) -> String {
        "fake".into()
    }
}

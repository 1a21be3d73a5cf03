//! The paged KV cache in host memory: per layer, K and V as `[block][kv_head][slot][head_dim]` f32,
//! so one head's keys within a block are contiguous.

use crate::backend::KvCacheShape;
use crate::{EngineError, Result};

pub struct KvCache {
    pub shape: KvCacheShape,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `(k, v)` per layer.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvCache {
    pub fn new(shape: KvCacheShape, layers: usize, kv_heads: usize, head_dim: usize) -> Result<KvCache> {
        if shape.block_size == 0 {
            return Err(EngineError::Backend("KV block size must be at least 1".into()));
        }
        let per_layer = shape
            .num_blocks
            .checked_mul(kv_heads)
            .and_then(|x| x.checked_mul(shape.block_size))
            .and_then(|x| x.checked_mul(head_dim))
            .filter(|&x| x.checked_mul(4 * 2 * layers).is_some())
            .ok_or_else(|| EngineError::Backend(format!("KV cache of {} blocks is too large", shape.num_blocks)))?;
        // vec![0.0; n] maps zeroed pages lazily, so an unused pool costs no resident memory.
        let layers = (0..layers).map(|_| (vec![0f32; per_layer], vec![0f32; per_layer])).collect();
        Ok(KvCache { shape, kv_heads, head_dim, layers })
    }

    /// Element offset of `(block, kv_head, slot)`.
    #[inline]
    pub fn offset(&self, block: usize, kv_head: usize, slot: usize) -> usize {
        ((block * self.kv_heads + kv_head) * self.shape.block_size + slot) * self.head_dim
    }
}

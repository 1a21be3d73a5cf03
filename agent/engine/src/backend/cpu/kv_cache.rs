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
    pub fn new(
        shape: KvCacheShape,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<KvCache> {
        if shape.block_size == 0 {
            return Err(EngineError::Backend(
                "KV block size must be at least 1".into(),
            ));
        }
        let per_layer = shape
            .num_blocks
            .checked_mul(kv_heads)
            .and_then(|x| x.checked_mul(shape.block_size))
            .and_then(|x| x.checked_mul(head_dim))
            .filter(|&x| x.checked_mul(4 * 2 * layers).is_some())
            .ok_or_else(|| {
                EngineError::Backend(format!(
                    "KV cache of {} blocks is too large",
                    shape.num_blocks
                ))
            })?;
        // vec![0.0; n] maps zeroed pages lazily; every page is touched now so the process's
        // resident memory is, from the start, what it will be under load (a pod's memory limit can
        // be set from it instead of being hit hours later).
        let layers = (0..layers)
            .map(|_| {
                let (mut k, mut v) = (vec![0f32; per_layer], vec![0f32; per_layer]);
                touch_pages(&mut k);
                touch_pages(&mut v);
                (k, v)
            })
            .collect();
        Ok(KvCache {
            shape,
            kv_heads,
            head_dim,
            layers,
        })
    }

    /// Bytes of K and V over all layers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.len() + v.len()) * std::mem::size_of::<f32>()).sum()
    }

    /// Element offset of `(block, kv_head, slot)`.
    #[inline]
    pub fn offset(&self, block: usize, kv_head: usize, slot: usize) -> usize {
        ((block * self.kv_heads + kv_head) * self.shape.block_size + slot) * self.head_dim
    }
}

/// Writes one element per page so the kernel maps every page now. The value goes through
/// `black_box`: the memory is known to be zero, and a plain store of zero may be optimised away.
fn touch_pages(data: &mut [f32]) {
    const PAGE_ELEMENTS: usize = 4096 / std::mem::size_of::<f32>();
    for x in data.iter_mut().step_by(PAGE_ELEMENTS) {
        *x = std::hint::black_box(0.0);
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Resident set size from /proc/self/statm (pages × page size; 4 KiB pages assumed).
    fn rss_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        statm.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 4096
    }

    #[test]
    fn the_pool_is_resident_from_the_start() {
        // 2 layers × (K + V) × 1024 blocks × 4 heads × 16 slots × 64 dims × 4 B = 64 MiB.
        let shape = KvCacheShape { num_blocks: 1024, block_size: 16 };
        let before = rss_bytes();
        let cache = KvCache::new(shape, 2, 4, 64).unwrap();
        let grown = rss_bytes().saturating_sub(before);
        assert_eq!(cache.bytes(), 64 << 20);
        // Other tests in this process allocate and free meanwhile: a margin, not an exact figure.
        assert!(grown >= cache.bytes() * 3 / 4, "RSS grew {grown} bytes for a {} byte pool", cache.bytes());
    }
}

//! Content hashes of full KV blocks, chained so that a block's hash covers every token before it.

use xxhash_rust::xxh3::Xxh3;

/// 128 bits so that two different token chains colliding is not a practical concern (a collision
/// would silently share wrong KV).
pub type BlockHash = u128;

/// The LoRA adapter version a sequence runs (`lora::AdapterId`); `None` in a key is the base model.
/// Ids are never reused, so a replaced adapter's blocks are never matched again.
pub type AdapterKey = u64;

/// Hash of one full block: its parent's hash (None for the first block), the LoRA adapter (adapters
/// change K/V, so equal tokens under different adapters must not share a block) and its tokens.
pub fn block_hash(parent: Option<BlockHash>, adapter: Option<AdapterKey>, tokens: &[u32]) -> BlockHash {
    let mut h = Xxh3::new();
    match parent {
        Some(p) => {
            h.update(&[1]);
            h.update(&p.to_le_bytes());
        }
        None => h.update(&[0]),
    }
    match adapter {
        Some(id) => {
            h.update(&[1]);
            h.update(&id.to_le_bytes());
        }
        None => h.update(&[0]),
    }
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    h.digest128()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_parent_adapter_and_tokens() {
        let base = block_hash(None, None, &[1, 2, 3, 4]);
        assert_eq!(base, block_hash(None, None, &[1, 2, 3, 4]));
        assert_ne!(base, block_hash(None, None, &[1, 2, 3, 5]));
        assert_ne!(base, block_hash(Some(7), None, &[1, 2, 3, 4]));
        assert_ne!(base, block_hash(None, Some(1), &[1, 2, 3, 4]));
        assert_ne!(block_hash(None, Some(1), &[1]), block_hash(None, Some(2), &[1]));
    }
}

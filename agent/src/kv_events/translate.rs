//! The engine's prefix-cache events (keyed by its own 128-bit block hashes) → events keyed by the
//! routers' hashes ([`super::hash`]). Remembers the external hash of every block still cached, so
//! a stored block's parent and a removed block are named as the router knows them; bounded by the
//! number of KV blocks.

use std::collections::HashMap;

use peregrine_engine::kv::{BlockHash, KvEvent};

use super::hash::{block_hash, none_hash};
use super::wire::WireEvent;

#[derive(Debug)]
pub struct HashTranslator {
    root: u64,
    known: HashMap<BlockHash, u64>,
}

impl HashTranslator {
    pub fn new(seed: &str) -> Self {
        HashTranslator { root: none_hash(seed), known: HashMap::new() }
    }

    /// None when nothing of the event can be expressed (a removal of blocks never reported, or a
    /// chain whose parent is no longer cached anywhere, which a router could not match anyway).
    pub fn translate(&mut self, event: KvEvent, block_size: usize) -> Option<WireEvent> {
        match event {
            KvEvent::Stored { hashes, parent, tokens, adapter } => {
                let parent_ext = match parent {
                    None => None,
                    Some(p) => Some(*self.known.get(&p)?),
                };
                let mut prev = parent_ext.unwrap_or(self.root);
                let mut ext = Vec::with_capacity(hashes.len());
                for (internal, chunk) in hashes.iter().zip(tokens.chunks_exact(block_size.max(1))) {
                    prev = block_hash(prev, chunk, adapter);
                    self.known.insert(*internal, prev);
                    ext.push(prev);
                }
                Some(WireEvent::Stored { hashes: ext, parent: parent_ext, tokens, block_size, lora_id: adapter })
            }
            KvEvent::Removed { hashes } => {
                let ext: Vec<u64> = hashes.iter().filter_map(|h| self.known.remove(h)).collect();
                (!ext.is_empty()).then_some(WireEvent::Removed { hashes: ext })
            }
            KvEvent::AllCleared => {
                self.known.clear();
                Some(WireEvent::AllCleared)
            }
        }
    }

    pub fn cached_blocks(&self) -> usize {
        self.known.len()
    }
}

//! What the prefix cache tells the outside world: blocks registered (`Stored`) and dropped
//! (`Removed`), in the order they happened, for prefix-aware routers (vLLM's KV-cache events). The
//! block manager only records them when asked ([`super::BlockManager::enable_events`]); the engine
//! thread hands each step's batch to a channel without waiting, and everything else (external
//! hashes, encoding, sockets) happens on the receiving side.

use super::hash::{AdapterKey, BlockHash};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Consecutive full blocks of one chain, now reusable: `hashes[i]` holds
    /// `tokens[i*block_size..(i+1)*block_size]`; `parent` is the block before `hashes[0]` (None: the
    /// chain's first block).
    Stored { hashes: Vec<BlockHash>, parent: Option<BlockHash>, tokens: Vec<u32>, adapter: Option<AdapterKey> },
    /// Blocks no longer in the prefix cache (evicted to make room).
    Removed { hashes: Vec<BlockHash> },
    /// Everything cached before is gone.
    AllCleared,
}

/// One step's events, stamped when the step ended.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Unix seconds.
    pub ts: f64,
    pub block_size: usize,
    pub events: Vec<KvEvent>,
}

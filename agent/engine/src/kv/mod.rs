//! The paged KV cache's bookkeeping: which physical blocks each sequence owns, which are free, and
//! which full blocks are cached for reuse by later sequences with the same prefix.
//!
//! The manager never touches K/V data; the backend does, through the block tables handed out here.

mod block_manager;
mod events;
mod hash;

pub use block_manager::{BlockManager, SeqId};
pub use events::{KvEvent, KvEventBatch};
pub use hash::{block_hash, AdapterKey, BlockHash};

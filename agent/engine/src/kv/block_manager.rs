//! Block allocation with a prefix cache of full blocks.
//!
//! Every physical block is in exactly one of three states:
//! - in use: referenced by one or more sequences' block tables (`ref_count > 0`);
//! - free: unreferenced and holding nothing worth keeping;
//! - evictable: unreferenced but registered in the prefix cache; it can be reused by a later sequence
//!   with the same token chain, or taken (least recently freed first) when the free list is empty.
//!
//! Only full blocks whose K/V has been computed are registered, so a partially filled block is never
//! shared and no sequence ever reads a block another one is still writing.

use std::collections::{BTreeMap, HashMap};

use super::events::KvEvent;
use super::hash::{block_hash, AdapterKey, BlockHash};

/// The sequence a block table belongs to (the engine uses the request id).
pub type SeqId = u64;

#[derive(Debug, Default)]
struct SeqBlocks {
    blocks: Vec<u32>,
    /// Chain hashes of the sequence's first `hashes.len()` full, computed blocks.
    hashes: Vec<BlockHash>,
    adapter: Option<AdapterKey>,
}

#[derive(Debug)]
pub struct BlockManager {
    block_size: usize,
    num_blocks: usize,
    enable_prefix_caching: bool,
    ref_counts: Vec<u32>,
    /// The hash under which a block is registered in `cached`, if it is.
    registered: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    /// Unreferenced, unregistered blocks; handed out first so cached content lives longer.
    free: Vec<u32>,
    /// Unreferenced registered blocks by the tick they were freed at: first entry = least recent.
    evictable: BTreeMap<u64, u32>,
    evictable_tick: Vec<u64>,
    tick: u64,
    seqs: HashMap<SeqId, SeqBlocks>,
    /// Prefix-cache changes since the last `take_events`, when someone listens (None: not recorded).
    events: Option<Vec<KvEvent>>,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Self {
        BlockManager {
            block_size: block_size.max(1),
            num_blocks,
            enable_prefix_caching,
            ref_counts: vec![0; num_blocks],
            registered: vec![None; num_blocks],
            cached: HashMap::new(),
            // Reversed so that `pop` hands out block 0 first (easier to read in logs and tests).
            free: (0..num_blocks as u32).rev().collect(),
            evictable: BTreeMap::new(),
            evictable_tick: vec![0; num_blocks],
            tick: 0,
            seqs: HashMap::new(),
            events: None,
        }
    }

    /// From now on, record prefix-cache changes for [`BlockManager::take_events`]. Starts with
    /// `AllCleared` so a listener drops whatever it knew of blocks cached before.
    pub fn enable_events(&mut self) {
        self.events = Some(vec![KvEvent::AllCleared]);
    }

    /// The changes recorded since the last call (empty when not enabled).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn prefix_caching_enabled(&self) -> bool {
        self.enable_prefix_caching
    }

    /// Blocks that can be handed out now (free plus evictable cached ones).
    pub fn num_free_blocks(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks registered in the prefix cache (in use or evictable).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of blocks held by sequences (cached-but-unreferenced blocks count as free).
    pub fn usage_ratio(&self) -> f64 {
        if self.num_blocks == 0 {
            return 0.0;
        }
        1.0 - self.num_free_blocks() as f64 / self.num_blocks as f64
    }

    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    pub fn block_table(&self, seq: SeqId) -> Option<&[u32]> {
        self.seqs.get(&seq).map(|s| s.blocks.as_slice())
    }

    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
    }

    /// Cached blocks (with their chain hashes) that hold a prefix of `tokens`. At most the full
    /// blocks inside `tokens[..len-1]` qualify: the last token is always recomputed so that the
    /// step yields logits for it, and recomputing it must not write into a shared block.
    fn prefix_hits(&self, tokens: &[u32], adapter: Option<AdapterKey>) -> Vec<(u32, BlockHash)> {
        let mut hits = Vec::new();
        if !self.enable_prefix_caching || tokens.is_empty() {
            return hits;
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            let h = block_hash(parent, adapter, chunk);
            match self.cached.get(&h) {
                Some(&block) => hits.push((block, h)),
                None => break,
            }
            parent = Some(h);
        }
        hits
    }

    /// Number of leading tokens of `tokens` whose K/V the prefix cache already holds.
    pub fn cached_prefix_len(&self, tokens: &[u32], adapter: Option<AdapterKey>) -> usize {
        self.prefix_hits(tokens, adapter).len() * self.block_size
    }

    fn new_blocks_needed(&self, tokens: &[u32], hits: &[(u32, BlockHash)]) -> (usize, usize) {
        let needed = self.blocks_for(tokens.len()) - hits.len();
        // Reusing an evictable hit takes it out of the free count too.
        let evictable_hits = hits.iter().filter(|(b, _)| self.ref_counts[*b as usize] == 0).count();
        (needed, evictable_hits)
    }

    /// Whether `allocate` for these tokens would succeed now.
    pub fn can_allocate(&self, tokens: &[u32], adapter: Option<AdapterKey>) -> bool {
        let hits = self.prefix_hits(tokens, adapter);
        let (needed, evictable_hits) = self.new_blocks_needed(tokens, &hits);
        needed + evictable_hits <= self.num_free_blocks()
    }

    /// Blocks that `allocate` for these tokens would take out of the free pool (fresh blocks plus
    /// evictable prefix hits), which are also the blocks the sequence alone then holds. The
    /// scheduler's admission look-ahead weighs this before it allocates anything.
    pub fn allocation_cost(&self, tokens: &[u32], adapter: Option<AdapterKey>) -> usize {
        let hits = self.prefix_hits(tokens, adapter);
        let (needed, evictable_hits) = self.new_blocks_needed(tokens, &hits);
        needed + evictable_hits
    }

    /// Blocks a `fork` over `len` tokens takes from the pool once its parent has computed
    /// `parent_computed` of them: all but the shared full blocks (see [`BlockManager::fork`]).
    pub fn fork_cost(&self, len: usize, parent_computed: usize) -> usize {
        self.blocks_for(len) - parent_computed.min(len.saturating_sub(1)) / self.block_size
    }

    /// Blocks of `seq`'s table that no other sequence references: what ending it gives back.
    pub fn private_blocks(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.blocks.iter().filter(|&&b| self.ref_counts[b as usize] == 1).count())
    }

    /// Gives `seq` a block table covering all of `tokens`, reusing cached prefix blocks. Returns the
    /// number of leading tokens whose K/V is already there, or None (changing nothing) when there
    /// are not enough free blocks.
    pub fn allocate(&mut self, seq: SeqId, tokens: &[u32], adapter: Option<AdapterKey>) -> Option<usize> {
        let hits = self.prefix_hits(tokens, adapter);
        let (needed, evictable_hits) = self.new_blocks_needed(tokens, &hits);
        if needed + evictable_hits > self.num_free_blocks() {
            return None;
        }
        // A sequence is allocated once per admission; a stale table would leak its blocks.
        self.free(seq);
        let mut entry = SeqBlocks { adapter, ..Default::default() };
        for &(block, h) in &hits {
            self.take_ref(block);
            entry.blocks.push(block);
            entry.hashes.push(h);
        }
        for _ in 0..needed {
            // Cannot fail: counted above, and evicting never touches the hits we now reference.
            let block = self.pop_free_block()?;
            entry.blocks.push(block);
        }
        self.seqs.insert(seq, entry);
        Some(hits.len() * self.block_size)
    }

    /// Gives `child` a block table over `tokens` whose leading full blocks are `parent`'s, shared
    /// by reference count (`n > 1`: the prompt is prefilled once and its choices fork it), the
    /// rest fresh. Shared: the parent's blocks inside its first `parent_computed` tokens, at most
    /// the full blocks inside `tokens[..len-1]` (the last token is recomputed for its logits, so
    /// no one writes into a shared block: the partial last block is the child's own). The caller
    /// guarantees the child's tokens start with the parent's and use the same adapter. Returns the
    /// shared token count, or None (changing nothing) when the parent has no table or the pool is
    /// short. Works with the prefix cache off too.
    pub fn fork(&mut self, parent: SeqId, child: SeqId, tokens: &[u32], parent_computed: usize) -> Option<usize> {
        let from = self.seqs.get(&parent)?;
        let shared = (parent_computed.min(tokens.len().saturating_sub(1)) / self.block_size).min(from.blocks.len());
        let shared_blocks = from.blocks[..shared].to_vec();
        let hashes = from.hashes[..shared.min(from.hashes.len())].to_vec();
        let adapter = from.adapter;
        let needed = self.blocks_for(tokens.len()) - shared;
        if parent == child || needed > self.num_free_blocks() {
            return None;
        }
        self.free(child);
        for &b in &shared_blocks {
            self.take_ref(b);
        }
        let mut entry = SeqBlocks { blocks: shared_blocks, hashes, adapter };
        for _ in 0..needed {
            // Cannot fail: counted above; shared blocks are referenced, so never evicted.
            let block = self.pop_free_block()?;
            entry.blocks.push(block);
        }
        self.seqs.insert(child, entry);
        Some(shared * self.block_size)
    }

    /// Grows `seq`'s block table to cover `num_tokens` tokens. False (changing nothing) when the
    /// blocks are not there or the sequence has no table.
    pub fn append_slots(&mut self, seq: SeqId, num_tokens: usize) -> bool {
        let have = match self.seqs.get(&seq) {
            Some(s) => s.blocks.len(),
            None => return false,
        };
        let want = self.blocks_for(num_tokens);
        if want <= have {
            return true;
        }
        if want - have > self.num_free_blocks() {
            return false;
        }
        let mut new_blocks = Vec::with_capacity(want - have);
        for _ in have..want {
            match self.pop_free_block() {
                Some(b) => new_blocks.push(b),
                None => return false,
            }
        }
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.blocks.extend(new_blocks);
        }
        true
    }

    /// Registers in the prefix cache every full block of `seq` whose K/V is now computed
    /// (`tokens[..num_computed]` are in the cache). Call after each successful step.
    pub fn commit_computed(&mut self, seq: SeqId, tokens: &[u32], num_computed: usize) {
        if !self.enable_prefix_caching {
            return;
        }
        let Some(entry) = self.seqs.get_mut(&seq) else { return };
        let full = (num_computed.min(tokens.len()) / self.block_size).min(entry.blocks.len());
        // Newly registered consecutive blocks, reported as one `Stored` event per run.
        let mut run: Option<(Option<BlockHash>, Vec<BlockHash>, usize)> = None;
        for i in entry.hashes.len()..full {
            let chunk = &tokens[i * self.block_size..(i + 1) * self.block_size];
            let parent = entry.hashes.last().copied();
            let h = block_hash(parent, entry.adapter, chunk);
            entry.hashes.push(h);
            let block = entry.blocks[i];
            // Another sequence computed the same chain first: keep that copy registered and leave
            // ours private (it goes back to the free list when released).
            if self.registered[block as usize].is_none() && !self.cached.contains_key(&h) {
                self.cached.insert(h, block);
                self.registered[block as usize] = Some(h);
                if self.events.is_some() {
                    run.get_or_insert_with(|| (parent, Vec::new(), i)).1.push(h);
                }
            } else if let Some(done) = run.take() {
                Self::push_stored(&mut self.events, done, tokens, self.block_size, entry.adapter);
            }
        }
        if let Some(done) = run {
            Self::push_stored(&mut self.events, done, tokens, self.block_size, entry.adapter);
        }
    }

    fn push_stored(
        events: &mut Option<Vec<KvEvent>>,
        (parent, hashes, first): (Option<BlockHash>, Vec<BlockHash>, usize),
        tokens: &[u32],
        block_size: usize,
        adapter: Option<AdapterKey>,
    ) {
        if let Some(ev) = events {
            let tokens = tokens[first * block_size..(first + hashes.len()) * block_size].to_vec();
            ev.push(KvEvent::Stored { hashes, parent, tokens, adapter });
        }
    }

    /// Releases `seq`'s blocks. Registered blocks stay cached (evictable); the tail of a chain is
    /// released first so that it is also evicted first and the shareable head survives longest.
    pub fn free(&mut self, seq: SeqId) {
        let Some(entry) = self.seqs.remove(&seq) else { return };
        for &block in entry.blocks.iter().rev() {
            let b = block as usize;
            self.ref_counts[b] = self.ref_counts[b].saturating_sub(1);
            if self.ref_counts[b] > 0 {
                continue;
            }
            if self.registered[b].is_some() {
                self.tick += 1;
                self.evictable_tick[b] = self.tick;
                self.evictable.insert(self.tick, block);
            } else {
                self.free.push(block);
            }
        }
    }

    fn take_ref(&mut self, block: u32) {
        let b = block as usize;
        if self.ref_counts[b] == 0 && self.registered[b].is_some() {
            self.evictable.remove(&self.evictable_tick[b]);
        }
        self.ref_counts[b] += 1;
    }

    fn pop_free_block(&mut self) -> Option<u32> {
        let block = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                if let Some(h) = self.registered[b as usize].take() {
                    self.cached.remove(&h);
                    if let Some(ev) = &mut self.events {
                        // Consecutive evictions of one step share one event.
                        match ev.last_mut() {
                            Some(KvEvent::Removed { hashes }) => hashes.push(h),
                            _ => ev.push(KvEvent::Removed { hashes: vec![h] }),
                        }
                    }
                }
                b
            }
        };
        self.ref_counts[block as usize] = 1;
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn allocate_append_and_free_track_the_pool() {
        let mut m = BlockManager::new(8, 4, false);
        assert_eq!(m.allocate(1, &toks(0..6), None), Some(0));
        assert_eq!(m.block_table(1).map(|t| t.len()), Some(2));
        assert_eq!(m.num_free_blocks(), 6);
        assert!((m.usage_ratio() - 0.25).abs() < 1e-12);
        // Positions 6 and 7 fit in block 2 of the table; position 8 needs a third block.
        assert!(m.append_slots(1, 8));
        assert_eq!(m.block_table(1).map(|t| t.len()), Some(2));
        assert!(m.append_slots(1, 9));
        assert_eq!(m.block_table(1).map(|t| t.len()), Some(3));
        m.free(1);
        assert_eq!(m.num_free_blocks(), 8);
        assert_eq!(m.block_table(1), None);
        assert_eq!(m.usage_ratio(), 0.0);
    }

    #[test]
    fn costs_match_what_allocate_and_fork_take_and_private_blocks_what_free_gives_back() {
        let mut m = BlockManager::new(16, 4, true);
        let a = toks(0..10);
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 10);
        // Seq 1 holds 3 blocks of its own.
        assert_eq!(m.private_blocks(1), 3);
        // A second copy of the prompt reuses the 2 cached full blocks (in use: not from the pool).
        let before = m.num_free_blocks();
        assert_eq!(m.allocation_cost(&a, None), 1);
        m.allocate(2, &a, None);
        assert_eq!(before - m.num_free_blocks(), 1);
        assert_eq!((m.private_blocks(1), m.private_blocks(2)), (1, 1));
        // Evictable hits leave the pool too: free both, then allocate again.
        m.free(1);
        m.free(2);
        assert_eq!(m.allocation_cost(&a, None), 3);
        let before = m.num_free_blocks();
        m.allocate(3, &a, None);
        assert_eq!(before - m.num_free_blocks(), 3);
        // A fork shares the computed full blocks and takes the rest.
        assert_eq!(m.fork_cost(10, 10), 1);
        assert_eq!(m.fork_cost(10, 4), 2);
        let before = m.num_free_blocks();
        m.fork(3, 4, &a, 10);
        assert_eq!(before - m.num_free_blocks(), 1);
        assert_eq!((m.private_blocks(3), m.private_blocks(4), m.private_blocks(99)), (1, 1, 0));
    }

    #[test]
    fn allocation_fails_without_side_effects_when_pool_is_short() {
        let mut m = BlockManager::new(3, 4, false);
        assert_eq!(m.allocate(1, &toks(0..8), None), Some(0));
        assert!(!m.can_allocate(&toks(0..5), None));
        assert_eq!(m.allocate(2, &toks(0..5), None), None);
        assert_eq!(m.num_free_blocks(), 1);
        assert!(m.append_slots(1, 12));
        assert!(!m.append_slots(1, 13));
        assert_eq!(m.block_table(1).map(|t| t.len()), Some(3));
        assert!(!m.append_slots(99, 1));
    }

    #[test]
    fn prefix_blocks_are_shared_and_ref_counted() {
        let mut m = BlockManager::new(10, 4, true);
        let a = toks(0..10);
        assert_eq!(m.allocate(1, &a, None), Some(0));
        m.commit_computed(1, &a, 10);
        assert_eq!(m.num_cached_blocks(), 2, "two full blocks, the partial third is never cached");

        let mut b = toks(0..8);
        b.extend([100, 101, 102]);
        assert_eq!(m.allocate(2, &b, None), Some(8));
        let ta = m.block_table(1).unwrap().to_vec();
        let tb = m.block_table(2).unwrap().to_vec();
        assert_eq!(ta[..2], tb[..2]);
        assert_ne!(ta[2], tb[2], "the partial block is private");
        assert_eq!(m.ref_count(ta[0]), 2);
        assert_eq!(m.ref_count(ta[2]), 1);

        m.free(1);
        assert_eq!(m.ref_count(ta[0]), 1);
        m.free(2);
        assert_eq!(m.ref_count(ta[0]), 0);
        assert_eq!(m.num_free_blocks(), 10);
        assert_eq!(m.num_cached_blocks(), 2, "freed full blocks stay cached");
        // And are found again.
        assert_eq!(m.cached_prefix_len(&b, None), 8);
    }

    #[test]
    fn forks_share_the_parents_full_prompt_blocks_by_reference() {
        for caching in [false, true] {
            let mut m = BlockManager::new(16, 4, caching);
            let prompt = toks(0..10);
            assert_eq!(m.allocate(1, &prompt, None), Some(0));
            m.commit_computed(1, &prompt, 10);
            // Three choices fork the computed prompt: its two full blocks are shared, each has
            // its own copy of the partial third (recomputed, never written into a shared block).
            for child in 2..=4 {
                assert_eq!(m.fork(1, child, &prompt, 10), Some(8), "caching {caching}");
            }
            let parent = m.block_table(1).unwrap().to_vec();
            for child in 2..=4 {
                let t = m.block_table(child).unwrap();
                assert_eq!(t[..2], parent[..2]);
                assert!(!parent.contains(&t[2]));
            }
            assert_eq!((m.ref_count(parent[0]), m.ref_count(parent[1]), m.ref_count(parent[2])), (4, 4, 1));
            // 3 blocks for the parent + 1 private block per child, not 3 per child.
            assert_eq!(m.num_free_blocks(), 16 - 3 - 3);
            // A parent part-way through its prompt shares only what it has computed.
            assert_eq!(m.fork(1, 5, &prompt, 5), Some(4));
            // The shared blocks live on until the last holder goes.
            for seq in 1..=5 {
                m.free(seq);
            }
            assert_eq!(m.ref_count(parent[0]), 0);
            assert_eq!(m.num_free_blocks(), 16);
        }
        let mut m = BlockManager::new(4, 4, false);
        assert_eq!(m.allocate(1, &toks(0..12), None), Some(0));
        assert_eq!(m.allocate(5, &toks(0..4), None), Some(0));
        assert_eq!(m.fork(1, 2, &toks(0..12), 12), None, "its last block must be fresh, and none is left");
        assert_eq!(m.block_table(2), None);
        m.free(5);
        assert_eq!(m.fork(1, 2, &toks(0..12), 12), Some(8));
        assert_eq!(m.fork(9, 3, &toks(0..8), 8), None, "no parent");
    }

    #[test]
    fn partial_blocks_are_never_shared() {
        let mut m = BlockManager::new(10, 4, true);
        let a = toks(0..6);
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 6);
        assert_eq!(m.num_cached_blocks(), 1);
        // Same six tokens again: only the first full block is a hit.
        assert_eq!(m.allocate(2, &a, None), Some(4));
        assert_ne!(m.block_table(1).unwrap()[1], m.block_table(2).unwrap()[1]);
    }

    #[test]
    fn last_token_is_always_recomputed() {
        let mut m = BlockManager::new(10, 4, true);
        let a = toks(0..8);
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 8);
        assert_eq!(m.num_cached_blocks(), 2);
        // Both blocks are cached, but the second holds the last token, which must produce logits.
        assert_eq!(m.allocate(2, &a, None), Some(4));
        assert_ne!(m.block_table(1).unwrap()[1], m.block_table(2).unwrap()[1]);
    }

    #[test]
    fn only_computed_blocks_are_registered() {
        let mut m = BlockManager::new(10, 4, true);
        let a = toks(0..12);
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 5);
        assert_eq!(m.num_cached_blocks(), 1);
        assert_eq!(m.cached_prefix_len(&a, None), 4);
        m.commit_computed(1, &a, 12);
        assert_eq!(m.num_cached_blocks(), 3);
    }

    #[test]
    fn adapter_is_part_of_the_key() {
        let mut m = BlockManager::new(10, 4, true);
        let a = toks(0..9);
        m.allocate(1, &a, Some(7));
        m.commit_computed(1, &a, 9);
        assert_eq!(m.cached_prefix_len(&a, Some(7)), 8);
        assert_eq!(m.cached_prefix_len(&a, None), 0);
        assert_eq!(m.cached_prefix_len(&a, Some(8)), 0);
    }

    #[test]
    fn disabled_prefix_caching_never_hits() {
        let mut m = BlockManager::new(10, 4, false);
        let a = toks(0..9);
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 9);
        assert_eq!(m.num_cached_blocks(), 0);
        assert_eq!(m.allocate(2, &a, None), Some(0));
    }

    #[test]
    fn duplicate_chains_keep_the_first_copy() {
        let mut m = BlockManager::new(10, 4, true);
        let a = toks(0..5);
        // Both admitted before either computed anything: no sharing possible yet.
        m.allocate(1, &a, None);
        m.allocate(2, &a, None);
        m.commit_computed(1, &a, 5);
        m.commit_computed(2, &a, 5);
        assert_eq!(m.num_cached_blocks(), 1);
        let first = m.block_table(1).unwrap()[0];
        m.free(2);
        m.free(1);
        assert_eq!(m.allocate(3, &a, None), Some(4));
        assert_eq!(m.block_table(3).unwrap()[0], first);
    }

    #[test]
    fn evicts_least_recently_freed_and_prefers_free_blocks() {
        let mut m = BlockManager::new(4, 2, true);
        let a = vec![1, 2, 3];
        let b = vec![5, 6, 7];
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 3);
        m.allocate(2, &b, None);
        m.commit_computed(2, &b, 3);
        m.free(1); // a's block freed first: least recent
        m.free(2);
        assert_eq!(m.num_cached_blocks(), 2);
        assert_eq!(m.num_free_blocks(), 4);
        // Two fresh blocks come from the free list; nothing is evicted.
        m.allocate(3, &[9, 9, 9, 9], None);
        assert_eq!(m.num_cached_blocks(), 2);
        // One more block must evict: a's (least recently freed) goes, b's stays.
        m.allocate(4, &[8], None);
        assert_eq!(m.num_cached_blocks(), 1);
        assert_eq!(m.cached_prefix_len(&a, None), 0);
        assert_eq!(m.cached_prefix_len(&b, None), 2);
    }

    #[test]
    fn reusing_an_evictable_hit_counts_against_the_pool() {
        let mut m = BlockManager::new(3, 2, true);
        let a = vec![1, 2, 3];
        m.allocate(1, &a, None);
        m.commit_computed(1, &a, 3);
        m.free(1);
        // Hit (1 evictable block) + 1 new block = 2 of the 3 available.
        assert_eq!(m.allocate(2, &a, None), Some(2));
        assert_eq!(m.num_free_blocks(), 1);
        assert!(!m.can_allocate(&[4, 4, 4, 4, 4], None));
        // Only the shared head of the chain is a hit for a different continuation.
        m.free(2);
        let mut long = vec![1, 2];
        long.extend([7, 7, 7]);
        assert_eq!(m.allocate(3, &long, None), Some(2));
        assert_eq!(m.num_free_blocks(), 0);
    }

    #[test]
    fn events_report_registrations_and_evictions_in_order() {
        let mut m = BlockManager::new(4, 2, true);
        let a = vec![1, 2, 3, 4, 5];
        m.allocate(1, &a, Some(3));
        m.commit_computed(1, &a, 5);
        assert!(m.take_events().is_empty(), "nothing recorded until enabled");

        let mut m = BlockManager::new(4, 2, true);
        m.enable_events();
        m.allocate(1, &a, Some(3));
        m.commit_computed(1, &a, 3); // one full block computed
        m.commit_computed(1, &a, 5); // the second
        let h0 = block_hash(None, Some(3), &[1, 2]);
        let h1 = block_hash(Some(h0), Some(3), &[3, 4]);
        assert_eq!(
            m.take_events(),
            vec![
                KvEvent::AllCleared,
                KvEvent::Stored { hashes: vec![h0], parent: None, tokens: vec![1, 2], adapter: Some(3) },
                KvEvent::Stored { hashes: vec![h1], parent: Some(h0), tokens: vec![3, 4], adapter: Some(3) },
            ]
        );
        assert!(m.take_events().is_empty(), "taken once");

        // Blocks registered in one commit make one event.
        let b = vec![7, 8, 9, 10, 11, 12, 13];
        m.free(1);
        assert!(m.allocate(2, &b, None).is_some());
        m.commit_computed(2, &b, 7);
        let g0 = block_hash(None, None, &[7, 8]);
        let g1 = block_hash(Some(g0), None, &[9, 10]);
        let g2 = block_hash(Some(g1), None, &[11, 12]);
        // b takes all four blocks: the two free ones, then a's cached two, least recently freed
        // first (`free` releases a chain's tail first, so h1 goes before h0).
        assert_eq!(
            m.take_events(),
            vec![
                KvEvent::Removed { hashes: vec![h1, h0] },
                KvEvent::Stored { hashes: vec![g0, g1, g2], parent: None, tokens: (7..=12).collect(), adapter: None },
            ]
        );
    }
}

//! A sequence as the scheduler tracks it: its tokens and how many of them have K/V in the cache.

use std::time::Instant;

use crate::kv::SeqId;
use crate::lora::AdapterId;

#[derive(Debug, Clone)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt followed by every token generated so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Leading tokens whose K/V is in the cache. The rest are computed by upcoming steps.
    pub num_computed: usize,
    /// The LoRA adapter version this sequence is pinned to (`lora::AdapterId`, resolved once from
    /// the request's name on the engine thread; `None`: the base model). Its one identity: the
    /// scheduler keeps the running set within `max_loras` distinct versions, and it is the
    /// prefix-cache key (a version id is never reused, so a replaced adapter never shares the old
    /// KV). Which device slot holds it is decided per step and travels in `SeqChunk::lora_slot`.
    pub lora: Option<AdapterId>,
    pub arrival: Instant,
    /// Another choice of the same request (`n > 1`) whose prompt this one shares: it is admitted
    /// once that one has computed its prompt, and forks its full blocks instead of computing them.
    pub follows: Option<SeqId>,
    /// Length (prompt + output) at which the sequence ends at the latest: `max_tokens` or the
    /// context length reached. The admission look-ahead projects its KV growth up to it; None:
    /// unknown, no growth projected.
    pub max_len: Option<usize>,
    /// True once every token but the newest sampled one is computed: the sequence then takes one
    /// decode token per step. Reset by preemption (the recompute is a prefill again).
    pub(super) decoding: bool,
    /// Whether any step has scheduled this sequence yet (preemption does not reset it).
    pub(super) ever_scheduled: bool,
    /// Times preempted: a sequence is only chosen again once every running one has been chosen
    /// as often.
    pub(super) preemptions: u32,
    /// Order of first admission (kept across preemptions): among sequences preempted equally
    /// often, the newest is the victim.
    pub(super) rank: u64,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>) -> Self {
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            lora: None,
            arrival: Instant::now(),
            follows: None,
            max_len: None,
            decoding: false,
            ever_scheduled: false,
            preemptions: 0,
            rank: 0,
        }
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Times this sequence was preempted so far.
    pub fn preemptions(&self) -> u32 {
        self.preemptions
    }

    pub fn is_decoding(&self) -> bool {
        self.decoding
    }

    pub(super) fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }
}

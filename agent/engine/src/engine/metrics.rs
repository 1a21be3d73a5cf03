//! A snapshot of the engine's state and running totals, published after every step.

#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineMetrics {
    pub num_running: usize,
    pub num_waiting: usize,
    /// Fraction of KV blocks held by sequences (0..=1).
    pub kv_usage_ratio: f64,
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    /// Prompt tokens of requests admitted at least once.
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub preemptions_total: u64,
    /// Tokens whose K/V came from the prefix cache at admission (re-admissions included).
    pub prefix_cache_hit_tokens_total: u64,
    /// Tokens run through prefill chunks (recomputation after preemption included).
    pub prefill_tokens_computed_total: u64,
    pub steps_total: u64,
    pub requests_finished_total: u64,
    /// KV-event batches dropped because the subscriber fell behind.
    pub kv_event_batches_dropped_total: u64,
    /// The LoRA adapter cache (host memory and backend slots); None when LoRA is off.
    pub lora_cache: Option<crate::lora::AdapterCacheStats>,
}

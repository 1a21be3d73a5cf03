//! Names of the agent's Prometheus series that other programs read: the operator's autoscaler,
//! dashboards, alerts. Defined once, here, so the agent that exports them and the operator that
//! scrapes them cannot drift apart.
//!
//! Counters are registered under their base name; the text exposition adds `_total`, which is the
//! name a scraper sees (`*_TOTAL`).

/// Time from arrival to the first token (histogram).
pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "peregrine_time_to_first_token_seconds";
/// Time between consecutive output tokens (histogram).
pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "peregrine_time_per_output_token_seconds";
/// Time from arrival to the last token (histogram).
pub const E2E_REQUEST_LATENCY_SECONDS: &str = "peregrine_e2e_request_latency_seconds";
/// Time from arrival until first scheduled (histogram).
pub const QUEUE_TIME_SECONDS: &str = "peregrine_queue_time_seconds";
/// Requests being generated (gauge).
pub const NUM_REQUESTS_RUNNING: &str = "peregrine_num_requests_running";
/// Requests admitted but not yet scheduled (gauge).
pub const NUM_REQUESTS_WAITING: &str = "peregrine_num_requests_waiting";
/// Fraction of KV-cache blocks in use, 0–1 (gauge).
pub const KV_CACHE_USAGE_RATIO: &str = "peregrine_kv_cache_usage_ratio";
/// Sequences preempted because the KV cache ran out (counter).
pub const NUM_PREEMPTIONS: &str = "peregrine_num_preemptions";
/// Prompt tokens of finished requests (counter).
pub const PROMPT_TOKENS: &str = "peregrine_prompt_tokens";
pub const PROMPT_TOKENS_TOTAL: &str = "peregrine_prompt_tokens_total";
/// Generated tokens (counter).
pub const GENERATION_TOKENS: &str = "peregrine_generation_tokens";
pub const GENERATION_TOKENS_TOTAL: &str = "peregrine_generation_tokens_total";
/// Prompt tokens whose KV came from the prefix cache (counter).
pub const PREFIX_CACHE_HIT_TOKENS: &str = "peregrine_prefix_cache_hit_tokens";
/// Finished requests by finish reason (counter).
pub const REQUEST_SUCCESS: &str = "peregrine_request_success";
/// Requests refused or failed, by error code (counter).
pub const REQUEST_ERRORS: &str = "peregrine_request_errors";
/// Server-wide totals, without a `model` label (they survive adapter unloads).
pub const SERVER_NUM_REQUESTS_RUNNING: &str = "peregrine_server_num_requests_running";
pub const SERVER_NUM_REQUESTS_WAITING: &str = "peregrine_server_num_requests_waiting";
pub const SERVER_PROMPT_TOKENS: &str = "peregrine_server_prompt_tokens";
pub const SERVER_GENERATION_TOKENS: &str = "peregrine_server_generation_tokens";
pub const SERVER_REQUESTS_FINISHED: &str = "peregrine_server_requests_finished";
/// Bytes of the KV-cache pool (gauge; CPU backend).
pub const KV_CACHE_BYTES: &str = "peregrine_kv_cache_bytes";
/// Fraction of the model's weight bytes read, 0–1 (gauge): served from the moment the port is
/// bound, while `/ready` is still 503; 1 once loaded. The operator shows it in `Progressing`.
pub const LOAD_PROGRESS: &str = "peregrine_load_progress";
/// Bytes of LoRA adapter weights held in host memory (gauge; only with LoRA on).
pub const LORA_CACHE_BYTES: &str = "peregrine_lora_cache_bytes";
/// LoRA adapters whose weights are in host memory (gauge).
pub const LORA_CACHE_ADAPTERS: &str = "peregrine_lora_cache_adapters";
/// Backend LoRA slots holding an adapter (gauge), of [`LORA_SLOTS`].
pub const LORA_SLOTS_USED: &str = "peregrine_lora_slots_used";
/// Backend LoRA slots in all (`--max-loras`, gauge).
pub const LORA_SLOTS: &str = "peregrine_lora_slots";
/// 1 for each loaded adapter marked failed (its evicted weights can no longer be re-read; refused
/// with 503 until loaded again), labelled `model` (gauge).
pub const LORA_ADAPTER_FAILED: &str = "peregrine_lora_adapter_failed";
/// Resident memory of the agent process (gauge; Prometheus' conventional name).
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
/// HTTP connections being served (gauge).
pub const HTTP_CONNECTIONS_OPEN: &str = "peregrine_http_connections_open";
/// Connections refused at `--max-connections` (counter).
pub const HTTP_CONNECTIONS_REFUSED: &str = "peregrine_http_connections_refused";
pub const HTTP_CONNECTIONS_REFUSED_TOTAL: &str = "peregrine_http_connections_refused_total";

/// Every metric family the agent always exposes, as its `# TYPE` line names it (counters without
/// `_total`). [`KV_CACHE_BYTES`] and [`PROCESS_RESIDENT_MEMORY_BYTES`] are left out: they appear
/// only where the backend or the OS provides them. Dashboards and alerts may name these (and their
/// `_total`, `_bucket`, `_sum`, `_count` samples); a test scrapes the agent for each.
pub const FAMILIES: &[&str] = &[
    // Gauges.
    NUM_REQUESTS_WAITING,
    NUM_REQUESTS_RUNNING,
    KV_CACHE_USAGE_RATIO,
    SERVER_NUM_REQUESTS_WAITING,
    SERVER_NUM_REQUESTS_RUNNING,
    HTTP_CONNECTIONS_OPEN,
    vllm::NUM_REQUESTS_WAITING,
    vllm::NUM_REQUESTS_RUNNING,
    vllm::KV_CACHE_USAGE_PERC,
    vllm::GPU_CACHE_USAGE_PERC,
    vllm::CACHE_CONFIG_INFO,
    vllm::LORA_REQUESTS_INFO,
    // Histograms.
    QUEUE_TIME_SECONDS,
    TIME_TO_FIRST_TOKEN_SECONDS,
    TIME_PER_OUTPUT_TOKEN_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    vllm::REQUEST_QUEUE_TIME_SECONDS,
    vllm::TIME_TO_FIRST_TOKEN_SECONDS,
    vllm::TIME_PER_OUTPUT_TOKEN_SECONDS,
    vllm::E2E_REQUEST_LATENCY_SECONDS,
    // Counters.
    NUM_PREEMPTIONS,
    vllm::NUM_PREEMPTIONS,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    PREFIX_CACHE_HIT_TOKENS,
    REQUEST_SUCCESS,
    REQUEST_ERRORS,
    SERVER_PROMPT_TOKENS,
    SERVER_GENERATION_TOKENS,
    SERVER_REQUESTS_FINISHED,
    HTTP_CONNECTIONS_REFUSED,
    vllm::PROMPT_TOKENS,
    vllm::GENERATION_TOKENS,
    vllm::PREFIX_CACHE_QUERIES,
    vllm::PREFIX_CACHE_HITS,
];

/// Every series the operator's autoscaler reads from a pod, as exposed.
pub const AUTOSCALER_INPUTS: &[&str] = &[
    TIME_TO_FIRST_TOKEN_SECONDS,
    TIME_PER_OUTPUT_TOKEN_SECONDS,
    E2E_REQUEST_LATENCY_SECONDS,
    QUEUE_TIME_SECONDS,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE_RATIO,
    GENERATION_TOKENS_TOTAL,
    PROMPT_TOKENS_TOTAL,
];

/// vLLM's own series, served beside the `peregrine_*` ones so that inference gateways (the Gateway
/// API Inference Extension's endpoint picker, llm-d's scheduler, AIBrix) route to an agent as they
/// route to vLLM. Names, types, label names and bucket boundaries match vLLM's v1 engine,
/// `vllm/v1/metrics/loggers.py` of the v0.10 series (commit 005a810b); values keep vLLM's meaning:
/// every series carries `model_name` = the served (base) model name and `engine="0"`, adapters
/// appear only in [`vllm::LORA_REQUESTS_INFO`]'s labels.
pub mod vllm {
    /// Requests in the engine's running batch (gauge).
    pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
    /// Requests not yet scheduled (gauge).
    pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
    /// Fraction of KV-cache blocks in use, 0–1 despite the name (gauge).
    pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
    /// The same value under vLLM's older name, which gateways still read (gauge).
    pub const GPU_CACHE_USAGE_PERC: &str = "vllm:gpu_cache_usage_perc";
    /// Constant 1 with the cache configuration as labels (gauge used as an info metric).
    pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
    /// Unix time of the last change, with the adapters as labels (gauge). One series at a time.
    pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
    /// Histograms.
    pub const TIME_TO_FIRST_TOKEN_SECONDS: &str = "vllm:time_to_first_token_seconds";
    pub const TIME_PER_OUTPUT_TOKEN_SECONDS: &str = "vllm:time_per_output_token_seconds";
    pub const E2E_REQUEST_LATENCY_SECONDS: &str = "vllm:e2e_request_latency_seconds";
    pub const REQUEST_QUEUE_TIME_SECONDS: &str = "vllm:request_queue_time_seconds";
    /// Counters, registered under the base name; exposed with `_total`.
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens";
    pub const PROMPT_TOKENS_TOTAL: &str = "vllm:prompt_tokens_total";
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens";
    pub const GENERATION_TOKENS_TOTAL: &str = "vllm:generation_tokens_total";
    /// Prompt tokens looked up in the prefix cache (counter).
    pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries";
    pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "vllm:prefix_cache_queries_total";
    /// Prompt tokens found there (counter).
    pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits";
    pub const PREFIX_CACHE_HITS_TOTAL: &str = "vllm:prefix_cache_hits_total";
    /// Sequences preempted (recomputed later) because the KV cache ran out (counter).
    pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions";
    pub const NUM_PREEMPTIONS_TOTAL: &str = "vllm:num_preemptions_total";

    /// Label names.
    pub const LABEL_MODEL_NAME: &str = "model_name";
    pub const LABEL_ENGINE: &str = "engine";
    pub const LABEL_BLOCK_SIZE: &str = "block_size";
    pub const LABEL_NUM_GPU_BLOCKS: &str = "num_gpu_blocks";
    pub const LABEL_MAX_LORA: &str = "max_lora";
    pub const LABEL_RUNNING_LORA_ADAPTERS: &str = "running_lora_adapters";
    pub const LABEL_WAITING_LORA_ADAPTERS: &str = "waiting_lora_adapters";

    /// Bucket upper bounds (seconds), as vLLM declares them.
    pub const TIME_TO_FIRST_TOKEN_BUCKETS: &[f64] = &[
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0,
    ];
    pub const TIME_PER_OUTPUT_TOKEN_BUCKETS: &[f64] =
        &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
    /// End-to-end and queue time.
    pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
        1920.0, 7680.0,
    ];

    /// What the Gateway API Inference Extension's endpoint picker reads for vLLM pods (queue, KV
    /// usage, LoRA affinity), as exposed.
    pub const GATEWAY_INPUTS: &[&str] =
        &[NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, KV_CACHE_USAGE_PERC, GPU_CACHE_USAGE_PERC, LORA_REQUESTS_INFO];
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_counter_names_add_total() {
        assert_eq!(PROMPT_TOKENS_TOTAL, format!("{PROMPT_TOKENS}_total"));
        assert_eq!(GENERATION_TOKENS_TOTAL, format!("{GENERATION_TOKENS}_total"));
        assert_eq!(vllm::PROMPT_TOKENS_TOTAL, format!("{}_total", vllm::PROMPT_TOKENS));
        assert_eq!(vllm::GENERATION_TOKENS_TOTAL, format!("{}_total", vllm::GENERATION_TOKENS));
        assert_eq!(vllm::PREFIX_CACHE_QUERIES_TOTAL, format!("{}_total", vllm::PREFIX_CACHE_QUERIES));
        assert_eq!(vllm::PREFIX_CACHE_HITS_TOTAL, format!("{}_total", vllm::PREFIX_CACHE_HITS));
        assert_eq!(HTTP_CONNECTIONS_REFUSED_TOTAL, format!("{HTTP_CONNECTIONS_REFUSED}_total"));
    }
}

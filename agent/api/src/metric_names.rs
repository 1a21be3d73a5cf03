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
/// Resident memory of the agent process (gauge; Prometheus' conventional name).
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
/// HTTP connections being served (gauge).
pub const HTTP_CONNECTIONS_OPEN: &str = "peregrine_http_connections_open";
/// Connections refused at `--max-connections` (counter).
pub const HTTP_CONNECTIONS_REFUSED: &str = "peregrine_http_connections_refused";
pub const HTTP_CONNECTIONS_REFUSED_TOTAL: &str = "peregrine_http_connections_refused_total";

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposed_counter_names_add_total() {
        assert_eq!(PROMPT_TOKENS_TOTAL, format!("{PROMPT_TOKENS}_total"));
        assert_eq!(GENERATION_TOKENS_TOTAL, format!("{GENERATION_TOKENS}_total"));
        assert_eq!(HTTP_CONNECTIONS_REFUSED_TOTAL, format!("{HTTP_CONNECTIONS_REFUSED}_total"));
    }
}

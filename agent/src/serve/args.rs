//! `peregrine-agent serve` flags. Every flag has an env-var fallback (the operator passes flags).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Model to serve: a GGUF file or a Hugging Face folder.
    #[arg(long, env = "PEREGRINE_MODEL")]
    pub model: PathBuf,
    /// The model id clients use in `"model"` (default: the file or folder name without extension).
    #[arg(long, env = "PEREGRINE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    #[arg(long, env = "PEREGRINE_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, env = "PEREGRINE_PORT", default_value_t = 8000)]
    pub port: u16,

    // Engine.
    /// Context length (default: the model's).
    #[arg(long, env = "PEREGRINE_MAX_MODEL_LEN")]
    pub max_model_len: Option<usize>,
    #[arg(long, env = "PEREGRINE_MAX_NUM_SEQS", default_value_t = 32)]
    pub max_num_seqs: usize,
    #[arg(long, env = "PEREGRINE_MAX_NUM_BATCHED_TOKENS", default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    #[arg(long, env = "PEREGRINE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: usize,
    /// KV cache size in blocks (default: enough for max_num_seqs full-length sequences, capped).
    #[arg(long, env = "PEREGRINE_NUM_KV_BLOCKS")]
    pub num_kv_blocks: Option<usize>,
    #[arg(long, env = "PEREGRINE_DISABLE_PREFIX_CACHING")]
    pub disable_prefix_caching: bool,
    /// CPU backend threads (default: all cores).
    #[arg(long, env = "PEREGRINE_THREADS")]
    pub threads: Option<usize>,
    #[arg(long, env = "PEREGRINE_SEED", default_value_t = 0)]
    pub seed: u64,

    // Admission and limits.
    /// Requests allowed to wait (tokenizing or queued in the engine); more get 429.
    #[arg(long, env = "PEREGRINE_MAX_WAITING_REQUESTS", default_value_t = 256)]
    pub max_waiting_requests: usize,
    #[arg(long, env = "PEREGRINE_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,

    // Auth and tenants.
    /// Accepted API keys (`Authorization: Bearer KEY`); repeat or comma-separate.
    #[arg(long = "api-key", env = "PEREGRINE_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// A file of API keys, one per line: `KEY [rpm=N] [tpm=N]`; `#` starts a comment.
    #[arg(long, env = "PEREGRINE_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Default requests per minute per key (0: unlimited).
    #[arg(long, env = "PEREGRINE_RATE_LIMIT_RPM", default_value_t = 0)]
    pub rate_limit_rpm: u64,
    /// Default tokens (prompt + completion) per minute per key (0: unlimited).
    #[arg(long, env = "PEREGRINE_RATE_LIMIT_TPM", default_value_t = 0)]
    pub rate_limit_tpm: u64,

    // Lifecycle.
    /// After SIGTERM, how long to keep accepting while load balancers notice `/ready` is 503.
    #[arg(long, env = "PEREGRINE_DRAIN_DELAY", value_parser = parse_secs, default_value = "0")]
    pub drain_delay: Duration,
    /// After SIGTERM, how long in-flight requests may take before the process exits anyway.
    #[arg(long, env = "PEREGRINE_SHUTDOWN_GRACE_PERIOD", value_parser = parse_secs, default_value = "30")]
    pub shutdown_grace_period: Duration,

    // Telemetry.
    /// OTLP/HTTP endpoint for traces (e.g. http://otel-collector:4318); no export when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Log as JSON lines.
    #[arg(long, env = "PEREGRINE_LOG_JSON")]
    pub log_json: bool,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim_end_matches('s').parse().map_err(|e| format!("not a number of seconds: {e}"))?;
    if !(secs.is_finite() && secs >= 0.0) {
        return Err("seconds must be a non-negative number".into());
    }
    Ok(Duration::from_secs_f64(secs))
}

//! `peregrine-agent serve` flags. Every flag has an env-var fallback (the operator passes flags).

use std::net::IpAddr;
use std::path::PathBuf;

use super::connections::ConnectionLimits;
use super::tools::ToolParserArg;
use crate::runtime::{DeviceArg, EngineArgs};
use std::time::Duration;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The model id clients use in `"model"` (default: the file or folder name without extension).
    #[arg(long, env = "PEREGRINE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    #[arg(long, env = "PEREGRINE_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,
    #[arg(long, env = "PEREGRINE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Also serve the encoder endpoints over gRPC (`peregrine.encoder.v1.Encoder`) on this port,
    /// on the same host, keys and limits; off unless set. Encoder models only.
    #[arg(long, env = "PEREGRINE_GRPC_PORT")]
    pub grpc_port: Option<u16>,
    /// What to serve: `generate` (completions and chat) or `embed` (a decoder's last-token
    /// embeddings through the encoder endpoints). Default: an encoder folder's own task, else generate.
    #[arg(long, env = "PEREGRINE_TASK", value_enum)]
    pub task: Option<ServeTask>,
    /// Threads of the async runtime that runs HTTP, SSE and detokenizing (default: on the CPU
    /// backend, the cores its `--threads` leave free, at least 1; on a GPU, every core).
    #[arg(long, env = "PEREGRINE_HTTP_WORKERS")]
    pub http_workers: Option<usize>,

    // Admission and limits.
    /// Requests allowed to wait (tokenizing or queued in the engine); more get 429.
    #[arg(long, env = "PEREGRINE_MAX_WAITING_REQUESTS", default_value_t = 256)]
    pub max_waiting_requests: usize,
    /// Larger bodies get 413; a larger `Content-Length` is refused before the body is read.
    #[arg(long, env = "PEREGRINE_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Open connections served at once; beyond it a connection is answered 503 and closed.
    #[arg(long, env = "PEREGRINE_MAX_CONNECTIONS", default_value_t = 4096)]
    pub max_connections: usize,
    /// Seconds a client has to send a complete request head; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, env = "PEREGRINE_HEADER_READ_TIMEOUT", value_parser = parse_secs, default_value = "10")]
    pub header_read_timeout: Duration,
    /// Seconds a client has to send a complete request body once its head has arrived (else 408).
    #[arg(long, env = "PEREGRINE_BODY_READ_TIMEOUT", value_parser = parse_secs, default_value = "30")]
    pub body_read_timeout: Duration,

    // Auth and tenants.
    /// Accepted API keys (`Authorization: Bearer KEY`); repeat or comma-separate.
    #[arg(long = "api-key", env = "PEREGRINE_API_KEYS", value_delimiter = ',')]
    pub api_keys: Vec<String>,
    /// Keys for the adapter admin endpoints (load, unload, list); repeat or comma-separate. They are
    /// not tenant keys, and tenant keys get 403 there. With tenant keys but no admin key, adapter
    /// admin is closed.
    #[arg(long = "admin-api-key", env = "PEREGRINE_ADMIN_API_KEYS", value_delimiter = ',')]
    pub admin_api_keys: Vec<String>,
    /// Folders adapters may be loaded from at run time (repeatable; symlinks resolved). Without
    /// one, any path the process can read.
    #[arg(long = "lora-root", env = "PEREGRINE_LORA_ROOTS", value_delimiter = ',')]
    pub lora_roots: Vec<PathBuf>,
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
    /// Log lines as `text` (colours only on a terminal) or `json`.
    #[arg(long, env = "PEREGRINE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The same as `--log-format json` (kept: the operator passes it).
    #[arg(long, env = "PEREGRINE_LOG_JSON")]
    pub log_json: bool,
    /// How `tool_choice: auto` outputs are parsed into `tool_calls`: `auto` reads the chat
    /// template (`<tool_call>` → hermes, `<|python_tag|>` → llama3_json); `none` refuses `auto`.
    /// Forced calls (`required`, a named function) need no parser.
    #[arg(long, env = "PEREGRINE_TOOL_CALL_PARSER", value_enum, default_value_t = ToolParserArg::Auto)]
    pub tool_call_parser: ToolParserArg,
    /// KV-cache events for prefix-aware routers (off unless `--kv-events-endpoint`).
    #[command(flatten)]
    pub kv_events: crate::kv_events::KvEventsArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServeTask {
    Generate,
    Embed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

impl ServeArgs {
    pub fn json_logs(&self) -> bool {
        self.log_json || self.log_format == LogFormat::Json
    }

    pub fn connection_limits(&self) -> ConnectionLimits {
        ConnectionLimits {
            max_connections: self.max_connections.max(1),
            // hyper's timer needs a non-zero deadline; 0 means "as short as possible", not "none".
            header_read_timeout: self.header_read_timeout.max(Duration::from_millis(1)),
            body_read_timeout: self.body_read_timeout,
        }
    }

    /// `--http-workers` or its default. On the CPU backend every extra runnable thread takes its
    /// core from a matmul thread, and a fork-join step waits for its slowest thread, so one async
    /// worker per token wakes up (not one per core: tokio wakes a second to steal) and it only uses
    /// cores the engine leaves free.
    pub fn http_workers(&self, device: DeviceArg) -> usize {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let default = match device {
            DeviceArg::Cpu => cores.saturating_sub(self.engine.threads()),
            DeviceArg::Cuda => cores,
        };
        self.http_workers.unwrap_or(default).max(1)
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim_end_matches('s').parse().map_err(|e| format!("not a number of seconds: {e}"))?;
    if !(secs.is_finite() && secs >= 0.0) {
        return Err("seconds must be a non-negative number".into());
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(extra: &[&str]) -> ServeArgs {
        Cli::try_parse_from(["serve", "--model", "/m.gguf"].into_iter().chain(extra.iter().copied())).unwrap().serve
    }

    #[test]
    fn http_workers_leave_the_matmul_threads_their_cores() {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let all_cores = parse(&[]);
        assert_eq!(all_cores.http_workers(DeviceArg::Cpu), 1, "--threads defaults to every core");
        assert_eq!(all_cores.http_workers(DeviceArg::Cuda), cores);
        assert_eq!(parse(&["--threads", "1"]).http_workers(DeviceArg::Cpu), cores.saturating_sub(1).max(1));
        assert_eq!(parse(&["--http-workers", "3"]).http_workers(DeviceArg::Cpu), 3);
        assert_eq!(parse(&["--http-workers", "0"]).http_workers(DeviceArg::Cuda), 1);
    }

    #[test]
    fn task_and_grpc_port_are_off_unless_given() {
        let plain = parse(&[]);
        assert_eq!((plain.task, plain.grpc_port), (None, None));
        let embed = parse(&["--task", "embed", "--grpc-port", "50051"]);
        assert_eq!((embed.task, embed.grpc_port), (Some(ServeTask::Embed), Some(50051)));
        assert_eq!(parse(&["--task", "generate"]).task, Some(ServeTask::Generate));
        assert!(Cli::try_parse_from(["serve", "--model", "/m.gguf", "--task", "rerank"]).is_err());
    }

    #[test]
    fn log_format_flags() {
        assert!(!parse(&[]).json_logs());
        assert!(parse(&["--log-format", "json"]).json_logs());
        assert!(parse(&["--log-json"]).json_logs());
        assert!(!parse(&["--log-format", "text"]).json_logs());
        assert!(Cli::try_parse_from(["serve", "--model", "/m.gguf", "--log-format", "xml"]).is_err());
    }
}

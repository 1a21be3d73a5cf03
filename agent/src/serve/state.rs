//! Shared state of the HTTP server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::admission::Admission;
use super::adapter_roots::AdapterRoots;
use super::auth::KeyStore;
use super::connections::ConnectionLimits;
use super::backend::InferenceBackend;
use super::lifecycle::Lifecycle;
use super::metrics::Metrics;
use super::rate_limit::RateLimiter;
use super::tools::ToolCallFormat;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub max_body_bytes: usize,
    pub max_waiting_requests: usize,
    pub connections: ConnectionLimits,
    pub adapter_roots: AdapterRoots,
    /// The format `tool_choice: auto` outputs are parsed in (`--tool-call-parser`, resolved
    /// against the chat template); None: `auto` is refused.
    pub tool_call_format: Option<ToolCallFormat>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_body_bytes: 4 * 1024 * 1024, max_waiting_requests: 256, connections: ConnectionLimits::default(),
            adapter_roots: AdapterRoots::default(), tool_call_format: None,
        }
    }
}

pub struct AppState<B> {
    pub backend: Arc<B>,
    pub metrics: Metrics,
    pub keys: KeyStore,
    pub limiter: RateLimiter,
    pub admission: Admission,
    pub lifecycle: Lifecycle,
    pub config: ServerConfig,
    next_id: AtomicU64,
    /// Unix seconds at start, for `/v1/models` `created`.
    pub started: u64,
}

impl<B: InferenceBackend> AppState<B> {
    pub fn new(backend: Arc<B>, keys: KeyStore, config: ServerConfig) -> Self {
        let stats_backend = backend.clone();
        let metrics = Metrics::new(backend.model_name(), backend.engine_shape(), move || stats_backend.stats());
        AppState {
            metrics,
            keys,
            limiter: RateLimiter::default(),
            admission: Admission::new(config.max_waiting_requests),
            lifecycle: Lifecycle::default(),
            next_id: AtomicU64::new(1),
            started: unix_now(),
            config,
            backend,
        }
    }

    pub fn next_request_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

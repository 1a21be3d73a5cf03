//! The engine thread and its handle. One thread owns the backend, the KV block manager, the
//! scheduler and the per-request samplers; callers talk to it only through channels.

mod config;
mod generate;
mod handle;
mod metrics;
mod worker;

use std::sync::Arc;

use parking_lot::Mutex;

pub use config::{EngineConfig, ResolvedLimits};
pub use generate::{generate_blocking, GenerationOutput};
pub use handle::{EngineHandle, RequestStream};
pub use metrics::EngineMetrics;

use crate::backend::Backend;
use crate::kv::BlockManager;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::{EngineError, Result};

pub struct Engine;

impl Engine {
    /// Checks the config against the backend and starts the engine thread.
    pub fn start(backend: Box<dyn Backend>, config: EngineConfig) -> Result<EngineHandle> {
        let kv_shape = backend.kv_shape();
        let limits = config.resolve(backend.config(), kv_shape)?;
        let scheduler = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
            },
            BlockManager::new(kv_shape.num_blocks, kv_shape.block_size, config.enable_prefix_caching),
        );
        let (tx, rx) = crossbeam_channel::unbounded();
        let metrics = Arc::new(Mutex::new(EngineMetrics::default()));
        tracing::info!(
            backend = backend.name(),
            num_blocks = kv_shape.num_blocks,
            block_size = kv_shape.block_size,
            max_model_len = limits.max_model_len,
            "starting engine"
        );
        let worker = worker::Worker::new(backend, scheduler, rx, metrics.clone(), limits, config.seed);
        let thread = std::thread::Builder::new()
            .name("peregrine-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Backend(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle::new(tx, metrics, limits, thread))
    }
}

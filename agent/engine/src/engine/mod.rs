//! The engine thread and its handle. One thread owns the backend, the KV block manager, the
//! scheduler and the per-request samplers; callers talk to it only through channels.

mod command;
mod config;
mod generate;
mod handle;
mod lora;
mod metrics;
mod outbox;
mod step_profile;
mod worker;

use std::sync::Arc;

use parking_lot::Mutex;

pub use config::{EngineConfig, ResolvedLimits};
pub use generate::{generate_blocking, GenerationOutput};
pub use handle::{EngineHandle, RequestStream};
pub use metrics::EngineMetrics;

use crate::backend::Backend;
use crate::kv::BlockManager;
use crate::lora::LoraConfig;
use crate::model::rotate::AdapterRotation;
use crate::scheduler::{Scheduler, SchedulerConfig};
use crate::{EngineError, Result};

pub struct Engine;

impl Engine {
    /// Checks the config against the backend and starts the engine thread.
    pub fn start(backend: Box<dyn Backend>, config: EngineConfig) -> Result<EngineHandle> {
        Engine::start_inner(backend, config, None, None)
    }

    /// Like [`Engine::start`], with multi-LoRA serving: the backend gets `lora.max_loras` slots
    /// of rank up to `lora.max_lora_rank`; adapters are managed through
    /// [`EngineHandle::load_adapter`], [`EngineHandle::unload_adapter`] and
    /// [`EngineHandle::list_adapters`].
    pub fn start_with_lora(backend: Box<dyn Backend>, config: EngineConfig, lora: LoraConfig) -> Result<EngineHandle> {
        Engine::start_inner(backend, config, Some(lora), None)
    }

    /// [`Engine::start_with_lora`] over a model whose residual stream was rotated
    /// (`model::rotate::rotate_residual_stream`): every adapter is rotated the same way as it is
    /// read, loads and re-reads alike.
    pub fn start_with_lora_rotated(backend: Box<dyn Backend>, config: EngineConfig, lora: LoraConfig, rotation: Arc<AdapterRotation>) -> Result<EngineHandle> {
        Engine::start_inner(backend, config, Some(lora), Some(rotation))
    }

    fn start_inner(mut backend: Box<dyn Backend>, config: EngineConfig, lora: Option<LoraConfig>, rotation: Option<Arc<AdapterRotation>>) -> Result<EngineHandle> {
        let kv_shape = backend.kv_shape();
        let limits = config.resolve(backend.config(), kv_shape)?;
        config.check_batch_capacity(backend.batch_capacity())?;
        if let Some(l) = &lora {
            if l.max_loras == 0 || l.max_lora_rank == 0 || l.max_cpu_loras == 0 {
                return Err(EngineError::InvalidConfig("max_loras, max_lora_rank and max_cpu_loras must be at least 1".into()));
            }
            backend.enable_lora(l.max_loras, l.max_lora_rank)?;
        }
        let mut scheduler = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: config.max_num_seqs,
                max_num_batched_tokens: config.max_num_batched_tokens,
                lookahead: config.kv_lookahead,
            },
            BlockManager::new(kv_shape.num_blocks, kv_shape.block_size, config.enable_prefix_caching),
        );
        if let Some(l) = &lora {
            scheduler.set_max_loras(l.max_loras);
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let handle_lora = lora.map(|config| lora::HandleLora {
            model: backend.config().clone(),
            config,
            rotation,
            names: lora::AdapterNames::default(),
            failed: lora::AdapterNames::default(),
        });
        let engine_lora = handle_lora
            .as_ref()
            .map(|h| lora::EngineLora::new(h.model.clone(), h.config, h.rotation.clone(), (h.names.clone(), h.failed.clone()), tx.clone()));
        let metrics = Arc::new(Mutex::new(EngineMetrics::default()));
        tracing::info!(
            backend = backend.name(),
            num_blocks = kv_shape.num_blocks,
            block_size = kv_shape.block_size,
            max_model_len = limits.max_model_len,
            "starting engine"
        );
        let worker = worker::Worker::new(backend, scheduler, rx, metrics.clone(), limits, config.seed, engine_lora);
        let thread = std::thread::Builder::new()
            .name("peregrine-engine".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Backend(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle::new(tx, metrics, limits, thread, handle_lora))
    }
}

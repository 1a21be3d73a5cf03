//! The engine thread's LoRA state: the adapter registry, requests parked while their adapter's
//! weights are re-read from disk, and the per-step slot assignment. File parsing never happens on
//! the engine thread: admin loads are parsed by the caller ([`super::EngineHandle::load_adapter`]),
//! reloads after a host-memory eviction by a short-lived loader thread that reports back over the
//! command channel.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crossbeam_channel::Sender;
use parking_lot::RwLock;

use super::command::Command;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::model::rotate::AdapterRotation;
use crate::lora::{AdapterCacheStats, AdapterId, AdapterInfo, LoadOutcome, LoraAdapter, LoraConfig, LoraRegistry};
use crate::request::RequestId;
use crate::scheduler::{Scheduler, SchedulerOutput, Sequence};
use crate::{EngineError, Result};

/// Reads the adapter in `source` and, over a rotated model, rotates it to match.
pub(super) fn load_rotated(source: &Path, model: &ModelConfig, max_rank: usize, rotation: Option<&AdapterRotation>) -> Result<LoraAdapter> {
    let mut adapter = LoraAdapter::load(source, model, max_rank)?;
    if let Some(r) = rotation {
        r.rotate(&mut adapter)?;
    }
    Ok(adapter)
}

/// Names that requests may use right now, shared with the handles so `submit` can refuse an
/// unknown adapter at once (the engine thread re-checks, since an unload may race).
pub(super) type AdapterNames = Arc<RwLock<HashSet<String>>>;

/// What the handles need to parse adapters off the engine thread and check names.
#[derive(Clone)]
pub(super) struct HandleLora {
    pub model: ModelConfig,
    pub config: LoraConfig,
    /// The model's residual-stream rotation, applied to every adapter as it is read.
    pub rotation: Option<Arc<AdapterRotation>>,
    pub names: AdapterNames,
    /// Names whose evicted weights could not be re-read (refused with `AdapterUnavailable` until
    /// loaded again). Written by the engine thread before it fails the requests that waited.
    pub failed: AdapterNames,
}

pub(super) struct EngineLora {
    registry: LoraRegistry,
    model: ModelConfig,
    rotation: Option<Arc<AdapterRotation>>,
    names: AdapterNames,
    failed: AdapterNames,
    /// To report reloads back to the engine thread.
    commands: Sender<Command>,
    /// Versions being re-read from disk, with the sequences waiting for them.
    parked: HashMap<AdapterId, Vec<Sequence>>,
}

/// Where a new request's sequence goes.
pub(super) enum Placement {
    /// Weights are in memory: schedule it.
    Ready(Sequence),
    /// Waiting for its adapter to be re-read.
    Parked,
}

impl EngineLora {
    pub(super) fn new(
        model: ModelConfig,
        config: LoraConfig,
        rotation: Option<Arc<AdapterRotation>>,
        (names, failed): (AdapterNames, AdapterNames),
        commands: Sender<Command>,
    ) -> Self {
        EngineLora {
            registry: LoraRegistry::new(config),
            model,
            rotation,
            names,
            failed,
            commands,
            parked: HashMap::new(),
        }
    }

    /// Pins the adapter `name` for a new sequence and tags the sequence with its version (slot
    /// admission and the prefix-cache key, so a replaced adapter never reuses the old KV).
    pub(super) fn pin(&mut self, seq: &mut Sequence, name: &str) -> Result<AdapterId> {
        let id = self.registry.acquire(name)?;
        seq.lora = Some(id);
        Ok(id)
    }

    /// Schedules the sequence now, or parks it and starts re-reading evicted weights.
    pub(super) fn place(&mut self, seq: Sequence, id: AdapterId) -> Placement {
        let Some(source) = self.registry.reload_source(id) else {
            return Placement::Ready(seq);
        };
        let waiting = self.parked.entry(id).or_default();
        let first = waiting.is_empty();
        waiting.push(seq);
        if first {
            let (model, max_rank, commands, rotation) = (
                self.model.clone(),
                self.registry.config().max_lora_rank,
                self.commands.clone(),
                self.rotation.clone(),
            );
            let spawned = std::thread::Builder::new()
                .name("peregrine-lora-load".into())
                .spawn(move || {
                    let t0 = std::time::Instant::now();
                    tracing::info!(adapter_version = id, "re-reading an evicted LoRA adapter");
                    let result = load_rotated(&source, &model, max_rank, rotation.as_deref()).map(Arc::new);
                    if let Ok(adapter) = &result {
                        let ms = t0.elapsed().as_secs_f64() * 1e3;
                        tracing::info!(adapter_version = id, bytes = adapter.size_bytes(), ms = format_args!("{ms:.1}"), "LoRA adapter re-read");
                    }
                    let _ = commands.send(Command::AdapterReloaded { id, result });
                });
            if let Err(e) = spawned {
                let err =
                    EngineError::Backend(format!("cannot start an adapter loader thread: {e}"));
                let _ = self.commands.send(Command::AdapterReloaded {
                    id,
                    result: Err(err),
                });
            }
        }
        Placement::Parked
    }

    /// A reload finished: the parked sequences to schedule, or to fail with the error. A failed
    /// reload marks the adapter failed (listed so, refused until an admin load) before the waiting
    /// requests hear of it, so their error can name the adapter as unavailable.
    pub(super) fn reloaded(
        &mut self,
        id: AdapterId,
        result: Result<Arc<LoraAdapter>>,
    ) -> std::result::Result<Vec<Sequence>, (Vec<Sequence>, String)> {
        let waiting = self.parked.remove(&id).unwrap_or_default();
        match result {
            Ok(adapter) => {
                self.registry.restore(id, adapter);
                Ok(waiting)
            }
            Err(e) => {
                // The path stays in the server's log; clients get the adapter's name only.
                tracing::warn!(adapter_version = id, error = %e, "an evicted LoRA adapter cannot be re-read; marked failed until it is loaded again");
                if let Some(name) = self.registry.mark_failed(id) {
                    self.failed.write().insert(name.clone());
                    return Err((waiting, EngineError::AdapterUnavailable(name).to_string()));
                }
                Err((waiting, format!("cannot reload the adapter: {e}")))
            }
        }
    }

    /// What the adapter cache holds now (for metrics).
    pub(super) fn cache_stats(&self) -> AdapterCacheStats {
        self.registry.cache_stats()
    }

    /// Drops a parked sequence (aborted before its adapter came back).
    pub(super) fn unpark(&mut self, request: RequestId) {
        for seqs in self.parked.values_mut() {
            seqs.retain(|s| s.id != request);
        }
    }

    pub(super) fn release(&mut self, id: AdapterId) {
        self.registry.release(id);
    }

    /// Gives this step's adapters slots, writes new ones into the backend and stamps each
    /// sequence's slot into the batch.
    pub(super) fn prepare_step(
        &mut self,
        scheduler: &Scheduler,
        out: &mut SchedulerOutput,
        backend: &mut dyn Backend,
    ) -> Result<()> {
        let ids: Vec<Option<AdapterId>> = out
            .chunks
            .iter()
            .map(|c| scheduler.get(c.id).and_then(|s| s.lora))
            .collect();
        if ids.iter().all(Option::is_none) {
            return Ok(());
        }
        if out.batch.seqs.len() != out.chunks.len() {
            return Err(EngineError::Backend(
                "step batch and chunks disagree".into(),
            ));
        }
        let step_ids: Vec<AdapterId> = ids.iter().flatten().copied().collect();
        let assignment = self.registry.assign_slots(&step_ids)?;
        for (slot, adapter) in &assignment.loads {
            backend.set_lora_slot(*slot, adapter)?;
        }
        for (seq, id) in out.batch.seqs.iter_mut().zip(&ids) {
            seq.lora_slot = id.and_then(|id| assignment.slot_of.get(&id).copied());
        }
        Ok(())
    }

    pub(super) fn install(
        &mut self,
        name: &str,
        source: &Path,
        adapter: Arc<LoraAdapter>,
    ) -> (LoadOutcome, AdapterInfo) {
        let result = self.registry.install(name, source, adapter);
        self.names.write().insert(name.to_string());
        // Loaded again (same or another source): servable once more.
        self.failed.write().remove(name);
        result
    }

    pub(super) fn unload(&mut self, name: &str) -> Result<AdapterInfo> {
        let info = self.registry.unload(name)?;
        self.names.write().remove(name);
        self.failed.write().remove(name);
        Ok(info)
    }

    pub(super) fn list(&self) -> Vec<AdapterInfo> {
        self.registry.list()
    }
}

/// Checks an adapter name given to `load_adapter` (it becomes a metrics label and a URL segment).
pub(super) fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 256
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/'));
    if ok {
        Ok(())
    } else {
        Err(EngineError::InvalidRequest(format!(
            "adapter name {name:?} must be 1-256 characters of A-Z a-z 0-9 - _ . : /"
        )))
    }
}

/// The canonical form of an adapter source, so `./a` and `/abs/a` count as the same source.
pub(super) fn canonical_source(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

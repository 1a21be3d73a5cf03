//! The caller's side of the engine: submitting requests and reading their events.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::command::Command;
use super::config::ResolvedLimits;
use super::lora::{canonical_source, check_name, HandleLora};
use super::metrics::EngineMetrics;
use crate::lora::{AdapterInfo, LoadOutcome};
use crate::request::{GenerationRequest, RequestEvent, RequestId};
use crate::{sampling, EngineError, Result};

struct Inner {
    commands: Sender<Command>,
    metrics: Arc<Mutex<EngineMetrics>>,
    limits: ResolvedLimits,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Present when the engine was started with LoRA enabled.
    lora: Option<HandleLora>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle is gone: let the thread finish (it also stops once every stream is gone).
        let _ = self.commands.send(Command::Shutdown);
    }
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl EngineHandle {
    pub(super) fn new(
        commands: Sender<Command>,
        metrics: Arc<Mutex<EngineMetrics>>,
        limits: ResolvedLimits,
        thread: JoinHandle<()>,
        lora: Option<HandleLora>,
    ) -> Self {
        EngineHandle {
            inner: Arc::new(Inner {
                commands,
                metrics,
                limits,
                next_id: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
                lora,
            }),
        }
    }

    /// A request id no other caller of this method gets (callers that pick their own ids must
    /// keep them unique themselves).
    pub fn new_request_id(&self) -> RequestId {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn max_model_len(&self) -> usize {
        self.inner.limits.max_model_len
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.limits.vocab_size
    }

    /// Checks a request and queues it. Errors here are the caller's fault (`InvalidRequest`) or
    /// mean the engine is gone (`EngineStopped`); failures after this arrive as events.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestStream> {
        self.submit_with(request, None)
    }

    /// [`Self::submit`] for another choice of a request already submitted as `leader` with the
    /// same prompt and adapter (`n > 1`, `best_of`): the prompt is computed once; this one waits
    /// until `leader` has computed it, then shares its full KV blocks by reference (the partial
    /// last block is recomputed into its own). If `leader` is gone, not running, or its prompt
    /// differs, this runs as an ordinary request.
    pub fn submit_following(&self, request: GenerationRequest, leader: RequestId) -> Result<RequestStream> {
        self.submit_with(request, Some(leader))
    }

    /// The `n` choices of one request (`n > 1`, `best_of`; the same prompt and adapter, their
    /// own ids and seeds), queued together in one message: the first computes the prompt, the
    /// others fork its blocks (see [`Self::submit_following`]), and the scheduler admits them as
    /// a whole, taking one of `max_num_seqs`' seats per choice. More choices than
    /// `max_num_seqs` could never run together: `InvalidRequest`. Nothing is queued unless every
    /// choice is valid.
    pub fn submit_choices(&self, requests: Vec<GenerationRequest>) -> Result<Vec<RequestStream>> {
        let max = self.inner.limits.max_num_seqs;
        if requests.len() > max {
            return Err(EngineError::InvalidRequest(format!(
                "{} choices cannot run together: this server runs at most {max} sequences at once",
                requests.len()
            )));
        }
        for r in &requests {
            self.validate(r)?;
        }
        let mut streams = Vec::with_capacity(requests.len());
        let mut queued = Vec::with_capacity(requests.len());
        for request in requests {
            let (tx, rx) = unbounded_channel();
            streams.push(RequestStream { id: request.id, events: rx, commands: self.inner.commands.clone(), done: false });
            queued.push((request, tx));
        }
        self.inner
            .commands
            .send(Command::SubmitChoices { requests: queued, arrival: Instant::now() })
            .map_err(|_| EngineError::EngineStopped)?;
        Ok(streams)
    }

    fn submit_with(&self, request: GenerationRequest, follows: Option<RequestId>) -> Result<RequestStream> {
        self.validate(&request)?;
        let (tx, rx) = unbounded_channel();
        let id = request.id;
        self.inner
            .commands
            .send(Command::Submit { request, events: tx, arrival: Instant::now(), follows })
            .map_err(|_| EngineError::EngineStopped)?;
        Ok(RequestStream { id, events: rx, commands: self.inner.commands.clone(), done: false })
    }

    fn validate(&self, request: &GenerationRequest) -> Result<()> {
        let limits = &self.inner.limits;
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        let n = request.prompt_tokens.len();
        if n == 0 {
            return bad("the prompt is empty".into());
        }
        if n > limits.max_model_len {
            return bad(format!(
                "the prompt has {n} tokens, more than the maximum context length of {}",
                limits.max_model_len
            ));
        }
        if let Some(&t) = request.prompt_tokens.iter().find(|&&t| t as usize >= limits.vocab_size) {
            return bad(format!("token id {t} is out of the vocabulary (size {})", limits.vocab_size));
        }
        if let Some(&(t, _)) = request.params.logit_bias.iter().find(|(t, _)| *t as usize >= limits.vocab_size) {
            return bad(format!("logit_bias names token id {t}, outside the vocabulary (size {})", limits.vocab_size));
        }
        if let Some(name) = &request.adapter {
            if !self.has_adapter(name) {
                return Err(EngineError::UnknownAdapter(name.clone()));
            }
            if self.adapter_failed(name) {
                return Err(EngineError::AdapterUnavailable(name.clone()));
            }
        }
        sampling::validate(&request.params)
    }

    /// Loads (or replaces) the PEFT adapter in folder `path` under `name`. Parses and validates on
    /// the calling thread (blocking: call it from `spawn_blocking` in async code), then registers
    /// it on the engine thread. Same name and source as already loaded: `AlreadyLoaded`, nothing
    /// changes. Same name, new source: `Replaced`; requests already running finish on the old
    /// weights, new ones get the new. Errors: `InvalidAdapter`/`Io` (bad files; the engine keeps
    /// serving), `InvalidRequest` (bad name), `Unsupported` (LoRA not enabled).
    pub fn load_adapter(&self, name: &str, path: &std::path::Path) -> Result<(LoadOutcome, AdapterInfo)> {
        let lora = self.lora_enabled()?;
        check_name(name)?;
        let source = canonical_source(path);
        let t0 = Instant::now();
        tracing::info!(adapter = name, "loading LoRA adapter");
        let adapter = Arc::new(super::lora::load_rotated(&source, &lora.model, lora.config.max_lora_rank, lora.rotation.as_deref())?);
        let (bytes, rank) = (adapter.size_bytes(), adapter.rank);
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.send(Command::LoadAdapter { name: name.to_string(), source, adapter, reply })?;
        let loaded = answer.recv().map_err(|_| EngineError::EngineStopped)?;
        tracing::info!(adapter = name, rank, bytes, ms = format_args!("{:.1}", t0.elapsed().as_secs_f64() * 1e3), "LoRA adapter loaded");
        Ok(loaded)
    }

    /// Unloads `name`: new requests naming it get `UnknownAdapter` at once; requests already
    /// running finish on it, then its weights are dropped.
    pub fn unload_adapter(&self, name: &str) -> Result<AdapterInfo> {
        self.lora_enabled()?;
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.send(Command::UnloadAdapter { name: name.to_string(), reply })?;
        answer.recv().map_err(|_| EngineError::EngineStopped)?
    }

    /// Every adapter (loaded ones, then versions still finishing requests after an unload or
    /// replace). Empty when LoRA is not enabled.
    pub fn list_adapters(&self) -> Result<Vec<AdapterInfo>> {
        if self.inner.lora.is_none() {
            return Ok(Vec::new());
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.send(Command::ListAdapters { reply })?;
        answer.recv().map_err(|_| EngineError::EngineStopped)
    }

    /// Whether the engine serves LoRA adapters (started with `Engine::start_with_lora`).
    pub fn lora_supported(&self) -> bool {
        self.inner.lora.is_some()
    }

    /// Whether requests may name adapter `name` right now. The engine thread checks again when
    /// the request arrives, since an unload may race with it.
    pub fn has_adapter(&self, name: &str) -> bool {
        self.inner.lora.as_ref().is_some_and(|l| l.names.read().contains(name))
    }

    /// Whether adapter `name` is loaded but failed: its evicted weights could not be re-read, and
    /// requests naming it are refused with `AdapterUnavailable` until it is loaded again. Set by
    /// the engine thread before it fails the requests that waited for the re-read.
    pub fn adapter_failed(&self, name: &str) -> bool {
        self.inner.lora.as_ref().is_some_and(|l| l.failed.read().contains(name))
    }

    /// Every failed adapter name (see [`Self::adapter_failed`]), sorted.
    pub fn failed_adapters(&self) -> Vec<String> {
        let mut names: Vec<String> =
            self.inner.lora.as_ref().map(|l| l.failed.read().iter().cloned().collect()).unwrap_or_default();
        names.sort_unstable();
        names
    }

    fn lora_enabled(&self) -> Result<&HandleLora> {
        self.inner
            .lora
            .as_ref()
            .ok_or_else(|| EngineError::Unsupported("LoRA is not enabled on this engine".into()))
    }

    fn send(&self, command: Command) -> Result<()> {
        self.inner.commands.send(command).map_err(|_| EngineError::EngineStopped)
    }

    /// Cancels a request; its blocks are freed at the next step and it finishes with `Abort`.
    pub fn abort(&self, id: RequestId) {
        let _ = self.inner.commands.send(Command::Abort(id));
    }

    /// Prefix-cache changes from now on, one batch per engine step that changed something (vLLM's
    /// KV-cache events). The engine thread never waits on the receiver: when `capacity` batches are
    /// queued unread, further ones are dropped and counted in [`EngineMetrics::kv_event_batches_dropped_total`].
    pub fn subscribe_kv_events(&self, capacity: usize) -> Result<crossbeam_channel::Receiver<crate::kv::KvEventBatch>> {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        self.send(Command::SubscribeKvEvents { events: tx })?;
        Ok(rx)
    }

    /// The state published after the latest step.
    pub fn metrics(&self) -> EngineMetrics {
        self.inner.metrics.lock().clone()
    }

    /// Stops the engine (requests in flight end with an `Error`) and waits for its thread.
    pub fn shutdown(&self) {
        let _ = self.inner.commands.send(Command::Shutdown);
        let thread = self.inner.thread.lock().take();
        if let Some(t) = thread {
            if t.join().is_err() {
                tracing::error!("the engine thread panicked");
            }
        }
    }
}

/// One request's events, in order. Dropping it before `Finished`/`Error` aborts the request.
pub struct RequestStream {
    id: RequestId,
    events: UnboundedReceiver<RequestEvent>,
    commands: Sender<Command>,
    done: bool,
}

impl RequestStream {
    pub fn id(&self) -> RequestId {
        self.id
    }

    pub async fn next(&mut self) -> Option<RequestEvent> {
        let event = self.events.recv().await;
        self.note(&event);
        event
    }

    /// For threads outside an async runtime (panics if called from inside one, like tokio's own).
    pub fn blocking_next(&mut self) -> Option<RequestEvent> {
        let event = self.events.blocking_recv();
        self.note(&event);
        event
    }

    fn note(&mut self, event: &Option<RequestEvent>) {
        if matches!(event, None | Some(RequestEvent::Finished { .. }) | Some(RequestEvent::Error(_))) {
            self.done = true;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

//! The encoder's batching thread. Requests arrive as lists of tokenized sequences; the thread keeps
//! one FIFO of waiting sequences and, each round, takes sequences from its head while their total
//! stays within `max_num_batched_tokens` (always at least one), runs one ragged forward over them
//! and post-processes each sequence (pooling chain or classifier). A large request is thus spread
//! over several forwards and small ones share one; a request whose caller went away is dropped
//! from the queue. Tokenizing happens on the caller's side, never on this thread.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::sentence::PoolingMode;
use super::tokenize::EncoderInput;
use super::EncoderModel;
use crate::backend::EncoderBackend;
use crate::plan::RaggedBatch;
use crate::{EngineError, Result};

/// What each sequence of a request comes back as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderJobKind {
    /// The Sentence-Transformers embedding.
    Embed,
    /// The embedding without the chain's final Normalize, if it has one (TEI's `normalize: false`).
    EmbedUnnormalized,
    /// The classifier's logits.
    Classify,
}

#[derive(Debug, Clone, Copy)]
pub struct EncoderServiceConfig {
    /// Most tokens one forward carries (a single longer sequence still runs, alone).
    pub max_num_batched_tokens: usize,
}

impl Default for EncoderServiceConfig {
    fn default() -> Self {
        EncoderServiceConfig { max_num_batched_tokens: 8192 }
    }
}

/// Counters published by the thread (read at any time; monotone except the queue gauges).
#[derive(Debug, Default)]
pub struct EncoderMetrics {
    pub queued_sequences: AtomicU64,
    pub queued_tokens: AtomicU64,
    pub forwards: AtomicU64,
    pub sequences: AtomicU64,
    pub tokens: AtomicU64,
    /// Total forward time in microseconds.
    pub forward_us: AtomicU64,
}

type Reply = tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>>>;

struct Job {
    inputs: Vec<EncoderInput>,
    kind: EncoderJobKind,
    reply: Reply,
}

/// A request in flight on the thread.
struct Active {
    kind: EncoderJobKind,
    results: Vec<Vec<f32>>,
    remaining: usize,
    reply: Reply,
}

/// Cheap to clone; the thread stops when every handle is dropped.
#[derive(Clone)]
pub struct EncoderHandle {
    tx: Sender<Job>,
    model: Arc<EncoderModel>,
    metrics: Arc<EncoderMetrics>,
    backend_name: Arc<str>,
}

impl std::fmt::Debug for EncoderHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EncoderHandle").field("backend", &self.backend_name).finish()
    }
}

impl EncoderHandle {
    pub fn start(backend: Box<dyn EncoderBackend>, model: Arc<EncoderModel>, config: EncoderServiceConfig) -> Result<EncoderHandle> {
        if config.max_num_batched_tokens < model.tokenizer.max_seq_length() {
            return Err(EngineError::InvalidConfig(format!(
                "max_num_batched_tokens {} is below the model's max_seq_length {}",
                config.max_num_batched_tokens,
                model.tokenizer.max_seq_length()
            )));
        }
        let (tx, rx) = crossbeam_channel::unbounded();
        let metrics = Arc::new(EncoderMetrics::default());
        let backend_name: Arc<str> = backend.name().into();
        let worker = Worker { backend, model: model.clone(), metrics: metrics.clone(), config, rx, queue: VecDeque::new(), active: HashMap::new(), next_id: 0 };
        std::thread::Builder::new()
            .name("peregrine-encoder".into())
            .spawn(move || worker.run())
            .map_err(|e| EngineError::Backend(format!("cannot start the encoder thread: {e}")))?;
        Ok(EncoderHandle { tx, model, metrics, backend_name })
    }

    pub fn model(&self) -> &EncoderModel {
        &self.model
    }

    pub fn metrics(&self) -> &EncoderMetrics {
        &self.metrics
    }

    pub fn backend_name(&self) -> &str {
        &self.backend_name
    }

    /// Queues `inputs` (already tokenized and length-checked) and waits for one vector per input, in
    /// order. Dropping the future withdraws the request's sequences that have not run yet.
    pub async fn run(&self, inputs: Vec<EncoderInput>, kind: EncoderJobKind) -> Result<Vec<Vec<f32>>> {
        let rx = self.submit(inputs, kind)?;
        rx.await.map_err(|_| EngineError::EngineStopped)?
    }

    /// [`EncoderHandle::run`] for threads outside a runtime (CLI, benchmarks, tests).
    pub fn run_blocking(&self, inputs: Vec<EncoderInput>, kind: EncoderJobKind) -> Result<Vec<Vec<f32>>> {
        let rx = self.submit(inputs, kind)?;
        rx.blocking_recv().map_err(|_| EngineError::EngineStopped)?
    }

    fn submit(&self, inputs: Vec<EncoderInput>, kind: EncoderJobKind) -> Result<tokio::sync::oneshot::Receiver<Result<Vec<Vec<f32>>>>> {
        if inputs.is_empty() {
            return Err(EngineError::InvalidRequest("no inputs".into()));
        }
        let max = self.model.tokenizer.max_seq_length();
        if let Some(bad) = inputs.iter().find(|i| i.is_empty() || i.len() > max || i.type_ids.len() != i.ids.len()) {
            return Err(EngineError::InvalidRequest(format!("an input has {} tokens (1..={max} allowed)", bad.len())));
        }
        if kind == EncoderJobKind::Classify && self.model.classifier.is_none() {
            return Err(EngineError::InvalidRequest("this model has no classification head".into()));
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.tx.send(Job { inputs, kind, reply }).map_err(|_| EngineError::EngineStopped)?;
        Ok(rx)
    }
}

struct Worker {
    backend: Box<dyn EncoderBackend>,
    model: Arc<EncoderModel>,
    metrics: Arc<EncoderMetrics>,
    config: EncoderServiceConfig,
    rx: Receiver<Job>,
    /// Waiting sequences: (request id, index in the request, tokens).
    queue: VecDeque<(u64, usize, EncoderInput)>,
    active: HashMap<u64, Active>,
    next_id: u64,
}

impl Worker {
    fn run(mut self) {
        loop {
            if self.queue.is_empty() {
                match self.rx.recv() {
                    Ok(job) => self.accept(job),
                    Err(_) => return,
                }
            }
            while let Ok(job) = self.rx.try_recv() {
                self.accept(job);
            }
            self.drop_abandoned();
            self.step();
        }
    }

    fn accept(&mut self, job: Job) {
        let id = self.next_id;
        self.next_id += 1;
        let n = job.inputs.len();
        let tokens: usize = job.inputs.iter().map(EncoderInput::len).sum();
        self.metrics.queued_sequences.fetch_add(n as u64, Ordering::Relaxed);
        self.metrics.queued_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
        self.queue.extend(job.inputs.into_iter().enumerate().map(|(i, input)| (id, i, input)));
        self.active.insert(id, Active { kind: job.kind, results: vec![Vec::new(); n], remaining: n, reply: job.reply });
    }

    /// Forgets requests whose caller stopped waiting, and their queued sequences.
    fn drop_abandoned(&mut self) {
        let gone: Vec<u64> = self.active.iter().filter(|(_, a)| a.reply.is_closed()).map(|(&id, _)| id).collect();
        if gone.is_empty() {
            return;
        }
        for id in &gone {
            self.active.remove(id);
        }
        let metrics = &self.metrics;
        self.queue.retain(|(id, _, input)| {
            let keep = !gone.contains(id);
            if !keep {
                metrics.queued_sequences.fetch_sub(1, Ordering::Relaxed);
                metrics.queued_tokens.fetch_sub(input.len() as u64, Ordering::Relaxed);
            }
            keep
        });
    }

    /// One forward over the longest prefix of the queue within the token budget.
    fn step(&mut self) {
        let mut batch = RaggedBatch::new();
        let mut owners = Vec::new();
        while let Some((_, _, input)) = self.queue.front() {
            if !owners.is_empty() && batch.num_tokens() + input.len() > self.config.max_num_batched_tokens {
                break;
            }
            let Some((id, i, input)) = self.queue.pop_front() else { break };
            batch.push(&input.ids, &input.type_ids);
            owners.push((id, i));
        }
        if owners.is_empty() {
            return;
        }
        let n_tokens = batch.num_tokens() as u64;
        self.metrics.queued_sequences.fetch_sub(owners.len() as u64, Ordering::Relaxed);
        self.metrics.queued_tokens.fetch_sub(n_tokens, Ordering::Relaxed);
        // What the sequences' jobs read: the pipeline's pooling, and the first token's state for a
        // classifier (pooled on the device by a device backend).
        let h = self.model.config.hidden_size;
        let mut modes = self.model.pipeline.pooling.clone();
        let embed_width = modes.len() * h;
        let classify = owners.iter().any(|(id, _)| self.active.get(id).is_some_and(|a| matches!(a.kind, EncoderJobKind::Classify)));
        if classify {
            modes.push(PoolingMode::Cls);
        }
        let width = modes.len() * h;
        let started = Instant::now();
        let result = self.backend.forward_pooled(&batch, h, &modes);
        self.metrics.forward_us.fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.metrics.forwards.fetch_add(1, Ordering::Relaxed);
        let pooled = match result {
            Ok(p) if p.len() == owners.len() * width => p,
            Ok(p) => {
                let msg = format!("the encoder backend pooled {} values for {} sequences of {width}", p.len(), owners.len());
                for (id, _) in &owners {
                    self.fail(*id, EngineError::Backend(msg.clone()));
                }
                return;
            }
            Err(e) => {
                let msg = e.to_string();
                for (id, _) in &owners {
                    self.fail(*id, EngineError::Backend(msg.clone()));
                }
                return;
            }
        };
        self.metrics.sequences.fetch_add(owners.len() as u64, Ordering::Relaxed);
        self.metrics.tokens.fetch_add(n_tokens, Ordering::Relaxed);
        for (s, (id, i)) in owners.into_iter().enumerate() {
            let Some(active) = self.active.get_mut(&id) else { continue };
            let row = &pooled[s * width..(s + 1) * width];
            active.results[i] = match active.kind {
                EncoderJobKind::Embed => self.model.pipeline.finish(row[..embed_width].to_vec(), true),
                EncoderJobKind::EmbedUnnormalized => self.model.pipeline.finish(row[..embed_width].to_vec(), false),
                EncoderJobKind::Classify => self.model.classify_first(&row[embed_width..]).unwrap_or_default(),
            };
            active.remaining -= 1;
            if active.remaining == 0 {
                if let Some(done) = self.active.remove(&id) {
                    let _ = done.reply.send(Ok(done.results));
                }
            }
        }
    }

    fn fail(&mut self, id: u64, error: EngineError) {
        if let Some(active) = self.active.remove(&id) {
            let _ = active.reply.send(Err(error));
        }
        let metrics = &self.metrics;
        self.queue.retain(|(owner, _, input)| {
            let keep = *owner != id;
            if !keep {
                metrics.queued_sequences.fetch_sub(1, Ordering::Relaxed);
                metrics.queued_tokens.fetch_sub(input.len() as u64, Ordering::Relaxed);
            }
            keep
        });
    }
}

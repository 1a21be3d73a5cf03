//! The engine thread: drains commands, runs one scheduled step at a time, samples and reports.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};
use parking_lot::Mutex;
use tokio::sync::mpsc::UnboundedSender;

use super::config::ResolvedLimits;
use super::command::Command;
use super::lora::{EngineLora, Placement};
use super::metrics::EngineMetrics;
use super::outbox::Outbox;
use super::step_profile::StepProfile;
use crate::backend::{Backend, Logits};
use crate::plan::{RowConstraints, RowSampling};
use crate::lora::AdapterId;
use crate::request::{FinishReason, GenerationRequest, RequestEvent, RequestId, SampledToken, Usage};
use crate::sampling::{request_seed, RequestSampler};
use crate::structured::{GrammarOutcome, PARALLEL_COMMIT_MIN_ROWS};
use crate::scheduler::{Scheduler, SchedulerOutput, Sequence};

/// Per-request state the scheduler does not need: where events go and how to sample.
struct Active {
    events: UnboundedSender<RequestEvent>,
    sampler: RequestSampler,
    arrival: Instant,
    prompt_len: usize,
    num_output: usize,
    cached_prompt_tokens: usize,
    /// The LoRA adapter version this request pinned (released when it ends).
    adapter: Option<AdapterId>,
}

pub(super) struct Worker {
    backend: Box<dyn Backend>,
    scheduler: Scheduler,
    requests: HashMap<RequestId, Active>,
    commands: Receiver<Command>,
    metrics: Arc<Mutex<EngineMetrics>>,
    totals: EngineMetrics,
    limits: ResolvedLimits,
    eos_token_ids: Vec<u32>,
    seed: u64,
    lora: Option<EngineLora>,
    profile: Option<StepProfile>,
    /// Events of active requests, sent while the device runs the next step.
    outbox: Outbox,
    /// Where prefix-cache changes go, once someone subscribed.
    kv_events: Option<crossbeam_channel::Sender<crate::kv::KvEventBatch>>,
}

enum Flow {
    Continue,
    Stop,
}

impl Worker {
    pub(super) fn new(
        backend: Box<dyn Backend>,
        scheduler: Scheduler,
        commands: Receiver<Command>,
        metrics: Arc<Mutex<EngineMetrics>>,
        limits: ResolvedLimits,
        seed: u64,
        lora: Option<EngineLora>,
    ) -> Self {
        let eos_token_ids = backend.config().eos_token_ids.clone();
        Worker {
            backend,
            scheduler,
            requests: HashMap::new(),
            commands,
            metrics,
            totals: EngineMetrics::default(),
            limits,
            eos_token_ids,
            seed,
            lora,
            profile: StepProfile::from_env(),
            outbox: Outbox::default(),
            kv_events: None,
        }
    }

    pub(super) fn run(mut self) {
        self.publish();
        'serve: loop {
            if !self.scheduler.has_work() {
                // Idle: sleep until a command arrives (or every sender is gone).
                match self.commands.recv() {
                    Ok(cmd) => {
                        if let Flow::Stop = self.handle(cmd) {
                            break 'serve;
                        }
                    }
                    Err(_) => break 'serve,
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(cmd) => {
                        if let Flow::Stop = self.handle(cmd) {
                            break 'serve;
                        }
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if !self.scheduler.has_work() {
                            break 'serve;
                        }
                        break;
                    }
                }
            }
            self.reap_disconnected();
            if self.scheduler.has_work() {
                self.step();
            }
            self.send_kv_events();
            if !self.scheduler.has_work() {
                // No step follows to carry the queued events out during its forward pass.
                self.outbox.deliver();
            }
            self.publish();
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.fail(id, "the engine shut down");
        }
        self.outbox.deliver();
        self.publish();
        if let Some(p) = &self.profile {
            eprintln!("{}", p.report());
        }
    }

    fn handle(&mut self, cmd: Command) -> Flow {
        match cmd {
            Command::Submit { request, events, arrival, follows } => self.add(request, events, arrival, follows),
            Command::SubmitChoices { requests, arrival } => {
                let leader = requests.first().map(|(r, _)| r.id);
                for (i, (request, events)) in requests.into_iter().enumerate() {
                    self.add(request, events, arrival, leader.filter(|_| i > 0));
                }
            }
            Command::Abort(id) => self.finish(id, FinishReason::Abort),
            Command::Shutdown => return Flow::Stop,
            Command::LoadAdapter { name, source, adapter, reply } => {
                if let Some(lora) = &mut self.lora {
                    let _ = reply.send(lora.install(&name, &source, adapter));
                }
            }
            Command::UnloadAdapter { name, reply } => {
                let result = match &mut self.lora {
                    Some(lora) => lora.unload(&name),
                    None => Err(crate::EngineError::UnknownAdapter(name)),
                };
                let _ = reply.send(result);
            }
            Command::ListAdapters { reply } => {
                let _ = reply.send(self.lora.as_ref().map(EngineLora::list).unwrap_or_default());
            }
            Command::AdapterReloaded { id, result } => self.adapter_reloaded(id, result),
            Command::SubscribeKvEvents { events } => {
                self.scheduler.kv_mut().enable_events();
                self.kv_events = Some(events);
                self.send_kv_events();
            }
        }
        Flow::Continue
    }

    fn add(&mut self, request: GenerationRequest, events: UnboundedSender<RequestEvent>, arrival: Instant, follows: Option<RequestId>) {
        if self.requests.contains_key(&request.id) {
            let _ = events.send(RequestEvent::Error(format!("request id {} is already in use", request.id)));
            return;
        }
        let max_tokens = request.params.max_tokens;
        let seed = request_seed(&request.params, request.id, self.seed);
        let sampler = RequestSampler::new(request.params, &request.prompt_tokens, seed);
        let prompt_len = request.prompt_tokens.len();
        let mut seq = Sequence::new(request.id, request.prompt_tokens);
        seq.arrival = arrival;
        seq.follows = follows;
        // Where it ends at the latest, for the admission look-ahead.
        seq.max_len = Some(prompt_len.saturating_add(max_tokens).min(self.limits.max_model_len));
        let id = request.id;
        let mut adapter = None;
        // None: parked until its adapter's weights are back in memory.
        let ready = match &request.adapter {
            None => Some(seq),
            Some(name) => {
                // Re-checked here: an unload may have raced with the handle's check.
                let Some(lora) = &mut self.lora else {
                    let _ = events.send(RequestEvent::Error(format!("unknown adapter {name:?}")));
                    return;
                };
                let version = match lora.pin(&mut seq, name) {
                    Ok(v) => v,
                    Err(e) => {
                        let _ = events.send(RequestEvent::Error(e.to_string()));
                        return;
                    }
                };
                adapter = Some(version);
                match lora.place(seq, version) {
                    Placement::Ready(seq) => Some(seq),
                    Placement::Parked => None,
                }
            }
        };
        if let Some(seq) = ready {
            self.scheduler.add(seq);
        }
        self.requests.insert(
            id,
            Active { events, sampler, arrival, prompt_len, num_output: 0, cached_prompt_tokens: 0, adapter },
        );
    }

    /// An evicted adapter is back in memory (or could not be read): schedule or fail its requests.
    fn adapter_reloaded(&mut self, id: AdapterId, result: crate::Result<std::sync::Arc<crate::lora::LoraAdapter>>) {
        let Some(lora) = &mut self.lora else { return };
        match lora.reloaded(id, result) {
            Ok(seqs) => {
                for seq in seqs.into_iter().filter(|s| self.requests.contains_key(&s.id)) {
                    self.scheduler.add(seq);
                }
            }
            Err((seqs, msg)) => {
                for seq in seqs {
                    self.fail(seq.id, &msg);
                }
            }
        }
    }

    /// Requests whose stream was dropped without an abort reaching us yet.
    fn reap_disconnected(&mut self) {
        let gone: Vec<RequestId> =
            self.requests.iter().filter(|(_, r)| r.events.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.finish(id, FinishReason::Abort);
        }
    }

    fn step(&mut self) {
        // New requests' first masks (queued when they were added) start before anything else.
        crate::structured::start_queued_masks();
        let t_schedule = Instant::now();
        let mut out = self.scheduler.schedule();
        self.totals.preemptions_total += out.preempted.len() as u64;
        if out.is_empty() {
            if out.preempted.is_empty() {
                // Work exists but nothing can run: only possible if the oldest waiting sequence
                // can never fit. Fail it rather than spin.
                let head = self.scheduler.waiting_ids().next();
                if let Some(id) = head {
                    self.fail(id, "the request does not fit in the KV cache");
                }
            }
            self.outbox.deliver();
            return;
        }
        self.note_admissions(&out);
        for c in out.chunks.iter().filter(|c| !c.is_decode) {
            self.totals.prefill_tokens_computed_total += c.num_tokens as u64;
        }
        self.totals.steps_total += 1;

        if let Some(lora) = &mut self.lora {
            if let Err(e) = lora.prepare_step(&self.scheduler, &mut out, self.backend.as_mut()) {
                return self.fail_step(&out, &e.to_string());
            }
        }
        let t_forward = Instant::now();
        let sampled = if self.backend.samples_on_device() {
            self.forward_sampling_on_device(&out)
        } else {
            self.forward_sampling_on_host(&out)
        };
        // The step's tokens are committed: their next masks run while the step is emitted, the
        // next one scheduled and its forward pass computed.
        crate::structured::start_queued_masks();
        let t_emit = Instant::now();
        match sampled {
            Ok(tokens) => {
                self.scheduler.step_done(&out);
                self.emit(&out, tokens);
            }
            Err(msg) => self.fail_step(&out, &msg),
        }
        if let Some(p) = &mut self.profile {
            p.record_step(t_schedule, t_forward, t_emit);
        }
    }

    /// Logits to the host, one [`RequestSampler`] per row. Returns each logits row's token (None
    /// where the request is gone).
    fn forward_sampling_on_host(&mut self, out: &SchedulerOutput) -> Result<Vec<Option<SampledToken>>, String> {
        self.outbox.deliver();
        let logits = self.backend.forward(&out.batch).map_err(|e| e.to_string())?;
        let wanted = out.chunks.iter().filter(|c| c.wants_logits).count();
        check_logits(&logits, wanted)?;
        let rows = out.chunks.iter().filter(|c| c.wants_logits).enumerate();
        Ok(rows.map(|(row, c)| self.requests.get_mut(&c.id).map(|req| req.sampler.sample(logits.row(row)))).collect())
    }

    /// Sampling on the backend's device: only token ids come back, plus the logits of rows whose
    /// requests need the host (penalties, logprobs).
    fn forward_sampling_on_device(&mut self, out: &SchedulerOutput) -> Result<Vec<Option<SampledToken>>, String> {
        let wanting: Vec<RequestId> = out.chunks.iter().filter(|c| c.wants_logits).map(|c| c.id).collect();
        // A request gone since scheduling still has a row: greedy, and its token is dropped.
        let greedy = RowSampling::Draw { temperature: 0.0, top_k: 0, top_p: 1.0, min_p: 0.0, uniform: 0.0 };
        // Where the backend applies token masks and logit biases itself, constrained rows stay on
        // the device; their masks are gathered while it computes the step. A step without any
        // keeps the plain path (its sampler is enqueued before the host's work, as before).
        let on_device = self.backend.applies_constraints_on_device()
            && wanting.iter().any(|id| self.requests.get(id).is_some_and(|r| r.sampler.has_constraints()));
        let plans: Vec<RowSampling> = wanting
            .iter()
            .map(|id| {
                self.requests.get_mut(id).map_or(greedy, |r| {
                    if on_device {
                        r.sampler.device_plan_constrained()
                    } else {
                        r.sampler.device_plan()
                    }
                })
            })
            .collect();
        let outbox = &mut self.outbox;
        let step = if on_device {
            let requests = &mut self.requests;
            let vocab = self.backend.config().vocab_size;
            let mut gather = || {
                outbox.deliver();
                let mut constraints = RowConstraints::new(vocab);
                for (row, (id, plan)) in wanting.iter().zip(&plans).enumerate() {
                    if let (RowSampling::Draw { .. }, Some(r)) = (plan, requests.get_mut(id)) {
                        if r.sampler.has_constraints() {
                            r.sampler.push_constraints(row, &mut constraints);
                        }
                    }
                }
                constraints
            };
            self.backend.forward_sample_constrained(&out.batch, &plans, &mut gather)
        } else {
            self.backend.forward_sample_with(&out.batch, &plans, &mut || outbox.deliver())
        }
        .map_err(|e| e.to_string())?;
        let host_rows = plans.iter().filter(|p| **p == RowSampling::Host).count();
        if step.tokens.len() != wanting.len() {
            return Err(format!("the backend sampled {} rows for {} sequences", step.tokens.len(), wanting.len()));
        }
        check_logits(&step.host_logits, host_rows)?;
        if plans.iter().zip(&step.tokens).any(|(p, t)| matches!(p, RowSampling::Draw { .. }) && t.is_none()) {
            return Err("the backend left a device-sampled row without a token".into());
        }
        let mut tokens: Vec<Option<SampledToken>> = vec![None; wanting.len()];
        if on_device {
            self.accept_constrained_tokens(&wanting, &step.tokens, &mut tokens);
        }
        let mut next_host_row = 0;
        for (row, ((id, plan), token)) in wanting.iter().zip(&plans).zip(step.tokens).enumerate() {
            tokens[row] = match (plan, token) {
                (RowSampling::Host, _) => {
                    let logits = step.host_logits.row(next_host_row);
                    next_host_row += 1;
                    self.requests.get_mut(id).map(|r| r.sampler.sample(logits))
                }
                (RowSampling::Draw { .. }, Some(t)) => match tokens[row].take() {
                    Some(accepted) => Some(accepted),
                    None => self.requests.get_mut(id).map(|r| r.sampler.accept_device_token(t)),
                },
                (RowSampling::Draw { .. }, None) => None,
            };
        }
        Ok(tokens)
    }

    /// Hands the device's tokens to the constrained rows' requests on the mask threads, all at
    /// once: each commit advances a grammar (a few µs at a 128k vocabulary), and one by one on the
    /// engine thread a batch of 256 took ~0.6 ms while the device waited for the next step. Fills
    /// `out` for those rows; the others are left to the caller.
    fn accept_constrained_tokens(&mut self, wanting: &[RequestId], device: &[Option<u32>], out: &mut [Option<SampledToken>]) {
        if wanting.len() < PARALLEL_COMMIT_MIN_ROWS {
            return;
        }
        let mut row_of: HashMap<RequestId, (usize, u32)> = HashMap::with_capacity(wanting.len());
        for (row, (id, token)) in wanting.iter().zip(device).enumerate() {
            if let Some(t) = token {
                row_of.insert(*id, (row, *t));
            }
        }
        let mut work: Vec<(usize, u32, &mut RequestSampler)> = self
            .requests
            .iter_mut()
            .filter(|(_, r)| r.sampler.has_constraints())
            .filter_map(|(id, r)| row_of.get(id).map(|&(row, t)| (row, t, &mut r.sampler)))
            .collect();
        if work.len() < PARALLEL_COMMIT_MIN_ROWS {
            return;
        }
        let accepted: Vec<(usize, SampledToken)> = crate::structured::on_mask_threads(|| {
            use rayon::prelude::*;
            work.par_iter_mut().map(|(row, t, sampler)| (*row, sampler.accept_device_token(*t))).collect()
        });
        for (row, token) in accepted {
            out[row] = Some(token);
        }
    }

    fn note_admissions(&mut self, out: &SchedulerOutput) {
        let now = Instant::now();
        for a in &out.admitted {
            self.totals.prefix_cache_hit_tokens_total += a.cached_tokens as u64;
            let Some(req) = self.requests.get_mut(&a.id) else { continue };
            if a.first_time {
                self.totals.prompt_tokens_total += req.prompt_len as u64;
                req.cached_prompt_tokens = a.cached_tokens.min(req.prompt_len);
                let queue_time = now.saturating_duration_since(req.arrival);
                self.outbox.push(&req.events, RequestEvent::Scheduled { queue_time });
            }
        }
    }

    /// Hands each logits row's token to its request and ends the requests that are done.
    fn emit(&mut self, out: &SchedulerOutput, tokens: Vec<Option<SampledToken>>) {
        for (c, token) in out.chunks.iter().filter(|c| c.wants_logits).zip(tokens) {
            let (Some(req), Some(token)) = (self.requests.get_mut(&c.id), token) else { continue };
            let id = token.token_id;
            req.num_output += 1;
            self.totals.generation_tokens_total += 1;
            self.scheduler.append_token(c.id, id);
            let params = req.sampler.params();
            let grammar = req.sampler.grammar_outcome();
            if let GrammarOutcome::Failed(msg) = grammar {
                self.outbox.push(&req.events, RequestEvent::Token(token));
                self.fail(c.id, &msg);
                continue;
            }
            let reason = if (!params.ignore_eos && self.eos_token_ids.contains(&id))
                || params.stop_token_ids.contains(&id)
                || grammar == GrammarOutcome::Complete
            {
                Some(FinishReason::Stop)
            } else if req.num_output >= params.max_tokens
                || req.prompt_len + req.num_output >= self.limits.max_model_len
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            // A reader that is gone is noticed by reap_disconnected before the next step.
            self.outbox.push(&req.events, RequestEvent::Token(token));
            if let Some(r) = reason {
                self.finish(c.id, r);
            }
        }
    }

    /// Ends a request normally (or by abort), freeing its blocks. Unknown ids are ignored: an abort
    /// may race with the request's own end.
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        self.scheduler.remove(id);
        let Some(req) = self.requests.remove(&id) else { return };
        self.release_adapter(id, req.adapter);
        self.totals.requests_finished_total += 1;
        let usage = Usage {
            prompt_tokens: req.prompt_len,
            completion_tokens: req.num_output,
            cached_prompt_tokens: req.cached_prompt_tokens,
        };
        self.outbox.push(&req.events, RequestEvent::Finished { reason, usage });
    }

    fn fail(&mut self, id: RequestId, msg: &str) {
        self.scheduler.remove(id);
        if let Some(req) = self.requests.remove(&id) {
            self.release_adapter(id, req.adapter);
            self.outbox.push(&req.events, RequestEvent::Error(msg.to_owned()));
        }
    }

    /// A request ended: unpin its adapter version (a retiring one is dropped with its last request).
    fn release_adapter(&mut self, request: RequestId, adapter: Option<AdapterId>) {
        if let (Some(lora), Some(version)) = (&mut self.lora, adapter) {
            lora.unpark(request);
            lora.release(version);
        }
    }

    /// A failed step fails the requests in it; the others keep being served.
    fn fail_step(&mut self, out: &SchedulerOutput, msg: &str) {
        tracing::warn!(error = msg, sequences = out.chunks.len(), "step failed");
        for c in &out.chunks {
            self.fail(c.id, msg);
        }
    }

    /// Hands the step's prefix-cache changes to the subscriber without waiting: a full channel
    /// drops the batch (counted) rather than slow the step loop.
    fn send_kv_events(&mut self) {
        let Some(tx) = &self.kv_events else { return };
        let kv = self.scheduler.kv_mut();
        let events = kv.take_events();
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
        let batch = crate::kv::KvEventBatch { ts, block_size: kv.block_size(), events };
        match tx.try_send(batch) {
            Ok(()) => {}
            Err(crossbeam_channel::TrySendError::Full(_)) => self.totals.kv_event_batches_dropped_total += 1,
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => self.kv_events = None,
        }
    }

    fn publish(&self) {
        let kv = self.scheduler.kv();
        let mut m = self.totals.clone();
        m.num_running = self.scheduler.num_running();
        m.num_waiting = self.scheduler.num_waiting();
        m.kv_usage_ratio = kv.usage_ratio();
        m.num_blocks = kv.num_blocks();
        m.num_free_blocks = kv.num_free_blocks();
        m.lora_cache = self.lora.as_ref().map(EngineLora::cache_stats);
        *self.metrics.lock() = m;
    }
}

/// A backend's logits must have one row per wanted sequence.
fn check_logits(logits: &Logits, wanted: usize) -> Result<(), String> {
    if logits.rows() != wanted || (wanted > 0 && logits.vocab == 0) || logits.data.len() != wanted * logits.vocab {
        return Err(format!("the backend returned {} logits rows for {wanted} sequences", logits.rows()));
    }
    Ok(())
}

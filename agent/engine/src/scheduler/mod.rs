//! Builds each step's flat batch: one decode token for every running sequence first, then prefill
//! chunks (of sequences part-way through their prompt, then of newly admitted ones, FCFS), within
//! `max_num_batched_tokens` and `max_num_seqs`.
//!
//! Memory pressure. A sequence is admitted only when its blocks exist now *and* the running
//! sequences' projected growth (see [`lookahead`]) leaves room for it, so that what is admitted is
//! not preempted a few hundred steps later. Each sequence is projected to reach a fraction of its
//! remaining `max_tokens` (clipped at 4096 tokens, as SGLang clips its estimate): the fraction
//! finished sequences actually used (a moving average, starting at 1), pulled back towards 1 by
//! every preemption. Like SGLang's `new_token_ratio` it
//! is optimistic only where requests end early; unlike a blind decay it learns from what ended,
//! so workloads that run to `max_tokens` (benchmarks with `ignore_eos`, up to the clip) keep an
//! exact projection and never preempt, while chat traffic with loose `max_tokens` is not starved.
//!
//! When a decode still finds no block (the projection was too optimistic), the victim is the
//! running sequence preempted the fewest times so far, newest first among equals (vLLM's choice
//! for those never preempted): a resumed sequence ranks above every sequence preempted fewer
//! times, so one sequence is not recomputed again and again while others keep their blocks.
//! Preempted sequences wait at the front of the queue and recompute prompt + output.
//!
//! The choices of one request (`n > 1`, a leader and the sequences that `follow` it, queued
//! together) are admitted as a whole: the leader only when seats and the look-ahead's blocks exist
//! for every choice, the followers (forking its prompt blocks) as soon as it has computed the
//! prompt, while nothing else overtakes them.

mod lookahead;
mod sequence;

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};

use lookahead::{Outlook, Projection};

pub use sequence::Sequence;

use crate::plan::{SeqChunk, StepBatch};
use crate::kv::{BlockManager, SeqId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Admit only what the running sequences' projected growth leaves room for. Off: admit
    /// whatever fits now and preempt when a decode finds no block (vLLM v1's policy).
    pub lookahead: bool,
}

/// Finished sequences the growth ratio averages over (an exponential moving average's window).
const RATIO_WINDOW: f64 = 32.0;

/// Most tokens of growth projected for one sequence (SGLang clips its estimate at the same 4096):
/// a request without `max_tokens` may run to the context length, and projecting that would let
/// one chat request hold back a whole cache's worth of admissions until the ratio has learned.
const GROWTH_CLIP: usize = 4096;

/// One sequence's part of a step, in batch order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub id: SeqId,
    pub context_len: usize,
    pub num_tokens: usize,
    /// The chunk ends at the sequence's newest token: the step yields a logits row to sample from.
    pub wants_logits: bool,
    pub is_decode: bool,
}

/// A sequence that left the waiting queue this step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub id: SeqId,
    /// Leading tokens found in the prefix cache.
    pub cached_tokens: usize,
    /// First admission (false: re-admitted after preemption).
    pub first_time: bool,
}

#[derive(Debug, Clone, Default)]
pub struct SchedulerOutput {
    pub batch: StepBatch,
    pub chunks: Vec<ScheduledChunk>,
    pub admitted: Vec<Admission>,
    /// Sequences preempted this step, in the order they were chosen.
    pub preempted: Vec<SeqId>,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    kv: BlockManager,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// In victim order, reversed: most preempted first, then by first admission; the last one is
    /// the first to be preempted.
    running: Vec<SeqId>,
    /// Most distinct LoRA adapters among running sequences (the backend's slots); None: no limit.
    max_loras: Option<usize>,
    /// Fraction of its remaining `max_tokens` a sequence is projected to still generate.
    growth_ratio: f64,
    /// Next first-admission rank.
    next_rank: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: BlockManager) -> Self {
        Scheduler {
            config,
            kv,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            max_loras: None,
            growth_ratio: 1.0,
            next_rank: 0,
        }
    }

    /// Admits a sequence only while the running set then uses at most `max_loras` distinct
    /// adapters, so every step's adapters fit in the backend's LoRA slots.
    pub fn set_max_loras(&mut self, max_loras: usize) {
        self.max_loras = Some(max_loras);
    }

    /// Whether admitting a sequence pinned to `lora_id` keeps the running adapters within the limit.
    fn lora_fits(&self, lora_id: Option<u64>) -> bool {
        let (Some(max), Some(key)) = (self.max_loras, lora_id) else { return true };
        let mut in_use: Vec<u64> = self.running.iter().filter_map(|r| self.seqs.get(r)?.lora).collect();
        in_use.sort_unstable();
        in_use.dedup();
        in_use.contains(&key) || in_use.len() < max
    }

    pub fn kv(&self) -> &BlockManager {
        &self.kv
    }

    /// For the engine thread's prefix-cache event switch and drain (never for allocation).
    pub fn kv_mut(&mut self) -> &mut BlockManager {
        &mut self.kv
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// The fraction of their remaining `max_tokens` running sequences are projected to generate.
    pub fn growth_ratio(&self) -> f64 {
        self.growth_ratio
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn running_ids(&self) -> &[SeqId] {
        &self.running
    }

    pub fn waiting_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.waiting.iter().copied()
    }

    /// Queues a new sequence at the back of the waiting queue.
    pub fn add(&mut self, seq: Sequence) {
        let id = seq.id;
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
    }

    /// Drops a sequence wherever it is (finished, aborted or failed) and frees its blocks. How
    /// much of its `max_tokens` it used feeds the growth ratio, whatever ended it: the projection
    /// is about when blocks come back, not why.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let seq = self.seqs.remove(&id)?;
        self.learn_growth(&seq);
        self.kv.free(id);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        Some(seq)
    }

    /// Appends a sampled token to a sequence (its K/V is computed by the next step).
    pub fn append_token(&mut self, id: SeqId, token: u32) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.tokens.push(token);
        }
    }

    /// Plans the next step. Empty when there is nothing to run.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;

        self.schedule_decodes(&mut out, &mut budget);

        // Sequences already running but part-way through their (re)computed prompt.
        for &id in &self.running {
            if budget == 0 {
                break;
            }
            let Some(seq) = self.seqs.get(&id) else { continue };
            if seq.decoding {
                continue;
            }
            let n = seq.remaining().min(budget);
            budget -= n;
            out.chunks.push(prefill_chunk(seq, n));
        }

        // Admitting right after a preemption would only hand the freed blocks to a newer sequence.
        if out.preempted.is_empty() {
            self.admit(&mut out, &mut budget);
        }
        self.build_batch(&mut out);
        out
    }

    fn schedule_decodes(&mut self, out: &mut SchedulerOutput, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let Some(seq) = self.seqs.get(&id) else {
                i += 1;
                continue;
            };
            if !seq.decoding {
                i += 1;
                continue;
            }
            if *budget == 0 {
                break;
            }
            let context_len = seq.num_computed;
            loop {
                if self.kv.append_slots(id, context_len + 1) {
                    out.chunks.push(ScheduledChunk {
                        id,
                        context_len,
                        num_tokens: 1,
                        wants_logits: true,
                        is_decode: true,
                    });
                    *budget -= 1;
                    i += 1;
                    break;
                }
                // Newer sequences sit after `i` (only older ones have been scheduled), so the
                // newest is never one already in this step's batch; it may be `id` itself.
                let Some(&victim) = self.running.last() else { break };
                self.preempt(victim);
                out.preempted.push(victim);
                if victim == id {
                    break;
                }
            }
        }
    }

    fn learn_growth(&mut self, seq: &Sequence) {
        let Some(max_len) = seq.max_len else { return };
        let budget = max_len.saturating_sub(seq.prompt_len).min(GROWTH_CLIP);
        if !seq.ever_scheduled || budget == 0 {
            return;
        }
        let used = (seq.output().len() as f64 / budget as f64).min(1.0);
        self.growth_ratio += (used - self.growth_ratio) / RATIO_WINDOW;
    }

    fn preempt(&mut self, id: SeqId) {
        self.kv.free(id);
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            // Recompute from prompt + generated tokens: nothing generated is lost or repeated.
            seq.num_computed = 0;
            seq.decoding = false;
            seq.preemptions += 1;
        }
        // The projection was too optimistic: halfway back to assuming every max_tokens is used.
        self.growth_ratio += (1.0 - self.growth_ratio) / 2.0;
        // Preempted newest-first and pushed to the front, so the queue stays oldest-first.
        self.waiting.push_front(id);
    }

    fn admit(&mut self, out: &mut SchedulerOutput, budget: &mut usize) {
        // Only worth building (O(running blocks)) when someone could be admitted.
        let could_admit = *budget > 0 && self.running.len() < self.config.max_num_seqs && !self.waiting.is_empty();
        let mut outlook = (self.config.lookahead && could_admit).then(|| self.outlook());
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            // FCFS as for blocks: the head waits until a LoRA slot's adapter is no longer running.
            if !self.lora_fits(seq.lora) {
                break;
            }
            // A request's choices take their seats together (never more than exist at all).
            let group = self.waiting_group(id).min(self.config.max_num_seqs);
            if self.running.len() + group > self.config.max_num_seqs {
                break;
            }
            let leader = match self.leader_of(id) {
                Leader::Computing => break, // FCFS: it waits a step or two, nothing overtakes it
                Leader::Ready(leader, computed) => Some((leader, computed)),
                Leader::None => None,
            };
            let cost = match leader {
                Some((_, computed)) => self.kv.fork_cost(seq.tokens.len(), computed),
                None => self.kv.allocation_cost(&seq.tokens, seq.lora),
            };
            // FCFS: if the oldest waiting sequence does not fit, nothing behind it jumps the queue.
            // With nothing running it is admitted on its blocks alone: something must progress.
            let mut admitted_projection = None;
            if let Some((look, queued_prefill)) = &outlook {
                let projections = self.admission_projections(seq, cost, group, *queued_prefill);
                if !self.running.is_empty() {
                    let followers_cost = (group - 1) * self.kv.fork_cost(seq.tokens.len(), seq.tokens.len());
                    let need = look.peak_with(&projections, self.kv.block_size()) + cost + followers_cost;
                    if need > self.kv.num_free_blocks() {
                        break;
                    }
                }
                admitted_projection = projections.first().copied();
            }
            let Some(seq) = self.seqs.get_mut(&id) else { break };
            let allocated = match leader {
                Some((leader, computed)) => self.kv.fork(leader, id, &seq.tokens, computed),
                None => self.kv.allocate(id, &seq.tokens, seq.lora),
            };
            let Some(cached) = allocated else { break };
            self.waiting.pop_front();
            seq.num_computed = cached;
            out.admitted.push(Admission { id, cached_tokens: cached, first_time: !seq.ever_scheduled });
            if !seq.ever_scheduled {
                seq.rank = self.next_rank;
                self.next_rank += 1;
            }
            seq.ever_scheduled = true;
            let n = seq.remaining().min(*budget);
            *budget -= n;
            let uncomputed = seq.remaining();
            out.chunks.push(prefill_chunk(seq, n));
            self.insert_running(id);
            if let (Some((look, queued_prefill)), Some(p)) = (&mut outlook, admitted_projection) {
                look.insert(p);
                *queued_prefill += uncomputed;
            }
        }
    }

    /// Running sequences go in victim order, reversed: the most preempted first, then by first
    /// admission, so the last one is the sequence preempted the fewest times, the newest of them.
    fn insert_running(&mut self, id: SeqId) {
        let key = |s: &Sequence| (Reverse(s.preemptions), s.rank);
        let Some(k) = self.seqs.get(&id).map(key) else { return };
        let at = self.running.partition_point(|r| self.seqs.get(r).is_none_or(|s| key(s) <= k));
        self.running.insert(at, id);
    }

    /// How many sequences at the head of the queue, from `id` on, are choices of one request: a
    /// leader (or a follower whose leader went first) and the followers queued right behind it.
    fn waiting_group(&self, id: SeqId) -> usize {
        let Some(head) = self.seqs.get(&id) else { return 1 };
        let leader = head.follows.unwrap_or(id);
        1 + self
            .waiting
            .iter()
            .skip(1)
            .take_while(|w| self.seqs.get(w).is_some_and(|s| s.follows == Some(leader)))
            .count()
    }

    /// The running sequences' projections, and the prompt tokens they still have to compute
    /// (which delays the ends of those still in prefill and of whatever is admitted next).
    fn outlook(&self) -> (Outlook, usize) {
        let mut look = Outlook::default();
        let mut queued_prefill = 0;
        for &id in &self.running {
            let Some(seq) = self.seqs.get(&id) else { continue };
            if !seq.decoding {
                queued_prefill += seq.remaining();
            }
            let prefill = if seq.decoding { 0 } else { queued_prefill };
            if let Some(p) = self.projection(seq, self.kv.private_blocks(id), prefill) {
                look.insert(p);
            }
        }
        (look, queued_prefill)
    }

    /// The head's projection (first), then one per follower queued behind it, which forks the
    /// prompt a step later.
    fn admission_projections(&self, seq: &Sequence, cost: usize, group: usize, queued_prefill: usize) -> Vec<Projection> {
        let prefill = queued_prefill + seq.tokens.len();
        let Some(head) = self.projection(seq, cost, prefill) else { return Vec::new() };
        let follower_cost = self.kv.fork_cost(seq.tokens.len(), seq.tokens.len());
        let follower = Projection { last_step: head.last_step + 1, private: follower_cost, ..head };
        std::iter::once(head).chain(std::iter::repeat_n(follower, group - 1)).collect()
    }

    /// `seq`'s projected future: it grows one token per step (after `prefill_tokens` more prompt
    /// tokens, its own included, are computed at the step budget's pace) up to the growth ratio's
    /// share of its remaining `max_tokens` (at most [`GROWTH_CLIP`]), holding `private` blocks of
    /// its own. None: no limit known.
    fn projection(&self, seq: &Sequence, private: usize, prefill_tokens: usize) -> Option<Projection> {
        let max_len = seq.max_len?;
        let len = seq.tokens.len().max(1);
        // The newest token never needs a slot: the last step holds max_len - 1 tokens.
        let remaining = max_len.saturating_sub(1).saturating_sub(len).min(GROWTH_CLIP);
        let grow = ((remaining as f64 * self.growth_ratio).ceil() as usize).min(remaining);
        let prefill_budget = self.config.max_num_batched_tokens.saturating_sub(self.running.len()).max(1);
        let prefill_steps = prefill_tokens.div_ceil(prefill_budget).saturating_sub(1);
        Some(Projection { last_step: grow + prefill_steps, offset: (len - 1) % self.kv.block_size(), private })
    }

    /// Where the choice `id` follows stands: still computing the shared prompt (wait), done
    /// (fork its blocks), or nothing to follow (gone, not running, or not the same prompt and
    /// adapter: allocate as usual).
    fn leader_of(&self, id: SeqId) -> Leader {
        let Some(seq) = self.seqs.get(&id) else { return Leader::None };
        let Some(leader_id) = seq.follows else { return Leader::None };
        let Some(leader) = self.seqs.get(&leader_id) else { return Leader::None };
        let same_prompt = leader.lora == seq.lora
            && leader.prompt_len == seq.prompt_len
            && leader.tokens.get(..leader.prompt_len) == seq.tokens.get(..seq.prompt_len);
        if !same_prompt || !self.running.contains(&leader_id) {
            return Leader::None;
        }
        if leader.decoding {
            Leader::Ready(leader_id, leader.num_computed.min(leader.prompt_len))
        } else {
            Leader::Computing
        }
    }

    fn build_batch(&self, out: &mut SchedulerOutput) {
        let total: usize = out.chunks.iter().map(|c| c.num_tokens).sum();
        let batch = &mut out.batch;
        batch.tokens.reserve(total);
        batch.positions.reserve(total);
        for c in &out.chunks {
            let (Some(seq), Some(table)) = (self.seqs.get(&c.id), self.kv.block_table(c.id)) else {
                continue;
            };
            let end = c.context_len + c.num_tokens;
            let blocks = self.kv.blocks_for(end).min(table.len());
            batch.seqs.push(SeqChunk {
                start: batch.tokens.len(),
                len: c.num_tokens,
                context_len: c.context_len,
                block_table: table[..blocks].to_vec(),
                wants_logits: c.wants_logits,
                lora_slot: None, // the engine thread assigns slots after planning
            });
            batch.tokens.extend_from_slice(&seq.tokens[c.context_len..end]);
            batch.positions.extend((c.context_len..end).map(|p| p as u32));
        }
    }

    /// Records that a step ran: its tokens are computed and full blocks enter the prefix cache.
    pub fn step_done(&mut self, out: &SchedulerOutput) {
        for c in &out.chunks {
            let Some(seq) = self.seqs.get_mut(&c.id) else { continue };
            seq.num_computed = c.context_len + c.num_tokens;
            if c.wants_logits {
                seq.decoding = true;
            }
            self.kv.commit_computed(c.id, &seq.tokens, seq.num_computed);
        }
    }
}

enum Leader {
    None,
    Computing,
    /// The leader's id and how many prompt tokens it has computed.
    Ready(SeqId, usize),
}

fn prefill_chunk(seq: &Sequence, n: usize) -> ScheduledChunk {
    ScheduledChunk {
        id: seq.id,
        context_len: seq.num_computed,
        num_tokens: n,
        wants_logits: seq.num_computed + n == seq.tokens.len(),
        is_decode: false,
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod pressure_tests;

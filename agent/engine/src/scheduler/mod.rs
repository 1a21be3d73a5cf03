//! Builds each step's flat batch: one decode token for every running sequence first, then prefill
//! chunks (of sequences part-way through their prompt, then of newly admitted ones, FCFS), within
//! `max_num_batched_tokens` and `max_num_seqs`. Admits a sequence only when its blocks exist, and
//! preempts the newest running sequence (by recompute) when a decode token finds no block.

mod sequence;

use std::collections::{HashMap, VecDeque};

pub use sequence::Sequence;

use crate::plan::{SeqChunk, StepBatch};
use crate::kv::{BlockManager, SeqId};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
}

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
    /// In admission order: the last one is the newest, the first to be preempted.
    running: Vec<SeqId>,
    /// Most distinct LoRA adapters among running sequences (the backend's slots); None: no limit.
    max_loras: Option<usize>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: BlockManager) -> Self {
        Scheduler { config, kv, seqs: HashMap::new(), waiting: VecDeque::new(), running: Vec::new(), max_loras: None }
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

    /// Drops a sequence wherever it is and frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let seq = self.seqs.remove(&id)?;
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

    fn preempt(&mut self, id: SeqId) {
        self.kv.free(id);
        self.running.retain(|&r| r != id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            // Recompute from prompt + generated tokens: nothing generated is lost or repeated.
            seq.num_computed = 0;
            seq.decoding = false;
        }
        // Preempted newest-first and pushed to the front, so the queue stays oldest-first.
        self.waiting.push_front(id);
    }

    fn admit(&mut self, out: &mut SchedulerOutput, budget: &mut usize) {
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let Some(lora_id) = self.seqs.get(&id).map(|s| s.lora) else {
                self.waiting.pop_front();
                continue;
            };
            // FCFS as for blocks: the head waits until a LoRA slot's adapter is no longer running.
            if !self.lora_fits(lora_id) {
                break;
            }
            let leader = match self.leader_of(id) {
                Leader::Computing => break, // FCFS: it waits a step or two, nothing overtakes it
                Leader::Ready(leader, computed) => Some((leader, computed)),
                Leader::None => None,
            };
            let Some(seq) = self.seqs.get_mut(&id) else { break };
            // FCFS: if the oldest waiting sequence does not fit, nothing behind it jumps the queue.
            let allocated = match leader {
                Some((leader, computed)) => self.kv.fork(leader, id, &seq.tokens, computed),
                None => self.kv.allocate(id, &seq.tokens, seq.lora),
            };
            let Some(cached) = allocated else { break };
            self.waiting.pop_front();
            seq.num_computed = cached;
            out.admitted.push(Admission { id, cached_tokens: cached, first_time: !seq.ever_scheduled });
            seq.ever_scheduled = true;
            let n = seq.remaining().min(*budget);
            *budget -= n;
            out.chunks.push(prefill_chunk(seq, n));
            self.running.push(id);
        }
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

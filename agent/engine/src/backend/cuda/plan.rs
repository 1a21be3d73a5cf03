//! A [`StepBatch`] turned into the flat metadata the kernels read, checked first: a bad plan must be
//! an error, never a write outside the KV cache.
//!
//! Everything is packed into one i32 array (one host→device copy per step) at offsets fixed by the
//! capacities, so device addresses stay the same from step to step (what CUDA graphs need).

use crate::plan::StepBatch;
use crate::{EngineError, Result};

/// Capacities the step buffers were sized for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLayout {
    pub max_tokens: usize,
    pub max_seqs: usize,
    /// Block-table row width: `ceil(max_model_len / block_size)`.
    pub max_blocks: usize,
}

impl PlanLayout {
    pub fn ids(&self) -> usize {
        0
    }
    pub fn positions(&self) -> usize {
        self.max_tokens
    }
    pub fn slots(&self) -> usize {
        2 * self.max_tokens
    }
    pub fn token_seq(&self) -> usize {
        3 * self.max_tokens
    }
    pub fn logit_rows(&self) -> usize {
        4 * self.max_tokens
    }
    /// Per token: its sequence's LoRA slot, -1 for the base model.
    pub fn lora_slots(&self) -> usize {
        4 * self.max_tokens + self.max_seqs
    }
    pub fn block_tables(&self) -> usize {
        5 * self.max_tokens + self.max_seqs
    }
    pub fn len(&self) -> usize {
        self.block_tables() + self.max_seqs * self.max_blocks
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What the model geometry allows.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub vocab: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_model_len: usize,
    /// LoRA slots the backend holds (0: LoRA not enabled).
    pub lora_slots: usize,
}

/// The prefix of the packed array a step of `num_seqs` sequences uses (what must be copied).
pub fn used_len(layout: &PlanLayout, num_seqs: usize) -> usize {
    layout.block_tables() + num_seqs * layout.max_blocks
}

/// Fills `packed` (length `layout.len()`) for `batch`; returns the number of logit rows. Sequences
/// with a LoRA slot need `lim.lora_slots` to cover it: a request that asked for an adapter is never
/// run on the base model silently.
pub fn pack(batch: &StepBatch, layout: &PlanLayout, lim: &Limits, packed: &mut [i32]) -> Result<usize> {
    let bad = |m: String| EngineError::InvalidRequest(m);
    let n = batch.tokens.len();
    if batch.positions.len() != n {
        return Err(bad(format!("{} tokens but {} positions", n, batch.positions.len())));
    }
    if n > layout.max_tokens {
        return Err(bad(format!("{n} tokens in one step, the backend holds {}", layout.max_tokens)));
    }
    if batch.seqs.len() > layout.max_seqs {
        return Err(bad(format!("{} sequences in one step, the backend holds {}", batch.seqs.len(), layout.max_seqs)));
    }
    debug_assert_eq!(packed.len(), layout.len());
    let mut covered = 0usize;
    let mut rows = 0usize;
    for (s, seq) in batch.seqs.iter().enumerate() {
        let lora_slot = match seq.lora_slot {
            None => -1,
            Some(slot) if lim.lora_slots == 0 => {
                return Err(EngineError::Unsupported(format!("sequence {s}: LoRA slot {slot}, but LoRA is not enabled on this backend")))
            }
            Some(slot) if slot as usize >= lim.lora_slots => {
                return Err(bad(format!("sequence {s}: LoRA slot {slot} outside the {} slots", lim.lora_slots)))
            }
            Some(slot) => slot as i32,
        };
        if seq.start != covered || seq.len == 0 || seq.start + seq.len > n {
            return Err(bad(format!("sequence {s}: chunk {}..{} does not tile the batch", seq.start, seq.start + seq.len)));
        }
        covered += seq.len;
        let end = seq.context_len + seq.len;
        if end > lim.max_model_len {
            return Err(bad(format!("sequence {s}: {end} positions exceed max_model_len {}", lim.max_model_len)));
        }
        if seq.block_table.len() * lim.block_size < end || seq.block_table.len() > layout.max_blocks {
            return Err(bad(format!("sequence {s}: {} blocks cannot hold {end} positions", seq.block_table.len())));
        }
        // Only the sequence's own blocks are written: kernels read block i only for positions
        // inside the context, so what lies beyond (stale entries) is never read. Rows are as wide
        // as max_model_len allows, so filling them whole would cost more than the step's own work.
        let row = &mut packed[layout.block_tables() + s * layout.max_blocks..][..seq.block_table.len()];
        for (slot, &b) in row.iter_mut().zip(&seq.block_table) {
            if b as usize >= lim.num_blocks {
                return Err(bad(format!("sequence {s}: block {b} outside the cache ({} blocks)", lim.num_blocks)));
            }
            *slot = b as i32;
        }
        for i in seq.start..seq.start + seq.len {
            let pos = seq.context_len + (i - seq.start);
            if batch.positions[i] as usize != pos {
                return Err(bad(format!("token {i}: position {} but the chunk says {pos}", batch.positions[i])));
            }
            let tok = batch.tokens[i];
            if tok as usize >= lim.vocab {
                return Err(bad(format!("token id {tok} outside the vocabulary ({})", lim.vocab)));
            }
            packed[layout.ids() + i] = tok as i32;
            packed[layout.positions() + i] = pos as i32;
            let block = seq.block_table[pos / lim.block_size] as usize;
            packed[layout.slots() + i] = (block * lim.block_size + pos % lim.block_size) as i32;
            packed[layout.token_seq() + i] = s as i32;
            packed[layout.lora_slots() + i] = lora_slot;
        }
        if seq.wants_logits {
            packed[layout.logit_rows() + rows] = (seq.start + seq.len - 1) as i32;
            rows += 1;
        }
    }
    if covered != n {
        return Err(bad(format!("sequences cover {covered} of {n} tokens")));
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::SeqChunk;

    fn seq(start: usize, len: usize, ctx: usize, blocks: Vec<u32>, logits: bool) -> SeqChunk {
        SeqChunk { start, len, context_len: ctx, block_table: blocks, wants_logits: logits, lora_slot: None }
    }

    const LIM: Limits = Limits { vocab: 100, num_blocks: 10, block_size: 4, max_model_len: 32, lora_slots: 0 };
    const LAYOUT: PlanLayout = PlanLayout { max_tokens: 8, max_seqs: 3, max_blocks: 8 };

    #[test]
    fn packs_slots_sequences_and_logit_rows() {
        // A decode token at position 5 (blocks 7, 2) and a 3-token prefill chunk at 0..3 (block 4).
        let batch = StepBatch {
            tokens: vec![11, 21, 22, 23],
            positions: vec![5, 0, 1, 2],
            seqs: vec![seq(0, 1, 5, vec![7, 2], true), seq(1, 3, 0, vec![4], false)],
        };
        let mut packed = vec![-7; LAYOUT.len()];
        let rows = pack(&batch, &LAYOUT, &LIM, &mut packed).unwrap();
        assert_eq!(rows, 1);
        assert_eq!(&packed[0..4], &[11, 21, 22, 23]);
        assert_eq!(&packed[LAYOUT.positions()..][..4], &[5, 0, 1, 2]);
        // position 5 → block index 1 (id 2), offset 1 → slot 9; positions 0..3 of block 4 → 16, 17, 18.
        assert_eq!(&packed[LAYOUT.slots()..][..4], &[9, 16, 17, 18]);
        assert_eq!(&packed[LAYOUT.token_seq()..][..4], &[0, 1, 1, 1]);
        assert_eq!(packed[LAYOUT.logit_rows()], 0);
        assert_eq!(&packed[LAYOUT.block_tables()..][..2], &[7, 2]);
        assert_eq!(packed[LAYOUT.block_tables() + LAYOUT.max_blocks], 4);
    }

    #[test]
    fn rejects_plans_that_would_write_outside_the_cache() {
        let mut packed = vec![0; LAYOUT.len()];
        let cases = [
            // block id beyond the cache
            StepBatch { tokens: vec![1], positions: vec![0], seqs: vec![seq(0, 1, 0, vec![10], true)] },
            // too few blocks for the positions
            StepBatch { tokens: vec![1], positions: vec![4], seqs: vec![seq(0, 1, 4, vec![1], true)] },
            // token outside the vocabulary
            StepBatch { tokens: vec![100], positions: vec![0], seqs: vec![seq(0, 1, 0, vec![1], true)] },
            // positions disagree with the chunk
            StepBatch { tokens: vec![1], positions: vec![3], seqs: vec![seq(0, 1, 0, vec![1], true)] },
            // chunks do not tile the batch
            StepBatch { tokens: vec![1, 2], positions: vec![0, 1], seqs: vec![seq(0, 1, 0, vec![1], true)] },
            // beyond max_model_len
            StepBatch { tokens: vec![1], positions: vec![32], seqs: vec![seq(0, 1, 32, vec![0; 9], true)] },
            // a LoRA slot while LoRA is not enabled
            StepBatch {
                tokens: vec![1],
                positions: vec![0],
                seqs: vec![SeqChunk { lora_slot: Some(0), ..seq(0, 1, 0, vec![1], true) }],
            },
        ];
        for (i, b) in cases.iter().enumerate() {
            assert!(pack(b, &LAYOUT, &LIM, &mut packed).is_err(), "case {i} accepted");
        }
    }

    #[test]
    fn packs_lora_slots_per_token_and_rejects_slots_beyond_the_stack() {
        let lim = Limits { lora_slots: 2, ..LIM };
        let batch = StepBatch {
            tokens: vec![11, 21, 22],
            positions: vec![5, 0, 1],
            seqs: vec![
                SeqChunk { lora_slot: Some(1), ..seq(0, 1, 5, vec![7, 2], true) },
                seq(1, 2, 0, vec![4], true),
            ],
        };
        let mut packed = vec![-7; LAYOUT.len()];
        assert_eq!(pack(&batch, &LAYOUT, &lim, &mut packed).unwrap(), 2);
        assert_eq!(&packed[LAYOUT.lora_slots()..][..3], &[1, -1, -1]);
        let beyond = StepBatch {
            tokens: vec![1],
            positions: vec![0],
            seqs: vec![SeqChunk { lora_slot: Some(2), ..seq(0, 1, 0, vec![1], true) }],
        };
        assert!(pack(&beyond, &LAYOUT, &lim, &mut packed).is_err());
    }
}

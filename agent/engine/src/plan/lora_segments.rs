//! The per-step segment table: which contiguous token ranges of a flat batch use which LoRA slot.
//! Built once per step and shared by every layer and module (and, in the CUDA backend, handed to
//! the grouped shrink/expand kernels as is).

use super::step::StepBatch;

/// Slot id of a base-model segment in [`LoraBatchPlan::seg_slots`].
pub const NO_SLOT: i32 = -1;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraBatchPlan {
    /// Segment `i` covers tokens `seg_starts[i] .. seg_starts[i + 1]`; one more entry than segments.
    pub seg_starts: Vec<u32>,
    /// Slot of each segment, [`NO_SLOT`] for the base model.
    pub seg_slots: Vec<i32>,
}

impl LoraBatchPlan {
    /// Groups the batch's tokens into maximal runs of equal slot (adjacent sequences with the same
    /// adapter share one segment).
    pub fn from_batch(batch: &StepBatch) -> LoraBatchPlan {
        let mut plan = LoraBatchPlan::default();
        let mut end = 0u32;
        for seq in batch.seqs.iter().filter(|s| s.len > 0) {
            let slot = seq.lora_slot.map_or(NO_SLOT, |s| s as i32);
            let start = seq.start as u32;
            // Sequences are laid out back to back; a gap would be a scheduler bug, but keep the
            // table exact anyway by giving the gap its own base segment.
            if start != end {
                plan.push(end, NO_SLOT);
            }
            plan.push(start, slot);
            end = start + seq.len as u32;
        }
        if !plan.seg_slots.is_empty() {
            plan.seg_starts.push(end);
        }
        plan
    }

    fn push(&mut self, start: u32, slot: i32) {
        if self.seg_slots.last() == Some(&slot) {
            return;
        }
        self.seg_starts.push(start);
        self.seg_slots.push(slot);
    }

    pub fn num_segments(&self) -> usize {
        self.seg_slots.len()
    }

    /// True when no token of the step uses an adapter (the backend can skip LoRA entirely).
    pub fn is_base_only(&self) -> bool {
        self.seg_slots.iter().all(|&s| s == NO_SLOT)
    }

    /// `(token range, slot)` of every adapter segment (base segments skipped).
    pub fn lora_segments(&self) -> impl Iterator<Item = (std::ops::Range<usize>, usize)> + '_ {
        self.seg_slots
            .iter()
            .enumerate()
            .filter(|(_, &s)| s != NO_SLOT)
            .map(|(i, &s)| {
                (
                    self.seg_starts[i] as usize..self.seg_starts[i + 1] as usize,
                    s as usize,
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::SeqChunk;

    fn chunk(start: usize, len: usize, slot: Option<u32>) -> SeqChunk {
        SeqChunk {
            start,
            len,
            context_len: 0,
            block_table: vec![],
            wants_logits: true,
            lora_slot: slot,
        }
    }

    #[test]
    fn merges_adjacent_sequences_with_the_same_slot() {
        let batch = StepBatch {
            tokens: vec![0; 10],
            positions: vec![0; 10],
            seqs: vec![
                chunk(0, 1, Some(1)),
                chunk(1, 1, Some(1)),
                chunk(2, 3, None),
                chunk(5, 1, Some(0)),
                chunk(6, 4, Some(1)),
            ],
        };
        let plan = LoraBatchPlan::from_batch(&batch);
        assert_eq!(plan.seg_starts, vec![0, 2, 5, 6, 10]);
        assert_eq!(plan.seg_slots, vec![1, NO_SLOT, 0, 1]);
        assert!(!plan.is_base_only());
        assert_eq!(
            plan.lora_segments().collect::<Vec<_>>(),
            vec![(0..2, 1), (5..6, 0), (6..10, 1)]
        );
    }

    #[test]
    fn base_only_batch() {
        let batch = StepBatch {
            tokens: vec![0; 3],
            positions: vec![0; 3],
            seqs: vec![chunk(0, 3, None)],
        };
        let plan = LoraBatchPlan::from_batch(&batch);
        assert!(plan.is_base_only());
        assert_eq!(plan.lora_segments().count(), 0);
    }
}

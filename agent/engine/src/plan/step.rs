//! The plan for one forward pass: a flat batch of new tokens and, per sequence, where its tokens
//! sit and which KV blocks they read and write. The scheduler builds it; backends execute it.

/// One sequence's share of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct SeqChunk {
    /// Offset of this sequence's first token in [`StepBatch::tokens`].
    pub start: usize,
    /// Number of new tokens of this sequence in this step (1 for decode, up to a chunk for prefill).
    pub len: usize,
    /// Tokens of this sequence already in the KV cache before this step. The new tokens sit at
    /// positions `context_len .. context_len + len` and attend to everything before them.
    pub context_len: usize,
    /// Physical KV block ids covering positions `0 .. context_len + len` (block `i` holds positions
    /// `i*block_size .. (i+1)*block_size`).
    pub block_table: Vec<u32>,
    /// Return logits for this chunk's last token (false for a prefill chunk that is not the last).
    pub wants_logits: bool,
    /// LoRA slot applied to this sequence's tokens (None: base model).
    pub lora_slot: Option<u32>,
}

/// The plan for one forward pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepBatch {
    /// Token ids of every sequence's new tokens, concatenated in `seqs` order.
    pub tokens: Vec<u32>,
    /// Position of each token in its sequence (same length as `tokens`).
    pub positions: Vec<u32>,
    pub seqs: Vec<SeqChunk>,
}

impl StepBatch {
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}

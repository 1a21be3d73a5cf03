//! The backend trait: run the model over one flat batch of tokens.
//!
//! A step's batch is flat (`[num_tokens, hidden]`, no padding): the decode tokens of running sequences
//! and the prefill chunks of new ones, back to back. Only attention needs to know where one sequence
//! ends and the next begins; it learns that from [`SeqChunk`]s and reads/writes K and V through each
//! sequence's block table. Backends never schedule: they do what the plan says.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::config::ModelConfig;
use crate::Result;

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

/// Row-major logits, one row per [`SeqChunk`] with `wants_logits`, in batch order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn rows(&self) -> usize {
        if self.vocab == 0 { 0 } else { self.data.len() / self.vocab }
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
}

/// How one logits row's next token is chosen when the backend samples on its device (see
/// [`Backend::forward_sample`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowSampling {
    /// Temperature (below [`crate::sampling::GREEDY_TEMPERATURE`]: greedy), top-k (0: off), top-p
    /// (1: off), min-p (0: off), and `uniform` in [0, 1): the one draw of the request's own RNG
    /// for this token, so seeded requests stay reproducible whatever the batch.
    Draw { temperature: f32, top_k: u32, top_p: f32, min_p: f32, uniform: f32 },
    /// The row's logits go to the host, where the engine samples (penalties, logprobs).
    Host,
}

/// What [`Backend::forward_sample`] returns: per logits row, the device's choice (`None` for
/// [`RowSampling::Host`] rows), and the logits of the host rows only, in row order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SampledStep {
    pub tokens: Vec<Option<u32>>,
    pub host_logits: Logits,
}

/// Geometry of the paged KV cache a backend holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Runs the model. Owned by the engine thread; one call at a time.
pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;

    fn kv_shape(&self) -> KvCacheShape;

    /// Runs one step: writes K/V for every new token into its sequence's blocks, returns logits for
    /// the sequences that want them.
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits>;

    /// Whether [`Backend::forward_sample`] works (the engine then leaves logits on the device).
    fn samples_on_device(&self) -> bool {
        false
    }

    /// Runs one step like [`Backend::forward`] and picks each logits row's token on the device as
    /// `rows` says (one entry per row), so only token ids (and the logits of host rows) cross to
    /// the host. Backends without device sampling keep this default.
    fn forward_sample(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> Result<SampledStep> {
        let _ = (batch, rows);
        Err(crate::EngineError::Unsupported(format!("backend {} does not sample on its device", self.name())))
    }

    /// [`Backend::forward_sample`], calling `while_running` once while the device computes the step
    /// (everything enqueued, the tokens not yet waited for), so the engine's host work overlaps the
    /// device's. The default runs it first, then the step.
    fn forward_sample_with(&mut self, batch: &StepBatch, rows: &[RowSampling], while_running: &mut dyn FnMut()) -> Result<SampledStep> {
        while_running();
        self.forward_sample(batch, rows)
    }

    /// A short name for logs and `bench` output ("cpu", "cuda:0").
    fn name(&self) -> String;

    /// Prepares `max_loras` LoRA slots of rank up to `max_rank` (see [`crate::lora`]). Backends
    /// without LoRA support keep this default.
    fn enable_lora(&mut self, max_loras: usize, max_rank: usize) -> Result<()> {
        let _ = (max_loras, max_rank);
        Err(crate::EngineError::Unsupported(format!("backend {} has no LoRA support", self.name())))
    }

    /// Writes `adapter` into LoRA slot `slot` (replacing what was there). The engine calls it
    /// between steps, before the first step whose [`SeqChunk::lora_slot`] names that slot.
    fn set_lora_slot(&mut self, slot: u32, adapter: &crate::lora::LoraAdapter) -> Result<()> {
        let _ = (slot, adapter);
        Err(crate::EngineError::Unsupported(format!("backend {} has no LoRA support", self.name())))
    }
}

/// Bytes of KV cache one block takes in f32 (K and V, every layer).
pub fn kv_block_bytes(config: &ModelConfig, block_size: usize, bytes_per_elem: usize) -> usize {
    2 * config.num_hidden_layers * config.kv_dim() * block_size * bytes_per_elem
}

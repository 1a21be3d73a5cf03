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

// The step plan lives below the backend (in `crate::plan`); re-exported here because every
// backend call takes it.
pub use crate::plan::{ConstrainedRowRef, RowConstraints, RowSampling, SeqChunk, StepBatch};

/// Row-major logits, one row per [`SeqChunk`] with `wants_logits`, in batch order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Logits {
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }
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

/// The most one step may carry on a backend that sized its buffers for it (the CUDA backend's
/// scratch and plan arrays), reported so that the engine's own limits are checked against it once,
/// at start, instead of failing on the first large step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchCapacity {
    pub max_seqs: usize,
    pub max_tokens: usize,
}

/// Runs the model. Owned by the engine thread; one call at a time.
pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;

    fn kv_shape(&self) -> KvCacheShape;

    /// What one step may carry, where the backend sized its per-step buffers up front (None: no
    /// such limit). The engine refuses to start with a larger `max_num_seqs` or
    /// `max_num_batched_tokens`.
    fn batch_capacity(&self) -> Option<BatchCapacity> {
        None
    }

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

    /// Whether [`Backend::forward_sample_constrained`] works: the backend applies token masks and
    /// logit biases on its device, so constrained rows need not send their logits to the host.
    fn applies_constraints_on_device(&self) -> bool {
        false
    }

    /// [`Backend::forward_sample_with`] where rows may carry token masks and logit biases:
    /// `while_running` is called once while the device computes the step and returns them (so the
    /// masks' computation overlaps the device's work); they are applied to the logits before the
    /// device picks the rows' tokens.
    fn forward_sample_constrained(&mut self, batch: &StepBatch, rows: &[RowSampling], while_running: &mut dyn FnMut() -> RowConstraints) -> Result<SampledStep> {
        let _ = (batch, rows, while_running);
        Err(crate::EngineError::Unsupported(format!("backend {} does not apply token masks on its device", self.name())))
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

/// Runs an encoder (BERT family) over one ragged batch: no KV cache, no sampling. Owned by the
/// encoder's batching thread; one call at a time.
pub trait EncoderBackend: Send {
    /// The last layer's hidden states, `batch.num_tokens() × hidden_size`, row-major in batch order.
    /// A malformed batch is an error, never a panic.
    fn forward(&mut self, batch: &crate::plan::RaggedBatch) -> Result<Vec<f32>>;

    /// Each sequence's hidden states pooled as each of `modes` says (concatenated in that order):
    /// `batch.num_seqs() × modes.len() × hidden`, what the batching thread needs (embeddings and
    /// classifiers read nothing else). This default pools on the host after [`Self::forward`]; a
    /// device backend pools where the states are and copies only the result (at 16 tokens a
    /// sequence, 1/16 of the bytes).
    fn forward_pooled(&mut self, batch: &crate::plan::RaggedBatch, hidden: usize, modes: &[crate::encoder::sentence::PoolingMode]) -> Result<Vec<f32>> {
        let states = self.forward(batch)?;
        let mut out = Vec::with_capacity(batch.num_seqs() * modes.len() * hidden);
        for s in 0..batch.num_seqs() {
            let r = batch.range(s);
            out.extend(crate::encoder::sentence::pool(&states[r.start * hidden..r.end * hidden], hidden, modes));
        }
        Ok(out)
    }

    /// A short name for logs and bench output.
    fn name(&self) -> String;
}

/// Bytes of KV cache one block takes (K and V, every layer), where one token's head takes
/// `bytes_per_head` in the K (or the V) cache (a per-head-scaled cache's scale included).
pub fn kv_block_bytes(config: &ModelConfig, block_size: usize, bytes_per_head: usize) -> usize {
    2 * config.num_hidden_layers * config.num_key_value_heads * block_size * bytes_per_head
}

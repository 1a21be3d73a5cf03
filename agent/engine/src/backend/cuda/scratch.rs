//! Per-step activation buffers on the device, and the packed plan metadata's staging.

use std::sync::Arc;

use peregrine_kernels::cudarc::driver::{CudaContext, CudaEvent, CudaStream, DriverError, PinnedHostSlice};
use peregrine_kernels::ops::{packed_capacity, SAMPLE_PARAMS};
use peregrine_kernels::{Cuda, DevBuf};

use super::{gpu_err, PlanLayout};
use crate::config::ModelConfig;
use crate::sampling::MAX_LOGIT_BIAS;
use crate::{EngineError, Result};

/// Per-step activations, sized for `max_num_batched_tokens` tokens and `max_num_seqs` logit rows.
pub(super) struct Scratch {
    pub(super) residual: DevBuf<f32>,
    pub(super) normed: DevBuf<u16>,
    pub(super) qkv: DevBuf<u16>,
    pub(super) q: DevBuf<u16>,
    pub(super) attn: DevBuf<u16>,
    pub(super) delta: DevBuf<u16>,
    pub(super) gate_up: DevBuf<u16>,
    pub(super) act: DevBuf<u16>,
    pub(super) final_normed: DevBuf<u16>,
    pub(super) logits: DevBuf<f32>,
    pub(super) argmax: DevBuf<u32>,
    /// [`peregrine_kernels::ops::SAMPLE_PARAMS`] floats per logits row.
    pub(super) sample_params: DevBuf<f32>,
    pub(super) sample_params_host: Vec<f32>,
    /// One step's token masks and logit biases packed for token_mask.cu (one upload per step),
    /// sized at start for every row masked with the most biases ([`Scratch::constraint_words`]).
    pub(super) constraints: DevBuf<u32>,
    pub(super) constraints_host: Vec<u32>,
    /// Made at the first constrained step (most deployments never have one).
    pub(super) constraints_pinned: Option<PinnedUpload>,
    pub(super) meta: DevBuf<i32>,
    pub(super) meta_host: Vec<i32>,
    pub(super) attn_partials: DevBuf<f32>,
    /// W8A8 models only (else one element each): the 8-bit codes of the activations the next linear
    /// reads (`t × max(hidden, q_dim, intermediate)` bytes) and one scale per token.
    pub(super) xq: DevBuf<u8>,
    pub(super) xs: DevBuf<f32>,
    /// W8A8 models only: one counter per token for the attention kernels' fused quantization of
    /// their output (`AttnOutQuant`, `PEREGRINE_ATTN_QUANT=fused`; zero between launches).
    pub(super) attn_counters: DevBuf<i32>,
}

impl Scratch {
    pub(super) fn new(cuda: &Cuda, c: &ModelConfig, t: usize, layout: &PlanLayout, w8: bool) -> Result<Self> {
        let h = c.hidden_size;
        let r = layout.max_seqs;
        let a = |n: usize| cuda.gpu.alloc_zeros::<u16>(n).map_err(gpu_err);
        Ok(Scratch {
            residual: cuda.gpu.alloc_zeros::<f32>(t * h).map_err(gpu_err)?,
            normed: a(t * h)?,
            qkv: a(t * (c.q_dim() + 2 * c.kv_dim()))?,
            q: a(t * c.q_dim())?,
            attn: a(t * c.q_dim())?,
            delta: a(t * h)?,
            gate_up: a(t * 2 * c.intermediate_size)?,
            act: a(t * c.intermediate_size)?,
            final_normed: a(r * h)?,
            logits: cuda.gpu.alloc_zeros::<f32>(r * c.vocab_size).map_err(gpu_err)?,
            argmax: cuda.gpu.alloc_zeros::<u32>(r).map_err(gpu_err)?,
            sample_params: cuda.gpu.alloc_zeros::<f32>(r * SAMPLE_PARAMS).map_err(gpu_err)?,
            sample_params_host: vec![0.0; r * SAMPLE_PARAMS],
            constraints: cuda.gpu.alloc_zeros::<u32>(Self::constraint_words(c, r)).map_err(gpu_err)?,
            constraints_host: Vec::new(),
            constraints_pinned: None,
            meta: cuda.gpu.alloc_zeros::<i32>(layout.len()).map_err(gpu_err)?,
            meta_host: vec![0; layout.len()],
            attn_partials: cuda.gpu.alloc_zeros::<f32>(cuda.kernels.attention_partials_len()).map_err(gpu_err)?,
            xq: cuda.gpu.alloc_zeros::<u8>(if w8 { Self::xq_len(c, t) } else { 1 }).map_err(gpu_err)?,
            xs: cuda.gpu.alloc_zeros::<f32>(if w8 { t } else { 1 }).map_err(gpu_err)?,
            attn_counters: cuda.gpu.alloc_zeros::<i32>(if w8 { t } else { 1 }).map_err(gpu_err)?,
        })
    }

    /// The most words a step's packed constraints take: `rows` rows, each with a mask and
    /// [`MAX_LOGIT_BIAS`] biases (at batch 256 and a 128k vocabulary about 6 MB).
    pub(super) fn constraint_words(c: &ModelConfig, rows: usize) -> usize {
        packed_capacity(rows, c.vocab_size, MAX_LOGIT_BIAS)
    }

    fn xq_len(c: &ModelConfig, t: usize) -> usize {
        t * c.hidden_size.max(c.q_dim()).max(c.intermediate_size)
    }

    pub(super) fn bytes(c: &ModelConfig, t: usize, layout: &PlanLayout, w8: bool) -> usize {
        let h = c.hidden_size;
        let bf = t * (h * 3 + c.q_dim() * 2 + c.q_dim() + 2 * c.kv_dim() + 3 * c.intermediate_size) + layout.max_seqs * h;
        let w8_bytes = if w8 { Self::xq_len(c, t) + t * 8 } else { 0 };
        bf * 2 + t * h * 4 + layout.max_seqs * (c.vocab_size * 4 + 4 + SAMPLE_PARAMS * 4) + layout.len() * 4 + w8_bytes + Self::constraint_words(c, layout.max_seqs) * 4
    }
}

/// Pinned host memory for uploads that must not wait for the step in flight: the packed token
/// constraints (at batch 256 and Llama 3's vocabulary about 4 MB a step). The copy runs on a
/// stream of its own, so it overlaps the forward pass instead of queueing behind it (where its
/// ~0.2 ms at batch 256 would come between the last layer and sampling); the compute stream waits
/// for it only where the constraints are read. A pageable copy that large would also be staged in
/// pieces, each waiting for the copy engine.
pub(super) struct PinnedUpload {
    host: PinnedHostSlice<u32>,
    /// Copies run here.
    copies: Arc<CudaStream>,
    /// Recorded on `copies` after each copy: the compute stream waits for it before reading the
    /// words, and the next write into `host` waits for it.
    copied: CudaEvent,
    /// Recorded on the compute stream once it has read the words ([`PinnedUpload::release`]): the
    /// next copy into the device buffer waits for it.
    read: CudaEvent,
}

// SAFETY: used only from the engine thread that owns the backend (as the LoRA slot uploader).
unsafe impl Send for PinnedUpload {}

impl PinnedUpload {
    pub(super) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self> {
        let driver = |e: DriverError| gpu_err(e.into());
        // SAFETY: u32 has no invalid bit patterns; only the words written are copied.
        let host = unsafe { ctx.alloc_pinned::<u32>(len.max(1)) }.map_err(driver)?;
        Ok(PinnedUpload {
            host,
            copies: ctx.new_stream().map_err(driver)?,
            copied: ctx.new_event(None).map_err(driver)?,
            read: ctx.new_event(None).map_err(driver)?,
        })
    }

    /// Copies `words` to the start of `dev` through the pinned memory, on the copy stream, and
    /// makes `compute` wait for the copy before its next work; returns once both are queued. Call
    /// [`PinnedUpload::release`] after the work on `compute` that reads `dev`.
    pub(super) fn upload(&mut self, compute: &Arc<CudaStream>, words: &[u32], dev: &mut DevBuf<u32>) -> Result<()> {
        let driver = |e: DriverError| gpu_err(e.into());
        self.copied.synchronize().map_err(driver)?;
        let all = self.host.as_mut_slice().map_err(driver)?;
        let Some(staged) = all.get_mut(..words.len()) else {
            return Err(EngineError::Backend(format!("{} words to upload, {} pinned", words.len(), all.len())));
        };
        staged.copy_from_slice(words);
        // The previous step's reads of `dev` (an event never recorded is already complete).
        self.copies.wait(&self.read).map_err(driver)?;
        // A plain slice to the driver: it finds the page-locked pages itself and copies
        // asynchronously; `copied` stands in for the slice's own event, which this path does not record.
        dev.write(&self.copies, staged).map_err(gpu_err)?;
        self.copied.record(&self.copies).map_err(driver)?;
        compute.wait(&self.copied).map_err(driver)
    }

    /// After the work on `compute` that reads the uploaded words: the next upload waits for it.
    pub(super) fn release(&mut self, compute: &Arc<CudaStream>) -> Result<()> {
        self.read.record(compute).map_err(|e| gpu_err(e.into()))
    }
}

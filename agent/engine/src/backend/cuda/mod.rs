//! The CUDA backend: the same [`Backend`] contract as the CPU reference, on an NVIDIA GPU.
//!
//! bf16 weights and activations, an f32 residual stream, f32 accumulation everywhere; GEMMs through
//! cuBLAS, everything else in Peregrine's own kernels (`peregrine-kernels`). One step:
//!
//! ```text
//! embed → per layer: [add+]RMSNorm → qkv GEMM → RoPE + KV write → paged attention → o GEMM
//!                    → add+RMSNorm → gate_up GEMM → SiLU·mul → down GEMM
//!                      (decode-sized steps without LoRA: gate_up GEMV with SiLU·mul fused)
//!       → add+final norm (logit rows only) → LM head GEMM (f32) → logits / GPU argmax
//! ```
//!
//! The plan's metadata crosses to the device in one copy per step ([`plan`]).
//!
//! With 8-bit weights (`CudaOptions::quantization`, or an FP8 checkpoint) the seven decoder linears
//! are W8A8 ([`weights::Linear::W8`]): the norms and SwiGLU write each token's 8-bit codes and scale
//! beside their bf16 output (`add_rmsnorm_quant`, `silu_mul_quant`), the attention output is
//! quantized by its own kernel, and the linears run the 8-bit GEMV (≤ 16 tokens) or the 8-bit
//! tensor-core GEMM, both scales in their epilogue. LoRA reads the bf16 activations as before.

pub mod bench;
pub mod encoder;
mod graphs;
mod lora;
mod plan;
mod rope;
mod scratch;
mod timing;
mod weights;

pub use lora::LoraCapacity;
pub use plan::{Limits, PlanLayout};
pub use rope::{inv_freq, tables as rope_tables};
pub use weights::{GpuWeights, Linear};

use std::cell::Cell;

use peregrine_kernels::ops::{pack_token_constraints, AttnOutQuant, ConstrainedRow, DPtr, GemvLoraRows, KvRotation, LoraDelta, OuterScale, RopeCache, RopeTables, SAMPLE_PARAMS};
pub use peregrine_kernels::KvCacheDtype;
use peregrine_kernels::{Cuda, DevBuf, KernelError, OutType, W8Format};

use self::graphs::Graphs;
use self::lora::{BaseGemv, FusedProjection, FusedW8Io, GpuLora, LoraBase, LoraUpdate, Projection};
use self::scratch::{PinnedUpload, Scratch};
use self::timing::StepTiming;
use crate::backend::{kv_block_bytes, Backend, BatchCapacity, KvCacheShape, Logits, RowConstraints, RowSampling, SampledStep, StepBatch};
use crate::lora::{LoraAdapter, TargetModule};
use crate::config::ModelConfig;
use crate::model::rowquant::RowFormat;
use crate::{EngineError, Result};

pub(crate) fn gpu_err(e: KernelError) -> EngineError {
    match e {
        KernelError::NoDevice(_) | KernelError::MissingLibrary(_) => EngineError::Backend(format!("{e}; use --device cpu to run without a GPU")),
        other => EngineError::Backend(other.to_string()),
    }
}

/// Whether a CUDA device can be used (the driver loads and device 0 exists), with the reason if not.
/// Never panics, so `--device` can default to cuda when present.
pub fn available() -> std::result::Result<(), String> {
    peregrine_kernels::probe(0).map_err(|e| match e {
        KernelError::NoDevice(why) => why,
        other => other.to_string(),
    })
}

/// How the backend sizes itself.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    pub device: usize,
    pub block_size: usize,
    /// Fraction of the GPU's memory this process may take in all (weights, activations, KV cache).
    pub gpu_memory_utilization: f32,
    /// Longest sequence (prompt + output); checked against the KV cache at start.
    pub max_model_len: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    /// Fixed number of KV blocks instead of sizing from memory (tests).
    pub num_blocks: Option<usize>,
    /// Decode steps of up to this many sequences replay a CUDA graph captured for their exact batch
    /// size (0: never capture).
    pub cuda_graph_max_batch: usize,
    /// Capture each decode step as graphs of this many layers, launched back to back, instead of one
    /// (0: one graph; `PEREGRINE_GRAPH_SEGMENT_LAYERS` overrides it, for comparisons).
    pub cuda_graph_segment_layers: usize,
    /// LoRA slots to reserve before the KV cache is sized (`--enable-lora`); None: no LoRA unless
    /// [`Backend::enable_lora`] finds memory for it later.
    pub lora: Option<LoraCapacity>,
    /// Element type of the KV cache (`--kv-cache-dtype`): bf16, or e4m3 for twice the tokens and half
    /// the attention traffic.
    pub kv_cache_dtype: KvCacheDtype,
    /// Rotate q and k of every head by the normalized Walsh–Hadamard matrix before k is stored
    /// (`--kv-cache-dtype fp8`/`fp8-hadamard`): scores are unchanged, k's outliers are spread before
    /// they are rounded to the cache's type. Needs a power-of-two head dimension.
    pub kv_hadamard: bool,
    /// Rotate v too (`--kv-cache-dtype fp8-hadamard-qkv`; only with `kv_hadamard`): v's rounding
    /// error is spread over the head as k's is, and each head of the attention output is rotated
    /// back (H is its own inverse) before o_proj and its LoRA adapter read it.
    pub kv_hadamard_v: bool,
    /// `--quantization fp8|int8`: the decoder linears as 8-bit codes with one scale per output row
    /// (host weights are quantized by `RowQuantMatrix::quantize`, the CPU backend's values; dummy
    /// weights on the device), activations quantized per token (W8A8). None: bf16, unless the
    /// checkpoint's linears are 8-bit already (an FP8 checkpoint), which then stay 8-bit.
    pub quantization: Option<RowFormat>,
    /// Random weights only (benchmarks): run the online rotation of down_proj's input that
    /// `--quantization-rotation` adds, to measure its cost. The weights are not rotated (random
    /// ones compute nothing worth keeping); host weights say for themselves whether they are.
    pub random_down_rotation: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            device: 0,
            block_size: 16,
            gpu_memory_utilization: 0.9,
            max_model_len: 4096,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            num_blocks: None,
            cuda_graph_max_batch: 256,
            cuda_graph_segment_layers: 0,
            lora: None,
            kv_cache_dtype: KvCacheDtype::Bf16,
            kv_hadamard: false,
            kv_hadamard_v: false,
            quantization: None,
            random_down_rotation: false,
        }
    }
}

/// Refuses 8-bit linears this GPU or this model's shapes cannot run.
fn check_w8(cuda: &Cuda, c: &ModelConfig, f: RowFormat) -> Result<()> {
    let format: W8Format = weights::w8_format(f);
    if !cuda.kernels.w8_ready(format) {
        return Err(EngineError::InvalidRequest(format!(
            "--quantization {}: needs compute capability {} or newer (this GPU: {}.{})",
            f.name(),
            if format == W8Format::E4m3 { "8.9" } else { "8.0" },
            cuda.gpu.arch.0,
            cuda.gpu.arch.1
        )));
    }
    // The 8-bit kernels read 16 codes per load.
    if [c.hidden_size, c.q_dim(), c.intermediate_size].iter().any(|d| d % 16 != 0) {
        return Err(EngineError::Unsupported(format!(
            "--quantization {}: the CUDA backend's 8-bit kernels need hidden size, q dim and intermediate size that are multiples of 16 (model: {}, {}, {})",
            f.name(),
            c.hidden_size,
            c.q_dim(),
            c.intermediate_size
        )));
    }
    Ok(())
}

/// Where the weights come from.
pub enum WeightInit<'a> {
    Host(&'a crate::model::ModelWeights),
    /// Random bf16 weights made on the GPU (`--load-format dummy`; the decoder linears 8-bit with
    /// [`CudaOptions::quantization`]).
    Random { config: ModelConfig, seed: u64 },
}

pub struct CudaBackend {
    cuda: Cuda,
    config: ModelConfig,
    weights: GpuWeights,
    /// Per layer: K then V, each `num_blocks * kv_heads * block_size * head_dim` elements of
    /// `kv_dtype` in its layout ([`KvCacheDtype`]), in one allocation.
    kv_cache: DevBuf<u16>,
    kv_dtype: KvCacheDtype,
    /// Which heads `rope_kv_write` Hadamard-rotates ([`CudaOptions::kv_hadamard`], `kv_hadamard_v`).
    kv_rotation: KvRotation,
    /// `PEREGRINE_ATTN_QUANT=fused`: with 8-bit linears, the attention kernels quantize their own
    /// output instead of a `quant_rows` pass. Off by default: on an H100 the per-block count and the
    /// completing block's read-back cost more than the pass saves (docs/benchmarks.md, session 16).
    fused_attn_quant: bool,
    /// The block of the online rotation of down_proj's input (`ModelWeights::down_input_hadamard`),
    /// applied by `silu_mul_quant` as it quantizes that input.
    down_input_hadamard: Option<usize>,
    rope_cos: DevBuf<f32>,
    rope_sin: DevBuf<f32>,
    scratch: Scratch,
    layout: PlanLayout,
    limits: Limits,
    graphs: Graphs,
    timing: Option<StepTiming>,
    lora: Option<GpuLora>,
    /// Multiprocessors kept from cuBLAS's GEMMs in LoRA steps of [`LORA_SM_RESERVE_TOKENS`], for
    /// the LoRA path on its side stream ([`LORA_SM_RESERVE`], `PEREGRINE_LORA_SM_RESERVE`
    /// overrides it; 0 keeps every SM for the GEMMs).
    lora_sm_reserve: usize,
    /// The LoRA steps that keep them: [`LORA_SM_RESERVE_TOKENS`], or up to
    /// `PEREGRINE_LORA_SM_RESERVE_MAX_TOKENS` (for comparisons).
    lora_sm_reserve_tokens: std::ops::RangeInclusive<usize>,
}

/// SMs cuBLAS leaves to the side stream's LoRA kernels in decode-sized LoRA steps. Measured on the
/// H100 (docs/benchmarks.md, session 13): batch 256 with 4 rank-32 adapters +1.9 % (three runs
/// each of 0 / 8 / 16), batch 64 within noise; without it the grouped kernels wait for SMs until the
/// GEMM's last blocks retire.
const LORA_SM_RESERVE: usize = 16;
/// The same over 8-bit base weights, whose shorter GEMMs hide less of the side stream: measured on
/// the H200 (docs/benchmarks.md, session 24; fp8 weights, 4 rank-32 adapters, runs interleaved),
/// 32 SMs gave batch 64 / 256 +2.8 % / +3.3 % LoRA throughput over 16 (six runs of 32, two of 16),
/// 8, 24 and 48 no more than 16; over bf16 weights 24 was no better than 16.
const LORA_SM_RESERVE_8BIT: usize = 32;
/// The LoRA steps that keep SMs free: from 64 tokens (below, the projections are GEMVs or small
/// GEMMs and measured no gain) to the largest decode batch it was measured on
/// ([`lora::SIDE_PLAN_MAX_TOKENS`]; longer steps are 128/128's ~1,000-token decode steps, whose
/// groups ride the fused path, and compute-bound prefill).
const LORA_SM_RESERVE_TOKENS: std::ops::RangeInclusive<usize> = 64..=lora::SIDE_PLAN_MAX_TOKENS;

/// [`LORA_SM_RESERVE`] (over `eight_bit` weights [`LORA_SM_RESERVE_8BIT`]), or
/// `PEREGRINE_LORA_SM_RESERVE`, at most half the device's SMs.
fn lora_sm_reserve(cuda: &Cuda, eight_bit: bool) -> usize {
    let default = if eight_bit { LORA_SM_RESERVE_8BIT } else { LORA_SM_RESERVE };
    std::env::var("PEREGRINE_LORA_SM_RESERVE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(default).min(cuda.num_sms / 2)
}

/// Memory kept free beyond the computed needs: cuBLAS's internal buffers, CUDA graphs, the context.
const HEADROOM_BYTES: usize = 512 << 20;

impl CudaBackend {
    pub fn new(init: WeightInit<'_>, opts: &CudaOptions) -> Result<Self> {
        let cuda = Cuda::new(opts.device).map_err(gpu_err)?;
        let c = match &init {
            WeightInit::Host(w) => &w.config,
            WeightInit::Random { config, .. } => config,
        };
        let group = c.num_attention_heads / c.num_key_value_heads.max(1);
        if !matches!(c.head_dim, 64 | 128) || group == 0 || group > peregrine_kernels::ops::ATTN_MAX_GROUP || c.hidden_size % 8 != 0 {
            return Err(EngineError::Unsupported(format!(
                "the CUDA backend supports head_dim 64 or 128 and at most {} query heads per KV head (model: head_dim {}, {} heads over {} KV heads)",
                peregrine_kernels::ops::ATTN_MAX_GROUP,
                c.head_dim,
                c.num_attention_heads,
                c.num_key_value_heads
            )));
        }
        if opts.block_size == 0 || opts.max_model_len == 0 || opts.max_num_batched_tokens == 0 || opts.max_num_seqs == 0 {
            return Err(EngineError::InvalidRequest("block size, max_model_len, batch limits must be positive".into()));
        }
        if !(0.0..=1.0).contains(&opts.gpu_memory_utilization) {
            return Err(EngineError::InvalidRequest(format!("gpu_memory_utilization {} not in (0, 1]", opts.gpu_memory_utilization)));
        }
        // Before the weights go up: a cache type this GPU cannot serve is refused at once.
        cuda.kernels.check_kv_dtype(opts.kv_cache_dtype, opts.block_size).map_err(|e| EngineError::InvalidRequest(format!("--kv-cache-dtype: {e}")))?;
        let kv_rotation = KvRotation::of(opts.kv_hadamard, opts.kv_hadamard_v).map_err(|e| EngineError::InvalidRequest(format!("--kv-cache-dtype: {e}")))?;
        let w8 = match &init {
            WeightInit::Host(w) => GpuWeights::w8_format_of(w, opts.quantization),
            WeightInit::Random { .. } => opts.quantization,
        };
        if let Some(f) = w8 {
            check_w8(&cuda, c, f)?;
        }
        let down_input_hadamard = match &init {
            WeightInit::Host(w) => w.down_input_hadamard,
            WeightInit::Random { config, .. } => opts.random_down_rotation.then(|| crate::model::rotate::down_input_block(config.intermediate_size)).flatten(),
        };
        if down_input_hadamard.is_some() && w8.is_none() {
            // Only the 8-bit path's SwiGLU kernel rotates; a bf16 one would feed down_proj unrotated.
            return Err(EngineError::InvalidRequest("the rotated model (--quantization-rotation) needs 8-bit linears (--quantization fp8|int8) on cuda".into()));
        }
        if down_input_hadamard.is_some() && c.intermediate_size > peregrine_kernels::ops::SILU_HADAMARD_MAX_INTER {
            // Refused here, not at the first step's launch: the kernel holds a row in shared memory.
            return Err(EngineError::InvalidRequest(format!(
                "--quantization-rotation on cuda rotates rows of at most {} intermediate channels; this model has {}",
                peregrine_kernels::ops::SILU_HADAMARD_MAX_INTER,
                c.intermediate_size
            )));
        }
        let (_, total) = cuda.gpu.mem_info().map_err(gpu_err)?;
        // LoRA's fused groups (cuda/lora.rs, FusedNorms): their weights are loaded with every slot's
        // A rows after their own, rather than rebuilt when LoRA attaches.
        let plain_bf16_cache = opts.kv_cache_dtype == KvCacheDtype::Bf16 && kv_rotation == KvRotation::None;
        let lora_rows = opts.lora.and_then(|cap| GpuLora::fused_lora_rows(&cuda, c, cap, opts.max_num_batched_tokens, w8.is_some(), plain_bf16_cache)).unwrap_or([0; 4]);
        let (config, mut weights) = match init {
            WeightInit::Host(w) => (w.config.clone(), GpuWeights::upload(&cuda, w, w8, lora_rows)?),
            WeightInit::Random { config, seed } => {
                let w = GpuWeights::random(&cuda, &config, seed, w8, lora_rows)?;
                (config, w)
            }
        };
        let layout = PlanLayout {
            max_tokens: opts.max_num_batched_tokens,
            max_seqs: opts.max_num_seqs,
            max_blocks: opts.max_model_len.div_ceil(opts.block_size),
        };
        let scratch = Scratch::new(&cuda, &config, opts.max_num_batched_tokens, &layout, w8.is_some())?;
        let lora_sm_reserve = lora_sm_reserve(&cuda, w8.is_some());
        let lora_base = LoraBase { side_sms: lora_sm_reserve, eight_bit: w8.is_some() };
        let mut lora = opts.lora.map(|cap| GpuLora::new(&cuda, &config, cap, opts.max_num_batched_tokens, lora_base)).transpose()?;
        if let Some(lora) = &mut lora {
            // Without room for the extended weights LoRA still runs, every group on the side stream.
            if let Err(e) = lora.attach_fused_norms(&cuda, &mut weights, &config, plain_bf16_cache) {
                tracing::warn!(error = %e, "LoRA stays on the side stream");
            }
        }
        let (cos, sin) = rope::tables(&config, opts.max_model_len);
        let rope_cos = cuda.gpu.upload(&cos).map_err(gpu_err)?;
        let rope_sin = cuda.gpu.upload(&sin).map_err(gpu_err)?;
        cuda.gpu.synchronize().map_err(gpu_err)?;

        let block_bytes = kv_block_bytes(&config, opts.block_size, opts.kv_cache_dtype.head_bytes(config.head_dim));
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                // Measured, not estimated: what the weights and activations really took is gone from `free`.
                let (free, _) = cuda.gpu.mem_info().map_err(gpu_err)?;
                let allowed = (total as f64 * opts.gpu_memory_utilization as f64) as usize;
                let used = total - free;
                let budget = allowed.saturating_sub(used).saturating_sub(HEADROOM_BYTES);
                budget / block_bytes
            }
        };
        let needed = opts.max_model_len.div_ceil(opts.block_size);
        if num_blocks < needed {
            return Err(EngineError::InvalidRequest(format!(
                "max_model_len {} needs {needed} KV blocks of {} tokens, but only {num_blocks} fit \
                 (weights {:.2} GiB, activations {:.2} GiB, GPU {:.1} GiB at utilization {}); \
                 lower --max-model-len or raise --gpu-memory-utilization",
                opts.max_model_len,
                opts.block_size,
                weights.bytes() as f64 / (1u64 << 30) as f64,
                Scratch::bytes(&config, opts.max_num_batched_tokens, &layout, w8.is_some()) as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64,
                opts.gpu_memory_utilization
            )));
        }
        let kv_cache = cuda.gpu.alloc_zeros::<u16>((num_blocks * block_bytes).div_ceil(2)).map_err(gpu_err)?;
        tracing::info!(
            "cuda:{} {} sm_{}{}: weights {:.2} GiB ({}), KV cache {num_blocks} blocks × {} tokens ({:.2} GiB, {:?})",
            opts.device,
            cuda.gpu.name,
            cuda.gpu.arch.0,
            cuda.gpu.arch.1,
            weights.bytes() as f64 / (1u64 << 30) as f64,
            w8.map_or("bf16 linears", |f| if f == RowFormat::Int8 { "int8 linears" } else { "fp8 linears" }),
            opts.block_size,
            (num_blocks * block_bytes) as f64 / (1u64 << 30) as f64,
            opts.kv_cache_dtype
        );
        let limits = Limits {
            vocab: config.vocab_size,
            num_blocks,
            block_size: opts.block_size,
            max_model_len: opts.max_model_len,
            lora_slots: lora.as_ref().map_or(0, |l| l.capacity.max_loras),
        };
        let graphs = Graphs::new(opts.cuda_graph_max_batch, opts.cuda_graph_segment_layers);
        let lora_sm_reserve_tokens = match std::env::var("PEREGRINE_LORA_SM_RESERVE_MAX_TOKENS").ok().and_then(|v| v.parse::<usize>().ok()) {
            Some(max) => *LORA_SM_RESERVE_TOKENS.start()..=max,
            None => LORA_SM_RESERVE_TOKENS,
        };
        let fused_attn_quant = std::env::var("PEREGRINE_ATTN_QUANT").is_ok_and(|v| v == "fused");
        Ok(CudaBackend { cuda, config, weights, kv_cache, kv_dtype: opts.kv_cache_dtype, kv_rotation, fused_attn_quant, down_input_hadamard, rope_cos, rope_sin, scratch, layout, limits, graphs, timing: None, lora, lora_sm_reserve, lora_sm_reserve_tokens })
    }

    /// Device address of layer `l`'s K (`v = false`) or V cache.
    fn cache_ptr(&self, layer: usize, v: bool) -> u64 {
        let per_bytes = self.limits.num_blocks * self.config.num_key_value_heads * self.limits.block_size * self.kv_dtype.head_bytes(self.config.head_dim);
        self.kv_cache.ptr() + ((2 * layer + v as usize) * per_bytes) as u64
    }

    /// Runs the layers for `batch` and leaves the logits of the wanted rows in `scratch.logits`;
    /// returns the number of rows.
    fn run(&mut self, batch: &StepBatch) -> Result<usize> {
        let rows = plan::pack(batch, &self.layout, &self.limits, &mut self.scratch.meta_host)?;
        let n = batch.num_tokens();
        if n == 0 {
            return Ok(0);
        }
        self.cuda.gpu.ctx.bind_to_thread().map_err(|e| gpu_err(e.into()))?;
        if let Some(t) = &self.timing {
            t.start.0.record(&self.cuda.gpu.stream).map_err(|e| gpu_err(e.into()))?;
        }
        // One copy of the packed array's used prefix is cheaper than a copy per section. It stays
        // outside graphs: graphs read the same device addresses.
        let Scratch { meta, meta_host, .. } = &mut self.scratch;
        let used = plan::used_len(&self.layout, batch.seqs.len());
        meta.write(&self.cuda.gpu.stream, &meta_host[..used]).map_err(gpu_err)?;
        let with_lora = batch.seqs.iter().any(|s| s.lora_slot.is_some());
        let decode_only = rows == n && batch.seqs.iter().all(|s| s.len == 1);
        let key = (n, with_lora);
        if decode_only && n <= self.graphs.max_batch {
            if let Some(launched) = self.graphs.launch(key) {
                launched?;
            } else {
                self.step(n, n, rows, with_lora, &|_| Ok(())).map_err(gpu_err)?;
                if !self.graphs.seen.insert(key) {
                    self.capture(key, rows)?;
                }
            }
        } else {
            // Leading sequences of one token each (the scheduler puts decode tokens first).
            let decode_tokens = batch.seqs.iter().enumerate().take_while(|(i, s)| s.len == 1 && s.start == *i).count();
            self.step(n, decode_tokens, rows, with_lora, &|_| Ok(())).map_err(gpu_err)?;
        }
        Ok(rows)
    }

    /// Enqueues every operation of a step of `n` tokens whose metadata is already on the device; the
    /// first `decode_tokens` are each alone in their sequence (`with_lora`: some token has a LoRA
    /// slot, so the LoRA updates run after each projection). `layer_start` is called before each
    /// layer's first launch (graph capture may start a new graph there).
    fn step(&self, n: usize, decode_tokens: usize, rows: usize, with_lora: bool, layer_start: &dyn Fn(usize) -> peregrine_kernels::Result<()>) -> peregrine_kernels::Result<()> {
        let cuda = &self.cuda;
        let (gpu, k) = (&cuda.gpu, &cuda.kernels);
        let s = &gpu.stream;
        let c = &self.config;
        let sc = &self.scratch;
        let lay = self.layout;
        let m = |off: usize| sc.meta.ptr_at(off);
        let (h, hq, hkv, d, inter) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size);
        let qkv_w = c.q_dim() + 2 * c.kv_dim();
        let eps = c.rms_norm_eps;
        let bs = self.limits.block_size;
        let w = &self.weights;
        let lora = self.lora.as_ref().filter(|_| with_lora);
        let lora_slots = m(lay.lora_slots());
        // Set for every step (graphs capture the target in force): LoRA steps long enough for
        // cuBLAS / cuBLASLt GEMMs leave `lora_sm_reserve` SMs to the side stream, all others use
        // every SM.
        let sm_target = (self.lora_sm_reserve > 0).then(|| {
            let reserve = if lora.is_some() && self.lora_sm_reserve_tokens.contains(&n) { self.lora_sm_reserve } else { 0 };
            if reserve > 0 { cuda.num_sms - reserve } else { 0 }
        });
        if let Some(target) = sm_target {
            cuda.set_sm_count_target(target)?;
        }
        let w8 = w.w8;
        let (xq, xs) = (sc.xq.ptr(), sc.xs.ptr());
        // A base projection `y = x · Wᵀ` (`base`) with its group's LoRA updates around it; `outs`
        // are (module, column offset) in `y`. Some(update): the kernel that consumes `y` must add it
        // (decode-sized steps compute it beside the base projection; see cuda/lora.rs).
        // `swiglu`: gate|up only, where SwiGLU may be written with the updates fused into it.
        // `gemv`: which of our GEMVs the base projection is this step; either runs with the LoRA
        // rows `base` is handed (a one-token step's shrink; cuda/lora.rs).
        let project_into = |l: usize, x: DPtr, x_stride: usize, y: DPtr, y_stride: usize, outs: &[(TargetModule, usize)], swiglu: Option<DPtr>, gemv: BaseGemv, base: &dyn Fn(Option<&GemvLoraRows>) -> peregrine_kernels::Result<()>| -> peregrine_kernels::Result<LoraUpdate> {
            let Some(lora) = lora else { return base(None).map(|()| LoraUpdate::Added) };
            // SAFETY: as the step's block below; each module's columns stay inside each row of `y`,
            // `base` writes `y` only, and `swiglu` (sc.act) holds the step's rows of the SwiGLU width.
            unsafe { lora.apply_around(cuda, l, &Projection { x, x_stride, y, y_stride, outs, gemv }, lora_slots, n, swiglu, base) }
        };
        let project = |l: usize, x: DPtr, x_stride: usize, y: DPtr, y_stride: usize, outs: &[(TargetModule, usize)], gemv: BaseGemv, base: &dyn Fn(Option<&GemvLoraRows>) -> peregrine_kernels::Result<()>| -> peregrine_kernels::Result<Option<LoraDelta>> {
            project_into(l, x, x_stride, y, y_stride, outs, None, gemv, base).map(LoraUpdate::buffered)
        };
        // o and down with their LoRA inside the base GEMM and the norm after it, no side stream
        // (cuda/lora.rs, FusedNorms): the GEMM over the weight's full rows (the model's, then every
        // slot's A), planned for every SM since nothing runs beside it.
        let fused_lora = lora.and_then(|l| l.fused_projection(n).map(|p| (l, p)));
        // Over 8-bit weights the GEMM reads x's codes and token scales (xq/xs) and may leave its
        // scales to the consumer (returned; None: `p.y` is final).
        let fused_linear = |p: FusedProjection, row_stride: usize, x: DPtr, wt: &Linear, k_in: usize| -> peregrine_kernels::Result<Option<OuterScale>> {
            let reserved = sm_target.filter(|&t| t > 0 && p.full_sms);
            if reserved.is_some() {
                cuda.set_sm_count_target(0)?;
            }
            // SAFETY: as the step's block below; the weight holds `row_stride` rows of `k_in` (and
            // an 8-bit one as many row scales; GpuWeights::extend_rows_for_lora), `p.y` that many
            // columns for the step's rows, and xq/xs the step's codes and scales of x.
            let scale = match (wt, w8) {
                (Linear::Bf16(wb), _) => unsafe { cuda.linear(p.y, OutType::Bf16, x, wb.ptr(), n, row_stride, k_in).map(|()| None)? },
                (Linear::W8 { codes, scales }, Some(f)) => unsafe { cuda.linear_w8_deferred(f, p.y, sc.xq.ptr(), sc.xs.ptr(), codes.ptr(), scales.ptr(), n, row_stride, k_in)? },
                (Linear::W8 { .. }, None) => return Err(KernelError::Unsupported("8-bit weights without a format".into())),
            };
            if let Some(target) = reserved {
                cuda.set_sm_count_target(target)?;
            }
            Ok(scale)
        };
        // What a fused norm over 8-bit weights reads and writes besides the bf16 path's buffers.
        let fused_w8_io = |y_scale: Option<OuterScale>| w8.map(|_| FusedW8Io { y_scale, q: sc.xq.ptr(), q_scales: sc.xs.ptr() });
        let gemv_of = |wt: &Linear, x: DPtr, k_in: usize| match wt {
            Linear::Bf16(wb) if cuda.linear_is_gemv(n, k_in, x, wb.ptr()) => BaseGemv::Bf16,
            Linear::W8 { .. } if cuda.linear_w8_is_gemv(n) => BaseGemv::W8,
            _ => BaseGemv::None,
        };
        // SAFETY (whole block): every buffer was sized for max_num_batched_tokens tokens and
        // max_num_seqs rows, which `plan::pack` enforced, and every block id/slot was checked
        // against the cache.
        unsafe {
            // `y = x · Wᵀ` on the step's n tokens: a bf16 linear reads `x`; an 8-bit one reads x's
            // codes and token scales, which the kernel that produced `x` left in xq/xs.
            let linear = |y: DPtr, x: DPtr, wt: &Linear, n_out: usize, k_in: usize, rows: Option<&GemvLoraRows>| -> peregrine_kernels::Result<()> {
                match (wt, w8) {
                    (Linear::Bf16(wb), _) => match rows {
                        Some(rows) => cuda.linear_lora_rows(y, x, wb.ptr(), n_out, k_in, rows),
                        None => cuda.linear(y, OutType::Bf16, x, wb.ptr(), n, n_out, k_in),
                    },
                    (Linear::W8 { codes, scales }, Some(f)) => match rows {
                        Some(rows) => cuda.linear_w8_lora_rows(f, y, xq, xs, codes.ptr(), scales.ptr(), n_out, k_in, x, rows),
                        None => cuda.linear_w8(f, y, OutType::Bf16, xq, xs, codes.ptr(), scales.ptr(), n, n_out, k_in),
                    },
                    (Linear::W8 { .. }, None) => Err(KernelError::Unsupported("8-bit weights without a format".into())),
                }
            };
            // The projections whose output goes to a kernel that can scale it (every one: q|k|v to
            // RoPE, o and down to the norms, gate|up to SwiGLU): an unscaled 8-bit GEMM leaves its
            // token and row scales to that kernel (in `scale`), unless LoRA adds its updates into the
            // output (an in-place expand needs it final).
            let defer_scales = lora.is_none_or(|l| l.update_buffered(n));
            let linear_scaled_later = |y: DPtr, x: DPtr, wt: &Linear, n_out: usize, k_in: usize, scale: &Cell<Option<OuterScale>>, rows: Option<&GemvLoraRows>| -> peregrine_kernels::Result<()> {
                scale.set(match (wt, w8) {
                    // A one-token step's LoRA rows ride in our GEMVs, whose output is final.
                    (Linear::W8 { codes, scales }, Some(f)) if defer_scales && rows.is_none() => cuda.linear_w8_deferred(f, y, xq, xs, codes.ptr(), scales.ptr(), n, n_out, k_in)?,
                    _ => linear(y, x, wt, n_out, k_in, rows).map(|()| None)?,
                });
                Ok(())
            };
            // Whether a quantizing kernel must also write its bf16 output: only LoRA (which reads
            // bf16) or a bf16 linear among its consumers reads it.
            let bf16_read = |consumers: &[&Linear]| lora.is_some() || consumers.iter().any(|l| l.reads_bf16());
            // add + RMSNorm into `normed`, and with 8-bit linears its codes into xq/xs.
            // `lora`: the update of the projection that wrote `delta`; `delta_scale`: its scales, when
            // it left them to this kernel; `consumers`: the linears that read `normed`.
            let norm = |delta: Option<DPtr>, weight: DPtr, lora: Option<LoraDelta>, delta_scale: Option<OuterScale>, consumers: &[&Linear]| -> peregrine_kernels::Result<()> {
                match w8 {
                    Some(f) => {
                        let out = if bf16_read(consumers) { sc.normed.ptr() } else { 0 };
                        k.add_rmsnorm_quant(s, f, sc.residual.ptr(), delta, weight, out, xq, xs, n, h, eps, lora, delta_scale)
                    }
                    None => k.add_rmsnorm(s, sc.residual.ptr(), delta, weight, sc.normed.ptr(), None, n, h, eps, lora, delta_scale),
                }
            };
            k.embedding_gather(s, sc.residual.ptr(), w.embed.ptr(), m(lay.ids()), n, h)?;
            if let Some(lora) = lora {
                lora.begin_step(cuda, lora_slots, n)?;
            }
            // The previous down projection's LoRA update and deferred scales (the next norm adds
            // and applies them with its output), or the layer of a fused one (its norm expands).
            let (mut down_lora, mut down_scale, mut down_fused) = (None, None, None);
            for (l, lw) in w.layers.iter().enumerate() {
                layer_start(l)?;
                let delta = (l > 0).then(|| sc.delta.ptr());
                match (fused_lora, down_fused) {
                    (Some((lo, p)), Some((prev, scale))) => {
                        // Over 8-bit weights a fused q|k|v reads only the codes: no bf16 copy.
                        let out = if w8.is_some() && p.qkv_stride.is_some() { 0 } else { sc.normed.ptr() };
                        lo.fused_norm(cuda, TargetModule::Down, prev, p, sc.residual.ptr(), lw.input_norm.ptr(), out, lora_slots, n, eps, fused_w8_io(scale))?
                    }
                    _ => norm(delta, lw.input_norm.ptr(), down_lora, down_scale, &[&lw.qkv])?,
                }
                let (kc, vc) = (self.cache_ptr(l, false), self.cache_ptr(l, true));
                let fused_qkv = fused_lora.and_then(|(lo, p)| p.qkv_stride.map(|stride| (lo, p, stride)));
                if let Some((lo, p, stride)) = fused_qkv {
                    let qkv_scale = fused_linear(p, stride, sc.normed.ptr(), &lw.qkv, h)?;
                    let rope = RopeTables { positions: m(lay.positions()), cos: self.rope_cos.ptr(), sin: self.rope_sin.ptr() };
                    let cache = RopeCache { cache_slots: m(lay.slots()), q_out: sc.q.ptr(), k_cache: kc, v_cache: vc, hq, hkv, d, block_size: bs };
                    lo.fused_rope(cuda, l, p, lw.qkv_bias.as_ref().map(|b| b.ptr()), rope, cache, lora_slots, n, qkv_scale)?;
                } else {
                    let qkv_cols = [(TargetModule::Q, 0), (TargetModule::K, c.q_dim()), (TargetModule::V, c.q_dim() + c.kv_dim())];
                    let qkv_scale = Cell::new(None);
                    let qkv_lora = project(l, sc.normed.ptr(), h, sc.qkv.ptr(), qkv_w, &qkv_cols, gemv_of(&lw.qkv, sc.normed.ptr(), h), &|rows| linear_scaled_later(sc.qkv.ptr(), sc.normed.ptr(), &lw.qkv, qkv_w, h, &qkv_scale, rows))?;
                    k.rope_kv_write(
                        s,
                        sc.qkv.ptr(),
                        lw.qkv_bias.as_ref().map(|b| b.ptr()),
                        m(lay.positions()),
                        self.rope_cos.ptr(),
                        self.rope_sin.ptr(),
                        m(lay.slots()),
                        sc.q.ptr(),
                        kc,
                        vc,
                        n,
                        hq,
                        hkv,
                        d,
                        bs,
                        self.kv_dtype,
                        self.kv_rotation,
                        qkv_lora,
                        qkv_scale.get(),
                    )?;
                }
                // With 8-bit linears and `fused_attn_quant` the attention kernels quantize their own
                // output for o_proj, unless it must first be rotated back (below).
                let attn_quant = match w8 {
                    Some(f) if self.fused_attn_quant && self.kv_rotation != KvRotation::QKV => AttnOutQuant::new(f, xq, xs, sc.attn_counters.ptr()),
                    _ => AttnOutQuant::NONE,
                };
                k.paged_attention(s, sc.attn.ptr(), sc.q.ptr(), kc, vc, m(lay.block_tables()), lay.max_blocks, m(lay.token_seq()), m(lay.positions()), n, decode_tokens, hq, hkv, d, bs, Some(sc.attn_partials.ptr()), self.kv_dtype, attn_quant)?;
                if self.kv_rotation == KvRotation::QKV {
                    // The cache holds H·v, so attention gave H times each head's output: rotate it
                    // back in place, before the 8-bit quantizer, o_proj and its LoRA adapter read it
                    // (part of the step's launches, so inside the decode graphs too).
                    k.hadamard_heads(s, sc.attn.ptr(), n, hq, d)?;
                }
                if let (Some(f), false) = (w8, attn_quant.is_some()) {
                    // The one 8-bit input quantized by a pass of its own (see `fused_attn_quant`).
                    k.quant_rows(s, f, xq, xs, sc.attn.ptr(), n, c.q_dim())?;
                }
                if let Some((lo, p)) = fused_lora {
                    let o_scale = fused_linear(p, p.o_down_stride, sc.attn.ptr(), &lw.o, c.q_dim())?;
                    lo.fused_norm(cuda, TargetModule::O, l, p, sc.residual.ptr(), lw.post_norm.ptr(), sc.normed.ptr(), lora_slots, n, eps, fused_w8_io(o_scale))?;
                } else {
                    let o_scale = Cell::new(None);
                    let o_lora = project(l, sc.attn.ptr(), c.q_dim(), sc.delta.ptr(), h, &[(TargetModule::O, 0)], gemv_of(&lw.o, sc.attn.ptr(), c.q_dim()), &|rows| linear_scaled_later(sc.delta.ptr(), sc.attn.ptr(), &lw.o, h, c.q_dim(), &o_scale, rows))?;
                    norm(Some(sc.delta.ptr()), lw.post_norm.ptr(), o_lora, o_scale.get(), &[&lw.gate_up])?;
                }
                // Decode-sized bf16 steps without LoRA: one kernel for gate/up and SwiGLU; otherwise
                // the projection (+ LoRA updates on gate and up), then SwiGLU (quantizing its output
                // for an 8-bit down projection).
                let fused = match (&lw.gate_up, lora) {
                    (Linear::Bf16(gu), None) => cuda.gate_up_silu(sc.act.ptr(), sc.normed.ptr(), gu.ptr(), n, inter, h)?,
                    _ => false,
                };
                let fused_gate_up = fused_lora.filter(|(_, p)| p.gate_up && !fused);
                if let Some((lo, p)) = fused_gate_up {
                    // gate|up rides only over bf16 weights (a final output, no scales left).
                    fused_linear(p, p.gate_up_stride, sc.normed.ptr(), &lw.gate_up, h)?;
                    lo.fused_swiglu(cuda, l, p, sc.act.ptr(), lora_slots, n)?;
                } else if !fused {
                    let gate_up_cols = [(TargetModule::Gate, 0), (TargetModule::Up, inter)];
                    let gate_up_scale = Cell::new(None);
                    // bf16 linears: large steps may write SwiGLU with the updates fused (cuda/lora.rs).
                    let swiglu = w8.is_none().then(|| sc.act.ptr());
                    let gate_up_update = project_into(l, sc.normed.ptr(), h, sc.gate_up.ptr(), 2 * inter, &gate_up_cols, swiglu, gemv_of(&lw.gate_up, sc.normed.ptr(), h), &|rows| linear_scaled_later(sc.gate_up.ptr(), sc.normed.ptr(), &lw.gate_up, 2 * inter, h, &gate_up_scale, rows))?;
                    let swiglu_written = matches!(gate_up_update, LoraUpdate::SwigluWritten);
                    let gate_up_lora = gate_up_update.buffered();
                    let gate_up_scale = gate_up_scale.get();
                    match w8 {
                        _ if swiglu_written => {}
                        Some(f) => {
                            let out = if bf16_read(&[&lw.down]) { sc.act.ptr() } else { 0 };
                            k.silu_mul_quant(s, f, out, xq, xs, sc.gate_up.ptr(), n, inter, gate_up_lora, gate_up_scale, self.down_input_hadamard)?
                        }
                        // bf16 linears never leave scales.
                        None => k.silu_mul(s, sc.act.ptr(), sc.gate_up.ptr(), n, inter, gate_up_lora)?,
                    }
                }
                // The last layer's down keeps the side stream: the final norm reads only the logit rows.
                match fused_lora.filter(|_| l + 1 < w.layers.len()) {
                    Some((_, p)) => {
                        let scale = fused_linear(p, p.o_down_stride, sc.act.ptr(), &lw.down, inter)?;
                        (down_lora, down_scale, down_fused) = (None, None, Some((l, scale)));
                    }
                    None => {
                        let scale = Cell::new(None);
                        down_lora = project(l, sc.act.ptr(), inter, sc.delta.ptr(), h, &[(TargetModule::Down, 0)], gemv_of(&lw.down, sc.act.ptr(), inter), &|rows| linear_scaled_later(sc.delta.ptr(), sc.act.ptr(), &lw.down, h, inter, &scale, rows))?;
                        (down_scale, down_fused) = (scale.get(), None);
                    }
                }
            }
            if rows > 0 {
                let delta = (!w.layers.is_empty()).then(|| sc.delta.ptr());
                k.add_rmsnorm(s, sc.residual.ptr(), delta, w.final_norm.ptr(), sc.final_normed.ptr(), Some(m(lay.logit_rows())), rows, h, eps, down_lora, down_scale)?;
                cuda.linear(sc.logits.ptr(), OutType::F32, sc.final_normed.ptr(), w.lm_head_ptr(), rows, c.vocab_size, h)?;
            }
        }
        Ok(())
    }

    /// One step with greedy sampling on the GPU: only the chosen token ids cross to the host.
    pub fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>> {
        let rows = self.run(batch)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let (gpu, kernels) = (&self.cuda.gpu, &self.cuda.kernels);
        // SAFETY: logits hold `rows` rows of vocab f32, argmax has max_num_seqs >= rows slots.
        unsafe { kernels.argmax_rows(&gpu.stream, self.scratch.logits.ptr(), rows, self.config.vocab_size, self.scratch.argmax.ptr()) }.map_err(gpu_err)?;
        let mut ids = vec![0u32; rows];
        gpu.stream
            .memcpy_dtoh(&self.scratch.argmax.slice().slice(0..rows), &mut ids)
            .map_err(|e| gpu_err(e.into()))?;
        self.account_step()?;
        Ok(ids)
    }

    /// Waits for all queued work (benchmarks time whole steps with this).
    pub fn synchronize(&self) -> Result<()> {
        self.cuda.gpu.synchronize().map_err(gpu_err)
    }

    /// One step with sampling on the device. `while_running` is called once the step is enqueued,
    /// while the device computes it; where it returns constraints (token masks, logit biases), they
    /// are uploaded in one copy and applied to the logits just before the sampler, outside the CUDA
    /// graph: which rows are constrained, and how many, changes every step, while a graph replays
    /// fixed launches, and the sampler itself runs outside the graph too.
    fn sample_step(&mut self, batch: &StepBatch, sampling: &[RowSampling], while_running: &mut dyn FnMut() -> Option<RowConstraints>) -> Result<SampledStep> {
        let rows = self.run(batch)?;
        if sampling.len() != rows {
            return Err(EngineError::InvalidRequest(format!("{} sampling entries for {rows} logits rows", sampling.len())));
        }
        let vocab = self.config.vocab_size;
        if rows == 0 {
            let _ = while_running();
            self.account_step()?;
            return Ok(SampledStep { tokens: Vec::new(), host_logits: Logits { vocab, data: Vec::new() } });
        }
        let params = &mut self.scratch.sample_params_host[..rows * SAMPLE_PARAMS];
        for (p, how) in params.chunks_exact_mut(SAMPLE_PARAMS).zip(sampling) {
            p.copy_from_slice(&match *how {
                RowSampling::Draw { temperature, top_k, top_p, min_p, uniform } => [temperature, top_k as f32, top_p, min_p, uniform],
                // Greedy is the cheapest row to run; its choice is dropped.
                RowSampling::Host => [0.0, 0.0, 1.0, 0.0, 0.0],
            });
        }
        let Scratch { sample_params, sample_params_host, logits, argmax, constraints, constraints_host, constraints_pinned, .. } = &mut self.scratch;
        let stream = &self.cuda.gpu.stream;
        sample_params.write(stream, &sample_params_host[..rows * SAMPLE_PARAMS]).map_err(gpu_err)?;
        // The whole step is enqueued (the forward pass); the host's work overlaps it.
        if let Some(c) = while_running() {
            let packed_rows: Vec<ConstrainedRow> = c.rows().map(|r| ConstrainedRow { row: r.row, mask: r.mask, biases: r.biases }).collect();
            if packed_rows.iter().any(|r| r.row >= rows) {
                return Err(EngineError::InvalidRequest(format!("token constraints for a row past the step's {rows} logits rows")));
            }
            let n = pack_token_constraints(vocab, &packed_rows, constraints_host).map_err(gpu_err)?;
            if constraints_host.len() > constraints.len() {
                // Bounded at start for max_num_seqs rows with the most biases each: not reachable
                // through validated requests.
                return Err(EngineError::InvalidRequest(format!(
                    "{} words of token constraints exceed the {} reserved",
                    constraints_host.len(),
                    constraints.len()
                )));
            }
            if n > 0 {
                let pinned = match constraints_pinned {
                    Some(p) => p,
                    None => constraints_pinned.insert(PinnedUpload::new(&self.cuda.gpu.ctx, constraints.len())?),
                };
                pinned.upload(stream, constraints_host, constraints)?;
                // SAFETY: logits hold `rows` rows of vocab f32 and every packed row is below `rows`;
                // the packed buffer was laid out for this vocabulary with `n` rows.
                unsafe { self.cuda.kernels.apply_token_constraints(stream, logits.ptr(), vocab, constraints.ptr(), n) }.map_err(gpu_err)?;
                pinned.release(stream)?;
            }
        }
        // SAFETY: logits hold `rows` rows of vocab f32; params `rows` entries; argmax max_num_seqs >= rows.
        unsafe { self.cuda.kernels.sample_rows(stream, logits.ptr(), rows, vocab, sample_params.ptr(), argmax.ptr()) }.map_err(gpu_err)?;
        let mut ids = vec![0u32; rows];
        stream.memcpy_dtoh(&argmax.slice().slice(0..rows), &mut ids).map_err(|e| gpu_err(e.into()))?;
        let mut host = Vec::new();
        for (r, how) in sampling.iter().enumerate() {
            if *how == RowSampling::Host {
                let at = host.len();
                host.resize(at + vocab, 0.0);
                stream
                    .memcpy_dtoh(&logits.slice().slice(r * vocab..(r + 1) * vocab), &mut host[at..])
                    .map_err(|e| gpu_err(e.into()))?;
            }
        }
        self.account_step()?;
        let tokens = ids.into_iter().zip(sampling).map(|(id, how)| (*how != RowSampling::Host).then_some(id)).collect();
        Ok(SampledStep { tokens, host_logits: Logits { vocab, data: host } })
    }

    pub fn device_name(&self) -> &str {
        &self.cuda.gpu.name
    }

    /// Whether LoRA's o and down groups (and where the configuration allows, q|k|v and gate|up) ride
    /// in the base GEMMs and their consumers for decode-sized steps (cuda/lora.rs, `FusedNorms`)
    /// rather than on the side stream.
    pub fn lora_rides_in_base_gemms(&self) -> bool {
        self.lora.as_ref().is_some_and(|l| l.rides_in_base_gemms())
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes()
    }
}

impl Backend for CudaBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_shape(&self) -> KvCacheShape {
        KvCacheShape { num_blocks: self.limits.num_blocks, block_size: self.limits.block_size }
    }

    fn batch_capacity(&self) -> Option<BatchCapacity> {
        Some(BatchCapacity { max_seqs: self.layout.max_seqs, max_tokens: self.layout.max_tokens })
    }

    fn forward(&mut self, batch: &StepBatch) -> Result<Logits> {
        let rows = self.run(batch)?;
        let vocab = self.config.vocab_size;
        let mut data = vec![0f32; rows * vocab];
        if rows > 0 {
            self.cuda
                .gpu
                .stream
                .memcpy_dtoh(&self.scratch.logits.slice().slice(0..rows * vocab), &mut data)
                .map_err(|e| gpu_err(e.into()))?;
        }
        self.account_step()?;
        Ok(Logits { vocab, data })
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sample(&mut self, batch: &StepBatch, sampling: &[RowSampling]) -> Result<SampledStep> {
        self.forward_sample_with(batch, sampling, &mut || {})
    }

    fn forward_sample_with(&mut self, batch: &StepBatch, sampling: &[RowSampling], while_running: &mut dyn FnMut()) -> Result<SampledStep> {
        self.sample_step(batch, sampling, &mut || {
            while_running();
            None
        })
    }

    fn applies_constraints_on_device(&self) -> bool {
        true
    }

    fn forward_sample_constrained(&mut self, batch: &StepBatch, sampling: &[RowSampling], while_running: &mut dyn FnMut() -> RowConstraints) -> Result<SampledStep> {
        self.sample_step(batch, sampling, &mut || Some(while_running()))
    }

    fn enable_lora(&mut self, max_loras: usize, max_rank: usize) -> Result<()> {
        let want = LoraCapacity { max_loras, max_rank };
        match &self.lora {
            Some(l) if l.capacity.max_loras >= max_loras && l.capacity.max_rank >= max_rank => Ok(()),
            Some(l) => Err(EngineError::InvalidRequest(format!(
                "the CUDA backend reserved {} LoRA slots of rank {}; {max_loras} of rank {max_rank} asked (set them in CudaOptions::lora)",
                l.capacity.max_loras, l.capacity.max_rank
            ))),
            None => {
                // Not reserved at start: the KV cache took its share already, so this allocation may
                // not fit; a clear error then, never an OOM later.
                let base = LoraBase { side_sms: self.lora_sm_reserve, eight_bit: self.weights.w8.is_some() };
                let lora = GpuLora::new(&self.cuda, &self.config, want, self.layout.max_tokens, base).map_err(|e| {
                    EngineError::Backend(format!(
                        "LoRA stacks ({:.1} MiB) do not fit beside the KV cache: {e}; reserve them at start",
                        GpuLora::bytes(&self.config, want, self.layout.max_tokens) as f64 / (1 << 20) as f64
                    ))
                })?;
                let mut lora = lora;
                // The fused groups' weights move to larger buffers: graphs captured so far read the
                // old ones, so they go. Without room for the extension LoRA still runs, on the side stream.
                let plain_bf16_cache = self.kv_dtype == KvCacheDtype::Bf16 && self.kv_rotation == KvRotation::None;
                if let Err(e) = lora.attach_fused_norms(&self.cuda, &mut self.weights, &self.config, plain_bf16_cache) {
                    tracing::warn!(error = %e, "LoRA stays on the side stream");
                }
                self.graphs.clear();
                self.limits.lora_slots = max_loras;
                self.lora = Some(lora);
                Ok(())
            }
        }
    }

    fn set_lora_slot(&mut self, slot: u32, adapter: &LoraAdapter) -> Result<()> {
        let Some(lora) = &mut self.lora else {
            return Err(EngineError::Unsupported("LoRA is not enabled on this backend".into()));
        };
        lora.set_slot(&self.cuda, slot, adapter)
    }

    fn name(&self) -> String {
        format!("cuda:{}", self.cuda.gpu.ordinal)
    }
}

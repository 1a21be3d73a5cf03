//! Paged attention: attention.cu (a warp per key), attention_tiled.cu (a lane per key) and
//! attention_mma.cu (tensor cores), with the split-K combine.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig};

use super::{as_i32, as_u32, DPtr, Kernels, Launch, W8Format};
use crate::{KernelError, Result};

/// The paged-attention kernels (same contract): a warp per key (`attention.cu`), 32 keys per warp
/// with a lane per key (`attention_tiled.cu`), both on CUDA cores, and the tensor-core kernel
/// (`attention_mma.cu`: 16 query rows per decode block, 64 per prefill block, K/V tiles streamed
/// through shared memory with cp.async), the default: on an H100 it reads K/V of batched decode at
/// 2.7 TB/s against the tiled kernel's 1.4, and runs prefill attention 12x faster (docs/benchmarks.md). The CUDA-core kernels
/// remain for GPUs where the tensor-core kernel cannot get its shared memory, and for comparisons
/// (`PEREGRINE_ATTN`); among those two, split launches (small batches) take the warp kernel and the
/// others the tiled one. Batch shape alone decides, so a CUDA graph captured for a batch size always
/// replays the same kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    WarpPerKey,
    Tiled,
    Mma,
}

impl AttentionKernel {
    /// `PEREGRINE_ATTN=warp`, `tiled` or `mma` forces one kernel for every launch (comparisons).
    pub fn from_env() -> Option<Self> {
        match std::env::var("PEREGRINE_ATTN").as_deref() {
            Ok("warp") => Some(AttentionKernel::WarpPerKey),
            Ok("tiled") => Some(AttentionKernel::Tiled),
            Ok("mma") => Some(AttentionKernel::Mma),
            _ => None,
        }
    }
}

/// Element type of the paged KV cache (`--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvCacheDtype {
    /// bf16, [blocks, kv heads, block size, head dim] for K and V.
    #[default]
    Bf16,
    /// e4m3 bytes, scale 1 (no calibration, as vLLM's `fp8` without scales): half the bytes of bf16,
    /// so twice the tokens in the same memory and half the K/V traffic of decode attention. K as
    /// bf16's layout; V transposed within each block ([blocks, kv heads, head dim, block size]).
    /// Tensor-core attention only (sm_89+), block size a power of two, at least 16.
    Fp8E4m3,
    /// e4m3 bytes of `x / s` with one f32 scale `s = max |x| / 448` per token and KV head (the CPU
    /// backend's `KvElem::Fp8E4m3PerHead`): each head vector uses e4m3's whole range instead of its
    /// subnormals. Each (block, KV head) of K and of V is `block_size * (head_dim + 4)` bytes: the
    /// codes as [`KvCacheDtype::Fp8E4m3`] lays them out, then `block_size` f32 scales. Same kernels'
    /// limits as `Fp8E4m3`.
    Fp8E4m3PerHead,
    /// int8 codes `round(x / s)` with one f32 scale `s = max |x| / 127` per token and KV head (the
    /// CPU backend's `KvElem::Int8PerHead`): a uniform grid over the head vector's range, several
    /// times closer than e4m3 for near-Gaussian K and V. Layout, bytes and kernels' limits as
    /// [`KvCacheDtype::Fp8E4m3PerHead`]; the fp8 kernels read it with another byte conversion.
    Int8PerHead,
}

impl KvCacheDtype {
    /// Bytes one token's head of `d` values takes in the K (or the V) cache, scales included.
    pub fn head_bytes(self, d: usize) -> usize {
        match self {
            KvCacheDtype::Bf16 => 2 * d,
            KvCacheDtype::Fp8E4m3 => d,
            KvCacheDtype::Fp8E4m3PerHead | KvCacheDtype::Int8PerHead => d + 4,
        }
    }

    /// Whether the cache holds 8-bit codes, e4m3 or int8 (read by the fp8 tensor-core kernels only).
    pub fn is_fp8(self) -> bool {
        self != KvCacheDtype::Bf16
    }

    /// Whether each token's head carries its own f32 scale after the block's codes.
    pub fn has_head_scales(self) -> bool {
        matches!(self, KvCacheDtype::Fp8E4m3PerHead | KvCacheDtype::Int8PerHead)
    }
}

/// Most query heads one KV head may serve (attention.cu's ATTN_MAX_GROUP).
pub const ATTN_MAX_GROUP: usize = 8;
/// Largest head dimension the attention kernels are built for.
pub const ATTN_MAX_HEAD_DIM: usize = 128;
const ATTN_THREADS: u32 = 128;
/// attention_mma.cu's tile geometry: query rows per block of the prefill kernel, keys per tile,
/// pipeline stages, row padding.
const MMA_ROWS_PREFILL: usize = 64;
const MMA_KT: usize = 64;
const MMA_STAGES: usize = 2;
const MMA_PAD: usize = 8;
const MMA_F8_PAD: usize = 16;
const MMA_F8_STAGES: usize = 3;
/// attention_mma_f8.cu's F8K_STAGES.
const F8_DECODE_STAGES: usize = 3;

/// The arguments every attention kernel takes first, in order.
struct AttentionArgs {
    out: DPtr,
    q: DPtr,
    k_cache: DPtr,
    v_cache: DPtr,
    block_tables: DPtr,
    max_blocks: i32,
    token_seq: DPtr,
    positions: DPtr,
    hq: i32,
    hkv: i32,
    block_size: i32,
    scale: f32,
    quant: AttnOutQuant,
}

/// The attention output's 8-bit quantization, done by the attention kernels themselves (quant8.cu's
/// `attn_out_rows_written`: the block that completes a token's output row writes its codes and
/// scale, exactly what [`Kernels::quant_rows`] would write for that row). Mirrors quant8.cu's
/// `AttnOutQuant`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttnOutQuant {
    q: DPtr,
    scales: DPtr,
    counters: DPtr,
    format: i32,
    pad: i32,
}

// SAFETY: plain data with the layout of the kernels' parameter (three pointers, two ints).
unsafe impl cudarc::driver::DeviceRepr for AttnOutQuant {}

impl AttnOutQuant {
    /// No quantization: the kernels write the bf16 output only.
    pub const NONE: AttnOutQuant = AttnOutQuant { q: 0, scales: 0, counters: 0, format: 0, pad: 0 };

    /// Codes into `q` ([tokens, hq · d] bytes) and one scale per token into `scales` (f32), in
    /// `format`; `counters`: one i32 per token of the largest step, zero before the first launch (the
    /// kernels leave them zero).
    pub fn new(format: W8Format, q: DPtr, scales: DPtr, counters: DPtr) -> Self {
        AttnOutQuant { q, scales, counters, format: format.index() as i32, pad: 0 }
    }

    pub fn is_some(&self) -> bool {
        self.q != 0
    }

    fn format(&self) -> W8Format {
        if self.format == W8Format::I8.index() as i32 {
            W8Format::I8
        } else {
            W8Format::E4m3
        }
    }
}

impl AttentionArgs {
    fn push<'a>(&'a self, launch: &mut Launch<'a>) {
        launch
            .arg(&self.out)
            .arg(&self.q)
            .arg(&self.k_cache)
            .arg(&self.v_cache)
            .arg(&self.block_tables)
            .arg(&self.max_blocks)
            .arg(&self.token_seq)
            .arg(&self.positions)
            .arg(&self.hq)
            .arg(&self.hkv)
            .arg(&self.block_size)
            .arg(&self.scale)
            .arg(&self.quant);
    }
}

/// Shared memory of an fp8 tile pipeline: `stages` K tiles [kt][d + 16] bytes and V^T tiles
/// [d][kt + 16] bytes.
fn f8_tiles_bytes(d: usize, kt: usize, stages: usize) -> usize {
    stages * (kt * (d + MMA_F8_PAD) + d * (kt + MMA_F8_PAD))
}

/// Dynamic shared memory of a tensor-core attention kernel (`decode`: the one-token kernel, else the
/// prefill rows kernel) for head dim `d`: the K and V tiles of every pipeline stage, rows padded (the
/// warps' merge reuses the same bytes). attention_mma.cu's MmaDecodeGeom / MmaRowsGeom, and for the
/// fp8 decode kernel attention_mma_f8.cu's configuration (F8K_KW, F8K_STAGES).
pub fn attention_mma_smem_bytes(d: usize, kv: KvCacheDtype, decode: bool) -> usize {
    // A per-head-scaled cache's stages also hold each tile's k and v scales (f32).
    let scales = if kv.has_head_scales() { 2 * MMA_KT * 4 } else { 0 };
    match kv {
        KvCacheDtype::Bf16 => MMA_STAGES * 2 * MMA_KT * (d + MMA_PAD) * 2,
        // attention_mma_f8.cu's decode kernel: F8K_STAGES unpadded stages of 64-key tiles (F8K_KW x 4 warps).
        _ if decode => F8_DECODE_STAGES * (2 * MMA_KT * d + scales),
        _ => f8_tiles_bytes(d, MMA_KT, MMA_F8_STAGES) + MMA_F8_STAGES * scales,
    }
}

/// Lets the tensor-core attention kernels launch with their dynamic shared memory; false if the
/// device refuses (it has less than they need).
pub(super) fn mma_smem_opt_in(module: &Arc<CudaModule>, kv: KvCacheDtype) -> bool {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN;
    let names: [&str; 2] = match kv {
        KvCacheDtype::Bf16 => ["paged_attention_mma", "paged_attention_mma_rows"],
        KvCacheDtype::Fp8E4m3 => ["paged_attention_mma_f8", "paged_attention_mma_rows_f8"],
        KvCacheDtype::Fp8E4m3PerHead => ["paged_attention_mma_f8s", "paged_attention_mma_rows_f8s"],
        KvCacheDtype::Int8PerHead => ["paged_attention_mma_i8s", "paged_attention_mma_rows_i8s"],
    };
    names.iter().enumerate().all(|(i, name)| {
        [64usize, 128].iter().all(|&d| {
            module
                .load_function(&format!("{name}_d{d}"))
                .is_ok_and(|f| f.set_attribute(MAX_DYN, attention_mma_smem_bytes(d, kv, i == 0) as i32).is_ok())
        })
    })
}

impl Kernels {
    /// Whether this GPU serves an fp8 KV cache (sm_89+, the fp8 attention kernels' shared memory).
    pub fn fp8_kv_ready(&self) -> bool {
        self.fp8_ready
    }

    /// Refuses a KV cache type this GPU, or a block size, cannot serve.
    pub fn check_kv_dtype(&self, kv: KvCacheDtype, block_size: usize) -> Result<()> {
        match kv {
            KvCacheDtype::Bf16 => Ok(()),
            _ if !self.fp8_ready => Err(KernelError::Unsupported(
                "an 8-bit KV cache (fp8 or int8) needs a GPU of compute capability 8.9 or newer (its kernels are built with the e4m3 ones) and the tensor-core attention kernels' shared memory".into(),
            )),
            // The fp8 tiles are copied 16 keys of a cache block at a time, and the decode kernel finds
            // a key's block with a shift.
            _ if !block_size.is_multiple_of(16) || !block_size.is_power_of_two() => Err(KernelError::Unsupported(format!(
                "an 8-bit KV cache needs a block size that is a power of two, at least 16 (got {block_size})"
            ))),
            KvCacheDtype::Fp8E4m3 | KvCacheDtype::Fp8E4m3PerHead | KvCacheDtype::Int8PerHead => Ok(()),
        }
    }

    /// f32 scratch [`Kernels::paged_attention`] needs to split decode attention along the sequence.
    pub fn attention_partials_len(&self) -> usize {
        // Splits are only used while n * hkv < 2 * SMs, so n * hkv * splits < 4 * SMs.
        4 * self.num_sms as usize * ATTN_MAX_GROUP * (ATTN_MAX_HEAD_DIM + 2)
    }

    /// How many sequence splits a launch of `n` tokens over `hkv` KV heads gets: enough blocks for
    /// two per SM, at most 16, and 1 (no split) once the batch fills the GPU by itself.
    pub fn attention_splits(&self, n: usize, hkv: usize) -> usize {
        let blocks = (n * hkv).max(1);
        let want = (2 * self.num_sms as usize).div_ceil(blocks);
        want.clamp(1, self.attn_max_splits)
    }

    /// Causal paged attention of `n` query tokens (decode and prefill alike; see attention.cu). The
    /// tokens of a sequence are contiguous, and the first `decode_tokens` are each alone in theirs
    /// (`n` for a decode batch). With `partials` (f32, [`Kernels::attention_partials_len`]) small
    /// decode batches are split along the sequence and merged by a second kernel. With `quant` (not
    /// [`AttnOutQuant::NONE`]) the kernels also write each token's output row as 8-bit codes and a
    /// scale, for an 8-bit o projection.
    ///
    /// # Safety
    /// q/out: n*hq*d bf16; caches as in `rope_kv_write`; block_tables: seqs*max_blocks i32 covering
    /// every position 0..=positions[t]; token_seq, positions: n i32; quant's buffers: n*hq*d bytes, n
    /// f32, n i32 (zero).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn paged_attention(&self, s: &CudaStream, out: DPtr, q: DPtr, k_cache: DPtr, v_cache: DPtr, block_tables: DPtr, max_blocks: usize, token_seq: DPtr, positions: DPtr, n: usize, decode_tokens: usize, hq: usize, hkv: usize, d: usize, block_size: usize, partials: Option<DPtr>, kv: KvCacheDtype, quant: AttnOutQuant) -> Result<()> {
        let kernel = self.attention.unwrap_or_else(|| {
            if self.mma_ready || kv.is_fp8() {
                AttentionKernel::Mma
            } else if partials.is_some() && self.attention_splits(n, hkv) > 1 {
                AttentionKernel::WarpPerKey
            } else {
                AttentionKernel::Tiled
            }
        });
        self.paged_attention_with(kernel, s, out, q, k_cache, v_cache, block_tables, max_blocks, token_seq, positions, n, decode_tokens, hq, hkv, d, block_size, partials, kv, quant)
    }

    /// [`Kernels::paged_attention`] with the kernel chosen by the caller (tests run both).
    ///
    /// # Safety
    /// As [`Kernels::paged_attention`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn paged_attention_with(&self, kernel: AttentionKernel, s: &CudaStream, out: DPtr, q: DPtr, k_cache: DPtr, v_cache: DPtr, block_tables: DPtr, max_blocks: usize, token_seq: DPtr, positions: DPtr, n: usize, decode_tokens: usize, hq: usize, hkv: usize, d: usize, block_size: usize, partials: Option<DPtr>, kv: KvCacheDtype, quant: AttnOutQuant) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if hkv == 0 || !hq.is_multiple_of(hkv) || hq / hkv > ATTN_MAX_GROUP {
            return Err(KernelError::Unsupported(format!(
                "attention: {hq} query heads over {hkv} KV heads (group at most {ATTN_MAX_GROUP})"
            )));
        }
        if d != 64 && d != 128 {
            return Err(KernelError::Unsupported(format!("attention: head_dim {d} (64 or 128 supported)")));
        }
        if decode_tokens > n {
            return Err(KernelError::Unsupported(format!("attention: {decode_tokens} decode tokens of {n}")));
        }
        self.check_kv_dtype(kv, block_size)?;
        if quant.is_some() {
            self.check_w8(quant.format(), "attention output quantization")?;
        }
        if kv.is_fp8() && kernel != AttentionKernel::Mma {
            return Err(KernelError::Unsupported(format!("attention: an fp8 KV cache is read by the tensor-core kernel only, not {kernel:?}")));
        }
        let wide = d == 128;
        let args = AttentionArgs {
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            max_blocks: as_i32(max_blocks, "max_blocks")?,
            token_seq,
            positions,
            hq: as_i32(hq, "hq")?,
            hkv: as_i32(hkv, "hkv")?,
            block_size: as_i32(block_size, "block_size")?,
            scale: 1.0f32 / (d as f32).sqrt(),
            quant,
        };
        match kernel {
            AttentionKernel::WarpPerKey | AttentionKernel::Tiled => {
                // One block per token (and KV head); any token may be split along its context.
                let func = match (kernel, wide) {
                    (AttentionKernel::WarpPerKey, false) => &self.paged_attention_d64,
                    (AttentionKernel::WarpPerKey, true) => &self.paged_attention_d128,
                    (_, false) => &self.paged_attention_tiled_d64,
                    (_, true) => &self.paged_attention_tiled_d128,
                };
                self.attention_per_token(s, func, 0, &args, n, hq, hkv, d, partials)
            }
            AttentionKernel::Mma => {
                if !self.mma_ready && kv == KvCacheDtype::Bf16 {
                    return Err(KernelError::Unsupported("attention: the tensor-core kernel needs sm_80 and its shared memory".into()));
                }
                // The leading decode tokens (each alone in its sequence) get a block each, split along
                // long contexts when they are too few to fill the GPU; the prefill chunks after them
                // go 64 query rows per block (64 / group tokens).
                // The (decode, prefill rows) kernels of this cache type and head dim.
                let (decode_func, rows_func) = match (kv, wide) {
                    (KvCacheDtype::Bf16, false) => (&self.paged_attention_mma_d64, &self.paged_attention_mma_rows_d64),
                    (KvCacheDtype::Bf16, true) => (&self.paged_attention_mma_d128, &self.paged_attention_mma_rows_d128),
                    (KvCacheDtype::Fp8E4m3, false) => (&self.paged_attention_mma_f8_d64, &self.paged_attention_mma_rows_f8_d64),
                    (KvCacheDtype::Fp8E4m3, true) => (&self.paged_attention_mma_f8_d128, &self.paged_attention_mma_rows_f8_d128),
                    (KvCacheDtype::Fp8E4m3PerHead, false) => (&self.paged_attention_mma_f8s_d64, &self.paged_attention_mma_rows_f8s_d64),
                    (KvCacheDtype::Fp8E4m3PerHead, true) => (&self.paged_attention_mma_f8s_d128, &self.paged_attention_mma_rows_f8s_d128),
                    (KvCacheDtype::Int8PerHead, false) => (&self.paged_attention_mma_i8s_d64, &self.paged_attention_mma_rows_i8s_d64),
                    (KvCacheDtype::Int8PerHead, true) => (&self.paged_attention_mma_i8s_d128, &self.paged_attention_mma_rows_i8s_d128),
                };
                if decode_tokens > 0 {
                    self.attention_per_token(s, decode_func, attention_mma_smem_bytes(d, kv, true), &args, decode_tokens, hq, hkv, d, partials)?;
                }
                if decode_tokens < n {
                    let tq = (MMA_ROWS_PREFILL / (hq / hkv)).max(1);
                    let config = LaunchConfig {
                        grid_dim: (as_u32((n - decode_tokens).div_ceil(tq), "tokens")?, hkv as u32, 1),
                        block_dim: (ATTN_THREADS, 1, 1),
                        shared_mem_bytes: attention_mma_smem_bytes(d, kv, false) as u32,
                    };
                    let (t_begin, n_i, tq_i) = (as_i32(decode_tokens, "tokens")?, as_i32(n, "tokens")?, as_i32(tq, "tokens per block")?);
                    let mut launch = Launch::new(rows_func);
                    args.push(&mut launch);
                    launch.arg(&t_begin).arg(&n_i).arg(&tq_i).launch(s, config, false)?;
                }
                Ok(())
            }
        }
    }

    /// Launches a one-token-per-block attention kernel (attention.cu's contract; `smem`: its dynamic
    /// shared memory) over the first `n` tokens, split along the sequence when `partials` is given
    /// and the launch is too small to fill the GPU.
    #[allow(clippy::too_many_arguments)]
    unsafe fn attention_per_token(&self, s: &CudaStream, func: &CudaFunction, smem: usize, args: &AttentionArgs, n: usize, hq: usize, hkv: usize, d: usize, partials: Option<DPtr>) -> Result<()> {
        let mut splits = if partials.is_some() { self.attention_splits(n, hkv) } else { 1 };
        if n * hq * splits * (d + 2) > self.attention_partials_len() {
            splits = 1;
        }
        let (part_ml, part_acc) = match partials {
            Some(p) if splits > 1 => (p, p + (2 * n * hq * splits * 4) as u64),
            _ => (0, 0),
        };
        let config = LaunchConfig {
            grid_dim: (as_u32(n, "tokens")?, hkv as u32, splits as u32),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let mut launch = Launch::new(func);
        args.push(&mut launch);
        launch.arg(&part_ml).arg(&part_acc).launch(s, config, false)?;
        if splits > 1 {
            let (hq_i, splits_i, d_i) = (args.hq, splits as i32, d as i32);
            let combine = LaunchConfig { grid_dim: (n as u32, hq as u32, 1), block_dim: (d as u32, 1, 1), shared_mem_bytes: 0 };
            Launch::new(&self.attention_combine)
                .arg(&args.out)
                .arg(&part_ml)
                .arg(&part_acc)
                .arg(&hq_i)
                .arg(&splits_i)
                .arg(&d_i)
                .arg(&args.quant)
                .launch(s, combine, false)?;
        }
        Ok(())
    }
}

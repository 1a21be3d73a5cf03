//! Launch wrappers: one method per kernel, shapes checked before launching.
//!
//! Pointers are raw device addresses (`u64`) of bf16 (`u16` bits), f32, i32 or u32 data. The caller
//! owns the buffers and guarantees their sizes; that is why every wrapper is `unsafe`.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};

use crate::{KernelError, Result};

/// Device address.
pub type DPtr = u64;

/// Every kernel of the module, loaded once.
pub struct Kernels {
    embedding_gather: CudaFunction,
    add_rmsnorm: CudaFunction,
    rope_kv_write: CudaFunction,
    rope_kv_write_fp8: CudaFunction,
    paged_attention_d64: CudaFunction,
    paged_attention_d128: CudaFunction,
    paged_attention_tiled_d64: CudaFunction,
    paged_attention_tiled_d128: CudaFunction,
    paged_attention_mma_d64: CudaFunction,
    paged_attention_mma_d128: CudaFunction,
    paged_attention_mma_rows_d64: CudaFunction,
    paged_attention_mma_rows_d128: CudaFunction,
    paged_attention_mma_f8_d64: CudaFunction,
    paged_attention_mma_f8_d128: CudaFunction,
    paged_attention_mma_rows_f8_d64: CudaFunction,
    paged_attention_mma_rows_f8_d128: CudaFunction,
    /// Forced attention kernel (`PEREGRINE_ATTN=warp|tiled|mma`); None: chosen per launch.
    attention: Option<AttentionKernel>,
    /// Whether the tensor-core kernel got its dynamic shared memory (it needs more than the 48 KB a
    /// launch gets without opting in); without it every launch takes the CUDA-core kernels.
    mma_ready: bool,
    attention_combine: CudaFunction,
    /// Whether an fp8 KV cache can be served: the fp8 tensor-core kernels need sm_89 (e4m3
    /// conversions) and their shared memory.
    fp8_ready: bool,
    silu_mul: CudaFunction,
    argmax_rows: CudaFunction,
    sample_rows: CudaFunction,
    lora_shrink: CudaFunction,
    lora_expand: CudaFunction,
    fill_uniform_bf16: CudaFunction,
    fill_f32: CudaFunction,
    f32_to_bf16: CudaFunction,
    /// [unroll 8, unroll 16] × [m ≤ 1, 2, 4, 8].
    gemv: [[CudaFunction; 4]; 2],
    /// gate/up GEMV with SwiGLU in the epilogue, m ≤ 1, 2, 4, 8.
    gemv_silu: [CudaFunction; 4],
    num_sms: u32,
    /// Tuning knobs read once from the environment, for measuring alternatives on a GPU without a
    /// rebuild: `PEREGRINE_GEMV_WPR=a,b` (warps per row for k < 8192 and k >= 8192, instead of
    /// [`Kernels::gemv_plan`]'s) and `PEREGRINE_ATTN_MAX_SPLITS=n` (instead of 16).
    gemv_wpr: Option<(usize, usize)>,
    attn_max_splits: usize,
    /// Launch GEMVs with programmatic dependent launch (sm_90+; `PEREGRINE_PDL=0` turns it off).
    pdl: bool,
}

/// f32 parameters per row of [`Kernels::sample_rows`] (sample.cu's SAMPLE_PARAMS): temperature,
/// top_k, top_p, min_p, u.
pub const SAMPLE_PARAMS: usize = 5;
const SAMPLE_THREADS: u32 = 1024;
/// Rank rows one block of [`Kernels::lora_shrink`] computes (one warp each).
const LORA_SHRINK_RANKS: usize = 8;

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
    /// Tensor-core attention only (sm_89+), block size a multiple of 16.
    Fp8E4m3,
}

impl KvCacheDtype {
    /// Bytes of one cached element.
    pub fn bytes(self) -> usize {
        match self {
            KvCacheDtype::Bf16 => 2,
            KvCacheDtype::Fp8E4m3 => 1,
        }
    }
}

/// Largest row count the skinny GEMM (`gemv`) takes.
pub const GEMV_MAX_M: usize = 8;
const GEMV_WARPS: usize = 8;

/// Most query heads one KV head may serve (attention.cu's ATTN_MAX_GROUP).
pub const ATTN_MAX_GROUP: usize = 8;
/// Largest head dimension the attention kernels are built for.
pub const ATTN_MAX_HEAD_DIM: usize = 128;
const ATTN_THREADS: u32 = 128;
/// rope_kv.cu's ROPE_HEADS: heads per block of `rope_kv_write`.
const ROPE_HEADS: i32 = 4;
/// attention_mma.cu's tile geometry: query rows per block of the prefill kernel, keys per tile,
/// pipeline stages, row padding.
const MMA_ROWS_PREFILL: usize = 64;
const MMA_KT: usize = 64;
const MMA_STAGES: usize = 2;
const MMA_PAD: usize = 8;
const MMA_F8_PAD: usize = 16;
const MMA_F8_STAGES: usize = 3;

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
            .arg(&self.scale);
    }
}

/// Dynamic shared memory of a tensor-core attention kernel (`decode`: the one-token kernel, else the
/// prefill rows kernel) for head dim `d`: the K and V tiles of every pipeline stage, rows padded (the
/// warps' merge reuses the same bytes). attention_mma.cu's MmaDecodeGeom / MmaRowsGeom.
pub fn attention_mma_smem_bytes(d: usize, kv: KvCacheDtype, decode: bool) -> usize {
    match kv {
        KvCacheDtype::Bf16 => MMA_STAGES * 2 * MMA_KT * (d + MMA_PAD) * 2,
        KvCacheDtype::Fp8E4m3 => {
            // K tile [MMA_KT][d + 16] bytes, V^T tile [d][MMA_KT + 16] bytes; decode: two stages.
            let stages = if decode { MMA_STAGES } else { MMA_F8_STAGES };
            stages * (MMA_KT * (d + MMA_F8_PAD) + d * (MMA_KT + MMA_F8_PAD))
        }
    }
}

/// Lets the tensor-core attention kernels launch with their dynamic shared memory; false if the
/// device refuses (it has less than they need).
fn mma_smem_opt_in(module: &Arc<CudaModule>, kv: KvCacheDtype) -> bool {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN;
    let names: [&str; 2] = match kv {
        KvCacheDtype::Bf16 => ["paged_attention_mma", "paged_attention_mma_rows"],
        KvCacheDtype::Fp8E4m3 => ["paged_attention_mma_f8", "paged_attention_mma_rows_f8"],
    };
    names.iter().enumerate().all(|(i, name)| {
        [64usize, 128].iter().all(|&d| {
            module
                .load_function(&format!("{name}_d{d}"))
                .is_ok_and(|f| f.set_attribute(MAX_DYN, attention_mma_smem_bytes(d, kv, i == 0) as i32).is_ok())
        })
    })
}

fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

fn as_u32(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).map_err(|_| KernelError::Unsupported(format!("{what} = {v} exceeds u32")))
}

fn as_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| KernelError::Unsupported(format!("{what} = {v} exceeds i32")))
}

impl Kernels {
    pub fn load(module: &Arc<CudaModule>, num_sms: u32, arch: (i32, i32)) -> Result<Self> {
        let f = |name: &str| module.load_function(name);
        Ok(Kernels {
            embedding_gather: f("embedding_gather")?,
            add_rmsnorm: f("add_rmsnorm")?,
            rope_kv_write: f("rope_kv_write")?,
            rope_kv_write_fp8: f("rope_kv_write_fp8")?,
            paged_attention_d64: f("paged_attention_d64")?,
            paged_attention_d128: f("paged_attention_d128")?,
            paged_attention_tiled_d64: f("paged_attention_tiled_d64")?,
            paged_attention_tiled_d128: f("paged_attention_tiled_d128")?,
            paged_attention_mma_d64: f("paged_attention_mma_d64")?,
            paged_attention_mma_d128: f("paged_attention_mma_d128")?,
            paged_attention_mma_rows_d64: f("paged_attention_mma_rows_d64")?,
            paged_attention_mma_rows_d128: f("paged_attention_mma_rows_d128")?,
            paged_attention_mma_f8_d64: f("paged_attention_mma_f8_d64")?,
            paged_attention_mma_f8_d128: f("paged_attention_mma_f8_d128")?,
            paged_attention_mma_rows_f8_d64: f("paged_attention_mma_rows_f8_d64")?,
            paged_attention_mma_rows_f8_d128: f("paged_attention_mma_rows_f8_d128")?,
            attention: AttentionKernel::from_env(),
            // mma.sync on bf16 and cp.async need sm_80.
            mma_ready: arch.0 >= 8 && mma_smem_opt_in(module, KvCacheDtype::Bf16),
            // cvt between e4m3 and f16 needs sm_89.
            fp8_ready: arch >= (8, 9) && mma_smem_opt_in(module, KvCacheDtype::Fp8E4m3),
            attention_combine: f("attention_combine")?,
            silu_mul: f("silu_mul")?,
            argmax_rows: f("argmax_rows")?,
            sample_rows: f("sample_rows")?,
            lora_shrink: f("lora_shrink")?,
            lora_expand: f("lora_expand")?,
            fill_uniform_bf16: f("fill_uniform_bf16")?,
            fill_f32: f("fill_f32")?,
            f32_to_bf16: f("f32_to_bf16")?,
            gemv: [
                [f("gemv_m1_u8")?, f("gemv_m2_u8")?, f("gemv_m4_u8")?, f("gemv_m8_u8")?],
                [f("gemv_m1_u16")?, f("gemv_m2_u16")?, f("gemv_m4_u16")?, f("gemv_m8_u16")?],
            ],
            gemv_silu: [f("gemv_silu_m1")?, f("gemv_silu_m2")?, f("gemv_silu_m4")?, f("gemv_silu_m8")?],
            num_sms: num_sms.max(1),
            gemv_wpr: std::env::var("PEREGRINE_GEMV_WPR").ok().and_then(|v| {
                let (a, b) = v.split_once(',')?;
                let ok = |w: usize| matches!(w, 1 | 2 | 4 | 8).then_some(w);
                Some((ok(a.trim().parse().ok()?)?, ok(b.trim().parse().ok()?)?))
            }),
            attn_max_splits: std::env::var("PEREGRINE_ATTN_MAX_SPLITS").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| (1..=16).contains(&n)).unwrap_or(16),
            // On by default on sm_90+ (`PEREGRINE_PDL=0` turns it off): with the kernels before the
            // GEMVs (norms, attention, the gate/up GEMV) triggering early, batch-1 decode on an H100
            // went 166.2 -> 167.8 tokens/s (docs/benchmarks.md).
            pdl: arch.0 >= 9 && std::env::var("PEREGRINE_PDL").map_or(true, |v| v != "0"),
        })
    }

    /// Grid for grid-stride elementwise kernels: enough blocks to fill the GPU, no more.
    fn elementwise_grid(&self, n: usize, block: u32) -> u32 {
        let want = n.div_ceil(block as usize).max(1);
        want.min(self.num_sms as usize * 8) as u32
    }

    /// `out[t, :] = f32(table[ids[t], :])` for `n` tokens. ids: u32, already checked `< vocab`.
    ///
    /// # Safety
    /// out: n*hidden f32; table: vocab*hidden bf16; ids: n u32.
    pub unsafe fn embedding_gather(&self, s: &CudaStream, out: DPtr, table: DPtr, ids: DPtr, n: usize, hidden: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let hidden = as_i32(hidden, "hidden")?;
        s.launch_builder(&self.embedding_gather)
            .arg(&out)
            .arg(&table)
            .arg(&ids)
            .arg(&hidden)
            .launch(cfg(as_u32(n, "tokens")?, 256))?;
        Ok(())
    }

    /// `residual += delta` (when `delta` is Some), then `out = rmsnorm(residual) * weight` in bf16.
    /// With `rows` = Some(ptr to `n` i32), output row i adds and normalizes residual row `rows[i]` only
    /// (the final norm, on the rows whose logits are wanted).
    ///
    /// # Safety
    /// residual: f32 rows of `hidden`; delta: bf16 like residual; weight: hidden f32; out: n*hidden bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rmsnorm(&self, s: &CudaStream, residual: DPtr, delta: Option<DPtr>, weight: DPtr, out: DPtr, rows: Option<DPtr>, n: usize, hidden: usize, eps: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let delta = delta.unwrap_or(0);
        let rows = rows.unwrap_or(0);
        let hidden_i = as_i32(hidden, "hidden")?;
        let threads = if hidden >= 4096 { 1024 } else { 256 };
        Launch::new(&self.add_rmsnorm)
            .arg(&residual)
            .arg(&delta)
            .arg(&weight)
            .arg(&out)
            .arg(&rows)
            .arg(&hidden_i)
            .arg(&eps)
            .launch(s, cfg(as_u32(n, "tokens")?, threads), false)?;
        Ok(())
    }

    /// RoPE on the q and k parts of `qkv` (+ optional f32 bias), q written to `q_out`, k and v into the
    /// paged caches at `slots[t]`, as `kv` elements in that type's layout ([`KvCacheDtype`]).
    ///
    /// # Safety
    /// qkv: n*(hq+2hkv)*d bf16; positions, slots: n i32; cos/sin: (max position + 1)*d/2 f32;
    /// q_out: n*hq*d bf16; caches: num_blocks*hkv*block_size*d elements of `kv` covering every slot.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_kv_write(&self, s: &CudaStream, qkv: DPtr, bias: Option<DPtr>, positions: DPtr, cos: DPtr, sin: DPtr, slots: DPtr, q_out: DPtr, k_cache: DPtr, v_cache: DPtr, n: usize, hq: usize, hkv: usize, d: usize, block_size: usize, kv: KvCacheDtype) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if d % 2 != 0 {
            return Err(KernelError::Unsupported(format!("rope: odd head_dim {d}")));
        }
        self.check_kv_dtype(kv, block_size)?;
        let bias = bias.unwrap_or(0);
        let (hq, hkv, d, bs) = (as_i32(hq, "hq")?, as_i32(hkv, "hkv")?, as_i32(d, "head_dim")?, as_i32(block_size, "block_size")?);
        let func = match kv {
            KvCacheDtype::Bf16 => &self.rope_kv_write,
            KvCacheDtype::Fp8E4m3 => &self.rope_kv_write_fp8,
        };
        Launch::new(func)
            .arg(&qkv)
            .arg(&bias)
            .arg(&positions)
            .arg(&cos)
            .arg(&sin)
            .arg(&slots)
            .arg(&q_out)
            .arg(&k_cache)
            .arg(&v_cache)
            .arg(&hq)
            .arg(&hkv)
            .arg(&d)
            .arg(&bs)
            .launch(s, LaunchConfig { grid_dim: (as_u32(n, "tokens")?, ((hq + 2 * hkv + ROPE_HEADS - 1) / ROPE_HEADS) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }, false)?;
        Ok(())
    }

    /// Whether this GPU serves an fp8 KV cache (sm_89+, the fp8 attention kernels' shared memory).
    pub fn fp8_kv_ready(&self) -> bool {
        self.fp8_ready
    }

    /// Refuses a KV cache type this GPU, or a block size, cannot serve.
    pub fn check_kv_dtype(&self, kv: KvCacheDtype, block_size: usize) -> Result<()> {
        match kv {
            KvCacheDtype::Bf16 => Ok(()),
            KvCacheDtype::Fp8E4m3 if !self.fp8_ready => Err(KernelError::Unsupported(
                "an fp8 KV cache needs a GPU of compute capability 8.9 or newer (e4m3 conversions) and the tensor-core attention kernels' shared memory".into(),
            )),
            KvCacheDtype::Fp8E4m3 if block_size % 16 != 0 => {
                Err(KernelError::Unsupported(format!("an fp8 KV cache needs a block size that is a multiple of 16 (got {block_size})")))
            }
            KvCacheDtype::Fp8E4m3 => Ok(()),
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
    /// decode batches are split along the sequence and merged by a second kernel.
    ///
    /// # Safety
    /// q/out: n*hq*d bf16; caches as in `rope_kv_write`; block_tables: seqs*max_blocks i32 covering
    /// every position 0..=positions[t]; token_seq, positions: n i32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn paged_attention(&self, s: &CudaStream, out: DPtr, q: DPtr, k_cache: DPtr, v_cache: DPtr, block_tables: DPtr, max_blocks: usize, token_seq: DPtr, positions: DPtr, n: usize, decode_tokens: usize, hq: usize, hkv: usize, d: usize, block_size: usize, partials: Option<DPtr>, kv: KvCacheDtype) -> Result<()> {
        let kernel = self.attention.unwrap_or_else(|| {
            if self.mma_ready || kv == KvCacheDtype::Fp8E4m3 {
                AttentionKernel::Mma
            } else if partials.is_some() && self.attention_splits(n, hkv) > 1 {
                AttentionKernel::WarpPerKey
            } else {
                AttentionKernel::Tiled
            }
        });
        self.paged_attention_with(kernel, s, out, q, k_cache, v_cache, block_tables, max_blocks, token_seq, positions, n, decode_tokens, hq, hkv, d, block_size, partials, kv)
    }

    /// [`Kernels::paged_attention`] with the kernel chosen by the caller (tests run both).
    ///
    /// # Safety
    /// As [`Kernels::paged_attention`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn paged_attention_with(&self, kernel: AttentionKernel, s: &CudaStream, out: DPtr, q: DPtr, k_cache: DPtr, v_cache: DPtr, block_tables: DPtr, max_blocks: usize, token_seq: DPtr, positions: DPtr, n: usize, decode_tokens: usize, hq: usize, hkv: usize, d: usize, block_size: usize, partials: Option<DPtr>, kv: KvCacheDtype) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if hkv == 0 || hq % hkv != 0 || hq / hkv > ATTN_MAX_GROUP {
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
        if kv == KvCacheDtype::Fp8E4m3 && kernel != AttentionKernel::Mma {
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
                let fp8 = kv == KvCacheDtype::Fp8E4m3;
                // The leading decode tokens (each alone in its sequence) get a block each, split along
                // long contexts when they are too few to fill the GPU; the prefill chunks after them
                // go 64 query rows per block (64 / group tokens).
                if decode_tokens > 0 {
                    let func = match (fp8, wide) {
                        (false, false) => &self.paged_attention_mma_d64,
                        (false, true) => &self.paged_attention_mma_d128,
                        (true, false) => &self.paged_attention_mma_f8_d64,
                        (true, true) => &self.paged_attention_mma_f8_d128,
                    };
                    self.attention_per_token(s, func, attention_mma_smem_bytes(d, kv, true), &args, decode_tokens, hq, hkv, d, partials)?;
                }
                if decode_tokens < n {
                    let func = match (fp8, wide) {
                        (false, false) => &self.paged_attention_mma_rows_d64,
                        (false, true) => &self.paged_attention_mma_rows_d128,
                        (true, false) => &self.paged_attention_mma_rows_f8_d64,
                        (true, true) => &self.paged_attention_mma_rows_f8_d128,
                    };
                    let tq = (MMA_ROWS_PREFILL / (hq / hkv)).max(1);
                    let config = LaunchConfig {
                        grid_dim: (as_u32((n - decode_tokens).div_ceil(tq), "tokens")?, hkv as u32, 1),
                        block_dim: (ATTN_THREADS, 1, 1),
                        shared_mem_bytes: attention_mma_smem_bytes(d, kv, false) as u32,
                    };
                    let (t_begin, n_i, tq_i) = (as_i32(decode_tokens, "tokens")?, as_i32(n, "tokens")?, as_i32(tq, "tokens per block")?);
                    let mut launch = Launch::new(func);
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
                .launch(s, combine, false)?;
        }
        Ok(())
    }

    /// `out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]`.
    ///
    /// # Safety
    /// out: n*inter bf16; gate_up: n*2*inter bf16.
    pub unsafe fn silu_mul(&self, s: &CudaStream, out: DPtr, gate_up: DPtr, n: usize, inter: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let inter_i = as_i32(inter, "intermediate")?;
        Launch::new(&self.silu_mul)
            .arg(&out)
            .arg(&gate_up)
            .arg(&n64)
            .arg(&inter_i)
            .launch(s, cfg(self.elementwise_grid(n * inter, 256), 256), false)?;
        Ok(())
    }

    /// `out[r] = argmax(logits[r, :])` (u32, lowest index on ties).
    ///
    /// # Safety
    /// logits: rows*vocab f32; out: rows u32.
    pub unsafe fn argmax_rows(&self, s: &CudaStream, logits: DPtr, rows: usize, vocab: usize, out: DPtr) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let vocab = as_i32(vocab, "vocab")?;
        s.launch_builder(&self.argmax_rows)
            .arg(&logits)
            .arg(&vocab)
            .arg(&out)
            .launch(cfg(as_u32(rows, "rows")?, 1024))?;
        Ok(())
    }

    /// One token per logits row, drawn with that row's temperature / top-k / top-p / min-p and the
    /// uniform number `u` the caller drew (greedy where temperature < 1e-5); see sample.cu.
    ///
    /// # Safety
    /// logits: rows*vocab f32; params: rows*[`SAMPLE_PARAMS`] f32; out: rows u32.
    pub unsafe fn sample_rows(&self, s: &CudaStream, logits: DPtr, rows: usize, vocab: usize, params: DPtr, out: DPtr) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let vocab = as_i32(vocab, "vocab")?;
        s.launch_builder(&self.sample_rows)
            .arg(&logits)
            .arg(&vocab)
            .arg(&params)
            .arg(&out)
            .launch(cfg(as_u32(rows, "rows")?, SAMPLE_THREADS))?;
        Ok(())
    }

    /// LoRA shrink: `t[i, :] = x[i, :] · A[slots[i]]ᵀ` for the `n` tokens with a slot (see lora.cu).
    ///
    /// # Safety
    /// t: n*r_max f32; x: n rows of k bf16, `x_stride` apart; a_stack: slots*r_max*k bf16 covering
    /// every slot index in `slots` (n i32, -1 for none).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_shrink(&self, s: &CudaStream, t: DPtr, x: DPtr, x_stride: usize, a_stack: DPtr, slots: DPtr, n: usize, k: usize, r_max: usize) -> Result<()> {
        if n == 0 || r_max == 0 {
            return Ok(());
        }
        let (x_stride, k, r) = (as_i32(x_stride, "x_stride")?, as_i32(k, "k")?, as_i32(r_max, "r_max")?);
        let config = LaunchConfig {
            grid_dim: (as_u32(n, "tokens")?, as_u32(r_max.div_ceil(LORA_SHRINK_RANKS), "ranks")?, 1),
            block_dim: ((LORA_SHRINK_RANKS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        s.launch_builder(&self.lora_shrink)
            .arg(&t)
            .arg(&x)
            .arg(&x_stride)
            .arg(&a_stack)
            .arg(&slots)
            .arg(&k)
            .arg(&r)
            .launch(config)?;
        Ok(())
    }

    /// LoRA expand: `y[i, :] += scales[slots[i]] · t[i, :] · B[slots[i]]ᵀ` in bf16 (see lora.cu).
    ///
    /// # Safety
    /// y: n rows of `out` bf16, `y_stride` apart; t: n*r_max f32; b_stack: slots*out*r_max bf16;
    /// scales: one f32 per slot; slots: n i32 (-1 for none).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_expand(&self, s: &CudaStream, y: DPtr, y_stride: usize, t: DPtr, b_stack: DPtr, scales: DPtr, slots: DPtr, n: usize, out: usize, r_max: usize) -> Result<()> {
        if n == 0 || r_max == 0 || out == 0 {
            return Ok(());
        }
        let (y_stride, out_i, r) = (as_i32(y_stride, "y_stride")?, as_i32(out, "out")?, as_i32(r_max, "r_max")?);
        let n64 = n as u64;
        s.launch_builder(&self.lora_expand)
            .arg(&y)
            .arg(&y_stride)
            .arg(&t)
            .arg(&b_stack)
            .arg(&scales)
            .arg(&slots)
            .arg(&n64)
            .arg(&out_i)
            .arg(&r)
            .launch(cfg(self.elementwise_grid(n * out, 256), 256))?;
        Ok(())
    }

    /// Uniform(-scale, scale) bf16 values, a pure function of (seed, index).
    ///
    /// # Safety
    /// out: n bf16.
    pub unsafe fn fill_uniform_bf16(&self, s: &CudaStream, out: DPtr, n: usize, seed: u64, scale: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        s.launch_builder(&self.fill_uniform_bf16)
            .arg(&out)
            .arg(&n64)
            .arg(&seed)
            .arg(&scale)
            .launch(cfg(self.elementwise_grid(n, 256), 256))?;
        Ok(())
    }

    /// # Safety
    /// out: n f32.
    pub unsafe fn fill_f32(&self, s: &CudaStream, out: DPtr, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        s.launch_builder(&self.fill_f32)
            .arg(&out)
            .arg(&n64)
            .arg(&value)
            .launch(cfg(self.elementwise_grid(n, 256), 256))?;
        Ok(())
    }

    /// # Safety
    /// out: n bf16; input: n f32.
    pub unsafe fn f32_to_bf16(&self, s: &CudaStream, out: DPtr, input: DPtr, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        s.launch_builder(&self.f32_to_bf16)
            .arg(&out)
            .arg(&input)
            .arg(&n64)
            .launch(cfg(self.elementwise_grid(n, 256), 256))?;
        Ok(())
    }

    /// (unroll depth, warps per row) for a weight of `n` rows × `k`. From a sweep on an H100
    /// (`examples/micro.rs`, docs/benchmarks.md): 4 warps per row beat 1 or 2 for every Llama-3.1-8B
    /// shape, 8 for the long rows of the down projection; unroll 16 never beat 8.
    pub fn gemv_plan(_n: usize, k: usize) -> (usize, usize) {
        (8, if k >= 8192 { 8 } else { 4 })
    }

    /// Skinny GEMM `y[m, n] = x[m, k] · w[n, k]ᵀ` for m ≤ [`GEMV_MAX_M`], k a multiple of 8
    /// (bandwidth-bound decode shapes); y bf16 or f32. Unroll depth and warps per row from
    /// [`Kernels::gemv_plan`].
    ///
    /// # Safety
    /// x: m*k bf16 and w: n*k bf16, both 16-byte aligned; y: m*n of the output type.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv(&self, s: &CudaStream, y: DPtr, y_f32: bool, x: DPtr, w: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        let (unroll, mut wpr) = Self::gemv_plan(n, k);
        if let Some((small, large)) = self.gemv_wpr {
            wpr = if k >= 8192 { large } else { small };
        }
        self.gemv_with(s, y, y_f32, x, w, m, n, k, unroll, wpr)
    }

    /// [`Kernels::gemv`] with an explicit unroll depth (8 or 16) and warps per row (1, 2, 4 or 8).
    ///
    /// # Safety
    /// As [`Kernels::gemv`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_with(&self, s: &CudaStream, y: DPtr, y_f32: bool, x: DPtr, w: DPtr, m: usize, n: usize, k: usize, unroll: usize, wpr: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        if m > GEMV_MAX_M || k % 8 != 0 || x % 16 != 0 || w % 16 != 0 {
            return Err(KernelError::Unsupported(format!("gemv: m {m}, k {k} (m <= {GEMV_MAX_M}, k % 8 == 0, aligned)")));
        }
        if !matches!(wpr, 1 | 2 | 4 | 8) || !matches!(unroll, 8 | 16) {
            return Err(KernelError::Unsupported(format!("gemv: unroll {unroll}, {wpr} warps per row")));
        }
        let func = &self.gemv[(unroll == 16) as usize][gemv_m_index(m)];
        let (yf, mi, ni, ki, wpr_i) = (y_f32 as i32, m as i32, as_i32(n, "n")?, as_i32(k, "k")?, wpr as i32);
        let rows_per_block = GEMV_WARPS / wpr;
        let grid = as_u32(n.div_ceil(rows_per_block), "gemv blocks")?;
        Launch::new(func)
            .arg(&y)
            .arg(&yf)
            .arg(&x)
            .arg(&w)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&wpr_i)
            .launch(s, cfg(grid, (GEMV_WARPS * 32) as u32), self.pdl)?;
        Ok(())
    }
}

impl Kernels {
    /// `act[m, inter] = silu(x · gate_j) * (x · up_j)` for `w_gate_up` = [gate; up] ([2 inter, k]),
    /// m ≤ [`GEMV_MAX_M`]: the skinny GEMM with SwiGLU in its epilogue (gemv.cu), unroll 8 and the
    /// plan's warps per row (at most 4, so each block holds whole gate/up pairs).
    ///
    /// # Safety
    /// x: m*k bf16, w_gate_up: 2*inter*k bf16, both 16-byte aligned; act: m*inter bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_silu(&self, s: &CudaStream, act: DPtr, x: DPtr, w_gate_up: DPtr, m: usize, inter: usize, k: usize) -> Result<()> {
        if m == 0 || inter == 0 {
            return Ok(());
        }
        if m > GEMV_MAX_M || k % 8 != 0 || x % 16 != 0 || w_gate_up % 16 != 0 {
            return Err(KernelError::Unsupported(format!("gemv_silu: m {m}, k {k} (m <= {GEMV_MAX_M}, k % 8 == 0, aligned)")));
        }
        let wpr = match self.gemv_wpr {
            Some((small, large)) => if k >= 8192 { large } else { small },
            None => Self::gemv_plan(2 * inter, k).1,
        }
        .min(4);
        let func = &self.gemv_silu[gemv_m_index(m)];
        let (mi, ni, ki, wpr_i) = (m as i32, as_i32(inter, "intermediate")?, as_i32(k, "k")?, wpr as i32);
        let grid = as_u32((2 * inter).div_ceil(GEMV_WARPS / wpr), "gemv blocks")?;
        Launch::new(func)
            .arg(&act)
            .arg(&x)
            .arg(&w_gate_up)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&wpr_i)
            .launch(s, cfg(grid, (GEMV_WARPS * 32) as u32), self.pdl)?;
        Ok(())
    }
}

/// The GEMV kernel table's column for `m` rows (kernels built for m ≤ 1, 2, 4, 8).
fn gemv_m_index(m: usize) -> usize {
    match m {
        0..=1 => 0,
        2 => 1,
        3..=4 => 2,
        _ => 3,
    }
}

/// A kernel launch that may carry the programmatic-stream-serialization attribute (PDL), which
/// cudarc's launch builder cannot: with it the kernel may begin while the previous kernel on the
/// stream finishes (once that kernel's blocks have all called `pdl_trigger()` or exited), and must
/// `pdl_wait()` before touching memory that kernel reads or writes. Only the GEMVs are launched this
/// way (they issue their first weight loads before waiting); the other kernels of a step call
/// `pdl_trigger()` early so that the GEMV after them can start. Launching every kernel with PDL (and
/// a wait at its top) measured no better on an H100 (docs/benchmarks.md).
struct Launch<'a> {
    func: &'a CudaFunction,
    args: Vec<*mut std::ffi::c_void>,
}

impl<'a> Launch<'a> {
    fn new(func: &'a CudaFunction) -> Self {
        Launch { func, args: Vec::with_capacity(16) }
    }

    fn arg<T: cudarc::driver::DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push(v as *const T as *mut std::ffi::c_void);
        self
    }

    /// # Safety
    /// The arguments must match the kernel's parameters.
    unsafe fn launch(&mut self, s: &CudaStream, config: LaunchConfig, pdl: bool) -> Result<()> {
        use cudarc::driver::sys;
        s.context().bind_to_thread()?;
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let launch = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: s.cu_stream(),
            attrs: &mut attr,
            numAttrs: pdl as u32,
        };
        sys::cuLaunchKernelEx(&launch, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()).result()?;
        Ok(())
    }
}

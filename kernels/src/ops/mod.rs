//! Launch wrappers: one method per kernel, shapes checked before launching.
//!
//! Pointers are raw device addresses (`u64`) of bf16 (`u16` bits), f32, i32 or u32 data. The caller
//! owns the buffers and guarantees their sizes; that is why every wrapper is `unsafe`.

mod argmax;
mod attention;
mod embedding;
mod encoder;
mod fill;
mod gemv;
mod gemm_w8a8;
mod gemv_fp8;
mod lora;
mod quant8;
mod rmsnorm;
mod rope_kv;
mod sample;
mod silu_mul;
mod token_mask;

use attention::mma_smem_opt_in;
use gemv_fp8::{GEMV8_M1_ROWS_DEFAULT, GEMV8_MMA_WARPS_PER_SM};
pub use gemv_fp8::{Gemv8Kernel, GemvLoraExpand};
pub use attention::{attention_mma_smem_bytes, AttentionKernel, AttnOutQuant, KvCacheDtype, ATTN_MAX_GROUP, ATTN_MAX_HEAD_DIM};
pub use encoder::{
    attention_tiles as encoder_attention_tiles, attention_tiles_of as encoder_attention_tiles_of, EmbeddingTables, EncoderActivation, EncoderKernels, EncoderPooling, NormParams, ENC_ATTN_MAX_HEAD_DIM,
    ENC_ATTN_MMA_HEAD_DIMS, ENC_ATTN_MMA_QUERIES_PER_WARP, ENC_ATTN_MMA_WARPS, ENC_ATTN_QUERY_TILE,
};
pub use gemv::{GemvLoraRows, GEMV_MAX_M};
pub use gemv_fp8::GEMV_FP8_MAX_M;
pub use quant8::{OuterScale, SILU_HADAMARD_MAX_INTER};
pub use rope_kv::{KvRotation, RopeCache, RopeTables};
pub use lora::{lora_max_tiles, lora_rank_pad, lora_splits, lora_swiglu_fits, LoraDelta, LoraModule, LoraShrinkShape, LoraScratch, LoraSegments, LORA_MAX_MODULES, LORA_MAX_RANK, LORA_TILE};
pub use sample::SAMPLE_PARAMS;
pub use token_mask::{mask_words, pack_token_constraints, packed_capacity, ConstrainedRow, TOKEN_MASK_HEADER};

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig};

use crate::{KernelError, Result};

/// Device address.
pub type DPtr = u64;

/// The 8-bit code format of row-wise quantized (W8A8) weights and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum W8Format {
    /// OCP E4M3 (largest code 448), compute capability 8.9+.
    E4m3,
    /// Symmetric int8 (codes −127..=127), compute capability 8.0+.
    I8,
}

impl W8Format {
    fn index(self) -> usize {
        match self {
            W8Format::E4m3 => 0,
            W8Format::I8 => 1,
        }
    }

    fn min_arch(self) -> &'static str {
        match self {
            W8Format::E4m3 => "8.9",
            W8Format::I8 => "8.0",
        }
    }
}

/// Every kernel of the module, loaded once.
pub struct Kernels {
    embedding_gather: CudaFunction,
    add_rmsnorm: CudaFunction,
    rope_kv_write: CudaFunction,
    rope_kv_write_fp8: CudaFunction,
    rope_kv_write_vec: CudaFunction,
    rope_kv_write_fp8_vec: CudaFunction,
    rope_kv_write_had: CudaFunction,
    rope_kv_write_fp8_had: CudaFunction,
    rope_kv_write_had_v: CudaFunction,
    rope_kv_write_fp8_had_v: CudaFunction,
    rope_kv_write_fp8s: CudaFunction,
    rope_kv_write_fp8s_w: CudaFunction,
    rope_kv_write_fp8s_had: CudaFunction,
    rope_kv_write_fp8s_had_v: CudaFunction,
    rope_kv_write_i8s: CudaFunction,
    rope_kv_write_i8s_w: CudaFunction,
    rope_kv_write_i8s_had: CudaFunction,
    rope_kv_write_i8s_had_v: CudaFunction,
    hadamard_heads: CudaFunction,
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
    paged_attention_mma_f8s_d64: CudaFunction,
    paged_attention_mma_f8s_d128: CudaFunction,
    paged_attention_mma_rows_f8s_d64: CudaFunction,
    paged_attention_mma_rows_f8s_d128: CudaFunction,
    paged_attention_mma_i8s_d64: CudaFunction,
    paged_attention_mma_i8s_d128: CudaFunction,
    paged_attention_mma_rows_i8s_d64: CudaFunction,
    paged_attention_mma_rows_i8s_d128: CudaFunction,
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
    apply_token_constraints: CudaFunction,
    lora_group: CudaFunction,
    lora_shrink_sgmv: CudaFunction,
    lora_shrink_staged: CudaFunction,
    /// `lora_shrink_staged` holding accumulators for ranks up to 32 only (fewer registers, more
    /// blocks per SM), for r_pad <= 32.
    lora_shrink_staged_r32: CudaFunction,
    /// Whether r_pad <= 32 takes `lora_shrink_staged_r32` (`PEREGRINE_LORA_STAGED_R32=0`: never).
    lora_staged_r32: bool,
    lora_shrink_ranks: CudaFunction,
    lora_pick_t: CudaFunction,
    /// The residual add + RMSNorm with a LoRA group's expand fused in (sm_90+: thread block clusters).
    add_rmsnorm_lora: CudaFunction,
    /// `[format][whether the GEMM left its scales]`.
    add_rmsnorm_lora_quant: [[CudaFunction; 2]; 2],
    /// SwiGLU with the gate|up group's LoRA expand fused in.
    silu_mul_lora: CudaFunction,
    silu_mul_lora_r32: CudaFunction,
    /// RoPE + bf16 KV write with the q|k|v group's LoRA expand fused in.
    rope_kv_write_lora: CudaFunction,
    rope_kv_write_lora_scaled: CudaFunction,
    rope_kv_write_lora_sums: CudaFunction,
    lora_expand_sgmv: CudaFunction,
    /// `lora_expand_sgmv` holding B for ranks up to 32 only (fewer registers), for r_pad <= 32.
    lora_expand_sgmv_r32: CudaFunction,
    /// SwiGLU of gate|up with its LoRA update fused (`lora_expand_swiglu`), and its r_pad <= 32 form.
    lora_expand_swiglu: CudaFunction,
    lora_expand_swiglu_r32: CudaFunction,
    /// Whether r_pad <= 32 takes `lora_expand_sgmv_r32` (`PEREGRINE_LORA_EXPAND_R32=0`: never).
    lora_expand_r32: bool,
    fill_uniform_bf16: CudaFunction,
    fill_f32: CudaFunction,
    f32_to_bf16: CudaFunction,
    /// [unroll 8, unroll 16] × [m ≤ 1, 2, 4, 8].
    gemv: [[CudaFunction; 4]; 2],
    /// gate/up GEMV with SwiGLU in the epilogue, m ≤ 1, 2, 4, 8.
    gemv_silu: [CudaFunction; 4],
    /// One token's GEMV with its LoRA shrink as extra rows (gemv.cu's LORA).
    gemv_lora_m1: CudaFunction,
    /// Row-wise 8-bit W8A8 GEMVs (gemv_fp8.cu), m ≤ 1, 2, 4, 8, 16, and the per-token quantizers of
    /// bf16 rows.
    /// m up to 1, 2, 4, 8, 16, then m = 1 with 2 and 4 weight rows per warp tile.
    gemv_e4m3: [CudaFunction; 7],
    gemv_i8: [CudaFunction; 7],
    /// The 8-bit GEMVs on tensor cores (gemv_mma8.cu), [`W8Format::index`] × [m ≤ 8, m ≤ 16].
    gemv8_mma: [[CudaFunction; 2]; 2],
    /// Its one-token form with the LoRA shrink's rows as extra blocks, per [`W8Format::index`] ×
    /// [without, with the expand in the epilogue].
    gemv8_mma_lora: [[CudaFunction; 2]; 2],
    /// The warps per SM its plan aims for (`PEREGRINE_GEMV8_MMA_WARPS`).
    gemv8_mma_warps: usize,
    /// Which 8-bit GEMV [`Kernels::gemv_w8`] runs (`PEREGRINE_GEMV8=cores` for the CUDA-core one).
    gemv8_kernel: Gemv8Kernel,
    quant_rows_e4m3: CudaFunction,
    quant_rows_i8: CudaFunction,
    /// `y *= xs[i] · ws[j]` after an unscaled 8-bit GEMM (quant8.cu).
    scale_outer: CudaFunction,
    /// `y = acc · xs[i] · ws[j]` from an unscaled int8 GEMM's int32 sums (quant8.cu).
    scale_outer_i32: CudaFunction,
    /// quant8.cu's fused quantizers and gemm_w8a8.cu's GEMMs, indexed by [`W8Format::index`].
    add_rmsnorm_quant: [CudaFunction; 2],
    silu_mul_quant: [CudaFunction; 2],
    /// gemm_w8a8.cu, [64 × 64 tiles, 32 × 32 tiles][format].
    gemm_w8a8: [[CudaFunction; 2]; 2],
    /// `PEREGRINE_GEMM8_TILE=64|32` forces the 8-bit GEMM's tile (None: by grid size).
    gemm8_tile: Option<usize>,
    /// Compute capability 8.9+: e4m3 conversions and e4m3 mma exist (the FP8 kernels' requirement).
    fp8_arch: bool,
    /// Compute capability 8.0+: int8 mma.sync (the int8 GEMM's requirement).
    int8_arch: bool,
    /// Compute capability 9.0+: thread block clusters and distributed shared memory.
    cluster_arch: bool,
    num_sms: u32,
    /// Tuning knobs read once from the environment, for measuring alternatives on a GPU without a
    /// rebuild: `PEREGRINE_GEMV_WPR=a,b` (warps per row for k < 8192 and k >= 8192, instead of
    /// [`Kernels::gemv_plan`]'s) and `PEREGRINE_ATTN_MAX_SPLITS=n` (instead of 16).
    gemv_wpr: Option<(usize, usize)>,
    /// `PEREGRINE_GEMV8_WPR=a,b`: the same for the 8-bit GEMVs (instead of [`Kernels::gemv8_plan`]'s).
    gemv8_wpr: Option<(usize, usize)>,
    /// Weight rows per warp tile of the one-token 8-bit GEMV (1, 2 or 4; `PEREGRINE_GEMV8_M1_ROWS`).
    gemv8_m1_rows: usize,
    attn_max_splits: usize,
    /// `PEREGRINE_LORA_SHRINK=split|whole|staged|staged-whole|ranks`: the LoRA shrink's kernel and grid, instead of
    /// [`Kernels::lora_shrink`]'s choice by step size (None).
    lora_shrink_shape: Option<LoraShrinkShape>,
    /// `PEREGRINE_LORA_EXPAND_TILES=n` (1 to 16): work tiles per expand block, instead of the choice
    /// by grid size.
    lora_expand_tiles: Option<usize>,
    /// Launch GEMVs with programmatic dependent launch (sm_90+; `PEREGRINE_PDL=0` turns it off).
    pdl: bool,
}

/// Warps per GEMV row from `var` = "a,b" (for k < 8192 and k >= 8192; each 1, 2, 4 or 8).
fn wpr_from_env(var: &str) -> Option<(usize, usize)> {
    let v = std::env::var(var).ok()?;
    let (a, b) = v.split_once(',')?;
    let ok = |w: usize| matches!(w, 1 | 2 | 4 | 8).then_some(w);
    Some((ok(a.trim().parse().ok()?)?, ok(b.trim().parse().ok()?)?))
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
            rope_kv_write_vec: f("rope_kv_write_vec")?,
            rope_kv_write_fp8_vec: f("rope_kv_write_fp8_vec")?,
            rope_kv_write_had: f("rope_kv_write_had")?,
            rope_kv_write_fp8_had: f("rope_kv_write_fp8_had")?,
            rope_kv_write_had_v: f("rope_kv_write_had_v")?,
            rope_kv_write_fp8_had_v: f("rope_kv_write_fp8_had_v")?,
            rope_kv_write_fp8s: f("rope_kv_write_fp8s")?,
            rope_kv_write_fp8s_w: f("rope_kv_write_fp8s_w")?,
            rope_kv_write_fp8s_had: f("rope_kv_write_fp8s_had")?,
            rope_kv_write_fp8s_had_v: f("rope_kv_write_fp8s_had_v")?,
            rope_kv_write_i8s: f("rope_kv_write_i8s")?,
            rope_kv_write_i8s_w: f("rope_kv_write_i8s_w")?,
            rope_kv_write_i8s_had: f("rope_kv_write_i8s_had")?,
            rope_kv_write_i8s_had_v: f("rope_kv_write_i8s_had_v")?,
            hadamard_heads: f("hadamard_heads")?,
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
            paged_attention_mma_f8s_d64: f("paged_attention_mma_f8s_d64")?,
            paged_attention_mma_f8s_d128: f("paged_attention_mma_f8s_d128")?,
            paged_attention_mma_rows_f8s_d64: f("paged_attention_mma_rows_f8s_d64")?,
            paged_attention_mma_rows_f8s_d128: f("paged_attention_mma_rows_f8s_d128")?,
            paged_attention_mma_i8s_d64: f("paged_attention_mma_i8s_d64")?,
            paged_attention_mma_i8s_d128: f("paged_attention_mma_i8s_d128")?,
            paged_attention_mma_rows_i8s_d64: f("paged_attention_mma_rows_i8s_d64")?,
            paged_attention_mma_rows_i8s_d128: f("paged_attention_mma_rows_i8s_d128")?,
            attention: AttentionKernel::from_env(),
            // mma.sync on bf16 and cp.async need sm_80.
            mma_ready: arch.0 >= 8 && mma_smem_opt_in(module, KvCacheDtype::Bf16),
            // cvt between e4m3 and f16 needs sm_89.
            fp8_ready: arch >= (8, 9) && mma_smem_opt_in(module, KvCacheDtype::Fp8E4m3) && mma_smem_opt_in(module, KvCacheDtype::Fp8E4m3PerHead)
                && mma_smem_opt_in(module, KvCacheDtype::Int8PerHead),
            attention_combine: f("attention_combine")?,
            silu_mul: f("silu_mul")?,
            argmax_rows: f("argmax_rows")?,
            sample_rows: f("sample_rows")?,
            apply_token_constraints: f("apply_token_constraints")?,
            lora_group: f("lora_group")?,
            lora_shrink_sgmv: f("lora_shrink_sgmv")?,
            lora_shrink_staged: {
                // Past the 48 KB default only with r_pad 64 (55 KB); sm_80+ allow far more, so a
                // refusal here is an error, not something to find at the first rank-64 prefill.
                use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN;
                let func = f("lora_shrink_staged")?;
                func.set_attribute(MAX_DYN, lora::lora_staged_smem_bytes(lora::lora_rank_pad(LORA_MAX_RANK)) as i32)?;
                func
            },
            // r_pad 32: 41 KB, under the default; no opt-in needed.
            lora_shrink_staged_r32: f("lora_shrink_staged_r32")?,
            lora_staged_r32: std::env::var("PEREGRINE_LORA_STAGED_R32").map_or(true, |v| v != "0"),
            lora_shrink_ranks: f("lora_shrink_ranks")?,
            lora_pick_t: f("lora_pick_t")?,
            add_rmsnorm_lora: f("add_rmsnorm_lora")?,
            add_rmsnorm_lora_quant: [[f("add_rmsnorm_lora_quant_e4m3")?, f("add_rmsnorm_lora_quant_e4m3_scaled")?], [f("add_rmsnorm_lora_quant_i8")?, f("add_rmsnorm_lora_quant_i8_scaled")?]],
            silu_mul_lora: f("silu_mul_lora")?,
            silu_mul_lora_r32: f("silu_mul_lora_r32")?,
            rope_kv_write_lora: f("rope_kv_write_lora")?,
            rope_kv_write_lora_scaled: f("rope_kv_write_lora_scaled")?,
            rope_kv_write_lora_sums: f("rope_kv_write_lora_sums")?,
            lora_expand_sgmv: f("lora_expand_sgmv")?,
            lora_expand_sgmv_r32: f("lora_expand_sgmv_r32")?,
            lora_expand_swiglu: f("lora_expand_swiglu")?,
            lora_expand_swiglu_r32: f("lora_expand_swiglu_r32")?,
            lora_expand_r32: std::env::var("PEREGRINE_LORA_EXPAND_R32").map_or(true, |v| v != "0"),
            fill_uniform_bf16: f("fill_uniform_bf16")?,
            fill_f32: f("fill_f32")?,
            f32_to_bf16: f("f32_to_bf16")?,
            gemv: [
                [f("gemv_m1_u8")?, f("gemv_m2_u8")?, f("gemv_m4_u8")?, f("gemv_m8_u8")?],
                [f("gemv_m1_u16")?, f("gemv_m2_u16")?, f("gemv_m4_u16")?, f("gemv_m8_u16")?],
            ],
            gemv_silu: [f("gemv_silu_m1")?, f("gemv_silu_m2")?, f("gemv_silu_m4")?, f("gemv_silu_m8")?],
            gemv_lora_m1: f("gemv_lora_m1")?,
            gemv_e4m3: [f("gemv_e4m3_m1")?, f("gemv_e4m3_m2")?, f("gemv_e4m3_m4")?, f("gemv_e4m3_m8")?, f("gemv_e4m3_m16")?, f("gemv_e4m3_m1r2")?, f("gemv_e4m3_m1r4")?],
            gemv_i8: [f("gemv_i8_m1")?, f("gemv_i8_m2")?, f("gemv_i8_m4")?, f("gemv_i8_m8")?, f("gemv_i8_m16")?, f("gemv_i8_m1r2")?, f("gemv_i8_m1r4")?],
            gemv8_mma: [[f("gemv8_mma_e4m3_t1")?, f("gemv8_mma_e4m3_t2")?], [f("gemv8_mma_i8_t1")?, f("gemv8_mma_i8_t2")?]],
            gemv8_mma_lora: [[f("gemv8_mma_e4m3_lora_t1")?, f("gemv8_mma_e4m3_lorax_t1")?], [f("gemv8_mma_i8_lora_t1")?, f("gemv8_mma_i8_lorax_t1")?]],
            gemv8_mma_warps: std::env::var("PEREGRINE_GEMV8_MMA_WARPS").ok().and_then(|v| v.parse().ok()).filter(|&w: &usize| (1..=64).contains(&w)).unwrap_or(GEMV8_MMA_WARPS_PER_SM),
            gemv8_kernel: Gemv8Kernel::from_env(),
            quant_rows_e4m3: f("quant_rows_e4m3")?,
            quant_rows_i8: f("quant_rows_i8")?,
            scale_outer: f("scale_outer")?,
            scale_outer_i32: f("scale_outer_i32")?,
            add_rmsnorm_quant: [f("add_rmsnorm_quant_e4m3")?, f("add_rmsnorm_quant_i8")?],
            silu_mul_quant: {
                // The online rotation of down_proj's input holds the row in shared memory (4 bytes
                // a channel: 56 KB for Llama-3.1-8B's 14336), past the 48 KB default.
                use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYN;
                let funcs = [f("silu_mul_quant_e4m3")?, f("silu_mul_quant_i8")?];
                for func in &funcs {
                    func.set_attribute(MAX_DYN, quant8::SILU_HADAMARD_SMEM_MAX as i32)?;
                }
                funcs
            },
            gemm_w8a8: [[f("gemm_w8a8_e4m3")?, f("gemm_w8a8_i8")?], [f("gemm_w8a8_e4m3_t32")?, f("gemm_w8a8_i8_t32")?]],
            gemm8_tile: std::env::var("PEREGRINE_GEMM8_TILE").ok().and_then(|v| v.parse().ok()).filter(|t| matches!(t, 32 | 64)),
            fp8_arch: arch >= (8, 9),
            int8_arch: arch >= (8, 0),
            cluster_arch: arch >= (9, 0),
            num_sms: num_sms.max(1),
            gemv_wpr: wpr_from_env("PEREGRINE_GEMV_WPR"),
            gemv8_wpr: wpr_from_env("PEREGRINE_GEMV8_WPR"),
            gemv8_m1_rows: std::env::var("PEREGRINE_GEMV8_M1_ROWS").ok().and_then(|v| v.parse().ok()).filter(|r| matches!(r, 1 | 2 | 4)).unwrap_or(GEMV8_M1_ROWS_DEFAULT),
            attn_max_splits: std::env::var("PEREGRINE_ATTN_MAX_SPLITS").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| (1..=16).contains(&n)).unwrap_or(16),
            lora_shrink_shape: match std::env::var("PEREGRINE_LORA_SHRINK").as_deref() {
                Ok("whole") => Some(LoraShrinkShape::Whole),
                Ok("split") => Some(LoraShrinkShape::Split),
                Ok("staged") => Some(LoraShrinkShape::Staged),
                Ok("staged-whole") => Some(LoraShrinkShape::StagedWhole),
                Ok("ranks") => Some(LoraShrinkShape::Ranks),
                _ => None,
            },
            lora_expand_tiles: std::env::var("PEREGRINE_LORA_EXPAND_TILES").ok().and_then(|v| v.parse().ok()).filter(|n: &usize| (1..=16).contains(n)),
            // On by default on sm_90+ (`PEREGRINE_PDL=0` turns it off): with the kernels before the
            // GEMVs (norms, attention, the gate/up GEMV) triggering early, batch-1 decode on an H100
            // went 166.2 -> 167.8 tokens/s (docs/benchmarks.md).
            pdl: arch.0 >= 9 && std::env::var("PEREGRINE_PDL").map_or(true, |v| v != "0"),
        })
    }

    /// Threads per block of a one-block-per-row kernel that holds its row in registers (common.cuh's
    /// row chunks: 8 values each, at most `ROW_MAXC` = 4 per thread): about two chunks per thread,
    /// 64 to 1024 threads. Rows must be a multiple of 8 values, at most 32,768.
    pub(crate) fn row_threads(len: usize, what: &str) -> Result<u32> {
        const ROW_MAXC: usize = 4;
        let chunks = len / 8;
        if !len.is_multiple_of(8) || chunks > ROW_MAXC * 1024 {
            return Err(KernelError::Unsupported(format!("{what}: rows of {len} values (a multiple of 8, at most {})", 8 * ROW_MAXC * 1024)));
        }
        Ok(chunks.div_ceil(2).next_power_of_two().clamp(64, 1024) as u32)
    }

    /// Grid for grid-stride elementwise kernels: enough blocks to fill the GPU, no more.
    fn elementwise_grid(&self, n: usize, block: u32) -> u32 {
        let want = n.div_ceil(block as usize).max(1);
        want.min(self.num_sms as usize * 8) as u32
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
        self.launch_with(s, config, pdl, None)
    }

    /// [`Launch::launch`] in thread block clusters of `cluster_x` blocks along x (sm_90+; the grid's
    /// x a multiple of it).
    ///
    /// # Safety
    /// As [`Launch::launch`].
    unsafe fn launch_clustered(&mut self, s: &CudaStream, config: LaunchConfig, pdl: bool, cluster_x: u32) -> Result<()> {
        self.launch_with(s, config, pdl, Some(cluster_x))
    }

    /// # Safety
    /// As [`Launch::launch`].
    unsafe fn launch_with(&mut self, s: &CudaStream, config: LaunchConfig, pdl: bool, cluster_x: Option<u32>) -> Result<()> {
        use cudarc::driver::sys;
        s.context().bind_to_thread()?;
        let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
        let mut count = 0;
        if pdl {
            attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[count].value.programmaticStreamSerializationAllowed = 1;
            count += 1;
        }
        if let Some(x) = cluster_x {
            attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[count].value.clusterDim.x = x;
            attrs[count].value.clusterDim.y = 1;
            attrs[count].value.clusterDim.z = 1;
            count += 1;
        }
        let launch = sys::CUlaunchConfig {
            gridDimX: config.grid_dim.0,
            gridDimY: config.grid_dim.1,
            gridDimZ: config.grid_dim.2,
            blockDimX: config.block_dim.0,
            blockDimY: config.block_dim.1,
            blockDimZ: config.block_dim.2,
            sharedMemBytes: config.shared_mem_bytes,
            hStream: s.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: count as u32,
        };
        sys::cuLaunchKernelEx(&launch, self.func.cu_function(), self.args.as_mut_ptr(), std::ptr::null_mut()).result()?;
        Ok(())
    }
}

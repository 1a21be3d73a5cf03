//! lora.cu: multi-LoRA, tokens grouped by adapter slot; shrink and expand on tensor cores.

use cudarc::driver::{CudaStream, LaunchConfig};

use super::{as_i32, as_u32, cfg, DPtr, Kernels, Launch, OuterScale, RopeCache, RopeTables, W8Format};
use crate::{KernelError, Result};

/// Largest rank the grouped kernels take (lora.cu's LORA_MAX_R); stacks pad ranks to
/// [`lora_rank_pad`].
pub const LORA_MAX_RANK: usize = 64;
/// Modules one launch covers (q|k|v).
pub const LORA_MAX_MODULES: usize = 3;
/// Fan-in per shrink block (lora.cu's LORA_KC).
const LORA_KC: usize = 256;
const LORA_EXPAND_COLS: usize = 128;
/// Columns of each module per `lora_expand_swiglu` block (lora.cu's LORA_SWIGLU_COLS).
const LORA_SWIGLU_COLS: usize = 64;
/// Tokens per work tile (lora.cu's LORA_TILE).
pub const LORA_TILE: usize = 16;
/// `add_rmsnorm_lora`'s cluster (blocks per tile), warps per block and column tiles of 8 per warp
/// (lora.cu's NORM_LORA_*).
const NORM_LORA_CLUSTER: usize = 8;
const NORM_LORA_WARPS: usize = 8;
const NORM_LORA_MAXJ: usize = 8;
/// `silu_mul_lora`'s columns per block (lora.cu's SWIGLU_LORA_COLS).
const SWIGLU_LORA_COLS: usize = 128;
/// The most work tiles a `silu_mul_lora` block takes (lora.cu's SWIGLU_LORA_MAX_TPB).
const SWIGLU_LORA_MAX_TPB: usize = 8;
/// `rope_kv_write_lora`'s warps per block (lora.cu's ROPE_LORA_WARPS): a head's column-tile pairs
/// (d / 16 of them) split evenly over them, at most ROPE_LORA_MAXI (2) each.
const ROPE_LORA_WARPS: usize = 4;

/// The work tiles a `silu_mul_lora` block takes for `n` tokens over `num_slots` slots: a slot's
/// tiles if the tokens spread evenly (one block then reads its slice of a slot's B once), at most 4
/// (a block's tiles run one after another). 4 adapters give 4 at batch 256 and 1 at batch 64; 16
/// adapters give 1 at batch 256.
pub fn swiglu_lora_tiles_per_block(n: usize, num_slots: usize) -> usize {
    n.div_ceil(num_slots.max(1)).div_ceil(LORA_TILE).clamp(1, 4)
}

/// Most work tiles a step of `n` tokens over `num_slots` slots can have: the length of
/// [`LoraSegments::tiles`] is `1 + 2 ×` this, of [`LoraScratch::counters`] `3 ×` this.
pub fn lora_max_tiles(n: usize, num_slots: usize) -> usize {
    n.div_ceil(LORA_TILE) + num_slots
}

/// Whether [`Kernels::lora_expand_swiglu`] takes a gate|up group of `inter` columns per module.
pub fn lora_swiglu_fits(inter: usize) -> bool {
    inter > 0 && inter.is_multiple_of(LORA_SWIGLU_COLS)
}

/// Rank every slot's rows are padded to in the stacks: a multiple of the mma's k step (16).
pub fn lora_rank_pad(max_rank: usize) -> usize {
    max_rank.div_ceil(16).max(1) * 16
}

/// Blocks the shrink splits a fan-in of `k` into (partial sums `[splits, n, R]` f32).
pub fn lora_splits(k: usize) -> usize {
    k.div_ceil(LORA_KC).max(1)
}

/// Which shrink kernel and grid [`Kernels::lora_shrink`] launches. All give the same bits (lora.cu;
/// `gpu_lora` checks it), so the choice may follow the step's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraShrinkShape {
    /// `lora_shrink_sgmv`, the fan-in split over blocks (one chunk of 256 each, staged in shared
    /// memory): steps below `LORA_STAGED_MIN_TOKENS` (2,048) that `Ranks` does not take.
    Split,
    /// `lora_shrink_sgmv`, one block per tile and module walking the whole fan-in.
    Whole,
    /// `lora_shrink_staged`: x and A staged in shared memory, 64 tokens per block, the fan-in split
    /// over as many blocks as fill the GPU: prefill-sized steps (from `LORA_STAGED_MIN_TOKENS`, 2,048).
    Staged,
    /// `lora_shrink_staged` with one block per 64 tokens and module walking the whole fan-in (what
    /// `Staged` becomes where the tiles alone fill the GPU).
    StagedWhole,
    /// `lora_shrink_ranks`: one block per 8 ranks, work tile and module walking the whole fan-in
    /// with 16 warps, no reduction across blocks (fan-ins up to [`LORA_RANKS_MAX_K`]; `Split`
    /// beyond). The default for decode-sized steps over short fan-ins ([`LORA_RANKS_TOKENS`],
    /// [`LORA_RANKS_DEFAULT_MAX_K`]).
    Ranks,
}

/// Warps of a `lora_shrink_ranks` block (lora.cu's LORA_RK_WARPS).
const LORA_RANKS_WARPS: u32 = 16;

/// The longest fan-in `lora_shrink_ranks` takes (its shared memory holds 64 chunks of 256).
pub const LORA_RANKS_MAX_K: usize = 64 * LORA_KC;

/// `Ranks` by default up to this many tokens and this fan-in. On an H100 (`MICRO=lora`, 4 adapters
/// of rank 32, Llama-3.1-8B shapes, docs/benchmarks.md session 18) it beat `Split` on the 4096-wide
/// fan-ins (q|k|v, o, gate|up) at 1 / 16 / 64 tokens (q|k|v 14.5 -> 12.4 µs at 1 token) and lost on
/// down's 14,336 (4 blocks walking 56 chunks each: 15.5 -> 19.6 µs); at 256 tokens it lost on q|k|v.
/// In `bench --lora 4 --lora-rank 32`, LoRA / base at batch 1 / 8 / 64 went 0.84 / 0.90 / 0.90 ->
/// 0.89 / 0.94 / 0.89 over bf16 and 0.73 / 0.76 / 0.82 -> 0.79 / 0.78 / 0.85 over fp8.
const LORA_RANKS_TOKENS: usize = 128;
const LORA_RANKS_DEFAULT_MAX_K: usize = 8192;

/// Dynamic shared memory of a `lora_shrink_staged` block (lora.cu): LORA_STAGES sub-ranges of x's 64
/// rows and A's `r_pad` rows, 144 bytes each.
pub(crate) fn lora_staged_smem_bytes(r_pad: usize) -> u32 {
    const STAGES: usize = 3; // lora.cu's LORA_STAGES
    (STAGES * (4 * LORA_TILE + r_pad) * (LORA_KC / 4 + 8) * 2) as u32
}

/// Steps of at least this many tokens take 4 work tiles per expand block (tiles mostly of one slot
/// there; below, decode batches' tiles mostly change slot and 1 per block is faster).
const LORA_EXPAND_MULTI_TILE_MIN_TOKENS: usize = 512;

/// Dynamic shared memory of a `lora_shrink_sgmv` block (lora.cu): a chunk of the tile's 16 rows of
/// x and of A's `r_pad` rows, LORA_KC + 8 bf16 each (42 KB at rank 64, under the 48 KB that needs no
/// opt-in).
fn lora_split_smem_bytes(r_pad: usize) -> u32 {
    ((LORA_TILE + r_pad) * (LORA_KC + 8) * 2) as u32
}

/// Steps of at least this many tokens take the staged shrink by default. Below it the split kernel,
/// with its chunks staged in shared memory, is faster: on an H200 (`MICRO=lora`, 16 adapters of rank
/// 32, µs for q|k|v / o / gate|up / down) 1,024 tokens 39.6 / 20.7 / 31.0 / 49.0 against the staged
/// kernel's 39.5 / 28.7 / 34.7 / 63.4; at 2,048 the staged kernel wins in sum (210 against 225 µs).
const LORA_STAGED_MIN_TOKENS: usize = 2048;

/// The step's adapter tables on the device, shared by every projection of the step.
#[derive(Debug, Clone, Copy)]
pub struct LoraSegments {
    /// i32 per token: its slot, -1 for the base model.
    pub slots: DPtr,
    /// i32 per token (written by [`Kernels::lora_group`]): token indices grouped by slot.
    pub order: DPtr,
    /// `num_slots + 1` i32 (written by [`Kernels::lora_group`]): where each slot's tokens start in `order`.
    pub seg: DPtr,
    /// `1 + 2 × lora_max_tiles(n, num_slots)` i32 (written by [`Kernels::lora_group`]): the count of
    /// work tiles, then (slot, first position in its segment) per tile.
    pub tiles: DPtr,
    /// i32 per slot: the adapter's rank (0 for an empty slot).
    pub ranks: DPtr,
    /// f32 per slot: the adapter's scaling.
    pub scales: DPtr,
    pub num_slots: usize,
}

/// One module of a projection group: its layer's A stack `[slots, r_pad, k]` and B stack `[slots,
/// out, r_pad]` (bf16), and where its `out` columns start in the (fused) output rows.
#[derive(Debug, Clone, Copy)]
pub struct LoraModule {
    pub a: DPtr,
    pub b: DPtr,
    pub out: usize,
    pub col: usize,
}

/// Work buffers of [`Kernels::lora_apply`]: `t_part` f32 of `lora_splits(k) * n * R`, `t_hi` and
/// `t_lo` bf16 of `n * R`, with R = modules × r_pad; `counters`: 3 i32 per slot, zeroed once at
/// allocation (every launch leaves them 0).
#[derive(Debug, Clone, Copy)]
pub struct LoraScratch {
    pub t_part: DPtr,
    pub t_hi: DPtr,
    pub t_lo: DPtr,
    pub counters: DPtr,
}

/// A LoRA update that [`Kernels::lora_expand_to`] wrote beside a base projection's output, for the
/// kernel that consumes that output to add (rmsnorm.cu, silu_mul.cu, quant8.cu, rope_kv.cu): bf16
/// rows laid out as the output (same row stride and column offsets), written for the tokens whose
/// `slots` entry is >= 0 and not read for the others. The expand then needs nothing the base
/// projection writes, so both run side by side.
#[derive(Debug, Clone, Copy)]
pub struct LoraDelta {
    pub d: DPtr,
    /// i32 per token, as [`LoraSegments::slots`].
    pub slots: DPtr,
}

impl LoraDelta {
    /// The two kernel arguments (null pointers for None).
    pub(crate) fn args(delta: Option<LoraDelta>) -> (DPtr, DPtr) {
        delta.map_or((0, 0), |d| (d.d, d.slots))
    }
}

/// What [`shrink_shape`] chooses by: the step's tokens, the group's fan-in and modules, and
/// whether x and A allow the staged kernel's 16-byte copies.
#[derive(Debug, Clone, Copy)]
struct ShrinkStep {
    n: usize,
    k: usize,
    modules: usize,
    aligned: bool,
}

/// The shrink kernel for a step: `forced` where set (falling back where that kernel cannot take the
/// step), else by size. All give the same bits (lora.cu), so the choice may follow the step's size:
/// prefill-sized steps take the staged kernel, which splits the fan-in to fill the GPU; decode-sized
/// steps over fan-ins up to [`LORA_RANKS_DEFAULT_MAX_K`] the rank-tile kernel; work tiles enough
/// for four blocks per SM on their own one block per tile and module walking the whole fan-in (on
/// an H100 at 4096 tokens the q|k|v shrink went 162 -> 130 µs this way, while o and down, one
/// module, got slower: docs/benchmarks.md); the rest the split kernel.
fn shrink_shape(forced: Option<LoraShrinkShape>, step: ShrinkStep, num_sms: usize) -> LoraShrinkShape {
    let ShrinkStep { n, k, modules, aligned } = step;
    match forced {
        Some(LoraShrinkShape::Staged | LoraShrinkShape::StagedWhole) if !aligned => LoraShrinkShape::Whole,
        Some(LoraShrinkShape::Ranks) if k > LORA_RANKS_MAX_K => LoraShrinkShape::Split,
        Some(shape) => shape,
        None if aligned && n >= LORA_STAGED_MIN_TOKENS => LoraShrinkShape::Staged,
        None if n <= LORA_RANKS_TOKENS && k <= LORA_RANKS_DEFAULT_MAX_K => LoraShrinkShape::Ranks,
        None if n.div_ceil(LORA_TILE) * modules >= 4 * num_sms => LoraShrinkShape::Whole,
        None => LoraShrinkShape::Split,
    }
}

impl Kernels {
    /// Fixes the LoRA kernels' launch shapes instead of choosing them by step size (None: choose):
    /// the shrink's kernel and grid, and the work tiles
    /// per expand block (1 to 16). Every shape gives the same bits; tests check that.
    pub fn set_lora_launch_shapes(&mut self, shrink: Option<LoraShrinkShape>, expand_tiles: Option<usize>) {
        self.lora_shrink_shape = shrink;
        self.lora_expand_tiles = expand_tiles.map(|t| t.clamp(1, 16));
    }

    /// Whether stacks padded to 32 ranks or fewer take the expand that holds B for 32 ranks only
    /// (the default) or the one for every rank. The same bits either way; tests check that.
    pub fn set_lora_expand_r32(&mut self, on: bool) {
        self.lora_expand_r32 = on;
    }

    /// The same for the staged (prefill-sized) shrink: accumulators for 32 ranks only, or for every
    /// rank. The same bits either way; tests check that.
    pub fn set_lora_staged_r32(&mut self, on: bool) {
        self.lora_staged_r32 = on;
    }

    /// Groups the `n` tokens of a step by slot into `segs.order` / `segs.seg` (once per step; see
    /// lora.cu).
    ///
    /// # Safety
    /// `segs.slots` and `segs.order` hold `n` i32, `segs.seg` `num_slots + 1`, `segs.tiles` as
    /// documented there; every slot is -1 or below `num_slots`.
    pub unsafe fn lora_group(&self, s: &CudaStream, segs: &LoraSegments, n: usize) -> Result<()> {
        self.lora_group_zeroing(s, segs, n, 0, 0)
    }

    /// [`Kernels::lora_group`] that also sets `zero_len` i32 at `zero` to 0 before any later kernel
    /// starts (the step's counters of [`super::GemvLoraExpand`]).
    ///
    /// # Safety
    /// As [`Kernels::lora_group`]; `zero` holds `zero_len` i32 (at most 1,024).
    pub unsafe fn lora_group_zeroing(&self, s: &CudaStream, segs: &LoraSegments, n: usize, zero: DPtr, zero_len: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if zero_len > 1024 || (zero_len > 0 && zero == 0) {
            return Err(KernelError::Unsupported(format!("lora_group: {zero_len} counters to zero (at most 1,024)")));
        }
        let (n, slots, zl) = (as_i32(n, "tokens")?, as_i32(segs.num_slots, "slots")?, zero_len as i32);
        Launch::new(&self.lora_group).arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.slots).arg(&n).arg(&slots).arg(&zero).arg(&zl).launch(s, cfg(1, 1024), self.pdl)?;
        Ok(())
    }

    /// `y[i, col_m ..] += scale · (x[i, :] · A_m[slot_i]ᵀ) · B_m[slot_i]ᵀ` for every module m of a
    /// projection group and every token with a slot, in two launches (grouped shrink with the split
    /// reduction in its last blocks, grouped expand) after [`Kernels::lora_group`] ran for the step. Tensor cores: needs
    /// sm_80.
    ///
    /// # Safety
    /// x: `n` rows of `k` bf16 `x_stride` apart; y: `n` rows `y_stride` apart holding every module's
    /// columns; the stacks hold `segs.num_slots` slots of `r_pad` ranks; `work` as [`LoraScratch`];
    /// `segs` as [`LoraSegments`] for these `n` tokens.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_apply(&self, s: &CudaStream, y: DPtr, y_stride: usize, x: DPtr, x_stride: usize, k: usize, modules: &[LoraModule], r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize) -> Result<()> {
        self.lora_shrink(s, x, x_stride, k, modules, r_pad, segs, work, n)?;
        self.lora_expand(s, y, y_stride, modules, r_pad, segs, work, n)
    }

    /// The first half of [`Kernels::lora_apply`]: `t = scale · x · Aᵀ` for every module of the group
    /// into `work.t_hi`/`t_lo` (bf16 hi + lo). It reads only `x`, the A stacks and the step's tables,
    /// so it may run on a second stream beside the base projection that reads the same `x`.
    ///
    /// # Safety
    /// As [`Kernels::lora_apply`]; `work` must not be in use by another shrink or expand.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_shrink(&self, s: &CudaStream, x: DPtr, x_stride: usize, k: usize, modules: &[LoraModule], r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize) -> Result<()> {
        if n == 0 || segs.num_slots == 0 {
            return Ok(());
        }
        check_group(modules, r_pad)?;
        if !k.is_multiple_of(16) || !x_stride.is_multiple_of(2) || !x.is_multiple_of(4) {
            return Err(KernelError::Unsupported(format!("LoRA: fan-in {k} must be a multiple of 16 and x rows 4-byte aligned")));
        }
        let (m0, m1, m2) = (module_at(modules, 0), module_at(modules, 1), module_at(modules, 2));
        // 16-byte cp.async needs 16-byte aligned rows of x and A; where they are not, the staged
        // kernel is not an option.
        let aligned = x.is_multiple_of(16) && x_stride.is_multiple_of(8) && k.is_multiple_of(8) && modules.iter().all(|m| m.a.is_multiple_of(16));
        let shape = shrink_shape(self.lora_shrink_shape, ShrinkStep { n, k, modules: modules.len(), aligned }, self.num_sms as usize);
        let max_tiles = lora_max_tiles(n, segs.num_slots);
        let (n_i, k_i, r_i, nm, x_stride) = (as_i32(n, "tokens")?, as_i32(k, "k")?, as_i32(r_pad, "r_pad")?, modules.len() as i32, as_i32(x_stride, "x_stride")?);
        if shape == LoraShrinkShape::Ranks {
            let grid = ((r_pad / 8) as u32, as_u32(max_tiles, "work tiles")?, modules.len() as u32);
            let launch = LaunchConfig { grid_dim: grid, block_dim: (LORA_RANKS_WARPS * 32, 1, 1), shared_mem_bytes: 0 };
            let mut l = Launch::new(&self.lora_shrink_ranks);
            l.arg(&work.t_hi).arg(&work.t_lo).arg(&x).arg(&x_stride).arg(&m0.a).arg(&m1.a).arg(&m2.a);
            l.arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.ranks).arg(&segs.scales).arg(&k_i).arg(&r_i).arg(&nm);
            l.launch(s, launch, self.pdl)?;
            return Ok(());
        }
        let staged = matches!(shape, LoraShrinkShape::Staged | LoraShrinkShape::StagedWhole);
        let (function, grid, chunks_per_block) = if staged {
            let groups = max_tiles.div_ceil(4);
            let chunks = lora_splits(k);
            // Enough blocks for four per SM (each holds 37 KB of shared memory, six fit).
            let wanted = if shape == LoraShrinkShape::StagedWhole { 1 } else { (4 * self.num_sms as usize).div_ceil(groups * modules.len()).clamp(1, chunks) };
            let per_block = chunks.div_ceil(wanted);
            let splits = chunks.div_ceil(per_block);
            // The r32 kernel fits 5 blocks per SM instead of 3: faster while the grid splits the fan-in
            // (H200, 4096 tokens, 4 adapters: down 149 -> 126 µs), slower once the step is large
            // enough to walk it whole (16384 tokens: down 345 -> 396 µs; docs/benchmarks.md).
            let function = if r_pad <= 32 && self.lora_staged_r32 && splits > 1 { &self.lora_shrink_staged_r32 } else { &self.lora_shrink_staged };
            (function, (as_u32(groups, "tile groups")?, modules.len() as u32, as_u32(splits, "splits")?), per_block)
        } else {
            let splits = if shape == LoraShrinkShape::Whole { 1 } else { lora_splits(k) };
            (&self.lora_shrink_sgmv, (as_u32(splits, "splits")?, as_u32(max_tiles, "work tiles")?, modules.len() as u32), 0)
        };
        let smem = if staged { lora_staged_smem_bytes(r_pad) } else { lora_split_smem_bytes(r_pad) };
        let launch = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: smem };
        let per_block_i = as_i32(chunks_per_block, "chunks per block")?;
        let mut l = Launch::new(function);
        l.arg(&work.t_hi).arg(&work.t_lo).arg(&work.t_part).arg(&work.counters).arg(&x).arg(&x_stride).arg(&m0.a).arg(&m1.a).arg(&m2.a);
        l.arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.ranks).arg(&segs.scales).arg(&n_i).arg(&k_i).arg(&r_i).arg(&nm);
        let aligned_i = i32::from(aligned);
        if staged {
            l.arg(&per_block_i);
        } else {
            l.arg(&aligned_i);
        }
        l.launch(s, launch, self.pdl)?;
        Ok(())
    }

    /// Whether [`Kernels::add_rmsnorm_lora`] takes rows of `hidden` on this GPU (sm_90+).
    pub fn add_rmsnorm_lora_fits(&self, hidden: usize) -> bool {
        let cols = 8 * NORM_LORA_CLUSTER;
        self.cluster_arch && hidden > 0 && hidden.is_multiple_of(cols) && hidden / cols <= NORM_LORA_WARPS * NORM_LORA_MAXJ
    }

    /// The residual add + RMSNorm with one LoRA module's expand fused in (lora.cu's
    /// `add_rmsnorm_lora`): `residual[i] += y[i, ..hidden] + bf16(scale_s · u_i · B_sᵀ)` and `out[i]
    /// = bf16(rmsnorm(residual[i]) · weight)` for each of the `n` tokens, where `y` (row stride
    /// `y_stride`) is a base GEMM's output whose weight carried every slot's A rows after its own:
    /// slot s's `u = x · A_sᵀ` (unscaled) at columns `hidden + s × r_pad ..`. `b`: the module's B
    /// stack of the layer, `[slots, hidden, r_pad]`. Tokens without a slot get the plain add + norm.
    ///
    /// # Safety
    /// `residual`/`out` hold `n` rows of `hidden`, `y` `n` rows of `y_stride >= hidden + num_slots ×
    /// r_pad`; `weight` `hidden` f32; `segs` as in [`Kernels::lora_apply`], after
    /// [`Kernels::lora_group`] of this step; `add_rmsnorm_lora_fits(hidden)`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rmsnorm_lora(&self, s: &CudaStream, residual: DPtr, y: DPtr, y_stride: usize, b: DPtr, weight: DPtr, out: DPtr, segs: &LoraSegments, n: usize, hidden: usize, eps: f32, r_pad: usize) -> Result<()> {
        self.add_rmsnorm_lora_launch(s, residual, y, y_stride, b, weight, out, segs, n, hidden, eps, r_pad, None)
    }

    /// [`Kernels::add_rmsnorm_lora`] after an 8-bit projection (lora.cu's
    /// `add_rmsnorm_lora_quant_{e4m3,i8}`): `y` is the output of an 8-bit GEMM whose weight carried
    /// every slot's A rows, row-quantized, after its own (their row scales after the weight's), with
    /// `y_scale` the scales it left (`Cuda::linear_w8_deferred`; None: y is final), which apply to
    /// u's columns as to the base's. Also writes each normalized row's codes to `q` (`n × hidden`
    /// bytes) and its scale to `q_scales`, as [`Kernels::add_rmsnorm_quant`] does; `out` may be 0
    /// (no bf16 copy). `y_scale.xs` may be `q_scales`.
    ///
    /// # Safety
    /// As [`Kernels::add_rmsnorm_lora`]; with `y_scale`, `ws` holds `y_stride` row scales and
    /// `sums_i32` (if not 0) `n` rows of `y_stride` sums; `q`/`q_scales` as above.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rmsnorm_lora_quant(&self, s: &CudaStream, format: W8Format, residual: DPtr, y: DPtr, y_stride: usize, y_scale: Option<OuterScale>, b: DPtr, weight: DPtr, out: DPtr, q: DPtr, q_scales: DPtr, segs: &LoraSegments, n: usize, hidden: usize, eps: f32, r_pad: usize) -> Result<()> {
        self.check_w8(format, "add_rmsnorm_lora_quant")?;
        self.add_rmsnorm_lora_launch(s, residual, y, y_stride, b, weight, out, segs, n, hidden, eps, r_pad, Some((format, y_scale, q, q_scales)))
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn add_rmsnorm_lora_launch(&self, s: &CudaStream, residual: DPtr, y: DPtr, y_stride: usize, b: DPtr, weight: DPtr, out: DPtr, segs: &LoraSegments, n: usize, hidden: usize, eps: f32, r_pad: usize, quant: Option<(W8Format, Option<OuterScale>, DPtr, DPtr)>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if !self.add_rmsnorm_lora_fits(hidden) || r_pad == 0 || r_pad > LORA_MAX_RANK || !r_pad.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("add_rmsnorm_lora: hidden {hidden}, r_pad {r_pad}")));
        }
        if y_stride < hidden + segs.num_slots * r_pad || !y_stride.is_multiple_of(2) {
            return Err(KernelError::Unsupported(format!("add_rmsnorm_lora: row stride {y_stride} for {} slots of rank {r_pad}", segs.num_slots)));
        }
        let lora_tiles = lora_max_tiles(n, segs.num_slots);
        let grid_y = as_u32(lora_tiles + n.div_ceil(LORA_TILE), "norm tiles")?;
        let (ys, hid, n_i, lt, r_i) = (as_i32(y_stride, "y_stride")?, as_i32(hidden, "hidden")?, as_i32(n, "tokens")?, as_i32(lora_tiles, "tiles")?, as_i32(r_pad, "r_pad")?);
        let config = LaunchConfig { grid_dim: (NORM_LORA_CLUSTER as u32, grid_y, 1), block_dim: (NORM_LORA_WARPS as u32 * 32, 1, 1), shared_mem_bytes: 0 };
        let (dxs, dws, y_i32) = OuterScale::args(quant.and_then(|(_, y_scale, ..)| y_scale));
        let (q, qs) = quant.map_or((0, 0), |(_, _, q, qs)| (q, qs));
        // The raw output each format's deferred GEMM leaves: e4m3 bf16, int8 int32 sums.
        let f = match quant {
            None => &self.add_rmsnorm_lora,
            Some((format, None, ..)) => &self.add_rmsnorm_lora_quant[format.index()][0],
            Some((format, Some(scale), ..)) if (scale.sums_i32 != 0) == (format == W8Format::I8) => &self.add_rmsnorm_lora_quant[format.index()][1],
            Some((format, Some(_), ..)) => return Err(KernelError::Unsupported(format!("add_rmsnorm_lora_quant: {format:?} output left unscaled in the other format's layout"))),
        };
        let mut l = Launch::new(f);
        l.arg(&residual).arg(&y).arg(&ys).arg(&b).arg(&weight).arg(&out).arg(&hid).arg(&eps);
        l.arg(&segs.slots).arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.ranks).arg(&segs.scales).arg(&n_i).arg(&lt).arg(&r_i);
        if quant.is_some() {
            l.arg(&dxs).arg(&dws).arg(&y_i32).arg(&q).arg(&qs);
        }
        l.launch_clustered(s, config, self.pdl, NORM_LORA_CLUSTER as u32)?;
        Ok(())
    }

    /// Registers and local (spilled) bytes a thread of each fused LoRA consumer takes on this GPU:
    /// what bounds the blocks an SM holds, which these latency-bound kernels live on (`micro`).
    pub fn fused_lora_resources(&self) -> Result<Vec<(&'static str, i32, i32)>> {
        let named = [
            ("add_rmsnorm_lora", &self.add_rmsnorm_lora),
            ("silu_mul_lora", &self.silu_mul_lora),
            ("silu_mul_lora_r32", &self.silu_mul_lora_r32),
            ("rope_kv_write_lora", &self.rope_kv_write_lora),
            ("add_rmsnorm_lora_quant_e4m3", &self.add_rmsnorm_lora_quant[0][0]),
            ("add_rmsnorm_lora_quant_i8", &self.add_rmsnorm_lora_quant[1][0]),
            ("add_rmsnorm_lora_quant_e4m3_scaled", &self.add_rmsnorm_lora_quant[0][1]),
            ("add_rmsnorm_lora_quant_i8_scaled", &self.add_rmsnorm_lora_quant[1][1]),
            ("rope_kv_write_lora_scaled", &self.rope_kv_write_lora_scaled),
            ("rope_kv_write_lora_sums", &self.rope_kv_write_lora_sums),
        ];
        named.into_iter().map(|(name, f)| Ok((name, f.num_regs()?, f.local_size_bytes()?))).collect()
    }

    /// Whether [`Kernels::silu_mul_lora`] takes `inter` columns per module on this GPU.
    pub fn silu_mul_lora_fits(&self, inter: usize) -> bool {
        self.cluster_arch && inter > 0 && inter.is_multiple_of(SWIGLU_LORA_COLS)
    }

    /// SwiGLU with the gate|up group's LoRA expand fused in (lora.cu's `silu_mul_lora`): `out[i] =
    /// silu(gate_i + bf16(scale_s · u_gate,i · B_gate,sᵀ)) · (up_i + bf16(scale_s · u_up,i ·
    /// B_up,sᵀ))`, where `y` (row stride `y_stride`) is the gate|up GEMM's output whose weight carried
    /// every slot's A rows of gate, then of up, after its own `2 × inter` rows: slot s's `u_gate` at
    /// column `2 × inter + s × r_pad`, its `u_up` `num_slots × r_pad` further. `b_gate`/`b_up`: the
    /// modules' B stacks of the layer, `[slots, inter, r_pad]`. Tokens without a slot get
    /// [`Kernels::silu_mul`]'s plain product.
    ///
    /// # Safety
    /// `out` holds `n` rows of `inter`, `y` `n` rows of `y_stride >= 2 × (inter + num_slots ×
    /// r_pad)`; `segs` as in [`Kernels::lora_apply`] after this step's [`Kernels::lora_group`];
    /// `silu_mul_lora_fits(inter)`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn silu_mul_lora(&self, s: &CudaStream, out: DPtr, y: DPtr, y_stride: usize, inter: usize, b_gate: DPtr, b_up: DPtr, segs: &LoraSegments, n: usize, r_pad: usize) -> Result<()> {
        let tpb = swiglu_lora_tiles_per_block(n, segs.num_slots);
        self.silu_mul_lora_tiles(s, out, y, y_stride, inter, b_gate, b_up, segs, n, r_pad, tpb)
    }

    /// [`Kernels::silu_mul_lora`] with each block taking `tiles_per_block` consecutive work tiles
    /// (1 to 8) with its slice of B held across them, rather than the count it picks from the tokens
    /// per slot (for `micro` and the tests, which compare counts).
    ///
    /// # Safety
    /// As [`Kernels::silu_mul_lora`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn silu_mul_lora_tiles(&self, s: &CudaStream, out: DPtr, y: DPtr, y_stride: usize, inter: usize, b_gate: DPtr, b_up: DPtr, segs: &LoraSegments, n: usize, r_pad: usize, tiles_per_block: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if !self.silu_mul_lora_fits(inter) || r_pad == 0 || r_pad > LORA_MAX_RANK || !r_pad.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("silu_mul_lora: {inter} columns, r_pad {r_pad}")));
        }
        if y_stride < 2 * (inter + segs.num_slots * r_pad) || !y_stride.is_multiple_of(2) {
            return Err(KernelError::Unsupported(format!("silu_mul_lora: row stride {y_stride} for {} slots of rank {r_pad}", segs.num_slots)));
        }
        if !(1..=SWIGLU_LORA_MAX_TPB).contains(&tiles_per_block) {
            return Err(KernelError::Unsupported(format!("silu_mul_lora: {tiles_per_block} tiles per block")));
        }
        let lora_tiles = lora_max_tiles(n, segs.num_slots);
        let grid = (as_u32(inter / SWIGLU_LORA_COLS, "columns")?, as_u32(lora_tiles.div_ceil(tiles_per_block) + n.div_ceil(LORA_TILE), "tiles")?, 1);
        let (ys, inter_i, n_i, lt, r_i, ns, tpb) = (as_i32(y_stride, "y_stride")?, as_i32(inter, "intermediate")?, as_i32(n, "tokens")?, as_i32(lora_tiles, "tiles")?, as_i32(r_pad, "r_pad")?, as_i32(segs.num_slots, "slots")?, as_i32(tiles_per_block, "tiles per block")?);
        // Half the registers for B where the ranks allow: more blocks in flight.
        let mut l = Launch::new(if r_pad <= 32 { &self.silu_mul_lora_r32 } else { &self.silu_mul_lora });
        l.arg(&out).arg(&y).arg(&ys).arg(&inter_i).arg(&b_gate).arg(&b_up);
        l.arg(&segs.slots).arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.ranks).arg(&segs.scales).arg(&n_i).arg(&lt).arg(&r_i).arg(&ns).arg(&tpb);
        l.launch(s, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 }, self.pdl)?;
        Ok(())
    }

    /// Whether [`Kernels::rope_kv_write_lora`] takes heads of `d` on this GPU (sm_90+, as the other
    /// fused consumers: the path that uses them is one).
    pub fn rope_kv_write_lora_fits(&self, d: usize) -> bool {
        self.cluster_arch && d > 0 && d.is_multiple_of(16 * ROPE_LORA_WARPS) && d <= 128
    }

    /// RoPE + the bf16 KV-cache write with the q|k|v group's LoRA expand fused in (lora.cu's
    /// `rope_kv_write_lora`): each token's q|k|v row is `y[i, ..width]` (+ `bias`) plus
    /// `bf16(scale_s · u_m,i · B_m,sᵀ)` for each module m (q, k, v), where `y` (row stride `y_stride`)
    /// is the q|k|v GEMM's output whose weight carried every slot's A rows of q, then k, then v after
    /// its own `width = (hq + 2 hkv) d` rows: module m's slot s's `u` at column `width + (m ×
    /// num_slots + s) × r_pad`. Then as [`Kernels::rope_kv_write`] with a bf16 cache and no rotation:
    /// q and k rotated, q into `q_out`, k and v into the caches at `cache_slots[i]`. `b_q`/`b_k`/`b_v`:
    /// the modules' B stacks of the layer, `[slots, fan-out, r_pad]`. Tokens without a slot get no
    /// update.
    /// `y_scale` Some: `y` is an 8-bit q|k|v GEMM's output whose weight carried the A rows
    /// row-quantized (their scales after the weight's), with the scales it left
    /// (`Cuda::linear_w8_deferred`), which apply to u's columns as to the base's
    /// (`rope_kv_write_lora_scaled`, or `_sums` for an int8 GEMM's int32 sums).
    ///
    /// # Safety
    /// `y` holds `n` rows of `y_stride >= width + 3 × num_slots × r_pad`; `bias` (if not 0) `width`
    /// f32; the rest as [`Kernels::rope_kv_write`] for a bf16 cache; `segs` as in
    /// [`Kernels::lora_apply`] after this step's [`Kernels::lora_group`]; `rope_kv_write_lora_fits(d)`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_kv_write_lora(
        &self,
        s: &CudaStream,
        y: DPtr,
        y_stride: usize,
        bias: Option<DPtr>,
        rope: RopeTables,
        cache: RopeCache,
        b_qkv: [DPtr; 3],
        segs: &LoraSegments,
        n: usize,
        r_pad: usize,
        y_scale: Option<OuterScale>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let RopeCache { cache_slots, q_out, k_cache, v_cache, hq, hkv, d, block_size } = cache;
        if !self.rope_kv_write_lora_fits(d) || r_pad == 0 || r_pad > LORA_MAX_RANK || !r_pad.is_multiple_of(16) || block_size == 0 {
            return Err(KernelError::Unsupported(format!("rope_kv_write_lora: head_dim {d}, r_pad {r_pad}, block size {block_size}")));
        }
        let width = (hq + 2 * hkv) * d;
        if y_stride < width + 3 * segs.num_slots * r_pad || !y_stride.is_multiple_of(2) {
            return Err(KernelError::Unsupported(format!("rope_kv_write_lora: row stride {y_stride} for {} slots of rank {r_pad}", segs.num_slots)));
        }
        let lora_tiles = lora_max_tiles(n, segs.num_slots);
        let grid = (as_u32(hq + 2 * hkv, "heads")?, as_u32(lora_tiles + n.div_ceil(LORA_TILE), "tiles")?, 1);
        let (ys, n_i, lt, r_i, ns) = (as_i32(y_stride, "y_stride")?, as_i32(n, "tokens")?, as_i32(lora_tiles, "tiles")?, as_i32(r_pad, "r_pad")?, as_i32(segs.num_slots, "slots")?);
        let (hq_i, hkv_i, d_i, bs_i) = (as_i32(hq, "hq")?, as_i32(hkv, "hkv")?, as_i32(d, "head_dim")?, as_i32(block_size, "block_size")?);
        let bias = bias.unwrap_or(0);
        let (dxs, dws, y_i32) = OuterScale::args(y_scale);
        let mut l = Launch::new(match y_scale {
            None => &self.rope_kv_write_lora,
            Some(scale) if scale.sums_i32 != 0 => &self.rope_kv_write_lora_sums,
            Some(_) => &self.rope_kv_write_lora_scaled,
        });
        l.arg(&y).arg(&ys).arg(&bias).arg(&rope.positions).arg(&rope.cos).arg(&rope.sin).arg(&cache_slots);
        l.arg(&q_out).arg(&k_cache).arg(&v_cache).arg(&hq_i).arg(&hkv_i).arg(&d_i).arg(&bs_i).arg(&b_qkv[0]).arg(&b_qkv[1]).arg(&b_qkv[2]);
        l.arg(&segs.slots).arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.ranks).arg(&segs.scales).arg(&n_i).arg(&lt).arg(&r_i).arg(&ns);
        if y_scale.is_some() {
            l.arg(&dxs).arg(&dws).arg(&y_i32);
        }
        l.launch(s, LaunchConfig { grid_dim: grid, block_dim: (ROPE_LORA_WARPS as u32 * 32, 1, 1), shared_mem_bytes: 0 }, self.pdl)?;
        Ok(())
    }

    /// The shrink's output `t` (bf16 hi + lo, as [`Kernels::lora_shrink`] leaves it for the expand)
    /// from a dense product `u = x · Aᵀ` of every token against every slot of the group: `u` f32
    /// `[n, n_modules × num_slots × r_pad]`, module m's slot s's rank j at column `(m × num_slots +
    /// s) × r_pad + j` (what one GEMM over a group's A stack, `[modules, slots, r_pad, k]` per layer,
    /// gives). Each token keeps its own slot's columns, times the slot's scale.
    ///
    /// # Safety
    /// `u` holds `n` such rows; `work.t_hi`/`t_lo` hold `n × n_modules × r_pad`; `segs` as in
    /// [`Kernels::lora_apply`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_pick_t(&self, s: &CudaStream, u: DPtr, n_modules: usize, r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize) -> Result<()> {
        if n == 0 || segs.num_slots == 0 {
            return Ok(());
        }
        if n_modules == 0 || n_modules > LORA_MAX_MODULES || r_pad == 0 || r_pad > LORA_MAX_RANK {
            return Err(KernelError::Unsupported(format!("LoRA pick: {n_modules} modules of rank {r_pad}")));
        }
        let total = n * n_modules * r_pad;
        let blocks = as_u32(total.div_ceil(256).min(4 * self.num_sms as usize), "pick blocks")?;
        let (n_i, nm, slots, r_i) = (as_i32(n, "tokens")?, n_modules as i32, as_i32(segs.num_slots, "slots")?, as_i32(r_pad, "r_pad")?);
        let mut l = Launch::new(&self.lora_pick_t);
        l.arg(&work.t_hi).arg(&work.t_lo).arg(&u).arg(&segs.slots).arg(&segs.ranks).arg(&segs.scales).arg(&n_i).arg(&nm).arg(&slots).arg(&r_i);
        l.launch(s, cfg(blocks, 256), self.pdl)?;
        Ok(())
    }

    /// The second half of [`Kernels::lora_apply`]: `y[.., col_m ..] += t · B_mᵀ`, after the
    /// [`Kernels::lora_shrink`] of the same group (and after whatever else writes `y`).
    ///
    /// # Safety
    /// As [`Kernels::lora_apply`]; `work` holds this group's shrink output.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_expand(&self, s: &CudaStream, y: DPtr, y_stride: usize, modules: &[LoraModule], r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize) -> Result<()> {
        self.expand(s, y, y_stride, modules, r_pad, segs, work, n, false)
    }

    /// [`Kernels::lora_expand`] into a separate buffer: `d[.., col_m ..] = t · B_mᵀ` (rounded to bf16
    /// once) for every token with a slot, nothing read from `d`; the consumer of the base output adds
    /// it ([`LoraDelta`]). It does not touch the base output, so it may run beside the base projection.
    ///
    /// # Safety
    /// As [`Kernels::lora_expand`] with `d` in place of `y` (`n` rows `d_stride` apart).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_expand_to(&self, s: &CudaStream, d: DPtr, d_stride: usize, modules: &[LoraModule], r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize) -> Result<()> {
        self.expand(s, d, d_stride, modules, r_pad, segs, work, n, true)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn expand(&self, s: &CudaStream, y: DPtr, y_stride: usize, modules: &[LoraModule], r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize, overwrite: bool) -> Result<()> {
        if n == 0 || segs.num_slots == 0 {
            return Ok(());
        }
        check_group(modules, r_pad)?;
        let (m0, m1, m2) = (module_at(modules, 0), module_at(modules, 1), module_at(modules, 2));
        let max_tiles = lora_max_tiles(n, segs.num_slots);
        let big_r_i = as_i32(modules.len() * r_pad, "R")?;
        let r_i = as_i32(r_pad, "r_pad")?;
        let tiles: usize = modules.iter().map(|m| m.out.div_ceil(LORA_EXPAND_COLS)).sum();
        if tiles == 0 {
            return Ok(());
        }
        let y_stride = as_i32(y_stride, "y_stride")?;
        let (o0, o1, o2) = (as_i32(m0.out, "out")?, as_i32(m1.out, "out")?, as_i32(m2.out, "out")?);
        let (c0, c1, c2) = (as_i32(m0.col, "col")?, as_i32(m1.col, "col")?, as_i32(m2.col, "col")?);
        // Work tiles per block, unless `PEREGRINE_LORA_EXPAND_TILES` says: several (B fragments
        // loaded once per slot for consecutive tiles) are slower for decode batches, whose tiles
        // mostly change slot (docs/benchmarks.md).
        // Prefill-sized steps (512+ tokens, tiles mostly of one slot) take 4: on an H100 at 4096
        // tokens the gate|up expand went 457 -> 408 µs per group that way (docs/benchmarks.md).
        let per_block = self.lora_expand_tiles.unwrap_or(if n >= LORA_EXPAND_MULTI_TILE_MIN_TOKENS { 4 } else { 1 });
        let per_block_i = as_i32(per_block, "tiles per block")?;
        let overwrite_i = overwrite as i32;
        let expand = LaunchConfig {
            grid_dim: (as_u32(tiles, "column tiles")?, as_u32(max_tiles.div_ceil(per_block), "work tiles")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let function = if r_pad <= 32 && self.lora_expand_r32 { &self.lora_expand_sgmv_r32 } else { &self.lora_expand_sgmv };
        Launch::new(function)
            .arg(&y)
            .arg(&y_stride)
            .arg(&work.t_hi)
            .arg(&work.t_lo)
            .arg(&m0.b)
            .arg(&m1.b)
            .arg(&m2.b)
            .arg(&o0)
            .arg(&o1)
            .arg(&o2)
            .arg(&c0)
            .arg(&c1)
            .arg(&c2)
            .arg(&segs.order)
            .arg(&segs.seg)
            .arg(&segs.tiles)
            .arg(&segs.ranks)
            .arg(&big_r_i)
            .arg(&r_i)
            .arg(&per_block_i)
            .arg(&overwrite_i)
            .launch(s, expand, self.pdl)?;
        Ok(())
    }

    /// SwiGLU of a gate|up projection's output `y` (`n × 2·inter`, gate first) with each token's
    /// LoRA update of both modules, into `h` (`n × inter`) for the tokens that have a slot: what
    /// [`Kernels::lora_expand_to`] and then [`Kernels::silu_mul`] adding that update give, bit for
    /// bit, without writing the update anywhere. After the [`Kernels::lora_shrink`] of the group
    /// (gate's ranks first); [`Kernels::silu_mul_unslotted`] writes the other tokens' rows.
    ///
    /// # Safety
    /// `y` (16-byte aligned) and `h` hold `n` rows of `2·inter` and `inter` bf16; `gate` and `up`
    /// are this layer's B stacks for `inter` outputs each (their `a`, `col` are not read); `segs`
    /// and `work` as for the shrink that ran before.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_expand_swiglu(&self, s: &CudaStream, h: DPtr, y: DPtr, inter: usize, gate: &LoraModule, up: &LoraModule, r_pad: usize, segs: &LoraSegments, work: &LoraScratch, n: usize) -> Result<()> {
        if n == 0 || segs.num_slots == 0 {
            return Ok(());
        }
        check_group(&[*gate, *up], r_pad)?;
        if !lora_swiglu_fits(inter) || gate.out != inter || up.out != inter {
            return Err(KernelError::Unsupported(format!("LoRA SwiGLU: {inter} columns per module (a multiple of {LORA_SWIGLU_COLS}, both modules that wide)")));
        }
        let max_tiles = lora_max_tiles(n, segs.num_slots);
        // Work tiles per block as for the expand (B fragments loaded once per slot for consecutive tiles).
        let per_block = self.lora_expand_tiles.unwrap_or(if n >= LORA_EXPAND_MULTI_TILE_MIN_TOKENS { 4 } else { 1 });
        let launch = LaunchConfig {
            grid_dim: (as_u32(inter / LORA_SWIGLU_COLS, "column blocks")?, as_u32(max_tiles.div_ceil(per_block), "work tiles")?, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let (inter_i, big_r_i, r_i, per_block_i) = (as_i32(inter, "inter")?, as_i32(2 * r_pad, "R")?, as_i32(r_pad, "r_pad")?, as_i32(per_block, "tiles per block")?);
        let function = if r_pad <= 32 && self.lora_expand_r32 { &self.lora_expand_swiglu_r32 } else { &self.lora_expand_swiglu };
        let mut l = Launch::new(function);
        l.arg(&h).arg(&y).arg(&inter_i).arg(&work.t_hi).arg(&work.t_lo).arg(&gate.b).arg(&up.b);
        l.arg(&segs.order).arg(&segs.seg).arg(&segs.tiles).arg(&segs.ranks).arg(&big_r_i).arg(&r_i).arg(&per_block_i);
        l.launch(s, launch, self.pdl)?;
        Ok(())
    }
}

/// The shape limits both halves check (the kernels index three module slots and pad ranks to the mma's k).
fn check_group(modules: &[LoraModule], r_pad: usize) -> Result<()> {
    if modules.is_empty() || modules.len() > LORA_MAX_MODULES {
        return Err(KernelError::Unsupported(format!("LoRA: {} modules in one group (1 to {LORA_MAX_MODULES})", modules.len())));
    }
    if !r_pad.is_multiple_of(16) || r_pad == 0 || r_pad > LORA_MAX_RANK {
        return Err(KernelError::Unsupported(format!("LoRA: padded rank {r_pad} (a multiple of 16 up to {LORA_MAX_RANK})")));
    }
    Ok(())
}

/// Module `i` of a group, or an empty one (the kernels take three and ignore those past `modules.len()`).
fn module_at(modules: &[LoraModule], i: usize) -> LoraModule {
    modules.get(i).copied().unwrap_or(LoraModule { a: 0, b: 0, out: 0, col: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100_SMS: usize = 132;

    fn step(n: usize, k: usize, modules: usize) -> ShrinkStep {
        ShrinkStep { n, k, modules, aligned: true }
    }

    #[test]
    fn decode_steps_over_short_fan_ins_take_the_rank_tiles() {
        // Llama-3.1-8B's q|k|v, o and gate|up (fan-in 4096) from 1 to 128 tokens.
        for n in [1, 8, 64, 128] {
            for modules in [3, 1, 2] {
                assert_eq!(shrink_shape(None, step(n, 4096, modules), H100_SMS), LoraShrinkShape::Ranks, "{n} tokens, {modules} modules");
            }
        }
        // Down's 14,336 (the rank-tile kernel measured slower there) and 256 tokens take the split kernel.
        assert_eq!(shrink_shape(None, step(1, 14336, 1), H100_SMS), LoraShrinkShape::Split);
        assert_eq!(shrink_shape(None, step(256, 4096, 3), H100_SMS), LoraShrinkShape::Split);
    }

    #[test]
    fn prefill_steps_take_the_staged_kernel_where_x_and_a_are_aligned() {
        assert_eq!(shrink_shape(None, step(2048, 4096, 3), H100_SMS), LoraShrinkShape::Staged);
        // Up to 2047 tokens the split kernel (faster there, docs/benchmarks.md).
        assert_eq!(shrink_shape(None, step(512, 4096, 3), H100_SMS), LoraShrinkShape::Split);
        assert_eq!(shrink_shape(None, step(2047, 14336, 1), H100_SMS), LoraShrinkShape::Split);
        assert_eq!(shrink_shape(None, step(16384, 14336, 1), H100_SMS), LoraShrinkShape::Staged);
        // Unaligned rows: enough tiles for four blocks per SM walk the whole fan-in, fewer split it.
        let unaligned = |n, modules| ShrinkStep { aligned: false, ..step(n, 4096, modules) };
        assert_eq!(shrink_shape(None, unaligned(4096, 3), H100_SMS), LoraShrinkShape::Whole);
        assert_eq!(shrink_shape(None, unaligned(512, 1), H100_SMS), LoraShrinkShape::Split);
    }

    #[test]
    fn a_swiglu_block_takes_a_slots_tiles_when_tokens_spread_evenly() {
        // 4 adapters: 64 tokens a slot at batch 256 (4 tiles), 16 at batch 64 (1 tile).
        assert_eq!(swiglu_lora_tiles_per_block(256, 4), 4);
        assert_eq!(swiglu_lora_tiles_per_block(128, 4), 2);
        assert_eq!(swiglu_lora_tiles_per_block(64, 4), 1);
        // 16 adapters at batch 256: a tile a slot; one slot's 512 tokens stop at 4 (run in turn).
        assert_eq!(swiglu_lora_tiles_per_block(256, 16), 1);
        assert_eq!(swiglu_lora_tiles_per_block(512, 1), 4);
        // A step of fewer tokens than slots, and no slots at all, still take one.
        assert_eq!(swiglu_lora_tiles_per_block(3, 16), 1);
        assert_eq!(swiglu_lora_tiles_per_block(40, 0), 3);
    }

    #[test]
    fn a_forced_shape_falls_back_where_its_kernel_cannot_take_the_step() {
        let unaligned = ShrinkStep { aligned: false, ..step(4096, 4096, 3) };
        assert_eq!(shrink_shape(Some(LoraShrinkShape::Staged), unaligned, H100_SMS), LoraShrinkShape::Whole);
        assert_eq!(shrink_shape(Some(LoraShrinkShape::StagedWhole), unaligned, H100_SMS), LoraShrinkShape::Whole);
        assert_eq!(shrink_shape(Some(LoraShrinkShape::Ranks), step(1, LORA_RANKS_MAX_K + 16, 1), H100_SMS), LoraShrinkShape::Split);
        assert_eq!(shrink_shape(Some(LoraShrinkShape::Ranks), step(1, 14336, 1), H100_SMS), LoraShrinkShape::Ranks);
        assert_eq!(shrink_shape(Some(LoraShrinkShape::Split), step(4096, 4096, 3), H100_SMS), LoraShrinkShape::Split);
    }
}

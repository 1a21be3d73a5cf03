//! LoRA slots on the GPU: per target module, one stack of every layer's A and B for every slot, in
//! bf16, each slot's rows padded with zeros to the largest rank rounded up to 16 (so a module the
//! adapter does not target adds exactly 0; the kernels compute only each slot's own rank). Each step
//! first groups its tokens by slot on the device (segment tables, inside the CUDA graph), then after
//! each base projection group (q|k|v, o, gate|up, down) one grouped shrink and one grouped expand (`lora.cu`)
//! compute every module's update: into the fused output, or for decode-sized steps into an update
//! buffer that the output's consumer adds (below).
//!
//! The shrink reads only the projection's input, as the base GEMM does, so it runs on a second
//! stream beside that GEMM (forked and joined with events, which CUDA graphs capture as edges). For
//! decode-sized steps (up to [`DELTA_MAX_TOKENS`] tokens) the expand runs there too, writing the
//! update into a buffer of its own ([`LoraDelta`]) that the kernel consuming the base output adds
//! (RoPE + KV write, the residual add + RMSNorm, SwiGLU): the whole LoRA path then hides beside the
//! base GEMM/GEMV instead of following it (at batch 1 the expand after each GEMV was ~10 µs of a
//! 13 µs-per-group overhead). Larger steps add in place after the GEMM, on the main stream: their
//! update buffer would be as large as the output. One-token steps over one of our GEMVs take
//! neither: the bf16 GEMV computes the shrink as extra rows of its own launch and the expand adds in
//! place right after it; the 8-bit GEMV computes the shrink in extra blocks and adds the expand in
//! its epilogue, one launch in all ([`W8Rows`]); either way such a step forks no side stream at all
//! ([`BaseGemv`], [`GemvRowGroups`]). Steps of 64–512
//! tokens (8–512 over 8-bit weights) take the side stream's shrink as one cuBLAS GEMM against
//! every slot's A of the group (the A stacks are laid out per group for it), then keep each
//! token's own slot ([`DenseShrink`]). `PEREGRINE_LORA_OVERLAP=0` runs everything on the main
//! stream, `PEREGRINE_LORA_DELTA=0` keeps the in-place expand at every size (for comparisons).

use std::sync::Arc;

use peregrine_kernels::cudarc::driver::{CudaEvent, CudaStream, DriverError, PinnedHostSlice};
use half::bf16;
use peregrine_kernels::ops::{lora_max_tiles, lora_rank_pad, lora_splits, lora_swiglu_fits, DPtr, GemvLoraExpand, LoraDelta, LoraModule, LoraScratch, LoraSegments, GemvLoraRows, OuterScale, RopeCache, RopeTables, LORA_MAX_RANK};
use peregrine_kernels::{Blas, Cuda, DevBuf, OutType, W8Format};

use super::gpu_err;
use super::weights::{ExtraRows, GpuWeights};
use crate::config::ModelConfig;
use crate::lora::{LoraAdapter, TargetModule};
use crate::{EngineError, Result};

/// How many adapters and how large a rank the stacks hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraCapacity {
    pub max_loras: usize,
    pub max_rank: usize,
}

/// One target module's B stack and shapes; its A lives in its group's stack ([`GroupStack`]).
struct ModuleStack {
    /// `[layers, slots, fan_out, r_pad]`.
    b: DevBuf<u16>,
    fan_in: usize,
    fan_out: usize,
    /// Its group in [`GROUPS`] and its place in that group.
    group: usize,
    index: usize,
}

/// The A stacks of one projection group's modules, `[layers, modules, slots, r_pad, fan_in]`: per
/// layer the group's every module's every slot's rows one after another, so that one GEMM reads
/// them all ([`DenseShrink`]). Module m's slice of a layer, `[slots, r_pad, fan_in]`, is what the
/// grouped kernels read.
struct GroupStack {
    a: AStore,
    modules: usize,
}

/// Where a group's A rows live.
enum AStore {
    /// A stack of the group's own, `[layers, modules, slots, r_pad, fan_in]`.
    Stack(DevBuf<u16>),
    /// Per layer, the LoRA rows of the group's fused base weight ([`FusedNorms`]): the same
    /// `[modules, slots, r_pad, fan_in]` block, which the fused GEMM reads and every other path
    /// (one-token GEMV rows, the side stream's shrink of longer steps) reads too, so that A is held
    /// once (4 adapters of rank 32 on Llama-3.1-8B: 251 MB less).
    InWeights(Vec<DPtr>),
}

pub struct GpuLora {
    pub capacity: LoraCapacity,
    layers: usize,
    modules: Vec<ModuleStack>,
    groups: Vec<GroupStack>,
    /// `scaling` of the adapter in each slot (0 for an empty slot).
    scales: DevBuf<f32>,
    scales_host: Vec<f32>,
    /// Each slot's adapter rank (0 for an empty slot).
    ranks: DevBuf<i32>,
    ranks_host: Vec<i32>,
    /// Stack rank: `max_rank` rounded up to the mma step (16).
    r_pad: usize,
    /// The step's tokens grouped by slot, and where each slot's group starts ([`LoraSegments`]).
    order: DevBuf<i32>,
    seg: DevBuf<i32>,
    tiles: DevBuf<i32>,
    /// Shrink partial sums, and the reduced `scale · x · Aᵀ` as bf16 hi + lo ([`LoraScratch`]).
    t_part: DevBuf<f32>,
    t_hi: DevBuf<u16>,
    t_lo: DevBuf<u16>,
    /// The shrink's per-(work tile, module) completion counters (always 0 between launches).
    counters: DevBuf<i32>,
    /// Where the shrink runs beside the base projection (None: on the main stream after it).
    overlap: Option<SideStream>,
    /// The update buffer of the side stream's expand (decode-sized steps; [`LoraDelta`]):
    /// [`DELTA_MAX_TOKENS`] rows of the widest group output. None: the expand adds in place.
    delta: Option<DevBuf<u16>>,
    /// Steps of at most this many tokens use `delta`.
    delta_tokens: usize,
    /// Copies adapters into slots (made at the first load: its pinned image is one slot's size).
    uploader: Option<SlotUploader>,
    /// Whether steps that add in place may fuse gate|up's expand into SwiGLU instead
    /// (`PEREGRINE_LORA_SWIGLU=0`: never, for comparisons).
    fused_swiglu: bool,
    /// The groups whose one-token steps have the base GEMV compute the shrink ([`GemvRowGroups`]).
    gemv_rows: GemvRowGroups,
    /// How one-token steps over an 8-bit GEMV compute their shrink ([`W8Rows`]).
    w8_rows: W8Rows,
    /// The 8-bit GEMV's counters for an expand in its epilogue, one per (layer, group) launch of a
    /// one-token step; [`GpuLora::begin_step`] zeroes them.
    gemv_counters: DevBuf<i32>,
    /// The side stream's shrink as one cuBLAS GEMM per group, for the step sizes it takes.
    dense: Option<DenseShrink>,
    /// The o and down groups inside the base GEMM and the norm after it ([`FusedNorms`]), once
    /// [`GpuLora::attach_fused_norms`] has extended their weights.
    fused: Option<FusedNorms>,
    /// Diagnostics only (wrong results): the groups whose LoRA path is left out entirely
    /// (`PEREGRINE_LORA_SKIP_GROUPS`), and those whose expand is (`PEREGRINE_LORA_SKIP_EXPAND`):
    /// what each group's side chain, and its expand, cost a step (docs/benchmarks.md, session 28).
    skip_groups: GemvRowGroups,
    skip_expand: GemvRowGroups,
    /// Diagnostics only: the groups that fork and join the side stream with nothing on it
    /// (`PEREGRINE_LORA_EMPTY_SIDE`), what the fork and join alone cost.
    empty_side: GemvRowGroups,
    /// ... in the first this many layers (`PEREGRINE_LORA_EMPTY_SIDE_LAYERS`, default all).
    empty_side_layers: usize,
}

/// Steps of `tokens` compute the side stream's shrink as one cuBLAS GEMM of the group's x against
/// every slot's A (`u`, f32), and `lora_pick_t` keeps each token's own slot's columns as the
/// expand's t. Every token is multiplied by every slot (the slots × ranks columns are few next to
/// the base projection's), but on tensor cores at cuBLAS's efficiency rather than our grouped
/// shrink's, whose blocks mostly wait on their loads (docs/benchmarks.md, session 21).
/// A token's t then depends on the step's size in its last bits, as the base GEMMs' outputs do.
/// `PEREGRINE_LORA_DENSE=lo-hi` (token counts) or `0` (never).
struct DenseShrink {
    /// A handle (and workspace) of its own on the side stream: the main stream's runs beside it.
    blas: Blas,
    u: DevBuf<f32>,
    tokens: std::ops::RangeInclusive<usize>,
}

/// The step sizes [`DenseShrink`] takes by default: from 64 tokens to the update buffer's largest
/// step. On an H200 (Llama-3.1-8B shape, `bench --lora 4 --lora-rank 32`, LoRA / base against the
/// grouped shrink, docs/benchmarks.md session 22) it gained at batch 128 (0.841 -> 0.886) and 256
/// (0.830–0.845 -> 0.873–0.877; over fp8 weights 0.715 -> 0.792; 16 adapters 0.807 -> 0.821); at
/// 64 it lost while planned for every SM (0.894 -> 0.864–0.879) and gained a little once planned
/// for the SMs the base GEMM leaves free (0.864–0.869 -> 0.872–0.880). It lost on 128/128 × 16
/// adapters, whose ~1,000-token steps expand after the GEMM (0.843 -> 0.827), so it stops at 512.
const DENSE_TOKENS: std::ops::RangeInclusive<usize> = 64..=SIDE_PLAN_MAX_TOKENS;

/// Over 8-bit weights from 8 tokens: there batch 8 went 0.711, 0.713 -> 0.743, 0.738 × base, 16
/// and 32 stayed (0.84–0.85); over bf16 weights 8 and 16 tokens lost a little (0.903 / 0.930 ->
/// 0.895 / 0.922; docs/benchmarks.md session 22).
const DENSE_TOKENS_W8: std::ops::RangeInclusive<usize> = 8..=SIDE_PLAN_MAX_TOKENS;

/// What the LoRA path needs to know of the base model's side of a step.
#[derive(Debug, Clone, Copy)]
pub struct LoraBase {
    /// The SMs the base GEMMs of LoRA steps of 64–512 tokens leave to the side stream; the dense
    /// shrink's GEMM is planned for that many at every size it takes (over 8-bit weights from 8
    /// tokens, where the base projections are GEMVs or unreserved GEMMs: measured that way).
    pub side_sms: usize,
    /// Whether the linears are 8-bit (shorter base projections: [`DENSE_TOKENS_W8`]).
    pub eight_bit: bool,
}

/// Slots × padded rank up to which [`DenseShrink`] is worth its extra products (16 slots of rank
/// 32, 8 of rank 64).
const DENSE_MAX_SLOT_RANKS: usize = 512;

impl DenseShrink {
    fn tokens_from_env(eight_bit: bool) -> Option<std::ops::RangeInclusive<usize>> {
        match std::env::var("PEREGRINE_LORA_DENSE") {
            Err(_) if eight_bit => Some(DENSE_TOKENS_W8),
            Err(_) => Some(DENSE_TOKENS),
            Ok(v) => {
                let (lo, hi) = v.trim().split_once('-')?;
                Some(lo.trim().parse().ok()?..=hi.trim().parse().ok()?)
            }
        }
    }

    /// The most tokens it takes for a step budget of `max_tokens`, and the f32 elements of `u`.
    fn sizes(cap: LoraCapacity, max_tokens: usize, tokens: &std::ops::RangeInclusive<usize>) -> (usize, usize) {
        let rows = (*tokens.end()).min(max_tokens);
        let widest = GROUPS.iter().map(|g| g.len()).max().unwrap_or(0) * cap.max_loras * lora_rank_pad(cap.max_rank);
        (rows, rows * widest)
    }

    fn new(cuda: &Cuda, cap: LoraCapacity, max_tokens: usize, side: Option<&SideStream>, base: LoraBase) -> Result<Option<Self>> {
        let Some(side) = side else { return Ok(None) };
        let Some(tokens) = Self::tokens_from_env(base.eight_bit) else { return Ok(None) };
        if cap.max_loras * lora_rank_pad(cap.max_rank) > DENSE_MAX_SLOT_RANKS || tokens.is_empty() {
            return Ok(None);
        }
        let (rows, len) = Self::sizes(cap, max_tokens, &tokens);
        if rows == 0 {
            return Ok(None);
        }
        let blas = Blas::new(&side.stream).map_err(gpu_err)?;
        // Planned for the SMs the base GEMM leaves free, so that its blocks do not queue behind the
        // base GEMM's nor take SMs the base GEMM was planned for (`PEREGRINE_LORA_DENSE_SMS`; 0: all).
        let sms = std::env::var("PEREGRINE_LORA_DENSE_SMS").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(base.side_sms);
        if let Err(e) = blas.set_sm_count_target(sms.min(cuda.num_sms)) {
            // Only a plan hint: without it the GEMM is planned for every SM, still correct.
            tracing::warn!(error = %e, "the dense LoRA shrink's cuBLAS handle keeps its SM count target");
        }
        Ok(Some(DenseShrink {
            blas,
            u: cuda.gpu.alloc_zeros::<f32>(len).map_err(gpu_err)?,
            tokens: *tokens.start()..=rows,
        }))
    }

    /// Device bytes it takes at most: `u` and the handle's workspace (`u` is as large over either base).
    fn bytes(cap: LoraCapacity, max_tokens: usize) -> usize {
        if overlap_disabled() || cap.max_loras * lora_rank_pad(cap.max_rank) > DENSE_MAX_SLOT_RANKS {
            return 0;
        }
        Self::tokens_from_env(false).map_or(0, |t| Self::sizes(cap, max_tokens, &t).1 * 4 + Blas::WORKSPACE_BYTES)
    }
}

/// The q|k|v, o, gate|up and down groups' LoRA without a side stream (docs/lora-fusion-plan.md):
/// each layer's bf16 weights carry every slot's A rows after their own (`[fan_out + modules · slots
/// · r_pad, fan_in]`, [`GpuWeights::extend_rows_for_lora`]), so the base GEMM writes `x · Wᵀ` and
/// every slot's `u = x · Aᵀ` side by side into `wide`, and the kernel that consumes the output adds
/// each token's `scale · u · Bᵀ`: RoPE + the KV write after q|k|v (`rope_kv_write_lora`, a bf16
/// cache without rotation only), the residual add + RMSNorm after o and down (`add_rmsnorm_lora`),
/// SwiGLU after gate|up (`silu_mul_lora`). Those groups then neither fork nor
/// join: the graph's fork/joins, not the LoRA kernels, were what LoRA decode steps lost
/// (docs/benchmarks.md, sessions 28-30). Decode-sized steps of 2 to the update buffer's tokens over
/// bf16 weights on sm_90+, except the last layer's down (the final norm keeps only logit rows).
/// `PEREGRINE_LORA_FUSED_NORMS=0`: off (the side stream for every group, for comparisons).
///
/// On an H200 (Llama-3.1-8B shape, `bench --lora 4 --lora-rank 32`, LoRA / base at batch 64 / 256,
/// docs/benchmarks.md session 30), o and down fused gave 0.890–0.904 / 0.877–0.906 against the side
/// stream's 0.868–0.890 / 0.873–0.892. gate|up fused as well gave 0.885 / 0.890–0.896: its expand
/// reads 3.5 times o's B, which beside the base GEMM was hidden and in SwiGLU is not (`silu_mul_lora`
/// 9.5 / 21.8 µs against `silu_mul`'s 4.6 / 8.1 at batch 64 / 256). q|k|v fused too (session 31)
/// gave 0.928–0.939 / 0.897–0.900 against 0.917 / 0.887–0.894 with it on the side stream
/// (`PEREGRINE_LORA_FUSED_QKV=0`). Session 32 loaded B before `pdl_wait()`, gave ranks up to 32 a
/// kernel with half the registers and let a block hold B across a slot's tiles: `silu_mul_lora`
/// 5.8 / 7.9 / 19.3 µs at batch 16 / 64 / 256. gate|up fused from [`FUSED_GATE_UP_MIN_TOKENS`] gave
/// 16 adapters +2.4 % tokens/s at batch 128 and 256 and 4 adapters the same as its side stream;
/// at batch 16 it lost 3 %, so smaller steps keep the side stream.
///
/// [`GpuWeights::extend_rows_for_lora`]: super::weights::GpuWeights::extend_rows_for_lora
struct FusedNorms {
    hidden: usize,
    inter: usize,
    /// q|k|v's output width, `(hq + 2 hkv) · d`.
    qkv_width: usize,
    /// Whether q|k|v rides in its GEMM and RoPE + KV write (a bf16 cache without rotation).
    qkv: bool,
    /// `[delta_tokens, widest row]`: a fused GEMM's output and every slot's u (o's, gate|up's and
    /// down's in turn: each is consumed before the next GEMM writes).
    wide: DevBuf<u16>,
    /// The largest step it takes (the update buffer's).
    max_tokens: usize,
    /// Whether gate|up's weight carries the rows, and from how many tokens a step takes them.
    gate_up: bool,
    gate_up_min_tokens: usize,
    /// Whether the fused GEMMs are planned for every SM rather than the LoRA steps' reserve
    /// (`PEREGRINE_LORA_FUSED_FULL_SMS=0`: the reserve, for comparisons).
    full_sms: bool,
    /// Over 8-bit weights: the format, and where each layer's weights hold the A rows' codes and
    /// row scales (the groups' stacks keep the bf16 rows, which the other paths read).
    w8: Option<FusedW8>,
}

/// The A rows of [`FusedNorms`] over 8-bit weights: each slot's bf16 rows quantized row by row into
/// the fused weights' extra rows (`quant_rows`, the activations' own quantizer: one scale per row),
/// in the same `[modules, slots, r_pad]` layout as a group's stack block. The shrink then rides in the
/// 8-bit GEMM as it does in the bf16 one; its output's scales (the token's times the A row's) are
/// applied by the consumer, as the base columns' are. The adapters themselves stay bf16: the stacks
/// keep the rows for every other path, and B and the expand are bf16.
struct FusedW8 {
    format: W8Format,
    rows: Vec<[ExtraRows; 4]>,
}

/// What a step's fused projections write and their consumers read ([`GpuLora::fused_projection`]).
#[derive(Debug, Clone, Copy)]
pub struct FusedProjection {
    /// A fused GEMM's output: the base output, then every slot's u.
    pub y: DPtr,
    /// Its row stride after o and down (hidden + slots · r_pad) and after gate|up (2 · (inter +
    /// slots · r_pad)).
    pub o_down_stride: usize,
    pub gate_up_stride: usize,
    /// Whether gate|up rides in its GEMM and SwiGLU this step.
    pub gate_up: bool,
    /// Its row stride after q|k|v (`(hq + 2 hkv) d + 3 · slots · r_pad`), where q|k|v rides in its
    /// GEMM and RoPE + KV write this step.
    pub qkv_stride: Option<usize>,
    /// Plan the GEMM for every SM (nothing runs beside it).
    pub full_sms: bool,
}

/// What the fused norm over 8-bit weights reads and writes besides the bf16 path's buffers: the
/// scales the projection left (None: its output is final), and where the normalized rows' codes and
/// token scales go (`q_scales` may be `y_scale.xs`).
#[derive(Debug, Clone, Copy)]
pub struct FusedW8Io {
    pub y_scale: Option<OuterScale>,
    pub q: DPtr,
    pub q_scales: DPtr,
}

fn fused_norms_disabled() -> bool {
    std::env::var("PEREGRINE_LORA_FUSED_NORMS").is_ok_and(|v| v == "0")
}

/// The smallest step gate|up rides in (its weight then carries the extra rows; steps below take its
/// side stream, reading A from there). `PEREGRINE_LORA_FUSED_GATE_UP=0`: never (no extra rows),
/// `=1`: every fused step, for comparisons. See [`FusedNorms`] for why 128.
fn fused_gate_up_min_tokens() -> Option<usize> {
    match std::env::var("PEREGRINE_LORA_FUSED_GATE_UP").as_deref() {
        Ok("0") => None,
        Ok("1") => Some(2),
        _ => Some(FUSED_GATE_UP_MIN_TOKENS),
    }
}

/// Below this many tokens `silu_mul_lora` costs more than gate|up's fork and join (H200, session 32
/// in docs/benchmarks.md: batch 16 0.872 against 0.901 × base, even at 64, ahead at 256).
const FUSED_GATE_UP_MIN_TOKENS: usize = 128;

/// Whether q|k|v rides too (`PEREGRINE_LORA_FUSED_QKV=0`: its side stream, for comparisons).
fn fused_qkv() -> bool {
    !std::env::var("PEREGRINE_LORA_FUSED_QKV").is_ok_and(|v| v == "0")
}

/// Over 8-bit weights, whether [`FusedNorms`] is off: unless `PEREGRINE_LORA_FUSED_W8=1`, every group
/// keeps the side stream with its bf16 A rows. The fused path measured no faster there (H200,
/// Llama-3.1-8B shape, 4 adapters of rank 32, LoRA / base at batch 16 / 64 / 256 over fp8: fused
/// 0.787 / 0.834 / 0.801, side stream 0.796 / 0.848 / 0.806; docs/benchmarks.md, session 37): its
/// consumers cost about what the forks and joins they save do.
fn fused_w8_disabled(eight_bit: bool) -> bool {
    eight_bit && !std::env::var("PEREGRINE_LORA_FUSED_W8").is_ok_and(|v| v == "1")
}

/// The fused weights, in [`GROUPS`]' order (and `GpuWeights::extend_rows_for_lora`'s).
const FUSED_QKV: usize = 0;
const FUSED_GATE_UP: usize = 2;

/// Where a module's A rows go among the fused weights: (q|k|v 0, o 1, gate|up 2, down 3; the first
/// of its rows past the weight's own, in units of `slots · r_pad` rows). The group's A block of a
/// layer ([`AStore::InWeights`]) then sits there as it would in the group's stack: the fused weights
/// follow [`GROUPS`]' order, and each module's part is its place in its group.
fn fused_place(module: TargetModule) -> Option<(usize, usize)> {
    match module {
        TargetModule::Q => Some((FUSED_QKV, 0)),
        TargetModule::K => Some((FUSED_QKV, 1)),
        TargetModule::V => Some((FUSED_QKV, 2)),
        TargetModule::O => Some((1, 0)),
        TargetModule::Gate => Some((FUSED_GATE_UP, 0)),
        TargetModule::Up => Some((FUSED_GATE_UP, 1)),
        TargetModule::Down => Some((3, 0)),
    }
}

/// Which projection groups of a one-token step over one of our GEMVs take the shrink as GEMV rows
/// ([`BaseGemv`]), with the expand in place right after the base GEMV on the main stream, instead of
/// the side stream's shrink -> expand beside it. All four by default: with no group left on the side
/// stream a one-token step has no fork or join at all. On an H200 (Llama-3.1-8B shape, 4 adapters of
/// rank 32, `bench --batch-sizes 1`) LoRA / base over bf16 went 0.857–0.860 (none) -> 0.913 (all),
/// while q|k|v and o alone (whose short GEMVs the side chain outlasted) gave 0.859–0.862: the side
/// stream's fork and join were what cost, not the chains; over fp8 weights 0.70 -> 0.78
/// (docs/benchmarks.md, session 21).
/// `PEREGRINE_LORA_GEMV_ROWS=none|all|qkv,o,gate_up,down` for comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GemvRowGroups {
    qkv: bool,
    o: bool,
    gate_up: bool,
    down: bool,
}

impl GemvRowGroups {
    const DEFAULT: GemvRowGroups = GemvRowGroups { qkv: true, o: true, gate_up: true, down: true };

    fn parse(v: &str) -> GemvRowGroups {
        let none = GemvRowGroups { qkv: false, o: false, gate_up: false, down: false };
        match v.trim() {
            "none" | "0" => none,
            "all" => GemvRowGroups { qkv: true, o: true, gate_up: true, down: true },
            list => list.split(',').fold(none, |g, name| match name.trim() {
                "qkv" => GemvRowGroups { qkv: true, ..g },
                "o" => GemvRowGroups { o: true, ..g },
                "gate_up" => GemvRowGroups { gate_up: true, ..g },
                "down" => GemvRowGroups { down: true, ..g },
                _ => g,
            }),
        }
    }

    fn from_env() -> GemvRowGroups {
        std::env::var("PEREGRINE_LORA_GEMV_ROWS").map_or(Self::DEFAULT, |v| Self::parse(&v))
    }

    /// The groups a diagnostic variable names (none when it is unset).
    fn diagnostic(var: &str) -> GemvRowGroups {
        let set = std::env::var(var).map_or(Self::parse("none"), |v| Self::parse(&v));
        if set != Self::parse("none") {
            tracing::warn!(variable = var, groups = ?set, "LoRA diagnostics: updates are left out, results are wrong");
        }
        set
    }

    /// Whether the group whose first module is `first` takes the GEMV's rows.
    fn takes(self, first: TargetModule) -> bool {
        match first {
            TargetModule::Q | TargetModule::K | TargetModule::V => self.qkv,
            TargetModule::O => self.o,
            TargetModule::Gate | TargetModule::Up => self.gate_up,
            TargetModule::Down => self.down,
        }
    }
}

/// Side streams and the two events that fork one from the main stream (the projection's input is
/// ready) and join it back (the shrink's output, or with the update buffer the update, is ready).
/// Reused by every group: a wait takes the event's state at the time it is enqueued.
struct SideStream {
    /// Default priority: steps of more than `urgent_max_tokens` tokens.
    stream: Arc<CudaStream>,
    /// The device's highest priority, for steps of up to `urgent_max_tokens` tokens: the block
    /// scheduler then starts the side path's blocks as soon as an SM has room, before the blocks of
    /// the base GEMV still queued, so the path runs beside it rather than after it. On an H100 at
    /// batch 1 (Llama-3.1-8B shape, 4 rank-32 adapters) that took LoRA/base from 0.773 to 0.844;
    /// at batch 16 / 64 / 256 it cost (0.881 → 0.842, 0.900 → 0.855, 0.801 → 0.737): there the
    /// base kernel's blocks are what the step waits for (docs/benchmarks.md). CUDA graphs keep the
    /// priority per node (captured from the stream; the decode graphs are instantiated to use it).
    urgent: Arc<CudaStream>,
    urgent_max_tokens: usize,
    input_ready: CudaEvent,
    side_done: CudaEvent,
}

/// Steps of at most this many tokens run the side path on the high-priority stream
/// (`PEREGRINE_LORA_URGENT_MAX_TOKENS` overrides it; 0 never does).
const URGENT_MAX_TOKENS: usize = 4;

// SAFETY: as timing::SendEvent: the events are used only through the backend, which the engine
// thread owns (`&self` methods run on that one thread).
unsafe impl Send for SideStream {}

/// `PEREGRINE_LORA_OVERLAP=0`: every LoRA launch on the main stream.
fn overlap_disabled() -> bool {
    std::env::var("PEREGRINE_LORA_OVERLAP").is_ok_and(|v| v == "0")
}

impl SideStream {
    fn new(cuda: &Cuda) -> Result<Option<Self>> {
        if overlap_disabled() {
            return Ok(None);
        }
        let ctx = &cuda.gpu.ctx;
        let driver = |e: DriverError| gpu_err(e.into());
        let (_, highest) = peregrine_kernels::cudarc::driver::result::stream::get_priority_range().map_err(driver)?;
        let urgent_max_tokens = std::env::var("PEREGRINE_LORA_URGENT_MAX_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(URGENT_MAX_TOKENS);
        Ok(Some(SideStream {
            stream: ctx.new_stream().map_err(driver)?,
            urgent: ctx.new_stream_with_priority(highest).map_err(driver)?,
            urgent_max_tokens,
            input_ready: ctx.new_event(None).map_err(driver)?,
            side_done: ctx.new_event(None).map_err(driver)?,
        }))
    }

    /// The stream a step of `n` tokens runs its side path on. Switching between the two is safe:
    /// each group's fork waits for the main stream, which waited for the previous group's join.
    fn for_tokens(&self, n: usize) -> &Arc<CudaStream> {
        if n <= self.urgent_max_tokens { &self.urgent } else { &self.stream }
    }
}

/// A copy stream, pinned memory for one slot's bf16 image, and the events that order a copy after
/// the steps already enqueued (`slot_free`) and the next step after the copy (`copied`).
struct SlotUploader {
    stream: Arc<CudaStream>,
    staging: PinnedHostSlice<u16>,
    slot_free: CudaEvent,
    copied: CudaEvent,
    /// A copy from `staging` was enqueued and may not have finished.
    in_flight: bool,
}

// SAFETY: as SideStream: used only from the engine thread that owns the backend.
unsafe impl Send for SlotUploader {}

impl SlotUploader {
    fn new(cuda: &Cuda, image_len: usize) -> Result<Self> {
        let ctx = &cuda.gpu.ctx;
        let driver = |e: DriverError| gpu_err(e.into());
        // SAFETY: u16 has no invalid bit patterns; every element is written before it is read.
        let staging = unsafe { ctx.alloc_pinned::<u16>(image_len.max(1)) }.map_err(driver)?;
        Ok(SlotUploader {
            stream: ctx.new_stream().map_err(driver)?,
            staging,
            slot_free: ctx.new_event(None).map_err(driver)?,
            copied: ctx.new_event(None).map_err(driver)?,
            in_flight: false,
        })
    }

    /// The pinned image, once the previous copy out of it has finished.
    fn staging(&mut self, len: usize) -> Result<&mut [u16]> {
        let driver = |e: DriverError| gpu_err(e.into());
        if self.in_flight {
            self.copied.synchronize().map_err(driver)?;
            self.in_flight = false;
        }
        let all = self.staging.as_mut_slice().map_err(driver)?;
        all.get_mut(..len).ok_or_else(|| EngineError::Backend("LoRA staging smaller than a slot".into()))
    }
}

/// One slot's bf16 image in the order `set_slot` copies it: per module (in
/// [`TargetModule::ALL`] order), per layer, A `[r_pad, fan_in]` (rank rows, then zero rows) then B
/// `[fan_out, r_pad]` (each row's rank columns, then zeros).
struct SlotImage;

impl SlotImage {
    fn len(dims: &[(usize, usize)], layers: usize, r_pad: usize) -> usize {
        dims.iter().map(|&(fan_in, fan_out)| layers * r_pad * (fan_in + fan_out)).sum()
    }

    /// Converts `adapter` into `out` on the CPU's cores (a rank-32 adapter of an 8B model is 84M
    /// values: one thread takes a good part of a second).
    fn fill(out: &mut [u16], adapter: &LoraAdapter, dims: &[(usize, usize)], layers: usize, r_pad: usize) -> Result<()> {
        use rayon::prelude::*;
        let bits = |v: f32| bf16::from_f32(v).to_bits();
        let rank = adapter.rank;
        // One work item per (module, layer): its A and B ranges of `out`.
        let mut items = Vec::with_capacity(dims.len() * layers);
        let mut rest = out;
        for (module, &(fan_in, fan_out)) in TargetModule::ALL.into_iter().zip(dims) {
            for layer in 0..layers {
                let (a, tail) = rest.split_at_mut(r_pad * fan_in);
                let (b, tail) = tail.split_at_mut(fan_out * r_pad);
                rest = tail;
                items.push((module, layer, fan_in, fan_out, a, b));
            }
        }
        items.into_par_iter().try_for_each(|(module, layer, fan_in, fan_out, a, b)| {
            a.fill(0);
            b.fill(0);
            let Some(pair) = adapter.pair(layer, module) else { return Ok(()) };
            if pair.a.len() != rank * fan_in || pair.b.len() != fan_out * rank {
                return Err(EngineError::InvalidRequest(format!("layer {layer} {}: LoRA shapes do not match the model", module.peft_name())));
            }
            // A: [rank, in] rows, then zero rows up to r_pad.
            pair.a.write_bf16_bits(a);
            // B: [out, rank] → [out, r_pad], zero-padded per row.
            if rank > 0 {
                let pair_b = pair.b.as_f32();
                for (dst, src) in b.chunks_exact_mut(r_pad).zip(pair_b.chunks_exact(rank)) {
                    for (d, &v) in dst.iter_mut().zip(src) {
                        *d = bits(v);
                    }
                }
            }
            Ok(())
        })
    }
}

/// The projection groups of a layer whose LoRA updates run as one launch each, as the base model
/// fuses them.
const GROUPS: [&[TargetModule]; 4] = [
    &[TargetModule::Q, TargetModule::K, TargetModule::V],
    &[TargetModule::O],
    &[TargetModule::Gate, TargetModule::Up],
    &[TargetModule::Down],
];

/// The shape of a [`GroupStack`]: `[layers, modules, slots, r_pad, fan_in]`.
#[derive(Debug, Clone, Copy)]
struct GroupShape {
    modules: usize,
    slots: usize,
    r_pad: usize,
    fan_in: usize,
}

impl GroupShape {
    /// Where the A rows of the group's module `index`, `slot`, `layer` start (elements).
    fn a_offset(self, index: usize, layer: usize, slot: usize) -> usize {
        let rows = self.r_pad * self.fan_in;
        ((layer * self.modules + index) * self.slots + slot) * rows
    }
}

/// A module's group in [`GROUPS`] and its place there.
fn group_of(module: TargetModule) -> (usize, usize) {
    GROUPS.iter().enumerate().find_map(|(g, ms)| ms.iter().position(|&m| m == module).map(|i| (g, i))).unwrap_or((0, 0))
}

/// Steps of at most this many tokens expand into the update buffer beside the base projection, and
/// over bf16 weights ride the fused path ([`FusedNorms`]): every decode batch the graphs capture,
/// and the ~1,000-token decode steps of 1000 × 128/128, where 16 adapters went 0.831 -> 0.852 ×
/// base with 1,024 against 512 (H200, docs/benchmarks.md session 32). A buffer of 1,024 rows of
/// Llama-3.1-8B's gate|up is 59 MB, and the fused path's as much.
pub const DELTA_MAX_TOKENS: usize = 1024;

/// The largest step the side stream's plans take: the dense shrink ([`DENSE_TOKENS`]) and the SMs
/// the base GEMMs leave free (`LORA_SM_RESERVE_TOKENS` in cuda/mod.rs). They were measured on
/// decode batches up to 512, and the dense shrink lost on 128/128's ~1,000-token steps, so longer
/// steps keep the grouped shrink and every SM even where they use the update buffer.
pub const SIDE_PLAN_MAX_TOKENS: usize = 512;

/// Widest (fused) output of a projection group: the update buffer's row stride bound.
fn widest_output(config: &ModelConfig) -> usize {
    GROUPS.iter().map(|g| g.iter().map(|m| m.dims(config).1).sum::<usize>()).max().unwrap_or(0)
}

/// Rows of the update buffer for steps of up to `max_tokens` tokens, or 0 where the expand adds in
/// place (`PEREGRINE_LORA_DELTA=0`, or no side stream to run it on).
/// `PEREGRINE_LORA_DELTA_MAX=N` moves the largest such step from [`DELTA_MAX_TOKENS`] (comparisons).
fn delta_rows(max_tokens: usize, side_stream: bool) -> usize {
    let enabled = side_stream && !std::env::var("PEREGRINE_LORA_DELTA").is_ok_and(|v| v == "0");
    let cap = std::env::var("PEREGRINE_LORA_DELTA_MAX").ok().and_then(|v| v.parse().ok()).unwrap_or(DELTA_MAX_TOKENS);
    if enabled { max_tokens.min(cap) } else { 0 }
}

/// f32 elements of the shrink's partial sums for the largest group: splits of its fan-in × its ranks.
fn t_part_len(config: &ModelConfig, r_pad: usize, max_tokens: usize) -> usize {
    GROUPS.iter().map(|g| lora_splits(g[0].dims(config).0) * g.len() * r_pad).max().unwrap_or(0) * max_tokens
}

/// Where one projection group's LoRA updates read and write in a step (rows are tokens).
pub struct Projection<'a> {
    pub x: DPtr,
    pub x_stride: usize,
    /// The (possibly fused) output.
    pub y: DPtr,
    pub y_stride: usize,
    /// The group's modules (they share x) and where each one's columns start in `y`.
    pub outs: &'a [(TargetModule, usize)],
    /// Which of our GEMVs the base projection is for this step, if one.
    pub gemv: BaseGemv,
}

/// Where a one-token step over an 8-bit GEMV computes its LoRA shrink (the expand then adds in place
/// after the GEMV, as over the bf16 GEMV, or inside it). `PEREGRINE_LORA_W8_ROWS=0|launch|gemv` for
/// comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum W8Rows {
    /// The side stream's shrink -> expand beside the GEMV (`0`).
    SideStream,
    /// A GEMV launch of the LoRA rows alone right before the base GEMV (`launch`): the default up
    /// to session 35, whose latency sat between the norm and the GEMV.
    OwnLaunch,
    /// Extra blocks of the 8-bit GEMV's own launch (`gemv_w8_lora_rows`), the expand launched after
    /// it (`gemv`).
    InGemv,
    /// The same, and the GEMV's tiles add the expand in their epilogue: one launch per group, the
    /// default where the tensor-core 8-bit GEMV runs (otherwise [`W8Rows::OwnLaunch`]). On an H200
    /// (Llama-3.1-8B shape, 4 adapters of rank 32, `bench --batch-sizes 1 --quantization fp8`) LoRA /
    /// base went 0.805 (own launch) -> 0.865 (rows in the GEMV) -> 0.903–0.917 (and the expand);
    /// int8 0.809 -> 0.902 (docs/benchmarks.md, session 36).
    InGemvWithExpand,
}

impl W8Rows {
    fn from_env(cuda: &Cuda) -> Self {
        let fused = if cuda.kernels.gemv_w8_expands_lora() { W8Rows::InGemvWithExpand } else { W8Rows::OwnLaunch };
        match std::env::var("PEREGRINE_LORA_W8_ROWS").as_deref() {
            Ok("0") => W8Rows::SideStream,
            Ok("launch") => W8Rows::OwnLaunch,
            Ok("gemv") if cuda.kernels.gemv_w8_expands_lora() => W8Rows::InGemv,
            _ => fused,
        }
    }
}

/// The kernel a step's base projection runs, as far as the one-token LoRA path cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BaseGemv {
    /// A GEMM (cuBLAS, cuBLASLt or ours), or a GEMV of several tokens.
    None,
    /// The bf16 GEMV: it computes a one-token step's shrink as extra rows when handed them
    /// ([`GemvLoraRows`]).
    Bf16,
    /// The 8-bit GEMV, whose output is final (no scales left to its consumer): it computes a
    /// one-token step's shrink as extra blocks of its launch when handed the rows ([`W8Rows`]).
    W8,
}

/// What [`GpuLora::apply_around`] did with a group's updates.
pub enum LoraUpdate {
    /// Added into the projection's output.
    Added,
    /// In the update buffer: the kernel that consumes the output must add it.
    Buffered(LoraDelta),
    /// Gate|up with a SwiGLU output given: SwiGLU written there for every token, updates included;
    /// the caller runs none of its own.
    SwigluWritten,
}

impl LoraUpdate {
    /// The update buffer the output's consumer must add, if any.
    pub fn buffered(self) -> Option<LoraDelta> {
        match self {
            LoraUpdate::Buffered(d) => Some(d),
            LoraUpdate::Added | LoraUpdate::SwigluWritten => None,
        }
    }
}

impl GpuLora {
    /// Device bytes the stacks take for `config` at `cap` (for sizing the KV cache around them).
    pub fn bytes(config: &ModelConfig, cap: LoraCapacity, max_tokens: usize) -> usize {
        let per_layer: usize = TargetModule::ALL
            .iter()
            .map(|m| {
                let (fan_in, fan_out) = m.dims(config);
                cap.max_loras * cap.max_rank * (fan_in + fan_out) * 2
            })
            .sum();
        let r_pad = lora_rank_pad(cap.max_rank);
        // per_layer counted max_rank rows per slot; the stacks hold r_pad.
        per_layer / cap.max_rank * r_pad * config.num_hidden_layers
            + cap.max_loras * 12
            + (1 + 5 * lora_max_tiles(max_tokens, cap.max_loras)) * 4
            + max_tokens * 4
            + t_part_len(config, r_pad, max_tokens) * 4
            + 2 * max_tokens * 3 * r_pad * 2
            + delta_rows(max_tokens, !overlap_disabled()) * widest_output(config) * 2
            + DenseShrink::bytes(cap, max_tokens)
            + Self::fused_norms_bytes(config, cap, max_tokens)
    }

    pub fn new(cuda: &Cuda, config: &ModelConfig, cap: LoraCapacity, max_tokens: usize, base: LoraBase) -> Result<Self> {
        if cap.max_loras == 0 || cap.max_rank == 0 {
            return Err(EngineError::InvalidRequest("LoRA needs at least one slot of rank >= 1".into()));
        }
        if cap.max_rank > LORA_MAX_RANK {
            return Err(EngineError::Unsupported(format!("the CUDA backend serves LoRA ranks up to {LORA_MAX_RANK} (asked {})", cap.max_rank)));
        }
        if cuda.gpu.arch.0 < 8 {
            return Err(EngineError::Unsupported("LoRA on the CUDA backend needs tensor cores of sm_80 or newer".into()));
        }
        for m in TargetModule::ALL {
            let (fan_in, _) = m.dims(config);
            if fan_in % 16 != 0 {
                return Err(EngineError::Unsupported(format!("LoRA on the CUDA backend: {} fan-in {fan_in} is not a multiple of 16", m.peft_name())));
            }
        }
        let layers = config.num_hidden_layers;
        let r_pad = lora_rank_pad(cap.max_rank);
        let zeros = |n: usize| cuda.gpu.alloc_zeros::<u16>(n).map_err(gpu_err);
        let overlap = SideStream::new(cuda)?;
        let delta_tokens = delta_rows(max_tokens, overlap.is_some());
        let delta = (delta_tokens > 0).then(|| zeros(delta_tokens * widest_output(config))).transpose()?;
        let ints = |n: usize| cuda.gpu.alloc_zeros::<i32>(n).map_err(gpu_err);
        let per = layers * cap.max_loras * r_pad;
        let mut modules = Vec::with_capacity(TargetModule::ALL.len());
        for m in TargetModule::ALL {
            let (fan_in, fan_out) = m.dims(config);
            let (group, index) = group_of(m);
            modules.push(ModuleStack { b: zeros(per * fan_out)?, fan_in, fan_out, group, index });
        }
        // A group's modules share a fan-in (they read the same x).
        let groups = GROUPS.iter().map(|g| Ok(GroupStack { a: AStore::Stack(zeros(g.len() * per * g[0].dims(config).0)?), modules: g.len() })).collect::<Result<Vec<_>>>()?;
        let dense = DenseShrink::new(cuda, cap, max_tokens, overlap.as_ref(), base)?;
        // Only an 8-bit base runs the 8-bit GEMV (over bf16 the mode is never consulted, and its
        // steps zero no counters); lora_group zeroes at most 1,024 (a model of 256 layers).
        let w8_rows = match W8Rows::from_env(cuda) {
            _ if !base.eight_bit => W8Rows::OwnLaunch,
            W8Rows::InGemvWithExpand if layers * GROUPS.len() > 1024 => W8Rows::InGemv,
            rows => rows,
        };
        Ok(GpuLora {
            capacity: cap,
            layers,
            modules,
            groups,
            scales: cuda.gpu.alloc_zeros::<f32>(cap.max_loras).map_err(gpu_err)?,
            scales_host: vec![0.0; cap.max_loras],
            ranks: ints(cap.max_loras)?,
            ranks_host: vec![0; cap.max_loras],
            r_pad,
            order: ints(max_tokens.max(1))?,
            seg: ints(cap.max_loras + 1)?,
            tiles: ints(1 + 2 * lora_max_tiles(max_tokens, cap.max_loras))?,
            t_part: cuda.gpu.alloc_zeros::<f32>(t_part_len(config, r_pad, max_tokens).max(1)).map_err(gpu_err)?,
            t_hi: zeros(max_tokens.max(1) * 3 * r_pad)?,
            t_lo: zeros(max_tokens.max(1) * 3 * r_pad)?,
            counters: ints(3 * lora_max_tiles(max_tokens, cap.max_loras))?,
            overlap,
            delta,
            delta_tokens,
            uploader: None,
            fused_swiglu: !std::env::var("PEREGRINE_LORA_SWIGLU").is_ok_and(|v| v == "0"),
            gemv_rows: GemvRowGroups::from_env(),
            skip_groups: GemvRowGroups::diagnostic("PEREGRINE_LORA_SKIP_GROUPS"),
            skip_expand: GemvRowGroups::diagnostic("PEREGRINE_LORA_SKIP_EXPAND"),
            empty_side: GemvRowGroups::diagnostic("PEREGRINE_LORA_EMPTY_SIDE"),
            empty_side_layers: std::env::var("PEREGRINE_LORA_EMPTY_SIDE_LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX),
            w8_rows,
            gemv_counters: ints(if w8_rows == W8Rows::InGemvWithExpand { layers * GROUPS.len() } else { 1 })?,
            dense,
            fused: None,
        })
    }

    /// Extends the o, gate|up, down (and q|k|v) weights for [`FusedNorms`] and takes those steps
    /// from now on, where the GPU, the weights and the configuration allow it (otherwise nothing
    /// changes). `plain_bf16_cache`: the KV cache is bf16 without rotation (what
    /// `rope_kv_write_lora` writes; otherwise q|k|v keeps its side stream). Before any slot is
    /// written: the weights' new rows start as zeros.
    pub fn attach_fused_norms(&mut self, cuda: &Cuda, weights: &mut GpuWeights, config: &ModelConfig, plain_bf16_cache: bool) -> Result<()> {
        let (hidden, inter) = (config.hidden_size, config.intermediate_size);
        let usable = self.overlap.is_some() && self.ranks_host.iter().all(|&r| r == 0);
        let plan = usable.then(|| Self::fused_plan(cuda, config, self.capacity, self.delta_tokens, plain_bf16_cache, weights.w8.is_some())).flatten();
        let Some(extended) = plan.filter(|_| self.fused.is_none()) else { return Ok(()) };
        let [qkv_extra, extra, gate_up_extra, _] = extended;
        let (qkv, gate_up) = (qkv_extra > 0, gate_up_extra > 0);
        let qkv_width = config.q_dim() + 2 * config.kv_dim();
        let fan_in = [hidden, config.q_dim(), hidden, inter];
        let Some(rows) = weights.extend_rows_for_lora(cuda, [qkv_width, hidden, 2 * inter, hidden], fan_in, extended)? else { return Ok(()) };
        let wide = cuda.gpu.alloc_zeros::<u16>(self.delta_tokens * Self::fused_row(config, extra, gate_up, qkv)).map_err(gpu_err)?;
        let full_sms = !std::env::var("PEREGRINE_LORA_FUSED_FULL_SMS").is_ok_and(|v| v == "0");
        tracing::info!(extra_rows = extra, qkv, gate_up, eight_bit = weights.w8.is_some(), "LoRA: o, down (and q|k|v, gate|up) ride in the base GEMMs and their consumers (no side stream for them)");
        let w8 = match weights.w8 {
            // The bf16 stacks stay: the other paths read them, the fused GEMM the 8-bit copies.
            Some(format) => Some(FusedW8 { format, rows }),
            None => {
                // The fused groups' A rows now live in their weights: their stacks go (the rows are
                // zeros in both, as no slot has been written). GROUPS and the fused weights share
                // their order.
                for (group, modules) in self.groups.iter_mut().zip(GROUPS) {
                    let Some((i, _)) = modules.first().and_then(|&m| fused_place(m)) else { continue };
                    if extended[i] > 0 {
                        group.a = AStore::InWeights(rows.iter().map(|r| r[i].rows).collect());
                    }
                }
                None
            }
        };
        self.fused = Some(FusedNorms { hidden, inter, qkv_width, qkv, wide, max_tokens: self.delta_tokens, gate_up, gate_up_min_tokens: fused_gate_up_min_tokens().unwrap_or(usize::MAX), full_sms, w8 });
        // The stacks' blocks go back to the pool's free list in stream order: wait for that here,
        // before the start-up allocations that follow and the KV cache's sizing.
        cuda.gpu.synchronize().map_err(gpu_err)?;
        Ok(())
    }

    /// The LoRA rows each weight gets for [`FusedNorms`], `[q|k|v, o, gate|up, down]` (0: that group
    /// keeps the side stream), for steps of up to `max_tokens` tokens at `cap`; None where nothing
    /// rides (switched off, no side stream, a GPU or shape the fused kernels do not take). Over
    /// 8-bit weights (`eight_bit`) gate|up keeps its side stream: its SwiGLU would have to quantize
    /// rows whose columns its blocks split (`silu_mul_lora` takes 128 columns a block). [`GpuWeights::upload`] leaves them at load, so that enabling LoRA rebuilds no
    /// weight (a rebuild's freed blocks strand memory in the allocator's pool).
    ///
    /// [`GpuWeights::upload`]: super::weights::GpuWeights::upload
    pub fn fused_lora_rows(cuda: &Cuda, config: &ModelConfig, cap: LoraCapacity, max_tokens: usize, eight_bit: bool, plain_bf16_cache: bool) -> Option<[usize; 4]> {
        if overlap_disabled() || cap.max_loras == 0 || cap.max_rank == 0 || cap.max_rank > LORA_MAX_RANK {
            return None;
        }
        Self::fused_plan(cuda, config, cap, delta_rows(max_tokens, true), plain_bf16_cache, eight_bit)
    }

    /// [`GpuLora::fused_lora_rows`] for an update buffer of `delta_tokens` rows (the fused steps' largest).
    fn fused_plan(cuda: &Cuda, config: &ModelConfig, cap: LoraCapacity, delta_tokens: usize, plain_bf16_cache: bool, eight_bit: bool) -> Option<[usize; 4]> {
        let k = &cuda.kernels;
        if fused_w8_disabled(eight_bit) {
            return None;
        }
        let gate_up = !eight_bit && fused_gate_up_min_tokens().is_some();
        let usable = !fused_norms_disabled() && delta_tokens >= 2 && k.add_rmsnorm_lora_fits(config.hidden_size) && (!gate_up || k.silu_mul_lora_fits(config.intermediate_size));
        if !usable {
            return None;
        }
        let qkv = fused_qkv() && plain_bf16_cache && k.rope_kv_write_lora_fits(config.head_dim);
        let extra = cap.max_loras * lora_rank_pad(cap.max_rank);
        Some([if qkv { 3 * extra } else { 0 }, extra, if gate_up { 2 * extra } else { 0 }, extra])
    }

    /// The widest fused GEMM row: o's and down's, or gate|up's or q|k|v's where they ride too.
    fn fused_row(config: &ModelConfig, extra: usize, gate_up: bool, qkv: bool) -> usize {
        let gate_up_row = if gate_up { 2 * (config.intermediate_size + extra) } else { 0 };
        let qkv_row = if qkv { config.q_dim() + 2 * config.kv_dim() + 3 * extra } else { 0 };
        (config.hidden_size + extra).max(gate_up_row).max(qkv_row)
    }

    /// Device bytes [`GpuLora::attach_fused_norms`] adds for `config` at `cap` once attached: the
    /// output buffer. The fused groups' A rows move from their stacks into the weights (held once);
    /// while it attaches, both are held.
    pub fn fused_norms_bytes(config: &ModelConfig, cap: LoraCapacity, max_tokens: usize) -> usize {
        if fused_norms_disabled() || overlap_disabled() {
            return 0;
        }
        let extra = cap.max_loras * lora_rank_pad(cap.max_rank);
        delta_rows(max_tokens, true) * Self::fused_row(config, extra, fused_gate_up_min_tokens().is_some(), fused_qkv()) * 2
    }

    /// Where an `n`-token step's fused projections write (their weights' full rows), or None where
    /// that step takes the side stream as before.
    pub fn fused_projection(&self, n: usize) -> Option<FusedProjection> {
        let f = self.fused.as_ref().filter(|f| (2..=f.max_tokens).contains(&n))?;
        let extra = self.capacity.max_loras * self.r_pad;
        let qkv_stride = f.qkv.then_some(f.qkv_width + 3 * extra);
        Some(FusedProjection { y: f.wide.ptr(), o_down_stride: f.hidden + extra, gate_up_stride: 2 * (f.inter + extra), gate_up: f.gate_up && n >= f.gate_up_min_tokens, qkv_stride, full_sms: f.full_sms })
    }

    /// Whether [`FusedNorms`] is attached.
    pub fn rides_in_base_gemms(&self) -> bool {
        self.fused.is_some()
    }

    /// `module`'s B stack of `layer`, `[slots, fan_out, r_pad]`.
    fn b_ptr(&self, module: TargetModule, layer: usize) -> DPtr {
        let stack = &self.modules[module.index()];
        stack.b.ptr_at(layer * self.capacity.max_loras * self.r_pad * stack.fan_out)
    }

    /// The residual add + RMSNorm after a fused `module` (o or down) projection of `layer`, its
    /// LoRA expand included (`add_rmsnorm_lora`), into `out`; over 8-bit weights (`w8`, which then
    /// must be given) with the projection's deferred scales applied and the row quantized for the
    /// next 8-bit linear (`add_rmsnorm_lora_quant`).
    ///
    /// # Safety
    /// `p` is this step's [`GpuLora::fused_projection`], written by that projection's GEMM over its
    /// full rows; `residual`/`out` hold `n` rows of hidden, `weight` hidden f32; `slots` as in
    /// [`GpuLora::begin_step`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fused_norm(&self, cuda: &Cuda, module: TargetModule, layer: usize, p: FusedProjection, residual: DPtr, weight: DPtr, out: DPtr, slots: DPtr, n: usize, eps: f32, w8: Option<FusedW8Io>) -> peregrine_kernels::Result<()> {
        let hidden = self.modules[module.index()].fan_out;
        let (b, segs) = (self.b_ptr(module, layer), self.segments(slots));
        match (w8, self.fused.as_ref().and_then(|f| f.w8.as_ref())) {
            (Some(io), Some(fw)) => cuda.kernels.add_rmsnorm_lora_quant(&cuda.gpu.stream, fw.format, residual, p.y, p.o_down_stride, io.y_scale, b, weight, out, io.q, io.q_scales, &segs, n, hidden, eps, self.r_pad),
            (None, None) => cuda.kernels.add_rmsnorm_lora(&cuda.gpu.stream, residual, p.y, p.o_down_stride, b, weight, out, &segs, n, hidden, eps, self.r_pad),
            _ => Err(peregrine_kernels::KernelError::Unsupported("the fused norm's 8-bit outputs and the fused weights disagree".into())),
        }
    }

    /// SwiGLU after the fused gate|up projection of `layer`, its LoRA expand included
    /// (`silu_mul_lora`), into `out`.
    ///
    /// # Safety
    /// As [`GpuLora::fused_norm`], for gate|up (`p.gate_up`); `out` holds `n` rows of inter.
    pub unsafe fn fused_swiglu(&self, cuda: &Cuda, layer: usize, p: FusedProjection, out: DPtr, slots: DPtr, n: usize) -> peregrine_kernels::Result<()> {
        let inter = self.modules[TargetModule::Gate.index()].fan_out;
        let (b_gate, b_up) = (self.b_ptr(TargetModule::Gate, layer), self.b_ptr(TargetModule::Up, layer));
        cuda.kernels.silu_mul_lora(&cuda.gpu.stream, out, p.y, p.gate_up_stride, inter, b_gate, b_up, &self.segments(slots), n, self.r_pad)
    }

    /// RoPE + the bf16 KV write after the fused q|k|v projection of `layer`, its LoRA expand
    /// included (`rope_kv_write_lora`); `y_scale`: the scales an 8-bit projection left.
    ///
    /// # Safety
    /// As [`GpuLora::fused_norm`], for q|k|v (`p.qkv_stride`); `bias` (if any) holds the q|k|v
    /// width in f32; `rope` and `cache` as [`peregrine_kernels::Kernels::rope_kv_write`] reads them
    /// for a bf16 cache.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn fused_rope(&self, cuda: &Cuda, layer: usize, p: FusedProjection, bias: Option<DPtr>, rope: RopeTables, cache: RopeCache, slots: DPtr, n: usize, y_scale: Option<OuterScale>) -> peregrine_kernels::Result<()> {
        let Some(stride) = p.qkv_stride else { return Err(peregrine_kernels::KernelError::Unsupported("q|k|v does not ride in its GEMM this step".into())) };
        let b = [TargetModule::Q, TargetModule::K, TargetModule::V].map(|m| self.b_ptr(m, layer));
        cuda.kernels.rope_kv_write_lora(&cuda.gpu.stream, p.y, stride, bias, rope, cache, b, &self.segments(slots), n, self.r_pad, y_scale)
    }

    /// Where `module`'s A rows of `slot` in `layer` start.
    fn a_at(&self, module: TargetModule, layer: usize, slot: usize) -> DPtr {
        let stack = &self.modules[module.index()];
        let group = &self.groups[stack.group];
        let shape = GroupShape { modules: group.modules, slots: self.capacity.max_loras, r_pad: self.r_pad, fan_in: stack.fan_in };
        match &group.a {
            AStore::Stack(a) => a.ptr_at(shape.a_offset(stack.index, layer, slot)),
            // A layer's block in the weight is the stack's layer 0 block.
            AStore::InWeights(rows) => rows.get(layer).map_or(0, |&at| at + 2 * shape.a_offset(stack.index, 0, slot) as u64),
        }
    }

    /// `module`'s A stack of `layer`, `[slots, r_pad, fan_in]`, as the grouped kernels read it.
    fn a_ptr(&self, module: TargetModule, layer: usize) -> DPtr {
        self.a_at(module, layer, 0)
    }

    /// Writes `adapter` into `slot` (every layer and module; untargeted modules become zeros)
    /// without blocking the engine thread on the GPU: the bf16 image is built on the CPU's cores
    /// into pinned memory and copied on the uploader's own stream, which first waits for the work
    /// already enqueued (an earlier step may still read the slot's previous adapter); the main stream
    /// then waits for the copy, so the next step sees the whole adapter. The host waits only when a
    /// second load follows before the first one's copy has finished (its pinned image is reused).
    pub fn set_slot(&mut self, cuda: &Cuda, slot: u32, adapter: &LoraAdapter) -> Result<()> {
        let slot = slot as usize;
        let LoraCapacity { max_loras, max_rank } = self.capacity;
        if slot >= max_loras {
            return Err(EngineError::InvalidRequest(format!("LoRA slot {slot} outside the {max_loras} slots")));
        }
        if adapter.rank > max_rank {
            return Err(EngineError::InvalidRequest(format!("adapter rank {} exceeds max LoRA rank {max_rank}", adapter.rank)));
        }
        if adapter.layers.len() != self.layers {
            return Err(EngineError::InvalidRequest(format!(
                "adapter has {} layers, the model {}",
                adapter.layers.len(),
                self.layers
            )));
        }
        let started = std::time::Instant::now();
        let dims: Vec<(usize, usize)> = self.modules.iter().map(|m| (m.fan_in, m.fan_out)).collect();
        let image_len = SlotImage::len(&dims, self.layers, self.r_pad);
        if self.uploader.is_none() {
            self.uploader = Some(SlotUploader::new(cuda, image_len)?);
        }
        let Some(up) = &mut self.uploader else { return Err(EngineError::Backend("LoRA uploader missing".into())) };
        SlotImage::fill(up.staging(image_len)?, adapter, &dims, self.layers, self.r_pad)?;
        let main = &cuda.gpu.stream;
        let driver = |e: DriverError| gpu_err(e.into());
        let staging = up.staging.as_slice().map_err(driver)?;
        up.slot_free.record(main).map_err(driver)?;
        up.stream.wait(&up.slot_free).map_err(driver)?;
        let r_pad = self.r_pad;
        let mut offset = 0;
        for module in TargetModule::ALL {
            let (fan_in, fan_out, group, index) = {
                let m = &self.modules[module.index()];
                (m.fan_in, m.fan_out, m.group, m.index)
            };
            let shape = GroupShape { modules: self.groups[group].modules, slots: max_loras, r_pad, fan_in };
            let (a_len, b_len) = (r_pad * fan_in, fan_out * r_pad);
            // Over 8-bit weights a fused group's rows are quantized into its weight too (FusedW8).
            let w8_rows = self.fused.as_ref().and_then(|f| f.w8.as_ref()).and_then(|fw| fused_place(module).map(|(i, _)| (fw, i))).filter(|&(fw, i)| fw.rows.first().is_some_and(|r| r[i].rows != 0));
            for layer in 0..self.layers {
                let at = shape.a_offset(index, layer, slot);
                let a_rows = &staging[offset..offset + a_len];
                match &mut self.groups[group].a {
                    AStore::Stack(a) => {
                        a.write_at(&up.stream, at, a_rows).map_err(gpu_err)?;
                        if let Some((fw, i)) = w8_rows {
                            let Some(extra) = fw.rows.get(layer).map(|r| r[i]) else { return Err(EngineError::Backend("LoRA rows of a fused 8-bit weight missing".into())) };
                            // The slot's rows of this module, as the stack's layer block lays them out.
                            let row = shape.a_offset(index, 0, slot) / fan_in;
                            // SAFETY: the stack holds these r_pad rows of fan_in at `at` (written
                            // just above on this stream); the weight holds the group's modules ·
                            // max_loras · r_pad extra rows of fan_in codes and as many scales.
                            unsafe { cuda.kernels.quant_rows(&up.stream, fw.format, extra.rows + (row * fan_in) as u64, extra.scales + 4 * row as u64, a.ptr_at(at), r_pad, fan_in) }.map_err(gpu_err)?;
                        }
                    }
                    AStore::InWeights(rows) => {
                        let Some(&layer_rows) = rows.get(layer) else { return Err(EngineError::Backend("LoRA rows of a fused weight missing".into())) };
                        let dst = layer_rows + 2 * shape.a_offset(index, 0, slot) as u64;
                        // SAFETY: the weight holds the group's modules · max_loras · r_pad rows of
                        // fan_in past `layer_rows` (extend_rows_for_lora), laid out as the stack's
                        // layer block; `staging` is pinned and not rewritten before the copy
                        // completes (`copied`).
                        unsafe { peregrine_kernels::cudarc::driver::result::memcpy_htod_async(dst, a_rows, up.stream.cu_stream()) }.map_err(driver)?;
                    }
                }
                offset += a_len;
                let b_at = (layer * max_loras + slot) * b_len;
                self.modules[module.index()].b.write_at(&up.stream, b_at, &staging[offset..offset + b_len]).map_err(gpu_err)?;
                offset += b_len;
            }
        }
        up.copied.record(&up.stream).map_err(driver)?;
        up.in_flight = true;
        main.wait(&up.copied).map_err(driver)?;
        self.scales_host[slot] = adapter.scaling;
        self.scales.write(main, &self.scales_host).map_err(gpu_err)?;
        self.ranks_host[slot] = adapter.rank as i32;
        self.ranks.write(main, &self.ranks_host).map_err(gpu_err)?;
        // Host time only: the copy itself (MiB / PCIe bandwidth) runs on the uploader stream and the
        // next step waits for it on the GPU.
        tracing::debug!(
            slot,
            rank = adapter.rank,
            mib = format_args!("{:.1}", (image_len * 2) as f64 / (1 << 20) as f64),
            host_ms = format_args!("{:.1}", started.elapsed().as_secs_f64() * 1e3),
            "LoRA adapter written into a GPU slot"
        );
        Ok(())
    }

    fn segments(&self, slots: DPtr) -> LoraSegments {
        LoraSegments {
            slots,
            order: self.order.ptr(),
            seg: self.seg.ptr(),
            tiles: self.tiles.ptr(),
            ranks: self.ranks.ptr(),
            scales: self.scales.ptr(),
            num_slots: self.capacity.max_loras,
        }
    }

    /// Enqueues the grouping of a step's `n` tokens by their slots (`slots`: device i32, -1 for
    /// none), once per step before any [`GpuLora::apply`].
    ///
    /// # Safety
    /// `slots` holds `n` entries below `max_loras` or -1; `n` is within the `max_tokens` of
    /// [`GpuLora::new`].
    pub unsafe fn begin_step(&self, cuda: &Cuda, slots: DPtr, n: usize) -> peregrine_kernels::Result<()> {
        // A one-token step whose 8-bit GEMVs add the expand: their counters start at 0.
        let counters = if n == 1 && self.w8_rows == W8Rows::InGemvWithExpand { self.gemv_counters.len() } else { 0 };
        cuda.kernels.lora_group_zeroing(&cuda.gpu.stream, &self.segments(slots), n, self.gemv_counters.ptr(), counters)
    }

    /// Whether [`GpuLora::apply_around`] returns the updates of an `n`-token step in their own buffer
    /// (for the consumer to add) rather than adding them into the projection's output: only then
    /// may that output stay unscaled for its consumer (`Cuda::linear_w8_deferred`).
    pub fn update_buffered(&self, n: usize) -> bool {
        self.overlap.is_some() && self.delta.is_some() && n <= self.delta_tokens
    }

    /// Enqueues the base projection (`base`, on the main stream) and the update `scale · (x · Aᵀ) ·
    /// Bᵀ` of every module of its group for the `n` tokens of a step, after [`GpuLora::begin_step`]
    /// with the same `slots`. Decode-sized steps: shrink and expand beside `base` on the side stream,
    /// into the update buffer, which the caller must have the consumer of `p.y` add (the returned
    /// [`LoraDelta`]; it holds until the next call). Otherwise: the shrink beside `base`, then the
    /// expand adds into `p.y`; or, for a gate|up group (gate's columns first, then up's, `p.y_stride`
    /// twice a module's width) with `swiglu` given, SwiGLU is written into `swiglu` for every token
    /// with the updates fused into it (`lora_expand_swiglu`: the same bits as the buffered path, and
    /// no read-modify-write of `p.y`), and `p.y` keeps the base output.
    ///
    /// # Safety
    /// `p.x`/`p.y` hold `n` rows at their strides with the modules' fan-in / fan-out columns (each
    /// module's at its offset in `p.outs`); the modules share a fan-in; `slots` as in
    /// [`GpuLora::begin_step`]; `base` writes `p.y` and does not write `p.x`; the update returned by
    /// the previous call was consumed by work enqueued on the main stream before this call;
    /// `swiglu` holds `n` rows of a module's width.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn apply_around(
        &self,
        cuda: &Cuda,
        layer: usize,
        p: &Projection<'_>,
        slots: DPtr,
        n: usize,
        swiglu: Option<DPtr>,
        base: impl FnOnce(Option<&GemvLoraRows>) -> peregrine_kernels::Result<()>,
    ) -> peregrine_kernels::Result<LoraUpdate> {
        // Diagnostics (all off by default): the fork and join with nothing on the side stream
        // (before the group skip, so that it can be alone in a step), the group left out, its expand.
        let diagnostic = |set: GemvRowGroups| p.outs.first().is_some_and(|&(m, _)| set.takes(m));
        let empty_side = self.overlap.is_some() && layer < self.empty_side_layers && diagnostic(self.empty_side);
        if !empty_side && diagnostic(self.skip_groups) {
            base(None)?;
            return Ok(LoraUpdate::Added);
        }
        let skip_expand = diagnostic(self.skip_expand);
        let mut modules = [LoraModule { a: 0, b: 0, out: 0, col: 0 }; 3];
        let mut fan_in = 0;
        for (dst, &(module, col)) in modules.iter_mut().zip(p.outs) {
            let stack = &self.modules[module.index()];
            fan_in = stack.fan_in;
            *dst = LoraModule { a: self.a_ptr(module, layer), b: self.b_ptr(module, layer), out: stack.fan_out, col };
        }
        let work = LoraScratch { t_part: self.t_part.ptr(), t_hi: self.t_hi.ptr(), t_lo: self.t_lo.ptr(), counters: self.counters.ptr() };
        let modules = &modules[..p.outs.len().min(modules.len())];
        let segs = self.segments(slots);
        let main = &cuda.gpu.stream;
        let k = &cuda.kernels;
        // The update buffer holds `delta_tokens` rows of the widest output at any stride up to it
        // (used only with the side stream: the decision `update_buffered` reports).
        let delta = self.delta.as_ref().filter(|_| self.update_buffered(n));
        let one_token = n == 1 && p.outs.first().is_some_and(|&(first, _)| self.gemv_rows.takes(first));
        // The rows-only GEMV reads x in 16-byte pieces (the bf16 GEMV's own check covers its case).
        let w8_rows = self.w8_rows != W8Rows::SideStream && p.x.is_multiple_of(16) && fan_in.is_multiple_of(16);
        if one_token && !empty_side && (p.gemv == BaseGemv::Bf16 || (p.gemv == BaseGemv::W8 && w8_rows)) {
            // Our GEMV writes the shrink's t (one token, every module of the group) with y: the
            // bf16 one as extra rows, the 8-bit one as extra blocks reading x's bf16 row. (Or, for
            // comparisons, a GEMV of the LoRA rows alone right before the 8-bit one: it triggers
            // the base GEMV's launch at once, so that one still streams its first weights early.)
            // The 8-bit GEMV then adds the expand in its epilogue; otherwise the expand adds in
            // place, PDL-chained after the base. All on the main stream.
            let mut a = [0; 3];
            for (dst, m) in a.iter_mut().zip(modules) {
                *dst = m.a;
            }
            let mut rows = GemvLoraRows { a, n_modules: modules.len(), r_pad: self.r_pad, slots, scales: self.scales.ptr(), t_hi: work.t_hi, t_lo: work.t_lo, expand: None };
            if p.gemv == BaseGemv::Bf16 {
                base(Some(&rows))?;
            } else if self.w8_rows == W8Rows::OwnLaunch {
                k.gemv_lora_rows(main, 0, p.x, p.x, 0, fan_in, &rows)?;
                base(None)?;
            } else {
                if self.w8_rows == W8Rows::InGemvWithExpand {
                    // This launch's own counter, zeroed by the step's begin_step.
                    let counter = self.gemv_counters.ptr_at(layer * GROUPS.len() + group_of(p.outs[0].0).0);
                    let mut e = GemvLoraExpand { b: [0; 3], out: [0; 3], col: [0; 3], counter };
                    for (i, m) in modules.iter().enumerate() {
                        (e.b[i], e.out[i], e.col[i]) = (m.b, m.out, m.col);
                    }
                    rows.expand = Some(e);
                }
                base(Some(&rows))?;
                if rows.expand.is_some() {
                    return Ok(LoraUpdate::Added);
                }
            }
            k.lora_expand(main, p.y, p.y_stride, modules, self.r_pad, &segs, &work, n)?;
            return Ok(LoraUpdate::Added);
        }
        match &self.overlap {
            Some(side) => {
                // The fork: the side stream starts once the main stream has made x (and consumed
                // the previous group's update, which this group's expand overwrites).
                let stream = side.for_tokens(n);
                side.input_ready.record(main)?;
                stream.wait(&side.input_ready)?;
                match self.dense_group(p, fan_in, n, Arc::ptr_eq(stream, &side.stream)) {
                    _ if empty_side => {}
                    // One GEMM of x against every slot's A of the group, then each token's own slot.
                    Some((dense, group)) => {
                        let cols = group.modules * self.capacity.max_loras * self.r_pad;
                        let a = self.a_at(p.outs[0].0, layer, 0);
                        dense.blas.matmul(dense.u.ptr(), OutType::F32, p.x, a, n, cols, fan_in, 0.0)?;
                        k.lora_pick_t(stream, dense.u.ptr(), modules.len(), self.r_pad, &segs, &work, n)?;
                    }
                    None => k.lora_shrink(stream, p.x, p.x_stride, fan_in, modules, self.r_pad, &segs, &work, n)?,
                }
                if let Some(d) = delta.filter(|_| !skip_expand && !empty_side) {
                    k.lora_expand_to(stream, d.ptr(), p.y_stride, modules, self.r_pad, &segs, &work, n)?;
                }
                side.side_done.record(stream)?;
                base(None)?;
                main.wait(&side.side_done)?;
                if skip_expand || empty_side {
                    return Ok(LoraUpdate::Added);
                }
                if let Some(d) = delta {
                    return Ok(LoraUpdate::Buffered(LoraDelta { d: d.ptr(), slots }));
                }
            }
            None => {
                base(None)?;
                k.lora_shrink(main, p.x, p.x_stride, fan_in, modules, self.r_pad, &segs, &work, n)?;
            }
        }
        if let Some(h) = swiglu.filter(|_| self.fused_swiglu && is_gate_up(modules, p.y_stride)) {
            let inter = modules[0].out;
            k.silu_mul_unslotted(main, h, p.y, n, inter, slots)?;
            k.lora_expand_swiglu(main, h, p.y, inter, &modules[0], &modules[1], self.r_pad, &segs, &work, n)?;
            return Ok(LoraUpdate::SwigluWritten);
        }
        k.lora_expand(main, p.y, p.y_stride, modules, self.r_pad, &segs, &work, n)?;
        Ok(LoraUpdate::Added)
    }

    /// The dense shrink and the group's A stack, when a step of `n` tokens on the side stream's
    /// default-priority stream (`on_side`) takes it for `p`: every module of the group in
    /// [`GROUPS`] order (what the GEMM's columns hold) and x rows packed (the GEMM's row stride).
    fn dense_group(&self, p: &Projection<'_>, fan_in: usize, n: usize, on_side: bool) -> Option<(&DenseShrink, &GroupStack)> {
        let dense = self.dense.as_ref().filter(|d| on_side && d.tokens.contains(&n) && p.x_stride == fan_in)?;
        let &(first, _) = p.outs.first()?;
        let (g, _) = group_of(first);
        let whole = GROUPS[g].len() == p.outs.len() && GROUPS[g].iter().zip(p.outs).all(|(&m, &(o, _))| m == o);
        whole.then(|| (dense, &self.groups[g]))
    }
}

/// Whether `modules` are gate and up side by side as `lora_expand_swiglu` reads them: two modules
/// of one width (that kernel's multiple), the second starting where the first ends, rows twice that.
fn is_gate_up(modules: &[LoraModule], y_stride: usize) -> bool {
    match modules {
        [gate, up] => gate.out == up.out && gate.col == 0 && up.col == gate.out && y_stride == 2 * gate.out && lora_swiglu_fits(gate.out),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_stack_gives_every_module_layer_and_slot_its_own_rows() {
        // q|k|v-like: 3 modules, 4 slots of r_pad 16 over a fan-in of 8, 2 layers.
        let shape = GroupShape { modules: 3, slots: 4, r_pad: 16, fan_in: 8 };
        let rows = shape.r_pad * shape.fan_in;
        let mut seen = vec![false; 2 * shape.modules * shape.slots * rows];
        for layer in 0..2 {
            for index in 0..shape.modules {
                // A module's slice of a layer is [slots, r_pad, fan_in], as the grouped kernels read it.
                let first = shape.a_offset(index, layer, 0);
                for slot in 0..shape.slots {
                    let at = shape.a_offset(index, layer, slot);
                    assert_eq!(at, first + slot * rows, "module {index} layer {layer} slot {slot}");
                    for e in &mut seen[at..at + rows] {
                        assert!(!*e, "module {index} layer {layer} slot {slot} overlaps another");
                        *e = true;
                    }
                }
            }
            // One layer's group is one [modules × slots × r_pad, fan_in] matrix (the dense GEMM's A),
            // module after module.
            assert_eq!(shape.a_offset(1, layer, 0), shape.a_offset(0, layer, 0) + shape.slots * rows);
        }
        assert!(seen.iter().all(|&e| e), "the stack has rows no module, layer or slot owns");
    }

    #[test]
    fn fused_rows_give_each_module_and_slot_the_rows_its_consumer_reads() {
        // set_slot writes module m's slot s at row `part · slots · r_pad + s · r_pad` past the
        // weight's own rows; the GEMM puts row j's product at column `fan_out + j`, where
        // add_rmsnorm_lora reads o's and down's u (hidden + s · r_pad), silu_mul_lora gate's
        // (2 · inter + s · r_pad) and up's (num_slots · r_pad further), rope_kv_write_lora q's, k's
        // and v's (width + (m · num_slots + s) · r_pad, m = 0, 1, 2).
        let (slots, r_pad) = (4usize, 32usize);
        let mut taken = std::collections::HashMap::<usize, Vec<bool>>::new();
        for m in TargetModule::ALL {
            let Some((weight, part)) = fused_place(m) else { panic!("{m:?} is fused") };
            // set_slot writes A where the group's stack would hold its layer block (AStore::InWeights).
            assert_eq!((weight, part), group_of(m), "{m:?}: its fused rows are its group's stack block");
            let modules = match weight {
                FUSED_QKV => 3,
                FUSED_GATE_UP => 2,
                _ => 1,
            };
            assert!(part < modules, "{m:?}: part {part} past its weight's {modules} modules");
            let rows = taken.entry(weight).or_insert_with(|| vec![false; modules * slots * r_pad]);
            for s in 0..slots {
                let first = part * slots * r_pad + s * r_pad;
                let kernel_reads = match m {
                    TargetModule::Up | TargetModule::K => slots * r_pad + s * r_pad,
                    TargetModule::V => 2 * slots * r_pad + s * r_pad,
                    _ => s * r_pad,
                };
                assert_eq!(first, kernel_reads, "{m:?} slot {s}");
                let shape = GroupShape { modules, slots, r_pad, fan_in: 8 };
                assert_eq!(shape.a_offset(part, 0, s), first * 8, "{m:?} slot {s}: set_slot's offset in the weight's rows");
                for r in &mut rows[first..first + r_pad] {
                    assert!(!*r, "{m:?} slot {s} overlaps another module's rows");
                    *r = true;
                }
            }
        }
        assert!(taken.values().all(|rows| rows.iter().all(|&r| r)), "rows no module or slot owns");
    }

    #[test]
    fn gemv_row_groups_parse_names_lists_and_the_two_words() {
        let all = GemvRowGroups { qkv: true, o: true, gate_up: true, down: true };
        let none = GemvRowGroups { qkv: false, o: false, gate_up: false, down: false };
        assert_eq!(GemvRowGroups::DEFAULT, all);
        assert_eq!(GemvRowGroups::parse("all"), all);
        assert_eq!(GemvRowGroups::parse("none"), none);
        assert_eq!(GemvRowGroups::parse("0"), none);
        assert_eq!(GemvRowGroups::parse("qkv, o"), GemvRowGroups { qkv: true, o: true, ..none });
        // Unknown names are ignored, not taken as "all".
        assert_eq!(GemvRowGroups::parse("down,bogus"), GemvRowGroups { down: true, ..none });
        let g = GemvRowGroups::parse("gate_up");
        assert!(g.takes(TargetModule::Gate) && g.takes(TargetModule::Up));
        assert!(!g.takes(TargetModule::Q) && !g.takes(TargetModule::O) && !g.takes(TargetModule::Down));
    }
}

//! The encoder's int8 linears (`--quantization int8` on an encoder folder): W8A8 with integer sums.
//!
//! Weights are quantized as every `--quantization int8` matrix is ([`RowQuantMatrix`]: symmetric
//! codes −127..=127, one scale per output row), then packed for the kernel. Activations are quantized
//! per token (max |x| → 127, the same rounding, [`RowFormat::Int8`]) by the step that produces them
//! ([`quantize_row`]), and stored offset by 128 as unsigned bytes, because the AVX-512 VNNI
//! instruction (`vpdpbusd`) multiplies unsigned by signed bytes. Since `Σ (x + 128)·w = Σ x·w +
//! 128·Σ w`, the kernel subtracts `128 · Σ_j w[r, j]` (precomputed per row) from its i32 sums: the
//! result is the exact integer dot product of the signed codes. The epilogue is the same f32
//! arithmetic in every kernel: `out = (sum as f32 · token scale) · row scale + bias`.
//!
//! Outlier columns of the activations are evened out first by SmoothQuant's migration
//! ([`Int8Linear::quantize_smoothed`]: activations divided, weights multiplied per input column, by
//! factors from a calibration forward at load); the division happens in f32 before the per-token
//! quantization.
//!
//! Two kernels compute identical results ([`Kernel`]): `vpdpbusd` on 16-lane registers where the CPU
//! has AVX-512 VNNI (detected at run time), and a portable scalar loop (i32 sums: integer addition is
//! exact in any order, and the epilogue's float operations are the same ones in the same order).
//!
//! Packing: rows in groups of [`GROUP`] (64, four 16-lane registers), columns in quads (the four
//! bytes one i32 lane of `vpdpbusd` sums); per group and quad the 4 × 16 lanes × 4 bytes are
//! contiguous, so the kernel reads 256 consecutive bytes per quad. Rows are padded to a whole group
//! and columns to a whole quad with zero weights (their products are zero whatever the activation).

use rayon::prelude::*;

use super::simd::Isa;
use crate::encoder::weights::Linear;
use crate::model::rowquant::{quantize_row_into, RowFormat, RowQuantMatrix};
use crate::{EngineError, Result};

/// Output rows per packed group: four 16-lane i32 registers.
pub const GROUP: usize = 64;
/// Tokens per register tile: 6 × 4 accumulators, 4 weight registers and a broadcast fit in 32 zmm.
const MR: usize = 6;
/// Tokens per parallel task (a multiple of [`MR`]): enough tasks to balance two threads on short
/// batches, few enough that each task reuses its weight group over many tokens.
const TASK_TOKENS: usize = 96;
/// SmoothQuant's migration strength: `s_j = max|x_j|^α / max|W_j|^(1−α)`. On all-MiniLM-L6-v2's
/// references 0.5 did best of 0.35/0.5/0.65/0.8 (min cosine 0.9965/0.9977/0.9968/0.9924; without
/// smoothing 0.9954).
const ALPHA: f32 = 0.5;

/// Which int8 kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 VNNI `vpdpbusd` (with AVX-512F/BW for the epilogue and the activation quantizer).
    Vnni,
    /// Portable scalar loops; the same integer sums and the same float epilogue.
    Scalar,
}

impl Kernel {
    /// VNNI if this CPU has it and `isa` allows AVX-512 (`PEREGRINE_CPU_ISA=generic|avx2` caps it,
    /// as for the f32 kernels), else scalar.
    pub fn detect(isa: Isa) -> Kernel {
        if isa == Isa::Avx512 && Self::vnni_available() {
            Kernel::Vnni
        } else {
            Kernel::Scalar
        }
    }

    /// Every kernel this CPU can run, best first.
    pub fn available() -> Vec<Kernel> {
        if Self::vnni_available() {
            vec![Kernel::Vnni, Kernel::Scalar]
        } else {
            vec![Kernel::Scalar]
        }
    }

    fn vnni_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Vnni => "avx512-vnni int8",
            Kernel::Scalar => "scalar int8",
        }
    }
}

/// A linear layer `y = x·Wᵀ + b` with int8 weights packed for [`gemm`].
#[derive(Debug, Clone)]
pub struct Int8Linear {
    /// Output rows (unpadded).
    pub rows: usize,
    /// Input columns (unpadded).
    pub cols: usize,
    /// `groups × quads × 64 × 4` signed codes (see the module doc), in 64-byte-aligned lines: the
    /// kernel's 64-byte loads then never straddle two cache lines (a `Vec<i8>` from the allocator
    /// starts 16 bytes past a line, which made every weight load a split load).
    packed: Vec<Line>,
    /// Per row (padded to a whole group with zeros): the weight scale, the bias, `128 · Σ_j code`.
    scales: Vec<f32>,
    bias: Vec<f32>,
    offsets: Vec<i32>,
    /// Per input column, what the activations are multiplied by before they are quantized (`1 / s`
    /// of [`Int8Linear::quantize_smoothed`]); empty: none.
    pub smooth: Vec<f32>,
}

impl Int8Linear {
    /// Quantizes an f32 linear's weight rows (one scale per row, as `--quantization int8` does for
    /// decoders) and packs them. Errors on non-finite weights.
    pub fn quantize(l: &Linear, what: &str) -> Result<Int8Linear> {
        let (rows, cols) = (l.weight.rows, l.weight.cols);
        if l.bias.len() != rows {
            return Err(EngineError::InvalidConfig(format!("{what}: {} biases for {rows} rows", l.bias.len())));
        }
        let q = RowQuantMatrix::quantize(RowFormat::Int8, rows, cols, &l.weight.to_f32())
            .map_err(|e| EngineError::Unsupported(format!("--quantization int8: {what}: {e}")))?;
        Ok(Self::from_codes(rows, cols, q.codes(), q.scales(), &l.bias))
    }

    /// SmoothQuant's migration (Xiao et al. 2023): a few input columns of the encoder's activations
    /// carry outliers many times the rest (all-MiniLM-L6-v2: column 99 of every LayerNorm output,
    /// ~28 where the row's RMS is ~1), which would take most of a per-token scale's 127 steps. Per
    /// column j, `s_j = max |x_j|^α / max |W[·, j]|^(1−α)` ([`ALPHA`] = ½) divides the activations and
    /// multiplies the weights before both are quantized: `x·Wᵀ` is unchanged in exact arithmetic,
    /// and both sides' ranges are evened out. `act_max`: max |x_j| seen on calibration inputs.
    pub fn quantize_smoothed(l: &Linear, act_max: &[f32], what: &str) -> Result<Int8Linear> {
        let (rows, cols) = (l.weight.rows, l.weight.cols);
        if act_max.len() != cols {
            return Err(EngineError::InvalidConfig(format!("{what}: {} calibration maxima for {cols} columns", act_max.len())));
        }
        let w = l.weight.to_f32();
        let mut w_max = vec![0f32; cols];
        for row in w.chunks_exact(cols.max(1)) {
            for (m, &v) in w_max.iter_mut().zip(row) {
                *m = m.max(v.abs());
            }
        }
        let s: Vec<f32> = act_max
            .iter()
            .zip(&w_max)
            .map(|(&a, &m)| if a > 0.0 && m > 0.0 && a.is_finite() { (a.powf(ALPHA) / m.powf(1.0 - ALPHA)).clamp(1e-4, 1e4) } else { 1.0 })
            .collect();
        let scaled: Vec<f32> = w.chunks_exact(cols.max(1)).flat_map(|row| row.iter().zip(&s).map(|(v, s)| v * s)).collect();
        let smoothed = Linear { weight: crate::model::Matrix::from_f32(rows, cols, scaled), bias: l.bias.clone() };
        let mut out = Self::quantize(&smoothed, what)?;
        out.smooth = s.iter().map(|s| 1.0 / s).collect();
        Ok(out)
    }

    /// Packs `rows × cols` int8 codes (two's complement bytes, row-major) with their row scales.
    pub fn from_codes(rows: usize, cols: usize, codes: &[u8], scales: &[f32], bias: &[f32]) -> Int8Linear {
        assert!(codes.len() == rows * cols && scales.len() == rows && bias.len() == rows, "Int8Linear: shapes");
        let groups = rows.div_ceil(GROUP);
        let quads = cols.div_ceil(4);
        let padded = groups * GROUP;
        let mut lines = vec![Line([0; 64]); groups * quads * GROUP * 4 / 64];
        let packed = Line::bytes_mut(&mut lines);
        let mut offsets = vec![0i32; padded];
        for r in 0..rows {
            let (g, lane) = (r / GROUP, r % GROUP);
            let row = &codes[r * cols..(r + 1) * cols];
            for (j, &c) in row.iter().enumerate() {
                packed[((g * quads + j / 4) * GROUP + lane) * 4 + j % 4] = c as i8;
            }
            offsets[r] = 128 * row.iter().map(|&c| c as i8 as i32).sum::<i32>();
        }
        let mut s = scales.to_vec();
        s.resize(padded, 0.0);
        let mut b = bias.to_vec();
        b.resize(padded, 0.0);
        Int8Linear { rows, cols, packed: lines, scales: s, bias: b, offsets, smooth: Vec::new() }
    }

    /// The signed code of row `r`, column `j` (0 in the padding).
    fn code(&self, r: usize, j: usize) -> i8 {
        let quads = self.cols.div_ceil(4);
        let at = (((r / GROUP) * quads + j / 4) * GROUP + r % GROUP) * 4 + j % 4;
        self.packed[at / 64].0[at % 64]
    }

    /// Bytes held (codes and per-row vectors).
    pub fn size_bytes(&self) -> usize {
        64 * self.packed.len() + 12 * self.scales.len()
    }
}

/// 64 packed weight codes on a cache line of their own.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 64]);

impl Line {
    fn bytes_mut(lines: &mut [Line]) -> &mut [i8] {
        // SAFETY: `Line` is `repr(C)` around `[i8; 64]` (size 64, no padding), so `lines` is
        // 64 · len initialized bytes, borrowed mutably for the slice's lifetime.
        unsafe { std::slice::from_raw_parts_mut(lines.as_mut_ptr() as *mut i8, 64 * lines.len()) }
    }
}

/// Rows of activations quantized per token: `codes[t · stride + j] = code + 128` (stride = width
/// rounded up to 4, padded with 128, i.e. code 0), one scale per token.
#[derive(Debug, Clone, Default)]
pub struct QuantRows {
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
    pub width: usize,
    pub stride: usize,
}

impl QuantRows {
    /// Room for `n` rows of `width` (contents unspecified until each row is quantized, but for the
    /// padding after `width`, which is 128). Reused at the same width, only new rows are filled:
    /// quantizing writes each row's first `width` bytes and never the padding.
    pub fn reset(&mut self, n: usize, width: usize) {
        if width != self.width {
            self.codes.clear();
        }
        self.width = width;
        self.stride = width.div_ceil(4) * 4;
        self.codes.resize(n * self.stride, 128);
        self.scales.resize(n, 0.0);
    }

    /// Each row's codes (stride bytes) paired with its scale, for filling in parallel.
    pub fn rows_mut(&mut self) -> impl IndexedParallelIterator<Item = (&mut [u8], &mut f32)> {
        self.codes.par_chunks_mut(self.stride.max(1)).zip(self.scales.par_iter_mut())
    }

    /// Quantizes every row of `x` (`n × width`) for a linear with smoothing `smooth` (empty: none;
    /// [`Int8Linear::smooth`]), in parallel on the current pool.
    pub fn quantize_all(&mut self, kernel: Kernel, x: &[f32], width: usize, smooth: &[f32]) {
        let n = x.len() / width.max(1);
        self.reset(n, width);
        x.par_chunks(width)
            .zip(self.rows_mut())
            .for_each_init(Vec::new, |tmp, (row, (codes, scale))| *scale = quantize_input(kernel, row, smooth, tmp, codes));
    }
}

/// One row of a linear's input quantized: multiplied by `smooth` column by column unless it is
/// empty, then [`quantize_row`]. The VNNI kernel multiplies on the fly in both of its passes (no
/// copy through `tmp`; the same products, so the same bytes as the scalar path).
pub fn quantize_input(kernel: Kernel, row: &[f32], smooth: &[f32], tmp: &mut Vec<f32>, codes: &mut [u8]) -> f32 {
    if smooth.is_empty() {
        return quantize_row(kernel, row, codes);
    }
    assert!(smooth.len() == row.len() && codes.len() >= row.len(), "quantize_input: shapes");
    #[cfg(target_arch = "x86_64")]
    if kernel == Kernel::Vnni {
        // SAFETY: `Kernel::Vnni` is only chosen where the CPU has AVX-512F/BW/VNNI.
        return unsafe { x86::quantize_row(row, Some(smooth), codes) };
    }
    tmp.clear();
    tmp.extend(row.iter().zip(smooth).map(|(x, s)| x * s));
    quantize_row(kernel, tmp, codes)
}

/// Quantizes one row of activations into `codes` (`code + 128` per element; at least `row.len()`
/// bytes) and returns its scale `max |x| / 127`, by [`RowFormat::Int8`]'s definition (`x / scale`
/// rounded half to even, clamped to ±127). A row of zeros, or one whose maximum is not finite,
/// gets scale 0 and code 0 throughout (as `rowquant` does). Both kernels give the same bytes for
/// finite inputs.
pub fn quantize_row(kernel: Kernel, row: &[f32], codes: &mut [u8]) -> f32 {
    assert!(codes.len() >= row.len(), "quantize_row: codes shorter than the row");
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Kernel::Vnni` is only chosen where the CPU has AVX-512F/BW/VNNI.
        Kernel::Vnni => unsafe { x86::quantize_row(row, None, codes) },
        _ => quantize_row_scalar(row, codes),
    }
}

/// `rowquant`'s own per-row quantizer (the definition every int8 path shares), codes offset by 128.
fn quantize_row_scalar(row: &[f32], codes: &mut [u8]) -> f32 {
    quantize_row_into(RowFormat::Int8, row, |i, c| codes[i] = offset(c))
}

/// `v / scale` as [`RowFormat::Int8`] encodes it, offset by 128.
#[inline(always)]
fn encode(v: f32, scale: f32) -> u8 {
    offset(RowFormat::Int8.encode(v / scale))
}

/// A signed int8 code (as `rowquant` stores it) + 128: the unsigned byte `vpdpbusd` multiplies.
#[inline(always)]
fn offset(code: u8) -> u8 {
    code.wrapping_add(128)
}

/// `out[t, r] = (Σ_j x[t, j]·W[r, j]) · sx[t] · sw[r] + b[r]` for the `n` rows of `x` (`out`:
/// `n × w.rows`, row-major, resized). Runs on the current rayon pool.
pub fn gemm(kernel: Kernel, x: &QuantRows, n: usize, w: &Int8Linear, out: &mut Vec<f32>) {
    assert!(x.width == w.cols && x.codes.len() >= n * x.stride && x.scales.len() >= n, "int8 gemm: shapes");
    out.resize(n * w.rows, 0.0);
    let groups = w.rows.div_ceil(GROUP);
    let chunks = n.div_ceil(TASK_TOKENS);
    let dst = OutPtr(out.as_mut_ptr());
    (0..groups * chunks).into_par_iter().for_each(|task| {
        let (g, c) = (task % groups, task / groups);
        let t0 = c * TASK_TOKENS;
        let t1 = (t0 + TASK_TOKENS).min(n);
        // SAFETY: this task writes rows t0..t1, columns of group g only; tasks are disjoint and
        // `out` (n × rows) outlives the parallel loop.
        unsafe { group_tile(kernel, x, t0, t1, w, g, dst) };
    });
}

/// Tokens per task of [`gemm_then_quantize`] (a multiple of [`MR`]): 22 tasks for a 1024-token
/// chunk; the task's activations (48 × 384 bytes) stay in L1 across the row groups, its output
/// (48 × 1536 floats) in L2 until it is finished.
const FUSED_TASK_TOKENS: usize = 48;

/// [`gemm`], whose output rows are then passed through `act` and quantized into `next` (smoothed
/// by `smooth`, as [`QuantRows::quantize_all`]) by the task that computed them, while they are in
/// cache: each task takes a block of tokens through every row group, then finishes its rows.
/// Why: the feed-forward up projection's output is 1536 floats a token (6 MiB for a 1024-token
/// chunk, more than L2), which went to memory between the GEMM, the GELU and the quantizer, and
/// each was a parallel region of its own. Results are bit for bit those of `gemm`, `act` on each
/// row and `quantize_all`.
#[allow(clippy::too_many_arguments)]
pub fn gemm_then_quantize<A: Fn(&mut [f32]) + Sync>(kernel: Kernel, x: &QuantRows, n: usize, w: &Int8Linear, out: &mut Vec<f32>, act: A, smooth: &[f32], next: &mut QuantRows) {
    assert!(x.width == w.cols && x.codes.len() >= n * x.stride && x.scales.len() >= n, "int8 gemm: shapes");
    assert!(smooth.is_empty() || smooth.len() == w.rows, "int8 gemm_then_quantize: smoothing");
    out.resize(n * w.rows, 0.0);
    next.reset(n, w.rows);
    let (groups, rows, stride) = (w.rows.div_ceil(GROUP), w.rows, next.stride);
    let dst = OutPtr(out.as_mut_ptr());
    next.codes
        .par_chunks_mut(FUSED_TASK_TOKENS * stride)
        .zip(next.scales.par_chunks_mut(FUSED_TASK_TOKENS))
        .enumerate()
        .for_each_init(Vec::new, |tmp, (c, (codes, scales))| {
            let t0 = c * FUSED_TASK_TOKENS;
            let t1 = (t0 + FUSED_TASK_TOKENS).min(n);
            for g in 0..groups {
                // SAFETY: this task writes rows t0..t1 of `out` only (tasks are disjoint), and
                // `out` (n × rows) outlives the parallel loop.
                unsafe { group_tile(kernel, x, t0, t1, w, g, dst) };
            }
            for (i, t) in (t0..t1).enumerate() {
                // SAFETY: row t of `out` is this task's alone (written above); nothing else holds a
                // reference into `out` during the loop.
                let row = unsafe { std::slice::from_raw_parts_mut(dst.get().add(t * rows), rows) };
                act(row);
                scales[i] = quantize_input(kernel, row, smooth, tmp, &mut codes[i * stride..(i + 1) * stride]);
            }
        });
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint (token, row) blocks of the buffer (see `gemm`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method, so closures capture the whole (Send) wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Tokens `t0..t1` × the rows of group `g`.
///
/// # Safety
/// `dst` points at `n × w.rows` floats (n ≥ t1) and no other thread touches this block.
unsafe fn group_tile(kernel: Kernel, x: &QuantRows, t0: usize, t1: usize, w: &Int8Linear, g: usize, dst: OutPtr) {
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: Vnni only where the CPU has it; the caller's block contract passes on.
        Kernel::Vnni => unsafe { x86::group_tile(x, t0, t1, w, g, dst.get()) },
        _ => {
            let r0 = g * GROUP;
            let r1 = (r0 + GROUP).min(w.rows);
            for t in t0..t1 {
                let a = &x.codes[t * x.stride..t * x.stride + x.width];
                for r in r0..r1 {
                    let mut acc = 0i32;
                    for (j, &c) in a.iter().enumerate() {
                        acc += c as i32 * w.code(r, j) as i32;
                    }
                    let v = epilogue(acc - w.offsets[r], x.scales[t], w.scales[r], w.bias[r]);
                    // SAFETY: (t, r) lies in this task's block (caller's contract).
                    unsafe { *dst.get().add(t * w.rows + r) = v };
                }
            }
        }
    }
}

/// The f32 epilogue both kernels share: `(sum · token scale) · row scale + bias`, rounded at each
/// step (no fused multiply-add, which the scalar path could not match on every target).
#[inline(always)]
fn epilogue(sum: i32, sx: f32, sw: f32, b: f32) -> f32 {
    sum as f32 * sx * sw + b
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Int8Linear, QuantRows, GROUP, MR};

    /// [`super::quantize_row`] with AVX-512: max |x| over 16 lanes (exact in any order), then the
    /// same division, round-half-even, clamp and offset as the scalar path, 16 at a time. With
    /// `smooth`, each element is first multiplied by its factor (in both passes: the same product
    /// each time, so the bytes are those of quantizing the multiplied row).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) fn quantize_row(row: &[f32], smooth: Option<&[f32]>, codes: &mut [u8]) -> f32 {
        assert!(smooth.is_none_or(|s| s.len() >= row.len()), "quantize_row: smoothing shorter than the row");
        let (chunks, tail) = row.as_chunks::<16>();
        let factor = |i: usize| -> __m512 {
            match smooth {
                // SAFETY: 16 factors at i·16 + 16 ≤ row.len() ≤ smooth.len() (asserted above).
                Some(s) => unsafe { _mm512_loadu_ps(s.as_ptr().add(16 * i)) },
                None => _mm512_set1_ps(1.0),
            }
        };
        let tail_value = |j: usize, v: f32| smooth.map_or(v, |s| v * s[j]);
        // Four running maxima: one is a chain of dependent `vmaxps` (4 cycles each), which made
        // this pass latency-bound.
        let mut m = [_mm512_setzero_ps(); 4];
        let (fours, rest) = chunks.as_chunks::<4>();
        for (i, four) in fours.iter().enumerate() {
            for (u, (m, c)) in m.iter_mut().zip(four).enumerate() {
                // SAFETY: 16 contiguous f32.
                let v = _mm512_mul_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }, factor(4 * i + u));
                *m = _mm512_max_ps(_mm512_abs_ps(v), *m);
            }
        }
        for (i, c) in rest.iter().enumerate() {
            // SAFETY: 16 contiguous f32.
            let v = _mm512_mul_ps(unsafe { _mm512_loadu_ps(c.as_ptr()) }, factor(4 * fours.len() + i));
            m[0] = _mm512_max_ps(_mm512_abs_ps(v), m[0]);
        }
        let m = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
        let done = chunks.len() * 16;
        let amax = tail.iter().enumerate().fold(_mm512_reduce_max_ps(m), |a, (j, &v)| a.max(tail_value(done + j, v).abs()));
        if amax == 0.0 || !amax.is_finite() {
            codes[..row.len()].fill(128);
            return 0.0;
        }
        let scale = amax / 127.0;
        let vs = _mm512_set1_ps(scale);
        // Multiplied by 1/scale rather than divided (a 16-lane division has about a tenth of a
        // multiply's throughput): x·(1/scale) is within 2 ulps of x/scale, which is at most
        // 127·(1 + 2⁻²³) in magnitude (|x| ≤ amax), so within 2⁻¹⁵; it rounds to the same integer
        // unless it lies that close to a half-integer, and vectors with such a lane (rare) take the
        // division: the bytes stay those of the definition. Both stay below 127.5 in magnitude, so
        // rounding (`vcvtps2dq`, to nearest even) gives codes within ±127 with no clamp.
        let vinv = _mm512_set1_ps(1.0 / scale);
        let (half, near) = (_mm512_set1_ps(0.5), _mm512_set1_ps(1.0 / 4096.0));
        let off = _mm512_set1_epi32(128);
        for (i, c) in chunks.iter().enumerate() {
            // SAFETY: 16 f32 in; 16 bytes out at i·16 < row.len() ≤ codes.len().
            unsafe {
                let x = _mm512_mul_ps(_mm512_loadu_ps(c.as_ptr()), factor(i));
                let v = _mm512_mul_ps(x, vinv);
                let mut q = _mm512_cvtps_epi32(v);
                let off_half = _mm512_sub_ps(_mm512_abs_ps(_mm512_sub_ps(v, _mm512_cvtepi32_ps(q))), half);
                if _mm512_cmp_ps_mask::<_CMP_LT_OQ>(_mm512_abs_ps(off_half), near) != 0 {
                    q = _mm512_cvtps_epi32(_mm512_div_ps(x, vs));
                }
                _mm_storeu_si128(codes.as_mut_ptr().add(i * 16) as *mut __m128i, _mm512_cvtepi32_epi8(_mm512_add_epi32(q, off)));
            }
        }
        for (j, (c, &v)) in codes[done..].iter_mut().zip(tail).enumerate() {
            *c = super::encode(tail_value(done + j, v), scale);
        }
        scale
    }

    /// [`super::group_tile`] with `vpdpbusd`: register tiles of up to [`MR`] tokens × 64 rows.
    ///
    /// # Safety
    /// The CPU has AVX-512F/BW/VNNI; `dst` as in [`super::group_tile`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn group_tile(x: &QuantRows, t0: usize, t1: usize, w: &Int8Linear, g: usize, dst: *mut f32) {
        let mut t = t0;
        while t < t1 {
            let m = (t1 - t).min(MR);
            // SAFETY: passed on from the caller.
            unsafe {
                match m {
                    6 => tile::<6>(x, t, w, g, dst),
                    5 => tile::<5>(x, t, w, g, dst),
                    4 => tile::<4>(x, t, w, g, dst),
                    3 => tile::<3>(x, t, w, g, dst),
                    2 => tile::<2>(x, t, w, g, dst),
                    _ => tile::<1>(x, t, w, g, dst),
                }
            }
            t += m;
        }
    }

    /// The shared epilogue of `R` 16-row registers from row `r0`, for tokens `t..t+M`, stored
    /// (masked past the last real row).
    ///
    /// # Safety
    /// As [`group_tile`]; rows `r0..` belong to the caller's block.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn store<const M: usize, const R: usize>(acc: &[[__m512i; R]; M], x: &QuantRows, t: usize, w: &Int8Linear, r0: usize, dst: *mut f32) {
        for v in 0..R {
            let r = r0 + 16 * v;
            if r >= w.rows {
                break;
            }
            let live = (w.rows - r).min(16);
            let mask: __mmask16 = if live == 16 { 0xFFFF } else { (1u16 << live) - 1 };
            // SAFETY: per-row vectors are padded to whole groups; (t + i, r..r + live) lies in the
            // caller's block of dst.
            unsafe {
                let off = _mm512_loadu_si512(w.offsets.as_ptr().add(r) as *const __m512i);
                let sw = _mm512_loadu_ps(w.scales.as_ptr().add(r));
                let bias = _mm512_loadu_ps(w.bias.as_ptr().add(r));
                for (i, acc) in acc.iter().enumerate() {
                    let sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[v], off));
                    let sx = _mm512_set1_ps(x.scales[t + i]);
                    let o = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(sum, sx), sw), bias);
                    _mm512_mask_storeu_ps(dst.add((t + i) * w.rows + r), mask, o);
                }
            }
        }
    }

    /// Tokens `t..t+M` × the 64 rows of group `g`: 4·M i32 accumulators over the quads, then the
    /// epilogue, stored (masked past the last real row).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn tile<const M: usize>(x: &QuantRows, t: usize, w: &Int8Linear, g: usize, dst: *mut f32) {
        let quads = w.cols.div_ceil(4);
        let mut acc = [[_mm512_setzero_si512(); 4]; M];
        // SAFETY: token rows t..t+M lie in x (checked by `gemm`: t + M ≤ n), each `stride` ≥ 4·quads
        // bytes; group g's packed block is quads × 256 bytes inside `packed`.
        unsafe {
            let a = x.codes.as_ptr().add(t * x.stride);
            let wp = (w.packed.as_ptr() as *const i8).add(g * quads * GROUP * 4);
            for q in 0..quads {
                let b = wp.add(q * GROUP * 4);
                let w0 = _mm512_loadu_si512(b as *const __m512i);
                let w1 = _mm512_loadu_si512(b.add(64) as *const __m512i);
                let w2 = _mm512_loadu_si512(b.add(128) as *const __m512i);
                let w3 = _mm512_loadu_si512(b.add(192) as *const __m512i);
                for (i, acc) in acc.iter_mut().enumerate() {
                    let v = _mm512_set1_epi32((a.add(i * x.stride + 4 * q) as *const i32).read_unaligned());
                    acc[0] = _mm512_dpbusd_epi32(acc[0], v, w0);
                    acc[1] = _mm512_dpbusd_epi32(acc[1], v, w1);
                    acc[2] = _mm512_dpbusd_epi32(acc[2], v, w2);
                    acc[3] = _mm512_dpbusd_epi32(acc[3], v, w3);
                }
            }
        }
        // SAFETY: passed on from the caller.
        unsafe { store::<M, 4>(&acc, x, t, w, g * GROUP, dst) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rowquant::quantize_activations;
    use crate::model::Matrix;

    fn values(n: usize, seed: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 2001) as f32 / 1000.0 - 1.0) * amp).collect()
    }

    #[test]
    fn activation_codes_match_rowquant_on_every_kernel() {
        // Widths with and without a 16-lane tail; a zero row; exact ties (±0.5 steps).
        for k in [384usize, 37, 5] {
            let n = 5;
            let mut x = values(n * k, k, 3.0);
            x[2 * k..3 * k].fill(0.0);
            x[3 * k] = 127.0; // row 3: scale 1, so the next values are exact ties
            x[3 * k + 1] = 2.5;
            x[3 * k + 2] = -3.5;
            x[3 * k + 3] = 0.5;
            let (want, want_scales) = quantize_activations(RowFormat::Int8, &x, n, k);
            for kernel in Kernel::available() {
                let mut q = QuantRows::default();
                q.quantize_all(kernel, &x, k, &[]);
                assert_eq!(q.scales, want_scales, "{kernel:?} k {k}");
                for t in 0..n {
                    for j in 0..k {
                        let code = q.codes[t * q.stride + j] as i32 - 128;
                        assert_eq!(code as f32, want[t * k + j], "{kernel:?} k {k} [{t}, {j}]");
                    }
                    assert!(q.codes[t * q.stride + k..(t + 1) * q.stride].iter().all(|&c| c == 128), "padding is code 0");
                }
                if k >= 4 {
                    assert_eq!(&q.codes[3 * q.stride..3 * q.stride + 4], &[255, 130, 124, 128], "ties to even: 2.5 → 2, -3.5 → -4, 0.5 → 0");
                }
            }
        }
    }

    #[test]
    fn smoothed_codes_match_the_scalar_path_on_every_kernel() {
        // Widths with and without a 16-lane tail; an outlier column divided down.
        for k in [384usize, 1536, 37, 5] {
            // Many rows of pseudo-random values, so that rounding near half-steps is exercised.
            let n = 200;
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            let x: Vec<f32> = (0..n * k)
                .map(|_| {
                    state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 6.0
                })
                .collect();
            let mut smooth = values(k, 2, 1.0).iter().map(|v| 0.5 + v.abs()).collect::<Vec<f32>>();
            smooth[k / 2] = 0.03;
            let mut want = QuantRows::default();
            want.quantize_all(Kernel::Scalar, &x, k, &smooth);
            for kernel in Kernel::available() {
                let mut q = QuantRows::default();
                q.quantize_all(kernel, &x, k, &smooth);
                assert_eq!((&q.codes, &q.scales), (&want.codes, &want.scales), "{kernel:?} k {k}");
            }
        }
    }

    #[test]
    fn quantization_round_trip_error_is_half_a_step() {
        let k = 384;
        let x = values(4 * k, 1, 5.0);
        let mut q = QuantRows::default();
        q.quantize_all(Kernel::detect(Isa::detect()), &x, k, &[]);
        for t in 0..4 {
            let s = q.scales[t];
            for j in 0..k {
                let back = (q.codes[t * q.stride + j] as i32 - 128) as f32 * s;
                assert!((back - x[t * k + j]).abs() <= 0.5 * s * (1.0 + 1e-6), "[{t}, {j}]");
            }
        }
        // Weights: each row's largest element is exactly ±127 codes, others within half a step.
        let (rows, cols) = (70, 38);
        let wv = values(rows * cols, 9, 0.2);
        let l = Linear { weight: Matrix::from_f32(rows, cols, wv.clone()), bias: vec![0.0; rows] };
        let p = Int8Linear::quantize(&l, "test").unwrap();
        for r in 0..rows {
            let s = p.scales[r];
            let row = &wv[r * cols..(r + 1) * cols];
            assert!((0..cols).any(|j| p.code(r, j).unsigned_abs() == 127));
            for (j, &v) in row.iter().enumerate() {
                assert!((p.code(r, j) as f32 * s - v).abs() <= 0.5 * s * (1.0 + 1e-6), "w[{r}, {j}]");
            }
            assert_eq!(p.offsets[r], 128 * (0..cols).map(|j| p.code(r, j) as i32).sum::<i32>());
        }
        for r in rows..p.scales.len() {
            assert_eq!((p.scales[r], p.offsets[r]), (0.0, 0));
        }
    }

    /// The integer dot products by the definition (i64), then the shared epilogue.
    fn reference(x: &QuantRows, n: usize, w: &Int8Linear) -> Vec<f32> {
        let mut out = vec![0f32; n * w.rows];
        for t in 0..n {
            for r in 0..w.rows {
                let dot: i64 = (0..w.cols).map(|j| (x.codes[t * x.stride + j] as i64 - 128) * w.code(r, j) as i64).sum();
                out[t * w.rows + r] = epilogue(dot as i32, x.scales[t], w.scales[r], w.bias[r]);
            }
        }
        out
    }

    #[test]
    fn vnni_and_scalar_kernels_give_identical_results() {
        // Partial groups (rows 100 = 64 + 36, and 20), a column tail (k 390 = 97 quads + 2), token
        // counts with partial register tiles and more than one task (200 = 2 × 96 + 8); the
        // feed-forward down projection's width (1536) with partial groups and tiles.
        for (rows, k, n) in [(100usize, 390usize, 200usize), (20, 8, 7), (128, 1536, 13), (100, 1536, 30), (20, 1100, 25)] {
            let mut wv = values(rows * k, rows, 0.1);
            wv[5] = 3.0; // an outlier: row 0's other codes small
            let bias = values(rows, 3, 0.5);
            let l = Linear { weight: Matrix::from_f32(rows, k, wv), bias };
            let w = Int8Linear::quantize(&l, "test").unwrap();
            let mut x = values(n * k, n, 2.0);
            x[k..2 * k].fill(0.0); // a zero token
            let mut q = QuantRows::default();
            q.quantize_all(Kernel::Scalar, &x, k, &[]);
            let want = reference(&q, n, &w);
            let mut outs = Vec::new();
            for kernel in Kernel::available() {
                let mut out = Vec::new();
                gemm(kernel, &q, n, &w, &mut out);
                assert_eq!(out, want, "{kernel:?} {rows}×{k}, {n} tokens");
                outs.push(out);
            }
            // A token's result does not depend on the batch.
            for kernel in Kernel::available() {
                let mut one = QuantRows::default();
                one.quantize_all(kernel, &x[7 % n * k..(7 % n + 1) * k], k, &[]);
                let mut out = Vec::new();
                gemm(kernel, &one, 1, &w, &mut out);
                assert_eq!(out, want[7 % n * rows..(7 % n + 1) * rows], "{kernel:?} alone");
            }
        }
    }

    #[test]
    fn fused_gemm_then_quantize_equals_the_separate_steps() {
        // Token counts below, at and past the fused task size, with a partial register tile.
        for (rows, k, n) in [(100usize, 40usize, 1usize), (128, 64, 48), (70, 36, 101)] {
            let l = Linear { weight: Matrix::from_f32(rows, k, values(rows * k, 3, 0.1)), bias: values(rows, 4, 0.2) };
            let w = Int8Linear::quantize(&l, "test").unwrap();
            let smooth: Vec<f32> = (0..rows).map(|i| 0.5 + (i % 5) as f32 * 0.25).collect();
            let act = |row: &mut [f32]| row.iter_mut().for_each(|v| *v = v.max(0.0) * 1.5);
            for kernel in Kernel::available() {
                let mut q = QuantRows::default();
                q.quantize_all(kernel, &values(n * k, n, 2.0), k, &[]);
                let mut want = Vec::new();
                gemm(kernel, &q, n, &w, &mut want);
                want.chunks_mut(rows).for_each(act);
                let mut want_q = QuantRows::default();
                want_q.quantize_all(kernel, &want, rows, &smooth);
                let (mut out, mut next) = (Vec::new(), QuantRows::default());
                gemm_then_quantize(kernel, &q, n, &w, &mut out, act, &smooth, &mut next);
                assert_eq!(out, want, "{kernel:?} {rows}×{k}, {n} tokens");
                assert_eq!((&next.codes, &next.scales), (&want_q.codes, &want_q.scales), "{kernel:?} {rows}×{k}, {n} tokens");
            }
        }
    }

    #[test]
    fn smoothing_keeps_the_product_and_tames_an_outlier_column() {
        let (rows, k, n) = (64, 384, 8);
        let wv = values(rows * k, 5, 0.1);
        let mut x = values(n * k, 6, 1.0);
        for t in 0..n {
            x[t * k + 99] = 30.0 * if t % 2 == 0 { 1.0 } else { -1.0 }; // MiniLM's column 99
        }
        let l = Linear { weight: Matrix::from_f32(rows, k, wv.clone()), bias: vec![0.0; rows] };
        let act_max = {
            let mut m = vec![0f32; k];
            for t in 0..n {
                for j in 0..k {
                    m[j] = m[j].max(x[t * k + j].abs());
                }
            }
            m
        };
        let kernel = Kernel::detect(Isa::detect());
        let error = |w: &Int8Linear| {
            let mut q = QuantRows::default();
            q.quantize_all(kernel, &x, k, &w.smooth);
            let mut out = Vec::new();
            gemm(kernel, &q, n, w, &mut out);
            let mut sq = 0f64;
            for t in 0..n {
                for r in 0..rows {
                    let exact: f64 = (0..k).map(|j| x[t * k + j] as f64 * wv[r * k + j] as f64).sum();
                    sq += (out[t * rows + r] as f64 - exact).powi(2);
                }
            }
            sq.sqrt()
        };
        let plain = Int8Linear::quantize(&l, "plain").unwrap();
        let smoothed = Int8Linear::quantize_smoothed(&l, &act_max, "smoothed").unwrap();
        assert!(plain.smooth.is_empty() && smoothed.smooth.len() == k);
        assert!(smoothed.smooth[99] < 0.5, "the outlier column is divided down: {}", smoothed.smooth[99]);
        let (e_plain, e_smooth) = (error(&plain), error(&smoothed));
        assert!(e_smooth < 0.5 * e_plain, "error {e_smooth} smoothed vs {e_plain} plain");
        assert!(Int8Linear::quantize_smoothed(&l, &act_max[1..], "short").is_err());
    }

    #[test]
    fn int8_gemm_is_close_to_the_f32_product() {
        let (rows, k, n) = (64, 384, 10);
        let wv = values(rows * k, 4, 0.1);
        let x = values(n * k, 8, 1.0);
        let l = Linear { weight: Matrix::from_f32(rows, k, wv.clone()), bias: vec![0.25; rows] };
        let w = Int8Linear::quantize(&l, "test").unwrap();
        let mut q = QuantRows::default();
        q.quantize_all(Kernel::detect(Isa::detect()), &x, k, &[]);
        let mut out = Vec::new();
        gemm(Kernel::detect(Isa::detect()), &q, n, &w, &mut out);
        for t in 0..n {
            for r in 0..rows {
                let exact: f32 = (0..k).map(|j| x[t * k + j] * wv[r * k + j]).sum::<f32>() + 0.25;
                // Each product's error is at most half a step of either factor: a loose, sure bound.
                let bound = 0.5 * k as f32 * (q.scales[t] * 0.1 + w.scales[r] * 1.0);
                assert!((out[t * rows + r] - exact).abs() <= bound, "[{t}, {r}]");
            }
        }
    }
}

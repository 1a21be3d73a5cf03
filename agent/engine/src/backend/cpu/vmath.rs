//! Elementwise maths the compiler can vectorize: `exp` and `erf` as branch-free polynomials, and
//! the encoder's softmax and GELU built on them, compiled once per instruction set ([`Isa`]).
//!
//! Why not `f32::exp` / `libm::erff`: they are calls per element, which the compiler cannot
//! vectorize. The encoder's attention takes heads × len² exponentials per layer (19 M for one
//! 512-token MiniLM sequence) and its GELU len × intermediate error functions (4.7 M): vectorized,
//! the encoder's batches ran 18–24 % faster (docs/benchmarks.md). These stay within a few float32
//! ulps of the library functions (tested below against f64), far below the encoder's 1e-5 tolerance.

use super::simd::Isa;

/// Below this, `exp` is 0 in float32 up to 1.2e-38 (the smallest normal), which this returns.
const EXP_MIN: f32 = -87.336_55;
/// Above this `2^n` would overflow the exponent; inputs are clamped here (softmax and erf only
/// pass values ≤ 0).
const EXP_MAX: f32 = 88.0;

/// `exp(x)` to ~2 ulps: `x = n·ln2 + r` with |r| ≤ ln2/2 (Cody–Waite: ln2 split in two so `n·ln2`
/// is exact), Cephes' degree-6 polynomial for `exp(r)`, and `2^n` built in the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds x·log2(e) to an integer n, which then sits in the low bits of
    // the sum's mantissa (no `round` call, no float-to-int conversion: both keep the loop scalar).
    const ROUND: f32 = 12_582_912.0;
    // Selects, not `clamp`/`max`, whose NaN rules cost the vector form.
    let x = if x < EXP_MIN { EXP_MIN } else { x };
    let x = if x > EXP_MAX { EXP_MAX } else { x };
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n is in [-126, 127] after the clamp: 2^n is a normal float with exponent bits n + 127.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    y * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

/// `erf(x)` to ~1.4e-7 absolute (2 float32 ulps near 0.84): a power series in `x²` up to |x| = 1,
/// `1 − exp(Q(u) − x²)` beyond (Q smooth and small: it carries `ln erfc(x) + x²`), 1 from |x| = 4
/// (erfc(4) is below half an ulp of 1). Both pieces are computed and one is selected, so there is
/// no branch. The coefficients and the error are printed by `scripts/fit-erf.py` (Chebyshev
/// interpolants, each checked in float32).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    // P[0] is 2/√π to float32's precision, as the series' leading term must be.
    const P: [f32; 7] = [std::f32::consts::FRAC_2_SQRT_PI, -0.376_126_26, 0.112_835_94, -0.026_854_211, 5.189_087_2e-3, -8.016_864e-4, 7.875_875e-5];
    const Q: [f32; 9] = [
        -1.556_815_3, -0.529_021, 0.126_239_17, -3.664_757_7e-2, 1.096_184_9e-2, -3.190_305_3e-3, 8.803_971e-4, -2.274_995e-4,
        4.195_84e-5,
    ];
    let a = x.abs();
    let s = x * x;
    let capped = if a > 4.0 { 4.0 } else { a };
    let mut p = P[6];
    for &c in P[..6].iter().rev() {
        p = p * s + c;
    }
    let small = p * a;
    let u = (2.0 * capped - 5.0) * (1.0 / 3.0);
    let mut q = Q[8];
    for &c in Q[..8].iter().rev() {
        q = q * u + c;
    }
    let large = 1.0 - exp(q - capped * capped);
    let y = if a <= 1.0 { small } else { large };
    y.copysign(x)
}

/// Lanes of the partial sums and maxima: independent accumulators the compiler keeps in vector
/// registers (a single running sum is one dependent add per element and cannot vectorize).
const LANES: usize = 16;

#[inline(always)]
fn softmax_body(row: &mut [f32]) {
    let mut lane_max = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lane_max.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lane_max.iter().chain(chunks.remainder()) {
        max = if v > max { v } else { max };
    }
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let mut lane_sum = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &v) in lane_sum.iter_mut().zip(c) {
            *s += v;
        }
    }
    let sum: f32 = lane_sum.iter().chain(chunks.remainder()).sum();
    let inv = 1.0 / sum;
    // Plain loops, not `for_each` with a closure: a generic function called here need not be
    // inlined, and outside this function it would be compiled without the ISA's features.
    for v in row.iter_mut() {
        *v *= inv;
    }
}

#[inline(always)]
fn gelu_erf_body(row: &mut [f32]) {
    for v in row.iter_mut() {
        *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// `x = LayerNorm(x + y)` with 16 lanes of f32 partial sums (two passes: mean, then the variance
/// about it), compiled per ISA. The encoder's f32 path keeps its f64 LayerNorm (1e-5 to the
/// references); its int8 path, whose quantization error is orders larger, uses this: the f64 sums,
/// in closures compiled without AVX, were ~7 % of a 128-token int8 run.
#[inline(always)]
fn residual_layer_norm_body(x: &mut [f32], y: &[f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len();
    for (a, &v) in x.iter_mut().zip(y) {
        *a += v;
    }
    let mut lane = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &v) in lane.iter_mut().zip(c) {
            *s += v;
        }
    }
    let mean = (lane.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()) / n as f32;
    let mut lane = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (s, &v) in lane.iter_mut().zip(c) {
            *s += (v - mean) * (v - mean);
        }
    }
    let var = (lane.iter().sum::<f32>() + chunks.remainder().iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>()) / n as f32;
    let inv = 1.0 / (var + eps).sqrt();
    for ((v, &w), &b) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * w + b;
    }
}

/// Pieces of [`erf_table`]: 16 of width ¼ cover [0, 4) (erf(4) is 1 to within 2e-8).
const ERF_PIECES: usize = 16;
/// Coefficients per piece (degree 5).
const ERF_COEFFS: usize = 6;

/// erf(z) on [0, 4) as [`ERF_PIECES`] polynomials of degree 5, piece i in `t = 4z − i − ½` ∈
/// [−½, ½]: `table[k][i]` is the coefficient of `t^k`. Each is the Chebyshev interpolant of libm's
/// f64 `erf` (error ~2e-9 before float32 rounding of the coefficients and of the evaluation; the
/// tests check the result against f64). The AVX-512 GELU looks a lane's coefficients up with one
/// permute each (16 pieces = one register per coefficient): 6 permutes and 5 FMAs, where the
/// two-piece [`erf`] evaluates both of its pieces and an `exp` for every lane (~2× the work; GELU was
/// ~10 % of a 128-token int8 run). Computed once, at first use.
fn erf_table() -> &'static [[f32; ERF_PIECES]; ERF_COEFFS] {
    static TABLE: std::sync::OnceLock<[[f32; ERF_PIECES]; ERF_COEFFS]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut table = [[0f32; ERF_PIECES]; ERF_COEFFS];
        for i in 0..ERF_PIECES {
            let nodes: [f64; ERF_COEFFS] = std::array::from_fn(|k| 0.5 * (std::f64::consts::PI * (2 * k + 1) as f64 / (2 * ERF_COEFFS) as f64).cos());
            // The Vandermonde system Σ_k a_k t_n^k = erf(z_n), by Gaussian elimination with
            // partial pivoting (6 × 6, well conditioned on Chebyshev nodes in [−½, ½]).
            let mut m: [[f64; ERF_COEFFS + 1]; ERF_COEFFS] = std::array::from_fn(|n| {
                let t = nodes[n];
                std::array::from_fn(|k| if k < ERF_COEFFS { t.powi(k as i32) } else { libm::erf((i as f64 + 0.5 + t) / 4.0) })
            });
            for col in 0..ERF_COEFFS {
                let pivot = (col..ERF_COEFFS).fold(col, |best, r| if m[r][col].abs() > m[best][col].abs() { r } else { best });
                m.swap(col, pivot);
                #[allow(clippy::needless_range_loop)] // rows r and col of the same matrix
                for r in 0..ERF_COEFFS {
                    if r != col {
                        let f = m[r][col] / m[col][col];
                        for k in col..=ERF_COEFFS {
                            m[r][k] -= f * m[col][k];
                        }
                    }
                }
            }
            for (k, row) in table.iter_mut().enumerate() {
                row[i] = (m[k][ERF_COEFFS] / m[k][k]) as f32;
            }
        }
        table
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// GELU with [`super::erf_table`]: `0.5·(x + |x|·erf(|x|/√2))`, the same as `0.5·x·(1 +
    /// erf(x/√2))` without a sign step. Tails (rows not a multiple of 16) by the scalar formula.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn gelu_erf_table(row: &mut [f32], table: &[[f32; super::ERF_PIECES]; super::ERF_COEFFS]) {
        // SAFETY: each table row is 16 f32.
        let c: [__m512; super::ERF_COEFFS] = std::array::from_fn(|k| unsafe { _mm512_loadu_ps(table[k].as_ptr()) });
        // 4·|x|/√2, capped just below 16 (the last piece; erf is 1 in float32 from there).
        let (to_z, cap) = (_mm512_set1_ps(2.0 * std::f32::consts::SQRT_2), _mm512_set1_ps(15.999_999));
        let half = _mm512_set1_ps(0.5);
        let (chunks, tail) = row.as_chunks_mut::<16>();
        for ch in chunks {
            // SAFETY: 16 f32 in and out.
            unsafe {
                let x = _mm512_loadu_ps(ch.as_ptr());
                let a = _mm512_abs_ps(x);
                let z = _mm512_min_ps(_mm512_mul_ps(a, to_z), cap);
                let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(z);
                let i = _mm512_cvtps_epi32(n);
                let t = _mm512_sub_ps(_mm512_sub_ps(z, n), half);
                let mut p = _mm512_permutexvar_ps(i, c[5]);
                for k in (0..5).rev() {
                    p = _mm512_fmadd_ps(p, t, _mm512_permutexvar_ps(i, c[k]));
                }
                _mm512_storeu_ps(ch.as_mut_ptr(), _mm512_mul_ps(half, _mm512_fmadd_ps(a, p, x)));
            }
        }
        super::gelu_erf_body(tail);
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn residual_layer_norm_avx512(x: &mut [f32], y: &[f32], w: &[f32], b: &[f32], eps: f32) {
        super::residual_layer_norm_body(x, y, w, b, eps)
    }
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn residual_layer_norm_avx2(x: &mut [f32], y: &[f32], w: &[f32], b: &[f32], eps: f32) {
        super::residual_layer_norm_body(x, y, w, b, eps)
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn softmax_avx512(row: &mut [f32]) {
        super::softmax_body(row)
    }
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn softmax_avx2(row: &mut [f32]) {
        super::softmax_body(row)
    }
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gelu_erf_avx2(row: &mut [f32]) {
        super::gelu_erf_body(row)
    }
}

/// Softmax of one row in place (an empty row is left alone; a row of -inf gives NaN, as torch).
pub fn softmax(isa: Isa, row: &mut [f32]) {
    match isa {
        // SAFETY: `Isa::detect` returns these only where the CPU has the features enabled.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::softmax_avx512(row) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::softmax_avx2(row) },
        _ => softmax_body(row),
    }
}

/// `x = LayerNorm(x + y)` (weight `w`, bias `b`) in f32 (see `residual_layer_norm_body`).
pub fn residual_layer_norm(isa: Isa, x: &mut [f32], y: &[f32], w: &[f32], b: &[f32], eps: f32) {
    assert!(y.len() == x.len() && w.len() == x.len() && b.len() == x.len() && !x.is_empty(), "residual_layer_norm: shapes");
    match isa {
        // SAFETY: as in `softmax`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::residual_layer_norm_avx512(x, y, w, b, eps) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::residual_layer_norm_avx2(x, y, w, b, eps) },
        _ => residual_layer_norm_body(x, y, w, b, eps),
    }
}

/// `0.5·x·(1 + erf(x/√2))` in place (transformers' `gelu`).
pub fn gelu_erf(isa: Isa, row: &mut [f32]) {
    match isa {
        // SAFETY: as in `softmax`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::gelu_erf_table(row, erf_table()) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::gelu_erf_avx2(row) },
        _ => gelu_erf_body(row),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every ISA this CPU has, so the vectorized builds are each checked.
    fn isas() -> Vec<Isa> {
        Isa::available()
    }

    #[test]
    fn exp_is_within_a_few_ulps_of_f64() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 + 175.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let rel = ((exp(x) as f64 - want) / want).abs();
            worst = worst.max(rel);
        }
        assert!(worst < 4.0 * f32::EPSILON as f64, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) <= f32::MIN_POSITIVE && exp(-1000.0) >= 0.0);
        assert!(exp(f32::NEG_INFINITY) <= f32::MIN_POSITIVE);
    }

    #[test]
    fn erf_is_within_2e7_of_f64_everywhere() {
        for i in 0..=240_000 {
            let x = -6.0 + 12.0 * i as f32 / 240_000.0;
            let want = libm::erf(x as f64);
            assert!((erf(x) as f64 - want).abs() < 2e-7, "erf({x}) = {} vs {want}", erf(x));
        }
        assert_eq!(erf(0.0), 0.0);
        assert!(erf(-0.5) < 0.0);
    }

    #[test]
    fn softmax_matches_f64_on_every_isa_and_length() {
        for isa in isas() {
            for len in [1usize, 7, 16, 17, 100, 512] {
                let row: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.37).collect();
                let max = row.iter().copied().fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
                let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
                let total: f64 = e.iter().sum();
                let mut got = row.clone();
                softmax(isa, &mut got);
                for (g, w) in got.iter().zip(&e) {
                    let w = w / total;
                    assert!((*g as f64 - w).abs() <= 1e-6 * w.max(1e-3), "{isa:?} len {len}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn residual_layer_norm_matches_f64_on_every_isa() {
        for isa in isas() {
            for n in [1usize, 5, 16, 37, 384] {
                let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.037).collect();
                let mut y: Vec<f32> = (0..n).map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.05).collect();
                y[n / 2] += 28.0; // an outlier column, as MiniLM's
                let w: Vec<f32> = (0..n).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
                let b: Vec<f32> = (0..n).map(|i| (i % 5) as f32 * 0.01 - 0.02).collect();
                let s: Vec<f64> = x.iter().zip(&y).map(|(&a, &c)| a as f64 + c as f64).collect();
                let mean = s.iter().sum::<f64>() / n as f64;
                let var = s.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
                let mut got = x.clone();
                residual_layer_norm(isa, &mut got, &y, &w, &b, 1e-12);
                for i in 0..n {
                    let want = (s[i] - mean) / (var + 1e-12).sqrt() * w[i] as f64 + b[i] as f64;
                    assert!((got[i] as f64 - want).abs() < 2e-5 * (1.0 + want.abs()), "{isa:?} n {n} [{i}]: {} vs {want}", got[i]);
                }
            }
        }
    }

    #[test]
    fn gelu_matches_the_erf_definition_on_every_isa() {
        for isa in isas() {
            // A dense grid (every piece of the AVX-512 table, its edges included), a tail, and
            // values past the table's end.
            let row: Vec<f32> = (0..100_003).map(|i| -12.0 + 24.0 * i as f32 / 100_002.0).collect();
            let mut got = row.clone();
            gelu_erf(isa, &mut got);
            for (g, &x) in got.iter().zip(&row) {
                let want = 0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2));
                assert!((*g as f64 - want).abs() < 1e-6 * (1.0 + x.abs() as f64), "{isa:?} gelu({x}) = {g} vs {want}");
            }
        }
    }
}

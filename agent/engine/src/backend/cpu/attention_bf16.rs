//! The int8 encoder's attention for one (sequence, head) in bf16 with AVX-512 BF16 (`vdpbf16ps`,
//! two bf16 products summed into each f32 lane: twice the multiply-adds of an f32 FMA per
//! instruction), softmax fused between the two products.
//!
//! Why: from 128 tokens up, the f32 attention (`gemm` calls per head, then a softmax pass) was the
//! largest cost after the int8 GEMM (~18 % of a 128-token run, ~37 % at 512 tokens; the `gemm`
//! crate also packs both operands on every call, which for d = 32 costs about as much as the
//! products). Q, K and V come out of an int8 linear, whose error is far larger than bf16 rounding
//! (relative 2⁻⁹), so the int8 path loses nothing it had (docs/benchmarks.md, session 12). The f32
//! encoder keeps its f32 attention (1e-5 to the references).
//!
//! Layout (per task, in the caller's per-thread [`Scratch`]):
//! - K as bf16 pairs along the head dimension, transposed: `kp[p · jpad + j]` = (K[j, 2p],
//!   K[j, 2p+1]); one load gives 16 keys' pair p, so `S = Q·Kᵀ` broadcasts a query's pair p and
//!   accumulates 16 keys per register;
//! - V as bf16 pairs along the keys: `vp[jp · d + e]` = (V[2jp, e], V[2jp+1, e]); `P·V` broadcasts
//!   the probabilities of keys 2jp and 2jp+1 and accumulates 16 head columns per register;
//! - keys padded with zeros to a multiple of 32 (`jpad`): their scores are never read (the softmax
//!   stops at `len`) and their probabilities are 0.
//!
//! Queries go in blocks of [`MR`] rows: the block's scores (MR × jpad f32, 16 KiB at 512 keys) stay
//! in L1 from `Q·Kᵀ` through the softmax to `P·V`. Q is multiplied by `scale` before rounding; the
//! probabilities are left unnormalized (the largest is 1) and each context row is divided by its sum
//! at the end, in f32. Everything a task computes depends only on its own sequence and head.

/// Query rows per block (8 × 2 accumulators of 16 lanes in `Q·Kᵀ` and, at d = 32, in `P·V`).
const MR: usize = 8;

/// Per-thread buffers, grown as needed and kept across tasks (no page faults per task).
#[derive(Default)]
pub struct Scratch {
    kp: Vec<u32>,
    vp: Vec<u32>,
    qp: Vec<u32>,
    s: Vec<f32>,
    pp: Vec<u32>,
}

/// Whether [`head`] can run here for head dimension `d`: AVX-512F/BW with BF16, and d 32 or 64
/// (MiniLM's 32, BERT-base's 64; other sizes keep the f32 path).
pub fn available(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        (d == 32 || d == 64) && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        false
    }
}

/// Where one head's Q, K and V lie: rows of `stride` floats, the head's `d` columns at `q`, `k`
/// and `v` within each row (the fused q/k/v linear's output).
#[derive(Clone, Copy)]
pub struct HeadView {
    pub stride: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub d: usize,
}

/// `out` (len × d, row-major) = softmax(scale · Q·Kᵀ)·V for the `len` rows of `rows`.
///
/// Panics if [`available`] is false for `view.d`, or if the shapes do not fit.
pub fn head(rows: &[f32], len: usize, view: HeadView, scale: f32, scratch: &mut Scratch, out: &mut [f32]) {
    let d = view.d;
    assert!(available(d), "attention_bf16: not available for d = {d}");
    assert!(
        view.q + d <= view.stride && view.k + d <= view.stride && view.v + d <= view.stride && rows.len() >= len * view.stride && out.len() >= len * d,
        "attention_bf16: shapes"
    );
    if len == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the features are present (checked by `available` above); shapes checked above.
    unsafe {
        if d == 32 {
            x86::head::<2>(rows, len, view, scale, scratch, out)
        } else {
            x86::head::<4>(rows, len, view, scale, scratch, out)
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{HeadView, Scratch, MR};
    use crate::backend::cpu::vmath;

    /// 32 f32 → 32 bf16 (round to nearest even) in order: pair k of the result (as u32 lanes) is
    /// (x[2k], x[2k+1]).
    #[inline(always)]
    unsafe fn bf16x32(p: *const f32, scale: __m512) -> __m512i {
        // SAFETY: the caller gives 32 readable floats.
        unsafe {
            let lo = _mm512_mul_ps(_mm512_loadu_ps(p), scale);
            let hi = _mm512_mul_ps(_mm512_loadu_ps(p.add(16)), scale);
            // The second operand fills the low half.
            std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo))
        }
    }

    #[inline(always)]
    fn bh(x: __m512i) -> __m512bh {
        // SAFETY: both are 64 bytes of plain bits.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
    }

    /// DV: d / 16 (2 or 4).
    ///
    /// # Safety
    /// AVX-512F/BW/BF16 present; shapes as checked by [`super::head`].
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn head<const DV: usize>(rows: &[f32], len: usize, view: HeadView, scale: f32, sc: &mut Scratch, out: &mut [f32]) {
        let d = 16 * DV;
        let pairs = d / 2;
        let jpad = len.div_ceil(32) * 32;
        let vpairs = len.div_ceil(2);
        let one = _mm512_set1_ps(1.0);
        let zero = _mm512_setzero_ps();

        // K: kp[p · jpad + j] = (K[j, 2p], K[j, 2p + 1]).
        sc.kp.clear();
        sc.kp.resize(pairs * jpad, 0);
        let mut tmp = [0u32; 16];
        for j in 0..len {
            for c in 0..d / 32 {
                // SAFETY: row j's K columns k..k+d lie inside `rows` (checked by the caller).
                let v = unsafe { bf16x32(rows.as_ptr().add(j * view.stride + view.k + 32 * c), one) };
                // SAFETY: 16 u32 into a 16-element array.
                unsafe { _mm512_storeu_si512(tmp.as_mut_ptr() as *mut __m512i, v) };
                for (p, &t) in tmp.iter().enumerate() {
                    sc.kp[(16 * c + p) * jpad + j] = t;
                }
            }
        }

        // V: vp[jp · d + e] = (V[2jp, e], V[2jp + 1, e]); a missing odd key reads as zeros.
        sc.vp.clear();
        sc.vp.resize(vpairs * d, 0);
        // Interleaves [a0..a15, b0..b15] (bf16) into [a0, b0, a1, b1, ...].
        let mut idx = [0u16; 32];
        for (k, i) in idx.iter_mut().enumerate() {
            *i = if k % 2 == 0 { (k / 2) as u16 } else { 16 + (k / 2) as u16 };
        }
        // SAFETY: 32 u16 = 64 bytes.
        let idx = unsafe { _mm512_loadu_si512(idx.as_ptr() as *const __m512i) };
        for jp in 0..vpairs {
            for c in 0..DV {
                // SAFETY: rows 2jp (< len) and 2jp + 1 (when < len) hold V at v..v+d; vp has
                // vpairs · d u32.
                unsafe {
                    let a = _mm512_loadu_ps(rows.as_ptr().add(2 * jp * view.stride + view.v + 16 * c));
                    let b = if 2 * jp + 1 < len { _mm512_loadu_ps(rows.as_ptr().add((2 * jp + 1) * view.stride + view.v + 16 * c)) } else { zero };
                    let ab = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(b, a));
                    _mm512_storeu_si512(sc.vp.as_mut_ptr().add(jp * d + 16 * c) as *mut __m512i, _mm512_permutexvar_epi16(idx, ab));
                }
            }
        }

        sc.qp.clear();
        sc.qp.resize(MR * pairs, 0);
        sc.s.clear();
        sc.s.resize(MR * jpad, 0.0);
        sc.pp.clear();
        sc.pp.resize(MR * jpad / 2, 0);
        let vscale = _mm512_set1_ps(scale);
        let mut sums = [0f32; MR];
        let mut i0 = 0;
        while i0 < len {
            let m = (len - i0).min(MR);
            // Q rows of the block, scaled, as bf16 pairs (rows past `len` stay zero from before or
            // are cleared here: their results are never written).
            for r in 0..MR {
                for c in 0..d / 32 {
                    let dst = &mut sc.qp[r * pairs + 16 * c..r * pairs + 16 * c + 16];
                    if r < m {
                        // SAFETY: row i0 + r < len; 16 u32 into a 16-element slice.
                        unsafe {
                            let v = bf16x32(rows.as_ptr().add((i0 + r) * view.stride + view.q + 32 * c), vscale);
                            _mm512_storeu_si512(dst.as_mut_ptr() as *mut __m512i, v);
                        }
                    } else {
                        dst.fill(0);
                    }
                }
            }
            // S = Q·Kᵀ, 32 keys at a time.
            for kb in (0..jpad).step_by(32) {
                let mut acc = [[zero; 2]; MR];
                for p in 0..pairs {
                    // SAFETY: kp holds pairs × jpad, kb + 32 ≤ jpad; qp holds MR × pairs.
                    unsafe {
                        let k0 = _mm512_loadu_si512(sc.kp.as_ptr().add(p * jpad + kb) as *const __m512i);
                        let k1 = _mm512_loadu_si512(sc.kp.as_ptr().add(p * jpad + kb + 16) as *const __m512i);
                        for (r, a) in acc.iter_mut().enumerate() {
                            let q = bh(_mm512_set1_epi32(*sc.qp.get_unchecked(r * pairs + p) as i32));
                            a[0] = _mm512_dpbf16_ps(a[0], q, bh(k0));
                            a[1] = _mm512_dpbf16_ps(a[1], q, bh(k1));
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    // SAFETY: s holds MR × jpad.
                    unsafe {
                        _mm512_storeu_ps(sc.s.as_mut_ptr().add(r * jpad + kb), a[0]);
                        _mm512_storeu_ps(sc.s.as_mut_ptr().add(r * jpad + kb + 16), a[1]);
                    }
                }
            }
            // Softmax numerators over the real keys (padding set to 0), their sums, and the
            // probabilities as bf16 pairs.
            for (r, sum) in sums.iter_mut().enumerate().take(m) {
                let row = &mut sc.s[r * jpad..(r + 1) * jpad];
                let (real, pad) = row.split_at_mut(len);
                let mut lane_max = [f32::NEG_INFINITY; 16];
                let mut chunks = real.chunks_exact(16);
                for c in &mut chunks {
                    for (mx, &v) in lane_max.iter_mut().zip(c) {
                        *mx = if v > *mx { v } else { *mx };
                    }
                }
                let mut max = f32::NEG_INFINITY;
                for &v in lane_max.iter().chain(chunks.remainder()) {
                    max = if v > max { v } else { max };
                }
                for v in real.iter_mut() {
                    *v = vmath::exp(*v - max);
                }
                pad.fill(0.0);
                let mut lane_sum = [0f32; 16];
                let mut chunks = real.chunks_exact(16);
                for c in &mut chunks {
                    for (s, &v) in lane_sum.iter_mut().zip(c) {
                        *s += v;
                    }
                }
                *sum = lane_sum.iter().chain(chunks.remainder()).sum();
                for jb in (0..jpad).step_by(32) {
                    // SAFETY: s row has jpad floats; pp row has jpad / 2 u32.
                    unsafe {
                        let v = bf16x32(sc.s.as_ptr().add(r * jpad + jb), one);
                        _mm512_storeu_si512(sc.pp.as_mut_ptr().add(r * jpad / 2 + jb / 2) as *mut __m512i, v);
                    }
                }
            }
            // ctx = P·V / sum, over the key pairs holding real keys.
            // SAFETY: passed on; rows i0..i0 + m of `out` hold d floats each.
            unsafe {
                if DV == 2 {
                    pv::<MR, DV>(sc, 0, vpairs, jpad, m, &sums, out.as_mut_ptr().add(i0 * d));
                } else {
                    pv::<4, DV>(sc, 0, vpairs, jpad, m.min(4), &sums, out.as_mut_ptr().add(i0 * d));
                    if m > 4 {
                        pv::<4, DV>(sc, 4, vpairs, jpad, m - 4, &sums[4..], out.as_mut_ptr().add((i0 + 4) * d));
                    }
                }
            }
            i0 += m;
        }
    }

    /// Rows `r0..r0 + R` of the block's probabilities times V; the first `m` rows written to `out`
    /// (row-major, d = 16 · DV), each divided by its `sums` entry.
    ///
    /// # Safety
    /// As [`head`]; `out` has m · d writable floats.
    #[inline(always)]
    unsafe fn pv<const R: usize, const DV: usize>(sc: &Scratch, r0: usize, vpairs: usize, jpad: usize, m: usize, sums: &[f32], out: *mut f32) {
        let d = 16 * DV;
        let mut acc = [[_mm512_setzero_ps(); DV]; R];
        let half = jpad / 2;
        for jp in 0..vpairs {
            // SAFETY: vp holds vpairs · d u32, pp holds MR rows of jpad / 2 (r0 + R ≤ MR).
            unsafe {
                let mut v = [_mm512_setzero_si512(); DV];
                for (c, v) in v.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(sc.vp.as_ptr().add(jp * d + 16 * c) as *const __m512i);
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let p = bh(_mm512_set1_epi32(*sc.pp.get_unchecked((r0 + r) * half + jp) as i32));
                    for c in 0..DV {
                        a[c] = _mm512_dpbf16_ps(a[c], p, bh(v[c]));
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate().take(m) {
            let inv = _mm512_set1_ps(1.0 / sums[r]);
            for (c, &a) in a.iter().enumerate() {
                // SAFETY: row r < m of out, columns 16c..16c + 16 < d.
                unsafe { _mm512_storeu_ps(out.add(r * d + 16 * c), _mm512_mul_ps(a, inv)) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// softmax(scale · Q·Kᵀ)·V in f64.
    fn reference(rows: &[f32], len: usize, view: HeadView, scale: f32) -> Vec<f64> {
        let d = view.d;
        let mut out = vec![0f64; len * d];
        for i in 0..len {
            let s: Vec<f64> = (0..len)
                .map(|j| (0..d).map(|e| rows[i * view.stride + view.q + e] as f64 * rows[j * view.stride + view.k + e] as f64).sum::<f64>() * scale as f64)
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for (j, w) in e.iter().enumerate() {
                for c in 0..d {
                    out[i * d + c] += w / total * rows[j * view.stride + view.v + c] as f64;
                }
            }
        }
        out
    }

    #[test]
    fn matches_f64_attention_within_bf16_rounding() {
        for d in [32usize, 64] {
            if !available(d) {
                eprintln!("no AVX-512 BF16 here: skipped");
                return;
            }
            // Odd lengths, one key, one MR block exactly, tails of keys and of query blocks.
            for len in [1usize, 2, 3, 8, 17, 33, 100, 129] {
                let stride = 3 * 2 * d + 5; // two heads of q/k/v and some slack, as in a fused row
                let view = HeadView { stride, q: d, k: 2 * d + d, v: 4 * d + d, d };
                let rows: Vec<f32> = (0..len * stride).map(|i| ((i * 7919 % 2003) as f32 / 1001.5 - 1.0) * 2.0).collect();
                let scale = 1.0 / (d as f32).sqrt();
                let want = reference(&rows, len, view, scale);
                let mut out = vec![f32::NAN; len * d];
                let mut sc = Scratch::default();
                head(&rows, len, view, scale, &mut sc, &mut out);
                let mut worst = 0f64;
                for (g, w) in out.iter().zip(&want) {
                    worst = worst.max((*g as f64 - w).abs());
                }
                // Values are within ±2: bf16's relative 2⁻⁹ on Q, K, V and the probabilities.
                assert!(worst < 0.03, "d {d} len {len}: max |Δ| {worst}");
                // Scratch reused by a shorter task gives the same as a fresh one.
                let mut again = vec![0f32; len * d];
                head(&rows, len, view, scale, &mut sc, &mut again);
                assert_eq!(out, again, "d {d} len {len}: scratch reuse");
            }
        }
    }
}

//! The int8 encoder's attention for one (sequence, head) with AVX-512 VNNI (`vpdpbusd`: 64 byte
//! products per instruction, 4× an f32 FMA's), softmax fused between the two products.
//!
//! Why: from 128 tokens up the f32 attention (a `gemm` call per product and head, then a softmax
//! pass) was the largest cost after the int8 linears (~18 % of a 128-token run, ~37 % at 512). A bf16
//! version (`vdpbf16ps`) was tried first and was slower: on this CPU that instruction has half an
//! FMA's throughput, so it does no more multiply-adds per cycle than f32 (docs/benchmarks.md,
//! session 12). Q, K and V come out of an int8 linear already; the int8 path's fidelity bounds
//! (cosine ≥ 0.996 to the references) are checked by `tests/encoder_minilm.rs`. The f32 encoder
//! keeps its f32 attention (1e-5).
//!
//! The quantization (as in SageAttention, Zhang et al. 2024):
//! - K minus its mean over the sequence's keys (softmax is unchanged: it subtracts the same
//!   `q·mean` from every score of a query), then per key symmetric int8 (max |k| → 127); Q per query
//!   the same, stored + 128 as unsigned bytes (`vpdpbusd` multiplies unsigned by signed), the kernel
//!   subtracting `128 · Σ_e k_e` per key;
//! - the probabilities unnormalized (the row's largest is exactly 1) as unsigned bytes `round(255·p)`,
//!   V per head column symmetric int8 (max over the sequence's keys → 127); each context row is
//!   divided by the sum of its quantized probabilities, so the weights used sum to exactly 1.
//! - `exp` as `2^t` with a degree-4 polynomial (relative error < 4e-5, far below the probabilities'
//!   step of 1/255).
//!
//! Layout (per task, in the caller's per-thread [`Scratch`], u32 = four bytes one lane sums):
//! `kq[quad · jpad + j]` = K[j, 4quad..4quad+4]: one load gives 16 keys' quad, and a query's quad is
//! broadcast; `vq[jq · d + e]` = V[4jq..4jq+4, e]: one load gives 16 head columns of four keys, and
//! the query's four probabilities are broadcast. Keys are padded with zeros to a multiple of 32
//! (`jpad`); their probabilities are 0. Queries go in blocks of [`MR`]: a block's scores (MR × jpad
//! f32, 16 KiB at 512 keys) stay in L1 from `Q·Kᵀ` through the softmax to `P·V`. A task reads only
//! its own sequence and head, so results do not depend on the batch.

/// Query rows per block (8 × 2 accumulators in `Q·Kᵀ`, 8 × 2 or 4 × 4 in `P·V`).
const MR: usize = 8;

/// Per-thread buffers, grown as needed and kept across tasks.
#[derive(Default)]
pub struct Scratch {
    kq: Vec<u32>,
    koff: Vec<i32>,
    ks: Vec<f32>,
    vq: Vec<u32>,
    qq: Vec<u32>,
    s: Vec<f32>,
    pq: Vec<u8>,
}

/// Whether [`head`] can run here for head dimension `d`: AVX-512F/BW/VNNI, and d 32 or 64
/// (MiniLM's 32, BERT-base's 64; other sizes keep the f32 path).
pub fn available(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        (d == 32 || d == 64) && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vnni")
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
    assert!(available(d), "attention_int8: not available for d = {d}");
    assert!(
        view.q + d <= view.stride && view.k + d <= view.stride && view.v + d <= view.stride && rows.len() >= len * view.stride && out.len() >= len * d,
        "attention_int8: shapes"
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

    /// 16 f32 → 16 i32 codes `round(x · inv)` (nearest even), clamped to ±127.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    fn codes(x: __m512, inv: __m512) -> __m512i {
        let c = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
        _mm512_max_epi32(_mm512_min_epi32(c, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127))
    }

    /// One row of d = 16·DV floats (minus `sub`) quantized per row: the codes as DV vectors of
    /// i32 and the scale (0 for a row of zeros).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn quantize_row<const DV: usize>(p: *const f32, sub: &[__m512; DV]) -> ([__m512i; DV], f32) {
        let mut x = [_mm512_setzero_ps(); DV];
        let mut m = _mm512_setzero_ps();
        for c in 0..DV {
            // SAFETY: the caller gives d readable floats.
            x[c] = _mm512_sub_ps(unsafe { _mm512_loadu_ps(p.add(16 * c)) }, sub[c]);
            m = _mm512_max_ps(m, _mm512_abs_ps(x[c]));
        }
        let amax = _mm512_reduce_max_ps(m);
        let (scale, inv) = if amax > 0.0 && amax.is_finite() { (amax / 127.0, 127.0 / amax) } else { (0.0, 0.0) };
        let vinv = _mm512_set1_ps(inv);
        let mut q = [_mm512_setzero_si512(); DV];
        for c in 0..DV {
            q[c] = codes(x[c], vinv);
        }
        (q, scale)
    }

    /// DV: d / 16 (2 or 4).
    ///
    /// # Safety
    /// AVX-512F/BW/VNNI present; shapes as checked by [`super::head`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn head<const DV: usize>(rows: &[f32], len: usize, view: HeadView, scale: f32, sc: &mut Scratch, out: &mut [f32]) {
        let d = 16 * DV;
        let quads = d / 4;
        let jpad = len.div_ceil(32) * 32;
        let vquads = len.div_ceil(4);
        let zero = _mm512_setzero_ps();
        let base = rows.as_ptr();
        let mut tmp = [0u32; 16];

        // K: mean over the keys, then kq / koff / ks.
        let mut mean = [zero; DV];
        for j in 0..len {
            for (c, m) in mean.iter_mut().enumerate() {
                // SAFETY: row j < len, columns k..k + d (checked by the caller).
                *m = _mm512_add_ps(*m, unsafe { _mm512_loadu_ps(base.add(j * view.stride + view.k + 16 * c)) });
            }
        }
        let inv_len = _mm512_set1_ps(1.0 / len as f32);
        for m in mean.iter_mut() {
            *m = _mm512_mul_ps(*m, inv_len);
        }
        sc.kq.clear();
        sc.kq.resize(quads * jpad, 0);
        sc.koff.clear();
        sc.koff.resize(jpad, 0);
        sc.ks.clear();
        sc.ks.resize(jpad, 0.0);
        for j in 0..len {
            // SAFETY: as above.
            let (q, s) = unsafe { quantize_row::<DV>(base.add(j * view.stride + view.k), &mean) };
            let mut sum = _mm512_setzero_si512();
            for (c, q) in q.iter().enumerate() {
                sum = _mm512_add_epi32(sum, *q);
                // SAFETY: 16 bytes into the 64-byte `tmp`, at 16c < 64.
                unsafe { _mm_storeu_si128((tmp.as_mut_ptr() as *mut u8).add(16 * c) as *mut __m128i, _mm512_cvtepi32_epi8(*q)) };
            }
            for (quad, &t) in tmp.iter().take(quads).enumerate() {
                sc.kq[quad * jpad + j] = t;
            }
            sc.koff[j] = 128 * _mm512_reduce_add_epi32(sum);
            sc.ks[j] = s;
        }

        // V: per column scale over the keys, then vq (four keys' bytes per u32).
        let mut vmax = [zero; DV];
        for j in 0..len {
            for (c, m) in vmax.iter_mut().enumerate() {
                // SAFETY: row j < len, columns v..v + d.
                *m = _mm512_max_ps(*m, _mm512_abs_ps(unsafe { _mm512_loadu_ps(base.add(j * view.stride + view.v + 16 * c)) }));
            }
        }
        let mut vinv = [zero; DV];
        let mut vscale = [zero; DV];
        for c in 0..DV {
            // Columns of zeros: scale 0, codes 0.
            let nz = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(vmax[c], zero);
            vinv[c] = _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.0), vmax[c]);
            vscale[c] = _mm512_maskz_mul_ps(nz, vmax[c], _mm512_set1_ps(1.0 / 127.0));
        }
        sc.vq.clear();
        sc.vq.resize(vquads * d, 0);
        let bytes = _mm512_set1_epi32(0xFF);
        for jq in 0..vquads {
            for (c, &vinv) in vinv.iter().enumerate() {
                let mut word = _mm512_setzero_si512();
                for b in 0..4 {
                    let j = 4 * jq + b;
                    if j < len {
                        // SAFETY: row j < len, columns v..v + d.
                        let x = unsafe { _mm512_loadu_ps(base.add(j * view.stride + view.v + 16 * c)) };
                        let q = _mm512_and_si512(codes(x, vinv), bytes);
                        word = _mm512_or_si512(word, _mm512_sllv_epi32(q, _mm512_set1_epi32(8 * b as i32)));
                    }
                }
                // SAFETY: vq holds vquads · d u32.
                unsafe { _mm512_storeu_si512(sc.vq.as_mut_ptr().add(jq * d + 16 * c) as *mut __m512i, word) };
            }
        }

        sc.qq.clear();
        sc.qq.resize(MR * quads, 0x8080_8080);
        sc.s.clear();
        sc.s.resize(MR * jpad, 0.0);
        sc.pq.clear();
        sc.pq.resize(MR * jpad, 0);
        // Scores in base-2 units: t = log2(e) · scale · q·k, so that p = 2^(t − max).
        let log2e_scale = std::f32::consts::LOG2_E * scale;
        let mut row_c = [0f32; MR];
        let mut sums = [0f32; MR];
        let no_sub = [zero; DV];
        let off128 = _mm512_set1_epi32(128);
        let mut i0 = 0;
        while i0 < len {
            let m = (len - i0).min(MR);
            // Q rows of the block as unsigned bytes (+128); rows past `len` code 0 (their results
            // are never written).
            for (r, rc) in row_c.iter_mut().enumerate() {
                if r < m {
                    // SAFETY: row i0 + r < len, columns q..q + d.
                    let (q, s) = unsafe { quantize_row::<DV>(base.add((i0 + r) * view.stride + view.q), &no_sub) };
                    for (c, q) in q.iter().enumerate() {
                        // SAFETY: 16 bytes into `tmp` at 16c < 64.
                        unsafe { _mm_storeu_si128((tmp.as_mut_ptr() as *mut u8).add(16 * c) as *mut __m128i, _mm512_cvtepi32_epi8(_mm512_add_epi32(*q, off128))) };
                    }
                    sc.qq[r * quads..(r + 1) * quads].copy_from_slice(&tmp[..quads]);
                    *rc = s * log2e_scale;
                } else {
                    sc.qq[r * quads..(r + 1) * quads].fill(0x8080_8080);
                    *rc = 0.0;
                }
            }
            // S = Q·Kᵀ, 32 keys at a time, in base-2 units.
            for kb in (0..jpad).step_by(32) {
                let mut acc = [[_mm512_setzero_si512(); 2]; MR];
                for quad in 0..quads {
                    // SAFETY: kq holds quads × jpad, kb + 32 ≤ jpad; qq holds MR × quads.
                    unsafe {
                        let k0 = _mm512_loadu_si512(sc.kq.as_ptr().add(quad * jpad + kb) as *const __m512i);
                        let k1 = _mm512_loadu_si512(sc.kq.as_ptr().add(quad * jpad + kb + 16) as *const __m512i);
                        for (r, a) in acc.iter_mut().enumerate() {
                            let q = _mm512_set1_epi32(*sc.qq.get_unchecked(r * quads + quad) as i32);
                            a[0] = _mm512_dpbusd_epi32(a[0], q, k0);
                            a[1] = _mm512_dpbusd_epi32(a[1], q, k1);
                        }
                    }
                }
                for n in 0..2 {
                    let j = kb + 16 * n;
                    // SAFETY: koff / ks hold jpad; s holds MR × jpad.
                    unsafe {
                        let off = _mm512_loadu_si512(sc.koff.as_ptr().add(j) as *const __m512i);
                        let ks = _mm512_loadu_ps(sc.ks.as_ptr().add(j));
                        for (r, a) in acc.iter().enumerate() {
                            let dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(a[n], off));
                            let t = _mm512_mul_ps(_mm512_mul_ps(dot, ks), _mm512_set1_ps(row_c[r]));
                            _mm512_storeu_ps(sc.s.as_mut_ptr().add(r * jpad + j), t);
                        }
                    }
                }
            }
            // Softmax numerators as bytes round(255 · 2^(t − max)), padding 0, and their sums.
            for (r, sum) in sums.iter_mut().enumerate().take(m) {
                // SAFETY: s row r holds jpad floats, pq row r jpad bytes.
                unsafe { *sum = probabilities(sc.s.as_ptr().add(r * jpad), len, jpad, sc.pq.as_mut_ptr().add(r * jpad)) };
            }
            // ctx = P·V / sum, over the key quads holding real keys.
            // SAFETY: passed on; rows i0..i0 + m of `out` hold d floats each.
            unsafe {
                if DV == 2 {
                    pv::<MR, DV>(sc, 0, vquads, jpad, m, &sums, &vscale, out.as_mut_ptr().add(i0 * d));
                } else {
                    pv::<4, DV>(sc, 0, vquads, jpad, m.min(4), &sums, &vscale, out.as_mut_ptr().add(i0 * d));
                    if m > 4 {
                        pv::<4, DV>(sc, 4, vquads, jpad, m - 4, &sums[4..], &vscale, out.as_mut_ptr().add((i0 + 4) * d));
                    }
                }
            }
            i0 += m;
        }
    }

    /// One row of base-2 scores `t` (jpad, the first `len` real) → `pq` bytes `round(255 · 2^(t −
    /// max))` (0 past `len`); returns their sum.
    ///
    /// # Safety
    /// `t` readable and `pq` writable for jpad (a multiple of 16) elements; AVX-512F/BW.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    unsafe fn probabilities(t: *const f32, len: usize, jpad: usize, pq: *mut u8) -> f32 {
        let live = |j: usize| -> __mmask16 {
            let n = len.saturating_sub(j).min(16);
            if n == 16 { 0xFFFF } else { ((1u32 << n) - 1) as __mmask16 }
        };
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for j in (0..len).step_by(16) {
            // SAFETY: j < len ≤ jpad.
            m = _mm512_mask_max_ps(m, live(j), m, unsafe { _mm512_loadu_ps(t.add(j)) });
        }
        let max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        // 255 · 2^f for f in [−½, ½]: Taylor to degree 4 (relative error < 4e-5).
        const L: f32 = std::f32::consts::LN_2;
        let c = [255.0, 255.0 * L, 255.0 * L * L / 2.0, 255.0 * L * L * L / 6.0, 255.0 * L * L * L * L / 24.0].map(|v| _mm512_set1_ps(v));
        // Below 2^−10 of the max a probability rounds to 0 of 255 anyway.
        let floor = _mm512_set1_ps(-10.0);
        let mut sum = _mm512_setzero_si512();
        for j in (0..jpad).step_by(16) {
            // SAFETY: j + 16 ≤ jpad.
            let x = _mm512_max_ps(_mm512_sub_ps(unsafe { _mm512_loadu_ps(t.add(j)) }, max), floor);
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
            let f = _mm512_sub_ps(x, n);
            let mut p = c[4];
            p = _mm512_fmadd_ps(p, f, c[3]);
            p = _mm512_fmadd_ps(p, f, c[2]);
            p = _mm512_fmadd_ps(p, f, c[1]);
            p = _mm512_fmadd_ps(p, f, c[0]);
            let y = _mm512_scalef_ps(p, n);
            let q = _mm512_maskz_cvtps_epi32(live(j), y);
            sum = _mm512_add_epi32(sum, q);
            // SAFETY: 16 bytes at j + 16 ≤ jpad.
            unsafe { _mm_storeu_si128(pq.add(j) as *mut __m128i, _mm512_cvtepi32_epi8(q)) };
        }
        _mm512_reduce_add_epi32(sum) as f32
    }

    /// Rows `r0..r0 + R` of the block's probabilities times V; the first `m` rows written to `out`
    /// (row-major, d = 16 · DV), each scaled by V's column scales and divided by its `sums` entry.
    ///
    /// # Safety
    /// As [`head`]; `out` has m · d writable floats.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn pv<const R: usize, const DV: usize>(sc: &Scratch, r0: usize, vquads: usize, jpad: usize, m: usize, sums: &[f32], vscale: &[__m512; DV], out: *mut f32) {
        let d = 16 * DV;
        let mut acc = [[_mm512_setzero_si512(); DV]; R];
        for jq in 0..vquads {
            // SAFETY: vq holds vquads · d u32; pq holds MR rows of jpad bytes (r0 + R ≤ MR, 4jq + 4
            // ≤ jpad).
            unsafe {
                let mut v = [_mm512_setzero_si512(); DV];
                for (c, v) in v.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(sc.vq.as_ptr().add(jq * d + 16 * c) as *const __m512i);
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let p = _mm512_set1_epi32((sc.pq.as_ptr().add((r0 + r) * jpad + 4 * jq) as *const i32).read_unaligned());
                    for c in 0..DV {
                        a[c] = _mm512_dpbusd_epi32(a[c], p, v[c]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate().take(m) {
            // The row's largest probability is 255 codes: the sum is never 0.
            let inv = _mm512_set1_ps(1.0 / sums[r]);
            for (c, &a) in a.iter().enumerate() {
                let o = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), vscale[c]), inv);
                // SAFETY: row r < m of out, columns 16c..16c + 16 ≤ d.
                unsafe { _mm512_storeu_ps(out.add(r * d + 16 * c), o) };
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
    fn matches_f64_attention_within_int8_rounding() {
        for d in [32usize, 64] {
            if !available(d) {
                eprintln!("no AVX-512 VNNI here: skipped");
                return;
            }
            // Odd lengths, one key, exactly one query block, tails of keys and of query blocks.
            for len in [1usize, 2, 3, 5, 8, 17, 33, 100, 129] {
                let stride = 3 * 2 * d + 5; // two heads of q/k/v and some slack, as in a fused row
                let view = HeadView { stride, q: d, k: 2 * d + d, v: 4 * d + d, d };
                let mut rows: Vec<f32> = (0..len * stride).map(|i| ((i * 7919 % 2003) as f32 / 1001.5 - 1.0) * 2.0).collect();
                // A key bias shared by all keys (what the mean subtraction is for) and a zero V column.
                for j in 0..len {
                    rows[j * stride + view.k] += 3.0;
                    rows[j * stride + view.v + 1] = 0.0;
                }
                let scale = 1.0 / (d as f32).sqrt();
                let want = reference(&rows, len, view, scale);
                let mut out = vec![f32::NAN; len * d];
                let mut sc = Scratch::default();
                head(&rows, len, view, scale, &mut sc, &mut out);
                let (mut worst, mut sq) = (0f64, 0f64);
                for (g, w) in out.iter().zip(&want) {
                    worst = worst.max((*g as f64 - w).abs());
                    sq += (*g as f64 - w).powi(2);
                }
                let rms = (sq / out.len() as f64).sqrt();
                // Values within ±2: steps of 2/127 on Q, K and V and 1/255 on the probabilities.
                assert!(worst < 0.06 && rms < 0.015, "d {d} len {len}: max |Δ| {worst}, rms {rms}");
                assert!(out.iter().skip(1).step_by(d).all(|&v| v == 0.0), "a zero V column stays 0");
                // Scratch reused (after a longer task) gives the same as a fresh one.
                let mut again = vec![0f32; len * d];
                head(&rows, len, view, scale, &mut sc, &mut again);
                assert_eq!(out, again, "d {d} len {len}: scratch reuse");
            }
        }
    }
}

//! `out[t, r] = Σ_k x[t, k] · W[r, k]` for f32 activations and f32 or quantized weights.
//!
//! Work is split over tiles of weight rows (one rayon task each). A task dequantizes its rows to
//! f32 once (the same values `quant` produces), then runs a register-blocked dot-product kernel over
//! tiles of tokens × rows. Every output is reduced in the same order whatever the batch holds:
//! 16 lane accumulators walk `k` in steps of 16 (a zero-padded tail), then a fixed horizontal sum.
//! So a row's result never depends on what else is in the batch, nor on how tokens are tiled.

// Kernels index fixed-size register tiles on purpose; iterator chains hide the unrolling.
#![allow(clippy::needless_range_loop)]

use rayon::prelude::*;

use super::simd::Isa;
use crate::model::{Matrix, MatrixData};

/// Weight rows per task: small enough that the dequantized rows stay in L1/L2, large enough to
/// amortise the task.
pub(super) const ROW_TILE: usize = 16;
/// Microkernel shape: tokens × rows, 16 accumulators of 16 lanes.
const MT: usize = 4;
const MR: usize = 4;

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: each task writes only the columns of its own row tile (disjoint elements).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `x` is `n × w.cols`, `out` is `n × w.rows`, both row-major. Runs on the current rayon pool.
pub fn matmul(isa: Isa, x: &[f32], n: usize, w: &Matrix, out: &mut [f32]) {
    let (rows, k) = (w.rows, w.cols);
    assert_eq!(x.len(), n * k, "matmul: x is not n × cols");
    assert_eq!(out.len(), n * rows, "matmul: out is not n × rows");
    if n == 0 || rows == 0 {
        return;
    }
    if let MatrixData::RowQuant(q) = &w.data {
        return super::matmul_w8a8::matmul(isa, x, n, q, out);
    }
    let ptr = OutPtr(out.as_mut_ptr());
    let tiles = rows.div_ceil(ROW_TILE);
    (0..tiles)
        .into_par_iter()
        .for_each_init(Vec::new, |scratch: &mut Vec<f32>, tile| {
            let r0 = tile * ROW_TILE;
            let nr = ROW_TILE.min(rows - r0);
            #[cfg(target_arch = "x86_64")]
            if let (Isa::Avx512, MatrixData::Quant(q)) = (isa, &w.data) {
                let p = ptr;
                // SAFETY: as below; AVX-512F/BW were detected at run time.
                unsafe {
                    let out = std::slice::from_raw_parts_mut(p.0, n * rows);
                    avx512::quant_tile(x, n, q, r0, nr, out, rows, scratch);
                }
                return;
            }
            #[cfg(target_arch = "x86_64")]
            if let (Isa::Avx2, MatrixData::Quant(q)) = (isa, &w.data) {
                let p = ptr;
                // SAFETY: as below; AVX2 and FMA were detected at run time.
                unsafe {
                    let out = std::slice::from_raw_parts_mut(p.0, n * rows);
                    super::matmul_avx2::quant_tile(x, n, q, r0, nr, out, rows, scratch, ROW_TILE);
                }
                return;
            }
            let wrows: &[f32] = match &w.data {
                MatrixData::F32(v) => &v[r0 * k..(r0 + nr) * k],
                // Row-quantized matrices took their own path above.
                MatrixData::Quant(_) | MatrixData::RowQuant(_) => {
                    scratch.resize(ROW_TILE * k, 0.0);
                    dequantize_rows(isa, w, r0, nr, scratch);
                    &scratch[..nr * k]
                }
            };
            let p = ptr;
            // SAFETY: rows r0..r0+nr of every token belong to this task alone; `out` outlives the
            // parallel loop.
            let out = unsafe { std::slice::from_raw_parts_mut(p.0, n * rows) };
            tile_kernel(isa, x, n, k, wrows, nr, out, rows, r0);
        });
}

fn dequantize_rows(isa: Isa, w: &Matrix, r0: usize, nr: usize, scratch: &mut [f32]) {
    #[inline(always)]
    fn body(w: &Matrix, r0: usize, nr: usize, scratch: &mut [f32]) {
        let k = w.cols;
        for i in 0..nr {
            w.row_into(r0 + i, &mut scratch[i * k..(i + 1) * k]);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
        unsafe fn avx512(w: &Matrix, r0: usize, nr: usize, scratch: &mut [f32]) {
            body(w, r0, nr, scratch)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2(w: &Matrix, r0: usize, nr: usize, scratch: &mut [f32]) {
            body(w, r0, nr, scratch)
        }
        match isa {
            // SAFETY: `isa` was detected at run time.
            Isa::Avx512 => return unsafe { avx512(w, r0, nr, scratch) },
            Isa::Avx2 => return unsafe { avx2(w, r0, nr, scratch) },
            Isa::Generic => {}
        }
    }
    body(w, r0, nr, scratch)
}

/// All tokens × one tile of `nr` weight rows (`w` holds those rows, `nr × k`).
#[allow(clippy::too_many_arguments)]
pub(super) fn tile_kernel(
    isa: Isa,
    x: &[f32],
    n: usize,
    k: usize,
    w: &[f32],
    nr: usize,
    out: &mut [f32],
    ld_out: usize,
    r0: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: AVX-512F was detected at run time; slices are sized as asserted in `matmul`.
        unsafe { avx512::tile(x, n, k, w, nr, out, ld_out, r0) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: AVX2 and FMA were detected at run time; slices are sized as asserted in `matmul`.
        unsafe { super::matmul_avx2::tile(x, n, k, w, nr, out, ld_out, r0) };
        return;
    }
    let _ = isa;
    portable::tile::<false>(x, n, k, w, nr, out, ld_out, r0)
}

/// Plain Rust kernel, written so the compiler vectorizes it (16-lane arrays).
mod portable {
    use super::{MR, MT};

    #[inline(always)]
    fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
        if FMA {
            a.mul_add(b, c)
        } else {
            c + a * b
        }
    }

    /// Fixed pairwise horizontal sum of 16 lanes.
    #[inline(always)]
    pub fn hsum16(v: &[f32; 16]) -> f32 {
        let mut a = [0f32; 8];
        for i in 0..8 {
            a[i] = v[i] + v[i + 8];
        }
        let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
        let c = [b[0] + b[2], b[1] + b[3]];
        c[0] + c[1]
    }

    #[inline(always)]
    fn micro<const T: usize, const R: usize, const FMA: bool>(
        x: &[f32],
        w: &[f32],
        k: usize,
        out: &mut [f32],
        ld_out: usize,
    ) {
        let mut acc = [[[0f32; 16]; R]; T];
        let mut kb = 0;
        while kb < k {
            let len = 16.min(k - kb);
            let mut xv = [[0f32; 16]; T];
            let mut wv = [[0f32; 16]; R];
            if len == 16 {
                for t in 0..T {
                    xv[t] = *super::as16(&x[t * k + kb..t * k + kb + 16]);
                }
                for r in 0..R {
                    wv[r] = *super::as16(&w[r * k + kb..r * k + kb + 16]);
                }
            } else {
                // Zero-padded tail: 0·0 + acc = acc exactly.
                for t in 0..T {
                    xv[t][..len].copy_from_slice(&x[t * k + kb..t * k + kb + len]);
                }
                for r in 0..R {
                    wv[r][..len].copy_from_slice(&w[r * k + kb..r * k + kb + len]);
                }
            }
            for t in 0..T {
                for r in 0..R {
                    let a = &mut acc[t][r];
                    for l in 0..16 {
                        a[l] = madd::<FMA>(xv[t][l], wv[r][l], a[l]);
                    }
                }
            }
            kb += 16;
        }
        for t in 0..T {
            for r in 0..R {
                out[t * ld_out + r] = hsum16(&acc[t][r]);
            }
        }
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub fn tile<const FMA: bool>(
        x: &[f32],
        n: usize,
        k: usize,
        w: &[f32],
        nr: usize,
        out: &mut [f32],
        ld_out: usize,
        r0: usize,
    ) {
        let mut t0 = 0;
        while t0 < n {
            let nt = MT.min(n - t0);
            let mut rr = 0;
            while rr < nr {
                let nrr = MR.min(nr - rr);
                let xs = &x[t0 * k..];
                let ws = &w[rr * k..];
                let os = &mut out[t0 * ld_out + r0 + rr..];
                macro_rules! go {
                    ($t:literal, $r:literal) => {
                        micro::<$t, $r, FMA>(xs, ws, k, os, ld_out)
                    };
                }
                match (nt, nrr) {
                    (4, 4) => go!(4, 4),
                    (4, 3) => go!(4, 3),
                    (4, 2) => go!(4, 2),
                    (4, _) => go!(4, 1),
                    (3, 4) => go!(3, 4),
                    (3, 3) => go!(3, 3),
                    (3, 2) => go!(3, 2),
                    (3, _) => go!(3, 1),
                    (2, 4) => go!(2, 4),
                    (2, 3) => go!(2, 3),
                    (2, 2) => go!(2, 2),
                    (2, _) => go!(2, 1),
                    (_, 4) => go!(1, 4),
                    (_, 3) => go!(1, 3),
                    (_, 2) => go!(1, 2),
                    (_, _) => go!(1, 1),
                }
                rr += MR;
            }
            t0 += MT;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{MR, MT, ROW_TILE};
    use crate::model::quant::{QuantKind, QuantMatrix};

    const Q8_0: u8 = 0;
    const Q4_0: u8 = 1;
    const Q4_1: u8 = 2;

    /// Block `b` as two 16-lane vectors (elements 0..16 and 16..32), with exactly the scalar
    /// formulas of `quant` (separate multiply and add, no FMA).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn deq<const KIND: u8>(
        d: *const f32,
        m: *const f32,
        qs: *const u8,
        b: usize,
    ) -> [__m512; 2] {
        let dv = _mm512_set1_ps(*d.add(b));
        if KIND == Q8_0 {
            let p = qs.add(b * 32);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                p.add(16) as *const __m128i
            )));
            return [_mm512_mul_ps(dv, lo), _mm512_mul_ps(dv, hi)];
        }
        let raw = _mm_loadu_si128(qs.add(b * 16) as *const __m128i);
        let mask = _mm_set1_epi8(0x0F);
        let mut lo = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
        let mut hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
        if KIND == Q4_0 {
            let eight = _mm512_set1_epi32(8);
            lo = _mm512_sub_epi32(lo, eight);
            hi = _mm512_sub_epi32(hi, eight);
        }
        let lo = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(lo));
        let hi = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(hi));
        if KIND == Q4_1 {
            let mv = _mm512_set1_ps(*m.add(b));
            return [_mm512_add_ps(lo, mv), _mm512_add_ps(hi, mv)];
        }
        [lo, hi]
    }

    /// Dot products straight from quantized blocks (no scratch): the same values and the same
    /// accumulation order as dequantizing first and running `micro`.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_q<const KIND: u8, const T: usize, const R: usize>(
        x: *const f32,
        k: usize,
        raw: (*const f32, *const f32, *const u8),
        row0: usize,
        bpr: usize,
        out: *mut f32,
        ld_out: usize,
    ) {
        let (d, m, qs) = raw;
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        for blk in 0..bpr {
            let mut wv = [[_mm512_setzero_ps(); 2]; R];
            for r in 0..R {
                wv[r] = deq::<KIND>(d, m, qs, (row0 + r) * bpr + blk);
            }
            for half in 0..2 {
                for t in 0..T {
                    let xv = _mm512_loadu_ps(x.add(t * k + blk * 32 + half * 16));
                    for r in 0..R {
                        acc[t][r] = _mm512_fmadd_ps(xv, wv[r][half], acc[t][r]);
                    }
                }
            }
        }
        for t in 0..T {
            for r in 0..R {
                *out.add(t * ld_out + r) = _mm512_reduce_add_ps(acc[t][r]);
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn fused<const KIND: u8>(
        x: &[f32],
        n: usize,
        q: &QuantMatrix,
        r0: usize,
        nr: usize,
        out: &mut [f32],
        ld_out: usize,
    ) {
        let k = q.cols;
        let bpr = q.blocks_per_row();
        let (d, m, qs) = q.raw();
        let raw = (d.as_ptr(), m.as_ptr(), qs.as_ptr());
        let mut t0 = 0;
        while t0 < n {
            let nt = MT.min(n - t0);
            let mut rr = 0;
            while rr < nr {
                let nrr = MR.min(nr - rr);
                let xs = x.as_ptr().add(t0 * k);
                let os = out.as_mut_ptr().add(t0 * ld_out + r0 + rr);
                let row0 = r0 + rr;
                macro_rules! go {
                    ($t:literal, $r:literal) => {
                        micro_q::<KIND, $t, $r>(xs, k, raw, row0, bpr, os, ld_out)
                    };
                }
                match (nt, nrr) {
                    (4, 4) => go!(4, 4),
                    (4, 3) => go!(4, 3),
                    (4, 2) => go!(4, 2),
                    (4, _) => go!(4, 1),
                    (3, 4) => go!(3, 4),
                    (3, 3) => go!(3, 3),
                    (3, 2) => go!(3, 2),
                    (3, _) => go!(3, 1),
                    (2, 4) => go!(2, 4),
                    (2, 3) => go!(2, 3),
                    (2, 2) => go!(2, 2),
                    (2, _) => go!(2, 1),
                    (_, 4) => go!(1, 4),
                    (_, 3) => go!(1, 3),
                    (_, 2) => go!(1, 2),
                    (_, _) => go!(1, 1),
                }
                rr += MR;
            }
            t0 += MT;
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn dequantize_rows<const KIND: u8>(
        q: &QuantMatrix,
        r0: usize,
        nr: usize,
        scratch: &mut [f32],
    ) {
        let bpr = q.blocks_per_row();
        let (d, m, qs) = q.raw();
        let (d, m, qs) = (d.as_ptr(), m.as_ptr(), qs.as_ptr());
        let dst = scratch.as_mut_ptr();
        for r in 0..nr {
            for blk in 0..bpr {
                let [lo, hi] = deq::<KIND>(d, m, qs, (r0 + r) * bpr + blk);
                let o = dst.add(r * q.cols + blk * 32);
                _mm512_storeu_ps(o, lo);
                _mm512_storeu_ps(o.add(16), hi);
            }
        }
    }

    /// All tokens × rows `r0..r0+nr` of a quantized matrix. Few tokens: dot products straight from
    /// the blocks; more: dequantize the rows once into `scratch` and reuse them for every token.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn quant_tile(
        x: &[f32],
        n: usize,
        q: &QuantMatrix,
        r0: usize,
        nr: usize,
        out: &mut [f32],
        ld_out: usize,
        scratch: &mut Vec<f32>,
    ) {
        let kind = match q.kind {
            QuantKind::Q8_0 => Q8_0,
            QuantKind::Q4_0 => Q4_0,
            QuantKind::Q4_1 => Q4_1,
        };
        if n <= MT {
            match kind {
                Q8_0 => fused::<Q8_0>(x, n, q, r0, nr, out, ld_out),
                Q4_0 => fused::<Q4_0>(x, n, q, r0, nr, out, ld_out),
                _ => fused::<Q4_1>(x, n, q, r0, nr, out, ld_out),
            }
            return;
        }
        scratch.resize(ROW_TILE * q.cols, 0.0);
        match kind {
            Q8_0 => dequantize_rows::<Q8_0>(q, r0, nr, scratch),
            Q4_0 => dequantize_rows::<Q4_0>(q, r0, nr, scratch),
            _ => dequantize_rows::<Q4_1>(q, r0, nr, scratch),
        }
        tile(x, n, q.cols, &scratch[..nr * q.cols], nr, out, ld_out, r0);
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn micro<const T: usize, const R: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        out: *mut f32,
        ld_out: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); R]; T];
        let mut kb = 0;
        while kb + 16 <= k {
            let mut wv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                wv[r] = _mm512_loadu_ps(w.add(r * k + kb));
            }
            for t in 0..T {
                let xv = _mm512_loadu_ps(x.add(t * k + kb));
                for r in 0..R {
                    acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
                }
            }
            kb += 16;
        }
        if kb < k {
            // Masked tail: missing lanes load as 0, and 0·0 + acc = acc exactly.
            let mask: __mmask16 = ((1u32 << (k - kb)) - 1) as __mmask16;
            let mut wv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                wv[r] = _mm512_maskz_loadu_ps(mask, w.add(r * k + kb));
            }
            for t in 0..T {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(t * k + kb));
                for r in 0..R {
                    acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
                }
            }
        }
        for t in 0..T {
            for r in 0..R {
                *out.add(t * ld_out + r) = _mm512_reduce_add_ps(acc[t][r]);
            }
        }
    }

    /// Same contract as `portable::tile`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile(
        x: &[f32],
        n: usize,
        k: usize,
        w: &[f32],
        nr: usize,
        out: &mut [f32],
        ld_out: usize,
        r0: usize,
    ) {
        debug_assert!(
            x.len() >= n * k && w.len() >= nr * k && out.len() >= (n - 1) * ld_out + r0 + nr
        );
        let mut t0 = 0;
        while t0 < n {
            let nt = MT.min(n - t0);
            let mut rr = 0;
            while rr < nr {
                let nrr = MR.min(nr - rr);
                let xs = x.as_ptr().add(t0 * k);
                let ws = w.as_ptr().add(rr * k);
                let os = out.as_mut_ptr().add(t0 * ld_out + r0 + rr);
                macro_rules! go {
                    ($t:literal, $r:literal) => {
                        micro::<$t, $r>(xs, ws, k, os, ld_out)
                    };
                }
                match (nt, nrr) {
                    (4, 4) => go!(4, 4),
                    (4, 3) => go!(4, 3),
                    (4, 2) => go!(4, 2),
                    (4, _) => go!(4, 1),
                    (3, 4) => go!(3, 4),
                    (3, 3) => go!(3, 3),
                    (3, 2) => go!(3, 2),
                    (3, _) => go!(3, 1),
                    (2, 4) => go!(2, 4),
                    (2, 3) => go!(2, 3),
                    (2, 2) => go!(2, 2),
                    (2, _) => go!(2, 1),
                    (_, 4) => go!(1, 4),
                    (_, 3) => go!(1, 3),
                    (_, 2) => go!(1, 2),
                    (_, _) => go!(1, 1),
                }
                rr += MR;
            }
            t0 += MT;
        }
    }
}

/// One 16-lane dot product with the same reduction order as the matmul kernels' portable path.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        let (x, y) = (as16(x), as16(y));
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    for l in 0..ra.len() {
        acc[l] += ra[l] * rb[l];
    }
    portable::hsum16(&acc)
}

/// A 16-element chunk as an array reference, so loops over it have a constant trip count and
/// vectorize (callers pass `chunks_exact(16)` items).
#[inline(always)]
fn as16(x: &[f32]) -> &[f32; 16] {
    match x.try_into() {
        Ok(a) => a,
        Err(_) => panic!("chunk of {} elements, expected 16", x.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(x: &[f32], n: usize, w: &[f32], rows: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0f64; n * rows];
        for t in 0..n {
            for r in 0..rows {
                out[t * rows + r] = (0..k)
                    .map(|i| x[t * k + i] as f64 * w[r * k + i] as f64)
                    .sum();
            }
        }
        out
    }

    #[test]
    fn quantized_matrices_match_their_dequantized_values_on_every_isa() {
        use crate::model::quant::QuantMatrix;
        use crate::model::GgmlType;
        let (rows, k) = (21, 96);
        for (ty, block) in [
            (GgmlType::Q4_0, 18),
            (GgmlType::Q4_1, 20),
            (GgmlType::Q8_0, 34),
        ] {
            let n_blocks = rows * k / 32;
            let mut bytes = Vec::with_capacity(n_blocks * block);
            for b in 0..n_blocks {
                bytes.extend_from_slice(&half::f16::from_f32(0.01 + b as f32 * 1e-3).to_le_bytes());
                if ty == GgmlType::Q4_1 {
                    bytes.extend_from_slice(&half::f16::from_f32(-0.05).to_le_bytes());
                }
                let payload = block - if ty == GgmlType::Q4_1 { 4 } else { 2 };
                bytes.extend((0..payload).map(|i| ((b * 31 + i * 17) % 256) as u8));
            }
            let q = QuantMatrix::from_ggml(ty, &bytes, rows, k).unwrap();
            let wm = Matrix::from_quant(q);
            let dense = wm.to_f32();
            assert_eq!(
                dense,
                crate::model::quant::dequantize(ty, &bytes, rows * k).unwrap()
            );
            let dm = Matrix::from_f32(rows, k, dense.clone());
            for n in [1usize, 3, 9] {
                let x: Vec<f32> = (0..n * k)
                    .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
                    .collect();
                let want = reference(&x, n, &dense, rows, k);
                for isa in Isa::available() {
                    let mut out = vec![0f32; n * rows];
                    matmul(isa, &x, n, &wm, &mut out);
                    for (a, b) in out.iter().zip(&want) {
                        assert!(
                            (*a as f64 - b).abs() < 1e-4,
                            "{ty} {isa:?} n={n}: {a} vs {b}"
                        );
                    }
                    // Same kernel over the dense copy: quantized weights change nothing but speed.
                    let mut dense_out = vec![0f32; n * rows];
                    matmul(isa, &x, n, &dm, &mut dense_out);
                    assert_eq!(out, dense_out, "{ty} {isa:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn matches_f64_reference_and_is_batch_invariant() {
        let (rows, k) = (37, 83); // awkward sizes: partial tiles and a k tail
        let w: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let wm = Matrix::from_f32(rows, k, w.clone());
        let n = 11;
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729 % 997) as f32 / 498.0) - 1.0)
            .collect();
        for isa in Isa::available() {
            let mut out = vec![0f32; n * rows];
            matmul(isa, &x, n, &wm, &mut out);
            let want = reference(&x, n, &w, rows, k);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-4, "{isa:?}: {a} vs {b}");
            }
            // Each token alone gives bit-identical results.
            for t in 0..n {
                let mut one = vec![0f32; rows];
                matmul(isa, &x[t * k..(t + 1) * k], 1, &wm, &mut one);
                assert_eq!(one, out[t * rows..(t + 1) * rows], "{isa:?} token {t}");
            }
        }
    }
}

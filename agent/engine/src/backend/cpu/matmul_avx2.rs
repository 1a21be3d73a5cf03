//! AVX2+FMA matmul kernels (x86-64 without AVX-512): 8-lane accumulators, a 4-token × 3-row
//! register tile (12 accumulators of the 16 ymm registers), quantized blocks dequantized 8 values
//! at a time with the same formulas as `quant`. Same contract and reduction-order guarantees as the
//! AVX-512 kernels in `matmul`.
#![cfg(target_arch = "x86_64")]
#![allow(clippy::needless_range_loop, clippy::too_many_arguments)]

use std::arch::x86_64::*;

use crate::model::quant::{QuantKind, QuantMatrix};

const MT: usize = 4;
const MR: usize = 3;
const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;

/// Fixed-order horizontal sum of 8 lanes.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum8(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Values `8*piece .. 8*piece+8` of block `b`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn deq_piece<const KIND: u8>(
    d: *const f32,
    m: *const f32,
    qs: *const u8,
    b: usize,
    piece: usize,
) -> __m256 {
    let dv = _mm256_set1_ps(*d.add(b));
    if KIND == Q8_0 {
        let raw = _mm_loadl_epi64(qs.add(b * 32 + piece * 8) as *const __m128i);
        return _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
    }
    let raw = _mm_loadl_epi64(qs.add(b * 16 + (piece % 2) * 8) as *const __m128i);
    let nib = if piece >= 2 {
        _mm_srli_epi16(raw, 4)
    } else {
        raw
    };
    let mut q = _mm256_cvtepu8_epi32(_mm_and_si128(nib, _mm_set1_epi8(0x0F)));
    if KIND == Q4_0 {
        q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
    }
    let v = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(q));
    if KIND == Q4_1 {
        return _mm256_add_ps(v, _mm256_set1_ps(*m.add(b)));
    }
    v
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tail_mask(len: usize) -> __m256i {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_cmpgt_epi32(_mm256_set1_epi32(len as i32), idx)
}

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn micro<const T: usize, const R: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    out: *mut f32,
    ld_out: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    let mut kb = 0;
    while kb + 8 <= k {
        let mut wv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            wv[r] = _mm256_loadu_ps(w.add(r * k + kb));
        }
        for t in 0..T {
            let xv = _mm256_loadu_ps(x.add(t * k + kb));
            for r in 0..R {
                acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
            }
        }
        kb += 8;
    }
    if kb < k {
        // Masked tail: missing lanes load as 0, and 0·0 + acc = acc exactly.
        let mask = tail_mask(k - kb);
        let mut wv = [_mm256_setzero_ps(); R];
        for r in 0..R {
            wv[r] = _mm256_maskload_ps(w.add(r * k + kb), mask);
        }
        for t in 0..T {
            let xv = _mm256_maskload_ps(x.add(t * k + kb), mask);
            for r in 0..R {
                acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
            }
        }
    }
    for t in 0..T {
        for r in 0..R {
            *out.add(t * ld_out + r) = hsum8(acc[t][r]);
        }
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
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
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    for blk in 0..bpr {
        for piece in 0..4 {
            let mut wv = [_mm256_setzero_ps(); R];
            for r in 0..R {
                wv[r] = deq_piece::<KIND>(d, m, qs, (row0 + r) * bpr + blk, piece);
            }
            for t in 0..T {
                let xv = _mm256_loadu_ps(x.add(t * k + blk * 32 + piece * 8));
                for r in 0..R {
                    acc[t][r] = _mm256_fmadd_ps(xv, wv[r], acc[t][r]);
                }
            }
        }
    }
    for t in 0..T {
        for r in 0..R {
            *out.add(t * ld_out + r) = hsum8(acc[t][r]);
        }
    }
}

/// Dispatches the register tile shapes over `n` tokens × `nr` rows.
macro_rules! tiles {
    ($n:expr, $nr:expr, |$nt:ident, $nrr:ident, $t0:ident, $rr:ident| $go:ident) => {{
        let mut $t0 = 0;
        while $t0 < $n {
            let $nt = MT.min($n - $t0);
            let mut $rr = 0;
            while $rr < $nr {
                let $nrr = MR.min($nr - $rr);
                match ($nt, $nrr) {
                    (4, 3) => $go!(4, 3, $t0, $rr),
                    (4, 2) => $go!(4, 2, $t0, $rr),
                    (4, _) => $go!(4, 1, $t0, $rr),
                    (3, 3) => $go!(3, 3, $t0, $rr),
                    (3, 2) => $go!(3, 2, $t0, $rr),
                    (3, _) => $go!(3, 1, $t0, $rr),
                    (2, 3) => $go!(2, 3, $t0, $rr),
                    (2, 2) => $go!(2, 2, $t0, $rr),
                    (2, _) => $go!(2, 1, $t0, $rr),
                    (_, 3) => $go!(1, 3, $t0, $rr),
                    (_, 2) => $go!(1, 2, $t0, $rr),
                    (_, _) => $go!(1, 1, $t0, $rr),
                }
                $rr += MR;
            }
            $t0 += MT;
        }
    }};
}

/// All tokens × one tile of `nr` f32 weight rows (`w` holds those rows, `nr × k`).
#[target_feature(enable = "avx2,fma")]
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
    debug_assert!(x.len() >= n * k && w.len() >= nr * k && out.len() >= (n - 1) * ld_out + r0 + nr);
    macro_rules! go {
        ($t:literal, $r:literal, $t0:ident, $rr:ident) => {
            micro::<$t, $r>(
                x.as_ptr().add($t0 * k),
                w.as_ptr().add($rr * k),
                k,
                out.as_mut_ptr().add($t0 * ld_out + r0 + $rr),
                ld_out,
            )
        };
    }
    tiles!(n, nr, |nt, nrr, t0, rr| go);
}

#[target_feature(enable = "avx2,fma")]
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
    macro_rules! go {
        ($t:literal, $r:literal, $t0:ident, $rr:ident) => {
            micro_q::<KIND, $t, $r>(
                x.as_ptr().add($t0 * k),
                k,
                raw,
                r0 + $rr,
                bpr,
                out.as_mut_ptr().add($t0 * ld_out + r0 + $rr),
                ld_out,
            )
        };
    }
    tiles!(n, nr, |nt, nrr, t0, rr| go);
}

#[target_feature(enable = "avx2,fma")]
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
            for piece in 0..4 {
                let v = deq_piece::<KIND>(d, m, qs, (r0 + r) * bpr + blk, piece);
                _mm256_storeu_ps(dst.add(r * q.cols + blk * 32 + piece * 8), v);
            }
        }
    }
}

/// All tokens × rows `r0..r0+nr` of a quantized matrix: few tokens straight from the blocks, more
/// through rows dequantized once into `scratch`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quant_tile(
    x: &[f32],
    n: usize,
    q: &QuantMatrix,
    r0: usize,
    nr: usize,
    out: &mut [f32],
    ld_out: usize,
    scratch: &mut Vec<f32>,
    row_tile: usize,
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
    scratch.resize(row_tile * q.cols, 0.0);
    match kind {
        Q8_0 => dequantize_rows::<Q8_0>(q, r0, nr, scratch),
        Q4_0 => dequantize_rows::<Q4_0>(q, r0, nr, scratch),
        _ => dequantize_rows::<Q4_1>(q, r0, nr, scratch),
    }
    tile(x, n, q.cols, &scratch[..nr * q.cols], nr, out, ld_out, r0);
}

//! `out = x · Wᵀ` over row-quantized 8-bit weights (W8A8): what the GPU's 8-bit GEMM computes.
//!
//! Each token's activations are quantized to the weights' format with one scale per token (max |x|
//! maps to the largest code), the 8-bit code values are multiplied and summed in f32 by the same
//! dot-product kernels as every other matmul (a tile of weight rows decoded to their unscaled code
//! values at a time), and each output is scaled once by `token scale · row scale`, as a GEMM
//! epilogue does.
//!
//! For int8 the code values are integers and the kernels' 16 lane accumulators stay exact in f32
//! up to 2²⁴ / 127² ≈ 1040 products per lane (k ≤ 16,640), so the sum is the integer dot product
//! an int8 tensor core accumulates in i32; beyond that it is rounded like any f32 sum.
//! A token's quantization depends on that token alone, so results stay batch-invariant.
//! With [`Activations::Float`] (weight-only, for comparisons) the activations are used as they are.

use rayon::prelude::*;

use super::matmul::{tile_kernel, OutPtr, ROW_TILE};
use super::simd::Isa;
use crate::model::rowquant::{quantize_activations, Activations, RowQuantMatrix};

/// `x` is `n × w.cols`, `out` is `n × w.rows`, both row-major. Runs on the current rayon pool.
pub fn matmul(isa: Isa, x: &[f32], n: usize, w: &RowQuantMatrix, out: &mut [f32]) {
    let (rows, k) = (w.rows, w.cols);
    let quantized;
    let (xq, x_scales): (&[f32], &[f32]) = match w.activations {
        Activations::PerToken => {
            quantized = quantize_activations(w.format, x, n, k);
            (&quantized.0, &quantized.1)
        }
        // Weight-only: the activations as they are, a token scale of 1.
        Activations::Float => (x, &[]),
    };
    let w_scales = w.scales();
    let ptr = OutPtr(out.as_mut_ptr());
    (0..rows.div_ceil(ROW_TILE))
        .into_par_iter()
        .for_each_init(Vec::new, |scratch: &mut Vec<f32>, tile| {
            let r0 = tile * ROW_TILE;
            let nr = ROW_TILE.min(rows - r0);
            scratch.resize(ROW_TILE * k, 0.0);
            for i in 0..nr {
                w.decode_row(r0 + i, &mut scratch[i * k..(i + 1) * k]);
            }
            let p = ptr;
            // SAFETY: rows r0..r0+nr of every token belong to this task alone; `out` outlives the
            // parallel loop and is n × rows (checked by the caller).
            let out = unsafe { std::slice::from_raw_parts_mut(p.0, n * rows) };
            tile_kernel(isa, xq, n, k, &scratch[..nr * k], nr, out, rows, r0);
            // Epilogue: the token's scale, then the row's.
            for t in 0..n {
                let sx = x_scales.get(t).copied().unwrap_or(1.0);
                let o = &mut out[t * rows + r0..t * rows + r0 + nr];
                for (v, &sw) in o.iter_mut().zip(&w_scales[r0..r0 + nr]) {
                    *v = *v * sx * sw;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::rowquant::RowFormat;
    use crate::model::Matrix;

    /// The W8A8 result computed independently: quantize both sides by the definition, dot products
    /// of the code values in f64 (i64 for int8), then both scales.
    fn reference(format: RowFormat, x: &[f32], n: usize, w: &[f32], rows: usize, k: usize) -> Vec<f64> {
        let q = RowQuantMatrix::quantize(format, rows, k, w).unwrap();
        let mut out = vec![0f64; n * rows];
        for t in 0..n {
            let xt = &x[t * k..(t + 1) * k];
            let amax = xt.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sx = amax / format.max_code();
            let xc: Vec<f64> = xt
                .iter()
                .map(|&v| if sx == 0.0 { 0.0 } else { format.decode(format.encode(v / sx)) as f64 })
                .collect();
            for r in 0..rows {
                let wc = &q.codes()[r * k..(r + 1) * k];
                let dot: f64 = xc.iter().zip(wc).map(|(a, &c)| a * format.decode(c) as f64).sum();
                out[t * rows + r] = dot * sx as f64 * q.scales()[r] as f64;
            }
        }
        out
    }

    #[test]
    fn w8a8_matches_the_definition_on_every_isa_and_is_batch_invariant() {
        let (rows, k, n) = (37, 200, 9); // partial row tiles and a k tail
        let w: Vec<f32> = (0..rows * k).map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.1).collect();
        let mut x: Vec<f32> = (0..n * k).map(|i| (i * 104729 % 997) as f32 / 498.0 - 1.0).collect();
        x[3 * k..4 * k].fill(0.0); // a zero token
        for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let wm = Matrix::from_row_quant(RowQuantMatrix::quantize(format, rows, k, &w).unwrap());
            let want = reference(format, &x, n, &w, rows, k);
            for isa in Isa::available() {
                let mut out = vec![0f32; n * rows];
                crate::backend::cpu::matmul::matmul(isa, &x, n, &wm, &mut out);
                for (i, (a, b)) in out.iter().zip(&want).enumerate() {
                    assert!((*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()), "{format:?} {isa:?} [{i}]: {a} vs {b}");
                }
                for t in 0..n {
                    let mut one = vec![0f32; rows];
                    crate::backend::cpu::matmul::matmul(isa, &x[t * k..(t + 1) * k], 1, &wm, &mut one);
                    assert_eq!(one, out[t * rows..(t + 1) * rows], "{format:?} {isa:?} token {t}");
                }
                assert!(out[3 * rows..4 * rows].iter().all(|&v| v == 0.0));
            }
        }
    }
}

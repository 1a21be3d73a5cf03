//! The FP8 W8A8 decode kernels (kernels/cuda/gemv_fp8.cu) against the CPU path they must reproduce
//! (`rowquant::quantize_activations` and `matmul_w8a8`): per-token activation codes and scales bit for
//! bit, the CUDA-core GEMV's outputs to f32 summation-order rounding (f32 out) or one bf16 rounding
//! (bf16 out); the tensor-core GEMV near them and batch invariant.
//! Needs a GPU of compute capability 8.9+; skips (visibly) elsewhere unless PEREGRINE_REQUIRE_GPU.

mod cuda_common;

use half::bf16;
use peregrine_engine::backend::cpu::{matmul::matmul, simd::Isa};
use peregrine_engine::model::rowquant::{quantize_activations, RowFormat, RowQuantMatrix};
use peregrine_engine::model::Matrix;
use cuda_common::values;
use peregrine_kernels::ops::{Gemv8Kernel, W8Format};
use peregrine_kernels::testing::cuda_or_skip;

#[test]
fn fp8_gemv_and_activation_quant_match_the_cpu_path() {
    let Some(c) = cuda_or_skip() else { return };
    if !c.kernels.fp8_gemm_ready() {
        assert!(std::env::var_os("PEREGRINE_REQUIRE_FP8").is_none(), "PEREGRINE_REQUIRE_FP8 set on a GPU below sm_89");
        cuda_common::report("skipped: the FP8 GEMV needs compute capability 8.9+");
        return;
    }
    let s = &c.gpu.stream;
    let isa = Isa::detect();
    // SmolLM2 and Llama-3.1-8B projection shapes (n, k), plus a small odd n.
    for (n, k) in [(1536usize, 576usize), (576, 1536), (6144, 4096), (4096, 14336), (37, 64)] {
        let w = values(n * k, n as u64, 0.05);
        let wq = RowQuantMatrix::quantize(RowFormat::Fp8E4m3, n, k, &w).unwrap();
        let dw = c.gpu.upload(wq.codes()).unwrap();
        let dws = c.gpu.upload(wq.scales()).unwrap();
        let wm = Matrix::from_row_quant(wq.clone());
        for m in 1..=peregrine_kernels::ops::GEMV_FP8_MAX_M {
            // bf16-exact activations, so the CPU quantizes the very values the GPU reads.
            let mut x: Vec<f32> = values(m * k, (m * 7 + k) as u64, 2.0).iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
            // A zero token: scale 0, zero codes, zero outputs.
            if m == 3 {
                x[k..2 * k].fill(0.0);
            }
            let xbits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            let dx = c.gpu.upload(&xbits).unwrap();
            let dq = c.gpu.upload(&vec![0xAAu8; m * k]).unwrap();
            let dxs = c.gpu.upload(&vec![f32::NAN; m]).unwrap();
            unsafe { c.kernels.quant_rows_e4m3(s, dq.ptr(), dxs.ptr(), dx.ptr(), m, k).unwrap() };
            let (want_vals, want_scales) = quantize_activations(RowFormat::Fp8E4m3, &x, m, k);
            let got_scales = dxs.download(s).unwrap();
            for (i, (a, b)) in got_scales.iter().zip(&want_scales).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "token scale {i} (n {n}, k {k}, m {m}): {a} vs {b}");
            }
            let got_codes = dq.download(s).unwrap();
            for (i, (&code, want)) in got_codes.iter().zip(&want_vals).enumerate() {
                assert_eq!(RowFormat::Fp8E4m3.decode(code).to_bits(), want.to_bits(), "activation code {i} (k {k}, m {m})");
            }

            let mut want = vec![0f32; m * n];
            matmul(isa, &x, m, &wm, &mut want);
            // The CUDA-core kernel sums in f32 (the CPU's results to summation-order rounding);
            // the tensor-core one accumulates fp8 products as cuBLASLt does (cuda_w8a8 checks it
            // against its f64 bound), so here only a loose sanity bound and its batch invariance.
            for kernel in [Gemv8Kernel::CudaCores, Gemv8Kernel::TensorCores] {
                let yf = c.gpu.upload(&vec![f32::NAN; m * n]).unwrap();
                unsafe { c.kernels.gemv_w8_with(kernel, s, W8Format::E4m3, yf.ptr(), true, dq.ptr(), dxs.ptr(), dw.ptr(), dws.ptr(), m, n, k).unwrap() };
                let got = yf.download(s).unwrap();
                let (mut num, mut den) = (0f64, 0f64);
                for (a, b) in got.iter().zip(&want) {
                    assert!(a.is_finite(), "{kernel:?} gemv_e4m3 n {n} k {k} m {m}: non-finite output");
                    num += ((a - b) as f64).powi(2);
                    den += (*b as f64).powi(2);
                }
                let rel = (num / den.max(1e-30)).sqrt();
                let bound = if kernel == Gemv8Kernel::CudaCores { 1e-5 } else { 1e-3 };
                assert!(rel < bound, "{kernel:?} gemv_e4m3 f32 n {n} k {k} m {m}: rel L2 {rel}");
                if m == 3 {
                    assert!(got[n..2 * n].iter().all(|&v| v == 0.0), "{kernel:?}: zero token");
                }
                if kernel != Gemv8Kernel::CudaCores {
                    // Each token alone gives the bits it gives in the batch.
                    let y1 = c.gpu.upload(&vec![f32::NAN; n]).unwrap();
                    for i in [0, m - 1] {
                        unsafe { c.kernels.gemv_w8_with(kernel, s, W8Format::E4m3, y1.ptr(), true, dq.ptr() + (i * k) as u64, dxs.ptr() + (i * 4) as u64, dw.ptr(), dws.ptr(), 1, n, k).unwrap() };
                        let alone = y1.download(s).unwrap();
                        assert!(alone.iter().zip(&got[i * n..(i + 1) * n]).all(|(a, b)| a.to_bits() == b.to_bits()), "{kernel:?} GEMV n {n} k {k}: token {i} of {m} differs from itself alone");
                    }
                    continue;
                }
                let yb = c.gpu.upload(&vec![0xFFFFu16; m * n]).unwrap();
                unsafe { c.kernels.gemv_w8_with(kernel, s, W8Format::E4m3, yb.ptr(), false, dq.ptr(), dxs.ptr(), dw.ptr(), dws.ptr(), m, n, k).unwrap() };
                for (i, (&bits, &b)) in yb.download(s).unwrap().iter().zip(&want).enumerate() {
                    let a = bf16::from_bits(bits).to_f32();
                    // One bf16 rounding of the output, plus the f32 summation-order difference, which
                    // scales with the row's Σ|products| (not with the result: a sum that cancels to
                    // near zero keeps the absolute error of its large terms). The floor is computed only
                    // where the relative bound alone fails (it costs k multiplications).
                    if (a - b).abs() <= b.abs() / 128.0 {
                        continue;
                    }
                    let floor = sum_abs_products(&wq, &want_vals, &want_scales, k, i / n, i % n) * 2f32.powi(-17);
                    assert!(
                        (a - b).abs() <= b.abs() / 128.0 + floor,
                        "gemv_e4m3 bf16 n {n} k {k} m {m} [{i}]: {a} vs {b} (f32 summation floor {floor:e})"
                    );
                }
            }
        }
    }
}

/// Σ_k |x[t, k] · w[row, k]| in real units (codes times both scales): the magnitude that bounds the
/// f32 rounding of a dot product summed in another order (about √k · 2⁻²⁴ of it; 2⁻¹⁷ ≈ 128 · 2⁻²⁴
/// allows k up to 16,384 at one unit of rounding per √k).
fn sum_abs_products(w: &RowQuantMatrix, x_vals: &[f32], x_scales: &[f32], k: usize, t: usize, row: usize) -> f32 {
    let mut wrow = vec![0f32; k];
    w.decode_row(row, &mut wrow);
    let s: f64 = x_vals[t * k..(t + 1) * k].iter().zip(&wrow).map(|(a, b)| (a * b).abs() as f64).sum();
    (s * x_scales[t] as f64 * w.scales()[row] as f64) as f32
}

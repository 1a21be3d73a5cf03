//! The W8A8 kernels of `--quantization fp8|int8` on the GPU (issue 17), against references computed
//! here from the definitions and against the CPU's `rowquant` functions:
//! - our 8-bit kernels (both GEMVs for ≤ 16 rows, the tensor-core GEMM above) on ragged
//!   shapes against an f64 dot product of the same codes (int8 weights with code −128, as
//!   checkpoints hold them), within the format's error (int8: exact
//!   integer sums, so f32 rounding only; e4m3: the tensor cores' reduced-precision accumulation, at
//!   most 2⁻¹² of |sum so far| + Σ|products| per 32-wide k step); the GEMM's rows do not depend on the other rows (bit for bit);
//! - cuBLASLt's FP8 GEMM (unscaled + `scale_outer` where it cannot scale by rows), the e4m3 path
//!   above 4 rows, against the same reference and tolerance; its int8 GEMM (+ `scale_outer_i32`)
//!   bit-identical to `gemm_w8a8` (exact integer sums, the same epilogue);
//! - the fused per-token quantizers (RMSNorm, SiLU·mul) against the CPU's `rms_norm`/`swiglu` then
//!   `quantize_activations`: codes bit-identical where the f32 maths is exact (a sum of squares
//!   without rounding), else within one code step; scales to f32 rounding; also with the GEMM's
//!   token and row scales left to them (`OuterScale`).
//! Needs compute capability 8.9+ for e4m3 (8.0+ for int8); skips visibly elsewhere unless
//! PEREGRINE_REQUIRE_GPU (and PEREGRINE_REQUIRE_FP8 for e4m3).

mod cuda_common;

use half::bf16;
use peregrine_engine::backend::cpu::ops::{rms_norm, swiglu};
use peregrine_engine::model::rowquant::{quantize_activations, RowFormat, RowQuantMatrix};
use cuda_common::values;
use peregrine_kernels::testing::cuda_or_skip;
use peregrine_kernels::gemm_lt::BlasLt;
use peregrine_kernels::ops::{Gemv8Kernel, OuterScale};
use peregrine_kernels::{Cuda, OutType, W8Format};

const FORMATS: [(RowFormat, W8Format); 2] = [(RowFormat::Fp8E4m3, W8Format::E4m3), (RowFormat::Int8, W8Format::I8)];

/// Whether this GPU runs `format`'s kernels; a visible skip (or a failure where required) if not.
fn ready(c: &Cuda, format: W8Format) -> bool {
    if c.kernels.w8_ready(format) {
        return true;
    }
    let required = match format {
        W8Format::E4m3 => std::env::var_os("PEREGRINE_REQUIRE_FP8").is_some(),
        W8Format::I8 => std::env::var_os("PEREGRINE_REQUIRE_GPU").is_some(),
    };
    assert!(!required, "{format:?} kernels required but this GPU cannot run them");
    cuda_common::report(&format!("skipped: the {format:?} W8A8 kernels need a newer GPU"));
    false
}

/// cuBLASLt, where this GPU runs `format` and the library is there; a visible skip if not.
fn blas_lt(c: &Cuda, format: W8Format) -> Option<&BlasLt> {
    if !ready(c, format) {
        return None;
    }
    if c.blas_lt.is_none() {
        cuda_common::report("skipped: libcublasLt not found (or PEREGRINE_GEMM8=ours)");
    }
    c.blas_lt.as_ref()
}

/// One code step of `format` at the magnitude of `v` (unscaled code values).
fn code_step(format: RowFormat, v: f32) -> f32 {
    match format {
        RowFormat::Int8 => 1.0,
        // 3 mantissa bits; the subnormal grid below 2⁻⁶ has steps of 2⁻⁹.
        RowFormat::Fp8E4m3 => (2f32.powi(v.abs().max(2f32.powi(-6)).log2().floor() as i32 - 3)).max(2f32.powi(-9)),
    }
}

/// int8 weights as a checkpoint may hold them: compressed-tensors' rounding writes code −128, which
/// our own quantizer never does (it clamps to ±127), so each row's −127 becomes −128 here and the
/// kernels meet that code (`tests/fixtures/int8_tiny` has it in every linear). e4m3 unchanged.
fn with_code_minus_128(q: RowQuantMatrix) -> RowQuantMatrix {
    if q.format != RowFormat::Int8 {
        return q;
    }
    let codes: Vec<u8> = q.codes().iter().map(|&c| if c == (-127i8) as u8 { (-128i8) as u8 } else { c }).collect();
    assert!(codes.contains(&((-128i8) as u8)), "no row of the test matrix reached code -127");
    RowQuantMatrix::from_parts(q.format, q.rows, q.cols, codes, q.scales().to_vec()).unwrap()
}

/// `(dot · xs[i] · ws[j], budget)` per output of `xq · wqᵀ` in f64: `budget` is Σ over the GEMM's
/// 32-wide k steps of |sum so far| + Σ|products of the step|, what each step's accumulation may
/// lose a fraction of (scaled like the dot).
fn f64_reference(format: RowFormat, xq: &RowQuantMatrix, wq: &RowQuantMatrix, m: usize, n: usize, k: usize) -> Vec<(f64, f64)> {
    (0..m * n)
        .map(|e| {
            let (i, j) = (e / n, e % n);
            let (mut dot, mut budget) = (0f64, 0f64);
            for t0 in (0..k).step_by(32) {
                let (mut step, mut abs) = (0f64, 0f64);
                for t in t0..(t0 + 32).min(k) {
                    let p = format.decode(xq.codes()[i * k + t]) as f64 * format.decode(wq.codes()[j * k + t]) as f64;
                    step += p;
                    abs += p.abs();
                }
                budget += dot.abs() + abs;
                dot += step;
            }
            let scale = xq.scales()[i] as f64 * wq.scales()[j] as f64;
            (dot * scale, budget * scale)
        })
        .collect()
}

/// How far an 8-bit GEMM output may be from [`f64_reference`]. int8: integer sums are exact, one
/// f32 rounding per epilogue product. e4m3: products are exact, but an fp8 mma adds its 32
/// products to the f32 accumulator with fewer bits than f32 (Hopper aligns to the largest term and
/// keeps about 14 bits), so each k step may lose up to 2⁻¹² of max(|sum so far|, Σ|its products|).
/// A wrong fragment layout, a lost tile or a misapplied scale is off by the whole sum, far above this.
fn tolerance(format: RowFormat, want: f64, budget: f64) -> f64 {
    match format {
        RowFormat::Int8 => 4e-7 * want.abs() + 1e-30,
        RowFormat::Fp8E4m3 => budget / 4096.0 + 4e-7 * want.abs() + 1e-30,
    }
}

#[test]
fn cublaslt_fp8_gemm_then_row_scales_matches_an_f64_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    let Some(lt) = blas_lt(&c, W8Format::E4m3) else { return };
    let format = RowFormat::Fp8E4m3;
    // (m, n, k): prefill- and batch-sized m, SmolLM2 and Llama-3.1-8B shapes, a ragged m.
    for (m, n, k) in [(17usize, 576usize, 1536usize), (100, 1536, 576), (64, 4096, 4096), (256, 1024, 4096), (33, 4096, 14336), (1000, 576, 576)] {
        let w = values(n * k, (n * 31 + k) as u64, 0.05);
        let x = values(m * k, (m * 7 + k) as u64, 2.0);
        let wq = RowQuantMatrix::quantize(format, n, k, &w).unwrap();
        let xq = RowQuantMatrix::quantize(format, m, k, &x).unwrap();
        let reference = f64_reference(format, &xq, &wq, m, n, k);
        let (dw, dws) = (c.gpu.upload(wq.codes()).unwrap(), c.gpu.upload(wq.scales()).unwrap());
        let (dx, dxs) = (c.gpu.upload(xq.codes()).unwrap(), c.gpu.upload(xq.scales()).unwrap());
        // As `Cuda::linear_w8` runs it: cuBLASLt unscaled, then the scales.
        let run = |y: u64, f32_out: bool| unsafe {
            let ran = lt.gemm_e4m3_unscaled(y, f32_out, dx.ptr(), dw.ptr(), m, n, k).unwrap();
            assert!(ran, "cuBLASLt refused the FP8 GEMM m {m} n {n} k {k}");
            c.kernels.scale_outer(s, y, f32_out, dxs.ptr(), dws.ptr(), m, n).unwrap();
        };
        let yf = c.gpu.upload(&vec![f32::NAN; m * n]).unwrap();
        run(yf.ptr(), true);
        let got = yf.download(s).unwrap();
        let mut worst = 0f64;
        for (e, (&g, &(want, budget))) in got.iter().zip(&reference).enumerate() {
            let tol = tolerance(format, want, budget);
            let err = (g as f64 - want).abs();
            worst = worst.max(err / tol);
            assert!(err <= tol, "cuBLASLt e4m3 m {m} n {n} k {k} [{}, {}]: {g} vs {want} (tolerance {tol})", e / n, e % n);
        }
        // bf16 output: the f32 result rounded, once by cuBLASLt's epilogue (unscaled) and once more
        // after the scales: within two bf16 steps.
        let yb = c.gpu.upload(&vec![0xFFFFu16; m * n]).unwrap();
        run(yb.ptr(), false);
        for (e, (&bits, &f)) in yb.download(s).unwrap().iter().zip(&got).enumerate() {
            let b = bf16::from_bits(bits).to_f32();
            let two_steps = (f.abs() * 2f32.powi(-7)).max(1e-30);
            assert!((b - f).abs() <= two_steps, "cuBLASLt e4m3 bf16 m {m} n {n} k {k} [{e}]: {b} vs f32 {f}");
        }
        cuda_common::report(&format!("cuBLASLt e4m3 m {m} n {n} k {k}: worst error {worst:.3} of the tolerance"));
    }
    // A shape it cannot take (n not a multiple of 16) is declined, not launched.
    let dummy = c.gpu.upload(&vec![0u8; 64 * 64]).unwrap();
    let ran = unsafe { lt.gemm_e4m3_unscaled(dummy.ptr(), true, dummy.ptr(), dummy.ptr(), 17, 37, 64).unwrap() };
    assert!(!ran, "n = 37 must fall back to gemm_w8a8");
}

#[test]
fn cublaslt_int8_gemm_is_bit_identical_to_gemm_w8a8() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    let Some(lt) = blas_lt(&c, W8Format::I8) else { return };
    // Integer sums are exact and the scale epilogue is the same expression, so cuBLASLt's int8 path
    // must give gemm_w8a8's bits. (700, 28672, 4096): more rows than one chunk of the int32 scratch.
    for (m, n, k) in [(17usize, 576usize, 1536usize), (256, 4096, 4096), (700, 28672, 4096)] {
        let w = values(n * k, (n * 31 + k) as u64, 0.05);
        let x = values(m * k, (m * 7 + k) as u64, 2.0);
        let wq = with_code_minus_128(RowQuantMatrix::quantize(RowFormat::Int8, n, k, &w).unwrap());
        let xq = RowQuantMatrix::quantize(RowFormat::Int8, m, k, &x).unwrap();
        let (dw, dws) = (c.gpu.upload(wq.codes()).unwrap(), c.gpu.upload(wq.scales()).unwrap());
        let (dx, dxs) = (c.gpu.upload(xq.codes()).unwrap(), c.gpu.upload(xq.scales()).unwrap());
        for f32_out in [true, false] {
            let bytes = if f32_out { 4 } else { 2 };
            let ours = c.gpu.upload(&vec![0xA5u8; m * n * bytes]).unwrap();
            unsafe { c.kernels.gemm_w8a8_tile(s, W8Format::I8, ours.ptr(), f32_out, dx.ptr(), dxs.ptr(), dw.ptr(), dws.ptr(), m, n, k, 64).unwrap() };
            let theirs = c.gpu.upload(&vec![0x5Au8; m * n * bytes]).unwrap();
            let scale = |y_rows, acc, xs_rows, rows| unsafe { c.kernels.scale_outer_i32(s, y_rows, f32_out, acc, xs_rows, dws.ptr(), rows, n) };
            let ran = unsafe { lt.gemm_i8_rowwise(theirs.ptr(), f32_out, dx.ptr(), dxs.ptr(), dw.ptr(), m, n, k, scale).unwrap() };
            assert!(ran, "cuBLASLt refused the int8 GEMM m {m} n {n} k {k}");
            let (a, b) = (ours.download(s).unwrap(), theirs.download(s).unwrap());
            let first = a.iter().zip(&b).position(|(x, y)| x != y);
            assert!(first.is_none(), "int8 m {m} n {n} k {k} f32 {f32_out}: cuBLASLt differs from gemm_w8a8 at byte {first:?}");
        }
        cuda_common::report(&format!("cuBLASLt int8 m {m} n {n} k {k}: bit-identical to gemm_w8a8"));
    }
}

/// Which kernel a GEMV- or GEMM-sized product runs on.
#[derive(Clone, Copy, Debug)]
enum Path {
    Gemv(Gemv8Kernel),
    /// gemm_w8a8 with output tiles of this size.
    Gemm(usize),
}

#[test]
fn linear_w8_matches_an_f64_reference_on_ragged_shapes_and_rows_are_batch_invariant() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    for (format, w8) in FORMATS {
        if !ready(&c, w8) {
            continue;
        }
        // (m, n, k): GEMV sizes, GEMM sizes with ragged m and n (not multiples of the 64 × 64
        // tile), k not a multiple of the 64-byte k step, SmolLM2 and Llama-3.1-8B shapes.
        for (m, n, k) in [(1usize, 37usize, 64usize), (5, 576, 1536), (16, 1536, 576), (17, 37, 80), (70, 200, 576), (100, 1536, 576), (129, 576, 1536), (64, 4096, 4096), (33, 4096, 14336)] {
            let w = values(n * k, (n * 31 + k) as u64, 0.05);
            let x = values(m * k, (m * 7 + k) as u64, 2.0);
            let wq = with_code_minus_128(RowQuantMatrix::quantize(format, n, k, &w).unwrap());
            // Per-token activation codes are a row-quantized matrix of the tokens.
            let xq = RowQuantMatrix::quantize(format, m, k, &x).unwrap();
            let reference = f64_reference(format, &xq, &wq, m, n, k);
            let (dw, dws) = (c.gpu.upload(wq.codes()).unwrap(), c.gpu.upload(wq.scales()).unwrap());
            let (dx, dxs) = (c.gpu.upload(xq.codes()).unwrap(), c.gpu.upload(xq.scales()).unwrap());
            // GEMV sizes: the 8-bit GEMV (up to 16 rows). GEMM sizes: both tiles (the plan picks by grid
            // size, so one sequence may meet either in different batches).
            // GEMV sizes: both GEMV kernels (CUDA cores, tensor cores).
            let tiles: &[Path] = if m <= peregrine_kernels::ops::GEMV_FP8_MAX_M { &[Path::Gemv(Gemv8Kernel::CudaCores), Path::Gemv(Gemv8Kernel::TensorCores)] } else { &[Path::Gemm(64), Path::Gemm(32)] };
            let run = |y: u64, out: OutType, rows: usize, tile: Path| match tile {
                // Our GEMVs themselves (`Cuda::linear_w8` may send these rows to cuBLASLt, tested above).
                Path::Gemv(kernel) => unsafe { c.kernels.gemv_w8_with(kernel, s, w8, y, out == OutType::F32, dx.ptr(), dxs.ptr(), dw.ptr(), dws.ptr(), rows, n, k).unwrap() },
                Path::Gemm(t) => unsafe { c.kernels.gemm_w8a8_tile(s, w8, y, out == OutType::F32, dx.ptr(), dxs.ptr(), dw.ptr(), dws.ptr(), rows, n, k, t).unwrap() },
            };
            let mut first: Option<Vec<f32>> = None;
            let mut worst = 0f64;
            for &tile in tiles {
                let yf = c.gpu.upload(&vec![f32::NAN; m * n]).unwrap();
                run(yf.ptr(), OutType::F32, m, tile);
                let got = yf.download(s).unwrap();
                for (e, (&g, &(want, budget))) in got.iter().zip(&reference).enumerate() {
                    let tol = tolerance(format, want, budget);
                    let err = (g as f64 - want).abs();
                    worst = worst.max(err / tol);
                    assert!(err <= tol, "{format:?} m {m} n {n} k {k} tile {tile:?} [{}, {}]: {g} vs {want} (tolerance {tol})", e / n, e % n);
                }
                let yb = c.gpu.upload(&vec![0xFFFFu16; m * n]).unwrap();
                run(yb.ptr(), OutType::Bf16, m, tile);
                for (e, (&bits, &f)) in yb.download(s).unwrap().iter().zip(&got).enumerate() {
                    assert_eq!(bits, bf16::from_f32(f).to_bits(), "{format:?} m {m} n {n} k {k} tile {tile:?} [{e}]: bf16 output is the f32 one rounded");
                }
                // The same rows in a smaller batch (still above the GEMV's 16 rows), and under the
                // other tile: bit-identical (every output sums the same k steps in the same order).
                if m > 17 {
                    let m2 = 17;
                    let y2 = c.gpu.upload(&vec![f32::NAN; m2 * n]).unwrap();
                    run(y2.ptr(), OutType::F32, m2, tile);
                    let alone = y2.download(s).unwrap();
                    assert!(alone.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{format:?} m {m} n {n} k {k} tile {tile:?}: rows depend on the batch");
                }
                // The GEMM's two tiles sum the same k steps in the same order; so do the GEMVs'
                // exact int8 sums (e4m3: the two GEMVs accumulate differently).
                if matches!(tile, Path::Gemm(_)) || format == RowFormat::Int8 {
                    match &first {
                        None => first = Some(got),
                        Some(f) => assert!(f.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{format:?} m {m} n {n} k {k}: {tiles:?} differ"),
                    }
                }
            }
            cuda_common::report(&format!("{format:?} linear_w8 m {m} n {n} k {k}: worst error {worst:.3} of the tolerance"));
        }
    }
}

#[test]
fn zero_rows_give_zero_scales_codes_and_outputs() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    for (format, w8) in FORMATS {
        if !ready(&c, w8) {
            continue;
        }
        let (m, n, k) = (20usize, 48usize, 64usize);
        let mut x = values(m * k, 5, 1.0);
        x[3 * k..4 * k].fill(0.0);
        let xbits: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let dx = c.gpu.upload(&xbits).unwrap();
        let dq = c.gpu.upload(&vec![0xAAu8; m * k]).unwrap();
        let dxs = c.gpu.upload(&vec![f32::NAN; m]).unwrap();
        unsafe { c.kernels.quant_rows(s, w8, dq.ptr(), dxs.ptr(), dx.ptr(), m, k).unwrap() };
        let xr: Vec<f32> = xbits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        let (want_vals, want_scales) = quantize_activations(format, &xr, m, k);
        let (got_q, got_s) = (dq.download(s).unwrap(), dxs.download(s).unwrap());
        assert_eq!(got_s[3], 0.0);
        assert!(got_q[3 * k..4 * k].iter().all(|&q| q == 0));
        for (i, (a, b)) in got_s.iter().zip(&want_scales).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "{format:?} token scale {i}");
        }
        for (i, (&q, want)) in got_q.iter().zip(&want_vals).enumerate() {
            assert_eq!(format.decode(q).to_bits(), want.to_bits(), "{format:?} code {i}");
        }
        let w = RowQuantMatrix::quantize(format, n, k, &values(n * k, 9, 0.1)).unwrap();
        let (dw, dws) = (c.gpu.upload(w.codes()).unwrap(), c.gpu.upload(w.scales()).unwrap());
        let y = c.gpu.upload(&vec![f32::NAN; m * n]).unwrap();
        unsafe { c.linear_w8(w8, y.ptr(), OutType::F32, dq.ptr(), dxs.ptr(), dw.ptr(), dws.ptr(), m, n, k).unwrap() };
        let got = y.download(s).unwrap();
        assert!(got[3 * n..4 * n].iter().all(|&v| v == 0.0), "{format:?}: a zero token gives zero outputs");
        assert!(got.iter().all(|v| v.is_finite()));
    }
}

/// Token and row scales a GEMM may leave to the kernel after it: powers of two (products exact in
/// f32, so the kernel's scaled inputs are the host's bit for bit), or all ones when not `deferred`.
fn deferred_scales(rows: usize, cols: usize, deferred: bool) -> (Vec<f32>, Vec<f32>) {
    if !deferred {
        return (vec![1.0; rows], vec![1.0; cols]);
    }
    ((0..rows).map(|r| [0.5, 2.0, 0.25][r % 3]).collect(), (0..cols).map(|j| [1.0, 0.5, 2.0, 4.0][j % 4]).collect())
}

/// Asserts GPU codes/scales against the CPU's quantization of the same f32 rows: scales within f32
/// rounding, codes equal (`exact`) or within one code step.
fn check_codes(format: RowFormat, what: &str, rows: usize, k: usize, want_f32: &[f32], got_q: &[u8], got_s: &[f32], exact: bool) {
    let (want_vals, want_scales) = quantize_activations(format, want_f32, rows, k);
    let mut differing = 0usize;
    for r in 0..rows {
        let (a, b) = (got_s[r], want_scales[r]);
        if exact {
            assert_eq!(a.to_bits(), b.to_bits(), "{what} {format:?} row {r}: scale {a} vs {b}");
        } else {
            assert!((a - b).abs() <= b.abs() * 4e-6, "{what} {format:?} row {r}: scale {a} vs {b}");
        }
        for i in r * k..(r + 1) * k {
            let (g, w) = (format.decode(got_q[i]), want_vals[i]);
            if exact {
                assert_eq!(g.to_bits(), w.to_bits(), "{what} {format:?} [{r}, {}]: code value {g} vs {w}", i - r * k);
            } else {
                assert!((g - w).abs() <= code_step(format, w) * 1.001, "{what} {format:?} [{r}, {}]: code value {g} vs {w} (more than one step)", i - r * k);
            }
            differing += (g != w) as usize;
        }
    }
    cuda_common::report(&format!("{what} {format:?}: {differing} of {} codes one step from the CPU's ({})", rows * k, if exact { "exact inputs" } else { "rounded inputs" }));
}

#[test]
fn fused_rmsnorm_quant_matches_the_cpu_rms_norm_then_quantize() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    for (format, w8) in FORMATS {
        if !ready(&c, w8) {
            continue;
        }
        for (rows, hidden) in [(3usize, 576usize), (20, 4096)] {
            let eps = 1e-5f32;
            let weight: Vec<f32> = values(hidden, 11, 1.0).iter().map(|v| 1.0 + v * 0.25).collect();
            // exact: multiples of 1/8 in ±4 (squares and their sum exact in f32 in any order), so the
            // GPU's f32 maths is the CPU's bit for bit; else arbitrary values.
            // deferred: delta is an unscaled GEMM output whose token and row scales the kernel applies
            // (powers of two, so the scaled sums stay exact), the token scales read from the very
            // buffer the kernel writes its own to, as in the decode step.
            // sums: the deferred delta as an int8 GEMM leaves it, int32 sums (8 × the bf16 delta,
            // exact) in their own buffer with row scales / 8, the bf16 delta buffer poisoned.
            for (exact, deferred, sums) in [(true, false, false), (false, false, false), (true, true, false), (true, true, true)] {
                let quantize = |v: f32| if exact { (v * 8.0).round() / 8.0 } else { v };
                let residual: Vec<f32> = values(rows * hidden, 3, 2.0).into_iter().map(|v| quantize(v.clamp(-4.0, 4.0))).collect();
                // delta in bf16 (what the o / down projections write), also exact multiples of 1/8.
                let delta: Vec<f32> = values(rows * hidden, 4, 1.0).into_iter().map(|v| bf16::from_f32(quantize(v.clamp(-2.0, 2.0))).to_f32()).collect();
                let (xs, ws) = deferred_scales(rows, hidden, deferred);
                let summed: Vec<f32> = residual.iter().zip(&delta).enumerate().map(|(i, (a, b))| a + b * (xs[i / hidden] * ws[i % hidden])).collect();
                let mut want = vec![0f32; rows * hidden];
                rms_norm(&summed, &weight, eps, &mut want);

                let dres = c.gpu.upload(&residual).unwrap();
                let delta_bits: Vec<u16> = if sums { vec![0xFFFF; rows * hidden] } else { delta.iter().map(|&v| bf16::from_f32(v).to_bits()).collect() };
                let ddelta = c.gpu.upload(&delta_bits).unwrap();
                let dw = c.gpu.upload(&weight).unwrap();
                let dout = c.gpu.upload(&vec![0xFFFFu16; rows * hidden]).unwrap();
                let dq = c.gpu.upload(&vec![0xAAu8; rows * hidden]).unwrap();
                let ds = c.gpu.upload(&if deferred { xs.clone() } else { vec![f32::NAN; rows] }).unwrap();
                let dws = c.gpu.upload(&if sums { ws.iter().map(|w| w / 8.0).collect() } else { ws.clone() }).unwrap();
                let dsums = c.gpu.upload(&delta.iter().map(|&v| (v * 8.0) as i32).collect::<Vec<i32>>()).unwrap();
                let scale = deferred.then(|| OuterScale { sums_i32: if sums { dsums.ptr() } else { 0 }, ..OuterScale::bf16(ds.ptr(), dws.ptr()) });
                unsafe { c.kernels.add_rmsnorm_quant(s, w8, dres.ptr(), Some(ddelta.ptr()), dw.ptr(), dout.ptr(), dq.ptr(), ds.ptr(), rows, hidden, eps, None, scale).unwrap() };
                let res_after = dres.download(s).unwrap();
                // Equal values (exact sums); == because int32 sums carry no -0.0 (a -0.0 residual
                // plus a zero delta gives +0.0 there, -0.0 from a bf16 -0.0 delta).
                assert!(res_after.iter().zip(&summed).all(|(a, b)| a == b), "residual += delta");
                for (i, (&bits, &w)) in dout.download(s).unwrap().iter().zip(&want).enumerate() {
                    let g = bf16::from_bits(bits).to_f32();
                    assert!((g - w).abs() <= w.abs() / 128.0 + 1e-6, "{format:?} normed bf16 [{i}]: {g} vs {w}");
                }
                let what = format!("rmsnorm {rows}x{hidden}{}", if sums { " (int32 sums, scales deferred)" } else if deferred { " (scales deferred)" } else { "" });
                // Deferred: exact sums, but the scaled values' squares no longer sum exactly.
                check_codes(format, &what, rows, hidden, &want, &dq.download(s).unwrap(), &ds.download(s).unwrap(), exact && !deferred);
            }
        }
    }
}

#[test]
fn fused_silu_mul_quant_matches_the_cpu_swiglu_then_quantize() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    for (format, w8) in FORMATS {
        if !ready(&c, w8) {
            continue;
        }
        // sums: gate|up as an int8 GEMM leaves it, int32 sums in their own buffer (the bf16 one poisoned).
        // Blocks the kernel cannot rotate are refused before any launch (1024 does not tile 1536).
        for bad in [3usize, 4, 4096, 1024] {
            let r = unsafe { c.kernels.silu_mul_quant(s, w8, 0, 0, 0, 0, 2, 1536, None, None, Some(bad)) };
            assert!(r.is_err(), "{format:?}: a Walsh–Hadamard block of {bad}");
        }
        // had: down_proj's online rotation (`--quantization-rotation`), SmolLM2's and Llama-3.1-8B's blocks.
        for (rows, inter, deferred, sums, had) in [
            (2usize, 1536usize, false, false, None),
            (17, 14336, false, false, None),
            (17, 14336, true, false, None),
            (17, 14336, true, true, None),
            (2, 1536, false, false, Some(512usize)),
            (17, 14336, true, true, Some(2048)),
            (5, 1536, true, false, Some(8)),
            // Blocks within a warp only (no shared memory), and a row that ends inside a warp.
            (3, 1536, false, false, Some(256)),
            (4, 320, false, false, Some(64)),
        ] {
            let mut gate_up = values(rows * 2 * inter, 21, 4.0);
            // A token whose SwiGLU is all zeros: scale 0, codes 0.
            gate_up[2 * inter..4 * inter].fill(0.0);
            let bits: Vec<u16> = gate_up.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
            // int32 sums: 64 × the values, rounded (the row scales take the 1/64: powers of two, exact).
            let ints: Vec<i32> = gate_up.iter().map(|&v| (v * 64.0).round() as i32).collect();
            // deferred: gate|up unscaled, scaled by the kernel (powers of two: exact).
            let (xs, ws) = deferred_scales(rows, 2 * inter, deferred);
            let ws: Vec<f32> = if sums { ws.iter().map(|w| w / 64.0).collect() } else { ws };
            let gu: Vec<f32> = (0..rows * 2 * inter)
                .map(|i| {
                    let v = if sums { ints[i] as f32 } else { bf16::from_bits(bits[i]).to_f32() };
                    v * (xs[i / (2 * inter)] * ws[i % (2 * inter)])
                })
                .collect();
            let mut want = vec![0f32; rows * inter];
            swiglu(&gu, inter, &mut want);
            if let Some(b) = had {
                // What the CPU backend does before down_proj reads the row.
                peregrine_engine::backend::cpu::hadamard::rotate_heads(&mut want, b);
            }
            let dgu = c.gpu.upload(&if sums { vec![0xFFFFu16; bits.len()] } else { bits.clone() }).unwrap();
            let dints = c.gpu.upload(&ints).unwrap();
            let dout = c.gpu.upload(&vec![0xFFFFu16; rows * inter]).unwrap();
            let dq = c.gpu.upload(&vec![0xAAu8; rows * inter]).unwrap();
            let ds = c.gpu.upload(&if deferred { xs.clone() } else { vec![f32::NAN; rows] }).unwrap();
            let dws = c.gpu.upload(&ws).unwrap();
            let scale = deferred.then(|| OuterScale { sums_i32: if sums { dints.ptr() } else { 0 }, ..OuterScale::bf16(ds.ptr(), dws.ptr()) });
            unsafe { c.kernels.silu_mul_quant(s, w8, dout.ptr(), dq.ptr(), ds.ptr(), dgu.ptr(), rows, inter, None, scale, had).unwrap() };
            for (i, (&b, &w)) in dout.download(s).unwrap().iter().zip(&want).enumerate() {
                let g = bf16::from_bits(b).to_f32();
                assert!((g - w).abs() <= w.abs() / 128.0 + 1e-6, "{format:?} SwiGLU bf16 [{i}]: {g} vs {w}");
            }
            let (q, sc) = (dq.download(s).unwrap(), ds.download(s).unwrap());
            assert_eq!(sc[1], 0.0, "zero token's scale");
            let what = format!("silu_mul {rows}x{inter}{}{}", if sums { " (int32 sums, scales deferred)" } else if deferred { " (scales deferred)" } else { "" }, had.map_or(String::new(), |b| format!(" rotated in blocks of {b}")));
            check_codes(format, &what, rows, inter, &want, &q, &sc, false);
        }
    }
}

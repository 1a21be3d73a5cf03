//! Diagnostic for `--quantization fp8|int8` on the CUDA backend: SmolLM2's layer 0, stage by stage,
//! the GPU kernels against the CPU backend's functions on the *same* inputs (the real activations of
//! the fixture prompts, computed on the CPU in f32), so that a whole-model gap between the two
//! backends (cuda_smollm2_w8a8) can be pinned to one stage. Stages:
//! 1. RMSNorm + per-token quantization (`add_rmsnorm_quant`) vs `rms_norm` + `quantize_activations`:
//!    token scales, and codes more than one step away (must be none);
//! 2. the fused q|k|v linear (8-bit GEMV for ≤ 16 tokens, GEMM above) on the GPU's codes vs the CPU's
//!    `matmul` (W8A8) on the same f32 activations, per output column group (q, k, v) so that a row
//!    scale carried to the wrong column shows as one group off;
//! 3. the fused gate|up linear, likewise (gate, up);
//! 4. SiLU·mul + quantization (`silu_mul_quant`, from the CPU's gate|up rounded to bf16, what the GPU
//!    reads) and the down projection vs `swiglu` + `matmul` on the f32 gate|up.
//! Each line prints max |Δ| and the reference's max |value| at that stage; asserted loosely (a wiring
//! bug gives |Δ| of the order of the values, rounding gives ~1 %). Runs in a few seconds.
//! Skips visibly without a GPU (below 8.9 for fp8) unless PEREGRINE_REQUIRE_GPU (PEREGRINE_REQUIRE_FP8).

mod common;
mod cuda_common;

use cuda_common::{report, u32s};
use half::bf16;
use peregrine_engine::backend::cpu::matmul::matmul;
use peregrine_engine::backend::cpu::ops::{rms_norm, swiglu};
use peregrine_engine::backend::cpu::simd::Isa;
use peregrine_engine::model::rowquant::{quantize_activations, RowFormat, RowQuantMatrix};
use peregrine_engine::model::{self, LoadFormat, Matrix};
use peregrine_kernels::testing::cuda_or_skip;
use peregrine_kernels::{Cuda, OutType, W8Format};

fn kernel_format(f: RowFormat) -> W8Format {
    match f {
        RowFormat::Fp8E4m3 => W8Format::E4m3,
        RowFormat::Int8 => W8Format::I8,
    }
}

/// One code step of `format` at the magnitude of `v` (unscaled code values), as cuda_w8a8.rs.
fn code_step(format: RowFormat, v: f32) -> f32 {
    match format {
        RowFormat::Int8 => 1.0,
        // 3 mantissa bits; the subnormal grid below 2⁻⁶ has steps of 2⁻⁹.
        RowFormat::Fp8E4m3 => (2f32.powi(v.abs().max(2f32.powi(-6)).log2().floor() as i32 - 3)).max(2f32.powi(-9)),
    }
}

/// max |a - b| and max |b|.
fn gap(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    (d, b.iter().fold(0f32, |m, v| m.max(v.abs())))
}

/// Prints (and loosely asserts) one stage's gap over column groups `groups` (name, first, width) of
/// rows of `width` values.
fn stage(what: &str, got: &[f32], want: &[f32], width: usize, groups: &[(&str, usize, usize)]) {
    let mut line = format!("{what}:");
    for &(name, c0, w) in groups {
        let (g, r): (Vec<f32>, Vec<f32>) = got
            .chunks_exact(width)
            .zip(want.chunks_exact(width))
            .flat_map(|(a, b)| a[c0..c0 + w].iter().copied().zip(b[c0..c0 + w].iter().copied()))
            .unzip();
        let (d, m) = gap(&g, &r);
        line.push_str(&format!(" {name} max |Δ| {d:.4} (max |ref| {m:.3}, {:.2} %)", 100.0 * d / m.max(1e-30)));
        assert!(d <= 0.1 * m, "{what} {name}: max |Δ| {d} against values up to {m}: a wiring bug, not rounding");
    }
    report(&line);
}

fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

/// GPU `linear_w8` of the codes/scales in (xq, xs) against the CPU's W8A8 `matmul` of `x`.
fn linear(c: &Cuda, f: RowFormat, parts: &[&Matrix], xq: u64, xs: u64, x: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>) {
    let q: Vec<RowQuantMatrix> = parts.iter().map(|m| RowQuantMatrix::quantize(f, m.rows, m.cols, &m.to_f32()).unwrap()).collect();
    let fused = RowQuantMatrix::concat_rows(&q.iter().collect::<Vec<_>>()).unwrap();
    let (n, k) = (fused.rows, fused.cols);
    let dw = c.gpu.upload(fused.codes()).unwrap();
    let dws = c.gpu.upload(fused.scales()).unwrap();
    let y = c.gpu.upload(&vec![f32::NAN; rows * n]).unwrap();
    unsafe { c.linear_w8(kernel_format(f), y.ptr(), OutType::F32, xq, xs, dw.ptr(), dws.ptr(), rows, n, k).unwrap() };
    let got = y.download(&c.gpu.stream).unwrap();
    let mut want = vec![0f32; rows * n];
    matmul(Isa::detect(), x, rows, &Matrix::from_row_quant(fused), &mut want);
    (got, want)
}

fn layer0_stages(f: RowFormat) {
    let Some(c) = cuda_or_skip() else { return };
    let w8 = kernel_format(f);
    if !c.kernels.w8_ready(w8) {
        assert!(std::env::var_os("PEREGRINE_REQUIRE_FP8").is_none() || f == RowFormat::Int8, "PEREGRINE_REQUIRE_FP8 set on a GPU without {f:?} support");
        report(&format!("skipped: {f:?} kernels need a newer GPU"));
        return;
    }
    let s = &c.gpu.stream;
    let weights = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF").weights;
    let cfg = weights.config.clone();
    let (h, inter, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps);
    let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
    let l0 = &weights.layers[0];
    let reference = common::reference();
    let ids: Vec<u32> = reference["prompts"].as_array().unwrap().iter().flat_map(|p| u32s(&p["input_ids"])).collect();
    // 8 tokens: the GEMV; all prompts' tokens: the GEMM (when more than 16).
    for rows in [ids.len().min(8), ids.len()] {
        let path = if rows <= peregrine_kernels::ops::GEMV_FP8_MAX_M { "GEMV" } else { "GEMM" };
        let tag = format!("{f:?} layer 0, {rows} tokens ({path})");
        let mut x = vec![0f32; rows * h];
        for (r, &t) in ids[..rows].iter().enumerate() {
            weights.embed_tokens.row_into(t as usize, &mut x[r * h..(r + 1) * h]);
        }
        // 1. input RMSNorm + quantization, from the f32 residual (layer 0: no delta).
        let mut normed = vec![0f32; rows * h];
        rms_norm(&x, &l0.input_layernorm, eps, &mut normed);
        let (want_vals, want_scales) = quantize_activations(f, &normed, rows, h);
        let dres = c.gpu.upload(&x).unwrap();
        let dnw = c.gpu.upload(&l0.input_layernorm).unwrap();
        let dout = c.gpu.alloc_zeros::<u16>(rows * h).unwrap();
        let dq = c.gpu.alloc_zeros::<u8>(rows * h.max(inter)).unwrap();
        let ds = c.gpu.alloc_zeros::<f32>(rows).unwrap();
        unsafe { c.kernels.add_rmsnorm_quant(s, w8, dres.ptr(), None, dnw.ptr(), dout.ptr(), dq.ptr(), ds.ptr(), rows, h, eps, None, None).unwrap() };
        let got_s = ds.download(s).unwrap();
        let got_q = dq.download(s).unwrap();
        let scale_gap = got_s.iter().zip(&want_scales).fold(0f32, |m, (a, b)| m.max((a - b).abs() / b.abs().max(1e-30)));
        let far = got_q[..rows * h].iter().zip(&want_vals).filter(|(&q, &v)| (f.decode(q) - v).abs() > code_step(f, f.decode(q).abs().max(v.abs()))).count();
        let differ = got_q[..rows * h].iter().zip(&want_vals).filter(|(&q, &v)| f.decode(q) != v).count();
        report(&format!("{tag}: norm+quant: token scales within rel {scale_gap:.2e}, {differ} of {} codes differ from the CPU's, {far} by more than one step", rows * h));
        assert!(scale_gap < 1e-5 && far == 0, "{tag}: the fused RMSNorm quantizer disagrees with the CPU");
        // 2. q|k|v.
        let (got, want) = linear(&c, f, &[&l0.q_proj, &l0.k_proj, &l0.v_proj], dq.ptr(), ds.ptr(), &normed, rows);
        stage(&format!("{tag}: q|k|v"), &got, &want, qd + 2 * kvd, &[("q", 0, qd), ("k", qd, kvd), ("v", qd + kvd, kvd)]);
        // 3. gate|up, on the same codes.
        let (got, gate_up) = linear(&c, f, &[&l0.gate_proj, &l0.up_proj], dq.ptr(), ds.ptr(), &normed, rows);
        stage(&format!("{tag}: gate|up"), &got, &gate_up, 2 * inter, &[("gate", 0, inter), ("up", inter, inter)]);
        // 4. SiLU·mul + quantization from the CPU's gate|up as bf16 (what the GPU's GEMM writes), then down.
        let gate_up_bf: Vec<f32> = gate_up.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let mut act = vec![0f32; rows * inter];
        swiglu(&gate_up_bf, inter, &mut act);
        let dgu = c.gpu.upload(&bf16_bits(&gate_up_bf)).unwrap();
        let dact = c.gpu.alloc_zeros::<u16>(rows * inter).unwrap();
        unsafe { c.kernels.silu_mul_quant(s, w8, dact.ptr(), dq.ptr(), ds.ptr(), dgu.ptr(), rows, inter, None, None, None).unwrap() };
        let (act_vals, act_scales) = quantize_activations(f, &act, rows, inter);
        let got_s = ds.download(s).unwrap();
        let got_q = dq.download(s).unwrap();
        let scale_gap = got_s.iter().zip(&act_scales).fold(0f32, |m, (a, b)| m.max((a - b).abs() / b.abs().max(1e-30)));
        let differ = got_q[..rows * inter].iter().zip(&act_vals).filter(|(&q, &v)| f.decode(q) != v).count();
        report(&format!("{tag}: silu·mul+quant: token scales within rel {scale_gap:.2e}, {differ} of {} codes differ", rows * inter));
        let (got, want) = linear(&c, f, &[&l0.down_proj], dq.ptr(), ds.ptr(), &act, rows);
        stage(&format!("{tag}: down"), &got, &want, h, &[("down", 0, h)]);
    }
}

#[test]
fn fp8_layer0_stages_match_the_cpu() {
    layer0_stages(RowFormat::Fp8E4m3);
}

#[test]
fn int8_layer0_stages_match_the_cpu() {
    layer0_stages(RowFormat::Int8);
}

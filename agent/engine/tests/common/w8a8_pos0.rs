//! A host emulation of one token at position 0 through a W8A8 model (weights already row-quantized),
//! with the CUDA backend's bf16 rounding points switchable, built from the CPU backend's own
//! functions (`matmul` = W8A8 with per-token activation quantization, `rms_norm`, `swiglu`).
//!
//! At position 0 attention has one key, so its output is the token's own v (softmax weight exactly
//! 1) and RoPE is the identity: the whole forward is linears, norms and SwiGLU, which this file can
//! reproduce exactly. With no rounding it equals the CPU backend (checked in CI by
//! `w8a8_pos0_emulation`); with the GPU's rounding points it predicts what a correctly wired CUDA
//! W8A8 backend computes (checked on the GPU by `cuda_smollm2_w8a8`). That separates a wiring bug
//! from the legitimate effect of the GPU's bf16 intermediates.

use half::bf16;
use peregrine_engine::backend::cpu::matmul::matmul;
use peregrine_engine::backend::cpu::ops::{rms_norm, swiglu};
use peregrine_engine::backend::cpu::simd::Isa;
use peregrine_engine::model::{Matrix, ModelWeights};

/// Where the CUDA backend rounds to bf16 (each as the GPU does it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rounding {
    /// The embedding table (bf16 on the device).
    Embedding,
    /// The q|k|v linear's output (then the bf16 KV cache; attention at position 0 returns v).
    V,
    /// The o projection's output (`delta`, added to the f32 residual).
    O,
    /// The gate|up linear's output (SwiGLU reads bf16).
    GateUp,
    /// The down projection's output.
    Down,
    /// The final norm's output and the LM head weights (a bf16 GEMM).
    Head,
}

pub const ALL: [Rounding; 6] = [Rounding::Embedding, Rounding::V, Rounding::O, Rounding::GateUp, Rounding::Down, Rounding::Head];

fn round(v: &mut [f32]) {
    for x in v {
        *x = bf16::from_f32(*x).to_f32();
    }
}

/// Logits of token `t` at position 0; `rounded`: the bf16 rounding points to apply.
pub fn logits(w: &ModelWeights, t: u32, rounded: &[Rounding]) -> Vec<f32> {
    let on = |r: Rounding| rounded.contains(&r);
    let c = &w.config;
    let isa = Isa::detect();
    let (h, inter, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let group = c.num_attention_heads / c.num_key_value_heads;
    let mut x = vec![0f32; h];
    w.embed_tokens.row_into(t as usize, &mut x);
    if on(Rounding::Embedding) {
        round(&mut x);
    }
    let mut xn = vec![0f32; h];
    for l in &w.layers {
        rms_norm(&x, &l.input_layernorm, c.rms_norm_eps, &mut xn);
        let mut v = vec![0f32; c.kv_dim()];
        matmul(isa, &xn, 1, &l.v_proj, &mut v);
        if on(Rounding::V) {
            round(&mut v);
        }
        if let Some(b) = &l.v_bias {
            v.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            if on(Rounding::V) {
                round(&mut v);
            }
        }
        let mut attn = vec![0f32; c.q_dim()];
        for (head, out) in attn.chunks_exact_mut(hd).enumerate() {
            let kv = head / group;
            out.copy_from_slice(&v[kv * hd..(kv + 1) * hd]);
        }
        let mut d = vec![0f32; h];
        matmul(isa, &attn, 1, &l.o_proj, &mut d);
        if on(Rounding::O) {
            round(&mut d);
        }
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
        rms_norm(&x, &l.post_attention_layernorm, c.rms_norm_eps, &mut xn);
        let mut gu = vec![0f32; 2 * inter];
        matmul(isa, &xn, 1, &l.gate_proj, &mut gu[..inter]);
        matmul(isa, &xn, 1, &l.up_proj, &mut gu[inter..]);
        if on(Rounding::GateUp) {
            round(&mut gu);
        }
        let mut act = vec![0f32; inter];
        swiglu(&gu, inter, &mut act);
        matmul(isa, &act, 1, &l.down_proj, &mut d);
        if on(Rounding::Down) {
            round(&mut d);
        }
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);
    }
    rms_norm(&x, &w.norm, c.rms_norm_eps, &mut xn);
    let head = w.lm_head();
    let mut weights = head.to_f32();
    if on(Rounding::Head) {
        round(&mut xn);
        round(&mut weights);
    }
    let mut out = vec![0f32; head.rows];
    matmul(isa, &xn, 1, &Matrix::from_f32(head.rows, head.cols, weights), &mut out);
    out
}

/// max |a - b| over `reference`'s top-10 ids.
pub fn top10_gap(a: &[f32], reference: &[f32]) -> f32 {
    let mut ids: Vec<usize> = (0..reference.len()).collect();
    ids.sort_by(|&x, &y| reference[y].total_cmp(&reference[x]));
    ids[..10].iter().fold(0f32, |m, &i| m.max((a[i] - reference[i]).abs()))
}

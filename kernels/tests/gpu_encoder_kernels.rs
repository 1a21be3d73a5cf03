//! The encoder's kernels (encoder.cu) and the f32 GEMM against f64 CPU references on fresh random
//! inputs, so that a failure of the end-to-end encoder test on a GPU (`cuda_encoder` in the engine)
//! can be traced to one kernel. f32 in and out: checked at 1e-5 absolute on O(1) values (f32
//! rounding of sums of a few hundred terms is ~1e-6). Skipped visibly without a GPU.

use peregrine_kernels::ops::{encoder_attention_tiles, encoder_attention_tiles_of, EmbeddingTables, EncoderActivation, EncoderKernels, NormParams, ENC_ATTN_MMA_WARPS};
use peregrine_kernels::testing::cuda_or_skip;
use peregrine_kernels::{compile, Cuda};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const TOL: f64 = 1e-5;

fn setup() -> Option<(Cuda, EncoderKernels, ChaCha8Rng)> {
    let cuda = cuda_or_skip()?;
    let module = compile::load_module(&cuda.gpu.ctx, cuda.gpu.arch).unwrap();
    let kernels = EncoderKernels::load(&module, 132).unwrap();
    let seed: u64 = rand::rng().random();
    eprintln!("seed {seed}");
    Some((cuda, kernels, ChaCha8Rng::seed_from_u64(seed)))
}

fn random(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-scale..scale)).collect()
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - w).abs() <= TOL, "{what}[{i}]: got {g}, want {w}");
    }
}

fn layer_norm(row: &[f64], gamma: &[f32], beta: &[f32], eps: f64) -> Vec<f64> {
    let n = row.len() as f64;
    let mean = row.iter().sum::<f64>() / n;
    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    row.iter().zip(gamma).zip(beta).map(|((v, &g), &b)| (v - mean) * inv * g as f64 + b as f64).collect()
}

/// Bidirectional attention of each sequence over itself in f64, from `qkv` rows (q | k | v).
fn reference_attention(qkv: &[f32], lengths: &[usize], heads: usize, d: usize) -> Vec<f64> {
    let h = heads * d;
    let n: usize = lengths.iter().sum();
    let mut want = vec![0f64; n * h];
    let scale = 1.0 / (d as f64).sqrt();
    let mut start = 0;
    for &len in lengths {
        for head in 0..heads {
            for i in 0..len {
                let q = |e: usize| qkv[(start + i) * 3 * h + head * d + e] as f64;
                let scores: Vec<f64> = (0..len).map(|j| (0..d).map(|e| q(e) * qkv[(start + j) * 3 * h + h + head * d + e] as f64).sum::<f64>() * scale).collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = p.iter().sum();
                for e in 0..d {
                    want[(start + i) * h + head * d + e] = (0..len).map(|j| p[j] * qkv[(start + j) * 3 * h + 2 * h + head * d + e] as f64).sum::<f64>() / sum;
                }
            }
        }
        start += len;
    }
    want
}

/// f32 rounded to bf16 (nearest even), back as f32: what the tensor-core kernel multiplies.
fn round_bf16(v: f32) -> f32 {
    let b = v.to_bits();
    f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

/// A kernel's bf16 copy of its output (for the next bf16 GEMM) is the f32 output rounded to
/// nearest even, bit for bit.
fn assert_bf16_copy(copy: &[u16], f32_out: &[f32], what: &str) {
    assert_eq!(copy.len(), f32_out.len(), "{what}: bf16 copy length");
    for (i, (&c, &v)) in copy.iter().zip(f32_out).enumerate() {
        assert_eq!(c as u32, round_bf16(v).to_bits() >> 16, "{what}: bf16 copy [{i}] of {v}");
    }
}

#[test]
fn varlen_attention_matches_per_sequence_softmax() {
    let Some((cuda, k, mut r)) = setup() else { return };
    // Head dims of MiniLM (32), BERT (64) and an odd one; lengths across tile (16) and chunk (32)
    // boundaries, and a single token.
    for (heads, d) in [(12usize, 32usize), (4, 64), (2, 80)] {
        let h = heads * d;
        let lengths = [1usize, 16, 17, 33, 70, 3];
        let n: usize = lengths.iter().sum();
        let qkv = random(&mut r, n * 3 * h, 2.0);
        let tiles = encoder_attention_tiles(lengths).unwrap();
        let s = &cuda.gpu.stream;
        let (qkv_d, tiles_d, ctx_d) = (cuda.gpu.upload(&qkv).unwrap(), cuda.gpu.upload(&tiles).unwrap(), cuda.gpu.upload(&vec![f32::NAN; n * h]).unwrap());
        unsafe { k.attention(s, ctx_d.ptr(), qkv_d.ptr(), tiles_d.ptr(), tiles.len() / 3, heads, d).unwrap() };
        let got = ctx_d.download(s).unwrap();
        let want = reference_attention(&qkv, &lengths, heads, d);
        assert_close(&got, &want, &format!("attention heads {heads} d {d}"));
    }
}

/// The tensor-core kernel against f64 attention over the same inputs rounded to bf16 (what its
/// mma steps read): what is left is the probabilities' bf16 rounding (≤ 2⁻⁹ of each, so ≤ 2⁻⁹ ·
/// max|v| ≈ 0.004 here) and f32 sums; 0.01 bounds it. Both block shapes (1 and 4 warps); lengths
/// cross the query tiles, the 64-key tiles and their 16-key groups; rows of other sequences (NaN-free random values) must not leak in, and a sequence
/// batched must give the bits it gives alone.
#[test]
fn tensor_core_attention_matches_bf16_rounded_reference() {
    let Some((cuda, k, mut r)) = setup() else { return };
    let s = &cuda.gpu.stream;
    for warps in ENC_ATTN_MMA_WARPS {
        let tile = 16 * warps;
        for (heads, d) in [(12usize, 32usize), (4, 64), (2, 128)] {
            let h = heads * d;
            let lengths = [1usize, 16, 64, 65, 130, 3, 200, 17];
            let n: usize = lengths.iter().sum();
            let qkv = random(&mut r, n * 3 * h, 2.0);
            let tiles = encoder_attention_tiles_of(lengths, tile).unwrap();
            let (qkv_d, tiles_d, ctx_d) = (cuda.gpu.upload(&qkv).unwrap(), cuda.gpu.upload(&tiles).unwrap(), cuda.gpu.upload(&vec![f32::NAN; n * h]).unwrap());
            unsafe { k.attention_mma(s, ctx_d.ptr(), qkv_d.ptr(), tiles_d.ptr(), tiles.len() / 3, heads, d, warps, 0).unwrap() };
            let got = ctx_d.download(s).unwrap();
            // The bf16 output (the output projection's input): the f32 one rounded, bit for bit.
            let ctxb_d = cuda.gpu.alloc_zeros::<u16>(n * h).unwrap();
            unsafe { k.attention_mma(s, ctx_d.ptr(), qkv_d.ptr(), tiles_d.ptr(), tiles.len() / 3, heads, d, warps, ctxb_d.ptr()).unwrap() };
            assert_bf16_copy(&ctxb_d.download(s).unwrap(), &got, &format!("tensor-core attention as bf16, {warps} warps, d {d}"));
            let rounded: Vec<f32> = qkv.iter().map(|&v| round_bf16(v)).collect();
            let want = reference_attention(&rounded, &lengths, heads, d);
            let worst = got.iter().zip(&want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0f64, |a, b| if b.is_nan() { f64::INFINITY } else { a.max(b) });
            assert!(worst <= 1e-2, "tensor-core attention, {warps} warps, heads {heads} d {d}: max |Δ| {worst}");
            // The sequence of 130 tokens alone: the same bits as in the batch.
            let (off, len) = (1 + 16 + 64 + 65, 130);
            let alone = &qkv[off * 3 * h..(off + len) * 3 * h];
            let tiles1 = encoder_attention_tiles_of([len], tile).unwrap();
            let (qkv1, tiles1_d, ctx1) = (cuda.gpu.upload(alone).unwrap(), cuda.gpu.upload(&tiles1).unwrap(), cuda.gpu.upload(&vec![0f32; len * h]).unwrap());
            unsafe { k.attention_mma(s, ctx1.ptr(), qkv1.ptr(), tiles1_d.ptr(), tiles1.len() / 3, heads, d, warps, 0).unwrap() };
            let got1 = ctx1.download(s).unwrap();
            assert!(got1.iter().zip(&got[off * h..(off + len) * h]).all(|(a, b)| a.to_bits() == b.to_bits()), "{warps} warps, heads {heads} d {d}: batched differs from alone");
        }
    }
    // Head sizes and block shapes it is not built for are refused, not mis-computed.
    let dummy = cuda.gpu.upload(&vec![0f32; 3 * 128]).unwrap();
    let tiles = cuda.gpu.upload(&encoder_attention_tiles_of([1usize], 64).unwrap()).unwrap();
    assert!(unsafe { k.attention_mma(s, dummy.ptr(), dummy.ptr(), tiles.ptr(), 1, 1, 80, 4, 0) }.is_err());
    assert!(unsafe { k.attention_mma(s, dummy.ptr(), dummy.ptr(), tiles.ptr(), 1, 1, 32, 2, 0) }.is_err());
}

#[test]
fn embedding_sum_and_residual_layernorms_match() {
    let Some((cuda, k, mut r)) = setup() else { return };
    let (h, vocab, positions, types, n) = (384usize, 50usize, 20usize, 2usize, 7usize);
    let (word, position, token_type) = (random(&mut r, vocab * h, 1.0), random(&mut r, positions * h, 1.0), random(&mut r, types * h, 1.0));
    let (gamma, beta) = (random(&mut r, h, 1.5), random(&mut r, h, 0.5));
    let eps = 1e-12f32;
    let meta: Vec<i32> = (0..n).flat_map(|t| [(t * 7 % vocab) as i32, (t % types) as i32, (t + 2) as i32]).collect();
    let g = &cuda.gpu;
    let s = &g.stream;
    let up = |v: &[f32]| g.upload(v).unwrap();
    let (word_d, pos_d, tt_d, gamma_d, beta_d) = (up(&word), up(&position), up(&token_type), up(&gamma), up(&beta));
    let meta_d = g.upload(&meta).unwrap();
    let x_d = up(&vec![f32::NAN; n * h]);
    let norm = NormParams { gamma: gamma_d.ptr(), beta: beta_d.ptr(), eps };
    let tables = EmbeddingTables { word: word_d.ptr(), position: pos_d.ptr(), token_type: tt_d.ptr() };
    let xb_d = g.alloc_zeros::<u16>(n * h).unwrap();
    unsafe { k.embed_layernorm(s, x_d.ptr(), meta_d.ptr(), tables, norm, n, h, xb_d.ptr()).unwrap() };
    let x = x_d.download(s).unwrap();
    assert_bf16_copy(&xb_d.download(s).unwrap(), &x, "embedding + LayerNorm");
    let mut want = Vec::new();
    for m in meta.chunks(3) {
        let (id, ty, pos) = (m[0] as usize, m[1] as usize, m[2] as usize);
        let row: Vec<f64> = (0..h).map(|j| word[id * h + j] as f64 + position[pos * h + j] as f64 + token_type[ty * h + j] as f64).collect();
        want.extend(layer_norm(&row, &gamma, &beta, eps as f64));
    }
    assert_close(&x, &want, "embedding + LayerNorm");

    // x = LayerNorm(x + y + bias), from the x just made.
    let (y, bias) = (random(&mut r, n * h, 1.0), random(&mut r, h, 0.5));
    let (y_d, bias_d) = (up(&y), up(&bias));
    unsafe { k.add_bias_layernorm(s, x_d.ptr(), y_d.ptr(), bias_d.ptr(), norm, n, h, xb_d.ptr()).unwrap() };
    let got = x_d.download(s).unwrap();
    assert_bf16_copy(&xb_d.download(s).unwrap(), &got, "residual + bias + LayerNorm");
    let want: Vec<f64> = (0..n)
        .flat_map(|t| {
            let row: Vec<f64> = (0..h).map(|j| x[t * h + j] as f64 + y[t * h + j] as f64 + bias[j] as f64).collect();
            layer_norm(&row, &gamma, &beta, eps as f64)
        })
        .collect();
    assert_close(&got, &want, "residual + bias + LayerNorm");
}

#[test]
fn bias_activation_and_f32_gemm_match() {
    let Some((cuda, k, mut r)) = setup() else { return };
    let (m, n, kk) = (37usize, 96usize, 384usize);
    let (x, w) = (random(&mut r, m * kk, 1.0), random(&mut r, n * kk, 0.1));
    let g = &cuda.gpu;
    let s = &g.stream;
    let (x_d, w_d, y_d) = (g.upload(&x).unwrap(), g.upload(&w).unwrap(), g.upload(&vec![f32::NAN; m * n]).unwrap());
    unsafe { cuda.blas.matmul_f32(y_d.ptr(), x_d.ptr(), w_d.ptr(), m, n, kk, 0.0).unwrap() };
    let y = y_d.download(s).unwrap();
    let want: Vec<f64> = (0..m).flat_map(|i| (0..n).map(|j| (0..kk).map(|e| x[i * kk + e] as f64 * w[j * kk + e] as f64).sum::<f64>()).collect::<Vec<_>>()).collect();
    // Not TF32: TF32 (10-bit mantissa) would be off by ~1e-3 here.
    assert_close(&y, &want, "f32 GEMM");

    let bias = random(&mut r, n, 0.5);
    let bias_d = g.upload(&bias).unwrap();
    for act in [EncoderActivation::None, EncoderActivation::GeluTanh, EncoderActivation::Relu] {
        let z_d = g.upload(&y).unwrap();
        unsafe { k.bias_act(s, z_d.ptr(), bias_d.ptr(), m, n, act, 0).unwrap() };
        let got = z_d.download(s).unwrap();
        // With a bf16 output: the same values rounded, there, and y untouched.
        let (y2_d, yb_d) = (g.upload(&y).unwrap(), g.alloc_zeros::<u16>(m * n).unwrap());
        unsafe { k.bias_act(s, y2_d.ptr(), bias_d.ptr(), m, n, act, yb_d.ptr()).unwrap() };
        assert_bf16_copy(&yb_d.download(s).unwrap(), &got, &format!("bias + {act:?} as bf16"));
        assert!(y2_d.download(s).unwrap().iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "bias + {act:?}: y written with a bf16 output");
        let want: Vec<f64> = y
            .iter()
            .enumerate()
            .map(|(e, &v)| {
                let v = v as f64 + bias[e % n] as f64;
                match act {
                    EncoderActivation::GeluTanh => 0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh()),
                    EncoderActivation::Relu => v.max(0.0),
                    _ => v,
                }
            })
            .collect();
        assert_close(&got, &want, &format!("bias + {act:?}"));
    }
}

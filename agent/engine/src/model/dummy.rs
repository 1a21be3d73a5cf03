//! Random weights from a config alone, for benchmarks and tests without a checkpoint.
//!
//! Uniform values scaled by `1/sqrt(fan_in)` keep every projection's output near unit scale, and
//! RMSNorm weights of 1 keep the residual stream normalised, so activations stay finite at any depth.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::weights::{LayerWeights, Matrix, ModelWeights};
use crate::config::ModelConfig;

fn matrix(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> Matrix {
    let bound = (3.0 / cols as f32).sqrt();
    Matrix::from_f32(
        rows,
        cols,
        (0..rows * cols)
            .map(|_| rng.random_range(-bound..bound))
            .collect(),
    )
}

fn small_vec(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-0.02f32..0.02)).collect()
}

/// The same `seed` and config always give the same weights.
pub fn dummy_weights(config: &ModelConfig, seed: u64) -> ModelWeights {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let c = config;
    let (h, q, kv, inter) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let embed_tokens = matrix(&mut rng, c.vocab_size, h);
    let layers = (0..c.num_hidden_layers)
        .map(|_| LayerWeights {
            input_layernorm: vec![1.0; h],
            q_proj: matrix(&mut rng, q, h),
            k_proj: matrix(&mut rng, kv, h),
            v_proj: matrix(&mut rng, kv, h),
            o_proj: matrix(&mut rng, h, q),
            q_bias: c.attention_bias.then(|| small_vec(&mut rng, q)),
            k_bias: c.attention_bias.then(|| small_vec(&mut rng, kv)),
            v_bias: c.attention_bias.then(|| small_vec(&mut rng, kv)),
            post_attention_layernorm: vec![1.0; h],
            gate_proj: matrix(&mut rng, inter, h),
            up_proj: matrix(&mut rng, inter, h),
            down_proj: matrix(&mut rng, h, inter),
        })
        .collect();
    let lm_head = (!c.tie_word_embeddings).then(|| matrix(&mut rng, c.vocab_size, h));
    ModelWeights {
        config: config.clone(),
        embed_tokens,
        layers,
        norm: vec![1.0; h],
        lm_head,
        down_input_hadamard: None,
    }
}

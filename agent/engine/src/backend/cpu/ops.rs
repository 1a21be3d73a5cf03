//! Element-wise and per-row ops, computed as transformers computes them in float32.

use crate::config::{Llama3RopeScaling, ModelConfig};

/// `out = w * (x / sqrt(mean(x²) + eps))` per row of `hidden` elements.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let hidden = w.len();
    for (xr, or) in x.chunks_exact(hidden).zip(out.chunks_exact_mut(hidden)) {
        let mut acc = [0f32; 16];
        let mut chunks = xr.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                acc[l] += c[l] * c[l];
            }
        }
        for (l, v) in chunks.remainder().iter().enumerate() {
            acc[l] += v * v;
        }
        let sum: f32 = acc.iter().sum();
        let inv = 1.0 / (sum / hidden as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = g * (v * inv);
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`; `gu` holds rows of `[gate | up]`, each `2 * inter` long, and
/// `out` rows are `inter` long.
pub fn swiglu(gu: &[f32], inter: usize, out: &mut [f32]) {
    for (row, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (g, u) = row.split_at(inter);
        for i in 0..inter {
            let x = g[i];
            o[i] = x / (1.0 + (-x).exp()) * u[i];
        }
    }
}

/// Rotate-half RoPE (HF layout), with optional Llama-3 frequency scaling.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(config: &ModelConfig) -> Rope {
        let dim = config.head_dim;
        let base = config.rope_theta;
        // As transformers: inv_freq = 1 / base^(2i/dim), in float32.
        let mut inv_freq: Vec<f32> =
            (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32)).collect();
        if let Some(s) = &config.rope_scaling {
            llama3_scale(&mut inv_freq, s);
        }
        Rope { head_dim: dim, inv_freq }
    }

    /// Rotates every head of one token's `x` (`n_heads * head_dim`) in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: u32, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.head_dim / 2;
        for i in 0..half {
            let angle = pos as f32 * self.inv_freq[i];
            cos[i] = angle.cos();
            sin[i] = angle.sin();
        }
        for head in x.chunks_exact_mut(self.head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x0, x1) = (a[i], b[i]);
                a[i] = x0 * cos[i] + (-x1) * sin[i];
                b[i] = x1 * cos[i] + x0 * sin[i];
            }
        }
    }

    pub fn half(&self) -> usize {
        self.head_dim / 2
    }
}

/// transformers' `_compute_llama3_parameters`: long wavelengths slowed by `factor`, short ones kept,
/// a smooth blend between.
fn llama3_scale(inv_freq: &mut [f32], s: &Llama3RopeScaling) {
    let old = s.original_max_position_embeddings as f32;
    let low_freq_wavelen = old / s.low_freq_factor;
    let high_freq_wavelen = old / s.high_freq_factor;
    for f in inv_freq.iter_mut() {
        let wavelen = 2.0 * std::f32::consts::PI / *f;
        let scaled = if wavelen > low_freq_wavelen { *f / s.factor } else { *f };
        let is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
        *f = if is_medium {
            let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
            (1.0 - smooth) * scaled / s.factor + smooth * scaled
        } else {
            scaled
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;

    fn config(scaling: Option<Llama3RopeScaling>) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 1,
            num_attention_heads: 1,
            num_key_value_heads: 1,
            head_dim: 64,
            vocab_size: 10,
            max_position_embeddings: 1024,
            rms_norm_eps: 1e-5,
            rope_theta: 500000.0,
            rope_scaling: scaling,
            tie_word_embeddings: true,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    #[test]
    fn llama3_scaling_matches_transformers_formula() {
        let s = Llama3RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192 };
        let plain = Rope::new(&config(None));
        let scaled = Rope::new(&config(Some(s)));
        // High frequencies (short wavelengths < 2048) are untouched.
        assert_eq!(plain.inv_freq[0], scaled.inv_freq[0]);
        // Low frequencies (wavelength > 8192) are divided by the factor.
        let last = plain.inv_freq.len() - 1;
        assert!((scaled.inv_freq[last] - plain.inv_freq[last] / 8.0).abs() < 1e-12);
        // Medium ones are blended (strictly between).
        for (p, q) in plain.inv_freq.iter().zip(&scaled.inv_freq) {
            let w = 2.0 * std::f32::consts::PI / p;
            if w > 2048.0 && w < 8192.0 {
                assert!(*q < *p && *q > *p / 8.0);
            }
        }
    }

    #[test]
    fn rope_rotates_halves() {
        let r = Rope::new(&config(None));
        let mut x = vec![0f32; 64];
        x[0] = 1.0;
        let (mut c, mut s) = (vec![0f32; 32], vec![0f32; 32]);
        r.apply(&mut x, 1, &mut c, &mut s);
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[32] - 1f32.sin()).abs() < 1e-6);
    }
}

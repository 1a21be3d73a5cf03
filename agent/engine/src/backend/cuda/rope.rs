//! RoPE cos/sin tables, computed on the host once per model the way transformers does it (inverse
//! frequencies and angles in f32, Llama-3 frequency scaling applied to the inverse frequencies).

use crate::config::ModelConfig;

/// The inverse frequencies `1 / theta^(2i/d)` for i in 0..d/2, with Llama-3 scaling when configured.
pub fn inv_freq(config: &ModelConfig) -> Vec<f32> {
    let d = config.head_dim;
    let base: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / config.rope_theta.powf((2 * i) as f32 / d as f32))
        .collect();
    let Some(s) = &config.rope_scaling else { return base };
    let old_len = s.original_max_position_embeddings as f32;
    let low_wavelen = old_len / s.low_freq_factor;
    let high_wavelen = old_len / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f32::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// `(cos, sin)`, each `[max_pos, head_dim / 2]` row-major: angle = f32(pos) * inv_freq in f32, as in
/// transformers' rotary embedding; cos/sin of that f32 angle rounded once to f32.
pub fn tables(config: &ModelConfig, max_pos: usize) -> (Vec<f32>, Vec<f32>) {
    let freqs = inv_freq(config);
    let half = freqs.len();
    let mut cos = Vec::with_capacity(max_pos * half);
    let mut sin = Vec::with_capacity(max_pos * half);
    for p in 0..max_pos {
        for &f in &freqs {
            let angle = (p as f32 * f) as f64;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

//! `--quantization-gptq`: calibration tokens, the second moments of every linear layer's inputs over
//! them, and the GPTQ-rounded 8-bit weights that follow (`model::gptq`).
//!
//! The calibration text is sampled from the model itself (temperature 1, each sequence starting from
//! a random token, as LLM-QAT's data-free calibration does): it needs no dataset, follows the
//! distribution the model serves, and shares nothing with the text `eval` measures perplexity on.
//! It is drawn by the Gumbel-max trick ([`gumbel_pick`]) so that every CPU samples the same tokens,
//! and so quantizes the same weights.
//! The inputs are those of the unquantized model (one pass, every layer at once; GPTQ's published
//! recipe feeds each layer the quantized layers' outputs instead, at one pass per layer).
//!
//! All of it runs on the CPU, with the unquantized weights in host memory: minutes for a model of a
//! few hundred million parameters, too slow for billions (quantize those once, offline, and load
//! the FP8 checkpoint).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::CpuBackend;
use crate::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use crate::config::ModelConfig;
use crate::model::gptq::{self, LayerInputs};
use crate::model::rowquant::{Activations, RowFormat};
use crate::model::{Matrix, ModelWeights};
use crate::{EngineError, Result};

/// How many calibration tokens, in how many sequences, from which seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CalibrationPlan {
    pub sequences: usize,
    pub tokens_per_sequence: usize,
    pub seed: u64,
}

impl Default for CalibrationPlan {
    /// 2048 tokens: 16 sequences of 128 (GPTQ's paper used 128 × 2048 for billions of parameters;
    /// a model's linear inputs have at most `intermediate_size` dimensions to cover).
    fn default() -> Self {
        CalibrationPlan { sequences: 16, tokens_per_sequence: 128, seed: 0x6770_7471 }
    }
}

const BLOCK_SIZE: usize = 16;

/// Most host memory the calibration's sums may take (f64 `x·xᵀ` of every layer's four inputs, held
/// at once): 16 GiB is a model of ~1–2B parameters (Llama-3.2-1B: 10 GiB; Llama-3.1-8B would need 65).
pub const MAX_LINEAR_INPUTS_BYTES: u64 = 16 << 30;

/// Most host memory the rounding's working buffers may take at once (layers run side by side up to it).
const ROUNDING_BUDGET_BYTES: u64 = 4 << 30;

/// Bytes of the sums [`linear_inputs`] keeps for a model of `c`'s shape.
pub fn linear_inputs_bytes(c: &ModelConfig) -> u64 {
    let sq = |d: usize| (d as u64).saturating_mul(d as u64);
    let per_layer = sq(c.hidden_size).saturating_mul(2).saturating_add(sq(c.q_dim())).saturating_add(sq(c.intermediate_size));
    per_layer.saturating_mul(c.num_hidden_layers as u64).saturating_mul(8)
}

/// Refuses a model whose calibration would not fit [`MAX_LINEAR_INPUTS_BYTES`], before any work.
pub fn check_size(c: &ModelConfig) -> Result<()> {
    let need = linear_inputs_bytes(c);
    if need > MAX_LINEAR_INPUTS_BYTES {
        return Err(EngineError::Unsupported(format!(
            "--quantization-gptq: this model's calibration would hold {:.1} GiB of input statistics in host memory, more than its limit of {} GiB (it is for models of up to ~1-2B parameters for now)",
            need as f64 / (1u64 << 30) as f64,
            MAX_LINEAR_INPUTS_BYTES >> 30
        )));
    }
    Ok(())
}

/// A CPU backend over `weights` with a KV cache for `plan`'s sequences side by side.
fn backend_for(weights: &ModelWeights, plan: CalibrationPlan, threads: usize) -> Result<(CpuBackend, usize)> {
    let blocks_per_seq = plan.tokens_per_sequence.div_ceil(BLOCK_SIZE).max(1);
    let shape = KvCacheShape { num_blocks: blocks_per_seq * plan.sequences.max(1), block_size: BLOCK_SIZE };
    Ok((CpuBackend::new(weights.clone(), shape, threads)?, blocks_per_seq))
}

fn block_table(seq: usize, blocks_per_seq: usize) -> Vec<u32> {
    (seq * blocks_per_seq..(seq + 1) * blocks_per_seq).map(|b| b as u32).collect()
}

/// Samples `plan`'s calibration sequences from the model (`weights`, unquantized): one random first
/// token each, then tokens drawn from the model's own distribution, all sequences decoded together.
pub fn sample_tokens(weights: &ModelWeights, plan: CalibrationPlan, threads: usize) -> Result<Vec<Vec<u32>>> {
    let vocab = weights.config.vocab_size;
    if vocab == 0 || plan.sequences == 0 || plan.tokens_per_sequence == 0 {
        return Err(EngineError::Unsupported("calibration needs a vocabulary and at least one token".into()));
    }
    let (mut backend, blocks_per_seq) = backend_for(weights, plan, threads)?;
    let mut rng = ChaCha8Rng::seed_from_u64(plan.seed);
    let mut seqs: Vec<Vec<u32>> = (0..plan.sequences).map(|_| vec![rng.random_range(0..vocab) as u32]).collect();
    // Temperature 1, no top-k/top-p: one noise stream per sequence.
    let mut noise: Vec<ChaCha8Rng> = (0..plan.sequences).map(|i| ChaCha8Rng::seed_from_u64(plan.seed.wrapping_add(1 + i as u64))).collect();
    let mut logged = std::time::Instant::now();
    for pos in 0..plan.tokens_per_sequence - 1 {
        let batch = StepBatch {
            tokens: seqs.iter().map(|s| s[pos]).collect(),
            positions: vec![pos as u32; seqs.len()],
            seqs: (0..seqs.len())
                .map(|i| SeqChunk {
                    start: i,
                    len: 1,
                    context_len: pos,
                    block_table: block_table(i, blocks_per_seq),
                    wants_logits: true,
                    lora_slot: None,
                })
                .collect(),
        };
        let logits = backend.forward(&batch)?;
        for (i, (seq, rng)) in seqs.iter_mut().zip(&mut noise).enumerate() {
            seq.push(gumbel_pick(logits.row(i), rng));
        }
        if logged.elapsed() >= crate::progress::LOG_INTERVAL {
            tracing::info!("calibration: sampled {}/{} tokens of {} sequences", pos + 2, plan.tokens_per_sequence, plan.sequences);
            logged = std::time::Instant::now();
        }
    }
    tracing::info!("calibration: {} tokens sampled, {}", plan.sequences * plan.tokens_per_sequence, tokens_digest(&seqs));
    Ok(seqs)
}

/// `sha256:<first 16 hex digits>` of the tokens (little-endian u32s, sequence after sequence): two
/// runs calibrated on the same text print the same digest.
pub fn tokens_digest(seqs: &[Vec<u32>]) -> String {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for seq in seqs {
        hasher.update((seq.len() as u64).to_le_bytes());
        for t in seq {
            hasher.update(t.to_le_bytes());
        }
    }
    let hex: String = hasher.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A token drawn from softmax(`logits`) (temperature 1) by the Gumbel-max trick: the argmax of
/// `logit + g` with one standard Gumbel draw `g` per vocabulary entry from `rng`. The distribution is
/// the engine sampler's, but the pick moves only where two perturbed logits come within the
/// arithmetic's noise of each other. An inverse-CDF draw (the engine's sampler) moves whenever the
/// running sum of probabilities crosses the draw: AVX-512 and AVX2 logits, about 1e-6 apart, then
/// sampled different calibration texts, and GPTQ rounded the same model differently on two CPUs
/// (docs/benchmarks.md, session 35). Non-finite logits are never picked (token 0 if all are).
pub fn gumbel_pick(logits: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let mut best = (f64::NEG_INFINITY, 0u32);
    for (i, &logit) in logits.iter().enumerate() {
        // u in (0, 1]: -ln(-ln u) is finite for every draw but u = 1 (+inf, a certain pick).
        let u = 1.0 - rng.random::<f64>();
        let g = -(-u.ln()).ln();
        let v = logit as f64 + g;
        if logit.is_finite() && v > best.0 {
            best = (v, i as u32);
        }
    }
    best.1
}

/// The second moments of every linear layer's inputs while `weights` (unquantized) run `tokens`.
pub fn linear_inputs(weights: &ModelWeights, tokens: &[Vec<u32>], threads: usize) -> Result<Vec<LayerInputs>> {
    check_size(&weights.config)?;
    let longest = tokens.iter().map(Vec::len).max().unwrap_or(0);
    let plan = CalibrationPlan { sequences: tokens.len(), tokens_per_sequence: longest, seed: 0 };
    let (mut backend, blocks_per_seq) = backend_for(weights, plan, threads)?;
    backend.record_linear_inputs();
    // A few sequences per step: every token's inputs, without one huge step's scratch.
    for (group, first) in tokens.chunks(4).zip((0..).step_by(4)) {
        let mut batch = StepBatch::default();
        for (j, seq) in group.iter().enumerate().filter(|(_, s)| !s.is_empty()) {
            batch.seqs.push(SeqChunk {
                start: batch.tokens.len(),
                len: seq.len(),
                context_len: 0,
                block_table: block_table(first + j, blocks_per_seq),
                wants_logits: false,
                lora_slot: None,
            });
            batch.tokens.extend_from_slice(seq);
            batch.positions.extend(0..seq.len() as u32);
        }
        if !batch.tokens.is_empty() {
            backend.forward(&batch)?;
        }
    }
    backend.take_linear_inputs().ok_or_else(|| EngineError::Backend("the calibration pass recorded nothing".into()))
}

/// Quantizes every decoder layer's seven linear projections of `weights` to `format` with GPTQ's
/// error feedback under `inputs` (from [`linear_inputs`] over the same weights). Matrices already
/// row-quantized to `format` are kept, and another 8-bit format refused, as `quantize_linear_weights`
/// does (`model::quantize::already_quantized`).
pub fn quantize_linear_weights(weights: &mut ModelWeights, format: RowFormat, activations: Activations, inputs: &[LayerInputs]) -> Result<()> {
    if inputs.len() != weights.layers.len() {
        return Err(EngineError::Backend(format!("calibration of {} layers for a model of {}", inputs.len(), weights.layers.len())));
    }
    let total = weights.layers.len();
    let done = std::sync::atomic::AtomicUsize::new(0);
    // One layer's rounding holds two n × n f64 factors for its widest input and the f64 weights:
    // groups of layers run one after the other, the layers of a group side by side.
    let c = &weights.config;
    let widest = c.hidden_size.max(c.intermediate_size).max(c.q_dim()) as u64;
    let per_layer = widest * widest * 16 + (c.intermediate_size as u64) * (c.hidden_size as u64) * 8;
    let side_by_side = (ROUNDING_BUDGET_BYTES / per_layer.max(1)).clamp(1, total.max(1) as u64) as usize;
    let mut layers: Vec<_> = weights.layers.iter_mut().zip(inputs).enumerate().collect();
    layers.chunks_mut(side_by_side).try_for_each(|group| group.par_iter_mut().try_for_each(|(i, (layer, h))| {
        let i = *i;
        for (name, m, h) in [
            ("q_proj", &mut layer.q_proj, &h.attention),
            ("k_proj", &mut layer.k_proj, &h.attention),
            ("v_proj", &mut layer.v_proj, &h.attention),
            ("o_proj", &mut layer.o_proj, &h.output),
            ("gate_proj", &mut layer.gate_proj, &h.mlp),
            ("up_proj", &mut layer.up_proj, &h.mlp),
            ("down_proj", &mut layer.down_proj, &h.down),
        ] {
            if crate::model::quantize::already_quantized(m, format, i, name)? {
                continue;
            }
            let mut q = gptq::quantize(format, m.rows, m.cols, &m.to_f32(), h, gptq::DEFAULT_DAMP)
                .map_err(|e| EngineError::Unsupported(format!("--quantization-gptq {}: layers.{i}.{name}: {e}", format.name())))?;
            q.activations = activations;
            *m = Matrix::from_row_quant(q);
        }
        let n = done.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        tracing::info!("calibration: layer {n}/{total} quantized");
        Ok(())
    }))
}

/// The whole of `--quantization-gptq` on host weights (unquantized, rotated or not): sample the
/// calibration tokens from the model, record its linear inputs over them, then quantize.
pub fn quantize_with_calibration(weights: &mut ModelWeights, format: RowFormat, plan: CalibrationPlan, threads: usize) -> Result<()> {
    check_size(&weights.config)?;
    tracing::info!("calibration: sampling {} × {} tokens from the model", plan.sequences, plan.tokens_per_sequence);
    let tokens = sample_tokens(weights, plan, threads)?;
    tracing::info!("calibration: recording the linear layers' inputs");
    let inputs = linear_inputs(weights, &tokens, threads)?;
    quantize_linear_weights(weights, format, Activations::PerToken, &inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MatrixData;
    use crate::model::dummy::dummy_weights;

    fn tiny() -> ModelWeights {
        let config = crate::model::hf_config::parse_hf_config(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "tie_word_embeddings": false
        }))
        .unwrap();
        dummy_weights(&config, 1)
    }

    #[test]
    fn sampled_tokens_are_seeded_and_in_the_vocabulary() {
        let w = tiny();
        let plan = CalibrationPlan { sequences: 3, tokens_per_sequence: 20, seed: 5 };
        let a = sample_tokens(&w, plan, 1).unwrap();
        assert_eq!(a.len(), 3);
        assert!(a.iter().all(|s| s.len() == 20 && s.iter().all(|&t| t < 100)));
        assert_eq!(a, sample_tokens(&w, plan, 2).unwrap(), "same seed, same tokens, whatever the threads");
        assert_eq!(tokens_digest(&a), tokens_digest(&a.clone()));
        assert!(tokens_digest(&a).starts_with("sha256:") && tokens_digest(&a).len() == 7 + 16);
        // Where one sequence ends and the next begins is part of the text.
        assert_ne!(tokens_digest(&[vec![1, 2], vec![3]]), tokens_digest(&[vec![1], vec![2, 3]]));
        assert_ne!(a, sample_tokens(&w, CalibrationPlan { seed: 6, ..plan }, 1).unwrap());
        assert!(sample_tokens(&w, CalibrationPlan { tokens_per_sequence: 0, ..plan }, 1).is_err());
    }

    #[test]
    fn gumbel_picks_follow_softmax_and_ignore_arithmetic_noise() {
        // Probabilities 1/6, 2/6, 3/6 (and never the NaN or -inf entries).
        let logits = [0.0f32, 2f32.ln(), 3f32.ln(), f32::NAN, f32::NEG_INFINITY];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut counts = [0usize; 5];
        let draws = 60_000;
        for _ in 0..draws {
            counts[gumbel_pick(&logits, &mut rng) as usize] += 1;
        }
        assert_eq!(counts[3] + counts[4], 0);
        for (k, want) in [(0, 1.0 / 6.0), (1, 2.0 / 6.0), (2, 3.0 / 6.0)] {
            let got = counts[k] as f64 / draws as f64;
            assert!((got - want).abs() < 0.01, "token {k}: {got} vs {want}");
        }
        assert_eq!(gumbel_pick(&[f32::NAN; 3], &mut rng), 0);

        // Rows of a 1,000-token vocabulary, each also perturbed by up to 1e-5 (ten times the
        // difference between two CPUs' logits): the same noise stream picks the same token every time.
        let mut values = ChaCha8Rng::seed_from_u64(2);
        let (mut a, mut b) = (ChaCha8Rng::seed_from_u64(3), ChaCha8Rng::seed_from_u64(3));
        for _ in 0..2_000 {
            let row: Vec<f32> = (0..1_000).map(|_| values.random_range(-8.0f32..8.0)).collect();
            let nudged: Vec<f32> = row.iter().map(|&x| x + values.random_range(-1e-5f32..1e-5)).collect();
            assert_eq!(gumbel_pick(&row, &mut a), gumbel_pick(&nudged, &mut b));
        }
    }

    #[test]
    fn every_token_reaches_every_linear_input() {
        let w = tiny();
        let tokens = vec![vec![1, 2, 3, 4, 5], vec![7, 8], vec![], vec![9, 10, 11], vec![12]];
        let inputs = linear_inputs(&w, &tokens, 1).unwrap();
        assert_eq!(inputs.len(), 2);
        for layer in &inputs {
            for (h, dim) in [(&layer.attention, 64), (&layer.output, 64), (&layer.mlp, 64), (&layer.down, 96)] {
                assert_eq!((h.rows(), h.dim()), (11, dim));
            }
        }
    }

    #[test]
    fn models_too_big_to_calibrate_are_refused_by_size() {
        let small = tiny().config;
        assert_eq!(linear_inputs_bytes(&small), 2 * (2 * 64 * 64 + 64 * 64 + 96 * 96) * 8);
        check_size(&small).unwrap();
        let llama_8b = ModelConfig { hidden_size: 4096, intermediate_size: 14336, num_hidden_layers: 32, num_attention_heads: 32, head_dim: 128, ..small };
        let e = check_size(&llama_8b).unwrap_err().to_string();
        assert!(e.contains("--quantization-gptq") && e.contains("GiB"), "{e}");
        let mut w = tiny();
        w.config = llama_8b;
        assert!(quantize_with_calibration(&mut w, RowFormat::Int8, CalibrationPlan::default(), 1).is_err(), "refused before sampling");
    }

    #[test]
    fn every_projection_is_quantized_with_its_inputs() {
        let mut w = tiny();
        let original = w.clone();
        let inputs = linear_inputs(&w, &[vec![1, 2, 3, 4, 5, 6, 7, 8]], 1).unwrap();
        quantize_linear_weights(&mut w, RowFormat::Int8, Activations::PerToken, &inputs).unwrap();
        for (l, o) in w.layers.iter().zip(&original.layers) {
            for (m, src) in [(&l.q_proj, &o.q_proj), (&l.o_proj, &o.o_proj), (&l.up_proj, &o.up_proj), (&l.down_proj, &o.down_proj)] {
                let MatrixData::RowQuant(q) = &m.data else { panic!("not quantized") };
                assert_eq!((q.rows, q.cols, q.format), (src.rows, src.cols, RowFormat::Int8));
            }
        }
        assert_eq!(w.lm_head, original.lm_head);
        let e = quantize_linear_weights(&mut original.clone(), RowFormat::Int8, Activations::PerToken, &inputs[..1]).unwrap_err();
        assert!(e.to_string().contains("1 layers"), "{e}");
    }
}

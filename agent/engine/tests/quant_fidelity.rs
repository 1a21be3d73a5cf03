//! What 8-bit weights (`--quantization fp8|int8`: row-wise weights, per-token activations) cost on
//! SmolLM2, measured against transformers' float32 logits (`fixtures/smollm2/reference.json`, every
//! position of the 6 prompts, the reference's top-10 ids at each): the quantized paths must stay
//! within the bounds below, and the f32 path (no quantization) within its own tight one, so the
//! measurement itself is checked. Besides the default (W8A8), int8 weight-only has a tight bound: it
//! is the most precise 8-bit path here, so it catches a weight-quantization error the W8A8 bounds
//! (dominated by the activations' error) would hide.
//!
//! The test model is the Q4_1 GGUF; it is quantized from its dequantized f32 weights, and the
//! reference is transformers on the same dequantized weights, so only the 8-bit step is measured.
//! The bounds are `fidelity::SMOLLM2_WEIGHT_BOUNDS` (shared with the agent's `eval` test). Figures
//! (and the per-tensor and KV-cache comparisons): `peregrine-agent eval --device cpu`, recorded in
//! docs/benchmarks.md.

mod common;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::KvCacheShape;
use peregrine_engine::bench::fidelity::{self, Fidelity};
use peregrine_engine::model::quantize::{quantize_linear_weights_with, Granularity};
use peregrine_engine::model::{self, LoadFormat, ModelWeights};

fn measure(weights: ModelWeights) -> Fidelity {
    let prompts = fidelity_prompts();
    let mut backend = CpuBackend::new(weights, KvCacheShape { num_blocks: 8, block_size: 16 }, 2).unwrap();
    fidelity::measure(&mut backend, &prompts).unwrap()
}

fn fidelity_prompts() -> Vec<fidelity::ReferencePrompt> {
    fidelity::prompts_from_reference(&common::reference()).unwrap()
}


#[test]
fn eight_bit_weights_stay_within_their_fidelity_bounds() {
    let base = model::load(&common::model_path(), LoadFormat::Gguf).unwrap().weights;
    let f32_path = measure(base.clone());
    // The unquantized path is the reference up to float rounding (model_fixtures checks 1e-3 per logit).
    assert_eq!(f32_path.positions, 36);
    assert_eq!(f32_path.top1_agree, 36, "{f32_path:?}");
    assert!(f32_path.max_abs_diff < 1e-3, "{f32_path:?}");

    for (label, format, activations, max_mean, min_top1) in fidelity::SMOLLM2_WEIGHT_BOUNDS {
        let mut w = base.clone();
        quantize_linear_weights_with(&mut w, format, Granularity::PerRow, activations).unwrap();
        let f = measure(w);
        eprintln!("{label}: mean |Δ| {:.4}, max |Δ| {:.4}, top-1 {}/{}", f.mean_abs_diff(), f.max_abs_diff, f.top1_agree, f.positions);
        assert!(f.mean_abs_diff() <= max_mean, "{label}: mean |Δlogit| {} > {max_mean}", f.mean_abs_diff());
        assert!(f.top1_agree >= min_top1, "{label}: top-1 {}/{} < {min_top1}", f.top1_agree, f.positions);
        // Quantization must change something: a path that silently ran f32 would pass the bounds.
        assert!(f.mean_abs_diff() > 10.0 * f32_path.mean_abs_diff(), "{label}: no quantization error at all?");
    }
}

/// The rotation of the residual stream (`model::rotate`) leaves the unquantized model's function
/// unchanged: its logits equal transformers' as the unrotated model's do (up to f32 rounding).
#[test]
fn the_rotated_residual_stream_computes_the_same_logits() {
    use peregrine_engine::model::rotate::{rotate_residual_stream, ROTATION_SEED};
    let mut w = model::load(&common::model_path(), LoadFormat::Gguf).unwrap().weights;
    rotate_residual_stream(&mut w, ROTATION_SEED).unwrap();
    assert!(w.norm.iter().all(|&g| g == 1.0) && w.lm_head.is_some(), "norm weights folded, head untied");
    let f = measure(w);
    eprintln!("rotated f32: mean |Δ| {:.6}, max |Δ| {:.6}, top-1 {}/{}", f.mean_abs_diff(), f.max_abs_diff, f.top1_agree, f.positions);
    assert_eq!(f.top1_agree, 36, "{f:?}");
    assert!(f.max_abs_diff < 2e-3, "{f:?}");
}

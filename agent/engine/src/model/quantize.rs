//! `--quantization fp8|int8`: which weights become row-quantized 8-bit matrices at load.
//!
//! Policy (vLLM's for FP8/INT8 W8A8): the seven linear projections of every decoder layer (q, k, v,
//! o, gate, up, down) are quantized, one scale per output row. The token embedding, the norms and
//! the LM head stay in their loaded precision: the embedding is a lookup (no GEMM to speed up), and
//! the LM head's logits feed sampling directly, where vLLM also keeps it unquantized. LoRA adapters
//! are separate and stay in floating point on top of the 8-bit base.
//!
//! The source may be f32 (HF folders of f32/f16/bf16) or ggml blocks (GGUF): those are dequantized
//! to f32 first, so a Q4_1 GGUF quantized to fp8 carries Q4_1's error plus fp8's. Matrices already
//! row-quantized (an FP8 checkpoint) are kept as they are.

use super::rowquant::{Activations, RowFormat, RowQuantMatrix};
use super::weights::{Matrix, MatrixData, ModelWeights};
use crate::{EngineError, Result};

/// One scale per output row (what `--quantization` does), or one per tensor (for comparisons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Granularity {
    PerRow,
    PerTensor,
}

/// Quantizes every decoder layer's linear weights in place, one scale per output row.
pub fn quantize_linear_weights(weights: &mut ModelWeights, format: RowFormat) -> Result<()> {
    quantize_linear_weights_with(weights, format, Granularity::PerRow, Activations::PerToken)
}

/// As [`quantize_linear_weights`], with the scales' granularity and the activations' treatment
/// chosen (the alternatives exist to measure what the default buys).
pub fn quantize_linear_weights_with(
    weights: &mut ModelWeights,
    format: RowFormat,
    granularity: Granularity,
    activations: Activations,
) -> Result<()> {
    for (i, layer) in weights.layers.iter_mut().enumerate() {
        for (name, m) in [
            ("q_proj", &mut layer.q_proj),
            ("k_proj", &mut layer.k_proj),
            ("v_proj", &mut layer.v_proj),
            ("o_proj", &mut layer.o_proj),
            ("gate_proj", &mut layer.gate_proj),
            ("up_proj", &mut layer.up_proj),
            ("down_proj", &mut layer.down_proj),
        ] {
            if already_quantized(m, format, i, name)? {
                continue;
            }
            let quantize = match granularity {
                Granularity::PerRow => RowQuantMatrix::quantize,
                Granularity::PerTensor => RowQuantMatrix::quantize_per_tensor,
            };
            let mut q = quantize(format, m.rows, m.cols, &m.to_f32()).map_err(|e| {
                EngineError::Unsupported(format!("--quantization {}: layers.{i}.{name}: {e}", format.name()))
            })?;
            q.activations = activations;
            *m = Matrix::from_row_quant(q);
        }
    }
    Ok(())
}

/// Whether linear `layers.{layer}.{name}` is row-quantized to `format` already (a pre-quantized
/// checkpoint, or an earlier pass): then it is kept as it is. In another 8-bit format it is refused:
/// re-quantizing 8-bit codes would stack two roundings, and keeping them would serve a format the
/// flag did not ask for.
pub fn already_quantized(m: &Matrix, format: RowFormat, layer: usize, name: &str) -> Result<bool> {
    match &m.data {
        MatrixData::RowQuant(q) if q.format == format => Ok(true),
        MatrixData::RowQuant(q) => Err(EngineError::Unsupported(format!(
            "--quantization {}: layers.{layer}.{name} is {} already (a pre-quantized checkpoint): leave --quantization out to serve it as it is, or load an unquantized checkpoint",
            format.name(),
            q.format.name()
        ))),
        _ => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dummy::dummy_weights;

    #[test]
    fn linears_are_quantized_and_everything_else_is_kept() {
        let config = crate::model::hf_config::parse_hf_config(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "tie_word_embeddings": false
        }))
        .unwrap();
        let original = dummy_weights(&config, 1);
        for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let mut w = original.clone();
            quantize_linear_weights(&mut w, format).unwrap();
            assert_eq!(w.embed_tokens, original.embed_tokens);
            assert_eq!(w.lm_head, original.lm_head);
            assert_eq!(w.norm, original.norm);
            let (l, o) = (&w.layers[1], &original.layers[1]);
            assert_eq!(l.input_layernorm, o.input_layernorm);
            for (m, src) in [(&l.q_proj, &o.q_proj), (&l.down_proj, &o.down_proj)] {
                let MatrixData::RowQuant(q) = &m.data else { panic!("{format:?}: not quantized") };
                assert_eq!(q.format, format);
                assert_eq!((m.rows, m.cols), (src.rows, src.cols));
                let want = RowQuantMatrix::quantize(format, src.rows, src.cols, &src.to_f32()).unwrap();
                assert_eq!(q, &want);
            }
            w.validate().unwrap();
            // Quantizing again to the same format keeps the matrices as they are; to the other
            // 8-bit format is refused, by layer and format.
            let mut again = w.clone();
            quantize_linear_weights(&mut again, format).unwrap();
            assert_eq!(again, w);
            let other = if format == RowFormat::Int8 { RowFormat::Fp8E4m3 } else { RowFormat::Int8 };
            let e = quantize_linear_weights(&mut again, other).unwrap_err().to_string();
            assert!(e.contains("layers.0.q_proj") && e.contains(&format!("is {} already", format.name())), "{e}");
        }
    }

    #[test]
    fn non_finite_weights_are_refused_by_name() {
        let config = crate::model::hf_config::parse_hf_config(&serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100
        }))
        .unwrap();
        let mut w = dummy_weights(&config, 1);
        let mut v = w.layers[0].up_proj.to_f32();
        v[5] = f32::INFINITY;
        w.layers[0].up_proj = Matrix::from_f32(96, 64, v);
        let e = quantize_linear_weights(&mut w, RowFormat::Fp8E4m3).unwrap_err().to_string();
        assert!(e.contains("layers.0.up_proj") && e.contains("non-finite"), "{e}");
    }
}

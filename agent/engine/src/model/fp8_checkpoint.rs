//! Pre-quantized FP8 checkpoints in the layout vLLM reads (`quantization_config.quant_method:
//! "fp8"`): a linear layer's `weight` is `F8_E4M3` (OCP e4m3fn) and its `weight_scale` (f32, f16 or
//! bf16) holds one scale per output row (`[out]` or `[out, 1]`) or one for the whole tensor (`[]` or
//! `[1]`, broadcast to every row). Value = code · scale. Other tensors (embedding, norms, usually the
//! LM head) are ordinary floats. Block-wise scales (`weight_block_size`) are not supported. A
//! static `input_scale` is ignored: activations are quantized per token at run time (vLLM's
//! `activation_scheme: dynamic`).

use serde_json::Value;

use super::rowquant::{RowFormat, RowQuantMatrix};
use super::weights::Matrix;

/// The name of the scale tensor that goes with weight `name` (`….weight` → `….weight_scale`).
pub fn scale_name(weight: &str) -> String {
    format!("{weight}_scale")
}

/// Checks `config.json`'s `quantization_config`, if any: only FP8 with per-row or per-tensor scales
/// is read. Returns whether the checkpoint says it is FP8.
pub fn check_quantization_config(config: &Value) -> Result<bool, String> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(false);
    };
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
    if method != "fp8" {
        return Err(format!(
            "quantization_config.quant_method {method:?} is not supported (only \"fp8\" checkpoints are read; \
             for others load an unquantized checkpoint and use --quantization)"
        ));
    }
    if q.get("weight_block_size").is_some_and(|b| !b.is_null()) {
        return Err("FP8 checkpoints with block-wise scales (weight_block_size) are not supported; \
                    per-channel or per-tensor weight_scale only"
            .into());
    }
    Ok(true)
}

/// An `F8_E4M3` weight (`rows × cols` codes) and its scale tensor (already converted to f32, with
/// its shape) → a row-quantized matrix.
pub fn fp8_matrix(
    name: &str,
    codes: &[u8],
    shape: &[usize],
    scale_shape: &[usize],
    scales: Vec<f32>,
    rows: usize,
    cols: usize,
) -> Result<Matrix, String> {
    if shape != [rows, cols] {
        return Err(format!("tensor {name} has shape {shape:?}, expected [{rows}, {cols}]"));
    }
    let per_row = match scale_shape {
        [] | [1] => vec![scales.first().copied().unwrap_or(0.0); rows],
        [n] | [n, 1] if *n == rows => scales,
        other => {
            return Err(format!(
                "tensor {} has shape {other:?}: expected [], [1] (per tensor), [{rows}] or [{rows}, 1] (per row)",
                scale_name(name)
            ))
        }
    };
    RowQuantMatrix::from_parts(RowFormat::Fp8E4m3, rows, cols, codes.to_vec(), per_row)
        .map(Matrix::from_row_quant)
        .map_err(|e| format!("tensor {name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MatrixData;

    #[test]
    fn quantization_config_is_checked() {
        assert_eq!(check_quantization_config(&serde_json::json!({})), Ok(false));
        let fp8 = serde_json::json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}});
        assert_eq!(check_quantization_config(&fp8), Ok(true));
        let awq = serde_json::json!({"quantization_config": {"quant_method": "awq"}});
        assert!(check_quantization_config(&awq).unwrap_err().contains("\"awq\""));
        let block = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}});
        assert!(check_quantization_config(&block).unwrap_err().contains("block-wise"));
    }

    #[test]
    fn per_tensor_scales_broadcast_and_bad_shapes_are_named() {
        let codes = [0x38u8, 0xB8, 0x40, 0x00]; // 1, −1, 2, 0
        let m = fp8_matrix("w.weight", &codes, &[2, 2], &[], vec![0.5], 2, 2).unwrap();
        assert_eq!(m.to_f32(), vec![0.5, -0.5, 1.0, 0.0]);
        let m = fp8_matrix("w.weight", &codes, &[2, 2], &[2, 1], vec![0.5, 2.0], 2, 2).unwrap();
        assert_eq!(m.to_f32(), vec![0.5, -0.5, 4.0, 0.0]);
        assert!(matches!(m.data, MatrixData::RowQuant(_)));
        let e = fp8_matrix("w.weight", &codes, &[2, 2], &[3], vec![1.0; 3], 2, 2).unwrap_err();
        assert!(e.contains("w.weight_scale") && e.contains("[3]"), "{e}");
        let e = fp8_matrix("w.weight", &codes, &[4, 1], &[], vec![1.0], 2, 2).unwrap_err();
        assert!(e.contains("expected [2, 2]"), "{e}");
        let e = fp8_matrix("w.weight", &codes, &[2, 2], &[2], vec![1.0, f32::NAN], 2, 2).unwrap_err();
        assert!(e.contains("scale of row 1"), "{e}");
    }
}

//! Pre-quantized 8-bit checkpoints in the two layouts vLLM reads for row-wise 8-bit weights:
//! - `quantization_config.quant_method: "fp8"`: a linear layer's `weight` is `F8_E4M3` (OCP
//!   e4m3fn). Block-wise scales (`weight_block_size`) are not supported.
//! - `quant_method: "compressed-tensors"` (what llm-compressor writes, its GPTQ included), formats
//!   `int-quantized`, `float-quantized` and `naive-quantized`: `weight` is `I8` (symmetric int8) or
//!   `F8_E4M3`, 8 bits, with `channel` or `tensor` strategy, no groups, no zero points.
//!
//! Either way `weight_scale` (f32, f16 or bf16) holds one scale per output row (`[out]` or
//! `[out, 1]`) or one for the whole tensor (`[]` or `[1]`, broadcast to every row), value = code ·
//! scale, and the other tensors (embedding, norms, usually the LM head: compressed-tensors'
//! `ignore`) are ordinary floats. Activations are quantized per token at run time (W8A8, vLLM's
//! `dynamic` scheme): a static `input_scale` is not read, and a weight-only checkpoint (W8A16) is
//! served W8A8 too; `load_hf_config` logs both. An int8 code may be −128 here (compressed-tensors
//! rounds `absmax / 127.5` scales into −128..=127), which our own quantizer never writes; every
//! kernel multiplies signed codes exactly, so it needs nothing special.

use serde_json::Value;

use super::rowquant::{RowFormat, RowQuantMatrix};
use super::weights::Matrix;

/// The name of the scale tensor that goes with weight `name` (`….weight` → `….weight_scale`).
pub fn scale_name(weight: &str) -> String {
    format!("{weight}_scale")
}

/// Checks `config.json`'s `quantization_config`, if any: only the row-wise 8-bit layouts above are
/// read. Ok: what the agent does differently from the checkpoint's own description (to log), empty
/// for an exact match or an unquantized checkpoint.
pub fn check_quantization_config(config: &Value) -> Result<Vec<String>, String> {
    let Some(q) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(Vec::new());
    };
    match q.get("quant_method").and_then(Value::as_str).unwrap_or("") {
        "fp8" => {
            if q.get("weight_block_size").is_some_and(|b| !b.is_null()) {
                return Err("FP8 checkpoints with block-wise scales (weight_block_size) are not supported; \
                            per-channel or per-tensor weight_scale only"
                    .into());
            }
            let static_inputs = q.get("activation_scheme").and_then(Value::as_str) == Some("static");
            Ok(static_inputs.then(|| STATIC_INPUTS.to_string()).into_iter().collect())
        }
        "compressed-tensors" => check_compressed_tensors(q),
        method => Err(format!(
            "quantization_config.quant_method {method:?} is not supported (\"fp8\" and \"compressed-tensors\" \
             8-bit checkpoints are read; for others load an unquantized checkpoint and use --quantization)"
        )),
    }
}

const STATIC_INPUTS: &str = "the checkpoint's static input scales are not used: activations are quantized per token at run time";

/// compressed-tensors' `quantization_config`: every config group must be row-wise 8-bit weights
/// that the loader keeps as they are (see the module's doc).
fn check_compressed_tensors(q: &Value) -> Result<Vec<String>, String> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("");
    if !matches!(format, "int-quantized" | "float-quantized" | "naive-quantized") {
        return Err(format!(
            "compressed-tensors format {format:?} is not supported (int-quantized, float-quantized and naive-quantized \
             8-bit checkpoints are read)"
        ));
    }
    for (key, what) in [("transform_config", "online transforms"), ("sparsity_config", "sparsity")] {
        // llm-compressor writes `{}` (or null) where there is none.
        let present = q.get(key).and_then(Value::as_object).is_some_and(|o| !o.is_empty());
        if present && q[key].get("format").and_then(Value::as_str) != Some("dense") {
            return Err(format!("compressed-tensors checkpoints with {what} ({key}) are not supported"));
        }
    }
    let groups = q.get("config_groups").and_then(Value::as_object).filter(|g| !g.is_empty()).ok_or("compressed-tensors quantization_config has no config_groups")?;
    let mut notes = Vec::new();
    for (name, group) in groups {
        let weights = group.get("weights").filter(|w| !w.is_null()).ok_or_else(|| format!("config group {name}: no weights scheme (activation-only quantization is not supported)"))?;
        let kind = check_args(name, "weights", weights, &["channel", "tensor"])?;
        match group.get("input_activations").filter(|a| !a.is_null()) {
            None => notes.push(format!("config group {name} quantizes weights only (W8A16): its activations are quantized per token at run time (W8A8)")),
            Some(inputs) => {
                if check_args(name, "input_activations", inputs, &["token", "tensor"])? != kind {
                    return Err(format!("config group {name}: {kind} weights with activations of another type are not supported"));
                }
                if inputs.get("dynamic").and_then(Value::as_bool) != Some(true) {
                    notes.push(STATIC_INPUTS.to_string());
                }
            }
        }
        if group.get("output_activations").is_some_and(|o| !o.is_null()) {
            return Err(format!("config group {name}: output activation quantization is not supported"));
        }
    }
    if q.get("kv_cache_scheme").is_some_and(|k| !k.is_null()) {
        notes.push("the checkpoint's kv_cache_scheme is not used: the KV cache's type is --kv-cache-dtype's".into());
    }
    notes.dedup();
    Ok(notes)
}

/// One `QuantizationArgs` of a config group: 8 bits, symmetric, no groups, one of `strategies`.
/// Returns its type ("int" or "float").
fn check_args<'a>(group: &str, what: &str, args: &'a Value, strategies: &[&str]) -> Result<&'a str, String> {
    let field = |k: &str| args.get(k).filter(|v| !v.is_null());
    let bits = field("num_bits").and_then(Value::as_u64);
    let kind = field("type").and_then(Value::as_str).unwrap_or("int");
    let strategy = field("strategy").and_then(Value::as_str).unwrap_or("");
    let bad = |why: String| Err(format!("config group {group}: {what}: {why} (row-wise 8-bit only: num_bits 8, symmetric, strategy {})", strategies.join(" or ")));
    if bits != Some(8) {
        return bad(format!("num_bits {}", bits.map_or("missing".into(), |b| b.to_string())));
    }
    if !matches!(kind, "int" | "float") {
        return bad(format!("type {kind:?}"));
    }
    if !strategies.contains(&strategy) {
        return bad(format!("strategy {strategy:?}"));
    }
    if field("symmetric").and_then(Value::as_bool) == Some(false) {
        return bad("asymmetric (zero points)".into());
    }
    if field("group_size").is_some() || field("block_structure").is_some() {
        return bad("groups or blocks".into());
    }
    Ok(kind)
}

/// The format of a linear weight stored as `dtype` in a pre-quantized checkpoint, if it is one.
pub fn row_format_of(dtype: safetensors::Dtype) -> Option<RowFormat> {
    match dtype {
        safetensors::Dtype::F8_E4M3 => Some(RowFormat::Fp8E4m3),
        safetensors::Dtype::I8 => Some(RowFormat::Int8),
        _ => None,
    }
}

/// An 8-bit weight (`rows × cols` codes of `format`) and its scale tensor (already converted to
/// f32, with its shape) → a row-quantized matrix.
#[allow(clippy::too_many_arguments)]
pub fn row_quant_matrix(
    format: RowFormat,
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
    RowQuantMatrix::from_parts(format, rows, cols, codes.to_vec(), per_row)
        .map(Matrix::from_row_quant)
        .map_err(|e| format!("tensor {name}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::MatrixData;

    #[test]
    fn quantization_config_is_checked() {
        assert_eq!(check_quantization_config(&serde_json::json!({})), Ok(vec![]));
        let fp8 = serde_json::json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}});
        assert_eq!(check_quantization_config(&fp8), Ok(vec![]));
        let fp8_static = serde_json::json!({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}});
        assert!(check_quantization_config(&fp8_static).unwrap()[0].contains("static input scales"));
        let awq = serde_json::json!({"quantization_config": {"quant_method": "awq"}});
        assert!(check_quantization_config(&awq).unwrap_err().contains("\"awq\""));
        let block = serde_json::json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}});
        assert!(check_quantization_config(&block).unwrap_err().contains("block-wise"));
    }

    #[test]
    fn per_tensor_scales_broadcast_and_bad_shapes_are_named() {
        let codes = [0x38u8, 0xB8, 0x40, 0x00]; // 1, −1, 2, 0
        let m = row_quant_matrix(RowFormat::Fp8E4m3, "w.weight", &codes, &[2, 2], &[], vec![0.5], 2, 2).unwrap();
        assert_eq!(m.to_f32(), vec![0.5, -0.5, 1.0, 0.0]);
        let m = row_quant_matrix(RowFormat::Fp8E4m3, "w.weight", &codes, &[2, 2], &[2, 1], vec![0.5, 2.0], 2, 2).unwrap();
        assert_eq!(m.to_f32(), vec![0.5, -0.5, 4.0, 0.0]);
        assert!(matches!(m.data, MatrixData::RowQuant(_)));
        let e = row_quant_matrix(RowFormat::Fp8E4m3, "w.weight", &codes, &[2, 2], &[3], vec![1.0; 3], 2, 2).unwrap_err();
        assert!(e.contains("w.weight_scale") && e.contains("[3]"), "{e}");
        let e = row_quant_matrix(RowFormat::Fp8E4m3, "w.weight", &codes, &[4, 1], &[], vec![1.0], 2, 2).unwrap_err();
        assert!(e.contains("expected [2, 2]"), "{e}");
        let e = row_quant_matrix(RowFormat::Fp8E4m3, "w.weight", &codes, &[2, 2], &[2], vec![1.0, f32::NAN], 2, 2).unwrap_err();
        assert!(e.contains("scale of row 1"), "{e}");
    }

    /// compressed-tensors' W8A8 int8 preset as llm-compressor writes it (`scheme="W8A8"`).
    fn w8a8_int8() -> serde_json::Value {
        serde_json::json!({"quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "sparsity_config": {},
            "transform_config": null,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "channel", "dynamic": false, "group_size": null, "actorder": null},
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "token", "dynamic": true, "group_size": null},
                "output_activations": null
            }}
        }})
    }

    #[test]
    fn compressed_tensors_row_wise_8_bit_schemes_are_read_and_others_refused_by_name() {
        assert_eq!(check_quantization_config(&w8a8_int8()), Ok(vec![]));
        // FP8_DYNAMIC, and FP8 with per-tensor weights and static activation scales (noted).
        let mut fp8 = w8a8_int8();
        fp8["quantization_config"]["format"] = "float-quantized".into();
        fp8["quantization_config"]["config_groups"]["group_0"]["weights"]["type"] = "float".into();
        fp8["quantization_config"]["config_groups"]["group_0"]["input_activations"]["type"] = "float".into();
        assert_eq!(check_quantization_config(&fp8), Ok(vec![]));
        fp8["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor".into();
        fp8["quantization_config"]["config_groups"]["group_0"]["input_activations"]["strategy"] = "tensor".into();
        fp8["quantization_config"]["config_groups"]["group_0"]["input_activations"]["dynamic"] = false.into();
        assert!(check_quantization_config(&fp8).unwrap()[0].contains("static input scales"));
        // Weight-only (W8A16) and a KV cache scheme: read, each with a note.
        let mut w8a16 = w8a8_int8();
        w8a16["quantization_config"]["config_groups"]["group_0"]["input_activations"] = serde_json::Value::Null;
        w8a16["quantization_config"]["kv_cache_scheme"] = serde_json::json!({"num_bits": 8, "type": "float", "strategy": "tensor"});
        let notes = check_quantization_config(&w8a16).unwrap();
        assert!(notes[0].contains("W8A16") && notes[1].contains("kv_cache_scheme"), "{notes:?}");

        let refused = |edit: &dyn Fn(&mut serde_json::Value), want: &str| {
            let mut c = w8a8_int8();
            edit(&mut c["quantization_config"]);
            let e = check_quantization_config(&c).unwrap_err();
            assert!(e.contains(want), "{want:?} not in {e:?}");
        };
        refused(&|q| q["format"] = "pack-quantized".into(), "\"pack-quantized\"");
        refused(&|q| q["config_groups"]["group_0"]["weights"]["num_bits"] = 4.into(), "num_bits 4");
        refused(&|q| q["config_groups"]["group_0"]["weights"]["strategy"] = "group".into(), "strategy \"group\"");
        refused(&|q| q["config_groups"]["group_0"]["weights"]["group_size"] = 128.into(), "groups");
        refused(&|q| q["config_groups"]["group_0"]["weights"]["symmetric"] = false.into(), "asymmetric");
        refused(&|q| q["config_groups"]["group_0"]["input_activations"]["type"] = "float".into(), "another type");
        refused(&|q| q["config_groups"]["group_0"]["output_activations"] = serde_json::json!({"num_bits": 8}), "output activation");
        refused(&|q| q["config_groups"] = serde_json::json!({}), "no config_groups");
        refused(&|q| q["transform_config"] = serde_json::json!({"config_groups": {}}), "online transforms");
        refused(&|q| q["quant_method"] = "gptq".into(), "\"gptq\"");
    }

    #[test]
    fn int8_codes_keep_their_sign_and_minus_128() {
        let codes = [0x80u8, 0x7F, 0xFF, 0x00]; // −128, 127, −1, 0
        let m = row_quant_matrix(RowFormat::Int8, "w.weight", &codes, &[2, 2], &[2, 1], vec![0.5, 0.25], 2, 2).unwrap();
        assert_eq!(m.to_f32(), vec![-64.0, 63.5, -0.25, 0.0]);
        assert_eq!(row_format_of(safetensors::Dtype::I8), Some(RowFormat::Int8));
        assert_eq!(row_format_of(safetensors::Dtype::F8_E4M3), Some(RowFormat::Fp8E4m3));
        assert_eq!(row_format_of(safetensors::Dtype::BF16), None);
    }
}

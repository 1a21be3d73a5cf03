//! The GGUF parser against the real test model and the facts the fixtures recorded about it, and
//! against corrupt and truncated copies of it.

mod common;

use peregrine_engine::model::{GgmlType, GgufFile, GgufValue};
use peregrine_engine::EngineError;

#[test]
fn parses_the_test_model_like_gguf_py() {
    let reference = common::reference();
    let facts = &reference["gguf"];
    let path = common::model_path();
    let file = GgufFile::open(&path).unwrap();

    assert_eq!(std::fs::metadata(&path).unwrap().len(), facts["size_bytes"].as_u64().unwrap());
    assert_eq!(file.tensors().len() as u64, facts["tensor_count"].as_u64().unwrap());
    assert_eq!(file.data_offset() % file.alignment(), 0);

    // Every scalar/string/short-array metadata value the fixtures list must match ours.
    for (key, want) in facts["metadata"].as_object().unwrap() {
        let got = file.get(key).unwrap_or_else(|| panic!("missing key {key}"));
        match want {
            serde_json::Value::String(s) if s.starts_with("<array len ") => {
                let n: usize = s.trim_start_matches("<array len ").trim_end_matches('>').parse().unwrap();
                assert_eq!(got.as_array().unwrap().len(), n, "{key}");
            }
            serde_json::Value::String(s) => assert_eq!(got.as_str(), Some(s.as_str()), "{key}"),
            serde_json::Value::Bool(b) => assert_eq!(got.as_bool(), Some(*b), "{key}"),
            serde_json::Value::Number(n) if n.is_u64() => assert_eq!(got.as_u64(), n.as_u64(), "{key}"),
            serde_json::Value::Number(n) => {
                assert!((got.as_f32().unwrap() as f64 - n.as_f64().unwrap()).abs() < 1e-6, "{key}")
            }
            serde_json::Value::Array(items) => {
                let got = got.as_array().unwrap();
                assert_eq!(got.len(), items.len(), "{key}");
                for (g, w) in got.iter().zip(items) {
                    assert_eq!(g.as_str(), w.as_str(), "{key}");
                }
            }
            other => panic!("unexpected fixture value {other} for {key}"),
        }
    }

    // Type counts and per-kind types.
    let mut counts = std::collections::BTreeMap::<String, u64>::new();
    for t in file.tensors() {
        let name = match t.ggml_type {
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::F32 => "F32",
            other => panic!("unexpected type {other}"),
        };
        *counts.entry(name.to_string()).or_default() += 1;
    }
    for (name, n) in facts["tensor_types"].as_object().unwrap() {
        assert_eq!(counts.get(name).copied(), n.as_u64(), "{name}");
    }
    let embd = file.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.ggml_type, GgmlType::Q8_0);
    assert_eq!(embd.shape(), vec![49152, 576]);
    assert!(file.tensor("output.weight").is_none());
    assert_eq!(file.tensor_data(embd).unwrap().len(), 49152 * 576 / 32 * 34);
    assert!(matches!(file.get("tokenizer.ggml.tokens"), Some(GgufValue::Array(_))));
    assert_eq!(
        file.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap()[1].as_str(),
        Some("<|im_start|>")
    );
}

fn assert_invalid(bytes: Vec<u8>, what: &str) {
    match GgufFile::from_bytes("corrupt.gguf", bytes) {
        Err(EngineError::InvalidModel { message, .. }) => assert!(!message.is_empty()),
        Err(other) => panic!("{what}: expected InvalidModel, got {other}"),
        Ok(_) => panic!("{what}: corrupt file parsed"),
    }
}

#[test]
fn truncated_files_are_invalid_not_panics() {
    let bytes = std::fs::read(common::model_path()).unwrap();
    let good = GgufFile::from_bytes("ok.gguf", bytes.clone()).unwrap();
    let data_offset = good.data_offset() as usize;
    let mut cuts = vec![0, 3, 4, 7, 8, 15, 16, 23, 24, 30, 100, 1000, 100_000, 1_000_000];
    cuts.extend([data_offset - 1, data_offset + 1, bytes.len() / 2, bytes.len() - 1]);
    for cut in cuts {
        assert_invalid(bytes[..cut].to_vec(), &format!("cut at {cut}"));
    }
    // Cutting a real file on disk goes through the same checks via the memory map.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.gguf");
    std::fs::write(&path, &bytes[..bytes.len() - 4096]).unwrap();
    assert!(matches!(GgufFile::open(&path), Err(EngineError::InvalidModel { .. })));
}

#[test]
fn corrupt_headers_are_invalid_not_panics() {
    let bytes = std::fs::read(common::model_path()).unwrap();
    let header = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = bytes[..2_000_000.min(bytes.len())].to_vec();
        f(&mut b);
        b
    };
    assert_invalid(header(&|b| b[0] = b'X'), "bad magic");
    assert_invalid(header(&|b| b[4..8].copy_from_slice(&1u32.to_le_bytes())), "version 1");
    assert_invalid(header(&|b| b[4..8].copy_from_slice(&3u32.to_be_bytes())), "big-endian version");
    assert_invalid(header(&|b| b[8..16].copy_from_slice(&u64::MAX.to_le_bytes())), "absurd tensor count");
    assert_invalid(header(&|b| b[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes())), "absurd kv count");
    // First key's length.
    assert_invalid(header(&|b| b[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes())), "absurd key length");
    // First value's type.
    let key_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    let ty_at = 32 + key_len;
    assert_invalid(header(&|b| b[ty_at..ty_at + 4].copy_from_slice(&99u32.to_le_bytes())), "bad value type");
    // A hand-made file: one array of absurd length, then nothing.
    let mut tiny = Vec::new();
    tiny.extend_from_slice(b"GGUF");
    tiny.extend_from_slice(&3u32.to_le_bytes());
    tiny.extend_from_slice(&0u64.to_le_bytes());
    tiny.extend_from_slice(&1u64.to_le_bytes());
    tiny.extend_from_slice(&1u64.to_le_bytes());
    tiny.push(b'a');
    tiny.extend_from_slice(&9u32.to_le_bytes());
    tiny.extend_from_slice(&8u32.to_le_bytes());
    tiny.extend_from_slice(&(1u64 << 60).to_le_bytes());
    assert_invalid(tiny.clone(), "absurd array length");
    // Tensor offsets/dims pointing outside the file.
    let good = GgufFile::from_bytes("ok.gguf", bytes.clone()).unwrap();
    let mut bad = bytes.clone();
    // The last tensor info's offset field sits just before the padding; find it by searching the
    // encoded (name, dims, type, offset) of the last tensor.
    let last = good.tensors().last().unwrap();
    let mut enc = Vec::new();
    enc.extend_from_slice(&(last.name.len() as u64).to_le_bytes());
    enc.extend_from_slice(last.name.as_bytes());
    let at = bytes.windows(enc.len()).position(|w| w == enc.as_slice()).unwrap();
    let off_at = at + enc.len() + 4 + 8 * last.dims.len() + 4;
    bad[off_at..off_at + 8].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert_invalid(bad, "tensor offset past the end");
    let mut bad = bytes.clone();
    let dim_at = at + enc.len() + 4;
    bad[dim_at..dim_at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_invalid(bad, "absurd dimension");
}

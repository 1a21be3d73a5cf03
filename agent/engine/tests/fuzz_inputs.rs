//! Fuzzing on stable Rust (proptest): readers of untrusted input must answer `Ok` or an error, never
//! panic and never allocate what a length field claims before checking it against the input.
//! Bounded for CI (a few hundred cases each, well under a second); for a longer run:
//! `PROPTEST_CASES=100000 cargo test --release -p peregrine-engine --test fuzz_inputs`.

use peregrine_engine::lora::config::AdapterConfig;
use peregrine_engine::model::GgufFile;
use peregrine_engine::tokenizer::{ChatMessage, ChatTemplate};
use proptest::prelude::*;

fn config() -> ProptestConfig {
    // PROPTEST_CASES overrides this (proptest reads it for the default, which `with_cases` replaces).
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(300);
    ProptestConfig::with_cases(cases)
}

/// Counts and lengths a hostile file would claim: small, near the type's limits, or huge.
fn claimed_count() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..8, Just(u64::MAX), Just(u64::MAX / 2), Just(1 << 40), Just(u32::MAX as u64 + 1), any::<u64>()]
}

/// A GGUF header (magic, version, tensor and metadata counts) followed by arbitrary bytes.
fn gguf_like() -> impl Strategy<Value = Vec<u8>> {
    (prop_oneof![Just(2u32), Just(3u32), any::<u32>()], claimed_count(), claimed_count(), proptest::collection::vec(any::<u8>(), 0..2048))
        .prop_map(|(version, tensors, kvs, tail)| {
            let mut b = b"GGUF".to_vec();
            b.extend_from_slice(&version.to_le_bytes());
            b.extend_from_slice(&tensors.to_le_bytes());
            b.extend_from_slice(&kvs.to_le_bytes());
            b.extend_from_slice(&tail);
            b
        })
}

/// One metadata entry whose key, type and string length are chosen, then arbitrary bytes.
fn gguf_with_entry() -> impl Strategy<Value = Vec<u8>> {
    (claimed_count(), 0u32..16, claimed_count(), proptest::collection::vec(any::<u8>(), 0..256)).prop_map(|(key_len, ty, len, tail)| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&key_len.min(16).to_le_bytes());
        b.extend_from_slice(&b"general.arch1234"[..key_len.min(16) as usize]);
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&len.to_le_bytes());
        b.extend_from_slice(&tail);
        b
    })
}

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}\n{% endfor %}\
{% if add_generation_prompt %}<|assistant|>{% endif %}";

proptest! {
    #![proptest_config(config())]

    #[test]
    fn gguf_reader_never_panics_on_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let _ = GgufFile::from_bytes("fuzz.gguf", bytes);
    }

    #[test]
    fn gguf_reader_checks_claimed_counts(bytes in gguf_like()) {
        let _ = GgufFile::from_bytes("fuzz.gguf", bytes);
    }

    #[test]
    fn gguf_reader_checks_claimed_lengths(bytes in gguf_with_entry()) {
        let _ = GgufFile::from_bytes("fuzz.gguf", bytes);
    }

    #[test]
    fn adapter_config_never_panics(text in ".{0,512}") {
        let _ = AdapterConfig::from_json(&text);
    }

    #[test]
    fn adapter_config_fields_of_any_value(r in any::<i64>(), alpha in any::<f64>(), targets in proptest::collection::vec("[a-z_]{0,12}", 0..6)) {
        let text = serde_json::json!({"r": r, "lora_alpha": alpha, "target_modules": targets, "peft_type": "LORA"}).to_string();
        let _ = AdapterConfig::from_json(&text);
    }

    #[test]
    fn chat_template_renders_any_input(turns in proptest::collection::vec(("[a-z]{0,10}", ".{0,200}"), 0..8)) {
        let template = ChatTemplate::new(TEMPLATE, "<s>", "</s>").unwrap();
        let messages: Vec<ChatMessage> = turns.into_iter().map(|(role, content)| ChatMessage::new(role, content)).collect();
        let _ = template.render(&messages, true);
    }
}

// --- safetensors: the model folder reader and the adapter reader ---------------------------------

use peregrine_engine::config::ModelConfig;
use peregrine_engine::lora::LoraAdapter;
use peregrine_engine::model::hf_config::parse_hf_config;
use peregrine_engine::model::safetensors::{weights_from_safetensors, SafetensorsFolder};

/// A one-layer model (as its config.json would say) small enough that a fuzzed file could hold all
/// of its tensors.
fn tiny_model() -> ModelConfig {
    let config = serde_json::json!({
        "model_type": "llama", "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8, "max_position_embeddings": 16,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "eos_token_id": 1
    });
    parse_hf_config(&config).unwrap()
}

/// Tensor names the readers look for, and some they must refuse.
fn tensor_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model.embed_tokens.weight".to_string()),
        Just("model.norm.weight".to_string()),
        Just("model.layers.0.self_attn.q_proj.weight".to_string()),
        Just("model.layers.0.self_attn.q_proj.weight_scale".to_string()),
        Just("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight".to_string()),
        Just("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight".to_string()),
        Just("base_model.model.model.layers.99999999999999999999.mlp.up_proj.lora_A.weight".to_string()),
        "[a-z_.0-9]{0,40}",
    ]
}

fn dtype() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("F32"), Just("F16"), Just("BF16"), Just("F8_E4M3"), Just("I64"), Just("BOOL"), Just("F4"), Just("XYZ")]
}

/// A dimension or offset a hostile header would claim: small, at the edges of u64/usize, or huge.
fn claimed_dim() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..9, Just(u64::MAX), Just(1 << 32), Just(1 << 40), Just(usize::MAX as u64 / 2 + 1), any::<u64>()]
}

/// A safetensors file: an 8-byte header length (true, or claimed), a JSON header of tensors with
/// chosen dtypes, shapes and offsets, then data bytes.
fn safetensors_like() -> impl Strategy<Value = Vec<u8>> {
    let tensor = (tensor_name(), dtype(), proptest::collection::vec(claimed_dim(), 0..4), claimed_dim(), claimed_dim());
    (
        proptest::collection::vec(tensor, 0..5),
        prop_oneof![Just(None), claimed_dim().prop_map(Some)],
        proptest::collection::vec(any::<u8>(), 0..512),
    )
        .prop_map(|(tensors, claimed_len, data)| {
            let mut header = serde_json::Map::new();
            for (name, dtype, shape, start, end) in tensors {
                header.insert(name, serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, end]}));
            }
            let header = serde_json::Value::Object(header).to_string();
            let len = claimed_len.unwrap_or(header.len() as u64);
            let mut b = len.to_le_bytes().to_vec();
            b.extend_from_slice(header.as_bytes());
            b.extend_from_slice(&data);
            b
        })
}

/// A valid single-tensor file of `n` F32 values whose header claims `shape` instead.
fn consistent_offsets_wrong_shape() -> impl Strategy<Value = Vec<u8>> {
    (0usize..16, proptest::collection::vec(claimed_dim(), 0..4)).prop_map(|(n, shape)| {
        let header = serde_json::json!({"model.norm.weight": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * n]}}).to_string();
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend(std::iter::repeat_n(0u8, 4 * n));
        b
    })
}

/// Opens `bytes` as a model folder's `model.safetensors` and reads every tensor and the model.
fn read_model_file(bytes: &[u8]) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    if let Ok(folder) = SafetensorsFolder::open(dir.path()) {
        let names: Vec<String> = folder.names().map(str::to_string).collect();
        for name in names {
            let _ = folder.tensor_f32(&name);
        }
    }
    let _ = weights_from_safetensors(dir.path(), &tiny_model());
}

fn lora_config(r: usize) -> AdapterConfig {
    let text = serde_json::json!({"r": r, "lora_alpha": 16, "target_modules": ["q_proj", "up_proj"], "peft_type": "LORA"}).to_string();
    AdapterConfig::from_json(&text).unwrap()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn safetensors_reader_never_panics_on_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        read_model_file(&bytes);
    }

    #[test]
    fn safetensors_reader_checks_claimed_sizes_offsets_and_shapes(bytes in safetensors_like()) {
        read_model_file(&bytes);
    }

    #[test]
    fn safetensors_reader_checks_shape_against_data(bytes in consistent_offsets_wrong_shape()) {
        read_model_file(&bytes);
    }

    #[test]
    fn safetensors_index_names_only_shards_in_the_folder(shards in proptest::collection::vec("[./a-z]{0,12}|/etc/passwd|\\.\\./x", 0..4)) {
        let dir = tempfile::tempdir().unwrap();
        let map: serde_json::Map<String, serde_json::Value> =
            shards.iter().enumerate().map(|(i, s)| (format!("t{i}"), serde_json::Value::String(s.clone()))).collect();
        std::fs::write(dir.path().join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
        if let Ok(folder) = SafetensorsFolder::open(dir.path()) {
            // Anything it opened is a file inside the folder (none exist here).
            prop_assert!(folder.names().next().is_none());
        }
    }

    #[test]
    fn adapter_weights_never_panic(bytes in safetensors_like(), r in prop_oneof![0usize..4, Just(1 << 20)]) {
        let _ = LoraAdapter::from_parts(&lora_config(r.max(1)), &bytes, &tiny_model(), 1 << 21);
    }

    #[test]
    fn adapter_weights_never_panic_on_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..1024)) {
        let _ = LoraAdapter::from_parts(&lora_config(2), &bytes, &tiny_model(), 8);
    }
}

/// The claims that once were dangerous, checked every run whatever proptest draws: a header length
/// past the file, a shape whose element count overflows, offsets past the data, and a rank whose
/// A matrix would be huge — each an error.
#[test]
fn hostile_safetensors_claims_are_errors() {
    let file = |header: serde_json::Value, data: &[u8], claimed: Option<u64>| {
        let header = header.to_string();
        let mut b = claimed.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(data);
        b
    };
    let norm = |shape: serde_json::Value, offsets: [u64; 2]| {
        serde_json::json!({"model.norm.weight": {"dtype": "F32", "shape": shape, "data_offsets": offsets}})
    };
    let cases = [
        file(norm(serde_json::json!([4]), [0, 16]), &[0; 16], Some(u64::MAX)),
        file(norm(serde_json::json!([4]), [0, 16]), &[0; 16], Some(1 << 30)),
        file(norm(serde_json::json!([1u64 << 62, 8]), [0, 16]), &[0; 16], None),
        file(norm(serde_json::json!([u64::MAX]), [0, 16]), &[0; 16], None),
        file(norm(serde_json::json!([4]), [0, 1 << 40]), &[0; 16], None),
        file(norm(serde_json::json!([4]), [u64::MAX - 1, 15]), &[0; 16], None),
    ];
    for (i, bytes) in cases.iter().enumerate() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
        let read = SafetensorsFolder::open(dir.path()).and_then(|f| f.tensor_f32("model.norm.weight"));
        assert!(read.is_err(), "case {i} was accepted");
        assert!(LoraAdapter::from_parts(&lora_config(2), bytes, &tiny_model(), 8).is_err(), "case {i} (adapter)");
    }
    // A rank that would size a huge A matrix is refused before any allocation.
    assert!(LoraAdapter::from_parts(&lora_config(1 << 40), &cases[0], &tiny_model(), 64).is_err());
}

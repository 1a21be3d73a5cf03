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

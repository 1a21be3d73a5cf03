//! `BertForSequenceClassification` on the CPU encoder against transformers: the all-MiniLM-L6-v2
//! body (from the wheel) with the seeded random heads of `tests/fixtures/minilm/classifier/`
//! (made by `scripts/make-minilm-classifier-fixture.py`), single texts and query/document pairs.

use std::sync::Arc;

use peregrine_engine::backend::cpu::encoder::CpuEncoder;
use peregrine_engine::encoder::{EncoderHandle, EncoderInput, EncoderJobKind, EncoderModel, EncoderServiceConfig, EncoderTask};
use serde_json::Value;

/// Logits are O(1); float32 forwards that sum in different orders differ by ~1e-6.
const TOL: f32 = 1e-4;

fn check(head_name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let head = peregrine_testkit::assemble_classifier(head_name, dir.path());
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(head.join("reference.json")).unwrap()).unwrap();
    let (model, weights) = EncoderModel::load(dir.path()).unwrap();
    assert_eq!(model.task, EncoderTask::Classify);
    let labels: Vec<String> = serde_json::from_value(reference["labels"].clone()).unwrap();
    assert_eq!(model.config.labels, labels);
    let backend = CpuEncoder::new(model.config.clone(), weights, 2).unwrap();
    let model = Arc::new(model);
    let handle = EncoderHandle::start(Box::new(backend), model.clone(), EncoderServiceConfig::default()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    let mut inputs = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let input = match case["text_pair"].as_str() {
            Some(pair) => model.tokenizer.encode_pair(text, pair, false).unwrap(),
            None => model.tokenizer.encode(text, false).unwrap(),
        };
        let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).unwrap();
        let want_types: Vec<u32> = serde_json::from_value(case["token_type_ids"].clone()).unwrap();
        assert_eq!((&input.ids, &input.type_ids), (&want_ids, &want_types), "tokens of {text:?}");
        inputs.push(input);
    }
    // All cases in one request (one ragged batch), then each alone.
    let together = handle.run_blocking(inputs.clone(), EncoderJobKind::Classify).unwrap();
    for (i, (case, input)) in cases.iter().zip(inputs).enumerate() {
        let want: Vec<f32> = serde_json::from_value(case["logits"].clone()).unwrap();
        let alone = handle.run_blocking(vec![input], EncoderJobKind::Classify).unwrap().remove(0);
        for got in [&together[i], &alone] {
            assert_eq!(got.len(), want.len());
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= TOL, "{head_name} case {i}: logits {got:?} vs {want:?}");
        }
    }
    assert!(handle.run_blocking(vec![EncoderInput { ids: vec![101, 102], type_ids: vec![0, 0] }], EncoderJobKind::Classify).is_ok());
}

#[test]
fn three_label_head_matches_transformers() {
    check("three-labels");
}

#[test]
fn cross_encoder_head_matches_transformers() {
    check("cross-encoder");
}

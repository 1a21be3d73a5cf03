//! The CUDA encoder (`backend::cuda::encoder::CudaEncoder`) against the same references as the CPU
//! encoder: all-MiniLM-L6-v2 embeddings vs Sentence-Transformers within 1e-5 per component and on
//! cosines (f32 GEMMs, TF32 off), alone and in ragged batches of very different lengths; the
//! classifier heads vs transformers within 1e-4; the CPU encoder's hidden states on a 512-token
//! batch; pooling on the device equal to the host's; bf16 GEMMs and tensor-core attention close in
//! cosine, a sequence batched close to itself alone. Skips visibly without a GPU (`PEREGRINE_REQUIRE_GPU` makes
//! that a failure).

mod cuda_common;

use std::sync::Arc;

use peregrine_engine::backend::cpu::encoder::CpuEncoder;
use peregrine_engine::backend::cuda::encoder::{CudaEncoder, EncoderGemm};
use peregrine_engine::backend::EncoderBackend;
use peregrine_engine::encoder::sentence::{pool, PoolingMode};
use peregrine_engine::encoder::{EncoderHandle, EncoderInput, EncoderJobKind, EncoderModel, EncoderServiceConfig};
use peregrine_engine::plan::RaggedBatch;
use serde_json::Value;

/// The fixtures README's tolerance on MiniLM embeddings and cosines.
const EMBED_TOL: f32 = 1e-5;
/// The fixtures README's tolerance on classifier logits.
const LOGIT_TOL: f32 = 1e-4;

fn minilm(gemm: EncoderGemm) -> (EncoderModel, CudaEncoder) {
    let (mut model, weights) = EncoderModel::load(&peregrine_testkit::test_encoder()).unwrap();
    model.set_max_seq_length(512).unwrap();
    let backend = CudaEncoder::new(model.config.clone(), weights, 0, gemm).unwrap();
    (model, backend)
}

fn worst(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)
}

fn embed_batch(model: &EncoderModel, backend: &mut dyn EncoderBackend, inputs: &[EncoderInput]) -> Vec<Vec<f32>> {
    let mut batch = RaggedBatch::new();
    for i in inputs {
        batch.push(&i.ids, &i.type_ids);
    }
    let hidden = backend.forward(&batch).unwrap();
    let h = model.config.hidden_size;
    assert_eq!(hidden.len(), batch.num_tokens() * h);
    (0..batch.num_seqs()).map(|s| model.pipeline.embed(&hidden[batch.range(s).start * h..batch.range(s).end * h], h)).collect()
}

struct Reference {
    sentences: Vec<String>,
    embeddings: Vec<Vec<f32>>,
    cosine: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let path = peregrine_testkit::fixtures_dir().join("minilm/reference.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rows = |v: &Value| -> Vec<Vec<f32>> {
        v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect()
    };
    Reference {
        sentences: json["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect(),
        embeddings: rows(&json["embeddings"]),
        cosine: rows(&json["cosine_similarity"]),
    }
}

#[test]
fn cuda_minilm_matches_sentence_transformers_alone_and_in_mixed_batches() {
    if !cuda_common::gpu_or_skip() {
        return;
    }
    let (model, mut backend) = minilm(EncoderGemm::F32);
    let r = reference();
    let inputs: Vec<EncoderInput> = r.sentences.iter().map(|s| model.tokenizer.encode(s, false).unwrap()).collect();
    let alone: Vec<Vec<f32>> = inputs.iter().map(|i| embed_batch(&model, &mut backend, std::slice::from_ref(i)).remove(0)).collect();
    for (i, (got, want)) in alone.iter().zip(&r.embeddings).enumerate() {
        let w = worst(got, want);
        cuda_common::report(&format!("sentence {i} alone: max abs diff {w:e}"));
        assert!(w <= EMBED_TOL, "sentence {i} alone: {w} > {EMBED_TOL}");
    }
    for i in 0..alone.len() {
        for j in 0..alone.len() {
            let cos: f32 = alone[i].iter().zip(&alone[j]).map(|(a, b)| a * b).sum();
            assert!((cos - r.cosine[i][j]).abs() <= EMBED_TOL, "cosine {i},{j}: {cos} vs {}", r.cosine[i][j]);
        }
    }
    // Very different lengths in one batch: 510 tokens (32 attention tiles, 16 key chunks), the
    // references, 3 tokens, 17 tokens (a tile boundary).
    let long = model.tokenizer.encode(&"the quick brown fox jumps over the lazy dog ".repeat(80), true).unwrap();
    assert_eq!(long.len(), 512);
    let short = model.tokenizer.encode("hi", false).unwrap();
    let seventeen = model.tokenizer.encode(&"word ".repeat(15), false).unwrap();
    assert_eq!(seventeen.len(), 17);
    let mixed = vec![long.clone(), inputs[0].clone(), short.clone(), inputs[1].clone(), seventeen.clone(), inputs[2].clone()];
    let got = embed_batch(&model, &mut backend, &mixed);
    for (k, i) in [(1, 0), (3, 1), (5, 2)] {
        assert!(worst(&got[k], &r.embeddings[i]) <= EMBED_TOL, "sentence {i} in a mixed batch");
        assert!(worst(&got[k], &alone[i]) <= EMBED_TOL, "sentence {i}: batched vs alone");
    }
    // The long and odd-length sequences against the CPU reference encoder, same batch.
    let (cpu_model, weights) = EncoderModel::load(&peregrine_testkit::test_encoder()).unwrap();
    let mut cpu = CpuEncoder::new(cpu_model.config.clone(), weights, 2).unwrap();
    let want = embed_batch(&model, &mut cpu, &mixed);
    for k in [0, 2, 4] {
        let w = worst(&got[k], &want[k]);
        cuda_common::report(&format!("mixed batch sequence {k} ({} tokens) vs CPU: max abs diff {w:e}", mixed[k].ids.len()));
        assert!(w <= EMBED_TOL, "sequence {k} vs the CPU encoder: {w}");
    }
    // A malformed batch is an error, and the encoder keeps working after it.
    let mut bad = RaggedBatch::new();
    bad.push(&[101, 99999, 102], &[0, 0, 0]);
    assert!(backend.forward(&bad).is_err());
    assert!(worst(&embed_batch(&model, &mut backend, &inputs[..1]).remove(0), &r.embeddings[0]) <= EMBED_TOL);
}

/// The device's pooling gives the host's bits (both sum means in f64, in row order) for every mode,
/// over ragged sequences; an empty sequence is refused, and the encoder keeps working.
#[test]
fn cuda_pooling_on_the_device_equals_host_pooling() {
    if !cuda_common::gpu_or_skip() {
        return;
    }
    let (model, mut backend) = minilm(EncoderGemm::F32);
    let h = model.config.hidden_size;
    let modes = [PoolingMode::Cls, PoolingMode::Max, PoolingMode::Mean, PoolingMode::MeanSqrtLen, PoolingMode::LastToken];
    let mut batch = RaggedBatch::new();
    for text in ["hi", "a somewhat longer sentence about pooling on the device", &"word ".repeat(300)] {
        let input = model.tokenizer.encode(text, true).unwrap();
        batch.push(&input.ids, &input.type_ids);
    }
    let states = backend.forward(&batch).unwrap();
    let pooled = backend.forward_pooled(&batch, h, &modes).unwrap();
    assert_eq!(pooled.len(), batch.num_seqs() * modes.len() * h);
    for s in 0..batch.num_seqs() {
        let r = batch.range(s);
        let want = pool(&states[r.start * h..r.end * h], h, &modes);
        let got = &pooled[s * modes.len() * h..(s + 1) * modes.len() * h];
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "sequence {s}: device pooling differs from the host's");
    }
    let mut empty = RaggedBatch::new();
    empty.push(&[101, 102], &[0, 0]);
    empty.push(&[], &[]);
    assert!(backend.forward_pooled(&empty, h, &modes).is_err());
    assert!(backend.forward_pooled(&batch, h + 1, &modes).is_err());
    assert_eq!(backend.forward_pooled(&batch, h, &modes).unwrap(), pooled);
}

#[test]
fn cuda_minilm_bf16_gemms_stay_close_in_cosine() {
    if !cuda_common::gpu_or_skip() {
        return;
    }
    let (model, mut backend) = minilm(EncoderGemm::Bf16);
    let r = reference();
    let inputs: Vec<EncoderInput> = r.sentences.iter().map(|s| model.tokenizer.encode(s, false).unwrap()).collect();
    let got = embed_batch(&model, &mut backend, &inputs);
    for (i, (g, want)) in got.iter().zip(&r.embeddings).enumerate() {
        let cos: f32 = g.iter().zip(want).map(|(a, b)| a * b).sum();
        cuda_common::report(&format!("bf16 GEMMs, sentence {i}: cosine to the reference {cos}"));
        assert!(cos >= 0.999, "sentence {i}: cosine {cos}");
    }
    // On sm_80+ the attention runs on the tensor cores too (PEREGRINE_ENCODER_ATTENTION=f32 aside).
    let name = backend.name();
    cuda_common::report(&format!("backend {name}"));
    if std::env::var("PEREGRINE_ENCODER_ATTENTION").as_deref() != Ok("f32") {
        assert!(name.contains("bf16 GEMMs and attention"), "{name}");
    }
    // A long sequence (8 query tiles, 8 key tiles of the tensor-core kernel) among short ones: close
    // to the f32 encoder in cosine, and each sequence batched close to itself alone (cuBLAS may pick
    // another algorithm for another batch size, so not bit for bit).
    let long = model.tokenizer.encode(&"the quick brown fox jumps over the lazy dog ".repeat(80), true).unwrap();
    let short = model.tokenizer.encode("hi", false).unwrap();
    let mixed = vec![inputs[0].clone(), long.clone(), short.clone(), inputs[1].clone()];
    let batched = embed_batch(&model, &mut backend, &mixed);
    let (_, mut f32_backend) = minilm(EncoderGemm::F32);
    let exact = embed_batch(&model, &mut f32_backend, &mixed);
    for (k, input) in mixed.iter().enumerate() {
        let alone = embed_batch(&model, &mut backend, std::slice::from_ref(input)).remove(0);
        let w = worst(&batched[k], &alone);
        let cos: f32 = batched[k].iter().zip(&exact[k]).map(|(a, b)| a * b).sum();
        cuda_common::report(&format!("bf16, mixed sequence {k} ({} tokens): vs alone {w:e}, cosine to f32 {cos}", input.ids.len()));
        assert!(w <= 1e-3, "sequence {k}: batched vs alone {w}");
        assert!(cos >= 0.999, "sequence {k}: cosine to the f32 encoder {cos}");
    }
}

fn check_classifier(head_name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let head = peregrine_testkit::assemble_classifier(head_name, dir.path());
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(head.join("reference.json")).unwrap()).unwrap();
    let (model, weights) = EncoderModel::load(dir.path()).unwrap();
    let backend = CudaEncoder::new(model.config.clone(), weights, 0, EncoderGemm::F32).unwrap();
    let model = Arc::new(model);
    let handle = EncoderHandle::start(Box::new(backend), model.clone(), EncoderServiceConfig::default()).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    let inputs: Vec<EncoderInput> = cases
        .iter()
        .map(|case| {
            let text = case["text"].as_str().unwrap();
            match case["text_pair"].as_str() {
                Some(pair) => model.tokenizer.encode_pair(text, pair, false).unwrap(),
                None => model.tokenizer.encode(text, false).unwrap(),
            }
        })
        .collect();
    let together = handle.run_blocking(inputs.clone(), EncoderJobKind::Classify).unwrap();
    for (i, (case, input)) in cases.iter().zip(inputs).enumerate() {
        let want: Vec<f32> = serde_json::from_value(case["logits"].clone()).unwrap();
        let alone = handle.run_blocking(vec![input], EncoderJobKind::Classify).unwrap().remove(0);
        for got in [&together[i], &alone] {
            assert!(worst(got, &want) <= LOGIT_TOL, "{head_name} case {i}: logits {got:?} vs {want:?}");
        }
    }
}

#[test]
fn cuda_classifier_heads_match_transformers() {
    if !cuda_common::gpu_or_skip() {
        return;
    }
    check_classifier("three-labels");
    check_classifier("cross-encoder");
}

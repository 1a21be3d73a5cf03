//! all-MiniLM-L6-v2 on the CPU encoder against Sentence-Transformers' embeddings
//! (`tests/fixtures/minilm/reference.json`, tolerances in `tests/fixtures/README.md`: 1e-5 per
//! component and on cosines), alone and inside ragged batches of very different lengths.

use std::sync::Arc;

use peregrine_engine::backend::cpu::encoder::CpuEncoder;
use peregrine_engine::backend::EncoderBackend;
use peregrine_engine::encoder::{EncoderHandle, EncoderInput, EncoderJobKind, EncoderModel, EncoderServiceConfig};
use peregrine_engine::plan::RaggedBatch;
use serde_json::Value;

const TOL: f32 = 1e-5;

struct Reference {
    sentences: Vec<String>,
    input_ids: Vec<Vec<u32>>,
    embeddings: Vec<Vec<f32>>,
    cosine: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let path = peregrine_testkit::fixtures_dir().join("minilm/reference.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strings = |v: &Value| v.as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect::<Vec<_>>();
    let floats = |v: &Value| -> Vec<Vec<f32>> {
        v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect()
    };
    Reference {
        sentences: strings(&json["sentences"]),
        input_ids: json["input_ids"].as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect(),
        embeddings: floats(&json["embeddings"]),
        cosine: floats(&json["cosine_similarity"]),
    }
}

fn load() -> (Arc<EncoderModel>, CpuEncoder) {
    let (model, weights) = EncoderModel::load(&peregrine_testkit::test_encoder()).unwrap();
    let backend = CpuEncoder::new(model.config.clone(), weights, 2).unwrap();
    (Arc::new(model), backend)
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= TOL, "{what}: max abs diff {worst} > {TOL}");
}

fn embed_batch(model: &EncoderModel, backend: &mut CpuEncoder, inputs: &[EncoderInput]) -> Vec<Vec<f32>> {
    let mut batch = RaggedBatch::new();
    for i in inputs {
        batch.push(&i.ids, &i.type_ids);
    }
    let hidden = backend.forward(&batch).unwrap();
    let h = model.config.hidden_size;
    (0..batch.num_seqs()).map(|s| model.pipeline.embed(&hidden[batch.range(s).start * h..batch.range(s).end * h], h)).collect()
}

#[test]
fn folder_is_read_as_sentence_transformers_configures_it() {
    let (model, _) = load();
    assert_eq!(model.embedding_dim(), 384);
    assert_eq!(model.tokenizer.max_seq_length(), 256, "sentence_bert_config.json's max_seq_length");
    assert!(model.pipeline.normalizes());
    assert!(model.classifier.is_none());
}

#[test]
fn tokenizer_matches_reference_ids() {
    let (model, _) = load();
    let r = reference();
    for (s, ids) in r.sentences.iter().zip(&r.input_ids) {
        let got = model.tokenizer.encode(s, false).unwrap();
        assert_eq!(&got.ids, ids, "{s}");
        assert!(got.type_ids.iter().all(|&t| t == 0));
    }
}

#[test]
fn embeddings_and_cosines_match_sentence_transformers_alone_and_batched() {
    let (model, mut backend) = load();
    let r = reference();
    let inputs: Vec<EncoderInput> = r.sentences.iter().map(|s| model.tokenizer.encode(s, false).unwrap()).collect();
    // Alone.
    let alone: Vec<Vec<f32>> = inputs.iter().map(|i| embed_batch(&model, &mut backend, std::slice::from_ref(i)).remove(0)).collect();
    for (i, (got, want)) in alone.iter().zip(&r.embeddings).enumerate() {
        assert_close(got, want, &format!("sentence {i} alone"));
    }
    for i in 0..3 {
        for j in 0..3 {
            let cos: f32 = alone[i].iter().zip(&alone[j]).map(|(a, b)| a * b).sum();
            assert!((cos - r.cosine[i][j]).abs() <= TOL, "cosine {i},{j}: {cos} vs {}", r.cosine[i][j]);
        }
    }
    // Ragged batch with sequences of very different lengths around the references: a 250-token
    // sequence first and a 3-token one between them.
    let long_text = "the quick brown fox jumps over the lazy dog ".repeat(40);
    let long = model.tokenizer.encode(&long_text, true).unwrap();
    assert_eq!(long.len(), 256, "truncated to max_seq_length as asked");
    let short = model.tokenizer.encode("hi", false).unwrap();
    let mixed = vec![long.clone(), inputs[0].clone(), short.clone(), inputs[1].clone(), inputs[2].clone()];
    let got = embed_batch(&model, &mut backend, &mixed);
    for (k, i) in [(1, 0), (3, 1), (4, 2)] {
        assert_close(&got[k], &r.embeddings[i], &format!("sentence {i} in a mixed batch"));
        assert_close(&got[k], &alone[i], &format!("sentence {i}: batched vs alone"));
    }
    let long_alone = embed_batch(&model, &mut backend, std::slice::from_ref(&long)).remove(0);
    assert_close(&got[0], &long_alone, "long sequence: batched vs alone");
}

#[test]
fn over_long_input_is_refused_unless_truncation_is_asked() {
    let (model, _) = load();
    let text = "word ".repeat(300);
    let err = model.tokenizer.encode(&text, false).unwrap_err();
    assert_eq!(err.kind(), "invalid_request");
    assert!(err.to_string().contains("max_seq_length 256"), "{err}");
    let ids: Vec<u32> = vec![2000; 300];
    assert!(model.tokenizer.check_ids(&ids, false).is_err());
    assert_eq!(model.tokenizer.check_ids(&ids, true).unwrap().len(), 256);
    assert!(model.tokenizer.check_ids(&[30522], false).is_err(), "id outside the vocabulary");
}

#[test]
fn malformed_batches_are_errors_not_panics() {
    let (_, mut backend) = load();
    let mut bad = RaggedBatch::new();
    bad.push(&[101, 99999, 102], &[0, 0, 0]);
    assert!(backend.forward(&bad).is_err());
    let mut bad = RaggedBatch::new();
    bad.push(&[101, 102], &[0, 5]);
    assert!(backend.forward(&bad).is_err());
    let mut bad = RaggedBatch::new();
    bad.push(&vec![1000; 513], &vec![0; 513]);
    assert!(backend.forward(&bad).is_err());
}

#[test]
fn batching_thread_merges_requests_and_keeps_each_result() {
    let (model, backend) = load();
    let r = reference();
    // A budget of 256 tokens: the 30-sequence request spans several forwards, and the reference
    // sentences queued behind it share forwards with its tail.
    let handle = EncoderHandle::start(Box::new(backend), model.clone(), EncoderServiceConfig { max_num_batched_tokens: 256 }).unwrap();
    let filler: Vec<EncoderInput> = (0..30).map(|i| model.tokenizer.encode(&format!("filler sentence number {i} {}", "x ".repeat(i)), false).unwrap()).collect();
    let big = {
        let h = handle.clone();
        std::thread::spawn(move || h.run_blocking(filler, EncoderJobKind::Embed).unwrap())
    };
    let refs: Vec<_> = r
        .sentences
        .iter()
        .map(|s| {
            let h = handle.clone();
            let input = model.tokenizer.encode(s, false).unwrap();
            std::thread::spawn(move || h.run_blocking(vec![input], EncoderJobKind::Embed).unwrap().remove(0))
        })
        .collect();
    for (i, t) in refs.into_iter().enumerate() {
        assert_close(&t.join().unwrap(), &r.embeddings[i], &format!("sentence {i} through the batcher"));
    }
    let big = big.join().unwrap();
    assert_eq!(big.len(), 30);
    assert!(big.iter().all(|v| v.len() == 384));
    let m = handle.metrics();
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(m.sequences.load(Relaxed), 33);
    assert!(m.forwards.load(Relaxed) >= 2, "30 sequences over a 256-token budget need several forwards");
    assert_eq!(m.queued_sequences.load(Relaxed), 0);
    // Invalid submissions are refused at the door.
    assert!(handle.run_blocking(vec![], EncoderJobKind::Embed).is_err());
    assert!(handle.run_blocking(vec![EncoderInput { ids: vec![], type_ids: vec![] }], EncoderJobKind::Embed).is_err());
    assert!(handle.run_blocking(vec![model.tokenizer.encode("a", false).unwrap()], EncoderJobKind::Classify).is_err(), "no head");
}

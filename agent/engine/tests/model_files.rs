//! HF folders and dummy weights: loading, corrupt safetensors, and the backend's batch invariance
//! and input checks on a small random model.

use std::path::Path;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use peregrine_engine::model::{self, LoadFormat, ModelWeights};
use peregrine_engine::EngineError;

const TINY_CONFIG: &str = r#"{"model_type":"llama","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
 "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"max_position_embeddings":256,
 "rms_norm_eps":1e-5,"rope_theta":10000.0,"tie_word_embeddings":false,"bos_token_id":1,"eos_token_id":2,
 "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
 "original_max_position_embeddings":64}}"#;

fn write_safetensors(
    dir: &Path,
    weights: &ModelWeights,
    file: &str,
    mutate: &dyn Fn(&str, &mut Vec<usize>, &mut Vec<u8>, &mut safetensors::Dtype),
) {
    let mut items = Vec::new();
    for (name, (mut shape, data)) in model::safetensors::hf_tensors(weights) {
        let mut bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut dtype = safetensors::Dtype::F32;
        mutate(&name, &mut shape, &mut bytes, &mut dtype);
        items.push((name, shape, bytes, dtype));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = items
        .iter()
        .map(|(n, s, b, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join(file)).unwrap();
}

fn tiny_folder() -> (tempfile::TempDir, ModelWeights) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), TINY_CONFIG).unwrap();
    let dummy = model::load(dir.path(), LoadFormat::Dummy).unwrap();
    write_safetensors(
        dir.path(),
        &dummy.weights,
        "model.safetensors",
        &|_, _, _, _| {},
    );
    (dir, dummy.weights)
}

fn assert_invalid(result: Result<model::LoadedModel, EngineError>, what: &str) {
    match result {
        Err(EngineError::InvalidModel { message, .. }) => assert!(!message.is_empty(), "{what}"),
        Err(other) => panic!("{what}: expected InvalidModel, got {other}"),
        Ok(_) => panic!("{what}: corrupt folder loaded"),
    }
}

#[test]
fn dummy_weights_round_trip_through_safetensors() {
    let (dir, weights) = tiny_folder();
    let loaded = model::load(dir.path(), LoadFormat::Auto).unwrap();
    assert_eq!(
        loaded.weights, weights,
        "f32 safetensors must reproduce the weights exactly"
    );
    let s = loaded.config.rope_scaling.unwrap();
    assert_eq!((s.factor, s.original_max_position_embeddings), (8.0, 64));
    assert!(loaded.weights.lm_head.is_some());
    // The config file itself also works for Dummy, with the same seed.
    let again = model::load(&dir.path().join("config.json"), LoadFormat::Dummy).unwrap();
    assert_eq!(again.weights, weights);
}

#[test]
fn corrupt_safetensors_are_invalid_not_panics() {
    let (dir, weights) = tiny_folder();
    let file = dir.path().join("model.safetensors");
    let good = std::fs::read(&file).unwrap();
    for cut in [0, 4, 8, 9, 100, good.len() / 2, good.len() - 1] {
        std::fs::write(&file, &good[..cut]).unwrap();
        assert_invalid(
            model::load(dir.path(), LoadFormat::Safetensors),
            &format!("cut at {cut}"),
        );
    }
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&file, &bad).unwrap();
    assert_invalid(
        model::load(dir.path(), LoadFormat::Safetensors),
        "absurd header length",
    );
    let mut bad = good.clone();
    bad[8] = b'[';
    std::fs::write(&file, &bad).unwrap();
    assert_invalid(
        model::load(dir.path(), LoadFormat::Safetensors),
        "header not JSON",
    );

    let rewrite = |m: &dyn Fn(&str, &mut Vec<usize>, &mut Vec<u8>, &mut safetensors::Dtype)| {
        write_safetensors(dir.path(), &weights, "model.safetensors", m);
        model::load(dir.path(), LoadFormat::Safetensors)
    };
    assert_invalid(
        rewrite(&|n, _, _, d| {
            if n == "model.norm.weight" {
                *d = safetensors::Dtype::I32;
            }
        }),
        "integer dtype",
    );
    assert_invalid(
        rewrite(&|n, s, b, _| {
            if n == "model.layers.1.mlp.up_proj.weight" {
                s.swap(0, 1);
                let _ = b;
            }
        }),
        "transposed shape",
    );
    assert_invalid(
        rewrite(&|n, s, b, _| {
            if n == "model.layers.0.self_attn.k_proj.weight" {
                s[0] -= 1;
                b.truncate(s[0] * s[1] * 4);
            }
        }),
        "wrong row count",
    );

    // A sharded folder whose index points outside the folder or at nothing.
    std::fs::write(&file, &good).unwrap();
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"weight_map":{"model.norm.weight":"../model.safetensors"}}"#,
    )
    .unwrap();
    assert_invalid(
        model::load(dir.path(), LoadFormat::Safetensors),
        "shard outside the folder",
    );
    std::fs::write(&index, r#"{"weight_map":{}}"#).unwrap();
    assert_invalid(
        model::load(dir.path(), LoadFormat::Safetensors),
        "no shards",
    );
    std::fs::write(&index, r#"{"weight_map": 3"#).unwrap();
    assert_invalid(
        model::load(dir.path(), LoadFormat::Safetensors),
        "index not JSON",
    );
    std::fs::write(
        &index,
        r#"{"weight_map":{"model.norm.weight":"missing.safetensors"}}"#,
    )
    .unwrap();
    assert!(
        model::load(dir.path(), LoadFormat::Safetensors).is_err(),
        "missing shard"
    );
    std::fs::remove_file(&index).unwrap();

    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","hidden_size":64}"#,
    )
    .unwrap();
    assert_invalid(
        model::load(dir.path(), LoadFormat::Safetensors),
        "incomplete config",
    );
}

fn seq(
    start: usize,
    tokens: &[u32],
    context_len: usize,
    table: Vec<u32>,
    wants_logits: bool,
) -> SeqChunk {
    SeqChunk {
        start,
        len: tokens.len(),
        context_len,
        block_table: table,
        wants_logits,
        lora_slot: None,
    }
}

#[test]
fn logits_of_a_sequence_do_not_depend_on_the_rest_of_the_batch() {
    let (dir, _) = tiny_folder();
    let loaded = model::load(dir.path(), LoadFormat::Dummy).unwrap();
    let shape = KvCacheShape {
        num_blocks: 16,
        block_size: 4,
    };
    let mut b = CpuBackend::new(loaded.weights, shape, 2).unwrap();
    let a_tokens = [5u32, 17, 42, 9, 33, 71, 2];
    let c_tokens = [8u32, 8, 91, 60, 3];

    // Alone: the whole prompt in one step.
    let alone = b
        .forward(&StepBatch {
            tokens: a_tokens.to_vec(),
            positions: (0..7).collect(),
            seqs: vec![seq(0, &a_tokens, 0, vec![0, 1], true)],
        })
        .unwrap();
    assert!(alone.data.iter().all(|x| x.is_finite()));

    // Batched with another sequence, after it in the batch, with different blocks.
    let mut tokens = c_tokens.to_vec();
    tokens.extend_from_slice(&a_tokens);
    let mut positions: Vec<u32> = (0..5).collect();
    positions.extend(0..7);
    let batched = b
        .forward(&StepBatch {
            tokens,
            positions,
            seqs: vec![
                seq(0, &c_tokens, 0, vec![7, 3], true),
                seq(5, &a_tokens, 0, vec![9, 12], true),
            ],
        })
        .unwrap();
    assert_eq!(batched.rows(), 2);
    assert_eq!(
        batched.row(1),
        alone.row(0),
        "batch composition changed a sequence's logits"
    );
}

#[test]
fn malformed_step_batches_are_errors() {
    let (dir, _) = tiny_folder();
    let loaded = model::load(dir.path(), LoadFormat::Dummy).unwrap();
    let shape = KvCacheShape {
        num_blocks: 4,
        block_size: 4,
    };
    let mut b = CpuBackend::new(loaded.weights, shape, 1).unwrap();
    let ok = StepBatch {
        tokens: vec![1, 2],
        positions: vec![0, 1],
        seqs: vec![seq(0, &[1, 2], 0, vec![0], true)],
    };
    assert_eq!(b.forward(&ok).unwrap().rows(), 1);
    let cases = [
        (
            "token outside vocab",
            StepBatch {
                tokens: vec![1, 100],
                ..ok.clone()
            },
        ),
        (
            "block outside pool",
            StepBatch {
                seqs: vec![seq(0, &[1, 2], 0, vec![4], true)],
                ..ok.clone()
            },
        ),
        (
            "block table too short",
            StepBatch {
                seqs: vec![seq(0, &[1, 2], 3, vec![0], true)],
                positions: vec![3, 4],
                ..ok.clone()
            },
        ),
        (
            "positions disagree",
            StepBatch {
                positions: vec![0, 2],
                ..ok.clone()
            },
        ),
        (
            "tokens not covered",
            StepBatch {
                seqs: vec![seq(0, &[1], 0, vec![0], true)],
                ..ok.clone()
            },
        ),
        (
            "positions length",
            StepBatch {
                positions: vec![0],
                ..ok.clone()
            },
        ),
    ];
    for (what, batch) in cases {
        assert!(
            matches!(b.forward(&batch), Err(EngineError::Backend(_))),
            "{what}"
        );
    }
}

#[test]
fn bench_helpers_drive_the_backend() {
    use peregrine_engine::bench;
    let (dir, _) = tiny_folder();
    let loaded = model::load(dir.path(), LoadFormat::Dummy).unwrap();
    let blocks = bench::blocks_needed(4, 10, 6, 4).max(bench::blocks_needed(1, 40, 0, 4));
    let shape = KvCacheShape {
        num_blocks: blocks,
        block_size: 4,
    };
    let mut b = CpuBackend::new(loaded.weights, shape, 2).unwrap();
    let p = bench::prefill(&mut b, 40).unwrap();
    assert_eq!(p.tokens, 40);
    assert!(p.tokens_per_second() > 0.0);
    let d = bench::decode(&mut b, 4, 10, 6).unwrap();
    assert_eq!(d.tokens, 24);
    // One block fewer than needed is refused, not a panic.
    let loaded = model::load(dir.path(), LoadFormat::Dummy).unwrap();
    let shape = KvCacheShape {
        num_blocks: bench::blocks_needed(4, 10, 6, 4) - 1,
        block_size: 4,
    };
    let mut b = CpuBackend::new(loaded.weights, shape, 1).unwrap();
    assert!(bench::decode(&mut b, 4, 10, 6).is_err());
}

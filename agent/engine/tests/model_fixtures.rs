//! The GGUF loader and the CPU backend against transformers' float32 reference
//! (`fixtures/smollm2/reference.json`): weight checksums, config, logits at every position, greedy
//! decoding through the paged KV cache, chunked and batched prefill, and the HF-folder path.

mod common;

use std::path::Path;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use peregrine_engine::model::{self, LoadFormat, Matrix, ModelWeights};
use serde_json::Value;

const ATOL: f32 = 1e-3;
const BLOCK: usize = 16;

fn gguf_weights() -> ModelWeights {
    model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF").weights
}

fn backend(weights: ModelWeights) -> CpuBackend {
    CpuBackend::new(weights, KvCacheShape { num_blocks: 64, block_size: BLOCK }, 2).expect("backend")
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Compares one logits row to a fixture position: values at the reference top-10 ids, our own
/// top-10 values, ids wherever the reference separates them by more than the tolerance, logsumexp.
fn check_position(row: &[f32], want: &Value, what: &str) {
    let ids = u32s(&want["top10_ids"]);
    let vals = f32s(&want["top10_logits"]);
    for (&id, &v) in ids.iter().zip(&vals) {
        let got = row[id as usize];
        assert!((got - v).abs() <= ATOL, "{what}: logit of {id} is {got}, reference {v}");
    }
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.select_nth_unstable_by(10, |&a, &b| row[b].total_cmp(&row[a]));
    let mut top: Vec<usize> = order[..10].to_vec();
    top.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    for k in 0..10 {
        assert!((row[top[k]] - vals[k]).abs() <= ATOL, "{what}: rank {k} logit {} vs {}", row[top[k]], vals[k]);
        let separated = (k == 0 || vals[k - 1] - vals[k] > 2.0 * ATOL) && (k == 9 || vals[k] - vals[k + 1] > 2.0 * ATOL);
        if separated {
            assert_eq!(top[k] as u32, ids[k], "{what}: rank {k} id");
        }
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    let want_lse = want["logsumexp"].as_f64().unwrap();
    assert!((lse - want_lse).abs() <= ATOL as f64, "{what}: logsumexp {lse} vs {want_lse}");
}

fn one_seq(tokens: &[u32], context_len: usize, table: Vec<u32>) -> StepBatch {
    StepBatch {
        tokens: tokens.to_vec(),
        positions: (context_len..context_len + tokens.len()).map(|p| p as u32).collect(),
        seqs: vec![SeqChunk { start: 0, len: tokens.len(), context_len, block_table: table, wants_logits: true, lora_slot: None }],
    }
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

/// Every position of every prompt, decoding one token per step through the KV cache; then the whole
/// prompt as one chunk (last position) and the greedy continuation.
fn check_prompts_and_greedy(backend: &mut CpuBackend, reference: &Value, label: &str) {
    let table: Vec<u32> = (0..8).collect();
    for (pi, prompt) in reference["prompts"].as_array().unwrap().iter().enumerate() {
        let ids = u32s(&prompt["input_ids"]);
        let positions = prompt["positions"].as_array().unwrap();
        for (p, &t) in ids.iter().enumerate() {
            let logits = backend.forward(&one_seq(&[t], p, table.clone())).unwrap();
            check_position(logits.row(0), &positions[p], &format!("{label} prompt {pi} pos {p} (token by token)"));
        }
        // Whole prompt in one chunk (overwrites the same blocks).
        let logits = backend.forward(&one_seq(&ids, 0, table.clone())).unwrap();
        let last = ids.len() - 1;
        check_position(logits.row(0), &positions[last], &format!("{label} prompt {pi} one chunk"));

        // Greedy decode one token per step.
        let greedy = &prompt["greedy"];
        let want_ids = u32s(&greedy["ids"]);
        let steps = greedy["steps"].as_array().unwrap();
        let mut row = logits.row(0).to_vec();
        let mut pos = ids.len();
        let mut checked = 0;
        for (s, step) in steps.iter().enumerate() {
            // From the first near-tie on, a correct engine may pick the other token.
            if step["top2_margin"].as_f64().unwrap() < ATOL as f64 {
                break;
            }
            let next = argmax(&row);
            assert_eq!(next, want_ids[s], "{label} prompt {pi} greedy step {s}");
            let want_logit = step["logit"].as_f64().unwrap() as f32;
            assert!((row[next as usize] - want_logit).abs() <= ATOL, "{label} prompt {pi} step {s} logit");
            checked += 1;
            if s + 1 == want_ids.len() {
                break;
            }
            row = backend.forward(&one_seq(&[next], pos, table.clone())).unwrap().row(0).to_vec();
            pos += 1;
        }
        assert!(checked >= 4, "{label} prompt {pi}: only {checked} greedy steps compared");
    }
}

#[test]
fn gguf_weights_config_logits_and_greedy_match_transformers() {
    let reference = common::reference();
    let loaded = model::load(&common::model_path(), LoadFormat::Auto).unwrap();
    let c = &loaded.config;
    let mc = &reference["model_config"];
    assert_eq!(c.hidden_size as u64, mc["hidden_size"].as_u64().unwrap());
    assert_eq!(c.intermediate_size as u64, mc["intermediate_size"].as_u64().unwrap());
    assert_eq!(c.num_hidden_layers as u64, mc["num_hidden_layers"].as_u64().unwrap());
    assert_eq!(c.num_attention_heads as u64, mc["num_attention_heads"].as_u64().unwrap());
    assert_eq!(c.num_key_value_heads as u64, mc["num_key_value_heads"].as_u64().unwrap());
    assert_eq!(c.head_dim as u64, mc["head_dim"].as_u64().unwrap());
    assert_eq!(c.vocab_size as u64, mc["vocab_size"].as_u64().unwrap());
    assert_eq!(c.max_position_embeddings as u64, mc["max_position_embeddings"].as_u64().unwrap());
    assert_eq!(c.rope_theta as f64, mc["rope_theta"].as_f64().unwrap());
    assert_eq!(c.rms_norm_eps as f64, mc["rms_norm_eps"].as_f64().unwrap());
    assert!(c.rope_scaling.is_none());
    assert_eq!(c.tie_word_embeddings, mc["tie_word_embeddings"].as_bool().unwrap());
    assert_eq!(c.attention_bias, mc["attention_bias"].as_bool().unwrap());
    assert_eq!(c.bos_token_id, Some(mc["bos_token_id"].as_u64().unwrap() as u32));
    assert_eq!(c.eos_token_ids, vec![mc["eos_token_id"].as_u64().unwrap() as u32]);
    assert!(loaded.weights.lm_head.is_none(), "SmolLM2 ties the LM head to the embedding");

    check_weight_checksums(&loaded.weights, &reference);
    let mut backend = backend(loaded.weights);
    check_prompts_and_greedy(&mut backend, &reference, "gguf");
}

fn hf_tensor<'a>(w: &'a ModelWeights, name: &str) -> Result<&'a Matrix, &'a [f32]> {
    if name == "model.embed_tokens.weight" {
        return Ok(&w.embed_tokens);
    }
    if name == "model.norm.weight" {
        return Err(&w.norm);
    }
    let rest = name.strip_prefix("model.layers.").unwrap();
    let (i, field) = rest.split_once('.').unwrap();
    let l = &w.layers[i.parse::<usize>().unwrap()];
    match field {
        "self_attn.q_proj.weight" => Ok(&l.q_proj),
        "self_attn.k_proj.weight" => Ok(&l.k_proj),
        "self_attn.v_proj.weight" => Ok(&l.v_proj),
        "self_attn.o_proj.weight" => Ok(&l.o_proj),
        "mlp.gate_proj.weight" => Ok(&l.gate_proj),
        "mlp.up_proj.weight" => Ok(&l.up_proj),
        "mlp.down_proj.weight" => Ok(&l.down_proj),
        "input_layernorm.weight" => Err(&l.input_layernorm),
        "post_attention_layernorm.weight" => Err(&l.post_attention_layernorm),
        other => panic!("unknown tensor {other}"),
    }
}

fn check_weight_checksums(w: &ModelWeights, reference: &Value) {
    let close = |got: f64, want: f64| (got - want).abs() <= 1e-5 * want.abs().max(1.0);
    for (key, want) in reference["weight_checksums"].as_object().unwrap() {
        let name = key.split(' ').next().unwrap();
        let (shape, data): (Vec<u64>, Vec<f32>) = match hf_tensor(w, name) {
            Ok(m) => (vec![m.rows as u64, m.cols as u64], m.to_f32()),
            Err(v) => (vec![v.len() as u64], v.to_vec()),
        };
        let want_shape: Vec<u64> = want["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert_eq!(shape, want_shape, "{key} shape");
        let sum: f64 = data.iter().map(|&x| x as f64).sum();
        let abs: f64 = data.iter().map(|&x| (x as f64).abs()).sum();
        assert!(close(sum, want["sum"].as_f64().unwrap()), "{key}: sum {sum} vs {}", want["sum"]);
        assert!(close(abs, want["abs_sum"].as_f64().unwrap()), "{key}: abs_sum {abs} vs {}", want["abs_sum"]);
        for (i, x) in want["row0_first8"].as_array().unwrap().iter().enumerate() {
            let x = x.as_f64().unwrap();
            assert!((data[i] as f64 - x).abs() <= 1e-5 * x.abs().max(1e-3), "{key}: row0[{i}] {} vs {x}", data[i]);
        }
    }
}

#[test]
fn chunked_and_batched_prefill_match_the_reference() {
    let reference = common::reference();
    let prompts: Vec<(Vec<u32>, &Vec<Value>)> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (u32s(&p["input_ids"]), p["positions"].as_array().unwrap()))
        .collect();
    let mut backend = backend(gguf_weights());
    // Every prompt is split in chunks of `chunk` tokens; step k carries the k-th chunk of every
    // prompt that still has one, each with its own (interleaved, non-contiguous) block table.
    for chunk in [1usize, 2, 3, 4] {
        let tables: Vec<Vec<u32>> = (0..prompts.len()).map(|s| vec![(2 * s + 1) as u32, (2 * s + 30) as u32]).collect();
        let longest = prompts.iter().map(|p| p.0.len()).max().unwrap();
        let mut done = 0;
        while done < longest {
            let mut batch = StepBatch::default();
            let mut expect = Vec::new();
            for (s, (ids, positions)) in prompts.iter().enumerate() {
                if done >= ids.len() {
                    continue;
                }
                let len = chunk.min(ids.len() - done);
                batch.seqs.push(SeqChunk {
                    start: batch.tokens.len(),
                    len,
                    context_len: done,
                    block_table: tables[s].clone(),
                    // Every other sequence skips logits, so rows must come back in the right order.
                    wants_logits: s % 2 == 0 || done + len == ids.len(),
                    lora_slot: None,
                });
                batch.tokens.extend_from_slice(&ids[done..done + len]);
                batch.positions.extend((done..done + len).map(|p| p as u32));
                if batch.seqs.last().unwrap().wants_logits {
                    expect.push((s, done + len - 1, &positions[done + len - 1]));
                }
            }
            let logits = backend.forward(&batch).unwrap();
            assert_eq!(logits.rows(), expect.len());
            for (row, (s, pos, want)) in expect.iter().enumerate() {
                check_position(logits.row(row), want, &format!("chunk {chunk} prompt {s} pos {pos}"));
            }
            done += chunk;
        }
    }
}

fn write_hf_folder(dir: &Path, weights: &ModelWeights, reference: &Value, shards: usize) {
    let mc = &reference["model_config"];
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": mc["hidden_size"], "intermediate_size": mc["intermediate_size"],
        "num_hidden_layers": mc["num_hidden_layers"], "num_attention_heads": mc["num_attention_heads"],
        "num_key_value_heads": mc["num_key_value_heads"], "head_dim": mc["head_dim"],
        "vocab_size": mc["vocab_size"], "max_position_embeddings": mc["max_position_embeddings"],
        "rope_theta": mc["rope_theta"], "rms_norm_eps": mc["rms_norm_eps"], "hidden_act": "silu",
        "tie_word_embeddings": true, "attention_bias": false, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32", "rope_scaling": null
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap()).unwrap();
    std::fs::write(dir.join("generation_config.json"), r#"{"bos_token_id": 1, "eos_token_id": [2, 0]}"#).unwrap();
    let tensors = model::safetensors::hf_tensors(weights);
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(name, (shape, data))| (name, shape, data.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    fn views(part: &[(String, Vec<usize>, Vec<u8>)]) -> Vec<(String, safetensors::tensor::TensorView<'_>)> {
        part.iter()
            .map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap()))
            .collect()
    }
    if shards == 1 {
        safetensors::serialize_to_file(views(&bytes), None, &dir.join("model.safetensors")).unwrap();
    } else {
        let per = bytes.len().div_ceil(shards);
        let mut map = serde_json::Map::new();
        for (i, part) in bytes.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
            safetensors::serialize_to_file(views(part), None, &dir.join(&file)).unwrap();
            for (n, _, _) in part {
                map.insert(n.clone(), Value::String(file.clone()));
            }
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

#[test]
fn hf_safetensors_folders_single_and_sharded_match_the_reference() {
    let reference = common::reference();
    let weights = gguf_weights();
    for shards in [1, 2] {
        let dir = tempfile::tempdir().unwrap();
        write_hf_folder(dir.path(), &weights, &reference, shards);
        let loaded = model::load(dir.path(), LoadFormat::Auto).unwrap();
        assert_eq!(loaded.config.eos_token_ids, vec![2, 0], "generation_config EOS ids are merged");
        assert!(loaded.weights.lm_head.is_none());
        check_weight_checksums(&loaded.weights, &reference);
        let mut backend = backend(loaded.weights);
        // Last position of each prompt (one chunk) and two prompts position by position.
        let table: Vec<u32> = (0..4).collect();
        for (pi, prompt) in reference["prompts"].as_array().unwrap().iter().enumerate() {
            let ids = u32s(&prompt["input_ids"]);
            let positions = prompt["positions"].as_array().unwrap();
            let logits = backend.forward(&one_seq(&ids, 0, table.clone())).unwrap();
            check_position(logits.row(0), &positions[ids.len() - 1], &format!("{shards} shard(s) prompt {pi}"));
            if pi < 2 {
                for (p, &t) in ids.iter().enumerate() {
                    let logits = backend.forward(&one_seq(&[t], p, table.clone())).unwrap();
                    check_position(logits.row(0), &positions[p], &format!("{shards} shard(s) prompt {pi} pos {p}"));
                }
            }
        }
    }
}

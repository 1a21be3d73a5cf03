//! The CPU backend with LoRA slots against PEFT's float32 reference (`fixtures/smollm2/lora_reference.json`):
//! last-position top-10 logits (atol 1e-3) and greedy continuations for adapter-a and adapter-b, each
//! prompt alone and all of them — base, a and b — mixed in the same steps.

mod common;
mod lora_common;

use lora_common::{cases, Case};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use peregrine_engine::lora::LoraAdapter;
use peregrine_engine::model::rotate::{rotate_residual_stream, ROTATION_SEED};
use peregrine_engine::model::{self, LoadFormat};

use lora_common::ATOL;
const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 4;

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// Reference logits at the reference top-10 ids, and our own top-10 ranking where the reference
/// separates neighbours by more than the tolerance.
fn check_top10(row: &[f32], ids: &[u32], vals: &[f32], what: &str) {
    for (&id, &v) in ids.iter().zip(vals) {
        let got = row[id as usize];
        assert!(
            (got - v).abs() <= ATOL,
            "{what}: logit of {id} is {got}, reference {v}"
        );
    }
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
    for k in 0..10 {
        assert!(
            (row[order[k]] - vals[k]).abs() <= ATOL,
            "{what}: rank {k} logit {} vs {}",
            row[order[k]],
            vals[k]
        );
        let separated = (k == 0 || vals[k - 1] - vals[k] > 2.0 * ATOL)
            && (k == 9 || vals[k] - vals[k + 1] > 2.0 * ATOL);
        if separated {
            assert_eq!(order[k] as u32, ids[k], "{what}: rank {k} id");
        }
    }
}

fn backend_with_adapters() -> CpuBackend {
    backend_with_adapters_rotated(false)
}

/// `rotated`: the model's residual stream rotated (`--quantization-rotation`) and each adapter
/// rotated to match at load (`AdapterRotation`).
fn backend_with_adapters_rotated(rotated: bool) -> CpuBackend {
    let mut loaded = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF");
    let rotation = rotated.then(|| rotate_residual_stream(&mut loaded.weights, ROTATION_SEED).unwrap());
    let config = loaded.config.clone();
    let num_blocks = 16 * BLOCKS_PER_SEQ;
    let mut backend = CpuBackend::new(
        loaded.weights,
        KvCacheShape {
            num_blocks,
            block_size: BLOCK,
        },
        2,
    )
    .unwrap();
    backend.enable_lora(2, 64).unwrap();
    for (slot, name) in ["adapter-a", "adapter-b"].into_iter().enumerate() {
        let mut adapter = LoraAdapter::load(&lora_common::adapter_dir(name), &config, 64).unwrap();
        if let Some(r) = &rotation {
            r.rotate(&mut adapter).unwrap();
        }
        backend.set_lora_slot(slot as u32, &adapter).unwrap();
    }
    backend
}

/// Runs `cases` together: all prompts prefilled in one step, then one decode token per live case
/// per step, greedy; checks the prompt's last logits and the continuation of every case.
fn run_together(backend: &mut CpuBackend, cases: &[Case]) {
    struct Live {
        tokens: Vec<u32>,
        context: usize,
        done: bool,
    }
    let mut live: Vec<Live> = cases
        .iter()
        .map(|c| Live {
            tokens: c.prompt.clone(),
            context: 0,
            done: false,
        })
        .collect();
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); cases.len()];
    let mut first = true;
    loop {
        let mut batch = StepBatch::default();
        let mut order = Vec::new();
        for (i, (l, c)) in live.iter().zip(cases).enumerate() {
            if l.done {
                continue;
            }
            let new = &l.tokens[l.context..];
            batch.seqs.push(SeqChunk {
                start: batch.tokens.len(),
                len: new.len(),
                context_len: l.context,
                block_table: (0..BLOCKS_PER_SEQ as u32)
                    .map(|b| i as u32 * BLOCKS_PER_SEQ as u32 + b)
                    .collect(),
                wants_logits: true,
                lora_slot: c.slot,
            });
            batch
                .positions
                .extend((l.context..l.tokens.len()).map(|p| p as u32));
            batch.tokens.extend_from_slice(new);
            order.push(i);
        }
        if order.is_empty() {
            break;
        }
        let logits = backend.forward(&batch).unwrap();
        for (row, &i) in order.iter().enumerate() {
            let row = logits.row(row);
            if first {
                check_top10(
                    row,
                    &cases[i].top10_ids,
                    &cases[i].top10_logits,
                    &cases[i].label,
                );
            }
            let next = argmax(row);
            generated[i].push(next);
            let l = &mut live[i];
            l.context = l.tokens.len();
            l.tokens.push(next);
            l.done = generated[i].len() >= cases[i].greedy.len().max(1) || next == 2;
        }
        first = false;
    }
    for (c, g) in cases.iter().zip(&generated) {
        assert_eq!(
            &g[..c.greedy.len()],
            &c.greedy[..],
            "{}: greedy ids",
            c.label
        );
    }
}

#[test]
fn each_adapter_alone_matches_peft() {
    let mut backend = backend_with_adapters();
    for case in cases(&[("adapter-a", 0), ("adapter-b", 1)]) {
        run_together(&mut backend, std::slice::from_ref(&case));
    }
}

#[test]
fn base_and_both_adapters_mixed_in_one_batch_match_the_references() {
    let mut backend = backend_with_adapters();
    let mut all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    // Interleave so that neighbouring sequences use different slots (many segments per step).
    all.sort_by_key(|c| c.prompt.len() * 7 + c.slot.map_or(0, |s| s as usize + 1));
    run_together(&mut backend, &all);
}

/// Over a rotated model (`--quantization-rotation`, unquantized here so the tolerance is PEFT's),
/// adapters rotated at load give PEFT's logits and continuations: every module's A and B are
/// rotated as the matrix they add to (adapter-b targets all seven modules).
#[test]
fn rotated_adapters_over_a_rotated_model_match_peft() {
    let mut backend = backend_with_adapters_rotated(true);
    let mut all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    all.sort_by_key(|c| c.prompt.len() * 7 + c.slot.map_or(0, |s| s as usize + 1));
    run_together(&mut backend, &all);
}

#[test]
fn a_slot_can_be_rewritten_between_steps() {
    let mut backend = backend_with_adapters();
    let config = backend.config().clone();
    // Put adapter-b into slot 0 (where adapter-a was): slot 0 must now give adapter-b's outputs.
    let b = LoraAdapter::load(&lora_common::adapter_dir("adapter-b"), &config, 64).unwrap();
    backend.set_lora_slot(0, &b).unwrap();
    let cases: Vec<Case> = cases(&[("adapter-b", 0)])
        .into_iter()
        .filter(|c| c.slot.is_some())
        .collect();
    run_together(&mut backend, &cases);
}

#[test]
fn lora_slots_without_enable_lora_are_rejected() {
    let loaded = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF");
    let mut backend = CpuBackend::new(
        loaded.weights,
        KvCacheShape {
            num_blocks: 4,
            block_size: BLOCK,
        },
        2,
    )
    .unwrap();
    let batch = StepBatch {
        tokens: vec![504],
        positions: vec![0],
        seqs: vec![SeqChunk {
            start: 0,
            len: 1,
            context_len: 0,
            block_table: vec![0],
            wants_logits: true,
            lora_slot: Some(0),
        }],
    };
    assert!(backend.forward(&batch).is_err());
    backend.enable_lora(1, 8).unwrap();
    let mut out_of_range = batch.clone();
    out_of_range.seqs[0].lora_slot = Some(1);
    assert!(backend.forward(&out_of_range).is_err());
}

#[test]
fn lora_decode_bench_runs_on_the_real_model() {
    use peregrine_engine::bench::lora::{decode_with_lora, random_adapters, zipf_assignment};
    let loaded = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF");
    let config = loaded.config.clone();
    let mut backend = CpuBackend::new(
        loaded.weights,
        KvCacheShape {
            num_blocks: 8,
            block_size: BLOCK,
        },
        2,
    )
    .unwrap();
    let adapters = random_adapters(&config, 2, 4, 0);
    let assignment = zipf_assignment(4, 2, 1.0, 0.25, 0);
    let figure = decode_with_lora(&mut backend, &adapters, &assignment, 8, 2).unwrap();
    assert_eq!(figure.tokens, 8);
    assert!(
        decode_with_lora(&mut backend, &adapters, &[Some(2)], 1, 1).is_err(),
        "adapter index out of range"
    );
}

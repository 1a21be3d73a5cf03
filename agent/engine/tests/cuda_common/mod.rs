//! Helpers shared by the GPU integration tests (`cuda_*.rs`).
#![allow(dead_code)]

use std::io::Write;

use peregrine_engine::backend::cuda;
use peregrine_engine::backend::{Backend, SeqChunk, StepBatch};
use serde_json::Value;

/// Whether a GPU is usable. Where none is, prints a visible "skipped: no CUDA device: <why>" (CI),
/// unless `PEREGRINE_REQUIRE_GPU` is set (`make test-gpu`), which makes it a failure: a GPU machine
/// cannot pass by skipping.
pub fn gpu_or_skip() -> bool {
    match cuda::available() {
        Ok(()) => true,
        Err(e) => {
            if std::env::var_os("PEREGRINE_REQUIRE_GPU").is_some() {
                panic!("PEREGRINE_REQUIRE_GPU is set but no GPU is usable: {e}");
            }
            // Straight to stderr: the harness captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device: {e}");
            false
        }
    }
}

/// A line on stderr that the test harness does not capture (figures a person should see).
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

pub fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

pub fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Deterministic values with a few outliers, as hidden states have (uniform in ±scale, every 97th ×20).
pub fn values(n: usize, salt: u64, scale: f32) -> Vec<f32> {
    let mut s = salt.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            u * scale * if i % 97 == 3 { 20.0 } else { 1.0 }
        })
        .collect()
}

pub fn u32s(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// One sequence's chunk of `tokens` after `context_len` cached ones, its logits wanted.
pub fn one_seq(tokens: &[u32], context_len: usize, table: Vec<u32>) -> StepBatch {
    StepBatch {
        tokens: tokens.to_vec(),
        positions: (context_len..context_len + tokens.len()).map(|p| p as u32).collect(),
        seqs: vec![SeqChunk { start: 0, len: tokens.len(), context_len, block_table: table, wants_logits: true, lora_slot: None }],
    }
}

/// Greedy ids from a backend (up to `steps`, stopping at <|im_end|>), with each step's top-2 margin.
pub fn greedy(b: &mut dyn Backend, prompt: &[u32], steps: usize, table: &[u32]) -> (Vec<u32>, Vec<f32>) {
    let mut row = b.forward(&one_seq(prompt, 0, table.to_vec())).unwrap().row(0).to_vec();
    let (mut ids, mut margins) = (vec![], vec![]);
    let mut pos = prompt.len();
    for _ in 0..steps {
        let next = argmax(&row);
        ids.push(next);
        margins.push(top2_margin(&row));
        if next == 2 {
            break; // <|im_end|>
        }
        row = b.forward(&one_seq(&[next], pos, table.to_vec())).unwrap().row(0).to_vec();
        pos += 1;
    }
    (ids, margins)
}

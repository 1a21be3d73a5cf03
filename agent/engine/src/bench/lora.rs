//! What `peregrine-agent bench --lora` needs: N random adapters shaped for the base model (seeded),
//! as values or as PEFT folders for the engine path, a Zipf spread of requests over them, and a
//! backend-level decode measurement with adapters in the batch (the base-only figure comes from
//! [`crate::bench::decode`], which lays out the same batch).

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::lora::LoraAdapter;
use crate::lora::random::{RandomAdapterSpec, ZipfSampler};
use crate::lora::save_peft;
use super::BenchFigure;
use crate::backend::Backend;
use crate::plan::{SeqChunk, StepBatch};
use crate::config::ModelConfig;
use crate::{EngineError, Result};

/// `n` random adapters of rank `rank` on all seven projections; adapter `i` uses seed `seed + i`.
pub fn random_adapters(config: &ModelConfig, n: usize, rank: usize, seed: u64) -> Vec<LoraAdapter> {
    (0..n).map(|i| random_adapter(config, rank, seed, i)).collect()
}

/// Adapter `i` of [`random_adapters`].
fn random_adapter(config: &ModelConfig, rank: usize, seed: u64, i: usize) -> LoraAdapter {
    LoraAdapter::random(config, &RandomAdapterSpec::new(rank, seed + i as u64))
}

/// Writes [`random_adapters`], narrowed to bf16, as PEFT folders `dir/adapter-{i}`; returns
/// `(name, folder)` pairs to pass to `EngineHandle::load_adapter`. bf16 is how PEFT adapters are
/// commonly shipped (a rank-32 adapter of an 8B model on all seven projections is 168 MB), so the
/// load and host-cache figures are those of a real adapter. Each adapter is made and written before
/// the next, so host memory holds one at a time (64 rank-64 adapters of an 8B model are 21 GB).
pub fn write_random_adapters(
    config: &ModelConfig,
    n: usize,
    rank: usize,
    seed: u64,
    dir: &Path,
) -> Result<Vec<(String, PathBuf)>> {
    (0..n)
        .map(|i| {
            let adapter = random_adapter(config, rank, seed, i).into_bf16();
            let name = format!("adapter-{i}");
            let folder = dir.join(&name);
            save_peft(&adapter, &folder)?;
            Ok((name, folder))
        })
        .collect()
}

/// The adapter index of each of `requests` requests, Zipf(`s`) over `n_adapters` (index 0 the most
/// popular). `base_fraction` of the requests (0..=1) use no adapter (`None`).
pub fn zipf_assignment(
    requests: usize,
    n_adapters: usize,
    s: f64,
    base_fraction: f64,
    seed: u64,
) -> Vec<Option<usize>> {
    let mut zipf = ZipfSampler::new(n_adapters, s, seed);
    let mut base = ZipfSampler::new(1, 0.0, seed ^ 0x9e37_79b9_7f4a_7c15);
    (0..requests)
        .map(|_| {
            let pick = zipf.sample();
            // A second stream decides base vs adapter, so the adapter spread does not depend on it.
            if n_adapters == 0 || base.uniform() < base_fraction {
                None
            } else {
                Some(pick)
            }
        })
        .collect()
}

/// Decode throughput with LoRA: `assignment.len()` sequences (the batch), sequence `i` on adapter
/// `assignment[i]` (an index into `adapters`, each written into its own slot; None = base),
/// each prefilled with `context` tokens (untimed), then `steps` timed decode steps. Needs
/// `batch · ((context + steps) / block_size + 1)` KV blocks.
pub fn decode_with_lora(
    backend: &mut dyn Backend,
    adapters: &[LoraAdapter],
    assignment: &[Option<usize>],
    context: usize,
    steps: usize,
) -> Result<BenchFigure> {
    let max_rank = adapters.iter().map(|a| a.rank).max().unwrap_or(1);
    backend.enable_lora(adapters.len().max(1), max_rank)?;
    for (slot, adapter) in adapters.iter().enumerate() {
        backend.set_lora_slot(slot as u32, adapter)?;
    }
    if let Some(bad) = assignment.iter().flatten().find(|&&a| a >= adapters.len()) {
        return Err(EngineError::InvalidRequest(format!(
            "adapter index {bad} but {} adapters",
            adapters.len()
        )));
    }
    let batch = assignment.len();
    let bs = backend.kv_shape().block_size;
    let vocab = backend.config().vocab_size.max(1);
    let per_seq = (context + steps).div_ceil(bs);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| (s * per_seq..(s + 1) * per_seq).map(|b| b as u32).collect())
        .collect();
    let token = |i: usize, salt: usize| ((i * 7919 + salt * 104_729 + 1000) % vocab) as u32;
    let slot = |s: usize| assignment[s].map(|a| a as u32);
    if context > 0 {
        for (s, table) in tables.iter().enumerate() {
            let prompt = StepBatch {
                tokens: (0..context).map(|i| token(i, s)).collect(),
                positions: (0..context as u32).collect(),
                seqs: vec![SeqChunk {
                    start: 0,
                    len: context,
                    context_len: 0,
                    block_table: table.clone(),
                    wants_logits: false,
                    lora_slot: slot(s),
                }],
            };
            backend.forward(&prompt)?;
        }
    }
    let mut next: Vec<u32> = (0..batch).map(|s| token(0, s + 17)).collect();
    let start = Instant::now();
    for step in 0..steps {
        let pos = context + step;
        let step_batch = StepBatch {
            tokens: next.clone(),
            positions: vec![pos as u32; batch],
            seqs: (0..batch)
                .map(|s| SeqChunk {
                    start: s,
                    len: 1,
                    context_len: pos,
                    block_table: tables[s].clone(),
                    wants_logits: true,
                    lora_slot: slot(s),
                })
                .collect(),
        };
        let logits = backend.forward(&step_batch)?;
        for (s, t) in next.iter_mut().enumerate() {
            let row = logits.row(s);
            *t = row
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                )
                .0 as u32;
        }
    }
    Ok(BenchFigure {
        tokens: batch * steps,
        elapsed: start.elapsed(),
    })
}

//! Throughput measurement helpers for `peregrine-agent bench`: drive a backend the way the engine
//! does (one prefill of a long prompt; decode steps of a batch of sequences) and time it.

use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::plan::{SeqChunk, StepBatch};
use crate::Result;

pub mod fidelity;
pub mod lora;
pub mod masks;

#[derive(Debug, Clone, PartialEq)]
pub struct BenchFigure {
    pub tokens: usize,
    pub elapsed: Duration,
}

impl BenchFigure {
    pub fn tokens_per_second(&self) -> f64 {
        self.tokens as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// KV blocks that [`prefill`] (`batch = 1`, `steps = 0`) or [`decode`] needs.
pub fn blocks_needed(batch: usize, context: usize, steps: usize, block_size: usize) -> usize {
    batch * (context + steps).div_ceil(block_size.max(1))
}

/// Blocks a sequence of `len` tokens needs, laid out consecutively from `first`.
fn table(first: usize, len: usize, block_size: usize) -> Vec<u32> {
    (first..first + len.div_ceil(block_size))
        .map(|b| b as u32)
        .collect()
}

/// Token ids that look like text to the model without a tokenizer (a fixed arithmetic walk).
fn synthetic_tokens(n: usize, vocab: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + salt * 104_729 + 1000) % vocab.max(1)) as u32)
        .collect()
}

/// Prefill of one `prompt_len`-token prompt in one step. Needs `prompt_len / block_size + 1` blocks.
pub fn prefill(backend: &mut dyn Backend, prompt_len: usize) -> Result<BenchFigure> {
    let bs = backend.kv_shape().block_size;
    let vocab = backend.config().vocab_size;
    let batch = StepBatch {
        tokens: synthetic_tokens(prompt_len, vocab, 0),
        positions: (0..prompt_len as u32).collect(),
        seqs: vec![SeqChunk {
            start: 0,
            len: prompt_len,
            context_len: 0,
            block_table: table(0, prompt_len, bs),
            wants_logits: true,
            lora_slot: None,
        }],
    };
    let start = Instant::now();
    backend.forward(&batch)?;
    Ok(BenchFigure {
        tokens: prompt_len,
        elapsed: start.elapsed(),
    })
}

/// `batch` sequences, each prefilled with `context` tokens (untimed), then `steps` decode steps of one
/// token per sequence (timed). Needs `batch * ((context + steps) / block_size + 1)` blocks.
pub fn decode(
    backend: &mut dyn Backend,
    batch: usize,
    context: usize,
    steps: usize,
) -> Result<BenchFigure> {
    let bs = backend.kv_shape().block_size;
    let vocab = backend.config().vocab_size;
    let per_seq = (context + steps).div_ceil(bs);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| table(s * per_seq, context + steps, bs))
        .collect();
    for (s, tbl) in tables.iter().enumerate() {
        let prompt = StepBatch {
            tokens: synthetic_tokens(context, vocab, s),
            positions: (0..context as u32).collect(),
            seqs: vec![SeqChunk {
                start: 0,
                len: context,
                context_len: 0,
                block_table: tbl.clone(),
                wants_logits: false,
                lora_slot: None,
            }],
        };
        if context > 0 {
            backend.forward(&prompt)?;
        }
    }
    let mut next: Vec<u32> = (0..batch)
        .map(|s| synthetic_tokens(1, vocab, s + 17)[0])
        .collect();
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
                    lora_slot: None,
                })
                .collect(),
        };
        let logits = backend.forward(&step_batch)?;
        // Greedy, so the work looks like real decoding.
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

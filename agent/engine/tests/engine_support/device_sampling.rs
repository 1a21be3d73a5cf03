//! A backend wrapper that "samples on its device" on the host, following the contract of
//! `Backend::forward_sample` and the CUDA kernel (`sample.cu`) exactly: candidates as the CPU sampler
//! keeps them (`keep_mask`), then the inverse CDF in id order at the request's own number `u`. It lets
//! the engine's device-sampling path (row plans, host rows, token routing) run in CI without a GPU.

use peregrine_engine::backend::{Backend, KvCacheShape, Logits, RowSampling, SampledStep, StepBatch};
use peregrine_engine::config::ModelConfig;
use peregrine_engine::sampling::{argmax, keep_mask, GREEDY_TEMPERATURE};

pub struct HostDevice<B>(pub B);

/// The token `sample_rows` picks for this row and plan.
pub fn pick(row: &[f32], temperature: f32, top_k: u32, top_p: f32, min_p: f32, u: f32) -> u32 {
    if temperature < GREEDY_TEMPERATURE {
        return argmax(row) as u32;
    }
    let scaled: Vec<f32> = row.iter().map(|&l| l / temperature).collect();
    let mut kept = keep_mask(&scaled, top_k as usize, top_p, min_p);
    kept.sort_by_key(|&(id, _)| id);
    let total: f64 = kept.iter().map(|&(_, p)| p).sum();
    let target = u as f64 * total;
    let mut cum = 0.0;
    for &(id, p) in &kept {
        cum += p;
        if cum > target {
            return id as u32;
        }
    }
    kept.last().map_or(argmax(row) as u32, |&(id, _)| id as u32)
}

impl<B: Backend> Backend for HostDevice<B> {
    fn config(&self) -> &ModelConfig {
        self.0.config()
    }

    fn kv_shape(&self) -> KvCacheShape {
        self.0.kv_shape()
    }

    fn forward(&mut self, batch: &StepBatch) -> peregrine_engine::Result<Logits> {
        self.0.forward(batch)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sample(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> peregrine_engine::Result<SampledStep> {
        let logits = self.0.forward(batch)?;
        assert_eq!(rows.len(), logits.rows(), "one plan per logits row");
        let mut step = SampledStep { tokens: Vec::new(), host_logits: Logits { vocab: logits.vocab, data: Vec::new() } };
        for (r, plan) in rows.iter().enumerate() {
            let row = logits.row(r);
            step.tokens.push(match *plan {
                RowSampling::Host => {
                    step.host_logits.data.extend_from_slice(row);
                    None
                }
                RowSampling::Draw { temperature, top_k, top_p, min_p, uniform } => Some(pick(row, temperature, top_k, top_p, min_p, uniform)),
            });
        }
        Ok(step)
    }

    fn name(&self) -> String {
        format!("{} (sampling as on a device)", self.0.name())
    }
}

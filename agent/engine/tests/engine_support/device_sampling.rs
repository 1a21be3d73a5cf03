//! A backend wrapper that "samples on its device" on the host, following the contract of
//! `Backend::forward_sample` and the CUDA kernel (`sample.cu`) exactly: candidates as the CPU sampler
//! keeps them (`keep_mask`), then the inverse CDF in id order at the request's own number `u`. It lets
//! the engine's device-sampling path (row plans, host rows, token routing) run in CI without a GPU.
//! [`HostDevice::with_masks`] also applies token masks and logit biases "on the device" as
//! `token_mask.cu` does (the mask, then the biases in order), for the engine's constrained path.

use peregrine_engine::backend::{Backend, KvCacheShape, Logits, RowConstraints, RowSampling, SampledStep, StepBatch};
use peregrine_engine::config::ModelConfig;
use peregrine_engine::sampling::{argmax, keep_mask, GREEDY_TEMPERATURE};

pub struct HostDevice<B> {
    inner: B,
    applies_masks: bool,
}

impl<B> HostDevice<B> {
    /// Samples on the "device"; constrained rows go to the host.
    pub fn new(inner: B) -> Self {
        HostDevice { inner, applies_masks: false }
    }

    /// Also applies masks and biases itself (`Backend::forward_sample_constrained`).
    pub fn with_masks(inner: B) -> Self {
        HostDevice { inner, applies_masks: true }
    }
}

/// Constrained rows a [`HostDevice::with_masks`] has applied, in this process (proof the path ran).
pub static CONSTRAINED_ROWS_APPLIED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

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
        self.inner.config()
    }

    fn kv_shape(&self) -> KvCacheShape {
        self.inner.kv_shape()
    }

    fn forward(&mut self, batch: &StepBatch) -> peregrine_engine::Result<Logits> {
        self.inner.forward(batch)
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    fn forward_sample(&mut self, batch: &StepBatch, rows: &[RowSampling]) -> peregrine_engine::Result<SampledStep> {
        let logits = self.inner.forward(batch)?;
        Ok(sample_rows(&logits, rows))
    }

    fn applies_constraints_on_device(&self) -> bool {
        self.applies_masks
    }

    fn forward_sample_constrained(&mut self, batch: &StepBatch, rows: &[RowSampling], while_running: &mut dyn FnMut() -> RowConstraints) -> peregrine_engine::Result<SampledStep> {
        assert!(self.applies_masks, "the engine asked a backend that does not apply masks to apply them");
        let mut logits = self.inner.forward(batch)?;
        let constraints = while_running();
        let vocab = logits.vocab;
        CONSTRAINED_ROWS_APPLIED.fetch_add(constraints.len(), std::sync::atomic::Ordering::Relaxed);
        for c in constraints.rows() {
            assert!(matches!(rows[c.row], RowSampling::Draw { .. }), "constraints only for device rows");
            let row = &mut logits.data[c.row * vocab..(c.row + 1) * vocab];
            if let Some(mask) = c.mask {
                for (t, l) in row.iter_mut().enumerate() {
                    if (mask[t / 32] >> (t % 32)) & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            for &(t, b) in c.biases {
                row[t as usize] += b;
            }
        }
        Ok(sample_rows(&logits, rows))
    }

    fn name(&self) -> String {
        format!("{} (sampling as on a device)", self.inner.name())
    }
}

/// What the device sampler returns for these logits and plans.
fn sample_rows(logits: &Logits, rows: &[RowSampling]) -> SampledStep {
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
    step
}


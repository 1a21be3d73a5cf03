//! How close a backend's logits are to a reference's (e.g. transformers in float32): mean and max
//! |Δlogit| over the reference's top-k ids at every position, and top-1 agreement. Used to measure
//! what 8-bit weights cost (`examples/quant_fidelity.rs`) and to bound it in tests.

use crate::backend::Backend;
use crate::plan::{SeqChunk, StepBatch};
use crate::Result;

/// One prompt of a reference: its tokens and, for each position, the reference's top-k next-token
/// ids (best first) and their logits.
#[derive(Debug, Clone)]
pub struct ReferencePrompt {
    pub input_ids: Vec<u32>,
    pub positions: Vec<(Vec<u32>, Vec<f32>)>,
}

/// The prompts of a reference file in the fixtures' format (`prompts[].input_ids`,
/// `prompts[].positions[].top10_ids` / `top10_logits`, see `tests/fixtures/README.md`).
pub fn prompts_from_reference(json: &serde_json::Value) -> std::result::Result<Vec<ReferencePrompt>, String> {
    fn list<T>(v: &serde_json::Value, what: &str, f: impl Fn(&serde_json::Value) -> Option<T>) -> std::result::Result<Vec<T>, String> {
        v.as_array()
            .ok_or_else(|| format!("{what} is not a list"))?
            .iter()
            .map(|x| f(x).ok_or_else(|| format!("{what} holds a bad value {x}")))
            .collect()
    }
    let ids = |v: &serde_json::Value, what: &str| list(v, what, |x| x.as_u64().and_then(|n| u32::try_from(n).ok()));
    let mut out = Vec::new();
    for p in json["prompts"].as_array().ok_or("no prompts list")? {
        let input_ids = ids(&p["input_ids"], "input_ids")?;
        let mut positions = Vec::new();
        for q in p["positions"].as_array().ok_or("no positions list")? {
            let top = ids(&q["top10_ids"], "top10_ids")?;
            let logits = list(&q["top10_logits"], "top10_logits", |x| x.as_f64().map(|f| f as f32))?;
            positions.push((top, logits));
        }
        if positions.len() != input_ids.len() {
            return Err(format!("{} positions for {} input ids", positions.len(), input_ids.len()));
        }
        out.push(ReferencePrompt { input_ids, positions });
    }
    Ok(out)
}

/// Accumulated comparison over positions.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Fidelity {
    pub positions: usize,
    pub top1_agree: usize,
    /// Logits compared (positions × k).
    pub compared: usize,
    pub sum_abs_diff: f64,
    pub max_abs_diff: f64,
}

impl Fidelity {
    pub fn mean_abs_diff(&self) -> f64 {
        self.sum_abs_diff / self.compared.max(1) as f64
    }

    /// Adds one position: `row` is our full logits row.
    pub fn add(&mut self, row: &[f32], ref_ids: &[u32], ref_logits: &[f32]) {
        self.positions += 1;
        if ref_ids.first().is_some_and(|&id| argmax(row) == id as usize) {
            self.top1_agree += 1;
        }
        for (&id, &want) in ref_ids.iter().zip(ref_logits) {
            let got = row.get(id as usize).copied().unwrap_or(f32::NAN);
            let d = (got as f64 - want as f64).abs();
            self.compared += 1;
            self.sum_abs_diff += d;
            // NaN compares false: make it the maximum so it is never hidden.
            if d.is_nan() || d > self.max_abs_diff {
                self.max_abs_diff = if d.is_nan() { f64::INFINITY } else { d };
            }
        }
    }
}

/// Lowest index of the largest value (the greedy pick).
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best
}

/// Runs every prompt token by token through the backend's KV cache (blocks `0..` reused per prompt)
/// and compares each position's logits with the reference.
pub fn measure(backend: &mut dyn Backend, prompts: &[ReferencePrompt]) -> Result<Fidelity> {
    let block = backend.kv_shape().block_size.max(1);
    let mut fidelity = Fidelity::default();
    for prompt in prompts {
        let table: Vec<u32> = (0..prompt.input_ids.len().div_ceil(block) as u32).collect();
        for (pos, (&token, (ids, logits))) in prompt.input_ids.iter().zip(&prompt.positions).enumerate() {
            let batch = StepBatch {
                tokens: vec![token],
                positions: vec![pos as u32],
                seqs: vec![SeqChunk {
                    start: 0,
                    len: 1,
                    context_len: pos,
                    block_table: table.clone(),
                    wants_logits: true,
                    lora_slot: None,
                }],
            };
            let out = backend.forward(&batch)?;
            fidelity.add(out.row(0), ids, logits);
        }
    }
    Ok(fidelity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_top1_and_max() {
        let mut f = Fidelity::default();
        f.add(&[0.0, 3.0, 1.0], &[1, 2], &[2.5, 1.0]);
        f.add(&[5.0, 3.0, 1.0], &[1, 0], &[4.0, 4.5]);
        assert_eq!((f.positions, f.top1_agree, f.compared), (2, 1, 4));
        assert!((f.mean_abs_diff() - (0.5 + 0.0 + 1.0 + 0.5) / 4.0).abs() < 1e-12);
        assert_eq!(f.max_abs_diff, 1.0);
        f.add(&[f32::NAN, 0.0], &[0], &[1.0]);
        assert_eq!(f.max_abs_diff, f64::INFINITY, "NaN logits are never hidden");
    }
}

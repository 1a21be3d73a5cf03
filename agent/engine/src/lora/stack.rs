//! Adapter weights laid out the way a grouped GEMM wants them: per layer and target module, every
//! slot's A stacked into `[slots, r_max, in]` and every slot's B into `[slots, out, r_max]`,
//! zero-padded from the adapter's rank to `r_max`. The CPU backend computes from this layout and a
//! CUDA backend copies it to the device as is.

use super::adapter::LoraAdapter;
use super::target::TargetModule;
use crate::config::ModelConfig;
use crate::{EngineError, Result};

/// The stacked A and B of one (layer, module). Empty until a slot targets this module, so a model
/// whose adapters touch only attention does not pay for MLP stacks.
#[derive(Debug, Clone, Default)]
pub struct ModuleStack {
    /// `[slots, r_max, in]`.
    pub a: Vec<f32>,
    /// `[slots, out, r_max]`.
    pub b: Vec<f32>,
}

/// A fixed number of adapter slots for one base model.
#[derive(Debug, Clone)]
pub struct LoraSlotStack {
    num_slots: usize,
    r_max: usize,
    /// `(in, out)` of each module, indexed by [`TargetModule::index`].
    dims: [(usize, usize); 7],
    /// `layers[l][module]`.
    layers: Vec<[ModuleStack; 7]>,
    /// `ranks[slot][module]`: the adapter's rank, 0 when the slot is empty or does not target it.
    ranks: Vec<[usize; 7]>,
    scales: Vec<f32>,
}

impl LoraSlotStack {
    pub fn new(config: &ModelConfig, num_slots: usize, r_max: usize) -> LoraSlotStack {
        let mut dims = [(0, 0); 7];
        for m in TargetModule::ALL {
            dims[m.index()] = m.dims(config);
        }
        LoraSlotStack {
            num_slots,
            r_max,
            dims,
            layers: (0..config.num_hidden_layers).map(|_| Default::default()).collect(),
            ranks: vec![[0; 7]; num_slots],
            scales: vec![0.0; num_slots],
        }
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    pub fn r_max(&self) -> usize {
        self.r_max
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn dims(&self, module: TargetModule) -> (usize, usize) {
        self.dims[module.index()]
    }

    /// Rank of `slot`'s adapter for `module` (0: nothing to apply).
    pub fn rank(&self, slot: usize, module: TargetModule) -> usize {
        self.ranks.get(slot).map_or(0, |r| r[module.index()])
    }

    pub fn scale(&self, slot: usize) -> f32 {
        self.scales.get(slot).copied().unwrap_or(0.0)
    }

    pub fn module(&self, layer: usize, module: TargetModule) -> &ModuleStack {
        &self.layers[layer][module.index()]
    }

    /// Writes `adapter` into `slot`, replacing whatever was there.
    pub fn set_slot(&mut self, slot: usize, adapter: &LoraAdapter) -> Result<()> {
        if slot >= self.num_slots {
            return Err(EngineError::Backend(format!("LoRA slot {slot} out of range ({} slots)", self.num_slots)));
        }
        if adapter.rank > self.r_max {
            return Err(EngineError::Backend(format!(
                "adapter rank {} exceeds the slots' r_max {}",
                adapter.rank, self.r_max
            )));
        }
        if adapter.layers.len() != self.layers.len() {
            return Err(EngineError::Backend(format!(
                "adapter has {} layers, the model {}",
                adapter.layers.len(),
                self.layers.len()
            )));
        }
        self.clear_slot(slot);
        let (r, r_max, num_slots) = (adapter.rank, self.r_max, self.num_slots);
        for (layer, pairs) in adapter.layers.iter().enumerate() {
            for m in TargetModule::ALL {
                let Some(pair) = &pairs[m.index()] else { continue };
                let (fan_in, fan_out) = self.dims[m.index()];
                if pair.a.len() != r * fan_in || pair.b.len() != fan_out * r {
                    return Err(EngineError::Backend(format!("adapter {m} of layer {layer} has the wrong size")));
                }
                let stack = &mut self.layers[layer][m.index()];
                if stack.a.is_empty() {
                    stack.a = vec![0.0; num_slots * r_max * fan_in];
                    stack.b = vec![0.0; num_slots * fan_out * r_max];
                }
                let a_slot = &mut stack.a[slot * r_max * fan_in..][..r * fan_in];
                a_slot.copy_from_slice(&pair.a);
                let b_slot = &mut stack.b[slot * fan_out * r_max..][..fan_out * r_max];
                for (dst, src) in b_slot.chunks_exact_mut(r_max).zip(pair.b.chunks_exact(r)) {
                    dst[..r].copy_from_slice(src);
                }
            }
        }
        for m in &adapter.targets {
            self.ranks[slot][m.index()] = r;
        }
        self.scales[slot] = adapter.scaling;
        Ok(())
    }

    /// Empties `slot` (zeroes its weights so a stale read can only add zero).
    pub fn clear_slot(&mut self, slot: usize) {
        if slot >= self.num_slots {
            return;
        }
        let r_max = self.r_max;
        for layer in &mut self.layers {
            for m in TargetModule::ALL {
                let stack = &mut layer[m.index()];
                if stack.a.is_empty() {
                    continue;
                }
                let (fan_in, fan_out) = self.dims[m.index()];
                stack.a[slot * r_max * fan_in..][..r_max * fan_in].fill(0.0);
                stack.b[slot * fan_out * r_max..][..fan_out * r_max].fill(0.0);
            }
        }
        self.ranks[slot] = [0; 7];
        self.scales[slot] = 0.0;
    }
}

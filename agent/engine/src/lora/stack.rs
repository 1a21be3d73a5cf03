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
    /// `[slots, out, r_max]` (the grouped-GEMM layout).
    pub b: Vec<f32>,
    /// `[slots, r_max, out]`: B transposed, for the CPU expand, which then streams contiguous
    /// output rows (vectorised axpy) instead of doing one short dot product per output.
    pub b_t: Vec<f32>,
}

/// A fixed number of adapter slots for one base model. `r_max` starts at the smallest rank set
/// (rounded up to 8) and grows, re-laying out the stacks, when a larger adapter arrives, up to
/// `max_rank`: memory and padded compute follow the adapters actually served.
#[derive(Debug, Clone)]
pub struct LoraSlotStack {
    num_slots: usize,
    r_max: usize,
    max_rank: usize,
    /// `(in, out)` of each module, indexed by [`TargetModule::index`].
    dims: [(usize, usize); 7],
    /// `layers[l][module]`.
    layers: Vec<[ModuleStack; 7]>,
    /// `ranks[slot][module]`: the adapter's rank, 0 when the slot is empty or does not target it.
    ranks: Vec<[usize; 7]>,
    scales: Vec<f32>,
}

impl LoraSlotStack {
    pub fn new(config: &ModelConfig, num_slots: usize, max_rank: usize) -> LoraSlotStack {
        let mut dims = [(0, 0); 7];
        for m in TargetModule::ALL {
            dims[m.index()] = m.dims(config);
        }
        LoraSlotStack {
            num_slots,
            r_max: 0,
            max_rank,
            dims,
            layers: (0..config.num_hidden_layers)
                .map(|_| Default::default())
                .collect(),
            ranks: vec![[0; 7]; num_slots],
            scales: vec![0.0; num_slots],
        }
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Current padded rank of the stacks.
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
            return Err(EngineError::Backend(format!(
                "LoRA slot {slot} out of range ({} slots)",
                self.num_slots
            )));
        }
        if adapter.rank > self.max_rank {
            return Err(EngineError::Backend(format!(
                "adapter rank {} exceeds max_lora_rank {}",
                adapter.rank, self.max_rank
            )));
        }
        if adapter.layers.len() != self.layers.len() {
            return Err(EngineError::Backend(format!(
                "adapter has {} layers, the model {}",
                adapter.layers.len(),
                self.layers.len()
            )));
        }
        for (layer, pairs) in adapter.layers.iter().enumerate() {
            for m in TargetModule::ALL {
                let Some(pair) = &pairs[m.index()] else {
                    continue;
                };
                let (fan_in, fan_out) = self.dims[m.index()];
                if pair.a.len() != adapter.rank * fan_in || pair.b.len() != fan_out * adapter.rank {
                    return Err(EngineError::Backend(format!(
                        "adapter {m} of layer {layer} has the wrong size"
                    )));
                }
            }
        }
        if adapter.rank > self.r_max {
            self.grow(adapter.rank.next_multiple_of(8).min(self.max_rank));
        }
        self.clear_slot(slot);
        let (r, r_max, num_slots) = (adapter.rank, self.r_max, self.num_slots);
        for (layer, pairs) in adapter.layers.iter().enumerate() {
            for m in TargetModule::ALL {
                let Some(pair) = &pairs[m.index()] else {
                    continue;
                };
                let (fan_in, fan_out) = self.dims[m.index()];
                let stack = &mut self.layers[layer][m.index()];
                if stack.a.is_empty() {
                    stack.a = vec![0.0; num_slots * r_max * fan_in];
                    stack.b = vec![0.0; num_slots * fan_out * r_max];
                    stack.b_t = vec![0.0; num_slots * r_max * fan_out];
                }
                // 16-bit adapters widen here (exactly); f32 ones are borrowed.
                let (pair_a, pair_b) = (pair.a.as_f32(), pair.b.as_f32());
                stack.a[slot * r_max * fan_in..][..r * fan_in].copy_from_slice(&pair_a);
                let b_slot = &mut stack.b[slot * fan_out * r_max..][..fan_out * r_max];
                for (dst, src) in b_slot.chunks_exact_mut(r_max).zip(pair_b.chunks_exact(r)) {
                    dst[..r].copy_from_slice(src);
                }
                let bt_slot = &mut stack.b_t[slot * r_max * fan_out..][..r * fan_out];
                for (o, src) in pair_b.chunks_exact(r).enumerate() {
                    for (j, &v) in src.iter().enumerate() {
                        bt_slot[j * fan_out + o] = v;
                    }
                }
            }
        }
        for m in &adapter.targets {
            self.ranks[slot][m.index()] = r;
        }
        self.scales[slot] = adapter.scaling;
        Ok(())
    }

    /// Re-lays out every allocated stack for a larger padded rank, keeping the slots' contents.
    fn grow(&mut self, new_r: usize) {
        let (old_r, n) = (self.r_max, self.num_slots);
        for layer in &mut self.layers {
            for m in TargetModule::ALL {
                let stack = &mut layer[m.index()];
                if stack.a.is_empty() {
                    continue;
                }
                let (fan_in, fan_out) = self.dims[m.index()];
                let mut a = vec![0.0; n * new_r * fan_in];
                let mut b = vec![0.0; n * fan_out * new_r];
                let mut b_t = vec![0.0; n * new_r * fan_out];
                for s in 0..n {
                    a[s * new_r * fan_in..][..old_r * fan_in]
                        .copy_from_slice(&stack.a[s * old_r * fan_in..][..old_r * fan_in]);
                    b_t[s * new_r * fan_out..][..old_r * fan_out]
                        .copy_from_slice(&stack.b_t[s * old_r * fan_out..][..old_r * fan_out]);
                    for o in 0..fan_out {
                        b[(s * fan_out + o) * new_r..][..old_r]
                            .copy_from_slice(&stack.b[(s * fan_out + o) * old_r..][..old_r]);
                    }
                }
                *stack = ModuleStack { a, b, b_t };
            }
        }
        self.r_max = new_r;
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
                stack.b_t[slot * r_max * fan_out..][..r_max * fan_out].fill(0.0);
            }
        }
        self.ranks[slot] = [0; 7];
        self.scales[slot] = 0.0;
    }
}

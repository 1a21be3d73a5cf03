//! LoRA slots on the GPU: per target module, one stack of every layer's A and B for every slot, in
//! bf16, each slot padded with zeros to the largest rank (so a smaller rank, or a module the adapter
//! does not target, adds exactly 0). After each base projection the step runs the shrink/expand
//! kernels (`lora.cu`) with one slot index per token, read from the step's packed plan.

use half::bf16;
use peregrine_kernels::ops::DPtr;
use peregrine_kernels::{Cuda, DevBuf};

use super::gpu_err;
use crate::config::ModelConfig;
use crate::lora::{LoraAdapter, TargetModule};
use crate::{EngineError, Result};

/// How many adapters and how large a rank the stacks hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraCapacity {
    pub max_loras: usize,
    pub max_rank: usize,
}

struct ModuleStack {
    /// `[layers, slots, r_max, fan_in]`.
    a: DevBuf<u16>,
    /// `[layers, slots, fan_out, r_max]`.
    b: DevBuf<u16>,
    fan_in: usize,
    fan_out: usize,
}

pub struct GpuLora {
    pub capacity: LoraCapacity,
    layers: usize,
    modules: Vec<ModuleStack>,
    /// `scaling` of the adapter in each slot (0 for an empty slot).
    scales: DevBuf<f32>,
    scales_host: Vec<f32>,
    /// Shrink output `[max_tokens, r_max]`.
    shrunk: DevBuf<f32>,
}

/// Where one projection's LoRA update reads and writes in a step (rows are tokens).
pub struct Projection {
    pub module: TargetModule,
    pub x: DPtr,
    pub x_stride: usize,
    /// Start of this module's columns in the (possibly fused) output.
    pub y: DPtr,
    pub y_stride: usize,
}

impl GpuLora {
    /// Device bytes the stacks take for `config` at `cap` (for sizing the KV cache around them).
    pub fn bytes(config: &ModelConfig, cap: LoraCapacity, max_tokens: usize) -> usize {
        let per_layer: usize = TargetModule::ALL
            .iter()
            .map(|m| {
                let (fan_in, fan_out) = m.dims(config);
                cap.max_loras * cap.max_rank * (fan_in + fan_out) * 2
            })
            .sum();
        per_layer * config.num_hidden_layers + cap.max_loras * 4 + max_tokens * cap.max_rank * 4
    }

    pub fn new(cuda: &Cuda, config: &ModelConfig, cap: LoraCapacity, max_tokens: usize) -> Result<Self> {
        if cap.max_loras == 0 || cap.max_rank == 0 {
            return Err(EngineError::InvalidRequest("LoRA needs at least one slot of rank >= 1".into()));
        }
        let layers = config.num_hidden_layers;
        let zeros = |n: usize| cuda.gpu.alloc_zeros::<u16>(n).map_err(gpu_err);
        let mut modules = Vec::with_capacity(TargetModule::ALL.len());
        for m in TargetModule::ALL {
            let (fan_in, fan_out) = m.dims(config);
            let per = layers * cap.max_loras * cap.max_rank;
            modules.push(ModuleStack { a: zeros(per * fan_in)?, b: zeros(per * fan_out)?, fan_in, fan_out });
        }
        Ok(GpuLora {
            capacity: cap,
            layers,
            modules,
            scales: cuda.gpu.alloc_zeros::<f32>(cap.max_loras).map_err(gpu_err)?,
            scales_host: vec![0.0; cap.max_loras],
            shrunk: cuda.gpu.alloc_zeros::<f32>(max_tokens * cap.max_rank).map_err(gpu_err)?,
        })
    }

    /// Writes `adapter` into `slot` (every layer and module; untargeted modules become zeros).
    pub fn set_slot(&mut self, cuda: &Cuda, slot: u32, adapter: &LoraAdapter) -> Result<()> {
        let slot = slot as usize;
        let LoraCapacity { max_loras, max_rank: r_max } = self.capacity;
        if slot >= max_loras {
            return Err(EngineError::InvalidRequest(format!("LoRA slot {slot} outside the {max_loras} slots")));
        }
        if adapter.rank > r_max {
            return Err(EngineError::InvalidRequest(format!("adapter rank {} exceeds max LoRA rank {r_max}", adapter.rank)));
        }
        if adapter.layers.len() != self.layers {
            return Err(EngineError::InvalidRequest(format!(
                "adapter has {} layers, the model {}",
                adapter.layers.len(),
                self.layers
            )));
        }
        let stream = &cuda.gpu.stream;
        let bits = |v: f32| bf16::from_f32(v).to_bits();
        for (mi, module) in TargetModule::ALL.into_iter().enumerate() {
            let stack = &mut self.modules[mi];
            let (fan_in, fan_out) = (stack.fan_in, stack.fan_out);
            let mut a = vec![0u16; r_max * fan_in];
            let mut b = vec![0u16; fan_out * r_max];
            for layer in 0..self.layers {
                a.fill(0);
                b.fill(0);
                if let Some(pair) = adapter.pair(layer, module) {
                    let rank = adapter.rank;
                    if pair.a.len() != rank * fan_in || pair.b.len() != fan_out * rank {
                        return Err(EngineError::InvalidRequest(format!(
                            "layer {layer} {}: LoRA shapes do not match the model",
                            module.peft_name()
                        )));
                    }
                    // A: [rank, in] rows, then zero rows up to r_max.
                    for (dst, &src) in a.iter_mut().zip(&pair.a) {
                        *dst = bits(src);
                    }
                    // B: [out, rank] → [out, r_max], zero-padded per row.
                    for o in 0..fan_out {
                        for r in 0..rank {
                            b[o * r_max + r] = bits(pair.b[o * rank + r]);
                        }
                    }
                }
                let at = layer * max_loras + slot;
                stack.a.write_at(stream, at * r_max * fan_in, &a).map_err(gpu_err)?;
                stack.b.write_at(stream, at * fan_out * r_max, &b).map_err(gpu_err)?;
            }
        }
        self.scales_host[slot] = adapter.scaling;
        self.scales.write(stream, &self.scales_host).map_err(gpu_err)?;
        Ok(())
    }

    /// Enqueues `y += scale · (x · Aᵀ) · Bᵀ` for the `n` tokens of a step, each with the slot in
    /// `slots` (device i32, -1 for none).
    ///
    /// # Safety
    /// `p.x`/`p.y` hold `n` rows at their strides with the module's fan-in/fan-out columns; `slots`
    /// holds `n` entries below `max_loras` or -1; `n` is within the `max_tokens` of [`GpuLora::new`].
    pub unsafe fn apply(&self, cuda: &Cuda, layer: usize, p: &Projection, slots: DPtr, n: usize) -> peregrine_kernels::Result<()> {
        let stack = &self.modules[p.module.index()];
        let LoraCapacity { max_loras, max_rank: r_max } = self.capacity;
        let at = layer * max_loras * r_max;
        let (k, s) = (&cuda.kernels, &cuda.gpu.stream);
        k.lora_shrink(s, self.shrunk.ptr(), p.x, p.x_stride, stack.a.ptr_at(at * stack.fan_in), slots, n, stack.fan_in, r_max)?;
        k.lora_expand(s, p.y, p.y_stride, self.shrunk.ptr(), stack.b.ptr_at(at * stack.fan_out), self.scales.ptr(), slots, n, stack.fan_out, r_max)
    }
}

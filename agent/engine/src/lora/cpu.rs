//! What a CPU backend keeps for LoRA: the slot stacks and the current step's segment table. The
//! backend calls [`CpuLora::begin_step`] once per forward and [`CpuLora::apply`] after each
//! projection; both are cheap no-ops for a step without adapters.

use super::adapter::LoraAdapter;
use super::apply::{apply_lora, Rows, RowsMut};
use crate::plan::LoraBatchPlan;
use super::stack::LoraSlotStack;
use super::target::TargetModule;
use crate::plan::StepBatch;
use crate::config::ModelConfig;
use crate::{EngineError, Result};

#[derive(Debug, Clone)]
pub struct CpuLora {
    stack: LoraSlotStack,
    plan: LoraBatchPlan,
}

impl CpuLora {
    pub fn new(config: &ModelConfig, max_loras: usize, max_rank: usize) -> CpuLora {
        CpuLora {
            stack: LoraSlotStack::new(config, max_loras, max_rank),
            plan: LoraBatchPlan::default(),
        }
    }

    pub fn stack(&self) -> &LoraSlotStack {
        &self.stack
    }

    pub fn set_slot(&mut self, slot: u32, adapter: &LoraAdapter) -> Result<()> {
        self.stack.set_slot(slot as usize, adapter)
    }

    /// Builds the step's segment table; refuses slots that do not exist.
    pub fn begin_step(&mut self, batch: &StepBatch) -> Result<()> {
        let slots = self.stack.num_slots();
        if let Some(bad) = batch
            .seqs
            .iter()
            .filter_map(|s| s.lora_slot)
            .find(|&s| s as usize >= slots)
        {
            return Err(EngineError::Backend(format!(
                "LoRA slot {bad} out of range ({slots} slots)"
            )));
        }
        self.plan = LoraBatchPlan::from_batch(batch);
        Ok(())
    }

    pub fn plan(&self) -> &LoraBatchPlan {
        &self.plan
    }

    /// Adds the update of `module` in `layer` to the projection output `y` of inputs `x`.
    pub fn apply(&self, layer: usize, module: TargetModule, x: Rows<'_>, y: RowsMut<'_>) {
        if self.plan.is_base_only() {
            return;
        }
        apply_lora(&self.stack, &self.plan, layer, module, x, y);
    }
}

/// Rejects a step that names a LoRA slot on a backend without LoRA enabled.
pub fn reject_lora_slots(batch: &StepBatch) -> Result<()> {
    match batch.seqs.iter().find_map(|s| s.lora_slot) {
        Some(slot) => Err(EngineError::Backend(format!(
            "LoRA slot {slot} used but LoRA is not enabled"
        ))),
        None => Ok(()),
    }
}

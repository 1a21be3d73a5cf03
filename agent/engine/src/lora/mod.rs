//! Multi-LoRA serving: PEFT adapters ([`adapter`], [`config`]), the registry that owns them in host
//! memory and assigns device slots ([`registry`]), the slot weight layout ([`stack`]), the per-step
//! segment table ([`crate::plan::lora_segments`]). The CPU shrink/expand update is
//! [`crate::backend::cpu::lora`], the CUDA one `backend::cuda::lora`.
//!
//! A step may mix the base model and any adapters: tokens are grouped into segments by slot
//! ([`LoraBatchPlan`]) and after each targeted projection `y += (x · Aᵀ) · Bᵀ · scale` is added per
//! segment. Weights are never merged into the base model.

pub mod adapter;
pub mod config;
pub mod random;
pub mod registry;
pub mod save;
pub mod stack;
pub mod target;
pub mod values;

pub use adapter::{LoraAdapter, LoraPair};
pub use config::AdapterConfig;
pub use crate::plan::{LoraBatchPlan, NO_SLOT};
pub use random::{RandomAdapterSpec, ZipfSampler};
pub use registry::{
    AdapterCacheStats, AdapterId, AdapterInfo, AdapterState, LoadOutcome, LoraConfig, LoraRegistry, SlotAssignment,
};
pub use save::save_peft;
pub use stack::LoraSlotStack;
pub use target::TargetModule;
pub use values::LoraValues;

#[cfg(test)]
pub(crate) mod test_support {
    use crate::config::{Architecture, ModelConfig};

    /// A small GQA config with distinct in/out sizes for every module.
    pub fn tiny_config() -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 40,
            intermediate_size: 72,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            vocab_size: 100,
            max_position_embeddings: 64,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            tie_word_embeddings: true,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: vec![2],
        }
    }
}

//! The projections a LoRA adapter may target, and their shapes in a given base model.

use crate::config::ModelConfig;

/// One of the seven linear projections of a Llama-family decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TargetModule {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl TargetModule {
    pub const ALL: [TargetModule; 7] = [
        TargetModule::Q,
        TargetModule::K,
        TargetModule::V,
        TargetModule::O,
        TargetModule::Gate,
        TargetModule::Up,
        TargetModule::Down,
    ];

    /// Dense index (0..7), used to lay out per-module tables.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The PEFT / HF module name (`q_proj`, ...).
    pub fn peft_name(self) -> &'static str {
        match self {
            TargetModule::Q => "q_proj",
            TargetModule::K => "k_proj",
            TargetModule::V => "v_proj",
            TargetModule::O => "o_proj",
            TargetModule::Gate => "gate_proj",
            TargetModule::Up => "up_proj",
            TargetModule::Down => "down_proj",
        }
    }

    /// The HF parent module (`self_attn` or `mlp`), as it appears in tensor names.
    pub fn parent(self) -> &'static str {
        match self {
            TargetModule::Q | TargetModule::K | TargetModule::V | TargetModule::O => "self_attn",
            TargetModule::Gate | TargetModule::Up | TargetModule::Down => "mlp",
        }
    }

    pub fn from_peft_name(name: &str) -> Option<TargetModule> {
        TargetModule::ALL.into_iter().find(|m| m.peft_name() == name)
    }

    /// `(in_features, out_features)` of this projection in `config`'s model.
    pub fn dims(self, config: &ModelConfig) -> (usize, usize) {
        let hidden = config.hidden_size;
        match self {
            TargetModule::Q => (hidden, config.q_dim()),
            TargetModule::K | TargetModule::V => (hidden, config.kv_dim()),
            TargetModule::O => (config.q_dim(), hidden),
            TargetModule::Gate | TargetModule::Up => (hidden, config.intermediate_size),
            TargetModule::Down => (config.intermediate_size, hidden),
        }
    }
}

impl std::fmt::Display for TargetModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.peft_name())
    }
}

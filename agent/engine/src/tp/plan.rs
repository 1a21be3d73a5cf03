//! The sharding plan: from a model's shape and a tensor-parallel size `N`, which tensor splits along
//! which dimension, and which range of it rank `r` holds. Ranges are contiguous and equal: rank `r`
//! of `N` holds part `r` of `N` (heads `r·H/N..(r+1)·H/N`, and so on).

use std::ops::Range;

use crate::config::ModelConfig;

/// The largest tensor-parallel size accepted (a bound for every limit; eight GPUs is a node).
pub const MAX_TP_SIZE: usize = 64;

/// How one tensor is divided among the ranks. Matrices are stored `[out, in]` (HF `nn.Linear`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// By output features (the matrix's rows): each rank computes its own outputs from the full
    /// input ("column parallel"). No collective after it.
    Output,
    /// By input features (the matrix's columns): each rank multiplies its slice of the input and
    /// gets a partial sum of every output ("row parallel"); an all-reduce adds the partials.
    Input,
    /// By vocabulary rows: the embedding row comes from the rank that holds it (the others add
    /// zeros), the LM head's logits are gathered rank after rank.
    Vocab,
    /// Every rank holds all of it (norm weights).
    Replicated,
}

/// The tensors of a Llama-family decoder, as the plan names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tensor {
    Embed,
    LmHead,
    Norm,
    Q,
    K,
    V,
    QBias,
    KBias,
    VBias,
    O,
    Gate,
    Up,
    Down,
}

impl Tensor {
    pub const ALL: [Tensor; 13] = [
        Tensor::Embed,
        Tensor::LmHead,
        Tensor::Norm,
        Tensor::Q,
        Tensor::K,
        Tensor::V,
        Tensor::QBias,
        Tensor::KBias,
        Tensor::VBias,
        Tensor::O,
        Tensor::Gate,
        Tensor::Up,
        Tensor::Down,
    ];

    /// The HF name (without the layer prefix), for messages.
    pub fn name(self) -> &'static str {
        match self {
            Tensor::Embed => "embed_tokens",
            Tensor::LmHead => "lm_head",
            Tensor::Norm => "norm",
            Tensor::Q => "q_proj",
            Tensor::K => "k_proj",
            Tensor::V => "v_proj",
            Tensor::QBias => "q_proj.bias",
            Tensor::KBias => "k_proj.bias",
            Tensor::VBias => "v_proj.bias",
            Tensor::O => "o_proj",
            Tensor::Gate => "gate_proj",
            Tensor::Up => "up_proj",
            Tensor::Down => "down_proj",
        }
    }

    pub fn split(self) -> Split {
        match self {
            Tensor::Embed | Tensor::LmHead => Split::Vocab,
            Tensor::Norm => Split::Replicated,
            Tensor::Q | Tensor::K | Tensor::V | Tensor::QBias | Tensor::KBias | Tensor::VBias => Split::Output,
            Tensor::Gate | Tensor::Up => Split::Output,
            Tensor::O | Tensor::Down => Split::Input,
        }
    }
}

/// Why a model cannot be split `N` ways, or a tensor cannot be cut as the plan says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TpError {
    #[error("tensor parallel size must be at least 1")]
    Zero,
    #[error("tensor parallel size {0} is above the limit of {MAX_TP_SIZE}")]
    TooLarge(usize),
    /// Every quantity that must split evenly and does not, named with its count.
    #[error("tensor parallel size {size} does not divide the model's {}", .what.join(", "))]
    NotDivisible { size: usize, what: Vec<String> },
    #[error("cannot shard {tensor}: {message}")]
    Slice { tensor: String, message: String },
}

/// Which part of every tensor each of `size` ranks holds, for one model shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpPlan {
    pub size: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    hidden: usize,
    intermediate: usize,
    vocab: usize,
}

impl TpPlan {
    /// The plan for `config` over `size` ranks; an error names every count `size` does not divide
    /// (attention heads, KV heads, intermediate size, vocabulary). KV heads are split, never
    /// replicated, so `size` may not exceed them.
    pub fn new(config: &ModelConfig, size: usize) -> Result<TpPlan, TpError> {
        if size == 0 {
            return Err(TpError::Zero);
        }
        if size > MAX_TP_SIZE {
            return Err(TpError::TooLarge(size));
        }
        let what: Vec<String> = [
            (config.num_attention_heads, "attention heads"),
            (config.num_key_value_heads, "KV heads"),
            (config.intermediate_size, "intermediate size"),
            (config.vocab_size, "vocabulary"),
        ]
        .into_iter()
        .filter(|&(n, _)| !n.is_multiple_of(size))
        .map(|(n, name)| format!("{name} ({n})"))
        .collect();
        if !what.is_empty() {
            return Err(TpError::NotDivisible { size, what });
        }
        Ok(TpPlan {
            size,
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            hidden: config.hidden_size,
            intermediate: config.intermediate_size,
            vocab: config.vocab_size,
        })
    }

    /// The full length of `tensor` along the dimension the plan splits (its whole first dimension
    /// for replicated vectors).
    pub fn full_len(&self, tensor: Tensor) -> usize {
        let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        match tensor {
            Tensor::Embed | Tensor::LmHead => self.vocab,
            Tensor::Norm => self.hidden,
            Tensor::Q | Tensor::QBias | Tensor::O => q,
            Tensor::K | Tensor::V | Tensor::KBias | Tensor::VBias => kv,
            Tensor::Gate | Tensor::Up | Tensor::Down => self.intermediate,
        }
    }

    /// The range of `tensor`'s split dimension that `rank` holds (the whole of it if replicated).
    /// Head-split tensors get whole heads.
    pub fn range(&self, tensor: Tensor, rank: usize) -> Range<usize> {
        let full = self.full_len(tensor);
        if tensor.split() == Split::Replicated {
            return 0..full;
        }
        let part = full / self.size;
        rank * part..(rank + 1) * part
    }

    /// The shape of one rank's slice, as a model config: heads, KV heads, intermediate size and
    /// vocabulary divided by `size`, everything else as in `config`. A backend runs a rank's
    /// weights as this smaller model, adding the all-reduces between.
    pub fn local_config(&self, config: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_attention_heads: config.num_attention_heads / self.size,
            num_key_value_heads: config.num_key_value_heads / self.size,
            intermediate_size: config.intermediate_size / self.size,
            vocab_size: config.vocab_size / self.size,
            ..config.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M's shape (9 heads, 3 KV heads, intermediate 1536, vocabulary 49152).
    fn smollm2() -> ModelConfig {
        let (hidden_size, intermediate_size, num_attention_heads) = (576, 1536, 9);
        ModelConfig {
            hidden_size,
            intermediate_size,
            num_attention_heads,
            num_key_value_heads: 3,
            head_dim: 64,
            vocab_size: 49152,
            ..crate::lora::test_support::tiny_config()
        }
    }

    #[test]
    fn three_ways_splits_heads_columns_rows_and_vocab() {
        let c = smollm2();
        let p = TpPlan::new(&c, 3).unwrap();
        assert_eq!(p.range(Tensor::Q, 1), 192..384, "rank 1 holds heads 3..6");
        assert_eq!(p.range(Tensor::K, 2), 128..192, "rank 2 holds KV head 2");
        assert_eq!(p.range(Tensor::O, 0), 0..192, "o_proj's input columns follow the heads");
        assert_eq!(p.range(Tensor::Gate, 1), 512..1024);
        assert_eq!(p.range(Tensor::Down, 2), 1024..1536);
        assert_eq!(p.range(Tensor::Embed, 2), 32768..49152);
        assert_eq!(p.range(Tensor::Norm, 2), 0..576);
        let local = p.local_config(&c);
        assert_eq!((local.num_attention_heads, local.num_key_value_heads), (3, 1));
        assert_eq!((local.intermediate_size, local.vocab_size, local.hidden_size), (512, 16384, 576));
        assert_eq!(local.gqa_group(), c.gqa_group(), "each rank keeps the GQA grouping");
        assert_eq!(Tensor::Q.split(), Split::Output);
        assert_eq!(Tensor::Down.split(), Split::Input);
        assert_eq!(Tensor::LmHead.split(), Split::Vocab);
    }

    #[test]
    fn ranges_tile_each_dimension() {
        let c = smollm2();
        let p = TpPlan::new(&c, 3).unwrap();
        for t in Tensor::ALL.into_iter().filter(|t| t.split() != Split::Replicated) {
            let mut next = 0;
            for r in 0..3 {
                let range = p.range(t, r);
                assert_eq!(range.start, next, "{}", t.name());
                next = range.end;
            }
            assert_eq!(next, p.full_len(t), "{}", t.name());
        }
    }

    #[test]
    fn sizes_that_do_not_divide_are_named() {
        let c = smollm2();
        let e = TpPlan::new(&c, 2).unwrap_err().to_string();
        assert!(e.contains("attention heads (9)") && e.contains("KV heads (3)"), "{e}");
        assert!(!e.contains("intermediate") && !e.contains("vocabulary"), "{e}");
        let e = TpPlan::new(&c, 9).unwrap_err().to_string();
        assert!(e.contains("KV heads (3)") && e.contains("intermediate size (1536)"), "{e}");
        let odd_vocab = ModelConfig { vocab_size: 49153, ..c.clone() };
        let e = TpPlan::new(&odd_vocab, 3).unwrap_err().to_string();
        assert!(e.contains("vocabulary (49153)") && !e.contains("heads"), "{e}");
        assert_eq!(TpPlan::new(&c, 0), Err(TpError::Zero));
        assert_eq!(TpPlan::new(&c, MAX_TP_SIZE + 1), Err(TpError::TooLarge(MAX_TP_SIZE + 1)));
        assert!(TpPlan::new(&c, 1).is_ok(), "one rank always fits");
    }
}

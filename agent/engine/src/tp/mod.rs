//! Tensor parallelism, independent of any backend: which tensor splits how across `N` ranks
//! ([`plan`]), cutting one matrix of any weight format into a rank's slice ([`slice`]), and a whole
//! model or LoRA adapter into what one rank holds ([`shard`]).
//!
//! The layout is Megatron's: q/k/v and gate/up split by output features (whole heads, whole
//! intermediate channels; "column parallel"), o and down by input features ("row parallel", each
//! rank's product a partial sum that an all-reduce adds up), the embedding and LM head by vocabulary
//! (the embedding's rows all-reduced, the LM head's logits gathered). A rank's slice is shaped like a
//! smaller model of the same architecture ([`TpPlan::local_config`]), so a backend runs it with its
//! ordinary layer code plus the two all-reduces per layer. The CPU backend's fake TP
//! (`backend::cpu::tp`) uses this today; a CUDA TP over NCCL would take the same shards.

pub mod plan;
pub mod shard;
pub mod slice;

pub use plan::{Split, Tensor, TpError, TpPlan, MAX_TP_SIZE};
pub use shard::{shard_adapter, shard_weights};

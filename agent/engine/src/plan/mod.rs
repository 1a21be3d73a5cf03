//! What one engine step asks of a backend, as plain data at the bottom of the engine: the flat
//! token batch ([`step`]), the LoRA segment table derived from it ([`lora_segments`]), how each
//! logits row is sampled ([`row_sampling`]) and constrained ([`row_constraints`]) and an encoder's ragged batch ([`ragged`]). The scheduler, `lora/` and `backend/` all depend on
//! this module and it depends on none of them.

pub mod lora_segments;
pub mod ragged;
pub mod row_constraints;
pub mod row_sampling;
pub mod step;

pub use lora_segments::{LoraBatchPlan, NO_SLOT};
pub use ragged::RaggedBatch;
pub use row_constraints::{ConstrainedRowRef, MaskWriter, RowConstraints};
pub use row_sampling::RowSampling;
pub use step::{SeqChunk, StepBatch};

//! The Peregrine inference engine.
//!
//! Layering (see `docs/architecture.md`):
//! - [`config`] and [`model`]: what a model is and how its files become weights in memory.
//! - [`tokenizer`]: text ⇄ token ids, incremental detokenization, chat templates.
//! - [`plan`]: what one step asks of a backend (token batch, LoRA segments, row sampling); plain
//!   data below the scheduler, `lora` and `backend`.
//! - [`backend`]: the [`backend::Backend`] trait that runs one flat batch of tokens; [`backend::cpu`]
//!   is the reference implementation.
//! - [`kv`], [`scheduler`], [`sampling`], [`engine`]: the engine thread that owns the backend, the
//!   paged KV cache and the sampler, fed over channels.
//! - [`encoder`]: BERT-family encoders (embeddings, classification, reranking) and their
//!   token-level batching thread, apart from the decoder path.
//! - [`structured`]: structured outputs (JSON schema, regex, choice, Lark grammars) through
//!   llguidance token masks applied in sampling.
//! - [`lora`]: multi-LoRA serving: PEFT adapters, the adapter registry and slots, the per-step
//!   segment plan and the CPU shrink/expand update.
//!
//! The engine knows nothing of HTTP; the server (`peregrine-agent`) depends on it, never the reverse.

pub mod backend;
pub mod bench;
pub mod config;
pub mod encoder;
pub mod error;
pub mod lora;
pub mod model;
pub mod plan;
pub mod progress;
pub mod request;
pub mod tokenizer;
pub mod tp;

pub use error::{EngineError, Result};
pub mod kv;
pub mod sampling;
pub mod scheduler;
pub mod structured;
pub mod engine;

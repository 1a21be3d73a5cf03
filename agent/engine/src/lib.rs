//! The Peregrine inference engine.
//!
//! Layering (see `docs/architecture.md`):
//! - [`config`] and [`model`]: what a model is and how its files become weights in memory.
//! - [`tokenizer`]: text ⇄ token ids, incremental detokenization, chat templates.
//! - [`backend`]: the [`backend::Backend`] trait that runs one flat batch of tokens; [`backend::cpu`]
//!   is the reference implementation.
//! - [`kv`], [`scheduler`], [`sampling`], [`engine`]: the engine thread that owns the backend, the
//!   paged KV cache and the sampler, fed over channels.
//!
//! The engine knows nothing of HTTP; the server (`peregrine-agent`) depends on it, never the reverse.

pub mod backend;
pub mod config;
pub mod error;
pub mod lora;
pub mod model;
pub mod request;
pub mod tokenizer;

pub use error::{EngineError, Result};
pub mod kv;
pub mod sampling;
pub mod scheduler;
pub mod engine;

//! Structured outputs: decoding constrained to a JSON schema, a regular expression, a list of
//! choices or a Lark grammar, with llguidance computing each step's allowed-token mask.
//!
//! - [`GrammarSpec`]: what a request asks for; [`GrammarCompiler`] turns it into a
//!   [`CompiledGrammar`] against the model's tokenizer ([`token_env`]), cached by hash.
//! - [`GrammarState`]: one sequence's matcher; the sampler applies its mask to the logits and
//!   commits each sampled token, and the next mask is computed meanwhile on the mask pool
//!   ([`set_mask_threads`]: threads of its own, `cores - 1` by default). Commits queue their masks;
//!   the engine starts a step's at once ([`start_queued_masks`]).

mod compiler;
mod constraint;
mod mask_pool;
mod spec;
mod token_env;

pub use compiler::{CompiledGrammar, GrammarCompiler, GrammarError, GRAMMAR_CACHE_CAPACITY};
pub use constraint::{mask_task_totals, GrammarOutcome, GrammarState};
pub use mask_pool::{install as on_mask_threads, mask_threads, PARALLEL_COMMIT_MIN_ROWS, on_mask_thread, set_mask_threads, start_queued as start_queued_masks, MAX_MASK_THREADS};
pub use spec::GrammarSpec;
pub use token_env::{token_bytes, token_env};

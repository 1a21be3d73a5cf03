//! The regression suite runner: golden cases sent through the agent's OpenAI API (greedy decoding),
//! judged against their expectations and, for `sameAsStable` and latency, against a stable reference.
//!
//! Used by the rollout controller at every step with `runRegression`, and on demand by
//! `peregrine-operator regress` (see [`cli`]), so that teams can run the same suite in their CI.
//!
//! - [`suite`]: loading and checking cases (inline, a ConfigMap's YAML, a file).
//! - [`client`]: one streamed OpenAI request → output text, tokens, TTFT and TPOT.
//! - [`encoder_client`]: one encoder case (embed, rerank, classify) → its vector, text and latency.
//! - [`judge`]: one case's verdict; token agreement.
//! - [`stats`], percentiles.
//! - [`runner`]: a whole suite against a canary (and a stable reference) → [`peregrine_crds::StepResult`].

pub mod cli;
pub mod client;
pub mod encoder_client;
pub mod judge;
pub mod runner;
pub mod stats;
pub mod suite;

pub use client::{ClientError, Generation, OpenAiClient};
pub use runner::{run_suite, SuiteReport, SuiteTarget};
pub use suite::{load_cases, SuiteError};

//! The engine scenarios (batching, chunked prefill, preemption, prefix cache, abort, limits) on the
//! real SmolLM2 model and the CPU backend. The reference for each request is the same request run
//! alone; the CPU backend computes every row of a batch in the same order whatever else is in the
//! batch, so the outputs must be identical, not merely close.

mod common;
mod engine_support;

use std::sync::OnceLock;

use engine_support::scenarios;
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::model::{self, LoadFormat, ModelWeights};

fn weights() -> &'static ModelWeights {
    static WEIGHTS: OnceLock<ModelWeights> = OnceLock::new();
    WEIGHTS.get_or_init(|| model::load(&common::model_path(), LoadFormat::Gguf).expect("load SmolLM2").weights)
}

fn smollm2(shape: KvCacheShape) -> Box<dyn Backend> {
    Box::new(CpuBackend::new(weights().clone(), shape, 2).expect("cpu backend"))
}

#[test]
fn smollm2_concurrent_requests_match_running_alone() {
    let m = scenarios::concurrent_requests_match_running_alone(&smollm2);
    eprintln!("smollm2 batched run: {m:?}");
}

#[test]
fn smollm2_preemption_keeps_outputs() {
    let m = scenarios::preemption_keeps_outputs(&smollm2);
    eprintln!("smollm2 preemptions: {}", m.preemptions_total);
}

#[test]
fn smollm2_prefix_cache_saves_prefill() {
    scenarios::prefix_cache_saves_prefill(&smollm2);
}

#[test]
fn smollm2_abort_frees_blocks() {
    scenarios::abort_frees_blocks(&smollm2);
}

#[test]
fn smollm2_invalid_requests_and_context_limit() {
    scenarios::invalid_requests_and_context_limit(&smollm2);
}

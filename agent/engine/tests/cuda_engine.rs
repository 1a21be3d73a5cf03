//! The engine driving the CUDA backend with sampling on the GPU, on a GPU machine. The reference is
//! the same backend's logits taken to the host (a second `CudaBackend`, one sequence at a time, the
//! same step shapes) and sampled there:
//! - a greedy request alone gets exactly the host argmax tokens (same shapes, so the same logits);
//! - a logprobs request (its row goes to the host) gets the same tokens with the logprobs of those
//!   logits;
//! - a seeded sampled request is reproducible;
//! - requests of every kind mixed in one batch keep their own tokens, up to bf16 near-ties (batch
//!   size picks the GEMM path, so logits may differ in the last bits between batch sizes).
//!
//! Skipped with a visible "skipped: no CUDA device: <why>" where no GPU is usable (CI).

mod common;
mod cuda_common;

use cuda_common::{argmax, gpu_or_skip, report, top2_margin};
use peregrine_engine::backend::cuda::{CudaBackend, CudaOptions, WeightInit};
use peregrine_engine::backend::{Backend, SeqChunk, StepBatch};
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle};
use peregrine_engine::model::{self, LoadFormat, ModelWeights};
use peregrine_engine::request::{GenerationRequest, RequestEvent, SampledToken, SamplingParams};
use peregrine_engine::sampling::log_softmax;

const BLOCK: usize = 16;
const NEW_TOKENS: usize = 12;
const BF16_NOISE_MARGIN: f32 = 1.0;

fn opts() -> CudaOptions {
    CudaOptions { num_blocks: Some(256), block_size: BLOCK, max_model_len: 512, max_num_batched_tokens: 512, max_num_seqs: 16, ..CudaOptions::default() }
}

fn weights() -> ModelWeights {
    model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF").weights
}

fn engine(w: &ModelWeights) -> EngineHandle {
    let backend = CudaBackend::new(WeightInit::Host(w), &opts()).expect("CUDA backend");
    let config = EngineConfig { max_num_seqs: 16, max_num_batched_tokens: 512, block_size: BLOCK, enable_prefix_caching: false, ..EngineConfig::default() };
    Engine::start(Box::new(backend), config).expect("engine")
}

/// Greedy tokens with each step's logits, one sequence through the backend (prompt as one chunk,
/// then one token per step), as the engine runs a request that is alone.
fn host_greedy(b: &mut CudaBackend, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let table: Vec<u32> = (0..32).collect();
    let mut batch = StepBatch {
        tokens: prompt.to_vec(),
        positions: (0..prompt.len() as u32).collect(),
        seqs: vec![SeqChunk { start: 0, len: prompt.len(), context_len: 0, block_table: table.clone(), wants_logits: true, lora_slot: None }],
    };
    let (mut ids, mut rows) = (Vec::new(), Vec::new());
    let mut pos = prompt.len();
    for _ in 0..steps {
        let row = b.forward(&batch).unwrap().row(0).to_vec();
        let next = argmax(&row);
        ids.push(next);
        rows.push(row);
        batch = StepBatch {
            tokens: vec![next],
            positions: vec![pos as u32],
            seqs: vec![SeqChunk { start: 0, len: 1, context_len: pos, block_table: table.clone(), wants_logits: true, lora_slot: None }],
        };
        pos += 1;
    }
    (ids, rows)
}

fn request(e: &EngineHandle, prompt: &[u32], params: SamplingParams) -> GenerationRequest {
    GenerationRequest { id: e.new_request_id(), prompt_tokens: prompt.to_vec(), params, adapter: None }
}

fn collect(mut s: peregrine_engine::engine::RequestStream) -> Vec<SampledToken> {
    let mut out = Vec::new();
    loop {
        match s.blocking_next() {
            Some(RequestEvent::Token(t)) => out.push(t),
            Some(RequestEvent::Finished { .. }) => return out,
            Some(RequestEvent::Error(m)) => panic!("request failed: {m}"),
            Some(RequestEvent::Scheduled { .. }) => {}
            None => panic!("engine stopped"),
        }
    }
}

fn ids(t: &[SampledToken]) -> Vec<u32> {
    t.iter().map(|t| t.token_id).collect()
}

fn prompts() -> Vec<Vec<u32>> {
    let reference = common::reference();
    reference["prompts"].as_array().unwrap().iter().map(|p| p["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect()
}

#[test]
fn device_sampling_through_the_engine_matches_host_sampling_of_the_same_logits() {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let e = engine(&w);
    let mut reference = CudaBackend::new(WeightInit::Host(&w), &opts()).expect("CUDA backend");
    let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(NEW_TOKENS) };
    let with_logprobs = SamplingParams { logprobs: Some(3), ..greedy.clone() };
    let sampled = SamplingParams { temperature: 0.8, top_p: 0.9, top_k: 40, seed: Some(5), ignore_eos: true, max_tokens: NEW_TOKENS, ..SamplingParams::default() };
    let prompts = prompts();
    let mut refs = Vec::new();
    for (pi, p) in prompts.iter().enumerate() {
        let (want, rows) = host_greedy(&mut reference, p, NEW_TOKENS);
        // Alone, device argmax: exactly the host argmax of the same logits.
        let got = collect(e.submit(request(&e, p, greedy.clone())).unwrap());
        assert_eq!(ids(&got), want, "prompt {pi}: device greedy vs host argmax");
        assert!(got.iter().all(|t| t.logprob.is_none()), "no logprobs were asked for");
        // Alone, logprobs: the row goes to the host; same tokens, logprobs of those logits.
        let got = collect(e.submit(request(&e, p, with_logprobs.clone())).unwrap());
        assert_eq!(ids(&got), want, "prompt {pi}: host-sampled greedy tokens");
        for (s, (t, row)) in got.iter().zip(&rows).enumerate() {
            let lp = log_softmax(row);
            let l = t.logprob.expect("logprob");
            assert!((l - lp[t.token_id as usize]).abs() < 1e-4, "prompt {pi} step {s}: logprob {l} vs {}", lp[t.token_id as usize]);
            assert_eq!(t.top_logprobs.len(), 3);
        }
        // Seeded sampling on the device: reproducible.
        let a = ids(&collect(e.submit(request(&e, p, sampled.clone())).unwrap()));
        let b = ids(&collect(e.submit(request(&e, p, sampled.clone())).unwrap()));
        assert_eq!(a, b, "prompt {pi}: seeded sampling must repeat");
        assert_eq!(a.len(), NEW_TOKENS);
        refs.push((want, rows));
    }
    // Everything at once: greedy (device), logprobs (host) and sampled rows in the same steps.
    let mut streams = Vec::new();
    for p in &prompts {
        streams.push(e.submit(request(&e, p, greedy.clone())).unwrap());
        streams.push(e.submit(request(&e, p, with_logprobs.clone())).unwrap());
        streams.push(e.submit(request(&e, p, sampled.clone())).unwrap());
    }
    let mut results: Vec<Vec<SampledToken>> = streams.into_iter().map(collect).collect();
    for (pi, (want, rows)) in refs.iter().enumerate() {
        let sampled_ids = ids(&results[3 * pi + 2]);
        assert_eq!(sampled_ids.len(), NEW_TOKENS, "prompt {pi}: sampled request length");
        for (kind, got) in [("greedy", ids(&results[3 * pi])), ("logprobs", ids(&results[3 * pi + 1]))] {
            match (0..NEW_TOKENS).find(|&s| got[s] != want[s]) {
                None => {}
                Some(s) => {
                    let margin = top2_margin(&rows[s]);
                    report(&format!("prompt {pi} {kind}: batched run diverges at step {s} (alone top-2 margin {margin:.4})"));
                    assert!(margin < BF16_NOISE_MARGIN, "prompt {pi} {kind}: batched tokens differ at step {s} where the margin is {margin}");
                }
            }
        }
        assert!(results[3 * pi + 1].iter().all(|t| t.logprob.is_some()), "prompt {pi}: logprobs lost in the batch");
        results[3 * pi].clear();
    }
    e.shutdown();
}

//! Engine behaviours every backend must show. Each scenario takes a factory that builds a fresh
//! backend for a given KV cache shape, so the same checks run on the fake and on a real model.
//!
//! The references are the same requests run one at a time on an engine with room to spare: batching,
//! chunking, preemption and the prefix cache must not change what a request generates.

use std::time::{Duration, Instant};

use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle, EngineMetrics, RequestStream};
use peregrine_engine::request::{FinishReason, GenerationRequest, RequestEvent, SamplingParams, Usage};
use peregrine_engine::EngineError;

pub type Factory<'a> = &'a dyn Fn(KvCacheShape) -> Box<dyn Backend>;

pub const BLOCK_SIZE: usize = 4;

#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub usage: Usage,
}

pub fn start(factory: Factory, num_blocks: usize, config: EngineConfig) -> EngineHandle {
    let backend = factory(KvCacheShape { num_blocks, block_size: BLOCK_SIZE });
    Engine::start(backend, EngineConfig { block_size: BLOCK_SIZE, ..config }).expect("engine starts")
}

pub fn config(
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    max_model_len: usize,
    caching: bool,
) -> EngineConfig {
    EngineConfig {
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len: Some(max_model_len),
        block_size: BLOCK_SIZE,
        enable_prefix_caching: caching,
        kv_lookahead: true,
        seed: 1234,
    }
}

/// Deterministic prompt tokens, valid for any vocabulary of 4+ tokens (id 0 and the last id avoided).
pub fn prompt(vocab: usize, salt: u64, len: usize) -> Vec<u32> {
    let span = (vocab.min(1000) - 2) as u64;
    (0..len as u64)
        .map(|i| {
            let x =
                (salt.wrapping_mul(6364136223846793005).wrapping_add(i.wrapping_mul(1442695040888963407)))
                    >> 17;
            1 + (x % span) as u32
        })
        .collect()
}

/// Reads a stream to its end, checking the event order: Scheduled, Tokens, Finished.
pub fn collect(stream: &mut RequestStream) -> Run {
    let mut tokens = Vec::new();
    match stream.blocking_next() {
        Some(RequestEvent::Scheduled { .. }) => {}
        other => panic!("request {}: first event {other:?}, expected Scheduled", stream.id()),
    }
    loop {
        match stream.blocking_next() {
            Some(RequestEvent::Token(t)) => tokens.push(t.token_id),
            Some(RequestEvent::Finished { reason, usage }) => {
                assert_eq!(usage.completion_tokens, tokens.len(), "usage counts every token sent");
                return Run { tokens, finish: reason, usage };
            }
            other => panic!("request {}: unexpected event {other:?}", stream.id()),
        }
    }
}

pub fn request(id: u64, prompt_tokens: Vec<u32>, params: SamplingParams) -> GenerationRequest {
    GenerationRequest { id, prompt_tokens, params, adapter: None }
}

/// Runs requests one after another, each alone in the engine.
pub fn run_alone(handle: &EngineHandle, requests: &[GenerationRequest]) -> Vec<Run> {
    requests.iter().map(|r| collect(&mut handle.submit(r.clone()).expect("valid request"))).collect()
}

/// Submits every request at once, then reads them all.
pub fn run_together(handle: &EngineHandle, requests: &[GenerationRequest]) -> Vec<Run> {
    let mut streams: Vec<RequestStream> =
        requests.iter().map(|r| handle.submit(r.clone()).expect("valid request")).collect();
    streams.iter_mut().map(collect).collect()
}

/// Final metrics, once the engine has stopped (so the last step's numbers are published).
pub fn final_metrics(handle: &EngineHandle) -> EngineMetrics {
    handle.shutdown();
    handle.metrics()
}

pub fn wait_for(handle: &EngineHandle, what: &str, pred: impl Fn(&EngineMetrics) -> bool) -> EngineMetrics {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = handle.metrics();
        if pred(&m) {
            return m;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {m:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A mix of greedy, seeded and unseeded sampling with assorted processors.
fn mixed_params(i: usize, max_tokens: usize) -> SamplingParams {
    match i % 4 {
        0 => SamplingParams::greedy(max_tokens),
        1 => SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(i as u64),
            max_tokens,
            ..Default::default()
        },
        2 => SamplingParams {
            temperature: 1.0,
            top_k: 20,
            repetition_penalty: 1.2,
            presence_penalty: 0.5,
            max_tokens,
            ..Default::default()
        },
        _ => SamplingParams {
            temperature: 0.7,
            min_p: 0.05,
            frequency_penalty: 0.3,
            max_tokens,
            ..Default::default()
        },
    }
}

/// 16 concurrent requests through a small token budget (forcing chunked prefill and mixed
/// decode/prefill steps) generate exactly what each generates alone.
pub fn concurrent_requests_match_running_alone(factory: Factory) -> EngineMetrics {
    let vocab = factory(KvCacheShape { num_blocks: 1, block_size: BLOCK_SIZE }).config().vocab_size;
    let requests: Vec<GenerationRequest> = (0..16)
        .map(|i| {
            request(
                100 + i as u64,
                prompt(vocab, i as u64, 5 + (i * 7) % 30),
                mixed_params(i, 6 + (i * 5) % 20),
            )
        })
        .collect();
    let alone = start(factory, 256, config(1, 512, 128, false));
    let want = run_alone(&alone, &requests);
    alone.shutdown();

    let together = start(factory, 256, config(16, 16, 128, false));
    let got = run_together(&together, &requests);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs when batched");
    }
    let m = final_metrics(&together);
    let prompt_total: usize = requests.iter().map(|r| r.prompt_tokens.len()).sum();
    let gen_total: usize = want.iter().map(|r| r.tokens.len()).sum();
    assert_eq!(m.prompt_tokens_total, prompt_total as u64);
    assert_eq!(m.generation_tokens_total, gen_total as u64);
    assert_eq!(m.prefill_tokens_computed_total, prompt_total as u64, "no cache, no preemption");
    assert_eq!(m.requests_finished_total, 16);
    // A 16-token budget cannot hold 16 prompts of ~20 tokens: prefill had to be spread over steps.
    assert!(m.steps_total as usize > prompt_total / 16, "{m:?}");
    m
}

/// A KV pool too small for every request at once forces preemptions; outputs do not change.
pub fn preemption_keeps_outputs(factory: Factory) -> EngineMetrics {
    let vocab = factory(KvCacheShape { num_blocks: 1, block_size: BLOCK_SIZE }).config().vocab_size;
    let requests: Vec<GenerationRequest> = (0..8)
        .map(|i| {
            let params = SamplingParams { ignore_eos: true, ..mixed_params(i, 30) };
            request(200 + i as u64, prompt(vocab, 50 + i as u64, 10 + i), params)
        })
        .collect();
    let alone = start(factory, 256, config(1, 512, 64, false));
    let want = run_alone(&alone, &requests);
    alone.shutdown();

    // Each request grows to 40-47 tokens (10-12 blocks); 30 blocks hold fewer than three.
    // Admitting on current blocks alone (no look-ahead) forces preemptions.
    let small = start(factory, 30, EngineConfig { kv_lookahead: false, ..config(8, 32, 64, false) });
    let got = run_together(&small, &requests);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs after preemption");
    }
    let m = final_metrics(&small);
    assert!(m.preemptions_total > 0, "the pool was meant to be too small: {m:?}");
    assert_eq!(m.num_running + m.num_waiting, 0);
    assert_eq!(m.num_free_blocks, m.num_blocks, "every block is back");
    small.shutdown();

    // With the look-ahead, the same requests (all run to max_tokens) never need preempting.
    let ahead = start(factory, 30, config(8, 32, 64, false));
    let got = run_together(&ahead, &requests);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i} differs with the look-ahead");
    }
    let with = final_metrics(&ahead);
    assert_eq!(with.preemptions_total, 0, "{with:?}");
    assert_eq!(with.num_free_blocks, with.num_blocks, "every block is back");
    m
}

/// Requests sharing a prompt prefix reuse its cached blocks: fewer prefill tokens, same outputs.
pub fn prefix_cache_saves_prefill(factory: Factory) -> (EngineMetrics, EngineMetrics) {
    let vocab = factory(KvCacheShape { num_blocks: 1, block_size: BLOCK_SIZE }).config().vocab_size;
    let shared = prompt(vocab, 999, 32); // 8 full blocks
    let requests: Vec<GenerationRequest> = (0..6)
        .map(|i| {
            let mut p = shared.clone();
            p.push(1 + i as u32); // distinct first suffix token: no hit past the shared prefix
            p.extend(prompt(vocab, 300 + i as u64, 2 + i));
            request(300 + i as u64, p, mixed_params(i, 8))
        })
        .collect();
    let run = |caching: bool| {
        let h = start(factory, 256, config(8, 64, 128, caching));
        let mut runs = run_alone(&h, &requests[..1]);
        runs.extend(run_together(&h, &requests[1..]));
        (runs, final_metrics(&h))
    };
    let (plain, plain_m) = run(false);
    let (cached, cached_m) = run(true);
    for (i, (c, p)) in cached.iter().zip(&plain).enumerate() {
        assert_eq!(c.tokens, p.tokens, "request {i} differs with the prefix cache");
        assert_eq!(c.finish, p.finish);
        assert_eq!(c.usage.cached_prompt_tokens, if i == 0 { 0 } else { 32 }, "request {i}");
    }
    assert_eq!(plain_m.prefix_cache_hit_tokens_total, 0);
    assert_eq!(cached_m.prefix_cache_hit_tokens_total, 5 * 32);
    assert_eq!(
        cached_m.prefill_tokens_computed_total,
        plain_m.prefill_tokens_computed_total - 5 * 32,
        "cached tokens are not recomputed"
    );
    (plain_m, cached_m)
}

/// `abort` and dropping the stream both end a request and give its blocks back.
pub fn abort_frees_blocks(factory: Factory) {
    let vocab = factory(KvCacheShape { num_blocks: 1, block_size: BLOCK_SIZE }).config().vocab_size;
    let h = start(factory, 64, config(4, 64, 256, false));
    let long = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(240) };

    let mut stream = h.submit(request(1, prompt(vocab, 1, 8), long.clone())).expect("valid");
    assert!(matches!(stream.blocking_next(), Some(RequestEvent::Scheduled { .. })));
    assert!(matches!(stream.blocking_next(), Some(RequestEvent::Token(_))));
    h.abort(1);
    let mut n = 1;
    loop {
        match stream.blocking_next() {
            Some(RequestEvent::Token(_)) => n += 1,
            Some(RequestEvent::Finished { reason, usage }) => {
                assert_eq!(reason, FinishReason::Abort);
                assert_eq!(usage.completion_tokens, n);
                assert!(n < 240);
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    wait_for(&h, "blocks freed after abort", |m| m.num_running == 0 && m.num_free_blocks == m.num_blocks);

    let mut stream = h.submit(request(2, prompt(vocab, 2, 8), long)).expect("valid");
    assert!(matches!(stream.blocking_next(), Some(RequestEvent::Scheduled { .. })));
    assert!(matches!(stream.blocking_next(), Some(RequestEvent::Token(_))));
    drop(stream);
    wait_for(&h, "blocks freed after the stream was dropped", |m| {
        m.num_running == 0 && m.num_waiting == 0 && m.num_free_blocks == m.num_blocks
    });
    // The engine keeps serving.
    let out = run_alone(&h, &[request(3, prompt(vocab, 3, 5), SamplingParams::greedy(3))]);
    assert!(!out[0].tokens.is_empty());
    h.shutdown();
}

/// Impossible requests are refused at submit; the context limit cuts generation with `length`.
pub fn invalid_requests_and_context_limit(factory: Factory) {
    let vocab = factory(KvCacheShape { num_blocks: 1, block_size: BLOCK_SIZE }).config().vocab_size;
    let h = start(factory, 64, config(4, 64, 64, false));
    let invalid = |r: GenerationRequest| match h.submit(r) {
        Err(EngineError::InvalidRequest(_)) => {}
        Err(e) => panic!("expected InvalidRequest, got {e}"),
        Ok(_) => panic!("expected InvalidRequest, got a stream"),
    };
    invalid(request(1, prompt(vocab, 1, 65), SamplingParams::greedy(1)));
    invalid(request(2, vec![], SamplingParams::greedy(1)));
    invalid(request(3, vec![1, vocab as u32, 2], SamplingParams::greedy(1)));
    invalid(request(4, vec![1, 2], SamplingParams::greedy(0)));
    invalid(request(5, vec![1, 2], SamplingParams { top_p: 0.0, ..Default::default() }));
    // An adapter that is not loaded: its own error kind, so the server can answer 404.
    match h.submit(GenerationRequest {
        adapter: Some("nope".into()),
        ..request(6, vec![1, 2], SamplingParams::greedy(1))
    }) {
        Err(EngineError::UnknownAdapter(name)) => assert_eq!(name, "nope"),
        Err(e) => panic!("expected UnknownAdapter, got {e}"),
        Ok(_) => panic!("expected UnknownAdapter, got a stream"),
    }

    let to_the_limit = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(100) };
    let runs = run_alone(
        &h,
        &[
            request(7, prompt(vocab, 7, 60), to_the_limit.clone()),
            request(8, prompt(vocab, 8, 64), to_the_limit),
        ],
    );
    assert_eq!((runs[0].tokens.len(), runs[0].finish), (4, FinishReason::Length));
    assert_eq!((runs[1].tokens.len(), runs[1].finish), (1, FinishReason::Length));
    assert_eq!(runs[1].usage.prompt_tokens, 64);
    h.shutdown();
}

/// `stop_token_ids` end generation at the first stop token (which is still reported).
pub fn stop_token_ids_end_generation(factory: Factory) {
    let vocab = factory(KvCacheShape { num_blocks: 1, block_size: BLOCK_SIZE }).config().vocab_size;
    let h = start(factory, 64, config(4, 64, 128, false));
    let p = prompt(vocab, 42, 12);
    let free = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    let full = run_alone(&h, &[request(1, p.clone(), free.clone())]).remove(0);
    assert_eq!(full.finish, FinishReason::Length);
    let stop = full.tokens[5];
    let first = full.tokens.iter().position(|&t| t == stop).expect("present");
    let stopped =
        run_alone(&h, &[request(2, p, SamplingParams { stop_token_ids: vec![stop], ..free })]).remove(0);
    assert_eq!(stopped.tokens, full.tokens[..=first]);
    assert_eq!(stopped.finish, FinishReason::Stop);
    h.shutdown();
}

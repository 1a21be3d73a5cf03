//! The engine scenarios on the deterministic fake backend, plus checks only the fake can make
//! (exact expected tokens, batch shapes, injected backend failures).

mod engine_support;

use std::sync::Arc;
use std::time::Duration;

use engine_support::fake::{self, FakeBackend, FakeStats, EOS, POISON, VOCAB};
use engine_support::scenarios::{self, collect, config, request, run_alone, run_together, start};
use parking_lot::Mutex;
use peregrine_engine::backend::{Backend, BatchCapacity, KvCacheShape};
use peregrine_engine::engine::{generate_blocking, Engine, EngineConfig};
use peregrine_engine::request::{FinishReason, RequestEvent, SamplingParams};
use peregrine_engine::sampling::{argmax, log_softmax};
use peregrine_engine::EngineError;

fn fake(shape: KvCacheShape) -> Box<dyn Backend> {
    Box::new(FakeBackend::new(shape))
}

type StatsLog = Arc<Mutex<Vec<Arc<Mutex<FakeStats>>>>>;

/// A factory that keeps each backend's stats for inspection.
fn recording() -> (impl Fn(KvCacheShape) -> Box<dyn Backend>, StatsLog) {
    let all: StatsLog = Arc::default();
    let keep = all.clone();
    let factory = move |shape| {
        let b = FakeBackend::new(shape);
        keep.lock().push(b.stats.clone());
        Box::new(b) as Box<dyn Backend>
    };
    (factory, all)
}

#[test]
fn concurrent_requests_match_running_alone() {
    let (factory, stats) = recording();
    scenarios::concurrent_requests_match_running_alone(&factory);
    // The batched engine is the last one built.
    let s = stats.lock().last().expect("built").lock().clone();
    assert!(s.max_batch_tokens <= 16, "{s:?}");
    assert!(s.max_batch_seqs > 1, "requests were batched: {s:?}");
    assert!(s.chunks_without_logits > 0, "prefill was chunked: {s:?}");
}

#[test]
fn preemption_keeps_outputs() {
    scenarios::preemption_keeps_outputs(&fake);
}

#[test]
fn prefix_cache_saves_prefill() {
    scenarios::prefix_cache_saves_prefill(&fake);
}

#[test]
fn abort_frees_blocks() {
    // Slow steps so that a 240-token request is still running when the abort lands.
    let slow = |shape| {
        Box::new(FakeBackend::new(shape).with_step_delay(Duration::from_millis(2))) as Box<dyn Backend>
    };
    scenarios::abort_frees_blocks(&slow);
}

#[test]
fn invalid_requests_and_context_limit() {
    scenarios::invalid_requests_and_context_limit(&fake);
}

#[test]
fn stop_token_ids_end_generation() {
    scenarios::stop_token_ids_end_generation(&fake);
}

/// Greedy decoding computed directly from the fake's logits function, without the engine.
fn direct_greedy(prompt: &[u32], max_tokens: usize) -> (Vec<u32>, FinishReason) {
    let mut history = prompt.to_vec();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let t = argmax(&fake::logits_for(&history)) as u32;
        out.push(t);
        history.push(t);
        if t == EOS {
            return (out, FinishReason::Stop);
        }
    }
    (out, FinishReason::Length)
}

#[test]
fn greedy_output_matches_direct_computation() {
    // Pick prompts whose direct greedy continuation hits EOS within 40 tokens and prompts whose
    // does not, so both the `stop` and the `length` endings are checked.
    let (mut stopping, mut running) = (Vec::new(), Vec::new());
    for salt in 0..2000u64 {
        let p = scenarios::prompt(VOCAB, salt, 3 + (salt as usize * 5) % 40);
        let (_, finish) = direct_greedy(&p, 40);
        let bucket = if finish == FinishReason::Stop { &mut stopping } else { &mut running };
        if bucket.len() < 6 {
            bucket.push(p);
        }
        if stopping.len() == 6 && running.len() == 6 {
            break;
        }
    }
    assert_eq!((stopping.len(), running.len()), (6, 6), "the fake's hash should give both kinds");
    let h = start(&fake, 256, config(8, 24, 256, true));
    let requests: Vec<_> = stopping
        .into_iter()
        .chain(running)
        .enumerate()
        .map(|(i, p)| request(i as u64, p, SamplingParams::greedy(40)))
        .collect();
    let runs = run_together(&h, &requests);
    for (r, run) in requests.iter().zip(&runs) {
        let (tokens, finish) = direct_greedy(&r.prompt_tokens, 40);
        assert_eq!(run.tokens, tokens, "request {}", r.id);
        assert_eq!(run.finish, finish, "request {}", r.id);
    }
    // With ignore_eos the EOS token is just another token.
    let ignoring = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) };
    let run = run_alone(&h, &[request(99, requests[0].prompt_tokens.clone(), ignoring)]).remove(0);
    assert_eq!((run.tokens.len(), run.finish), (40, FinishReason::Length));
    assert_eq!(run.tokens[..runs[0].tokens.len()], runs[0].tokens[..]);
    h.shutdown();
}

#[test]
fn prefix_cache_under_memory_pressure_stays_correct() {
    // 24 blocks of 4 tokens; 12 requests of 16-24 prompt tokens + 20 generated, sharing three
    // 16-token prefixes: blocks are shared, evicted, reused and preempted sequences re-hit their own
    // (admitting on current blocks alone, without the look-ahead, so that preemptions happen).
    let h = start(&fake, 24, EngineConfig { kv_lookahead: false, ..config(12, 32, 64, true) });
    let prefixes: Vec<Vec<u32>> = (0..3).map(|i| scenarios::prompt(VOCAB, 500 + i, 16)).collect();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) };
    let requests: Vec<_> = (0..12u64)
        .map(|i| {
            let mut p = prefixes[(i % 3) as usize].clone();
            p.extend(scenarios::prompt(VOCAB, 600 + i, 1 + (i as usize * 3) % 8));
            request(i, p, params.clone())
        })
        .collect();
    let runs = run_together(&h, &requests);
    for (r, run) in requests.iter().zip(&runs) {
        let (tokens, _) = direct_greedy_ignoring_eos(&r.prompt_tokens, 20);
        assert_eq!(run.tokens, tokens, "request {}", r.id);
    }
    let m = scenarios::final_metrics(&h);
    assert!(m.preemptions_total > 0, "{m:?}");
    assert!(m.prefix_cache_hit_tokens_total > 0, "{m:?}");
    assert_eq!(m.num_free_blocks, 24);
}

fn direct_greedy_ignoring_eos(prompt: &[u32], max_tokens: usize) -> (Vec<u32>, FinishReason) {
    let mut history = prompt.to_vec();
    for _ in 0..max_tokens {
        let t = argmax(&fake::logits_for(&history)) as u32;
        history.push(t);
    }
    (history[prompt.len()..].to_vec(), FinishReason::Length)
}

#[test]
fn logprobs_are_log_softmax_of_model_logits() {
    let h = start(&fake, 64, config(4, 64, 128, false));
    let prompt = scenarios::prompt(VOCAB, 5, 9);
    let params = SamplingParams {
        logprobs: Some(3),
        repetition_penalty: 1.5,
        ignore_eos: true,
        ..SamplingParams::greedy(5)
    };
    let mut stream = h.submit(request(1, prompt.clone(), params)).expect("valid");
    let mut history = prompt;
    while let Some(ev) = stream.blocking_next() {
        match ev {
            RequestEvent::Token(t) => {
                let lp = log_softmax(&fake::logits_for(&history));
                assert_eq!(t.logprob, Some(lp[t.token_id as usize]));
                assert_eq!(t.top_logprobs.len(), 3);
                assert_eq!(t.top_logprobs[0].token_id as usize, argmax(&lp));
                assert!(t.top_logprobs.windows(2).all(|w| w[0].logprob >= w[1].logprob));
                history.push(t.token_id);
            }
            RequestEvent::Finished { .. } => break,
            RequestEvent::Scheduled { .. } => {}
            RequestEvent::Error(e) => panic!("{e}"),
        }
    }
    h.shutdown();
}

#[test]
fn backend_error_fails_only_the_affected_requests() {
    let h = start(&fake, 64, config(4, 64, 128, false));
    let ok = || request(0, scenarios::prompt(VOCAB, 3, 6), SamplingParams::greedy(4));
    let want = run_alone(&h, &[ok()]).remove(0);

    let mut bad = h.submit(request(1, vec![5, POISON, 6], SamplingParams::greedy(4))).expect("valid ids");
    assert!(matches!(bad.blocking_next(), Some(RequestEvent::Scheduled { .. })));
    match bad.blocking_next() {
        Some(RequestEvent::Error(msg)) => assert!(msg.contains("poisoned"), "{msg}"),
        other => panic!("expected an error, got {other:?}"),
    }
    assert_eq!(bad.blocking_next(), None);
    // The engine goes on serving, with the same result as before.
    let again = run_alone(&h, &[request(2, ok().prompt_tokens, SamplingParams::greedy(4))]).remove(0);
    assert_eq!(again, want);
    let m = scenarios::final_metrics(&h);
    assert_eq!(m.num_free_blocks, m.num_blocks);
}

#[test]
fn duplicate_request_id_is_refused_without_disturbing_the_first() {
    let slow = |shape| {
        Box::new(FakeBackend::new(shape).with_step_delay(Duration::from_millis(2))) as Box<dyn Backend>
    };
    let h = start(&slow, 64, config(4, 64, 128, false));
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(20) };
    let mut first = h.submit(request(7, vec![1, 2, 3], params.clone())).expect("valid");
    let mut second = h.submit(request(7, vec![4, 5, 6], params)).expect("valid");
    match second.blocking_next() {
        Some(RequestEvent::Error(msg)) => assert!(msg.contains("already in use"), "{msg}"),
        other => panic!("expected an error, got {other:?}"),
    }
    let run = collect(&mut first);
    assert_eq!((run.tokens.len(), run.finish), (20, FinishReason::Length));
    h.shutdown();
}

#[test]
fn shutdown_ends_requests_in_flight_and_refuses_new_ones() {
    let slow = |shape| {
        Box::new(FakeBackend::new(shape).with_step_delay(Duration::from_millis(2))) as Box<dyn Backend>
    };
    let h = start(&slow, 64, config(4, 64, 256, false));
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(200) };
    let mut s = h.submit(request(1, vec![1, 2, 3], params)).expect("valid");
    assert!(matches!(s.blocking_next(), Some(RequestEvent::Scheduled { .. })));
    h.shutdown();
    let mut last = None;
    while let Some(ev) = s.blocking_next() {
        last = Some(ev);
    }
    assert!(matches!(last, Some(RequestEvent::Error(_))), "{last:?}");
    assert!(matches!(
        h.submit(request(2, vec![1], SamplingParams::greedy(1))),
        Err(EngineError::EngineStopped)
    ));
    assert!(matches!(
        generate_blocking(&h, vec![1], SamplingParams::greedy(1)),
        Err(EngineError::EngineStopped)
    ));
}

#[test]
fn generate_blocking_and_metrics() {
    let h = start(&fake, 50, config(4, 64, 128, true));
    assert_eq!(h.max_model_len(), 128);
    assert_eq!(h.vocab_size(), VOCAB);
    let prompt = scenarios::prompt(VOCAB, 11, 10);
    let out = generate_blocking(&h, prompt.clone(), SamplingParams::greedy(6)).expect("runs");
    let (tokens, finish) = direct_greedy(&prompt, 6);
    assert_eq!(out.token_ids(), tokens);
    assert_eq!(out.finish_reason, finish);
    assert_eq!(out.usage.prompt_tokens, 10);
    let m = scenarios::final_metrics(&h);
    assert_eq!(m.num_blocks, 50);
    assert_eq!(m.prompt_tokens_total, 10);
    assert_eq!(m.generation_tokens_total, tokens.len() as u64);
    assert_eq!(m.steps_total, tokens.len() as u64, "one prefill step, then one per further token");
    assert_eq!(m.kv_usage_ratio, 0.0);
    assert_eq!(m.requests_finished_total, 1);
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let h = start(&fake, 256, config(8, 64, 128, false));
    let p = scenarios::prompt(VOCAB, 1, 6);
    let params = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(30)
    };
    let a = run_together(
        &h,
        &[
            request(1, p.clone(), params(5)),
            request(2, p.clone(), params(5)),
            request(3, p.clone(), params(6)),
        ],
    );
    assert_eq!(a[0].tokens, a[1].tokens, "same seed, same tokens, whatever the request id");
    assert_ne!(a[0].tokens, a[2].tokens);
    h.shutdown();
}

#[test]
fn config_is_checked_against_the_backend() {
    let start_with = |shape: KvCacheShape, cfg: EngineConfig| Engine::start(fake(shape), cfg).map(|_| ());
    let shape = KvCacheShape { num_blocks: 16, block_size: 4 };
    let ok = EngineConfig { block_size: 4, max_model_len: Some(64), ..Default::default() };
    assert!(start_with(shape, ok.clone()).is_ok());
    let invalid = [
        EngineConfig { block_size: 8, ..ok.clone() },
        EngineConfig { max_model_len: Some(65), ..ok.clone() },
        EngineConfig { max_model_len: Some(0), ..ok.clone() },
        EngineConfig { max_num_seqs: 32, max_num_batched_tokens: 16, ..ok.clone() },
        EngineConfig { max_model_len: Some(fake::model_config().max_position_embeddings + 1), ..ok.clone() },
    ];
    for cfg in invalid {
        assert!(matches!(start_with(shape, cfg.clone()), Err(EngineError::InvalidConfig(_))), "{cfg:?}");
    }
    // max_num_seqs and max_num_batched_tokens must fit the backend's step capacity (default config:
    // 64 sequences, 2048 tokens).
    let capped = |max_seqs: usize, max_tokens: usize| {
        let mut backend = FakeBackend::new(shape);
        backend.batch_capacity = Some(BatchCapacity { max_seqs, max_tokens });
        Box::new(backend) as Box<dyn Backend>
    };
    assert!(Engine::start(capped(64, 2048), ok.clone()).is_ok());
    let refused = Engine::start(capped(63, 2048), ok.clone()).map(|_| ());
    assert!(matches!(&refused, Err(EngineError::InvalidConfig(m)) if m.contains("batch capacity of 63")), "{refused:?}");
    let refused = Engine::start(capped(64, 2047), ok.clone()).map(|_| ());
    assert!(matches!(&refused, Err(EngineError::InvalidConfig(m)) if m.contains("step capacity of 2047 tokens")), "{refused:?}");
    // Without an explicit limit the KV cache capacity caps the context.
    let h = Engine::start(fake(shape), EngineConfig { block_size: 4, ..Default::default() }).expect("starts");
    assert_eq!(h.max_model_len(), 64);
    h.shutdown();
}

fn fake_sampling_on_device(shape: KvCacheShape) -> Box<dyn Backend> {
    Box::new(engine_support::device_sampling::HostDevice::new(FakeBackend::new(shape)))
}

/// The engine's device-sampling path (plans per row, host rows for penalties/logprobs, tokens routed
/// back): batched equals alone for every kind of request, as on the host path, and preemption keeps
/// outputs.
#[test]
fn device_sampling_path_keeps_batched_equal_to_alone_and_survives_preemption() {
    scenarios::concurrent_requests_match_running_alone(&fake_sampling_on_device);
    scenarios::preemption_keeps_outputs(&fake_sampling_on_device);
}

/// Greedy requests and requests whose rows go to the host (logprobs, penalties) get the same tokens
/// and logprobs through the device path as through host sampling.
#[test]
fn device_sampling_path_matches_host_sampling_where_both_are_exact() {
    let cfg = config(8, 64, 128, false);
    let host = start(&fake, 64, cfg.clone());
    let device = start(&fake_sampling_on_device, 64, cfg);
    let kinds = [
        SamplingParams::greedy(10),
        SamplingParams { logprobs: Some(2), ..SamplingParams::greedy(10) },
        SamplingParams { temperature: 0.9, repetition_penalty: 1.3, seed: Some(3), max_tokens: 10, ..Default::default() },
    ];
    let requests: Vec<_> = kinds.iter().enumerate().map(|(i, p)| request(i as u64 + 1, vec![3, 5, 7, 11 + i as u32], p.clone())).collect();
    let want = run_together(&host, &requests);
    let got = run_together(&device, &requests);
    assert_eq!(got, want, "greedy and host-row requests must not depend on where sampling runs");
    // Logprobs come back through the device path too.
    let mut stream = device.submit(request(9, vec![3, 5, 7], SamplingParams { logprobs: Some(2), ..SamplingParams::greedy(3) })).unwrap();
    let mut seen = 0;
    while let Some(ev) = stream.blocking_next() {
        match ev {
            RequestEvent::Token(t) => {
                assert!(t.logprob.is_some() && t.top_logprobs.len() == 2, "{t:?}");
                seen += 1;
            }
            RequestEvent::Finished { .. } => break,
            _ => {}
        }
    }
    assert_eq!(seen, 3);
    host.shutdown();
    device.shutdown();
}

/// A subscriber sees the prefix cache as the engine thread changes it: AllCleared first, then one
/// `Stored` run per computed prompt chain (hashes chained with the engine's own `block_hash`), and
/// nothing new when the same prompt hits the cache.
#[test]
fn kv_events_follow_the_prefix_cache() {
    use peregrine_engine::kv::{block_hash, KvEvent};
    let handle = start(&fake, 64, config(4, 64, 64, true));
    let events = handle.subscribe_kv_events(64).expect("subscribed");
    let vocab = fake::model_config().vocab_size;
    let prompt = scenarios::prompt(vocab, 7, 10); // two full blocks of 4, two tokens over
    let mut stream = handle.submit(request(1, prompt.clone(), SamplingParams::greedy(1))).expect("submitted");
    collect(&mut stream);
    let mut seen: Vec<KvEvent> = Vec::new();
    while let Ok(batch) = events.recv_timeout(Duration::from_secs(5)) {
        assert_eq!(batch.block_size, scenarios::BLOCK_SIZE);
        seen.extend(batch.events);
        if seen.iter().any(|e| matches!(e, KvEvent::Stored { .. })) {
            break;
        }
    }
    let h0 = block_hash(None, None, &prompt[..4]);
    let h1 = block_hash(Some(h0), None, &prompt[4..8]);
    assert_eq!(seen[0], KvEvent::AllCleared);
    let stored: Vec<&KvEvent> = seen.iter().filter(|e| matches!(e, KvEvent::Stored { .. })).collect();
    assert_eq!(stored, [&KvEvent::Stored { hashes: vec![h0, h1], parent: None, tokens: prompt[..8].to_vec(), adapter: None }]);

    // The same prompt again reuses both blocks: no new Stored event for them.
    let mut stream = handle.submit(request(2, prompt, SamplingParams::greedy(1))).expect("submitted");
    collect(&mut stream);
    std::thread::sleep(Duration::from_millis(200));
    let again: Vec<KvEvent> = events.try_iter().flat_map(|b| b.events).collect();
    assert!(
        again.iter().all(|e| !matches!(e, KvEvent::Stored { hashes, .. } if hashes.contains(&h0) || hashes.contains(&h1))),
        "{again:?}"
    );
    assert_eq!(handle.metrics().kv_event_batches_dropped_total, 0);
    handle.shutdown();
}

/// `n > 1`: the first choice computes the prompt; the others fork its full KV blocks (prefix
/// caching off, so nothing else could share them) and compute only the partial last block. The
/// fake's K/V is a hash chained through the block tables, so a wrongly shared block would change
/// the tokens: greedy choices must equal the request run alone.
#[test]
fn choices_share_the_prompts_blocks_and_match_running_alone() {
    let h = start(&fake, 64, config(8, 64, 128, false));
    let prompt = scenarios::prompt(VOCAB, 3, 10);
    // Long enough that the leader is still running when its followers arrive (with 6 tokens a busy
    // 2-core CI machine once let it finish first, and the last follower ran alone).
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(48) };
    let alone = run_alone(&h, &[request(1, prompt.clone(), params.clone())]).remove(0);
    let mut streams = vec![h.submit(request(10, prompt.clone(), params.clone())).expect("valid")];
    for id in 11..14 {
        streams.push(h.submit_following(request(id, prompt.clone(), params.clone()), 10).expect("valid"));
    }
    let runs: Vec<_> = streams.iter_mut().map(collect).collect();
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(run.tokens, alone.tokens, "choice {i}");
        // 10 prompt tokens, blocks of 4: the two full blocks are shared, the tail recomputed.
        assert_eq!(run.usage.cached_prompt_tokens, if i == 0 { 0 } else { 8 }, "choice {i}");
    }
    // A leader that is not there: an ordinary request.
    let lone = collect(&mut h.submit_following(request(20, prompt.clone(), params.clone()), 999).expect("valid"));
    assert_eq!((lone.tokens, lone.usage.cached_prompt_tokens), (alone.tokens.clone(), 0));

    // The same choices in one message: queued together, the first computes, the rest fork.
    let choices = (30..34).map(|id| request(id, prompt.clone(), params.clone())).collect();
    let mut streams = h.submit_choices(choices).expect("valid");
    for (i, run) in streams.iter_mut().map(collect).enumerate() {
        assert_eq!((&run.tokens, run.usage.cached_prompt_tokens), (&alone.tokens, if i == 0 { 0 } else { 8 }), "choice {i}");
    }
    // More choices than max_num_seqs (8) could never run together; an invalid one refuses all.
    let nine = (40..49).map(|id| request(id, prompt.clone(), params.clone())).collect();
    assert!(matches!(h.submit_choices(nine), Err(EngineError::InvalidRequest(_))));
    let bad = vec![request(50, prompt.clone(), params.clone()), request(51, vec![u32::MAX], params.clone())];
    assert!(matches!(h.submit_choices(bad), Err(EngineError::InvalidRequest(_))));
    assert_eq!(scenarios::final_metrics(&h).num_waiting, 0, "nothing was queued");
    h.shutdown();
}

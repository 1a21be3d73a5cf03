//! Multi-LoRA serving through the engine thread with the real SmolLM2 CPU backend: mixed batches,
//! slot eviction, host-memory eviction and reload, hot load/replace/unload while requests run, and
//! bad adapters refused while the engine keeps serving. Outputs are checked against the PEFT
//! fixtures, not against the engine itself.

mod common;
mod lora_common;

use std::path::Path;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::KvCacheShape;
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle, RequestStream};
use peregrine_engine::lora::{AdapterState, LoadOutcome, LoraConfig};
use peregrine_engine::model::rotate::{rotate_residual_stream, ROTATION_SEED};
use peregrine_engine::model::{self, LoadFormat};
use peregrine_engine::request::{FinishReason, GenerationRequest, RequestEvent, SamplingParams};
use peregrine_engine::EngineError;

use lora_common::{adapter_dir, cases, Case};

fn start(lora: LoraConfig, max_num_seqs: usize) -> EngineHandle {
    start_maybe_rotated(lora, max_num_seqs, false)
}

/// `rotated`: the model's residual stream rotated (`--quantization-rotation`), adapters rotated
/// by the engine as it reads them.
fn start_maybe_rotated(lora: LoraConfig, max_num_seqs: usize, rotated: bool) -> EngineHandle {
    let mut loaded = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF");
    let rotation = rotated.then(|| std::sync::Arc::new(rotate_residual_stream(&mut loaded.weights, ROTATION_SEED).unwrap()));
    let backend = CpuBackend::new(
        loaded.weights,
        KvCacheShape {
            num_blocks: 256,
            block_size: 16,
        },
        2,
    )
    .unwrap();
    let config = EngineConfig {
        max_num_seqs,
        max_num_batched_tokens: 256,
        block_size: 16,
        ..Default::default()
    };
    match rotation {
        Some(r) => Engine::start_with_lora_rotated(Box::new(backend), config, lora, r),
        None => Engine::start_with_lora(Box::new(backend), config, lora),
    }
    .expect("engine starts")
}

fn load_fixture_adapters(h: &EngineHandle) {
    for name in ["adapter-a", "adapter-b"] {
        let (outcome, info) = h.load_adapter(name, &adapter_dir(name)).unwrap();
        assert_eq!(outcome, LoadOutcome::Loaded);
        assert_eq!(info.name, name);
    }
}

fn submit(
    h: &EngineHandle,
    prompt: &[u32],
    adapter: Option<&str>,
    max_tokens: usize,
) -> RequestStream {
    h.submit(GenerationRequest {
        id: h.new_request_id(),
        prompt_tokens: prompt.to_vec(),
        params: SamplingParams::greedy(max_tokens),
        adapter: adapter.map(str::to_string),
    })
    .unwrap()
}

/// Reads a stream to its end: the tokens, or the error.
fn collect(stream: &mut RequestStream) -> Result<(Vec<u32>, FinishReason), String> {
    let mut tokens = Vec::new();
    while let Some(event) = stream.blocking_next() {
        match event {
            RequestEvent::Token(t) => tokens.push(t.token_id),
            RequestEvent::Finished { reason, .. } => return Ok((tokens, reason)),
            RequestEvent::Error(e) => return Err(e),
            RequestEvent::Scheduled { .. } => {}
        }
    }
    Err("stream ended without Finished".into())
}

fn check(case: &Case, got: &[u32]) {
    assert!(
        got.len() >= case.greedy.len(),
        "{}: {got:?} shorter than {:?}",
        case.label,
        case.greedy
    );
    assert_eq!(
        &got[..case.greedy.len()],
        &case.greedy[..],
        "{}: greedy ids",
        case.label
    );
}

/// Submits every case at once (so steps mix base and adapters), then checks each output.
fn run_all(h: &EngineHandle, cases: &[Case]) {
    let mut streams: Vec<RequestStream> = cases
        .iter()
        .map(|c| submit(h, &c.prompt, c.adapter.as_deref(), 24))
        .collect();
    for (case, stream) in cases.iter().zip(&mut streams) {
        let (tokens, _) = collect(stream).unwrap_or_else(|e| panic!("{}: {e}", case.label));
        check(case, &tokens);
    }
}

#[test]
fn mixed_batch_gives_what_each_gives_alone() {
    let h = start(
        LoraConfig {
            max_loras: 2,
            max_lora_rank: 64,
            max_cpu_loras: 4,
        },
        16,
    );
    load_fixture_adapters(&h);
    let all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    // Alone: one request at a time.
    for case in &all {
        let (tokens, _) =
            collect(&mut submit(&h, &case.prompt, case.adapter.as_deref(), 24)).unwrap();
        check(case, &tokens);
    }
    // Together: all nine in flight, steps mixing base, adapter-a and adapter-b.
    run_all(&h, &all);
    let steps_before = h.metrics().steps_total;
    run_all(&h, &all);
    // Nine requests of up to 24 tokens each in far fewer than 9 × 24 steps: they really were batched.
    assert!(h.metrics().steps_total - steps_before < 9 * 24 / 2);
    let infos = h.list_adapters().unwrap();
    assert_eq!(infos.iter().map(|i| i.requests_served).sum::<u64>(), 18);
    h.shutdown();
}

#[test]
fn one_slot_three_models_interleaved() {
    let h = start(
        LoraConfig {
            max_loras: 1,
            max_lora_rank: 64,
            max_cpu_loras: 4,
        },
        16,
    );
    load_fixture_adapters(&h);
    let all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    // Interleave a, b and base so the single slot must change hands many times.
    let order = [0, 3, 6, 1, 4, 7, 2, 5, 8];
    let interleaved: Vec<Case> = order.iter().map(|&i| clone_case(&all[i])).collect();
    run_all(&h, &interleaved);
    h.shutdown();
}

#[test]
fn host_memory_eviction_reloads_from_disk() {
    // One adapter in host memory at a time: every switch re-reads the other one off the engine thread.
    let h = start(
        LoraConfig {
            max_loras: 1,
            max_lora_rank: 64,
            max_cpu_loras: 1,
        },
        16,
    );
    load_fixture_adapters(&h);
    let infos = h.list_adapters().unwrap();
    let state = |n: &str| infos.iter().find(|i| i.name == n).unwrap().state;
    assert_eq!(state("adapter-a"), AdapterState::Evicted);
    assert_eq!(state("adapter-b"), AdapterState::Loaded);
    let all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    for round in [[0, 3], [4, 1], [2, 5]] {
        for i in round {
            let case = &all[i];
            let (tokens, _) =
                collect(&mut submit(&h, &case.prompt, case.adapter.as_deref(), 24)).unwrap();
            check(case, &tokens);
        }
    }
    run_all(&h, &all);
    h.shutdown();
}

/// Over a rotated model the engine rotates each adapter as it loads it and as it re-reads an
/// evicted one (one adapter in host memory: every switch re-reads): PEFT's continuations.
#[test]
fn adapters_over_a_rotated_model_are_rotated_as_they_are_read() {
    let h = start_maybe_rotated(LoraConfig { max_loras: 1, max_lora_rank: 64, max_cpu_loras: 1 }, 16, true);
    load_fixture_adapters(&h);
    let all = cases(&[("adapter-a", 0), ("adapter-b", 1)]);
    for i in [0, 3, 1, 4] {
        let case = &all[i];
        let (tokens, _) = collect(&mut submit(&h, &case.prompt, case.adapter.as_deref(), 24)).unwrap();
        check(case, &tokens);
    }
    h.shutdown();
}

#[test]
fn hot_replace_and_unload_while_requests_run() {
    let h = start(
        LoraConfig {
            max_loras: 2,
            max_lora_rank: 64,
            max_cpu_loras: 4,
        },
        16,
    );
    let only_adapter =
        |all: Vec<Case>| -> Vec<Case> { all.into_iter().filter(|c| c.adapter.is_some()).collect() };
    let a_cases = only_adapter(cases(&[("adapter-a", 0)]));
    let b_cases = only_adapter(cases(&[("adapter-b", 0)]));
    let (outcome, first) = h.load_adapter("x", &adapter_dir("adapter-a")).unwrap();
    assert_eq!(outcome, LoadOutcome::Loaded);
    // Same name, same source (spelled differently): a no-op.
    let roundabout = adapter_dir("adapter-a").join("../adapter-a");
    let (outcome, again) = h.load_adapter("x", &roundabout).unwrap();
    assert_eq!((outcome, again.id), (LoadOutcome::AlreadyLoaded, first.id));

    // Requests on "x" = adapter-a, running.
    let mut old: Vec<RequestStream> = a_cases
        .iter()
        .map(|c| submit(&h, &c.prompt, Some("x"), 24))
        .collect();
    wait_first_token(&mut old[0]);
    // Replace "x" with adapter-b while they run: they finish as adapter-a, new ones get adapter-b.
    let (outcome, replaced) = h.load_adapter("x", &adapter_dir("adapter-b")).unwrap();
    assert_eq!(outcome, LoadOutcome::Replaced);
    assert_ne!(replaced.id, first.id);
    let listed = h.list_adapters().unwrap();
    assert!(
        listed
            .iter()
            .any(|i| i.id == first.id && i.state == AdapterState::Unloading),
        "{listed:?}"
    );
    let mut new: Vec<RequestStream> = b_cases
        .iter()
        .map(|c| submit(&h, &c.prompt, Some("x"), 24))
        .collect();
    for (case, stream) in a_cases.iter().zip(&mut old).skip(1) {
        check(case, &collect(stream).unwrap().0);
    }
    // old[0] already gave its first token; the rest must still be adapter-a's.
    let rest = collect(&mut old[0]).unwrap().0;
    assert_eq!(
        &rest[..a_cases[0].greedy.len() - 1],
        &a_cases[0].greedy[1..],
        "old request after replace"
    );

    // Unload while the adapter-b requests run: they complete as adapter-b; new ones are refused.
    wait_first_token(&mut new[1]);
    let info = h.unload_adapter("x").unwrap();
    assert_eq!(info.state, AdapterState::Unloading);
    match h.submit(GenerationRequest {
        id: h.new_request_id(),
        prompt_tokens: b_cases[0].prompt.clone(),
        params: SamplingParams::greedy(4),
        adapter: Some("x".into()),
    }) {
        Err(e @ EngineError::UnknownAdapter(_)) => assert_eq!(e.kind(), "unknown_adapter"),
        Err(e) => panic!("expected UnknownAdapter, got {e}"),
        Ok(_) => panic!("an unloaded adapter accepted a request"),
    }
    assert!(matches!(
        h.unload_adapter("x"),
        Err(EngineError::UnknownAdapter(_))
    ));
    for (i, (case, stream)) in b_cases.iter().zip(&mut new).enumerate() {
        let tokens = collect(stream).unwrap().0;
        let want = if i == 1 {
            &case.greedy[1..]
        } else {
            &case.greedy[..]
        };
        assert_eq!(&tokens[..want.len()], want, "{} after unload", case.label);
    }
    // Both versions are gone once their requests ended.
    assert!(h.list_adapters().unwrap().is_empty());
    // Loading again under the same name works.
    h.load_adapter("x", &adapter_dir("adapter-a")).unwrap();
    let (tokens, _) = collect(&mut submit(&h, &a_cases[0].prompt, Some("x"), 24)).unwrap();
    check(&a_cases[0], &tokens);
    h.shutdown();
}

#[test]
fn bad_adapters_are_refused_and_the_engine_keeps_serving() {
    let h = start(
        LoraConfig {
            max_loras: 2,
            max_lora_rank: 8,
            max_cpu_loras: 4,
        },
        16,
    );
    let a = &cases(&[("adapter-a", 0)])[0];
    let mut running = submit(&h, &a.prompt, None, 24);

    let expect_invalid = |name: &str, dir: &Path, needle: &str| match h.load_adapter(name, dir) {
        Err(e @ EngineError::InvalidAdapter { .. }) => {
            assert!(e.to_string().contains(needle), "{name}: {e}")
        }
        Err(e) => panic!("{name}: expected InvalidAdapter, got {e}"),
        Ok(_) => panic!("{name}: a bad adapter was accepted"),
    };
    // Rank 16 > max_lora_rank 8.
    expect_invalid(
        "too-big",
        &adapter_dir("adapter-b"),
        "exceeds max_lora_rank",
    );
    let corrupt = lora_common::copy_adapter("adapter-a");
    let weights = corrupt.path().join("adapter_model.safetensors");
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 3]).unwrap();
    expect_invalid("corrupt", corrupt.path(), "not a valid safetensors");
    let no_config = lora_common::copy_adapter("adapter-a");
    std::fs::remove_file(no_config.path().join("adapter_config.json")).unwrap();
    expect_invalid("no-config", no_config.path(), "missing adapter_config.json");
    let pickle = lora_common::copy_adapter("adapter-a");
    std::fs::rename(
        pickle.path().join("adapter_model.safetensors"),
        pickle.path().join("adapter_model.bin"),
    )
    .unwrap();
    expect_invalid("pickle", pickle.path(), "convert to safetensors");
    assert!(matches!(
        h.load_adapter("bad name!", &adapter_dir("adapter-a")),
        Err(EngineError::InvalidRequest(_))
    ));
    assert!(h.list_adapters().unwrap().is_empty());

    // The request that was running when all that happened is unharmed, and the engine still serves.
    let base = &cases(&[])[0];
    let (tokens, _) = collect(&mut running).unwrap();
    check(base, &tokens);
    h.load_adapter("a", &adapter_dir("adapter-a")).unwrap();
    let (tokens, _) = collect(&mut submit(&h, &a.prompt, Some("a"), 24)).unwrap();
    check(a, &tokens);
    h.shutdown();
}

#[test]
fn engine_without_lora_refuses_adapters() {
    let loaded = model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF");
    let backend = CpuBackend::new(
        loaded.weights,
        KvCacheShape {
            num_blocks: 16,
            block_size: 16,
        },
        2,
    )
    .unwrap();
    let h = Engine::start(Box::new(backend), EngineConfig::default()).unwrap();
    assert!(matches!(
        h.load_adapter("a", &adapter_dir("adapter-a")),
        Err(EngineError::Unsupported(_))
    ));
    assert!(h.list_adapters().unwrap().is_empty());
    let r = GenerationRequest {
        id: 1,
        prompt_tokens: vec![504],
        params: SamplingParams::greedy(1),
        adapter: Some("a".into()),
    };
    assert!(matches!(h.submit(r), Err(EngineError::UnknownAdapter(_))));
    h.shutdown();
}

fn wait_first_token(stream: &mut RequestStream) {
    loop {
        match stream.blocking_next() {
            Some(RequestEvent::Token(_)) => return,
            Some(RequestEvent::Scheduled { .. }) => {}
            other => panic!("expected a token, got {other:?}"),
        }
    }
}

fn clone_case(c: &Case) -> Case {
    Case {
        label: c.label.clone(),
        prompt: c.prompt.clone(),
        slot: c.slot,
        adapter: c.adapter.clone(),
        top10_ids: c.top10_ids.clone(),
        top10_logits: c.top10_logits.clone(),
        greedy: c.greedy.clone(),
    }
}

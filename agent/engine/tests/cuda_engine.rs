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
//! - constrained requests (JSON schema, regex, `logit_bias`; masks applied on the GPU) get exactly
//!   the tokens of host masking of the same logits, and the CPU backend's up to bf16 near-ties.
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
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::KvCacheShape;
use peregrine_engine::model::gguf::GgufFile;
use peregrine_engine::sampling::log_softmax;
use peregrine_engine::structured::{CompiledGrammar, GrammarCompiler, GrammarOutcome, GrammarSpec, GrammarState};
use peregrine_engine::tokenizer::Tokenizer;

const BLOCK: usize = 16;
const NEW_TOKENS: usize = 12;
const CONSTRAINED_TOKENS: usize = 24;
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
    let mut rows = Vec::new();
    let ids = host_decode(b, prompt, steps, &mut |row| {
        let next = argmax(&row);
        rows.push(row);
        Some(next)
    });
    (ids, rows)
}

/// One sequence alone through the backend (prompt as one chunk, then one token per step); `pick`
/// chooses each token from that step's logits (None: stop before it).
fn host_decode(b: &mut dyn Backend, prompt: &[u32], steps: usize, pick: &mut dyn FnMut(Vec<f32>) -> Option<u32>) -> Vec<u32> {
    let table: Vec<u32> = (0..32).collect();
    let mut batch = StepBatch {
        tokens: prompt.to_vec(),
        positions: (0..prompt.len() as u32).collect(),
        seqs: vec![SeqChunk { start: 0, len: prompt.len(), context_len: 0, block_table: table.clone(), wants_logits: true, lora_slot: None }],
    };
    let mut ids = Vec::new();
    let mut pos = prompt.len();
    for _ in 0..steps {
        let Some(next) = pick(b.forward(&batch).unwrap().row(0).to_vec()) else { break };
        ids.push(next);
        batch = StepBatch {
            tokens: vec![next],
            positions: vec![pos as u32],
            seqs: vec![SeqChunk { start: 0, len: 1, context_len: pos, block_table: table.clone(), wants_logits: true, lora_slot: None }],
        };
        pos += 1;
    }
    ids
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

fn grammars(tok: &Tokenizer) -> Vec<(&'static str, CompiledGrammar)> {
    let c = GrammarCompiler::new(tok).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"],
        "additionalProperties": false
    });
    vec![
        ("json schema", c.compile(&GrammarSpec::JsonSchema(schema)).unwrap()),
        ("regex", c.compile(&GrammarSpec::Regex(r"-?[0-9]{1,3}(\.[0-9]+)? (apples|pears|plums)".into())).unwrap()),
    ]
}

/// Greedy tokens of one sequence with its grammar mask and `bias` applied to each step's logits on
/// the host, and each step's top-2 margin after them; stops after the token that completes the
/// grammar, as the engine does.
fn host_constrained_greedy(b: &mut dyn Backend, prompt: &[u32], grammar: &CompiledGrammar, bias: &[(u32, f32)]) -> (Vec<u32>, Vec<f32>) {
    let mut state = GrammarState::new(grammar);
    let mut margins = Vec::new();
    let ids = host_decode(b, prompt, CONSTRAINED_TOKENS, &mut |mut row| {
        if state.outcome() != GrammarOutcome::Continue {
            return None;
        }
        state.apply(&mut row);
        for &(t, v) in bias {
            row[t as usize] += v;
        }
        let next = argmax(&row);
        margins.push(top2_margin(&row));
        state.commit(next);
        Some(next)
    });
    (ids, margins)
}

/// Constrained decode (issue 18): grammar masks and `logit_bias` are applied on the GPU
/// (`token_mask.cu`) and the rows stay on the GPU sampler. References: host masking of the same
/// backend's logits (exact: same shapes, same logits) and the CPU backend (up to bf16 near-ties).
#[test]
fn constrained_greedy_on_the_gpu_equals_host_masking_and_the_cpu_backend() {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let tok = Tokenizer::from_gguf(&GgufFile::open(common::model_path()).unwrap()).unwrap();
    let e = engine(&w);
    let mut reference = CudaBackend::new(WeightInit::Host(&w), &opts()).expect("CUDA backend");
    let mut cpu = CpuBackend::new(w.clone(), KvCacheShape { num_blocks: 64, block_size: BLOCK }, 4).expect("CPU backend");
    // Biases that change the greedy choice: the digits 1 and 7 pushed up, the quote down a little.
    let digit = |d: &str| tok.encode(d).unwrap()[0];
    let bias = vec![(digit("1"), 3.0), (digit("7"), 2.0), (digit("\""), -0.5)];
    let prompts = prompts();
    let mut jobs = Vec::new();
    for (gname, grammar) in grammars(&tok) {
        for (pi, p) in prompts.iter().enumerate() {
            for b in [Vec::new(), bias.clone()] {
                let (want, _) = host_constrained_greedy(&mut reference, p, &grammar, &b);
                let (cpu_ids, cpu_margins) = host_constrained_greedy(&mut cpu, p, &grammar, &b);
                let params = SamplingParams { grammar: Some(grammar.clone()), logit_bias: b.clone(), ..SamplingParams::greedy(CONSTRAINED_TOKENS) };
                jobs.push((format!("{gname}, prompt {pi}, {} biases", b.len()), p.clone(), params, want, cpu_ids, cpu_margins));
            }
        }
    }
    // Alone, then all at once (mixed with an unconstrained greedy row and a penalised host row).
    for (what, p, params, want, cpu_ids, cpu_margins) in &jobs {
        let got = ids(&collect(e.submit(request(&e, p, params.clone())).unwrap()));
        assert_eq!(&got, want, "{what}: GPU-masked greedy vs host-masked argmax of the same backend's logits");
        match (0..got.len().min(cpu_ids.len())).find(|&s| got[s] != cpu_ids[s]) {
            None => report(&format!("{what}: {} constrained tokens identical to the CPU backend", got.len())),
            Some(s) => {
                report(&format!("{what}: first divergence from the CPU backend at step {s} (CPU masked top-2 margin {:.4})", cpu_margins[s]));
                assert!(cpu_margins[s] < BF16_NOISE_MARGIN, "{what}: diverged from the CPU backend at step {s}, margin {}", cpu_margins[s]);
            }
        }
    }
    let penalised = SamplingParams { repetition_penalty: 1.3, ignore_eos: true, ..SamplingParams::greedy(CONSTRAINED_TOKENS) };
    let mut streams = Vec::new();
    for (what, p, params, want, _, _) in &jobs {
        streams.push((what.clone(), want.clone(), e.submit(request(&e, p, params.clone())).unwrap()));
    }
    let host_row = e.submit(request(&e, &prompts[0], penalised)).unwrap();
    let mut near_ties = 0;
    for (what, want, s) in streams {
        let got = ids(&collect(s));
        // Batch size picks the GEMM path: logits may differ in the last bits from the alone run.
        if got != want {
            near_ties += 1;
            report(&format!("{what}: batched tokens differ from alone ({got:?} vs {want:?})"));
        }
    }
    assert_eq!(collect(host_row).len(), CONSTRAINED_TOKENS, "the penalised (host) row beside constrained ones");
    assert!(near_ties * 4 <= jobs.len(), "{near_ties} of {} constrained requests changed tokens when batched", jobs.len());
}

//! Constrained decoding (grammar masks, logit biases) with the rows kept on the GPU sampler, on a
//! GPU machine. Two references:
//! - the same CUDA backend's logits taken to the host one sequence at a time (same step shapes, so
//!   the same logits), masked by the same grammar and biased there, then argmax: the engine's greedy
//!   tokens must equal these exactly (the mask and bias are applied on the device, token_mask.cu);
//! - the CPU backend, masked and biased the same way: greedy tokens equal up to bf16 near-ties
//!   (the first divergence only where the CPU's top-2 masked logits are within bf16 noise).
//! Requests with penalties still go to the host and must keep working beside them.
//!
//! Skipped with a visible "skipped: no CUDA device: <why>" where no GPU is usable (CI).

mod common;
mod cuda_common;

use cuda_common::{argmax, gpu_or_skip, report, top2_margin};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::cuda::{CudaBackend, CudaOptions, WeightInit};
use peregrine_engine::backend::{Backend, KvCacheShape, SeqChunk, StepBatch};
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle};
use peregrine_engine::model::gguf::GgufFile;
use peregrine_engine::model::{self, LoadFormat, ModelWeights};
use peregrine_engine::request::{GenerationRequest, RequestEvent, SamplingParams};
use peregrine_engine::structured::{CompiledGrammar, GrammarCompiler, GrammarSpec, GrammarState};
use peregrine_engine::tokenizer::Tokenizer;

const BLOCK: usize = 16;
const NEW_TOKENS: usize = 24;
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
/// the host, and each step's top-2 margin after them; stops where the grammar completes.
fn host_constrained_greedy(b: &mut dyn Backend, prompt: &[u32], grammar: &CompiledGrammar, bias: &[(u32, f32)]) -> (Vec<u32>, Vec<f32>) {
    let table: Vec<u32> = (0..32).collect();
    let mut state = GrammarState::new(grammar);
    let mut batch = StepBatch {
        tokens: prompt.to_vec(),
        positions: (0..prompt.len() as u32).collect(),
        seqs: vec![SeqChunk { start: 0, len: prompt.len(), context_len: 0, block_table: table.clone(), wants_logits: true, lora_slot: None }],
    };
    let (mut ids, mut margins) = (Vec::new(), Vec::new());
    let mut pos = prompt.len();
    for _ in 0..NEW_TOKENS {
        let mut row = b.forward(&batch).unwrap().row(0).to_vec();
        state.apply(&mut row);
        for &(t, v) in bias {
            row[t as usize] += v;
        }
        let next = argmax(&row);
        ids.push(next);
        margins.push(top2_margin(&row));
        state.commit(next);
        if state.outcome() != peregrine_engine::structured::GrammarOutcome::Continue {
            break;
        }
        batch = StepBatch {
            tokens: vec![next],
            positions: vec![pos as u32],
            seqs: vec![SeqChunk { start: 0, len: 1, context_len: pos, block_table: table.clone(), wants_logits: true, lora_slot: None }],
        };
        pos += 1;
    }
    (ids, margins)
}

fn collect(mut s: peregrine_engine::engine::RequestStream) -> Vec<u32> {
    let mut out = Vec::new();
    loop {
        match s.blocking_next() {
            Some(RequestEvent::Token(t)) => out.push(t.token_id),
            Some(RequestEvent::Finished { .. }) => return out,
            Some(RequestEvent::Error(m)) => panic!("request failed: {m}"),
            Some(RequestEvent::Scheduled { .. }) => {}
            None => panic!("engine stopped"),
        }
    }
}

fn prompts() -> Vec<Vec<u32>> {
    let reference = common::reference();
    reference["prompts"].as_array().unwrap().iter().map(|p| p["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect()
}

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
                let params = SamplingParams { grammar: Some(grammar.clone()), logit_bias: b.clone(), ignore_eos: false, ..SamplingParams::greedy(NEW_TOKENS) };
                jobs.push((format!("{gname}, prompt {pi}, {} biases", b.len()), p.clone(), params, want, cpu_ids, cpu_margins));
            }
        }
    }
    // Alone, then all at once (mixed with an unconstrained greedy row and a penalised host row).
    for (what, p, params, want, cpu_ids, cpu_margins) in &jobs {
        let got = collect(e.submit(GenerationRequest { id: e.new_request_id(), prompt_tokens: p.clone(), params: params.clone(), adapter: None }).unwrap());
        assert_eq!(&got, want, "{what}: GPU-masked greedy vs host-masked argmax of the same backend's logits");
        match (0..got.len().min(cpu_ids.len())).find(|&s| got[s] != cpu_ids[s]) {
            None => report(&format!("{what}: {} constrained tokens identical to the CPU backend", got.len())),
            Some(s) => {
                report(&format!("{what}: first divergence from the CPU backend at step {s} (CPU masked top-2 margin {:.4})", cpu_margins[s]));
                assert!(cpu_margins[s] < BF16_NOISE_MARGIN, "{what}: diverged from the CPU backend at step {s}, margin {}", cpu_margins[s]);
            }
        }
    }
    let penalised = SamplingParams { repetition_penalty: 1.3, ignore_eos: true, ..SamplingParams::greedy(NEW_TOKENS) };
    let mut streams = Vec::new();
    for (what, p, params, want, _, _) in &jobs {
        streams.push((what.clone(), want.clone(), e.submit(GenerationRequest { id: e.new_request_id(), prompt_tokens: p.clone(), params: params.clone(), adapter: None }).unwrap()));
    }
    let host_row = e.submit(GenerationRequest { id: e.new_request_id(), prompt_tokens: prompts[0].clone(), params: penalised, adapter: None }).unwrap();
    let mut near_ties = 0;
    for (what, want, s) in streams {
        let got = collect(s);
        // Batch size picks the GEMM path: logits may differ in the last bits from the alone run.
        if got != want {
            near_ties += 1;
            report(&format!("{what}: batched tokens differ from alone ({got:?} vs {want:?})"));
        }
    }
    assert_eq!(collect(host_row).len(), NEW_TOKENS, "the penalised (host) row beside constrained ones");
    assert!(near_ties * 4 <= jobs.len(), "{near_ties} of {} constrained requests changed tokens when batched", jobs.len());
}

//! The engine's constrained device path (`Backend::forward_sample_constrained`: grammar masks and
//! logit biases gathered while the step runs, applied by the backend before it samples) on the real
//! SmolLM2 model, without a GPU: the CPU backend wrapped to apply masks and sample as the CUDA
//! backend does (`engine_support::device_sampling::HostDeviceMasks`). Reference: the same requests
//! through the plain CPU backend, where the host sampler applies mask and biases. Greedy rows must get
//! identical tokens (same logits, same mask, same argmax); penalised constrained rows go to the host on
//! both paths and must match too.

mod common;
mod engine_support;

use engine_support::device_sampling::HostDeviceMasks;
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::engine::{Engine, EngineConfig, EngineHandle};
use peregrine_engine::model::gguf::GgufFile;
use peregrine_engine::model::{self, LoadFormat, ModelWeights};
use peregrine_engine::request::{GenerationRequest, RequestEvent, SamplingParams};
use peregrine_engine::structured::{GrammarCompiler, GrammarSpec};
use peregrine_engine::tokenizer::Tokenizer;

const SHAPE: KvCacheShape = KvCacheShape { num_blocks: 128, block_size: 16 };

fn start(backend: Box<dyn Backend>) -> EngineHandle {
    let config = EngineConfig { max_num_seqs: 8, max_num_batched_tokens: 256, block_size: 16, enable_prefix_caching: false, ..EngineConfig::default() };
    Engine::start(backend, config).expect("engine")
}

fn run_together(e: &EngineHandle, requests: &[(Vec<u32>, SamplingParams)]) -> Vec<Vec<u32>> {
    let streams: Vec<_> = requests
        .iter()
        .map(|(p, params)| e.submit(GenerationRequest { id: e.new_request_id(), prompt_tokens: p.clone(), params: params.clone(), adapter: None }).unwrap())
        .collect();
    streams
        .into_iter()
        .map(|mut s| {
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
        })
        .collect()
}

#[test]
fn constrained_rows_sampled_as_on_a_device_equal_host_sampling() {
    let weights: ModelWeights = model::load(&common::model_path(), LoadFormat::Gguf).expect("load SmolLM2").weights;
    let tok = Tokenizer::from_gguf(&GgufFile::open(common::model_path()).unwrap()).unwrap();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let json = compiler.compile(&GrammarSpec::JsonSchema(schema)).unwrap();
    let regex = compiler.compile(&GrammarSpec::Regex(r"(yes|no), [0-9]{1,3} (apples|pears)".into())).unwrap();
    let digit = |d: &str| tok.encode(d).unwrap()[0];
    let bias = vec![(digit("7"), 4.0), (digit("1"), 2.5)];
    let prompt = |text: &str| tok.encode(text).unwrap();
    let greedy = SamplingParams::greedy(20);
    let requests = vec![
        (prompt("Describe a person as JSON:"), SamplingParams { grammar: Some(json.clone()), ..greedy.clone() }),
        (prompt("Describe a person as JSON:"), SamplingParams { grammar: Some(json.clone()), logit_bias: bias.clone(), ..greedy.clone() }),
        (prompt("Do you like fruit?"), SamplingParams { grammar: Some(regex.clone()), ..greedy.clone() }),
        (prompt("Do you like fruit?"), SamplingParams { grammar: Some(regex.clone()), logit_bias: bias.clone(), ..greedy.clone() }),
        // Biases alone, no grammar.
        (prompt("Count: 1, 2,"), SamplingParams { logit_bias: bias.clone(), ..greedy.clone() }),
        // A penalised constrained row: the host samples it on both paths.
        (prompt("Describe a person as JSON:"), SamplingParams { grammar: Some(json.clone()), repetition_penalty: 1.2, ..greedy.clone() }),
        // Unconstrained beside them.
        (prompt("The capital of France is"), greedy.clone()),
    ];
    let host = start(Box::new(CpuBackend::new(weights.clone(), SHAPE, 2).unwrap()));
    let want = run_together(&host, &requests);
    host.shutdown();
    let device = start(Box::new(HostDeviceMasks(CpuBackend::new(weights, SHAPE, 2).unwrap())));
    let got = run_together(&device, &requests);
    device.shutdown();
    let applied = engine_support::device_sampling::CONSTRAINED_ROWS_APPLIED.load(std::sync::atomic::Ordering::Relaxed);
    assert!(applied >= 5 * 5, "only {applied} constrained rows went through the device path");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}: device-constrained path vs host sampling");
    }
    // The constraints did something: the biased JSON differs from the unbiased one, and the regex
    // outputs match the regex.
    assert_ne!(want[0], want[1], "the biases changed nothing");
    for i in [2, 3] {
        let text = tok.decode(&want[i], true).unwrap();
        assert!(regex_automata::meta::Regex::new(r"^(yes|no), [0-9]{1,3} (apples|pears)$").unwrap().is_match(&text), "request {i}: {text:?}");
    }
}

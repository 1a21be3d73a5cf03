//! The engine's constrained device path (`Backend::forward_sample_constrained`: grammar masks and
//! logit biases gathered while the step runs, applied by the backend before it samples) on the real
//! SmolLM2 model, without a GPU: the CPU backend wrapped to apply masks and sample as the CUDA
//! backend does (`engine_support::device_sampling::HostDevice::with_masks`). Reference: the same requests
//! through the plain CPU backend, where the host sampler applies mask and biases. Greedy rows must get
//! identical tokens (same logits, same mask, same argmax); penalised constrained rows go to the host on
//! both paths and must match too.

mod common;
mod engine_support;

use engine_support::device_sampling::HostDevice;
use engine_support::scenarios::{config, request, run_together, start};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::model::gguf::GgufFile;
use peregrine_engine::model::{self, LoadFormat, ModelWeights};
use peregrine_engine::request::SamplingParams;
use peregrine_engine::structured::{GrammarCompiler, GrammarSpec};
use peregrine_engine::tokenizer::Tokenizer;

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
    let requests: Vec<_> = requests.into_iter().enumerate().map(|(i, (p, params))| request(i as u64 + 1, p, params)).collect();
    let on_host = |shape: KvCacheShape| -> Box<dyn Backend> { Box::new(CpuBackend::new(weights.clone(), shape, 2).unwrap()) };
    let on_device = |shape: KvCacheShape| -> Box<dyn Backend> { Box::new(HostDevice::with_masks(CpuBackend::new(weights.clone(), shape, 2).unwrap())) };
    let host = start(&on_host, 512, config(8, 256, 512, false));
    let want: Vec<Vec<u32>> = run_together(&host, &requests).into_iter().map(|r| r.tokens).collect();
    host.shutdown();
    let device = start(&on_device, 512, config(8, 256, 512, false));
    let got: Vec<Vec<u32>> = run_together(&device, &requests).into_iter().map(|r| r.tokens).collect();
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

/// A batch with more constrained rows than the engine commits one by one (16): their tokens are
/// handed to the grammars on the mask threads, all at once. Same reference: the plain CPU backend,
/// where the host sampler applies the masks and commits each token itself.
#[test]
fn a_large_constrained_batch_commits_on_the_mask_threads_and_equals_host_sampling() {
    let weights: ModelWeights = model::load(&common::model_path(), LoadFormat::Gguf).expect("load SmolLM2").weights;
    let tok = Tokenizer::from_gguf(&GgufFile::open(common::model_path()).unwrap()).unwrap();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    let regex = compiler.compile(&GrammarSpec::Regex(r"(yes|no), [0-9]{1,3} (apples|pears)".into())).unwrap();
    let list = compiler.compile(&GrammarSpec::JsonSchema(serde_json::json!({"type": "array", "items": {"type": "integer"}}))).unwrap();
    let subjects = ["fruit", "pears", "apples", "numbers", "lists", "cats", "rain", "tea", "maps", "boats", "jazz", "trains"];
    let mut requests = Vec::new();
    for (i, subject) in subjects.iter().enumerate() {
        let grammar = if i % 2 == 0 { regex.clone() } else { list.clone() };
        let params = SamplingParams { grammar: Some(grammar), ..SamplingParams::greedy(12) };
        for prefix in ["Do you like", "Tell me about"] {
            let prompt = tok.encode(&format!("{prefix} {subject}?")).unwrap();
            requests.push(request(requests.len() as u64 + 1, prompt, params.clone()));
        }
    }
    assert!(requests.len() >= 24);
    let on_host = |shape: KvCacheShape| -> Box<dyn Backend> { Box::new(CpuBackend::new(weights.clone(), shape, 2).unwrap()) };
    let on_device = |shape: KvCacheShape| -> Box<dyn Backend> { Box::new(HostDevice::with_masks(CpuBackend::new(weights.clone(), shape, 2).unwrap())) };
    let host = start(&on_host, 1024, config(32, 1024, 512, false));
    let want: Vec<Vec<u32>> = run_together(&host, &requests).into_iter().map(|r| r.tokens).collect();
    host.shutdown();
    let before = engine_support::device_sampling::CONSTRAINED_ROWS_APPLIED.load(std::sync::atomic::Ordering::Relaxed);
    let device = start(&on_device, 1024, config(32, 1024, 512, false));
    let got: Vec<Vec<u32>> = run_together(&device, &requests).into_iter().map(|r| r.tokens).collect();
    device.shutdown();
    let applied = engine_support::device_sampling::CONSTRAINED_ROWS_APPLIED.load(std::sync::atomic::Ordering::Relaxed) - before;
    assert!(applied >= 24 * 5, "only {applied} constrained rows went through the device path");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}: device-constrained path vs host sampling");
    }
}

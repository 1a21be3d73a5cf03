//! The scheduler under memory pressure, modeled: runs the real `Scheduler` and `BlockManager` on
//! a synthetic workload (no model, no device; every request runs to `--output-len`, as the
//! `throughput` command's do) and prices each step with an affine cost model of an H100 running
//! the Llama-3.1-8B shape in bf16. Prints, for the look-ahead admission and for admission on
//! current blocks alone (vLLM's policy), the steps, preemptions, recomputed prefill tokens, mean
//! decode batch and the modeled time. A model, not a measurement: it ranks policies, the GPU run
//! settles them.
//!
//! `cargo run -p peregrine-engine --example sched_model -- [--num-prompts 1000]
//! [--input-len 1000] [--output-len 1000] [--kv-tokens 420000] [--block-size 16]
//! [--max-num-seqs 1024] [--max-num-batched-tokens 16384]`

use peregrine_engine::kv::BlockManager;
use peregrine_engine::scheduler::{Scheduler, SchedulerConfig, Sequence};

/// Milliseconds per step, per decode row, per prefill token and per context token that attention
/// reads. From docs/benchmarks.md (H100, 8B shape, bf16): decode at batch 64 / 256 ≈ 9.7 / 16 ms
/// per step with short contexts; prefill ≈ 31.5k tokens/s; the KV cache's 128 KiB per token read
/// at ≈ 2.5 TB/s.
const STEP_MS: f64 = 7.5;
const DECODE_ROW_MS: f64 = 0.033;
const PREFILL_TOKEN_MS: f64 = 0.032;
const CONTEXT_TOKEN_MS: f64 = 5.2e-5;

struct Workload {
    num_prompts: usize,
    input_len: usize,
    output_len: usize,
    kv_tokens: usize,
    block_size: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
}

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} takes a number, not {v:?}")))
        .unwrap_or(default)
}

fn run(w: &Workload, lookahead: bool) {
    let config = SchedulerConfig { max_num_seqs: w.max_num_seqs, max_num_batched_tokens: w.max_num_batched_tokens, lookahead };
    let mut s = Scheduler::new(config, BlockManager::new(w.kv_tokens / w.block_size, w.block_size, false));
    for id in 0..w.num_prompts as u64 {
        let mut seq = Sequence::new(id, vec![id as u32; w.input_len]);
        seq.max_len = Some(w.input_len + w.output_len);
        s.add(seq);
    }
    let (mut ms, mut steps, mut preemptions, mut prefill, mut rows) = (0.0f64, 0usize, 0usize, 0usize, 0usize);
    while s.has_work() {
        let out = s.schedule();
        assert!(!out.is_empty(), "a request does not fit in the KV cache alone");
        let decode_rows = out.chunks.iter().filter(|c| c.is_decode).count();
        let prefill_tokens: usize = out.chunks.iter().filter(|c| !c.is_decode).map(|c| c.num_tokens).sum();
        let context: usize = out.chunks.iter().map(|c| c.context_len + c.num_tokens).sum();
        ms += STEP_MS
            + DECODE_ROW_MS * decode_rows as f64
            + PREFILL_TOKEN_MS * prefill_tokens as f64
            + CONTEXT_TOKEN_MS * context as f64;
        (steps, preemptions, prefill, rows) =
            (steps + 1, preemptions + out.preempted.len(), prefill + prefill_tokens, rows + decode_rows);
        s.step_done(&out);
        for c in out.chunks.iter().filter(|c| c.wants_logits) {
            s.append_token(c.id, 1);
            if s.get(c.id).is_some_and(|q| q.output().len() >= w.output_len) {
                s.remove(c.id);
            }
        }
    }
    let seconds = ms / 1e3;
    println!(
        "{:<26} {steps:>6} steps {preemptions:>5} preemptions {:>9} prefill tokens ({} prompts) mean decode batch {:>5.1}  modeled {seconds:>7.1} s = {:>7.0} output tokens/s",
        if lookahead { "look-ahead" } else { "current blocks (vLLM)" },
        prefill,
        w.num_prompts * w.input_len,
        rows as f64 / steps.max(1) as f64,
        (w.num_prompts * w.output_len) as f64 / seconds,
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let w = Workload {
        num_prompts: arg(&args, "--num-prompts", 1000),
        input_len: arg(&args, "--input-len", 1000),
        output_len: arg(&args, "--output-len", 1000),
        kv_tokens: arg(&args, "--kv-tokens", 420_000),
        block_size: arg(&args, "--block-size", 16),
        max_num_seqs: arg(&args, "--max-num-seqs", 1024),
        max_num_batched_tokens: arg(&args, "--max-num-batched-tokens", 16384),
    };
    println!(
        "{} x ({} in / {} out), KV cache {} tokens, max_num_seqs {}, max_num_batched_tokens {}",
        w.num_prompts, w.input_len, w.output_len, w.kv_tokens, w.max_num_seqs, w.max_num_batched_tokens
    );
    run(&w, true);
    run(&w, false);
}

//! `peregrine-agent throughput`: offline throughput of many requests at once through the whole engine
//! (scheduler, paged KV cache, chunked prefill, sampling; no HTTP), like vLLM's
//! `benchmark_throughput.py`: `--num-prompts` random prompts of `--input-len` tokens, each generating
//! exactly `--output-len` tokens (EOS ignored), all submitted at once. With `--lora N` (N random
//! adapters) or `--lora-dir DIR` (the PEFT adapters in a folder) the same workload runs twice on one
//! engine, base model then each request on one of the adapters (`--lora-dist`), and both figures
//! print side by side. Prints figures; asserts nothing.

use std::time::{Duration, Instant};

use clap::Args;
use peregrine_engine::engine::EngineHandle;
use peregrine_engine::bench::lora::zipf_assignment;
use peregrine_engine::request::{GenerationRequest, RequestEvent, SamplingParams};
use serde::Serialize;

use crate::bench_adapters::{AdapterSource, AdapterSummary, ScratchDir};
use crate::runtime::EngineArgs;

#[derive(Debug, Clone, Args)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Requests submitted at once.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Prompt tokens of each request (random token ids).
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Tokens each request generates (EOS ignored).
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    /// Sampling temperature (0: greedy). vLLM's benchmark samples at 1.0.
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Top-p of every request (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Top-k of every request (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Also run the workload with this many random LoRA adapters (0: base model only).
    #[arg(long, default_value_t = 0)]
    pub lora: usize,
    /// Rank of the random adapters (all seven projections).
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// Run the LoRA side on the PEFT adapters in this folder (each subfolder with an
    /// adapter_config.json, or the folder itself) instead of random ones: all of them, or the
    /// first `--lora N` by name.
    #[arg(long)]
    pub lora_dir: Option<std::path::PathBuf>,
    /// How requests spread over the adapters: `uniform` or `zipf:S` (Zipf exponent S).
    #[arg(long, default_value = "zipf:1", value_parser = parse_lora_dist)]
    pub lora_dist: f64,
    /// Print the figures as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `uniform` (Zipf exponent 0) or `zipf:S`.
fn parse_lora_dist(v: &str) -> Result<f64, String> {
    match v.split_once(':') {
        _ if v == "uniform" => Ok(0.0),
        Some(("zipf", s)) => s.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0).ok_or_else(|| format!("bad Zipf exponent {s:?}")),
        _ => Err(format!("--lora-dist takes uniform or zipf:S, not {v:?}")),
    }
}

/// What `throughput` measured (printed, or as JSON with `--json`).
#[derive(Debug, Serialize)]
pub struct ThroughputReport {
    pub model: String,
    pub backend: String,
    pub num_prompts: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub seconds: f64,
    pub requests_per_second: f64,
    pub output_tokens_per_second: f64,
    pub total_tokens_per_second: f64,
    ttft_p50_seconds: f64,
    ttft_p99_seconds: f64,
    pub preemptions: u64,
    /// Tokens run through prefill, recomputation after preemption included (the prompts alone
    /// are `num_prompts * input_len`).
    pub prefill_tokens_computed: u64,
    pub engine_steps: u64,
    /// With `--lora`: the same workload on the adapters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraRun>,
}

/// The LoRA side of the workload.
#[derive(Debug, Serialize)]
pub struct LoraRun {
    #[serde(flatten)]
    pub adapters: AdapterSummary,
    pub zipf_s: f64,
    pub seconds: f64,
    pub output_tokens_per_second: f64,
    /// LoRA output throughput / base output throughput.
    pub relative_to_base: f64,
    ttft_p50_seconds: f64,
    pub preemptions: u64,
    /// A new adapter from disk to its first token, with the engine idle (median of
    /// [`COLD_ADAPTER_SAMPLES`]): written as PEFT files, loaded, then one request on it.
    pub cold_adapter: ColdAdapter,
}

/// How long a new adapter takes from its files on disk to the first token of a request on it.
#[derive(Debug, Serialize)]
pub struct ColdAdapter {
    /// Reading, parsing and validating the PEFT files (`load_adapter`, the admin API's work).
    pub load_seconds: f64,
    /// Then one request of `input_len` tokens on it: its first token (the slot upload and the prefill).
    pub first_token_seconds: f64,
    /// `load_seconds + first_token_seconds`.
    pub disk_to_first_token_seconds: f64,
    /// The same request on the base model, for comparison (the prefill alone).
    pub base_first_token_seconds: f64,
}

/// Fresh adapters timed from disk to first token (the median is reported).
const COLD_ADAPTER_SAMPLES: usize = 3;

/// What one timed pass of the workload measured.
struct Pass {
    seconds: f64,
    output_tokens: usize,
    ttft: Vec<f64>,
    preemptions: u64,
    prefill_tokens_computed: u64,
    engine_steps: u64,
}

impl Pass {
    fn pct(&self, q: f64) -> f64 {
        self.ttft.get(((self.ttft.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
    }
}

pub fn run(args: ThroughputArgs) -> anyhow::Result<()> {
    let json = args.json;
    let report = measure(args)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        report.print();
    }
    Ok(())
}

/// Runs the workload (and its LoRA side) and returns the figures.
pub fn measure(args: ThroughputArgs) -> anyhow::Result<ThroughputReport> {
    if args.num_prompts == 0 || args.input_len == 0 || args.output_len == 0 {
        anyhow::bail!("--num-prompts, --input-len and --output-len must be at least 1");
    }
    let mut engine_args = args.engine.clone();
    // Random prompts share no prefix; the cache would only add bookkeeping.
    engine_args.disable_prefix_caching = true;
    // Read before the model loads, so that a bad folder fails fast and its ranks can be reserved.
    let adapters = AdapterSource::from_flags(args.lora, args.lora_rank, args.lora_dir.as_deref())?;
    // GPU slots stay at --max-loras: more adapters than slots is part of what a workload measures.
    adapters.reserve(&mut engine_args, false);
    let runtime = engine_args.start()?;
    let engine = &runtime.engine;
    let vocab = runtime.model_config.vocab_size;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        ignore_eos: true,
        ..SamplingParams::greedy(args.output_len)
    };
    let loaded = adapters.load(&runtime, args.engine.seed)?;
    let adapter_names = &loaded.names;

    // Warm-up (kernels compiled and loaded, first CUDA graphs, pages touched), not timed.
    let warm = GenerationRequest {
        id: engine.new_request_id(),
        prompt_tokens: random_prompt(args.input_len, vocab, u64::MAX),
        params: SamplingParams { max_tokens: 4, ..params.clone() },
        adapter: None,
    };
    drain(engine.submit(warm)?)?;
    let base = run_pass(engine, &args, &params, &vec![None; args.num_prompts], vocab)?;
    let lora = if adapter_names.is_empty() {
        None
    } else {
        let picks = zipf_assignment(args.num_prompts, adapter_names.len(), args.lora_dist, 0.0, args.engine.seed);
        let assignment: Vec<Option<String>> = picks.iter().map(|p| p.map(|a| adapter_names[a].clone())).collect();
        let pass = run_pass(engine, &args, &params, &assignment, vocab)?;
        let cold_adapter = time_cold_adapters(&runtime, &args, &params, adapters.max_rank())?;
        let tps = pass.output_tokens as f64 / pass.seconds;
        Some(LoraRun {
            adapters: adapters.summary(),
            zipf_s: args.lora_dist,
            seconds: pass.seconds,
            output_tokens_per_second: tps,
            relative_to_base: tps / (base.output_tokens as f64 / base.seconds).max(1e-9),
            ttft_p50_seconds: pass.pct(0.5),
            preemptions: pass.preemptions,
            cold_adapter,
        })
    };
    engine.shutdown();

    let report = ThroughputReport {
        model: args.engine.model.display().to_string(),
        backend: runtime.backend_name.clone(),
        num_prompts: args.num_prompts,
        input_len: args.input_len,
        output_len: args.output_len,
        max_num_seqs: engine_args.max_num_seqs,
        max_num_batched_tokens: engine_args.max_num_batched_tokens,
        seconds: base.seconds,
        requests_per_second: args.num_prompts as f64 / base.seconds,
        output_tokens_per_second: base.output_tokens as f64 / base.seconds,
        total_tokens_per_second: (base.output_tokens + args.num_prompts * args.input_len) as f64 / base.seconds,
        ttft_p50_seconds: base.pct(0.5),
        ttft_p99_seconds: base.pct(0.99),
        preemptions: base.preemptions,
        prefill_tokens_computed: base.prefill_tokens_computed,
        engine_steps: base.engine_steps,
        lora,
    };
    Ok(report)
}

impl ThroughputReport {
    fn print(&self) {
        let report = self;
        println!("model       {} on {}", report.model, report.backend);
        println!(
            "workload    {} requests x ({} in / {} out), max_num_seqs {}, max_num_batched_tokens {}",
            report.num_prompts, report.input_len, report.output_len, report.max_num_seqs, report.max_num_batched_tokens
        );
        println!("elapsed     {:.2} s ({} engine steps, {} preemptions)", report.seconds, report.engine_steps, report.preemptions);
        println!(
            "prefill     {} tokens computed for {} prompt tokens (the rest is recomputation after preemption)",
            report.prefill_tokens_computed,
            report.num_prompts * report.input_len
        );
        println!("throughput  {:.2} requests/s, {:.1} output tokens/s, {:.1} total tokens/s", report.requests_per_second, report.output_tokens_per_second, report.total_tokens_per_second);
        println!("TTFT        p50 {:.3} s, p99 {:.3} s (all requests submitted at t=0)", report.ttft_p50_seconds, report.ttft_p99_seconds);
        if let Some(l) = &report.lora {
            println!(
                "+ LoRA      {:.1} output tokens/s = {:.3} x base ({}, zipf s={}; {:.2} s, TTFT p50 {:.3} s, {} preemptions)",
                l.output_tokens_per_second,
                l.relative_to_base,
                l.adapters.describe(),
                l.zipf_s, l.seconds, l.ttft_p50_seconds, l.preemptions
            );
            let c = &l.cold_adapter;
            println!(
                "cold LoRA   disk to first token {:.1} ms = load {:.1} ms + first token {:.1} ms (base model's first token {:.1} ms; a new bf16 rank-{} adapter, engine idle, median of {})",
                c.disk_to_first_token_seconds * 1e3,
                c.load_seconds * 1e3,
                c.first_token_seconds * 1e3,
                c.base_first_token_seconds * 1e3,
                l.adapters.rank,
                COLD_ADAPTER_SAMPLES
            );
        }
    }
}

/// Times [`COLD_ADAPTER_SAMPLES`] adapters never seen before (random, of `rank`: the workload's
/// largest) from their PEFT files to the first token of one request on each (the engine otherwise
/// idle; the GPU slots still hold the workload's adapters, so each takes a slot from one of them),
/// and the same request on the base model.
fn time_cold_adapters(runtime: &crate::runtime::Runtime, args: &ThroughputArgs, params: &SamplingParams, rank: usize) -> anyhow::Result<ColdAdapter> {
    let engine = &runtime.engine;
    let vocab = runtime.model_config.vocab_size;
    let scratch = ScratchDir::new()?;
    let written = peregrine_engine::bench::lora::write_random_adapters(&runtime.model_config, COLD_ADAPTER_SAMPLES, rank, args.engine.seed ^ 0xC01D, &scratch.0)?;
    let one = SamplingParams { max_tokens: 1, ..params.clone() };
    let first_token = |adapter: Option<String>, salt: u64| -> anyhow::Result<f64> {
        let request = GenerationRequest { id: engine.new_request_id(), prompt_tokens: random_prompt(args.input_len, vocab, salt), params: one.clone(), adapter };
        let start = Instant::now();
        let mut stream = engine.submit(request)?;
        let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        tokio.block_on(async {
            let mut first = None;
            loop {
                match stream.next().await {
                    Some(RequestEvent::Token(_)) => {
                        first.get_or_insert_with(|| start.elapsed().as_secs_f64());
                    }
                    Some(RequestEvent::Finished { .. }) => return first.ok_or_else(|| anyhow::anyhow!("no token")),
                    Some(RequestEvent::Error(m)) => anyhow::bail!("request failed: {m}"),
                    Some(RequestEvent::Scheduled { .. }) => {}
                    None => anyhow::bail!("the engine stopped"),
                }
            }
        })
    };
    let (mut load, mut first, mut base) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (name, folder)) in written.iter().enumerate() {
        let name = format!("cold-{name}");
        let start = Instant::now();
        engine.load_adapter(&name, folder)?;
        load.push(start.elapsed().as_secs_f64());
        first.push(first_token(Some(name.clone()), 1_000_000 + i as u64)?);
        base.push(first_token(None, 2_000_000 + i as u64)?);
        engine.unload_adapter(&name)?;
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let totals: Vec<f64> = load.iter().zip(&first).map(|(a, b)| a + b).collect();
    Ok(ColdAdapter { load_seconds: median(load), first_token_seconds: median(first), disk_to_first_token_seconds: median(totals), base_first_token_seconds: median(base) })
}

/// Submits every request at once (request `i` on `adapters[i]`) and waits for all of them.
fn run_pass(engine: &EngineHandle, args: &ThroughputArgs, params: &SamplingParams, adapters: &[Option<String>], vocab: usize) -> anyhow::Result<Pass> {
    let before = engine.metrics();
    let tokio = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let start = Instant::now();
    let mut streams = Vec::with_capacity(args.num_prompts);
    for (i, adapter) in adapters.iter().enumerate() {
        let request = GenerationRequest {
            id: engine.new_request_id(),
            prompt_tokens: random_prompt(args.input_len, vocab, i as u64),
            params: params.clone(),
            adapter: adapter.clone(),
        };
        streams.push(engine.submit(request)?);
    }
    // One task per stream on one thread: the engine thread does the work, readers only count.
    let results: Vec<anyhow::Result<(usize, Duration)>> = tokio.block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for mut stream in streams {
            tasks.spawn(async move {
                let mut tokens = 0usize;
                let mut first = None;
                loop {
                    match stream.next().await {
                        Some(RequestEvent::Token(_)) => {
                            tokens += 1;
                            first.get_or_insert_with(|| start.elapsed());
                        }
                        Some(RequestEvent::Finished { .. }) => return Ok((tokens, first.unwrap_or_default())),
                        Some(RequestEvent::Error(m)) => anyhow::bail!("request failed: {m}"),
                        Some(RequestEvent::Scheduled { .. }) => {}
                        None => anyhow::bail!("the engine stopped"),
                    }
                }
            });
        }
        let mut out = Vec::new();
        while let Some(r) = tasks.join_next().await {
            out.push(r.unwrap_or_else(|e| Err(anyhow::anyhow!("reader task failed: {e}"))));
        }
        out
    });
    let seconds = start.elapsed().as_secs_f64();
    let results = results.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let after = engine.metrics();
    let output_tokens: usize = results.iter().map(|r| r.0).sum();
    if output_tokens != adapters.len() * args.output_len {
        anyhow::bail!("generated {output_tokens} tokens, expected {}", adapters.len() * args.output_len);
    }
    let mut ttft: Vec<f64> = results.iter().map(|r| r.1.as_secs_f64()).collect();
    ttft.sort_by(|a, b| a.total_cmp(b));
    Ok(Pass {
        seconds,
        output_tokens,
        ttft,
        preemptions: after.preemptions_total.saturating_sub(before.preemptions_total),
        prefill_tokens_computed: after.prefill_tokens_computed_total.saturating_sub(before.prefill_tokens_computed_total),
        engine_steps: after.steps_total.saturating_sub(before.steps_total),
    })
}

/// Reads a stream to its end on this thread.
fn drain(mut stream: peregrine_engine::engine::RequestStream) -> anyhow::Result<()> {
    loop {
        match stream.blocking_next() {
            Some(RequestEvent::Finished { .. }) => return Ok(()),
            Some(RequestEvent::Error(m)) => anyhow::bail!("warm-up request failed: {m}"),
            Some(_) => {}
            None => anyhow::bail!("the engine stopped"),
        }
    }
}

/// Random token ids (a fixed function of `salt`), avoiding the special tokens at the start of most
/// vocabularies.
fn random_prompt(len: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let low = (vocab / 50).min(1000) as u64;
    let span = (vocab as u64).saturating_sub(low).max(1);
    let mut x = salt.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5151_5eed;
    (0..len)
        .map(|_| {
            // xorshift64*: cheap, good enough to make prompts unrelated.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            (low + x.wrapping_mul(0x2545_f491_4f6c_dd1d) % span) as u32
        })
        .collect()
}

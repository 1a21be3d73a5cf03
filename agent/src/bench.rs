//! `peregrine-agent bench`: offline throughput through the whole engine (scheduler, KV cache, sampler;
//! no HTTP), like vLLM's `benchmark_throughput`/`benchmark_latency`. Prints figures; asserts nothing.

use std::time::{Duration, Instant};

use clap::Args;
use peregrine_engine::engine::EngineHandle;
use peregrine_engine::request::{GenerationRequest, RequestEvent, SamplingParams};
use serde::Serialize;

use crate::runtime::EngineArgs;

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt length of the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Batch sizes of the decode measurements (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch_sizes: Vec<usize>,
    /// Prompt tokens of each sequence before the decode measurement starts.
    #[arg(long, default_value_t = 64)]
    pub context_len: usize,
    /// Tokens generated per sequence in a decode measurement.
    #[arg(long, default_value_t = 64)]
    pub decode_tokens: usize,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Print the figures as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct DecodeFigure {
    batch: usize,
    tokens_per_second: f64,
    ms_per_step: f64,
}

#[derive(Debug, Serialize)]
struct BenchReport {
    model: String,
    backend: String,
    threads: usize,
    prompt_len: usize,
    prefill_tokens_per_second: f64,
    decode: Vec<DecodeFigure>,
    peak_rss_mib: Option<f64>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let mut engine_args = args.engine.clone();
    // Every measurement uses fresh prompts; the prefix cache would only blur the prefill figure.
    engine_args.disable_prefix_caching = true;
    let max_batch = args.batch_sizes.iter().copied().max().unwrap_or(1);
    engine_args.max_num_seqs = engine_args.max_num_seqs.max(max_batch);
    engine_args.max_num_batched_tokens = engine_args.max_num_batched_tokens.max(args.prompt_len);
    let runtime = engine_args.start()?;
    let engine = &runtime.engine;
    let vocab = runtime.model_config.vocab_size;
    let repeat = args.repeat.max(1);
    let mut salt = 0u64;

    // Warm-up: first-touch of weights and KV pages.
    run_batch(engine, 1, 16, 2, vocab, &mut salt)?;

    let mut prefill = Vec::new();
    for _ in 0..repeat {
        let t = run_batch(engine, 1, args.prompt_len, 1, vocab, &mut salt)?;
        prefill.push(args.prompt_len as f64 / t.first_token.as_secs_f64().max(1e-9));
    }
    let mut decode = Vec::new();
    for &batch in &args.batch_sizes {
        let mut figures = Vec::new();
        for _ in 0..repeat {
            let t = run_batch(engine, batch, args.context_len, args.decode_tokens + 1, vocab, &mut salt)?;
            figures.push(t.decode_tokens as f64 / t.decode.as_secs_f64().max(1e-9));
        }
        let tps = median(&mut figures);
        decode.push(DecodeFigure { batch, tokens_per_second: tps, ms_per_step: 1000.0 * batch as f64 / tps });
    }
    engine.shutdown();

    let report = BenchReport {
        model: args.engine.model.display().to_string(),
        backend: runtime.backend_name.clone(),
        threads: args.engine.threads(),
        prompt_len: args.prompt_len,
        prefill_tokens_per_second: median(&mut prefill),
        decode,
        peak_rss_mib: peak_rss_mib(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("model      {}", report.model);
        println!("backend    {} ({} threads)", report.backend, report.threads);
        println!("prefill    {:>9.1} tokens/s  (1 x {} tokens)", report.prefill_tokens_per_second, report.prompt_len);
        for d in &report.decode {
            println!("decode     {:>9.1} tokens/s  (batch {:>3}, {:.1} ms/step)", d.tokens_per_second, d.batch, d.ms_per_step);
        }
        match report.peak_rss_mib {
            Some(m) => println!("peak RSS   {m:>9.1} MiB"),
            None => println!("peak RSS   unknown on this platform"),
        }
    }
    Ok(())
}

struct BatchTiming {
    /// Submit → the last sequence's first token (the whole batch's prefill).
    first_token: Duration,
    /// The last first token → the last token.
    decode: Duration,
    /// Tokens generated after the decode clock started.
    decode_tokens: usize,
}

/// Runs `batch` sequences of `prompt_len` synthetic tokens, `max_tokens` each, and times them. Each
/// stream is read on its own thread so token arrival times are real.
fn run_batch(
    engine: &EngineHandle,
    batch: usize,
    prompt_len: usize,
    max_tokens: usize,
    vocab: usize,
    salt: &mut u64,
) -> anyhow::Result<BatchTiming> {
    let start = Instant::now();
    let mut streams = Vec::with_capacity(batch);
    for _ in 0..batch {
        *salt += 1;
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
        let request = GenerationRequest {
            id: engine.new_request_id(),
            prompt_tokens: synthetic_prompt(prompt_len, vocab, *salt),
            params,
            adapter: None,
        };
        streams.push(engine.submit(request)?);
    }
    let arrivals: Vec<anyhow::Result<Vec<Instant>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = streams
            .into_iter()
            .map(|mut stream| {
                scope.spawn(move || {
                    let mut times = Vec::new();
                    loop {
                        match stream.blocking_next() {
                            Some(RequestEvent::Token(_)) => times.push(Instant::now()),
                            Some(RequestEvent::Finished { .. }) => return Ok(times),
                            Some(RequestEvent::Error(m)) => anyhow::bail!("request failed: {m}"),
                            Some(RequestEvent::Scheduled { .. }) => {}
                            None => anyhow::bail!("the engine stopped"),
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("reader panicked")))).collect()
    });
    let arrivals = arrivals.into_iter().collect::<anyhow::Result<Vec<_>>>()?;
    let first = arrivals.iter().filter_map(|t| t.first().copied()).max().unwrap_or(start);
    let last = arrivals.iter().filter_map(|t| t.last().copied()).max().unwrap_or(first);
    let decode_tokens = arrivals.iter().map(|t| t.iter().filter(|&&x| x > first).count()).sum();
    Ok(BatchTiming { first_token: first - start, decode: last - first, decode_tokens })
}

/// Token ids that avoid the special tokens at the start of most vocabularies.
fn synthetic_prompt(len: usize, vocab: usize, salt: u64) -> Vec<u32> {
    let low = (vocab / 50).min(1000) as u64;
    let span = (vocab as u64).saturating_sub(low).max(1);
    (0..len as u64).map(|i| (low + (salt * 7_919 + i * 104_729 + i * i * 31) % span) as u32).collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Peak resident memory of this process (Linux `VmHWM`).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

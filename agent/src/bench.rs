//! `peregrine-agent bench`: offline throughput through the whole engine (scheduler, KV cache, sampler;
//! no HTTP), like vLLM's `benchmark_throughput`/`benchmark_latency`. Prints figures; asserts nothing.
//! With `--lora N` (N random adapters) or `--lora-dir DIR` (the PEFT adapters in a folder), each
//! decode batch size is run a second time on the adapters (Zipf-spread over the batch) and the
//! throughput is reported relative to the base model's. With
//! `--json-schema FILE`, likewise with every sequence constrained to that JSON schema (llguidance
//! masks, computed beside the forward pass), relative to unconstrained decode, and the host time one
//! step's masks take for 32 and 256 sequences (the tokenizer's vocabulary; with a dummy-weight shape,
//! `--tokenizer` supplies one).

use std::time::{Duration, Instant};

use clap::{Args, Subcommand};
use peregrine_engine::engine::EngineHandle;
use peregrine_engine::bench::lora::zipf_assignment;
use peregrine_engine::request::{GenerationRequest, RequestEvent, SamplingParams};
use peregrine_engine::structured::{CompiledGrammar, GrammarCompiler, GrammarSpec};
use serde::Serialize;

use crate::bench_adapters::{AdapterSource, AdapterSummary};
use crate::bench_serve::ServeBenchArgs;
use crate::runtime::EngineArgs;

/// `bench [offline flags]`, `bench offline [flags]` or `bench serve [flags]`. Implemented by hand
/// because clap's derive cannot tell a flattened optional `BenchArgs` apart from none when only the
/// nested engine flags (`--model`) are given.
#[derive(Debug, Clone)]
pub enum BenchCommand {
    /// Boxed: the offline flags are several times the size of the serve ones.
    Offline(Box<BenchArgs>),
    Serve(ServeBenchArgs),
}

impl clap::FromArgMatches for BenchCommand {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        match matches.subcommand_name() {
            Some(_) => Ok(match BenchMode::from_arg_matches(matches)? {
                BenchMode::Offline(a) => BenchCommand::Offline(a),
                BenchMode::Serve(a) => BenchCommand::Serve(a),
            }),
            None => BenchArgs::from_arg_matches(matches).map(|a| BenchCommand::Offline(Box::new(a))),
        }
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl Args for BenchCommand {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        BenchMode::augment_subcommands(BenchArgs::augment_args(cmd))
            .args_conflicts_with_subcommands(true)
            .subcommand_negates_reqs(true)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

#[derive(Debug, Clone, Subcommand)]
pub enum BenchMode {
    /// Offline throughput: prefill and decode tokens/s through the engine, no HTTP (the default).
    Offline(Box<BenchArgs>),
    /// Load generator against a running server: throughput, TTFT, TPOT and ITL percentiles.
    Serve(ServeBenchArgs),
}

pub fn dispatch(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Offline(args) => run(*args),
        BenchCommand::Serve(args) => crate::bench_serve::run(args),
    }
}

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
    /// Also measure decode with this many random LoRA adapters (0: base model only).
    #[arg(long, default_value_t = 0)]
    pub lora: usize,
    /// Rank of the random adapters (all seven projections).
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
    /// Measure on the PEFT adapters in this folder (each subfolder with an adapter_config.json, or
    /// the folder itself) instead of random ones: all of them, or the first `--lora N` by name.
    #[arg(long)]
    pub lora_dir: Option<std::path::PathBuf>,
    /// Zipf exponent of the requests' spread over the adapters (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    pub zipf_s: f64,
    /// Also measure decode with every sequence constrained to this JSON schema (structured outputs).
    /// A schema that never completes within `--decode-tokens` (e.g. an array of integers) measures
    /// steady-state decode; one that completes earlier ends its sequences early.
    #[arg(long)]
    pub json_schema: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize)]
struct DecodeFigure {
    batch: usize,
    tokens_per_second: f64,
    ms_per_step: f64,
    /// With `--lora`: the same batch size with adapters.
    #[serde(skip_serializing_if = "Option::is_none")]
    lora: Option<LoraFigure>,
    /// With `--json-schema`: the same batch size, every sequence constrained to the schema.
    #[serde(skip_serializing_if = "Option::is_none")]
    json_schema: Option<ConstrainedFigure>,
}

#[derive(Debug, Serialize)]
struct ConstrainedFigure {
    tokens_per_second: f64,
    /// Constrained throughput / unconstrained throughput at the same batch size.
    relative_to_unconstrained: f64,
}

/// One step's masks for `sequences` constrained sequences, computed on the host's thread pool.
#[derive(Debug, Serialize)]
struct MaskFigure {
    sequences: usize,
    vocab: usize,
    /// Median over the measured steps, milliseconds for all the sequences' masks.
    ms_per_step: f64,
    /// The first masks of fresh sequences.
    first_ms: f64,
    /// Mean time of one sequence's mask on a mask thread, microseconds: the step's
    /// masks on `n` free cores take about `sequences × task_us / n`.
    task_us: f64,
    /// Threads of the mask pool (`--mask-threads`; default cores - 1).
    mask_threads: usize,
    /// The step's commits (tokens consumed by the grammars), milliseconds: on the engine thread
    /// between one step's tokens and the next step's launch, so not hidden behind the device.
    commit_ms: f64,
}

/// Sequences per step whose mask time `bench --json-schema` reports (the CPU and GPU batches).
const MASK_TIMING_SEQUENCES: [usize; 2] = [32, 256];
const MASK_TIMING_STEPS: usize = 16;

#[derive(Debug, Serialize)]
struct LoraFigure {
    tokens_per_second: f64,
    /// LoRA throughput / base throughput at the same batch size.
    relative_to_base: f64,
    /// Sequences per adapter in the batch (most popular first).
    spread: Vec<usize>,
}

#[derive(Debug, Serialize)]
struct LoraSetup {
    #[serde(flatten)]
    adapters: AdapterSummary,
    zipf_s: f64,
    max_loras: usize,
}

#[derive(Debug, Serialize)]
struct BenchReport {
    model: String,
    device: String,
    backend: String,
    threads: usize,
    prompt_len: usize,
    prefill_tokens_per_second: f64,
    decode: Vec<DecodeFigure>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lora: Option<LoraSetup>,
    /// With `--json-schema`: host time of one step's masks.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    masks: Vec<MaskFigure>,
    peak_rss_mib: Option<f64>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let json = args.json;
    let report = measure(args)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn measure(args: BenchArgs) -> anyhow::Result<BenchReport> {
    let mut engine_args = args.engine.clone();
    // Every measurement uses fresh prompts; the prefix cache would only blur the prefill figure.
    engine_args.disable_prefix_caching = true;
    let max_batch = args.batch_sizes.iter().copied().max().unwrap_or(1);
    engine_args.max_num_seqs = engine_args.max_num_seqs.max(max_batch);
    engine_args.max_num_batched_tokens = engine_args.max_num_batched_tokens.max(args.prompt_len);
    // Read before the model loads, so that a bad folder fails fast and its ranks can be reserved.
    let adapters = AdapterSource::from_flags(args.lora, args.lora_rank, args.lora_dir.as_deref())?;
    adapters.reserve(&mut engine_args, true);
    let runtime = engine_args.start()?;
    let engine = &runtime.engine;
    let limits = BatchLimits {
        max_num_batched_tokens: engine_args.max_num_batched_tokens,
        max_model_len: engine.max_model_len(),
    };
    let vocab = runtime.model_config.vocab_size;
    let repeat = args.repeat.max(1);
    let mut salt = 0u64;

    // The adapters go through the same path as a served adapter: PEFT folders, loaded by name.
    let loaded = adapters.load(&runtime, args.engine.seed)?;
    let adapter_names = &loaded.names;

    let grammar = match &args.json_schema {
        Some(path) => Some(compile_schema(&runtime, path)?),
        None => None,
    };
    // Before any decode, so the engine's threads do not share the cores with it.
    let masks = match (&grammar, &runtime.tokenizer) {
        (Some(g), Some(t)) => MASK_TIMING_SEQUENCES
            .iter()
            .map(|&n| {
                let m = peregrine_engine::bench::masks::time_masks(g, t.vocab_size(), n, MASK_TIMING_STEPS);
                MaskFigure {
                    sequences: n,
                    vocab: m.vocab,
                    ms_per_step: m.step.as_secs_f64() * 1e3,
                    first_ms: m.first.as_secs_f64() * 1e3,
                    task_us: m.task.as_secs_f64() * 1e6,
                    mask_threads: m.threads,
                    commit_ms: m.commit.as_secs_f64() * 1e3,
                }
            })
            .collect(),
        _ => Vec::new(),
    };

    // Warm-up: first-touch of weights and KV pages.
    run_batch(engine, &base_only(1), 16, 2, vocab, &mut salt, None)?;

    let mut prefill = Vec::new();
    for _ in 0..repeat {
        let t = run_batch(engine, &base_only(1), args.prompt_len, 1, vocab, &mut salt, None)?;
        prefill.push(args.prompt_len as f64 / t.first_token.as_secs_f64().max(1e-9));
    }
    let mut decode = Vec::new();
    for (i, &batch) in args.batch_sizes.iter().enumerate() {
        let tps = decode_tps(engine, &base_only(batch), &args, vocab, &mut salt, None, limits)?;
        let lora = if adapter_names.is_empty() {
            None
        } else {
            let picks = zipf_assignment(batch, adapter_names.len(), args.zipf_s, 0.0, args.engine.seed + i as u64);
            let assignment: Vec<Option<String>> = picks.iter().map(|p| p.map(|a| adapter_names[a].clone())).collect();
            let mut spread = vec![0usize; adapter_names.len()];
            picks.iter().flatten().for_each(|&a| spread[a] += 1);
            let lora_tps = decode_tps(engine, &assignment, &args, vocab, &mut salt, None, limits)?;
            Some(LoraFigure { tokens_per_second: lora_tps, relative_to_base: lora_tps / tps.max(1e-9), spread })
        };
        let json_schema = match &grammar {
            None => None,
            Some(g) => {
                let constrained = decode_tps(engine, &base_only(batch), &args, vocab, &mut salt, Some(g), limits)?;
                Some(ConstrainedFigure { tokens_per_second: constrained, relative_to_unconstrained: constrained / tps.max(1e-9) })
            }
        };
        decode.push(DecodeFigure { batch, tokens_per_second: tps, ms_per_step: 1000.0 * batch as f64 / tps, lora, json_schema });
    }
    engine.shutdown();

    let report = BenchReport {
        model: args.engine.model.display().to_string(),
        device: runtime.device.as_str().to_string(),
        backend: runtime.backend_name.clone(),
        threads: args.engine.threads(),
        prompt_len: args.prompt_len,
        prefill_tokens_per_second: median(&mut prefill),
        decode,
        lora: (adapters.count() > 0).then(|| LoraSetup { adapters: adapters.summary(), zipf_s: args.zipf_s, max_loras: engine_args.max_loras }),
        masks,
        peak_rss_mib: peak_rss_mib(),
    };
    Ok(report)
}

fn print_report(report: &BenchReport) {
    {
        println!("model      {}", report.model);
        println!("device     {} (backend {}, {} threads)", report.device, report.backend, report.threads);
        println!("prefill    {:>9.1} tokens/s  (1 x {} tokens)", report.prefill_tokens_per_second, report.prompt_len);
        for d in &report.decode {
            println!("decode     {:>9.1} tokens/s  (batch {:>3}, {:.1} ms/step)", d.tokens_per_second, d.batch, d.ms_per_step);
            if let (Some(l), Some(setup)) = (&d.lora, &report.lora) {
                println!(
                    "  + LoRA   {:>9.1} tokens/s  ({:.3} x base; {}, zipf s={}, spread {:?})",
                    l.tokens_per_second,
                    l.relative_to_base,
                    setup.adapters.describe(),
                    setup.zipf_s,
                    l.spread
                );
            }
            if let Some(j) = &d.json_schema {
                println!("  + schema {:>9.1} tokens/s  ({:.3} x unconstrained)", j.tokens_per_second, j.relative_to_unconstrained);
            }
        }
        for m in &report.masks {
            println!(
                "masks      {:>9.2} ms/step   ({} sequences, {}-token vocabulary; first masks {:.2} ms; {:.1} µs per mask task, {} mask threads; commits {:.3} ms/step)",
                m.ms_per_step, m.sequences, m.vocab, m.first_ms, m.task_us, m.mask_threads, m.commit_ms
            );
        }
        match report.peak_rss_mib {
            Some(m) => println!("peak RSS   {m:>9.1} MiB"),
            None => println!("peak RSS   unknown on this platform"),
        }
    }
}

/// The schema in `path`, compiled against the model's tokenizer the way the server compiles one.
fn compile_schema(runtime: &crate::runtime::Runtime, path: &std::path::Path) -> anyhow::Result<CompiledGrammar> {
    let tokenizer = runtime.tokenizer.as_ref().ok_or_else(|| anyhow::anyhow!("--json-schema needs a model with a tokenizer"))?;
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read the --json-schema file: {e}"))?;
    let schema: serde_json::Value = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--json-schema is not JSON: {e}"))?;
    let compiler = GrammarCompiler::new(tokenizer)?;
    Ok(compiler.compile(&GrammarSpec::JsonSchema(schema))?)
}

fn base_only(batch: usize) -> Vec<Option<String>> {
    vec![None; batch]
}

/// Median decode throughput of one batch (one sequence per entry, on that adapter).
fn decode_tps(
    engine: &EngineHandle,
    adapters: &[Option<String>],
    args: &BenchArgs,
    vocab: usize,
    salt: &mut u64,
    grammar: Option<&CompiledGrammar>,
    limits: BatchLimits,
) -> anyhow::Result<f64> {
    let mut figures = Vec::new();
    let max_tokens = decode_max_tokens(adapters.len(), args, limits);
    for _ in 0..args.repeat.max(1) {
        let t = run_batch(engine, adapters, args.context_len, max_tokens, vocab, salt, grammar)?;
        if t.decode_tokens == 0 {
            anyhow::bail!(
                "batch {}: no step ran with every sequence decoding (the first finished before the last \
                 started); raise --max-num-batched-tokens or --max-model-len",
                adapters.len()
            );
        }
        figures.push(t.decode_tokens as f64 / t.decode.as_secs_f64().max(1e-9));
    }
    Ok(median(&mut figures))
}

/// The engine limits a decode measurement plans around.
#[derive(Clone, Copy)]
struct BatchLimits {
    max_num_batched_tokens: usize,
    max_model_len: usize,
}

/// Tokens each sequence of a decode measurement generates: `--decode-tokens` at the full batch,
/// plus the steps the batch's chunked prefill takes. Sequences whose prompt went in early decode
/// while later prompts still prefill; without the margin the first would finish before the last
/// started and the measurement would time a shrinking tail instead of the batch (a 256 x 1024-token
/// batch prefills over ~150 steps of 2048 tokens, longer than 128 decode tokens).
fn decode_max_tokens(batch: usize, args: &BenchArgs, limits: BatchLimits) -> usize {
    let budget = limits.max_num_batched_tokens;
    // Running decodes take one token each from a step's budget, at most `batch`.
    let prefill_per_step = budget.saturating_sub(batch).max(budget / 4).max(1);
    let prefill_steps = (batch * args.context_len).div_ceil(prefill_per_step);
    let wanted = args.decode_tokens + 1 + if batch > 1 { prefill_steps } else { 0 };
    wanted.min(limits.max_model_len.saturating_sub(args.context_len)).max(2)
}

struct BatchTiming {
    /// Submit → the last sequence's first token (the whole batch's prefill).
    first_token: Duration,
    /// The full-batch window: the last sequence's first token → the first sequence's last token,
    /// while every sequence of the batch decodes.
    decode: Duration,
    /// Tokens generated inside that window.
    decode_tokens: usize,
}

/// Runs one sequence per entry of `adapters` (None: the base model) of `prompt_len` synthetic tokens,
/// `max_tokens` each, and times them. Each stream is read on its own thread so token arrival times
/// are real.
fn run_batch(
    engine: &EngineHandle,
    adapters: &[Option<String>],
    prompt_len: usize,
    max_tokens: usize,
    vocab: usize,
    salt: &mut u64,
    grammar: Option<&CompiledGrammar>,
) -> anyhow::Result<BatchTiming> {
    let start = Instant::now();
    let mut streams = Vec::with_capacity(adapters.len());
    for adapter in adapters {
        *salt += 1;
        let params = SamplingParams { ignore_eos: true, grammar: grammar.cloned(), ..SamplingParams::greedy(max_tokens) };
        let request = GenerationRequest {
            id: engine.new_request_id(),
            prompt_tokens: synthetic_prompt(prompt_len, vocab, *salt),
            params,
            adapter: adapter.clone(),
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
    let (first, decode, decode_tokens) = full_batch_window(&arrivals, start);
    Ok(BatchTiming { first_token: first - start, decode, decode_tokens })
}

/// The window in which every sequence decodes: from the last first token to the first sequence's
/// last token, with the tokens that arrived inside it (after its start, up to its end). Returns the
/// window's start, its length and that count.
fn full_batch_window(arrivals: &[Vec<Instant>], start: Instant) -> (Instant, Duration, usize) {
    let first = arrivals.iter().filter_map(|t| t.first().copied()).max().unwrap_or(start);
    let end = arrivals.iter().filter_map(|t| t.last().copied()).min().unwrap_or(first).max(first);
    let tokens = arrivals.iter().map(|t| t.iter().filter(|&&x| x > first && x <= end).count()).sum();
    (first, end - first, tokens)
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchCommand,
    }

    fn parse(args: &[&str]) -> Result<BenchCommand, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    #[test]
    fn offline_is_the_default_and_serve_a_subcommand() {
        for args in [&["--model", "/m.gguf"][..], &["offline", "--model", "/m.gguf"]] {
            match parse(args).unwrap() {
                BenchCommand::Offline(a) => assert_eq!((a.engine.model.to_str(), a.batch_sizes.clone()), (Some("/m.gguf"), vec![1, 8, 32])),
                other => panic!("{args:?}: {other:?}"),
            }
        }
        match parse(&["serve", "--url", "http://h:1", "--request-rate", "2.5", "--num-prompts", "7"]).unwrap() {
            BenchCommand::Serve(a) => assert_eq!((a.url.as_str(), a.request_rate, a.num_prompts), ("http://h:1", 2.5, 7)),
            other => panic!("{other:?}"),
        }
        assert_eq!(parse(&["serve"]).map(|c| matches!(c, BenchCommand::Serve(a) if a.request_rate.is_infinite())).ok(), Some(true));
        assert!(parse(&[]).is_err(), "offline needs --model");
        assert!(parse(&["--model", "/m", "serve"]).is_err(), "offline flags and a subcommand conflict");
    }

    /// The decode window is the stretch where every sequence of the batch decodes: a sequence that
    /// started early and finished early bounds it, and its tokens before the last first token do
    /// not count.
    #[test]
    fn decode_window_covers_only_steps_with_the_whole_batch() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // A: tokens at 0..=10 ms; B: first token at 5 ms, then to 15 ms.
        let a: Vec<Instant> = (0..=10).map(at).collect();
        let b: Vec<Instant> = (5..=15).map(at).collect();
        let (first, len, tokens) = full_batch_window(&[a, b], t0);
        assert_eq!(first, at(5));
        assert_eq!(len, Duration::from_millis(5));
        // 6..=10 from each.
        assert_eq!(tokens, 10);
        // One sequence: its whole decode after the first token.
        let (_, len, tokens) = full_batch_window(&[(0..=4).map(at).collect()], t0);
        assert_eq!((len, tokens), (Duration::from_millis(4), 4));
    }

    /// The margin covers the batch's chunked prefill and stays within the context.
    #[test]
    fn decode_tokens_include_the_prefill_steps_of_the_batch() {
        let BenchCommand::Offline(args) = parse(&["--model", "/m", "--context-len", "1024", "--decode-tokens", "128"]).unwrap() else {
            panic!("offline")
        };
        let limits = BatchLimits { max_num_batched_tokens: 2048, max_model_len: 4096 };
        assert_eq!(decode_max_tokens(1, &args, limits), 129);
        // 256 x 1024 prompt tokens at 2048 - 256 per step: 147 steps.
        assert_eq!(decode_max_tokens(256, &args, limits), 129 + 147);
        let short = BatchLimits { max_model_len: 1200, ..limits };
        assert_eq!(decode_max_tokens(256, &args, short), 176);
    }

    /// `bench --json-schema` on a dummy-weight shape with Llama 3's vocabulary size, the stand-in
    /// tokenizer from `scripts/make-stand-in-tokenizer.py` (`--tokenizer`), on the CPU: the
    /// constrained figures and the mask timings come out, for that vocabulary.
    #[test]
    fn json_schema_bench_runs_on_a_dummy_shape_with_the_stand_in_tokenizer() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let dir = tempfile::tempdir().unwrap();
        let python = std::env::var("PEREGRINE_PYTHON").unwrap_or_else(|_| "python3".into());
        let tok_dir = dir.path().join("tokenizer");
        let status = std::process::Command::new(&python)
            .arg(root.join("scripts/make-stand-in-tokenizer.py"))
            .arg(&tok_dir)
            .status()
            .unwrap_or_else(|e| panic!("running {python}: {e}"));
        assert!(status.success(), "make-stand-in-tokenizer.py failed");
        let tok = peregrine_engine::tokenizer::Tokenizer::for_model(&tok_dir).unwrap();
        assert_eq!(tok.vocab_size(), 128_256);
        assert_eq!(tok.eos_token_ids().first(), Some(&128_001));
        assert_eq!(tok.token_to_id("<|eot_id|>"), Some(128_009));
        // Pair tokens encode like the text they stand for.
        assert_eq!(tok.decode(&tok.encode("hello world, 42").unwrap(), false).unwrap(), "hello world, 42");

        // Llama-3.1-8B's shape file, shrunk (its vocabulary and end ids kept).
        let mut shape: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(root.join("scripts/shapes/llama-3.1-8b.json")).unwrap()).unwrap();
        for (k, v) in [("hidden_size", 64), ("intermediate_size", 128), ("num_hidden_layers", 2), ("num_attention_heads", 4), ("num_key_value_heads", 2), ("head_dim", 16), ("max_position_embeddings", 1024)] {
            shape[k] = v.into();
        }
        let shape_path = dir.path().join("tiny-llama3-vocab.json");
        std::fs::write(&shape_path, shape.to_string()).unwrap();
        let schema = root.join("scripts/schemas/integer-array.json");
        let (shape_arg, tok_arg, schema_arg) = (shape_path.to_str().unwrap(), tok_dir.to_str().unwrap(), schema.to_str().unwrap());
        let args = [
            "--model", shape_arg, "--load-format", "dummy", "--device", "cpu", "--threads", "2", "--tokenizer", tok_arg,
            "--json-schema", schema_arg, "--batch-sizes", "1,4", "--repeat", "1", "--prompt-len", "8", "--context-len", "4", "--decode-tokens", "4",
        ];
        let BenchCommand::Offline(bench) = parse(&args).unwrap() else { panic!("offline") };
        let report = measure(*bench).unwrap();
        assert_eq!(report.decode.len(), 2);
        for d in &report.decode {
            let j = d.json_schema.as_ref().expect("constrained figure");
            assert!(j.tokens_per_second > 0.0 && d.tokens_per_second > 0.0);
        }
        let masks: Vec<(usize, usize)> = report.masks.iter().map(|m| (m.sequences, m.vocab)).collect();
        assert_eq!(masks, vec![(32, 128_256), (256, 128_256)]);
        assert!(report.masks.iter().all(|m| m.ms_per_step > 0.0));
    }
}

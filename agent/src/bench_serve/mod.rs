//! `peregrine-agent bench serve`: a load generator for a running server (ours or any
//! OpenAI-compatible one), in the manner of vLLM's `benchmark_serving.py`: Poisson arrivals at
//! `--request-rate` (inf: all at once), streaming `/v1/completions` with `ignore_eos` so every request
//! generates `--output-len` tokens, random-word or given prompts; prints throughput and TTFT / TPOT /
//! ITL percentiles. Runs on one thread, so on a small machine it takes as little CPU from the
//! server as possible (the Python script beside it, `scripts/bench_serve.py`, takes several times more).

pub mod client;
pub mod stats;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use rand::{Rng, SeedableRng};

use client::RequestSpec;
use stats::Summary;

/// The words random prompts are made of (one token each for most tokenizers, with the space).
const WORDS: &[&str] = &[
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye", "woman", "place",
    "work", "week", "case", "point", "government", "company", "number", "group", "problem", "fact", "river", "mountain",
    "story", "dragon", "castle", "garden", "music",
];

#[derive(Debug, Clone, Args)]
pub struct ServeBenchArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// The `model` field of each request (default: the first model `/v1/models` lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer`.
    #[arg(long, env = "PEREGRINE_BENCH_API_KEY")]
    pub api_key: Option<String>,
    /// Requests per second, with Poisson arrivals; `inf` sends them all at once.
    #[arg(long, default_value_t = f64::INFINITY)]
    pub request_rate: f64,
    #[arg(long, default_value_t = 32)]
    pub num_prompts: usize,
    /// Words per random prompt.
    #[arg(long, default_value_t = 64)]
    pub input_len: usize,
    /// `max_tokens` of every request (`ignore_eos` is set, so each generates exactly this many).
    #[arg(long, default_value_t = 64)]
    pub output_len: usize,
    /// Prompts, one per line (used in turn), instead of random words.
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Seeds the random prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print the figures as one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let summary = runtime.block_on(bench(&args))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", summary.table());
    }
    Ok(())
}

/// Runs the whole benchmark and summarizes it (failed requests are counted, not fatal).
pub async fn bench(args: &ServeBenchArgs) -> anyhow::Result<Summary> {
    if args.request_rate.is_nan() || args.request_rate <= 0.0 {
        anyhow::bail!("--request-rate must be positive (or inf)");
    }
    let base = args.url.trim_end_matches('/').to_string();
    // No proxies: the figures are about the server, and benchmarks run next to it.
    let client = reqwest::Client::builder().no_proxy().build()?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_model(&client, &base, args.api_key.as_deref()).await?,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
    let prompts = prompts(args, &mut rng)?;
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, prompt) in prompts.into_iter().enumerate() {
        if i > 0 && args.request_rate.is_finite() {
            tokio::time::sleep(poisson_gap(&mut rng, args.request_rate)).await;
        }
        let spec = RequestSpec {
            completions_url: format!("{base}/v1/completions"),
            model: model.clone(),
            prompt,
            max_tokens: args.output_len,
            api_key: args.api_key.clone(),
        };
        let client = client.clone();
        tasks.spawn(async move { client::run(&client, &spec).await });
    }
    let mut results = Vec::with_capacity(args.num_prompts);
    while let Some(joined) = tasks.join_next().await {
        results.push(joined.unwrap_or_else(|e| Err(format!("request task failed: {e}"))));
    }
    Ok(Summary::new(&results, start.elapsed()))
}

/// Exponentially distributed gap between arrivals of a Poisson process of `rate` per second.
fn poisson_gap(rng: &mut impl Rng, rate: f64) -> Duration {
    let u: f64 = rng.random();
    Duration::from_secs_f64(-(1.0 - u).ln() / rate)
}

fn prompts(args: &ServeBenchArgs, rng: &mut impl Rng) -> anyhow::Result<Vec<String>> {
    match &args.prompts_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let pool: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
            if pool.is_empty() {
                anyhow::bail!("{} has no prompts", path.display());
            }
            Ok((0..args.num_prompts).map(|i| pool[i % pool.len()].to_string()).collect())
        }
        None => Ok((0..args.num_prompts)
            .map(|_| (0..args.input_len).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" "))
            .collect()),
    }
}

async fn first_model(client: &reqwest::Client, base: &str, api_key: Option<&str>) -> anyhow::Result<String> {
    let mut request = client.get(format!("{base}/v1/models"));
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let list: serde_json::Value = request.send().await?.error_for_status()?.json().await?;
    list["data"][0]["id"]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow::anyhow!("{base}/v1/models lists no model; pass --model"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_gaps_have_the_asked_mean() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let n = 20_000;
        let mean = (0..n).map(|_| poisson_gap(&mut rng, 4.0).as_secs_f64()).sum::<f64>() / n as f64;
        assert!((mean - 0.25).abs() < 0.01, "mean gap {mean}, want 0.25 s");
    }

    #[tokio::test]
    async fn a_rate_that_is_not_positive_is_refused_before_sending() {
        for rate in [0.0, -1.0, f64::NAN] {
            let args = ServeBenchArgs {
                url: "http://127.0.0.1:1".into(),
                model: Some("m".into()),
                api_key: None,
                request_rate: rate,
                num_prompts: 1,
                input_len: 1,
                output_len: 1,
                prompts_file: None,
                seed: 0,
                json: false,
            };
            let e = bench(&args).await.unwrap_err().to_string();
            assert!(e.contains("--request-rate must be positive"), "{rate}: {e}");
        }
    }
}

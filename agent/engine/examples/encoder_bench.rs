//! Encoder throughput and latency on the CPU through the batching thread, as a server drives it:
//! `cargo run --release -p peregrine-engine --example encoder_bench -- <encoder folder> [threads]`.
//!
//! For input lengths 16/128/512 tokens (texts of repeated words, tokenized on the client threads)
//! and concurrency 1 and 64 (closed loop: each client sends its next one-sentence request when the
//! last returns), prints sequences/s, tokens/s and p50/p99 request latency.
//! `scripts/bench_sentence_transformers.py` measures Sentence-Transformers the same way.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use peregrine_engine::backend::cpu::encoder::CpuEncoder;
use peregrine_engine::encoder::{EncoderHandle, EncoderJobKind, EncoderModel, EncoderServiceConfig};

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: encoder_bench <encoder folder> [threads]")?);
    let threads: usize = args.next().map(|t| t.parse()).transpose()?.unwrap_or(2);
    let (mut model, weights) = EncoderModel::load(&path)?;
    model.set_max_seq_length(512)?;
    let backend = CpuEncoder::new(model.config.clone(), weights, threads)?;
    let model = Arc::new(model);
    let config = EncoderServiceConfig { max_num_batched_tokens: 8192 };
    let handle = EncoderHandle::start(Box::new(backend), model.clone(), config)?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "backend {} max_num_batched_tokens {} load average {}",
        handle.backend_name(),
        config.max_num_batched_tokens,
        load.split_whitespace().next().unwrap_or("?")
    );
    println!("{:>6} {:>5} {:>6} {:>10} {:>10} {:>9} {:>9}", "len", "conc", "reqs", "seq/s", "tok/s", "p50 ms", "p99 ms");
    for len in [16usize, 128, 512] {
        // "hello" is one token: [CLS] + (len - 2) words + [SEP].
        let text = "hello ".repeat(len - 2);
        assert_eq!(model.tokenizer.encode(&text, false)?.len(), len);
        // About 8k tokens per row at concurrency 64 (at least 64 requests), 1k at 1 (at least 4).
        for (conc, per_client) in [(1usize, (1024 / len).max(4)), (64, (128 / len).max(1))] {
            let warm = model.tokenizer.encode(&text, false)?;
            handle.run_blocking(vec![warm], EncoderJobKind::Embed)?;
            let t0 = Instant::now();
            let clients: Vec<_> = (0..conc)
                .map(|_| {
                    let (handle, text) = (handle.clone(), text.clone());
                    std::thread::spawn(move || -> Result<Vec<Duration>, String> {
                        let mut lat = Vec::with_capacity(per_client);
                        for _ in 0..per_client {
                            let start = Instant::now();
                            let input = handle.model().tokenizer.encode(&text, false).map_err(|e| e.to_string())?;
                            handle.run_blocking(vec![input], EncoderJobKind::Embed).map_err(|e| e.to_string())?;
                            lat.push(start.elapsed());
                        }
                        Ok(lat)
                    })
                })
                .collect();
            let mut lat = Vec::new();
            for c in clients {
                lat.extend(c.join().map_err(|_| "client panicked")??);
            }
            let wall = t0.elapsed().as_secs_f64();
            lat.sort();
            let n = lat.len();
            println!(
                "{len:>6} {conc:>5} {n:>6} {:>10.1} {:>10.0} {:>9.1} {:>9.1}",
                n as f64 / wall,
                (n * len) as f64 / wall,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99)
            );
        }
    }
    Ok(())
}

//! Encoder throughput and latency through the batching thread, as a server drives it:
//! `cargo run --release -p peregrine-engine --example encoder_bench -- <encoder folder> [threads]
//! [--device cpu|cuda] [--gemm f32|bf16] [--quantization int8] [--lens 16,128,512] [--reps N]
//! [--forward-only]` (the
//! GEMM choice is the CUDA encoder's, `--quantization int8` the CPU encoder's int8 linears; on cuda
//! each row sends 16× the CPU's requests, so that it lasts long enough to time; `--reps N` sends N×
//! as many again, for steadier figures on a noisy machine).
//!
//! For input lengths 16/128/512 tokens (texts of repeated words, tokenized on the client threads)
//! and concurrency 1 and 64 (closed loop: each client sends its next one-sentence request when the
//! last returns), prints sequences/s, tokens/s, p50/p99 request latency and the mean sequences per
//! forward (how the batching thread packed them).
//! `scripts/bench_sentence_transformers.py` measures Sentence-Transformers the same way.
//!
//! `--forward-only` times the backend alone instead: one forward over 8192 tokens (512 sequences of
//! 16, 64 of 128, 16 of 512, pre-tokenized) and the model's pooling (on the device for the CUDA
//! encoder), pooled vectors copied to the host, no batching thread or tokenization: what the device
//! does, for comparing kernels (torch's counterpart is
//! `scripts/bench_torch_encoder_gpu.py --model-only`).

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use peregrine_engine::backend::cpu::encoder::CpuEncoder;
use peregrine_engine::backend::cuda::encoder::{CudaEncoder, EncoderGemm};
use peregrine_engine::backend::EncoderBackend;
use peregrine_engine::encoder::weights::EncoderWeights;
use peregrine_engine::encoder::{EncoderHandle, EncoderJobKind, EncoderModel, EncoderServiceConfig};
use peregrine_engine::model::rowquant::RowFormat;
use peregrine_engine::plan::RaggedBatch;

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1e3
}

type BoxError = Box<dyn std::error::Error>;

/// The encoder backend asked for, and how many times the CPU's request counts to send.
fn backend(device: &str, gemm: &str, int8: bool, model: &EncoderModel, weights: EncoderWeights, threads: usize) -> Result<(Box<dyn EncoderBackend>, usize), BoxError> {
    match device {
        "cpu" => {
            let q = int8.then_some(RowFormat::Int8);
            Ok((Box::new(CpuEncoder::with_quantization(model.config.clone(), weights, threads, q)?), 1))
        }
        "cuda" if int8 => Err("--quantization int8: the CPU encoder's only".into()),
        "cuda" => {
            let gemm = match gemm {
                "f32" => EncoderGemm::F32,
                "bf16" => EncoderGemm::Bf16,
                other => return Err(format!("--gemm {other}: f32 or bf16").into()),
            };
            Ok((Box::new(CudaEncoder::new(model.config.clone(), weights, 0, gemm)?), 16))
        }
        other => Err(format!("--device {other}: cpu or cuda").into()),
    }
}

/// `--forward-only`: forwards of 8192 tokens straight on the backend, timed end to end (the
/// hidden states reach the host before the clock stops).
fn time_forwards(backend: &mut dyn EncoderBackend, model: &EncoderModel, lens: &[usize], reps: usize) -> Result<(), BoxError> {
    println!("backend {} (forward only, 8192 tokens a forward)", backend.name());
    println!("{:>6} {:>5} {:>9} {:>10} {:>11} {:>9}", "len", "seqs", "forwards", "seq/s", "tok/s", "ms/fwd");
    for &len in lens {
        let input = model.tokenizer.encode(&"hello ".repeat(len - 2), false)?;
        let seqs = (8192 / len).max(1);
        let mut batch = RaggedBatch::new();
        for _ in 0..seqs {
            batch.push(&input.ids, &input.type_ids);
        }
        let (h, modes) = (model.config.hidden_size, &model.pipeline.pooling);
        for _ in 0..3 {
            backend.forward_pooled(&batch, h, modes)?;
        }
        let forwards = 8 * reps;
        let t0 = Instant::now();
        for _ in 0..forwards {
            backend.forward_pooled(&batch, h, modes)?;
        }
        let wall = t0.elapsed().as_secs_f64();
        let done = (forwards * seqs) as f64;
        println!(
            "{len:>6} {seqs:>5} {forwards:>9} {:>10.1} {:>11.0} {:>9.3}",
            done / wall,
            done * len as f64 / wall,
            wall * 1e3 / forwards as f64
        );
    }
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let mut path = None;
    let mut threads = 2usize;
    let mut device = "cpu".to_string();
    let mut gemm = "f32".to_string();
    let mut lens = vec![16usize, 128, 512];
    let mut int8 = false;
    let mut extra_reps = 1usize;
    let mut forward_only = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => device = args.next().ok_or("--device needs cpu or cuda")?,
            "--gemm" => gemm = args.next().ok_or("--gemm needs f32 or bf16")?,
            "--quantization" => match args.next().as_deref() {
                Some("int8") => int8 = true,
                _ => return Err("--quantization: int8 (the CPU encoder's)".into()),
            },
            "--lens" => {
                let list = args.next().ok_or("--lens needs a list such as 16,128")?;
                lens = list.split(',').map(str::parse).collect::<Result<_, _>>()?;
                if lens.iter().any(|&l| !(2..=512).contains(&l)) {
                    return Err("--lens: each length in 2..=512".into());
                }
            }
            "--forward-only" => forward_only = true,
            "--reps" => extra_reps = args.next().ok_or("--reps needs a count")?.parse::<usize>()?.max(1),
            _ if path.is_none() => path = Some(PathBuf::from(a)),
            _ => threads = a.parse()?,
        }
    }
    let path = path.ok_or("usage: encoder_bench <encoder folder> [threads] [--device cpu|cuda] [--gemm f32|bf16] [--quantization int8] [--lens 16,128,512] [--reps N]")?;
    let (mut model, weights) = EncoderModel::load(&path)?;
    model.set_max_seq_length(512)?;
    let (mut backend, reps) = backend(&device, &gemm, int8, &model, weights, threads)?;
    let reps = reps * extra_reps;
    if forward_only {
        return time_forwards(backend.as_mut(), &model, &lens, reps);
    }
    let model = Arc::new(model);
    let config = EncoderServiceConfig { max_num_batched_tokens: 8192 };
    let handle = EncoderHandle::start(backend, model.clone(), config)?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "backend {} max_num_batched_tokens {} load average {}",
        handle.backend_name(),
        config.max_num_batched_tokens,
        load.split_whitespace().next().unwrap_or("?")
    );
    println!("{:>6} {:>5} {:>6} {:>10} {:>10} {:>9} {:>9} {:>9}", "len", "conc", "reqs", "seq/s", "tok/s", "p50 ms", "p99 ms", "seq/fwd");
    for len in lens {
        // "hello" is one token: [CLS] + (len - 2) words + [SEP].
        let text = "hello ".repeat(len - 2);
        assert_eq!(model.tokenizer.encode(&text, false)?.len(), len);
        // About 8k tokens per row at concurrency 64 (at least 64 requests), 1k at 1 (at least 4).
        for (conc, per_client) in [(1usize, reps * (1024 / len).max(4)), (64, reps * (128 / len).max(1))] {
            let warm = model.tokenizer.encode(&text, false)?;
            handle.run_blocking(vec![warm], EncoderJobKind::Embed)?;
            let forwards0 = handle.metrics().forwards.load(Ordering::Relaxed);
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
            let forwards = handle.metrics().forwards.load(Ordering::Relaxed) - forwards0;
            println!(
                "{len:>6} {conc:>5} {n:>6} {:>10.1} {:>10.0} {:>9.1} {:>9.1} {:>9.1}",
                n as f64 / wall,
                (n * len) as f64 / wall,
                percentile(&lat, 0.5),
                percentile(&lat, 0.99),
                n as f64 / forwards.max(1) as f64
            );
        }
    }
    Ok(())
}

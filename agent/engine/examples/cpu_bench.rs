//! Quick CPU backend throughput check:
//! `cargo run --release -p peregrine-engine --example cpu_bench -- <model.gguf> [threads]`.
//! Prints prefill tokens/s (one 512-token prompt) and decode tokens/s at batch 1, 8 and 32.

use std::path::PathBuf;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::bench;
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::model::{self, LoadFormat};

/// User+system CPU seconds of this process so far (Linux), to tell contention from slowness.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: cpu_bench <model> [threads]")?);
    let threads: usize = args.next().map(|t| t.parse()).transpose()?.unwrap_or(2);
    let loaded = model::load(&path, LoadFormat::Auto)?;
    let shape = KvCacheShape {
        num_blocks: 32 * 8 + 64,
        block_size: 16,
    };
    let mut backend = CpuBackend::new(loaded.weights, shape, threads)?;
    println!("backend {}", backend.name());
    // Warm-up (page in the weights, start the threads).
    bench::prefill(&mut backend, 16)?;
    // "cpu-bound" = tokens / (CPU seconds / threads): what the run would give with the cores to itself.
    let c0 = cpu_seconds();
    let p = bench::prefill(&mut backend, 512)?;
    let cpu = cpu_seconds() - c0;
    println!(
        "prefill 512 tokens: {:.1} tok/s ({:.3} s wall, {cpu:.2} CPU-s; cpu-bound {:.1} tok/s)",
        p.tokens_per_second(),
        p.elapsed.as_secs_f64(),
        512.0 * threads as f64 / cpu
    );
    for batch in [1usize, 8, 32] {
        let steps = 32;
        let c0 = cpu_seconds();
        // The untimed prefill of the context is included in the CPU time; subtract it.
        let d = bench::decode(&mut backend, batch, 64, steps)?;
        let total = cpu_seconds() - c0;
        let c1 = cpu_seconds();
        let ctx_only = bench::decode(&mut backend, batch, 64, 0)?;
        let ctx_cpu = cpu_seconds() - c1;
        let _ = ctx_only;
        let cpu = (total - ctx_cpu).max(1e-3);
        println!(
            "decode batch {batch:>2}: {:.1} tok/s aggregate ({:.1} ms/step wall; cpu-bound {:.1} tok/s)",
            d.tokens_per_second(),
            d.elapsed.as_secs_f64() * 1000.0 / steps as f64,
            (batch * steps) as f64 * threads as f64 / cpu
        );
    }
    Ok(())
}

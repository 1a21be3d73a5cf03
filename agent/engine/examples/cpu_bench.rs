//! Quick CPU backend throughput check:
//! `cargo run --release -p peregrine-engine --example cpu_bench -- <model.gguf> [threads]`.
//! Prints prefill tokens/s (one 512-token prompt) and decode tokens/s at batch 1, 8 and 32.

use std::path::PathBuf;

use peregrine_engine::backend::cpu::{bench, CpuBackend};
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::model::{self, LoadFormat};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = PathBuf::from(args.next().ok_or("usage: cpu_bench <model> [threads]")?);
    let threads: usize = args.next().map(|t| t.parse()).transpose()?.unwrap_or(2);
    let loaded = model::load(&path, LoadFormat::Auto)?;
    let shape = KvCacheShape { num_blocks: 32 * 8 + 64, block_size: 16 };
    let mut backend = CpuBackend::new(loaded.weights, shape, threads)?;
    println!("backend {}", backend.name());
    // Warm-up (page in the weights, start the threads).
    bench::prefill(&mut backend, 16)?;
    let p = bench::prefill(&mut backend, 512)?;
    println!("prefill 512 tokens: {:.1} tok/s ({:.3} s)", p.tokens_per_second(), p.elapsed.as_secs_f64());
    for batch in [1usize, 8, 32] {
        let d = bench::decode(&mut backend, batch, 64, 32)?;
        println!("decode batch {batch:>2}: {:.1} tok/s aggregate ({:.1} ms/step)", d.tokens_per_second(), d.elapsed.as_secs_f64() * 1000.0 / 32.0);
    }
    Ok(())
}

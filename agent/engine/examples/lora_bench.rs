//! LoRA overhead on decode: batch-32 decode steps of SmolLM2 on the CPU backend, base model vs every
//! sequence on one of 4 random rank-16 adapters (spread by Zipf s = 1). Alternates runs to even out
//! machine noise and reports the best of each.
//!
//! `cargo run --release -p peregrine-engine --example lora_bench -- [model.gguf] [batch] [rank] [adapters]`

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::bench;
use peregrine_engine::backend::KvCacheShape;
use peregrine_engine::bench::lora::{decode_with_lora, random_adapters, zipf_assignment};
use peregrine_engine::model::{self, LoadFormat};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model_path = args.get(1).cloned().unwrap_or_else(|| {
        format!(
            "{}/.cache/peregrine/SmolLM2-135M-Instruct.Q4_1.gguf",
            std::env::var("HOME").unwrap_or_default()
        )
    });
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (batch, rank, n_adapters) = (arg(2, 32), arg(3, 16), arg(4, 4));
    let (context, steps, rounds) = (64, 16, 3);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);

    let loaded = model::load(std::path::Path::new(&model_path), LoadFormat::Gguf)?;
    let config = loaded.config.clone();
    let blocks = batch * ((context + steps) / 16 + 1);
    let shape = KvCacheShape {
        num_blocks: blocks,
        block_size: 16,
    };
    let mut base = CpuBackend::new(loaded.weights.clone(), shape, threads)?;
    let mut with_lora = CpuBackend::new(loaded.weights, shape, threads)?;
    let adapters = random_adapters(&config, n_adapters, rank, 1);
    let assignment = zipf_assignment(batch, n_adapters, 1.0, 0.0, 7);
    let mut per_adapter = vec![0usize; n_adapters];
    for a in assignment.iter().flatten() {
        per_adapter[*a] += 1;
    }

    let (mut best_base, mut best_lora) = (0f64, 0f64);
    for round in 0..rounds {
        let b = bench::decode(&mut base, batch, context, steps)?.tokens_per_second();
        let l = decode_with_lora(&mut with_lora, &adapters, &assignment, context, steps)?
            .tokens_per_second();
        println!("round {round}: base {b:.1} tok/s, LoRA {l:.1} tok/s");
        best_base = best_base.max(b);
        best_lora = best_lora.max(l);
    }
    println!(
        "decode batch {batch}, {threads} threads, rank {rank}, {n_adapters} adapters (sequences per adapter {per_adapter:?}), all 7 projections:"
    );
    println!(
        "base {best_base:.1} tok/s, LoRA {best_lora:.1} tok/s, overhead {:.1}%",
        (best_base / best_lora - 1.0) * 100.0
    );
    Ok(())
}

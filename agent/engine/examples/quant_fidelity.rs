//! What 8-bit weights cost, side by side: `cargo run --release -p peregrine-engine --example
//! quant_fidelity -- [model.gguf] [reference.json] [threads]` (defaults: `PEREGRINE_TEST_MODEL` and
//! `PEREGRINE_FIXTURES/smollm2/reference.json`). For the unquantized f32 path and fp8/int8 with
//! per-row and per-tensor weight scales, activations quantized per token (W8A8, what
//! `--quantization` does) or left in floating point (W8A16, weight-only), prints mean and
//! max |Δlogit| against the reference (its top-10 ids at every position of every prompt) and top-1
//! agreement. The figures in docs/benchmarks.md come from here.

use std::path::PathBuf;

use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::KvCacheShape;
use peregrine_engine::bench::fidelity;
use peregrine_engine::model::quantize::{quantize_linear_weights_with, Granularity};
use peregrine_engine::model::rowquant::{Activations, RowFormat};
use peregrine_engine::model::{self, LoadFormat};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model_path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var("PEREGRINE_TEST_MODEL").map_err(|_| "give a model path or set PEREGRINE_TEST_MODEL")?),
    };
    let reference_path = match args.next() {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var("PEREGRINE_FIXTURES").map_err(|_| "give a reference.json or set PEREGRINE_FIXTURES")?)
            .join("smollm2/reference.json"),
    };
    let threads = args.next().and_then(|t| t.parse().ok()).unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&reference_path)?)?;
    let prompts = fidelity::prompts_from_reference(&reference)?;
    let base = model::load(&model_path, LoadFormat::Auto)?.weights;

    println!("{:<24} {:>12} {:>12} {:>8}", "weights", "mean |Δ|", "max |Δ|", "top-1");
    use Activations::{Float, PerToken};
    use Granularity::{PerRow, PerTensor};
    use RowFormat::{Fp8E4m3, Int8};
    let variants: [(&str, Option<(RowFormat, Granularity, Activations)>); 9] = [
        ("f32 (as loaded)", None),
        ("fp8 W8A8, per row", Some((Fp8E4m3, PerRow, PerToken))),
        ("fp8 W8A8, per tensor", Some((Fp8E4m3, PerTensor, PerToken))),
        ("fp8 W8A16, per row", Some((Fp8E4m3, PerRow, Float))),
        ("fp8 W8A16, per tensor", Some((Fp8E4m3, PerTensor, Float))),
        ("int8 W8A8, per row", Some((Int8, PerRow, PerToken))),
        ("int8 W8A8, per tensor", Some((Int8, PerTensor, PerToken))),
        ("int8 W8A16, per row", Some((Int8, PerRow, Float))),
        ("int8 W8A16, per tensor", Some((Int8, PerTensor, Float))),
    ];
    for (label, quant) in variants {
        let mut w = base.clone();
        if let Some((format, granularity, activations)) = quant {
            quantize_linear_weights_with(&mut w, format, granularity, activations)?;
        }
        let mut backend = CpuBackend::new(w, KvCacheShape { num_blocks: 64, block_size: 16 }, threads)?;
        let f = fidelity::measure(&mut backend, &prompts)?;
        println!(
            "{label:<24} {:>12.5} {:>12.5} {:>5}/{}",
            f.mean_abs_diff(),
            f.max_abs_diff,
            f.top1_agree,
            f.positions
        );
    }
    Ok(())
}

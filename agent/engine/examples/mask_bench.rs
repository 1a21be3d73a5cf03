//! Host time of grammar masks, alone (no model): `cargo run --example mask_bench -p peregrine-engine
//! -- <tokenizer dir> <schema.json> [sequences] [steps] [mask threads]`. For profiling the mask path with `perf`;
//! `peregrine-agent bench --json-schema` prints the same figure beside decode throughput.

use peregrine_engine::bench::masks::time_masks;
use peregrine_engine::structured::{set_mask_threads, GrammarCompiler, GrammarSpec};
use peregrine_engine::tokenizer::Tokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(tok_dir), Some(schema)) = (args.get(1), args.get(2)) else {
        return Err("usage: mask_bench <tokenizer dir> <schema.json> [sequences] [steps] [mask threads]".into());
    };
    let sequences: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(256);
    let steps: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(16);
    if let Some(threads) = args.get(5) {
        set_mask_threads(threads.parse()?);
    }
    let tokenizer = Tokenizer::for_model(std::path::Path::new(tok_dir))?;
    let t = std::time::Instant::now();
    let compiler = GrammarCompiler::new(&tokenizer)?;
    println!("token trie and slices: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let spec = GrammarSpec::JsonSchema(serde_json::from_str(&std::fs::read_to_string(schema)?)?);
    let grammar = compiler.compile(&spec).map_err(|e| e.0)?;
    for _ in 0..3 {
        let m = time_masks(&grammar, tokenizer.vocab_size(), sequences, steps);
        println!(
            "{sequences} sequences, {} tokens: {:.2} ms/step (median of {steps}), first masks {:.2} ms; {:.1} us per mask task on {} mask threads; commits {:.3} ms/step",
            m.vocab,
            m.step.as_secs_f64() * 1e3,
            m.first.as_secs_f64() * 1e3,
            m.task.as_secs_f64() * 1e6,
            m.threads,
            m.commit.as_secs_f64() * 1e3
        );
    }
    Ok(())
}

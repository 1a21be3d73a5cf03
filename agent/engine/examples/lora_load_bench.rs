//! A new LoRA adapter from disk to host memory, without a GPU: writes one random adapter (all seven
//! projections) shaped for a base model as a PEFT folder in a temporary folder, then times
//! `LoraAdapter::load` (read + digest + parse + validate, values kept in the file's width)
//! `repeats` times and prints each time, the median and the best, in ms and MB/s of the
//! safetensors file. The files were just written, so the figures are warm-cache ones; with `cold`
//! the adapter's two files (only they) are dropped from the page cache before each load
//! (`dd iflag=nocache count=0`, i.e. `posix_fadvise(DONTNEED)`), so each load reads the disk.
//!
//! `cargo run --release -p peregrine-engine --example lora_load_bench -- [shape.json] [rank] [f32|bf16] [repeats] [warm|cold]`
//!
//! Default: `scripts/shapes/llama-3.1-8b.json`, rank 32, f32 (what `bench::lora::write_random_adapters`
//! writes, and so what `peregrine-agent throughput --lora` loads), 5 repeats.

use std::path::{Path, PathBuf};
use std::time::Instant;

use peregrine_engine::lora::adapter::content_digest;
use peregrine_engine::lora::{save_peft, LoraAdapter, RandomAdapterSpec};
use peregrine_engine::model::hf_config::parse_hf_config;

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> AnyResult<()> {
    let args: Vec<String> = std::env::args().collect();
    let shape = args.get(1).map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/shapes/llama-3.1-8b.json")
    });
    let rank: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(32);
    let dtype = args.get(3).map(String::as_str).unwrap_or("f32").to_string();
    let repeats: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
    let cold = match args.get(5).map(String::as_str) {
        None | Some("warm") => false,
        Some("cold") => true,
        Some(other) => return Err(format!("{other:?}: warm or cold").into()),
    };
    if dtype != "f32" && dtype != "bf16" {
        return Err(format!("dtype {dtype:?}: f32 or bf16").into());
    }
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&shape)?)?;
    let config = parse_hf_config(&json)?;

    let scratch = tempfile::tempdir()?;
    let folder = scratch.path().join("adapter");
    eprintln!(
        "writing a random rank-{rank} {dtype} adapter on all 7 projections of a {}-layer model ({}) ...",
        config.num_hidden_layers,
        shape.display()
    );
    let t = Instant::now();
    let adapter = LoraAdapter::random(&config, &RandomAdapterSpec::new(rank, 7));
    let params = adapter.size_bytes() / 4;
    save_peft(&adapter, &folder)?;
    if dtype == "bf16" {
        rewrite_as_bf16(&folder.join("adapter_model.safetensors"))?;
    }
    drop(adapter);
    let file_bytes = std::fs::metadata(folder.join("adapter_model.safetensors"))?.len() as f64;
    eprintln!(
        "written in {:.1} s: {:.1} M parameters, adapter_model.safetensors {:.1} MB",
        t.elapsed().as_secs_f64(),
        params as f64 / 1e6,
        file_bytes / 1e6
    );

    let threads = rayon::current_num_threads();
    // The floor of a load on any number of cores: the content digest is one SHA-256 over both files.
    let (config_bytes, weights_bytes) = (
        std::fs::read(folder.join("adapter_config.json"))?,
        std::fs::read(folder.join("adapter_model.safetensors"))?,
    );
    let t = Instant::now();
    std::hint::black_box(content_digest(&config_bytes, &weights_bytes));
    let digest_ms = t.elapsed().as_secs_f64() * 1e3;
    drop((config_bytes, weights_bytes));
    eprintln!("the SHA-256 content digest alone, one thread, from memory: {digest_ms:.1} ms");
    let cpu_before = process_cpu_seconds();
    let mut times = Vec::with_capacity(repeats);
    let cache = if cold { "cold cache" } else { "warm cache" };
    for i in 0..repeats {
        if cold {
            for file in ["adapter_config.json", "adapter_model.safetensors"] {
                drop_from_page_cache(&folder.join(file))?;
            }
        }
        let t = Instant::now();
        let loaded = LoraAdapter::load(&folder, &config, rank)?;
        let s = t.elapsed().as_secs_f64();
        std::hint::black_box(&loaded);
        drop(loaded);
        eprintln!("load {}/{repeats}: {:.1} ms, {:.0} MB/s", i + 1, s * 1e3, file_bytes / s / 1e6);
        times.push(s);
    }
    let cpu_ms = cpu_before
        .zip(process_cpu_seconds())
        .map(|(a, b)| format!("{:.0} ms", (b - a) / repeats as f64 * 1e3))
        .unwrap_or_else(|| "unknown".into());
    times.sort_by(f64::total_cmp);
    let (median, best) = (times[times.len() / 2], times[0]);
    println!(
        "LoraAdapter::load, rank {rank} {dtype}, {:.1} M params ({:.1} MB file), {threads} threads, {cache}: median {:.1} ms ({:.0} MB/s), best {:.1} ms ({:.0} MB/s), {repeats} runs; CPU time (all threads) per load {cpu_ms}; the digest alone {digest_ms:.1} ms",
        params as f64 / 1e6,
        file_bytes / 1e6,
        median * 1e3,
        file_bytes / median / 1e6,
        best * 1e3,
        file_bytes / best / 1e6
    );
    Ok(())
}

/// User + system CPU seconds of this process (all threads) from `/proc/self/stat`, if readable.
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces) in parentheses: utime and stime are
    // the 12th and 13th, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

/// Asks the kernel to drop `path`'s pages from the page cache (this file only).
fn drop_from_page_cache(path: &Path) -> AnyResult<()> {
    let status = std::process::Command::new("dd")
        .arg(format!("if={}", path.display()))
        .args(["iflag=nocache", "count=0", "status=none"])
        .status()?;
    if !status.success() {
        return Err(format!("dd iflag=nocache failed on {}", path.display()).into());
    }
    Ok(())
}

/// Rewrites an f32 safetensors file with every tensor in bf16 (round to nearest even).
fn rewrite_as_bf16(path: &Path) -> AnyResult<()> {
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype, SafeTensors};
    let bytes = std::fs::read(path)?;
    let st = SafeTensors::deserialize(&bytes)?;
    let mut converted: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let data: Vec<u8> = view
            .data()
            .chunks_exact(4)
            .flat_map(|c| half::bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])).to_le_bytes())
            .collect();
        converted.push((name, view.shape().to_vec(), data));
    }
    let views = converted
        .iter()
        .map(|(name, shape, data)| TensorView::new(Dtype::BF16, shape.clone(), data).map(|v| (name.clone(), v)))
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::write(path, safetensors::serialize(views, None)?)?;
    Ok(())
}

//! CUDA backend figures on a Llama-3.1-8B-shaped model with random bf16 weights made on the GPU:
//! HBM bandwidth, batch-1 and batch-64 decode (128 prompt + 128 new tokens), prefill 1 x 2048 and
//! 8 x 512, TTFT of a 2048-token prompt. `cargo build --release --example cuda_bench`, run on a GPU.
//! Optional argument: decode steps (default 128). CUDA_BENCH_KV=fp8 runs with an fp8 KV cache;
//! CUDA_BENCH_QUANT=fp8|int8 with 8-bit decoder linears (`--quantization`, made on the GPU).

use peregrine_engine::backend::cuda::{bench, CudaBackend, CudaOptions, KvCacheDtype, WeightInit};
use peregrine_engine::model::rowquant::RowFormat;

fn main() {
    if let Err(e) = run() {
        eprintln!("cuda_bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> peregrine_engine::Result<()> {
    let steps: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(128);
    let config = bench::llama31_8b();
    // PEREGRINE_CUDA_GRAPHS=0 runs decode without graphs; PEREGRINE_GEMV=0 keeps decode GEMMs on cuBLAS.
    let graphs = std::env::var("PEREGRINE_CUDA_GRAPHS").map_or(true, |v| v != "0");
    // CUDA_BENCH_BATCHES=1,16,64,256,1024 chooses the decode batch sizes (default 1,16,64).
    let batches: Vec<usize> = std::env::var("CUDA_BENCH_BATCHES")
        .ok()
        .map(|v| v.split(',').filter_map(|b| b.trim().parse().ok()).filter(|&b| b > 0).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| vec![1, 16, 64]);
    let opts = CudaOptions {
        max_model_len: 2304,
        max_num_batched_tokens: 4096.max(batches.iter().copied().max().unwrap_or(0)),
        max_num_seqs: 256.max(batches.iter().copied().max().unwrap_or(0)),
        cuda_graph_max_batch: if graphs { 256 } else { 0 },
        kv_cache_dtype: if std::env::var("CUDA_BENCH_KV").is_ok_and(|v| v == "fp8") { KvCacheDtype::Fp8E4m3 } else { KvCacheDtype::Bf16 },
        quantization: match std::env::var("CUDA_BENCH_QUANT").as_deref() {
            Ok("fp8") => Some(RowFormat::Fp8E4m3),
            Ok("int8") => Some(RowFormat::Int8),
            Ok("") | Ok("bf16") | Err(_) => None,
            Ok(other) => return Err(peregrine_engine::EngineError::InvalidRequest(format!("CUDA_BENCH_QUANT={other}: fp8, int8 or bf16"))),
        },
        ..CudaOptions::default()
    };
    let t0 = std::time::Instant::now();
    let mut b = CudaBackend::new(WeightInit::Random { config, seed: 1 }, &opts)?;
    println!("device: {} ({}), init {:.1} s", b.device_name(), peregrine_engine::backend::Backend::name(&b), t0.elapsed().as_secs_f64());
    let bw = bench::hbm_bandwidth(&b)?;
    let bytes = bench::decode_weight_bytes(&b);
    let bound = bw / bytes as f64;
    println!("HBM copy bandwidth: {:.0} GB/s; weight bytes per decode step: {:.2} GB; bound {:.1} tokens/s", bw / 1e9, bytes as f64 / 1e9, bound);
    // Warm-up (kernel load, cuBLAS heuristics, first-touch of the KV cache).
    bench::decode(&mut b, 1, 16, 4, 4096)?;
    let on = |var: &str| std::env::var(var).map_or(true, |v| v != "0");
    println!(
        "cuda graphs: {graphs}, skinny GEMM: {}, PDL (sm_90+): {}, KV cache: {:?}, linears: {}",
        on("PEREGRINE_GEMV"),
        // On by default on sm_90+ as Kernels::load decides it (this line said "false" unless
        // PEREGRINE_PDL=1 was set, long after PDL became the default).
        on("PEREGRINE_PDL"),
        opts.kv_cache_dtype,
        opts.quantization.map_or("bf16", |f| f.name())
    );
    for &batch in &batches {
        let f = bench::decode(&mut b, batch, 128, steps, 4096)?;
        let extra = if batch == 1 { format!(", {:.1}% of the bandwidth bound", 100.0 * f.tokens_per_second() / bound) } else { String::new() };
        let idle = f.gpu_idle.map_or(String::new(), |i| format!(", GPU idle {:.1}% of wall time", 100.0 * i));
        println!("{}: {:.1} tokens/s ({:.2} ms/step){extra}{idle}", f.name, f.tokens_per_second(), 1e3 * f.seconds / steps as f64);
    }
    bench::prefill(&mut b, 1, 512, 4096)?;
    for (seqs, len) in [(1usize, 2048usize), (8, 512)] {
        let f = bench::prefill(&mut b, seqs, len, 4096)?;
        println!("{}: {:.0} tokens/s ({:.1} ms)", f.name, f.tokens_per_second(), 1e3 * f.seconds);
    }
    println!("TTFT 2048-token prompt: {:.1} ms", 1e3 * bench::ttft(&mut b, 2048)?);
    Ok(())
}

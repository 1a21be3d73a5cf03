//! Micro-benchmarks of the decode-critical kernels on Llama-3.1-8B shapes (run on a GPU):
//! skinny GEMM vs cuBLAS at m = 1 (achieved GB/s of weight reads) and decode attention with and
//! without the sequence split, the grouped LoRA kernels (`MICRO=lora`), and the row-wise FP8 GEMV
//! against the bf16 one (`MICRO=fp8`), the 8-bit tensor-core GEMMs against cuBLAS bf16 (`MICRO=w8`),
//! SiLU·mul with its 8-bit quantization with and without the online Walsh–Hadamard of
//! `--quantization-rotation` (`MICRO=silu`), and what LoRA's o and down cost inside the base GEMM
//! and the norm (`MICRO=fused`: the GEMM over the weight with every slot's A rows appended, and
//! `add_rmsnorm_lora` against `add_rmsnorm`).
//! Prints a table; asserts nothing.

use peregrine_kernels::cudarc::driver::sys::CUevent_flags;
use peregrine_kernels::ops::{AttentionKernel, AttnOutQuant, Gemv8Kernel};
use peregrine_kernels::{Cuda, KvCacheDtype, OutType, W8Format};

/// Median seconds per call of `f` over `reps` timings. Each timing brackets `MICRO_INNER` calls
/// (default 1, as every figure in docs/benchmarks.md up to session 20) with two events: with one, a
/// short kernel's time includes the host's launch latency; with several back to back, launches
/// overlap the kernels before them and the figure approaches the GPU's time per call.
fn time<F: FnMut()>(c: &Cuda, reps: usize, mut f: F) -> f64 {
    f();
    let inner = std::env::var("MICRO_INNER").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1).max(1);
    // `MICRO_REPS=1`: one timing per figure (a short ncu capture sees every kernel a few times).
    let reps = std::env::var("MICRO_REPS").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(reps).max(1);
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let mut ts = vec![];
    for _ in 0..reps {
        let (a, b) = (c.gpu.ctx.new_event(flags).unwrap(), c.gpu.ctx.new_event(flags).unwrap());
        a.record(&c.gpu.stream).unwrap();
        for _ in 0..inner {
            f();
        }
        b.record(&c.gpu.stream).unwrap();
        b.synchronize().unwrap();
        ts.push(a.elapsed_ms(&b).unwrap() as f64 * 1e-3 / inner as f64);
    }
    ts.sort_by(|x, y| x.total_cmp(y));
    ts[ts.len() / 2]
}

fn main() {
    let c = match Cuda::new(0) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("micro: {e}");
            std::process::exit(1);
        }
    };
    let s = &c.gpu.stream;
    // MICRO=attention times the attention kernels only; MICRO=lora the grouped LoRA kernels.
    if std::env::var("MICRO").is_ok_and(|v| v == "attention") {
        attention(&c);
        return;
    }
    if std::env::var("MICRO").is_ok_and(|v| v == "lora") {
        lora(&c);
        return;
    }
    if std::env::var("MICRO").is_ok_and(|v| v == "fp8") {
        fp8(&c);
        return;
    }
    if std::env::var("MICRO").is_ok_and(|v| v == "w8") {
        w8(&c);
        return;
    }
    if std::env::var("MICRO").is_ok_and(|v| v == "silu") {
        silu(&c);
        return;
    }
    if std::env::var("MICRO").is_ok_and(|v| v == "fused") {
        fused_norms(&c);
        return;
    }
    println!("{:<20} {:>7} {:>9} {:>9}  {}", "m=1 GEMM [n x k]", "MB", "plan GB/s", "cuBLAS", "GB/s by (unroll, warps per row)");
    for (n, k) in [(6144usize, 4096usize), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)] {
        // Several weight copies, rotated, so repeated runs do not read from L2 (50 MB on H100/H200).
        let copies = (400_000_000 / (n * k * 2)).clamp(2, 8);
        let ws: Vec<_> = (0..copies).map(|_| c.gpu.alloc_zeros::<u16>(n * k).unwrap()).collect();
        for (i, w) in ws.iter().enumerate() {
            unsafe { c.kernels.fill_uniform_bf16(s, w.ptr(), n * k, i as u64, 0.02).unwrap() };
        }
        let x = c.gpu.alloc_zeros::<u16>(k).unwrap();
        unsafe { c.kernels.fill_uniform_bf16(s, x.ptr(), k, 99, 1.0).unwrap() };
        let y = c.gpu.alloc_zeros::<f32>(n).unwrap();
        let mut i = 0;
        let mb = (n * k * 2) as f64 / 1e6;
        let mut gbs = |unroll: usize, wpr: usize| {
            let t = time(&c, 30, || {
                i += 1;
                unsafe { c.kernels.gemv_with(s, y.ptr(), false, x.ptr(), ws[i % copies].ptr(), 1, n, k, unroll, wpr).unwrap() };
            });
            mb / 1e3 / t
        };
        let (pu, pw) = peregrine_kernels::Kernels::gemv_plan(n, k);
        let plan = gbs(pu, pw);
        let mut sweep = String::new();
        for unroll in [8usize, 16] {
            for wpr in [1usize, 2, 4, 8] {
                sweep.push_str(&format!(" ({unroll},{wpr}) {:.0}", gbs(unroll, wpr)));
            }
        }
        let tb = time(&c, 30, || {
            i += 1;
            unsafe { c.blas.matmul(y.ptr(), OutType::Bf16, x.ptr(), ws[i % copies].ptr(), 1, n, k, 0.0).unwrap() };
        });
        println!("{:<20} {:>7.1} {:>9.0} {:>9.0} {sweep}  [plan ({pu},{pw})]", format!("[{n} x {k}]"), mb, plan, mb / 1e3 / tb);
    }
    // cuBLAS GEMMs at the row counts of batched decode and prefill steps: TFLOP/s.
    println!("{:<20} {}", "GEMM [n x k]", "TFLOP/s by m");
    for (n, k) in [(6144usize, 4096usize), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)] {
        let w = c.gpu.alloc_zeros::<u16>(n * k).unwrap();
        unsafe { c.kernels.fill_uniform_bf16(s, w.ptr(), n * k, 5, 0.02).unwrap() };
        let mut line = format!("{:<20}", format!("[{n} x {k}]"));
        for m in [64usize, 256, 1000, 1024, 4096, 16384] {
            let x = c.gpu.alloc_zeros::<u16>(m * k).unwrap();
            unsafe { c.kernels.fill_uniform_bf16(s, x.ptr(), m * k, 6, 1.0).unwrap() };
            let y = c.gpu.alloc_zeros::<u16>(m * n).unwrap();
            let t = time(&c, 10, || unsafe { c.blas.matmul(y.ptr(), OutType::Bf16, x.ptr(), w.ptr(), m, n, k, 0.0).unwrap() });
            line += &format!(" m={m}: {:.0}", (2 * m * n * k) as f64 / t / 1e12);
        }
        println!("{line}");
    }
    attention(&c);
}

/// Decode (one token; batched), and prefill attention, every kernel and cache type.
fn attention(c: &Cuda) {
    // Decode attention: 1 token, 32 q heads over 8 KV heads, d 128, block 16.
    let (hq, hkv, d, bs) = (32usize, 8usize, 128usize, 16usize);
    // MICRO_ATTN=batched: only the batched decode shapes (what a profiler is pointed at).
    let batched_only = std::env::var("MICRO_ATTN").is_ok_and(|v| v == "batched");
    let single_ctxs: &[usize] = if batched_only { &[] } else { &[256, 2048, 8192] };
    for &ctx in single_ctxs {
        let blocks = ctx.div_ceil(bs);
        let kc = c.gpu.alloc_zeros::<u16>(blocks * hkv * bs * d).unwrap();
        let vc = c.gpu.alloc_zeros::<u16>(blocks * hkv * bs * d).unwrap();
        unsafe {
            c.kernels.fill_uniform_bf16(&c.gpu.stream, kc.ptr(), kc.len(), 1, 1.0).unwrap();
            c.kernels.fill_uniform_bf16(&c.gpu.stream, vc.ptr(), vc.len(), 2, 1.0).unwrap();
        }
        let table: Vec<i32> = (0..blocks as i32).collect();
        let bt = c.gpu.upload(&table).unwrap();
        let pos = c.gpu.upload(&[ctx as i32 - 1]).unwrap();
        let seq = c.gpu.upload(&[0i32]).unwrap();
        let q = c.gpu.alloc_zeros::<u16>(hq * d).unwrap();
        unsafe { c.kernels.fill_uniform_bf16(&c.gpu.stream, q.ptr(), hq * d, 3, 1.0).unwrap() };
        let out = c.gpu.alloc_zeros::<u16>(hq * d).unwrap();
        let parts = c.gpu.alloc_zeros::<f32>(c.kernels.attention_partials_len()).unwrap();
        let mut line = format!("decode attention ctx {ctx:>5} (KV {:.1} MB, split x{}):", (2 * kc.len() * 2) as f64 / 1e6, c.kernels.attention_splits(1, hkv));
        for (kernel, kv) in attention_variants(c) {
            let s = &c.gpu.stream;
            let run = |p: Option<u64>| unsafe {
                c.kernels.paged_attention_with(kernel, s, out.ptr(), q.ptr(), kc.ptr(), vc.ptr(), bt.ptr(), blocks, seq.ptr(), pos.ptr(), 1, 1, hq, hkv, d, bs, p, kv, AttnOutQuant::NONE).unwrap()
            };
            let t1 = time(c, 30, || run(None));
            let t2 = time(c, 30, || run(Some(parts.ptr())));
            line += &format!("  {} {:.1} us unsplit, {:.1} us split", label(kernel, kv), t1 * 1e6, t2 * 1e6);
        }
        println!("{line}");
    }
    // Batched decode attention (what long-context serving runs): `seqs` tokens, each at the end of
    // its own `ctx`-token sequence, both kernels; GB/s of K/V read.
    for (seqs, ctx) in [(64usize, 1024usize), (256, 1024), (200, 1500), (1000, 192)] {
        let per = ctx.div_ceil(bs);
        let blocks = seqs * per;
        let kc = c.gpu.alloc_zeros::<u16>(blocks * hkv * bs * d).unwrap();
        let vc = c.gpu.alloc_zeros::<u16>(blocks * hkv * bs * d).unwrap();
        unsafe {
            c.kernels.fill_uniform_bf16(&c.gpu.stream, kc.ptr(), kc.len(), 4, 1.0).unwrap();
            c.kernels.fill_uniform_bf16(&c.gpu.stream, vc.ptr(), vc.len(), 5, 1.0).unwrap();
        }
        let table: Vec<i32> = (0..blocks as i32).collect();
        let bt = c.gpu.upload(&table).unwrap();
        let pos = c.gpu.upload(&vec![ctx as i32 - 1; seqs]).unwrap();
        let seq = c.gpu.upload(&(0..seqs as i32).collect::<Vec<_>>()).unwrap();
        let q = c.gpu.alloc_zeros::<u16>(seqs * hq * d).unwrap();
        unsafe { c.kernels.fill_uniform_bf16(&c.gpu.stream, q.ptr(), seqs * hq * d, 6, 1.0).unwrap() };
        let out = c.gpu.alloc_zeros::<u16>(seqs * hq * d).unwrap();
        let parts = c.gpu.alloc_zeros::<f32>(c.kernels.attention_partials_len()).unwrap();
        let kv_bytes = (2 * seqs * ctx * hkv * d * 2) as f64;
        let mut line = format!("batched decode attention {seqs} x ctx {ctx} (KV {:.0} MB in bf16):", kv_bytes / 1e6);
        for (kernel, kv) in attention_variants(c) {
            let s = &c.gpu.stream;
            let t = time(c, 20, || unsafe {
                c.kernels
                    .paged_attention_with(kernel, s, out.ptr(), q.ptr(), kc.ptr(), vc.ptr(), bt.ptr(), per, seq.ptr(), pos.ptr(), seqs, seqs, hq, hkv, d, bs, Some(parts.ptr()), kv, AttnOutQuant::NONE)
                    .unwrap()
            });
            // GB/s of the bytes this cache type really reads.
            let read = kv_bytes / 2.0 * kv.head_bytes(d) as f64 / d as f64;
            line += &format!("  {} {:.1} us = {:.0} GB/s", label(kernel, kv), t * 1e6, read / t / 1e9);
        }
        println!("{line}");
    }
    if batched_only {
        return;
    }
    // Prefill attention: `seqs` fresh prompts of `len` tokens in one launch (causal), every kernel;
    // TFLOP/s counts the causal half of q·k and p·V (4 flops per query head, key and head dim).
    for (seqs, len) in [(1usize, 2048usize), (8, 512), (64, 128)] {
        let per = len.div_ceil(bs);
        let blocks = seqs * per;
        let n = seqs * len;
        let kc = c.gpu.alloc_zeros::<u16>(blocks * hkv * bs * d).unwrap();
        let vc = c.gpu.alloc_zeros::<u16>(blocks * hkv * bs * d).unwrap();
        unsafe {
            c.kernels.fill_uniform_bf16(&c.gpu.stream, kc.ptr(), kc.len(), 7, 1.0).unwrap();
            c.kernels.fill_uniform_bf16(&c.gpu.stream, vc.ptr(), vc.len(), 8, 1.0).unwrap();
        }
        let table: Vec<i32> = (0..blocks as i32).collect();
        let bt = c.gpu.upload(&table).unwrap();
        let pos = c.gpu.upload(&(0..n).map(|i| (i % len) as i32).collect::<Vec<_>>()).unwrap();
        let seq = c.gpu.upload(&(0..n).map(|i| (i / len) as i32).collect::<Vec<_>>()).unwrap();
        let q = c.gpu.alloc_zeros::<u16>(n * hq * d).unwrap();
        unsafe { c.kernels.fill_uniform_bf16(&c.gpu.stream, q.ptr(), n * hq * d, 9, 1.0).unwrap() };
        let out = c.gpu.alloc_zeros::<u16>(n * hq * d).unwrap();
        let flops = (seqs * len * (len + 1) / 2 * hq * d * 4) as f64;
        let mut line = format!("prefill attention {seqs} x {len} tokens:");
        for (kernel, kv) in attention_variants(c) {
            let s = &c.gpu.stream;
            let t = time(c, 10, || unsafe {
                c.kernels
                    .paged_attention_with(kernel, s, out.ptr(), q.ptr(), kc.ptr(), vc.ptr(), bt.ptr(), per, seq.ptr(), pos.ptr(), n, 0, hq, hkv, d, bs, None, kv, AttnOutQuant::NONE)
                    .unwrap()
            });
            line += &format!("  {} {:.1} us = {:.1} TFLOP/s", label(kernel, kv), t * 1e6, flops / t / 1e12);
        }
        println!("{line}");
    }
}

/// Every attention kernel on a bf16 cache, and the tensor-core kernel on an fp8 cache (scale 1 and
/// per-head scales) where the GPU serves one (the fp8 runs read the same buffers as bytes: the values
/// are not meaningful, the timing is).
fn attention_variants(c: &Cuda) -> Vec<(AttentionKernel, KvCacheDtype)> {
    let mut v = vec![(AttentionKernel::WarpPerKey, KvCacheDtype::Bf16), (AttentionKernel::Tiled, KvCacheDtype::Bf16), (AttentionKernel::Mma, KvCacheDtype::Bf16)];
    if c.kernels.fp8_kv_ready() {
        v.push((AttentionKernel::Mma, KvCacheDtype::Fp8E4m3));
        v.push((AttentionKernel::Mma, KvCacheDtype::Fp8E4m3PerHead));
        v.push((AttentionKernel::Mma, KvCacheDtype::Int8PerHead));
    }
    v
}

fn label(kernel: AttentionKernel, kv: KvCacheDtype) -> String {
    match kv {
        KvCacheDtype::Bf16 => format!("{kernel:?}"),
        KvCacheDtype::Fp8E4m3 => format!("{kernel:?}-fp8"),
        KvCacheDtype::Fp8E4m3PerHead => format!("{kernel:?}-fp8s"),
        KvCacheDtype::Int8PerHead => format!("{kernel:?}-i8s"),
    }
}

/// The grouped LoRA path of one Llama-3.1-8B layer (q|k|v, o, gate|up, down groups) at decode batch
/// sizes, adapters assigned round-robin, against the base GEMMs of the same layer (skinny GEMM at m ≤ 8,
/// cuBLAS above), in µs; "x32" is the LoRA cost of a whole step (32 layers).
fn lora(c: &Cuda) {
    use peregrine_kernels::ops::{lora_max_tiles, lora_rank_pad, lora_splits, LoraModule, LoraScratch, LoraSegments};
    let s = &c.gpu.stream;
    let (h, q, kv, inter) = (4096usize, 4096usize, 1024usize, 14336usize);
    // (fan-in, fan-outs) per group.
    let groups: [(usize, Vec<usize>); 4] = [(h, vec![q, kv, kv]), (q, vec![h]), (h, vec![inter, inter]), (inter, vec![h])];
    println!("{:<10} {:>5} {:>5} {:>9} {:>9} {:>9} {:>9} {:>8} {:>11} {:>11}", "LoRA", "batch", "rank", "qkv us", "o us", "gate_up", "down", "x32 ms", "qkv shrink", "qkv expand");
    let mut halves_rows = Vec::new();
    let mut swiglu_rows = Vec::new();
    // `MICRO_LORA_CONFIGS=16x32,4x32`: only those (adapters x rank) configurations (for ncu runs).
    let configs: Vec<(usize, usize)> = std::env::var("MICRO_LORA_CONFIGS")
        .ok()
        .map(|v| v.split(',').filter_map(|c| c.trim().split_once('x')).filter_map(|(a, r)| Some((a.parse().ok()?, r.parse().ok()?))).collect())
        .unwrap_or_else(|| vec![(4usize, 32usize), (4, 8), (4, 64), (16, 32)]);
    for (adapters, rank) in configs {
        let r_pad = lora_rank_pad(rank);
        let bufs: Vec<Vec<(peregrine_kernels::DevBuf<u16>, peregrine_kernels::DevBuf<u16>)>> = groups
            .iter()
            .map(|(k, outs)| {
                outs.iter()
                    .map(|&o| {
                        let a = c.gpu.alloc_zeros::<u16>(adapters * r_pad * k).unwrap();
                        let b = c.gpu.alloc_zeros::<u16>(adapters * o * r_pad).unwrap();
                        unsafe {
                            c.kernels.fill_uniform_bf16(s, a.ptr(), adapters * r_pad * k, 1, 0.02).unwrap();
                            c.kernels.fill_uniform_bf16(s, b.ptr(), adapters * o * r_pad, 2, 0.02).unwrap();
                        }
                        (a, b)
                    })
                    .collect()
            })
            .collect();
        let ranks = c.gpu.upload(&vec![rank as i32; adapters]).unwrap();
        let scales = c.gpu.upload(&vec![1.0f32; adapters]).unwrap();
        let seg = c.gpu.alloc_zeros::<i32>(adapters + 1).unwrap();
        // `MICRO_LORA_TOKENS=4096,16384`: other step sizes; `MICRO_LORA_SEGMENTS=1`: each adapter's
        // tokens contiguous (prefill: whole sequences) instead of interleaved.
        let sizes: Vec<usize> = std::env::var("MICRO_LORA_TOKENS").ok().map(|v| v.split(',').filter_map(|t| t.trim().parse().ok()).collect()).unwrap_or_else(|| vec![1, 16, 64, 256, 4096]);
        let contiguous = std::env::var("MICRO_LORA_SEGMENTS").is_ok_and(|v| v == "1");
        for &n in &sizes {
            let slot_of = |i: usize| if contiguous { i * adapters / n } else { i % adapters };
            let slots = c.gpu.upload(&(0..n).map(|i| slot_of(i) as i32).collect::<Vec<_>>()).unwrap();
            let order = c.gpu.alloc_zeros::<i32>(n).unwrap();
            let counters = c.gpu.alloc_zeros::<i32>(3 * lora_max_tiles(n, adapters)).unwrap();
            let tiles = c.gpu.alloc_zeros::<i32>(1 + 2 * lora_max_tiles(n, adapters)).unwrap();
            let x = c.gpu.alloc_zeros::<u16>(n * inter).unwrap();
            unsafe { c.kernels.fill_uniform_bf16(s, x.ptr(), n * inter, 3, 1.0).unwrap() };
            let y = c.gpu.alloc_zeros::<u16>(n * 2 * inter).unwrap();
            let t_part = c.gpu.alloc_zeros::<f32>(lora_splits(inter) * n * 3 * r_pad).unwrap();
            let t_hi = c.gpu.alloc_zeros::<u16>(n * 3 * r_pad).unwrap();
            let t_lo = c.gpu.alloc_zeros::<u16>(n * 3 * r_pad).unwrap();
            let segs = LoraSegments { slots: slots.ptr(), order: order.ptr(), seg: seg.ptr(), tiles: tiles.ptr(), ranks: ranks.ptr(), scales: scales.ptr(), num_slots: adapters };
            let work = LoraScratch { t_part: t_part.ptr(), t_hi: t_hi.ptr(), t_lo: t_lo.ptr(), counters: counters.ptr() };
            unsafe { c.kernels.lora_group(s, &segs, n).unwrap() };
            let mut us = vec![];
            let mut halves = vec![];
            let mut qkv_halves = (0.0, 0.0);
            for (g, (k, outs)) in groups.iter().enumerate() {
                let mut col = 0;
                let modules: Vec<LoraModule> = outs
                    .iter()
                    .zip(&bufs[g])
                    .map(|(&o, (a, b))| {
                        let m = LoraModule { a: a.ptr(), b: b.ptr(), out: o, col };
                        col += o;
                        m
                    })
                    .collect();
                let t = time(c, 20, || unsafe { c.kernels.lora_apply(s, y.ptr(), col, x.ptr(), *k, *k, &modules, r_pad, &segs, &work, n).unwrap() });
                us.push(t * 1e6);
                let shrink = time(c, 20, || unsafe { c.kernels.lora_shrink(s, x.ptr(), *k, *k, &modules, r_pad, &segs, &work, n).unwrap() });
                let expand = time(c, 20, || unsafe { c.kernels.lora_expand(s, y.ptr(), col, &modules, r_pad, &segs, &work, n).unwrap() });
                if g == 0 {
                    qkv_halves = (shrink * 1e6, expand * 1e6);
                }
                if g == 2 {
                    // After the shrink: SwiGLU with the updates added in place first, against the
                    // fused kernel that leaves gate|up alone (what large bf16 steps take).
                    let act = c.gpu.alloc_zeros::<u16>(n * inter).unwrap();
                    let in_place = time(c, 20, || unsafe {
                        c.kernels.lora_expand(s, y.ptr(), col, &modules, r_pad, &segs, &work, n).unwrap();
                        c.kernels.silu_mul(s, act.ptr(), y.ptr(), n, inter, None).unwrap()
                    });
                    let fused = time(c, 20, || unsafe {
                        c.kernels.silu_mul_unslotted(s, act.ptr(), y.ptr(), n, inter, slots.ptr()).unwrap();
                        c.kernels.lora_expand_swiglu(s, act.ptr(), y.ptr(), inter, &modules[0], &modules[1], r_pad, &segs, &work, n).unwrap()
                    });
                    swiglu_rows.push((adapters, n, rank, in_place * 1e6, fused * 1e6));
                }
                halves.push((shrink * 1e6, expand * 1e6));
            }
            let group_us = time(c, 20, || unsafe { c.kernels.lora_group(s, &segs, n).unwrap() }) * 1e6;
            let step_ms = (us.iter().sum::<f64>() * 32.0 + group_us) / 1e3;
            println!(
                "{:<10} {:>5} {:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>11.1} {:>11.1}",
                format!("{adapters} adapters"),
                n,
                rank,
                us[0],
                us[1],
                us[2],
                us[3],
                step_ms,
                qkv_halves.0,
                qkv_halves.1
            );
            halves_rows.push((adapters, n, rank, halves));
        }
    }
    // Each group's shrink and expand launched alone (no PDL overlap between them): where a step's
    // LoRA time goes.
    println!("{:<10} {:>5} {:>5} {:>17} {:>17} {:>17} {:>17}", "alone", "batch", "rank", "qkv shr/exp", "o shr/exp", "gate_up shr/exp", "down shr/exp");
    for (adapters, n, rank, h) in halves_rows {
        let cell = |i: usize| format!("{:.1}/{:.1}", h[i].0, h[i].1);
        println!("{:<10} {:>5} {:>5} {:>17} {:>17} {:>17} {:>17}", format!("{adapters} adapters"), n, rank, cell(0), cell(1), cell(2), cell(3));
    }
    // Gate|up's expand and SwiGLU (every token with an adapter), in place + silu_mul against fused.
    println!("{:<10} {:>5} {:>5} {:>22} {:>10}", "SwiGLU", "batch", "rank", "expand + silu_mul us", "fused us");
    for (adapters, n, rank, in_place, fused) in swiglu_rows {
        println!("{:<10} {:>5} {:>5} {:>22.1} {:>10.1}", format!("{adapters} adapters"), n, rank, in_place, fused);
    }
}

/// The 8-bit W8A8 GEMVs (weights with per-row scales, activations quantized per token first) against
/// the bf16 GEMV at m = 1..16 on the Llama-3.1-8B projection shapes: microseconds per call and GB/s
/// of weight bytes read (bf16: 2 bytes per weight, 8-bit: 1; the bound is the HBM bandwidth). e4m3 on
/// the CUDA cores (gemv_fp8.cu) and on the tensor cores (gemv_mma8.cu), int8 on the tensor cores.
fn fp8(c: &Cuda) {
    let s = &c.gpu.stream;
    if !c.kernels.fp8_gemm_ready() {
        println!("fp8: this GPU has no e4m3 conversions (compute capability below 8.9)");
        return;
    }
    println!(
        "{:<18} {:>3} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "[n x k]", "m", "bf16 us", "bf16 GB/s", "quant us", "e4m3c us", "e4m3c GB/s", "e4m3t us", "e4m3t GB/s", "i8t us"
    );
    for (n, k) in [(6144usize, 4096usize), (4096, 4096), (28672, 4096), (4096, 14336)] {
        let copies = (400_000_000 / (n * k * 2)).clamp(2, 8);
        let wb: Vec<_> = (0..copies).map(|_| c.gpu.alloc_zeros::<u16>(n * k).unwrap()).collect();
        for (i, w) in wb.iter().enumerate() {
            unsafe { c.kernels.fill_uniform_bf16(s, w.ptr(), n * k, i as u64, 0.02).unwrap() };
        }
        // 8-bit weights: arbitrary codes below e4m3's NaN (0x7F/0xFF), row scales of 1/448.
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 37 % 0x7E) as u8).collect();
        let w8: Vec<_> = (0..copies).map(|_| c.gpu.upload(&codes).unwrap()).collect();
        let ws = c.gpu.upload(&vec![1.0f32 / 448.0; n]).unwrap();
        for m in [1usize, 2, 4, 8, 16] {
            let x = c.gpu.alloc_zeros::<u16>(m * k).unwrap();
            unsafe { c.kernels.fill_uniform_bf16(s, x.ptr(), m * k, 99, 1.0).unwrap() };
            let xq = c.gpu.alloc_zeros::<u8>(m * k).unwrap();
            let xs = c.gpu.alloc_zeros::<f32>(m).unwrap();
            let y = c.gpu.alloc_zeros::<u16>(m * n).unwrap();
            let mut i = 0;
            let tb = time(c, 30, || {
                i += 1;
                unsafe { c.linear(y.ptr(), OutType::Bf16, x.ptr(), wb[i % copies].ptr(), m, n, k).unwrap() };
            });
            let tq = time(c, 30, || unsafe { c.kernels.quant_rows_e4m3(s, xq.ptr(), xs.ptr(), x.ptr(), m, k).unwrap() });
            let mut gemv8 = |kernel: Gemv8Kernel, format: W8Format| {
                time(c, 30, || {
                    i += 1;
                    unsafe { c.kernels.gemv_w8_with(kernel, s, format, y.ptr(), false, xq.ptr(), xs.ptr(), w8[i % copies].ptr(), ws.ptr(), m, n, k).unwrap() };
                })
            };
            let tc = gemv8(Gemv8Kernel::CudaCores, W8Format::E4m3);
            let tt = gemv8(Gemv8Kernel::TensorCores, W8Format::E4m3);
            let ti = gemv8(Gemv8Kernel::TensorCores, W8Format::I8);
            let gbs = |t: f64| (n * k) as f64 / t / 1e9;
            println!(
                "{:<18} {m:>3} {:>9.1} {:>9.0} {:>9.1} {:>9.1} {:>9.0} {:>9.1} {:>9.0} {:>9.1}",
                format!("[{n} x {k}]"),
                tb * 1e6,
                (n * k * 2) as f64 / tb / 1e9,
                tq * 1e6,
                tc * 1e6,
                gbs(tc),
                tt * 1e6,
                gbs(tt),
                ti * 1e6
            );
        }
    }
}

/// The row-wise 8-bit GEMMs (gemm_w8a8.cu, e4m3 and int8, prefill-sized m) against cuBLAS's bf16
/// GEMM on the Llama-3.1-8B projection shapes, and the 8-bit GEMVs at m = 1, 16 (the decode rows
/// they take): microseconds per call and TFLOP/s (GEMM) or GB/s of weight bytes (GEMV).
fn w8(c: &Cuda) {
    let s = &c.gpu.stream;
    let formats: Vec<W8Format> = [W8Format::E4m3, W8Format::I8].into_iter().filter(|&f| c.kernels.w8_ready(f)).collect();
    // e4m3: `linear_w8` (cuBLASLt above 16 rows where the library is there) and our gemm_w8a8 alone.
    // `MICRO_W8_M=256,1100`: those step sizes only; `MICRO_W8_INT8_ONLY=1`: the int8 column only.
    let ms: Vec<usize> = std::env::var("MICRO_W8_M").ok().map(|v| v.split(',').filter_map(|t| t.trim().parse().ok()).collect()).unwrap_or_else(|| vec![1, 16, 64, 128, 256, 512, 2048]);
    let int8_only = std::env::var("MICRO_W8_INT8_ONLY").is_ok();
    println!("{:<18} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}", "[n x k]", "m", "bf16 us", "bf16 TF/s", "e4m3 us", "e4m3 TF/s", "ours us", "int8 us", "int8 TF/s");
    // `MICRO_W8_SHAPES=6528x4096,4224x4096`: those [n x k] only (a fused LoRA weight's extra rows).
    let shapes: Vec<(usize, usize)> = std::env::var("MICRO_W8_SHAPES")
        .ok()
        .map(|v| v.split(',').filter_map(|t| t.split_once('x').and_then(|(n, k)| Some((n.trim().parse().ok()?, k.trim().parse().ok()?)))).collect())
        .unwrap_or_else(|| vec![(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]);
    for (n, k) in shapes {
        let wb = c.gpu.alloc_zeros::<u16>(n * k).unwrap();
        unsafe { c.kernels.fill_uniform_bf16(s, wb.ptr(), n * k, 1, 0.02).unwrap() };
        let wq = c.gpu.alloc_zeros::<u8>(n * k).unwrap();
        let ws = c.gpu.alloc_zeros::<f32>(n).unwrap();
        for &m in &ms {
            let x = c.gpu.alloc_zeros::<u16>(m * k).unwrap();
            unsafe { c.kernels.fill_uniform_bf16(s, x.ptr(), m * k, 99, 1.0).unwrap() };
            let y = c.gpu.alloc_zeros::<u16>(m * n).unwrap();
            let mut ours = f64::NAN;
            let tb = if int8_only { f64::NAN } else { time(c, 20, || unsafe { c.linear(y.ptr(), OutType::Bf16, x.ptr(), wb.ptr(), m, n, k).unwrap() }) };
            let mut cols = vec![];
            for &f in &[W8Format::E4m3, W8Format::I8] {
                if !formats.contains(&f) || (int8_only && f == W8Format::E4m3) {
                    cols.push((f64::NAN, f64::NAN));
                    continue;
                }
                let xq = c.gpu.alloc_zeros::<u8>(m * k).unwrap();
                let xs = c.gpu.alloc_zeros::<f32>(m).unwrap();
                // Real codes for both operands: the bf16 values quantized per row.
                unsafe { c.kernels.quant_rows(s, f, wq.ptr(), ws.ptr(), wb.ptr(), n, k).unwrap() };
                unsafe { c.kernels.quant_rows(s, f, xq.ptr(), xs.ptr(), x.ptr(), m, k).unwrap() };
                let t = time(c, 20, || unsafe { c.linear_w8(f, y.ptr(), OutType::Bf16, xq.ptr(), xs.ptr(), wq.ptr(), ws.ptr(), m, n, k).unwrap() });
                if f == W8Format::E4m3 && m > peregrine_kernels::ops::GEMV_FP8_MAX_M {
                    ours = time(c, 20, || unsafe { c.kernels.gemm_w8a8(s, f, y.ptr(), false, xq.ptr(), xs.ptr(), wq.ptr(), ws.ptr(), m, n, k).unwrap() });
                }
                cols.push((t, 2.0 * (m * n * k) as f64 / t / 1e12));
            }
            println!(
                "{:<18} {m:>5} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                format!("[{n} x {k}]"),
                tb * 1e6,
                2.0 * (m * n * k) as f64 / tb / 1e12,
                cols[0].0 * 1e6,
                cols[0].1,
                ours * 1e6,
                cols[1].0 * 1e6,
                cols[1].1
            );
        }
    }
}

/// `silu_mul_quant` (int8) at Llama-3.1-8B's and SmolLM2's intermediate sizes, plain and with
/// down_proj's online rotation: what the rotation adds to each layer's step.
fn silu(c: &Cuda) {
    let s = &c.gpu.stream;
    if !c.kernels.w8_ready(W8Format::I8) {
        println!("int8 kernels not ready on this GPU");
        return;
    }
    println!("{:<8} {:>6} {:>6} {:>10} {:>10} {:>7}", "inter", "block", "m", "plain us", "rotated us", "ratio");
    for (inter, block) in [(14336usize, 2048usize), (1536, 512)] {
        for m in [1usize, 16, 64, 256, 2048] {
            let gu = c.gpu.alloc_zeros::<u16>(m * 2 * inter).unwrap();
            unsafe { c.kernels.fill_uniform_bf16(s, gu.ptr(), m * 2 * inter, 3, 2.0).unwrap() };
            let out = c.gpu.alloc_zeros::<u16>(m * inter).unwrap();
            let q = c.gpu.alloc_zeros::<u8>(m * inter).unwrap();
            let sc = c.gpu.alloc_zeros::<f32>(m).unwrap();
            let run = |had: Option<usize>| time(c, 50, || unsafe { c.kernels.silu_mul_quant(s, W8Format::I8, out.ptr(), q.ptr(), sc.ptr(), gu.ptr(), m, inter, None, None, had).unwrap() });
            let (plain, rotated) = (run(None), run(Some(block)));
            println!("{inter:<8} {block:>6} {m:>6} {:>10.2} {:>10.2} {:>7.2}", plain * 1e6, rotated * 1e6, rotated / plain);
        }
    }
}

/// `MICRO=fused`: the pieces of LoRA's o and down inside the step's own launches (cuda/lora.rs,
/// FusedNorms), Llama-3.1-8B shape, 4 adapters of rank 32: the base GEMM with and without every
/// slot's A rows appended (N 4096 -> 4224), and the residual add + RMSNorm with and without the
/// expand, at decode batch sizes (each figure: MICRO_INNER launches back to back).
fn fused_norms(c: &Cuda) {
    use peregrine_kernels::ops::{lora_max_tiles, lora_rank_pad, KvRotation, LoraSegments, OuterScale, RopeCache, RopeTables};
    let s = &c.gpu.stream;
    let (h, slots, r_pad) = (4096usize, 4usize, lora_rank_pad(32));
    let extra = slots * r_pad;
    // Registers and spilled bytes a thread: what bounds the blocks an SM holds.
    for (name, regs, local) in c.kernels.fused_lora_resources().unwrap() {
        println!("{name:<34} {regs:>4} registers, {local} B local a thread");
    }
    println!("{:<34} {:>6} {:>10}", "fused o/down pieces", "batch", "us");
    for k in [4096usize, 14336] {
        let copies = 4;
        let ws: Vec<_> = (0..copies).map(|_| c.gpu.alloc_zeros::<u16>((h + extra) * k).unwrap()).collect();
        for (i, w) in ws.iter().enumerate() {
            unsafe { c.kernels.fill_uniform_bf16(s, w.ptr(), (h + extra) * k, i as u64, 0.02).unwrap() };
        }
        for m in [64usize, 256] {
            let x = c.gpu.alloc_zeros::<u16>(m * k).unwrap();
            unsafe { c.kernels.fill_uniform_bf16(s, x.ptr(), m * k, 7, 1.0).unwrap() };
            let y = c.gpu.alloc_zeros::<u16>(m * (h + extra)).unwrap();
            for n_out in [h, h + extra] {
                let mut i = 0;
                let t = time(c, 50, || {
                    i = (i + 1) % copies;
                    unsafe { c.linear(y.ptr(), OutType::Bf16, x.ptr(), ws[i].ptr(), m, n_out, k).unwrap() };
                });
                println!("{:<34} {:>6} {:>10.2}", format!("GEMM k {k} n {n_out}"), m, t * 1e6);
            }
        }
    }
    for m in [16usize, 64, 256] {
        let residual = c.gpu.alloc_zeros::<f32>(m * h).unwrap();
        let y = c.gpu.alloc_zeros::<u16>(m * (h + extra)).unwrap();
        let b = c.gpu.alloc_zeros::<u16>(slots * h * r_pad).unwrap();
        let weight = c.gpu.upload(&vec![1.0f32; h]).unwrap();
        let out = c.gpu.alloc_zeros::<u16>(m * h).unwrap();
        unsafe {
            c.kernels.fill_uniform_bf16(s, y.ptr(), m * (h + extra), 3, 0.5).unwrap();
            c.kernels.fill_uniform_bf16(s, b.ptr(), slots * h * r_pad, 4, 0.02).unwrap();
        }
        let slot_of: Vec<i32> = (0..m).map(|i| (i % slots) as i32).collect();
        let (slot_buf, order, seg) = (c.gpu.upload(&slot_of).unwrap(), c.gpu.alloc_zeros::<i32>(m).unwrap(), c.gpu.alloc_zeros::<i32>(slots + 1).unwrap());
        let tiles = c.gpu.alloc_zeros::<i32>(1 + 2 * lora_max_tiles(m, slots)).unwrap();
        let (ranks, scales) = (c.gpu.upload(&vec![32i32; slots]).unwrap(), c.gpu.upload(&vec![1.0f32; slots]).unwrap());
        let segs = LoraSegments { slots: slot_buf.ptr(), order: order.ptr(), seg: seg.ptr(), tiles: tiles.ptr(), ranks: ranks.ptr(), scales: scales.ptr(), num_slots: slots };
        unsafe { c.kernels.lora_group(s, &segs, m).unwrap() };
        let plain = time(c, 50, || unsafe { c.kernels.add_rmsnorm(s, residual.ptr(), Some(y.ptr()), weight.ptr(), out.ptr(), None, m, h, 1e-5, None, None).unwrap() });
        println!("{:<34} {:>6} {:>10.2}", "add_rmsnorm", m, plain * 1e6);
        let inter = 14336usize;
        let gu = c.gpu.alloc_zeros::<u16>(m * 2 * (inter + extra)).unwrap();
        let (bg, bu, act) = (c.gpu.alloc_zeros::<u16>(slots * inter * r_pad).unwrap(), c.gpu.alloc_zeros::<u16>(slots * inter * r_pad).unwrap(), c.gpu.alloc_zeros::<u16>(m * inter).unwrap());
        unsafe {
            c.kernels.fill_uniform_bf16(s, gu.ptr(), m * 2 * (inter + extra), 5, 0.5).unwrap();
            c.kernels.fill_uniform_bf16(s, bg.ptr(), slots * inter * r_pad, 6, 0.02).unwrap();
            c.kernels.fill_uniform_bf16(s, bu.ptr(), slots * inter * r_pad, 7, 0.02).unwrap();
        }
        let plain = time(c, 50, || unsafe { c.kernels.silu_mul(s, act.ptr(), gu.ptr(), m, inter, None).unwrap() });
        println!("{:<34} {:>6} {:>10.2}", "silu_mul", m, plain * 1e6);
        if c.kernels.silu_mul_lora_fits(inter) {
            let fused = time(c, 50, || unsafe { c.kernels.silu_mul_lora(s, act.ptr(), gu.ptr(), 2 * (inter + extra), inter, bg.ptr(), bu.ptr(), &segs, m, r_pad).unwrap() });
            println!("{:<34} {:>6} {:>10.2}", "silu_mul_lora (4 slots x r32)", m, fused * 1e6);
            // Each count of work tiles per block (the line above: the one the kernel picks).
            for tpb in [1usize, 2, 4] {
                let t = time(c, 50, || unsafe { c.kernels.silu_mul_lora_tiles(s, act.ptr(), gu.ptr(), 2 * (inter + extra), inter, bg.ptr(), bu.ptr(), &segs, m, r_pad, tpb).unwrap() });
                println!("{:<34} {:>6} {:>10.2}", format!("  {tpb} tiles per block"), m, t * 1e6);
            }
        }
        if c.kernels.add_rmsnorm_lora_fits(h) {
            let fused = time(c, 50, || unsafe { c.kernels.add_rmsnorm_lora(s, residual.ptr(), y.ptr(), h + extra, b.ptr(), weight.ptr(), out.ptr(), &segs, m, h, 1e-5, r_pad).unwrap() });
            println!("{:<34} {:>6} {:>10.2}", "add_rmsnorm_lora (4 slots x r32)", m, fused * 1e6);
            // Over 8-bit weights: the 8-bit norm alone (scales left by the GEMM), and the fused one
            // with the deferred scales on y and u and the row quantized.
            if c.kernels.w8_ready(W8Format::E4m3) {
                let (xq, xs, ws) = (c.gpu.alloc_zeros::<u8>(m * h).unwrap(), c.gpu.upload(&vec![0.01f32; m]).unwrap(), c.gpu.upload(&vec![0.01f32; h + extra]).unwrap());
                let scale = OuterScale::bf16(xs.ptr(), ws.ptr());
                let t = time(c, 50, || unsafe { c.kernels.add_rmsnorm_quant(s, W8Format::E4m3, residual.ptr(), Some(y.ptr()), weight.ptr(), out.ptr(), xq.ptr(), xs.ptr(), m, h, 1e-5, None, Some(scale)).unwrap() });
                println!("{:<34} {:>6} {:>10.2}", "add_rmsnorm_quant e4m3 (scaled)", m, t * 1e6);
                let t = time(c, 50, || unsafe { c.kernels.add_rmsnorm_lora_quant(s, W8Format::E4m3, residual.ptr(), y.ptr(), h + extra, Some(scale), b.ptr(), weight.ptr(), out.ptr(), xq.ptr(), xs.ptr(), &segs, m, h, 1e-5, r_pad).unwrap() });
                println!("{:<34} {:>6} {:>10.2}", "add_rmsnorm_lora_quant e4m3", m, t * 1e6);
            }
        }
        // RoPE + KV write of Llama-3.1-8B's q|k|v (32 + 8 + 8 heads of 128), plain and with q|k|v's
        // expand fused in (rope_kv_write_lora).
        let (hq, hkv, d, bs) = (32usize, 8usize, 128usize, 16usize);
        let width = (hq + 2 * hkv) * d;
        let qkv = c.gpu.alloc_zeros::<u16>(m * (width + 3 * extra)).unwrap();
        let bq = c.gpu.alloc_zeros::<u16>(slots * hq * d * r_pad).unwrap();
        let bkv = c.gpu.alloc_zeros::<u16>(slots * hkv * d * r_pad).unwrap();
        unsafe {
            c.kernels.fill_uniform_bf16(s, qkv.ptr(), m * (width + 3 * extra), 8, 0.5).unwrap();
            c.kernels.fill_uniform_bf16(s, bq.ptr(), slots * hq * d * r_pad, 9, 0.02).unwrap();
            c.kernels.fill_uniform_bf16(s, bkv.ptr(), slots * hkv * d * r_pad, 10, 0.02).unwrap();
        }
        let positions = c.gpu.upload(&(0..m as i32).map(|i| 128 + i % 64).collect::<Vec<_>>()).unwrap();
        let cache_slots = c.gpu.upload(&(0..m as i32).map(|i| i * bs as i32).collect::<Vec<_>>()).unwrap();
        let (cos, sin) = (c.gpu.upload(&vec![0.6f32; 256 * d / 2]).unwrap(), c.gpu.upload(&vec![0.8f32; 256 * d / 2]).unwrap());
        let q_out = c.gpu.alloc_zeros::<u16>(m * hq * d).unwrap();
        let (kc, vc) = (c.gpu.alloc_zeros::<u16>(m * hkv * bs * d).unwrap(), c.gpu.alloc_zeros::<u16>(m * hkv * bs * d).unwrap());
        let plain = time(c, 50, || unsafe {
            c.kernels
                .rope_kv_write(s, qkv.ptr(), None, positions.ptr(), cos.ptr(), sin.ptr(), cache_slots.ptr(), q_out.ptr(), kc.ptr(), vc.ptr(), m, hq, hkv, d, bs, KvCacheDtype::Bf16, KvRotation::None, None, None)
                .unwrap()
        });
        println!("{:<34} {:>6} {:>10.2}", "rope_kv_write", m, plain * 1e6);
        if c.kernels.rope_kv_write_lora_fits(d) {
            let rope = RopeTables { positions: positions.ptr(), cos: cos.ptr(), sin: sin.ptr() };
            let cache = RopeCache { cache_slots: cache_slots.ptr(), q_out: q_out.ptr(), k_cache: kc.ptr(), v_cache: vc.ptr(), hq, hkv, d, block_size: bs };
            let fused = time(c, 50, || unsafe { c.kernels.rope_kv_write_lora(s, qkv.ptr(), width + 3 * extra, None, rope, cache, [bq.ptr(), bkv.ptr(), bkv.ptr()], &segs, m, r_pad, None).unwrap() });
            println!("{:<34} {:>6} {:>10.2}", "rope_kv_write_lora (4 slots x r32)", m, fused * 1e6);
            let (xs, ws) = (c.gpu.upload(&vec![0.01f32; m]).unwrap(), c.gpu.upload(&vec![0.01f32; width + 3 * extra]).unwrap());
            let scale = Some(OuterScale::bf16(xs.ptr(), ws.ptr()));
            let t = time(c, 50, || unsafe { c.kernels.rope_kv_write_lora(s, qkv.ptr(), width + 3 * extra, None, rope, cache, [bq.ptr(), bkv.ptr(), bkv.ptr()], &segs, m, r_pad, scale).unwrap() });
            println!("{:<34} {:>6} {:>10.2}", "rope_kv_write_lora_scaled", m, t * 1e6);
        }
    }
}

//! The Hadamard rotation of q and k on the GPU (`CudaOptions::kv_hadamard`, fused into
//! `rope_kv_write`) against the CPU backend's rotation (`hadamard::rotate`, the reference), on
//! SmolLM2 at every position of the fixture prompts:
//! - bf16 cache, rotated: the GPU's logits equal the CPU's rotated f32 logits within the bf16
//!   tolerance `cuda_smollm2.rs` uses against transformers (|Δ| ≤ 0.75 on the CPU's top-10, mean ≤ 0.15);
//! - fp8 cache, rotated: equal to the CPU computing with the same e4m3 values of the rotated k
//!   (`KvFormat { fp8, fp8, hadamard }`) within `cuda_smollm2.rs`'s fp8 tolerance (2.0 / 0.5), and
//!   different from the unrotated fp8 cache (the rotation really ran);
//! - the same two with v rotated too (`kv_hadamard_v`, `--kv-cache-dtype fp8-hadamard-qkv`: v
//!   rotated in `rope_kv_write`, each head of the attention output rotated back by `hadamard_heads`)
//!   against the CPU's `KvFormat { hadamard, hadamard_v }`, with the same bounds; the fp8 one must
//!   differ from the q/k-only rotation (v's rotation really ran, and was undone).
//! Both run the decode path (steps of single-token sequences, replayed from CUDA graphs) and a
//! prefill chunk.
//! - the fp8 cache with one scale per token and KV head against the CPU with the same values, and
//!   (unrotated) closer to the f32 cache than scale 1.
//! - the int8 cache (a scale per token and KV head) against the CPU with the same values, and
//!   closer to the f32 cache than the per-head fp8 one.
//! Skipped with a visible message where no GPU (or, for fp8, no sm_89+) is usable.

mod common;
mod cuda_common;

use cuda_common::{gpu_or_skip, report};
use peregrine_engine::backend::cpu::kv_cache::{KvElem, KvFormat};
use peregrine_engine::backend::cpu::CpuBackend;
use peregrine_engine::backend::cuda::{CudaBackend, CudaOptions, KvCacheDtype, WeightInit};
use peregrine_engine::backend::{Backend, KvCacheShape};
use peregrine_engine::bench::fidelity::{self, Fidelity};
use peregrine_engine::model::{self, LoadFormat, ModelWeights};

const BLOCK: usize = 16;

fn gpu(w: &ModelWeights, kv: KvCacheDtype, hadamard: bool) -> Option<CudaBackend> {
    gpu_rotated(w, kv, hadamard, false)
}

fn gpu_rotated(w: &ModelWeights, kv: KvCacheDtype, hadamard: bool, hadamard_v: bool) -> Option<CudaBackend> {
    let opts = CudaOptions {
        num_blocks: Some(64),
        block_size: BLOCK,
        max_model_len: 512,
        max_num_batched_tokens: 64,
        max_num_seqs: 64,
        kv_cache_dtype: kv,
        kv_hadamard: hadamard,
        kv_hadamard_v: hadamard_v,
        ..CudaOptions::default()
    };
    match CudaBackend::new(WeightInit::Host(w), &opts) {
        Ok(b) => Some(b),
        Err(e) if kv != KvCacheDtype::Bf16 && e.to_string().contains("--kv-cache-dtype") && std::env::var_os("PEREGRINE_REQUIRE_FP8").is_none() => {
            report(&format!("skipped: {e}"));
            None
        }
        Err(e) => panic!("CUDA backend: {e}"),
    }
}

/// Every position's logits of every fixture prompt: all positions of a prompt in one step (one
/// single-token sequence each, the decode kernels), then the whole prompt as one prefill chunk (its
/// last row).
fn rows(b: &mut dyn Backend) -> Vec<Vec<f32>> {
    let reference = common::reference();
    let mut out = Vec::new();
    for p in reference["prompts"].as_array().unwrap() {
        let ids = cuda_common::u32s(&p["input_ids"]);
        fidelity::for_each_position(b, &ids, 64, |_, row| out.push(row.to_vec())).unwrap();
        let table: Vec<u32> = (0..ids.len().div_ceil(BLOCK) as u32).collect();
        out.push(b.forward(&cuda_common::one_seq(&ids, 0, table)).unwrap().row(0).to_vec());
    }
    out
}

/// |Δ| over `want`'s top-10 ids at every row, and top-1 agreement.
fn compare(got: &[Vec<f32>], want: &[Vec<f32>]) -> Fidelity {
    let mut f = Fidelity::default();
    for (g, w) in got.iter().zip(want) {
        assert!(g.iter().all(|v| v.is_finite()), "non-finite GPU logits");
        let ids = fidelity::top_k(w, 10);
        let vals: Vec<f32> = ids.iter().map(|&i| w[i as usize]).collect();
        f.add(g, &ids, &vals);
    }
    f
}

fn weights() -> ModelWeights {
    model::load(&common::model_path(), LoadFormat::Gguf).expect("load GGUF").weights
}

fn cpu_rows(w: &ModelWeights, format: KvFormat) -> Vec<Vec<f32>> {
    let mut cpu = CpuBackend::new(w.clone(), KvCacheShape { num_blocks: 64, block_size: BLOCK }, 4).unwrap();
    cpu.set_kv_format(format).unwrap();
    rows(&mut cpu)
}

/// The GPU's logits with `kv` rotated as `v` says (q/k always) against the CPU's `want` format,
/// reported; None where this GPU cannot keep `kv`.
fn rotated_vs_cpu(w: &ModelWeights, kv: KvCacheDtype, v: bool, want: KvFormat) -> Option<(Vec<Vec<f32>>, Fidelity)> {
    let mut g = gpu_rotated(w, kv, true, v)?;
    let got = rows(&mut g);
    drop(g);
    let f = compare(&got, &cpu_rows(w, want));
    let what = if v { "hadamard q/k/v" } else { "hadamard q/k" };
    report(&format!("cuda {kv:?} KV + {what} vs cpu {}: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", want.label(), f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    Some((got, f))
}

/// bf16 cache: the rotation is exact in real arithmetic, so `cuda_smollm2.rs`'s bf16 bound holds; with
/// v rotated, v's rotation and the output's rotation back add two bf16 roundings per layer, while a
/// missing or doubled inverse rotation scrambles every head's output and moves the logits far more.
fn bf16_case(v: bool) {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some((_, f)) = rotated_vs_cpu(&w, KvCacheDtype::Bf16, v, KvFormat { hadamard: true, hadamard_v: v, ..KvFormat::F32 }) else { return };
    assert!(f.max_abs_diff <= 0.75 && f.mean_abs_diff() <= 0.15, "{f:?}");
}

/// fp8 cache against the CPU with the same e4m3 values, and different from the cache without this
/// option's last rotation (v's, or q/k's): it really ran.
fn fp8_case(v: bool) {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let want = KvFormat { hadamard_v: v, ..KvFormat::both(KvElem::Fp8E4m3, true) };
    let Some((got, f)) = rotated_vs_cpu(&w, KvCacheDtype::Fp8E4m3, v, want) else { return };
    // Bounds from the H100 (2026-11-25, q/k): max |Δ| 2.027, mean 0.291, top-1 40/42 — 1.5× those, as
    // the W8A8 tests' bounds. Both sides round K and V to e4m3 but at different points (the GPU's
    // bf16 intermediates), and on SmolLM2 one code step moves a logit by units; a wrong rotation
    // (or none on one side) moves every logit far more (the bf16 test holds to 0.75). With v rotated
    // the CPU's error is smaller than q/k-only's (docs/benchmarks.md), so the same bounds are at
    // least as loose; to be tightened from the H100 figures.
    assert!(f.max_abs_diff <= 3.0 && f.mean_abs_diff() <= 0.45, "{f:?}");
    // q/k/v against q/k only; q/k against no rotation.
    let Some(mut other) = (if v { gpu(&w, KvCacheDtype::Fp8E4m3, true) } else { gpu(&w, KvCacheDtype::Fp8E4m3, false) }) else { return };
    let moved = compare(&got, &rows(&mut other));
    assert!(moved.max_abs_diff > 0.0, "v {v}: the same logits bit for bit as the cache without this rotation: it did not run");
}

#[test]
fn bf16_cache_with_hadamard_matches_the_cpu_rotation() {
    bf16_case(false);
}

#[test]
fn fp8_cache_with_hadamard_matches_the_cpu_rotation_and_differs_from_plain_fp8() {
    fp8_case(false);
}

#[test]
fn bf16_cache_with_rotated_v_matches_the_cpu_rotation() {
    bf16_case(true);
}

#[test]
fn fp8_cache_with_rotated_v_matches_the_cpu_rotation_and_differs_from_q_k_only() {
    fp8_case(true);
}

/// The per-head-scaled fp8 cache (`KvCacheDtype::Fp8E4m3PerHead`, `--kv-cache-dtype fp8-scaled*`)
/// against the CPU computing with the same per-head-scaled e4m3 values (`KvElem::Fp8E4m3PerHead`).
/// Bounds 1.5 × the H200's figures (2026-11-29: max |Δ| 0.864 / 0.891, mean 0.210 / 0.230 with and
/// without the rotation), well inside the scale-1 cache's (3.0 / 0.45): a scale applied to the wrong
/// key, or not at all, moves logits by units. Without the rotation the scales must also bring the
/// GPU closer to the CPU's f32 cache than scale 1 does (H200: 0.248 against 0.327 mean |Δ|), so they
/// really reach the attention kernels; with the rotation the two were 0.214 and 0.229, too close to
/// assert on another GPU, so that pair is only reported.
fn fp8_per_head_case(hadamard: bool) {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some(mut g) = gpu(&w, KvCacheDtype::Fp8E4m3PerHead, hadamard) else { return };
    let got = rows(&mut g);
    drop(g);
    let want = KvFormat::both(KvElem::Fp8E4m3PerHead, hadamard);
    let f = compare(&got, &cpu_rows(&w, want));
    report(&format!("cuda per-head fp8 KV (hadamard {hadamard}) vs cpu {}: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", want.label(), f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    assert!(f.max_abs_diff <= 1.35 && f.mean_abs_diff() <= 0.35, "{f:?}");
    let Some(mut one) = gpu(&w, KvCacheDtype::Fp8E4m3, hadamard) else { return };
    let scale_one = rows(&mut one);
    drop(one);
    let exact = cpu_rows(&w, KvFormat { hadamard, ..KvFormat::F32 });
    let (head, unit) = (compare(&got, &exact), compare(&scale_one, &exact));
    report(&format!("against the cpu's f32 cache (hadamard {hadamard}): per-head fp8 mean |Δ| {:.4}, scale-1 fp8 {:.4}", head.mean_abs_diff(), unit.mean_abs_diff()));
    if !hadamard {
        assert!(head.mean_abs_diff() < unit.mean_abs_diff(), "per-head scales no closer to the f32 cache than scale 1: {head:?} vs {unit:?}");
    }
}

#[test]
fn fp8_cache_with_per_head_scales_matches_the_cpu_and_unrotated_beats_scale_one() {
    fp8_per_head_case(true);
    fp8_per_head_case(false);
}

/// The int8 cache (`KvCacheDtype::Int8PerHead`, `--kv-cache-dtype int8*`) against the CPU computing
/// with the same per-head-scaled int8 values (`KvElem::Int8PerHead`), within the bf16 cache's
/// bounds against the CPU (its codes are of values the GPU computed in bf16: a code may differ by
/// one step, a rounding error of the size int8's own). It must also be closer to the CPU's f32
/// cache than the per-head fp8 cache is, with and without the rotation: its uniform grid is what
/// `--kv-cache-dtype int8` is for (CPU eval: mean |Δ| 0.055 against fp8-scaled's 0.148).
fn int8_case(hadamard: bool) {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some(mut g) = gpu(&w, KvCacheDtype::Int8PerHead, hadamard) else { return };
    let got = rows(&mut g);
    drop(g);
    let want = KvFormat::both(KvElem::Int8PerHead, hadamard);
    let f = compare(&got, &cpu_rows(&w, want));
    report(&format!("cuda int8 KV (hadamard {hadamard}) vs cpu {}: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", want.label(), f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    assert!(f.max_abs_diff <= 0.75 && f.mean_abs_diff() <= 0.15, "{f:?}");
    let Some(mut fp8) = gpu(&w, KvCacheDtype::Fp8E4m3PerHead, hadamard) else { return };
    let fp8_rows = rows(&mut fp8);
    drop(fp8);
    let exact = cpu_rows(&w, KvFormat { hadamard, ..KvFormat::F32 });
    let (int8, fp8) = (compare(&got, &exact), compare(&fp8_rows, &exact));
    report(&format!("against the cpu's f32 cache (hadamard {hadamard}): int8 mean |Δ| {:.4}, per-head fp8 {:.4}", int8.mean_abs_diff(), fp8.mean_abs_diff()));
    assert!(int8.mean_abs_diff() < fp8.mean_abs_diff(), "int8 no closer to the f32 cache than per-head fp8: {int8:?} vs {fp8:?}");
}

#[test]
fn int8_cache_matches_the_cpu_and_beats_per_head_fp8() {
    int8_case(true);
    int8_case(false);
}

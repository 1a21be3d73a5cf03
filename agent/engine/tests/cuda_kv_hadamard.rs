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

#[test]
fn bf16_cache_with_hadamard_matches_the_cpu_rotation() {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some(mut g) = gpu(&w, KvCacheDtype::Bf16, true) else { return };
    let want = cpu_rows(&w, KvFormat { hadamard: true, ..KvFormat::F32 });
    let f = compare(&rows(&mut g), &want);
    report(&format!("cuda bf16 KV + hadamard vs cpu f32 + hadamard: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    assert!(f.max_abs_diff <= 0.75 && f.mean_abs_diff() <= 0.15, "{f:?}");
}

#[test]
fn fp8_cache_with_hadamard_matches_the_cpu_rotation_and_differs_from_plain_fp8() {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some(mut rotated) = gpu(&w, KvCacheDtype::Fp8E4m3, true) else { return };
    let got = rows(&mut rotated);
    drop(rotated);
    let want = cpu_rows(&w, KvFormat::both(KvElem::Fp8E4m3, true));
    let f = compare(&got, &want);
    report(&format!("cuda fp8 KV + hadamard vs cpu fp8 + hadamard: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    // Bounds from the H100 (2026-11-25): max |Δ| 2.027, mean 0.291, top-1 40/42 — 1.5× those, as
    // the W8A8 tests' bounds. Both sides round K and V to e4m3 but at different points (the GPU's
    // bf16 intermediates), and on SmolLM2 one code step moves a logit by units; a wrong rotation
    // (or none on one side) moves every logit far more (the bf16 test above holds to 0.75).
    assert!(f.max_abs_diff <= 3.0 && f.mean_abs_diff() <= 0.45, "{f:?}");
    let Some(mut plain) = gpu(&w, KvCacheDtype::Fp8E4m3, false) else { return };
    let unrotated = rows(&mut plain);
    let moved = compare(&got, &unrotated);
    assert!(moved.max_abs_diff > 0.0, "the rotated fp8 cache gave the unrotated one's logits bit for bit: no rotation ran");
}

#[test]
fn bf16_cache_with_rotated_v_matches_the_cpu_rotation() {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some(mut g) = gpu_rotated(&w, KvCacheDtype::Bf16, true, true) else { return };
    let want = cpu_rows(&w, KvFormat { hadamard: true, hadamard_v: true, ..KvFormat::F32 });
    let f = compare(&rows(&mut g), &want);
    report(&format!("cuda bf16 KV + hadamard q/k/v vs cpu f32 + hadamard q/k/v: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    // The rotation is exact in real arithmetic, so the bf16 bound holds: v rotated and the output
    // rotated back add two bf16 roundings per layer; a missing or doubled inverse rotation scrambles
    // every head's output and moves the logits by far more.
    assert!(f.max_abs_diff <= 0.75 && f.mean_abs_diff() <= 0.15, "{f:?}");
}

#[test]
fn fp8_cache_with_rotated_v_matches_the_cpu_rotation_and_differs_from_q_k_only() {
    if !gpu_or_skip() {
        return;
    }
    let w = weights();
    let Some(mut rotated) = gpu_rotated(&w, KvCacheDtype::Fp8E4m3, true, true) else { return };
    let got = rows(&mut rotated);
    drop(rotated);
    let want = cpu_rows(&w, KvFormat { hadamard_v: true, ..KvFormat::both(KvElem::Fp8E4m3, true) });
    let f = compare(&got, &want);
    report(&format!("cuda fp8 KV + hadamard q/k/v vs cpu fp8 + hadamard q/k/v: max |Δ| {:.3}, mean {:.4}, top-1 {}/{}", f.max_abs_diff, f.mean_abs_diff(), f.top1_agree, f.positions));
    // The q/k test's bounds (1.5× its H100 figures): both sides round the same rotated K and V to
    // e4m3 at different points; the CPU's rotated-v error is smaller than q/k-only's (docs/benchmarks.md),
    // so these are at least as loose. To be tightened from the H100 figures.
    assert!(f.max_abs_diff <= 3.0 && f.mean_abs_diff() <= 0.45, "{f:?}");
    let Some(mut qk_only) = gpu(&w, KvCacheDtype::Fp8E4m3, true) else { return };
    let moved = compare(&got, &rows(&mut qk_only));
    assert!(moved.max_abs_diff > 0.0, "rotating v gave the q/k-only cache's logits bit for bit: v's rotation did not run");
}

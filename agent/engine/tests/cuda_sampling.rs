//! GPU sampling (`sample_rows`) against the CPU sampler's candidate set (`sampling::keep_mask`), on a
//! GPU machine. For a fixed logits row and N rows of uniform numbers u = (j + 0.5) / N, the inverse-CDF
//! draw must pick each candidate exactly N·p times up to rounding (at most 3 off here: the kernel
//! sums in f32, the reference in f64), never a token outside the candidates, and ids must not
//! decrease as u grows (the CDF runs in id order). Greedy rows must give the argmax.
//!
//! Skipped with a visible "skipped: no CUDA device: <why>" where no GPU is usable (CI).

mod cuda_common;

use cuda_common::{argmax, gpu_or_skip, report};
use peregrine_engine::sampling::keep_mask;
use peregrine_kernels::ops::SAMPLE_PARAMS;
use peregrine_kernels::Cuda;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

const VOCAB: usize = 5003; // not a multiple of the block size: the last thread's run is short
const ROWS: usize = 4096;
const COUNT_TOL: f64 = 3.0;

fn normal_logits(seed: u64) -> Vec<f32> {
    let mut r = ChaCha20Rng::seed_from_u64(seed);
    (0..VOCAB)
        .map(|_| {
            // Box-Muller, scaled so a few hundred tokens carry most of the mass.
            let (u1, u2): (f64, f64) = (r.random::<f64>().max(1e-12), r.random());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * 3.0) as f32
        })
        .collect()
}

/// Token ids the GPU draws for u = (j + 0.5) / ROWS, j = 0..ROWS.
fn gpu_draws(c: &Cuda, logits: &[f32], params: [f32; 4]) -> Vec<u32> {
    let mut all = Vec::with_capacity(ROWS * VOCAB);
    let mut p = Vec::with_capacity(ROWS * SAMPLE_PARAMS);
    for j in 0..ROWS {
        all.extend_from_slice(logits);
        p.extend_from_slice(&params);
        p.push((j as f32 + 0.5) / ROWS as f32);
    }
    let d_logits = c.gpu.upload(&all).unwrap();
    let d_params = c.gpu.upload(&p).unwrap();
    let out = c.gpu.upload(&vec![u32::MAX; ROWS]).unwrap();
    unsafe { c.kernels.sample_rows(&c.gpu.stream, d_logits.ptr(), ROWS, VOCAB, d_params.ptr(), out.ptr()).unwrap() };
    out.download(&c.gpu.stream).unwrap()
}

#[test]
fn draws_follow_the_cpu_samplers_candidates_and_probabilities() {
    if !gpu_or_skip() {
        return;
    }
    let c = Cuda::new(0).expect("CUDA");
    let logits = normal_logits(20261122);
    // (temperature, top_k, top_p, min_p)
    let cases: [(f32, usize, f32, f32); 6] =
        [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 200, 0.8, 0.02), (0.5, 0, 1.0, 0.1), (2.0, 5, 0.5, 0.0)];
    for (t, k, p, m) in cases {
        let ids = gpu_draws(&c, &logits, [t, k as f32, p, m]);
        let scaled: Vec<f32> = logits.iter().map(|&l| l / t).collect();
        let kept = keep_mask(&scaled, k, p, m);
        let total: f64 = kept.iter().map(|&(_, q)| q).sum();
        let mut counts = vec![0usize; VOCAB];
        for &id in &ids {
            assert!((id as usize) < VOCAB, "case {:?}: id {id} out of range", (t, k, p, m));
            counts[id as usize] += 1;
        }
        assert!(ids.windows(2).all(|w| w[0] <= w[1]), "case {:?}: ids decrease as u grows", (t, k, p, m));
        let mut in_set = vec![false; VOCAB];
        let mut worst = 0f64;
        for &(id, q) in &kept {
            in_set[id] = true;
            let want = ROWS as f64 * q / total;
            let diff = (counts[id] as f64 - want).abs();
            worst = worst.max(diff);
            assert!(diff <= COUNT_TOL, "case {:?}: token {id} drawn {} times, expected {want:.2}", (t, k, p, m), counts[id]);
        }
        for (id, &n) in counts.iter().enumerate() {
            assert!(n == 0 || in_set[id], "case {:?}: token {id} drawn {n} times but is not a candidate", (t, k, p, m));
        }
        report(&format!("sampling T={t} top_k={k} top_p={p} min_p={m}: {} candidates, worst count error {worst:.2} of {ROWS} draws", kept.len()));
    }
    // Greedy rows (temperature below 1e-5) take the argmax, whatever u is.
    let ids = gpu_draws(&c, &logits, [0.0, 0.0, 1.0, 0.0]);
    assert!(ids.iter().all(|&id| id == argmax(&logits)), "greedy rows must give the argmax");
}

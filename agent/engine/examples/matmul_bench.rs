//! Times the CPU matmul on the test model's matrices (single thread, n tokens).
use std::time::Instant;

use peregrine_engine::backend::cpu::matmul::matmul;
use peregrine_engine::backend::cpu::simd::Isa;
use peregrine_engine::model::{self, LoadFormat};

fn main() {
    let path = std::env::args().nth(1).unwrap();
    let loaded = model::load(std::path::Path::new(&path), LoadFormat::Auto).unwrap();
    let w = &loaded.weights;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for isa in Isa::available() {
        for n in [1usize, 32] {
            for (name, m) in [("embed/lm_head", &w.embed_tokens), ("gate", &w.layers[0].gate_proj), ("down", &w.layers[0].down_proj)] {
                let x = vec![0.5f32; n * m.cols];
                let mut out = vec![0f32; n * m.rows];
                pool.install(|| matmul(isa, &x, n, m, &mut out));
                let reps = 5;
                let t = Instant::now();
                for _ in 0..reps {
                    pool.install(|| matmul(isa, &x, n, m, &mut out));
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                let gflops = 2.0 * (n * m.rows * m.cols) as f64 / s / 1e9;
                println!("{isa:?} n={n:>2} {name:<14} {:>8.3} ms  {gflops:6.1} GFLOP/s  {:.2} Gelem/s dequant", s * 1e3, (m.rows * m.cols) as f64 / s / 1e9);
            }
        }
    }
}

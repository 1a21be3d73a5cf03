//! Helpers shared by the GPU integration tests (`cuda_*.rs`).
#![allow(dead_code)]

use std::io::Write;

use peregrine_engine::backend::cuda;

/// Whether a GPU is usable. Where none is, prints a visible "skipped: no CUDA device: <why>" (CI),
/// unless `PEREGRINE_REQUIRE_GPU` is set (`make test-gpu`), which makes it a failure: a GPU machine
/// cannot pass by skipping.
pub fn gpu_or_skip() -> bool {
    match cuda::available() {
        Ok(()) => true,
        Err(e) => {
            if std::env::var_os("PEREGRINE_REQUIRE_GPU").is_some() {
                panic!("PEREGRINE_REQUIRE_GPU is set but no GPU is usable: {e}");
            }
            // Straight to stderr: the harness captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device: {e}");
            false
        }
    }
}

/// A line on stderr that the test harness does not capture (figures a person should see).
pub fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

pub fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

pub fn top2_margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

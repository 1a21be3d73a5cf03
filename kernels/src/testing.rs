
//! Helpers for GPU tests: get a GPU or skip with a visible reason.

use std::io::Write;

use crate::Cuda;

/// `Some(cuda)` when a GPU is usable. Otherwise prints `skipped: no CUDA device: <error>` and returns
/// None, unless `PEREGRINE_REQUIRE_GPU` is set (as `make test-gpu` does): then the test fails, so a GPU
/// machine can never pass by skipping.
pub fn cuda_or_skip() -> Option<Cuda> {
    match Cuda::new(0) {
        Ok(c) => Some(c),
        Err(e) => {
            if std::env::var_os("PEREGRINE_REQUIRE_GPU").is_some() {
                panic!("PEREGRINE_REQUIRE_GPU is set but no GPU is usable: {e}");
            }
            // Written straight to stderr: the test harness captures eprintln! of passing tests.
            let reason = match e {
                crate::KernelError::NoDevice(why) => why,
                other => other.to_string(),
            };
            let _ = writeln!(std::io::stderr(), "skipped: no CUDA device: {reason}");
            None
        }
    }
}

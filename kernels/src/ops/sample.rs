//! sample.cu: temperature / top-k / top-p / min-p sampling per logits row.

use cudarc::driver::{CudaStream, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, Kernels};
use crate::Result;

/// f32 parameters per row of [`Kernels::sample_rows`] (sample.cu's SAMPLE_PARAMS): temperature,
/// top_k, top_p, min_p, u.
pub const SAMPLE_PARAMS: usize = 5;
const SAMPLE_THREADS: u32 = 1024;

impl Kernels {
    /// One token per logits row, drawn with that row's temperature / top-k / top-p / min-p and the
    /// uniform number `u` the caller drew (greedy where temperature < 1e-5); see sample.cu.
    ///
    /// # Safety
    /// logits: rows*vocab f32; params: rows*[`SAMPLE_PARAMS`] f32; out: rows u32.
    pub unsafe fn sample_rows(&self, s: &CudaStream, logits: DPtr, rows: usize, vocab: usize, params: DPtr, out: DPtr) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let vocab = as_i32(vocab, "vocab")?;
        s.launch_builder(&self.sample_rows)
            .arg(&logits)
            .arg(&vocab)
            .arg(&params)
            .arg(&out)
            .launch(cfg(as_u32(rows, "rows")?, SAMPLE_THREADS))?;
        Ok(())
    }
}

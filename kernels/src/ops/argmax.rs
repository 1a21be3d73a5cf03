//! argmax.cu: greedy token per logits row.

use cudarc::driver::{CudaStream, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, Kernels};
use crate::Result;

impl Kernels {
    /// `out[r] = argmax(logits[r, :])` (u32, lowest index on ties).
    ///
    /// # Safety
    /// logits: rows*vocab f32; out: rows u32.
    pub unsafe fn argmax_rows(&self, s: &CudaStream, logits: DPtr, rows: usize, vocab: usize, out: DPtr) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let vocab = as_i32(vocab, "vocab")?;
        s.launch_builder(&self.argmax_rows)
            .arg(&logits)
            .arg(&vocab)
            .arg(&out)
            .launch(cfg(as_u32(rows, "rows")?, 1024))?;
        Ok(())
    }
}

//! embedding.cu: the token-embedding gather.

use cudarc::driver::{CudaStream, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, Kernels};
use crate::Result;

impl Kernels {
    /// `out[t, :] = f32(table[ids[t], :])` for `n` tokens. ids: u32, already checked `< vocab`.
    ///
    /// # Safety
    /// out: n*hidden f32; table: vocab*hidden bf16; ids: n u32.
    pub unsafe fn embedding_gather(&self, s: &CudaStream, out: DPtr, table: DPtr, ids: DPtr, n: usize, hidden: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let hidden = as_i32(hidden, "hidden")?;
        s.launch_builder(&self.embedding_gather)
            .arg(&out)
            .arg(&table)
            .arg(&ids)
            .arg(&hidden)
            .launch(cfg(as_u32(n, "tokens")?, 256))?;
        Ok(())
    }
}

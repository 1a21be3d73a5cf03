//! rmsnorm.cu: residual add + RMSNorm.

use cudarc::driver::CudaStream;

use super::{as_i32, as_u32, cfg, DPtr, Kernels, Launch, LoraDelta, OuterScale};
use crate::Result;

impl Kernels {
    /// `residual += delta` (when `delta` is Some), then `out = rmsnorm(residual) * weight` in bf16.
    /// With `rows` = Some(ptr to `n` i32), output row i adds and normalizes residual row `rows[i]` only
    /// (the final norm, on the rows whose logits are wanted). `lora`: the LoRA update of the
    /// projection that wrote `delta`, added with it. `delta_scale`: `delta` is an 8-bit GEMM's unscaled
    /// output, scaled here ([`OuterScale`]).
    ///
    /// # Safety
    /// residual: f32 rows of `hidden`; delta and lora's buffer: bf16 like residual; weight: hidden
    /// f32; out: n*hidden bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rmsnorm(&self, s: &CudaStream, residual: DPtr, delta: Option<DPtr>, weight: DPtr, out: DPtr, rows: Option<DPtr>, n: usize, hidden: usize, eps: f32, lora: Option<LoraDelta>, delta_scale: Option<OuterScale>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let delta = delta.unwrap_or(0);
        let (lora_d, lora_slots) = LoraDelta::args(lora);
        let (dxs, dws, delta_i32) = OuterScale::args(delta_scale);
        let rows = rows.unwrap_or(0);
        let hidden_i = as_i32(hidden, "hidden")?;
        let threads = Self::row_threads(hidden, "add_rmsnorm")?;
        Launch::new(&self.add_rmsnorm)
            .arg(&residual)
            .arg(&delta)
            .arg(&weight)
            .arg(&out)
            .arg(&rows)
            .arg(&hidden_i)
            .arg(&eps)
            .arg(&lora_d)
            .arg(&lora_slots)
            .arg(&dxs)
            .arg(&dws)
            .arg(&delta_i32)
            .launch(s, cfg(as_u32(n, "tokens")?, threads), false)?;
        Ok(())
    }
}

//! lora.cu: multi-LoRA shrink and expand.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, Kernels};
use crate::Result;

/// Rank rows one block of [`Kernels::lora_shrink`] computes (one warp each).
const LORA_SHRINK_RANKS: usize = 8;

impl Kernels {
    /// LoRA shrink: `t[i, :] = x[i, :] · A[slots[i]]ᵀ` for the `n` tokens with a slot (see lora.cu).
    ///
    /// # Safety
    /// t: n*r_max f32; x: n rows of k bf16, `x_stride` apart; a_stack: slots*r_max*k bf16 covering
    /// every slot index in `slots` (n i32, -1 for none).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_shrink(&self, s: &CudaStream, t: DPtr, x: DPtr, x_stride: usize, a_stack: DPtr, slots: DPtr, n: usize, k: usize, r_max: usize) -> Result<()> {
        if n == 0 || r_max == 0 {
            return Ok(());
        }
        let (x_stride, k, r) = (as_i32(x_stride, "x_stride")?, as_i32(k, "k")?, as_i32(r_max, "r_max")?);
        let config = LaunchConfig {
            grid_dim: (as_u32(n, "tokens")?, as_u32(r_max.div_ceil(LORA_SHRINK_RANKS), "ranks")?, 1),
            block_dim: ((LORA_SHRINK_RANKS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        s.launch_builder(&self.lora_shrink)
            .arg(&t)
            .arg(&x)
            .arg(&x_stride)
            .arg(&a_stack)
            .arg(&slots)
            .arg(&k)
            .arg(&r)
            .launch(config)?;
        Ok(())
    }

    /// LoRA expand: `y[i, :] += scales[slots[i]] · t[i, :] · B[slots[i]]ᵀ` in bf16 (see lora.cu).
    ///
    /// # Safety
    /// y: n rows of `out` bf16, `y_stride` apart; t: n*r_max f32; b_stack: slots*out*r_max bf16;
    /// scales: one f32 per slot; slots: n i32 (-1 for none).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn lora_expand(&self, s: &CudaStream, y: DPtr, y_stride: usize, t: DPtr, b_stack: DPtr, scales: DPtr, slots: DPtr, n: usize, out: usize, r_max: usize) -> Result<()> {
        if n == 0 || r_max == 0 || out == 0 {
            return Ok(());
        }
        let (y_stride, out_i, r) = (as_i32(y_stride, "y_stride")?, as_i32(out, "out")?, as_i32(r_max, "r_max")?);
        let n64 = n as u64;
        s.launch_builder(&self.lora_expand)
            .arg(&y)
            .arg(&y_stride)
            .arg(&t)
            .arg(&b_stack)
            .arg(&scales)
            .arg(&slots)
            .arg(&n64)
            .arg(&out_i)
            .arg(&r)
            .launch(cfg(self.elementwise_grid(n * out, 256), 256))?;
        Ok(())
    }
}

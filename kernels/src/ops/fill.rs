//! fill.cu: device-side fills and the f32 -> bf16 conversion.

use cudarc::driver::{CudaStream, PushKernelArg};

use super::{cfg, DPtr, Kernels};
use crate::Result;

impl Kernels {
    /// Uniform(-scale, scale) bf16 values, a pure function of (seed, index).
    ///
    /// # Safety
    /// out: n bf16.
    pub unsafe fn fill_uniform_bf16(&self, s: &CudaStream, out: DPtr, n: usize, seed: u64, scale: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        s.launch_builder(&self.fill_uniform_bf16)
            .arg(&out)
            .arg(&n64)
            .arg(&seed)
            .arg(&scale)
            .launch(cfg(self.elementwise_grid(n, 256), 256))?;
        Ok(())
    }

    /// # Safety
    /// out: n f32.
    pub unsafe fn fill_f32(&self, s: &CudaStream, out: DPtr, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        s.launch_builder(&self.fill_f32)
            .arg(&out)
            .arg(&n64)
            .arg(&value)
            .launch(cfg(self.elementwise_grid(n, 256), 256))?;
        Ok(())
    }

    /// # Safety
    /// out: n bf16; input: n f32.
    pub unsafe fn f32_to_bf16(&self, s: &CudaStream, out: DPtr, input: DPtr, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        s.launch_builder(&self.f32_to_bf16)
            .arg(&out)
            .arg(&input)
            .arg(&n64)
            .launch(cfg(self.elementwise_grid(n, 256), 256))?;
        Ok(())
    }
}

//! silu_mul.cu: SwiGLU on a fused gate|up output.

use cudarc::driver::CudaStream;

use super::{as_i32, cfg, DPtr, Kernels, Launch, LoraDelta};
use crate::{KernelError, Result};

impl Kernels {
    /// `out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j]`, `lora`'s update added to gate_up
    /// first.
    ///
    /// # Safety
    /// out: n*inter bf16; gate_up and lora's buffer: n*2*inter bf16.
    pub unsafe fn silu_mul(&self, s: &CudaStream, out: DPtr, gate_up: DPtr, n: usize, inter: usize, lora: Option<LoraDelta>) -> Result<()> {
        let (lora_d, lora_slots) = LoraDelta::args(lora);
        self.launch_silu_mul(s, out, gate_up, n, inter, lora_d, lora_slots, 0)
    }

    /// [`Kernels::silu_mul`] without LoRA for the rows whose `slots` entry (i32 per row) is -1: the
    /// others are left alone, for [`Kernels::lora_expand_swiglu`] to write with their update.
    ///
    /// # Safety
    /// As [`Kernels::silu_mul`]; `slots` holds n i32.
    pub unsafe fn silu_mul_unslotted(&self, s: &CudaStream, out: DPtr, gate_up: DPtr, n: usize, inter: usize, slots: DPtr) -> Result<()> {
        self.launch_silu_mul(s, out, gate_up, n, inter, 0, 0, slots)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_silu_mul(&self, s: &CudaStream, out: DPtr, gate_up: DPtr, n: usize, inter: usize, lora_d: DPtr, lora_slots: DPtr, skip_slots: DPtr) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n64 = n as u64;
        let inter_i = as_i32(inter, "intermediate")?;
        let chunks = n * inter / 8;
        if !inter.is_multiple_of(8) || u32::try_from(chunks).is_err() {
            return Err(KernelError::Unsupported(format!("silu_mul: {n} rows of {inter} (a multiple of 8, fewer than 2^35 values)")));
        }
        Launch::new(&self.silu_mul)
            .arg(&out)
            .arg(&gate_up)
            .arg(&n64)
            .arg(&inter_i)
            .arg(&lora_d)
            .arg(&lora_slots)
            .arg(&skip_slots)
            .launch(s, cfg(self.elementwise_grid(chunks, 256), 256), false)?;
        Ok(())
    }
}

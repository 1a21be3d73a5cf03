//! gemm_w8a8.cu: the row-wise 8-bit tensor-core GEMM (prefill-sized steps of `--quantization`).

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{as_i32, as_u32, DPtr, Kernels, W8Format};
use crate::{KernelError, Result};

/// Output tile of one block (rows × columns).
const TILE_M: usize = 64;
const TILE_N: usize = 64;

impl Kernels {
    /// `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]` over 8-bit codes (`xq` m × k, `wq` n × k, row-major),
    /// any m and n, k a multiple of 16; y bf16 or f32. e4m3 needs compute capability 8.9+, int8 8.0+.
    ///
    /// # Safety
    /// xq: m*k bytes and wq: n*k bytes, both 16-byte aligned; xs: m f32; ws: n f32; y: m*n of the
    /// output type.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_w8a8(&self, s: &CudaStream, format: W8Format, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.check_w8(format, "gemm_w8a8")?;
        if !k.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("gemm_w8a8: k {k} (k % 16 == 0, 16-byte aligned operands)")));
        }
        let func = match format {
            W8Format::E4m3 => &self.gemm_w8a8[0],
            W8Format::I8 => &self.gemm_w8a8[1],
        };
        let (yf, mi, ni, ki) = (y_f32 as i32, as_i32(m, "m")?, as_i32(n, "n")?, as_i32(k, "k")?);
        let grid = (as_u32(n.div_ceil(TILE_N), "gemm_w8a8 column tiles")?, as_u32(m.div_ceil(TILE_M), "gemm_w8a8 row tiles")?, 1);
        let config = LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        s.launch_builder(func)
            .arg(&y)
            .arg(&yf)
            .arg(&xq)
            .arg(&xs)
            .arg(&wq)
            .arg(&ws)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .launch(config)?;
        Ok(())
    }
}

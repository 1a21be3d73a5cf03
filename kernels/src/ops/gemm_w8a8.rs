//! gemm_w8a8.cu: the row-wise 8-bit tensor-core GEMM (prefill-sized steps of `--quantization`).

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{as_i32, as_u32, DPtr, Kernels, W8Format};
use crate::{KernelError, Result};


impl Kernels {
    /// The 8-bit GEMM's square output tile for an `m × n` output: 64, unless that leaves fewer
    /// blocks than SMs (decode-sized m on the n = 4096 projections), then 32 (four times the
    /// blocks; each weight tile is read by twice as many blocks, mostly from L2). Not yet measured:
    /// `PEREGRINE_GEMM8_TILE=32|64` forces one.
    pub fn gemm8_plan(&self, m: usize, n: usize) -> usize {
        if n.div_ceil(64) * m.div_ceil(64) < self.num_sms as usize {
            32
        } else {
            64
        }
    }

    /// `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]` over 8-bit codes (`xq` m × k, `wq` n × k, row-major),
    /// any m and n, k a multiple of 16; y bf16 or f32. e4m3 needs compute capability 8.9+, int8 8.0+.
    ///
    /// # Safety
    /// xq: m*k bytes and wq: n*k bytes, both 16-byte aligned; xs: m f32; ws: n f32; y: m*n of the
    /// output type.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_w8a8(&self, s: &CudaStream, format: W8Format, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        let tile = self.gemm8_tile.unwrap_or_else(|| self.gemm8_plan(m, n));
        self.gemm_w8a8_tile(s, format, y, y_f32, xq, xs, wq, ws, m, n, k, tile)
    }

    /// [`Kernels::gemm_w8a8`] with its output tile chosen (64 or 32; tests cover both).
    ///
    /// # Safety
    /// As [`Kernels::gemm_w8a8`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_w8a8_tile(&self, s: &CudaStream, format: W8Format, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize, tile: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.check_w8(format, "gemm_w8a8")?;
        if !k.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("gemm_w8a8: k {k} (k % 16 == 0, 16-byte aligned operands)")));
        }
        if !matches!(tile, 32 | 64) {
            return Err(KernelError::Unsupported(format!("gemm_w8a8: tile {tile} (32 or 64)")));
        }
        let func = &self.gemm_w8a8[(tile == 32) as usize][format.index()];
        let (yf, mi, ni, ki) = (y_f32 as i32, as_i32(m, "m")?, as_i32(n, "n")?, as_i32(k, "k")?);
        let grid = (as_u32(n.div_ceil(tile), "gemm_w8a8 column tiles")?, as_u32(m.div_ceil(tile), "gemm_w8a8 row tiles")?, 1);
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

//! gemv_fp8.cu: row-wise FP8 W8A8 for decode-sized steps: per-token activation quantization and the
//! e4m3 GEMV with both scales in its epilogue (sm_89+).

use cudarc::driver::{CudaStream, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, Kernels};
use crate::{KernelError, Result};

/// Largest row count the FP8 GEMV takes.
pub const GEMV_FP8_MAX_M: usize = 8;
const GEMV8_WARPS: usize = 8;

impl Kernels {
    /// Whether the FP8 kernels can run here (e4m3 conversions need compute capability 8.9+).
    pub fn fp8_gemm_ready(&self) -> bool {
        self.fp8_arch
    }

    /// `q[m, k]` = e4m3 codes of each bf16 row of `x` divided by its scale, `scales[m]` = the row's
    /// max |x| / 448 (0 for a zero row).
    ///
    /// # Safety
    /// x: m*k bf16; q: m*k bytes; scales: m f32.
    pub unsafe fn quant_rows_e4m3(&self, s: &CudaStream, q: DPtr, scales: DPtr, x: DPtr, m: usize, k: usize) -> Result<()> {
        if m == 0 || k == 0 {
            return Ok(());
        }
        if !self.fp8_arch {
            return Err(KernelError::Unsupported("quant_rows_e4m3 needs compute capability 8.9+".into()));
        }
        let ki = as_i32(k, "k")?;
        s.launch_builder(&self.quant_rows_e4m3)
            .arg(&q)
            .arg(&scales)
            .arg(&x)
            .arg(&ki)
            .launch(cfg(as_u32(m, "rows")?, 256))?;
        Ok(())
    }

    /// `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]` over e4m3 codes (`xq` m × k, `wq` n × k), m ≤
    /// [`GEMV_FP8_MAX_M`], k a multiple of 16; y bf16 or f32.
    ///
    /// # Safety
    /// xq: m*k bytes and wq: n*k bytes, both 16-byte aligned; xs: m f32; ws: n f32; y: m*n of the
    /// output type.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_e4m3(&self, s: &CudaStream, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        if !self.fp8_arch {
            return Err(KernelError::Unsupported("gemv_e4m3 needs compute capability 8.9+".into()));
        }
        if m > GEMV_FP8_MAX_M || !k.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("gemv_e4m3: m {m}, k {k} (m <= {GEMV_FP8_MAX_M}, k % 16 == 0, aligned)")));
        }
        let func = &self.gemv_e4m3[match m {
            0..=1 => 0,
            2 => 1,
            3..=4 => 2,
            _ => 3,
        }];
        let (yf, mi, ni, ki) = (y_f32 as i32, m as i32, as_i32(n, "n")?, as_i32(k, "k")?);
        let grid = as_u32(n.div_ceil(GEMV8_WARPS), "gemv_e4m3 blocks")?;
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
            .launch(cfg(grid, (GEMV8_WARPS * 32) as u32))?;
        Ok(())
    }
}

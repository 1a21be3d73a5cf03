//! bf16 (and, for the encoder, f32) GEMMs through cuBLAS (f32 accumulation), in the row-major terms the model uses:
//! `y[m, n] = x[m, k] · w[n, k]ᵀ (+ beta · y)`, with `w` a weight in PyTorch's `[out, in]` layout.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::{result as blas, sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream};

use crate::ops::DPtr;
use crate::{KernelError, Result};

pub struct Blas {
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
}

/// The element type of a GEMM output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    Bf16,
    F32,
}

impl Blas {
    /// cuBLAS needs a fixed workspace of its own to be capturable into CUDA graphs.
    pub const WORKSPACE_BYTES: usize = 32 << 20;

    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        let blas = CudaBlas::new(stream.clone())?;
        let workspace = stream.alloc_zeros::<u8>(Self::WORKSPACE_BYTES)?;
        let ws_ptr = {
            let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(&workspace, stream.as_ref());
            ptr
        };
        // SAFETY: the workspace lives as long as the handle (both in self).
        unsafe {
            sys::cublasSetWorkspace_v2(*blas.handle(), ws_ptr as *mut c_void, Self::WORKSPACE_BYTES).result()?;
        }
        Ok(Blas { blas, _workspace: workspace })
    }

    /// Limits the multiprocessors cuBLAS plans its next GEMMs for to `sms` (0: all of them), so
    /// that kernels on another stream (the LoRA path beside a base projection) find SMs free
    /// instead of queueing behind every block of the GEMM. A GEMM captured into a graph keeps the
    /// target it was captured with.
    pub fn set_sm_count_target(&self, sms: usize) -> Result<()> {
        let sms = i32::try_from(sms).map_err(|_| KernelError::Unsupported(format!("SM count target {sms}")))?;
        // SAFETY: the handle is live (owned by self); the call only sets a handle attribute.
        unsafe { sys::cublasSetSmCountTarget(*self.blas.handle(), sms).result()? };
        Ok(())
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ + beta · y` (x, w bf16; y bf16 or f32; f32 accumulation).
    ///
    /// # Safety
    /// The pointers must address buffers of the stated shapes on the handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(&self, y: DPtr, out: OutType, x: DPtr, w: DPtr, m: usize, n: usize, k: usize, beta: f32) -> Result<()> {
        let c_type = match out {
            OutType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            OutType::F32 => sys::cudaDataType::CUDA_R_32F,
        };
        self.row_major(Operands { y, c_type, x, w, ab_type: sys::cudaDataType::CUDA_R_16BF }, m, n, k, beta)
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ + beta · y`, everything f32 and computed in f32: cuBLAS's
    /// `CUBLAS_COMPUTE_32F` never takes TF32 tensor cores (only `_FAST_TF32` or the TF32 math mode
    /// does, and the handle keeps the default mode), so results stay within f32 rounding of a CPU
    /// reference (the encoder's 1e-5 tests need that).
    ///
    /// # Safety
    /// The pointers must address f32 buffers of the stated shapes on the handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_f32(&self, y: DPtr, x: DPtr, w: DPtr, m: usize, n: usize, k: usize, beta: f32) -> Result<()> {
        let f32_type = sys::cudaDataType::CUDA_R_32F;
        self.row_major(Operands { y, c_type: f32_type, x, w, ab_type: f32_type }, m, n, k, beta)
    }

    /// The row-major GEMM both element types share, with f32 accumulation.
    ///
    /// # Safety
    /// As [`Blas::matmul`].
    unsafe fn row_major(&self, o: Operands, m: usize, n: usize, k: usize, beta: f32) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let dim = |v: usize| i32::try_from(v).map_err(|_| KernelError::Unsupported(format!("GEMM dimension {v}")));
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        let alpha = 1.0f32;
        // Column-major view: yᵀ[n, m] = w[n, k] (stored as a k×n column-major matrix, transposed) · xᵀ[k, m].
        blas::gemm_ex(
            *self.blas.handle(),
            sys::cublasOperation_t::CUBLAS_OP_T,
            sys::cublasOperation_t::CUBLAS_OP_N,
            ni,
            mi,
            ki,
            &alpha as *const f32 as *const c_void,
            o.w as *const c_void,
            o.ab_type,
            ki,
            o.x as *const c_void,
            o.ab_type,
            ki,
            &beta as *const f32 as *const c_void,
            o.y as *mut c_void,
            o.c_type,
            ni,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
        Ok(())
    }
}

/// A GEMM's operands: output, input and weight addresses with their cuBLAS element types.
struct Operands {
    y: DPtr,
    c_type: sys::cudaDataType,
    x: DPtr,
    w: DPtr,
    ab_type: sys::cudaDataType,
}

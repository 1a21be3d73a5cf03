//! Row-wise FP8 GEMMs through cuBLASLt: `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]`: Hopper's FP8 tensor
//! cores through NVIDIA's own pipelined kernels (TMA, warp-specialised), where our `gemm_w8a8`
//! (mma.sync, no software pipeline) reaches about a third of the chip. The token scales `xs` and
//! weight-row scales `ws` go to cuBLASLt's "outer vector" scaling mode where the library offers it
//! for the GPU (one f32 per row of each operand, applied to the f32 accumulator); where it does not
//! (cuBLAS 13.0 on the H100 refuses it), the GEMM runs unscaled and the caller applies both scales
//! in place afterwards (`Kernels::scale_outer`: one more pass over the output, 2 × m × n × 2 bytes).
//!
//! cuBLASLt picks its kernel per shape (`cublasLtMatmulAlgoGetHeuristic`, tens of microseconds on
//! the host), so a plan (descriptors + chosen algorithm) is made once per (m, n, k, output type)
//! and kept; a shape cuBLASLt refuses is remembered as refused and the caller falls back to our
//! kernel. Like the bf16 cuBLAS path, the kernel (split-K, tile) depends on m, so a row's last bits
//! may differ between batch sizes; `PEREGRINE_GEMM8=ours` keeps every 8-bit GEMM on `gemm_w8a8`,
//! whose rows are batch invariant.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::{size_of, MaybeUninit};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::ops::DPtr;
use crate::{KernelError, Result};

/// cuBLASLt's recommended workspace on Hopper; fixed, so that calls can be captured into graphs.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Plans kept before the cache is emptied (prefill steps of many different lengths each make
/// one per projection shape; a plan is a few hundred bytes of descriptors).
const MAX_PLANS: usize = 2048;

fn lt_err(what: &str, e: CublasError) -> KernelError {
    KernelError::Unsupported(format!("cuBLASLt {what}: {e:?}"))
}

/// What [`BlasLt::gemm_fp8_rowwise`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LtRun {
    /// Nothing launched: cuBLASLt has no kernel for the shape.
    Declined,
    /// `y` holds the scaled result.
    Scaled,
    /// `y` holds `xq · wqᵀ` unscaled: the caller multiplies by `xs[i] · ws[j]`.
    Unscaled,
}

/// Descriptors and the chosen algorithm of one shape.
struct Plan {
    /// The scales go to cuBLASLt's outer-vector mode (else the GEMM runs unscaled).
    outer: bool,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Plan::new`, destroyed once here; errors on teardown are not actionable.
        unsafe {
            for layout in self.layouts {
                let _ = lt::destroy_matrix_layout(layout);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    f32_out: bool,
}

pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    /// None: cuBLASLt has no kernel for this shape (the caller uses its own).
    plans: Mutex<HashMap<PlanKey, Option<Plan>>>,
}

// SAFETY: the handle and descriptors are used under the plans' mutex or from the one thread that
// owns the stream; cuBLASLt handles may be used from any thread.
unsafe impl Send for BlasLt {}
unsafe impl Sync for BlasLt {}

impl Drop for BlasLt {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl BlasLt {
    /// A handle on `stream`, or None where libcublasLt cannot be loaded (the caller keeps its own
    /// kernels).
    pub fn new(stream: &Arc<CudaStream>) -> Result<Option<Self>> {
        // SAFETY: only probes whether the library loads.
        if !unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        let handle = lt::create_handle().map_err(|e| lt_err("handle", e))?;
        let workspace = stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        Ok(Some(BlasLt { handle, workspace, stream: stream.clone(), plans: Mutex::new(HashMap::new()) }))
    }

    /// `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]` over e4m3 codes (`xq` m × k tokens, `wq` n × k weight
    /// rows, both row-major), y bf16 or f32, or the same unscaled ([`LtRun::Unscaled`]) where the
    /// library cannot scale by rows; [`LtRun::Declined`] (nothing launched) where cuBLASLt has no
    /// kernel for the shape (k or n not a multiple of 16, or the library refuses it).
    ///
    /// # Safety
    /// xq: m*k bytes, wq: n*k bytes, 16-byte aligned; xs: m f32; ws: n f32; y: m*n of the output
    /// type; all on this handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_fp8_rowwise(&self, y: DPtr, f32_out: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<LtRun> {
        if m == 0 || n == 0 {
            return Ok(LtRun::Scaled);
        }
        // FP8 cuBLASLt needs 16-element leading dimensions and 16-byte aligned operands.
        if !k.is_multiple_of(16) || !n.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) || !y.is_multiple_of(16) {
            return Ok(LtRun::Declined);
        }
        let key = PlanKey { m, n, k, f32_out };
        let mut plans = self.plans.lock().map_err(|_| KernelError::Unsupported("cuBLASLt plan cache poisoned".into()))?;
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                plans.clear();
            }
            let plan = self.plan(key).ok();
            plans.insert(key, plan);
        }
        let Some(plan) = plans.get(&key).and_then(Option::as_ref) else { return Ok(LtRun::Declined) };
        // Column-major view, as in `Blas::matmul`: yᵀ[n, m] = wq[n, k] (a k × n matrix, transposed) ·
        // xqᵀ[k, m]. cuBLASLt's A is the weight (its rows are our output columns: scales `ws`), B the
        // tokens (its columns are our rows: scales `xs`).
        let set_ptr = |attr: sys::cublasLtMatmulDescAttributes_t, p: DPtr| {
            let p = p as *const c_void;
            lt::set_matmul_desc_attribute(plan.desc, attr, &p as *const *const c_void as *const c_void, size_of::<*const c_void>())
        };
        if plan.outer {
            set_ptr(sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ws).map_err(|e| lt_err("A scales", e))?;
            set_ptr(sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, xs).map_err(|e| lt_err("B scales", e))?;
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (ws_ptr, _sync) = self.workspace.device_ptr(self.stream.as_ref());
        let [a, b, d] = plan.layouts;
        lt::matmul(
            self.handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            wq as *const c_void,
            a,
            xq as *const c_void,
            b,
            y as *const c_void,
            d,
            y as *mut c_void,
            d,
            &plan.algo,
            ws_ptr as *mut c_void,
            WORKSPACE_BYTES,
            self.stream.cu_stream() as sys::cudaStream_t,
        )
        .map_err(|e| lt_err("matmul", e))?;
        Ok(if plan.outer { LtRun::Scaled } else { LtRun::Unscaled })
    }

    /// The plan for one shape: with outer-vector scales if cuBLASLt has a kernel for them, else
    /// unscaled.
    fn plan(&self, key: PlanKey) -> std::result::Result<Plan, CublasError> {
        self.plan_with(key, true).or_else(|_| self.plan_with(key, false))
    }

    /// Descriptors for one shape (`outer`: with outer-vector scale modes) and cuBLASLt's first-choice
    /// algorithm for them.
    fn plan_with(&self, key: PlanKey, outer: bool) -> std::result::Result<Plan, CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let PlanKey { m, n, k, f32_out } = key;
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
        let d_type = if f32_out { sys::cudaDataType::CUDA_R_32F } else { sys::cudaDataType::CUDA_R_16BF };
        // Each layout is owned by the plan as soon as it exists, so an error below frees it.
        let mut plan = Plan { outer, desc, layouts: [std::ptr::null_mut(); 3], algo: unsafe { MaybeUninit::zeroed().assume_init() } };
        plan.layouts[0] = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_8F_E4M3, k64, n64, k as i64)?;
        plan.layouts[1] = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_8F_E4M3, k64, m64, k as i64)?;
        plan.layouts[2] = lt::create_matrix_layout(d_type, n64, m64, n as i64)?;
        // SAFETY: the descriptor is live; each value outlives its call.
        unsafe {
            let set_u32 = |attr: Attr, v: u32| lt::set_matmul_desc_attribute(desc, attr, &v as *const u32 as *const c_void, size_of::<u32>());
            set_u32(Attr::CUBLASLT_MATMUL_DESC_TRANSA, cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as u32)?;
            set_u32(Attr::CUBLASLT_MATMUL_DESC_TRANSB, cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N as u32)?;
            if outer {
                let mode = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as u32;
                set_u32(Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode)?;
                set_u32(Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode)?;
            }
            let pref = lt::create_matmul_pref()?;
            let ws = WORKSPACE_BYTES as u64;
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                size_of::<u64>(),
            );
            let [a, b, d] = plan.layouts;
            let found = set.and_then(|()| lt::get_matmul_algo_heuristic(self.handle, desc, a, b, d, d, pref));
            let _ = lt::destroy_matmul_pref(pref);
            plan.algo = found?.algo;
        }
        Ok(plan)
    }
}

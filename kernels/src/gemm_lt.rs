//! Row-wise FP8 GEMMs through cuBLASLt: `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]`: Hopper's FP8 tensor
//! cores through NVIDIA's own pipelined kernels (TMA, warp-specialised), where our `gemm_w8a8`
//! (mma.sync, no software pipeline) reaches about a third of the chip. The GEMM runs unscaled and
//! the caller applies the token scales `xs` and weight-row scales `ws` in place afterwards
//! (`Kernels::scale_outer`: one more pass over the output, 2 × m × n × 2 bytes): cuBLASLt's "outer
//! vector" scaling mode would apply them in the epilogue, but cuBLAS 13.0 offers no algorithm for it
//! on the H100 (measured: the heuristic returns none for every shape).
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
/// The int8 GEMM's int32 sums go through this scratch (32 Mi elements, 128 MiB) before the scales make
/// them bf16/f32; longer steps run in row chunks that fit. Sized so that a decode step of up to 1,170
/// tokens runs Llama-3.1-8B's gate|up (28,672 columns) in one piece, whose sums its consumer can then
/// read in place (`BlasLt::gemm_i8_into_scratch`): at 16 Mi, a 1,024-token step ran it in two
/// chunks, each with its own scale pass.
const ACC_ELEMS: usize = 32 << 20;
/// Plans kept before the cache is emptied (prefill steps of many different lengths each make
/// one per projection shape; a plan is a few hundred bytes of descriptors).
const MAX_PLANS: usize = 2048;

fn lt_err(what: &str, e: CublasError) -> KernelError {
    KernelError::Unsupported(format!("cuBLASLt {what}: {e:?}"))
}

/// Descriptors and the chosen algorithm of one shape.
struct Plan {
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

/// One GEMM shape and its operand types: e4m3 codes into bf16/f32 (`f32_out`), or int8 codes into
/// exact int32 sums (`int8`; `f32_out` unused).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct PlanKey {
    m: usize,
    n: usize,
    k: usize,
    f32_out: bool,
    int8: bool,
    /// The SM count the plan targets (0: all; [`BlasLt::set_sm_count_target`]).
    sm_target: usize,
}

pub struct BlasLt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// int32 sums of the int8 GEMM, [`ACC_ELEMS`].
    acc: CudaSlice<i32>,
    stream: Arc<CudaStream>,
    /// None: cuBLASLt has no kernel for this shape (the caller uses its own).
    plans: Mutex<HashMap<PlanKey, Option<Plan>>>,
    /// The SM count the next GEMMs target (0: all).
    sm_target: std::sync::atomic::AtomicUsize,
    /// int8 plans: the fastest of cuBLASLt's candidate algorithms per size class (`TuneKey`), timed
    /// the first time a shape of the class ran outside a graph capture.
    tuned: Mutex<HashMap<TuneKey, sys::cublasLtMatmulAlgo_t>>,
    /// `PEREGRINE_GEMM8_TUNE=0`: the heuristic's first algorithm for every int8 shape (as before).
    tune: bool,
}

/// The size class an int8 GEMM's timed algorithm is shared across: rows rounded up to 64 (128 from
/// 1,024), the same n, k and SM target. Steps of every length between two classes' bounds reuse one
/// timing instead of paying one each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct TuneKey {
    rows: usize,
    n: usize,
    k: usize,
    sm_target: usize,
}

impl TuneKey {
    fn of(key: &PlanKey) -> TuneKey {
        let rows = if key.m < 1024 { key.m.next_multiple_of(64) } else { key.m.next_multiple_of(128) };
        TuneKey { rows, n: key.n, k: key.k, sm_target: key.sm_target }
    }
}

/// A matmul preference allowing [`WORKSPACE_BYTES`] of workspace (the caller destroys it).
///
/// # Safety
/// Calls into cuBLASLt; the preference is destroyed here if setting it fails.
unsafe fn workspace_preference() -> std::result::Result<sys::cublasLtMatmulPreference_t, CublasError> {
    // SAFETY: a fresh preference; `ws` outlives the call that reads it.
    unsafe {
        let pref = lt::create_matmul_pref()?;
        let ws = WORKSPACE_BYTES as u64;
        let set = lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const c_void,
            size_of::<u64>(),
        );
        if let Err(e) = set {
            let _ = lt::destroy_matmul_pref(pref);
            return Err(e);
        }
        Ok(pref)
    }
}

/// Candidates cuBLASLt is asked for when an int8 shape is timed.
const TUNE_CANDIDATES: usize = 8;
/// Timed runs per candidate (after one untimed).
const TUNE_RUNS: usize = 5;
/// Another candidate replaces the heuristic's first only when it is at least this much faster:
/// timings of one algorithm vary by a few % between runs, and a choice made on noise can be worse.
const TUNE_MARGIN: f32 = 0.97;

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
        let acc = stream.alloc_zeros::<i32>(ACC_ELEMS)?;
        let tune = std::env::var("PEREGRINE_GEMM8_TUNE").map_or(true, |v| v != "0");
        Ok(Some(BlasLt {
            handle,
            workspace,
            acc,
            stream: stream.clone(),
            plans: Mutex::new(HashMap::new()),
            sm_target: Default::default(),
            tuned: Mutex::new(HashMap::new()),
            tune,
        }))
    }

    /// Plans the next GEMMs for `sms` multiprocessors (0: all of them), as `Blas::set_sm_count_target`
    /// does for cuBLAS: kernels on another stream (the LoRA path beside an 8-bit base projection)
    /// then find SMs free. The target is part of each plan's key (it is a descriptor attribute that
    /// also steers the heuristic), and a GEMM captured into a graph keeps the plan it ran with.
    pub fn set_sm_count_target(&self, sms: usize) {
        self.sm_target.store(sms, std::sync::atomic::Ordering::Relaxed);
    }

    fn sm_target(&self) -> usize {
        self.sm_target.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `y[m, n] = xq · wqᵀ` over e4m3 codes (`xq` m × k tokens, `wq` n × k weight rows, both
    /// row-major), unscaled, y bf16 or f32: the caller then multiplies by `xs[i] · ws[j]`
    /// (`Kernels::scale_outer`). false: nothing launched, cuBLASLt has no kernel for the shape (k or n
    /// not a multiple of 16, or the library refuses it).
    ///
    /// # Safety
    /// xq: m*k bytes, wq: n*k bytes, 16-byte aligned; y: m*n of the output type; all on this
    /// handle's stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_e4m3_unscaled(&self, y: DPtr, f32_out: bool, xq: DPtr, wq: DPtr, m: usize, n: usize, k: usize) -> Result<bool> {
        if m == 0 || n == 0 {
            return Ok(true);
        }
        // FP8 cuBLASLt needs 16-element leading dimensions and 16-byte aligned operands.
        if !k.is_multiple_of(16) || !n.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) || !y.is_multiple_of(16) {
            return Ok(false);
        }
        let key = PlanKey { m, n, k, f32_out, int8: false, sm_target: self.sm_target() };
        // SAFETY: as this function's contract.
        unsafe { self.run(key, y, xq, wq) }
    }

    /// `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]` over int8 codes, y bf16 or f32: cuBLASLt's int8 GEMM
    /// into exact int32 sums (in row chunks through its scratch), then `scale(y_rows, acc, xs_rows,
    /// rows)` for each chunk (the caller's `Kernels::scale_outer_i32` with the row scales `ws`,
    /// bit-identical to `gemm_w8a8`'s epilogue). false: nothing launched (cuBLASLt has no kernel for
    /// the shape).
    ///
    /// # Safety
    /// As [`BlasLt::gemm_e4m3_unscaled`] (with xs: m f32); `scale(y, acc, xs, m)` must write `m` rows of `y` from `m`
    /// rows of int32 sums at `acc`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_i8_rowwise(
        &self,
        y: DPtr,
        f32_out: bool,
        xq: DPtr,
        xs: DPtr,
        wq: DPtr,
        m: usize,
        n: usize,
        k: usize,
        scale: impl Fn(DPtr, DPtr, DPtr, usize) -> Result<()>,
    ) -> Result<bool> {
        if m == 0 || n == 0 {
            return Ok(true);
        }
        if !k.is_multiple_of(16) || !n.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) || !y.is_multiple_of(16) || n > ACC_ELEMS {
            return Ok(false);
        }
        let rows = (ACC_ELEMS / n).min(m);
        let (acc, _sync) = self.acc.device_ptr(self.stream.as_ref());
        let out_bytes = if f32_out { 4 } else { 2 };
        let mut r0 = 0;
        while r0 < m {
            let chunk = rows.min(m - r0);
            let key = PlanKey { m: chunk, n, k, f32_out: false, int8: true, sm_target: self.sm_target() };
            // SAFETY: the chunk's rows of xq and the scratch (chunk * n <= ACC_ELEMS) as the contract.
            let ran = unsafe { self.run(key, acc, xq + (r0 * k) as u64, wq)? };
            if !ran {
                if r0 == 0 {
                    return Ok(false);
                }
                return Err(KernelError::Unsupported(format!("cuBLASLt took the first rows of an int8 GEMM but not {chunk} rows (n {n}, k {k})")));
            }
            scale(y + (r0 * n * out_bytes) as u64, acc, xs + (r0 * 4) as u64, chunk)?;
            r0 += chunk;
        }
        Ok(true)
    }

    /// `acc = xq · wqᵀ` over int8 codes, as exact int32 sums in this handle's scratch (row-major m × n),
    /// for a consumer that applies the token and row scales itself (`ops::OuterScale::sums_i32`):
    /// Some(scratch) when it ran, None (nothing launched) where the sums do not fit the scratch in one
    /// piece or cuBLASLt has no kernel for the shape. The sums stay valid until the next int8 GEMM on
    /// this handle.
    ///
    /// # Safety
    /// xq: m*k bytes, wq: n*k bytes, 16-byte aligned; on this handle's stream.
    pub unsafe fn gemm_i8_into_scratch(&self, xq: DPtr, wq: DPtr, m: usize, n: usize, k: usize) -> Result<Option<DPtr>> {
        if m == 0 || n == 0 || m.saturating_mul(n) > ACC_ELEMS {
            return Ok(None);
        }
        if !k.is_multiple_of(16) || !n.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) {
            return Ok(None);
        }
        let (acc, _sync) = self.acc.device_ptr(self.stream.as_ref());
        let key = PlanKey { m, n, k, f32_out: false, int8: true, sm_target: self.sm_target() };
        // SAFETY: m * n <= ACC_ELEMS, the rest as this function's contract.
        Ok(unsafe { self.run(key, acc, xq, wq)? }.then_some(acc))
    }

    /// Runs `key`'s plan (made on first use) on `d = xq · wqᵀ` in our row-major terms; false where
    /// cuBLASLt has no kernel for it (nothing launched).
    ///
    /// # Safety
    /// As [`BlasLt::gemm_e4m3_unscaled`] for `key`'s shape and types.
    unsafe fn run(&self, key: PlanKey, d_ptr: DPtr, xq: DPtr, wq: DPtr) -> Result<bool> {
        let mut plans = self.plans.lock().map_err(|_| KernelError::Unsupported("cuBLASLt plan cache poisoned".into()))?;
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                plans.clear();
            }
            let mut plan = self.plan(key).ok();
            if let (Some(p), true) = (plan.as_mut(), key.int8 && self.tune) {
                // SAFETY: the operands are this call's, valid for `key`'s shape (the contract).
                if let Err(e) = unsafe { self.tune_int8(key, p, d_ptr, xq, wq) } {
                    // The heuristic's first stays: timing is an optimisation, never a failure.
                    tracing::warn!("cuBLASLt int8 plan for {}×{}×{} not timed: {e}", key.m, key.n, key.k);
                }
            }
            plans.insert(key, plan);
        }
        let Some(plan) = plans.get(&key).and_then(Option::as_ref) else { return Ok(false) };
        // Column-major view, as in `Blas::matmul`: yᵀ[n, m] = wq[n, k] (a k × n matrix, transposed) ·
        // xqᵀ[k, m]: cuBLASLt's A is the weight, B the tokens.
        // The scale type is f32 for FP8 and int32 for int8 (`plan`).
        let (alpha_f, beta_f, alpha_i, beta_i) = (1.0f32, 0.0f32, 1i32, 0i32);
        let (alpha, beta) = if key.int8 {
            (&alpha_i as *const i32 as *const c_void, &beta_i as *const i32 as *const c_void)
        } else {
            (&alpha_f as *const f32 as *const c_void, &beta_f as *const f32 as *const c_void)
        };
        // SAFETY: as this function's contract.
        unsafe { self.launch(plan, &plan.algo, alpha, beta, d_ptr, xq, wq) }?;
        Ok(true)
    }

    /// An int8 plan's algorithm: its size class's timed one where that class was timed (and cuBLASLt
    /// accepts it for this shape); else, outside a graph capture, the fastest of cuBLASLt's first
    /// [`TUNE_CANDIDATES`] on this call's operands (the heuristic's first unless another is
    /// [`TUNE_MARGIN`] faster), remembered for the class; else (inside a capture,
    /// where nothing can be timed) the heuristic's first, as `plan` chose. On the H200 the
    /// heuristic's first int8 choice ran Llama-3.1-8B's gate|up at 1,100–1,170 rows 1.8 × slower than
    /// the best of its others (docs/benchmarks.md). int8 sums are exact, so no choice changes a result.
    ///
    /// # Safety
    /// `d_ptr`, `xq`, `wq` as [`BlasLt::run`]'s for `key`: the candidates write `d_ptr` (the int32
    /// scratch) again and again.
    unsafe fn tune_int8(&self, key: PlanKey, plan: &mut Plan, d_ptr: DPtr, xq: DPtr, wq: DPtr) -> Result<()> {
        let class = TuneKey::of(&key);
        let mut tuned = self.tuned.lock().map_err(|_| KernelError::Unsupported("cuBLASLt tuning cache poisoned".into()))?;
        let [a, b, d] = plan.layouts;
        if let Some(algo) = tuned.get(&class) {
            let mut check = MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit();
            // SAFETY: descriptors live; the result is written by cuBLASLt.
            let ok = unsafe { sys::cublasLtMatmulAlgoCheck(self.handle, plan.desc, a, b, d, d, algo, check.as_mut_ptr()) };
            if ok == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                plan.algo = *algo;
            }
            return Ok(());
        }
        let capturing = self.stream.capture_status().map_err(|e| KernelError::Unsupported(format!("stream capture status: {e:?}")))?;
        if capturing != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(());
        }
        let mut found = [MaybeUninit::<sys::cublasLtMatmulHeuristicResult_t>::uninit(); TUNE_CANDIDATES];
        let mut count = 0i32;
        // SAFETY: descriptors live; `found` holds TUNE_CANDIDATES results.
        let listed = unsafe {
            let pref = workspace_preference().map_err(|e| lt_err("preference", e))?;
            let status = sys::cublasLtMatmulAlgoGetHeuristic(self.handle, plan.desc, a, b, d, d, pref, TUNE_CANDIDATES as i32, found.as_mut_ptr() as *mut _, &mut count);
            let _ = lt::destroy_matmul_pref(pref);
            status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        };
        if !listed || count <= 1 {
            return Ok(());
        }
        let mut best: Option<(f32, sys::cublasLtMatmulAlgo_t)> = None;
        let mut first_ms = None;
        for result in &found[..count as usize] {
            // SAFETY: cuBLASLt wrote the first `count` results.
            let result = unsafe { result.assume_init() };
            if result.state != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                continue;
            }
            let algo = result.algo;
            // One untimed run (a candidate cuBLASLt then refuses is skipped), then the timed ones.
            // SAFETY: as this function's contract.
            if unsafe { self.matmul_i8(plan, &algo, d_ptr, xq, wq) }.is_err() {
                continue;
            }
            let timed = (|| -> Result<f32> {
                let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
                let start = self.stream.record_event(flags)?;
                for _ in 0..TUNE_RUNS {
                    // SAFETY: as above.
                    unsafe { self.matmul_i8(plan, &algo, d_ptr, xq, wq) }?;
                }
                let end = self.stream.record_event(flags)?;
                Ok(start.elapsed_ms(&end)?)
            })();
            if let Ok(ms) = timed {
                let first = *first_ms.get_or_insert(ms);
                let bar = best.map_or(first * TUNE_MARGIN, |(b, _)| b.min(first * TUNE_MARGIN));
                if ms < bar {
                    best = Some((ms, algo));
                }
            }
        }
        // The heuristic's first (already in the plan) unless another beat it by the margin.
        let algo = best.map_or(plan.algo, |(_, algo)| algo);
        plan.algo = algo;
        tuned.insert(class, algo);
        Ok(())
    }

    /// `d = xq · wqᵀ` over int8 codes with `plan`'s descriptors and `algo` (int32 scale: 1 and 0).
    ///
    /// # Safety
    /// As [`BlasLt::run`] for the plan's shape.
    unsafe fn matmul_i8(&self, plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t, d_ptr: DPtr, xq: DPtr, wq: DPtr) -> Result<()> {
        let (alpha, beta) = (1i32, 0i32);
        // SAFETY: as this function's contract; the scalars outlive the call.
        unsafe { self.launch(plan, algo, &alpha as *const i32 as *const c_void, &beta as *const i32 as *const c_void, d_ptr, xq, wq) }
    }

    /// One cuBLASLt matmul `d = alpha · xq · wqᵀ + beta · d` with `plan`'s descriptors and `algo`
    /// (see [`BlasLt::run`] for the views; `alpha`/`beta` point at the plan's scale type).
    ///
    /// # Safety
    /// As [`BlasLt::run`] for the plan's shape; `alpha` and `beta` valid for the call.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        alpha: *const c_void,
        beta: *const c_void,
        d_ptr: DPtr,
        xq: DPtr,
        wq: DPtr,
    ) -> Result<()> {
        let (ws_ptr, _sync) = self.workspace.device_ptr(self.stream.as_ref());
        let [a, b, d] = plan.layouts;
        // SAFETY: descriptors live; pointers as the caller's contract; the workspace is ours.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                alpha,
                beta,
                wq as *const c_void,
                a,
                xq as *const c_void,
                b,
                d_ptr as *const c_void,
                d,
                d_ptr as *mut c_void,
                d,
                algo,
                ws_ptr as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err("matmul", e))
    }

    /// Descriptors for one shape and cuBLASLt's first-choice algorithm for them.
    fn plan(&self, key: PlanKey) -> std::result::Result<Plan, CublasError> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let PlanKey { m, n, k, f32_out, int8, sm_target } = key;
        let (m64, n64, k64) = (m as u64, n as u64, k as u64);
        let (compute, scale_type, code_type, d_type) = if int8 {
            (sys::cublasComputeType_t::CUBLAS_COMPUTE_32I, sys::cudaDataType::CUDA_R_32I, sys::cudaDataType::CUDA_R_8I, sys::cudaDataType::CUDA_R_32I)
        } else {
            let d_type = if f32_out { sys::cudaDataType::CUDA_R_32F } else { sys::cudaDataType::CUDA_R_16BF };
            (sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F, sys::cudaDataType::CUDA_R_8F_E4M3, d_type)
        };
        let desc = lt::create_matmul_desc(compute, scale_type)?;
        // Each layout is owned by the plan as soon as it exists, so an error below frees it.
        let mut plan = Plan { desc, layouts: [std::ptr::null_mut(); 3], algo: unsafe { MaybeUninit::zeroed().assume_init() } };
        plan.layouts[0] = lt::create_matrix_layout(code_type, k64, n64, k as i64)?;
        plan.layouts[1] = lt::create_matrix_layout(code_type, k64, m64, k as i64)?;
        plan.layouts[2] = lt::create_matrix_layout(d_type, n64, m64, n as i64)?;
        // SAFETY: the descriptor is live; each value outlives its call.
        unsafe {
            let set_u32 = |attr: Attr, v: u32| lt::set_matmul_desc_attribute(desc, attr, &v as *const u32 as *const c_void, size_of::<u32>());
            set_u32(Attr::CUBLASLT_MATMUL_DESC_TRANSA, cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as u32)?;
            set_u32(Attr::CUBLASLT_MATMUL_DESC_TRANSB, cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N as u32)?;
            if sm_target > 0 {
                let sms = i32::try_from(sm_target).unwrap_or(i32::MAX);
                lt::set_matmul_desc_attribute(desc, Attr::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms as *const i32 as *const c_void, size_of::<i32>())?;
            }
            let pref = workspace_preference()?;
            let [a, b, d] = plan.layouts;
            let found = lt::get_matmul_algo_heuristic(self.handle, desc, a, b, d, d, pref);
            let _ = lt::destroy_matmul_pref(pref);
            plan.algo = found?.algo;
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_shapes_share_a_timing_within_their_size_class() {
        let key = |m| PlanKey { m, n: 4096, k: 14336, f32_out: false, int8: true, sm_target: 0 };
        let rows = |m| TuneKey::of(&key(m)).rows;
        assert_eq!((rows(1), rows(64), rows(65), rows(1000), rows(1023)), (64, 64, 128, 1024, 1024));
        assert_eq!((rows(1024), rows(1100), rows(1170), rows(1280)), (1024, 1152, 1280, 1280));
        let other = PlanKey { sm_target: 116, ..key(100) };
        assert_ne!(TuneKey::of(&other), TuneKey::of(&key(100)), "an SM target is its own class");
    }
}

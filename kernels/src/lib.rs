//! Peregrine's CUDA kernels and their launch wrappers.
//!
//! - [`device`]: a GPU (context + the one stream work runs on), device buffers, a panic-free probe.
//! - [`compile`]: the `.cu` sources (embedded), compiled with NVRTC at run time and cached on disk.
//! - [`ops`]: one launch wrapper per kernel, one file per `.cu` family (embedding gather, add+RMSNorm, RoPE+KV write, paged
//!   attention, SiLU·mul, argmax, fills).
//! - [`gemm`]: bf16 GEMMs through cuBLAS; [`gemm_lt`]: row-wise FP8 GEMMs through cuBLASLt.
//!
//! Kernels know nothing of requests: they take tensors and plans (block tables, slot maps).
//! Libraries are loaded at run time (cudarc's dynamic loading), so building needs no CUDA toolkit.

pub mod compile;
pub mod device;
pub mod error;
pub mod gemm;
pub mod gemm_lt;
pub mod ops;
pub mod testing;

pub use cudarc;
pub use device::{probe, DevBuf, Gpu};
pub use error::{KernelError, Result};
pub use gemm::{Blas, OutType};
pub use ops::{DPtr, Kernels, KvCacheDtype, W8Format};

/// Above this many tokens an 8-bit linear leaves the GEMV for the tensor-core GEMM: measured on the
/// H100 (Llama-3.1-8B shape, fp8 decode, docs/benchmarks.md session 16), the tensor-core GEMV beats
/// cuBLASLt's FP8 GEMM up to 8 tokens (2 / 4 / 8 tokens: 522 / 1,008 / 1,931 tokens/s against 482 /
/// 944 / 1,856) and loses at 16 (3,432 against 3,575).
pub const GEMV8_DEFAULT_MAX_M: usize = 8;

/// The most tokens a bf16 linear sends to the skinny GEMV by default (cuBLAS above). Measured on an
/// H100 (Llama-3.1-8B shape, bf16 decode steps, docs/benchmarks.md "Session 12"): from 3 tokens
/// cuBLAS is faster, far faster at 8 (6.5 ms a step against the GEMV's 14.7); at 2 they tie.
pub const GEMV_DEFAULT_MAX_M: usize = 2;

/// A GPU with its kernels compiled and loaded and a cuBLAS handle on its stream.
pub struct Cuda {
    pub gpu: Gpu,
    pub kernels: Kernels,
    pub blas: Blas,
    /// Route GEMMs of at most `gemv_max_m` rows to the skinny kernel (on unless
    /// `PEREGRINE_GEMV=0`, which keeps everything on cuBLAS for comparisons).
    pub use_gemv: bool,
    /// The most tokens a bf16 linear sends to the GEMV: [`GEMV_DEFAULT_MAX_M`], or
    /// `PEREGRINE_GEMV_MAX_M` up to the kernels' [`ops::GEMV_MAX_M`] (for comparisons).
    pub gemv_max_m: usize,
    /// cuBLASLt for the FP8 GEMMs above the GEMV's rows (None where the library is missing or
    /// `PEREGRINE_GEMM8=ours` keeps them on our own tensor-core kernel).
    pub blas_lt: Option<gemm_lt::BlasLt>,
    /// The most tokens an 8-bit linear sends to the GEMV: [`GEMV8_DEFAULT_MAX_M`], or
    /// `PEREGRINE_GEMV8_MAX_M` up to the kernels' [`ops::GEMV_FP8_MAX_M`] (for comparisons).
    pub gemv8_max_m: usize,
    /// The device's multiprocessors.
    pub num_sms: usize,
}

impl Cuda {
    pub fn new(ordinal: usize) -> Result<Self> {
        let gpu = Gpu::new(ordinal)?;
        let module = compile::load_module(&gpu.ctx, gpu.arch)?;
        let sms = gpu
            .ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let kernels = Kernels::load(&module, sms.max(1) as u32, gpu.arch)?;
        let blas = Blas::new(&gpu.stream)?;
        let use_gemv = std::env::var("PEREGRINE_GEMV").map_or(true, |v| v != "0");
        let blas_lt = match std::env::var("PEREGRINE_GEMM8").as_deref() {
            Ok("ours") => None,
            _ => gemm_lt::BlasLt::new(&gpu.stream)?,
        };
        let gemv8_max_m = std::env::var("PEREGRINE_GEMV8_MAX_M")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(GEMV8_DEFAULT_MAX_M, |m| m.min(ops::GEMV_FP8_MAX_M));
        let gemv_max_m = std::env::var("PEREGRINE_GEMV_MAX_M")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(GEMV_DEFAULT_MAX_M, |m| m.min(ops::GEMV_MAX_M));
        Ok(Cuda { gpu, kernels, blas, use_gemv, blas_lt, gemv8_max_m, gemv_max_m, num_sms: sms.max(1) as usize })
    }

    /// `y[m, n] = x[m, k] · w[n, k]ᵀ` (a linear layer on `m` tokens): the skinny bandwidth-bound
    /// kernel for decode-sized m, cuBLAS otherwise. Which path runs depends on m, so results may
    /// differ in the last bf16 bit between batch sizes (summation order).
    ///
    /// # Safety
    /// As [`Blas::matmul`] with beta = 0.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear(&self, y: DPtr, out: OutType, x: DPtr, w: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        if self.linear_is_gemv(m, k, x, w) {
            self.kernels.gemv(&self.gpu.stream, y, out == OutType::F32, x, w, m, n, k)
        } else {
            self.blas.matmul(y, out, x, w, m, n, k, 0.0)
        }
    }

    /// Whether [`Cuda::linear_w8`] runs the 8-bit GEMV (not a GEMM) for `m` tokens: its output is
    /// then final (no scales left to the consumer).
    pub fn linear_w8_is_gemv(&self, m: usize) -> bool {
        self.use_gemv && m <= self.gemv8_max_m
    }

    /// Whether [`Cuda::linear`] runs the skinny GEMV (not cuBLAS) for these arguments.
    pub fn linear_is_gemv(&self, m: usize, k: usize, x: DPtr, w: DPtr) -> bool {
        self.use_gemv && m <= self.gemv_max_m && k.is_multiple_of(8) && x.is_multiple_of(16) && w.is_multiple_of(16)
    }

    /// [`Cuda::linear`] of one token into bf16 with its LoRA shrink as the GEMV's extra rows
    /// ([`ops::GemvLoraRows`]); only where [`Cuda::linear_is_gemv`] holds for m = 1.
    ///
    /// # Safety
    /// As [`Cuda::linear`] and [`Kernels::gemv_lora_rows`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear_lora_rows(&self, y: DPtr, x: DPtr, w: DPtr, n: usize, k: usize, rows: &ops::GemvLoraRows) -> Result<()> {
        if !self.linear_is_gemv(1, k, x, w) {
            return Err(KernelError::Unsupported("LoRA rows need the GEMV path (PEREGRINE_GEMV on, k % 8 == 0, aligned)".into()));
        }
        self.kernels.gemv_lora_rows(&self.gpu.stream, y, x, w, n, k, rows)
    }

    /// [`Cuda::linear_w8`] of one token into bf16 with its LoRA shrink from the token's bf16 row `x`
    /// (and, with `rows.expand`, the update added into y) in the same launch
    /// ([`Kernels::gemv_w8_lora_rows`]); only where [`Cuda::linear_w8_is_gemv`] holds for m = 1.
    ///
    /// # Safety
    /// As [`Cuda::linear_w8`] and [`Kernels::gemv_w8_lora_rows`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear_w8_lora_rows(&self, format: W8Format, y: DPtr, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, n: usize, k: usize, x: DPtr, rows: &ops::GemvLoraRows) -> Result<()> {
        if !self.linear_w8_is_gemv(1) {
            return Err(KernelError::Unsupported("LoRA rows need the 8-bit GEMV path (PEREGRINE_GEMV on)".into()));
        }
        self.kernels.gemv_w8_lora_rows(&self.gpu.stream, format, y, xq, xs, wq, ws, n, k, x, rows)
    }

    /// `y[m, n] = (xq · wqᵀ) · xs[i] · ws[j]`, a linear layer over row-wise 8-bit weights (`wq`
    /// n × k codes, `ws` one scale per output row) and per-token 8-bit activations (`xq` m × k
    /// codes, `xs` one scale per token): the 8-bit GEMV for decode-sized m (≤ `gemv8_max_m`), above that cuBLASLt's FP8 GEMM with row scales for e4m3 where it
    /// takes the shape, else our tensor-core GEMM (always the GEMMs with `PEREGRINE_GEMV=0`; never
    /// cuBLASLt with `PEREGRINE_GEMM8=ours`).
    ///
    /// # Safety
    /// As [`Kernels::gemm_w8a8`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear_w8(&self, format: W8Format, y: DPtr, out: OutType, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        self.linear_w8_inner(format, y, out, xq, xs, wq, ws, m, n, k, false).map(|_| ())
    }

    /// [`Cuda::linear_w8`] that may leave the token and row scales to the kernel that consumes `y`:
    /// Some(scale) when it did, None when `y` is final. e4m3 (cuBLASLt's unscaled GEMM): `y` holds
    /// the raw dot products, and that kernel must multiply by them; saves `scale_outer`'s pass over
    /// the output, a tenth of a batch-256 fp8 decode step on an H100. int8: the exact int32 sums stay
    /// in cuBLASLt's scratch (`scale.sums_i32`; `y` is not written), saving `scale_outer_i32`'s
    /// pass; the consumer must run before the next 8-bit linear.
    ///
    /// # Safety
    /// As [`Kernels::gemm_w8a8`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn linear_w8_deferred(&self, format: W8Format, y: DPtr, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<Option<ops::OuterScale>> {
        self.linear_w8_inner(format, y, OutType::Bf16, xq, xs, wq, ws, m, n, k, true)
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn linear_w8_inner(&self, format: W8Format, y: DPtr, out: OutType, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize, defer: bool) -> Result<Option<ops::OuterScale>> {
        let f32_out = out == OutType::F32;
        if self.use_gemv && m <= self.gemv8_max_m {
            return self.kernels.gemv_w8(&self.gpu.stream, format, y, f32_out, xq, xs, wq, ws, m, n, k).map(|()| None);
        }
        if let Some(lt) = &self.blas_lt {
            let s = &self.gpu.stream;
            match format {
                W8Format::E4m3 => {
                    if lt.gemm_e4m3_unscaled(y, f32_out, xq, wq, m, n, k)? {
                        if defer {
                            return Ok(Some(ops::OuterScale::bf16(xs, ws)));
                        }
                        return self.kernels.scale_outer(s, y, f32_out, xs, ws, m, n).map(|()| None);
                    }
                }
                W8Format::I8 => {
                    if defer {
                        if let Some(sums) = lt.gemm_i8_into_scratch(xq, wq, m, n, k)? {
                            return Ok(Some(ops::OuterScale { xs, ws, sums_i32: sums }));
                        }
                    }
                    let scale = |y_rows, acc, xs_rows, rows| self.kernels.scale_outer_i32(s, y_rows, f32_out, acc, xs_rows, ws, rows, n);
                    if lt.gemm_i8_rowwise(y, f32_out, xq, xs, wq, m, n, k, scale)? {
                        return Ok(None);
                    }
                }
            }
        }
        self.kernels.gemm_w8a8(&self.gpu.stream, format, y, f32_out, xq, xs, wq, ws, m, n, k).map(|()| None)
    }

    /// Plans the next cuBLAS and cuBLASLt GEMMs for `sms` multiprocessors (0: all of them), leaving
    /// the rest to kernels on another stream ([`Blas::set_sm_count_target`]).
    pub fn set_sm_count_target(&self, sms: usize) -> Result<()> {
        if let Some(lt) = &self.blas_lt {
            lt.set_sm_count_target(sms);
        }
        self.blas.set_sm_count_target(sms)
    }

    /// The fused gate/up projection with SwiGLU on `m` tokens, `act[m, inter] = silu(x · gate) * (x ·
    /// up)` for `w_gate_up` = [gate; up] ([2 inter, k]), in one skinny kernel where `linear` would
    /// take the skinny path; returns false (nothing launched) where it would not, and the caller runs
    /// `linear` + `silu_mul`.
    ///
    /// # Safety
    /// act: m*inter bf16; x: m*k bf16; w_gate_up: 2*inter*k bf16.
    pub unsafe fn gate_up_silu(&self, act: DPtr, x: DPtr, w_gate_up: DPtr, m: usize, inter: usize, k: usize) -> Result<bool> {
        if self.use_gemv && m <= self.gemv_max_m && k.is_multiple_of(8) && x.is_multiple_of(16) && w_gate_up.is_multiple_of(16) {
            self.kernels.gemv_silu(&self.gpu.stream, act, x, w_gate_up, m, inter, k)?;
            Ok(true)
        } else {
            Ok(false)
        }
    }
}

//! quant8.cu: per-token 8-bit activation quantization fused into RMSNorm and SiLU·mul (the inputs
//! of the W8A8 linears), each also writing its usual bf16 output (read by LoRA).

use cudarc::driver::{CudaStream, LaunchConfig};

use super::{as_i32, as_u32, cfg, DPtr, Kernels, Launch, LoraDelta, W8Format};
use crate::{KernelError, Result};

/// The widest row `silu_mul_quant` rotates (its Walsh–Hadamard holds the row in shared memory).
pub const SILU_HADAMARD_MAX_INTER: usize = 16384;
/// The dynamic shared memory that takes, opted into when the kernels load.
pub(crate) const SILU_HADAMARD_SMEM_MAX: usize = 4 * SILU_HADAMARD_MAX_INTER;

/// The token and row scales an unscaled 8-bit GEMM left to the kernel that consumes its output
/// (`Cuda::linear_w8_deferred`): that kernel multiplies each value by `xs[token] · ws[column]`, which
/// saves `scale_outer`'s pass over the output. `xs` may be the buffer the consumer writes its own
/// token scales to (each row's is read before it is overwritten). `sums_i32` (0 for none): an int8
/// GEMM's int32 sums, which the consumer reads there instead of the output buffer it is given (the
/// conversion to bf16 deferred too); they live in cuBLASLt's scratch, so the consumer must run before
/// the next int8 GEMM.
#[derive(Debug, Clone, Copy)]
pub struct OuterScale {
    pub xs: DPtr,
    pub ws: DPtr,
    pub sums_i32: DPtr,
}

impl OuterScale {
    /// Scales for a bf16 output the consumer reads where it was written.
    pub fn bf16(xs: DPtr, ws: DPtr) -> Self {
        OuterScale { xs, ws, sums_i32: 0 }
    }

    /// The three kernel arguments (null pointers for None).
    pub(crate) fn args(scale: Option<OuterScale>) -> (DPtr, DPtr, DPtr) {
        scale.map_or((0, 0, 0), |s| (s.xs, s.ws, s.sums_i32))
    }
}

impl Kernels {
    /// [`Kernels::add_rmsnorm`] (with `lora` as there) on all `n` rows (no row selection), which also writes each normalized
    /// row's codes to `q` (`n × hidden` bytes) and its scale to `scales` (computed from the f32
    /// values, before their bf16 rounding).
    ///
    /// # Safety
    /// residual: n*hidden f32; delta and lora's buffer: like residual in bf16; weight: hidden f32;
    /// out: n*hidden bf16 or 0 (no bf16 copy); q: n*hidden bytes; scales: n f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn add_rmsnorm_quant(&self, s: &CudaStream, format: W8Format, residual: DPtr, delta: Option<DPtr>, weight: DPtr, out: DPtr, q: DPtr, scales: DPtr, n: usize, hidden: usize, eps: f32, lora: Option<LoraDelta>, delta_scale: Option<OuterScale>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (lora_d, lora_slots) = LoraDelta::args(lora);
        let (dxs, dws, delta_i32) = OuterScale::args(delta_scale);
        self.check_w8(format, "add_rmsnorm_quant")?;
        let delta = delta.unwrap_or(0);
        let hidden_i = as_i32(hidden, "hidden")?;
        let threads = Self::row_threads(hidden, "add_rmsnorm_quant")?;
        Launch::new(&self.add_rmsnorm_quant[format.index()])
            .arg(&residual)
            .arg(&delta)
            .arg(&weight)
            .arg(&out)
            .arg(&q)
            .arg(&scales)
            .arg(&hidden_i)
            .arg(&eps)
            .arg(&lora_d)
            .arg(&lora_slots)
            .arg(&dxs)
            .arg(&dws)
            .arg(&delta_i32)
            .launch(s, cfg(as_u32(n, "tokens")?, threads), false)?;
        Ok(())
    }

    /// [`Kernels::silu_mul`] (with `lora` as there) that also writes each output row's codes to `q` (`n × inter` bytes) and
    /// its scale to `scales` (from the f32 values). One block per row. `hadamard_block` Some(b):
    /// each row is first rotated by the normalized Walsh–Hadamard matrix of each block of `b`
    /// channels (b a power of two from 8 to 2048 dividing `inter`, `inter` at most
    /// [`SILU_HADAMARD_MAX_INTER`]), codes, scale and bf16 copy alike: down_proj's online rotation
    /// (`model::rotate` in the engine).
    ///
    /// # Safety
    /// out: n*inter bf16 or 0 (no bf16 copy); q: n*inter bytes; scales: n f32; gate_up: n*2*inter bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn silu_mul_quant(&self, s: &CudaStream, format: W8Format, out: DPtr, q: DPtr, scales: DPtr, gate_up: DPtr, n: usize, inter: usize, lora: Option<LoraDelta>, gate_up_scale: Option<OuterScale>, hadamard_block: Option<usize>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (had, smem) = match hadamard_block {
            None => (0i32, 0u32),
            Some(b) => {
                if !b.is_power_of_two() || !(8..=2048).contains(&b) || !inter.is_multiple_of(b) || inter > SILU_HADAMARD_MAX_INTER {
                    return Err(KernelError::Unsupported(format!(
                        "silu_mul_quant: a Walsh–Hadamard block of {b} over {inter} channels (a power of two from 8 to 2048 dividing them, at most {SILU_HADAMARD_MAX_INTER} channels)"
                    )));
                }
                // Blocks up to 256 rotate within warps; longer ones pass through shared memory.
                (b as i32, if b > 256 { (4 * inter) as u32 } else { 0 })
            }
        };
        let (lora_d, lora_slots) = LoraDelta::args(lora);
        let (dxs, dws, gate_up_i32) = OuterScale::args(gate_up_scale);
        self.check_w8(format, "silu_mul_quant")?;
        let inter_i = as_i32(inter, "intermediate")?;
        let threads = Self::row_threads(inter, "silu_mul_quant")?;
        Launch::new(&self.silu_mul_quant[format.index()])
            .arg(&out)
            .arg(&q)
            .arg(&scales)
            .arg(&gate_up)
            .arg(&inter_i)
            .arg(&lora_d)
            .arg(&lora_slots)
            .arg(&dxs)
            .arg(&dws)
            .arg(&gate_up_i32)
            .arg(&had)
            .launch(s, LaunchConfig { shared_mem_bytes: smem, ..cfg(as_u32(n, "tokens")?, threads) }, false)?;
        Ok(())
    }

    /// `y[i, j] *= xs[i] · ws[j]` in place over an `m × n` output (bf16 or f32): the token and row
    /// scales of an 8-bit GEMM that ran unscaled.
    ///
    /// # Safety
    /// y: m*n of its type, 16-byte aligned; xs: m f32; ws: n f32; n a multiple of 8.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scale_outer(&self, s: &CudaStream, y: DPtr, y_f32: bool, xs: DPtr, ws: DPtr, m: usize, n: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let blocks = outer8_blocks("scale_outer", m, n, &[y])?;
        let (yf, mi, ni) = (y_f32 as i32, as_i32(m, "m")?, as_i32(n, "n")?);
        Launch::new(&self.scale_outer)
            .arg(&y)
            .arg(&yf)
            .arg(&xs)
            .arg(&ws)
            .arg(&mi)
            .arg(&ni)
            .launch(s, cfg(blocks, 256), false)?;
        Ok(())
    }

    /// `y[i, j] = acc[i, j] · xs[i] · ws[j]` over an `m × n` output (bf16 or f32) from the exact
    /// int32 sums of an int8 GEMM that ran unscaled: the same expression, in the same order, as
    /// `gemm_w8a8`'s int8 epilogue, so the results are bit-identical to it.
    ///
    /// # Safety
    /// y: m*n of its type and acc: m*n i32, both 16-byte aligned; xs: m f32; ws: n f32; n a multiple of 8.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn scale_outer_i32(&self, s: &CudaStream, y: DPtr, y_f32: bool, acc: DPtr, xs: DPtr, ws: DPtr, m: usize, n: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let blocks = outer8_blocks("scale_outer_i32", m, n, &[y, acc])?;
        let (yf, mi, ni) = (y_f32 as i32, as_i32(m, "m")?, as_i32(n, "n")?);
        Launch::new(&self.scale_outer_i32)
            .arg(&y)
            .arg(&yf)
            .arg(&acc)
            .arg(&xs)
            .arg(&ws)
            .arg(&mi)
            .arg(&ni)
            .launch(s, cfg(blocks, 256), false)?;
        Ok(())
    }
}

/// Blocks of 256 threads for the outer-scale epilogues (8 outputs per thread), after checking their
/// shape: n a multiple of 8, every buffer 16-byte aligned.
fn outer8_blocks(kernel: &str, m: usize, n: usize, buffers: &[DPtr]) -> Result<u32> {
    if !n.is_multiple_of(8) || buffers.iter().any(|b| !b.is_multiple_of(16)) {
        return Err(crate::KernelError::Unsupported(format!("{kernel}: n {n} (a multiple of 8, 16-byte aligned buffers)")));
    }
    let threads = m.checked_mul(n / 8).ok_or_else(|| crate::KernelError::Unsupported(format!("{kernel}: m * n overflows")))?;
    as_u32(threads.div_ceil(256), "outer-scale blocks")
}

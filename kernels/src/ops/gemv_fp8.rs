//! gemv_fp8.cu and gemv_mma8.cu: row-wise 8-bit W8A8 for decode-sized steps: per-token activation
//! quantization and the e4m3 (sm_89+) and int8 GEMVs with both scales in their epilogue.

use cudarc::driver::{CudaFunction, CudaStream, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, GemvLoraRows, Kernels, Launch, W8Format};
use crate::{KernelError, Result};

/// Largest row count the 8-bit GEMVs take (larger steps take [`Kernels::gemm_w8a8`]).
pub const GEMV_FP8_MAX_M: usize = 16;
const GEMV8_WARPS: usize = 8;
/// Warps per block and bytes of each row per stage of the tensor-core GEMV (GST8_WARPS, GST8_PIECE
/// in gemv_mma8.cu).
const GEMV8_MMA_WARPS: usize = 4;
const GEMV8_MMA_PIECE: usize = 256;
/// Weight rows per warp tile of the one-token GEMV unless `PEREGRINE_GEMV8_M1_ROWS` says otherwise:
/// 2, from batch-1 decode on an H100 (Llama-3.1-8B shape; docs/benchmarks.md, session 9): fp8 223.8
/// (1 row) / 227.9 (2) / 226.5 (4) tokens/s, int8 232.7 / 242.6 / 240.8.
pub(super) const GEMV8_M1_ROWS_DEFAULT: usize = 2;
/// Warps the tensor-core GEMV aims to have in flight per SM (the plan gives a 16-row tile more warps,
/// each a share of k, until the grid reaches this): its blocks of 4 warps and 48 KB fit 4 to an SM.
pub(super) const GEMV8_MMA_WARPS_PER_SM: usize = 16;

/// Which kernel computes an 8-bit GEMV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemv8Kernel {
    /// gemv_mma8.cu: codes straight into mma.sync, the weights streamed through shared memory
    /// (fp8 accumulation as cuBLASLt's for e4m3; exact for int8); 1..8 tokens cost what one does.
    TensorCores,
    /// gemv_fp8.cu: codes decoded to f32 on the CUDA cores, f32 sums (the CPU's results to f32
    /// rounding).
    CudaCores,
}

impl Gemv8Kernel {
    /// The tensor-core kernel unless `PEREGRINE_GEMV8=cores` (faster at every m ≤ 16 on an H100:
    /// docs/benchmarks.md, session 16).
    pub(super) fn from_env() -> Self {
        match std::env::var("PEREGRINE_GEMV8").as_deref() {
            Ok("cores") => Gemv8Kernel::CudaCores,
            _ => Gemv8Kernel::TensorCores,
        }
    }
}

/// The one-token LoRA expand [`Kernels::gemv_w8_lora_rows`] adds in the 8-bit GEMV's epilogue: per
/// module of the rows (in their order) its B stack for the layer (`[slots, out, r_pad]` bf16, as
/// [`super::LoraModule`]), its output width and first column in y; and an i32 counter of this
/// launch's own that is 0 when it starts (the LoRA blocks count themselves done in it, and the GEMV's
/// tile blocks wait for that count before reading t; nothing sets it back: [`Kernels::lora_group`]
/// can zero a step's counters).
#[derive(Debug, Clone, Copy)]
pub struct GemvLoraExpand {
    pub b: [DPtr; 3],
    pub out: [usize; 3],
    pub col: [usize; 3],
    pub counter: DPtr,
}

impl Kernels {
    /// Whether the FP8 kernels can run here (e4m3 conversions need compute capability 8.9+).
    pub fn fp8_gemm_ready(&self) -> bool {
        self.fp8_arch
    }

    /// Whether the 8-bit kernels of `format` can run here (e4m3: compute capability 8.9+; int8's
    /// tensor-core GEMM: 8.0+).
    pub fn w8_ready(&self, format: W8Format) -> bool {
        match format {
            W8Format::E4m3 => self.fp8_arch,
            W8Format::I8 => self.int8_arch,
        }
    }

    pub(super) fn check_w8(&self, format: W8Format, what: &str) -> Result<()> {
        if self.w8_ready(format) {
            Ok(())
        } else {
            Err(KernelError::Unsupported(format!("{what} ({format:?}) needs compute capability {}+", format.min_arch())))
        }
    }

    /// `q[m, k]` = e4m3 codes of each bf16 row of `x` divided by its scale, `scales[m]` = the row's
    /// max |x| / 448 (0 for a zero row).
    ///
    /// # Safety
    /// x: m*k bf16; q: m*k bytes; scales: m f32.
    pub unsafe fn quant_rows_e4m3(&self, s: &CudaStream, q: DPtr, scales: DPtr, x: DPtr, m: usize, k: usize) -> Result<()> {
        self.quant_rows(s, W8Format::E4m3, q, scales, x, m, k)
    }

    /// `q[m, k]` = 8-bit codes of each bf16 row of `x` divided by its scale, `scales[m]` = the row's
    /// max |x| / the format's largest code (0 for a zero row).
    ///
    /// # Safety
    /// x: m*k bf16; q: m*k bytes; scales: m f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn quant_rows(&self, s: &CudaStream, format: W8Format, q: DPtr, scales: DPtr, x: DPtr, m: usize, k: usize) -> Result<()> {
        if m == 0 || k == 0 {
            return Ok(());
        }
        self.check_w8(format, "quant_rows")?;
        let func = match format {
            W8Format::E4m3 => &self.quant_rows_e4m3,
            W8Format::I8 => &self.quant_rows_i8,
        };
        let ki = as_i32(k, "k")?;
        let threads = Self::row_threads(k, "quant_rows")?;
        s.launch_builder(func).arg(&q).arg(&scales).arg(&x).arg(&ki).launch(cfg(as_u32(m, "rows")?, threads))?;
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
        self.gemv_w8(s, W8Format::E4m3, y, y_f32, xq, xs, wq, ws, m, n, k)
    }

    /// As [`Kernels::gemv_e4m3`] for codes of `format` (int8: exact integer sums).
    ///
    /// # Safety
    /// As [`Kernels::gemv_e4m3`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_w8(&self, s: &CudaStream, format: W8Format, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        self.gemv_w8_with(self.gemv8_kernel, s, format, y, y_f32, xq, xs, wq, ws, m, n, k)
    }

    /// [`Kernels::gemv_w8`] on the kernel named (tests and benchmarks compare the two).
    ///
    /// # Safety
    /// As [`Kernels::gemv_e4m3`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_w8_with(&self, kernel: Gemv8Kernel, s: &CudaStream, format: W8Format, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        self.check_w8(format, "gemv_w8")?;
        if m > GEMV_FP8_MAX_M || !k.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("gemv_w8: m {m}, k {k} (m <= {GEMV_FP8_MAX_M}, k % 16 == 0, aligned)")));
        }
        if kernel == Gemv8Kernel::TensorCores {
            return self.gemv8_mma(s, format, y, y_f32, xq, xs, wq, ws, m, n, k);
        }
        let index = match m {
            0..=1 => match self.gemv8_m1_rows {
                2 => 5,
                4 => 6,
                _ => 0,
            },
            2 => 1,
            3..=4 => 2,
            5..=8 => 3,
            _ => 4,
        };
        let func = match format {
            W8Format::E4m3 => &self.gemv_e4m3[index],
            W8Format::I8 => &self.gemv_i8[index],
        };
        let mut wpr = Self::gemv8_plan(k);
        if let Some((small, large)) = self.gemv8_wpr {
            wpr = if k >= 8192 { large } else { small };
        }
        let blocks = n.div_ceil(GEMV8_WARPS / wpr * Self::gemv8_rows(index));
        self.launch_gemv8(s, func, blocks, GEMV8_WARPS * 32, wpr, y, y_f32, xq, xs, wq, ws, m, n, k)
    }

    /// Launches an 8-bit GEMV kernel (both files share the argument list) with PDL where enabled.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_gemv8(&self, s: &CudaStream, func: &CudaFunction, blocks: usize, threads: usize, wpr: usize, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        let (yf, mi, ni, ki, wpr_i) = (y_f32 as i32, m as i32, as_i32(n, "n")?, as_i32(k, "k")?, wpr as i32);
        Launch::new(func)
            .arg(&y)
            .arg(&yf)
            .arg(&xq)
            .arg(&xs)
            .arg(&wq)
            .arg(&ws)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&wpr_i)
            .launch(s, cfg(as_u32(blocks, "gemv_w8 blocks")?, threads as u32), self.pdl)?;
        Ok(())
    }

    /// gemv_mma8.cu's kernel for m ≤ 16 (checked by the caller): blocks of [`GEMV8_MMA_WARPS`]
    /// warps, one or two 8-token column tiles.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemv8_mma(&self, s: &CudaStream, format: W8Format, y: DPtr, y_f32: bool, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        let func = &self.gemv8_mma[format.index()][usize::from(m > 8)];
        let tiles = n.div_ceil(16);
        let wpr = self.gemv8_mma_wpr(tiles, k)?;
        self.launch_gemv8(s, func, tiles.div_ceil(GEMV8_MMA_WARPS / wpr), GEMV8_MMA_WARPS * 32, wpr, y, y_f32, xq, xs, wq, ws, m, n, k)
    }

    /// Whether [`Kernels::gemv_w8_lora_rows`] can add the expand too (the tensor-core GEMV can; the
    /// CUDA-core one, `PEREGRINE_GEMV8=cores`, cannot).
    pub fn gemv_w8_expands_lora(&self) -> bool {
        self.gemv8_kernel == Gemv8Kernel::TensorCores
    }

    /// One token's 8-bit GEMV `y[1, n] = (xq · wqᵀ) · xs · ws` and, in the same launch, its LoRA
    /// shrink `t = scale · x · Aᵀ` over `rows`' modules from the token's bf16 row `x`
    /// (gemv_mma8.cu's `_lora_t1`): t's bits are [`Kernels::gemv_lora_rows`]'s, without a launch of
    /// the rows' own before the GEMV. Without `rows.expand`, y's bits are [`Kernels::gemv_w8`]'s;
    /// with it, y also has the token's update `t · Bᵀ` added before its rounding
    /// ([`GemvLoraExpand`]), so the step needs no expand launch. With the CUDA-core GEMV
    /// (`PEREGRINE_GEMV8=cores`) it is the rows' launch and the GEMV's, and an expand is refused.
    ///
    /// # Safety
    /// As [`Kernels::gemv_e4m3`] with m = 1 and a bf16 y, and as [`Kernels::gemv_lora_rows`] for `x`
    /// (k bf16, 16-byte aligned) and `rows`; the expand's B stacks hold `[slots, out, r_pad]` bf16 per
    /// module, its columns lie inside y's n, and its counter is an i32 that is 0 and that no other
    /// launch in flight uses.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_w8_lora_rows(&self, s: &CudaStream, format: W8Format, y: DPtr, xq: DPtr, xs: DPtr, wq: DPtr, ws: DPtr, n: usize, k: usize, x: DPtr, rows: &GemvLoraRows) -> Result<()> {
        if let Some(e) = &rows.expand {
            if !self.gemv_w8_expands_lora() || n == 0 {
                return Err(KernelError::Unsupported("gemv_w8_lora_rows: the expand needs the tensor-core 8-bit GEMV and base rows".into()));
            }
            let inside = (0..rows.n_modules).all(|m| e.col[m] + e.out[m] <= n);
            if !inside || e.counter == 0 || rows.r_pad > 64 || e.b.iter().take(rows.n_modules).any(|b| !b.is_multiple_of(16)) || !rows.t_hi.is_multiple_of(16) || !rows.t_lo.is_multiple_of(16) {
                return Err(KernelError::Unsupported("gemv_w8_lora_rows: the expand's columns past y, or unaligned B / t".into()));
            }
        }
        if self.gemv8_kernel == Gemv8Kernel::CudaCores || n == 0 {
            self.gemv_lora_rows(s, 0, x, x, 0, k, rows)?;
            return self.gemv_w8(s, format, y, false, xq, xs, wq, ws, 1, n, k);
        }
        self.check_w8(format, "gemv_w8_lora_rows")?;
        if !k.is_multiple_of(16) || !xq.is_multiple_of(16) || !wq.is_multiple_of(16) || !x.is_multiple_of(16) || rows.a.iter().take(rows.n_modules).any(|a| !a.is_multiple_of(16)) {
            return Err(KernelError::Unsupported(format!("gemv_w8_lora_rows: k {k} (k % 16 == 0, 16-byte aligned rows)")));
        }
        if !(1..=3).contains(&rows.n_modules) || rows.r_pad == 0 {
            return Err(KernelError::Unsupported(format!("gemv_w8_lora_rows: {} modules of rank {}", rows.n_modules, rows.r_pad)));
        }
        let tiles = n.div_ceil(16);
        let wpr = self.gemv8_mma_wpr(tiles, k)?;
        // The rows sum as gemv_lora_m1's with the bf16 GEMV's warps per row, 4 / that rows a block
        // (one for 8: the kernel's (row, part) items fit its 8 partial sums).
        let lora_wpr = self.gemv_wpr(0, k);
        if !matches!(lora_wpr, 1 | 2 | 4 | 8) {
            return Err(KernelError::Unsupported(format!("gemv_w8_lora_rows: {lora_wpr} warps per LoRA row (1, 2, 4 or 8)")));
        }
        let lora_blocks = (rows.n_modules * rows.r_pad).div_ceil((GEMV8_MMA_WARPS / lora_wpr).max(1));
        let blocks = as_u32(lora_blocks + tiles.div_ceil(GEMV8_MMA_WARPS / wpr), "gemv_w8_lora_rows blocks")?;
        let (yf, ni, ki, wpr_i) = (0i32, as_i32(n, "n")?, as_i32(k, "k")?, wpr as i32);
        let (r_i, nm, lwpr, lb) = (as_i32(rows.r_pad, "r_pad")?, rows.n_modules as i32, lora_wpr as i32, as_i32(lora_blocks, "LoRA blocks")?);
        let none = GemvLoraExpand { b: [0; 3], out: [0; 3], col: [0; 3], counter: 0 };
        let e = rows.expand.as_ref().unwrap_or(&none);
        let (out, col) = (e.out.map(|v| v as i32), e.col.map(|v| v as i32));
        let mut l = Launch::new(&self.gemv8_mma_lora[format.index()][usize::from(rows.expand.is_some())]);
        l.arg(&y).arg(&yf).arg(&xq).arg(&xs).arg(&wq).arg(&ws).arg(&ni).arg(&ki).arg(&wpr_i).arg(&x);
        l.arg(&rows.a[0]).arg(&rows.a[1]).arg(&rows.a[2]).arg(&rows.slots).arg(&rows.scales).arg(&rows.t_hi).arg(&rows.t_lo).arg(&r_i).arg(&nm).arg(&lwpr).arg(&lb);
        l.arg(&e.b[0]).arg(&e.b[1]).arg(&e.b[2]).arg(&out[0]).arg(&out[1]).arg(&out[2]).arg(&col[0]).arg(&col[1]).arg(&col[2]).arg(&e.counter);
        l.launch(s, cfg(blocks, (GEMV8_MMA_WARPS * 32) as u32), self.pdl)?;
        Ok(())
    }

    /// Warps per 16-row tile of [`Kernels::gemv8_mma`] for `tiles` tiles of `k`: the plan's, or
    /// `PEREGRINE_GEMV8_WPR`'s.
    fn gemv8_mma_wpr(&self, tiles: usize, k: usize) -> Result<usize> {
        let mut wpr = Self::gemv8_mma_plan(tiles, k, self.num_sms as usize * self.gemv8_mma_warps);
        if let Some((small, large)) = self.gemv8_wpr {
            wpr = if k >= 8192 { large } else { small };
        }
        if !matches!(wpr, 1 | 2 | 4) {
            return Err(KernelError::Unsupported(format!("gemv_w8 (tensor cores): {wpr} warps per tile (1, 2 or 4)")));
        }
        Ok(wpr)
    }

    /// Warps per 16-row tile of the tensor-core GEMV: doubled (up to its block's 4) until the grid has
    /// `target_warps` warps, while each warp keeps at least two 256-byte pieces of its rows.
    /// Llama-3.1-8B on 132 SMs, 16 warps per SM: q|k|v, o and down 4, gate|up 2.
    pub fn gemv8_mma_plan(tiles: usize, k: usize, target_warps: usize) -> usize {
        let pieces = k.div_ceil(GEMV8_MMA_PIECE);
        let mut wpr = 1;
        while wpr < GEMV8_MMA_WARPS && tiles * wpr < target_warps && pieces >= 4 * wpr {
            wpr *= 2;
        }
        wpr
    }

    /// Weight rows per warp tile of the 8-bit GEMV variant `index` (m up to 1, 2, 4, 8, 16, then
    /// m = 1 with 2 and 4 rows): 2 from m = 8, where re-reading the activations per weight row
    /// dominated. Must match the ROWS of the GEMV8 / GEMV8_M1 instances in gemv_fp8.cu.
    fn gemv8_rows(index: usize) -> usize {
        match index {
            0..=2 => 1,
            6 => 4,
            _ => 2,
        }
    }

    /// Warps per weight row of the 8-bit GEMV: the bf16 GEMV's plan ([`Kernels::gemv_plan`]) at the
    /// same bytes per warp (a code is half a bf16), so 2 below k = 8192 and 4 from there. Not yet
    /// measured on its own: `PEREGRINE_GEMV8_WPR=a,b` overrides it for a sweep.
    pub fn gemv8_plan(k: usize) -> usize {
        if k >= 8192 {
            4
        } else {
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensor_core_gemv_plan_splits_small_grids_and_keeps_two_pieces_per_warp() {
        let target = 132 * GEMV8_MMA_WARPS_PER_SM;
        assert_eq!(Kernels::gemv8_mma_plan(6144 / 16, 4096, target), 4, "q|k|v");
        assert_eq!(Kernels::gemv8_mma_plan(4096 / 16, 4096, target), 4, "o");
        assert_eq!(Kernels::gemv8_mma_plan(28672 / 16, 4096, target), 2, "gate|up");
        assert_eq!(Kernels::gemv8_mma_plan(4096 / 16, 14336, target), 4, "down");
        // SmolLM2's k 576 = 3 pieces: one warp per tile; 1536 = 6 pieces: two.
        assert_eq!(Kernels::gemv8_mma_plan(36, 576, target), 1);
        assert_eq!(Kernels::gemv8_mma_plan(36, 1536, target), 2);
    }

    #[test]
    fn row_kernels_get_about_two_chunks_per_thread_and_refuse_what_they_cannot_hold() {
        assert_eq!(Kernels::row_threads(4096, "t").unwrap(), 256);
        assert_eq!(Kernels::row_threads(14336, "t").unwrap(), 1024);
        assert_eq!(Kernels::row_threads(576, "t").unwrap(), 64);
        assert_eq!(Kernels::row_threads(64, "t").unwrap(), 64);
        assert_eq!(Kernels::row_threads(32768, "t").unwrap(), 1024);
        assert!(Kernels::row_threads(32776, "t").is_err(), "more than 4 chunks per thread");
        assert!(Kernels::row_threads(100, "t").is_err(), "not a multiple of 8");
    }
}

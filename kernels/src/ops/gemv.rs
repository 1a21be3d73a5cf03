//! gemv.cu: the skinny bandwidth-bound GEMM of decode, and its gate/up + SwiGLU variant.

use cudarc::driver::CudaStream;

use super::{as_i32, as_u32, cfg, DPtr, Kernels, Launch};
use crate::{KernelError, Result};

/// Largest row count the skinny GEMM (`gemv`) takes.
pub const GEMV_MAX_M: usize = 8;
const GEMV_WARPS: usize = 8;

impl Kernels {
    /// (unroll depth, warps per row) for a weight of `n` rows × `k`. From a sweep on an H100
    /// (`examples/micro.rs`, docs/benchmarks.md): 4 warps per row beat 1 or 2 for every Llama-3.1-8B
    /// shape, 8 for the long rows of the down projection; unroll 16 never beat 8.
    pub fn gemv_plan(_n: usize, k: usize) -> (usize, usize) {
        (8, if k >= 8192 { 8 } else { 4 })
    }

    /// Warps per row of the GEMVs that run the plan's unroll: `PEREGRINE_GEMV_WPR` where set, else
    /// [`Kernels::gemv_plan`]'s. One place, so that `gemv_lora_rows` sums its base rows exactly as
    /// `gemv` does.
    pub(super) fn gemv_wpr(&self, n: usize, k: usize) -> usize {
        match self.gemv_wpr {
            Some((small, large)) => if k >= 8192 { large } else { small },
            None => Self::gemv_plan(n, k).1,
        }
    }

    /// Skinny GEMM `y[m, n] = x[m, k] · w[n, k]ᵀ` for m ≤ [`GEMV_MAX_M`], k a multiple of 8
    /// (bandwidth-bound decode shapes); y bf16 or f32. Unroll depth and warps per row from
    /// [`Kernels::gemv_plan`].
    ///
    /// # Safety
    /// x: m*k bf16 and w: n*k bf16, both 16-byte aligned; y: m*n of the output type.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv(&self, s: &CudaStream, y: DPtr, y_f32: bool, x: DPtr, w: DPtr, m: usize, n: usize, k: usize) -> Result<()> {
        let unroll = Self::gemv_plan(n, k).0;
        self.gemv_with(s, y, y_f32, x, w, m, n, k, unroll, self.gemv_wpr(n, k))
    }

    /// [`Kernels::gemv`] with an explicit unroll depth (8 or 16) and warps per row (1, 2, 4 or 8).
    ///
    /// # Safety
    /// As [`Kernels::gemv`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_with(&self, s: &CudaStream, y: DPtr, y_f32: bool, x: DPtr, w: DPtr, m: usize, n: usize, k: usize, unroll: usize, wpr: usize) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        if m > GEMV_MAX_M || !k.is_multiple_of(8) || !x.is_multiple_of(16) || !w.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("gemv: m {m}, k {k} (m <= {GEMV_MAX_M}, k % 8 == 0, aligned)")));
        }
        if !matches!(wpr, 1 | 2 | 4 | 8) || !matches!(unroll, 8 | 16) {
            return Err(KernelError::Unsupported(format!("gemv: unroll {unroll}, {wpr} warps per row")));
        }
        let func = &self.gemv[(unroll == 16) as usize][gemv_m_index(m)];
        let (yf, mi, ni, ki, wpr_i) = (y_f32 as i32, m as i32, as_i32(n, "n")?, as_i32(k, "k")?, wpr as i32);
        let rows_per_block = GEMV_WARPS / wpr;
        let grid = as_u32(n.div_ceil(rows_per_block), "gemv blocks")?;
        Launch::new(func)
            .arg(&y)
            .arg(&yf)
            .arg(&x)
            .arg(&w)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&wpr_i)
            .launch(s, cfg(grid, (GEMV_WARPS * 32) as u32), self.pdl)?;
        Ok(())
    }
}

impl Kernels {
    /// `act[m, inter] = silu(x · gate_j) * (x · up_j)` for `w_gate_up` = [gate; up] ([2 inter, k]),
    /// m ≤ [`GEMV_MAX_M`]: the skinny GEMM with SwiGLU in its epilogue (gemv.cu), unroll 8 and the
    /// plan's warps per row (at most 4, so each block holds whole gate/up pairs).
    ///
    /// # Safety
    /// x: m*k bf16, w_gate_up: 2*inter*k bf16, both 16-byte aligned; act: m*inter bf16.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_silu(&self, s: &CudaStream, act: DPtr, x: DPtr, w_gate_up: DPtr, m: usize, inter: usize, k: usize) -> Result<()> {
        if m == 0 || inter == 0 {
            return Ok(());
        }
        if m > GEMV_MAX_M || !k.is_multiple_of(8) || !x.is_multiple_of(16) || !w_gate_up.is_multiple_of(16) {
            return Err(KernelError::Unsupported(format!("gemv_silu: m {m}, k {k} (m <= {GEMV_MAX_M}, k % 8 == 0, aligned)")));
        }
        let wpr = self.gemv_wpr(2 * inter, k).min(4);
        let func = &self.gemv_silu[gemv_m_index(m)];
        let (mi, ni, ki, wpr_i) = (m as i32, as_i32(inter, "intermediate")?, as_i32(k, "k")?, wpr as i32);
        let grid = as_u32((2 * inter).div_ceil(GEMV_WARPS / wpr), "gemv blocks")?;
        Launch::new(func)
            .arg(&act)
            .arg(&x)
            .arg(&w_gate_up)
            .arg(&mi)
            .arg(&ni)
            .arg(&ki)
            .arg(&wpr_i)
            .launch(s, cfg(grid, (GEMV_WARPS * 32) as u32), self.pdl)?;
        Ok(())
    }
}

/// One token's LoRA shrink, computed by [`Kernels::gemv_lora_rows`] beside its base projection:
/// the group's modules' A stacks for this layer (`[slots, r_pad, k]` bf16, as [`super::LoraModule`]),
/// the token's slot (device i32, -1 for none) and the slots' scales, and where t goes (bf16 hi + lo,
/// `n_modules * r_pad` columns: what [`Kernels::lora_shrink`] writes for a one-token step).
#[derive(Debug, Clone, Copy)]
pub struct GemvLoraRows {
    pub a: [DPtr; 3],
    pub n_modules: usize,
    pub r_pad: usize,
    pub slots: DPtr,
    pub scales: DPtr,
    pub t_hi: DPtr,
    pub t_lo: DPtr,
    /// The expand too, in the GEMV's epilogue: only the 8-bit GEMV takes it
    /// ([`Kernels::gemv_w8_lora_rows`]); the bf16 one refuses it.
    pub expand: Option<super::GemvLoraExpand>,
}

impl Kernels {
    /// `y[1, n] = x[1, k] · w[n, k]ᵀ` (bf16 out) and, in the same launch, one token's LoRA shrink
    /// `t = scale · x · Aᵀ` over `rows`' modules (gemv.cu's LORA): a one-token step's shrink without
    /// a launch of its own. The GEMV's sum order, so t may differ from the tensor-core shrinks' in
    /// the last bits (a one-token step's result depends only on its token either way). `n` = 0:
    /// the shrink alone (`y` is not written; `w` must still be a valid 16-byte aligned pointer).
    ///
    /// # Safety
    /// As [`Kernels::gemv`] with m = 1 and a bf16 y; `rows`' A stacks hold `r_pad` rows of `k` per
    /// slot, its slot is below their slot count or -1, and t holds `n_modules * r_pad` bf16.
    // The plain GEMV's arguments plus the LoRA rows, in the same order as `gemv`'s.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemv_lora_rows(&self, s: &CudaStream, y: DPtr, x: DPtr, w: DPtr, n: usize, k: usize, rows: &GemvLoraRows) -> Result<()> {
        if !k.is_multiple_of(8) || !x.is_multiple_of(16) || !w.is_multiple_of(16) || rows.a.iter().take(rows.n_modules).any(|a| !a.is_multiple_of(16)) {
            return Err(KernelError::Unsupported(format!("gemv_lora_rows: k {k} (k % 8 == 0, 16-byte aligned rows)")));
        }
        if !(1..=3).contains(&rows.n_modules) || rows.r_pad == 0 || rows.expand.is_some() {
            return Err(KernelError::Unsupported(format!("gemv_lora_rows: {} modules of rank {} (and no expand)", rows.n_modules, rows.r_pad)));
        }
        let wpr = self.gemv_wpr(n, k);
        let total = n + rows.n_modules * rows.r_pad;
        let grid = as_u32(total.div_ceil(GEMV_WARPS / wpr), "gemv blocks")?;
        let (ni, ki, wpr_i, r_i, nm) = (as_i32(n, "n")?, as_i32(k, "k")?, wpr as i32, as_i32(rows.r_pad, "r_pad")?, rows.n_modules as i32);
        let mut l = Launch::new(&self.gemv_lora_m1);
        l.arg(&y).arg(&x).arg(&w).arg(&ni).arg(&ki).arg(&wpr_i);
        l.arg(&rows.a[0]).arg(&rows.a[1]).arg(&rows.a[2]).arg(&rows.slots).arg(&rows.scales).arg(&rows.t_hi).arg(&rows.t_lo).arg(&r_i).arg(&nm);
        l.launch(s, cfg(grid, (GEMV_WARPS * 32) as u32), self.pdl)?;
        Ok(())
    }
}

/// The GEMV kernel table's column for `m` rows (kernels built for m ≤ 1, 2, 4, 8).
fn gemv_m_index(m: usize) -> usize {
    match m {
        0..=1 => 0,
        2 => 1,
        3..=4 => 2,
        _ => 3,
    }
}

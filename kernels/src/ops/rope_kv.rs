//! rope_kv.cu: RoPE on q and k, k and v written into the paged KV cache.

use cudarc::driver::{CudaStream, LaunchConfig};

use super::{as_i32, as_u32, DPtr, Kernels, KvCacheDtype, Launch};
use crate::{KernelError, Result};

/// rope_kv.cu's ROPE_HEADS: heads per block of `rope_kv_write`.
const ROPE_HEADS: i32 = 4;
/// rope_kv.cu's ROPE_HAD_MAX_D: largest head dimension the Hadamard variants stage.
const ROPE_HAD_MAX_D: usize = 128;

impl Kernels {
    /// RoPE on the q and k parts of `qkv` (+ optional f32 bias), q written to `q_out`, k and v into the
    /// paged caches at `slots[t]`, as `kv` elements in that type's layout ([`KvCacheDtype`]). With
    /// `hadamard`, every q and k head is then rotated by the normalized Walsh–Hadamard matrix (scores
    /// unchanged; k's outliers spread before rounding; `d` a power of two up to 128).
    ///
    /// # Safety
    /// qkv: n*(hq+2hkv)*d bf16; positions, slots: n i32; cos/sin: (max position + 1)*d/2 f32;
    /// q_out: n*hq*d bf16; caches: num_blocks*hkv*block_size*d elements of `kv` covering every slot.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_kv_write(&self, s: &CudaStream, qkv: DPtr, bias: Option<DPtr>, positions: DPtr, cos: DPtr, sin: DPtr, slots: DPtr, q_out: DPtr, k_cache: DPtr, v_cache: DPtr, n: usize, hq: usize, hkv: usize, d: usize, block_size: usize, kv: KvCacheDtype, hadamard: bool) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if d % 2 != 0 {
            return Err(KernelError::Unsupported(format!("rope: odd head_dim {d}")));
        }
        if hadamard && !(d.is_power_of_two() && d <= ROPE_HAD_MAX_D) {
            return Err(KernelError::Unsupported(format!("rope: Hadamard rotation of head_dim {d} (a power of two up to {ROPE_HAD_MAX_D})")));
        }
        self.check_kv_dtype(kv, block_size)?;
        let bias = bias.unwrap_or(0);
        let (hq, hkv, d, bs) = (as_i32(hq, "hq")?, as_i32(hkv, "hkv")?, as_i32(d, "head_dim")?, as_i32(block_size, "block_size")?);
        let func = match (kv, hadamard) {
            (KvCacheDtype::Bf16, false) => &self.rope_kv_write,
            (KvCacheDtype::Fp8E4m3, false) => &self.rope_kv_write_fp8,
            (KvCacheDtype::Bf16, true) => &self.rope_kv_write_had,
            (KvCacheDtype::Fp8E4m3, true) => &self.rope_kv_write_fp8_had,
        };
        Launch::new(func)
            .arg(&qkv)
            .arg(&bias)
            .arg(&positions)
            .arg(&cos)
            .arg(&sin)
            .arg(&slots)
            .arg(&q_out)
            .arg(&k_cache)
            .arg(&v_cache)
            .arg(&hq)
            .arg(&hkv)
            .arg(&d)
            .arg(&bs)
            .launch(s, LaunchConfig { grid_dim: (as_u32(n, "tokens")?, ((hq + 2 * hkv + ROPE_HEADS - 1) / ROPE_HEADS) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }, false)?;
        Ok(())
    }
}

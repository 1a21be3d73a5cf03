//! rope_kv.cu: RoPE on q and k, k and v written into the paged KV cache.

use cudarc::driver::{CudaStream, LaunchConfig};

use super::{as_i32, as_u32, DPtr, Kernels, KvCacheDtype, Launch, LoraDelta, OuterScale};
use crate::{KernelError, Result};

/// Where a RoPE kernel finds each token's position and the rotation tables.
#[derive(Debug, Clone, Copy)]
pub struct RopeTables {
    /// i32 per token.
    pub positions: DPtr,
    /// `[max position + 1, d / 2]` f32 each.
    pub cos: DPtr,
    pub sin: DPtr,
}

/// Where a RoPE + KV-write kernel stores q, k and v, and the attention shape.
#[derive(Debug, Clone, Copy)]
pub struct RopeCache {
    /// i32 per token: `block × block_size + offset` of its position in the paged cache.
    pub cache_slots: DPtr,
    /// `[n, hq × d]` bf16.
    pub q_out: DPtr,
    pub k_cache: DPtr,
    pub v_cache: DPtr,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub block_size: usize,
}

/// rope_kv.cu's ROPE_HEADS: heads per block of the block kernel (`rope_kv_write_impl`).
const ROPE_HEADS: i32 = 4;
/// rope_kv.cu's ROPE_WARP_HEADS: heads (warps) per block of the one-warp-per-head kernels.
const ROPE_WARP_HEADS: i32 = 4;
/// rope_kv.cu's ROPE_WARP_MAXV: values a lane holds at most in the one-warp-per-head kernels.
const ROPE_WARP_MAXV: usize = 4;
/// rope_kv.cu's ROPE_HAD_MAX_D: largest head dimension of the rotated and per-head-scaled caches.
const ROPE_HAD_MAX_D: usize = 128;

/// Which heads `rope_kv_write` rotates by the normalized Walsh–Hadamard matrix `H` before the cache
/// rounds them (`d` a power of two up to 128).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRotation {
    /// None (`--kv-cache-dtype fp8-plain`, bf16).
    None,
    /// q and k (`fp8-hadamard`): scores unchanged, k's outliers spread before rounding.
    QK,
    /// q, k and v (`fp8-hadamard-qkv`): v's rounding error is spread too; the attention output is
    /// then `H ·` the true one per head, and [`Kernels::hadamard_heads`] must rotate it back.
    QKV,
}

impl KvRotation {
    /// The rotation of q and k (`qk`) with or without v.
    pub fn of(qk: bool, v: bool) -> Result<KvRotation> {
        match (qk, v) {
            (false, false) => Ok(KvRotation::None),
            (true, false) => Ok(KvRotation::QK),
            (true, true) => Ok(KvRotation::QKV),
            (false, true) => Err(KernelError::Unsupported("rope: v is Hadamard-rotated only together with q and k".into())),
        }
    }
}

fn check_hadamard_dim(d: usize) -> Result<()> {
    if d.is_power_of_two() && (2..=ROPE_HAD_MAX_D).contains(&d) {
        Ok(())
    } else {
        Err(KernelError::Unsupported(format!("Hadamard rotation of head_dim {d} (a power of two up to {ROPE_HAD_MAX_D})")))
    }
}

/// Values a lane holds when one warp holds a head of `d` values (rope_kv.cu's `rope_warp_values`,
/// the same rule): the smallest of 1..=ROPE_WARP_MAXV with `(d / 2) % v == 0` and `d / v <= 32`.
/// None: no warp layout, the block kernel's fallback (only unrotated caches get there: every
/// power of two up to 128 has one).
fn rope_warp_values(d: usize) -> Option<usize> {
    (1..=ROPE_WARP_MAXV).find(|&v| (d / 2).is_multiple_of(v) && d / v <= 32)
}

/// Which rope_kv.cu kernel a launch runs, for its grid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RopeGrid {
    /// The 16-byte kernel: this many items a token, one per thread.
    Vec(usize),
    /// One warp per head.
    Warp,
    /// The block kernel: ROPE_HEADS heads a block.
    Block,
}

/// rope_kv_write's grid: a token's items over blocks of 128 threads (the 16-byte kernel),
/// ROPE_WARP_HEADS heads of a token per block of one warp each, or ROPE_HEADS heads of a token per
/// block of 256 threads.
fn rope_launch(n: usize, hq: i32, hkv: i32, grid: RopeGrid) -> Result<LaunchConfig> {
    let tokens = as_u32(n, "tokens")?;
    let heads = hq + 2 * hkv;
    Ok(match grid {
        RopeGrid::Vec(items) => LaunchConfig { grid_dim: (tokens, items.div_ceil(128) as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 },
        RopeGrid::Warp => LaunchConfig { grid_dim: (tokens, ((heads + ROPE_WARP_HEADS - 1) / ROPE_WARP_HEADS) as u32, 1), block_dim: (ROPE_WARP_HEADS as u32 * 32, 1, 1), shared_mem_bytes: 0 },
        RopeGrid::Block => LaunchConfig { grid_dim: (tokens, ((heads + ROPE_HEADS - 1) / ROPE_HEADS) as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 },
    })
}

impl Kernels {
    /// RoPE on the q and k parts of `qkv` (+ optional f32 bias), q written to `q_out`, k and v into the
    /// paged caches at `slots[t]`, as `kv` elements in that type's layout ([`KvCacheDtype`]), the
    /// heads `rotation` names rotated by the normalized Walsh–Hadamard matrix first; `lora`'s update
    /// is added to qkv as the bias is. `qkv_scale`: qkv is an 8-bit GEMM's unscaled output (or its
    /// int32 sums at `sums_i32`), scaled here before the bias ([`OuterScale`]).
    ///
    /// # Safety
    /// qkv and lora's buffer: n*(hq+2hkv)*d bf16; positions, slots: n i32; cos/sin: (max position + 1)*d/2 f32;
    /// q_out: n*hq*d bf16; caches: num_blocks*hkv*block_size*`kv.head_bytes(d)` bytes covering every slot.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rope_kv_write(&self, s: &CudaStream, qkv: DPtr, bias: Option<DPtr>, positions: DPtr, cos: DPtr, sin: DPtr, slots: DPtr, q_out: DPtr, k_cache: DPtr, v_cache: DPtr, n: usize, hq: usize, hkv: usize, d: usize, block_size: usize, kv: KvCacheDtype, rotation: KvRotation, lora: Option<LoraDelta>, qkv_scale: Option<OuterScale>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (lora_d, lora_slots) = LoraDelta::args(lora);
        let (dxs, dws, qkv_i32) = OuterScale::args(qkv_scale);
        if !d.is_multiple_of(2) {
            return Err(KernelError::Unsupported(format!("rope: odd head_dim {d}")));
        }
        if rotation != KvRotation::None {
            check_hadamard_dim(d)?;
        }
        if kv.has_head_scales() && d > ROPE_HAD_MAX_D {
            return Err(KernelError::Unsupported(format!("rope: a per-head-scaled cache stages head_dim {d} (at most {ROPE_HAD_MAX_D})")));
        }
        self.check_kv_dtype(kv, block_size)?;
        let bias = bias.unwrap_or(0);
        // Unrotated heads of a dimension that is a multiple of 16: rope_kv_write_vec's 16-byte
        // accesses, one item (8 RoPE pairs, or 8 values of v) per thread. Rotated or per-head-scaled
        // heads (rotated, or reduced for their max): one warp per head where the dimension has a warp
        // layout (always, for a rotation); the block kernel for the others.
        let staged = rotation != KvRotation::None || kv.has_head_scales();
        let grid = match (staged, rope_warp_values(d)) {
            (false, _) if d.is_multiple_of(16) => RopeGrid::Vec((hq + hkv) * (d / 16) + hkv * (d / 8)),
            (true, Some(_)) => RopeGrid::Warp,
            _ => RopeGrid::Block,
        };
        let (hq, hkv, d, bs) = (as_i32(hq, "hq")?, as_i32(hkv, "hkv")?, as_i32(d, "head_dim")?, as_i32(block_size, "block_size")?);
        let func = match (kv, rotation, grid) {
            (KvCacheDtype::Bf16, KvRotation::None, RopeGrid::Vec(_)) => &self.rope_kv_write_vec,
            (KvCacheDtype::Fp8E4m3, KvRotation::None, RopeGrid::Vec(_)) => &self.rope_kv_write_fp8_vec,
            (KvCacheDtype::Bf16, KvRotation::None, _) => &self.rope_kv_write,
            (KvCacheDtype::Fp8E4m3, KvRotation::None, _) => &self.rope_kv_write_fp8,
            (KvCacheDtype::Bf16, KvRotation::QK, _) => &self.rope_kv_write_had,
            (KvCacheDtype::Fp8E4m3, KvRotation::QK, _) => &self.rope_kv_write_fp8_had,
            (KvCacheDtype::Bf16, KvRotation::QKV, _) => &self.rope_kv_write_had_v,
            (KvCacheDtype::Fp8E4m3, KvRotation::QKV, _) => &self.rope_kv_write_fp8_had_v,
            (KvCacheDtype::Fp8E4m3PerHead, KvRotation::None, RopeGrid::Warp) => &self.rope_kv_write_fp8s_w,
            (KvCacheDtype::Fp8E4m3PerHead, KvRotation::None, _) => &self.rope_kv_write_fp8s,
            (KvCacheDtype::Fp8E4m3PerHead, KvRotation::QK, _) => &self.rope_kv_write_fp8s_had,
            (KvCacheDtype::Fp8E4m3PerHead, KvRotation::QKV, _) => &self.rope_kv_write_fp8s_had_v,
            (KvCacheDtype::Int8PerHead, KvRotation::None, RopeGrid::Warp) => &self.rope_kv_write_i8s_w,
            (KvCacheDtype::Int8PerHead, KvRotation::None, _) => &self.rope_kv_write_i8s,
            (KvCacheDtype::Int8PerHead, KvRotation::QK, _) => &self.rope_kv_write_i8s_had,
            (KvCacheDtype::Int8PerHead, KvRotation::QKV, _) => &self.rope_kv_write_i8s_had_v,
        };
        // Every rotated kernel is a warp kernel: check_hadamard_dim's powers of two all have a layout.
        debug_assert!(rotation == KvRotation::None || grid == RopeGrid::Warp);
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
            .arg(&lora_d)
            .arg(&lora_slots)
            .arg(&dxs)
            .arg(&dws)
            .arg(&qkv_i32)
            .launch(s, rope_launch(n, hq, hkv, grid)?, false)?;
        Ok(())
    }

    /// `x ← H x` for each of the `heads` heads of `d` values of the `n` bf16 rows of `x`, in place
    /// (`H` the normalized Walsh–Hadamard matrix, its own inverse): turns the attention output of a
    /// [`KvRotation::QKV`] cache back into the true one before o_proj reads it.
    ///
    /// # Safety
    /// x: n*heads*d bf16.
    pub unsafe fn hadamard_heads(&self, s: &CudaStream, x: DPtr, n: usize, heads: usize, d: usize) -> Result<()> {
        if n == 0 || heads == 0 {
            return Ok(());
        }
        check_hadamard_dim(d)?;
        let (h, d) = (as_i32(heads, "heads")?, as_i32(d, "head_dim")?);
        Launch::new(&self.hadamard_heads)
            .arg(&x)
            .arg(&h)
            .arg(&d)
            .launch(s, LaunchConfig { grid_dim: (as_u32(n, "tokens")?, ((h + ROPE_WARP_HEADS - 1) / ROPE_WARP_HEADS) as u32, 1), block_dim: (ROPE_WARP_HEADS as u32 * 32, 1, 1), shared_mem_bytes: 0 }, false)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The warp layout every launch relies on: `d / v` lanes of `v` values, each RoPE pair at one
    /// index of two lanes, and a layout for every head dimension a rotation accepts.
    #[test]
    fn warp_layout_fits_a_warp_and_keeps_rope_pairs_at_one_index() {
        assert_eq!(rope_warp_values(128), Some(4));
        assert_eq!(rope_warp_values(64), Some(2));
        assert_eq!(rope_warp_values(96), Some(3));
        assert_eq!(rope_warp_values(80), Some(4));
        assert_eq!(rope_warp_values(24), Some(1));
        assert_eq!(rope_warp_values(110), None, "55 has no divisor in 2..=4 and 110 values need more than 32 lanes");
        for d in (2..=ROPE_HAD_MAX_D).step_by(2) {
            if let Some(v) = rope_warp_values(d) {
                assert!(d / v <= 32 && (d / 2).is_multiple_of(v) && v <= ROPE_WARP_MAXV, "head_dim {d}: {v} a lane");
            }
            if check_hadamard_dim(d).is_ok() {
                assert!(rope_warp_values(d).is_some(), "rotated head_dim {d} without a warp layout");
            }
        }
    }
}

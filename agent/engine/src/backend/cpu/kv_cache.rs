//! The paged KV cache in host memory: per layer, K and V as `[block][kv_head][slot][head_dim]` f32,
//! so one head's keys within a block are contiguous.

use crate::backend::KvCacheShape;
use crate::model::rowquant::{e4m3_from_f32, e4m3_to_f32};
use crate::{EngineError, Result};

/// The values K or V are stored as. The CPU cache always holds f32, but rounded to the element type
/// a GPU cache would hold, so the CPU computes with the same values and measures what that type costs
/// (`peregrine-agent eval`); it saves no memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvElem {
    #[default]
    F32,
    /// Round to nearest even bf16.
    Bf16,
    /// e4m3, scale 1, saturating at ±448: the CUDA fp8 cache's values.
    Fp8E4m3,
    /// e4m3 with one scale per token and KV head, `max |x| / 448` (the CUDA `fp8-scaled` cache's values): each head's
    /// vector uses e4m3's whole range, so its small values keep 3 mantissa bits instead of falling
    /// into e4m3's subnormals below 2^-6.
    Fp8E4m3PerHead,
    /// int8 with one scale per token and KV head, `max |x| / 127` (the CUDA `int8` cache's values):
    /// a uniform grid over the head's range. For the near-Gaussian head vectors of K and V (more so
    /// after the q/k rotation) its error is a fraction of e4m3's 3-bit mantissa's.
    Int8PerHead,
}

impl KvElem {
    /// One token's head vector `src` as this type stores it, into `dst` (the whole vector, since a
    /// per-head type's scale depends on all of it); both of one length.
    pub fn round_head(self, src: &[f32], dst: &mut [f32]) {
        let e4m3 = |x: f32| e4m3_to_f32(e4m3_from_f32(x));
        match self {
            KvElem::F32 => dst.copy_from_slice(src),
            KvElem::Bf16 => dst.iter_mut().zip(src).for_each(|(d, &x)| *d = half::bf16::from_f32(x).to_f32()),
            KvElem::Fp8E4m3 => dst.iter_mut().zip(src).for_each(|(d, &x)| *d = e4m3(x)),
            KvElem::Fp8E4m3PerHead => {
                let scale = src.iter().fold(0f32, |m, &x| m.max(x.abs())) / 448.0;
                // A zero head stays zero (no division by a zero scale).
                dst.iter_mut().zip(src).for_each(|(d, &x)| *d = if scale > 0.0 { e4m3(x / scale) * scale } else { 0.0 });
            }
            KvElem::Int8PerHead => {
                let scale = src.iter().fold(0f32, |m, &x| m.max(x.abs())) / 127.0;
                // Round half away from zero (CUDA's __float2int_rn rounds half to even: a tie lies
                // on the grid's midpoint either way, so both are within half a step).
                let code = |x: f32| (x / scale).round().clamp(-127.0, 127.0);
                dst.iter_mut().zip(src).for_each(|(d, &x)| *d = if scale > 0.0 { code(x) * scale } else { 0.0 });
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvElem::F32 => "f32",
            KvElem::Bf16 => "bf16",
            KvElem::Fp8E4m3 => "fp8",
            KvElem::Fp8E4m3PerHead => "fp8/head",
            KvElem::Int8PerHead => "int8/head",
        }
    }
}

/// How the cache keeps K and V, and whether q and k are Hadamard-rotated per head before k is stored
/// ([`super::hadamard`]): scores are unchanged, k's outliers are spread before they are rounded.
/// `hadamard_v` rotates v too, and each head of the attention output back (H is its own inverse, so
/// the output is unchanged in exact arithmetic): a CPU-only measurement of what rotating V would buy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvFormat {
    pub k: KvElem,
    pub v: KvElem,
    pub hadamard: bool,
    pub hadamard_v: bool,
}

impl KvFormat {
    pub const F32: KvFormat = KvFormat { k: KvElem::F32, v: KvElem::F32, hadamard: false, hadamard_v: false };

    /// K and V both as `elem`, q/k rotated when `hadamard`.
    pub fn both(elem: KvElem, hadamard: bool) -> KvFormat {
        KvFormat { k: elem, v: elem, hadamard, hadamard_v: false }
    }

    /// A short label: `f32`, `fp8`, `fp8+hadamard`, `k fp8 / v bf16`, ...
    pub fn label(&self) -> String {
        let elems = if self.k == self.v {
            self.k.name().to_string()
        } else {
            format!("k {} / v {}", self.k.name(), self.v.name())
        };
        match (self.hadamard, self.hadamard_v) {
            (false, false) => elems,
            (true, false) => format!("{elems}, hadamard q/k"),
            (false, true) => format!("{elems}, hadamard v"),
            (true, true) => format!("{elems}, hadamard q/k/v"),
        }
    }
}

pub struct KvCache {
    pub shape: KvCacheShape,
    pub format: KvFormat,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// `(k, v)` per layer.
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvCache {
    pub fn new(
        shape: KvCacheShape,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<KvCache> {
        if shape.block_size == 0 {
            return Err(EngineError::Backend(
                "KV block size must be at least 1".into(),
            ));
        }
        let per_layer = shape
            .num_blocks
            .checked_mul(kv_heads)
            .and_then(|x| x.checked_mul(shape.block_size))
            .and_then(|x| x.checked_mul(head_dim))
            .filter(|&x| x.checked_mul(4 * 2 * layers).is_some())
            .ok_or_else(|| {
                EngineError::Backend(format!(
                    "KV cache of {} blocks is too large",
                    shape.num_blocks
                ))
            })?;
        // vec![0.0; n] maps zeroed pages lazily; every page is touched now so the process's
        // resident memory is, from the start, what it will be under load (a pod's memory limit can
        // be set from it instead of being hit hours later).
        let layers = (0..layers)
            .map(|_| {
                let (mut k, mut v) = (vec![0f32; per_layer], vec![0f32; per_layer]);
                touch_pages(&mut k);
                touch_pages(&mut v);
                (k, v)
            })
            .collect();
        Ok(KvCache {
            shape,
            format: KvFormat::F32,
            kv_heads,
            head_dim,
            layers,
        })
    }

    /// Bytes of K and V over all layers.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| (k.len() + v.len()) * std::mem::size_of::<f32>()).sum()
    }

    /// Element offset of `(block, kv_head, slot)`.
    #[inline]
    pub fn offset(&self, block: usize, kv_head: usize, slot: usize) -> usize {
        ((block * self.kv_heads + kv_head) * self.shape.block_size + slot) * self.head_dim
    }
}

/// Writes one element per page so the kernel maps every page now. The value goes through
/// `black_box`: the memory is known to be zero, and a plain store of zero may be optimised away.
fn touch_pages(data: &mut [f32]) {
    const PAGE_ELEMENTS: usize = 4096 / std::mem::size_of::<f32>();
    for x in data.iter_mut().step_by(PAGE_ELEMENTS) {
        *x = std::hint::black_box(0.0);
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Resident set size from /proc/self/statm (pages × page size; 4 KiB pages assumed).
    fn rss_bytes() -> usize {
        let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
        statm.split_whitespace().nth(1).unwrap().parse::<usize>().unwrap() * 4096
    }

    #[test]
    fn per_head_fp8_keeps_small_values_that_scale_1_rounds_away() {
        // A head whose values are all below e4m3's normal range (2^-6): with scale 1 they land in
        // the subnormals (steps of 2^-9), with a per-head scale they keep 3 mantissa bits.
        let src: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 1e-4).collect();
        let mut plain = vec![0.0; 64];
        let mut scaled = vec![0.0; 64];
        KvElem::Fp8E4m3.round_head(&src, &mut plain);
        KvElem::Fp8E4m3PerHead.round_head(&src, &mut scaled);
        let amax = src.iter().fold(0f32, |m, &x| m.max(x.abs()));
        for (i, (&x, (&p, &q))) in src.iter().zip(plain.iter().zip(&scaled)).enumerate() {
            // e4m3's relative step is 2^-3: rounding to nearest is within 2^-4 of x (normals, which
            // every value is once scaled, except those under 2^-6 of the head's largest).
            let bound = if x.abs() >= amax / 64.0 { x.abs() / 16.0 } else { amax / 448.0 * 2f32.powi(-9) };
            assert!((q - x).abs() <= bound * 1.0001, "value {i}: {x} -> {q} (bound {bound})");
            assert_eq!(p, e4m3_to_f32(e4m3_from_f32(x)), "scale 1 is the plain rounding");
        }
        let err = |v: &[f32]| v.iter().zip(&src).map(|(a, b)| (a - b).abs()).sum::<f32>();
        assert!(err(&scaled) * 4.0 < err(&plain), "per-head {} against scale 1 {}", err(&scaled), err(&plain));
        // The largest value maps to ±448 · scale: itself.
        assert_eq!(scaled[0].abs(), amax);
        // A zero head stays zero (no division by a zero scale).
        let mut out = vec![1.0; 4];
        KvElem::Fp8E4m3PerHead.round_head(&[0.0; 4], &mut out);
        assert_eq!(out, [0.0; 4]);
    }

    #[test]
    fn per_head_int8_rounds_to_a_uniform_grid_closer_than_per_head_fp8() {
        // A bell-shaped head (values spread over a few units, as K and V heads are): int8's grid of
        // max / 127 steps beats e4m3's 3-bit mantissa on all but the smallest values.
        let src: Vec<f32> = (0..128).map(|i| ((i as f32 * 0.37).sin() * 2.0) * (-((i as f32 - 64.0) / 40.0).powi(2)).exp()).collect();
        let (mut int8, mut fp8) = (vec![0.0; 128], vec![0.0; 128]);
        KvElem::Int8PerHead.round_head(&src, &mut int8);
        KvElem::Fp8E4m3PerHead.round_head(&src, &mut fp8);
        let amax = src.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let step = amax / 127.0;
        for (i, (&x, &q)) in src.iter().zip(&int8).enumerate() {
            // On the grid (an integer number of steps, at most 127) and within half a step of x.
            let code = q / step;
            assert!((code - code.round()).abs() < 1e-3 && code.abs() <= 127.0 + 1e-3, "value {i}: {q} is {code} steps");
            assert!((q - x).abs() <= step / 2.0 * 1.0001, "value {i}: {x} -> {q} (step {step})");
        }
        // The largest value maps to itself.
        let at = src.iter().position(|x| x.abs() == amax).unwrap();
        assert!((int8[at] - src[at]).abs() <= amax * 1e-6);
        let err = |v: &[f32]| v.iter().zip(&src).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt();
        assert!(err(&int8) * 3.0 < err(&fp8), "int8 {} against per-head fp8 {}", err(&int8), err(&fp8));
        // A zero head stays zero.
        let mut out = vec![1.0; 4];
        KvElem::Int8PerHead.round_head(&[0.0; 4], &mut out);
        assert_eq!(out, [0.0; 4]);
    }

    #[test]
    fn the_pool_is_resident_from_the_start() {
        // 2 layers × (K + V) × 1024 blocks × 4 heads × 16 slots × 64 dims × 4 B = 64 MiB.
        let shape = KvCacheShape { num_blocks: 1024, block_size: 16 };
        let before = rss_bytes();
        let cache = KvCache::new(shape, 2, 4, 64).unwrap();
        let grown = rss_bytes().saturating_sub(before);
        assert_eq!(cache.bytes(), 64 << 20);
        // Other tests in this process allocate and free meanwhile: a margin, not an exact figure.
        assert!(grown >= cache.bytes() * 3 / 4, "RSS grew {grown} bytes for a {} byte pool", cache.bytes());
    }
}

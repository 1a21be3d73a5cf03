//! The CPU LoRA update after a projection: for every adapter segment of the step,
//! `y[t] += ((x[t] · Aᵀ) · scale) · Bᵀ` (shrink to rank r, then expand), reading the slot stacks.
//!
//! Each token row is computed on its own with a fixed summation order, so a row's result does not
//! depend on what else is in the batch (batch invariance), nor on which SIMD path runs: the
//! accumulator structure below is explicit and the compiler does not reassociate float adds.

use rayon::prelude::*;

use crate::plan::LoraBatchPlan;
use crate::lora::stack::LoraSlotStack;
use crate::lora::target::TargetModule;

/// A row-major activation matrix: row `t` is `data[t * stride + offset ..][..cols]`. Strides and
/// offsets let the backend point into fused buffers (e.g. `[q | k | v]` or `[gate | up]`).
#[derive(Debug)]
pub struct RowsMut<'a> {
    pub data: &'a mut [f32],
    pub stride: usize,
    pub offset: usize,
}

#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
}

/// Adds the LoRA update of `module` in `layer` to `y` for every adapter segment of `plan`.
/// `x` holds the projection's inputs (`in` columns), `y` its outputs (`out` columns), one row per
/// token of the step.
pub fn apply_lora(
    stack: &LoraSlotStack,
    plan: &LoraBatchPlan,
    layer: usize,
    module: TargetModule,
    x: Rows<'_>,
    y: RowsMut<'_>,
) {
    let (fan_in, fan_out) = stack.dims(module);
    let r_max = stack.r_max();
    let weights = stack.module(layer, module);
    let Some(&last_start) = plan.seg_starts.last() else {
        return;
    };
    let n_tokens = last_start as usize;
    if weights.a.is_empty() || n_tokens == 0 {
        return;
    }
    let kernel = select_kernel();
    let RowsMut {
        data: y_data,
        stride: y_stride,
        offset: y_offset,
    } = y;
    // One slot per segment, resolved to its weights once.
    let segments: Vec<Option<SegmentWeights<'_>>> = plan
        .seg_slots
        .iter()
        .map(|&slot| {
            let slot = usize::try_from(slot).ok()?;
            let rank = stack.rank(slot, module);
            (rank > 0).then(|| SegmentWeights {
                a: &weights.a[slot * r_max * fan_in..][..rank * fan_in],
                b_t: &weights.b_t[slot * r_max * fan_out..][..rank * fan_out],
                rank,
                fan_in,
                fan_out,
                scale: stack.scale(slot),
            })
        })
        .collect();
    if segments.iter().all(Option::is_none) {
        return;
    }
    let row = |t: usize, y_row: &mut [f32]| {
        let seg = plan.seg_starts.partition_point(|&s| s as usize <= t) - 1;
        if let Some(w) = &segments[seg] {
            let x_row = &x.data[t * x.stride + x.offset..][..fan_in];
            kernel(w, x_row, &mut y_row[y_offset..y_offset + fan_out]);
        }
    };
    // The rows of the step in y; the last row may be shorter than the stride.
    let y_end = ((n_tokens - 1) * y_stride + y_offset + fan_out).min(y_data.len());
    let y_rows = &mut y_data[..y_end];
    // Rayon only pays off with enough work per task (~100k multiply-adds each).
    let work_per_row = stack.r_max().max(1) * (fan_in + fan_out);
    let rows_per_task = (100_000 / work_per_row).max(1);
    if n_tokens <= rows_per_task {
        y_rows
            .chunks_mut(y_stride)
            .enumerate()
            .for_each(|(t, y_row)| row(t, y_row));
    } else {
        y_rows
            .par_chunks_mut(y_stride)
            .with_min_len(rows_per_task)
            .enumerate()
            .for_each(|(t, y_row)| row(t, y_row));
    }
}

/// One slot's weights for one module, already offset into the stacks.
struct SegmentWeights<'a> {
    /// `[rank, in]`.
    a: &'a [f32],
    /// `[rank, out]` (B transposed).
    b_t: &'a [f32],
    rank: usize,
    fan_in: usize,
    fan_out: usize,
    scale: f32,
}

type RowKernel = fn(&SegmentWeights<'_>, &[f32], &mut [f32]);

fn select_kernel() -> RowKernel {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return row_avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            return row_avx2;
        }
    }
    row_portable
}

#[cfg(target_arch = "x86_64")]
fn row_avx512(w: &SegmentWeights<'_>, x: &[f32], y: &mut [f32]) {
    #[target_feature(enable = "avx512f")]
    unsafe fn inner(w: &SegmentWeights<'_>, x: &[f32], y: &mut [f32]) {
        // The closure inherits avx512f, so the SIMD dot is safe to call here.
        row_update(w, x, y, |a, b| simd::dot_avx512(a, b))
    }
    // SAFETY: only selected by `select_kernel` after `is_x86_feature_detected!("avx512f")`.
    unsafe { inner(w, x, y) }
}

#[cfg(target_arch = "x86_64")]
fn row_avx2(w: &SegmentWeights<'_>, x: &[f32], y: &mut [f32]) {
    #[target_feature(enable = "avx2")]
    unsafe fn inner(w: &SegmentWeights<'_>, x: &[f32], y: &mut [f32]) {
        // The closure inherits avx2, so the SIMD dot is safe to call here.
        row_update(w, x, y, |a, b| simd::dot_avx2(a, b))
    }
    // SAFETY: only selected by `select_kernel` after `is_x86_feature_detected!("avx2")`.
    unsafe { inner(w, x, y) }
}

fn row_portable(w: &SegmentWeights<'_>, x: &[f32], y: &mut [f32]) {
    row_update(w, x, y, dot)
}

/// Maximum rank handled with a stack buffer; larger ranks use a heap one.
const STACK_RANK: usize = 128;

#[inline(always)]
fn row_update(
    w: &SegmentWeights<'_>,
    x: &[f32],
    y: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let mut buf = [0f32; STACK_RANK];
    let mut heap;
    let t: &mut [f32] = if w.rank <= STACK_RANK {
        &mut buf[..w.rank]
    } else {
        heap = vec![0f32; w.rank];
        &mut heap
    };
    // Shrink: t = (x · Aᵀ) · scale. Folding the scale into the r-vector is PEFT's order up to one
    // rounding (PEFT scales the out-vector) and costs r multiplies instead of `out`.
    for (tj, a_row) in t.iter_mut().zip(w.a.chunks_exact(w.fan_in)) {
        *tj = dot(x, a_row) * w.scale;
    }
    // Expand: y += Σ_j t[j] · Bᵀ[j], one contiguous axpy per rank; each y[o] sums in j order.
    let y = &mut y[..w.fan_out];
    for (&tj, bt_row) in t.iter().zip(w.b_t.chunks_exact(w.fan_out)) {
        for (yo, &b) in y.iter_mut().zip(bt_row) {
            *yo += tj * b;
        }
    }
}

/// Dot product over 16 lanes: lane `i` sums the products at indices `≡ i (mod 16)` in order, then
/// the lanes are added in a fixed tree. The SIMD versions in [`simd`] do exactly these operations
/// (multiply then add, no FMA), so every path gives the same bits.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (ca, ra) = a[..n].as_chunks::<LANES>();
    let (cb, rb) = b[..n].as_chunks::<LANES>();
    let mut acc = [0f32; LANES];
    for (xa, xb) in ca.iter().zip(cb) {
        for i in 0..LANES {
            acc[i] += xa[i] * xb[i];
        }
    }
    finish_dot(acc, ra, rb)
}

const LANES: usize = 16;

/// Adds the tail products to their lanes and reduces the lanes in a fixed tree.
#[inline(always)]
fn finish_dot(mut acc: [f32; LANES], ra: &[f32], rb: &[f32]) -> f32 {
    for (i, (xa, xb)) in ra.iter().zip(rb).enumerate() {
        acc[i] += xa * xb;
    }
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{finish_dot, LANES};

    /// [`super::dot`] with one 16-lane AVX-512 register.
    #[target_feature(enable = "avx512f")]
    pub(super) fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (ca, ra) = a[..n].as_chunks::<LANES>();
        let (cb, rb) = b[..n].as_chunks::<LANES>();
        let mut acc = _mm512_setzero_ps();
        for (xa, xb) in ca.iter().zip(cb) {
            // SAFETY: each chunk is 16 contiguous f32; unaligned loads.
            let (va, vb) = unsafe { (_mm512_loadu_ps(xa.as_ptr()), _mm512_loadu_ps(xb.as_ptr())) };
            acc = _mm512_add_ps(acc, _mm512_mul_ps(va, vb));
        }
        let mut lanes = [0f32; LANES];
        // SAFETY: `lanes` holds 16 f32.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), acc) };
        finish_dot(lanes, ra, rb)
    }

    /// [`super::dot`] with two 8-lane AVX2 registers (lanes 0..8 and 8..16).
    #[target_feature(enable = "avx2")]
    pub(super) fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (ca, ra) = a[..n].as_chunks::<LANES>();
        let (cb, rb) = b[..n].as_chunks::<LANES>();
        let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for (xa, xb) in ca.iter().zip(cb) {
            // SAFETY: each chunk is 16 contiguous f32; unaligned loads of 8 at offsets 0 and 8.
            unsafe {
                let (a0, b0) = (_mm256_loadu_ps(xa.as_ptr()), _mm256_loadu_ps(xb.as_ptr()));
                let (a1, b1) = (
                    _mm256_loadu_ps(xa.as_ptr().add(8)),
                    _mm256_loadu_ps(xb.as_ptr().add(8)),
                );
                lo = _mm256_add_ps(lo, _mm256_mul_ps(a0, b0));
                hi = _mm256_add_ps(hi, _mm256_mul_ps(a1, b1));
            }
        }
        let mut lanes = [0f32; LANES];
        // SAFETY: `lanes` holds 16 f32.
        unsafe {
            _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
        }
        finish_dot(lanes, ra, rb)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::adapter::{LoraAdapter, LoraPair};
    use crate::plan::NO_SLOT;
    use crate::lora::test_support::tiny_config;
    use rand::{Rng, SeedableRng};

    fn random_adapter(
        rng: &mut impl Rng,
        cfg: &crate::config::ModelConfig,
        rank: usize,
        scaling: f32,
    ) -> LoraAdapter {
        let targets = vec![TargetModule::Q, TargetModule::V, TargetModule::Down];
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| {
                let mut l: [Option<LoraPair>; 7] = Default::default();
                for m in &targets {
                    let (i, o) = m.dims(cfg);
                    l[m.index()] = Some(LoraPair {
                        a: (0..rank * i).map(|_| rng.random_range(-1.0..1.0)).collect(),
                        b: (0..o * rank).map(|_| rng.random_range(-1.0..1.0)).collect(),
                    });
                }
                l
            })
            .collect();
        LoraAdapter {
            rank,
            scaling,
            targets,
            layers,
            digest: String::new(),
        }
    }

    /// Naive reference in f64: y + scale * B (A x), from the adapter's own unpadded matrices.
    fn reference(
        adapter: &LoraAdapter,
        layer: usize,
        m: TargetModule,
        x: &[f32],
        y: &[f32],
    ) -> Vec<f32> {
        let Some(p) = adapter.pair(layer, m) else {
            return y.to_vec();
        };
        let (r, fan_in, fan_out) = (adapter.rank, x.len(), y.len());
        let (pa, pb) = (p.a.as_f32(), p.b.as_f32());
        let t: Vec<f64> = (0..r)
            .map(|j| {
                (0..fan_in)
                    .map(|k| pa[j * fan_in + k] as f64 * x[k] as f64)
                    .sum()
            })
            .collect();
        (0..fan_out)
            .map(|o| {
                let d: f64 = (0..r).map(|j| pb[o * r + j] as f64 * t[j]).sum();
                (y[o] as f64 + adapter.scaling as f64 * d) as f32
            })
            .collect()
    }

    #[test]
    fn matches_naive_reference_for_mixed_segments() {
        let cfg = tiny_config();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let adapters = [
            random_adapter(&mut rng, &cfg, 4, 2.0),
            random_adapter(&mut rng, &cfg, 13, 0.5),
        ];
        let mut stack = LoraSlotStack::new(&cfg, 3, 16);
        stack.set_slot(2, &adapters[0]).unwrap();
        assert_eq!(stack.r_max(), 8);
        // A larger rank re-lays out the stacks; slot 2 must keep its adapter.
        stack.set_slot(0, &adapters[1]).unwrap();
        assert_eq!(stack.r_max(), 16);
        assert!(stack
            .set_slot(1, &random_adapter(&mut rng, &cfg, 17, 1.0))
            .is_err());
        // tokens: 0..3 slot 2, 3..5 base, 5..9 slot 0, 9..10 slot 2
        let plan = LoraBatchPlan {
            seg_starts: vec![0, 3, 5, 9, 10],
            seg_slots: vec![2, NO_SLOT, 0, 2],
        };
        let adapter_of = |t: usize| match t {
            0..=2 | 9 => Some(&adapters[0]),
            5..=8 => Some(&adapters[1]),
            _ => None,
        };
        for m in [
            TargetModule::Q,
            TargetModule::V,
            TargetModule::Down,
            TargetModule::K,
        ] {
            let (fan_in, fan_out) = m.dims(&cfg);
            let n = 10;
            // Fused-buffer layout: y has 3 extra columns before and 2 after this module's outputs.
            let (y_stride, y_off) = (fan_out + 5, 3);
            let x: Vec<f32> = (0..n * fan_in)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let y0: Vec<f32> = (0..n * y_stride)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let mut y = y0.clone();
            for layer in 0..cfg.num_hidden_layers {
                y.copy_from_slice(&y0);
                apply_lora(
                    &stack,
                    &plan,
                    layer,
                    m,
                    Rows {
                        data: &x,
                        stride: fan_in,
                        offset: 0,
                    },
                    RowsMut {
                        data: &mut y,
                        stride: y_stride,
                        offset: y_off,
                    },
                );
                for t in 0..n {
                    let row = &y[t * y_stride..][..y_stride];
                    let row0 = &y0[t * y_stride..][..y_stride];
                    assert_eq!(&row[..y_off], &row0[..y_off]);
                    assert_eq!(&row[y_off + fan_out..], &row0[y_off + fan_out..]);
                    let want = match adapter_of(t) {
                        Some(a) => reference(
                            a,
                            layer,
                            m,
                            &x[t * fan_in..][..fan_in],
                            &row0[y_off..][..fan_out],
                        ),
                        None => row0[y_off..][..fan_out].to_vec(),
                    };
                    for (g, w) in row[y_off..][..fan_out].iter().zip(&want) {
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{m} layer {layer} token {t}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rows_are_batch_invariant_and_cleared_slots_add_nothing() {
        let cfg = tiny_config();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let adapter = random_adapter(&mut rng, &cfg, 5, 1.5);
        let mut stack = LoraSlotStack::new(&cfg, 2, 8);
        stack.set_slot(1, &adapter).unwrap();
        let (fan_in, fan_out) = TargetModule::Q.dims(&cfg);
        let x: Vec<f32> = (0..9 * fan_in)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let run = |stack: &LoraSlotStack, n: usize| {
            let mut y = vec![0.5f32; n * fan_out];
            let plan = LoraBatchPlan {
                seg_starts: vec![0, n as u32],
                seg_slots: vec![1],
            };
            apply_lora(
                stack,
                &plan,
                0,
                TargetModule::Q,
                Rows {
                    data: &x,
                    stride: fan_in,
                    offset: 0,
                },
                RowsMut {
                    data: &mut y,
                    stride: fan_out,
                    offset: 0,
                },
            );
            y
        };
        let one = run(&stack, 1);
        let nine = run(&stack, 9);
        assert_eq!(
            &one[..],
            &nine[..fan_out],
            "row 0 must not depend on the batch size"
        );
        assert!(one.iter().any(|&v| v != 0.5));
        stack.clear_slot(1);
        assert!(run(&stack, 9).iter().all(|&v| v == 0.5));
    }

    #[test]
    fn simd_paths_agree_bitwise_with_portable() {
        let cfg = tiny_config();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let adapter = random_adapter(&mut rng, &cfg, 6, 2.0);
        let mut stack = LoraSlotStack::new(&cfg, 1, 8);
        stack.set_slot(0, &adapter).unwrap();
        let (fan_in, fan_out) = TargetModule::Down.dims(&cfg);
        let w = stack.module(0, TargetModule::Down);
        assert_eq!(stack.r_max(), 8);
        let seg = SegmentWeights {
            a: &w.a[..6 * fan_in],
            b_t: &w.b_t[..6 * fan_out],
            rank: 6,
            fan_in,
            fan_out,
            scale: 2.0,
        };
        let x: Vec<f32> = (0..fan_in).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut portable = vec![0.25f32; fan_out];
        row_portable(&seg, &x, &mut portable);
        let mut selected = vec![0.25f32; fan_out];
        select_kernel()(&seg, &x, &mut selected);
        assert_eq!(portable, selected);
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            let mut avx2 = vec![0.25f32; fan_out];
            row_avx2(&seg, &x, &mut avx2);
            assert_eq!(portable, avx2);
        }
        // Dot products of every length agree bitwise, tails included.
        for n in [1, 15, 16, 17, 40, 72] {
            let (a, b) = (&x[..n], &x[fan_in - n..]);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: feature detected.
                assert_eq!(dot(a, b), unsafe { simd::dot_avx512(a, b) });
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: feature detected.
                assert_eq!(dot(a, b), unsafe { simd::dot_avx2(a, b) });
            }
        }
    }
}

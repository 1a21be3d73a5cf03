//! The grouped LoRA kernels (lora.cu) against an f64 reference from the same bf16 inputs: ragged
//! and empty segments, every supported rank in one launch, base-model tokens mixed in, fused outputs
//! of several modules, fan-ins that end inside a split; and a token's result alone equals its result
//! in a batch, bit for bit, whatever launch shape the step's size picks (split or whole fan-in per
//! shrink block, one or several work tiles per expand block). The expand into a separate update
//! buffer (`lora_expand_to`, for the consumer of the base output to add) is checked the same way.
//! GPU tests: skipped with a visible reason where there is no GPU.
//!
//! Tolerance: the output is rounded to bf16 once from an f32 sum (2^-9 relative), so |err| <=
//! 2^-8 |ref| plus 2^-12 of the magnitude of the terms summed (f32 accumulation on the tensor cores
//! and the bf16 hi + lo split of the shrink output, each far below that).

use half::bf16;
use peregrine_kernels::ops::{lora_max_tiles, lora_rank_pad, lora_splits, GemvLoraExpand, GemvLoraRows, LoraDelta, LoraModule, LoraScratch, LoraSegments, LoraShrinkShape, OuterScale, RopeCache, RopeTables, LORA_TILE};
use peregrine_kernels::testing::cuda_or_skip;
use peregrine_kernels::{Cuda, DevBuf, W8Format};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn rng() -> ChaCha8Rng {
    let seed: u64 = rand::rng().random();
    eprintln!("seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

fn rand_bf16(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<u16> {
    (0..n).map(|_| bf16::from_f32(r.random_range(-scale..scale)).to_bits()).collect()
}

fn val(b: u16) -> f64 {
    bf16::from_bits(b).to_f32() as f64
}

/// One projection group's inputs on the host.
#[derive(Clone)]
struct Case {
    k: usize,
    /// (fan-out, first column in y) per module.
    outs: Vec<(usize, usize)>,
    y_width: usize,
    /// Rank per slot (0: empty slot).
    ranks: Vec<usize>,
    scales: Vec<f32>,
    slots: Vec<i32>,
}

struct Host {
    x: Vec<u16>,
    y0: Vec<u16>,
    /// Per module: A stack `[slots, r_pad, k]`, B stack `[slots, out, r_pad]`, zero past each rank.
    a: Vec<Vec<u16>>,
    b: Vec<Vec<u16>>,
    r_pad: usize,
}

fn host_inputs(r: &mut ChaCha8Rng, c: &Case) -> Host {
    let n = c.slots.len();
    let r_pad = lora_rank_pad(*c.ranks.iter().max().unwrap_or(&1));
    let slots = c.ranks.len();
    let mut a = vec![];
    let mut b = vec![];
    for &(out, _) in &c.outs {
        let mut am = vec![0u16; slots * r_pad * c.k];
        let mut bm = vec![0u16; slots * out * r_pad];
        for (s, &rank) in c.ranks.iter().enumerate() {
            for rr in 0..rank {
                let row = rand_bf16(r, c.k, 0.05);
                am[(s * r_pad + rr) * c.k..][..c.k].copy_from_slice(&row);
            }
            for o in 0..out {
                let row = rand_bf16(r, rank, 0.05);
                bm[(s * out + o) * r_pad..][..rank].copy_from_slice(&row);
            }
        }
        a.push(am);
        b.push(bm);
    }
    Host { x: rand_bf16(r, n * c.k, 1.0), y0: rand_bf16(r, n * c.y_width, 1.0), a, b, r_pad }
}

/// The reference y (f64) and the magnitude of each element's terms.
fn reference(c: &Case, h: &Host) -> (Vec<f64>, Vec<f64>) {
    let mut y: Vec<f64> = h.y0.iter().map(|&v| val(v)).collect();
    let mut mag: Vec<f64> = y.iter().map(|v| v.abs()).collect();
    for (i, &slot) in c.slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let s = slot as usize;
        let (rank, scale) = (c.ranks[s], c.scales[s] as f64);
        for (m, &(out, col)) in c.outs.iter().enumerate() {
            let t: Vec<f64> = (0..rank)
                .map(|rr| (0..c.k).map(|j| val(h.x[i * c.k + j]) * val(h.a[m][(s * h.r_pad + rr) * c.k + j])).sum::<f64>() * scale)
                .collect();
            for o in 0..out {
                let bo = &h.b[m][(s * out + o) * h.r_pad..];
                let terms = t.iter().enumerate().map(|(rr, tv)| tv * val(bo[rr]));
                let at = i * c.y_width + col + o;
                for term in terms {
                    y[at] += term;
                    mag[at] += term.abs();
                }
            }
        }
    }
    (y, mag)
}

/// A bf16 NaN: what the delta buffer holds where the expand must not write.
const UNWRITTEN: u16 = 0x7fc1;

/// Runs group + apply on the GPU for the tokens `rows` of the case (all: `None`) and returns y.
fn run(cuda: &Cuda, c: &Case, h: &Host, rows: Option<&[usize]>) -> Vec<u16> {
    run_both(cuda, c, h, rows).0
}

/// A case's inputs on the GPU for some of its tokens, with the group's scratch buffers.
struct Group {
    n: usize,
    slots_host: Vec<i32>,
    x: DevBuf<u16>,
    y: DevBuf<u16>,
    slots: DevBuf<i32>,
    a: Vec<DevBuf<u16>>,
    b: Vec<DevBuf<u16>>,
    ranks: DevBuf<i32>,
    scales: DevBuf<f32>,
    order: DevBuf<i32>,
    seg: DevBuf<i32>,
    tiles: DevBuf<i32>,
    t_part: DevBuf<f32>,
    t_hi: DevBuf<u16>,
    t_lo: DevBuf<u16>,
    counters: DevBuf<i32>,
}

impl Group {
    /// The tokens `pick` of the case (x, y and slots gathered in that order).
    fn upload(cuda: &Cuda, c: &Case, h: &Host, pick: &[usize]) -> Group {
        let g = &cuda.gpu;
        let n = pick.len();
        let gather = |src: &[u16], w: usize| pick.iter().flat_map(|&i| src[i * w..(i + 1) * w].to_vec()).collect::<Vec<u16>>();
        let slots_host: Vec<i32> = pick.iter().map(|&i| c.slots[i]).collect();
        let big_r = c.outs.len() * h.r_pad;
        let max_tiles = lora_max_tiles(n, c.ranks.len());
        Group {
            n,
            x: g.upload(&gather(&h.x, c.k)).unwrap(),
            y: g.upload(&gather(&h.y0, c.y_width)).unwrap(),
            slots: g.upload(&slots_host).unwrap(),
            slots_host,
            a: h.a.iter().map(|v| g.upload(v).unwrap()).collect(),
            b: h.b.iter().map(|v| g.upload(v).unwrap()).collect(),
            ranks: g.upload(&c.ranks.iter().map(|&r| r as i32).collect::<Vec<_>>()).unwrap(),
            scales: g.upload(&c.scales).unwrap(),
            order: g.alloc_zeros::<i32>(n).unwrap(),
            seg: g.alloc_zeros::<i32>(c.ranks.len() + 1).unwrap(),
            tiles: g.alloc_zeros::<i32>(1 + 2 * max_tiles).unwrap(),
            t_part: g.alloc_zeros::<f32>(lora_splits(c.k) * n * big_r).unwrap(),
            t_hi: g.alloc_zeros::<u16>(n * big_r).unwrap(),
            t_lo: g.alloc_zeros::<u16>(n * big_r).unwrap(),
            counters: g.alloc_zeros::<i32>(3 * max_tiles).unwrap(),
        }
    }

    fn segs(&self) -> LoraSegments {
        LoraSegments { slots: self.slots.ptr(), order: self.order.ptr(), seg: self.seg.ptr(), tiles: self.tiles.ptr(), ranks: self.ranks.ptr(), scales: self.scales.ptr(), num_slots: self.ranks.len() }
    }

    fn modules(&self, c: &Case) -> Vec<LoraModule> {
        c.outs.iter().enumerate().map(|(m, &(out, col))| LoraModule { a: self.a[m].ptr(), b: self.b[m].ptr(), out, col }).collect()
    }

    fn work(&self) -> LoraScratch {
        LoraScratch { t_part: self.t_part.ptr(), t_hi: self.t_hi.ptr(), t_lo: self.t_lo.ptr(), counters: self.counters.ptr() }
    }
}

/// [`run`], and the update the expand writes into a separate buffer (`lora_expand_to`, from the same
/// shrink output), which starts as [`UNWRITTEN`].
fn run_both(cuda: &Cuda, c: &Case, h: &Host, rows: Option<&[usize]>) -> (Vec<u16>, Vec<u16>) {
    let g = &cuda.gpu;
    let s = &g.stream;
    let pick: Vec<usize> = rows.map_or_else(|| (0..c.slots.len()).collect(), |r| r.to_vec());
    let dev = Group::upload(cuda, c, h, &pick);
    let (n, segs, modules, work) = (dev.n, dev.segs(), dev.modules(c), dev.work());
    let (x, y, order, seg, tiles, slots_host) = (&dev.x, &dev.y, &dev.order, &dev.seg, &dev.tiles, &dev.slots_host);
    // SAFETY: every buffer above is sized as the wrappers document for these n tokens.
    unsafe {
        cuda.kernels.lora_group(s, &segs, n).unwrap();
        cuda.kernels.lora_apply(s, y.ptr(), c.y_width, x.ptr(), c.k, c.k, &modules, h.r_pad, &segs, &work, n).unwrap();
    }
    let d = g.upload(&vec![UNWRITTEN; n * c.y_width]).unwrap();
    // SAFETY: as above; the shrink output in `work` is still the group's.
    unsafe { cuda.kernels.lora_expand_to(s, d.ptr(), c.y_width, &modules, h.r_pad, &segs, &work, n).unwrap() };
    let got = y.download(s).unwrap();
    let delta = d.download(s).unwrap();
    // The segment table: ascending tokens per slot, starts as prefix counts.
    let (order_got, seg_got) = (order.download(s).unwrap(), seg.download(s).unwrap());
    let mut at = 0;
    for (slot, &start) in seg_got[..c.ranks.len()].iter().enumerate() {
        assert_eq!(start, at as i32, "segment start of slot {slot}");
        let mine: Vec<i32> = (0..n as i32).filter(|&i| slots_host[i as usize] == slot as i32).collect();
        assert_eq!(&order_got[at..at + mine.len()], &mine[..], "tokens of slot {slot}");
        at += mine.len();
    }
    assert_eq!(seg_got[c.ranks.len()], at as i32);
    // Work tiles: every slot's tokens in tiles of up to LORA_TILE, in slot order.
    let tiles_got = tiles.download(s).unwrap();
    let mut want = vec![];
    for (slot, bounds) in seg_got.windows(2).enumerate() {
        for p in (bounds[0]..bounds[1]).step_by(LORA_TILE) {
            want.extend([slot as i32, p - bounds[0]]);
        }
    }
    assert_eq!(tiles_got[0] as usize, want.len() / 2, "work tiles");
    assert_eq!(&tiles_got[1..1 + want.len()], &want[..], "work tiles");
    (got, delta)
}

fn check(cuda: &Cuda, c: &Case) {
    let mut r = rng();
    let h = host_inputs(&mut r, c);
    let (want, mag) = reference(c, &h);
    let (got, delta) = run_both(cuda, c, &h, None);
    for (i, &slot) in c.slots.iter().enumerate() {
        for j in 0..c.y_width {
            let at = i * c.y_width + j;
            let in_module = c.outs.iter().any(|&(out, col)| (col..col + out).contains(&j));
            // The separate update: written (0 for an empty slot) in every module column of a token
            // with a slot, rounded once from the same f32 sum; untouched elsewhere.
            if slot < 0 || !in_module {
                assert_eq!(delta[at], UNWRITTEN, "token {i} (slot {slot}) column {j}: the update must not be written");
            } else {
                let (d, d_want) = (val(delta[at]), want[at] - val(h.y0[at]));
                let d_mag = mag[at] - val(h.y0[at]).abs();
                let tol = d_want.abs() / 256.0 + d_mag / 4096.0 + 1e-6;
                assert!((d - d_want).abs() <= tol, "token {i} (slot {slot}) column {j}: update {d}, want {d_want} (tol {tol})");
            }
            if slot < 0 || !in_module || c.ranks[slot as usize] == 0 {
                assert_eq!(got[at], h.y0[at], "token {i} (slot {slot}) column {j} must be left alone");
                continue;
            }
            let g = val(got[at]);
            let tol = want[at].abs() / 256.0 + mag[at] / 4096.0 + 1e-6;
            assert!((g - want[at]).abs() <= tol, "token {i} (slot {slot}, rank {}) column {j}: got {g}, want {} (tol {tol})", c.ranks[slot as usize], want[at]);
        }
    }
    // A token's row is the same bits alone as in the batch (batch invariance), in both modes.
    for i in [0, c.slots.len() / 2, c.slots.len() - 1] {
        let (alone, alone_delta) = run_both(cuda, c, &h, Some(&[i]));
        let row = i * c.y_width..(i + 1) * c.y_width;
        assert_eq!(&alone[..], &got[row.clone()], "token {i} alone differs from the batch");
        assert_eq!(&alone_delta[..], &delta[row], "token {i}'s update alone differs from the batch");
    }
}

#[test]
fn grouped_lora_matches_reference_on_ragged_segments_and_every_rank() {
    let Some(cuda) = cuda_or_skip() else { return };
    // Slots of rank 8, 16, 32, 64, and an empty one; 61 tokens: 19 for slot 0 (two token tiles), one
    // for slot 1, 17 for slot 2, none for slot 3 (a segment of 0), the rest base-model tokens, all
    // shuffled. q|k|v-like fused output with a gap column, fan-in ending mid-split.
    let mut slots: Vec<i32> = [vec![0; 19], vec![1; 1], vec![2; 17], vec![-1; 24]].concat();
    let mut r = rng();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    let case = Case { k: 1040, outs: vec![(200, 0), (72, 200), (72, 273)], y_width: 346, ranks: vec![8, 16, 32, 64, 0], scales: vec![2.0, 0.5, 1.0, 4.0, 0.0], slots };
    check(&cuda, &case);
    // Every token on slot 3 (rank 64).
    let all_rank_64 = Case { slots: vec![3; 33], ..case.clone() };
    check(&cuda, &all_rank_64);
    // The shrink without a cross-block reduction (`lora_shrink_ranks`), on both.
    let mut cuda = cuda;
    cuda.kernels.set_lora_launch_shapes(Some(LoraShrinkShape::Ranks), None);
    check(&cuda, &case);
    check(&cuda, &all_rank_64);
    cuda.kernels.set_lora_launch_shapes(None, None);
}

#[test]
fn grouped_lora_matches_reference_on_a_long_prefill_segment() {
    let Some(cuda) = cuda_or_skip() else { return };
    // Llama's down projection fan-in (56 splits), one adapter of rank 32 over 300 tokens, and two
    // tokens of a second adapter.
    let mut slots = vec![1i32; 300];
    slots[7] = 0;
    slots[250] = 0;
    let case = Case { k: 14336, outs: vec![(512, 0)], y_width: 512, ranks: vec![16, 32], scales: vec![1.0, 2.0], slots };
    check(&cuda, &case);
    // The staged shrink (prefill steps of 512+ tokens take it), its blocks mixing both slots, over
    // the fan-in split and whole; and the shrink by rank tiles, 56 chunks over its 16 warps.
    let mut cuda = cuda;
    for shape in [LoraShrinkShape::Staged, LoraShrinkShape::StagedWhole, LoraShrinkShape::Ranks] {
        cuda.kernels.set_lora_launch_shapes(Some(shape), None);
        check(&cuda, &case);
    }
    // Ranks up to 32 (r_pad 32): the staged shrink holding 4 accumulator tiles (taken where the grid
    // splits the fan-in, as here) gives the bits of the one holding 8.
    let mut r = rng();
    let h = host_inputs(&mut r, &case);
    cuda.kernels.set_lora_launch_shapes(Some(LoraShrinkShape::Staged), None);
    let narrow = run(&cuda, &case, &h, None);
    cuda.kernels.set_lora_staged_r32(false);
    let wide = run(&cuda, &case, &h, None);
    cuda.kernels.set_lora_staged_r32(true);
    assert!(narrow == wide, "the r_pad <= 32 staged shrink: different bits");
    // Ranks up to 32 (r_pad 32): the expand holding B for 32 ranks gives the bits of the one for 64.
    cuda.kernels.set_lora_launch_shapes(None, None);
    let mut r = rng();
    let h = host_inputs(&mut r, &case);
    let narrow = run(&cuda, &case, &h, None);
    cuda.kernels.set_lora_expand_r32(false);
    assert!(run(&cuda, &case, &h, None) == narrow, "the r_pad <= 32 expand: different bits");
    cuda.kernels.set_lora_expand_r32(true);
}

#[test]
fn grouped_lora_gives_the_same_bits_for_every_launch_shape() {
    let Some(mut cuda) = cuda_or_skip() else { return };
    // A prefill-sized step: 900 tokens over four adapters and the base model, enough work tiles that
    // the shrink walks the whole fan-in per block by default (fan-in 1040: five chunks, the last
    // partial); `check` compares with the f64 reference and with tokens run alone (split shrink).
    let mut r = rng();
    let mut slots: Vec<i32> = (0..900).map(|i| [0, 1, 2, 3, -1][i % 5]).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    let case = Case { k: 1040, outs: vec![(200, 0), (72, 200), (72, 273)], y_width: 346, ranks: vec![8, 16, 32, 64, 0], scales: vec![2.0, 0.5, 1.0, 4.0, 0.0], slots };
    check(&cuda, &case);
    // Every shape gives the bits of the split shrink with one tile per expand block.
    let h = host_inputs(&mut r, &case);
    cuda.kernels.set_lora_launch_shapes(Some(LoraShrinkShape::Split), Some(1));
    let base = run(&cuda, &case, &h, None);
    use LoraShrinkShape::{Ranks, Split, Staged, StagedWhole, Whole};
    for (shape, tiles) in [(Whole, 1), (Whole, 4), (Split, 3), (Whole, 16), (Staged, 1), (Staged, 4), (StagedWhole, 1), (Ranks, 1)] {
        cuda.kernels.set_lora_launch_shapes(Some(shape), Some(tiles));
        let got = run(&cuda, &case, &h, None);
        assert!(got == base, "shrink {shape:?}, {tiles} tiles per expand block: different bits");
    }
    // The same step with every module's columns 8-aligned, so that the expand takes its 16-byte
    // path (the case above, with a module at column 273, takes the 2-byte one).
    let aligned = Case { outs: vec![(200, 0), (72, 200), (72, 272)], y_width: 344, ..case };
    check(&cuda, &aligned);
    let h = host_inputs(&mut r, &aligned);
    cuda.kernels.set_lora_launch_shapes(Some(Split), Some(1));
    let base = run(&cuda, &aligned, &h, None);
    for (shape, tiles) in [(Whole, 1), (Staged, 1), (Staged, 4), (StagedWhole, 2), (Ranks, 1)] {
        cuda.kernels.set_lora_launch_shapes(Some(shape), Some(tiles));
        assert!(run(&cuda, &aligned, &h, None) == base, "aligned columns, shrink {shape:?}, {tiles} tiles per expand block: different bits");
    }
    cuda.kernels.set_lora_launch_shapes(None, None);
}

#[test]
fn the_split_shrink_gives_the_same_bits_from_rows_that_are_not_16_byte_aligned() {
    let Some(mut cuda) = cuda_or_skip() else { return };
    // x rows 2 elements longer than the fan-in: 4-byte aligned, not 16, so the split kernel stages
    // them 4 bytes at a time instead of with cp.async; its bits must be those of packed rows.
    let slots: Vec<i32> = (0..45).map(|i| [0, 1, 2, 3, -1][i % 5]).collect();
    let case = Case { k: 1040, outs: vec![(200, 0), (72, 200), (72, 272)], y_width: 344, ranks: vec![8, 32, 64, 0], scales: vec![2.0, 0.5, 1.0, 0.0], slots };
    let mut r = rng();
    let h = host_inputs(&mut r, &case);
    for shape in [LoraShrinkShape::Split, LoraShrinkShape::Whole] {
        cuda.kernels.set_lora_launch_shapes(Some(shape), Some(1));
        let want = run(&cuda, &case, &h, None);
        let all: Vec<usize> = (0..case.slots.len()).collect();
        let dev = Group::upload(&cuda, &case, &h, &all);
        let x_stride = case.k + 2;
        let padded: Vec<u16> = h.x.chunks(case.k).flat_map(|row| row.iter().copied().chain([0, 0])).collect();
        let x = cuda.gpu.upload(&padded).unwrap();
        let (s, segs, modules, work) = (&cuda.gpu.stream, dev.segs(), dev.modules(&case), dev.work());
        // SAFETY: the group's buffers are sized for its tokens; x holds them at `x_stride`.
        unsafe {
            cuda.kernels.lora_group(s, &segs, dev.n).unwrap();
            cuda.kernels.lora_apply(s, dev.y.ptr(), case.y_width, x.ptr(), x_stride, case.k, &modules, h.r_pad, &segs, &work, dev.n).unwrap();
        }
        assert!(dev.y.download(s).unwrap() == want, "shrink {shape:?}: x rows {x_stride} apart give other bits than packed rows");
    }
    cuda.kernels.set_lora_launch_shapes(None, None);
}

/// SwiGLU of a gate|up case (modules 0 and 1, each `inter` wide, side by side in y) with the LoRA
/// updates, two ways from the same shrink: the update buffer added by `silu_mul` (decode-sized
/// steps), and `silu_mul_unslotted` + `lora_expand_swiglu` (large steps); both outputs start as
/// [`UNWRITTEN`]. Also returns plain SwiGLU without updates and y after the fused path.
fn swiglu_both(cuda: &Cuda, c: &Case, h: &Host) -> (Vec<u16>, Vec<u16>, Vec<u16>, Vec<u16>) {
    let g = &cuda.gpu;
    let s = &g.stream;
    let pick: Vec<usize> = (0..c.slots.len()).collect();
    let dev = Group::upload(cuda, c, h, &pick);
    let (n, segs, modules, work) = (dev.n, dev.segs(), dev.modules(c), dev.work());
    let (x, y, slots) = (&dev.x, &dev.y, &dev.slots);
    let inter = c.outs[0].0;
    let d = g.upload(&vec![UNWRITTEN; n * c.y_width]).unwrap();
    let (buffered, fused, plain) = (g.upload(&vec![UNWRITTEN; n * inter]).unwrap(), g.upload(&vec![UNWRITTEN; n * inter]).unwrap(), g.upload(&vec![UNWRITTEN; n * inter]).unwrap());
    // SAFETY: every buffer above is sized as the wrappers document for these n tokens.
    unsafe {
        let k = &cuda.kernels;
        k.lora_group(s, &segs, n).unwrap();
        k.lora_shrink(s, x.ptr(), c.k, c.k, &modules, h.r_pad, &segs, &work, n).unwrap();
        k.lora_expand_to(s, d.ptr(), c.y_width, &modules, h.r_pad, &segs, &work, n).unwrap();
        k.silu_mul(s, buffered.ptr(), y.ptr(), n, inter, Some(LoraDelta { d: d.ptr(), slots: slots.ptr() })).unwrap();
        k.silu_mul_unslotted(s, fused.ptr(), y.ptr(), n, inter, slots.ptr()).unwrap();
        k.lora_expand_swiglu(s, fused.ptr(), y.ptr(), inter, &modules[0], &modules[1], h.r_pad, &segs, &work, n).unwrap();
        k.silu_mul(s, plain.ptr(), y.ptr(), n, inter, None).unwrap();
    }
    (buffered.download(s).unwrap(), fused.download(s).unwrap(), plain.download(s).unwrap(), y.download(s).unwrap())
}

#[test]
fn lora_swiglu_gives_the_bits_of_the_update_buffer_path() {
    let Some(mut cuda) = cuda_or_skip() else { return };
    let mut r = rng();
    // Gate and up of 192 columns each (three 64-column blocks), fan-in 320; every rank, an empty
    // slot and base-model tokens mixed in; a decode-sized step (one work tile per block) and a
    // prefill-sized one (four), each with ranks up to 64 and up to 32 (the r32 kernel).
    for (n, ranks) in [(45, vec![8, 16, 32, 64, 0]), (700, vec![8, 16, 32, 64, 0]), (45, vec![8, 32, 16, 0]), (700, vec![32, 8, 16, 0])] {
        let slots: Vec<i32> = (0..n).map(|_| r.random_range(-1..ranks.len() as i32)).collect();
        let scales = ranks.iter().map(|&rk| if rk == 0 { 0.0 } else { r.random_range(0.5..2.0) }).collect();
        let case = Case { k: 320, outs: vec![(192, 0), (192, 192)], y_width: 384, ranks: ranks.clone(), scales, slots };
        let h = host_inputs(&mut r, &case);
        for r32 in [true, false] {
            cuda.kernels.set_lora_expand_r32(r32);
            let (buffered, fused, plain, y_after) = swiglu_both(&cuda, &case, &h);
            assert!(y_after == h.y0, "{n} tokens, ranks {ranks:?}: the fused path must leave gate|up alone");
            assert!(fused == buffered, "{n} tokens, ranks {ranks:?}, r32 {r32}: fused SwiGLU differs from the update-buffer path");
            // Not vacuous: the updates changed the output of every token with a ranked slot.
            for (i, &slot) in case.slots.iter().enumerate() {
                let row = |v: &[u16]| v[i * 192..(i + 1) * 192].to_vec();
                let lora = slot >= 0 && ranks[slot as usize] > 0;
                assert_eq!(row(&fused) != row(&plain), lora, "token {i} (slot {slot}): LoRA update {}", if lora { "missing" } else { "where none is due" });
            }
        }
    }
    cuda.kernels.set_lora_expand_r32(true);
}

/// A one-token shrink's t (bf16 hi + lo, `n_modules * r_pad` columns, the case's three modules)
/// for the case's token in `slot` (>= 0) against the f64 reference, zeros past the slot's rank.
fn check_one_token_t(case: &Case, h: &Host, slot: i32, hi: &[u16], lo: &[u16], what: &str) {
    let (sl, rank, scale) = (slot as usize, case.ranks[slot as usize], case.scales[slot as usize] as f64);
    for m in 0..case.outs.len() {
        for rr in 0..h.r_pad {
            let at = m * h.r_pad + rr;
            let got = val(hi[at]) + val(lo[at]);
            let terms: Vec<f64> = (0..case.k).map(|j| val(h.x[j]) * val(h.a[m][(sl * h.r_pad + rr) * case.k + j]) * scale).collect();
            let want: f64 = terms.iter().sum();
            let tol = terms.iter().map(|t| t.abs()).sum::<f64>() / 4096.0 + 1e-7;
            if rr >= rank {
                assert!(hi[at] == 0 && lo[at] == 0, "{what}, module {m}, rank {rr} past {rank}: t must be 0");
            }
            assert!((got - want).abs() <= tol, "{what}, module {m}, rank {rr}: t {got}, want {want} (tol {tol})");
        }
    }
}

#[test]
fn the_gemv_computes_a_one_token_shrink_as_extra_rows() {
    let Some(cuda) = cuda_or_skip() else { return };
    let s = &cuda.gpu.stream;
    let mut r = rng();
    // Three modules (q|k|v-like) over a fan-in that is no multiple of the GEMV's 256-wide passes;
    // slots of rank 8, 32, 64 and an empty one, and a token without an adapter.
    let base = Case { k: 1040, outs: vec![(200, 0), (72, 200), (72, 272)], y_width: 344, ranks: vec![8, 32, 64, 0], scales: vec![2.0, 0.5, 1.0, 0.0], slots: vec![0] };
    for slot in [0, 1, 2, 3, -1] {
        let case = Case { slots: vec![slot], ..base.clone() };
        let h = host_inputs(&mut r, &case);
        let dev = Group::upload(&cuda, &case, &h, &[0]);
        let w = cuda.gpu.upload(&rand_bf16(&mut r, case.y_width * case.k, 0.05)).unwrap();
        let big_r = case.outs.len() * h.r_pad;
        let t_hi = cuda.gpu.upload(&vec![UNWRITTEN; big_r]).unwrap();
        let t_lo = cuda.gpu.upload(&vec![UNWRITTEN; big_r]).unwrap();
        let plain = cuda.gpu.alloc_zeros::<u16>(case.y_width).unwrap();
        let rows = GemvLoraRows { a: [dev.a[0].ptr(), dev.a[1].ptr(), dev.a[2].ptr()], n_modules: 3, r_pad: h.r_pad, slots: dev.slots.ptr(), scales: dev.scales.ptr(), t_hi: t_hi.ptr(), t_lo: t_lo.ptr(), expand: None };
        // SAFETY: x holds one row of k, w y_width rows of k, y and plain y_width, t 3 * r_pad.
        unsafe {
            cuda.kernels.gemv(s, plain.ptr(), false, dev.x.ptr(), w.ptr(), 1, case.y_width, case.k).unwrap();
            cuda.kernels.gemv_lora_rows(s, dev.y.ptr(), dev.x.ptr(), w.ptr(), case.y_width, case.k, &rows).unwrap();
        }
        let y_rows = dev.y.download(s).unwrap();
        assert!(y_rows == plain.download(s).unwrap(), "slot {slot}: the base rows' bits differ from the plain GEMV's");
        let (hi, lo) = (t_hi.download(s).unwrap(), t_lo.download(s).unwrap());
        // The rows alone (no base rows: what runs before an 8-bit GEMV) give the same t.
        let (alone_hi, alone_lo) = (cuda.gpu.upload(&vec![UNWRITTEN; big_r]).unwrap(), cuda.gpu.upload(&vec![UNWRITTEN; big_r]).unwrap());
        let alone = GemvLoraRows { t_hi: alone_hi.ptr(), t_lo: alone_lo.ptr(), ..rows };
        // SAFETY: as above; with no base rows y is not written and w only names a valid row.
        unsafe { cuda.kernels.gemv_lora_rows(s, 0, dev.x.ptr(), w.ptr(), 0, case.k, &alone).unwrap() };
        assert!(alone_hi.download(s).unwrap() == hi && alone_lo.download(s).unwrap() == lo, "slot {slot}: the rows alone give another t");
        if slot < 0 {
            assert!(hi.iter().chain(&lo).all(|&v| v == UNWRITTEN), "no adapter: t must be left alone");
            continue;
        }
        check_one_token_t(&case, &h, slot, &hi, &lo, &format!("slot {slot}"));
        // The expand after it (what a one-token engine step does) adds the update to the GEMV's y.
        let modules = dev.modules(&case);
        let work = LoraScratch { t_hi: t_hi.ptr(), t_lo: t_lo.ptr(), ..dev.work() };
        // SAFETY: as above; the group's tables are sized for its one token.
        unsafe {
            cuda.kernels.lora_group(s, &dev.segs(), 1).unwrap();
            cuda.kernels.lora_expand(s, dev.y.ptr(), case.y_width, &modules, h.r_pad, &dev.segs(), &work, 1).unwrap();
        }
        let got = dev.y.download(s).unwrap();
        let (want, mag) = reference(&case, &Host { y0: y_rows.clone(), x: h.x.clone(), a: h.a.clone(), b: h.b.clone(), r_pad: h.r_pad });
        for j in 0..case.y_width {
            let tol = want[j].abs() / 256.0 + mag[j] / 4096.0 + 1e-6;
            assert!((val(got[j]) - want[j]).abs() <= tol, "slot {slot} column {j}: got {}, want {} (tol {tol})", val(got[j]), want[j]);
        }
    }
}

#[test]
fn the_8bit_gemv_computes_a_one_token_shrink_as_extra_blocks_and_the_expand_in_its_epilogue() {
    let Some(cuda) = cuda_or_skip() else { return };
    let s = &cuda.gpu.stream;
    let mut r = rng();
    // A fan-in below 8192 (the bf16 rows' 4 warps per row, one row a block) and one above (8 warps
    // per row: one row a block, two parts a warp); 344 base rows, the last 16-row tile partial.
    for k in [1040, 8208] {
        let base = Case { k, outs: vec![(200, 0), (72, 200), (72, 272)], y_width: 344, ranks: vec![8, 32, 64, 0], scales: vec![2.0, 0.5, 1.0, 0.0], slots: vec![0] };
        for format in [W8Format::E4m3, W8Format::I8] {
            if !cuda.kernels.w8_ready(format) {
                eprintln!("skipped {format:?}: this GPU lacks its 8-bit kernels");
                continue;
            }
            for slot in [0, 1, 2, 3, -1] {
                let case = Case { slots: vec![slot], ..base.clone() };
                let h = host_inputs(&mut r, &case);
                let dev = Group::upload(&cuda, &case, &h, &[0]);
                let n = case.y_width;
                // Row-wise 8-bit weights and the token's codes, quantized on the device.
                let w = cuda.gpu.upload(&rand_bf16(&mut r, n * k, 0.05)).unwrap();
                let (wq, ws) = (cuda.gpu.alloc_zeros::<u8>(n * k).unwrap(), cuda.gpu.alloc_zeros::<f32>(n).unwrap());
                let (xq, xs) = (cuda.gpu.alloc_zeros::<u8>(k).unwrap(), cuda.gpu.alloc_zeros::<f32>(1).unwrap());
                let big_r = case.outs.len() * h.r_pad;
                let unwritten = || cuda.gpu.upload(&vec![UNWRITTEN; big_r]).unwrap();
                let (t_hi, t_lo, alone_hi, alone_lo) = (unwritten(), unwritten(), unwritten(), unwritten());
                let (plain, y) = (cuda.gpu.alloc_zeros::<u16>(n).unwrap(), cuda.gpu.alloc_zeros::<u16>(n).unwrap());
                let rows = GemvLoraRows { a: [dev.a[0].ptr(), dev.a[1].ptr(), dev.a[2].ptr()], n_modules: 3, r_pad: h.r_pad, slots: dev.slots.ptr(), scales: dev.scales.ptr(), t_hi: t_hi.ptr(), t_lo: t_lo.ptr(), expand: None };
                let alone = GemvLoraRows { t_hi: alone_hi.ptr(), t_lo: alone_lo.ptr(), ..rows };
                // SAFETY: w holds n rows of k bf16, wq/ws their codes and scales, x one row of k and
                // xq/xs its codes and scale; y and plain n bf16; t 3 * r_pad bf16 each.
                unsafe {
                    cuda.kernels.quant_rows(s, format, wq.ptr(), ws.ptr(), w.ptr(), n, k).unwrap();
                    cuda.kernels.quant_rows(s, format, xq.ptr(), xs.ptr(), dev.x.ptr(), 1, k).unwrap();
                    cuda.kernels.gemv_w8(s, format, plain.ptr(), false, xq.ptr(), xs.ptr(), wq.ptr(), ws.ptr(), 1, n, k).unwrap();
                    cuda.kernels.gemv_w8_lora_rows(s, format, y.ptr(), xq.ptr(), xs.ptr(), wq.ptr(), ws.ptr(), n, k, dev.x.ptr(), &rows).unwrap();
                    // What ran before: the bf16 GEMV's rows alone.
                    cuda.kernels.gemv_lora_rows(s, 0, dev.x.ptr(), dev.x.ptr(), 0, k, &alone).unwrap();
                }
                let what = format!("k {k}, {format:?}, slot {slot}");
                let plain_bits = plain.download(s).unwrap();
                assert!(y.download(s).unwrap() == plain_bits, "{what}: the base blocks' bits differ from the plain 8-bit GEMV's");
                let (hi, lo) = (t_hi.download(s).unwrap(), t_lo.download(s).unwrap());
                assert!(alone_hi.download(s).unwrap() == hi && alone_lo.download(s).unwrap() == lo, "{what}: t differs from the bf16 GEMV's rows");
                // With the expand in the epilogue, twice: the counter zeroed by lora_group (as the
                // engine's step does) before each; the second must give the same bits.
                // (It starts past any count, so that a launch without the zeroing would not wait.)
                let stale = 1 << 20;
                let mut counter = cuda.gpu.upload(&[stale]).unwrap();
                let (ex_hi, ex_lo) = (unwritten(), unwritten());
                let expand = GemvLoraExpand { b: [dev.b[0].ptr(), dev.b[1].ptr(), dev.b[2].ptr()], out: [200, 72, 72], col: [0, 200, 272], counter: counter.ptr() };
                let with_expand = GemvLoraRows { t_hi: ex_hi.ptr(), t_lo: ex_lo.ptr(), expand: Some(expand), ..rows };
                let (y_ex, plain_f32) = (cuda.gpu.alloc_zeros::<u16>(n).unwrap(), cuda.gpu.alloc_zeros::<f32>(n).unwrap());
                let mut launches = vec![];
                for _ in 0..2 {
                    // SAFETY: as above; B stacks hold [slots, out, r_pad] per module, the columns
                    // lie inside y's n, the counter is zeroed first; plain_f32 holds n f32.
                    unsafe {
                        cuda.kernels.lora_group_zeroing(s, &dev.segs(), 1, counter.ptr(), 1).unwrap();
                        cuda.kernels.gemv_w8_lora_rows(s, format, y_ex.ptr(), xq.ptr(), xs.ptr(), wq.ptr(), ws.ptr(), n, k, dev.x.ptr(), &with_expand).unwrap();
                    }
                    launches.push(y_ex.download(s).unwrap());
                    // One LoRA row a block at these fan-ins (4 and 8 warps per row).
                    assert_eq!(counter.download(s).unwrap()[0], 3 * h.r_pad as i32, "{what}: the LoRA blocks' count");
                    counter.write(s, &[stale]).unwrap();
                }
                assert!(launches[0] == launches[1], "{what}: a second launch gives other bits");
                assert!(ex_hi.download(s).unwrap() == hi && ex_lo.download(s).unwrap() == lo, "{what}: t differs with the expand");
                // SAFETY: as above.
                unsafe { cuda.kernels.gemv_w8(s, format, plain_f32.ptr(), true, xq.ptr(), xs.ptr(), wq.ptr(), ws.ptr(), 1, n, k).unwrap() };
                let base_f32 = plain_f32.download(s).unwrap();
                for (j, &got) in launches[0].iter().enumerate() {
                    let (m, &(out, col)) = case.outs.iter().enumerate().find(|(_, &(out, col))| (col..col + out).contains(&j)).unwrap();
                    let terms: Vec<f64> = match slot {
                        -1 => vec![],
                        sl => (0..h.r_pad).map(|rr| (val(hi[m * h.r_pad + rr]) + val(lo[m * h.r_pad + rr])) * val(h.b[m][((sl as usize) * out + j - col) * h.r_pad + rr])).collect(),
                    };
                    let want = base_f32[j] as f64 + terms.iter().sum::<f64>();
                    let tol = want.abs() / 256.0 + terms.iter().map(|t| t.abs()).sum::<f64>() / 4096.0 + 1e-6;
                    assert!((val(got) - want).abs() <= tol, "{what} column {j}: with the expand {}, want {want} (tol {tol})", val(got));
                }
                if slot < 0 {
                    assert!(launches[0] == plain_bits, "{what}: no adapter, y must be the plain GEMV's");
                    assert!(hi.iter().chain(&lo).all(|&v| v == UNWRITTEN), "{what}: no adapter, t must be left alone");
                    continue;
                }
                // And against the reference (so that both cannot be wrong alike).
                check_one_token_t(&case, &h, slot, &hi, &lo, &what);
            }
        }
    }
}

#[test]
fn the_dense_shrink_and_pick_match_the_reference() {
    let Some(cuda) = cuda_or_skip() else { return };
    let s = &cuda.gpu.stream;
    let mut r = rng();
    // What decode-sized engine steps on the side stream take (cuda/lora.rs, DenseShrink): one cuBLAS
    // GEMM of every token against every slot's A of a q|k|v-like group, then `lora_pick_t` keeps each
    // token's own slot, then the expand. Slots of rank 8, 16, 32, 64 and an empty one, tokens
    // without an adapter mixed in, a fan-in ending inside a 256-wide chunk.
    let mut slots: Vec<i32> = (0..150).map(|i| [0, 1, 2, 3, 4, -1][i % 6]).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    let case = Case { k: 1040, outs: vec![(200, 0), (72, 200), (72, 273)], y_width: 346, ranks: vec![8, 16, 32, 64, 0], scales: vec![2.0, 0.5, 1.0, 4.0, 0.0], slots };
    let h = host_inputs(&mut r, &case);
    let (want, mag) = reference(&case, &h);
    let n = case.slots.len();
    let dev = Group::upload(&cuda, &case, &h, &(0..n).collect::<Vec<_>>());
    // The group's A stack: every module's [slots, r_pad, k] one after another.
    let a_group = cuda.gpu.upload(&h.a.concat()).unwrap();
    let cols = case.outs.len() * case.ranks.len() * h.r_pad;
    let u = cuda.gpu.alloc_zeros::<f32>(n * cols).unwrap();
    let big_r = case.outs.len() * h.r_pad;
    let t_hi = cuda.gpu.upload(&vec![UNWRITTEN; n * big_r]).unwrap();
    let t_lo = cuda.gpu.upload(&vec![UNWRITTEN; n * big_r]).unwrap();
    let work = LoraScratch { t_hi: t_hi.ptr(), t_lo: t_lo.ptr(), ..dev.work() };
    let (segs, modules) = (dev.segs(), dev.modules(&case));
    // SAFETY: x holds n rows of k, the stack cols rows of k, u n rows of cols, t n rows of big_r; the
    // tables are sized for n tokens.
    unsafe {
        cuda.kernels.lora_group(s, &segs, n).unwrap();
        cuda.blas.matmul(u.ptr(), peregrine_kernels::OutType::F32, dev.x.ptr(), a_group.ptr(), n, cols, case.k, 0.0).unwrap();
        cuda.kernels.lora_pick_t(s, u.ptr(), case.outs.len(), h.r_pad, &segs, &work, n).unwrap();
    }
    let (hi, lo) = (t_hi.download(s).unwrap(), t_lo.download(s).unwrap());
    for (i, &slot) in case.slots.iter().enumerate() {
        let row = i * big_r..(i + 1) * big_r;
        if slot < 0 {
            assert!(hi[row.clone()].iter().chain(&lo[row]).all(|&v| v == UNWRITTEN), "token {i} without an adapter: t must be left alone");
            continue;
        }
        let (sl, rank, scale) = (slot as usize, case.ranks[slot as usize], case.scales[slot as usize] as f64);
        for m in 0..case.outs.len() {
            for rr in 0..h.r_pad {
                let at = i * big_r + m * h.r_pad + rr;
                if rr >= rank {
                    assert!(hi[at] == 0 && lo[at] == 0, "token {i}, slot {slot}, module {m}, rank {rr} past {rank}: t must be 0");
                    continue;
                }
                let terms: Vec<f64> = (0..case.k).map(|j| val(h.x[i * case.k + j]) * val(h.a[m][(sl * h.r_pad + rr) * case.k + j]) * scale).collect();
                let want_t: f64 = terms.iter().sum();
                let tol = terms.iter().map(|t| t.abs()).sum::<f64>() / 4096.0 + 1e-7;
                let got_t = val(hi[at]) + val(lo[at]);
                assert!((got_t - want_t).abs() <= tol, "token {i}, slot {slot}, module {m}, rank {rr}: t {got_t}, want {want_t} (tol {tol})");
            }
        }
    }
    // SAFETY: as above; t holds this group's shrink output for the n tokens.
    unsafe { cuda.kernels.lora_expand(s, dev.y.ptr(), case.y_width, &modules, h.r_pad, &segs, &work, n).unwrap() };
    let got = dev.y.download(s).unwrap();
    for (i, &slot) in case.slots.iter().enumerate() {
        for j in 0..case.y_width {
            let at = i * case.y_width + j;
            let in_module = case.outs.iter().any(|&(out, col)| (col..col + out).contains(&j));
            if slot < 0 || !in_module || case.ranks[slot as usize] == 0 {
                assert_eq!(got[at], h.y0[at], "token {i} (slot {slot}) column {j} must be left alone");
                continue;
            }
            let tol = want[at].abs() / 256.0 + mag[at] / 4096.0 + 1e-6;
            assert!((val(got[at]) - want[at]).abs() <= tol, "token {i} (slot {slot}) column {j}: got {}, want {} (tol {tol})", val(got[at]), want[at]);
        }
    }
}

/// What an 8-bit fused projection left for its consumer (`Cuda::linear_w8_deferred`): the raw
/// output (the case's y0 as bf16, or int32 sums) and the token and row scales still to apply (every
/// column's, the A rows' included), or `deferred: false`, a final bf16 y0 (our GEMVs' output).
struct W8Out {
    format: W8Format,
    deferred: bool,
    xs: Vec<f32>,
    ws: Vec<f32>,
    sums: Option<Vec<i32>>,
}

impl W8Out {
    /// Scales and sums that put the effective y near ±2, as the bf16 cases' y0.
    fn new(r: &mut ChaCha8Rng, format: W8Format, deferred: bool, sums: bool, n: usize, y_width: usize, y0: &mut [u16]) -> W8Out {
        let (xs, ws): (Vec<f32>, Vec<f32>) = if sums {
            ((0..n).map(|_| r.random_range(0.005f32..0.02)).collect(), (0..y_width).map(|_| r.random_range(0.005f32..0.02)).collect())
        } else {
            ((0..n).map(|_| r.random_range(0.05f32..0.2)).collect(), (0..y_width).map(|_| r.random_range(0.05f32..0.2)).collect())
        };
        if deferred && !sums {
            for v in y0.iter_mut() {
                *v = bf16::from_f64(val(*v) * 100.0).to_bits();
            }
        }
        let sums = sums.then(|| (0..n * y_width).map(|_| r.random_range(-20_000i32..20_000)).collect());
        W8Out { format, deferred, xs, ws, sums }
    }

    /// Token i's column `col` as the consumer must see it (f64).
    fn eff(&self, h: &Host, y_width: usize, i: usize, col: usize) -> f64 {
        if !self.deferred {
            return val(h.y0[i * y_width + col]);
        }
        let raw = match &self.sums {
            Some(s) => s[i * y_width + col] as f64,
            None => val(h.y0[i * y_width + col]),
        };
        raw * self.xs[i] as f64 * self.ws[col] as f64
    }

    /// The consumer rounds each scaled u to bf16 (2^-9 relative) before its products.
    fn u_rounding(&self) -> f64 {
        if self.deferred {
            1.0 / 256.0
        } else {
            0.0
        }
    }
}

/// The scales and sums of a [`W8Out`] for the tokens `pick` on the GPU.
struct W8Dev {
    xs: DevBuf<f32>,
    ws: DevBuf<f32>,
    sums: Option<DevBuf<i32>>,
}

impl W8Dev {
    fn upload(cuda: &Cuda, w8: &W8Out, y_width: usize, pick: &[usize]) -> W8Dev {
        let g = &cuda.gpu;
        W8Dev {
            xs: g.upload(&pick.iter().map(|&i| w8.xs[i]).collect::<Vec<f32>>()).unwrap(),
            ws: g.upload(&w8.ws).unwrap(),
            sums: w8.sums.as_ref().map(|s| g.upload(&pick.iter().flat_map(|&i| s[i * y_width..(i + 1) * y_width].to_vec()).collect::<Vec<i32>>()).unwrap()),
        }
    }

    fn scale(&self, w8: &W8Out) -> Option<OuterScale> {
        w8.deferred.then(|| OuterScale { xs: self.xs.ptr(), ws: self.ws.ptr(), sums_i32: self.sums.as_ref().map_or(0, |s| s.ptr()) })
    }
}

/// What the fused norm wrote: the residual after, the normed bf16 rows, and over 8-bit weights the
/// rows' codes and scales.
struct NormOut {
    residual: Vec<f32>,
    out: Vec<u16>,
    codes: Vec<u8>,
    scales: Vec<f32>,
}

/// `add_rmsnorm_lora` (or with `w8` `add_rmsnorm_lora_quant`, its token scales read from and its
/// own written to the same buffer, as the engine runs it) for the tokens `pick` of the case.
#[allow(clippy::too_many_arguments)]
fn fused_norm_run(cuda: &Cuda, c: &Case, h: &Host, hidden: usize, residual: &[f32], weight: &DevBuf<f32>, pick: &[usize], w8: Option<&W8Out>) -> NormOut {
    let g = &cuda.gpu;
    let s = &g.stream;
    let dev = Group::upload(cuda, c, h, pick);
    let n = dev.n;
    let res = g.upload(&pick.iter().flat_map(|&i| residual[i * hidden..(i + 1) * hidden].to_vec()).collect::<Vec<f32>>()).unwrap();
    let out = g.upload(&vec![UNWRITTEN; n * hidden]).unwrap();
    let codes = g.upload(&vec![0xA5u8; n * hidden]).unwrap();
    let w8_dev = w8.map(|w| W8Dev::upload(cuda, w, c.y_width, pick));
    let segs = dev.segs();
    // SAFETY: residual/out/codes hold n rows of hidden, y (and the sums) n rows of y_width >= hidden
    // + slots · r_pad, b [slots, hidden, r_pad], ws y_width scales, xs n, the tables sized for n
    // tokens.
    unsafe {
        cuda.kernels.lora_group(s, &segs, n).unwrap();
        match (w8, &w8_dev) {
            (Some(w), Some(d)) => cuda.kernels.add_rmsnorm_lora_quant(s, w.format, res.ptr(), dev.y.ptr(), c.y_width, d.scale(w), dev.b[0].ptr(), weight.ptr(), out.ptr(), codes.ptr(), d.xs.ptr(), &segs, n, hidden, 1e-5, h.r_pad).unwrap(),
            _ => cuda.kernels.add_rmsnorm_lora(s, res.ptr(), dev.y.ptr(), c.y_width, dev.b[0].ptr(), weight.ptr(), out.ptr(), &segs, n, hidden, 1e-5, h.r_pad).unwrap(),
        }
    }
    NormOut {
        residual: res.download(s).unwrap(),
        out: out.download(s).unwrap(),
        codes: codes.download(s).unwrap(),
        scales: w8_dev.map_or(vec![], |d| d.xs.download(s).unwrap()),
    }
}

fn e4m3_value(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 0 {
        sign * m as f64 / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
    }
}

/// Checks the fused norm over a case of this hidden size against an f64 reference (and, with `w8`
/// = (format, deferred, int32 sums), its codes and scales), then that a token's bits alone equal
/// its bits in the whole batch.
fn check_fused_norm(cuda: &Cuda, r: &mut ChaCha8Rng, hidden: usize, w8: Option<(W8Format, bool, bool)>) {
    let mut slots: Vec<i32> = (0..150).map(|i| [0, 1, 2, 3, 4, -1, -1][i % 7]).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    let (ranks, scales) = (vec![8, 16, 32, 64, 0], vec![2.0, 0.5, 1.0, 4.0, 0.0]);
    let r_pad = lora_rank_pad(64);
    let y_width = hidden + ranks.len() * r_pad + 8;
    let case = Case { k: 16, outs: vec![(hidden, 0)], y_width, ranks, scales, slots };
    let mut h = host_inputs(r, &case);
    let n = case.slots.len();
    let w8 = w8.map(|(format, deferred, sums)| W8Out::new(r, format, deferred, sums, n, y_width, &mut h.y0));
    let what = format!("hidden {hidden} {:?}", w8.as_ref().map(|w| (w.format, w.deferred, w.sums.is_some())));
    let eff = |i: usize, col: usize| w8.as_ref().map_or_else(|| val(h.y0[i * y_width + col]), |w| w.eff(&h, y_width, i, col));
    let u_rounding = w8.as_ref().map_or(0.0, |w| w.u_rounding());
    let residual: Vec<f32> = (0..n * hidden).map(|_| r.random_range(-2.0f32..2.0)).collect();
    let weight_host: Vec<f32> = (0..hidden).map(|_| r.random_range(0.5f32..1.5)).collect();
    let weight = cuda.gpu.upload(&weight_host).unwrap();
    let all: Vec<usize> = (0..n).collect();
    let got = fused_norm_run(cuda, &case, &h, hidden, &residual, &weight, &all, w8.as_ref());
    for (i, &slot) in case.slots.iter().enumerate() {
        // The reference: residual + base + scale · u · Bᵀ in f64, then the norm.
        let mut v = vec![0f64; hidden];
        let mut err = vec![1e-6f64; hidden];
        for j in 0..hidden {
            let base = residual[i * hidden + j] as f64 + eff(i, j);
            let mut upd = 0.0;
            let mut mag = 0.0;
            if slot >= 0 {
                let s = slot as usize;
                for rr in 0..case.ranks[s] {
                    let term = eff(i, hidden + s * r_pad + rr) * val(h.b[0][(s * hidden + j) * r_pad + rr]) * case.scales[s] as f64;
                    upd += term;
                    mag += term.abs();
                }
            }
            v[j] = base + upd;
            // The update is rounded to bf16 once (2^-9 relative), its f32 sum far below (and over
            // 8-bit weights each scaled u once more); the f32 residual and scaling add a few ulps.
            err[j] += upd.abs() / 256.0 + mag / 4096.0 + mag * u_rounding + base.abs() * 2e-6;
        }
        let inv = 1.0 / (v.iter().map(|x| x * x).sum::<f64>() / hidden as f64 + 1e-5).sqrt();
        let want: Vec<f64> = (0..hidden).map(|j| v[j] * inv * weight_host[j] as f64).collect();
        let tol: Vec<f64> = (0..hidden).map(|j| want[j].abs() / 128.0 + 2.0 * err[j] * inv * weight_host[j] as f64 + 1e-5).collect();
        for j in 0..hidden {
            let res = got.residual[i * hidden + j] as f64;
            assert!((res - v[j]).abs() <= err[j], "{what} token {i} (slot {slot}) column {j}: residual {res}, want {} (tol {})", v[j], err[j]);
            let out = val(got.out[i * hidden + j]);
            assert!((out - want[j]).abs() <= tol[j], "{what} token {i} (slot {slot}) column {j}: out {out}, want {} (tol {})", want[j], tol[j]);
        }
        let Some(w) = &w8 else { continue };
        // The codes: scale = max |v| / Q (448 or 127), each code v / scale rounded to the format.
        let q_max = if w.format == W8Format::E4m3 { 448.0 } else { 127.0 };
        let amax = want.iter().fold(0f64, |m, x| m.max(x.abs()));
        let scale = got.scales[i] as f64;
        assert!((scale - amax / q_max).abs() <= amax / q_max / 64.0 + 1e-9, "{what} token {i}: scale {scale}, want {}", amax / q_max);
        for j in 0..hidden {
            let code = got.codes[i * hidden + j];
            let (value, step) = match w.format {
                W8Format::E4m3 => (e4m3_value(code) * scale, want[j].abs() / 16.0 + scale * 2f64.powi(-10)),
                W8Format::I8 => (code as i8 as f64 * scale, scale / 2.0),
            };
            let bound = step * 1.01 + tol[j] + want[j].abs() / 64.0;
            assert!((value - want[j]).abs() <= bound, "{what} token {i} column {j}: code {code:#04x} is {value}, want {} (bound {bound})", want[j]);
        }
    }
    // A token's bits alone, in a few small batches and in the whole one, are the same: its sums
    // depend on its own row only, whatever shares its tile.
    for pick in [vec![7usize], vec![3, 149, 40], (20..37).collect::<Vec<_>>()] {
        let alone = fused_norm_run(cuda, &case, &h, hidden, &residual, &weight, &pick, w8.as_ref());
        for (a, &i) in pick.iter().enumerate() {
            let (ra, ri) = (a * hidden..(a + 1) * hidden, i * hidden..(i + 1) * hidden);
            assert!(alone.residual[ra.clone()].iter().zip(&got.residual[ri.clone()]).all(|(x, y)| x.to_bits() == y.to_bits()), "{what} token {i}: residual bits differ alone");
            assert_eq!(&alone.out[ra.clone()], &got.out[ri.clone()], "{what} token {i}: normed bits differ alone");
            if w8.is_some() {
                assert_eq!(&alone.codes[ra], &got.codes[ri], "{what} token {i}: codes differ alone");
                assert_eq!(alone.scales[a].to_bits(), got.scales[i].to_bits(), "{what} token {i}: scale differs alone");
            }
        }
    }
}

/// The GPU where `add_rmsnorm_lora` runs (sm_90: thread block clusters), or None with a visible skip.
fn cuda_with_clusters() -> Option<Cuda> {
    let cuda = cuda_or_skip()?;
    if !cuda.kernels.add_rmsnorm_lora_fits(576) {
        eprintln!("skipped: add_rmsnorm_lora needs sm_90 (thread block clusters)");
        return None;
    }
    Some(cuda)
}

#[test]
fn the_fused_norm_adds_each_tokens_expand_before_normalizing() {
    let Some(cuda) = cuda_with_clusters() else { return };
    let mut r = rng();
    // What a fused o or down projection leaves (cuda/lora.rs, FusedNorms): the base output in the
    // first `hidden` columns of y, then every slot's u = x · Aᵀ (unscaled), at a row stride of
    // hidden + slots · r_pad (+ 8 here: any stride at least that). Hidden 576 (SmolLM2: 9 column
    // tiles per block, uneven over the warps) and 4096 (the largest per-warp share). Slots of rank
    // 8, 16, 32, 64 and an empty one, tokens without an adapter mixed in, tiles ragged.
    for hidden in [576usize, 4096] {
        check_fused_norm(&cuda, &mut r, hidden, None);
    }
}

#[test]
fn the_fused_norm_over_an_8bit_projection_scales_its_output_and_quantizes_the_row() {
    let Some(cuda) = cuda_with_clusters() else { return };
    let mut r = rng();
    // Over 8-bit weights the projection's weight carries the A rows row-quantized, and cuBLASLt
    // leaves its scales to this kernel: e4m3's raw bf16 output and int8's int32 sums, each times
    // the token's and the column's scale (u's columns the A rows' own); our GEMV (small steps)
    // leaves a final y. The row's codes and scale are written as add_rmsnorm_quant's.
    for hidden in [576usize, 4096] {
        for (format, deferred, sums) in [(W8Format::E4m3, true, false), (W8Format::I8, true, true), (W8Format::E4m3, false, false), (W8Format::I8, false, false)] {
            check_fused_norm(&cuda, &mut r, hidden, Some((format, deferred, sums)));
        }
    }
}

/// `silu_mul_lora` for the tokens `pick` of the case (gate|up: modules 0 and 1 of `inter` each),
/// each block taking `tiles_per_block` work tiles (None: the count the kernel picks).
fn fused_swiglu_run(cuda: &Cuda, c: &Case, h: &Host, inter: usize, pick: &[usize], tiles_per_block: Option<usize>) -> Vec<u16> {
    let g = &cuda.gpu;
    let s = &g.stream;
    let dev = Group::upload(cuda, c, h, pick);
    let n = dev.n;
    let out = g.upload(&vec![UNWRITTEN; n * inter]).unwrap();
    let segs = dev.segs();
    // SAFETY: out holds n rows of inter, y n rows of y_width >= 2 (inter + slots · r_pad), the B
    // stacks [slots, inter, r_pad], the tables sized for n tokens.
    unsafe {
        cuda.kernels.lora_group(s, &segs, n).unwrap();
        match tiles_per_block {
            Some(tpb) => cuda.kernels.silu_mul_lora_tiles(s, out.ptr(), dev.y.ptr(), c.y_width, inter, dev.b[0].ptr(), dev.b[1].ptr(), &segs, n, h.r_pad, tpb).unwrap(),
            None => cuda.kernels.silu_mul_lora(s, out.ptr(), dev.y.ptr(), c.y_width, inter, dev.b[0].ptr(), dev.b[1].ptr(), &segs, n, h.r_pad).unwrap(),
        }
    }
    out.download(s).unwrap()
}

#[test]
fn the_fused_swiglu_adds_each_tokens_gate_and_up_updates() {
    let Some(cuda) = cuda_or_skip() else { return };
    if !cuda.kernels.silu_mul_lora_fits(1536) {
        eprintln!("skipped: silu_mul_lora needs sm_90");
        return;
    }
    let mut r = rng();
    // What a fused gate|up projection leaves (cuda/lora.rs, FusedNorms): gate, up, then every
    // slot's u_gate, then every slot's u_up. SmolLM2's 1536 columns per module; ranks 8-64 (the
    // kernel that holds 4 k steps of B) and 8-32 (the one that holds 2), an empty slot, tokens
    // without an adapter mixed in; about 17 tokens a slot, so two tiles each, and blocks taking 3
    // tiles reach into the next slot.
    let inter = 1536usize;
    for (ranks, max_rank) in [(vec![8, 16, 32, 64, 0], 64), (vec![8, 16, 32, 24, 0], 32)] {
        let mut slots: Vec<i32> = (0..100).map(|i| [0, 1, 2, 3, 4, -1][i % 6]).collect();
        for i in (1..slots.len()).rev() {
            slots.swap(i, r.random_range(0..=i));
        }
        let scales = vec![2.0, 0.5, 1.0, 4.0, 0.0];
        let r_pad = lora_rank_pad(max_rank);
        let num_slots = ranks.len();
        let y_width = 2 * (inter + num_slots * r_pad) + 8;
        let case = Case { k: 16, outs: vec![(inter, 0), (inter, inter)], y_width, ranks, scales, slots };
        let h = host_inputs(&mut r, &case);
        let n = case.slots.len();
        let all: Vec<usize> = (0..n).collect();
        let got = fused_swiglu_run(&cuda, &case, &h, inter, &all, Some(1));
        for (i, &slot) in case.slots.iter().enumerate() {
            for j in 0..inter {
                // Each module's value plus its update (f64), the update's error bound as rounded to bf16.
                let value = |m: usize| {
                    let base = val(h.y0[i * y_width + m * inter + j]);
                    let (mut upd, mut mag) = (0.0, 0.0);
                    if slot >= 0 {
                        let s = slot as usize;
                        let u_at = i * y_width + 2 * inter + (m * num_slots + s) * r_pad;
                        for rr in 0..case.ranks[s] {
                            let term = val(h.y0[u_at + rr]) * val(h.b[m][(s * inter + j) * r_pad + rr]) * case.scales[s] as f64;
                            upd += term;
                            mag += term.abs();
                        }
                    }
                    (base + upd, upd.abs() / 256.0 + mag / 4096.0 + 1e-6)
                };
                let ((gv, ge), (uv, ue)) = (value(0), value(1));
                let silu = |x: f64| x / (1.0 + (-x).exp());
                let want = silu(gv) * uv;
                // silu's slope is at most 1.1; the product rounds to bf16 once.
                let tol = want.abs() / 128.0 + 1.1 * ge * uv.abs() + ue * silu(gv).abs() + 1e-5;
                let v = val(got[i * inter + j]);
                assert!((v - want).abs() <= tol, "rank {max_rank}: token {i} (slot {slot}) column {j}: {v}, want {want} (tol {tol})");
            }
        }
        // Blocks taking several tiles (B held across them, reloaded where the tiles reach the next
        // slot) give the same bits as one tile a block.
        for tpb in [Some(2), Some(3), Some(4), Some(8), None] {
            let many = fused_swiglu_run(&cuda, &case, &h, inter, &all, tpb);
            assert_eq!(many, got, "rank {max_rank}: {tpb:?} tiles per block differ from one");
        }
        for pick in [vec![5usize], vec![2, 99, 31], (40..57).collect::<Vec<_>>()] {
            let alone = fused_swiglu_run(&cuda, &case, &h, inter, &pick, None);
            for (a, &i) in pick.iter().enumerate() {
                assert_eq!(&alone[a * inter..(a + 1) * inter], &got[i * inter..(i + 1) * inter], "rank {max_rank}: token {i}: bits differ alone");
            }
        }
    }
}

/// A q|k|v case's RoPE inputs: positions, the tables, each token's cache slot, a bias.
struct RopeInputs {
    hq: usize,
    hkv: usize,
    d: usize,
    block_size: usize,
    num_blocks: usize,
    positions: Vec<i32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    cache_slots: Vec<i32>,
    bias: Option<Vec<f32>>,
}

/// `rope_kv_write_lora` for the tokens `pick` of the case: (q_out, k cache, v cache), the caches
/// starting as [`UNWRITTEN`].
fn fused_rope_run(cuda: &Cuda, c: &Case, h: &Host, ri: &RopeInputs, pick: &[usize], w8: Option<&W8Out>) -> (Vec<u16>, Vec<u16>, Vec<u16>) {
    let g = &cuda.gpu;
    let s = &g.stream;
    let dev = Group::upload(cuda, c, h, pick);
    let n = dev.n;
    let gather = |v: &[i32]| pick.iter().map(|&i| v[i]).collect::<Vec<i32>>();
    let positions = g.upload(&gather(&ri.positions)).unwrap();
    let cache_slots = g.upload(&gather(&ri.cache_slots)).unwrap();
    let (cos, sin) = (g.upload(&ri.cos).unwrap(), g.upload(&ri.sin).unwrap());
    let bias = ri.bias.as_ref().map(|b| g.upload(b).unwrap());
    let q_out = g.upload(&vec![UNWRITTEN; n * ri.hq * ri.d]).unwrap();
    let cache_len = ri.num_blocks * ri.hkv * ri.block_size * ri.d;
    let (kc, vc) = (g.upload(&vec![UNWRITTEN; cache_len]).unwrap(), g.upload(&vec![UNWRITTEN; cache_len]).unwrap());
    let w8_dev = w8.map(|w| W8Dev::upload(cuda, w, c.y_width, pick));
    let y_scale = w8.zip(w8_dev.as_ref()).and_then(|(w, d)| d.scale(w));
    let segs = dev.segs();
    let rope = RopeTables { positions: positions.ptr(), cos: cos.ptr(), sin: sin.ptr() };
    let cache = RopeCache { cache_slots: cache_slots.ptr(), q_out: q_out.ptr(), k_cache: kc.ptr(), v_cache: vc.ptr(), hq: ri.hq, hkv: ri.hkv, d: ri.d, block_size: ri.block_size };
    // SAFETY: y holds n rows of y_width >= width + 3 · slots · r_pad, the B stacks [slots, fan-out,
    // r_pad], the tables cover every position, the caches every slot, the segment tables n tokens.
    unsafe {
        cuda.kernels.lora_group(s, &segs, n).unwrap();
        cuda.kernels.rope_kv_write_lora(s, dev.y.ptr(), c.y_width, bias.as_ref().map(|b| b.ptr()), rope, cache, [dev.b[0].ptr(), dev.b[1].ptr(), dev.b[2].ptr()], &segs, n, h.r_pad, y_scale).unwrap();
    }
    (q_out.download(s).unwrap(), kc.download(s).unwrap(), vc.download(s).unwrap())
}

/// The GPU where `rope_kv_write_lora` runs (sm_90), or None with a visible skip.
fn cuda_for_fused_rope() -> Option<Cuda> {
    let cuda = cuda_or_skip()?;
    if !cuda.kernels.rope_kv_write_lora_fits(64) {
        eprintln!("skipped: rope_kv_write_lora needs sm_90");
        return None;
    }
    Some(cuda)
}

#[test]
fn the_fused_rope_adds_each_tokens_qkv_update_before_rotating_and_caching() {
    let Some(cuda) = cuda_for_fused_rope() else { return };
    let mut r = rng();
    // What a fused q|k|v projection leaves (cuda/lora.rs, FusedNorms): q, k, v, then every slot's
    // u_q, u_k, u_v. SmolLM2's heads (9 q, 3 kv of 64, with a bias as Qwen's models have) and heads
    // of 128 (two RoPE pairs of column tiles per warp). Ranks 8-64 and an empty slot, tokens
    // without an adapter mixed in, tiles ragged; cache slots scattered over the blocks.
    for heads in [(9usize, 3usize, 64usize, true), (8, 2, 128, false)] {
        check_fused_rope(&cuda, &mut r, heads, None);
    }
}

#[test]
fn the_fused_rope_over_an_8bit_projection_scales_its_output() {
    let Some(cuda) = cuda_for_fused_rope() else { return };
    let mut r = rng();
    // As the fused norm's 8-bit cases: e4m3's raw bf16 output or int8's int32 sums with the scales
    // left to this kernel (u's columns the A rows' own).
    for heads in [(9usize, 3usize, 64usize, true), (8, 2, 128, false)] {
        for (format, sums) in [(W8Format::E4m3, false), (W8Format::I8, true)] {
            check_fused_rope(&cuda, &mut r, heads, Some((format, true, sums)));
        }
    }
}

/// Checks the fused RoPE + KV write over a case with these heads `(hq, hkv, d, with_bias)` (and
/// `w8` as [`check_fused_norm`]'s) against an f64 reference, then a token's bits alone against its
/// bits in the whole batch.
fn check_fused_rope(cuda: &Cuda, r: &mut ChaCha8Rng, (hq, hkv, d, with_bias): (usize, usize, usize, bool), w8: Option<(W8Format, bool, bool)>) {
    let mut slots: Vec<i32> = (0..120).map(|i| [0, 1, 2, 3, 4, -1, -1][i % 7]).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    let n = slots.len();
    let (ranks, scales) = (vec![8, 16, 32, 64, 0], vec![2.0, 0.5, 1.0, 4.0, 0.0]);
    let r_pad = lora_rank_pad(64);
    let num_slots = ranks.len();
    let width = (hq + 2 * hkv) * d;
    let y_width = width + 3 * num_slots * r_pad + 8;
    let outs = vec![(hq * d, 0), (hkv * d, hq * d), (hkv * d, (hq + hkv) * d)];
    let case = Case { k: 16, outs: outs.clone(), y_width, ranks, scales, slots };
    let mut h = host_inputs(r, &case);
    let w8 = w8.map(|(format, deferred, sums)| W8Out::new(r, format, deferred, sums, n, y_width, &mut h.y0));
    let eff = |i: usize, col: usize| w8.as_ref().map_or_else(|| val(h.y0[i * y_width + col]), |w| w.eff(&h, y_width, i, col));
    let u_rounding = w8.as_ref().map_or(0.0, |w| w.u_rounding());
    let half = d / 2;
    let max_pos = 300usize;
    let mut cos = vec![0f32; max_pos * half];
    let mut sin = vec![0f32; max_pos * half];
    for p in 0..max_pos {
        for i in 0..half {
            let angle = p as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
            cos[p * half + i] = angle.cos() as f32;
            sin[p * half + i] = angle.sin() as f32;
        }
    }
    let block_size = 16usize;
    let num_blocks = n.div_ceil(block_size) + 3;
    let mut cache_slots: Vec<i32> = (0..(num_blocks * block_size) as i32).collect();
    for i in (1..cache_slots.len()).rev() {
        cache_slots.swap(i, r.random_range(0..=i));
    }
    cache_slots.truncate(n);
    let ri = RopeInputs {
        hq,
        hkv,
        d,
        block_size,
        num_blocks,
        positions: (0..n).map(|_| r.random_range(0..max_pos as i32)).collect(),
        cos,
        sin,
        cache_slots,
        bias: with_bias.then(|| (0..width).map(|_| r.random_range(-0.5f32..0.5)).collect()),
    };
    let all: Vec<usize> = (0..n).collect();
    let (q_got, k_got, v_got) = fused_rope_run(cuda, &case, &h, &ri, &all, w8.as_ref());
    // Where token i's head `head` (q heads, then k, then v) column j went.
    let at = |i: usize, head: usize, j: usize| -> (u16, usize) {
        let (blk, off) = (ri.cache_slots[i] as usize / block_size, ri.cache_slots[i] as usize % block_size);
        let kv = |kvh: usize| ((blk * hkv + kvh) * block_size + off) * d + j;
        match head {
            _ if head < hq => (q_got[i * hq * d + head * d + j], 0),
            _ if head < hq + hkv => (k_got[kv(head - hq)], 1),
            _ => (v_got[kv(head - hq - hkv)], 2),
        }
    };
    for (i, &slot) in case.slots.iter().enumerate() {
        // Column `col` of the token's q|k|v before RoPE (f64) and its error bound: the update is
        // rounded to bf16 once (2^-9 relative), its f32 sum far below.
        let value = |col: usize| -> (f64, f64) {
            let y = eff(i, col);
            let mut x = y + ri.bias.as_ref().map_or(0.0, |b| b[col] as f64);
            let (mut upd, mut mag) = (0.0, 0.0);
            if slot >= 0 {
                let s = slot as usize;
                let m = outs.iter().position(|&(out, first)| (first..first + out).contains(&col)).unwrap();
                let (out, first) = outs[m];
                let u_at = i * y_width + width + (m * num_slots + s) * r_pad;
                for rr in 0..case.ranks[s] {
                    let term = eff(i, u_at - i * y_width + rr) * val(h.b[m][(s * out + col - first) * r_pad + rr]) * case.scales[s] as f64;
                    upd += term;
                    mag += term.abs();
                }
            }
            x += upd;
            (x, upd.abs() / 256.0 + mag / 4096.0 + mag * u_rounding + y.abs() * 2e-6 + 1e-6)
        };
        let pos = ri.positions[i] as usize;
        for head in 0..hq + 2 * hkv {
            for j in 0..half {
                let (c0, c1) = (head * d + j, head * d + j + half);
                let ((x0, e0), (x1, e1)) = (value(c0), value(c1));
                let (want0, want1) = if head < hq + hkv {
                    let (cv, sv) = (ri.cos[pos * half + j] as f64, ri.sin[pos * half + j] as f64);
                    (x0 * cv - x1 * sv, x1 * cv + x0 * sv)
                } else {
                    (x0, x1)
                };
                for (jj, want) in [(j, want0), (j + half, want1)] {
                    let (bits, _) = at(i, head, jj);
                    let tol = want.abs() / 128.0 + e0 + e1 + 1e-5;
                    let got = val(bits);
                    assert!((got - want).abs() <= tol, "d {d} token {i} (slot {slot}) head {head} column {jj}: {got}, want {want} (tol {tol})");
                }
            }
        }
    }
    // Only the tokens' own cache entries are written.
    let written = |c: &[u16]| c.iter().filter(|&&v| v != UNWRITTEN).count();
    assert_eq!(written(&k_got), n * hkv * d, "d {d}: k entries written");
    assert_eq!(written(&v_got), n * hkv * d, "d {d}: v entries written");
    // A token's bits alone, in a few small batches and in the whole one, are the same.
    for pick in [vec![6usize], vec![3, 119, 40], (20..37).collect::<Vec<_>>()] {
        let (q_alone, k_alone, v_alone) = fused_rope_run(cuda, &case, &h, &ri, &pick, w8.as_ref());
        for (a, &i) in pick.iter().enumerate() {
            assert_eq!(&q_alone[a * hq * d..(a + 1) * hq * d], &q_got[i * hq * d..(i + 1) * hq * d], "d {d} token {i}: q bits differ alone");
            let (blk, off) = (ri.cache_slots[i] as usize / block_size, ri.cache_slots[i] as usize % block_size);
            for kvh in 0..hkv {
                let e = ((blk * hkv + kvh) * block_size + off) * d;
                assert_eq!(&k_alone[e..e + d], &k_got[e..e + d], "d {d} token {i}: k bits differ alone");
                assert_eq!(&v_alone[e..e + d], &v_got[e..e + d], "d {d} token {i}: v bits differ alone");
            }
        }
    }
}

//! Every kernel against a CPU reference (f64 from the same bf16 inputs) on fresh random inputs.
//! GPU tests: skipped with a visible "skipped: no CUDA device: ..." where there is none (CI);
//! `make test-gpu` runs them on a GPU machine with PEREGRINE_REQUIRE_GPU=1.
//!
//! Tolerances: a bf16 output carries a rounding error of at most 2^-9 relative (RNE, 8 significant
//! bits), so outputs rounded once from an f32 computation are checked at |err| <= 2^-8 |ref| + 1e-6
//! (twice the rounding bound, for the f32 arithmetic before it). Outputs that pass through several
//! bf16 roundings (attention over bf16 q/k/v, GEMMs) are checked by relative L2 error < 1e-2, the
//! usual band for bf16 operands, plus a max-abs bound stated at each check.

use half::bf16;
use peregrine_kernels::testing::cuda_or_skip;
use peregrine_kernels::ops::{pack_token_constraints, AttentionKernel, AttnOutQuant, ConstrainedRow, KvRotation, LoraDelta, OuterScale};
use peregrine_kernels::{Cuda, DevBuf, KvCacheDtype, OutType, W8Format};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const POISON_BF16: u16 = 0x7fc0; // NaN: an unwritten output fails every check

fn rng() -> ChaCha8Rng {
    // Fresh inputs every run; the seed is printed so a failure can be replayed.
    let seed: u64 = rand::rng().random();
    eprintln!("seed {seed}");
    ChaCha8Rng::seed_from_u64(seed)
}

fn rand_bf16(r: &mut ChaCha8Rng, n: usize, scale: f32) -> (Vec<u16>, Vec<f64>) {
    let mut bits = Vec::with_capacity(n);
    let mut vals = Vec::with_capacity(n);
    for _ in 0..n {
        let b = bf16::from_f32(r.random_range(-scale..scale));
        bits.push(b.to_bits());
        vals.push(b.to_f32() as f64);
    }
    (bits, vals)
}

fn to_f64(bits: &[u16]) -> Vec<f64> {
    bits.iter().map(|&b| bf16::from_bits(b).to_f32() as f64).collect()
}

fn assert_bf16_close(got: &[u16], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = bf16::from_bits(g).to_f32() as f64;
        let tol = w.abs() / 256.0 + 1e-6;
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w} (tol {tol})");
    }
}

fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-300)).sqrt()
}

/// The value of an e4m3 byte (sign, 4 exponent bits with bias 7, 3 mantissa bits; 0x7f/0xff NaN).
fn e4m3_value(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 0xf && m == 7 {
        return f64::NAN;
    }
    if e == 0 {
        sign * m as f64 / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + m as f64 / 8.0) * 2f64.powi(e as i32 - 7)
    }
}

/// Random e4m3 bytes with |value| <= 2 (every exponent from subnormals up, so both ends of the format
/// are exercised), with their values.
fn rand_fp8(r: &mut ChaCha8Rng, n: usize) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::with_capacity(n);
    let mut vals = Vec::with_capacity(n);
    while bytes.len() < n {
        let b: u8 = r.random();
        let v = e4m3_value(b);
        if v.is_finite() && v.abs() <= 2.0 {
            bytes.push(b);
            vals.push(v);
        }
    }
    (bytes, vals)
}

/// Random int8 codes (every byte), with their values code / 64 (within ±2, as `rand_fp8`'s).
fn rand_i8(r: &mut ChaCha8Rng, n: usize) -> (Vec<u8>, Vec<f64>) {
    let bytes: Vec<u8> = (0..n).map(|_| r.random()).collect();
    let vals = bytes.iter().map(|&b| b as i8 as f64 / 64.0).collect();
    (bytes, vals)
}

/// `Some(cuda)` when the GPU can hold a KV cache of type `kv`, else a visible skip (an fp8 cache needs
/// sm_89; `make test-gpu`'s H100 always can).
fn cuda_for(kv: KvCacheDtype) -> Option<Cuda> {
    let c = cuda_or_skip()?;
    if let Err(e) = c.kernels.check_kv_dtype(kv, 16) {
        assert!(std::env::var_os("PEREGRINE_REQUIRE_FP8").is_none(), "PEREGRINE_REQUIRE_FP8 is set: {e}");
        eprintln!("skipped: {e}");
        return None;
    }
    Some(c)
}

fn poison(c: &Cuda, n: usize) -> DevBuf<u16> {
    c.gpu.upload(&vec![POISON_BF16; n]).unwrap()
}

#[test]
fn embedding_gather_copies_rows() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let (vocab, hidden, n) = (1000, 576, 37);
    let (table, tv) = rand_bf16(&mut r, vocab * hidden, 1.0);
    let ids: Vec<u32> = (0..n).map(|_| r.random_range(0..vocab as u32)).collect();
    let dt = c.gpu.upload(&table).unwrap();
    let di = c.gpu.upload(&ids).unwrap();
    let out = c.gpu.upload(&vec![f32::NAN; n * hidden]).unwrap();
    unsafe { c.kernels.embedding_gather(&c.gpu.stream, out.ptr(), dt.ptr(), di.ptr(), n, hidden).unwrap() };
    let got = out.download(&c.gpu.stream).unwrap();
    for t in 0..n {
        for j in 0..hidden {
            assert_eq!(got[t * hidden + j] as f64, tv[ids[t] as usize * hidden + j], "token {t} col {j}");
        }
    }
}

fn rmsnorm_ref(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

#[test]
fn add_rmsnorm_matches_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    for hidden in [576usize, 4096] {
        let n = 19;
        let eps = 1e-5f32;
        let res: Vec<f32> = (0..n * hidden).map(|_| r.random_range(-3.0..3.0)).collect();
        let (delta, dv) = rand_bf16(&mut r, n * hidden, 2.0);
        let w: Vec<f32> = (0..hidden).map(|_| r.random_range(0.5..1.5)).collect();
        let dres = c.gpu.upload(&res).unwrap();
        let dd = c.gpu.upload(&delta).unwrap();
        let dw = c.gpu.upload(&w).unwrap();
        let out = poison(&c, n * hidden);
        unsafe {
            c.kernels
                .add_rmsnorm(&c.gpu.stream, dres.ptr(), Some(dd.ptr()), dw.ptr(), out.ptr(), None, n, hidden, eps, None, None)
                .unwrap()
        };
        let got_res = dres.download(&c.gpu.stream).unwrap();
        let got = out.download(&c.gpu.stream).unwrap();
        let wv: Vec<f64> = w.iter().map(|&v| v as f64).collect();
        for t in 0..n {
            let row: Vec<f64> = (0..hidden).map(|j| (res[t * hidden + j] + dv[t * hidden + j] as f32) as f64).collect();
            for j in 0..hidden {
                assert_eq!(got_res[t * hidden + j] as f64, row[j], "residual add is one f32 addition");
            }
            assert_bf16_close(&got[t * hidden..(t + 1) * hidden], &rmsnorm_ref(&row, &wv, eps as f64), "norm");
        }
        // Row-mapped final norm: add and normalize only the chosen rows.
        let rows: Vec<i32> = vec![(n - 1) as i32, 3, 0];
        let drows = c.gpu.upload(&rows).unwrap();
        let out2 = poison(&c, rows.len() * hidden);
        unsafe {
            c.kernels
                .add_rmsnorm(&c.gpu.stream, dres.ptr(), Some(dd.ptr()), dw.ptr(), out2.ptr(), Some(drows.ptr()), rows.len(), hidden, eps, None, None)
                .unwrap()
        };
        let got2 = out2.download(&c.gpu.stream).unwrap();
        let res3 = dres.download(&c.gpu.stream).unwrap();
        for (i, &src) in rows.iter().enumerate() {
            let src = src as usize;
            let row: Vec<f64> = (0..hidden).map(|j| (got_res[src * hidden + j] + dv[src * hidden + j] as f32) as f64).collect();
            for j in 0..hidden {
                assert_eq!(res3[src * hidden + j] as f64, row[j], "mapped row's residual updated");
            }
            assert_bf16_close(&got2[i * hidden..(i + 1) * hidden], &rmsnorm_ref(&row, &wv, eps as f64), "row-mapped norm");
        }
        assert_eq!(res3[hidden..2 * hidden], got_res[hidden..2 * hidden], "unmapped rows untouched");
    }
}

/// A random paged layout: `seqs` of the given total lengths spread over shuffled blocks.
struct Paged {
    block_tables: Vec<i32>, // [seqs, max_blocks]
    max_blocks: usize,
    num_blocks: usize,
}

fn paged(r: &mut ChaCha8Rng, lens: &[usize], block_size: usize) -> Paged {
    let max_blocks = lens.iter().map(|l| l.div_ceil(block_size)).max().unwrap_or(1).max(1);
    let total: usize = lens.iter().map(|l| l.div_ceil(block_size)).sum();
    let num_blocks = total + 5;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.random_range(0..=i));
    }
    let mut block_tables = vec![-1i32; lens.len() * max_blocks];
    let mut next = 0;
    for (s, l) in lens.iter().enumerate() {
        for b in 0..l.div_ceil(block_size) {
            block_tables[s * max_blocks + b] = ids[next];
            next += 1;
        }
    }
    Paged { block_tables, max_blocks, num_blocks }
}

fn cache_index(block: usize, h: usize, off: usize, i: usize, hkv: usize, bs: usize, d: usize) -> usize {
    ((block * hkv + h) * bs + off) * d + i
}

/// Where an fp8 cache keeps V: transposed within each block, [blocks, hkv, d, bs].
fn v_index_fp8(block: usize, h: usize, off: usize, i: usize, hkv: usize, bs: usize, d: usize) -> usize {
    ((block * hkv + h) * d + i) * bs + off
}

/// Random K and V caches of `len` elements of type `kv` as uploaded bytes (V in its type's layout)
/// and their values in bf16's layout ([blocks, hkv, bs, d]) for the reference.
fn rand_caches(c: &Cuda, r: &mut ChaCha8Rng, kv: KvCacheDtype, len: usize, hkv: usize, bs: usize, d: usize) -> (DevBuf<u8>, DevBuf<u8>, Vec<f64>, Vec<f64>) {
    match kv {
        KvCacheDtype::Bf16 => {
            let (kb, kv_) = rand_bf16(r, len, 1.0);
            let (vb, vv) = rand_bf16(r, len, 1.0);
            let bytes = |b: &[u16]| -> Vec<u8> { b.iter().flat_map(|x| x.to_le_bytes()).collect() };
            (c.gpu.upload(&bytes(&kb)).unwrap(), c.gpu.upload(&bytes(&vb)).unwrap(), kv_, vv)
        }
        KvCacheDtype::Fp8E4m3 => {
            let (kb, kv_) = rand_fp8(r, len);
            let (vb, vv) = rand_fp8(r, len);
            let mut vt = vec![0u8; len];
            let blocks = len / (hkv * bs * d);
            for b in 0..blocks {
                for h in 0..hkv {
                    for off in 0..bs {
                        for i in 0..d {
                            vt[v_index_fp8(b, h, off, i, hkv, bs, d)] = vb[cache_index(b, h, off, i, hkv, bs, d)];
                        }
                    }
                }
            }
            (c.gpu.upload(&kb).unwrap(), c.gpu.upload(&vt).unwrap(), kv_, vv)
        }
        KvCacheDtype::Fp8E4m3PerHead | KvCacheDtype::Int8PerHead => {
            // Codes as above (int8: every code of -128..=127, values code / 64 within ±2), and one
            // scale per (block, head, slot) in [0.05, 1) for K and for V, in each (block, head) chunk
            // after its codes; the values are code × scale.
            let (kb, mut kv_) = if kv == KvCacheDtype::Int8PerHead { rand_i8(r, len) } else { rand_fp8(r, len) };
            let (vb, mut vv) = if kv == KvCacheDtype::Int8PerHead { rand_i8(r, len) } else { rand_fp8(r, len) };
            let chunk = bs * (d + 4);
            let blocks = len / (hkv * bs * d);
            let (mut kbuf, mut vbuf) = (vec![0u8; blocks * hkv * chunk], vec![0u8; blocks * hkv * chunk]);
            for b in 0..blocks {
                for h in 0..hkv {
                    let base = (b * hkv + h) * chunk;
                    for off in 0..bs {
                        let (mut ks, mut vs): (f32, f32) = (r.random_range(0.05..1.0), r.random_range(0.05..1.0));
                        if kv == KvCacheDtype::Int8PerHead {
                            // The cache holds the codes: its scale carries the 1/64.
                            (ks, vs) = (ks / 64.0, vs / 64.0);
                        }
                        kbuf[base + bs * d + off * 4..][..4].copy_from_slice(&ks.to_le_bytes());
                        vbuf[base + bs * d + off * 4..][..4].copy_from_slice(&vs.to_le_bytes());
                        for i in 0..d {
                            let at = cache_index(b, h, off, i, hkv, bs, d);
                            kbuf[base + off * d + i] = kb[at];
                            vbuf[base + i * bs + off] = vb[at];
                            let unit = if kv == KvCacheDtype::Int8PerHead { 64.0 } else { 1.0 };
                            kv_[at] *= ks as f64 * unit;
                            vv[at] *= vs as f64 * unit;
                        }
                    }
                }
            }
            (c.gpu.upload(&kbuf).unwrap(), c.gpu.upload(&vbuf).unwrap(), kv_, vv)
        }
    }
}

#[test]
fn rope_kv_write_matches_reference() {
    rope_kv_write_case(KvCacheDtype::Bf16, KvRotation::None);
}

#[test]
fn rope_kv_write_fp8_matches_reference() {
    rope_kv_write_case(KvCacheDtype::Fp8E4m3, KvRotation::None);
}

/// The per-head-scaled fp8 cache (`--kv-cache-dtype fp8-scaled*`): each cached head's scale is its
/// max |x| / 448 and its codes are x / scale in e4m3, with and without the rotations.
#[test]
fn rope_kv_write_fp8_per_head_scales_match_reference() {
    for rotation in [KvRotation::None, KvRotation::QK, KvRotation::QKV] {
        rope_kv_write_case(KvCacheDtype::Fp8E4m3PerHead, rotation);
    }
}

/// The int8 cache (`--kv-cache-dtype int8*`): each cached head's scale is its max |x| / 127 and its
/// codes are x / scale rounded to the nearest integer, with and without the rotations.
#[test]
fn rope_kv_write_int8_per_head_scales_match_reference() {
    for rotation in [KvRotation::None, KvRotation::QK, KvRotation::QKV] {
        rope_kv_write_case(KvCacheDtype::Int8PerHead, rotation);
    }
}

/// The Hadamard-rotated variants (`--kv-cache-dtype fp8-hadamard`, and `fp8-hadamard-qkv` which
/// rotates v too): q and k heads after RoPE (and v heads as they are) multiplied by Sylvester's
/// normalized matrix, entry by entry.
#[test]
fn rope_kv_write_hadamard_matches_reference() {
    for rotation in [KvRotation::QK, KvRotation::QKV] {
        rope_kv_write_case(KvCacheDtype::Bf16, rotation);
        rope_kv_write_case(KvCacheDtype::Fp8E4m3, rotation);
    }
}

/// `hadamard_heads` (the QKV cache's attention output rotated back): every head of every row times
/// Sylvester's normalized matrix, and applied twice the identity (H is its own inverse), within
/// bf16's rounding; odd head counts leave a partial block of heads.
#[test]
fn hadamard_heads_matches_reference_and_is_its_own_inverse() {
    let Some(c) = cuda_for(KvCacheDtype::Bf16) else { return };
    let mut r = rng();
    for (n, heads, d) in [(1usize, 9usize, 64usize), (37, 32, 128), (5, 3, 128)] {
        let (x, xv) = rand_bf16(&mut r, n * heads * d, 3.0);
        let dx = c.gpu.upload(&x).unwrap();
        unsafe { c.kernels.hadamard_heads(&c.gpu.stream, dx.ptr(), n, heads, d).unwrap() };
        let once: Vec<u16> = dx.download(&c.gpu.stream).unwrap();
        for (row, head) in (0..n * heads).map(|i| (i, i * d)) {
            let want = sylvester_rotate(&xv[head..head + d]);
            assert_bf16_close(&once[head..head + d], &want, &format!("rotated head {row}"));
        }
        unsafe { c.kernels.hadamard_heads(&c.gpu.stream, dx.ptr(), n, heads, d).unwrap() };
        let twice: Vec<u16> = dx.download(&c.gpu.stream).unwrap();
        let once = to_f64(&once);
        for head in (0..n * heads).map(|i| i * d) {
            assert_bf16_close(&twice[head..head + d], &sylvester_rotate(&once[head..head + d]), "H applied to H x");
        }
        // Back to x: two bf16 roundings, each at most 2⁻⁸ of every element, and H keeps the norm of
        // the first one's error, so the whole is within 2 · 2⁻⁸ of x in relative L2.
        let back = rel_l2(&to_f64(&twice), &xv);
        assert!(back <= 2.0 / 256.0, "H·H x vs x: relative L2 {back}");
    }
    // Head dimensions the rotation does not support are refused, not launched.
    let dx = c.gpu.upload(&vec![0u16; 96]).unwrap();
    assert!(unsafe { c.kernels.hadamard_heads(&c.gpu.stream, dx.ptr(), 1, 1, 96) }.is_err());
}

/// `H x` with H[i][j] = (-1)^popcount(i & j) / sqrt(n).
fn sylvester_rotate(x: &[f64]) -> Vec<f64> {
    let n = x.len();
    (0..n)
        .map(|i| (0..n).map(|j| if (i & j).count_ones() % 2 == 0 { x[j] } else { -x[j] }).sum::<f64>() / (n as f64).sqrt())
        .collect()
}

/// e4m3 rounding to nearest: within half a unit of the last place, 2^-4 relative for normal values
/// (3 mantissa bits), 2^-10 absolute below 2^-6 (subnormal steps of 2^-9); plus f32 arithmetic.
fn assert_fp8_close(got: &[u8], want: &[f64], what: &str) {
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let g = e4m3_value(g);
        let tol = w.abs() / 16.0 + 2f64.powi(-10) + 1e-6;
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w} (tol {tol})");
    }
}

fn rope_kv_write_case(kv: KvCacheDtype, rotation: KvRotation) {
    let Some(c) = cuda_for(kv) else { return };
    let mut r = rng();
    // (6, 3): a block of 4 heads holds the last k head and the v heads (rotated together). d 24 (not
    // a multiple of 16): the unrotated heads' one-pair-per-thread kernel instead of the 16-byte one,
    // and for the scaled caches the one-warp-per-head kernel with 24 of a warp's lanes (one value
    // each). d 38: no warp layout (19 has no divisor in 2..=4 and 38 values need more than 32
    // lanes), so the scaled caches take the block kernel too.
    for (hq, hkv, d) in [(9usize, 3usize, 64usize), (32, 8, 128), (6, 3, 64), (4, 2, 24), (4, 2, 38)] {
        if !d.is_power_of_two() && rotation != KvRotation::None {
            continue; // the Hadamard rotation needs a power of two
        }
        let bs = 16;
        let lens = [5usize, 40, 1];
        let pg = paged(&mut r, &lens, bs);
        // Tokens: seq 0 positions 0..5, seq 1 positions 30..40 (a prefill chunk after a cached prefix), seq 2 position 0.
        let mut positions = vec![];
        let mut seq_of = vec![];
        for (s, range) in [(0usize, 0..5usize), (1, 30..40), (2, 0..1)] {
            for p in range {
                positions.push(p as i32);
                seq_of.push(s);
            }
        }
        let n = positions.len();
        let slots: Vec<i32> = positions
            .iter()
            .zip(&seq_of)
            .map(|(&p, &s)| pg.block_tables[s * pg.max_blocks + p as usize / bs] * bs as i32 + p % bs as i32)
            .collect();
        let width = (hq + 2 * hkv) * d;
        let (qkv, qv) = rand_bf16(&mut r, n * width, 2.0);
        let bias: Vec<f32> = (0..width).map(|_| r.random_range(-0.5..0.5)).collect();
        let max_pos = 64;
        let half = d / 2;
        let theta = 10000.0f64;
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        for p in 0..max_pos {
            for i in 0..half {
                let a = p as f64 * theta.powf(-(2.0 * i as f64) / d as f64);
                cos[p * half + i] = a.cos() as f32;
                sin[p * half + i] = a.sin() as f32;
            }
        }
        let cache_len = pg.num_blocks * hkv * bs * d;
        let (dqkv, dbias, dpos, dcos, dsin, dslots) = (
            c.gpu.upload(&qkv).unwrap(),
            c.gpu.upload(&bias).unwrap(),
            c.gpu.upload(&positions).unwrap(),
            c.gpu.upload(&cos).unwrap(),
            c.gpu.upload(&sin).unwrap(),
            c.gpu.upload(&slots).unwrap(),
        );
        // Input modes: a final bf16 q|k|v; an 8-bit GEMM's unscaled bf16 output with its token and
        // row scales (powers of two) left to this kernel; and an int8 GEMM's int32 sums (64 × the
        // values, rounded) with the row scales / 64, the bf16 buffer poisoned.
        let ints: Vec<i32> = qv.iter().map(|v| (v * 64.0).round() as i32).collect();
        let dints = c.gpu.upload(&ints).unwrap();
        let dpoison = c.gpu.upload(&vec![0xFFFFu16; n * width]).unwrap();
        for mode in 0..3 {
            let xs: Vec<f32> = (0..n).map(|t| if mode == 0 { 1.0 } else { [0.5, 2.0, 0.25][t % 3] }).collect();
            let ws: Vec<f32> = (0..width).map(|j| if mode == 0 { 1.0 } else { [1.0, 0.5, 2.0, 4.0][j % 4] / if mode == 2 { 64.0 } else { 1.0 } }).collect();
            let (dxs, dws) = (c.gpu.upload(&xs).unwrap(), c.gpu.upload(&ws).unwrap());
            let scale = match mode {
                0 => None,
                1 => Some(OuterScale::bf16(dxs.ptr(), dws.ptr())),
                _ => Some(OuterScale { sums_i32: dints.ptr(), ..OuterScale::bf16(dxs.ptr(), dws.ptr()) }),
            };
            let qkv_in = if mode == 2 { dpoison.ptr() } else { dqkv.ptr() };
            let qout = poison(&c, n * hq * d);
            // Caches as bytes, poisoned (bf16 NaN pairs; 0xff is an e4m3 NaN too).
            let cache_bytes = cache_len / d * kv.head_bytes(d);
            let kc = c.gpu.upload(&vec![0xffu8; cache_bytes]).unwrap();
            let vc = c.gpu.upload(&vec![0xffu8; cache_bytes]).unwrap();
            unsafe {
                c.kernels
                    .rope_kv_write(&c.gpu.stream, qkv_in, Some(dbias.ptr()), dpos.ptr(), dcos.ptr(), dsin.ptr(), dslots.ptr(), qout.ptr(), kc.ptr(), vc.ptr(), n, hq, hkv, d, bs, kv, rotation, None, scale)
                    .unwrap()
            };
            let gq = qout.download(&c.gpu.stream).unwrap();
            let (gk, gv) = (kc.download(&c.gpu.stream).unwrap(), vc.download(&c.gpu.stream).unwrap());
            let as_bf16 = |b: &[u8]| -> Vec<u16> { b.chunks_exact(2).map(|p| u16::from_le_bytes([p[0], p[1]])).collect() };
            // Checks a cached head row: `at(i)` is element i's index in the cache; a scaled cache's
            // head also has its scale at `scale_at` (bytes).
            let check_cache = |bytes: &[u8], at: &dyn Fn(usize) -> usize, scale_at: usize, want: &[f64], what: &str| match kv {
                KvCacheDtype::Bf16 => {
                    let all = as_bf16(bytes);
                    assert_bf16_close(&(0..d).map(|i| all[at(i)]).collect::<Vec<_>>(), want, what)
                }
                KvCacheDtype::Fp8E4m3 => assert_fp8_close(&(0..d).map(|i| bytes[at(i)]).collect::<Vec<_>>(), want, what),
                KvCacheDtype::Fp8E4m3PerHead => {
                    let got_scale = f32::from_le_bytes([bytes[scale_at], bytes[scale_at + 1], bytes[scale_at + 2], bytes[scale_at + 3]]) as f64;
                    let amax = want.iter().fold(0f64, |m, w| m.max(w.abs()));
                    // The kernel's max is over f32 values (bf16 inputs, f32 RoPE and rotation).
                    assert!((got_scale - amax / 448.0).abs() <= 1e-4 * amax / 448.0 + 1e-9, "{what}: scale {got_scale}, want {}", amax / 448.0);
                    let codes: Vec<u8> = (0..d).map(|i| bytes[at(i)]).collect();
                    // Codes within e4m3's rounding of x / scale (and the largest near ±448, not past it).
                    assert_fp8_close(&codes, &want.iter().map(|w| w / got_scale).collect::<Vec<_>>(), what);
                }
                KvCacheDtype::Int8PerHead => {
                    let got_scale = f32::from_le_bytes([bytes[scale_at], bytes[scale_at + 1], bytes[scale_at + 2], bytes[scale_at + 3]]) as f64;
                    let amax = want.iter().fold(0f64, |m, w| m.max(w.abs()));
                    assert!((got_scale - amax / 127.0).abs() <= 1e-4 * amax / 127.0 + 1e-9, "{what}: scale {got_scale}, want {}", amax / 127.0);
                    for i in 0..d {
                        // The nearest integer to x / scale (the kernel's x is f32: a hair of slack
                        // at the midpoints), never past ±127.
                        let (code, x) = (bytes[at(i)] as i8 as f64, want[i] / got_scale);
                        assert!((code - x).abs() <= 0.5 + 1e-3 && code.abs() <= 127.0, "{what}[{i}]: code {code} for x / scale {x}");
                    }
                }
            };
            // A scaled cache's (block, head) chunk: its codes, then its block_size f32 scales.
            let chunk = |blk: usize, h: usize| (blk * hkv + h) * bs * (d + 4);
            for t in 0..n {
                let raw = |col: usize| if mode == 2 { ints[t * width + col] as f64 } else { qv[t * width + col] };
                let x = |col: usize| raw(col) * (xs[t] * ws[col]) as f64 + bias[col] as f64;
                let (cs, sn) = (&cos[positions[t] as usize * half..], &sin[positions[t] as usize * half..]);
                let blk = slots[t] as usize / bs;
                let off = slots[t] as usize % bs;
                for h in 0..hq + hkv {
                    let mut want = vec![0f64; d];
                    for i in 0..half {
                        let (x0, x1) = (x(h * d + i), x(h * d + i + half));
                        want[i] = x0 * cs[i] as f64 - x1 * sn[i] as f64;
                        want[i + half] = x1 * cs[i] as f64 + x0 * sn[i] as f64;
                    }
                    if rotation != KvRotation::None {
                        want = sylvester_rotate(&want);
                    }
                    if h < hq {
                        assert_bf16_close(&gq[t * hq * d + h * d..t * hq * d + (h + 1) * d], &want, "rotated q");
                    } else {
                        let k_at = |i: usize| match kv {
                            KvCacheDtype::Fp8E4m3PerHead | KvCacheDtype::Int8PerHead => chunk(blk, h - hq) + off * d + i,
                            _ => cache_index(blk, h - hq, off, i, hkv, bs, d),
                        };
                        check_cache(&gk, &k_at, chunk(blk, h - hq) + bs * d + off * 4, &want, "rotated k in cache");
                    }
                }
                for h in 0..hkv {
                    let mut want: Vec<f64> = (0..d).map(|i| x((hq + hkv + h) * d + i)).collect();
                    if rotation == KvRotation::QKV {
                        want = sylvester_rotate(&want);
                    }
                    let at = |i: usize| match kv {
                        KvCacheDtype::Bf16 => cache_index(blk, h, off, i, hkv, bs, d),
                        KvCacheDtype::Fp8E4m3 => v_index_fp8(blk, h, off, i, hkv, bs, d),
                        KvCacheDtype::Fp8E4m3PerHead | KvCacheDtype::Int8PerHead => chunk(blk, h) + i * bs + off,
                    };
                    check_cache(&gv, &at, chunk(blk, h) + bs * d + off * 4, &want, "v in cache");
                }
            }
        }
    }
}

#[test]
fn paged_attention_matches_reference() {
    let Some(c) = cuda_or_skip() else { return };
    for kernel in [AttentionKernel::WarpPerKey, AttentionKernel::Tiled, AttentionKernel::Mma] {
        paged_attention_case(&c, kernel, KvCacheDtype::Bf16, 16);
    }
}

/// The 8-bit caches (fp8, fp8 with per-head scales, int8) through the tensor-core kernel (their only
/// reader), against a reference over the very values in the cache: what is checked is the kernel,
/// not the quantization.
#[test]
fn paged_attention_fp8_matches_reference() {
    let Some(c) = cuda_for(KvCacheDtype::Fp8E4m3) else { return };
    // The default block size and a larger one (a 64-key tile spans two cache blocks, not four); scale
    // 1 and per-head scales.
    for kv in [KvCacheDtype::Fp8E4m3, KvCacheDtype::Fp8E4m3PerHead, KvCacheDtype::Int8PerHead] {
        for bs in [16, 32] {
            paged_attention_case(&c, AttentionKernel::Mma, kv, bs);
        }
    }
    // Block sizes the fp8 kernels cannot address are refused up front.
    for bs in [8, 48] {
        assert!(c.kernels.check_kv_dtype(KvCacheDtype::Fp8E4m3, bs).is_err(), "an fp8 cache with blocks of {bs} must be refused");
    }
    // The CUDA-core kernels refuse an fp8 cache rather than misread it.
    let err = unsafe { c.kernels.paged_attention_with(AttentionKernel::Tiled, &c.gpu.stream, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 8, 8, 128, 16, None, KvCacheDtype::Fp8E4m3, AttnOutQuant::NONE) };
    assert!(err.is_err(), "the tiled kernel must refuse an fp8 cache");
}

/// With 8-bit linears the attention kernels quantize their own output (the block that completes a
/// token's row writes its codes and scale): the codes and scales must be the bits `quant_rows` gives
/// for the bf16 output they wrote, in every launch shape (decode blocks, split decode + combine,
/// prefill blocks of several tokens), for every kernel and format, and twice in a row (the per-token
/// counters are left at zero for the next launch).
#[test]
fn paged_attention_quantizes_its_output_as_quant_rows_does() {
    let Some(c) = cuda_or_skip() else { return };
    let s = &c.gpu.stream;
    let mut r = rng();
    let formats: Vec<W8Format> = [W8Format::E4m3, W8Format::I8].into_iter().filter(|&f| c.kernels.w8_ready(f)).collect();
    if formats.is_empty() {
        eprintln!("skipped: no 8-bit format on this GPU");
        return;
    }
    let mut cases = vec![(AttentionKernel::WarpPerKey, KvCacheDtype::Bf16), (AttentionKernel::Tiled, KvCacheDtype::Bf16), (AttentionKernel::Mma, KvCacheDtype::Bf16)];
    if c.kernels.check_kv_dtype(KvCacheDtype::Fp8E4m3, 16).is_ok() {
        cases.push((AttentionKernel::Mma, KvCacheDtype::Fp8E4m3));
        cases.push((AttentionKernel::Mma, KvCacheDtype::Fp8E4m3PerHead));
        cases.push((AttentionKernel::Mma, KvCacheDtype::Int8PerHead));
    }
    let bs = 16;
    for (hq, hkv, d) in [(9usize, 3usize, 64usize), (32, 8, 128)] {
        // Two decode tokens at long contexts, then a prefill chunk over a cached prefix and a fresh prompt.
        let lens = [700usize, 300, 70, 9];
        let chunks = [(0usize, 699..700usize), (1, 299..300), (2, 50..70), (3, 0..9)];
        let pg = paged(&mut r, &lens, bs);
        let (positions, token_seq) = chunk_tokens(&chunks);
        let n = positions.len();
        let (q, _) = rand_bf16(&mut r, n * hq * d, 2.0);
        let (dq, dbt, dts, dpos) = (c.gpu.upload(&q).unwrap(), c.gpu.upload(&pg.block_tables).unwrap(), c.gpu.upload(&token_seq).unwrap(), c.gpu.upload(&positions).unwrap());
        let partials = c.gpu.alloc_zeros::<f32>(c.kernels.attention_partials_len()).unwrap();
        assert!(c.kernels.attention_splits(2, hkv) > 1, "two decode tokens are split");
        let counters = c.gpu.alloc_zeros::<i32>(n).unwrap();
        for &(kernel, kvt) in &cases {
            let (dk, dv, _, _) = rand_caches(&c, &mut r, kvt, pg.num_blocks * hkv * bs * d, hkv, bs, d);
            for &format in &formats {
                // (tokens, decode tokens, split): the whole batch unsplit; the two decode tokens alone,
                // split along their contexts (combine quantizes); everything as prefill rows.
                for (rows, decode, split) in [(n, 2usize, false), (2, 2, true), (n, 0, false)] {
                    for round in 0..2 {
                        let out = poison(&c, rows * hq * d);
                        let (xq, xs) = (c.gpu.upload(&vec![0xAAu8; rows * hq * d]).unwrap(), c.gpu.upload(&vec![f32::NAN; rows]).unwrap());
                        let quant = AttnOutQuant::new(format, xq.ptr(), xs.ptr(), counters.ptr());
                        let parts = if split { Some(partials.ptr()) } else { None };
                        unsafe {
                            c.kernels
                                .paged_attention_with(kernel, s, out.ptr(), dq.ptr(), dk.ptr(), dv.ptr(), dbt.ptr(), pg.max_blocks, dts.ptr(), dpos.ptr(), rows, decode, hq, hkv, d, bs, parts, kvt, quant)
                                .unwrap()
                        };
                        let (wq, ws) = (c.gpu.upload(&vec![0x55u8; rows * hq * d]).unwrap(), c.gpu.upload(&vec![f32::NAN; rows]).unwrap());
                        unsafe { c.kernels.quant_rows(s, format, wq.ptr(), ws.ptr(), out.ptr(), rows, hq * d).unwrap() };
                        let what = format!("{kernel:?} {kvt:?} {format:?} hq {hq} d {d}: {rows} tokens, {decode} decode, split {split}, round {round}");
                        let (got_s, want_s) = (xs.download(s).unwrap(), ws.download(s).unwrap());
                        for (i, (a, b)) in got_s.iter().zip(&want_s).enumerate() {
                            assert_eq!(a.to_bits(), b.to_bits(), "{what}: scale of token {i}: {a} vs {b}");
                        }
                        let (got_q, want_q) = (xq.download(s).unwrap(), wq.download(s).unwrap());
                        if let Some(i) = got_q.iter().zip(&want_q).position(|(a, b)| a != b) {
                            panic!("{what}: code {i} (token {}) is {:#x}, quant_rows gives {:#x}", i / (hq * d), got_q[i], want_q[i]);
                        }
                        assert!(counters.download(s).unwrap().iter().all(|&v| v == 0), "{what}: counters left non-zero");
                    }
                }
            }
        }
    }
}

/// The positions and sequence of each token of a batch of (sequence, positions) chunks, in order.
fn chunk_tokens(chunks: &[(usize, std::ops::Range<usize>)]) -> (Vec<i32>, Vec<i32>) {
    chunks.iter().flat_map(|(s, range)| range.clone().map(move |p| (p as i32, *s as i32))).unzip()
}

fn paged_attention_case(c: &Cuda, kernel: AttentionKernel, kvt: KvCacheDtype, bs: usize) {
    let mut r = rng();
    for (hq, hkv, d) in [(9usize, 3usize, 64usize), (32, 8, 128), (8, 8, 128), (16, 2, 128)] {
        // Three sequences: a decode token at a long context, a prefill chunk over a cached prefix, a fresh prompt.
        let lens = [700usize, 70, 9];
        let chunks = [(0usize, 699..700usize), (1, 50..70), (2, 0..9)];
        let pg = paged(&mut r, &lens, bs);
        let cache_len = pg.num_blocks * hkv * bs * d;
        let (dk, dv, kv, vv) = rand_caches(c, &mut r, kvt, cache_len, hkv, bs, d);
        let (positions, token_seq) = chunk_tokens(&chunks);
        let n = positions.len();
        let (q, qv) = rand_bf16(&mut r, n * hq * d, 2.0);
        let (dq, dbt, dts, dpos) = (
            c.gpu.upload(&q).unwrap(),
            c.gpu.upload(&pg.block_tables).unwrap(),
            c.gpu.upload(&token_seq).unwrap(),
            c.gpu.upload(&positions).unwrap(),
        );
        let partials = c.gpu.alloc_zeros::<f32>(c.kernels.attention_partials_len()).unwrap();
        let out = poison(c, n * hq * d);
        unsafe {
            c.kernels
                .paged_attention_with(kernel, &c.gpu.stream, out.ptr(), dq.ptr(), dk.ptr(), dv.ptr(), dbt.ptr(), pg.max_blocks, dts.ptr(), dpos.ptr(), n, 1, hq, hkv, d, bs, None, kvt, AttnOutQuant::NONE)
                .unwrap()
        };
        let got = to_f64(&out.download(&c.gpu.stream).unwrap());
        // The same batch with no token taken as a decode token: the lone token of sequence 0 goes
        // through the prefill path too (for the tensor-core kernel: its 64-row blocks).
        let all_prefill = poison(c, n * hq * d);
        unsafe {
            c.kernels
                .paged_attention_with(kernel, &c.gpu.stream, all_prefill.ptr(), dq.ptr(), dk.ptr(), dv.ptr(), dbt.ptr(), pg.max_blocks, dts.ptr(), dpos.ptr(), n, 0, hq, hkv, d, bs, None, kvt, AttnOutQuant::NONE)
                .unwrap()
        };
        let all_prefill = to_f64(&all_prefill.download(&c.gpu.stream).unwrap());
        // Split along the sequence: each token alone (decode-sized launches) must give the same result.
        let mut split_out = vec![0f64; n * hq * d];
        for t in 0..n {
            let one = poison(c, hq * d);
            let (pos1, seq1) = (c.gpu.upload(&positions[t..t + 1]).unwrap(), c.gpu.upload(&token_seq[t..t + 1]).unwrap());
            let q1 = c.gpu.upload(&q[t * hq * d..(t + 1) * hq * d]).unwrap();
            assert!(c.kernels.attention_splits(1, hkv) > 1, "a single token is split");
            unsafe {
                c.kernels
                    .paged_attention_with(kernel, &c.gpu.stream, one.ptr(), q1.ptr(), dk.ptr(), dv.ptr(), dbt.ptr(), pg.max_blocks, seq1.ptr(), pos1.ptr(), 1, 1, hq, hkv, d, bs, Some(partials.ptr()), kvt, AttnOutQuant::NONE)
                    .unwrap()
            };
            split_out[t * hq * d..(t + 1) * hq * d].copy_from_slice(&to_f64(&one.download(&c.gpu.stream).unwrap()));
        }
        let mut want = vec![0f64; n * hq * d];
        let scale = 1.0 / (d as f64).sqrt();
        for t in 0..n {
            let s = token_seq[t] as usize;
            for h in 0..hq {
                let kvh = h / (hq / hkv);
                let qrow = &qv[(t * hq + h) * d..(t * hq + h + 1) * d];
                let ctx = positions[t] as usize + 1;
                let mut scores = Vec::with_capacity(ctx);
                for p in 0..ctx {
                    let blk = pg.block_tables[s * pg.max_blocks + p / bs] as usize;
                    let base = cache_index(blk, kvh, p % bs, 0, hkv, bs, d);
                    scores.push(qrow.iter().zip(&kv[base..base + d]).map(|(a, b)| a * b).sum::<f64>() * scale);
                }
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let ws: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = ws.iter().sum();
                for p in 0..ctx {
                    let blk = pg.block_tables[s * pg.max_blocks + p / bs] as usize;
                    let base = cache_index(blk, kvh, p % bs, 0, hkv, bs, d);
                    for i in 0..d {
                        want[(t * hq + h) * d + i] += ws[p] / z * vv[base + i];
                    }
                }
            }
        }
        for (label, got) in [("one launch", &got), ("all as prefill", &all_prefill), ("split per token", &split_out)] {
            assert!(got.iter().all(|v| v.is_finite()), "{label}: every output written and finite");
            let err = rel_l2(got, &want);
            let max_abs = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max);
            eprintln!("attention {kernel:?} {kvt:?} {label} hq={hq} hkv={hkv} d={d}: rel L2 {err:.2e}, max abs {max_abs:.2e}");
            assert!(err < 1e-2, "{label}: rel L2 error {err}");
            // Outputs are convex combinations of values in [-2, 2] (bf16: [-1, 1]): the 16-bit rounding
            // of q, p and out bounds the error well under 0.02.
            assert!(max_abs < 2e-2, "{kernel:?} {kvt:?} {label}: max abs error {max_abs}");
        }
    }
}

#[test]
fn silu_mul_matches_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let (n, inter) = (13, 1536);
    let (gu, guv) = rand_bf16(&mut r, n * 2 * inter, 6.0);
    let dgu = c.gpu.upload(&gu).unwrap();
    let out = poison(&c, n * inter);
    unsafe { c.kernels.silu_mul(&c.gpu.stream, out.ptr(), dgu.ptr(), n, inter, None).unwrap() };
    let got = out.download(&c.gpu.stream).unwrap();
    let mut want = vec![0f64; n * inter];
    for t in 0..n {
        for j in 0..inter {
            let g = guv[t * 2 * inter + j];
            let u = guv[t * 2 * inter + inter + j];
            want[t * inter + j] = g / (1.0 + (-g).exp()) * u;
        }
    }
    // __expf has ~2 ulp of f32 error: far below the bf16 rounding the check allows.
    assert_bf16_close(&got, &want, "silu*up");
}

/// The LoRA update written beside a base output (`LoraDelta`) is added by the kernels that consume
/// that output, for the tokens with a slot and only for them.
#[test]
fn consumers_add_the_lora_update_of_tokens_with_a_slot() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let s = &c.gpu.stream;
    let n = 7;
    let slots: Vec<i32> = vec![0, -1, 2, 2, -1, 1, 0];
    let dslots = c.gpu.upload(&slots).unwrap();
    // add_rmsnorm: residual += delta + update, in that order, one f32 addition each.
    let (hidden, eps) = (576usize, 1e-5f32);
    let res: Vec<f32> = (0..n * hidden).map(|_| r.random_range(-3.0..3.0)).collect();
    let (delta, dv) = rand_bf16(&mut r, n * hidden, 2.0);
    let (upd, uv) = rand_bf16(&mut r, n * hidden, 0.5);
    let w: Vec<f32> = (0..hidden).map(|_| r.random_range(0.5..1.5)).collect();
    let (dres, dd, du, dw) = (c.gpu.upload(&res).unwrap(), c.gpu.upload(&delta).unwrap(), c.gpu.upload(&upd).unwrap(), c.gpu.upload(&w).unwrap());
    let out = poison(&c, n * hidden);
    let lora = Some(LoraDelta { d: du.ptr(), slots: dslots.ptr() });
    unsafe { c.kernels.add_rmsnorm(s, dres.ptr(), Some(dd.ptr()), dw.ptr(), out.ptr(), None, n, hidden, eps, lora, None).unwrap() };
    let (got_res, got) = (dres.download(s).unwrap(), out.download(s).unwrap());
    let wv: Vec<f64> = w.iter().map(|&v| v as f64).collect();
    for t in 0..n {
        let row: Vec<f32> = (0..hidden)
            .map(|j| {
                let v = res[t * hidden + j] + dv[t * hidden + j] as f32;
                if slots[t] >= 0 { v + uv[t * hidden + j] as f32 } else { v }
            })
            .collect();
        assert_eq!(&got_res[t * hidden..(t + 1) * hidden], &row[..], "token {t} (slot {}): residual", slots[t]);
        let row64: Vec<f64> = row.iter().map(|&v| v as f64).collect();
        assert_bf16_close(&got[t * hidden..(t + 1) * hidden], &rmsnorm_ref(&row64, &wv, eps as f64), "norm with the update");
    }
    // silu_mul: the update added to gate and up before SwiGLU.
    let inter = 1536;
    let (gu, guv) = rand_bf16(&mut r, n * 2 * inter, 6.0);
    let (gupd, gupv) = rand_bf16(&mut r, n * 2 * inter, 1.0);
    let (dgu, dgupd) = (c.gpu.upload(&gu).unwrap(), c.gpu.upload(&gupd).unwrap());
    let act = poison(&c, n * inter);
    unsafe { c.kernels.silu_mul(s, act.ptr(), dgu.ptr(), n, inter, Some(LoraDelta { d: dgupd.ptr(), slots: dslots.ptr() })).unwrap() };
    let got = act.download(s).unwrap();
    let mut want = vec![0f64; n * inter];
    for t in 0..n {
        let with = |i: usize| guv[i] + if slots[t] >= 0 { gupv[i] } else { 0.0 };
        for j in 0..inter {
            let (g, u) = (with(t * 2 * inter + j), with(t * 2 * inter + inter + j));
            want[t * inter + j] = g / (1.0 + (-g).exp()) * u;
        }
    }
    assert_bf16_close(&got, &want, "silu*up with the update");
}

#[test]
fn token_constraints_match_the_host_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    // Llama 3's vocabulary (not a multiple of 32 words' worth of bits is covered by the 49,155 case).
    for vocab in [128_256usize, 49_155] {
        let rows = 64;
        let words = peregrine_kernels::ops::mask_words(vocab);
        let logits: Vec<f32> = (0..rows * vocab).map(|_| r.random_range(-10.0..10.0)).collect();
        let mut want = logits.clone();
        let mut per_row = Vec::new();
        for row in 0..rows {
            // About a third of the rows have a mask, a third biases, some both, the rest nothing.
            let mask = (r.random_range(0..3) == 0).then(|| {
                let density: f64 = r.random_range(0.0..1.0);
                let mut m = vec![0u32; words];
                for t in 0..vocab {
                    if r.random_bool(density) {
                        m[t / 32] |= 1 << (t % 32);
                    }
                }
                m
            });
            let biases: Vec<(u32, f32)> = if r.random_range(0..3) == 0 {
                (0..r.random_range(1..300)).map(|_| (r.random_range(0..vocab as u32), r.random_range(-100.0..100.0))).collect()
            } else {
                Vec::new()
            };
            let w = &mut want[row * vocab..(row + 1) * vocab];
            if let Some(m) = &mask {
                for (t, l) in w.iter_mut().enumerate() {
                    if (m[t / 32] >> (t % 32)) & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            for &(t, b) in &biases {
                w[t as usize] += b;
            }
            per_row.push((row, mask, biases));
        }
        let rows: Vec<ConstrainedRow> = per_row.iter().map(|(row, mask, biases)| ConstrainedRow { row: *row, mask: mask.as_deref(), biases }).collect();
        let mut packed = Vec::new();
        let n = pack_token_constraints(vocab, &rows, &mut packed).unwrap();
        let dl = c.gpu.upload(&logits).unwrap();
        let dp = c.gpu.upload(&packed).unwrap();
        unsafe { c.kernels.apply_token_constraints(&c.gpu.stream, dl.ptr(), vocab, dp.ptr(), n).unwrap() };
        let got = dl.download(&c.gpu.stream).unwrap();
        // Same f32 operations in the same order: bit-exact (untouched rows included).
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.to_bits() == w.to_bits(), "vocab {vocab}, row {}, token {}: got {g}, want {w}", i / vocab, i % vocab);
        }
    }
}

#[test]
fn argmax_picks_the_first_maximum() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let (rows, vocab) = (7, 49152);
    let mut logits: Vec<f32> = (0..rows * vocab).map(|_| r.random_range(-10.0..10.0)).collect();
    // Row 1: a tie between two far-apart indices; the lower index must win.
    logits[vocab + 40000] = 50.0;
    logits[vocab + 123] = 50.0;
    // Row 2: the maximum at the very end.
    logits[2 * vocab + vocab - 1] = 99.0;
    let dl = c.gpu.upload(&logits).unwrap();
    let out = c.gpu.upload(&vec![u32::MAX; rows]).unwrap();
    unsafe { c.kernels.argmax_rows(&c.gpu.stream, dl.ptr(), rows, vocab, out.ptr()).unwrap() };
    let got = out.download(&c.gpu.stream).unwrap();
    for row in 0..rows {
        let slice = &logits[row * vocab..(row + 1) * vocab];
        let mut best = 0;
        for (i, &v) in slice.iter().enumerate() {
            if v > slice[best] {
                best = i;
            }
        }
        assert_eq!(got[row] as usize, best, "row {row}");
    }
    assert_eq!(got[1], 123);
    assert_eq!(got[2] as usize, vocab - 1);
}

#[test]
fn gemm_bf16_matches_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    for (m, n, k) in [(1usize, 1536usize, 576usize), (37, 576, 1536), (5, 4096, 4096)] {
        let (x, xv) = rand_bf16(&mut r, m * k, 1.0);
        let (w, wv) = rand_bf16(&mut r, n * k, 0.05);
        let (dx, dw) = (c.gpu.upload(&x).unwrap(), c.gpu.upload(&w).unwrap());
        let mut want = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                want[i * n + j] = (0..k).map(|l| xv[i * k + l] * wv[j * k + l]).sum();
            }
        }
        let yb = poison(&c, m * n);
        unsafe { c.blas.matmul(yb.ptr(), OutType::Bf16, dx.ptr(), dw.ptr(), m, n, k, 0.0).unwrap() };
        let got = to_f64(&yb.download(&c.gpu.stream).unwrap());
        let err = rel_l2(&got, &want);
        eprintln!("gemm bf16 out {m}x{n}x{k}: rel L2 {err:.2e}");
        assert!(err < 1e-2, "bf16-out GEMM rel L2 {err}");
        // f32 output accumulated onto an existing value (beta = 1), as the residual adds would use.
        let base: Vec<f32> = (0..m * n).map(|_| r.random_range(-1.0..1.0)).collect();
        let yf = c.gpu.upload(&base).unwrap();
        unsafe { c.blas.matmul(yf.ptr(), OutType::F32, dx.ptr(), dw.ptr(), m, n, k, 1.0).unwrap() };
        let got: Vec<f64> = yf.download(&c.gpu.stream).unwrap().iter().map(|&v| v as f64).collect();
        let want2: Vec<f64> = want.iter().zip(&base).map(|(w, b)| w + *b as f64).collect();
        let err = rel_l2(&got, &want2);
        eprintln!("gemm f32 out {m}x{n}x{k}: rel L2 {err:.2e}");
        // f32 output, f32 accumulation of exact bf16 products: only summation-order error.
        assert!(err < 1e-5, "f32-out GEMM rel L2 {err}");
    }
}

#[test]
fn fills_and_conversion() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let n = 1 << 20;
    let out = poison(&c, n);
    unsafe { c.kernels.fill_uniform_bf16(&c.gpu.stream, out.ptr(), n, 42, 0.1).unwrap() };
    let v = to_f64(&out.download(&c.gpu.stream).unwrap());
    // bf16(0.1) rounds up to 0.10009765625: allow one bf16 rounding above the scale.
    assert!(v.iter().all(|x| x.abs() <= 0.1 * (1.0 + 1.0 / 256.0)), "within the scale");
    let mean = v.iter().sum::<f64>() / n as f64;
    let var = v.iter().map(|x| x * x).sum::<f64>() / n as f64;
    assert!(mean.abs() < 1e-3, "mean {mean}");
    assert!((var - 0.01 / 3.0).abs() < 1e-4, "variance {var} vs uniform's {}", 0.01 / 3.0);
    let src: Vec<f32> = (0..4096).map(|_| r.random_range(-100.0..100.0)).collect();
    let ds = c.gpu.upload(&src).unwrap();
    let dst = poison(&c, src.len());
    unsafe { c.kernels.f32_to_bf16(&c.gpu.stream, dst.ptr(), ds.ptr(), src.len()).unwrap() };
    let got = dst.download(&c.gpu.stream).unwrap();
    for (g, s) in got.iter().zip(&src) {
        assert_eq!(*g, bf16::from_f32(*s).to_bits(), "round to nearest even, as half::bf16");
    }
    let f = c.gpu.upload(&vec![0f32; 1000]).unwrap();
    unsafe { c.kernels.fill_f32(&c.gpu.stream, f.ptr(), 1000, 1.5).unwrap() };
    assert!(f.download(&c.gpu.stream).unwrap().iter().all(|&x| x == 1.5));
}

#[test]
fn gemv_matches_reference_for_every_small_m() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    // n picks 4, 2 and 1 warps per row, k unroll 8 or 16 (see Kernels::gemv_plan).
    for (n, k) in [(1536usize, 576usize), (576, 1536), (4096, 14336), (1000, 8), (9000, 136), (20000, 64)] {
        for m in 1..=peregrine_kernels::ops::GEMV_MAX_M {
            let (x, xv) = rand_bf16(&mut r, m * k, 1.0);
            let (w, wv) = rand_bf16(&mut r, n * k, 0.05);
            let (dx, dw) = (c.gpu.upload(&x).unwrap(), c.gpu.upload(&w).unwrap());
            let mut want = vec![0f64; m * n];
            for i in 0..m {
                for j in 0..n {
                    want[i * n + j] = (0..k).map(|l| xv[i * k + l] * wv[j * k + l]).sum();
                }
            }
            let yb = poison(&c, m * n);
            unsafe { c.kernels.gemv(&c.gpu.stream, yb.ptr(), false, dx.ptr(), dw.ptr(), m, n, k).unwrap() };
            // One bf16 rounding of an f32 sum: within 2^-8 relative of each value.
            assert_bf16_close(&yb.download(&c.gpu.stream).unwrap(), &want, &format!("gemv bf16 m={m} n={n} k={k}"));
            let yf = c.gpu.upload(&vec![f32::NAN; m * n]).unwrap();
            unsafe { c.kernels.gemv(&c.gpu.stream, yf.ptr(), true, dx.ptr(), dw.ptr(), m, n, k).unwrap() };
            let gotf: Vec<f64> = yf.download(&c.gpu.stream).unwrap().iter().map(|&v| v as f64).collect();
            let err = rel_l2(&gotf, &want);
            assert!(err < 1e-5, "gemv f32 m={m} n={n} k={k}: rel L2 {err}");
        }
    }
}

/// The gate/up GEMV with SwiGLU in its epilogue: silu(g) * u from g and u rounded to bf16 (as the
/// unfused path stores them), for every small m and shapes that take 4, 2 and 1 warps per row.
#[test]
fn gemv_silu_matches_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let round = |v: f64| bf16::from_f64(v).to_f64();
    for (inter, k) in [(1536usize, 576usize), (1000, 8192), (3, 64), (1001, 136)] {
        for m in 1..=peregrine_kernels::ops::GEMV_MAX_M {
            let (x, xv) = rand_bf16(&mut r, m * k, 1.0);
            let (w, wv) = rand_bf16(&mut r, 2 * inter * k, 0.05);
            let (dx, dw) = (c.gpu.upload(&x).unwrap(), c.gpu.upload(&w).unwrap());
            let act = poison(&c, m * inter);
            unsafe { c.kernels.gemv_silu(&c.gpu.stream, act.ptr(), dx.ptr(), dw.ptr(), m, inter, k).unwrap() };
            let got = to_f64(&act.download(&c.gpu.stream).unwrap());
            for i in 0..m {
                for j in 0..inter {
                    let dot = |row: usize| -> f64 { (0..k).map(|l| xv[i * k + l] * wv[row * k + l]).sum() };
                    let (g, u) = (round(dot(j)), round(dot(inter + j)));
                    let want = g / (1.0 + (-g).exp()) * u;
                    // g and u may each land one bf16 step (2^-8 relative) off the f64 rounding, then
                    // the output is rounded once more.
                    let tol = want.abs() / 64.0 + 1e-3 * (g.abs() + u.abs()) + 1e-6;
                    let v = got[i * inter + j];
                    assert!((v - want).abs() <= tol, "gemv_silu m={m} inter={inter} k={k} [{i},{j}]: got {v}, want {want}");
                }
            }
        }
    }
}

#[test]
fn gemv_every_unroll_and_row_split_matches_reference() {
    let Some(c) = cuda_or_skip() else { return };
    let mut r = rng();
    let (n, k) = (300usize, 4104usize); // k not a multiple of any split: partial last iterations everywhere
    for m in [1usize, 3, 8] {
        let (x, xv) = rand_bf16(&mut r, m * k, 1.0);
        let (w, wv) = rand_bf16(&mut r, n * k, 0.05);
        let (dx, dw) = (c.gpu.upload(&x).unwrap(), c.gpu.upload(&w).unwrap());
        let want: Vec<f64> = (0..m * n).map(|e| (0..k).map(|l| xv[(e / n) * k + l] * wv[(e % n) * k + l]).sum()).collect();
        for unroll in [8usize, 16] {
            for wpr in [1usize, 2, 4, 8] {
                let y = poison(&c, m * n);
                unsafe { c.kernels.gemv_with(&c.gpu.stream, y.ptr(), false, dx.ptr(), dw.ptr(), m, n, k, unroll, wpr).unwrap() };
                assert_bf16_close(&y.download(&c.gpu.stream).unwrap(), &want, &format!("gemv m={m} unroll {unroll} wpr {wpr}"));
            }
        }
    }
}

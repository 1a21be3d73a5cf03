//! An orthogonal rotation of the residual stream, folded into the weights (QuaRot's "computational
//! invariance"), so that 8-bit per-token activations lose less.
//!
//! SmolLM2's post-norm hidden states have a few outlier channels; one int8 scale per token spends
//! its range on them, and the inputs of q/k/v and gate/up (the residual stream after RMSNorm) are
//! where W8A8 loses most (docs/benchmarks.md, "Which projection inputs cost"). With `x' = Q x` for an
//! orthogonal `Q`, the model computes the same function when
//! - every RMSNorm weight `g` moves into the matrices that read the norm's output (`W diag(g) Qᵀ`) and
//!   becomes 1 (`RMSNorm(Q x) = Q RMSNorm(x)` without a weight: `Q` keeps the norm);
//! - the matrices that write into the stream (o_proj, down_proj) and the embedding rows become `Q W`;
//! - the LM head reads `W_lm diag(g_final) Qᵀ` (a tied head becomes a matrix of its own).
//!
//! `Q` spreads each channel over all of them: the normalized Walsh–Hadamard matrix of the largest
//! power of two dividing the hidden size, Kronecker with a seeded random orthogonal matrix for the
//! odd factor (576 = 9 × 64 for SmolLM2), times seeded random signs (as QuaRot's randomized
//! Hadamard). Everything is computed in f32 from the loaded values; quantized matrices come out as
//! f32, to be quantized afterwards.
//!
//! down_proj's input (SwiGLU's output) lives outside the stream and no fold reaches it: it is rotated
//! at run time instead, by the block-diagonal normalized Walsh–Hadamard matrix `H` of
//! [`down_input_block`]-sized blocks, inside the kernel that quantizes it (QuaRot's online Hadamard;
//! on the CPU `backend::cpu::hadamard::rotate_heads` over those blocks).
//! Seeded signs `S` are folded into up_proj's rows (`silu(g) · (s u) = s · silu(g) u`), so the kernel
//! computes `x' = H S x` and down_proj's columns become `W S H` (`ModelWeights::down_input_hadamard`
//! tells the backends).
//!
//! LoRA adapters read the norm's output and write into the stream too: an adapter trained on the
//! original model is rotated the same way at load ([`AdapterRotation`]).

use super::weights::{Matrix, ModelWeights};
// The normalized Walsh–Hadamard transform, here in f64 (the folds' precision).
use crate::backend::cpu::hadamard::rotate as hadamard;
use crate::lora::LoraAdapter;
use crate::{EngineError, Result};

/// The seed of the rotation's random factors: fixed, so a model is rotated the same way every load.
pub const ROTATION_SEED: u64 = 0x5155_4152_4f54; // "QUAROT"

/// Largest odd factor of the hidden size the rotation builds a dense random orthogonal matrix for.
const MAX_ODD_FACTOR: usize = 64;

/// Largest block of the online rotation of down_proj's input: 2048 spreads an outlier channel over
/// plenty, and keeps the kernel's butterflies to 8 passes (Llama-3.1-8B's 14336 = 7 × 2048).
const MAX_DOWN_BLOCK: usize = 2048;

/// The block of the online rotation of down_proj's input for an intermediate size: its largest
/// power-of-two divisor up to [`MAX_DOWN_BLOCK`]; None below 8 (the kernels rotate 8 values per
/// thread in registers first).
pub fn down_input_block(intermediate: usize) -> Option<usize> {
    let b = (1usize << intermediate.trailing_zeros().min(usize::BITS - 1)).min(MAX_DOWN_BLOCK);
    (intermediate > 0 && b >= 8).then_some(b)
}

/// The rotation `Q = (R ⊗ H) · diag(signs)` of `n` channels.
#[derive(Debug)]
pub struct Rotation {
    n: usize,
    /// The Walsh–Hadamard order: the largest power of two dividing n.
    p: usize,
    /// The odd factor m = n / p and its orthogonal matrix R (m × m, row-major).
    m: usize,
    r: Vec<f64>,
    signs: Vec<f64>,
}

impl Rotation {
    pub fn new(n: usize, seed: u64) -> Result<Rotation> {
        if n == 0 {
            return Err(EngineError::Unsupported("rotation: hidden size 0".into()));
        }
        let p = 1usize << n.trailing_zeros();
        let m = n / p;
        if m > MAX_ODD_FACTOR {
            return Err(EngineError::Unsupported(format!(
                "rotation: hidden size {n} has the odd factor {m} (at most {MAX_ODD_FACTOR} supported)"
            )));
        }
        let mut rng = SplitMix64(seed);
        let signs = (0..n).map(|_| if rng.next() & 1 == 0 { 1.0 } else { -1.0 }).collect();
        let r = random_orthogonal(m, &mut rng);
        Ok(Rotation { n, p, m, r, signs })
    }

    /// v ← Q v.
    pub fn apply(&self, v: &mut [f64]) {
        debug_assert_eq!(v.len(), self.n);
        v.iter_mut().zip(&self.signs).for_each(|(x, s)| *x *= s);
        self.kron(v, false);
    }

    /// v ← Qᵀ v.
    pub fn apply_transposed(&self, v: &mut [f64]) {
        self.kron(v, true);
        v.iter_mut().zip(&self.signs).for_each(|(x, s)| *x *= s);
    }

    /// v ← (R ⊗ H) v, or (Rᵀ ⊗ H) v: v as m rows of p, H on each row, then R (or Rᵀ) across rows.
    fn kron(&self, v: &mut [f64], transposed: bool) {
        let (m, p) = (self.m, self.p);
        for row in v.chunks_exact_mut(p) {
            hadamard(row);
        }
        if m == 1 {
            return;
        }
        let mut col = vec![0f64; m];
        for b in 0..p {
            for (a, c) in col.iter_mut().enumerate() {
                *c = (0..m).map(|k| if transposed { self.r[k * m + a] } else { self.r[a * m + k] } * v[k * p + b]).sum();
            }
            for (a, &c) in col.iter().enumerate() {
                v[a * p + b] = c;
            }
        }
    }
}

/// A random orthogonal m × m matrix (row-major): Gram–Schmidt over Gaussian rows.
fn random_orthogonal(m: usize, rng: &mut SplitMix64) -> Vec<f64> {
    let mut r = vec![0f64; m * m];
    for i in 0..m {
        loop {
            let mut row: Vec<f64> = (0..m).map(|_| rng.gaussian()).collect();
            for j in 0..i {
                let dot: f64 = (0..m).map(|k| row[k] * r[j * m + k]).sum();
                (0..m).for_each(|k| row[k] -= dot * r[j * m + k]);
            }
            let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
            if norm > 1e-6 {
                r[i * m..(i + 1) * m].iter_mut().zip(&row).for_each(|(d, x)| *d = x / norm);
                break;
            }
        }
    }
    r
}

/// A small deterministic generator (the rotation must not depend on a crate's stream).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A standard normal sample (Box–Muller).
    fn gaussian(&mut self) -> f64 {
        let u1 = ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let u2 = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// `W diag(g) Qᵀ`: each row r of a matrix that reads the stream becomes Q (g ⊙ r). Rows in parallel.
fn fold_reader(m: &Matrix, g: &[f32], q: &Rotation) -> Matrix {
    use rayon::prelude::*;
    let mut data = m.to_f32();
    data.par_chunks_mut(m.cols.max(1)).for_each_init(
        || vec![0f64; m.cols],
        |row, r| {
            row.iter_mut().zip(r.iter().zip(g)).for_each(|(d, (&x, &w))| *d = x as f64 * w as f64);
            q.apply(row);
            r.iter_mut().zip(row.iter()).for_each(|(d, &x)| *d = x as f32);
        },
    );
    Matrix::from_f32(m.rows, m.cols, data)
}

/// `Q W`: the matrix's rows are mixed (Q acts on the row index), as whole rows at a time: each
/// butterfly adds and subtracts two rows, so a wide matrix (down_proj) streams through memory once
/// per pass instead of gathering each column with a stride.
fn fold_writer(m: &Matrix, q: &Rotation) -> Matrix {
    use rayon::prelude::*;
    let k = m.cols.max(1);
    let mut rows: Vec<Vec<f64>> = m.to_f32().chunks_exact(k).map(|r| r.iter().map(|&x| x as f64).collect()).collect();
    rows.par_iter_mut().zip(q.signs.par_iter()).for_each(|(r, &s)| r.iter_mut().for_each(|x| *x *= s));
    let (p, mm) = (q.p, q.m);
    let norm = 1.0 / (p as f64).sqrt();
    for group in rows.chunks_mut(p) {
        let mut len = 1;
        while len < p {
            // Pairs (j, j + len) within each 2·len run: disjoint, so the runs go in parallel.
            group.par_chunks_mut(2 * len).for_each(|run| {
                let (lo, hi) = run.split_at_mut(len);
                for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                    a.iter_mut().zip(b.iter_mut()).for_each(|(x, y)| (*x, *y) = (*x + *y, *x - *y));
                }
            });
            len <<= 1;
        }
        group.par_iter_mut().for_each(|r| r.iter_mut().for_each(|x| *x *= norm));
    }
    if mm > 1 {
        // Row (a, b) <- sum_c R[a][c] row (c, b), for each b.
        let mixed: Vec<Vec<f64>> = (0..mm * p)
            .into_par_iter()
            .map(|i| {
                let (a, b) = (i / p, i % p);
                let mut out = vec![0f64; k];
                for c in 0..mm {
                    let w = q.r[a * mm + c];
                    out.iter_mut().zip(&rows[c * p + b]).for_each(|(o, &x)| *o += w * x);
                }
                out
            })
            .collect();
        rows = mixed;
    }
    Matrix::from_f32(m.rows, m.cols, rows.into_iter().flatten().map(|x| x as f32).collect())
}

/// Each head's block of `d` rows rotated by the normalized Walsh–Hadamard matrix H (every column):
/// a matrix whose outputs are heads (v_proj, a v adapter's B) then writes H times each head.
fn heads_on_rows(m: &Matrix, d: usize) -> Matrix {
    let mut v = m.to_f32();
    let mut buf = vec![0f64; d];
    for c in 0..m.cols {
        for head in 0..m.rows / d {
            buf.iter_mut().enumerate().for_each(|(i, x)| *x = v[(head * d + i) * m.cols + c] as f64);
            hadamard(&mut buf);
            buf.iter().enumerate().for_each(|(i, &x)| v[(head * d + i) * m.cols + c] = x as f32);
        }
    }
    Matrix::from_f32(m.rows, m.cols, v)
}

/// Each row's blocks of `d` columns rotated by H: a matrix that reads heads (o_proj, an o adapter's
/// A) then undoes H on each (H is symmetric and its own inverse); likewise down_proj over blocks of
/// the SwiGLU output.
fn blocks_on_cols(m: &Matrix, d: usize) -> Matrix {
    let mut o = m.to_f32();
    let mut buf = vec![0f64; d];
    for row in o.chunks_exact_mut(m.cols.max(1)) {
        for head in row.chunks_exact_mut(d) {
            buf.iter_mut().zip(head.iter()).for_each(|(x, &y)| *x = y as f64);
            hadamard(&mut buf);
            head.iter_mut().zip(&buf).for_each(|(y, &x)| *y = x as f32);
        }
    }
    Matrix::from_f32(m.rows, m.cols, o)
}

/// `v_proj`'s rows of each KV head rotated by H (its bias too), and `o_proj`'s columns of each query
/// head: attention averages v rows, so each head's output comes out rotated and o_proj undoes it.
/// o_proj then reads rotated heads, whose outliers are spread as the stream's are.
fn rotate_heads(v_proj: &Matrix, v_bias: Option<&mut Vec<f32>>, o_proj: &Matrix, d: usize) -> (Matrix, Matrix) {
    if let Some(b) = v_bias {
        let rotated = heads_on_rows(&Matrix::from_f32(b.len(), 1, b.clone()), d).to_f32();
        *b = rotated;
    }
    (heads_on_rows(v_proj, d), blocks_on_cols(o_proj, d))
}

/// What LoRA adapters trained on the unrotated model need to serve over the rotated one: each
/// pair rotated as the matrix it adds to (A of a norm-reading module folds the norm weight and Q,
/// B of a stream-writing module gets Q, v's B and o's A the per-head H), from the norm weights the
/// rotation folded away.
#[derive(Debug)]
pub struct AdapterRotation {
    q: Rotation,
    head_dim: usize,
    /// The online rotation of down_proj's input, if any: its block, and the signs folded into up.
    down: Option<DownRotation>,
    /// Per layer: input_layernorm's and post_attention_layernorm's weights before folding.
    norms: Vec<(Vec<f32>, Vec<f32>)>,
}

/// The online rotation of down_proj's input: `x' = H S x`, H over blocks of `block`.
#[derive(Debug)]
struct DownRotation {
    block: usize,
    signs: Vec<f32>,
}

impl DownRotation {
    fn new(inter: usize, seed: u64) -> Option<DownRotation> {
        let block = down_input_block(inter)?;
        let mut rng = SplitMix64(seed ^ 0x444f_574e); // "DOWN": signs of their own stream
        let signs = (0..inter).map(|_| if rng.next() & 1 == 0 { 1.0 } else { -1.0 }).collect();
        Some(DownRotation { block, signs })
    }

    /// Rows of a matrix writing up_proj's outputs (up_proj, an up adapter's B) times the signs.
    fn sign_rows(&self, m: &Matrix) -> Matrix {
        let mut v = m.to_f32();
        v.chunks_exact_mut(m.cols.max(1)).zip(&self.signs).for_each(|(r, &s)| r.iter_mut().for_each(|x| *x *= s));
        Matrix::from_f32(m.rows, m.cols, v)
    }

    /// `W S H` for a matrix reading the SwiGLU output (down_proj, a down adapter's A).
    fn reader(&self, m: &Matrix) -> Matrix {
        let mut v = m.to_f32();
        v.chunks_exact_mut(m.cols.max(1)).for_each(|r| r.iter_mut().zip(&self.signs).for_each(|(x, &s)| *x *= s));
        blocks_on_cols(&Matrix::from_f32(m.rows, m.cols, v), self.block)
    }
}

impl AdapterRotation {
    /// Rotates every pair of `adapter` (one trained on the unrotated model).
    pub fn rotate(&self, adapter: &mut LoraAdapter) -> Result<()> {
        use crate::lora::target::TargetModule as T;
        if adapter.layers.len() != self.norms.len() {
            return Err(EngineError::Unsupported(format!("rotating an adapter of {} layers for a model of {}", adapter.layers.len(), self.norms.len())));
        }
        let r = adapter.rank;
        for (layer, (g1, g2)) in adapter.layers.iter_mut().zip(&self.norms) {
            for m in T::ALL {
                let Some(pair) = layer[m.index()].as_mut() else { continue };
                let (cols_a, rows_b) = (pair.a.len() / r.max(1), pair.b.len() / r.max(1));
                // The rotation is f32 arithmetic: a 16-bit adapter comes out of it in f32.
                let a = Matrix::from_f32(r, cols_a, std::mem::take(&mut pair.a).into_f32());
                let b = Matrix::from_f32(rows_b, r, std::mem::take(&mut pair.b).into_f32());
                let (a, b) = match m {
                    T::Q | T::K => (fold_reader(&a, g1, &self.q), b),
                    T::V => (fold_reader(&a, g1, &self.q), heads_on_rows(&b, self.head_dim)),
                    T::O => (blocks_on_cols(&a, self.head_dim), fold_writer(&b, &self.q)),
                    T::Gate => (fold_reader(&a, g2, &self.q), b),
                    T::Up => (fold_reader(&a, g2, &self.q), match &self.down {
                        Some(d) => d.sign_rows(&b),
                        None => b,
                    }),
                    T::Down => {
                        let a = match &self.down {
                            Some(d) => d.reader(&a),
                            None => a,
                        };
                        (a, fold_writer(&b, &self.q))
                    },
                };
                (pair.a, pair.b) = (a.to_f32().into(), b.to_f32().into());
            }
        }
        Ok(())
    }
}

/// Rotates the residual stream of `w` by the seeded rotation of its hidden size, each attention
/// head's values by H, and down_proj's input where its size allows (see the module's header;
/// `w.down_input_hadamard` then says so): the model computes the same logits up to f32 rounding.
pub fn rotate_residual_stream(w: &mut ModelWeights, seed: u64) -> Result<AdapterRotation> {
    let h = w.config.hidden_size;
    let d = w.config.head_dim;
    if !d.is_power_of_two() {
        return Err(EngineError::Unsupported(format!("rotation: head_dim {d} is not a power of two")));
    }
    let q = Rotation::new(h, seed)?;
    let down = DownRotation::new(w.config.intermediate_size, seed);
    let ones = vec![1f32; h];
    let norms = w.layers.iter().map(|l| (l.input_layernorm.clone(), l.post_attention_layernorm.clone())).collect();
    // The head first: a tied head is the embedding before it is rotated.
    w.lm_head = Some(fold_reader(w.lm_head(), &w.norm, &q));
    w.norm = ones.clone();
    // Embedding rows are stream vectors: e' = Q e (a reader with g = 1 does exactly that per row).
    w.embed_tokens = fold_reader(&w.embed_tokens, &ones, &q);
    let layers = w.layers.len();
    for (i, layer) in w.layers.iter_mut().enumerate() {
        if i % layers.div_ceil(8).max(1) == 0 {
            tracing::info!("rotating the residual stream: layer {}/{layers}", i + 1);
        }
        let g = std::mem::replace(&mut layer.input_layernorm, ones.clone());
        layer.q_proj = fold_reader(&layer.q_proj, &g, &q);
        layer.k_proj = fold_reader(&layer.k_proj, &g, &q);
        layer.v_proj = fold_reader(&layer.v_proj, &g, &q);
        (layer.v_proj, layer.o_proj) = rotate_heads(&layer.v_proj, layer.v_bias.as_mut(), &layer.o_proj, d);
        layer.o_proj = fold_writer(&layer.o_proj, &q);
        let g = std::mem::replace(&mut layer.post_attention_layernorm, ones.clone());
        layer.gate_proj = fold_reader(&layer.gate_proj, &g, &q);
        layer.up_proj = fold_reader(&layer.up_proj, &g, &q);
        if let Some(dr) = &down {
            layer.up_proj = dr.sign_rows(&layer.up_proj);
            layer.down_proj = dr.reader(&layer.down_proj);
        }
        layer.down_proj = fold_writer(&layer.down_proj, &q);
    }
    w.down_input_hadamard = down.as_ref().map(|d| d.block);
    Ok(AdapterRotation { q, head_dim: d, down, norms })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotation_is_orthogonal_for_powers_of_two_and_odd_factors() {
        for n in [64usize, 576, 96, 8] {
            let q = Rotation::new(n, ROTATION_SEED).unwrap();
            // Columns of Q: Q e_i; orthonormal, and Qᵀ undoes Q.
            let cols: Vec<Vec<f64>> = (0..n)
                .map(|i| {
                    let mut e = vec![0f64; n];
                    e[i] = 1.0;
                    q.apply(&mut e);
                    e
                })
                .collect();
            for i in (0..n).step_by(7) {
                for j in (0..n).step_by(5) {
                    let dot: f64 = cols[i].iter().zip(&cols[j]).map(|(a, b)| a * b).sum();
                    assert!((dot - if i == j { 1.0 } else { 0.0 }).abs() < 1e-9, "n {n}: <Q e{i}, Q e{j}> = {dot}");
                }
                let mut back = cols[i].clone();
                q.apply_transposed(&mut back);
                assert!(back.iter().enumerate().all(|(k, &x)| (x - if k == i { 1.0 } else { 0.0 }).abs() < 1e-9));
            }
            // One channel is spread over all of them (no entry larger than a few / sqrt(n)).
            let spread = cols[0].iter().fold(0f64, |m, x| m.max(x.abs()));
            assert!(spread <= 4.0 / (n as f64).sqrt(), "n {n}: largest entry {spread}");
        }
        assert!(Rotation::new(3 * 67, 1).is_err(), "an odd factor past the bound is refused");
    }

    #[test]
    fn the_row_wise_writer_fold_is_q_times_each_column() {
        // 96 = 3 × 32 (an odd factor) and 64 rows, 5 columns.
        for n in [96usize, 64] {
            let q = Rotation::new(n, ROTATION_SEED).unwrap();
            let data: Vec<f32> = (0..n * 5).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let got = fold_writer(&Matrix::from_f32(n, 5, data.clone()), &q).to_f32();
            for c in 0..5 {
                let mut col: Vec<f64> = (0..n).map(|r| data[r * 5 + c] as f64).collect();
                q.apply(&mut col);
                for r in 0..n {
                    assert!((got[r * 5 + c] as f64 - col[r]).abs() < 1e-5, "n {n} row {r} col {c}: {} vs {}", got[r * 5 + c], col[r]);
                }
            }
        }
    }

    #[test]
    fn down_proj_input_blocks_are_the_largest_power_of_two_up_to_2048() {
        assert_eq!(down_input_block(1536), Some(512), "SmolLM2: 3 × 512");
        assert_eq!(down_input_block(14336), Some(2048), "Llama-3.1-8B: 7 × 2048");
        assert_eq!(down_input_block(16384), Some(2048), "capped");
        assert_eq!(down_input_block(8 * 11), Some(8));
        assert_eq!(down_input_block(4 * 11), None, "blocks under 8 are not rotated");
        assert_eq!(down_input_block(0), None);
    }

    #[test]
    fn the_online_down_rotation_undoes_what_down_proj_holds() {
        // down(x) = W x must equal W' (H S x) with W' = W S H, the signs S folded into up's rows.
        let (inter, out) = (96usize, 3usize);
        let down = DownRotation::new(inter, ROTATION_SEED).unwrap();
        assert_eq!(down.block, 32);
        assert!(down.signs.iter().any(|&s| s < 0.0) && down.signs.iter().any(|&s| s > 0.0));
        let w: Vec<f32> = (0..out * inter).map(|i| ((i * 29 % 53) as f32 - 26.0) / 13.0).collect();
        let x: Vec<f32> = (0..inter).map(|i| ((i * 17 % 31) as f32 - 15.0) / 7.0).collect();
        let folded = down.reader(&Matrix::from_f32(out, inter, w.clone())).to_f32();
        // What the kernel reads: up's output carries the signs, then each block is rotated.
        let mut xr: Vec<f32> = x.iter().zip(&down.signs).map(|(a, s)| a * s).collect();
        crate::backend::cpu::hadamard::rotate_heads(&mut xr, down.block);
        for r in 0..out {
            let want: f32 = (0..inter).map(|c| w[r * inter + c] * x[c]).sum();
            let got: f32 = (0..inter).map(|c| folded[r * inter + c] * xr[c]).sum();
            assert!((want - got).abs() < 1e-4 * want.abs().max(1.0), "row {r}: {got} vs {want}");
        }
        // The signed up rows: each output channel negated where its sign is.
        let up = down.sign_rows(&Matrix::from_f32(inter, 2, (0..2 * inter).map(|i| i as f32).collect())).to_f32();
        for c in 0..inter {
            assert_eq!(up[2 * c + 1], down.signs[c] * (2 * c + 1) as f32);
        }
    }
}

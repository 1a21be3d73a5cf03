//! The normalized Walsh–Hadamard rotation of one attention head (`--kv-cache-dtype fp8` with
//! rotation): `H = Hₙ / √n` for a power-of-two head dimension `n`, where `Hₙ` is Sylvester's ±1
//! matrix. `H` is symmetric and orthogonal, so rotating both q and k leaves every score q·k
//! unchanged in exact arithmetic, while a k whose energy sits in a few outlier dimensions is spread
//! over all of them: its largest element shrinks and an 8-bit float (one scale for everything) wastes
//! less of its range. The CUDA `rope_kv_write` kernel applies the same rotation; this is its
//! reference.

/// Whether heads of `head_dim` can be rotated (the fast transform needs a power of two).
pub fn supports(head_dim: usize) -> bool {
    head_dim.is_power_of_two() && head_dim >= 2
}

/// The element types the rotation runs in: f32 at run time, f64 where `model::rotate` folds it into
/// weights.
pub trait HadamardScalar: Copy + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self> + std::ops::MulAssign {
    /// 1 / √n.
    fn inv_sqrt(n: usize) -> Self;
}

impl HadamardScalar for f32 {
    fn inv_sqrt(n: usize) -> f32 {
        1.0 / (n as f32).sqrt()
    }
}

impl HadamardScalar for f64 {
    fn inv_sqrt(n: usize) -> f64 {
        1.0 / (n as f64).sqrt()
    }
}

/// Rotates `x` in place: `x ← H x`. `x.len()` must be a power of two ([`supports`]); the caller
/// checks that once, when the cache format is chosen.
pub fn rotate<T: HadamardScalar>(x: &mut [T]) {
    let n = x.len();
    debug_assert!(supports(n), "Hadamard rotation of {n} values");
    // Butterflies: at stride h, pairs (i, i + h) become (a + b, a - b). log2(n) passes give Hₙ x.
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (s, d) = (*a + *b, *a - *b);
                *a = s;
                *b = d;
            }
        }
        h *= 2;
    }
    let norm = T::inv_sqrt(n);
    for v in x.iter_mut() {
        *v *= norm;
    }
}

/// Rotates each of the `x.len() / head_dim` heads of `x` (or blocks: the online rotation of
/// down_proj's input under `--quantization-rotation`, `model::rotate`).
pub fn rotate_heads(x: &mut [f32], head_dim: usize) {
    for head in x.chunks_exact_mut(head_dim) {
        rotate(head);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sylvester's construction, entry by entry: Hₙ[i][j] = (-1)^popcount(i & j).
    fn sylvester(n: usize, i: usize, j: usize) -> f32 {
        let sign = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
        sign / (n as f32).sqrt()
    }

    #[test]
    fn matches_the_normalized_sylvester_matrix() {
        for n in [2usize, 8, 64, 128] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3).collect();
            let mut got = x.clone();
            rotate(&mut got);
            for (i, g) in got.iter().enumerate() {
                let want: f32 = (0..n).map(|j| sylvester(n, i, j) * x[j]).sum();
                assert!((g - want).abs() < 1e-5, "n {n} row {i}: {g} vs {want}");
            }
        }
    }

    #[test]
    fn is_its_own_inverse_and_keeps_dot_products() {
        let n = 64;
        let q: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        // An outlier dimension, as k vectors of real models have.
        let mut k: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 0.2).collect();
        k[5] = 40.0;
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
        let (mut qr, mut kr) = (q.clone(), k.clone());
        rotate(&mut qr);
        rotate(&mut kr);
        assert!((dot(&q, &k) - dot(&qr, &kr)).abs() < 1e-4 * dot(&q, &k).abs().max(1.0));
        // The outlier is spread: the rotated vector's largest element is about 40/√64.
        let max = kr.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max < 6.0, "{max}");
        rotate(&mut kr);
        for (a, b) in kr.iter().zip(&k) {
            assert!((a - b).abs() < 1e-4, "H·H = I");
        }
        assert!(supports(64) && supports(128) && !supports(96) && !supports(1));
    }
}

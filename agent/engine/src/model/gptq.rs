//! Error-compensated rounding of row-quantized weights (GPTQ, Frantar et al. 2022), for
//! `--quantization-gptq`.
//!
//! Rounding each weight to its nearest 8-bit code (what [`RowQuantMatrix::quantize`] does) minimizes
//! each weight's error but not the layer's: what matters is `(W − Q)·x` over the inputs the layer
//! sees. GPTQ quantizes one input column at a time and spreads that column's rounding error over the
//! columns not yet quantized, in the proportions that cancel it best given the inputs' second moment
//! `H = Σ x·xᵀ` (a [`Hessian`], collected over calibration tokens). The row scales stay those of
//! round-to-nearest (each row's max |w| on the largest code), so the result is an ordinary
//! [`RowQuantMatrix`]: every backend runs it unchanged.
//!
//! Columns go in decreasing order of `H`'s diagonal ("act order": the columns whose inputs carry the
//! most energy are rounded first, while the most columns are left to absorb their error). Dense
//! linear algebra here is f64: the Cholesky factors of a damped `H` are ill-conditioned in f32 for
//! the widest layers.

use super::rowquant::{RowFormat, RowQuantError, RowQuantMatrix};

/// Relative damping added to `H`'s diagonal (1 % of its mean, GPTQ's default): keeps the
/// factorization stable where calibration tokens leave directions unexplored.
pub const DEFAULT_DAMP: f64 = 0.01;

/// Columns per lazy batch update: within a batch, errors propagate column by column; to the
/// columns past it, in one matrix product.
const BLOCK: usize = 128;

/// The running sum `Σ x·xᵀ` of a linear layer's input rows (dimension `dim`).
#[derive(Debug, Clone, PartialEq)]
pub struct Hessian {
    dim: usize,
    /// Row-major `dim × dim`.
    sum: Vec<f64>,
    rows: usize,
}

impl Hessian {
    pub fn new(dim: usize) -> Hessian {
        Hessian { dim, sum: vec![0.0; dim * dim], rows: 0 }
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// How many input rows were added.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Adds `n` input rows (`x` is `n × dim`, row-major; extra values past `n · dim` are ignored).
    pub fn add(&mut self, x: &[f32], n: usize) {
        let d = self.dim;
        if n == 0 || d == 0 {
            return;
        }
        let x: Vec<f64> = x[..n * d].iter().map(|&v| f64::from(v)).collect();
        // sum (d × d) += xᵀ (d × n) · x (n × d).
        // SAFETY: `x` holds n × d values and `sum` d × d; lhs element (i, k) = x[k·d + i], rhs
        // element (k, j) = x[k·d + j] and dst element (i, j) = sum[i·d + j] stay inside them.
        unsafe {
            gemm::gemm(
                d, d, n,
                self.sum.as_mut_ptr(), 1, d as isize,
                true,
                x.as_ptr(), d as isize, 1,
                x.as_ptr(), 1, d as isize,
                1.0, 1.0,
                false, false, false,
                gemm::Parallelism::Rayon(0),
            );
        }
        self.rows += n;
    }

    /// The mean of the diagonal (the inputs' mean energy per coordinate).
    fn mean_diagonal(&self) -> f64 {
        (0..self.dim).map(|i| self.sum[i * self.dim + i]).sum::<f64>() / self.dim.max(1) as f64
    }
}

/// Which input of a decoder layer a linear projection reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearInput {
    /// The normalized residual stream q, k and v read.
    Attention,
    /// The attention output o_proj reads.
    Output,
    /// The normalized residual stream gate and up read.
    Mlp,
    /// SwiGLU's output (rotated, under `--quantization-rotation`) down_proj reads.
    Down,
}

/// The second moments of one decoder layer's four linear inputs.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerInputs {
    pub attention: Hessian,
    pub output: Hessian,
    pub mlp: Hessian,
    pub down: Hessian,
}

impl LayerInputs {
    pub fn new(c: &crate::config::ModelConfig) -> LayerInputs {
        LayerInputs {
            attention: Hessian::new(c.hidden_size),
            output: Hessian::new(c.q_dim()),
            mlp: Hessian::new(c.hidden_size),
            down: Hessian::new(c.intermediate_size),
        }
    }

    pub fn site_mut(&mut self, site: LinearInput) -> &mut Hessian {
        match site {
            LinearInput::Attention => &mut self.attention,
            LinearInput::Output => &mut self.output,
            LinearInput::Mlp => &mut self.mlp,
            LinearInput::Down => &mut self.down,
        }
    }
}

/// Why GPTQ could not quantize a matrix.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GptqError {
    #[error("the calibration inputs have {found} columns, the matrix {expected}")]
    Width { expected: usize, found: usize },
    #[error("no calibration tokens reached this layer")]
    NoCalibration,
    #[error("the calibration inputs' second moment is not positive definite, even damped")]
    NotPositiveDefinite,
    #[error(transparent)]
    Rows(#[from] RowQuantError),
}

/// Quantizes `w` (`rows × cols`, row-major) to `format` with one scale per row, rounding column by
/// column with GPTQ's error feedback under the inputs' second moment `h` (`cols × cols`).
pub fn quantize(format: RowFormat, rows: usize, cols: usize, w: &[f32], h: &Hessian, damp: f64) -> Result<RowQuantMatrix, GptqError> {
    if h.dim != cols {
        return Err(GptqError::Width { expected: cols, found: h.dim });
    }
    if h.rows == 0 {
        return Err(GptqError::NoCalibration);
    }
    // Round-to-nearest gives the scales (and refuses non-finite weights).
    let nearest = RowQuantMatrix::quantize(format, rows, cols, w)?;
    if rows == 0 || cols == 0 {
        return Ok(nearest);
    }
    let scales = nearest.scales().to_vec();

    // Columns ordered by decreasing input energy; a column no token ever fed is dead: its weights
    // are rounded alone (their error costs nothing) and it gets a unit diagonal so H stays invertible.
    let diag: Vec<f64> = (0..cols).map(|i| h.sum[i * cols + i]).collect();
    let mut order: Vec<usize> = (0..cols).collect();
    order.sort_by(|&a, &b| diag[b].total_cmp(&diag[a]).then(a.cmp(&b)));
    let damping = damp * h.mean_diagonal().max(f64::MIN_POSITIVE);
    // H in the permuted order, damped, and index-reversed for `factor_inverse_upper` (row `a` of the
    // permuted matrix is row `cols − 1 − a` of this one, its columns reversed alike).
    let mut reversed = vec![0f64; cols * cols];
    for (a, &i) in order.iter().enumerate() {
        let row = &mut reversed[(cols - 1 - a) * cols..(cols - a) * cols];
        for (b, &j) in order.iter().enumerate() {
            row[cols - 1 - b] = h.sum[i * cols + j];
        }
        if diag[i] == 0.0 {
            row[cols - 1 - a] = 1.0;
        }
        row[cols - 1 - a] += damping;
    }
    let u = factor_inverse_upper(reversed, cols).ok_or(GptqError::NotPositiveDefinite)?;

    // The weights transposed into the permuted column order: `wt[a]` is input column `order[a]`,
    // contiguous over the rows, so each step's column and each update are unit-stride.
    let mut wt = vec![0f64; cols * rows];
    for r in 0..rows {
        for (a, &i) in order.iter().enumerate() {
            wt[a * rows + r] = f64::from(w[r * cols + i]);
        }
    }
    let mut codes = vec![0u8; rows * cols];
    let mut errors = vec![0f64; BLOCK * rows];
    for start in (0..cols).step_by(BLOCK) {
        let end = (start + BLOCK).min(cols);
        for a in start..end {
            let d = u[a * cols + a];
            let (done, rest) = wt.split_at_mut((a + 1) * rows);
            let column = &done[a * rows..];
            let err = &mut errors[(a - start) * rows..(a - start + 1) * rows];
            let col = order[a];
            for r in 0..rows {
                let s = scales[r];
                let (code, q) = if s == 0.0 {
                    (0, 0.0)
                } else {
                    let c = format.encode((column[r] / f64::from(s)) as f32);
                    (c, f64::from(format.decode(c)) * f64::from(s))
                };
                codes[r * cols + col] = code;
                err[r] = (column[r] - q) / d;
            }
            // Within the batch: the error flows to each later column at once.
            for b in a + 1..end {
                let coeff = u[a * cols + b];
                let target = &mut rest[(b - a - 1) * rows..(b - a) * rows];
                for (t, e) in target.iter_mut().zip(err.iter()) {
                    *t -= e * coeff;
                }
            }
        }
        if end < cols {
            // Past the batch: wt[end..] −= U[start..end, end..]ᵀ · errors, one product.
            let (m, k) = (cols - end, end - start);
            // SAFETY: lhs element (i, k) = u[(start + k)·cols + end + i] for i < cols − end, k < end −
            // start; rhs element (k, j) = errors[k·rows + j] for j < rows; dst element (i, j) =
            // wt[(end + i)·rows + j]: all inside their buffers, and dst does not overlap the others.
            unsafe {
                gemm::gemm(
                    m, rows, k,
                    wt.as_mut_ptr().add(end * rows), 1, rows as isize,
                    true,
                    u.as_ptr().add(start * cols + end), cols as isize, 1,
                    errors.as_ptr(), 1, rows as isize,
                    1.0, -1.0,
                    false, false, false,
                    gemm::Parallelism::Rayon(0),
                );
            }
        }
    }
    Ok(RowQuantMatrix::from_parts(format, rows, cols, codes, scales)?)
}

/// The upper-triangular `U` with `H⁻¹ = Uᵀ·U` (the Cholesky factor of the inverse GPTQ steps
/// with), for a symmetric positive-definite `H` (`n × n`, row-major); `None` if `H` is not.
///
/// With `P` the index reversal, `P·H·P = L·Lᵀ` gives `H⁻¹ = (P·L⁻¹·P)ᵀ·(P·L⁻¹·P)`, and `P·L⁻¹·P` is
/// upper triangular with a positive diagonal, so it is `U`: one factorization and one triangular
/// inverse, no explicit inverse of `H`.
pub fn inverse_upper_cholesky(h: &[f64], n: usize) -> Option<Vec<f64>> {
    // Reversing both indices of a row-major n × n matrix reverses its flat array.
    let mut reversed = h[..n * n].to_vec();
    reversed.reverse();
    factor_inverse_upper(reversed, n)
}

/// [`inverse_upper_cholesky`] of `P·H·P` given as `reversed` (consumed): two n × n buffers in all,
/// the factor in place and the inverse beside it.
fn factor_inverse_upper(mut reversed: Vec<f64>, n: usize) -> Option<Vec<f64>> {
    cholesky_lower_in_place(&mut reversed, n)?;
    let mut u = lower_inverse(&reversed, n);
    u.reverse();
    Some(u)
}

/// Overwrites the lower triangle of `a` with `L` (`A = L·Lᵀ`) and zeroes the upper one, or returns
/// `None` if `A` is not positive definite.
fn cholesky_lower_in_place(a: &mut [f64], n: usize) -> Option<()> {
    for i in 0..n {
        let (above, rest) = a.split_at_mut(i * n);
        let row = &mut rest[..n];
        for j in 0..i {
            let s = row[j] - dot(&row[..j], &above[j * n..j * n + j]);
            row[j] = s / above[j * n + j];
        }
        let s = row[i] - dot(&row[..i], &row[..i]);
        if !(s > 0.0 && s.is_finite()) {
            return None;
        }
        row[i] = s.sqrt();
        row[i + 1..].fill(0.0);
    }
    Some(())
}

/// `L⁻¹` of a lower-triangular `L` with a nonzero diagonal, by forward substitution row by row
/// (`Y[i] = (eᵢ − Σₖ L[i,k]·Y[k]) / L[i,i]`: each step an update of contiguous rows).
fn lower_inverse(l: &[f64], n: usize) -> Vec<f64> {
    let mut y = vec![0f64; n * n];
    for i in 0..n {
        let (above, row) = y.split_at_mut(i * n);
        let row = &mut row[..n];
        row[i] = 1.0;
        for k in 0..i {
            let c = l[i * n + k];
            if c != 0.0 {
                // Row k of Y is zero past column k.
                for (t, &v) in row[..=k].iter_mut().zip(&above[k * n..k * n + k + 1]) {
                    *t -= c * v;
                }
            }
        }
        let d = l[i * n + i];
        for t in &mut row[..=i] {
            *t /= d;
        }
    }
    y
}

/// A dot product in four running sums (so the compiler vectorizes it).
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut acc = [0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..4 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Inputs with correlated coordinates and uneven energy, as a layer's are.
    fn correlated_inputs(n: usize, d: usize, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mix: Vec<f32> = (0..d * d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut x = vec![0f32; n * d];
        for t in 0..n {
            let z: Vec<f32> = (0..d).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            for j in 0..d {
                let energy = 1.0 + 4.0 * (j % 7 == 0) as u8 as f32;
                x[t * d + j] = energy * (0..d).map(|i| z[i] * mix[i * d + j]).sum::<f32>();
            }
        }
        x
    }

    /// Σ over tokens of |(W − Q)·x|², the layer output's squared error.
    fn output_error(w: &[f32], q: &RowQuantMatrix, x: &[f32], n: usize) -> f64 {
        let (rows, cols) = (q.rows, q.cols);
        let mut deq = vec![0f32; cols];
        let mut total = 0f64;
        for r in 0..rows {
            q.dequantize_row(r, &mut deq);
            for t in 0..n {
                let e: f64 = (0..cols).map(|i| f64::from(w[r * cols + i] - deq[i]) * f64::from(x[t * cols + i])).sum();
                total += e * e;
            }
        }
        total
    }

    #[test]
    fn the_inverse_factor_reproduces_the_inverse() {
        let n = 37;
        let x = correlated_inputs(80, n, 3);
        let mut h = Hessian::new(n);
        h.add(&x, 80);
        let u = inverse_upper_cholesky(&h.sum, n).unwrap();
        // Uᵀ·U·H = I.
        for i in 0..n {
            for j in 0..n {
                assert!(u[i * n + j] == 0.0 || j >= i, "U is upper triangular");
            }
        }
        for i in 0..n {
            for j in 0..n {
                let uu = |a: usize, b: usize| (0..n).map(|k| u[k * n + a] * u[k * n + b]).sum::<f64>();
                let v: f64 = (0..n).map(|k| uu(i, k) * h.sum[k * n + j]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((v - want).abs() < 1e-8, "(UᵀU·H)[{i},{j}] = {v}");
            }
        }
    }

    #[test]
    fn the_hessian_is_the_inputs_second_moment() {
        let x = correlated_inputs(9, 5, 1);
        let mut h = Hessian::new(5);
        h.add(&x[..4 * 5], 4);
        h.add(&x[4 * 5..], 5);
        assert_eq!(h.rows(), 9);
        for i in 0..5 {
            for j in 0..5 {
                let want: f64 = (0..9).map(|t| f64::from(x[t * 5 + i]) * f64::from(x[t * 5 + j])).sum();
                assert!((h.sum[i * 5 + j] - want).abs() < 1e-9 * want.abs().max(1.0));
            }
        }
    }

    #[test]
    fn error_feedback_beats_round_to_nearest_on_the_layers_output() {
        let (rows, cols, n) = (24, 64, 256);
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let x = correlated_inputs(n, cols, 5);
        let mut h = Hessian::new(cols);
        h.add(&x, n);
        for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let nearest = RowQuantMatrix::quantize(format, rows, cols, &w).unwrap();
            let gptq = quantize(format, rows, cols, &w, &h, DEFAULT_DAMP).unwrap();
            // Same scales: only the rounding differs.
            assert_eq!(gptq.scales(), nearest.scales());
            let (e_near, e_gptq) = (output_error(&w, &nearest, &x, n), output_error(&w, &gptq, &x, n));
            assert!(e_gptq < 0.7 * e_near, "{format:?}: GPTQ {e_gptq} vs nearest {e_near}");
        }
    }

    #[test]
    fn uncorrelated_unit_inputs_leave_nearest_rounding() {
        // H = c·I: no column can cancel another's error, so GPTQ is round-to-nearest.
        let (rows, cols) = (5, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut x = vec![0f32; cols * cols];
        for i in 0..cols {
            x[i * cols + i] = 2.0;
        }
        let mut h = Hessian::new(cols);
        h.add(&x, cols);
        for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let want = RowQuantMatrix::quantize(format, rows, cols, &w).unwrap();
            assert_eq!(quantize(format, rows, cols, &w, &h, DEFAULT_DAMP).unwrap(), want);
        }
    }

    #[test]
    fn dead_columns_zero_rows_and_bad_inputs() {
        let (rows, cols) = (3, 6);
        let mut w: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        w[cols..2 * cols].fill(0.0);
        // Column 2 never gets input.
        let mut x = correlated_inputs(20, cols, 4);
        for t in 0..20 {
            x[t * cols + 2] = 0.0;
        }
        let mut h = Hessian::new(cols);
        h.add(&x, 20);
        let q = quantize(RowFormat::Int8, rows, cols, &w, &h, DEFAULT_DAMP).unwrap();
        assert_eq!(q.scales()[1], 0.0);
        assert!(q.codes()[cols..2 * cols].iter().all(|&c| c == 0));
        assert_eq!(
            quantize(RowFormat::Int8, rows, cols, &w, &Hessian::new(5), DEFAULT_DAMP),
            Err(GptqError::Width { expected: 6, found: 5 })
        );
        assert_eq!(quantize(RowFormat::Int8, rows, cols, &w, &Hessian::new(6), DEFAULT_DAMP), Err(GptqError::NoCalibration));
        w[4] = f32::NAN;
        assert!(matches!(quantize(RowFormat::Int8, rows, cols, &w, &h, DEFAULT_DAMP), Err(GptqError::Rows(RowQuantError::NonFinite { row: 0 }))));
    }
}

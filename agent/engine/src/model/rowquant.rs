//! 8-bit weights with one scale per output row (`--quantization fp8|int8`, and pre-quantized FP8
//! checkpoints), and the per-token activation quantization that goes with them (W8A8).
//!
//! - FP8 is OCP E4M3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits, no infinities,
//!   `S.1111.111` is NaN, largest finite value 448, smallest subnormal 2⁻⁹). Conversion from f32
//!   rounds to nearest, ties to even, and saturates at ±448 (as vLLM's quantizers clamp before they
//!   convert), so no finite input becomes NaN.
//! - INT8 is symmetric: codes −127..=127 (−128 unused, so the range is symmetric), ties to even
//!   (the GPU's `cvt.rni`).
//!
//! A row's scale is `max |w| / Q` (Q = 448 or 127): the largest element lands on the format's
//! largest code. Value = `code · scale`. A zero row gets scale 0 and zero codes.
//!
//! The matmul keeps the codes unscaled and applies `token scale · row scale` to each output once
//! (the GPU's GEMM epilogue does the same), so the CPU computes what the 8-bit GEMM computes:
//! products of 8-bit values, summed, then scaled.

use std::sync::LazyLock;

/// The 8-bit format of a [`RowQuantMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowFormat {
    /// OCP E4M3 codes.
    Fp8E4m3,
    /// Symmetric int8 codes (two's complement bytes).
    Int8,
}

impl RowFormat {
    /// The largest code magnitude: a row's (or token's) max |value| maps to it.
    pub fn max_code(self) -> f32 {
        match self {
            RowFormat::Fp8E4m3 => E4M3_MAX,
            RowFormat::Int8 => 127.0,
        }
    }

    /// The code nearest to `v` (already divided by its scale).
    #[inline]
    pub fn encode(self, v: f32) -> u8 {
        match self {
            RowFormat::Fp8E4m3 => e4m3_from_f32(v),
            RowFormat::Int8 => v.round_ties_even().clamp(-127.0, 127.0) as i8 as u8,
        }
    }

    /// The value of a code (unscaled).
    #[inline(always)]
    pub fn decode(self, code: u8) -> f32 {
        match self {
            RowFormat::Fp8E4m3 => E4M3_TABLE[code as usize],
            RowFormat::Int8 => code as i8 as f32,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RowFormat::Fp8E4m3 => "fp8",
            RowFormat::Int8 => "int8",
        }
    }
}

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// E4M3 code → f32 (NaN for the two NaN codes), by the format's definition.
static E4M3_TABLE: LazyLock<[f32; 256]> = LazyLock::new(|| {
    let mut t = [0f32; 256];
    for (code, v) in t.iter_mut().enumerate() {
        *v = e4m3_to_f32(code as u8);
    }
    t
});

/// Decodes one E4M3 code by the OCP definition.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((code >> 3) & 0x0F) as i32;
    let man = (code & 0x07) as f32;
    if exp == 0x0F && code & 0x07 == 0x07 {
        return f32::NAN;
    }
    let mag = if exp == 0 {
        man / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

/// f32 → E4M3: round to nearest, ties to even; saturates at ±448; NaN → NaN code `0x7F`/`0xFF`.
pub fn e4m3_from_f32(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    if v.is_nan() {
        return sign | 0x7F;
    }
    let a = v.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Below the smallest normal (2⁻⁶) the grid is uniform in steps of 2⁻⁹: the code is the number of
    // steps (8 steps is the smallest normal, code 0x08, so the carry lands right).
    if a < 2f32.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: keep 3 of f32's 23 mantissa bits, ties to even; a carry into the exponent is the
    // next binade's code, as wanted. Rebias the exponent from 127 to 7.
    let bits = a.to_bits();
    let drop = 20;
    let half = 1u32 << (drop - 1);
    let lsb = (bits >> drop) & 1;
    let rounded = (bits + half - 1 + lsb) >> drop; // exponent(8) | mantissa(3)
    let code = rounded - ((127 - 7) << 3);
    // `a < 448` rounds to at most 448 (0x7E).
    sign | code.min(0x7E) as u8
}

/// Per-token scales and codes of `n` activation rows of width `k`, returned as the codes' f32 values
/// (unscaled) and one scale per token: what a kernel that quantizes activations on the fly produces.
pub fn quantize_activations(format: RowFormat, x: &[f32], n: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let mut values = vec![0f32; n * k];
    let mut scales = vec![0f32; n];
    for ((row, out), scale) in x.chunks_exact(k).zip(values.chunks_exact_mut(k)).zip(&mut scales) {
        *scale = quantize_row_into(format, row, |i, c| out[i] = format.decode(c));
    }
    (values, scales)
}

/// Quantizes one row: calls `put(i, code)` for each element, returns the scale (0 for a row of
/// zeros or one with a non-finite maximum; callers that must refuse those check first).
#[inline]
pub(crate) fn quantize_row_into(format: RowFormat, row: &[f32], mut put: impl FnMut(usize, u8)) -> f32 {
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        for i in 0..row.len() {
            put(i, 0);
        }
        return 0.0;
    }
    let scale = amax / format.max_code();
    for (i, &v) in row.iter().enumerate() {
        put(i, format.encode(v / scale));
    }
    scale
}

/// Why a matrix could not be quantized or assembled.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RowQuantError {
    #[error("row {row} holds a non-finite value (inf or NaN): cannot quantize")]
    NonFinite { row: usize },
    #[error("{what}: {found} values, expected {expected}")]
    Size {
        what: &'static str,
        expected: usize,
        found: usize,
    },
    #[error("scale of row {row} is {value}: scales must be finite and ≥ 0")]
    BadScale { row: usize, value: f32 },
}

/// What the matmul does with the activations a row-quantized matrix multiplies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// Quantized to the weights' format, one scale per token (W8A8; what `--quantization` does).
    #[default]
    PerToken,
    /// Left in floating point (W8A16: only the weights are 8-bit; for comparisons).
    Float,
}

/// A row-major `rows × cols` matrix of 8-bit codes with one f32 scale per row.
#[derive(Debug, Clone, PartialEq)]
pub struct RowQuantMatrix {
    pub format: RowFormat,
    pub rows: usize,
    pub cols: usize,
    /// How the matmul treats the activations (per token by default).
    pub activations: Activations,
    scales: Vec<f32>,
    codes: Vec<u8>,
}

impl RowQuantMatrix {
    /// Quantizes f32 weights (`rows × cols`, row-major) row by row.
    pub fn quantize(format: RowFormat, rows: usize, cols: usize, w: &[f32]) -> Result<Self, RowQuantError> {
        let n = rows.saturating_mul(cols);
        if w.len() != n {
            return Err(RowQuantError::Size { what: "weights", expected: n, found: w.len() });
        }
        let mut codes = vec![0u8; n];
        let mut scales = Vec::with_capacity(rows);
        if cols > 0 {
            for (r, (row, out)) in w.chunks_exact(cols).zip(codes.chunks_exact_mut(cols)).enumerate() {
                if row.iter().any(|v| !v.is_finite()) {
                    return Err(RowQuantError::NonFinite { row: r });
                }
                scales.push(quantize_row_into(format, row, |i, c| out[i] = c));
            }
        } else {
            scales.resize(rows, 0.0);
        }
        Ok(RowQuantMatrix { format, rows, cols, activations: Activations::PerToken, scales, codes })
    }

    /// Quantizes with one scale for the whole tensor (the common recipe row-wise scales improve on;
    /// kept for comparisons): stored as equal per-row scales.
    pub fn quantize_per_tensor(format: RowFormat, rows: usize, cols: usize, w: &[f32]) -> Result<Self, RowQuantError> {
        let n = rows.saturating_mul(cols);
        if w.len() != n {
            return Err(RowQuantError::Size { what: "weights", expected: n, found: w.len() });
        }
        if let Some(i) = w.iter().position(|v| !v.is_finite()) {
            return Err(RowQuantError::NonFinite { row: i / cols.max(1) });
        }
        let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if amax == 0.0 { 0.0 } else { amax / format.max_code() };
        let codes = w.iter().map(|&v| if scale == 0.0 { 0 } else { format.encode(v / scale) }).collect();
        Ok(RowQuantMatrix { format, rows, cols, activations: Activations::PerToken, scales: vec![scale; rows], codes })
    }

    /// Codes and scales as stored by a checkpoint (`scales.len() == rows`).
    pub fn from_parts(
        format: RowFormat,
        rows: usize,
        cols: usize,
        codes: Vec<u8>,
        scales: Vec<f32>,
    ) -> Result<Self, RowQuantError> {
        let n = rows.saturating_mul(cols);
        if codes.len() != n {
            return Err(RowQuantError::Size { what: "codes", expected: n, found: codes.len() });
        }
        if scales.len() != rows {
            return Err(RowQuantError::Size { what: "row scales", expected: rows, found: scales.len() });
        }
        if let Some((row, &value)) = scales.iter().enumerate().find(|(_, s)| !(s.is_finite() && **s >= 0.0)) {
            return Err(RowQuantError::BadScale { row, value });
        }
        Ok(RowQuantMatrix { format, rows, cols, activations: Activations::PerToken, scales, codes })
    }

    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    pub fn codes(&self) -> &[u8] {
        &self.codes
    }

    /// Row `r`'s code values, unscaled, into `out[..cols]`.
    #[inline(always)]
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let codes = &self.codes[r * self.cols..(r + 1) * self.cols];
        for (o, &c) in out[..self.cols].iter_mut().zip(codes) {
            *o = self.format.decode(c);
        }
    }

    /// Row `r` dequantized (`code · scale`) into `out[..cols]`.
    #[inline(always)]
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        self.decode_row(r, out);
        let s = self.scales[r];
        for o in &mut out[..self.cols] {
            *o *= s;
        }
    }

    /// Reorders rows: new row `i` is old row `perm[i]`.
    pub fn permute_rows(&self, perm: &[usize]) -> RowQuantMatrix {
        let mut codes = Vec::with_capacity(self.codes.len());
        let mut scales = Vec::with_capacity(self.scales.len());
        for &src in perm {
            codes.extend_from_slice(&self.codes[src * self.cols..(src + 1) * self.cols]);
            scales.push(self.scales[src]);
        }
        RowQuantMatrix { format: self.format, rows: perm.len(), cols: self.cols, activations: self.activations, scales, codes }
    }

    /// The sub-matrix of `rows` × `cols`. Each row keeps its own scale, so every element
    /// dequantizes to exactly its value in `self`. None if a range runs past the matrix.
    pub fn slice(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Option<RowQuantMatrix> {
        if rows.start > rows.end || rows.end > self.rows || cols.start > cols.end || cols.end > self.cols {
            return None;
        }
        let mut codes = Vec::with_capacity(rows.len() * cols.len());
        for r in rows.clone() {
            codes.extend_from_slice(&self.codes[r * self.cols + cols.start..r * self.cols + cols.end]);
        }
        Some(RowQuantMatrix {
            format: self.format,
            rows: rows.len(),
            cols: cols.len(),
            activations: self.activations,
            scales: self.scales[rows].to_vec(),
            codes,
        })
    }

    /// Stacks matrices of one format and width (rows of `parts[0]` first); None if they differ.
    pub fn concat_rows(parts: &[&RowQuantMatrix]) -> Option<RowQuantMatrix> {
        let first = parts.first()?;
        if parts.iter().any(|p| p.format != first.format || p.cols != first.cols || p.activations != first.activations) {
            return None;
        }
        Some(RowQuantMatrix {
            format: first.format,
            activations: first.activations,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            scales: parts.iter().flat_map(|p| p.scales.iter().copied()).collect(),
            codes: parts.iter().flat_map(|p| p.codes.iter().copied()).collect(),
        })
    }

    /// Bytes held in memory.
    pub fn size_bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite E4M3 value, by brute force from the definition (the reference for rounding).
    fn finite_values() -> Vec<(u8, f32)> {
        (0u8..=255).filter(|&c| c & 0x7F != 0x7F).map(|c| (c, e4m3_to_f32(c))).collect()
    }

    /// The nearest finite E4M3 code by exhaustive search; ties to the even code (mantissa lsb 0).
    fn nearest(v: f32) -> u8 {
        let clamped = v.clamp(-E4M3_MAX, E4M3_MAX) as f64;
        let mut best: Option<(f64, u8)> = None;
        for (c, x) in finite_values() {
            // Both zeros: keep the one with v's sign.
            if x == 0.0 && (c & 0x80 != 0) != v.is_sign_negative() {
                continue;
            }
            let d = (x as f64 - clamped).abs();
            best = match best {
                None => Some((d, c)),
                Some((bd, bc)) if d < bd || (d == bd && c & 1 == 0 && bc & 1 == 1) => Some((d, c)),
                keep => keep,
            };
        }
        best.map(|b| b.1).unwrap_or(0)
    }

    #[test]
    fn e4m3_table_matches_the_ocp_spec_points() {
        // OCP 8-bit floating point spec, E4M3 column.
        assert_eq!(e4m3_to_f32(0x7E), 448.0, "max normal S.1111.110");
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6), "min normal S.0001.000");
        assert_eq!(e4m3_to_f32(0x07), 0.875 * 2f32.powi(-6), "max subnormal S.0000.111");
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9), "min subnormal S.0000.001");
        assert_eq!(e4m3_to_f32(0x38), 1.0, "one: exponent 7 = bias");
        assert_eq!(e4m3_to_f32(0x80), 0.0);
        assert!(e4m3_to_f32(0x80).is_sign_negative());
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        // 126 distinct positive finite values (zero included), strictly increasing with the code.
        let pos: Vec<f32> = (0u8..0x7F).map(e4m3_to_f32).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]));
        for c in 0u8..=255 {
            assert_eq!(RowFormat::Fp8E4m3.decode(c).to_bits(), e4m3_to_f32(c).to_bits(), "table code {c:#x}");
        }
    }

    #[test]
    fn e4m3_encoding_is_round_to_nearest_even_with_saturation() {
        let vals = finite_values();
        // Every code round-trips.
        for &(c, x) in &vals {
            assert_eq!(e4m3_from_f32(x), c, "code {c:#x} ({x})");
        }
        // Midpoints between neighbours (ties → even code) and one f32 step either side of them.
        let mut pos: Vec<f32> = vals.iter().map(|v| v.1).filter(|v| *v >= 0.0).collect();
        pos.sort_by(f32::total_cmp);
        pos.dedup();
        for w in pos.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for v in [mid, f32::from_bits(mid.to_bits() - 1), f32::from_bits(mid.to_bits() + 1)] {
                for s in [v, -v] {
                    assert_eq!(e4m3_from_f32(s), nearest(s), "{s}");
                }
            }
        }
        // A dense log-spaced sweep over the whole range and beyond.
        let mut v = 1e-5f32;
        while v < 2000.0 {
            assert_eq!(e4m3_from_f32(v), nearest(v), "{v}");
            assert_eq!(e4m3_from_f32(-v), nearest(-v), "{}", -v);
            v *= 1.0007;
        }
        // Saturation, NaN, infinities, tiny values.
        assert_eq!(e4m3_from_f32(1e9), 0x7E);
        assert_eq!(e4m3_from_f32(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_from_f32(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_from_f32(464.0), 0x7E, "above 448 saturates instead of rounding to NaN");
        assert_eq!(e4m3_from_f32(f32::NAN) & 0x7F, 0x7F);
        assert_eq!(e4m3_from_f32(2f32.powi(-11)), 0x00, "below half the smallest subnormal → 0");
        assert_eq!(e4m3_from_f32(2f32.powi(-10)), 0x00, "exactly half: tie to even (0)");
        assert_eq!(e4m3_from_f32(3.0 * 2f32.powi(-10)), 0x02, "1.5 steps: tie to even (2)");
        assert_eq!(e4m3_from_f32(-0.0), 0x80);
    }

    #[test]
    fn int8_codes_round_ties_to_even_and_clamp() {
        let f = RowFormat::Int8;
        assert_eq!(f.encode(2.5) as i8, 2);
        assert_eq!(f.encode(3.5) as i8, 4);
        assert_eq!(f.encode(-2.5) as i8, -2);
        assert_eq!(f.encode(127.4) as i8, 127);
        assert_eq!(f.encode(-300.0) as i8, -127, "−128 is never used");
        assert_eq!(f.decode(0x81), -127.0);
    }

    #[test]
    fn row_scales_map_each_rows_max_to_the_largest_code() {
        #[rustfmt::skip]
        let w = [
            1.0, -2.0, 0.5, 4.0,
            0.0, 0.0, 0.0, 0.0,
            -0.03, 0.01, 0.02, 0.0,
        ];
        for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let q = RowQuantMatrix::quantize(format, 3, 4, &w).unwrap();
            let qmax = format.max_code();
            assert_eq!(q.scales(), &[4.0 / qmax, 0.0, 0.03 / qmax]);
            let mut row = [0f32; 4];
            q.decode_row(0, &mut row);
            assert_eq!(row[3], qmax, "{format:?}: the max lands on the top code");
            q.dequantize_row(1, &mut row);
            assert_eq!(row, [0.0; 4], "{format:?}: a zero row stays zero");
            // Dequantized values are within half a step of the weights: int8's step is the scale;
            // e4m3 keeps 3 mantissa bits, so a relative error ≤ 2⁻⁴ (above the subnormals).
            for r in [0, 2] {
                q.dequantize_row(r, &mut row);
                for (c, (&got, &want)) in row.iter().zip(&w[r * 4..r * 4 + 4]).enumerate() {
                    let bound = match format {
                        RowFormat::Int8 => q.scales()[r] / 2.0 * 1.0001,
                        RowFormat::Fp8E4m3 => want.abs() / 16.0 + q.scales()[r] * 2f32.powi(-10),
                    };
                    assert!((got - want).abs() <= bound, "{format:?} [{r},{c}]: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn per_tensor_scale_is_the_tensors_max() {
        let w = [1.0, -2.0, 0.5, 4.0, 0.0, 0.0, -0.03, 0.01];
        for format in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let q = RowQuantMatrix::quantize_per_tensor(format, 4, 2, &w).unwrap();
            assert_eq!(q.scales(), &[4.0 / format.max_code(); 4]);
            let mut row = [0f32; 2];
            q.decode_row(1, &mut row);
            assert_eq!(row[1], format.max_code());
            for (i, &v) in w.iter().enumerate() {
                assert_eq!(q.codes()[i], format.encode(v / q.scales()[0]));
            }
        }
        let z = RowQuantMatrix::quantize_per_tensor(RowFormat::Int8, 1, 2, &[0.0, 0.0]).unwrap();
        assert_eq!((z.scales(), z.codes()), (&[0.0][..], &[0u8, 0][..]));
    }

    #[test]
    fn non_finite_weights_and_bad_parts_are_errors() {
        let w = [1.0, f32::NAN, 0.0, 1.0];
        assert_eq!(
            RowQuantMatrix::quantize(RowFormat::Int8, 2, 2, &w),
            Err(RowQuantError::NonFinite { row: 0 })
        );
        assert!(matches!(
            RowQuantMatrix::quantize(RowFormat::Int8, 2, 3, &w),
            Err(RowQuantError::Size { .. })
        ));
        assert!(matches!(
            RowQuantMatrix::from_parts(RowFormat::Fp8E4m3, 2, 2, vec![0; 4], vec![1.0]),
            Err(RowQuantError::Size { what: "row scales", .. })
        ));
        assert!(matches!(
            RowQuantMatrix::from_parts(RowFormat::Fp8E4m3, 2, 2, vec![0; 4], vec![1.0, -1.0]),
            Err(RowQuantError::BadScale { row: 1, .. })
        ));
    }

    #[test]
    fn activations_get_one_scale_per_token() {
        let x = [0.5, -1.0, 0.25, 0.0, 0.0, 0.0];
        let (v, s) = quantize_activations(RowFormat::Int8, &x, 2, 3);
        assert_eq!(s, vec![1.0 / 127.0, 0.0]);
        assert_eq!(&v[..3], &[64.0, -127.0, 32.0], "63.5 → 64 (tie to even), 31.75 → 32");
        assert_eq!(&v[3..], &[0.0; 3]);
        let (v, s) = quantize_activations(RowFormat::Fp8E4m3, &x, 2, 3);
        assert_eq!(s[0], 1.0 / 448.0);
        assert_eq!(&v[..3], &[224.0, -448.0, 112.0]);
    }

    #[test]
    fn permute_and_concat_keep_rows_with_their_scales() {
        let w: Vec<f32> = (0..12).map(|i| i as f32 - 5.5).collect();
        let q = RowQuantMatrix::quantize(RowFormat::Fp8E4m3, 3, 4, &w).unwrap();
        let p = q.permute_rows(&[2, 0, 1]);
        let (mut a, mut b) = ([0f32; 4], [0f32; 4]);
        p.dequantize_row(0, &mut a);
        q.dequantize_row(2, &mut b);
        assert_eq!(a, b);
        let c = RowQuantMatrix::concat_rows(&[&q, &p]).unwrap();
        assert_eq!(c.rows, 6);
        c.dequantize_row(3, &mut a);
        assert_eq!(a, b);
        let other = RowQuantMatrix::quantize(RowFormat::Int8, 3, 4, &w).unwrap();
        assert!(RowQuantMatrix::concat_rows(&[&q, &other]).is_none());
    }
}

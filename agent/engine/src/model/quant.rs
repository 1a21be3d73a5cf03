//! Dequantization of ggml blocks to f32, value for value as ggml and gguf-py compute them.
//!
//! Block layouts (little-endian):
//! - Q8_0: f16 `d`, 32 × i8 `q`; value `d * q`.
//! - Q4_0: f16 `d`, 16 bytes; element `j` is the low nibble of byte `j`, element `j + 16` its high
//!   nibble; value `d * (q - 8)`.
//! - Q4_1: f16 `d`, f16 `m`, 16 bytes (nibbles as Q4_0); value `d * q + m` (multiply, then add: two
//!   roundings, as numpy does, so no fused multiply-add here).
//!
//! For the matmul kernels a quantized matrix is repacked ([`QuantMatrix`]): the f16 scales are
//! converted to f32 once (exactly), so a kernel never converts f16 in its inner loop.

use half::{bf16, f16};

use super::ggml_type::GgmlType;

pub const QK: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("tensor type {0} is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
    Unsupported(GgmlType),
    #[error("{ty} data for {n_elements} elements should be {expected} bytes, found {found}")]
    Size {
        ty: GgmlType,
        n_elements: usize,
        expected: usize,
        found: usize,
    },
}

fn expected_bytes(ty: GgmlType, n_elements: usize) -> Result<usize, QuantError> {
    let (block, size) = match ty {
        GgmlType::F32
        | GgmlType::F16
        | GgmlType::BF16
        | GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q4_1 => ty.block_geometry().ok_or(QuantError::Unsupported(ty))?,
        other => return Err(QuantError::Unsupported(other)),
    };
    if !n_elements.is_multiple_of(block) {
        return Err(QuantError::Size {
            ty,
            n_elements,
            expected: 0,
            found: 0,
        });
    }
    // A claimed element count can be anything: overflow is a size error, not a wrap or a panic.
    (n_elements / block).checked_mul(size).ok_or(QuantError::Size { ty, n_elements, expected: 0, found: 0 })
}

/// Dequantizes `bytes` (exactly `n_elements` elements of type `ty`) to f32.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>, QuantError> {
    // The element count comes from a file's shape: the bytes must confirm it before it sizes an
    // allocation (a header claiming 2^40 elements over 8 bytes is an error, not an abort).
    let expected = expected_bytes(ty, n_elements)?;
    if bytes.len() != expected {
        return Err(QuantError::Size { ty, n_elements, expected, found: bytes.len() });
    }
    let mut out = vec![0f32; n_elements];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// Dequantizes into `out`, whose length is the element count.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let expected = expected_bytes(ty, out.len())?;
    if bytes.len() != expected {
        return Err(QuantError::Size {
            ty,
            n_elements: out.len(),
            expected,
            found: bytes.len(),
        });
    }
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(34)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                q8_0_block(d, &b[2..34], o);
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(18)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                q4_0_block(d, &b[2..18], o);
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(bytes.chunks_exact(20)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                q4_1_block(d, m, &b[4..20], o);
            }
        }
        other => return Err(QuantError::Unsupported(other)),
    }
    Ok(())
}

#[inline(always)]
fn q8_0_block(d: f32, qs: &[u8], out: &mut [f32]) {
    for (o, &q) in out[..QK].iter_mut().zip(&qs[..QK]) {
        *o = d * (q as i8) as f32;
    }
}

#[inline(always)]
fn q4_0_block(d: f32, qs: &[u8], out: &mut [f32]) {
    let (lo, hi) = out[..QK].split_at_mut(QK / 2);
    for j in 0..QK / 2 {
        lo[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        hi[j] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

#[inline(always)]
fn q4_1_block(d: f32, m: f32, qs: &[u8], out: &mut [f32]) {
    let (lo, hi) = out[..QK].split_at_mut(QK / 2);
    for j in 0..QK / 2 {
        lo[j] = d * (qs[j] & 0x0F) as f32 + m;
        hi[j] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// Which block format a [`QuantMatrix`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl QuantKind {
    pub fn from_ggml(ty: GgmlType) -> Option<QuantKind> {
        match ty {
            GgmlType::Q8_0 => Some(QuantKind::Q8_0),
            GgmlType::Q4_0 => Some(QuantKind::Q4_0),
            GgmlType::Q4_1 => Some(QuantKind::Q4_1),
            _ => None,
        }
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            QuantKind::Q8_0 => GgmlType::Q8_0,
            QuantKind::Q4_0 => GgmlType::Q4_0,
            QuantKind::Q4_1 => GgmlType::Q4_1,
        }
    }

    /// Bytes of quant payload per block (without scales).
    fn payload(self) -> usize {
        match self {
            QuantKind::Q8_0 => 32,
            QuantKind::Q4_0 | QuantKind::Q4_1 => 16,
        }
    }
}

/// A row-major quantized matrix, repacked: per block an f32 scale `d` (and `m` for Q4_1) and the raw
/// payload. Rows never share blocks, so rows can be reordered or sliced freely.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantMatrix {
    pub kind: QuantKind,
    pub rows: usize,
    pub cols: usize,
    d: Vec<f32>,
    m: Vec<f32>,
    qs: Vec<u8>,
}

impl QuantMatrix {
    /// Repacks `rows × cols` elements of ggml blocks (`cols` a multiple of 32).
    pub fn from_ggml(
        ty: GgmlType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<QuantMatrix, QuantError> {
        let kind = QuantKind::from_ggml(ty).ok_or(QuantError::Unsupported(ty))?;
        let n = rows.checked_mul(cols).ok_or(QuantError::Size {
            ty,
            n_elements: usize::MAX,
            expected: 0,
            found: bytes.len(),
        })?;
        if !cols.is_multiple_of(QK) {
            return Err(QuantError::Size {
                ty,
                n_elements: n,
                expected: 0,
                found: bytes.len(),
            });
        }
        let expected = expected_bytes(ty, n)?;
        if bytes.len() != expected {
            return Err(QuantError::Size {
                ty,
                n_elements: n,
                expected,
                found: bytes.len(),
            });
        }
        let n_blocks = n / QK;
        let payload = kind.payload();
        let mut d = Vec::with_capacity(n_blocks);
        let mut m = Vec::with_capacity(if kind == QuantKind::Q4_1 { n_blocks } else { 0 });
        let mut qs = Vec::with_capacity(n_blocks * payload);
        let block_bytes = ty.block_geometry().map(|g| g.1).unwrap_or(0);
        for b in bytes.chunks_exact(block_bytes) {
            d.push(f16::from_le_bytes([b[0], b[1]]).to_f32());
            let head = if kind == QuantKind::Q4_1 {
                m.push(f16::from_le_bytes([b[2], b[3]]).to_f32());
                4
            } else {
                2
            };
            qs.extend_from_slice(&b[head..head + payload]);
        }
        Ok(QuantMatrix {
            kind,
            rows,
            cols,
            d,
            m,
            qs,
        })
    }

    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }

    /// Reorders rows: new row `i` is old row `perm[i]`.
    pub fn permute_rows(&self, perm: &[usize]) -> QuantMatrix {
        let bpr = self.blocks_per_row();
        let payload = self.kind.payload();
        let mut out = QuantMatrix {
            kind: self.kind,
            rows: self.rows,
            cols: self.cols,
            d: Vec::with_capacity(self.d.len()),
            m: Vec::with_capacity(self.m.len()),
            qs: Vec::with_capacity(self.qs.len()),
        };
        for &src in perm {
            out.d.extend_from_slice(&self.d[src * bpr..(src + 1) * bpr]);
            if !self.m.is_empty() {
                out.m.extend_from_slice(&self.m[src * bpr..(src + 1) * bpr]);
            }
            out.qs
                .extend_from_slice(&self.qs[src * bpr * payload..(src + 1) * bpr * payload]);
        }
        out
    }

    /// The sub-matrix of `rows` and of the whole blocks `blocks` of each row (columns
    /// `blocks.start * 32 .. blocks.end * 32`): blocks are copied as they are, so every element
    /// dequantizes to exactly its value in `self`. None if a range runs past the matrix.
    pub fn slice(&self, rows: std::ops::Range<usize>, blocks: std::ops::Range<usize>) -> Option<QuantMatrix> {
        let bpr = self.blocks_per_row();
        if rows.start > rows.end || rows.end > self.rows || blocks.start > blocks.end || blocks.end > bpr {
            return None;
        }
        let payload = self.kind.payload();
        let (nr, nb) = (rows.len(), blocks.len());
        let mut out = QuantMatrix {
            kind: self.kind,
            rows: nr,
            cols: nb * QK,
            d: Vec::with_capacity(nr * nb),
            m: Vec::with_capacity(if self.m.is_empty() { 0 } else { nr * nb }),
            qs: Vec::with_capacity(nr * nb * payload),
        };
        for r in rows {
            let (b0, b1) = (r * bpr + blocks.start, r * bpr + blocks.end);
            out.d.extend_from_slice(&self.d[b0..b1]);
            if !self.m.is_empty() {
                out.m.extend_from_slice(&self.m[b0..b1]);
            }
            out.qs.extend_from_slice(&self.qs[b0 * payload..b1 * payload]);
        }
        Some(out)
    }

    /// Stacks matrices of the same kind and width (rows of `parts[0]` first); None if they differ.
    pub fn concat_rows(parts: &[&QuantMatrix]) -> Option<QuantMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.kind != first.kind || p.cols != first.cols)
        {
            return None;
        }
        Some(QuantMatrix {
            kind: first.kind,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            d: parts.iter().flat_map(|p| p.d.iter().copied()).collect(),
            m: parts.iter().flat_map(|p| p.m.iter().copied()).collect(),
            qs: parts.iter().flat_map(|p| p.qs.iter().copied()).collect(),
        })
    }

    /// Dequantizes row `r` into `out` (`cols` long). Inlined so that callers compiled with wider
    /// SIMD features vectorize it.
    #[inline(always)]
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bpr = self.blocks_per_row();
        let payload = self.kind.payload();
        let base = r * bpr;
        let qs = &self.qs[base * payload..(base + bpr) * payload];
        let d = &self.d[base..base + bpr];
        let out = &mut out[..self.cols];
        match self.kind {
            QuantKind::Q8_0 => {
                for ((o, q), &d) in out
                    .chunks_exact_mut(QK)
                    .zip(qs.chunks_exact(payload))
                    .zip(d)
                {
                    q8_0_block(d, q, o);
                }
            }
            QuantKind::Q4_0 => {
                for ((o, q), &d) in out
                    .chunks_exact_mut(QK)
                    .zip(qs.chunks_exact(payload))
                    .zip(d)
                {
                    q4_0_block(d, q, o);
                }
            }
            QuantKind::Q4_1 => {
                let m = &self.m[base..base + bpr];
                for (((o, q), &d), &m) in out
                    .chunks_exact_mut(QK)
                    .zip(qs.chunks_exact(payload))
                    .zip(d)
                    .zip(m)
                {
                    q4_1_block(d, m, q, o);
                }
            }
        }
    }

    /// The repacked storage for SIMD kernels: per-block `d`, per-block `m` (Q4_1 only, else
    /// empty), and the payload (`payload_bytes()` per block), all in row-major block order.
    pub fn raw(&self) -> (&[f32], &[f32], &[u8]) {
        (&self.d, &self.m, &self.qs)
    }

    pub fn payload_bytes(&self) -> usize {
        self.kind.payload()
    }

    /// Bytes held in memory.
    pub fn size_bytes(&self) -> usize {
        4 * (self.d.len() + self.m.len()) + self.qs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_block_layout_and_formula() {
        // d = 0.5, m = -1.0; byte j holds element j (low nibble) and j+16 (high nibble).
        let mut block = Vec::new();
        block.extend_from_slice(&f16::from_f32(0.5).to_le_bytes());
        block.extend_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16u8 {
            block.push(j | ((15 - j) << 4));
        }
        let out = dequantize(GgmlType::Q4_1, &block, 32).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 1.0);
            assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 1.0);
        }
        let qm = QuantMatrix::from_ggml(GgmlType::Q4_1, &block, 1, 32).unwrap();
        let mut row = vec![0f32; 32];
        qm.dequantize_row(0, &mut row);
        assert_eq!(row, out);
    }

    #[test]
    fn q4_0_and_q8_0_formulas() {
        let mut block = f16::from_f32(2.0).to_le_bytes().to_vec();
        block.extend((0..16u8).map(|j| j | (j << 4)));
        let out = dequantize(GgmlType::Q4_0, &block, 32).unwrap();
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16 + 15], 14.0);
        let mut block = f16::from_f32(0.25).to_le_bytes().to_vec();
        block.extend((0..32).map(|j: i32| (j - 16) as i8 as u8));
        let out = dequantize(GgmlType::Q8_0, &block, 32).unwrap();
        assert_eq!(out[0], -4.0);
        assert_eq!(out[31], 3.75);
    }

    #[test]
    fn unsupported_and_bad_sizes_are_errors() {
        assert!(matches!(
            dequantize(GgmlType::Q4K, &[0; 144], 256),
            Err(QuantError::Unsupported(_))
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_1, &[0; 19], 32),
            Err(QuantError::Size { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::F16, &[0; 3], 2),
            Err(QuantError::Size { .. })
        ));
    }
}

//! Cutting one matrix into a rank's slice, in the format it is stored in: f32 (bf16 and f16 files
//! are f32 in memory), GGUF blocks (Q8_0/Q4_0/Q4_1) and row-quantized 8-bit (fp8/int8 with one
//! scale per row). A slice holds exactly the values of its part of the whole: blocks and codes are
//! copied, never requantized.

use std::ops::Range;

use crate::model::quant::QK;
use crate::model::{Matrix, MatrixData};

/// The rows `rows` (output features) of `m`, all columns. Any format splits on any row.
pub fn slice_rows(m: &Matrix, rows: Range<usize>) -> Result<Matrix, String> {
    slice(m, rows, 0..m.cols)
}

/// The columns `cols` (input features) of `m`, all rows. A GGUF-block matrix splits only at block
/// boundaries (multiples of 32 columns): a block has one scale for its 32 values, so cutting one
/// would change what the other half dequantizes to. A row-quantized matrix keeps each row's scale.
pub fn slice_cols(m: &Matrix, cols: Range<usize>) -> Result<Matrix, String> {
    slice(m, 0..m.rows, cols)
}

fn slice(m: &Matrix, rows: Range<usize>, cols: Range<usize>) -> Result<Matrix, String> {
    if rows.start > rows.end || rows.end > m.rows || cols.start > cols.end || cols.end > m.cols {
        return Err(format!(
            "rows {rows:?} × columns {cols:?} fall outside the [{}, {}] matrix",
            m.rows, m.cols
        ));
    }
    match &m.data {
        MatrixData::F32(v) => {
            let mut out = Vec::with_capacity(rows.len() * cols.len());
            for r in rows.clone() {
                out.extend_from_slice(&v[r * m.cols + cols.start..r * m.cols + cols.end]);
            }
            Ok(Matrix::from_f32(rows.len(), cols.len(), out))
        }
        MatrixData::Quant(q) => {
            if !cols.start.is_multiple_of(QK) || !cols.end.is_multiple_of(QK) {
                return Err(format!(
                    "columns {cols:?} do not fall on {QK}-value {:?} block boundaries (a block cannot be split)",
                    q.kind
                ));
            }
            q.slice(rows, cols.start / QK..cols.end / QK)
                .map(Matrix::from_quant)
                .ok_or_else(|| "block range outside the matrix".to_string())
        }
        MatrixData::RowQuant(q) => q
            .slice(rows, cols)
            .map(Matrix::from_row_quant)
            .ok_or_else(|| "range outside the matrix".to_string()),
    }
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::model::quant::QuantMatrix;
    use crate::model::rowquant::{RowFormat, RowQuantMatrix};
    use crate::model::GgmlType;

    /// `rows × cols` values that differ everywhere (a misplaced copy shows).
    fn values(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0).collect()
    }

    /// The expected slice, cut from the dequantized whole.
    fn cut(full: &[f32], cols: usize, rows: Range<usize>, c: Range<usize>) -> Vec<f32> {
        rows.flat_map(|r| full[r * cols + c.start..r * cols + c.end].to_vec()).collect()
    }

    /// GGUF bytes of `rows × cols` (`cols` a multiple of 32) with a distinct scale (and min) per block.
    fn ggml_bytes(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for b in 0..rows * cols / QK {
            out.extend_from_slice(&f16::from_f32(0.25 + b as f32 / 8.0).to_le_bytes());
            match ty {
                GgmlType::Q8_0 => out.extend((0..QK).map(|j| ((j * 7 + b) % 255) as u8)),
                GgmlType::Q4_0 => out.extend((0..QK / 2).map(|j| ((j * 5 + b) % 256) as u8)),
                _ => {
                    out.extend_from_slice(&f16::from_f32(-(b as f32) / 4.0).to_le_bytes());
                    out.extend((0..QK / 2).map(|j| ((j * 11 + b) % 256) as u8));
                }
            }
        }
        out
    }

    fn check_every_cut(m: &Matrix) {
        let full = m.to_f32();
        let (rows, cols) = (m.rows, m.cols);
        let r = slice_rows(m, 1..rows - 1).unwrap();
        assert_eq!((r.rows, r.cols), (rows - 2, cols));
        assert_eq!(r.to_f32(), cut(&full, cols, 1..rows - 1, 0..cols));
        let c = slice_cols(m, 32..cols).unwrap();
        assert_eq!((c.rows, c.cols), (rows, cols - 32));
        assert_eq!(c.to_f32(), cut(&full, cols, 0..rows, 32..cols), "values unchanged by the cut");
        assert_eq!(std::mem::discriminant(&c.data), std::mem::discriminant(&m.data), "format kept");
        assert!(slice_rows(m, 0..rows + 1).is_err());
        assert!(slice_cols(m, 0..cols + 32).is_err());
    }

    #[test]
    fn f32_slices_hold_their_values() {
        check_every_cut(&Matrix::from_f32(4, 96, values(4, 96)));
        let m = Matrix::from_f32(3, 10, values(3, 10));
        assert_eq!(slice_cols(&m, 3..7).unwrap().to_f32(), cut(&m.to_f32(), 10, 0..3, 3..7), "f32 cuts anywhere");
    }

    #[test]
    fn gguf_block_slices_hold_their_values_and_refuse_to_split_a_block() {
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
            let q = QuantMatrix::from_ggml(ty, &ggml_bytes(ty, 4, 96), 4, 96).unwrap();
            let m = Matrix::from_quant(q);
            check_every_cut(&m);
            let e = slice_cols(&m, 0..48).unwrap_err();
            assert!(e.contains("block"), "{ty:?}: {e}");
            assert!(slice_cols(&m, 16..64).is_err(), "{ty:?}: a start inside a block");
        }
    }

    #[test]
    fn row_quantized_slices_keep_each_rows_scale() {
        for f in [RowFormat::Fp8E4m3, RowFormat::Int8] {
            let q = RowQuantMatrix::quantize(f, 4, 96, &values(4, 96)).unwrap();
            let m = Matrix::from_row_quant(q);
            check_every_cut(&m);
            let odd = slice_cols(&m, 5..17).unwrap();
            assert_eq!(odd.to_f32(), cut(&m.to_f32(), 96, 0..4, 5..17), "{f:?}: any column cut");
        }
    }
}

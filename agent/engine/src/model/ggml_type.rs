//! ggml tensor element types: their on-disk ids and block geometry.
//!
//! The geometry is known for every type llama.cpp writes, so a GGUF file's tensor sizes can be
//! bounds-checked even for types we cannot dequantize (those fail later, in `quant`).

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    I8,
    I16,
    I32,
    I64,
    F64,
    BF16,
    /// An id this build does not know; its size cannot be computed.
    Other(u32),
}

impl GgmlType {
    pub fn from_id(id: u32) -> GgmlType {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            15 => GgmlType::Q8K,
            24 => GgmlType::I8,
            25 => GgmlType::I16,
            26 => GgmlType::I32,
            27 => GgmlType::I64,
            28 => GgmlType::F64,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// `(elements per block, bytes per block)`, or None for an unknown id.
    pub fn block_geometry(self) -> Option<(usize, usize)> {
        Some(match self {
            GgmlType::F32 | GgmlType::I32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 | GgmlType::I16 => (1, 2),
            GgmlType::I8 => (1, 1),
            GgmlType::I64 | GgmlType::F64 => (1, 8),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q8_1 => (32, 36),
            GgmlType::Q2K => (256, 84),
            GgmlType::Q3K => (256, 110),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Q8K => (256, 292),
            GgmlType::Other(_) => return None,
        })
    }

    /// Bytes taken by `n_elements` elements, or None when the type is unknown, `n_elements` is not a
    /// whole number of blocks, or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let (block, size) = self.block_geometry()?;
        let (block, size) = (block as u64, size as u64);
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(size)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GgmlType::Other(id) => write!(f, "ggml type {id}"),
            known => write!(f, "{known:?}"),
        }
    }
}

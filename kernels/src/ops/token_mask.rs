//! token_mask.cu: per-row token bitmasks and sparse logit biases applied to logits in place, and
//! [`pack_token_constraints`], which lays one step's out in one buffer.

use cudarc::driver::{CudaStream, PushKernelArg};

use super::{as_i32, as_u32, cfg, DPtr, Kernels};
use crate::{KernelError, Result};

/// Words of the packed header per constrained row (token_mask.cu's TOKEN_MASK_HEADER).
pub const TOKEN_MASK_HEADER: usize = 4;
/// The header's "no mask" offset (token_mask.cu's TOKEN_MASK_NONE).
const TOKEN_MASK_NONE: u32 = u32::MAX;
const TOKEN_MASK_THREADS: u32 = 1024;

/// u32 words of one row's bitmask over `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Upper bound on the packed words of a step with at most `rows` constrained rows, each with a mask
/// and at most `max_biases` biases: what a backend reserves at start.
pub fn packed_capacity(rows: usize, vocab: usize, max_biases: usize) -> usize {
    rows * (TOKEN_MASK_HEADER + mask_words(vocab) + 2 * max_biases)
}

/// One logits row's constraints: `mask` (exactly [`mask_words`] words, bit set = allowed) and
/// `biases` (token, bias), added after the mask in this order.
#[derive(Debug, Clone, Copy)]
pub struct ConstrainedRow<'a> {
    pub row: usize,
    pub mask: Option<&'a [u32]>,
    pub biases: &'a [(u32, f32)],
}

/// Packs one step's constrained rows (increasing row order; rows with neither mask nor bias are
/// skipped) into the buffer token_mask.cu reads: per row a header (logits row, mask offset or none,
/// bias pairs' [begin, end)), then the masks, then (token, f32 bits) pairs. `out` is cleared first.
/// Returns the number of rows packed (the kernel's grid).
pub fn pack_token_constraints(vocab: usize, rows: &[ConstrainedRow], out: &mut Vec<u32>) -> Result<usize> {
    out.clear();
    let words = mask_words(vocab);
    let rows: Vec<&ConstrainedRow> = rows.iter().filter(|r| r.mask.is_some() || !r.biases.is_empty()).collect();
    let mut last = None;
    for r in &rows {
        if last.is_some_and(|l| l >= r.row) {
            return Err(KernelError::Unsupported(format!("constrained rows must come in increasing order ({})", r.row)));
        }
        last = Some(r.row);
        if let Some(m) = r.mask.filter(|m| m.len() != words) {
            return Err(KernelError::Unsupported(format!("a token mask of {} words for a vocabulary of {vocab} ({words} words)", m.len())));
        }
    }
    let masks_at = rows.len() * TOKEN_MASK_HEADER;
    let num_masks = rows.iter().filter(|r| r.mask.is_some()).count();
    let biases_at = masks_at + num_masks * words;
    let total = biases_at + 2 * rows.iter().map(|r| r.biases.len()).sum::<usize>();
    as_u32(total, "packed constraint words")?;
    out.reserve(total);
    let (mut next_mask, mut next_bias) = (masks_at, biases_at);
    for r in &rows {
        let mask_at = match r.mask {
            Some(_) => {
                next_mask += words;
                (next_mask - words) as u32
            }
            None => TOKEN_MASK_NONE,
        };
        let begin = next_bias;
        next_bias += 2 * r.biases.len();
        out.extend_from_slice(&[as_u32(r.row, "constrained logits row")?, mask_at, begin as u32, next_bias as u32]);
    }
    for m in rows.iter().filter_map(|r| r.mask) {
        out.extend_from_slice(m);
    }
    for &(t, b) in rows.iter().flat_map(|r| r.biases) {
        out.extend_from_slice(&[t, b.to_bits()]);
    }
    Ok(rows.len())
}

impl Kernels {
    /// Applies constraints packed by [`pack_token_constraints`] (`num_rows` constrained rows) to `logits` in place.
    ///
    /// # Safety
    /// logits: at least (largest row + 1) * vocab f32; packed: the buffer [`pack_token_constraints`]
    /// wrote for this vocabulary, with `num_rows` rows.
    pub unsafe fn apply_token_constraints(&self, s: &CudaStream, logits: DPtr, vocab: usize, packed: DPtr, num_rows: usize) -> Result<()> {
        if num_rows == 0 {
            return Ok(());
        }
        let vocab = as_i32(vocab, "vocab")?;
        s.launch_builder(&self.apply_token_constraints)
            .arg(&logits)
            .arg(&vocab)
            .arg(&packed)
            .launch(cfg(as_u32(num_rows, "constrained rows")?, TOKEN_MASK_THREADS))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed buffer read back the way token_mask.cu reads it, on the host.
    fn apply_like_the_kernel(packed: &[u32], rows: usize, vocab: usize, logits: &mut [f32]) {
        for h in packed[..rows * TOKEN_MASK_HEADER].chunks_exact(TOKEN_MASK_HEADER) {
            let row = &mut logits[h[0] as usize * vocab..][..vocab];
            if h[1] != TOKEN_MASK_NONE {
                let mask = &packed[h[1] as usize..];
                for (j, l) in row.iter_mut().enumerate() {
                    if (mask[j >> 5] >> (j & 31)) & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            for pair in packed[h[2] as usize..h[3] as usize].chunks_exact(2) {
                row[pair[0] as usize] += f32::from_bits(pair[1]);
            }
        }
    }

    fn row<'a>(row: usize, mask: Option<&'a [u32]>, biases: &'a [(u32, f32)]) -> ConstrainedRow<'a> {
        ConstrainedRow { row, mask, biases }
    }

    #[test]
    fn packing_keeps_each_rows_mask_and_biases_in_order() {
        let vocab = 40; // two words, the second partly used
        let mut m1 = vec![0u32; 2];
        m1[0] = 0b1010; // tokens 1 and 3
        m1[1] = 1 << 3; // token 35
        let m4 = vec![u32::MAX, 0];
        let b3 = [(5, 2.5), (5, -1.0), (39, 7.0)];
        let b4 = [(3, 1.0), (33, 4.0)];
        // Row 2 has nothing: skipped.
        let rows = [row(1, Some(&m1), &[]), row(2, None, &[]), row(3, None, &b3), row(4, Some(&m4), &b4)];
        let mut packed = Vec::new();
        let n = pack_token_constraints(vocab, &rows, &mut packed).unwrap();
        assert_eq!(n, 3);
        assert_eq!(packed.len(), 3 * TOKEN_MASK_HEADER + 2 * 2 + 5 * 2);
        assert!(packed.len() <= packed_capacity(3, vocab, 3));

        let base: Vec<f32> = (0..5 * vocab).map(|i| i as f32 * 0.25).collect();
        let mut got = base.clone();
        apply_like_the_kernel(&packed, n, vocab, &mut got);
        let mut want = base.clone();
        for (j, l) in want[vocab..2 * vocab].iter_mut().enumerate() {
            if ![1, 3, 35].contains(&j) {
                *l = f32::NEG_INFINITY;
            }
        }
        want[3 * vocab + 5] = want[3 * vocab + 5] + 2.5 - 1.0;
        want[3 * vocab + 39] += 7.0;
        for l in &mut want[4 * vocab + 32..5 * vocab] {
            *l = f32::NEG_INFINITY;
        }
        want[4 * vocab + 3] += 1.0;
        // Token 33 is masked out: -inf + 4 stays -inf.
        assert_eq!(got, want);
        assert_eq!(got[4 * vocab + 33], f32::NEG_INFINITY);
    }

    #[test]
    fn bad_masks_and_row_order_are_refused() {
        let mut out = Vec::new();
        assert!(pack_token_constraints(64, &[row(0, Some(&[0; 3]), &[])], &mut out).is_err());
        let b = [(1, 1.0)];
        assert!(pack_token_constraints(64, &[row(2, None, &b), row(2, None, &b)], &mut out).is_err());
        assert!(pack_token_constraints(64, &[row(2, None, &b), row(1, None, &b)], &mut out).is_err());
        assert_eq!(pack_token_constraints(64, &[row(1, None, &b), row(5, Some(&[1, 2]), &[])], &mut out).unwrap(), 2);
        assert_eq!(pack_token_constraints(64, &[], &mut out).unwrap(), 0);
        assert!(out.is_empty());
    }
}

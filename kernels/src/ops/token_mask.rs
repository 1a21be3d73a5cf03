//! token_mask.cu: per-row token bitmasks and sparse logit biases applied to logits in place, and
//! [`TokenConstraints`], the one buffer a step packs them into.

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

/// One step's constraints, packed for token_mask.cu: per constrained row a header (logits row, mask
/// offset or none, bias pairs' [begin, end)), then the masks, then (token, f32 bits) pairs.
/// Rows are added with [`TokenConstraints::push`]; [`TokenConstraints::pack`] lays out the buffer.
#[derive(Debug, Clone)]
pub struct TokenConstraints {
    vocab: usize,
    /// (logits row, index into `masks` in rows of `mask_words(vocab)`, bias range in `biases`).
    rows: Vec<(u32, Option<usize>, std::ops::Range<usize>)>,
    masks: Vec<u32>,
    biases: Vec<(u32, f32)>,
}

impl TokenConstraints {
    pub fn new(vocab: usize) -> Self {
        TokenConstraints { vocab, rows: Vec::new(), masks: Vec::new(), biases: Vec::new() }
    }

    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Constrained rows so far.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Adds logits row `row`'s constraints: `mask` (exactly [`mask_words`] words, bit set = allowed)
    /// and `biases` (token, bias), added after the mask in this order. A row with neither is skipped.
    pub fn push(&mut self, row: usize, mask: Option<&[u32]>, biases: &[(u32, f32)]) -> Result<()> {
        if mask.is_none() && biases.is_empty() {
            return Ok(());
        }
        let row = as_u32(row, "constrained logits row")?;
        if self.rows.last().is_some_and(|r| r.0 >= row) {
            return Err(KernelError::Unsupported(format!("constrained rows must be pushed in increasing order ({row})")));
        }
        let words = mask_words(self.vocab);
        let mask_index = match mask {
            Some(m) if m.len() != words => {
                return Err(KernelError::Unsupported(format!("a token mask of {} words for a vocabulary of {} ({words} words)", m.len(), self.vocab)));
            }
            Some(m) => {
                self.masks.extend_from_slice(m);
                Some(self.masks.len() / words - 1)
            }
            None => None,
        };
        let begin = self.biases.len();
        self.biases.extend_from_slice(biases);
        self.rows.push((row, mask_index, begin..self.biases.len()));
        Ok(())
    }

    /// The buffer token_mask.cu reads, appended to `out` (cleared first), in u32 words.
    pub fn pack(&self, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        let words = mask_words(self.vocab);
        let masks_at = self.rows.len() * TOKEN_MASK_HEADER;
        let biases_at = masks_at + self.masks.len();
        let total = biases_at + 2 * self.biases.len();
        as_u32(total, "packed constraint words")?;
        out.reserve(total);
        for (row, mask, bias) in &self.rows {
            let mask_at = mask.map_or(TOKEN_MASK_NONE, |m| (masks_at + m * words) as u32);
            out.extend_from_slice(&[*row, mask_at, (biases_at + 2 * bias.start) as u32, (biases_at + 2 * bias.end) as u32]);
        }
        out.extend_from_slice(&self.masks);
        for &(t, b) in &self.biases {
            out.extend_from_slice(&[t, b.to_bits()]);
        }
        Ok(())
    }

    /// Forgets every row (keeps the allocations).
    pub fn clear(&mut self) {
        self.rows.clear();
        self.masks.clear();
        self.biases.clear();
    }
}

impl Kernels {
    /// Applies a packed [`TokenConstraints`] (`num_rows` constrained rows) to `logits` in place.
    ///
    /// # Safety
    /// logits: at least (largest row + 1) * vocab f32; packed: the buffer [`TokenConstraints::pack`]
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

    #[test]
    fn packing_keeps_each_rows_mask_and_biases_in_order() {
        let vocab = 40; // two words, the second partly used
        let mut c = TokenConstraints::new(vocab);
        let mut m1 = vec![0u32; 2];
        m1[0] = 0b1010; // tokens 1 and 3
        m1[1] = 1 << 3; // token 35
        c.push(1, Some(&m1), &[]).unwrap();
        c.push(2, None, &[]).unwrap(); // nothing: skipped
        c.push(3, None, &[(5, 2.5), (5, -1.0), (39, 7.0)]).unwrap();
        let m4 = vec![u32::MAX, 0];
        c.push(4, Some(&m4), &[(3, 1.0), (33, 4.0)]).unwrap();
        assert_eq!(c.len(), 3);
        let mut packed = Vec::new();
        c.pack(&mut packed).unwrap();
        assert_eq!(packed.len(), 3 * TOKEN_MASK_HEADER + 2 * 2 + 5 * 2);
        assert!(packed.len() <= packed_capacity(3, vocab, 3));

        let base: Vec<f32> = (0..5 * vocab).map(|i| i as f32 * 0.25).collect();
        let mut got = base.clone();
        apply_like_the_kernel(&packed, c.len(), vocab, &mut got);
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
        let mut c = TokenConstraints::new(64);
        assert!(c.push(0, Some(&[0; 3]), &[]).is_err());
        c.push(2, None, &[(1, 1.0)]).unwrap();
        assert!(c.push(2, None, &[(1, 1.0)]).is_err());
        assert!(c.push(1, None, &[(1, 1.0)]).is_err());
        c.clear();
        assert!(c.is_empty());
        c.push(1, None, &[(1, 1.0)]).unwrap();
    }
}

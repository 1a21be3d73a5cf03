//! One step's token masks and logit biases, for backends that apply them on their device.

/// The masks (allowed-token bitmasks, bit `t % 32` of word `t / 32` set where token `t` may follow)
/// and logit biases of one step's constrained logits rows, gathered on the host in row order. The
/// CUDA backend packs them into one upload and applies them before its sampler (token_mask.cu).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowConstraints {
    words_per_row: usize,
    /// (logits row, index of its mask in `masks` in rows of `words_per_row`, its biases' range).
    rows: Vec<(usize, Option<usize>, std::ops::Range<usize>)>,
    masks: Vec<u32>,
    biases: Vec<(u32, f32)>,
}

/// Fills a zeroed bitmask with the allowed tokens; false where no mask applies.
pub type MaskWriter<'a> = &'a mut dyn FnMut(&mut [u32]) -> bool;

/// One constrained row, as [`RowConstraints::rows`] hands it out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConstrainedRowRef<'a> {
    pub row: usize,
    pub mask: Option<&'a [u32]>,
    pub biases: &'a [(u32, f32)],
}

impl RowConstraints {
    /// Empty, for a vocabulary of `vocab` tokens.
    pub fn new(vocab: usize) -> Self {
        RowConstraints { words_per_row: vocab.div_ceil(32), ..Default::default() }
    }

    pub fn words_per_row(&self) -> usize {
        self.words_per_row
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Adds logits row `row` (after every row added so far): `write_mask` fills a zeroed mask and
    /// says whether one applies; `biases` are added after the mask in their order.
    pub fn push(&mut self, row: usize, write_mask: Option<MaskWriter<'_>>, biases: &[(u32, f32)]) {
        let mask = write_mask.and_then(|write| {
            let at = self.masks.len();
            self.masks.resize(at + self.words_per_row, 0);
            if write(&mut self.masks[at..]) {
                Some(at / self.words_per_row.max(1))
            } else {
                self.masks.truncate(at);
                None
            }
        });
        if mask.is_none() && biases.is_empty() {
            return;
        }
        let begin = self.biases.len();
        self.biases.extend_from_slice(biases);
        self.rows.push((row, mask, begin..self.biases.len()));
    }

    /// The constrained rows in the order added.
    pub fn rows(&self) -> impl Iterator<Item = ConstrainedRowRef<'_>> {
        self.rows.iter().map(|(row, mask, bias)| ConstrainedRowRef {
            row: *row,
            mask: mask.map(|m| &self.masks[m * self.words_per_row..(m + 1) * self.words_per_row]),
            biases: &self.biases[bias.clone()],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_keep_their_masks_and_biases_and_empty_rows_are_dropped() {
        let mut c = RowConstraints::new(40);
        assert_eq!(c.words_per_row(), 2);
        c.push(0, Some(&mut |w: &mut [u32]| {
            w[1] = 5;
            true
        }), &[]);
        // A grammar that failed writes no mask: the row has nothing left and is dropped.
        c.push(1, Some(&mut |_: &mut [u32]| false), &[]);
        c.push(2, Some(&mut |_: &mut [u32]| false), &[(3, 1.5)]);
        c.push(3, None, &[]);
        c.push(4, Some(&mut |w: &mut [u32]| {
            w[0] = 9;
            true
        }), &[(1, -2.0), (1, 4.0)]);
        let rows: Vec<_> = c.rows().collect();
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0], ConstrainedRowRef { row: 0, mask: Some(&[0, 5]), biases: &[] });
        assert_eq!(rows[1], ConstrainedRowRef { row: 2, mask: None, biases: &[(3, 1.5)] });
        assert_eq!(rows[2], ConstrainedRowRef { row: 4, mask: Some(&[9, 0]), biases: &[(1, -2.0), (1, 4.0)] });
    }
}

//! One encoder forward as plain data: every sequence's tokens concatenated with no padding, and the
//! offsets where each sequence starts. Attention stays inside each sequence, so a sequence's result
//! does not depend on what else is in the batch.

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RaggedBatch {
    pub ids: Vec<u32>,
    pub type_ids: Vec<u32>,
    /// `offsets[i]..offsets[i + 1]` are sequence `i`'s tokens; starts with 0, ends with `ids.len()`.
    pub offsets: Vec<usize>,
}

impl RaggedBatch {
    pub fn new() -> RaggedBatch {
        RaggedBatch { ids: Vec::new(), type_ids: Vec::new(), offsets: vec![0] }
    }

    /// Appends one sequence; `type_ids` must be as long as `ids`.
    pub fn push(&mut self, ids: &[u32], type_ids: &[u32]) {
        if self.offsets.is_empty() {
            self.offsets.push(0);
        }
        self.ids.extend_from_slice(ids);
        self.type_ids.extend_from_slice(type_ids);
        self.offsets.push(self.ids.len());
    }

    pub fn num_seqs(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    pub fn num_tokens(&self) -> usize {
        self.ids.len()
    }

    /// Sequence `i`'s token range.
    pub fn range(&self, i: usize) -> std::ops::Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Checks the batch is well formed for a model of `vocab` ids, `type_vocab` token types and at most
    /// `max_len` tokens per sequence. Backends call this before touching any table.
    pub fn validate(&self, vocab: usize, type_vocab: usize, max_len: usize) -> Result<(), String> {
        if self.offsets.first() != Some(&0) || self.offsets.last() != Some(&self.ids.len()) {
            return Err("offsets must start at 0 and end at the token count".into());
        }
        if self.type_ids.len() != self.ids.len() {
            return Err("type_ids and ids differ in length".into());
        }
        for w in self.offsets.windows(2) {
            let len = w[1].checked_sub(w[0]).ok_or("offsets go backwards")?;
            if len == 0 || len > max_len {
                return Err(format!("a sequence has {len} tokens (1..={max_len} allowed)"));
            }
        }
        if let Some(&id) = self.ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(format!("token id {id} is outside the vocabulary ({vocab})"));
        }
        if let Some(&t) = self.type_ids.iter().find(|&&t| t as usize >= type_vocab) {
            return Err(format!("token type {t} is outside the model's {type_vocab} types"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_and_validation() {
        let mut b = RaggedBatch::new();
        b.push(&[1, 2, 3], &[0, 0, 1]);
        b.push(&[4], &[0]);
        assert_eq!((b.num_seqs(), b.num_tokens(), b.range(1)), (2, 4, 3..4));
        assert!(b.validate(5, 2, 3).is_ok());
        assert!(b.validate(4, 2, 3).is_err(), "id 4 outside a vocab of 4");
        assert!(b.validate(5, 1, 3).is_err(), "type 1 outside 1 type");
        assert!(b.validate(5, 2, 2).is_err(), "3 tokens above max 2");
        b.offsets.push(4);
        assert!(b.validate(5, 2, 3).is_err(), "empty sequence");
    }
}

//! Admission look-ahead: how many more KV blocks the running sequences will need before they end.
//!
//! Each sequence is projected to grow by one token per step until its projected end, then to
//! give its private blocks back. The peak of "blocks grown minus blocks given back" over the
//! coming steps is what must stay free; a sequence is admitted only if, with it counted in, that
//! peak still fits. Because sequences end at different steps, this admits far more than reserving
//! every sequence's full length at once would (the sum of final lengths is never held at one
//! time), and, when requests do run to their limits, it never admits what it would later have to
//! preempt.
//!
//! The peak is only evaluated where it can occur, at the last step of some sequence (between two
//! endings the need only grows), and each sequence's growth over `t` steps is bounded from above
//! as a sum of floors: `Σ ⌊(o + t) / B⌋ ≤ ⌊(Σ o + n·t) / B⌋`, where `o` is how far into its last
//! block a sequence is. So the projection never under-counts and costs O(n) per check.

/// One sequence's future, as the look-ahead counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Projection {
    /// Step offset (0: the step being planned) of the last step that still needs its KV slots;
    /// it ends after that step.
    pub last_step: usize,
    /// Tokens already in its last block, minus one: `(len - 1) % block_size`.
    pub offset: usize,
    /// Blocks it alone holds, given back when it ends.
    pub private: usize,
}

/// The running sequences' projections, kept sorted by `last_step`.
#[derive(Debug, Clone, Default)]
pub(super) struct Outlook {
    items: Vec<Projection>,
}

impl Outlook {
    pub fn insert(&mut self, p: Projection) {
        let at = self.items.partition_point(|q| q.last_step <= p.last_step);
        self.items.insert(at, p);
    }

    /// The most blocks, beyond those held now, the projected sequences (with `extra` counted in)
    /// will need at any one coming step.
    pub fn peak_with(&self, extra: &[Projection], block_size: usize) -> usize {
        let mut all = self.items.clone();
        for &p in extra {
            let at = all.partition_point(|q| q.last_step <= p.last_step);
            all.insert(at, p);
        }
        peak(&all, block_size.max(1))
    }
}

/// `items` sorted by `last_step`. At step `t = last_step[i]`, every item from the first one with
/// that `last_step` on is still running (and has grown `t` tokens), every item before has ended.
fn peak(items: &[Projection], block_size: usize) -> usize {
    let n = items.len();
    // Suffix sums of offsets and counts, from the back.
    let mut suffix_offsets = vec![0usize; n + 1];
    for i in (0..n).rev() {
        suffix_offsets[i] = suffix_offsets[i + 1] + items[i].offset;
    }
    let mut best = 0usize;
    let mut freed = 0usize;
    for i in 0..n {
        let t = items[i].last_step;
        if i == 0 || items[i - 1].last_step != t {
            let alive = n - i;
            let grown = (suffix_offsets[i].saturating_add(alive.saturating_mul(t))) / block_size;
            best = best.max(grown.saturating_sub(freed));
        }
        freed += items[i].private;
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same quantity by brute force: every step, every sequence's exact block count.
    fn brute(items: &[Projection], b: usize) -> usize {
        let horizon = items.iter().map(|p| p.last_step).max().unwrap_or(0);
        (0..=horizon + 1)
            .map(|t| {
                let mut need: isize = 0;
                for p in items {
                    if t <= p.last_step {
                        need += ((p.offset + t) / b) as isize;
                    } else {
                        need -= p.private as isize;
                    }
                }
                need.max(0) as usize
            })
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn peak_bounds_the_exact_need_and_matches_it_for_aligned_sequences() {
        // Aligned (offset 0 or all equal) sequences: the bound is exact.
        let aligned = [
            Projection { last_step: 3, offset: 0, private: 2 },
            Projection { last_step: 9, offset: 0, private: 3 },
            Projection { last_step: 9, offset: 0, private: 1 },
            Projection { last_step: 20, offset: 0, private: 5 },
        ];
        let mut o = Outlook::default();
        aligned.iter().for_each(|&p| o.insert(p));
        assert_eq!(o.peak_with(&[], 4), brute(&aligned, 4));
        // Mixed offsets: never below the exact need, at most one block per sequence above it.
        let mut state = 7u64;
        for _ in 0..200 {
            let items: Vec<Projection> = (0..12)
                .map(|_| {
                    state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    let r = (state >> 33) as usize;
                    Projection { last_step: r % 40, offset: (r / 40) % 4, private: (r / 160) % 6 }
                })
                .collect();
            let (first, rest) = items.split_at(5);
            let mut o = Outlook::default();
            first.iter().for_each(|&p| o.insert(p));
            let got = o.peak_with(rest, 4);
            let exact = brute(&items, 4);
            assert!(got >= exact && got <= exact + items.len(), "{got} vs {exact} for {items:?}");
        }
    }

    #[test]
    fn endings_give_blocks_back_before_later_growth() {
        // One sequence ends after step 0 and gives 4 blocks back; the other, 3 tokens past its
        // last block's start, grows 8 tokens (2 new blocks by step 8), which those 4 cover.
        let items = [Projection { last_step: 0, offset: 0, private: 4 }, Projection { last_step: 8, offset: 3, private: 1 }];
        let mut o = Outlook::default();
        items.iter().for_each(|&p| o.insert(p));
        assert_eq!(o.peak_with(&[], 4), 0);
        assert_eq!(o.peak_with(&[], 4), brute(&items, 4));
        // Alone, the grower needs those 2 blocks.
        let alone = Outlook::default();
        assert_eq!(alone.peak_with(&[Projection { last_step: 8, offset: 3, private: 1 }], 4), 2);
    }
}

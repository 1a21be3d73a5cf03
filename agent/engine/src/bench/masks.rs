//! How long one decode step's token masks take for a batch of constrained sequences: what the host
//! must finish while the device runs a step for constrained decode to keep its speed
//! (`peregrine-agent bench --json-schema` prints it).
//!
//! Each sequence has its own matcher; a token is committed on the calling thread and the next mask
//! is computed on the mask pool (`GrammarState::commit`), all sequences at once, as in the engine. A
//! step here is: commit one allowed token per sequence, read each outcome, then wait for every mask
//! (`GrammarState::write_mask`).

use std::time::{Duration, Instant};

use crate::structured::{mask_task_totals, mask_threads, on_mask_threads, start_queued_masks, PARALLEL_COMMIT_MIN_ROWS, CompiledGrammar, GrammarOutcome, GrammarState};

/// Mask timing for one batch size.
#[derive(Debug, Clone, PartialEq)]
pub struct MaskTiming {
    pub sequences: usize,
    /// Bits per mask (the tokenizer's vocabulary).
    pub vocab: usize,
    /// Median wall time of one step's masks, all sequences.
    pub step: Duration,
    /// The first masks (fresh matchers, as at the end of prefill).
    pub first: Duration,
    /// Mean time of one sequence's mask task on a mask thread over the measured
    /// steps: a step's masks on `n` free cores take about `sequences × task / n`.
    pub task: Duration,
    /// Threads of the mask pool.
    pub threads: usize,
    /// Median time of one step's commits (every sequence's token consumed by its grammar), which
    /// the engine thread spends between a step's tokens and the next step's launch.
    pub commit: Duration,
}

/// Times `steps` steps of masks for `sequences` sequences under `grammar` (vocabulary `vocab`).
/// Each sequence follows its own path: at each step it takes an allowed token chosen by its index,
/// so the sequences' matchers do different work, as different outputs would.
pub fn time_masks(grammar: &CompiledGrammar, vocab: usize, sequences: usize, steps: usize) -> MaskTiming {
    let words = vocab.div_ceil(32);
    let mut masks = vec![0u32; sequences * words];
    let t0 = Instant::now();
    let mut states: Vec<GrammarState> = (0..sequences).map(|_| GrammarState::new(grammar)).collect();
    start_queued_masks();
    wait_all(&mut states, &mut masks, words);
    let first = t0.elapsed();
    let mut times = Vec::with_capacity(steps);
    let mut commits = Vec::with_capacity(steps);
    let (tasks0, busy0) = mask_task_totals();
    for step in 0..steps {
        // The picks stand for sampling, which is not the masks' cost: outside the timing.
        let picks: Vec<Option<u32>> =
            (0..sequences).map(|i| pick_allowed(&masks[i * words..(i + 1) * words], i * 7919 + step * 31, grammar.eos_ids())).collect();
        let t = Instant::now();
        // As the engine: every sequence's token is handed over first (`accept_device_token`), then
        // the outcomes are read (`emit`), then the masks gathered while the next step runs.
        commit_all(&mut states, &picks);
        commits.push(t.elapsed());
        for (s, pick) in states.iter_mut().zip(&picks) {
            if pick.is_none() || s.outcome() != GrammarOutcome::Continue {
                *s = GrammarState::new(grammar);
            }
        }
        start_queued_masks();
        wait_all(&mut states, &mut masks, words);
        times.push(t.elapsed());
    }
    let (tasks1, busy1) = mask_task_totals();
    let task = busy1.saturating_sub(busy0) / u32::try_from(tasks1.saturating_sub(tasks0).max(1)).unwrap_or(u32::MAX);
    times.sort();
    commits.sort();
    MaskTiming {
        sequences,
        vocab,
        step: times.get(times.len() / 2).copied().unwrap_or(first),
        first,
        task,
        threads: mask_threads(),
        commit: commits.get(commits.len() / 2).copied().unwrap_or_default(),
    }
}

/// Every sequence's token consumed by its grammar, as the engine does it: on the mask threads for
/// a batch of [`PARALLEL_COMMIT_MIN_ROWS`] or more constrained rows, else one by one.
fn commit_all(states: &mut [GrammarState], picks: &[Option<u32>]) {
    let commit = |(s, pick): (&mut GrammarState, &Option<u32>)| {
        if let Some(token) = pick {
            s.commit(*token);
        }
    };
    if states.len() >= PARALLEL_COMMIT_MIN_ROWS {
        use rayon::prelude::*;
        on_mask_threads(|| states.par_iter_mut().zip(picks).for_each(commit));
    } else {
        states.iter_mut().zip(picks).for_each(commit);
    }
}

fn wait_all(states: &mut [GrammarState], masks: &mut [u32], words: usize) {
    for (s, m) in states.iter_mut().zip(masks.chunks_exact_mut(words)) {
        m.fill(0);
        s.write_mask(m);
    }
}

/// The `(k mod allowed)`-th allowed token that is not an end id; None where only the end is left.
fn pick_allowed(mask: &[u32], k: usize, eos: &[u32]) -> Option<u32> {
    // One pass over the set bits: a 128k vocabulary has ~4,000 words, most of them zero.
    let allowed: Vec<u32> = mask
        .iter()
        .enumerate()
        .filter(|(_, &w)| w != 0)
        .flat_map(|(i, &w)| (0..32u32).filter(move |b| (w >> b) & 1 == 1).map(move |b| i as u32 * 32 + b))
        .filter(|t| !eos.contains(t))
        .collect();
    if allowed.is_empty() {
        return None;
    }
    allowed.get(k % allowed.len()).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_kth_allowed_non_end_token() {
        let mask = [0b1011u32, 1 << 4];
        assert_eq!(pick_allowed(&mask, 0, &[]), Some(0));
        assert_eq!(pick_allowed(&mask, 2, &[]), Some(3));
        assert_eq!(pick_allowed(&mask, 3, &[]), Some(36));
        assert_eq!(pick_allowed(&mask, 4, &[]), Some(0));
        assert_eq!(pick_allowed(&mask, 0, &[0]), Some(1));
        assert_eq!(pick_allowed(&[1 << 5], 0, &[5]), None);
    }
}

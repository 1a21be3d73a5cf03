//! Log-probabilities reported to the caller (taken from the raw model logits, vLLM's default).

use crate::request::TokenLogprob;

/// `log_softmax` in f64, returned as f32.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return vec![f32::NEG_INFINITY; logits.len()];
    }
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&l| (l as f64 - lse) as f32).collect()
}

/// The `n` most probable tokens, best first, lower id first among ties.
pub fn top_logprobs(logprobs: &[f32], n: usize) -> Vec<TokenLogprob> {
    let n = n.min(logprobs.len());
    if n == 0 {
        return Vec::new();
    }
    let cmp = |a: &usize, b: &usize| logprobs[*b].total_cmp(&logprobs[*a]).then(a.cmp(b));
    let mut ids: Vec<usize> = (0..logprobs.len()).collect();
    if n < ids.len() {
        ids.select_nth_unstable_by(n - 1, cmp);
        ids.truncate(n);
    }
    ids.sort_unstable_by(cmp);
    ids.into_iter().map(|i| TokenLogprob { token_id: i as u32, logprob: logprobs[i] }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_hand_computation() {
        // exp: 1, 3, 6 over a sum of 10.
        let lp = log_softmax(&[0.0, (3.0f32).ln(), (6.0f32).ln()]);
        let want = [(0.1f64).ln(), (0.3f64).ln(), (0.6f64).ln()];
        for (a, b) in lp.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-6, "{lp:?}");
        }
        // Shift invariance with huge logits (no overflow).
        let big = log_softmax(&[1000.0, 1000.0 + (3.0f32).ln(), 1000.0 + (6.0f32).ln()]);
        for (a, b) in big.iter().zip(want) {
            assert!((*a as f64 - b).abs() < 1e-4, "{big:?}");
        }
    }

    #[test]
    fn top_logprobs_are_sorted_with_id_tiebreak() {
        let lp = [-1.0, -0.5, -3.0, -0.5, -2.0];
        let top = top_logprobs(&lp, 3);
        let ids: Vec<u32> = top.iter().map(|t| t.token_id).collect();
        assert_eq!(ids, vec![1, 3, 0]);
        assert_eq!(top[2].logprob, -1.0);
        assert_eq!(top_logprobs(&lp, 0), vec![]);
        assert_eq!(top_logprobs(&lp, 10).len(), 5);
    }
}

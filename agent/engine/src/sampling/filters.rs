//! Top-k, top-p and min-p: which tokens stay candidates for the draw.

use std::cmp::Ordering;

/// Softmax in f64 (sums over a 100k+ vocabulary lose too much in f32). `-inf` logits get 0.
pub fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return vec![0.0; logits.len()];
    }
    let mut out: Vec<f64> = logits.iter().map(|&l| (l as f64 - max).exp()).collect();
    let sum: f64 = out.iter().sum();
    for p in &mut out {
        *p /= sum;
    }
    out
}

/// Higher logit first; among equal logits the lower id first (so ties resolve the same everywhere).
fn by_logit_desc(logits: &[f32]) -> impl Fn(&usize, &usize) -> Ordering + '_ {
    move |&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b))
}

/// The candidate tokens after top-k (`0` disables; tokens tied with the k-th logit are kept, as in
/// HF and vLLM), top-p (`1.0` disables; the smallest most-probable set whose probability reaches
/// `top_p` of what top-k kept) and min-p (`0.0` disables; probability at least `min_p` times the
/// largest). Returns `(token id, probability)` pairs: most probable first when top-k or top-p is on,
/// else in id order (sorting a whole vocabulary per token is not free). Never empty for a row with at
/// least one finite logit.
pub fn keep_mask(logits: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Vec<(usize, f64)> {
    let probs = softmax(logits);
    let cmp = by_logit_desc(logits);
    let mut ids: Vec<usize> = (0..logits.len()).filter(|&i| probs[i] > 0.0).collect();
    if ids.is_empty() {
        return Vec::new();
    }
    let top_k_on = top_k > 0 && top_k < ids.len();
    if top_k_on {
        ids.select_nth_unstable_by(top_k - 1, &cmp);
        let kth = logits[ids[top_k - 1]];
        // Ties with the k-th logit may sit beyond position k after the partition: keep them too.
        ids.retain(|&i| logits[i] >= kth);
    }
    if top_k_on || top_p < 1.0 {
        ids.sort_unstable_by(&cmp);
    }
    if top_p < 1.0 {
        let total: f64 = ids.iter().map(|&i| probs[i]).sum();
        let target = top_p as f64 * total;
        let mut cum = 0.0;
        let mut keep = 0;
        for &i in &ids {
            if keep > 0 && cum >= target {
                break;
            }
            cum += probs[i];
            keep += 1;
        }
        ids.truncate(keep);
    }
    if min_p > 0.0 {
        let best = ids.iter().map(|&i| probs[i]).fold(0.0, f64::max);
        let threshold = min_p as f64 * best;
        ids.retain(|&i| probs[i] >= threshold);
    }
    ids.into_iter().map(|i| (i, probs[i])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(kept: &[(usize, f64)]) -> Vec<usize> {
        kept.iter().map(|&(i, _)| i).collect()
    }

    /// Logits whose softmax is exactly `probs` (up to rounding).
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn softmax_matches_hand_computation() {
        let p = softmax(&[0.0, (2.0f32).ln(), f32::NEG_INFINITY, (5.0f32).ln()]);
        let want = [1.0 / 8.0, 2.0 / 8.0, 0.0, 5.0 / 8.0];
        for (a, b) in p.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{p:?}");
        }
    }

    #[test]
    fn no_filters_keep_everything() {
        let kept = keep_mask(&[1.0, 3.0, 2.0], 0, 1.0, 0.0);
        assert_eq!(ids(&kept), vec![0, 1, 2]);
    }

    #[test]
    fn top_k_keeps_k_best_and_their_ties() {
        assert_eq!(ids(&keep_mask(&[1.0, 5.0, 3.0, 4.0], 2, 1.0, 0.0)), vec![1, 3]);
        // The 2nd best logit (3.0) is shared by ids 0 and 2: both stay.
        assert_eq!(ids(&keep_mask(&[3.0, 5.0, 3.0, 1.0], 2, 1.0, 0.0)), vec![1, 0, 2]);
        // k >= vocab disables.
        assert_eq!(keep_mask(&[3.0, 5.0], 7, 1.0, 0.0).len(), 2);
        assert_eq!(ids(&keep_mask(&[3.0, 5.0, 4.0], 1, 1.0, 0.0)), vec![1]);
    }

    #[test]
    fn top_p_keeps_smallest_set_reaching_p() {
        let l = logits_of(&[0.1, 0.5, 0.15, 0.25]);
        // 0.5 < 0.6, 0.5+0.25 = 0.75 >= 0.6.
        assert_eq!(ids(&keep_mask(&l, 0, 0.6, 0.0)), vec![1, 3]);
        assert_eq!(ids(&keep_mask(&l, 0, 0.45, 0.0)), vec![1]);
        // Tiny p still keeps the best token.
        assert_eq!(ids(&keep_mask(&l, 0, 1e-6, 0.0)), vec![1]);
        assert_eq!(ids(&keep_mask(&l, 0, 0.95, 0.0)), vec![1, 3, 2, 0]);
    }

    #[test]
    fn top_p_applies_to_what_top_k_kept() {
        let l = logits_of(&[0.1, 0.5, 0.15, 0.25]);
        // Top-2 renormalised: 0.5/0.75 = 0.667, 0.25/0.75 = 0.333; p = 0.6 → only token 1.
        assert_eq!(ids(&keep_mask(&l, 2, 0.6, 0.0)), vec![1]);
        assert_eq!(ids(&keep_mask(&l, 2, 0.7, 0.0)), vec![1, 3]);
    }

    #[test]
    fn min_p_is_relative_to_the_best_token() {
        let l = logits_of(&[0.1, 0.5, 0.15, 0.25]);
        // Threshold 0.28 * 0.5 = 0.14: ids 1, 3, 2 stay, id 0 (0.1) goes.
        let kept = keep_mask(&l, 0, 1.0, 0.28);
        assert_eq!(ids(&kept), vec![1, 2, 3]);
        assert!((kept[0].1 - 0.5).abs() < 1e-6);
        assert_eq!(ids(&keep_mask(&l, 0, 1.0, 0.32)), vec![1, 3]);
        // Relative to the best token that top-k left, combined with it.
        assert_eq!(ids(&keep_mask(&l, 3, 1.0, 0.28)), vec![1, 3, 2]);
        assert_eq!(ids(&keep_mask(&l, 0, 1.0, 1.0)), vec![1]);
    }

    #[test]
    fn masked_tokens_are_never_candidates() {
        let kept = keep_mask(&[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY], 0, 1.0, 0.0);
        assert_eq!(ids(&kept), vec![1]);
        assert!(keep_mask(&[f32::NEG_INFINITY; 3], 0, 1.0, 0.0).is_empty());
    }
}

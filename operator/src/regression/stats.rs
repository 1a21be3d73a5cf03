//! Percentiles of latency samples.

use std::time::Duration;

/// The nearest-rank percentile `p` (0..=100) of `samples`; `None` when there are none.
pub fn percentile(samples: &[Duration], p: f64) -> Option<Duration> {
    if samples.is_empty() {
        return None;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let ms = |v: &[u64]| v.iter().map(|&m| Duration::from_millis(m)).collect::<Vec<_>>();
        let samples = ms(&(1..=20).rev().collect::<Vec<_>>());
        assert_eq!(percentile(&samples, 95.0), Some(Duration::from_millis(19)));
        assert_eq!(percentile(&samples, 100.0), Some(Duration::from_millis(20)));
        assert_eq!(percentile(&samples, 0.0), Some(Duration::from_millis(1)));
        assert_eq!(percentile(&ms(&[7]), 95.0), Some(Duration::from_millis(7)));
        assert_eq!(percentile(&[], 95.0), None);
    }
}

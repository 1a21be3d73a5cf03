//! Cumulative Prometheus histograms: deltas over a window, sums across pods, quantiles.
//!
//! Percentiles of a fleet are computed the way Prometheus' `histogram_quantile(0.95,
//! sum(rate(x_bucket[w])))` does: subtract the bucket counts at the window's start from those at its
//! end per pod, add the deltas of all pods, and interpolate inside the bucket that holds the rank.
//! Averaging per-pod p95s would let one overloaded pod hide behind idle ones.

/// A cumulative histogram: `buckets` holds `(upper bound, observations <= bound)`, ascending, the
/// last bound `+Inf`.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

/// Two histograms with different bucket bounds cannot be combined exactly.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("histograms have different bucket bounds")]
pub struct BoundsMismatch;

impl Histogram {
    pub fn new(buckets: Vec<(f64, f64)>, sum: f64, count: f64) -> Self {
        Histogram { buckets, sum, count }
    }

    /// An empty histogram with these upper bounds (`+Inf` is added when missing).
    pub fn with_bounds(bounds: &[f64]) -> Self {
        let mut buckets: Vec<(f64, f64)> = bounds.iter().map(|&b| (b, 0.0)).collect();
        if buckets.last().is_none_or(|b| b.0 != f64::INFINITY) {
            buckets.push((f64::INFINITY, 0.0));
        }
        Histogram { buckets, sum: 0.0, count: 0.0 }
    }

    /// Records one observation (used by the simulation, which plays the agent).
    pub fn observe(&mut self, value: f64) {
        for bucket in self.buckets.iter_mut().filter(|b| value <= b.0) {
            bucket.1 += 1.0;
        }
        self.sum += value;
        self.count += 1.0;
    }

    fn same_bounds(&self, other: &Histogram) -> bool {
        self.buckets.len() == other.buckets.len() && self.buckets.iter().zip(&other.buckets).all(|(a, b)| a.0 == b.0)
    }

    /// Adds `other`'s counts into `self` (summing pods).
    pub fn add(&mut self, other: &Histogram) -> Result<(), BoundsMismatch> {
        if !self.same_bounds(other) {
            return Err(BoundsMismatch);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            a.1 += b.1;
        }
        self.sum += other.sum;
        self.count += other.count;
        Ok(())
    }

    /// Observations made since `earlier` (a scrape of the same pod). A count that went down means the
    /// process restarted and its counters began again from zero, so everything in `self` is new.
    pub fn delta_since(&self, earlier: &Histogram) -> Result<Histogram, BoundsMismatch> {
        if !self.same_bounds(earlier) {
            return Err(BoundsMismatch);
        }
        let reset = self.count < earlier.count || self.buckets.iter().zip(&earlier.buckets).any(|(a, b)| a.1 < b.1);
        if reset {
            return Ok(self.clone());
        }
        let buckets = self.buckets.iter().zip(&earlier.buckets).map(|(a, b)| (a.0, a.1 - b.1)).collect();
        Ok(Histogram { buckets, sum: self.sum - earlier.sum, count: self.count - earlier.count })
    }

    /// The `q` quantile (0..=1) by linear interpolation inside the bucket holding the rank, as
    /// Prometheus' `histogram_quantile` does; `None` without observations. A rank in the `+Inf`
    /// bucket returns the highest finite bound (the most that can be said).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 || !q.is_finite() {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower_bound = 0.0;
        let mut lower_count = 0.0;
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound == f64::INFINITY {
                    return Some(lower_bound);
                }
                let in_bucket = count - lower_count;
                if in_bucket <= 0.0 {
                    return Some(bound);
                }
                return Some(lower_bound + (bound - lower_bound) * (rank - lower_count) / in_bucket);
            }
            lower_bound = bound;
            lower_count = count;
        }
        Some(lower_bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(counts: &[f64]) -> Histogram {
        let bounds = [0.1, 0.2, 0.5, 1.0, f64::INFINITY];
        let buckets: Vec<(f64, f64)> = bounds.iter().copied().zip(counts.iter().copied()).collect();
        let count = buckets.last().map_or(0.0, |b| b.1);
        Histogram::new(buckets, 0.0, count)
    }

    #[test]
    fn quantile_matches_prometheus_interpolation() {
        // 100 observations: 50 <= 0.1, 40 in (0.1, 0.2], 10 in (0.2, 0.5].
        // p95: rank 95 lies in (0.2, 0.5] at (95 - 90) / 10 of its width: 0.2 + 0.3 * 0.5 = 0.35.
        let h = hist(&[50.0, 90.0, 100.0, 100.0, 100.0]);
        assert!((h.quantile(0.95).unwrap() - 0.35).abs() < 1e-12);
        // p50: rank 50 is exactly the top of the first bucket: 0 + 0.1 * 50/50.
        assert!((h.quantile(0.5).unwrap() - 0.1).abs() < 1e-12);
    }

    #[test]
    fn quantile_in_inf_bucket_is_highest_finite_bound() {
        let h = hist(&[0.0, 0.0, 0.0, 1.0, 10.0]);
        assert_eq!(h.quantile(0.95), Some(1.0));
        assert_eq!(hist(&[0.0; 5]).quantile(0.95), None);
    }

    #[test]
    fn fleet_quantile_is_not_mean_of_pod_quantiles() {
        // One busy slow pod and one idle fast pod: the fleet p95 is dominated by the busy pod.
        let slow = hist(&[0.0, 0.0, 0.0, 90.0, 90.0]);
        let fast = hist(&[10.0, 10.0, 10.0, 10.0, 10.0]);
        let mut fleet = slow.clone();
        fleet.add(&fast).unwrap();
        let p95 = fleet.quantile(0.95).unwrap();
        let mean_of_p95 = (slow.quantile(0.95).unwrap() + fast.quantile(0.95).unwrap()) / 2.0;
        // rank 95 of 100: 10 fast ones, then 85 of the 90 in (0.5, 1.0].
        assert!((p95 - (0.5 + 0.5 * 85.0 / 90.0)).abs() < 1e-12);
        assert!(mean_of_p95 < 0.6 && p95 > 0.9);
    }

    #[test]
    fn delta_and_counter_reset() {
        let before = hist(&[5.0, 6.0, 7.0, 8.0, 8.0]);
        let after = hist(&[6.0, 8.0, 10.0, 12.0, 12.0]);
        assert_eq!(after.delta_since(&before).unwrap().buckets.iter().map(|b| b.1).collect::<Vec<_>>(), [1.0, 2.0, 3.0, 4.0, 4.0]);
        // The pod restarted: its counters are below the earlier ones.
        let restarted = hist(&[1.0, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(restarted.delta_since(&before).unwrap(), restarted);
        let other_bounds = Histogram::with_bounds(&[0.3]);
        assert_eq!(other_bounds.delta_since(&before), Err(BoundsMismatch));
    }

    #[test]
    fn observe_fills_cumulative_buckets() {
        let mut h = Histogram::with_bounds(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(5.0);
        assert_eq!(h.buckets, vec![(0.1, 1.0), (1.0, 2.0), (f64::INFINITY, 3.0)]);
        assert_eq!(h.count, 3.0);
    }
}

//! What one replica sustains while the SLO holds, learned from the agents' own metrics.
//!
//! The estimate starts from `spec.autoscaling.capacityPerReplica` (a configured or benchmarked
//! value). A window that met every SLO with real load shows the replicas sustained at least the
//! per-replica throughput seen then, so the estimate rises to it; a window that broke an SLO at a
//! lower per-replica throughput than estimated shows the estimate was too high, so it falls to
//! what was seen, but only once the breach has lasted `BREACHES_TO_LEARN` evaluations in a row:
//! a minute's p95 of a replica below capacity breaks now and then by chance (Poisson bursts on
//! one pod), and the window's latencies lag a backlog that has just drained; learning from either
//! would ratchet the estimate down for good (a fleet sized below its load never sees the
//! throughput that would raise it again). Windows with unread or loading pods, or too few
//! requests, teach nothing.

use peregrine_crds::{LatencySlo, Throughput};

use super::window::FleetSnapshot;

/// Fewest requests in a window before its percentiles are trusted to teach capacity.
pub const MIN_REQUESTS_TO_LEARN: f64 = 20.0;

/// A breached window lowers the estimate only with fewer waiting requests per replica than this:
/// then the latency, not a queue, broke the SLO at the throughput served.
pub const MAX_QUEUE_TO_LEARN_FROM_BREACH: f64 = 1.0;

/// Consecutive breached evaluations (without a queue) before a breach lowers the estimate: with
/// a 60 s window scraped every 15 s, 8 is two whole windows, longer than one bad minute (which
/// shows in 4) or the lag after a backlog.
pub const BREACHES_TO_LEARN: u32 = 8;

/// Where the current estimate comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacitySource {
    None,
    Seeded,
    Measured,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CapacityEstimator {
    output_tokens_per_second: Option<f64>,
    requests_per_second: Option<f64>,
    source: CapacitySource,
    /// Breached evaluations in a row that could teach (no queue, enough requests).
    breaches_in_a_row: u32,
}

impl CapacityEstimator {
    pub fn new(seed: Option<&Throughput>) -> Self {
        CapacityEstimator {
            output_tokens_per_second: seed.map(|t| t.output_tokens_per_second),
            requests_per_second: seed.and_then(|t| t.requests_per_second),
            source: if seed.is_some() { CapacitySource::Seeded } else { CapacitySource::None },
            breaches_in_a_row: 0,
        }
    }

    pub fn source(&self) -> CapacitySource {
        self.source
    }

    /// The current estimate per replica, if any.
    pub fn per_replica(&self) -> Option<Throughput> {
        self.output_tokens_per_second
            .map(|tps| Throughput { output_tokens_per_second: tps, requests_per_second: self.requests_per_second })
    }

    /// Learns from one window. Returns true when the estimate changed.
    pub fn learn(&mut self, slo: &LatencySlo, snap: &FleetSnapshot) -> bool {
        if !snap.complete() || snap.loading > 0 || snap.ready == 0 || snap.requests_in_window < MIN_REQUESTS_TO_LEARN {
            self.breaches_in_a_row = 0;
            return false;
        }
        let (Some(tps), Some(rps)) = (snap.output_tokens_per_second, snap.requests_per_second) else {
            self.breaches_in_a_row = 0;
            return false;
        };
        let n = f64::from(snap.ready);
        let (tps, rps) = (tps / n, rps / n);
        let within = within_slo(slo, snap);
        let queued = snap.queue_depth_per_replica.unwrap_or(0.0) >= MAX_QUEUE_TO_LEARN_FROM_BREACH;
        let draining = snap.queue_growth_per_second.unwrap_or(0.0) < 0.0;
        if !within && (queued || draining) {
            // A breach with a queue is demand beyond capacity (the queue grows) or the backlog of
            // an earlier overload (it drains, and its requests' latencies stay in the window for
            // a while after): either way the replicas served all they could or were catching up,
            // and what they served is no upper bound on their capacity.
            self.breaches_in_a_row = 0;
            return false;
        }
        if within {
            self.breaches_in_a_row = 0;
        } else {
            self.breaches_in_a_row += 1;
            if self.breaches_in_a_row < BREACHES_TO_LEARN {
                return false;
            }
        }
        let before = (self.output_tokens_per_second, self.requests_per_second);
        self.output_tokens_per_second = Some(adjust(self.output_tokens_per_second, tps, within));
        if rps > 0.0 {
            self.requests_per_second = Some(adjust(self.requests_per_second, rps, within));
        }
        let changed = before != (self.output_tokens_per_second, self.requests_per_second);
        if changed {
            self.source = CapacitySource::Measured;
        }
        changed
    }
}

/// Within the SLO, capacity is at least what was seen; over it, at most.
fn adjust(current: Option<f64>, seen: f64, within: bool) -> f64 {
    match (current, within) {
        (None, _) => seen,
        (Some(c), true) => c.max(seen),
        (Some(c), false) => c.min(seen),
    }
}

/// Every configured latency objective held in this window (absent percentiles hold trivially).
pub fn within_slo(slo: &LatencySlo, snap: &FleetSnapshot) -> bool {
    let ok = |p: Option<f64>, target: Option<f64>| match (p, target) {
        (Some(p), Some(t)) => p <= t,
        _ => true,
    };
    ok(snap.ttft_p95, slo.ttft_p95_seconds) && ok(snap.tpot_p95, slo.tpot_p95_seconds) && ok(snap.e2e_p95, slo.e2e_p95_seconds)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slo() -> LatencySlo {
        LatencySlo { ttft_p95_seconds: Some(0.5), tpot_p95_seconds: Some(0.05), e2e_p95_seconds: None }
    }

    fn snap(ready: u32, tps: f64, ttft: f64) -> FleetSnapshot {
        FleetSnapshot {
            ready,
            ttft_p95: Some(ttft),
            tpot_p95: Some(0.02),
            requests_in_window: 100.0,
            output_tokens_per_second: Some(tps),
            requests_per_second: Some(tps / 100.0),
            ..Default::default()
        }
    }

    #[test]
    fn rises_within_slo_falls_on_breach_and_ignores_thin_windows() {
        let seed = Throughput { output_tokens_per_second: 100.0, requests_per_second: None };
        let mut c = CapacityEstimator::new(Some(&seed));
        assert_eq!(c.source(), CapacitySource::Seeded);
        // 2 replicas served 300 tok/s within the SLO: each sustains at least 150.
        assert!(c.learn(&slo(), &snap(2, 300.0, 0.3)));
        assert_eq!(c.per_replica().unwrap().output_tokens_per_second, 150.0);
        assert_eq!(c.source(), CapacitySource::Measured);
        // Less load within the SLO teaches nothing new.
        assert!(!c.learn(&slo(), &snap(2, 100.0, 0.1)));
        // A breach at 120 per replica: capacity is below 150, once it has lasted two windows.
        for _ in 1..BREACHES_TO_LEARN {
            assert!(!c.learn(&slo(), &snap(2, 240.0, 0.9)));
        }
        assert!(c.learn(&slo(), &snap(2, 240.0, 0.9)));
        assert_eq!(c.per_replica().unwrap().output_tokens_per_second, 120.0);
        // A breach at more than the estimate says nothing new.
        assert!(!c.learn(&slo(), &snap(2, 400.0, 0.9)));
        // A short breach (one bad minute) is not learned from, however low the throughput.
        assert!(!c.learn(&slo(), &snap(2, 160.0, 0.2)));
        for _ in 0..4 {
            assert!(!c.learn(&slo(), &snap(2, 60.0, 0.9)));
        }
        assert!(!c.learn(&slo(), &snap(2, 160.0, 0.2)));
        // Too few requests, or a pod unread: ignored.
        let mut thin = snap(1, 1000.0, 0.1);
        thin.requests_in_window = 5.0;
        assert!(!c.learn(&slo(), &thin));
        let mut partial = snap(1, 1000.0, 0.1);
        partial.unreachable.push(("b".into(), "timeout".into()));
        assert!(!c.learn(&slo(), &partial));
        assert_eq!(c.per_replica().unwrap().output_tokens_per_second, 120.0);
    }
}

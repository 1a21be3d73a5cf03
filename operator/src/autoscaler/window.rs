//! Per-pod scrape history and the fleet snapshot over the evaluation window.
//!
//! Times are seconds on any monotonic clock (the controller uses the process's `Instant`, the
//! simulation its own clock), so this module stays pure.

use std::collections::{BTreeMap, VecDeque};

use super::histogram::Histogram;
use super::sample::PodMetrics;

/// What the controller saw of one pod this round.
// One per pod per round, mostly `Scraped`: boxing the metrics would only add an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum PodState {
    /// Ready, and its `/metrics` was read.
    Scraped(PodMetrics),
    /// Ready, but `/metrics` could not be read: reported, never counted as idle.
    Unreachable(String),
    /// Created but not ready yet (pulling, loading the model, loading adapters): not capacity.
    Loading,
}

/// One pod's state this round.
#[derive(Clone, Debug, PartialEq)]
pub struct PodObservation {
    pub pod: String,
    pub state: PodState,
}

/// The fleet over the last `evaluationWindowSeconds`, the input of every decision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FleetSnapshot {
    /// Ready pods (scraped or not).
    pub ready: u32,
    /// Pods that exist but are not ready yet.
    pub loading: u32,
    /// Ready pods whose metrics could not be read, with the error.
    pub unreachable: Vec<(String, String)>,
    /// Fleet p95s over the window (`None`: no request finished that phase in the window).
    pub ttft_p95: Option<f64>,
    pub tpot_p95: Option<f64>,
    pub e2e_p95: Option<f64>,
    /// Requests that got a first token in the window (how much the percentiles rest on).
    pub requests_in_window: f64,
    /// Mean waiting requests per scraped pod, now.
    pub queue_depth_per_replica: Option<f64>,
    /// Change of the fleet's waiting requests per second over the window (arrivals minus admissions).
    pub queue_growth_per_second: Option<f64>,
    /// Requests running across the fleet, now.
    pub running: Option<f64>,
    /// Mean KV-cache usage of the scraped pods, now.
    pub kv_cache_usage: Option<f64>,
    /// Fleet output tokens per second over the window.
    pub output_tokens_per_second: Option<f64>,
    /// Fleet completed requests per second over the window.
    pub requests_per_second: Option<f64>,
    /// Requests arriving per second over the window: admitted (first token) plus the queue's
    /// growth. Unlike completions, this keeps rising past saturation, so it measures demand.
    pub arrivals_per_second: Option<f64>,
    /// The same over the last scrape interval only: a step in load shows here a window earlier.
    pub recent_arrivals_per_second: Option<f64>,
}

impl FleetSnapshot {
    /// True when every ready pod was read: only then may the decision scale down.
    pub fn complete(&self) -> bool {
        self.unreachable.is_empty()
    }

    /// No request ran, waited or finished in the window.
    pub fn idle(&self) -> bool {
        self.requests_in_window == 0.0
            && self.running.unwrap_or(0.0) == 0.0
            && self.queue_depth_per_replica.unwrap_or(0.0) == 0.0
            && self.output_tokens_per_second.unwrap_or(0.0) == 0.0
    }
}

/// Scrapes of each pod, kept as long as the evaluation window needs them.
#[derive(Debug, Default)]
pub struct ScrapeWindow {
    window_seconds: f64,
    pods: BTreeMap<String, VecDeque<(f64, PodMetrics)>>,
    /// The pods serve an encoder (see [`ScrapeWindow::set_one_step`]).
    one_step: bool,
}

impl ScrapeWindow {
    pub fn new(window_seconds: f64) -> Self {
        ScrapeWindow { window_seconds, pods: BTreeMap::new(), one_step: false }
    }

    /// An encoder (`spec.model.task` other than generate) answers each request in one step: no
    /// first token and no output tokens. Its requests are counted when they finish (the e2e
    /// histogram stands in for TTFT's) and its work is the input tokens it encodes.
    pub fn set_one_step(&mut self, one_step: bool) {
        self.one_step = one_step;
    }


    pub fn set_window(&mut self, window_seconds: f64) {
        self.window_seconds = window_seconds;
    }

    /// Records this round and returns the snapshot over the window ending at `now`. Pods not in
    /// `observations` are gone and forgotten; an unreachable pod keeps its history so that it
    /// counts again once it answers.
    pub fn observe(&mut self, now: f64, observations: &[PodObservation]) -> FleetSnapshot {
        self.pods.retain(|name, _| observations.iter().any(|o| &o.pod == name && !matches!(o.state, PodState::Loading)));
        let one_step = self.one_step;
        let mut snap = FleetSnapshot::default();
        let mut fleet = FleetHistograms::default();
        let mut waiting_now = 0.0;
        // Per pod over its own span, then summed, like the rates below: one divisor for all pods
        // would divide the old pods' change over the whole window by a new pod's short span.
        let mut growth = None::<f64>;
        let mut kv = Vec::new();
        let mut running = None::<f64>;
        let mut tokens = 0.0;
        let mut requests = 0.0;
        let mut rate_span = f64::INFINITY;
        // Arrivals are fleet totals over the window divided by its length, not sums of per-pod
        // rates: when new pods take over traffic, per-pod rates over different spans count the
        // moved traffic twice (once in the old pods' longer average, once in the new pods').
        let mut arrivals = Totals::default();
        let mut recent_arrivals = Totals::default();
        let mut scraped = 0u32;
        for obs in observations {
            let metrics = match &obs.state {
                PodState::Loading => {
                    snap.loading += 1;
                    continue;
                }
                PodState::Unreachable(err) => {
                    snap.ready += 1;
                    snap.unreachable.push((obs.pod.clone(), err.clone()));
                    continue;
                }
                PodState::Scraped(m) => m,
            };
            snap.ready += 1;
            scraped += 1;
            let history = self.pods.entry(obs.pod.clone()).or_default();
            history.push_back((now, metrics.clone()));
            // Keep the newest scrape at or before the window start as the baseline, drop older ones.
            while history.len() > 2 && history[1].0 <= now - self.window_seconds {
                history.pop_front();
            }
            waiting_now += metrics.waiting.unwrap_or(0.0);
            if let Some(k) = metrics.kv_usage {
                kv.push(k);
            }
            if let Some(r) = metrics.running {
                running = Some(running.unwrap_or(0.0) + r);
            }
            let (t0, base) = &history[0];
            if history.len() < 2 {
                // First scrape of this pod: gauges count, rates need a second scrape.
                continue;
            }
            let span = now - t0;
            fleet.add(metrics, base);
            // Rates per pod over that pod's own span, then summed: pods scraped for different
            // lengths of time (a new pod) must not share one divisor.
            if span > 0.0 {
                if let (Some(a), Some(b)) = (work_tokens(one_step, metrics), work_tokens(one_step, base)) {
                    tokens += (if a >= b { a - b } else { a }) / span;
                }
                if let (Some(a), Some(b)) = (&metrics.e2e, &base.e2e) {
                    requests += a.delta_since(b).map_or(0.0, |d| d.count) / span;
                }
                rate_span = rate_span.min(span);
                let change = metrics.waiting.unwrap_or(0.0) - base.waiting.unwrap_or(0.0);
                growth = Some(growth.unwrap_or(0.0) + change / span);
                arrivals.add(arrived(admitted(one_step, metrics), admitted(one_step, base), metrics, base), span);
            }
            if let Some((t1, prev)) = history.get(history.len() - 2) {
                recent_arrivals.add(arrived(admitted(one_step, metrics), admitted(one_step, prev), metrics, prev), now - t1);
            }
        }
        if scraped > 0 {
            snap.queue_depth_per_replica = Some(waiting_now / f64::from(scraped));
            snap.running = running;
            if !kv.is_empty() {
                snap.kv_cache_usage = Some(kv.iter().sum::<f64>() / kv.len() as f64);
            }
        }
        if rate_span.is_finite() {
            snap.output_tokens_per_second = Some(tokens);
            snap.requests_per_second = Some(requests);
        }
        snap.arrivals_per_second = arrivals.rate();
        snap.recent_arrivals_per_second = recent_arrivals.rate();
        snap.queue_growth_per_second = growth;
        snap.ttft_p95 = fleet.ttft.as_ref().and_then(|h| h.quantile(0.95));
        snap.tpot_p95 = fleet.tpot.as_ref().and_then(|h| h.quantile(0.95));
        snap.e2e_p95 = fleet.e2e.as_ref().and_then(|h| h.quantile(0.95));
        let admitted = if self.one_step { &fleet.e2e } else { &fleet.ttft };
        snap.requests_in_window = admitted.as_ref().map_or(0.0, |h| h.count);
        snap
    }
}

/// The histogram whose count is a pod's admitted requests (see [`ScrapeWindow::set_one_step`]).
fn admitted(one_step: bool, m: &PodMetrics) -> Option<&Histogram> {
    if one_step { m.e2e.as_ref() } else { m.ttft.as_ref() }
}

/// The counter of a pod's work in tokens.
fn work_tokens(one_step: bool, m: &PodMetrics) -> Option<f64> {
    if one_step { m.prompt_tokens } else { m.generation_tokens }
}

/// Requests that arrived at one pod between two scrapes: those admitted (that got a first token;
/// for an encoder, that finished), `a` now and `b` at the base, plus the growth of the waiting
/// queue. `None` without the series.
fn arrived(a: Option<&Histogram>, b: Option<&Histogram>, now: &PodMetrics, base: &PodMetrics) -> Option<f64> {
    let (Some(a), Some(b)) = (a, b) else { return None };
    // A restarted pod's counters start again from zero.
    let admitted = a.delta_since(b).map_or(a.count, |d| d.count);
    let growth = now.waiting.unwrap_or(0.0) - base.waiting.unwrap_or(0.0);
    Some(admitted + growth)
}

/// Counts summed over pods, and the longest span they cover (the window's actual length).
#[derive(Default)]
struct Totals {
    count: Option<f64>,
    span: f64,
}

impl Totals {
    fn add(&mut self, count: Option<f64>, span: f64) {
        if let Some(c) = count {
            if span > 0.0 {
                self.count = Some(self.count.unwrap_or(0.0) + c);
                self.span = self.span.max(span);
            }
        }
    }

    fn rate(&self) -> Option<f64> {
        self.count.map(|c| (c / self.span).max(0.0))
    }
}

/// Sums of per-pod window deltas.
#[derive(Default)]
struct FleetHistograms {
    ttft: Option<Histogram>,
    tpot: Option<Histogram>,
    e2e: Option<Histogram>,
}

impl FleetHistograms {
    fn add(&mut self, now: &PodMetrics, base: &PodMetrics) {
        add_delta(&mut self.ttft, &now.ttft, &base.ttft);
        add_delta(&mut self.tpot, &now.tpot, &base.tpot);
        add_delta(&mut self.e2e, &now.e2e, &base.e2e);
    }
}

/// Adds a pod's window delta to the fleet sum. A pod whose buckets differ from the fleet's (version
/// skew during a rollout) is left out of that percentile rather than mixed in wrongly.
fn add_delta(acc: &mut Option<Histogram>, now: &Option<Histogram>, base: &Option<Histogram>) {
    let (Some(now), Some(base)) = (now, base) else { return };
    let Ok(delta) = now.delta_since(base) else { return };
    match acc {
        Some(sum) => {
            if sum.add(&delta).is_err() {
                tracing::warn!("histogram bucket bounds differ between pods; a pod is left out of the fleet percentile");
            }
        }
        None => *acc = Some(delta),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod_metrics(ttft: &[f64], waiting: f64, tokens: f64) -> PodMetrics {
        let mut h = Histogram::with_bounds(&[0.1, 0.25, 0.5, 1.0, 2.5]);
        for &v in ttft {
            h.observe(v);
        }
        PodMetrics {
            ttft: Some(h.clone()),
            e2e: Some(h),
            waiting: Some(waiting),
            running: Some(1.0),
            kv_usage: Some(0.25),
            generation_tokens: Some(tokens),
            ..Default::default()
        }
    }

    fn scraped(pod: &str, m: PodMetrics) -> PodObservation {
        PodObservation { pod: pod.into(), state: PodState::Scraped(m) }
    }

    #[test]
    fn window_uses_deltas_and_drops_old_observations() {
        let mut w = ScrapeWindow::new(60.0);
        // Slow requests long ago must fall out of the window.
        let old = vec![2.0; 50];
        w.observe(0.0, &[scraped("a", pod_metrics(&old, 0.0, 0.0))]);
        let mut fast = old.clone();
        fast.extend(std::iter::repeat_n(0.05, 100));
        w.observe(30.0, &[scraped("a", pod_metrics(&fast, 0.0, 500.0))]);
        let snap = w.observe(90.0, &[scraped("a", pod_metrics(&fast, 0.0, 1100.0))]);
        // Baseline is the scrape at t=30 (the newest at or before 90-60): nothing finished since.
        assert_eq!(snap.requests_in_window, 0.0);
        assert_eq!(snap.ttft_p95, None);
        assert!((snap.output_tokens_per_second.unwrap() - 10.0).abs() < 1e-9);
        let snap = w.observe(100.0, &[scraped("a", pod_metrics(&fast, 0.0, 1100.0))]);
        // t=90 is inside the window ending at 100, so the baseline stays the scrape at t=30.
        assert_eq!(snap.requests_in_window, 0.0);
    }

    #[test]
    fn unreachable_and_loading_pods_are_reported_not_idle() {
        let mut w = ScrapeWindow::new(60.0);
        let obs = [
            scraped("a", pod_metrics(&[0.05], 2.0, 0.0)),
            PodObservation { pod: "b".into(), state: PodState::Unreachable("connection refused".into()) },
            PodObservation { pod: "c".into(), state: PodState::Loading },
        ];
        let snap = w.observe(0.0, &obs);
        assert_eq!(snap.ready, 2);
        assert_eq!(snap.loading, 1);
        assert!(!snap.complete());
        // The queue is averaged over pods that were read, not diluted by the unreadable one.
        assert_eq!(snap.queue_depth_per_replica, Some(2.0));
    }

    #[test]
    fn fleet_p95_pools_buckets_of_all_pods() {
        let mut w = ScrapeWindow::new(60.0);
        w.observe(0.0, &[scraped("a", pod_metrics(&[], 0.0, 0.0)), scraped("b", pod_metrics(&[], 0.0, 0.0))]);
        let slow = vec![0.8; 19];
        let fast = vec![0.05; 1];
        let snap = w.observe(15.0, &[scraped("a", pod_metrics(&slow, 3.0, 0.0)), scraped("b", pod_metrics(&fast, 1.0, 0.0))]);
        assert_eq!(snap.requests_in_window, 20.0);
        // rank 19 of 20: 1 in the first bucket, 19 in (0.5, 1.0] -> 0.5 + 0.5 * 18/19.
        assert!((snap.ttft_p95.unwrap() - (0.5 + 0.5 * 18.0 / 19.0)).abs() < 1e-9);
        assert_eq!(snap.queue_depth_per_replica, Some(2.0));
        assert!((snap.queue_growth_per_second.unwrap() - 4.0 / 15.0).abs() < 1e-9);
    }

    #[test]
    fn arrivals_count_admissions_and_queue_growth_once_per_fleet() {
        let mut w = ScrapeWindow::new(60.0);
        w.observe(0.0, &[scraped("a", pod_metrics(&[], 0.0, 0.0))]);
        // 30 s later: 60 admitted and 30 more waiting, so 90 arrived: 3 req/s.
        let snap = w.observe(30.0, &[scraped("a", pod_metrics(&vec![0.05; 60], 30.0, 0.0))]);
        assert!((snap.arrivals_per_second.unwrap() - 3.0).abs() < 1e-9);
        assert!((snap.recent_arrivals_per_second.unwrap() - 3.0).abs() < 1e-9);
        // A new pod takes half the traffic for the last 15 s: 15 s × 1 req/s on each pod. Fleet
        // arrivals over the 45 s window are (90 + 15 + 15) / 45, not a + b's own 15-s rate added.
        w.observe(30.0, &[scraped("a", pod_metrics(&vec![0.05; 60], 30.0, 0.0)), scraped("b", pod_metrics(&[], 0.0, 0.0))]);
        let snap = w.observe(
            45.0,
            &[scraped("a", pod_metrics(&vec![0.05; 75], 30.0, 0.0)), scraped("b", pod_metrics(&vec![0.05; 15], 0.0, 0.0))],
        );
        assert!((snap.arrivals_per_second.unwrap() - 120.0 / 45.0).abs() < 1e-9);
        assert!((snap.recent_arrivals_per_second.unwrap() - 2.0).abs() < 1e-9);
    }

    #[test]
    fn encoder_pods_count_finished_requests_and_input_tokens() {
        // An encoder's agent exports an empty TTFT histogram and no output tokens: its requests
        // show in the e2e histogram and its work in the prompt-token counter.
        let encoder = |latencies: &[f64], waiting: f64, prompt_tokens: f64| {
            let empty = Histogram::with_bounds(&[0.1, 0.25, 0.5, 1.0, 2.5]);
            let mut e2e = empty.clone();
            latencies.iter().for_each(|&v| e2e.observe(v));
            PodMetrics {
                ttft: Some(empty),
                e2e: Some(e2e),
                waiting: Some(waiting),
                running: Some(0.0),
                generation_tokens: Some(0.0),
                prompt_tokens: Some(prompt_tokens),
                ..Default::default()
            }
        };
        let mut w = ScrapeWindow::new(60.0);
        w.set_one_step(true);
        w.observe(0.0, &[scraped("a", encoder(&[], 0.0, 0.0))]);
        // 30 s: 60 requests of 16 tokens finished, 30 waiting.
        let snap = w.observe(30.0, &[scraped("a", encoder(&vec![0.05; 60], 30.0, 960.0))]);
        assert_eq!(snap.requests_in_window, 60.0);
        assert!((snap.arrivals_per_second.unwrap() - 3.0).abs() < 1e-9);
        assert!((snap.output_tokens_per_second.unwrap() - 32.0).abs() < 1e-9, "input tokens per second");
        assert!((snap.requests_per_second.unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(snap.ttft_p95, None);
        assert!(snap.e2e_p95.is_some());
        assert!(!snap.idle());
        // Read as a generator, the same pod would look idle but for its queue: no first tokens.
        let mut g = ScrapeWindow::new(60.0);
        g.observe(0.0, &[scraped("a", encoder(&[], 0.0, 0.0))]);
        let snap = g.observe(30.0, &[scraped("a", encoder(&vec![0.05; 60], 0.0, 960.0))]);
        assert_eq!(snap.requests_in_window, 0.0);
    }
}

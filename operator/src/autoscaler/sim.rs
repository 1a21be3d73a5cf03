//! A fleet simulation that drives the real window, capacity and decision code.
//!
//! Each replica is a continuous-batching engine: every step, each running request gets one token
//! and newly admitted requests get their prompt prefilled; a step takes
//! `base + per_seq · batch + per_prefill_token · prefill_tokens` seconds (a CPU-bench-shaped
//! curve, see [`StepModel::smollm2_cpu`]), so latency rises with load, and past the batch limit
//! requests wait in a queue. Requests arrive as a Poisson process following a load trace and go
//! to a random ready replica (as a Service does). Every scrape interval each replica exports
//! cumulative histograms like the agent; the autoscaler sees only those, decides, and the fleet
//! follows, with new replicas spending `startup_seconds` loading before they take traffic.
//!
//! Ground truth for the assertions is measured directly from every simulated request, not from the
//! autoscaler's histograms.

use std::collections::VecDeque;

use peregrine_crds::{AutoscalingSpec, LatencySlo, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::capacity::CapacityEstimator;
use super::decision::{decide, DecisionInput, DecisionState};
use super::histogram::Histogram;
use super::sample::PodMetrics;
use super::window::{PodObservation, PodState, ScrapeWindow};

/// Bucket bounds the agent exports its latency histograms with (seconds).
pub const LATENCY_BUCKETS: [f64; 20] =
    [0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0];

/// Cost of one engine step.
#[derive(Clone, Copy, Debug)]
pub struct StepModel {
    /// Fixed cost of a step (weights streamed once per step), seconds.
    pub base: f64,
    /// Extra per running sequence (attention, sampling), seconds.
    pub per_seq: f64,
    /// Extra per prompt token prefilled in the step, seconds.
    pub per_prefill_token: f64,
    /// Most sequences in one batch (`--max-num-seqs`).
    pub max_num_seqs: usize,
}

impl StepModel {
    /// A linear step-cost curve of the shape the CPU backend's `cpu_bench` prints for SmolLM2-135M
    /// (decode 13 ms/step at batch 1, 58 ms/step at batch 32, prefill 0.46 ms/token).
    ///
    /// NOT YET MEASURED: these figures are assumed, not read from a `cpu_bench` run; replace them
    /// with `cargo run --release -p peregrine-engine --example cpu_bench -- <model> 2` output (the
    /// simulation's assertions are relative to its own calibration, so they hold for any curve).
    pub fn smollm2_cpu() -> Self {
        StepModel { base: 0.0115, per_seq: 0.00145, per_prefill_token: 0.00046, max_num_seqs: 32 }
    }

    fn step_seconds(&self, batch: usize, prefill_tokens: usize) -> f64 {
        self.base + self.per_seq * batch as f64 + self.per_prefill_token * prefill_tokens as f64
    }
}

/// The shape of every request.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub prompt_tokens: usize,
    /// Output tokens are uniform in `[min_output_tokens, max_output_tokens]`.
    pub min_output_tokens: usize,
    pub max_output_tokens: usize,
}

impl Workload {
    pub fn mean_output_tokens(&self) -> f64 {
        (self.min_output_tokens + self.max_output_tokens) as f64 / 2.0
    }
}

#[derive(Clone, Debug)]
struct Request {
    arrival: f64,
    output_tokens: usize,
}

#[derive(Clone, Debug)]
struct Running {
    req: Request,
    generated: usize,
    first_token_at: f64,
}

/// Latencies of one finished request, for the ground truth.
#[derive(Clone, Copy, Debug)]
pub struct Finished {
    pub finished_at: f64,
    pub ttft: f64,
    pub tpot: f64,
}

/// One simulated agent.
#[derive(Clone, Debug)]
struct Replica {
    name: String,
    created_at: f64,
    ready_at: f64,
    /// Set when scaled away: it takes no new requests, finishes what it has, then is gone.
    draining_since: Option<f64>,
    clock: f64,
    inbox: VecDeque<Request>,
    waiting: VecDeque<Request>,
    running: Vec<Running>,
    metrics: PodMetrics,
}

impl Replica {
    fn new(name: String, now: f64, startup: f64) -> Self {
        let hist = Histogram::with_bounds(&LATENCY_BUCKETS);
        Replica {
            name,
            created_at: now,
            ready_at: now + startup,
            draining_since: None,
            clock: now + startup,
            inbox: VecDeque::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            metrics: PodMetrics {
                ttft: Some(hist.clone()),
                tpot: Some(hist.clone()),
                e2e: Some(hist.clone()),
                queue_time: Some(hist),
                running: Some(0.0),
                waiting: Some(0.0),
                kv_usage: Some(0.0),
                generation_tokens: Some(0.0),
                prompt_tokens: Some(0.0),
            },
        }
    }

    fn ready(&self, now: f64) -> bool {
        self.ready_at <= now && self.draining_since.is_none()
    }

    fn empty(&self) -> bool {
        self.inbox.is_empty() && self.waiting.is_empty() && self.running.is_empty()
    }

    /// Runs engine steps until `until`.
    fn advance(&mut self, until: f64, model: &StepModel, workload: &Workload, done: &mut Vec<Finished>) {
        loop {
            while self.inbox.front().is_some_and(|r| r.arrival <= self.clock) {
                if let Some(r) = self.inbox.pop_front() {
                    self.waiting.push_back(r);
                }
            }
            if self.running.is_empty() && self.waiting.is_empty() {
                // Idle: jump to the next arrival.
                match self.inbox.front() {
                    Some(r) if r.arrival < until => {
                        self.clock = self.clock.max(r.arrival);
                        continue;
                    }
                    _ => {
                        self.clock = self.clock.max(until);
                        break;
                    }
                }
            }
            if self.clock >= until {
                break;
            }
            let mut admitted = Vec::new();
            while self.running.len() + admitted.len() < model.max_num_seqs {
                match self.waiting.pop_front() {
                    Some(r) => admitted.push(r),
                    None => break,
                }
            }
            let start = self.clock;
            let step = model.step_seconds(self.running.len() + admitted.len(), admitted.len() * workload.prompt_tokens);
            self.clock += step;
            let end = self.clock;
            let m = &mut self.metrics;
            let tokens = self.running.len() + admitted.len();
            for r in admitted {
                observe(&mut m.queue_time, start - r.arrival);
                observe(&mut m.ttft, end - r.arrival);
                *m.prompt_tokens.get_or_insert(0.0) += workload.prompt_tokens as f64;
                self.running.push(Running { req: r, generated: 0, first_token_at: end });
            }
            for seq in &mut self.running {
                seq.generated += 1;
            }
            let mut i = 0;
            while i < self.running.len() {
                if self.running[i].generated >= self.running[i].req.output_tokens {
                    let seq = self.running.swap_remove(i);
                    let tpot = if seq.generated > 1 { (end - seq.first_token_at) / (seq.generated - 1) as f64 } else { 0.0 };
                    let ttft = seq.first_token_at - seq.req.arrival;
                    observe(&mut m.tpot, tpot);
                    observe(&mut m.e2e, end - seq.req.arrival);
                    done.push(Finished { finished_at: end, ttft, tpot });
                } else {
                    i += 1;
                }
            }
            // Tokens are counted as they are generated, like the agent's counter.
            *m.generation_tokens.get_or_insert(0.0) += tokens as f64;
        }
        self.metrics.running = Some(self.running.len() as f64);
        self.metrics.waiting = Some((self.waiting.len() + self.inbox.iter().filter(|r| r.arrival <= until).count()) as f64);
        self.metrics.kv_usage = Some(self.running.len() as f64 / model.max_num_seqs as f64);
    }
}

fn observe(h: &mut Option<Histogram>, v: f64) {
    if let Some(h) = h.as_mut() {
        h.observe(v);
    }
}

/// Everything a simulation run needs.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub spec: AutoscalingSpec,
    pub model: StepModel,
    pub workload: Workload,
    /// Seconds between scrapes and decisions.
    pub scrape_interval: f64,
    /// Seconds a new replica loads before it takes traffic.
    pub startup_seconds: f64,
    pub initial_replicas: i32,
    pub seed: u64,
}

/// One row of the printed table.
#[derive(Clone, Debug, PartialEq)]
pub struct MinuteRow {
    pub minute: usize,
    /// Requests per second offered.
    pub load: f64,
    /// Replicas at the end of the minute (`spec.replicas`).
    pub replicas: i32,
    /// Replicas ready at the end of the minute.
    pub ready: usize,
    /// Ground-truth p95s of requests that finished in the minute.
    pub ttft_p95: Option<f64>,
    pub tpot_p95: Option<f64>,
    pub finished: usize,
    /// Pod-seconds held (loading, serving or draining) in the minute, / 60.
    pub gpu_minutes: f64,
    /// Oracle's replica count for the minute.
    pub oracle: i32,
}

impl MinuteRow {
    pub fn within_slo(&self, slo: &LatencySlo) -> bool {
        let holds = |p: Option<f64>, target: Option<f64>| p.is_none_or(|p| target.is_none_or(|t| p <= t));
        holds(self.ttft_p95, slo.ttft_p95_seconds) && holds(self.tpot_p95, slo.tpot_p95_seconds)
    }
}

/// Outcome of a run.
#[derive(Clone, Debug)]
pub struct SimReport {
    pub rows: Vec<MinuteRow>,
    /// `(time, replicas)` after every change.
    pub changes: Vec<(f64, i32)>,
    pub gpu_minutes: f64,
    pub oracle_gpu_minutes: f64,
    pub learned_capacity: Option<Throughput>,
}

impl SimReport {
    /// The readable table: minute, load, replicas, ready, oracle, p95s.
    pub fn table(&self) -> String {
        let mut out = String::from("minute  load(req/s)  replicas  ready  oracle  p95_ttft(s)  p95_tpot(ms)  finished\n");
        for r in &self.rows {
            let f = |v: Option<f64>, scale: f64| v.map_or("-".to_string(), |v| format!("{:.3}", v * scale));
            out.push_str(&format!(
                "{:>6}  {:>11.2}  {:>8}  {:>5}  {:>6}  {:>11}  {:>12}  {:>8}\n",
                r.minute,
                r.load,
                r.replicas,
                r.ready,
                r.oracle,
                f(r.ttft_p95, 1.0),
                f(r.tpot_p95, 1000.0),
                r.finished
            ));
        }
        out.push_str(&format!("GPU-minutes: autoscaler {:.1}, oracle {:.1}\n", self.gpu_minutes, self.oracle_gpu_minutes));
        out
    }
}

/// Runs `trace` (requests per second for each minute) through a simulated fleet under the autoscaler.
/// `oracle` gives the replicas an all-knowing scaler would hold each minute.
pub fn run(config: &SimConfig, trace: &[f64], oracle: &dyn Fn(f64) -> i32) -> SimReport {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let spec = &config.spec;
    let mut window = ScrapeWindow::new(f64::from(spec.evaluation_window_seconds));
    let mut decisions = DecisionState::default();
    let mut capacity = CapacityEstimator::new(spec.capacity_per_replica.as_ref());
    let mut replicas_spec = config.initial_replicas;
    let mut next_id = 0usize;
    let mut fleet: Vec<Replica> = Vec::new();
    for _ in 0..replicas_spec {
        fleet.push(Replica::new(format!("pod-{next_id}"), 0.0, 0.0));
        next_id += 1;
    }
    let mut changes = vec![(0.0, replicas_spec)];
    let mut rows = Vec::new();
    let mut gpu_seconds = 0.0;
    let mut oracle_minutes = 0.0;
    let dt = config.scrape_interval;
    let mut t = 0.0f64;
    let mut next_arrival = 0.0f64;
    for (minute, &load) in trace.iter().enumerate() {
        let minute_end = (minute + 1) as f64 * 60.0;
        let mut done = Vec::new();
        let mut minute_gpu = 0.0;
        while t < minute_end - 1e-9 {
            let tick_end = (t + dt).min(minute_end);
            // Poisson arrivals over the tick, each to a random ready replica.
            if next_arrival < t {
                next_arrival = t;
            }
            if load > 0.0 {
                loop {
                    let gap = -(1.0 - rng.random::<f64>()).ln() / load;
                    next_arrival += gap;
                    if next_arrival >= tick_end {
                        next_arrival = tick_end;
                        break;
                    }
                    let ready: Vec<usize> = (0..fleet.len()).filter(|&i| fleet[i].ready(next_arrival)).collect();
                    if ready.is_empty() {
                        // No replica: the request fails (counted as an SLO miss below).
                        done.push(Finished { finished_at: next_arrival, ttft: f64::INFINITY, tpot: 0.0 });
                        continue;
                    }
                    let pick = ready[rng.random_range(0..ready.len())];
                    let output_tokens = rng.random_range(config.workload.min_output_tokens..=config.workload.max_output_tokens);
                    fleet[pick].inbox.push_back(Request { arrival: next_arrival, output_tokens });
                }
            } else {
                next_arrival = tick_end;
            }
            for r in &mut fleet {
                if tick_end > r.ready_at {
                    r.advance(tick_end, &config.model, &config.workload, &mut done);
                }
                minute_gpu += tick_end - t.max(r.created_at);
            }
            // Drained replicas are gone.
            fleet.retain(|r| r.draining_since.is_none() || !r.empty());
            t = tick_end;

            // Scrape and decide.
            let observations: Vec<PodObservation> = fleet
                .iter()
                .filter(|r| r.draining_since.is_none())
                .map(|r| PodObservation {
                    pod: r.name.clone(),
                    state: if r.ready(t) { PodState::Scraped(r.metrics.clone()) } else { PodState::Loading },
                })
                .collect();
            let snapshot = window.observe(t, &observations);
            capacity.learn(&spec.slo, &snapshot);
            let input = DecisionInput {
                now: t,
                current_replicas: replicas_spec,
                snapshot: &snapshot,
                capacity: capacity.per_replica(),
                wake_requested: load > 0.0,
                gpus_per_replica: 1,
            };
            let decision = decide(spec, &mut decisions, &input);
            if decision.to_replicas != replicas_spec {
                resize(&mut fleet, decision.to_replicas, t, config.startup_seconds, &mut next_id);
                replicas_spec = decision.to_replicas;
                changes.push((t, replicas_spec));
            }
        }
        gpu_seconds += minute_gpu;
        let oracle_n = oracle(load);
        oracle_minutes += f64::from(oracle_n);
        let ttfts: Vec<f64> = done.iter().map(|d| d.ttft).collect();
        let tpots: Vec<f64> = done.iter().map(|d| d.tpot).collect();
        rows.push(MinuteRow {
            minute,
            load,
            replicas: replicas_spec,
            ready: fleet.iter().filter(|r| r.ready(t)).count(),
            ttft_p95: p95(&ttfts),
            tpot_p95: p95(&tpots),
            finished: done.len(),
            gpu_minutes: minute_gpu / 60.0,
            oracle: oracle_n,
        });
    }
    SimReport { rows, changes, gpu_minutes: gpu_seconds / 60.0, oracle_gpu_minutes: oracle_minutes, learned_capacity: capacity.per_replica() }
}

/// Adds loading replicas, or drains the newest (loading first, they hold no requests).
fn resize(fleet: &mut Vec<Replica>, to: i32, now: f64, startup: f64, next_id: &mut usize) {
    let active = |f: &Vec<Replica>| f.iter().filter(|r| r.draining_since.is_none()).count() as i32;
    while active(fleet) < to {
        fleet.push(Replica::new(format!("pod-{next_id}"), now, startup));
        *next_id += 1;
    }
    while active(fleet) > to {
        let Some(victim) = fleet.iter_mut().rev().find(|r| r.draining_since.is_none()) else { break };
        victim.draining_since = Some(now);
        if victim.ready_at > now {
            // Never became ready: nothing to drain, and no more time is billed.
            victim.inbox.clear();
            victim.ready_at = now;
        }
    }
    fleet.retain(|r| r.draining_since.is_none() || !r.empty() || r.ready_at > now);
}

/// Exact p95 (nearest rank) of raw values.
pub fn p95(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((0.95 * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Largest request rate one replica sustains for `seconds` with both p95s within `slo`
/// (bisection over steady-state runs): the "benchmarked" capacity the autoscaler is seeded with,
/// and the oracle's sizing rule.
pub fn capacity_at_slo(model: &StepModel, workload: &Workload, slo: &LatencySlo, seconds: f64, seed: u64) -> f64 {
    let holds = |rate: f64| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut r = Replica::new("bench".into(), 0.0, 0.0);
        let mut t = 0.0;
        while t < seconds {
            t += -(1.0 - rng.random::<f64>()).ln() / rate;
            let output_tokens = rng.random_range(workload.min_output_tokens..=workload.max_output_tokens);
            r.inbox.push_back(Request { arrival: t, output_tokens });
        }
        let mut done = Vec::new();
        r.advance(seconds, model, workload, &mut done);
        // Requests still queued at the end count as misses.
        let mut ttfts: Vec<f64> = done.iter().map(|d| d.ttft).collect();
        ttfts.extend(std::iter::repeat_n(f64::INFINITY, r.waiting.len()));
        let tpots: Vec<f64> = done.iter().map(|d| d.tpot).collect();
        // The simulation models generation: an objective left unset holds trivially.
        let holds = |p: Option<f64>, target: Option<f64>| target.is_none_or(|t| p.is_some_and(|v| v <= t));
        holds(p95(&ttfts), slo.ttft_p95_seconds) && holds(p95(&tpots), slo.tpot_p95_seconds)
    };
    let (mut lo, mut hi) = (0.01, 1.0);
    while holds(hi) && hi < 1e4 {
        lo = hi;
        hi *= 2.0;
    }
    for _ in 0..20 {
        let mid = (lo + hi) / 2.0;
        if holds(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The standard scenario of the issue: step up ×4, slow ramp down, spike, idle.
pub fn standard_trace(base_rps: f64) -> Vec<f64> {
    let mut trace = Vec::new();
    trace.extend(std::iter::repeat_n(base_rps, 20)); // 0-19 steady
    trace.extend(std::iter::repeat_n(base_rps * 4.0, 40)); // 20-59 step up ×4
    for m in 0..60 {
        // 60-119 slow ramp back down
        trace.push(base_rps * (4.0 - 3.0 * f64::from(m) / 60.0));
    }
    trace.extend(std::iter::repeat_n(base_rps, 10)); // 120-129
    trace.extend(std::iter::repeat_n(base_rps * 3.0, 5)); // 130-134 spike
    trace.extend(std::iter::repeat_n(base_rps, 15)); // 135-149
    trace.extend(std::iter::repeat_n(0.0, 30)); // 150-179 idle
    trace
}

/// Autoscaling spec used by the standard scenario.
pub fn standard_spec(slo: LatencySlo, capacity: Throughput) -> AutoscalingSpec {
    AutoscalingSpec { capacity_per_replica: Some(capacity), ..AutoscalingSpec::new(1, 16, slo) }
}


//! The scaling decision: a pure function of the spec, a fleet snapshot, the capacity estimate and
//! the recommendations of the last few minutes (kept in [`DecisionState`]).
//!
//! Policy, in order:
//! 1. Zero replicas: stay there until a wake-up is requested, then go straight to the floor (at
//!    least one), skipping stabilization: the first request is waiting.
//! 2. A ready pod whose metrics could not be read: hold (never scale on missing data), except that
//!    `minReplicas`/`maxReplicas` and the provisioned-throughput floor are still enforced.
//! 3. Any signal over its target (p95 TTFT, TPOT, e2e; waiting requests per replica; KV usage):
//!    size the fleet to the demand, `ceil((arrivals + waiting / BACKLOG_DRAIN_SECONDS + growth) /
//!    learned capacity)`, where arrivals are admissions plus the queue's growth (they keep rising
//!    past saturation, unlike completions) and `growth` projects the queue the new pods will find
//!    (see `demand_replicas`). Loading pods are not capacity but count as already ordered (the
//!    target is compared with every replica asked for). Without a capacity estimate, or when the
//!    demand says the ready pods suffice yet the SLO breaks, grow in proportion to the worst ratio
//!    (at most ×2); not while requests wait or a backlog drains (the demand estimate sizes for
//!    them; the window's latencies lag), and with a capacity estimate only once the breach has
//!    lasted `UNEXPLAINED_BREACH_WINDOWS` evaluation windows.
//! 4. Every signal under its target: scale down only when nothing is loading, every latency has
//!    room (p95 under `SCALE_DOWN_LATENCY_HEADROOM` of its objective), to what the demand, the KV
//!    cache and the queue need at the smaller size. Idle past `scaleToZero.idleTimeoutSeconds`
//!    (with `minReplicas: 0`): zero.
//! 5. Stabilization (as the HorizontalPodAutoscaler does it): a scale-up happens to the *lowest*
//!    recommendation of the last `scaleUpStabilizationSeconds`, a scale-down to the *highest*
//!    sustained recommendation of the last `scaleDownStabilizationSeconds` (replicas ordered only
//!    to drain a backlog are not remembered there), so a flapping input moves nothing. Then the
//!    rate limits: at most `max(2n, n+8)` up and halving down per decision. A scale-down that
//!    would undo a scale-up which itself reversed a scale-down waits until
//!    `scaleDownStabilizationSeconds` after that reversal, so the replicas never change direction
//!    twice within one window (e.g. a short spike: down the ramp, up for the spike, and down again
//!    as soon as its backlog is gone).
//! 6. Bounds last: `[max(minReplicas, provisioned floor), maxReplicas]`.

use std::collections::VecDeque;
use std::fmt;

use peregrine_crds::{AutoscalingSpec, ScalingInputs, Throughput};

use super::window::FleetSnapshot;

/// Most a latency/queue ratio multiplies the ready replicas by in one decision.
pub const MAX_SCALE_UP_FACTOR: f64 = 2.0;
/// A scale-up adds at most `max(n, MAX_SCALE_UP_PODS)` replicas per decision. Twice the HPA's
/// default of 4: a small fleet hit by a step must be able to order what the demand estimate
/// says at once, since a backlog queued on the old pods stays there and every scrape of delay
/// adds to it.
pub const MAX_SCALE_UP_PODS: i32 = 8;
/// Waiting requests per replica that count as a growing queue when `maxQueueDepthPerReplica` is unset.
pub const DEFAULT_MAX_QUEUE_DEPTH: f64 = 4.0;
/// A smaller fleet is planned at this fraction of its learned capacity. The capacity is already
/// what a replica sustains *within* the SLO, and the scale-down window takes the highest of its
/// recommendations (the top of ~20 noisy demand samples, about two standard deviations over the
/// mean), so no further margin is taken: one would only hold replicas the demand does not need.
pub const SCALE_DOWN_UTILIZATION: f64 = 1.0;
/// Requests already waiting are sized to be served within this many seconds on top of the arrivals.
pub const BACKLOG_DRAIN_SECONDS: f64 = 60.0;
/// Evaluation windows a breach the demand estimate does not explain must last before it scales
/// up (the up window, if longer, still applies). A burst of slow requests stays in every window
/// that overlaps it, so one bad minute reads as a breach for up to two windows; a capacity
/// estimate that is really too high keeps breaking the SLO beyond that (and is then lowered,
/// see `capacity::BREACHES_TO_LEARN`, which waits as long).
pub const UNEXPLAINED_BREACH_WINDOWS: i32 = 2;
/// A scale-down needs every p95 under this fraction of its objective.
pub const SCALE_DOWN_LATENCY_HEADROOM: f64 = 0.9;

/// Why the replica count is what it is. Its name is the status' `reason` and the metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    TtftAboveSlo,
    TpotAboveSlo,
    E2eAboveSlo,
    QueueDepth,
    KvCacheUsage,
    ProvisionedThroughput,
    MinReplicas,
    MaxReplicas,
    /// Capped by `maxGpus`: each replica holds `resources.gpus` GPUs.
    MaxGpus,
    WithinSlo,
    Underutilized,
    Idle,
    WakeUp,
    MissingMetrics,
    PodsLoading,
    Stabilizing,
}

impl Reason {
    pub const ALL: [Reason; 16] = [
        Reason::TtftAboveSlo,
        Reason::TpotAboveSlo,
        Reason::E2eAboveSlo,
        Reason::QueueDepth,
        Reason::KvCacheUsage,
        Reason::ProvisionedThroughput,
        Reason::MinReplicas,
        Reason::MaxReplicas,
        Reason::MaxGpus,
        Reason::WithinSlo,
        Reason::Underutilized,
        Reason::Idle,
        Reason::WakeUp,
        Reason::MissingMetrics,
        Reason::PodsLoading,
        Reason::Stabilizing,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TtftAboveSlo => "TtftAboveSlo",
            Reason::TpotAboveSlo => "TpotAboveSlo",
            Reason::E2eAboveSlo => "E2eAboveSlo",
            Reason::QueueDepth => "QueueDepth",
            Reason::KvCacheUsage => "KvCacheUsage",
            Reason::ProvisionedThroughput => "ProvisionedThroughput",
            Reason::MinReplicas => "MinReplicas",
            Reason::MaxReplicas => "MaxReplicas",
            Reason::MaxGpus => "MaxGpus",
            Reason::WithinSlo => "WithinSlo",
            Reason::Underutilized => "Underutilized",
            Reason::Idle => "Idle",
            Reason::WakeUp => "WakeUp",
            Reason::MissingMetrics => "MissingMetrics",
            Reason::PodsLoading => "PodsLoading",
            Reason::Stabilizing => "Stabilizing",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything one decision reads besides the spec and its own history.
#[derive(Clone, Debug)]
pub struct DecisionInput<'a> {
    /// Seconds on a monotonic clock.
    pub now: f64,
    /// `spec.replicas` now (what was last asked for, by us or by `kubectl scale`).
    pub current_replicas: i32,
    pub snapshot: &'a FleetSnapshot,
    /// Learned (or seeded) capacity of one replica at the SLO.
    pub capacity: Option<Throughput>,
    /// A request is waiting for a deployment at zero replicas.
    pub wake_requested: bool,
    /// GPUs one replica holds (`resources.gpus`: its tensor-parallel ranks; 0 on the CPU), what
    /// `maxGpus` counts a replica as.
    pub gpus_per_replica: i32,
}

/// The outcome: the replica count to write and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub from_replicas: i32,
    pub to_replicas: i32,
    /// What the signals alone asked for, before stabilization and bounds.
    pub recommendation: i32,
    pub reason: Reason,
    pub message: String,
    pub inputs: ScalingInputs,
}

/// Recommendations remembered for stabilization, and when traffic was last seen.
#[derive(Clone, Debug, Default)]
pub struct DecisionState {
    /// `(time, recommendation, sustained)`: see [`Recommendation::sustained`].
    recommendations: VecDeque<(f64, i32, i32)>,
    last_active: Option<f64>,
    /// Direction (+1/-1) of the last change, and when that direction began if it reversed the
    /// one before (a wake-up from zero counts as no change).
    last_direction: i32,
    reversed_at: Option<f64>,
}

/// The most replicas `spec.maxGpus` allows when each holds `gpus_per_replica` GPUs (None: no
/// budget, or a CPU deployment, which holds none).
pub fn gpu_budget_replicas(spec: &AutoscalingSpec, gpus_per_replica: i32) -> Option<i32> {
    let budget = spec.max_gpus?;
    (gpus_per_replica > 0).then(|| budget.max(0) / gpus_per_replica)
}

/// Decides the replica count for one deployment. `state` carries the history between calls.
pub fn decide(spec: &AutoscalingSpec, state: &mut DecisionState, input: &DecisionInput<'_>) -> Decision {
    let snap = input.snapshot;
    let now = input.now;
    let cur = input.current_replicas.max(0);
    if input.wake_requested || !snap.idle() || state.last_active.is_none() {
        // A freshly started controller has seen no idleness yet; it counts as traffic.
        state.last_active = Some(now);
    }
    if state.recommendations.is_empty() {
        // Without history the current size is the only evidence; a restarted operator must not
        // scale down at once.
        state.recommendations.push_back((now, cur, cur));
    }
    // maxReplicas is the hard cost limit: a provisioned floor above it is cut to it (and the
    // message says so).
    let max_by_replicas = spec.max_replicas.max(spec.min_replicas).max(0);
    // The GPU budget is a cost limit too, counted in replicas of `gpus_per_replica` GPUs (never
    // below minReplicas, which the CRD's rule keeps within it).
    let gpu_cap = gpu_budget_replicas(spec, input.gpus_per_replica).filter(|&c| c < max_by_replicas);
    let max = gpu_cap.map_or(max_by_replicas, |c| c.max(spec.min_replicas).max(0));
    let (floor, floor_reason) = floor(spec, input.capacity.as_ref());
    let floor = floor.min(max);

    let raw = recommend(spec, state, input, cur);
    let (rec, reason, message, stabilize) = (raw.replicas, raw.reason, raw.message, raw.stabilize);

    let mut to = rec;
    let mut reason = reason;
    let mut message = message;
    if stabilize {
        // The window holds what the signals asked for, before the rate limits below: a limit that
        // cut one decision short must not also hold back the next one.
        state.recommendations.push_back((now, rec, raw.sustained));
        let keep = f64::from(
            spec.scale_up_stabilization_seconds
                .max(spec.scale_down_stabilization_seconds)
                .max(UNEXPLAINED_BREACH_WINDOWS * spec.evaluation_window_seconds),
        );
        while state.recommendations.front().is_some_and(|&(t, _, _)| t <= now - keep) && state.recommendations.len() > 1 {
            state.recommendations.pop_front();
        }
        if rec > cur {
            let up_window = if raw.unexplained {
                spec.scale_up_stabilization_seconds.max(UNEXPLAINED_BREACH_WINDOWS * spec.evaluation_window_seconds)
            } else {
                spec.scale_up_stabilization_seconds
            };
            let lowest = recent(state, now, up_window).map(|r| r.0).chain([rec]).min().unwrap_or(rec);
            to = lowest.max(cur).min(max_step_up(cur));
        } else if rec < cur {
            let highest = recent(state, now, spec.scale_down_stabilization_seconds).map(|r| r.1).chain([rec]).max().unwrap_or(rec);
            to = highest.min(cur).max(max_step_down(cur));
            let window = f64::from(spec.scale_down_stabilization_seconds);
            if state.last_direction > 0 && state.reversed_at.is_some_and(|t| now - t < window) {
                to = cur;
            }
        }
        if to == cur && rec != cur {
            message = format!("{reason} recommends {rec}, held at {cur} by the stabilization window: {message}");
            reason = Reason::Stabilizing;
        } else if to != rec {
            message = format!("{message}; {to} this step (at most ×2 or +{MAX_SCALE_UP_PODS} up, half down)");
        }
    }
    // Bounds override everything else.
    if to < floor {
        message = format!("raised from {to} to {floor}: {}", floor_message(spec, floor_reason, input.capacity.as_ref()));
        to = floor;
        reason = floor_reason;
    } else if to > max {
        match (gpu_cap, spec.max_gpus) {
            (Some(_), Some(budget)) => {
                let g = input.gpus_per_replica;
                message = format!("capped from {to} at {max} replicas by maxGpus {budget} ({g} GPUs per replica): {message}");
                reason = Reason::MaxGpus;
            }
            _ => {
                message = format!("capped from {to} at maxReplicas {max}: {message}");
                reason = Reason::MaxReplicas;
            }
        }
        to = max;
    }
    let direction = (to - cur).signum();
    if direction != 0 && cur > 0 {
        if state.last_direction != 0 && direction != state.last_direction {
            state.reversed_at = Some(now);
        }
        state.last_direction = direction;
    }
    Decision { from_replicas: cur, to_replicas: to, recommendation: rec, reason, message, inputs: inputs(snap) }
}

struct Recommendation {
    replicas: i32,
    /// What the demand itself needs, without the extra replicas ordered to drain a backlog (or
    /// held only because a breach forbids scaling down while one drains): what the scale-down
    /// window remembers, so that replicas bought to clear a queue go once it is gone instead of
    /// being held a whole window after it.
    sustained: i32,
    reason: Reason,
    message: String,
    /// Whether stabilization applies (holds on missing data and wake-ups bypass it).
    stabilize: bool,
    /// A breach the demand estimate does not explain (the ready pods have the capacity for the
    /// demand, yet a p95 is over): it must outlast `UNEXPLAINED_BREACH_WINDOWS` evaluation
    /// windows before it scales up.
    unexplained: bool,
}

fn recommend(spec: &AutoscalingSpec, state: &DecisionState, input: &DecisionInput<'_>, cur: i32) -> Recommendation {
    let snap = input.snapshot;
    let hold = |reason, message: String| Recommendation { replicas: cur, sustained: cur, reason, message, stabilize: false, unexplained: false };
    if cur == 0 {
        if input.wake_requested {
            return Recommendation { replicas: 1, sustained: 1, reason: Reason::WakeUp, message: "a request is waiting".into(), stabilize: false, unexplained: false };
        }
        return hold(Reason::Idle, "scaled to zero; waiting for a request".into());
    }
    if !snap.complete() {
        let pods: Vec<&str> = snap.unreachable.iter().map(|(p, _)| p.as_str()).collect();
        return hold(Reason::MissingMetrics, format!("metrics of ready pods {} could not be read; holding", pods.join(", ")));
    }
    if snap.ready == 0 {
        return hold(Reason::PodsLoading, format!("no ready pod yet ({} loading)", snap.loading));
    }

    let ready = f64::from(snap.ready);
    let capacity = input.capacity.as_ref();
    let signals = signals(spec, snap);
    let worst = signals.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((reason, ratio)) = worst.filter(|w| w.1 > 1.0) {
        // Sized against every replica asked for, loading ones included (they were ordered for
        // this demand already): only demand beyond them, or a backlog that kept growing while
        // they load, orders more.
        let by_demand = demand_replicas(snap, capacity, 1.0, Direction::Up, true).unwrap_or(0);
        let by_arrivals = demand_replicas(snap, capacity, 1.0, Direction::Up, false).unwrap_or(0);
        // A draining queue means the capacity already there is catching up on a backlog; the
        // window's latencies still show the overload, so only the demand estimate can add more.
        // Waiting requests likewise: the breach is theirs, and the demand estimate already sizes
        // for serving them; doubling the fleet on top would buy replicas for a queue that the
        // ones just ordered (or just ready) are about to drain.
        let queued = snap.queue_depth_per_replica.is_some_and(|q| q >= 1.0);
        let draining = (snap.queue_growth_per_second.is_some_and(|g| g < 0.0) || queued) && capacity.is_some();
        // Without a capacity estimate (or when it says the fleet suffices, yet the SLO breaks)
        // the ratio is the only guide: grow in proportion to it.
        let proportional =
            if draining || by_demand > snap.ready as i32 { 0 } else { (ready * ratio.min(MAX_SCALE_UP_FACTOR)).ceil() as i32 };
        let replicas = proportional.max(by_demand).max(cur);
        // A breach the demand does not explain (the proportional fallback) is held for the whole
        // window; one the arrivals or a backlog explain is remembered at what the arrivals need.
        let sustained = if proportional > 0 { replicas } else { by_arrivals };
        let message = format!(
            "{} at {:.2}× its target on {} ready pods ({} loading); proportional {proportional}, by demand {by_demand}",
            signal_name(reason),
            ratio,
            snap.ready,
            snap.loading
        );
        // Only a breach the capacity estimate cannot explain is suspect of noise: one minute of
        // bad luck on one pod breaks the window's p95 for as long as it stays in the window.
        let unexplained = proportional > 0 && capacity.is_some();
        return Recommendation { replicas, sustained, reason, message, stabilize: true, unexplained };
    }
    if snap.loading > 0 {
        return hold(Reason::PodsLoading, format!("{} pods loading; no scale-down until they are ready", snap.loading));
    }
    if snap.idle() {
        let idle_for = now_minus(input.now, state.last_active);
        let s2z = &spec.scale_to_zero;
        if s2z.enabled && spec.min_replicas == 0 && idle_for >= f64::from(s2z.idle_timeout_seconds) {
            return Recommendation {
                replicas: 0,
                sustained: 0,
                reason: Reason::Idle,
                message: format!("no traffic for {idle_for:.0}s"),
                stabilize: true, unexplained: false,
            };
        }
        return Recommendation { replicas: 1, sustained: 1, reason: Reason::Underutilized, message: "no traffic in the window".into(), stabilize: true, unexplained: false };
    }
    if let Some((reason, ratio)) = signals.iter().copied().filter(|s| is_latency(s.0)).find(|s| s.1 > SCALE_DOWN_LATENCY_HEADROOM) {
        return Recommendation {
            replicas: cur,
            sustained: cur,
            reason: Reason::WithinSlo,
            message: format!("{} at {:.2}× its target: no room to scale down", signal_name(reason), ratio),
            stabilize: true, unexplained: false,
        };
    }
    let Some(needed) = scale_down_needs(spec, snap, capacity) else {
        return Recommendation {
            replicas: cur,
            sustained: cur,
            reason: Reason::WithinSlo,
            message: "within SLO; capacity per replica not known yet, so no scale-down".into(),
            stabilize: true, unexplained: false,
        };
    };
    let replicas = needed.max(1).min(cur);
    if replicas < cur {
        Recommendation {
            replicas,
            sustained: replicas,
            reason: Reason::Underutilized,
            message: format!("every signal has room at {replicas} replicas (demand, queue and KV cache need {needed})"),
            stabilize: true, unexplained: false,
        }
    } else {
        Recommendation {
            replicas: cur,
            sustained: cur,
            reason: Reason::WithinSlo,
            message: format!("within SLO; {needed} replicas needed"),
            stabilize: true, unexplained: false,
        }
    }
}

/// Most replicas one decision may go to from `cur`.
fn max_step_up(cur: i32) -> i32 {
    (cur * 2).max(cur + MAX_SCALE_UP_PODS)
}

/// Fewest replicas one decision may go to from `cur` (at most halving; zero only from one).
fn max_step_down(cur: i32) -> i32 {
    if cur <= 1 {
        0
    } else {
        (cur + 1) / 2
    }
}

fn now_minus(now: f64, then: Option<f64>) -> f64 {
    then.map_or(0.0, |t| now - t)
}

/// Each available signal as `(reason, measured / target)`.
fn signals(spec: &AutoscalingSpec, snap: &FleetSnapshot) -> Vec<(Reason, f64)> {
    let mut out = Vec::new();
    let mut push = |reason, value: Option<f64>, target: Option<f64>| {
        if let (Some(v), Some(t)) = (value, target) {
            if t > 0.0 && v.is_finite() {
                out.push((reason, v / t));
            }
        }
    };
    push(Reason::TtftAboveSlo, snap.ttft_p95, spec.slo.ttft_p95_seconds);
    push(Reason::TpotAboveSlo, snap.tpot_p95, spec.slo.tpot_p95_seconds);
    push(Reason::E2eAboveSlo, snap.e2e_p95, spec.slo.e2e_p95_seconds);
    push(Reason::QueueDepth, snap.queue_depth_per_replica, Some(max_queue_depth(spec)));
    push(Reason::KvCacheUsage, snap.kv_cache_usage, spec.max_kv_cache_usage);
    out
}

fn is_latency(reason: Reason) -> bool {
    matches!(reason, Reason::TtftAboveSlo | Reason::TpotAboveSlo | Reason::E2eAboveSlo)
}

fn signal_name(reason: Reason) -> &'static str {
    match reason {
        Reason::TtftAboveSlo => "p95 TTFT",
        Reason::TpotAboveSlo => "p95 TPOT",
        Reason::E2eAboveSlo => "p95 e2e latency",
        Reason::QueueDepth => "waiting requests per replica",
        Reason::KvCacheUsage => "KV-cache usage",
        _ => "signal",
    }
}

/// Waiting requests per replica that count as a growing queue.
pub fn max_queue_depth(spec: &AutoscalingSpec) -> f64 {
    spec.max_queue_depth_per_replica.map_or(DEFAULT_MAX_QUEUE_DEPTH, f64::from)
}

/// Which way a demand estimate is used.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
}

/// Requests arriving per second. Up: the larger of the window's and the last interval's estimate
/// (a step up shows in the last interval first). Down: the window's (less noisy; the scale-down
/// window adds the caution). Where the agent's metrics give neither: completions plus the
/// queue's growth.
fn arrivals_per_second(snap: &FleetSnapshot, direction: Direction) -> Option<f64> {
    let recent = snap.recent_arrivals_per_second.filter(|_| direction == Direction::Up);
    match (snap.arrivals_per_second, recent) {
        (Some(a), Some(r)) => Some(a.max(r)),
        (Some(a), None) | (None, Some(a)) => Some(a),
        (None, None) => {
            let rps = snap.requests_per_second?;
            Some(rps + snap.queue_growth_per_second.unwrap_or(0.0).max(0.0))
        }
    }
}

/// Replicas the demand needs with each replica at `utilization` of its learned capacity:
/// `ceil(demand / (capacity × utilization))`, in requests and in output tokens, whichever needs
/// more. With `backlog`, the requests already waiting count too, to be served within
/// `BACKLOG_DRAIN_SECONDS`. `None` without a capacity or a demand measurement.
fn demand_replicas(snap: &FleetSnapshot, capacity: Option<&Throughput>, utilization: f64, direction: Direction, backlog: bool) -> Option<i32> {
    let cap = capacity?;
    let waiting = if backlog { snap.queue_depth_per_replica.unwrap_or(0.0) * f64::from(snap.ready) } else { 0.0 };
    // The backlog new replicas will face is what waits now plus what the queue gains while they
    // start (about `BACKLOG_DRAIN_SECONDS`), all to be served within `BACKLOG_DRAIN_SECONDS`;
    // planning for only what waits now orders replicas one scrape at a time behind a growing
    // queue, and the late ones arrive after the backlog has set the recovery time. Projected once,
    // when the first replicas are ordered: while they load, the growth is the one already planned
    // for, and counting it again at every scrape would order a second fleet for the same queue.
    // And only as far as the arrivals exceed what the ready replicas serve: the window's growth
    // lags, and a queue the ready fleet already outpaces grows no further.
    let arrivals = arrivals_per_second(snap, direction)?;
    // Output tokens per request, as served in the window.
    let tokens_per_request = match (snap.output_tokens_per_second, snap.requests_per_second) {
        (Some(t), Some(r)) if r > 0.0 && t > 0.0 => Some(t / r),
        _ => None,
    };
    let ready_serves = f64::from(snap.ready)
        * cap
            .requests_per_second
            .or(tokens_per_request.map(|tpr| cap.output_tokens_per_second / tpr))
            .unwrap_or(0.0);
    let growth = if backlog && snap.loading == 0 {
        snap.queue_growth_per_second.unwrap_or(0.0).min(arrivals - ready_serves).max(0.0)
    } else {
        0.0
    };
    let rps = arrivals + waiting / BACKLOG_DRAIN_SECONDS + growth;
    let mut needed = None::<f64>;
    let mut need = |n: f64| {
        if n.is_finite() {
            needed = Some(needed.map_or(n, |m: f64| m.max(n)));
        }
    };
    if let Some(cap_rps) = cap.requests_per_second.filter(|c| *c > 0.0) {
        need(rps / (cap_rps * utilization));
    }
    if let Some(tpr) = tokens_per_request.filter(|_| cap.output_tokens_per_second > 0.0) {
        need(rps * tpr / (cap.output_tokens_per_second * utilization));
    }
    // A whisker over a whole number is measurement noise, not a reason for one more replica.
    needed.map(|n| (n - 1e-3).ceil().max(0.0) as i32)
}

/// The fewest replicas with room for every signal, or `None` when throughput cannot be sized yet.
fn scale_down_needs(spec: &AutoscalingSpec, snap: &FleetSnapshot, capacity: Option<&Throughput>) -> Option<i32> {
    let cap = capacity?;
    let ready = f64::from(snap.ready);
    let mut needed = 0.0f64;
    if let Some(n) = demand_replicas(snap, Some(cap), SCALE_DOWN_UTILIZATION, Direction::Down, true) {
        needed = needed.max(f64::from(n));
    } else if let Some(tps) = snap.output_tokens_per_second {
        needed = needed.max(tps / (cap.output_tokens_per_second * SCALE_DOWN_UTILIZATION));
    }
    // KV usage and waiting requests spread over the replicas that remain.
    if let (Some(kv), Some(max_kv)) = (snap.kv_cache_usage, spec.max_kv_cache_usage) {
        needed = needed.max(ready * kv / (max_kv * SCALE_DOWN_UTILIZATION));
    }
    if let Some(q) = snap.queue_depth_per_replica {
        needed = needed.max(ready * q / (max_queue_depth(spec) * 0.5));
    }
    Some(needed.ceil() as i32)
}

/// `max(minReplicas, replicas the provisioned throughput needs at the learned capacity)`.
pub fn floor(spec: &AutoscalingSpec, capacity: Option<&Throughput>) -> (i32, Reason) {
    let min = spec.min_replicas.max(0);
    let provisioned = provisioned_replicas(spec, capacity).unwrap_or(0);
    if provisioned > min {
        (provisioned, Reason::ProvisionedThroughput)
    } else {
        (min, Reason::MinReplicas)
    }
}

/// Replicas whose capacity at the SLO covers `spec.provisionedThroughput`.
pub fn provisioned_replicas(spec: &AutoscalingSpec, capacity: Option<&Throughput>) -> Option<i32> {
    let want = spec.provisioned_throughput.as_ref()?;
    let cap = capacity?;
    let mut n = (want.output_tokens_per_second / cap.output_tokens_per_second).ceil();
    if let (Some(w), Some(c)) = (want.requests_per_second, cap.requests_per_second) {
        n = n.max((w / c).ceil());
    }
    n.is_finite().then_some(n as i32)
}

fn floor_message(spec: &AutoscalingSpec, reason: Reason, capacity: Option<&Throughput>) -> String {
    match (reason, spec.provisioned_throughput.as_ref(), capacity) {
        (Reason::ProvisionedThroughput, Some(p), Some(c)) => format!(
            "provisioned {:.1} output tokens/s at {:.1} per replica",
            p.output_tokens_per_second, c.output_tokens_per_second
        ),
        _ => format!("minReplicas {}", spec.min_replicas),
    }
}

/// `(recommendation, sustained)` of the last `window_seconds`.
fn recent(state: &DecisionState, now: f64, window_seconds: i32) -> impl Iterator<Item = (i32, i32)> + '_ {
    let since = now - f64::from(window_seconds.max(0));
    state.recommendations.iter().filter(move |&&(t, _, _)| t > since).map(|&(_, r, s)| (r, s))
}

fn inputs(snap: &FleetSnapshot) -> ScalingInputs {
    ScalingInputs {
        ready_replicas: Some(snap.ready as i32),
        ttft_p95_seconds: snap.ttft_p95,
        tpot_p95_seconds: snap.tpot_p95,
        e2e_p95_seconds: snap.e2e_p95,
        queue_depth_per_replica: snap.queue_depth_per_replica,
        kv_cache_usage: snap.kv_cache_usage,
        output_tokens_per_second: snap.output_tokens_per_second,
        requests_per_second: snap.requests_per_second,
    }
}

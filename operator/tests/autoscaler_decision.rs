//! The decision function as a pure function over metric snapshots: breach, recovery, flapping input,
//! missing pods, loading pods, min/max, stabilization, provisioned throughput, scale to zero.

use peregrine_crds::{AutoscalingSpec, LatencySlo, ScaleToZero, Throughput};
use peregrine_operator::autoscaler::{decide, DecisionInput, DecisionState, FleetSnapshot, Reason};

fn spec() -> AutoscalingSpec {
    AutoscalingSpec::new(1, 10, LatencySlo { ttft_p95_seconds: Some(0.5), tpot_p95_seconds: Some(0.05), e2e_p95_seconds: None })
}

fn cap(tps: f64) -> Option<Throughput> {
    Some(Throughput { output_tokens_per_second: tps, requests_per_second: None })
}

/// `ready` pods serving `tps` output tokens/s with the given p95s.
fn snap(ready: u32, ttft: f64, tpot: f64, tps: f64) -> FleetSnapshot {
    FleetSnapshot {
        ready,
        ttft_p95: Some(ttft),
        tpot_p95: Some(tpot),
        requests_in_window: 100.0,
        queue_depth_per_replica: Some(0.0),
        queue_growth_per_second: Some(0.0),
        running: Some(f64::from(ready) * 4.0),
        kv_cache_usage: Some(0.3),
        output_tokens_per_second: Some(tps),
        requests_per_second: Some(tps / 100.0),
        ..Default::default()
    }
}

fn idle(ready: u32) -> FleetSnapshot {
    FleetSnapshot {
        ready,
        queue_depth_per_replica: Some(0.0),
        running: Some(0.0),
        output_tokens_per_second: Some(0.0),
        requests_per_second: Some(0.0),
        ..Default::default()
    }
}

/// Feeds `(seconds, snapshot)` rounds, following the decisions; returns the replica count after each.
fn drive(spec: &AutoscalingSpec, start: i32, capacity: Option<Throughput>, rounds: &[(f64, FleetSnapshot)]) -> Vec<(i32, Reason)> {
    let mut state = DecisionState::default();
    let mut cur = start;
    rounds
        .iter()
        .map(|(now, s)| {
            let d = decide(spec, &mut state, &DecisionInput { now: *now, current_replicas: cur, snapshot: s, capacity: capacity.clone(), wake_requested: false, gpus_per_replica: 1 });
            cur = d.to_replicas;
            (cur, d.reason)
        })
        .collect()
}

#[test]
fn ttft_breach_scales_up_proportionally_after_the_up_window() {
    // p95 TTFT 1.5× the SLO on 2 pods: 3 replicas, once the breach has lasted 30 s.
    let s = spec();
    let breach = snap(2, 0.75, 0.02, 400.0);
    let out = drive(&s, 2, None, &[(0.0, breach.clone()), (15.0, breach.clone()), (30.0, breach.clone()), (45.0, breach)]);
    assert_eq!(out[0], (2, Reason::Stabilizing));
    assert_eq!(out[1], (2, Reason::Stabilizing));
    assert_eq!(out[2], (3, Reason::TtftAboveSlo));
}

#[test]
fn large_breach_is_bounded_by_the_max_step() {
    let mut s = spec();
    s.scale_up_stabilization_seconds = 0;
    s.max_replicas = 100;
    // 10× over the SLO on 2 pods: the ratio is capped at ×2 → 4 pods. With a demand estimate of
    // 40 replicas (more with the queue's growth projected), the step is capped at max(2n, n+8) = 10.
    let mut breach = snap(2, 5.0, 0.02, 400.0);
    assert_eq!(drive(&s, 2, None, &[(0.0, breach.clone())])[0], (4, Reason::TtftAboveSlo));
    breach.queue_growth_per_second = Some(39.0); // 39 req/s × 100 tokens on top of 400 tok/s served
    assert_eq!(drive(&s, 2, cap(100.0), &[(0.0, breach)])[0], (10, Reason::TtftAboveSlo));
}

#[test]
fn queue_and_tpot_and_kv_breaches_scale_up() {
    let mut s = spec();
    s.scale_up_stabilization_seconds = 0;
    s.max_kv_cache_usage = Some(0.8);
    let mut queued = snap(2, 0.3, 0.02, 400.0);
    queued.queue_depth_per_replica = Some(6.0); // default limit 4
    assert_eq!(drive(&s, 2, None, &[(0.0, queued)])[0], (3, Reason::QueueDepth));
    assert_eq!(drive(&s, 2, None, &[(0.0, snap(2, 0.3, 0.08, 400.0))])[0], (4, Reason::TpotAboveSlo));
    let mut kv = snap(4, 0.3, 0.02, 400.0);
    kv.kv_cache_usage = Some(0.96);
    assert_eq!(drive(&s, 4, None, &[(0.0, kv)])[0], (5, Reason::KvCacheUsage));
}

#[test]
fn recovery_scales_down_slowly_and_only_with_room_everywhere() {
    let s = spec();
    // 6 pods serving 300 tok/s, capacity 100 per pod (at the SLO): 3 pods, after 300 s.
    let low = snap(6, 0.2, 0.02, 300.0);
    let rounds: Vec<(f64, FleetSnapshot)> = (0..=21).map(|i| (f64::from(i) * 15.0, low.clone())).collect();
    let out = drive(&s, 6, cap(100.0), &rounds);
    assert!(out[..20].iter().all(|o| *o == (6, Reason::Stabilizing)), "{out:?}");
    assert_eq!(out[20], (3, Reason::Underutilized));
    // A p95 close to the SLO (over 90 % of it) leaves no room: hold.
    let tight = snap(6, 0.47, 0.02, 100.0);
    let rounds: Vec<(f64, FleetSnapshot)> = (0..=25).map(|i| (f64::from(i) * 15.0, tight.clone())).collect();
    assert!(drive(&s, 6, cap(100.0), &rounds).iter().all(|o| *o == (6, Reason::WithinSlo)));
    // Without a capacity estimate throughput cannot be sized: hold.
    let rounds: Vec<(f64, FleetSnapshot)> = (0..=25).map(|i| (f64::from(i) * 15.0, low.clone())).collect();
    assert!(drive(&s, 6, None, &rounds).iter().all(|o| o.0 == 6));
    // KV usage that would not fit on fewer pods blocks the scale-down.
    let mut s_kv = spec();
    s_kv.max_kv_cache_usage = Some(0.8);
    let mut kv_full = low.clone();
    kv_full.kv_cache_usage = Some(0.7); // 6 × 0.7 / 0.8 → 6 pods
    let rounds: Vec<(f64, FleetSnapshot)> = (0..=25).map(|i| (f64::from(i) * 15.0, kv_full.clone())).collect();
    assert!(drive(&s_kv, 6, cap(100.0), &rounds).iter().all(|o| o.0 == 6));
}

#[test]
fn scale_down_at_most_halves() {
    let mut s = spec();
    s.scale_down_stabilization_seconds = 0;
    assert_eq!(drive(&s, 9, cap(100.0), &[(0.0, idle(9))])[0], (5, Reason::Underutilized));
}

#[test]
fn flapping_input_moves_nothing() {
    let s = spec();
    // Breach and calm alternate every round for 10 minutes: neither the up window (needs 30 s of
    // breach) nor the down window (needs 300 s of calm) is ever satisfied.
    let rounds: Vec<(f64, FleetSnapshot)> = (0..40)
        .map(|i| {
            let s = if i % 2 == 0 { snap(4, 0.9, 0.02, 100.0) } else { snap(4, 0.1, 0.01, 100.0) };
            (f64::from(i) * 15.0, s)
        })
        .collect();
    let out = drive(&s, 4, cap(100.0), &rounds);
    assert!(out.iter().all(|o| o.0 == 4), "{out:?}");
}

#[test]
fn missing_pods_hold_and_are_never_idle() {
    let mut s = spec();
    s.scale_down_stabilization_seconds = 0;
    s.scale_up_stabilization_seconds = 0;
    // Two pods read as idle, a third unreadable: no scale-down.
    let mut partial = idle(3);
    partial.unreachable.push(("pod-c".into(), "connection refused".into()));
    let out = drive(&s, 3, cap(100.0), &[(0.0, partial.clone()), (15.0, partial.clone())]);
    assert_eq!(out, vec![(3, Reason::MissingMetrics), (3, Reason::MissingMetrics)]);
    // Even a breach seen on the readable pods does not move it, but min/max still apply.
    let mut breach = snap(3, 2.0, 0.02, 100.0);
    breach.unreachable.push(("pod-c".into(), "timeout".into()));
    assert_eq!(drive(&s, 3, None, &[(0.0, breach.clone())])[0], (3, Reason::MissingMetrics));
    assert_eq!(drive(&s, 12, None, &[(0.0, breach)])[0], (10, Reason::MaxReplicas));
}

#[test]
fn loading_pods_are_not_capacity_and_not_scaled_again() {
    let mut s = spec();
    s.scale_up_stabilization_seconds = 0;
    s.scale_down_stabilization_seconds = 0;
    // Scaled 2 → 4 already; 2 ready still breach at 1.8×: 2·1.8 = 4 is already asked for: hold.
    let mut loading = snap(2, 0.9, 0.02, 400.0);
    loading.loading = 2;
    assert_eq!(drive(&s, 4, None, &[(0.0, loading.clone())])[0].0, 4);
    // Calm on the ready pods while others load: no scale-down either.
    let mut calm = idle(2);
    calm.loading = 2;
    assert_eq!(drive(&s, 4, cap(100.0), &[(0.0, calm)])[0], (4, Reason::PodsLoading));
    // No pod ready at all: hold.
    let none = FleetSnapshot { loading: 3, ..Default::default() };
    assert_eq!(drive(&s, 3, None, &[(0.0, none)])[0], (3, Reason::PodsLoading));
}

#[test]
fn min_max_and_provisioned_throughput_bound_the_count() {
    let mut s = spec();
    s.scale_up_stabilization_seconds = 0;
    s.scale_down_stabilization_seconds = 0;
    s.min_replicas = 2;
    s.max_replicas = 5;
    assert_eq!(drive(&s, 1, cap(100.0), &[(0.0, idle(1))])[0], (2, Reason::MinReplicas));
    assert_eq!(drive(&s, 4, None, &[(0.0, snap(4, 5.0, 0.02, 100.0))])[0], (5, Reason::MaxReplicas));
    // 350 tok/s promised at 100 per replica: at least 4, however idle.
    s.provisioned_throughput = Some(Throughput { output_tokens_per_second: 350.0, requests_per_second: None });
    assert_eq!(drive(&s, 5, cap(100.0), &[(0.0, idle(5))])[0], (4, Reason::ProvisionedThroughput));
    assert_eq!(drive(&s, 2, cap(100.0), &[(0.0, idle(2))])[0], (4, Reason::ProvisionedThroughput));
    // Requests per second promised too: the stricter one wins (3 req/s at 0.5 per replica → 6, max 5).
    s.provisioned_throughput = Some(Throughput { output_tokens_per_second: 350.0, requests_per_second: Some(3.0) });
    let c = Some(Throughput { output_tokens_per_second: 100.0, requests_per_second: Some(0.5) });
    assert_eq!(drive(&s, 2, c, &[(0.0, idle(2))])[0].0, 5);
}

#[test]
fn scale_to_zero_after_idle_timeout_and_wake_up() {
    let mut s = spec();
    s.min_replicas = 0;
    s.scale_down_stabilization_seconds = 60;
    s.scale_to_zero = ScaleToZero { enabled: true, idle_timeout_seconds: 120 };
    let mut state = DecisionState::default();
    let mut cur = 1;
    let mut reached_zero_at = None;
    for i in 0..20 {
        let now = f64::from(i) * 15.0;
        let s0 = if cur == 0 { FleetSnapshot::default() } else { idle(cur as u32) };
        let d = decide(&s, &mut state, &DecisionInput { now, current_replicas: cur, snapshot: &s0, capacity: cap(100.0), wake_requested: false, gpus_per_replica: 1 });
        cur = d.to_replicas;
        if cur == 0 && reached_zero_at.is_none() {
            reached_zero_at = Some(now);
        }
    }
    // Idle since t=0: recommended 0 from 120 s on; at 165 s every recommendation in the last 60 s
    // (120, 135, 150, 165) is 0, so the 60 s down window lets it go.
    assert_eq!(reached_zero_at, Some(165.0));
    // At zero, a waiting request wakes it at once (no stabilization).
    let d = decide(&s, &mut state, &DecisionInput { now: 400.0, current_replicas: 0, snapshot: &FleetSnapshot::default(), capacity: cap(100.0), wake_requested: true, gpus_per_replica: 1 });
    assert_eq!((d.to_replicas, d.reason), (1, Reason::WakeUp));
    // Disabled: idle holds at one replica.
    let out = drive(&spec(), 1, cap(100.0), &(0..40).map(|i| (f64::from(i) * 15.0, idle(1))).collect::<Vec<_>>());
    assert!(out.iter().all(|o| o.0 == 1));
}

#[test]
fn restarted_controller_does_not_scale_down_at_once() {
    let s = spec();
    // First decision after a restart sees an idle fleet of 6: the down window starts now.
    let out = drive(&s, 6, cap(100.0), &[(0.0, idle(6)), (15.0, idle(6)), (299.0, idle(6)), (301.0, idle(6))]);
    assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), [6, 6, 6, 3]);
}

/// One round from `cur` replicas of `gpus` GPUs each.
fn decide_with_gpus(s: &AutoscalingSpec, cur: i32, gpus: i32, snapshot: &FleetSnapshot) -> (i32, Reason, String) {
    let mut state = DecisionState::default();
    let d = decide(s, &mut state, &DecisionInput { now: 0.0, current_replicas: cur, snapshot, capacity: None, wake_requested: false, gpus_per_replica: gpus });
    (d.to_replicas, d.reason, d.message)
}

#[test]
fn a_gpu_budget_counts_each_replica_as_its_gpus() {
    // 12 pods over maxReplicas 10 come back down; with maxGpus 16, 4-GPU replicas stop at 4.
    let mut s = spec();
    let busy = snap(12, 0.2, 0.02, 400.0);
    assert_eq!(decide_with_gpus(&s, 12, 4, &busy).0, 10, "no budget: maxReplicas alone");
    s.max_gpus = Some(16);
    let (to, reason, message) = decide_with_gpus(&s, 12, 4, &busy);
    assert_eq!((to, reason), (4, Reason::MaxGpus));
    assert!(message.contains("maxGpus 16 (4 GPUs per replica)"), "{message}");
    // The same budget over 2-GPU replicas allows 8; over 1-GPU replicas maxReplicas binds first.
    assert_eq!(decide_with_gpus(&s, 12, 2, &busy).0, 8);
    let (to, reason, _) = decide_with_gpus(&s, 12, 1, &busy);
    assert_eq!((to, reason), (10, Reason::MaxReplicas));
    // A CPU deployment holds no GPUs: the budget does not apply.
    assert_eq!(decide_with_gpus(&s, 12, 0, &busy).1, Reason::MaxReplicas);
    assert_eq!(peregrine_operator::autoscaler::decision::gpu_budget_replicas(&s, 8), Some(2));
}

//! The autoscaler against a simulated fleet (see `peregrine_operator::autoscaler::sim`): step up ×4,
//! slow ramp down, spike, idle. Run with `--nocapture` to read the minute-by-minute table.

use peregrine_crds::{LatencySlo, Throughput};
use peregrine_operator::autoscaler::decision::BACKLOG_DRAIN_SECONDS;
use peregrine_operator::autoscaler::sim::{self, SimConfig, StepModel, Workload};

/// Minutes after a load rise during which the fleet may still be catching up: the rise is seen at
/// the next scrape, must persist through the scale-up stabilization window, the new pods load,
/// and then the backlog queued meanwhile is drained (the policy sizes for that within
/// `BACKLOG_DRAIN_SECONDS`). Per-minute p95s count requests by finish time, so one more minute
/// passes before a minute holds only requests that arrived after the backlog was gone.
/// With the standard scenario: 15 + 30 + 60 + 60 = 165 s → 3 minutes, + 1 = 4.
fn reaction_minutes(config: &SimConfig) -> usize {
    let seconds = config.scrape_interval
        + f64::from(config.spec.scale_up_stabilization_seconds)
        + config.startup_seconds
        + BACKLOG_DRAIN_SECONDS;
    (seconds / 60.0).ceil() as usize + 1
}

#[test]
fn standard_trace_holds_the_slo_without_flapping_near_oracle_cost() {
    let slo = LatencySlo { ttft_p95_seconds: 0.5, tpot_p95_seconds: 0.05, e2e_p95_seconds: None };
    let model = StepModel::smollm2_cpu();
    let workload = Workload { prompt_tokens: 128, min_output_tokens: 32, max_output_tokens: 96 };
    // The "benchmark": the highest request rate one replica holds the SLO at.
    let per_replica_rps = sim::capacity_at_slo(&model, &workload, &slo, 1800.0, 7);
    assert!(per_replica_rps > 1.0, "calibration found no capacity: {per_replica_rps}");
    let capacity = Throughput {
        output_tokens_per_second: per_replica_rps * workload.mean_output_tokens(),
        requests_per_second: Some(per_replica_rps),
    };
    let spec = sim::standard_spec(slo.clone(), capacity);
    let config = SimConfig {
        spec: spec.clone(),
        model,
        workload,
        scrape_interval: 15.0,
        startup_seconds: 60.0,
        initial_replicas: 2,
        seed: 42,
    };
    let trace = sim::standard_trace(1.5 * per_replica_rps);
    let min = spec.min_replicas;
    let oracle = move |load: f64| ((load / per_replica_rps).ceil() as i32).max(min);
    let report = sim::run(&config, &trace, &oracle);
    let reaction = reaction_minutes(&config);
    println!("capacity per replica at the SLO: {per_replica_rps:.2} req/s");
    println!("{}", report.table());
    println!("replica changes (seconds, replicas): {:?}", report.changes);

    // 1. The SLO holds in >= 95 % of the minutes with traffic, outside the reaction time after rises.
    let rises: Vec<usize> = (1..trace.len()).filter(|&m| trace[m] > trace[m - 1] * 1.2).collect();
    let judged: Vec<_> = report
        .rows
        .iter()
        .filter(|r| r.finished > 0 && !rises.iter().any(|&m| r.minute >= m && r.minute < m + reaction))
        .collect();
    let held = judged.iter().filter(|r| r.within_slo(&slo)).count();
    let share = held as f64 / judged.len() as f64;
    println!("reaction bound {reaction} min; SLO held in {held}/{} judged minutes ({:.1} %)", judged.len(), share * 100.0);
    assert!(share >= 0.95, "SLO held in {held}/{} judged minutes ({:.1} %)", judged.len(), share * 100.0);
    // ... and the reaction is bounded: within reaction of each rise the SLO holds again.
    for &m in &rises {
        let recovered = report.rows[m..(m + reaction + 1).min(report.rows.len())].iter().any(|r| r.within_slo(&slo) && r.finished > 0);
        assert!(recovered, "no recovery within {reaction} minutes of the rise at minute {m}");
    }

    // 2. No oscillation: direction reversals at least one scale-down stabilization window apart.
    let mut reversals = Vec::new();
    let mut last_dir = 0i32;
    for w in report.changes.windows(2) {
        let dir = (w[1].1 - w[0].1).signum();
        if last_dir != 0 && dir != last_dir {
            reversals.push(w[1].0);
        }
        last_dir = dir;
    }
    let window = f64::from(spec.scale_down_stabilization_seconds);
    for pair in reversals.windows(2) {
        assert!(pair[1] - pair[0] >= window, "replicas reversed direction twice within {window} s: {reversals:?}");
    }

    // 3. Cost within 20 % of an oracle that knows the trace in advance.
    let ratio = report.gpu_minutes / report.oracle_gpu_minutes;
    println!("direction reversals at {reversals:?} s; GPU-minutes ×{ratio:.3} of the oracle");
    assert!((0.8..=1.2).contains(&ratio), "GPU-minutes {:.1} vs oracle {:.1} (×{ratio:.3})", report.gpu_minutes, report.oracle_gpu_minutes);
}

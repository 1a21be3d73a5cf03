//! Table tests of the rollout state machine: every transition, as a pure function of
//! (spec, observed state, previous status, annotations, suite result).

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use peregrine_crds::{
    Mismatch, RegressionSpec, RolloutSpec, RolloutStatus, RolloutStep, RolloutStrategy, StepResult, CONDITION_ROLLOUT_FAILED,
    CONDITION_ROLLOUT_PAUSED, CONDITION_ROLLOUT_PROGRESSING,
};
use peregrine_operator::rollout::machine::{canary_replicas, plan, Action, CanaryState, Controls, Failure, Input, Observed, Plan};

const S: &str = "stable0001";
const U: &str = "update0002";
const V: &str = "update0003";

fn t0() -> Timestamp {
    Timestamp::from_second(1_700_000_000).unwrap()
}

fn at(secs: i64) -> Timestamp {
    t0() + SignedDuration::from_secs(secs)
}

/// Steps as (canary replicas, pause seconds, run regression).
fn spec(steps: &[(i32, i32, bool)]) -> RolloutSpec {
    RolloutSpec {
        strategy: RolloutStrategy::Canary,
        steps: steps
            .iter()
            .map(|&(n, pause, regression)| RolloutStep { canary_replicas: Some(n), canary_percent: None, pause_seconds: pause, run_regression: regression })
            .collect(),
        regression: Some(RegressionSpec { suite: Default::default(), thresholds: Default::default() }),
        max_failures: 0,
        progress_deadline_seconds: 600,
        auto_promote: true,
    }
}

/// A rollout of U over S at `step`, started at t0, its canary first seen ready at `secs`.
fn ready_since(step: i32, secs: i64) -> RolloutStatus {
    RolloutStatus { canary_ready_at: Some(Time(at(secs))), ..at_step(step) }
}

/// A rollout of U over S at `step`, started at t0.
fn at_step(step: i32) -> RolloutStatus {
    RolloutStatus {
        current_revision: Some(S.into()),
        update_revision: Some(U.into()),
        current_step: Some(step),
        current_step_started_at: Some(Time(t0())),
        ..Default::default()
    }
}

fn canary(revision: &str, replicas: i32, ready: bool) -> Option<CanaryState> {
    Some(CanaryState { revision: Some(revision.into()), replicas, ready, crash_looping: false })
}

fn observed(stable: Option<&str>, canary: Option<CanaryState>) -> Observed {
    Observed { stable_revision: stable.map(Into::into), stable_rolled_out: true, canary, failed: None }
}

fn result(step: i32, passed: bool) -> StepResult {
    StepResult {
        step,
        passed,
        pass_rate: if passed { 1.0 } else { 0.5 },
        cases: 2,
        failed_cases: if passed { 0 } else { 1 },
        mismatches: if passed {
            vec![]
        } else {
            vec![Mismatch { case: "capital".into(), expected: "Paris".into(), got: "Lyon".into(), reason: "output does not contain the expected text".into() }]
        },
        message: if passed { "2/2 cases passed".into() } else { "1/2 cases passed: pass rate 50% is below 100%".into() },
        ..Default::default()
    }
}

/// One row: the inputs that differ from a default rollout of U over S with spec `[(1,0,true),(2,0,true)]`.
struct Row {
    name: &'static str,
    rollout: Option<RolloutSpec>,
    replicas: i32,
    update: &'static str,
    status: RolloutStatus,
    observed: Observed,
    controls: Controls,
    suite: Option<StepResult>,
    now: Timestamp,
    /// `summary` of the plan.
    want: &'static str,
}

fn row(name: &'static str, want: &'static str) -> Row {
    Row {
        name,
        rollout: Some(spec(&[(1, 0, true), (2, 0, true)])),
        replicas: 4,
        update: U,
        status: RolloutStatus::default(),
        observed: observed(Some(S), None),
        controls: Controls::default(),
        suite: None,
        now: t0(),
        want,
    }
}

fn run(r: &Row) -> Plan {
    plan(&Input {
        rollout: r.rollout.as_ref(),
        replicas: r.replicas,
        update_revision: r.update,
        status: &r.status,
        observed: &r.observed,
        controls: &r.controls,
        suite: r.suite.as_ref(),
        now: r.now,
    })
}

/// A one-line description of a plan, compared with the table.
fn summary(p: &Plan) -> String {
    let actions: Vec<String> = p
        .actions
        .iter()
        .map(|a| match a {
            Action::EnsureCanary { replicas } => format!("canary({replicas})"),
            Action::DeleteCanary => "delete-canary".into(),
            Action::RunRegression { step } => format!("regress({step})"),
            Action::Event { warning, reason, .. } => format!("{}{reason}", if *warning { "!" } else { "" }),
        })
        .collect();
    let cond = |t: &str| p.condition(t).map(|c| if c.status { c.reason.clone() } else { "-".into() }).unwrap_or_default();
    format!(
        "stable={:?} actions=[{}] step={} current={} update={} progressing={} paused={} failed={} requeue={}",
        p.stable,
        actions.join(","),
        p.status.current_step.map_or("none".into(), |s| s.to_string()),
        p.status.current_revision.as_deref().unwrap_or("none"),
        p.status.update_revision.as_deref().unwrap_or("none"),
        cond(CONDITION_ROLLOUT_PROGRESSING),
        cond(CONDITION_ROLLOUT_PAUSED),
        cond(CONDITION_ROLLOUT_FAILED),
        p.requeue.map_or("none".into(), |d| format!("{}s", d.as_secs())),
    )
}

fn table() -> Vec<Row> {
    vec![
        // --- nothing to roll out from, or no staged rollout asked for ---
        Row {
            observed: observed(None, None),
            ..row("first deployment applies the spec at once", "stable=Update actions=[] step=none current=update0002 update=update0002 progressing=- paused=- failed=- requeue=none")
        },
        Row { rollout: None, ..row("no rollout spec updates in place", "stable=Update actions=[] step=none current=update0002 update=update0002 progressing=- paused=- failed=- requeue=none") },
        Row {
            rollout: Some(RolloutSpec { strategy: RolloutStrategy::Recreate, ..spec(&[]) }),
            ..row("Recreate updates in place", "stable=Update actions=[] step=none current=update0002 update=update0002 progressing=- paused=- failed=- requeue=none")
        },
        Row {
            observed: observed(Some(U), None),
            status: RolloutStatus { current_revision: Some(U.into()), update_revision: Some(U.into()), ..Default::default() },
            ..row("settled: stable runs the spec", "stable=Update actions=[] step=none current=update0002 update=update0002 progressing=- paused=- failed=- requeue=none")
        },
        // --- a rollout starts and waits for its canary ---
        row("a change starts step 1 with its canary", "stable=Keep actions=[RolloutStarted,canary(1)] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=- failed=- requeue=10s"),
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            now: at(60),
            ..row("canary not ready yet: wait", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(S, 1, true)),
            now: at(60),
            ..row("a canary of another revision is not ready", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            now: at(601),
            ..row("canary never ready: step fails after the deadline, rollback", "stable=Keep actions=[delete-canary,!CanaryNotReady] step=none current=stable0001 update=update0002 progressing=- paused=- failed=CanaryNotReady requeue=none")
        },
        Row {
            rollout: Some(RolloutSpec { max_failures: 3, ..spec(&[(1, 0, true), (2, 0, true)]) }),
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            now: at(600),
            ..row("the progress deadline ignores maxFailures: no retry, rollback", "stable=Keep actions=[delete-canary,!CanaryNotReady] step=none current=stable0001 update=update0002 progressing=- paused=- failed=CanaryNotReady requeue=none")
        },
        Row {
            rollout: Some(RolloutSpec { progress_deadline_seconds: 60, ..spec(&[(1, 0, true), (2, 0, true)]) }),
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            now: at(59),
            ..row("progressDeadlineSeconds from the spec: still waiting", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
        Row {
            rollout: Some(RolloutSpec { progress_deadline_seconds: 60, ..spec(&[(1, 0, true), (2, 0, true)]) }),
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            now: at(60),
            ..row("progressDeadlineSeconds from the spec: missed", "stable=Keep actions=[delete-canary,!CanaryNotReady] step=none current=stable0001 update=update0002 progressing=- paused=- failed=CanaryNotReady requeue=none")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), Some(CanaryState { revision: Some(U.into()), replicas: 1, ready: false, crash_looping: true })),
            now: at(599),
            ..row("a crash-looping canary waits out its deadline", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
        Row {
            status: ready_since(0, 100),
            observed: observed(Some(S), canary(U, 1, false)),
            now: at(650),
            ..row("a canary that loses readiness starts the step over", "stable=Keep actions=[canary(1),!CanaryLostReadiness] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
        Row {
            status: ready_since(0, 100),
            observed: observed(Some(S), Some(CanaryState { revision: Some(U.into()), replicas: 1, ready: false, crash_looping: true })),
            now: at(650),
            ..row("a crash-looping canary that was ready keeps its deadline", "stable=Keep actions=[!CanaryLostReadiness,delete-canary,!CanaryNotReady] step=none current=stable0001 update=update0002 progressing=- paused=- failed=CanaryNotReady requeue=none")
        },
        // --- pause, regression, advance ---
        Row {
            rollout: Some(spec(&[(1, 300, true), (2, 0, true)])),
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            now: at(100),
            ..row("a canary first seen ready starts the pause", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=StepPause paused=StepPause failed=- requeue=300s")
        },
        Row {
            rollout: Some(spec(&[(1, 300, true), (2, 0, true)])),
            status: ready_since(0, 500),
            observed: observed(Some(S), canary(U, 1, true)),
            now: at(700),
            ..row("the pause counts from canaryReadyAt, not the step's start", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=StepPause paused=StepPause failed=- requeue=100s")
        },
        Row {
            rollout: Some(spec(&[(1, 300, true), (2, 0, true)])),
            status: ready_since(0, 500),
            observed: observed(Some(S), canary(U, 1, true)),
            now: at(800),
            ..row("the pause over, the suite runs", "stable=Keep actions=[canary(1),regress(0)] step=0 current=stable0001 update=update0002 progressing=RunningRegression paused=- failed=- requeue=10s")
        },
        Row {
            rollout: Some(spec(&[(1, 300, true), (2, 0, true)])),
            status: ready_since(0, 500),
            observed: observed(Some(S), canary(U, 1, true)),
            now: at(2000),
            ..row("a ready canary is past any deadline", "stable=Keep actions=[canary(1),regress(0)] step=0 current=stable0001 update=update0002 progressing=RunningRegression paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            now: at(100),
            ..row("ready canary gets the regression suite", "stable=Keep actions=[canary(1),regress(0)] step=0 current=stable0001 update=update0002 progressing=RunningRegression paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            suite: Some(result(0, true)),
            now: at(100),
            ..row("a passed run moves to the next step", "stable=Keep actions=[canary(1),RegressionPassed] step=1 current=stable0001 update=update0002 progressing=StepAdvanced paused=- failed=- requeue=1s")
        },
        Row {
            status: RolloutStatus { step_results: vec![result(0, true)], ..at_step(0) },
            observed: observed(Some(S), canary(U, 1, true)),
            now: at(100),
            ..row("a step that passed is not run again", "stable=Keep actions=[canary(1)] step=1 current=stable0001 update=update0002 progressing=StepAdvanced paused=- failed=- requeue=1s")
        },
        Row {
            rollout: Some(spec(&[(1, 0, false), (2, 0, true)])),
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            ..row("a step without regression advances once ready", "stable=Keep actions=[canary(1)] step=1 current=stable0001 update=update0002 progressing=StepAdvanced paused=- failed=- requeue=1s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            suite: Some(result(0, false)),
            ..row("a failed run rolls back (maxFailures 0)", "stable=Keep actions=[delete-canary,!RegressionFailed] step=none current=stable0001 update=update0002 progressing=- paused=- failed=RegressionFailed requeue=none")
        },
        Row {
            rollout: Some(RolloutSpec { max_failures: 1, ..spec(&[(1, 0, true), (2, 0, true)]) }),
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            suite: Some(result(0, false)),
            ..row("a failed run is retried while maxFailures allows", "stable=Keep actions=[canary(1),!StepFailed] step=0 current=stable0001 update=update0002 progressing=RetryingStep paused=- failed=- requeue=30s")
        },
        Row {
            rollout: Some(RolloutSpec { max_failures: 1, ..spec(&[(1, 0, true), (2, 0, true)]) }),
            status: RolloutStatus { failures: 1, step_results: vec![result(0, false)], ..at_step(0) },
            observed: observed(Some(S), canary(U, 1, true)),
            suite: Some(result(0, false)),
            ..row("the failure past maxFailures rolls back", "stable=Keep actions=[delete-canary,!RegressionFailed] step=none current=stable0001 update=update0002 progressing=- paused=- failed=RegressionFailed requeue=none")
        },
        // --- promotion ---
        Row {
            status: at_step(1),
            observed: observed(Some(S), canary(U, 2, true)),
            suite: Some(result(1, true)),
            ..row("the last step passing promotes: stable takes the update, canary stays", "stable=Update actions=[canary(2),RegressionPassed] step=2 current=stable0001 update=update0002 progressing=Promoting paused=- failed=- requeue=10s")
        },
        Row {
            rollout: Some(RolloutSpec { auto_promote: false, ..spec(&[(1, 0, true), (2, 0, true)]) }),
            status: RolloutStatus { step_results: vec![result(1, true)], ..at_step(1) },
            observed: observed(Some(S), canary(U, 2, true)),
            ..row("autoPromote off waits for the promote annotation", "stable=Keep actions=[canary(2)] step=1 current=stable0001 update=update0002 progressing=AwaitingPromotion paused=AwaitingPromotion failed=- requeue=none")
        },
        Row {
            status: at_step(2),
            observed: Observed { stable_rolled_out: false, ..observed(Some(U), canary(U, 2, true)) },
            ..row("promoting: canary kept until stable has rolled out", "stable=Update actions=[] step=2 current=stable0001 update=update0002 progressing=Promoting paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(2),
            observed: observed(Some(U), canary(U, 2, true)),
            ..row("promoted: canary removed, update is current", "stable=Update actions=[Promoted,delete-canary] step=none current=update0002 update=update0002 progressing=- paused=- failed=- requeue=none")
        },
        // --- edits, annotations, failures held ---
        Row {
            update: V,
            status: RolloutStatus { step_results: vec![result(0, true)], failures: 1, ..at_step(1) },
            observed: observed(Some(S), canary(U, 2, true)),
            now: at(50),
            ..row("an edit mid-rollout restarts from step 1 with the new revision", "stable=Keep actions=[RolloutRestarted,canary(1)] step=0 current=stable0001 update=update0003 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
        Row {
            update: S,
            status: at_step(1),
            observed: observed(Some(S), canary(U, 2, true)),
            ..row("reverting the spec mid-rollout cancels it", "stable=Update actions=[RolloutCancelled,delete-canary] step=none current=stable0001 update=stable0001 progressing=- paused=- failed=- requeue=none")
        },
        Row {
            status: at_step(1),
            observed: observed(Some(S), canary(U, 2, true)),
            controls: Controls { abort: Some(U.into()), ..Default::default() },
            ..row("abort annotation rolls back", "stable=Keep actions=[delete-canary,!Aborted] step=none current=stable0001 update=update0002 progressing=- paused=- failed=Aborted requeue=none")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            controls: Controls { abort: Some(V.into()), ..Default::default() },
            ..row("an abort naming another revision is ignored", "stable=Keep actions=[canary(1),regress(0)] step=0 current=stable0001 update=update0002 progressing=RunningRegression paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            controls: Controls { promote: Some(U.into()), ..Default::default() },
            ..row("promote annotation skips the remaining steps", "stable=Update actions=[PromotedByAnnotation] step=2 current=stable0001 update=update0002 progressing=Promoting paused=- failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, true)),
            controls: Controls { paused: true, ..Default::default() },
            ..row("pause annotation holds the step (no regression run)", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=PausedByAnnotation paused=PausedByAnnotation failed=- requeue=60s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            controls: Controls { paused: true, ..Default::default() },
            now: at(60),
            ..row("pause annotation before the canary is ready is reported", "stable=Keep actions=[canary(1)] step=0 current=stable0001 update=update0002 progressing=CanaryStarting paused=PausedByAnnotation failed=- requeue=10s")
        },
        Row {
            status: at_step(0),
            observed: observed(Some(S), canary(U, 1, false)),
            controls: Controls { paused: true, ..Default::default() },
            now: at(600),
            ..row("pause annotation does not stop the progress deadline", "stable=Keep actions=[delete-canary,!CanaryNotReady] step=none current=stable0001 update=update0002 progressing=- paused=- failed=CanaryNotReady requeue=none")
        },
        Row {
            status: RolloutStatus { current_revision: Some(S.into()), update_revision: Some(U.into()), ..Default::default() },
            observed: Observed {
                failed: Some(Failure { revision: U.into(), reason: "RegressionFailed".into(), message: "step 1: ...".into() }),
                ..observed(Some(S), canary(U, 1, true))
            },
            ..row("a failed revision is not retried", "stable=Keep actions=[delete-canary] step=none current=stable0001 update=update0002 progressing=- paused=- failed=RegressionFailed requeue=none")
        },
        Row {
            update: V,
            status: RolloutStatus { current_revision: Some(S.into()), update_revision: Some(U.into()), ..Default::default() },
            observed: Observed {
                failed: Some(Failure { revision: U.into(), reason: "RegressionFailed".into(), message: "step 1: ...".into() }),
                ..observed(Some(S), None)
            },
            ..row("after a failure, a new spec rolls out again", "stable=Keep actions=[RolloutStarted,canary(1)] step=0 current=stable0001 update=update0003 progressing=CanaryStarting paused=- failed=- requeue=10s")
        },
    ]
}

#[test]
fn every_transition() {
    let mut failures = Vec::new();
    for r in table() {
        let got = summary(&run(&r));
        if got != r.want {
            failures.push(format!("{}\n  want {}\n  got  {}", r.name, r.want, got));
        }
    }
    assert!(failures.is_empty(), "{} row(s) differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn failure_condition_and_event_name_the_failing_cases() {
    let mut r = row("", "");
    r.status = at_step(0);
    r.observed = observed(Some(S), canary(U, 1, true));
    r.suite = Some(result(0, false));
    let p = run(&r);
    let failed = p.condition(CONDITION_ROLLOUT_FAILED).unwrap();
    assert!(failed.message.contains("capital") && failed.message.contains("Lyon") && failed.message.contains("50%"), "{}", failed.message);
    let note = p.actions.iter().find_map(|a| match a {
        Action::Event { warning: true, note, .. } => Some(note.clone()),
        _ => None,
    });
    assert_eq!(note.as_deref(), Some(failed.message.as_str()));
    assert_eq!(p.status.failures, 1);
    assert_eq!(p.status.step_results.len(), 1);
    assert!(!p.status.step_results[0].passed);
}

#[test]
fn restart_clears_results_and_records_the_step_start() {
    let mut r = row("", "");
    r.update = V;
    r.status = RolloutStatus { step_results: vec![result(0, true)], failures: 1, ..at_step(1) };
    r.now = at(50);
    let p = run(&r);
    assert_eq!(p.status.failures, 0);
    assert!(p.status.step_results.is_empty());
    assert_eq!(p.status.current_step_started_at, Some(Time(at(50))));
}

#[test]
fn a_passed_result_is_recorded_and_the_next_step_clock_starts() {
    let mut r = row("", "");
    r.status = at_step(0);
    r.observed = observed(Some(S), canary(U, 1, true));
    r.suite = Some(result(0, true));
    r.now = at(100);
    let p = run(&r);
    assert_eq!(p.status.step_results, vec![result(0, true)]);
    assert_eq!(p.status.current_step_started_at, Some(Time(at(100))));
    assert_eq!(p.status.canary_ready_at, None, "the next step's canary has yet to be ready");
}

#[test]
fn canary_readiness_is_recorded_once_and_the_step_start_kept() {
    let mut r = row("", "");
    r.rollout = Some(spec(&[(1, 300, true), (2, 0, true)]));
    r.status = at_step(0);
    r.observed = observed(Some(S), canary(U, 1, true));
    r.now = at(500);
    let p = run(&r);
    assert_eq!(p.status.canary_ready_at, Some(Time(at(500))));
    assert_eq!(p.status.current_step_started_at, Some(Time(t0())));
    // Seen again later: the first moment stays.
    r.status = p.status;
    r.now = at(600);
    assert_eq!(run(&r).status.canary_ready_at, Some(Time(at(500))));
}

#[test]
fn lost_readiness_restarts_the_deadline_unless_crash_looping() {
    let mut r = row("", "");
    r.status = ready_since(0, 100);
    r.observed = observed(Some(S), canary(U, 1, false));
    r.now = at(650);
    let p = run(&r);
    assert_eq!(p.status.canary_ready_at, None);
    assert_eq!(p.status.current_step_started_at, Some(Time(at(650))));
    assert_eq!(p.status.failures, 0);

    r.observed = observed(Some(S), Some(CanaryState { revision: Some(U.into()), replicas: 1, ready: false, crash_looping: true }));
    r.now = at(300);
    let p = run(&r);
    assert_eq!(p.status.current_step_started_at, Some(Time(t0())), "a crash loop keeps the step's deadline");
}

#[test]
fn a_missed_deadline_is_not_a_regression_failure() {
    let mut r = row("", "");
    r.rollout = Some(RolloutSpec { max_failures: 2, ..spec(&[(1, 0, true), (2, 0, true)]) });
    r.status = RolloutStatus { failures: 1, ..at_step(0) };
    r.observed = observed(Some(S), Some(CanaryState { revision: Some(U.into()), replicas: 1, ready: false, crash_looping: true }));
    r.now = at(600);
    let p = run(&r);
    assert_eq!(p.status.failures, 1, "maxFailures counts failed regression runs only");
    let last = p.status.step_results.last().unwrap();
    assert!(!last.passed);
    assert_eq!((last.cases, last.started_at.clone(), last.finished_at.clone()), (0, Some(Time(t0())), Some(Time(at(600)))));
    let failed = p.condition(CONDITION_ROLLOUT_FAILED).unwrap();
    assert!(
        failed.message.contains("progressDeadlineSeconds (600s)") && failed.message.contains("crash-looping") && failed.message.starts_with("step 1:"),
        "{}",
        failed.message
    );
}

#[test]
fn a_retried_step_waits_for_readiness_again_before_its_pause() {
    let mut r = row("", "");
    r.rollout = Some(RolloutSpec { max_failures: 1, ..spec(&[(1, 60, true), (2, 0, true)]) });
    r.status = ready_since(0, 10);
    r.observed = observed(Some(S), canary(U, 1, true));
    r.suite = Some(result(0, false));
    r.now = at(100);
    let p = run(&r);
    assert_eq!(p.status.canary_ready_at, None);
    assert_eq!(p.status.current_step_started_at, Some(Time(at(100))));
    r.status = p.status;
    r.suite = None;
    r.now = at(130);
    let p = run(&r);
    assert_eq!(p.status.canary_ready_at, Some(Time(at(130))));
    assert_eq!(p.requeue, Some(Duration::from_secs(60)), "a full pause again");
}

#[test]
fn crash_looping_canary_is_reported_while_waiting() {
    let mut r = row("", "");
    r.status = at_step(0);
    r.observed = observed(Some(S), Some(CanaryState { revision: Some(U.into()), replicas: 1, ready: false, crash_looping: true }));
    let p = run(&r);
    assert!(p.condition(CONDITION_ROLLOUT_PROGRESSING).unwrap().message.contains("crash-looping"));
}

#[test]
fn canary_percent_rounds_up_and_never_below_one() {
    let pct = |p: i32| RolloutStep { canary_replicas: None, canary_percent: Some(p), pause_seconds: 0, run_regression: false };
    assert_eq!(canary_replicas(&pct(25), 10), 3);
    assert_eq!(canary_replicas(&pct(50), 4), 2);
    assert_eq!(canary_replicas(&pct(10), 1), 1);
    assert_eq!(canary_replicas(&pct(100), 0), 1);
    let fixed = RolloutStep { canary_replicas: Some(2), ..pct(1) };
    assert_eq!(canary_replicas(&fixed, 10), 2);
}

#[test]
fn annotations_are_read() {
    let a = [
        ("serving.peregrine.dev/rollout-paused".to_string(), "True".to_string()),
        ("serving.peregrine.dev/rollout-promote".to_string(), " update0002 ".to_string()),
        ("serving.peregrine.dev/rollout-abort".to_string(), "".to_string()),
    ]
    .into_iter()
    .collect();
    let c = Controls::from_annotations(Some(&a));
    assert_eq!(c, Controls { paused: true, promote: Some(U.into()), abort: None });
    assert_eq!(Controls::from_annotations(None), Controls::default());
}

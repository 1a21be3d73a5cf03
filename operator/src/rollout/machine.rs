//! The rollout state machine: a pure function from (spec, observed cluster state, previous status,
//! control annotations, a regression result) to what should happen next.
//!
//! Everything a rollout needs to remember lives in `status.rollout` and in the cluster itself (the
//! revision annotations of the stable and canary Deployments), so the controller can restart at any
//! moment and [`plan`] picks up where it was.
//!
//! Phases, for an update revision `U` and a stable revision `S` (what the stable Deployment runs):
//! - settled (`U == S`, or nothing to roll out from): the stable Deployment takes the spec as is;
//! - step `i` of `n`: the canary Deployment runs `U` with the step's replica count next to the
//!   untouched stable one; its pods must be ready within `progressDeadlineSeconds` of the step's
//!   start (else the rollout fails, whatever `maxFailures` says); once they are, `pauseSeconds`
//!   counted from that moment (`canaryReadyAt`) must pass, then the regression suite runs (if the
//!   step asks), and a pass moves on to step `i + 1`;
//! - promoting (step index `n`): the stable Deployment takes `U` (a rolling update that never drops
//!   below its replica count) while the canary keeps serving; once stable has rolled out, the canary
//!   goes and `U` becomes current;
//! - failed: the canary is removed, stable is untouched, and `U` is not tried again until the spec
//!   changes (to anything, including back to `S`).

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use peregrine_crds::{
    RolloutSpec, RolloutStatus, RolloutStep, RolloutStrategy, StepResult, ANNOTATION_ROLLOUT_ABORT, ANNOTATION_ROLLOUT_PAUSED,
    ANNOTATION_ROLLOUT_PROMOTE, CONDITION_ROLLOUT_FAILED, CONDITION_ROLLOUT_PAUSED, CONDITION_ROLLOUT_PROGRESSING,
};

/// Requeue while waiting on pods (canary starting, stable rolling out during promotion).
pub const WAIT: Duration = Duration::from_secs(10);
/// Requeue after a failed step that may be retried.
pub const RETRY: Duration = Duration::from_secs(30);
/// Requeue right after a step completed, to start the next at once.
pub const NEXT: Duration = Duration::from_secs(1);
/// Step results kept in the status (oldest dropped first).
pub const MAX_STEP_RESULTS: usize = 20;

/// Reasons of the three rollout conditions.
pub mod reasons {
    pub const STABLE: &str = "Stable";
    pub const CANARY_STARTING: &str = "CanaryStarting";
    pub const STEP_PAUSE: &str = "StepPause";
    pub const RUNNING_REGRESSION: &str = "RunningRegression";
    pub const STEP_ADVANCED: &str = "StepAdvanced";
    pub const RETRYING_STEP: &str = "RetryingStep";
    pub const AWAITING_PROMOTION: &str = "AwaitingPromotion";
    pub const PROMOTING: &str = "Promoting";
    pub const PAUSED_BY_ANNOTATION: &str = "PausedByAnnotation";
    pub const NOT_PAUSED: &str = "NotPaused";
    pub const ROLLED_BACK: &str = "RolledBack";
    pub const NO_FAILURE: &str = "NoFailure";
    pub const REGRESSION_FAILED: &str = "RegressionFailed";
    pub const CANARY_NOT_READY: &str = "CanaryNotReady";
    pub const CANARY_LOST_READINESS: &str = "CanaryLostReadiness";
    pub const ABORTED: &str = "Aborted";
    // Event reasons.
    pub const ROLLOUT_STARTED: &str = "RolloutStarted";
    pub const ROLLOUT_RESTARTED: &str = "RolloutRestarted";
    pub const ROLLOUT_CANCELLED: &str = "RolloutCancelled";
    pub const REGRESSION_PASSED: &str = "RegressionPassed";
    pub const STEP_FAILED: &str = "StepFailed";
    pub const PROMOTED: &str = "Promoted";
    pub const PROMOTED_BY_ANNOTATION: &str = "PromotedByAnnotation";
}

/// What the control annotations of the ModelDeployment ask.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Controls {
    pub paused: bool,
    /// Promote this update revision now.
    pub promote: Option<String>,
    /// Roll this update revision back.
    pub abort: Option<String>,
}

impl Controls {
    pub fn from_annotations(annotations: Option<&BTreeMap<String, String>>) -> Self {
        let get = |key: &str| annotations.and_then(|a| a.get(key)).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        Controls {
            paused: get(ANNOTATION_ROLLOUT_PAUSED).is_some_and(|v| v.eq_ignore_ascii_case("true")),
            promote: get(ANNOTATION_ROLLOUT_PROMOTE),
            abort: get(ANNOTATION_ROLLOUT_ABORT),
        }
    }
}

/// The canary Deployment as observed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CanaryState {
    /// Its revision annotation.
    pub revision: Option<String>,
    /// Its desired replicas.
    pub replicas: i32,
    /// Every desired replica runs the current template and is available.
    pub ready: bool,
    /// A canary pod's container is in CrashLoopBackOff.
    pub crash_looping: bool,
}

/// A rollout that failed (read back from the `RolloutFailed` condition and `status.rollout`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub revision: String,
    pub reason: String,
    pub message: String,
}

/// The cluster as observed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Revision annotation of the stable Deployment; `None` when it does not exist yet.
    pub stable_revision: Option<String>,
    /// The stable Deployment has rolled out its template on every replica.
    pub stable_rolled_out: bool,
    pub canary: Option<CanaryState>,
    pub failed: Option<Failure>,
}

/// Everything [`plan`] decides on.
#[derive(Clone, Debug)]
pub struct Input<'a> {
    /// `spec.rollout`; `None` updates in place.
    pub rollout: Option<&'a RolloutSpec>,
    /// `spec.replicas` (canary percentages are of this).
    pub replicas: i32,
    /// Revision of the pod template the spec asks for now.
    pub update_revision: &'a str,
    /// `status.rollout` as last written.
    pub status: &'a RolloutStatus,
    pub observed: &'a Observed,
    pub controls: &'a Controls,
    /// Result of the regression run the previous plan asked for, if it has been run.
    pub suite: Option<&'a StepResult>,
    pub now: Timestamp,
}

/// Which template the stable Deployment gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StableTemplate {
    /// The one it has (the stable revision keeps serving unchanged).
    Keep,
    /// The spec's, i.e. the update revision.
    Update,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Create or update the canary Deployment with the update revision and this many replicas.
    EnsureCanary { replicas: i32 },
    DeleteCanary,
    /// Run the regression suite against the canary for this step, then plan again with its result.
    RunRegression { step: i32 },
    Event { warning: bool, reason: &'static str, note: String },
}

/// A rollout condition, before times are attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cond {
    pub type_: &'static str,
    pub status: bool,
    pub reason: String,
    pub message: String,
}

impl Cond {
    fn new(type_: &'static str, status: bool, reason: &str, message: impl Into<String>) -> Self {
        Cond { type_, status, reason: reason.to_string(), message: message.into() }
    }
}

/// What to do.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub stable: StableTemplate,
    pub actions: Vec<Action>,
    pub status: RolloutStatus,
    /// `RolloutProgressing`, `RolloutPaused`, `RolloutFailed`, in that order.
    pub conditions: Vec<Cond>,
    pub requeue: Option<Duration>,
}

impl Plan {
    pub fn condition(&self, type_: &str) -> Option<&Cond> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

/// Canary pods of a step: its count, or its percentage of `replicas` rounded up; at least one.
pub fn canary_replicas(step: &RolloutStep, replicas: i32) -> i32 {
    let n = match (step.canary_replicas, step.canary_percent) {
        (Some(n), _) => n,
        (None, Some(p)) => (u64::from(p.max(0).unsigned_abs()) * u64::from(replicas.max(0).unsigned_abs())).div_ceil(100).min(i32::MAX as u64) as i32,
        (None, None) => 1,
    };
    n.max(1)
}

/// Decides the next move. See the module documentation for the phases.
pub fn plan(input: &Input) -> Plan {
    let Some(stable_revision) = input.observed.stable_revision.as_deref() else {
        // First deployment: nothing serves yet, so there is nothing to protect or compare with.
        return settled(input, Vec::new());
    };
    let spec = match input.rollout {
        Some(s) if s.strategy == RolloutStrategy::Canary && !s.steps.is_empty() => s,
        _ => return settled(input, Vec::new()),
    };
    if stable_revision == input.update_revision {
        return settle_or_finish_promotion(input, spec);
    }
    if let Some(failure) = input.observed.failed.as_ref().filter(|f| f.revision == input.update_revision) {
        return hold_failed(input, stable_revision, failure);
    }
    progress(input, spec, stable_revision)
}

fn conditions(progressing: Cond, paused: Option<Cond>, failed: Option<Cond>) -> Vec<Cond> {
    vec![
        progressing,
        paused.unwrap_or_else(|| Cond::new(CONDITION_ROLLOUT_PAUSED, false, reasons::NOT_PAUSED, "")),
        failed.unwrap_or_else(|| Cond::new(CONDITION_ROLLOUT_FAILED, false, reasons::NO_FAILURE, "")),
    ]
}

fn event(warning: bool, reason: &'static str, note: impl Into<String>) -> Action {
    Action::Event { warning, reason, note: note.into() }
}

/// The spec's revision is (or becomes at once) the stable one; no canary.
fn settled(input: &Input, mut actions: Vec<Action>) -> Plan {
    let upd = input.update_revision;
    let keep_results = input.status.update_revision.as_deref() == Some(upd);
    if input.observed.canary.is_some() {
        actions.push(Action::DeleteCanary);
    }
    Plan {
        stable: StableTemplate::Update,
        actions,
        status: RolloutStatus {
            current_revision: Some(upd.to_string()),
            update_revision: Some(upd.to_string()),
            current_step: None,
            current_step_started_at: None,
            canary_ready_at: None,
            failures: if keep_results { input.status.failures } else { 0 },
            step_results: if keep_results { input.status.step_results.clone() } else { Vec::new() },
        },
        conditions: conditions(Cond::new(CONDITION_ROLLOUT_PROGRESSING, false, reasons::STABLE, format!("revision {upd} is serving")), None, None),
        requeue: None,
    }
}

/// Stable runs the update revision: either a promotion is finishing, or there is nothing to do.
fn settle_or_finish_promotion(input: &Input, spec: &RolloutSpec) -> Plan {
    let upd = input.update_revision;
    let status = input.status;
    let was_rolling_out_this = status.update_revision.as_deref() == Some(upd) && status.current_step.is_some();
    let promoting = was_rolling_out_this && status.current_step.is_some_and(|s| s as usize >= spec.steps.len());
    if promoting && !input.observed.stable_rolled_out {
        // The canary keeps serving until every stable pod runs the new revision.
        return Plan {
            stable: StableTemplate::Update,
            actions: Vec::new(),
            status: status.clone(),
            conditions: conditions(
                Cond::new(CONDITION_ROLLOUT_PROGRESSING, true, reasons::PROMOTING, format!("stable pods are being replaced by revision {upd}")),
                None,
                None,
            ),
            requeue: Some(WAIT),
        };
    }
    let mut actions = Vec::new();
    if promoting {
        actions.push(event(false, reasons::PROMOTED, format!("revision {upd} promoted; canary removed")));
    } else if status.current_step.is_some() && status.update_revision.as_deref().is_some_and(|u| u != upd) {
        actions.push(event(
            false,
            reasons::ROLLOUT_CANCELLED,
            format!("spec reverted to the stable revision {upd}: rollout of {} cancelled", status.update_revision.as_deref().unwrap_or_default()),
        ));
    }
    settled(input, actions)
}

/// A failed update revision stays rolled back until the spec changes.
fn hold_failed(input: &Input, stable_revision: &str, failure: &Failure) -> Plan {
    let mut status = input.status.clone();
    status.current_revision = Some(stable_revision.to_string());
    status.update_revision = Some(input.update_revision.to_string());
    status.current_step = None;
    status.current_step_started_at = None;
    status.canary_ready_at = None;
    Plan {
        stable: StableTemplate::Keep,
        actions: if input.observed.canary.is_some() { vec![Action::DeleteCanary] } else { Vec::new() },
        status,
        conditions: conditions(
            Cond::new(
                CONDITION_ROLLOUT_PROGRESSING,
                false,
                reasons::ROLLED_BACK,
                format!("revision {} was rolled back to {stable_revision}; change the spec to roll out again", input.update_revision),
            ),
            None,
            Some(Cond::new(CONDITION_ROLLOUT_FAILED, true, &failure.reason, failure.message.clone())),
        ),
        requeue: None,
    }
}

fn push_result(status: &mut RolloutStatus, result: StepResult) {
    status.step_results.push(result);
    let excess = status.step_results.len().saturating_sub(MAX_STEP_RESULTS);
    status.step_results.drain(..excess);
}

fn since(now: Timestamp, then: Option<&Time>) -> Duration {
    then.map_or(Duration::ZERO, |t| Duration::try_from(now.duration_since(t.0)).unwrap_or(Duration::ZERO))
}

/// A canary rollout under way (or starting) from `stable_revision` to the update revision.
/// The status to carry on from: this rollout's, or a fresh one at its first step when the update
/// (or the stable revision) changed, with the event saying which.
fn begin_rollout(input: &Input, n: i32, stable_revision: &str, actions: &mut Vec<Action>) -> RolloutStatus {
    let upd = input.update_revision;
    let now = Time(input.now);
    let mut st = input.status.clone();
    let same_rollout = st.update_revision.as_deref() == Some(upd) && st.current_revision.as_deref() == Some(stable_revision) && st.current_step.is_some();
    if !same_rollout {
        match (&st.current_step, st.update_revision.as_deref()) {
            (Some(_), Some(old)) if old != upd => actions.push(event(
                false,
                reasons::ROLLOUT_RESTARTED,
                format!("spec changed during the rollout of {old}: rolling out {upd} from the first step"),
            )),
            _ => actions.push(event(false, reasons::ROLLOUT_STARTED, format!("rolling out revision {upd} over {stable_revision} in {n} step(s)"))),
        }
        st = RolloutStatus {
            current_revision: Some(stable_revision.to_string()),
            update_revision: Some(upd.to_string()),
            current_step: Some(0),
            current_step_started_at: Some(now.clone()),
            canary_ready_at: None,
            failures: 0,
            step_results: Vec::new(),
        };
    }
    st
}

/// One step of a rollout under way: what each phase of [`progress`] reads.
struct StepCtx<'a> {
    input: &'a Input<'a>,
    spec: &'a RolloutSpec,
    stable_revision: &'a str,
    /// Index of the current step, `0..n`.
    step: i32,
    n: i32,
    /// `step i/n`, for messages.
    label: String,
}

impl StepCtx<'_> {
    fn step_spec(&self) -> &RolloutStep {
        &self.spec.steps[self.step as usize]
    }

    fn running(&self, reason: &str, message: String) -> Cond {
        Cond::new(CONDITION_ROLLOUT_PROGRESSING, true, reason, message)
    }

    /// A plan that keeps stable as it is and holds the rollout where it is.
    fn hold(&self, status: RolloutStatus, actions: Vec<Action>, progressing: Cond, paused: Option<Cond>, requeue: Option<Duration>) -> Plan {
        Plan { stable: StableTemplate::Keep, actions, status, conditions: conditions(progressing, paused, None), requeue }
    }
}

/// A rollout under way: start (or carry on), honour the abort and promote annotations, then walk
/// the current step through its phases: canary ready → annotation pause → step pause → regression
/// → advance.
fn progress(input: &Input, spec: &RolloutSpec, stable_revision: &str) -> Plan {
    let upd = input.update_revision;
    let n = spec.steps.len() as i32;
    let mut actions = Vec::new();
    let mut st = begin_rollout(input, n, stable_revision, &mut actions);

    if input.controls.abort.as_deref() == Some(upd) {
        return fail(input, st, stable_revision, actions, reasons::ABORTED, format!("rollout of {upd} aborted by annotation"));
    }
    let step = promote_by_annotation(input, n, &mut st, &mut actions);
    if step >= n {
        return promoting(st, actions, upd);
    }
    let ctx = StepCtx { input, spec, stable_revision, step, n, label: format!("step {}/{n}", step + 1) };

    let target = canary_replicas(ctx.step_spec(), input.replicas);
    actions.push(Action::EnsureCanary { replicas: target });
    let ready = input.observed.canary.as_ref().is_some_and(|c| c.revision.as_deref() == Some(upd) && c.replicas == target && c.ready);
    if !ready {
        return canary_not_ready(&ctx, st, actions, target);
    }
    // The step's observation (its pause, then its regression run) counts from here.
    let ready_at = st.canary_ready_at.get_or_insert(Time(input.now)).clone();
    if input.controls.paused {
        return paused_by_annotation(&ctx, st, actions);
    }
    if let Some(left) = pause_left(&ctx, &ready_at) {
        return step_pause(&ctx, st, actions, left);
    }
    match regression(&ctx, &mut st, &mut actions) {
        Regression::Passed => advance(&ctx, st, actions),
        Regression::Run => ctx.hold(
            st,
            actions,
            ctx.running(reasons::RUNNING_REGRESSION, format!("{}: running the regression suite against the canary", ctx.label)),
            None,
            Some(WAIT),
        ),
        Regression::Failed(result) => step_failed(input, spec, st, stable_revision, actions, result, reasons::REGRESSION_FAILED),
    }
}

/// The promote annotation naming the update skips the remaining steps; returns the step to be in.
fn promote_by_annotation(input: &Input, n: i32, st: &mut RolloutStatus, actions: &mut Vec<Action>) -> i32 {
    let upd = input.update_revision;
    let step = st.current_step.unwrap_or(0);
    if input.controls.promote.as_deref() != Some(upd) || step >= n {
        return step;
    }
    actions.push(event(false, reasons::PROMOTED_BY_ANNOTATION, format!("promoting {upd} now, skipping step(s) {}..{n}", step + 1)));
    st.current_step = Some(n);
    st.current_step_started_at = Some(Time(input.now));
    st.canary_ready_at = None;
    n
}

/// The pause annotation holds a step whose canary is ready.
fn paused_by_annotation(ctx: &StepCtx, st: RolloutStatus, actions: Vec<Action>) -> Plan {
    let label = &ctx.label;
    ctx.hold(
        st,
        actions,
        ctx.running(reasons::PAUSED_BY_ANNOTATION, format!("{label}: paused")),
        Some(Cond::new(CONDITION_ROLLOUT_PAUSED, true, reasons::PAUSED_BY_ANNOTATION, format!("{label}: paused by annotation; remove it to resume"))),
        Some(Duration::from_secs(60)),
    )
}

/// What is left of the step's `pauseSeconds`, counted from the moment its canary was ready.
fn pause_left(ctx: &StepCtx, ready_at: &Time) -> Option<Duration> {
    let pause = Duration::from_secs(u64::from(ctx.step_spec().pause_seconds.max(0).unsigned_abs()));
    let observed_for = since(ctx.input.now, Some(ready_at));
    (observed_for < pause).then(|| pause - observed_for)
}

fn step_pause(ctx: &StepCtx, st: RolloutStatus, actions: Vec<Action>, left: Duration) -> Plan {
    let label = &ctx.label;
    ctx.hold(
        st,
        actions,
        ctx.running(reasons::STEP_PAUSE, format!("{label}: canary ready; pausing")),
        Some(Cond::new(CONDITION_ROLLOUT_PAUSED, true, reasons::STEP_PAUSE, format!("{label}: {}s of the step's pause left", left.as_secs()))),
        Some(left),
    )
}

/// Where the step's regression suite stands.
enum Regression {
    /// Passed now or earlier in this step, or the step runs none.
    Passed,
    /// Not run yet for this step: asked for.
    Run,
    Failed(StepResult),
}

fn regression(ctx: &StepCtx, st: &mut RolloutStatus, actions: &mut Vec<Action>) -> Regression {
    let step = ctx.step;
    let passed_already = st.step_results.iter().any(|r| r.step == step && r.passed);
    if !ctx.step_spec().run_regression || passed_already {
        return Regression::Passed;
    }
    match ctx.input.suite.filter(|r| r.step == step) {
        None => {
            actions.push(Action::RunRegression { step });
            Regression::Run
        }
        Some(result) if !result.passed => Regression::Failed(result.clone()),
        Some(result) => {
            actions.push(event(false, reasons::REGRESSION_PASSED, format!("{}: {}", ctx.label, result.message)));
            push_result(st, result.clone());
            Regression::Passed
        }
    }
}

/// The step passed: the next step, promotion, or (last step without `autoPromote`) a wait for the
/// promote annotation.
fn advance(ctx: &StepCtx, mut st: RolloutStatus, actions: Vec<Action>) -> Plan {
    let (step, n, upd) = (ctx.step, ctx.n, ctx.input.update_revision);
    if step + 1 == n && !ctx.spec.auto_promote {
        return ctx.hold(
            st,
            actions,
            ctx.running(reasons::AWAITING_PROMOTION, format!("every step passed; {upd} awaits promotion")),
            Some(Cond::new(
                CONDITION_ROLLOUT_PAUSED,
                true,
                reasons::AWAITING_PROMOTION,
                format!("annotate {ANNOTATION_ROLLOUT_PROMOTE}={upd} to promote (autoPromote is off)"),
            )),
            None,
        );
    }
    st.current_step = Some(step + 1);
    st.current_step_started_at = Some(Time(ctx.input.now));
    st.canary_ready_at = None;
    if step + 1 == n {
        return promoting(st, actions, upd);
    }
    ctx.hold(st, actions, ctx.running(reasons::STEP_ADVANCED, format!("{} passed; starting step {}/{n}", ctx.label, step + 2)), None, Some(NEXT))
}

/// The step's canary is not (or no longer) ready: wait for it until the progress deadline, then fail.
fn canary_not_ready(ctx: &StepCtx, mut st: RolloutStatus, mut actions: Vec<Action>, target: i32) -> Plan {
    let (input, label) = (ctx.input, &ctx.label);
    let upd = input.update_revision;
    let now = Time(input.now);
    let canary = input.observed.canary.as_ref();
    let crash = canary.is_some_and(|c| c.crash_looping);
    let note = if crash { " (a canary pod is crash-looping)" } else { "" };
    if st.canary_ready_at.take().is_some() {
        // Ready earlier in this step, not any more (a pod restarted or was evicted): its
        // observation starts over once it is ready again, and so does its deadline, except
        // for a crash-looping canary, whose brief ready spells must not hold the rollout forever.
        if !crash {
            st.current_step_started_at = Some(now.clone());
        }
        actions.push(event(true, reasons::CANARY_LOST_READINESS, format!("{label}: canary pods of {upd} are no longer ready{note}")));
    }
    let deadline = Duration::from_secs(u64::from(ctx.spec.progress_deadline_seconds.max(1).unsigned_abs()));
    if since(input.now, st.current_step_started_at.as_ref()) >= deadline {
        let result = StepResult {
            step: ctx.step,
            passed: false,
            started_at: st.current_step_started_at.clone(),
            finished_at: Some(now),
            message: format!("canary pods not ready within progressDeadlineSeconds ({}s){note}", deadline.as_secs()),
            ..Default::default()
        };
        // Not a regression failure: a canary that cannot become ready is not retried, whatever
        // maxFailures allows.
        let message = describe_failure(&result);
        push_result(&mut st, result);
        return fail(input, st, ctx.stable_revision, actions, reasons::CANARY_NOT_READY, message);
    }
    // The annotation holds the step once its canary is ready; the deadline still runs.
    let paused = input.controls.paused.then(|| {
        Cond::new(
            CONDITION_ROLLOUT_PAUSED,
            true,
            reasons::PAUSED_BY_ANNOTATION,
            format!("{label}: paused by annotation (the canary is not ready yet; progressDeadlineSeconds still applies)"),
        )
    });
    ctx.hold(
        st,
        actions,
        ctx.running(reasons::CANARY_STARTING, format!("{label}: waiting for {target} canary pod(s) of {upd} to be ready{note}")),
        paused,
        Some(WAIT),
    )
}

/// Every step passed (or promotion was asked for): stable takes the update; the canary stays until
/// stable has rolled out.
fn promoting(status: RolloutStatus, actions: Vec<Action>, upd: &str) -> Plan {
    Plan {
        stable: StableTemplate::Update,
        actions,
        status,
        conditions: conditions(
            Cond::new(CONDITION_ROLLOUT_PROGRESSING, true, reasons::PROMOTING, format!("promoting {upd}: stable pods are being replaced")),
            None,
            None,
        ),
        requeue: Some(WAIT),
    }
}

/// A regression run failed: the step is retried while `maxFailures` allows, else the rollout fails.
fn step_failed(
    input: &Input,
    spec: &RolloutSpec,
    mut st: RolloutStatus,
    stable_revision: &str,
    mut actions: Vec<Action>,
    result: StepResult,
    reason: &'static str,
) -> Plan {
    st.failures += 1;
    let message = describe_failure(&result);
    push_result(&mut st, result);
    if st.failures > spec.max_failures {
        return fail(input, st, stable_revision, actions, reason, message);
    }
    actions.push(event(true, reasons::STEP_FAILED, format!("{message} (failure {} of {} tolerated)", st.failures, spec.max_failures)));
    // The step starts over: a new readiness deadline, a new pause, a new run.
    st.current_step_started_at = Some(Time(input.now));
    st.canary_ready_at = None;
    Plan {
        stable: StableTemplate::Keep,
        actions,
        status: st,
        conditions: conditions(Cond::new(CONDITION_ROLLOUT_PROGRESSING, true, reasons::RETRYING_STEP, message), None, None),
        requeue: Some(RETRY),
    }
}

/// The result's message and its failing cases, for the condition and the Event.
fn describe_failure(result: &StepResult) -> String {
    let mut message = result.message.clone();
    if !result.mismatches.is_empty() {
        let cases: Vec<String> = result
            .mismatches
            .iter()
            .map(|m| format!("{} ({}; expected {:?}, got {:?})", m.case, m.reason, m.expected, m.got))
            .collect();
        message.push_str(&format!("; failing: {}", cases.join(", ")));
    }
    format!("step {}: {message}", result.step + 1)
}

/// Rolls back: canary removed, stable untouched, the update revision marked failed.
fn fail(input: &Input, mut st: RolloutStatus, stable_revision: &str, mut actions: Vec<Action>, reason: &'static str, message: String) -> Plan {
    actions.retain(|a| !matches!(a, Action::EnsureCanary { .. }));
    actions.push(Action::DeleteCanary);
    actions.push(event(true, reason, message.clone()));
    st.current_revision = Some(stable_revision.to_string());
    st.update_revision = Some(input.update_revision.to_string());
    st.current_step = None;
    st.current_step_started_at = None;
    st.canary_ready_at = None;
    Plan {
        stable: StableTemplate::Keep,
        actions,
        status: st,
        conditions: conditions(
            Cond::new(CONDITION_ROLLOUT_PROGRESSING, false, reasons::ROLLED_BACK, format!("rolled back to {stable_revision}")),
            None,
            Some(Cond::new(CONDITION_ROLLOUT_FAILED, true, reason, message)),
        ),
        requeue: None,
    }
}

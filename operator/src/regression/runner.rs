//! A whole suite against a canary, with a stable reference for `sameAsStable` cases and latency.
//!
//! Cases run one at a time, the stable reference first and the canary right after, so that both see
//! the same background load; the p95 TTFT and TPOT of the two sides are then compared (for an
//! encoder, the whole request's latency, which its client reports as TTFT).

use std::time::Duration;

use peregrine_crds::{ExpectationKind, LatencyComparison, Mismatch, ModelTask, RegressionCase, RegressionThresholds, StepResult};

use super::client::{ClientError, Generation, OpenAiClient};
use super::judge::{judge, same_as_stable, Verdict};
use super::stats::percentile;

/// Latency differences below this are noise whatever their ratio (a 3 ms TTFT against a 2 ms one is
/// not a regression).
pub const LATENCY_SLACK: Duration = Duration::from_millis(10);
/// Most failing cases kept in a result (the status field allows 5).
const MAX_MISMATCHES: usize = 5;

/// Where to send the suite.
#[derive(Clone, Debug, Default)]
pub struct SuiteTarget {
    /// Root URL of the server under test (a canary pod).
    pub canary: String,
    /// Root URL of the reference (a stable pod); needed by `sameAsStable` cases and the latency gate.
    pub stable: Option<String>,
    /// Model id to send (the deployment's served model name).
    pub model: String,
    /// Served names of the deployment's adapters: each case without its own `adapter` also runs
    /// through each of these.
    pub adapters: Vec<String>,
    /// What the model serves (`spec.model.task`): generation, or one encoder request per case.
    pub task: ModelTask,
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Without a reference nothing can be compared; the canary is not to blame.
    #[error("stable reference {url} failed on case {case:?}: {source}")]
    Stable { url: String, case: String, source: ClientError },
    #[error("the suite has sameAsStable cases but no stable reference was given")]
    NoStable,
    /// A case the model's task cannot run (a prompt for an encoder, an input for a generator).
    #[error("{0}")]
    TaskMismatch(super::suite::SuiteError),
}

/// One case's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseOutcome {
    pub name: String,
    pub verdict: Verdict,
    /// The canary answered with an error.
    pub error: bool,
}

/// What a run found.
#[derive(Clone, Debug, PartialEq)]
pub struct SuiteReport {
    pub cases: Vec<CaseOutcome>,
    pub pass_rate: f64,
    pub errors: usize,
    pub latency: LatencyComparison,
    pub passed: bool,
    /// One line: what passed, what did not.
    pub message: String,
}

impl SuiteReport {
    /// The report as a rollout step's result (times are the caller's).
    pub fn to_step_result(&self, step: i32) -> StepResult {
        let failed: Vec<&CaseOutcome> = self.cases.iter().filter(|c| !c.verdict.passed).collect();
        StepResult {
            step,
            passed: self.passed,
            pass_rate: self.pass_rate,
            cases: self.cases.len() as i32,
            failed_cases: failed.len() as i32,
            latency: Some(self.latency.clone()),
            mismatches: failed
                .iter()
                .take(MAX_MISMATCHES)
                .map(|c| Mismatch {
                    case: c.name.clone(),
                    expected: c.verdict.expected.clone(),
                    got: c.verdict.got.clone(),
                    reason: c.verdict.reason.clone(),
                })
                .collect(),
            started_at: None,
            finished_at: None,
            message: self.message.clone(),
        }
    }
}

/// A case as sent: the suite's cases, then their variants through each adapter.
struct Planned {
    name: String,
    case: RegressionCase,
    /// Adapter variants are judged by agreement with stable (the suite's expected texts were written
    /// for the base model) with this threshold, when a stable reference exists.
    adapter_threshold: Option<f64>,
}

fn plan(cases: &[RegressionCase], adapters: &[String]) -> Vec<Planned> {
    let mut planned: Vec<Planned> = cases.iter().map(|c| Planned { name: c.name.clone(), case: c.clone(), adapter_threshold: None }).collect();
    for adapter in adapters {
        for c in cases.iter().filter(|c| c.adapter.is_none()) {
            let threshold = match c.expect.kind {
                ExpectationKind::SameAsStable => c.expect.threshold.unwrap_or(1.0),
                _ => 1.0,
            };
            let mut case = c.clone();
            case.adapter = Some(adapter.clone());
            planned.push(Planned { name: format!("{}@{adapter}", c.name), case, adapter_threshold: Some(threshold) });
        }
    }
    planned
}

/// Runs `cases` against `target` and judges the run by `thresholds`.
pub async fn run_suite(
    client: &OpenAiClient,
    target: &SuiteTarget,
    cases: &[RegressionCase],
    thresholds: &RegressionThresholds,
) -> Result<SuiteReport, RunError> {
    if target.stable.is_none() && super::suite::needs_stable(cases) {
        return Err(RunError::NoStable);
    }
    super::suite::check_task(cases, target.task).map_err(RunError::TaskMismatch)?;
    let planned = plan(cases, &target.adapters);
    // The first request to a fresh server pays for lazy initialisation; keep it out of the figures.
    if let Some(first) = planned.first() {
        let model = first.case.adapter.as_deref().unwrap_or(&target.model);
        if let Some(stable) = &target.stable {
            let _ = client.run_case(stable, model, target.task, &first.case).await;
        }
        let _ = client.run_case(&target.canary, model, target.task, &first.case).await;
    }

    let mut outcomes = Vec::with_capacity(planned.len());
    let (mut canary_ttft, mut canary_tpot, mut stable_ttft, mut stable_tpot) = (vec![], vec![], vec![], vec![]);
    for p in &planned {
        let model = p.case.adapter.as_deref().unwrap_or(&target.model);
        let stable: Option<Generation> = match &target.stable {
            Some(url) => Some(client.run_case(url, model, target.task, &p.case).await.map_err(|source| RunError::Stable {
                url: url.clone(),
                case: p.name.clone(),
                source,
            })?),
            None => None,
        };
        let outcome = match client.run_case(&target.canary, model, target.task, &p.case).await {
            Ok(canary) => {
                if let Some(s) = &stable {
                    stable_ttft.push(s.ttft);
                    stable_tpot.extend(s.tpot);
                }
                canary_ttft.push(canary.ttft);
                canary_tpot.extend(canary.tpot);
                let verdict = match (p.adapter_threshold, &stable) {
                    (Some(threshold), Some(_)) => same_as_stable(threshold, &canary, stable.as_ref()),
                    _ => judge(&p.case, &canary, stable.as_ref()),
                };
                CaseOutcome { name: p.name.clone(), verdict, error: false }
            }
            Err(e) => CaseOutcome {
                name: p.name.clone(),
                verdict: Verdict {
                    passed: false,
                    reason: format!("canary error: {e}"),
                    expected: String::new(),
                    got: String::new(),
                    agreement: None,
                },
                error: true,
            },
        };
        outcomes.push(outcome);
    }

    let latency = compare_latency(&canary_ttft, &canary_tpot, &stable_ttft, &stable_tpot);
    Ok(report(outcomes, latency, thresholds))
}

fn secs(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

/// p95 TTFT and TPOT of both sides and the worse of their ratios. A ratio only counts where the
/// canary is slower by more than [`LATENCY_SLACK`].
pub fn compare_latency(canary_ttft: &[Duration], canary_tpot: &[Duration], stable_ttft: &[Duration], stable_tpot: &[Duration]) -> LatencyComparison {
    let (ct, st) = (percentile(canary_ttft, 95.0), percentile(stable_ttft, 95.0));
    let (cp, sp) = (percentile(canary_tpot, 95.0), percentile(stable_tpot, 95.0));
    let ratio = |canary: Option<Duration>, stable: Option<Duration>| match (canary, stable) {
        (Some(c), Some(s)) if c > s + LATENCY_SLACK => Some(c.as_secs_f64() / s.as_secs_f64().max(1e-6)),
        (Some(_), Some(_)) => Some(1.0),
        _ => None,
    };
    let factor = [ratio(ct, st), ratio(cp, sp)].into_iter().flatten().reduce(f64::max);
    LatencyComparison {
        canary_ttft_p95_seconds: secs(ct),
        stable_ttft_p95_seconds: secs(st),
        canary_tpot_p95_seconds: secs(cp),
        stable_tpot_p95_seconds: secs(sp),
        latency_factor: factor,
    }
}

/// Applies the thresholds: pass rate, no canary errors, latency factor.
pub fn report(cases: Vec<CaseOutcome>, latency: LatencyComparison, thresholds: &RegressionThresholds) -> SuiteReport {
    let total = cases.len();
    let passed_cases = cases.iter().filter(|c| c.verdict.passed).count();
    let errors = cases.iter().filter(|c| c.error).count();
    let pass_rate = if total == 0 { 0.0 } else { passed_cases as f64 / total as f64 };
    let mut problems = Vec::new();
    if pass_rate < thresholds.min_agreement_rate {
        problems.push(format!("pass rate {:.0}% is below {:.0}%", pass_rate * 100.0, thresholds.min_agreement_rate * 100.0));
    }
    if errors > 0 {
        problems.push(format!("{errors} request(s) to the canary failed"));
    }
    if let Some(f) = latency.latency_factor {
        if f > thresholds.max_latency_factor {
            problems.push(format!("p95 latency is {f:.2}x stable's (max {:.2}x)", thresholds.max_latency_factor));
        }
    }
    let summary = format!(
        "{passed_cases}/{total} cases passed{}",
        latency.latency_factor.map(|f| format!(", latency {f:.2}x stable")).unwrap_or_default()
    );
    let passed = problems.is_empty() && total > 0;
    let message = if passed { summary } else { format!("{summary}: {}", problems.join("; ")) };
    SuiteReport { cases, pass_rate, errors, latency, passed, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_crds::Expectation;

    fn ms(v: &[u64]) -> Vec<Duration> {
        v.iter().map(|&m| Duration::from_millis(m)).collect()
    }

    #[test]
    fn latency_factor_ignores_noise_but_not_regressions() {
        let quiet = compare_latency(&ms(&[3, 3]), &ms(&[1]), &ms(&[1, 1]), &ms(&[1]));
        assert_eq!(quiet.latency_factor, Some(1.0), "3 ms vs 1 ms is within the slack");
        let slow = compare_latency(&ms(&[200, 400]), &ms(&[30]), &ms(&[100, 100]), &ms(&[30]));
        assert_eq!(slow.latency_factor, Some(4.0));
        assert_eq!(slow.canary_ttft_p95_seconds, Some(0.4));
        assert_eq!(compare_latency(&ms(&[5]), &[], &[], &[]).latency_factor, None, "no reference, no factor");
    }

    #[test]
    fn thresholds_decide() {
        let outcome = |name: &str, passed: bool, error: bool| CaseOutcome {
            name: name.into(),
            verdict: Verdict { passed, reason: if passed { String::new() } else { "x".into() }, expected: "e".into(), got: "g".into(), agreement: None },
            error,
        };
        let lenient = RegressionThresholds { min_agreement_rate: 0.5, max_latency_factor: 1.5 };
        let fast = LatencyComparison { latency_factor: Some(1.2), ..Default::default() };
        let r = report(vec![outcome("a", true, false), outcome("b", false, false)], fast.clone(), &lenient);
        assert!(r.passed, "{}", r.message);
        assert_eq!(r.to_step_result(2).mismatches.len(), 1);
        assert_eq!(r.to_step_result(2).failed_cases, 1);
        let r = report(vec![outcome("a", true, false), outcome("b", false, true)], fast.clone(), &lenient);
        assert!(!r.passed && r.message.contains("failed"), "errors fail the run: {}", r.message);
        let slow = LatencyComparison { latency_factor: Some(1.6), ..Default::default() };
        let r = report(vec![outcome("a", true, false)], slow, &lenient);
        assert!(!r.passed && r.message.contains("1.60x"), "{}", r.message);
        let r = report(vec![outcome("a", true, false), outcome("b", false, false)], fast, &RegressionThresholds::default());
        assert!(!r.passed && r.message.contains("50%"), "{}", r.message);
    }

    #[test]
    fn adapters_get_variants_of_base_cases() {
        let base = RegressionCase { name: "a".into(), prompt: Some("p".into()), expect: Expectation { kind: ExpectationKind::Exact, value: Some("x".into()), ..Default::default() }, ..Default::default() };
        let pinned = RegressionCase { name: "b".into(), adapter: Some("sql".into()), ..base.clone() };
        let planned = plan(&[base, pinned], &["sql".into(), "chat".into()]);
        let names: Vec<&str> = planned.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "a@sql", "a@chat"]);
        assert_eq!(planned[3].case.adapter.as_deref(), Some("chat"));
        assert_eq!(planned[3].adapter_threshold, Some(1.0));
    }
}

//! Regression cases: parsed from YAML (a ConfigMap key or a file) and checked before anything is sent,
//! so that a broken suite is reported as such instead of as a failing canary.

use peregrine_crds::{ExpectationKind, ModelTask, RegressionCase};
use regex::Regex;

#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    #[error("suite YAML: {0}")]
    Yaml(#[from] serde_yaml::Error),
    #[error("suite has no cases")]
    Empty,
    #[error("case {case:?}: {problem}")]
    Invalid { case: String, problem: String },
    #[error("ConfigMap {name:?} has no key {key:?}")]
    MissingKey { name: String, key: String },
}

/// Parses a YAML list of cases (the format of `regression.suite.cases`, and of a ConfigMap key).
pub fn load_cases(yaml: &str) -> Result<Vec<RegressionCase>, SuiteError> {
    let cases: Vec<RegressionCase> = serde_yaml::from_str(yaml)?;
    check_cases(&cases)?;
    Ok(cases)
}

/// The checks the CRD's validation rules make, repeated here because ConfigMap and file suites never
/// pass through the API server's validation.
pub fn check_cases(cases: &[RegressionCase]) -> Result<(), SuiteError> {
    if cases.is_empty() {
        return Err(SuiteError::Empty);
    }
    let mut names = std::collections::BTreeSet::new();
    for case in cases {
        let invalid = |problem: String| SuiteError::Invalid { case: case.name.clone(), problem };
        if case.name.is_empty() {
            return Err(invalid("name must not be empty".into()));
        }
        if !names.insert(case.name.as_str()) {
            return Err(invalid("duplicate case name".into()));
        }
        if usize::from(case.prompt.is_some()) + usize::from(!case.messages.is_empty()) + usize::from(case.input.is_some()) != 1 {
            return Err(invalid("set exactly one of prompt, messages and input".into()));
        }
        if !case.documents.is_empty() && case.input.is_none() {
            return Err(invalid("documents go with input (a rerank case)".into()));
        }
        if case.sampling.max_tokens < 1 {
            return Err(invalid("sampling.maxTokens must be at least 1".into()));
        }
        if case.sampling.seed.is_some_and(|s| s < 0) {
            return Err(invalid("sampling.seed must not be negative".into()));
        }
        if let Some(role) = case.messages.iter().map(|m| m.role.as_str()).find(|r| !matches!(*r, "system" | "user" | "assistant")) {
            return Err(invalid(format!("role {role:?} must be system, user or assistant")));
        }
        let expect = &case.expect;
        match expect.kind {
            ExpectationKind::SameAsStable => {}
            ExpectationKind::Exact | ExpectationKind::Contains | ExpectationKind::Regex if expect.value.is_none() => {
                return Err(invalid("expect.value is required for exact, contains and regex".into()));
            }
            ExpectationKind::CosineAtLeast | ExpectationKind::WithinTolerance if expect.values.is_empty() => {
                return Err(invalid("expect.values (the golden vector) is required for cosineAtLeast and withinTolerance".into()));
            }
            ExpectationKind::CosineAtLeast => {}
            _ if expect.threshold.is_some() => {
                return Err(invalid("expect.threshold applies only to sameAsStable and cosineAtLeast".into()));
            }
            _ => {}
        }
        if expect.tolerance.is_some() && expect.kind != ExpectationKind::WithinTolerance {
            return Err(invalid("expect.tolerance applies only to withinTolerance".into()));
        }
        if expect.tolerance.is_some_and(|t| t.is_nan() || t < 0.0) {
            return Err(invalid("expect.tolerance must be >= 0".into()));
        }
        if let Some(t) = expect.threshold {
            if !(0.0..=1.0).contains(&t) {
                return Err(invalid(format!("expect.threshold must be in [0, 1], got {t}")));
            }
        }
        if expect.kind == ExpectationKind::Regex {
            let pattern = expect.value.as_deref().unwrap_or_default();
            Regex::new(pattern).map_err(|e| invalid(format!("expect.value is not a valid regex: {e}")))?;
        }
    }
    Ok(())
}

/// Checks that every case fits the model's task: prompts or messages for `generate`; an `input`
/// for the encoders, with `documents` exactly for `rerank`; golden vectors only for encoders.
pub fn check_task(cases: &[RegressionCase], task: ModelTask) -> Result<(), SuiteError> {
    for case in cases {
        let invalid = |problem: String| SuiteError::Invalid { case: case.name.clone(), problem };
        let vector_kind = matches!(case.expect.kind, ExpectationKind::CosineAtLeast | ExpectationKind::WithinTolerance);
        let problem = match task {
            ModelTask::Generate if case.input.is_some() => Some("input is for encoder tasks; a generate model takes prompt or messages"),
            ModelTask::Generate if vector_kind => Some("cosineAtLeast and withinTolerance are for encoder tasks"),
            ModelTask::Embed | ModelTask::Classify | ModelTask::Rerank if case.input.is_none() => {
                Some("an encoder task takes input (and documents to rerank), not prompt or messages")
            }
            ModelTask::Embed | ModelTask::Classify if !case.documents.is_empty() => Some("documents are for rerank"),
            ModelTask::Rerank if case.documents.is_empty() => Some("a rerank case needs documents"),
            _ => None,
        };
        if let Some(p) = problem {
            return Err(invalid(format!("{p} (model.task is {})", task.as_str())));
        }
    }
    Ok(())
}

/// Whether any case compares with the stable revision (then a stable reference is needed).
pub fn needs_stable(cases: &[RegressionCase]) -> bool {
    cases.iter().any(|c| c.expect.kind == ExpectationKind::SameAsStable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_configmap_style_list() {
        let cases = load_cases(
            r#"
- name: capital
  prompt: "The capital of France is"
  sampling: {maxTokens: 8}
  expect: {type: contains, value: Paris}
- name: chat
  messages: [{role: user, content: "Say hi"}]
  expect: {type: sameAsStable, threshold: 0.9}
"#,
        )
        .unwrap();
        assert_eq!(cases.len(), 2);
        assert_eq!(cases[0].sampling.max_tokens, 8);
        assert_eq!(cases[1].expect.threshold, Some(0.9));
        assert_eq!(cases[1].sampling.max_tokens, 32, "default maxTokens");
        assert!(needs_stable(&cases));
    }

    #[test]
    fn refuses_broken_cases() {
        let bad = [
            ("[]", "no cases"),
            ("- {name: a, expect: {type: exact, value: x}}", "exactly one of prompt, messages and input"),
            ("- {name: a, prompt: p, input: i, expect: {type: exact, value: x}}", "exactly one of prompt, messages and input"),
            ("- {name: a, prompt: p, documents: [d], expect: {type: exact, value: x}}", "documents go with input"),
            ("- {name: a, input: i, expect: {type: cosineAtLeast}}", "values (the golden vector) is required"),
            ("- {name: a, input: i, expect: {type: exact, value: x, tolerance: 0.1}}", "tolerance applies only"),
            ("- {name: a, prompt: p, expect: {type: exact}}", "value is required"),
            ("- {name: a, prompt: p, expect: {type: regex, value: '(unclosed'}}", "not a valid regex"),
            ("- {name: a, prompt: p, expect: {type: contains, value: x, threshold: 0.5}}", "only to sameAsStable"),
            ("- {name: a, prompt: p, expect: {type: sameAsStable, threshold: 1.5}}", "[0, 1]"),
            ("- {name: a, prompt: p, expect: {type: sameAsStable}}\n- {name: a, prompt: q, expect: {type: sameAsStable}}", "duplicate"),
            ("- {name: a, messages: [{role: robot, content: x}], expect: {type: sameAsStable}}", "role"),
            ("- {name: a, prompt: p, expect: {type: fuzzy}}", "unknown variant"),
        ];
        for (yaml, want) in bad {
            let err = load_cases(yaml).expect_err(yaml).to_string();
            assert!(err.contains(want), "{yaml}: {err}");
        }
    }

    #[test]
    fn cases_must_fit_the_task() {
        let cases = |yaml: &str| load_cases(yaml).unwrap();
        let prompt = cases("- {name: a, prompt: p, expect: {type: sameAsStable}}");
        let embed = cases("- {name: a, input: i, expect: {type: cosineAtLeast, values: [0.6, 0.8], threshold: 0.99}}");
        let rerank = cases("- {name: a, input: q, documents: [d1, d2], expect: {type: withinTolerance, values: [0.9, 0.1], tolerance: 0.01}}");
        let classify = cases("- {name: a, input: i, expect: {type: exact, value: positive}}");
        assert!(check_task(&prompt, ModelTask::Generate).is_ok());
        assert!(check_task(&embed, ModelTask::Embed).is_ok());
        assert!(check_task(&rerank, ModelTask::Rerank).is_ok());
        assert!(check_task(&classify, ModelTask::Classify).is_ok());
        for (cases, task, want) in [
            (&prompt, ModelTask::Embed, "an encoder task takes input"),
            (&embed, ModelTask::Generate, "input is for encoder tasks"),
            (&embed, ModelTask::Rerank, "a rerank case needs documents"),
            (&rerank, ModelTask::Classify, "documents are for rerank"),
        ] {
            let err = check_task(cases, task).expect_err(want).to_string();
            assert!(err.contains(want) && err.contains(task.as_str()), "{err}");
        }
    }
}

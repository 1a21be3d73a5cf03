//! Regression cases: parsed from YAML (a ConfigMap key or a file) and checked before anything is sent,
//! so that a broken suite is reported as such instead of as a failing canary.

use peregrine_crds::{ExpectationKind, RegressionCase};
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
        if case.prompt.is_some() == !case.messages.is_empty() {
            return Err(invalid("set exactly one of prompt and messages".into()));
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
            _ if expect.threshold.is_some() => {
                return Err(invalid("expect.threshold applies only to sameAsStable".into()));
            }
            _ => {}
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
            ("- {name: a, expect: {type: exact, value: x}}", "exactly one of prompt and messages"),
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
}

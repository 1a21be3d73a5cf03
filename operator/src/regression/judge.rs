//! One case's verdict: the canary's output against the case's expectation (and, for `sameAsStable`,
//! against the stable revision's output for the same case).

use peregrine_crds::{ExpectationKind, RegressionCase};
use regex::Regex;

use super::client::{truncate, Generation};

/// Longest expected/got text kept in a verdict (they end up in the object's status).
const SHOWN_CHARS: usize = 200;

#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    pub passed: bool,
    /// Why it failed (empty when it passed).
    pub reason: String,
    pub expected: String,
    pub got: String,
    /// Token agreement with stable, for comparisons with stable.
    pub agreement: Option<f64>,
}

/// Fraction of leading output tokens that agree: the length of the common prefix over the longer
/// output. Two empty outputs agree fully.
///
/// A prefix, not a position-wise match, because greedy decoding diverges for good after the first
/// differing token: later coincidences mean nothing.
pub fn token_agreement<T: PartialEq>(stable: &[T], canary: &[T]) -> f64 {
    let longest = stable.len().max(canary.len());
    if longest == 0 {
        return 1.0;
    }
    let common = stable.iter().zip(canary).take_while(|(a, b)| a == b).count();
    common as f64 / longest as f64
}

/// Agreement of two generations: over their tokens when both servers reported them, else over
/// characters (a finer unit, so never more lenient).
pub fn agreement(stable: &Generation, canary: &Generation) -> f64 {
    match (&stable.tokens, &canary.tokens) {
        (Some(s), Some(c)) => token_agreement(s, c),
        _ => {
            let s: Vec<char> = stable.text.chars().collect();
            let c: Vec<char> = canary.text.chars().collect();
            token_agreement(&s, &c)
        }
    }
}

/// Judges `canary` against `case.expect`. `stable` is the stable revision's output for the same case;
/// `sameAsStable` without it fails (the caller makes sure it exists when it must).
pub fn judge(case: &RegressionCase, canary: &Generation, stable: Option<&Generation>) -> Verdict {
    let value = case.expect.value.as_deref().unwrap_or_default();
    let got = truncate(&canary.text, SHOWN_CHARS);
    let verdict = |passed: bool, reason: String, expected: String| Verdict {
        passed,
        reason: if passed { String::new() } else { reason },
        expected: truncate(&expected, SHOWN_CHARS),
        got: got.clone(),
        agreement: None,
    };
    match case.expect.kind {
        ExpectationKind::Exact => verdict(canary.text == value, "output differs from the expected text".into(), value.into()),
        ExpectationKind::Contains => verdict(canary.text.contains(value), "output does not contain the expected text".into(), value.into()),
        ExpectationKind::Regex => match Regex::new(value) {
            Ok(re) => verdict(re.is_match(&canary.text), "output does not match the pattern".into(), format!("/{value}/")),
            Err(e) => verdict(false, format!("invalid pattern: {e}"), format!("/{value}/")),
        },
        ExpectationKind::SameAsStable => same_as_stable(case.expect.threshold.unwrap_or(1.0), canary, stable),
    }
}

/// Judges token agreement with stable against `threshold`.
pub fn same_as_stable(threshold: f64, canary: &Generation, stable: Option<&Generation>) -> Verdict {
    let got = truncate(&canary.text, SHOWN_CHARS);
    let Some(stable) = stable else {
        return Verdict { passed: false, reason: "no stable output to compare with".into(), expected: String::new(), got, agreement: None };
    };
    let a = agreement(stable, canary);
    let passed = a >= threshold;
    Verdict {
        passed,
        reason: if passed { String::new() } else { format!("agreement with stable {a:.2} is below {threshold:.2}") },
        expected: truncate(&stable.text, SHOWN_CHARS),
        got,
        agreement: Some(a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_crds::Expectation;

    fn generation(text: &str, tokens: Option<&[&str]>) -> Generation {
        Generation { text: text.into(), tokens: tokens.map(|t| t.iter().map(|s| s.to_string()).collect()), ..Default::default() }
    }

    fn case(kind: ExpectationKind, value: Option<&str>, threshold: Option<f64>) -> RegressionCase {
        RegressionCase {
            name: "c".into(),
            prompt: Some("p".into()),
            expect: Expectation { kind, value: value.map(Into::into), threshold },
            ..Default::default()
        }
    }

    #[test]
    fn agreement_is_the_common_prefix_over_the_longer_output() {
        assert_eq!(token_agreement(&["a", "b", "c", "d"], &["a", "b", "x", "d"]), 0.5);
        assert_eq!(token_agreement(&["a", "b"], &["a", "b", "c", "d"]), 0.5);
        assert_eq!(token_agreement::<&str>(&[], &[]), 1.0);
        assert_eq!(token_agreement(&["a"], &[]), 0.0);
        // Without tokens on one side, characters are compared.
        assert_eq!(agreement(&generation("abcd", None), &generation("abXd", Some(&["ab", "Xd"]))), 0.5);
    }

    #[test]
    fn expectations() {
        let out = generation("The capital is Paris.", None);
        assert!(judge(&case(ExpectationKind::Exact, Some("The capital is Paris."), None), &out, None).passed);
        let v = judge(&case(ExpectationKind::Exact, Some("The capital is Paris"), None), &out, None);
        assert!(!v.passed);
        assert_eq!(v.got, "The capital is Paris.");
        assert!(judge(&case(ExpectationKind::Contains, Some("Paris"), None), &out, None).passed);
        assert!(!judge(&case(ExpectationKind::Contains, Some("Lyon"), None), &out, None).passed);
        assert!(judge(&case(ExpectationKind::Regex, Some(r"capital\s+is\s+[A-Z]\w+"), None), &out, None).passed);
        assert!(!judge(&case(ExpectationKind::Regex, Some(r"^\d+$"), None), &out, None).passed);
    }

    #[test]
    fn same_as_stable_uses_the_threshold() {
        let stable = generation("a b c d", Some(&["a", " b", " c", " d"]));
        let canary = generation("a b c x", Some(&["a", " b", " c", " x"]));
        let strict = judge(&case(ExpectationKind::SameAsStable, None, None), &canary, Some(&stable));
        assert!(!strict.passed);
        assert_eq!(strict.agreement, Some(0.75));
        assert!(strict.reason.contains("0.75"));
        assert!(judge(&case(ExpectationKind::SameAsStable, None, Some(0.75)), &canary, Some(&stable)).passed);
        assert!(judge(&case(ExpectationKind::SameAsStable, None, None), &stable, Some(&stable)).passed);
        assert!(!judge(&case(ExpectationKind::SameAsStable, None, Some(0.0)), &canary, None).passed, "no stable output");
    }
}

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
        ExpectationKind::SameAsStable => {
            let default = if canary.values.is_some() { ENCODER_DEFAULT_THRESHOLD } else { 1.0 };
            same_as_stable(case.expect.threshold.unwrap_or(default), canary, stable)
        }
        ExpectationKind::CosineAtLeast => {
            let threshold = case.expect.threshold.unwrap_or(ENCODER_DEFAULT_THRESHOLD);
            judge_values(canary, &case.expect.values, |got, want| {
                let c = cosine(got, want);
                (c >= threshold, format!("cosine with the golden vector {c:.6} is below {threshold}"))
            })
        }
        ExpectationKind::WithinTolerance => {
            let tolerance = case.expect.tolerance.unwrap_or(DEFAULT_TOLERANCE);
            judge_values(canary, &case.expect.values, |got, want| {
                let d = max_abs_diff(got, want);
                (d <= tolerance, format!("a value differs from the golden one by {d:.6}, more than {tolerance}"))
            })
        }
    }
}

/// Encoder outputs are floats: `sameAsStable` and `cosineAtLeast` allow this much by default
/// (float32 forwards that batch differently differ by ~1e-6, a changed model by far more).
pub const ENCODER_DEFAULT_THRESHOLD: f64 = 0.999;
/// `withinTolerance`'s default.
pub const DEFAULT_TOLERANCE: f64 = 1e-3;

/// Cosine of two vectors; 0 when either is zero.
pub fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f64>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f64>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}

/// Largest elementwise difference (infinite when the lengths differ or a value is not a number).
pub fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) })
}

/// First values of a vector, for a verdict's expected/got.
fn show(values: &[f64]) -> String {
    let head: Vec<String> = values.iter().take(8).map(|v| format!("{v:.6}")).collect();
    format!("[{}{}] ({} values)", head.join(", "), if values.len() > 8 { ", ..." } else { "" }, values.len())
}

/// Judges an encoder output's vector against `want` with `check` → (passed, reason if not).
fn judge_values(canary: &Generation, want: &[f64], check: impl Fn(&[f64], &[f64]) -> (bool, String)) -> Verdict {
    let Some(got) = canary.values.as_deref() else {
        return Verdict { passed: false, reason: "the output has no vector (not an encoder answer)".into(), expected: show(want), got: truncate(&canary.text, SHOWN_CHARS), agreement: None };
    };
    let (passed, reason) = if got.len() == want.len() {
        check(got, want)
    } else {
        (false, format!("the output has {} values, the golden vector {}", got.len(), want.len()))
    };
    Verdict { passed, reason: if passed { String::new() } else { reason }, expected: show(want), got: show(got), agreement: None }
}

/// Judges token agreement with stable against `threshold`; for encoder outputs, the agreement is
/// 1 - the largest difference between the two vectors (0 when they differ in length).
pub fn same_as_stable(threshold: f64, canary: &Generation, stable: Option<&Generation>) -> Verdict {
    let got = truncate(&canary.text, SHOWN_CHARS);
    let Some(stable) = stable else {
        return Verdict { passed: false, reason: "no stable output to compare with".into(), expected: String::new(), got, agreement: None };
    };
    if let (Some(c), Some(s)) = (&canary.values, &stable.values) {
        let a = (1.0 - max_abs_diff(c, s)).clamp(0.0, 1.0);
        let same_text = canary.text == stable.text;
        let passed = a >= threshold && same_text;
        let reason = if !same_text {
            format!("label or ranking differs from stable's ({:?} vs {:?})", canary.text, stable.text)
        } else {
            format!("agreement with stable {a:.6} (1 - largest difference) is below {threshold}")
        };
        return Verdict { passed, reason: if passed { String::new() } else { reason }, expected: show(s), got: show(c), agreement: Some(a) };
    }
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
            expect: Expectation { kind, value: value.map(Into::into), threshold, ..Default::default() },
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

    fn encoded(text: &str, values: &[f64]) -> Generation {
        Generation { text: text.into(), values: Some(values.to_vec()), ..Default::default() }
    }

    fn vector_case(kind: ExpectationKind, values: &[f64], threshold: Option<f64>, tolerance: Option<f64>) -> RegressionCase {
        let mut c = case(kind, None, threshold);
        c.expect.values = values.to_vec();
        c.expect.tolerance = tolerance;
        c
    }

    #[test]
    fn encoder_outputs_against_golden_vectors() {
        // Embedding: cosine with the golden vector (scale does not matter, direction does).
        let golden = [0.6, 0.8, 0.0];
        assert!(judge(&vector_case(ExpectationKind::CosineAtLeast, &golden, None, None), &encoded("", &[1.2, 1.6, 0.0]), None).passed);
        let off = judge(&vector_case(ExpectationKind::CosineAtLeast, &golden, None, None), &encoded("", &[0.8, 0.6, 0.0]), None);
        assert!(!off.passed && off.reason.contains("0.96"), "{off:?}");
        assert!(judge(&vector_case(ExpectationKind::CosineAtLeast, &golden, Some(0.95), None), &encoded("", &[0.8, 0.6, 0.0]), None).passed);
        let short = judge(&vector_case(ExpectationKind::CosineAtLeast, &golden, None, None), &encoded("", &[0.6, 0.8]), None);
        assert!(!short.passed && short.reason.contains("2 values"), "{short:?}");
        // Rerank scores: each within the tolerance (default 1e-3).
        let scores = [0.9, 0.2];
        assert!(judge(&vector_case(ExpectationKind::WithinTolerance, &scores, None, None), &encoded("0,1", &[0.9005, 0.2]), None).passed);
        assert!(!judge(&vector_case(ExpectationKind::WithinTolerance, &scores, None, None), &encoded("0,1", &[0.9, 0.21]), None).passed);
        assert!(judge(&vector_case(ExpectationKind::WithinTolerance, &scores, None, Some(0.02)), &encoded("0,1", &[0.9, 0.21]), None).passed);
        assert!(!judge(&vector_case(ExpectationKind::WithinTolerance, &scores, None, Some(1.0)), &encoded("0,1", &[0.9, f64::NAN]), None).passed);
        // A generation has no vector.
        assert!(!judge(&vector_case(ExpectationKind::WithinTolerance, &scores, None, None), &generation("x", None), None).passed);
        // Classify: the label is the text.
        assert!(judge(&case(ExpectationKind::Exact, Some("positive"), None), &encoded("positive", &[0.1, 0.9]), None).passed);
        // sameAsStable: 1 - the largest difference (default 0.999), and the same label/ranking.
        let stable = encoded("1,0", &[0.2, 0.9]);
        assert!(judge(&case(ExpectationKind::SameAsStable, None, None), &encoded("1,0", &[0.2, 0.9002]), Some(&stable)).passed);
        let drift = judge(&case(ExpectationKind::SameAsStable, None, None), &encoded("1,0", &[0.2, 0.95]), Some(&stable));
        assert!(!drift.passed && drift.agreement.is_some_and(|a| (a - 0.95).abs() < 1e-9), "{drift:?}");
        let reordered = judge(&case(ExpectationKind::SameAsStable, None, Some(0.0)), &encoded("0,1", &[0.9, 0.2]), Some(&stable));
        assert!(!reordered.passed && reordered.reason.contains("ranking"), "{reordered:?}");
    }
}

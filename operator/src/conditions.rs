//! Building `metav1.Condition`s that keep their transition time while their status holds.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// A condition's status, reason and message, before times and generations are attached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CondSpec {
    pub type_: &'static str,
    pub status: bool,
    pub reason: &'static str,
    pub message: String,
}

impl CondSpec {
    pub fn new(type_: &'static str, status: bool, reason: &'static str, message: impl Into<String>) -> Self {
        CondSpec { type_, status, reason, message: message.into() }
    }
}

/// Turns `specs` into conditions. `lastTransitionTime` is carried over from `previous` when the status
/// did not change, so that it records when the condition last flipped, as the API conventions ask.
pub fn build(specs: &[CondSpec], previous: &[Condition], generation: Option<i64>, now: &Time) -> Vec<Condition> {
    specs
        .iter()
        .map(|spec| {
            let status = if spec.status { "True" } else { "False" }.to_string();
            let last_transition_time = previous
                .iter()
                .find(|c| c.type_ == spec.type_ && c.status == status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            Condition {
                type_: spec.type_.to_string(),
                status,
                reason: spec.reason.to_string(),
                message: spec.message.clone(),
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect()
}

/// Whether `conditions` holds `type_` with status True.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    conditions.iter().any(|c| c.type_ == type_ && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::Timestamp;

    fn t(secs: i64) -> Time {
        Time(Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let first = build(&[CondSpec::new("Ready", false, "ReplicasNotReady", "0/1")], &[], Some(1), &t(10));
        assert_eq!(first[0].last_transition_time, t(10));
        let same = build(&[CondSpec::new("Ready", false, "ReplicasNotReady", "0/2")], &first, Some(2), &t(20));
        assert_eq!(same[0].last_transition_time, t(10));
        assert_eq!(same[0].message, "0/2");
        assert_eq!(same[0].observed_generation, Some(2));
        let flipped = build(&[CondSpec::new("Ready", true, "AllReplicasReady", "2/2")], &same, Some(2), &t(30));
        assert_eq!(flipped[0].last_transition_time, t(30));
        assert!(is_true(&flipped, "Ready"));
        assert!(!is_true(&same, "Ready"));
    }
}

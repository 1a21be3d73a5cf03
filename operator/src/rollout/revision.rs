//! Revisions: a short hash of the pod template a ModelDeployment produces.
//!
//! Hashing the template, not the spec, makes every pod-affecting change a new revision (weights,
//! engine flags, image, resources, and also the operator's own defaults, such as a new default agent
//! image), while changes that do not touch pods (replicas, autoscaling, the rollout settings) are not.

use k8s_openapi::api::core::v1::PodTemplateSpec;
use xxhash_rust::xxh3::xxh3_64;

/// Annotation on the stable and canary Deployments: the revision their template is.
pub const REVISION_ANNOTATION: &str = "serving.peregrine.dev/revision";
/// Label on canary pods (and in the canary Deployment's selector): the revision they run.
pub const REVISION_LABEL: &str = "serving.peregrine.dev/revision";

/// The revision of `template`: 10 hex digits of the XXH3 of its JSON form. Serialization is
/// deterministic (struct fields in order, maps sorted), so equal templates always hash alike.
pub fn revision_of(template: &PodTemplateSpec) -> Result<String, serde_json::Error> {
    let bytes = serde_json::to_vec(template)?;
    Ok(format!("{:016x}", xxh3_64(&bytes))[..10].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use std::collections::BTreeMap;

    fn template(image: &str, labels: &[(&str, &str)]) -> PodTemplateSpec {
        PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>()),
                ..Default::default()
            }),
            spec: Some(PodSpec { containers: vec![Container { name: "agent".into(), image: Some(image.into()), ..Default::default() }], ..Default::default() }),
        }
    }

    #[test]
    fn equal_templates_hash_alike_and_changes_do_not() {
        let a = revision_of(&template("agent:1", &[("a", "1"), ("b", "2")])).unwrap();
        assert_eq!(a.len(), 10);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        // Label insertion order does not matter (maps serialize sorted).
        assert_eq!(a, revision_of(&template("agent:1", &[("b", "2"), ("a", "1")])).unwrap());
        assert_ne!(a, revision_of(&template("agent:2", &[("a", "1"), ("b", "2")])).unwrap());
        assert_ne!(a, revision_of(&template("agent:1", &[("a", "1")])).unwrap());
    }
}

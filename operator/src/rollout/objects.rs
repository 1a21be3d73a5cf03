//! Pure functions between Kubernetes objects and the state machine: the canary Deployment and the
//! stable Deployment to apply, and what observed Deployments and pods mean.
//!
//! The canary runs under the same Service as the stable pods (they share the ModelDeployment label
//! the Service selects), so traffic splits by replica count, as Argo Rollouts does without a mesh.
//! The canary Deployment's selector adds a track label so that it never counts stable pods; the
//! stable Deployment's ReplicaSets select by their own pod-template-hash, so it never counts canary
//! pods either.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, DeploymentStrategy};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use peregrine_crds::{RolloutSpec, RolloutStatus, RolloutStrategy, CONDITION_ROLLOUT_FAILED, DEPLOYMENT_LABEL};

use super::machine::{CanaryState, Failure, StableTemplate};
use super::revision::{REVISION_ANNOTATION, REVISION_LABEL};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Label on canary pods and in the canary Deployment's selector.
pub const TRACK_LABEL: &str = "serving.peregrine.dev/track";
pub const TRACK_CANARY: &str = "canary";

/// Name of the canary Deployment of ModelDeployment `name`.
pub fn canary_name(name: &str) -> String {
    format!("{name}-canary")
}

/// Label selector (string form) of the canary pods of ModelDeployment `name`.
pub fn canary_pod_selector(name: &str) -> String {
    format!("{DEPLOYMENT_LABEL}={name},{TRACK_LABEL}={TRACK_CANARY}")
}

/// Label selector of the stable pods: the deployment's, without the canary track.
pub fn stable_pod_selector(name: &str) -> String {
    format!("{DEPLOYMENT_LABEL}={name},!{TRACK_LABEL}")
}

fn annotate(d: &mut Deployment, revision: &str) {
    d.metadata.annotations.get_or_insert_with(BTreeMap::new).insert(REVISION_ANNOTATION.into(), revision.into());
}

/// The canary Deployment: `desired` (the stable Deployment as the spec asks for it now) renamed,
/// with the track and revision labels on its pods and in its selector, and `replicas` pods.
pub fn canary_deployment(desired: &Deployment, name: &str, revision: &str, replicas: i32) -> Deployment {
    let mut canary = desired.clone();
    canary.metadata.name = Some(canary_name(name));
    canary.metadata.resource_version = None;
    canary.metadata.uid = None;
    canary.status = None;
    annotate(&mut canary, revision);
    let extra = [(TRACK_LABEL.to_string(), TRACK_CANARY.to_string()), (REVISION_LABEL.to_string(), revision.to_string())];
    canary.metadata.labels.get_or_insert_with(BTreeMap::new).extend(extra.clone());
    if let Some(spec) = canary.spec.as_mut() {
        spec.replicas = Some(replicas);
        let mut selector = spec.selector.match_labels.clone().unwrap_or_default();
        // The selector is immutable: only the track goes in, so that a new revision can reuse the
        // Deployment (its pods roll like any template change).
        selector.insert(TRACK_LABEL.into(), TRACK_CANARY.into());
        spec.selector = LabelSelector { match_labels: Some(selector), ..Default::default() };
        let meta = spec.template.metadata.get_or_insert_with(Default::default);
        meta.labels.get_or_insert_with(BTreeMap::new).extend(extra);
    }
    canary
}

/// The stable Deployment to apply: `desired` with the template `which` says, annotated with its
/// revision. `existing` is the stable Deployment in the cluster (its template is kept for `Keep`).
pub fn stable_deployment(
    desired: &Deployment,
    existing: Option<&Deployment>,
    which: StableTemplate,
    update_revision: &str,
    rollout: Option<&RolloutSpec>,
) -> Deployment {
    let mut out = desired.clone();
    let kept = match which {
        StableTemplate::Keep => existing.and_then(|e| Some((e.spec.as_ref()?.template.clone(), revision_annotation(e)?))),
        StableTemplate::Update => None,
    };
    match kept {
        Some((template, revision)) => {
            if let Some(spec) = out.spec.as_mut() {
                spec.template = template;
            }
            annotate(&mut out, &revision);
        }
        None => annotate(&mut out, update_revision),
    }
    if rollout.is_some_and(|r| r.strategy == RolloutStrategy::Recreate) {
        if let Some(spec) = out.spec.as_mut() {
            // Two revisions cannot share the GPUs: old pods go before new ones start.
            spec.strategy = Some(DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None });
        }
    }
    out
}

/// The revision annotation of a Deployment.
pub fn revision_annotation(d: &Deployment) -> Option<String> {
    d.metadata.annotations.as_ref()?.get(REVISION_ANNOTATION).cloned()
}

/// Whether `d` has rolled out its current template on every desired replica.
pub fn rolled_out(d: &Deployment) -> bool {
    let (Some(spec), Some(status)) = (d.spec.as_ref(), d.status.as_ref()) else {
        return false;
    };
    let want = spec.replicas.unwrap_or(1);
    let observed = match (d.metadata.generation, status.observed_generation) {
        (Some(g), Some(o)) => o >= g,
        (None, _) => true,
        (Some(_), None) => false,
    };
    observed
        && status.updated_replicas.unwrap_or(0) >= want
        && status.available_replicas.unwrap_or(0) >= want
        && status.replicas.unwrap_or(0) <= want
}

/// Whether a container of a pod is crash-looping.
pub fn crash_looping(pods: &[Pod]) -> bool {
    pods.iter().any(|p| {
        p.status.as_ref().and_then(|s| s.container_statuses.as_ref()).is_some_and(|cs| {
            cs.iter().any(|c| c.state.as_ref().and_then(|s| s.waiting.as_ref()).and_then(|w| w.reason.as_deref()) == Some("CrashLoopBackOff"))
        })
    })
}

/// The canary Deployment (with its pods) as the state machine sees it.
pub fn canary_state(canary: &Deployment, pods: &[Pod]) -> CanaryState {
    CanaryState {
        revision: revision_annotation(canary),
        replicas: canary.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
        ready: rolled_out(canary),
        crash_looping: crash_looping(pods),
    }
}

/// The failed rollout recorded in the status, if the `RolloutFailed` condition is set.
pub fn recorded_failure(status: Option<&RolloutStatus>, conditions: &[Condition]) -> Option<Failure> {
    let cond = conditions.iter().find(|c| c.type_ == CONDITION_ROLLOUT_FAILED && c.status == "True")?;
    Some(Failure { revision: status?.update_revision.clone()?, reason: cond.reason.clone(), message: cond.message.clone() })
}

/// Root URLs (`http://<podIP>:<port>`) of the ready pods among `pods`.
pub fn ready_pod_urls(pods: &[Pod], port: i32) -> Vec<String> {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .filter_map(|p| p.status.as_ref()?.pod_ip.as_ref().map(|ip| format!("http://{ip}:{port}")))
        .collect()
}

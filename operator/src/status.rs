//! What a ModelDeployment's status should say, from what the cluster reports (pure).

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use peregrine_crds::{
    reasons, ModelDeployment, ModelDeploymentStatus, CONDITION_DEGRADED, CONDITION_PROGRESSING, CONDITION_READY,
};

use crate::conditions::{build, CondSpec};
use crate::desired::{endpoint, selector_string};
use crate::validate::SpecError;

/// The status the operator owns (replicas, selector, endpoint, `Ready`/`Progressing`/`Degraded`).
/// `autoscaling` and `rollout` are left out: their controllers own them under server-side apply.
///
/// `problem` is a spec error or failed apply; it makes the deployment `Degraded` with its message.
pub fn model_deployment_status(
    md: &ModelDeployment,
    deployment: Option<&Deployment>,
    problem: Option<&SpecError>,
    port: i32,
    now: &Time,
) -> ModelDeploymentStatus {
    let desired = md.spec.replicas;
    let dep_status = deployment.and_then(|d| d.status.clone()).unwrap_or_default();
    let replicas = dep_status.replicas.unwrap_or(0);
    let ready = dep_status.ready_replicas.unwrap_or(0);
    let updated = dep_status.updated_replicas.unwrap_or(0);
    let dep_generation = deployment.and_then(|d| d.metadata.generation);
    // The Deployment controller has not seen our latest template yet.
    let dep_behind = dep_status.observed_generation.is_some_and(|o| Some(o) < dep_generation);
    let deadline_exceeded = dep_status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Progressing" && c.status == "False" && c.reason.as_deref() == Some("ProgressDeadlineExceeded"));

    let ready_cond = match (problem, deployment) {
        (Some(p), _) => CondSpec::new(CONDITION_READY, false, p.reason, p.message.clone()),
        (None, None) => CondSpec::new(CONDITION_READY, false, reasons::REPLICAS_NOT_READY, "Deployment not created yet"),
        (None, Some(_)) if desired == 0 => CondSpec::new(CONDITION_READY, true, reasons::SCALED_TO_ZERO, "scaled to zero replicas"),
        (None, Some(_)) if ready >= desired && !dep_behind => {
            CondSpec::new(CONDITION_READY, true, reasons::ALL_REPLICAS_READY, format!("{ready}/{desired} replicas ready"))
        }
        (None, Some(_)) => CondSpec::new(CONDITION_READY, false, reasons::REPLICAS_NOT_READY, format!("{ready}/{desired} replicas ready")),
    };
    let progressing = problem.is_none() && (deployment.is_none() || dep_behind || updated < desired || replicas != desired || ready < desired);
    let progressing_cond = if progressing {
        CondSpec::new(CONDITION_PROGRESSING, true, reasons::ROLLING_UPDATE, format!("{updated}/{desired} replicas updated, {ready} ready"))
    } else {
        CondSpec::new(CONDITION_PROGRESSING, false, reasons::STABLE, "no change in progress")
    };
    let degraded_cond = match problem {
        Some(p) => CondSpec::new(CONDITION_DEGRADED, true, p.reason, p.message.clone()),
        None if deadline_exceeded => CondSpec::new(
            CONDITION_DEGRADED,
            true,
            reasons::REPLICAS_NOT_READY,
            "pods did not become ready within the progress deadline; see the pods' events",
        ),
        None => CondSpec::new(CONDITION_DEGRADED, false, reasons::STABLE, "no problems"),
    };

    let previous = md.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    ModelDeploymentStatus {
        observed_generation: md.metadata.generation,
        replicas,
        ready_replicas: ready,
        selector: Some(selector_string(md)),
        endpoint: (problem.is_none()).then(|| endpoint(md, port)),
        conditions: build(&[ready_cond, progressing_cond, degraded_cond], previous, md.metadata.generation, now),
        autoscaling: None,
        rollout: None,
    }
}

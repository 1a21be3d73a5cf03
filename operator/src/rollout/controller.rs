//! The rollout controller glue: reads the cluster, asks [`machine::plan`] what to do, does it.
//!
//! Called by the ModelDeployment controller in place of applying its desired Deployment directly:
//! [`reconcile`] applies the stable Deployment itself (with the stable template kept during a
//! rollout) and returns it for the status.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client, Resource, ResourceExt};
use peregrine_crds::{LoraAdapter, ModelDeployment, RegressionCase, RegressionThresholds, StepResult};
use serde_json::json;
use tracing::{info, warn};

use super::machine::{self, Action, Controls, Input, Observed, Plan};
use super::objects::{
    canary_deployment, canary_name, canary_pod_selector, canary_state, ready_pod_urls, recorded_failure, revision_annotation, rolled_out,
    stable_deployment, stable_pod_selector,
};
use super::revision::revision_of;
use crate::regression::runner::{RunError, SuiteReport, SuiteTarget};
use crate::regression::suite::{load_cases, SuiteError};
use crate::regression::{run_suite, OpenAiClient};

/// Field manager of the Deployments (shared with the ModelDeployment controller, which applied them
/// before rollouts existed).
pub const DEPLOYMENT_FIELD_MANAGER: &str = "peregrine-operator";
/// Field manager of `status.rollout` and the rollout conditions, so that under server-side apply
/// they are owned apart from the ModelDeployment controller's conditions.
pub const STATUS_FIELD_MANAGER: &str = "peregrine-operator-rollout";

#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("serializing: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error("object has no {0}")]
    MissingField(&'static str),
}

/// Runs a suite; a trait so that controller tests need no agents.
pub trait SuiteRunner: Send + Sync {
    fn run<'a>(
        &'a self,
        target: SuiteTarget,
        cases: Vec<RegressionCase>,
        thresholds: RegressionThresholds,
    ) -> BoxFuture<'a, Result<SuiteReport, RunError>>;
}

/// [`SuiteRunner`] over the agents' HTTP API.
pub struct HttpSuiteRunner {
    pub client: OpenAiClient,
}

impl SuiteRunner for HttpSuiteRunner {
    fn run<'a>(
        &'a self,
        target: SuiteTarget,
        cases: Vec<RegressionCase>,
        thresholds: RegressionThresholds,
    ) -> BoxFuture<'a, Result<SuiteReport, RunError>> {
        Box::pin(async move { run_suite(&self.client, &target, &cases, &thresholds).await })
    }
}

pub struct RolloutContext {
    pub client: Client,
    pub runner: Arc<dyn SuiteRunner>,
    /// Port of the agents' HTTP API.
    pub agent_port: i32,
    /// Where Events go (none in tests).
    pub recorder: Option<Recorder>,
}

/// What a reconciliation did.
#[derive(Debug)]
pub struct Reconciled {
    /// The stable Deployment as the API server returned it after the apply.
    pub stable: Deployment,
    pub plan: Plan,
    pub requeue: Option<Duration>,
}

/// Reconciles the rollout of `md`, whose Deployment as the spec asks for it now is `desired`.
pub async fn reconcile(md: &ModelDeployment, desired: Deployment, ctx: &RolloutContext) -> Result<Reconciled, RolloutError> {
    let ns = md.namespace().ok_or(RolloutError::MissingField("metadata.namespace"))?;
    let name = md.name_any();
    let template = desired.spec.as_ref().map(|s| s.template.clone()).ok_or(RolloutError::MissingField("spec of the desired Deployment"))?;
    let update_revision = revision_of(&template)?;
    let deployments = Api::<Deployment>::namespaced(ctx.client.clone(), &ns);
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &ns);

    let stable = deployments.get_opt(&name).await?;
    let canary = deployments.get_opt(&canary_name(&name)).await?;
    let canary_pods = match &canary {
        Some(_) => pods.list(&ListParams::default().labels(&canary_pod_selector(&name))).await?.items,
        None => Vec::new(),
    };
    let md_status = md.status.clone().unwrap_or_default();
    let status = md_status.rollout.clone().unwrap_or_default();
    let observed = Observed {
        stable_revision: stable.as_ref().map(|s| revision_annotation(s).unwrap_or_else(|| "unrecorded".into())),
        stable_rolled_out: stable.as_ref().is_some_and(rolled_out),
        canary: canary.as_ref().map(|c| canary_state(c, &canary_pods)),
        failed: recorded_failure(md_status.rollout.as_ref(), &md_status.conditions),
    };
    let controls = Controls::from_annotations(md.metadata.annotations.as_ref());
    let mut input = Input {
        rollout: md.spec.rollout.as_ref(),
        replicas: md.spec.replicas,
        update_revision: &update_revision,
        status: &status,
        observed: &observed,
        controls: &controls,
        suite: None,
        now: jiff::Timestamp::now(),
    };
    let mut plan = machine::plan(&input);

    let step = plan.actions.iter().find_map(|a| match a {
        Action::RunRegression { step } => Some(*step),
        _ => None,
    });
    let result;
    if let Some(step) = step {
        match run_regression(md, &ns, step, &canary_pods, ctx).await {
            Ok(r) => {
                result = r;
                input.suite = Some(&result);
                input.now = jiff::Timestamp::now();
                plan = machine::plan(&input);
            }
            Err(why) => {
                // Not the canary's fault (no reference pod yet, API hiccup): try again later.
                warn!(deployment = %name, step, %why, "regression run could not start");
                if let Some(c) = plan.conditions.first_mut() {
                    c.message = format!("step {}: regression run could not start: {why}", step + 1);
                }
                plan.requeue = Some(machine::RETRY);
            }
        }
    }

    for action in &plan.actions {
        match action {
            Action::EnsureCanary { replicas } => {
                let canary = canary_deployment(&desired, &name, &update_revision, *replicas);
                deployments.patch(&canary_name(&name), &PatchParams::apply(DEPLOYMENT_FIELD_MANAGER).force(), &Patch::Apply(&canary)).await?;
            }
            Action::DeleteCanary => match deployments.delete(&canary_name(&name), &DeleteParams::background()).await {
                Ok(_) => info!(deployment = %name, "canary deleted"),
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            },
            Action::RunRegression { .. } => {}
            Action::Event { warning, reason, note } => publish(md, ctx, *warning, reason, note).await,
        }
    }

    let stable_object = stable_deployment(&desired, stable.as_ref(), plan.stable, &update_revision, md.spec.rollout.as_ref());
    let stable = deployments.patch(&name, &PatchParams::apply(DEPLOYMENT_FIELD_MANAGER).force(), &Patch::Apply(&stable_object)).await?;

    write_status(md, &ns, &plan, &md_status.conditions, ctx).await?;
    Ok(Reconciled { stable, requeue: plan.requeue, plan })
}

/// Why a regression run did not happen (the step is retried, not failed).
#[derive(Debug, thiserror::Error)]
enum NotRun {
    #[error("no ready canary pod")]
    NoCanaryPod,
    #[error("no ready stable pod to compare with")]
    NoStablePod,
    #[error(transparent)]
    Kube(#[from] kube::Error),
    #[error(transparent)]
    Stable(RunError),
}

/// Runs the suite of `md` against one ready canary pod, with one ready stable pod as the reference.
/// A suite that cannot be read fails the step (someone must fix it); a missing reference does not.
async fn run_regression(md: &ModelDeployment, ns: &str, step: i32, canary_pods: &[Pod], ctx: &RolloutContext) -> Result<StepResult, NotRun> {
    let started = Time(jiff::Timestamp::now());
    let failed = |message: String| StepResult { step, passed: false, message, started_at: Some(started.clone()), finished_at: Some(Time(jiff::Timestamp::now())), ..Default::default() };
    let Some(regression) = md.spec.rollout.as_ref().and_then(|r| r.regression.as_ref()) else {
        return Ok(failed("step has runRegression but spec.rollout.regression is not set".into()));
    };
    let cases = match load_suite(ns, regression, ctx).await? {
        Ok(cases) => cases,
        Err(e) => return Ok(failed(format!("regression suite: {e}"))),
    };
    let name = md.name_any();
    let canary = ready_pod_urls(canary_pods, ctx.agent_port).into_iter().next().ok_or(NotRun::NoCanaryPod)?;
    let stable_pods = Api::<Pod>::namespaced(ctx.client.clone(), ns).list(&ListParams::default().labels(&stable_pod_selector(&name))).await?;
    let stable = ready_pod_urls(&stable_pods.items, ctx.agent_port).into_iter().next().ok_or(NotRun::NoStablePod)?;
    let adapters = Api::<LoraAdapter>::namespaced(ctx.client.clone(), ns).list(&ListParams::default()).await?;
    let adapters: Vec<String> = adapters
        .items
        .iter()
        .filter(|a| a.spec.deployment_ref.name == name && a.metadata.deletion_timestamp.is_none())
        .map(LoraAdapter::served_name)
        .collect();
    let target = SuiteTarget { canary, stable: Some(stable), model: md.served_model_name(), adapters, task: md.spec.model.task };
    info!(deployment = %name, step, canary = %target.canary, cases = cases.len(), "running regression suite");
    let report = match ctx.runner.run(target, cases, regression.thresholds.clone()).await {
        Ok(report) => report,
        Err(e @ RunError::Stable { .. }) => return Err(NotRun::Stable(e)),
        Err(e) => return Ok(failed(e.to_string())),
    };
    let mut result = report.to_step_result(step);
    result.started_at = Some(started);
    result.finished_at = Some(Time(jiff::Timestamp::now()));
    Ok(result)
}

/// The suite's cases: inline, or from the ConfigMap key.
async fn load_suite(
    ns: &str,
    regression: &peregrine_crds::RegressionSpec,
    ctx: &RolloutContext,
) -> Result<Result<Vec<RegressionCase>, SuiteError>, kube::Error> {
    let Some(r) = &regression.suite.config_map_ref else {
        return Ok(crate::regression::suite::check_cases(&regression.suite.cases).map(|()| regression.suite.cases.clone()));
    };
    let Some(cm) = Api::<ConfigMap>::namespaced(ctx.client.clone(), ns).get_opt(&r.name).await? else {
        return Ok(Err(SuiteError::MissingKey { name: r.name.clone(), key: r.key.clone() }));
    };
    Ok(match cm.data.as_ref().and_then(|d| d.get(&r.key)) {
        Some(text) => load_cases(text),
        None => Err(SuiteError::MissingKey { name: r.name.clone(), key: r.key.clone() }),
    })
}

async fn publish(md: &ModelDeployment, ctx: &RolloutContext, warning: bool, reason: &str, note: &str) {
    if warning {
        warn!(deployment = %md.name_any(), reason, note, "rollout");
    } else {
        info!(deployment = %md.name_any(), reason, note, "rollout");
    }
    let Some(recorder) = &ctx.recorder else { return };
    let event = Event {
        type_: if warning { EventType::Warning } else { EventType::Normal },
        reason: reason.to_string(),
        // Event notes are limited to 1 kB.
        note: Some(crate::regression::client::truncate(note, 1000)),
        action: "Rollout".into(),
        secondary: None,
    };
    // An Event that cannot be written must not fail the reconciliation.
    if let Err(e) = recorder.publish(&event, &md.object_ref(&())).await {
        warn!(error = %e, "publishing rollout event");
    }
}

/// Turns the plan's conditions into `metav1.Condition`s, keeping `lastTransitionTime` while a
/// condition's status holds.
pub fn build_conditions(plan: &Plan, previous: &[Condition], generation: Option<i64>, now: &Time) -> Vec<Condition> {
    plan.conditions
        .iter()
        .map(|c| {
            let status = if c.status { "True" } else { "False" }.to_string();
            let last_transition_time = previous
                .iter()
                .find(|p| p.type_ == c.type_ && p.status == status)
                .map(|p| p.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            Condition {
                type_: c.type_.to_string(),
                status,
                reason: c.reason.clone(),
                message: crate::regression::client::truncate(&c.message, 32_000),
                observed_generation: generation,
                last_transition_time,
            }
        })
        .collect()
}

async fn write_status(md: &ModelDeployment, ns: &str, plan: &Plan, previous: &[Condition], ctx: &RolloutContext) -> Result<(), RolloutError> {
    let now = Time(jiff::Timestamp::now());
    let patch = json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1",
        "kind": "ModelDeployment",
        "status": {
            "rollout": plan.status,
            "conditions": build_conditions(plan, previous, md.metadata.generation, &now),
        },
    });
    Api::<ModelDeployment>::namespaced(ctx.client.clone(), ns)
        .patch_status(&md.name_any(), &PatchParams::apply(STATUS_FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await?;
    Ok(())
}

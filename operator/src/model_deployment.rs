//! The ModelDeployment controller: Deployment + Service by server-side apply, the adapters-loaded
//! readiness gate of its pods, and status from what the cluster reports.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, Resource, ResourceExt};
use peregrine_crds::{
    reasons, AdapterPhase, LoraAdapter, ModelDeployment, PodAdapterState, SourceUri, ADAPTERS_LOADED_CONDITION,
    CONDITION_READY, DEPLOYMENT_LABEL,
};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::conditions::{build, is_true, CondSpec};
use crate::gateway;
use crate::desired::{deployment::desired_deployment, selector_string, service::desired_service};
use crate::rollout;
use crate::status::model_deployment_status;
use crate::validate::{validate_name, validate_spec, SpecError};
use crate::{Context, Error, Result, FIELD_MANAGER};

const CONTROLLER: &str = "modeldeployment";

/// Reconciles one ModelDeployment, in one trace span named after the object.
#[instrument(name = "reconcile_model_deployment", skip_all, fields(name = %md.name_any(), namespace = md.namespace().unwrap_or_default()))]
pub async fn reconcile(md: Arc<ModelDeployment>, ctx: Arc<Context>) -> Result<Action> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let ns = md.namespace().ok_or(Error::MissingField("metadata.namespace"))?;
    let name = md.name_any();
    let now = Time(jiff::Timestamp::now());

    // Refuse what cannot work before creating anything, so nothing is half-created.
    let uri = match validate_name(&name).and_then(|()| validate_spec(&md.spec)) {
        Ok(uri) => uri,
        Err(problem) => {
            write_status(&md, &ctx, None, Some(&problem), &now, None).await?;
            return Ok(Action::await_change());
        }
    };
    if let Some(secret) = &md.spec.model.secret_ref {
        if Api::<Secret>::namespaced(ctx.client.clone(), &ns).get_opt(&secret.name).await?.is_none() {
            let problem = SpecError {
                reason: reasons::SECRET_NOT_FOUND,
                message: format!("spec.model.secretRef: Secret {:?} not found in namespace {ns}", secret.name),
            };
            write_status(&md, &ctx, None, Some(&problem), &now, None).await?;
            // Secrets are not watched; look again in a while.
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    }

    let (deployment, rollout_requeue) = match apply_children(&md, &uri, &ctx, &ns).await {
        Ok(applied) => applied,
        Err(error) => {
            // The API server refused a child (a quantity it cannot parse, a field it forbids...) or
            // could not be reached: say so on the object, where `kubectl get` and Argo CD look,
            // and let the error policy retry with backoff.
            let problem = SpecError { reason: reasons::APPLY_FAILED, message: format!("applying the Deployment and Service failed: {error}") };
            if let Err(status_error) = write_status(&md, &ctx, None, Some(&problem), &now, None).await {
                warn!(error = %status_error, "writing the ApplyFailed status");
            }
            return Err(error);
        }
    };

    let pods = open_readiness_gates(&md, &ns, &ctx, &now).await?;
    let load_note = crate::load_progress::note(&pods, ctx.agent.as_ref(), ctx.config.agent_port).await;

    // Only deployments that ask for a pool (or had one) cost API calls here.
    let gateway = if gateway::involved(&md) {
        let adapters = Api::<LoraAdapter>::namespaced(ctx.client.clone(), &ns).list(&ListParams::default()).await?;
        gateway::reconcile(&md, &adapters.items, &ctx, &ns).await
    } else {
        None
    };

    let ready = write_status_with_gateway(&md, &ctx, Some(&deployment), None, gateway.as_ref(), &now, load_note.as_deref()).await?;
    let requeue = if ready { Duration::from_secs(300) } else { Duration::from_secs(15) };
    // A rollout step (pause, canary deadline, retry) may need to be looked at sooner.
    Ok(Action::requeue(rollout_requeue.map_or(requeue, |r| r.min(requeue))))
}

/// Applies the Deployment(s), through the rollout controller, and the Service. Returns the stable
/// Deployment as the API server has it and when the rollout wants to be looked at again.
async fn apply_children(md: &ModelDeployment, uri: &SourceUri, ctx: &Context, ns: &str) -> Result<(Deployment, Option<Duration>)> {
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    if let Some(key) = &ctx.config.admin_api_key {
        // Before the pods that read it.
        let secret = crate::desired::admin_key::desired_secret(md, key);
        Api::<Secret>::namespaced(ctx.client.clone(), ns)
            .patch(&crate::desired::admin_key::secret_name(md), &apply, &Patch::Apply(&secret))
            .await?;
    }
    let desired = desired_deployment(md, uri, &ctx.config);
    // The rollout controller applies the stable Deployment (and any canary) itself, so that a
    // pod-changing edit goes out in gated steps instead of one rolling update.
    let rollout = rollout::reconcile(md, desired, &ctx.rollout).await?;
    ctx.metrics.record_rollout_step(ns, &md.name_any(), rollout.plan.status.current_step);
    let service = desired_service(md, ctx.config.agent_port);
    Api::<Service>::namespaced(ctx.client.clone(), ns).patch(&md.name_any(), &apply, &Patch::Apply(&service)).await?;
    Ok((rollout.stable, rollout.requeue))
}

/// Writes the status (server-side apply of the fields this controller owns) and publishes an Event
/// when `Ready` flips; `load_note` (the agents' load progress) ends the `Progressing` message.
/// Returns whether the deployment is ready.
async fn write_status(
    md: &ModelDeployment,
    ctx: &Context,
    deployment: Option<&Deployment>,
    problem: Option<&SpecError>,
    now: &Time,
    load_note: Option<&str>,
) -> Result<bool> {
    write_status_with_gateway(md, ctx, deployment, problem, None, now, load_note).await
}

/// [`write_status`] with the gateway step's `InferencePoolReady` condition, if any (left out, it
/// is removed: this field manager owns it); an Event when its reason changes.
async fn write_status_with_gateway(
    md: &ModelDeployment,
    ctx: &Context,
    deployment: Option<&Deployment>,
    problem: Option<&SpecError>,
    gateway: Option<&CondSpec>,
    now: &Time,
    load_note: Option<&str>,
) -> Result<bool> {
    let ns = md.namespace().ok_or(Error::MissingField("metadata.namespace"))?;
    let mut status = model_deployment_status(md, deployment, problem, ctx.config.agent_port, now);
    ctx.metrics.record_replicas(&ns, &md.name_any(), status.replicas, status.ready_replicas);
    let previous = md.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    if let Some(cond) = gateway {
        status.conditions.extend(build(std::slice::from_ref(cond), previous, md.metadata.generation, now));
        let changed = !previous.iter().any(|c| c.type_ == cond.type_ && c.reason == cond.reason);
        if changed {
            let event = Event {
                type_: if cond.status { EventType::Normal } else { EventType::Warning },
                reason: cond.reason.to_string(),
                note: Some(cond.message.chars().take(1024).collect()),
                action: "Reconcile".into(),
                secondary: None,
            };
            if let Err(e) = ctx.recorder.publish(&event, &md.object_ref(&())).await {
                warn!(error = %e, "publishing event");
            }
        }
    }
    if let Some(note) = load_note {
        crate::load_progress::annotate(&mut status, note);
    }
    let was_ready = md.status.as_ref().is_some_and(|s| is_true(&s.conditions, CONDITION_READY));
    let ready = is_true(&status.conditions, CONDITION_READY);
    let patch = json!({
        "apiVersion": "serving.peregrine.dev/v1alpha1",
        "kind": "ModelDeployment",
        "status": status,
    });
    Api::<ModelDeployment>::namespaced(ctx.client.clone(), &ns)
        .patch_status(&md.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await?;

    let previous_reason = md
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION_READY))
        .map(|c| c.reason.clone());
    let ready_cond = status.conditions.iter().find(|c| c.type_ == CONDITION_READY);
    if let Some(cond) = ready_cond {
        if was_ready != ready || previous_reason.as_deref() != Some(cond.reason.as_str()) {
            let event = Event {
                type_: if problem.is_some() { EventType::Warning } else { EventType::Normal },
                reason: cond.reason.clone(),
                note: Some(cond.message.clone()),
                action: "Reconcile".into(),
                secondary: None,
            };
            // An Event that cannot be written must not fail the reconciliation.
            if let Err(e) = ctx.recorder.publish(&event, &md.object_ref(&())).await {
                warn!(error = %e, "publishing event");
            }
        }
    }
    Ok(ready)
}

/// Adapters that gate pod readiness: every adapter of the deployment except those failing
/// everywhere (they would hold every new pod back forever; their own status says why) and those
/// being deleted.
pub fn gating_adapters<'a>(adapters: &'a [LoraAdapter], deployment: &str) -> Vec<&'a LoraAdapter> {
    adapters
        .iter()
        .filter(|a| a.spec.deployment_ref.name == deployment)
        .filter(|a| a.metadata.deletion_timestamp.is_none())
        .filter(|a| a.status.as_ref().and_then(|s| s.phase) != Some(AdapterPhase::Failed))
        .collect()
}

/// Whether every gating adapter reports itself loaded in `pod`.
pub fn adapters_loaded_in(pod: &str, gating: &[&LoraAdapter]) -> bool {
    gating.iter().all(|a| {
        a.status
            .as_ref()
            .is_some_and(|s| s.pods.iter().any(|p| p.name == pod && p.state == PodAdapterState::Loaded))
    })
}

/// Sets the `adapters-loaded` readiness gate on pods that have every adapter. A gate, once open,
/// stays open: adding an adapter must not pull serving pods out of the Service.
/// Returns the deployment's pods (read for the gates, reused for the load progress).
async fn open_readiness_gates(md: &ModelDeployment, ns: &str, ctx: &Context, now: &Time) -> Result<Vec<Pod>> {
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns);
    let pod_list = pods.list(&ListParams::default().labels(&selector_string(md))).await?;
    if pod_list.items.is_empty() {
        return Ok(Vec::new());
    }
    let adapters = Api::<LoraAdapter>::namespaced(ctx.client.clone(), ns).list(&ListParams::default()).await?;
    let gating = gating_adapters(&adapters.items, &md.name_any());
    for pod in &pod_list.items {
        let gate_open = pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == ADAPTERS_LOADED_CONDITION && c.status == "True"));
        let name = pod.name_any();
        if gate_open || pod.metadata.deletion_timestamp.is_some() || !adapters_loaded_in(&name, &gating) {
            continue;
        }
        let patch = json!({"status": {"conditions": [{
            "type": ADAPTERS_LOADED_CONDITION,
            "status": "True",
            "reason": reasons::LOADED,
            "message": format!("{} adapter(s) loaded", gating.len()),
            "lastTransitionTime": now,
        }]}});
        pods.patch_status(&name, &PatchParams::default(), &Patch::Strategic(&patch)).await?;
        info!(pod = %name, adapters = gating.len(), "opened adapters-loaded readiness gate");
    }
    Ok(pod_list.items)
}

pub fn error_policy(md: Arc<ModelDeployment>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(name = %md.name_any(), %error, "reconcile failed");
    ctx.metrics.reconcile_failed(CONTROLLER, error);
    Action::requeue(ctx.backoff.next(ObjectRef::from_obj(&*md).erase()))
}

/// Runs the controller until the stream ends (shutdown signal).
pub async fn run(ctx: Arc<Context>, namespace: Option<String>) {
    let client = ctx.client.clone();
    let (mds, deployments, services, pods, adapters) = match &namespace {
        Some(ns) => (
            Api::<ModelDeployment>::namespaced(client.clone(), ns),
            Api::<Deployment>::namespaced(client.clone(), ns),
            Api::<Service>::namespaced(client.clone(), ns),
            Api::<Pod>::namespaced(client.clone(), ns),
            Api::<LoraAdapter>::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone()), Api::all(client.clone()), Api::all(client.clone()), Api::all(client.clone())),
    };
    let managed = watcher::Config::default().labels(DEPLOYMENT_LABEL);
    Controller::new(mds, watcher::Config::default().any_semantic())
        .owns(deployments, managed.clone())
        .owns(services, managed.clone())
        // Pods are owned by ReplicaSets, not by us: map them back through their label.
        .watches(pods, managed, |pod: Pod| {
            let ns = pod.namespace();
            pod.labels().get(DEPLOYMENT_LABEL).map(|name| ObjectRef::new(name).within(ns.as_deref().unwrap_or_default()))
        })
        // Adapter status changes open readiness gates.
        .watches(adapters, watcher::Config::default(), |a: LoraAdapter| {
            let ns = a.namespace();
            Some(ObjectRef::new(&a.spec.deployment_ref.name).within(ns.as_deref().unwrap_or_default()))
        })
        .shutdown_on_signal()
        .run(reconcile_with_backoff, error_policy, ctx)
        .for_each(|_| futures::future::ready(()))
        .await;
}

/// [`reconcile`], resetting the object's failure backoff when it succeeds.
async fn reconcile_with_backoff(md: Arc<ModelDeployment>, ctx: Arc<Context>) -> Result<Action> {
    let key = ObjectRef::from_obj(&*md).erase();
    let action = reconcile(md, ctx.clone()).await?;
    ctx.backoff.reset(&key);
    Ok(action)
}

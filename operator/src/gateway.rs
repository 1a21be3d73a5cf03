//! The ModelDeployment controller's gateway step: the `InferencePool` of a deployment whose
//! `spec.gateway.inferencePool` asks for one, and its adapters' `InferenceObjective`s, applied only
//! where API discovery shows those CRDs (discovery needs no RBAC rule, unlike reading CRDs).
//!
//! It never fails the reconciliation: a missing CRD or a refused object is the
//! `InferencePoolReady` condition's reason and message (with a Warning event when it changes),
//! while the deployment keeps serving through its Service.

use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::core::DynamicObject;
use kube::{Api, Client, ResourceExt};
use peregrine_crds::{reasons, InferencePoolSettings, LoraAdapter, ModelDeployment, CONDITION_INFERENCE_POOL_READY, DEPLOYMENT_LABEL};
use tracing::info;

use crate::conditions::CondSpec;
use crate::desired::gateway::{endpoint_picker_service, inference_objective, inference_objective_resource, inference_pool, inference_pool_resource};
use crate::{Context, FIELD_MANAGER};

/// Whether the gateway step has anything to do: the spec asks for a pool, or one was made before.
pub fn involved(md: &ModelDeployment) -> bool {
    let asks = md.spec.gateway.as_ref().and_then(|g| g.inference_pool.as_ref()).is_some_and(|p| p.enabled);
    asks || md.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.type_ == CONDITION_INFERENCE_POOL_READY))
}

/// What to report as `InferencePoolReady`: `None` when the spec asks for no pool and none was made.
pub async fn reconcile(md: &ModelDeployment, adapters: &[LoraAdapter], ctx: &Context, ns: &str) -> Option<CondSpec> {
    let settings = md.spec.gateway.as_ref().and_then(|g| g.inference_pool.as_ref()).filter(|p| p.enabled);
    let reported = md.status.as_ref().is_some_and(|s| s.conditions.iter().any(|c| c.type_ == CONDITION_INFERENCE_POOL_READY));
    match settings {
        Some(settings) => Some(apply(md, settings, adapters, ctx, ns).await),
        // Asked before, not now: delete what was made (the condition goes once that worked).
        None if reported => remove(md, ctx, ns).await.err(),
        None => None,
    }
}

/// Whether the cluster serves `plural` in `group_version` (the CRD is installed and established).
pub async fn api_available(client: &Client, group_version: &str, plural: &str) -> Result<bool, kube::Error> {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == plural)),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

fn failed(message: String) -> CondSpec {
    CondSpec::new(CONDITION_INFERENCE_POOL_READY, false, reasons::INFERENCE_POOL_APPLY_FAILED, message)
}

async fn apply(md: &ModelDeployment, settings: &InferencePoolSettings, adapters: &[LoraAdapter], ctx: &Context, ns: &str) -> CondSpec {
    let client = &ctx.client;
    let pool_resource = inference_pool_resource();
    match api_available(client, &pool_resource.api_version, &pool_resource.plural).await {
        Ok(true) => {}
        Ok(false) => {
            return CondSpec::new(
                CONDITION_INFERENCE_POOL_READY,
                false,
                reasons::INFERENCE_POOL_CRD_MISSING,
                "spec.gateway.inferencePool: this cluster has no InferencePool API (inference.networking.k8s.io/v1): install the Gateway API Inference Extension CRDs (docs/gateways.md); the deployment serves through its Service meanwhile",
            )
        }
        Err(e) => return failed(format!("API discovery of inference.networking.k8s.io/v1 failed: {e}")),
    }
    let name = md.name_any();
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let pool = inference_pool(md, settings, ctx.config.agent_port);
    let pools = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &pool_resource);
    if let Err(e) = pools.patch(&name, &apply, &Patch::Apply(&pool)).await {
        return failed(format!("applying InferencePool {name:?} failed: {e}"));
    }
    let picker = format!("{}:{}", endpoint_picker_service(md, settings), settings.endpoint_picker_port);
    let summary = format!("InferencePool {name:?} selects the deployment's pods on port {}, endpoint picker Service {picker}", ctx.config.agent_port);

    let ours: Vec<&LoraAdapter> = adapters
        .iter()
        .filter(|a| a.spec.deployment_ref.name == name && a.metadata.deletion_timestamp.is_none())
        .collect();
    let prioritized = ours.iter().filter(|a| a.spec.gateway.as_ref().is_some_and(|g| g.priority.is_some())).count();
    let objective_resource = inference_objective_resource();
    match api_available(client, &objective_resource.api_version, &objective_resource.plural).await {
        Ok(true) => {}
        Ok(false) if prioritized == 0 => {
            return CondSpec::new(CONDITION_INFERENCE_POOL_READY, true, reasons::INFERENCE_POOL_APPLIED, summary);
        }
        Ok(false) => {
            return CondSpec::new(
                CONDITION_INFERENCE_POOL_READY,
                false,
                reasons::INFERENCE_POOL_CRD_MISSING,
                format!("{summary}; but this cluster has no InferenceObjective API (inference.networking.x-k8s.io/v1alpha2), so the priorities of {prioritized} LoraAdapter(s) are not applied: install the Gateway API Inference Extension's experimental CRDs (docs/gateways.md)"),
            )
        }
        Err(e) => return failed(format!("{summary}; API discovery of inference.networking.x-k8s.io/v1alpha2 failed: {e}")),
    }
    if let Err(message) = sync_objectives(md, &ours, client, ns).await {
        return failed(format!("{summary}; {message}"));
    }
    CondSpec::new(CONDITION_INFERENCE_POOL_READY, true, reasons::INFERENCE_POOL_APPLIED, format!("{summary}; {prioritized} InferenceObjective(s) for LoraAdapters with a priority"))
}

/// Applies an objective per adapter with a priority and deletes the ones this deployment made for
/// adapters that no longer set one (found by the deployment label; deleted adapters' objectives
/// go with them through their owner reference).
async fn sync_objectives(md: &ModelDeployment, adapters: &[&LoraAdapter], client: &Client, ns: &str) -> Result<(), String> {
    let objectives = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &inference_objective_resource());
    let apply = PatchParams::apply(FIELD_MANAGER).force();
    let mut wanted = Vec::new();
    for adapter in adapters {
        if let Some(objective) = inference_objective(adapter, md) {
            let name = adapter.name_any();
            objectives
                .patch(&name, &apply, &Patch::Apply(&objective))
                .await
                .map_err(|e| format!("applying InferenceObjective {name:?} failed: {e}"))?;
            wanted.push(name);
        }
    }
    let selector = format!("{DEPLOYMENT_LABEL}={}", md.name_any());
    let existing = objectives.list(&ListParams::default().labels(&selector)).await.map_err(|e| format!("listing InferenceObjectives failed: {e}"))?;
    for stale in existing.items.iter().map(ResourceExt::name_any).filter(|n| !wanted.contains(n)) {
        delete(&objectives, &stale).await.map_err(|e| format!("deleting InferenceObjective {stale:?} failed: {e}"))?;
        info!(objective = %stale, "deleted InferenceObjective of a LoraAdapter without a priority");
    }
    Ok(())
}

/// Deletes the pool and this deployment's objectives; the error is the condition to keep showing.
async fn remove(md: &ModelDeployment, ctx: &Context, ns: &str) -> Result<(), CondSpec> {
    let name = md.name_any();
    for (resource, by_label) in [(inference_objective_resource(), true), (inference_pool_resource(), false)] {
        match api_available(&ctx.client, &resource.api_version, &resource.plural).await {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => return Err(failed(format!("API discovery of {} failed: {e}", resource.api_version))),
        }
        let api = Api::<DynamicObject>::namespaced_with(ctx.client.clone(), ns, &resource);
        let names = if by_label {
            let list = api.list(&ListParams::default().labels(&format!("{DEPLOYMENT_LABEL}={name}"))).await;
            list.map_err(|e| failed(format!("listing {}s failed: {e}", resource.kind)))?.items.iter().map(ResourceExt::name_any).collect()
        } else {
            vec![name.clone()]
        };
        for object in names {
            delete(&api, &object).await.map_err(|e| failed(format!("deleting {} {object:?} failed: {e}", resource.kind)))?;
        }
    }
    info!(deployment = %name, "spec.gateway.inferencePool turned off: deleted its InferencePool and InferenceObjectives");
    Ok(())
}

/// Deletes `name`; already gone is done.
async fn delete(api: &Api<DynamicObject>, name: &str) -> Result<(), kube::Error> {
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

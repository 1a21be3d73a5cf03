//! The LoraAdapter controller: loads the adapter into every ready agent pod of its deployment through
//! the agent's admin API, retries failed pods with backoff, unloads it on deletion (finalizer).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{finalizer, Event as FinalizerEvent};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Api, ResourceExt};
use peregrine_crds::{
    reasons, AdapterPhase, LoraAdapter, LoraAdapterStatus, ModelDeployment, PodAdapterState, PodAdapterStatus,
    SourceUri, CONDITION_CONFLICT, CONDITION_LOADED, CONDITION_READY, DEPLOYMENT_LABEL,
};
use serde_json::json;
use tracing::{info, instrument, warn};

use crate::conditions::{build, CondSpec};
use crate::context::backoff_delay;
use crate::desired::model::PVC_ROOT;
use crate::desired::selector_string;
use crate::validate::SpecError;
use crate::{Context, Error, Result, FIELD_MANAGER};

const CONTROLLER: &str = "loraadapter";
/// Finalizer that unloads the adapter from the agents before the object goes away.
pub const FINALIZER: &str = "serving.peregrine.dev/unload-adapter";

/// The path the agent loads the adapter from, as seen inside the agent container.
pub fn adapter_path(adapter: &LoraAdapter, md: &ModelDeployment) -> Result<String, SpecError> {
    let uri = SourceUri::parse(&adapter.spec.source.uri)
        .map_err(|e| SpecError { reason: reasons::UNSUPPORTED_URI, message: format!("spec.source.uri: {e}") })?;
    match uri {
        SourceUri::File { path } => Ok(path),
        SourceUri::Pvc { claim, path } => {
            let model_claim = match SourceUri::parse(&md.spec.model.uri) {
                Ok(SourceUri::Pvc { claim, .. }) => Some(claim),
                _ => None,
            };
            if model_claim.as_deref() == Some(claim.as_str()) || md.spec.adapter_volumes.contains(&claim) {
                Ok(format!("{PVC_ROOT}/{claim}/{path}"))
            } else {
                Err(SpecError {
                    reason: reasons::INVALID_SPEC,
                    message: format!(
                        "PVC {claim:?} is not mounted in the pods of ModelDeployment {:?}: add it to its spec.adapterVolumes",
                        md.name_any()
                    ),
                })
            }
        }
        // The agent fetches remote adapters itself.
        SourceUri::Remote { uri, .. } => Ok(uri),
    }
}

/// Why `adapter` may not serve under its name: the base model has it, or an older adapter of the
/// same deployment does (the oldest keeps the name; ties go to the name that sorts first), so
/// requests for the name would reach other weights.
pub fn served_name_conflict(adapter: &LoraAdapter, md: &ModelDeployment, adapters: &[LoraAdapter]) -> Option<String> {
    let name = adapter.served_name();
    if name == md.served_model_name() {
        return Some(format!("served name {name:?} is the base model's name in ModelDeployment {:?}: set spec.servedName", md.name_any()));
    }
    let seniority = |a: &LoraAdapter| (a.metadata.creation_timestamp.as_ref().map(|t| t.0), a.name_any());
    adapters
        .iter()
        .filter(|other| other.name_any() != adapter.name_any())
        .filter(|other| other.spec.deployment_ref.name == adapter.spec.deployment_ref.name)
        .filter(|other| other.metadata.deletion_timestamp.is_none())
        .filter(|other| other.served_name() == name)
        .find(|other| seniority(other) < seniority(adapter))
        .map(|other| format!("served name {name:?} is already served by LoraAdapter {:?}: give this one another spec.servedName", other.name_any()))
}

/// An adapter whose declared rank the deployment's agents are configured to refuse: said before
/// any agent is called, with the field to change.
pub fn rank_problem(adapter: &LoraAdapter, md: &ModelDeployment) -> Option<SpecError> {
    let (Some(rank), Some(max)) = (adapter.spec.rank, md.spec.engine.max_lora_rank) else {
        return None;
    };
    (rank > max).then(|| SpecError {
        reason: reasons::RANK_TOO_HIGH,
        message: format!("spec.rank {rank} is above engine.maxLoraRank {max} of ModelDeployment {:?}: raise maxLoraRank there or use an adapter of rank <= {max}", md.name_any()),
    })
}

/// A pod the adapter should be in: its agent container is ready (the model is loaded), so its
/// admin API answers. Pod readiness itself waits on the adapters-loaded gate, so it cannot be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetPod {
    pub name: String,
    pub base_url: String,
}

pub fn target_pods(pods: &[Pod], port: i32) -> Vec<TargetPod> {
    let mut out: Vec<TargetPod> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let status = p.status.as_ref()?;
            let containers_ready = status.conditions.iter().flatten().any(|c| c.type_ == "ContainersReady" && c.status == "True");
            let ip = status.pod_ip.as_ref().filter(|ip| !ip.is_empty())?;
            containers_ready.then(|| TargetPod {
                name: p.name_any(),
                base_url: if ip.contains(':') { format!("http://[{ip}]:{port}") } else { format!("http://{ip}:{port}") },
            })
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Phase and `Loaded` condition from the per-pod states.
pub fn summarize(pods: &[PodAdapterStatus]) -> (AdapterPhase, CondSpec) {
    let target = pods.len();
    let loaded = pods.iter().filter(|p| p.state == PodAdapterState::Loaded).count();
    let failed: Vec<&PodAdapterStatus> = pods.iter().filter(|p| p.state == PodAdapterState::Failed).collect();
    if target == 0 {
        return (AdapterPhase::Pending, CondSpec::new(CONDITION_LOADED, false, reasons::NO_READY_PODS, "the deployment has no ready agent pods yet"));
    }
    if loaded == target {
        return (AdapterPhase::Ready, CondSpec::new(CONDITION_LOADED, true, reasons::LOADED, format!("loaded in {loaded}/{target} pods")));
    }
    if failed.len() == target {
        let first = failed.first().map(|p| format!("{}: {}", p.name, p.message)).unwrap_or_default();
        return (
            AdapterPhase::Failed,
            CondSpec::new(CONDITION_LOADED, false, reasons::LOAD_FAILED, format!("loading failed in every pod ({target}); retrying with backoff. First error: {first}")),
        );
    }
    let mut message = format!("loaded in {loaded}/{target} pods");
    if let Some(f) = failed.first() {
        message.push_str(&format!("; {} failed, e.g. {}: {}", failed.len(), f.name, f.message));
    }
    (AdapterPhase::Loading, CondSpec::new(CONDITION_LOADED, false, reasons::PARTIALLY_LOADED, message))
}

/// Reconciles one LoraAdapter (through its finalizer), in one trace span named after the object.
#[instrument(name = "reconcile_lora_adapter", skip_all, fields(name = %adapter.name_any(), namespace = adapter.namespace().unwrap_or_default()))]
pub async fn reconcile(adapter: Arc<LoraAdapter>, ctx: Arc<Context>) -> Result<Action> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let ns = adapter.namespace().ok_or(Error::MissingField("metadata.namespace"))?;
    let api = Api::<LoraAdapter>::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, adapter, |event| async move {
        match event {
            FinalizerEvent::Apply(adapter) => apply(adapter, ctx, &ns).await,
            FinalizerEvent::Cleanup(adapter) => cleanup(adapter, ctx, &ns).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e) | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => Error::Finalizer(other.to_string()),
    })
}

async fn apply(adapter: Arc<LoraAdapter>, ctx: Arc<Context>, ns: &str) -> Result<Action> {
    let now = Time(jiff::Timestamp::now());
    let md_name = &adapter.spec.deployment_ref.name;
    let Some(md) = Api::<ModelDeployment>::namespaced(ctx.client.clone(), ns).get_opt(md_name).await? else {
        let cond = CondSpec::new(CONDITION_LOADED, false, reasons::DEPLOYMENT_NOT_FOUND, format!("ModelDeployment {md_name:?} not found in namespace {ns}"));
        write_status(&adapter, &ctx, ns, AdapterPhase::Pending, cond, None, Vec::new(), &now).await?;
        // The ModelDeployment watch brings us back when it appears.
        return Ok(Action::requeue(Duration::from_secs(300)));
    };
    let path = match adapter_path(&adapter, &md) {
        Ok(path) => path,
        Err(problem) => {
            let cond = CondSpec::new(CONDITION_LOADED, false, problem.reason, problem.message);
            write_status(&adapter, &ctx, ns, AdapterPhase::Failed, cond, None, Vec::new(), &now).await?;
            return Ok(Action::await_change());
        }
    };
    if let Some(problem) = rank_problem(&adapter, &md) {
        let cond = CondSpec::new(CONDITION_LOADED, false, problem.reason, problem.message);
        write_status(&adapter, &ctx, ns, AdapterPhase::Failed, cond, None, Vec::new(), &now).await?;
        return Ok(Action::await_change());
    }
    let adapters = Api::<LoraAdapter>::namespaced(ctx.client.clone(), ns).list(&ListParams::default()).await?;
    if let Some(conflict) = served_name_conflict(&adapter, &md, &adapters.items) {
        let cond = CondSpec::new(CONDITION_LOADED, false, reasons::SERVED_NAME_CONFLICT, "not loaded: its served name is taken");
        write_status(&adapter, &ctx, ns, AdapterPhase::Failed, cond, Some(conflict), Vec::new(), &now).await?;
        // Other adapters are not watched by this object: look again for the name to come free.
        return Ok(Action::requeue(Duration::from_secs(60)));
    }
    if let Some(secret) = &adapter.spec.source.secret_ref {
        if Api::<Secret>::namespaced(ctx.client.clone(), ns).get_opt(&secret.name).await?.is_none() {
            let cond = CondSpec::new(CONDITION_LOADED, false, reasons::SECRET_NOT_FOUND, format!("spec.source.secretRef: Secret {:?} not found in namespace {ns}", secret.name));
            write_status(&adapter, &ctx, ns, AdapterPhase::Failed, cond, None, Vec::new(), &now).await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
    }

    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns).list(&ListParams::default().labels(&selector_string(&md))).await?;
    let targets = target_pods(&pods.items, ctx.config.agent_port);
    let previous = adapter.status.as_ref().map(|s| s.pods.clone()).unwrap_or_default();
    let name = adapter.served_name();
    let mut states = Vec::with_capacity(targets.len());
    for pod in &targets {
        let before = previous.iter().find(|p| p.name == pod.name);
        states.push(sync_pod(&ctx, pod, before, &name, &path, &now).await);
    }

    let (phase, cond) = summarize(&states);
    let next_retry = states.iter().filter_map(|p| p.next_retry_at.as_ref()).min().cloned();
    write_status(&adapter, &ctx, ns, phase, cond, None, states, &now).await?;
    Ok(match (phase, next_retry) {
        (_, Some(at)) => Action::requeue(until(&at, &now).max(Duration::from_secs(1))),
        (AdapterPhase::Ready, None) => Action::requeue(Duration::from_secs(120)),
        _ => Action::requeue(Duration::from_secs(10)),
    })
}

/// Brings the adapter into one pod: already there from the same source with the content recorded
/// for the pod (agent restarts lose adapters, so ask), wait out a retry delay, or load it. A pod
/// that has the adapter from another source (`spec.source` was edited), or reports another content
/// digest than the one recorded (the files were replaced and re-read, or something else loaded the
/// name), gets it loaded again under the same name: the agent reads it and then swaps it in, so
/// requests never find the name missing. What the load reports is recorded as the pod's source and
/// digest.
async fn sync_pod(ctx: &Context, pod: &TargetPod, before: Option<&PodAdapterStatus>, name: &str, path: &str, now: &Time) -> PodAdapterStatus {
    let mut state = before.cloned().unwrap_or(PodAdapterStatus {
        name: pod.name.clone(),
        state: PodAdapterState::Pending,
        message: String::new(),
        source: None,
        digest: None,
        loaded_at: None,
        failures: 0,
        next_retry_at: None,
    });
    if state.state == PodAdapterState::Failed && state.next_retry_at.as_ref().is_some_and(|at| at > now) {
        return state;
    }
    let current = match ctx.agent.list_adapters(&pod.base_url).await {
        // Versions still finishing requests after a replace or unload are listed as `unloading`.
        Ok(adapters) => adapters.into_iter().find(|a| a.name == name && a.state != "unloading"),
        Err(e) => return failed(ctx, state, format!("listing adapters: {e}"), now),
    };
    let present = current.is_some();
    if let Some(current) = current {
        if pod_is_current(&state, path, current.digest.as_deref()) {
            if state.state != PodAdapterState::Loaded {
                state.loaded_at = Some(now.clone());
            }
            let digest = current.digest.or(state.digest.take());
            return PodAdapterStatus { state: PodAdapterState::Loaded, message: String::new(), digest, failures: 0, next_retry_at: None, ..state };
        }
        if state.source.as_deref() == Some(path) {
            warn!(pod = %pod.name, adapter = name, recorded = state.digest.as_deref().unwrap_or_default(), reported = current.digest.as_deref().unwrap_or_default(), "the pod reports other adapter content than recorded; loading it again");
        }
    }
    match ctx.agent.load_adapter(&pod.base_url, name, path).await {
        Ok(digest) => {
            ctx.metrics.adapter_call("load", true);
            info!(pod = %pod.name, adapter = name, source = path, digest = digest.as_deref().unwrap_or_default(), replaced = present, "adapter loaded");
            PodAdapterStatus {
                state: PodAdapterState::Loaded,
                message: String::new(),
                source: Some(path.to_string()),
                digest,
                loaded_at: Some(now.clone()),
                failures: 0,
                next_retry_at: None,
                ..state
            }
        }
        Err(e) => {
            ctx.metrics.adapter_call("load", false);
            failed(ctx, state, e.to_string(), now)
        }
    }
}

/// Whether the adapter a pod reports is the one recorded for it: same source, and the same digest
/// where both sides know one (a status written before digests were recorded, or an agent that
/// reports none, is taken as current and the reported digest recorded).
pub fn pod_is_current(recorded: &PodAdapterStatus, path: &str, reported_digest: Option<&str>) -> bool {
    recorded.source.as_deref() == Some(path)
        && match (recorded.digest.as_deref(), reported_digest) {
            (Some(recorded), Some(reported)) => recorded == reported,
            _ => true,
        }
}

fn failed(_ctx: &Context, state: PodAdapterStatus, message: String, now: &Time) -> PodAdapterStatus {
    let failures = state.failures.saturating_add(1);
    let delay = backoff_delay(u32::try_from(failures - 1).unwrap_or(0));
    let next = now.0.checked_add(jiff::SignedDuration::from_secs(delay.as_secs() as i64)).unwrap_or(now.0);
    PodAdapterStatus { state: PodAdapterState::Failed, message, loaded_at: None, failures, next_retry_at: Some(Time(next)), ..state }
}

fn until(at: &Time, now: &Time) -> Duration {
    let secs = at.0.as_second() - now.0.as_second();
    Duration::from_secs(secs.max(0) as u64)
}

// Every argument is a separate part of the status; a struct for one call site would only rename them.
#[allow(clippy::too_many_arguments)]
async fn write_status(
    adapter: &LoraAdapter,
    ctx: &Context,
    ns: &str,
    phase: AdapterPhase,
    cond: CondSpec,
    conflict: Option<String>,
    pods: Vec<PodAdapterStatus>,
    now: &Time,
) -> Result<()> {
    let previous = adapter.status.as_ref().map(|s| s.conditions.as_slice()).unwrap_or_default();
    let conditions = adapter_conditions(cond, conflict);
    let status = LoraAdapterStatus {
        phase: Some(phase),
        observed_generation: adapter.metadata.generation,
        conditions: build(&conditions, previous, adapter.metadata.generation, now),
        loaded_replicas: pods.iter().filter(|p| p.state == PodAdapterState::Loaded).count() as i32,
        target_replicas: pods.len() as i32,
        pods,
    };
    ctx.metrics.record_adapter(ns, &adapter.name_any(), status.loaded_replicas, status.target_replicas);
    let patch = json!({"apiVersion": "serving.peregrine.dev/v1alpha1", "kind": "LoraAdapter", "status": status});
    Api::<LoraAdapter>::namespaced(ctx.client.clone(), ns)
        .patch_status(&adapter.name_any(), &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&patch))
        .await?;
    Ok(())
}

/// `Loaded` as given, `Conflict`, and `Ready`: loaded with no conflict (the one condition
/// `kubectl wait` and Argo CD need).
pub fn adapter_conditions(loaded: CondSpec, conflict: Option<String>) -> [CondSpec; 3] {
    let ready = match &conflict {
        Some(message) => CondSpec::new(CONDITION_READY, false, reasons::SERVED_NAME_CONFLICT, message.clone()),
        None => CondSpec::new(CONDITION_READY, loaded.status, loaded.reason, loaded.message.clone()),
    };
    let conflict = match conflict {
        Some(message) => CondSpec::new(CONDITION_CONFLICT, true, reasons::SERVED_NAME_CONFLICT, message),
        None => CondSpec::new(CONDITION_CONFLICT, false, reasons::NO_CONFLICT, "no other adapter or base model serves this name"),
    };
    [loaded, conflict, ready]
}

/// Unloads the adapter from every pod that can still answer. Best effort: pods of a deleted
/// deployment are going away anyway, and a stuck finalizer would block namespace deletion.
async fn cleanup(adapter: Arc<LoraAdapter>, ctx: Arc<Context>, ns: &str) -> Result<Action> {
    let md_name = &adapter.spec.deployment_ref.name;
    let Some(md) = Api::<ModelDeployment>::namespaced(ctx.client.clone(), ns).get_opt(md_name).await? else {
        return Ok(Action::await_change());
    };
    // An adapter that lost its served name to another never loaded it: unloading the name would
    // take the other one away.
    let adapters = Api::<LoraAdapter>::namespaced(ctx.client.clone(), ns).list(&ListParams::default()).await?;
    if served_name_conflict(&adapter, &md, &adapters.items).is_some() {
        return Ok(Action::await_change());
    }
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), ns).list(&ListParams::default().labels(&selector_string(&md))).await?;
    let name = adapter.served_name();
    for pod in target_pods(&pods.items, ctx.config.agent_port) {
        match ctx.agent.unload_adapter(&pod.base_url, &name).await {
            Ok(()) => {
                ctx.metrics.adapter_call("unload", true);
                info!(pod = %pod.name, adapter = %name, "adapter unloaded");
            }
            Err(e) => {
                ctx.metrics.adapter_call("unload", false);
                warn!(pod = %pod.name, adapter = %name, error = %e, "unloading adapter failed");
            }
        }
    }
    Ok(Action::await_change())
}

pub fn error_policy(adapter: Arc<LoraAdapter>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(name = %adapter.name_any(), %error, "reconcile failed");
    ctx.metrics.reconcile_failed(CONTROLLER, error);
    Action::requeue(ctx.backoff.next(ObjectRef::from_obj(&*adapter).erase()))
}

async fn reconcile_with_backoff(adapter: Arc<LoraAdapter>, ctx: Arc<Context>) -> Result<Action> {
    let key = ObjectRef::from_obj(&*adapter).erase();
    let action = reconcile(adapter, ctx.clone()).await?;
    ctx.backoff.reset(&key);
    Ok(action)
}

/// Runs the controller until shutdown.
pub async fn run(ctx: Arc<Context>, namespace: Option<String>) {
    let client = ctx.client.clone();
    let (adapters, pods, mds) = match &namespace {
        Some(ns) => (
            Api::<LoraAdapter>::namespaced(client.clone(), ns),
            Api::<Pod>::namespaced(client.clone(), ns),
            Api::<ModelDeployment>::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone()), Api::all(client.clone())),
    };
    let controller = Controller::new(adapters, watcher::Config::default().any_semantic());
    let store = controller.store();
    let by_deployment = move |ns: Option<String>, md: String| {
        store
            .state()
            .into_iter()
            .filter(|a| a.namespace() == ns && a.spec.deployment_ref.name == md)
            .map(|a| ObjectRef::from_obj(&*a))
            .collect::<Vec<_>>()
    };
    let for_pod = by_deployment.clone();
    controller
        // A pod becoming ready (or restarting) needs every adapter of its deployment.
        .watches(pods, watcher::Config::default().labels(DEPLOYMENT_LABEL), move |pod: Pod| {
            let md = pod.labels().get(DEPLOYMENT_LABEL).cloned();
            md.map(|md| for_pod(pod.namespace(), md)).unwrap_or_default()
        })
        // A deployment appearing resolves DeploymentNotFound.
        .watches(mds, watcher::Config::default(), move |md: ModelDeployment| by_deployment(md.namespace(), md.name_any()))
        .shutdown_on_signal()
        .run(reconcile_with_backoff, error_policy, ctx)
        .for_each(|_| futures::future::ready(()))
        .await;
}

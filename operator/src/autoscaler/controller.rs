//! The autoscaler loop: every interval, for each `ModelDeployment` with `spec.autoscaling`, read its
//! pods, decide, write `spec.replicas` through the `scale` subresource and report in
//! `status.autoscaling`.
//!
//! The replica count goes through `/scale` with its own field manager (`peregrine-autoscaler`), the
//! same path `kubectl scale` and the HorizontalPodAutoscaler use, so a GitOps tool can be told to
//! ignore exactly that field (see `docs/autoscaling.md`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use peregrine_crds::{AutoscalingStatus, ModelDeployment, ScalingDecision, Throughput, DEPLOYMENT_LABEL};
use serde_json::json;

use super::capacity::CapacityEstimator;
use super::decision::{decide, Decision, DecisionInput, DecisionState};
use super::metrics::{AutoscalerMetrics, DeploymentLabels};
use super::scraper::Scraper;
use super::window::{PodObservation, PodState, ScrapeWindow};
use crate::config::WatchScope;

/// Field manager of the autoscaler's writes (spec.replicas through /scale, status.autoscaling).
pub const FIELD_MANAGER: &str = "peregrine-autoscaler";
/// Annotation a request router (or a person) sets to an RFC 3339 time to wake a deployment that was
/// scaled to zero; a value older than [`WAKE_ANNOTATION_TTL`] is ignored.
pub const WAKE_ANNOTATION: &str = "serving.peregrine.dev/wake-requested";
pub const WAKE_ANNOTATION_TTL: Duration = Duration::from_secs(300);
/// Agent port used when a pod names no `http` container port.
pub const DEFAULT_AGENT_PORT: i32 = 8000;
/// Decisions kept in `status.autoscaling.history`.
pub const HISTORY_LEN: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum AutoscalerError {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("object has no {0}")]
    MissingField(&'static str),
}

#[derive(Clone, Debug)]
pub struct AutoscalerConfig {
    /// How often every deployment is scraped and decided.
    pub interval: Duration,
    /// Per-pod `/metrics` timeout.
    pub scrape_timeout: Duration,
    /// Only these namespaces (`--watch-namespace`; a namespaced install has no right to list others).
    pub scope: WatchScope,
}

impl Default for AutoscalerConfig {
    fn default() -> Self {
        AutoscalerConfig { interval: Duration::from_secs(15), scrape_timeout: Duration::from_secs(3), scope: WatchScope::All }
    }
}

/// What the autoscaler remembers of one deployment between rounds.
struct DeploymentState {
    window: ScrapeWindow,
    decisions: DecisionState,
    capacity: CapacityEstimator,
    seed: Option<Throughput>,
    history: Vec<ScalingDecision>,
}

pub struct Autoscaler {
    client: Client,
    scraper: Scraper,
    metrics: AutoscalerMetrics,
    config: AutoscalerConfig,
    started: Instant,
    states: HashMap<(String, String), DeploymentState>,
}

impl Autoscaler {
    pub fn new(client: Client, config: AutoscalerConfig, metrics: AutoscalerMetrics) -> Result<Self, AutoscalerError> {
        let scraper = Scraper::new(config.scrape_timeout)?;
        Ok(Autoscaler { client, scraper, metrics, config, started: Instant::now(), states: HashMap::new() })
    }

    /// Runs rounds forever; a failed round is logged and the next one runs on time.
    pub async fn run(mut self) {
        let mut ticker = tokio::time::interval(self.config.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            if let Err(err) = self.round().await {
                tracing::warn!(error = %err, "autoscaler round failed");
            }
        }
    }

    /// One round over every autoscaled deployment.
    pub async fn round(&mut self) -> Result<(), AutoscalerError> {
        let mut deployments = Vec::new();
        for namespace in self.config.scope.watches() {
            let api: Api<ModelDeployment> = match &namespace {
                Some(ns) => Api::namespaced(self.client.clone(), ns),
                None => Api::all(self.client.clone()),
            };
            deployments.extend(api.list(&ListParams::default()).await?.items);
        }
        let mut seen = Vec::new();
        for md in deployments.iter().filter(|md| md.spec.autoscaling.is_some()) {
            let key = (md.namespace().unwrap_or_default(), md.name_any());
            seen.push(key.clone());
            if let Err(err) = self.reconcile(md).await {
                tracing::warn!(namespace = %key.0, name = %key.1, error = %err, "autoscaling failed");
            }
        }
        self.states.retain(|key, _| seen.contains(key));
        Ok(())
    }

    #[tracing::instrument(name = "autoscale_model_deployment", skip_all, fields(name = %md.name_any(), namespace = md.namespace().unwrap_or_default()))]
    async fn reconcile(&mut self, md: &ModelDeployment) -> Result<(), AutoscalerError> {
        let spec = md.spec.autoscaling.as_ref().ok_or(AutoscalerError::MissingField("spec.autoscaling"))?;
        let namespace = md.namespace().ok_or(AutoscalerError::MissingField("metadata.namespace"))?;
        let name = md.name_any();
        let pods_api: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        let pods = pods_api.list(&ListParams::default().labels(&format!("{DEPLOYMENT_LABEL}={name}"))).await?;
        let observations = observe_pods(&self.scraper, &pods.items).await;
        let now = self.started.elapsed().as_secs_f64();

        let state = self.states.entry((namespace.clone(), name.clone())).or_insert_with(|| DeploymentState {
            window: ScrapeWindow::new(f64::from(spec.evaluation_window_seconds)),
            decisions: DecisionState::default(),
            capacity: CapacityEstimator::new(spec.capacity_per_replica.as_ref()),
            seed: spec.capacity_per_replica.clone(),
            history: md.status.as_ref().and_then(|s| s.autoscaling.as_ref()).map(|a| a.history.clone()).unwrap_or_default(),
        });
        state.window.set_one_step(md.spec.model.task.is_encoder());
        if state.seed != spec.capacity_per_replica {
            // A new seed is new information from a person: start from it again.
            state.capacity = CapacityEstimator::new(spec.capacity_per_replica.as_ref());
            state.seed = spec.capacity_per_replica.clone();
        }
        state.window.set_window(f64::from(spec.evaluation_window_seconds));
        let snapshot = state.window.observe(now, &observations);
        let labels = DeploymentLabels { namespace: namespace.clone(), name: name.clone() };
        for (pod, err) in &snapshot.unreachable {
            tracing::warn!(%namespace, deployment = %name, %pod, error = %err, "agent metrics unreadable; not counted");
            self.metrics.scrape_failures.get_or_create(&labels).inc();
        }
        state.capacity.learn(&spec.slo, &snapshot);
        let input = DecisionInput {
            now,
            current_replicas: md.spec.replicas,
            snapshot: &snapshot,
            capacity: state.capacity.per_replica(),
            wake_requested: wake_requested(md),
            gpus_per_replica: md.spec.resources.gpus,
        };
        let decision = decide(spec, &mut state.decisions, &input);
        if let Some(cap) = state.capacity.per_replica() {
            self.metrics.capacity_output_tokens.get_or_create(&labels).set(cap.output_tokens_per_second);
        }
        self.metrics.record_decision(&namespace, &name, decision.to_replicas, decision.reason);

        let api: Api<ModelDeployment> = Api::namespaced(self.client.clone(), &namespace);
        if decision.to_replicas != md.spec.replicas {
            tracing::info!(%namespace, deployment = %name, from = decision.from_replicas, to = decision.to_replicas,
                reason = %decision.reason, message = %decision.message, "scaling");
            api.patch_scale(&name, &PatchParams::apply(FIELD_MANAGER), &Patch::Merge(scale_patch(decision.to_replicas)))
                .await?;
        }
        let record = scaling_decision(&decision);
        // History holds changes only; holds would push every change out within a minute.
        if decision.to_replicas != decision.from_replicas {
            state.history.insert(0, record.clone());
            state.history.truncate(HISTORY_LEN);
        }
        let status = AutoscalingStatus {
            desired_replicas: Some(decision.to_replicas),
            desired_gpus: Some(decision.to_replicas.saturating_mul(md.spec.resources.gpus)),
            measured_capacity_per_replica: state.capacity.per_replica(),
            last_decision: Some(record),
            history: state.history.clone(),
        };
        api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER), &Patch::Merge(json!({ "status": { "autoscaling": status } })))
            .await?;
        Ok(())
    }
}

/// The body of a merge patch to `/scale`.
pub fn scale_patch(replicas: i32) -> serde_json::Value {
    json!({ "spec": { "replicas": replicas } })
}

fn scaling_decision(d: &Decision) -> ScalingDecision {
    ScalingDecision {
        time: Time(jiff::Timestamp::now()),
        from_replicas: d.from_replicas,
        to_replicas: d.to_replicas,
        reason: d.reason.as_str().to_string(),
        message: d.message.clone(),
        inputs: d.inputs.clone(),
    }
}

fn wake_requested(md: &ModelDeployment) -> bool {
    let Some(value) = md.annotations().get(WAKE_ANNOTATION) else { return false };
    let Ok(at) = value.parse::<jiff::Timestamp>() else { return false };
    let age = jiff::Timestamp::now().duration_since(at);
    age.as_secs() >= -60 && age.as_secs() <= WAKE_ANNOTATION_TTL.as_secs() as i64
}

/// Classifies every pod and scrapes the ready ones concurrently.
pub async fn observe_pods(scraper: &Scraper, pods: &[Pod]) -> Vec<PodObservation> {
    let scraper = Arc::new(scraper.clone());
    let futures = pods.iter().filter(|p| p.metadata.deletion_timestamp.is_none()).map(|pod| {
        let scraper = scraper.clone();
        let name = pod.name_any();
        let target = scrape_target(pod);
        async move {
            let state = match target {
                None => PodState::Loading,
                Some(url) => match scraper.scrape(&url).await {
                    Ok(m) => PodState::Scraped(m),
                    Err(err) => PodState::Unreachable(err.to_string()),
                },
            };
            PodObservation { pod: name, state }
        }
    });
    join_all(futures).await
}

/// `http://<pod IP>:<http port>` of a ready pod; `None` for a pod that is not ready (still loading).
pub fn scrape_target(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref()?;
    let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
    let ip = status.pod_ip.as_ref().filter(|ip| !ip.is_empty())?;
    if !ready {
        return None;
    }
    let port = pod
        .spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("http"))
        .map_or(DEFAULT_AGENT_PORT, |p| p.container_port);
    let host = if ip.contains(':') { format!("[{ip}]") } else { ip.clone() };
    Some(format!("http://{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ready: bool, ip: Option<&str>, port: Option<i32>) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": "p" },
            "spec": { "containers": [{ "name": "agent", "ports": port.map(|p| vec![json!({"name": "http", "containerPort": p})]).unwrap_or_default() }] },
            "status": {
                "podIP": ip,
                "conditions": [{ "type": "Ready", "status": if ready { "True" } else { "False" } }]
            }
        }))
        .unwrap()
    }

    #[test]
    fn only_ready_pods_with_an_ip_are_scraped() {
        assert_eq!(scrape_target(&pod(true, Some("10.0.0.7"), Some(8080))).as_deref(), Some("http://10.0.0.7:8080"));
        assert_eq!(scrape_target(&pod(true, Some("fd00::7"), None)).as_deref(), Some("http://[fd00::7]:8000"));
        assert_eq!(scrape_target(&pod(false, Some("10.0.0.7"), Some(8080))), None);
        assert_eq!(scrape_target(&pod(true, None, Some(8080))), None);
    }

    #[test]
    fn scale_patch_sets_spec_replicas_only() {
        assert_eq!(scale_patch(3), json!({ "spec": { "replicas": 3 } }));
    }
}

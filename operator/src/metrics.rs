//! Prometheus metrics of the controllers (`/metrics`), named `peregrine_operator_*`.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use prometheus_client::metrics::gauge::Gauge;

use crate::autoscaler::metrics::{AutoscalerMetrics, DeploymentLabels};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabels {
    pub controller: &'static str,
    pub error: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdapterCallLabels {
    pub op: &'static str,
    pub result: &'static str,
}

/// Every metric the operator exports, registered in one registry.
#[derive(Clone)]
pub struct Metrics {
    pub registry: Arc<Registry>,
    pub reconciliations: Family<ControllerLabels, Counter>,
    pub failures: Family<FailureLabels, Counter>,
    pub duration: Family<ControllerLabels, Histogram>,
    pub adapter_calls: Family<AdapterCallLabels, Counter>,
    /// Per ModelDeployment: pods, ready pods (what `status` says), and the canary step under way
    /// (-1: none), for dashboards beside `peregrine_autoscaler_desired_replicas`.
    pub replicas: Family<DeploymentLabels, Gauge>,
    pub ready_replicas: Family<DeploymentLabels, Gauge>,
    pub rollout_step: Family<DeploymentLabels, Gauge>,
    /// Per LoraAdapter (`name` is the adapter's): pods it is loaded in, and ready pods it should be in.
    pub adapter_loaded_replicas: Family<DeploymentLabels, Gauge>,
    pub adapter_target_replicas: Family<DeploymentLabels, Gauge>,
    /// The autoscaler's `peregrine_autoscaler_*` series, served from the same `/metrics`.
    pub autoscaler: AutoscalerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        // The root has no prefix so the autoscaler keeps its own `peregrine_autoscaler_*` names;
        // the controllers' series live under `peregrine_operator_*`.
        let mut root = Registry::default();
        let autoscaler = AutoscalerMetrics::register(&mut root);
        let registry = root.sub_registry_with_prefix("peregrine_operator");
        let reconciliations = Family::<ControllerLabels, Counter>::default();
        let failures = Family::<FailureLabels, Counter>::default();
        // 5 ms to ~10 s: reconciliations are API round trips, adapter loads take seconds.
        let duration: Family<ControllerLabels, Histogram> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.005, 2.0, 12)));
        let adapter_calls = Family::<AdapterCallLabels, Counter>::default();
        registry.register("reconciliations", "Reconciliations started", reconciliations.clone());
        registry.register("reconcile_failures", "Reconciliations that failed, by error kind", failures.clone());
        registry.register_with_unit(
            "reconcile_duration",
            "Time one reconciliation took",
            prometheus_client::registry::Unit::Seconds,
            duration.clone(),
        );
        registry.register("adapter_calls", "Calls to agents' adapter API, by operation and result", adapter_calls.clone());
        let replicas = Family::<DeploymentLabels, Gauge>::default();
        let ready_replicas = Family::<DeploymentLabels, Gauge>::default();
        let rollout_step = Family::<DeploymentLabels, Gauge>::default();
        registry.register("model_deployment_replicas", "Agent pods of a ModelDeployment (status.replicas)", replicas.clone());
        registry.register("model_deployment_ready_replicas", "Ready agent pods of a ModelDeployment (status.readyReplicas)", ready_replicas.clone());
        registry.register("rollout_step", "Index of the canary step under way (spec.rollout.steps); -1 when no rollout is", rollout_step.clone());
        let adapter_loaded_replicas = Family::<DeploymentLabels, Gauge>::default();
        let adapter_target_replicas = Family::<DeploymentLabels, Gauge>::default();
        registry.register("adapter_loaded_replicas", "Pods a LoraAdapter is loaded in (status.loadedReplicas)", adapter_loaded_replicas.clone());
        registry.register("adapter_target_replicas", "Ready pods a LoraAdapter should be loaded in (status.targetReplicas)", adapter_target_replicas.clone());
        Metrics {
            registry: Arc::new(root),
            reconciliations,
            failures,
            duration,
            adapter_calls,
            replicas,
            ready_replicas,
            rollout_step,
            adapter_loaded_replicas,
            adapter_target_replicas,
            autoscaler,
        }
    }
}

impl Metrics {
    /// Counts a reconciliation and returns a guard that records its duration when dropped.
    pub fn reconcile_started(&self, controller: &'static str) -> DurationGuard {
        self.reconciliations.get_or_create(&ControllerLabels { controller }).inc();
        DurationGuard { histogram: self.duration.get_or_create(&ControllerLabels { controller }).clone(), start: Instant::now() }
    }

    pub fn reconcile_failed(&self, controller: &'static str, error: &crate::Error) {
        self.failures.get_or_create(&FailureLabels { controller, error: error.metric_label() }).inc();
    }

    /// Records what a ModelDeployment's status says about its pods.
    pub fn record_replicas(&self, namespace: &str, name: &str, replicas: i32, ready: i32) {
        let labels = DeploymentLabels { namespace: namespace.into(), name: name.into() };
        self.replicas.get_or_create(&labels).set(i64::from(replicas));
        self.ready_replicas.get_or_create(&labels).set(i64::from(ready));
    }

    /// Records the rollout step under way (`None`: no rollout).
    pub fn record_rollout_step(&self, namespace: &str, name: &str, step: Option<i32>) {
        let labels = DeploymentLabels { namespace: namespace.into(), name: name.into() };
        self.rollout_step.get_or_create(&labels).set(step.map_or(-1, i64::from));
    }

    /// Records a LoraAdapter's loaded and target pod counts.
    pub fn record_adapter(&self, namespace: &str, name: &str, loaded: i32, target: i32) {
        let labels = DeploymentLabels { namespace: namespace.into(), name: name.into() };
        self.adapter_loaded_replicas.get_or_create(&labels).set(i64::from(loaded));
        self.adapter_target_replicas.get_or_create(&labels).set(i64::from(target));
    }

    pub fn adapter_call(&self, op: &'static str, ok: bool) {
        self.adapter_calls.get_or_create(&AdapterCallLabels { op, result: if ok { "ok" } else { "error" } }).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Records the elapsed time into the duration histogram on drop.
pub struct DurationGuard {
    histogram: Histogram,
    start: Instant,
}

impl Drop for DurationGuard {
    fn drop(&mut self) {
        self.histogram.observe(self.start.elapsed().as_secs_f64());
    }
}

//! Prometheus metrics of the controllers (`/metrics`), named `peregrine_operator_*`.

use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::autoscaler::metrics::AutoscalerMetrics;

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
        Metrics { registry: Arc::new(root), reconciliations, failures, duration, adapter_calls, autoscaler }
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

//! The autoscaler's own Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::decision::Reason;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeploymentLabels {
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

#[derive(Clone, Debug, Default)]
pub struct AutoscalerMetrics {
    pub desired_replicas: Family<DeploymentLabels, Gauge>,
    pub decisions: Family<ReasonLabels, Counter>,
    pub scrape_failures: Family<DeploymentLabels, Counter>,
    pub capacity_output_tokens: Family<DeploymentLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

impl AutoscalerMetrics {
    /// Registers every metric under its `peregrine_autoscaler_*` name.
    pub fn register(registry: &mut Registry) -> Self {
        let m = AutoscalerMetrics::default();
        registry.register(
            "peregrine_autoscaler_desired_replicas",
            "Replica count the autoscaler last decided",
            m.desired_replicas.clone(),
        );
        registry.register(
            "peregrine_autoscaler_decisions",
            "Autoscaler decisions, by the reason they were made for",
            m.decisions.clone(),
        );
        registry.register(
            "peregrine_autoscaler_scrape_failures",
            "Ready agent pods whose /metrics could not be read",
            m.scrape_failures.clone(),
        );
        registry.register(
            "peregrine_autoscaler_capacity_output_tokens_per_second",
            "Learned output tokens/s one replica sustains within the SLO",
            m.capacity_output_tokens.clone(),
        );
        m
    }

    pub fn record_decision(&self, namespace: &str, name: &str, desired: i32, reason: Reason) {
        let labels = DeploymentLabels { namespace: namespace.into(), name: name.into() };
        self.desired_replicas.get_or_create(&labels).set(i64::from(desired));
        self.decisions
            .get_or_create(&ReasonLabels { namespace: namespace.into(), name: name.into(), reason: reason.as_str().into() })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_desired_replicas_and_decisions_by_reason() {
        let mut registry = Registry::default();
        let m = AutoscalerMetrics::register(&mut registry);
        m.record_decision("ml", "smol", 3, Reason::TtftAboveSlo);
        m.record_decision("ml", "smol", 3, Reason::Stabilizing);
        m.record_decision("ml", "smol", 4, Reason::TtftAboveSlo);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let parsed = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
        let value = |metric: &str, reason: Option<&str>| {
            parsed
                .samples
                .iter()
                .find(|s| s.metric == metric && s.labels.get("reason") == reason)
                .map(|s| match s.value {
                    prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Untyped(v) => v,
                    _ => f64::NAN,
                })
        };
        assert_eq!(value("peregrine_autoscaler_desired_replicas", None), Some(4.0));
        assert_eq!(value("peregrine_autoscaler_decisions_total", Some("TtftAboveSlo")), Some(2.0));
        assert_eq!(value("peregrine_autoscaler_decisions_total", Some("Stabilizing")), Some(1.0));
    }
}

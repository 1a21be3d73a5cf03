//! `spec.autoscaling` / `status.autoscaling` of a ModelDeployment.
//!
//! Acted on by the operator's autoscaler (`operator/src/autoscaler/`): every interval it scrapes the
//! ready agent pods' `/metrics`, decides the replica count that holds the SLO, writes it through the
//! `scale` subresource (`spec.replicas`) and reports the decision in `status.autoscaling`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// Size the replica count to hold latency SLOs, read from the agents' own metrics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.maxReplicas >= self.minReplicas").message("autoscaling.maxReplicas must be >= minReplicas"))]
#[x_kube(validation = kube::core::Rule::new("self.minReplicas > 0 || (has(self.scaleToZero) && self.scaleToZero.enabled)").message("autoscaling.minReplicas may be 0 only with scaleToZero.enabled"))]
pub struct AutoscalingSpec {
    /// Fewest replicas (0 only with `scaleToZero.enabled`).
    #[serde(default = "default_min_replicas")]
    #[schemars(range(min = 0))]
    pub min_replicas: i32,
    /// Most replicas.
    #[schemars(range(min = 1, max = 1000))]
    pub max_replicas: i32,
    /// Most GPUs the deployment may hold at once: each replica counts as `resources.gpus` GPUs
    /// (its tensor-parallel ranks), so the autoscaler stays at or below `maxGpus / gpus` replicas
    /// (and `maxReplicas`). No effect on a CPU deployment (0 GPUs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8000))]
    pub max_gpus: Option<i32>,
    /// Latency objectives, as 95th percentiles over `evaluationWindowSeconds`.
    pub slo: LatencySlo,
    /// Scale up when the mean waiting requests per replica exceeds this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_queue_depth_per_replica: Option<i32>,
    /// Scale up when the mean KV-cache usage (0..1) exceeds this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self > 0.0 && self <= 1.0").message("maxKvCacheUsage must be in (0, 1]"))]
    pub max_kv_cache_usage: Option<f64>,
    /// A scale-up must be recommended this long before it happens (default 30).
    #[serde(default = "default_scale_up_stabilization")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_up_stabilization_seconds: i32,
    /// A scale-down must be recommended this long before it happens (default 300).
    #[serde(default = "default_scale_down_stabilization")]
    #[schemars(range(min = 0, max = 3600))]
    pub scale_down_stabilization_seconds: i32,
    /// Window the percentiles and rates are computed over (default 60).
    #[serde(default = "default_evaluation_window")]
    #[schemars(range(min = 10, max = 3600))]
    pub evaluation_window_seconds: i32,
    /// Scale to zero replicas when idle (off by default).
    #[serde(default)]
    pub scale_to_zero: ScaleToZero,
    /// Throughput the platform promises for this endpoint; the autoscaler keeps enough replicas for it
    /// even when current traffic is lower.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned_throughput: Option<Throughput>,
    /// Seed for what one replica sustains at the SLO, used until the autoscaler has measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_per_replica: Option<Throughput>,
}

impl AutoscalingSpec {
    /// `minReplicas..=maxReplicas` held to `slo`, every optional field unset and every other at
    /// its documented default (what a spec naming only these fields deserializes to).
    pub fn new(min_replicas: i32, max_replicas: i32, slo: LatencySlo) -> AutoscalingSpec {
        AutoscalingSpec {
            min_replicas,
            max_replicas,
            max_gpus: None,
            slo,
            max_queue_depth_per_replica: None,
            max_kv_cache_usage: None,
            scale_up_stabilization_seconds: default_scale_up_stabilization(),
            scale_down_stabilization_seconds: default_scale_down_stabilization(),
            evaluation_window_seconds: default_evaluation_window(),
            scale_to_zero: ScaleToZero::default(),
            provisioned_throughput: None,
            capacity_per_replica: None,
        }
    }
}

fn default_min_replicas() -> i32 {
    1
}
fn default_scale_up_stabilization() -> i32 {
    30
}
fn default_scale_down_stabilization() -> i32 {
    300
}
fn default_evaluation_window() -> i32 {
    60
}

/// p95 latency objectives in seconds. A `generate` model needs `ttftP95Seconds` and
/// `tpotP95Seconds`; an encoder (`spec.model.task` embed, rerank or classify) answers in one step and
/// takes `e2eP95Seconds` only (the ModelDeployment's rules check which).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LatencySlo {
    /// Time to first token, p95 (`generate` only, required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self > 0.0").message("ttftP95Seconds must be > 0"))]
    pub ttft_p95_seconds: Option<f64>,
    /// Time per output token after the first, p95 (`generate` only, required there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self > 0.0").message("tpotP95Seconds must be > 0"))]
    pub tpot_p95_seconds: Option<f64>,
    /// End-to-end request latency, p95 (optional for `generate`, required for encoders).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self > 0.0").message("e2eP95Seconds must be > 0"))]
    pub e2e_p95_seconds: Option<f64>,
}

/// Scale to zero when no request arrived for `idleTimeoutSeconds`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScaleToZero {
    #[serde(default)]
    pub enabled: bool,
    /// Idle time before scaling to zero (default 900).
    #[serde(default = "default_idle_timeout")]
    #[schemars(range(min = 60))]
    pub idle_timeout_seconds: i32,
}

impl Default for ScaleToZero {
    fn default() -> Self {
        ScaleToZero { enabled: false, idle_timeout_seconds: default_idle_timeout() }
    }
}

fn default_idle_timeout() -> i32 {
    900
}

/// A throughput: output tokens per second, and optionally requests per second. For an encoder
/// (no output tokens), the tokens are the input tokens it encodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Throughput {
    #[x_kube(validation = kube::core::Rule::new("self > 0.0").message("outputTokensPerSecond must be > 0"))]
    pub output_tokens_per_second: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self > 0.0").message("requestsPerSecond must be > 0"))]
    pub requests_per_second: Option<f64>,
}

/// What the autoscaler decided and why (written by the autoscaler).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AutoscalingStatus {
    /// Replica count the autoscaler wants now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_replicas: Option<i32>,
    /// GPUs those replicas hold (`desiredReplicas × resources.gpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_gpus: Option<i32>,
    /// What one replica was measured to sustain while meeting the SLO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_capacity_per_replica: Option<Throughput>,
    /// The latest decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_decision: Option<ScalingDecision>,
    /// The last 5 decisions, newest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    pub history: Vec<ScalingDecision>,
}

/// One autoscaler decision with the inputs it was made from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingDecision {
    pub time: Time,
    pub from_replicas: i32,
    pub to_replicas: i32,
    /// CamelCase reason, e.g. `TtftAboveSlo`, `ProvisionedThroughput`, `Idle`, `WithinSlo`.
    pub reason: String,
    /// Human-readable explanation.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    pub inputs: ScalingInputs,
}

/// Measurements a decision was made from; absent ones were not available.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScalingInputs {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_replicas: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_p95_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpot_p95_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e2e_p95_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth_per_replica: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_usage: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens_per_second: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_second: Option<f64>,
}

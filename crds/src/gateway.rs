//! Routing through the Gateway API Inference Extension (docs/gateways.md): the operator creates an
//! `InferencePool` for a ModelDeployment that asks for one, and an `InferenceObjective` for each of
//! its LoraAdapters that sets a priority, where those CRDs are installed.

use kube::KubeSchema;
use serde::{Deserialize, Serialize};

/// `ModelDeployment.spec.gateway`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    /// An `InferencePool` (`inference.networking.k8s.io/v1`) named after the ModelDeployment,
    /// selecting its pods on the agent port, for an endpoint picker and a Gateway to route by queue,
    /// KV-cache use and loaded adapters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inference_pool: Option<InferencePoolSettings>,
}

/// What the operator writes into the `InferencePool`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSettings {
    /// Create the pool (and the adapters' objectives); false deletes what was created.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// Service of the endpoint picker (EPP) in the same namespace; default `<name>-epp`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub endpoint_picker_service: Option<String>,
    /// Port of that Service (the EPP's ext-proc gRPC port).
    #[serde(default = "default_epp_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub endpoint_picker_port: i32,
    /// What the Gateway does when the endpoint picker does not answer: `FailClose` (refuse the
    /// request, the API's default) or `FailOpen` (route it to a pod of its own choosing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<EndpointPickerFailureMode>,
}

impl Default for InferencePoolSettings {
    fn default() -> Self {
        InferencePoolSettings { enabled: true, endpoint_picker_service: None, endpoint_picker_port: default_epp_port(), failure_mode: None }
    }
}

/// `InferencePool.spec.endpointPickerRef.failureMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum EndpointPickerFailureMode {
    FailOpen,
    FailClose,
}

impl EndpointPickerFailureMode {
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointPickerFailureMode::FailOpen => "FailOpen",
            EndpointPickerFailureMode::FailClose => "FailClose",
        }
    }
}

/// `LoraAdapter.spec.gateway`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdapterGatewaySpec {
    /// Priority of this adapter's requests in the deployment's InferencePool: the operator creates an
    /// `InferenceObjective` (`inference.networking.x-k8s.io/v1alpha2`) named after the LoraAdapter
    /// with this priority. Higher is served first when the pool is saturated; negative values are
    /// allowed; requests without an objective count as 0. Requests name the objective in the
    /// `x-gateway-inference-objective` header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = -1000000, max = 1000000))]
    pub priority: Option<i32>,
}

fn default_true() -> bool {
    true
}

/// The endpoint picker's ext-proc port in the Gateway API Inference Extension's manifests and chart.
fn default_epp_port() -> i32 {
    9002
}

//! `LoraAdapter`: a PEFT LoRA adapter hot-loaded into every ready pod of one ModelDeployment.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::gateway::AdapterGatewaySpec;
use crate::source::AdapterSource;

/// Desired state of an adapter.
// kube's `printcolumn(...)` lists repeat the same keys by design.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "serving.peregrine.dev",
    version = "v1alpha1",
    kind = "LoraAdapter",
    namespaced,
    status = "LoraAdapterStatus",
    shortname = "lora",
    category = "peregrine",
    doc = "A LoRA adapter (PEFT format) hot-loaded into every ready pod of a ModelDeployment.",
    printcolumn(name = "Deployment", type_ = "string", json_path = ".spec.deploymentRef.name"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Loaded", type_ = "integer", json_path = ".status.loadedReplicas"),
    printcolumn(name = "Target", type_ = "integer", json_path = ".status.targetReplicas"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
)]
#[serde(rename_all = "camelCase")]
pub struct LoraAdapterSpec {
    /// The ModelDeployment (same namespace) whose pods load this adapter. Immutable: to move an adapter,
    /// create a new one.
    #[x_kube(validation = kube::core::Rule::new("self == oldSelf").message("deploymentRef is immutable"))]
    pub deployment_ref: DeploymentRef,
    /// Where the PEFT folder is.
    pub source: AdapterSource,
    /// Name clients send as `model`; defaults to the LoraAdapter's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 128))]
    pub served_name: Option<String>,
    /// Expected LoRA rank `r`; when set, the agent refuses an adapter of another rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 512))]
    pub rank: Option<i32>,
    /// Gateway routing: a priority here gives the adapter an `InferenceObjective` in its
    /// deployment's InferencePool (see docs/gateways.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<AdapterGatewaySpec>,
}

/// Reference to a ModelDeployment in the same namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeploymentRef {
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Overall state of an adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum AdapterPhase {
    /// Waiting: no ready pods yet, or the deployment does not exist.
    Pending,
    /// Loaded in some ready pods, being loaded in others.
    Loading,
    /// Loaded in every ready pod.
    Ready,
    /// Loading failed in every ready pod (or the spec cannot be acted on); retried with backoff.
    Failed,
    /// Being unloaded after deletion.
    Unloading,
}

/// Observed state of an adapter, written by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct LoraAdapterStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<AdapterPhase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Loaded` (True when every ready pod has the adapter), `Conflict` (its served name is taken)
    /// and `Ready` (loaded and no conflict), with the reason otherwise.
    ///
    /// A list-map keyed by `type`, so that each controller (field manager) owns its own conditions
    /// under server-side apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = kube::core::ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// Ready pods the adapter is loaded in.
    #[serde(default)]
    pub loaded_replicas: i32,
    /// Ready pods of the deployment (where it should be loaded).
    #[serde(default)]
    pub target_replicas: i32,
    /// Per-pod state.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = kube::core::ListMerge::Map(vec!["name".into()]))]
    pub pods: Vec<PodAdapterStatus>,
}

/// State of the adapter in one pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum PodAdapterState {
    Pending,
    Loaded,
    Failed,
}

/// The adapter in one pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodAdapterStatus {
    /// Pod name.
    pub name: String,
    pub state: PodAdapterState,
    /// Error of the last failed attempt.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// What the pod has loaded: the path or URI the agent read the adapter from. When
    /// `spec.source` changes, the pods whose `source` differs are reloaded (the agent loads the new
    /// version, then swaps it in; running requests finish on the old one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// What the pod has loaded, by content: the agent's `sha256:` digest of the adapter's files
    /// (`adapter_config.json` then `adapter_model.safetensors`) as read at load. When the pod later
    /// reports another digest for the name (its files were re-read after a change, or something
    /// else loaded it), the operator loads it again and records the new digest; pods whose
    /// digests differ hold different weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded_at: Option<Time>,
    /// Failed attempts in a row (drives the retry backoff).
    #[serde(default)]
    pub failures: i32,
    /// Earliest time of the next attempt after a failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_retry_at: Option<Time>,
}

impl LoraAdapter {
    /// The name clients send as `model` and the agent registers the adapter under.
    pub fn served_name(&self) -> String {
        match &self.spec.served_name {
            Some(name) if !name.is_empty() => name.clone(),
            _ => self.metadata.name.clone().unwrap_or_default(),
        }
    }
}

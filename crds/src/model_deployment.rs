//! `ModelDeployment`: a base model served by a set of `peregrine-agent` pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Affinity, LocalObjectReference, ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::autoscaling::{AutoscalingSpec, AutoscalingStatus};
use crate::gateway::GatewaySpec;
use crate::rollout::{RolloutSpec, RolloutStatus};
use crate::source::ModelSource;

/// Desired state of a served base model.
///
/// The operator turns it into a Deployment of agent pods and a Service; the agent gets the engine
/// settings as command-line flags.
#[derive(CustomResource, KubeSchema, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "serving.peregrine.dev",
    version = "v1alpha1",
    kind = "ModelDeployment",
    namespaced,
    status = "ModelDeploymentStatus",
    shortname = "md",
    shortname = "mdep",
    category = "peregrine",
    doc = "A base model served by a set of peregrine-agent pods, with its LoRA adapters hot-loaded.",
    scale(
        spec_replicas_path = ".spec.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model.uri", priority = 1),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".spec.replicas"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyReplicas"),
    printcolumn(name = "Endpoint", type_ = "string", json_path = ".status.endpoint"),
    printcolumn(name = "Status", type_ = "string", json_path = ".status.conditions[?(@.type==\"Ready\")].reason"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(name = "Progress", type_ = "string", json_path = ".status.conditions[?(@.type==\"Progressing\")].message", priority = 1),
    validation = kube::core::Rule::new("self.metadata.name.size() <= 52").message("metadata.name must be at most 52 characters (pod names are derived from it)"),
    validation = kube::core::Rule::new(DNS1035_NAME_RULE).message(DNS1035_NAME_MESSAGE),
)]
#[x_kube(validation = kube::core::Rule::new(GPU_DTYPE_RULE).message(GPU_DTYPE_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new(SLO_TASK_RULE).message(SLO_TASK_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new(GPU_BUDGET_RULE).message(GPU_BUDGET_MESSAGE))]
#[serde(rename_all = "camelCase")]
pub struct ModelDeploymentSpec {
    /// The base model.
    pub model: ModelSource,
    /// Engine settings, passed to every agent as flags. Unset fields take the agent's defaults.
    #[serde(default)]
    pub engine: EngineSettings,
    /// Agent image; defaults to the image the operator was installed with (`agent.image` in the chart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Pull policy of the agent image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
    /// Secrets for pulling the agent image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub image_pull_secrets: Vec<LocalObjectReference>,
    /// What each pod asks of the cluster and where it may run.
    #[serde(default)]
    pub resources: PodResources,
    /// Number of agent pods. With `autoscaling` set, the autoscaler owns this field; `kubectl scale`
    /// works through the `scale` subresource.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 1000))]
    pub replicas: i32,
    /// Extra PersistentVolumeClaims mounted read-only at `/mnt/pvc/<claim>`, so that `LoraAdapter`s
    /// with `pvc://<claim>/...` sources can be read by the agents.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapter_volumes: Vec<String>,
    /// Latency-SLO autoscaling (see docs/autoscaling.md). When set, the operator's autoscaler owns `replicas`: it
    /// scrapes the agents' metrics and writes the count that holds the SLO through the `scale`
    /// subresource. Unset (or the autoscaler turned off), `replicas` is used as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingSpec>,
    /// Staged rollouts gated by regression tests (see docs/rollouts.md). A change to the pods goes out as a canary
    /// (or all at once with `Recreate`), step by step, each step optionally gated by the regression
    /// suite, then is promoted or rolled back. Unset, a change updates the Deployment in place (a plain
    /// rolling update).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
    /// Routing through the Gateway API Inference Extension (see docs/gateways.md): with
    /// `inferencePool`, the operator creates an `InferencePool` selecting this deployment's pods,
    /// where that CRD is installed (else the `InferencePoolReady` condition says it is missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<GatewaySpec>,
}

/// The ModelDeployment's name names its Service, and a Service name must be a DNS-1035 label (a
/// dot or a leading digit would create the Deployment and then fail on the Service).
pub const DNS1035_NAME_RULE: &str = "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')";
/// Message of [`DNS1035_NAME_RULE`].
pub const DNS1035_NAME_MESSAGE: &str = "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter, no dots: e.g. llama-3-1-8b): it names the Service";

/// A pod's GPUs are one agent's tensor-parallel ranks (`--tensor-parallel-size`), and the model's
/// heads split evenly over them: 0 (CPU backend), 1, 2, 4 or 8 (one node's GPUs at most).
pub const GPUS_RULE: &str = "self.gpus in [0, 1, 2, 4, 8]";
/// Message of [`GPUS_RULE`] (the operator's own check says the same).
pub const GPUS_MESSAGE: &str = "resources.gpus must be 0 (CPU), 1, 2, 4 or 8: a pod's GPUs are the agent's tensor-parallel ranks";

/// `tensorParallelSize`, where written, says the same as `gpus` (one agent drives all of a pod's
/// GPUs, one rank each).
pub const TENSOR_PARALLEL_RULE: &str = "!has(self.tensorParallelSize) || self.tensorParallelSize == self.gpus";
/// Message of [`TENSOR_PARALLEL_RULE`] (the operator's own check says the same).
pub const TENSOR_PARALLEL_MESSAGE: &str = "resources.tensorParallelSize must equal resources.gpus (each of a pod's GPUs is one tensor-parallel rank; set both, or gpus alone)";

/// A GPU budget must leave room for `minReplicas` pods of `resources.gpus` GPUs each.
pub const GPU_BUDGET_RULE: &str =
    "!has(self.autoscaling) || !has(self.autoscaling.maxGpus) || self.autoscaling.maxGpus >= self.autoscaling.minReplicas * self.resources.gpus";
/// Message of [`GPU_BUDGET_RULE`].
pub const GPU_BUDGET_MESSAGE: &str = "autoscaling.maxGpus must cover minReplicas × resources.gpus (each replica holds resources.gpus GPUs)";

/// The CPU backend computes in float32, or int8 W8A8; every other dtype needs a GPU.
pub const GPU_DTYPE_RULE: &str =
    "self.resources.gpus > 0 || !has(self.engine.dtype) || self.engine.dtype in ['auto', 'float32', 'int8']";
/// Message of [`GPU_DTYPE_RULE`].
pub const GPU_DTYPE_MESSAGE: &str =
    "resources.gpus is 0 (CPU backend): engine.dtype must be auto, float32 or int8";

/// The autoscaling SLO fits the task: TTFT and TPOT for `generate`; for an encoder (one step, no
/// output tokens) the end-to-end p95 and neither of the others.
pub const SLO_TASK_RULE: &str = "!has(self.autoscaling) || ((has(self.model.task) && self.model.task != 'generate') ? (has(self.autoscaling.slo.e2eP95Seconds) && !has(self.autoscaling.slo.ttftP95Seconds) && !has(self.autoscaling.slo.tpotP95Seconds)) : (has(self.autoscaling.slo.ttftP95Seconds) && has(self.autoscaling.slo.tpotP95Seconds)))";
/// Message of [`SLO_TASK_RULE`] (the operator's own check says the same).
pub const SLO_TASK_MESSAGE: &str = "autoscaling.slo must fit model.task: generate needs ttftP95Seconds and tpotP95Seconds; embed, rerank and classify take e2eP95Seconds only (an encoder answers in one step)";

fn default_replicas() -> i32 {
    1
}

/// Weight and activation precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum Dtype {
    /// float16 on GPU when the weights are 16-bit, float32 on CPU.
    #[serde(rename = "auto")]
    Auto,
    #[serde(rename = "float32")]
    Float32,
    #[serde(rename = "float16")]
    Float16,
    #[serde(rename = "bfloat16")]
    Bfloat16,
    /// FP8 weights (GPU only).
    #[serde(rename = "fp8")]
    Fp8,
    /// int8 weights and activations over a rotated model (GPU compute capability 8.0+, or the CPU).
    #[serde(rename = "int8")]
    Int8,
}

impl Dtype {
    /// The value of the agent's `--dtype` flag.
    pub fn as_flag(self) -> &'static str {
        match self {
            Dtype::Auto => "auto",
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Fp8 => "fp8",
            Dtype::Int8 => "int8",
        }
    }
}

/// Container image pull policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum PullPolicy {
    Always,
    IfNotPresent,
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

/// Flags the operator writes itself (from a typed field or always): repeating one in `extraArgs`
/// would leave the agent with two values and the spec with a field that silently does nothing.
pub const EXTRA_ARGS_RULE: &str = "!has(self.extraArgs) || !self.extraArgs.exists(a, a.matches('^--(model|served-model-name|host|port|device|enable-lora|load-format|dtype|max-model-len|max-num-seqs|max-num-batched-tokens|gpu-memory-utilization|max-loras|max-lora-rank|max-cpu-loras|tensor-parallel-size|enable-prefix-caching|disable-prefix-caching|grpc-port)(=.*)?$'))";
/// Message of [`EXTRA_ARGS_RULE`].
pub const EXTRA_ARGS_MESSAGE: &str = "engine.extraArgs must not repeat a flag the operator sets (--model, --port, --device, ...) or a typed engine field (--max-model-len, --max-lora-rank, ...): use the field";
/// `dtype: fp8 | int8` sets the agent's quantization flags: extraArgs may not set them again.
pub const EXTRA_ARGS_QUANTIZATION_RULE: &str = "!has(self.extraArgs) || !has(self.dtype) || !(self.dtype in ['fp8', 'int8']) || !self.extraArgs.exists(a, a.matches('^--quantization(-rotation)?(=.*)?$'))";
/// Message of [`EXTRA_ARGS_QUANTIZATION_RULE`].
pub const EXTRA_ARGS_QUANTIZATION_MESSAGE: &str = "engine.extraArgs must not set --quantization or --quantization-rotation when engine.dtype is fp8 or int8 (the dtype sets them)";

/// Engine settings; each maps to one `peregrine-agent serve` flag of the same name.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(EXTRA_ARGS_RULE).message(EXTRA_ARGS_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new(EXTRA_ARGS_QUANTIZATION_RULE).message(EXTRA_ARGS_QUANTIZATION_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new("!has(self.maxLoraRank) || !has(self.maxLoras) || self.maxLoras > 0").message("maxLoraRank needs maxLoras > 0"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.maxCpuLoras) || !has(self.maxLoras) || self.maxCpuLoras >= self.maxLoras").message("maxCpuLoras must be at least maxLoras"))]
pub struct EngineSettings {
    /// Precision (`--dtype`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// Longest sequence, prompt plus output, in tokens (`--max-model-len`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_model_len: Option<i32>,
    /// Most sequences in one batch (`--max-num-seqs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_num_seqs: Option<i32>,
    /// Most tokens in one step (`--max-num-batched-tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_num_batched_tokens: Option<i32>,
    /// Fraction of GPU memory the agent may use, in (0, 1] (`--gpu-memory-utilization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self > 0.0 && self <= 1.0").message("gpuMemoryUtilization must be in (0, 1]"))]
    pub gpu_memory_utilization: Option<f64>,
    /// Reuse KV blocks of shared prompt prefixes (`--enable-prefix-caching`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enable_prefix_caching: Option<bool>,
    /// Adapters resident on the device at once (`--max-loras`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_loras: Option<i32>,
    /// Highest adapter rank accepted (`--max-lora-rank`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 512))]
    pub max_lora_rank: Option<i32>,
    /// Adapters kept in host memory (`--max-cpu-loras`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_cpu_loras: Option<i32>,
    /// Further agent flags, appended as written (an escape hatch; prefer the typed fields). At most
    /// 64, each at most 256 characters.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 256)))]
    pub extra_args: Vec<String>,
}

/// Pod-level resources and scheduling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(GPUS_RULE).message(GPUS_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new(TENSOR_PARALLEL_RULE).message(TENSOR_PARALLEL_MESSAGE))]
pub struct PodResources {
    /// GPUs per pod: 0 runs the CPU backend, 1 the GPU backend, 2, 4 or 8 one agent over that
    /// many GPUs with tensor parallelism (`--tensor-parallel-size`; the agent's multi-GPU NCCL
    /// path is not built yet, so such pods do not start today). The pod's GPU limit.
    #[serde(default = "default_gpus")]
    #[schemars(range(min = 0, max = 16))]
    pub gpus: i32,
    /// Tensor-parallel ranks per pod, written out for readers of the spec; must equal `gpus`
    /// (which alone sets it when this is unset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 8))]
    pub tensor_parallel_size: Option<i32>,
    /// Extended resource name of a GPU.
    #[serde(default = "default_gpu_resource")]
    pub gpu_resource_name: String,
    /// CPU and memory requests/limits of the agent container (the GPU entry is added from `gpus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(transform = crate::schema_bounds::bound_resource_requirements)]
    pub container: Option<ResourceRequirements>,
    /// Node labels the pods must match.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints the pods tolerate (GPU nodes are often tainted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// Node and pod affinity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<Affinity>,
    /// PriorityClass of the pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_class_name: Option<String>,
}

impl Default for PodResources {
    fn default() -> Self {
        PodResources {
            gpus: default_gpus(),
            tensor_parallel_size: None,
            gpu_resource_name: default_gpu_resource(),
            container: None,
            node_selector: BTreeMap::new(),
            tolerations: Vec::new(),
            affinity: None,
            priority_class_name: None,
        }
    }
}

impl PodResources {
    /// The agent's `--tensor-parallel-size`: one rank per GPU, 1 on the CPU backend.
    pub fn tensor_parallel_size(&self) -> i32 {
        self.gpus.max(1)
    }
}

fn default_gpus() -> i32 {
    1
}

fn default_gpu_resource() -> String {
    "nvidia.com/gpu".to_string()
}

/// Observed state, written only by the operator from what the cluster reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelDeploymentStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Agent pods that exist (the `scale` subresource reads this).
    #[serde(default)]
    pub replicas: i32,
    /// Agent pods that are ready: model loaded and every adapter loaded.
    #[serde(default)]
    pub ready_replicas: i32,
    /// Label selector of the pods, as a string (the `scale` subresource and HPA read this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// In-cluster base URL of the OpenAI-compatible API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// `Ready`, `Progressing`, `Degraded`, and during staged rollouts `RolloutProgressing`,
    /// `RolloutPaused`, `RolloutFailed`.
    ///
    /// A list-map keyed by `type`, so that each controller (field manager) owns its own conditions
    /// under server-side apply.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[x_kube(merge_strategy = kube::core::ListMerge::Map(vec!["type".into()]))]
    pub conditions: Vec<Condition>,
    /// What the autoscaler last decided and why (set only with `spec.autoscaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<AutoscalingStatus>,
    /// The staged rollout's progress (set only with `spec.rollout`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
}

impl ModelDeployment {
    /// The model id clients send: `spec.model.servedModelName`, else the object's name.
    pub fn served_model_name(&self) -> String {
        match &self.spec.model.served_model_name {
            Some(name) if !name.is_empty() => name.clone(),
            _ => self.metadata.name.clone().unwrap_or_default(),
        }
    }
}

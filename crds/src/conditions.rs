//! Condition types and reasons that Peregrine resources report in `status.conditions`.
//!
//! Conditions use the standard `metav1.Condition` shape so that `kubectl wait --for=condition=Ready`
//! and GitOps health checks work without custom code.

/// ModelDeployment: every desired replica is ready and serving. LoraAdapter: loaded in every ready
/// pod, under a served name no one else has (what `kubectl wait` and Argo CD look at).
pub const CONDITION_READY: &str = "Ready";
/// ModelDeployment: a change is being rolled out, or pods are starting.
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// ModelDeployment: the spec cannot be acted on, or pods fail; the message says why.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// ModelDeployment with `spec.rollout`: a staged rollout is under way.
pub const CONDITION_ROLLOUT_PROGRESSING: &str = "RolloutProgressing";
/// ModelDeployment with `spec.rollout`: a staged rollout waits (pause step or the pause annotation).
pub const CONDITION_ROLLOUT_PAUSED: &str = "RolloutPaused";
/// ModelDeployment with `spec.rollout`: a staged rollout failed its regression gate and was rolled back.
pub const CONDITION_ROLLOUT_FAILED: &str = "RolloutFailed";
/// LoraAdapter: the adapter is loaded in every ready pod of its deployment.
pub const CONDITION_LOADED: &str = "Loaded";
/// LoraAdapter: its served name is taken by an older adapter of the same deployment or by the base
/// model; it is not loaded (requests for the name would reach other weights).
pub const CONDITION_CONFLICT: &str = "Conflict";

/// ModelDeployment with `spec.gateway.inferencePool`: its InferencePool (and its adapters'
/// InferenceObjectives) exist as the spec asks; False says why not (e.g. the CRDs are not installed).
pub const CONDITION_INFERENCE_POOL_READY: &str = "InferencePoolReady";

/// Machine-readable reasons (CamelCase, as the API conventions ask).
pub mod reasons {
    pub const INVALID_SPEC: &str = "InvalidSpec";
    pub const UNSUPPORTED_URI: &str = "UnsupportedUri";
    pub const SECRET_NOT_FOUND: &str = "SecretNotFound";
    pub const NO_GPUS_FOR_DTYPE: &str = "NoGpusForDtype";
    pub const APPLY_FAILED: &str = "ApplyFailed";
    /// `resources.gpus` other than 0, 1, 2, 4 or 8 (a pod's GPUs are its tensor-parallel ranks).
    pub const TOO_MANY_GPUS: &str = "TooManyGpus";
    /// `metadata.name` is not a DNS-1035 label (it names the Service).
    pub const INVALID_NAME: &str = "InvalidName";
    pub const ALL_REPLICAS_READY: &str = "AllReplicasReady";
    pub const REPLICAS_NOT_READY: &str = "ReplicasNotReady";
    pub const ROLLING_UPDATE: &str = "RollingUpdate";
    pub const SCALED_TO_ZERO: &str = "ScaledToZero";
    pub const STABLE: &str = "Stable";
    pub const DEPLOYMENT_NOT_FOUND: &str = "DeploymentNotFound";
    pub const NO_READY_PODS: &str = "NoReadyPods";
    pub const LOADED: &str = "Loaded";
    pub const PARTIALLY_LOADED: &str = "PartiallyLoaded";
    pub const LOAD_FAILED: &str = "LoadFailed";
    pub const SERVED_NAME_CONFLICT: &str = "ServedNameConflict";
    pub const NO_CONFLICT: &str = "NoConflict";
    /// The adapter's `spec.rank` is above the deployment's `engine.maxLoraRank`.
    pub const RANK_TOO_HIGH: &str = "RankTooHigh";
    /// The InferencePool (and objectives) are applied.
    pub const INFERENCE_POOL_APPLIED: &str = "InferencePoolApplied";
    /// `spec.gateway.inferencePool` asks for a pool but the cluster has no InferencePool API.
    pub const INFERENCE_POOL_CRD_MISSING: &str = "InferencePoolCRDMissing";
    /// The API server refused the InferencePool or an InferenceObjective.
    pub const INFERENCE_POOL_APPLY_FAILED: &str = "InferencePoolApplyFailed";
}

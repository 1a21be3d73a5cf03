//! `spec.rollout` / `status.rollout` of a ModelDeployment: staged rollouts, each stage gated
//! by a regression suite run against the canary.
//!
//! Acted on by the operator's rollout controller (`operator/src/rollout/`), run from every
//! ModelDeployment reconcile: a change to the pod template starts a canary Deployment next to the
//! stable one, advances through `steps` (running the regression suite where a step asks for it), and is
//! promoted or rolled back; progress is reported in `status.rollout` and the `Rollout*` conditions.
//! Without `spec.rollout` a change updates the Deployment in place (a plain rolling update).
//!
//! Control annotations on the ModelDeployment (level-triggered, so re-applying them is harmless):
//! - [`ANNOTATION_ROLLOUT_PAUSED`] `"true"`: hold at the current step; remove it (or `"false"`) to resume.
//! - [`ANNOTATION_ROLLOUT_PROMOTE`] `<updateRevision>`: skip the remaining steps and promote that revision.
//! - [`ANNOTATION_ROLLOUT_ABORT`] `<updateRevision>`: roll that revision back to the stable one.
//!
//! Promote and abort name the revision they mean, so a stale annotation never acts on a later rollout.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::KubeSchema;
use serde::{Deserialize, Serialize};

pub const ANNOTATION_ROLLOUT_PAUSED: &str = "serving.peregrine.dev/rollout-paused";
pub const ANNOTATION_ROLLOUT_PROMOTE: &str = "serving.peregrine.dev/rollout-promote";
pub const ANNOTATION_ROLLOUT_ABORT: &str = "serving.peregrine.dev/rollout-abort";

/// How spec changes reach the pods.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.strategy != 'Canary' || (has(self.steps) && size(self.steps) > 0)").message("rollout.steps must not be empty with strategy Canary"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.steps) || !self.steps.exists(s, s.runRegression) || has(self.regression)").message("a step with runRegression needs rollout.regression"))]
pub struct RolloutSpec {
    /// `Canary` (default): new pods next to the stable ones, step by step. `Recreate`: replace all
    /// pods at once (for when two revisions cannot share the GPUs).
    #[serde(default)]
    pub strategy: RolloutStrategy,
    /// Canary steps, in order; after the last one the update is promoted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub steps: Vec<RolloutStep>,
    /// The regression gate steps with `runRegression` run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regression: Option<RegressionSpec>,
    /// Failed regression runs tolerated before the rollout is aborted (default 0: the first fails it).
    /// A canary that misses `progressDeadlineSeconds` is not counted here: it fails the rollout.
    #[serde(default)]
    #[schemars(range(min = 0, max = 10))]
    pub max_failures: i32,
    /// How long a step's canary pods may take to become ready (counted from the step's start)
    /// before the rollout fails and is rolled back (default 600, like a Deployment's).
    #[serde(default = "default_progress_deadline")]
    #[schemars(range(min = 1, max = 86400))]
    pub progress_deadline_seconds: i32,
    /// Promote after the last step without waiting for the promote annotation (default true).
    #[serde(default = "default_true")]
    pub auto_promote: bool,
}

fn default_true() -> bool {
    true
}

fn default_progress_deadline() -> i32 {
    600
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum RolloutStrategy {
    #[default]
    Canary,
    Recreate,
}

/// One canary step: how many canary pods, how long to wait, whether to run the regression suite.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("has(self.canaryReplicas) != has(self.canaryPercent)").message("a step sets exactly one of canaryReplicas and canaryPercent"))]
pub struct RolloutStep {
    /// Canary pods at this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub canary_replicas: Option<i32>,
    /// Canary pods as a percentage of `replicas`, rounded up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100))]
    pub canary_percent: Option<i32>,
    /// Wait this long after the canary pods are ready (0: go on at once).
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub pause_seconds: i32,
    /// Run the regression suite against the canary before going on.
    #[serde(default)]
    pub run_regression: bool,
}

/// The regression gate: a suite of cases and the thresholds it must meet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegressionSpec {
    pub suite: RegressionSuite,
    #[serde(default)]
    pub thresholds: RegressionThresholds,
}

/// Cases written inline or kept in a ConfigMap (a YAML list of cases under one key).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("(has(self.cases) && size(self.cases) > 0) != has(self.configMapRef)").message("regression.suite sets exactly one of cases and configMapRef"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.cases) || self.cases.all(c, self.cases.exists_one(d, d.name == c.name))").message("regression case names must be unique (results are reported by name)"))]
pub struct RegressionSuite {
    #[serde(default)]
    #[schemars(length(max = 200))]
    pub cases: Vec<RegressionCase>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<ConfigMapKeyRef>,
}

/// A key of a ConfigMap in the same namespace.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapKeyRef {
    #[schemars(length(min = 1))]
    pub name: String,
    /// Key holding the YAML list of cases (default `cases.yaml`).
    #[serde(default = "default_cases_key")]
    pub key: String,
}

fn default_cases_key() -> String {
    "cases.yaml".to_string()
}

/// One regression case: a prompt (or chat), greedy decoding, and what the output must satisfy; or,
/// for an encoder (`spec.model.task` embed, rerank, classify), an `input` (with `documents` to rerank).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new(CASE_INPUT_RULE).message(CASE_INPUT_MESSAGE))]
#[x_kube(validation = kube::core::Rule::new("!has(self.documents) || size(self.documents) == 0 || has(self.input)").message("documents go with input (a rerank case)"))]
pub struct RegressionCase {
    /// Identifies the case in results.
    #[schemars(length(min = 1, max = 128))]
    pub name: String,
    /// Completion prompt (`/v1/completions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Chat messages (`/v1/chat/completions`), at most 64 (a bound the API server needs to cost the
    /// rules on each message).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub messages: Vec<ChatMessage>,
    /// Encoder cases: the text to embed or classify, or the query to rerank `documents` against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// Rerank cases: the documents, at most 100. The output is their relevance scores in this order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub documents: Vec<String>,
    /// Send to this LoraAdapter (its served name) instead of the base model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<String>,
    /// Decoding is greedy (temperature 0) so outputs are comparable; these bound it.
    #[serde(default)]
    pub sampling: GreedySampling,
    pub expect: Expectation,
}

/// A case sends exactly one of a completion prompt, chat messages or an encoder input.
pub const CASE_INPUT_RULE: &str = "(has(self.prompt) ? 1 : 0) + (has(self.messages) && size(self.messages) > 0 ? 1 : 0) + (has(self.input) ? 1 : 0) == 1";
/// Message of [`CASE_INPUT_RULE`].
pub const CASE_INPUT_MESSAGE: &str = "a case sets exactly one of prompt, messages and input";

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ChatMessage {
    #[x_kube(validation = kube::core::Rule::new("self in ['system', 'user', 'assistant']").message("role must be system, user or assistant"))]
    #[schemars(length(max = 16))]
    pub role: String,
    pub content: String,
}

/// Greedy decoding parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct GreedySampling {
    /// Output token limit (default 32).
    #[serde(default = "default_max_tokens")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_tokens: i32,
    /// Stop strings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// Seed, for engines whose greedy path still draws (ties).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
}

impl Default for GreedySampling {
    fn default() -> Self {
        GreedySampling { max_tokens: default_max_tokens(), stop: Vec::new(), seed: None }
    }
}

fn default_max_tokens() -> i32 {
    32
}

/// What a case's output must satisfy.
///
/// An encoder case's output is a vector (the embedding; the scores of `documents` in order; the
/// class probabilities) and a text (the top label for classify; the document indices, most
/// relevant first and comma-separated, for rerank), so `exact`/`contains`/`regex` check labels and
/// rankings, `cosineAtLeast` and `withinTolerance` check the vector against golden `values`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = kube::core::Rule::new("self.type in ['sameAsStable', 'cosineAtLeast', 'withinTolerance'] || has(self.value)").message("expect.value is required for exact, contains and regex"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.threshold) || self.type in ['sameAsStable', 'cosineAtLeast']").message("expect.threshold applies only to sameAsStable and cosineAtLeast"))]
#[x_kube(validation = kube::core::Rule::new("!(self.type in ['cosineAtLeast', 'withinTolerance']) || (has(self.values) && size(self.values) > 0)").message("expect.values (the golden vector) is required for cosineAtLeast and withinTolerance"))]
#[x_kube(validation = kube::core::Rule::new("!has(self.tolerance) || self.type == 'withinTolerance'").message("expect.tolerance applies only to withinTolerance"))]
pub struct Expectation {
    #[serde(rename = "type")]
    pub kind: ExpectationKind,
    /// Expected text (`exact`, `contains`) or pattern (`regex`, RE2 syntax).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// `sameAsStable`: least fraction (0..1) of leading output tokens that must equal the stable
    /// revision's output (default 1.0: identical); for an encoder, the least of 1 - the largest
    /// difference between the two outputs' values (default 0.999). `cosineAtLeast`: the least
    /// cosine between the output and `values` (default 0.999).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self >= 0.0 && self <= 1.0").message("threshold must be in [0, 1]"))]
    pub threshold: Option<f64>,
    /// Golden vector of an encoder case (`cosineAtLeast`, `withinTolerance`), at most 8192 values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8192))]
    pub values: Vec<f64>,
    /// `withinTolerance`: the largest difference allowed between each output value and `values`
    /// (default 1e-3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = kube::core::Rule::new("self >= 0.0").message("tolerance must be >= 0"))]
    pub tolerance: Option<f64>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub enum ExpectationKind {
    #[default]
    #[serde(rename = "exact")]
    Exact,
    #[serde(rename = "contains")]
    Contains,
    #[serde(rename = "regex")]
    Regex,
    /// Compare with the stable revision's output for the same case.
    #[serde(rename = "sameAsStable")]
    SameAsStable,
    /// Encoder cases: the cosine between the output vector and `values` is at least `threshold`.
    #[serde(rename = "cosineAtLeast")]
    CosineAtLeast,
    /// Encoder cases: every output value is within `tolerance` of `values`.
    #[serde(rename = "withinTolerance")]
    WithinTolerance,
}

/// Suite-level thresholds a step must meet to pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RegressionThresholds {
    /// Least fraction of cases that must pass (default 1.0).
    #[serde(default = "default_agreement")]
    #[x_kube(validation = kube::core::Rule::new("self >= 0.0 && self <= 1.0").message("minAgreementRate must be in [0, 1]"))]
    pub min_agreement_rate: f64,
    /// Canary p95 latency (TTFT and TPOT; an encoder's whole request, reported as TTFT) may be at
    /// most this multiple of stable's (default 1.5).
    #[serde(default = "default_latency_factor")]
    #[x_kube(validation = kube::core::Rule::new("self >= 1.0").message("maxLatencyFactor must be >= 1"))]
    pub max_latency_factor: f64,
}

impl Default for RegressionThresholds {
    fn default() -> Self {
        RegressionThresholds { min_agreement_rate: default_agreement(), max_latency_factor: default_latency_factor() }
    }
}

fn default_agreement() -> f64 {
    1.0
}
fn default_latency_factor() -> f64 {
    1.5
}

/// Rollout state (written by the rollout controller). Conditions `RolloutProgressing`,
/// `RolloutPaused` and `RolloutFailed` live in the ModelDeployment's `status.conditions`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RolloutStatus {
    /// Hash of the pod template the stable pods run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_revision: Option<String>,
    /// Hash of the pod template being rolled out (equal to `currentRevision` when none is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_revision: Option<String>,
    /// Index into `spec.rollout.steps` of the step under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step: Option<i32>,
    /// When the current step started, or last started over (a retried step, or a canary that lost
    /// its readiness); `progressDeadlineSeconds` counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_step_started_at: Option<Time>,
    /// When every canary pod of the current step was first seen ready; the step's pause and its
    /// regression run count from here. Unset while the canary is not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary_ready_at: Option<Time>,
    /// Failed regression runs of this update so far.
    #[serde(default)]
    pub failures: i32,
    /// Results of the steps run for `updateRevision`, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub step_results: Vec<StepResult>,
}

/// Outcome of one step's regression run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepResult {
    pub step: i32,
    pub passed: bool,
    /// Fraction of cases that passed.
    pub pass_rate: f64,
    pub cases: i32,
    pub failed_cases: i32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency: Option<LatencyComparison>,
    /// A few failing cases, for `kubectl describe` (at most 5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    pub mismatches: Vec<Mismatch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Canary against stable latency, p95 in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LatencyComparison {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary_ttft_p95_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_ttft_p95_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary_tpot_p95_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stable_tpot_p95_seconds: Option<f64>,
    /// The larger of the canary/stable ratios, compared with `maxLatencyFactor`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_factor: Option<f64>,
}

/// A failing case: what was expected and what came back (both truncated).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Mismatch {
    pub case: String,
    pub expected: String,
    pub got: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

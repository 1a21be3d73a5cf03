//! Pure functions from a ModelDeployment to the objects that should exist. No API calls, so every
//! field can be table-tested.

pub mod admin_key;
pub mod args;
pub mod deployment;
pub mod gateway;
pub mod model;
pub mod service;

use std::collections::BTreeMap;

use peregrine_crds::{ModelDeployment, DEPLOYMENT_LABEL};

/// The agent's gRPC port (`--grpc-port`) for encoder tasks (embed, rerank, classify): container and
/// Service port `grpc` (gRPC's conventional port; generation has no gRPC service, so no port).
pub const AGENT_GRPC_PORT: i32 = 50051;

/// Whether `md`'s agent serves gRPC beside HTTP (an encoder task).
pub fn serves_grpc(md: &ModelDeployment) -> bool {
    md.spec.model.task.is_encoder()
}

/// Labels on every object made for `md`; [`selector_labels`] is the subset the pods are selected by.
///
/// No `app.kubernetes.io/instance`: Argo CD tracks the objects of an Application by that label, so
/// children carrying it would be shown (and pruned) as the Application's own. Ownership is in the
/// owner reference and [`DEPLOYMENT_LABEL`].
pub fn labels(md: &ModelDeployment) -> BTreeMap<String, String> {
    let mut labels = selector_labels(md);
    labels.insert("app.kubernetes.io/name".into(), "peregrine-agent".into());
    labels.insert("app.kubernetes.io/managed-by".into(), "peregrine-operator".into());
    labels
}

/// The pod selector: one label naming the ModelDeployment. Never changes, since a Deployment's
/// selector is immutable.
pub fn selector_labels(md: &ModelDeployment) -> BTreeMap<String, String> {
    BTreeMap::from([(DEPLOYMENT_LABEL.to_string(), md.metadata.name.clone().unwrap_or_default())])
}

/// `key=value` form of the selector, for `status.selector` and label-selected lists.
pub fn selector_string(md: &ModelDeployment) -> String {
    selector_labels(md).iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

/// In-cluster base URL of the OpenAI API of `md`.
pub fn endpoint(md: &ModelDeployment, port: i32) -> String {
    let name = md.metadata.name.as_deref().unwrap_or_default();
    let namespace = md.metadata.namespace.as_deref().unwrap_or("default");
    format!("http://{name}.{namespace}.svc:{port}/v1")
}

//! ModelDeployment → its Gateway API Inference Extension objects: an `InferencePool` selecting the
//! deployment's pods, and an `InferenceObjective` per LoraAdapter that sets a priority (pure).
//!
//! Written as JSON, not typed structs: these are other projects' CRDs, and only the fields below
//! (the GA `inference.networking.k8s.io/v1` pool and the `v1alpha2` objective) are ours to set.

use kube::core::ApiResource;
use kube::Resource;
use peregrine_crds::{InferencePoolSettings, LoraAdapter, ModelDeployment};
use serde_json::{json, Value};

use super::{labels, selector_labels};

/// `inference.networking.k8s.io/v1` `InferencePool`.
pub fn inference_pool_resource() -> ApiResource {
    ApiResource {
        group: "inference.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

/// `inference.networking.x-k8s.io/v1alpha2` `InferenceObjective`.
pub fn inference_objective_resource() -> ApiResource {
    ApiResource {
        group: "inference.networking.x-k8s.io".into(),
        version: "v1alpha2".into(),
        api_version: "inference.networking.x-k8s.io/v1alpha2".into(),
        kind: "InferenceObjective".into(),
        plural: "inferenceobjectives".into(),
    }
}

/// The endpoint picker Service the pool names: the spec's, else `<name>-epp`.
pub fn endpoint_picker_service(md: &ModelDeployment, settings: &InferencePoolSettings) -> String {
    match &settings.endpoint_picker_service {
        Some(name) if !name.is_empty() => name.clone(),
        _ => format!("{}-epp", md.metadata.name.as_deref().unwrap_or_default()),
    }
}

/// The pool: named like `md`, owned by it (garbage-collected with it), selecting its pods (stable
/// and canary: the Service's selector) on the agent port.
pub fn inference_pool(md: &ModelDeployment, settings: &InferencePoolSettings, agent_port: i32) -> Value {
    let mut picker = json!({
        "group": "",
        "kind": "Service",
        "name": endpoint_picker_service(md, settings),
        "port": {"number": settings.endpoint_picker_port},
    });
    if let Some(mode) = settings.failure_mode {
        picker["failureMode"] = json!(mode.as_str());
    }
    let resource = inference_pool_resource();
    json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": {
            "name": md.metadata.name,
            "namespace": md.metadata.namespace,
            "labels": labels(md),
            "ownerReferences": md.controller_owner_ref(&()).map(|o| vec![o]),
        },
        "spec": {
            "selector": {"matchLabels": selector_labels(md)},
            "targetPorts": [{"number": agent_port}],
            "endpointPickerRef": picker,
        },
    })
}

/// The adapter's objective, when it sets a priority: named like the LoraAdapter (requests name it
/// in `x-gateway-inference-objective`), owned by it, in `md`'s pool.
pub fn inference_objective(adapter: &LoraAdapter, md: &ModelDeployment) -> Option<Value> {
    let priority = adapter.spec.gateway.as_ref()?.priority?;
    let resource = inference_objective_resource();
    let pool = inference_pool_resource();
    Some(json!({
        "apiVersion": resource.api_version,
        "kind": resource.kind,
        "metadata": {
            "name": adapter.metadata.name,
            "namespace": adapter.metadata.namespace,
            "labels": labels(md),
            "ownerReferences": adapter.controller_owner_ref(&()).map(|o| vec![o]),
        },
        "spec": {
            "priority": priority,
            "poolRef": {"group": pool.group, "kind": pool.kind, "name": md.metadata.name},
        },
    }))
}

//! Bounds and checks added to the schemas of Kubernetes types we embed (their generated schemas
//! have none): the API server needs every list, map and string a CEL rule reads to be bounded, and
//! a bad quantity must be refused at `kubectl apply`, not when the Deployment is created.

use serde_json::{json, Value};

/// Most entries in a container's `requests` or `limits` (cpu, memory, ephemeral-storage, a GPU
/// resource, hugepages: a handful in practice).
pub const MAX_RESOURCE_ENTRIES: u64 = 16;
/// Longest quantity string (`"1.5Gi"`, `"500m"`, `"128974848e3"`).
pub const MAX_QUANTITY_LENGTH: u64 = 64;

/// CEL rule on each quantity of `requests`/`limits`: parses like the API server's `resource.ParseQuantity`.
pub const QUANTITY_RULE: &str = "isQuantity(string(self))";
/// Message of [`QUANTITY_RULE`].
pub const QUANTITY_MESSAGE: &str = "must be a Kubernetes quantity such as 500m, 4, 32Gi or 1.5G (not 32GB)";

/// `schemars` transform for a `ResourceRequirements` field: bounds `requests` and `limits` and
/// checks each quantity with [`QUANTITY_RULE`]. The generic quantity description (2 KB, twice) is
/// replaced by one line, to keep the CRD small.
pub fn bound_resource_requirements(schema: &mut schemars::Schema) {
    let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) else {
        return;
    };
    for map in ["requests", "limits"] {
        let Some(node) = properties.get_mut(map).and_then(Value::as_object_mut) else {
            continue;
        };
        node.insert("maxProperties".into(), json!(MAX_RESOURCE_ENTRIES));
        if let Some(value) = node.get_mut("additionalProperties").and_then(Value::as_object_mut) {
            value.insert("description".into(), json!("A quantity: 500m, 4, 32Gi, 1.5G ..."));
            value.insert("maxLength".into(), json!(MAX_QUANTITY_LENGTH));
            value.insert(
                "x-kubernetes-validations".into(),
                json!([{"rule": QUANTITY_RULE, "message": QUANTITY_MESSAGE}]),
            );
        }
    }
}

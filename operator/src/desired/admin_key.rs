//! The agents' admin key: the operator's own `--admin-api-key` goes into one Secret per
//! ModelDeployment (in its namespace, owned by it), and the agent container reads it from there as
//! `PEREGRINE_ADMIN_API_KEYS`. The operator then sends the same key on its adapter pushes, so the
//! pods it runs accept them while tenant keys get 403 on the admin endpoints.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{EnvVar, EnvVarSource, Secret, SecretKeySelector};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use peregrine_crds::ModelDeployment;

use super::labels;

/// The key inside the Secret.
pub const SECRET_KEY: &str = "admin-api-key";
/// The agent's environment variable for `--admin-api-key`.
pub const AGENT_ENV: &str = "PEREGRINE_ADMIN_API_KEYS";

/// The operator's admin key. Its `Debug` never prints the key, so config dumps and logs stay clean.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminKey(String);

impl AdminKey {
    /// None for an empty or blank key (no key configured).
    pub fn new(key: &str) -> Option<AdminKey> {
        let key = key.trim();
        (!key.is_empty()).then(|| AdminKey(key.to_string()))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for AdminKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminKey(<redacted>)")
    }
}

/// `<name>-agent-admin`.
pub fn secret_name(md: &ModelDeployment) -> String {
    format!("{}-agent-admin", md.metadata.name.as_deref().unwrap_or_default())
}

/// The Secret the agent pods of `md` read their admin key from.
pub fn desired_secret(md: &ModelDeployment, key: &AdminKey) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name(md)),
            namespace: md.metadata.namespace.clone(),
            labels: Some(labels(md)),
            owner_references: md.controller_owner_ref(&()).map(|o| vec![o]),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(SECRET_KEY.to_string(), key.expose().to_string())])),
        type_: Some("Opaque".to_string()),
        ..Default::default()
    }
}

/// The agent container's variable that reads the key from [`desired_secret`].
pub fn agent_env(md: &ModelDeployment) -> EnvVar {
    EnvVar {
        name: AGENT_ENV.to_string(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector { name: secret_name(md), key: SECRET_KEY.to_string(), optional: Some(false) }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

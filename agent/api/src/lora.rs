//! LoRA adapter admin endpoints: `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`
//! (vLLM's bodies and plain-text success answers) and `GET /v1/adapters` (what is loaded).

use serde::{Deserialize, Serialize};

use crate::{Validate, ValidationError};

/// Longest adapter name the engine accepts.
pub const MAX_ADAPTER_NAME_LEN: usize = 256;

/// Header of a successful `POST /v1/load_lora_adapter` answer: the loaded version's content digest
/// (see [`AdapterStatus::digest`]). A header, so the body stays vLLM's plain-text message.
pub const ADAPTER_DIGEST_HEADER: &str = "x-peregrine-adapter-digest";

/// `POST /v1/load_lora_adapter`, as vLLM takes it. Loading a name again from the same path changes
/// nothing; from another path it replaces the adapter (running requests finish on the old one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadLoraAdapterRequest {
    pub lora_name: String,
    /// A PEFT folder on the agent's file system.
    pub lora_path: String,
}

/// `POST /v1/unload_lora_adapter`, as vLLM takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnloadLoraAdapterRequest {
    pub lora_name: String,
    /// vLLM's integer id; accepted for compatibility and ignored (names identify adapters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_int_id: Option<i64>,
}

fn check_name(name: &str) -> Result<(), ValidationError> {
    let ok_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/');
    if name.is_empty() || name.len() > MAX_ADAPTER_NAME_LEN || !name.chars().all(ok_char) {
        return Err(ValidationError::new(
            "lora_name",
            format!("lora_name must be 1-{MAX_ADAPTER_NAME_LEN} characters of A-Z a-z 0-9 - _ . : /"),
        ));
    }
    Ok(())
}

impl Validate for LoadLoraAdapterRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        check_name(&self.lora_name)?;
        if self.lora_path.is_empty() {
            return Err(ValidationError::new("lora_path", "lora_path must not be empty"));
        }
        Ok(())
    }
}

impl Validate for UnloadLoraAdapterRequest {
    fn validate(&self) -> Result<(), ValidationError> {
        check_name(&self.lora_name)
    }
}

/// `GET /v1/adapters`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterList {
    /// Always `list`.
    pub object: String,
    pub data: Vec<AdapterStatus>,
}

/// One adapter version. After a replace or unload the old version stays listed (state
/// `unloading`) until its running requests end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterStatus {
    pub name: String,
    /// The version: a replace under the same name gets a new id.
    pub id: u64,
    /// The folder it was read from.
    pub source: String,
    pub rank: usize,
    /// `active` (in a GPU/CPU slot), `loaded` (in host memory), `evicted` (re-read on next use),
    /// `unloading`, or `failed` (evicted and its files can no longer be read: requests naming it
    /// get 503 `adapter_unavailable` until it is loaded again).
    pub state: String,
    pub slot: Option<u32>,
    /// Unix seconds.
    pub loaded_at: f64,
    /// Unix seconds of the last request scheduled on it.
    pub last_used: Option<f64>,
    /// Requests that ended on this version.
    pub requests_served: u64,
    /// Requests on it now (waiting or running).
    pub in_flight: usize,
    pub size_bytes: usize,
    /// What this version was read from, by content: `sha256:<hex>` of `adapter_config.json`'s bytes
    /// followed by `adapter_model.safetensors`'s (`cat adapter_config.json
    /// adapter_model.safetensors | sha256sum`), computed at load. Absent from agents that predate it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
}

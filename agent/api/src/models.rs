//! `GET /v1/models`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    /// Always `model`.
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// The base model this one is (for an adapter: the base it applies to).
    pub root: String,
    /// For an adapter, the base model's id; None for the base model itself.
    pub parent: Option<String>,
    pub max_model_len: usize,
}

//! The agent's own endpoints, read by the operator.

use serde::{Deserialize, Serialize};

/// `GET /version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionInfo {
    pub version: String,
    /// The served base model's id.
    pub model: String,
    /// The backend running it ("cpu", "cuda:0").
    pub backend: String,
}

/// `GET /health` and `GET /ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeStatus {
    /// `ok`, `starting` or `draining`.
    pub status: String,
}

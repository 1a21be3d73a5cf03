//! The operator's error type; each variant has a stable label for the failure metric.

use peregrine_crds::UriError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("agent {pod}: {source}")]
    Agent { pod: String, source: crate::agent_client::AgentError },
    #[error("invalid spec: {0}")]
    InvalidUri(#[from] UriError),
    #[error("object has no {0}")]
    MissingField(&'static str),
    #[error("serializing: {0}")]
    Serialize(#[from] serde_json::Error),
    #[error("finalizer: {0}")]
    Finalizer(String),
    #[error("rollout: {0}")]
    Rollout(#[from] crate::rollout::RolloutError),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Label value of `peregrine_operator_reconcile_failures_total{error=...}`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Agent { .. } => "agent",
            Error::InvalidUri(_) => "invalid_spec",
            Error::MissingField(_) => "missing_field",
            Error::Serialize(_) => "serialize",
            Error::Finalizer(_) => "finalizer",
            Error::Rollout(_) => "rollout",
        }
    }
}

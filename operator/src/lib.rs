//! `peregrine-operator`: reconciles `ModelDeployment`s into agent pods and `LoraAdapter`s into those
//! pods' adapter slots, sizes each deployment to hold its latency SLO ([`autoscaler`]) and rolls out
//! spec changes in stages ([`rollout`], [`regression`]).
//!
//! Layout (modelled on kube-rs's controller-rs): pure functions that compute what should exist
//! ([`desired`], [`status`], [`validate`]), the controllers that apply them ([`model_deployment`],
//! [`lora_adapter`]), the agent's HTTP client ([`agent_client`]), and the process plumbing
//! ([`metrics`], [`leader`], [`telemetry`], [`server`]).

pub mod agent_client;
pub mod autoscaler;
pub mod conditions;
pub mod config;
pub mod context;
pub mod desired;
pub mod error;
pub mod gateway;
pub mod leader;
pub mod load_progress;
pub mod lora_adapter;
pub mod metrics;
pub mod model_deployment;
pub mod regression;
pub mod rollout;
pub mod server;
pub mod status;
pub mod telemetry;
pub mod validate;

pub use context::Context;
pub use error::{Error, Result};

/// Field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "peregrine-operator";

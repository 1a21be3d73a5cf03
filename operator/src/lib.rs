//! `peregrine-operator`: reconciles `ModelDeployment`s into agent pods, rolls changes out in stages
//! gated by regression suites.

pub mod regression;
pub mod rollout;

//! `peregrine-operator`: reconciles `ModelDeployment`s into agent pods and `LoraAdapter`s into those
//! pods' adapter slots, and sizes each deployment to hold its latency SLO ([`autoscaler`]).

pub mod autoscaler;

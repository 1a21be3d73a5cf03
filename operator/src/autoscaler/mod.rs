//! Latency-SLO autoscaling: sizes each `ModelDeployment` with `spec.autoscaling` to hold
//! its p95 TTFT/TPOT with the fewest replicas.
//!
//! Data flow, one round per deployment every scrape interval:
//! [`scraper`] reads each ready pod's `/metrics` → [`sample`] picks out the agent's series →
//! [`window`] keeps each pod's scrapes and builds a [`window::FleetSnapshot`] over the evaluation
//! window from histogram bucket deltas ([`histogram`]) → [`capacity`] learns what one replica
//! sustains within the SLO → [`decision`] (pure) picks the replica count → [`controller`] writes it
//! through the `scale` subresource and reports it in `status.autoscaling`, and [`metrics`] exports
//! it. [`sim`] drives the same window, capacity and decision code against a simulated fleet.

pub mod capacity;
pub mod controller;
pub mod decision;
pub mod histogram;
pub mod metrics;
pub mod sample;
pub mod scraper;
pub mod sim;
pub mod window;

pub use capacity::CapacityEstimator;
pub use decision::{decide, Decision, DecisionInput, DecisionState, Reason};
pub use window::{FleetSnapshot, PodObservation, PodState, ScrapeWindow};

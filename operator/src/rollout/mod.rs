//! Staged rollouts: a ModelDeployment change that alters its pods goes out as a canary,
//! step by step, each step gated by the regression suite, then is promoted or rolled back.
//!
//! - [`revision`]: the revision hash of a pod template.
//! - [`machine`]: the state machine, a pure function of (spec, observed state, suite result).
//! - [`objects`]: canary/stable Deployments and what observed objects mean (pure).
//! - [`controller`]: the glue that reads the cluster, runs the suite and applies the plan.

pub mod controller;
pub mod machine;
pub mod objects;
pub mod revision;

pub use controller::{reconcile, HttpSuiteRunner, Reconciled, RolloutContext, RolloutError, SuiteRunner};
pub use machine::{plan, Action, Controls, Input, Observed, Plan, StableTemplate};

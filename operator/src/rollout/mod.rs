//! Staged rollouts.

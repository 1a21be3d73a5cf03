//! Engine scenarios shared by every backend's engine tests, plus a deterministic fake backend.
//! A test file pulls them in with `mod engine_support;` and runs each scenario with its own
//! backend factory.
#![allow(dead_code)]

pub mod device_sampling;
pub mod fake;
pub mod scenarios;

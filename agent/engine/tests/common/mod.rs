//! Shared helpers for the integration tests: where the test model and fixtures live.
#![allow(dead_code, unused_imports)]

/// The test model and the fixtures are found one way for the whole workspace (`peregrine-testkit`).
pub use peregrine_testkit::{fixtures_dir, test_model as model_path};

pub fn reference() -> serde_json::Value {
    let path = fixtures_dir().join("smollm2/reference.json");
    let text = std::fs::read_to_string(&path).expect("read reference.json");
    serde_json::from_str(&text).expect("parse reference.json")
}

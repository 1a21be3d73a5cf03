//! Shared helpers for the integration tests: where the test model and fixtures live.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn model_path() -> PathBuf {
    let path = match std::env::var_os("PEREGRINE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME").expect("HOME is not set");
            PathBuf::from(home).join(".cache/peregrine/SmolLM2-135M-Instruct.Q4_1.gguf")
        }
    };
    assert!(
        path.is_file(),
        "test model {} not found: run `make model` (or set PEREGRINE_TEST_MODEL)",
        path.display()
    );
    path
}

pub fn fixtures_dir() -> PathBuf {
    let dir = match std::env::var_os("PEREGRINE_FIXTURES") {
        Some(p) => PathBuf::from(p),
        // `<repo root>/../shared/fixtures`; a git worktree under `<root>/wt/<name>` looks one more
        // level up.
        None => {
            let repo_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
            let near = repo_root.join("../shared/fixtures");
            let far = repo_root.join("../../shared/fixtures");
            if near.exists() || !far.exists() { near } else { far }
        }
    };
    assert!(
        dir.join("smollm2/reference.json").is_file(),
        "fixtures not found in {}: run `make model` and make sure ../shared/fixtures exists (or set PEREGRINE_FIXTURES)",
        dir.display()
    );
    dir
}

pub fn reference() -> serde_json::Value {
    let path = fixtures_dir().join("smollm2/reference.json");
    let text = std::fs::read_to_string(&path).expect("read reference.json");
    serde_json::from_str(&text).expect("parse reference.json")
}

//! The design's layering, checked from `cargo metadata` (crate dependencies) and the source's paths
//! (module imports). A change that crosses a boundary fails here, naming the crate or the line.
//!
//! Crate boundaries: the engine never reaches the server (peregrine-agent, axum); the operator never
//! links the engine or the kernels; `peregrine-crds` depends on no crate of ours.
//! Module boundary: the step planners (scheduler, KV cache, the LoRA plan and registry) never name the
//! backend; they produce plans that backends execute.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Crate → crates it must never reach through normal or build dependencies, direct or transitive.
const FORBIDDEN_CRATE_DEPS: &[(&str, &[&str])] = &[
    ("peregrine-engine", &["peregrine-agent", "axum", "peregrine-operator"]),
    ("peregrine-operator", &["peregrine-engine", "peregrine-kernels"]),
];

/// Crates that may depend on no workspace crate at all.
const LEAF_CRATES: &[&str] = &["peregrine-crds"];

/// Files and folders (relative to the workspace root) whose code must not name `backend::`.
/// One list: when a module moves, update it here (a missing path fails the test, so a move never
/// silently drops a check).
const PLANNER_PATHS: &[&str] = &[
    "agent/engine/src/scheduler",
    "agent/engine/src/kv",
    "agent/engine/src/plan",
    "agent/engine/src/lora/registry.rs",
    // The tensor-parallel sharding plan serves every backend (the CPU's fake TP, a CUDA one).
    "agent/engine/src/tp",
];

struct Graph {
    /// package id → name
    names: HashMap<String, String>,
    /// package id → ids of its normal/build dependencies
    deps: HashMap<String, Vec<String>>,
    workspace: BTreeSet<String>,
}

fn graph() -> Graph {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--locked", "--manifest-path"])
        .arg(peregrine_testkit::repo_root().join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata JSON");
    let names = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["id"].as_str().expect("id").to_string(), p["name"].as_str().expect("name").to_string()))
        .collect();
    let workspace = meta["workspace_members"].as_array().expect("members").iter().map(|m| m.as_str().expect("id").to_string()).collect();
    let mut deps = HashMap::new();
    for node in meta["resolve"]["nodes"].as_array().expect("resolve nodes") {
        let linked = node["deps"]
            .as_array()
            .expect("deps")
            .iter()
            // `kind` is null for normal dependencies, "build" for build ones, "dev" for tests only.
            .filter(|d| d["dep_kinds"].as_array().expect("dep_kinds").iter().any(|k| k["kind"].as_str() != Some("dev")))
            .map(|d| d["pkg"].as_str().expect("pkg").to_string())
            .collect();
        deps.insert(node["id"].as_str().expect("id").to_string(), linked);
    }
    Graph { names, deps, workspace }
}

impl Graph {
    fn id_of(&self, name: &str) -> String {
        let ids: Vec<_> = self.workspace.iter().filter(|id| self.names[*id] == name).collect();
        assert_eq!(ids.len(), 1, "workspace crate {name} not found (renamed? update this test)");
        ids[0].clone()
    }

    /// Every crate `from` links, with the chain that reaches it.
    fn reachable(&self, from: &str) -> HashMap<String, Vec<String>> {
        let start = self.id_of(from);
        let mut seen: HashMap<String, Vec<String>> = HashMap::new();
        let mut stack = vec![(start, vec![from.to_string()])];
        while let Some((id, chain)) = stack.pop() {
            for dep in self.deps.get(&id).into_iter().flatten() {
                let name = self.names[dep].clone();
                if seen.contains_key(&name) {
                    continue;
                }
                let mut next = chain.clone();
                next.push(name.clone());
                seen.insert(name, next.clone());
                stack.push((dep.clone(), next));
            }
        }
        seen
    }
}

#[test]
fn crates_never_reach_across_the_design() {
    let g = graph();
    let mut crossings = Vec::new();
    for (from, forbidden) in FORBIDDEN_CRATE_DEPS {
        let reach = g.reachable(from);
        for bad in *forbidden {
            if let Some(chain) = reach.get(*bad) {
                crossings.push(format!("{from} links {bad}: {}", chain.join(" -> ")));
            }
        }
    }
    let ours: BTreeSet<&str> = g.workspace.iter().map(|id| g.names[id].as_str()).collect();
    for leaf in LEAF_CRATES {
        for (name, chain) in g.reachable(leaf) {
            if ours.contains(name.as_str()) {
                crossings.push(format!("{leaf} must depend on no crate of ours: {}", chain.join(" -> ")));
            }
        }
    }
    assert!(crossings.is_empty(), "design boundaries crossed:\n{}", crossings.join("\n"));
}

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path).expect("read dir").map(|e| e.expect("dir entry").path()).collect();
        entries.sort();
        for entry in entries {
            rust_files(&entry, out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_path_buf());
    }
}

/// `backend::` as a path segment in code (comments stripped), e.g. `use crate::backend::StepBatch`.
fn names_backend(line: &str) -> bool {
    let code = line.split("//").next().unwrap_or("");
    code.match_indices("backend::").any(|(at, _)| {
        let before = code[..at].chars().next_back();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

#[test]
fn planners_never_name_a_backend() {
    let root = peregrine_testkit::repo_root();
    let mut files = Vec::new();
    for rel in PLANNER_PATHS {
        let path = root.join(rel);
        assert!(path.exists(), "{rel} is gone: update PLANNER_PATHS in testkit/tests/boundaries.rs to where it moved");
        rust_files(&path, &mut files);
    }
    let mut crossings = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("read source");
        for (i, line) in text.lines().enumerate() {
            if names_backend(line) {
                let rel = file.strip_prefix(&root).unwrap_or(file).display().to_string();
                crossings.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(crossings.is_empty(), "the step planners import a backend (move the shared types below both):\n{}", crossings.join("\n"));
}

#[test]
fn backend_path_detection() {
    assert!(names_backend("use crate::backend::{SeqChunk, StepBatch};"));
    assert!(names_backend("    use super::super::backend::cpu::Cpu;"));
    assert!(!names_backend("//! see [`crate::backend::cpu`]"));
    assert!(!names_backend("let x = 1; // backend::Foo in a comment"));
    assert!(!names_backend("use crate::plan::StepBatch;"));
    assert!(!names_backend("use crate::my_backend::X;"));
}

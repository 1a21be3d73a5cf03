//! Where the tests find what they read: the reference fixtures (in the repository, under
//! `tests/fixtures/`) and the test model (downloaded once by `make model`). Every crate's tests use
//! these two functions, so there is one rule for each.
//!
//! Test support only: a missing prerequisite panics with what to run, so the test fails loudly.

use std::path::PathBuf;

/// The workspace root (this crate sits one level below it).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `PEREGRINE_FIXTURES` when set (e.g. a copy of the fixtures on a GPU machine without the
/// repository), else the repository's `tests/fixtures/`.
pub fn fixtures_dir() -> PathBuf {
    let dir = std::env::var_os("PEREGRINE_FIXTURES").map(PathBuf::from).unwrap_or_else(|| repo_root().join("tests/fixtures"));
    if !dir.join("smollm2/reference.json").is_file() {
        panic!(
            "fixtures not found in {}: they ship in the repository under tests/fixtures/; unset PEREGRINE_FIXTURES or point it at a copy",
            dir.display()
        );
    }
    dir
}

/// `PEREGRINE_TEST_MODEL` when set, else the SmolLM2 GGUF that `make model` caches in
/// `~/.cache/peregrine/`.
pub fn test_model() -> PathBuf {
    let path = match std::env::var_os("PEREGRINE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cache/peregrine/SmolLM2-135M-Instruct.Q4_1.gguf"),
            None => panic!("neither PEREGRINE_TEST_MODEL nor HOME is set: run `make model` and set PEREGRINE_TEST_MODEL"),
        },
    };
    if !path.is_file() {
        panic!("test model not found at {}: run `make model` (or set PEREGRINE_TEST_MODEL)", path.display());
    }
    path
}

/// `PEREGRINE_TEST_ENCODER` when set, else the all-MiniLM-L6-v2 folder that `make model`
/// (`scripts/fetch-encoder.sh`) caches in `~/.cache/peregrine/`.
pub fn test_encoder() -> PathBuf {
    let path = match std::env::var_os("PEREGRINE_TEST_ENCODER") {
        Some(p) => PathBuf::from(p),
        None => match std::env::var_os("HOME") {
            Some(home) => PathBuf::from(home).join(".cache/peregrine/all-MiniLM-L6-v2"),
            None => panic!("neither PEREGRINE_TEST_ENCODER nor HOME is set: run `make model` and set PEREGRINE_TEST_ENCODER"),
        },
    };
    if !path.join("model.safetensors").is_file() {
        panic!("test encoder not found at {}: run `make model` (or scripts/fetch-encoder.sh, or set PEREGRINE_TEST_ENCODER)", path.display());
    }
    path
}

/// The sequence-classification fixture `head` (`three-labels` or `cross-encoder`, under
/// `minilm/classifier/`) as a model folder in `dir`: the fixture's `config.json` and head, the test
/// encoder's tokenizer, its body linked in, and a safetensors index that maps the body's tensors to
/// the body file and the head's to the head file (the fixtures ship only the head, 2 KB, not a
/// second 90 MB body). Returns the fixture folder (its `reference.json` holds the logits).
pub fn assemble_classifier(head: &str, dir: &std::path::Path) -> PathBuf {
    let fixture = fixtures_dir().join("minilm/classifier").join(head);
    let body = test_encoder();
    let copy = |from: PathBuf, to: &str| {
        if let Err(e) = std::fs::copy(&from, dir.join(to)) {
            panic!("copy {} into {}: {e}", from.display(), dir.display());
        }
    };
    copy(fixture.join("config.json"), "config.json");
    copy(body.join("tokenizer.json"), "tokenizer.json");
    copy(fixture.join("head.safetensors"), "head.safetensors");
    if let Err(e) = std::os::unix::fs::symlink(body.join("model.safetensors"), dir.join("body.safetensors")) {
        panic!("link the encoder body into {}: {e}", dir.display());
    }
    let bytes = std::fs::read(body.join("model.safetensors")).unwrap_or_else(|e| panic!("read the encoder body: {e}"));
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap_or_else(|e| panic!("the encoder body's header: {e}"));
    let mut map = serde_json::Map::new();
    for name in meta.tensors().keys() {
        map.insert(name.clone(), "body.safetensors".into());
    }
    for name in ["classifier.weight", "classifier.bias"] {
        map.insert(name.into(), "head.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    if let Err(e) = std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()) {
        panic!("write the safetensors index: {e}");
    }
    fixture
}

/// `sha256:` + the hex digest of `files` in `dir` read one after the other, as coreutils computes it
/// (`cat FILE... | sha256sum`): a reference for digests the engine computes itself (adapters'
/// content digests), from an implementation independent of ours.
pub fn sha256sum_of_files(dir: &std::path::Path, files: &[&str]) -> String {
    let script = format!("cat {} | sha256sum", files.join(" "));
    let out = match std::process::Command::new("sh").arg("-c").arg(&script).current_dir(dir).output() {
        Ok(out) if out.status.success() => out,
        Ok(out) => panic!("`{script}` in {} failed: {}", dir.display(), String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("running `{script}` (needs sh and coreutils' sha256sum): {e}"),
    };
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().next() {
        Some(hex) if hex.len() == 64 => format!("sha256:{hex}"),
        _ => panic!("unexpected sha256sum output {text:?}"),
    }
}

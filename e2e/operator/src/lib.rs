//! Helpers shared by the tests in `tests/`: finding the agent binary, the test model and the
//! fixtures, and running `peregrine-agent serve` processes on loopback that are killed on drop.
//! (`tests/kind.rs` runs against a real cluster and needs none of this.)
//!
//! Test support only: a missing prerequisite panics with what to run, so the test fails loudly.
// This library exists only for the tests in `tests/`; a panic here is a test failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The name the agents serve the base model under.
pub const MODEL: &str = "smollm2";

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `PEREGRINE_AGENT_BIN`, else `<target>/debug/peregrine-agent`.
pub fn agent_bin() -> PathBuf {
    let path = std::env::var_os("PEREGRINE_AGENT_BIN").map(PathBuf::from).unwrap_or_else(|| {
        // Cargo does not build another package's binaries for a test. `cargo test --workspace`
        // (`make test`) builds it for the agent's own tests, before running any test.
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"));
        target.join("debug/peregrine-agent")
    });
    assert!(
        path.is_file(),
        "peregrine-agent not found at {}: run `cargo test --workspace` (`make test`) or `cargo build -p peregrine-agent`, or set PEREGRINE_AGENT_BIN",
        path.display()
    );
    path
}

/// The test model and the fixtures are found one way for the whole workspace (`peregrine-testkit`).
pub use peregrine_testkit::{fixtures_dir, test_model as model_path};

/// A running `peregrine-agent serve` on loopback; killed when dropped, pass or fail.
pub struct Agent {
    child: Child,
    /// Root URL, e.g. `http://127.0.0.1:41234`.
    pub url: String,
}

impl Agent {
    /// Starts an agent on SmolLM2 (CPU, one thread, served as [`MODEL`]) with `extra` flags and
    /// waits until `/ready` answers.
    pub async fn start(extra: &[&str]) -> Agent {
        let port = TcpListener::bind("127.0.0.1:0").expect("bind a free port").local_addr().expect("local addr").port();
        let child = Command::new(agent_bin())
            .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string(), "--served-model-name", MODEL, "--threads", "1", "--num-kv-blocks", "128"])
            .arg("--model")
            .arg(model_path())
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn peregrine-agent");
        let mut agent = Agent { child, url: format!("http://127.0.0.1:{port}") };
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if let Ok(r) = http.get(format!("{}/ready", agent.url)).send().await {
                if r.status().is_success() {
                    return agent;
                }
            }
            if let Ok(Some(status)) = agent.child.try_wait() {
                panic!("agent {extra:?} exited before it was ready: {status}");
            }
            assert!(started.elapsed() < Duration::from_secs(240), "agent {extra:?} not ready after 240 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `host:port`, the way a pod address is written.
    pub fn address(&self) -> &str {
        self.url.trim_start_matches("http://")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

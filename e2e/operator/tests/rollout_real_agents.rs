//! The regression runner against real `peregrine-agent serve` processes with SmolLM2 (CPU), through
//! the real HTTP API: a canary with another `--max-num-seqs` must pass against the stable agent, and
//! a canary whose `--max-model-len` is too short for the suite must fail.
//!
//! Needs the agent binary (`make test` builds it: `cargo build -p peregrine-agent`; or `PEREGRINE_AGENT_BIN`) and the test
//! model (`make model`; or `PEREGRINE_TEST_MODEL`).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use peregrine_crds::{ChatMessage, Expectation, ExpectationKind, GreedySampling, RegressionCase, RegressionThresholds};
use peregrine_operator::regression::{run_suite, OpenAiClient, SuiteTarget};

const MODEL: &str = "smollm2";

fn agent_bin() -> PathBuf {
    let path = std::env::var_os("PEREGRINE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // Cargo does not build another package's binaries for a test: `make test` builds the
            // agent first, into the workspace's target directory.
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target"));
            target.join("debug/peregrine-agent")
        });
    assert!(path.is_file(), "peregrine-agent not found at {}: run `cargo build -p peregrine-agent` (`make test` does) or set PEREGRINE_AGENT_BIN", path.display());
    path
}

fn model_path() -> PathBuf {
    let path = std::env::var_os("PEREGRINE_TEST_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/peregrine/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    assert!(path.is_file(), "test model not found at {}: run `make model`", path.display());
    path
}

/// A running agent; killed when dropped.
struct Agent {
    child: Child,
    url: String,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn start_agent(extra: &[&str]) -> Agent {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
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
    let agent = Agent { child, url: format!("http://127.0.0.1:{port}") };
    let http = reqwest::Client::new();
    let started = Instant::now();
    loop {
        if let Ok(r) = http.get(format!("{}/ready", agent.url)).send().await {
            if r.status().is_success() {
                return agent;
            }
        }
        assert!(started.elapsed() < Duration::from_secs(240), "agent {extra:?} not ready after 240 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn suite() -> Vec<RegressionCase> {
    let same = |name: &str, prompt: &str| RegressionCase {
        name: name.into(),
        prompt: Some(prompt.into()),
        sampling: GreedySampling { max_tokens: 16, ..Default::default() },
        expect: Expectation { kind: ExpectationKind::SameAsStable, value: None, threshold: None },
        ..Default::default()
    };
    vec![
        same("capital", "The capital of France is"),
        same("count", "1, 2, 3, 4,"),
        same("story", "Once upon a time, in a small village by the sea, there lived an old fisherman who"),
        RegressionCase {
            name: "chat".into(),
            messages: vec![ChatMessage { role: "user".into(), content: "What is the capital of France?".into() }],
            sampling: GreedySampling { max_tokens: 16, ..Default::default() },
            expect: Expectation { kind: ExpectationKind::Contains, value: Some("Paris".into()), threshold: None },
            ..Default::default()
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canary_with_other_max_num_seqs_passes_and_a_truncated_context_fails() {
    let stable = start_agent(&["--max-num-seqs", "8"]).await;
    let good = start_agent(&["--max-num-seqs", "2"]).await;
    let client = OpenAiClient::new(Duration::from_secs(120)).unwrap();
    // Two agents share two cores here: latency is not what this test is about.
    let thresholds = RegressionThresholds { max_latency_factor: 100.0, ..Default::default() };
    let target = |canary: &str| SuiteTarget { canary: canary.into(), stable: Some(stable.url.clone()), model: MODEL.into(), adapters: vec![] };

    let report = run_suite(&client, &target(&good.url), &suite(), &thresholds).await.unwrap();
    assert!(report.passed, "{}: {:?}", report.message, report.cases);
    assert_eq!(report.pass_rate, 1.0);
    assert!(report.cases.iter().filter(|c| c.name != "chat").all(|c| c.verdict.agreement == Some(1.0)));
    let latency = report.latency.clone();
    assert!(latency.canary_ttft_p95_seconds.unwrap() > 0.0 && latency.stable_tpot_p95_seconds.unwrap() > 0.0, "{latency:?}");
    drop(good);

    // The story prompt plus its output does not fit in 24 tokens: the canary refuses it.
    let short = start_agent(&["--max-num-seqs", "8", "--max-model-len", "24"]).await;
    let report = run_suite(&client, &target(&short.url), &suite(), &thresholds).await.unwrap();
    assert!(!report.passed, "{}", report.message);
    let story = report.cases.iter().find(|c| c.name == "story").unwrap();
    assert!(!story.verdict.passed && story.error, "{story:?}");
    assert!(report.errors >= 1 && report.message.contains("failed"), "{}", report.message);
}

//! The regression runner against real `peregrine-agent serve` processes with SmolLM2 (CPU), through
//! the real HTTP API: a canary with another `--max-num-seqs` must pass against the stable agent, and
//! a canary whose `--max-model-len` is too short for the suite must fail.
//!
//! Needs the agent binary (`cargo test --workspace` builds it, as `make test` does; or `PEREGRINE_AGENT_BIN`) and the test
//! model (`make model`; or `PEREGRINE_TEST_MODEL`).

use std::time::Duration;

use peregrine_crds::{ChatMessage, Expectation, ExpectationKind, GreedySampling, RegressionCase, RegressionThresholds};
use peregrine_e2e_operator::{Agent, MODEL};
use peregrine_operator::regression::{run_suite, OpenAiClient, SuiteTarget};

fn suite() -> Vec<RegressionCase> {
    let same = |name: &str, prompt: &str| RegressionCase {
        name: name.into(),
        prompt: Some(prompt.into()),
        sampling: GreedySampling { max_tokens: 16, ..Default::default() },
        expect: Expectation { kind: ExpectationKind::SameAsStable, value: None, threshold: None, ..Default::default() },
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
            expect: Expectation { kind: ExpectationKind::Contains, value: Some("Paris".into()), threshold: None, ..Default::default() },
            ..Default::default()
        },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canary_with_other_max_num_seqs_passes_and_a_truncated_context_fails() {
    let stable = Agent::start(&["--max-num-seqs", "8"]).await;
    let good = Agent::start(&["--max-num-seqs", "2"]).await;
    let client = OpenAiClient::new(Duration::from_secs(120)).unwrap();
    // Two agents share two cores here: latency is not what this test is about.
    let thresholds = RegressionThresholds { max_latency_factor: 100.0, ..Default::default() };
    let target = |canary: &str| SuiteTarget { canary: canary.into(), stable: Some(stable.url.clone()), model: MODEL.into(), adapters: vec![], task: Default::default() };

    let report = run_suite(&client, &target(&good.url), &suite(), &thresholds).await.unwrap();
    assert!(report.passed, "{}: {:?}", report.message, report.cases);
    assert_eq!(report.pass_rate, 1.0);
    assert!(report.cases.iter().filter(|c| c.name != "chat").all(|c| c.verdict.agreement == Some(1.0)));
    let latency = report.latency.clone();
    assert!(latency.canary_ttft_p95_seconds.unwrap() > 0.0 && latency.stable_tpot_p95_seconds.unwrap() > 0.0, "{latency:?}");
    drop(good);

    // The story prompt plus its output does not fit in 24 tokens: the canary refuses it.
    let short = Agent::start(&["--max-num-seqs", "8", "--max-model-len", "24"]).await;
    let report = run_suite(&client, &target(&short.url), &suite(), &thresholds).await.unwrap();
    assert!(!report.passed, "{}", report.message);
    let story = report.cases.iter().find(|c| c.name == "story").unwrap();
    assert!(!story.verdict.passed && story.error, "{story:?}");
    assert!(report.errors >= 1 && report.message.contains("failed"), "{}", report.message);
}

//! The regression runner against fake OpenAI servers speaking the agent's HTTP API (streamed
//! completions and chat completions with logprobs), and the `regress` subcommand end to end.
//!
//! The fakes answer deterministically per (model, prompt), like greedy decoding: a "stable" server,
//! an identical "canary" that must pass, and canaries that must fail (another model, an adapter forced
//! as the default, slow tokens, errors).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use peregrine_crds::{ChatMessage, Expectation, ExpectationKind, GreedySampling, RegressionCase, RegressionThresholds};
use peregrine_operator::regression::runner::RunError;
use peregrine_operator::regression::{run_suite, OpenAiClient, SuiteTarget};
use serde_json::{json, Value};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// The reference model.
    Base,
    /// Another model: agrees on the first token only.
    OtherModel,
    /// Every request is answered by the `sql` adapter, whatever model it names.
    AdapterAsDefault,
    /// Answers with HTTP 500.
    Broken,
}

#[derive(Clone)]
struct Fake {
    mode: Mode,
    token_delay: Duration,
    requests: Arc<Mutex<Vec<Value>>>,
}

/// Greedy output of the reference model for a prompt.
fn base_tokens(prompt: &str) -> Vec<String> {
    if prompt.contains("France") {
        [" Paris", ".", " It", " is", " the", " capital", "."].map(String::from).to_vec()
    } else {
        prompt.split_whitespace().rev().map(|w| format!(" {w}")).chain([" end".to_string()]).collect()
    }
}

fn tokens_for(mode: Mode, model: &str, prompt: &str, max_tokens: usize) -> Vec<String> {
    let adapter = model == "sql" || mode == Mode::AdapterAsDefault;
    let mut tokens = if adapter { [" SELECT", " *", " FROM", " t", ";"].map(String::from).to_vec() } else { base_tokens(prompt) };
    if mode == Mode::OtherModel {
        for t in tokens.iter_mut().skip(1) {
            *t = format!("{t}x");
        }
    }
    tokens.truncate(max_tokens);
    tokens
}

async fn completions(State(fake): State<Fake>, Json(body): Json<Value>) -> Response {
    generate(fake, body, false).await
}

async fn chat(State(fake): State<Fake>, Json(body): Json<Value>) -> Response {
    generate(fake, body, true).await
}

async fn generate(fake: Fake, body: Value, chat: bool) -> Response {
    fake.requests.lock().unwrap().push(body.clone());
    if fake.mode == Mode::Broken {
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "engine failed", "type": "server_error"}}))).into_response();
    }
    let model = body["model"].as_str().unwrap_or_default().to_string();
    let prompt = if chat {
        body["messages"].as_array().unwrap().iter().map(|m| m["content"].as_str().unwrap_or_default()).collect::<Vec<_>>().join(" ")
    } else {
        body["prompt"].as_str().unwrap_or_default().to_string()
    };
    let max_tokens = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    let tokens = tokens_for(fake.mode, &model, &prompt, max_tokens);
    let n = tokens.len();
    let delay = fake.token_delay;
    let events = futures::stream::unfold(0usize, move |i| {
        let tokens = tokens.clone();
        async move {
            if i > n + 1 {
                return None;
            }
            let data = if i < n {
                tokio::time::sleep(delay).await;
                let finish = if i + 1 == n { json!("length") } else { Value::Null };
                if chat {
                    json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [{"index": 0,
                        "delta": {"content": tokens[i]}, "logprobs": {"content": [{"token": tokens[i], "logprob": -0.1, "bytes": null, "top_logprobs": []}]},
                        "finish_reason": finish}]})
                    .to_string()
                } else {
                    json!({"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [{"index": 0,
                        "text": tokens[i], "logprobs": {"tokens": [tokens[i]], "token_logprobs": [-0.1], "top_logprobs": [{}], "text_offset": [0]},
                        "finish_reason": finish}]})
                    .to_string()
                }
            } else if i == n {
                json!({"id": "c", "object": "x", "created": 0, "model": "m", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}}).to_string()
            } else {
                "[DONE]".to_string()
            };
            Some((Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))), i + 1))
        }
    });
    Response::builder().header(header::CONTENT_TYPE, "text/event-stream").body(Body::from_stream(events)).unwrap()
}

/// Starts a fake on a free port; returns its root URL and the requests it will record.
async fn start(mode: Mode, token_delay: Duration) -> (String, Arc<Mutex<Vec<Value>>>) {
    let requests = Arc::new(Mutex::new(Vec::new()));
    let fake = Fake { mode, token_delay, requests: requests.clone() };
    let app = Router::new().route("/v1/completions", post(completions)).route("/v1/chat/completions", post(chat)).with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), requests)
}

fn case(name: &str, prompt: &str, kind: ExpectationKind, value: Option<&str>) -> RegressionCase {
    RegressionCase {
        name: name.into(),
        prompt: Some(prompt.into()),
        sampling: GreedySampling { max_tokens: 8, ..Default::default() },
        expect: Expectation { kind, value: value.map(Into::into), ..Default::default() },
        ..Default::default()
    }
}

fn suite() -> Vec<RegressionCase> {
    vec![
        case("exact", "The capital of France is", ExpectationKind::Exact, Some(" Paris. It is the capital.")),
        case("contains", "Where is the capital of France?", ExpectationKind::Contains, Some("Paris")),
        case("regex", "one two three", ExpectationKind::Regex, Some(r"^ three two one end$")),
        case("same", "alpha beta gamma delta", ExpectationKind::SameAsStable, None),
        RegressionCase {
            name: "chat".into(),
            messages: vec![ChatMessage { role: "user".into(), content: "hello there".into() }],
            sampling: GreedySampling { max_tokens: 8, stop: vec!["\n".into()], seed: Some(7) },
            expect: Expectation { kind: ExpectationKind::SameAsStable, ..Default::default() },
            ..Default::default()
        },
    ]
}

fn client() -> OpenAiClient {
    OpenAiClient::new(Duration::from_secs(30)).unwrap()
}

fn target(canary: &str, stable: &str, adapters: &[&str]) -> SuiteTarget {
    SuiteTarget {
        canary: canary.into(),
        stable: Some(stable.into()),
        model: "smollm2".into(),
        adapters: adapters.iter().map(|s| s.to_string()).collect(),
        task: Default::default(),
    }
}

#[tokio::test]
async fn identical_canary_passes_every_kind_of_case_and_adapters() {
    let (stable, _) = start(Mode::Base, Duration::from_millis(2)).await;
    let (canary, requests) = start(Mode::Base, Duration::from_millis(2)).await;
    let report = run_suite(&client(), &target(&canary, &stable, &["sql"]), &suite(), &RegressionThresholds::default()).await.unwrap();
    assert!(report.passed, "{}: {:?}", report.message, report.cases);
    assert_eq!(report.cases.len(), 5 + 5, "every case, and every case again through the adapter");
    assert_eq!(report.pass_rate, 1.0);
    assert_eq!(report.errors, 0);
    assert!(report.cases.iter().any(|c| c.name == "same@sql"));
    let step = report.to_step_result(1);
    assert_eq!((step.step, step.cases, step.failed_cases, step.mismatches.len()), (1, 10, 0, 0));
    let latency = step.latency.unwrap();
    assert!(latency.canary_ttft_p95_seconds.is_some() && latency.stable_tpot_p95_seconds.is_some());
    assert!(latency.latency_factor.unwrap() <= 1.5, "{latency:?}");

    // What went over the wire: greedy, streamed, with the sampled tokens asked for.
    let requests = requests.lock().unwrap();
    let completion = requests.iter().find(|r| r["prompt"] == "one two three").unwrap();
    assert_eq!(completion["temperature"], 0.0);
    assert_eq!(completion["stream"], true);
    assert_eq!(completion["logprobs"], 0);
    assert_eq!(completion["max_tokens"], 8);
    assert_eq!(completion["model"], "smollm2");
    let chat = requests.iter().find(|r| r.get("messages").is_some() && r["model"] == "smollm2").unwrap();
    assert_eq!(chat["logprobs"], true);
    assert_eq!(chat["stop"], json!(["\n"]));
    assert_eq!(chat["seed"], 7);
    assert!(requests.iter().any(|r| r["model"] == "sql"), "adapter cases name the adapter as the model");
}

#[tokio::test]
async fn another_model_fails_with_mismatch_examples() {
    let (stable, _) = start(Mode::Base, Duration::ZERO).await;
    let (canary, _) = start(Mode::OtherModel, Duration::ZERO).await;
    let report = run_suite(&client(), &target(&canary, &stable, &[]), &suite(), &RegressionThresholds::default()).await.unwrap();
    assert!(!report.passed);
    let failed: Vec<&str> = report.cases.iter().filter(|c| !c.verdict.passed).map(|c| c.name.as_str()).collect();
    // "contains Paris" still holds for " Parisx"; the rest differ.
    assert_eq!(failed, ["exact", "regex", "same", "chat"]);
    let same = report.cases.iter().find(|c| c.name == "same").unwrap();
    assert_eq!(same.verdict.agreement, Some(0.2), "1 of 5 leading tokens agree");
    let step = report.to_step_result(0);
    assert_eq!(step.failed_cases, 4);
    assert_eq!(step.mismatches[0].case, "exact");
    assert_eq!(step.mismatches[0].expected, " Paris. It is the capital.");
    assert!(step.mismatches[0].got.starts_with(" Paris.x"), "{:?}", step.mismatches[0]);

    // A lenient suite-level threshold and per-case threshold let the same run pass.
    let mut lenient = suite();
    lenient.retain(|c| c.expect.kind == ExpectationKind::SameAsStable);
    for c in &mut lenient {
        c.expect.threshold = Some(0.2);
    }
    let report = run_suite(&client(), &target(&canary, &stable, &[]), &lenient, &RegressionThresholds::default()).await.unwrap();
    assert!(report.passed, "{}", report.message);
}

#[tokio::test]
async fn adapter_forced_as_default_fails() {
    let (stable, _) = start(Mode::Base, Duration::ZERO).await;
    let (canary, _) = start(Mode::AdapterAsDefault, Duration::ZERO).await;
    let report = run_suite(&client(), &target(&canary, &stable, &["sql"]), &suite(), &RegressionThresholds::default()).await.unwrap();
    assert!(!report.passed);
    // Base cases fail; the adapter's own cases agree (the adapter is still the adapter).
    assert!(report.cases.iter().filter(|c| !c.name.contains('@')).all(|c| !c.verdict.passed));
    assert!(report.cases.iter().filter(|c| c.name.contains('@')).all(|c| c.verdict.passed));
    assert_eq!(report.pass_rate, 0.5);
}

#[tokio::test]
async fn slow_canary_fails_the_latency_gate() {
    let (stable, _) = start(Mode::Base, Duration::from_millis(1)).await;
    let (canary, _) = start(Mode::Base, Duration::from_millis(60)).await;
    let report = run_suite(&client(), &target(&canary, &stable, &[]), &suite(), &RegressionThresholds::default()).await.unwrap();
    assert!(!report.passed);
    assert_eq!(report.pass_rate, 1.0, "outputs agree; only latency fails");
    let factor = report.latency.latency_factor.unwrap();
    assert!(factor > 1.5, "{factor}");
    assert!(report.message.contains("latency"), "{}", report.message);
    // A generous factor lets it through.
    let lax = RegressionThresholds { max_latency_factor: 1000.0, ..Default::default() };
    let report = run_suite(&client(), &target(&canary, &stable, &[]), &suite(), &lax).await.unwrap();
    assert!(report.passed, "{}", report.message);
}

#[tokio::test]
async fn canary_errors_fail_and_a_missing_reference_is_not_the_canarys_fault() {
    let (stable, _) = start(Mode::Base, Duration::ZERO).await;
    let (broken, _) = start(Mode::Broken, Duration::ZERO).await;
    let lax = RegressionThresholds { min_agreement_rate: 0.0, ..Default::default() };
    let report = run_suite(&client(), &target(&broken, &stable, &[]), &suite(), &lax).await.unwrap();
    assert!(!report.passed, "errors fail a run whatever the pass rate");
    assert_eq!(report.errors, 5);
    assert!(report.cases[0].verdict.reason.contains("HTTP 500"), "{:?}", report.cases[0]);

    let err = run_suite(&client(), &target(&stable, &broken, &[]), &suite(), &lax).await.unwrap_err();
    assert!(matches!(err, RunError::Stable { .. }), "{err}");
    let no_ref = SuiteTarget { stable: None, ..target(&stable, &stable, &[]) };
    assert!(matches!(run_suite(&client(), &no_ref, &suite(), &lax).await, Err(RunError::NoStable)));
}

#[tokio::test]
async fn regress_subcommand_exit_status() {
    let (stable, _) = start(Mode::Base, Duration::ZERO).await;
    let (good, _) = start(Mode::Base, Duration::ZERO).await;
    let (bad, _) = start(Mode::OtherModel, Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let suite_path = dir.path().join("suite.yaml");
    std::fs::write(
        &suite_path,
        "suite:\n  cases:\n  - {name: capital, prompt: The capital of France is, sampling: {maxTokens: 4}, expect: {type: contains, value: Paris}}\n  - {name: same, prompt: a b c, expect: {type: sameAsStable}}\nthresholds: {maxLatencyFactor: 100}\n",
    )
    .unwrap();
    let bin = env!("CARGO_BIN_EXE_peregrine-operator");
    let run = |canary: String, json: bool| {
        let suite_path = suite_path.clone();
        let stable = stable.clone();
        async move {
            tokio::process::Command::new(bin)
                .args(["regress", "--canary", &canary, "--stable", &stable, "--model", "smollm2", "--suite"])
                .arg(&suite_path)
                .args(if json { vec!["--json"] } else { vec![] })
                .output()
                .await
                .unwrap()
        }
    };
    let ok = run(good, false).await;
    assert_eq!(ok.status.code(), Some(0), "{}", String::from_utf8_lossy(&ok.stdout));
    assert!(String::from_utf8_lossy(&ok.stdout).contains("PASSED: 2/2 cases passed"));
    let failed = run(bad, true).await;
    assert_eq!(failed.status.code(), Some(1));
    let result: Value = serde_json::from_slice(&failed.stdout).unwrap();
    assert_eq!(result["passed"], false);
    assert_eq!(result["mismatches"][0]["case"], "same");
    let missing = tokio::process::Command::new(bin).args(["regress", "--canary", "http://127.0.0.1:1", "--model", "m", "--suite", "/nonexistent.yaml"]).output().await.unwrap();
    assert_eq!(missing.status.code(), Some(2));
}

//! vLLM's metric contract as a gateway reads it: `/metrics` parsed by prometheus_client's own
//! OpenMetrics parser (the reference implementation, run in PEREGRINE_PYTHON's venv) and checked
//! name by name against vLLM's types, labels and buckets (vLLM v0.10, `vllm/v1/metrics/loggers.py`).

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use peregrine_api::metric_names::vllm as names;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::fake::FakeBackend;
use super::{call, post, state_with};
use crate::serve::auth::KeyStore;
use crate::serve::backend::EngineShape;
use crate::serve::state::{AppState, ServerConfig};

fn python() -> String {
    std::env::var("PEREGRINE_PYTHON").unwrap_or_else(|_| {
        panic!("PEREGRINE_PYTHON is not set: run `make python-deps` (or `make test`), which installs prometheus_client, and export the python it prints")
    })
}

/// The families of one scrape, as prometheus_client parsed them.
async fn scrape(state: &Arc<AppState<FakeBackend>>) -> Vec<Value> {
    let (status, _, body) = call(crate::serve::routes::router(state.clone()), Method::GET, "/metrics", Body::empty(), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openmetrics_to_json.py");
    let mut child = Command::new(python())
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the OpenMetrics parser");
    child.stdin.take().unwrap().write_all(&body).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "the reference parser refused the exposition: {}\n{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&body));
    serde_json::from_slice::<Value>(&out.stdout).unwrap().as_array().unwrap().clone()
}

fn family<'a>(families: &'a [Value], name: &str) -> &'a Value {
    families.iter().find(|f| f["name"] == name).unwrap_or_else(|| panic!("{name} is not exposed"))
}

/// The one sample named `sample` of family `name` (panics if there are several).
fn only_sample<'a>(families: &'a [Value], name: &str, sample: &str) -> &'a Value {
    let found: Vec<&Value> = family(families, name)["samples"].as_array().unwrap().iter().filter(|s| s["name"] == sample).collect();
    assert_eq!(found.len(), 1, "{sample}: {found:?}");
    found[0]
}

fn model_labels() -> Value {
    json!({"model_name": "fake-model", "engine": "0"})
}

fn check_histogram(families: &[Value], name: &str, buckets: &[f64], count: f64) {
    let f = family(families, name);
    assert_eq!(f["type"], "histogram", "{name}");
    let bounds: Vec<String> = f["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == format!("{name}_bucket"))
        .map(|s| {
            let mut labels = s["labels"].as_object().unwrap().clone();
            let le = labels.remove("le").unwrap();
            assert_eq!(Value::Object(labels), model_labels(), "{name}");
            le.as_str().unwrap().to_string()
        })
        .collect();
    let mut want: Vec<String> = buckets.iter().map(|b| format!("{b:?}")).collect();
    want.push("+Inf".to_string());
    let bounds: Vec<f64> = bounds.iter().map(|b| b.parse::<f64>().unwrap()).collect();
    let want: Vec<f64> = want.iter().map(|b| b.parse::<f64>().unwrap()).collect();
    assert_eq!(bounds, want, "{name}: vLLM's bucket boundaries");
    assert_eq!(only_sample(families, name, &format!("{name}_count"))["value"], count, "{name}");
}

fn check_scalar(families: &[Value], name: &str, kind: &str, sample: &str, labels: Value) -> f64 {
    let f = family(families, name);
    assert_eq!(f["type"], kind, "{name}");
    let s = only_sample(families, name, sample);
    assert_eq!(s["labels"], labels, "{name}");
    s["value"].as_f64().unwrap()
}

fn shaped(delay: Duration) -> Arc<AppState<FakeBackend>> {
    let mut backend = FakeBackend::new(delay);
    backend.shape = EngineShape { kv_block_size: 16, num_kv_blocks: 100, max_loras: Some(4) };
    backend.cached_prompt_tokens = 2;
    state_with(backend, KeyStore::default(), ServerConfig::default())
}

#[tokio::test]
async fn vllm_series_have_vllms_names_types_labels_and_buckets() {
    let state = shaped(Duration::ZERO);
    let (status, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "abcd", "max_tokens": 3})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let fams = scrape(&state).await;

    check_histogram(&fams, names::TIME_TO_FIRST_TOKEN_SECONDS, names::TIME_TO_FIRST_TOKEN_BUCKETS, 1.0);
    // Three tokens: two intervals between them.
    check_histogram(&fams, names::TIME_PER_OUTPUT_TOKEN_SECONDS, names::TIME_PER_OUTPUT_TOKEN_BUCKETS, 2.0);
    check_histogram(&fams, names::E2E_REQUEST_LATENCY_SECONDS, names::REQUEST_LATENCY_BUCKETS, 1.0);
    check_histogram(&fams, names::REQUEST_QUEUE_TIME_SECONDS, names::REQUEST_LATENCY_BUCKETS, 1.0);
    // vLLM's declared boundaries, written out here as read from vLLM, not from our constants.
    assert_eq!(names::TIME_TO_FIRST_TOKEN_BUCKETS.len(), 22);
    assert_eq!(names::TIME_TO_FIRST_TOKEN_BUCKETS.last(), Some(&2560.0));
    assert_eq!(names::TIME_PER_OUTPUT_TOKEN_BUCKETS.first(), Some(&0.01));
    assert_eq!(names::REQUEST_LATENCY_BUCKETS.first(), Some(&0.3));
    assert_eq!(names::REQUEST_LATENCY_BUCKETS.last(), Some(&7680.0));

    // Counters: the family is the base name, the sample `_total`.
    let counter = |base: &str, total: &str| check_scalar(&fams, base, "counter", total, model_labels());
    assert_eq!(counter(names::PROMPT_TOKENS, names::PROMPT_TOKENS_TOTAL), 4.0);
    assert_eq!(counter(names::GENERATION_TOKENS, names::GENERATION_TOKENS_TOTAL), 3.0);
    assert_eq!(counter(names::PREFIX_CACHE_QUERIES, names::PREFIX_CACHE_QUERIES_TOTAL), 4.0);
    assert_eq!(counter(names::PREFIX_CACHE_HITS, names::PREFIX_CACHE_HITS_TOTAL), 2.0);

    let gauge = |name: &str| check_scalar(&fams, name, "gauge", name, model_labels());
    assert_eq!(gauge(names::NUM_REQUESTS_RUNNING), 0.0);
    assert_eq!(gauge(names::NUM_REQUESTS_WAITING), 0.0);
    assert_eq!(gauge(names::KV_CACHE_USAGE_PERC), 0.0);
    assert_eq!(gauge(names::GPU_CACHE_USAGE_PERC), 0.0);

    let info = check_scalar(
        &fams,
        names::CACHE_CONFIG_INFO,
        "gauge",
        names::CACHE_CONFIG_INFO,
        json!({"block_size": "16", "num_gpu_blocks": "100", "engine": "0"}),
    );
    assert_eq!(info, 1.0);
    let lora = check_scalar(
        &fams,
        names::LORA_REQUESTS_INFO,
        "gauge",
        names::LORA_REQUESTS_INFO,
        json!({"max_lora": "4", "running_lora_adapters": "", "waiting_lora_adapters": ""}),
    );
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    assert!(lora > now - 60.0 && lora <= now, "Unix time of the last update: {lora} vs {now}");

    for name in names::GATEWAY_INPUTS {
        family(&fams, name);
    }
}

#[tokio::test]
async fn without_lora_there_is_no_lora_requests_info() {
    let state = state_with(FakeBackend::new(Duration::ZERO), KeyStore::default(), ServerConfig::default());
    let fams = scrape(&state).await;
    assert!(fams.iter().all(|f| f["name"] != names::LORA_REQUESTS_INFO), "vLLM registers it only with LoRA on");
    family(&fams, names::KV_CACHE_USAGE_PERC);
}

/// Opens a streaming completion on `model` and returns its body once the first token arrived.
async fn open_stream(state: &Arc<AppState<FakeBackend>>, model: &str) -> Body {
    let body = json!({"model": model, "prompt": "abcdefghijklmnopqrstuvwxyz", "max_tokens": 26, "stream": true}).to_string();
    let req = Request::post("/v1/completions").header("content-type", "application/json").body(Body::from(body)).unwrap();
    let resp = crate::serve::routes::router(state.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some());
    body
}

/// `(running_lora_adapters, waiting_lora_adapters, value)` of the one current series.
async fn lora_info(state: &Arc<AppState<FakeBackend>>) -> (String, String, f64) {
    let fams = scrape(state).await;
    let samples = family(&fams, names::LORA_REQUESTS_INFO)["samples"].as_array().unwrap().clone();
    assert_eq!(samples.len(), 1, "exactly one current series: {samples:?}");
    let s = &samples[0];
    assert_eq!(s["labels"]["max_lora"], "4");
    let running = s["labels"]["running_lora_adapters"].as_str().unwrap().to_string();
    assert!(!running.contains(' '), "comma-joined without spaces: {running:?}");
    (running, s["labels"]["waiting_lora_adapters"].as_str().unwrap().to_string(), s["value"].as_f64().unwrap())
}

#[tokio::test]
async fn lora_requests_info_follows_load_request_unload() {
    let state = shaped(Duration::from_millis(30));
    for name in ["a1", "a2"] {
        let (status, _, v) = post(&state, "/v1/load_lora_adapter", json!({"lora_name": name, "lora_path": "/adapters/x"})).await;
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    // Loaded but idle adapters are not running anything.
    let (running, waiting, t0) = lora_info(&state).await;
    assert_eq!((running.as_str(), waiting.as_str()), ("", ""));

    let a1 = open_stream(&state, "a1").await;
    let (running, waiting, t1) = lora_info(&state).await;
    assert_eq!((running.as_str(), waiting.as_str()), ("a1", ""));
    assert!(t1 >= t0);

    let a2 = open_stream(&state, "a2").await;
    // A base-model request is never listed.
    let base = open_stream(&state, "fake-model").await;
    assert_eq!(lora_info(&state).await.0, "a1,a2");
    let fams = scrape(&state).await;
    assert_eq!(check_scalar(&fams, names::NUM_REQUESTS_RUNNING, "gauge", names::NUM_REQUESTS_RUNNING, model_labels()), 3.0);

    // Unloading a1 hides it from new requests; the one in flight still runs on it.
    let (status, _, v) = post(&state, "/v1/unload_lora_adapter", json!({"lora_name": "a1"})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, _, _) = post(&state, "/v1/completions", json!({"model": "a1", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(lora_info(&state).await.0, "a1,a2");

    let _ = a1.collect().await.unwrap(); // a1's request runs to its end
    let (running, _, t2) = lora_info(&state).await;
    assert_eq!(running, "a2");
    assert!(t2 >= t1);
    drop(a2); // the client goes away
    drop(base);
    let (running, waiting, t3) = lora_info(&state).await;
    assert_eq!((running.as_str(), waiting.as_str()), ("", ""));
    assert!(t3 >= t2);
    let fams = scrape(&state).await;
    assert_eq!(check_scalar(&fams, names::NUM_REQUESTS_RUNNING, "gauge", names::NUM_REQUESTS_RUNNING, model_labels()), 0.0);
}

#[tokio::test]
async fn every_family_of_metric_names_is_exposed() {
    // What dashboards may name (peregrine_api::metric_names::FAMILIES) is what a scrape has.
    let state = shaped(Duration::ZERO);
    let (status, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "abcd", "max_tokens": 3})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // One refused request, so that the error family has a series.
    let (status, _, _) = post(&state, "/v1/completions", json!({"model": "no-such-model", "prompt": "abcd", "max_tokens": 3})).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let fams = scrape(&state).await;
    let exposed: Vec<&str> = fams.iter().filter_map(|f| f["name"].as_str()).collect();
    let missing: Vec<&&str> = peregrine_api::metric_names::FAMILIES.iter().filter(|name| !exposed.contains(name)).collect();
    assert!(missing.is_empty(), "in metric_names::FAMILIES but not exposed: {missing:?} (exposed: {exposed:?})");
}

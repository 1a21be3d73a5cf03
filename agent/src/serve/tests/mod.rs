//! Server behaviour against a fake backend: routing, validation, SSE framing, auth, rate limits,
//! admission, disconnects and draining. The real-model tests live in `agent/tests/`.

mod fake;
mod tools;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, Method, Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use super::auth::KeyStore;
use super::tenant::Limits;
use super::state::{AppState, ServerConfig};
use fake::FakeBackend;

fn state_with(backend: FakeBackend, keys: KeyStore, config: ServerConfig) -> Arc<AppState<FakeBackend>> {
    let state = Arc::new(AppState::new(Arc::new(backend), keys, config));
    state.lifecycle.set_ready();
    state
}

fn fast() -> Arc<AppState<FakeBackend>> {
    state_with(FakeBackend::new(Duration::ZERO), KeyStore::default(), ServerConfig::default())
}

async fn call(router: Router, method: Method, path: &str, body: impl Into<Body>, headers: &[(&str, &str)]) -> (StatusCode, HeaderMap, Bytes) {
    let mut req = Request::builder().method(method).uri(path).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = router.oneshot(req.body(body.into()).unwrap()).await.unwrap();
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, headers, body)
}

async fn post(state: &Arc<AppState<FakeBackend>>, path: &str, body: Value) -> (StatusCode, HeaderMap, Value) {
    let (s, h, b) = call(super::routes::router(state.clone()), Method::POST, path, body.to_string(), &[]).await;
    let v = serde_json::from_slice(&b).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&b).into_owned()));
    (s, h, v)
}

/// Splits an SSE body into its `data:` payloads, checking the framing byte for byte on the way.
fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "stream must end with [DONE]: {text:?}");
    let frames: Vec<&str> = text.split_terminator("\n\n").collect();
    for f in &frames {
        assert!(f.starts_with("data: ") && !f[6..].contains('\n'), "bad frame {f:?}");
    }
    frames.iter().map(|f| f[6..].to_string()).collect()
}

#[tokio::test]
async fn completion_non_streaming() {
    let state = fast();
    let (status, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "abc", "max_tokens": 2, "logprobs": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["model"], "fake-model");
    assert_eq!(v["choices"][0]["text"], "AB");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["A", "B"]));
    assert_eq!(v["choices"][0]["logprobs"]["token_logprobs"], json!([-0.25, -0.25]));
    assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"], json!([{"A": -0.25}, {"B": -0.25}]));
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"], json!([0, 1]));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(v["usage"]["total_tokens"], 5);

    // Token-id prompt, ends by itself: finish_reason stop. Stop strings are passed to the backend.
    let (status, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": [104, 105], "max_tokens": 10})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], "HI");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (_, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "hello", "stop": ["L"]})).await;
    assert_eq!(v["choices"][0]["text"], "HE");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn chat_non_streaming_with_logprobs() {
    let state = fast();
    let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3,
                      "logprobs": true, "top_logprobs": 2});
    let (status, _, v) = post(&state, "/v1/chat/completions", body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "USE"}));
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let first = &v["choices"][0]["logprobs"]["content"][0];
    assert_eq!(first["token"], "U");
    assert_eq!(first["bytes"], json!([85]));
    assert_eq!(first["top_logprobs"], json!([{"token": "U", "logprob": -0.25, "bytes": [85]}, {"token": "?", "logprob": -2.0, "bytes": [63]}]));
    assert_eq!(v["usage"]["prompt_tokens"], "user:hi|".len());
}

#[tokio::test]
async fn chat_stream_is_byte_exact() {
    let state = fast();
    let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (status, headers, bytes) =
        call(super::routes::router(state.clone()), Method::POST, "/v1/chat/completions", body.to_string(), &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "text/event-stream; charset=utf-8");
    let events = sse_events(&bytes);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    let (id, created) = (first["id"].as_str().unwrap().to_string(), first["created"].as_u64().unwrap());
    let head = format!(r#"{{"id":"{id}","object":"chat.completion.chunk","created":{created},"model":"fake-model","choices":"#);
    let expected = format!(
        "data: {head}[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n\
         data: {head}[{{\"index\":0,\"delta\":{{\"content\":\"U\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n\
         data: {head}[{{\"index\":0,\"delta\":{{\"content\":\"S\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null}}\n\n\
         data: {head}[{{\"index\":0,\"delta\":{{}},\"logprobs\":null,\"finish_reason\":\"length\"}}],\"usage\":null}}\n\n\
         data: {head}[],\"usage\":{{\"prompt_tokens\":8,\"completion_tokens\":2,\"total_tokens\":10,\"prompt_tokens_details\":{{\"cached_tokens\":0}}}}}}\n\n\
         data: [DONE]\n\n"
    );
    assert_eq!(std::str::from_utf8(&bytes).unwrap(), expected);
}

#[tokio::test]
async fn completion_stream_without_usage_has_no_usage_field() {
    let state = fast();
    let body = json!({"model": "fake-model", "prompt": "ab", "max_tokens": 5, "stream": true, "logprobs": 0});
    let (status, _, bytes) = call(super::routes::router(state.clone()), Method::POST, "/v1/completions", body.to_string(), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&bytes);
    assert_eq!(events.len(), 4, "{events:?}"); // A, B, finish, [DONE]
    let chunks: Vec<Value> = events[..3].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert!(c.get("usage").is_none(), "{c}");
    }
    assert_eq!(chunks[0]["choices"][0]["text"], "A");
    assert_eq!(chunks[0]["choices"][0]["logprobs"]["tokens"], json!(["A"]));
    assert_eq!(chunks[1]["choices"][0]["logprobs"]["text_offset"], json!([1]));
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(events[3], "[DONE]");
}

#[tokio::test]
async fn bad_inputs_get_openai_errors_and_server_keeps_serving() {
    let state = state_with(
        FakeBackend::new(Duration::ZERO),
        KeyStore::default(),
        ServerConfig { max_body_bytes: 4096, ..ServerConfig::default() },
    );
    let router = || super::routes::router(state.clone());
    let cases: Vec<(&str, Vec<u8>, StatusCode, &str)> = vec![
        ("/v1/completions", b"{not json".to_vec(), StatusCode::BAD_REQUEST, "invalid_json"),
        ("/v1/completions", b"{\"model\":\"fake-model\",\"prompt\":\"\xc3\x28\"}".to_vec(), StatusCode::BAD_REQUEST, "invalid_json"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","max_tokens":"5"}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "invalid_type"),
        ("/v1/completions", br#"{"model":"fake-model"}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "invalid_type"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","bogus":1}"#.to_vec(), StatusCode::BAD_REQUEST, "unknown_parameter"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","max_tokens":-3}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid_value"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","max_tokens":1000000000000}"#.to_vec(), StatusCode::BAD_REQUEST, "context_length_exceeded"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","max_tokens":64}"#.to_vec(), StatusCode::BAD_REQUEST, "context_length_exceeded"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","temperature":9}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid_value"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":"a","n":17}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid_value"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":""}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid_value"),
        ("/v1/completions", br#"{"model":"fake-model","prompt":[4294967295]}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid_value"),
        ("/v1/completions", br#"{"model":"nope","prompt":"a"}"#.to_vec(), StatusCode::NOT_FOUND, "model_not_found"),
        ("/v1/chat/completions", br#"{"model":"fake-model","messages":[{"role":"wizard","content":"x"}]}"#.to_vec(), StatusCode::UNPROCESSABLE_ENTITY, "invalid_type"),
        ("/v1/chat/completions", br#"{"model":"fake-model","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#.to_vec(), StatusCode::BAD_REQUEST, "invalid_value"),
        ("/v1/completions", format!(r#"{{"model":"fake-model","prompt":"{}"}}"#, "a".repeat(5000)).into_bytes(), StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
        ("/v1/nothing", b"{}".to_vec(), StatusCode::NOT_FOUND, "route_not_found"),
    ];
    for (path, body, want_status, want_code) in cases {
        let (status, _, bytes) = call(router(), Method::POST, path, body.clone(), &[]).await;
        let v: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{path} {:?}: non-JSON error body ({e})", String::from_utf8_lossy(&body)));
        assert_eq!(status, want_status, "{} → {v}", String::from_utf8_lossy(&body));
        assert_eq!(v["error"]["code"], want_code, "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(v["error"]["type"].is_string() && v["error"].get("param").is_some(), "{v}");
        // The server is unaffected: a good request still works.
        let (s, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "ok", "max_tokens": 1})).await;
        assert_eq!(s, StatusCode::OK, "{v}");
    }
    let (status, _, _) = call(router(), Method::GET, "/v1/completions", Body::empty(), &[]).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    // Errors are counted by code.
    let (_, _, metrics) = call(router(), Method::GET, "/metrics", Body::empty(), &[]).await;
    let metrics = String::from_utf8(metrics.to_vec()).unwrap();
    assert!(metrics.contains(r#"peregrine_request_errors_total{code="context_length_exceeded"} 2"#), "{metrics}");
}

#[tokio::test]
async fn adapters_resolve_and_are_listed() {
    let state = fast();
    let (status, _, v) = post(&state, "/v1/completions", json!({"model": "fake-adapter", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], "fake-adapter");
    let (status, _, body) = call(super::routes::router(state.clone()), Method::GET, "/v1/models", Body::empty(), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "list");
    let ids: Vec<&str> = v["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["fake-model", "fake-adapter"]);
    assert_eq!(v["data"][1]["parent"], "fake-model");
    assert_eq!(v["data"][0]["max_model_len"], 64);
    // Metrics carry the adapter's name as the model label.
    let (_, _, m) = call(super::routes::router(state.clone()), Method::GET, "/metrics", Body::empty(), &[]).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    assert!(m.contains(r#"peregrine_request_success_total{model="fake-adapter",finished_reason="length"} 1"#), "{m}");
    assert!(m.contains(r#"peregrine_time_to_first_token_seconds_count{model="fake-adapter"} 1"#), "{m}");
}

#[tokio::test]
async fn api_keys_and_open_probes() {
    let keys = KeyStore::new(&["sk-alpha".into()], None, Limits::default()).unwrap();
    let state = state_with(FakeBackend::new(Duration::ZERO), keys, ServerConfig::default());
    let router = || super::routes::router(state.clone());
    let body = json!({"model": "fake-model", "prompt": "x", "max_tokens": 1}).to_string();
    let (s, _, b) = call(router(), Method::POST, "/v1/completions", body.clone(), &[]).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{b:?}");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["type"], "authentication_error");
    let (s, _, _) = call(router(), Method::POST, "/v1/completions", body.clone(), &[("authorization", "Bearer sk-alphb")]).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(router(), Method::GET, "/v1/models", Body::empty(), &[]).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(router(), Method::POST, "/v1/completions", body, &[("authorization", "Bearer sk-alpha")]).await;
    assert_eq!(s, StatusCode::OK);
    for path in ["/health", "/ready", "/metrics", "/version"] {
        let (s, _, _) = call(router(), Method::GET, path, Body::empty(), &[]).await;
        assert_eq!(s, StatusCode::OK, "{path}");
    }
}

#[tokio::test]
async fn per_key_rate_limits() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keys");
    std::fs::write(&file, "sk-small rpm=2\nsk-tokens tpm=40\nsk-big\n").unwrap();
    let keys = KeyStore::new(&[], Some(&file), Limits::default()).unwrap();
    let state = state_with(FakeBackend::new(Duration::ZERO), keys, ServerConfig::default());
    let send = |key: &'static str, max_tokens: u32| {
        let state = state.clone();
        async move {
            let body = json!({"model": "fake-model", "prompt": "abcd", "max_tokens": max_tokens}).to_string();
            let auth = format!("Bearer {key}");
            call(super::routes::router(state), Method::POST, "/v1/completions", body, &[("authorization", auth.as_str())]).await
        }
    };
    assert_eq!(send("sk-small", 1).await.0, StatusCode::OK);
    assert_eq!(send("sk-small", 1).await.0, StatusCode::OK);
    let (s, h, b) = send("sk-small", 1).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b:?}");
    let retry: u64 = h["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
    // Another tenant is not affected.
    assert_eq!(send("sk-big", 1).await.0, StatusCode::OK);
    // Tokens (40 per minute): 4 prompt + 30 reserved fits; the fake replies with 4 tokens, so 26 come
    // back (32 left). 4 + 20 fits (16 back: 24 left); 4 + 36 does not.
    assert_eq!(send("sk-tokens", 30).await.0, StatusCode::OK);
    assert_eq!(send("sk-tokens", 20).await.0, StatusCode::OK);
    let (s, h, _) = send("sk-tokens", 36).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert!(h.contains_key("retry-after"));
}

/// The tokens-per-minute reservation is settled to what was used on every path: a request refused
/// after reserving costs nothing, an aborted stream costs its prompt and what it streamed.
#[tokio::test]
async fn token_budget_settles_on_refusals_and_aborts() {
    let keys = KeyStore::new(&["sk-t".into()], None, Limits { requests_per_minute: 0, tokens_per_minute: 100 }).unwrap();
    let state = state_with(FakeBackend::new(Duration::from_millis(20)), keys, ServerConfig::default());
    let send = |model: &'static str, max_tokens: u32, stream: bool| {
        let state = state.clone();
        async move {
            let body = json!({"model": model, "prompt": "abcd", "max_tokens": max_tokens, "stream": stream}).to_string();
            let req = Request::post("/v1/completions")
                .header("content-type", "application/json")
                .header("authorization", "Bearer sk-t")
                .body(Body::from(body))
                .unwrap();
            super::routes::router(state).oneshot(req).await.unwrap()
        }
    };
    // 4 + 56 = 60 reserved each time, refused by the backend (404): without settling, the second
    // would already be refused for tokens.
    for _ in 0..5 {
        assert_eq!(send("unloaded-adapter", 56, false).await.status(), StatusCode::NOT_FOUND);
    }
    // A stream of 60 reserved, aborted after its first token: costs ~5, not 60.
    let resp = send("fake-model", 56, true).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let _ = body.frame().await.unwrap().unwrap();
    drop(body);
    // 4 + 56 = 60 fits only if the abort was charged less than 40.
    let resp = send("fake-model", 56, false).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let _ = resp.into_body().collect().await.unwrap();
}

#[tokio::test]
async fn queue_full_gives_429_with_retry_after() {
    let state = state_with(
        FakeBackend::new(Duration::from_millis(200)),
        KeyStore::default(),
        ServerConfig { max_waiting_requests: 1, ..ServerConfig::default() },
    );
    // The first request waits in the fake's queue (never scheduled while we hold its stream).
    let router = super::routes::router(state.clone());
    let body = json!({"model": "fake-model", "prompt": "abc", "max_tokens": 3, "stream": true}).to_string();
    let req = Request::post("/v1/completions").body(Body::from(body.clone())).unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(state.admission.waiting(), 1);
    let (s, h, b) = call(router.clone(), Method::POST, "/v1/completions", body.clone(), &[]).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b:?}");
    assert_eq!(h["retry-after"], "1");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["code"], "queue_full");
    // Once the first is read to the end, capacity is back.
    let _ = resp.into_body().collect().await.unwrap();
    assert_eq!(state.admission.waiting(), 0);
    let (s, _, _) = call(router, Method::POST, "/v1/completions", body, &[]).await;
    assert_eq!(s, StatusCode::OK);
}

/// The `n` choices of a request each take a queue slot, all at once or none.
#[tokio::test]
async fn choices_are_queued_as_a_whole() {
    let state = state_with(
        FakeBackend::new(Duration::from_millis(200)),
        KeyStore::default(),
        ServerConfig { max_waiting_requests: 3, ..ServerConfig::default() },
    );
    let router = super::routes::router(state.clone());
    let body = json!({"model": "fake-model", "prompt": "abc", "max_tokens": 3, "stream": true}).to_string();
    let req = Request::post("/v1/completions").body(Body::from(body)).unwrap();
    let resp = router.clone().oneshot(req).await.unwrap();
    assert_eq!(state.admission.waiting(), 1);
    let choices = |n: u32| json!({"model": "fake-model", "prompt": "abc", "max_tokens": 2, "n": n}).to_string();
    // 2 slots free: 3 choices are refused whole (and take none), 4 could never be queued.
    let (s, _, b) = call(router.clone(), Method::POST, "/v1/completions", choices(3), &[]).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{b:?}");
    assert_eq!(state.admission.waiting(), 1);
    let (s, _, b) = call(router.clone(), Method::POST, "/v1/completions", choices(4), &[]).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b:?}");
    let (s, _, b) = call(router.clone(), Method::POST, "/v1/completions", choices(2), &[]).await;
    assert_eq!(s, StatusCode::OK, "{b:?}");
    let _ = resp.into_body().collect().await.unwrap();
    let (s, _, b) = call(router, Method::POST, "/v1/completions", choices(3), &[]).await;
    assert_eq!(s, StatusCode::OK, "{b:?}");
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(3));
    assert_eq!(state.admission.waiting(), 0);
}

#[tokio::test]
async fn client_disconnect_aborts_generation() {
    let backend = FakeBackend::new(Duration::from_millis(20));
    let live = backend.live.clone();
    let state = state_with(backend, KeyStore::default(), ServerConfig::default());
    let router = super::routes::router(state.clone());
    let body = json!({"model": "fake-model", "prompt": "abcdefghijklmnop", "max_tokens": 40, "stream": true}).to_string();
    let resp = router.clone().oneshot(Request::post("/v1/completions").body(Body::from(body)).unwrap()).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.data_ref().is_some());
    assert_eq!(live.load(Ordering::SeqCst), 1);
    let (_, _, m) = call(router.clone(), Method::GET, "/metrics", Body::empty(), &[]).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    assert!(m.contains(r#"peregrine_kv_cache_usage_ratio{model="fake-model"} 0.1"#), "{m}");
    assert!(m.contains(r#"peregrine_num_requests_running{model="fake-model"} 1"#), "{m}");
    drop(body); // the client goes away
    assert_eq!(live.load(Ordering::SeqCst), 0, "the backend stream must be dropped (aborted)");
    let (_, _, m) = call(router, Method::GET, "/metrics", Body::empty(), &[]).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    assert!(m.contains(r#"peregrine_kv_cache_usage_ratio{model="fake-model"} 0.0"#), "{m}");
    assert!(m.contains(r#"peregrine_num_requests_running{model="fake-model"} 0"#), "{m}");
    assert!(m.contains(r#"peregrine_request_success_total{model="fake-model",finished_reason="abort"} 1"#), "{m}");
}

mod tcp;

/// Memory a pod limit can be set from: the KV pool's size and the process's resident memory.
#[tokio::test]
async fn metrics_report_memory() {
    let state = fast();
    let (_, _, m) = call(super::routes::router(state), Method::GET, "/metrics", Body::empty(), &[]).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    assert!(m.lines().any(|l| l == "peregrine_kv_cache_bytes 1048576"), "{m}");
    let rss: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
        .unwrap_or_else(|| panic!("no RSS series:\n{m}"))
        .parse()
        .unwrap();
    assert!(rss > 1e6, "{rss}");
}

/// `/metrics` is bounded by what the server has: unknown `model` strings mint no series, an
/// unloaded adapter's series go, and the server-wide totals keep counting.
#[tokio::test]
async fn metric_labels_are_bounded_by_loaded_models() {
    let state = fast();
    let router = || super::routes::router(state.clone());
    let scrape = || async { String::from_utf8(call(router(), Method::GET, "/metrics", Body::empty(), &[]).await.2.to_vec()).unwrap() };
    let (s, _, v) = post(&state, "/v1/completions", json!({"model": "fake-adapter", "prompt": "xy", "max_tokens": 2})).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let before = scrape().await;
    for i in 0..40 {
        let model = format!("client-made-{i}-{}", "m".repeat(10_000));
        let (s, _, _) = post(&state, "/v1/completions", json!({"model": model, "prompt": "x", "max_tokens": 1})).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
    }
    let after = scrape().await;
    assert!(!after.contains("client-made-"), "an unknown model became a series");
    assert!(after.len() < before.len() + 200, "/metrics grew from {} to {} bytes", before.len(), after.len());
    assert!(after.contains(r#"peregrine_generation_tokens_total{model="fake-adapter"} 2"#), "{after}");

    let (s, _, b) =
        call(router(), Method::POST, "/v1/unload_lora_adapter", json!({"lora_name": "fake-adapter"}).to_string(), &[]).await;
    assert_eq!(s, StatusCode::OK, "{b:?}");
    let unloaded = scrape().await;
    assert!(!unloaded.contains(r#"model="fake-adapter""#), "the unloaded adapter's series remain:\n{unloaded}");
    assert!(unloaded.contains(r#"peregrine_num_requests_running{model="fake-model"} 0"#), "{unloaded}");
    assert!(unloaded.contains("peregrine_server_generation_tokens_total 2"), "{unloaded}");
    assert!(unloaded.contains("peregrine_server_requests_finished_total 1"), "{unloaded}");
    let (s, _, _) = post(&state, "/v1/completions", json!({"model": "fake-adapter", "prompt": "x", "max_tokens": 1})).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(!scrape().await.contains(r#"model="fake-adapter""#));
}

/// Adapter admin needs an admin key; tenant keys get 403; the admin key is no tenant key.
#[tokio::test]
async fn adapter_admin_needs_an_admin_key() {
    let keys = KeyStore::new(&["sk-tenant".into()], None, Limits::default()).unwrap().with_admin_keys(&["sk-admin".into()]);
    let state = state_with(FakeBackend::new(Duration::ZERO), keys, ServerConfig::default());
    let router = || super::routes::router(state.clone());
    let load = json!({"lora_name": "a1", "lora_path": "/tmp"}).to_string();
    let unload = json!({"lora_name": "fake-adapter"}).to_string();
    let admin_calls = [
        (Method::POST, "/v1/load_lora_adapter", load.clone()),
        (Method::POST, "/v1/unload_lora_adapter", unload.clone()),
        (Method::GET, "/v1/adapters", String::new()),
    ];
    for (method, path, body) in admin_calls.clone() {
        let (s, _, b) = call(router(), method.clone(), path, body.clone(), &[("authorization", "Bearer sk-tenant")]).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{path}: {b:?}");
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["error"]["code"], "permission_denied");
        assert_eq!(v["error"]["type"], "permission_error");
        let (s, _, _) = call(router(), method.clone(), path, body.clone(), &[]).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
        let (s, _, _) = call(router(), method.clone(), path, body.clone(), &[("authorization", "Bearer sk-admim")]).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{path}");
    }
    assert!(state.backend.loads.lock().is_empty(), "nothing was loaded by a tenant");
    let (s, _, b) = call(router(), Method::POST, "/v1/load_lora_adapter", load, &[("authorization", "Bearer sk-admin")]).await;
    assert_eq!(s, StatusCode::OK, "{b:?}");
    let (s, _, _) = call(router(), Method::GET, "/v1/adapters", Body::empty(), &[("authorization", "Bearer sk-admin")]).await;
    assert_eq!(s, StatusCode::OK);
    // The admin key does not make its holder a tenant.
    let body = json!({"model": "fake-model", "prompt": "x", "max_tokens": 1}).to_string();
    let (s, _, _) = call(router(), Method::POST, "/v1/completions", body.clone(), &[("authorization", "Bearer sk-admin")]).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(router(), Method::POST, "/v1/completions", body, &[("authorization", "Bearer sk-tenant")]).await;
    assert_eq!(s, StatusCode::OK);

    // Tenant keys and no admin key: adapter admin is closed, not open to tenants.
    let keys = KeyStore::new(&["sk-tenant".into()], None, Limits::default()).unwrap();
    let state = state_with(FakeBackend::new(Duration::ZERO), keys, ServerConfig::default());
    let body = json!({"lora_name": "a1", "lora_path": "/tmp"}).to_string();
    let (s, _, _) = call(super::routes::router(state), Method::POST, "/v1/load_lora_adapter", body, &[("authorization", "Bearer sk-tenant")]).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
}

/// `--lora-root`: only folders inside it (symlinks resolved) load; every refusal reads the same and
/// names the adapter, never a host path; the base model's name is not an adapter name.
#[tokio::test]
async fn adapter_paths_are_confined_to_the_lora_roots() {
    use super::adapter_roots::AdapterRoots;
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("adapters");
    std::fs::create_dir_all(root.join("good")).unwrap();
    std::fs::create_dir_all(tmp.path().join("outside")).unwrap();
    std::os::unix::fs::symlink(tmp.path().join("outside"), root.join("escape")).unwrap();
    let config = ServerConfig { adapter_roots: AdapterRoots::new(std::slice::from_ref(&root)).unwrap(), ..ServerConfig::default() };
    let state = state_with(FakeBackend::new(Duration::ZERO), KeyStore::default(), config);
    let load = |name: &str, path: String| {
        let state = state.clone();
        let body = json!({"lora_name": name, "lora_path": path}).to_string();
        async move {
            let (s, _, b) = call(super::routes::router(state), Method::POST, "/v1/load_lora_adapter", body, &[]).await;
            (s, String::from_utf8_lossy(&b).into_owned())
        }
    };
    let (s, b) = load("good", format!("{}/../adapters/good", root.display())).await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(state.backend.loads.lock()[0].1, std::fs::canonicalize(root.join("good")).unwrap(), "the canonical path is loaded");

    let refused = [
        tmp.path().join("outside").display().to_string(),
        root.join("escape").display().to_string(),
        root.join("missing").display().to_string(),
        "/proc/self".to_string(),
        "/".to_string(),
        "adapters/good".to_string(),
    ];
    let mut messages = Vec::new();
    for path in refused {
        let (s, b) = load("evil", path.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{path}: {b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["error"]["code"], "invalid_adapter", "{v}");
        let message = v["error"]["message"].as_str().unwrap().to_string();
        assert!(message.contains("`evil`"), "names the adapter: {message}");
        assert!(!message.contains(&tmp.path().display().to_string()) && !message.contains("/proc"), "no host path: {message}");
        messages.push(message);
    }
    assert!(messages.windows(2).all(|w| w[0] == w[1]), "missing, outside and escaping read alike: {messages:?}");
    assert_eq!(state.backend.loads.lock().len(), 1, "nothing outside the root reached the backend");

    let (s, b) = load("fake-model", root.join("good").display().to_string()).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(b.contains("base model"), "{b}");
    assert_eq!(state.backend.loads.lock().len(), 1);
}

/// The operator's autoscaler reads these names from every pod (`peregrine_api::metric_names`):
/// after one finished request, each is exposed with a sample for the served model.
#[tokio::test]
async fn metrics_expose_every_series_the_autoscaler_reads() {
    let state = fast();
    let body = json!({"model": "fake-model", "prompt": "abc", "max_tokens": 3}).to_string();
    let (status, _, b) = call(super::routes::router(state.clone()), Method::POST, "/v1/completions", body, &[]).await;
    assert_eq!(status, StatusCode::OK, "{b:?}");
    let (_, _, m) = call(super::routes::router(state), Method::GET, "/metrics", Body::empty(), &[]).await;
    let m = String::from_utf8(m.to_vec()).unwrap();
    for name in peregrine_api::metric_names::AUTOSCALER_INPUTS {
        // A histogram's samples are `<name>_bucket`/`_sum`/`_count`; others are `<name>{...}`.
        let exposed = m.lines().filter(|l| !l.starts_with('#')).any(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| ["{model=\"fake-model\"", "_count{model=\"fake-model\"}"].iter().any(|p| rest.starts_with(p)))
        });
        assert!(exposed, "{name} is not exposed for the served model:\n{m}");
    }
}

mod vllm;

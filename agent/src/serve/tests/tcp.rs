//! Over real loopback TCP: concurrent streams and draining on shutdown.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};

use super::fake::FakeBackend;
use super::{sse_events, state_with};
use crate::serve::auth::KeyStore;
use crate::serve::state::{AppState, ServerConfig};
use crate::serve::{serve, DrainConfig};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn request(client: &HttpClient, addr: SocketAddr, method: &str, path: &str, body: Option<Value>) -> (u16, Bytes) {
    let req = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.map(|b| b.to_string()).unwrap_or_default())))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

struct Running {
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(state: Arc<AppState<FakeBackend>>, drain: DrainConfig) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, state, drain, async move {
        let _ = rx.await;
    }));
    Running { addr, stop, server }
}

fn streamed_text(body: &[u8]) -> (String, Vec<String>) {
    let events = sse_events(body);
    let mut text = String::new();
    let mut ids = Vec::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        ids.push(v["id"].as_str().unwrap().to_string());
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    (text, ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_interleave_without_mixing() {
    let state = state_with(FakeBackend::new(Duration::from_millis(5)), KeyStore::default(), ServerConfig::default());
    let srv = start(state, DrainConfig { delay: Duration::ZERO, grace_period: Duration::from_secs(5) }).await;
    let c = client();
    let prompts: Vec<String> = (0..8).map(|i| format!("stream{i}-{}", "xyz".repeat(i))).collect();
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let c = c.clone();
            let body = json!({"model": "fake-model", "messages": [{"role": "user", "content": p}], "max_tokens": 20, "stream": true});
            tokio::spawn(async move { request(&c, srv.addr, "POST", "/v1/chat/completions", Some(body)).await })
        })
        .collect();
    let mut all_ids = std::collections::HashSet::new();
    for (p, t) in prompts.iter().zip(tasks) {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200);
        let (text, ids) = streamed_text(&body);
        let want: String = format!("user:{p}|").to_uppercase().chars().take(20).collect();
        assert_eq!(text, want);
        assert!(ids.iter().all(|i| i == &ids[0]), "one id per stream");
        assert!(all_ids.insert(ids[0].clone()), "ids are unique across streams");
    }
    let _ = srv.stop.send(());
    srv.server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drain_finishes_in_flight_and_loses_nothing() {
    let backend = FakeBackend::new(Duration::from_millis(30));
    let started = backend.started.clone();
    let state = state_with(backend, KeyStore::default(), ServerConfig::default());
    let drain = DrainConfig { delay: Duration::from_millis(400), grace_period: Duration::from_secs(10) };
    let srv = start(state.clone(), drain).await;
    let c = client();
    let n = 6;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let c = c.clone();
            let body = json!({"model": "fake-model", "prompt": format!("request number {i}"), "max_tokens": 12, "stream": true});
            tokio::spawn(async move { request(&c, srv.addr, "POST", "/v1/completions", Some(body)).await })
        })
        .collect();
    let t0 = Instant::now();
    while started.load(Ordering::SeqCst) < n && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(started.load(Ordering::SeqCst), n);
    let _ = srv.stop.send(());
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Draining: not ready, but still serving what arrives during the drain delay.
    let fresh = client();
    let (status, _) = request(&fresh, srv.addr, "GET", "/ready", None).await;
    assert_eq!(status, 503);
    let (status, body) =
        request(&fresh, srv.addr, "POST", "/v1/completions", Some(json!({"model": "fake-model", "prompt": "late", "max_tokens": 4}))).await;
    assert_eq!(status, 200, "{body:?}");
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200);
        let events = sse_events(&body);
        let text: String = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
            .collect();
        assert_eq!(text, format!("REQUEST NUMBER {i}").chars().take(12).collect::<String>());
    }
    let result = tokio::time::timeout(Duration::from_secs(5), srv.server).await;
    assert!(matches!(result, Ok(Ok(Ok(())))), "server must exit cleanly after draining: {result:?}");
    assert!(tokio::net::TcpStream::connect(srv.addr).await.is_err(), "listener must be closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grace_period_bounds_shutdown() {
    let state = state_with(FakeBackend::new(Duration::from_millis(500)), KeyStore::default(), ServerConfig::default());
    let srv = start(state, DrainConfig { delay: Duration::ZERO, grace_period: Duration::from_millis(300) }).await;
    let c = client();
    let body = json!({"model": "fake-model", "prompt": "a very long generation", "max_tokens": 20, "stream": true});
    let c2 = c.clone();
    let slow = tokio::spawn(async move { request(&c, srv.addr, "POST", "/v1/completions", Some(body)).await });
    let whole = json!({"model": "fake-model", "prompt": "another long generation", "max_tokens": 20});
    let slow_whole = tokio::spawn(async move { request(&c2, srv.addr, "POST", "/v1/completions", Some(whole)).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    let _ = srv.stop.send(());
    let result = tokio::time::timeout(Duration::from_secs(5), srv.server).await;
    assert!(matches!(result, Ok(Ok(Ok(())))), "{result:?}");
    assert!(t0.elapsed() < Duration::from_secs(2), "exited after the grace period, not after the request: {:?}", t0.elapsed());
    // Cut off cleanly: the stream ends with an error event naming the shutdown, then [DONE]; the
    // non-streaming request gets 503 `draining`, which carries `Retry-After: 1`.
    let (status, body) = slow.await.unwrap();
    assert_eq!(status, 200);
    let events = sse_events(&body);
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["error"]["code"], "draining", "{last}");
    let (status, body) = slow_whole.await.unwrap();
    assert_eq!(status, 503, "{body:?}");
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "draining");
}

/// `bench serve` against the server: every request's tokens, usage and timings reach the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_reports_what_the_server_streamed() {
    let delay = Duration::from_millis(2);
    let state = state_with(FakeBackend::new(delay), KeyStore::default(), ServerConfig::default());
    let srv = start(state, DrainConfig { delay: Duration::ZERO, grace_period: Duration::from_secs(5) }).await;
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("prompts.txt");
    // The fake backend's tokens are characters and its reply is as long as the prompt (> 20 here).
    let lines = ["abcdefghij klmnopqrst uvwxyz", "the quick brown fox jumps over"];
    std::fs::write(&prompts, format!("{}\n\n{}\n", lines[0], lines[1])).unwrap();
    // Used in turn: 0, 1, 0, 1, 0.
    let input_tokens = 3 * lines[0].len() + 2 * lines[1].len();
    let args = crate::bench_serve::ServeBenchArgs {
        url: format!("http://{}/", srv.addr),
        model: None,
        api_key: None,
        request_rate: 200.0,
        num_prompts: 5,
        input_len: 0,
        output_len: 20,
        prompts_file: Some(prompts),
        seed: 3,
        json: false,
    };
    let s = crate::bench_serve::bench(&args).await.unwrap();
    assert_eq!((s.successful_requests, s.failed_requests), (5, 0), "{:?}", s.first_error);
    assert_eq!((s.total_input_tokens, s.total_output_tokens), (input_tokens, 5 * 20));
    let ms = delay.as_secs_f64() * 1000.0;
    assert!(s.tpot.p50_ms >= ms && s.itl.p50_ms >= ms, "a token every {ms} ms at best: {s:?}");
    assert!(s.ttft.p50_ms >= ms && s.ttft.p99_ms >= s.ttft.p50_ms);
    assert!(s.output_token_throughput > 0.0 && s.output_token_throughput <= 5.0 * 1000.0 / ms);

    // A model the server does not have: every request fails with the server's 404, none is lost.
    let s = crate::bench_serve::bench(&crate::bench_serve::ServeBenchArgs { model: Some("nope".into()), ..args }).await.unwrap();
    assert_eq!((s.successful_requests, s.failed_requests), (0, 5));
    assert!(s.first_error.as_deref().is_some_and(|e| e.starts_with("HTTP 404")), "{:?}", s.first_error);
    let _ = srv.stop.send(());
    srv.server.await.unwrap().unwrap();
}

/// Sockets that send half a request head and stall (issue 22's flood, scaled down): beyond the cap
/// they are answered 503 and counted; the rest are closed at the header deadline; and a normal
/// request is served again right after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_are_capped_and_timed_out() {
    use crate::serve::connections::ConnectionLimits;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let header_timeout = Duration::from_millis(500);
    let config = ServerConfig {
        connections: ConnectionLimits { max_connections: 32, header_read_timeout: header_timeout, ..Default::default() },
        ..ServerConfig::default()
    };
    let state = state_with(FakeBackend::new(Duration::ZERO), KeyStore::default(), config);
    let srv = start(state.clone(), DrainConfig { delay: Duration::ZERO, grace_period: Duration::from_secs(2) }).await;
    let stalled_count = 200;
    let mut stalled = Vec::with_capacity(stalled_count);
    for _ in 0..stalled_count {
        let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
        s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        stalled.push(s);
    }
    let t0 = Instant::now();
    // Every stalled socket ends within the header deadline (plus scheduling slack): refused ones
    // with a 503 at once, admitted ones closed by the server when their head never completes.
    let mut answered_503 = 0;
    for mut s in stalled {
        let mut buf = Vec::new();
        let read = tokio::time::timeout(header_timeout * 4, s.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "a stalled connection is still open after {:?}", t0.elapsed());
        if buf.starts_with(b"HTTP/1.1 503") {
            answered_503 += 1;
        }
    }
    assert!(t0.elapsed() < header_timeout * 4, "{:?}", t0.elapsed());
    let refused = state.metrics.connections.refused.get();
    assert!(refused >= (stalled_count - 32) as u64, "refused {refused}");
    assert!(answered_503 >= stalled_count - 32 - 8, "most refused sockets read the 503 ({answered_503})");
    let metrics = state.metrics.render().unwrap();
    assert!(metrics.contains(&format!("peregrine_http_connections_refused_total {refused}")), "{metrics}");

    let (status, body) =
        request(&client(), srv.addr, "POST", "/v1/completions", Some(json!({"model": "fake-model", "prompt": "ok", "max_tokens": 2}))).await;
    assert_eq!(status, 200, "{body:?}");
    let _ = srv.stop.send(());
    srv.server.await.unwrap().unwrap();
}

/// A body that never arrives whole gets 408 at the body deadline; a `Content-Length` over the limit
/// gets 413 before any of the body is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_oversized_bodies_are_refused_early() {
    use crate::serve::connections::ConnectionLimits;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let body_timeout = Duration::from_millis(300);
    let config = ServerConfig {
        max_body_bytes: 1024,
        connections: ConnectionLimits { body_read_timeout: body_timeout, ..Default::default() },
        ..ServerConfig::default()
    };
    let state = state_with(FakeBackend::new(Duration::ZERO), KeyStore::default(), config);
    let srv = start(state.clone(), DrainConfig { delay: Duration::ZERO, grace_period: Duration::from_secs(2) }).await;

    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        .await
        .unwrap();
    let t0 = Instant::now();
    let mut buf = vec![0u8; 512];
    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf)).await.unwrap().unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(t0.elapsed() >= body_timeout - Duration::from_millis(50), "{:?}", t0.elapsed());

    // Head only: the server answers without waiting for (or reading) the promised gigabyte.
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await.unwrap().unwrap();
    let head = String::from_utf8_lossy(&buf[..n]).to_string();
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(head.contains("payload_too_large"), "{head}");
    let _ = srv.stop.send(());
    srv.server.await.unwrap().unwrap();
}

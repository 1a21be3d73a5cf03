//! The built binary serving the real SmolLM2 model on the CPU backend: the official `openai`
//! Python client, concurrency against the fixtures, disconnects freeing KV blocks, SIGTERM drain.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use common::{client, metric, metrics, post, Server, MODEL_NAME};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};


fn sse_data(body: &[u8]) -> Vec<Value> {
    let text = std::str::from_utf8(body).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    text.split_terminator("\n\n")
        .map(|f| f.strip_prefix("data: ").unwrap_or_else(|| panic!("bad frame {f:?}")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn strip_special(s: &str) -> String {
    s.replace("<|im_end|>", "").replace("<|im_start|>", "")
}

#[test]
fn openai_python_client() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "sk-test\nsk-limited rpm=1\n").unwrap();
    let server = Server::start(&["--api-keys-file", keys.to_str().unwrap()]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_client_test.py");
    let out = Command::new(common::python())
        .arg(script)
        .args([&server.base_url(), MODEL_NAME, "sk-test", "sk-limited"])
        .arg(common::fixtures_reference())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success() && stdout.contains("ALL OK"), "python client test failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

/// Structured outputs (JSON schema, regex, choice, Lark) through the `openai` client, each output
/// checked by an independent validator (`jsonschema`, Python's `re`).
#[test]
fn openai_python_structured_outputs() {
    run_python_script("openai_structured_test.py", &Server::start(&[]));
}

/// Runs `tests/python/<script> BASE_URL MODEL` against `server`; it must end with `ALL OK`.
fn run_python_script(script: &str, server: &Server) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python").join(script);
    let out = Command::new(common::python()).arg(path).args([&server.base_url(), MODEL_NAME]).output().expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success() && stdout.contains("ALL OK"), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

/// Tool calling (`tool_choice` required and named, streamed and not, a tool-call history), then
/// `logit_bias`, `n` and `best_of`, through the `openai` client; tool arguments checked against
/// each tool's schema by `jsonschema`.
#[test]
fn openai_python_tool_calls() {
    run_python_script("openai_tools_test.py", &Server::start(&[]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_match_fixtures() {
    let server = Server::start(&[]);
    let reference = common::reference();
    let prompts: Vec<&Value> = reference["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["greedy"]["steps"].as_array().unwrap().iter().all(|s| s["top2_margin"].as_f64().unwrap() >= 1e-2))
        .collect();
    assert!(prompts.len() >= 3);
    let c = client();
    let tasks: Vec<_> = prompts
        .iter()
        .map(|p| {
            let body = json!({"model": MODEL_NAME, "prompt": p["prompt"], "max_tokens": 32, "temperature": 0, "stream": true});
            let (c, addr) = (c.clone(), server.addr);
            tokio::spawn(async move { post(&c, addr, "/v1/completions", body.to_string()).await })
        })
        .collect();
    for (p, t) in prompts.iter().zip(tasks) {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200, "{body:?}");
        let chunks = sse_data(&body);
        let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
        assert_eq!(text, strip_special(p["greedy"]["text"].as_str().unwrap()), "prompt {}", p["prompt"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_stream_frees_kv_blocks() {
    let server = Server::start(&[]);
    let series = |name: &str| format!("{name}{{model=\"{MODEL_NAME}\"}}");
    let body = json!({"model": MODEL_NAME, "prompt": "Write a long story about a dragon.", "max_tokens": 1500,
                      "ignore_eos": true, "stream": true});
    let req = hyper::Request::post(format!("http://{}/v1/completions", server.addr))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    for _ in 0..3 {
        body.frame().await.unwrap().unwrap();
    }
    let m = metrics(server.addr).await;
    assert!(metric(&m, &series("peregrine_kv_cache_usage_ratio")).unwrap() > 0.0, "{m}");
    assert_eq!(metric(&m, &series("peregrine_num_requests_running")), Some(1.0), "{m}");
    drop(body); // the client goes away mid-stream
    let t0 = Instant::now();
    loop {
        let m = metrics(server.addr).await;
        let kv = metric(&m, &series("peregrine_kv_cache_usage_ratio")).unwrap();
        let running = metric(&m, &series("peregrine_num_requests_running")).unwrap();
        let aborted = metric(&m, &format!("peregrine_request_success_total{{model=\"{MODEL_NAME}\",finished_reason=\"abort\"}}"));
        if kv == 0.0 && running == 0.0 && aborted == Some(1.0) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "blocks not freed after disconnect: kv={kv} running={running}\n{m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let generated = metric(&metrics(server.addr).await, &series("peregrine_generation_tokens_total")).unwrap();
    assert!(generated < 1500.0, "generation must stop at the disconnect, got {generated} tokens");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_requests() {
    let mut server = Server::start(&["--drain-delay", "1", "--shutdown-grace-period", "120"]);
    let addr = server.addr;
    let c = client();
    let n = 6;
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let body = json!({"model": MODEL_NAME, "prompt": format!("Count from {i} to 100:"), "max_tokens": 24,
                              "ignore_eos": true, "temperature": 0, "stream": true});
            let c = c.clone();
            tokio::spawn(async move { post(&c, addr, "/v1/completions", body.to_string()).await })
        })
        .collect();
    // All requests are in the engine before the signal.
    let t0 = Instant::now();
    loop {
        let m = metrics(addr).await;
        let running = metric(&m, &format!("peregrine_num_requests_running{{model=\"{MODEL_NAME}\"}}")).unwrap_or(0.0);
        let waiting = metric(&m, &format!("peregrine_num_requests_waiting{{model=\"{MODEL_NAME}\"}}")).unwrap_or(0.0);
        if running + waiting >= n as f64 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "requests did not arrive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (status, _) = common::get(addr, "/ready").await.expect("/ready answers while draining");
    assert_eq!(status, 503);
    for t in tasks {
        let (status, body) = t.await.unwrap();
        assert_eq!(status, 200);
        let chunks = sse_data(&body);
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
        let text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
        assert!(!text.is_empty());
    }
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "server did not exit after draining");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "exit status {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_do_not_disturb_the_server() {
    let server = Server::start(&["--max-body-bytes", "65536"]);
    let c = client();
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (b"{\"model\":\"smollm2\",\"prompt\":\"\xff\xfe\"}".to_vec(), 400),
        (b"[[[[".to_vec(), 400),
        (format!(r#"{{"model":"smollm2","prompt":"{}"}}"#, "x".repeat(70000)).into_bytes(), 413),
        (br#"{"model":"smollm2","prompt":[99999999]}"#.to_vec(), 400),
        (br#"{"model":"smollm2","prompt":"hi","max_tokens":2048}"#.to_vec(), 400),
        (br#"{"model":"smollm2","prompt":"hi","max_tokens":0}"#.to_vec(), 400),
        (br#"{"model":"other","prompt":"hi"}"#.to_vec(), 404),
        (br#"{"model":"smollm2","prompt":{"a":1}}"#.to_vec(), 422),
    ];
    for (body, want) in cases {
        let (status, resp) = post(&c, server.addr, "/v1/completions", body.clone()).await;
        assert_eq!(status, want, "{} → {}", String::from_utf8_lossy(&body[..body.len().min(80)]), String::from_utf8_lossy(&resp));
        let v: Value = serde_json::from_slice(&resp).unwrap();
        assert!(v["error"]["message"].is_string() && v["error"]["type"].is_string(), "{v}");
    }
    let (status, resp) = post(&c, server.addr, "/v1/completions", json!({"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}).to_string()).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(v["choices"][0]["text"], " Paris.\n");
}

/// The offline commands log on stderr, beside what they print on stdout: warnings by default,
/// more with `RUST_LOG` (weights loading here), and never on stdout, where their tables go.
#[test]
fn offline_commands_log_warnings_by_default_and_more_with_rust_log() {
    let generate = |rust_log: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_peregrine-agent"));
        cmd.args(["generate", "--device", "cpu", "--threads", "2", "--prompt", "The capital of France is", "--max-tokens", "2"]).arg("--model").arg(common::model_path());
        cmd.env_remove("RUST_LOG");
        if let Some(filter) = rust_log {
            cmd.env("RUST_LOG", filter);
        }
        let out = cmd.output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned());
        assert!(out.status.success(), "{stderr}");
        (stdout, stderr)
    };
    let (stdout, stderr) = generate(None);
    assert!(!stdout.trim().is_empty(), "generate printed nothing");
    assert!(!stderr.contains("INFO"), "info lines without RUST_LOG: {stderr}");
    let (stdout, stderr) = generate(Some("info"));
    assert!(stderr.contains("loading weights"), "RUST_LOG=info should show the weights loading: {stderr}");
    assert!(!stdout.contains("loading weights"), "logs belong on stderr: {stdout}");
}

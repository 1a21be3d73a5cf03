//! Multi-LoRA over HTTP: the built binary serving the real SmolLM2 on the CPU backend with PEFT's
//! fixture adapters (`fixtures/smollm2/lora/adapter-{a,b}`). Expected texts come from PEFT's greedy
//! decodes (`lora_reference.json`) and the base fixtures, never from the server itself.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use axum::body::Bytes;
use common::{client, fixtures_dir, get, metrics, post, HttpClient, Server, MODEL_NAME};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};

fn adapter_dir(name: &str) -> String {
    fixtures_dir().join("smollm2/lora").join(name).to_str().unwrap().to_string()
}

fn lora_reference() -> Value {
    serde_json::from_slice(&std::fs::read(fixtures_dir().join("smollm2/lora_reference.json")).unwrap()).unwrap()
}

/// PEFT's greedy text for `adapter` on its prompt `i`: (prompt, text without special tokens, tokens).
fn expected(reference: &Value, adapter: &str, i: usize) -> (String, String, usize) {
    let p = &reference["adapters"][adapter]["prompts"][i];
    let g = &p["greedy"];
    (
        p["prompt"].as_str().unwrap().to_string(),
        g["text"].as_str().unwrap().replace("<|im_end|>", ""),
        g["max_new_tokens"].as_u64().unwrap() as usize,
    )
}

/// The base model's greedy text on `prompt` from the base fixtures, when it has no near-tie.
fn base_expected(prompt: &str) -> Option<String> {
    let reference = common::reference();
    let p = reference["prompts"].as_array().unwrap().iter().find(|p| p["prompt"] == prompt)?;
    let steps = p["greedy"]["steps"].as_array().unwrap();
    if !steps.iter().all(|s| s["top2_margin"].as_f64().unwrap() >= 1e-2) {
        return None;
    }
    Some(p["greedy"]["text"].as_str().unwrap().replace("<|im_end|>", ""))
}

async fn complete(c: &HttpClient, addr: SocketAddr, model: &str, prompt: &str, max_tokens: usize) -> (u16, Value) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let (status, body) = post(c, addr, "/v1/completions", body.to_string()).await;
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

async fn admin(c: &HttpClient, addr: SocketAddr, path: &str, body: Value) -> (u16, String) {
    let (status, body) = post(c, addr, path, body.to_string()).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

async fn load(c: &HttpClient, addr: SocketAddr, name: &str, path: &str) -> (u16, String) {
    admin(c, addr, "/v1/load_lora_adapter", json!({"lora_name": name, "lora_path": path})).await
}

async fn model_ids(addr: SocketAddr) -> Vec<(String, Value)> {
    let (status, body) = get(addr, "/v1/models").await.unwrap();
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["data"].as_array().unwrap().iter().map(|m| (m["id"].as_str().unwrap().to_string(), m["parent"].clone())).collect()
}

/// A streaming completion read frame by frame, so admin calls can happen while it runs.
struct Stream {
    body: hyper::body::Incoming,
    text: String,
    buffer: String,
}

impl Stream {
    async fn open(addr: SocketAddr, model: &str, prompt: &str, max_tokens: usize) -> Stream {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true});
        let req = hyper::Request::post(format!("http://{addr}/v1/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = client().request(req).await.unwrap();
        assert_eq!(resp.status(), 200, "stream on {model}");
        Stream { body: resp.into_body(), text: String::new(), buffer: String::new() }
    }

    /// Reads until at least one token's text has arrived (the request is running in the engine).
    async fn first_token(&mut self) {
        while self.text.is_empty() {
            assert!(self.read().await, "stream ended before its first token");
        }
    }

    /// One frame; false at the end.
    async fn read(&mut self) -> bool {
        let Some(frame) = self.body.frame().await else { return false };
        if let Ok(data) = frame.unwrap().into_data() {
            self.buffer.push_str(std::str::from_utf8(&data).unwrap());
        }
        while let Some(end) = self.buffer.find("\n\n") {
            let event: String = self.buffer.drain(..end + 2).collect();
            let data = event.trim_end().strip_prefix("data: ").unwrap_or_else(|| panic!("bad frame {event:?}"));
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "stream failed: {v}");
            self.text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
        true
    }

    async fn finish(mut self) -> String {
        while self.read().await {}
        self.text
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_complete_list_and_refuse_bad_adapters() {
    let server = Server::start(&["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]);
    let (addr, c, reference) = (server.addr, client(), lora_reference());

    for name in ["adapter-a", "adapter-b"] {
        let (status, text) = load(&c, addr, name, &adapter_dir(name)).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(text, format!("Success: LoRA adapter '{name}' added successfully."));
    }
    // Loading again from the same folder is a no-op, not an error.
    let (status, text) = load(&c, addr, "adapter-a", &adapter_dir("adapter-a")).await;
    assert_eq!(status, 200, "{text}");

    let ids = model_ids(addr).await;
    assert_eq!(ids[0], (MODEL_NAME.to_string(), Value::Null));
    for name in ["adapter-a", "adapter-b"] {
        assert!(ids.contains(&(name.to_string(), json!(MODEL_NAME))), "{ids:?}");
    }

    // Both adapters (and the base) in flight together, each giving its own reference text.
    let mut tasks = Vec::new();
    for (name, i) in [("adapter-a", 0), ("adapter-b", 0), ("adapter-a", 1), ("adapter-b", 2)] {
        let (prompt, want, max_tokens) = expected(&reference, name, i);
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let (status, v) = complete(&c, addr, name, &prompt, max_tokens).await;
            assert_eq!(status, 200, "{v}");
            assert_eq!(v["model"], name);
            assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "{name} on {prompt:?}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let (status, body) = get(addr, "/v1/adapters").await.unwrap();
    assert_eq!(status, 200);
    let list: Value = serde_json::from_slice(&body).unwrap();
    let a = list["data"].as_array().unwrap().iter().find(|a| a["name"] == "adapter-a").unwrap().clone();
    assert_eq!(a["rank"], 8);
    assert_eq!(a["requests_served"], 2, "{a}");
    assert!(a["source"].as_str().unwrap().ends_with("adapter-a"), "{a}");
    let b = list["data"].as_array().unwrap().iter().find(|a| a["name"] == "adapter-b").unwrap().clone();
    assert_eq!(b["rank"], 16);

    // Metrics carry the adapter's name.
    let m = metrics(addr).await;
    assert_eq!(
        common::metric(&m, r#"peregrine_request_success_total{model="adapter-a",finished_reason="stop"}"#),
        Some(1.0),
        "{m}"
    );

    // Bad adapters: 400 with the reason, and the server keeps serving.
    let dir = tempfile::tempdir().unwrap();
    let wrong_shapes = dir.path().join("wrong-shapes");
    std::fs::create_dir(&wrong_shapes).unwrap();
    let config = std::fs::read_to_string(PathBuf::from(adapter_dir("adapter-a")).join("adapter_config.json")).unwrap();
    let mut config: Value = serde_json::from_str(&config).unwrap();
    config["r"] = json!(4); // the tensors have rank 8
    std::fs::write(wrong_shapes.join("adapter_config.json"), config.to_string()).unwrap();
    std::fs::copy(
        PathBuf::from(adapter_dir("adapter-a")).join("adapter_model.safetensors"),
        wrong_shapes.join("adapter_model.safetensors"),
    )
    .unwrap();
    let missing = dir.path().join("missing");
    for (name, path) in [("missing", missing.to_str().unwrap()), ("wrong-shapes", wrong_shapes.to_str().unwrap())] {
        let (status, text) = load(&c, addr, name, path).await;
        assert_eq!(status, 400, "{name}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["code"], "invalid_adapter", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    // Malformed admin bodies.
    let (status, text) = admin(&c, addr, "/v1/load_lora_adapter", json!({"lora_name": "x"})).await;
    assert_eq!(status, 422, "{text}");
    let (status, text) = admin(&c, addr, "/v1/load_lora_adapter", json!({"lora_name": "a b", "lora_path": "/x"})).await;
    assert_eq!(status, 400, "{text}");

    // Unknown adapter: 404 for a completion and for an unload.
    let (status, v) = complete(&c, addr, "adapter-z", "Hello", 2).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(v["error"]["type"], "not_found_error");
    let (status, text) = admin(&c, addr, "/v1/unload_lora_adapter", json!({"lora_name": "adapter-z"})).await;
    assert_eq!(status, 404, "{text}");

    // Still serving the good adapters after the refusals.
    let (prompt, want, max_tokens) = expected(&reference, "adapter-b", 1);
    let (status, v) = complete(&c, addr, "adapter-b", &prompt, max_tokens).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want);

    // Unload: gone from /v1/models, and requests for it get 404.
    let (status, text) = admin(&c, addr, "/v1/unload_lora_adapter", json!({"lora_name": "adapter-b"})).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text, "Success: LoRA adapter 'adapter-b' removed successfully.");
    assert!(!model_ids(addr).await.iter().any(|(id, _)| id == "adapter-b"));
    let (status, _) = complete(&c, addr, "adapter-b", "Hello", 2).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rank_above_max_lora_rank_is_refused() {
    let server = Server::start(&["--enable-lora", "--max-lora-rank", "8"]);
    let c = client();
    let (status, text) = load(&c, server.addr, "adapter-b", &adapter_dir("adapter-b")).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("invalid_adapter"), "{text}");
    // rank 8 fits.
    let (status, text) = load(&c, server.addr, "adapter-a", &adapter_dir("adapter-a")).await;
    assert_eq!(status, 200, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_admin_needs_the_api_key_and_lora_enabled() {
    let server = Server::start(&["--api-key", "sk-tenant", "--admin-api-key", "sk-admin"]);
    let c = client();
    let (status, _) = load(&c, server.addr, "adapter-a", &adapter_dir("adapter-a")).await;
    assert_eq!(status, 401);
    let (status, _) = get(server.addr, "/v1/adapters").await.unwrap();
    assert_eq!(status, 401);
    // A tenant key is authenticated but may not manage adapters.
    let req = hyper::Request::post(format!("http://{}/v1/load_lora_adapter", server.addr))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-tenant")
        .body(Full::new(Bytes::from(json!({"lora_name": "a", "lora_path": adapter_dir("adapter-a")}).to_string())))
        .unwrap();
    assert_eq!(c.request(req).await.unwrap().status(), 403);
    let req = hyper::Request::post(format!("http://{}/v1/load_lora_adapter", server.addr))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-admin")
        .body(Full::new(Bytes::from(json!({"lora_name": "a", "lora_path": adapter_dir("adapter-a")}).to_string())))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    // Authenticated, but this server runs without LoRA.
    assert_eq!(resp.status(), 400);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("lora_disabled"), "{body:?}");
}

/// `--max-loras 1` with the base model and three adapter names in use; adapters hot-loaded,
/// replaced and unloaded while streams run. No request fails or gets another adapter's output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_swap_while_streaming_with_one_slot() {
    let a = adapter_dir("adapter-a");
    let b = adapter_dir("adapter-b");
    let module = format!("adapter-a={a}");
    let server = Server::start(&["--lora-modules", &module, "--max-loras", "1"]);
    let (addr, c, reference) = (server.addr, client(), lora_reference());
    let (prompt_a, want_a, n_a) = expected(&reference, "adapter-a", 0);
    let (prompt_b, want_b, n_b) = expected(&reference, "adapter-b", 0);
    assert_eq!(prompt_a, prompt_b);

    // Preloaded by --lora-modules.
    assert!(model_ids(addr).await.iter().any(|(id, _)| id == "adapter-a"));

    // A stream on adapter-a runs while adapter-b is hot-loaded and requested (it waits for the
    // single slot), with the base model in flight too.
    let mut on_a = Stream::open(addr, "adapter-a", &prompt_a, n_a).await;
    on_a.first_token().await;
    let (status, text) = load(&c, addr, "adapter-b", &b).await;
    assert_eq!(status, 200, "{text}");
    let on_b = Stream::open(addr, "adapter-b", &prompt_b, n_b).await;
    let base = Stream::open(addr, MODEL_NAME, &prompt_a, 16).await;

    // "swap" starts as adapter-a; a stream on it runs while "swap" is replaced by adapter-b.
    let (status, text) = load(&c, addr, "swap", &a).await;
    assert_eq!(status, 200, "{text}");
    let mut on_swap_old = Stream::open(addr, "swap", &prompt_a, n_a).await;
    on_swap_old.first_token().await;
    let (status, text) = load(&c, addr, "swap", &b).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text, "Success: LoRA adapter 'swap' replaced successfully.");
    let on_swap_new = Stream::open(addr, "swap", &prompt_b, n_b).await;

    // Unload adapter-a while a request on it is running: that request finishes on adapter-a.
    let mut on_a_late = Stream::open(addr, "adapter-a", &prompt_a, n_a).await;
    on_a_late.first_token().await;
    let (status, text) = admin(&c, addr, "/v1/unload_lora_adapter", json!({"lora_name": "adapter-a"})).await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = complete(&c, addr, "adapter-a", &prompt_a, 2).await;
    assert_eq!(status, 404, "unloaded adapter must be refused for new requests");

    assert_eq!(on_a.finish().await, want_a, "adapter-a stream");
    assert_eq!(on_b.finish().await, want_b, "adapter-b stream");
    assert_eq!(on_swap_old.finish().await, want_a, "swap before the replace: adapter-a's weights");
    assert_eq!(on_swap_new.finish().await, want_b, "swap after the replace: adapter-b's weights");
    assert_eq!(on_a_late.finish().await, want_a, "adapter-a stream across its unload");
    let base_text = base.finish().await;
    if let Some(want) = base_expected(&prompt_a) {
        assert!(want.starts_with(&base_text), "base: got {base_text:?}, reference {want:?}");
    }
    assert_ne!(base_text, want_a[..base_text.len().min(want_a.len())], "the base request must not run on an adapter");

    // After the unload drained, only the new swap version and adapter-b remain.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, body) = get(addr, "/v1/adapters").await.unwrap();
    let list: Value = serde_json::from_slice(&body).unwrap();
    let names: Vec<&str> = list["data"].as_array().unwrap().iter().map(|a| a["name"].as_str().unwrap()).collect();
    assert!(!names.contains(&"adapter-a"), "{list}");
    let m = metrics(addr).await;
    assert!(!m.contains("finished_reason=\"error\""), "{m}");
}

#[test]
fn openai_python_client_on_an_adapter() {
    let module = format!("adapter-a={}", adapter_dir("adapter-a"));
    let server = Server::start(&["--lora-modules", &module]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_lora_test.py");
    let out = Command::new(common::python())
        .arg(script)
        .args([&server.base_url(), MODEL_NAME, "adapter-a"])
        .arg(fixtures_dir().join("smollm2/lora_reference.json"))
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("ALL OK"),
        "python LoRA client test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}


fn copy_adapter(from: &str, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(PathBuf::from(from).join(file), to.join(file)).unwrap();
    }
}

async fn adapter_state(addr: SocketAddr, name: &str) -> String {
    let (status, body) = get(addr, "/v1/adapters").await.unwrap();
    assert_eq!(status, 200);
    let list: Value = serde_json::from_slice(&body).unwrap();
    let entry = list["data"].as_array().unwrap().iter().find(|a| a["name"] == name).cloned();
    entry.unwrap_or_else(|| panic!("{name} is not listed: {list}"))["state"].as_str().unwrap().to_string()
}

/// An adapter evicted from host memory whose files are deleted afterwards answers 503 naming it
/// (no host path), is listed and exported as failed, and a new admin load clears it; the base
/// model and the other adapters keep serving their reference texts throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_adapter_whose_files_are_gone_is_failed_not_a_500() {
    let server = Server::start(&["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "16"]);
    let (addr, c, reference) = (server.addr, client(), lora_reference());
    let scratch = tempfile::tempdir().unwrap();
    let doomed_dir = scratch.path().join("doomed-copy-of-a");
    copy_adapter(&adapter_dir("adapter-a"), &doomed_dir);

    let (status, text) = load(&c, addr, "doomed", doomed_dir.to_str().unwrap()).await;
    assert_eq!(status, 200, "{text}");
    // One adapter fits in host memory: loading adapter-b evicts doomed.
    let (status, text) = load(&c, addr, "adapter-b", &adapter_dir("adapter-b")).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(adapter_state(addr, "doomed").await, "evicted");
    let m = metrics(addr).await;
    assert_eq!(common::metric(&m, "peregrine_lora_cache_adapters "), Some(1.0), "{m}");
    assert_eq!(common::metric(&m, "peregrine_lora_slots "), Some(1.0), "{m}");
    assert!(common::metric(&m, "peregrine_lora_cache_bytes ").is_some_and(|b| b > 0.0), "{m}");

    std::fs::remove_dir_all(&doomed_dir).unwrap();
    // The first request starts the re-read (which fails), the second is refused up front: both 503.
    for attempt in 0..2 {
        let (status, v) = complete(&c, addr, "doomed", "Hello", 4).await;
        assert_eq!(status, 503, "attempt {attempt}: {v}");
        assert_eq!(v["error"]["code"], "adapter_unavailable", "{v}");
        assert_eq!(v["error"]["type"], "service_unavailable_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("doomed"), "{message}");
        assert!(!message.contains(scratch.path().to_str().unwrap()), "a host path leaked: {message}");
    }
    assert_eq!(adapter_state(addr, "doomed").await, "failed");
    let m = metrics(addr).await;
    assert_eq!(common::metric(&m, r#"peregrine_lora_adapter_failed{model="doomed"}"#), Some(1.0), "{m}");
    assert_eq!(common::metric(&m, r#"peregrine_request_errors_total{code="adapter_unavailable"}"#), Some(2.0), "{m}");

    // The base model and the other adapter are untouched.
    let (prompt, want, max_tokens) = expected(&reference, "adapter-b", 0);
    let (status, v) = complete(&c, addr, "adapter-b", &prompt, max_tokens).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want);
    let (status, v) = complete(&c, addr, MODEL_NAME, &prompt, 4).await;
    assert_eq!(status, 200, "{v}");

    // The files are back and an admin loads it again: servable, no longer failed.
    copy_adapter(&adapter_dir("adapter-a"), &doomed_dir);
    let (status, text) = load(&c, addr, "doomed", doomed_dir.to_str().unwrap()).await;
    assert_eq!(status, 200, "{text}");
    assert_ne!(adapter_state(addr, "doomed").await, "failed");
    let (prompt, want, max_tokens) = expected(&reference, "adapter-a", 0);
    let (status, v) = complete(&c, addr, "doomed", &prompt, max_tokens).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), want, "doomed serves adapter-a's weights again");
    let m = metrics(addr).await;
    assert_eq!(common::metric(&m, r#"peregrine_lora_adapter_failed{model="doomed"}"#), None, "{m}");
}

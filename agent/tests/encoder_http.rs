//! The built binary serving all-MiniLM-L6-v2 (`serve --model <encoder folder>`): the official
//! `openai` Python client against the Sentence-Transformers references, rerank/score/classify
//! shapes, concurrent requests merged by the batcher, bad inputs, metrics.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{client, metric, metrics, post, Server};
use serde_json::{json, Value};

const NAME: &str = "minilm";


fn minilm_reference() -> Value {
    serde_json::from_slice(&std::fs::read(common::fixtures_dir().join("minilm/reference.json")).unwrap()).unwrap()
}

fn start() -> Server {
    Server::start_model(&peregrine_testkit::test_encoder(), NAME, &["--threads", "2", "--max-num-batched-tokens", "1024"])
}

#[test]
fn openai_python_client_embeddings() {
    let server = start();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/openai_embeddings_test.py");
    let out = Command::new(common::python())
        .arg(script)
        .args([&server.base_url(), NAME])
        .arg(common::fixtures_dir().join("minilm/reference.json"))
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success() && stdout.contains("ALL OK"), "python client test failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_rerank_score_and_bad_inputs() {
    let server = start();
    let r = minilm_reference();
    let http = client();
    // 24 concurrent single-sentence requests: each gets its own reference vector back.
    let mut tasks = Vec::new();
    for k in 0..24 {
        let (http, addr, r) = (http.clone(), server.addr, r.clone());
        tasks.push(tokio::spawn(async move {
            let i = k % 3;
            let body = json!({"model": NAME, "input": r["sentences"][i], "encoding_format": "float"});
            let (status, bytes) = post(&http, addr, "/v1/embeddings", body.to_string()).await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
            let v: Value = serde_json::from_slice(&bytes).unwrap();
            let got = v["data"][0]["embedding"].as_array().unwrap();
            let want = r["embeddings"][i].as_array().unwrap();
            let worst = got.iter().zip(want).map(|(a, b)| (a.as_f64().unwrap() - b.as_f64().unwrap()).abs()).fold(0.0, f64::max);
            assert!(worst <= 1e-5, "request {k}: {worst}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // Rerank with a bi-encoder: cosine scores, most relevant first, against the reference cosines.
    let body = json!({"query": r["sentences"][0], "documents": [r["sentences"][1], {"text": r["sentences"][2]}], "top_n": 2});
    let (status, bytes) = post(&http, server.addr, "/v1/rerank", body.to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert_eq!(results[0]["index"], 0, "sentence 1 is closer to sentence 0 (cosine 0.247 vs -0.046)");
    let cos01 = r["cosine_similarity"][0][1].as_f64().unwrap();
    assert!((results[0]["relevance_score"].as_f64().unwrap() - cos01).abs() <= 1e-5);
    assert_eq!(results[1]["document"]["text"], r["sentences"][2]);
    // Score: pairwise.
    let body = json!({"text_1": [r["sentences"][0], r["sentences"][1]], "text_2": [r["sentences"][2], r["sentences"][2]]});
    let (status, bytes) = post(&http, server.addr, "/v1/score", body.to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    for (k, (i, j)) in [(0usize, 2usize), (1, 2)].into_iter().enumerate() {
        let got = v["data"][k]["score"].as_f64().unwrap();
        assert!((got - r["cosine_similarity"][i][j].as_f64().unwrap()).abs() <= 1e-5, "score {i},{j}: {got}");
    }
    // Bad inputs: clear 4xx each, and the server keeps serving.
    let long = "word ".repeat(400);
    let many: Vec<&str> = vec!["x"; 10_000];
    let cases: Vec<(&str, String, u16)> = vec![
        ("/v1/embeddings", json!({"model": NAME, "input": ""}).to_string(), 400),
        ("/v1/embeddings", json!({"model": NAME, "input": []}).to_string(), 400),
        ("/v1/embeddings", json!({"model": NAME, "input": many}).to_string(), 400),
        ("/v1/embeddings", json!({"model": NAME, "input": long}).to_string(), 400),
        ("/v1/embeddings", json!({"model": NAME, "input": {"a": 1}}).to_string(), 422),
        ("/v1/embeddings", json!({"model": NAME, "input": [1, "a"]}).to_string(), 422),
        ("/v1/embeddings", json!({"input": "a"}).to_string(), 422),
        ("/v1/embeddings", "{\"model\": ".to_string(), 400),
        ("/v1/rerank", json!({"query": "q", "documents": []}).to_string(), 400),
        ("/v1/rerank", json!({"query": "", "documents": ["a"]}).to_string(), 400),
        ("/v1/score", json!({"text_1": ["a", "b"], "text_2": ["c"]}).to_string(), 400),
        ("/classify", json!({"input": "a"}).to_string(), 400),
        ("/v1/chat/completions", json!({"model": NAME, "messages": [{"role": "user", "content": "hi"}]}).to_string(), 400),
    ];
    for (path, body, want) in cases {
        let (status, bytes) = post(&http, server.addr, path, body.clone()).await;
        assert_eq!(status, want, "{path} {body:.80}: {}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body:.80}: {v}");
        let model_dir = peregrine_testkit::test_encoder();
        let home = model_dir.parent().map(|p| p.display().to_string()).unwrap_or_default();
        assert!(!String::from_utf8_lossy(&bytes).contains(&home), "no host paths in errors");
    }
    let (status, _) = post(&http, server.addr, "/v1/embeddings", json!({"model": NAME, "input": "still here"}).to_string()).await;
    assert_eq!(status, 200);
    // Metrics: tokens, latency and the queue gauges.
    let text = metrics(server.addr).await;
    let tokens = metric(&text, &format!("peregrine_prompt_tokens_total{{model=\"{NAME}\"}}")).unwrap_or(0.0);
    assert!(tokens >= 24.0 * 8.0, "prompt tokens counted: {tokens}");
    let count = metric(&text, &format!("peregrine_e2e_request_latency_seconds_count{{model=\"{NAME}\"}}")).unwrap_or(0.0);
    assert!(count >= 27.0, "latency histogram: {count}");
    assert_eq!(metric(&text, &format!("peregrine_num_requests_waiting{{model=\"{NAME}\"}}")), Some(0.0));
    assert_eq!(metric(&text, &format!("peregrine_num_requests_running{{model=\"{NAME}\"}}")), Some(0.0));
}

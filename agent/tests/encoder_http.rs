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

/// A `BertForSequenceClassification` fixture (`three-labels` or `cross-encoder`) served from a
/// folder assembled in a temporary directory, with its transformers reference.
fn start_classifier(head: &str) -> (Server, tempfile::TempDir, Value) {
    let dir = tempfile::tempdir().unwrap();
    let fixture = peregrine_testkit::assemble_classifier(head, dir.path());
    let reference = serde_json::from_slice(&std::fs::read(fixture.join("reference.json")).unwrap()).unwrap();
    let server = Server::start_model(dir.path(), NAME, &["--threads", "2", "--max-num-batched-tokens", "1024"]);
    (server, dir, reference)
}

/// The fixtures README's tolerance on logits; probabilities and sigmoid scores move less than
/// their logits (softmax and sigmoid are 1-Lipschitz), so the same bound holds for them.
const LOGIT_TOL: f64 = 1e-4;

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn softmax64(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|e| e / sum).collect()
}

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Sends each case and checks a clear 4xx with an OpenAI error body, then that the server still
/// answers `ok_path` with `ok_body`.
async fn refuses_and_keeps_serving(server: &Server, cases: Vec<(&str, String, u16)>, ok_path: &str, ok_body: Value) {
    let http = client();
    for (path, body, want) in cases {
        let (status, bytes) = post(&http, server.addr, path, body.clone()).await;
        assert_eq!(status, want, "{path} {body:.80}: {}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{path} {body:.80}: {v}");
        assert!(!String::from_utf8_lossy(&bytes).contains("/tmp"), "no host paths in errors: {v}");
    }
    let (status, bytes) = post(&http, server.addr, ok_path, ok_body.to_string()).await;
    assert_eq!(status, 200, "still serving: {}", String::from_utf8_lossy(&bytes));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classify_matches_transformers_labels_and_probabilities() {
    let (server, _dir, r) = start_classifier("three-labels");
    let labels: Vec<&str> = r["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
    // /classify takes single texts; the fixture's pair cases are checked through /v1/score below
    // on the cross-encoder, and through the engine in agent/engine/tests/encoder_classifier.rs.
    let cases: Vec<&Value> = r["cases"].as_array().unwrap().iter().filter(|c| c["text_pair"].is_null()).collect();
    assert!(cases.len() >= 4);
    let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
    let http = client();
    // All texts in one request (one ragged batch), then the first alone as a plain string.
    let (status, bytes) = post(&http, server.addr, "/classify", json!({"model": NAME, "input": texts}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let data = v["data"].as_array().unwrap();
    assert_eq!(data.len(), cases.len());
    let (status, bytes) = post(&http, server.addr, "/classify", json!({"input": texts[0]}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let alone: Value = serde_json::from_slice(&bytes).unwrap();
    let mut checks: Vec<(&Value, &Value)> = cases.iter().copied().zip(data).collect();
    checks.push((cases[0], &alone["data"][0]));
    for (case, got) in checks {
        let want = softmax64(&floats(&case["logits"]));
        let probs = floats(&got["probs"]);
        assert_eq!(probs.len(), labels.len());
        assert_eq!(got["num_classes"], labels.len());
        let worst = probs.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst <= LOGIT_TOL, "{:.40}: probs {probs:?} vs {want:?}", case["text"]);
        let best = want.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        assert_eq!(got["label"], labels[best], "{:.40}", case["text"]);
    }
    assert_eq!(v["usage"]["prompt_tokens"], cases.iter().map(|c| c["input_ids"].as_array().unwrap().len()).sum::<usize>());
    // Bad inputs: clear 4xx each, the server keeps serving.
    let long = "word ".repeat(600);
    let many: Vec<&str> = vec!["x"; 10_000];
    let cases: Vec<(&str, String, u16)> = vec![
        ("/classify", json!({"input": ""}).to_string(), 400),
        ("/classify", json!({"input": ["a", ""]}).to_string(), 400),
        ("/classify", json!({"input": []}).to_string(), 400),
        ("/classify", json!({"input": many}).to_string(), 400),
        ("/classify", json!({"input": long}).to_string(), 400),
        ("/classify", json!({"input": 5}).to_string(), 422),
        ("/classify", json!({"input": [1, 2]}).to_string(), 422),
        ("/classify", json!({"text": "a"}).to_string(), 400),
        ("/classify", json!({"model": "other", "input": "a"}).to_string(), 404),
        ("/classify", "[".to_string(), 400),
        // Three labels: no relevance score to give.
        ("/v1/rerank", json!({"query": "q", "documents": ["a"]}).to_string(), 400),
        ("/v1/score", json!({"text_1": "q", "text_2": "a"}).to_string(), 400),
    ];
    refuses_and_keeps_serving(&server, cases, "/classify", json!({"input": texts[1]})).await;
    // Over-long input with truncate: cut to the model's limit, then classified.
    let (status, bytes) = post(&http, server.addr, "/classify", json!({"input": long, "truncate": true}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_encoder_rerank_and_score_match_transformers() {
    let (server, _dir, r) = start_classifier("cross-encoder");
    let pairs: Vec<&Value> = r["cases"].as_array().unwrap().iter().filter(|c| !c["text_pair"].is_null()).collect();
    assert!(pairs.len() >= 3);
    let query = pairs[0]["text"].as_str().unwrap();
    assert!(pairs.iter().all(|c| c["text"] == query), "the fixture's pairs share one query");
    let docs: Vec<&str> = pairs.iter().map(|c| c["text_pair"].as_str().unwrap()).collect();
    let want: Vec<f64> = pairs.iter().map(|c| sigmoid64(c["logits"][0].as_f64().unwrap())).collect();
    let http = client();
    // Rerank: sigmoid(logit) of each (query, document), most relevant first.
    let body = json!({"model": NAME, "query": query, "documents": docs, "return_documents": true});
    let (status, bytes) = post(&http, server.addr, "/v1/rerank", body.to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), docs.len());
    let mut order: Vec<usize> = (0..docs.len()).collect();
    order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
    for (rank, result) in results.iter().enumerate() {
        let i = result["index"].as_u64().unwrap() as usize;
        assert_eq!(i, order[rank], "rank {rank}: {v}");
        let got = result["relevance_score"].as_f64().unwrap();
        assert!((got - want[i]).abs() <= LOGIT_TOL, "document {i}: {got} vs {}", want[i]);
        assert_eq!(result["document"]["text"], docs[i]);
    }
    let tokens: usize = pairs.iter().map(|c| c["input_ids"].as_array().unwrap().len()).sum();
    assert_eq!(v["usage"]["prompt_tokens"], tokens);
    // top_n and no documents back.
    let body = json!({"query": query, "documents": docs, "top_n": 1, "return_documents": false});
    let (status, bytes) = post(&http, server.addr, "/v1/rerank", body.to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["results"].as_array().unwrap().len(), 1);
    assert_eq!(v["results"][0]["index"], order[0]);
    assert!(v["results"][0].get("document").is_none());
    // Score: one query against every document, then pairwise (the same pairs), in input order.
    for text_1 in [json!(query), json!(vec![query; docs.len()])] {
        let body = json!({"text_1": text_1, "text_2": docs});
        let (status, bytes) = post(&http, server.addr, "/v1/score", body.to_string()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        for (i, want) in want.iter().enumerate() {
            assert_eq!(v["data"][i]["index"], i);
            let got = v["data"][i]["score"].as_f64().unwrap();
            assert!((got - want).abs() <= LOGIT_TOL, "score {i}: {got} vs {want}");
        }
    }
    // TEI's /rerank: the same scores, or the logits with raw_scores, as a bare array.
    for raw in [false, true] {
        let body = json!({"query": query, "texts": docs, "raw_scores": raw, "return_text": true});
        let (status, bytes) = post(&http, server.addr, "/rerank", body.to_string()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let ranks = v.as_array().unwrap();
        assert_eq!(ranks.len(), docs.len());
        for (rank, got) in ranks.iter().enumerate() {
            let i = got["index"].as_u64().unwrap() as usize;
            assert_eq!(i, order[rank], "rank {rank}: {v}");
            let logit = pairs[i]["logits"][0].as_f64().unwrap();
            let want = if raw { logit } else { sigmoid64(logit) };
            assert!((got["score"].as_f64().unwrap() - want).abs() <= LOGIT_TOL, "TEI rerank {i} raw={raw}: {got}");
            assert_eq!(got["text"], docs[i]);
        }
    }
    // Bad inputs: clear 4xx each, the server keeps serving.
    let long = "word ".repeat(600);
    let many: Vec<&str> = vec!["x"; 10_000];
    let cases: Vec<(&str, String, u16)> = vec![
        ("/rerank", json!({"query": "q", "texts": []}).to_string(), 400),
        ("/rerank", json!({"query": "q", "texts": [""]}).to_string(), 400),
        ("/rerank", json!({"query": "q", "texts": many}).to_string(), 400),
        ("/rerank", json!({"query": "q", "texts": [long]}).to_string(), 400),
        ("/rerank", json!({"query": "q", "texts": ["a"], "truncation_direction": "left"}).to_string(), 400),
        ("/rerank", json!({"query": "q", "texts": "a"}).to_string(), 422),
        ("/v1/rerank", json!({"query": "", "documents": ["a"]}).to_string(), 400),
        ("/v1/rerank", json!({"query": "q", "documents": ["a", ""]}).to_string(), 400),
        ("/v1/rerank", json!({"query": "q", "documents": []}).to_string(), 400),
        ("/v1/rerank", json!({"query": "q", "documents": many}).to_string(), 400),
        ("/v1/rerank", json!({"query": "q", "documents": [long]}).to_string(), 400),
        ("/v1/rerank", json!({"query": "q", "documents": ["a"], "top_n": 0}).to_string(), 400),
        ("/v1/rerank", json!({"query": 1, "documents": ["a"]}).to_string(), 422),
        ("/v1/rerank", json!({"query": "q", "documents": "a"}).to_string(), 422),
        ("/v1/rerank", json!({"query": "q", "documents": [{"txt": "a"}]}).to_string(), 422),
        ("/v1/rerank", json!({"query": "q"}).to_string(), 422),
        ("/v1/score", json!({"text_1": "", "text_2": "a"}).to_string(), 400),
        ("/v1/score", json!({"text_1": "q", "text_2": []}).to_string(), 400),
        ("/v1/score", json!({"text_1": "q", "text_2": many}).to_string(), 400),
        ("/v1/score", json!({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}).to_string(), 400),
        ("/v1/score", json!({"text_1": long, "text_2": "a"}).to_string(), 400),
        ("/v1/score", json!({"text_1": 1, "text_2": "a"}).to_string(), 422),
        ("/v1/rerank", "{\"query\": ".to_string(), 400),
    ];
    refuses_and_keeps_serving(&server, cases, "/v1/rerank", json!({"query": query, "documents": [docs[0]]})).await;
    // Over-long document with truncate: cut to the model's limit, then scored.
    let (status, bytes) = post(&http, server.addr, "/v1/rerank", json!({"query": "q", "documents": [long], "truncate": true}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tei_embed_and_rerank_aliases() {
    let server = start();
    let r = minilm_reference();
    let http = client();
    let sentences: Vec<&str> = r["sentences"].as_array().unwrap().iter().map(|s| s.as_str().unwrap()).collect();
    let close = |got: &[f64], want: &[f64], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst <= 1e-5, "{what}: {worst}");
    };
    let unit = |v: &[f64]| {
        let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter().map(|x| x / n).collect::<Vec<f64>>()
    };
    // /embed: a bare array of vectors, the references (unit length).
    let (status, bytes) = post(&http, server.addr, "/embed", json!({"inputs": sentences}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v.as_array().unwrap().len(), sentences.len());
    for (i, got) in v.as_array().unwrap().iter().enumerate() {
        close(&floats(got), &floats(&r["embeddings"][i]), &format!("/embed {i}"));
    }
    // One string; normalize false: the mean-pooled vector before the chain's Normalize, so its
    // direction is the reference's and its length is not 1.
    let (status, bytes) = post(&http, server.addr, "/embed", json!({"inputs": sentences[1], "normalize": false}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let raw = floats(&v[0]);
    let norm = raw.iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() > 1e-3, "normalize false left the vector at unit length: {norm}");
    close(&unit(&raw), &floats(&r["embeddings"][1]), "/embed normalize false, direction");
    // dimensions: the leading components, unit length again.
    let (status, bytes) = post(&http, server.addr, "/embed", json!({"inputs": [sentences[2]], "dimensions": 64}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    close(&floats(&v[0]), &unit(&floats(&r["embeddings"][2])[..64]), "/embed dimensions 64");
    // /rerank with an embedding model: cosines, most relevant first.
    let body = json!({"query": sentences[0], "texts": [sentences[1], sentences[2]]});
    let (status, bytes) = post(&http, server.addr, "/rerank", body.to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let ranks = v.as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    assert_eq!(ranks[0]["index"], 0, "sentence 1 is closer to sentence 0: {v}");
    for got in ranks {
        let i = got["index"].as_u64().unwrap() as usize;
        let want = r["cosine_similarity"][0][i + 1].as_f64().unwrap();
        assert!((got["score"].as_f64().unwrap() - want).abs() <= 1e-5, "{got}");
        assert!(got.get("text").is_none(), "no text unless return_text: {got}");
    }
    let long = "word ".repeat(400);
    let many: Vec<&str> = vec!["x"; 10_000];
    let cases: Vec<(&str, String, u16)> = vec![
        ("/embed", json!({"inputs": ""}).to_string(), 400),
        ("/embed", json!({"inputs": []}).to_string(), 400),
        ("/embed", json!({"inputs": many}).to_string(), 400),
        ("/embed", json!({"inputs": long}).to_string(), 400),
        ("/embed", json!({"inputs": "a", "dimensions": 385}).to_string(), 400),
        ("/embed", json!({"inputs": "a", "truncation_direction": "left"}).to_string(), 400),
        ("/embed", json!({"inputs": 5}).to_string(), 422),
        ("/embed", json!({"inputs": [1]}).to_string(), 422),
        ("/embed", json!({"input": "a"}).to_string(), 400),
        ("/embed", "{".to_string(), 400),
        ("/rerank", json!({"query": "", "texts": ["a"]}).to_string(), 400),
        ("/rerank", json!({"query": "q", "texts": [1]}).to_string(), 422),
    ];
    refuses_and_keeps_serving(&server, cases, "/embed", json!({"inputs": "still here"})).await;
    let (status, bytes) = post(&http, server.addr, "/embed", json!({"inputs": long, "truncate": true}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
}

/// `--quantization int8` on an encoder folder: the CPU encoder's int8 linears serve embeddings close
/// to the references (the bound `encoder_minilm`'s int8 test measures), and `/version` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quantization_int8_serves_embeddings() {
    let server = Server::start_model(&peregrine_testkit::test_encoder(), NAME, &["--threads", "2", "--quantization", "int8"]);
    let r = minilm_reference();
    let http = client();
    let (status, bytes) = common::get(server.addr, "/version").await.expect("GET /version");
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(v["backend"].as_str().is_some_and(|b| b.contains("int8")), "{v}");
    let body = json!({"model": NAME, "input": r["sentences"], "encoding_format": "float"});
    let (status, bytes) = post(&http, server.addr, "/v1/embeddings", body.to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    for i in 0..3 {
        let got = floats(&v["data"][i]["embedding"]);
        let want = floats(&r["embeddings"][i]);
        assert_eq!(got.len(), 384);
        let cos = got.iter().zip(&want).map(|(a, b)| a * b).sum::<f64>();
        let norm = got.iter().map(|a| a * a).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "normalized: {norm}");
        assert!(cos >= 0.996, "sentence {i}: cosine {cos} to the reference");
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(worst > 0.0, "sentence {i}: identical to f32: was the flag ignored?");
    }
}

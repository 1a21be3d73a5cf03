//! `serve --task embed` on the decoder GGUF (SmolLM2-135M-Instruct): last-token embeddings of the
//! final norm's output, unit length, through `/v1/embeddings` and gRPC, against transformers'
//! hidden states of the same dequantized weights (`tests/fixtures/smollm2/embeddings.json`, made by
//! `scripts/make-smollm2-embedding-fixture.py`).

mod common;

use common::{client, post, Server};
use peregrine_agent::serve::grpc::proto::encoder_client::EncoderClient;
use peregrine_agent::serve::grpc::proto::EmbedRequest;
use serde_json::{json, Value};

const NAME: &str = "smollm2-embed";
/// float32 against float32 from the same dequantized weights, in another summation order through 30
/// layers: the MiniLM embeddings' bound (fixtures README: 1e-5 per component and on cosines; the
/// 6-digit rounding of the reference adds up to 5e-7) holds here as well.
const TOL: f64 = 1e-5;

fn reference() -> Value {
    serde_json::from_slice(&std::fs::read(common::fixtures_dir().join("smollm2/embeddings.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

fn worst(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decoder_last_token_embeddings_match_transformers() {
    let grpc_port = common::free_port().to_string();
    let args = ["--task", "embed", "--threads", "2", "--max-num-batched-tokens", "1024", "--max-model-len", "64", "--grpc-port", &grpc_port];
    let server = Server::start_model(&common::model_path(), NAME, &args);
    let r = reference();
    let cases = r["cases"].as_array().unwrap();
    let texts: Vec<&str> = cases.iter().map(|c| c["text"].as_str().unwrap()).collect();
    let http = client();
    // Every input in one request (one ragged batch of very different lengths), then each alone.
    let (status, bytes) = post(&http, server.addr, "/v1/embeddings", json!({"model": NAME, "input": texts}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let batched: Value = serde_json::from_slice(&bytes).unwrap();
    let tokens: usize = cases.iter().map(|c| c["input_ids"].as_array().unwrap().len()).sum();
    assert_eq!(batched["usage"]["prompt_tokens"], tokens, "the reference's tokenization");
    let mut got = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let v = floats(&batched["data"][i]["embedding"]);
        let w = worst(&v, &floats(&case["embedding"]));
        assert!(w <= TOL, "{:?} in a batch: {w}", case["text"]);
        let (status, bytes) = post(&http, server.addr, "/v1/embeddings", json!({"model": NAME, "input": texts[i]}).to_string()).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        let alone: Value = serde_json::from_slice(&bytes).unwrap();
        let w = worst(&floats(&alone["data"][0]["embedding"]), &floats(&case["embedding"]));
        assert!(w <= TOL, "{:?} alone: {w}", case["text"]);
        got.push(v);
    }
    for i in 0..got.len() {
        for j in 0..got.len() {
            let cos: f64 = got[i].iter().zip(&got[j]).map(|(a, b)| a * b).sum();
            let want = r["cosine_similarity"][i][j].as_f64().unwrap();
            assert!((cos - want).abs() <= TOL, "cosine {i},{j}: {cos} vs {want}");
        }
    }
    // More one-token inputs than the KV pool has blocks (1024 / 16 + 1): the embedder runs them in
    // several steps, every one still the reference.
    let hello = cases.iter().position(|c| c["input_ids"].as_array().unwrap().len() == 1).unwrap();
    let many = vec![texts[hello]; 100];
    let (status, bytes) = post(&http, server.addr, "/v1/embeddings", json!({"model": NAME, "input": many}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    for d in v["data"].as_array().unwrap() {
        assert!(worst(&floats(&d["embedding"]), &floats(&cases[hello]["embedding"])) <= TOL, "split batch, {}", d["index"]);
    }
    // gRPC: the same vectors.
    let channel = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{grpc_port}")).unwrap().connect().await.unwrap();
    let mut grpc = EncoderClient::new(channel);
    let inputs = texts.iter().map(|t| t.to_string()).collect();
    let answer = grpc.embed(EmbedRequest { inputs, ..Default::default() }).await.unwrap().into_inner();
    for (case, e) in cases.iter().zip(&answer.embeddings) {
        let v: Vec<f64> = e.values.iter().map(|&x| x as f64).collect();
        assert!(worst(&v, &floats(&case["embedding"])) <= TOL, "gRPC {:?}", case["text"]);
    }
    // Generation is not served; over-long inputs are refused (or cut when asked); still serving.
    let chat = json!({"model": NAME, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _) = post(&http, server.addr, "/v1/chat/completions", chat.to_string()).await;
    assert_eq!(status, 400);
    let long = "word ".repeat(100);
    let (status, bytes) = post(&http, server.addr, "/v1/embeddings", json!({"model": NAME, "input": long}).to_string()).await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&bytes));
    let (status, bytes) = post(&http, server.addr, "/v1/embeddings", json!({"model": NAME, "input": long, "truncate": true}).to_string()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], 64);
    let norm: f64 = floats(&v["data"][0]["embedding"]).iter().map(|x| x * x).sum::<f64>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "unit length: {norm}");
}

#[test]
fn generation_refuses_grpc_and_an_encoder_refuses_generate() {
    let refused = |model: &std::path::Path, extra: &[&str], says: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_peregrine-agent"))
            .args(["serve", "--host", "127.0.0.1", "--port", "0"])
            .arg("--model")
            .arg(model)
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(says), "{extra:?}: {stderr}");
    };
    refused(&common::model_path(), &["--grpc-port", "1"], "--grpc-port serves the encoder endpoints");
    refused(&peregrine_testkit::test_encoder(), &["--task", "generate"], "this model is an encoder");
    // The rotation would rotate the embeddings themselves; GPTQ needs a format to round to.
    refused(&common::model_path(), &["--task", "embed", "--quantization", "int8", "--quantization-rotation"], "--quantization-rotation is for generation");
    refused(&common::model_path(), &["--task", "embed", "--quantization-gptq"], "--quantization fp8|int8");
}

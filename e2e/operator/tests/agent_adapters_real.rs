//! The LoraAdapter controller's agent client against a real `peregrine-agent` (CPU, SmolLM2, the PEFT
//! fixture adapters): load both adapters, read them back from `/v1/models`, generate through one, a
//! bad path refused with the client's status error, unload (twice), and back to the base model only.
//!
//! Needs the agent binary (`cargo build -p peregrine-agent`, `make test` does; or `PEREGRINE_AGENT_BIN`),
//! the test model (`make model`) and the fixtures (`PEREGRINE_FIXTURES`).

use std::time::Duration;

use peregrine_e2e_operator::{fixtures_dir, Agent, MODEL};
use peregrine_operator::agent_client::{AgentApi, AgentError, HttpAgentClient, ModelEntry};
use serde_json::{json, Value};

const ADAPTERS: [&str; 2] = ["adapter-a", "adapter-b"];

fn ids(models: &[ModelEntry]) -> Vec<(String, Option<String>)> {
    let mut out: Vec<_> = models.iter().map(|m| (m.id.clone(), m.parent.clone())).collect();
    out.sort();
    out
}

/// The adapter's digest as the agent should report it, computed by coreutils.
fn sha256sum_of_files(dir: &std::path::Path) -> String {
    peregrine_testkit::sha256sum_of_files(dir, &["adapter_config.json", "adapter_model.safetensors"])
}

async fn complete(http: &reqwest::Client, base: &str, model: &str) -> (u16, Value) {
    let response = http
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": model, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_client_loads_and_unloads_fixture_adapters_in_a_real_agent() {
    let lora = fixtures_dir().join("smollm2/lora");
    let agent = Agent::start(&["--enable-lora", "--max-loras", "2"]).await;
    let base = agent.url.as_str();
    let client = HttpAgentClient::new(Duration::from_secs(60)).unwrap();
    let http = reqwest::Client::new();

    assert_eq!(ids(&client.list_models(base).await.unwrap()), [(MODEL.to_string(), None)]);

    for name in ADAPTERS {
        let digest = client.load_adapter(base, name, lora.join(name).to_str().unwrap()).await.unwrap();
        // What the LoraAdapter status records per pod: the files' digest, as coreutils computes it.
        assert_eq!(digest, Some(sha256sum_of_files(&lora.join(name))), "{name}");
    }
    let listed = client.list_adapters(base).await.unwrap();
    for name in ADAPTERS {
        let entry = listed.iter().find(|a| a.name == name).unwrap();
        assert_eq!(entry.digest, Some(sha256sum_of_files(&lora.join(name))), "GET /v1/adapters reports the same digest");
    }
    // Loading again from the same path is what a retried reconcile does: it must succeed.
    client.load_adapter(base, "adapter-a", lora.join("adapter-a").to_str().unwrap()).await.unwrap();
    let parent = Some(MODEL.to_string());
    assert_eq!(
        ids(&client.list_models(base).await.unwrap()),
        [("adapter-a".to_string(), parent.clone()), ("adapter-b".to_string(), parent.clone()), (MODEL.to_string(), None)]
    );

    let (status, body) = complete(&http, base, "adapter-b").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "adapter-b");
    assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
    assert!(!body["choices"][0]["text"].as_str().unwrap().is_empty(), "{body}");

    // A path with no adapter: the agent answers 400 and the client reports it as a status error
    // (which the controller records on the pod and retries with backoff).
    match client.load_adapter(base, "broken", "/nonexistent/adapter").await {
        Err(AgentError::Status { status: 400, body }) => assert!(!body.is_empty()),
        other => panic!("expected a 400 status error, got {other:?}"),
    }
    assert_eq!(client.list_models(base).await.unwrap().len(), 3, "a failed load leaves the others loaded");

    for name in ADAPTERS {
        client.unload_adapter(base, name).await.unwrap();
    }
    // The agent answers 404 for an adapter it does not have; the controller's client (finalizer on
    // a retried delete) takes that as done.
    let raw = http.post(format!("{base}/v1/unload_lora_adapter")).json(&json!({"lora_name": "adapter-a"})).send().await.unwrap();
    assert_eq!(raw.status().as_u16(), 404);
    client.unload_adapter(base, "adapter-a").await.unwrap();

    assert_eq!(ids(&client.list_models(base).await.unwrap()), [(MODEL.to_string(), None)]);
    let (status, body) = complete(&http, base, "adapter-a").await;
    assert_eq!(status, 404, "an unloaded adapter no longer serves: {body}");
}

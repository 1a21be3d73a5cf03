//! The HTTP agent client on the wire: paths, JSON bodies and status handling of vLLM's adapter API
//! (`POST /v1/load_lora_adapter {"lora_name","lora_path"}`, `POST /v1/unload_lora_adapter
//! {"lora_name"}`, `GET /v1/models`), served here by a minimal axum stand-in that checks the shape.
//! The same client against a running peregrine-agent is left for when the agent exists.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use peregrine_operator::agent_client::{AgentApi, AgentError, HttpAgentClient};
use serde_json::{json, Value};

#[derive(Clone, Default)]
struct Agent {
    adapters: Arc<Mutex<Vec<String>>>,
}

async fn load(State(agent): State<Agent>, Json(body): Json<Value>) -> (StatusCode, [(&'static str, &'static str); 1], Json<Value>) {
    let keys: Vec<&String> = body.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["lora_name", "lora_path"], "vLLM's request shape");
    let name = body["lora_name"].as_str().unwrap().to_string();
    if body["lora_path"] == "/missing" {
        return (StatusCode::BAD_REQUEST, [("x-other", "")], Json(json!({"error": {"message": "adapter_config.json not found", "type": "BadRequestError", "code": 400}})));
    }
    agent.adapters.lock().unwrap().push(name);
    (StatusCode::OK, [(peregrine_api::ADAPTER_DIGEST_HEADER, "sha256:abc")], Json(json!("Success")))
}

/// peregrine's `GET /v1/adapters`, in the shape of `peregrine_api::AdapterList`.
async fn adapters(State(agent): State<Agent>) -> Json<Value> {
    let data: Vec<Value> = agent.adapters.lock().unwrap().iter().enumerate().map(|(i, a)| json!({
        "name": a, "id": i + 1, "source": format!("/adapters/{a}"), "rank": 8, "state": "loaded", "slot": null,
        "loaded_at": 1.0, "last_used": null, "requests_served": 0, "in_flight": 0, "size_bytes": 64, "digest": "sha256:abc"
    })).collect();
    Json(json!({"object": "list", "data": data}))
}

async fn unload(State(agent): State<Agent>, Json(body): Json<Value>) -> StatusCode {
    let name = body["lora_name"].as_str().unwrap().to_string();
    let mut adapters = agent.adapters.lock().unwrap();
    if !adapters.contains(&name) {
        return StatusCode::NOT_FOUND;
    }
    adapters.retain(|a| *a != name);
    StatusCode::OK
}

async fn models(State(agent): State<Agent>) -> Json<Value> {
    let mut data = vec![json!({"id": "smol", "object": "model", "owned_by": "peregrine"})];
    for a in agent.adapters.lock().unwrap().iter() {
        data.push(json!({"id": a, "object": "model", "owned_by": "peregrine", "parent": "smol"}));
    }
    Json(json!({"object": "list", "data": data}))
}

#[tokio::test]
async fn load_list_unload_over_http() {
    let agent = Agent::default();
    let app = Router::new()
        .route("/v1/load_lora_adapter", post(load))
        .route("/v1/unload_lora_adapter", post(unload))
        .route("/v1/models", get(models))
        .route("/v1/adapters", get(adapters))
        .with_state(agent);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let client = HttpAgentClient::new(Duration::from_secs(5)).unwrap();
    let digest = client.load_adapter(&base, "pirate", "/mnt/pvc/models/adapters/pirate").await.unwrap();
    assert_eq!(digest.as_deref(), Some("sha256:abc"), "the digest comes from the answer's header");
    let listed = client.list_adapters(&base).await.unwrap();
    assert_eq!((listed[0].name.as_str(), listed[0].digest.as_deref()), ("pirate", Some("sha256:abc")));
    let models = client.list_models(&base).await.unwrap();
    assert_eq!(models.len(), 2);
    assert_eq!((models[1].id.as_str(), models[1].parent.as_deref()), ("pirate", Some("smol")));

    match client.load_adapter(&base, "bad", "/missing").await {
        Err(AgentError::Status { status: 400, body }) => assert!(body.contains("adapter_config.json not found"), "{body}"),
        other => panic!("expected a 400, got {other:?}"),
    }

    client.unload_adapter(&base, "pirate").await.unwrap();
    // Unloading what is not there is success: the goal state holds.
    client.unload_adapter(&base, "pirate").await.unwrap();
    assert_eq!(client.list_models(&base).await.unwrap().len(), 1);

    // Nobody listening: a transport error, not a panic.
    let dead = HttpAgentClient::new(Duration::from_secs(2)).unwrap();
    assert!(matches!(dead.list_models("http://127.0.0.1:9").await, Err(AgentError::Transport(_))));
}

/// With an admin key the client sends `Authorization: Bearer <key>` on every call, as agents
/// started with `--admin-api-key` require for adapter pushes; without one it sends no header.
#[tokio::test]
async fn the_admin_key_goes_in_the_authorization_header() {
    use axum::http::HeaderMap;
    use peregrine_operator::desired::admin_key::AdminKey;

    let seen: Arc<Mutex<Vec<(String, Option<String>)>>> = Arc::default();
    let record = |path: &'static str| {
        let seen = seen.clone();
        move |headers: HeaderMap| {
            let auth = headers.get("authorization").map(|v| v.to_str().unwrap().to_string());
            seen.lock().unwrap().push((path.to_string(), auth));
            async { Json(json!({"object": "list", "data": []})) }
        }
    };
    let app = Router::new()
        .route("/v1/load_lora_adapter", post(record("load")))
        .route("/v1/unload_lora_adapter", post(record("unload")))
        .route("/v1/models", get(record("models")));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let keyed = HttpAgentClient::new(Duration::from_secs(5)).unwrap().with_admin_key(AdminKey::new("sk-admin-123"));
    keyed.load_adapter(&base, "pirate", "/adapters/pirate").await.unwrap();
    keyed.unload_adapter(&base, "pirate").await.unwrap();
    keyed.list_models(&base).await.unwrap();
    let plain = HttpAgentClient::new(Duration::from_secs(5)).unwrap();
    plain.load_adapter(&base, "pirate", "/adapters/pirate").await.unwrap();

    let bearer = Some("Bearer sk-admin-123".to_string());
    assert_eq!(
        *seen.lock().unwrap(),
        [
            ("load".to_string(), bearer.clone()),
            ("unload".to_string(), bearer.clone()),
            ("models".to_string(), bearer),
            ("load".to_string(), None),
        ]
    );
    // The key never shows in debug output (logs, config dumps).
    assert!(!format!("{keyed:?} {:?}", AdminKey::new("sk-admin-123")).contains("sk-admin-123"));
    assert_eq!(AdminKey::new("  "), None, "a blank key is no key");
}

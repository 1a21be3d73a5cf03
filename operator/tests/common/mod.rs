//! A fake Kubernetes API behind kube's mock service (`tower-test`), as in controller-rs: it keeps
//! objects in memory, applies the patch types the controllers send (server-side apply, JSON patch,
//! strategic merge of conditions), lists by label, and records every request for assertions.
//! And a scripted fake agent.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use kube::client::Body;
use kube::Client;
use peregrine_operator::agent_client::{AgentApi, AgentError, ModelEntry};
use peregrine_operator::config::OperatorConfig;
use peregrine_operator::metrics::Metrics;
use peregrine_operator::regression::OpenAiClient;
use peregrine_operator::rollout::HttpSuiteRunner;
use peregrine_operator::Context;
use serde_json::{json, Value};

#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub query: String,
    pub content_type: String,
    pub body: Value,
}

#[derive(Default)]
pub struct FakeApi {
    pub objects: Mutex<BTreeMap<String, Value>>,
    pub requests: Mutex<Vec<Recorded>>,
    /// Writes (POST/PUT/PATCH) to these paths are answered with this status code and message, the
    /// way the API server refuses an invalid object.
    pub refused: Mutex<HashMap<String, (u16, String)>>,
}

const COLLECTIONS: &[&str] = &["pods", "loraadapters", "modeldeployments", "deployments", "services", "secrets", "events", "inferenceobjectives"];

impl FakeApi {
    pub fn insert(&self, path: &str, object: Value) {
        self.objects.lock().unwrap().insert(path.to_string(), object);
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        self.objects.lock().unwrap().get(path).cloned()
    }

    /// Requests other than Event writes, as `METHOD path`.
    pub fn calls(&self) -> Vec<String> {
        self.requests
            .lock()
            .unwrap()
            .iter()
            .filter(|r| !r.path.contains("/events"))
            .map(|r| format!("{} {}", r.method, r.path))
            .collect()
    }

    pub fn events(&self) -> Vec<Value> {
        self.requests.lock().unwrap().iter().filter(|r| r.path.contains("/events") && r.method == "POST").map(|r| r.body.clone()).collect()
    }

    pub fn request(&self, method: &str, path: &str) -> Option<Recorded> {
        self.requests.lock().unwrap().iter().find(|r| r.method == method && r.path == path).cloned()
    }

    /// Makes writes to `path` fail with `code` (e.g. 422) and `message`.
    pub fn refuse(&self, path: &str, code: u16, message: &str) {
        self.refused.lock().unwrap().insert(path.to_string(), (code, message.to_string()));
    }

    fn handle(&self, r: &Recorded) -> (StatusCode, Value) {
        if r.method != "GET" {
            if let Some((code, message)) = self.refused.lock().unwrap().get(&r.path) {
                let status = StatusCode::from_u16(*code).unwrap();
                return (status, status_body(*code, status.canonical_reason().unwrap_or("Invalid"), message));
            }
        }
        let (key, status_sub) = match r.path.strip_suffix("/status") {
            Some(k) => (k.to_string(), true),
            None => (r.path.clone(), false),
        };
        let mut objects = self.objects.lock().unwrap();
        let last = key.rsplit('/').next().unwrap_or_default();
        match r.method.as_str() {
            "GET" if objects.contains_key(&key) => (StatusCode::OK, objects[&key].clone()),
            "GET" if COLLECTIONS.contains(&last) => {
                let selector = query_param(&r.query, "labelSelector");
                let items: Vec<Value> = objects
                    .iter()
                    .filter(|(k, _)| k.strip_prefix(&format!("{key}/")).is_some_and(|rest| !rest.contains('/')))
                    .map(|(_, v)| v.clone())
                    .filter(|v| selector.as_deref().is_none_or(|s| matches_selector(v, s)))
                    .collect();
                (StatusCode::OK, json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "1"}, "items": items}))
            }
            "GET" => not_found(&key),
            "POST" => {
                let name = r.body["metadata"]["name"].as_str().unwrap_or("generated").to_string();
                objects.insert(format!("{key}/{name}"), r.body.clone());
                (StatusCode::CREATED, r.body.clone())
            }
            "PUT" => {
                objects.insert(key, r.body.clone());
                (StatusCode::OK, r.body.clone())
            }
            "PATCH" => {
                let content_type = r.content_type.as_str();
                let current = objects.get(&key).cloned();
                let updated = if content_type.starts_with("application/apply-patch") {
                    let mut object = current.unwrap_or_else(|| json!({"metadata": {"generation": 1, "resourceVersion": "1"}}));
                    if status_sub {
                        object["status"] = r.body["status"].clone();
                    } else {
                        for (field, value) in r.body.as_object().unwrap() {
                            if field == "metadata" {
                                for (k, v) in value.as_object().unwrap() {
                                    object["metadata"][k] = v.clone();
                                }
                            } else {
                                object[field] = value.clone();
                            }
                        }
                    }
                    object
                } else if content_type.starts_with("application/json-patch") {
                    let Some(mut object) = current else { return not_found(&key) };
                    // The API server (evanphx/json-patch) lets `test` for null pass on a missing
                    // path; kube's finalizer helper relies on it.
                    let ops: Vec<Value> = r.body.as_array().unwrap().iter().filter(|op| {
                        !(op["op"] == "test" && op["value"].is_null() && object.pointer(op["path"].as_str().unwrap()).is_none())
                    }).cloned().collect();
                    let patch: json_patch::Patch = serde_json::from_value(Value::Array(ops)).unwrap();
                    if json_patch::patch(&mut object, &patch).is_err() {
                        return (StatusCode::UNPROCESSABLE_ENTITY, status_body(422, "Invalid", "json patch test failed"));
                    }
                    object
                } else if content_type.starts_with("application/strategic-merge-patch") {
                    // Only what the controllers send: status.conditions merged by type.
                    let Some(mut object) = current else { return not_found(&key) };
                    let mut conditions = object["status"]["conditions"].as_array().cloned().unwrap_or_default();
                    for new in r.body["status"]["conditions"].as_array().unwrap() {
                        conditions.retain(|c| c["type"] != new["type"]);
                        conditions.push(new.clone());
                    }
                    object["status"]["conditions"] = Value::Array(conditions);
                    object
                } else {
                    panic!("unexpected patch type {content_type}");
                };
                objects.insert(key, updated.clone());
                (StatusCode::OK, updated)
            }
            "DELETE" => match objects.remove(&key) {
                Some(object) => (StatusCode::OK, object),
                None => not_found(&key),
            },
            other => panic!("unexpected method {other}"),
        }
    }
}

fn not_found(key: &str) -> (StatusCode, Value) {
    (StatusCode::NOT_FOUND, status_body(404, "NotFound", &format!("{key} not found")))
}

fn status_body(code: u16, reason: &str, message: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message, "metadata": {}})
}

fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

/// `k=v` and bare `k` (exists) terms, comma-separated.
fn matches_selector(object: &Value, selector: &str) -> bool {
    let labels = &object["metadata"]["labels"];
    selector.split(',').all(|term| match term.split_once('=') {
        Some((k, v)) => labels[k] == v,
        None => !labels[term].is_null(),
    })
}

/// A client whose requests the fake answers.
pub fn fake_client(api: Arc<FakeApi>) -> Client {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect().await.unwrap().to_bytes();
            let recorded = Recorded {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
                query: parts.uri.query().unwrap_or_default().to_string(),
                content_type: parts.headers.get("content-type").map(|v| v.to_str().unwrap().to_string()).unwrap_or_default(),
                body: if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).unwrap_or(Value::Null) },
            };
            api.requests.lock().unwrap().push(recorded.clone());
            let (status, body) = api.handle(&recorded);
            send.send_response(Response::builder().status(status).body(Body::from(serde_json::to_vec(&body).unwrap())).unwrap());
        }
    });
    Client::new(service, "default")
}

/// What the fake agent at one base URL does.
#[derive(Clone, Debug, Default)]
pub struct AgentScript {
    /// Adapters the agent already has.
    pub loaded: Vec<String>,
    /// Answer of load calls: `None` succeeds, `Some((status, body))` fails.
    pub load_error: Option<(u16, String)>,
    /// The agent does not answer at all.
    pub down: bool,
    /// `peregrine_load_progress` on its `/metrics` (None: not reported).
    pub load_progress: Option<f64>,
    /// Content digest the agent reports for what it loads (its files' content); `None`: an agent
    /// that reports no digest.
    pub digest: Option<String>,
}

#[derive(Default)]
pub struct FakeAgent {
    pub scripts: Mutex<HashMap<String, AgentScript>>,
    pub calls: Mutex<Vec<String>>,
}

impl FakeAgent {
    pub fn script(&self, base: &str, script: AgentScript) {
        self.scripts.lock().unwrap().insert(base.to_string(), script);
    }
    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn with<T>(&self, base: &str, f: impl FnOnce(&mut AgentScript) -> T) -> T {
        let mut scripts = self.scripts.lock().unwrap();
        f(scripts.entry(base.to_string()).or_default())
    }
}

impl AgentApi for FakeAgent {
    fn load_adapter<'a>(&'a self, base: &'a str, name: &'a str, path: &'a str) -> BoxFuture<'a, Result<Option<String>, AgentError>> {
        self.calls.lock().unwrap().push(format!("load {base} {name} {path}"));
        let result = self.with(base, |s| {
            if s.down {
                return Err(AgentError::Transport("connection refused".into()));
            }
            match &s.load_error {
                Some((status, body)) => Err(AgentError::Status { status: *status, body: body.clone() }),
                None => {
                    if !s.loaded.iter().any(|n| n == name) {
                        s.loaded.push(name.to_string());
                    }
                    Ok(s.digest.clone())
                }
            }
        });
        Box::pin(async move { result })
    }

    fn unload_adapter<'a>(&'a self, base: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        self.calls.lock().unwrap().push(format!("unload {base} {name}"));
        let result = self.with(base, |s| {
            if s.down {
                return Err(AgentError::Transport("connection refused".into()));
            }
            s.loaded.retain(|n| n != name);
            Ok(())
        });
        Box::pin(async move { result })
    }

    fn load_progress<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Option<f64>, AgentError>> {
        self.calls.lock().unwrap().push(format!("progress {base}"));
        let result = self.with(base, |s| if s.down { Err(AgentError::Transport("connection refused".into())) } else { Ok(s.load_progress) });
        Box::pin(async move { result })
    }

    fn list_models<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Vec<ModelEntry>, AgentError>> {
        self.calls.lock().unwrap().push(format!("list {base}"));
        let result = self.with(base, |s| {
            if s.down {
                return Err(AgentError::Transport("connection refused".into()));
            }
            let mut models = vec![ModelEntry { id: "base".into(), parent: None }];
            models.extend(s.loaded.iter().map(|n| ModelEntry { id: n.clone(), parent: Some("base".into()) }));
            Ok(models)
        });
        Box::pin(async move { result })
    }

    fn list_adapters<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Vec<peregrine_api::AdapterStatus>, AgentError>> {
        let result = self.adapters(base);
        Box::pin(async move { result })
    }
}

impl FakeAgent {
    /// What `GET /v1/adapters` answers (recorded as `list <base>`, like the model list).
    fn adapters(&self, base: &str) -> Result<Vec<peregrine_api::AdapterStatus>, AgentError> {
        self.calls.lock().unwrap().push(format!("list {base}"));
        self.with(base, |s| {
            if s.down {
                return Err(AgentError::Transport("connection refused".into()));
            }
            // As the agent answers it on the wire (`GET /v1/adapters`).
            Ok(s.loaded
                .iter()
                .enumerate()
                .map(|(i, n)| {
                    serde_json::from_value(json!({
                        "name": n, "id": i + 1, "source": format!("/resolved/{n}"), "rank": 8, "state": "loaded",
                        "slot": null, "loaded_at": 0.0, "last_used": null, "requests_served": 0, "in_flight": 0,
                        "size_bytes": 0, "digest": s.digest,
                    }))
                    .unwrap()
                })
                .collect())
        })
    }
}

pub struct Harness {
    pub api: Arc<FakeApi>,
    pub agent: Arc<FakeAgent>,
    pub ctx: Arc<Context>,
}

pub fn harness() -> Harness {
    let api = Arc::new(FakeApi::default());
    let agent = Arc::new(FakeAgent::default());
    let client = fake_client(api.clone());
    // These specs have no regression suite: the runner is never called.
    let runner = Arc::new(HttpSuiteRunner { client: OpenAiClient::new(std::time::Duration::from_secs(5)).unwrap() });
    let ctx = Context::new(client, OperatorConfig::default(), agent.clone(), Metrics::default(), runner);
    Harness { api, agent, ctx }
}

pub const NS: &str = "models";

pub fn md_path(name: &str) -> String {
    format!("/apis/serving.peregrine.dev/v1alpha1/namespaces/{NS}/modeldeployments/{name}")
}
pub fn lora_path(name: &str) -> String {
    format!("/apis/serving.peregrine.dev/v1alpha1/namespaces/{NS}/loraadapters/{name}")
}
/// Makes the fake API server's discovery list `plural` under `group_version` (as when that CRD is
/// installed); without it, discovery of the group version answers 404.
pub fn install_api(api: &FakeApi, group_version: &str, kind: &str, plural: &str) {
    api.insert(&format!("/apis/{group_version}"), json!({
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": group_version,
        "resources": [{"name": plural, "singularName": kind.to_lowercase(), "namespaced": true, "kind": kind, "verbs": ["get", "list", "create", "patch", "delete"]}]
    }));
}

pub fn pod_path(name: &str) -> String {
    format!("/api/v1/namespaces/{NS}/pods/{name}")
}

/// A pod of ModelDeployment `md`; `containers_ready` is the agent's own readiness.
pub fn pod(name: &str, md: &str, ip: &str, containers_ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"serving.peregrine.dev/model-deployment": md}},
        "spec": {"containers": [{"name": "agent"}]},
        "status": {"podIP": ip, "conditions": [
            {"type": "ContainersReady", "status": if containers_ready { "True" } else { "False" }}
        ]}
    })
}

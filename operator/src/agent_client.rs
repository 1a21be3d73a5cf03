//! Client of the agent's admin API (vLLM-compatible): load/unload LoRA adapters, list models, and
//! peregrine's own `GET /v1/adapters` (what each version was loaded from, by path and digest).
//!
//! A trait so that controllers can be tested without agents; [`HttpAgentClient`] is the real one.

use std::time::Duration;

use futures::future::BoxFuture;
use peregrine_api::{AdapterList, AdapterStatus, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, ADAPTER_DIGEST_HEADER};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The agent answered with an error status; `body` is its message (OpenAI error JSON or text).
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    /// No answer: connection refused, timeout, bad response.
    #[error("request failed: {0}")]
    Transport(String),
}

/// One entry of `GET /v1/models`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelEntry {
    pub id: String,
    /// Set on adapters: the base model id.
    #[serde(default)]
    pub parent: Option<String>,
}

/// The part of `GET /v1/models` the controllers read. Lenient on purpose (not
/// `peregrine_api::ModelList`): any vLLM-compatible server's list parses.
#[derive(Debug, Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}


/// What the controllers need from an agent. `base` is the agent's root URL, e.g. `http://10.0.0.5:8000`.
pub trait AgentApi: Send + Sync {
    /// Loads (or reloads) `name` from `path`; returns the content digest of what the agent loaded
    /// (`None` from an agent that does not report one).
    fn load_adapter<'a>(&'a self, base: &'a str, name: &'a str, path: &'a str) -> BoxFuture<'a, Result<Option<String>, AgentError>>;
    /// Unloading an adapter the agent does not have succeeds (the goal state holds).
    fn unload_adapter<'a>(&'a self, base: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), AgentError>>;
    fn list_models<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Vec<ModelEntry>, AgentError>>;
    /// The agent's weight-load progress (0–1, `peregrine_load_progress` on its `/metrics`, served
    /// while it loads); None when it does not report one.
    fn load_progress<'a>(&'a self, _base: &'a str) -> BoxFuture<'a, Result<Option<f64>, AgentError>> {
        Box::pin(async { Ok(None) })
    }
    /// `GET /v1/adapters`: every adapter version the agent holds, with source and digest.
    fn list_adapters<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Vec<AdapterStatus>, AgentError>>;
}

/// A load-progress read is one small scrape: never wait on a busy pod for long.
const LOAD_PROGRESS_TIMEOUT: Duration = Duration::from_secs(2);

/// [`AgentApi`] over HTTP.
#[derive(Clone, Debug)]
pub struct HttpAgentClient {
    http: reqwest::Client,
    /// Sent as `Authorization: Bearer` on every call (agents accept adapter pushes only with it).
    admin_key: Option<crate::desired::admin_key::AdminKey>,
}

impl HttpAgentClient {
    /// `timeout` bounds each call; loading an adapter reads its weights, so allow seconds, not millis.
    pub fn new(timeout: Duration) -> Result<Self, AgentError> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| AgentError::Transport(e.to_string()))?;
        Ok(HttpAgentClient { http, admin_key: None })
    }

    /// Sends `key` as `Authorization: Bearer` (the agents' `--admin-api-key`).
    pub fn with_admin_key(mut self, key: Option<crate::desired::admin_key::AdminKey>) -> Self {
        self.admin_key = key;
        self
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.admin_key {
            Some(key) => request.bearer_auth(key.expose()),
            None => request,
        }
    }

    async fn post<T: Serialize + ?Sized>(&self, url: String, body: &T) -> Result<reqwest::Response, AgentError> {
        self.authorized(self.http.post(url).json(body)).send().await.map_err(|e| AgentError::Transport(e.to_string()))
    }

    /// GETs `url` and parses the JSON answer; an error status is [`AgentError::Status`].
    async fn get_json<T: serde::de::DeserializeOwned>(&self, url: String) -> Result<T, AgentError> {
        let response = self.authorized(self.http.get(url)).send().await.map_err(|e| AgentError::Transport(e.to_string()))?;
        if !response.status().is_success() {
            return Err(error_of(response).await);
        }
        response.json().await.map_err(|e| AgentError::Transport(e.to_string()))
    }
}

async fn error_of(response: reqwest::Response) -> AgentError {
    let status = response.status().as_u16();
    let body = response.text().await.unwrap_or_default();
    // Keep status messages short: they end up in object status.
    let body: String = body.chars().take(512).collect();
    AgentError::Status { status, body }
}

impl AgentApi for HttpAgentClient {
    fn load_adapter<'a>(&'a self, base: &'a str, name: &'a str, path: &'a str) -> BoxFuture<'a, Result<Option<String>, AgentError>> {
        Box::pin(async move {
            let response = self.post(format!("{base}/v1/load_lora_adapter"), &LoadLoraAdapterRequest { lora_name: name.to_string(), lora_path: path.to_string() }).await?;
            if response.status().is_success() {
                let digest = response.headers().get(ADAPTER_DIGEST_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
                Ok(digest)
            } else {
                Err(error_of(response).await)
            }
        })
    }

    fn unload_adapter<'a>(&'a self, base: &'a str, name: &'a str) -> BoxFuture<'a, Result<(), AgentError>> {
        Box::pin(async move {
            let response = self.post(format!("{base}/v1/unload_lora_adapter"), &UnloadLoraAdapterRequest { lora_name: name.to_string(), lora_int_id: None }).await?;
            if response.status().is_success() || response.status() == reqwest::StatusCode::NOT_FOUND {
                Ok(())
            } else {
                Err(error_of(response).await)
            }
        })
    }

    fn load_progress<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Option<f64>, AgentError>> {
        Box::pin(async move {
            let request = self.http.get(format!("{base}/metrics")).timeout(LOAD_PROGRESS_TIMEOUT);
            let response = request.send().await.map_err(|e| AgentError::Transport(e.to_string()))?;
            if !response.status().is_success() {
                return Err(error_of(response).await);
            }
            let text = response.text().await.map_err(|e| AgentError::Transport(e.to_string()))?;
            Ok(crate::load_progress::parse(&text))
        })
    }

    fn list_models<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Vec<ModelEntry>, AgentError>> {
        Box::pin(async move { Ok(self.get_json::<ModelList>(format!("{base}/v1/models")).await?.data) })
    }

    fn list_adapters<'a>(&'a self, base: &'a str) -> BoxFuture<'a, Result<Vec<AdapterStatus>, AgentError>> {
        Box::pin(async move { Ok(self.get_json::<AdapterList>(format!("{base}/v1/adapters")).await?.data) })
    }
}

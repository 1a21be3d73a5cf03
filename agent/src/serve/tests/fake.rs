//! A small deterministic backend: one token per character, and the reply is the prompt's text in
//! upper case (so concurrent streams can be told apart), one token per `delay`.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use peregrine_engine::request::{FinishReason, Usage};

use crate::serve::backend::{
    AdapterLoaded, BackendStats, EngineShape, EventStream, LoadOutcome, GenerateEvent, GenerateInput, InferenceBackend, PreparedPrompt, PromptInput, TokenOutput,
};
use crate::serve::error::ApiError;

pub struct FakeBackend {
    pub delay: Duration,
    pub max_model_len: usize,
    /// Generations whose stream is still alive (the fake's "KV blocks in use").
    pub live: Arc<AtomicUsize>,
    pub started: Arc<AtomicUsize>,
    /// Adapter names served (load/unload change it; any path loads).
    pub adapters: Arc<Mutex<BTreeSet<String>>>,
    pub shape: EngineShape,
    /// Prompt tokens every request reports as found in the prefix cache (at most its prompt).
    pub cached_prompt_tokens: usize,
    /// `(name, path)` of every adapter load the server passed on.
    pub loads: Arc<parking_lot::Mutex<Vec<(String, PathBuf)>>>,
    /// A fixed reply instead of the upper-cased prompt (tool-call outputs).
    pub reply: Option<String>,
    /// The `tools` of the last chat prompt prepared.
    pub last_tools: Arc<parking_lot::Mutex<Option<serde_json::Value>>>,
}

impl FakeBackend {
    pub fn new(delay: Duration) -> Self {
        FakeBackend {
            delay,
            max_model_len: 64,
            live: Arc::default(),
            started: Arc::default(),
            adapters: Arc::new(Mutex::new(BTreeSet::from(["fake-adapter".to_string()]))),
            shape: EngineShape::default(),
            cached_prompt_tokens: 0,
            loads: Arc::default(),
            reply: None,
            last_tools: Arc::default(),
        }
    }

    fn adapter_status(name: &str) -> peregrine_api::AdapterStatus {
        peregrine_api::AdapterStatus {
            name: name.into(),
            id: 1,
            source: "/fake".into(),
            rank: 8,
            state: "loaded".into(),
            slot: None,
            loaded_at: 0.0,
            last_used: None,
            requests_served: 0,
            in_flight: 0,
            size_bytes: 0,
            digest: Some(format!("sha256:fake-{name}")),
        }
    }
}

struct LiveGuard(Arc<AtomicUsize>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn decode(ids: &[u32]) -> Result<String, ApiError> {
    ids.iter()
        .map(|&id| char::from_u32(id).ok_or_else(|| ApiError::invalid(Some("prompt".to_string()), format!("token id {id} is out of vocabulary"))))
        .collect()
}

impl InferenceBackend for FakeBackend {
    fn model_name(&self) -> &str {
        "fake-model"
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn backend_name(&self) -> String {
        "fake".into()
    }

    fn stats(&self) -> BackendStats {
        BackendStats {
            kv_cache_usage_ratio: self.live.load(Ordering::SeqCst) as f64 / 10.0,
            kv_cache_bytes: Some(1 << 20),
            ..Default::default()
        }
    }

    fn engine_shape(&self) -> EngineShape {
        self.shape
    }

    fn has_adapter(&self, name: &str) -> bool {
        // "unloaded-adapter" is unloaded between the server's check and the submit (a real race).
        self.adapters.lock().unwrap().contains(name) || name == "unloaded-adapter"
    }

    async fn adapters(&self) -> Result<Vec<peregrine_api::AdapterStatus>, ApiError> {
        Ok(self.adapters.lock().unwrap().iter().map(|n| Self::adapter_status(n)).collect())
    }

    async fn load_adapter(&self, name: String, path: PathBuf) -> Result<AdapterLoaded, ApiError> {
        self.loads.lock().push((name.clone(), path.clone()));
        let fresh = self.adapters.lock().unwrap().insert(name.clone());
        let outcome = if fresh { LoadOutcome::Loaded } else { LoadOutcome::AlreadyLoaded };
        let mut adapter = Self::adapter_status(&name);
        adapter.source = path.display().to_string();
        Ok(AdapterLoaded { outcome, adapter })
    }

    async fn unload_adapter(&self, name: String) -> Result<peregrine_api::AdapterStatus, ApiError> {
        if self.adapters.lock().unwrap().remove(&name) {
            Ok(Self::adapter_status(&name))
        } else {
            Err(ApiError::AdapterNotFound(name))
        }
    }

    async fn prepare(&self, prompt: PromptInput) -> Result<PreparedPrompt, ApiError> {
        let text = match prompt {
            PromptInput::Text(t) => t,
            PromptInput::Tokens(ids) => decode(&ids)?,
            PromptInput::Chat { turns, tools } => {
                *self.last_tools.lock() = tools;
                turns.iter().map(|t| format!("{}:{}|", t.role, t.content)).collect()
            }
        };
        Ok(PreparedPrompt { tokens: text.chars().map(u32::from).collect() })
    }

    fn generate(&self, input: GenerateInput) -> Result<EventStream, ApiError> {
        if let Some(gone) = input.adapter.filter(|a| a == "unloaded-adapter") {
            return Err(ApiError::ModelNotFound(gone));
        }
        let prompt = decode(&input.prompt.tokens)?;
        let reply: Vec<char> = self.reply.clone().unwrap_or_else(|| prompt.to_uppercase()).chars().collect();
        self.live.fetch_add(1, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard(self.live.clone());
        let delay = self.delay;
        let prompt_tokens = input.prompt.tokens.len();
        let cached_prompt_tokens = self.cached_prompt_tokens.min(prompt_tokens);
        let max_tokens = input.params.max_tokens;
        let top = input.params.logprobs.unwrap_or(0);
        let stop = input.stop;
        struct S {
            i: usize,
            done: bool,
            scheduled: bool,
            _guard: LiveGuard,
        }
        let s = S { i: 0, done: false, scheduled: false, _guard: guard };
        let stream = futures::stream::unfold(s, move |mut s| {
            let reply = reply.clone();
            let stop = stop.clone();
            async move {
                if s.done {
                    return None;
                }
                if !s.scheduled {
                    s.scheduled = true;
                    return Some((GenerateEvent::Scheduled { queue_time: Duration::from_millis(1) }, s));
                }
                let usage = |n| Usage { prompt_tokens, completion_tokens: n, cached_prompt_tokens };
                if s.i >= reply.len() || s.i >= max_tokens {
                    s.done = true;
                    let reason = if s.i >= max_tokens { FinishReason::Length } else { FinishReason::Stop };
                    return Some((GenerateEvent::Finished { trailing_text: String::new(), reason, usage: usage(s.i) }, s));
                }
                tokio::time::sleep(delay).await;
                let c = reply[s.i];
                s.i += 1;
                // Single-character stop strings only: enough to test that the server passes them on.
                if stop.iter().any(|st| st.chars().eq(std::iter::once(c))) {
                    s.done = true;
                    let reason = FinishReason::Stop;
                    return Some((GenerateEvent::Finished { trailing_text: String::new(), reason, usage: usage(s.i) }, s));
                }
                let tops: Vec<(String, f32)> =
                    [(c.to_string(), -0.25f32), ("?".to_string(), -2.0)].into_iter().take(top).collect();
                let token = TokenOutput {
                    token_id: u32::from(c),
                    text: c.to_string(),
                    token_text: c.to_string(),
                    logprob: Some(-0.25),
                    top_logprobs: tops,
                };
                Some((GenerateEvent::Token(token), s))
            }
        });
        Ok(Box::pin(stream))
    }
}

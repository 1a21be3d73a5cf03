//! A small deterministic backend: one token per character, and the reply is the prompt's text in
//! upper case (so concurrent streams can be told apart), one token per `delay`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use peregrine_engine::request::{FinishReason, Usage};

use crate::serve::backend::{
    BackendStats, EventStream, GenerateEvent, GenerateInput, InferenceBackend, PreparedPrompt, PromptInput, TokenOutput,
};
use crate::serve::error::ApiError;

pub struct FakeBackend {
    pub delay: Duration,
    pub max_model_len: usize,
    /// Generations whose stream is still alive (the fake's "KV blocks in use").
    pub live: Arc<AtomicUsize>,
    pub started: Arc<AtomicUsize>,
    /// `(name, path)` of every adapter load the server passed on.
    pub loads: Arc<parking_lot::Mutex<Vec<(String, std::path::PathBuf)>>>,
    /// Whether "fake-adapter" is loaded (an unload clears it).
    pub adapter_loaded: Arc<std::sync::atomic::AtomicBool>,
}

impl FakeBackend {
    pub fn new(delay: Duration) -> Self {
        FakeBackend {
            delay, max_model_len: 64, live: Arc::default(), started: Arc::default(), loads: Arc::default(),
            adapter_loaded: Arc::new(std::sync::atomic::AtomicBool::new(true)),
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

    fn has_adapter(&self, name: &str) -> bool {
        // "unloaded-adapter" is unloaded between the server's check and the submit (a real race).
        (name == "fake-adapter" && self.adapter_loaded.load(Ordering::SeqCst)) || name == "unloaded-adapter"
    }

    async fn adapters(&self) -> Result<Vec<peregrine_api::AdapterStatus>, ApiError> {
        Ok(vec![peregrine_api::AdapterStatus {
            name: "fake-adapter".into(),
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
        }])
    }

    async fn load_adapter(&self, name: String, path: std::path::PathBuf) -> Result<crate::serve::backend::AdapterLoaded, ApiError> {
        self.loads.lock().push((name.clone(), path.clone()));
        let mut adapter = self.adapters().await?.remove(0);
        adapter.name = name;
        adapter.source = path.display().to_string();
        Ok(crate::serve::backend::AdapterLoaded { outcome: crate::serve::backend::LoadOutcome::Loaded, adapter })
    }

    async fn unload_adapter(&self, name: String) -> Result<peregrine_api::AdapterStatus, ApiError> {
        if name != "fake-adapter" || !self.adapter_loaded.swap(false, Ordering::SeqCst) {
            return Err(ApiError::AdapterNotFound(name));
        }
        Ok(self.adapters().await?.remove(0))
    }

    async fn prepare(&self, prompt: PromptInput) -> Result<PreparedPrompt, ApiError> {
        let text = match prompt {
            PromptInput::Text(t) => t,
            PromptInput::Tokens(ids) => decode(&ids)?,
            PromptInput::Chat(turns) => turns.iter().map(|t| format!("{}:{}|", t.role, t.content)).collect(),
        };
        Ok(PreparedPrompt { tokens: text.chars().map(u32::from).collect() })
    }

    fn generate(&self, input: GenerateInput) -> Result<EventStream, ApiError> {
        if let Some(gone) = input.adapter.filter(|a| a == "unloaded-adapter") {
            return Err(ApiError::ModelNotFound(gone));
        }
        let prompt = decode(&input.prompt.tokens)?;
        let reply: Vec<char> = prompt.to_uppercase().chars().collect();
        self.live.fetch_add(1, Ordering::SeqCst);
        self.started.fetch_add(1, Ordering::SeqCst);
        let guard = LiveGuard(self.live.clone());
        let delay = self.delay;
        let prompt_tokens = input.prompt.tokens.len();
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
                let usage = |n| Usage { prompt_tokens, completion_tokens: n, cached_prompt_tokens: 0 };
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

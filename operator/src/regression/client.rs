//! One regression case through the OpenAI API of an agent, streamed, so that the time to the first
//! token (TTFT) and the time per output token after it (TPOT) are measured as a client sees them.
//!
//! Requests are greedy (`temperature: 0`) and ask for the sampled tokens (`logprobs`), so that outputs
//! can be compared token by token with the stable revision's.

use std::time::{Duration, Instant};

use peregrine_api::chat::Role;
use peregrine_api::{ChatCompletionRequest, ChatMessage, CompletionRequest, Prompt, SamplingFields, StopSequences, StreamOptions};
use peregrine_crds::RegressionCase;
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server answered with an error status; `body` is what it said.
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    /// No (complete) answer: connection refused, timeout, connection dropped.
    #[error("request failed: {0}")]
    Transport(String),
    /// An answer that is not the OpenAI API's (or an error event inside the stream).
    #[error("bad response: {0}")]
    Protocol(String),
    /// The case cannot be sent (admission should have refused it).
    #[error("bad case: {0}")]
    BadCase(String),
}

/// What one case produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    pub text: String,
    /// The sampled tokens, as the server spells them; `None` when the server sent no logprobs.
    pub tokens: Option<Vec<String>>,
    /// From sending the request to the first output token.
    pub ttft: Duration,
    /// Mean time between later output tokens; `None` with fewer than two tokens.
    pub tpot: Option<Duration>,
    pub completion_tokens: usize,
    pub finish_reason: Option<String>,
    /// An encoder case's vector (the embedding, the documents' scores in order, the class
    /// probabilities); `None` for generation. See `encoder_client`.
    pub values: Option<Vec<f64>>,
}

/// A small OpenAI client: only what the regression runner sends.
#[derive(Clone, Debug)]
pub struct OpenAiClient {
    http: reqwest::Client,
}

impl OpenAiClient {
    /// `timeout` bounds each whole request (connect, generation and stream).
    pub fn new(timeout: Duration) -> Result<Self, ClientError> {
        let http = reqwest::Client::builder().timeout(timeout).build().map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(OpenAiClient { http })
    }

    pub(super) fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// Sends `case` to the server at `base` (its root, e.g. `http://10.0.0.5:8000`; a trailing `/v1`
    /// is accepted too) as `model`.
    pub async fn generate(&self, base: &str, model: &str, case: &RegressionCase) -> Result<Generation, ClientError> {
        let chat = case.prompt.is_none();
        let url = format!("{}/v1/{}", root(base), if chat { "chat/completions" } else { "completions" });
        let body = request_body(model, case)?;
        let started = Instant::now();
        let response = self.http.post(&url).json(&body).send().await.map_err(|e| ClientError::Transport(e.to_string()))?;
        let status = response.status();
        if !status.is_success() {
            let body = response.text().await.unwrap_or_default();
            return Err(ClientError::Status { status: status.as_u16(), body: truncate(&body, 500) });
        }
        let mut stream = StreamState::new(started, chat);
        let mut response = response;
        let mut buffer: Vec<u8> = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| ClientError::Transport(e.to_string()))? {
            buffer.extend_from_slice(&chunk);
            // Server-sent events: one `data: <json>` line per event; events may be split across chunks.
            while let Some(end) = buffer.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = buffer.drain(..=end).collect();
                let line = String::from_utf8_lossy(&line);
                if stream.line(line.trim_end())? {
                    return Ok(stream.finish());
                }
            }
        }
        if !buffer.is_empty() {
            let line = String::from_utf8_lossy(&buffer).to_string();
            if stream.line(line.trim_end())? {
                return Ok(stream.finish());
            }
        }
        Err(ClientError::Transport("stream ended without [DONE]".into()))
    }
}

/// The server root of `base`, without a trailing `/` or `/v1`.
pub(super) fn root(base: &str) -> &str {
    let base = base.trim_end_matches('/');
    base.strip_suffix("/v1").unwrap_or(base)
}

/// The request for `case`, built from the agent's own request types (`peregrine-api`), so the two
/// cannot drift: greedy, streamed with usage, and asking for the sampled tokens.
fn request_body(model: &str, case: &RegressionCase) -> Result<Value, ClientError> {
    let seed = case.sampling.seed.map(u64::try_from).transpose().map_err(|_| ClientError::BadCase("a negative seed".into()))?;
    let sampling = SamplingFields {
        max_tokens: Some(i64::from(case.sampling.max_tokens)),
        temperature: Some(0.0),
        stream: true,
        stream_options: Some(StreamOptions { include_usage: true, continuous_usage_stats: None }),
        stop: (!case.sampling.stop.is_empty()).then(|| StopSequences::Many(case.sampling.stop.clone())),
        seed,
        ..SamplingFields::default()
    };
    let body = match &case.prompt {
        // Legacy completions: `logprobs: 0` returns the sampled token of each position.
        Some(prompt) => serde_json::to_value(CompletionRequest {
            model: model.to_string(),
            prompt: Prompt::Text(prompt.clone()),
            logprobs: Some(0),
            sampling,
            ..CompletionRequest::default()
        }),
        None => {
            let messages = case.messages.iter().map(chat_message).collect::<Result<Vec<_>, _>>()?;
            serde_json::to_value(ChatCompletionRequest {
                model: model.to_string(),
                messages,
                logprobs: true,
                sampling,
                ..ChatCompletionRequest::default()
            })
        }
    };
    body.map_err(|e| ClientError::BadCase(format!("cannot encode the request: {e}")))
}

fn chat_message(m: &peregrine_crds::ChatMessage) -> Result<ChatMessage, ClientError> {
    // The CRD admits only the roles the API has (system, user, assistant); serde maps the name.
    let role: Role = serde_json::from_value(Value::String(m.role.clone())).map_err(|_| ClientError::BadCase(format!("unknown message role {:?}", m.role)))?;
    Ok(ChatMessage::text(role, m.content.clone()))
}

/// Accumulates one streamed response.
struct StreamState {
    started: Instant,
    chat: bool,
    out: Generation,
    tokens: Vec<String>,
    saw_logprobs: bool,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Output pieces seen (the token count when the server reports neither usage nor logprobs).
    pieces: usize,
}

impl StreamState {
    fn new(started: Instant, chat: bool) -> Self {
        StreamState {
            started,
            chat,
            out: Generation::default(),
            tokens: Vec::new(),
            saw_logprobs: false,
            first_token: None,
            last_token: None,
            pieces: 0,
        }
    }

    /// Handles one SSE line; returns true at `[DONE]`.
    fn line(&mut self, line: &str) -> Result<bool, ClientError> {
        let Some(data) = line.strip_prefix("data:") else {
            // Comments, `event:` lines and blank separators carry nothing we need.
            return Ok(false);
        };
        let data = data.trim();
        if data == "[DONE]" {
            return Ok(true);
        }
        let event: Value = serde_json::from_str(data).map_err(|e| ClientError::Protocol(format!("{e}: {}", truncate(data, 200))))?;
        if let Some(error) = event.get("error") {
            return Err(ClientError::Protocol(format!("error event: {error}")));
        }
        if let Some(n) = event.pointer("/usage/completion_tokens").and_then(Value::as_u64) {
            self.out.completion_tokens = n as usize;
        }
        let Some(choice) = event.pointer("/choices/0") else {
            return Ok(false);
        };
        let text = if self.chat { choice.pointer("/delta/content") } else { choice.get("text") };
        let text = text.and_then(Value::as_str).unwrap_or_default();
        let mut new_tokens = 0;
        if self.chat {
            if let Some(content) = choice.pointer("/logprobs/content").and_then(Value::as_array) {
                self.saw_logprobs = true;
                for t in content {
                    self.tokens.push(t.get("token").and_then(Value::as_str).unwrap_or_default().to_string());
                    new_tokens += 1;
                }
            }
        } else if let Some(tokens) = choice.pointer("/logprobs/tokens").and_then(Value::as_array) {
            self.saw_logprobs = true;
            for t in tokens {
                self.tokens.push(t.as_str().unwrap_or_default().to_string());
                new_tokens += 1;
            }
        }
        if !text.is_empty() || new_tokens > 0 {
            let now = Instant::now();
            self.first_token.get_or_insert(now);
            self.last_token = Some(now);
            self.pieces += new_tokens.max(1);
            self.out.text.push_str(text);
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.out.finish_reason = Some(reason.to_string());
        }
        Ok(false)
    }

    fn finish(mut self) -> Generation {
        if self.saw_logprobs {
            self.out.tokens = Some(std::mem::take(&mut self.tokens));
        }
        if self.out.completion_tokens == 0 {
            self.out.completion_tokens = self.out.tokens.as_ref().map_or(self.pieces, Vec::len);
        }
        if let (Some(first), Some(last)) = (self.first_token, self.last_token) {
            self.out.ttft = first - self.started;
            let n = self.out.completion_tokens;
            if n >= 2 {
                self.out.tpot = Some((last - first) / (n as u32 - 1));
            }
        }
        self.out
    }
}

/// At most `max` bytes of `s`, cut at a character boundary.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_api::chat::MessageContent;

    #[test]
    fn root_accepts_v1_and_slashes() {
        assert_eq!(root("http://a:8000/"), "http://a:8000");
        assert_eq!(root("http://a:8000/v1/"), "http://a:8000");
        assert_eq!(root("http://a:8000"), "http://a:8000");
    }

    #[test]
    fn parses_completion_and_chat_events() {
        let mut s = StreamState::new(Instant::now(), false);
        assert!(!s.line(r#"data: {"choices":[{"index":0,"text":"Hel","logprobs":{"tokens":["Hel"],"token_logprobs":[-0.1],"top_logprobs":[{}],"text_offset":[0]},"finish_reason":null}]}"#).unwrap());
        assert!(!s.line("").unwrap());
        assert!(!s.line(r#"data: {"choices":[{"index":0,"text":"lo","logprobs":{"tokens":["lo"]},"finish_reason":"length"}]}"#).unwrap());
        assert!(!s.line(r#"data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#).unwrap());
        assert!(s.line("data: [DONE]").unwrap());
        let g = s.finish();
        assert_eq!(g.text, "Hello");
        assert_eq!(g.tokens.as_deref(), Some(&["Hel".to_string(), "lo".to_string()][..]));
        assert_eq!(g.completion_tokens, 2);
        assert_eq!(g.finish_reason.as_deref(), Some("length"));
        assert!(g.tpot.is_some());

        let mut s = StreamState::new(Instant::now(), true);
        s.line(r#"data: {"choices":[{"index":0,"delta":{"role":"assistant"},"logprobs":null,"finish_reason":null}]}"#).unwrap();
        s.line(r#"data: {"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[{"token":"Hi","logprob":-0.5,"bytes":null,"top_logprobs":[]}]},"finish_reason":"stop"}]}"#).unwrap();
        let g = s.finish();
        assert_eq!(g.text, "Hi");
        assert_eq!(g.tokens.as_deref(), Some(&["Hi".to_string()][..]));
        assert_eq!(g.tpot, None, "one token has no TPOT");
    }

    #[test]
    fn error_events_and_garbage_are_errors() {
        let mut s = StreamState::new(Instant::now(), false);
        assert!(matches!(s.line(r#"data: {"error":{"message":"boom"}}"#), Err(ClientError::Protocol(m)) if m.contains("boom")));
        assert!(matches!(s.line("data: {not json"), Err(ClientError::Protocol(_))));
    }

    /// The bodies the runner sends are what the agent's own request types accept (they are built
    /// from them, and parsed back here as the agent parses them): greedy, streamed with usage, with
    /// the sampled tokens asked for.
    #[test]
    fn requests_are_the_agents_own_types() {
        let mut case: RegressionCase = serde_json::from_value(serde_json::json!({
            "name": "c", "prompt": "Hi", "sampling": {"maxTokens": 5, "stop": ["\n"], "seed": 7}, "expect": {"type": "contains", "value": "x"}
        }))
        .unwrap();
        let body = request_body("m", &case).unwrap();
        let parsed: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(parsed.model, "m");
        assert_eq!(parsed.prompt, Prompt::Text("Hi".into()));
        assert_eq!(parsed.logprobs, Some(0));
        assert_eq!(parsed.sampling.temperature, Some(0.0));
        assert_eq!(parsed.sampling.max_tokens, Some(5));
        assert_eq!(parsed.sampling.seed, Some(7));
        assert_eq!(parsed.sampling.stop, Some(StopSequences::Many(vec!["\n".into()])));
        assert!(parsed.sampling.stream && parsed.sampling.stream_options.is_some_and(|o| o.include_usage));

        case.prompt = None;
        case.messages = serde_json::from_value(serde_json::json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])).unwrap();
        let parsed: ChatCompletionRequest = serde_json::from_value(request_body("m", &case).unwrap()).unwrap();
        assert_eq!(parsed.messages.len(), 2);
        assert_eq!(parsed.messages[1].role, Role::User);
        assert_eq!(parsed.messages[1].content, Some(MessageContent::Text("Hi".into())));
        assert!(parsed.logprobs);

        case.sampling.seed = Some(-1);
        assert!(matches!(request_body("m", &case), Err(ClientError::BadCase(_))));
    }

    #[test]
    fn truncates_on_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h…");
        assert_eq!(truncate("abc", 5), "abc");
    }
}

//! One streaming completion request, timed at the client: reads the Server-Sent Events as they
//! arrive and notes when each chunk with text lands. Parsing is kept minimal (only the fields the
//! figures need) so that the load generator's own CPU time barely disturbs a server sharing its cores.

use std::time::{Duration, Instant};

use serde::Deserialize;

use super::stats::RequestResult;

/// What is sent for every request.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub completions_url: String,
    pub model: String,
    pub prompt: String,
    pub max_tokens: usize,
    pub api_key: Option<String>,
}

#[derive(Deserialize)]
struct Chunk<'a> {
    #[serde(default, borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    /// Borrowed where the JSON has no escapes; `Cow` takes the owned path otherwise.
    #[serde(default, borrow)]
    text: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
}

/// Splits a byte stream into SSE events (`...\n\n`) and yields each event's `data:` payload.
#[derive(Debug, Default)]
pub struct SseBuffer {
    buf: Vec<u8>,
}

impl SseBuffer {
    /// Appends `bytes` and returns the `data` payloads of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<Vec<u8>> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some(end) = find(&self.buf, b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let data: Vec<u8> = event
                .split(|&b| b == b'\n')
                .filter_map(|line| line.strip_prefix(b"data:"))
                .map(|d| d.strip_prefix(b" ").unwrap_or(d))
                .collect::<Vec<_>>()
                .join(&b'\n');
            if !data.is_empty() {
                events.push(data);
            }
        }
        events
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Sends one streaming request and times it. Errors are returned as text for the report.
pub async fn run(client: &reqwest::Client, spec: &RequestSpec) -> Result<RequestResult, String> {
    let body = serde_json::json!({
        "model": spec.model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
        "temperature": 0,
    });
    let mut request = client.post(&spec.completions_url).json(&body);
    if let Some(key) = &spec.api_key {
        request = request.bearer_auth(key);
    }
    let start = Instant::now();
    let mut response = request.send().await.map_err(|e| e.to_string())?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(format!("HTTP {}: {}", status.as_u16(), text.chars().take(200).collect::<String>()));
    }
    let mut sse = SseBuffer::default();
    let mut arrivals: Vec<Instant> = Vec::with_capacity(spec.max_tokens);
    let mut usage = None;
    'read: while let Some(bytes) = response.chunk().await.map_err(|e| e.to_string())? {
        let now = Instant::now();
        for data in sse.push(&bytes) {
            if data == b"[DONE]" {
                break 'read;
            }
            let chunk: Chunk = serde_json::from_slice(&data).map_err(|e| format!("bad chunk: {e}"))?;
            if let Some(error) = chunk.error {
                return Err(format!("error in stream: {error}"));
            }
            if chunk.usage.is_some() {
                usage = chunk.usage;
            }
            if chunk.choices.first().and_then(|c| c.text.as_deref()).is_some_and(|t| !t.is_empty()) {
                arrivals.push(now);
            }
        }
    }
    let latency = start.elapsed();
    let first = *arrivals.first().ok_or("no tokens in the stream")?;
    let (prompt_tokens, output_tokens) = match usage {
        Some(u) => (u.prompt_tokens, u.completion_tokens),
        None => (0, arrivals.len()),
    };
    Ok(RequestResult {
        prompt_tokens,
        output_tokens,
        ttft: first - start,
        itl: arrivals.windows(2).map(|w| w[1] - w[0]).collect::<Vec<Duration>>(),
        latency,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_across_chunk_boundaries() {
        // OpenAI's framing: `data: <json>\n\n`, split at arbitrary points by the network.
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\n: keep-alive\n\ndata: [DONE]\n\n";
        for split in 0..stream.len() {
            let mut sse = SseBuffer::default();
            let mut events = sse.push(&stream[..split]);
            events.extend(sse.push(&stream[split..]));
            assert_eq!(events, vec![b"{\"a\":1}".to_vec(), b"{\"b\":2}".to_vec(), b"[DONE]".to_vec()], "split at {split}");
        }
    }

    #[test]
    fn chunk_fields_with_and_without_escapes() {
        let c: Chunk = serde_json::from_slice(br#"{"id":"x","choices":[{"index":0,"text":"a\nb","finish_reason":null}],"usage":null}"#).unwrap();
        assert_eq!(c.choices[0].text.as_deref(), Some("a\nb"));
        let c: Chunk = serde_json::from_slice(br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#).unwrap();
        assert!(c.choices.is_empty());
        assert_eq!(c.usage.map(|u| (u.prompt_tokens, u.completion_tokens)), Some((3, 4)));
    }
}

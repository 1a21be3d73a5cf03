//! Tool calling through the chat endpoint on the fake backend: the reply is a fixed text in the
//! model's own format, parsed into `tool_calls` whole and streamed; requests that cannot be served
//! are refused with the field named. (Forced calls need a real tokenizer for their grammar: they
//! are tested against SmolLM2 in `agent/tests/real_model.rs`.)

use std::sync::Arc;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use serde_json::{json, Value};

use super::fake::FakeBackend;
use super::{call, post, sse_events, state_with};
use crate::serve::auth::KeyStore;
use crate::serve::state::{AppState, ServerConfig};
use crate::serve::tools::ToolCallFormat;

const HERMES_REPLY: &str =
    "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";

fn hermes_server(reply: &str, format: Option<ToolCallFormat>) -> Arc<AppState<FakeBackend>> {
    let backend = FakeBackend { max_model_len: 4096, reply: Some(reply.to_string()), ..FakeBackend::new(Duration::ZERO) };
    state_with(backend, KeyStore::default(), ServerConfig { tool_call_format: format, ..ServerConfig::default() })
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time"}}
    ])
}

fn body(extra: Value) -> Value {
    let mut b = json!({"model": "fake-model", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools()});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

#[tokio::test]
async fn auto_calls_are_parsed_into_tool_calls() {
    let state = hermes_server(HERMES_REPLY, Some(ToolCallFormat::Hermes));
    let (status, _, v) = post(&state, "/v1/chat/completions", body(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Sure.");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"], json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
    assert_eq!(calls[1]["function"], json!({"name": "get_time", "arguments": "{}"}));
    let (a, b) = (calls[0]["id"].as_str().unwrap(), calls[1]["id"].as_str().unwrap());
    assert!(a.starts_with("call_") && a != b, "{a} {b}");
    // The template got the request's tools as they were sent.
    assert_eq!(state.backend.last_tools.lock().clone(), Some(tools()));
}

#[tokio::test]
async fn auto_calls_stream_as_the_sdk_assembles_them() {
    let state = hermes_server(HERMES_REPLY, Some(ToolCallFormat::Hermes));
    let req = body(json!({"stream": true, "tool_choice": "auto"}));
    let (status, _, bytes) = call(super::super::routes::router(state.clone()), Method::POST, "/v1/chat/completions", req.to_string(), &[]).await;
    assert_eq!(status, StatusCode::OK);
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<(String, String, String)>::new(), None);
    for e in sse_events(&bytes).iter().filter(|e| *e != "[DONE]") {
        let chunk: Value = serde_json::from_str(e).unwrap();
        let choice = &chunk["choices"][0];
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or(""));
        for tc in delta["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                // A call's first delta names it and carries its id and type.
                assert_eq!(tc["type"], "function", "{tc}");
                calls.push((tc["id"].as_str().unwrap().into(), tc["function"]["name"].as_str().unwrap().into(), String::new()));
            } else {
                assert!(tc.get("id").is_none() && tc["function"].get("name").is_none(), "{tc}");
            }
            calls[i].2.push_str(tc["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(content, "Sure.\n");
    assert_eq!(calls.len(), 2);
    assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), ("get_weather", "{\"city\":\"Paris\"}"));
    assert_eq!((calls[1].1.as_str(), calls[1].2.as_str()), ("get_time", "{}"));
    assert_eq!(finish.as_deref(), Some("tool_calls"));
}

#[tokio::test]
async fn none_and_plain_answers_stay_text() {
    let state = hermes_server(HERMES_REPLY, Some(ToolCallFormat::Hermes));
    let (status, _, v) = post(&state, "/v1/chat/completions", body(json!({"tool_choice": "none"}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": HERMES_REPLY}));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let state = hermes_server("No tools needed.", Some(ToolCallFormat::Hermes));
    let (_, _, v) = post(&state, "/v1/chat/completions", body(json!({}))).await;
    assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "No tools needed."}));
}

#[tokio::test]
async fn tool_history_is_accepted_and_rendered() {
    let state = hermes_server("It is 18 degrees.", Some(ToolCallFormat::Hermes));
    let req = body(json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}
    ]}));
    let (status, _, v) = post(&state, "/v1/chat/completions", req).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "It is 18 degrees.");
}

#[tokio::test]
async fn unservable_tool_requests_are_refused_naming_the_field() {
    let state = hermes_server("x", None);
    let named = json!({"type": "function", "function": {"name": "nope"}});
    let cases = [
        // No format for `auto` in this model's template (as vLLM without --tool-call-parser).
        (body(json!({})), "tool_choice"),
        (body(json!({"tool_choice": named})), "tool_choice"),
        (json!({"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}), "tool_choice"),
        (body(json!({"tool_choice": "required", "response_format": {"type": "json_object"}})), "response_format"),
        (body(json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]})), "tools[0].function.name"),
    ];
    for (req, param) in cases {
        let (status, _, v) = post(&state, "/v1/chat/completions", req.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{req} → {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // `none` needs no parser.
    let (status, _, v) = post(&state, "/v1/chat/completions", body(json!({"tool_choice": "none"}))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
}

/// `n` choices on both endpoints: every choice with its index, whole and streamed; usage counts
/// the prompt once and every choice's tokens; `best_of` returns `n`; out-of-range `n` is a 400.
#[tokio::test]
async fn n_choices_whole_and_streamed() {
    let state = hermes_server("abc", None);
    let (status, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "hi", "n": 3, "logprobs": 1})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(choices.iter().all(|c| c["text"] == "abc" && c["logprobs"]["tokens"].as_array().unwrap().len() == 3));
    assert_eq!((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()), (Some(2), Some(9)));
    let (_, _, v) = post(&state, "/v1/completions", json!({"model": "fake-model", "prompt": "hi", "n": 2, "best_of": 4})).await;
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert!(v["choices"][1].get("logprobs").is_some_and(Value::is_null), "logprobs used to rank are not returned: {v}");
    let (_, _, v) = post(&state, "/v1/chat/completions", json!({"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 2})).await;
    assert_eq!(v["choices"][1]["message"]["content"], "abc", "{v}");
    for (path, body) in [
        ("/v1/completions", json!({"model": "fake-model", "prompt": "hi", "n": 2, "stream": true, "stream_options": {"include_usage": true}})),
        ("/v1/chat/completions", json!({"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": true, "stream_options": {"include_usage": true}})),
    ] {
        let (status, _, bytes) = call(super::super::routes::router(state.clone()), Method::POST, path, body.to_string(), &[]).await;
        assert_eq!(status, StatusCode::OK);
        let (mut texts, mut finished, mut usage) = (vec![String::new(); 2], vec![0; 2], None);
        for e in sse_events(&bytes).iter().filter(|e| *e != "[DONE]") {
            let chunk: Value = serde_json::from_str(e).unwrap();
            if let Some(u) = chunk.get("usage").filter(|u| !u.is_null()) {
                usage = Some(u["completion_tokens"].as_u64().unwrap());
            }
            for c in chunk["choices"].as_array().unwrap() {
                let i = c["index"].as_u64().unwrap() as usize;
                let piece = c.get("text").or_else(|| c["delta"].get("content")).and_then(Value::as_str).unwrap_or("");
                texts[i].push_str(piece);
                if c["finish_reason"].is_string() {
                    finished[i] += 1;
                }
            }
        }
        assert_eq!((texts, finished, usage), (vec!["abc".to_string(), "abc".to_string()], vec![1, 1], Some(6)), "{path}");
    }
    for body in [json!({"model": "fake-model", "prompt": "hi", "n": 17}), json!({"model": "fake-model", "prompt": "hi", "best_of": 2, "stream": true})] {
        let (status, _, v) = post(&state, "/v1/completions", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    }
}

//! Server-Sent Events framing exactly as OpenAI's API sends it: `data: <json>\n\n` per event and
//! `data: [DONE]\n\n` at the end.

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use futures::Stream;
use serde::Serialize;

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// One `data:` event. Serializing our own response types cannot fail; if it ever did, the event
/// carries an error object rather than a broken frame.
pub fn event<T: Serialize>(value: &T) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    if serde_json::to_writer(&mut out, value).is_err() {
        out.truncate(6);
        out.extend_from_slice(br#"{"error":{"message":"serialization failed","type":"server_error","param":null,"code":"internal_error"}}"#);
    }
    out.extend_from_slice(b"\n\n");
    out
}

pub fn response(stream: impl Stream<Item = Result<Bytes, std::convert::Infallible>> + Send + 'static) -> Response {
    let mut response = Response::new(Body::from_stream(stream));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Proxies (nginx) must not buffer tokens.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

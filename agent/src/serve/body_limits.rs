//! In front of every route: a request whose `Content-Length` is over the body limit is refused
//! (413) before a byte of its body is read, and a body that does not arrive whole within
//! `--body-read-timeout` is answered 408, so a client trickling a body cannot hold a connection
//! and its buffer for ever.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{CONNECTION, CONTENT_LENGTH};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use super::backend::InferenceBackend;
use super::error::ApiError;
use super::handlers::fail;
use super::state::AppState;

pub async fn limit_body<B: InferenceBackend>(State(state): State<Arc<AppState<B>>>, request: Request, next: Next) -> Response {
    let limit = state.config.max_body_bytes;
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        let response = closing(fail(&state, ApiError::PayloadTooLarge { limit }));
        // A body a little over the limit is likely already on its way: read and drop it (bounded in
        // bytes and time, nothing kept) so that closing the connection does not reset the answer away
        // before the client reads it. A far larger promise is not waited for.
        if n <= (limit as u64).saturating_add(LINGER_BYTES) {
            let _ = tokio::time::timeout(LINGER_TIME, discard(request.into_body(), n)).await;
        }
        return response;
    }
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(state.config.connections.body_read_timeout, Limited::new(body, limit).collect()).await;
    let bytes = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return closing(fail(&state, ApiError::PayloadTooLarge { limit })),
        // The client reset or sent a broken chunked encoding.
        Ok(Err(_)) => return closing(fail(&state, ApiError::MalformedBody)),
        Err(_elapsed) => return closing(fail(&state, ApiError::RequestTimeout)),
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// How far past the limit a declared body is still read and dropped before the connection closes.
const LINGER_BYTES: u64 = 1 << 20;
const LINGER_TIME: std::time::Duration = std::time::Duration::from_millis(500);

/// The body's rest is not read: the connection cannot carry another request, and saying so keeps
/// clients from reusing it.
fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Reads and drops up to `max` bytes of `body`.
async fn discard(mut body: Body, max: u64) {
    let mut seen = 0u64;
    while seen < max {
        match body.frame().await {
            Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |d| d.len() as u64),
            _ => break,
        }
    }
}

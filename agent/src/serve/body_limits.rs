//! In front of every route: a request whose `Content-Length` is over the body limit is refused
//! (413) before a byte of its body is read, and a body that does not arrive whole within
//! `--body-read-timeout` is answered 408, so a client trickling a body cannot hold a connection
//! and its buffer for ever.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::CONTENT_LENGTH;
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
    if declared.is_some_and(|n| n > limit as u64) {
        return fail(&state, ApiError::PayloadTooLarge { limit });
    }
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(state.config.connections.body_read_timeout, Limited::new(body, limit).collect()).await;
    let bytes = match read {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => return fail(&state, ApiError::PayloadTooLarge { limit }),
        // The client reset or sent a broken chunked encoding.
        Ok(Err(_)) => return fail(&state, ApiError::MalformedBody),
        Err(_elapsed) => return fail(&state, ApiError::RequestTimeout),
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

//! The server's one error type. Every variant has a stable label and maps to an HTTP status and an
//! OpenAI-shaped JSON body, so clients' SDKs raise the matching exception class.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use peregrine_api::{ErrorBody, ErrorDetail};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Syntactically broken JSON or a body that is not UTF-8.
    #[error("invalid JSON body: {0}")]
    MalformedJson(String),
    /// Well-formed JSON naming a field the API does not know (OpenAI answers 400 for this).
    #[error("unrecognized request argument supplied: {0}")]
    UnknownField(String),
    /// Well-formed JSON of the wrong shape: wrong types, missing required fields.
    #[error("{message}")]
    Unprocessable { message: String, param: Option<String> },
    /// Values out of range, unsupported options.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<String> },
    /// Prompt plus completion longer than the model's context.
    #[error("{0}")]
    ContextLengthExceeded(String),
    #[error("{0}")]
    Unauthorized(String),
    /// Authenticated, but the key may not do this (a tenant key on an admin endpoint).
    #[error("{0}")]
    Forbidden(String),
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// An admin call naming an adapter that is not loaded.
    #[error("the LoRA adapter `{0}` cannot be found")]
    AdapterNotFound(String),
    /// An adapter that cannot be served: missing files, shapes that do not fit the model, rank
    /// above `--max-lora-rank`, unsupported PEFT features.
    #[error("{0}")]
    InvalidAdapter(String),
    /// No adapter could be read at the given path: outside the allowed roots, missing, not a folder
    /// or unreadable. One message for all of them, naming the adapter and no host path, so the
    /// answer does not reveal which folders exist.
    #[error("the LoRA adapter `{0}` cannot be loaded: no readable PEFT adapter (adapter_config.json and adapter_model.safetensors) at lora_path inside the server's adapter roots")]
    AdapterUnreadable(String),
    /// A loaded adapter whose evicted weights can no longer be re-read (its files were deleted or
    /// damaged after the load). It will not heal by itself, so no `Retry-After`: an admin load of
    /// the adapter clears it.
    #[error("the LoRA adapter `{0}` is unavailable: its files can no longer be read on the server; it must be loaded again")]
    AdapterUnavailable(String),
    #[error("LoRA is not enabled on this server; start it with --enable-lora or --lora-modules")]
    LoraDisabled,
    #[error("no route for {0}")]
    RouteNotFound(String),
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// The body did not arrive whole within `--body-read-timeout`.
    #[error("the request body was not received in time")]
    RequestTimeout,
    /// The body broke off or its chunked encoding is invalid.
    #[error("the request body could not be read")]
    MalformedBody,
    /// A tenant's requests- or tokens-per-minute limit.
    #[error("{message}")]
    RateLimited { message: String, retry_after: Duration },
    /// The waiting queue is full: back-pressure instead of unbounded memory.
    #[error("the server is at capacity ({waiting} requests waiting); retry later")]
    QueueFull { waiting: usize, retry_after: Duration },
    #[error("the server is shutting down")]
    Draining,
    /// The model is still loading (only the loading server answers with it).
    #[error("the model is still loading; retry later")]
    Loading,
    #[error("the engine has stopped")]
    EngineStopped,
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        ApiError::InvalidRequest { message: message.into(), param: param.into() }
    }

    /// A short stable label: the JSON `code`, a metrics label and a log field.
    pub fn label(&self) -> &'static str {
        match self {
            ApiError::MalformedJson(_) => "invalid_json",
            ApiError::UnknownField(_) => "unknown_parameter",
            ApiError::Unprocessable { .. } => "invalid_type",
            ApiError::InvalidRequest { .. } => "invalid_value",
            ApiError::ContextLengthExceeded(_) => "context_length_exceeded",
            ApiError::Unauthorized(_) => "invalid_api_key",
            ApiError::Forbidden(_) => "permission_denied",
            ApiError::ModelNotFound(_) => "model_not_found",
            ApiError::AdapterNotFound(_) => "adapter_not_found",
            ApiError::InvalidAdapter(_) | ApiError::AdapterUnreadable(_) => "invalid_adapter",
            ApiError::AdapterUnavailable(_) => "adapter_unavailable",
            ApiError::LoraDisabled => "lora_disabled",
            ApiError::RouteNotFound(_) => "route_not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::PayloadTooLarge { .. } => "payload_too_large",
            ApiError::RequestTimeout => "request_timeout",
            ApiError::MalformedBody => "invalid_body",
            ApiError::RateLimited { .. } => "rate_limit_exceeded",
            ApiError::QueueFull { .. } => "queue_full",
            ApiError::Draining => "draining",
            ApiError::Loading => "model_loading",
            ApiError::EngineStopped => "engine_stopped",
            ApiError::Internal(_) => "internal_error",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::MalformedJson(_)
            | ApiError::UnknownField(_)
            | ApiError::InvalidRequest { .. }
            | ApiError::ContextLengthExceeded(_)
            | ApiError::InvalidAdapter(_)
            | ApiError::AdapterUnreadable(_)
            | ApiError::LoraDisabled
            | ApiError::MalformedBody => StatusCode::BAD_REQUEST,
            ApiError::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unprocessable { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::ModelNotFound(_) | ApiError::AdapterNotFound(_) | ApiError::RouteNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RateLimited { .. } | ApiError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Draining | ApiError::Loading | ApiError::EngineStopped | ApiError::AdapterUnavailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's error class for the JSON `type` field.
    fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            StatusCode::INTERNAL_SERVER_ERROR => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn param(&self) -> Option<String> {
        match self {
            ApiError::UnknownField(f) => Some(f.clone()),
            ApiError::Unprocessable { param, .. } | ApiError::InvalidRequest { param, .. } => param.clone(),
            ApiError::ContextLengthExceeded(_) => Some("messages".to_string()),
            ApiError::ModelNotFound(_) | ApiError::AdapterUnavailable(_) => Some("model".to_string()),
            ApiError::AdapterNotFound(_) => Some("lora_name".to_string()),
            ApiError::InvalidAdapter(_) | ApiError::AdapterUnreadable(_) => Some("lora_path".to_string()),
            _ => None,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::RateLimited { retry_after, .. } | ApiError::QueueFull { retry_after, .. } => Some(*retry_after),
            ApiError::Draining => Some(Duration::from_secs(1)),
            ApiError::Loading => Some(Duration::from_secs(5)),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind().to_string(),
                param: self.param(),
                code: Some(self.label().to_string()),
            },
        }
    }
}

impl From<peregrine_api::ValidationError> for ApiError {
    fn from(e: peregrine_api::ValidationError) -> Self {
        ApiError::InvalidRequest { message: e.message, param: e.param }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let Some(after) = self.retry_after() {
            // Whole seconds, rounded up, never 0: clients sleep at least this long.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            if let Ok(v) = HeaderValue::from_str(&secs.max(1).to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        response
    }
}

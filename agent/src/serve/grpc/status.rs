//! [`ApiError`] → gRPC status: the HTTP status's meaning in gRPC's codes, the same message, and
//! the error's stable label (the OpenAI body's `code`) in the `x-peregrine-error` metadata key.

use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::serve::error::ApiError;

/// The metadata key that carries [`ApiError::label`].
pub const ERROR_LABEL_KEY: &str = "x-peregrine-error";

pub fn code(e: &ApiError) -> Code {
    match e {
        ApiError::MalformedJson(_)
        | ApiError::UnknownField(_)
        | ApiError::Unprocessable { .. }
        | ApiError::InvalidRequest { .. }
        | ApiError::ContextLengthExceeded(_)
        | ApiError::InvalidAdapter(_)
        | ApiError::AdapterUnreadable(_)
        | ApiError::MalformedBody => Code::InvalidArgument,
        ApiError::Unauthorized(_) => Code::Unauthenticated,
        ApiError::Forbidden(_) => Code::PermissionDenied,
        ApiError::ModelNotFound(_) | ApiError::AdapterNotFound(_) | ApiError::RouteNotFound(_) => Code::NotFound,
        ApiError::MethodNotAllowed | ApiError::LoraDisabled => Code::Unimplemented,
        // Too large a message, too many requests: gRPC's "some resource has been exhausted".
        ApiError::PayloadTooLarge { .. } | ApiError::RateLimited { .. } | ApiError::QueueFull { .. } => Code::ResourceExhausted,
        ApiError::RequestTimeout => Code::DeadlineExceeded,
        ApiError::Draining | ApiError::Loading | ApiError::EngineStopped | ApiError::AdapterUnavailable(_) => Code::Unavailable,
        ApiError::Internal(_) => Code::Internal,
    }
}

pub fn to_status(e: &ApiError) -> Status {
    let mut status = Status::new(code(e), e.to_string());
    status.metadata_mut().insert(ERROR_LABEL_KEY, MetadataValue::from_static(e.label()));
    status
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn bad_input_overload_and_loading_map_to_their_codes() {
        let invalid = ApiError::invalid(Some("input".to_string()), "input must not be an empty list");
        let s = to_status(&invalid);
        assert_eq!(s.code(), Code::InvalidArgument);
        assert_eq!(s.message(), "input must not be an empty list");
        assert_eq!(s.metadata().get(ERROR_LABEL_KEY).and_then(|v| v.to_str().ok()), Some("invalid_value"));
        let full = ApiError::QueueFull { waiting: 3, retry_after: Duration::from_secs(1) };
        assert_eq!(code(&full), Code::ResourceExhausted);
        assert_eq!(code(&ApiError::PayloadTooLarge { limit: 10 }), Code::ResourceExhausted);
        assert_eq!(code(&ApiError::Loading), Code::Unavailable);
        assert_eq!(code(&ApiError::Draining), Code::Unavailable);
        assert_eq!(code(&ApiError::ModelNotFound("m".into())), Code::NotFound);
        assert_eq!(code(&ApiError::Unauthorized("no key".into())), Code::Unauthenticated);
        assert_eq!(code(&ApiError::Internal("x".into())), Code::Internal);
    }
}

//! Request bodies → typed requests, with every failure mapped to an OpenAI-style error. Fuzzed by
//! the proptests below: arbitrary bytes must give `Ok` or an `ApiError`, never a panic.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use peregrine_api::Validate;
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use super::error::ApiError;

/// Parses and validates a JSON request body.
pub fn parse_request<T: DeserializeOwned + Validate>(body: &[u8]) -> Result<T, ApiError> {
    let request: T = serde_json::from_slice(body).map_err(|e| {
        // serde reports a type mismatch before reaching broken syntax further on (`[[[[` is
        // "expected a map"), so the whole body is checked for well-formedness on this error path.
        match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Err(syntax) => ApiError::MalformedJson(syntax.to_string()),
            Ok(_) => json_error(e),
        }
    })?;
    request.validate()?;
    Ok(request)
}

fn json_error(e: serde_json::Error) -> ApiError {
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => ApiError::MalformedJson(e.to_string()),
        Category::Data => {
            let message = e.to_string();
            match unknown_field_name(&message) {
                Some(field) => ApiError::UnknownField(field),
                None => ApiError::Unprocessable { message, param: None },
            }
        }
    }
}

/// The stray field names in serde's "unknown field `name`, expected ..." (from
/// `deny_unknown_fields`) or in the API's own "unknown field `a`, `b`" (from
/// [`peregrine_api::NoUnknownFields`]), joined with ", ".
fn unknown_field_name(message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field ")?;
    let names_part = rest.split(", expected").next().unwrap_or(rest);
    let names: Vec<&str> = names_part.split('`').skip(1).step_by(2).collect();
    (!names.is_empty()).then(|| names.join(", "))
}

/// The body, or the error for a body that could not be read (too large, connection broken).
pub fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge { limit }
        } else {
            ApiError::MalformedJson(rejection.body_text())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use peregrine_api::{ChatCompletionRequest, CompletionRequest};
    use proptest::prelude::*;

    #[test]
    fn error_kinds() {
        let e = parse_request::<CompletionRequest>(br#"{"model": "m", "prompt": "x""#).unwrap_err();
        assert!(matches!(e, ApiError::MalformedJson(_)), "{e:?}");
        let e = parse_request::<CompletionRequest>(b"[[[[").unwrap_err();
        assert!(matches!(e, ApiError::MalformedJson(_)), "{e:?}");
        let e = parse_request::<CompletionRequest>(br#"{"model": "m", "prompt": "x", "foo": 1}"#).unwrap_err();
        assert!(matches!(&e, ApiError::UnknownField(f) if f == "foo"), "{e:?}");
        // Every stray field is named, at the top level of both requests (flattened fields are
        // known), and inside messages (serde's own deny_unknown_fields).
        let e = parse_request::<ChatCompletionRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "mood": 1, "tone": "x"}"#,
        )
        .unwrap_err();
        assert!(matches!(&e, ApiError::UnknownField(f) if f == "mood, tone"), "{e:?}");
        assert_eq!(e.label(), "unknown_parameter");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let e = parse_request::<ChatCompletionRequest>(br#"{"model": "m", "messages": [{"role": "user", "content": "x", "mood": 1}]}"#)
            .unwrap_err();
        assert!(matches!(&e, ApiError::UnknownField(f) if f == "mood"), "{e:?}");
        let ok = parse_request::<CompletionRequest>(br#"{"model": "m", "prompt": "x", "top_k": 5, "stream": true, "stop": ["a"]}"#).unwrap();
        assert_eq!((ok.sampling.top_k, ok.sampling.stream), (Some(5), true));
        let e = parse_request::<CompletionRequest>(br#"{"model": "m", "prompt": "x", "max_tokens": "7"}"#).unwrap_err();
        assert!(matches!(e, ApiError::Unprocessable { .. }), "{e:?}");
        let e = parse_request::<CompletionRequest>(br#"{"model": "m", "prompt": "x", "max_tokens": -1}"#).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "max_tokens"), "{e:?}");
        let e = parse_request::<CompletionRequest>(b"{\"model\": \"m\", \"prompt\": \"\xff\xfe\"}").unwrap_err();
        assert!(matches!(e, ApiError::MalformedJson(_)), "{e:?}");
        let e = parse_request::<ChatCompletionRequest>(br#"{"model": "m", "messages": []}"#).unwrap_err();
        assert!(matches!(&e, ApiError::InvalidRequest { param: Some(p), .. } if p == "messages"), "{e:?}");
        assert!(parse_request::<ChatCompletionRequest>(br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#).is_ok());
    }

    /// JSON-ish fragments that reach deeper into the parser than uniform random bytes do.
    fn jsonish() -> impl Strategy<Value = Vec<u8>> {
        let atoms = prop::sample::select(vec![
            "{", "}", "[", "]", ",", ":", "\"model\"", "\"prompt\"", "\"messages\"", "\"role\"", "\"user\"",
            "\"content\"", "\"max_tokens\"", "\"stop\"", "\"stream\"", "\"logprobs\"", "\"temperature\"", "-1",
            "1e309", "0", "18446744073709551616", "true", "null", "\"x\"", "\"\\ud800\"", "[1,2]", " ",
        ]);
        prop::collection::vec(prop_oneof![atoms.prop_map(|s| s.as_bytes().to_vec()), any::<u8>().prop_map(|b| vec![b])], 0..40)
            .prop_map(|parts| parts.concat())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
        #[test]
        fn parser_never_panics(body in jsonish()) {
            let _ = parse_request::<CompletionRequest>(&body);
            let _ = parse_request::<ChatCompletionRequest>(&body);
        }

        #[test]
        fn parser_never_panics_on_bytes(body in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_request::<CompletionRequest>(&body);
            let _ = parse_request::<ChatCompletionRequest>(&body);
        }
    }
}

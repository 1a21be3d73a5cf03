//! Per-request logits processing and sampling on one host logits row.
//!
//! Order (vLLM's): log-probabilities are taken from the raw model logits; then penalties, then
//! greedy argmax when temperature is 0, else temperature, top-k, top-p (on the top-k survivors),
//! min-p, and one draw from the request's own RNG.

mod filters;
mod logprobs;
mod penalties;
mod sampler;

pub use filters::{keep_mask, softmax};
pub use logprobs::{log_softmax, top_logprobs};
pub use penalties::{apply_penalties, PenaltyState};
pub use sampler::{argmax, request_seed, RequestSampler};

use crate::request::SamplingParams;
use crate::{EngineError, Result};

/// Below this temperature sampling is greedy (dividing by it would overflow).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;
/// Most `logit_bias` entries one request may carry (bounds the per-token work; OpenAI documents
/// no limit, vLLM none).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// `logit_bias` values must lie in [-MAX_BIAS, MAX_BIAS] (OpenAI's range).
pub const MAX_BIAS: f32 = 100.0;

/// Rejects parameters outside the ranges the OpenAI API and vLLM accept.
pub fn validate(params: &SamplingParams) -> Result<()> {
    let bad = |msg: String| Err(EngineError::InvalidRequest(msg));
    if !params.temperature.is_finite() || params.temperature < 0.0 {
        return bad(format!("temperature must be >= 0, got {}", params.temperature));
    }
    if !(params.top_p > 0.0 && params.top_p <= 1.0) {
        return bad(format!("top_p must be in (0, 1], got {}", params.top_p));
    }
    if !(0.0..=1.0).contains(&params.min_p) {
        return bad(format!("min_p must be in [0, 1], got {}", params.min_p));
    }
    if !params.repetition_penalty.is_finite() || params.repetition_penalty <= 0.0 {
        return bad(format!("repetition_penalty must be > 0, got {}", params.repetition_penalty));
    }
    if !(-2.0..=2.0).contains(&params.presence_penalty) {
        return bad(format!("presence_penalty must be in [-2, 2], got {}", params.presence_penalty));
    }
    if !(-2.0..=2.0).contains(&params.frequency_penalty) {
        return bad(format!("frequency_penalty must be in [-2, 2], got {}", params.frequency_penalty));
    }
    if params.max_tokens == 0 {
        return bad("max_tokens must be at least 1".into());
    }
    if params.logit_bias.len() > MAX_LOGIT_BIAS {
        return bad(format!("logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {}", params.logit_bias.len()));
    }
    if let Some((id, b)) = params.logit_bias.iter().find(|(_, b)| !(-MAX_BIAS..=MAX_BIAS).contains(b)) {
        return bad(format!("logit_bias values must be in [-{MAX_BIAS}, {MAX_BIAS}], got {b} for token {id}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_out_of_range_params() {
        assert!(validate(&SamplingParams::default()).is_ok());
        let cases = [
            SamplingParams { temperature: -0.1, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { top_p: 1.5, ..Default::default() },
            SamplingParams { min_p: -0.1, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { presence_penalty: 2.5, ..Default::default() },
            SamplingParams { frequency_penalty: -3.0, ..Default::default() },
            SamplingParams { max_tokens: 0, ..Default::default() },
            SamplingParams { logit_bias: vec![(1, 100.5)], ..Default::default() },
            SamplingParams { logit_bias: vec![(1, f32::NAN)], ..Default::default() },
            SamplingParams { logit_bias: (0..=MAX_LOGIT_BIAS as u32).map(|i| (i, 1.0)).collect(), ..Default::default() },
        ];
        for p in cases {
            assert!(matches!(validate(&p), Err(EngineError::InvalidRequest(_))), "{p:?}");
        }
    }
}

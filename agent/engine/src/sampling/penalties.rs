//! Repetition (HF/vLLM), presence and frequency (OpenAI) penalties.

use std::collections::{HashMap, HashSet};

use crate::request::SamplingParams;

/// What the penalties need to know about a request's tokens so far.
#[derive(Debug, Clone, Default)]
pub struct PenaltyState {
    /// Every distinct token of the prompt and the output (repetition penalty).
    seen: HashSet<u32>,
    /// Occurrences of each token in the output only (presence and frequency penalties).
    output_counts: HashMap<u32, u32>,
}

impl PenaltyState {
    pub fn new(prompt: &[u32]) -> Self {
        PenaltyState { seen: prompt.iter().copied().collect(), output_counts: HashMap::new() }
    }

    pub fn record_output(&mut self, token: u32) {
        self.seen.insert(token);
        *self.output_counts.entry(token).or_insert(0) += 1;
    }
}

/// Applies the penalties the params enable, in place. Token ids outside the row are ignored.
pub fn apply_penalties(logits: &mut [f32], params: &SamplingParams, state: &PenaltyState) {
    if params.repetition_penalty != 1.0 {
        let p = params.repetition_penalty;
        for &t in &state.seen {
            if let Some(l) = logits.get_mut(t as usize) {
                // Dividing a positive logit and multiplying a negative one both lower it for p > 1.
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        for (&t, &count) in &state.output_counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetition_penalty_covers_prompt_and_output() {
        let params = SamplingParams { repetition_penalty: 2.0, ..Default::default() };
        let mut state = PenaltyState::new(&[0, 1, 1]);
        state.record_output(3);
        let mut logits = vec![4.0, -4.0, 1.0, 0.5];
        apply_penalties(&mut logits, &params, &state);
        // Token 0: 4/2; token 1: -4*2 (applied once despite two occurrences); token 2 untouched.
        assert_eq!(logits, vec![2.0, -8.0, 1.0, 0.25]);
    }

    #[test]
    fn presence_and_frequency_cover_output_only() {
        let params = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut state = PenaltyState::new(&[2]);
        for t in [0, 0, 0, 1] {
            state.record_output(t);
        }
        let mut logits = vec![1.0, 1.0, 1.0];
        apply_penalties(&mut logits, &params, &state);
        // 1 - (0.25*3 + 0.5), 1 - (0.25 + 0.5), prompt-only token 2 untouched.
        assert_eq!(logits, vec![-0.25, 0.25, 1.0]);
    }

    #[test]
    fn neutral_params_change_nothing_and_out_of_range_ids_are_ignored() {
        let mut state = PenaltyState::new(&[0, 99]);
        state.record_output(100);
        let mut logits = vec![1.5, -2.0];
        apply_penalties(&mut logits, &SamplingParams::default(), &state);
        assert_eq!(logits, vec![1.5, -2.0]);
        let params = SamplingParams { repetition_penalty: 1.3, presence_penalty: 1.0, ..Default::default() };
        apply_penalties(&mut logits, &params, &state);
        assert_eq!(logits, vec![1.5 / 1.3, -2.0]);
    }
}

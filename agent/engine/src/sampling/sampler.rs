//! One request's sampler: its parameters, penalty state and RNG.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use super::filters::keep_mask;
use super::logprobs::{log_softmax, top_logprobs};
use super::penalties::{apply_penalties, PenaltyState};
use super::GREEDY_TEMPERATURE;
use crate::plan::{MaskWriter, RowConstraints, RowSampling};
use crate::request::{RequestId, SampledToken, SamplingParams};
use crate::structured::{GrammarOutcome, GrammarState};

/// Highest logit, lowest id among ties (NaNs never win).
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] || logits[best].is_nan() && !l.is_nan() {
            best = i;
        }
    }
    best
}

/// The RNG seed of a request: its own `seed`, else derived from its id and the engine's seed so that
/// unseeded requests still differ from each other and runs of the engine are reproducible.
pub fn request_seed(params: &SamplingParams, id: RequestId, engine_seed: u64) -> u64 {
    match params.seed {
        Some(s) => s,
        None => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&engine_seed.to_le_bytes());
            bytes[8..].copy_from_slice(&id.to_le_bytes());
            xxhash_rust::xxh3::xxh3_64(&bytes)
        }
    }
}

/// Samples one request's tokens. Owns its RNG, so its draws depend only on its own logits.
#[derive(Debug)]
pub struct RequestSampler {
    params: SamplingParams,
    penalties: PenaltyState,
    rng: ChaCha20Rng,
    /// Structured outputs: the sequence's grammar, whose mask is applied before everything else.
    grammar: Option<GrammarState>,
}

impl RequestSampler {
    pub fn new(params: SamplingParams, prompt: &[u32], seed: u64) -> Self {
        let grammar = params.grammar.as_ref().map(GrammarState::new);
        RequestSampler { params, penalties: PenaltyState::new(prompt), rng: ChaCha20Rng::seed_from_u64(seed), grammar }
    }

    /// Where the grammar stands after the latest token ([`GrammarOutcome::Continue`] without one).
    pub fn grammar_outcome(&self) -> GrammarOutcome {
        self.grammar.as_ref().map_or(GrammarOutcome::Continue, GrammarState::outcome)
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from the model's raw logits row and records it for the penalties.
    pub fn sample(&mut self, raw: &[f32]) -> SampledToken {
        let mut logits = raw.to_vec();
        if let Some(g) = &mut self.grammar {
            g.apply(&mut logits);
        }
        // A forbidden token stays forbidden: -inf plus any bias is -inf.
        for &(id, bias) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        apply_penalties(&mut logits, &self.params, &self.penalties);
        let token = if self.params.temperature < GREEDY_TEMPERATURE {
            argmax(&logits)
        } else {
            self.draw(&mut logits)
        };
        self.penalties.record_output(token as u32);
        if let Some(g) = &mut self.grammar {
            g.commit(token as u32);
        }

        let (logprob, top) = match self.params.logprobs {
            Some(n) => {
                let lp = log_softmax(raw);
                (lp.get(token).copied(), top_logprobs(&lp, n))
            }
            None => (None, Vec::new()),
        };
        SampledToken { token_id: token as u32, logprob, top_logprobs: top }
    }

    /// How the device should pick this request's next token, for backends that sample on their
    /// device: a draw with this request's parameters and its one RNG number for the token, or
    /// [`RowSampling::Host`] where penalties, logit bias, logprobs or a grammar need the logits on
    /// the host (for backends that cannot apply masks and biases themselves; see
    /// [`RequestSampler::device_plan_constrained`] for those that can).
    pub fn device_plan(&mut self) -> RowSampling {
        if self.has_constraints() {
            return RowSampling::Host;
        }
        self.device_plan_constrained()
    }

    /// [`RequestSampler::device_plan`] for backends that apply token masks and logit biases on
    /// their device (`Backend::applies_constraints_on_device`): only penalties and logprobs need
    /// the host; a grammar's mask and the biases go with [`RequestSampler::push_constraints`].
    pub fn device_plan_constrained(&mut self) -> RowSampling {
        let p = &self.params;
        let penalties = p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if penalties || p.logprobs.is_some() {
            return RowSampling::Host;
        }
        let (temperature, top_k, top_p, min_p) = (p.temperature, p.top_k.min(u32::MAX as usize) as u32, p.top_p, p.min_p);
        let uniform = if temperature < GREEDY_TEMPERATURE {
            0.0 // greedy draws nothing, as on the host
        } else {
            // f64 → f32 may round up to 1.0; the draw needs [0, 1).
            (self.rng.random::<f64>() as f32).min(1.0 - f32::EPSILON)
        };
        RowSampling::Draw { temperature, top_k, top_p, min_p, uniform }
    }

    /// Whether the next token is constrained by a grammar or logit biases.
    pub fn has_constraints(&self) -> bool {
        self.grammar.is_some() || !self.params.logit_bias.is_empty()
    }

    /// Adds this request's grammar mask (waiting for it if it is still being computed) and logit
    /// biases for its next token to `out`, as logits row `row`: what the device applies for a row
    /// planned by [`RequestSampler::device_plan_constrained`], the same as [`RequestSampler::sample`]
    /// does on the host (the mask, then the biases in order).
    pub fn push_constraints(&mut self, row: usize, out: &mut RowConstraints) {
        let has_grammar = self.grammar.is_some();
        let mut write = |words: &mut [u32]| self.grammar.as_mut().is_some_and(|g| g.write_mask(words));
        let write: Option<MaskWriter<'_>> = if has_grammar { Some(&mut write) } else { None };
        out.push(row, write, &self.params.logit_bias);
    }

    /// Records a token the device picked under [`RequestSampler::device_plan`].
    pub fn accept_device_token(&mut self, token: u32) -> SampledToken {
        self.penalties.record_output(token);
        if let Some(g) = &mut self.grammar {
            g.commit(token);
        }
        SampledToken { token_id: token, logprob: None, top_logprobs: Vec::new() }
    }

    fn draw(&mut self, logits: &mut [f32]) -> usize {
        let t = self.params.temperature;
        for l in logits.iter_mut() {
            *l /= t;
        }
        let kept = keep_mask(logits, self.params.top_k, self.params.top_p, self.params.min_p);
        // Exactly one RNG draw per sampled token, so a request's stream of draws is fixed by its
        // seed however its steps are batched.
        let u: f64 = self.rng.random();
        let total: f64 = kept.iter().map(|&(_, p)| p).sum();
        let target = u * total;
        let mut cum = 0.0;
        for &(id, p) in &kept {
            cum += p;
            if cum > target {
                return id;
            }
        }
        // Rounding left `target` past the sum, or every logit was -inf: fall back deterministically.
        kept.last().map(|&(id, _)| id).unwrap_or_else(|| argmax(logits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::log_softmax;

    #[test]
    fn argmax_prefers_lowest_id_on_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.1]), 1);
        assert_eq!(argmax(&[-1.0]), 0);
    }

    #[test]
    fn greedy_takes_argmax_after_penalties() {
        let params = SamplingParams { repetition_penalty: 4.0, ..SamplingParams::greedy(4) };
        // Token 0 is in the prompt: 4.0 / 4 = 1.0 < 2.0.
        let mut s = RequestSampler::new(params, &[0], 1);
        assert_eq!(s.sample(&[4.0, 2.0, 1.0]).token_id, 1);
        // Now token 1 is penalised too: 4/4 = 1, 2/4 = 0.5, 1 → tie 1.0 between 0 and 2: lowest id.
        assert_eq!(s.sample(&[4.0, 2.0, 1.0]).token_id, 0);
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let params = SamplingParams { temperature: 1.0, max_tokens: 64, ..Default::default() };
        let row: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
        let run = |seed| {
            let mut s = RequestSampler::new(params.clone(), &[], seed);
            (0..64).map(|_| s.sample(&row).token_id).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }

    #[test]
    fn request_seed_uses_explicit_seed_else_id_and_engine_seed() {
        let seeded = SamplingParams { seed: Some(5), ..Default::default() };
        assert_eq!(request_seed(&seeded, 1, 0), 5);
        assert_eq!(request_seed(&seeded, 2, 9), 5);
        let p = SamplingParams::default();
        assert_ne!(request_seed(&p, 1, 0), request_seed(&p, 2, 0));
        assert_ne!(request_seed(&p, 1, 0), request_seed(&p, 1, 1));
        assert_eq!(request_seed(&p, 1, 0), request_seed(&p, 1, 0));
    }

    #[test]
    fn draws_follow_the_tempered_distribution() {
        // Logits ln(1), ln(2), ln(3), ln(4); temperature 0.5 squares the odds: 1:4:9:16 over 30.
        let row: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        let params = SamplingParams { temperature: 0.5, max_tokens: 1, ..Default::default() };
        let mut s = RequestSampler::new(params, &[], 7);
        let n = 40_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&row).token_id as usize] += 1;
        }
        for (i, want) in [1.0, 4.0, 9.0, 16.0].iter().enumerate() {
            let got = counts[i] as f64 / n as f64;
            assert!((got - want / 30.0).abs() < 0.01, "token {i}: {got} vs {}", want / 30.0);
        }
    }

    #[test]
    fn draws_respect_top_k_and_top_p() {
        let row: Vec<f32> = [1.0f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        // top_k 2 → tokens 3 (4/7) and 2 (3/7).
        let params = SamplingParams { top_k: 2, max_tokens: 1, ..Default::default() };
        let mut s = RequestSampler::new(params, &[], 3);
        let n = 20_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            counts[s.sample(&row).token_id as usize] += 1;
        }
        assert_eq!(counts[0] + counts[1], 0);
        assert!((counts[3] as f64 / n as f64 - 4.0 / 7.0).abs() < 0.015, "{counts:?}");
        // top_p 0.3 keeps only the best token (0.4 >= 0.3).
        let params = SamplingParams { top_p: 0.3, max_tokens: 1, ..Default::default() };
        let mut s = RequestSampler::new(params, &[], 3);
        assert!((0..200).all(|_| s.sample(&row).token_id == 3));
    }

    #[test]
    fn logprobs_are_log_softmax_of_raw_logits() {
        let row = [0.5f32, 2.0, -1.0, 1.0];
        // Penalties and temperature must not change reported logprobs.
        let params = SamplingParams {
            logprobs: Some(2),
            repetition_penalty: 3.0,
            temperature: 0.0,
            ..Default::default()
        };
        let mut s = RequestSampler::new(params, &[1], 0);
        let out = s.sample(&row);
        // 2.0 / 3 = 0.667 < 1.0: greedy picks token 3 after the penalty.
        assert_eq!(out.token_id, 3);
        let lp = log_softmax(&row);
        let lse = row.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        assert!((out.logprob.unwrap() as f64 - (1.0 - lse)).abs() < 1e-6);
        assert_eq!(out.top_logprobs.len(), 2);
        assert_eq!(out.top_logprobs[0].token_id, 1);
        assert_eq!(out.top_logprobs[0].logprob, lp[1]);
        assert_eq!(out.top_logprobs[1].token_id, 3);

        let mut plain = RequestSampler::new(SamplingParams::greedy(1), &[], 0);
        let out = plain.sample(&row);
        assert_eq!(out.logprob, None);
        assert!(out.top_logprobs.is_empty());
    }

    #[test]
    fn logit_bias_shifts_logits_before_penalties_but_not_logprobs() {
        let row = [1.0f32, 2.0, 0.5, 1.5];
        // +100 makes token 2 certain; -100 makes token 1 impossible in practice.
        let forced = SamplingParams { logit_bias: vec![(2, 100.0)], temperature: 1.0, ..Default::default() };
        let mut s = RequestSampler::new(forced, &[], 5);
        assert!((0..50).all(|_| s.sample(&row).token_id == 2));
        let banned = SamplingParams { logit_bias: vec![(1, -100.0)], logprobs: Some(1), ..SamplingParams::greedy(4) };
        let out = RequestSampler::new(banned, &[], 0).sample(&row);
        assert_eq!(out.token_id, 3);
        // Logprobs are the raw logits' (vLLM's default), bias or not.
        assert_eq!(out.top_logprobs[0].token_id, 1);
        assert_eq!(out.logprob, Some(log_softmax(&row)[3]));
        // Bias then repetition penalty: (1.0 + 1.5) / 2 = 1.25 < 1.5, so token 3 still wins; with
        // the penalty first it would be 0.5 + 1.5 = 2.0 and token 0 would.
        let order = SamplingParams { logit_bias: vec![(0, 1.5), (1, -10.0)], repetition_penalty: 2.0, ..SamplingParams::greedy(4) };
        assert_eq!(RequestSampler::new(order, &[0], 0).sample(&row).token_id, 3);
        // An id past the row is ignored here (submit refuses it before).
        let outside = SamplingParams { logit_bias: vec![(99, 5.0)], ..SamplingParams::greedy(4) };
        assert_eq!(RequestSampler::new(outside, &[], 0).sample(&row).token_id, 1);
    }

    #[test]
    fn device_plans_carry_the_same_draw_the_host_would_make() {
        let params = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.9, min_p: 0.05, ..Default::default() };
        let mut device = RequestSampler::new(params.clone(), &[], 7);
        let mut host_rng = ChaCha20Rng::seed_from_u64(7);
        for _ in 0..3 {
            let want = host_rng.random::<f64>() as f32;
            match device.device_plan() {
                RowSampling::Draw { temperature, top_k, top_p, min_p, uniform } => {
                    assert_eq!((temperature, top_k, top_p, min_p), (0.8, 40, 0.9, 0.05));
                    assert_eq!(uniform, want.min(1.0 - f32::EPSILON));
                }
                RowSampling::Host => panic!("plain sampling must run on the device"),
            }
        }
        // Greedy draws nothing (as on the host), penalties and logprobs need the host.
        let mut greedy = RequestSampler::new(SamplingParams::greedy(4), &[], 7);
        assert!(matches!(greedy.device_plan(), RowSampling::Draw { temperature, uniform, .. } if temperature == 0.0 && uniform == 0.0));
        for p in [
            SamplingParams { repetition_penalty: 1.1, ..params.clone() },
            SamplingParams { presence_penalty: 0.5, ..params.clone() },
            SamplingParams { frequency_penalty: -0.5, ..params.clone() },
            SamplingParams { logprobs: Some(0), ..params.clone() },
            SamplingParams { logit_bias: vec![(3, -1.0)], ..params.clone() },
        ] {
            assert_eq!(RequestSampler::new(p, &[], 1).device_plan(), RowSampling::Host);
        }
        // A device-picked token counts for the penalties like a host-picked one.
        let mut s = RequestSampler::new(SamplingParams { repetition_penalty: 4.0, ..SamplingParams::greedy(4) }, &[], 1);
        assert_eq!(s.accept_device_token(0).token_id, 0);
        assert_eq!(s.sample(&[4.0, 2.0, 1.0]).token_id, 1);
    }
}

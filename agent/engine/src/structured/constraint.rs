//! One sequence's grammar state during decoding.
//!
//! The mask for the next token is computed on rayon's pool as soon as the previous token is
//! committed, so it runs while the engine thread emits events, schedules and runs the next forward
//! pass; sampling then only waits for what is left of it. Each sequence has its own task: none
//! waits for another's mask.

use crossbeam_channel::{bounded, Receiver};
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

use super::compiler::CompiledGrammar;

/// Where a constrained sequence stands after its latest token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrammarOutcome {
    /// More tokens may follow.
    Continue,
    /// The grammar is complete (it allows nothing but the end): the sequence stops. llguidance
    /// reports this as soon as the last token of the grammar is committed, with no EOS needed.
    Complete,
    /// The grammar could not go on (a parser limit, a token it did not allow): the request fails.
    Failed(String),
}

type MaskResult = (Box<Matcher>, Result<SimpleVob, String>);

enum State {
    Ready(Box<Matcher>),
    Computing(Receiver<MaskResult>),
    Done,
    Failed(String),
}

pub struct GrammarState {
    state: State,
    eos_ids: std::sync::Arc<[u32]>,
}

impl std::fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Ready(_) => "ready",
            State::Computing(_) => "computing",
            State::Done => "done",
            State::Failed(_) => "failed",
        };
        f.debug_struct("GrammarState").field("state", &state).finish()
    }
}

impl GrammarState {
    /// A fresh matcher for one sequence; its first mask starts computing at once (during prefill).
    pub fn new(grammar: &CompiledGrammar) -> Self {
        let mut s = GrammarState { state: State::Ready(Box::new(grammar.start())), eos_ids: grammar.eos_ids().clone() };
        s.prefetch();
        s
    }

    /// Starts computing the next mask on rayon's pool.
    fn prefetch(&mut self) {
        if let State::Ready(_) = self.state {
            let State::Ready(mut matcher) = std::mem::replace(&mut self.state, State::Done) else { return };
            let (tx, rx) = bounded(1);
            rayon::spawn(move || {
                let mask = matcher.compute_mask().map_err(|e| e.to_string());
                // The sequence may be gone (aborted) by now: nobody to tell.
                let _ = tx.send((matcher, mask));
            });
            self.state = State::Computing(rx);
        }
    }

    /// Sets every logit the grammar does not allow to -inf. Waits for this sequence's mask if it is
    /// still being computed.
    pub fn apply(&mut self, logits: &mut [f32]) {
        let mut words = vec![0u32; logits.len().div_ceil(32)];
        if !self.write_mask(&mut words) {
            return;
        }
        for (id, l) in logits.iter_mut().enumerate() {
            if (words[id / 32] >> (id % 32)) & 1 == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Writes the allowed-token bitmask for the next token into `words` (bit `t % 32` of word
    /// `t / 32` set where token `t` is allowed; ids past the grammar's vocabulary are not), the form
    /// the GPU applies (token_mask.cu). Waits for this sequence's mask if it is still being computed.
    /// False where no mask applies (the grammar failed: the request ends after this token), `words`
    /// then untouched.
    pub fn write_mask(&mut self, words: &mut [u32]) -> bool {
        let (matcher, mask) = match std::mem::replace(&mut self.state, State::Done) {
            State::Ready(mut m) => {
                let mask = m.compute_mask().map_err(|e| e.to_string());
                (m, mask)
            }
            State::Computing(rx) => match rx.recv() {
                Ok(r) => r,
                Err(_) => {
                    self.state = State::Failed("the grammar mask task stopped".into());
                    return false;
                }
            },
            State::Done => {
                // Complete: only the end may follow (the worker ends the sequence before sampling
                // again; this keeps the mask right for any caller that samples once more).
                words.fill(0);
                self.allow_eos(words);
                return true;
            }
            State::Failed(e) => {
                self.state = State::Failed(e);
                return false;
            }
        };
        match mask {
            Ok(mask) => {
                let bits = mask.len().min(words.len() * 32);
                let src = mask.as_slice();
                for (i, w) in words.iter_mut().enumerate() {
                    let keep = bits.saturating_sub(i * 32).min(32);
                    let valid = if keep == 32 { u32::MAX } else { (1u32 << keep) - 1 };
                    *w = src.get(i).copied().unwrap_or(0) & valid;
                }
                // The grammar sees one end id; the model may have several: all of them end it.
                if self.eos_ids.first().is_some_and(|&e| mask.is_allowed(e)) {
                    self.allow_eos(words);
                }
                self.state = State::Ready(matcher);
                true
            }
            Err(e) => {
                self.state = State::Failed(format!("grammar: {e}"));
                false
            }
        }
    }

    fn allow_eos(&self, words: &mut [u32]) {
        for &e in self.eos_ids.iter() {
            if let Some(w) = words.get_mut(e as usize / 32) {
                *w |= 1 << (e % 32);
            }
        }
    }

    /// Advances the grammar by the sampled token and starts the next mask.
    pub fn commit(&mut self, token: u32) {
        let State::Ready(matcher) = &mut self.state else { return };
        // Any of the model's end ids ends the text the grammar sees.
        let token = if self.eos_ids.contains(&token) { self.eos_ids[0] } else { token };
        if let Err(e) = matcher.consume_token(token) {
            self.state = State::Failed(format!("grammar: {e}"));
            return;
        }
        if matcher.is_stopped() {
            self.state = State::Done;
            return;
        }
        self.prefetch();
    }

    pub fn outcome(&self) -> GrammarOutcome {
        match &self.state {
            State::Ready(_) | State::Computing(_) => GrammarOutcome::Continue,
            State::Done => GrammarOutcome::Complete,
            State::Failed(e) => GrammarOutcome::Failed(e.clone()),
        }
    }
}

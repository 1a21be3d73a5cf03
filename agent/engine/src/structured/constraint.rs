//! One sequence's grammar state during decoding.
//!
//! The mask for the next token is computed on the mask pool ([`super::mask_pool`]) as soon as the
//! previous token is committed, so it runs while the engine thread emits events, schedules and runs
//! the next forward pass; sampling then only waits for what is left of it. Each sequence has its
//! own task and its own matcher (lexer included: see [`CompiledGrammar::start`]): none waits for
//! another's mask. The task also packs the mask into the 32-bit words the device applies, so the
//! engine thread only copies it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver};
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

use super::compiler::CompiledGrammar;
use super::mask_pool;

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

/// What a mask task hands back: the matcher, and the next mask packed into words, or where the
/// committed token left the grammar.
struct Computed {
    matcher: Box<Matcher>,
    next: Next,
}

enum Next {
    Mask(Result<Vec<u32>, String>),
    /// The committed token completed the grammar.
    Complete,
    /// The committed token was refused.
    Failed(String),
}

/// Where a mask task gets its matcher.
enum MatcherSource {
    /// The sequence's own; the token to commit first, if any.
    Owned(Box<Matcher>, Option<u32>),
    /// A new sequence: its matcher is made from the grammar on the mask thread (a deep copy of the
    /// lexer, kept off the engine thread).
    Fresh(CompiledGrammar),
}

enum State {
    Ready(Box<Matcher>),
    /// A task has the matcher: it commits the sampled token (its outcome comes first, on
    /// `committed`, so the engine learns where the grammar stands without waiting for the mask),
    /// then computes the next mask.
    Computing { committed: Option<Committed>, rx: Receiver<Computed> },
    Done,
    Failed(String),
}

/// The outcome of a token committed on the mask pool: received once, then kept.
struct Committed {
    rx: Receiver<GrammarOutcome>,
    seen: OnceLock<GrammarOutcome>,
}

impl Committed {
    fn outcome(&self) -> &GrammarOutcome {
        self.seen.get_or_init(|| self.rx.recv().unwrap_or_else(|_| GrammarOutcome::Failed(TASK_STOPPED.into())))
    }
}

const TASK_STOPPED: &str = "the grammar mask task stopped";

pub struct GrammarState {
    state: State,
    eos_ids: Arc<[u32]>,
}

impl std::fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &self.state {
            State::Ready(..) => "ready",
            State::Computing { .. } => "computing",
            State::Done => "done",
            State::Failed(_) => "failed",
        };
        f.debug_struct("GrammarState").field("state", &state).finish()
    }
}

impl GrammarState {
    /// A fresh matcher for one sequence; it is made, and its first mask computed, on the mask pool
    /// at once (during prefill).
    pub fn new(grammar: &CompiledGrammar) -> Self {
        let eos_ids = grammar.eos_ids().clone();
        let (rx, _) = spawn_mask(MatcherSource::Fresh(grammar.clone()), eos_ids.clone());
        GrammarState { state: State::Computing { committed: None, rx }, eos_ids }
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
        let computed = match std::mem::replace(&mut self.state, State::Done) {
            // Asked twice for one state: computed here (llguidance answers it from its cache).
            State::Ready(mut matcher) => {
                let next = Next::Mask(compute_packed(&mut matcher, &self.eos_ids));
                Computed { matcher, next }
            }
            State::Computing { rx, .. } => match rx.recv() {
                Ok(c) => c,
                Err(_) => {
                    self.state = State::Failed(TASK_STOPPED.into());
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
        match computed.next {
            Next::Mask(Ok(packed)) => {
                let n = packed.len().min(words.len());
                words[..n].copy_from_slice(&packed[..n]);
                words[n..].fill(0);
                self.state = State::Ready(computed.matcher);
                true
            }
            Next::Mask(Err(e)) | Next::Failed(e) => {
                self.state = State::Failed(format!("grammar: {e}"));
                false
            }
            Next::Complete => {
                self.state = State::Done;
                self.write_mask(words)
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

    /// Advances the grammar by the sampled token and computes the next mask, both on the mask pool:
    /// the engine thread only hands the token over. [`GrammarState::outcome`] then waits for the
    /// commit alone (microseconds), [`GrammarState::write_mask`] for the mask.
    pub fn commit(&mut self, token: u32) {
        if !matches!(self.state, State::Ready(..)) {
            return;
        }
        let State::Ready(matcher) = std::mem::replace(&mut self.state, State::Done) else { return };
        // Any of the model's end ids ends the text the grammar sees.
        let token = if self.eos_ids.contains(&token) { self.eos_ids[0] } else { token };
        let (rx, outcome) = spawn_mask(MatcherSource::Owned(matcher, Some(token)), self.eos_ids.clone());
        let committed = outcome.map(|rx| Committed { rx, seen: OnceLock::new() });
        self.state = State::Computing { committed, rx };
    }

    /// Where the grammar stands after the latest committed token (waits for the commit if it is
    /// still running on the mask pool).
    pub fn outcome(&self) -> GrammarOutcome {
        match &self.state {
            State::Ready(..) | State::Computing { committed: None, .. } => GrammarOutcome::Continue,
            State::Computing { committed: Some(c), .. } => c.outcome().clone(),
            State::Done => GrammarOutcome::Complete,
            State::Failed(e) => GrammarOutcome::Failed(e.clone()),
        }
    }
}

/// Commits the token (if any) and computes the next mask on the mask pool. The mask (or the end)
/// comes on the first receiver; where a token is committed, its outcome comes first on the second.
fn spawn_mask(source: MatcherSource, eos_ids: Arc<[u32]>) -> (Receiver<Computed>, Option<Receiver<GrammarOutcome>>) {
    let (tx, rx) = bounded(1);
    let (token, outcome) = match &source {
        MatcherSource::Owned(_, Some(t)) => {
            let (otx, orx) = bounded(1);
            (Some((*t, otx)), Some(orx))
        }
        _ => (None, None),
    };
    mask_pool::spawn(move || {
        let t0 = Instant::now();
        let mut matcher = match source {
            MatcherSource::Owned(m, _) => m,
            MatcherSource::Fresh(grammar) => Box::new(grammar.start()),
        };
        // The sequence may be gone (aborted) by now: nobody to tell, so sends may fail.
        if let Some((token, otx)) = token {
            let next = match matcher.consume_token(token) {
                Err(e) => Some(Next::Failed(e.to_string())),
                Ok(()) if matcher.is_stopped() => Some(Next::Complete),
                Ok(()) => None,
            };
            let outcome = match &next {
                Some(Next::Failed(e)) => GrammarOutcome::Failed(format!("grammar: {e}")),
                Some(_) => GrammarOutcome::Complete,
                None => GrammarOutcome::Continue,
            };
            let _ = otx.send(outcome);
            if let Some(next) = next {
                let _ = tx.send(Computed { matcher, next });
                return;
            }
        }
        let next = Next::Mask(compute_packed(&mut matcher, &eos_ids));
        record_task_time(t0.elapsed());
        let _ = tx.send(Computed { matcher, next });
    });
    (rx, outcome)
}

/// Mask tasks run so far and their total time (commit and mask, on the mask threads): for
/// `bench --json-schema`, whose per-mask cost on one core predicts the time on more cores.
static TASKS: AtomicU64 = AtomicU64::new(0);
static TASK_NANOS: AtomicU64 = AtomicU64::new(0);

fn record_task_time(d: Duration) {
    TASKS.fetch_add(1, Ordering::Relaxed);
    TASK_NANOS.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// (mask tasks completed, their summed time) since the process started.
pub fn mask_task_totals() -> (u64, Duration) {
    (TASKS.load(Ordering::Relaxed), Duration::from_nanos(TASK_NANOS.load(Ordering::Relaxed)))
}

/// The matcher's next mask, packed (see [`pack_mask`]).
fn compute_packed(matcher: &mut Matcher, eos_ids: &[u32]) -> Result<Vec<u32>, String> {
    matcher.compute_mask().map(|mask| pack_mask(mask, eos_ids)).map_err(|e| e.to_string())
}

/// llguidance's mask as words of 32 token bits (its own storage, taken over: no copy): bits past
/// the grammar's vocabulary cleared, and every one of the model's end ids allowed where the grammar
/// allows its one end id.
fn pack_mask(mask: SimpleVob, eos_ids: &[u32]) -> Vec<u32> {
    let bits = mask.len();
    // The grammar sees one end id; the model may have several: all of them end it.
    let ends = eos_ids.first().is_some_and(|&e| (e as usize) < bits && mask.is_allowed(e));
    let grammar_words = bits.div_ceil(32);
    let eos_words = eos_ids.iter().map(|&e| e as usize / 32 + 1).max().unwrap_or(0);
    let mut words = Vec::<u32>::from(mask);
    words.truncate(grammar_words);
    words.resize(grammar_words.max(eos_words), 0);
    if !bits.is_multiple_of(32) {
        if let Some(last) = words.get_mut(bits / 32) {
            *last &= (1u32 << (bits % 32)) - 1;
        }
    }
    if ends {
        for &e in eos_ids {
            if let Some(w) = words.get_mut(e as usize / 32) {
                *w |= 1 << (e % 32);
            }
        }
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vob(size: usize, allowed: &[u32]) -> SimpleVob {
        let mut v = SimpleVob::alloc(size);
        for &t in allowed {
            v.allow_token(t);
        }
        v
    }

    #[test]
    fn packed_masks_keep_the_vocabulary_and_allow_every_end_id_with_the_grammars() {
        // 70 tokens: three words, the last one holding 6 tokens.
        assert_eq!(pack_mask(vob(70, &[0, 33, 69]), &[5, 64]), vec![1, 2, 1 << 5]);
        // The grammar's end id (5) allowed: every end id is.
        assert_eq!(pack_mask(vob(70, &[5, 33]), &[5, 64]), vec![1 << 5, 2, 1]);
        // An end id past the grammar's vocabulary still gets its word.
        assert_eq!(pack_mask(vob(40, &[5]), &[5, 100]), vec![1 << 5, 0, 0, 1 << 4]);
        // Bits set past the vocabulary (llguidance's words are whole) are cleared.
        let mut narrow = SimpleVob::alloc_with_capacity(41, 64);
        for t in [39, 40, 63] {
            narrow.allow_token(t);
        }
        assert_eq!(pack_mask(narrow, &[5]), vec![0, (1 << 7) | (1 << 8)]);
    }
}
